"""The map of ``runs/``: every file and folder a round, a live experiment and the flywheel write, named once.

Reads and writes nothing itself. A stage, the runner, compare, status, the supervisor, the gateway and the
data readers ask these objects for a path instead of joining literal names, so a file is renamed here or
nowhere (tests/core/test_layout.py fails on a round file's literal name anywhere else in ``hermes_lab/``)::

    runs/                                  RunsLayout(runs_dir)
      state.json  mlflow.db  mlartifacts/  .state .mlflow_db .mlartifacts (core.state, core.tracking)
      policies/<name>/build.json           .policies, PolicyLayout (policy.model's built tiny policies)
      review/labels.jsonl                  .labels (review.labels' store, every round's)
      cache/judge.jsonl  cache/champion-vN .judge_cache, .champion_cache(n)
      round-NN/                            .round(n) -> RoundLayout
        trajectories.jsonl                 .trajectories (agents.execute; logs.gateway when live: its join in live/)
        agent_episodes.jsonl               .agent_episodes (the agent family's conversations)
        hermes/                            .hermes -> PlayLayout (agent.runner hermes: execute's): params.yaml
                                           gateway.out log/ (its server's) ws/ (the real agent's runs) join/
                                           (logs.gateway's join of log/: the turns' tokens)
        NN_<stage>.ipynb                   .notebook(name): the executed notebooks (names: round.stages)
        prep/                              .prep -> PrepLayout: grpo_dataset/ heldout_dataset/
                                           conversations/ accepted.jsonl (and the other sinks) review_queue.jsonl
                                           summary.json selection.json left_out.jsonl plots/ verdict.json
        review/                            .review -> ReviewLayout: gate.json agreement.png verdict.json
        audit/                             .audit -> AuditLayout: audit.json verdict.json
        train/                             .train -> TrainLayout: adapter/ train_log.jsonl samples.jsonl
                                           eval.json health.json run.json config.yaml data_gain.json
                                           trl/ (trl/hermes_resume.json) verdict.json; turns/ and
                                           episodes/ are TrainLayouts of their own (the same files)
        validate/                          .validate -> ValidateLayout: diagnostics.json regression.json plots/
                                           hermes/<arm>/ (.hermes(arm) -> PlayLayout, agent.runner hermes)
        ab/                                .ab -> ABLayout: requests.jsonl ab_report.json plots/ live/
                                           live_trajectories.jsonl verdict.json
        compare/                           .compare -> CompareLayout: its plots
        summary.json  progress.json        .summary (round.outcome), .progress (round.runner)
      live/<experiment>/                   .experiment(name) -> ExperimentLayout: requests.jsonl tools.jsonl
                                           feedback.jsonl experiment.json ab_report.json plots/
      live/flywheel/                       .flywheel -> FlywheelLayout: state.json status.json params.yaml
                                           round-NN.yaml round-NN.log

The shapes of three of these files are dataclasses: ``core.verdict.Verdict`` (a stage's verdict.json),
``core.reports.EvalReport`` (train/eval.json) and ``core.reports.RoundSummary`` (summary.json).

Names that are not the round's stay where they are used: third-party formats (HF / PEFT's
``adapter_config.json``, ``tokenizer_config.json``, ``config.json``, ``trainer_state.json`` and TRL's
``checkpoint-N/``), a Hermes Agent's own files (``logs.hermes_sessions``), JupyterLab's settings
(``cli.lab``), temporary files, MLflow artifact paths, and the stage's notebook names (``round.stages.STAGES``,
whose executed copy ``RoundLayout.notebook`` places). The stage names ("train", "prep") that MLflow metrics and
verdicts carry are the stages' (``round.stages``), not folder names. One exception: ``policy/model.py`` names
its ``policies/`` and ``build.json`` itself (``PolicyLayout`` for everyone else), because its source is hashed
into the tiny policy's build recipe and an edit there rebuilds the policy on every machine. The notebooks'
code cells use these objects too; their parameters cells keep plain defaults (``core.inputs``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# ------------------------------------------------------------------------------------------- names
VERDICT = "verdict.json"  # every gated stage's, in its folder (core.verdict)
_SUMMARY = "summary.json"
# a gateway log dir's files (live.log writes them, logs.gateway reads them: the names both import)
REQUESTS, FEEDBACK, TOOLS, EXPERIMENT = "requests.jsonl", "feedback.jsonl", "tools.jsonl", "experiment.json"
AB_REPORT = "ab_report.json"  # an A/B's report: in a round's ab/ and in a live log dir
_STATE = "state.json"
_PLOTS = "plots"
TRL_RESUME = "hermes_resume.json"  # in train/trl/ (train.state: named in its messages)

# a round's stage folders (the stage names of round.stages, as folders)
_STAGE_DIRS = ("prep", "review", "audit", "train", "validate", "ab", "compare")

# every literal file name of runs/: tests/core/test_layout.py finds none of them in hermes_lab/ outside this module
FILE_NAMES = (
    VERDICT,
    _SUMMARY,
    REQUESTS,
    FEEDBACK,
    TOOLS,
    EXPERIMENT,
    AB_REPORT,
    _STATE,
    "trajectories.jsonl",
    "agent_episodes.jsonl",
    "progress.json",
    "accepted.jsonl",
    "review_queue.jsonl",
    "selection.json",
    "left_out.jsonl",
    "reward_by_family.png",
    "rejects_by_reason.png",
    "selection_by_family.png",
    "conversations.png",
    "gate.json",
    "agreement.png",
    "audit.json",
    "train_log.jsonl",
    "samples.jsonl",
    "eval.json",
    "health.json",
    "run.json",
    "config.yaml",
    "data_gain.json",
    TRL_RESUME,
    "diagnostics.json",
    "regression.json",
    "live_trajectories.jsonl",
    "pass_rate_by_round.png",
    "rounds.png",
    "curves_by_round.png",
    "status.json",
    "params.yaml",
    "mlflow.db",
    "labels.jsonl",
    "judge.jsonl",
    "build.json",
)
# folder names joined as paths (``/ "train"``): the same test finds none of them joined outside this module
DIR_NAMES = (
    *_STAGE_DIRS,
    _PLOTS,
    "adapter",
    "trl",
    "turns",
    "episodes",
    "grpo_dataset",
    "heldout_dataset",
    "conversations",
    "live",
    "flywheel",
    "policies",
    "cache",
    "mlartifacts",
)


def round_name(n: int) -> str:
    """``round-NN``: a round's folder, and the name of its live experiment and flywheel files."""
    return f"round-{n:02d}"


def round_number(name: str) -> int | None:
    """NN of ``round-NN`` (a folder's name), None for another name."""
    head, _, num = name.partition("-")
    return int(num) if head == "round" and num.isdigit() else None


def stage_verdict(stage: str) -> str:
    """A stage's verdict file relative to its round dir (``<stage>/verdict.json``): ``round.stages``' rows."""
    return f"{stage}/{VERDICT}"


# ------------------------------------------------------------------------------------ a round's stages
@dataclass(frozen=True)
class _Dir:
    """A folder of runs/, by its path (a str is made a Path)."""

    root: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))


@dataclass(frozen=True)
class PrepLayout(_Dir):
    """``round-NN/prep/`` (prep.run: ingest then distill)."""

    def sink(self, name: str) -> Path:
        """A record sink of ingest (accepted, negatives, duplicates, rejects, outliers, review_queue)."""
        return self.root / f"{name}.jsonl"

    grpo_dataset = property(lambda self: self.root / "grpo_dataset")
    heldout_dataset = property(lambda self: self.root / "heldout_dataset")
    conversations = property(lambda self: self.root / "conversations")
    accepted = property(lambda self: self.root / "accepted.jsonl")
    review_queue = property(lambda self: self.root / "review_queue.jsonl")
    summary = property(lambda self: self.root / _SUMMARY)
    selection = property(lambda self: self.root / "selection.json")
    left_out = property(lambda self: self.root / "left_out.jsonl")
    plots = property(lambda self: self.root / _PLOTS)
    plot_rewards = property(lambda self: self.plots / "reward_by_family.png")
    plot_rejects = property(lambda self: self.plots / "rejects_by_reason.png")
    plot_selection = property(lambda self: self.plots / "selection_by_family.png")
    plot_conversations = property(lambda self: self.plots / "conversations.png")
    verdict = property(lambda self: self.root / VERDICT)


@dataclass(frozen=True)
class ReviewLayout(_Dir):
    """``round-NN/review/`` (review.gate)."""

    gate = property(lambda self: self.root / "gate.json")
    agreement = property(lambda self: self.root / "agreement.png")  # notebooks/15_review_gate.ipynb's plot
    verdict = property(lambda self: self.root / VERDICT)


@dataclass(frozen=True)
class AuditLayout(_Dir):
    """``round-NN/audit/`` (rewards.audit)."""

    report = property(lambda self: self.root / "audit.json")  # every adversarial completion, what each reward paid
    verdict = property(lambda self: self.root / VERDICT)


@dataclass(frozen=True)
class TrainLayout(_Dir):
    """``round-NN/train/`` (train.grpo) and its phases' ``turns/`` and ``episodes/``, which hold the same files.
    Any training output dir (``hermes-lab train --output``) has this layout."""

    adapter = property(lambda self: self.root / "adapter")
    train_log = property(lambda self: self.root / "train_log.jsonl")
    samples = property(lambda self: self.root / "samples.jsonl")
    eval = property(lambda self: self.root / "eval.json")  # core.reports.EvalReport (agent: episode success)
    # status, warnings; the tests reward's completions by kind, the judges' failures and fallbacks
    health = property(lambda self: self.root / "health.json")
    run = property(lambda self: self.root / "run.json")  # base model, adapter, steps, MLflow run; turns: the turn rows
    config = property(lambda self: self.root / "config.yaml")
    data_gain = property(lambda self: self.root / "data_gain.json")  # round.compare's
    trl = property(lambda self: self.root / "trl")  # TRL's output_dir: its checkpoint-N/ folders
    resume = property(lambda self: self.trl / TRL_RESUME)  # what those checkpoints were trained with
    verdict = property(lambda self: self.root / VERDICT)
    prep = property(lambda self: PrepLayout(self.root / "prep"))  # a JSONL given as --data, prepared here

    @property
    def turns(self) -> TrainLayout:
        return TrainLayout(self.root / "turns")

    @property
    def episodes(self) -> TrainLayout:
        return TrainLayout(self.root / "episodes")


@dataclass(frozen=True)
class ValidateLayout(_Dir):
    """``round-NN/validate/`` (evaluate.inspect, evaluate.validate)."""

    diagnostics = property(lambda self: self.root / "diagnostics.json")
    regression = property(lambda self: self.root / "regression.json")
    plots = property(lambda self: self.root / _PLOTS)
    verdict = property(lambda self: self.root / VERDICT)

    def hermes(self, arm: str) -> PlayLayout:
        """agent.runner hermes: the arm's policy as the real agent played it (``candidate``, ``baseline``)."""
        return PlayLayout(self.root / "hermes" / arm)


@dataclass(frozen=True)
class ExperimentLayout(_Dir):
    """A gateway's log dir, ``runs/live/<experiment>/`` (live.gateway, live.log, live.experiment, live.report),
    read by logs.gateway; a simulated A/B's ``round-NN/ab/`` holds the same requests and report."""

    # one record per turn: its conversation id, only its new messages, from in-process arms its tokens
    requests = property(lambda self: self.root / REQUESTS)
    tools = property(lambda self: self.root / TOOLS)
    feedback = property(lambda self: self.root / FEEDBACK)
    experiment = property(lambda self: self.root / EXPERIMENT)
    report = property(lambda self: self.root / AB_REPORT)
    plots = property(lambda self: self.root / _PLOTS)


@dataclass(frozen=True)
class PlayLayout(_Dir):
    """A policy played by the real Hermes Agent (agents.play): ``round-NN/hermes/`` (execute),
    ``round-NN/validate/hermes/<arm>/`` (validate)."""

    params = property(lambda self: self.root / "params.yaml")  # the config its server runs with
    output = property(lambda self: self.root / "gateway.out")  # its server's output
    log = property(lambda self: ExperimentLayout(self.root / "log"))  # its server's request log
    runs = property(lambda self: self.root / "ws")  # agents.hermes_loop.HermesLoop's folders, one per task
    join = property(lambda self: self.root / "join")  # logs.gateway's join of its log (execute: the turns' tokens)


@dataclass(frozen=True)
class ABLayout(ExperimentLayout):
    """``round-NN/ab/`` (ab.run + ab.report simulated, live.round live)."""

    live = property(lambda self: self.root / "live")  # logs.gateway's trajectories of the live experiment
    live_trajectories = property(lambda self: self.root / "live_trajectories.jsonl")
    verdict = property(lambda self: self.root / VERDICT)


@dataclass(frozen=True)
class CompareLayout(_Dir):
    """``round-NN/compare/`` (round.compare)."""

    pass_rate = property(lambda self: self.root / "pass_rate_by_round.png")
    rounds = property(lambda self: self.root / "rounds.png")
    curves = property(lambda self: self.root / "curves_by_round.png")


# ------------------------------------------------------------------------------------------ a round
@dataclass(frozen=True)
class RoundLayout(_Dir):
    """``runs/round-NN/``: built from the round dir (``RoundLayout(rd)``) or ``RunsLayout(runs).round(n)``."""

    number = property(lambda self: round_number(self.root.name))
    trajectories = property(lambda self: self.root / "trajectories.jsonl")
    # OpenAI chat conversations: execute.agent_tasks' episodes, or (live) the traffic's, per-turn tokens in meta.turns
    agent_episodes = property(lambda self: self.root / "agent_episodes.jsonl")
    hermes = property(lambda self: PlayLayout(self.root / "hermes"))  # execute's, with agent.runner hermes
    summary = property(lambda self: self.root / _SUMMARY)
    progress = property(lambda self: self.root / "progress.json")
    live = property(lambda self: self.root / "live")  # execute.source live: logs.gateway's join of the traffic
    prep = property(lambda self: PrepLayout(self.root / "prep"))
    review = property(lambda self: ReviewLayout(self.root / "review"))
    audit = property(lambda self: AuditLayout(self.root / "audit"))
    train = property(lambda self: TrainLayout(self.root / "train"))
    validate = property(lambda self: ValidateLayout(self.root / "validate"))
    ab = property(lambda self: ABLayout(self.root / "ab"))
    compare = property(lambda self: CompareLayout(self.root / "compare"))

    def notebook(self, name: str) -> Path:
        """The executed copy of a stage's notebook (``Stage.notebook``, relative to notebooks/ or absolute)."""
        return self.root / Path(name).name

    def notebooks(self) -> list[Path]:
        return sorted(self.root.glob("*.ipynb"))

    def runs(self) -> RunsLayout:
        return RunsLayout(self.root.parent)


# ------------------------------------------------------------------------------------- live and runs/
@dataclass(frozen=True)
class FlywheelLayout(_Dir):
    """``runs/live/flywheel/`` (round.supervisor, ``hermes-lab flywheel --live``)."""

    state = property(lambda self: self.root / _STATE)  # the experiment served, conversations counted
    status = property(lambda self: self.root / "status.json")  # what it waits for (the page, status)
    params = property(lambda self: self.root / "params.yaml")  # the live rounds' base params

    def round_params(self, n: int) -> Path:
        return self.root / f"{round_name(n)}.yaml"

    def round_log(self, n: int) -> Path:
        return self.root / f"{round_name(n)}.log"


@dataclass(frozen=True)
class PolicyLayout(_Dir):
    """A built policy, ``runs/policies/<name>/`` (policy.model)."""

    build = property(lambda self: self.root / "build.json")


@dataclass(frozen=True)
class RunsLayout(_Dir):
    """``runs/`` (``round.runs_dir``): the rounds, the live experiments and what every round shares."""

    state = property(lambda self: self.root / _STATE)  # champion, cooldown, negatives, held A/B, progress
    mlflow_db = property(lambda self: self.root / "mlflow.db")  # one parent run per round, one nested per stage
    mlartifacts = property(lambda self: self.root / "mlartifacts")
    policies = property(lambda self: self.root / "policies")  # copied from the machine cache when one was built
    labels = property(lambda self: self.root / "review" / "labels.jsonl")  # review.labels: every round's
    cache = property(lambda self: self.root / "cache")
    judge_cache = property(lambda self: self.cache / "judge.jsonl")
    live = property(lambda self: self.root / "live")
    flywheel = property(lambda self: FlywheelLayout(self.live / "flywheel"))

    def round(self, n: int) -> RoundLayout:
        return RoundLayout(self.root / round_name(n))

    def round_dir(self, n: int) -> Path:
        return self.root / round_name(n)

    def rounds(self) -> list[RoundLayout]:
        """Every ``round-NN`` folder here, in round order."""
        found = [(n, d) for d in self.root.glob("round-*") if (n := round_number(d.name)) is not None and d.is_dir()]
        return [RoundLayout(d) for _, d in sorted(found)]

    def experiment(self, name: str) -> ExperimentLayout:
        return ExperimentLayout(self.live / name)

    def collect(self, n: int) -> ExperimentLayout:
        """The live flywheel's collection experiment before round n (``live/collect-NN``)."""
        return self.experiment(f"collect-{n:02d}")

    def champion_cache(self, version: int | str) -> Path:
        """A registered champion's adapter fetched from MLflow's artifacts (policy.arms)."""
        return self.cache / f"champion-v{version}"

    def policy(self, name: str) -> PolicyLayout:
        return PolicyLayout(self.policies / name)
