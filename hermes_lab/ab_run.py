"""The staged A/B rollout: drive traffic through the router, score it, decide at every look, report.

Stage: validate (A/B). Reads the baseline and candidate policies (a model dir, a LoRA adapter dir, a train
output dir, a hub id, ``embedded:tiny`` or ``champion``: ``hermes_lab.arms``) and optionally a request log
to replay. Writes, by default beside ``--output``
(the round's ``runs/round-NN/ab/`` when the notebook runs it):
- ``ab_report.json``: the user's fields (delta, p_value, significant; overall and per stage), the decision
  and its reasons, per-stage and per-family statistics, SRM, guardrails, the confidence-sequence path,
  and the user's rule side by side;
- ``requests.jsonl``: every request (request_id, unit, arm, stage, status, latency_ms, reward, response,
  prompt, task_id, family, timestamp, policy): the same fields as trajectories, i.e. the next round's data;
- ``plots/*.png`` (also logged to MLflow when a run is active).

    python -m hermes_lab.ab_run --baseline DIR --candidate DIR --ratio 0.1 --duration 7200 --output ab_report.json
    hermes-lab ab-run --params params/embedded.yaml --baseline embedded:tiny --candidate runs/round-01/adapter

Traffic runs on a simulated clock: arrival times are drawn (Poisson at ``ab.request_rate``), nothing
sleeps, so the SPEC's 10%/2 h -> 30%/4 h -> 100% rollout takes as long as generating its responses. The
requests of one look window are generated per arm in one batched call. Statistics: ``hermes_lab.ab``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import math
import sys
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import numpy as np

from hermes_lab import ab
from hermes_lab import tasks as T
from hermes_lab.arms import POLICY_KINDS, ArmError, ArmSpec, load_args, resolve_arm
from hermes_lab.config import ConfigError, HermesConfig, load_config
from hermes_lab.jsonl import iter_objects, write_json_atomic

log = logging.getLogger("hermes_lab.ab")
EPOCH = datetime(2026, 1, 1, tzinfo=timezone.utc)  # the simulated clock's start (SimulatedClock's default)
LOG_NAME, REPORT_NAME = "requests.jsonl", "ab_report.json"


# -------------------------------------------------------------------------------------------- inputs
def check_ab_config(cfg: HermesConfig, ratio: float | None = None) -> list[list[float]]:
    """The stage list; the first ratio is --ratio, else whichever of ab.traffic_ratio / ab.stages[0] was
    changed from its default (both changed and different: an error). Errors name the key."""
    from hermes_lab.config import ABSection

    a, src = cfg.ab, cfg.source or "<defaults>"
    stages = [list(map(float, s)) for s in a.stages]
    if not stages or any(len(s) != 2 for s in stages):
        raise ConfigError(f"{src}: ab.stages must be a list of [ratio, seconds] pairs")
    if ratio is not None:
        stages[0][0] = float(ratio)
    elif a.traffic_ratio != stages[0][0]:
        if a.traffic_ratio != ABSection().traffic_ratio and stages[0][0] != ABSection().stages[0][0]:
            raise ConfigError(
                f"{src}: ab.traffic_ratio ({a.traffic_ratio}) and the first ratio of ab.stages "
                f"({stages[0][0]}) disagree; set one of them"
            )
        if a.traffic_ratio != ABSection().traffic_ratio:
            stages[0][0] = float(a.traffic_ratio)
    ratios = [s[0] for s in stages]
    if any(not 0 < r <= 1 for r in ratios) or any(b < a_ for a_, b in itertools.pairwise(ratios)) or ratios[0] >= 1:
        raise ConfigError(
            f"{src}: ab.stages ratios must lie in (0, 1], start below 1 (a test needs a baseline) "
            f"and never decrease (a monotone ramp keeps candidate units candidates), got {ratios}"
        )
    for key, ok in (
        ("request_rate", a.request_rate > 0),
        ("look_every", a.look_every > 0),
        ("alpha", 0 < a.alpha < 1),
        ("srm_alpha", 0 < a.srm_alpha < 1),
        ("max_extension", a.max_extension >= 0),
        ("unit", a.unit in ("request", "user")),
        ("task_split", a.task_split in ("heldout", "any", "train")),
        ("min_per_arm", a.min_per_arm >= 2),
    ):
        if not ok:
            raise ConfigError(f"{src}: ab.{key} has an invalid value: {getattr(a, key)!r}")
    return stages


class Traffic:
    """Requests in time order: (t, request_id, unit, prompt, task_id). Simulated or replayed."""

    def __init__(self, t: np.ndarray, ids: list[str], units: list[str], prompts: list[str], task_ids: list[str]):
        t = np.round(t, 3)  # ms resolution, as logged: windows and the log's re-analysis see the same times
        self.t, self.ids, self.units, self.prompts, self.task_ids = t, ids, units, prompts, task_ids

    @classmethod
    def simulate(cls, cfg: HermesConfig, horizon: float, seed: int) -> Traffic:
        a = cfg.ab
        rng = np.random.default_rng([seed, 7])
        n_guess = int(a.request_rate * horizon * 1.2 + 50)
        t = np.cumsum(rng.exponential(1 / a.request_rate, n_guess))
        while t[-1] < horizon:  # rare: Poisson ran long
            t = np.concatenate([t, t[-1] + np.cumsum(rng.exponential(1 / a.request_rate, n_guess))])
        t = t[t <= horizon]
        tasks = T.generate_tasks(len(t), split=a.task_split, seed=seed, families=cfg.execute.families or None)
        # shuffle so the families' round-robin order does not line up with look windows
        tasks = [tasks[i] for i in rng.permutation(len(tasks))]
        ids = [f"req-{seed}-{i:08d}" for i in range(len(t))]
        if a.unit == "user":  # a few heavy users, many light ones (Zipf-like), as real traffic has
            w = 1 / np.arange(1, a.num_users + 1) ** 0.8
            units = [f"user-{seed}-{k:06d}" for k in rng.choice(a.num_users, len(t), p=w / w.sum())]
        else:
            units = ids
        return cls(t, ids, units, [x.prompt for x in tasks], [x.task_id for x in tasks])

    @classmethod
    def replay(cls, path: str | Path, rate: float, seed: int) -> Traffic:
        """A request log (JSONL with prompt; optional request_id, unit, t seconds, timestamp ISO, task_id)."""
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"replay log not found: {p}")
        rows = []
        for i, r in iter_objects(p):
            if not isinstance(r.get("prompt"), str):
                raise ValueError(f"{p}:{i}: each line needs a string 'prompt'")
            rows.append((i, r))
        if not rows:
            raise ValueError(f"{p}: no requests to replay")
        if all("t" in r for _, r in rows):
            t = np.array([float(r["t"]) for _, r in rows])
        elif all("timestamp" in r for _, r in rows):
            ts = [datetime.fromisoformat(str(r["timestamp"]).replace("Z", "+00:00")) for _, r in rows]
            t = np.array([(x - ts[0]).total_seconds() for x in ts])
        else:  # no times in the log: arrivals at the configured rate
            t = np.cumsum(np.random.default_rng([seed, 7]).exponential(1 / rate, len(rows)))
        order = np.argsort(t, kind="stable")
        t, rows = t[order] - t.min(), [rows[k] for k in order]  # the replay starts with the log's first request
        ids = [str(r.get("request_id", f"replay-{i}")) for i, r in rows]
        units = [str(r.get("unit", rid)) for (_, r), rid in zip(rows, ids)]
        tasks = [T.parse_prompt(r["prompt"]) for _, r in rows]
        task_ids = [str(r.get("task_id") or (x.task_id if x else "")) for (_, r), x in zip(rows, tasks)]
        return cls(t, ids, units, [r["prompt"] for _, r in rows], task_ids)


def load_arm(spec: Any, cfg: HermesConfig, cache: dict[str, Any]) -> Any:
    """A policy object (anything with .generate) as is; a spec string (hermes_lab.arms: model, adapter or
    train output dir, hub id, embedded:tiny, champion), an ArmSpec or a (base, adapter) pair through
    hermes_lab.policy.load_policy. The same spec is loaded once (an A/A test shares one policy)."""
    if hasattr(spec, "generate"):
        return spec
    key = _name(spec)
    if key not in cache:
        from hermes_lab.policy import load_policy

        arm = resolve_arm(spec, "policy", cfg) if isinstance(spec, str) else spec  # ArmError: names nothing
        base, adapter = load_args(arm)
        cache[key] = load_policy(
            str(base),
            adapter=adapter,
            runs_dir=cfg.round.runs_dir,
            seed=cfg.model.seed,
            dtype=cfg.model.dtype,
            trust_remote_code=cfg.model.trust_remote_code,
        )
    return cache[key]


def _name(spec: Any) -> str:
    if hasattr(spec, "generate"):
        return getattr(spec, "name", type(spec).__name__)
    if isinstance(spec, ArmSpec):
        return spec.label
    if isinstance(spec, tuple):
        return f"{spec[0]}+{spec[1]}" if spec[1] else str(spec[0])
    return str(spec)


# -------------------------------------------------------------------------------------------- runner
def run_ab(
    cfg: HermesConfig,
    baseline: Any,
    candidate: Any,
    *,
    ratio: float | None = None,
    duration: float = 0,
    output: str | Path = REPORT_NAME,
    log_dir: str | Path | None = None,
    replay: str | Path | None = None,
    seed: int = 0,
    score_fn: Callable[[list[str], list[str]], list[float]] | None = None,
    plots: bool = True,
) -> dict[str, Any]:
    """Run the staged rollout and write the report, the request log and the plots; returns the report.

    ``baseline``/``candidate``: a path or id, or a policy object with ``generate``. ``duration``: cap on
    simulated seconds (0: every stage, with extensions). ``score_fn(prompts, responses)``: the reward
    (default: the round's system reward, ``rewards.score_responses``: the task verifiers).
    """
    wall0 = time.time()
    stage_list = check_ab_config(cfg, ratio)
    st = ab.Settings.from_config(cfg)
    a = cfg.ab
    plan = ab.plan_stages(stage_list, a.request_rate, a.look_every, a.max_extension)
    cache: dict[str, Any] = {}
    pols = {}
    for arm, spec, flag in ((0, baseline, "--baseline"), (1, candidate, "--candidate")):
        try:  # a spec that names nothing fails here, before any file is written
            pols[arm] = load_arm(spec, cfg, cache)
        except ArmError as e:
            raise e.with_flag(flag) from None
    full = sum(s.seconds * (1 + s.max_extension) for s in plan)
    horizon = min(duration, full) if duration and duration > 0 else full
    output = Path(output)
    log_dir = Path(log_dir) if log_dir else output.parent
    log_dir.mkdir(parents=True, exist_ok=True)
    output.parent.mkdir(parents=True, exist_ok=True)
    if score_fn is None:  # the round's system reward (reward.system: the task verifiers by default)
        from hermes_lab.rewards import score_responses

        score_fn = lambda ps, rs: score_responses(cfg, ps, rs)  # noqa: E731
    names = {0: _name(baseline), 1: _name(candidate)}
    log_path = log_dir / LOG_NAME
    if replay and Path(replay).resolve() == log_path.resolve():
        raise ValueError(f"--replay {replay} is where this run writes its request log: pass another --log-dir")
    traffic = Traffic.replay(replay, a.request_rate, seed) if replay else Traffic.simulate(cfg, horizon, seed)
    if replay:
        horizon = min(horizon, float(traffic.t[-1]))
    fam_index = {f: i for i, f in enumerate(T.FAMILIES)}
    fam_names = list(T.FAMILIES) + ["other"]
    unit_codes: dict[str, int] = {}
    cols: dict[str, list] = {k: [] for k in ("t", "stage", "arm", "reward", "error", "latency_ms", "family", "unit")}
    lat_rng = np.random.default_rng([seed, 11])
    stages_run: list[ab.Stage] = []
    stage_until: dict[int, float] = {}
    pos, start, stopped_by = 0, 0.0, None
    log.info(
        "A/B rollout: %d stages planned, %.0f simulated seconds at most, %d requests",
        len(plan),
        horizon,
        len(traffic.t),
    )
    from tqdm.auto import tqdm

    bar = tqdm(
        total=len(traffic.t),
        desc="A/B requests",
        mininterval=2,
        disable=not (sys.stderr.isatty() or "ipykernel" in sys.modules),
    )
    with log_path.open("w", encoding="utf-8") as logf:
        for stg0 in plan:
            if start >= horizon:
                break
            stg = ab.Stage(
                stg0.index, stg0.ratio, start, stg0.seconds, stg0.max_extension, stg0.look_every, stg0.planned_n
            )
            stages_run.append(stg)
            router = ab.ABRouter(names[0], names[1], stg.ratio, a.salt)
            lo_row = len(cols["t"])
            prev = start
            end = min(stg.hard_end, horizon)
            action = None
            for look in stg.look_times(end):
                hi = int(np.searchsorted(traffic.t, look, side="right"))
                idx = list(range(pos, hi))
                pos = hi
                if idx:
                    _serve(
                        idx,
                        traffic,
                        router,
                        pols,
                        names,
                        score_fn,
                        cfg,
                        seed,
                        stg,
                        lat_rng,
                        cols,
                        logf,
                        fam_index,
                        unit_codes,
                    )
                    bar.update(len(idx))
                prev = look
                part = {k: np.asarray(v[lo_row:]) for k, v in cols.items()}
                if not len(part["t"]):
                    continue
                part["unit"] = part["unit"] if a.unit == "user" else None
                action = ab.stage_action(_cols(part), stg, st, look, st.rule)
                if action:
                    break
            stage_until[stg.index] = prev
            start = prev
            if action is None or action[0] != "widen":  # a passed stage widens to the next one
                stopped_by = action[0] if action else ("duration" if prev < stg.hard_end - 1e-9 else "keep observing")
                break
    bar.close()
    arr = _cols({k: np.asarray(v) for k, v in cols.items()})
    if a.unit != "user":
        arr.pop("unit", None)
    analysis = ab.analyse_log(arr, stages_run, st, fam_names, stage_until)
    report = build_report(
        cfg,
        analysis,
        stage_list,
        st,
        names,
        seed=seed,
        duration=duration,
        horizon=horizon,
        stopped_by=stopped_by,
        log_path=log_path,
        replay=replay,
        wall=time.time() - wall0,
    )
    pngs = make_plots(arr, report, log_dir / "plots", fam_names) if plots else []
    report["plots"] = [str(p) for p in pngs]
    write_json_atomic(output, report)
    log_to_mlflow(cfg, report, output, log_path)
    log.info("A/B decision: %s (%s)", report["decision"], "; ".join(report["reasons"]))
    return report


def _serve(
    idx: list[int],
    traffic: Traffic,
    router: ab.ABRouter,
    pols: dict[int, Any],
    names: dict[int, str],
    score: Callable,
    cfg: HermesConfig,
    seed: int,
    stg: ab.Stage,
    lat_rng: np.random.Generator,
    cols: dict[str, list],
    logf: Any,
    fam_index: dict[str, int],
    unit_codes: dict[str, int],
) -> None:
    """Route one look window's requests, generate each arm's responses in one batched call, score, log."""
    units = [traffic.units[i] for i in idx]
    arms = router.assign(units)
    a = cfg.ab
    responses: dict[int, str] = {}
    for arm in (0, 1):
        sel = [i for i, x in zip(idx, arms) if x == arm]
        if not sel:
            continue
        prompts = [traffic.prompts[i] for i in sel]
        # one seed per (window, arm): reruns are identical, arms never share a sampling stream
        gen_seed = seed * 1_000_003 + sel[0] * 2 + arm
        kw = {"batch_size": cfg.execute.batch_size} if _takes_batch_size(pols[arm]) else {}
        out = pols[arm].generate(
            prompts, temperature=cfg.execute.temperature, max_new_tokens=cfg.execute.max_new_tokens, seed=gen_seed, **kw
        )
        responses.update(zip(sel, out))
    prompts = [traffic.prompts[i] for i in idx]
    resp = [responses[i] for i in idx]
    rewards = [float(x) for x in score(prompts, resp)]
    base = np.exp(lat_rng.normal(math.log(a.latency_median_ms), a.latency_sigma, len(idx)))
    debug = log.isEnabledFor(logging.DEBUG)
    lines = []
    for k, i in enumerate(idx):
        arm, r = int(arms[k]), resp[k]
        status = "ok" if r.strip() else "error"  # an empty answer is a failed request
        # rounded as logged, so that re-analysing the log reproduces every number of the report
        lat = round(float(base[k] + a.latency_ms_per_char * len(r)), 2)
        fam = T.family_of(traffic.prompts[i]) or "other"
        t = round(float(traffic.t[i]), 3)
        rec = {
            "request_id": traffic.ids[i],
            "unit": units[k],
            "arm": "candidate" if arm else "baseline",
            "stage": stg.index,
            "ratio": stg.ratio,
            "status": status,
            "latency_ms": lat,
            "reward": rewards[k],
            "response": r,
            "prompt": traffic.prompts[i],
            "task_id": traffic.task_ids[i],
            "family": fam,
            "t": t,
            "timestamp": (EPOCH + timedelta(seconds=t)).isoformat(),
            "policy": names[arm],
        }
        lines.append(json.dumps(rec))
        if debug:
            log.debug("request_id=%s arm=%s status=%s", rec["request_id"], rec["arm"], status)
        for key, val in (
            ("t", t),
            ("stage", stg.index),
            ("arm", arm),
            ("reward", rewards[k]),
            ("error", status == "error"),
            ("latency_ms", lat),
            ("family", fam_index.get(fam, len(fam_index))),
            ("unit", unit_codes.setdefault(units[k], len(unit_codes))),
        ):
            cols[key].append(val)
    logf.write("\n".join(lines) + "\n")


def _takes_batch_size(policy: Any) -> bool:
    """hermes_lab.policy.Policy takes execute.batch_size; a duck-typed policy may not."""
    import inspect

    try:
        return "batch_size" in inspect.signature(policy.generate).parameters
    except (TypeError, ValueError):
        return False


def _cols(c: dict[str, Any]) -> dict[str, Any]:
    """Typed columns for hermes_lab.ab (a list-built dict or one read back from a log)."""
    out = {
        "t": np.asarray(c["t"], np.float64),
        "stage": np.asarray(c["stage"], np.int64),
        "arm": np.asarray(c["arm"], np.int8),
        "reward": np.asarray(c["reward"], np.float64),
        "error": np.asarray(c["error"], bool),
        "latency_ms": np.asarray(c["latency_ms"], np.float64),
        "family": np.asarray(c["family"], np.int64),
    }
    if c.get("unit") is not None:
        out["unit"] = np.asarray(c["unit"], np.int64)
    return out


def read_log(path: str | Path) -> tuple[dict[str, np.ndarray], list[str]]:
    """A request log written by run_ab, as analysis columns (and the family names)."""
    import pandas as pd

    df = pd.read_json(path, lines=True)
    fams = list(T.FAMILIES) + ["other"]
    cols = _cols(
        {
            "t": df["t"],
            "stage": df["stage"],
            "arm": (df["arm"] == "candidate").astype(int),
            "reward": df["reward"],
            "error": df["status"] != "ok",
            "latency_ms": df["latency_ms"],
            "family": df["family"].map({f: i for i, f in enumerate(fams)}).fillna(len(fams) - 1),
            "unit": pd.factorize(df["unit"])[0],
        }
    )
    return cols, fams


def _clean(o: Any) -> Any:
    """Strict JSON: non-finite numbers become null (json.dumps would write NaN / Infinity)."""
    if isinstance(o, dict):
        return {k: _clean(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_clean(v) for v in o]
    if isinstance(o, (float, np.floating)):
        return float(o) if math.isfinite(o) else None
    return o.item() if isinstance(o, (np.integer, np.bool_)) else str(o) if isinstance(o, Path) else o


# -------------------------------------------------------------------------------------------- report
def build_report(
    cfg: HermesConfig,
    analysis: dict[str, Any],
    stage_list: list[list[float]],
    st: ab.Settings,
    names: dict[int, str],
    *,
    seed: int,
    duration: float,
    horizon: float,
    stopped_by: str | None,
    log_path: Path,
    replay: Any,
    wall: float,
) -> dict[str, Any]:
    """ab_report.json: the user's fields first, then our decision and everything behind it."""
    stages = analysis["stages"]
    ours = ab.rollout_decision(stages, stage_list, "sequential")
    users = ab.rollout_decision(stages, stage_list, "user")
    chosen = ours if st.rule == "sequential" else users
    overall = analysis["overall"]
    last = stages[-1] if stages else {}
    if st.rule == "sequential":
        reasons = list(last.get("reasons", ["no traffic was analysed"]))
    else:
        reasons = [last.get("user_rule_reason", "no traffic was analysed"), f"decision: {chosen['decision']}"]
    if stopped_by == "duration" and last:
        reasons.insert(
            0,
            f"--duration {duration:g} s ended the rollout in stage {last['index']} "
            f"(ratio {last['ratio']:g}); promotion waits for the stage's planned end",
        )
    # "promote" only once traffic reached 100%; a stage that passed without that only widened (issue #14)
    if chosen["decision"] == "promote":
        reasons.append("promoted to 100%")
    elif chosen["decision"] == "widen":
        reasons.append(f"widen traffic to {chosen['final_ratio']:.0%}; not promoted: the rollout stopped before 100%")
    report = {
        **{
            k: overall[k]
            for k in (
                "delta",
                "p_value",
                "significant",
                "baseline_mean",
                "candidate_mean",
                "baseline_success",
                "candidate_success",
                "n_baseline",
                "n_candidate",
            )
        },
        "decision": chosen["decision"],
        "reasons": reasons,
        "rule": st.rule,
        "final_ratio": chosen["final_ratio"],
        "promoted": bool(chosen.get("promoted", False)),
        "rolled_back": chosen["decision"] == "roll back",
        "negative": chosen["decision"] == "roll back",  # the round's data is marked negative for the next one
        "decisions": {"sequential": ours["decision"], "user": users["decision"]},
        "user_rule": {
            "rollout": users,
            "on_overall": dict(zip(("decision", "reason"), ab.decide_user_rule(overall, st.alpha))),
            "per_stage": [
                {
                    "stage": s["index"],
                    "decision": s["user_decision"],
                    "reason": s["user_rule_reason"],
                    "look": s["user_look"],
                }
                for s in stages
            ],
        },
        "sequential_rule": {
            "rollout": ours,
            "per_stage": [
                {
                    "stage": s["index"],
                    "decision": s["sequential_decision"],
                    "reasons": s["reasons"],
                    "look": s["sequential_look"],
                }
                for s in stages
            ],
        },
        "overall_note": "delta/p_value/significant pool all requests (the user's formula); stages are decided on "
        "their own data, see 'stages' and 'stratified'",
        "stratified": analysis["stratified"],
        "stages": stages,
        "per_family": analysis["per_family"],
        "srm": last.get("srm"),
        "guardrails": last.get("guardrails"),
        "sequential": last.get("sequential", {}),
        "baseline": names[0],
        "candidate": names[1],
        "seed": seed,
        "duration": duration,
        "stages_planned": stage_list,
        "simulated_seconds": horizon,
        "stopped_by": stopped_by,
        "n_requests": overall["n_baseline"] + overall["n_candidate"],
        "log": str(log_path),
        "replay": str(replay) if replay else None,
        "config": cfg.to_dict()["ab"],
        "wall_seconds": round(wall, 2),
    }
    return _clean(report)


# --------------------------------------------------------------------------------------------- plots
def plot_scores(cols: dict[str, np.ndarray], report: dict[str, Any]) -> Any:
    """Per-arm score distributions, one panel per stage (each stage's own data)."""
    import matplotlib.pyplot as plt

    stages = report["stages"] or [{"index": 0, "ratio": float("nan")}]
    fig, axes = plt.subplots(1, len(stages), figsize=(5 * len(stages), 3.4), squeeze=False)
    bins = np.linspace(0, max(5.0, float(cols["reward"].max()) if len(cols["reward"]) else 5.0), 21)
    for ax, s in zip(axes[0], stages):
        m = cols["stage"] == s["index"]
        for arm, name, color in ((0, "baseline", "tab:blue"), (1, "candidate", "tab:orange")):
            x = cols["reward"][m & (cols["arm"] == arm)]
            if len(x):
                ax.hist(
                    x,
                    bins=bins,
                    density=True,
                    alpha=0.55,
                    color=color,
                    label=f"{name} (n={len(x)}, mean {x.mean():.2f})",
                )
        ax.set_title(f"stage {s['index']}: candidate {s['ratio']:.0%}")
        ax.set_xlabel("reward")
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("density")
    fig.tight_layout()
    return fig


def plot_sequence(report: dict[str, Any]) -> Any:
    """Cumulative delta and its confidence sequence over simulated time, stage by stage."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 3.8))
    for s in report["stages"]:
        looks = s["sequential"]["looks"]
        h = np.array([x["t"] for x in looks]) / 3600
        nan = lambda v: np.nan if v is None else v  # noqa: E731  (inf bounds are stored as null)
        d = np.array([nan(x["delta"]) for x in looks], float)
        lo = np.array([nan(x["cs_lower"]) for x in looks], float)
        hi = np.array([nan(x["cs_upper"]) for x in looks], float)
        ax.plot(h, d, "o-", ms=3, label=f"stage {s['index']} ({s['ratio']:.0%}): {s['sequential_decision']}")
        ax.fill_between(h, lo, hi, alpha=0.2)
        ax.axvline(s["planned_end"] / 3600, color="grey", ls=":", lw=1)
    ax.axhline(0, color="black", lw=0.8)
    ax.set_xlabel("simulated hours (dotted: planned stage ends)")
    ax.set_ylabel("delta (candidate - baseline)")
    ax.set_title(
        f"delta and its {1 - report['config']['alpha']:.0%} confidence sequence; decision: {report['decision']}"
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_breakdown(report: dict[str, Any]) -> Any:
    """Delta per stage (own data) and per family (stratified across stages), with 95% intervals."""
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.6))
    st = [s for s in report["stages"] if s.get("var_delta")]
    a1.errorbar(
        [f"{s['index']} ({s['ratio']:.0%})" for s in st],
        [s["delta"] for s in st],
        yerr=[1.96 * math.sqrt(s["var_delta"]) for s in st],
        fmt="o",
        capsize=4,
    )
    a1.set_title("per stage (each stage's own data)")
    fam = {k: v for k, v in report["per_family"].items() if v.get("delta") is not None}
    a2.errorbar(
        list(fam),
        [v["delta"] for v in fam.values()],
        yerr=[[v["delta"] - v["ci"][0] for v in fam.values()], [v["ci"][1] - v["delta"] for v in fam.values()]],
        fmt="o",
        capsize=4,
        color="tab:green",
    )
    a2.set_title("per family (stratified by stage)")
    for ax in (a1, a2):
        ax.axhline(0, color="black", lw=0.8)
        ax.set_ylabel("delta")
    fig.tight_layout()
    return fig


def make_plots(
    cols: dict[str, np.ndarray],
    report: dict[str, Any],
    out_dir: str | Path,
    fam_names: Sequence[str] = (),
    close: bool = True,
) -> list[Path]:
    """Save the three plots as PNG (logged to MLflow when a run is active); returns their paths."""
    import matplotlib

    if "matplotlib.pyplot" not in sys.modules and "ipykernel" not in sys.modules:
        matplotlib.use("Agg")  # headless CLI; a notebook keeps its inline backend
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, fig in (
        ("ab_scores", plot_scores(cols, report)),
        ("ab_sequence", plot_sequence(report)),
        ("ab_breakdown", plot_breakdown(report)),
    ):
        p = out_dir / f"{name}.png"
        if "mlflow" in sys.modules:  # tracking imports mlflow; skip that cost when nothing is tracked
            from hermes_lab import tracking

            tracking.log_figure(fig, p)
        else:
            fig.savefig(p, dpi=110, bbox_inches="tight")
        paths.append(p)
        if close:
            plt.close(fig)
    return paths


def log_to_mlflow(cfg: HermesConfig, report: dict[str, Any], output: Path, log_path: Path) -> bool:
    """Params, metrics, the report and the request log to the active MLflow run (if there is one)."""
    if "mlflow" not in sys.modules:
        return False
    import mlflow

    from hermes_lab import tracking

    if mlflow.active_run() is None:
        return False
    params = {f"ab.{k}": v for k, v in report["config"].items()}
    params.update(
        {
            "ab.baseline": report["baseline"],
            "ab.candidate": report["candidate"],
            "ab.seed": report["seed"],
            "ab.duration": report["duration"],
            "ab.replay": report["replay"],
        }
    )
    try:
        tracking.log_params(params)
    except mlflow.exceptions.MlflowException as e:  # same key logged earlier with another value
        log.warning("MLflow params not logged: %s", e)
    m = {
        "ab_delta": report["delta"],
        "ab_p_value": report["p_value"],
        "ab_significant": float(report["significant"]),
        "ab_n_requests": report["n_requests"],
        "ab_stratified_delta": report["stratified"]["delta"],
        "ab_final_ratio": report["final_ratio"],
        "ab_promoted": float(report["promoted"]),
    }
    for s in report["stages"]:
        i = s["index"]
        m.update(
            {
                f"ab_stage{i}_delta": s["delta"],
                f"ab_stage{i}_p_value": s["p_value"],
                f"ab_stage{i}_cs_lower": s["sequential"]["cs_lower"],
                f"ab_stage{i}_cs_upper": s["sequential"]["cs_upper"],
                f"ab_stage{i}_n_candidate": s["n_candidate"],
                f"ab_stage{i}_n_baseline": s["n_baseline"],
                f"ab_stage{i}_srm_p": s["srm"]["p_value"],
            }
        )
    mlflow.log_metrics({k: float(v) for k, v in m.items() if v is not None})
    mlflow.set_tags({"ab.decision": report["decision"], "ab.user_decision": report["decisions"]["user"]})
    mlflow.log_artifact(str(output), artifact_path="ab")
    mlflow.log_artifact(str(log_path), artifact_path="ab")
    return True


# ------------------------------------------------------------------------------------ notebook helpers
def resolve_arms(cfg: HermesConfig, round_dir: str | Path, baseline: str = "", candidate: str = "") -> tuple[Any, Any]:
    """The notebook's arms. Empty baseline: validate.resolve_baseline, the policy the regression gate
    compared against (champion, else model.adapter, else the bare base). Empty candidate: this round's
    training output (<round_dir>/train/adapter on the base named in train/run.json), as validate finds it."""
    from hermes_lab.paths import project_root
    from hermes_lab.validate import candidate_from_train_dir, resolve_baseline

    root = project_root()  # notebook parameters are relative to the project, not to the kernel's cwd
    b: Any = resolve_arm(baseline, "baseline", cfg, root) if baseline else None
    c: Any = resolve_arm(candidate, "candidate", cfg, root) if candidate else None
    b = b or resolve_baseline(cfg)
    c = c or candidate_from_train_dir(Path(round_dir) / "train", cfg)
    return b, c


def notebook_run(
    cfg: HermesConfig,
    round_dir: str | Path,
    parent_run_id: str = "",
    baseline: str = "",
    candidate: str = "",
    duration: float = 0,
    seed: int = 0,
) -> dict[str, Any]:
    """What 40_ab_analysis.ipynb does: reuse round_dir/ab/ab_report.json if it exists, else run the
    rollout; plots (PNG + MLflow) in an 'ab' run nested under the round's run."""
    from hermes_lab import tracking

    out = Path(round_dir) / "ab"
    report_path = out / REPORT_NAME
    with tracking.stage_run("ab", parent_run_id or None, cfg.round.runs_dir, cfg.round.experiment):
        if report_path.is_file() and (out / LOG_NAME).is_file():
            report = json.loads(report_path.read_text(encoding="utf-8"))
            cols, fams = read_log(out / LOG_NAME)
            paths = make_plots(cols, report, out / "plots", fams)
            log_to_mlflow(cfg, report, report_path, out / LOG_NAME)
        else:
            b, c = resolve_arms(cfg, round_dir, baseline, candidate)
            report = run_ab(cfg, b, c, duration=duration, output=report_path, seed=seed)
            cols, fams = read_log(out / LOG_NAME)
            paths = [Path(p) for p in report["plots"]]
    return {"report": report, "cols": cols, "families": fams, "plots": paths, "report_path": report_path}


def stage_table(report: dict[str, Any]) -> Any:
    """One row per stage: the user's fields, the CS, SRM, guardrails, both rules' decisions."""
    import pandas as pd

    return pd.DataFrame(
        [
            {
                "stage": s["index"],
                "ratio": s["ratio"],
                "n_baseline": s["n_baseline"],
                "n_candidate": s["n_candidate"],
                "baseline_mean": s["baseline_mean"],
                "candidate_mean": s["candidate_mean"],
                "delta": s["delta"],
                "p_value": s["p_value"],
                "cs_lower": s["sequential"]["cs_lower"],
                "cs_upper": s["sequential"]["cs_upper"],
                "candidate_success": s["candidate_success"],
                "candidate_success_ci": s["candidate_success_ci"],
                "mann_whitney_p": s["mann_whitney"]["p_value"],
                "srm_p": s["srm"]["p_value"],
                "p95_ratio": s["guardrails"]["latency_p95_ratio"],
                "sequential": s["sequential_decision"],
                "user_rule": s["user_decision"],
            }
            for s in report["stages"]
        ]
    ).set_index("stage")


def family_table(report: dict[str, Any]) -> Any:
    import pandas as pd

    return pd.DataFrame(
        [
            {
                "family": f,
                "n_baseline": v.get("n_baseline"),
                "n_candidate": v.get("n_candidate"),
                "delta": v["delta"],
                "ci_low": v["ci"][0],
                "ci_high": v["ci"][1],
                "p_value": v["p_value"],
            }
            for f, v in report["per_family"].items()
        ]
    ).set_index("family")


def summary(report: dict[str, Any]) -> str:
    """The decision and why, as a few lines of text."""
    d = lambda v, f: "n/a" if v is None else format(v, f)  # noqa: E731
    lines = [
        f"decision: {report['decision']} (rule: {report['rule']}; the user's rule says: {report['decisions']['user']})",
        f"delta {d(report['delta'], '+.3f')}  p {d(report['p_value'], '.3g')}  significant {report['significant']}"
        f"  (n = {report['n_baseline']} baseline / {report['n_candidate']} candidate)",
    ]
    lines += [f"  - {r}" for r in report["reasons"]]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------- CLI
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--params",
        default=None,
        help="HermesConfig YAML (ab section: stages, request_rate, salt, alpha, "
        "srm_alpha, guardrails, rule). Default: built-in defaults",
    )
    p.add_argument("--baseline", required=True, help=f"baseline policy: {POLICY_KINDS}")
    p.add_argument("--candidate", required=True, help=f"candidate policy: {POLICY_KINDS}")
    p.add_argument(
        "--ratio", type=float, default=None, help="candidate share of the first stage (default: ab.traffic_ratio)"
    )
    p.add_argument(
        "--duration", type=float, default=0, help="cap on simulated seconds (0: all stages; 7200: the first stage only)"
    )
    p.add_argument("--output", default=REPORT_NAME, help="report path (default: ab_report.json)")
    p.add_argument(
        "--replay", default=None, help="replay this request log (JSONL with 'prompt') instead of simulated traffic"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of traffic, sampling and latency")
    p.add_argument("--log-dir", default=None, help="where requests.jsonl and plots/ go (default: beside --output)")
    p.add_argument("--parent-run-id", default="", help="MLflow run to nest under (the round's run)")
    p.add_argument("--no-mlflow", action="store_true", help="do not log to MLflow")
    p.add_argument(
        "-v", "--verbose", action="store_true", help="DEBUG logging: one line per request (request_id, arm, status)"
    )


def run_cli(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s"
    )
    from hermes_lab import quiet

    if not quiet.debug_enabled():  # hermes-lab --debug: everything
        for noisy in ("urllib3", "alembic", "matplotlib", "filelock", "httpx"):
            logging.getLogger(noisy).setLevel(logging.WARNING)
    cfg = load_config(args.params)
    kw = dict(
        ratio=args.ratio,
        duration=args.duration,
        output=args.output,
        log_dir=args.log_dir,
        replay=args.replay,
        seed=args.seed,
    )
    if args.no_mlflow:
        report = run_ab(cfg, args.baseline, args.candidate, **kw)
    else:
        from hermes_lab import tracking

        with tracking.stage_run("ab", args.parent_run_id or None, cfg.round.runs_dir, cfg.round.experiment):
            report = run_ab(cfg, args.baseline, args.candidate, **kw)
    print(summary(report))
    print(f"report: {args.output}   requests: {report['log']}")
    return 0


def main(argv: list[str] | None = None) -> int:
    from hermes_lab.cli import run_module

    return run_module(
        "hermes_lab.ab_run", add_arguments, run_cli, argv, description="Staged A/B rollout -> ab_report.json"
    )


if __name__ == "__main__":
    sys.exit(main())
