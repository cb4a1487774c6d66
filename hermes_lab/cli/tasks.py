"""`hermes-lab tasks export`: the embedded task suite's tasks as JSONL, for any agent to run and anyone to check.

Reads nothing; writes the ``--out`` file (through a temporary file and a rename). One task a line::

    {"id": "hermes-ad59a940", "prompt": "first line of xep.txt?", "files": {"xep.txt": "fsxl\\ndut\\n"},
     "expect": {"answer_contains": "fsxl"}}

``files`` are laid in an empty workspace before the run (paths relative to it); ``expect.files`` are the files'
exact content after it, ``expect.answer_contains`` a string the final answer must contain (either may be absent).
The ``prompt`` field is what Hermes's own batch tooling reads. ``hermes_lab.tasks.hermes.verify`` is the verifier
the project pays with (it also refuses answers that name a decoy or run long).

    hermes-lab tasks export --family hermes --split heldout --n 20 --out heldout.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

FAMILIES = ("hermes",)


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    ex = sub.add_parser("export", help="Write a family's tasks as JSONL (id, prompt, files, expect).")
    ex.add_argument("--family", choices=FAMILIES, default="hermes", help="the task family (default: hermes)")
    ex.add_argument(
        "--split", choices=("train", "heldout", "any"), default="heldout", help="the split (default: heldout)"
    )
    ex.add_argument("--n", type=int, default=20, help="how many tasks (round-robin over the family's kinds)")
    ex.add_argument("--seed", type=int, default=0, help="the draw's seed (the same seed gives the same tasks)")
    ex.add_argument("--out", required=True, help="the JSONL file to write")


def run_cli(args: argparse.Namespace) -> int:
    from hermes_lab.tasks import hermes as H

    if args.n < 1:
        raise SystemExit(f"--n must be at least 1, got {args.n}")
    tasks = H.generate_tasks(args.n, split=args.split, seed=args.seed)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for t in tasks:
            f.write(json.dumps(t.to_dict(), ensure_ascii=False) + "\n")
    os.replace(tmp, out)
    print(f"wrote {len(tasks)} {args.family} tasks ({args.split}) to {out}")
    return 0
