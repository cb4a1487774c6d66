"""The A/B rollout's sequential statistics: the always-valid confidence sequence, SRM, Wilson and Mann-Whitney,
and the vectorised per-look sums and decision codes they are computed from.

Stage: validate (A/B). Reads and writes nothing: ``hermes_lab.ab`` (the router, compare(), the rules and the
stage analysis) calls it, ``hermes_lab.ab_run`` drives the traffic. Why a confidence sequence and how its
boundary is chosen: the docstring of ``hermes_lab.ab``.

    python -c "from hermes_lab.ab_stats import wilson; print(wilson(45, 50))"
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    from hermes_lab.ab import Settings

KEEP, PROMOTE, ROLLBACK, HOLD = 0, 1, 2, 3
DECISIONS = ("keep observing", "promote", "roll back", "hold")
LAT_BINS = np.linspace(0.0, np.log(1e5), 257)  # log-latency histogram edges (1 ms..100 s): ~4.5% wide bins, plenty
# for a "p95 ratio > 1.5" guardrail; the report also gives the exact p95 of the final look


# ------------------------------------------------------------------------------ sequential statistics
@lru_cache(maxsize=16)
def _mixture_x(alpha: float) -> float:
    """tau^2 / V at which the normal-mixture boundary is narrowest (Waudby-Smith et al., sec. 2.5)."""
    from scipy.optimize import minimize_scalar

    L = math.log(1 / alpha)
    return float(
        minimize_scalar(lambda x: (1 + 1 / x) * (math.log1p(x) + 2 * L), bounds=(1e-3, 1e4), method="bounded").x
    )


def cs_halfwidth(V: np.ndarray, alpha: float, v_star: float) -> np.ndarray:
    """Half-width of the two-sided (1-alpha) normal-mixture confidence sequence for an estimate of variance V.

    Robbins' mixture over a N(0, tau^2) alternative: the CS is est +- sqrt(V(V+tau^2)/tau^2 *
    (2 log(1/alpha) + log(1 + tau^2/V))), valid simultaneously over all looks. tau^2 is fixed in advance
    from the planned variance at the stage end ``v_star`` (not from the data), so that is where it is
    narrowest; coverage holds for any tau.
    """
    V = np.asarray(V, dtype=np.float64)
    tau2 = _mixture_x(alpha) * v_star
    with np.errstate(divide="ignore", invalid="ignore"):
        hw = np.sqrt(V * (V + tau2) / tau2 * (2 * math.log(1 / alpha) + np.log1p(tau2 / V)))
    return np.where(np.isfinite(hw), hw, np.inf)


def srm_pvalue(n_c: np.ndarray, n_b: np.ndarray, ratio: float) -> np.ndarray:
    """Sample-ratio-mismatch chi-square p (scipy.stats.chisquare) of the observed split vs the ratio.

    1.0 while an arm expects fewer than 5 units: the chi-square approximation is not valid there (3 of
    3 requests in a 10% arm would read p = 2e-7, though it happens once in a thousand).
    """
    from scipy import stats

    n_c, n_b = np.asarray(n_c, float), np.asarray(n_b, float)
    n = n_c + n_b
    obs = np.stack([n_c, n_b], axis=-1)
    exp = np.stack([n * ratio, n * (1 - ratio)], axis=-1)
    ok = (n * ratio >= 5) & (n * (1 - ratio) >= 5)
    p = np.ones(n.shape)
    if ok.any():
        p[ok] = stats.chisquare(obs[ok], exp[ok], axis=-1).pvalue
    return p


def wilson(successes: int, n: int, alpha: float = 0.05) -> list[float]:
    """Wilson score interval of a success rate (statsmodels proportion_confint)."""
    from statsmodels.stats.proportion import proportion_confint

    if n == 0:
        return [float("nan"), float("nan")]
    lo, hi = proportion_confint(successes, n, alpha=alpha, method="wilson")
    return [float(lo), float(hi)]


def _runs(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Distinct values of a sorted array and how often each occurs."""
    starts = np.flatnonzero(np.concatenate([[True], x[1:] != x[:-1]]))
    return x[starts], np.diff(np.append(starts, len(x))).astype(np.float64)


def mann_whitney(c: np.ndarray, b: np.ndarray) -> dict[str, float]:
    """Two-sided Mann-Whitney U of candidate vs baseline scores, and P(C > B) + P(C = B)/2.

    Small samples go to scipy. Large ones use scipy's asymptotic formula (tie correction, continuity)
    with U counted from the two sorted arms (no rank array), several times faster than scipy's
    rankdata on millions of scores; tests/test_ab.py checks both agree.
    """
    from scipy import stats

    n1, n2 = len(c), len(b)
    if n1 < 2 or n2 < 2:
        return {"U": float("nan"), "p_value": float("nan"), "prob_superiority": float("nan")}
    if n1 + n2 < 100_000:
        r = stats.mannwhitneyu(c, b, alternative="two-sided")
        U1, p = float(r.statistic), float(r.pvalue)
    else:
        # sort each arm once; U1 = sum over candidate values of (#baseline below + #baseline equal / 2)
        cs, bs = np.sort(c), np.sort(b)
        vc, kc = _runs(cs)
        below = np.searchsorted(bs, vc, "left")
        equal = np.searchsorted(bs, vc, "right") - below
        U1 = float(np.dot(kc, below + equal / 2.0))
        vb, kb = _runs(bs)
        vals = np.union1d(vc, vb)
        counts = np.zeros(len(vals))
        counts[np.searchsorted(vals, vc)] += kc
        counts[np.searchsorted(vals, vb)] += kb
        n = n1 + n2
        tie = float(((counts.astype(np.float64)) ** 3 - counts).sum())
        s = math.sqrt(n1 * n2 / 12 * ((n + 1) - tie / (n * (n - 1))))
        z = (max(U1, n1 * n2 - U1) - n1 * n2 / 2 - 0.5) / s if s > 0 else 0.0
        p = float(min(1.0, 2 * stats.norm.sf(z)))
    return {"U": U1, "p_value": p, "prob_superiority": U1 / (n1 * n2)}


# --------------------------------------------------------------------------- vectorised look statistics
def look_sums(
    t: np.ndarray,
    arm: np.ndarray,
    reward: np.ndarray,
    error: np.ndarray,
    latency_ms: np.ndarray,
    look_times: np.ndarray,
    group: np.ndarray | None = None,
    n_groups: int = 1,
    unit: np.ndarray | None = None,
) -> dict[str, np.ndarray]:
    """Cumulative per-arm sums at each look, shape (groups, looks, 2) (arm 0 baseline, 1 candidate).

    One bincount per quantity over the key (group, look, arm): a row belongs to the first look at or
    after its time. ``group`` lets the decision benchmark analyse thousands of simulated experiments at
    once. ``unit`` (codes) switches to unit-level (cluster-robust) variances when units repeat.
    """
    L = len(look_times)
    look = np.searchsorted(look_times, t, side="left")
    keep = look < L
    g = np.zeros(len(t), np.int64) if group is None else np.asarray(group, np.int64)
    key = ((g * L + look) * 2 + arm.astype(np.int64))[keep]
    size, shape = n_groups * L * 2, (n_groups, L, 2)

    def cum(w: np.ndarray | None) -> np.ndarray:
        return np.cumsum(np.bincount(key, weights=w, minlength=size).reshape(shape), axis=1)

    r = reward[keep].astype(np.float64)
    ll = np.log(np.maximum(latency_ms[keep], 1.0))
    out = {
        "n": cum(None),
        "s1": cum(r),
        "s2": cum(r * r),
        "nerr": cum(error[keep].astype(np.float64)),
        "l1": cum(ll),
        "l2": cum(ll * ll),
    }
    nb = len(LAT_BINS) - 1  # uniform bins: the index is arithmetic, no search
    lb = np.minimum(((ll - LAT_BINS[0]) * (nb / (LAT_BINS[-1] - LAT_BINS[0]))).astype(np.int64), nb - 1)
    out["hist"] = np.cumsum(np.bincount(key * nb + lb, minlength=size * nb).reshape(*shape, nb), axis=1)
    if unit is not None and group is None:
        u = np.asarray(unit, np.int64)[keep]
        nu = int(u.max()) + 1 if u.size else 1
        if nu < keep.sum():  # units repeat: per-unit sums so the variance counts units, not requests
            ukey = key * nu + u
            S = np.cumsum(np.bincount(ukey, weights=r, minlength=size * nu).reshape(*shape, nu), axis=1)
            N = np.cumsum(np.bincount(ukey, minlength=size * nu).reshape(*shape, nu), axis=1).astype(float)
            out.update(uSS=(S * S).sum(-1), uSN=(S * N).sum(-1), uNN=(N * N).sum(-1))
    return out


def look_stats(sums: dict[str, np.ndarray], ratio: float, plan_k: float, st: Settings) -> dict[str, np.ndarray]:
    """Per-look statistics from ``look_sums``: means, delta, its confidence sequence, Welch p, SRM,
    guardrail inputs. Arrays shaped like the sums without the arm axis.

    ``plan_k`` = 1/n_c + 1/n_b planned at the stage end: each metric's CS is tuned to be narrowest
    there (variance guess x plan_k): scores ``cs_sd``^2, error indicator 0.05, log-latency 0.1.
    """
    from scipy import stats

    n = sums["n"].astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        mean = sums["s1"] / n
        var = np.maximum(sums["s2"] - n * mean**2, 0) / (n - 1)  # sample variance, ddof=1 like scipy
        if "uSS" in sums:  # cluster-robust variance of a ratio-of-sums mean (units are the i.i.d. draws)
            vm = np.maximum(sums["uSS"] - 2 * mean * sums["uSN"] + mean**2 * sums["uNN"], 0) / n**2
        else:
            vm = var / n
        # one pseudo-observation at the largest variance a [0, scale] score can have: early looks whose
        # few scores happen to be equal must not produce a zero-width interval
        vm = vm + (st.scale**2 / 4) / n**2
        delta = mean[..., 1] - mean[..., 0]
        V = vm[..., 1] + vm[..., 0]
        hw = cs_halfwidth(V, st.alpha, st.cs_sd**2 * plan_k)
        err = sums["nerr"] / n
        err_V = (err * (1 - err) / n).sum(-1) + 0.25 / n[..., 1] ** 2 + 0.25 / n[..., 0] ** 2
        err_d = err[..., 1] - err[..., 0]
        lm = sums["l1"] / n
        lvar = np.maximum(sums["l2"] - n * lm**2, 0) / (n - 1)
        l_d = lm[..., 1] - lm[..., 0]
        l_V = (lvar / n).sum(-1)
        welch = stats.ttest_ind_from_stats(
            mean[..., 1],
            np.sqrt(var[..., 1]),
            n[..., 1],
            mean[..., 0],
            np.sqrt(var[..., 0]),
            n[..., 0],
            equal_var=False,
        ).pvalue
    hist = sums["hist"]
    cnt = hist.cumsum(-1)
    idx = np.argmax(cnt >= 0.95 * np.maximum(cnt[..., -1:], 1), axis=-1)  # first bin reaching 95%
    p95 = np.exp((LAT_BINS[idx] + LAT_BINS[idx + 1]) / 2)
    enough = (n[..., 1] >= st.min_per_arm) & (n[..., 0] >= st.min_per_arm)
    return {
        "n_b": n[..., 0],
        "n_c": n[..., 1],
        "mean_b": mean[..., 0],
        "mean_c": mean[..., 1],
        "delta": delta,
        "V": V,
        "lo": np.where(enough, delta - hw, -np.inf),
        "hi": np.where(enough, delta + hw, np.inf),
        "welch_p": np.where(np.isfinite(welch), welch, 1.0),
        "err_b": err[..., 0],
        "err_c": err[..., 1],
        "err_lo": err_d - cs_halfwidth(err_V, st.alpha, 0.05 * plan_k),
        "p95_b": p95[..., 0],
        "p95_c": p95[..., 1],
        "lat_lo": l_d - cs_halfwidth(l_V, st.alpha, 0.1 * plan_k),
        "srm_p": srm_pvalue(n[..., 1], n[..., 0], ratio),
        "enough": enough,
    }


def rule_codes(S: dict[str, np.ndarray], st: Settings) -> dict[str, np.ndarray]:
    """Both rules at every look, as decision codes, plus the condition flags that explain them."""
    enough = S["enough"]
    err_guard = enough & (S["err_c"] - S["err_b"] > st.max_error_rate) & (S["err_lo"] > 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        lat_guard = enough & (S["p95_c"] / S["p95_b"] > st.max_latency_ratio) & (S["lat_lo"] > 0)
    srm = S["srm_p"] < st.srm_alpha
    harm, benefit = enough & (S["hi"] < 0), enough & (S["lo"] > 0)
    guard = err_guard | lat_guard
    seq = np.where(guard, ROLLBACK, np.where(srm, HOLD, np.where(harm, ROLLBACK, np.where(benefit, PROMOTE, KEEP))))
    d = S["delta"]
    # the user's rule, gated by the same minimum sample (a rule read at n = 3 is not worth simulating)
    user = np.where(enough & (d < 0), ROLLBACK, np.where(enough & (d > 0) & (S["welch_p"] < st.alpha), PROMOTE, KEEP))
    return {
        "sequential": seq,
        "user": user,
        "err_guard": err_guard,
        "lat_guard": lat_guard,
        "srm": srm,
        "harm": harm,
        "benefit": benefit,
    }


def first_action(codes: np.ndarray, look_times: np.ndarray, planned_end: float) -> tuple[np.ndarray, np.ndarray]:
    """Rollout semantics over looks (last axis): roll back / hold act at once, promote from the planned
    stage end on. Returns (decision code, look index it was taken at); no action -> keep observing at the
    last look."""
    acts = (codes == ROLLBACK) | (codes == HOLD) | ((codes == PROMOTE) & (look_times >= planned_end - 1e-9))
    any_act = acts.any(-1)
    idx = np.where(any_act, np.argmax(acts, -1), codes.shape[-1] - 1)
    code = np.take_along_axis(codes, idx[..., None], -1)[..., 0]
    return np.where(any_act, code, KEEP), idx


def explain(
    S: dict[str, np.ndarray], C: dict[str, np.ndarray], i: int, st: Settings, code: int, before_end: bool
) -> list[str]:
    """Why the sequential rule decided ``code`` at look ``i``, in words."""
    g = lambda k: float(np.asarray(S[k])[i])  # noqa: E731
    r = []
    if not bool(np.asarray(S["enough"])[i]):
        r.append(f"fewer than {st.min_per_arm} requests in an arm: no statistical decision yet")
    if C["err_guard"][i]:
        r.append(
            f"guardrail: candidate error rate {g('err_c'):.1%} vs baseline {g('err_b'):.1%} "
            f"(> +{st.max_error_rate:.1%}, significant)"
        )
    if C["lat_guard"][i]:
        r.append(f"guardrail: p95 latency ratio {g('p95_c') / g('p95_b'):.2f} > {st.max_latency_ratio} (significant)")
    if C["srm"][i]:
        r.append(
            f"sample ratio mismatch: chi-square p = {g('srm_p'):.2g} < {st.srm_alpha}; the split is broken, "
            "check the router before trusting any number"
        )
    cs = f"{1 - st.alpha:.0%} confidence sequence for delta [{g('lo'):+.3f}, {g('hi'):+.3f}]"
    if C["harm"][i]:
        r.append(f"significant harm: {cs} lies entirely below 0")
    elif C["benefit"][i]:
        r.append(
            f"significant improvement: {cs} lies entirely above 0"
            + (" (promotion waits for the stage's planned end)" if before_end else "")
        )
    elif np.isfinite(g("lo")):
        r.append(f"inconclusive: {cs} contains 0")
    r.append(f"decision: {DECISIONS[code]}")
    return r
