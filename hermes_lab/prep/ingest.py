"""Distill stage, part 1 (``hermes_lab.prep.run``): read every line of every input, validate it, dedupe it, spill it.

Reads the inputs prep was given (``.jsonl`` or ``.jsonl.gz``, read transparently; Hermes session files, state.db
and exports, Claude Code traces and Atropos groups through their readers, ``hermes_lab.prep.conversations``; never
written, truncated or moved). Writes into prep's output
dir, through temp files renamed into place at the end: ``accepted.jsonl``, ``negatives.jsonl``,
``duplicates.jsonl``, ``rejects.jsonl`` (see ``hermes_lab.prep.run``); and, in a temp dir prep removes, the
accepted records' text partitioned by prompt (Arrow IPC streams) for ``hermes_lab.prep.distill``.

Two paths, chosen per input (``hermes_lab.logs.readers.detect`` or ``conversations.format``): the seed's
``{prompt, response, reward, task_id}`` lines are read a block at a time (``hermes_lab.prep.seed.read_blocks``)
and parsed and checked in columns (``hermes_lab.prep.seed``, this class's mixin), the lines that need a rule
one by one (``_line``); every other shape becomes a canonical conversation record
(``hermes_lab.logs.record``), rewarded and deduped exactly, nearly and by conversation_id
(``hermes_lab.prep.conversations``, the other mixin; a large file's lines converted by worker processes). Its
projection for the prompt tables is (first user message, final answer); its conversations/ row goes, as Arrow, in
acceptance order, to the dataset's own shards (``conv_ingest.ConvRows``, in the temp dir until distill moves them
into place), and the spill keeps its record's offset in its sink (a review pick is read back from there).

Memory is bounded: lines are read in blocks (``columns.BLOCK_BYTES``) and validated in batches (at most
``BATCH_LINES`` lines or a sixteenth of ``data.memory_budget_mb``), duplicates are found through a 16-byte XXH3-128
digest of (task_id, prompt, response), their lengths first, held in sorted numpy runs (``DigestIndex``), and
what is kept for the whole input is a handful of fixed-size fields per accepted record (reward, origin, family
id, split, review rank (XXH3-64 of the same key, seeded with ``data.seed``), duplicate count: ~40 bytes).

Validation, every field of every line: ``hermes_lab.logs.lines`` (JSON, the seed record) and
``hermes_lab.logs.readers`` / ``hermes_lab.logs.record`` (every other shape); a bad line is a reject with
its number and reason, never a traceback. A line (a seed record, or a conversation of a JSONL format) may carry
its task's tests (``hermes_lab.logs.lines.record_tests``): tests that do not parse reject the line ("bad
tests"), tests that do ride along, normalised, for the tests reward (the partitions' ``tests`` column; a
conversation's record holds them as ``tests``, absent without any).

Run through ``hermes-lab prep --input FILE... --output DIR`` (``hermes_lab.prep.run.run_prep``), not on its own.
"""

from __future__ import annotations

import gzip
import json
import os
from array import array
from collections import Counter
from pathlib import Path
from typing import Any, BinaryIO

from xxhash import xxh3_64_intdigest, xxh3_128_digest

from hermes_lab.logs import readers
from hermes_lab.logs.lines import (  # noqa: F401  (re-exported: prep's and the tests' names for them)
    BOM,
    REQUIRED,
    Bad,
    DigestIndex,
    check_record,
    decode,
    estimated_size,
    is_gzip,
    record_tests,
    review_id,
    review_rank,
    split_of,
)
from hermes_lab.prep.conversation_worker import RAW_KEEP, convert
from hermes_lab.prep.conversations import BATCH_LINES, ConversationIngest, ConvRows
from hermes_lab.prep.outcomes import JudgeQueue, load_feedback
from hermes_lab.prep.resources import trim_heap
from hermes_lab.prep.seed import LINE_BITS, Corrupt, SeedColumns, read_blocks
from hermes_lab.tasks import suite as tasks

PROGRESS_MIN = 32 << 20  # show a tqdm bar for files from this size on
SINKS = ("accepted", "negatives", "duplicates", "rejects")
_CACHE_MAX = 200_000  # entries of the per-prompt family / per-task split caches before they are cleared


# ------------------------------------------------------------------------------------------- ingest
class _Scan:
    """Where the scan of one JSONL input stands: its counts and the batch not yet flushed."""

    __slots__ = (
        "blank",
        "conv",
        "fidx",
        "lineno",
        "pending",
        "pending_bytes",
        "read",
        "role",
        "round_no",
        "st",
        "stop",
    )

    def __init__(self, st: dict[str, Any], fidx: int, role: str, round_no: int | None, conv: str | None):
        self.st, self.fidx, self.role, self.round_no, self.conv = st, fidx, role, round_no, conv
        self.lineno = self.read = self.blank = self.pending_bytes = 0
        self.pending: list[tuple[Any, ...]] = []
        self.stop = False


class Ingest(SeedColumns, ConversationIngest):
    """Streams every line of every file into the four JSONL sinks, the fixed-size columns and the spill."""

    def __init__(
        self,
        tmp: Path,
        scale: float,
        cap: int,
        budget_bytes: int,
        n_parts: int,
        cfg: Any,
        feedback_files: list[Path] | None = None,
    ):
        """``tmp``: where the sinks are written before ``commit`` moves them, and the spill lives;
        ``feedback_files``: JSONL of later rewards joined into conversations by conversation_id."""
        import pyarrow as pa

        self.pa, self.tmp = pa, tmp
        self.scale, self.cap, self.batch_bytes = scale, cap, max(1 << 20, budget_bytes // 16)
        self.n_parts = max(1, n_parts)
        self.holdout, self.seed = cfg.data.holdout_fraction, cfg.data.seed
        self.rank_seed = cfg.data.seed % (1 << 64)  # the review rank: xxh3_64 of the record's key, seeded
        self.files: list[dict[str, Any]] = []
        self.index = DigestIndex()
        self.n = 0  # accepted records so far (their seq numbers)
        self.text_bytes = 0  # bytes of accepted prompt + response + task_id
        self.cols = {
            "reward": array("d"),
            "origin": array("q"),
            "family": array("i"),
            "held": array("b"),
            "negative": array("b"),
            "rank": array("Q"),
            "copies": array("I"),  # duplicate lines of the record: samples of its prompt's group all the same
        }
        self.families: dict[str, int] = {}
        self._fam_cache: dict[str, str] = {}
        self._split_cache: dict[str, bool] = {}
        self.tmp_sinks = {n: tmp / f"{n}.jsonl" for n in SINKS}
        self.sinks = {n: open(p, "wb") for n, p in self.tmp_sinks.items()}  # noqa: SIM115
        # the conversations: their own near-duplicate index, their stats (accepted ones, in seq order), rewards
        self.conv_cfg, self.feedback, self.feedback_info = cfg.conversations, *load_feedback(feedback_files, scale)
        self.near_index, self.id_index = DigestIndex(), DigestIndex()
        self.conv_cols = {k: array("q") for k in ("seq", "turns", "tool_calls", "tool_errors", "source")}
        self.reward_sources: dict[str, int] = {}
        self.judge = JudgeQueue(tmp, cfg) if cfg.conversations.reward == "judge" else None
        self.schema = pa.schema(
            [
                ("seq", pa.int64()),
                ("prompt", pa.string()),
                ("response", pa.string()),
                ("task_id", pa.string()),
                ("conv_at", pa.int64()),  # a conversation's record: its byte offset in its sink; null for a seed line
                ("tests", pa.string()),  # the task's tests (``TestSpec.to_json``); null without any
            ]
        )
        self.part_paths = [tmp / f"part-{k:04d}.arrows" for k in range(self.n_parts)]
        self._writers = [pa.ipc.new_stream(str(p), self.schema) for p in self.part_paths]
        # conversations/, its rows written as they are accepted (seq order; distill checks their split)
        self.conv_rows = ConvRows(tmp)
        self.committed: dict[str, Path] = {}
        # the seed's fields as columns (hermes_lab.prep.seed); task_id's type is read from the data
        s = pa.string()
        self.seed_schema = pa.schema([("prompt", s), ("response", s), ("reward", pa.float64()), ("family", s)])

    # ----------------------------------------------------------------------------------- lifecycle
    def close(self) -> None:
        """The sinks and partitions closed; what only the scan needs (the dedup indexes, the per-prompt and
        per-task caches) let go, and the heap's free pages given back, before distill."""
        for f in self.sinks.values():
            f.close()
        self.index, self.near_index, self.id_index = DigestIndex(), DigestIndex(), DigestIndex()
        self._fam_cache, self._split_cache = {}, {}
        trim_heap()
        for w in self._writers:
            w.close()
        self._writers = []
        self.conv_rows.close()

    def commit(self, final: dict[str, Path]) -> None:
        """Move the finished sinks into place (after close): a reader sees the old file or the new one."""
        for n, tmp in self.tmp_sinks.items():
            os.replace(tmp, final[n])
        self.committed = final  # distill reads a review pick's conversation back from its sink

    def columns(self) -> dict[str, Any]:
        """The fixed-size columns as numpy arrays indexed by seq (views on the arrays, no copy)."""
        import numpy as np

        dt = {"reward": np.float64, "origin": np.int64, "family": np.int32, "held": np.bool_, "negative": np.bool_}
        dt["copies"] = np.uint32
        out = {}
        for k, v in self.cols.items():
            t = dt.get(k, np.uint64)
            out[k] = np.frombuffer(v, dtype=t) if len(v) else np.zeros(0, t)
        return out

    def family_names(self) -> list[str]:
        return list(self.families)

    def origin_str(self, origin: int) -> str:
        return f"{self.files[origin >> LINE_BITS]['file']}:{origin & ((1 << LINE_BITS) - 1)}"

    # ------------------------------------------------------------------------------------- rejects
    def _reject(
        self, st: dict[str, Any], lineno: int | None, reason: str, detail: str, raw: bytes | str, **extra: Any
    ) -> None:
        """A rejected line (or session: ``lineno`` None, ``extra`` names the session and its file)."""
        st["rejected"] += 1
        st["by_reason"][reason] += 1
        if len(st["first_errors"]) < 5:
            other = extra.get("file") if extra.get("file") not in (None, st["file"]) else None  # a file of a folder
            at = f"line {lineno}" if lineno is not None else f"session {extra.get('session') or extra.get('file')}"
            at = f"{Path(other).name} {at}" if other and lineno is not None else at
            st["first_errors"].append(f"{at}: {reason}" + (f" ({detail})" if detail else ""))
        if isinstance(raw, bytes):
            raw = raw.decode("utf-8", errors="backslashreplace")
        rec = {
            "file": st["file"],
            "line": lineno,
            "reason": reason,
            "detail": detail,
            "raw": raw,
            **extra,
        }
        self.sinks["rejects"].write((json.dumps(rec) + "\n").encode())

    # ---------------------------------------------------------------------------------------- scan
    def detect(self, path: Path) -> str:
        """An input's format (``hermes_lab.logs.readers.detect``) from what it is and its first JSON line."""
        fmt = readers.detect(path)
        if fmt != "seed":  # a folder, a SQLite store, a session file
            return fmt
        return readers.detect(path, readers.first_object(path, self.cap))

    def scan(self, path: Path, role: str, round_no: int | None, fmt: str = "auto") -> dict[str, Any]:
        from tqdm import tqdm

        fmt = self.detect(path) if fmt == "auto" else fmt
        st: dict[str, Any] = {
            "file": str(path),
            "format": fmt,
            "role": role,
            "round": round_no,
            "lines": 0,
            "blank": 0,
            "read": 0,
            "accepted": 0,
            "rejected": 0,
            "duplicates": 0,
            "by_reason": Counter(),
            "first_errors": [],
        }
        fidx = len(self.files)
        self.files.append(st)
        if fmt not in readers.JSONL_FORMATS:  # sessions, state.db, exports, traces, groups: whole records
            return self._scan_records(path, st, fidx, role, fmt)
        ctx = _Scan(st, fidx, role, round_no, None if fmt == "seed" else fmt)
        size = path.stat().st_size
        bar = tqdm(total=size, unit="B", unit_scale=True, desc=f"prep {path.name}", disable=size < PROGRESS_MIN,
                   mininterval=1.0)  # fmt: skip
        last_pos = 0
        with open(path, "rb") as raw_f:
            f: BinaryIO = gzip.GzipFile(fileobj=raw_f, mode="rb") if is_gzip(path) else raw_f  # type: ignore[assignment]
            pool = self.pool(ctx, size)
            try:
                # a plain file's conversation lines: the workers read their own byte ranges (conv_ranges)
                blocks = read_blocks(f, self.cap) if pool is None or f is not raw_f else self.conv_ranges(ctx, pool, f)
                for block, plain in self.seed_blocks(blocks, ctx) if ctx.conv is None else blocks:
                    if ctx.conv is None:  # ``plain``: the block's runs, prepared a block ahead
                        self._seed_block(ctx, block, plain)
                    elif pool is not None and plain:
                        self._conv_block(ctx, pool, block)
                    else:
                        self._drain(ctx, pool)
                        for line in block:
                            self._line(ctx, line)
                    if ctx.stop:
                        break
                    if not bar.disable:  # tell() of the raw file: compressed bytes for .gz
                        pos = raw_f.tell()
                        bar.update(pos - last_pos)
                        last_pos = pos
                self._drain(ctx, pool)
                if pool is not None:  # reaped: their CPU is the command's
                    pool[0].close()
                    pool[0].join()
            finally:
                if pool is not None:
                    pool[0].terminate()
        self._flush_pending(ctx)
        if not bar.disable:
            bar.update(max(0, size - last_pos))
        bar.close()
        st.update(lines=ctx.lineno, read=ctx.read, blank=ctx.blank)
        return st

    def _flush_pending(self, ctx: _Scan) -> None:
        (self._flush if ctx.conv is None else self._flush_conv)(ctx.st, ctx.fidx, ctx.role, ctx.pending)
        ctx.pending, ctx.pending_bytes = [], 0

    def _line(self, ctx: _Scan, line: Any) -> None:
        """One line through every check (``lines.decode``, ``check_record`` or the format's reader): a reject
        with its number and reason, or an item of the batch (flushed at ``BATCH_LINES`` or a sixteenth of the
        memory budget)."""
        st, scale, cap = ctx.st, self.scale, self.cap
        ctx.lineno += 1
        lineno = ctx.lineno
        if type(line) is not bytes:
            ctx.read += 1
            if isinstance(line, Corrupt):  # a truncated or corrupt .gz: what was read is kept
                e = line.error
                self._reject(st, lineno, "corrupt gzip stream", f"{type(e).__name__}: {e}"[:200], b"")
                ctx.stop = True
            else:
                detail = f"{line.total} bytes > data.max_line_bytes {cap}"
                self._reject(st, lineno, "line too long", detail, line.head[:RAW_KEEP], raw_truncated=True)
            return
        if ctx.conv is not None:  # a conversation's line: hermes_lab.prep.conversations
            self._take(ctx, lineno, convert(self.line_work(ctx), lineno, line, keep=self.judge is not None))
            return
        line = line.rstrip(b"\r")
        if line.startswith(BOM):  # Windows editors put one at the file start (or at every join)
            line = line[3:]
        if not line.strip():
            ctx.blank += 1
            return
        ctx.read += 1
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as e:
            self._reject(st, lineno, "not valid UTF-8", f"{e.reason} at byte {e.start}", line)
            return
        try:
            obj = decode(text, line)
            prompt, response, reward, task_id, fam = check_record(obj, scale)
            tests_json = record_tests(obj, prompt)
        except Bad as e:
            self._reject(st, lineno, e.reason, e.detail, line)
            return
        out_text = text
        if ctx.role == "negative":
            obj["_negative"] = {"file": st["file"], "round": ctx.round_no}
            try:  # ASCII escapes: extra fields may hold characters some readers split lines on
                out_text = json.dumps(obj)
            except (RecursionError, ValueError):
                self._reject(st, lineno, "malformed JSON", "nested too deeply", line)
                return
        keyed = f"{len(task_id)},{len(prompt)},{task_id}{prompt}{response}".encode()  # lengths: unambiguous
        item = (lineno, text, out_text, prompt, response, reward, task_id, fam, keyed, xxh3_128_digest(keyed))
        ctx.pending.append((*item, tests_json))
        ctx.pending_bytes += len(text) + len(keyed) + (len(out_text) if out_text is not text else 0)
        if len(ctx.pending) >= BATCH_LINES or ctx.pending_bytes >= self.batch_bytes:
            self._flush_pending(ctx)

    def _flush(self, st: dict[str, Any], fidx: int, role: str, pending: list[tuple[Any, ...]]) -> None:
        """Duplicate lookup for a batch (vectorised), then the sinks, the columns and the spill, in line order."""
        if not pending:
            return
        import numpy as np

        keys = np.frombuffer(b"".join(p[9] for p in pending), dtype=np.uint64).reshape(-1, 2)
        found = self.index.lookup(keys[:, 0], keys[:, 1]).tolist()
        first_in_batch: dict[bytes, int] = {}
        new_rows: list[int] = []
        new_seqs: list[int] = []
        enc = json.encoder.encode_basestring_ascii  # C encoder: a duplicate costs no dict dumps
        file_js = enc(st["file"])
        sink = self.sinks["negatives" if role == "negative" else "accepted"]
        dup_out = self.sinks["duplicates"]
        c = self.cols
        c_rew, c_orig, c_fam, c_held, c_neg, c_rank, c_copies = (
            c["reward"],
            c["origin"],
            c["family"],
            c["held"],
            c["negative"],
            c["rank"],
            c["copies"],
        )
        negative = role == "negative"
        families, fam_cache, split_cache, holdout = self.families, self._fam_cache, self._split_cache, self.holdout
        rank_seed = self.rank_seed
        # seq, prompt, response, task_id, conv (none on this path: a null column), tests
        parts: list[tuple[list[Any], ...]] = [([], [], [], [], [], []) for _ in range(self.n_parts)]
        k_parts = self.n_parts
        seq, text_bytes = self.n, 0
        dups = 0
        # the hot loop of prep: the helpers (split_of, review_id, review_rank) are inlined here
        for j, (
            lineno,
            text,
            out_text,
            prompt,
            response,
            reward,
            task_id,
            fam,
            joined,
            digest,
            tests_json,
        ) in enumerate(pending):
            o = found[j]
            if o < 0:
                o = first_in_batch.get(digest, -1)
            if o >= 0:
                dups += 1
                c_copies[o] += 1
                first = enc(self.origin_str(c_orig[o]))
                line = f'{{"file": {file_js}, "line": {lineno}, "duplicate_of": {first}, "raw": {enc(text)}}}\n'
                dup_out.write(line.encode())
                continue
            origin = fidx << LINE_BITS | lineno
            first_in_batch[digest] = seq
            new_rows.append(j)
            new_seqs.append(seq)
            sink.write((out_text + "\n").encode())
            if fam is None:
                fam = fam_cache.get(prompt)
                if fam is None:
                    if len(fam_cache) > _CACHE_MAX:
                        fam_cache.clear()
                    fam = fam_cache[prompt] = tasks.family_of(prompt) or "unknown"
            fid = families.get(fam)
            if fid is None:
                fid = families[fam] = len(families)
            held = split_cache.get(task_id)
            if held is None:
                held = split_of(task_id, holdout, split_cache)
            c_rew.append(reward)
            c_orig.append(origin)
            c_copies.append(0)
            c_fam.append(fid)
            c_held.append(held)
            c_neg.append(negative)
            c_rank.append(0 if negative else xxh3_64_intdigest(joined, rank_seed))
            part = parts[hash(prompt) % k_parts if k_parts > 1 else 0]
            part[0].append(seq)
            part[1].append(prompt)
            part[2].append(response)
            part[3].append(task_id)
            part[5].append(tests_json)
            seq += 1
            text_bytes += len(joined)
        self.n, self.text_bytes = seq, self.text_bytes + text_bytes
        if new_rows:
            idx = np.asarray(new_rows, dtype=np.int64)
            self.index.add(keys[idx, 0].copy(), keys[idx, 1].copy(), np.asarray(new_seqs, dtype=np.int64))
        self._write_parts(parts)
        st["accepted"] += len(new_rows)
        st["duplicates"] += dups

    def _write_parts(self, parts: list[tuple[list[Any], ...]]) -> None:
        """A batch's rows into the partitions: per partition the lists (seq, prompt, response, task_id, conv_at,
        tests); conv_at empty for seed lines (a null column)."""
        pa = self.pa
        for w, (seqs, ps, rs, ts, convs, tests) in zip(self._writers, parts):
            if seqs:
                conv = pa.array(convs, pa.int64()) if convs else pa.nulls(len(seqs), pa.int64())
                cols = [pa.array(seqs, pa.int64()), pa.array(ps, pa.string()), pa.array(rs, pa.string())]
                cols += [pa.array(ts, pa.string()), conv, pa.array(tests, pa.string())]
                w.write_batch(pa.record_batch(cols, schema=self.schema))


def _cut(cut: bool) -> dict[str, Any]:
    return {"raw_truncated": True} if cut else {}
