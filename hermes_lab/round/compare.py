"""Stage 50, compare rounds: pass rates with intervals, gates, rewards, KL, A/B deltas and decisions across rounds.

Reads every ``runs/round-NN/`` that ran, and the MLflow store (``mlflow.search_runs`` for the round runs
and their nested stage runs, metric history for the per-step training curves); writes PNG plots under
``runs/round-NN/compare/`` (``pass_rate_by_round.png``, ``rounds.png``, ``curves_by_round.png``) and logs
them to the active MLflow run. Columns use the names MLflow has: ``gate:<gate>`` for every gate of the
stage registry, in round order, and ``<stage>/<metric>`` for the stage runs' metrics (``train/reward``,
``ab/delta``, ...), so a number in the table is found in the UI under the same name.

Which rounds: every round directory with a ``summary.json`` or a ``progress.json``. This stage runs
inside its own round, before the runner writes that round's ``summary.json``; so a round in flight (its
progress says ``running``, or ``failed``) is read from what its stages left instead: ``progress.json``
(parent run id, completed stages) and the stage verdicts (``train/verdict.json`` carries the held-out
eval, ``ab/verdict.json`` the A/B outcome), with the rules ``hermes_lab.round.outcome.finish_round`` applies. A round
that skipped training (data gate) or stopped early is a row too, with its status: a tick, not a gap.

    papermill notebooks/50_round_compare.ipynb runs/compare.ipynb -p config_path params/embedded.yaml
    make mlflow-ui        # the same store in the MLflow UI
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hermes_lab.config.schema import HermesConfig
from hermes_lab.core.layout import CompareLayout, RoundLayout, RunsLayout
from hermes_lab.core.reports import EvalReport, RoundSummary
from hermes_lab.core.verdict import read_verdict
from hermes_lab.round.stages import STAGES, Stage, all_gates

# the last value of these stage-run metrics, one column each
TABLE_METRICS = (
    "execute/pass_rate",
    "prep/new_samples",
    "review/agreement",
    "train/reward",
    "train/kl",
    "train/entropy",
    "train/frac_reward_zero_std",
    "train/eval_pass_rate_before",
    "train/eval_pass_rate_after",
    "validate/regression_delta",
    "ab/delta",
    "ab/p_value",
    "ab/final_ratio",
)
CURVES = ("train/reward", "train/kl")  # per-step histories overlaid by round
MARK = {True: "pass", False: "stop", None: "not run"}
Z95 = 1.959963984540054  # two-sided 95% normal quantile

# a round's status (summary.json / the stop statuses of hermes_lab.round.stages) -> the kind a plot marks it as;
# first match wins. "held": an A/B that neither promoted nor rolled back (hold, keep observing, widen)
KINDS = (
    ("promoted", "promoted"),
    ("rolled back", "rolled back"),
    ("candidate held", "held"),
    ("skipped", "skipped"),
    ("awaiting", "waiting"),
    ("running", "running"),
    ("completed", "completed"),
)
# the look of each kind: (colour, marker); everything else (stopped:, blocked:, failed) is "stopped"
STYLE = {
    "promoted": ("tab:green", "^"),
    "held": ("tab:orange", "s"),
    "rolled back": ("tab:red", "v"),
    "skipped": ("tab:gray", "X"),
    "stopped": ("tab:purple", "D"),
    "waiting": ("tab:blue", "P"),
    "running": ("tab:cyan", "o"),
    "completed": ("tab:olive", "o"),
}


def status_kind(status: str | None) -> str:
    """The plot's category of a round status (``candidate held (hold)`` -> ``held``)."""
    s = (status or "").lower()
    return next((kind for prefix, kind in KINDS if s.startswith(prefix)), "stopped")


# ------------------------------------------------------------------------------------------- rounds
def _read(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) else None


def _round_dirs(runs_dir: str | Path) -> list[tuple[int, Path]]:
    """(number, dir) of every ``round-NN`` folder, by number (not by name: round-100 sorts after round-99)."""
    return [(rd.number, rd.root) for rd in RunsLayout(runs_dir).rounds()]


def _in_flight(n: int, rd: Path, prog: dict[str, Any], stages: Sequence[Stage]) -> dict[str, Any]:
    """A summary-shaped record of a round with no (current) summary.json, from its stage files: the
    same rules as ``round.outcome.finish_round`` (the last completed stage with a candidate / an eval wins), with the
    status so far. It changes nothing: the champion, the negatives and the registry are the runner's."""
    verdicts = {s.name: read_verdict(rd / s.verdict) if s.verdict else None for s in stages}
    completed = list(prog.get("completed") or [])
    done = [v for s in stages if s.name in completed and (v := verdicts[s.name])]
    cont = prog.get("continues")
    if cont:  # a round continuing a held A/B: the candidate's eval is the held round's
        done = [
            v for s in stages if s.starts_cooldown and (v := read_verdict(Path(cont["round_dir"]) / s.verdict))
        ] + done
    cand = next((v["candidate"] for v in reversed(done) if v.get("candidate")), None)
    ev = next((v["eval"] for v in reversed(done) if v.get("eval")), None)
    if ev is None and "train" in completed:  # a verdict written before eval was part of it
        report = EvalReport.read(RoundLayout(rd).train.eval)
        ev = report.to_json() if report is not None else None
    promoted = bool(cand and cand.get("promoted") is True)
    decision = cand.get("decision") if cand else None
    stopped = prog.get("stopped_at") or {}
    pending = next((s.name for s in stages if s.name not in completed), None)
    if stopped:
        status = stopped["status"]
    elif cand is not None:
        status = (
            "promoted"
            if promoted
            else "rolled back"
            if cand.get("rolled_back")
            else "candidate held: undecided"
            if cand.get("held")
            else f"candidate held ({decision})"
        )
    elif prog.get("status") == "failed":
        status = f"failed at {pending}" if pending else "failed"
    else:
        status = f"running ({pending})" if pending else "completed"
    # a gate is reported by the verdict of a stage that ran (the runner deletes a verdict before a rerun)
    gates = [g for s in stages for g in (verdicts[s.name] or {}).get("gates", [])]
    return {
        "round": n,
        "status": status,
        "decision": decision,
        "promoted": promoted,
        "gates": gates,
        "total_s": round(sum((prog.get("timings") or {}).values()), 1),
        "pass_rate": ((ev.get("after") if promoted else ev.get("before")) or {}).get("pass_rate") if ev else None,
        "eval": ev,
        "parent_run_id": prog.get("parent_run_id"),
        "ab": cand,
    }


def round_records(cfg: HermesConfig, stages: Sequence[Stage] = STAGES) -> list[dict[str, Any]]:
    """One summary-shaped dict per round that ran, by round number, each with ``in_progress``: its
    summary.json, or (a round in flight, or one without a summary) what its stage files say so far."""
    out = []
    for n, rd in _round_dirs(cfg.round.runs_dir):
        lay = RoundLayout(rd)
        report, prog = RoundSummary.read(lay.summary), _read(lay.progress)
        summary = report.to_json() if report is not None else None
        # a resumed round (after awaiting review / live A/B) still has its old summary while it runs
        in_flight = prog is not None and prog.get("status") in ("running", "failed")
        if summary is not None and not in_flight:
            out.append({**summary, "round": int(summary.get("round", n)), "in_progress": False})
        elif prog is not None:
            out.append({**_in_flight(n, rd, prog, stages), "in_progress": True})
    return out


# ------------------------------------------------------------------------------------- intervals
def wilson(p: float, n: float, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of a proportion: inside [0, 1] and sensible at 0 % and 100 %, unlike p ± z·se."""
    if not n or n <= 0 or p is None or math.isnan(p):
        return (math.nan, math.nan)
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z / denom * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return (max(0.0, centre - half), min(1.0, centre + half))


def newcombe(p1: float, n1: float, p2: float, n2: float, z: float = Z95) -> tuple[float, float]:
    """Interval of p2 - p1 for two independent proportions (Newcombe's hybrid score, from the Wilson
    intervals). Before and after are scored on the same tasks, which correlates them positively, so
    this unpaired interval is wider than the paired one: conservative. The eval keeps no per-task outcomes,
    so the paired interval cannot be computed here."""
    l1, u1 = wilson(p1, n1, z)
    l2, u2 = wilson(p2, n2, z)
    d = p2 - p1
    return (d - math.hypot(p2 - l2, u1 - p1), d + math.hypot(u2 - p2, p1 - l1))


def _n_eff(side: dict[str, Any]) -> float:
    """Independent units behind an eval's pass rate: its tasks. ``n`` counts samples, ``samples_per_task``
    per task; samples of one task are correlated, so counting them all would make the intervals too narrow.
    Counting tasks is the conservative end (it assumes the samples of a task always agree)."""
    n = float(side.get("n") or 0)
    return n / max(1, int(side.get("samples_per_task") or 1))


def pass_rate_by_round(cfg: HermesConfig, stages: Sequence[Stage] = STAGES) -> Any:
    """The table behind ``pass_rate_by_round.png``: one row per round that ran (index: the round, int).

    ``champion``: the champion's held-out sampled pass rate after the round (the candidate's if it was
    promoted, else the policy the round started from), carried forward (``champion_carried``) from the
    last round that measured it when this one did not (skipped, stopped before the eval). ``candidate``:
    the trained candidate's, when the round trained; ``start``: the policy's it started from.
    ``*_lo``/``*_hi``: 95 % Wilson intervals over the eval's tasks; ``gain``: candidate - start, with the
    eval's interval paired by task (``policy.paired_gain``), or Newcombe's where the eval has no outcomes.
    The eval is the train stage's fixed held-out task set (same tasks and seed every round), so rounds compare."""
    import pandas as pd

    rows, last = [], None  # last: (pass rate, n) of the champion so far
    for r in round_records(cfg, stages):
        ev = r.get("eval") or {}
        before, after = ev.get("before") or {}, ev.get("after") or {}
        row: dict[str, Any] = {
            "round": int(r["round"]),
            "status": r.get("status"),
            "kind": status_kind(r.get("status")),
            "in_progress": bool(r.get("in_progress")),
            "decision": r.get("decision"),
        }
        champ = after if r.get("promoted") and after else before
        if champ.get("pass_rate") is not None:
            last = (float(champ["pass_rate"]), _n_eff(champ))
            row["champion_carried"] = False
        else:
            row["champion_carried"] = last is not None
        p, n = last if last is not None else (math.nan, 0.0)
        row["champion"], row["champion_n"] = p, n
        row["champion_lo"], row["champion_hi"] = wilson(p, n)
        cp, cn = (float(after["pass_rate"]), _n_eff(after)) if after.get("pass_rate") is not None else (math.nan, 0)
        row["start"] = float(before["pass_rate"]) if before.get("pass_rate") is not None else math.nan
        row["candidate"], row["candidate_n"] = cp, cn
        row["candidate_lo"], row["candidate_hi"] = wilson(cp, cn)
        if before.get("pass_rate") is not None and not math.isnan(cp):
            bp, bn = float(before["pass_rate"]), _n_eff(before)
            row["gain"] = cp - bp
            paired = ev.get("gain") if isinstance(ev.get("gain"), dict) else {}
            if paired.get("gain_lo") is not None:  # paired by task (policy.paired_gain): the tighter, right one
                row["gain_lo"], row["gain_hi"] = paired["gain_lo"], paired["gain_hi"]
            else:  # an eval.json from before per-sample outcomes were kept
                row["gain_lo"], row["gain_hi"] = newcombe(bp, bn, cp, cn)
        else:
            row["gain"] = row["gain_lo"] = row["gain_hi"] = math.nan
        rows.append(row)
    return pd.DataFrame(rows).set_index("round") if rows else pd.DataFrame()


def print_flywheel(summaries: list[dict[str, Any]]) -> None:
    """The champion's held-out pass rate after each round, each trained candidate's paired gain, and the
    total over the policy the first of these rounds started from (the same fixed held-out set throughout)."""
    from hermes_lab.policy.model import describe_gain

    print("\nflywheel: held-out sampled pass rate of the champion after each round")
    start, rises = None, 0
    for s in summaries:
        ev, pr = s.get("eval") or {}, s.get("pass_rate")
        if start is None and ev.get("before"):
            start = ev["before"]["pass_rate"]
        gain = f"  candidate {ev['after']['pass_rate']:.1%}: {describe_gain(ev)}" if ev.get("after") else ""
        rises += bool(s.get("promoted") and ev.get("after") and ev["after"]["pass_rate"] > ev["before"]["pass_rate"])
        cont = f" (continues round {s['continues']:02d})" if s.get("continues") else ""
        print(f"  round {s['round']:02d}  {s['status'] + cont:28s} {'' if pr is None else f'{pr:.1%}'}{gain}")
    kinds = [status_kind(s.get("status")) for s in summaries]
    held, rejected = kinds.count("held"), kinds.count("rolled back") + kinds.count("stopped")
    last = next((s["pass_rate"] for s in reversed(summaries) if s.get("pass_rate") is not None), None)
    if start is not None and last is not None:
        total = f"{start:.1%} -> {last:.1%} ({100 * (last - start):+.1f} points)"
        print(
            f"  champion {total}, rose in {rises} of {len(summaries)} rounds; held {held} (the A/B did not "
            f"decide), rejected {rejected} (rolled back, or stopped by a gate)"
        )


def data_gain(round_dir: str | Path) -> Any:
    """Which data drove a round's gain: per family, the share of the training weight and of mixed-outcome
    prompts prep selected (``prep/selection.json``) beside the held-out pass rate before / after training
    (``train/eval.json``); written to ``train/data_gain.json``. A joint view, not a causal split (families
    train together and transfer). An empty frame when the round has no selection report or no eval."""
    import pandas as pd

    from hermes_lab.core.jsonl import write_json_atomic
    from hermes_lab.prep.selection import gain_by_family

    rd = RoundLayout(round_dir)
    sel, ev = rd.prep.selection, rd.train.eval
    if not sel.is_file() or not ev.is_file():
        return pd.DataFrame()
    rows = gain_by_family(json.loads(sel.read_text()), json.loads(ev.read_text()))
    write_json_atomic(rd.train.data_gain, rows)
    return pd.DataFrame(rows).T


# ------------------------------------------------------------------------------------------ MLflow
def _runs(cfg: HermesConfig) -> Any:
    import mlflow

    from hermes_lab.core import tracking

    tracking.setup(cfg.round.runs_dir, cfg.round.experiment)
    return mlflow.search_runs(experiment_names=[cfg.round.experiment], output_format="pandas")


def stage_run(runs: Any, parent: str | None, stage: str) -> Any:
    """The row of a round's stage run (its nested run named like the stage), or None."""
    if parent is None or runs.empty or "tags.mlflow.parentRunId" not in runs:
        return None
    m = runs[(runs["tags.mlflow.parentRunId"] == parent) & (runs["tags.mlflow.runName"] == stage)]
    return None if m.empty else m.iloc[0]


def rounds_table(cfg: HermesConfig, stages: Sequence[Stage] = STAGES) -> Any:
    """One row per round that ran (the one in flight included): status, decision, every gate, and the
    stage metrics of TABLE_METRICS."""
    import pandas as pd

    runs = _runs(cfg)
    rows = []
    for s in round_records(cfg, stages):
        row: dict[str, Any] = {
            "round": int(s["round"]),
            "status": s["status"],
            "kind": status_kind(s["status"]),
            "in_progress": s["in_progress"],
            "decision": s.get("decision"),
            "promoted": s.get("promoted"),
            "total_s": s.get("total_s"),
        }
        verdicts = {g["gate"]: g.get("passed") for g in s.get("gates", [])}
        for _, gate in all_gates(stages):
            row[f"gate:{gate}"] = MARK[verdicts.get(gate)]
        by_stage = {st.name: stage_run(runs, s.get("parent_run_id"), st.name) for st in stages}
        for name in TABLE_METRICS:
            run = by_stage.get(name.split("/", 1)[0])
            row[name] = None if run is None else run.get(f"metrics.{name}")
        rows.append(row)
    return pd.DataFrame(rows).set_index("round") if rows else pd.DataFrame()


def step_curves(cfg: HermesConfig, keys: Sequence[str] = CURVES) -> Any:
    """Per-step curves (``<stage>/<metric>`` names) of every round's stage runs, from MLflow metric history."""
    import pandas as pd
    from mlflow import MlflowClient

    runs = _runs(cfg)
    if runs.empty:
        return pd.DataFrame()
    client = MlflowClient()
    frames = []
    for s in round_records(cfg):
        for k in keys:
            run = stage_run(runs, s.get("parent_run_id"), k.split("/", 1)[0])
            if run is None:
                continue
            hist = client.get_metric_history(run["run_id"], k)
            frames.append(
                pd.DataFrame(
                    {"round": s["round"], "metric": k, "step": [m.step for m in hist], "value": [m.value for m in hist]}
                )
            )
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


# ------------------------------------------------------------------------------------------- plots
def _round_axis(ax: Any, table: Any) -> None:
    """Every round that ran on an integer tick (none missing, none fractional); a round with nothing to
    draw (skipped, stopped early) gets its status written at the tick, and one in flight says so."""
    rounds = [int(r) for r in table.index]
    ax.set_xticks(rounds)
    ax.set_xticklabels([f"{r}*" if ip else str(r) for r, ip in zip(rounds, table["in_progress"])])
    ax.set_xlim(min(rounds) - 0.6, max(rounds) + 0.6)
    ax.set_xlabel("round  (* in progress: status so far)" if table["in_progress"].any() else "round")
    trans = ax.get_xaxis_transform()  # x in data, y in axes fraction: the text sits at the foot, whatever the scale
    for r, status, kind in zip(rounds, table["status"], table["kind"]):
        if kind in ("skipped", "stopped", "waiting", "running"):
            ax.text(
                r,
                0.03,
                str(status),
                transform=trans,
                rotation=90,
                ha="center",
                va="bottom",
                fontsize=7,
                color=STYLE[kind][0],
            )


def plot_pass_rate(table: Any, out_dir: str | Path) -> Path:
    """``pass_rate_by_round.png``: the champion's pass rate as a line with its 95 % band across every
    round (hollow where carried forward), each candidate as a point with its interval, marked by status."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    from hermes_lab.core.tracking import log_figure

    fig, ax = plt.subplots(figsize=(max(6.0, 0.7 * len(table) + 3), 4.2))
    x = table.index.to_numpy(dtype=float)
    ch = table["champion"].to_numpy(dtype=float)
    ax.fill_between(x, table["champion_lo"], table["champion_hi"], color="black", alpha=0.12, lw=0)
    ax.plot(x, ch, color="black", lw=1.6, zorder=2)
    carried = table["champion_carried"].to_numpy(dtype=bool)
    ax.scatter(x[~carried], ch[~carried], color="black", s=22, zorder=3)
    ax.scatter(x[carried], ch[carried], facecolor="white", edgecolor="black", s=22, zorder=3)
    # candidates a little right of the tick, so a promoted candidate does not hide the champion's point
    dx = 0.12
    for kind, (colour, marker) in STYLE.items():
        rows = table[(table["kind"] == kind) & table["candidate"].notna()]
        if rows.empty:
            continue
        y = rows["candidate"].to_numpy(dtype=float)
        err = [y - rows["candidate_lo"].to_numpy(dtype=float), rows["candidate_hi"].to_numpy(dtype=float) - y]
        ax.errorbar(
            rows.index.to_numpy(dtype=float) + dx, y, yerr=err, fmt=marker, color=colour, ms=7, capsize=3, zorder=4
        )
    # rounds without a candidate still show their status: a marker on the champion line (or the foot)
    for r, kind, has_cand, c in zip(table.index, table["kind"], table["candidate"].notna(), ch):
        if not has_cand:
            colour, marker = STYLE[kind]
            ax.scatter([r], [c if not math.isnan(c) else 0.0], marker=marker, color=colour, s=60, zorder=5)
    _round_axis(ax, table)
    ax.set_ylim(0, 1)
    ax.set_ylabel("held-out sampled pass rate")
    ax.set_title("champion and candidates by round (95% Wilson intervals over tasks)")
    kinds = [k for k in STYLE if (table["kind"] == k).any()]
    handles = [Line2D([], [], color="black", marker="o", label="champion (after the round)")]
    if carried.any():
        handles.append(Line2D([], [], color="black", marker="o", mfc="white", ls="", label="champion carried forward"))
    handles.append(plt.Rectangle((0, 0), 1, 1, color="black", alpha=0.12, label="champion 95% interval"))
    handles += [Line2D([], [], color=STYLE[k][0], marker=STYLE[k][1], ls="", label=k) for k in kinds]
    ax.legend(handles=handles, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), title="candidate / round")
    path = log_figure(fig, CompareLayout(out_dir).pass_rate)
    plt.close(fig)
    return path


def plot_rounds(cfg: HermesConfig, table: Any, out_dir: str | Path, rates: Any = None) -> list[Path]:
    """``pass_rate_by_round.png`` (see ``plot_pass_rate``), ``rounds.png`` (pass rate before / after
    training and the A/B delta, on integer round ticks) and the per-step reward/KL curves by round."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    import seaborn as sns

    from hermes_lab.core.tracking import log_figure

    out = Path(out_dir)
    paths = []
    rates = pass_rate_by_round(cfg) if rates is None else rates
    if not rates.empty:
        paths.append(plot_pass_rate(rates, out))
    if not table.empty and not rates.empty:  # both list the rounds of round_records
        fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
        # from the rounds' eval files (the rates table), which the round in flight has before MLflow's
        # round record is complete; a round that did not train is skipped by the line, not a break in it
        for col, label in (("start", "before training (the round's start)"), ("candidate", "after (candidate)")):
            y = rates[col].dropna()
            axes[0].plot(y.index.to_numpy(dtype=float), y.to_numpy(dtype=float), marker="o", label=label)
        axes[0].set_ylim(0, 1)
        axes[0].legend(fontsize=8)
        axes[0].set_title("held-out sampled pass rate (train stage)")
        _round_axis(axes[0], table)
        colours = [STYLE[k][0] for k in table["kind"]]
        delta = table["ab/delta"].to_numpy(dtype=float)
        axes[1].bar(table.index.to_numpy(dtype=float), np.nan_to_num(delta), color=colours, width=0.6)
        axes[1].axhline(0, color="black", lw=0.8)
        axes[1].set_title("ab/delta, coloured by status")
        _round_axis(axes[1], table)
        kinds = [k for k in STYLE if (table["kind"] == k).any()]
        axes[1].legend(
            handles=[plt.Rectangle((0, 0), 1, 1, color=STYLE[k][0], label=k) for k in kinds],
            fontsize=8,
            loc="upper left",
            bbox_to_anchor=(1.01, 1.0),
        )
        paths.append(log_figure(fig, CompareLayout(out).rounds))
        plt.close(fig)
    curves = step_curves(cfg)
    if not curves.empty:
        g = sns.relplot(
            data=curves,
            x="step",
            y="value",
            hue="round",
            col="metric",
            kind="line",
            facet_kws={"sharey": False},
            height=3.2,
            aspect=1.4,
            palette="viridis",
        )
        paths.append(log_figure(g.figure, CompareLayout(out).curves))
        plt.close(g.figure)
    return paths
