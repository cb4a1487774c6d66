"""Stage 50, compare rounds: gates, rewards, KL, A/B deltas and decisions across rounds, from MLflow.

Reads the MLflow store (``mlflow.search_runs`` for the round runs and their nested stage runs, metric
history for the per-step training curves) and ``runs/round-*/summary.json``; writes PNG plots under
``runs/round-NN/compare/`` and logs them to the active MLflow run. Columns use the names MLflow has:
``gate:<gate>`` for every gate of the stage registry, in round order, and ``<stage>/<metric>`` for the
stage runs' metrics (``train/reward``, ``ab/delta``, ...), so a number in the table is found in the UI
under the same name.

    papermill notebooks/50_round_compare.ipynb runs/compare.ipynb -p config_path params/embedded.yaml
    make mlflow-ui        # the same store in the MLflow UI
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hermes_lab.config import HermesConfig
from hermes_lab.stages import STAGES, Stage, all_gates

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


def _runs(cfg: HermesConfig) -> Any:
    import mlflow

    from hermes_lab import tracking

    tracking.setup(cfg.round.runs_dir, cfg.round.experiment)
    return mlflow.search_runs(experiment_names=[cfg.round.experiment], output_format="pandas")


def _summaries(cfg: HermesConfig) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(Path(cfg.round.runs_dir).glob("round-*/summary.json"))]


def stage_run(runs: Any, parent: str | None, stage: str) -> Any:
    """The row of a round's stage run (its nested run named like the stage), or None."""
    if parent is None or runs.empty or "tags.mlflow.parentRunId" not in runs:
        return None
    m = runs[(runs["tags.mlflow.parentRunId"] == parent) & (runs["tags.mlflow.runName"] == stage)]
    return None if m.empty else m.iloc[0]


def rounds_table(cfg: HermesConfig, stages: Sequence[Stage] = STAGES) -> Any:
    """One row per round: status, decision, every gate, and the stage metrics of TABLE_METRICS."""
    import pandas as pd

    runs = _runs(cfg)
    rows = []
    for s in _summaries(cfg):
        row: dict[str, Any] = {
            "round": s["round"],
            "status": s["status"],
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
    for s in _summaries(cfg):
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


def plot_rounds(cfg: HermesConfig, table: Any, out_dir: str | Path) -> list[Path]:
    """Pass rate and A/B delta across rounds, and the per-step reward/KL curves overlaid by round."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import seaborn as sns

    from hermes_lab.tracking import log_figure

    out = Path(out_dir)
    paths = []
    if not table.empty:
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
        passes = [c for c in ("train/eval_pass_rate_before", "train/eval_pass_rate_after") if c in table]
        if passes and table[passes].notna().any().any():
            table[passes].plot(marker="o", ax=axes[0])
        axes[0].set_title("held-out sampled pass rate (train stage)")
        axes[0].set_xlabel("round")
        if table["ab/delta"].notna().any():
            colors = [
                "tab:green" if p is True else "tab:red" if d == "roll back" else "tab:gray"
                for p, d in zip(table["promoted"], table["decision"])
            ]
            axes[1].bar(table.index.astype(str), table["ab/delta"].fillna(0), color=colors)
        axes[1].axhline(0, color="black", lw=0.8)
        axes[1].set_title("ab/delta (green: promoted, red: rolled back)")
        paths.append(log_figure(fig, out / "rounds.png"))
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
        paths.append(log_figure(g.figure, out / "curves_by_round.png"))
        plt.close(g.figure)
    return paths
