"""Parallel work in spawned worker processes (GPU compilation and validation).

Triton compiles one kernel at a time per process and holds the GIL while doing it, so
compiling dozens of candidates is only parallel across processes. Workers are spawned (never
forked: a forked CUDA context is unusable), run the real kernels (the interpreter switch is
removed from their environment), and share Triton's on-disk cache with the parent, so a kernel
a worker compiled loads instantly in the timing process.

A job that raises returns its failure as data. When a pool process dies, the first unfinished
job is reported as "crash" (the likeliest culprit, not always the real one) and the rest rerun.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from typing import Callable, Iterable, TypeVar

T = TypeVar("T")
R = TypeVar("R")

# A pool process holds a CUDA context on its GPU and one job's tensors (a compile job's workload
# inputs and outputs, no reference): at most this share of a GPU's memory goes to them all.
POOL_GPU_MEMORY_SHARE = 0.5
CONTEXT_BYTES = 600 * 2**20  # a process's CUDA context and Triton's modules (H200: ~500 MB)
PROCESSES_PER_GPU_UNSIZED = 8  # where the caller gives no GPU memory (verify, a cluster tune's suites)


def _visible_list() -> list[str] | None:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return visible.split(",") if visible else None


def _pin_gpu(gpu: int | None, visible: list[str] | None) -> None:
    """In a child, before anything initialises CUDA: see only GPU `gpu` of the parent's set
    (`visible`, the parent's CUDA_VISIBLE_DEVICES), as cuda:0. The parent's own environment is
    never changed: other threads spawn children meanwhile (measuring workers start during the
    compile phase), and a child spawned inside a temporary change would inherit it."""
    if gpu is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = visible[gpu] if visible else str(gpu)


def ignore_interrupts() -> None:
    """Ctrl-C reaches every process of the terminal's group: a worker dying of it would pass for
    its job crashing. Only the parent handles it; it kills the workers as it stops."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


POOL_NICENESS = 5  # pool processes yield the CPU to the measuring workers, whose host work a timing holds


def _init_worker(slots, gpus: int, visible: list[str] | None) -> None:
    """Runs first in each pool process: real kernels, a lower CPU priority than the measuring
    workers' (`POOL_NICENESS`: a compile's nvcc or ptxas children inherit it), and with several
    GPUs a GPU of its own (processes are dealt out round-robin in start order)."""
    ignore_interrupts()
    try:
        os.nice(POOL_NICENESS)
    except OSError:  # a sandbox that refuses it: the pool runs at the measuring workers' priority
        pass
    os.environ.pop("TRITON_INTERPRET", None)
    if gpus > 1:
        with slots.get_lock():
            slot = slots.value
            slots.value += 1
        _pin_gpu(slot % gpus, visible)


def usable_cores() -> int:
    """The cores this process may run on (a container's or `taskset`'s share, not the host's)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def worker_count(jobs: int, gpus: int = 1, job_bytes: int = 0, gpu_bytes: int | None = None) -> int:
    """Pool processes for `jobs` jobs on `gpus` GPUs: a core each, less one per GPU for the
    process that times trials there (it overlaps the compiles, and a host starved of cores
    would show as GPU time); and on a GPU of `gpu_bytes` memory, no more than its
    POOL_GPU_MEMORY_SHARE holds of a CUDA context and `job_bytes` of a job's tensors each
    (without `gpu_bytes`, PROCESSES_PER_GPU_UNSIZED)."""
    gpus = max(1, gpus)
    processes = min(jobs, max(1, usable_cores() - gpus))
    if gpu_bytes:
        per_gpu = int(gpu_bytes * POOL_GPU_MEMORY_SHARE) // (CONTEXT_BYTES + max(0, job_bytes))
    else:
        per_gpu = PROCESSES_PER_GPU_UNSIZED
    return max(1, min(processes, max(1, per_gpu) * gpus))


@dataclass
class PoolStats:
    """Where the time of one or more `parallel_map` calls went (the tuner reports it per phase).

    `busy_s / (processes * wall)` says how well the pool was fed; `cpu_s / busy_s` how much of
    a job's time its process was on a core (below 1: waiting, e.g. for a core another process
    holds); `startup_s` is what a process costs before its first job (imports, CUDA context).
    """

    processes: int = 0  # the largest pool used
    jobs: int = 0
    busy_s: float = 0.0  # job wall time, summed over jobs
    cpu_s: float = 0.0  # job CPU time (user + system, subprocesses such as ptxas included)
    startups: list[float] = field(default_factory=list)  # per process: pool start to first job

    def record(self, timing: tuple[int, float, float, float], pool_start: float, seen: set[int]) -> None:
        pid, started, finished, cpu = timing
        self.jobs += 1
        self.busy_s += finished - started
        self.cpu_s += cpu
        if pid not in seen:
            seen.add(pid)
            self.startups.append(started - pool_start)

    def to_dict(self) -> dict:
        startup = sorted(self.startups)
        return {"processes": self.processes, "jobs": self.jobs, "busy_s": round(self.busy_s, 1),
                "cpu_s": round(self.cpu_s, 1),
                "startup_s_median": round(startup[len(startup) // 2], 2) if startup else None}


# A pool whose jobs were on a core at least this share of their time was bound by its cores ...
ON_CORE_SHARE = 0.8
# ... unless its processes were busy less than this share of the phase (they waited for jobs).
FED_SHARE = 0.7


def phase_bound(wall_s: float, pool: dict | None, cores: int, gpus: int = 1) -> dict:
    """What bounded one phase of a tune, `wall_s` long, run on `pool` (`PoolStats.to_dict`; None:
    the tuning process alone, which times the trials on the GPU one at a time) on a host of
    `cores` cores: the processes and cores, the share of their jobs' time on a core
    (`on_core`), how fully the jobs kept the processes busy over the phase (`fed`), and `bound`:
    "serial" (one process did the work in turn: the timing of trials on the GPU, or in the
    interpreter everything), "waiting" (jobs off their core: the GPU, the disk or a core another
    process held), "hand-over" (processes idle between jobs: start-up, rounds that wait on the
    GPU) or "cores" (every process busy on its core; `more_cores`: the host had cores the pool
    did not use, beyond the one `worker_count` leaves to each of the `gpus` timing processes).
    A phase that also ran work outside its pool (the winners phase's suites of a
    failed winner's runners-up, one at a time) reads that time as hand-over."""
    if pool is None or not pool["jobs"]:
        return {"processes": 1, "cores": cores, "on_core": None, "fed": None, "bound": "serial", "more_cores": False}
    processes = max(1, pool["processes"])
    on_core = pool["cpu_s"] / pool["busy_s"] if pool["busy_s"] > 0 else 0.0
    fed = pool["busy_s"] / (processes * wall_s) if wall_s > 0 else 0.0
    bound = "waiting" if on_core < ON_CORE_SHARE else "hand-over" if fed < FED_SHARE else "cores"
    return {"processes": processes, "cores": cores, "on_core": round(on_core, 2), "fed": round(fed, 2),
            "bound": bound, "more_cores": bound == "cores" and processes < cores - max(1, gpus)}


def _timed(fn: Callable[[T], R], item: T) -> tuple[R, tuple[int, float, float, float]]:
    """Runs in a pool process: `fn(item)` and (pid, start, end, CPU seconds) of the job."""
    before, started = os.times(), time.time()
    result = fn(item)
    after = os.times()
    cpu = sum(a - b for a, b in zip(after[:4], before[:4]))  # user, system, children's user, system
    return result, (os.getpid(), started, time.time(), cpu)


def abandon_pool(pool: ProcessPoolExecutor) -> None:
    """After Ctrl-C: the pool's processes ignore it (`ignore_interrupts`), so kill them rather
    than wait, on leaving the `with`, for every job already submitted."""
    pool.shutdown(wait=False, cancel_futures=True)
    for process in list((getattr(pool, "_processes", None) or {}).values()):  # no public handle on them
        process.kill()


class ProcessPool:
    """Spawned processes kept for several `parallel_map` calls: a tune's compile rounds and its
    winners' suites, of every backend it tunes. A process costs seconds before its first job
    (imports, a CUDA context: ~5 s on the H200's host), which a pool per call paid again each
    widening round. The processes start as jobs arrive, `processes` at most (`worker_count`);
    when one dies, the next call starts a fresh set."""

    def __init__(self, processes: int, gpus: int = 1):
        self.processes = max(1, processes)
        self.gpus = gpus
        self._executor: ProcessPoolExecutor | None = None
        self.started = 0.0  # when the live set of processes was asked for
        self.seen: set[int] = set()  # pids that ran a job: their start-up is counted once

    def executor(self) -> ProcessPoolExecutor:
        if self._executor is not None and getattr(self._executor, "_broken", False):
            self.discard()  # a process died between calls (e.g. killed while idle): no job of the next call is to blame
        if self._executor is None:
            context = multiprocessing.get_context("spawn")
            self._executor = ProcessPoolExecutor(self.processes, mp_context=context, initializer=_init_worker,
                                                 initargs=(context.Value("i", 0), self.gpus, _visible_list()))
            self.started, self.seen = time.time(), set()
        return self._executor

    def discard(self, kill: bool = False) -> None:
        """Lets the processes go (`kill`: at once, e.g. after Ctrl-C, where they ignore it and
        would finish every job already submitted first); the next call starts new ones."""
        executor, self._executor = self._executor, None
        if executor is not None:
            if kill:
                abandon_pool(executor)
            else:
                executor.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> "ProcessPool":
        return self

    def __exit__(self, kind, value, traceback) -> None:
        self.discard(kill=kind is not None)


def leaders(kernels_per_job: list[list[tuple]]) -> list[tuple[int, ...]]:
    """Per job, the earlier jobs it waits for: for each kernel it needs, the first job needing
    it compiles it (into Triton's on-disk cache) and the later ones load it from there, instead
    of compiling it again in other processes at the same time. On the 2x H200 the 8-process
    compile phase's CPU time fell from 630 to 570 s with it; the 16-process one did not move
    (684 -> 694 s), its extra cost being slower cores, not duplicates."""
    first: dict[tuple, int] = {}
    after = []
    for index, kernels in enumerate(kernels_per_job):
        after.append(tuple(sorted({first.setdefault(kernel, index) for kernel in kernels} - {index})))
    return after


def parallel_map(fn: Callable[[T], R], items: Iterable[T], on_crash: Callable[[T, str], R],
                 on_done: Callable[[T, R], None] | None = None, gpus: int = 1,
                 stats: PoolStats | None = None, after: list[tuple[int, ...]] | None = None,
                 pool: ProcessPool | None = None) -> list[R]:
    """`[fn(item) for item in items]` across worker processes, results in item order.

    Args:
        fn: a module-level function (it is pickled by name).
        items: picklable arguments.
        on_crash: builds the result for an item whose worker died (reason given).
        on_done: called in the parent as each result arrives.
        gpus: GPUs to spread the processes over (cuda:0..gpus-1, each process sees one as
            cuda:0); as many processes as `worker_count` gives. 1: inherit.
        stats: accumulates where the time went.
        after: per item, the indices of earlier items it must wait for (e.g. the item that
            compiles a kernel it shares); items start in order as soon as they may.
        pool: the processes to run on, kept after the call (None: a pool for this call alone).
    """
    items = list(items)
    after = after or [()] * len(items)
    if any(index >= item for item, waits in enumerate(after) for index in waits):
        raise ValueError("after: an item may only wait for earlier items")
    results: list[R | None] = [None] * len(items)
    if not items:
        return []
    if pool is None:
        with ProcessPool(worker_count(len(items), gpus), gpus) as own:
            return parallel_map(fn, items, on_crash, on_done, gpus, stats, after, own)
    dependents: dict[int, list[int]] = {}
    for item, waits in enumerate(after):
        for index in waits:
            dependents.setdefault(index, []).append(item)
    pending = list(range(len(items)))  # unfinished, in item order
    finished: set[int] = set()
    stats = stats if stats is not None else PoolStats()
    while pending:
        stats.processes = max(stats.processes, min(pool.processes, len(pending)))
        submitted: dict[int, None] = {}  # in submission order
        executor = pool.executor()
        running: dict[Future, int] = {}

        def submit_if_ready(index: int) -> None:
            if index not in submitted and finished.issuperset(after[index]):
                submitted[index] = None
                running[executor.submit(_timed, fn, items[index])] = index

        try:
            for index in pending:
                submit_if_ready(index)
            while running:
                done, _ = wait(running, return_when=FIRST_COMPLETED)
                for future in sorted(done, key=running.__getitem__):
                    index = running.pop(future)
                    results[index], timing = future.result()
                    stats.record(timing, pool.started, pool.seen)
                    pending.remove(index)
                    finished.add(index)
                    if on_done:
                        on_done(items[index], results[index])
                    for later in dependents.get(index, ()):
                        submit_if_ready(later)
        except KeyboardInterrupt:
            pool.discard(kill=True)
            raise
        except BrokenProcessPool as exc:
            # the earliest submitted unfinished job is the likeliest culprit: record it, retry the
            # rest in a fresh set of processes
            pool.discard()
            culprit = next(index for index in submitted if index in pending)
            pending.remove(culprit)
            finished.add(culprit)
            results[culprit] = on_crash(items[culprit], f"worker process died: {exc}")
            if on_done:
                on_done(items[culprit], results[culprit])
    return results  # type: ignore[return-value]


# -- one persistent worker per GPU: isolation for measuring candidates ---------------------------


class WorkerCrashed(RuntimeError):
    """The worker process died while running a job (segfault, abort, killed)."""


class WorkerTimedOut(RuntimeError):
    """The job did not finish within its time limit; the worker was killed."""


def _serve(conn, interpret: bool, gpu: int | None, visible: list[str] | None) -> None:
    """Worker loop: run (fn, args) requests until the pipe closes."""
    ignore_interrupts()
    _pin_gpu(gpu, visible)
    if not interpret:
        os.environ.pop("TRITON_INTERPRET", None)
    while True:
        try:
            fn, args = conn.recv()
        except EOFError:
            return
        try:
            conn.send(("ok", fn(*args)))
        except Exception as exc:  # noqa: BLE001 - reported to the parent as data
            conn.send(("error", f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"))


class Worker:
    """A reusable subprocess that runs jobs one at a time, with a per-job timeout.

    A job that crashes the process (illegal memory access that aborts, segfault, os.abort) or
    outlives its timeout costs only itself: the caller gets WorkerCrashed / WorkerTimedOut and
    the next call starts a fresh process. The CUDA context of the tuning session therefore never
    lives in the parent.
    """

    def __init__(self, interpret: bool, gpu: int | None = None):
        self.interpret = interpret
        self.gpu = gpu  # pin the worker to one GPU (CUDA_VISIBLE_DEVICES), or inherit
        self._process = None
        self._conn = None
        self.restarts = 0
        # stop() runs in the parent's main thread (end of a tune, Ctrl-C) while a measuring
        # thread may be in call() finding the process gone and stopping it too
        self._stopping = threading.Lock()

    def _start(self) -> None:
        context = multiprocessing.get_context("spawn")
        parent, child = context.Pipe()
        self._process = context.Process(target=_serve, args=(child, self.interpret, self.gpu, _visible_list()),
                                        daemon=True)
        self._process.start()
        child.close()
        self._conn = parent

    def stop(self) -> None:
        """Kills the process (the next call starts a new one); safe from several threads."""
        with self._stopping:
            process, conn = self._process, self._conn
            self._process = self._conn = None
        if process is not None:
            if process.is_alive():
                process.kill()
            process.join(timeout=10)
            conn.close()

    def call(self, fn: Callable, args: tuple, timeout: float):
        """`fn(*args)` in the worker. Raises WorkerCrashed, WorkerTimedOut or RuntimeError (job error)."""
        if self._process is None or not self._process.is_alive():
            self.stop()
            self._start()
        try:
            self._conn.send((fn, args))
        except OSError:  # the process died since the liveness check
            self.stop()
            self.restarts += 1
            raise WorkerCrashed("worker process died before the job was sent") from None
        if not self._conn.poll(timeout):
            self.stop()
            self.restarts += 1
            raise WorkerTimedOut(f"no result after {timeout:.0f} s; worker killed")
        try:
            kind, payload = self._conn.recv()
        except (EOFError, ConnectionResetError, OSError):
            process = self._process  # None if the parent stopped it meanwhile (Ctrl-C)
            if process is not None:
                process.join(timeout=10)
            code = process.exitcode if process is not None else None
            self.stop()
            self.restarts += 1
            raise WorkerCrashed(f"worker process died (exit code {code})") from None
        if kind == "error":
            raise RuntimeError(payload)
        return payload
