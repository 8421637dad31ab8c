"""Kernel timing: warm-up, repeats, medians and spread, L2 flushed between repeats.

On a GPU each repeat is bracketed by CUDA events and preceded by a write over a buffer twice the
L2 size, so no repeat finds its inputs in cache, then a read of another such buffer, so that no
dirty line is left for the repeat to write back (`_L2Flusher`); before both, by a GPU spin
(`_HostLead`) long enough for the host to enqueue the whole call while the GPU is still busy. Without the
spin, host work of the call beyond the flush's 40 us (Python wrapper, dispatch, launches) left
the GPU idle inside the measured interval: our W3 forward takes 0.25 ms of host time per call
against 0.31 ms on the GPU, and a host hiccup showed as GPU time (W3 rows of `dmattn-bench bench`
10-40% spread while the peers' were under 1%; with the spin, the same medians within 2% and
maxima 0.538 -> 0.319 ms; H200, commit a6a0921). The host's own
time per call is reported beside (`Timing.host_ms`). On the CPU (the Triton interpreter) the
same loop runs with a host clock and the result is marked as not meaningful.

What an eager caller sees is neither: `eager_wall_ms` times back-to-back calls with no spin and no
flush, synchronised once at the end, so a call whose host work outlasts its GPU work costs its
host time, as it does in a training loop that is not captured in a CUDA graph.
"""

from __future__ import annotations

import functools
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch

# A timed kernel whose repeats spread over this (p80 - p20 over the median) timed more than the
# kernel: the H200 tunes of the default, W1-W3 and packed grids spread 0.2-0.4% at the median and
# none over 10%; the sweep grid's, whose compile workers drew B4 H16 L4096 masks and biases on
# the GPU beside the timed kernels, 14% at the median and half over 10%
NOISY_SPREAD = 0.05

DEFAULT_L2_BYTES = 50 * 2**20  # H100's L2; used when the driver does not report it
FLUSH_FACTOR = 2  # write twice the L2 so nothing of the inputs survives
LEAD_FACTOR = 2  # the spin lasts this many times the host time of the last warm-up call ...
MIN_LEAD_MS = 0.2  # ... and at least this long
MAX_LEAD_MS = 50.0


@dataclass(frozen=True)
class Timing:
    """Median and spread of one kernel's repeats (milliseconds)."""

    median_ms: float
    p20_ms: float
    p80_ms: float
    repeats: int
    meaningful: bool  # False for interpreter timings
    host_ms: float | None = None  # median host time of one call (GPU only: the spin hides it)

    @property
    def spread(self) -> float:
        """(p80 - p20) / median: the noise of the measurement."""
        return (self.p80_ms - self.p20_ms) / self.median_ms if self.median_ms > 0 else 0.0

    def to_dict(self) -> dict:
        return dict(asdict(self), spread=round(self.spread, 4))


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


@functools.cache
def _spin_cycles_per_ms(device_index: int) -> float:
    """GPU clock cycles of `torch.cuda._sleep` per millisecond, measured once per device."""
    cycles = 2_000_000
    with torch.cuda.device(device_index):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(cycles)  # the first spin pays the module load
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        return cycles / max(start.elapsed_time(end), 1e-3)


class _HostLead:
    """Keeps the GPU busy for `lead_ms` so that the host enqueues the timed call ahead of it."""

    def __init__(self, device: torch.device, lead_ms: float):
        self.cycles = int(lead_ms * _spin_cycles_per_ms(device.index if device.index is not None else
                                                        torch.cuda.current_device()))

    def __call__(self) -> None:
        torch.cuda._sleep(self.cycles)


class _L2Flusher:
    """Evicts the timed call's inputs from L2 and leaves it clean: a write over one buffer pushes
    everything else out, then a read of another pushes the written lines out. After the write
    alone, the L2 held tens of MB of dirty lines that the timed call paid to write back as its
    own reads evicted them, about 9 us on a short decode step."""

    def __init__(self, device: torch.device):
        props = torch.cuda.get_device_properties(device)
        l2_bytes = getattr(props, "L2_cache_size", 0) or DEFAULT_L2_BYTES
        words = FLUSH_FACTOR * l2_bytes // 4
        self.written = torch.empty(words, dtype=torch.int32, device=device)
        self.read = torch.ones(words, dtype=torch.int32, device=device)
        self.total = torch.empty((), dtype=torch.int64, device=device)

    def __call__(self) -> None:
        self.written.zero_()
        torch.sum(self.read, 0, out=self.total)


def time_kernel(fn: Callable[[], None], device: torch.device | str, warmup: int = 3, repeats: int = 20) -> Timing:
    """Times `fn` (which launches the kernel and writes preallocated outputs)."""
    device = torch.device(device)
    warmup_host_ms = 0.0
    for _ in range(warmup):
        begin = time.perf_counter()
        fn()
        warmup_host_ms = (time.perf_counter() - begin) * 1e3  # the last: the first may compile
    samples: list[float] = []
    host_ms = None
    if device.type == "cuda":
        flush = _L2Flusher(device)
        lead = _HostLead(device, min(max(LEAD_FACTOR * warmup_host_ms, MIN_LEAD_MS), MAX_LEAD_MS))
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
        host_samples = []
        for start, end in zip(starts, ends):
            lead()
            flush()
            start.record()
            begin = time.perf_counter()
            fn()
            host_samples.append((time.perf_counter() - begin) * 1e3)
            end.record()
        torch.cuda.synchronize(device)
        samples = [start.elapsed_time(end) for start, end in zip(starts, ends)]
        host_ms = statistics.median(host_samples)
        meaningful = True
    else:
        for _ in range(repeats):
            begin = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - begin) * 1e3)
        meaningful = False
    return Timing(statistics.median(samples), _quantile(samples, 0.2), _quantile(samples, 0.8), repeats, meaningful,
                  host_ms)


def eager_wall_ms(fn: Callable[[], None], device: torch.device | str, calls: int = 20, loops: int = 5,
                  warmup: int = 1) -> float:
    """Wall time per call of an eager loop: `calls` back-to-back calls of `fn`, no spin, no flush,
    one synchronisation at the end; the median over `loops` such loops (milliseconds).

    On the CPU (the Triton interpreter) it is a host clock like `time_kernel`'s, and as little
    meaningful.
    """
    device = torch.device(device)

    def synchronize() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(warmup):
        fn()
    per_call = []
    for _ in range(loops):
        synchronize()  # the loop starts on an idle GPU: no earlier work is charged to it
        begin = time.perf_counter()
        for _ in range(calls):
            fn()
        synchronize()
        per_call.append((time.perf_counter() - begin) * 1e3 / calls)
    return statistics.median(per_call)


HOST_CALLS, HOST_ROUNDS, HOST_SPIN_CYCLES = 100, 9, 60_000_000


def host_us(fn: Callable[[], None], n: int = HOST_CALLS) -> float:
    """Warm host microseconds per call of `fn`: the median over HOST_ROUNDS rounds of `n`
    back-to-back calls enqueued behind a GPU spin (so no call waits on the GPU), divided by `n`."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    rounds = []
    for _ in range(HOST_ROUNDS):
        torch.cuda._sleep(HOST_SPIN_CYCLES)
        begin = time.perf_counter()
        for _ in range(n):
            fn()
        rounds.append((time.perf_counter() - begin) / n * 1e6)
        torch.cuda.synchronize()
    return statistics.median(rounds)
