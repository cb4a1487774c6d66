"""The human review label store: ``runs/review/labels.jsonl``, shared by rounds and reviewers (review.gate).

Reads and writes ``runs/review/labels.jsonl`` (append only, one fsync'd line per click) and, when it finds a
corrupt line, ``labels.jsonl.quarantine`` (the line's file, number, reason and raw bytes, once) and
``labels.jsonl.torn`` (a torn last line cut off by the next writer). Used by the review widget
(``hermes_lab.review.app``) and the review gate (``hermes-lab review``), which re-exports it.

A click is one JSON line written with a single write() then flush+fsync, so a dead kernel
loses at most the click in flight. Nothing is rewritten: undo appends a tombstone (``undo_of`` = the
undone ``label_id``); a relabel appends a newer record, which wins. A torn last line (the kernel died
mid-write) is ignored with a warning; the next writer moves it to ``labels.jsonl.torn`` and cuts it off,
since no one ever saw it acknowledged. A corrupt line elsewhere (a bad merge, a hand edit) is skipped and
reported with its file and line; its raw bytes are copied once to ``labels.jsonl.quarantine``. The store is
not rewritten for it (no rewrite can race a reviewer's append), and reads and appends go on.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import uuid
import warnings
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from hermes_lab.core.layout import RunsLayout

# relative to the project root (hermes_lab.core.paths), not to the cwd
DEFAULT_STORE = RunsLayout(Path("runs")).labels.as_posix()


@dataclass
class LoadResult:
    records: list[dict[str, Any]]
    truncated: bool = False
    message: str = ""
    quarantined: list[dict[str, Any]] = field(default_factory=list)  # {file, line, reason, sha256, raw}


def read_labels(path: str | os.PathLike[str], quarantine: bool = True) -> LoadResult:
    """All records of a store, in write order. A torn last line is dropped and reported, not fatal; a
    corrupt line elsewhere is skipped, reported with its file and line, and copied (once) to
    ``<store>.quarantine`` with its raw bytes. The store itself is never rewritten for it."""
    p = Path(path)
    if not p.exists():
        return LoadResult([])
    lines = p.read_bytes().split(b"\n")
    tail = lines.pop()  # b"" when the file ends in a newline, as every complete write does
    records = []
    bad: list[dict[str, Any]] = []
    for i, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            rec = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            bad.append(_bad_line(p, i, raw, "not valid JSON"))
            continue
        if not isinstance(rec, dict) or not {"label_id", "review_id", "reviewer"} <= rec.keys():
            bad.append(_bad_line(p, i, raw, "not a label record (needs label_id, review_id, reviewer)"))
            continue
        records.append(rec)
    result = LoadResult(records, quarantined=bad)
    notes = []
    if bad:
        where = ", ".join(f"{p}:{b['line']} ({b['reason']})" for b in bad[:5]) + (" ..." if len(bad) > 5 else "")
        notes.append(
            f"skipped {len(bad)} corrupt label line(s): {where}; their raw bytes are in {_quarantine_path(p)}. "
            "The other labels are loaded and new labels are appended as usual."
        )
        if quarantine:
            _quarantine(p, bad)
    if tail.strip():
        try:
            records.append(json.loads(tail))  # complete record, only its newline is missing
        except (json.JSONDecodeError, UnicodeDecodeError):
            result.truncated = True
            notes.append(
                f"{p}: ignored a truncated last line ({len(tail)} bytes): the kernel stopped "
                f"mid-write. {len(records)} records loaded; that last click is lost, redo it."
            )
    result.message = " ".join(notes)
    for note in notes:
        warnings.warn(note, stacklevel=2)
    return result


def _bad_line(p: Path, line: int, raw: bytes, reason: str) -> dict[str, Any]:
    return {
        "file": str(p),
        "line": line,
        "reason": reason,
        "sha256": hashlib.sha256(raw).hexdigest(),
        "raw": raw.decode("utf-8", errors="backslashreplace"),
    }


def _quarantine_path(p: Path) -> Path:
    return p.with_name(p.name + ".quarantine")


def _quarantine(p: Path, bad: list[dict[str, Any]]) -> None:
    """Append the corrupt lines not yet quarantined (same line, same bytes) to <store>.quarantine, under a lock."""
    q = _quarantine_path(p)
    try:
        fd = os.open(q, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    except OSError:  # a read-only store is still readable: report, do not fail
        return
    try:
        _lock(fd)
        with open(q, "rb") as f:
            known = set()
            for line in f:
                with contextlib.suppress(ValueError, TypeError, KeyError):
                    rec = json.loads(line)
                    known.add((rec["line"], rec["sha256"]))
        new = [b for b in bad if (b["line"], b["sha256"]) not in known]
        if new:
            ts = datetime.now(timezone.utc).isoformat(timespec="seconds")
            os.write(fd, "".join(json.dumps({**b, "quarantined_at": ts}) + "\n" for b in new).encode())
            os.fsync(fd)
    finally:
        os.close(fd)


def current_labels(records: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    """(review_id, reviewer) -> the label in force: the latest record not undone by a tombstone."""
    undone = {r["undo_of"] for r in records if r.get("undo_of")}
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for r in records:
        if r.get("undo_of") or r["label_id"] in undone:
            continue
        out[(r["review_id"], r["reviewer"])] = r
    return out


def _lock(fd: int) -> None:
    try:
        import fcntl  # Unix; several reviewers' kernels may append to one shared store
    except ImportError:  # pragma: no cover - Windows: single writer assumed
        return
    fcntl.flock(fd, fcntl.LOCK_EX)  # released when fd is closed


class LabelStore:
    """Append-only JSONL of labels. ``records`` holds everything this process read or wrote."""

    def __init__(self, path: str | os.PathLike[str] | None = None, scale: float = 5.0):
        from hermes_lab.core.paths import resolve

        self.path, self.scale = Path(path) if path else resolve(DEFAULT_STORE), float(scale)
        loaded = read_labels(self.path)
        self.records, self.recovered = loaded.records, loaded.message

    def _repair_tail(self, fd: int) -> None:
        # under the lock: cut a torn tail (saved aside) so the next record starts on its own line
        data = self.path.read_bytes()
        if not data or data.endswith(b"\n"):
            return
        cut = data.rfind(b"\n") + 1
        try:
            json.loads(data[cut:])
            os.write(fd, b"\n")  # a complete record missing only its newline: keep it
        except (json.JSONDecodeError, UnicodeDecodeError):
            with open(self.path.with_name(self.path.name + ".torn"), "ab") as f:
                f.write(data[cut:] + b"\n")
            os.truncate(self.path, cut)

    def make_record(
        self,
        review_id: str,
        reviewer: str,
        label: float | None,
        *,
        mode: str = "score",
        note: str = "",
        simulated: bool = False,
        undo_of: str | None = None,
    ) -> dict[str, Any]:
        if label is not None:
            label = float(label)
            if not 0 <= label <= self.scale:
                raise ValueError(f"label {label} outside 0..{self.scale:g}")
            if mode == "passfail" and label not in (0.0, self.scale):
                raise ValueError(f"pass/fail labels are 0 or {self.scale:g}, got {label}")
        if not reviewer:
            raise ValueError("reviewer id is empty: every label records who gave it")
        return {
            "label_id": uuid.uuid4().hex[:16],
            "review_id": str(review_id),
            "reviewer": reviewer,
            "label": label,
            "mode": mode,
            "note": note,
            "simulated": bool(simulated),
            "undo_of": undo_of,
            "ts": datetime.now(timezone.utc).isoformat(timespec="milliseconds"),
        }

    def append_many(self, recs: list[dict[str, Any]]) -> None:
        """One unbuffered write() and one fsync per batch (per click in the app): a crash can tear only
        the last line, which the next load ignores and the next append cuts off."""
        if not recs:
            return
        data = "".join(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n" for r in recs).encode("utf-8")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        created = not self.path.exists()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            _lock(fd)
            self._repair_tail(fd)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        if created:  # the new directory entry must survive a crash too
            try:
                dfd = os.open(self.path.parent, os.O_RDONLY)
                os.fsync(dfd)
                os.close(dfd)
            except OSError:  # pragma: no cover - platforms without directory fsync
                pass
        self.records.extend(recs)

    def append(self, review_id: str, reviewer: str, label: float, **kw: Any) -> dict[str, Any]:
        rec = self.make_record(review_id, reviewer, label, **kw)
        self.append_many([rec])
        return rec

    def undo(self, reviewer: str) -> dict[str, Any] | None:
        """Tombstone ``reviewer``'s latest label in force; returns the undone record (None: nothing to undo)."""
        live = current_labels(self.records)
        mine = [r for (_, who), r in live.items() if who == reviewer]
        if not mine:
            return None
        order = {r["label_id"]: i for i, r in enumerate(self.records)}
        last = max(mine, key=lambda r: order[r["label_id"]])
        self.append_many(
            [
                self.make_record(
                    last["review_id"],
                    reviewer,
                    None,
                    mode=last.get("mode", "score"),
                    simulated=last.get("simulated", False),
                    undo_of=last["label_id"],
                )
            ]
        )
        return last

    def labelled_ids(self, reviewer: str) -> set[str]:
        return {rid for (rid, who) in current_labels(self.records) if who == reviewer}
