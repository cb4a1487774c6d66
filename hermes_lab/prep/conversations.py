"""Distill stage, part 1 (``hermes_lab.prep.ingest``), the conversations' half: every shape but the seed's; prep's side.

Reads what ``hermes_lab.logs.readers`` detected as a conversation format: the line formats' records come from the
ingest's JSONL scan, converted and checked by ``hermes_lab.prep.conversation_worker`` (a large plain file by forked
worker processes, each reading its own byte ranges and building its rows' Arrow table; here only where lines end is
found), the others (``readers.RECORD_FORMATS``: Hermes session files, state.db and exports, Claude Code / Agent
Trace JSONL, Atropos groups) from their readers, whole (``records``). Each record is rewarded (its log's reward,
else feedback joined by conversation_id, else the outcome rules or the judge: ``conversations.reward``), and
deduped three ways, each a ``DigestIndex``: exact (what was said, call ids and reasoning included), near (the
exchange up to whitespace, case, reasoning, call ids, system prompt and tool schemas: a run's trajectory line and
its session snapshot) and by conversation_id (a run and its compressed copy). Writes what the ingest writes (the
sinks, the fixed-size columns, the partitions: ``Ingest`` holds them; this is its mixin) and each accepted
conversation's conversations/ row, as Arrow, in acceptance order, into the dataset's shards (``ConvRows``), and
counts per input what the readers report (blank lines, skipped lines, Atropos groups, where tool schemas came
from).

Run through ``hermes-lab prep`` (``hermes_lab.prep.run.run_prep``), not on its own.
"""

from __future__ import annotations

import json
import os
import pickle
import sqlite3
from collections import Counter, deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from xxhash import xxh3_64_intdigest

from hermes_lab.logs import atropos, claude_code, hermes_sessions, readers
from hermes_lab.logs.lines import split_of
from hermes_lab.logs.record import dataset_schema
from hermes_lab.prep.conversation_worker import (
    WORK,
    Invalid,
    LineWork,
    conv_item,
    convert_range,
    convert_task,
    cut_raw,
    row_table,
)
from hermes_lab.prep.outcomes import assign_reward
from hermes_lab.prep.resources import ForkPool, usable_cores
from hermes_lab.prep.seed import LINE_BITS, read_blocks

BATCH_LINES = 16384  # records held before one vectorised duplicate lookup


PARALLEL_MIN = 8 << 20  # a conversation file from this size on is converted by worker processes
TASK_BYTES = 1 << 20  # lines sent to a worker at once
FLIGHT = 6  # tasks in flight a worker: the workers keep converting while this process writes a batch (~0.2 s)


SHARD_BYTES = 500_000_000  # a conversations/ shard's size: datasets' own (config.MAX_SHARD_SIZE, 500MB)


class ConvRows:
    """``conversations/`` written as the ingest accepts its rows, in acceptance order: Arrow stream shards in a
    folder of the temp dir, in the layout ``datasets.Dataset.save_to_disk`` gives (its features in the schema's
    metadata), each row with its record's own split (its task_id's). ``finish`` moves the folder into place when
    that is every row's split; where the prompt sets' rule moved a row to the held-out set (its prompt seen under a
    held-out task_id), the rows are saved again with their split (``rows``, memory-mapped, then save_to_disk)."""

    def __init__(self, tmp: Path):
        self.dir = tmp / "conv-rows"  # renamed to conversations/ at the end
        self.shards: list[Path] = []
        self.schema: Any = None
        self._writer: Any = None
        self._bytes = 0

    def write(self, table: Any) -> None:
        """Rows of the dataset's schema (``record.dataset_schema``), their split included."""
        import pyarrow as pa

        if self._writer is None or self._bytes >= SHARD_BYTES:
            if self.schema is None:
                from datasets import Features

                self.dir.mkdir()
                self.schema = Features.from_arrow_schema(dataset_schema()).arrow_schema  # with datasets' metadata
            self.close()
            self.shards.append(self.dir / f"shard-{len(self.shards):05d}.arrow")
            self._writer, self._bytes = pa.ipc.new_stream(str(self.shards[-1]), self.schema), 0
        self._writer.write_table(table)
        self._bytes += table.nbytes

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def rows(self) -> Any:
        """Every row, the shards memory-mapped (no copy)."""
        import pyarrow as pa

        return pa.concat_tables([pa.ipc.open_stream(pa.memory_map(str(p))).read_all() for p in self.shards])

    def finish(self, path: Path, fingerprint: str) -> None:
        """The shards as ``save_to_disk`` names them, its state.json and dataset_info.json beside them (written by
        datasets, for the schema without rows, then given the shards' names), the folder renamed to ``path``."""
        import datasets

        self.close()
        datasets.Dataset(self.schema.empty_table(), fingerprint=fingerprint).save_to_disk(str(self.dir))
        names = [f"data-{k:05d}-of-{len(self.shards):05d}.arrow" for k in range(len(self.shards))]
        for p, name in zip(self.shards, names):
            p.rename(self.dir / name)
        state_path = self.dir / datasets.config.DATASET_STATE_JSON_FILENAME
        state = json.loads(state_path.read_text(encoding="utf-8"))
        state["_data_files"] = [{"filename": name} for name in names]
        with open(state_path, "w", encoding="utf-8") as f:
            json.dump(state, f, indent=2, sort_keys=True)  # as save_to_disk writes it
        os.replace(self.dir, path)


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
        cores = usable_cores()
        if ctx.conv is None or self.judge is not None or size < PARALLEL_MIN or cores < 2:
            return None
        import pyarrow as pa

        pa.array([], pa.int64())  # pyarrow imports pandas at its first pa.array (~0.7 s): once here, not per worker
        WORK[:] = [self.line_work(ctx)]  # inherited by the forked workers: no pickling of the feedback
        WORK[0].as_dict = True
        return [ForkPool(cores), deque(), 0]

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
                flight.append(p.apply_async(convert_task, (pool[2] + 1, lines[start : k + 1])))
                pool[2] += k + 1 - start
                start, size = k + 1, 0
                while len(flight) > FLIGHT * p._processes:
                    self._take_task(ctx, flight.popleft())

    def conv_ranges(self, ctx: Any, pool: list[Any], f: Any) -> Iterator[tuple[list[Any], bool]]:
        """A plain file's lines for the workers as byte ranges of ~TASK_BYTES, each read by its worker (this process
        only finds where lines end and counts them, in one reused buffer); a block for the scan's loop after each
        (none to read here). A line longer than the buffer: from its start on, the file's blocks as
        ``columns.read_blocks`` gives them (a line over ``data.max_line_bytes`` is never held whole)."""
        import numpy as np

        p, flight = pool[0], pool[1]
        buf = bytearray(TASK_BYTES)
        start = f.tell()
        while True:
            n = f.readinto(buf)
            if not n:
                return
            end = buf.rfind(b"\n", 0, n) + 1
            lines = int(np.count_nonzero(np.frombuffer(buf, np.uint8, end) == 10))  # 4x bytearray.count's speed
            if n < len(buf) and end < n:  # the file's last line, without its newline
                end, lines = n, lines + 1
            if not end:
                f.seek(start)
                yield from read_blocks(f, self.cap)
                return
            if not flight:
                pool[2] = ctx.lineno
            flight.append(p.apply_async(convert_range, (pool[2] + 1, start, end)))
            pool[2] += lines
            start += end
            f.seek(start)
            while len(flight) > FLIGHT * p._processes:
                self._take_task(ctx, flight.popleft())
            yield [], True

    def _take_task(self, ctx: Any, result: Any) -> None:
        results, rows = pickle.loads(result.get())  # conv_lines.packed
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
        item = conv_item(lineno, rec)
        pending.append(item)
        return 2 * len(item[1]) + len(item[2]) + len(item[3])

    def records(self, path: Path, fmt: str, info: dict[str, Any]) -> Iterator[tuple[Any, ...]]:
        """(session, file, line, raw, record or Invalid) of an input read whole (``readers.RECORD_FORMATS``)."""
        max_chars, cap, budget = self.conv_cfg.max_message_chars, self.cap, self.batch_bytes
        if fmt == "hermes_state":
            return hermes_sessions.iter_state_db(path, max_chars, info)
        if fmt == "hermes_export":
            return hermes_sessions.iter_export(path, max_chars, cap, budget, info)
        if fmt == "claude_code":
            return claude_code.iter_traces(readers.trace_files(path, cap), max_chars, cap, budget, info)
        if fmt == "atropos":
            lo, hi = self.conv_cfg.atropos_scores
            return atropos.iter_groups(path, max_chars, cap, (float(lo), float(hi)), self.scale, info)
        return hermes_sessions.iter_sessions(path, max_chars, cap)

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
                by_file.setdefault(fidx, []).append(conv_item(lineno, rec))
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
        """The accepted conversations' conversations/ rows, in seq order, with their record's split, into the
        dataset's shards (``ConvRows``): a worker's rows taken from its task's table, the others' (row text) parsed
        here."""
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
        held = self.cols["held"]
        split = pa.array(["heldout" if held[s] else "train" for s in seqs], pa.string())  # its task_id's
        t = pa.concat_tables(pieces)
        self.conv_rows.write(t.add_column(dataset_schema().get_field_index("split"), "split", split))

    def conversation_seqs(self) -> Any:
        """The accepted conversations' seq numbers in acceptance order: row i of conversations/ has the i-th."""
        import numpy as np

        v = self.conv_cols["seq"]
        return np.frombuffer(v, dtype=np.int64).copy() if len(v) else np.zeros(0, np.int64)

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
