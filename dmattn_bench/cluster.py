"""Tuning across the GPUs of a Ray cluster (optional extra `cluster`).

The tuner needs measuring slots with two methods, `call(fn, args, timeout)` and `stop()`
(`workers.Worker` on one host). `RayWorker` is such a slot backed by a Ray actor that holds one
GPU, on whichever node Ray places it. Everything else stays with the driver: the plan, the
trial journal (so `--resume` works as on one host), the winners and the table. The driver
needs the same GPU model as the cluster's nodes: it reads its own fingerprint, limits and
defaults for the table.

Failure handling matches the local workers. A job that outlives its timeout gets its actor
killed (`WorkerTimedOut`). An actor that dies (abort, segfault, node lost) raises
`WorkerCrashed`. Either way the next call starts a fresh actor, so a faulting candidate costs
only its own trial.

Kernels are compiled by each actor on first launch, into that node's Triton cache; the
driver's parallel compile phase is skipped, since its cache would not reach other nodes.
"""

from __future__ import annotations

import os
from typing import Callable

from dmattn_bench.errors import DmattnError
from dmattn_bench.workers import WorkerCrashed, WorkerTimedOut

FORWARDED_ENV_PREFIXES = ("DMATTN_", "PYTHONPATH")  # plugins and fault injection reach the actors
ACTOR_STOP_TIMEOUT_S = 10


def _import_ray():
    try:
        import ray
    except ModuleNotFoundError:
        raise DmattnError("--ray needs Ray", "pip install 'dmattn-bench[cluster]'") from None
    return ray


class _Slot:
    """The actor body: runs jobs one at a time; a job that raises comes back as data."""

    def run(self, fn: Callable, args: tuple):
        try:
            return "ok", fn(*args)
        except Exception as exc:  # noqa: BLE001 - reported to the driver as data
            text = str(exc).strip()
            return "error", f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


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

    def _start(self) -> None:
        ray = _import_ray()
        slot = ray.remote(_Slot).options(
            num_gpus=0 if self.interpret else 1,
            num_cpus=1,
            max_restarts=0,  # a dead actor is replaced by the driver, which records why
            runtime_env={"env_vars": _actor_env(self.interpret)},
        )
        self._actor = slot.remote()

    def stop(self) -> None:
        """Kills the actor (the next call starts a new one)."""
        if self._actor is not None:
            _import_ray().kill(self._actor, no_restart=True)
        self._actor = None

    def call(self, fn: Callable, args: tuple, timeout: float):
        """`fn(*args)` on the actor. Raises WorkerCrashed, WorkerTimedOut or RuntimeError (job error)."""
        ray = _import_ray()
        from ray.exceptions import GetTimeoutError, RayActorError

        if self._actor is None:
            self._start()
        reference = self._actor.run.remote(fn, args)
        try:
            kind, payload = ray.get(reference, timeout=timeout)
        except GetTimeoutError:
            self.stop()
            self.restarts += 1
            raise WorkerTimedOut(f"no result after {timeout:.0f} s; actor killed") from None
        except RayActorError as exc:
            self._actor = None
            self.restarts += 1
            first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            raise WorkerCrashed(f"actor died: {first_line[:200]}") from None
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
        if address == "local":
            ray.init(include_dashboard=False, log_to_driver=False)
        else:
            ray.init(address=address, include_dashboard=False, log_to_driver=False)
    gpus = int(ray.cluster_resources().get("GPU", 0))
    if on_gpu and gpus == 0:
        raise DmattnError(f"the Ray cluster at {address!r} has no GPU", "start its nodes with GPUs, or tune locally")
    return gpus


def ray_workers(count: int, interpret: bool) -> list[RayWorker]:
    """`count` measuring slots; their actors start on first use."""
    return [RayWorker(interpret) for _ in range(count)]
