"""Session 13 timing probe: why our W3 rows (and at times W2's) in `dmattn-bench bench` are
noisy (spread 10-40%) while the peers' rows of the same run are not.

Hypothesis: `timing.time_kernel` records its start event right after the L2 flush (about 40 us
of GPU work), so host work of the timed call beyond that (Python wrapper, dispatch lookup,
kernel launch) leaves the GPU idle inside the measured interval, and any host hiccup shows up
as GPU time. Per workload and direction this prints, for ours and FlexAttention: the host time of
one call (no sync), and the median / spread of 50 repeats timed as `time_kernel` does and with a
2 ms GPU spin (`torch.cuda._sleep`) enqueued before the flush, which lets the host run ahead.

Run from the repository root on a GPU:
`python results/bench/session13_timing_probe.py [TABLE]` (TABLE: a peer-shape table);
PROBE_PROFILE=1 also prints a cProfile of our calls to stderr.
"""

import cProfile
import os
import pstats
import statistics
import sys
import time

import torch

from dmattn_bench.bench import _fwd_bwd, build_bench_inputs, load_peer_workloads
from dmattn_bench.peers import PEERS
from dmattn_bench.timing import _L2Flusher, _quantile

REPEATS = 50
SPIN_CYCLES = 4_000_000  # about 2 ms at 1.98 GHz
PROFILE = os.environ.get("PROBE_PROFILE") == "1"  # also cProfile our calls (to stderr)


def gpu_times(fn, flush, spin: bool) -> list[float]:
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(REPEATS)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(REPEATS)]
    for start, end in zip(starts, ends):
        if spin:
            torch.cuda._sleep(SPIN_CYCLES)
        flush()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in zip(starts, ends)]


def host_times(fn) -> list[float]:
    """Host time of each call, the GPU kept busy so that no call waits on a full queue."""
    samples = []
    for _ in range(REPEATS):
        torch.cuda._sleep(SPIN_CYCLES)
        begin = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - begin) * 1e3)
        torch.cuda.synchronize()
    return samples


def profile(fn, label: str) -> None:
    """cProfile of 100 calls (GPU kept busy), the top 30 by own time, to stderr."""
    profiler = cProfile.Profile()
    for _ in range(100):
        torch.cuda._sleep(SPIN_CYCLES // 4)
        profiler.enable()
        fn()
        profiler.disable()
    torch.cuda.synchronize()
    print(f"## profile {label}: 100 calls", file=sys.stderr)
    pstats.Stats(profiler, stream=sys.stderr).sort_stats("tottime").print_stats(30)


def summary(samples: list[float]) -> str:
    median = statistics.median(samples)
    spread = (_quantile(samples, 0.8) - _quantile(samples, 0.2)) / median
    return f"{median:.4f} ({spread:.1%}, max {max(samples):.3f})"


def main():
    table = sys.argv[1] if len(sys.argv) > 1 else None
    device = torch.device("cuda")
    print(f"# {torch.cuda.get_device_name(device)}, torch {torch.__version__}, table {table}", flush=True)
    flush = _L2Flusher(device)
    print("| workload | peer | direction | host ms per call | GPU ms as time_kernel | GPU ms after a 2 ms spin |")
    print("|---|---|---|---|---|---|")
    for pw in load_peer_workloads("configs/workloads/peers.yaml", names=["W1", "W2", "W3"]):
        inputs = build_bench_inputs(pw, device)
        for peer in ("dmattn", "flex"):
            prepared = PEERS[peer](inputs, table)
            grad_out = torch.ones_like(prepared.forward().detach())
            for direction, fn in (("fwd", prepared.forward), ("fwd+bwd", _fwd_bwd(prepared, grad_out))):
                try:
                    with torch.no_grad() if direction == "fwd" else torch.enable_grad():
                        for _ in range(3):
                            fn()
                        host = host_times(fn)
                        plain = gpu_times(fn, flush, spin=False)
                        spun = gpu_times(fn, flush, spin=True)
                        if PROFILE and peer == "dmattn":
                            profile(fn, f"{pw.name.split()[0]} {direction}")
                except Exception as exc:  # noqa: BLE001 - a probe row, not a crash
                    print(f"| {pw.name.split()[0]} | {peer} | {direction} | error {type(exc).__name__} | | |")
                    continue
                print(f"| {pw.name.split()[0]} | {peer} | {direction} | {summary(host)} | {summary(plain)} | "
                      f"{summary(spun)} |", flush=True)
            del prepared
        del inputs
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
