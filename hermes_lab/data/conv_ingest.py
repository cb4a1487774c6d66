"""Distill stage, part 1 (``hermes_lab.data.ingest``), the conversations' half: every shape but the seed's.

Reads what ``hermes_lab.data.readers`` detected as a conversation format: the line formats' records come from the
ingest's JSONL scan, the others (``readers.RECORD_FORMATS``: Hermes session files, state.db and exports, Claude
Code / Agent Trace JSONL, Atropos groups) from their readers, whole (``records``). Each record is rewarded (its
log's reward, else feedback joined by conversation_id, else the outcome rules or the judge:
``conversations.reward``), and deduped three ways, each a ``DigestIndex``: exact (what was said, call ids and
reasoning included), near (the exchange up to whitespace, case, reasoning, call ids, system prompt and tool
schemas: a run's trajectory line and its session snapshot) and by conversation_id (a run and its compressed
copy). Writes what the ingest writes (the sinks, the fixed-size columns, the partitions: ``Ingest`` holds them;
this is its mixin) and each accepted conversation's conversations/ row, as Arrow, in acceptance order (a large
file's lines are converted by forked worker processes, which read their own byte ranges of a plain file and
build their rows' Arrow table too), and counts per input what the readers report (blank lines, skipped lines,
Atropos groups, where tool schemas came from).

Run through ``hermes-lab prep`` (``hermes_lab.data.prep.run_prep``), not on its own.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
from collections import Counter, deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
from xxhash import xxh3_64_intdigest, xxh3_128_digest

from hermes_lab.data import atropos, hermes_store, readers, traces
from hermes_lab.data.columns import read_blocks
from hermes_lab.data.conversation import (
    Invalid,
    content_digest,
    dataset_schema,
    final_answer,
    record_of,
    record_text,
    review_key,
    task_prompt_of,
)
from hermes_lab.data.lines import EXACT, decode_exact, fast_decode, record_tests, split_of
from hermes_lab.data.outcomes import assign_reward

RAW_KEEP = 4096  # bytes of a rejected record's raw text kept when it is cut
RAW_MAX = 1 << 20  # a rejected record's raw text past this is cut, whatever the reason
BATCH_LINES = 16384  # records held before one vectorised duplicate lookup
LINE_BITS = 40  # origin = file index << 40 | line number (the ingest's)


PARALLEL_MIN = 8 << 20  # a conversation file from this size on is converted by worker processes
TASK_BYTES = 1 << 20  # lines sent to a worker at once
FLIGHT = 6  # tasks in flight a worker: the workers keep converting while this process writes a batch (~0.2 s)
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
    obj = fast_decode(line)  # orjson, its checks made on the bytes; a line it may not read: the exact decoder's
    text = None
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
    return ("item", _conv_item(lineno, rec, as_dict=w.as_dict), rec if keep else None)


_WORK: list[LineWork] = []  # the forked workers' LineWork
_FDS: dict[str, int] = {}  # a worker's open input files


def _convert_range(first: int, start: int, length: int) -> tuple[list[tuple[Any, ...]], Any]:
    """A worker's task on a plain file: its byte range read here (whole lines; the last one of the file may lack
    its newline), each line over ``data.max_line_bytes`` rejected as the block reader would (its first 4 KiB
    kept), the others converted (``_convert_lines``)."""
    w = _WORK[0]
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
    return _convert_lines(first, lines)


def _convert_lines(first: int, lines: list[Any]) -> tuple[list[tuple[Any, ...]], Any]:
    """A worker's task: its lines converted, and its items' conversations/ rows as one Arrow table (sent as an
    IPC stream; an item holds its row's index there instead of the row). A line that is a tuple is its result."""
    w = _WORK[0]
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
    the rows of one process do (tests/test_prep.py holds the two to the same dataset)."""
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


class ConversationIngest:
    """The ingest's conversation methods (``Ingest`` inherits them; its attributes are theirs)."""

    def line_work(self, ctx: Any) -> LineWork:
        return LineWork(
            fmt=ctx.conv,
            file=ctx.st["file"],
            role=ctx.role,
            round_no=ctx.round_no,
            scale=self.scale,
            max_chars=self.conv_cfg.max_message_chars,
            feedback=self.feedback,
            rules=self.conv_cfg,
            cap=self.cap,
        )

    def pool(self, ctx: Any, size: int) -> list[Any] | None:
        """Worker processes for a large conversation file (both cores: the conversion is ~90% of its time; the
        judge's queue needs the records here, so not with conversations.reward: judge); None: convert here.
        [pool, results in flight, the last line number sent]."""
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        if ctx.conv is None or self.judge is not None or size < PARALLEL_MIN or cores < 2:
            return None
        import multiprocessing

        _WORK[:] = [self.line_work(ctx)]  # inherited by the forked workers: no pickling of the feedback
        _WORK[0].as_dict = True
        return [multiprocessing.get_context("fork").Pool(cores), deque(), 0]

    def _conv_block(self, ctx: Any, pool: list[Any], lines: list[bytes]) -> None:
        """A block's lines sent to the workers in tasks of ~TASK_BYTES; results taken in order, a few in flight
        (the file is not read ahead into memory)."""
        p, flight = pool[0], pool[1]
        if not flight:
            pool[2] = ctx.lineno
        start, size = 0, 0
        for k, line in enumerate(lines):
            size += len(line)
            if size >= TASK_BYTES or k == len(lines) - 1:
                flight.append(p.apply_async(_convert_lines, (pool[2] + 1, lines[start : k + 1])))
                pool[2] += k + 1 - start
                start, size = k + 1, 0
                while len(flight) > FLIGHT * p._processes:
                    self._take_task(ctx, flight.popleft())

    def conv_ranges(self, ctx: Any, pool: list[Any], f: Any) -> Iterator[tuple[list[Any], bool]]:
        """A plain file's lines for the workers as byte ranges of ~TASK_BYTES, each read by its worker (this process
        only finds where lines end and counts them, in one reused buffer); a block for the scan's loop after each
        (none to read here). A line longer than the buffer: from its start on, the file's blocks as
        ``columns.read_blocks`` gives them (a line over ``data.max_line_bytes`` is never held whole)."""
        p, flight = pool[0], pool[1]
        buf = bytearray(TASK_BYTES)
        start = f.tell()
        while True:
            n = f.readinto(buf)
            if not n:
                return
            end = buf.rfind(b"\n", 0, n) + 1
            lines = buf.count(b"\n", 0, end)
            if n < len(buf) and end < n:  # the file's last line, without its newline
                end, lines = n, lines + 1
            if not end:
                f.seek(start)
                yield from read_blocks(f, self.cap)
                return
            if not flight:
                pool[2] = ctx.lineno
            flight.append(p.apply_async(_convert_range, (pool[2] + 1, start, end)))
            pool[2] += lines
            start += end
            f.seek(start)
            while len(flight) > FLIGHT * p._processes:
                self._take_task(ctx, flight.popleft())
            yield [], True

    def _take_task(self, ctx: Any, result: Any) -> None:
        results, rows = result.get()
        if rows is not None:
            import pyarrow as pa

            rows = pa.ipc.open_stream(rows).read_all()
        for res in results:
            ctx.lineno += 1
            if res[0] == "item":  # its conversations/ row: (the task's table, its index)
                res = ("item", (*res[1][:9], (rows, res[1][9])), None)
            self._take(ctx, ctx.lineno, res)

    def _drain(self, ctx: Any, pool: list[Any] | None) -> None:
        while pool is not None and pool[1]:
            self._take_task(ctx, pool[1].popleft())

    def _take(self, ctx: Any, lineno: int, res: tuple[Any, ...]) -> None:
        """A converted line: a blank, a reject, the judge's, or an item of the batch."""
        if res[0] == "blank":
            ctx.blank += 1
            return
        ctx.read += 1
        st = ctx.st
        if res[0] == "reject":
            _, reason, detail, raw, cut = res
            self._reject(st, lineno, reason, detail, raw, **({"raw_truncated": True} if cut else {}))
            return
        if res[0] == "defer":
            self.judge.defer(ctx.fidx, ctx.role, lineno, res[1], res[2])  # type: ignore[union-attr]
            return
        item = res[1]
        if self.judge is not None:
            self.judge.offer(res[2], res[2]["reward"])
        ctx.pending.append(item)
        ctx.pending_bytes += 2 * len(item[1]) + len(item[2]) + len(item[3])
        if len(ctx.pending) >= BATCH_LINES or ctx.pending_bytes >= self.batch_bytes:
            self._flush_pending(ctx)

    def _add_conv(
        self,
        st: dict[str, Any],
        fidx: int,
        role: str,
        round_no: int | None,
        lineno: int | None,
        rec: dict[str, Any],
        raw: str,
        pending: list[tuple[Any, ...]],
    ) -> int:
        """Reward a record (or queue it for the judge), then add it to the batch; the bytes it holds."""
        if role == "negative":
            rec["negative"] = {"file": st["file"], "round": round_no}
        if not assign_reward(rec, self.feedback, self.conv_cfg, self.scale):
            self.judge.defer(fidx, role, lineno, rec, raw)  # type: ignore[union-attr]
            return 0
        if self.judge is not None:
            self.judge.offer(rec, rec["reward"])
        item = _conv_item(lineno, rec)
        pending.append(item)
        return 2 * len(item[1]) + len(item[2]) + len(item[3])

    def records(self, path: Path, fmt: str, info: dict[str, Any]) -> Iterator[tuple[Any, ...]]:
        """(session, file, line, raw, record or Invalid) of an input read whole (``readers.RECORD_FORMATS``)."""
        max_chars, cap, budget = self.conv_cfg.max_message_chars, self.cap, self.batch_bytes
        if fmt == "hermes_state":
            return hermes_store.iter_state_db(path, max_chars, info)
        if fmt == "hermes_export":
            return hermes_store.iter_export(path, max_chars, cap, budget, info)
        if fmt == "claude_code":
            return traces.iter_traces(readers.trace_files(path, cap), max_chars, cap, budget, info)
        if fmt == "atropos":
            lo, hi = self.conv_cfg.atropos_scores
            return atropos.iter_groups(path, max_chars, cap, (float(lo), float(hi)), self.scale, info)
        return hermes_store.iter_sessions(path, max_chars, cap)

    def _scan_records(self, path: Path, st: dict[str, Any], fidx: int, role: str, fmt: str) -> dict[str, Any]:
        """An input read whole: each conversation is one record (its line: its ordinal), a line no record can
        come from is one reject (its line: its line number in its file)."""
        pending: list[tuple[Any, ...]] = []
        pending_bytes = n = 0
        info: dict[str, Any] = {}
        records = self.records(path, fmt, info)
        while True:
            try:
                sid, file, line, raw, rec = next(records)
            except StopIteration:
                break
            except sqlite3.Error as e:  # not a SQLite store after all, or a damaged one: what was read is kept
                n += 1
                detail = f"{type(e).__name__}: {e}"[:200]
                self._reject(st, None, "unreadable SQLite store", detail, "", file=str(path), session=None)
                break
            n += 1
            if isinstance(rec, Invalid):
                kept, cut = cut_raw(raw, rec.reason)
                self._reject(st, line, rec.reason, rec.detail, kept, file=file, session=sid, **cut)
                continue
            pending_bytes += self._add_conv(st, fidx, role, st["round"], n, rec, raw, pending)
            if len(pending) >= BATCH_LINES or pending_bytes >= self.batch_bytes:
                self._flush_conv(st, fidx, role, pending)
                pending, pending_bytes = [], 0
        self._flush_conv(st, fidx, role, pending)
        blank = info.pop("blank", 0)
        st.update(lines=n + blank, read=n, blank=blank, **info)
        return st

    def finish(self) -> dict[str, Any]:
        """After every input: the judge's queue scored and ingested (each under its own file and line);
        what the feedback join did."""
        judged = 0
        for batch in self.judge.drain() if self.judge is not None else []:
            judged += len(batch)
            by_file: dict[int, list[tuple[Any, ...]]] = {}
            for fidx, _role, lineno, rec, _raw in batch:
                by_file.setdefault(fidx, []).append(_conv_item(lineno, rec))
            for fidx, items in by_file.items():
                st = self.files[fidx]
                self._flush_conv(st, fidx, st["role"], items)
        return {**self.feedback_info, "matched": self.feedback_info.get("matched", 0), "judge_queue": judged}

    def _flush_conv(self, st: dict[str, Any], fidx: int, role: str, pending: list[tuple[Any, ...]]) -> None:
        """The conversations' batch: exact then near duplicate lookups, then the sinks, columns and spill."""
        if not pending:
            return
        import numpy as np

        # exact content, near content, conversation id: the first that was seen before makes a duplicate
        kinds = (("exact", self.index, 6), ("near", self.near_index, 7), ("id", self.id_index, 8))
        keys = [np.frombuffer(b"".join(p[col] for p in pending), dtype=np.uint64).reshape(-1, 2) for *_, col in kinds]
        found = [ix.lookup(k[:, 0], k[:, 1]).tolist() for (_, ix, _), k in zip(kinds, keys)]
        first: list[dict[bytes, int]] = [{}, {}, {}]  # within this batch
        new_rows: list[int] = []
        new_seqs: list[int] = []
        enc = json.encoder.encode_basestring_ascii
        sink = self.sinks["negatives" if role == "negative" else "accepted"]
        c, cc = self.cols, self.conv_cols
        parts: list[tuple[list[Any], ...]] = [([], [], [], [], [], []) for _ in range(self.n_parts)]
        seq, dups = self.n, 0
        at = sink.tell()  # each accepted record's offset in its sink (a review pick is read back from there)
        row_refs: list[Any] = []
        texts: list[bytes] = []  # the accepted records' lines, written at once (~10 KB each: a system call each)
        for j, item in enumerate(pending):
            lineno, text, prompt, response, info, key = item[:6]
            cid, fam, reward, task_id, turns, tool_calls, tool_errors, reward_source, tests = info
            o, kind = -1, ""
            for k, (name, _, col) in enumerate(kinds):
                o = found[k][j] if found[k][j] >= 0 else first[k].get(item[col], -1)
                if o >= 0:
                    kind = name
                    break
            if o >= 0:
                dups += 1
                c["copies"][o] += 1
                where = enc(self.origin_str(c["origin"][o]))
                line = "null" if lineno is None else lineno
                dup = (
                    f'{{"file": {enc(st["file"])}, "line": {line}, "duplicate_of": {where}, "kind": "{kind}", '
                    f'"conversation_id": {enc(cid)}, "raw": {enc(text.decode())}}}\n'
                )
                self.sinks["duplicates"].write(dup.encode())
                continue
            for k, (*_, col) in enumerate(kinds):
                first[k][item[col]] = seq
            new_rows.append(j)
            new_seqs.append(seq)
            texts.append(text)
            row_refs.append(item[9])
            fid = self.families.get(fam)
            if fid is None:
                fid = self.families[fam] = len(self.families)
            c["reward"].append(reward)
            c["origin"].append(fidx << LINE_BITS | (lineno or 0))
            c["copies"].append(0)
            c["family"].append(fid)
            c["held"].append(split_of(task_id, self.holdout, self._split_cache))
            c["negative"].append(role == "negative")
            c["rank"].append(0 if role == "negative" else xxh3_64_intdigest(key, self.rank_seed))
            src = reward_source.split(":", 1)[0]
            sid = self.reward_sources.setdefault(src, len(self.reward_sources))
            for k, v in (("seq", seq), ("turns", turns), ("tool_calls", tool_calls), ("tool_errors", tool_errors),
                         ("source", sid)):  # fmt: skip
                cc[k].append(v)
            if cid in self.feedback:
                self.feedback_info["matched"] = self.feedback_info.get("matched", 0) + 1
            part = parts[hash(prompt) % self.n_parts if self.n_parts > 1 else 0]
            for col, v in zip(part, (seq, prompt, response, task_id, at, tests)):
                col.append(v)
            at += len(text) + 1
            seq += 1
            self.text_bytes += len(prompt) + len(response) + len(text)
        self.n = seq
        if texts:
            texts.append(b"")
            sink.write(b"\n".join(texts))
        if new_rows:
            idx = np.asarray(new_rows, dtype=np.int64)
            for (_, ix, _), k in zip(kinds, keys):
                ix.add(k[idx, 0].copy(), k[idx, 1].copy(), np.asarray(new_seqs, dtype=np.int64))
        self._write_parts(parts)
        if new_seqs:
            self._write_rows(row_refs, new_seqs)
        st["accepted"] += len(new_rows)
        st["duplicates"] += dups

    def _write_rows(self, refs: list[Any], seqs: list[int]) -> None:
        """The accepted conversations' conversations/ rows, in seq order, into the ingest's Arrow file: a worker's
        rows taken from its task's table, the others' (row text) parsed here."""
        import pyarrow as pa

        pieces, i, n = [], 0, len(refs)
        while i < n:
            j = i + 1
            if type(refs[i]) is bytes:
                while j < n and type(refs[j]) is bytes:
                    j += 1
                pieces.append(row_table(refs[i:j]))
            else:
                table = refs[i][0]
                while j < n and type(refs[j]) is not bytes and refs[j][0] is table:
                    j += 1
                k = i  # its rows in runs (a duplicate between two ends one): slices of the table, no copy
                while k < j:
                    m = k + 1
                    while m < j and refs[m][1] == refs[m - 1][1] + 1:
                        m += 1
                    pieces.append(table.slice(refs[k][1], m - k))
                    k = m
            i = j
        t = pa.concat_tables(pieces).append_column("seq", pa.array(seqs, pa.int64()))
        if self._conv_writer is None:
            self._conv_writer = pa.ipc.new_stream(str(self.conv_path), t.schema)
        self._conv_writer.write_table(t)

    def conversation_stats(self) -> dict[str, Any]:
        """The accepted conversations' numbers for summary.json and MLflow: turns, tool calls and errors per
        conversation, and how many conversations (and seed lines) each reward source set, with its mean."""
        import numpy as np

        cc = {
            k: np.frombuffer(v, dtype=np.int64) if len(v) else np.zeros(0, np.int64) for k, v in self.conv_cols.items()
        }
        n = len(cc["seq"])
        rewards = self.columns()["reward"]
        names = list(self.reward_sources)
        by_source: dict[str, dict[str, Any]] = {}
        for i, name in enumerate(names):
            sel = cc["seq"][cc["source"] == i]
            by_source[name] = {"conversations": int(len(sel)), "mean_reward": round(float(rewards[sel].mean()), 4)}
        seed_n = self.n - n
        if seed_n:
            mask = np.ones(self.n, dtype=bool)
            mask[cc["seq"]] = False
            log = by_source.setdefault("log", {"conversations": 0, "mean_reward": 0.0})
            log["seed_records"] = int(seed_n)
            log["mean_reward_seed"] = round(float(rewards[mask].mean()), 4)

        def dist(x: Any) -> dict[str, Any]:
            if not len(x):
                return {"total": 0, "mean": None, "median": None, "max": None}
            return {
                "total": int(x.sum()),
                "mean": round(float(x.mean()), 3),
                "median": float(np.median(x)),
                "max": int(x.max()),
            }

        groups = [f["atropos"] for f in self.files if "atropos" in f]
        tools_from: Counter = sum((Counter(f["tools_from"]) for f in self.files if "tools_from" in f), Counter())
        extra: dict[str, Any] = {}
        if groups:  # Atropos groups: how many, and how many carry no signal (every score equal)
            extra["atropos"] = {k: sum(g[k] for g in groups) for k in groups[0]}
        if tools_from:  # state.db and exports: where each conversation's tool schemas came from
            extra["tools_from"] = dict(tools_from)
        return {
            **extra,
            "conversations": n,
            "seed_records": int(seed_n),
            "turns": dist(cc["turns"]),
            "tool_calls": dist(cc["tool_calls"]),
            "tool_errors": dist(cc["tool_errors"]),
            "with_tool_errors": int((cc["tool_errors"] > 0).sum()),
            "reward_sources": by_source,
            "arrays": cc,
        }


def _conv_item(lineno: int | None, rec: dict[str, Any], as_dict: bool = False) -> tuple[Any, ...]:
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
    """``conversation.record_text`` as UTF-8 bytes (what the sinks and the spill take), the U+2028 / U+2029 test
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
    """(exact, near) 16-byte digests of what was said, as ``conversation.content_digest`` defines them (exact: roles,
    text, reasoning, call ids and arguments, the schemas; near: the exchange up to whitespace, case, reasoning,
    call ids, system prompt and schemas), in one pass: XXH3-128 of the parts as JSON (unambiguous, C-fast)."""
    exact, near = [], []
    try:
        for m in messages:
            role, text = m["role"], m.get("content") or ""
            calls = m.get("tool_calls") or ()
            exact.append((role, text, m.get("reasoning") or "", m.get("tool_call_id") or "",
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
    """``_text`` of a record, its tool list written once per list (the same bytes: orjson's text of it)."""
    frag = _tools_cached(rec["tools"])[2] if rec["tools"] else None
    return _text(rec, None if frag is None else {**rec, "tools": frag})


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
