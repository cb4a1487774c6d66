"""Stage verdicts: the file a gated stage writes before it stops, and the statuses it may stop a round with.

Every gated stage writes ``runs/round-NN/<stage>/verdict.json`` with ``write_verdict`` before it raises
(so papermill stops); the round runner (``hermes_lab.round``) reads it back with ``read_verdict``, never
an exception's name::

    {"stage": "review", "gates": [{"gate": "review_agreement", "passed": false, "detail": "..."}],
     "stop": "awaiting review", "written_at": "..."}

``stop`` is null when the round may go on, else one of the statuses below (the round's status). The
runner deletes the verdict before it runs the stage, so a verdict it reads was written by this execution;
a failed notebook without a stopping verdict is a failure, whatever exception it raised. Here, at
the bottom of the house, because every stage writes one and the registry that reads them
(``hermes_lab.round.stages``) sits above every stage.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from hermes_lab.core.jsonl import write_json_atomic
from hermes_lab.core.layout import VERDICT as VERDICT_NAME
from hermes_lab.core.reports import JsonReport

# the statuses a stage's verdict may stop a round with
STOP_DATA = "skipped: data gate"
STOP_NO_SIGNAL = "stopped: no learning signal"  # every conversation of a task paid the same (hermes_lab.prep.signal)
STOP_AWAITING_REVIEW = "awaiting review"
STOP_BLOCKED_REVIEW = "blocked: reward model disagrees with reviewers"
STOP_HEALTH = "stopped: training health"
STOP_REGRESSION = "stopped: regression gate"
STOP_AUDIT = "blocked: reward audit"  # a reward paid an adversarial completion (hermes_lab.rewards.audit)
STOP_AWAITING_LIVE = "awaiting live A/B"  # ab.mode live: the gateway has not decided the rollout yet
WAITING = (STOP_AWAITING_REVIEW, STOP_AWAITING_LIVE)  # the same round continues (--resume) after these


# ------------------------------------------------------------------------------------------ verdicts
@dataclass
class Verdict(JsonReport):
    """A stage's verdict.json. ``extra`` is what a stage adds (``candidate``, ``adapter``, ``eval``, ``plan``,
    ``mlflow_run_id``), written after the four keys in its order, so a file reads back to the same bytes."""

    stage: str | None = None
    gates: list[dict[str, Any]] | None = None
    stop: str | None = None
    written_at: str | None = None

    def write(self, stage_dir: str | Path) -> Path:  # type: ignore[override]
        """``<stage_dir>/verdict.json``, atomically."""
        return write_json_atomic(Path(stage_dir) / VERDICT_NAME, self.to_json())


def gate(name: str, passed: bool | None, detail: str) -> dict[str, Any]:
    return {"gate": name, "passed": passed, "detail": detail}


def write_verdict(
    stage_dir: str | Path, stage_name: str, gates: list[dict[str, Any]], stop: str | None = None, **extra: Any
) -> Path:
    """Write ``<stage_dir>/verdict.json`` atomically (the round runner reads it back)."""
    return Verdict(stage_name, gates, stop, datetime.now(timezone.utc).isoformat(), extra=extra).write(stage_dir)


def read_verdict(path: str | Path) -> dict[str, Any] | None:
    """A verdict as its JSON object (``Verdict.read`` for the dataclass), or None when there is none."""
    v = Verdict.read(path)
    return v.to_json() if v is not None else None
