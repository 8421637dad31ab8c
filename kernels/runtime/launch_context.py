"""What every launch of either launcher consults: the compile-only switch (`compile_only`), the
launch observers (`LAUNCH_OBSERVERS`, `PROGRAM_OBSERVERS`) and the stream a run's launches take
(`launch_stream`).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Callable

import torch
from triton import knobs

_MODE = threading.local()  # compile-only switch of the current thread (see `compile_only`)
# Called with each kernel's name as it is launched (or compiled in `compile_only`): launch counts
# for tests and instrumentation. Empty in normal use, where it costs one truth test per launch.
# Read as `launch_context.LAUNCH_OBSERVERS` by the launchers and the native entry, so that a test
# may replace the list.
LAUNCH_OBSERVERS: list[Callable[[str], None]] = []
# Called with each launch's `dmattn_kernels.target.Program` (the kernel and the compile-time
# parameters its launcher passed; a Triton launch reports it only while LAUNCH_OBSERVERS holds an
# observer, which also keeps native programs out of the way): what a run ran, for the
# adversarial-case ledger (`dmattn_bench.tuning.ledger.observing` sets both). Empty in normal use.
PROGRAM_OBSERVERS: list[Callable[[object], None]] = []


@contextmanager
def compile_only():
    """Within this block the launchers build what a launch needs (Triton's `warmup`, a CUDA
    variant's cubin) but launch nothing.

    The tuner compiles candidates in parallel worker processes this way: no candidate kernel
    ever runs there, so a config that faults on the GPU can only fault in the measuring worker,
    which is isolated and restarted.
    """
    previous = getattr(_MODE, "compile_only", False)
    _MODE.compile_only = True
    try:
        yield
    finally:
        _MODE.compile_only = previous


def is_compile_only() -> bool:
    return getattr(_MODE, "compile_only", False)


def _hooked(hook) -> bool:
    """Whether a Triton launch hook is set: a `HookChain` (Triton 3.6+) with calls, or a callable."""
    calls = getattr(hook, "calls", hook)
    return bool(calls)


# The current device and stream, as Triton's JIT reads them before a launch, without the lazy-init
# check `torch.cuda.current_device` repeats (5 us per launch on an H100 host, cProfile of
# `benchmarks/host_profile.py`): a plan's kernels run after its first JIT launch initialised CUDA.
_current_device = torch._C._cuda_getDevice if torch.cuda.is_available() else None
_current_stream = torch._C._cuda_getCurrentRawStream if torch.cuda.is_available() else None


def launch_stream() -> int | None:
    """The current CUDA stream, for launches through compiled launchers; None where every launch
    takes the JIT: without CUDA, within `compile_only()`, and while a Triton launch hook is set
    (a profiler), which only the JIT calls. (The interpreter compiles nothing, so its launches
    never have a launcher.)"""
    runtime = knobs.runtime
    if (_current_stream is None or is_compile_only() or _hooked(runtime.launch_enter_hook)
            or _hooked(runtime.launch_exit_hook)):
        return None
    return _current_stream(_current_device())
