"""The staged A/B rollout: drive traffic through the router, score it, decide at every look.

Stage: validate (A/B). Reads the baseline and candidate policies (a model dir, a LoRA adapter dir, a train
output dir, a hub id, ``embedded:tiny`` or ``champion``: ``hermes_lab.policy.arms``) and optionally a request log
to replay. Writes, by default beside ``--output``
(the round's ``runs/round-NN/ab/`` when the notebook runs it):
- ``ab_report.json``: the user's fields (delta, p_value, significant; overall and per stage), the decision
  and its reasons, per-stage and per-family statistics, SRM, guardrails, the confidence-sequence path,
  and the user's rule side by side;
- ``requests.jsonl``: every request (request_id, unit, arm, stage, status, latency_ms, reward, response,
  prompt, task_id, family, timestamp, policy): the same fields as trajectories, i.e. the next round's data;
- ``plots/*.png`` (also logged to MLflow when a run is active);
- ``verdict.json``: the ab_decision gate and the candidate's outcome, for the round runner.
The report, plots, MLflow record and verdict are built by ``hermes_lab.ab.report``.

    python -m hermes_lab.ab_run --baseline DIR --candidate DIR --ratio 0.1 --duration 7200 --output ab_report.json
    hermes-lab ab-run --params params/embedded.yaml --baseline embedded:tiny --candidate runs/round-01/adapter

Traffic runs on a simulated clock: arrival times are drawn (Poisson at ``ab.request_rate``, or with
``ab.plan_power`` at the rate ``hermes_lab.ab.plan`` plans for the gain to detect; report key "plan"), nothing
sleeps, so docs/SPEC.md's 10%/2 h -> 30%/4 h -> 100% rollout takes as long as generating its responses. The
requests of one look window are generated per arm in one batched call (the traffic and the request log:
``hermes_lab.ab.traffic``). Statistics: ``hermes_lab.ab.stats``; with ``ab.covariates`` every request carries
its covariates (``hermes_lab.ab.covariates``, with ``--history`` logs as their prior) and the sequential rule
is regression-adjusted (``hermes_lab.ab.adjust``). ``--continue-from`` carries an earlier run's undecided
experiment on (``hermes_lab.ab.held``; ``round.on_held: continue`` in a round).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import logging
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import numpy as np

from hermes_lab.ab import analysis as ab_analysis
from hermes_lab.ab import covariates as ab_cov
from hermes_lab.ab import rollout as ab_rollout
from hermes_lab.ab import stats as ab
from hermes_lab.ab.held import load_held
from hermes_lab.ab.report import (
    REPORT_NAME,
    RunFacts,
    build_report,
    log_to_mlflow,
    make_plots,
    summary,
    write_ab_verdict,
)
from hermes_lab.ab.traffic import FAM_INDEX, FAM_NAMES, LOG_NAME, RequestLog, Traffic, plays_agent, read_log
from hermes_lab.config.schema import HermesConfig, ab_stages, load_config
from hermes_lab.core.inputs import AB
from hermes_lab.core.jsonl import write_json_atomic
from hermes_lab.core.layout import ExperimentLayout, RoundLayout
from hermes_lab.policy import episodes as E
from hermes_lab.policy.arms import ArmError, ArmSpec, load_args, resolve_arm
from hermes_lab.tasks import suite as T

log = logging.getLogger("hermes_lab.ab")
EPOCH = datetime(2026, 1, 1, tzinfo=timezone.utc)  # the simulated clock's start (SimulatedClock's default)


# -------------------------------------------------------------------------------------------- inputs
def load_arm(spec: Any, cfg: HermesConfig, cache: dict[str, Any]) -> Any:
    """A policy object (anything with .generate) as is; a spec string (hermes_lab.policy.arms: model, adapter or
    train output dir, hub id, embedded:tiny, champion), an ArmSpec or a (base, adapter) pair through
    hermes_lab.policy.model.load_policy. The same spec is loaded once (an A/A test shares one policy)."""
    if hasattr(spec, "generate"):
        return spec
    key = _name(spec)
    if key not in cache:
        from hermes_lab.policy import formats
        from hermes_lab.policy.model import load_policy

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
        formats.prepare(cache[key].tokenizer, cfg.model.tool_parser)  # the policy's reader, as every stage's
    return cache[key]


def _name(spec: Any) -> str:
    if hasattr(spec, "generate"):
        return getattr(spec, "name", type(spec).__name__)
    if isinstance(spec, ArmSpec):
        return spec.label
    if isinstance(spec, tuple):
        return f"{spec[0]}+{spec[1]}" if spec[1] else str(spec[0])
    return str(spec)


# -------------------------------------------------------------------------------------------- serving
@dataclass
class Arms:
    """The two policies by arm (0: baseline, 1: candidate), and the names the report and log give them."""

    policies: dict[int, Any]
    names: dict[int, str]


@dataclass
class Server:
    """What stays fixed while a rollout serves traffic: config, traffic, arms, reward, seeds."""

    cfg: HermesConfig
    traffic: Traffic
    arms: Arms
    score: Callable[[list[str], list[str]], list[float]]
    seed: int
    lat_rng: np.random.Generator

    def serve(self, idx: list[int], stage: ab.Stage, router: ab.ABRouter, sink: RequestLog) -> None:
        """Route one look window's requests, generate each arm's responses in one batched call, score, log."""
        traffic, cfg, seed, stg = self.traffic, self.cfg, self.seed, stage
        units = [traffic.units[i] for i in idx]
        arms = router.assign(units)
        a = cfg.ab
        responses: dict[int, str] = {}
        episodes: dict[int, Any] = {}  # the agent family's requests: each a whole episode, its reward its own
        for arm in (0, 1):
            sel = [i for i, x in zip(idx, arms) if x == arm and i not in traffic.agent]
            plays = [i for i, x in zip(idx, arms) if x == arm and i in traffic.agent]
            if plays:
                eps = E.run_episodes(
                    self.arms.policies[arm],
                    [traffic.agent[i] for i in plays],
                    temperature=cfg.execute.temperature,
                    seed=seed * 1_000_003 + plays[0] * 2 + arm,
                    max_turns=cfg.grpo.max_turns,
                )
                episodes.update(zip(plays, eps))
                responses.update((i, ep.answer or "") for i, ep in zip(plays, eps))
            if not sel:
                continue
            prompts = [traffic.prompts[i] for i in sel]
            # one seed per (window, arm): reruns are identical, arms never share a sampling stream
            gen_seed = seed * 1_000_003 + sel[0] * 2 + arm
            kw = {"batch_size": cfg.execute.batch_size} if _takes_batch_size(self.arms.policies[arm]) else {}
            out = self.arms.policies[arm].generate(
                prompts,
                temperature=cfg.execute.temperature,
                max_new_tokens=cfg.execute.max_new_tokens,
                seed=gen_seed,
                **kw,
            )
            responses.update(zip(sel, out))
        text = [i for i in idx if i not in episodes]
        scored = (
            dict(zip(text, self.score([traffic.prompts[i] for i in text], [responses[i] for i in text])))
            if text
            else {}
        )
        resp = [responses[i] for i in idx]
        rewards = [float(episodes[i].reward if i in episodes else scored[i]) for i in idx]
        base = np.exp(self.lat_rng.normal(math.log(a.latency_median_ms), a.latency_sigma, len(idx)))
        debug = log.isEnabledFor(logging.DEBUG)
        lines = []
        for k, i in enumerate(idx):
            arm, r = int(arms[k]), resp[k]
            # an empty answer is a failed request; an episode that ran out of turns without one answered (reward 0)
            status = "ok" if r.strip() or (i in episodes and episodes[i].turns) else "error"
            # rounded as logged, so that re-analysing the log reproduces every number of the report
            lat = round(float(base[k] + a.latency_ms_per_char * len(r)), 2)
            fam = episodes[i].task.family if i in episodes else T.family_of(traffic.prompts[i]) or "other"
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
                "policy": self.arms.names[arm],
            }
            if i in episodes:  # the conversation as played (its opening turn is the covariates' cell)
                rec["messages"] = episodes[i].messages
            lines.append(json.dumps(rec))
            if debug:
                log.debug("request_id=%s arm=%s status=%s", rec["request_id"], rec["arm"], status)
            if sink.covariates:
                sink.cov_rows.append(sink.covariates.row(rec))
            for key, val in (
                ("t", t),
                ("stage", stg.index),
                ("arm", arm),
                ("reward", rewards[k]),
                ("error", status == "error"),
                ("latency_ms", lat),
                ("family", FAM_INDEX.get(fam, len(FAM_INDEX))),
                ("unit", sink.unit_codes.setdefault(units[k], len(sink.unit_codes))),
            ):
                sink.cols[key].append(val)
        sink.file.write("\n".join(lines) + "\n")


def rollout(
    server: Server,
    plan: list[ab.Stage],
    horizon: float,
    st: ab.Settings,
    sink: RequestLog,
    first: ab.Stage | None = None,
) -> tuple[list[ab.Stage], dict[int, float], str | None]:
    """Serve the traffic stage by stage, deciding at every look: (stages run, each one's end, what stopped it).
    ``first``: a continued stage (its kept rows already in ``sink``), served from its old hard end on."""
    from tqdm.auto import tqdm

    traffic, a = server.traffic, server.cfg.ab
    stages_run: list[ab.Stage] = []
    stage_until: dict[int, float] = {}
    pos, stopped_by = 0, None
    bar = tqdm(
        total=len(traffic.t),
        desc="A/B requests",
        mininterval=2,
        disable=not (sys.stderr.isatty() or "ipykernel" in sys.modules),
    )
    # the steps between looks and stages are hermes_lab.ab.rollout's, which the live gateway shares
    stg: ab.Stage | None = ab_rollout.start_stage(plan[0], 0.0) if plan and horizon > 0 else None
    since = -np.inf
    if first is not None:  # looks before the old hard end were taken by the held round: none acted
        stg, since = first, first.hard_end - first.continued
    while stg is not None:
        stages_run.append(stg)
        router = ab.ABRouter(server.arms.names[0], server.arms.names[1], stg.ratio, a.salt)
        lo_row = 0 if stg is first else sink.rows()
        for look in stg.look_times(min(stg.hard_end, horizon)):
            if look <= since:
                continue
            hi = int(np.searchsorted(traffic.t, look, side="right"))
            idx, pos = list(range(pos, hi)), hi
            if idx:
                server.serve(idx, stg, router, sink)
                bar.update(len(idx))
            _, step = ab_rollout.look_step(plan, stg, sink.columns(lo_row), st, float(look), horizon)
            if step.kind != "stay":
                break
        stage_until[stg.index] = float(look)
        stg, stopped_by = step.stage, step.stopped_by
    bar.close()
    return stages_run, stage_until, stopped_by


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
    plan_eval: str | Path | None = None,
    history: Sequence[str | Path] = (),
    continue_from: str | Path | None = None,
) -> dict[str, Any]:
    """Run the staged rollout and write the report, its verdict, the request log and the plots; returns the
    report.

    ``baseline``/``candidate``: a path or id, or a policy object with ``generate``. ``duration``: cap on
    simulated seconds (0: every stage, with extensions). ``score_fn(prompts, responses)``: the reward
    (default: the round's system reward, ``rewards.score_responses``: the task verifiers). ``plan_eval``:
    train's eval.json, the held-out gain ``ab.plan_power`` sizes the simulated traffic for (``ab_plan``).
    ``history``: logs with rewards from before this experiment, the ``ab.covariates`` history prior
    (``hermes_lab.ab.covariates.round_history`` gives a round's). ``continue_from``: an earlier round's ``ab/``
    whose rollout ended undecided at a stage's hard end: continue that experiment (``hermes_lab.ab.held``; its
    settings, plan and history replace this run's).
    """
    wall0 = time.time()
    held = load_held(continue_from) if continue_from else None  # HeldError names the folder, before any load
    cache: dict[str, Any] = {}
    pols = {}
    for arm, spec, flag in ((0, baseline, "--baseline"), (1, candidate, "--candidate")):
        try:  # a spec that names nothing fails here, before any file is written
            pols[arm] = load_arm(spec, cfg, cache)
        except ArmError as e:
            raise e.with_flag(flag) from None
    if held is not None:  # the held experiment's own settings, rate and history: the same sequence, carried on
        cfg = copy.copy(cfg)
        cfg.ab, history = held.ab, held.history
    stage_list = held.stage_list if held is not None else ab_stages(cfg, ratio)
    st = ab.Settings.from_config(cfg)
    sized = None
    if cfg.ab.plan_power > 0 and not replay:  # a replayed log keeps its own arrival times
        from hermes_lab.ab import plan as ab_plan

        sized = ab_plan.plan_rate(cfg, stage_list, st, plan_eval, seed=seed)
        print(sized.line())
        cfg = copy.copy(cfg)  # the caller's config stays as it was; this run's records show the planned rate
        cfg.ab = dataclasses.replace(cfg.ab, request_rate=sized.rate)
    a = cfg.ab
    plan = ab.plan_stages(stage_list, a.request_rate, a.look_every, a.max_extension)
    full = sum(s.seconds * (1 + s.max_extension) for s in plan)
    start = 0.0
    if held is not None:  # from the held stage's old hard end: its added time, then the stages after it
        plan = [held.stage if s.index == held.stage.index else s for s in plan if s.index >= held.stage.index]
        start = held.stage.hard_end - held.stage.continued
        full = held.stage.hard_end + sum(s.seconds * (1 + s.max_extension) for s in plan[1:])
    horizon = min(duration, full) if duration and duration > 0 else full
    output = Path(output)
    log_dir = Path(log_dir) if log_dir else output.parent
    log_dir.mkdir(parents=True, exist_ok=True)
    if score_fn is None:  # the round's system reward (reward.system: the task verifiers by default)
        from hermes_lab.rewards.registry import score_responses

        score_fn = lambda ps, rs: score_responses(cfg, ps, rs)  # noqa: E731
    arms = Arms(pols, {0: _name(baseline), 1: _name(candidate)})
    log_path = log_dir / LOG_NAME
    if replay and Path(replay).resolve() == log_path.resolve():
        raise ValueError(f"--replay {replay} is where this run writes its request log: pass another --log-dir")
    agent = plays_agent(cfg) and not replay
    if agent and not all(_plays_episodes(p) for p in pols.values()):
        agent = False  # an arm behind a URL, or a stand-in: its episodes cannot be played offline here
        log.warning("ab: the agent family is left out of this A/B: an arm is not a local policy")
    traffic = (
        Traffic.replay(replay, a.request_rate, seed) if replay else Traffic.simulate(cfg, horizon, seed, start, agent)
    )
    if replay:
        horizon = min(horizon, float(traffic.t[-1]))
    log.info(
        "A/B rollout: %d stages planned, %.0f simulated seconds at most, %d requests",
        len(plan),
        horizon,
        len(traffic.t),
    )
    server = Server(cfg, traffic, arms, score_fn, seed, np.random.default_rng([seed, 11]))
    enc = ab_cov.encoder(cfg, history)
    with log_path.open("w", encoding="utf-8") as logf:
        sink = RequestLog(logf, a.unit, covariates=enc)
        if held is not None:
            sink.keep(held.rows)
        stages_run, stage_until, stopped_by = rollout(server, plan, horizon, st, sink, held.stage if held else None)
    arr = sink.columns()
    analysis = ab_analysis.analyse_log(arr, stages_run, st, FAM_NAMES, stage_until)
    facts = RunFacts(
        arms.names[0],
        arms.names[1],
        seed,
        duration,
        horizon,
        stopped_by,
        log_path,
        str(replay) if replay else None,
        time.time() - wall0,
    )
    report = build_report(cfg, analysis, stage_list, st, facts)
    report["plan"] = {**sized.as_dict(), "line": sized.line(), "underpowered": sized.underpowered} if sized else None
    report["covariates"] = enc.describe() if enc else None
    if held is not None:
        report["plan"], report["continued"] = None, held.describe()  # the plan was the held round's
        report["reasons"].insert(
            0,
            f"continues the experiment held in {held.source} (stage {held.stage.index} at "
            f"{held.stage.ratio:.0%}, its {len(held.rows)} requests kept): another {held.added:g} s from "
            f"t = {start:g} s, the same bets, covariates and history",
        )
    pngs = make_plots(arr, report, ExperimentLayout(log_dir).plots, FAM_NAMES) if plots else []
    report["plots"] = [str(p) for p in pngs]
    write_json_atomic(output, report)
    write_ab_verdict(report, output.parent)
    log_to_mlflow(cfg, report, output, log_path)
    _log_plan(report)
    log.info("A/B decision: %s (%s)", report["decision"], "; ".join(report["reasons"]))
    return report


def _log_plan(report: dict[str, Any]) -> None:
    """The plan's ``ab/plan_*`` metrics on the active MLflow run (ab_report's record has the rest)."""
    if report.get("plan"):
        from hermes_lab.ab import plan as ab_plan
        from hermes_lab.core import tracking

        tracking.log_metrics("ab", ab_plan.plan_metrics(report["plan"]))


def _plays_episodes(policy: Any) -> bool:
    """A local policy (tokenizer with a chat template, model): what ``policy.episodes`` plays episodes with."""
    tok = getattr(policy, "tokenizer", None)
    return getattr(policy, "model", None) is not None and bool(getattr(tok, "chat_template", None))


def _takes_batch_size(policy: Any) -> bool:
    """hermes_lab.policy.model.Policy takes execute.batch_size; a duck-typed policy may not."""
    import inspect

    try:
        return "batch_size" in inspect.signature(policy.generate).parameters
    except (TypeError, ValueError):
        return False


# ------------------------------------------------------------------------------------ notebook helpers
def resolve_arms(cfg: HermesConfig, round_dir: str | Path, baseline: str = "", candidate: str = "") -> tuple[Any, Any]:
    """The notebook's arms. Empty baseline: arms.resolve_baseline, the policy the regression gate
    compared against (champion, else model.adapter, else the bare base). Empty candidate: this round's
    training output (<round_dir>/train/adapter on the base named in train/run.json), as validate finds it."""
    from hermes_lab.core.paths import project_root
    from hermes_lab.policy.arms import candidate_from_train_dir, resolve_baseline

    root = project_root()  # notebook parameters are relative to the project, not to the kernel's cwd
    b: Any = resolve_arm(baseline, "baseline", cfg, root) if baseline else None
    c: Any = resolve_arm(candidate, "candidate", cfg, root) if candidate else None
    b = b or resolve_baseline(cfg)
    c = c or candidate_from_train_dir(RoundLayout(round_dir).train.root, cfg)
    return b, c


def notebook_run(
    cfg: HermesConfig,
    round_dir: str | Path,
    parent_run_id: str = "",
    baseline: str = "",
    candidate: str = "",
    duration: float = 0,
    seed: int = 0,
    continue_from: str = "",
) -> dict[str, Any]:
    """What 40_ab_analysis.ipynb does with a simulated A/B (``ab.mode: simulated``; live:
    ``hermes_lab.live.round.notebook_run``): reuse round_dir/ab/ab_report.json if it exists (its verdict is
    rewritten), else run the rollout; plots (PNG + MLflow) in an 'ab' run nested under the round's run."""
    from hermes_lab.core import tracking

    ab_dir = RoundLayout(round_dir).ab
    out, report_path = ab_dir.root, ab_dir.report
    with tracking.stage_run("ab", parent_run_id or None, cfg.round.runs_dir, cfg.round.experiment):
        if report_path.is_file() and ab_dir.requests.is_file():
            report = json.loads(report_path.read_text(encoding="utf-8"))
            cols, fams = read_log(ab_dir.requests)
            paths = make_plots(cols, report, ab_dir.plots, fams)
            write_ab_verdict(report, out)
            log_to_mlflow(cfg, report, report_path, ab_dir.requests)
            _log_plan(report)
        else:
            b, c = resolve_arms(cfg, round_dir, baseline, candidate)
            ev = RoundLayout(round_dir).train.eval  # this round's held-out gain: what ab.plan_power sizes for
            hist = ab_cov.round_history(round_dir, cfg.ab.history_rounds)  # the covariates' prior
            report = run_ab(
                cfg,
                b,
                c,
                duration=duration,
                output=report_path,
                seed=seed,
                plan_eval=ev,
                history=hist,
                continue_from=continue_from or None,  # round.on_held continue: an earlier round's held A/B
            )
            cols, fams = read_log(ab_dir.requests)
            paths = [Path(p) for p in report["plots"]]
    return {"report": report, "cols": cols, "families": fams, "plots": paths, "report_path": report_path}


# ----------------------------------------------------------------------------------------------- CLI
def add_arguments(p: argparse.ArgumentParser) -> None:
    AB.add_arguments(p, output={"default": REPORT_NAME})  # declared in hermes_lab.core.inputs


def run_cli(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s"
    )
    from hermes_lab.core import quiet

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
        plan_eval=args.plan_eval,
        history=[h for h in args.history.split(",") if h],
        continue_from=args.continue_from,
    )
    for spec, flag in ((args.baseline, "--baseline"), (args.candidate, "--candidate")):
        if spec.strip() != "champion":  # one that names nothing is refused before MLflow's run is set up (champion
            resolve_arm(spec, flag, cfg)  # asks MLflow's registry: run_ab resolves it, in the run)
    if args.no_mlflow:
        report = run_ab(cfg, args.baseline, args.candidate, **kw)
    else:
        from hermes_lab.core import tracking

        with tracking.stage_run("ab", args.parent_run_id or None, cfg.round.runs_dir, cfg.round.experiment):
            report = run_ab(cfg, args.baseline, args.candidate, **kw)
    print(summary(report))
    print(f"report: {args.output}   requests: {report['log']}")
    return 0


def main(argv: list[str] | None = None) -> int:
    from hermes_lab.core.command import run_module

    return run_module(
        "hermes_lab.ab_run", add_arguments, run_cli, argv, description="Staged A/B rollout -> ab_report.json"
    )


if __name__ == "__main__":
    sys.exit(main())
