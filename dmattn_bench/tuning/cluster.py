"""Tuning across the GPUs of a Ray cluster (optional extra `cluster`).

The tuner needs measuring slots with two methods, `call(fn, args, timeout)` and `stop()`
(`workers.Worker` on one host). `RayWorker` is such a slot backed by a Ray actor that holds one
GPU, on whichever node Ray places it. Everything else stays with the driver: the plan, the
trial journal (so `--resume` works as on one host), the winners and the table. The driver
needs the same GPU model as the cluster's nodes: it reads its own fingerprint, limits and
defaults for the table.

Failure handling matches the local workers. A job that outlives its timeout gets its actor
killed (`WorkerTimedOut`). An actor that dies (abort, segfault, node lost), or any other Ray
failure of a call, raises `WorkerCrashed`. Either way the next call starts a fresh actor, so a
faulting candidate costs only its own trial. Actors are started, and wait for a free GPU,
before any trial clock runs (`ACTOR_START_TIMEOUT_S`): queueing is never journaled as a timeout.

Kernels are compiled by each actor on first launch, into that node's Triton cache; the
driver's parallel compile phase is skipped, since its cache would not reach other nodes.
"""

from __future__ import annotations

import os
from typing import Callable

from dmattn_bench.errors import DmattnError
from dmattn_bench.tuning.workers import WorkerCrashed, WorkerTimedOut

FORWARDED_ENV_PREFIXES = ("DMATTN_", "PYTHONPATH")  # plugins and fault injection reach the actors
# How long an actor may wait for a GPU and start before the tune gives up on the cluster. Kept
# apart from --trial-timeout so that a queue for GPUs is never journaled as a candidate's timeout.
ACTOR_START_TIMEOUT_S = 600.0


def _import_ray():
    try:
        import ray
    except ModuleNotFoundError:
        raise DmattnError("--ray needs Ray", "pip install 'dmattn-bench[cluster]'") from None
    return ray


class ClusterError(DmattnError):
    """The cluster could not be reached or could not start a measuring actor."""


class _Slot:
    """The actor body: runs jobs one at a time; a job that raises comes back as data."""

    def ready(self) -> bool:
        return True

    def run(self, fn: Callable, args: tuple):
        try:
            return "ok", fn(*args)
        except Exception as exc:  # noqa: BLE001 - reported to the driver as data
            return "error", f"{type(exc).__name__}: {_first_line(exc)}"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _actor_env(interpret: bool) -> dict[str, str]:
    env = {name: value for name, value in os.environ.items() if name.startswith(FORWARDED_ENV_PREFIXES)}
    # an actor process starts with this environment, before any kernel module is imported
    env["TRITON_INTERPRET"] = "1" if interpret else "0"
    return env


class RayWorker:
    """A measuring slot on a Ray actor holding one GPU (none for interpreter actors)."""

    def __init__(self, interpret: bool):
        self.interpret = interpret
        self.restarts = 0
        self._actor = None

    def start(self, timeout: float = ACTOR_START_TIMEOUT_S) -> None:
        """Starts the actor and waits until it runs (placed on a GPU, environment set up).

        Raises:
            ClusterError: it did not start within `timeout` or its set-up failed.
        """
        ray = _import_ray()
        from ray.exceptions import GetTimeoutError, RayError

        slot = ray.remote(_Slot).options(
            num_gpus=0 if self.interpret else 1,
            num_cpus=1,
            max_restarts=0,  # a dead actor is replaced by the driver, which records why
            runtime_env={"env_vars": _actor_env(self.interpret)},
        )
        self._actor = slot.remote()
        try:
            ray.get(self._actor.ready.remote(), timeout=timeout)
        except (GetTimeoutError, RayError) as exc:
            self.stop()
            reason = "no GPU became free" if isinstance(exc, GetTimeoutError) else _first_line(exc)
            raise ClusterError(f"a measuring actor did not start within {timeout:.0f} s: {reason}",
                               "check `ray status` for free GPUs and that every node can import dmattn_bench") from None

    def stop(self) -> None:
        """Kills the actor (the next call starts a new one)."""
        if self._actor is not None:
            _import_ray().kill(self._actor, no_restart=True)
        self._actor = None

    def call(self, fn: Callable, args: tuple, timeout: float):
        """`fn(*args)` on the actor; the clock starts once the actor runs.

        Raises:
            WorkerCrashed: the actor died, or Ray failed the call for any other reason.
            WorkerTimedOut: no result within `timeout` (the actor is killed).
            RuntimeError: the job raised (its one-line reason).
            ClusterError: a replacement actor could not be started.
        """
        ray = _import_ray()
        from ray.exceptions import GetTimeoutError, RayActorError, RayError

        if self._actor is None:
            self.start()
        reference = self._actor.run.remote(fn, args)
        try:
            kind, payload = ray.get(reference, timeout=timeout)
        except GetTimeoutError:
            self.stop()
            self.restarts += 1
            raise WorkerTimedOut(f"no result after {timeout:.0f} s; actor killed") from None
        except RayError as exc:  # the actor died (RayActorError) or Ray failed the task otherwise
            if isinstance(exc, RayActorError):
                self._actor = None
            else:
                self.stop()
            self.restarts += 1
            what = "actor died" if isinstance(exc, RayActorError) else f"Ray error {type(exc).__name__}"
            raise WorkerCrashed(f"{what}: {_first_line(exc)[:200]}") from None
        if kind == "error":
            raise RuntimeError(payload)
        return payload


def _ray_messages_to_stderr() -> None:
    """Ray prints the cluster's error messages (e.g. "A worker died ...", which a crashing
    candidate causes on purpose) to the driver's stdout, where they would corrupt
    `--format json`. They go to stderr instead, with the other progress and warnings (Ray 2.60
    routes them through `ray._private.worker.print_to_stdstream`; where that is absent nothing
    changes)."""
    from ray._private import worker as ray_worker

    original = getattr(ray_worker, "print_to_stdstream", None)
    if original is None or getattr(original, "_dmattn_to_stderr", False):
        return

    def to_stderr(data, ignore_prefix):
        return original(dict(data, is_err=True), ignore_prefix)

    to_stderr._dmattn_to_stderr = True
    ray_worker.print_to_stdstream = to_stderr


def connect(address: str, on_gpu: bool) -> int:
    """Joins (or, with "local", starts) a Ray cluster; returns its GPU count.

    Raises:
        DmattnError: Ray is missing, or a GPU tune finds no GPU in the cluster.
    """
    ray = _import_ray()
    _ray_messages_to_stderr()
    if not ray.is_initialized():
        try:
            if address == "local":
                ray.init(include_dashboard=False, log_to_driver=False)
            else:
                ray.init(address=address, include_dashboard=False, log_to_driver=False)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise ClusterError(f"--ray {address}: cannot connect: {_first_line(exc)[:200]}",
                               "start the cluster (`ray start --head`), or pass --ray local") from None
    gpus = int(ray.cluster_resources().get("GPU", 0))
    if on_gpu and gpus == 0:
        raise DmattnError(f"the Ray cluster at {address!r} has no GPU", "start its nodes with GPUs, or tune locally")
    return gpus


def ray_workers(count: int, interpret: bool, start_timeout: float = ACTOR_START_TIMEOUT_S) -> list[RayWorker]:
    """`count` measuring slots with their actors started, before any trial begins.

    Raises:
        ClusterError: an actor did not start (no free GPU, a node that cannot import us).
    """
    workers = [RayWorker(interpret) for _ in range(count)]
    for worker in workers:
        worker.start(start_timeout)
    return workers
