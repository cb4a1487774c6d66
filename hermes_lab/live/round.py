"""Rounds on live traffic: the A/B stage run live by the gateway (``ab.mode: live``).

The round runner runs it through the stage registry like any other: the A/B notebook calls ``notebook_run``
here in live mode (``hermes_lab.ab.run.notebook_run`` otherwise). A live round's *data* (``execute.source:
live``) is read from the previous experiment's log by ``hermes_lab.logs.gateway``.

A/B, live: the stage prepares the round's experiment in ``runs/live/round-NN/`` (``serve.log_dir`` set: that
dir, to attach to a gateway already running there): baseline the policy the regression gate compared
against, candidate this round's adapter, the plan of ``ab.stages``. The round then stops as "awaiting live
A/B" until the gateway has decided; ``hermes-lab serve --params P --log-dir runs/live/round-NN`` serves it
(the arms come from the experiment), the agent's traffic and feedback drive it, ``hermes-lab status`` says
which stage it is in and what it waits for, and ``hermes-lab round --resume`` continues the round. Once the
rollout ended, its ``ab_report.json`` (``hermes_lab.live.report``: ab-run's schema) becomes the round's
``runs/round-NN/ab/ab_report.json``; the champion moves only when the rollout reached 100% (``promoted``).

    hermes-lab round --params params/live.yaml            # ... stops at ab: awaiting live A/B
    hermes-lab serve --params params/live.yaml --log-dir runs/live/round-01   # + the agent's traffic
    hermes-lab round --params params/live.yaml --resume   # the live decision, then compare
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from hermes_lab.config.schema import HermesConfig
from hermes_lab.core.layout import RoundLayout, RunsLayout, TrainLayout
from hermes_lab.core.verdict import STOP_AWAITING_LIVE, gate, write_verdict
from hermes_lab.live import log as L
from hermes_lab.live.report import FAM_NAMES
from hermes_lab.logs.gateway import gateway_trajectories

AWAITING = STOP_AWAITING_LIVE


class LiveABPending(Exception):
    """The round's live rollout is not decided yet: the round stops here and continues with --resume."""


# ------------------------------------------------------------------------------------------- the A/B stage
def experiment_dir(cfg: HermesConfig, round_dir: str | os.PathLike[str]) -> Path:
    return (
        Path(cfg.serve.log_dir)
        if cfg.serve.log_dir
        else RunsLayout(cfg.round.runs_dir).experiment(Path(round_dir).name).root
    )


def prepare(cfg: HermesConfig, round_dir: str | os.PathLike[str], baseline: str, candidate: str) -> dict[str, Any]:
    """The round's live experiment: created for its arms, or (created before, by the round or a gateway
    started first) checked to be the same experiment. Returns its state."""
    from hermes_lab.live import experiment as X
    from hermes_lab.live.arms import ARMS, resolve_arm

    log_dir = experiment_dir(cfg, round_dir)
    if cfg.serve.candidate.startswith(("http://", "https://")):
        # a hosted API cannot load the round's adapter: the operator deploys it and names the model id it
        # serves (serve.candidate_model, read from the params file the round runs with)
        candidate = cfg.serve.candidate
    specs = {"baseline": resolve_arm(cfg, "baseline", baseline), "candidate": resolve_arm(cfg, "candidate", candidate)}
    stages, ratio = X.live_stages(cfg, log_dir)
    ident = X.experiment_ident(cfg, {n: specs[n].describe() for n in ARMS}, Path(round_dir).name)
    fresh = L.load_experiment(log_dir) is None
    return X.open_experiment(
        log_dir, ident, stages, ratio, arm_specs=X.arm_specs(specs) if fresh else None, restart=False
    )


def status_line(cfg: HermesConfig, log_dir: str | os.PathLike[str]) -> str | None:
    """``ab: live stage 2 (30%) since 14:05, next look in 7 min, waiting for ...`` of a log dir, or None."""
    from hermes_lab.live import experiment as X

    state = L.load_experiment(log_dir)
    if state is None:
        return None
    return X.LiveRollout(cfg, state, log_dir, L.Tally(), say=lambda _: None).status_line()


def arm_spec(path: str) -> str:
    """A train output's adapter as its train dir (the gateway then takes the base from its run.json)."""
    a = Path(path)
    return str(a.parent) if a == TrainLayout(a.parent).adapter and TrainLayout(a.parent).run.is_file() else path


def baseline_spec(cfg: HermesConfig, explicit: str = "") -> str:
    """The live baseline as an arm spec: the policy the regression gate compared against (champion, else
    model.adapter, else the bare base; ``policy.arms.resolve_baseline``)."""
    from hermes_lab.policy.arms import resolve_baseline

    if explicit:
        return arm_spec(explicit)
    base, adapter = resolve_baseline(cfg)
    return arm_spec(adapter) if adapter else base


def notebook_run(
    cfg: HermesConfig,
    round_dir: str | os.PathLike[str],
    parent_run_id: str = "",
    baseline: str = "",
    candidate: str = "",
) -> dict[str, Any]:
    """What 40_ab_analysis.ipynb does with ``ab.mode: live``: the gateway's decided rollout as the round's A/B
    (``LiveABPending`` while it decides: the round stops), in the result shape of ``ab.run.notebook_run``."""
    from hermes_lab.ab.report import log_to_mlflow, write_ab_verdict
    from hermes_lab.core import tracking

    out = RoundLayout(round_dir).ab
    with tracking.stage_run("ab", parent_run_id or None, cfg.round.runs_dir, cfg.round.experiment):
        report, cols = ab_stage(cfg, round_dir, baseline, candidate)
        write_ab_verdict(report, out.root)
        log_to_mlflow(cfg, report, out.report, Path(report["log"]))
    plots = [Path(p) for p in report["plots"]]
    return {"report": report, "cols": cols, "families": FAM_NAMES, "plots": plots, "report_path": out.report}


def ab_stage(
    cfg: HermesConfig, round_dir: str | os.PathLike[str], baseline: str = "", candidate: str = ""
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The live A/B stage: (the decided rollout's report, written as the round's ``ab/ab_report.json`` with
    its plots, and the rewarded requests' columns), or ``LiveABPending`` while the gateway decides."""
    from hermes_lab.live.report import write_live_report

    candidate = arm_spec(candidate or str(RoundLayout(round_dir).train.root))
    state = prepare(cfg, round_dir, baseline_spec(cfg, baseline), candidate)
    ab_dir = RoundLayout(round_dir).ab
    log_dir, out = experiment_dir(cfg, round_dir), ab_dir.root
    if state["status"] == "running":
        where = status_line(cfg, log_dir)
        msg = (
            f"{AWAITING}: {where}. Serve it: hermes-lab serve --params {cfg.source or '<params>'} --log-dir {log_dir} "
            "(and the agent's traffic), then: hermes-lab round --resume"
        )
        write_verdict(out, "ab", [gate("ab_decision", None, msg)], stop=AWAITING)  # the round stops, resumable
        raise LiveABPending(msg)
    # the traffic as trajectories: the next round's fuel, and its negatives on a roll back (stages.py)
    info = gateway_trajectories(log_dir, ab_dir.live, cfg)
    shutil.copyfile(info["trajectories"], ab_dir.live_trajectories)
    # rebuilt from the log dir alone: the same decisions the gateway took, in the round's ab/
    return write_live_report(cfg, log_dir, out)
