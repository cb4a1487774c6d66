"""How a command runs: the argument parser of ``python -m hermes_lab.<module>`` and the one error policy
every command shares (``hermes-lab <command>`` and ``python -m`` alike).

Reads and writes nothing. A stage module provides ``add_arguments(parser)`` and ``run_cli(args)``; its
``main()`` hands them to ``run_module``, and ``hermes_lab.cli.main`` wires the same pair into
``hermes-lab``. A bad config (``ConfigError``) or a bad argument (``CommandError``, e.g. a policy flag that
names nothing loadable) is one line on stderr and exit 2, never a traceback.

It lives at the bottom of the house on purpose: every stage's entry point calls it, so it may import
nothing above ``hermes_lab.core``.

    python -m hermes_lab.agents.execute --help
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from hermes_lab.core import quiet
from hermes_lab.core.yaml_typed import ConfigError

DEBUG_HELP = "let library logging (HTTP requests...) and every warning through (hermes_lab.core.quiet)"


class CommandError(ValueError):
    """A command-line value that cannot be used; its message names the flag and what it accepts."""


def run(runner: Callable[[argparse.Namespace], int | None], args: argparse.Namespace, name: str) -> int:
    """Run a command; a config problem or a bad argument is one line on stderr and exit 2."""
    quiet.configure(getattr(args, "global_debug", False) or None)  # None: $HERMES_LAB_DEBUG decides
    try:
        return int(runner(args) or 0)
    except ConfigError as e:
        print(f"{name}: config error: {e}", file=sys.stderr)
        return 2
    except CommandError as e:
        print(f"{name}: {e}", file=sys.stderr)
        return 2


def run_module(
    module: str,
    add_arguments: Callable[[argparse.ArgumentParser], None],
    run_cli: Callable[[argparse.Namespace], int | None],
    argv: list[str] | None = None,
    description: str | None = None,
) -> int:
    """`python -m hermes_lab.<module>`: the same arguments and error handling as `hermes-lab <command>`."""
    p = argparse.ArgumentParser(prog=f"python -m {module}", description=description)
    add_arguments(p)
    if not any("--debug" in a.option_strings for a in p._actions):  # doctor's own --debug wins
        p.add_argument("--debug", dest="global_debug", action="store_true", help=DEBUG_HELP)
    return run(run_cli, p.parse_args(argv), f"python -m {module}")
