"""JSONL whose records span lines (stage: prep, for ``hermes_lab.logs.claude_code``,
``hermes_lab.logs.hermes_sessions`` and ``hermes_lab.logs.atropos``): every line read and checked as prep's
other JSONL, then grouped. Reads, never writes.

A Claude Code trace is one line a message (a session is its lines, in any order, across files); a Hermes export is
one line a session (a compression chain is several lines). Such a reader first goes through every line
(``read_lines``: bounded like the ingest's, a line over ``data.max_line_bytes`` never held whole; UTF-8, JSON and the
checks of ``hermes_lab.logs.lines.decode``), noting what groups them, then builds one group at a time from its
lines. ``Kept`` holds the decoded lines for that second step while their text stays within a byte budget
(a sixteenth of ``data.memory_budget_mb``); past it the lines are read again from the files, batch by batch
(``Kept.fetch``), so memory stays bounded whatever the input's size.

Run through ``hermes-lab prep``, not on its own.
"""

from __future__ import annotations

import gzip
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

from hermes_lab.logs.lines import BOM, decode, is_gzip
from hermes_lab.logs.record import Invalid

RAW_KEEP = 4096  # bytes of a rejected line kept in rejects.jsonl when it is cut


class Bad:
    """A line that is no JSON value prep accepts: its reason, and the raw text kept for rejects.jsonl."""

    __slots__ = ("cut", "error", "raw")

    def __init__(self, error: Invalid, raw: bytes, cut: bool = False):
        self.error, self.raw, self.cut = error, raw, cut


def _open(path: Path) -> tuple[BinaryIO, BinaryIO]:
    raw = open(path, "rb")  # noqa: SIM115  (closed by the caller)
    return raw, (gzip.GzipFile(fileobj=raw, mode="rb") if is_gzip(path) else raw)  # type: ignore[return-value]


def read_lines(path: Path, cap: int, want: Any = None) -> Iterator[tuple[int, int, Any]]:
    """(line number, bytes, decoded JSON value or Bad) for every non-blank line of a JSONL file (.gz read
    transparently); a blank line yields (n, 0, None). ``want``: a set of line numbers, the others skipped undecoded."""
    raw_f, f = _open(path)
    try:
        n = 0
        while True:
            try:
                line = f.readline(cap + 1)
                total = 0
                if len(line) > cap and not line.endswith(b"\n"):  # too long: skip the rest unread
                    total, chunk = len(line), line
                    while chunk and not chunk.endswith(b"\n"):
                        chunk = f.readline(1 << 20)
                        total += len(chunk)
            except (EOFError, OSError, zlib.error) as e:  # a truncated or corrupt .gz: what was read is kept
                yield n + 1, 0, Bad(Invalid("corrupt gzip stream", f"{type(e).__name__}: {e}"[:200]), b"")
                return
            if not line:
                return
            n += 1
            if want is not None and n not in want:
                continue
            if total:
                yield n, total, Bad(Invalid("line too long", f"{total} bytes > data.max_line_bytes {cap}"),
                                    line[:RAW_KEEP], True)  # fmt: skip
                continue
            line = line.rstrip(b"\r\n") if line.endswith(b"\n") else line.rstrip(b"\r")
            if line.startswith(BOM):
                line = line[3:]
            if not line.strip():
                yield n, 0, None
                continue
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError as e:
                yield n, len(line), Bad(Invalid("not valid UTF-8", f"{e.reason} at byte {e.start}"), line)
                continue
            try:
                yield n, len(line), decode(text)
            except Invalid as e:
                yield n, len(line), Bad(e, line)
    finally:
        raw_f.close()


class Kept:
    """The decoded lines a grouping reader will need again, by (file index, line number): held while their text
    stays within ``budget`` bytes, read again from the files (in order, a batch at a time) past it."""

    def __init__(self, files: list[Path], cap: int, budget: int):
        self.files, self.cap, self.budget = files, cap, max(1 << 20, budget)
        self.objs: dict[tuple[int, int], Any] | None = {}
        self.size = 0

    def keep(self, key: tuple[int, int], obj: Any, size: int) -> None:
        if self.objs is None:
            return
        self.size += size
        if self.size > self.budget:
            self.objs = None  # from now on: fetched from the files when needed
            return
        self.objs[key] = obj

    def batches(self, groups: list[Any], lines_of: Any, size_of: Any) -> Iterator[list[Any]]:
        """``groups`` in order, packed so that each batch's lines (``lines_of(group)`` -> keys, ``size_of(key)``)
        stay within the budget; with every line still held, one batch."""
        if self.objs is not None:
            yield groups
            return
        batch, size = [], 0
        for g in groups:
            s = sum(size_of(k) for k in lines_of(g))
            if batch and size + s > self.budget:
                yield batch
                batch, size = [], 0
            batch.append(g)
            size += s
        if batch:
            yield batch

    def fetch(self, keys: set[tuple[int, int]]) -> dict[tuple[int, int], Any]:
        """The decoded lines of ``keys``."""
        if self.objs is not None:
            return {k: self.objs[k] for k in keys}
        out: dict[tuple[int, int], Any] = {}
        by_file: dict[int, set[int]] = {}
        for fi, ln in keys:
            by_file.setdefault(fi, set()).add(ln)
        for fi, lns in sorted(by_file.items()):
            for ln, _, obj in read_lines(self.files[fi], self.cap, want=lns):
                out[(fi, ln)] = obj
        return out
