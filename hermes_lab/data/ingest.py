"""Distill stage, part 1 (``hermes_lab.data.prep``): read every line of every input, validate it, dedupe it, spill it.

Reads the trajectory files prep was given (``.jsonl`` or ``.jsonl.gz``, read transparently; never written,
truncated or moved). Writes into prep's output dir, through temp files renamed into place at the end:
``accepted.jsonl``, ``negatives.jsonl``, ``duplicates.jsonl``, ``rejects.jsonl`` (see ``hermes_lab.data.prep``);
and, in a temp dir prep removes, the accepted records' text partitioned by prompt (Arrow IPC streams) for
``hermes_lab.data.distill``.

Memory is bounded: lines are validated in batches (at most ``BATCH_LINES`` lines or a sixteenth of
``data.memory_budget_mb``), duplicates are found through a 16-byte blake2b digest of (prompt, response,
task_id) held in sorted numpy runs (``DigestIndex``), and what is kept for the whole input is a handful of
fixed-size fields per accepted record (reward, origin, family id, split, review hash, duplicate count: ~64 bytes).

Validation, every field of every line (a bad line is a reject with its number and reason, never a
traceback): valid UTF-8; JSON with no NaN/Infinity, no number that overflows a double or that Python
refuses to convert (an integer of more than 4300 digits), no key twice in one object (parsers disagree on
which value wins), no lone surrogate escape in any string or key, not nested beyond Python's recursion
limit; an object with prompt (non-empty string), response (string), reward (a number in 0..scale, not a
bool), task_id (non-empty string, or an integer, kept as text), family (a string or null, optional), and
optionally the task's tests (``tests``, ``entry_point``, MBPP's ``test_list``, HumanEval's ``test``, APPS'
``input_output``: ``hermes_lab.sandbox.specs.parse_tests``); tests that do not parse reject the line ("bad
tests", naming the test), tests that do are kept with the record, normalised, for the tests reward.

Run through ``hermes-lab prep --input FILE... --output DIR`` (``hermes_lab.data.prep.run_prep``), not on its own.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import math
import os
import zlib
from array import array
from collections import Counter
from pathlib import Path
from typing import Any, BinaryIO

from hermes_lab.sandbox.specs import SpecError, parse_tests
from hermes_lab.tasks import suite as tasks

BOM = b"\xef\xbb\xbf"
REQUIRED = ("prompt", "response", "reward", "task_id")
RAW_KEEP = 4096  # bytes of a too-long line kept in rejects.jsonl
PROGRESS_MIN = 32 << 20  # show a tqdm bar for files from this size on
BATCH_LINES = 16384  # lines validated before one vectorised duplicate lookup
LINE_BITS = 40  # origin = file index << 40 | line number
SINKS = ("accepted", "negatives", "duplicates", "rejects")
_CACHE_MAX = 200_000  # entries of the per-prompt family / per-task split caches before they are cleared


class Bad(ValueError):
    def __init__(self, reason: str, detail: str = ""):
        super().__init__(reason)
        self.reason, self.detail = reason, detail


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


def _lone_surrogate(obj: Any) -> str | None:
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


def decode(text: str) -> Any:
    """The JSON value of one line; Bad (reason, detail) for anything the checks above refuse."""
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
    if ("\\ud" in text or "\\uD" in text) and (field := _lone_surrogate(obj)) is not None:
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


def review_rank(seed: int | Any, rid: str) -> int:
    """The review sample's seeded hash rank of a record: the first 8 bytes of sha1(f"{seed}:{rid}").
    ``seed`` may be ``hashlib.sha1(f"{seed}:".encode())``, copied instead of rehashing the prefix."""
    h = hashlib.sha1(f"{seed}:".encode()) if isinstance(seed, int) else seed.copy()
    h.update(rid.encode())
    return int.from_bytes(h.digest()[:8], "big")


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


# ------------------------------------------------------------------------------------------- ingest
class Ingest:
    """Streams every line of every file into the four JSONL sinks, the fixed-size columns and the spill."""

    def __init__(self, tmp: Path, scale: float, cap: int, budget_bytes: int, n_parts: int, cfg: Any):
        """``tmp``: where the sinks are written before ``commit`` moves them, and the spill lives."""
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
        self.schema = pa.schema(
            [
                ("seq", pa.int64()),
                ("prompt", pa.string()),
                ("response", pa.string()),
                ("task_id", pa.string()),
                ("tests", pa.string()),
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
    def _reject(self, st: dict[str, Any], lineno: int, reason: str, detail: str, raw: bytes, **extra: Any) -> None:
        st["rejected"] += 1
        st["by_reason"][reason] += 1
        if len(st["first_errors"]) < 5:
            st["first_errors"].append(f"line {lineno}: {reason}" + (f" ({detail})" if detail else ""))
        rec = {
            "file": st["file"],
            "line": lineno,
            "reason": reason,
            "detail": detail,
            "raw": raw.decode("utf-8", errors="backslashreplace"),
            **extra,
        }
        self.sinks["rejects"].write(json.dumps(rec) + "\n")

    # ---------------------------------------------------------------------------------------- scan
    def scan(self, path: Path, role: str, round_no: int | None) -> dict[str, Any]:
        from tqdm import tqdm

        st: dict[str, Any] = {
            "file": str(path),
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
                    prompt, response, reward, task_id, fam = check_record(obj, scale)
                    tests_json = record_tests(obj, prompt)
                except Bad as e:
                    self._reject(st, lineno, e.reason, e.detail, line)
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
        self._flush(st, fidx, role, pending)
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
        parts: list[tuple[list[int], list[str], list[str], list[str], list[str | None]]] = [
            ([], [], [], [], []) for _ in range(self.n_parts)
        ]
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
            part[4].append(tests_json)
            seq += 1
            text_bytes += len(joined)
        self.n, self.text_bytes = seq, self.text_bytes + text_bytes
        if new_rows:
            idx = np.asarray(new_rows, dtype=np.int64)
            self.index.add(keys[idx, 0].copy(), keys[idx, 1].copy(), np.asarray(new_seqs, dtype=np.int64))
        pa = self.pa
        for w, (seqs, ps, rs, ts, tj) in zip(self._writers, parts):
            if seqs:
                w.write_batch(
                    pa.record_batch(
                        [
                            pa.array(seqs, pa.int64()),
                            pa.array(ps, pa.string()),
                            pa.array(rs, pa.string()),
                            pa.array(ts, pa.string()),
                            pa.array(tj, pa.string()),
                        ],
                        schema=self.schema,
                    )
                )
        st["accepted"] += len(new_rows)
        st["duplicates"] += dups
