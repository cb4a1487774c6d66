"""A/B split and analysis: the user's router and compare(), and the statistics that gate a rollout.

Stage: validate (A/B). Reads and writes nothing itself; ``hermes_lab.ab.run`` drives traffic through it
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
- The randomised unit is the i.i.d. draw (``ab.unit``: request, or user: all of a user's requests share
  its md5 arm). Decisions count units: the SRM check, ``min_per_arm``, and the always-valid statistics of
  the reward and both guardrails use one observation per unit (``hermes_lab.ab.cs``).
- Looks happen every ``ab.look_every`` seconds. A p < 0.05 rule read at every look rejects far more
  than 5% of A/A tests, so the test is a *confidence sequence* for delta, valid at every look and every
  sample size for bounded rewards (a betting CS on inverse-propensity pseudo-outcomes; method, proof and
  the packages considered in ``hermes_lab.ab.cs``). It replaced an asymptotic normal-mixture CS whose A/A
  error exceeded 5% with rare successes and a small arm.
- With covariates known before assignment (``ab.covariates``: the task's family and level, the prompt, its
  earlier outcomes; ``hermes_lab.ab.covariates``) the pseudo-outcomes are regression-adjusted by an outcome
  model fitted on earlier looks only (``hermes_lab.ab.adjust``): the same guarantee, a narrower CS, so a
  few points' gain is decided within the budget. Request units only; users keep the plain CS.
- Decision at a look: failing guardrail (error rate more than ``max_error_rate`` above baseline, or p95
  latency ratio above ``max_latency_ratio``, each also shown by a one-sided always-valid bound at
  ``guardrail_alpha``) -> roll back; sample ratio mismatch on unit counts (anytime-valid p < srm_alpha)
  -> hold, the split is broken and no number can be trusted; CS entirely below 0 -> roll back
  (significant harm); CS entirely above 0 -> widen, acted on only from the stage's planned end (docs/SPEC.md's
  "10% for 2 h" is a minimum exposure); otherwise keep observing (the stage is extended by up to
  ``max_extension`` times its length). The rollout is "promote" only once traffic reaches 100%.
- Rollback needs *significant* harm: the user's "delta < 0 -> roll back" fires on ~half of all A/A
  tests at a single look (benchmarks/bench_ab_decisions.py measures both rules).

Vectorised throughout (bincount over (look, arm) keys): a 10M-request log is analysed in seconds
(benchmarks/bench_ab_analysis.py). This module holds the router, the user's analysis, the settings, the
stages and the per-look statistics; a stage's analysis and the rollout's outcome are in
``hermes_lab.ab.analysis`` (``analyse_stage``, ``stage_action``, ``rollout_decision``, ``analyse_log``).
"""

from __future__ import annotations

import hashlib
import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hermes_lab.ab import adjust as ab_adjust
from hermes_lab.ab import cs as ab_cs

# Decisions at a look / of a stage. A stage that passes *widens* traffic to the next stage; the rollout is
# "promote" (``promoted: true``) only once the last tested stage passed and traffic reaches 100%.
KEEP, WIDEN, ROLLBACK, HOLD = 0, 1, 2, 3
PROMOTE = WIDEN  # the stage-level code of a passed stage (older name)
DECISIONS = ("keep observing", "widen", "roll back", "hold")
LAT_BINS = np.linspace(0.0, np.log(1e5), 257)  # log-latency histogram edges (1 ms..100 s): ~4.5% wide bins, plenty
# for a "p95 ratio > 1.5" guardrail; the report also gives the exact p95 of the final look


# ------------------------------------------------------------------------------------------- routing
# CPython's own md5 (the same digest): hashlib's OpenSSL one looks the algorithm up at every call (OpenSSL 3's
# fetch), ~2 us of the gateway's ~150 for a request it routes; OpenSSL's where a build leaves the module out
try:
    from _md5 import md5 as _MD5
except ImportError:  # pragma: no cover - CPython builds it by default
    _MD5 = hashlib.md5


def bucket(unit_id: Any, salt: str = "") -> float:
    """docs/SPEC.md's bucket of a unit, in [0, 1]. With a salt the key is 'salt:id' (a fresh split per experiment)."""
    key = str(unit_id) if not salt else f"{salt}:{unit_id}"
    # the first 8 hex digits are the first 4 bytes, big-endian (without formatting the whole digest)
    return int.from_bytes(_MD5(key.encode("utf-8")).digest()[:4], "big") / 0xFFFFFFFF


def buckets(unit_ids: Sequence[Any], salt: str = "") -> np.ndarray:
    """``bucket`` of many units at once: the same formula (the first 4 digest bytes are the first 8 hex
    digits), without the hex round trip."""
    md5, pre = _MD5, (f"{salt}:" if salt else "")
    raw = b"".join(md5(f"{pre}{u}".encode()).digest()[:4] for u in unit_ids)
    return np.frombuffer(raw, dtype=">u4").astype(np.float64) / 0xFFFFFFFF


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
        return (buckets(unit_ids, self.salt) < self.traffic_ratio).astype(np.int8)

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
    guardrail_alpha: float = 0.01
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
            guardrail_alpha=ab.guardrail_alpha,
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
    continued: float = 0.0  # seconds a later round added after the hard end (round.on_held: continue)

    @property
    def planned_end(self) -> float:
        return self.start + self.seconds

    @property
    def hard_end(self) -> float:
        """The last look. A continued stage keeps its bets (``tune_n``) and its earlier looks: only its end moves."""
        return self.start + self.seconds * (1 + self.max_extension) + self.continued

    @property
    def tune_n(self) -> float:
        """Requests the always-valid bounds are tuned for: mid-extension, between the planned end (the first
        look that may widen) and the hard end (the last); benchmarks/bench_ab_decisions.py chose it."""
        return self.planned_n * (1 + self.max_extension / 2)

    def look_times(self, until: float | None = None) -> np.ndarray:
        """Grid looks, the planned end always among them; cut at ``until`` (which becomes the last look)."""
        grid = (
            self.start
            + np.arange(1, int(np.ceil((self.hard_end - self.start) / self.look_every)) + 1) * self.look_every
        )
        ends = [self.planned_end, self.hard_end - self.continued]  # a continued stage keeps its old last look
        grid = np.unique(np.append(np.minimum(grid, self.hard_end), ends))
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
srm_pvalue = ab_cs.srm_pvalue  # anytime-valid, on unit counts (hermes_lab.ab.cs)


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
    rankdata on millions of scores; tests/ab/test_ab.py checks both agree.
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
) -> dict[str, np.ndarray]:
    """Cumulative per-arm request sums at each look, shape (groups, looks, 2) (arm 0 baseline, 1 candidate):
    the per-request numbers the report and the user's rule show. ``win``: each row's look window.

    One bincount per quantity over the key (group, look, arm): a row belongs to the first look at or
    after its time. ``group`` lets the decision benchmark analyse thousands of simulated experiments at once.
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
    fin = np.isfinite(r)  # NaN: no reward yet (a live request awaiting feedback), in the guardrails only
    r = np.where(fin, r, 0.0)
    ll = np.log(np.maximum(latency_ms[keep], 1.0))
    out = {"n": cum(None), "s1": cum(r), "s2": cum(r * r), "nerr": cum(error[keep].astype(np.float64))}
    out["nr"] = out["n"] if fin.all() else cum(fin.astype(np.float64))
    nb = len(LAT_BINS) - 1  # uniform bins: the index is arithmetic, no search
    lb = np.minimum(((ll - LAT_BINS[0]) * (nb / (LAT_BINS[-1] - LAT_BINS[0]))).astype(np.int64), nb - 1)
    out["hist"] = np.cumsum(np.bincount(key * nb + lb, minlength=size * nb).reshape(*shape, nb), axis=1)
    out["win"], out["keep"], out["ll"] = look, keep, ll
    return out


def _p95_log(hist: np.ndarray) -> np.ndarray:
    """log p95 from cumulative latency histograms (last axis: bins), the midpoint of the bin reaching 95%."""
    cnt = hist.cumsum(-1)
    idx = np.argmax(cnt >= 0.95 * np.maximum(cnt[..., -1:], 1), axis=-1)
    return (LAT_BINS[idx] + LAT_BINS[idx + 1]) / 2


def look_path(
    cols: dict[str, np.ndarray],
    look_times: np.ndarray,
    ratio: float,
    planned_n: float,
    st: Settings,
    group: np.ndarray | None = None,
    n_groups: int = 1,
) -> dict[str, np.ndarray]:
    """Per-look statistics of one stage, arrays shaped (groups, looks): per-request means, delta, Welch p,
    error rates and p95 latencies (what the report and the user's rule show), and the unit-level always-valid
    statistics the decision uses: the CS of delta, the guardrails' one-sided bounds, SRM on unit counts.

    ``cols``: t, arm, reward, error, latency_ms and optionally unit (codes; None or absent: requests are the
    units). The rows of each group must be in time order. A NaN reward (a live request without feedback
    yet) is left out of the reward's statistics and counts in the guardrails, SRM and ``min_per_arm``.
    Covariates (the columns of ``hermes_lab.ab.adjust.COLUMNS``, request and conversation units): the reward's
    CS is the regression-adjusted one (``lo``/``hi``); ``lo_plain``/``hi_plain`` keep the unadjusted CS beside it.
    ``planned_n``: the requests the bets are tuned to be sharpest at (``Stage.tune_n``); it never affects
    validity. Guardrails, both on bounded unit observations: error indicator; latency above
    ``max_latency_ratio`` x the baseline's p95 of the earlier looks (the p95-ratio guardrail as an exceedance
    rate, so bounded and finite-sample valid).
    """
    from scipy import stats

    t, arm = cols["t"], np.asarray(cols["arm"], np.int64)
    sums = look_sums(t, arm, cols["reward"], cols["error"], cols["latency_ms"], look_times, group, n_groups)
    L, keep, win = len(look_times), sums["keep"], sums["win"][sums["keep"]]
    g = None if group is None else np.asarray(group, np.int64)[keep]
    n, nr = sums["n"].astype(np.float64), sums["nr"].astype(np.float64)
    # latency threshold per look window from the baseline's latencies before it (predictable); none at first
    tau = np.log(st.max_latency_ratio) + _p95_log(sums["hist"][:, :, 0])
    tau = np.concatenate([np.full((n_groups, 1), np.inf), tau[:, :-1]], axis=1)
    tau = np.where(np.concatenate([np.zeros((n_groups, 1)), n[:, :-1, 0]], axis=1) > 0, tau, np.inf)
    exceed = sums["ll"] > tau[0 if g is None else g, win]
    X = np.stack(
        [
            np.clip(cols["reward"][keep] / st.scale, 0.0, 1.0),
            cols["error"][keep].astype(np.float64),
            exceed.astype(np.float64),
        ]
    )
    unit = cols.get("unit")
    unit = None if unit is None else np.asarray(unit)[keep]
    us = ab_cs.unit_window_sums(win, arm[keep], X, L, unit, g, n_groups)
    un = us["n"]
    # planned units: planned requests x the units per request of the units entered before the window (1 for
    # request units); only entered units' data, so that the bets stay independent of the units to come
    rows_before = np.concatenate([np.zeros((n_groups, 1)), np.cumsum(us["rows"], 1)[:, :-1]], axis=1)
    units_before = np.concatenate([np.zeros((n_groups, 1)), np.cumsum(un.sum(-1), 1)[:, :-1]], axis=1)
    n_star = max(planned_n, 2.0) * np.where(rows_before > 0, units_before / np.maximum(rows_before, 1), 1.0)
    # distinct units so far per arm, by first appearance (SRM and min_per_arm count every unit seen)
    if unit is None:
        cu = np.cumsum(un, axis=1)
    else:
        key = (0 if g is None else g) * (int(unit.max()) + 1 if unit.size else 1) + unit
        _, first = np.unique(key, return_index=True)
        fk = ((0 if g is None else g[first]) * L + win[first]) * 2 + arm[keep][first]
        cu = np.cumsum(np.bincount(fk, minlength=n_groups * L * 2).reshape(n_groups, L, 2), axis=1).astype(float)
    un_r = us["nk"][0] if "nk" in us else un  # units with a reward
    lo, hi = ab_cs.fan_cs(un_r, us["S"][0], us["Q"][0], ratio, n_star, st.alpha / 2, st.alpha / 2)
    lo_plain, hi_plain, var_ratio = lo, hi, np.full(n_groups, np.nan)
    if _one_reward_per_unit(unit, g, X[0]) and ab_adjust.has_covariates(cols):  # the adjusted CS decides
        cov = {k: None if cols.get(k) is None else np.asarray(cols[k])[keep] for k in ab_adjust.COLUMNS}
        adj = ab_adjust.adjusted_cs(
            win, arm[keep], X[0], cov, ratio, n_star, st.alpha / 2, st.alpha / 2, g, n_groups, L
        )
        lo, hi = adj["lo"], adj["hi"]
        with np.errstate(divide="ignore", invalid="ignore"):
            var_ratio = adj["var"] / adj["var_plain"]
    err_lo, _ = ab_cs.fan_cs(un, us["S"][1], us["Q"][1], ratio, n_star, st.guardrail_alpha, None)
    lat_lo, _ = ab_cs.fan_cs(un, us["S"][2], us["Q"][2], ratio, n_star, st.guardrail_alpha, None)
    with np.errstate(divide="ignore", invalid="ignore"):
        mean = sums["s1"] / nr
        var = np.maximum(sums["s2"] - nr * mean**2, 0) / (nr - 1)  # sample variance, ddof=1 like scipy
        welch = stats.ttest_ind_from_stats(
            mean[..., 1], np.sqrt(var[..., 1]), nr[..., 1], mean[..., 0], np.sqrt(var[..., 0]), nr[..., 0], False
        ).pvalue
        err = sums["nerr"] / n
    p95 = np.exp(_p95_log(sums["hist"]))
    enough = (cu[..., 1] >= st.min_per_arm) & (cu[..., 0] >= st.min_per_arm)
    return {
        "n_b": nr[..., 0],  # requests behind the reward's numbers
        "n_c": nr[..., 1],
        "req_b": n[..., 0],  # every request (error rates)
        "req_c": n[..., 1],
        "units_b": cu[..., 0],
        "units_c": cu[..., 1],
        "mean_b": mean[..., 0],
        "mean_c": mean[..., 1],
        "delta": mean[..., 1] - mean[..., 0],
        "lo": np.where(enough, lo * st.scale, -np.inf),
        "hi": np.where(enough, hi * st.scale, np.inf),
        "lo_plain": np.where(enough, lo_plain * st.scale, -np.inf),  # the unadjusted CS (the same when no
        "hi_plain": np.where(enough, hi_plain * st.scale, np.inf),  # covariates): what adjustment narrowed
        "var_ratio": var_ratio,  # per group: Var(adjusted pseudo-outcome) / Var(plain); NaN: not adjusted
        "welch_p": np.where(np.isfinite(welch), welch, 1.0),
        "err_b": err[..., 0],
        "err_c": err[..., 1],
        "err_lo": err_lo,
        "p95_b": p95[..., 0],
        "p95_c": p95[..., 1],
        "lat_lo": lat_lo,
        "srm_p": ab_cs.srm_pvalue(cu[..., 1], cu[..., 0], ratio),
        "enough": enough,
        "planned_units": n_star[:, -1],
    }


def _one_reward_per_unit(unit: np.ndarray | None, g: np.ndarray | None, y: np.ndarray) -> bool:
    """Request units, or units with at most one reward row each (a conversation's reward is on its first turn,
    the row it enters with): the adjusted CS, written for one row per unit, then holds for the units as they
    are. A user's many rewarded rows are not independent: those keep the plain, unit-level CS."""
    if unit is None or not unit.size:
        return True
    ok = np.isfinite(y)
    k = unit[ok] + (0 if g is None else g[ok] * (int(unit.max()) + 1))
    return bool(np.unique(k).size == k.size)


def rule_codes(S: dict[str, np.ndarray], st: Settings) -> dict[str, np.ndarray]:
    """Both rules at every look, as decision codes, plus the condition flags that explain them."""
    enough = S["enough"]
    err_guard = enough & (S["err_c"] - S["err_b"] > st.max_error_rate) & (S["err_lo"] > 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        lat_guard = enough & (S["p95_c"] / S["p95_b"] > st.max_latency_ratio) & (S["lat_lo"] > 0)
    srm = S["srm_p"] < st.srm_alpha
    harm, benefit = enough & (S["hi"] < 0), enough & (S["lo"] > 0)
    guard = err_guard | lat_guard
    seq = np.where(guard, ROLLBACK, np.where(srm, HOLD, np.where(harm, ROLLBACK, np.where(benefit, WIDEN, KEEP))))
    d = S["delta"]
    # the user's rule, gated by the same minimum sample (a rule read at n = 3 is not worth simulating)
    user = np.where(enough & (d < 0), ROLLBACK, np.where(enough & (d > 0) & (S["welch_p"] < st.alpha), WIDEN, KEEP))
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
    """Rollout semantics over looks (last axis): roll back / hold act at once, widen from the planned
    stage end on. Returns (decision code, look index it was taken at); no action -> keep observing at the
    last look."""
    acts = (codes == ROLLBACK) | (codes == HOLD) | ((codes == WIDEN) & (look_times >= planned_end - 1e-9))
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
        r.append(f"fewer than {st.min_per_arm} units in an arm: no statistical decision yet")
    if C["err_guard"][i]:
        r.append(
            f"guardrail: candidate error rate {g('err_c'):.1%} vs baseline {g('err_b'):.1%} "
            f"(> +{st.max_error_rate:.1%}; its {1 - st.guardrail_alpha:.0%} lower bound {g('err_lo'):+.1%} > 0)"
        )
    if C["lat_guard"][i]:
        r.append(
            f"guardrail: p95 latency ratio {g('p95_c') / g('p95_b'):.2f} > {st.max_latency_ratio}; the candidate "
            f"exceeds {st.max_latency_ratio} x the baseline's p95 more often ({1 - st.guardrail_alpha:.0%} lower "
            f"bound of the difference {g('lat_lo'):+.1%} > 0)"
        )
    if C["srm"][i]:
        r.append(
            f"sample ratio mismatch: {g('units_c'):.0f} candidate vs {g('units_b'):.0f} baseline units, "
            f"anytime-valid p = {g('srm_p'):.2g} < {st.srm_alpha}; the split is broken, "
            "check the router before trusting any number"
        )
    cs = f"{1 - st.alpha:.0%} confidence sequence for delta [{g('lo'):+.3f}, {g('hi'):+.3f}]"
    if C["harm"][i]:
        r.append(f"significant harm: {cs} lies entirely below 0")
    elif C["benefit"][i]:
        r.append(
            f"significant improvement: {cs} lies entirely above 0"
            + (" (widening waits for the stage's planned end)" if before_end else "")
        )
    elif np.isfinite(g("lo")):
        r.append(f"inconclusive: {cs} contains 0")
    r.append(f"decision: {DECISIONS[code]}")
    return r
