"""Small helpers shared by the stages: line-numbered JSONL reading, THE atomic JSON writer, safe names.

Every reader of a JSONL file the workbench wrote (train logs, review queues, request logs) wants the
same thing: objects with their 1-based line numbers, blank lines skipped, and an error that names the
file and line. User input (trajectories) goes through prep's own, more forgiving ingest instead.

``write_json_atomic`` writes every JSON file the round runner reads back (prep's summary.json, train's
health/eval/run.json, regression.json, ab_report.json, progress.json, state.json): a reader sees the old
file or the new one, never half of one, and a crash or power cut after it returns cannot lose it.

``safe_name`` and ``plot_label`` turn free text from the data (a task ``family`` such as ``c++``, ``$x^2$``
or ``..``) into something fit for an MLflow metric name or a file name, or a matplotlib label, at the point
of use; the data itself keeps the original text.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def iter_objects(path: str | os.PathLike[str]) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) for each non-blank line; ValueError naming file:line otherwise."""
    p = Path(path)
    with p.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{p}:{lineno}: not valid JSON ({e.msg})") from None
            if not isinstance(rec, dict):
                raise ValueError(f"{p}:{lineno}: expected a JSON object, got {type(rec).__name__}")
            yield lineno, rec


def _default_mode() -> int:
    mask = os.umask(0)  # read the umask (at import, before any thread could create files)
    os.umask(mask)
    return 0o666 & ~mask


_MODE = _default_mode()


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms that cannot open a directory
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover - file systems without directory fsync
        pass
    finally:
        os.close(fd)


def write_text_atomic(path: str | os.PathLike[str], text: str) -> Path:
    """Write ``text`` via a uniquely named temp file in the same directory, fsync, rename, fsync the dir.

    The temp name is unique (mkstemp), so two writers of one path never write into each other's temp
    file; the last rename wins whole. On any error the temp file is removed and the old file is intact."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.", suffix=".tmp")
    try:
        if hasattr(os, "fchmod"):  # mkstemp makes it 0600; give it the mode open() would
            os.fchmod(fd, _MODE)
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    _fsync_dir(p.parent)  # the rename itself must survive a crash too
    return p


def write_json_atomic(path: str | os.PathLike[str], data: Any) -> Path:
    """Write ``data`` as indented JSON atomically (see ``write_text_atomic``): a reader never sees half a file.

    The JSON is built before the temp file is opened, so an unserialisable value leaves nothing behind."""
    return write_text_atomic(path, json.dumps(data, indent=2, default=str))


# --------------------------------------------------------------------------------------------- names
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def safe_name(text: Any, max_len: int = 64) -> str:
    """``text`` as an identifier fit for an MLflow metric name segment and a file name on any platform.

    Keeps ``[A-Za-z0-9_.-]``, replaces every other run of characters by ``_``, never starts with a dot
    (no ``..`` or hidden files), and is never empty. When anything had to change, a short hash of the
    original is appended, so two families that differ only in unsafe characters (``c++``, ``c**``) stay
    two names. A name that needed no change is returned as is."""
    s = str(text)
    if s and len(s) <= max_len and not _UNSAFE.search(s) and not s.startswith("."):
        return s
    body = _UNSAFE.sub("_", s).lstrip(".")[:max_len].strip("_") or "_"
    digest = hashlib.sha1(s.encode("utf-8", "surrogatepass")).hexdigest()[:6]
    return f"{body}-{digest}"


def plot_label(text: Any, max_len: int = 40) -> str:
    """``text`` fit for a matplotlib label or legend entry: ``$`` escaped (no mathtext), no control
    characters or line breaks, at most ``max_len`` characters, and no leading ``_`` (legend hides those)."""
    s = _CONTROL.sub(" ", str(text).encode("utf-8", "surrogatepass").decode("utf-8", "replace"))
    if len(s) > max_len:
        s = s[: max_len - 1] + "…"
    s = s.replace("$", r"\$")  # matplotlib shows "\$" as "$" outside mathtext; nothing else is special
    return " " + s if s.startswith("_") else s
