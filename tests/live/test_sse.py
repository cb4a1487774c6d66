"""How the gateway reads an upstream's SSE pieces (hermes_lab.live.sse.read_piece): the decoded fast path and the
general path (orjson per event) agree on what is forwarded and logged, for every shape of event a provider sends;
a piece's events become one chunk that says what the per-event reading said. test_upstream.py and test_server.py
drive the same code through a real upstream and gateway."""

from __future__ import annotations

import itertools
import json

import pytest

from hermes_lab.live.sse import CallAssembler, event_fields, read_piece


def sse(obj: dict | str) -> bytes:
    return b"data: " + (obj if isinstance(obj, str) else json.dumps(obj)).encode() + b"\n\n"


def delta(finish: str | None = None, **d: object) -> dict:
    return {
        "id": "c",
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": d, "finish_reason": finish}],
    }


USAGE = {"id": "c", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}
SHAPES = {
    "text": [sse(delta(role="assistant", content="")), sse(delta(content="Hel")), sse(delta(content="lo"))],
    "reasoning": [sse(delta(reasoning_content="think ")), sse(delta(reasoning="more")), sse(delta(content="ok"))],
    "calls": [
        sse(delta(tool_calls=[{"index": 0, "id": "call_1", "function": {"name": "ls", "arguments": '{"pa'}}])),
        sse(delta(tool_calls=[{"index": 0, "function": {"arguments": 'th": "."}'}}])),
        sse(delta(tool_calls=[{"index": 1, "id": "call_2", "function": {"name": "cat", "arguments": "{}"}}])),
    ],
    # no index: each piece is placed by its position in its own event (two calls here, pieces joined by place)
    "calls without index": [
        sse(delta(tool_calls=[{"id": "a", "function": {"name": "f", "arguments": "{"}}, {"id": "b", "function": {}}])),
        sse(delta(tool_calls=[{"function": {"arguments": "}"}}, {"function": {"name": "g", "arguments": "[]"}}])),
    ],
    "finish and usage": [sse(delta(finish="stop")), sse(USAGE)],
    "content parts (general path)": [sse(delta(content=[{"type": "text", "text": "x"}])), sse(delta(content="y"))],
    "not a chunk object": [sse("[1, 2]"), sse(delta(content="z"))],
    "broken JSON, dropped": [sse('{"choices": [}'), sse(delta(content="after"))],
    "no space after data:": [b'data:{"choices": [{"delta": {"content": "tight"}}]}\n\n'],
    "null delta and a number as usage": [sse({"choices": [{"delta": None, "finish_reason": "length"}], "usage": 7})],
    "comment and event lines": [
        b": keep-alive\n\n",
        b"event: message\ndata: " + json.dumps(delta(content="e")).encode() + b"\n\n",
    ],
}


def per_event(events: list[bytes], wants_usage: bool) -> tuple[bytes, str, object, object, list, str]:
    """What reading each event alone gives (the reference): forwarded bytes, text, last usage, last finish
    reason, the assembled calls, reasoning."""
    fwd, text, usage, finish, thought, calls = b"", "", None, None, "", CallAssembler()
    for e in events:
        line = next((x for x in e.split(b"\n") if x.startswith(b"data:")), None)
        try:
            obj = json.loads(line[5:]) if line is not None else None
        except json.JSONDecodeError:
            continue
        if line is None:
            continue
        keep, t, u, fr, cs, r = event_fields(obj, wants_usage)
        fwd += e if keep else b""
        text, thought = text + t, thought + r
        usage, finish = u or usage, fr or finish
        if cs:
            calls.add(cs)
    return fwd, text, usage, finish, calls.result() or [], thought


def read_all(stream: bytes, cuts: list[int], wants_usage: bool) -> tuple[bytes, str, object, object, list, str, bool]:
    """The stream as the gateway reads it, in pieces cut at ``cuts``."""
    fwd, text, usage, finish, thought, calls, held, done = b"", "", None, None, "", CallAssembler(), b"", False
    edges = [0, *cuts, len(stream)]
    for a, b in itertools.pairwise(edges):
        data = held + stream[a:b]
        ch, rest, done = read_piece(data, wants_usage)
        held = data[rest:]
        if ch is not None:
            fwd += ch.raw
            text, thought = text + ch.text, thought + ch.reasoning
            usage, finish = ch.usage or usage, ch.finish_reason or finish
            if ch.calls:
                calls.add(ch.calls)
            assert ch.end == done
        if done:
            break
    return fwd, text, usage, finish, calls.result() or [], thought, done


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("wants_usage", [False, True])
def test_a_piece_reads_as_its_events_read_one_by_one(shape, wants_usage):
    events = SHAPES[shape]
    stream = b"".join(events) + sse("[DONE]")
    want = per_event(events, wants_usage)
    crlf = [e.replace(b"\n", b"\r\n") for e in events]
    for cuts in ([], [len(events[0])], list(range(5, len(stream), 7))):  # whole, at an event, anywhere
        got = read_all(stream, cuts, wants_usage)
        assert got[:6] == want and got[6], (shape, cuts)
        got = read_all(b"".join(crlf) + b"data: [DONE]\r\n\r\n", cuts, wants_usage)  # CRLF: the general path
        assert got[0] == per_event(crlf, wants_usage)[0] and got[1:6] == want[1:] and got[6], (shape, cuts)


def test_the_usage_we_asked_for_is_not_forwarded_and_done_ends_the_piece():
    events = [sse(delta(content="a")), sse(USAGE)]
    data = b"".join(events) + sse("[DONE]") + sse(delta(content="after the end"))
    ch, rest, done = read_piece(data, False)
    assert (ch.raw, ch.text, ch.usage, ch.end, rest, done) == (events[0], "a", USAGE["usage"], True, len(data), True)
    ch, _, _ = read_piece(data, True)
    assert ch.raw == b"".join(events)
    # a piece all forwarded is passed on as it came, not copied; an event cut short waits for the next piece
    whole = b"".join(SHAPES["text"])
    ch, rest, done = read_piece(whole + b"data: {", False)
    assert ch.raw == whole and (rest, done) == (len(whole), False)
    ch, _, _ = read_piece(whole, False)
    assert ch.raw is whole
    assert read_piece(b"data: {", False) == (None, 0, False)
