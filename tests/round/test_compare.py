"""hermes_lab.round.compare: the rounds table, the pass rate by round and the curves, from a real SQLite MLflow store
and real round folders (summary.json, or only the stage files of the round in flight), in the stage/metric
namespace."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from hermes_lab.config.schema import load_config
from hermes_lab.core import tracking
from hermes_lab.core.verdict import gate, write_verdict
from hermes_lab.round import compare
from hermes_lab.round.stages import all_gates


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
    # no eval in these summaries: the pass-rate plot still draws both rounds (their statuses, no line)
    assert [p.name for p in paths] == ["pass_rate_by_round.png", "rounds.png", "curves_by_round.png"] and all(
        p.stat().st_size > 5000 for p in paths
    )


# ------------------------------------------------------------------------------- pass rate by round
def _eval(before: float, after: float, tasks: int = 300, per_task: int = 2) -> dict:
    """The train stage's eval.json shape (hermes_lab.train.grpo._eval_before_after, policy.evaluate)."""
    side = lambda p: {"pass_rate": p, "mean_reward": 3.0, "n": tasks * per_task, "samples_per_task": per_task}  # noqa: E731
    return {"before": side(before), "after": side(after), "gain_points": round(100 * (after - before), 1)}


def _finished(cfg, n: int, status: str, decision, promoted: bool, ev, ab_delta=None) -> None:
    """A finished round as round.outcome.finish_round leaves it: summary.json, its parent run and stage runs."""
    tracking.setup(cfg.round.runs_dir, cfg.round.experiment)
    parent = tracking.start_round_run(f"round-{n:02d}", {"round.number": n})
    if ab_delta is not None:
        with tracking.stage_run("ab", parent, cfg.round.runs_dir, cfg.round.experiment):
            tracking.log_metrics("ab", {"delta": ab_delta})
    pass_rate = ((ev["after"] if promoted else ev["before"])["pass_rate"]) if ev else None
    rd = Path(cfg.round.runs_dir) / f"round-{n:02d}"
    rd.mkdir(parents=True)
    summary = {"round": n, "status": status, "decision": decision, "promoted": promoted, "pass_rate": pass_rate}
    summary |= {"eval": ev, "parent_run_id": parent, "gates": [], "total_s": 1.0}
    (rd / "summary.json").write_text(json.dumps(summary))
    (rd / "progress.json").write_text(json.dumps({"round": n, "parent_run_id": parent, "status": "done"}))


def _in_flight(cfg, n: int, ev, candidate: dict, completed=("execute", "prep", "review", "train", "validate", "ab")):
    """The round whose compare stage is running: progress.json and the stage verdicts, no summary.json."""
    tracking.setup(cfg.round.runs_dir, cfg.round.experiment)
    parent = tracking.start_round_run(f"round-{n:02d}", {"round.number": n})
    with tracking.stage_run("ab", parent, cfg.round.runs_dir, cfg.round.experiment):
        tracking.log_metrics("ab", {"delta": candidate["delta"]})
    rd = Path(cfg.round.runs_dir) / f"round-{n:02d}"
    write_verdict(rd / "prep", "prep", [gate("min_samples", True, ""), gate("cooldown", True, "")])
    write_verdict(
        rd / "train", "train", [gate("training_health", True, "")], adapter=str(rd / "train/adapter"), eval=ev
    )
    (rd / "train" / "eval.json").write_text(json.dumps(ev))
    write_verdict(rd / "ab", "ab", [gate("ab_decision", candidate["promoted"], "")], candidate=candidate)
    prog = {"round": n, "parent_run_id": parent, "completed": list(completed), "timings": {"ab": 2.0}}
    (rd / "progress.json").write_text(json.dumps({**prog, "status": "running"}))
    return rd


HOLD = {"decision": "hold", "promoted": False, "rolled_back": False, "delta": 0.01, "p_value": 0.4}


def test_pass_rate_by_round_has_every_round_with_its_status_and_intervals(tmp_path, mlflow_store):
    cfg = load_config(None, {"round.runs_dir": str(tmp_path / "runs")})
    _finished(cfg, 1, "promoted", "promote", True, _eval(0.30, 0.50), ab_delta=0.4)
    _finished(cfg, 2, "candidate held (hold)", "hold", False, _eval(0.50, 0.53), ab_delta=0.02)
    _finished(cfg, 3, "rolled back", "roll back", False, _eval(0.50, 0.41), ab_delta=-0.3)
    _finished(cfg, 4, "skipped: data gate", None, False, None)  # prep stopped it: no training, no eval
    rd5 = _in_flight(cfg, 5, _eval(0.50, 0.58), HOLD)

    rates = compare.pass_rate_by_round(cfg)
    assert list(rates.index) == [1, 2, 3, 4, 5] and rates.index.dtype.kind == "i"
    assert list(rates["status"]) == [
        "promoted",
        "candidate held (hold)",
        "rolled back",
        "skipped: data gate",
        "candidate held (hold)",  # round 5 so far, from its A/B verdict
    ]
    assert list(rates["kind"]) == ["promoted", "held", "rolled back", "skipped", "held"]
    assert list(rates["in_progress"]) == [False, False, False, False, True]
    # the champion: the promoted candidate after round 1, then carried on holds / rollbacks / the skip
    assert list(rates["champion"]) == pytest.approx([0.50, 0.50, 0.50, 0.50, 0.50])
    assert list(rates["champion_carried"]) == [False, False, False, True, False]
    assert rates.loc[4, "champion_lo"] == rates.loc[3, "champion_lo"]  # the carried interval, not a new one
    assert math.isnan(rates.loc[4, "candidate"]) and rates.loc[5, "candidate"] == pytest.approx(0.58)
    assert list(rates["champion_n"]) == [300.0] * 5  # tasks, not samples: 2 samples of a task are not independent
    for col in ("champion", "candidate"):
        got = rates[rates[col].notna()]
        assert ((got[f"{col}_lo"] >= 0) & (got[f"{col}_lo"] < got[col])).all()
        assert ((got[f"{col}_hi"] <= 1) & (got[f"{col}_hi"] > got[col])).all()
    trained = rates[rates["gain"].notna()]
    assert list(trained.index) == [1, 2, 3, 5]
    assert ((trained["gain_lo"] < trained["gain"]) & (trained["gain"] < trained["gain_hi"])).all()
    assert rates.loc[1, "gain_lo"] > 0 and rates.loc[3, "gain_hi"] < 0  # +20 points is real, -9 points too
    assert rates.loc[2, "gain_lo"] < 0 < rates.loc[2, "gain_hi"]  # +3 points on 300 tasks is not

    # the rounds table has the round in flight too, its gates from its verdicts, its A/B from MLflow
    table = compare.rounds_table(cfg)
    assert list(table.index) == [1, 2, 3, 4, 5]
    assert table.loc[5, "status"] == "candidate held (hold)" and table.loc[5, "ab/delta"] == pytest.approx(0.01)
    assert table.loc[5, "gate:training_health"] == "pass" and table.loc[5, "gate:regression"] == "not run"

    paths = compare.plot_rounds(cfg, table, rd5 / "compare", rates)
    assert [p.name for p in paths] == ["pass_rate_by_round.png", "rounds.png"]  # no step history logged here
    assert all(p.stat().st_size > 10000 for p in paths)


def test_round_axis_puts_every_round_on_an_integer_tick_and_names_the_skipped_one(tmp_path, mlflow_store):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg = load_config(None, {"round.runs_dir": str(tmp_path / "runs")})
    _finished(cfg, 1, "promoted", "promote", True, _eval(0.30, 0.50))
    _finished(cfg, 2, "skipped: data gate", None, False, None)
    _in_flight(cfg, 3, _eval(0.50, 0.40), {**HOLD, "decision": "roll back", "rolled_back": True})
    rates = compare.pass_rate_by_round(cfg)
    fig, ax = plt.subplots()
    compare._round_axis(ax, rates)
    assert list(ax.get_xticks()) == [1, 2, 3]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["1", "2", "3*"]  # * : in progress
    assert [t.get_text() for t in ax.texts] == ["skipped: data gate"]
    plt.close(fig)
    assert rates.loc[3, "status"] == "rolled back" and rates.loc[3, "champion"] == pytest.approx(0.50)


def test_a_resumed_round_is_read_from_its_stage_files_not_its_old_summary(tmp_path, mlflow_store):
    cfg = load_config(None, {"round.runs_dir": str(tmp_path / "runs")})
    _finished(cfg, 1, "promoted", "promote", True, _eval(0.30, 0.50))
    # round 2 waited for review (its summary says so), was resumed and is now at its compare stage
    rd = _in_flight(cfg, 2, _eval(0.50, 0.62), {**HOLD, "decision": "promote", "promoted": True})
    (rd / "summary.json").write_text(json.dumps({"round": 2, "status": "awaiting review", "eval": None}))
    rates = compare.pass_rate_by_round(cfg)
    assert rates.loc[2, "status"] == "promoted" and rates.loc[2, "in_progress"]
    assert rates.loc[2, "champion"] == pytest.approx(0.62)  # a promotion moves the champion to the candidate


def test_a_round_that_failed_or_stopped_before_training_is_a_stopped_tick(tmp_path, mlflow_store):
    cfg = load_config(None, {"round.runs_dir": str(tmp_path / "runs")})
    _finished(cfg, 1, "stopped: training health", None, False, None)
    rd = Path(cfg.round.runs_dir) / "round-02"
    rd.mkdir()
    (rd / "progress.json").write_text(json.dumps({"round": 2, "completed": ["execute", "prep"], "status": "failed"}))
    rates = compare.pass_rate_by_round(cfg)
    assert list(rates["status"]) == ["stopped: training health", "failed at review"]
    assert list(rates["kind"]) == ["stopped", "stopped"]
    assert rates["champion"].isna().all() and not rates["champion_carried"].any()  # nothing measured yet
    assert compare.plot_pass_rate(rates, tmp_path / "out").stat().st_size > 5000


def test_wilson_matches_scipy_and_stays_in_the_unit_interval():
    from scipy.stats import binomtest

    for k, n in ((0, 300), (17, 300), (150, 300), (300, 300), (3, 7)):
        ref = binomtest(k, n).proportion_ci(confidence_level=0.95, method="wilson")
        assert compare.wilson(k / n, n) == pytest.approx((ref.low, ref.high), abs=1e-9)
    assert all(math.isnan(v) for v in compare.wilson(0.5, 0))


def test_the_compare_notebook_plots_the_round_in_flight(tmp_path, mlflow_store):
    """notebooks/50_round_compare.ipynb under papermill, as the round runs it (stage 50, before summary.json):
    the kernel sees the same store (MLFLOW_TRACKING_URI), files the plots under the round and in MLflow."""
    from hermes_lab.round.runner import run_notebook

    runs = tmp_path / "runs"
    cfg_path = tmp_path / "params.yaml"
    cfg_path.write_text(f"round:\n  runs_dir: {runs}\n")
    cfg = load_config(str(cfg_path))
    _finished(cfg, 1, "promoted", "promote", True, _eval(0.30, 0.50), ab_delta=0.4)
    _finished(cfg, 2, "skipped: data gate", None, False, None)
    rd = _in_flight(cfg, 3, _eval(0.50, 0.55), HOLD)
    parent = json.loads((rd / "progress.json").read_text())["parent_run_id"]
    params = {"config_path": str(cfg_path), "round_dir": str(rd), "parent_run_id": parent}
    run_notebook("50_round_compare.ipynb", rd / "50_round_compare.ipynb", params)
    assert (rd / "compare" / "pass_rate_by_round.png").stat().st_size > 10000
    assert (rd / "compare" / "rounds.png").is_file()
    nested = mlflow_store.search_runs(
        experiment_names=["hermes-lab"], filter_string=f"tags.mlflow.parentRunId = '{parent}'", output_format="list"
    )
    compare_run = next(r for r in nested if r.info.run_name == "compare")
    logged = [a.path for a in mlflow_store.MlflowClient().list_artifacts(compare_run.info.run_id, "plots")]
    assert "plots/pass_rate_by_round.png" in logged and "plots/rounds.png" in logged


def test_print_flywheel_reports_each_gain_and_the_total(capsys):
    def ev(b, a, lo=None, hi=None):
        return {
            "before": {"pass_rate": b},
            "after": {"pass_rate": a},
            "gain": {"gain": a - b, "gain_lo": lo, "gain_hi": hi, "gain_tasks": 300},
        }

    compare.print_flywheel(
        [
            {"round": 1, "status": "promoted", "promoted": True, "pass_rate": 0.5, "eval": ev(0.3, 0.5, 0.15, 0.25)},
            {
                "round": 2,
                "status": "candidate held (keep observing)",
                "promoted": False,
                "pass_rate": 0.5,
                "eval": ev(0.5, 0.48),
            },
            {"round": 3, "status": "skipped (data gate)", "promoted": False, "pass_rate": None, "eval": None},
            {"round": 4, "status": "promoted", "promoted": True, "pass_rate": 0.56, "eval": ev(0.5, 0.56, 0.02, 0.1)},
        ]
    )
    out = capsys.readouterr().out
    assert "+20.0 points (95% CI +15.0 to +25.0, paired over 300 tasks)" in out
    assert "candidate 48.0%: -2.0 points" in out
    assert "champion 30.0% -> 56.0% (+26.0 points), rose in 2 of 4 rounds" in out
