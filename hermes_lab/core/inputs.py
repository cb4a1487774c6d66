"""Each stage's inputs, declared once: the notebook's parameters, the command's arguments, which ones are paths.

Reads and writes nothing. One ``Inputs`` per notebook below (``EXECUTE`` ... ``REVIEW_APP``), one ``Input`` row
per parameter or argument, from which are built:
- the notebook's parameters: the rows with ``notebook=True``, in order, are its ``parameters`` cell
  (``name: type = default  # help``; tests/core/test_stage_inputs.py checks each cell against its declaration with
  papermill's own inspection, so ``papermill --help-notebook`` shows these helps), and what the round runner
  passes is checked against them (``Inputs.papermill``);
- the command's arguments (``hermes-lab prep`` ...): the rows with a ``flag``, in order, with their help; a
  stage module's ``add_arguments`` is ``PREP.add_arguments(parser)``. A bool is a switch (off unless given);
  ``cli`` holds what the command does differently (its own default, required, nargs, metavar, action);
- path resolution: ``kind`` says which notebook parameters ``hermes_lab.core.paths.resolve_params`` makes
  absolute against the project root (``PATH``, a comma-separated list of paths ``PATHS``, a policy spec
  ``SPEC``). Paths typed on a command line stay relative to the shell's cwd.

It sits in core because every stage module builds its command from it (data, train, evaluate, ab, review and
rewards cannot import the round's registry) and core.paths resolves from it. A new parameter is one row here
and one line in the notebook's parameters cell, with the same help.

    python -c "from hermes_lab.core.inputs import PREP; print(PREP.notebook_names())"
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hermes_lab.core.layout import RunsLayout

VALUE, PATH, PATHS, SPEC = "value", "path", "paths", "spec"  # Input.kind
ROUND_PARAMS = ("config_path", "round_dir", "parent_run_id")  # every stage notebook takes these, first
_RUNS = RunsLayout(Path("runs"))  # the defaults under the project's runs/ (core.layout names its files)


@dataclass(frozen=True)
class Input:
    """One input of a stage: a notebook parameter (``notebook``), a command argument (``flag``), or both."""

    name: str  # the notebook's parameter; the command's dest comes from its flag, as argparse makes it
    type: type  # str, int, float or bool
    default: Any  # the notebook's default (the command's too, unless ``cli`` says otherwise)
    help: str  # the parameter's `# help` comment and the argument's help
    kind: str = VALUE  # PATH / PATHS / SPEC: resolved against the project root in a notebook
    flag: str | tuple[str, ...] | None = None  # the command's option(s); None: the notebook's alone
    notebook: bool = True  # False: the command's alone
    cli: Mapping[str, Any] = field(default_factory=dict, hash=False)  # argparse settings of the command's own

    def argument(self) -> tuple[tuple[str, ...], dict[str, Any]]:
        """The option strings and argparse keywords of the command's argument."""
        assert self.flag, self.name
        kw: dict[str, Any] = {"help": self.help}
        if self.type is bool:
            kw["action"] = "store_true"
        else:
            kw["default"] = self.default
            if self.type is not str:
                kw["type"] = self.type
        kw |= self.cli
        if kw.get("action") in ("store_true", "append"):
            kw.pop("type", None)
        if kw.get("required"):  # no default: the notebook's is no value to type
            kw.pop("default", None)
        return ((self.flag,) if isinstance(self.flag, str) else self.flag), kw


@dataclass(frozen=True)
class Inputs:
    """A notebook's and its command's inputs, in the parameters cell's order (a command's only rows between).
    The notebook is named by its stage row (``hermes_lab.round.stages``), the reviewer's in the test."""

    name: str  # the stage's, for messages
    rows: tuple[Input, ...]

    def __post_init__(self) -> None:
        names = [r.name for r in self.rows]
        if len(names) != len(set(names)):
            raise ValueError(f"{self.name}: an input is declared twice: {names}")

    def notebook_rows(self) -> tuple[Input, ...]:
        return tuple(r for r in self.rows if r.notebook)

    def notebook_names(self) -> tuple[str, ...]:
        return tuple(r.name for r in self.notebook_rows())

    def add_arguments(self, parser: argparse.ArgumentParser, **settings: Mapping[str, Any]) -> None:
        """The command's arguments. ``settings``: argparse keywords known only where the command lives, by
        input name (``format={"choices": ...}``)."""
        unknown = set(settings) - {r.name for r in self.rows if r.flag}
        assert not unknown, f"{self.name}: no command argument {sorted(unknown)}"
        for r in self.rows:
            if r.flag:
                flags, kw = r.argument()
                parser.add_argument(*flags, **(kw | dict(settings.get(r.name, {}))))

    def papermill(self, values: Mapping[str, Any]) -> dict[str, Any]:
        """The parameters a run passes, checked against the declaration: every name a notebook parameter, every
        value of its type (papermill would write anything into the cell). In declaration order."""
        rows = {r.name: r for r in self.notebook_rows()}
        unknown = sorted(set(values) - set(rows))
        if unknown:
            raise ValueError(f"{self.name}: unknown parameter(s) {unknown}; its notebook takes {list(rows)}")
        for name, value in values.items():
            t = rows[name].type
            ok = isinstance(value, t) and (t is bool or not isinstance(value, bool))
            if not ok and not (t is float and type(value) is int):
                raise ValueError(f"{self.name}: parameter {name}={value!r} is not {t.__name__}")
        return {n: values[n] for n in rows if n in values}


def config_path(help: str, **kw: Any) -> Input:
    return Input("config_path", str, "params/embedded.yaml", help, PATH, **kw)


def round_dir(help: str, default: str = "runs/round-01", **kw: Any) -> Input:
    return Input("round_dir", str, default, help, PATH, **kw)


def parent_run_id(help: str, **kw: Any) -> Input:
    return Input("parent_run_id", str, "", help, **kw)


def cli_only(name: str, flag: str | tuple[str, ...], help: str, type: type = str, default: Any = None, **cli: Any):
    """An argument of the command alone (no notebook parameter)."""
    return Input(name, type, default, help, flag=flag, notebook=False, cli=cli)


REQUIRED = {"required": True}
NO_DEFAULT = {"default": None}  # the command's None: "not given" (the notebook's "" says the same)
SET = cli_only(
    "set",
    "--set",
    "config override, e.g. --set data.min_samples=100 or --set 'reward.types=[system,tool_call]' (repeatable)",
    action="append",
    default=[],
    metavar="KEY=VALUE",
)

# ------------------------------------------------------------------------------------------ the stages
# what a stage without inputs of its own takes (a stage row's default)
ROUND_INPUTS = Inputs(
    "round",
    (
        config_path("config YAML"),
        round_dir("this round's folder"),
        parent_run_id("MLflow run id of the round (the stage run nests under it)"),
    ),
)

EXECUTE = Inputs(
    "execute",
    (
        config_path("config YAML (hermes_lab.config.schema schema)", flag="--params"),
        round_dir("this round's output folder"),
        parent_run_id("MLflow run id of the round (stage runs nest under it)"),
        cli_only("output", "--output", "trajectories JSONL to write", required=True),
        Input(
            "adapter",
            str,
            "",
            "LoRA adapter to execute with: adapter or train output dir, or champion; empty: the base",
            SPEC,
            flag="--adapter",
            cli=NO_DEFAULT,
        ),
        cli_only("num_tasks", "--num-tasks", "override execute.num_tasks", type=int),
        Input(
            "seed",
            int,
            1,
            "task and sampling seed (the round number keeps rounds' tasks apart)",
            flag="--seed",
            cli={"default": 0},
        ),
    ),
)

PREP = Inputs(
    "prep",
    (
        cli_only(
            "input",
            "--input",
            "trajectories or conversations: JSONL (.gz) files (seed, OpenAI chat, Hermes trajectories and exports, "
            "Claude Code / Agent Trace, Atropos groups), Hermes session folders or files, a Hermes state.db, gateway "
            "log dirs, or any folder holding them",
            nargs="+",
            required=True,
            metavar="FILE",
        ),
        cli_only("output", "--output", "output dir (e.g. runs/round-01/prep)", required=True, metavar="DIR"),
        config_path(
            "the user's YAML plus optional sections (no --params: built-in defaults)",
            flag="--params",
            cli={"default": None, "metavar": "YAML"},
        ),
        SET,
        round_dir("this round's folder; prep writes into <round_dir>/prep"),
        parent_run_id("MLflow run id of the round (the prep run nests under it); empty: top level"),
        Input(
            "trajectories",
            str,
            "",
            "comma-separated inputs (JSONL, sessions dir, state.db); empty: <round_dir>/trajectories.jsonl",
            PATHS,
        ),
        cli_only(
            "negatives",
            "--negatives",
            "trajectories of rolled-back rounds, carried as negative samples (added to state.negative_files)",
            nargs="+",
            default=[],
            metavar="FILE",
        ),
        Input(
            "state_path",
            str,
            _RUNS.state.as_posix(),
            "flywheel state (last training time, negative files); may be absent",
            PATH,
            flag="--state",
            cli={"default": None, "metavar": "JSON"},
        ),
        Input(
            "simulated_now",
            str,
            "",
            "ISO time for a simulated clock (embedded flywheel); empty: wall clock / state",
            flag="--simulated-now",
            cli={"default": None, "metavar": "ISO"},
        ),
        Input(
            "override_cooldown",
            bool,
            False,
            "train despite the cooldown (needs a reason; recorded in MLflow and summary.json)",
            flag="--override-cooldown",
        ),
        Input(
            "override_reason",
            str,
            "",
            "why the cooldown is overridden (required with override_cooldown)",
            flag="--reason",
            cli={"metavar": "TEXT"},
        ),
        cli_only("format", "--format", "the inputs' shape (default: conversations.format, auto = detected per input)"),
        cli_only(
            "feedback",
            "--feedback",
            "feedback JSONL ({conversation_id, reward, source?}) joined into conversations by id",
            nargs="+",
            default=[],
            metavar="FILE",
        ),
    ),
)

REVIEW = Inputs(
    "review",
    (
        config_path(
            "YAML config (review.* gates, reward scale); empty: built-in defaults",
            flag="--params",
            cli=NO_DEFAULT,
        ),
        round_dir(
            "this round's folder, where review/ goes (no --round-dir: the queue's round)",
            flag="--round-dir",
            cli=NO_DEFAULT,
        ),
        parent_run_id("MLflow run id of the round; the stage run nests under it"),
        Input(
            "labels_path",
            str,
            _RUNS.labels.as_posix(),
            "append-only label store written by notebooks/review.ipynb",
            PATH,
            flag="--labels",
            cli=NO_DEFAULT,
        ),
        Input(
            "queue_path",
            str,
            "",
            "review queue JSONL from prep; empty: <round_dir>/prep/review_queue.jsonl",
            PATH,
            flag="--queue",
            cli=REQUIRED,
        ),
        Input(
            "simulate",
            bool,
            False,
            "the task verifier labels as a simulated reviewer (also on with review.simulate)",
            flag="--simulate",
        ),
        cli_only("json", "--json", "print the gate result as JSON", type=bool, default=False),
    ),
)

AUDIT = Inputs(
    "audit",
    (
        config_path(
            "YAML config: reward.types and reward.audit*; empty: built-in defaults",
            flag="--params",
            cli=NO_DEFAULT,
        ),
        round_dir(
            "this round's folder; the audit writes <round_dir>/audit/ (no --round-dir: nothing)",
            flag="--round-dir",
            cli=NO_DEFAULT,
        ),
        parent_run_id("MLflow run id of the round; the stage run nests under it"),
        cli_only("json", "--json", "print the result as JSON", type=bool, default=False),
    ),
)

TRAIN = Inputs(
    "train",
    (
        config_path(
            "config YAML (the user's hermes_grpo_lora.yaml schema)", flag=("--config", "--params"), cli=REQUIRED
        ),
        round_dir("this round's output folder"),
        parent_run_id("MLflow run id of the round (the training run nests under it)", flag="--parent-run-id"),
        Input(
            "data_dir",
            str,
            "",
            "prep output dir, saved datasets dir or trajectories JSONL; empty: round_dir/prep",
            PATH,
            flag="--data",
            cli=REQUIRED,
        ),
        cli_only("output", "--output", "output dir (adapter/, train_log.jsonl, ...)", required=True),
        Input(
            "start_adapter",
            str,
            "",
            "continue this adapter: adapter or train output dir, or champion; empty: fresh LoRA",
            SPEC,
            flag="--start-adapter",
            cli=NO_DEFAULT,
        ),
        Input(
            "max_steps",
            int,
            0,
            "override grpo.max_steps (0: keep the config's); the command caps grpo.turn/episode_steps too",
            flag="--max-steps",
            cli=NO_DEFAULT,
        ),
        cli_only("no_eval", "--no-eval", "skip the held-out before/after pass-rate check", type=bool, default=False),
        Input(
            "resume",
            bool,
            True,
            "continue from the last checkpoint in the output's trl/ (a killed round); none there: start at 0",
            flag="--resume",
        ),
        SET,
    ),
)

VALIDATE = Inputs(
    "validate",
    (
        config_path(
            "YAML config (hermes_grpo_lora.yaml as is; no --params: built-in defaults)",
            flag="--params",
            cli=NO_DEFAULT,
        ),
        round_dir("this round's folder; outputs go to <round_dir>/validate"),
        parent_run_id(
            "MLflow run id of the round; the validate run nests under it (empty: a top-level run)",
            flag="--parent-run-id",
        ),
        cli_only("base", "--base", "base model: hub id, local path or embedded:tiny", required=True),
        cli_only(
            "candidate_adapter",
            "--candidate-adapter",
            "the candidate: a LoRA adapter dir, a train output dir (adapter/ inside) or champion",
            required=True,
        ),
        Input("train_dir", str, "", "training output to inspect and validate (empty: <round_dir>/train)", PATH),
        Input(
            "compare_rounds",
            str,
            "",
            "earlier train dirs or MLflow run ids to overlay, comma-separated (empty: all)",
            PATHS,
        ),
        Input(
            "baseline_adapter",
            str,
            "",
            "baseline: adapter or train output dir, or champion (empty: champion, model.adapter, base)",
            SPEC,
            flag="--baseline-adapter",
            cli=NO_DEFAULT,
        ),
        cli_only("heldout", "--heldout", "held-out datasets dir (default: generated held-out tasks)"),
        cli_only("output", "--output", "where regression.json goes", required=True),
        cli_only("no_mlflow", "--no-mlflow", "do not log to MLflow", type=bool, default=False),
    ),
)

AB = Inputs(
    "ab",
    (
        config_path(
            "the user's YAML plus optional sections (no --params: built-in defaults)",
            flag="--params",
            cli=NO_DEFAULT,
        ),
        round_dir("this round's folder; the A/B report and request log go to <round_dir>/ab"),
        parent_run_id(
            "MLflow run id of the round (the ab run nests under it); empty: top level", flag="--parent-run-id"
        ),
        Input(
            "baseline",
            str,
            "",
            "model/adapter/train output dir, hub id, embedded:tiny or champion; empty: the champion",
            SPEC,
            flag="--baseline",
            cli=REQUIRED,
        ),
        Input(
            "candidate",
            str,
            "",
            "the same kinds as baseline; empty: <round_dir>/train/adapter",
            SPEC,
            flag="--candidate",
            cli=REQUIRED,
        ),
        cli_only("ratio", "--ratio", "candidate share of the first stage (default: ab.traffic_ratio)", type=float),
        Input(
            "duration",
            int,
            0,
            "cap on simulated seconds (0: all stages; 7200: the 10% stage only)",
            flag="--duration",
            cli={"type": float},
        ),
        cli_only("output", "--output", "report path (default: %(default)s)"),
        cli_only("replay", "--replay", "replay this request log (JSONL with 'prompt') instead of simulated traffic"),
        Input("seed", int, 0, "seed of traffic, sampling and latency", flag="--seed"),
        cli_only("log_dir", "--log-dir", "where requests.jsonl and plots/ go (default: beside --output)"),
        cli_only(
            "plan_eval", "--plan-eval", "train's eval.json: the held-out gain ab.plan_power sizes the traffic for"
        ),
        cli_only(
            "history",
            "--history",
            "comma-separated logs with rewards from before this A/B (trajectories, earlier A/B request logs): "
            "the prior of the ab.covariates adjustment",
            default="",
        ),
        Input(
            "continue_from",
            str,
            "",
            "an earlier round's ab/ folder whose A/B ended undecided: continue it (round.on_held)",
            flag="--continue-from",
            cli=NO_DEFAULT,
        ),
        cli_only("no_mlflow", "--no-mlflow", "do not log to MLflow", type=bool, default=False),
        cli_only(
            "verbose",
            ("-v", "--verbose"),
            "DEBUG logging: one line per request (request_id, arm, status)",
            type=bool,
            default=False,
        ),
    ),
)

COMPARE = Inputs(
    "compare",
    (
        config_path("config YAML (for runs_dir and the experiment name)"),
        round_dir("the round this comparison is filed under (plots land in round_dir/compare)"),
        parent_run_id("MLflow run id of the round (the compare run nests under it)"),
    ),
)

# the human reviewer's notebook (notebooks/review.ipynb): not a round stage, opened in JupyterLab
REVIEW_APP = Inputs(
    "review app",
    (
        config_path("YAML config (reward scale, review.min_labels, label mode)"),
        round_dir("the round whose queue you review; empty: the latest round with a review queue", default=""),
        parent_run_id("unused here (the labeller logs nothing to MLflow); kept for papermill uniformity"),
        Input("queue_path", str, "", "review queue JSONL; empty: <round_dir>/prep/review_queue.jsonl", PATH),
        Input(
            "store_path",
            str,
            _RUNS.labels.as_posix(),
            "append-only label store, shared by rounds and reviewers",
            PATH,
        ),
        Input("reviewer", str, "", "your name or id (required to label; can also be typed into the widget)"),
        Input("mode", str, "score", "score (0..5 buttons) or passfail; empty: review.label_mode from the config"),
    ),
)

NOTEBOOKS: tuple[Inputs, ...] = (EXECUTE, PREP, REVIEW, AUDIT, TRAIN, VALIDATE, AB, COMPARE, REVIEW_APP)


def kinds(declared: Iterable[Inputs] = NOTEBOOKS) -> dict[str, str]:
    """Notebook parameter -> its kind, over every notebook: a name means one kind of thing wherever it is."""
    out: dict[str, str] = {}
    for inputs in declared:
        for r in inputs.notebook_rows():
            if out.setdefault(r.name, r.kind) != r.kind:
                raise ValueError(f"{inputs.name}: '{r.name}' is a {r.kind} here, a {out[r.name]} elsewhere")
    return out


KINDS = kinds()
