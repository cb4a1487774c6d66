"""`hermes-lab config`: print the resolved config (secrets are never in it), or explain every key.

hermes-lab config --params params/hermes_grpo_lora.yaml
hermes-lab config --explain
"""

from __future__ import annotations

import argparse

import yaml

from hermes_lab.config import field_help, load_config


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--params", default=None, help="config YAML (default: built-in defaults)")
    p.add_argument("--explain", action="store_true", help="list every key with its help text")


def run_cli(args: argparse.Namespace) -> int:
    if args.explain:
        for key, text in field_help().items():
            print(f"{key:34s} {text}")
        return 0
    cfg = load_config(args.params)
    print(yaml.safe_dump(cfg.to_dict(), sort_keys=False), end="")
    return 0
