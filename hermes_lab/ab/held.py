"""A held experiment, continued: the A/B of a round whose stage reached its hard end undecided, carried on.

Stage: validate (A/B). Reads an earlier round's ``runs/round-NN/ab/`` (``ab_report.json``: the held stage,
the experiment's settings, the covariates' history sources; ``requests.jsonl``: the held stage's rows);
writes nothing (``hermes_lab.ab.run`` writes the continued rollout's files in the new round's ``ab/``). The
round runner starts such a round when ``round.on_held: continue`` (``hermes_lab.round.runner``):

    hermes-lab ab-run --params params/embedded.yaml --baseline champion --candidate runs/round-04/train \\
        --continue-from runs/round-04/ab --output runs/round-05/ab/ab_report.json

Why continuing keeps the guarantee: a confidence sequence is valid at every look however many there are,
so more looks on the *same* sequence are free. "Same" is the point: the continued stage keeps everything
that shaped the earlier looks (the experiment's ``ab`` settings, its salt and rate, the bets tuned for the
stage's original ``tune_n``, its look grid, the covariates and the very history logs they were built
from); only its hard end moves out (``Stage.continued``, by another stage length with extension), and new
requests (new ids, so new units) join the stage's kept rows. Re-tuning the bets or rebuilding the history
after seeing the undecided interval would choose the test on its own data.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hermes_lab.ab import stats as ab
from hermes_lab.config.gates import ABSection
from hermes_lab.core.command import CommandError
from hermes_lab.core.jsonl import iter_objects
from hermes_lab.core.layout import AB_REPORT, REQUESTS

REPORT, LOG = AB_REPORT, REQUESTS  # a held A/B's folder: round-NN/ab/ or a live log dir (core.layout)


class HeldError(CommandError):
    """The folder names no held experiment that can be continued (a command's exit 2, one line)."""


@dataclass
class Held:
    """What a continued rollout starts from."""

    ab: ABSection  # the held experiment's own settings (its planned rate, stages, salt, covariates ...)
    stage_list: list[list[float]]
    stage: ab.Stage  # the held stage, its hard end moved out by ``added``
    rows: list[dict[str, Any]]  # the held stage's requests, in log order
    history: list[str]  # the covariates' history logs the held experiment used (the same again)
    plan: dict[str, Any] | None
    source: Path
    added: float

    def describe(self) -> dict[str, Any]:
        """What ab_report.json says about the continuation."""
        return {
            "from": str(self.source),
            "stage": self.stage.index,
            "ratio": self.stage.ratio,
            "since": self.stage.hard_end - self.added,
            "added_seconds": self.added,
            "rows_kept": len(self.rows),
        }


def load_held(ab_dir: str | Path) -> Held:
    """The held experiment of ``ab_dir`` (an earlier round's ``ab/``), ready to continue. Raises HeldError when
    its rollout did not end undecided at a stage's hard end, or was itself a continuation."""
    d = Path(ab_dir)
    rep_path, log_path = d / REPORT, d / LOG
    if not rep_path.is_file() or not log_path.is_file():
        raise HeldError(f"{d}: no {REPORT} and {LOG} to continue")
    report = json.loads(rep_path.read_text(encoding="utf-8"))
    held = report.get("held")
    if not held:
        raise HeldError(f"{rep_path}: the rollout ended '{report.get('decision')}', not undecided at a hard end")
    if report.get("continued"):
        raise HeldError(f"{rep_path}: a continued experiment is not continued twice")
    fields = {f.name for f in dataclasses.fields(ABSection)} - {"plan_power", "mode"}  # its rate is planned
    kept = {k: v for k, v in (report.get("config") or {}).items() if k in fields}
    settings = dataclasses.replace(ABSection(), **kept, plan_power=0.0)
    stage_list = [[float(x) for x in s] for s in report["stages_planned"]]
    res = next(s for s in report["stages"] if s["index"] == held["stage"])
    planned = ab.plan_stages(stage_list, settings.request_rate, settings.look_every, settings.max_extension)
    base = next(s for s in planned if s.index == held["stage"])
    added = base.seconds * (1 + base.max_extension)  # another stage length with its extension
    stage = dataclasses.replace(base, start=float(res["start"]), continued=added)
    rows = [r for _, r in iter_objects(log_path) if int(r.get("stage", -1)) == stage.index]
    cov = report.get("covariates") or {}
    history = list(((cov.get("history") or {}).get("sources")) or [])
    return Held(settings, stage_list, stage, rows, history, report.get("plan"), d, added)
