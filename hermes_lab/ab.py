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
from typing import Any

import numpy as np

from hermes_lab.ab_stats import (  # noqa: F401 (the statistics stay importable from here)
    DECISIONS,
    HOLD,
    KEEP,
    LAT_BINS,
    PROMOTE,
    ROLLBACK,
    _mixture_x,
    cs_halfwidth,
    explain,
    first_action,
    look_stats,
    look_sums,
    mann_whitney,
    rule_codes,
    srm_pvalue,
    wilson,
)


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
