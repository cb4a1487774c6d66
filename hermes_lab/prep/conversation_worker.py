"""Distill stage, part 1 (``hermes_lab.prep.ingest``): one conversation line's conversion, the ingest's worker side.

Reads a line of a conversation JSONL format (or, in a forked worker process of ``hermes_lab.prep.conversations``,
its own byte range of a plain file, ``os.pread``), and makes every check on it: decoding (``lines.fast_decode``,
the exact decoder for what orjson may not read), the format's record (``readers.parse_line``), its tests, its
reward (``outcomes.assign_reward``). Gives, per line, a blank, a reject with its reason, a record for the judge, or
a batch item: the record's JSON text, its projection for the prompt tables (first user message, final answer),
the fixed-size fields, its exact / near / conversation_id digests (XXH3-128) and its conversations/ row (a worker
builds its task's rows as one Arrow table, sent back as an IPC stream). Writes nothing.

Run through ``hermes-lab prep`` (``hermes_lab.prep.run.run_prep``), not on its own.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
from typing import Any

import orjson
from xxhash import xxh3_128_digest

from hermes_lab.logs import readers
from hermes_lab.logs.lines import EXACT, decode_exact, fast_decode, known_text, record_tests
from hermes_lab.logs.record import (
    Invalid,
    content_digest,
    dataset_schema,
    final_answer,
    record_of,
    record_text,
    review_key,
    task_prompt_of,
)
from hermes_lab.prep.outcomes import assign_reward

RAW_KEEP = 4096  # bytes of a rejected record's raw text kept when it is cut
RAW_MAX = 1 << 20  # a rejected record's raw text past this is cut, whatever the reason
BOM = b"\xef\xbb\xbf"


class LineWork:
    """What converting one line of a conversation format needs (a worker inherits it when the pool forks)."""

    __slots__ = ("as_dict", "cap", "feedback", "file", "fmt", "max_chars", "role", "round_no", "rules", "scale")

    def __init__(self, **kw: Any):
        self.as_dict = False  # an item's conversations/ row as the dict (a worker's: pa.array takes it), not text
        for k, v in kw.items():
            setattr(self, k, v)


def convert(w: LineWork, lineno: int, line: bytes, keep: bool = False) -> tuple[Any, ...]:
    """One line of a conversation JSONL, every check made: ("blank",), ("reject", reason, detail, raw, cut),
    ("defer", record, text) for the judge, or ("item", the batch's item, the record when ``keep``)."""
    line = line.rstrip(b"\r")
    if line.startswith(BOM):  # Windows editors put one at the file start (or at every join)
        line = line[3:]
    if not line.strip():
        return ("blank",)
    obj = fast_decode(line, KNOWN[0])  # orjson, its checks made on the bytes; else the exact decoder's
    text = None
    if w.fmt == "hermes_trajectory" and type(obj) is dict:
        learn_system(line, obj)
    if obj is EXACT:
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as e:
            return ("reject", "not valid UTF-8", f"{e.reason} at byte {e.start}", line, False)
    try:
        if text is not None:
            obj = decode_exact(text)
        rec = readers.parse_line(obj, w.fmt, w.file, lineno, w.scale, w.max_chars)
        if (tests := record_tests(obj, task_prompt_of(rec["messages"]))) is not None:
            rec["tests"] = tests
    except Invalid as e:
        cut = e.reason == "message too long"  # keep its first 4 KiB, as for a line too long
        return ("reject", e.reason, e.detail, line[:RAW_KEEP] if cut else line, cut)
    if w.role == "negative":
        rec["negative"] = {"file": w.file, "round": w.round_no}
    if not assign_reward(rec, w.feedback, w.rules, w.scale):
        return ("defer", rec, line.decode("utf-8") if text is None else text)
    return ("item", conv_item(lineno, rec, as_dict=w.as_dict), rec if keep else None)


KNOWN: list[Any] = [None, None]  # fast_decode's known text (a Hermes run's system turn) and the last value tried
KNOWN_MIN = 2048  # characters of a system turn from which its bytes are looked for in the next lines


def learn_system(line: bytes, obj: dict[str, Any]) -> None:
    """A Hermes line's system turn (its value: orjson writes it as Hermes's json.dumps does, without ASCII
    escapes) as ``fast_decode``'s known text for the next lines of its run, which repeat it at the same offset;
    each value looked for once (a file written with ASCII escapes has none)."""
    k = KNOWN[0]
    if k is not None and line.startswith(k[0], k[1]):
        return
    turns = obj.get("conversations")
    if type(turns) is not list or not turns or type(turns[0]) is not dict:
        return
    value = turns[0].get("value")
    if type(value) is not str or len(value) < KNOWN_MIN or value == KNOWN[1]:
        return
    KNOWN[1] = value
    try:
        text = orjson.dumps(value)
    except orjson.JSONEncodeError:
        return
    at, known = line.find(text), known_text(text)
    if at >= 0 and known is not None:
        KNOWN[0] = (text, at, *known[2:])


WORK: list[LineWork] = []  # the forked workers' LineWork
_FDS: dict[str, int] = {}  # a worker's open input files


def convert_range(first: int, start: int, length: int) -> tuple[list[tuple[Any, ...]], Any]:
    """A worker's task on a plain file: its byte range read here (whole lines; the last one of the file may lack
    its newline), each line over ``data.max_line_bytes`` rejected as the block reader would (its first 4 KiB
    kept), the others converted (``convert_lines``)."""
    w = WORK[0]
    fd = _FDS.get(w.file)
    if fd is None:
        fd = _FDS[w.file] = os.open(w.file, os.O_RDONLY)
    data = os.pread(fd, length, start)
    lines = data.split(b"\n")
    if data.endswith(b"\n"):
        lines.pop()
    long = [k for k, line in enumerate(lines) if len(line) > w.cap] if length > w.cap else []
    for k in long:
        total = len(lines[k]) + (k < len(lines) - 1 or data.endswith(b"\n"))  # with its newline, as read
        detail = f"{total} bytes > data.max_line_bytes {w.cap}"
        lines[k] = ("reject", "line too long", detail, lines[k][:RAW_KEEP], True)  # type: ignore[call-overload]
    return packed(convert_lines(first, lines))


def convert_task(first: int, lines: list[bytes]) -> bytes:
    """A worker's task on lines read by prep's process (a .gz file): ``convert_lines``, ``packed``."""
    return packed(convert_lines(first, lines))


def packed(result: Any) -> bytes:
    """A task's results as one pickle (protocol 5), which the pool's own pickling then sends as one object:
    multiprocessing's ForkingPickler writes into an io.BytesIO, which grows by an eighth at a time and copies
    itself each time, ~7 ms for a task's ~2 MB of records and rows (~75 us a line) where pickle.dumps takes
    ~1.4. Prep's process: ``pickle.loads``."""
    return pickle.dumps(result, protocol=5)


def convert_lines(first: int, lines: list[Any]) -> tuple[list[tuple[Any, ...]], Any]:
    """A worker's task: its lines converted, and its items' conversations/ rows as one Arrow table (sent as an
    IPC stream; an item holds its row's index there instead of the row). A line that is a tuple is its result."""
    w = WORK[0]
    out = [convert(w, first + k, line) if type(line) is bytes else line for k, line in enumerate(lines)]
    rows = [r[1][9] for r in out if r[0] == "item"]
    if not rows:
        return out, None
    import pyarrow as pa

    table, k = dict_rows(rows), 0
    for i, r in enumerate(out):
        if r[0] == "item":
            out[i] = ("item", (*r[1][:9], k), None)
            k += 1
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return out, sink.getvalue()


def row_schema() -> Any:
    """The conversations/ rows as the ingest keeps them: the dataset's schema without its split (known at distill)."""
    import pyarrow as pa

    return pa.schema([f for f in dataset_schema() if f.name != "split"])


def dict_rows(rows: list[dict[str, Any]]) -> Any:
    """``row_table`` of rows that are still dicts: ``pa.array`` converts them (~4x faster than Arrow's JSON reader
    on their text); what it refuses (a value of a type the schema does not take) goes through their text, as
    the rows of one process do (tests/prep/test_prep.py holds the two to the same dataset)."""
    import pyarrow as pa

    try:
        arr = pa.array(rows, type=pa.struct(list(row_schema())))
    except (pa.ArrowException, TypeError, ValueError, OverflowError):
        return row_table([_text(r) for r in rows], threads=False)
    return pa.Table.from_batches([pa.RecordBatch.from_struct_array(arr)])


def row_table(texts: list[bytes], threads: bool = True) -> Any:
    """conversations/ rows from their text (``_conv_item``'s: the record with tools and meta as JSON text) as one
    Arrow table, parsed by Arrow's JSON reader straight into ``row_schema``; a batch Arrow refuses (a lone
    surrogate's escape) row by row through ``record_of``."""
    import pyarrow as pa
    import pyarrow.json as pj

    schema = row_schema()
    try:
        t = pj.read_json(
            pa.BufferReader(b"\n".join(texts) + b"\n"),
            read_options=pj.ReadOptions(block_size=max(4 << 20, max(map(len, texts)) + 1), use_threads=threads),
            parse_options=pj.ParseOptions(explicit_schema=schema, unexpected_field_behavior="ignore"),
        )
        if t.num_rows != len(texts):
            raise ValueError("a row is not one line")
    except (pa.ArrowInvalid, ValueError):
        rows = [record_of(x.decode("utf-8", "surrogatepass")) for x in texts]
        return pa.Table.from_batches([pa.RecordBatch.from_struct_array(pa.array(rows, type=pa.struct(list(schema))))])
    return t


def conv_item(lineno: int | None, rec: dict[str, Any], as_dict: bool = False) -> tuple[Any, ...]:
    """A conversation in a batch: (line, record text, prompt, response, what the columns need, review key, exact
    digest, near digest, id digest, its conversations/ row as text); no record object (pickled cheaply)."""
    msgs, tools, cid = rec["messages"], rec["tools"], rec["conversation_id"]
    text, key = _record_text(rec), review_key(rec["task_id"], cid)
    o = rec["outcome"]
    info = (cid, rec["family"], rec["reward"], rec["task_id"], o["turns"], o["tool_calls"], o["tool_errors"])
    info += (rec["reward_source"], rec.get("tests"))
    cid_digest = xxh3_128_digest(cid.encode("utf-8", "surrogatepass"))
    row = {**rec, "tools": _tools_text(tools), "meta": json_text(rec.get("meta") or {})}
    row["negative"] = bool(rec.get("negative"))
    return (lineno, text, task_prompt_of(msgs), final_answer(msgs), info, key, *digests(msgs, tools), cid_digest,
            row if as_dict else _text(row))  # fmt: skip


def _text(v: Any, same: Any = None) -> bytes:
    """``record.record_text`` as UTF-8 bytes (what the sinks and the spill take), the U+2028 / U+2029 test
    made on orjson's bytes; ``same``: what orjson writes as ``v`` (a record with its tools as a fragment)."""
    try:
        data = orjson.dumps(v if same is None else same)
    except (TypeError, orjson.JSONEncodeError):
        return record_text(v).encode("utf-8", "surrogatepass")
    # their last bytes first: one byte is a memchr, and \xa8 / \xa9 are rare (a dash is \xe2\x80\x94)
    if (b"\xa8" in data or b"\xa9" in data) and (b"\xe2\x80\xa8" in data or b"\xe2\x80\xa9" in data):
        return record_text(v).encode()
    return data


def digests(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> tuple[bytes, bytes]:
    """(exact, near) 16-byte digests of what was said, as ``record.content_digest`` defines them (exact: roles,
    text, reasoning, call ids and arguments, the schemas; near: the exchange up to whitespace, case, reasoning,
    call ids, system prompt and schemas), in one pass: XXH3-128 of the parts as JSON (unambiguous, C-fast)."""
    exact, near = [], []
    try:
        for m in messages:
            role, text = m["role"], m.get("content") or ""
            calls = m.get("tool_calls") or ()
            said = _system_frag(text) if role == "system" and len(text) >= SYSTEM_FRAG else text
            exact.append((role, said, m.get("reasoning") or "", m.get("tool_call_id") or "",
                          [(c["function"]["name"], c["function"]["arguments"], c["id"]) for c in calls]))  # fmt: skip
            if role != "system":
                near.append((role, " ".join(text.split()).lower(), [_norm_args(c) for c in calls]))
        return (xxh3_128_digest(orjson.dumps(exact) + _tools_key(tools)), xxh3_128_digest(orjson.dumps(near)))
    except (TypeError, orjson.JSONEncodeError):  # a lone surrogate (a session file's): the standard digests
        return content_digest(messages, tools), content_digest(messages, tools, near=True)


def _norm_args(call: dict[str, Any]) -> tuple[str, str]:
    args = call["function"]["arguments"]
    with contextlib.suppress(orjson.JSONDecodeError):
        args = orjson.dumps(orjson.loads(args), option=orjson.OPT_SORT_KEYS).decode().lower()
    return call["function"]["name"], args


_TOOLS: dict[int, tuple[Any, bytes, str, Any]] = {}  # id -> (the list, kept alive; its digest; its JSON text; its
# orjson text as a fragment of a record's, None where orjson refuses it)


def _tools_cached(tools: list[dict[str, Any]]) -> tuple[bytes, str, Any]:
    """A tool list's digest, JSON text and orjson fragment, once per list object (a Hermes run's lines share one
    parsed list)."""
    hit = _TOOLS.get(id(tools))
    if hit is not None and hit[0] is tools:
        return hit[1], hit[2], hit[3]
    text = json_text(tools)
    d = xxh3_128_digest(orjson.dumps(tools, option=orjson.OPT_SORT_KEYS)) if tools else b""
    try:
        frag = orjson.Fragment(orjson.dumps(tools))
    except (TypeError, orjson.JSONEncodeError):
        frag = None
    if len(_TOOLS) >= 256:
        _TOOLS.clear()
    _TOOLS[id(tools)] = (tools, d, text, frag)
    return d, text, frag


def _record_text(rec: dict[str, Any]) -> bytes:
    """``_text`` of a record, its tool list and a long first system message written once per object (the same
    bytes: orjson's text of them)."""
    frag = _tools_cached(rec["tools"])[2] if rec["tools"] else None
    same = None if frag is None else {**rec, "tools": frag}
    msgs = rec["messages"]
    m = msgs[0]
    if m["role"] == "system" and len(m["content"] or "") >= SYSTEM_FRAG:
        with contextlib.suppress(TypeError, orjson.JSONEncodeError):  # a lone surrogate: _text's own fallback
            same = {**(same or rec), "messages": [{**m, "content": _system_frag(m["content"])}, *msgs[1:]]}
    return _text(rec, same)


SYSTEM_FRAG = 1024  # a system message from this length on is encoded once per text object (``_system_frag``)
_SYSTEM: list[tuple[str, Any]] = []  # (text, kept alive; its orjson text as a fragment), the last few


def _system_frag(text: str) -> Any:
    """orjson's text of a system message as a fragment of a record's or a digest's text, once per string object:
    the lines of a Hermes run share one system turn (``hermes_trajectory._trajectory`` gives them one stripped
    text), ~70% of a line's bytes, which the record text and the exact digest would otherwise encode again each line."""
    for t, f in _SYSTEM:
        if t is text:
            return f
    f = orjson.Fragment(orjson.dumps(text))  # raises on a lone surrogate, as the whole text's encoding would
    _SYSTEM.insert(0, (text, f))
    del _SYSTEM[4:]
    return f


def json_text(v: Any) -> str:
    """A dataset row's JSON text column (tools, meta): orjson's, the standard encoder's for what it refuses."""
    try:
        return orjson.dumps(v).decode()
    except (TypeError, orjson.JSONEncodeError):
        return json.dumps(v, ensure_ascii=False)


def _tools_key(tools: list[dict[str, Any]]) -> bytes:
    return _tools_cached(tools)[0]


def _tools_text(tools: list[dict[str, Any]]) -> str:
    return _tools_cached(tools)[1]


def cut_raw(raw: Any, reason: str) -> tuple[Any, dict[str, Any]]:
    """A rejected record's raw text as rejects.jsonl keeps it: its first 4 KiB when it is too long to be the
    point (a line or message too long, or anything past 1 MiB), whole otherwise."""
    cut = len(raw) > RAW_KEEP and (reason in ("message too long", "line too long") or len(raw) >= RAW_MAX)
    return (raw[:RAW_KEEP], {"raw_truncated": True}) if cut else (raw, {})
