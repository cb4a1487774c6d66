"""Validate stage, part 1: reward-curve / KL inspection of a GRPO training run, with diagnostics.

Reads a training run's per-step curves (``hermes_lab.evaluate.curves``: MLflow, the run id in
``<round_dir>/train/run.json``, or ``<round_dir>/train/train_log.jsonl``), and those of earlier rounds
(``runs/round-NN/train/``), which the plots (``hermes_lab.evaluate.plots``) overlay for comparison.

Writes under ``<round_dir>/validate/``:
- ``plots/*.png``: reward mean with a +/-std band, per-reward-function curves, KL, frac_reward_zero_std,
  entropy, completion lengths, clip ratios, learning rate, loss / grad norm (also logged to MLflow);
- for a run with an episode phase (``<train_dir>/episodes/``): the same plots under ``plots/episodes/`` plus
  episode success, tool errors, turns and tool calls per episode; its diagnostics as ``episodes:<rule>``, and
  ``episodes.by_turns`` in diagnostics.json (episodes by the turns they took: success, reward, tool calls);
- ``diagnostics.json``: one entry per rule of thumb {rule, severity (ok/warn/fail), step, value, message,
  advice} -- KL spike, KL above the guard, reward not rising, NaN anywhere, groups with zero reward
  spread, reward outliers -- with the user's advice in plain words (docs/SPEC.md, "Rules of thumb").

    hermes-lab inspect --train-dir runs/round-01/train --output runs/round-01/validate
    python -m hermes_lab.evaluate.inspect --train-dir runs/round-02/train --compare runs/round-01/train --output ...

The notebook notebooks/30_inspect_validate.ipynb calls the same functions. Heavy imports (pandas,
matplotlib, mlflow, scipy) live inside functions so that ``hermes-lab --help`` stays fast.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hermes_lab.core.jsonl import write_json_atomic
from hermes_lab.core.layout import TrainLayout, ValidateLayout
from hermes_lab.evaluate.curves import earlier_train_dirs, load_comparisons, load_curves
from hermes_lab.evaluate.plots import plot_curves

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

SEVERITIES = ("ok", "warn", "fail")
RULES = ("nan", "kl_spike", "kl_high", "reward_rising", "zero_std_groups", "reward_outliers")
SUSTAIN_STEPS = 3  # steps after a KL spike looked at to tell a sustained jump from one noisy batch


# ------------------------------------------------------------------------------------------- diagnostics
def _diag(
    rule: str, severity: str, message: str, advice: str = "", step: Any = None, value: Any = None
) -> dict[str, Any]:
    v = None if value is None or not math.isfinite(float(value)) else float(value)
    return {
        "rule": rule,
        "severity": severity,
        "step": None if step is None else int(step),
        "value": v,
        "message": message,
        "advice": advice,
    }


def _finite(df: pd.DataFrame, col: str) -> pd.Series:
    import numpy as np
    import pandas as pd

    if col not in df.columns:
        return pd.Series(dtype=float)
    s = df[col].astype(float)
    return s[np.isfinite(s.to_numpy())]


def _mad(a: Any) -> float:
    import numpy as np

    a = np.asarray(a, dtype=float)
    return float(np.median(np.abs(a - np.median(a)))) if a.size else math.nan


def _neighbour_median(a: Any, window: int) -> Any:
    """Median of the ``window`` points around each point, the point itself left out: with it in, a
    median smoother returns many exact-zero residuals and the MAD underestimates the noise."""
    import numpy as np

    h, n = max(1, window // 2), len(a)
    out = np.empty(n)
    for i in range(n):
        # a full-size window shifted inwards at both ends: three edge points would be a noisy median
        lo = max(0, min(i - h, n - 1 - 2 * h))
        nb = np.concatenate([a[lo:i], a[i + 1 : lo + 2 * h + 1]])
        out[i] = np.median(nb) if nb.size else a[i]
    return out


def check_nan(df: pd.DataFrame) -> dict[str, Any]:
    """NaN / inf anywhere that was really logged (missing keys are not NaN)."""
    import numpy as np

    cells = df.attrs.get("nonfinite")
    if cells is None:  # a frame built by hand: every non-finite cell counts
        cells = {c: [int(i) for i in df.index[~np.isfinite(df[c].astype(float).to_numpy())]] for c in df.columns}
    cells = {c: s for c, s in cells.items() if s}
    if not cells:
        return _diag("nan", "ok", "no NaN or inf in any logged metric")
    first = min(min(s) for s in cells.values())
    cols = sorted(c for c, s in cells.items() if first in s)
    more = sorted(set(cells) - set(cols))
    msg = f"NaN/inf at step {first} in {', '.join(cols)}"
    if more:
        msg += f" (later also in {', '.join(more)})"
    return _diag(
        "nan",
        "fail",
        msg,
        step=first,
        advice="Look for reward outliers in the training data and normalise the rewards (clip to "
        "0..scale, scale_rewards); lower grpo.learning_rate if the loss still blows up.",
    )


def check_kl_spike(
    df: pd.DataFrame, window: int = 10, k: float = 6.0, min_jump: float = 0.02, ratio: float = 3.0
) -> dict[str, Any]:
    """A KL value that jumps over the rolling median of the previous ``window`` steps (plus their trend)
    by more than ``k`` robust standard deviations (1.4826 * MAD, at least 10% of the median), by at
    least ``min_jump`` in absolute terms and to at least ``ratio`` times the expected value. Per-batch KL
    is noisy (1.5x wiggles are normal); a policy that runs off multiplies it. Causal (only past steps);
    a steady rise of KL is not a spike. 'fail' when KL stays up afterwards, 'warn' for a lone batch."""
    import numpy as np

    s = _finite(df, "kl")
    if s.size == 0:
        return _diag("kl_spike", "ok", "no KL logged (kl_coefficient 0 disables it): nothing to check")
    prev = s.shift(1)
    minp = min(3, window)
    roll = prev.rolling(window, min_periods=minp)
    med, count = roll.median(), roll.count()
    mad = roll.apply(_mad, raw=True)
    # KL normally grows during training and a trailing median lags a trend by ~window/2 steps: add the
    # window's median step-to-step rise so steady growth is not read as a jump (never a fall: stay causal
    # and conservative)
    drift = prev.diff().rolling(window - 1, min_periods=max(1, minp - 1)).median().fillna(0).clip(lower=0)
    expected = med + drift * (count + 1) / 2
    # the floor keeps a flat (MAD 0) early KL from turning every wiggle into a "spike"
    scale = np.maximum(1.4826 * mad, 0.1 * med.abs()).clip(lower=1e-12)
    jump = s - expected
    hit = (jump > k * scale) & (jump > min_jump) & (s >= ratio * expected)
    if not hit.any():
        return _diag(
            "kl_spike",
            "ok",
            f"KL has no spike (max {s.max():.4g} at step {int(s.idxmax())})",
            step=int(s.idxmax()),
            value=s.max(),
        )
    # Sustained (the next steps stay up: the policy moved away) fails; an isolated batch that KL comes
    # straight back from warns. A spike in the last logged step cannot be told apart: it fails.
    steps = list(s.index)
    sustained = []
    for st in s.index[hit.to_numpy()]:
        after = s.iloc[steps.index(st) + 1 : steps.index(st) + 1 + SUSTAIN_STEPS]
        sustained.append(after.empty or float(after.median()) > expected[st] + 0.5 * jump[st])
    hits = [int(st) for st in s.index[hit.to_numpy()]]
    first = next((st for st, sus in zip(hits, sustained) if sus), hits[0])
    kind = "sustained" if any(sustained) else "isolated: KL came back down in the next steps"
    peak_step = int(s[hit].idxmax())
    return _diag(
        "kl_spike",
        "fail" if any(sustained) else "warn",
        f"KL spike at step {first}: {s[first]:.4g} where the last {int(count[first])} steps predict "
        f"{expected[first]:.4g} ({kind}; peak {s[peak_step]:.4g} at step {peak_step}; {len(hits)} "
        f"spiking step(s))",
        step=first,
        value=s[first],
        advice=f"KL spike at step {first}: the policy ran off; raise kl_coefficient and rerun.",
    )


def check_kl_high(df: pd.DataFrame, kl_warn: float = 0.5) -> dict[str, Any]:
    """KL above the training guard (grpo.kl_warn): KL should stay bounded."""
    s = _finite(df, "kl")
    if s.size == 0:
        return _diag("kl_high", "ok", "no KL logged: nothing to check")
    over = s[s > kl_warn]
    if over.empty:
        return _diag(
            "kl_high", "ok", f"KL stays below {kl_warn:g} (max {s.max():.4g})", step=int(s.idxmax()), value=s.max()
        )
    first = int(over.index[0])
    return _diag(
        "kl_high",
        "warn",
        f"KL exceeds {kl_warn:g} from step {first} (max {s.max():.4g})",
        step=first,
        value=over.iloc[0],
        advice="KL is not staying bounded: raise grpo.kl_coefficient (or lower the learning rate) and rerun.",
    )


def check_reward_rising(
    df: pd.DataFrame, window_frac: float = 0.25, alpha: float = 0.05, reward_max: float | None = None
) -> dict[str, Any]:
    """Compare the first and the last window of the reward with a one-sided Welch t-test, plus a
    Theil-Sen slope: 'ok' when the rise is significant, 'warn' when flat, 'fail' when it falls."""
    import numpy as np
    from scipy import stats

    s = _finite(df, "reward")
    if s.size == 0:
        return _diag(
            "reward_rising",
            "warn",
            "no reward curve logged",
            advice="Check the training log: the trainer must log 'reward' every logging step.",
        )
    if s.size < 6:
        return _diag(
            "reward_rising",
            "warn",
            f"only {s.size} reward points: too few to judge the trend",
            step=int(s.index[-1]),
            value=s.iloc[-1],
            advice="Train longer (grpo.max_steps) or log more often (grpo.logging_steps).",
        )
    w = max(3, int(round(s.size * window_frac)))
    first, last = s.iloc[:w].to_numpy(), s.iloc[-w:].to_numpy()
    slope = float(stats.theilslopes(s.to_numpy(), s.index.to_numpy(dtype=float))[0])
    d = float(last.mean() - first.mean())
    with np.errstate(all="ignore"):
        p_up = float(stats.ttest_ind(last, first, equal_var=False, alternative="greater").pvalue)
        p_down = float(stats.ttest_ind(last, first, equal_var=False, alternative="less").pvalue)
    desc = (
        f"reward {first.mean():.3g} over the first {w} steps -> {last.mean():.3g} over the last {w} "
        f"(delta {d:+.3g}, slope {slope:+.3g}/step"
    )
    step, val = int(s.index[-1]), float(last.mean())
    if reward_max and first.mean() >= 0.95 * reward_max:
        return _diag("reward_rising", "ok", desc + "): reward already near its maximum", step=step, value=val)
    if d > 0 and (p_up < alpha or (math.isnan(p_up) and slope > 0)):
        return _diag("reward_rising", "ok", desc + f", p={p_up:.3g}): reward rises", step=step, value=val)
    if d < 0 and (p_down < alpha or (math.isnan(p_down) and slope < 0)):
        return _diag(
            "reward_rising",
            "fail",
            desc + f", p={p_down:.3g}): reward falls",
            step=step,
            value=val,
            advice="Reward falls during training: the policy is getting worse. Check the reward "
            "functions for bugs and the KL (raise kl_coefficient), lower the learning rate.",
        )
    return _diag(
        "reward_rising",
        "warn",
        desc + f", p={p_up:.3g}): reward is not rising",
        step=step,
        value=val,
        advice="Reward is flat: check groups have reward spread (frac_reward_zero_std; raise "
        "temperature), spot-check the reward model against human labels (>= 90% agreement), "
        "then raise learning_rate or max_steps.",
    )


def check_zero_std_groups(df: pd.DataFrame, warn: float = 0.8, reward_max: float | None = None) -> dict[str, Any]:
    """Share of groups whose completions all got the same reward: zero advantage, no learning signal."""
    s = _finite(df, "frac_reward_zero_std")
    if s.size == 0:
        return _diag("zero_std_groups", "ok", "frac_reward_zero_std not logged: nothing to check")
    mean = float(s.mean())
    if mean <= warn:
        return _diag(
            "zero_std_groups",
            "ok",
            f"groups have reward spread (mean frac_reward_zero_std {mean:.2f} <= {warn:g})",
            step=int(s.idxmax()),
            value=mean,
        )
    over = s[s > warn]
    first = int(over.index[0]) if not over.empty else int(s.index[0])
    sev = "fail" if float(s.min()) >= 0.999 else "warn"
    msg = f"{mean:.0%} of groups (mean over {s.size} steps) have all-equal rewards; above {warn:g} from step {first}"
    r = _finite(df, "reward")
    solved = reward_max and r.size and float(r.loc[r.index >= first].mean()) >= 0.9 * reward_max
    advice = (
        "All rewards equal in a group means zero advantage: raise temperature (grpo.temperature, "
        "0.8-1.0 keeps groups diverse) or group_size."
    )
    if solved:
        advice += " The reward is near its maximum too: the prompts are solved; harder prompts give more signal."
    return _diag("zero_std_groups", sev, msg, step=first, value=mean, advice=advice)


def check_reward_outliers(
    df: pd.DataFrame, z: float = 6.0, window: int = 7, reward_max: float | None = None
) -> dict[str, Any]:
    """Per-step reward (and per-function means) against the median of the neighbouring steps: robust z
    of the residual (residual / (1.4826 * MAD)). Detrending first keeps a rising reward from looking like
    outliers. Reports the worst one."""
    cols = ["reward"] + [c for c in df.columns if c.startswith("rewards/") and c.endswith("/mean")]
    floor = 1e-3 * (reward_max or 1.0)  # a perfectly flat curve has MAD 0: any wiggle is not an outlier
    found: list[tuple[float, int, str, float]] = []
    checked = 0
    for c in cols:
        s = _finite(df, c)
        if s.size < 5:
            continue
        checked += 1
        resid = s - _neighbour_median(s.to_numpy(), window)
        scale = max(1.4826 * _mad(resid.to_numpy()), floor)
        zs = (resid / scale).abs()
        for st in zs.index[zs.to_numpy() > z]:
            found.append((float(zs[st]), int(st), c, float(s[st])))
    if not checked:
        return _diag("reward_outliers", "ok", "too few reward points to look for outliers")
    if not found:
        return _diag("reward_outliers", "ok", f"no per-step reward outliers (robust z <= {z:g})")
    zmax, st, c, v = max(found)
    steps = sorted({t[1] for t in found})
    return _diag(
        "reward_outliers",
        "warn",
        f"{len(steps)} step(s) with outlying reward (robust z > {z:g}), first at step {steps[0]}; "
        f"worst {c}={v:.4g} at step {st} (z={zmax:.1f})",
        step=st,
        value=v,
        advice="Look for reward outliers in the data (prep flags them) and normalise the rewards; "
        "an outlier-driven update can end in NaN loss.",
    )


def diagnose(
    df: pd.DataFrame,
    *,
    kl_warn: float = 0.5,
    zero_std_warn: float = 0.8,
    kl_spike_k: float = 6.0,
    kl_spike_min_jump: float = 0.02,
    kl_spike_ratio: float = 3.0,
    window: int = 10,
    trend_window: float = 0.25,
    alpha: float = 0.05,
    outlier_z: float = 6.0,
    reward_max: float | None = None,
) -> list[dict[str, Any]]:
    """Every rule of thumb on one run's curves; one entry per rule (severity 'ok' when clean)."""
    return [
        check_nan(df),
        check_kl_spike(df, window=window, k=kl_spike_k, min_jump=kl_spike_min_jump, ratio=kl_spike_ratio),
        check_kl_high(df, kl_warn=kl_warn),
        check_reward_rising(df, window_frac=trend_window, alpha=alpha, reward_max=reward_max),
        check_zero_std_groups(df, warn=zero_std_warn, reward_max=reward_max),
        check_reward_outliers(df, z=outlier_z, reward_max=reward_max),
    ]


def diagnose_with_config(df: pd.DataFrame, cfg: Any) -> list[dict[str, Any]]:
    """``diagnose`` with thresholds from a HermesConfig (grpo guards, validate section, reward scale)."""
    v = cfg.validate
    n_fn = sum(1 for c in df.columns if c.startswith("rewards/") and c.endswith("/mean"))
    weights = cfg.reward.weights or [1.0] * len(cfg.reward.types)
    # TRL's "reward" is the weighted sum of the reward functions, so its ceiling is scale * sum(weights)
    reward_max = cfg.reward.scale * (sum(weights) if n_fn == 0 or n_fn == len(weights) else n_fn)
    return diagnose(
        df,
        kl_warn=cfg.grpo.kl_warn,
        zero_std_warn=cfg.grpo.zero_std_warn,
        kl_spike_k=v.kl_spike_k,
        kl_spike_min_jump=v.kl_spike_min_jump,
        kl_spike_ratio=v.kl_spike_ratio,
        window=v.curve_window,
        trend_window=v.trend_window,
        alpha=v.alpha,
        outlier_z=v.reward_outlier_z,
        reward_max=reward_max,
    )


def worst(diags: list[dict[str, Any]]) -> str:
    return max((d["severity"] for d in diags), key=SEVERITIES.index, default="ok")


# ------------------------------------------------------------------------------------------- tables
def summary_table(df: pd.DataFrame) -> pd.DataFrame:
    """First / last / min / max / mean of every logged metric: the notebook's quick look."""
    import pandas as pd

    rows = []
    for c in df.columns:
        s = df[c].dropna()
        if s.empty:
            continue
        rows.append(
            {
                "metric": c,
                "first": s.iloc[0],
                "last": s.iloc[-1],
                "min": s.min(),
                "max": s.max(),
                "mean": s.mean(),
                "n": int(s.size),
            }
        )
    return pd.DataFrame(rows).set_index("metric") if rows else pd.DataFrame()


# ------------------------------------------------------------------------------------------- the stage
def inspect_run(
    train_dir: str | Path,
    out_dir: str | Path,
    cfg: Any,
    compare: list[str | Path] | None = None,
    run_id: str | None = None,
    close: bool = True,
) -> dict[str, Any]:
    """Load, plot, diagnose; write ``out_dir/diagnostics.json``; log to the active MLflow run if any.
    Returns {"curves", "compare", "diagnostics", "plots", "worst", "path"}."""
    from hermes_lab.core import tracking

    runs_dir = cfg.round.runs_dir
    df = load_curves(train_dir, run_id=run_id, runs_dir=runs_dir)
    others = load_comparisons(list(compare or []), runs_dir=runs_dir)
    diags = diagnose_with_config(df, cfg)
    from hermes_lab.train.state import judge_diagnostic, sandbox_diagnostic  # from health.json

    if (judge := judge_diagnostic(train_dir, cfg.reward.max_judge_failure_rate)) is not None:
        diags.append(judge)
    if (sandbox := sandbox_diagnostic(train_dir)) is not None:
        diags.append(sandbox)
    out_dir, out = Path(out_dir), ValidateLayout(out_dir)
    plots = plot_curves(df, out.plots, compare=others, diagnostics=diags, close=close)
    report = {
        "train_dir": str(train_dir),
        "source": df.attrs.get("source"),
        "fallback": df.attrs.get("fallback"),
        "n_steps": int(len(df)),
        "last_step": int(df.index.max()),
        "worst": worst(diags),
        "compared_with": list(others),
        "plots": {k: str(v) for k, v in plots.items()},
        "diagnostics": diags,
    }
    ep = TrainLayout(train_dir).episodes
    ep_dir = ep.root
    if ep.train_log.is_file():  # the episode phase: its own curves, diagnostics and table
        ep_df = load_curves(ep_dir, runs_dir=runs_dir)
        ep_diags = [{**d, "rule": f"episodes:{d['rule']}"} for d in diagnose_with_config(ep_df, cfg)]
        diags += ep_diags
        ep_plots = plot_curves(ep_df, out.plots / ep_dir.name, diagnostics=ep_diags, close=close)
        report["episodes"] = {
            "n_steps": int(len(ep_df)),
            "plots": {k: str(v) for k, v in ep_plots.items()},
            "by_turns": episode_table(ep_dir).reset_index().to_dict("records"),
        }
        report["worst"] = worst(diags)
        plots.update({f"{ep_dir.name}/{k}": v for k, v in ep_plots.items()})
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out.diagnostics
    write_json_atomic(path, report)
    tracking.log_artifact(path)
    tracking.set_tags({"diagnostics.worst": report["worst"]})
    tracking.log_metrics(
        "validate", {f"diagnostics_{sev}_count": sum(d["severity"] == sev for d in diags) for sev in SEVERITIES[1:]}
    )
    return {
        "curves": df,
        "compare": others,
        "diagnostics": diags,
        "plots": plots,
        "worst": report["worst"],
        "path": path,
    }


def episode_table(episodes_dir: str | Path) -> pd.DataFrame:
    """The episode phase's logged episodes (``samples.jsonl``) by the number of assistant turns they took: how
    many, their success rate, mean reward, tool calls and tool errors per episode (reward by turn)."""
    import json

    import pandas as pd

    rows = []
    path = TrainLayout(episodes_dir).samples
    for line in path.read_text(encoding="utf-8").splitlines() if path.is_file() else []:
        rec = json.loads(line)
        msgs = rec.get("episode") or []
        rows.append(
            {
                "turns": sum(m.get("role") == "assistant" for m in msgs),
                "reward": rec.get("reward"),
                "success": (rec.get("reward") or 0) >= 3,
                "tool_calls": sum(len(m.get("tool_calls") or []) for m in msgs if m.get("role") == "assistant"),
                "tool_errors": sum(
                    m.get("role") == "tool" and str(m.get("content", "")).startswith("{'error'") for m in msgs
                ),
            }
        )
    cols = ["episodes", "success_rate", "mean_reward", "tool_calls", "tool_errors"]
    if not rows:
        return pd.DataFrame(columns=cols).rename_axis("turns")
    df = pd.DataFrame(rows).groupby("turns")
    return pd.DataFrame(
        {
            "episodes": df.size(),
            "success_rate": df["success"].mean().round(4),
            "mean_reward": df["reward"].mean().round(3),
            "tool_calls": df["tool_calls"].mean().round(3),
            "tool_errors": df["tool_errors"].mean().round(3),
        }
    )


def diagnostics_table(diags: list[dict[str, Any]]) -> pd.DataFrame:
    import pandas as pd

    df = pd.DataFrame(diags, columns=["rule", "severity", "step", "value", "message", "advice"]).set_index("rule")
    df["step"] = df["step"].astype("Int64")  # a step, not a float: no "41.0"
    return df


# ------------------------------------------------------------------------------------------- CLI
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--train-dir", required=True, help="Training output dir (train_log.jsonl, run.json).")
    p.add_argument("--run-id", default=None, help="MLflow run id of the training run (default: run.json's).")
    p.add_argument(
        "--compare",
        nargs="*",
        default=None,
        help="Earlier train dirs or run ids to overlay (default: earlier runs/round-*/train).",
    )
    p.add_argument("--params", default=None, help="YAML config (thresholds: grpo guards, validate section).")
    p.add_argument("--output", required=True, help="Where diagnostics.json and plots/ go.")
    p.add_argument("--strict", action="store_true", help="Exit 3 when a diagnostic fails.")


def run_cli(args: argparse.Namespace) -> int:
    from hermes_lab.config.schema import load_config

    cfg = load_config(args.params)
    train_dir = Path(args.train_dir)
    compare = args.compare if args.compare is not None else earlier_train_dirs(train_dir.parent)
    res = inspect_run(train_dir, args.output, cfg, compare=compare, run_id=args.run_id)
    for d in res["diagnostics"]:
        print(f"[{d['severity']:>4}] {d['rule']}: {d['message']}")
        if d["advice"] and d["severity"] != "ok":
            print(f"       advice: {d['advice']}")
    print(f"diagnostics: {res['path']}  plots: {len(res['plots'])} in {ValidateLayout(args.output).plots}")
    return 3 if args.strict and res["worst"] == "fail" else 0


def main(argv: list[str] | None = None) -> int:
    from hermes_lab.core.command import run_module

    return run_module("hermes_lab.evaluate.inspect", add_arguments, run_cli, argv, description=__doc__.split("\n")[0])


if __name__ == "__main__":
    sys.exit(main())
