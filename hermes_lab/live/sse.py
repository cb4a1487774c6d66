"""A streamed chat answer (server-sent events) as the gateway reads it: each upstream piece cut into events, what
the log keeps of each (``Chunk``), and the tool calls put back together from their deltas (``CallAssembler``).

Stage: validate (live A/B, ``hermes-lab serve``). Used by ``hermes_lab.live.arms.UpstreamArm.stream`` on the
upstream's pieces as they arrive (an in-process arm makes its ``Chunk``s itself, ``hermes_lab.live.local``);
reads and writes nothing.

The events are forwarded as the upstream wrote them (the bytes of a piece, less the usage-only event the gateway
asked for itself); only the few fields the log keeps are read. A piece's events are decoded together, by msgspec
into the shapes of those fields: one call per piece, no dict built for the fields the log does not keep. An
event that does not fit the shapes (content parts, a non-JSON data line, an ``event:`` or comment line) sends
its piece through the general path, orjson per event, which reads whatever a chunk holds. (msgspec skips the
fields the log does not keep without checking their UTF-8 or numbers: such an event is forwarded as the upstream
wrote it, where the general path, which cannot parse it, drops it.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec
import orjson


@dataclass
class Chunk:
    """One SSE event of a stream: ``raw`` is forwarded as is (b'' = dropped), the rest is logged.
    ``calls``: the event's ``delta.tool_calls`` (pieces: index, id, name, arguments), assembled by
    ``CallAssembler``; ``reasoning``: its ``reasoning_content`` / ``reasoning`` piece; ``end``: the stream ended
    in the same upstream piece (its ``raw`` can go out with the end of the answer, in one write)."""

    raw: bytes
    text: str = ""
    usage: dict[str, Any] | None = None
    finish_reason: str | None = None
    calls: list[Any] | None = None
    reasoning: str = ""
    end: bool = False


class CallAssembler:
    """Tool calls from a stream's deltas: the first piece of a call (by ``index``) brings its id and name,
    later pieces append to its arguments, as OpenAI streams them."""

    def __init__(self) -> None:
        self.calls: dict[int, dict[str, Any]] = {}

    def add(self, pieces: list[Any]) -> None:
        for k, p in enumerate(pieces):
            if not isinstance(p, dict):
                continue
            i = p.get("index") if isinstance(p.get("index"), int) else k
            c = self.calls.get(i)
            if c is None:
                c = self.calls[i] = {"id": "", "type": "function", "function": {"name": "", "arguments": ""}}
            if isinstance(p.get("id"), str) and p["id"]:
                c["id"] = p["id"]
            fn = p.get("function")
            if isinstance(fn, dict):
                if isinstance(fn.get("name"), str) and fn["name"] and not c["function"]["name"]:
                    c["function"]["name"] = fn["name"]
                if isinstance(fn.get("arguments"), str):
                    c["function"]["arguments"] += fn["arguments"]

    def result(self) -> list[dict[str, Any]] | None:
        return [self.calls[i] for i in sorted(self.calls)] or None


# ------------------------------------------------------------------------------------------ a piece's events
# What the log keeps of one event: (forwarded, text, usage, finish_reason, tool-call pieces, reasoning).
Fields = tuple[bool, str, Any, Any, list[Any] | None, str]


def event_fields(obj: Any, client_wants_usage: bool) -> Fields:
    """An event's fields, from its parsed JSON; the usage-only event the gateway asked for itself is not
    forwarded, and a data line that is not a chunk object is forwarded and logs nothing."""
    if not isinstance(obj, dict):
        return True, "", None, None, None, ""
    choices = obj.get("choices") or []
    usage = obj.get("usage")
    if not choices:
        return bool(client_wants_usage or not usage), "", usage, None, None, ""
    c0 = choices[0] if isinstance(choices[0], dict) else {}
    d = c0.get("delta") or {}
    text = d.get("content") or ""
    calls = d.get("tool_calls")
    r = d.get("reasoning_content") or d.get("reasoning") or ""
    return (
        True,
        text if isinstance(text, str) else "",
        usage,
        c0.get("finish_reason"),
        calls if isinstance(calls, list) else None,
        r if isinstance(r, str) else "",
    )


class _Delta(msgspec.Struct):
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None


class _Choice(msgspec.Struct):
    delta: _Delta | None = None
    finish_reason: str | None = None


class _Event(msgspec.Struct):
    choices: list[_Choice] | None = None
    usage: dict[str, Any] | None = None


_EVENTS = msgspec.json.Decoder(list[_Event])


def _placed(pieces: list[Any]) -> list[Any]:
    """An event's tool-call pieces, each without an index given the one its place in the event gives it (what
    ``CallAssembler.add`` does with one event's list), so a piece's events can be added as one list."""
    return [p if not isinstance(p, dict) or isinstance(p.get("index"), int) else {**p, "index": k}
            for k, p in enumerate(pieces)]  # fmt: skip


def _decoded(data: bytes, events: list[bytes], size: int, client_wants_usage: bool, done: bool) -> Chunk | None:
    """The chunk of ``data: {...}`` lines (``events``, the first ``size`` bytes of ``data``), decoded in one call
    into the fields' shapes; None where one does not fit them (the general path reads the piece)."""
    try:
        decoded = _EVENTS.decode(b"[" + b",".join([e[5:] for e in events]) + b"]")
    except msgspec.DecodeError:  # (ValidationError is one)
        return None
    text, thought, calls, usage, finish, dropped = [], [], [], None, None, []
    for i, ev in enumerate(decoded):
        if ev.usage:
            usage = ev.usage
        if not ev.choices:
            if ev.usage and not client_wants_usage:
                dropped.append(i)
            continue
        c0 = ev.choices[0]
        if c0.finish_reason:
            finish = c0.finish_reason
        d = c0.delta
        if d is not None:
            if d.content:
                text.append(d.content)
            if d.reasoning_content or d.reasoning:
                thought.append(d.reasoning_content or d.reasoning)
            if d.tool_calls:
                calls += _placed(d.tool_calls)
    if dropped:
        kept = b"".join([e + b"\n\n" for i, e in enumerate(events) if i not in dropped])
    else:  # the events from the piece's start: the piece itself, or its head
        kept = data if size == len(data) else data[:size]
    return Chunk(kept, "".join(text), usage, finish, calls or None, "".join(thought), done)


def _parsed(data: bytes, start: int, end: int) -> tuple[str | None, Any]:
    """('data', obj) / ('done', None) / (None, None) for one SSE event, ``data[start:end]`` (its first data line)."""
    pos = start
    while pos < end:
        nl = data.find(b"\n", pos, end)
        nl = end if nl == -1 else nl
        if data.startswith(b"data:", pos, nl):
            line = memoryview(data)[pos + 5 : nl]  # parsed where it lies (orjson skips the whitespace)
            if len(line) < 16 and bytes(line).strip() == b"[DONE]":
                return "done", None
            try:
                return "data", orjson.loads(line)
            except orjson.JSONDecodeError:
                return None, None
        pos = nl + 1
    return None, None


def _general(data: bytes, client_wants_usage: bool) -> tuple[list[tuple[int, int]], list[Fields], int, bool]:
    """Any piece: its events' (start, end) spans, blank line included, their fields, where the rest begins, and
    whether [DONE] came. An event that is not a data line of JSON (a comment, ``event:`` alone, a broken line) is
    neither forwarded nor logged."""
    start, spans, fields, cr = 0, [], [], b"\r" in data
    while True:
        end, n = data.find(b"\n\n", start), 2
        if cr:
            j = data.find(b"\r\n\r\n", start)
            if j != -1 and (end == -1 or j < end):
                end, n = j, 4
        if end == -1:
            return spans, fields, start, False
        kind, obj = _parsed(data, start, end)
        if kind == "done":
            return spans, fields, len(data), True
        if kind == "data":
            spans.append((start, end + n))
            fields.append(event_fields(obj, client_wants_usage))
        start = end + n


def read_piece(data: bytes, client_wants_usage: bool) -> tuple[Chunk | None, int, bool]:
    """The events that end in ``data`` (an upstream piece, after the start of an event a former piece left) as one
    chunk: (the chunk, None if no event ended; where the rest begins; whether [DONE] came). Its ``raw`` is the
    piece's forwarded events as they came (the piece itself when it is all forwarded), its text and reasoning
    the events' joined, its usage and finish reason the last given, its tool-call pieces all of them, in order."""
    if b"\r" not in data:  # the usual shape: one ``data: {...}`` line per event, split here in C
        events = data.split(b"\n\n")
        rest, done = len(data) - len(events.pop()), False
        if b"data: [DONE]" in data:
            for i, e in enumerate(events):
                if e.startswith(b"data: [DONE]") and not e[12:].strip():
                    events, rest, done = events[:i], len(data), True
                    break
        n = len(events)
        size = sum(map(len, events)) + 2 * n
        if not n:
            return None, rest, done
        # every event one line that starts with data: (counted in C: its newlines are the blank lines' alone)
        if (
            data.startswith(b"data:")
            and data.count(b"\n", 0, size) == 2 * n
            and data.count(b"\n\ndata:", 0, size) == n - 1
        ):
            ch = _decoded(data, events, size, client_wants_usage, done)
            if ch is not None:
                return ch, rest, done
    spans, fields, rest, done = _general(data, client_wants_usage)
    if not fields:
        return None, rest, done
    text, thought, calls, usage, finish = [], [], [], None, None
    for _, t, u, fr, cs, r in fields:
        if t:
            text.append(t)
        if r:
            thought.append(r)
        if u:
            usage = u
        if fr:
            finish = fr
        if cs:
            calls += _placed(cs)
    kept = b"".join([data[a:b] for (a, b), f in zip(spans, fields, strict=True) if f[0]])
    return Chunk(kept, "".join(text), usage, finish, calls or None, "".join(thought), done), rest, done
