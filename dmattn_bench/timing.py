"""Kernel timing: warm-up, repeats, medians and spread, L2 flushed between repeats.

On a GPU each repeat is bracketed by CUDA events and preceded by a write over a buffer twice the
L2 size, so no repeat finds its inputs in cache. On the CPU (the Triton interpreter) the same
loop runs with a host clock and the result is marked as not meaningful.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch

DEFAULT_L2_BYTES = 50 * 2**20  # H100's L2; used when the driver does not report it
FLUSH_FACTOR = 2  # write twice the L2 so nothing of the inputs survives


@dataclass(frozen=True)
class Timing:
    """Median and spread of one kernel's repeats (milliseconds)."""

    median_ms: float
    p20_ms: float
    p80_ms: float
    repeats: int
    meaningful: bool  # False for interpreter timings

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


class _L2Flusher:
    def __init__(self, device: torch.device):
        props = torch.cuda.get_device_properties(device)
        l2_bytes = getattr(props, "L2_cache_size", 0) or DEFAULT_L2_BYTES
        self.buffer = torch.empty(FLUSH_FACTOR * l2_bytes // 4, dtype=torch.int32, device=device)

    def __call__(self) -> None:
        self.buffer.zero_()


def time_kernel(fn: Callable[[], None], device: torch.device | str, warmup: int = 3, repeats: int = 20) -> Timing:
    """Times `fn` (which launches the kernel and writes preallocated outputs)."""
    device = torch.device(device)
    for _ in range(warmup):
        fn()
    samples: list[float] = []
    if device.type == "cuda":
        flush = _L2Flusher(device)
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
        for start, end in zip(starts, ends):
            flush()
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize(device)
        samples = [start.elapsed_time(end) for start, end in zip(starts, ends)]
        meaningful = True
    else:
        for _ in range(repeats):
            begin = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - begin) * 1e3)
        meaningful = False
    return Timing(statistics.median(samples), _quantile(samples, 0.2), _quantile(samples, 0.8), repeats, meaningful)
