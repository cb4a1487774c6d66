"""Plots of a GRPO training run's curves, one PNG per panel, earlier rounds overlaid (validate stage).

Writes ``<round_dir>/validate/plots/*.png`` (reward mean with a +/-std band, per-reward-function curves,
KL with its spikes marked, frac_reward_zero_std, entropy, completion lengths, clip ratios, learning rate,
loss / grad norm; for the episode phase, under ``plots/episodes/``, the same and episode success, tool errors,
invalid calls, turns and tool calls per episode) and logs them to the active MLflow run. Reads nothing:
``hermes_lab.evaluate.curves`` loads the curves, ``hermes_lab.evaluate.inspect`` diagnoses them and calls
``plot_curves``.

    hermes-lab inspect --train-dir runs/round-01/train --output runs/round-01/validate
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd


@dataclass
class _Panel:
    name: str
    title: str
    ylabel: str
    cols: list[str]
    overlay: list[str] = field(default_factory=list)  # columns drawn for earlier rounds too
    logy: bool = False


PANELS = [
    _Panel("reward", "Reward (mean +/- std over completions)", "reward", ["reward"], ["reward"]),
    _Panel("kl", "KL to the reference policy", "KL", ["kl"], ["kl"]),
    _Panel(
        "frac_reward_zero_std",
        "Groups with zero reward spread",
        "fraction",
        ["frac_reward_zero_std"],
        ["frac_reward_zero_std"],
    ),
    _Panel("entropy", "Policy entropy", "nats/token", ["entropy"], ["entropy"]),
    _Panel(
        "completion_lengths",
        "Completion length",
        "tokens",
        ["completions/mean_length", "completions/min_length", "completions/max_length"],
        ["completions/mean_length"],
    ),
    _Panel(
        "clip_ratios",
        "Clipping: policy ratio (clip_ratio/*) and truncated completions",
        "fraction",
        ["clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "completions/clipped_ratio"],
    ),
    _Panel("learning_rate", "Learning rate", "lr", ["learning_rate"]),
    # the episode phase (train/episodes/, hermes_lab.train.episodes): skipped for a run without it
    _Panel(
        "episode_success",
        "Episodes: success, tool errors, invalid calls, answers without a tool",
        "fraction",
        ["episode_success", "tool_error_rate", "invalid_call_rate", "answered_without_tool"],
        ["episode_success"],
    ),
    _Panel(
        "episode_turns",
        "Episodes: assistant turns and tool calls per episode",
        "per episode",
        ["turns_per_episode", "tool_calls_per_episode"],
        ["turns_per_episode"],
    ),
    _Panel("loss_grad_norm", "Loss and gradient norm", "value", ["loss", "grad_norm"], ["loss"]),
]


def _has(df: pd.DataFrame, col: str) -> bool:
    return col in df.columns and bool(df[col].notna().any())


def _plot_panel(panel: _Panel, df: pd.DataFrame, compare: dict[str, pd.DataFrame], marks: dict[str, list[int]]) -> Any:
    import matplotlib.pyplot as plt
    import seaborn as sns

    cols = [c for c in panel.cols if _has(df, c)]
    if not cols:
        return None
    with sns.axes_style("whitegrid"):
        fig, ax = plt.subplots(figsize=(8, 4))
    palette = sns.color_palette("tab10", max(3, len(cols) + len(compare)))
    for i, c in enumerate(cols):
        s = df[c].dropna()
        ax.plot(s.index, s.to_numpy(), color=palette[i], lw=1.6, label=c if len(cols) > 1 or compare else None)
        std_col = {"reward": "reward_std"}.get(c)
        if std_col and _has(df, std_col):
            sd = df[std_col].reindex(s.index)
            ax.fill_between(s.index, s - sd, s + sd, color=palette[i], alpha=0.2, label=f"{c} +/- std")
    for j, (label, other) in enumerate(compare.items()):
        for c in panel.overlay:
            if _has(other, c):
                s = other[c].dropna()
                ax.plot(
                    s.index,
                    s.to_numpy(),
                    color=palette[len(cols) + j],
                    lw=1.1,
                    ls="--",
                    alpha=0.8,
                    label=f"{label}: {c}",
                )
    for c in cols:
        for st in marks.get(c, []):
            if st in df.index:
                ax.axvline(st, color="crimson", lw=1, ls=":")
                ax.annotate("spike", (st, df.at[st, c]), color="crimson", fontsize=8)
    if panel.logy and all((df[c].dropna() > 0).all() for c in cols):
        ax.set_yscale("log")
    ax.set(title=panel.title, xlabel="step", ylabel=panel.ylabel)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    return fig


def _plot_reward_functions(df: pd.DataFrame, compare: dict[str, pd.DataFrame]) -> Any:
    import matplotlib.pyplot as plt
    import seaborn as sns

    names = [
        c[len("rewards/") : -len("/mean")]
        for c in df.columns
        if c.startswith("rewards/") and c.endswith("/mean") and _has(df, c)
    ]
    if not names:
        return None
    with sns.axes_style("whitegrid"):
        fig, axes = plt.subplots(1, len(names), figsize=(4.5 * len(names), 3.8), squeeze=False)
    palette = sns.color_palette("tab10", 1 + len(compare))
    for ax, n in zip(axes[0], names):
        s = df[f"rewards/{n}/mean"].dropna()
        ax.plot(s.index, s.to_numpy(), color=palette[0], lw=1.6, label="this run")
        if _has(df, f"rewards/{n}/std"):
            sd = df[f"rewards/{n}/std"].reindex(s.index)
            ax.fill_between(s.index, s - sd, s + sd, color=palette[0], alpha=0.2)
        for j, (label, other) in enumerate(compare.items()):
            if _has(other, f"rewards/{n}/mean"):
                o = other[f"rewards/{n}/mean"].dropna()
                ax.plot(o.index, o.to_numpy(), color=palette[1 + j], ls="--", lw=1.1, label=label)
        ax.set(title=f"reward: {n}", xlabel="step", ylabel="mean +/- std")
        if compare:
            ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_curves(
    df: pd.DataFrame,
    out_dir: str | Path,
    compare: dict[str, pd.DataFrame] | None = None,
    diagnostics: list[dict[str, Any]] | None = None,
    close: bool = True,
) -> dict[str, Path]:
    """Render every panel whose metrics were logged; PNGs under ``out_dir`` (and the active MLflow run).
    A panel with no logged metric is skipped rather than drawn empty. ``close=False`` leaves the figures
    open so a notebook shows them."""
    import matplotlib.pyplot as plt

    from hermes_lab.core import tracking

    compare = compare or {}
    marks = {
        "kl": [
            d["step"]
            for d in diagnostics or []
            if d["rule"] == "kl_spike" and d["severity"] != "ok" and d["step"] is not None
        ]
    }
    out_dir = Path(out_dir)
    written: dict[str, Path] = {}
    figs = [(p.name, _plot_panel(p, df, compare, marks)) for p in PANELS[:1]]
    figs.append(("reward_functions", _plot_reward_functions(df, compare)))
    figs += [(p.name, _plot_panel(p, df, compare, marks)) for p in PANELS[1:]]
    for name, fig in figs:
        if fig is None:
            continue
        written[name] = tracking.log_figure(fig, out_dir / f"{name}.png", laid_out=True)  # tight_layout() above
        if close:
            plt.close(fig)
    return written
