"""A/B split and analysis: the user's router and compare(), and the statistics that gate a rollout.

Stage: validate (A/B). Reads and writes nothing itself; ``hermes_lab.ab_run`` drives traffic through it
and writes ``runs/round-NN/ab/`` (request log, ab_report.json, plots); the analysis notebook
``notebooks/40_ab_analysis.ipynb`` shows the result.

    python -m hermes_lab.ab_run --baseline DIR --candidate DIR --ratio 0.1 --duration 7200 --output ab_report.json

The user's interfaces, bit for bit (docs/SPEC.md, "A/B split and analysis"):
- ``ABRouter(baseline, candidate, traffic_ratio).route(request_id)``: bucket = first 8 hex digits of
  md5(id) / 0xFFFFFFFF, candidate when bucket < ratio. A salt (empty by default: the exact formula) gives
  each experiment its own split; since a unit's bucket never changes, raising the ratio only moves units
  baseline -> candidate (monotone ramps). Any unit id works (request, user, conversation).
- ``compare(baseline_scores, candidate_scores)`` and the user's rule ``decide_user_rule``.

What gates the rollout by default (``ab.rule: sequential``) and why:
- Every stage is analysed on its own data only. The candidate share changes between stages, so pooling
  stages would weight time periods differently per arm (Simpson's paradox).
- Looks happen every ``ab.look_every`` seconds. A p < 0.05 rule read at every look rejects far more
  than 5% of A/A tests, so the test is an always-valid *confidence sequence* for delta: the asymptotic
  CS of Waudby-Smith, Arbour, Sinha, Kennedy & Ramdas ("Time-uniform central limit theory and
  asymptotic confidence sequences", 2024), i.e. Robbins' normal-mixture boundary with a plug-in variance.
  We chose it over a Gaussian mSPRT (Johari et al. 2017, the same boundary written as a likelihood
  ratio) because it yields the interval itself, which the rollback rule ("entirely below 0") and the
  plot need, and its validity rests on the CLT, not on normal scores (ours are bounded, bimodal). The
  maintained packages that implement it (confseq, savvi, expectation) are not dependencies of this
  project; the boundary is one closed-form line (``cs_halfwidth``), so we write it rather than add one.
- Decision at a look: failing guardrail (error rate or p95 latency clearly worse) -> roll back; sample
  ratio mismatch (chi-square p < srm_alpha) -> hold, the split is broken and no number can be trusted;
  CS entirely below 0 -> roll back (significant harm); CS entirely above 0 -> promote (widen), acted on
  only from the stage's planned end (docs/SPEC.md's "10% for 2 h" is a minimum exposure); otherwise keep
  observing (the stage is extended by up to ``max_extension`` times its length).
- Rollback needs *significant* harm: the user's "delta < 0 -> roll back" fires on ~half of all A/A
  tests at a single look (benchmarks/bench_ab_decisions.py measures both rules).

Vectorised throughout (bincount over (look, arm) keys): a 10M-request log is analysed in seconds
(benchmarks/bench_ab_analysis.py).
"""

from __future__ import annotations

import hashlib
import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

KEEP, PROMOTE, ROLLBACK, HOLD = 0, 1, 2, 3
DECISIONS = ("keep observing", "promote", "roll back", "hold")
LAT_BINS = np.linspace(0.0, np.log(1e5), 257)  # log-latency histogram edges (1 ms..100 s): ~4.5% wide bins, plenty
# for a "p95 ratio > 1.5" guardrail; the report also gives the exact p95 of the final look


# ------------------------------------------------------------------------------------------- routing
def bucket(unit_id: Any, salt: str = "") -> float:
    """docs/SPEC.md's bucket of a unit, in [0, 1]. With a salt the key is 'salt:id' (a fresh split per experiment)."""
    key = str(unit_id) if not salt else f"{salt}:{unit_id}"
    return int(hashlib.md5(key.encode("utf-8")).hexdigest()[:8], 16) / 0xFFFFFFFF


class ABRouter:
    """The user's router. ``route(id)`` -> ("candidate", candidate) when bucket < ratio, else baseline.

    The same id always lands in the same arm (md5 is stable across processes, unlike ``hash``). Note the
    docs/SPEC.md's threshold rule keeps the one id whose bucket is exactly 1.0 on baseline even at ratio 1.0.
    """

    def __init__(self, baseline_model: Any, candidate_model: Any, traffic_ratio: float = 0.1, salt: str = ""):
        if not 0 <= traffic_ratio <= 1:
            raise ValueError(f"traffic_ratio must lie in [0, 1], got {traffic_ratio}")
        self.baseline_model, self.candidate_model = baseline_model, candidate_model
        self.traffic_ratio, self.salt = float(traffic_ratio), salt

    def bucket(self, unit_id: Any) -> float:
        return bucket(unit_id, self.salt)

    def route(self, request_id: Any) -> tuple[str, Any]:
        if self.bucket(request_id) < self.traffic_ratio:
            return "candidate", self.candidate_model
        return "baseline", self.baseline_model

    def assign(self, unit_ids: Sequence[Any]) -> np.ndarray:
        """Vectorised routing: 1 where the unit goes to the candidate, 0 for baseline."""
        b = np.fromiter((self.bucket(u) for u in unit_ids), dtype=np.float64, count=len(unit_ids))
        return (b < self.traffic_ratio).astype(np.int8)

    def with_ratio(self, traffic_ratio: float) -> ABRouter:
        """The next ramp stage: same salt, so every candidate unit stays candidate."""
        return ABRouter(self.baseline_model, self.candidate_model, traffic_ratio, self.salt)


# ------------------------------------------------------------------------------- the user's analysis
def compare(
    baseline_scores: Sequence[float], candidate_scores: Sequence[float], threshold: float = 3.0
) -> dict[str, Any]:
    """The comparison of docs/SPEC.md: means, delta, success shares (>= 3), Welch p, significant."""
    from scipy import stats

    b = np.asarray(baseline_scores, dtype=np.float64)
    c = np.asarray(candidate_scores, dtype=np.float64)
    bm = float(b.mean()) if b.size else float("nan")
    cm = float(c.mean()) if c.size else float("nan")
    if b.size >= 2 and c.size >= 2:
        with warnings.catch_warnings():  # constant scores: scipy warns and returns nan, which we report
            warnings.simplefilter("ignore", RuntimeWarning)
            p = float(stats.ttest_ind(c, b, equal_var=False).pvalue)
    else:
        p = float("nan")  # Welch needs two observations per arm
    return {
        "baseline_mean": bm,
        "candidate_mean": cm,
        "delta": cm - bm,
        "baseline_success": float((b >= threshold).mean()) if b.size else float("nan"),
        "candidate_success": float((c >= threshold).mean()) if c.size else float("nan"),
        "p_value": p,
        "significant": bool(p < 0.05 and cm > bm),
        "n_baseline": int(b.size),
        "n_candidate": int(c.size),
    }


def decide_user_rule(result: dict[str, Any], alpha: float = 0.05) -> tuple[str, str]:
    """The user's table: delta > 0 and p < alpha -> widen; delta > 0 -> keep observing; delta < 0 -> roll back.
    delta == 0 or undefined is not in the table: keep observing."""
    d, p = result["delta"], result["p_value"]
    if d is None or not math.isfinite(d):
        return "keep observing", "no data in one arm yet"
    if d > 0 and p < alpha:
        return "promote", f"delta {d:+.3f} > 0 and p = {p:.3g} < {alpha}: widen traffic"
    if d > 0:
        return "keep observing", f"delta {d:+.3f} > 0 but p = {p:.3g} >= {alpha}: not significant"
    if d < 0:
        return "roll back", f"delta {d:+.3f} < 0: candidate below baseline"
    return "keep observing", "delta = 0"


# ---------------------------------------------------------------------------------------- settings
@dataclass
class Settings:
    """What the decision rules need, from ``cfg.ab`` and ``cfg.reward``."""

    alpha: float = 0.05
    srm_alpha: float = 0.001
    max_error_rate: float = 0.02
    max_latency_ratio: float = 1.5
    min_per_arm: int = 30
    cs_sd: float = 1.75
    scale: float = 5.0
    threshold: float = 3.0
    rule: str = "sequential"

    @classmethod
    def from_config(cls, cfg: Any) -> Settings:
        ab, rw = cfg.ab, cfg.reward
        return cls(
            alpha=ab.alpha,
            srm_alpha=ab.srm_alpha,
            max_error_rate=ab.max_error_rate,
            max_latency_ratio=ab.max_latency_ratio,
            min_per_arm=ab.min_per_arm,
            cs_sd=ab.cs_sd or 0.35 * rw.scale,
            scale=rw.scale,
            threshold=rw.success_threshold,
            rule=ab.rule,
        )


@dataclass
class Stage:
    """One rollout stage on the simulated time axis (seconds from the experiment start)."""

    index: int
    ratio: float
    start: float
    seconds: float
    max_extension: float = 1.0
    look_every: float = 900.0
    planned_n: float = 0.0  # expected requests in the planned length; tunes where the CS is tightest

    @property
    def planned_end(self) -> float:
        return self.start + self.seconds

    @property
    def hard_end(self) -> float:
        return self.start + self.seconds * (1 + self.max_extension)

    def look_times(self, until: float | None = None) -> np.ndarray:
        """Grid looks, the planned end always among them; cut at ``until`` (which becomes the last look)."""
        grid = (
            self.start
            + np.arange(1, int(np.ceil(self.seconds * (1 + self.max_extension) / self.look_every)) + 1)
            * self.look_every
        )
        grid = np.unique(np.append(np.minimum(grid, self.hard_end), self.planned_end))
        if until is not None and until < self.hard_end:
            grid = np.append(grid[grid < until], until)
        return grid


def plan_stages(
    stages: Sequence[Sequence[float]], request_rate: float, look_every: float, max_extension: float
) -> list[Stage]:
    """Stages with ratio < 1 are tested; the first ratio >= 1 (or 0 seconds) means 'promoted'."""
    out, start = [], 0.0
    for i, (ratio, seconds) in enumerate(stages):
        if ratio >= 1 or seconds <= 0:
            break
        out.append(Stage(i, float(ratio), start, float(seconds), max_extension, look_every, request_rate * seconds))
        start += seconds * (1 + max_extension)  # nominal; the runner starts a stage when the last one acts
    return out


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


# ----------------------------------------------------------------------------------- stage analysis
def _scalar(x: Any) -> Any:
    x = float(x)
    return x if math.isfinite(x) else None


def _breakdown(m: dict[str, np.ndarray], i: int, st: Settings) -> dict[str, Any]:
    """The user's fields for one slice from its per-arm moments (``_slice_moments`` row i), plus Wilson
    CIs of the success rates. Moments instead of arrays: every slice of a 10M-row log in one pass."""
    from scipy import stats

    n_b, n_c = (int(x) for x in m["n"][i])
    with np.errstate(divide="ignore", invalid="ignore"):
        bm, cm = m["s1"][i] / m["n"][i]
        vb, vc = np.maximum(m["s2"][i] - m["n"][i] * np.array([bm, cm]) ** 2, 0) / (m["n"][i] - 1)
    p = (
        float(stats.ttest_ind_from_stats(cm, np.sqrt(vc), n_c, bm, np.sqrt(vb), n_b, equal_var=False).pvalue)
        if n_b > 1 and n_c > 1
        else float("nan")
    )
    sb, sc = (int(x) for x in m["k"][i])
    return {
        "n_baseline": n_b,
        "n_candidate": n_c,
        "baseline_mean": _scalar(bm),
        "candidate_mean": _scalar(cm),
        "delta": _scalar(cm - bm),
        "p_value": _scalar(p),
        "significant": bool(p < st.alpha and cm > bm),
        "baseline_success": _scalar(sb / n_b if n_b else np.nan),
        "candidate_success": _scalar(sc / n_c if n_c else np.nan),
        "baseline_success_ci": wilson(sb, n_b, st.alpha),
        "candidate_success_ci": wilson(sc, n_c, st.alpha),
        "var_delta": _scalar(vc / n_c + vb / n_b) if n_b > 1 and n_c > 1 else None,
    }


def _slice_moments(
    code: np.ndarray, n_codes: int, arm: np.ndarray, r: np.ndarray, success: np.ndarray
) -> dict[str, np.ndarray]:
    """n, sum, sum of squares and successes per (slice code, arm): shape (n_codes, 2)."""
    key = code.astype(np.int64) * 2 + arm
    size = n_codes * 2
    return {
        "n": np.bincount(key, minlength=size).reshape(n_codes, 2).astype(np.float64),
        "s1": np.bincount(key, r, size).reshape(n_codes, 2),
        "s2": np.bincount(key, r * r, size).reshape(n_codes, 2),
        "k": np.bincount(key, success, size).reshape(n_codes, 2),
    }


def stage_path(
    cols: dict[str, np.ndarray], stage: Stage, st: Settings, until: float | None = None
) -> tuple[np.ndarray, dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Look times, per-look statistics and both rules' codes for one stage's own rows."""
    t = cols["t"]
    if until is None:  # a log without its stop time: the data ran to the look that covers its last row
        grid = stage.look_times()
        until = float(grid[min(np.searchsorted(grid, t.max()), len(grid) - 1)]) if len(t) else stage.start
    looks = stage.look_times(until)
    n_star = max(stage.planned_n, 2.0)
    plan_k = 1 / max(n_star * stage.ratio, 1) + 1 / max(n_star * (1 - stage.ratio), 1)
    sums = look_sums(t, cols["arm"], cols["reward"], cols["error"], cols["latency_ms"], looks, unit=cols.get("unit"))
    S = {k: v[0] for k, v in look_stats(sums, stage.ratio, plan_k, st).items()}
    S["plan_k"] = np.asarray(plan_k)
    return looks, S, rule_codes(S, st)


def stage_action(
    cols: dict[str, np.ndarray], stage: Stage, st: Settings, until: float, rule: str
) -> tuple[str, float] | None:
    """What the rollout does now: (decision, look time) once ``rule`` acts, else None (keep going)."""
    looks, _, C = stage_path(cols, stage, st, until)
    code, i = first_action(C[rule], looks, stage.planned_end)
    code, i = int(code), int(i)
    if code == KEEP:
        return None
    return DECISIONS[code], float(looks[i])


def analyse_stage(
    cols: dict[str, np.ndarray],
    stage: Stage,
    st: Settings,
    until: float | None = None,
    family_names: Sequence[str] = (),
) -> dict[str, Any]:
    """One stage's own data: the look path, both rules' decisions, and the final-look statistics.

    ``cols`` holds the stage's rows only (t, arm, reward, error, latency_ms, family codes, optional unit).
    ``until``: the time the stage's traffic stopped (default: the first look at or after its last row).
    """
    looks, S, C = stage_path(cols, stage, st, until)
    out: dict[str, Any] = {
        "index": stage.index,
        "ratio": stage.ratio,
        "start": stage.start,
        "planned_seconds": stage.seconds,
        "planned_end": stage.planned_end,
    }
    for rule in ("sequential", "user"):
        code, i = first_action(C[rule], looks, stage.planned_end)
        code, i = int(code), int(i)
        before_end = looks[i] < stage.planned_end - 1e-9
        out[f"{rule}_decision"] = DECISIONS[code]
        out[f"{rule}_look"] = {"index": i, "t": float(looks[i])}
        if rule == "sequential":
            out["reasons"] = explain(S, C, i, st, code, before_end)
        elif not S["enough"][i]:
            out["user_rule_reason"] = f"fewer than {st.min_per_arm} requests in an arm: no decision yet"
        else:  # the user's table at the look their rule acted on (or the last one)
            why = decide_user_rule({"delta": float(S["delta"][i]), "p_value": float(S["welch_p"][i])}, st.alpha)[1]
            out["user_rule_reason"] = f"{why} (look at {looks[i] / 3600:.2f} h)"
    arm, r = cols["arm"].astype(np.int64), cols["reward"]
    cand = arm == 1
    c, b = r[cand], r[~cand]
    success = (r >= st.threshold).astype(np.float64)
    out.update(_breakdown(_slice_moments(np.zeros(len(r), np.int64), 1, arm, r, success), 0, st))
    out["mann_whitney"] = {k: _scalar(v) for k, v in mann_whitney(c, b).items()}
    last = len(looks) - 1
    out["srm"] = {
        "p_value": _scalar(S["srm_p"][last]),
        "expected_ratio": stage.ratio,
        "observed_ratio": _scalar(S["n_c"][last] / max(S["n_c"][last] + S["n_b"][last], 1)),
        "mismatch": bool(C["srm"][last]),
    }
    lat, err = cols["latency_ms"], cols["error"]
    p95 = [float(np.percentile(x, 95)) if len(x) else float("nan") for x in (lat[~cand], lat[cand])]
    out["guardrails"] = {
        "error_rate_baseline": _scalar(S["err_b"][last]),
        "error_rate_candidate": _scalar(S["err_c"][last]),
        "error_rate_failed": bool(C["err_guard"][last]),
        "max_error_rate": st.max_error_rate,
        "latency_p95_baseline_ms": _scalar(p95[0]),
        "latency_p95_candidate_ms": _scalar(p95[1]),
        "latency_p95_ratio": _scalar(p95[1] / p95[0]) if p95[0] else None,
        "latency_failed": bool(C["lat_guard"][last]),
        "max_latency_ratio": st.max_latency_ratio,
        "errors_baseline": int(err[~cand].sum()),
        "errors_candidate": int(err[cand].sum()),
    }
    out["sequential"] = {
        "cs_lower": _scalar(S["lo"][last]),
        "cs_upper": _scalar(S["hi"][last]),
        "method": "asymptotic confidence sequence (normal mixture), Waudby-Smith et al. 2024",
        "alpha": st.alpha,
        "tuned_variance": st.cs_sd**2 * float(S["plan_k"]),
        "looks": [
            {
                "t": float(looks[k]),
                "n_baseline": int(S["n_b"][k]),
                "n_candidate": int(S["n_c"][k]),
                "delta": _scalar(S["delta"][k]),
                "cs_lower": _scalar(S["lo"][k]),
                "cs_upper": _scalar(S["hi"][k]),
                "p_value": _scalar(S["welch_p"][k]),
                "sequential": DECISIONS[int(C["sequential"][k])],
                "user": DECISIONS[int(C["user"][k])],
            }
            for k in range(len(looks))
        ],
    }
    fam = cols.get("family")
    out["per_family"] = {}
    if fam is not None and len(family_names):
        fm = _slice_moments(fam, len(family_names), arm, r, success)
        for f, name in enumerate(family_names):
            if fm["n"][f].sum():
                out["per_family"][name] = _breakdown(fm, f, st)
    return out


def stratify(items: Sequence[dict[str, Any]], alpha: float = 0.05) -> dict[str, Any]:
    """Inverse-variance combination of per-stage deltas: an overall effect that never pools time periods."""
    from scipy import stats

    ds = [(it["delta"], it["var_delta"]) for it in items if it.get("var_delta")]
    if not ds:
        return {"delta": None, "se": None, "ci": [None, None], "p_value": None, "stages": 0}
    w = np.array([1 / v for _, v in ds])
    d = float(np.dot(w, [x for x, _ in ds]) / w.sum())
    se = float(1 / np.sqrt(w.sum()))
    z = stats.norm.ppf(1 - alpha / 2)
    return {
        "delta": d,
        "se": se,
        "ci": [d - z * se, d + z * se],
        "p_value": float(2 * stats.norm.sf(abs(d) / se)),
        "stages": len(ds),
        "note": "fixed-horizon summary across stages; decisions use each stage's own CS",
    }


def rollout_decision(
    stage_results: Sequence[dict[str, Any]],
    stages: Sequence[Sequence[float]],
    rule: str = "sequential",
    complete: bool = True,
) -> dict[str, Any]:
    """The rollout's outcome from its stages' decisions under ``rule``: the first roll back / hold stops
    it; every stage promoted up to a ratio-1.0 stage means promoted; otherwise the current stage's
    decision (promote = widen to the next ratio)."""
    key = f"{rule}_decision"
    ratios = [float(s[0]) for s in stages]
    for res in stage_results:
        d = res[key]
        if d in ("roll back", "hold") or d == "keep observing":
            return {"decision": d, "stage": res["index"], "final_ratio": 0.0 if d == "roll back" else res["ratio"]}
    if not stage_results:
        return {"decision": "keep observing", "stage": None, "final_ratio": 0.0}
    last = stage_results[-1]
    nxt = ratios[last["index"] + 1] if last["index"] + 1 < len(ratios) else 1.0
    return {"decision": "promote", "stage": last["index"], "final_ratio": nxt, "promoted": nxt >= 1.0}


# -------------------------------------------------------------------------------------- whole logs
def analyse_log(
    cols: dict[str, np.ndarray],
    stages: Sequence[Stage],
    st: Settings,
    family_names: Sequence[str] = (),
    stage_until: dict[int, float] | None = None,
) -> dict[str, Any]:
    """Analyse a request log (columns t, stage, arm, reward, error, latency_ms, family[, unit]) stage by stage.

    Rows are sliced per stage with searchsorted when the log is in stage order (a chronological log
    is), so a 10M-row log costs a few linear passes.
    """
    stage_col = cols["stage"]
    if len(stage_col) > 1 and np.any(np.diff(stage_col) < 0):
        order = np.argsort(stage_col, kind="stable")
        cols = {k: v[order] for k, v in cols.items()}
        stage_col = cols["stage"]
    results = []
    for stg in stages:
        lo, hi = np.searchsorted(stage_col, [stg.index, stg.index + 1])
        if hi <= lo:
            continue
        part = {k: v[lo:hi] for k, v in cols.items()}
        results.append(analyse_stage(part, stg, st, (stage_until or {}).get(stg.index), family_names))
    overall = compare(cols["reward"][cols["arm"] == 0], cols["reward"][cols["arm"] == 1], st.threshold)
    fams = {}
    for name in family_names:
        fams[name] = stratify([r["per_family"][name] for r in results if name in r["per_family"]], st.alpha)
        fams[name].update(
            {
                k: sum((r["per_family"].get(name) or {}).get(k, 0) for r in results)
                for k in ("n_baseline", "n_candidate")
            }
        )
    return {"overall": overall, "stratified": stratify(results, st.alpha), "stages": results, "per_family": fams}
