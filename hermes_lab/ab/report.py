"""The A/B report: ab_report.json from a rollout's analysis, its plots, its MLflow record, its verdict.

Stage: validate (A/B), the second half of ``hermes_lab.ab.run`` (the runner drives traffic and calls
``build_report``). Writes nothing by itself but what its callers ask for: the PNG plots under
``runs/round-NN/ab/plots/`` (also logged to MLflow), the ``ab/*`` metrics, params and tags of the active
MLflow run, and ``runs/round-NN/ab/verdict.json`` (the ab_decision gate and the candidate's outcome, which
the round runner reads: only ``promoted`` true, a rollout that reached 100%, moves the champion).
The analysis notebook ``notebooks/40_ab_analysis.ipynb`` shows the tables and plots below.

    python -m hermes_lab.ab_run ... --output runs/round-01/ab/ab_report.json   # writes the report via this module
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hermes_lab.ab import analysis as ab_analysis
from hermes_lab.ab import stats as ab
from hermes_lab.config.schema import HermesConfig
from hermes_lab.core import tracking
from hermes_lab.core.layout import AB_REPORT
from hermes_lab.core.verdict import gate, write_verdict

REPORT_NAME = AB_REPORT  # the report's file, in a round's ab/ and in a live log dir (core.layout)


@dataclass(frozen=True)
class RunFacts:
    """What a rollout was and how it ended, beside its statistics: the report's bookkeeping fields."""

    baseline: str
    candidate: str
    seed: int
    duration: float  # the --duration cap (0: none)
    horizon: float  # simulated seconds the rollout could run
    stopped_by: str | None  # the action or limit that ended it
    log_path: Path
    replay: str | None
    wall_seconds: float


def _clean(o: Any) -> Any:
    """Strict JSON: non-finite numbers become null (json.dumps would write NaN / Infinity)."""
    if isinstance(o, dict):
        return {k: _clean(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_clean(v) for v in o]
    if isinstance(o, (float, np.floating)):
        return float(o) if math.isfinite(o) else None
    return o.item() if isinstance(o, (np.integer, np.bool_)) else str(o) if isinstance(o, Path) else o


def held_info(
    chosen: dict[str, Any], stopped_by: str | None, last: dict[str, Any], st: ab.Settings
) -> dict[str, Any] | None:
    """The honest end of an undecided rollout: the stage that reached its hard end without a decision, the
    interval its confidence sequence reached there, and its units; None when the rollout decided (or a hold,
    a --duration cut ended it: those are not 'undecided at the hard end')."""
    if chosen["decision"] != "keep observing" or stopped_by != "keep observing" or not last:
        return None
    q = last["sequential"]
    lo, hi = q.get("cs_lower"), q.get("cs_upper")
    span = "n/a" if lo is None or hi is None else f"[{lo:+.3f}, {hi:+.3f}]"
    return {
        "stage": last["index"],
        "ratio": last["ratio"],
        "until": last["sequential_look"]["t"],
        "cs": [lo, hi],
        "delta": last.get("delta"),
        "units_baseline": q.get("units_baseline"),
        "units_candidate": q.get("units_candidate"),
        "reason": f"stage {last['index']} ({last['ratio']:.0%}) reached its hard end undecided: the "
        f"{1 - st.alpha:.0%} confidence sequence for delta ended at {span} (reward scale), which contains 0",
    }


def build_report(
    cfg: HermesConfig, analysis: dict[str, Any], stage_list: list[list[float]], st: ab.Settings, facts: RunFacts
) -> dict[str, Any]:
    """ab_report.json: the user's fields first, then our decision and everything behind it."""
    stages = analysis["stages"]
    ours = ab_analysis.rollout_decision(stages, stage_list, "sequential")
    users = ab_analysis.rollout_decision(stages, stage_list, "user")
    chosen = ours if st.rule == "sequential" else users
    overall = analysis["overall"]
    last = stages[-1] if stages else {}
    if st.rule == "sequential":
        reasons = list(last.get("reasons", ["no traffic was analysed"]))
    else:
        reasons = [last.get("user_rule_reason", "no traffic was analysed"), f"decision: {chosen['decision']}"]
    if facts.stopped_by == "duration" and last:
        reasons.insert(
            0,
            f"--duration {facts.duration:g} s ended the rollout in stage {last['index']} "
            f"(ratio {last['ratio']:g}); promotion waits for the stage's planned end",
        )
    held = held_info(chosen, facts.stopped_by, last, st)
    if held:
        reasons.append(held["reason"])
    # "promote" only once traffic reached 100%; a stage that passed without that only widened (issue #14)
    if chosen["decision"] == "promote":
        reasons.append("promoted to 100%")
    elif chosen["decision"] == "widen":
        reasons.append(f"widen traffic to {chosen['final_ratio']:.0%}; not promoted: the rollout stopped before 100%")
    report = {
        **{
            k: overall[k]
            for k in (
                "delta",
                "p_value",
                "significant",
                "baseline_mean",
                "candidate_mean",
                "baseline_success",
                "candidate_success",
                "n_baseline",
                "n_candidate",
            )
        },
        "decision": chosen["decision"],
        "reasons": reasons,
        "rule": st.rule,
        "final_ratio": chosen["final_ratio"],
        "promoted": bool(chosen.get("promoted", False)),
        "rolled_back": chosen["decision"] == "roll back",
        "negative": chosen["decision"] == "roll back",  # the round's data is marked negative for the next one
        "held": held,  # a stage that reached its hard end undecided: where, and the interval it reached
        "decisions": {"sequential": ours["decision"], "user": users["decision"]},
        "user_rule": {
            "rollout": users,
            "on_overall": dict(zip(("decision", "reason"), ab.decide_user_rule(overall, st.alpha))),
            "per_stage": [
                {
                    "stage": s["index"],
                    "decision": s["user_decision"],
                    "reason": s["user_rule_reason"],
                    "look": s["user_look"],
                }
                for s in stages
            ],
        },
        "sequential_rule": {
            "rollout": ours,
            "per_stage": [
                {
                    "stage": s["index"],
                    "decision": s["sequential_decision"],
                    "reasons": s["reasons"],
                    "look": s["sequential_look"],
                }
                for s in stages
            ],
        },
        "overall_note": "delta/p_value/significant pool all requests (the user's formula); stages are decided on "
        "their own data, see 'stages' and 'stratified'",
        "stratified": analysis["stratified"],
        "stages": stages,
        "per_family": analysis["per_family"],
        "srm": last.get("srm"),
        "guardrails": last.get("guardrails"),
        "sequential": last.get("sequential", {}),
        "baseline": facts.baseline,
        "candidate": facts.candidate,
        "seed": facts.seed,
        "duration": facts.duration,
        "stages_planned": stage_list,
        "simulated_seconds": facts.horizon,
        "stopped_by": facts.stopped_by,
        "n_requests": overall["n_baseline"] + overall["n_candidate"],
        "log": str(facts.log_path),
        "replay": str(facts.replay) if facts.replay else None,
        "config": cfg.to_dict()["ab"],
        "wall_seconds": round(facts.wall_seconds, 2),
    }
    return _clean(report)


# --------------------------------------------------------------------------------------------- plots
def plot_scores(cols: dict[str, np.ndarray], report: dict[str, Any]) -> Any:
    """Per-arm score distributions, one panel per stage (each stage's own data)."""
    import matplotlib.pyplot as plt

    stages = report["stages"] or [{"index": 0, "ratio": float("nan")}]
    fig, axes = plt.subplots(1, len(stages), figsize=(5 * len(stages), 3.4), squeeze=False)
    bins = np.linspace(0, max(5.0, float(cols["reward"].max()) if len(cols["reward"]) else 5.0), 21)
    for ax, s in zip(axes[0], stages):
        m = cols["stage"] == s["index"]
        for arm, name, color in ((0, "baseline", "tab:blue"), (1, "candidate", "tab:orange")):
            x = cols["reward"][m & (cols["arm"] == arm)]
            if len(x):
                ax.hist(
                    x,
                    bins=bins,
                    density=True,
                    alpha=0.55,
                    color=color,
                    label=f"{name} (n={len(x)}, mean {x.mean():.2f})",
                )
        ax.set_title(f"stage {s['index']}: candidate {s['ratio']:.0%}")
        ax.set_xlabel("reward")
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("density")
    fig.tight_layout()
    return fig


def plot_sequence(report: dict[str, Any]) -> Any:
    """Cumulative delta and its confidence sequence over simulated time, stage by stage."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 3.8))
    for s in report["stages"]:
        looks = s["sequential"]["looks"]
        h = np.array([x["t"] for x in looks]) / 3600
        nan = lambda v: np.nan if v is None else v  # noqa: E731  (inf bounds are stored as null)
        d = np.array([nan(x["delta"]) for x in looks], float)
        lo = np.array([nan(x["cs_lower"]) for x in looks], float)
        hi = np.array([nan(x["cs_upper"]) for x in looks], float)
        line = ax.plot(h, d, "o-", ms=3, label=f"stage {s['index']} ({s['ratio']:.0%}): {s['sequential_decision']}")
        ax.fill_between(h, lo, hi, alpha=0.2)
        if s["sequential"].get("adjusted"):  # the plain CS the adjustment narrowed, dashed
            for key in ("cs_lower_plain", "cs_upper_plain"):
                ax.plot(h, np.array([nan(x.get(key)) for x in looks], float), "--", lw=0.8, color=line[0].get_color())
        ax.axvline(s["planned_end"] / 3600, color="grey", ls=":", lw=1)
    ax.axhline(0, color="black", lw=0.8)
    clock = (  # a live rollout's axis is its experiment clock (the wall clock x serve.time_scale)
        f"experiment hours (wall clock x{report['time_scale']:g})"
        if report.get("mode") == "live"
        else "simulated hours"
    )
    ax.set_xlabel(f"{clock} (dotted: planned stage ends)")
    ax.set_ylabel("delta (candidate - baseline)")
    adjusted = any(s["sequential"].get("adjusted") for s in report["stages"])
    ax.set_title(
        f"delta and its {1 - report['config']['alpha']:.0%} confidence sequence"
        + (" (regression-adjusted; dashed: plain)" if adjusted else "")
        + f"; decision: {report['decision']}"
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_breakdown(report: dict[str, Any]) -> Any:
    """Delta per stage (own data) and per family (stratified across stages), with 95% intervals."""
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.6))
    st = [s for s in report["stages"] if s.get("var_delta")]
    a1.errorbar(
        [f"{s['index']} ({s['ratio']:.0%})" for s in st],
        [s["delta"] for s in st],
        yerr=[1.96 * math.sqrt(s["var_delta"]) for s in st],
        fmt="o",
        capsize=4,
    )
    a1.set_title("per stage (each stage's own data)")
    fam = {k: v for k, v in report["per_family"].items() if v.get("delta") is not None}
    a2.errorbar(
        list(fam),
        [v["delta"] for v in fam.values()],
        yerr=[[v["delta"] - v["ci"][0] for v in fam.values()], [v["ci"][1] - v["delta"] for v in fam.values()]],
        fmt="o",
        capsize=4,
        color="tab:green",
    )
    a2.set_title("per family (stratified by stage)")
    for ax in (a1, a2):
        ax.axhline(0, color="black", lw=0.8)
        ax.set_ylabel("delta")
    fig.tight_layout()
    return fig


def make_plots(
    cols: dict[str, np.ndarray],
    report: dict[str, Any],
    out_dir: str | Path,
    fam_names: Sequence[str] = (),
    close: bool = True,
) -> list[Path]:
    """Save the three plots as PNG (logged to MLflow when a run is active); returns their paths."""
    import matplotlib

    if "matplotlib.pyplot" not in sys.modules and "ipykernel" not in sys.modules:
        matplotlib.use("Agg")  # headless CLI; a notebook keeps its inline backend
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, fig in (
        ("ab_scores", plot_scores(cols, report)),
        ("ab_sequence", plot_sequence(report)),
        ("ab_breakdown", plot_breakdown(report)),
    ):
        paths.append(tracking.log_figure(fig, out_dir / f"{name}.png", laid_out=True))  # each tight_layout()
        if close:
            plt.close(fig)
    return paths


def show_plot(saved: Sequence[str | Path], name: str, draw: Any, *args: Any) -> Any:
    """A plot of the A/B in a notebook (notebooks/40_ab_analysis): the PNG the A/B saved under ``name``
    (``make_plots``) shown as saved, not drawn again (and once more by the inline backend at the cell's end);
    ``draw(*args)`` where none was saved (a live rollout without rewarded requests)."""
    path = next((p for p in saved if Path(p).stem == name), None)
    if path is None:
        return draw(*args)
    from IPython.display import Image, display

    display(Image(filename=str(path)))
    return None


def log_to_mlflow(cfg: HermesConfig, report: dict[str, Any], output: Path, log_path: Path) -> bool:
    """Params, ``ab/*`` metrics, the report and the request log to the active MLflow run (if there is one)."""
    if tracking.active_run() is None:
        return False
    params = {f"ab.{k}": v for k, v in report["config"].items()}
    params.update({f"ab.{k}": report[k] for k in ("baseline", "candidate", "seed", "duration", "replay")})
    tracking.log_params(params)
    m = {
        "delta": report["delta"],
        "p_value": report["p_value"],
        "significant": float(report["significant"]),
        "n_requests": report["n_requests"],
        "stratified_delta": report["stratified"]["delta"],
        "final_ratio": report["final_ratio"],
        "promoted": float(report["promoted"]),
    }
    for s in report["stages"]:
        i = s["index"]
        q = s["sequential"]
        m.update(
            {
                f"stage{i}_delta": s["delta"],
                f"stage{i}_p_value": s["p_value"],
                f"stage{i}_cs_lower": q["cs_lower"],
                f"stage{i}_cs_upper": q["cs_upper"],
                f"stage{i}_n_candidate": s["n_candidate"],
                f"stage{i}_n_baseline": s["n_baseline"],
                f"stage{i}_srm_p": s["srm"]["p_value"],
            }
        )
        if q.get("adjusted"):  # what the regression adjustment bought: the plain CS beside the adjusted one
            m[f"stage{i}_cs_lower_plain"], m[f"stage{i}_cs_upper_plain"] = q["cs_lower_plain"], q["cs_upper_plain"]
            m[f"stage{i}_width_ratio"] = q["width_ratio"]
            m[f"stage{i}_variance_reduction"] = q["variance_reduction"]
    tracking.log_metrics("ab", m)
    tracking.set_tags({"ab.decision": report["decision"], "ab.user_decision": report["decisions"]["user"]})
    tracking.log_artifact(output, "ab")
    tracking.log_artifact(log_path, "ab")
    return True


def write_ab_verdict(report: dict[str, Any], out_dir: str | Path) -> Path:
    """ab/verdict.json for the round runner: the ab_decision gate (passed: promoted to 100%) and the outcome."""
    promoted = report.get("promoted") is True
    detail = f"{report['decision']} (candidate share reached {report['final_ratio']:.0%})"
    keys = ("decision", "promoted", "rolled_back", "final_ratio", "delta", "p_value", "significant", "held")
    outcome = {k: report.get(k) for k in keys}
    outcome["continued"] = report.get("continued")  # a round that continued an earlier round's held A/B
    gates = [gate("ab_decision", promoted, detail)]
    return write_verdict(out_dir, "ab", gates, candidate=outcome, plan=report.get("plan"))  # plan: ab_plan's


def stage_table(report: dict[str, Any]) -> Any:
    """One row per stage: the user's fields, the CS (and the plain CS the regression adjustment narrowed, its
    width ratio and variance reduction), SRM, guardrails, both rules' decisions."""
    import pandas as pd

    return pd.DataFrame(
        [
            {
                "stage": s["index"],
                "ratio": s["ratio"],
                "n_baseline": s["n_baseline"],
                "n_candidate": s["n_candidate"],
                "baseline_mean": s["baseline_mean"],
                "candidate_mean": s["candidate_mean"],
                "delta": s["delta"],
                "p_value": s["p_value"],
                "cs_lower": s["sequential"]["cs_lower"],
                "cs_upper": s["sequential"]["cs_upper"],
                "cs_lower_plain": s["sequential"].get("cs_lower_plain"),
                "cs_upper_plain": s["sequential"].get("cs_upper_plain"),
                "cs_width_ratio": s["sequential"].get("width_ratio"),
                "variance_reduction": s["sequential"].get("variance_reduction"),
                "candidate_success": s["candidate_success"],
                "candidate_success_ci": s["candidate_success_ci"],
                "mann_whitney_p": s["mann_whitney"]["p_value"],
                "srm_p": s["srm"]["p_value"],
                "p95_ratio": s["guardrails"]["latency_p95_ratio"],
                "sequential": s["sequential_decision"],
                "user_rule": s["user_decision"],
            }
            for s in report["stages"]
        ]
    ).set_index("stage")


def adjustment_table(report: dict[str, Any]) -> Any:
    """One row per stage: the regression-adjusted CS and the plain one at the stage's last look, the width
    ratio and the pseudo-outcomes' variance reduction (empty columns when the stage was not adjusted)."""
    import pandas as pd

    rows = []
    for s in report["stages"]:
        q = s["sequential"]
        rows.append(
            {
                "stage": s["index"],
                "ratio": s["ratio"],
                "adjusted": bool(q.get("adjusted")),
                "cs_lower": q["cs_lower"],
                "cs_upper": q["cs_upper"],
                "cs_lower_plain": q.get("cs_lower_plain"),
                "cs_upper_plain": q.get("cs_upper_plain"),
                "width_ratio": q.get("width_ratio"),
                "variance_reduction": q.get("variance_reduction"),
                "decision": s["sequential_decision"],
            }
        )
    cov = report.get("covariates") or {}
    return pd.DataFrame(rows).set_index("stage").rename_axis(f"stage (covariates: {cov.get('kinds') or 'none'})")


def family_table(report: dict[str, Any]) -> Any:
    import pandas as pd

    return pd.DataFrame(
        [
            {
                "family": f,
                "n_baseline": v.get("n_baseline"),
                "n_candidate": v.get("n_candidate"),
                "delta": v["delta"],
                "ci_low": v["ci"][0],
                "ci_high": v["ci"][1],
                "p_value": v["p_value"],
            }
            for f, v in report["per_family"].items()
        ]
    ).set_index("family")


def summary(report: dict[str, Any]) -> str:
    """The decision and why, as a few lines of text."""
    d = lambda v, f: "n/a" if v is None else format(v, f)  # noqa: E731
    lines = [
        f"decision: {report['decision']} (rule: {report['rule']}; the user's rule says: {report['decisions']['user']})",
        f"delta {d(report['delta'], '+.3f')}  p {d(report['p_value'], '.3g')}  significant {report['significant']}"
        f"  (n = {report['n_baseline']} baseline / {report['n_candidate']} candidate)",
    ]
    lines += [f"  - {r}" for r in report["reasons"]]
    lines += [f"  {x}" for x in adjustment_lines(report)]
    return "\n".join(lines)


def adjustment_lines(report: dict[str, Any]) -> list[str]:
    """One line per stage on what the regression adjustment bought (none when it was off)."""
    out = []
    for s in report.get("stages") or []:
        q = s.get("sequential") or {}
        if not q.get("adjusted"):
            continue
        plain = (q.get("cs_lower_plain"), q.get("cs_upper_plain"))
        width, red = q.get("width_ratio"), q.get("variance_reduction")
        narrow = None if width is None else round(100 * (1 - width))
        cut = None if red is None else round(100 * red)
        out.append(
            f"stage {s['index']}: regression-adjusted CS [{_f(q.get('cs_lower'))}, {_f(q.get('cs_upper'))}], "
            f"plain [{_f(plain[0])}, {_f(plain[1])}]"
            + ("" if narrow is None else f": {narrow}% narrower" if narrow > 0 else ": no narrower")
            + ("" if cut is None else f", variance {cut}% lower" if cut > 0 else ", variance not reduced")
        )
    return out


def _f(v: Any) -> str:
    return "n/a" if v is None else f"{v:+.3f}"
