"""Where the project is: relative paths of configs and notebooks resolve against the project root.

Foundation, used by every stage; reads and writes nothing itself. Without it, ``runs/`` would be
wherever the current directory happens to be: JupyterLab starts a notebook's kernel in ``notebooks/``,
a shell may sit anywhere, and the two would split one project's rounds, label store, state file and
MLflow store in two.

The project root is, in this order:
1. ``$HERMES_LAB_ROOT`` when set (an explicit choice always wins);
2. the nearest ancestor of the current directory (itself included) that looks like the project: it
   holds ``params/`` and ``notebooks/``, or a ``pyproject.toml`` naming hermes-lab;
3. the checkout holding this package (an editable install: ``hermes_lab/..``), if it looks like the project;
4. the current directory.

What resolves against the root: ``round.runs_dir`` and the other path-valued config fields (at load time,
``hermes_lab.config.schema``), the config file itself when it is not found relative to the current directory,
the notebooks' path parameters (``resolve_params``) and the defaults under ``runs/``. Paths a user types
on a command line (``--input ./x.jsonl``) keep the shell's convention: relative to the current directory.

    HERMES_LAB_ROOT=/srv/hermes-lab hermes-lab status      # a project elsewhere

The machine's cache, shared by every project on it (``machine_cache``): ``$HERMES_LAB_CACHE`` ("off" or empty:
none), else ``$XDG_CACHE_HOME/hermes-lab``, else ``~/.cache/hermes-lab``. It holds what depends on the
machine's packages and not on a project: built tiny policies (``policies/``), configs TRL and PEFT accepted
(``checked-configs/``, the round runner) and an empty migrated MLflow store (``mlflow/``, ``core.tracking``).
"""

from __future__ import annotations

import os
import re
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

from hermes_lab.core.inputs import KINDS, PATH, PATHS, SPEC

ENV_ROOT = "HERMES_LAB_ROOT"
PACKAGE_REPO = Path(__file__).resolve().parents[2]  # hermes_lab/core/paths.py -> the checkout
_NAME = re.compile(r"""^\s*name\s*=\s*["']hermes[-_]lab["']""", re.M)

_RUN_ID = re.compile(r"^[0-9a-f]{32}$")


def machine_cache(name: str) -> Path | None:
    """The folder ``name`` of the machine's cache (the module docstring), or None where the cache is off."""
    env = os.environ.get("HERMES_LAB_CACHE")
    if env is not None:
        return None if env.strip() in ("", "off", "0") else Path(env).expanduser() / name
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "hermes-lab" / name


def looks_like_project(d: Path) -> bool:
    """A hermes-lab checkout: params/ and notebooks/ side by side, or a pyproject.toml naming hermes-lab."""
    if (d / "params").is_dir() and (d / "notebooks").is_dir():
        return True
    pp = d / "pyproject.toml"
    try:
        return pp.is_file() and bool(_NAME.search(pp.read_text(encoding="utf-8", errors="replace")))
    except OSError:
        return False


def project_root() -> Path:
    """The project root (see the module docstring for the order). Computed afresh: the cwd may change."""
    env = os.environ.get(ENV_ROOT, "").strip()
    if env:
        return Path(os.path.abspath(os.path.expanduser(env)))
    cwd = Path.cwd()
    for d in (cwd, *cwd.parents):
        if looks_like_project(d):
            return d
    if looks_like_project(PACKAGE_REPO):
        return PACKAGE_REPO
    return cwd


def resolve(p: str | os.PathLike[str], root: Path | None = None) -> Path:
    """An absolute path: ``p`` unchanged when absolute (``~`` expanded), else ``project_root() / p``."""
    q = Path(os.path.expanduser(os.fspath(p)))
    if q.is_absolute():
        return q
    return Path(os.path.normpath((root or project_root()) / q))


def config_file(path: str | os.PathLike[str]) -> Path:
    """A config file as a user names it: relative to the cwd if it is there, else to the project root.
    Returns the absolute path found (or the cwd-relative one, absolute, when it is nowhere)."""
    q = Path(os.path.expanduser(os.fspath(path)))
    here = Path(os.path.abspath(q))
    if q.is_absolute() or here.is_file():
        return here
    there = resolve(q)
    return there if there.is_file() else here


def is_local_spec(spec: str, root: Path | None = None) -> bool:
    """Whether a policy spec (``model.base_model``, an adapter parameter) names a local path rather than a
    hub id or a keyword: it starts with ./ ../ / or ~, or exists under the project root."""
    if not spec or spec == "champion" or ":" in spec:  # embedded:tiny, s3://..., C:\... never a project path
        return False
    if spec.startswith(("./", "../", "/", "~")) or spec in (".", ".."):
        return True
    return resolve(spec, root).exists()


def resolve_spec(spec: str, root: Path | None = None) -> str:
    """A policy spec with a local relative path made absolute against the root; anything else unchanged."""
    return str(resolve(spec, root)) if is_local_spec(spec, root) else spec


def resolve_params(ns: MutableMapping[str, Any]) -> dict[str, str]:
    """Make a notebook's path parameters absolute against the project root, in place (pass ``globals()``).

    The kernel's cwd is notebooks/ under JupyterLab and the repo root under papermill; parameters are
    written relative to the root (``config_path = "params/embedded.yaml"``), so they resolve the same in
    both. Empty strings stay empty (they mean "the default"). Returns the names that changed -> new value.
    """
    root = project_root()
    changed: dict[str, str] = {}

    def put(name: str, value: str) -> None:
        if value != ns[name]:
            ns[name] = changed[name] = value

    # which parameters hold paths: their declaration (hermes_lab.core.inputs) says, by name. A list's entry
    # that is an MLflow run id stays as it is; a policy spec may be a hub id / embedded:tiny / champion
    for name, kind in KINDS.items():
        value = ns.get(name)
        if not isinstance(value, str) or not value:
            continue
        if kind == PATH:
            put(name, str(resolve(value, root)))
        elif kind == PATHS and value.strip():
            items = [s.strip() for s in value.split(",") if s.strip()]
            put(name, ",".join(s if _RUN_ID.match(s) else str(resolve(s, root)) for s in items))
        elif kind == SPEC:
            put(name, resolve_spec(value, root))
    return changed
