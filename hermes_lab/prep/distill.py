"""Distill stage, part 2 (``hermes_lab.prep.run``): from the ingested records to the GRPO / held-out prompt sets, the
outlier report and the human review sample, in bounded memory.

Reads what ``hermes_lab.prep.ingest.Ingest`` left: the fixed-size columns (reward, origin, family id, split,
negative, review rank; indexed by the record's seq number, its order of acceptance) and the text spill,
partitioned by prompt. Writes into prep's output dir: ``grpo_dataset/``, ``heldout_dataset/``,
``conversations/``, ``outliers.jsonl``, ``review_queue.jsonl`` and ``left_out.jsonl`` (contents in
``hermes_lab.prep.run``'s docstring); ``data.select`` weighs the prompt rows (``hermes_lab.prep.selection``).

A conversation (a record that came in as one, ``hermes_lab.logs.record``) joins the prompt tables as its
projection (first user message, final answer) and keeps its whole record: a row of ``conversations/`` with
its split (the prompt tables' rule: its task_id's, or held out with its prompt) and reward, and, when the
review sample picks it, a review item holding its messages and tools (the label is the conversation's).

How the memory stays bounded: a prompt's records all sit in one partition, so the per-prompt rows are built
one partition at a time; rows keep the seq of their prompt's first record, and the datasets are written in
that order (the order the whole input would give). The outliers (in input order) and the review sample (in
seeded-hash order) go through ``SortedSpill``: lines bucketed on disk by key range, each bucket sorted in
memory on its own. The robust z-score's median and MAD are exact (numpy over the reward column). The
conversations' rows are written by the ingest, in acceptance order, with their record's split: distill keeps
them, or saves them again where a row's prompt moved it to the held-out set.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from array import array
from collections import deque
from pathlib import Path
from typing import Any

from xxhash import xxh3_64_intdigest

from hermes_lab.core.layout import PrepLayout
from hermes_lab.logs.record import dataset_schema
from hermes_lab.prep import review_sample
from hermes_lab.prep.resources import ForkPool, trim_heap, usable_cores
from hermes_lab.prep.review_sample import conversation_review_lines, seed_review_lines
from hermes_lab.prep.seed import LINE_BITS, values_of
from hermes_lab.prep.selection import Selection

ROW_BATCH = 65536
LINE_MASK = (1 << LINE_BITS) - 1


# -------------------------------------------------------------------------------------------- outliers
def outlier_stats(rewards: Any, z_max: float) -> dict[str, Any]:
    """Robust z-score parameters (median / 1.4826*MAD; 1.2533*MeanAD when MAD is 0)."""
    import numpy as np

    if len(rewards) == 0:
        return {"method": "robust_z", "z": z_max, "median": None, "sigma": None}
    med = float(np.median(rewards))
    dev = np.abs(rewards - med)
    sigma = 1.4826 * float(np.median(dev))
    if sigma == 0:  # more than half the rewards equal (e.g. all passes): fall back to the mean deviation
        sigma = 1.2533 * float(dev.mean())
    return {"method": "robust_z", "z": z_max, "median": med, "sigma": sigma}


def outlier_flags(rewards: Any, info: dict[str, Any]) -> Any:
    import numpy as np

    if not info["sigma"]:
        return np.zeros(len(rewards), dtype=bool)
    return np.abs((rewards - info["median"]) / info["sigma"]) > info["z"]


# ------------------------------------------------------------------------------------------ sorted spill
class SortedSpill:
    """Lines with an integer sort key in [0, key_max), bucketed on disk by key range; ``write_sorted`` writes
    them in key order, holding one bucket in memory at a time."""

    def __init__(self, tmp: Path, name: str, key_max: int, est_bytes: int, budget_bytes: int):
        self.key_max = max(1, key_max)
        self.n = max(1, min(256, math.ceil(est_bytes / max(1, budget_bytes))))
        self.paths = [tmp / f"{name}-{i:03d}.txt" for i in range(self.n)]
        self.files = [open(p, "wb") for p in self.paths]  # noqa: SIM115
        self.width = len(f"{self.key_max:x}")

    def add(self, key: int, text: str) -> None:
        """``text``: one JSON line without its newline, ASCII (JSON escapes raw newlines and tabs)."""
        self.files[key * self.n // self.key_max].write(f"{key:0{self.width}x}\t{text}\n".encode())

    def add_many(self, keys: list[int], lines: Any) -> None:
        """``add`` of many lines at once: ``lines`` an Arrow string array of them (built in columns)."""
        import numpy as np
        import pyarrow as pa
        import pyarrow.compute as pc

        w = self.width
        text = pc.binary_join_element_wise(pa.array([f"{k:0{w}x}" for k in keys], pa.string()), "\t", lines, "\n", "")
        bucket = np.asarray([k * self.n // self.key_max for k in keys], dtype=np.int64)
        for b in np.unique(bucket).tolist():
            part = text if self.n == 1 else text.filter(pa.array(bucket == b))
            self.files[b].write(values_of(part))

    def write_sorted(self, path: Path) -> int:
        """Every line, in key order (a bucket sorted in Arrow on its fixed-width hex keys: text order is key
        order), without its key."""
        import numpy as np
        import pyarrow as pa
        import pyarrow.compute as pc

        for f in self.files:
            f.close()
        n, w = 0, self.width
        with open(path, "wb") as out:
            for p in self.paths:
                data = p.read_bytes()
                if data:
                    ends = np.flatnonzero(np.frombuffer(data, dtype=np.uint8) == 10)
                    offsets = pa.py_buffer(np.concatenate(([0], ends + 1)).astype(np.int64))
                    lines = pa.LargeBinaryArray.from_buffers(
                        pa.large_binary(), len(ends), [None, offsets, pa.py_buffer(data)]
                    )
                    order = pc.sort_indices(pc.binary_slice(lines, 0, w))
                    for k in range(0, len(order), ROW_BATCH):  # a batch of sorted lines at a time, without keys
                        part = lines.take(order.slice(k, ROW_BATCH))
                        out.write(values_of(pc.binary_slice(part, w + 1, len(data))))  # stop None: fails
                    n += len(ends)
                p.unlink()
        return n


# ------------------------------------------------------------------------------------------ grouping
def _prompt_table(p: dict[str, Any], sel: Selection, held: bool) -> Any:
    """One set's prompt rows, one a prompt in order of its first record, from the per-prompt columns ``p`` (numpy
    and Arrow arrays: the sums over its records, its first, reference, task_id and tests rows' values), with the
    group outcome over its logged samples (every sample of the prompt, duplicate lines included: the policy gave
    that answer again; pass: reward >= reward.success_threshold), its weight and selection; ``held``: the held-out
    set (negatives weighted, no other selection: it is the regression set)."""
    import numpy as np
    import pyarrow as pa

    ns, n_pass, neg = p["ns"], p["n_pass"], p["neg"]
    outcome = np.where(ns < 2, "single", np.where(n_pass == ns, "all_pass", np.where(n_pass == 0, "all_fail", "mixed")))
    same = p["rmax"] == p["rmin"]  # equal rewards: std exactly 0 (the sums' cancellation leaves ~1e-8 for e.g.
    # three rewards of 1.6667); the others as a record-by-record sum gives it, in Python floats
    std = [0.0 if z else math.sqrt(max(q / k - (s1 / k) ** 2, 0.0))
           for z, q, s1, k in zip(same.tolist(), p["sq"].tolist(), p["s1"].tolist(), ns.tolist())]  # fmt: skip
    weight = np.where(neg, sel.neg_w, 1)
    if held:
        reason: Any = np.full(len(ns), "heldout")
    else:
        if sel.mode == "mixed":
            weight = np.where(outcome == "mixed", np.maximum(weight, sel.mixed_w), weight)
        reason = np.where(neg, "negative", outcome if sel.mode == "mixed" else "all")
    n = len(ns)
    return pa.table(
        {
            "prompt": p["prompt"],
            "task_id": p["task_id"],
            "family": pa.array(p["family"], pa.string()),
            "reference": p["reference"],
            "tests": p["tests"],  # the tests reward's column (None: no tests)
            "ref_reward": pa.array(p["ref_reward"], pa.float64()),
            "n_logged": pa.array(p["n"], pa.int64()),
            "mean_logged_reward": pa.array(p["total"] / p["n"] if n else [], pa.float64()),
            "n_samples": pa.array(ns, pa.int64()),
            "n_pass": pa.array(n_pass, pa.int64()),
            "pass_share": pa.array(n_pass / ns if n else [], pa.float64()),
            "reward_std": pa.array(std, pa.float64()),
            "zero_std": pa.array((ns >= 2) & same, pa.bool_()),
            "outcome": pa.array(outcome.tolist(), pa.string()),
            "is_negative": pa.array(neg, pa.bool_()),
            "weight": pa.array(weight, pa.int64()),
            "selected": pa.array(np.ones(n, dtype=bool), pa.bool_()),
            "selection": pa.array(reason.tolist(), pa.string()),
            "negative_source": pa.array(p["neg_source"], pa.string()),
            "negative_round": pa.array(p["neg_round"], pa.int64()),
            "n_outliers": pa.array(p["n_out"], pa.int64()),
            "first_seq": pa.array(p["first_seq"], pa.int64()),
            "select_rank": pa.array(np.zeros(n, np.uint64) if held else p["rank"], pa.uint64()),
        }
    )


def _empty_prompts() -> dict[str, Any]:
    import numpy as np
    import pyarrow as pa

    f, i, e = np.zeros(0), np.zeros(0, np.int64), pa.array([], pa.string())
    return {"prompt": e, "task_id": e, "family": [], "reference": e, "tests": e, "ref_reward": f, "n": i,
            "total": f, "ns": i, "n_pass": i, "s1": f, "sq": f, "rmin": f, "rmax": f, "neg": np.zeros(0, bool),
            "neg_source": [], "neg_round": [], "n_out": i, "first_seq": i, "rank": []}  # fmt: skip


def _fingerprint() -> str:
    """A new dataset's fingerprint: random, as datasets gives an in-memory table it cannot hash cheaply (hashing
    the rows would cost more than writing them)."""
    import uuid

    return uuid.uuid4().hex


def _tid_hash(task_id: str | None) -> int:
    """A task_id's 64-bit hash, for counting the sets' distinct task_ids and their overlap."""
    return xxh3_64_intdigest((task_id or "").encode())


def _merge_by_first_seq(tables: list[Any], path: Path, batch: int = ROW_BATCH) -> None:
    """Partition tables, each in first_seq order, into one Arrow stream file in first_seq order (without the
    column), a batch of rows at a time: in a batch, each table's rows are one slice of it."""
    import numpy as np
    import pyarrow as pa

    first = [t.column("first_seq").to_numpy() for t in tables]
    which = np.concatenate([np.full(len(f), k, dtype=np.int64) for k, f in enumerate(first)])
    order = np.argsort(np.concatenate(first), kind="stable")
    row = np.concatenate([np.arange(len(f), dtype=np.int64) for f in first])[order]
    which = which[order]
    tables = [t.drop_columns(["first_seq"]) for t in tables]
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, tables[0].schema) as writer:
        for s in range(0, len(order), batch):
            w, r = which[s : s + batch], row[s : s + batch]
            pieces, offset, pos = [], 0, np.empty(len(w), dtype=np.int64)
            for k in np.unique(w).tolist():
                at = w == k
                lo = int(r[at].min())
                n = int(r[at].max()) - lo + 1
                pieces.append(tables[k].slice(lo, n))
                pos[at] = offset + r[at] - lo
                offset += n
            writer.write_table(pa.concat_tables(pieces).take(pa.array(pos)))


class Distill:
    """Builds the prompt tables partition by partition, feeding the outlier and review spills on the way."""

    def __init__(self, ing: Any, cols: dict[str, Any], cfg: Any, is_out: Any, picked: Any, z: dict[str, Any]):
        import numpy as np

        self.ing, self.cols, self.cfg, self.is_out, self.picked, self.z = ing, cols, cfg, is_out, picked, z
        self.fam_names = ing.family_names()
        self.moved = 0
        # one partition: its tables stay in memory; several: each partition's rows go to an Arrow file at once
        self.tables: dict[str, list[Any]] = {"grpo_dataset": [], "heldout_dataset": []}
        self.rows = {"grpo_dataset": 0, "heldout_dataset": 0}
        self.tids: dict[str, Any] = {"grpo_dataset": array("Q"), "heldout_dataset": array("Q")}
        self.n_negative_grpo = 0
        self.sel = Selection(cfg)
        self.conv_held = np.zeros(ing.n, dtype=bool)  # by seq: a conversation held out (its prompt's split)
        self.conv_split = {"train": 0, "heldout": 0}
        self._review_pool: Any = None  # the worker building the conversations' review items (``run``)
        self._review_jobs: deque[tuple[list[int], Any]] = deque()

    def run(self, review: SortedSpill, outliers: SortedSpill) -> None:
        """Every partition's prompt rows; the conversations' review items meanwhile in forked workers (each reads
        its records back, scores them and writes their JSON), taken as they are ready."""
        import pyarrow as pa

        self._start_review()
        try:
            for path in self.ing.part_paths:
                with pa.memory_map(str(path)) as src:
                    table = pa.ipc.open_stream(src).read_all()
                if table.num_rows:
                    self._partition(table, review, outliers)
                del table
                trim_heap()  # a partition's work freed: its pages back before the next
                path.unlink()
                self._take_review(review, wait=False)
            self._take_review(review, wait=True)
            if self._review_pool is not None:  # reaped: its CPU is the command's
                self._review_pool.close()
                self._review_pool.join()
        finally:
            if self._review_pool is not None:
                self._review_pool.terminate()
        self.sel.plan()

    def _start_review(self) -> None:
        """The review workers, one a core: forked when conversations were picked and a second core is there (they
        build ~10% of the conversations' items, ~0.4 ms each, beside this process's partitions)."""
        scale, thr = float(self.cfg.reward.scale), float(self.cfg.reward.success_threshold)
        review_sample.JOB[:] = [(self.cols, self.fam_names, scale, thr, self.ing.committed.get("accepted"))]
        cores = usable_cores()
        seqs = self.ing.conversation_seqs()
        if cores >= 2 and len(seqs) and self.picked[seqs].any():
            self._review_pool = ForkPool(cores)

    def _take_review(self, review: SortedSpill, wait: bool) -> None:
        while self._review_jobs and (wait or self._review_jobs[0][1].ready()):
            keys, res = self._review_jobs.popleft()
            for key, line in zip(keys, res.get()):
                review.add(key, line)

    def _partition(self, table: Any, review: SortedSpill, outliers: SortedSpill) -> None:
        """One partition's prompt rows, in columns: each prompt's numbers summed over its records at once
        (numpy, in seq order: the sums are the ones a record-by-record loop gives), and its row built from them
        (``_prompt_table``); per record only the outliers, the review picks and the conversations."""
        import numpy as np
        import pyarrow as pa
        import pyarrow.compute as pc

        c, files = self.cols, self.ing.files
        scale, thr = float(self.cfg.reward.scale), float(self.cfg.reward.success_threshold)
        med, sigma = self.z["median"], self.z["sigma"]
        seq = table.column("seq").to_numpy()  # ascending: the partition's rows in the order they were accepted
        n = len(seq)
        r, held, neg = c["reward"][seq], c["held"][seq], c["negative"][seq]
        k = 1 + c["copies"][seq].astype(np.int64)  # a record and its duplicate lines: samples of its group
        enc = pc.dictionary_encode(table.column("prompt")).combine_chunks()
        code = enc.indices.to_numpy().astype(np.int64)
        prompts = enc.dictionary.to_pylist()  # in order of first record
        n_g = len(prompts)
        held_g = np.zeros(n_g, dtype=bool)
        held_g[code[held]] = True  # a prompt seen under a held-out task_id is held out whole
        h = held_g[code]
        self.moved += int((h & ~held).sum())

        def first_of(mask: Any) -> Any:  # per prompt: the first row where mask holds (n: none)
            out = np.full(n_g, n, dtype=np.int64)
            rows = np.flatnonzero(mask)
            np.minimum.at(out, code[rows], rows)
            return out

        def total(w: Any) -> Any:
            return np.bincount(code, weights=w, minlength=n_g)

        first = first_of(np.ones(n, dtype=bool))
        rmax = np.full(n_g, -np.inf)
        np.maximum.at(rmax, code, r)
        rmin = np.full(n_g, np.inf)
        np.minimum.at(rmin, code, r)
        ref = first_of(r == rmax[code])  # the reference: the highest-reward response, the first on ties
        tid_row = np.where(held_g, first_of(held), first)  # a held prompt's task_id: its first held-out record's
        tests = table.column("tests")
        test_row = first_of(tests.is_valid().to_numpy(zero_copy_only=False))
        neg_row = first_of(neg)
        sums = {
            "n": np.bincount(code, minlength=n_g),
            "total": total(r),
            "ns": total(k),
            "s1": total(k * r),
            "sq": total(k * r * r),
            "n_pass": total(k * (r >= thr)),
            "n_out": total(self.is_out[seq]),
        }
        tids, resps = table.column("task_id"), table.column("response")
        origin = c["origin"][seq]
        has_neg = neg_row < n
        neg_file = [files[o >> LINE_BITS] if ok else None
                    for o, ok in zip(origin[np.minimum(neg_row, n - 1)].tolist(), has_neg.tolist())]  # fmt: skip
        per = {  # per prompt, in order of first record
            "prompt": enc.dictionary,
            "task_id": tids.take(pa.array(tid_row)),
            "family": np.asarray(self.fam_names, dtype=object)[c["family"][seq[first]]] if n_g else [],
            "reference": resps.take(pa.array(ref)),
            "tests": pc.if_else(pa.array(test_row < n), tests.take(pa.array(np.minimum(test_row, n - 1))), None),
            "ref_reward": r[ref],
            "n": sums["n"],
            "total": sums["total"],
            "ns": sums["ns"].astype(np.int64),
            "n_pass": sums["n_pass"].astype(np.int64),
            "n_out": sums["n_out"].astype(np.int64),
            "s1": sums["s1"],
            "sq": sums["sq"],
            "rmin": rmin,
            "rmax": rmax,
            "neg": has_neg,
            "neg_source": np.asarray([f and f["file"] for f in neg_file], dtype=object),
            "neg_round": np.asarray([f and f["round"] for f in neg_file], dtype=object),
            "first_seq": seq[first],
        }
        out_rows = np.flatnonzero(self.is_out[seq])  # outliers, in input order: json.dumps's line, written here
        esc = json.encoder.encode_basestring_ascii
        names = [esc(f["file"]) for f in files]
        for s, o, tid, x in zip(seq[out_rows].tolist(), origin[out_rows].tolist(),
                                tids.take(pa.array(out_rows)).to_pylist(), r[out_rows].tolist()):  # fmt: skip
            z = round((x - med) / sigma, 3)
            t = "null" if tid is None else esc(tid)
            outliers.add(s, f'{{"file": {names[o >> LINE_BITS]}, "line": {o & LINE_MASK}, "task_id": {t}, '
                            f'"reward": {float.__repr__(x)}, "z": {float.__repr__(z)}}}')  # fmt: skip
        conv_at = table.column("conv_at")  # a conversation's record: its offset in its sink (null: a seed line)
        picks = np.flatnonzero(self.picked[seq])
        is_conv = conv_at.take(pa.array(picks)).is_valid().to_numpy(zero_copy_only=False)
        if (~is_conv).any():  # seed records: their review items built in columns
            sp = picks[~is_conv]
            at = pa.array(sp)
            lines = seed_review_lines(
                enc.dictionary.take(pa.array(code[sp])), resps.take(at), tids.take(at), c["family"][seq[sp]],
                r[sp], self.fam_names, scale, thr,
            )  # fmt: skip
            keys = [rk << LINE_BITS | s for rk, s in zip(c["rank"][seq[sp]].tolist(), seq[sp].tolist())]
            review.add_many(keys, lines)
        picks = picks[is_conv]  # conversations: their whole records, read back from the sink (in the worker)
        if len(picks):
            at = pa.array(picks)
            items = list(zip([prompts[x] for x in code[picks].tolist()], resps.take(at).to_pylist(),
                             tids.take(at).to_pylist(), conv_at.take(at).to_pylist()))  # fmt: skip
            seqs = seq[picks]
            keys = [rk << LINE_BITS | s for rk, s in zip(c["rank"][seqs].tolist(), seqs.tolist())]
            if self._review_pool is not None:
                job = self._review_pool.apply_async(conversation_review_lines, (items, seqs))
                self._review_jobs.append((keys, job))
            else:
                for key, line in zip(keys, conversation_review_lines(items, seqs)):
                    review.add(key, line)
        rows = np.flatnonzero(conv_at.is_valid().to_numpy(zero_copy_only=False))  # conversations: their rows
        if len(rows):
            self.conv_held[seq[rows]] = h[rows]
            self.conv_split["heldout"] += int(h[rows].sum())
            self.conv_split["train"] += int(len(rows) - h[rows].sum())
        for name, mask in (("grpo_dataset", ~held_g), ("heldout_dataset", held_g)):
            if not mask.any():
                continue
            pick = pa.array(mask)
            grp = {k: v.filter(pick) if isinstance(v, (pa.Array, pa.ChunkedArray)) else v[mask] for k, v in per.items()}
            held_set = name == "heldout_dataset"
            if not held_set:
                grp["rank"] = np.asarray([self.sel.rank(x) for x in grp["prompt"].to_pylist()], dtype=np.uint64)
            t = _prompt_table(grp, self.sel, held=held_set)
            if not held_set:
                self.sel.count(t)
                self.n_negative_grpo += int(grp["neg"].sum())
            self.rows[name] += t.num_rows
            self.tids[name].extend(_tid_hash(x) for x in grp["task_id"].to_pylist())
            if len(self.ing.part_paths) == 1:
                self.tables[name].append(t)
                continue
            f = self.ing.tmp / f"{name}-{len(self.tables[name]):04d}.arrow"
            with pa.OSFile(str(f), "wb") as sink, pa.ipc.new_stream(sink, t.schema) as writer:
                writer.write_table(t)
            self.tables[name].append(f)

    def split_summary(self) -> dict[str, Any]:
        import numpy as np

        w = self.cfg.data.negative_weight
        n = self.rows
        tids = {k: np.unique(np.frombuffer(v, dtype=np.uint64)) for k, v in self.tids.items()}
        return {
            "holdout_fraction": self.cfg.data.holdout_fraction,
            "grpo_prompts": n["grpo_dataset"],
            "heldout_prompts": n["heldout_dataset"],
            "grpo_rows_weighted": sum(c[1] - c[3] for c in self.sel.cells.values()),  # capped rows weigh 1
            "grpo_task_ids": int(len(tids["grpo_dataset"])),
            "heldout_task_ids": int(len(tids["heldout_dataset"])),
            "task_id_overlap": int(len(np.intersect1d(tids["grpo_dataset"], tids["heldout_dataset"]))),
            "records_moved_to_heldout": int(self.moved),
            "negative_prompts": self.n_negative_grpo,
            "negative_weight": w,
        }

    def save(self, out: Path) -> dict[str, Path]:
        """Write both datasets (save_to_disk), rows in the order of their prompt's first record."""
        import datasets

        bars = datasets.is_progress_bar_enabled()
        datasets.disable_progress_bars()  # two "Saving the dataset" bars per round say nothing
        import pyarrow as pa

        paths = {"left_out": PrepLayout(out).left_out}
        tmp = self.ing.tmp
        budget = (self.cfg.data.memory_budget_mb << 20) // 8
        left = SortedSpill(tmp, "left_out", max(1, self.ing.n), self.sel.cap.get("left_out", 0) * 400, budget)
        try:
            for name, parts in self.tables.items():
                paths[name] = out / name
                shutil.rmtree(paths[name], ignore_errors=True)  # a rerun into the same dir leaves no stale shards
                spill = left if name == "grpo_dataset" else None
                if not parts or not isinstance(parts[0], Path):  # one partition: rows already in first-record order
                    empty = _prompt_table(_empty_prompts(), self.sel, held=False)
                    table = self.sel.finish(parts[0] if parts else empty, spill)
                    ds = datasets.Dataset(table.drop_columns(["first_seq"]), fingerprint=_fingerprint())
                    ds.save_to_disk(str(paths[name]))
                    continue
                # several partitions: each finished (the cap) into a new Arrow file, memory-mapped, then merged in
                # first_seq order into one (a partition's rows are in that order already: each batch of the merge
                # is a slice of each partition, interleaved by one take), which datasets saves as it is
                tables = []
                for f in parts:
                    with pa.memory_map(str(f)) as src:
                        t = self.sel.finish(pa.ipc.open_stream(src).read_all(), spill)
                    g = f.with_suffix(".sel.arrow")
                    with pa.OSFile(str(g), "wb") as sink, pa.ipc.new_stream(sink, t.schema) as writer:
                        writer.write_table(t)
                    del t
                    tables.append(pa.ipc.open_stream(pa.memory_map(str(g))).read_all())
                merged = tmp / f"{name}.arrow"
                _merge_by_first_seq(tables, merged)
                del tables
                trim_heap()
                ds = datasets.Dataset.from_file(str(merged))
                ds.save_to_disk(str(paths[name]))
                del ds
            paths["conversations"] = self._save_conversations(PrepLayout(out).conversations)
        finally:
            if bars:
                datasets.enable_progress_bars()
        spilled = tmp / paths["left_out"].name
        left.write_sorted(spilled)
        os.replace(spilled, paths["left_out"])
        return paths

    def _save_conversations(self, path: Path) -> Path:
        """``conversations/``: every accepted conversation in acceptance order (empty, schema only, for seed
        input: those records are the prompt sets' one-turn rows), with its split. The ingest wrote its rows with
        their record's own split (``conv_ingest.ConvRows``): kept as written when that is every row's, else the
        rows saved again with the split column the prompt sets' rule gives."""
        import datasets
        import numpy as np
        import pyarrow as pa

        shutil.rmtree(path, ignore_errors=True)
        rows = self.ing.conv_rows
        if not rows.shards:
            ds = datasets.Dataset(dataset_schema().empty_table(), fingerprint=_fingerprint())
            ds.save_to_disk(str(path))
            return path
        seqs = self.ing.conversation_seqs()  # row i's seq
        held = self.conv_held[seqs]
        if np.array_equal(held, self.cols["held"][seqs]):
            rows.finish(path, _fingerprint())
            return path
        rows.close()
        t = rows.rows()
        split = pa.array(np.where(held, "heldout", "train").tolist(), pa.string())
        t = t.set_column(t.schema.get_field_index("split"), "split", split)
        ds = datasets.Dataset(t, fingerprint=_fingerprint())
        ds.save_to_disk(str(path))
        del ds, t
        return path
