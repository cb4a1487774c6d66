"""Which conversation a gateway request belongs to, without any change to the client (stage: validate, live A/B).

Reads and writes nothing on disk: ``hermes_lab.live.gateway`` asks ``Tracker.link`` for every chat request and
logs what it answers into ``requests.jsonl`` (``conversation_id``, ``turn``, ``history``; ``hermes-lab serve``).

An agent (Hermes Agent, any OpenAI-SDK loop) sends its whole history with every request and names nothing.
A request continues a conversation when its messages begin with that conversation's messages plus the answer
the gateway gave: the request's messages *up to its last assistant message* are exactly an earlier turn's
messages plus that turn's answer. So every answered turn registers one key, the digest of (its messages, its
answer), and a new request looks up one key, the digest of its messages through its last assistant message:
one dict lookup, never a scan over open conversations. The digest is a chained XXH3-128 over a canonical
encoding of each message (role, text stripped, tool calls as name + arguments with sorted keys; call ids and
reasoning left out, because clients echo answers back without them or with ids of their own). A large body's
messages come as raw slices (``hermes_lab.live.wire``): a message's encoding is looked up by a digest of its raw
bytes (``wire.raw_digest``), so only a message never seen before is parsed (orjson, which also checks
it) and encoded; a 58 KB, 41-message history whose 39 first messages were seen costs ~10 us, not the ~220 us of
parsing it all and encoding every message. A small body's messages are parsed and encoded in one pass (``link``).

An explicit id wins: the ``X-Hermes-Conversation`` header, ``metadata.conversation_id``, or (with
``serve.conversation_from_user``) the OpenAI ``user`` field. A request that continues nothing opens a
conversation; its id is the explicit one, else the request id (so a single-turn request's unit is its
request id, the user's ABRouter on request ids, unchanged).

Memory is bounded: open conversations sit in an LRU order of their last turn; a conversation ends (and is
forgotten) when its last answer had no tool call and ``serve.conversation_idle_s`` passed without a new
turn, when its last answer asked for tools and ``serve.conversation_tool_wait_s`` passed, when feedback
closes it, or when ``serve.max_conversations`` are open and it is the longest idle. A later request that
would have continued an ended conversation opens a new one.

A retry stays in its conversation: a turn whose answer failed (an error status) or was empty (no text, no tool
call; or a tool call left as text, which the server could not read) registers the digest of its messages, and a
request with exactly those messages (an agent retrying: Hermes Agent resends them up to 3 times) is that turn
again: the same conversation, turn number, arm and unit, logged with ``retry`` = its attempt (1, 2, ...; 0 for
every other request). An answer with text or tool calls ends it.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any

import orjson
import xxhash

from hermes_lab.live.wire import raw_digest
from hermes_lab.logs.record import is_tool_error

_SEP = b"\x1e"


def _text(c: Any) -> str:
    if c is None:
        return ""
    if type(c) is str:
        return c
    if isinstance(c, list):  # content parts: their text
        return "".join(p.get("text", "") for p in c if isinstance(p, dict) and isinstance(p.get("text"), str))
    return orjson.dumps(c).decode()


_ARGS: dict[str, bytes] = {}  # arguments text -> canonical bytes: an agent re-sends every earlier call each turn


def _args(a: Any) -> bytes:
    """Arguments canonical: a JSON object's text with sorted keys (a client may re-serialise them)."""
    if isinstance(a, str):
        hit = _ARGS.get(a)
        if hit is not None:
            return hit
        try:
            out = orjson.dumps(orjson.loads(a) if a.strip() else {}, option=orjson.OPT_SORT_KEYS)
        except (orjson.JSONDecodeError, TypeError):
            out = a.encode("utf-8", "surrogatepass")
        if len(_ARGS) >= 65536:
            _ARGS.clear()
        _ARGS[a] = out
        return out
    try:
        return orjson.dumps(a, option=orjson.OPT_SORT_KEYS)
    except TypeError:
        return repr(a).encode()


def encode(m: Any) -> bytes:
    """One message's canonical bytes. An assistant message must match between our answer and the client's echo
    of it (text stripped, tool calls as name + sorted arguments, no ids, no reasoning); every other message is
    only ever the client's own, so its role and text suffice (and cost least: this runs on every message of
    every request)."""
    if type(m) is not dict:
        return b"?" + _SEP
    role = m.get("role")
    c = m.get("content")
    if role != "assistant":
        text = c if type(c) is str else _text(c)
        if role == "tool":
            return b"".join((b"tool\x1f", str(m.get("tool_call_id") or "").encode(), b"\x1f", _utf8(text), _SEP))
        return b"".join((str(role).encode(), b"\x1f", _utf8(text), _SEP))  # one copy of a long text, not two
    parts = [b"assistant", _utf8(_text(c).strip())]
    calls = m.get("tool_calls")
    if isinstance(calls, list):
        for call in calls:
            fn = call.get("function") if isinstance(call, dict) else None
            if isinstance(fn, dict):
                parts += [str(fn.get("name") or "").encode(), _args(fn.get("arguments"))]
    return b"\x1f".join(parts) + _SEP


def _utf8(s: str) -> bytes:
    return s.encode("utf-8", "surrogatepass")


def empty(answer: dict[str, Any]) -> bool:
    """An answer an agent retries: no text but white space and no tool call, or a tool call left as text (the
    server could not read it: Hermes Agent resends the same messages for one, as for an empty answer)."""
    c = answer.get("content")
    if answer.get("tool_calls"):
        return False
    return not (isinstance(c, str) and c.strip()) or "<tool_call>" in c


def tool_errors(messages: list[Any]) -> int:
    """Tool results among a turn's new messages that report an error (Hermes's rule, ``is_tool_error``)."""
    n = 0
    for m in messages:
        if isinstance(m, dict) and m.get("role") == "tool":
            c = m.get("content")
            n += is_tool_error(c if isinstance(c, str) else orjson.dumps(c).decode() if c else "")
    return n


class Conversation:
    """One open conversation: its arm, turns, and the keys its answered turns registered."""

    __slots__ = ("arm", "closed", "explicit", "id", "keys", "last", "switched", "tools_hash", "turns", "waiting_tools")

    def __init__(self, cid: str, arm: int, explicit: bool):
        self.id, self.arm, self.explicit = cid, arm, explicit
        self.turns = 0
        self.last = time.monotonic()
        self.waiting_tools = False
        self.keys: list[bytes] = []
        self.switched = False
        self.tools_hash: str | None = None
        self.closed = False


class Link:
    """What ``Tracker.link`` found for a request: the conversation (None: open a new one), the turn's index,
    how many of the request's messages were logged before (``history``), the digest to extend, the digest of all
    its messages (``full``: a retry of them finds it) and, for a retry, which attempt at its turn it is (``retry``,
    1 for the first retry; 0: not a retry) with the arm and unit of the turn it retries."""

    __slots__ = ("arm", "conv", "full", "hasher", "history", "retry", "turn", "unit")

    def __init__(self, conv: Conversation | None, turn: int, history: int, hasher: Any, full: bytes = b""):
        self.conv, self.turn, self.history, self.hasher, self.full = conv, turn, history, hasher, full
        self.retry, self.arm, self.unit = 0, 0, ""


class _Failed:
    """A turn whose answer failed or was empty: a request with exactly its messages is its retry."""

    __slots__ = ("arm", "attempts", "conv", "history", "turn", "unit")

    def __init__(self, conv: Conversation, turn: int, history: int, arm: int, unit: str):
        self.conv, self.turn, self.history, self.arm, self.unit, self.attempts = conv, turn, history, arm, unit, 0


SEEN_MAX = 65536  # raw messages whose encodings are kept, and their bytes at most (past either, the memory starts
SEEN_BYTES = 64 << 20  # again): an agent's turn re-sends ~40, so thousands of conversations run before it does


class Tracker:
    def __init__(self, idle_s: float, tool_wait_s: float, max_open: int):
        self.idle_s, self.tool_wait_s, self.max_open = idle_s, tool_wait_s, max_open
        self.by_key: dict[bytes, tuple[Conversation, int]] = {}  # digest -> (conversation, messages so far)
        # digest of a request's messages -> its turn, while that turn's answer failed or was empty: an agent resends
        # the same messages (Hermes Agent: up to 3 times), and the retry stays in the turn's conversation and arm
        self.failed_turns: dict[bytes, _Failed] = {}
        self.open: OrderedDict[str, Conversation] = OrderedDict()  # by id, least recently active first
        self.ended = 0
        self._opened = 0
        self._seen: dict[bytes, tuple[bytes, bool]] = {}  # raw digest -> (its encoding, an assistant message?)
        self._seen_bytes = 0

    def keys(self, raws: list[Any]) -> tuple[list[bytes], int, dict[int, Any]]:
        """Raw messages' encodings (``encode``), the index of the last assistant message (-1: none) and the
        messages parsed here, by index: those never seen before (orjson parses and checks them, and raises
        ``orjson.JSONDecodeError`` on one that is not valid JSON); a message seen before is not parsed again."""
        seen, keys, parsed, last = self._seen, [], {}, -1
        for i, r in enumerate(raws):
            d = raw_digest(r)
            hit = seen.get(d)
            if hit is None:
                m = parsed[i] = orjson.loads(memoryview(r))
                hit = (encode(m), type(m) is dict and m.get("role") == "assistant")
                self._seen_bytes += len(hit[0])
                if len(seen) >= SEEN_MAX or self._seen_bytes > SEEN_BYTES:
                    seen.clear()
                    self._seen_bytes = len(hit[0])
                seen[d] = hit
            keys.append(hit[0])
            if hit[1]:
                last = i
        return keys, last, parsed

    def _expired(self, c: Conversation, now: float) -> bool:
        return c.closed or now - c.last > (self.tool_wait_s if c.waiting_tools else self.idle_s)

    def _forget(self, c: Conversation) -> None:
        self.open.pop(c.id, None)
        for k in c.keys:  # its continuation keys, and the digests of its failed turns
            hit = self.by_key.get(k)
            if hit is not None and hit[0] is c:
                del self.by_key[k]
            f = self.failed_turns.get(k)
            if f is not None and f.conv is c:
                del self.failed_turns[k]
        c.keys = []
        self.ended += 1

    def sweep(self, now: float | None = None) -> None:
        """End the idle conversations at the front of the LRU order, and the oldest beyond ``max_open``."""
        now = time.monotonic() if now is None else now
        while self.open:
            c = next(iter(self.open.values()))
            if not (self._expired(c, now) or len(self.open) > self.max_open):
                return
            self._forget(c)

    def get(self, cid: str) -> Conversation | None:
        c = self.open.get(cid)
        if c is not None and self._expired(c, time.monotonic()):
            self._forget(c)
            return None
        return c

    def link(self, messages: list[Any], explicit: str | None) -> Link:
        """The conversation that parsed messages continue. One pass over them: the chained digest, copied at the
        last assistant message (the lookup key) and carried on (``Link.hasher``) for the key its answer adds."""
        last = len(messages) - 1
        while last >= 0 and not (isinstance(messages[last], dict) and messages[last].get("role") == "assistant"):
            last -= 1
        h = xxhash.xxh3_128()
        key = None
        for i, m in enumerate(messages):
            h.update(encode(m))
            if i == last:
                key = h.digest()
        return self._linked(key, h, explicit)

    def link_keys(self, keys: list[bytes], last: int, explicit: str | None) -> Link:
        """``link`` from the messages' encodings (``keys``) and the index of the last assistant message."""
        h = xxhash.xxh3_128(b"".join(keys[: last + 1]))
        key = h.digest() if last >= 0 else None
        h.update(b"".join(keys[last + 1 :]))
        return self._linked(key, h, explicit)

    def _linked(self, key: bytes | None, h: Any, explicit: str | None) -> Link:
        now = time.monotonic()
        full = h.digest()  # the digest of all the messages: a retry's (and the key of this turn if it fails)
        f = self.failed_turns.get(full) if self.failed_turns else None
        if f is not None and not self._expired(f.conv, now) and explicit in (None, f.conv.id):
            f.attempts += 1
            link = Link(f.conv, f.turn, f.history, h, full)
            link.retry, link.arm, link.unit = f.attempts, f.arm, f.unit
            return link
        hit = self.by_key.get(key) if key is not None else None
        if hit is not None and self._expired(hit[0], now):
            self._forget(hit[0])
            hit = None
        if explicit is not None:
            c = self.get(explicit)
            if c is not None:  # named: continues it; the logged history is what the key proves, else none
                n = hit[1] if hit is not None and hit[0] is c else 0
                return Link(c, c.turns, n, h, full)
            return Link(None, 0, 0, h, full)
        if hit is not None:
            return Link(hit[0], hit[0].turns, hit[1], h, full)
        return Link(None, 0, 0, h, full)

    def open_new(self, cid: str, arm: int, explicit: bool) -> Conversation:
        self._opened += 1
        if self._opened % 64 == 0 or len(self.open) >= self.max_open:  # ending idle ones need not be per request
            self.sweep()
        old = self.open.get(cid)
        if old is not None:  # a client reusing an id for a new opening: the old one ends here
            self._forget(old)
        c = Conversation(cid, arm, explicit)
        self.open[cid] = c
        return c

    def started(self, c: Conversation, retry: bool = False) -> None:
        """A turn of ``c`` was routed: it is active now (a retry is the same turn again: the count stays)."""
        c.turns += not retry
        c.last = time.monotonic()
        self.open.move_to_end(c.id)

    def failed(self, c: Conversation, link: Link, turn: int, arm: int, unit: str) -> None:
        """A turn's answer failed or was empty: a request with the same messages is its retry (same turn, arm and
        unit) while the conversation is open."""
        c.last = time.monotonic()
        if c.closed or self.open.get(c.id) is not c or not link.full:
            return
        if link.full not in self.failed_turns:
            c.keys.append(link.full)
            self.failed_turns[link.full] = _Failed(c, turn, link.history, arm, unit)

    def answered(
        self, c: Conversation, hasher: Any, n_messages: int, answer: dict[str, Any] | None, full: bytes = b""
    ) -> None:
        """A turn's answer came: register the key a continuation will look up (messages + answer). An answer
        with text or tool calls ends the retries of its messages: the same messages again are a new request."""
        c.last = time.monotonic()
        if full and answer is not None and not empty(answer):
            self.failed_turns.pop(full, None)
        if answer is None or c.closed or self.open.get(c.id) is not c:
            return
        hasher.update(encode(answer))  # the request's digest is not needed after this: extend it in place
        k = hasher.digest()
        self.by_key[k] = (c, n_messages + 1)
        c.keys.append(k)
        c.waiting_tools = bool(answer.get("tool_calls"))

    def restore(self, cid: str, arm: int, turns: int, messages: list[Any], age_s: float) -> None:
        """A conversation still open when the gateway stopped (its messages and answers reassembled from the
        log): a restarted gateway links its next turn as before (``hermes_lab.live.log.open_conversations``)."""
        c = self.open_new(cid, arm, False)
        c.turns, c.last = turns, time.monotonic() - age_s
        last = messages[-1] if messages else {}
        c.waiting_tools = isinstance(last, dict) and bool(last.get("tool_calls"))
        if self._expired(c, time.monotonic()):
            self._forget(c)
            return
        k = xxhash.xxh3_128_digest(b"".join([encode(m) for m in messages]))  # the chain, as link_keys hashes it
        self.by_key[k] = (c, len(messages))
        c.keys.append(k)

    def close(self, cid: str) -> bool:
        """Feedback closed it: a later turn that would continue it opens a new conversation."""
        c = self.open.get(cid)
        if c is None:
            return False
        c.closed = True
        self._forget(c)
        return True

    def state(self, cid: str) -> str:
        c = self.get(cid)
        if c is None:
            return "ended"
        return "waiting for tool results" if c.waiting_tools else "open"
