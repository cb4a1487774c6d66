"""Small JSON/JSONL helpers shared by the stages: line-numbered reading, atomic writing.

Every reader of a JSONL file the workbench wrote (train logs, review queues, request logs) wants the
same thing: objects with their 1-based line numbers, blank lines skipped, and an error that names the
file and line. User input (trajectories) goes through prep's own, more forgiving ingest instead.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def iter_objects(path: str | os.PathLike[str]) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) for each non-blank line; ValueError naming file:line otherwise."""
    p = Path(path)
    with p.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{p}:{lineno}: not valid JSON ({e.msg})") from None
            if not isinstance(rec, dict):
                raise ValueError(f"{p}:{lineno}: expected a JSON object, got {type(rec).__name__}")
            yield lineno, rec


def write_json_atomic(path: str | os.PathLike[str], data: Any) -> Path:
    """Write JSON via a temp file and rename: a reader never sees half a file."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str), encoding="utf-8")
    os.replace(tmp, p)
    return p
