"""Stage 50, compare rounds: gates, rewards, KL, A/B deltas and decisions across rounds, from MLflow.

Reads the MLflow store (``mlflow.search_runs`` for round and stage runs, metric history for the
per-step training curves) and ``runs/round-*/summary.json``; writes PNG plots under
``runs/round-NN/compare/`` and logs them to the active MLflow run.

    papermill notebooks/50_round_compare.ipynb runs/compare.ipynb -p config_path params/embedded.yaml
    make mlflow-ui        # the same store in the MLflow UI
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hermes_lab.config import HermesConfig


def _runs(cfg: HermesConfig) -> Any:
    import mlflow

    from hermes_lab import tracking

    tracking.setup(cfg.round.runs_dir, cfg.round.experiment)
    return mlflow.search_runs(experiment_names=[cfg.round.experiment], output_format="pandas")


def rounds_table(cfg: HermesConfig) -> Any:
    """One row per round: status, decision, gates, training reward/KL, held-out pass rate, A/B delta."""
    import pandas as pd

    runs = _runs(cfg)
    rows = []
    for p in sorted(Path(cfg.round.runs_dir).glob("round-*/summary.json")):
        s = json.loads(p.read_text())
        row: dict[str, Any] = {
            "round": s["round"],
            "status": s["status"],
            "decision": s.get("decision"),
            "total_s": s.get("total_s"),
        }
        for g in s.get("gates", []):
            row[f"gate:{g['gate']}"] = "pass" if g.get("passed") else "stop"
        ev = s.get("eval") or {}
        if ev:
            row["pass_before"] = ev["before"]["pass_rate"]
            row["pass_after"] = ev["after"]["pass_rate"]
        ab = s.get("ab") or {}
        row.update({"ab_delta": ab.get("delta"), "ab_p": ab.get("p_value")})
        train = _train_run(runs, s.get("parent_run_id"))
        if train is not None:
            for k in ("reward", "kl", "entropy", "frac_reward_zero_std"):
                col = f"metrics.{k}"
                row[f"train_{k}_last"] = train.get(col)
        rows.append(row)
    return pd.DataFrame(rows).set_index("round") if rows else pd.DataFrame()


def _train_run(runs: Any, parent: str | None) -> Any:
    if parent is None or runs.empty or "tags.mlflow.parentRunId" not in runs:
        return None
    m = runs[(runs["tags.mlflow.parentRunId"] == parent) & (runs["tags.mlflow.runName"] == "train")]
    return None if m.empty else m.iloc[0]


def step_curves(cfg: HermesConfig, keys: tuple[str, ...] = ("reward", "kl")) -> Any:
    """Per-step training curves of every round's training run (MLflow metric history)."""
    import pandas as pd
    from mlflow import MlflowClient

    runs = _runs(cfg)
    if runs.empty:
        return pd.DataFrame()
    client = MlflowClient()
    frames = []
    for p in sorted(Path(cfg.round.runs_dir).glob("round-*/summary.json")):
        s = json.loads(p.read_text())
        train = _train_run(runs, s.get("parent_run_id"))
        if train is None:
            continue
        for k in keys:
            hist = client.get_metric_history(train["run_id"], k)
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
        if "pass_after" in table:
            table[["pass_before", "pass_after"]].plot(marker="o", ax=axes[0])
        axes[0].set_title("held-out sampled pass rate (train stage)")
        axes[0].set_xlabel("round")
        if table["ab_delta"].notna().any():
            colors = [
                "tab:green" if d == "promote" else "tab:red" if d == "roll back" else "tab:gray"
                for d in table["decision"]
            ]
            axes[1].bar(table.index.astype(str), table["ab_delta"].fillna(0), color=colors)
        axes[1].axhline(0, color="black", lw=0.8)
        axes[1].set_title("A/B delta (green: promoted, red: rolled back)")
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
