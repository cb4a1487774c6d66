"""The round and the flywheel: the stage notebooks of ``hermes_lab.round.stages`` run in order by papermill.

Reads ``params/*.yaml`` and ``runs/state.json``; writes ``runs/round-NN/`` (the executed notebooks, every
stage's outputs, ``summary.json``, and ``progress.json``, a copy of the progress kept in state.json) and
the round's MLflow runs (one parent run, one nested run per stage). Promotion sets the MLflow registry
alias ``champion``; a rollback marks the round's data negative for the next prep.

    hermes-lab round --params params/embedded.yaml          # one round (make round)
    hermes-lab round --params params/embedded.yaml --resume # continue after the last completed stage
    hermes-lab flywheel --params params/embedded.yaml --rounds 3
    hermes-lab status --params params/embedded.yaml

Gates, in registry order, each with its verdict in summary.json and MLflow (a gate that did not run says
why): data trigger (>= min_samples new samples) and cooldown (hard) in prep; review agreement; training
health; regression; the A/B decision. A gate that says no ends the round cleanly with its status (the
stage's verdict file says so, see ``hermes_lab.round.stages``); a failing cell fails the round with the notebook
and cell named, and the executed notebook is kept. The round's end (the gates collected, promotion or roll back,
``summary.json``, what it prints) is ``hermes_lab.round.outcome``'s.

Crash safety: every change of a round's progress and of the flywheel state (cooldown, negatives,
champion, round number) is one atomic rename of state.json, made under the runs/ lock; registering the
champion in MLflow is idempotent, so a resumed round never registers a version twice.

Secrets are never papermill parameters (they would be written into the executed notebooks): stages
read keys from the environment.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from hermes_lab.config.schema import HermesConfig, load_config
from hermes_lab.core.jsonl import write_json_atomic
from hermes_lab.core.layout import PolicyLayout, RoundLayout, RunsLayout, round_name
from hermes_lab.core.paths import PACKAGE_REPO
from hermes_lab.core.state import FlywheelState, SimulatedClock, parse_time, state_path
from hermes_lab.core.verdict import STOP_AWAITING_LIVE, WAITING, read_verdict
from hermes_lab.policy import formats
from hermes_lab.round.outcome import finish_round, log_round, print_summary
from hermes_lab.round.stages import STAGES, RoundContext, Stage, fresh_data

NOTEBOOKS = PACKAGE_REPO / "notebooks"  # the stage notebooks of this checkout
OK_STATUSES = ("promoted", "rolled back", "completed", *WAITING, "candidate held", "skipped")


class RoundError(RuntimeError):
    """A round failed: the message names the notebook and the cell."""


class RoundLocked(RuntimeError):
    """Another round holds the lock on this runs/ folder."""


@dataclass
class RoundResult:
    round_no: int
    round_dir: Path
    status: str
    decision: str | None = None
    summary: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------- lock
class RoundLock:
    """An exclusive flock on runs/.round.lock: released by the kernel even if the process is killed."""

    def __init__(self, runs_dir: str | Path):
        self.path = Path(runs_dir) / ".round.lock"
        self.f: Any = None

    def __enter__(self) -> RoundLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.f = open(self.path, "a+")
        try:
            fcntl.flock(self.f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.f.seek(0)
            holder = self.f.read().strip() or "?"
            self.f.close()
            raise RoundLocked(
                f"another round is running on {self.path.parent} ({holder}); wait for it or use another round.runs_dir"
            ) from None
        self.f.seek(0)
        self.f.truncate()
        self.f.write(f"pid {os.getpid()} since {time.strftime('%Y-%m-%d %H:%M:%S')}")
        self.f.flush()
        return self

    def __exit__(self, *a: Any) -> None:
        fcntl.flock(self.f, fcntl.LOCK_UN)
        self.f.close()


# ------------------------------------------------------------------------------------------ papermill
def notebook_path(stage: Stage) -> Path:
    p = Path(stage.notebook)
    return p if p.is_absolute() else NOTEBOOKS / p


def run_notebook(
    name: str | Path, out: Path, params: dict[str, Any], timeout_s: int | None = None, preload: Sequence[str] = ()
) -> None:
    """Execute one notebook; unknown parameters are refused (papermill only warns). ``preload``: heavy modules
    its kernel will import, imported once by the zygote it is forked from (``Stage.preload``)."""
    from hermes_lab.core import kernels, paths, quiet

    kernels.skip_unused_imports()
    import papermill as pm

    src = Path(name) if Path(name).is_absolute() else NOTEBOOKS / name
    known = pm.inspect_notebook(str(src))
    unknown = sorted(set(params) - set(known))
    if unknown:
        raise RoundError(f"{src.name}: unknown parameter(s) {unknown}; the notebook takes {sorted(known)}")
    try:
        pm.execute_notebook(
            str(src),
            str(out),
            parameters=params,
            kernel_name="python3",
            cwd=str(paths.project_root()),  # the kernels resolve relative paths against the runner's project
            log_output=True,
            progress_bar=False,
            execution_timeout=timeout_s,
            config=quiet.kernel_config(),  # an encrypted kernel channel: no plain-TCP warning per stage
            kernel_manager_class=kernels.manager(preload),  # forked from a warm zygote: no ~2.5 s of imports
        )
    except pm.PapermillExecutionError as e:
        raise RoundError(
            f"{src.name} failed in cell {e.exec_count} (index {e.cell_index}): {e.ename}: {e.evalue}. "
            f"Executed notebook kept at {out}"
        ) from None


def run_stage(stage: Stage, ctx: RoundContext) -> str | None:
    """Run one stage's notebook; the stop status its verdict gives, or None. Raises RoundError on a failure
    that no verdict of this execution explains."""
    verdict_path = ctx.round_dir / stage.verdict if stage.verdict else None
    if verdict_path is not None:
        verdict_path.unlink(missing_ok=True)  # a verdict read below is this execution's
    # the config file as load_config found it (absolute): the kernels' cwd is not the user's
    params = {
        "config_path": ctx.cfg.source or ctx.params_path,
        "round_dir": str(ctx.round_dir),
        "parent_run_id": ctx.parent_run_id,
    }
    params |= stage.params(ctx)
    try:  # the names and types its inputs declare (hermes_lab.core.inputs)
        params = stage.inputs.papermill(params)
    except ValueError as e:
        raise RoundError(str(e)) from None
    failure = None
    preload = stage.preload if stage.live_preload or ctx.cfg.ab.mode != "live" else ()
    try:
        run_notebook(notebook_path(stage), RoundLayout(ctx.round_dir).notebook(stage.notebook), params, preload=preload)
    except RoundError as e:
        failure = e
    verdict = read_verdict(verdict_path) if verdict_path is not None else None
    stop = (verdict or {}).get("stop")
    if stop and stop not in stage.stops:
        raise RoundError(f"stage '{stage.name}': its verdict stops with '{stop}', not one of {list(stage.stops)}")
    if stop:
        return stop
    if failure is not None:
        raise failure
    return None


# --------------------------------------------------------------------------------------------- round
def _round_dir(runs: Path, n: int) -> Path:
    return RunsLayout(runs).round_dir(n)


def _commit(state: FlywheelState, runs: Path, rd: Path, prog: dict[str, Any]) -> None:
    """The one write that changes a round's progress and the flywheel state together (atomic rename).
    progress.json is a copy for people and notebooks; nothing reads it back."""
    state.save(state_path(runs))
    write_json_atomic(RoundLayout(rd).progress, prog)


def _check_deep(cfg: HermesConfig, runs: Path) -> list[str]:
    """check_config(deep=True) before the first stage: what TRL would refuse at the train stage fails now,
    not an hour in. Its imports (~8 s of CPU) are paid once per machine for the sections TRL and PEFT are
    asked about (grpo, lora, reward), their versions and the code that asks: a stamp in the machine's cache
    (``hermes_lab.core.paths.machine_cache``), or in runs/ where that cache is off. Another project, another
    runs_dir or another data setting on the same machine does not ask again."""
    import hashlib
    from importlib.metadata import PackageNotFoundError, version

    from hermes_lab.config import check
    from hermes_lab.config import trl as trl_mapping
    from hermes_lab.core.paths import machine_cache

    versions = {}
    for dist in ("trl", "peft", "transformers", "torch", "vllm"):
        try:
            versions[dist] = version(dist)
        except PackageNotFoundError:
            versions[dist] = None
    d = cfg.to_dict()
    asked = {k: d[k] for k in ("grpo", "lora", "reward")}  # all that deep_problems gives TRL and PEFT
    asked["gpus"] = os.environ.get("CUDA_VISIBLE_DEVICES")  # grpo_kwargs asks torch for CUDA (bf16, use_cpu)
    # and how we ask: an edited mapping (config/trl.py) or check (config/check.py) is never served an old stamp
    asked["code"] = hashlib.sha256(b"".join(Path(m.__file__).read_bytes() for m in (check, trl_mapping))).hexdigest()
    key = hashlib.sha256(json.dumps([asked, versions], sort_keys=True, default=str).encode()).hexdigest()[:32]
    cache = machine_cache("checked-configs")
    stamp = cache / key if cache is not None else runs / ".config-checked"
    if stamp.is_file() and stamp.read_text().strip() == key:
        return check.check_config(cfg)
    warnings = check.check_config(cfg, deep=True)
    with contextlib.suppress(OSError):  # a cache that cannot be written only asks again next time
        stamp.parent.mkdir(parents=True, exist_ok=True)
        stamp.write_text(key)
    return warnings


def _due(state: FlywheelState, cfg: HermesConfig) -> None:
    """Simulated clock only: move it past the cooldown of the last training, if that has not passed."""
    last = parse_time(state.last_train_time)
    now = parse_time(state.simulated_now) or SimulatedClock().now()
    if last is not None and now < last + timedelta(hours=cfg.data.cooldown_hours):
        now = last + timedelta(hours=cfg.data.cooldown_hours + 1)
    state.simulated_now = now.isoformat()


def run_round(
    params_path: str,
    resume: bool | None = False,
    quiet: bool = False,
    stages: Sequence[Stage] = STAGES,
    *,
    due: bool = False,
) -> RoundResult:
    """One round: every stage notebook in order, then promotion or rollback.

    ``resume``: True continues the unfinished round, None continues it if there is one. ``due`` (the
    flywheel, simulated clock only): move the clock past the cooldown first, under the lock."""
    from hermes_lab.core import tracking

    cfg = load_config(params_path)
    runs = Path(cfg.round.runs_dir)
    with RoundLock(runs):
        for w in _check_deep(cfg, runs):
            if not quiet:
                print(f"warning: {w}", flush=True)
        formats.check_model(cfg)  # a policy whose tool calls cannot be read: a named error now, not text answers
        state = FlywheelState.load(state_path(runs))
        n = state.last_round + 1
        rd = _round_dir(runs, n)
        prog = state.progress if state.progress and state.progress.get("round") == n else None
        if resume is None:
            resume = prog is not None
        if prog and not resume:
            raise RoundError(
                f"{rd} holds an unfinished round ({prog.get('status')}, stages done: "
                f"{prog.get('completed')}); continue it with --resume (make clean-runs starts over)"
            )
        if resume and not prog:
            raise RoundError(f"nothing to resume: round {n} in {state_path(runs)} has not started")
        rd.mkdir(parents=True, exist_ok=True)
        if cfg.model.base_model == "embedded:tiny" and not quiet:
            _report_tiny(cfg, say=n == 1)  # the starting point once, not again every flywheel round
        if not quiet:  # what a conversation with no verifier, feedback or judge is paid (issue 56)
            from hermes_lab.prep.outcomes import paying_for

            print(f"[round {n:02d}] {paying_for(cfg)}", flush=True)
            print(f"[round {n:02d}] {who_plays(cfg)}", flush=True)
        _agent_ready(cfg, params_path, say=(lambda _m: None) if quiet else print)
        if cfg.round.simulated_clock:
            if due:
                _due(state, cfg)
            elif state.simulated_now is None:
                state.simulated_now = SimulatedClock().now().isoformat()
        tracking.setup(runs, cfg.round.experiment)
        if prog:
            prog["status"] = "running"
            prog.pop("stopped_at", None)  # a resumed round reruns the stage that stopped it
        else:
            held = state.held if cfg.round.on_held == "continue" else None
            state.held = None  # continued now, or not to be (round.on_held: new): never twice
            params = {
                "round.params": params_path,
                "round.number": n,
                "round.champion": state.champion_adapter or "base",
            }
            run_id = tracking.start_round_run(
                round_name(n), params | ({"round.continues": held["round"]} if held else {})
            )
            prog = {"round": n, "parent_run_id": run_id, "completed": [], "timings": {}, "status": "running"}
            prog["params"] = params_path
            if held:
                prog["continues"] = held
        state.progress = prog
        _commit(state, runs, rd, prog)  # stage notebooks read the simulated clock and the negatives from it
        ctx = RoundContext(cfg, params_path, rd, n, prog["parent_run_id"], state)
        status = "completed"
        cont = prog.get("continues")
        if cont and not quiet:
            print(
                f"[round {n:02d}] continues round {cont['round']:02d}'s held A/B (round.on_held: continue): "
                f"its candidate and data, no new training",
                flush=True,
            )
        for stage in stages:
            if stage.name in prog["completed"] or (cont and not stage.on_continue):
                continue
            t0 = time.time()
            if not quiet:
                print(f"[round {n:02d}] {stage.name:8s} ({Path(stage.notebook).name}) ...", flush=True)
            try:
                stop = run_stage(stage, ctx)
            except RoundError:
                prog["status"] = "failed"
                prog["timings"][stage.name] = round(time.time() - t0, 1)
                _commit(state, runs, rd, prog)
                tracking.log_failed_notebook(prog["parent_run_id"], RoundLayout(rd).notebook(stage.notebook))
                raise
            prog["timings"][stage.name] = round(time.time() - t0, 1)
            if stop:
                status = stop
                prog["stopped_at"] = {"stage": stage.name, "status": stop}
                break
            prog["completed"].append(stage.name)
            if stage.consumes_negatives:  # they are in this round's prompt set now: never carry them twice
                state.negative_files = []
            if stage.starts_cooldown:  # the cooldown counts from the training, whatever the A/B says
                state.last_train_time = state.clock(cfg.round.simulated_clock).now().isoformat()
            _commit(state, runs, rd, prog)
        summary = finish_round(cfg, stages, state, rd, n, prog, status)
        log_round(prog, rd, summary)  # idempotent: a kill before the commit below only repeats it
        # awaiting review / live A/B: the same round continues (--resume) once the labels / the decision are in
        prog["status"] = status if status in WAITING else "done"
        if status not in WAITING:
            state.last_round = n
        state.history.append(
            {
                "round": n,
                "status": summary["status"],
                "decision": summary["decision"],
                "pass_rate": summary["pass_rate"],
            }
        )
        state.progress = prog if prog["status"] in WAITING else None
        _commit(state, runs, rd, prog)
        if not quiet:
            print_summary(summary)
        return RoundResult(n, rd, summary["status"], summary["decision"], summary)


def who_plays(cfg: HermesConfig) -> str:
    """One line: who plays the round's agent family in execute and validate (agent.runner)."""
    from hermes_lab.agents.play import plays_hermes
    from hermes_lab.policy.episodes import family_of_environment

    fam = family_of_environment(cfg.grpo.environment)
    if fam is None:
        return "agent runner: none (grpo.environment names no embedded family: no held-out tasks to play here)"
    if plays_hermes(cfg):
        return (
            "agent runner: the real Hermes Agent (its own loop and tools, sandboxed) plays the hermes family in "
            "execute and validate, against the policy served on 127.0.0.1 (agent.runner: hermes)"
        )
    name = fam.FAMILY
    return f"agent runner: the built-in loop plays the {name} family in execute and validate (agent.runner: builtin)"


def _agent_ready(cfg: HermesConfig, params_path: str, say: Callable[[str], None]) -> None:
    """agent.runner hermes: the real agent installed and its sandbox working before any stage runs, else a named
    RoundError (not a traceback from execute's kernel minutes later)."""
    from hermes_lab.agents.hermes_chat import HermesRunError
    from hermes_lab.agents.play import plays_hermes, ready

    if not plays_hermes(cfg):
        return
    try:
        ready(say)
    except HermesRunError as e:
        raise RoundError(
            f"{params_path}: agent.runner: hermes, but the real Hermes Agent cannot run here: {e}. Set "
            "agent.runner: builtin to play the hermes family with the project's own loop"
        ) from None


def _report_tiny(cfg: HermesConfig, say: bool = True) -> None:
    """Build (or reuse) the embedded policy and (``say``) how good the base is: GRPO's starting point."""
    from hermes_lab.policy.model import build_tiny_policy

    d = build_tiny_policy(cfg.round.runs_dir, cfg.model.seed)
    if not say:
        return
    rep = _read(PolicyLayout(d).build)
    fams = ", ".join(f"{f} {v['pass_rate']:.0%}" for f, v in rep.get("per_family", {}).items())
    h = rep.get("hermes") or {}
    agent = (
        f"; hermes tasks (Hermes's own tools, verified on disk) {h['episode_success']:.0%} of held-out episodes, "
        f"greedy {h['greedy_episode_success']:.0%}"
        if h
        else ""
    )
    print(
        f"base policy {d} ({rep.get('parameters', 0):,} parameters): sampled pass rate at T=0.9 on held-out "
        f"tasks {rep.get('pass_rate', 0):.1%} ({fams}), greedy {rep.get('greedy_pass_rate', 0):.0%}{agent}; "
        f"report in {PolicyLayout(d).build}",
        flush=True,
    )


def _read(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}


# ------------------------------------------------------------------------------------------ flywheel
def advance_clock(params_path: str, hours: float) -> None:
    """Move the simulated clock on, under the runs/ lock (a running round reads it)."""
    cfg = load_config(params_path)
    with RoundLock(cfg.round.runs_dir):
        sp = state_path(cfg.round.runs_dir)
        state = FlywheelState.load(sp)
        clock = SimulatedClock(parse_time(state.simulated_now) or SimulatedClock().now())
        state.simulated_now = clock.advance(hours=hours).isoformat()
        state.save(sp)


def flywheel(params_path: str, rounds: int, stages: Sequence[Stage] = STAGES, quiet: bool = False) -> list[RoundResult]:
    """``rounds`` rounds back to back on the simulated clock, whatever ran before: each starts by moving
    the clock past the cooldown of the last training (under the lock) and continues an unfinished round."""
    cfg = load_config(params_path)
    if not cfg.round.simulated_clock:
        raise RoundError("flywheel needs round.simulated_clock: true (a real clock would wait out the cooldown)")
    results = []
    for _ in range(rounds):
        results.append(run_round(params_path, resume=None, quiet=quiet, stages=stages, due=True))
        if results[-1].status in WAITING:  # nothing changes until someone labels / the gateway decides
            break
    if not quiet:
        from hermes_lab.round.compare import print_flywheel

        print_flywheel([r.summary for r in results])
    return results


def status(params_path: str) -> dict[str, Any]:
    """Whether a round is due and, if not, why."""
    cfg = load_config(params_path)
    runs = Path(cfg.round.runs_dir)
    state = FlywheelState.load(state_path(runs))
    now = state.clock(cfg.round.simulated_clock).now()
    reasons = []
    last = parse_time(state.last_train_time)
    if last is not None:
        left = last + timedelta(hours=cfg.data.cooldown_hours) - now
        if left.total_seconds() > 0:
            reasons.append(f"cooldown: {left.total_seconds() / 3600:.1f} h left (last training {last.isoformat()})")
    n = state.last_round + 1
    pending = cfg.execute.num_tasks * cfg.execute.samples_per_task  # what the embedded execute stage logs
    if cfg.execute.source == "live":  # ... or the live traffic it trains on: its requests with feedback
        from hermes_lab.logs import gateway

        pending = gateway.pending_samples(cfg, _round_dir(runs, n), pending)
    for p in fresh_data(runs, n)[1:]:  # plus earlier logs since the last training (A/B, skipped rounds)
        with open(p, encoding="utf-8") as f:
            pending += sum(1 for _ in f)
    if pending < cfg.data.min_samples:
        reasons.append(f"samples: {pending} of {cfg.data.min_samples} new samples")
    unfinished = state.progress if state.progress and state.progress.get("round") == n else {}
    if unfinished.get("status") == "awaiting review":
        reasons.append(
            f"review pending: open notebooks/review.ipynb and label the queue of round {n}, "
            f"then hermes-lab round --resume"
        )
    elif unfinished.get("status") == STOP_AWAITING_LIVE:
        from hermes_lab.live import round as live_round

        where = live_round.status_line(cfg, live_round.experiment_dir(cfg, _round_dir(runs, n)))
        reasons.append(f"round {n} is awaiting its live A/B: {where}; once decided: hermes-lab round --resume")
    elif unfinished.get("status") in {"running", "failed"}:
        reasons.append(f"round {n} is unfinished ({unfinished['status']}): hermes-lab round --resume")
    return {
        "due": not reasons,
        "reasons": reasons,
        "last_round": state.last_round,
        "champion": state.champion_adapter or "base",
        "now": now.isoformat(),
        "pending_samples": pending,
        "live": live_status(runs),
    }


def live_status(runs: Path) -> dict[str, Any] | None:
    """The live flywheel's last status (``hermes_lab.round.supervisor`` writes it every second), with whether
    its process is still there; None when no live flywheel ran on these runs/."""
    try:
        got = json.loads(RunsLayout(runs).flywheel.status.read_text(encoding="utf-8"))
    except (FileNotFoundError, ValueError):
        return None
    pid = got.get("pid")
    try:
        os.kill(int(pid), 0) if isinstance(pid, int) and pid > 0 else None
        got["alive"] = isinstance(pid, int) and pid > 0
    except PermissionError:  # there, under another user
        got["alive"] = True
    except ProcessLookupError:
        got["alive"] = False
    return got


# ----------------------------------------------------------------------------------------------- CLI
def add_arguments_round(p: argparse.ArgumentParser) -> None:
    p.add_argument("--params", default="params/embedded.yaml", help="config YAML")
    p.add_argument("--resume", action="store_true", help="continue the unfinished round after its last completed stage")


def run_cli_round(args: argparse.Namespace) -> int:
    try:
        r = run_round(args.params, resume=args.resume)
    except (RoundError, RoundLocked) as e:
        print(f"hermes-lab round: {e}", file=sys.stderr)
        return 1
    return 0 if r.status.startswith(OK_STATUSES) else 4


def add_arguments_flywheel(p: argparse.ArgumentParser) -> None:
    p.add_argument("--params", default="params/embedded.yaml", help="config YAML (round.simulated_clock: true)")
    p.add_argument("--rounds", type=int, default=3, help="number of rounds")


def run_cli_flywheel(args: argparse.Namespace) -> int:
    try:
        flywheel(args.params, args.rounds)
    except (RoundError, RoundLocked) as e:
        print(f"hermes-lab flywheel: {e}", file=sys.stderr)
        return 1
    return 0


def add_arguments_status(p: argparse.ArgumentParser) -> None:
    p.add_argument("--params", default="params/embedded.yaml", help="config YAML")


def run_cli_status(args: argparse.Namespace) -> int:
    s = status(args.params)
    print(
        f"round {s['last_round'] + 1} is {'due' if s['due'] else 'not due'} (champion: {s['champion']}, now {s['now']})"
    )
    for r in s["reasons"]:
        print(f"  - {r}")
    live = s["live"]
    if live:  # the live flywheel decides when rounds start: what it waits for
        state = "running" if live["alive"] else "not running (its last status)"
        exp = live.get("experiment") or {}
        print(f"live flywheel {live.get('address')} pid {live.get('pid')}: {state}, phase {live.get('phase')}")
        if exp:
            print(f"  serving {exp.get('name')}: candidate at {float(exp.get('ratio') or 0):.0%} ({exp.get('status')})")
        for w in live.get("waiting_for") or ["nothing"]:
            print(f"  waiting for {w}")
    return 0 if s["due"] else 3


add_arguments, run_cli = add_arguments_round, run_cli_round


def main(argv: list[str] | None = None) -> int:
    from hermes_lab.core.command import run_module

    return run_module(
        "hermes_lab.round.runner", add_arguments_round, run_cli_round, argv, description=__doc__.split("\n")[0]
    )


if __name__ == "__main__":
    sys.exit(main())
