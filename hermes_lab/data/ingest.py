"""Distill stage, part 1 (``hermes_lab.data.prep``): read every line of every input, validate it, dedupe it, spill it.

Reads the inputs prep was given (``.jsonl`` or ``.jsonl.gz``, read transparently; Hermes session files, state.db
and exports, Claude Code traces and Atropos groups through their readers, ``hermes_lab.data.conv_ingest``; never
written, truncated or moved). Writes into prep's output
dir, through temp files renamed into place at the end: ``accepted.jsonl``, ``negatives.jsonl``,
``duplicates.jsonl``, ``rejects.jsonl`` (see ``hermes_lab.data.prep``); and, in a temp dir prep removes, the
accepted records' text partitioned by prompt (Arrow IPC streams) for ``hermes_lab.data.distill``.

Two paths, chosen per input (``hermes_lab.data.readers.detect`` or ``conversations.format``): the seed's
``{prompt, response, reward, task_id}`` lines take the fast path below, unchanged; every other shape becomes a
canonical conversation record (``hermes_lab.data.conversation``), rewarded and deduped exactly, nearly and by
conversation_id (``hermes_lab.data.conv_ingest``, this class's mixin). Its projection for the prompt tables is
(first user message, final answer); the whole record rides along in the spill for the conversations
dataset and the review queue.

Memory is bounded: lines are validated in batches (at most ``BATCH_LINES`` lines or a sixteenth of
``data.memory_budget_mb``), duplicates are found through a 16-byte blake2b digest of (prompt, response,
task_id) held in sorted numpy runs (``DigestIndex``), and what is kept for the whole input is a handful of
fixed-size fields per accepted record (reward, origin, family id, split, review hash, duplicate count: ~64 bytes).

Validation, every field of every line: ``hermes_lab.data.lines`` (JSON, the seed record) and
``hermes_lab.data.readers`` / ``hermes_lab.data.conversation`` (every other shape); a bad line is a reject with
its number and reason, never a traceback. A line (a seed record, or a conversation of a JSONL format) may carry
its task's tests (``hermes_lab.data.lines.record_tests``): tests that do not parse reject the line ("bad
tests"), tests that do ride along, normalised, for the tests reward (the partitions' ``tests`` column; a
conversation's record holds them as ``tests``, absent without any).

Run through ``hermes-lab prep --input FILE... --output DIR`` (``hermes_lab.data.prep.run_prep``), not on its own.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import zlib
from array import array
from collections import Counter
from pathlib import Path
from typing import Any, BinaryIO

from hermes_lab.data import readers
from hermes_lab.data.conv_ingest import BATCH_LINES, LINE_BITS, RAW_KEEP, ConversationIngest
from hermes_lab.data.conversation import (
    task_prompt_of,
)
from hermes_lab.data.lines import (  # noqa: F401  (re-exported: prep's and the tests' names for them)
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
from hermes_lab.data.outcomes import JudgeQueue, load_feedback
from hermes_lab.tasks import suite as tasks

PROGRESS_MIN = 32 << 20  # show a tqdm bar for files from this size on
SINKS = ("accepted", "negatives", "duplicates", "rejects")
_CACHE_MAX = 200_000  # entries of the per-prompt family / per-task split caches before they are cleared


# ------------------------------------------------------------------------------------------- ingest
class Ingest(ConversationIngest):
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
        self.sinks = {n: open(p, "w", encoding="utf-8", newline="\n") for n, p in self.tmp_sinks.items()}  # noqa: SIM115
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
                ("conv", pa.string()),  # the canonical record (JSON) of a conversation; null for a seed line
                ("tests", pa.string()),  # the task's tests (``TestSpec.to_json``); null without any
            ]
        )
        self.part_paths = [tmp / f"part-{k:04d}.arrows" for k in range(self.n_parts)]
        self._writers = [pa.ipc.new_stream(str(p), self.schema) for p in self.part_paths]

    # ----------------------------------------------------------------------------------- lifecycle
    def close(self) -> None:
        for f in self.sinks.values():
            f.close()
        for w in self._writers:
            w.close()
        self._writers = []

    def commit(self, final: dict[str, Path]) -> None:
        """Move the finished sinks into place (after close): a reader sees the old file or the new one."""
        for n, tmp in self.tmp_sinks.items():
            os.replace(tmp, final[n])

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
        self.sinks["rejects"].write(json.dumps(rec) + "\n")

    # ---------------------------------------------------------------------------------------- scan
    def detect(self, path: Path) -> str:
        """An input's format (``hermes_lab.data.readers.detect``) from what it is and its first JSON line."""
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
        conv = None if fmt == "seed" else fmt
        max_chars = self.conv_cfg.max_message_chars
        size = path.stat().st_size
        bar = tqdm(
            total=size,
            unit="B",
            unit_scale=True,
            desc=f"prep {path.name}",
            disable=size < PROGRESS_MIN,
            mininterval=1.0,
        )
        scale, cap = self.scale, self.cap
        pending: list[tuple[Any, ...]] = []
        pending_bytes = 0
        lineno = read = blank = 0
        last_pos = 0
        with open(path, "rb") as raw_f:
            f: BinaryIO = gzip.GzipFile(fileobj=raw_f, mode="rb") if is_gzip(path) else raw_f  # type: ignore[assignment]
            readline = f.readline
            while True:
                try:
                    raw = readline(cap + 1)  # bounded: a 1 GiB line never sits in memory whole
                    if len(raw) > cap and not raw.endswith(b"\n"):
                        total, chunk = len(raw), raw
                        while chunk and not chunk.endswith(b"\n"):
                            chunk = readline(1 << 20)
                            total += len(chunk)
                    else:
                        total = 0
                except (EOFError, OSError, zlib.error) as e:  # a truncated or corrupt .gz: what was read is kept
                    lineno += 1
                    read += 1
                    self._reject(st, lineno, "corrupt gzip stream", f"{type(e).__name__}: {e}"[:200], b"")
                    break
                if not raw:
                    break
                lineno += 1
                if not lineno & 0x1FFF and not bar.disable:  # tell() of the raw file: compressed bytes for .gz
                    pos = raw_f.tell()
                    bar.update(pos - last_pos)
                    last_pos = pos
                if total:
                    read += 1
                    self._reject(
                        st,
                        lineno,
                        "line too long",
                        f"{total} bytes > data.max_line_bytes {cap}",
                        raw[:RAW_KEEP],
                        raw_truncated=True,
                    )
                    continue
                line = raw.rstrip(b"\r\n") if raw.endswith(b"\n") else raw.rstrip(b"\r")
                if line.startswith(BOM):  # Windows editors put one at the file start (or at every join)
                    line = line[3:]
                if not line.strip():
                    blank += 1
                    continue
                read += 1
                try:
                    text = line.decode("utf-8")
                except UnicodeDecodeError as e:
                    self._reject(st, lineno, "not valid UTF-8", f"{e.reason} at byte {e.start}", line)
                    continue
                try:
                    obj = decode(text)
                    if conv is None:
                        prompt, response, reward, task_id, fam = check_record(obj, scale)
                        tests_json = record_tests(obj, prompt)
                    else:
                        rec = readers.parse_line(obj, conv, st["file"], lineno, scale, max_chars)
                        if (conv_tests := record_tests(obj, task_prompt_of(rec["messages"]))) is not None:
                            rec["tests"] = conv_tests
                except Bad as e:
                    cut = e.reason == "message too long"  # keep its first 4 KiB, as for a line too long
                    self._reject(st, lineno, e.reason, e.detail, line[:RAW_KEEP] if cut else line, **_cut(cut))
                    continue
                if conv is not None:
                    pending_bytes += self._add_conv(st, fidx, role, round_no, lineno, rec, text, pending)
                    if len(pending) >= BATCH_LINES or pending_bytes >= self.batch_bytes:
                        self._flush_conv(st, fidx, role, pending)
                        pending, pending_bytes = [], 0
                    continue
                out_text = text
                if role == "negative":
                    obj["_negative"] = {"file": st["file"], "round": round_no}
                    try:  # ASCII escapes: extra fields may hold characters some readers split lines on
                        out_text = json.dumps(obj)
                    except (RecursionError, ValueError):
                        self._reject(st, lineno, "malformed JSON", "nested too deeply", line)
                        continue
                joined = (task_id + prompt + response).encode()  # the review id's bytes too
                h = hashlib.blake2b(f"{len(task_id)},{len(prompt)},".encode(), digest_size=16)
                h.update(joined)  # unambiguous: the lengths say where task_id and prompt end
                pending.append(
                    (lineno, text, out_text, prompt, response, reward, task_id, fam, joined, h.digest(), tests_json)
                )
                pending_bytes += len(text) + len(joined) + (len(out_text) if out_text is not text else 0)
                if len(pending) >= BATCH_LINES or pending_bytes >= self.batch_bytes:
                    self._flush(st, fidx, role, pending)
                    pending, pending_bytes = [], 0
        (self._flush if conv is None else self._flush_conv)(st, fidx, role, pending)
        if not bar.disable:
            bar.update(max(0, size - last_pos))
        bar.close()
        st.update(lines=lineno, read=read, blank=blank)
        return st

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
        seed_hash, sha1 = hashlib.sha1(f"{self.seed}:".encode()), hashlib.sha1
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
                dup_out.write(f'{{"file": {file_js}, "line": {lineno}, "duplicate_of": {first}, "raw": {enc(text)}}}\n')
                continue
            origin = fidx << LINE_BITS | lineno
            first_in_batch[digest] = seq
            new_rows.append(j)
            new_seqs.append(seq)
            sink.write(out_text + "\n")
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
            if negative:
                c_rank.append(0)
            else:  # review_rank(seed, review_id(...)), inlined
                h = seed_hash.copy()
                h.update(sha1(joined).hexdigest()[:12].encode())
                c_rank.append(int.from_bytes(h.digest()[:8], "big"))
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
        """A batch's rows into the partitions: per partition the lists (seq, prompt, response, task_id, conv,
        tests); conv empty for seed lines (a null column)."""
        pa = self.pa
        for w, (seqs, ps, rs, ts, convs, tests) in zip(self._writers, parts):
            if seqs:
                conv = pa.array(convs, pa.string()) if convs else pa.nulls(len(seqs), pa.string())
                cols = [pa.array(seqs, pa.int64()), pa.array(ps, pa.string()), pa.array(rs, pa.string())]
                cols += [pa.array(ts, pa.string()), conv, pa.array(tests, pa.string())]
                w.write_batch(pa.record_batch(cols, schema=self.schema))


def _cut(cut: bool) -> dict[str, Any]:
    return {"raw_truncated": True} if cut else {}
