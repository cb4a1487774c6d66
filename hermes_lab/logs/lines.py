"""Prep's lowest layer (stage: prep, through ``hermes_lab.prep.ingest``): one JSON line, the seed record's checks,
the split and review hashes, and the duplicate index. Reads and writes nothing itself.

Every field of every line is validated (a bad line is a reject with its number and reason, never a
traceback): valid UTF-8; JSON with no NaN/Infinity, no number that overflows a double or that Python
refuses to convert (an integer of more than 4300 digits), no key twice in one object (parsers disagree on
which value wins), no lone surrogate escape in any string or key, not nested beyond Python's recursion
limit; a seed record is an object with prompt (non-empty string), response (string), reward (a number in
0..scale, not a bool), task_id (non-empty string, or an integer, kept as text), family (a string or null,
optional). A line (a seed record or a conversation's) may also carry its task's tests (``tests``,
``entry_point``, MBPP's ``test_list``, HumanEval's ``test``, APPS' ``input_output``:
``hermes_lab.sandbox.specs.parse_tests``): tests that do not parse reject the line ("bad tests", naming the
test), tests that do are kept with the record, normalised, for the tests reward (``record_tests``).
``DigestIndex`` holds 16-byte digests in sorted numpy runs (24 bytes each).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
from pathlib import Path
from typing import Any

import orjson

from hermes_lab.logs.record import Invalid
from hermes_lab.sandbox.specs import SpecError, parse_tests

BOM = b"\xef\xbb\xbf"
REQUIRED = ("prompt", "response", "reward", "task_id")
_CACHE_MAX = 200_000  # entries of the per-task split cache before it is cleared


Bad = Invalid  # a rejected line: its reason (counted in summary.json) and a detail naming the field or turn


# ------------------------------------------------------------------------------------------ decoding
def _no_constants(name: str) -> Any:
    raise Bad("NaN/Infinity not allowed", f"{name} is not valid JSON")


def _float(text: str) -> float:
    v = float(text)
    if math.isinf(v):  # 1e400: Python reads inf, Arrow and the loss cannot use it, other parsers refuse it
        raise Bad("number out of range", f"{text[:40]} overflows a 64-bit float")
    return v


def _pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    d = dict(pairs)
    if len(d) != len(pairs):
        seen: set[str] = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        raise Bad("duplicate key", f"key {dup[:40]!r} appears twice in one object (parsers disagree on which wins)")
    return d


# one decoder (json.loads(**kw) would build one per call), called through its C scanner: JSONDecoder.decode
# adds two Python frames per line for the whitespace handling done here
_DECODER = json.JSONDecoder(parse_constant=_no_constants, parse_float=_float, object_pairs_hook=_pairs)
_SCAN = json.scanner.make_scanner(_DECODER)
_WS = json.decoder.WHITESPACE.match


def _kind(v: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(type(v), "number")


def lone_surrogate(obj: Any) -> str | None:
    """The top-level field holding a string (or key) with a lone surrogate, else None. Iterative: no depth limit."""
    for top, value in obj.items() if isinstance(obj, dict) else [("(top level)", obj)]:
        stack = [top, value]
        while stack:
            v = stack.pop()
            if isinstance(v, str):
                try:
                    v.encode("utf-8")
                except UnicodeEncodeError:
                    return top
            elif isinstance(v, dict):
                stack.extend(v.keys())
                stack.extend(v.values())
            elif isinstance(v, list):
                stack.extend(v)
    return None


_DIGITS = bytes(48 if 48 <= i <= 57 else 10 for i in range(256))  # translate: a digit -> "0", the rest -> newline
_LONG_INT = b"0" * 19  # an integer past 64 bits: orjson reads it as a float, Python as an int
# translate: a digit -> "0", a colon stays, the rest -> newline (one pass for both checks)
_MARKS = bytes(48 if 48 <= i <= 57 else i if i == 58 else 10 for i in range(256))


def decode(text: str, raw: bytes | None = None) -> Any:
    """The JSON value of one line; Bad (reason, detail) for anything the checks above refuse. orjson (C) reads
    it first (``fast_decode``); the standard decoder with every check (``decode_exact``) reads what orjson refuses
    (and so names the fault) or might read otherwise: deep nesting, a 64-bit-plus integer, a duplicate key."""
    obj = fast_decode(text.encode("utf-8", "surrogatepass") if raw is None else raw)  # ``raw``: the line's bytes
    return decode_exact(text) if obj is EXACT else obj


EXACT = object()  # fast_decode's answer for a line only the exact decoder may read
MAX_DEPTH = 500  # nesting orjson reads (to 1024) and the standard decoder too (Python's recursion limit: ~990)


def fast_decode(raw: bytes, known: tuple[bytes, int, int, bool, bool] | None = None) -> Any:
    """``decode`` of a line's bytes by orjson, or ``EXACT`` when the line is for ``decode_exact``: orjson refuses
    it (invalid UTF-8, a lone surrogate, NaN, a number a double cannot hold, bad JSON: the exact decoder names
    the fault), it holds ``\\u003a`` (a colon the key count below cannot see), a key twice (``_keys_unique``),
    nesting past ``MAX_DEPTH``, or a float where a run of 19 digits may be an integer orjson read as one.

    ``known`` (``known_text``): a JSON string's bytes the line holds at a given offset (a Hermes run's system turn,
    ~70% of a line), with what the tests below find in them: the tests then scan only the bytes around it (a line
    without them there: all of it). The same answers: the string starts and ends with a quote, which no pattern
    tested here holds, so each match lies wholly before, inside or after it, and the colons add up."""
    if known is None or not raw.startswith(known[0], known[1]):
        known = _NO_KNOWN
    text, at, colons, u003, long_run = known
    head, tail = raw[:at], raw[at + len(text) :]  # (no known text: b"" and the line itself, not a copy)
    if u003 or b"\\u003" in head or b"\\u003" in tail:
        return EXACT
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return EXACT
    mh, mt = head.translate(_MARKS), tail.translate(_MARKS)
    ok: bool | None = None
    if not long_run and _LONG_INT not in mh and _LONG_INT not in mt:
        # no run of digits orjson may read otherwise: the key count decides alone, taken on orjson's text of the
        # value (its colons: one a key, plus those inside strings) in C; orjson writes no nesting past 254 (it
        # refuses it), so what it writes is within MAX_DEPTH
        with contextlib.suppress(orjson.JSONEncodeError):
            ok = orjson.dumps(obj).count(b":") == colons + mh.count(b":") + mt.count(b":")
    if ok is None:
        ok = _keys_unique(raw, obj)
        if ok is None:  # a float: an integer past 64 bits reads as one in orjson, as an int in Python
            ok = _LONG_INT not in raw.translate(_DIGITS)
    return obj if ok else EXACT


_NO_KNOWN = (b"", 0, 0, False, False)  # fast_decode without a known text: the whole line is scanned


def known_text(text: bytes) -> tuple[bytes, int, int, bool, bool] | None:
    """``fast_decode``'s ``known`` for a JSON string's bytes (``text``, its quotes included), offset 0: its colons,
    whether it holds ``\\u003`` and a run of 19 digits; None for bytes that are not one quoted string."""
    if len(text) < 2 or text[:1] != b'"' or text[-1:] != b'"':
        return None
    return (text, 0, text.count(b":"), b"\\u003" in text, _LONG_INT in text.translate(_MARKS))


def _keys_unique(raw: bytes, obj: Any) -> bool | None:
    """No object of ``obj`` had a key twice and none is nested past ``MAX_DEPTH``: the line's colons are its
    objects' key separators plus the colons inside its strings, so a key that a later one overwrote leaves the
    count short (``\\u003a``, a colon that is no colon in the text, is excluded by ``fast_decode``; a colon byte
    is never part of a multi-byte UTF-8 character). None when the count holds and a float was read."""
    n, floats = 0, False
    stack = [(obj, 1)]
    while stack:
        v, depth = stack.pop()
        if depth > MAX_DEPTH:
            return False
        depth += 1
        if type(v) is str:
            n += v.count(":")
        elif type(v) is dict:
            n += len(v)
            for k, x in v.items():
                n += k.count(":")
                if type(x) is str:
                    n += x.count(":")
                elif type(x) is dict or type(x) is list:
                    stack.append((x, depth))
                elif type(x) is float:
                    floats = True
        elif type(v) is list:  # only what can hold a colon or a key goes on the stack (not a group's token ids)
            for x in v:
                if type(x) is str:
                    n += x.count(":")
                elif type(x) is dict or type(x) is list:
                    stack.append((x, depth))
                elif type(x) is float:
                    floats = True
        elif type(v) is float:
            floats = True
    if n != raw.count(b":"):
        return False
    return None if floats else True


def decode_exact(text: str) -> Any:
    """``decode`` with the standard decoder and every check, value by value."""
    try:
        try:
            obj, end = _SCAN(text, _WS(text, 0).end())
        except StopIteration as err:
            raise json.JSONDecodeError("Expecting value", text, err.value) from None
        end = _WS(text, end).end()
        if end != len(text):
            raise json.JSONDecodeError("Extra data", text, end)
    except json.JSONDecodeError as e:
        raise Bad("malformed JSON", f"{e.msg} at column {e.colno}") from None
    except RecursionError:
        raise Bad("malformed JSON", "nested too deeply") from None
    except ValueError as e:  # not Bad: int() refusing a 4300+ digit integer
        if isinstance(e, Bad):
            raise
        raise Bad("number out of range", str(e)[:120]) from None
    if ("\\ud" in text or "\\uD" in text) and (field := lone_surrogate(obj)) is not None:
        # "\ud800" escapes decode to lone surrogates: UTF-8 writers, Arrow and most parsers refuse them
        raise Bad("invalid Unicode", f"lone surrogate escape in {field}")
    return obj


def check_record(obj: Any, scale: float) -> tuple[str, str, float, str, str | None]:
    """(prompt, response, reward, task_id, family field) of a valid record, else raises Bad."""
    if type(obj) is not dict:
        raise Bad("not a JSON object", f"got a JSON {_kind(obj)}")
    for k in REQUIRED:
        if k not in obj:
            raise Bad(f"missing field '{k}'", f"required: {', '.join(REQUIRED)}; present: {', '.join(list(obj)[:12])}")
    prompt, response, reward, task_id = obj["prompt"], obj["response"], obj["reward"], obj["task_id"]
    if type(prompt) is not str:
        raise Bad("prompt not a string", f"prompt is a JSON {_kind(prompt)}")
    if not prompt.strip():
        raise Bad("empty prompt")
    if type(response) is not str:
        raise Bad("response not a string", f"response is a JSON {_kind(response)}")
    if type(reward) is not float and type(reward) is not int:  # bool is not a reward; neither is "4.2"
        raise Bad("reward not a number", f"reward is a JSON {_kind(reward)}: {str(reward)[:40]}")
    if not 0 <= reward <= scale:
        raise Bad("reward out of range", f"reward {str(reward)[:40]} outside 0..{scale:g}")
    if type(task_id) is int:  # numeric ids are common in exports; the split hashes the text
        task_id = str(task_id)
    elif type(task_id) is not str or not task_id.strip():
        raise Bad("bad task_id", f"task_id must be a non-empty string, got {json.dumps(task_id)[:40]}")
    fam = obj.get("family")
    if fam is not None and type(fam) is not str:
        raise Bad("bad family", f"family must be a string or null, got a JSON {_kind(fam)}")
    return prompt, response, float(reward), task_id, fam or None


TEST_FIELDS = ("tests", "entry_point", "test_list", "test", "input_output")


def record_tests(obj: dict[str, Any], prompt: str) -> str | None:
    """The record's tests as normalised JSON (``TestSpec.to_json``), None without any; Bad when they do not parse."""
    if not any(k in obj for k in TEST_FIELDS):
        return None
    try:
        spec = parse_tests(obj, prompt)
    except SpecError as e:
        raise Bad("bad tests", str(e)[:300]) from None
    return spec.to_json() if spec is not None else None


# ------------------------------------------------------------------------------------------- reading
def estimated_size(path: Path) -> int:
    """Bytes of text in a file: its size, or for gzip the larger of 4x the size and the ISIZE trailer."""
    if path.is_dir():  # a folder of session files, of traces (sub-agents in subfolders)
        return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    size = path.stat().st_size
    if not is_gzip(path):
        return size
    try:
        with open(path, "rb") as f:
            f.seek(-4, os.SEEK_END)
            isize = int.from_bytes(f.read(4), "little")
    except OSError:
        isize = 0
    return max(isize, 4 * size)


def is_gzip(path: Path) -> bool:
    if path.name.endswith(".gz"):
        return True
    with open(path, "rb") as f:
        return f.read(2) == b"\x1f\x8b"


def split_of(task_id: str, fraction: float, cache: dict[str, bool]) -> bool:
    """True when the task_id is held out: first 8 hex of sha1(task_id) / 0xFFFFFFFF < fraction."""
    held = cache.get(task_id)
    if held is None:
        if len(cache) > _CACHE_MAX:
            cache.clear()
        held = int(hashlib.sha1(task_id.encode("utf-8")).hexdigest()[:8], 16) / 0xFFFFFFFF < fraction
        cache[task_id] = held
    return held


def review_id(task_id: str, prompt: str, response: str, joined: bytes | None = None) -> str:
    """The review id of a record: sha1 of task_id + prompt + response (``joined``: those bytes, if at hand)."""
    return hashlib.sha1(joined if joined is not None else (task_id + prompt + response).encode()).hexdigest()[:12]


def review_rank(seed: int, key: bytes) -> int:
    """The review sample's seeded hash rank of a record: XXH3-64 of its key (a seed record's
    ``"{len(task_id)},{len(prompt)},{task_id}{prompt}{response}"``, a conversation's ``review_key``), seeded with
    ``data.seed`` (the ingest computes it inline; the sample is the lowest ranks per stratum)."""
    from xxhash import xxh3_64_intdigest

    return xxh3_64_intdigest(key, seed % (1 << 64))


# ------------------------------------------------------------------------------------ duplicate index
class DigestIndex:
    """Set of 16-byte digests with the seq of their first record, in sorted numpy runs (24 bytes each).

    Runs merge like a binary counter (a run merges into the previous one once it is at least half its
    size), so every digest is merged O(log n) times and lookups search O(log n) runs."""

    def __init__(self) -> None:
        import numpy as np

        self.np = np
        self.runs: list[tuple[Any, Any, Any]] = []  # (hi sorted, lo, origin)

    def lookup(self, hi: Any, lo: Any) -> Any:
        np = self.np
        found = np.full(len(hi), -1, dtype=np.int64)
        for rhi, rlo, rorig in self.runs:
            pos = np.searchsorted(rhi, hi)
            pos_c = np.minimum(pos, len(rhi) - 1)
            same_hi = (pos < len(rhi)) & (rhi[pos_c] == hi)
            hit = same_hi & (rlo[pos_c] == lo)
            found[hit] = rorig[pos_c[hit]]
            for j in np.flatnonzero(same_hi & ~hit).tolist():  # 64-bit prefix shared by another digest: rare
                k = int(pos[j]) + 1
                while k < len(rhi) and rhi[k] == hi[j]:
                    if rlo[k] == lo[j]:
                        found[j] = rorig[k]
                        break
                    k += 1
        return found

    def add(self, hi: Any, lo: Any, origin: Any) -> None:
        np = self.np
        if not len(hi):
            return
        run = (hi, lo, origin)
        while self.runs and len(self.runs[-1][0]) <= 2 * len(run[0]):
            prev = self.runs.pop()
            run = tuple(np.concatenate([a, b]) for a, b in zip(prev, run))  # type: ignore[assignment]
        order = np.argsort(run[0], kind="stable")  # timsort: two sorted runs merge in linear time
        self.runs.append(tuple(a[order] for a in run))  # type: ignore[arg-type]

    def __len__(self) -> int:
        return sum(len(r[0]) for r in self.runs)
