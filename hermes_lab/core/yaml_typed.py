"""Typed YAML: ``${VAR}`` interpolation, values coerced to dataclass field types, every bad key collected.

The machinery under ``hermes_lab.config.schema`` (which holds the fields and every check of their values);
reads the one YAML file it is given, writes nothing.

- ``${VAR}`` and ``${VAR:-default}`` are filled from the environment, outside YAML comments; a missing
  variable is an error naming the variable, the key and the file line;
- a value is coerced to its field's type: bool, int, float, str, ``Literal[...]`` (one of its values),
  ``list[X]``, ``X | None``; a nested dataclass is a section;
- an unknown key names the valid keys of its section; every problem is collected, not just the first;
- a field declared with ``field_with(default, help, ge=.., gt=.., le=.., lt=..)`` carries its bounds,
  which ``bound_problems`` checks.

    from hermes_lab.core.yaml_typed import read_yaml, build
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Collection
from dataclasses import field
from pathlib import Path
from typing import Any, Literal, get_args, get_origin, get_type_hints

import yaml


class ConfigError(ValueError):
    """A config problem, phrased so the user can fix it from the message alone. ``problems``: all of them."""

    def __init__(self, message: str, problems: list[str] | None = None):
        super().__init__(message)
        self.problems = problems or [message]


def field_with(
    default: Any = dataclasses.MISSING,
    help: str = "",
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    why: str = "",
) -> Any:
    """A dataclass field with its help text and the bounds its value (or each list element) must meet
    (checked by ``bound_problems``); ``why`` is said with a bound's error."""
    meta = {"help": help, "bounds": (ge, gt, le, lt), "why": why}
    if isinstance(default, (list, dict)):
        value = default
        return field(default_factory=lambda: type(value)(value), metadata=meta)
    return field(default=default, metadata=meta)


def bound_problems(sec: str, obj: Any) -> list[str]:
    """One problem per field of ``obj`` (a section named ``sec``) whose value is out of its bounds."""
    out = []
    for f in dataclasses.fields(obj):
        ge, gt, le, lt = f.metadata.get("bounds", (None,) * 4)
        value = getattr(obj, f.name)
        for v in value if isinstance(value, list) else [value]:
            if not isinstance(v, (int, float)) or isinstance(v, bool):
                continue
            bad = [
                f"{op} {b:g}"
                for op, b, ok in (
                    (">=", ge, ge is None or v >= ge),
                    (">", gt, gt is None or v > gt),
                    ("<=", le, le is None or v <= le),
                    ("<", lt, lt is None or v < lt),
                )
                if not ok
            ]
            if bad:
                why = f" ({f.metadata['why']})" if f.metadata.get("why") else ""
                out.append(f"{sec}.{f.name} must be {' and '.join(bad)}{why}, got {v}")
                break
    return out


def read_yaml(
    path: str | os.PathLike[str] | None, env: dict[str, str], overrides: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The mapping of a YAML file (``{}`` for no file), interpolated, with dotted ``overrides`` applied."""
    raw: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        text = interpolate(p.read_text(encoding="utf-8"), str(p), env)
        try:
            raw = yaml.safe_load(text) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{p}: not valid YAML: {e}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{p}: the top level must be a mapping of sections")
    for dotted, value in (overrides or {}).items():
        sec, _, key = dotted.partition(".")
        if not key:
            raise ConfigError(f"override '{dotted}': use section.key")
        if not isinstance(raw.get(sec), dict):
            raw[sec] = {}
        raw[sec][key] = value
    return raw


_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")
_COMMENT = re.compile(r"(?:^|\s)#")


def interpolate(text: str, source: str, env: dict[str, str]) -> str:
    lines = text.splitlines(keepends=True)
    for i, line in enumerate(lines):
        # comments may mention ${VAR}: only the part before a YAML comment ('#' at the line start or after
        # whitespace, a tab included) is interpolated
        m_comment = _COMMENT.search(line)
        cut = m_comment.start() if m_comment else len(line)
        code, comment = line[:cut], line[cut:]

        def sub(m: re.Match[str], code: str = code, i: int = i) -> str:
            name, default = m.group(1), m.group(2)
            if name in env and env[name] != "":
                return env[name]
            if default is not None:
                return default
            key = code.split(":", 1)[0].strip() or "?"
            raise ConfigError(
                f"{source}:{i + 1}: environment variable {name} is not set (used by key '{key}'). "
                f"Set it, e.g. `export {name}=...`, or write ${{{name}:-default}}."
            )

        lines[i] = _VAR.sub(sub, code) + comment
    return "".join(lines)


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp)).replace("typing.", "")


def coerce(value: Any, tp: Any, where: str) -> Any:
    origin, args = get_origin(tp), get_args(tp)
    if value is None:
        if type(None) in args:
            return None
        raise ConfigError(f"{where}: must not be empty (expected {_type_name(tp)})")
    if args and type(None) in args:  # Optional[X]
        (inner,) = [a for a in args if a is not type(None)]
        return coerce(value, inner, where)
    if origin is Literal:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool) and str(value) in args:
            return str(value)
        raise ConfigError(f"{where}: must be one of {', '.join(args)}; got {value!r}")
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        return [coerce(v, args[0], f"{where}[{j}]") for j, v in enumerate(value)]
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in {"true", "false", "1", "0", "yes", "no"}:
            return value.lower() in {"true", "1", "yes"}
        raise ConfigError(f"{where}: expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, bool) or not (
            isinstance(value, int) or (isinstance(value, str) and value.strip().lstrip("-").isdigit())
        ):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return int(value)
    if tp is float:
        try:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: expected a number, got {value!r}") from None
    if tp is str:
        if isinstance(value, (dict, list)):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return str(value)
    return value


def build(cls: type, raw: Any, where: str, problems: list[str], skip: Collection[str] = ()) -> Any:
    """The dataclass from a mapping; each bad key is a problem (and keeps its default), all are collected.
    ``skip``: fields of ``cls`` itself that are no keys (a section's own fields may reuse their names)."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        problems.append(f"{where}: expected a mapping of keys, got {raw!r}")
        return cls()
    hints = get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.name not in skip]
    for k in raw:
        if k not in names:
            problems.append(f"{where or 'top level'}: unknown key '{k}'. Valid keys: {', '.join(names)}")
    kwargs = {}
    for k, v in raw.items():
        if k not in names:
            continue
        tp, key_where = hints[k], f"{where}.{k}" if where else k
        try:
            kwargs[k] = build(tp, v, key_where, problems) if dataclasses.is_dataclass(tp) else coerce(v, tp, key_where)
        except ConfigError as e:
            problems.append(str(e))
    return cls(**kwargs)
