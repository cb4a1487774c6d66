"""Benchmark: analysing a 10,000,000-request A/B log (goal: <= 10 s on 2 cores).

Stage: validate (A/B). Reads and writes nothing under runs/: the log is synthesised in memory as columns
(what ``hermes_lab.ab.run.read_log`` returns), two stages (10% for 2 h, 30% for 4 h), five families,
3% errors, lognormal latencies. Times ``hermes_lab.ab.analysis.analyse_log`` (per-stage user fields, Wilson CIs,
Mann-Whitney, SRM, guardrails, the confidence-sequence path over every look, both rules, per-family
breakdown) against a plain pandas groupby doing only the aggregates (per stage x arm, per stage x family x
arm, per look cumulative, p95 latency), measured in the same run.

    .venv/bin/python benchmarks/bench_ab_analysis.py [--rows 10000000]
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from hermes_lab.ab import analysis as ab_analysis
from hermes_lab.ab import stats as ab
from hermes_lab.tasks import suite as T

GOAL_S = 10.0


def synth(rows: int, seed: int = 0) -> tuple[dict[str, np.ndarray], list[ab.Stage]]:
    rng = np.random.default_rng(seed)
    stages = ab.plan_stages([[0.1, 7200], [0.3, 14400], [1.0, 0]], rows / 21600, 900, 0.0)
    t = np.sort(rng.uniform(0, 21600, rows))
    stage = (t > 7200).astype(np.int64)
    arm = (rng.random(rows) < np.where(stage == 0, 0.1, 0.3)).astype(np.int8)
    succ = rng.random(rows) < np.where(arm == 1, 0.47, 0.45)
    reward = np.where(succ, 5.0, np.round(2.5 * rng.random(rows), 4))
    error = rng.random(rows) < 0.03
    reward[error] = 0.0
    lat = np.exp(rng.normal(np.log(120), 0.35, rows))
    fam = rng.integers(0, len(T.FAMILIES), rows)
    return {
        "t": t,
        "stage": stage,
        "arm": arm,
        "reward": reward,
        "error": error,
        "latency_ms": lat,
        "family": fam,
    }, stages


def pandas_baseline(cols: dict[str, np.ndarray], stages: list[ab.Stage]) -> float:
    import pandas as pd

    t0 = time.perf_counter()
    df = pd.DataFrame(cols)
    df["look"] = (df["t"] // 900).astype(np.int64)
    df.groupby(["stage", "arm"]).agg(
        n=("reward", "size"),
        mean=("reward", "mean"),
        var=("reward", "var"),
        err=("error", "mean"),
        p95=("latency_ms", lambda x: x.quantile(0.95)),
    )
    df.groupby(["stage", "family", "arm"])["reward"].agg(["size", "mean", "var"])
    per_look = df.groupby(["stage", "look", "arm"])["reward"].agg(["size", "sum"])
    per_look.groupby(level=["stage", "arm"]).cumsum()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=10_000_000)
    args = p.parse_args(argv)
    cols, stages = synth(args.rows)
    fams = list(T.FAMILIES)
    st = ab.Settings()
    ab_analysis.analyse_log(
        {k: v[:1000] for k, v in cols.items()}, stages, st, fams
    )  # imports (scipy, statsmodels) off the clock
    t0 = time.perf_counter()
    res = ab_analysis.analyse_log(cols, stages, st, fams)
    ours = time.perf_counter() - t0
    base = pandas_baseline(cols, stages)
    looks = sum(len(s["sequential"]["looks"]) for s in res["stages"])
    print(f"rows: {args.rows:,}  stages: {len(res['stages'])}  looks: {looks}")
    print(f"hermes_lab.ab.analysis.analyse_log (full analysis): {ours:6.2f} s")
    print(f"pandas groupby (aggregates only):          {base:6.2f} s")
    print(f"ratio ours / pandas: {ours / base:.2f}")
    for s in res["stages"]:
        print(
            f"  stage {s['index']}: delta {s['delta']:+.4f}  CS [{s['sequential']['cs_lower']:+.4f}, "
            f"{s['sequential']['cs_upper']:+.4f}]  -> {s['sequential_decision']} (user rule: {s['user_decision']})"
        )
    ok = ours <= GOAL_S * args.rows / 10_000_000
    print(f"goal <= {GOAL_S:g} s per 10M rows: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
