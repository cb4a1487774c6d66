"""Prep's inputs (stage: prep, through ``hermes_lab.prep.run.run_prep``): what ``--input`` and the state name,
resolved to the files, folders and stores the ingest reads, checked before anything is opened or created.
Reads only folder listings and first lines (``hermes_lab.logs.readers.folder_inputs``); writes nothing.

A folder stands for what it holds (``expand_folders``); an input that is missing, or one of prep's own outputs
in ``--output`` (``--input D/accepted.jsonl --output D``), is a ``PrepError`` naming it.

    hermes-lab prep --input ~/agent-logs/ runs/round-01/trajectories.jsonl --output runs/round-01/prep
"""

from __future__ import annotations

import os
from pathlib import Path

from hermes_lab.core.layout import PrepLayout
from hermes_lab.core.state import FlywheelState
from hermes_lab.logs import readers
from hermes_lab.logs.readers import SESSION_GLOB
from hermes_lab.prep.ingest import SINKS

_PREP = PrepLayout(Path())  # prep's own output (core.layout), which a folder given as its input skips
OUTPUT_FILES = (
    *(_PREP.sink(n).name for n in (*SINKS, "outliers", "review_queue", "left_out")),
    *(p.name for p in (_PREP.summary, _PREP.verdict, _PREP.selection)),
)
OUTPUT_DIRS = tuple(p.name for p in (_PREP.grpo_dataset, _PREP.heldout_dataset, _PREP.conversations, _PREP.plots))


class PrepError(Exception):
    """Bad input (file, line and reason in the message). rejects.jsonl and summary.json are written first."""


def resolve_inputs(
    inputs: list[str | Path], negatives: list[str | Path] | None, state: FlywheelState | None, out: Path
) -> tuple[list[Path], list[tuple[Path, int | None, str]]]:
    """Every file prep will read: the --input files and the negatives (state's, then --negatives), with the
    round each negative came from. The one place inputs are interpreted, and checked before anything is
    opened or created: each must be a regular file, and none may be one of prep's own outputs in ``out``
    (prep would replace it: ``--input D/accepted.jsonl --output D``)."""
    ins = [Path(p) for p in inputs]
    for p in ins:
        if not p.is_file() and not p.is_dir():
            raise PrepError(f"input file not found (or not a regular file): {p}")
    negs = [
        (Path(p), _round_of(str(p), state, i), "state.negative_files")
        for i, p in enumerate(state.negative_files if state else [])
    ]
    negs += [(Path(p), _round_of(str(p), None, -1), "--negatives") for p in negatives or []]
    for p, _, origin in negs:
        if not p.is_file():
            raise PrepError(f"negative file not found: {p} (listed in {origin})")
    _refuse_own_outputs([*ins, *(p for p, _, _ in negs)], out)
    return ins, negs


def expand_folders(inputs: list[str | Path], out: Path, cap: int) -> list[str | Path]:
    """Each folder input replaced by the inputs it stands for (``hermes_lab.logs.readers.folder_inputs``: session
    folders and gateway log dirs stay whole, the JSONL files and SQLite stores under any other folder become inputs
    of their own, its Claude Code traces one input); prep's output dir inside it is left out. A folder that holds
    nothing prep reads is refused."""
    expanded: list[str | Path] = []
    for p in inputs:
        if not Path(p).is_dir():
            expanded.append(p)
            continue
        found = readers.folder_inputs(Path(p), cap, skip=out)
        if not found:
            raise PrepError(
                f"input folder {p} holds nothing prep reads: no JSONL (.jsonl, .jsonl.gz), Hermes session files "
                f"({SESSION_GLOB}), SQLite store or gateway log dir"
            )
        expanded += found
    return expanded


def _refuse_own_outputs(files: list[Path], out: Path) -> None:
    root = out.resolve()
    owned = [root / n for n in OUTPUT_FILES]
    for f in files:
        r = f.resolve()
        try:
            top = r.relative_to(root).parts[0]
        except ValueError:  # not under the output dir
            top = ""
        hit = top in OUTPUT_FILES or top in OUTPUT_DIRS or top.startswith(".prep-")  # .prep-*: prep's temp dirs
        same = next((o for o in owned if o.exists() and os.path.samefile(o, f)), None)  # a hard link
        if hit or same is not None:
            name = top if hit else same.name  # type: ignore[union-attr]
            raise PrepError(
                f"input {f} is {name}, one of prep's own outputs in --output {out}: prep would replace it. "
                "Copy it elsewhere first, or write to another --output directory."
            )


def _round_of(path: str, state: FlywheelState | None, index: int) -> int | None:
    """The rolled-back round a negative file came from: 'round-NN' in its path, else state's parallel list."""
    import re

    m = re.search(r"round-0*(\d+)", str(path))
    if m:
        return int(m.group(1))
    if state is not None and len(state.negative_rounds) == len(state.negative_files) and index >= 0:
        return state.negative_rounds[index]
    return None
