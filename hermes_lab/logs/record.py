"""The canonical conversation record: what every agent log becomes before prep distills it (stage: prep).

Reads nothing and writes nothing itself: ``hermes_lab.logs.readers`` turns each input shape (the seed's
trajectories, OpenAI chat JSONL, Hermes ShareGPT trajectories, Hermes session JSON, Hermes ``state.db``) into
this record, ``hermes_lab.prep.ingest`` checks, dedupes and spills it, and prep writes the accepted ones to
``runs/round-NN/prep/accepted.jsonl`` (one record a line) and ``runs/round-NN/prep/conversations/`` (a
Hugging Face dataset with the split and reward, ``CONVERSATION_FEATURES``). Run through ``hermes-lab prep``.

The record (one JSON object; keys always present unless marked optional)::

    conversation_id   str    stable id: the log's own (session id, "id"), else a hash of the content
    task_id           str    what the conversation is about; the train / held-out split hashes it, so every
                             conversation of a task (and every turn of each) lands on one side. The log's own
                             task_id, else "conv-" + sha1 of the first user message
    messages          list   OpenAI chat messages, in order:
                               {"role": "system" | "user", "content": str}
                               {"role": "assistant", "content": str | null, "reasoning": str (optional),
                                "tool_calls": [{"id": str, "type": "function",
                                                "function": {"name": str, "arguments": JSON text of an object}}]
                                (optional, non-empty)}
                               {"role": "tool", "tool_call_id": str, "name": str, "content": str,
                                "is_error": true (optional: a Claude Code tool_result's is_error)}
                             every tool message answers a call of an earlier assistant message of the same
                             exchange (its id); content is text (multimodal parts are flattened to their text)
    tools             list   OpenAI function schemas {"type": "function", "function": {name, description, parameters}}
    source            dict   {"format": seed | openai | hermes_trajectory | hermes_session | hermes_state |
                                         hermes_export | claude_code | atropos,
                              "file": str, "line": int | null, "session": str | null}
    model             str | null
    started_at, ended_at  str | null   ISO 8601 times, when the log says
    outcome           dict   signals for rewards: completed (bool | null), partial (bool | null), inferred (true
                             when completed / partial were read off the messages: the log said nothing),
                             end_reason (str | null), api_calls (int | null), turns (assistant messages),
                             tool_calls, tool_errors (Hermes's own rule, or its logged tool_error_counts),
                             unanswered_calls, unknown_tools (tool names the schemas do not declare), compressed
    reward            float | null   on 0..reward.scale; null until a reward source set it
    reward_source     str | null     "log" (the line carried it), "feedback:<source>" (joined by
                                     conversation_id), "outcome" (the rules of the conversations section),
                                     "judge" (the comparison judge), "atropos" (an Atropos group's score)
    family            str    the embedded task family of the first user message, else the log's "family",
                             else "agent" (tools offered) or "chat"
    parent_conversation_id   str | null   a sub-agent's or branch's parent (state.db)
    meta              dict   what else the log said (Hermes: prompt_index, toolsets_used, tool_stats,
                             compression_metrics, metadata; sessions: platform, base_url)

The seed record ``{"prompt", "response", "reward", "task_id"}`` is the special case of one user and one
assistant message (``from_seed``); prep keeps its fast path for it and still reads it unchanged.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import orjson

ROLES = ("system", "user", "assistant", "tool")
FORMATS = (
    "seed",
    "openai",
    "hermes_trajectory",
    "hermes_session",
    "hermes_state",
    "hermes_export",
    "claude_code",
    "atropos",
)
REWARD_SOURCES = ("log", "feedback", "outcome", "judge", "atropos")  # feedback:<source> counts under feedback
# a compressed conversation's summary turn: Hermes's trajectory compressor's, its live context compressor's,
# Claude Code's compaction summary
SUMMARY_PREFIXES = (
    "[CONTEXT SUMMARY]:",
    "[CONTEXT COMPACTION",
    "This session is being continued from a previous conversation",
)


class Invalid(ValueError):
    """A conversation prep rejects: a short reason (counted) and a detail naming the message or turn."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(reason)
        self.reason, self.detail = reason, detail


# ------------------------------------------------------------------------------------------- helpers
_json_std = json.JSONEncoder(ensure_ascii=False).encode  # json.dumps(v, ensure_ascii=False), its encoder built once
_FLOAT_OK = (float("inf"), float("-inf"))


def _json_text(v: Any) -> str:
    """``json.dumps(v, ensure_ascii=False)`` (a tool result or call arguments as text): its text built from orjson's
    strings (the same escapes for every character) with json's separators and float reprs, several times faster
    on a large result; what that cannot write (a lone surrogate, NaN, a key that is no string, a tuple, an integer
    Python will not print) by the standard encoder, which gives the text or the error it always gave."""
    try:
        return _fast_json(v)
    except (TypeError, ValueError, RecursionError):  # orjson.JSONEncodeError is a TypeError
        return _json_std(v)


def _fast_json(v: Any) -> str:
    t = type(v)
    if t is str:
        return orjson.dumps(v).decode()
    if t is dict:
        if not v:
            return "{}"
        return "{" + ", ".join([f"{_json_key(k)}: {_fast_json(x)}" for k, x in v.items()]) + "}"
    if t is list:
        return "[" + ", ".join([_fast_json(x) for x in v]) + "]"
    if v is None or t is bool:
        return "null" if v is None else "true" if v else "false"
    if t is int:
        return int.__repr__(v)
    if t is float and v == v and v not in _FLOAT_OK:
        return float.__repr__(v)
    raise TypeError("for the standard encoder")


def _json_key(k: Any) -> str:
    if type(k) is not str:
        raise TypeError("for the standard encoder")
    return orjson.dumps(k).decode()


def text_of(content: Any, where: str) -> str | None:
    """Message content as text: a string as is, OpenAI content parts joined (images as "[image]")."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for p in content:
            if isinstance(p, str):
                out.append(p)
            elif isinstance(p, dict) and isinstance(p.get("text"), str):
                out.append(p["text"])
            elif isinstance(p, dict) and str(p.get("type", "")).startswith(("image", "input_image")):
                out.append("[image]")
            else:
                raise Invalid("bad message content", f"{where}: a content part is neither text nor an image")
        return "\n".join(out)
    if isinstance(content, (dict, int, float, bool)):  # a tool result logged as JSON: keep it as JSON text
        return _json_text(content)
    raise Invalid("bad message content", f"{where}: content is a JSON {type(content).__name__}")


def arguments_text(args: Any, where: str) -> str:
    """A tool call's arguments as OpenAI sends them: the JSON text of an object."""
    if isinstance(args, dict):
        return _json_text(args)
    if isinstance(args, str):
        try:
            parsed = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            raise Invalid(
                "tool call arguments not JSON", f"{where}: {e.msg} at column {e.colno}: {args[:60]!r}"
            ) from None
        if not isinstance(parsed, dict):
            raise Invalid(
                "tool call arguments not JSON", f"{where}: arguments are a JSON {type(parsed).__name__}, not an object"
            )
        return args if args.strip() else "{}"
    raise Invalid("tool call arguments not JSON", f"{where}: arguments are a JSON {type(args).__name__}")


def tool_schema(t: Any, where: str) -> dict[str, Any]:
    """An OpenAI function schema from OpenAI's shape or Hermes's trajectory shape ({name, description, parameters})."""
    if isinstance(t, dict) and isinstance(t.get("function"), dict):
        f = t["function"]
    elif isinstance(t, dict) and "name" in t:
        f = t
    else:
        raise Invalid("bad tool schema", f"{where}: a tool is not a function schema")
    if not isinstance(f.get("name"), str) or not f["name"].strip():
        raise Invalid("bad tool schema", f"{where}: a tool has no name")
    fn = {"name": f["name"], "description": str(f.get("description") or ""), "parameters": f.get("parameters") or {}}
    return {"type": "function", "function": fn}


def is_tool_error(content: str | None) -> bool:
    """Hermes's rule (batch_runner._extract_tool_stats): JSON with a non-null "error" (also inside a "content"
    object) or "success": false; other text: empty, or starting with "error:"."""
    if not content:
        return True
    s = content.strip()
    if s[:1] in "{[":
        try:
            obj = orjson.loads(s)  # C; what it refuses, json reads as before (NaN, which json accepts)
        except orjson.JSONDecodeError:
            try:
                obj = json.loads(s)
            except json.JSONDecodeError:
                obj = None
        if isinstance(obj, dict):
            inner = obj.get("content")
            return (
                obj.get("error") is not None
                or (isinstance(inner, dict) and inner.get("error") is not None)
                or obj.get("success") is False
            )
        if obj is not None:
            return False
    return s.lower().startswith("error:")


# ---------------------------------------------------------------------------------------- validation
def check_messages(raw: Any, max_chars: int, where: str = "") -> list[dict[str, Any]]:
    """OpenAI chat messages, checked and normalised (Hermes's drift: ``reasoning_content`` for ``reasoning``,
    ``tool_calls`` stored as a JSON string, ``tool_name`` for ``name``, arguments as an object, a result
    without its call id answered in call order). Raises Invalid naming the message."""
    if not isinstance(raw, list) or not raw:
        raise Invalid("empty conversation", f"{where}messages must be a non-empty list")
    out: list[dict[str, Any]] = []
    pending: dict[str, str] = {}  # call id -> tool name, of the current exchange
    for i, m in enumerate(raw):
        at = f"{where}message {i}"
        if not isinstance(m, dict):
            raise Invalid("bad message", f"{at} is not an object")
        role = m.get("role")
        if role not in ROLES:
            raise Invalid("bad role", f"{at}: role {str(role)[:20]!r} (use {', '.join(ROLES)})")
        content = text_of(m.get("content"), at)
        if content is not None and len(content) > max_chars:
            raise Invalid(
                "message too long",
                f"{at} ({role}): {len(content)} characters > conversations.max_message_chars {max_chars}",
            )
        msg: dict[str, Any] = {"role": role, "content": content}
        if role == "assistant":
            reasoning = m.get("reasoning") or m.get("reasoning_content")
            if reasoning is not None and not isinstance(reasoning, str):
                raise Invalid("bad message", f"{at}: reasoning is not text")
            if reasoning and reasoning.strip():
                msg["reasoning"] = reasoning
            calls = m.get("tool_calls")
            if isinstance(calls, str):  # state.db and some exporters keep them as JSON text
                try:
                    calls = json.loads(calls) if calls.strip() else None
                except json.JSONDecodeError:
                    raise Invalid("bad tool calls", f"{at}: tool_calls is text that is not JSON") from None
            if calls:
                if not isinstance(calls, list):
                    raise Invalid("bad tool calls", f"{at}: tool_calls is not a list")
                msg["tool_calls"] = []
                pending = {}
                for k, c in enumerate(calls):
                    cat = f"{at} call {k}"
                    fn = c.get("function") if isinstance(c, dict) else None
                    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"].strip():
                        raise Invalid("bad tool calls", f"{cat}: no function name")
                    cid = c.get("id") if isinstance(c.get("id"), str) and c.get("id") else f"call_{i}_{k}"
                    args = arguments_text(fn.get("arguments", "{}"), f"{cat} ({fn['name']})")
                    call = {"id": cid, "type": "function", "function": {"name": fn["name"], "arguments": args}}
                    msg["tool_calls"].append(call)
                    pending[cid] = fn["name"]
            else:
                pending = {}  # a text answer closes the exchange: a later result has no call to answer
                if content is None:
                    msg["content"] = ""
        elif role == "tool":
            cid = m.get("tool_call_id")
            if not pending:
                raise Invalid("tool result without a call", f"{at}: no open tool call of an earlier assistant message")
            if not isinstance(cid, str) or cid not in pending:
                if cid:  # an id no open call has
                    raise Invalid(
                        "tool result without a call", f"{at}: tool_call_id {str(cid)[:40]!r} matches no open call"
                    )
                cid = next(iter(pending))  # no id logged: results answer in call order
            name = pending.pop(cid)
            logged = m.get("name") or m.get("tool_name")
            msg.update(
                tool_call_id=cid, name=logged if isinstance(logged, str) and logged else name, content=content or ""
            )
        else:
            if content is None:
                raise Invalid("bad message", f"{at}: a {role} message without content")
            if role == "user":
                pending = {}
        out.append(msg)
    if not any(m["role"] == "user" for m in out):
        raise Invalid("no user turn", f"{where}a conversation starts from a user message")
    if not any(m["role"] == "assistant" for m in out):
        raise Invalid("no assistant turn", f"{where}nothing the policy said")
    return out


# the logged outcome signals a reader may pass on, with the JSON type each must have (the conversations dataset's
# columns): a log holding another type is rejected here, by line, rather than failing the dataset's build
SIGNAL_TYPES: dict[str, type] = {
    "completed": bool,
    "partial": bool,
    "end_reason": str,
    "finish_reason": str,
    "api_calls": int,
}


def outcome_of(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]], errors: int | None = None, **logged: Any
) -> dict[str, Any]:
    """The outcome signals: what the log said (``logged``), else completed / partial read off the messages.
    ``errors``: the tool messages' ``is_tool_error`` count when the reader took it already."""
    declared = {t["function"]["name"] for t in tools}
    calls: list[dict[str, Any]] = []
    answered: set[str] = set()
    turns, count, compressed = 0, errors is None, False
    errors = errors or 0
    for m in messages:  # one pass: turns, calls, results and their errors, a summary turn
        role = m["role"]
        if role == "tool":
            answered.add(m["tool_call_id"])
            if count:
                errors += is_tool_error(m["content"])
            continue
        if role == "assistant":
            turns += 1
            calls += m.get("tool_calls", [])
        if not compressed and (m["content"] or "").startswith(SUMMARY_PREFIXES):
            compressed = True
    logged_errors = logged.pop("tool_error_counts", None)
    if isinstance(logged_errors, dict):
        errors = sum(int(v) for v in logged_errors.values() if isinstance(v, int) and not isinstance(v, bool))
    out = {
        "completed": None,
        "partial": None,
        "inferred": False,
        "end_reason": None,
        "api_calls": None,
        "turns": turns,
        "tool_calls": len(calls),
        "tool_errors": errors,
        "unanswered_calls": sum(c["id"] not in answered for c in calls),
        "unknown_tools": sorted({c["function"]["name"] for c in calls} - declared) if declared else [],
        "compressed": compressed,
    }
    for k, v in logged.items():
        want = SIGNAL_TYPES.get(k)
        if v is None or want is None:
            continue
        if not isinstance(v, want) or (want is int and isinstance(v, bool)):  # a JSON true is no call count
            name = {bool: "true or false", str: "text", int: "an integer"}[want]
            raise Invalid("bad outcome field", f"{k} must be {name}, got a JSON {type(v).__name__}")
        if want is int and v < 0:
            raise Invalid("bad outcome field", f"{k} must be >= 0, got {v}")
    out.update({k: v for k, v in logged.items() if v is not None})
    if out["completed"] is None:  # the log says nothing: a final text answer is a finished conversation
        last = messages[-1]
        done = last["role"] == "assistant" and not last.get("tool_calls") and bool((last["content"] or "").strip())
        done = done and out.get("finish_reason") not in ("length", "content_filter")  # cut off mid-answer
        out.update(completed=done, partial=not done, inferred=True)
    elif out["partial"] is None:
        out["partial"] = False
    return out


# ---------------------------------------------------------------------------------------------- record
def make_record(
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]],
    source: dict[str, Any],
    *,
    conversation_id: str | None = None,
    task_id: Any = None,
    model: Any = None,
    started_at: Any = None,
    ended_at: Any = None,
    outcome: dict[str, Any] | None = None,
    reward: float | None = None,
    reward_source: str | None = None,
    family: Any = None,
    parent_conversation_id: str | None = None,
    meta: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The canonical record (schema in the module docstring) from checked messages and tools."""
    first_user = task_prompt_of(messages)
    if isinstance(task_id, int) and not isinstance(task_id, bool):
        task_id = str(task_id)
    if not isinstance(task_id, str) or not task_id.strip():
        task_id = "conv-" + hashlib.sha1(first_user.encode("utf-8", "surrogatepass")).hexdigest()[:12]
    cid = conversation_id if isinstance(conversation_id, str) and conversation_id.strip() else None
    if cid is None:
        cid = "conv-" + content_digest(messages, tools).hex()[:16]
    fam = _family_of(first_user) or (family if isinstance(family, str) and family else None)
    return {
        "conversation_id": cid,
        "task_id": task_id,
        "messages": messages,
        "tools": tools,
        "source": source,
        "model": model if isinstance(model, str) else None,
        "started_at": _iso(started_at),
        "ended_at": _iso(ended_at),
        "outcome": outcome if outcome is not None else outcome_of(messages, tools),
        "reward": reward,
        "reward_source": reward_source,
        "family": fam or ("agent" if tools else "chat"),
        "parent_conversation_id": parent_conversation_id,
        "meta": meta or {},
    }


_FAMILY_OF: Any = None  # tasks.suite.family_of, once imported


def _family_of(prompt: str) -> str | None:
    """``tasks.suite.family_of``, imported on first use (the task suite pulls in the sandbox) and then held: an
    import statement a record cost ~2% of a conversation's conversion."""
    global _FAMILY_OF
    if _FAMILY_OF is None:
        from hermes_lab.tasks import suite as tasks

        _FAMILY_OF = tasks.family_of
    return _FAMILY_OF(prompt)


def from_seed(prompt: str, response: str, reward: float, task_id: str, source: dict[str, Any]) -> dict[str, Any]:
    """A seed record as a conversation: one user and one assistant message, its reward from the log."""
    msgs = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
    return make_record(msgs, [], source, task_id=task_id, reward=reward, reward_source="log")


def _iso(t: Any) -> str | None:
    if isinstance(t, str) and t.strip():
        return t
    if isinstance(t, (int, float)) and not isinstance(t, bool) and t > 0:
        from datetime import datetime, timezone

        return datetime.fromtimestamp(float(t), timezone.utc).isoformat()
    return None


def task_prompt_of(messages: list[dict[str, Any]]) -> str:
    """The conversation's task: its first user message (a compressor's summary turn is not a task)."""
    first = None
    for m in messages:
        if m["role"] == "user":
            text = m["content"] or ""
            if not text.startswith(SUMMARY_PREFIXES):
                return text
            if first is None:
                first = text
    return first if first is not None else ""


def final_answer(messages: list[dict[str, Any]]) -> str:
    """The last assistant text (what the user was told): the response of the seed's projection."""
    return next((m["content"] or "" for m in reversed(messages) if m["role"] == "assistant" and m["content"]), "")


def content_digest(messages: list[dict[str, Any]], tools: list[dict[str, Any]], near: bool = False) -> bytes:
    """16-byte digest of what was said: roles, text, reasoning, tool calls and results, tool schemas. ``near``:
    the exchange itself, up to whitespace, case, reasoning, call ids, the system prompt and the tool schemas
    (a Hermes run's trajectory line and its session snapshot are one conversation)."""
    h = hashlib.blake2b(digest_size=16)
    for m in messages:
        if near and m["role"] == "system":
            continue
        text = m.get("content") or ""
        if near:
            text = " ".join(text.split()).lower()
        parts = [m["role"], text]
        if not near:
            parts += [m.get("reasoning") or "", m.get("tool_call_id") or ""]
        for c in m.get("tool_calls", []):
            parts += [c["function"]["name"], c["function"]["arguments"] if not near else _norm_args(c)]
            if not near:
                parts.append(c["id"])
        for p in parts:
            b = p.encode("utf-8", "surrogatepass")
            h.update(len(b).to_bytes(8, "little"))
            h.update(b)
    if not near and tools:
        h.update(_tools_digest(tools))
    return h.digest()


_TOOLS: dict[int, tuple[list[dict[str, Any]], bytes]] = {}  # id -> (the list, kept alive; its digest)


def _tools_digest(tools: list[dict[str, Any]]) -> bytes:
    """The schemas' digest, once per list object: every line of a Hermes run shares one parsed tool list
    (``readers`` caches it), and dumping ~7 KB of schemas per conversation would cost more than the rest."""
    hit = _TOOLS.get(id(tools))
    if hit is not None and hit[0] is tools:
        return hit[1]
    d = hashlib.blake2b(json.dumps(tools, sort_keys=True).encode("utf-8", "surrogatepass"), digest_size=16).digest()
    if len(_TOOLS) >= 256:
        _TOOLS.clear()
    _TOOLS[id(tools)] = (tools, d)
    return d


def _norm_args(call: dict[str, Any]) -> str:
    try:
        return json.dumps(json.loads(call["function"]["arguments"]), sort_keys=True).lower()
    except json.JSONDecodeError:
        return call["function"]["arguments"]


def record_text(rec: dict[str, Any]) -> str:
    """A record as one JSON line (no newline): orjson's, with U+2028 / U+2029 escaped (readers that split on
    them stay whole); the standard encoder's ASCII escapes for what orjson refuses (a lone surrogate from a
    session file, an integer past 64 bits in a log's metadata)."""
    try:
        import orjson

        return orjson.dumps(rec).decode().replace("\u2028", "\\u2028").replace("\u2029", "\\u2029")
    except (TypeError, ValueError):
        return json.dumps(rec)


def record_of(text: str) -> dict[str, Any]:
    """``record_text``'s inverse."""
    import orjson

    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:  # the standard encoder's escapes of a lone surrogate
        return json.loads(text)


def review_key(task_id: str, conversation_id: str) -> bytes:
    """The bytes of a conversation's review id (sha1, 12 hex) and review rank: the label is the conversation's."""
    return f"{task_id}\x00{conversation_id}".encode("utf-8", "surrogatepass")


# ------------------------------------------------------------------------------- the trainer's dataset
def dataset_schema() -> Any:
    """The Arrow schema of prep's ``conversations/`` dataset: the record's fields, ``messages`` as structs (what
    chat templates take), ``split`` ("train" / "heldout", the prompt sets' rule), ``tools`` and ``meta`` as JSON
    text (their shapes vary by tool), and ``negative`` (from a rolled-back round)."""
    import pyarrow as pa

    s = pa.string()
    call = pa.struct([("id", s), ("type", s), ("function", pa.struct([("name", s), ("arguments", s)]))])
    message = pa.struct(
        [
            ("role", s),
            ("content", s),
            ("reasoning", s),
            ("tool_calls", pa.list_(call)),
            ("tool_call_id", s),
            ("name", s),
        ]
    )
    outcome = pa.struct(
        [
            ("completed", pa.bool_()),
            ("partial", pa.bool_()),
            ("inferred", pa.bool_()),
            ("end_reason", s),
            ("finish_reason", s),
            ("api_calls", pa.int64()),
            ("turns", pa.int64()),
            ("tool_calls", pa.int64()),
            ("tool_errors", pa.int64()),
            ("unanswered_calls", pa.int64()),
            ("unknown_tools", pa.list_(s)),
            ("compressed", pa.bool_()),
        ]
    )
    source = pa.struct([("format", s), ("file", s), ("line", pa.int64()), ("session", s)])
    return pa.schema(
        [
            ("conversation_id", s),
            ("task_id", s),
            ("family", s),
            ("split", s),
            ("messages", pa.list_(message)),
            ("tools", s),
            ("reward", pa.float64()),
            ("reward_source", s),
            ("negative", pa.bool_()),
            ("source", source),
            ("model", s),
            ("started_at", s),
            ("ended_at", s),
            ("outcome", outcome),
            ("parent_conversation_id", s),
            ("meta", s),
        ]
    )


def where(fmt: str, file: str, line: int | None = None, session: str | None = None) -> dict[str, Any]:
    """Where a record came from: its format, file, line (a line format's) and session (a store's)."""
    return {"format": fmt, "file": file, "line": line, "session": session}
