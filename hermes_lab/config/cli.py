"""`hermes-lab config`: print the resolved config (secrets are never in it), check it, or explain every key.

    hermes-lab config --params params/hermes_grpo_lora.yaml
    hermes-lab config --check --params params/hermes_grpo_lora.yaml   # every problem; exit 0 ok, 2 not
    hermes-lab config --check --params params/a.yaml --params params/b.yaml   # several files, one TRL import
    hermes-lab config --explain

``--check`` runs every check a round would run into later, TRL's and PEFT's own included
(``hermes_lab.config.check.check_config(deep=True)``), and lists every problem, one a line. Several files are
checked in one process: TRL's and PEFT's imports (~10 s of CPU) are paid once, not once a file.
"""

from __future__ import annotations

import argparse
import sys

import yaml

from hermes_lab.config.check import check_config
from hermes_lab.config.schema import ConfigError, field_help, load_config


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--params",
        action="append",
        default=None,
        help="config YAML (default: built-in defaults); with --check, give it once per file to check several",
    )
    p.add_argument(
        "--check", action="store_true", help="check everything a round would fail on (TRL, PEFT too); exit 0/2"
    )
    p.add_argument("--explain", action="store_true", help="list every key with its help text")


def run_cli(args: argparse.Namespace) -> int:
    if args.explain:
        for key, text in field_help().items():
            print(f"{key:34s} {text}")
        return 0
    paths = args.params or [None]
    if args.check:
        return max(_check(path) for path in paths)  # every file checked, whatever the first said
    if len(paths) > 1:
        print("hermes-lab config: one --params to print (several only with --check)", file=sys.stderr)
        return 2
    cfg = load_config(paths[0])
    print(yaml.safe_dump(cfg.to_dict(), sort_keys=False), end="")
    return 0


def _check(path: str | None) -> int:
    name = path or "<defaults>"
    try:
        warnings = check_config(load_config(path), deep=True)
    except ConfigError as e:
        print(f"{name}: {len(e.problems)} problem(s)", file=sys.stderr)
        for p in e.problems:
            print(f"  error: {p}", file=sys.stderr)
        return 2
    for w in warnings:
        print(f"  warning: {w}")
    print(f"{name}: ok" + (f" ({len(warnings)} warning(s))" if warnings else ""))
    return 0
