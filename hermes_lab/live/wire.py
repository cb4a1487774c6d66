"""A chat request's body as the gateway reads it: the top level split into raw slices, the small fields parsed, the
messages and tool list left as the client's bytes (stage: validate, live A/B; ``hermes-lab serve``).

Reads nothing on disk; ``hermes_lab.live.handling`` builds a ``ChatBody`` from every chat request's bytes.

An agent re-sends its whole history with every turn: 21-41 messages and ~7 KB of tool schemas, 31-52 KB, of
which one or two messages are new. Parsing it all (orjson: ~120 us for 58 KB) and writing it all again for the
upstream (~25 us) cost more than anything else the gateway does for a turn. Here msgspec splits the body into
raw slices in C (``msgspec.Raw``: the structure checked, nothing built; the top level and the messages in one
pass when the body holds only the chat fields of ``FIELDS``, else in two); the small top-level fields (model,
stream, metadata, ...) are parsed by orjson, which checks them whole; the messages are encoded for the link by
``hermes_lab.live.conversations.Tracker.keys``, which parses only those it has not seen (so every message is
checked by orjson once: msgspec's skip does not check UTF-8 or numbers inside a value); the tool list by
``hermes_lab.live.log.ToolsLog.add_raw``, the same way. The upstream's body is the client's own slices with the
arm's model (``ChatBody.upstream``: parts of one write, neither parsed nor serialised). An in-process arm, and a
conversation's opening (its prompt is logged), get the messages parsed. A body of at most ``SMALL`` bytes (a
single-turn request) is parsed whole, as before: its slices would cost it more than they save.

    hermes-lab serve --params params/embedded.yaml      # then POST http://127.0.0.1:8700/v1/chat/completions
"""

from __future__ import annotations

import os
from typing import Any

import msgspec
import orjson
import xxhash

_TOP = msgspec.json.Decoder(dict[str, msgspec.Raw])
_LIST = msgspec.json.Decoder(list[msgspec.Raw])
SLICED = ("messages", "tools")  # the top-level fields kept as the client's bytes
SMALL = 4096  # bytes: a body up to this size is parsed whole (a single-turn request; cheaper than its slices)
# The chat request's fields a client may send (OpenAI's, and the sampling extras of vLLM and SGLang): a body of
# these alone is split, top level and messages, in one pass (``_KNOWN``; any other field: two passes, ``_TOP``
# then ``_LIST``, the messages' bytes skipped a second time)
FIELDS = (
    "model", "tools", "tool_choice", "parallel_tool_calls", "stream", "stream_options", "temperature", "top_p",
    "max_tokens", "max_completion_tokens", "n", "stop", "seed", "presence_penalty", "frequency_penalty",
    "logit_bias", "logprobs", "top_logprobs", "user", "metadata", "response_format", "reasoning_effort",
    "service_tier", "store", "modalities", "audio", "prediction", "web_search_options", "functions",
    "function_call", "safety_identifier", "prompt_cache_key", "verbosity", "top_k", "min_p", "repetition_penalty",
    "chat_template_kwargs",
)  # fmt: skip
_UNSET = msgspec.UNSET
_KNOWN = msgspec.json.Decoder(
    msgspec.defstruct(
        "_Known",
        [("messages", list[msgspec.Raw], []), *((k, msgspec.Raw | msgspec.UnsetType, _UNSET) for k in FIELDS)],
        forbid_unknown_fields=True,
    )
)


_SEED = int.from_bytes(os.urandom(8), "little")  # a client cannot aim a raw digest at another client's bytes


def raw_digest(raw: Any) -> bytes:
    """The key of a slice's bytes in the gateway's caches of what it has parsed (a message's encoding, a tool
    list's hash): XXH3-128, seeded at random per process."""
    return xxhash.xxh3_128_digest(raw, _SEED)


class BadBody(ValueError):
    """A body the gateway refuses (400), with the error code it answers."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


def _bad_json(e: Exception, where: str = "") -> BadBody:
    return BadBody("invalid_json", f"the body is not valid JSON: {where}{e}")


class ChatBody:
    """One chat request's body. ``fields``: its top-level fields but ``messages`` and ``tools``, parsed; ``raws``: each
    message's bytes (``msgspec.Raw``, views of the body); ``tools``: the tool list's bytes (None: absent); the
    upstream's body is ``upstream``'s parts. A body of at most ``SMALL`` bytes is parsed whole instead: ``fields`` is
    the body, ``raws`` and ``tools`` are None."""

    __slots__ = ("_full", "_keys", "body", "fields", "n", "raws", "tools")

    def __init__(self, body: bytes):
        self.body, self._full, self._keys = body, None, None
        if len(body) <= SMALL:
            self._whole(body)
            return
        try:
            known = _KNOWN.decode(body)
        except msgspec.ValidationError:  # another field, or not the shapes: the general path says which
            top, known = self._top(body), None
        except msgspec.DecodeError as e:
            raise _bad_json(e) from None
        else:
            top = {k: v for k in FIELDS if (v := getattr(known, k)) is not _UNSET}
        fields: dict[str, Any] = {}
        for k, v in top.items():
            if k in SLICED:
                continue
            try:
                fields[k] = orjson.loads(memoryview(v))
            except orjson.JSONDecodeError as e:
                raise _bad_json(e, f"{k!r}: ") from None
        raws = None
        if known is not None:
            raws = known.messages
        elif "messages" in top:
            try:
                raws = _LIST.decode(top["messages"])
            except msgspec.ValidationError:
                raws = None
        if not raws:
            raise BadBody("invalid_messages", "'messages' must be a non-empty list")
        self.fields, self.raws, self.tools, self.n = fields, raws, top.get("tools"), len(raws)

    @staticmethod
    def _top(body: bytes) -> dict[str, Any]:
        try:
            return _TOP.decode(body)
        except msgspec.ValidationError:
            raise BadBody("invalid_body", "the body must be a JSON object") from None
        except msgspec.DecodeError as e:
            raise _bad_json(e) from None

    def _whole(self, body: bytes) -> None:
        try:
            obj = orjson.loads(body)
        except orjson.JSONDecodeError as e:
            raise _bad_json(e) from None
        if not isinstance(obj, dict):
            raise BadBody("invalid_body", "the body must be a JSON object")
        msgs = obj.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise BadBody("invalid_messages", "'messages' must be a non-empty list")
        self.fields, self.raws, self.tools, self.n, self._full = obj, None, None, len(msgs), obj

    def encode_messages(self, tracker: Any) -> None:
        """A large body's messages encoded for the link (``Tracker.keys``: only those never seen are parsed; raises
        ``orjson.JSONDecodeError`` on one that is not valid JSON). A small body's are encoded by ``link``."""
        if self.raws is not None:
            self._keys = tracker.keys(self.raws)

    def link(self, tracker: Any, explicit: str | None) -> Any:
        """The request's ``Link`` (``Tracker.link_keys`` of the encodings; of a small body, ``Tracker.link``)."""
        if self.raws is None:
            return tracker.link(self.fields["messages"], explicit)
        if self._keys is None:
            self.encode_messages(tracker)
        return tracker.link_keys(self._keys[0], self._keys[1], explicit)

    def tools_hash(self, tools_log: Any) -> str | None:
        """The tool list's hash in ``tools.jsonl`` (``ToolsLog``: of its bytes, or of a small body's parsed list)."""
        if self.raws is None:
            return tools_log.add(self.fields.get("tools"))
        return tools_log.add_raw(self.tools)

    def upstream(self, model: str, extra: dict[str, Any] | None = None) -> list[Any]:
        """The body for an upstream arm, as the parts of one write (their lengths add up to it): the top-level fields
        with the arm's ``model`` (and ``extra``: a stream's) serialised, then the client's messages and tool list as
        they came (the messages joined once, nothing copied into orjson's buffer). A small body: one part."""
        small = {**self.fields, "model": model, **(extra or {})}
        if self.raws is None:
            return [orjson.dumps(small)]
        # the fields' object left open (it holds the model at least, so a comma follows), then the slices
        parts = [orjson.dumps(small)[:-1], b',"messages":[', b",".join(self.raws), b"]"]
        if self.tools is not None:
            parts += (b',"tools":', self.tools)
        parts.append(b"}")
        return parts

    def get(self, key: str, default: Any = None) -> Any:
        """A top-level field other than the messages and tools, parsed."""
        return self.fields.get(key, default)

    def full(self) -> dict[str, Any]:
        """The body parsed whole (an in-process arm renders the messages and tools itself)."""
        if self._full is None:
            self._full = orjson.loads(self.body)
        return self._full

    def messages(self, start: int = 0) -> list[Any]:
        """The messages from ``start`` on, parsed: those ``encode_messages`` parsed as they are, the others now (each
        was checked when first seen)."""
        raws = self.raws
        if raws is None:  # a small body: parsed whole
            return self.fields["messages"][start:]
        parsed = self._keys[2] if self._keys is not None else {}
        return [parsed[i] if i in parsed else orjson.loads(memoryview(raws[i])) for i in range(start, self.n)]
