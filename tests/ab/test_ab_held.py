"""ab-run end to end with covariates (hermes_lab.ab.covariates / adjust) and the honest end of an undecided
rollout (hermes_lab.ab.held): the report shows what the adjustment bought, per stage and in MLflow; a stage
that reaches its hard end undecided says so with the interval it reached; a later run continues that same
experiment (its settings, kept rows, earlier looks unchanged) and never twice."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from hermes_lab.ab import held as ab_held
from hermes_lab.ab import report as ab_report
from hermes_lab.ab import run as ab_run
from hermes_lab.config.schema import load_config
from hermes_lab.tasks import suite as T

# pass rates by family and level: the cells explain much of whether an answer passes, as on the embedded suite
RATES = {"upper": 0.97, "reverse": 0.85, "sort": 0.65, "tool": 0.45, "add": 0.25, "code": 0.55}


class CellPolicy:
    """Right answer with the pass rate of the prompt's family (minus 0.08 per level above 1) plus ``lift``."""

    def __init__(self, name: str, lift: float = 0.0):
        self.name, self.lift = name, lift

    def generate(self, prompts, temperature=0.9, max_new_tokens=16, seed=0):
        rng = random.Random(seed)
        out = []
        for pr in prompts:
            t = T.parse_prompt(pr)
            p = RATES[t.family] - 0.08 * (t.level - 1) + self.lift
            out.append(t.answer if rng.random() < p else T.corrupt(t.answer, rng))
        return out


def _cfg(tmp_path, **ab_over):
    over = {"round.runs_dir": str(tmp_path / "runs"), **{f"ab.{k}": v for k, v in ab_over.items()}}
    return load_config(None, overrides=over)


@pytest.mark.slow  # a real SQLite MLflow store and two 2-hour rollouts: ~20 s of CPU
def test_the_report_shows_what_the_covariates_bought_per_stage_and_in_mlflow(tmp_path, mlflow_store):
    mlflow = mlflow_store
    hist = tmp_path / "history.jsonl"  # an earlier log: the baseline on the same cells
    hist.write_text(
        "\n".join(
            json.dumps({"prompt": t.prompt, "reward": 5.0 if random.Random(i).random() < RATES[t.family] else 1.0})
            for i, t in enumerate(T.generate_tasks(400, split="train", seed=3))
        )
        + "\n"
    )
    cfg = _cfg(tmp_path, request_rate=1.0, stages=[[0.2, 3600], [1.0, 0]])
    out = tmp_path / "ab" / "ab_report.json"
    with mlflow.start_run() as run:
        rep = ab_run.run_ab(
            cfg, CellPolicy("b"), CellPolicy("c", 0.05), output=out, plots=False, history=[hist], seed=2
        )
    s0 = rep["stages"][0]["sequential"]
    assert s0["adjusted"] and rep["covariates"]["kinds"] == list(cfg.ab.covariates)
    assert rep["covariates"]["history"]["rows"] == 400 and rep["covariates"]["history"]["sources"] == [str(hist)]
    assert rep["covariates"]["cells"] == sum(T.LEVELS.values())  # every family:level of the suite
    assert 0.15 < s0["variance_reduction"] < 0.8 and s0["width_ratio"] < 0.95
    assert s0["cs_upper"] - s0["cs_lower"] < s0["cs_upper_plain"] - s0["cs_lower_plain"]
    assert all("cs_lower_plain" in look for look in s0["looks"])
    assert "regression-adjusted CS" in ab_report.summary(rep) and "narrower" in ab_report.summary(rep)
    table = ab_report.adjustment_table(rep)
    assert table.loc[0, "variance_reduction"] == pytest.approx(s0["variance_reduction"])
    metrics = mlflow.get_run(run.info.run_id).data.metrics
    assert metrics["ab/stage0_variance_reduction"] == pytest.approx(s0["variance_reduction"])
    assert metrics["ab/stage0_width_ratio"] == pytest.approx(s0["width_ratio"])
    # the same traffic without covariates: the plain CS decides, and it is the one reported beside
    plain = ab_run.run_ab(
        _cfg(tmp_path, request_rate=1.0, stages=[[0.2, 3600], [1.0, 0]], covariates=[]),
        CellPolicy("b"),
        CellPolicy("c", 0.05),
        output=tmp_path / "plain" / "ab_report.json",
        plots=False,
        seed=2,
    )
    p0 = plain["stages"][0]["sequential"]
    assert not p0["adjusted"] and plain["covariates"] is None and p0["variance_reduction"] is None
    assert (p0["cs_lower"], p0["cs_upper"]) == pytest.approx((s0["cs_lower_plain"], s0["cs_upper_plain"]))


def _held(tmp_path):
    """A rollout whose only tested stage ends undecided: the same policy in both arms."""
    cfg = _cfg(tmp_path, request_rate=0.5, stages=[[0.3, 1800], [1.0, 0]], look_every=900)
    out = tmp_path / "round-04" / "ab" / "ab_report.json"
    rep = ab_run.run_ab(cfg, CellPolicy("b"), CellPolicy("c"), output=out, plots=False, seed=4)
    return cfg, out, rep


def test_an_undecided_hard_end_is_reported_with_the_interval_it_reached(tmp_path):
    _, out, rep = _held(tmp_path)
    assert rep["decision"] == "keep observing" and rep["stopped_by"] == "keep observing"
    held = rep["held"]
    assert held["stage"] == 0 and held["until"] == 3600 and held["cs"][0] < 0 < held["cs"][1]
    assert held["cs"] == [rep["stages"][0]["sequential"]["cs_lower"], rep["stages"][0]["sequential"]["cs_upper"]]
    assert "reached its hard end undecided" in rep["reasons"][-1]
    verdict = json.loads((out.parent / "verdict.json").read_text())
    assert verdict["candidate"]["held"] == held and verdict["gates"][0]["passed"] is False


def test_a_held_experiment_is_continued_on_the_same_sequence_and_only_once(tmp_path):
    _, out, rep = _held(tmp_path)
    kept = [json.loads(x) for x in (out.parent / "requests.jsonl").read_text().splitlines()]
    # the next round continues it: even with other ab settings in its config, the held experiment's own apply
    other = _cfg(tmp_path, request_rate=3.0, stages=[[0.1, 7200], [1.0, 0]], look_every=300)
    out2 = tmp_path / "round-05" / "ab" / "ab_report.json"
    cont = ab_run.run_ab(
        other, CellPolicy("b"), CellPolicy("c"), output=out2, plots=False, seed=5, continue_from=out.parent
    )
    assert cont["continued"] == {
        "from": str(out.parent),
        "stage": 0,
        "ratio": 0.3,
        "since": 3600.0,
        "added_seconds": 3600.0,
        "rows_kept": len(kept),
    }
    assert cont["config"]["request_rate"] == rep["config"]["request_rate"] and cont["plan"] is None
    assert cont["reasons"][0].startswith("continues the experiment held in")
    new = [json.loads(x) for x in (out2.parent / "requests.jsonl").read_text().splitlines()]
    assert new and min(r["t"] for r in new) > 3600 and max(r["t"] for r in new) <= 7200  # only the added time
    assert not {r["request_id"] for r in new} & {r["request_id"] for r in kept}  # new requests: new units
    s_old, s_new = rep["stages"][0], cont["stages"][0]
    assert s_new["n_baseline"] + s_new["n_candidate"] == len(kept) + len(new)
    # the looks the held round took are the same looks, numbers and all: one sequence, carried on
    old_looks = s_old["sequential"]["looks"]
    assert s_new["sequential"]["looks"][: len(old_looks)] == old_looks
    assert len(s_new["sequential"]["looks"]) == len(old_looks) + 4  # 3600 s more at a look every 900 s
    lo, hi = s_new["sequential"]["cs_lower"], s_new["sequential"]["cs_upper"]
    assert s_old["sequential"]["cs_lower"] <= lo <= hi <= s_old["sequential"]["cs_upper"]  # running intersection
    assert cont["decision"] in ("keep observing", "promote", "roll back")
    if cont["decision"] == "keep observing":
        assert cont["held"] and cont["held"]["until"] == 7200
    with pytest.raises(ab_held.HeldError, match="not continued twice"):
        ab_held.load_held(out2.parent)


def test_only_an_undecided_hard_end_can_be_continued(tmp_path):
    cfg = _cfg(tmp_path, request_rate=0.5, stages=[[0.3, 1800], [1.0, 0]])
    out = tmp_path / "ab" / "ab_report.json"
    rep = ab_run.run_ab(cfg, CellPolicy("b"), CellPolicy("c", 0.5), output=out, plots=False, seed=1)
    assert rep["decision"] == "promote" and rep["held"] is None
    with pytest.raises(ab_held.HeldError, match="not undecided at a hard end"):
        ab_held.load_held(out.parent)
    with pytest.raises(ab_held.HeldError, match="no ab_report.json"):
        ab_held.load_held(tmp_path / "nowhere")
    rc = ab_run.main(
        ["--baseline", "embedded:tiny", "--candidate", "embedded:tiny", "--no-mlflow"]
        + ["--continue-from", str(tmp_path / "nowhere"), "--output", str(tmp_path / "cli" / "ab_report.json")]
    )
    assert rc == 2 and not (tmp_path / "cli").exists()  # one line naming the folder, before any policy loads


def test_history_and_round_logs(tmp_path):
    """A round's history: its own execution log and the A/B logs of the ab.history_rounds rounds before it."""
    from hermes_lab.ab import covariates

    runs = tmp_path / "runs"
    for k in (1, 2, 3):
        (runs / f"round-{k:02d}" / "ab").mkdir(parents=True)
        (runs / f"round-{k:02d}" / "ab" / "requests.jsonl").write_text("{}\n")
    (runs / "round-04").mkdir()
    (runs / "round-04" / "trajectories.jsonl").write_text("{}\n")
    got = [p.relative_to(runs).as_posix() for p in covariates.round_history(runs / "round-04", 2)]
    assert got == ["round-04/trajectories.jsonl", "round-03/ab/requests.jsonl", "round-02/ab/requests.jsonl"]
    assert [p.name for p in covariates.round_history(runs / "round-04", 0)] == ["trajectories.jsonl"]
    assert np.isfinite(len(got))
