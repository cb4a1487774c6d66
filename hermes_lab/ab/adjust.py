"""Regression adjustment of the always-valid A/B statistics: the betting confidence sequence of
``hermes_lab.ab.cs`` on pseudo-outcomes whose outcome model uses covariates fixed before assignment.

Stage: validate (A/B). Reads and writes nothing; ``hermes_lab.ab.stats.look_path`` calls it at every look
of a stage when the rows carry covariate codes (``hermes_lab.ab.covariates`` builds them: the embedded
task's family and level or a conversation's opening turn as the *cell*, the prompt as the *task*, and the
outcomes of both in earlier rounds' logs as the *history*).

Why it stays valid (the whole argument; tests/ab/test_ab_adjust.py checks it in A/A simulations)
-----------------------------------------------------------------------------------------------
Unit i has a covariate X_i (its cell, task and history), fixed before it is assigned; the arm Z_i is
Bernoulli(p) independent of X_i and of everything before. Before unit i's look window the rule knows an
outcome model: predictions ``g(x)`` (candidate) and ``h(x)`` (baseline) in [0, 1], fitted only on units of
*earlier* windows and on earlier rounds' logs, never on unit i's own outcome or arm. The augmented IPW
pseudo-outcome

    psi_i = Z_i (Y_i - g(X_i)) / p - (1 - Z_i) (Y_i - h(X_i)) / (1 - p) + g(X_i) - h(X_i)

then has E[psi_i | past, X_i] = E[Y(1) - Y(0) | X_i], so E[psi_i | past] = delta for i.i.d. units; in an
A/A test it is 0 given *any* X_i, so the A/A guarantee holds even when the task mix drifts. With Y, g, h
in [0, 1] psi_i is bounded: below any d by ``U_i`` (``cs._ranges`` at the unit's own g, h). Fan's inequality
holds pointwise for each unit's own range, ``exp(lam xi - c_i xi^2) <= 1 + lam xi`` with
``c_i = psi_F(lam U_i) / U_i^2``, as long as the bet ``lam`` is fixed before the window and
``lam U_i < 1`` for every unit the window may bring: the cap uses the range any g, h in [0, 1] can give,
``max(1/p, 1/(1-p)) + 1``. So the capital is the same nonnegative supermartingale as in ``hermes_lab.ab.cs``
and Ville's inequality gives the same always-valid CS; only its width changes, by the variance of
``psi`` that the predictions remove (Lindon, Ham, Tingley & Bojinov 2022, "Anytime-valid linear models and
regression adjusted causal inference in randomized experiments"; Waudby-Smith, Arbour, Sinha, Kennedy &
Ramdas 2024 on predictable plug-ins). A unit without covariates gets the arm means as predictions: the
unadjusted pseudo-outcome of ``hermes_lab.ab.cs``.

The outcome model: arm means plus shrunken effects, in closed form
------------------------------------------------------------------
``h = m_b + e_cell + e_task``, ``g = m_c + e_cell + e_task`` (clipped to [0, 1]), with the arms' means
``m`` of earlier windows (shrunk towards 1/2 as ``cs`` does), the cell's effect ``e_cell`` = the mean
residual ``Y - m_arm`` of the cell's earlier units, and the task's effect ``e_task`` = the mean residual
left after the cell's, each shrunk towards 0 by ``K_CELL`` / ``K_TASK`` pseudo-units. The history (an
earlier round's mean of the cell, of the task, relative to the level above) enters as up to ``HIST_CAP``
pseudo-units at weight ``HIST_WEIGHT``: an earlier policy's outcomes predict, but less than this
experiment's own. One effect per level (an additive model) rather than a regression: a look costs a
few sorts and bincounts over the stage's rows, so the rollout's looks and the benchmark's thousands of
simulated experiments stay cheap. The constants affect the width only, never validity.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from hermes_lab.ab import cs as ab_cs

# the columns of a stage's rows the adjustment reads (all optional; without "cell" and "task": no adjustment)
COLUMNS = ("cell", "task", "hist_cell_dev", "hist_cell_n", "hist_task_dev", "hist_task_n")
K_CELL = 20.0  # a cell's effect counts as measured once it has ~20 units: cells are few, their effects stable
K_TASK = 3.0  # tasks within a cell differ a lot on the embedded suite (some prompts always slip)
HIST_WEIGHT = 0.5  # an earlier round's unit is worth half of this experiment's (the policy has changed since)
HIST_CAP = 40.0  # and a key's history counts as at most this many of them


def has_covariates(cols: dict[str, Any]) -> bool:
    """Whether the rows carry a covariate the adjustment can use (a cell or task code >= 0 somewhere)."""
    return any(k in cols and cols[k] is not None and np.any(np.asarray(cols[k]) >= 0) for k in ("cell", "task"))


def prior_key_sums(key: np.ndarray, win: np.ndarray, vals: np.ndarray) -> np.ndarray:
    """For every row: the sums of ``vals`` (K, rows) over the rows of the same key in *earlier* windows.

    Each key's running total grows window by window, in the rows' order within a window, and nothing else
    enters it: a row's prior sums are the same bits whatever later windows hold (a continued experiment
    recomputes its earlier looks exactly)."""
    n = len(key)
    out = np.zeros((len(vals), n))
    if n == 0:
        return out
    n_keys, n_win = int(key.max()) + 1, int(win.max()) + 1
    if n_keys * n_win <= 4 * n:  # few keys (cells): a dense (key, window) table
        idx = key * n_win + win
        for j, v in enumerate(vals):
            tot = np.bincount(idx, v, n_keys * n_win).reshape(n_keys, n_win)
            before = np.concatenate([np.zeros((n_keys, 1)), np.cumsum(tot[:, :-1], axis=1)], axis=1)
            out[j] = before.reshape(-1)[idx]
        return out
    order = np.argsort(win, kind="stable")  # many keys (tasks): one running table, window by window
    bounds = np.searchsorted(win[order], np.arange(n_win + 1))
    running = np.zeros((len(vals), n_keys))
    for w in range(n_win):
        rows = order[bounds[w] : bounds[w + 1]]
        if not len(rows):
            continue
        k = key[rows]
        out[:, rows] = running[:, k]
        for j, v in enumerate(vals):
            running[j] += np.bincount(k, v[rows], n_keys)
    return out


def _level_effect(
    key: np.ndarray,
    win: np.ndarray,
    r: dict[str, np.ndarray],
    m0: np.ndarray,
    m1: np.ndarray,
    above: np.ndarray,
    hist_dev: np.ndarray,
    hist_n: np.ndarray,
    k: float,
) -> np.ndarray:
    """The shrunken mean residual of each row's key over earlier windows (0 for rows without a key):
    residual = Y - the arm's mean now - ``above`` (the effect of the enclosing level, now)."""
    has = key >= 0
    eff = np.zeros(len(key))
    if not has.any():
        return eff
    sel: Any = slice(None) if has.all() else np.flatnonzero(has)
    n, arm = r["n"][sel], r["arm"][sel]
    S, n0, n1 = prior_key_sums(key[sel], win[sel], np.stack([r["S"][sel], n * (1 - arm), n * arm]))
    resid = S - n0 * m0[sel] - n1 * m1[sel] - (n0 + n1) * above[sel]
    hn = HIST_WEIGHT * np.minimum(hist_n[sel], HIST_CAP)
    eff[sel] = (resid + hn * hist_dev[sel]) / (n0 + n1 + hn + k)
    return eff


def _rows(
    win: np.ndarray, arm: np.ndarray, y: np.ndarray, cov: dict[str, np.ndarray | None], g_idx: np.ndarray, W: int
) -> dict[str, np.ndarray]:
    """The units as rows of moments (n, S = sum y, Q = sum y^2) with their group, window, arm and covariates.

    Units that share a prediction share a row: without task codes every unit of one (group, window, cell,
    arm) has the same g, h and range, so the CS needs only their moments (one bincount, no per-unit work:
    the plan's and the benchmark's thousands of simulated experiments). With task codes: one row per unit."""

    def col(name: str) -> np.ndarray:
        v = cov.get(name)
        return np.zeros(len(y)) if v is None else np.nan_to_num(np.asarray(v, np.float64))

    def codes(name: str) -> np.ndarray:
        v = cov.get(name)
        return np.full(len(y), -1, np.int64) if v is None else np.asarray(v, np.int64)

    cell, task = codes("cell"), codes("task")
    if (task >= 0).any():
        return {
            "g": g_idx, "win": win, "arm": arm.astype(np.float64), "cell": cell, "task": task,
            "n": np.ones(len(y)), "S": y, "Q": y * y,
            **{k: col(k) for k in COLUMNS[2:]},
        }  # fmt: skip
    span = int(cell.max()) + 2 if len(cell) else 1  # cell -1 (none) becomes 0
    key = ((g_idx * W + win) * span + cell + 1) * 2 + arm
    size = int(key.max()) + 1 if len(key) else 0
    n = np.bincount(key, minlength=size).astype(np.float64)
    used = np.flatnonzero(n)
    out = {"arm": (used % 2).astype(np.float64), "cell": (used // 2) % span - 1}
    gw = used // 2 // span
    out["g"], out["win"], out["task"] = gw // W, gw % W, np.full(len(used), -1, np.int64)
    out["n"], out["S"], out["Q"] = n[used], np.bincount(key, y, size)[used], np.bincount(key, y * y, size)[used]
    for name in COLUMNS[2:]:  # the history of a cell: one value per cell, so its mean over the row's units
        out[name] = np.bincount(key, col(name), size)[used] / out["n"]
    return out


def predictions(r: dict[str, np.ndarray], n_groups: int, n_windows: int) -> tuple[np.ndarray, ...]:
    """(g, h, m_c, m_b) of every row of ``_rows``: the predicted candidate and baseline outcome in [0, 1]
    from earlier windows only, and the arms' means it adds the covariates' effects to (the unadjusted
    predictions). Codes are made unique per group here, so simulated experiments never share a model."""
    g_idx, win, arm = r["g"], r["win"], r["arm"].astype(np.int64)
    key = (g_idx * n_windows + win) * 2 + arm
    size, shape = n_groups * n_windows * 2, (n_groups, n_windows, 2)
    n = np.bincount(key, r["n"], size).reshape(shape)
    S = np.bincount(key, r["S"], size).reshape(shape)
    pn, pS = ab_cs._prev(n[None])[0], ab_cs._prev(S[None])[0]
    mean = (0.5 + pS) / (1.0 + pn)  # the arms' means as cs shrinks them: the unadjusted predictions
    m0, m1 = mean[g_idx, win, 0], mean[g_idx, win, 1]

    def unique(c: np.ndarray) -> np.ndarray:
        span = int(c.max()) + 1 if c.size else 1
        return np.where(c >= 0, g_idx * span + c, -1)

    e_cell = _level_effect(
        unique(r["cell"]), win, r, m0, m1, np.zeros(len(win)), r["hist_cell_dev"], r["hist_cell_n"], K_CELL
    )
    e_task = _level_effect(unique(r["task"]), win, r, m0, m1, e_cell, r["hist_task_dev"], r["hist_task_n"], K_TASK)
    e = e_cell + e_task
    return np.clip(m1 + e, 0.0, 1.0), np.clip(m0 + e, 0.0, 1.0), m1, m0


def adjusted_cs(
    win: np.ndarray,
    arm: np.ndarray,
    y: np.ndarray,
    cov: dict[str, np.ndarray | None],
    ratio: float,
    n_star: Any,
    alpha_lower: float | None,
    alpha_upper: float | None,
    group: np.ndarray | None = None,
    n_groups: int = 1,
    n_windows: int = 1,
    running: bool = True,
) -> dict[str, np.ndarray]:
    """The regression-adjusted CS of delta at every look, from unit rows in time order: ``lo``, ``hi``
    (n_groups, n_windows), like ``cs.fan_cs``; ``var`` and ``var_plain``, per group, the variance of the
    adjusted pseudo-outcomes (what sets the width) and of the unadjusted ones of ``cs`` on the same units.

    ``y``: each unit's outcome in [0, 1] (NaN: none yet, the unit is left out); ``arm`` 0/1; ``win`` its
    look window; ``n_star``: the planned units the bets are tuned for, broadcastable to (groups, windows)."""
    p = float(ratio)
    g_idx = np.zeros(len(y), np.int64) if group is None else np.asarray(group, np.int64)
    ok = np.isfinite(y)
    win, arm, y, g_idx = np.asarray(win)[ok], np.asarray(arm, np.int64)[ok], np.asarray(y, np.float64)[ok], g_idx[ok]
    cov = {k: (None if v is None else np.asarray(v)[ok]) for k, v in cov.items()}
    G, W = n_groups, n_windows
    r = _rows(win, arm, y, cov, g_idx, W)
    g, h, m1, m0 = predictions(r, G, W)
    n, S, Q, z = r["n"], r["S"], r["Q"], r["arm"]
    # psi = a + b y on a row: its sums over the row's units from the moments
    b = np.where(z == 1, 1 / p, -1 / (1 - p))
    a = np.where(z == 1, -g / p, h / (1 - p)) + g - h
    sum_psi, sum_psi2 = n * a + b * S, n * a * a + 2 * a * b * S + b * b * Q
    gw = r["g"] * W + r["win"]
    # the bet's variance: each arm's squared residual in earlier windows (shrunk like cs's arm variances)
    pred = np.where(z == 1, g, h)
    key = gw * 2 + z.astype(np.int64)
    nn = np.bincount(key, n, G * W * 2).reshape(G, W, 2)
    rr = np.bincount(key, Q - 2 * pred * S + n * pred * pred, G * W * 2).reshape(G, W, 2)
    pn, prr = ab_cs._prev(nn[None])[0], ab_cs._prev(rr[None])[0]
    var = (0.25 + prr) / (pn + 1.0)
    v = var[..., 1] / p + var[..., 0] / (1 - p)
    u_cap = max(1 / p, 1 / (1 - p)) + 1  # any g, h in [0, 1]: a bound known before the window
    count = np.bincount(gw, n, G * W).reshape(G, W)
    total = np.bincount(gw, sum_psi, G * W).reshape(G, W)
    out: dict[str, np.ndarray] = {}
    for name, alpha, upper in (("lo", alpha_lower, False), ("hi", alpha_upper, True)):
        if not alpha:
            out[name] = np.full((G, W), 1.0 if upper else -1.0)
            continue
        L = math.log(1 / alpha)
        lam = np.minimum(np.sqrt(2 * L / (np.maximum(n_star, 1.0) * v)), ab_cs.BET_CAP / u_cap)
        lam = np.broadcast_to(lam, (G, W))
        U1, U0 = ab_cs._ranges(g, h, p, upper)
        U = np.where(z == 1, U1, U0)
        c = ab_cs.fan_psi(lam[r["g"], r["win"]] * U) / U**2
        sc = np.bincount(gw, c * n, G * W).reshape(G, W)
        scp = np.bincount(gw, c * sum_psi, G * W).reshape(G, W)
        scq = np.bincount(gw, c * sum_psi2, G * W).reshape(G, W)
        sgn = -1.0 if upper else 1.0
        A = -np.cumsum(sc, -1)
        B = np.cumsum(-sgn * lam * count + 2 * scp, -1)
        C = np.cumsum(sgn * lam * total - scq, -1)
        out[name] = ab_cs._solve(A, B, C, L, upper, running)
    # the variance reduction: Var(psi) per group, adjusted and with the arm means alone (cs's psi)
    bp = np.where(z == 1, -m1 / p, m0 / (1 - p)) + m1 - m0
    plain1, plain2 = n * bp + b * S, n * bp * bp + 2 * bp * b * S + b * b * Q
    out["var"] = _group_var(r["g"], n, sum_psi, sum_psi2, G)
    out["var_plain"] = _group_var(r["g"], n, plain1, plain2, G)
    return out


def _group_var(g_idx: np.ndarray, n: np.ndarray, s1: np.ndarray, s2: np.ndarray, G: int) -> np.ndarray:
    """Sample variance per group from per-row counts, sums and sums of squares."""
    N = np.bincount(g_idx, n, G)
    S1, S2 = np.bincount(g_idx, s1, G), np.bincount(g_idx, s2, G)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.maximum(S2 - S1 * S1 / N, 0.0) / np.maximum(N - 1, 1)
