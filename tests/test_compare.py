"""hermes_lab.compare: the rounds table and curves, from a real SQLite MLflow store, in the stage/metric namespace."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hermes_lab import compare, tracking
from hermes_lab.config import load_config
from hermes_lab.stages import all_gates


def _round(cfg, n: int, reward: list[float], delta: float, promoted: bool, gates: dict[str, bool | None]) -> None:
    """What a round leaves behind: a parent run with nested stage runs, and summary.json."""
    tracking.setup(cfg.round.runs_dir, cfg.round.experiment)
    parent = tracking.start_round_run(f"round-{n:02d}", {"round.number": n})
    with tracking.stage_run("train", parent, cfg.round.runs_dir, cfg.round.experiment):
        for step, r in enumerate(reward, 1):
            tracking.log_metrics("train", {"reward": r, "kl": 0.01 * step}, step=step)
        tracking.log_metrics("train", {"eval_pass_rate_before": 0.4, "eval_pass_rate_after": 0.4 + delta})
    with tracking.stage_run("ab", parent, cfg.round.runs_dir, cfg.round.experiment):
        tracking.log_metrics("ab", {"delta": delta, "p_value": 0.01})
    summary = {
        "round": n,
        "status": "promoted" if promoted else "rolled back",
        "decision": "promote" if promoted else "roll back",
        "promoted": promoted,
        "parent_run_id": parent,
        "total_s": 1.0,
        "gates": [{"gate": g, "passed": p, "detail": ""} for g, p in gates.items()],
    }
    rd = Path(cfg.round.runs_dir) / f"round-{n:02d}"
    rd.mkdir(parents=True, exist_ok=True)
    (rd / "summary.json").write_text(json.dumps(summary))


def test_rounds_table_and_curves_use_the_registry_and_the_namespace(tmp_path, mlflow_store):
    cfg = load_config(None, {"round.runs_dir": str(tmp_path / "runs")})
    every = [g for _, g in all_gates()]
    _round(cfg, 1, [1.0, 2.0, 3.0], 0.1, True, dict.fromkeys(every, True))
    _round(cfg, 2, [2.5, 2.0], -0.2, False, {"min_samples": True, "cooldown": False})  # stopped early
    table = compare.rounds_table(cfg)
    assert list(table.index) == [1, 2]
    assert [c for c in table.columns if c.startswith("gate:")] == [f"gate:{g}" for g in every]
    assert table.loc[2, "gate:cooldown"] == "stop" and table.loc[2, "gate:regression"] == "not run"
    assert table.loc[1, "train/reward"] == 3.0 and table.loc[2, "ab/delta"] == pytest.approx(-0.2)
    assert table.loc[1, "train/eval_pass_rate_after"] == pytest.approx(0.5)
    assert table.loc[1, "validate/regression_delta"] is None  # no validate run in these rounds
    curves = compare.step_curves(cfg)
    got = curves[curves["metric"] == "train/reward"].groupby("round")["value"].apply(list).to_dict()
    assert got == {1: [1.0, 2.0, 3.0], 2: [2.5, 2.0]}
    paths = compare.plot_rounds(cfg, table, tmp_path / "compare")
    assert [p.name for p in paths] == ["rounds.png", "curves_by_round.png"] and all(
        p.stat().st_size > 5000 for p in paths
    )
