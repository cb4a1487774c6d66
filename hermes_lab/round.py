"""The round and the flywheel: stage notebooks run in sequence by papermill, gates, promotion, rollback.

Reads ``params/*.yaml`` and ``runs/state.json``; writes ``runs/round-NN/`` (the executed notebooks,
every stage's outputs, ``progress.json`` for --resume, ``summary.json``) and the round's MLflow runs
(one parent run, one nested run per stage). Promotion sets the MLflow registry alias ``champion``;
rollback marks the round's data negative for the next prep.

    hermes-lab round --params params/embedded.yaml          # one round (make round)
    hermes-lab round --params params/embedded.yaml --resume # continue after the last completed stage
    hermes-lab flywheel --params params/embedded.yaml --rounds 3
    hermes-lab status --params params/embedded.yaml

Gates, in order, each with its verdict in summary.json and MLflow: data trigger (>= min_samples new
samples) and cooldown (hard) in prep; review agreement; training health; regression; the A/B decision.
A gate that says no ends the round cleanly with its status; a failing cell fails the round with the
notebook and cell named, and the executed notebook is kept.

Secrets are never papermill parameters (they would be written into the executed notebooks): stages
read keys from the environment.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from hermes_lab.config import HermesConfig, load_config
from hermes_lab.jsonl import write_json_atomic
from hermes_lab.state import FlywheelState, SimulatedClock, parse_time, state_path

REPO = Path(__file__).resolve().parent.parent
NOTEBOOKS = REPO / "notebooks"
# stage name, notebook. 50_round_compare runs last so its table includes this round.
STAGES = [
    ("execute", "00_execute.ipynb"),
    ("prep", "10_data_prep.ipynb"),
    ("review", "15_review_gate.ipynb"),
    ("train", "20_grpo_train.ipynb"),
    ("validate", "30_inspect_validate.ipynb"),
    ("ab", "40_ab_analysis.ipynb"),
    ("compare", "50_round_compare.ipynb"),
]
# exception names a stage raises when its gate says no -> the round's status
GATE_STOPS = {
    "GateRefused": "skipped: data gate",
    "ReviewGateStop": "awaiting review",
    "RegressionGateStop": "stopped: regression gate",
    "TrainingHealthError": "stopped: training health",
}


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

    def __init__(self, runs_dir: Path):
        self.path = runs_dir / ".round.lock"
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
def run_notebook(name: str, out: Path, params: dict[str, Any], timeout_s: int | None = None) -> None:
    """Execute one stage notebook; unknown parameters are refused (papermill only warns)."""
    import papermill as pm

    from hermes_lab import paths, quiet

    src = NOTEBOOKS / name
    known = pm.inspect_notebook(str(src))
    unknown = sorted(set(params) - set(known))
    if unknown:
        raise RoundError(f"{name}: unknown parameter(s) {unknown}; the notebook takes {sorted(known)}")
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
        )
    except pm.PapermillExecutionError as e:
        stop = GATE_STOPS.get(e.ename)
        if stop:
            raise GateStop(stop, f"{e.ename}: {e.evalue}") from None
        raise RoundError(
            f"{name} failed in cell {e.exec_count} (index {e.cell_index}): {e.ename}: {e.evalue}. "
            f"Executed notebook kept at {out}"
        ) from None


class GateStop(Exception):
    def __init__(self, status: str, detail: str):
        super().__init__(detail)
        self.status, self.detail = status, detail


# --------------------------------------------------------------------------------------------- round
def _progress(round_dir: Path) -> dict[str, Any]:
    p = round_dir / "progress.json"
    return json.loads(p.read_text()) if p.exists() else {}


def _stage_params(
    stage: str, cfg: HermesConfig, params_path: str, rd: Path, parent: str, state: FlywheelState, n: int
) -> dict[str, Any]:
    runs = Path(cfg.round.runs_dir)
    # the config file as load_config found it (absolute): the kernels' cwd is not the user's
    common = {"config_path": cfg.source or params_path, "round_dir": str(rd), "parent_run_id": parent}
    champion = state.champion_adapter or ""
    if stage == "execute":
        return common | {"adapter": champion, "seed": n}
    if stage == "prep":
        inputs = [str(rd / "trajectories.jsonl")]
        prev_ab = runs / f"round-{n - 1:02d}" / "ab" / "requests.jsonl"
        if prev_ab.exists():  # the last round's A/B traffic logs: execution logs of both policies
            inputs.append(str(prev_ab))
        return common | {
            "trajectories": ",".join(inputs),
            "state_path": str(state_path(runs)),
            "simulated_now": state.simulated_now or "",
        }
    if stage == "review":
        return common | {"labels_path": str(runs / "review" / "labels.jsonl")}
    if stage == "train":
        return common | {"start_adapter": champion}
    # one baseline for both gates (issue #14): empty -> the notebooks resolve it with validate.resolve_baseline
    # (champion, else model.adapter, else the bare base), the regression gate and the A/B stage alike
    if stage == "validate":
        return common | {"baseline_adapter": ""}
    if stage == "ab":
        return common | {"baseline": "", "candidate": str(rd / "train" / "adapter"), "seed": n}
    return common


def _round_dir(runs: Path, n: int) -> Path:
    return runs / f"round-{n:02d}"


def run_round(params_path: str, resume: bool = False, quiet: bool = False) -> RoundResult:
    """One round: every stage notebook in order, then promotion or rollback."""
    import mlflow

    from hermes_lab import tracking

    cfg = load_config(params_path)
    runs = Path(cfg.round.runs_dir)
    with RoundLock(runs):
        sp = state_path(runs)
        state = FlywheelState.load(sp)
        n = state.last_round + 1
        rd = _round_dir(runs, n)
        prog = _progress(rd)
        if prog and not resume:
            raise RoundError(
                f"{rd} holds an unfinished round ({prog.get('status')}, stages done: "
                f"{prog.get('completed')}); continue it with --resume or remove the folder"
            )
        if resume and not prog:
            raise RoundError(f"nothing to resume: {rd} has no progress.json")
        if prog:
            prog["status"] = "running"
        rd.mkdir(parents=True, exist_ok=True)
        if cfg.model.base_model == "embedded:tiny" and not quiet:
            _report_tiny(cfg)
        if state.simulated_now is None and cfg.round.simulated_clock:
            state.simulated_now = SimulatedClock().now().isoformat()
        state.save(sp)  # stage notebooks read the simulated clock and the negatives from it
        tracking.setup(runs, cfg.round.experiment)
        if not prog:
            run = mlflow.start_run(run_name=f"round-{n:02d}", tags={"hermes.round": str(n)})
            prog = {
                "round": n,
                "parent_run_id": run.info.run_id,
                "completed": [],
                "timings": {},
                "status": "running",
                "params": params_path,
            }
            mlflow.log_params(
                tracking.safe_params(
                    {"round.params": params_path, "round.number": n, "round.champion": state.champion_adapter or "base"}
                )
            )
            mlflow.end_run()
            write_json_atomic(rd / "progress.json", prog)
        parent = prog["parent_run_id"]
        status, decision = "running", None
        for stage, nb in STAGES:
            if stage in prog["completed"]:
                continue
            t0 = time.time()
            if not quiet:
                print(f"[round {n:02d}] {stage:8s} ({nb}) ...", flush=True)
            try:
                run_notebook(nb, rd / nb, _stage_params(stage, cfg, params_path, rd, parent, state, n))
            except GateStop as g:
                status = g.status
                if stage == "review" and _read(rd / "review" / "gate.json").get("status") == "blocked":
                    status = "blocked: reward model disagrees with reviewers"
                prog["timings"][stage] = round(time.time() - t0, 1)
                prog["stopped_at"] = {"stage": stage, "detail": g.detail}
                break
            except RoundError:
                prog["status"] = "failed"
                prog["timings"][stage] = round(time.time() - t0, 1)
                write_json_atomic(rd / "progress.json", prog)
                _log_notebook(parent, rd / nb)
                raise
            prog["completed"].append(stage)
            prog["timings"][stage] = round(time.time() - t0, 1)
            write_json_atomic(rd / "progress.json", prog)
            if stage == "prep":  # the negatives are now in this round's prompt set: don't carry them twice
                state.negative_files = []
            if stage == "train":  # the cooldown counts from the training, whatever the A/B says
                state.last_train_time = (state.clock(cfg.round.simulated_clock).now()).isoformat()
            state.save(sp)
        else:
            status = "completed"
        summary = _finish(cfg, state, rd, n, prog, status)
        decision = summary.get("decision")
        # awaiting review: the same round continues (--resume) once the labels are in
        prog["status"] = "awaiting review" if status == "awaiting review" else "done"
        write_json_atomic(rd / "progress.json", prog)
        if status != "awaiting review":
            state.last_round = n
        state.history.append(
            {"round": n, "status": summary["status"], "decision": decision, "pass_rate": summary.get("pass_rate")}
        )
        state.save(sp)
        with mlflow.start_run(run_id=parent):
            for nb_path in sorted(rd.glob("*.ipynb")):
                mlflow.log_artifact(str(nb_path), artifact_path="notebooks")
            mlflow.log_artifact(str(rd / "summary.json"))
            mlflow.set_tags(
                {
                    "round.status": summary["status"],
                    "round.decision": decision or "",
                    **{f"gate.{g['gate']}": "pass" if g["passed"] else "stop" for g in summary["gates"]},
                }
            )
            if summary.get("pass_rate") is not None:
                mlflow.log_metric("champion.pass_rate", summary["pass_rate"])
            mlflow.log_metrics({f"time.{k}": v for k, v in prog["timings"].items()})
        if not quiet:
            print_summary(summary)
        return RoundResult(n, rd, summary["status"], decision, summary)


def _report_tiny(cfg: HermesConfig) -> None:
    """Build (or reuse) the embedded policy and say how good the base is: GRPO's starting point."""
    from hermes_lab.policy import build_tiny_policy

    d = build_tiny_policy(cfg.round.runs_dir, cfg.model.seed)
    rep = _read(d / "build.json")
    fams = ", ".join(f"{f} {v['pass_rate']:.0%}" for f, v in rep.get("per_family", {}).items())
    print(
        f"base policy {d} ({rep.get('parameters', 0):,} parameters): sampled pass rate at T=0.9 on held-out "
        f"tasks {rep.get('pass_rate', 0):.1%} ({fams}); report in {d / 'build.json'}",
        flush=True,
    )


def _log_notebook(parent: str, path: Path) -> None:
    import mlflow

    if path.exists():
        with mlflow.start_run(run_id=parent):
            mlflow.log_artifact(str(path), artifact_path="notebooks")
            mlflow.set_tag("round.status", "failed")


def _read(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}


def _finish(
    cfg: HermesConfig, state: FlywheelState, rd: Path, n: int, prog: dict[str, Any], status: str
) -> dict[str, Any]:
    """Collect the gates, apply the A/B decision (promote / roll back), write summary.json."""
    prep = _read(rd / "prep" / "summary.json")
    review = _read(rd / "review" / "gate.json")
    health = _read(rd / "train" / "health.json")
    regression = _read(rd / "validate" / "regression.json")
    ab = _read(rd / "ab" / "ab_report.json")
    ev = _read(rd / "train" / "eval.json")
    gates = [
        {"gate": g.get("name"), "passed": g.get("passed"), "detail": g.get("detail")} for g in prep.get("gates", [])
    ]
    if review:
        gates.append(
            {"gate": "review_agreement", "passed": review.get("status") == "pass", "detail": review.get("message")}
        )
    if "train" in prog["completed"]:
        gates.append(
            {
                "gate": "training_health",
                "passed": True,
                "detail": "; ".join(health.get("warnings", [])) or "no warnings",
            }
        )
    if regression:
        gates.append(
            {
                "gate": "regression",
                "passed": regression.get("passed"),
                "detail": "; ".join(regression.get("reasons", [])) or "no family regressed",
            }
        )
    decision = ab.get("decision") if ab else None
    promoted = bool(ab.get("promoted")) if ab else False  # only a rollout that reached 100% (issue #14)
    if ab:
        detail = f"{decision} (final ratio {ab.get('final_ratio')})" if decision == "widen" else decision
        gates.append({"gate": "ab_decision", "passed": promoted, "detail": detail})
    if status == "completed":
        status = (
            "promoted" if promoted else "rolled back" if decision == "roll back" else f"candidate held ({decision})"
        )
    if promoted:
        state.champion_adapter = str(rd / "train" / "adapter")
        state.champion_round = n
        _register_champion(cfg, rd)
    elif decision == "roll back" or (status.startswith("stopped") and "train" in prog["completed"]):
        # a rejected candidate: its round's data is fuel for the next round, as negatives
        state.negative_rounds.append(n)
        for f in (rd / "trajectories.jsonl", rd / "ab" / "requests.jsonl"):
            if f.exists():
                state.negative_files.append(str(f))
    # the champion's held-out sampled pass rate on the train stage's fixed task set (same tasks and seed
    # every round, so rounds compare): the candidate's if it was promoted, else the policy it started from
    pass_rate = (ev.get("after") if promoted else ev.get("before") or {}).get("pass_rate") if ev else None
    summary = {
        "round": n,
        "status": status,
        "decision": decision,
        "gates": gates,
        "timings_s": prog["timings"],
        "total_s": round(sum(prog["timings"].values()), 1),
        "pass_rate": pass_rate,
        "eval": ev,
        "champion": state.champion_adapter,
        "stopped_at": prog.get("stopped_at"),
        "parent_run_id": prog["parent_run_id"],
        "ab": {k: ab.get(k) for k in ("delta", "p_value", "significant", "decision", "promoted", "final_ratio")}
        if ab
        else None,
    }
    write_json_atomic(rd / "summary.json", summary)
    return summary


def _register_champion(cfg: HermesConfig, rd: Path) -> None:
    """Register the promoted adapter in the MLflow registry and point the 'champion' alias at it."""
    import mlflow
    from mlflow import MlflowClient

    run_id = _read(rd / "train" / "run.json").get("mlflow_run_id")
    if not run_id:
        return
    client, name = MlflowClient(), cfg.round.registered_model
    if not client.search_registered_models(filter_string=f"name = '{name}'"):
        client.create_registered_model(
            name, description="hermes-lab policies (LoRA adapters); alias 'champion' is live"
        )
    # a plain artifact version (MLflow 3's register_model wants a logged model; the adapter is a PEFT folder)
    source = f"{mlflow.get_run(run_id).info.artifact_uri}/adapter"
    mv = client.create_model_version(name, source=source, run_id=run_id, tags={"round": rd.name})
    client.set_registered_model_alias(name, "champion", mv.version)


def print_summary(s: dict[str, Any]) -> None:
    print(f"\nround {s['round']:02d}: {s['status']}  (decision: {s['decision']}, {s['total_s']} s)")
    for g in s["gates"]:
        mark = "PASS" if g["passed"] else "STOP"
        print(f"  {mark}  {g['gate']:18s} {str(g['detail'])[:110]}")
    print("  where the time went: " + ", ".join(f"{k} {v:.0f}s" for k, v in s["timings_s"].items()))
    if s.get("eval"):
        e = s["eval"]
        print(f"  held-out sampled pass rate: {e['before']['pass_rate']:.1%} -> {e['after']['pass_rate']:.1%}")


# ------------------------------------------------------------------------------------------ flywheel
def advance_clock(params_path: str, hours: float) -> None:
    cfg = load_config(params_path)
    sp = state_path(cfg.round.runs_dir)
    state = FlywheelState.load(sp)
    clock = SimulatedClock(parse_time(state.simulated_now) or SimulatedClock().now())
    state.simulated_now = clock.advance(hours=hours).isoformat()
    state.save(sp)


def flywheel(params_path: str, rounds: int) -> list[RoundResult]:
    """Rounds back to back on the simulated clock: after each, the clock moves past the cooldown."""
    cfg = load_config(params_path)
    if not cfg.round.simulated_clock:
        raise RoundError("flywheel needs round.simulated_clock: true (a real clock would wait out the cooldown)")
    results = []
    for _ in range(rounds):
        results.append(run_round(params_path))
        advance_clock(params_path, cfg.data.cooldown_hours + 1)
    print("\nflywheel: held-out sampled pass rate of the champion after each round")
    for r in results:
        pr = r.summary.get("pass_rate")
        print(f"  round {r.round_no:02d}  {r.status:28s} {'' if pr is None else f'{pr:.1%}'}")
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
    pending = cfg.execute.num_tasks  # the embedded execute stage produces these each round
    prev_ab = runs / f"round-{state.last_round:02d}" / "ab" / "requests.jsonl"
    if prev_ab.exists():
        with open(prev_ab, encoding="utf-8") as f:
            pending += sum(1 for _ in f)
    if pending < cfg.data.min_samples:
        reasons.append(f"samples: {pending} of {cfg.data.min_samples} new samples")
    unfinished = _progress(_round_dir(runs, state.last_round + 1))
    if unfinished.get("status") == "awaiting review":
        reasons.append(
            f"review pending: open notebooks/review.ipynb and label the queue of round "
            f"{state.last_round + 1}, then hermes-lab round --resume"
        )
    elif unfinished.get("status") in {"running", "failed"}:
        reasons.append(
            f"round {state.last_round + 1} is unfinished ({unfinished['status']}): hermes-lab round --resume"
        )
    return {
        "due": not reasons,
        "reasons": reasons,
        "last_round": state.last_round,
        "champion": state.champion_adapter or "base",
        "now": now.isoformat(),
        "pending_samples": pending,
    }


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
    return (
        0
        if r.status in {"promoted", "rolled back"}
        or r.status.startswith(("candidate held", "skipped"))
        or r.status == "awaiting review"
        else 4
    )


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
    return 0 if s["due"] else 3


add_arguments, run_cli = add_arguments_round, run_cli_round


def main(argv: list[str] | None = None) -> int:
    from hermes_lab.cli import run_module

    return run_module("hermes_lab.round", add_arguments_round, run_cli_round, argv, description=__doc__.split("\n")[0])


if __name__ == "__main__":
    sys.exit(main())
