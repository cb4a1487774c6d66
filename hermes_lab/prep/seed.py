"""Distill stage, part 1 (``hermes_lab.prep.ingest``), the seed's lines in columns: prep at the speed of reading them.

Reads the seed's JSONL (``{prompt, response, reward, task_id}`` a line, ``.jsonl`` or ``.jsonl.gz``) a block of
lines at a time (``read_blocks``: ``BLOCK_BYTES``, a line over ``data.max_line_bytes`` never held whole) and
parses each block with Arrow's JSON reader into columns (``pyarrow.json``: C++, on both cores), then checks the
columns at once (numpy, Arrow compute); only the lines that need a rule go through the per-line path of
``hermes_lab.prep.ingest`` (``lines.decode`` and ``check_record``), which names every reject exactly as before.
Writes what the ingest writes (sinks, columns, partitions), in line order: a run of column rows and the per-line
lines between them are flushed in turn.

Which lines take the per-line path, so that every check prep makes still holds (Arrow's reader refuses duplicate
keys at any depth, lone surrogates, control characters, numbers a double cannot hold and trailing data, and a
block it refuses is split in halves down to single lines): a block that is not valid UTF-8, or holds a BOM,
``NaN`` / ``Infinity`` (which Arrow reads), a run of 4,301 digits (an integer Python refuses), ``\\u003a``; a line
with over 500 brackets (nesting Python refuses past ~990), one of a negative file (its ``_negative`` field is
added per line); a row whose prompt, response, reward or task_id is missing, of the wrong type, empty or out of
range, or that carries tests (``lines.record_tests`` parses them). A blank line is counted, not read.

Run through ``hermes-lab prep`` (``hermes_lab.prep.run.run_prep``), not on its own.
"""

from __future__ import annotations

import json
import zlib
from collections import deque
from collections.abc import Iterator
from typing import Any, BinaryIO

from xxhash import xxh3_64_intdigest

from hermes_lab.logs.lines import TEST_FIELDS, split_of
from hermes_lab.prep.resources import arrow_pool, trim_heap
from hermes_lab.tasks import suite as tasks

BLOCK_BYTES = 2 << 20  # bytes read and parsed at once (4 MiB: ~10 MiB more peak RSS at 1M records, ~3% less CPU)
PREFETCH = 1  # blocks prepared ahead of the one being ingested (one keeps the parse beside the main thread)
TRIM_BLOCKS = 4  # blocks between two ``trim_heap`` calls
MIN_RUN = 64  # a refused block is split down to this many lines, then read line by line
MAX_BRACKETS = 500  # a line with more open brackets takes the per-line path (Python's nesting limit)
SUSPECT = (b"\xef\xbb\xbf", b"NaN", b"Infinity", b"\\u003a", b"\\u003A")
SUSPECT_RE = r"\x{FEFF}|NaN|Infinity|\\u003[aA]"  # SUSPECT as RE2 reads it (a BOM is U+FEFF)
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
        block = out + lines
        parts, chunk, data, lines = [], b"", b"", []  # not held while the block is out: only its lines are
        yield block, plain


def fast_block(data: bytes) -> bool:
    """Whether a block's lines (joined) may be read in columns at all (see the module docstring): valid UTF-8 and
    none of ``SUSPECT``, tested in Arrow's C++ (its UTF-8 validation is Python's decoder's rule; RE2), outside
    the GIL. The digit runs are ``long_ints``'."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    whole = pa.StringArray.from_buffers(1, pa.py_buffer(np.array([0, len(data)], np.int32)), pa.py_buffer(data))
    try:
        whole.validate(full=True)
    except pa.ArrowInvalid:
        return False
    return not pc.match_substring_regex(whole, SUSPECT_RE)[0].as_py()


def long_ints(data: bytes, starts: Any, ends: Any) -> bool:
    """Whether a line of the block holds a run of 4,301 digits (an integer Python refuses): only a line that long
    can, so only those are looked at."""
    import numpy as np

    long = np.flatnonzero(ends - starts >= len(LONG_INT)).tolist()
    return any(LONG_INT in data[starts[k] : ends[k]].translate(DIGITS) for k in long)


def plain_lines(data: bytes, a: Any, starts: Any, ends: Any) -> Any:
    """Per line of a block (``data``: its lines, each ended by a newline; ``a`` its bytes as numpy, ``starts`` /
    ``ends`` each line's first byte and its newline): whether it may go to Arrow's reader: "{" first and "}" last
    (an object's line, nothing else: Arrow's reader crashes on some lines that are no object, a lone ``null``),
    and at most ``MAX_BRACKETS`` brackets. Blank lines, leading whitespace: not plain (counted line by line)."""
    import numpy as np

    last = len(a) - 1
    plain = (ends > starts) & (a[np.minimum(starts, last)] == 123) & (a[np.maximum(ends - 1, 0)] == 125)
    if (ends - starts).max() > MAX_BRACKETS:  # per line: the brackets between its newlines (a shorter line is fine)
        at = np.flatnonzero((a == 91) | (a == 123))
        plain &= (np.searchsorted(at, ends) - np.searchsorted(at, starts)) <= MAX_BRACKETS
    return plain


def special_lines(a: Any, ends: Any) -> Any:
    """Per line: whether it holds a byte that JSON's ASCII escaping (``encode_basestring_ascii``) changes other
    than a quote or a backslash (a control character, DEL, any non-ASCII byte): its duplicate line is escaped in
    Python, the others in columns."""
    import numpy as np

    if a.max() < 127 and np.count_nonzero(a < 32) == len(ends):  # printable ASCII and the newlines: none
        return np.zeros(len(ends), dtype=bool)
    pos = np.flatnonzero((a - np.uint8(32)) > 94)  # uint8 wraps: below 0x20 or from 0x7f on
    pos = pos[a[pos] != 10]  # the lines' own newlines
    out = np.zeros(len(ends), dtype=bool)
    out[np.searchsorted(ends, pos)] = True
    return out


def parse_run(buf: Any, n: int, schema: Any) -> Any:
    """The run's lines (``buf``: an Arrow buffer of them, each ended by a newline) as one Arrow table (a row a
    line), or None when Arrow refuses them or a line is not one object."""
    import pyarrow as pa
    import pyarrow.json as pj

    try:
        t = pj.read_json(
            pa.BufferReader(buf),
            read_options=pj.ReadOptions(block_size=BLOCK_BYTES),
            parse_options=pj.ParseOptions(explicit_schema=schema, unexpected_field_behavior="infer"),
            memory_pool=arrow_pool(),
        )
    except (pa.ArrowInvalid, pa.ArrowTypeError, OSError):
        return None
    return t if t.num_rows == n else None


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


class Run:
    """A run of plain lines parsed and checked in columns, with what dedup needs (``parse_checked``, in the
    prefetch thread): the table, the rows the columns accept (``ok``), task_id as text, the lines (Arrow strings,
    each with its newline), which of them ``special_lines`` names, and the dedup key of each row as a ``code``
    into the run's distinct keys, with their XXH3-128 digests, review ranks and lengths."""

    __slots__ = ("code", "digests", "klen", "lines", "ok", "ranks", "special", "t", "tid")


def dedup_keys(run: Run, rank_seed: int) -> None:
    """The dedup key of each row, ``"{len(task_id)},{len(prompt)},{task_id}{prompt}{response}"`` (lengths first:
    unambiguous; the per-line path's), built in Arrow; only the run's distinct keys are hashed: their XXH3-128
    digest and their review rank (XXH3-64 seeded with ``rank_seed``, the per-line path's), not kept as text."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc
    from xxhash import xxh3_128_digest

    t = run.t
    tid, p = pc.fill_null(run.tid, ""), pc.fill_null(t.column("prompt"), "")  # a null: a row not ok, never used
    lens = [pc.cast(pc.utf8_length(x), pa.string()) for x in (tid, p)]
    keyed = pc.binary_join_element_wise(lens[0], ",", lens[1], ",", tid, p, pc.fill_null(t.column("response"), ""), "")
    enc = pc.dictionary_encode(pc.cast(keyed, pa.binary()).combine_chunks())
    run.code = enc.indices.to_numpy().astype(np.int64)
    keyed = enc.dictionary.to_pylist()
    run.klen = pc.binary_length(enc.dictionary).to_numpy().astype(np.int64)
    run.digests = np.frombuffer(b"".join(map(xxh3_128_digest, keyed)), dtype=np.uint64).reshape(-1, 2)
    run.ranks = np.fromiter((xxh3_64_intdigest(k, rank_seed) for k in keyed), dtype=np.uint64, count=len(keyed))


def parse_checked(buf: Any, offsets: Any, special: Any, schema: Any, scale: float, rank_seed: int) -> Run | None:
    """The ``Run`` of plain lines (``buf``: their bytes, each line ended by a newline; ``offsets``: where each
    starts, and the end), or None when Arrow refuses it."""
    import numpy as np
    import pyarrow as pa

    n = len(offsets) - 1
    t = parse_run(buf, n, schema)
    if t is None:
        return None
    run = Run()
    run.t, run.special = t, special
    run.ok, run.tid = row_checks(t, scale)
    run.lines = pa.StringArray.from_buffers(n, pa.py_buffer(np.asarray(offsets, dtype=np.int32)), buf)
    if run.tid is not None and run.ok.any():
        dedup_keys(run, rank_seed)
    return run


def parse_lines(lines: list[bytes], schema: Any, scale: float, rank_seed: int) -> Run | None:
    """``parse_checked`` of a list of plain lines (a run that a refused one was split into)."""
    import numpy as np
    import pyarrow as pa

    data = b"\n".join([*lines, b""])
    a = np.frombuffer(data, dtype=np.uint8)
    ends = np.flatnonzero(a == 10)
    offsets = np.concatenate(([0], ends + 1))
    return parse_checked(pa.py_buffer(data), offsets, special_lines(a, ends), schema, scale, rank_seed)


NOT_PLAIN, NOT_PARSED = object(), object()  # a run that is one line not for Arrow; a run not parsed yet


def prepare_block(
    lines: list[Any], fast: bool, schema: Any, scale: float, rank_seed: int
) -> tuple[list[Any] | None, Any]:
    """A block's work that needs no ingest state (pure: the prefetch threads do it): (its lines, its runs), runs
    None when every line takes the per-line path (a block that fails ``fast_block``, holds a long line or a
    broken .gz, or is a negative file's: ``fast`` False), else (start, end, ``parse_checked`` of the run) in line
    order, NOT_PLAIN for a line that is not plain. The lines are None when no line of the block needs them (every
    row in columns: its text is in the runs' buffer)."""
    import numpy as np
    import pyarrow as pa

    data = b"\n".join([*lines, b""]) if fast and lines else b""
    if not data or not fast_block(data):
        return lines, None
    if b"\r" in data:
        lines = [line.rstrip(b"\r") for line in lines]
        data = b"\n".join([*lines, b""])
    a = np.frombuffer(data, dtype=np.uint8)
    ends = np.flatnonzero(a == 10)  # each line's newline: one a line
    starts = np.concatenate(([0], ends[:-1] + 1))
    if long_ints(data, starts, ends):
        return lines, None
    plain = plain_lines(data, a, starts, ends)
    special = special_lines(a, ends)
    buf = pa.py_buffer(data)
    runs: list[tuple[int, int, Any]] = []
    i, n = 0, len(lines)
    while i < n:
        if not plain[i]:
            runs.append((i, i + 1, NOT_PLAIN))
            i += 1
            continue
        j = i + int(np.argmin(plain[i:])) if not plain[i:].all() else n
        s, e = int(starts[i]), int(ends[j - 1]) + 1
        offsets = np.append(starts[i:j], e) - s
        runs.append((i, j, parse_checked(buf.slice(s, e - s), offsets, special[i:j], schema, scale, rank_seed)))
        i = j
    if all(run is not NOT_PLAIN and run is not None and run.ok.all() for _, _, run in runs):
        return None, runs
    return lines, runs


def values_of(arr: Any) -> memoryview:
    """The bytes of an Arrow (large) string / binary array's values, in order (its rows joined with nothing)."""
    import numpy as np
    import pyarrow as pa

    wide = pa.types.is_large_binary(arr.type) or pa.types.is_large_string(arr.type)
    dt = np.int64 if wide else np.int32
    off = np.frombuffer(arr.buffers()[1], dtype=dt, count=len(arr) + 1, offset=dt().itemsize * arr.offset)
    data = arr.buffers()[2]
    return memoryview(data)[int(off[0]) : int(off[-1])] if data is not None else memoryview(b"")


LINE_BITS = 40  # a row's origin: its file's index << 40 | its line number (the ingest's, seed and conversations)


class SeedColumns:
    """The ingest's column path for seed lines (``Ingest`` inherits it; its attributes are theirs)."""

    def seed_blocks(self, blocks: Iterator[tuple[list[Any], bool]], ctx: Any) -> Iterator[tuple[list[Any], Any]]:
        """``read_blocks``' blocks with their ingest-free work done one block ahead in a thread (``prepare_block``:
        the block tests, Arrow's parse, the row checks and the dedup keys; Arrow's work releases the GIL), so
        both cores work: (lines, runs)."""
        from concurrent.futures import ThreadPoolExecutor

        fast, schema, scale = ctx.role == "input", self.seed_schema, self.scale
        ahead: deque[Any] = deque()
        with ThreadPoolExecutor(PREFETCH, thread_name_prefix="prep-parse") as ex:
            try:
                for k, (lines, plain) in enumerate(blocks):
                    ahead.append(ex.submit(prepare_block, lines, plain and fast, schema, scale, self.rank_seed))
                    if len(ahead) > PREFETCH:
                        yield ahead.popleft().result()
                    if k % TRIM_BLOCKS == TRIM_BLOCKS - 1:
                        trim_heap()
                while ahead:
                    yield ahead.popleft().result()
            finally:  # a corrupt .gz stops the scan: what is in flight is dropped
                for fut in ahead:
                    fut.cancel()

    def _seed_block(self, ctx: Any, lines: list[Any] | None, runs: Any) -> None:
        """One prepared block: runs of rows in columns, the lines that need a rule through ``_line``, in line
        order (``lines`` None: there are none)."""
        if runs is None:
            for line in lines or ():
                self._line(ctx, line)
            return
        for i, j, parsed in runs:
            if parsed is NOT_PLAIN:
                self._line(ctx, lines[i])  # type: ignore[index]
            else:
                self._parse(ctx, lines[i:j] if lines is not None else [], parsed)

    def _parse(self, ctx: Any, run: list[bytes], parsed: Any = NOT_PARSED) -> None:
        """A run of plain lines: its rows in columns (``parsed``: ``parse_checked``'s, when done ahead), halved
        while Arrow refuses it, the rows that need a rule line by line (``run``: the lines, empty when every row
        is in columns)."""
        import numpy as np

        if parsed is NOT_PARSED:
            parsed = parse_lines(run, self.seed_schema, self.scale, self.rank_seed)
        if parsed is None:
            if len(run) <= MIN_RUN:
                for line in run:
                    self._line(ctx, line)
                return
            half = len(run) // 2
            self._parse(ctx, run[:half])
            self._parse(ctx, run[half:])
            return
        i, n = 0, len(parsed.ok)
        for j in [*np.flatnonzero(~parsed.ok).tolist(), n]:  # the rows that need a rule, then the end
            if j > i:
                self._flush_pending(ctx)
                self._flush_columns(ctx, parsed, i, j)
            if j < n:
                self._line(ctx, run[j])
            i = j + 1

    def _flush_columns(self, ctx: Any, run: Run, i: int, j: int) -> None:
        """Rows i..j of a run, all valid: duplicates found at once (``DigestIndex``, over the run's distinct keys),
        their duplicates.jsonl lines built in Arrow, the rest written and counted."""
        import numpy as np
        import pyarrow as pa

        n = j - i
        linenos = np.arange(ctx.lineno + 1, ctx.lineno + 1 + n, dtype=np.int64)
        ctx.lineno += n
        ctx.read += n
        st, fidx = ctx.st, ctx.fidx
        code = run.code[i:j]
        uniq, first_idx, inverse = np.unique(code, return_index=True, return_inverse=True)
        d = run.digests[uniq]
        by_hi = np.argsort(d[:, 0])  # sorted needles: the index's binary searches stay in cache
        found = np.empty(len(uniq), dtype=np.int64)
        found[by_hi] = self.index.lookup(d[by_hi, 0], d[by_hi, 1])
        found = found[inverse]
        first = first_idx[inverse]
        new = (found < 0) & (first == np.arange(n))
        seq0 = self.n
        new_idx = np.flatnonzero(new)
        k = len(new_idx)
        c = self.cols
        c["copies"].frombytes(bytes(4 * k))
        c["origin"].frombytes(((fidx << LINE_BITS) | linenos[new_idx]).astype(np.int64).tobytes())
        lines = run.lines.slice(i, n)
        if k < n:
            new_seq = seq0 - 1 + np.cumsum(new)  # at a new row: its seq
            dups = np.flatnonzero(~new)
            dup_seq = np.where(found >= 0, found, new_seq[first])[dups]  # the seq each repeats
            copies = np.frombuffer(c["copies"], dtype=np.uint32)
            np.add.at(copies, dup_seq, 1)
            origin = np.frombuffer(c["origin"], dtype=np.int64)[dup_seq]
            del copies
            self.sinks["duplicates"].write(self._duplicate_lines(st, lines, dups, linenos[dups], origin, run, i))
            st["duplicates"] += len(dups)
        if not k:
            return
        t = run.t.slice(i, n)
        sel = pa.array(new_idx)
        self.sinks["accepted"].write(values_of(lines if k == n else lines.take(sel)))
        rewards = t.column("reward").to_numpy()[new_idx]
        c["reward"].frombytes(rewards.astype(np.float64).tobytes())
        tid = run.tid.slice(i, n).take(sel)
        prompts = t.column("prompt").take(sel)
        fam_ids, uniq_prompts, prompt_code = self._family_ids(prompts, t.column("family").take(sel))
        c["family"].frombytes(fam_ids.tobytes())
        c["held"].frombytes(self._held(tid).tobytes())
        c["negative"].frombytes(bytes(k))
        new_code = code[new_idx]
        c["rank"].frombytes(run.ranks[new_code].tobytes())
        self.text_bytes += int(run.klen[new_code].sum())
        self.n = seq0 + k
        d = run.digests[new_code]
        self.index.add(d[:, 0].copy(), d[:, 1].copy(), np.arange(seq0, seq0 + k, dtype=np.int64))
        cols = {"prompt": prompts, "response": t.column("response").take(sel), "task_id": tid}
        self._write_columns(np.arange(seq0, seq0 + k, dtype=np.int64), cols, uniq_prompts, prompt_code)
        st["accepted"] += k

    def _duplicate_lines(
        self, st: dict[str, Any], lines: Any, dups: Any, linenos: Any, origin: Any, run: Run, i: int
    ) -> memoryview:
        """duplicates.jsonl's lines of a run's duplicates, as ``json.dumps`` of ``{file, line, duplicate_of,
        raw}`` writes them (ASCII escapes), built in Arrow: the raw line escaped by replacing quotes and
        backslashes (a line ``special_lines`` names: in Python), the line numbers cast to text."""
        import numpy as np
        import pyarrow as pa
        import pyarrow.compute as pc

        enc = json.encoder.encode_basestring_ascii
        raw = lines.take(pa.array(dups))  # each ends with its newline: the line's end of JSON goes in its place
        esc = pc.replace_substring(pc.replace_substring(raw, "\\", "\\\\"), '"', '\\"')
        esc = pc.replace_substring(esc, "\n", '"}\n')
        special = run.special[i:][dups]
        if special.any():
            odd = [enc(raw[x].as_py()[:-1])[1:] + "}\n" for x in np.flatnonzero(special).tolist()]
            esc = pc.replace_with_mask(esc, pa.array(special), pa.array(odd, pa.string()))
        files = origin >> LINE_BITS
        heads = {f: f', "duplicate_of": {enc(self.files[f]["file"])[:-1]}:' for f in np.unique(files).tolist()}
        if len(heads) == 1:
            mid: Any = next(iter(heads.values()))
        else:
            at = {f: x for x, f in enumerate(heads)}
            idx = np.asarray([at[f] for f in files.tolist()], dtype=np.int32)
            mid = pa.DictionaryArray.from_arrays(pa.array(idx), pa.array(list(heads.values()))).cast(pa.string())
        ln = pc.cast(pa.array(linenos), pa.string())
        at_line = pc.cast(pa.array(origin & ((1 << LINE_BITS) - 1)), pa.string())
        head = f'{{"file": {enc(st["file"])}, "line": '
        return values_of(pc.binary_join_element_wise(head, ln, mid, at_line, '", "raw": "', esc, ""))

    def _family_ids(self, prompts: Any, fams: Any) -> tuple[Any, list[str], Any]:
        """Each row's family id: its family field, else its prompt's embedded family (once per distinct prompt);
        with the distinct prompts and each row's index into them."""
        import numpy as np
        import pyarrow as pa
        import pyarrow.compute as pc

        fam_cache, families = self._fam_cache, self.families
        if len(fam_cache) > _CACHE_MAX:
            fam_cache.clear()

        def fid(name: str) -> int:
            f = families.get(name)
            if f is None:
                f = families[name] = len(families)
            return f

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
        return ids[final.indices.to_numpy()], uniq, idx

    def _held(self, tids: Any) -> Any:
        """Each row's split (held out: True), once per distinct task_id."""
        import numpy as np
        import pyarrow.compute as pc

        enc = pc.dictionary_encode(tids).combine_chunks()
        cache, holdout = self._split_cache, self.holdout
        names = enc.dictionary.to_pylist()
        held = list(map(cache.get, names))  # most task_ids were seen in an earlier block
        if None in held:
            for k in np.flatnonzero(np.equal(held, None)).tolist():
                held[k] = split_of(names[k], holdout, cache)
        return np.asarray(held, dtype=np.int8)[enc.indices.to_numpy()]

    def _write_columns(self, seqs: Any, cols: dict[str, Any], uniq: list[str], code: Any) -> None:
        """Rows (Arrow columns) into their prompt's partition (``uniq``: the distinct prompts, ``code``: each row's
        index into them; the partition is the per-line path's, ``hash(prompt) % n_parts``, once per distinct prompt)."""
        import numpy as np
        import pyarrow as pa

        k_parts, n = self.n_parts, len(seqs)
        order, bounds = None, [0, n]
        if k_parts > 1:
            # hashing a distinct prompt costs less than finding it in a dict of every prompt seen (cache misses)
            where = np.fromiter((hash(x) % k_parts for x in uniq), dtype=np.int64, count=len(uniq))[code]
            order = np.argsort(where, kind="stable")  # the rows by partition, each in seq order: one take a column
            bounds = np.searchsorted(where[order], np.arange(k_parts + 1)).tolist()
        rows = [pa.array(seqs if order is None else seqs[order], pa.int64())]
        pick = None if order is None else pa.array(order)
        rows += [_flat(cols[c] if pick is None else cols[c].take(pick)) for c in ("prompt", "response", "task_id")]
        rows += [pa.nulls(n, pa.int64()), pa.nulls(n, pa.string())]  # conv_at, tests: none on this path
        batch = pa.record_batch(rows, schema=self.schema)
        for j, w in enumerate(self._writers if k_parts > 1 else self._writers[:1]):
            lo, hi = bounds[j], bounds[j + 1]
            if hi > lo:
                w.write_batch(batch.slice(lo, hi - lo))


def _flat(a: Any) -> Any:
    return a.combine_chunks() if hasattr(a, "combine_chunks") else a
