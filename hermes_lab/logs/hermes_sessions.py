"""The Hermes Agent's own stores and exports as canonical conversation records (stage: prep).

Reads, never writes (through ``hermes-lab prep --input``; ``hermes_lab.prep.ingest`` calls these):

  hermes_session   ``$HERMES_HOME/sessions/session_<id>.json`` snapshots (written with
                   ``sessions.write_json_snapshots: true``), or a folder of them: system prompt, tools, messages
  hermes_state     ``$HERMES_HOME/state.db`` (SQLite, opened read-only)
  hermes_export    ``hermes sessions export out.jsonl`` (hermes-agent's default export format): one line a session,
                   the sessions table's row (id, model, system_prompt, parent_session_id, started_at, end_reason,
                   ...) with its messages

In state.db and an export, a compression chain (sessions linked by ``parent_session_id`` whose parent ended with
end_reason "compression") is one conversation, its replayed hand-off messages dropped; sub-agents and branches
are conversations of their own with ``parent_conversation_id``. The session's system prompt is the first
message. Neither store keeps the tool schemas the agent offered: they are taken from the session's JSON snapshot
(``sessions/session_<id>.json`` beside state.db) where there is one, else from a ``<tools>`` block of the system
prompt, else the record has none and its ``meta.tools_from`` says "none" (``tools_from``: log, snapshot,
system_prompt, none; counted per input in summary.json).

Each reader yields ``(session id, file, line, raw text, record or Invalid)``: a line that is no JSON session is
rejected by its line; a conversation by its root session id.

    hermes-lab prep --input ~/.hermes/state.db sessions.jsonl ~/.hermes/sessions --output DIR
"""

from __future__ import annotations

import json
import os
import sqlite3
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson

from hermes_lab.logs.grouping import Bad, Kept, read_lines
from hermes_lab.logs.hermes_trajectory import system_tools
from hermes_lab.logs.lines import lone_surrogate
from hermes_lab.logs.openai_chat import tools_of
from hermes_lab.logs.readers import SESSION_GLOB
from hermes_lab.logs.record import Invalid, check_messages, make_record, outcome_of, where

JSON_PREFIX = "\x00json:"  # hermes_state.SessionDB._CONTENT_JSON_PREFIX: list / dict content stored as JSON
MESSAGE_COLUMNS = (
    "role",
    "content",
    "tool_call_id",
    "tool_calls",
    "tool_name",
    "finish_reason",
    "reasoning",
    "reasoning_content",
    "timestamp",
)


# ------------------------------------------------------------------------------------- session files
def from_session(obj: Any, file: str, max_chars: int) -> dict[str, Any]:
    """A ``session_<id>.json`` snapshot: its system prompt, tools and OpenAI messages."""
    if not isinstance(obj, dict) or not isinstance(obj.get("messages"), list):
        raise Invalid("not a Hermes session", "a session file holds an object with session_id and messages")
    raw = with_system(list(obj["messages"]), obj.get("system_prompt"))
    msgs = check_messages(raw, max_chars)
    tools = tools_of(obj.get("tools"), "")
    last_finish = next(
        (m.get("finish_reason") for m in reversed(raw) if isinstance(m, dict) and m.get("role") == "assistant"), None
    )
    signals = {"finish_reason": last_finish} if last_finish else {}
    sid = obj.get("session_id")
    return make_record(
        msgs,
        tools,
        where("hermes_session", file, None, sid if isinstance(sid, str) else None),
        conversation_id=sid if isinstance(sid, str) else None,
        model=obj.get("model"),
        started_at=obj.get("session_start"),
        ended_at=obj.get("last_updated"),
        outcome=outcome_of(msgs, tools, **signals),
        meta={k: obj[k] for k in ("platform", "base_url", "message_count") if k in obj},
    )


def session_files(path: Path) -> list[Path]:
    return sorted(path.glob(SESSION_GLOB)) if path.is_dir() else [path]


def iter_sessions(path: Path, max_chars: int, max_bytes: int) -> Iterator[tuple[Any, ...]]:
    """A session folder or file: one record per file."""
    for f in session_files(path):
        size = f.stat().st_size
        if size > max_bytes:
            yield (
                None,
                str(f),
                None,
                "",
                Invalid("line too long", f"session file of {size} bytes > data.max_line_bytes {max_bytes}"),
            )
            continue
        data = f.read_bytes()
        text = data.decode("utf-8", errors="replace")
        try:
            obj = json.loads(data)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            yield None, str(f), None, text, Invalid("malformed JSON", str(e)[:120])
            continue
        sid = obj.get("session_id") if isinstance(obj, dict) else None
        # a "\\ud800" escape reads as a lone surrogate, which no UTF-8 writer or Arrow takes: rejected as in a line
        if "\\ud" in text.lower() and (field := lone_surrogate(obj)) is not None:
            yield sid, str(f), None, text, Invalid("invalid Unicode", f"lone surrogate escape in {field}")
            continue
        try:
            yield sid, str(f), None, text, from_session(obj, str(f), max_chars)
        except Invalid as e:
            yield sid, str(f), None, text, e


# ------------------------------------------------------------------------------------------- chains
def with_system(raw: list[Any], system_prompt: Any) -> list[Any]:
    """The messages with the session's system prompt first (unless they start with one already)."""
    first_system = raw and isinstance(raw[0], dict) and raw[0].get("role") == "system"
    if isinstance(system_prompt, str) and system_prompt.strip() and not first_system:
        return [{"role": "system", "content": system_prompt}, *raw]
    return raw


def chains(sessions: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Compression chains, root first (hermes_state.SessionDB.get_compression_lineage's rule): a child whose
    parent ended with "compression" (and that is no /branch) continues its parent. ``sessions``: ordered by
    started_at; each a dict with id, parent_session_id, end_reason and model_config."""
    by_id = {s["id"]: s for s in sessions}

    def branch(s: dict[str, Any]) -> bool:
        cfg = s.get("model_config")
        try:
            cfg = json.loads(cfg or "null") if isinstance(cfg, str) or cfg is None else cfg
        except (json.JSONDecodeError, TypeError):
            return False
        return isinstance(cfg, dict) and cfg.get("_branched_from") is not None

    def continues(s: dict[str, Any]) -> bool:
        p = by_id.get(s.get("parent_session_id"))
        return p is not None and p.get("end_reason") == "compression" and not branch(s)

    nxt: dict[str, dict[str, Any]] = {}
    for s in sessions:  # ordered by started_at: the first continuation wins
        if continues(s):
            nxt.setdefault(s["parent_session_id"], s)
    out = []
    for s in sessions:
        if continues(s) and nxt.get(s["parent_session_id"]) is s:
            continue
        chain, seen = [s], {s["id"]}
        while chain[-1]["id"] in nxt and nxt[chain[-1]["id"]]["id"] not in seen:
            chain.append(nxt[chain[-1]["id"]])
            seen.add(chain[-1]["id"])
        out.append(chain)
    return out


def _db_content(v: Any) -> Any:
    if isinstance(v, str) and v.startswith(JSON_PREFIX):
        try:
            return json.loads(v[len(JSON_PREFIX) :])
        except json.JSONDecodeError:
            return v
    return v


def chain_messages(segments: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """A chain's messages, session after session, without the hand-off a compression replays into its
    continuation (a message of a later session already seen earlier in the chain)."""
    out: list[dict[str, Any]] = []
    seen: set[Any] = set()
    for k, rows in enumerate(segments):
        for r in rows:
            m = {c: r[c] for c in MESSAGE_COLUMNS if r.get(c) is not None}
            m["content"] = _db_content(m.get("content"))
            key = _key([m.get("role"), m.get("content"), m.get("tool_call_id"), m.get("tool_calls")])
            if k and key in seen:
                continue
            seen.add(key)
            out.append(m)
    return out


def _key(parts: list[Any]) -> bytes | str:
    """A message's identity for the hand-off test: orjson's text, json's (str for the rest) when orjson refuses."""
    try:
        return orjson.dumps(parts)
    except (TypeError, orjson.JSONEncodeError):
        return json.dumps(parts, default=str)


def tools_for(
    chain: list[dict[str, Any]], logged: Any, system_prompt: Any, snapshots: Path | None
) -> tuple[list[dict[str, Any]], str]:
    """(tools, where they came from): the log's own, a session's JSON snapshot in ``snapshots``, the system
    prompt's ``<tools>`` block, else none."""
    if isinstance(logged, list) and logged:
        return tools_of(logged, ""), "log"
    for s in chain if snapshots is not None else []:
        f = snapshots / f"session_{s['id']}.json"
        try:
            snap = json.loads(f.read_bytes())
        except (OSError, ValueError):
            continue
        if isinstance(snap, dict) and isinstance(snap.get("tools"), list) and snap["tools"]:
            if lone_surrogate(snap["tools"]) is not None:
                raise Invalid("invalid Unicode", f"{f.name}: lone surrogate escape in tools")
            return tools_of(snap["tools"], f"{f.name}: "), "snapshot"
    if isinstance(system_prompt, str) and "<tools>" in system_prompt:
        _, found = system_tools(system_prompt, "system prompt")
        if found:
            return found, "system_prompt"
    return [], "none"


def chain_record(
    chain: list[dict[str, Any]],
    raw_msgs: list[dict[str, Any]],
    tools: tuple[list[dict[str, Any]], str],
    source: dict[str, Any],
    root_of: dict[str, str],
    max_chars: int,
) -> dict[str, Any]:
    """A chain's record: checked messages, the tools found for it, the tip's end and the chain's api calls."""
    root, tip = chain[0], chain[-1]
    msgs = check_messages(raw_msgs, max_chars)
    last = next((m for m in reversed(raw_msgs) if m.get("role") == "assistant"), {})
    signals: dict[str, Any] = {"end_reason": tip.get("end_reason")}
    if last.get("finish_reason"):
        signals["finish_reason"] = last["finish_reason"]
    if any(s.get("api_call_count") is not None for s in chain):
        signals["api_calls"] = sum(int(s.get("api_call_count") or 0) for s in chain)
    parent = root.get("parent_session_id")
    meta = {"sessions": [s["id"] for s in chain], "source_platform": root.get("source"), "tools_from": tools[1]}
    if root.get("title"):
        meta["title"] = root["title"]
    return make_record(
        msgs,
        tools[0],
        source,
        conversation_id=root["id"],
        model=tip.get("model") or root.get("model"),
        started_at=root.get("started_at"),
        ended_at=tip.get("ended_at"),
        outcome=outcome_of(msgs, tools[0], **signals),
        parent_conversation_id=root_of.get(parent, parent) if parent else None,
        meta=meta,
    )


# ----------------------------------------------------------------------------------------- state.db
def open_state_db(path: Path) -> sqlite3.Connection:
    """state.db read-only. A live store (its -wal file beside it) is read through SQLite's read-only mode,
    which sees the agent's latest commits; a store at rest is opened immutable: no lock taken, no -wal or
    -shm file created next to it, nothing written."""
    uri = Path(os.path.abspath(path)).as_uri()
    live = Path(f"{path}-wal").exists()
    con = sqlite3.connect(f"{uri}?mode=ro" if live else f"{uri}?mode=ro&immutable=1", uri=True)
    con.row_factory = sqlite3.Row
    # a row's invalid UTF-8 is kept as lone surrogates, and its conversation rejected by name (_bad_text):
    # SQLite's default decode raised, which rejected the whole store for one bad row
    con.text_factory = lambda b: b.decode("utf-8", "surrogateescape")
    return con


def _bad_text(chain: list[dict[str, Any]], raw_msgs: list[dict[str, Any]]) -> str | None:
    """Where a chain holds text that no UTF-8 writer (or Arrow) takes: a lone surrogate from a ``\\ud800``
    escape in a message's JSON content, or invalid UTF-8 in a row (``open_state_db``'s surrogateescape)."""
    for i, m in enumerate(raw_msgs):
        if (field := lone_surrogate(m)) is not None:
            return f"messages[{i}].{field}"
    for sess in chain:
        if (field := lone_surrogate(sess)) is not None:
            return f"session {sess.get('id')!a} {field}"
    return None


def iter_state_db(path: Path, max_chars: int, info: dict[str, Any]) -> Iterator[tuple[Any, ...]]:
    """Each conversation of a state.db; its tools from the snapshots in ``sessions/`` beside it."""
    con = open_state_db(path)
    snapshots = path.parent / "sessions"
    tools_from: Counter = info.setdefault("tools_from", Counter())
    try:
        scols = {r[1] for r in con.execute("PRAGMA table_info(sessions)")}
        mcols = {r[1] for r in con.execute("PRAGMA table_info(messages)")}
        keep = ("id", "source", "model", "model_config", "parent_session_id", "started_at", "ended_at", "end_reason")
        keep += ("api_call_count", "title")
        cols = ", ".join(c for c in keep if c in scols)  # the system prompts are read per conversation
        sessions = [dict(r) for r in con.execute(f"SELECT {cols} FROM sessions ORDER BY started_at, id")]
        found = chains(sessions)
        root_of = {s["id"]: c[0]["id"] for c in found for s in c}
        want = ", ".join(c for c in MESSAGE_COLUMNS if c in mcols)
        active = " AND active = 1" if "active" in mcols else ""  # rewound (soft-deleted) rows are not the transcript
        for chain in found:
            root = chain[0]
            segments = [
                [
                    dict(r)
                    for r in con.execute(
                        f"SELECT {want} FROM messages WHERE session_id = ?{active} ORDER BY id", (s["id"],)
                    )
                ]
                for s in chain
            ]
            sp = None
            if "system_prompt" in scols:
                sp = con.execute("SELECT system_prompt FROM sessions WHERE id = ?", (root["id"],)).fetchone()[0]
            raw_msgs = with_system(chain_messages(segments), sp)
            raw = json.dumps(
                {"session": root["id"], "chain": [s["id"] for s in chain], "messages": raw_msgs}, default=str
            )
            # json.dumps escapes every non-ASCII character: "\\ud" is in the text of any surrogate (pairs too)
            if "\\ud" in raw and (bad := _bad_text(chain, raw_msgs)) is not None:
                yield (
                    root["id"],
                    str(path),
                    None,
                    raw,
                    Invalid("invalid Unicode", f"invalid UTF-8 or a lone surrogate in {bad}"),
                )
                continue
            try:
                tools = tools_for(chain, None, sp, snapshots)
                rec = chain_record(
                    chain, raw_msgs, tools, where("hermes_state", str(path), None, root["id"]), root_of, max_chars
                )
                tools_from[tools[1]] += 1
                yield root["id"], str(path), None, raw, rec
            except Invalid as e:
                yield root["id"], str(path), None, raw, e
    finally:
        con.close()


# --------------------------------------------------------------------------------- hermes export JSONL
def iter_export(path: Path, max_chars: int, cap: int, budget: int, info: dict[str, Any]) -> Iterator[tuple[Any, ...]]:
    """``hermes sessions export`` JSONL: a torn or foreign line is rejected by its line; each chain of sessions
    is one conversation (its lines read a second time past the memory budget: ``grouping.Kept``)."""
    kept = Kept([path], cap, budget)
    sessions: list[dict[str, Any]] = []
    seen: set[str] = set()
    repeats: list[int] = []
    tools_from: Counter = info.setdefault("tools_from", Counter())
    for ln, size, obj in read_lines(path, cap):
        if obj is None:
            info["blank"] = info.get("blank", 0) + 1
            continue
        if isinstance(obj, Bad):
            yield None, str(path), ln, obj.raw, obj.error
            continue
        if not isinstance(obj, dict):
            yield None, str(path), ln, json.dumps(obj), Invalid("not a JSON object", f"got a JSON {type(obj).__name__}")
            continue
        sid = obj.get("id")
        if not isinstance(sid, str) or not sid or not isinstance(obj.get("messages"), list):
            missing = "id" if not isinstance(sid, str) or not sid else "messages"
            text = json.dumps(obj)[:4096]
            yield (
                None,
                str(path),
                ln,
                text,
                Invalid(f"missing field '{missing}'", f"present: {', '.join(list(obj)[:12])}"),
            )
            continue
        if sid in seen:  # the same session exported twice: its own conversation (prep's id index finds it)
            repeats.append(ln)
        else:
            seen.add(sid)
            s = {k: obj.get(k) for k in ("id", "parent_session_id", "end_reason", "model_config", "started_at")}
            sessions.append(s | {"_line": ln, "_size": size})
        kept.keep((0, ln), obj, size)
    sessions.sort(key=lambda s: (s["started_at"] if isinstance(s["started_at"], (int, float)) else 0, s["_line"]))
    found = chains(sessions)
    root_of = {s["id"]: c[0]["id"] for c in found for s in c}
    units = [[s["_line"] for s in c] for c in found] + [[ln] for ln in repeats]
    sizes = {s["_line"]: s["_size"] for s in sessions}
    for batch in kept.batches(units, lambda u: [(0, ln) for ln in u], lambda k: sizes.get(k[1], 0)):
        objs = kept.fetch({(0, ln) for u in batch for ln in u})
        for unit in batch:
            rows = [objs[(0, ln)] for ln in unit]
            chain = [{**{k: v for k, v in r.items() if k != "messages"}} for r in rows]
            root = rows[0]
            raw_msgs = with_system(
                chain_messages([[m for m in r["messages"] if isinstance(m, dict)] for r in rows]),
                root.get("system_prompt"),
            )
            raw = json.dumps(
                {"session": root["id"], "lines": unit, "messages": raw_msgs}, default=str, ensure_ascii=False
            )
            src = where("hermes_export", str(path), unit[0], root["id"])
            try:
                bad = next((k for r in rows for k, m in enumerate(r["messages"]) if not isinstance(m, dict)), None)
                if bad is not None:
                    raise Invalid("bad message", f"message {bad} is not an object")
                tools = tools_for(chain, root.get("tools"), root.get("system_prompt"), None)
                rec = chain_record(chain, raw_msgs, tools, src, root_of, max_chars)
                tools_from[tools[1]] += 1
                yield root["id"], str(path), None, raw, rec
            except Invalid as e:
                yield root["id"], str(path), None, raw, e
