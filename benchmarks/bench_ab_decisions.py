"""Benchmark: decision quality of the staged rollout, the user's rule vs ours, in one simulation.

Stage: validate (A/B). Reads and writes nothing under runs/. Simulates thousands of complete rollouts of
the default plan (10% for 2 h -> 30% for 4 h -> 100%, 0.25 requests/s, a look every 15 min, an inconclusive
stage extended once) with the score distribution of the embedded tasks (a pass scores 5, a miss gets
partial credit below 3, 3% empty answers score 0 and count as errors), and runs both rules through the
same looks and the same rollout semantics (``hermes_lab.ab.first_action``):
- user: "delta > 0 and p < 0.05 -> widen; delta > 0 -> keep observing; delta < 0 -> roll back", read at
  every look (after 30 requests per arm, as ours) - what an automated canary that checks every 15 min does;
- user, stage end only: the same table read once per stage (at the planned end);
- ours: the confidence sequence, SRM and guardrails (``ab.rule: sequential``).

Reported per scenario: A/A (no difference) -> false widening (promoted past stage 1), false rollback, hold;
a stated improvement -> power (promoted to 100%); the same harm -> rollback rate. Goal: ours <= 5% false
promotion and <= 5% false rollback under all stage looks. Finishes in well under 2 minutes on 2 cores.

    .venv/bin/python benchmarks/bench_ab_decisions.py [--reps 2000]
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from hermes_lab import ab

P_BASE, LIFT = 0.45, 0.12  # baseline pass rate; the stated effect: +12 points of pass rate
RATE, LOOK, EXT, MISS_ERR = 0.25, 900.0, 1.0, 0.03
PLAN = [[0.1, 7200], [0.3, 14400], [1.0, 0]]


def simulate_stage(
    reps: int, stage: ab.Stage, p_c: float, st: ab.Settings, rng: np.random.Generator
) -> dict[str, np.ndarray]:
    """Decision codes of ``reps`` independent runs of one stage, for each rule: {rule: (code, look_time)}."""
    n = int(RATE * stage.seconds * (1 + EXT))
    looks = stage.look_times()
    t = np.tile(np.sort(rng.uniform(stage.start, stage.hard_end, n)), reps)
    g = np.repeat(np.arange(reps, dtype=np.int64), n)
    arm = (rng.random(reps * n) < stage.ratio).astype(np.int8)
    passed = rng.random(reps * n) < np.where(arm == 1, p_c, P_BASE)
    reward = np.where(passed, 5.0, np.round(2.5 * rng.beta(2, 2, reps * n), 4))
    error = ~passed & (rng.random(reps * n) < MISS_ERR / (1 - P_BASE))
    reward[error] = 0.0
    lat = np.exp(rng.normal(np.log(120), 0.35, reps * n)) + 4.0 * np.where(error, 0, 5)
    k = 1 / (stage.planned_n * stage.ratio) + 1 / (stage.planned_n * (1 - stage.ratio))
    S = ab.look_stats(ab.look_sums(t, arm, reward, error, lat, looks, g, reps), stage.ratio, k, st)
    C = ab.rule_codes(S, st)
    out = {}
    for rule in ("sequential", "user"):
        code, idx = ab.first_action(C[rule], looks, stage.planned_end)
        out[rule] = (code, looks[idx])
    end = int(np.searchsorted(looks, stage.planned_end))  # the user's table read once, at the planned end
    out["user_end"] = (C["user"][:, end], np.full(reps, stage.planned_end))
    out["delta"] = float(np.nanmean(S["delta"][:, -1]))
    return out


def rollout(reps: int, p_c: float, st: ab.Settings, rng: np.random.Generator) -> dict[str, dict[str, float]]:
    """Chain the stages: stage 2 only where stage 1 promoted; promoted past the last tested stage = 100%."""
    stages = ab.plan_stages(PLAN, RATE, LOOK, EXT)
    sims = [simulate_stage(reps, s, p_c, st, rng) for s in stages]
    res = {}
    for rule in ("user", "user_end", "sequential"):
        alive = np.ones(reps, bool)
        final = np.full(reps, ab.KEEP)
        widened = np.zeros(reps, bool)
        for i, sim in enumerate(sims):
            code = sim[rule][0]
            stop = alive & (code != ab.PROMOTE)
            final[stop] = code[stop]
            if i == 0:
                widened = alive & (code == ab.PROMOTE)
            alive &= code == ab.PROMOTE
        final[alive] = ab.PROMOTE
        res[rule] = {
            "widen": widened.mean(),
            "promoted": alive.mean(),
            "rollback": (final == ab.ROLLBACK).mean(),
            "hold": (final == ab.HOLD).mean(),
            "keep": (final == ab.KEEP).mean(),
        }
    res["delta"] = sims[0]["delta"]
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=2000, help="simulated rollouts per scenario")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    st = ab.Settings()
    rng = np.random.default_rng(args.seed)
    scen = {
        "A/A": rollout(args.reps, P_BASE, st, rng),
        "better": rollout(args.reps, P_BASE + LIFT, st, rng),
        "worse": rollout(args.reps, P_BASE - LIFT, st, rng),
    }
    names = {"user": "user rule, every look", "user_end": "user rule, stage end", "sequential": "ours (sequential)"}
    print(
        f"{args.reps} rollouts per scenario; plan {PLAN[:2]} then 100%, {RATE} req/s, a look every {LOOK:.0f} s, "
        f"extension x{EXT:g}; stated effect: pass rate {P_BASE:.0%} -> {P_BASE + LIFT:.0%} "
        f"(delta ~ {scen['better']['delta']:+.2f} reward; harm: {scen['worse']['delta']:+.2f})"
    )
    head = (
        f"{'rule':24s} {'A/A false widen':>15s} {'A/A false 100%':>14s} {'A/A false rollbk':>16s} {'A/A hold':>8s}"
        f" {'power (100%)':>12s} {'harm rolled back':>16s}"
    )
    print(head)
    print("-" * len(head))
    for rule, label in names.items():
        aa, up, down = scen["A/A"][rule], scen["better"][rule], scen["worse"][rule]
        print(
            f"{label:24s} {aa['widen']:15.1%} {aa['promoted']:14.1%} {aa['rollback']:16.1%} {aa['hold']:8.1%}"
            f" {up['promoted']:12.1%} {down['rollback']:16.1%}"
        )
    ours = scen["A/A"]["sequential"]
    se = np.sqrt(0.05 * 0.95 / args.reps)
    ok = ours["widen"] <= 0.05 and ours["rollback"] <= 0.05
    print(
        f"goal (ours): false promotion <= 5% and false rollback <= 5% under all looks "
        f"(Monte Carlo s.e. ~{se:.1%}): {'PASS' if ok else 'FAIL'}"
    )
    print(f"time: {time.perf_counter() - t0:.1f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
