"""The live rollout's report: ``ab_report.json`` and plots of a gateway log dir, in ab-run's schema.

Stage: validate (live A/B). Reads ``<log_dir>/requests.jsonl``, ``feedback.jsonl`` and ``experiment.json``;
writes ``<log_dir>/ab_report.json`` (atomically) and ``<log_dir>/plots/*.png``. The gateway writes it when
its rollout ends; ``hermes-lab serve --report DIR`` writes it at any time (a running experiment: its decided
stages and the current one up to its latest look).

    hermes-lab serve --report runs/live/tiny-vs-round-01 --params params/embedded.yaml

The analysis and the report are ab-run's (``ab.analysis.analyse_log``, ``ab.report.build_report``,
``ab.report.make_plots``), so the user's fields (delta, p_value, significant) and the decision sit where
they do in ab-run's report.
Each stage is analysed on what the gateway knew at the look that ended it (its requests complete by then,
the rewards whose feedback had arrived: ``Tally.columns(known_by=...)``), so the report re-derives the
decisions the gateway took. Live fields on top: ``mode: live``, ``time_scale`` (and a reason line saying
the clock ran faster), ``status``, ``looks`` (every look's decision), ``stage_starts``, ``experiment``.
"""

from __future__ import annotations

import os
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from hermes_lab.ab import analysis as ab_analysis
from hermes_lab.ab import rollout as ab_rollout
from hermes_lab.ab import stats as ab
from hermes_lab.config.schema import HermesConfig
from hermes_lab.core.jsonl import write_json_atomic
from hermes_lab.core.layout import AB_REPORT, ExperimentLayout
from hermes_lab.live import log as L
from hermes_lab.tasks import suite as T

REPORT = AB_REPORT  # in a live log dir, and the round's ab/ (core.layout)
FAM_NAMES = [*T.FAMILIES, "other"]


def _arm_name(d: dict[str, Any]) -> str:
    return str(d.get("model") or d.get("adapter") or d.get("base") or d.get("kind") or "?")


def stages_to_report(state: dict[str, Any], plan: list[ab.Stage]) -> list[tuple[ab.Stage, float]]:
    """(stage, the time its data ends) for every decided stage and the current one once it had a look."""
    out = []
    for r in state.get("stage_results", []):
        out.append((ab_rollout.start_stage(plan[r["index"]], r["start"]), float(r["until"])))
    i = int(state["stage"])
    looks = [lk["t"] for lk in state.get("looks", []) if lk["stage"] == i]
    if state.get("status") == "running" and i < len(plan) and looks:
        out.append((ab_rollout.start_stage(plan[i], float(state["stage_starts"][i])), float(max(looks))))
    return out


def build_live_report(cfg: HermesConfig, log_dir: str | os.PathLike[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the report, the analysed columns) of a gateway log dir."""
    from hermes_lab.ab.report import RunFacts, build_report

    log_dir = Path(log_dir)
    state = L.load_experiment(log_dir)
    if state is None:
        raise FileNotFoundError(f"{log_dir}: no {L.EXPERIMENT} (not a gateway log dir)")
    st = ab.Settings.from_config(cfg)
    a = cfg.ab
    stage_list = [list(map(float, s)) for s in state["stages"]]
    plan = ab.plan_stages(stage_list, a.request_rate, a.look_every, a.max_extension)
    covs = a.covariates if a.unit != "user" else ()  # the gateway's own decision rule, covariates and all
    tally = L.Tally.from_dir(log_dir, cfg.serve.feedback_source, families=True, covariates=covs)
    todo = stages_to_report(state, plan)
    parts = [tally.columns(s.index, until) for s, until in todo]
    keys = ("t", "stage", "arm", "reward", "error", "latency_ms", "family", "unit", *(("cell", "task") if covs else ()))
    cols = {k: np.concatenate([p[k] for p in parts]) if parts else tally.columns(-1)[k] for k in keys}
    if a.unit == "request":
        cols.pop("unit")
    analysis = ab_analysis.analyse_log(cols, [s for s, _ in todo], st, FAM_NAMES, {s.index: u for s, u in todo})
    K = float(state.get("time_scale", 1.0))
    ended = state.get("ended_at")
    wall = (datetime.fromisoformat(ended).timestamp() if ended else time.time()) - float(state["start_unix"])
    horizon = max((u for _, u in todo), default=0.0)
    running = state.get("status") == "running"
    facts = RunFacts(
        _arm_name(state["arms"]["baseline"]),
        _arm_name(state["arms"]["candidate"]),
        0,
        0,
        horizon,
        "running" if running else state.get("stopped_by"),
        log_dir / L.REQUESTS,
        None,
        wall,
    )
    report = build_report(cfg, analysis, stage_list, st, facts)
    if running:
        report["reasons"].insert(
            0, f"the experiment is still running (stage {state['stage'] + 1} of the plan): a report so far"
        )
    if K != 1:
        report["reasons"].append(
            f"clock: --time-scale {K:g}, the experiment clock ran {K:g} times faster than the wall clock "
            f"({horizon / 3600:.2f} experiment hours in {wall / 60:.1f} wall minutes)"
        )
    report.update(
        mode="live",
        time_scale=K,
        clock="experiment seconds = wall seconds since the start x time_scale (t, looks, stage starts)",
        experiment=state.get("experiment"),
        status=state.get("status"),
        arms=state.get("arms"),
        log_dir=str(log_dir),
        stage_starts=state.get("stage_starts"),
        looks=state.get("looks"),
        started=state.get("created"),
        ended=ended,
        restarts=state.get("restarts", 0),
        requests_logged=tally.n[0] + tally.n[1],
        covariates=tally.covariates.describe() if tally.covariates else None,
        conversations=tally.conversation_stats(),
        unrewarded_note="requests without feedback by a look: out of the reward's numbers, in the error and "
        "latency guardrails and SRM; failed requests: errors of their arm, reward 0",
    )
    report["simulated_seconds"] = None  # live: the experiment clock's span is in 'looks' and 'stage_starts'
    return report, cols


def write_live_report(
    cfg: HermesConfig,
    log_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str] | None = None,
    plots: bool = True,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Build the report of ``log_dir``, save its plots under ``<out_dir>/plots/`` and write
    ``<out_dir>/ab_report.json`` (``out_dir``: the log dir by default; a live round's ``ab/``). Returns the
    report and the rewarded requests' columns (the score plots')."""
    from hermes_lab.ab.report import make_plots

    out = Path(out_dir or log_dir)
    report, cols = build_live_report(cfg, log_dir)
    rw = np.isfinite(cols["reward"])  # score histograms: the rewarded requests
    scored = {k: v[rw] for k, v in cols.items()}
    report["plots"] = (
        [str(p) for p in make_plots(scored, report, ExperimentLayout(out).plots, FAM_NAMES)]
        if plots and rw.any()
        else []
    )
    write_json_atomic(out / REPORT, report)
    return report, scored


def report_cli(cfg: HermesConfig, log_dir: str | os.PathLike[str]) -> int:
    """``hermes-lab serve --report DIR``: write the report of a log dir and print its summary."""
    from hermes_lab.ab.report import summary

    rep, _ = write_live_report(cfg, log_dir)
    print(summary(rep))
    for arm, c in (rep.get("conversations") or {}).items():
        print(
            f"{arm:9s} {c['conversations']} conversations, {c['turns_per_conversation']} turns each, tool-call rate "
            f"{c['tool_call_rate']}, {c['tool_errors']} tool errors, {c['tokens']} tokens, p50 {c['latency_ms_p50']} ms"
        )
    print(f"status: {rep['status']}   report: {Path(log_dir) / REPORT}   plots: {len(rep['plots'])}")
    return 0
