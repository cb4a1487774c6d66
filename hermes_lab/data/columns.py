"""Distill stage, part 1 (``hermes_lab.data.ingest``), the seed's lines in columns: prep at the speed of reading them.

Reads the seed's JSONL (``{prompt, response, reward, task_id}`` a line, ``.jsonl`` or ``.jsonl.gz``) a block of
lines at a time (``read_blocks``: ``BLOCK_BYTES``, a line over ``data.max_line_bytes`` never held whole) and
parses each block with Arrow's JSON reader into columns (``pyarrow.json``: C++, on both cores), then checks the
columns at once (numpy, Arrow compute); only the lines that need a rule go through the per-line path of
``hermes_lab.data.ingest`` (``lines.decode`` and ``check_record``), which names every reject exactly as before.
Writes what the ingest writes (sinks, columns, partitions), in line order: a run of column rows and the per-line
lines between them are flushed in turn.

Which lines take the per-line path, so that every check prep makes still holds (Arrow's reader refuses duplicate
keys at any depth, lone surrogates, control characters, numbers a double cannot hold and trailing data, and a
block it refuses is split in halves down to single lines): a block that is not valid UTF-8, or holds a BOM,
``NaN`` / ``Infinity`` (which Arrow reads), a run of 4,301 digits (an integer Python refuses), ``\\u003a``; a line
with over 500 brackets (nesting Python refuses past ~990), one of a negative file (its ``_negative`` field is
added per line); a row whose prompt, response, reward or task_id is missing, of the wrong type, empty or out of
range, or that carries tests (``lines.record_tests`` parses them). A blank line is counted, not read.

Run through ``hermes-lab prep`` (``hermes_lab.data.prep.run_prep``), not on its own.
"""

from __future__ import annotations

import io
import json
import zlib
from collections import deque
from collections.abc import Iterator
from typing import Any, BinaryIO

from hermes_lab.data.lines import TEST_FIELDS, split_of
from hermes_lab.tasks import suite as tasks

BLOCK_BYTES = 4 << 20  # bytes read and parsed at once
PREFETCH = 1  # blocks prepared ahead of the one being ingested (one keeps the parse beside the main thread)
MIN_RUN = 64  # a refused block is split down to this many lines, then read line by line
MAX_BRACKETS = 500  # a line with more open brackets takes the per-line path (Python's nesting limit)
SUSPECT = (b"\xef\xbb\xbf", b"NaN", b"Infinity", b"\\u003a", b"\\u003A")
DIGITS = bytes(48 if 48 <= i <= 57 else 10 for i in range(256))  # translate: a digit -> "0", the rest -> newline
LONG_INT = b"0" * 4301
_CACHE_MAX = 200_000


class TooLong:
    """A line over the cap: its length and first bytes (never the whole line)."""

    __slots__ = ("head", "total")

    def __init__(self, total: int, head: bytes):
        self.total, self.head = total, head


class Corrupt:
    """A .gz stream that ends or breaks mid-file: what was read before it is kept."""

    __slots__ = ("error",)

    def __init__(self, error: Exception):
        self.error = error


def read_blocks(f: BinaryIO, cap: int, size: int = BLOCK_BYTES) -> Iterator[tuple[list[Any], bool]]:
    """The file's lines (without their newline), a block at a time, and whether they are all bytes: a line over
    ``cap`` comes as ``TooLong``, a broken .gz as a final ``Corrupt``."""
    rest = b""
    skipping = 0  # bytes of a too-long line read so far (its head kept in ``rest``)
    read = getattr(f, "read1", f.read)  # read1: a broken .gz loses only what its last call decompressed
    error: Exception | None = None
    while True:
        parts, got = [], 0
        try:
            while got < size and (part := read(size - got)):
                parts.append(part)
                got += len(part)
        except (EOFError, OSError, zlib.error) as e:
            error = e
        chunk = b"".join(parts)
        if error is not None:  # the complete lines read before it, then the break (a partial last line is lost)
            lines = (rest + chunk).split(b"\n")[:-1] if not skipping else []
            yield [*lines, Corrupt(error)], False
            return
        if not chunk:
            if skipping:
                yield [TooLong(skipping, rest)], False
            elif rest:
                yield [rest], True
            return
        if skipping:
            nl = chunk.find(b"\n")
            if nl < 0:
                skipping += len(chunk)
                continue
            out: list[Any] = [TooLong(skipping + nl + 1, rest)]
            rest, skipping = b"", 0
            chunk = chunk[nl + 1 :]
        else:
            out = []
        data = rest + chunk if rest else chunk
        lines = data.split(b"\n")
        rest = lines.pop()
        if len(rest) > cap:
            skipping, rest = len(rest), rest[:4096]
        plain = not out
        if len(data) > cap:  # only then can a line of the block be over the cap
            for k, line in enumerate(lines):
                if len(line) > cap:
                    lines[k], plain = TooLong(len(line) + 1, line[:4096]), False
        yield out + lines, plain


def fast_block(data: bytes) -> bool:
    """Whether a block's lines (joined) may be read in columns at all (see the module docstring)."""
    if any(s in data for s in SUSPECT) or LONG_INT in data.translate(DIGITS):
        return False
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def plain_lines(data: bytes) -> Any:
    """Per line of a block (joined by newlines): whether it may go to Arrow's reader: "{" first and "}" last (an
    object's line, nothing else: Arrow's reader crashes on some lines that are no object, a lone ``null``), and
    at most ``MAX_BRACKETS`` brackets. Blank lines, leading whitespace: not plain (counted line by line)."""
    import numpy as np

    if not data:
        return np.zeros(1, dtype=bool)
    a = np.frombuffer(data, dtype=np.uint8)
    nl = np.flatnonzero(a == 10)
    ends, starts = np.append(nl, len(a)), np.concatenate(([0], nl + 1))
    plain = (ends > starts) & (a[np.minimum(starts, len(a) - 1)] == 123) & (a[np.maximum(ends - 1, 0)] == 125)
    if data.count(b"[") + data.count(b"{") > MAX_BRACKETS:  # per line: the brackets between its newlines
        at = np.flatnonzero((a == 91) | (a == 123))
        plain &= (np.searchsorted(at, ends) - np.searchsorted(at, starts)) <= MAX_BRACKETS
    return plain


def parse_run(lines: list[bytes], schema: Any) -> Any:
    """The lines as one Arrow table (a row a line), or None when Arrow refuses them or a line is not one object."""
    import pyarrow as pa
    import pyarrow.json as pj

    try:
        t = pj.read_json(
            io.BytesIO(b"\n".join(lines)),
            read_options=pj.ReadOptions(block_size=BLOCK_BYTES),
            parse_options=pj.ParseOptions(explicit_schema=schema, unexpected_field_behavior="infer"),
            memory_pool=pa.system_memory_pool(),  # malloc's: a block's buffers go back when freed (mimalloc keeps them)
        )
    except (pa.ArrowInvalid, pa.ArrowTypeError, OSError):
        return None
    return t if t.num_rows == len(lines) else None


def row_checks(t: Any, scale: float) -> tuple[Any, Any]:
    """(the rows the columns accept as they are, task_id as text): a row that needs a rule goes line by line."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    n = t.num_rows
    names = t.column_names
    if "task_id" not in names:
        return np.zeros(n, dtype=bool), None
    ok = np.ones(n, dtype=bool)
    for f in TEST_FIELDS:  # a row with tests: parsed line by line (lines.record_tests)
        if f in names:
            ok &= t.column(f).is_null().to_numpy(zero_copy_only=False)
    tid = t.column("task_id")
    if pa.types.is_integer(tid.type):
        tid = pc.cast(tid, pa.string())
    elif not pa.types.is_string(tid.type):
        return np.zeros(n, dtype=bool), None
    for col in (t.column("prompt"), t.column("response"), tid):
        ok &= col.is_valid().to_numpy(zero_copy_only=False)
    r = t.column("reward").to_numpy(zero_copy_only=False)  # a null: NaN, which fails both (fill_null: 30x slower)
    ok &= (r >= 0) & (r <= scale)
    for col in (t.column("prompt"), tid):  # empty or whitespace only (str.strip's rule): printable ASCII is neither
        seen = pc.match_substring_regex(col, "[!-~]").fill_null(True).to_numpy(zero_copy_only=False)
        for i in np.flatnonzero(~seen & ok).tolist():
            ok[i] = bool(col[i].as_py().strip())
    return ok, tid


NOT_PLAIN, NOT_PARSED = object(), object()  # a run that is one line not for Arrow; a run not parsed yet


def parse_checked(run: list[bytes], schema: Any, scale: float) -> Any:
    """(table, rows the columns accept, task_id as text) of a run of plain lines, or None when Arrow refuses it."""
    t = parse_run(run, schema)
    return None if t is None else (t, *row_checks(t, scale))


def prepare_block(lines: list[Any], fast: bool, schema: Any, scale: float) -> tuple[list[Any], Any]:
    """A block's work that needs no ingest state (pure: the prefetch thread does it): (its lines, its runs), runs
    None when every line takes the per-line path (a block that fails ``fast_block``, holds a long line or a
    broken .gz, or is a negative file's: ``fast`` False), else (start, end, ``parse_checked`` of the run) in line
    order, NOT_PLAIN for a line that is not plain."""
    import numpy as np

    data = b"\n".join(lines) if fast else b""
    if not data or not fast_block(data):
        return lines, None
    if b"\r" in data:
        lines = [line.rstrip(b"\r") for line in lines]
        data = b"\n".join(lines)
    plain = plain_lines(data)
    runs: list[tuple[int, int, Any]] = []
    i, n = 0, len(lines)
    while i < n:
        if not plain[i]:
            runs.append((i, i + 1, NOT_PLAIN))
            i += 1
            continue
        j = i + int(np.argmin(plain[i:])) if not plain[i:].all() else n
        runs.append((i, j, parse_checked(lines[i:j], schema, scale)))
        i = j
    return lines, runs


class SeedColumns:
    """The ingest's column path for seed lines (``Ingest`` inherits it; its attributes are theirs)."""

    def seed_blocks(self, blocks: Iterator[tuple[list[Any], bool]], ctx: Any) -> Iterator[tuple[list[Any], Any]]:
        """``read_blocks``' blocks with their ingest-free work done one block ahead in a thread (``prepare_block``:
        the block tests, Arrow's parse and the row checks release the GIL), so both cores work: (lines, runs)."""
        from concurrent.futures import ThreadPoolExecutor

        fast, schema, scale = ctx.role == "input", self.seed_schema, self.scale
        ahead: deque[Any] = deque()
        with ThreadPoolExecutor(1, thread_name_prefix="prep-parse") as ex:
            try:
                for lines, plain in blocks:
                    ahead.append(ex.submit(prepare_block, lines, plain and fast, schema, scale))
                    if len(ahead) > PREFETCH:
                        yield ahead.popleft().result()
                while ahead:
                    yield ahead.popleft().result()
            finally:  # a corrupt .gz stops the scan: what is in flight is dropped
                for fut in ahead:
                    fut.cancel()

    def _seed_block(self, ctx: Any, lines: list[Any], runs: Any) -> None:
        """One prepared block: runs of rows in columns, the lines that need a rule through ``_line``, in line
        order."""
        if runs is None:
            for line in lines:
                self._line(ctx, line)
            return
        for i, j, parsed in runs:
            if parsed is NOT_PLAIN:
                self._line(ctx, lines[i])
            else:
                self._parse(ctx, lines[i:j], parsed)

    def _parse(self, ctx: Any, run: list[bytes], parsed: Any = NOT_PARSED) -> None:
        """A run of plain lines: its rows in columns (``parsed``: ``parse_checked``'s, when done ahead), halved
        while Arrow refuses it, the rows that need a rule line by line."""
        if parsed is NOT_PARSED:
            parsed = parse_checked(run, self.seed_schema, self.scale)
        if parsed is None:
            if len(run) <= MIN_RUN:
                for line in run:
                    self._line(ctx, line)
                return
            half = len(run) // 2
            self._parse(ctx, run[:half])
            self._parse(ctx, run[half:])
            return
        t, ok, tid = parsed
        i, n = 0, len(run)
        while i < n:
            if not ok[i]:
                self._line(ctx, run[i])
                i += 1
                continue
            j = i + 1
            while j < n and ok[j]:
                j += 1
            self._flush_pending(ctx)
            self._flush_columns(ctx, run[i:j], t.slice(i, j - i), tid.slice(i, j - i))
            i = j

    def _flush_columns(self, ctx: Any, raws: list[bytes], t: Any, tid: Any) -> None:
        """A run of valid rows: duplicates found at once (``DigestIndex``), the rest written and counted."""
        import numpy as np
        import pyarrow as pa
        import pyarrow.compute as pc
        import xxhash

        n = len(raws)
        linenos = np.arange(ctx.lineno + 1, ctx.lineno + 1 + n, dtype=np.int64)
        ctx.lineno += n
        ctx.read += n
        st, fidx = ctx.st, ctx.fidx
        p_col, r_col = t.column("prompt"), t.column("response")
        # the dedup key (lengths, then the texts: unambiguous) built in Arrow, hashed per row (XXH3-128)
        lens = [pc.cast(pc.utf8_length(x), pa.string()) for x in (tid, p_col)]
        keyed = pc.binary_join_element_wise(lens[0], ",", lens[1], ",", tid, p_col, r_col, "")
        keyed = pc.cast(keyed, pa.binary()).to_pylist()
        keys = np.frombuffer(b"".join(map(xxhash.xxh3_128_digest, keyed)), dtype=np.uint64).reshape(-1, 2)
        found = self.index.lookup(keys[:, 0], keys[:, 1])
        kv = np.ascontiguousarray(keys).view(np.dtype((np.void, 16))).ravel()
        _, first_idx, inverse = np.unique(kv, return_index=True, return_inverse=True)
        first = first_idx[inverse.ravel()]
        new = (found < 0) & (first == np.arange(n))
        seq0 = self.n
        new_seq = seq0 - 1 + np.cumsum(new)  # at a new row: its seq
        dup_seq = np.where(found >= 0, found, new_seq[first])  # at a duplicate: the seq it repeats
        new_idx = np.flatnonzero(new)
        k = len(new_idx)
        c = self.cols
        c["copies"].frombytes(bytes(4 * k))
        if k < n:
            dups = np.flatnonzero(~new)
            copies = np.frombuffer(c["copies"], dtype=np.uint32)
            np.add.at(copies, dup_seq[dups], 1)
            del copies
            enc = json.encoder.encode_basestring_ascii
            file_js = enc(st["file"])
            orig = np.frombuffer(c["origin"], dtype=np.int64)
            wheres: dict[int, str] = {}  # many lines repeat a few records: each one's origin said once
            out = []
            for d, o, ln in zip(dups.tolist(), dup_seq[dups].tolist(), linenos[dups].tolist()):
                where = wheres.get(o)
                if where is None:
                    at = self.origin_str(int(orig[o])) if o < seq0 else f"{st['file']}:{int(linenos[first[d]])}"
                    where = wheres[o] = enc(at)
                raw = enc(raws[d].decode())
                out.append(f'{{"file": {file_js}, "line": {ln}, "duplicate_of": {where}, "raw": {raw}}}\n')
            del orig
            self.sinks["duplicates"].write("".join(out).encode())
            st["duplicates"] += len(dups)
        if not k:
            return
        self.sinks["accepted"].write(b"\n".join([raws[i] for i in new_idx.tolist()]) + b"\n")
        rewards = t.column("reward").to_numpy()[new_idx]
        c["reward"].frombytes(rewards.astype(np.float64).tobytes())
        c["origin"].frombytes(((fidx << 40) | linenos[new_idx]).astype(np.int64).tobytes())
        sel = pa.array(new_idx)
        prompts = p_col.take(sel)
        c["family"].frombytes(self._family_ids(prompts, t.column("family").take(sel)).tobytes())
        c["held"].frombytes(self._held(tid.take(sel)).tobytes())
        c["negative"].frombytes(bytes(k))
        seed, rank = self.rank_seed, xxhash.xxh3_64_intdigest
        kept = [keyed[i] for i in new_idx.tolist()]
        c["rank"].extend([rank(x, seed) for x in kept])
        self.text_bytes += sum(map(len, kept))
        self.n = seq0 + k
        self.index.add(keys[new_idx, 0].copy(), keys[new_idx, 1].copy(), np.arange(seq0, seq0 + k, dtype=np.int64))
        cols = {"prompt": prompts, "response": r_col.take(sel), "task_id": tid.take(sel)}
        self._write_columns(np.arange(seq0, seq0 + k, dtype=np.int64), cols)
        st["accepted"] += k

    def _family_ids(self, prompts: Any, fams: Any) -> Any:
        """Each row's family id: its family field, else its prompt's embedded family (once per distinct prompt)."""
        import numpy as np
        import pyarrow.compute as pc

        fam_cache, families = self._fam_cache, self.families
        if len(fam_cache) > _CACHE_MAX:
            fam_cache.clear()

        def fid(name: str) -> int:
            f = families.get(name)
            if f is None:
                f = families[name] = len(families)
            return f

        import pyarrow as pa

        given = pc.if_else(pc.equal(fams, ""), None, fams)  # an empty family field is no family
        need = given.is_null()
        enc = pc.dictionary_encode(prompts).combine_chunks()
        idx = enc.indices.to_numpy()
        uniq = enc.dictionary.to_pylist()
        names: list[str | None] = [None] * len(uniq)
        for u in np.unique(idx[need.to_numpy(zero_copy_only=False)]).tolist():  # the prompts of rows without one
            f = fam_cache.get(uniq[u])
            if f is None:
                f = fam_cache[uniq[u]] = tasks.family_of(uniq[u]) or "unknown"
            names[u] = f
        derived = pa.DictionaryArray.from_arrays(enc.indices, pa.array(names, pa.string())).cast(pa.string())
        final = pc.dictionary_encode(pc.if_else(need, derived, given)).combine_chunks()
        ids = np.asarray([fid(f) for f in final.dictionary.to_pylist()], dtype=np.int32)  # in order of first row
        return ids[final.indices.to_numpy()]

    def _held(self, tids: Any) -> Any:
        """Each row's split (held out: True), once per distinct task_id."""
        import numpy as np
        import pyarrow.compute as pc

        enc = pc.dictionary_encode(tids).combine_chunks()
        cache, holdout = self._split_cache, self.holdout
        held = [split_of(x, holdout, cache) for x in enc.dictionary.to_pylist()]
        return np.asarray(held, dtype=np.int8)[enc.indices.to_numpy()]

    def _write_columns(self, seqs: Any, cols: dict[str, Any]) -> None:
        """Rows (Arrow columns) into their prompt's partition."""
        import numpy as np
        import pyarrow as pa

        k_parts = self.n_parts
        null, no_conv = pa.nulls(len(seqs), pa.string()), pa.nulls(len(seqs), pa.int64())
        if k_parts == 1:
            parts = [(self._writers[0], np.arange(len(seqs)))]
        else:
            prompts = cols["prompt"].to_pylist()
            where = np.fromiter((hash(p) % k_parts for p in prompts), dtype=np.int64, count=len(prompts))
            parts = [(w, np.flatnonzero(where == j)) for j, w in enumerate(self._writers)]
        for w, idx in parts:
            if not len(idx):
                continue
            whole = len(idx) == len(seqs)
            pick = pa.array(idx)
            batch = [pa.array(seqs[idx], pa.int64())]
            batch += [cols[c] if whole else cols[c].take(pick) for c in ("prompt", "response", "task_id")]
            batch += [no_conv if whole else no_conv.take(pick), null if whole else null.take(pick)]
            w.write_batch(pa.record_batch([_flat(a) for a in batch], schema=self.schema))


def _flat(a: Any) -> Any:
    return a.combine_chunks() if hasattr(a, "combine_chunks") else a
