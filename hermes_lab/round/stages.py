"""The stage registry: one row per round stage, read by the round runner, the CLI, status, compare and tests.

Reads and writes nothing itself: a gated stage writes its verdict (``runs/round-NN/<stage>/verdict.json``)
through ``hermes_lab.core.verdict``, and the runner reads it back. Adding a stage to a round is one ``Stage``
row below, its inputs declared in ``hermes_lab.core.inputs`` (the notebook's parameters, the command's
arguments), one notebook in ``notebooks/`` and one module in a stage package: the runner runs the rows in
order, passes the parameters the row builds (checked against its inputs), lists the row's gates in every
round summary, and stops the round when the stage's verdict says so; ``hermes-lab <command>`` comes from the
row's ``command``. A verdict may also carry ``candidate`` (the A/B outcome: decision, promoted, rolled_back,
delta, p_value, significant) and ``eval`` (held-out pass rate before/after training), which the round summary
reports.

    python -c "from hermes_lab.round.stages import STAGES; print([s.name for s in STAGES])"
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hermes_lab.core import inputs as stage_inputs
from hermes_lab.core.inputs import ROUND_INPUTS, Inputs
from hermes_lab.core.layout import RoundLayout, RunsLayout
from hermes_lab.core.reports import RoundSummary
from hermes_lab.core.verdict import (
    STOP_AUDIT,
    STOP_AWAITING_LIVE,
    STOP_AWAITING_REVIEW,
    STOP_BLOCKED_REVIEW,
    STOP_DATA,
    STOP_HEALTH,
    STOP_NO_SIGNAL,
    STOP_REGRESSION,
    read_verdict,
)

if TYPE_CHECKING:  # pragma: no cover
    from hermes_lab.config.schema import HermesConfig
    from hermes_lab.core.state import FlywheelState


@dataclass(frozen=True)
class RoundContext:
    """What a stage's parameters are built from."""

    cfg: HermesConfig
    params_path: str
    round_dir: Path
    round_no: int
    parent_run_id: str
    state: FlywheelState

    @property
    def runs_dir(self) -> Path:
        return Path(self.cfg.round.runs_dir)

    @property
    def champion(self) -> str:
        return self.state.champion_adapter or ""

    def round_dir_of(self, n: int) -> Path:
        return RunsLayout(self.runs_dir).round_dir(n)

    @property
    def continues(self) -> dict[str, Any] | None:
        """The held experiment this round continues (``round.on_held: continue``), or None."""
        return (self.state.progress or {}).get("continues")


def _no_params(ctx: RoundContext) -> dict[str, Any]:
    return {}


# What a kernel that loads a policy imports (~6 s of CPU): the zygote that forks the round's kernels imports it
# once, for the first of those stages (hermes_lab.core.kernels). One list for the four, not one per stage: the
# pieces one of them does not need (the execute kernel's TRL trainer) cost ~1 s once, and a list per stage
# would go stale as the modules change. A module missing here is only imported by the kernel itself.
POLICY_IMPORTS = (
    "torch",
    "transformers.modeling_utils",
    "peft",
    "datasets",
    "trl.chat_template_utils",
    "trl.trainer.grpo_trainer",
)


@dataclass(frozen=True)
class Stage:
    """One stage of a round. ``notebook`` is relative to notebooks/ (or absolute); ``verdict`` is relative
    to the round dir; ``inputs`` declares the notebook's parameters and the command's arguments
    (``hermes_lab.core.inputs``), ``params`` gives the values the round passes."""

    name: str
    notebook: str
    module: str
    verdict: str | None = None
    gates: tuple[str, ...] = ()  # gate names the verdict reports, in summary order
    stops: tuple[str, ...] = ()  # statuses the verdict may stop the round with
    params: Callable[[RoundContext], dict[str, Any]] = _no_params  # values beyond the round's three (core.inputs)
    inputs: Inputs = ROUND_INPUTS
    command: str | None = None  # `hermes-lab <command>` (module's add_arguments / run_cli)
    help: str = ""
    data_outputs: tuple[str, ...] = ()  # the round's execution data it writes: negatives on a rollback
    starts_cooldown: bool = False  # completing it is a training: the cooldown counts from here
    consumes_negatives: bool = False  # completing it has used state.negative_files
    on_continue: bool = False  # runs in a round that continues a held A/B (round.on_held: continue); others skip
    preload: tuple[str, ...] = ()  # heavy modules its kernel imports, imported once for the round's kernels
    live_preload: bool = True  # ab.mode live: its kernel still imports them (the live A/B reads logs only)


# -------------------------------------------------------------------------------- parameter builders
def _execute_params(ctx: RoundContext) -> dict[str, Any]:
    return {"adapter": ctx.champion, "seed": ctx.round_no}


def fresh_data(runs_dir: str | Path, round_no: int) -> list[Path]:
    """A round's new samples: everything logged since the last round that reached training. That is its own
    execution log and the previous round's A/B traffic (the execution logs of both policies), and, while
    the rounds before stopped at the data gate (too few samples, the cooldown, no learning signal) or only
    continued a held A/B (``round.on_held: continue``), their logs as well: samples pile up until they trigger
    a training, none is dropped by a skipped round."""
    runs = RunsLayout(runs_dir)
    rd = runs.round(round_no)
    out = [rd.trajectories]
    if rd.agent_episodes.exists():  # execute.agent_tasks: conversations
        out.append(rd.agent_episodes)
    for k in range(round_no - 1, 0, -1):
        prev = runs.round(k)
        if prev.ab.requests.exists():
            out.append(prev.ab.requests)
        verdict = read_verdict(prev.prep.verdict)
        if _continued_only(prev.root):  # it ran no prep: what came before it is still fresh
            continue
        # round k trained on what came before it; one stopped for no learning signal did not (feedback may come)
        if not verdict or verdict.get("stop") not in (STOP_DATA, STOP_NO_SIGNAL):
            break
        if prev.trajectories.exists():
            out.append(prev.trajectories)
    return out


def _continued_only(round_dir: Path) -> bool:
    """Whether a round only continued an earlier round's held A/B (its summary says which)."""
    summary = RoundSummary.read(RoundLayout(round_dir).summary)
    return bool(summary is not None and summary.continues)


def _prep_params(ctx: RoundContext) -> dict[str, Any]:
    from hermes_lab.core.state import state_path

    return {
        "trajectories": ",".join(str(p) for p in fresh_data(ctx.runs_dir, ctx.round_no)),
        "state_path": str(state_path(ctx.runs_dir)),
        "simulated_now": ctx.state.simulated_now or "",
    }


def _review_params(ctx: RoundContext) -> dict[str, Any]:
    return {"labels_path": str(RunsLayout(ctx.runs_dir).labels)}


def _train_params(ctx: RoundContext) -> dict[str, Any]:
    return {"start_adapter": ctx.champion}


# one baseline for both gates (issue #14): empty, so that both notebooks resolve it the same way with
# policy.arms.resolve_baseline (champion, else model.adapter, else the bare base)
def _validate_params(ctx: RoundContext) -> dict[str, Any]:
    return {"baseline_adapter": ""}


def _ab_params(ctx: RoundContext) -> dict[str, Any]:
    held = ctx.continues
    if held:  # the held round's candidate and A/B, carried on (hermes_lab.ab.held)
        return {"baseline": "", "candidate": held["adapter"], "seed": ctx.round_no, "continue_from": held["ab_dir"]}
    return {"baseline": "", "candidate": str(RoundLayout(ctx.round_dir).train.adapter), "seed": ctx.round_no}


# ---------------------------------------------------------------------------------------- the rows
_IN_ROUND = RoundLayout(Path())  # the rows' files, relative to a round dir (core.layout)
STAGES: tuple[Stage, ...] = (
    Stage(
        "execute",
        "00_execute.ipynb",
        "hermes_lab.agents.execute",
        preload=POLICY_IMPORTS,
        params=_execute_params,
        inputs=stage_inputs.EXECUTE,
        command="execute",
        help="Run a policy on tasks and write trajectories JSONL (execution logs).",
        data_outputs=(str(_IN_ROUND.trajectories),),
    ),
    Stage(
        "prep",
        "10_data_prep.ipynb",
        "hermes_lab.prep.run",
        verdict=str(_IN_ROUND.prep.verdict),
        gates=("min_samples", "cooldown", "learning_signal"),
        stops=(STOP_DATA, STOP_NO_SIGNAL),
        params=_prep_params,
        inputs=stage_inputs.PREP,
        command="prep",
        help="Ingest, validate and distill trajectories; apply the data gates and the learning-signal gate.",
        consumes_negatives=True,
    ),
    Stage(
        "review",
        "15_review_gate.ipynb",
        "hermes_lab.review.gate",
        verdict=str(_IN_ROUND.review.verdict),
        gates=("review_agreement",),
        stops=(STOP_AWAITING_REVIEW, STOP_BLOCKED_REVIEW),
        params=_review_params,
        inputs=stage_inputs.REVIEW,
        command="review",
        help="Reward-model agreement gate over the human review labels.",
    ),
    Stage(
        "audit",
        "18_reward_audit.ipynb",
        "hermes_lab.rewards.audit",
        verdict=str(_IN_ROUND.audit.verdict),
        gates=("reward_audit",),
        stops=(STOP_AUDIT,),
        inputs=stage_inputs.AUDIT,
        command="audit",
        help="Score built-in adversarial completions with every configured reward; stop before training if one pays.",
    ),
    Stage(
        "train",
        "20_grpo_train.ipynb",
        "hermes_lab.train.grpo",
        preload=POLICY_IMPORTS,
        verdict=str(_IN_ROUND.train.verdict),
        gates=("training_health",),
        stops=(STOP_HEALTH,),
        params=_train_params,
        inputs=stage_inputs.TRAIN,
        command="train",
        help="GRPO + LoRA training from the user's YAML.",
        starts_cooldown=True,
    ),
    Stage(
        "validate",
        "30_inspect_validate.ipynb",
        "hermes_lab.evaluate.validate",
        preload=POLICY_IMPORTS,
        verdict=str(_IN_ROUND.validate.verdict),
        gates=("regression",),
        stops=(STOP_REGRESSION,),
        params=_validate_params,
        inputs=stage_inputs.VALIDATE,
        command="validate",
        help="Regression gate: candidate vs baseline on the held-out set.",
    ),
    Stage(
        "ab",
        "40_ab_analysis.ipynb",
        "hermes_lab.ab.run",
        preload=POLICY_IMPORTS,  # the simulated A/B generates with both policies
        live_preload=False,  # the live one reads the gateway's log: a live round's deciding worker imports no torch
        verdict=str(_IN_ROUND.ab.verdict),
        gates=("ab_decision",),
        stops=(STOP_AWAITING_LIVE,),  # ab.mode live (hermes_lab.live.round)
        params=_ab_params,
        inputs=stage_inputs.AB,
        command="ab-run",
        help="Run the staged A/B rollout and write ab_report.json.",
        data_outputs=(str(_IN_ROUND.ab.requests), str(_IN_ROUND.ab.live_trajectories)),  # simulated / live traffic
        on_continue=True,
    ),
    # last, so that its table includes this round
    Stage(
        "compare", "50_round_compare.ipynb", "hermes_lab.round.compare", on_continue=True, inputs=stage_inputs.COMPARE
    ),
)


def stage(name: str, stages: Sequence[Stage] = STAGES) -> Stage:
    for s in stages:
        if s.name == name:
            return s
    raise KeyError(f"no stage '{name}'; stages: {', '.join(s.name for s in stages)}")


def all_gates(stages: Sequence[Stage] = STAGES) -> list[tuple[str, str]]:
    """(stage, gate) in round order: every round summary lists exactly these."""
    return [(s.name, g) for s in stages for g in s.gates]
