"""Every input shape prep reads, as canonical conversation records (stage: prep; ``hermes_lab.data.conversation``).

Reads, never writes: the files and folders given to ``hermes-lab prep --input`` (with ``--format`` or
``conversations.format`` to force a shape; ``auto`` detects it per input):

  seed               JSONL of ``{"prompt", "response", "reward", "task_id"}`` (``hermes_lab.data.ingest``'s fast path)
  openai             JSONL of ``{"messages": [...], "tools": [...]}`` (OpenAI fine-tuning, TRL's conversational
                     datasets, most agent frameworks; also ``{"prompt": [...], "completion": [...]}`` and prep's
                     own accepted records)
  hermes_trajectory  the Hermes Agent's ShareGPT trajectories: ``run_agent.py --save_trajectories``'s
                     ``trajectory_samples.jsonl`` / ``failed_trajectories.jsonl``, its batch runner's
                     ``trajectories.jsonl``, the trajectory compressor's output; ``.jsonl`` or ``.jsonl.gz``
  hermes_session     ``$HERMES_HOME/sessions/session_<id>.json`` files, or a folder of them
  hermes_state       ``$HERMES_HOME/state.db`` (SQLite, opened read-only): a compression chain (sessions linked by
                     ``parent_session_id`` whose parent ended with end_reason "compression") is one conversation,
                     its replayed hand-off messages dropped; sub-agents and branches are conversations of their
                     own with ``parent_conversation_id``

JSONL lines are read (bounded, validated JSON) by the ingest, which hands each object to ``parse_line``;
session files and state.db yield whole records through ``iter_records``. A malformed conversation raises
``conversation.Invalid`` (reason + the turn or message at fault), which the ingest turns into a rejected
line (file, line or session id, reason, detail, raw).

    hermes-lab prep --input trajectory_samples.jsonl failed_trajectories.jsonl ~/.hermes/state.db --output DIR
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hermes_lab.data.conversation import (
    Invalid,
    arguments_text,
    check_messages,
    final_answer,
    make_record,
    outcome_of,
    task_prompt_of,
    text_of,
    tool_schema,
)

JSONL_FORMATS = ("seed", "openai", "hermes_trajectory")
SQLITE_MAGIC = b"SQLite format 3\x00"
SESSION_GLOB = "session_*.json"
HERMES_ROLES = {"system": "system", "human": "user", "gpt": "assistant", "tool": "tool"}


# ------------------------------------------------------------------------------------------ detection
def detect(path: Path, first_object: Any = None) -> str:
    """The format of one input: a folder of session files, a SQLite file, a session JSON file, or JSONL
    whose first object says which (``first_object``: the ingest's decoded first line)."""
    if path.is_dir():
        return "hermes_session"
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
    if "messages" in obj or (isinstance(obj.get("prompt"), list) and isinstance(obj.get("completion"), list)):
        return "openai"
    return "seed"


def where(fmt: str, file: str, line: int | None = None, session: str | None = None) -> dict[str, Any]:
    return {"format": fmt, "file": file, "line": line, "session": session}


# ------------------------------------------------------------------------------------------ JSONL lines
def parse_line(obj: Any, fmt: str, file: str, line: int, scale: float, max_chars: int) -> dict[str, Any]:
    """One JSONL object of an openai or hermes_trajectory file as a record; Invalid names what is wrong."""
    if type(obj) is not dict:
        raise Invalid("not a JSON object", f"got a JSON {type(obj).__name__}")
    if fmt == "hermes_trajectory":
        return from_trajectory(obj, file, line, max_chars)
    return from_openai(obj, file, line, scale, max_chars)


def _reward(obj: dict[str, Any], scale: float) -> tuple[float | None, str | None]:
    r = obj.get("reward")
    if r is None:
        return None, None
    if type(r) is not float and type(r) is not int:
        raise Invalid("reward not a number", f"reward is {json.dumps(r)[:40]}")
    if not 0 <= r <= scale:
        raise Invalid("reward out of range", f"reward {r} outside 0..{scale:g}")
    src = obj.get("reward_source")
    return float(r), src if isinstance(src, str) and src else "log"


def _tools(raw: Any, at: str) -> list[dict[str, Any]]:
    if raw is None:
        return []
    if isinstance(raw, str):  # a JSON text column (prep's own conversations dataset)
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError:
            raise Invalid("bad tool schema", f"{at}tools is text that is not JSON") from None
    if not isinstance(raw, list):
        raise Invalid("bad tool schema", f"{at}tools is not a list")
    return [tool_schema(t, f"{at}tool {k}") for k, t in enumerate(raw)]


def from_openai(obj: dict[str, Any], file: str, line: int | None, scale: float, max_chars: int) -> dict[str, Any]:
    """``{"messages", "tools"?, "id" | "conversation_id"?, "task_id"?, "reward"?, "model"?, ...}``."""
    raw = obj.get("messages")
    if raw is None and isinstance(obj.get("prompt"), list):  # TRL's conversational prompt / completion
        raw = obj["prompt"] + (obj.get("completion") or [])
    if raw is None:
        raise Invalid("missing field 'messages'", f"present: {', '.join(list(obj)[:12])}")
    msgs = check_messages(raw, max_chars)
    tools = _tools(obj.get("tools"), "")
    reward, rsrc = _reward(obj, scale)
    logged = obj.get("outcome") if isinstance(obj.get("outcome"), dict) else {}
    signals = {k: obj.get(k, logged.get(k)) for k in ("completed", "partial", "end_reason", "api_calls")}
    signals = {k: v for k, v in signals.items() if v is not None}
    meta = obj.get("meta") if isinstance(obj.get("meta"), dict) else {}
    if isinstance(obj.get("source"), dict):
        meta = {**meta, "logged_source": obj["source"]}
    return make_record(
        msgs,
        tools,
        where("openai", file, line),
        conversation_id=obj.get("conversation_id") or obj.get("id"),
        task_id=obj.get("task_id"),
        model=obj.get("model"),
        started_at=obj.get("started_at") or obj.get("timestamp"),
        ended_at=obj.get("ended_at"),
        outcome=outcome_of(msgs, tools, **signals),
        reward=reward,
        reward_source=rsrc,
        family=obj.get("family"),
        parent_conversation_id=obj.get("parent_conversation_id"),
        meta=meta,
    )


# ------------------------------------------------------------------------------------- Hermes ShareGPT
def _blocks(value: str, kinds: tuple[str, ...], at: str) -> list[tuple[str | None, str]]:
    """``value`` split into (tag, body) blocks of the given tags and (None, text) around them. Inside a block
    only its own closing tag counts (a <think> may mention <tool_call>); an unclosed or stray tag is Invalid."""
    out: list[tuple[str | None, str]] = []
    pos = 0
    while True:
        starts = [(value.find(f"<{k}>", pos), k) for k in kinds]
        starts = [(i, k) for i, k in starts if i >= 0]
        stray = [(value.find(f"</{k}>", pos), k) for k in kinds]
        stray = [(i, k) for i, k in stray if i >= 0]
        if not starts:
            if stray:
                i, k = min(stray)
                raise Invalid("broken tag", f"{at}: </{k}> at character {i} closes nothing")
            out.append((None, value[pos:]))
            return out
        i, k = min(starts)
        if stray and min(stray)[0] < i:
            j, sk = min(stray)
            raise Invalid("broken tag", f"{at}: </{sk}> at character {j} closes nothing")
        out.append((None, value[pos:i]))
        body_at = i + len(k) + 2
        end = value.find(f"</{k}>", body_at)
        if end < 0:
            raise Invalid("broken tag", f"{at}: <{k}> at character {i} is never closed")
        out.append((k, value[body_at:end]))
        pos = end + len(k) + 3


def _json_body(body: str, what: str, at: str) -> dict[str, Any]:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        raise Invalid(f"malformed {what}", f"{at}: {e.msg} at column {e.colno}: {body.strip()[:60]!r}") from None
    if not isinstance(obj, dict):
        raise Invalid(f"malformed {what}", f"{at}: a JSON {type(obj).__name__}, not an object")
    return obj


@functools.lru_cache(maxsize=64)
def _system_tools(value: str, at: str) -> tuple[str, list[dict[str, Any]]]:
    """The system turn without its ``<tools>[...]</tools>`` block, and those tools as OpenAI schemas. Cached:
    the lines of one run repeat the same system turn, and its records share the parsed list (never mutated)."""
    i = value.rfind("<tools>")  # the block itself: Hermes's preamble names "<tools> </tools> XML tags" first
    if i < 0:
        return value, []
    j = value.find("</tools>", i)
    if j < 0:
        raise Invalid("broken tag", f"{at}: <tools> at character {i} is never closed")
    body = value[i + 7 : j]
    try:
        raw = json.loads(body)
    except json.JSONDecodeError as e:
        raise Invalid("bad tool schema", f"{at}: <tools> is not JSON ({e.msg} at column {e.colno})") from None
    return value[:i] + value[j + 8 :], _tools(raw, f"{at}: ")


def trajectory_messages(turns: Any, max_chars: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Hermes ShareGPT turns as (OpenAI messages, tools): <think> -> reasoning, each <tool_call> -> a call,
    each <tool_response> -> a tool message answering the preceding turn's calls in order."""
    if not isinstance(turns, list) or not turns:
        raise Invalid("empty conversation", "conversations must be a non-empty list of turns")
    msgs: list[dict[str, Any]] = []
    tools: list[dict[str, Any]] = []
    open_calls: list[dict[str, Any]] | None = None  # the last gpt turn's calls, until a tool turn answers them
    for t, turn in enumerate(turns):
        at = f"turn {t}"
        if not isinstance(turn, dict) or turn.get("from") not in HERMES_ROLES or not isinstance(turn.get("value"), str):
            raise Invalid("bad turn", f"{at}: needs from (system, human, gpt, tool) and a text value")
        kind, value = turn["from"], turn["value"]
        at = f"turn {t} ({kind})"
        if len(value) > max_chars:
            raise Invalid(
                "message too long", f"{at}: {len(value)} characters > conversations.max_message_chars {max_chars}"
            )
        if kind == "system":
            text, found = _system_tools(value, at)
            tools = found if not tools else tools + found
            msgs.append({"role": "system", "content": text.strip()})
        elif kind == "human":
            msgs.append({"role": "user", "content": value})
            open_calls = None
        elif kind == "gpt":
            reasoning, text, calls = [], [], []
            for tag, body in _blocks(value, ("think", "tool_call"), at):
                if tag == "think":
                    reasoning.append(body.strip())
                elif tag == "tool_call":
                    c = _json_body(body, "tool call", f"{at} call {len(calls)}")
                    if not isinstance(c.get("name"), str) or not c["name"].strip():
                        raise Invalid("malformed tool call", f"{at} call {len(calls)}: no name")
                    args = arguments_text(c.get("arguments", {}), f"{at} call {len(calls)} ({c['name']})")
                    calls.append({"type": "function", "function": {"name": c["name"], "arguments": args}})
                else:
                    text.append(body)
            m: dict[str, Any] = {"role": "assistant", "content": "".join(text).strip() or None}
            if any(reasoning):
                m["reasoning"] = "\n".join(r for r in reasoning if r)
            if calls:
                m["tool_calls"] = calls
            msgs.append(m)
            open_calls = calls or None
        else:
            results = []
            for tag, body in _blocks(value, ("tool_response",), at):
                if tag is None:
                    if body.strip():
                        raise Invalid("broken tag", f"{at}: text outside <tool_response>: {body.strip()[:40]!r}")
                    continue
                results.append(_json_body(body, "tool response", f"{at} result {len(results)}"))
            if not open_calls:
                raise Invalid("tool result without a call", f"{at}: the turn before it called no tool")
            if len(results) > len(open_calls):
                raise Invalid("tool result without a call", f"{at}: {len(results)} results for {len(open_calls)} calls")
            for k, r in enumerate(results):
                call = open_calls[k]
                cid = r.get("tool_call_id")
                call["id"] = cid if isinstance(cid, str) and cid else f"call_{t}_{k}"
                name = r.get("name") if isinstance(r.get("name"), str) and r.get("name") != "unknown" else None
                content = text_of(r.get("content"), f"{at} result {k}")
                msgs.append(
                    {
                        "role": "tool",
                        "tool_call_id": call["id"],
                        "name": name or call["function"]["name"],
                        "content": content,
                    }
                )
            open_calls = None
    return check_messages(msgs, max_chars), tools


def from_trajectory(obj: dict[str, Any], file: str, line: int | None, max_chars: int) -> dict[str, Any]:
    """A Hermes ShareGPT trajectory line (single run, batch runner, compressor) as a record."""
    if "conversations" not in obj:
        raise Invalid("missing field 'conversations'", f"present: {', '.join(list(obj)[:12])}")
    msgs, tools = trajectory_messages(obj["conversations"], max_chars)
    meta_in = obj.get("metadata") if isinstance(obj.get("metadata"), dict) else {}
    completed = obj.get("completed") if isinstance(obj.get("completed"), bool) else None
    if completed is None and Path(file).name.startswith("failed_trajectories"):
        completed = False  # which file a record came from is a signal too
    signals: dict[str, Any] = {"completed": completed}
    if isinstance(obj.get("partial"), bool):
        signals["partial"] = obj["partial"]
    if isinstance(obj.get("api_calls"), int):
        signals["api_calls"] = obj["api_calls"]
    if isinstance(obj.get("tool_error_counts"), dict):
        signals["tool_error_counts"] = obj["tool_error_counts"]
    stamp = obj.get("timestamp") or meta_in.get("timestamp")
    keep = ("prompt_index", "toolsets_used", "tool_stats", "compression_metrics", "metadata")
    meta = {k: obj[k] for k in keep if k in obj}
    # no id in the log: the run's time, model, task and answer (a line copied into two files keeps its id)
    key = "\x00".join([str(stamp), str(obj.get("model")), task_prompt_of(msgs), final_answer(msgs)])
    cid = "hermes-" + hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=8).hexdigest()
    return make_record(
        msgs,
        tools,
        where("hermes_trajectory", file, line),
        conversation_id=obj.get("conversation_id") or cid,
        task_id=obj.get("task_id"),
        model=obj.get("model") or meta_in.get("model"),
        started_at=stamp,
        outcome=outcome_of(msgs, tools, **signals),
        family=obj.get("family"),
        meta=meta,
    )


# ------------------------------------------------------------------------------------- Hermes sessions
def from_session(obj: Any, file: str, max_chars: int) -> dict[str, Any]:
    """A ``session_<id>.json`` snapshot: its system prompt, tools and OpenAI messages."""
    if not isinstance(obj, dict) or not isinstance(obj.get("messages"), list):
        raise Invalid("not a Hermes session", "a session file holds an object with session_id and messages")
    raw = list(obj["messages"])
    sp = obj.get("system_prompt")
    if isinstance(sp, str) and sp.strip() and not (raw and isinstance(raw[0], dict) and raw[0].get("role") == "system"):
        raw.insert(0, {"role": "system", "content": sp})
    msgs = check_messages(raw, max_chars)
    tools = _tools(obj.get("tools"), "")
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


# ----------------------------------------------------------------------------------- Hermes state.db
JSON_PREFIX = "\x00json:"  # hermes_state.SessionDB._CONTENT_JSON_PREFIX: list / dict content stored as JSON


def _db_content(v: Any) -> Any:
    if isinstance(v, str) and v.startswith(JSON_PREFIX):
        try:
            return json.loads(v[len(JSON_PREFIX) :])
        except json.JSONDecodeError:
            return v
    return v


def open_state_db(path: Path) -> sqlite3.Connection:
    """state.db read-only. A live store (its -wal file beside it) is read through SQLite's read-only mode,
    which sees the agent's latest commits; a store at rest is opened immutable: no lock taken, no -wal or
    -shm file created next to it, nothing written."""
    uri = Path(os.path.abspath(path)).as_uri()
    live = Path(f"{path}-wal").exists()
    con = sqlite3.connect(f"{uri}?mode=ro" if live else f"{uri}?mode=ro&immutable=1", uri=True)
    con.row_factory = sqlite3.Row
    return con


def _chains(sessions: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Compression chains, root first (hermes_state.SessionDB.get_compression_lineage's rule): a child whose
    parent ended with "compression" (and that is no /branch) continues its parent."""
    by_id = {s["id"]: s for s in sessions}

    def branch(s: dict[str, Any]) -> bool:
        try:
            cfg = json.loads(s.get("model_config") or "null")
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
    chains = []
    for s in sessions:
        if continues(s) and nxt.get(s["parent_session_id"]) is s:
            continue
        chain, seen = [s], {s["id"]}
        while chain[-1]["id"] in nxt and nxt[chain[-1]["id"]]["id"] not in seen:
            chain.append(nxt[chain[-1]["id"]])
            seen.add(chain[-1]["id"])
        chains.append(chain)
    return chains


def iter_state_db(path: Path, max_chars: int) -> Iterator[tuple[int, str | None, str, dict[str, Any] | Invalid]]:
    """(ordinal, root session id, raw text for a reject, record or Invalid) for each conversation of a state.db."""
    con = open_state_db(path)
    try:
        scols = {r[1] for r in con.execute("PRAGMA table_info(sessions)")}
        mcols = {r[1] for r in con.execute("PRAGMA table_info(messages)")}
        keep = ("id", "source", "model", "model_config", "parent_session_id", "started_at", "ended_at", "end_reason")
        keep += ("api_call_count",)
        cols = ", ".join(c for c in keep if c in scols)  # the system prompts are read per conversation
        sessions = [dict(r) for r in con.execute(f"SELECT {cols} FROM sessions ORDER BY started_at, id")]
        chains = _chains(sessions)
        root_of = {s["id"]: c[0]["id"] for c in chains for s in c}
        want = [
            c
            for c in (
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
            if c in mcols
        ]
        active = " AND active = 1" if "active" in mcols else ""  # rewound (soft-deleted) rows are not the transcript
        for n, chain in enumerate(chains, 1):
            root = chain[0]
            raw_msgs: list[dict[str, Any]] = []
            seen: set[str] = set()
            for k, s in enumerate(chain):
                rows = con.execute(
                    f"SELECT {', '.join(want)} FROM messages WHERE session_id = ?{active} ORDER BY id", (s["id"],)
                )
                for r in rows:
                    m = {c: r[c] for c in want if r[c] is not None}
                    m["content"] = _db_content(m.get("content"))
                    key = json.dumps(
                        [m.get("role"), m.get("content"), m.get("tool_call_id"), m.get("tool_calls")], default=str
                    )
                    if k and key in seen:
                        continue  # the hand-off a compression replays into its continuation
                    seen.add(key)
                    raw_msgs.append(m)
            sp = None
            if "system_prompt" in scols:
                sp = con.execute("SELECT system_prompt FROM sessions WHERE id = ?", (root["id"],)).fetchone()[0]
            if isinstance(sp, str) and sp.strip() and not (raw_msgs and raw_msgs[0].get("role") == "system"):
                raw_msgs.insert(0, {"role": "system", "content": sp})
            raw = json.dumps(
                {"session": root["id"], "chain": [s["id"] for s in chain], "messages": raw_msgs}, default=str
            )
            try:
                msgs = check_messages(raw_msgs, max_chars)
                last = next((m for m in reversed(raw_msgs) if m.get("role") == "assistant"), {})
                tip = chain[-1]
                signals: dict[str, Any] = {"end_reason": tip.get("end_reason")}
                if last.get("finish_reason"):
                    signals["finish_reason"] = last["finish_reason"]
                if "api_call_count" in scols:
                    signals["api_calls"] = sum(int(s.get("api_call_count") or 0) for s in chain)
                parent = root.get("parent_session_id")
                meta = {"sessions": [s["id"] for s in chain], "source_platform": root.get("source")}
                rec = make_record(
                    msgs,
                    [],  # state.db keeps no tool schemas
                    where("hermes_state", str(path), None, root["id"]),
                    conversation_id=root["id"],
                    model=tip.get("model") or root.get("model"),
                    started_at=root.get("started_at"),
                    ended_at=tip.get("ended_at"),
                    outcome=outcome_of(msgs, [], **signals),
                    parent_conversation_id=root_of.get(parent, parent) if parent else None,
                    meta=meta,
                )
                yield n, root["id"], raw, rec
            except Invalid as e:
                yield n, root["id"], raw, e
    finally:
        con.close()


def iter_records(
    path: Path, fmt: str, max_chars: int, max_bytes: int
) -> Iterator[tuple[int, str | None, str, str, dict[str, Any] | Invalid]]:
    """(ordinal, session id, file, raw text, record or Invalid) of a session folder / file or a state.db."""
    if fmt == "hermes_state":
        for n, sid, raw, rec in iter_state_db(path, max_chars):
            yield n, sid, str(path), raw, rec
        return
    for n, f in enumerate(session_files(path), 1):
        size = f.stat().st_size
        if size > max_bytes:
            yield (
                n,
                None,
                str(f),
                "",
                Invalid("line too long", f"session file of {size} bytes > data.max_line_bytes {max_bytes}"),
            )
            continue
        data = f.read_bytes()
        text = data.decode("utf-8", errors="replace")
        try:
            obj = json.loads(data)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            yield n, None, str(f), text, Invalid("malformed JSON", str(e)[:120])
            continue
        try:
            yield (
                n,
                obj.get("session_id") if isinstance(obj, dict) else None,
                str(f),
                text,
                from_session(obj, str(f), max_chars),
            )
        except Invalid as e:
            yield n, obj.get("session_id") if isinstance(obj, dict) else None, str(f), text, e
