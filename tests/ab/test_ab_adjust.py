"""hermes_lab.ab.adjust: the regression-adjusted confidence sequence is predictable, solves its own betting
process, stays valid at every look in A/A simulations (covariates that predict, drift, history that lies),
and is narrower than the plain one when the covariates predict; hermes_lab.ab.covariates builds the keys."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from hermes_lab.ab import adjust, covariates
from hermes_lab.ab import cs as ab_cs
from hermes_lab.ab import stats as ab

CELLS = np.array([0.97, 0.9, 0.75, 0.5, 0.25])  # pass rates per cell: the embedded suite's spread, roughly


def _sim(reps, n, W, p, delta, seed, tasks=0, drift=False, history=None):
    """Units in time order per group: window, arm, outcome in [0, 1] (a pass scores 1, a miss partial
    credit), cell and task codes, history columns. ``history``: 'true' (the task's real deviation) or
    'lies' (the opposite)."""
    rng = np.random.default_rng(seed)
    win = np.tile(np.sort(rng.integers(0, W, n)), reps)
    g = np.repeat(np.arange(reps), n)
    C = len(CELLS)
    if drift:  # the mix moves from easy to hard cells over the stage
        cell = np.minimum((rng.random(reps * n) * C * (0.3 + win / W)).astype(int), C - 1)
    else:
        cell = rng.integers(0, C, reps * n)
    q = CELLS[cell]
    task = np.full(reps * n, -1)
    cov = {"cell": cell, "task": task}
    if tasks:
        task = cell * tasks + rng.integers(0, tasks, reps * n)
        dev = rng.normal(0, 0.15, C * tasks)
        q = np.clip(CELLS[task // tasks] + dev[task], 0.01, 0.99)
        cov["task"] = task
        if history:
            sign = 1.0 if history == "true" else -1.0
            cov["hist_task_dev"] = sign * dev[task] * 0.8
            cov["hist_task_n"] = np.full(reps * n, 30.0)
            cov["hist_cell_dev"] = CELLS[cell] - CELLS.mean()
            cov["hist_cell_n"] = np.full(reps * n, 200.0)
    arm = (rng.random(reps * n) < p).astype(np.int64)
    passed = rng.random(reps * n) < np.clip(q + delta * arm, 0, 1)
    y = np.where(passed, 1.0, 0.5 * rng.beta(2, 2, reps * n))
    return win, g, arm, y, cov


def _both(win, g, arm, y, cov, reps, W, p, n_star):
    s = ab_cs.unit_window_sums(win, arm, y[None], W, group=g, n_groups=reps)
    plain = ab_cs.fan_cs(s["n"], s["S"][0], s["Q"][0], p, n_star, 0.025, 0.025)
    adj = adjust.adjusted_cs(win, arm, y, cov, p, n_star, 0.025, 0.025, g, reps, W)
    return plain, adj


# -------------------------------------------------------------------------------------- the model
@pytest.mark.parametrize("n_keys", [4, 3000])  # the dense table and the sort
def test_prior_key_sums_are_the_same_key_in_earlier_windows(n_keys):
    rng = np.random.default_rng(n_keys)
    n = 2500
    key, win, vals = rng.integers(0, n_keys, n), np.sort(rng.integers(0, 6, n)), rng.random((2, n))
    got = adjust.prior_key_sums(key, win, vals)
    for i in rng.choice(n, 200, replace=False):
        ref = vals[:, (key == key[i]) & (win < win[i])].sum(axis=1)
        assert got[:, i] == pytest.approx(ref, abs=1e-9)


def test_predictions_never_see_their_own_window():
    """Changing every outcome and arm of window k leaves the predictions of windows <= k unchanged: the
    model of a window is fitted on earlier windows only (what makes the pseudo-outcomes predictable)."""
    W, reps = 6, 2
    win, g, arm, y, cov = _sim(reps, 900, W, 0.3, 0.05, seed=3, tasks=8)
    rows = lambda yy, aa: adjust._rows(win, aa, yy, cov, g, W)  # noqa: E731
    base = adjust.predictions(rows(y, arm), reps, W)
    for k in range(W):
        moved = win == k
        y2, arm2 = np.where(moved, 1 - y, y), np.where(moved, 1 - arm, arm)
        other = adjust.predictions(rows(y2, arm2), reps, W)
        upto = win <= k
        for a, b in zip(base[:2], other[:2]):  # to the last bit
            assert np.array_equal(a[upto], b[upto])
        if k < W - 1:
            assert np.abs(base[0][win > k] - other[0][win > k]).max() > 0.01  # later windows do learn from it


def test_units_without_covariates_get_the_plain_pseudo_outcome():
    W = 5
    win, g, arm, y, _ = _sim(1, 1200, W, 0.2, 0.0, seed=4)
    none = {"cell": np.full(len(y), -1), "task": np.full(len(y), -1)}
    g_, h_, m1, m0 = adjust.predictions(adjust._rows(win, arm, y, none, g, W), 1, W)
    assert np.array_equal(g_, m1) and np.array_equal(h_, m0)
    out = adjust.adjusted_cs(win, arm, y, none, 0.2, 1200, 0.025, 0.025, g, 1, W)
    assert out["var"][0] == pytest.approx(out["var_plain"][0])


def _brute_predictions(win, arm, y, cell, task, hist, W):
    """The model of the module docstring written out unit by unit (an independent implementation)."""
    g, h = np.zeros(len(y)), np.zeros(len(y))
    for i in range(len(y)):
        prev = win < win[i]
        m = [(0.5 + y[prev & (arm == a)].sum()) / (1 + (prev & (arm == a)).sum()) for a in (0, 1)]
        mj = np.where(arm == 1, m[1], m[0])
        hn_c, hn_t = (adjust.HIST_WEIGHT * min(hist[k][i], adjust.HIST_CAP) for k in ("hist_cell_n", "hist_task_n"))
        sel = prev & (cell == cell[i])
        e_c = ((y - mj)[sel].sum() + hn_c * hist["hist_cell_dev"][i]) / (sel.sum() + hn_c + adjust.K_CELL)
        sel = prev & (task == task[i])
        e_t = ((y - mj - e_c)[sel].sum() + hn_t * hist["hist_task_dev"][i]) / (sel.sum() + hn_t + adjust.K_TASK)
        e_t = e_t if task[i] >= 0 else 0.0  # no task: no task effect
        g[i], h[i] = min(max(m[1] + e_c + e_t, 0), 1), min(max(m[0] + e_c + e_t, 0), 1)
    return g, h


@pytest.mark.parametrize("tasks", [0, 6])  # cell rows aggregated by moments, and one row per unit
def test_closed_form_bounds_solve_the_betting_process_unit_by_unit(tasks):
    """Each endpoint solves log M(d) = log(1/alpha_side) for the capital computed one unit at a time from the
    brute-force predictions, bets fixed per window, each unit's own range."""
    W, p, n_star = 4, 0.25, 500
    win, g0, arm, y, cov = _sim(1, 500, W, p, 0.1, seed=5, tasks=tasks, history="true" if tasks else None)
    cell, task = cov["cell"], cov["task"]
    hist = {k: np.asarray(cov.get(k, np.zeros(len(y))), float) for k in adjust.COLUMNS[2:]}
    out = adjust.adjusted_cs(win, arm, y, {**cov, **hist}, p, n_star, 0.025, 0.025, g0, 1, W, running=False)
    gp, hp = _brute_predictions(win, arm, y, cell, task, hist, W)
    psi = np.where(arm == 1, (y - gp) / p, -(y - hp) / (1 - p)) + gp - hp
    res2 = (y - np.where(arm == 1, gp, hp)) ** 2
    L = math.log(1 / 0.025)

    def log_capital(d, upper):
        total = 0.0
        for w in range(W):
            prev, cur = win < w, win == w
            var = [(0.25 + res2[prev & (arm == a)].sum()) / ((prev & (arm == a)).sum() + 1) for a in (0, 1)]
            lam = math.sqrt(2 * L / (n_star * (var[1] / p + var[0] / (1 - p))))
            lam = min(lam, 0.5 / (max(1 / p, 1 / (1 - p)) + 1))
            for i in np.flatnonzero(cur):
                U1, U0 = ab_cs._ranges(gp[i], hp[i], p, upper)
                U = U1 if arm[i] else U0
                e = (d - psi[i]) if upper else (psi[i] - d)
                total += lam * e - ab_cs.fan_psi(lam * U) / U**2 * (psi[i] - d) ** 2
        return total

    for bound, upper in ((out["lo"][0, -1], False), (out["hi"][0, -1], True)):
        assert -1 < bound < 1
        assert log_capital(bound, upper) == pytest.approx(L, abs=1e-6)
        inside = bound + (-0.01 if upper else 0.01)
        assert log_capital(inside, upper) < L < log_capital(2 * bound - inside, upper)


# ------------------------------------------------------------------------------------ the guarantee
@pytest.mark.parametrize(
    "kw",
    [
        {"delta": 0.0},  # A/A, cells that predict
        {"delta": 0.0, "drift": True},  # A/A while the task mix drifts to the hard cells
        {"delta": 0.0, "tasks": 12},  # A/A, repeated tasks
        {"delta": 0.0, "tasks": 12, "history": "lies"},  # A/A, a history that predicts the opposite
        {"delta": 0.06, "tasks": 12, "history": "true"},  # a true effect: the CS covers it, not just 0
    ],
)
def test_adjusted_cs_covers_at_every_look(kw):
    reps, n, W, p = 300, 2400, 12, 0.1
    seed = 7 + int(100 * kw["delta"]) + 10 * kw.get("tasks", 0) + bool(kw.get("drift"))
    win, g, arm, y, cov = _sim(reps, n, W, p, seed=seed, **kw)
    _, adj = _both(win, g, arm, y, cov, reps, W, p, n)
    d = 0.0  # A/A; with an effect: the simulation's delta (one draw of task effects for all experiments), to
    if kw["delta"]:  # ~0.002 by the mean of the experiments' differences in means
        d = float(np.mean([y[(g == r) & (arm == 1)].mean() - y[(g == r) & (arm == 0)].mean() for r in range(reps)]))
    miss = ((adj["lo"] > d) | (adj["hi"] < d)).any(-1).mean()
    assert miss <= 0.05 + 0.025, miss  # alpha plus ~2 Monte Carlo s.e.; every look at once


def test_adjusted_is_narrower_when_the_covariates_predict_and_no_worse_when_they_do_not():
    reps, n, W, p = 200, 3000, 12, 0.1
    win, g, arm, y, cov = _sim(reps, n, W, p, 0.0, seed=11, tasks=12)
    (lo_p, hi_p), adj = _both(win, g, arm, y, cov, reps, W, p, n)
    width = lambda lo, hi: float((hi - lo)[:, -1].mean())  # noqa: E731
    assert width(adj["lo"], adj["hi"]) < 0.9 * width(lo_p, hi_p)
    assert np.median(adj["var"] / adj["var_plain"]) < 0.8
    noise = {"cell": np.random.default_rng(1).integers(0, 5, len(y)), "task": np.full(len(y), -1)}
    _, junk = _both(win, g, arm, y, noise, reps, W, p, n)
    assert width(junk["lo"], junk["hi"]) < 1.06 * width(lo_p, hi_p)  # cells that predict nothing cost little


def test_look_path_decides_on_the_adjusted_cs_and_keeps_the_plain_one():
    reps, n, W, p = 50, 3000, 8, 0.1
    win, g, arm, y, cov = _sim(reps, n, W, p, 0.05, seed=12, tasks=12)
    stage = ab.Stage(0, p, 0.0, 3600, 1.0, 900, n / 2)
    looks = stage.look_times()
    t = (win + np.tile(np.sort(np.random.default_rng(0).random(n)), reps)) * 900.0
    cols = {"t": t, "arm": arm.astype(np.int8), "reward": y * 5, "error": np.zeros(len(y), bool)}
    cols["latency_ms"] = np.full(len(y), 100.0)
    plain = ab.look_path(cols, looks, p, stage.tune_n, ab.Settings(), g, reps)
    adj = ab.look_path({**cols, **cov}, looks, p, stage.tune_n, ab.Settings(), g, reps)
    assert np.isnan(plain["var_ratio"]).all() and np.array_equal(plain["lo"], plain["lo_plain"])
    assert np.array_equal(adj["lo_plain"], plain["lo"])  # the plain CS, unchanged beside the adjusted one
    assert (adj["var_ratio"] < 0.9).all()
    # from the second half of the stage on (the model has learnt the cells by then) the adjusted CS is narrower
    late = slice(len(looks) // 2, None)
    assert ((adj["hi"] - adj["lo"])[:, late] < (adj["hi_plain"] - adj["lo_plain"])[:, late]).mean() > 0.9
    by_user = {**cols, **cov, "unit": np.arange(len(y)) // 3}
    users = ab.look_path(by_user, looks, p, stage.tune_n, ab.Settings(), g, reps)
    assert np.isnan(users["var_ratio"]).all()  # user units: the plain CS (covariates are per request)
    # conversation units: one reward row each (the first turn's; later turns' rewards are NaN): adjusted
    conv_unit = np.arange(len(y))
    later = {"t": t + 1e-3, "arm": cols["arm"], "reward": np.full(len(y), np.nan), "error": cols["error"]}
    later |= {"latency_ms": cols["latency_ms"], "unit": conv_unit, "cell": cov["cell"], "task": cov["task"]}
    first = {**cols, **cov, "unit": conv_unit}
    order = np.argsort(np.repeat(g, 2), kind="stable")  # each group's rows together, each turn after its first
    both = {k: np.stack([first[k], later[k]], 1).reshape(-1)[order] for k in first}
    convs = ab.look_path(both, looks, p, stage.tune_n, ab.Settings(), np.repeat(g, 2)[order], reps)
    assert np.isfinite(convs["var_ratio"]).all() and np.allclose(convs["var_ratio"], adj["var_ratio"])


# ------------------------------------------------------------------------------------- the keys
def test_keys_of_embedded_tasks_conversations_and_other_prompts():
    kinds = covariates.KINDS
    task_id = covariates.T.parse_prompt("add 12+7=").task_id
    assert covariates.keys_of({"prompt": "add 12+7="}, kinds) == ("add:2", task_id)
    assert covariates.keys_of({"prompt": "add 12+7="}, ["task"])[0] is None
    c, t = covariates.keys_of({"prompt": "what is the capital of peru?"}, kinds)
    assert c is None and t.startswith("prompt:")
    conv = {
        "messages": [
            {"role": "system", "content": 'You are Hermes. <tools>[{"name": "a"}, {"name": "b"}]</tools>'},
            {"role": "user", "content": "fix the failing test"},
            {"role": "assistant", "content": "<tool_call>...</tool_call>"},
            {"role": "tool", "content": "ok"},
        ]
    }
    cell, task = covariates.keys_of(conv, kinds)
    assert "tools=2" in cell and task.startswith("conv:")
    # a later turn of the same conversation keeps the opening turn's keys (later turns hold an arm's answers)
    later = {"messages": conv["messages"] + [{"role": "user", "content": "now run it"}]}
    assert covariates.keys_of(later, kinds) == (cell, task)
    sharegpt = {"conversations": [{"from": "system", "value": conv["messages"][0]["content"]},
                                  {"from": "human", "value": "fix the failing test"}]}  # fmt: skip
    assert covariates.keys_of(sharegpt, kinds)[1] == task


def test_history_gives_each_request_its_cells_and_tasks_earlier_outcomes(tmp_path):
    log = tmp_path / "requests.jsonl"
    rows = [{"prompt": "add 12+7=", "reward": 5.0}] * 3 + [{"prompt": "add 12+7=", "reward": 0.0}]
    rows += [{"prompt": "up cat=", "reward": 5.0}] * 4
    rows += [{"prompt": "no reward"}, {"prompt": "sort 31=", "reward": None}]
    log.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    hist = covariates.load_history([log, tmp_path / "missing.jsonl"], 5.0, covariates.KINDS)
    assert hist.rows == 8 and hist.sources == [str(log)]
    enc = covariates.Encoder(covariates.KINDS, hist)
    cols = enc.columns([{"prompt": "add 12+7="}, {"prompt": "up cat="}, {"prompt": "add 3+4="}, {"prompt": "hi"}])
    assert cols["cell"].tolist() == [0, 1, 2, -1] and cols["task"].tolist() == [0, 1, 2, 3]
    assert cols["hist_cell_dev"][0] == pytest.approx(0.75 - 7 / 8) and cols["hist_cell_n"][0] == 4
    assert cols["hist_task_dev"][0] == pytest.approx(0.0) and cols["hist_task_n"][0] == 4  # its cell's mean
    assert cols["hist_cell_n"][2] == 0 and cols["hist_task_n"][3] == 0  # nothing known: no prior
    assert not covariates.Encoder(["history"], hist)  # history alone has no key to attach to
