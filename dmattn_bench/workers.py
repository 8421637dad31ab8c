"""Parallel work in spawned worker processes (GPU compilation and validation).

Triton compiles one kernel at a time per process and holds the GIL while doing it, so
compiling dozens of candidates is only parallel across processes. Workers are spawned (never
forked: a forked CUDA context is unusable), run the real kernels (the interpreter switch is
removed from their environment), and share Triton's on-disk cache with the parent, so a kernel
a worker compiled loads instantly in the timing process.

A job that raises returns its failure as data; a worker that dies takes only the jobs in
flight with it (they are reported as "crash").
"""

from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Callable, Iterable, TypeVar

T = TypeVar("T")
R = TypeVar("R")

MAX_WORKERS = 8  # each holds a CUDA context (~500 MB) and a workload's tensors


def _init_worker() -> None:
    os.environ.pop("TRITON_INTERPRET", None)


def worker_count(jobs: int) -> int:
    return max(1, min(MAX_WORKERS, os.cpu_count() or 1, jobs))


def parallel_map(fn: Callable[[T], R], items: Iterable[T], on_crash: Callable[[T, str], R],
                 on_done: Callable[[T, R], None] | None = None) -> list[R]:
    """`[fn(item) for item in items]` across worker processes, in order.

    Args:
        fn: a module-level function (it is pickled by name).
        items: picklable arguments.
        on_crash: builds the result for an item whose worker died (reason given).
        on_done: called in the parent as each result arrives.
    """
    items = list(items)
    results: list[R | None] = [None] * len(items)
    if not items:
        return []
    context = multiprocessing.get_context("spawn")
    pending = list(range(len(items)))
    while pending:
        try:
            with ProcessPoolExecutor(worker_count(len(pending)), mp_context=context,
                                     initializer=_init_worker) as pool:
                futures = {index: pool.submit(fn, items[index]) for index in pending}
                for index, future in futures.items():
                    results[index] = future.result()
                    pending.remove(index)
                    if on_done:
                        on_done(items[index], results[index])
        except BrokenProcessPool as exc:
            # the first unfinished job is the likeliest culprit: record it, retry the rest
            culprit = pending.pop(0)
            results[culprit] = on_crash(items[culprit], f"worker process died: {exc}")
            if on_done:
                on_done(items[culprit], results[culprit])
    return results  # type: ignore[return-value]
