"""Claude Code / Agent Trace JSONL as canonical conversation records (stage: prep, format ``claude_code``).

Reads, never writes: what ``hermes sessions export out.jsonl --format trace`` writes (hermes-agent 0.19.0; the
format of the Hugging Face Agent Trace Viewer) and Claude Code's own session logs
(``~/.claude/projects/<project>/<session>.jsonl``, its sub-agents in ``<session>/subagents/agent-<id>.jsonl``):
one line a message, ``{"type": "user" | "assistant", "sessionId", "uuid", "parentUuid", "isSidechain",
"message": {"role", "content": text or blocks}, "timestamp", ...}``, plus lines outside the conversation
(summary, file-history-snapshot, system, progress, ...), which are skipped and counted.

A file, or a folder (every trace file under it: a session split across files, a sub-agent in a file of its own,
are read as one session). The lines are grouped by ``sessionId``; a session's main conversation is the
``parentUuid`` chain from its latest tip (a line no other line names as parent) back to its root, in chain order
whatever the order of the lines (a compaction's boundary followed through its ``logicalParentUuid``), the
branches off it (edits, retries) counted in ``meta.off_path_lines``; its sidechains (``isSidechain``: a Task
sub-agent, grouped by ``agentId`` or by their own root) are conversations of their own, with
``parent_conversation_id`` the session's. Blocks become OpenAI messages: ``text`` the content, ``thinking`` the
reasoning, ``tool_use`` a tool call (its ``input`` as JSON arguments), ``tool_result`` a tool message answering
its ``tool_use_id`` (``is_error`` kept on it as ``"is_error": true`` and counted in the outcome's tool errors),
``image`` / ``document`` a placeholder; consecutive assistant lines of one API message (one ``message.id``) are
one message, and harness lines (``isMeta``) are left out. The trace holds no system prompt and no tool schemas
(hermes-agent drops the system message from a trace).

Rejected, by line: a line that is no JSON object, or a message line without its sessionId / uuid. By session
(its id and the line at fault named): a chain that breaks (a parentUuid that no line of the session holds, as
when a line is torn or the session continues in a file not given, or a cycle), an unknown content block type, a
message longer than ``conversations.max_message_chars``, and whatever ``record.check_messages`` refuses
(a tool result without its call, ...).

    hermes-lab prep --input ~/.claude/projects/-home-me-myproject traces/ --output DIR
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hermes_lab.logs.grouping import Bad, Kept, read_lines
from hermes_lab.logs.record import Invalid, check_messages, is_tool_error, make_record, outcome_of, where

MESSAGE_TYPES = ("user", "assistant")


class Node:
    """One chain line of a session, as the first pass saw it."""

    __slots__ = ("agent", "key", "logical", "meta", "parent", "side", "size", "stamp", "type", "uuid")

    def __init__(self, key: tuple[int, int], size: int, obj: dict[str, Any]):
        self.key, self.size = key, size
        self.uuid, self.parent = obj["uuid"], obj.get("parentUuid")
        self.logical = obj.get("logicalParentUuid")  # a compaction boundary: the chain before it
        self.type, self.side = obj.get("type"), obj.get("isSidechain") is True
        agent = obj.get("agentId")
        self.agent = agent if isinstance(agent, str) and agent else None
        stamp = obj.get("timestamp")
        self.stamp = stamp if isinstance(stamp, str) else ""
        self.meta = obj.get("isMeta") is True


class Session:
    __slots__ = ("first", "nodes", "order", "repeats", "sid")

    def __init__(self, sid: str, first: tuple[int, int]):
        self.sid, self.first = sid, first
        self.nodes: dict[str, Node] = {}
        self.order: list[Node] = []
        self.repeats = 0  # lines whose uuid the session already holds (a file given twice, a copied line)


def iter_traces(
    files: list[Path], max_chars: int, cap: int, budget: int, info: dict[str, Any]
) -> Iterator[tuple[Any, ...]]:
    """(session, file, line, raw, record or Invalid) for every torn line and every conversation of the files."""
    kept = Kept(files, cap, budget)
    sessions: dict[str, Session] = {}
    skipped = 0
    for fi, f in enumerate(files):
        for ln, size, obj in read_lines(f, cap):
            if obj is None:
                info["blank"] = info.get("blank", 0) + 1
                continue
            if isinstance(obj, Bad):
                yield None, str(f), ln, obj.raw, obj.error
                continue
            if not isinstance(obj, dict):
                yield (
                    None,
                    str(f),
                    ln,
                    json.dumps(obj)[:4096],
                    Invalid("not a JSON object", f"got a JSON {type(obj).__name__}"),
                )
                continue
            if "uuid" not in obj and obj.get("type") not in MESSAGE_TYPES:
                skipped += 1  # summary, file-history-snapshot, queue operations: not part of the chain
                continue
            sid, uid = obj.get("sessionId"), obj.get("uuid")
            missing = (
                "sessionId"
                if not isinstance(sid, str) or not sid
                else "uuid"
                if not isinstance(uid, str) or not uid
                else None
            )
            if missing:
                present = ", ".join(list(obj)[:12])
                yield (
                    None,
                    str(f),
                    ln,
                    json.dumps(obj)[:4096],
                    Invalid(f"missing field '{missing}'", f"present: {present}"),
                )
                continue
            s = sessions.get(sid)
            if s is None:
                s = sessions[sid] = Session(sid, (fi, ln))
            if uid in s.nodes:
                s.repeats += 1
                continue
            node = Node((fi, ln), size, obj)
            s.nodes[uid] = node
            s.order.append(node)
            kept.keep((fi, ln), obj, size)
    info["skipped_lines"] = info.get("skipped_lines", 0) + skipped
    units: list[tuple[Session, list[Node], list[Node] | Invalid, str | None]] = []
    for s in sorted(sessions.values(), key=lambda s: s.first):
        units += _units(s)
    sizes = {n.key: n.size for s in sessions.values() for n in s.order}

    def lines_of(u: Any) -> list[tuple[int, int]]:
        return [n.key for n in u[2]] if isinstance(u[2], list) else []

    for batch in kept.batches(units, lines_of, lambda k: sizes.get(k, 0)):
        objs = kept.fetch({k for u in batch for k in lines_of(u)})
        for s, members, path, agent in batch:
            first = path[0] if isinstance(path, list) and path else members[0]
            file = str(files[first.key[0]])
            cid = s.sid if agent is None else f"{s.sid}/{agent}"
            raw = json.dumps(
                {
                    "session": s.sid,
                    "agent": agent,
                    "lines": [_at(files, n) for n in (path if isinstance(path, list) else members)][:200],
                }
            )
            if isinstance(path, Invalid):
                yield cid, file, None, raw, path
                continue
            try:
                rec = _record(s, members, path, agent, [objs[n.key] for n in path], files, max_chars)
                yield cid, file, None, raw, rec
            except Invalid as e:
                yield cid, file, None, raw, e


def _at(files: list[Path], n: Node) -> str:
    return f"{files[n.key[0]].name}:{n.key[1]}"


# ------------------------------------------------------------------------------------------- chains
def _units(s: Session) -> list[tuple[Session, list[Node], list[Node] | Invalid, str | None]]:
    """The session's conversations: (session, its lines, its chain root first or why it has none, agent id)."""
    main = [n for n in s.order if not n.side]
    groups: dict[str, list[Node]] = {}
    for n in s.order:
        if n.side:
            groups.setdefault(n.agent or _side_root(s, n), []).append(n)
    out = []
    if any(n.type in MESSAGE_TYPES for n in main):
        out.append((s, main, _chain(s, main, side=False), None))
    for agent, members in groups.items():
        if any(n.type in MESSAGE_TYPES for n in members):
            out.append((s, members, _chain(s, members, side=True), agent))
    return out


def _side_root(s: Session, n: Node) -> str:
    """A sidechain line without an agentId: named after the first line of its own chain."""
    seen = set()
    while n.parent in s.nodes and s.nodes[n.parent].side and n.uuid not in seen:
        seen.add(n.uuid)
        n = s.nodes[n.parent]
    return "side-" + n.uuid[:8]


def _chain(s: Session, members: list[Node], side: bool) -> list[Node] | Invalid:
    """The conversation's lines root first: from the latest tip (a message line no other line names as its parent;
    later timestamp, then later in the input) back through parentUuid (and a compaction's logicalParentUuid)."""
    named = {n.parent for n in members} | {n.logical for n in members}
    tips = [n for n in members if n.uuid not in named and n.type in MESSAGE_TYPES]
    if not tips:
        return Invalid(
            "broken parentUuid chain",
            f"session {s.sid}: no last message (every line names another as its parent: a cycle)",
        )
    tip = max(tips, key=lambda n: (n.stamp, n.key))
    path, seen = [], set()
    n: Node | None = tip
    while n is not None:
        if n.uuid in seen:
            return Invalid(
                "broken parentUuid chain", f"session {s.sid}: the chain through line {n.key[1]} loops back to it"
            )
        seen.add(n.uuid)
        path.append(n)
        up = n.parent or (n.logical if n.logical in s.nodes else None)
        if up is None:
            break
        nxt = s.nodes.get(up)
        if nxt is None or (side and not nxt.side):  # a sidechain's chain ends where it leaves the sidechain
            if nxt is None:
                return Invalid(
                    "broken parentUuid chain",
                    f"session {s.sid}: line {n.key[1]} names parent {str(up)[:40]!r}, which no line of the session "
                    "holds (a torn line, or the session continues in a file not given: give their folder)",
                )
            break
        n = nxt
    path.reverse()
    return path


# ----------------------------------------------------------------------------------------- messages
def _text(v: Any, at: str, max_chars: int) -> str:
    """A tool result's or a message's content (text or blocks) as text."""
    if isinstance(v, str):
        text = v
    elif isinstance(v, list):
        parts = []
        for b in v:
            kind = b.get("type") if isinstance(b, dict) else None
            if kind == "text" and isinstance(b.get("text"), str):
                parts.append(b["text"])
            elif kind in ("image", "document"):
                parts.append(f"[{kind}]")
            else:
                raise Invalid("unknown content block", f"{at}: a block of type {str(kind)[:40]!r} in a tool result")
        text = "\n".join(parts)
    elif v is None:
        text = ""
    else:
        raise Invalid("bad message content", f"{at}: content is a JSON {type(v).__name__}")
    if len(text) > max_chars:
        raise Invalid("message too long", f"{at}: {len(text)} characters > conversations.max_message_chars {max_chars}")
    return text


def _messages(
    objs: list[dict[str, Any]], ats: list[str], max_chars: int
) -> tuple[list[dict[str, Any]], list[bool], dict[str, int]]:
    """OpenAI messages from the chain's lines, each tool message's is_error, and what was left out."""
    raw: list[dict[str, Any]] = []
    errors: list[bool] = []
    left = {"meta": 0, "other": 0, "redacted_thinking": 0}
    last_id = None  # the API message id of the assistant message being built
    for obj, at in zip(objs, ats):
        kind = obj.get("type")
        if kind not in MESSAGE_TYPES:
            left["other"] += 1
            last_id = None
            continue
        if obj.get("isMeta") is True:
            left["meta"] += 1
            continue
        msg = obj.get("message")
        if not isinstance(msg, dict):
            raise Invalid("bad message", f"{at}: a {kind} line without a message object")
        content = msg.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            raise Invalid("bad message content", f"{at}: content is a JSON {type(content).__name__}")
        if kind == "user":
            last_id = None
            texts = []
            for b in blocks:
                t = b.get("type") if isinstance(b, dict) else None
                if t == "tool_result":
                    cid = b.get("tool_use_id")
                    raw.append({"role": "tool", "tool_call_id": cid if isinstance(cid, str) else None,
                                "content": _text(b.get("content"), at, max_chars)})  # fmt: skip
                    errors.append(b.get("is_error") is True)
                elif t == "text" and isinstance(b.get("text"), str):
                    texts.append(b["text"])
                elif t in ("image", "document"):
                    texts.append(f"[{t}]")
                else:
                    raise Invalid("unknown content block", f"{at}: a user block of type {str(t)[:40]!r}")
            if texts:
                text = "\n".join(texts)
                if len(text) > max_chars:
                    raise Invalid(
                        "message too long",
                        f"{at}: {len(text)} characters > conversations.max_message_chars {max_chars}",
                    )
                raw.append({"role": "user", "content": text})
                errors.append(False)
            continue
        mid = msg.get("id") if isinstance(msg.get("id"), str) else None
        if mid is not None and mid == last_id and raw and raw[-1]["role"] == "assistant":
            m = raw[-1]  # the next block of the same API message (Claude Code logs one line per block)
        else:
            m = {"role": "assistant", "content": None}
            raw.append(m)
            errors.append(False)
        last_id = mid
        for b in blocks:
            t = b.get("type") if isinstance(b, dict) else None
            if t == "text" and isinstance(b.get("text"), str):
                m["content"] = (m["content"] + "\n" if m["content"] else "") + b["text"] if b["text"] else m["content"]
            elif t == "thinking" and isinstance(b.get("thinking"), str):
                m["reasoning"] = (m["reasoning"] + "\n" if m.get("reasoning") else "") + b["thinking"]
            elif t == "redacted_thinking":
                left["redacted_thinking"] += 1
            elif t == "tool_use" and isinstance(b.get("name"), str):
                args = b.get("input", {})
                if not isinstance(args, dict):
                    raise Invalid(
                        "tool call arguments not JSON", f"{at}: tool_use {b['name'][:40]!r} input is not an object"
                    )
                call = {"id": b.get("id") if isinstance(b.get("id"), str) else None, "type": "function",
                        "function": {"name": b["name"], "arguments": json.dumps(args, ensure_ascii=False)}}  # fmt: skip
                m.setdefault("tool_calls", []).append(call)
            else:
                raise Invalid("unknown content block", f"{at}: an assistant block of type {str(t)[:40]!r}")
        if m["content"] is not None and len(m["content"]) > max_chars:
            raise Invalid(
                "message too long",
                f"{at}: {len(m['content'])} characters > conversations.max_message_chars {max_chars}",
            )
    return raw, errors, left


def _record(
    s: Session,
    members: list[Node],
    path: list[Node],
    agent: str | None,
    objs: list[dict[str, Any]],
    files: list[Path],
    max_chars: int,
) -> dict[str, Any]:
    ats = [f"{files[n.key[0]].name} line {n.key[1]}" for n in path]
    raw, errors, left = _messages(objs, ats, max_chars)
    msgs = check_messages(raw, max_chars)
    flagged = 0
    for m, err in zip(msgs, errors):
        if m["role"] == "tool" and (err or is_tool_error(m["content"])):
            flagged += 1
            if err:
                m["is_error"] = True
    model = next(
        (
            o["message"].get("model")
            for o in reversed(objs)
            if o.get("type") == "assistant" and isinstance(o.get("message"), dict)
        ),
        None,
    )
    first = next((o for o in objs if o.get("type") in MESSAGE_TYPES), objs[0])
    meta: dict[str, Any] = {
        k: first[v] for k, v in (("cwd", "cwd"), ("git_branch", "gitBranch"), ("version", "version")) if first.get(v)
    }
    meta["off_path_lines"] = len(members) - len(path)
    if s.repeats and agent is None:
        meta["repeated_lines"] = s.repeats
    meta["left_out"] = {k: v for k, v in left.items() if v}
    if agent is not None:
        meta["agent_id"] = agent
    in_files = sorted({files[n.key[0]].name for n in path})
    if len(in_files) > 1:
        meta["files"] = in_files
    stamps = [n.stamp for n in path if n.stamp]
    return make_record(
        msgs,
        [],
        where("claude_code", str(files[path[0].key[0]]), path[0].key[1], s.sid),
        conversation_id=s.sid if agent is None else f"{s.sid}/{agent}",
        model=model if model and model != "unknown" else None,
        started_at=stamps[0] if stamps else None,
        ended_at=stamps[-1] if stamps else None,
        outcome=outcome_of(msgs, [], tool_error_counts={"tool_result": flagged}),
        parent_conversation_id=s.sid if agent is not None else None,
        meta=meta,
    )
