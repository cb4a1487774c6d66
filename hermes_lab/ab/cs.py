"""Always-valid statistics of the A/B gate: a finite-sample confidence sequence for a difference of two
bounded means under Bernoulli(p) assignment, unit-level observations, and an anytime-valid SRM test.

Stage: validate (A/B). Reads and writes nothing; ``hermes_lab.ab.stats`` calls it at every look of a stage.

The confidence sequence (CS), and why this one
----------------------------------------------
Each randomised unit (a request, or a user when ``ab.unit: user``) is one observation ``X`` in [0, 1]
(reward / scale, an error indicator, a latency-exceedance indicator), assigned to the candidate with the
stage's ratio ``p``. We need a CS for ``delta = E[X | candidate] - E[X | baseline]`` that holds at every
look and every sample size, not only asymptotically: with rare successes and a 10% arm the asymptotic
normal-mixture CS this module replaces rolled back more than 5% of A/A tests.

1. *Pseudo-outcome* (augmented inverse-propensity weighting, a standard construction for anytime-valid
   inference on randomised experiments, e.g. Waudby-Smith, Arbour, Sinha, Kennedy & Ramdas 2024):
   ``psi = Z (X - g)/p - (1 - Z)(X - h)/(1 - p) + g - h`` with ``g``, ``h`` the arms' means estimated from
   earlier looks only. Whatever ``g`` and ``h`` are, ``E[psi | past] = delta`` exactly, and with good
   estimates its variance is ``Var_c/p + Var_b/(1-p)``, the difference-in-means variance. ``psi`` lies in
   bounds known before the observation (they depend on ``g``, ``h``, ``p``).
2. *Betting with Fan's inequality*: for ``xi >= -U`` and ``0 <= lam < 1/U``,
   ``exp(lam xi - c xi^2) <= 1 + lam xi`` with ``c = psi_F(lam U) / U^2``, ``psi_F(x) = -log(1-x) - x``
   (Fan, Grama & Liu 2015; the inequality behind the empirical-Bernstein CS of Waudby-Smith & Ramdas,
   JRSS-B 2024, "Estimating means of bounded random variables by betting", Thm 2). With ``xi = psi - d``
   and bets ``lam`` fixed before each look window, ``M_t(d) = exp(sum lam (psi - d) - sum c (psi - d)^2)``
   is a nonnegative supermartingale under ``delta = d``, so by Ville's inequality
   ``P(exists t: M_t(delta) >= 2/alpha) <= alpha/2``. That is the whole proof: no CLT, valid at every n.
   ``c`` may differ between the arms (the pointwise inequality holds with each observation's own range),
   which keeps the baseline's narrow range from paying for the candidate's wide one; ``lam`` may not.
3. ``log M_t(d)`` is a concave quadratic in ``d``: each endpoint of the CS is a root, in closed form, of
   per-(look, arm) sums of n, sum X, sum X^2. So a look costs O(rows) (bincounts) plus O(looks), and a
   live rollout can call it on a growing log. The running intersection over looks is kept (still valid).
4. Bets: ``lam = sqrt(2 log(2/alpha) / (n* Var(psi)))``, the bet that makes the bound tightest at the
   stage's planned number of units ``n*`` (where promotion is decided), with ``Var(psi)`` estimated from
   earlier looks, capped at ``lam U <= 1/2``. The choice affects power only, never validity.

Units. When users are randomised, a user's requests are not independent, so the i.i.d. draw is the user:
each unit enters the CS once, in the look window where it first appears in the stage, with the mean of its
requests in that window (later requests still count in the reported per-request numbers). Requests as
units: every request is its own unit, and this reduces to the request-level CS.

SRM. The sample-ratio check counts units: under a working router each new unit is Bernoulli(p), so the
Beta-binomial mixture likelihood ratio (Lindon & Malek 2022, "Anytime-valid inference for multinomial
count data") is a test martingale; its running maximum gives a p-value valid under continuous monitoring.

Packages considered (PyPI): ``expectation`` (0.6) needs Python >= 3.12 and is GPL-3.0 with an AI-training
clause; ``avinf`` (1.0) needs Python >= 3.12 and its tests are Gaussian linear models, not bounded data;
``confseq`` (0.0.11, 2023) has the reference betting CSs for one bounded mean only, needs a C++/CMake build
and pulls pytest at run time; ``savvi`` (0.3) has the multinomial SRM test but pulls cvxpy for it. None
has a bounded-data CS for a difference under unequal allocation, so the few closed-form lines live here,
and tests/ab/test_ab.py checks their coverage by simulation (A/A at every look, rare successes, small arms).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

BET_CAP = 0.5  # lam * U <= 1/2: the truncation Waudby-Smith & Ramdas recommend for predictable bets
SRM_PRIOR_K = 100.0  # Beta prior concentration of the SRM test (savvi's default): ~3 points sd at p = 0.1


def fan_psi(x: np.ndarray) -> np.ndarray:
    """-log(1 - x) - x, for 0 <= x < 1 (Fan et al.'s exponent)."""
    return -np.log1p(-x) - x


def _prev(a: np.ndarray) -> np.ndarray:
    """Cumulative sums through the previous window (axis -2): what a bet may use."""
    c = np.cumsum(a, axis=-2)
    return np.concatenate([np.zeros_like(c[..., :1, :]), c[..., :-1, :]], axis=-2)


def unit_window_sums(
    win: np.ndarray,
    arm: np.ndarray,
    X: np.ndarray,
    n_windows: int,
    unit: np.ndarray | None = None,
    group: np.ndarray | None = None,
    n_groups: int = 1,
) -> dict[str, np.ndarray]:
    """Unit observations per (group, entry window, arm): n (G, W, 2) and, per metric row of ``X`` (K, rows),
    S = sum and Q = sum of squares, shape (K, G, W, 2); ``rows`` (G, W): the requests behind them.
    ``win``: each row's look window (0..W-1).

    ``unit`` None: every row is a unit. Otherwise a unit enters in the window where it first appears, its
    observation the mean of its rows in that window; its later rows are left out (they are not independent
    of its first ones). Entering later, with more of its rows, was tried: no power gained in the benchmark's
    heavy-user scenario, where the spread between users dominates.

    A NaN in ``X`` is a missing observation of that metric (a live request without feedback yet): it is
    left out of that metric's sums, and ``nk`` (K, G, W, 2) then counts each metric's units (a unit
    observes a metric when one of its rows in its entry window does); ``n`` counts every unit."""
    X = np.atleast_2d(np.asarray(X, np.float64))
    F = np.isfinite(X)
    missing = not F.all()
    g = np.zeros(len(win), np.int64) if group is None else np.asarray(group, np.int64)
    arm = np.asarray(arm, np.int64)
    cnt = np.ones(len(win))
    if unit is not None:
        u = np.asarray(unit, np.int64)
        key = g * (int(u.max()) + 1 if u.size else 1) + u
        _, first, inv = np.unique(key, return_index=True, return_inverse=True)
        ew = win[first]  # rows are in time order: a unit's first row is in its first window
        sel = win == ew[inv]
        cnt = np.bincount(inv[sel], minlength=len(first)).astype(np.float64)
        ok = cnt > 0
        per = np.stack([np.bincount(inv[sel], f[sel], len(first)) for f in F]) if missing else cnt
        with np.errstate(invalid="ignore"):
            X = np.stack([np.bincount(inv[sel], np.where(f, x, 0.0)[sel], len(first)) for x, f in zip(X, F)]) / per
        X = X[:, ok]
        F = np.isfinite(X)
        win, arm, g, cnt = ew[ok], arm[first][ok], g[first][ok], cnt[ok]
    key = (g * n_windows + win) * 2 + arm
    size, shape = n_groups * n_windows * 2, (n_groups, n_windows, 2)
    if missing:
        X = np.where(F, X, 0.0)
    out = {
        "n": np.bincount(key, minlength=size).reshape(shape).astype(np.float64),
        "S": np.stack([np.bincount(key, x, size).reshape(shape) for x in X]),
        "Q": np.stack([np.bincount(key, x * x, size).reshape(shape) for x in X]),
        "rows": np.bincount(key // 2, cnt, n_groups * n_windows).reshape(n_groups, n_windows),
    }
    if missing:
        out["nk"] = np.stack([np.bincount(key, f.astype(np.float64), size).reshape(shape) for f in F])
    return out


def _pseudo_sums(n: np.ndarray, S: np.ndarray, Q: np.ndarray, p: float) -> dict[str, np.ndarray]:
    """Predictable arm means g (candidate), h (baseline), Var(psi), and per-window sums of psi, psi^2."""
    pn, pS, pQ = _prev(n), _prev(S), _prev(Q)
    mean = (0.5 + pS) / (1.0 + pn)  # shrunk towards 1/2: defined before the first observation
    var = (0.25 + np.maximum(pQ - pS**2 / np.maximum(pn, 1.0), 0.0)) / (pn + 1.0)
    h, g = mean[..., 0], mean[..., 1]
    d = g - h
    n0, n1 = n[..., 0], n[..., 1]
    dev1, sq1 = S[..., 1] - n1 * g, Q[..., 1] - 2 * g * S[..., 1] + n1 * g**2  # sum (X-g), sum (X-g)^2
    dev0, sq0 = S[..., 0] - n0 * h, Q[..., 0] - 2 * h * S[..., 0] + n0 * h**2
    return {
        "g": g,
        "h": h,
        "v": var[..., 1] / p + var[..., 0] / (1 - p),
        "P1": dev1 / p + n1 * d,
        "Q1": sq1 / p**2 + 2 * d * dev1 / p + n1 * d**2,
        "P0": -dev0 / (1 - p) + n0 * d,
        "Q0": sq0 / (1 - p) ** 2 - 2 * d * dev0 / (1 - p) + n0 * d**2,
    }


def _ranges(g: Any, h: Any, p: float, upper: bool) -> tuple[Any, Any]:
    """How far a pseudo-outcome (predictions g, h) can lie beyond any d in [-1, 1] on the side bet against:
    (candidate U1, baseline U0). Below d for the lower bound, above it for the upper one."""
    d = g - h
    if upper:
        return (1 - g) / p + d + 1, h / (1 - p) + d + 1
    return g / p - d + 1, (1 - h) / (1 - p) - d + 1


def _side(
    ps: dict[str, np.ndarray], n: np.ndarray, p: float, n_star: Any, alpha: float, upper: bool, running: bool
) -> np.ndarray:
    """One side of the CS at every look: the lower bound (upper=False) or the upper bound, in [-1, 1]."""
    U1, U0 = _ranges(ps["g"], ps["h"], p, upper)
    L = math.log(1 / alpha)
    lam = np.sqrt(2 * L / (np.maximum(n_star, 1.0) * ps["v"]))
    lam = np.minimum(lam, BET_CAP / np.maximum(U1, U0))
    c1, c0 = fan_psi(lam * U1) / U1**2, fan_psi(lam * U0) / U0**2
    n0, n1 = n[..., 0], n[..., 1]
    sgn = -1.0 if upper else 1.0  # log M(x) = sum lam sgn (psi - x) - sum c (psi - x)^2
    A = -np.cumsum(c1 * n1 + c0 * n0, -1)
    B = np.cumsum(-sgn * lam * (n1 + n0) + 2 * (c1 * ps["P1"] + c0 * ps["P0"]), -1)
    C = np.cumsum(sgn * lam * (ps["P1"] + ps["P0"]) - (c1 * ps["Q1"] + c0 * ps["Q0"]), -1)
    return _solve(A, B, C, L, upper, running)


def _solve(A: np.ndarray, B: np.ndarray, C: np.ndarray, L: float, upper: bool, running: bool) -> np.ndarray:
    """The CS endpoint at every look from the cumulative coefficients of log M(x) = A x^2 + B x + C (A < 0):
    the root of log M = L on the side bet on, in [-1, 1]; the running intersection when ``running``."""
    edge = 1.0 if upper else -1.0  # the far end of the feasible range [-1, 1]
    excluded = A * edge**2 + B * edge + C >= L  # concave: {log M >= L} is an interval; it holds the edge
    with np.errstate(divide="ignore", invalid="ignore"):
        root = np.sqrt(np.maximum(B * B - 4 * A * (C - L), 0.0))
        r1, r2 = (-B + root) / (2 * A), (-B - root) / (2 * A)
        bound = np.minimum(r1, r2) if upper else np.maximum(r1, r2)
    bound = np.where(excluded & np.isfinite(bound), np.clip(bound, -1.0, 1.0), edge)
    if not running:
        return bound
    # the running intersection of a confidence sequence is one too
    return np.minimum.accumulate(bound, -1) if upper else np.maximum.accumulate(bound, -1)


def fan_cs(
    n: np.ndarray,
    S: np.ndarray,
    Q: np.ndarray,
    ratio: float,
    n_star: Any,
    alpha_lower: float | None,
    alpha_upper: float | None,
    running: bool = True,
) -> tuple[np.ndarray, np.ndarray]:
    """(lower, upper) bounds of delta at every look, shape (..., W), from per-window unit sums of X in
    [0, 1] (``unit_window_sums``). Each side is valid at every look with error alpha_side; None skips a
    side (its bound is then -1 or +1). ``n_star``: planned units at the stage end, broadcastable to W.
    ``running``: the running intersection over looks (default) or each look's own bounds."""
    ps = _pseudo_sums(n, S, Q, ratio)
    shape = n.shape[:-1]
    lo = _side(ps, n, ratio, n_star, alpha_lower, False, running) if alpha_lower else np.full(shape, -1.0)
    hi = _side(ps, n, ratio, n_star, alpha_upper, True, running) if alpha_upper else np.full(shape, 1.0)
    return lo, hi


def srm_pvalue(n_c: np.ndarray, n_b: np.ndarray, ratio: float, k: float = SRM_PRIOR_K) -> np.ndarray:
    """Anytime-valid sample-ratio-mismatch p-value of cumulative unit counts at each look (last axis).

    The Beta(k p, k (1-p)) mixture likelihood ratio against Bernoulli(ratio) assignment is a martingale
    under a working router; 1 / its running maximum is a p-value that stays valid however often it is read.
    """
    from scipy.special import betaln

    n_c, n_b = np.asarray(n_c, np.float64), np.asarray(n_b, np.float64)
    a, b = k * ratio, k * (1 - ratio)
    log_bf = betaln(a + n_c, b + n_b) - betaln(a, b) - n_c * math.log(ratio) - n_b * math.log1p(-ratio)
    return np.minimum(1.0, np.exp(-np.maximum.accumulate(np.atleast_1d(log_bf), axis=-1)))
