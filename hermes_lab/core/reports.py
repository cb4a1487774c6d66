"""The shapes of two round files: train's held-out eval (``round-NN/train/eval.json``) and the round's
summary (``round-NN/summary.json``), as dataclasses that read and write their JSON.

``train.grpo`` writes ``EvalReport``; ``round.outcome`` writes ``RoundSummary``; compare, status, the
supervisor, the A/B plan and the round registry read them back (paths: ``core.layout``; a stage's verdict:
``core.verdict.Verdict``). The JSON keeps its keys and their order, so a file written before these classes
existed reads back and writes again to the same bytes; a key the class does not know (an older or newer run)
is kept in ``extra`` and written back after the known ones. Reads and writes only the file it is given.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from hermes_lab.core.jsonl import write_json_atomic

_T = TypeVar("_T", bound="JsonReport")


@dataclass
class JsonReport:
    """A JSON object file as a dataclass (these two and ``core.verdict.Verdict``): known keys as fields (in file
    order), the rest in ``extra``. A field left None whose key the file did
    not have is not written (``_optional``), so an older file round-trips."""

    extra: dict[str, Any] = field(default_factory=dict, kw_only=True)
    _missing: tuple[str, ...] = field(default=(), kw_only=True, repr=False, compare=False)

    _optional: ClassVar[tuple[str, ...]] = ()  # keys written only when set

    @classmethod
    def _keys(cls) -> list[str]:
        return [f.name for f in fields(cls) if f.name not in ("extra", "_missing")]

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k in self._keys():
            v = getattr(self, k)
            if (k in self._missing or k in self._optional) and v is None:
                continue
            out[k] = v
        return {**out, **self.extra}

    @classmethod
    def from_json(cls: type[_T], data: dict[str, Any]) -> _T:
        if not isinstance(data, dict):
            raise ValueError(f"{cls.__name__}: a JSON object expected, got {type(data).__name__}")
        keys = cls._keys()
        missing = tuple(k for k in keys if k not in data and k not in cls._optional)
        kw = {k: data.get(k) for k in keys}
        return cls(**kw, extra={k: v for k, v in data.items() if k not in keys}, _missing=missing)

    @classmethod
    def read(cls: type[_T], path: str | Path) -> _T | None:
        """The file's report, None when it is missing or unreadable (a half-written file of a killed writer)."""
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        return cls.from_json(data) if isinstance(data, dict) else None

    def write(self, path: str | Path) -> Path:
        return write_json_atomic(path, self.to_json())


@dataclass
class EvalReport(JsonReport):
    """``train/eval.json``: the held-out sampled pass rate before and after training (``policy.model.evaluate``
    results), the paired gain (``policy.model.paired_gain``), and with the embedded agent family its held-out
    episode success before and after (``agent``)."""

    before: dict[str, Any] | None = None
    after: dict[str, Any] | None = None
    gain_points: float | None = None
    gain: dict[str, Any] | None = None
    agent: dict[str, Any] | None = None

    _optional = ("agent",)


@dataclass
class RoundSummary(JsonReport):
    """``round-NN/summary.json``: the round's status, every gate, timings, the champion and the A/B outcome."""

    round: int | None = None
    status: str | None = None
    decision: str | None = None
    promoted: bool | None = None
    gates: list[dict[str, Any]] | None = None
    timings_s: dict[str, float] | None = None
    total_s: float | None = None
    pass_rate: float | None = None
    eval: dict[str, Any] | None = None
    champion: str | None = None
    stopped_at: dict[str, Any] | None = None
    parent_run_id: str | None = None
    ab: dict[str, Any] | None = None
    held: dict[str, Any] | None = None
    continues: int | None = None
    ab_plan: str | None = None
    agent_played: dict[str, Any] | None = None  # validate's agent family played by the real Hermes Agent
