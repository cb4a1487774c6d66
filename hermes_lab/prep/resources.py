"""Distill stage (``hermes-lab prep``): what prep takes from the machine, shared by its parts.

Worker processes: ``usable_cores`` (how many help) and ``ForkPool`` (the conversation workers of
``hermes_lab.prep.conversations``, distill's review workers). Memory: ``arrow_pool`` (where prep's Arrow buffers come
from, set by ``hermes_lab.prep.run``) and ``trim_heap`` (the C heap's free pages given back between blocks and
partitions: peak RSS counts them). Reads and writes nothing.

Run through ``hermes-lab prep`` (``hermes_lab.prep.run.run_prep``), not on its own.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing.pool
import os
from typing import Any


def arrow_pool() -> Any:
    """The memory pool prep's Arrow buffers come from: jemalloc's, set to give freed pages back at once (decay 0:
    its own arenas, so a block's buffers do not stay between Python's longer-lived objects in the C heap), where
    pyarrow has it; else malloc's (mimalloc's pool keeps what was freed)."""
    import pyarrow as pa

    try:
        pool = pa.jemalloc_memory_pool()
        pa.jemalloc_set_decay_ms(0)
    except NotImplementedError:  # a pyarrow built without jemalloc
        return pa.system_memory_pool()
    return pool


def usable_cores() -> int:
    """The cores this process may run on (its affinity where the OS has one): how many worker processes help."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class ForkPool(multiprocessing.pool.Pool):
    """A pool of forked worker processes (the conversation workers, distill's review workers) whose worker
    handler thread waits on the workers' exits and the pool's own notices only. The stdlib's also wakes whenever
    the results pipe is readable, and a task's results (~2 MB for the conversations) keep it readable while the
    result thread reads them: the thread spun there, ~a quarter of prep's process CPU and a share of the GIL its
    main thread needs (without ``maxtasksperchild`` nothing it does waits on a result)."""

    def __init__(self, processes: int):
        super().__init__(processes, context=multiprocessing.get_context("fork"))

    def _get_sentinels(self) -> list[Any]:
        return [self._change_notifier._reader]  # type: ignore[attr-defined]


def trim_heap() -> None:
    """Give the C heap's free pages back to the system (glibc's ``malloc_trim``; elsewhere nothing): a block's
    buffers, once freed, stay with the allocator between longer-lived objects (the columns, the dedup index),
    and peak RSS counts them."""
    with contextlib.suppress(OSError, AttributeError):  # AttributeError: not glibc
        ctypes.CDLL(None).malloc_trim(0)
