"""The Hermes Agent's ShareGPT trajectories as canonical conversation records (stage: prep, format
``hermes_trajectory``).

Reads, never writes: ``run_agent.py --save_trajectories``'s ``trajectory_samples.jsonl`` /
``failed_trajectories.jsonl``, its batch runner's ``trajectories.jsonl`` and the trajectory compressor's output, one
``{"conversations": [{"from", "value"}], ...}`` a line, handed over by the ingest
(``hermes_lab.logs.readers.parse_line``): the Hermes function-calling format, ``<tools>`` in the system turn,
``<think>`` / ``<tool_call>`` in the assistant's text, ``<tool_response>`` in tool turns. Atropos groups and Hermes's
session stores read their messages with ``trajectory_messages`` and ``system_tools``. A malformed line raises
``record.Invalid``. Run through ``hermes-lab prep``.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from pathlib import Path
from typing import Any

import orjson

from hermes_lab.logs.openai_chat import tools_of
from hermes_lab.logs.record import (
    Invalid,
    arguments_text,
    final_answer,
    is_tool_error,
    make_record,
    outcome_of,
    task_prompt_of,
    text_of,
    where,
)

HERMES_ROLES = {"system": "system", "human": "user", "gpt": "assistant", "tool": "tool"}


@functools.lru_cache(maxsize=8)
def _tags(kinds: tuple[str, ...]) -> re.Pattern[str]:
    return re.compile("<(/?)(" + "|".join(map(re.escape, kinds)) + ")>")


def _blocks(value: str, kinds: tuple[str, ...], at: str) -> list[tuple[str | None, str]]:
    """``value`` split into (tag, body) blocks of the given tags and (None, text) around them. Inside a block
    only its own closing tag counts (a <think> may mention <tool_call>); an unclosed or stray tag is Invalid."""
    out: list[tuple[str | None, str]] = []
    pos = 0
    open_k, open_at = None, 0  # the block being read: its tag and where its body starts
    for m in _tags(kinds).finditer(value):
        closing, k = m.group(1), m.group(2)
        if open_k is None:
            if closing:
                raise Invalid("broken tag", f"{at}: </{k}> at character {m.start()} closes nothing")
            out.append((None, value[pos : m.start()]))
            open_k, open_at, pos = k, m.end(), m.start()
        elif closing and k == open_k:
            out.append((k, value[open_at : m.start()]))
            open_k, pos = None, m.end()
    if open_k is not None:
        raise Invalid("broken tag", f"{at}: <{open_k}> at character {pos} is never closed")
    out.append((None, value[pos:]))
    return out


def _one_block(value: str, kind: str) -> list[tuple[str | None, str]] | None:
    """``_blocks`` of a value holding one ``kind`` block (a tool turn's single result): three finds instead of the
    tag scan; None for any other value."""
    head, tail = f"<{kind}>", f"</{kind}>"
    i, j = value.find(head), value.find(tail)  # the first closing tag closes (an opening one inside is text)
    end = j + len(tail)
    if i < 0 or j < i + len(head) or value.find(head, end) >= 0 or value.find(tail, end) >= 0:
        return None
    return [(None, value[:i]), (kind, value[i + len(head) : j]), (None, value[end:])]


def _json_body(body: str, what: str, at: str) -> dict[str, Any]:
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        obj = _NOT_READ
    if obj is _NOT_READ or _LONG_INT in body.encode("utf-8", "surrogatepass").translate(_DIGITS):
        obj = _json_exact(body, what, at)  # what orjson refuses (NaN, which json reads) or reads otherwise
    if not isinstance(obj, dict):
        raise Invalid(f"malformed {what}", f"{at}: a JSON {type(obj).__name__}, not an object")
    return obj


_NOT_READ = object()
_DIGITS = bytes(48 if 48 <= i <= 57 else 10 for i in range(256))  # translate: a digit -> "0", the rest -> newline
_LONG_INT = b"0" * 19  # an integer past 64 bits: orjson reads it as a float, json as an int


def _json_exact(body: str, what: str, at: str) -> Any:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        raise Invalid(f"malformed {what}", f"{at}: {e.msg} at column {e.colno}: {body.strip()[:60]!r}") from None
    if not isinstance(obj, dict):
        raise Invalid(f"malformed {what}", f"{at}: a JSON {type(obj).__name__}, not an object")
    return obj


@functools.lru_cache(maxsize=64)
def system_tools(value: str, at: str) -> tuple[str, list[dict[str, Any]]]:
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
    return value[:i] + value[j + 8 :], tools_of(raw, f"{at}: ")


_LAST_SYSTEM: list[Any] = [None]  # (value, at, system_tools' with its text stripped) of the last line's system turn


def trajectory_messages(turns: Any, max_chars: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Hermes ShareGPT turns as (OpenAI messages, tools): <think> -> reasoning, each <tool_call> -> a call,
    each <tool_response> -> a tool message answering the preceding turn's calls in order."""
    msgs, tools, _ = _trajectory(turns, max_chars)
    return msgs, tools


def _trajectory(turns: Any, max_chars: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]], int]:
    """``trajectory_messages`` and the tool errors among its results (``record.is_tool_error``'s count,
    taken on each result as parsed: its content is not read a second time)."""
    if not isinstance(turns, list) or not turns:
        raise Invalid("empty conversation", "conversations must be a non-empty list of turns")
    msgs: list[dict[str, Any]] = []
    tools: list[dict[str, Any]] = []
    open_calls: list[dict[str, Any]] | None = None  # the last gpt turn's calls, until a tool turn answers them
    errors = 0
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
            last = _LAST_SYSTEM[0]
            if last is not None and last[0] == value and last[1] == at:  # a run's lines: one system turn, unhashed
                text, found = last[2]  # its text the same object (conv_lines writes it once per object)
            else:
                text, found = system_tools(value, at)
                text = text.strip()
                _LAST_SYSTEM[0] = (value, at, (text, found))
            tools = found if not tools else tools + found
            msgs.append({"role": "system", "content": text})
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
            for tag, body in _one_block(value, "tool_response") or _blocks(value, ("tool_response",), at):
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
                raw = r.get("content")
                content = text_of(raw, f"{at} result {k}")
                errors += _dict_error(raw) if type(raw) is dict else is_tool_error(content or "")
                msgs.append(
                    {
                        "role": "tool",
                        "tool_call_id": call["id"],
                        "name": name or call["function"]["name"],
                        "content": content,
                    }
                )
            open_calls = None
    return _checked(msgs, max_chars), tools, errors


def _dict_error(obj: dict[str, Any]) -> bool:
    """``is_tool_error`` of a result whose content is a JSON object (its text reads back as this object)."""
    inner = obj.get("content")
    return (
        obj.get("error") is not None
        or (isinstance(inner, dict) and inner.get("error") is not None)
        or (obj.get("success") is False)
    )


def _checked(msgs: list[dict[str, Any]], max_chars: int) -> list[dict[str, Any]]:
    """``record.check_messages`` of the messages ``_trajectory`` built: the same messages and the same
    refusals (an over-long result's text, a result no open call has, no user or assistant turn), without the
    checks their construction already made (roles, types, the calls' names and arguments)."""
    out: list[dict[str, Any]] = []
    pending: dict[str, str] = {}  # call id -> tool name, of the current exchange
    for i, m in enumerate(msgs):
        role, content = m["role"], m["content"]
        if content is not None and len(content) > max_chars:
            raise Invalid(
                "message too long",
                f"message {i} ({role}): {len(content)} characters > conversations.max_message_chars {max_chars}",
            )
        if role == "assistant":
            msg: dict[str, Any] = {"role": role, "content": content}
            if "reasoning" in m:
                msg["reasoning"] = m["reasoning"]
            calls = m.get("tool_calls")
            if calls:
                pending = {}
                msg["tool_calls"] = out_calls = []
                for k, c in enumerate(calls):
                    name, args = c["function"]["name"], c["function"]["arguments"]
                    cid = c.get("id") or f"call_{i}_{k}"
                    out_calls.append({"id": cid, "type": "function", "function": {"name": name, "arguments": args}})
                    pending[cid] = name
            else:
                pending = {}
                if content is None:
                    msg["content"] = ""
        elif role == "tool":
            cid = m["tool_call_id"]
            if not pending:
                raise Invalid(
                    "tool result without a call", f"message {i}: no open tool call of an earlier assistant message"
                )
            if cid not in pending:
                raise Invalid(
                    "tool result without a call", f"message {i}: tool_call_id {cid[:40]!r} matches no open call"
                )
            name = pending.pop(cid)
            msg = {"role": role, "content": content or "", "tool_call_id": cid, "name": m["name"] or name}
        else:
            msg = {"role": role, "content": content}
            if role == "user":
                pending = {}
        out.append(msg)
    if not any(m["role"] == "user" for m in out):
        raise Invalid("no user turn", "a conversation starts from a user message")
    if not any(m["role"] == "assistant" for m in out):
        raise Invalid("no assistant turn", "nothing the policy said")
    return out


def from_trajectory(obj: dict[str, Any], file: str, line: int | None, max_chars: int) -> dict[str, Any]:
    """A Hermes ShareGPT trajectory line (single run, batch runner, compressor) as a record."""
    if "conversations" not in obj:
        raise Invalid("missing field 'conversations'", f"present: {', '.join(list(obj)[:12])}")
    msgs, tools, errors = _trajectory(obj["conversations"], max_chars)
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
        outcome=outcome_of(msgs, tools, errors, **signals),
        family=obj.get("family"),
        meta=meta,
    )
