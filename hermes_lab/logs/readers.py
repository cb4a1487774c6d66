"""Every input shape prep reads, detected, and a line format's object handed to its reader (stage: prep).

Reads, never writes: the files and folders given to ``hermes-lab prep --input`` (with ``--format`` or
``conversations.format`` to force a shape; ``auto`` detects it per input, by what it is and its first JSON line).
One module of ``hermes_lab.logs`` a format:

  seed               JSONL of ``{"prompt", "response", "reward", "task_id"}``            (``logs.lines``; the
                     ingest's fast path, ``hermes_lab.prep.seed``)
  openai             JSONL of ``{"messages": [...], "tools": [...]}`` (OpenAI fine-tuning, TRL's conversational
                     datasets, most agent frameworks; also ``{"prompt": [...], "completion": [...]}`` and prep's
                     own accepted records)                                                (``logs.openai_chat``)
  hermes_trajectory  the Hermes Agent's ShareGPT trajectories: ``run_agent.py --save_trajectories``'s
                     ``trajectory_samples.jsonl`` / ``failed_trajectories.jsonl``, its batch runner's
                     ``trajectories.jsonl``, the trajectory compressor's output; ``.jsonl`` or ``.jsonl.gz``
                                                                                    (``logs.hermes_trajectory``)
  hermes_session     ``$HERMES_HOME/sessions/session_<id>.json`` files, or a folder of them
  hermes_state       ``$HERMES_HOME/state.db`` (SQLite, opened read-only)  (all three: ``logs.hermes_sessions``)
  hermes_export      ``hermes sessions export out.jsonl``
  claude_code        Claude Code / Agent Trace JSONL: ``hermes sessions export out.jsonl --format trace``, Claude
                     Code's ``~/.claude/projects/<project>/`` (a file, or a folder: sessions across its files)
                                                                                          (``logs.claude_code``)
  atropos            Atropos scored groups: an atroposlib environment's ``process`` mode output
                                                                                              (``logs.atropos``)
  (a gateway log dir) ``hermes-lab serve``'s log, joined into trajectories                    (``logs.gateway``)

A folder given as an input is read whole (``folder_inputs``): a folder of ``session_*.json`` is one hermes_session
input, a gateway log dir is joined as before, and any other folder stands for what it holds: each JSONL file
(``.jsonl``, ``.jsonl.gz``) and SQLite store under it an input of its own, detected per file, except Claude Code
traces, which are one input (the folder: a session's lines may sit in several files, its sub-agents in a
``subagents/`` folder).

The line formats (seed, openai, hermes_trajectory) are read (bounded, validated JSON) by the ingest, which hands
each object to ``parse_line``; the other formats yield whole records. A malformed conversation raises
``record.Invalid`` (reason + the turn or message at fault), which the ingest turns into a rejected line
(file, line or session id, reason, detail, raw).

    hermes-lab prep --input trajectory_samples.jsonl failed_trajectories.jsonl ~/.hermes/state.db --output DIR
"""

from __future__ import annotations

import gzip
import zlib
from pathlib import Path
from typing import Any, BinaryIO

from hermes_lab.core.layout import REQUESTS
from hermes_lab.logs.hermes_trajectory import from_trajectory
from hermes_lab.logs.lines import BOM, decode, is_gzip
from hermes_lab.logs.openai_chat import from_openai
from hermes_lab.logs.record import Invalid

JSONL_FORMATS = ("seed", "openai", "hermes_trajectory")
RECORD_FORMATS = ("hermes_session", "hermes_state", "hermes_export", "claude_code", "atropos")
SQLITE_MAGIC = b"SQLite format 3\x00"
SESSION_GLOB = "session_*.json"
GATEWAY_REQUESTS = REQUESTS  # hermes_lab.logs.gateway's: a folder holding it is a gateway log dir
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".ndjson")
TRACE_META_TYPES = ("summary", "file-history-snapshot", "queue-operation")  # Claude Code lines outside the chain
DETECT_LINES = 100  # lines read at most for an input's first JSON object


# ------------------------------------------------------------------------------------------ detection
def detect(path: Path, first_object: Any = None) -> str:
    """The format of one input: a folder (of session files, else of traces), a SQLite file, a session JSON file,
    or JSONL whose first object says which (``first_object``: its first line that is a JSON object)."""
    if path.is_dir():
        return "hermes_session" if any(path.glob(SESSION_GLOB)) else "claude_code"
    with open(path, "rb") as f:
        head = f.read(16)
    if head == SQLITE_MAGIC:
        return "hermes_state"
    if path.suffix == ".json":  # one JSON document, not lines: a session snapshot
        return "hermes_session"
    obj = first_object
    if not isinstance(obj, dict) or isinstance(obj.get("prompt"), str):
        return "seed"  # a text prompt is the seed's record, whatever else the line carries (a gateway log's messages)
    if "conversations" in obj:
        return "hermes_trajectory"
    if is_trace_line(obj):
        return "claude_code"
    if isinstance(obj.get("scores"), list) and ("tokens" in obj or "messages" in obj):
        return "atropos"  # atroposlib's ScoredDataGroup
    if isinstance(obj.get("messages"), list) and "system_prompt" in obj and "started_at" in obj:
        return "hermes_export"  # the sessions table's row and its messages
    if "messages" in obj or (isinstance(obj.get("prompt"), list) and isinstance(obj.get("completion"), list)):
        return "openai"
    return "seed"


def is_trace_line(obj: dict[str, Any]) -> bool:
    """A Claude Code / Agent Trace line: a message of the uuid / parentUuid chain, or one of its meta lines."""
    if isinstance(obj.get("sessionId"), str) and "uuid" in obj and "parentUuid" in obj:
        return True
    return obj.get("type") in TRACE_META_TYPES and ("leafUuid" in obj or "messageId" in obj or "operation" in obj)


def first_object(path: Path, cap: int) -> Any:
    """The first line of a JSONL file that is a JSON object (a torn first line says nothing), or None."""
    with open(path, "rb") as raw_f:
        f: BinaryIO = gzip.GzipFile(fileobj=raw_f, mode="rb") if is_gzip(path) else raw_f  # type: ignore[assignment]
        for _ in range(DETECT_LINES):
            try:
                raw = f.readline(cap + 1)
            except (OSError, EOFError, zlib.error):  # the scan reports it
                return None
            if not raw:
                return None
            try:
                obj = decode(raw.strip().removeprefix(BOM).decode("utf-8"))
            except (ValueError, UnicodeDecodeError):
                continue
            if isinstance(obj, dict):
                return obj
    return None


def folder_inputs(path: Path, cap: int, skip: Path | None = None) -> list[Path]:
    """The inputs a folder stands for (see the module docstring), in name order: session folders, gateway log
    dirs, JSONL files and SQLite stores under it, and the folder itself when Claude Code traces are among them.
    Hidden entries and ``skip`` (prep's output dir) are left out."""
    if any(path.glob(SESSION_GLOB)) or (path / GATEWAY_REQUESTS).is_file():
        return [path]
    out: list[Path] = []
    traces = False
    for p in _walk(path, skip):
        if p.is_dir() or _is_sqlite(p):
            out.append(p)
        elif detect(p, first_object(p, cap)) == "claude_code":
            traces = True
        else:
            out.append(p)
    return [*out, path] if traces else out


def trace_files(path: Path, cap: int) -> list[Path]:
    """The Claude Code trace files of a folder input (every depth), in name order; a file: itself."""
    if not path.is_dir():
        return [path]
    return [
        p
        for p in _walk(path, None)
        if p.is_file() and not _is_sqlite(p) and detect(p, first_object(p, cap)) == "claude_code"
    ]


def _walk(path: Path, skip: Path | None) -> list[Path]:
    """Session folders and gateway log dirs (not descended), JSONL files and SQLite stores under ``path``."""
    found: list[Path] = []
    for p in sorted(path.iterdir()):
        if p.name.startswith(".") or (skip is not None and p.resolve() == skip.resolve()):
            continue
        if p.is_dir():
            if any(p.glob(SESSION_GLOB)) or (p / GATEWAY_REQUESTS).is_file():
                found.append(p)
            else:
                found += _walk(p, skip)
        elif p.is_file() and (p.name.endswith(JSONL_SUFFIXES) or _is_sqlite(p)):
            found.append(p)
    return found


def _is_sqlite(p: Path) -> bool:
    if p.suffix not in (".db", ".sqlite", ".sqlite3"):
        return False
    with open(p, "rb") as f:
        return f.read(16) == SQLITE_MAGIC


# ------------------------------------------------------------------------------------------ JSONL lines
def parse_line(obj: Any, fmt: str, file: str, line: int, scale: float, max_chars: int) -> dict[str, Any]:
    """One JSONL object of an openai or hermes_trajectory file as a record; Invalid names what is wrong."""
    if type(obj) is not dict:
        raise Invalid("not a JSON object", f"got a JSON {type(obj).__name__}")
    if fmt == "hermes_trajectory":
        return from_trajectory(obj, file, line, max_chars)
    return from_openai(obj, file, line, scale, max_chars)
