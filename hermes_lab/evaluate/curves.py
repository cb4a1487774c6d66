"""Per-step training curves of a GRPO run, for the validate stage's inspection and the round comparison.

Reads a training run's curves from MLflow (the run id in ``<round_dir>/train/run.json``; the train stage
logs TRL's metrics as ``train/<TRL name>``) or, when MLflow is off or does not have the run, from
``<round_dir>/train/train_log.jsonl`` (one TRL log dict per line plus "step"); and the curves of earlier
rounds (``runs/round-NN/train/``). Writes nothing.

    python -c "from hermes_lab.evaluate.curves import load_curves; print(load_curves('runs/round-01/train').tail())"
"""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hermes_lab.core.jsonl import iter_objects
from hermes_lab.core.layout import RoundLayout, TrainLayout

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

_RUN_ID = re.compile(r"^[0-9a-f]{32}$")


def _num(value: Any) -> float | None:
    """A logged value as float; None for things that are not numbers (strings, lists)."""
    if value is None:  # JSON cannot hold NaN: a logger that sanitises NaN writes null
        return math.nan
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return float(value)
    return None


def _frame(rows: dict[int, dict[str, float]], source: str) -> pd.DataFrame:
    import pandas as pd

    df = pd.DataFrame.from_dict(rows, orient="index").sort_index()
    df.index = df.index.astype(int)
    df.index.name = "step"
    # Missing cells (a key not logged at that step) and logged NaN look alike in a frame; the NaN rule
    # must only see the latter, so the loaders record the non-finite cells that were really logged.
    nonfinite: dict[str, list[int]] = {}
    for step, vals in rows.items():
        for k, v in vals.items():
            if not math.isfinite(v):
                nonfinite.setdefault(k, []).append(int(step))
    df.attrs["nonfinite"] = {k: sorted(v) for k, v in nonfinite.items()}
    df.attrs["source"] = source
    return df


def load_train_log(path: str | Path) -> pd.DataFrame:
    """Curves from a ``train_log.jsonl`` as a DataFrame indexed by step (later lines win per step)."""
    p = Path(path)
    if p.is_dir():
        p = TrainLayout(p).train_log
    if not p.is_file():
        raise FileNotFoundError(f"training log not found: {p}")
    rows: dict[int, dict[str, float]] = {}
    for lineno, rec in iter_objects(p):
        if "step" not in rec:
            raise ValueError(f"{p}:{lineno}: no 'step' key (every log line needs the optimizer step)")
        try:
            step = int(rec["step"])
        except (TypeError, ValueError):
            raise ValueError(f"{p}:{lineno}: 'step' must be an integer, got {rec['step']!r}") from None
        vals = {k: v for k, v in ((k, _num(v)) for k, v in rec.items() if k != "step") if v is not None}
        rows.setdefault(step, {}).update(vals)  # e.g. the end-of-training summary shares the last step
    if not rows:
        raise ValueError(f"{p}: no log lines")
    return _frame(rows, str(p))


def _curve_keys(keys: set[str]) -> dict[str, str]:
    """MLflow key -> curve name. The train stage logs TRL's per-step metrics as ``train/<TRL name>`` (the
    ``stage/metric`` namespace); its summaries (train.SUMMARY_METRICS) are not curves. A run without
    ``train/`` keys (logged by another integration) is read as is."""
    from hermes_lab.train.grpo import SUMMARY_METRICS

    prefix = "train/"
    staged = {k: k[len(prefix) :] for k in keys if k.startswith(prefix)}
    if not staged:
        return {k: k for k in keys}
    return {k: name for k, name in staged.items() if name not in SUMMARY_METRICS}


def load_mlflow_curves(run_id: str, tracking_uri: str | None = None) -> pd.DataFrame:
    """Every per-step metric of an MLflow training run (the last value logged at a step wins)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    run = client.get_run(run_id)
    names = _curve_keys(set(run.data.metrics))
    if not names:
        raise ValueError(f"MLflow run {run_id} has no metrics")
    rows: dict[int, dict[str, float]] = {}
    for key in sorted(names):
        hist = sorted(client.get_metric_history(run_id, key), key=lambda m: (m.step, m.timestamp))
        for m in hist:
            rows.setdefault(int(m.step), {})[names[key]] = float(m.value)
    return _frame(rows, f"mlflow:{run_id}")


def read_run_json(train_dir: str | Path) -> dict[str, Any]:
    p = TrainLayout(train_dir).run
    if not p.is_file():
        return {}
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{p}: not valid JSON ({e.msg})") from None
    return data if isinstance(data, dict) else {}


def load_curves(
    train_dir: str | Path | None = None,
    run_id: str | None = None,
    tracking_uri: str | None = None,
    runs_dir: str | Path = "runs",
) -> pd.DataFrame:
    """Curves of one training run: MLflow first (``run_id`` or run.json's), else train_log.jsonl.

    ``df.attrs["source"]`` says which one was used, ``df.attrs["fallback"]`` why MLflow was not.
    """
    run_id = run_id or (read_run_json(train_dir).get("mlflow_run_id") if train_dir else None)
    why = "no MLflow run id"
    if run_id:
        try:
            from hermes_lab.core import tracking

            df = load_mlflow_curves(run_id, tracking_uri or tracking.tracking_uri(runs_dir))
            if "reward" in df.columns or train_dir is None:
                return _with_logged_nans(df, train_dir)
            why = f"MLflow run {run_id} has no 'reward' metric"
        except Exception as e:  # MLflow down, store missing, run deleted: the JSONL still has the curves
            why = f"MLflow unavailable for run {run_id}: {type(e).__name__}: {e}"
            if train_dir is None:
                raise
    if train_dir is None:
        raise ValueError("load_curves needs a train_dir or an MLflow run id")
    df = load_train_log(train_dir)
    df.attrs["fallback"] = why
    return df


def _with_logged_nans(df: pd.DataFrame, train_dir: str | Path | None) -> pd.DataFrame:
    """MLflow curves plus the NaN/inf cells of the JSONL: the train callback logs only finite values to
    MLflow, so a NaN would otherwise vanish from the curves the NaN rule looks at."""
    log = TrainLayout(train_dir).train_log if train_dir is not None else None
    if log is None or not log.is_file():
        return df
    try:
        nonfinite = load_train_log(log).attrs["nonfinite"]
    except ValueError:  # a broken JSONL does not spoil curves MLflow already has
        return df
    merged = {k: list(v) for k, v in df.attrs.get("nonfinite", {}).items()}
    for col, steps in nonfinite.items():
        for st in steps:
            df.loc[st, col] = math.nan  # adds the row/column when MLflow has none
        merged[col] = sorted(set(merged.get(col, [])) | set(steps))
    df = df.sort_index()
    df.attrs["nonfinite"] = merged
    return df


def round_label(path_or_id: str | Path) -> str:
    """'round-01' for runs/round-01/train, the folder name otherwise, the first 8 chars of a run id."""
    s = str(path_or_id)
    if _RUN_ID.match(s) and not Path(s).exists():
        return s[:8]
    p = Path(s)
    return p.parent.name if p == RoundLayout(p.parent).train.root else p.name


def earlier_train_dirs(round_dir: str | Path) -> list[Path]:
    """Train dirs of the rounds before ``round_dir`` (runs/round-NN/train with a log), oldest first."""
    rd = Path(round_dir)
    m = re.search(r"(\d+)$", rd.name)
    current = int(m.group(1)) if m else None
    out: list[tuple[int, Path]] = []
    for d in rd.parent.glob("round-*"):
        dm = re.search(r"(\d+)$", d.name)
        if not dm or d.resolve() == rd.resolve():
            continue
        n = int(dm.group(1))
        if current is not None and n >= current:
            continue
        t = RoundLayout(d).train
        if t.train_log.is_file() or t.run.is_file():
            out.append((n, t.root))
    return [p for _, p in sorted(out)]


def load_comparisons(
    items: list[str | Path], tracking_uri: str | None = None, runs_dir: str | Path = "runs"
) -> dict[str, pd.DataFrame]:
    """Curves of earlier rounds by label; an item is a train dir or an MLflow run id. Bad ones are skipped
    with a printed note: a missing old round must not stop today's inspection."""
    out: dict[str, pd.DataFrame] = {}
    for item in items:
        s = str(item).strip()
        if not s:
            continue
        try:
            if Path(s).exists():
                df = load_curves(s, tracking_uri=tracking_uri, runs_dir=runs_dir)
            else:
                df = load_curves(None, run_id=s, tracking_uri=tracking_uri, runs_dir=runs_dir)
        except Exception as e:
            print(f"inspect: skipping comparison {s}: {e}", file=sys.stderr)
            continue
        out[round_label(s)] = df
    return out
