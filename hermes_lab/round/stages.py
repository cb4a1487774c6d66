"""The stage registry: one row per round stage, read by the round runner, the CLI, status, compare and tests.

Reads and writes nothing itself: a gated stage writes its verdict (``runs/round-NN/<stage>/verdict.json``)
through ``hermes_lab.core.verdict``, and the runner reads it back. Adding a stage to a round is one ``Stage``
row below, one notebook in ``notebooks/`` and one module in a stage package: the runner runs the rows in
order, passes the parameters the row builds, lists the row's gates in every round summary, and stops the
round when the stage's verdict says so; ``hermes-lab <command>`` comes from the row's ``command``. A verdict
may also carry ``candidate`` (the A/B outcome: decision, promoted, rolled_back, delta, p_value, significant)
and ``eval`` (held-out pass rate before/after training), which the round summary reports.

    python -c "from hermes_lab.round.stages import STAGES; print([s.name for s in STAGES])"
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hermes_lab.core.verdict import (
    STOP_AUDIT,
    STOP_AWAITING_LIVE,
    STOP_AWAITING_REVIEW,
    STOP_BLOCKED_REVIEW,
    STOP_DATA,
    STOP_HEALTH,
    STOP_REGRESSION,
    VERDICT_NAME,
    read_verdict,
)

if TYPE_CHECKING:  # pragma: no cover
    from hermes_lab.config.schema import HermesConfig
    from hermes_lab.core.state import FlywheelState

ROUND_PARAMS = ("config_path", "round_dir", "parent_run_id")  # every stage notebook takes these


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
        return self.runs_dir / f"round-{n:02d}"

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
    to the round dir; ``notebook_params`` lists the notebook's parameters cell in order (a test pins it)."""

    name: str
    notebook: str
    module: str
    verdict: str | None = None
    gates: tuple[str, ...] = ()  # gate names the verdict reports, in summary order
    stops: tuple[str, ...] = ()  # statuses the verdict may stop the round with
    params: Callable[[RoundContext], dict[str, Any]] = _no_params  # beyond ROUND_PARAMS
    notebook_params: tuple[str, ...] = ROUND_PARAMS
    command: str | None = None  # `hermes-lab <command>` (module's add_arguments / run_cli)
    help: str = ""
    data_outputs: tuple[str, ...] = ()  # the round's execution data it writes: negatives on a rollback
    starts_cooldown: bool = False  # completing it is a training: the cooldown counts from here
    consumes_negatives: bool = False  # completing it has used state.negative_files
    on_continue: bool = False  # runs in a round that continues a held A/B (round.on_held: continue); others skip
    preload: tuple[str, ...] = ()  # heavy modules its kernel imports, imported once for the round's kernels


# -------------------------------------------------------------------------------- parameter builders
def _execute_params(ctx: RoundContext) -> dict[str, Any]:
    return {"adapter": ctx.champion, "seed": ctx.round_no}


def fresh_data(runs_dir: str | Path, round_no: int) -> list[Path]:
    """A round's new samples: everything logged since the last round that reached training. That is its own
    execution log and the previous round's A/B traffic (the execution logs of both policies), and, while
    the rounds before stopped at the data gate (too few samples, or the cooldown) or only continued a held
    A/B (``round.on_held: continue``), their logs as well: samples pile up until they trigger a training,
    none is dropped by a skipped round."""
    runs = Path(runs_dir)
    out = [runs / f"round-{round_no:02d}" / "trajectories.jsonl"]
    if (runs / f"round-{round_no:02d}" / "agent_episodes.jsonl").exists():  # execute.agent_tasks: conversations
        out.append(runs / f"round-{round_no:02d}" / "agent_episodes.jsonl")
    for k in range(round_no - 1, 0, -1):
        prev = runs / f"round-{k:02d}"
        if (prev / "ab" / "requests.jsonl").exists():
            out.append(prev / "ab" / "requests.jsonl")
        verdict = read_verdict(prev / "prep" / VERDICT_NAME)
        if _continued_only(prev):  # it ran no prep: what came before it is still fresh
            continue
        if not verdict or verdict.get("stop") != STOP_DATA:  # round k trained on what came before it
            break
        if (prev / "trajectories.jsonl").exists():
            out.append(prev / "trajectories.jsonl")
    return out


def _continued_only(round_dir: Path) -> bool:
    """Whether a round only continued an earlier round's held A/B (its summary says which)."""
    import json

    try:
        return bool(json.loads((round_dir / "summary.json").read_text(encoding="utf-8")).get("continues"))
    except (FileNotFoundError, ValueError, AttributeError):
        return False


def _prep_params(ctx: RoundContext) -> dict[str, Any]:
    from hermes_lab.core.state import state_path

    return {
        "trajectories": ",".join(str(p) for p in fresh_data(ctx.runs_dir, ctx.round_no)),
        "state_path": str(state_path(ctx.runs_dir)),
        "simulated_now": ctx.state.simulated_now or "",
    }


def _review_params(ctx: RoundContext) -> dict[str, Any]:
    return {"labels_path": str(ctx.runs_dir / "review" / "labels.jsonl")}


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
    return {"baseline": "", "candidate": str(ctx.round_dir / "train" / "adapter"), "seed": ctx.round_no}


# ---------------------------------------------------------------------------------------- the rows
STAGES: tuple[Stage, ...] = (
    Stage(
        "execute",
        "00_execute.ipynb",
        "hermes_lab.data.execute",
        preload=POLICY_IMPORTS,
        params=_execute_params,
        notebook_params=(*ROUND_PARAMS, "adapter", "seed"),
        command="execute",
        help="Run a policy on tasks and write trajectories JSONL (execution logs).",
        data_outputs=("trajectories.jsonl",),
    ),
    Stage(
        "prep",
        "10_data_prep.ipynb",
        "hermes_lab.data.prep",
        verdict=f"prep/{VERDICT_NAME}",
        gates=("min_samples", "cooldown"),
        stops=(STOP_DATA,),
        params=_prep_params,
        notebook_params=(
            *ROUND_PARAMS,
            "trajectories",
            "state_path",
            "simulated_now",
            "override_cooldown",
            "override_reason",
        ),
        command="prep",
        help="Ingest, validate and distill trajectories; apply the data gates.",
        consumes_negatives=True,
    ),
    Stage(
        "review",
        "15_review_gate.ipynb",
        "hermes_lab.review.gate",
        verdict=f"review/{VERDICT_NAME}",
        gates=("review_agreement",),
        stops=(STOP_AWAITING_REVIEW, STOP_BLOCKED_REVIEW),
        params=_review_params,
        notebook_params=(*ROUND_PARAMS, "labels_path", "queue_path", "simulate"),
        command="review",
        help="Reward-model agreement gate over the human review labels.",
    ),
    Stage(
        "audit",
        "18_reward_audit.ipynb",
        "hermes_lab.rewards.audit",
        verdict=f"audit/{VERDICT_NAME}",
        gates=("reward_audit",),
        stops=(STOP_AUDIT,),
        command="audit",
        help="Score built-in adversarial completions with every configured reward; stop before training if one pays.",
    ),
    Stage(
        "train",
        "20_grpo_train.ipynb",
        "hermes_lab.train.grpo",
        preload=POLICY_IMPORTS,
        verdict=f"train/{VERDICT_NAME}",
        gates=("training_health",),
        stops=(STOP_HEALTH,),
        params=_train_params,
        notebook_params=(*ROUND_PARAMS, "data_dir", "start_adapter", "max_steps", "resume"),
        command="train",
        help="GRPO + LoRA training from the user's YAML.",
        starts_cooldown=True,
    ),
    Stage(
        "validate",
        "30_inspect_validate.ipynb",
        "hermes_lab.evaluate.validate",
        preload=POLICY_IMPORTS,
        verdict=f"validate/{VERDICT_NAME}",
        gates=("regression",),
        stops=(STOP_REGRESSION,),
        params=_validate_params,
        notebook_params=(*ROUND_PARAMS, "train_dir", "compare_rounds", "baseline_adapter"),
        command="validate",
        help="Regression gate: candidate vs baseline on the held-out set.",
    ),
    Stage(
        "ab",
        "40_ab_analysis.ipynb",
        "hermes_lab.ab.run",
        preload=POLICY_IMPORTS,
        verdict=f"ab/{VERDICT_NAME}",
        gates=("ab_decision",),
        stops=(STOP_AWAITING_LIVE,),  # ab.mode live (hermes_lab.live.round)
        params=_ab_params,
        notebook_params=(*ROUND_PARAMS, "baseline", "candidate", "duration", "seed", "continue_from"),
        command="ab-run",
        help="Run the staged A/B rollout and write ab_report.json.",
        data_outputs=("ab/requests.jsonl", "ab/live_trajectories.jsonl"),  # simulated / live traffic
        on_continue=True,
    ),
    # last, so that its table includes this round
    Stage("compare", "50_round_compare.ipynb", "hermes_lab.round.compare", on_continue=True),
)


def stage(name: str, stages: Sequence[Stage] = STAGES) -> Stage:
    for s in stages:
        if s.name == name:
            return s
    raise KeyError(f"no stage '{name}'; stages: {', '.join(s.name for s in stages)}")


def all_gates(stages: Sequence[Stage] = STAGES) -> list[tuple[str, str]]:
    """(stage, gate) in round order: every round summary lists exactly these."""
    return [(s.name, g) for s in stages for g in s.gates]
