"""`hermes-lab`: the command line. Each subcommand lives in its stage module, which provides
``add_arguments(parser)`` and ``run_cli(args) -> int``; this file only wires them up. The stages'
commands come from the stage registry (``hermes_lab.round.stages``).

    hermes-lab --help
    hermes-lab <command> --help
    hermes-lab --debug <command> ...     # library logging and warnings too (hermes_lab.core.quiet)
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from hermes_lab.core import command
from hermes_lab.round.stages import STAGES, Stage

# command -> (module, one-line help). The round's stage commands come from the stage registry (its rows'
# ``command``); these are the others. Modules keep heavy imports (torch, trl, mlflow) inside functions so
# that `hermes-lab --help` stays fast.
BEFORE_STAGES: dict[str, tuple[str, str]] = {
    "config": ("hermes_lab.config.cli", "Print the resolved config, check it (--check), or explain every key."),
    "build-policy": (
        "hermes_lab.policy.model",
        "Build (or reuse) the embedded tiny base policy and report its pass rate.",
    ),
}
AFTER_STAGES: dict[str, tuple[str, str]] = {
    "inspect": ("hermes_lab.evaluate.inspect", "Reward/KL curves and diagnostics of a training run."),
    "round": ("hermes_lab.round.runner", "Run one full round of stage notebooks with papermill."),
    "flywheel": (
        "hermes_lab.round.supervisor",
        "Run several rounds unattended on a simulated clock; --live: one gateway, rounds started by traffic.",
    ),
    "status": ("hermes_lab.round.runner", "Is a round due? If not, why (samples, cooldown, review)."),
    "doctor": ("hermes_lab.cli.doctor", "Check the model API setup: base URL, key, model ids, proxies."),
    "serve": (
        "hermes_lab.live.serve",
        "Live A/B gateway: an OpenAI-compatible server routing real traffic to two arms.",
    ),
    "agent": (
        "hermes_lab.agents.standin",
        "Stand-in agent: embedded tasks through the openai SDK, verifier scores as feedback.",
    ),
    "tasks": ("hermes_lab.cli.tasks", "The embedded task suite: export a family's tasks as JSONL (tasks export)."),
    "lab": ("hermes_lab.cli.lab", "JupyterLab on the project, opening notebooks/README.md (make lab)."),
}


def commands(stages: Sequence[Stage] = STAGES) -> dict[str, tuple[str, str]]:
    """Every command, in --help order: the fixed ones around the stages' own."""
    return BEFORE_STAGES | {s.command: (s.module, s.help) for s in stages if s.command} | AFTER_STAGES


COMMANDS = commands()


def build_parser(stages: Sequence[Stage] = STAGES) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hermes-lab", description=__doc__.split("\n")[0])
    # its own dest: a subcommand's --debug (doctor has one) would overwrite a shared one
    parser.add_argument("--debug", dest="global_debug", action="store_true", help=command.DEBUG_HELP)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (modname, help_) in commands(stages).items():
        mod = importlib.import_module(modname)  # a missing module is an error, not a silently absent command
        p = sub.add_parser(name, help=help_, description=help_)
        adder = getattr(mod, f"add_arguments_{name.replace('-', '_')}", None) or mod.add_arguments
        runner = getattr(mod, f"run_cli_{name.replace('-', '_')}", None) or mod.run_cli
        adder(p)
        p.set_defaults(_run=runner)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return command.run(args._run, args, f"hermes-lab {args.command}")


if __name__ == "__main__":
    sys.exit(main())
