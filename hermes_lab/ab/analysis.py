"""A/B stage analysis: one stage's decision path and statistics, the rollout's outcome, whole request logs.

Stage: validate (A/B). Builds on ``hermes_lab.ab.stats`` (router, the user's compare and rule, settings,
stages, and the per-look statistics). Reads and writes nothing; ``hermes_lab.ab.run`` (simulated traffic)
and the live gateway (``hermes_lab.live.experiment``) call it look by look, ``hermes_lab.ab.report`` turns
its output into ab_report.json.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from hermes_lab.ab.stats import (
    DECISIONS,
    KEEP,
    Settings,
    Stage,
    compare,
    decide_user_rule,
    explain,
    first_action,
    look_path,
    mann_whitney,
    rule_codes,
    wilson,
)


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
        "var_delta": _var_delta(m, i, vb, vc, n_b, n_c),
    }


def _var_delta(m: dict[str, np.ndarray], i: int, vb: float, vc: float, n_b: int, n_c: int) -> float | None:
    """Variance of delta: per-request, or cluster-robust when the moments carry unit-level ``vm``."""
    if n_b < 2 or n_c < 2:
        return None
    if "vm" in m:
        return _scalar(m["vm"][i].sum())
    return _scalar(vc / n_c + vb / n_b)


def _slice_moments(
    code: np.ndarray, n_codes: int, arm: np.ndarray, r: np.ndarray, success: np.ndarray, unit: np.ndarray | None = None
) -> dict[str, np.ndarray]:
    """n, sum, sum of squares and successes per (slice code, arm): shape (n_codes, 2). With ``unit`` codes
    also ``vm``, the cluster-robust variance of each mean (units are the i.i.d. draws; G/(G-1) corrected)."""
    key = code.astype(np.int64) * 2 + arm
    size = n_codes * 2
    out = {
        "n": np.bincount(key, minlength=size).reshape(n_codes, 2).astype(np.float64),
        "s1": np.bincount(key, r, size).reshape(n_codes, 2),
        "s2": np.bincount(key, r * r, size).reshape(n_codes, 2),
        "k": np.bincount(key, success, size).reshape(n_codes, 2),
    }
    if unit is not None and len(r):
        u = np.asarray(unit, np.int64)
        nu = int(u.max()) + 1
        cells, inv = np.unique(key * nu + u, return_inverse=True)
        slot = cells // nu
        S_u, N_u = np.bincount(inv, r, len(cells)), np.bincount(inv, minlength=len(cells))
        n = out["n"].reshape(-1)
        with np.errstate(divide="ignore", invalid="ignore"):
            m = out["s1"].reshape(-1) / n
            G = np.bincount(slot, minlength=size)
            ss = np.bincount(slot, (S_u - m[slot] * N_u) ** 2, size)
            out["vm"] = (ss / n**2 * G / (G - 1)).reshape(n_codes, 2)
    return out


def stage_path(
    cols: dict[str, np.ndarray], stage: Stage, st: Settings, until: float | None = None
) -> tuple[np.ndarray, dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Look times, per-look statistics and both rules' codes for one stage's own rows (in time order)."""
    t = cols["t"]
    if until is None:  # a log without its stop time: the data ran to the look that covers its last row
        grid = stage.look_times()
        until = float(grid[min(np.searchsorted(grid, t.max()), len(grid) - 1)]) if len(t) else stage.start
    looks = stage.look_times(until)
    S = {k: v[0] for k, v in look_path(cols, looks, stage.ratio, stage.tune_n, st).items()}
    return looks, S, rule_codes(S, st)


def stage_action(
    cols: dict[str, np.ndarray], stage: Stage, st: Settings, until: float, rule: str
) -> tuple[str, float] | None:
    """What the rollout does now: (decision, look time) once ``rule`` acts, else None (keep going).

    The per-look entry point of a live rollout: ``cols`` holds the stage's rows so far (t, arm, reward,
    error, latency_ms[, unit codes]), ``until`` the current time; one call costs O(rows)."""
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
            out["user_rule_reason"] = f"fewer than {st.min_per_arm} units in an arm: no decision yet"
        else:  # the user's table at the look their rule acted on (or the last one)
            why = decide_user_rule({"delta": float(S["delta"][i]), "p_value": float(S["welch_p"][i])}, st.alpha)[1]
            out["user_rule_reason"] = f"{why} (look at {looks[i] / 3600:.2f} h)"
    arm, r = cols["arm"].astype(np.int64), cols["reward"]
    cand = arm == 1
    unit, fam = cols.get("unit"), cols.get("family")
    rw = np.isfinite(r)  # the reward's numbers: rows with a reward (all of them, but live before feedback)
    if not rw.all():
        ra, r = arm[rw], r[rw]
        unit, fam = (None if unit is None else unit[rw]), (None if fam is None else fam[rw])
    else:
        ra = arm
    c, b = r[ra == 1], r[ra == 0]
    success = (r >= st.threshold).astype(np.float64)
    out.update(_breakdown(_slice_moments(np.zeros(len(r), np.int64), 1, ra, r, success, unit), 0, st))
    out["mann_whitney"] = {k: _scalar(v) for k, v in mann_whitney(c, b).items()}
    last = len(looks) - 1
    out["srm"] = {
        "p_value": _scalar(S["srm_p"][last]),
        "expected_ratio": stage.ratio,
        "observed_ratio": _scalar(S["units_c"][last] / max(S["units_c"][last] + S["units_b"][last], 1)),
        "units_baseline": int(S["units_b"][last]),
        "units_candidate": int(S["units_c"][last]),
        "mismatch": bool(C["srm"][last]),
        "method": "anytime-valid Beta-binomial mixture test on unit counts (Lindon & Malek 2022)",
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
    adjusted = bool(np.isfinite(S["var_ratio"]))
    out["sequential"] = {
        "cs_lower": _scalar(S["lo"][last]),
        "cs_upper": _scalar(S["hi"][last]),
        "method": "finite-sample betting confidence sequence (Fan's inequality on AIPW pseudo-outcomes of "
        "unit observations), valid at every look; see hermes_lab.ab.cs"
        + (", regression-adjusted by covariates fixed before assignment (hermes_lab.ab.adjust)" if adjusted else ""),
        "adjusted": adjusted,
        **_adjustment(S, last),
        "alpha": st.alpha,
        "units_baseline": int(S["units_b"][last]),
        "units_candidate": int(S["units_c"][last]),
        "planned_units": _scalar(S["planned_units"]),
        "looks": [
            {
                "t": float(looks[k]),
                "n_baseline": int(S["n_b"][k]),
                "n_candidate": int(S["n_c"][k]),
                "requests_baseline": int(S["req_b"][k]),
                "requests_candidate": int(S["req_c"][k]),
                "units_baseline": int(S["units_b"][k]),
                "units_candidate": int(S["units_c"][k]),
                "delta": _scalar(S["delta"][k]),
                "cs_lower": _scalar(S["lo"][k]),
                "cs_upper": _scalar(S["hi"][k]),
                "cs_lower_plain": _scalar(S["lo_plain"][k]),
                "cs_upper_plain": _scalar(S["hi_plain"][k]),
                "p_value": _scalar(S["welch_p"][k]),
                "sequential": DECISIONS[int(C["sequential"][k])],
                "user": DECISIONS[int(C["user"][k])],
            }
            for k in range(len(looks))
        ],
    }
    out["per_family"] = {}
    if fam is not None and len(family_names):
        fm = _slice_moments(fam, len(family_names), ra, r, success, unit)
        for f, name in enumerate(family_names):
            if fm["n"][f].sum():
                out["per_family"][name] = _breakdown(fm, f, st)
    return out


def _adjustment(S: dict[str, np.ndarray], i: int) -> dict[str, Any]:
    """What the regression adjustment bought at look ``i``: the plain CS beside the adjusted one, their widths'
    ratio, and the pseudo-outcomes' variance ratio (adjusted / plain; 1 - it is the variance reduction)."""
    lo, hi, lp, hp = (float(S[k][i]) for k in ("lo", "hi", "lo_plain", "hi_plain"))
    vr = _scalar(S["var_ratio"])
    width = (hi - lo) / (hp - lp) if all(map(math.isfinite, (lo, hi, lp, hp))) and hp > lp else None
    return {
        "cs_lower_plain": _scalar(lp),
        "cs_upper_plain": _scalar(hp),
        "width_ratio": _scalar(width) if width is not None else None,
        "variance_ratio": vr,
        "variance_reduction": None if vr is None else 1 - vr,
    }


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
    """The rollout's outcome from its stages' decisions under ``rule``: the first stage that did not widen
    (roll back, hold, keep observing) ends it; "promote" (``promoted: true``) only when the last tested
    stage widened to a ratio of 1.0; a rollout that stopped after a widening below 1.0 (e.g. ``--duration``
    ended it) is "widen", with the ratio it reached in ``final_ratio``."""
    key = f"{rule}_decision"
    ratios = [float(s[0]) for s in stages]
    for res in stage_results:
        d = res[key]
        if d != "widen":
            final = 0.0 if d == "roll back" else res["ratio"]
            return {"decision": d, "stage": res["index"], "final_ratio": final, "promoted": False}
    if not stage_results:
        return {"decision": "keep observing", "stage": None, "final_ratio": 0.0, "promoted": False}
    last = stage_results[-1]
    nxt = ratios[last["index"] + 1] if last["index"] + 1 < len(ratios) else 1.0
    promoted = nxt >= 1.0
    return {
        "decision": "promote" if promoted else "widen",
        "stage": last["index"],
        "final_ratio": nxt,
        "promoted": promoted,
    }


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
    r, arm = cols["reward"], cols["arm"]
    rw = np.isfinite(r)  # the user's pooled formula on the requests with a reward
    overall = compare(r[rw & (arm == 0)], r[rw & (arm == 1)], st.threshold)
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
