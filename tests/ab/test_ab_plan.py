"""The A/B plan (hermes_lab.ab.plan): the planned rate reaches the power it was planned for, checked by an
independent simulation through the runner's own per-experiment decision (md5 router, ab_analysis.stage_action)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hermes_lab.ab import analysis as ab_analysis
from hermes_lab.ab import plan as ab_plan
from hermes_lab.ab import rollout as ab_rollout
from hermes_lab.ab import run as ab_run
from hermes_lab.ab import stats as ab
from hermes_lab.config.schema import ab_stages, load_config

from conftest import mlflow_db

# one short tested stage (10% for 30 min, looks every 5 min) keeps each simulation to a fraction of a second
SHORT = {"ab.stages": [[0.1, 1800], [1.0, 0]], "ab.look_every": 300, "ab.plan_power": 0.8}


def _cfg(tmp_path=None, **over):
    extra = {"round.runs_dir": str(tmp_path / "runs")} if tmp_path else {}
    return load_config(None, overrides={**SHORT, **extra, **{f"ab.{k}": v for k, v in over.items()}})


def _plan(cfg, eval_path=None):
    return ab_plan.plan_rate(cfg, ab_stages(cfg), ab.Settings.from_config(cfg), eval_path)


def _runner_power(cfg, rate, p_b, delta, n_exp, seed):
    """Share of experiments the runner's decision widens: Poisson arrivals, md5-routed request ids, Bernoulli
    rewards, ab_analysis.stage_action at the stage's hard end (every look until then), one experiment at a time."""
    st = ab.Settings.from_config(cfg)
    stage = ab_rollout.start_stage(ab.plan_stages(ab_stages(cfg), rate, cfg.ab.look_every, cfg.ab.max_extension)[0], 0)
    rng = np.random.default_rng(seed)
    widened = 0
    for e in range(n_exp):
        t = np.cumsum(rng.exponential(1 / rate, int(rate * stage.hard_end * 1.5) + 50))
        t = np.round(t[t <= stage.hard_end], 3)
        router = ab.ABRouter("b", "c", stage.ratio, salt=f"exp{seed}-{e}")
        arm = router.assign([f"req-{i}" for i in range(len(t))]).astype(np.int8)
        reward = np.where(rng.random(len(t)) < p_b + delta * arm, st.scale, 0.0)
        cols = {"t": t, "arm": arm, "reward": reward, "error": np.zeros(len(t), bool)}
        cols["latency_ms"] = np.full(len(t), 100.0)
        act = ab_analysis.stage_action(cols, stage, st, stage.hard_end, st.rule)
        widened += act is not None and act[0] == "widen"
    return widened / n_exp


def test_planned_rate_reaches_the_planned_power_in_the_runners_own_decision():
    cfg = _cfg(plan_effect=15)
    plan = _plan(cfg)
    assert not plan.capped and plan.stages[0]["power_by"] == "simulated"
    assert abs(plan.power - 0.8) < 0.06  # the smallest bisected rate with power >= 0.8: just above it
    got = _runner_power(cfg, plan.rate, plan.baseline_share, 0.15, 300, seed=123)
    assert abs(got - 0.8) < 0.09, got  # 300 experiments: one standard error is 0.023
    # the plan is not oversized: at half the rate the same test has clearly less power
    assert _runner_power(cfg, plan.rate / 2, plan.baseline_share, 0.15, 300, seed=321) < 0.65
    # and an A/A test at the planned rate (no gain) widens at most alpha/2 of the time
    assert _runner_power(cfg, plan.rate, plan.baseline_share, 0.0, 200, seed=7) <= 0.05


def test_larger_effect_needs_fewer_requests_and_the_cap_is_reported_when_it_binds():
    small, large = _plan(_cfg(plan_effect=10)), _plan(_cfg(plan_effect=20))
    ratio = small.stages[0]["requests"] / large.stages[0]["requests"]
    assert 2.5 < ratio < 6  # ~ (20/10)^2: requests grow with 1 / effect^2
    assert small.rate > large.rate and not small.capped and not large.capped
    capped = _plan(_cfg(plan_effect=10, plan_max_rate=small.rate / 3))
    assert capped.capped and capped.rate == pytest.approx(small.rate / 3)
    assert capped.power < 0.6  # the power the cap reaches, simulated at the cap
    # the round's output names the underpowered plan: what the target needs, what the budget allows
    line = capped.line()
    assert line.startswith("ab: UNDERPOWERED plan") and "UNDERPOWERED" not in small.line()
    assert f"needs ~{capped.needed_requests()} requests" in line and f"allows {capped.stages[0]['requests']}" in line
    assert 0.7 < capped.needed_rate / small.rate < 1.6  # the approximation, calibrated at the cap: about right
    m = ab_plan.plan_metrics(capped.as_dict())
    assert m["plan_capped"] == 1.0 and m["plan_power"] == capped.power and m["plan_rate"] == capped.rate


def test_a_huge_gain_still_plans_enough_units_for_the_rule_to_decide():
    """A +45-point gain at the approximation's rate is a handful of requests, and the rule decides nothing under
    ``ab.min_per_arm`` units an arm: the plan must count that (a round planned 7 candidate requests for +32 points
    and held its A/B undecided), and the runner's own decision must widen at the planned rate."""
    cfg = _cfg(plan_effect=45)
    plan = _plan(cfg)
    st = ab.Settings.from_config(cfg)
    s0 = plan.stages[0]  # units by the hard end: the planned stage and its extensions
    assert s0["requests_with_extension"] * s0["ratio"] >= st.min_per_arm, s0
    assert _runner_power(cfg, plan.rate, plan.baseline_share, 0.45, 200, seed=11) >= 0.7
    # the approximation knows it: half the units an arm needs is (almost) no chance, whatever the gain
    stage = ab_rollout.start_stage(ab.plan_stages(ab_stages(cfg), 1.0, cfg.ab.look_every, cfg.ab.max_extension)[0], 0)
    arms = ab_plan.plan_arms(cfg, None, 0.5, 0.45)
    n = st.min_per_arm / 2 / (stage.ratio * stage.seconds * (1 + stage.max_extension))
    assert ab_plan.approx_power(stage, n, arms, 0.45, st.alpha, st.min_per_arm) < 0.01
    assert ab_plan.approx_power(stage, n, arms, 0.45, st.alpha) > 0.5  # without the count: what the bug planned


def test_the_effect_comes_from_trains_held_out_gain(tmp_path):
    ev = tmp_path / "eval.json"
    ev.write_text(json.dumps({"before": {"pass_rate": 0.4}, "after": {"pass_rate": 0.52}, "gain_points": 12.0}))
    assert ab_plan.resolve_effect(_cfg(), ev) == (12.0, 0.4, "the held-out gain of eval.json")
    assert ab_plan.resolve_effect(_cfg(plan_effect=3), ev)[:2] == (3, 0.4)  # set explicitly: it wins
    ev.write_text(json.dumps({"before": {"pass_rate": 0.4}, "gain_points": -2.0}))
    eff, share, src = ab_plan.resolve_effect(_cfg(plan_fallback_effect=7), ev)
    assert (eff, share) == (7, 0.4) and "held-out gain -2.0 not positive" in src
    eff, share, src = ab_plan.resolve_effect(_cfg(), tmp_path / "missing.json")
    assert (eff, share) == (5.0, ab_plan.FALLBACK_SHARE) and "no held-out gain known" in src
    # with mean rewards (what the rollout tests): their gain on the scale, not the pass rate's
    before, after = {"pass_rate": 0.325, "mean_reward": 2.89}, {"pass_rate": 0.497, "mean_reward": 3.31}
    ev.write_text(json.dumps({"before": before, "after": after, "gain_points": 17.2}))
    eff, share, _ = ab_plan.resolve_effect(_cfg(), ev)
    assert eff == pytest.approx(100 * 0.42 / 5) and share == pytest.approx(2.89 / 5)


def test_run_ab_simulates_at_the_planned_rate_and_reports_the_plan(tmp_path, monkeypatch, capsys):
    import mlflow

    from hermes_lab.core import tracking

    from test_ab_run import FakePolicy

    uri = mlflow_db(tmp_path / "mlflow.db")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    mlflow.set_tracking_uri(uri)
    ev = tmp_path / "round-01" / "train" / "eval.json"
    ev.parent.mkdir(parents=True)
    ev.write_text(json.dumps({"before": {"pass_rate": 0.5}, "after": {"pass_rate": 0.7}, "gain_points": 20.0}))
    cfg = _cfg(tmp_path)
    with tracking.stage_run("ab", None, cfg.round.runs_dir, cfg.round.experiment):
        rep = ab_run.run_ab(
            cfg,
            FakePolicy(0.5, "b"),
            FakePolicy(0.7, "c"),
            output=tmp_path / "round-01" / "ab" / "ab_report.json",
            plots=False,
            plan_eval=ev,
        )
    plan = rep["plan"]
    line = capsys.readouterr().out
    assert f"ab: planned for a +20.0-point gain at power 0.80: {plan['stages'][0]['requests_candidate']} " in line
    assert plan["effect_source"] == "the held-out gain of eval.json" and plan["baseline_share"] == 0.5
    assert rep["config"]["request_rate"] == plan["rate"] != cfg.ab.request_rate  # simulated at the planned rate
    assert cfg.ab.request_rate == 0.25  # the caller's config is left as it was
    served_until = rep["stages"][-1]["sequential_look"]["t"]  # the rollout's last look: traffic up to it
    assert rep["n_requests"] == pytest.approx(plan["rate"] * served_until, rel=0.2)  # Poisson at the planned rate
    saved = json.loads((tmp_path / "round-01" / "ab" / "ab_report.json").read_text())
    assert saved["plan"] == plan
    (run,) = mlflow.search_runs(search_all_experiments=True, output_format="list")
    assert run.data.metrics["ab/plan_rate"] == pytest.approx(plan["rate"])
    assert run.data.metrics["ab/plan_effect_points"] == 20.0 and "ab/plan_stage0_power" in run.data.metrics
    # ab.plan_power 0 (the default): ab.request_rate as set, no plan
    rep0 = ab_run.run_ab(
        load_config(None, {"round.runs_dir": str(tmp_path / "runs")}),
        FakePolicy(0.5, "b"),
        FakePolicy(0.5, "c"),
        duration=900,
        output=tmp_path / "off" / "ab_report.json",
        plots=False,
    )
    assert rep0["plan"] is None and rep0["config"]["request_rate"] == 0.25


def test_the_agent_family_is_one_more_cell_of_the_plan_when_the_traffic_has_it(tmp_path):
    from hermes_lab.tasks import agent as A
    from hermes_lab.tasks import hermes as H

    ev = tmp_path / "eval.json"
    levels = {
        "add:1": {"n": 60, "pass_rate": 0.2, "mean_reward": 1.5},
        "add:2": {"n": 40, "pass_rate": 0.1, "mean_reward": 1.0},
        "upper:1": {"n": 100, "pass_rate": 0.5, "mean_reward": 3.0},
    }
    agent = {"before": {"episode_success": 0.44, "mean_reward": 2.5, "n": 200}}
    ev.write_text(json.dumps({"before": {"pass_rate": 0.3, "per_level": levels}, "agent": agent}))
    plain = ab_plan.plan_arms(_cfg(), ev, 0.3, 0.03)
    assert plain.cells == 3
    for env in (H.ENVIRONMENT, A.ENVIRONMENT):  # the round's agent family (hermes), or the time family
        over = {**SHORT, "grpo.environment": env, "execute.agent_tasks": 64}
        arms = ab_plan.plan_arms(load_config(None, overrides=over), ev, 0.3, 0.03)
        assert arms.cells == 4
        assert arms.weight[-1] == pytest.approx(1 / 3) and arms.pass_b[-1] == pytest.approx(0.44)  # a family's share
        assert arms.weight[:3] == pytest.approx(plain.weight * 2 / 3)
    # no episodes logged, or a user's own environment: no agent traffic, no cell
    for over in ({"grpo.environment": H.ENVIRONMENT, "execute.agent_tasks": 0}, {"grpo.environment": "mypkg:Env"}):
        assert ab_plan.plan_arms(load_config(None, overrides={**SHORT, **over}), ev, 0.3, 0.03).cells == 3
