"""hermes_lab.ab: the user's router and compare() bit for bit, and the statistics that gate a rollout."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import numpy as np
import pytest
from scipy import stats

from hermes_lab import ab

IDS = [f"req-{i}" for i in range(4000)]


def spec_bucket(request_id: str) -> float:
    """The formula of docs/SPEC.md, computed independently: the first 4 digest bytes are the first 8 hex digits."""
    return int.from_bytes(hashlib.md5(request_id.encode()).digest()[:4], "big") / 0xFFFFFFFF


# ------------------------------------------------------------------------------------------- router
def test_route_is_stable_over_ten_calls():
    router = ab.ABRouter("base", "cand", 0.1)
    for rid in IDS[:200]:
        assert len({router.route(rid) for _ in range(10)}) == 1


def test_route_is_stable_across_processes():
    code = (
        "import json; from hermes_lab.ab import ABRouter; r = ABRouter('b', 'c', 0.3, salt='exp-7');"
        f"print(json.dumps([r.route(i)[0] for i in {IDS[:300]!r}]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    router = ab.ABRouter("b", "c", 0.3, salt="exp-7")
    assert json.loads(out) == [router.route(i)[0] for i in IDS[:300]]


@pytest.mark.parametrize("ratio", [0.0, 0.05, 0.1, 0.3, 0.5, 1.0])
def test_spec_formula_bit_for_bit(ratio):
    router = ab.ABRouter("base-model", "cand-model", ratio)
    for rid in IDS:
        assert router.bucket(rid) == spec_bucket(rid)  # exact float equality, not approx
        expected = ("candidate", "cand-model") if spec_bucket(rid) < ratio else ("baseline", "base-model")
        assert router.route(rid) == expected
    share = np.mean([router.route(r)[0] == "candidate" for r in IDS])
    assert abs(share - ratio) < 0.03


def test_assign_matches_route_and_accepts_any_unit_id():
    router = ab.ABRouter("b", "c", 0.3)
    units = [f"user-{i}" for i in range(500)] + [f"conv-{i}" for i in range(500)] + list(range(200))
    assert router.assign(units).tolist() == [int(router.route(u)[0] == "candidate") for u in units]
    # every request of one user lands in the user's arm
    assert len({router.route("user-42")[0] for _ in range(20)}) == 1


def test_salt_changes_assignment_and_empty_salt_is_the_spec():
    plain, empty = ab.ABRouter("b", "c", 0.5), ab.ABRouter("b", "c", 0.5, salt="")
    salted, again = ab.ABRouter("b", "c", 0.5, salt="exp-2"), ab.ABRouter("b", "c", 0.5, salt="exp-2")
    a, e, s, s2 = (r.assign(IDS) for r in (plain, empty, salted, again))
    assert (a == e).all() and (s == s2).all()
    differ = float((a != s).mean())
    assert 0.4 < differ < 0.6  # independent splits disagree on ~2 r (1 - r) = half of the units


def test_ramps_are_monotone():
    r10 = ab.ABRouter("b", "c", 0.1, salt="exp")
    r30, r100 = r10.with_ratio(0.3), r10.with_ratio(1.0)
    assert r30.salt == "exp"
    c10, c30, c100 = (r.assign(IDS).astype(bool) for r in (r10, r30, r100))
    assert c10.sum() > 300 and c30.sum() > c10.sum()
    assert not (c10 & ~c30).any() and not (c30 & ~c100).any()  # no unit ever moves candidate -> baseline


# ------------------------------------------------------------------------------------------ compare
def test_compare_matches_the_spec_formula():
    rng = np.random.default_rng(3)
    b = np.round(rng.uniform(0, 5, 500), 2).tolist()
    c = np.round(rng.uniform(0.3, 5, 80), 2).tolist()
    got = ab.compare(b, c)
    t = stats.ttest_ind(c, b, equal_var=False)
    assert got["baseline_mean"] == np.mean(b) and got["candidate_mean"] == np.mean(c)
    assert got["delta"] == np.mean(c) - np.mean(b)
    assert got["baseline_success"] == sum(x >= 3 for x in b) / len(b)
    assert got["candidate_success"] == sum(x >= 3 for x in c) / len(c)
    assert got["p_value"] == t.pvalue
    assert got["significant"] == (t.pvalue < 0.05 and np.mean(c) > np.mean(b))


def test_compare_significant_needs_the_candidate_ahead():
    worse = ab.compare([4.0, 5.0] * 50, [1.0, 2.0] * 50)
    assert worse["p_value"] < 1e-10 and worse["significant"] is False
    better = ab.compare([1.0, 2.0] * 50, [4.0, 5.0] * 50)
    assert better["significant"] is True and better["candidate_success"] == 1.0


@pytest.mark.parametrize(
    "delta,p,expected",
    [
        (0.3, 0.01, "promote"),
        (0.3, 0.2, "keep observing"),
        (-0.3, 0.5, "roll back"),
        (-0.3, 0.001, "roll back"),
        (0.0, 0.9, "keep observing"),
        (float("nan"), float("nan"), "keep observing"),
    ],
)
def test_user_rule_table(delta, p, expected):
    assert ab.decide_user_rule({"delta": delta, "p_value": p})[0] == expected


# ----------------------------------------------------------------------------------- sequential rule
def test_cs_halfwidth_is_the_normal_mixture_boundary():
    V = np.array([4.0, 1.0, 0.25])
    hw = ab.cs_halfwidth(V, 0.05, v_star=1.0)
    tau2 = ab._mixture_x(0.05)
    expected = np.sqrt(V * (V + tau2) / tau2 * (2 * np.log(20) + np.log1p(tau2 / V)))
    assert np.allclose(hw, expected)
    assert 3.0 < hw[1] < 3.1  # at the tuned variance: ~3.04 sd, vs 1.96 for a single fixed-horizon look
    assert np.isinf(ab.cs_halfwidth(np.array([np.nan]), 0.05, 1.0)).all()


def _sim(reps, n, ratio, p_c, p_b, seed, err_c=0.0, lat_c=1.0, srm_ratio=None, T=7200.0):
    """``reps`` experiments of ``n`` requests over T seconds, analysed at once (one group each)."""
    rng = np.random.default_rng(seed)
    t = np.tile(np.sort(rng.uniform(0, T, n)), reps)
    g = np.repeat(np.arange(reps), n)
    arm = (rng.random(reps * n) < (srm_ratio or ratio)).astype(np.int8)
    succ = rng.random(reps * n) < np.where(arm == 1, p_c, p_b)
    r = np.where(succ, 5.0, np.round(2.5 * rng.beta(2, 2, reps * n), 4))
    err = (arm == 1) & (rng.random(reps * n) < err_c)
    r[err] = 0.0
    lat = np.exp(rng.normal(np.log(120), 0.35, reps * n)) * np.where(arm == 1, lat_c, 1.0)
    return {"t": t, "g": g, "arm": arm, "reward": r, "error": err, "latency_ms": lat}


def _codes(d, reps, ratio, T=7200.0, st=None):
    st = st or ab.Settings()
    stage = ab.Stage(0, ratio, 0.0, T / 2, max_extension=1.0, look_every=900, planned_n=len(d["t"]) / reps / 2)
    looks = stage.look_times()
    k = 1 / (stage.planned_n * ratio) + 1 / (stage.planned_n * (1 - ratio))
    sums = ab.look_sums(d["t"], d["arm"], d["reward"], d["error"], d["latency_ms"], looks, d["g"], reps)
    S = ab.look_stats(sums, ratio, k, st)
    C = ab.rule_codes(S, st)
    return {rule: ab.first_action(C[rule], looks, stage.planned_end)[0] for rule in ("sequential", "user")}, S


def test_aa_rarely_rejects_while_the_user_rule_rolls_back_often():
    reps = 400
    codes, S = _codes(_sim(reps, 1800, 0.3, 0.45, 0.45, seed=1), reps, 0.3)
    seq, user = codes["sequential"], codes["user"]
    assert np.mean(seq == ab.PROMOTE) <= 0.05 and np.mean(seq == ab.ROLLBACK) <= 0.05
    assert np.mean((S["lo"] > 0) | (S["hi"] < 0), axis=None) < 0.05  # per look, too
    assert np.mean(user == ab.ROLLBACK) > 0.3  # "delta < 0 -> roll back" fires on chance alone


def test_clear_effect_is_detected_and_promoted():
    reps = 100
    codes, _ = _codes(_sim(reps, 1800, 0.3, 0.65, 0.40, seed=2), reps, 0.3)
    assert np.mean(codes["sequential"] == ab.PROMOTE) > 0.9


def test_rollback_only_on_significant_harm():
    # slight harm, not significant: we keep observing where the user's rule rolls back
    stage = ab.Stage(0, 0.3, 0.0, 3600, 0.0, 900, 900)
    rng = np.random.default_rng(5)
    n = 900
    arm = (rng.random(n) < 0.3).astype(np.int8)
    r = np.where(rng.random(n) < np.where(arm == 1, 0.47, 0.5), 5.0, 1.5)
    cols = {
        "t": np.sort(rng.uniform(0, 3600, n)),
        "arm": arm,
        "reward": r,
        "error": np.zeros(n, bool),
        "latency_ms": np.full(n, 100.0),
        "family": np.zeros(n, np.int64),
    }
    out = ab.analyse_stage(cols, stage, ab.Settings())
    if out["delta"] < 0:
        assert out["user_decision"] == "roll back"
    assert out["sequential_decision"] == "keep observing"
    assert out["sequential"]["cs_lower"] < 0 < out["sequential"]["cs_upper"]
    # clear harm: rolled back at an interim look, before the stage's planned end
    r2 = np.where(rng.random(n) < np.where(arm == 1, 0.1, 0.6), 5.0, 1.5)
    out2 = ab.analyse_stage({**cols, "reward": r2}, stage, ab.Settings())
    assert out2["sequential_decision"] == "roll back"
    assert out2["sequential_look"]["t"] < stage.planned_end
    assert any("significant harm" in x for x in out2["reasons"])


def test_promotion_waits_for_the_planned_stage_end():
    codes = np.array([[ab.PROMOTE, ab.PROMOTE, ab.KEEP], [ab.KEEP, ab.ROLLBACK, ab.PROMOTE], [ab.KEEP] * 3])
    looks = np.array([900.0, 1800.0, 2700.0])
    code, idx = ab.first_action(codes, looks, planned_end=1800.0)
    assert code.tolist() == [ab.PROMOTE, ab.ROLLBACK, ab.KEEP] and idx.tolist() == [1, 1, 2]


@pytest.mark.parametrize("kw,word", [({"err_c": 0.2}, "error rate"), ({"lat_c": 3.0}, "latency")])
def test_guardrail_rolls_back(kw, word):
    stage = ab.Stage(0, 0.3, 0.0, 3600, 0.0, 900, 900)
    d = _sim(1, 900, 0.3, 0.6, 0.4, seed=4, T=3600, **kw)  # the candidate is *better* on reward
    cols = {k: d[k] for k in ("t", "arm", "reward", "error", "latency_ms")}
    out = ab.analyse_stage(cols, stage, ab.Settings())
    assert out["sequential_decision"] == "roll back"
    assert any("guardrail" in x and word in x for x in out["reasons"])


def test_srm_detects_a_broken_split_and_holds():
    assert ab.srm_pvalue(np.array([150.0]), np.array([850.0]), 0.1)[0] < 1e-6
    assert ab.srm_pvalue(np.array([101.0]), np.array([899.0]), 0.1)[0] > 0.5
    assert ab.srm_pvalue(np.array([3.0]), np.array([0.0]), 0.1)[0] == 1.0  # too few units for chi-square
    stage = ab.Stage(0, 0.1, 0.0, 3600, 0.0, 900, 900)
    d = _sim(1, 2000, 0.1, 0.7, 0.4, seed=6, T=3600, srm_ratio=0.2)  # the router sends 20%, not 10%
    out = ab.analyse_stage({k: d[k] for k in ("t", "arm", "reward", "error", "latency_ms")}, stage, ab.Settings())
    assert out["srm"]["mismatch"] and out["sequential_decision"] == "hold"  # never promote on a broken split
    assert any("sample ratio mismatch" in x for x in out["reasons"])


def test_stage_statistics_match_compare_wilson_and_mann_whitney():
    stage = ab.Stage(0, 0.3, 0.0, 3600, 0.0, 900, 900)
    d = _sim(1, 1500, 0.3, 0.5, 0.45, seed=8, T=3600)
    cols = {k: d[k] for k in ("t", "arm", "reward", "error", "latency_ms")}
    out = ab.analyse_stage(cols, stage, ab.Settings())
    c, b = d["reward"][d["arm"] == 1], d["reward"][d["arm"] == 0]
    ref = ab.compare(b, c)
    for k in ("baseline_mean", "candidate_mean", "delta", "baseline_success", "candidate_success"):
        assert out[k] == pytest.approx(ref[k], rel=1e-12)
    assert out["p_value"] == pytest.approx(ref["p_value"], rel=1e-9)
    lo, hi = out["candidate_success_ci"]
    assert lo < out["candidate_success"] < hi
    assert out["mann_whitney"]["p_value"] == pytest.approx(stats.mannwhitneyu(c, b).pvalue)
    assert out["sequential"]["looks"][-1]["t"] == 3600.0


def test_fast_mann_whitney_equals_scipy_on_large_tied_samples():
    rng = np.random.default_rng(9)
    c = np.round(rng.uniform(0, 5, 60_000), 1)
    b = np.round(rng.uniform(0, 5.05, 90_000), 1)
    ours, ref = ab.mann_whitney(c, b), stats.mannwhitneyu(c, b, alternative="two-sided")
    assert ours["U"] == pytest.approx(ref.statistic, rel=1e-12)
    assert ours["p_value"] == pytest.approx(ref.pvalue, rel=1e-6)


def test_look_times_include_the_planned_end_and_stop_at_until():
    s = ab.Stage(0, 0.1, 100.0, 7200, 1.0, 1000)
    looks = s.look_times()
    assert 7300.0 in looks and looks[-1] == s.hard_end and np.all(np.diff(looks) > 0)
    assert s.look_times(until=2500.0).tolist() == [1100.0, 2100.0, 2500.0]


def test_units_that_repeat_get_cluster_robust_variances():
    # 50 users with strong per-user effects: request-level variance would understate the uncertainty
    rng = np.random.default_rng(10)
    n, users = 3000, 50
    unit = rng.integers(0, users, n)
    arm = (np.array([ab.bucket(f"u{u}") for u in range(users)]) < 0.5).astype(np.int8)[unit]
    r = np.clip(rng.normal(0, 1.5, users)[unit] + 2.5 + rng.normal(0, 0.3, n), 0, 5)
    cols = {
        "t": np.sort(rng.uniform(0, 3600, n)),
        "arm": arm,
        "reward": r,
        "error": np.zeros(n, bool),
        "latency_ms": np.full(n, 100.0),
    }
    stage = ab.Stage(0, 0.5, 0.0, 3600, 0.0, 900, n)
    _, S_iid, _ = ab.stage_path(cols, stage, ab.Settings())
    _, S_unit, _ = ab.stage_path({**cols, "unit": unit}, stage, ab.Settings())
    assert S_unit["V"][-1] > 5 * S_iid["V"][-1]
