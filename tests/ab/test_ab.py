"""hermes_lab.ab.stats: the user's router and compare() bit for bit, and the statistics that gate a rollout."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import numpy as np
import pytest
from scipy import stats

from hermes_lab.ab import analysis as ab_analysis
from hermes_lab.ab import stats as ab

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
        "import json; from hermes_lab.ab.stats import ABRouter; r = ABRouter('b', 'c', 0.3, salt='exp-7');"
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
    assert ab.buckets(units, "s").tolist() == [ab.bucket(u, "s") for u in units]  # the vectorised formula
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
    cols = {k: d[k] for k in ("t", "arm", "reward", "error", "latency_ms")}
    S = ab.look_path(cols, looks, ratio, stage.tune_n, st, d["g"], reps)
    C = ab.rule_codes(S, st)
    return {rule: ab.first_action(C[rule], looks, stage.planned_end)[0] for rule in ("sequential", "user")}, S


def test_aa_rarely_rejects_while_the_user_rule_rolls_back_often():
    reps = 400
    codes, S = _codes(_sim(reps, 1800, 0.3, 0.45, 0.45, seed=1), reps, 0.3)
    seq, user = codes["sequential"], codes["user"]
    assert np.mean(seq == ab.WIDEN) <= 0.05 and np.mean(seq == ab.ROLLBACK) <= 0.05
    assert np.mean((S["lo"] > 0) | (S["hi"] < 0), axis=None) < 0.05  # per look, too
    assert np.mean(user == ab.ROLLBACK) > 0.3  # "delta < 0 -> roll back" fires on chance alone


def test_clear_effect_is_detected_and_promoted():
    reps = 100
    codes, _ = _codes(_sim(reps, 1800, 0.3, 0.65, 0.40, seed=2), reps, 0.3)
    assert np.mean(codes["sequential"] == ab.WIDEN) > 0.9


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
    out = ab_analysis.analyse_stage(cols, stage, ab.Settings())
    if out["delta"] < 0:
        assert out["user_decision"] == "roll back"
    assert out["sequential_decision"] == "keep observing"
    assert out["sequential"]["cs_lower"] < 0 < out["sequential"]["cs_upper"]
    # clear harm: rolled back at an interim look, before the stage's planned end
    r2 = np.where(rng.random(n) < np.where(arm == 1, 0.1, 0.6), 5.0, 1.5)
    out2 = ab_analysis.analyse_stage({**cols, "reward": r2}, stage, ab.Settings())
    assert out2["sequential_decision"] == "roll back"
    assert out2["sequential_look"]["t"] < stage.planned_end
    assert any("significant harm" in x for x in out2["reasons"])


def test_widening_waits_for_the_planned_stage_end():
    codes = np.array([[ab.WIDEN, ab.WIDEN, ab.KEEP], [ab.KEEP, ab.ROLLBACK, ab.WIDEN], [ab.KEEP] * 3])
    looks = np.array([900.0, 1800.0, 2700.0])
    code, idx = ab.first_action(codes, looks, planned_end=1800.0)
    assert code.tolist() == [ab.WIDEN, ab.ROLLBACK, ab.KEEP] and idx.tolist() == [1, 1, 2]


@pytest.mark.parametrize("kw,word", [({"err_c": 0.2}, "error rate"), ({"lat_c": 3.0}, "latency")])
def test_guardrail_rolls_back(kw, word):
    stage = ab.Stage(0, 0.3, 0.0, 3600, 0.0, 900, 900)
    d = _sim(1, 900, 0.3, 0.6, 0.4, seed=4, T=3600, **kw)  # the candidate is *better* on reward
    cols = {k: d[k] for k in ("t", "arm", "reward", "error", "latency_ms")}
    out = ab_analysis.analyse_stage(cols, stage, ab.Settings())
    assert out["sequential_decision"] == "roll back"
    assert any("guardrail" in x and word in x for x in out["reasons"])


def test_srm_detects_a_broken_split_and_holds():
    assert ab.srm_pvalue(np.array([150.0]), np.array([850.0]), 0.1)[0] < 1e-4  # 15% of 1000 in a 10% arm
    assert ab.srm_pvalue(np.array([101.0]), np.array([899.0]), 0.1)[0] > 0.5
    assert ab.srm_pvalue(np.array([3.0]), np.array([0.0]), 0.1)[0] > 0.5  # 3 of 3 in a 10% arm: no evidence yet
    # the p-value is anytime-valid: it never rises again once evidence was seen (running maximum of the e-value)
    p = ab.srm_pvalue(np.array([150.0, 160.0, 300.0]), np.array([850.0, 2000.0, 2700.0]), 0.1)
    assert np.all(np.diff(p) <= 0)
    stage = ab.Stage(0, 0.1, 0.0, 3600, 0.0, 900, 900)
    d = _sim(1, 2000, 0.1, 0.7, 0.4, seed=6, T=3600, srm_ratio=0.2)  # the router sends 20%, not 10%
    out = ab_analysis.analyse_stage(
        {k: d[k] for k in ("t", "arm", "reward", "error", "latency_ms")}, stage, ab.Settings()
    )
    assert out["srm"]["mismatch"] and out["sequential_decision"] == "hold"  # never promote on a broken split
    assert any("sample ratio mismatch" in x for x in out["reasons"])


def test_stage_statistics_match_compare_wilson_and_mann_whitney():
    stage = ab.Stage(0, 0.3, 0.0, 3600, 0.0, 900, 900)
    d = _sim(1, 1500, 0.3, 0.5, 0.45, seed=8, T=3600)
    cols = {k: d[k] for k in ("t", "arm", "reward", "error", "latency_ms")}
    out = ab_analysis.analyse_stage(cols, stage, ab.Settings())
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


def test_units_that_repeat_are_counted_once():
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
        "family": np.zeros(n, np.int64),
    }
    stage = ab.Stage(0, 0.5, 0.0, 3600, 0.0, 900, n)
    _, S_req, _ = ab_analysis.stage_path(cols, stage, ab.Settings())
    _, S_unit, _ = ab_analysis.stage_path({**cols, "unit": unit}, stage, ab.Settings())
    assert S_unit["units_c"][-1] + S_unit["units_b"][-1] == users and S_req["units_c"][-1] == S_req["n_c"][-1]
    assert (S_unit["hi"] - S_unit["lo"])[-1] > 3 * (S_req["hi"] - S_req["lo"])[-1]
    out = ab_analysis.analyse_stage({**cols, "unit": unit}, stage, ab.Settings(), family_names=["f"])
    assert out["var_delta"] > 5 * ab_analysis.analyse_stage(cols, stage, ab.Settings())["var_delta"]  # cluster-robust
    assert out["srm"]["units_baseline"] + out["srm"]["units_candidate"] == users


def _zipf_aa(reps, n, users, ratio, seed, heterogeneity=True):
    """A/A experiments with Zipf-distributed users routed by the md5 bucket of their id (a salt per rep)."""
    rng = np.random.default_rng(seed)
    w = 1 / np.arange(1, users + 1) ** 0.8
    u = rng.choice(users, (reps, n), p=w / w.sum())
    buckets = np.array([[ab.bucket(f"user-{k}", f"rep{i}") for k in range(users)] for i in range(reps)])
    arm = (np.take_along_axis(buckets, u, 1) < ratio).astype(np.int8).ravel()
    p_user = rng.beta(2, 2.4, (reps, users)) if heterogeneity else np.full((reps, users), 0.45)
    succ = rng.random((reps, n)) < np.take_along_axis(p_user, u, 1)
    r = np.where(succ, 5.0, 0.0).ravel()
    t = np.tile(np.sort(rng.uniform(0, 7200, n)), reps)
    return {
        "t": t,
        "g": np.repeat(np.arange(reps), n),
        "arm": arm,
        "reward": r,
        "error": np.zeros(reps * n, bool),
        "latency_ms": np.full(reps * n, 100.0),
        "unit": u.ravel(),
    }


def test_heavy_users_hold_request_level_srm_but_not_unit_level():
    reps, n, ratio = 60, 1800, 0.1
    d = _zipf_aa(reps, n, 2000, ratio, seed=11)
    st, looks = ab.Settings(), ab.Stage(0, ratio, 0.0, 3600, 1.0, 900, n / 2).look_times()
    cols = {k: d[k] for k in ("t", "arm", "reward", "error", "latency_ms")}
    by_unit = ab.rule_codes(ab.look_path({**cols, "unit": d["unit"]}, looks, ratio, n / 2, st, d["g"], reps), st)
    by_request = ab.look_path(cols, looks, ratio, n / 2, st, d["g"], reps)
    req_srm = (ab.srm_pvalue(by_request["n_c"], by_request["n_b"], ratio) < st.srm_alpha).any(-1)
    assert req_srm.mean() > 0.1  # counting requests, heavy users "break" the split in many A/A tests (vs 0.1%)
    assert not by_unit["srm"].any() and (by_unit["harm"] | by_unit["benefit"]).any(-1).mean() <= 0.05


def _coverage(reps, n, W, p, p_c, p_b, binary, seed, unit_users=0):
    """Share of simulated experiments whose CS misses the true delta at SOME look (time-uniform miss)."""
    from hermes_lab.ab import cs as ab_cs

    rng = np.random.default_rng(seed)
    win = np.tile(np.sort(rng.integers(0, W, n)), reps)
    g = np.repeat(np.arange(reps), n)
    arm = (rng.random(reps * n) < p).astype(np.int64)
    passed = rng.random(reps * n) < np.where(arm == 1, p_c, p_b)
    x = passed.astype(float) if binary else np.where(passed, 1.0, 0.5 * rng.beta(2, 2, reps * n))
    s = ab_cs.unit_window_sums(win, arm, x[None], W, group=g, n_groups=reps)
    lo, hi = ab_cs.fan_cs(s["n"], s["S"][0], s["Q"][0], p, n / 2, 0.025, 0.025)
    delta = (p_c - p_b) * (1.0 if binary else 0.75)
    return float(((lo > delta) | (hi < delta)).any(-1).mean()), lo, hi


@pytest.mark.parametrize(
    "n,p,p_c,p_b,binary",
    [
        (1800, 0.1, 0.45, 0.45, False),  # the benchmark's traffic, A/A
        (1800, 0.1, 0.57, 0.45, False),  # a true effect: the CS must cover it, not just 0
        (1800, 0.1, 0.03, 0.03, True),  # rare successes, scores 0/5
        (360, 0.05, 0.03, 0.03, True),  # rare successes in a small arm (~18 candidate units)
        (360, 0.3, 0.9, 0.9, True),  # rare failures
    ],
)
def test_confidence_sequence_covers_at_every_look(n, p, p_c, p_b, binary):
    miss, _, _ = _coverage(400, n, 16, p, p_c, p_b, binary, seed=n + int(100 * p_c))
    assert miss <= 0.05 + 0.02  # alpha plus ~2 Monte Carlo s.e.; every look at once, not one look


def test_closed_form_bounds_match_the_betting_process_row_by_row():
    """The endpoints solve log M(d) = log(2/alpha) for the capital process computed observation by observation."""
    from hermes_lab.ab import cs as ab_cs

    rng = np.random.default_rng(4)
    n, W, p = 400, 4, 0.2
    win = np.sort(rng.integers(0, W, n))
    arm = (rng.random(n) < p).astype(np.int64)
    x = np.where(rng.random(n) < np.where(arm == 1, 0.7, 0.4), 1.0, rng.uniform(0, 0.5, n))
    s = ab_cs.unit_window_sums(win, arm, x[None], W)
    lo, hi = ab_cs.fan_cs(s["n"], s["S"][0], s["Q"][0], p, 300, 0.025, 0.025, running=False)

    def log_capital(d, upper):  # the supermartingale, one unit at a time, bets fixed per window
        total = 0.0
        for w in range(W):
            prev, cur = win < w, win == w
            mean = [(0.5 + x[prev & (arm == a)].sum()) / (1 + (prev & (arm == a)).sum()) for a in (0, 1)]
            var = []
            for a in (0, 1):
                xs = x[prev & (arm == a)]
                var.append((0.25 + (((xs - xs.mean()) ** 2).sum() if len(xs) else 0.0)) / (len(xs) + 1))
            h, g = mean
            lam = np.sqrt(2 * np.log(40) / (300 * (var[1] / p + var[0] / (1 - p))))
            if upper:
                U = {1: (1 - g) / p + g - h + 1, 0: h / (1 - p) + g - h + 1}
            else:
                U = {1: g / p - g + h + 1, 0: (1 - h) / (1 - p) - g + h + 1}
            lam = min(lam, 0.5 / max(U.values()))
            for xi, a in zip(x[cur], arm[cur]):
                psi = (xi - g) / p + g - h if a else -(xi - h) / (1 - p) + g - h
                e = (d - psi) if upper else (psi - d)
                total += lam * e - ab_cs.fan_psi(lam * U[a]) / U[a] ** 2 * (psi - d) ** 2
        return total

    L = np.log(1 / 0.025)
    for bound, upper in ((lo[0, -1], False), (hi[0, -1], True)):
        assert -1 < bound < 1
        assert log_capital(bound, upper) == pytest.approx(L, abs=1e-6)
        inside = bound + (0.01 if not upper else -0.01)
        assert log_capital(inside, upper) < L and log_capital(2 * bound - inside, upper) > L


def test_rollout_decision_keeps_widen_and_promote_apart():
    stages = [[0.1, 7200], [0.3, 14400], [1.0, 0]]
    s0 = {"index": 0, "ratio": 0.1, "sequential_decision": "widen"}
    s1 = {"index": 1, "ratio": 0.3, "sequential_decision": "widen"}
    first = ab_analysis.rollout_decision([s0], stages)
    assert first == {"decision": "widen", "stage": 0, "final_ratio": 0.3, "promoted": False}
    both = ab_analysis.rollout_decision([s0, s1], stages)
    assert both["decision"] == "promote" and both["promoted"] and both["final_ratio"] == 1.0
    held = ab_analysis.rollout_decision([s0, {**s1, "sequential_decision": "keep observing"}], stages)
    assert held["decision"] == "keep observing" and held["final_ratio"] == 0.3 and not held["promoted"]
    assert ab_analysis.rollout_decision([{**s0, "sequential_decision": "roll back"}], stages)["final_ratio"] == 0.0


def test_stage_action_look_by_look_equals_the_whole_path():
    """A live rollout calls stage_action on the rows so far at each look; it must act where the batch analysis
    of the whole stage says it acts (the benchmark and the report use the batch path)."""
    st = ab.Settings()
    for p_c, seed in ((0.75, 1), (0.15, 2), (0.45, 3)):
        stage = ab.Stage(0, 0.3, 0.0, 3600, 1.0, 900, 900)
        d = _sim(1, 1800, 0.3, p_c, 0.45, seed=seed, T=7200)
        cols = {k: d[k] for k in ("t", "arm", "reward", "error", "latency_ms")}
        looks, _, C = ab_analysis.stage_path(cols, stage, st, stage.hard_end)
        code, i = ab.first_action(C["sequential"], looks, stage.planned_end)
        live = None
        for look in stage.look_times():
            upto = cols["t"] <= look
            live = ab_analysis.stage_action({k: v[upto] for k, v in cols.items()}, stage, st, float(look), "sequential")
            if live:
                break
        expect = None if int(code) == ab.KEEP else (ab.DECISIONS[int(code)], float(looks[int(i)]))
        assert live == expect


@pytest.mark.parametrize("users", [0, 300])
def test_rows_without_a_reward_count_in_the_guardrails_only(users):
    """A live look sees requests whose feedback has not arrived (reward NaN): the reward's statistics and
    its confidence sequence are those of the rewarded rows alone; error rates and SRM count every request."""
    stage = ab.Stage(0, 0.3, 0.0, 3600, 0.0, 900, 900)
    st = ab.Settings(min_per_arm=5)
    d = _sim(1, 1500, 0.3, 0.6, 0.45, seed=12, T=3600, err_c=0.05)
    rng = np.random.default_rng(12)
    cols = {k: d[k] for k in ("t", "arm", "reward", "error", "latency_ms")}
    if users:  # units: users, all of a user's requests in one arm
        cols["unit"] = rng.integers(0, users, len(cols["t"]))
        cols["arm"] = (np.array([ab.bucket(f"u{u}") for u in range(users)]) < 0.3).astype(np.int8)[cols["unit"]]
    missing = (rng.random(len(cols["t"])) < 0.3) & ~cols["error"]
    part = {**cols, "reward": np.where(missing, np.nan, cols["reward"])}
    rewarded = {k: v[~missing] for k, v in cols.items()}
    full, ref = ab_analysis.analyse_stage(part, stage, st), ab_analysis.analyse_stage(rewarded, stage, st)
    for k in ("n_baseline", "n_candidate", "baseline_mean", "candidate_mean", "delta", "p_value", "var_delta"):
        assert full[k] == pytest.approx(ref[k], rel=1e-12), k
    assert full["mann_whitney"] == ref["mann_whitney"]
    if not users:  # request units: a row without a reward is simply absent from the reward's CS
        for a, b in zip(full["sequential"]["looks"], ref["sequential"]["looks"]):
            assert (a["cs_lower"], a["cs_upper"], a["delta"]) == pytest.approx(
                (b["cs_lower"], b["cs_upper"], b["delta"])
            )
    cand = cols["arm"] == 1
    g = full["guardrails"]
    assert g["error_rate_candidate"] == pytest.approx(cols["error"][cand].mean())  # every request, not just rewarded
    assert g["errors_candidate"] == int(cols["error"][cand].sum())
    last = full["sequential"]["looks"][-1]
    assert last["requests_candidate"] == int(cand.sum()) > last["n_candidate"] == full["n_candidate"]
    units = len(np.unique(cols["unit"][cand])) if users else int(cand.sum())
    assert full["srm"]["units_candidate"] == units
    # the pooled user's fields ignore rows without a reward too
    overall = ab_analysis.analyse_log({**part, "stage": np.zeros(len(part["t"]), np.int64)}, [stage], st)["overall"]
    assert overall["n_candidate"] == ref["n_candidate"] and np.isfinite(overall["delta"])
