"""Covariates of the A/B's regression adjustment: what is known about a request before it is assigned.

Stage: validate (A/B). Reads the history logs it is given (by default, from a round: this round's
``trajectories.jsonl`` and the ``ab/requests.jsonl`` of the ``ab.history_rounds`` rounds before it; any
JSONL with ``prompt`` (or ``messages`` / ``conversations``) and ``reward``); writes nothing. ``hermes_lab.ab.run``
adds the columns below to the rows it analyses, the live gateway's tally (``hermes_lab.live.log``) the codes;
``hermes_lab.ab.adjust`` turns them into predictions, ``hermes_lab.ab.plan`` plans with what they leave.

    hermes-lab ab-run --params params/embedded.yaml ... --history runs/round-02/ab/requests.jsonl

Which covariates (``ab.covariates``; each is fixed before the request is routed, so any use of them keeps the
always-valid guarantee, ``hermes_lab.ab.adjust``):
- ``family_level``: the embedded task's family and level (``tasks.suite.family_of`` / ``level_of``), the
  request's *cell*; on the embedded default it explains much of whether an answer passes.
- ``opening_turn``: for a conversation (a request with ``messages``), the cell is its opening turn: the
  system prompt, the number of tools, the length of the first user message (in doublings). Only the
  opening turn: later turns hold answers of an arm.
- ``task``: the prompt itself (the embedded task id, a conversation's first user message, else the
  prompt's hash), the request's *task*: the rule learns a repeated task's mean from the stage's earlier
  requests.
- ``history``: the cell's and the task's mean reward in the history logs, as a prior for both.
A request with none of these (an unknown prompt and ``task`` off) keeps the unadjusted pseudo-outcome.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hermes_lab.ab.adjust import COLUMNS
from hermes_lab.core.layout import RoundLayout
from hermes_lab.tasks import suite as T

KINDS = ("family_level", "opening_turn", "task", "history")
_TOOLS = re.compile(r"<tools>(.*?)</tools>", re.S)


def _text(content: Any) -> str:
    """A message's text: a string, or the text parts of an OpenAI content list."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return ""


def _turns(rec: dict[str, Any]) -> list[tuple[str, str]]:
    """(role, text) of a record's conversation: OpenAI ``messages`` or ShareGPT ``conversations``."""
    msgs = rec.get("messages")
    if isinstance(msgs, list) and msgs:
        return [(str(m.get("role", "")), _text(m.get("content"))) for m in msgs if isinstance(m, dict)]
    conv = rec.get("conversations")
    if isinstance(conv, list) and conv:
        role = {"system": "system", "human": "user", "gpt": "assistant", "tool": "tool"}
        return [(role.get(str(m.get("from")), ""), str(m.get("value", ""))) for m in conv if isinstance(m, dict)]
    return []


def _digest(s: str) -> str:
    return hashlib.sha1(s.encode("utf-8")).hexdigest()[:16]


def keys_of(rec: dict[str, Any], kinds: Sequence[str]) -> tuple[str | None, str | None]:
    """(cell key, task key) of a request record (``prompt`` and/or ``messages``), None where unknown."""
    return _keys(rec, _turns(rec), kinds)


def early_keys(rec: dict[str, Any], kinds: Sequence[str]) -> tuple[str | None, str | None] | None:
    """``keys_of`` where it costs little: a conversation's (the digests of its system prompt and its first user
    message, on its opening turn only). None for a lone prompt, whose keys parse it (the live tally works those
    out at its next look, off the event loop, ``hermes_lab.live.log``)."""
    msgs = rec.get("messages")
    if isinstance(msgs, list) and len(msgs) == 1 and isinstance(msgs[0], dict) and msgs[0].get("role") == "user":
        return None  # a lone user message (a single-turn request): a prompt, told apart at no cost
    turns = _turns(rec)
    return _keys(rec, turns, kinds) if _conversation(turns) else None


def _conversation(turns: list[tuple[str, str]]) -> bool:
    """Whether a request's turns are a conversation's (more than one, or not a lone user message): then its cell
    and task are its opening turn's, else its prompt's."""
    return len(turns) > 1 or bool(turns and turns[0][0] != "user")


def _keys(rec: dict[str, Any], turns: list[tuple[str, str]], kinds: Sequence[str]) -> tuple[str | None, str | None]:
    users = [t for r, t in turns if r == "user"]
    if _conversation(turns):  # a conversation: its opening turn only
        first = users[0] if users else ""
        cell = task = None
        if "opening_turn" in kinds:
            system = next((t for r, t in turns if r == "system"), "")
            tools = rec.get("tools")
            n_tools = len(tools) if isinstance(tools, list) else _count_tools(system)
            length = int(math.log2(len(first) + 1))
            cell = f"turn:{_digest(system)[:8]}:tools={n_tools}:len={length}"
        if "task" in kinds and first:
            task = "conv:" + _digest(first)
        return cell, task
    prompt = rec.get("prompt") if isinstance(rec.get("prompt"), str) else (users[0] if users else "")
    parsed = T.parse_prompt(prompt) if prompt else None
    cell = f"{parsed.family}:{parsed.level}" if parsed is not None and "family_level" in kinds else None
    task = None
    if "task" in kinds and prompt:
        task = parsed.task_id if parsed is not None else "prompt:" + _digest(prompt)
    return cell, task


def _count_tools(system: str) -> int:
    m = _TOOLS.search(system or "")
    return m.group(1).count('"name"') if m else 0


@dataclass
class History:
    """Earlier outcomes by key: (sum of reward shares, count) per cell and per task, and overall."""

    cell: dict[str, list[float]] = field(default_factory=dict)
    task: dict[str, list[float]] = field(default_factory=dict)
    total: list[float] = field(default_factory=lambda: [0.0, 0.0])
    task_cell: dict[str, str | None] = field(default_factory=dict)
    sources: list[str] = field(default_factory=list)
    rows: int = 0

    def add(self, cell: str | None, task: str | None, y: float) -> None:
        self.total[0] += y
        self.total[1] += 1
        self.rows += 1
        for table, key in ((self.cell, cell), (self.task, task)):
            if key is not None:
                s = table.setdefault(key, [0.0, 0.0])
                s[0] += y
                s[1] += 1
        if task is not None:
            self.task_cell.setdefault(task, cell)

    def mean(self, table: dict[str, list[float]], key: str | None) -> float | None:
        s = table.get(key) if key is not None else None
        return s[0] / s[1] if s and s[1] else None

    def summary(self) -> dict[str, Any]:
        return {"rows": self.rows, "cells": len(self.cell), "tasks": len(self.task), "sources": self.sources}


def load_history(paths: Iterable[str | Path], scale: float, kinds: Sequence[str]) -> History:
    """The history of ``paths`` (JSONL logs with a reward; missing files are skipped, rows without a
    finite reward or a prompt too): what ``columns`` gives every request as its covariates' prior."""
    from hermes_lab.core.jsonl import iter_objects

    hist = History()
    for p in paths:
        p = Path(p)
        if not p.is_file():
            continue
        hist.sources.append(str(p))
        for _, rec in iter_objects(p):
            r = rec.get("reward")
            if not isinstance(r, (int, float)) or isinstance(r, bool) or not math.isfinite(r):
                continue
            cell, task = keys_of(rec, kinds)
            if cell is None and task is None:
                continue
            hist.add(cell, task, min(max(float(r) / scale, 0.0), 1.0))
    return hist


def round_history(round_dir: str | Path, rounds: int) -> list[Path]:
    """The history logs of a round: its own execution log (the baseline's samples, written before the A/B)
    and the A/B request logs of the ``rounds`` rounds before it that have one."""
    rd = RoundLayout(round_dir)
    out = [rd.trajectories]
    n = rd.number
    if n is not None and rounds > 0:
        for k in range(n - 1, max(0, n - 1 - rounds), -1):
            out.append(rd.runs().round(k).ab.requests)
    return [p for p in out if p.is_file()]


class Encoder:
    """A request's covariate columns (``hermes_lab.ab.adjust.COLUMNS``): cell and task codes in order of first
    sight, and each key's history relative to the level above (a cell's mean minus the history's, a task's
    minus its cell's) with its count (0: no history). ``kinds``: ``ab.covariates``."""

    def __init__(self, kinds: Sequence[str], history: History | None = None):
        self.kinds = tuple(kinds)
        self.history = history if "history" in self.kinds and history is not None and history.rows else None
        self.cells: dict[str, int] = {}
        self.tasks: dict[str, int] = {}

    def __bool__(self) -> bool:
        return any(k in self.kinds for k in ("family_level", "opening_turn", "task"))

    def row(self, rec: dict[str, Any]) -> tuple[int, int, float, float, float, float]:
        return self.row_of(*keys_of(rec, self.kinds))

    def row_of(self, c: str | None, t: str | None) -> tuple[int, int, float, float, float, float]:
        """``row`` of a request whose (cell key, task key) are known (``keys_of``)."""
        out = [
            -1 if c is None else self.cells.setdefault(c, len(self.cells)),
            -1 if t is None else self.tasks.setdefault(t, len(self.tasks)),
            0.0,
            0.0,
            0.0,
            0.0,
        ]
        h = self.history
        if h is not None:
            base = h.total[0] / h.total[1]
            mc = h.mean(h.cell, c)
            if mc is not None:
                out[2], out[3] = mc - base, h.cell[c][1]  # type: ignore[index]
            mt = h.mean(h.task, t)
            if mt is not None:
                above = h.mean(h.cell, h.task_cell.get(t))  # type: ignore[arg-type]
                out[4], out[5] = mt - (base if above is None else above), h.task[t][1]  # type: ignore[index]
        return tuple(out)  # type: ignore[return-value]

    def columns(self, recs: Iterable[dict[str, Any]]) -> dict[str, np.ndarray]:
        rows = [self.row(r) for r in recs]
        arr = np.array(rows, np.float64).reshape(-1, len(COLUMNS))
        out = {k: arr[:, j] for j, k in enumerate(COLUMNS)}
        out["cell"], out["task"] = out["cell"].astype(np.int64), out["task"].astype(np.int64)
        return out

    def describe(self) -> dict[str, Any]:
        """What ab_report.json says about the covariates (the history's sources: a continued experiment
        must use the same)."""
        return {
            "kinds": list(self.kinds),
            "cells": len(self.cells),
            "tasks": len(self.tasks),
            "history": self.history.summary() if self.history is not None else None,
        }


def encoder(cfg: Any, history: Iterable[str | Path] = ()) -> Encoder | None:
    """The request rows' covariates (``ab.covariates``), the history read from ``history``. Request and
    conversation units only: each has one reward row (a conversation's is its first turn); a user's many rows
    are not independent units."""
    kinds = cfg.ab.covariates
    if not kinds or cfg.ab.unit == "user":
        return None
    hist = load_history(history, cfg.reward.scale, kinds) if "history" in kinds and history else None
    enc = Encoder(kinds, hist)
    return enc if enc else None
