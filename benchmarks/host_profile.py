"""Where the host time of one eager call goes: cProfile over repeated calls of one
`benchmarks/host_overhead.py` scenario (ours, or SDPA for comparison), top functions by own time.

    python -m benchmarks host-profile --scenario W2 --direction fwd+bwd
"""

from __future__ import annotations

import argparse
import cProfile
import pstats

import torch

from benchmarks import host_overhead
from dmattn_bench.bench.operators import operator

CALLS = 300


@operator("host-profile", help="cProfile of one host-overhead scenario's eager call, top functions by own time")
def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", default="W2", help="a prefix of a scenario name of host_overhead.py")
    parser.add_argument("--direction", choices=("fwd", "fwd+bwd"), default="fwd+bwd")
    parser.add_argument("--impl", choices=("ours", "sdpa"), default="ours")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    name, shape = next((n, s) for n, s in host_overhead._scenarios(device).items() if n.startswith(args.scenario))
    make = host_overhead._ours if args.impl == "ours" else host_overhead._sdpa
    fn, context = make(shape, device, args.direction == "fwd+bwd")
    with context:
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        profiler = cProfile.Profile()
        for _ in range(CALLS):
            torch.cuda._sleep(host_overhead.SPIN_CYCLES)
            profiler.enable()
            fn()
            profiler.disable()
            torch.cuda.synchronize()
    print(f"{name} {args.direction} {args.impl}: {CALLS} calls, own time per call")
    stats = pstats.Stats(profiler).sort_stats("tottime")
    for (file, line, func), (_, calls, tottime, cumtime, _) in list(
            sorted(stats.stats.items(), key=lambda item: -item[1][2]))[:args.top]:
        print(f"{tottime / CALLS * 1e6:8.1f} us own {cumtime / CALLS * 1e6:8.1f} us cum {calls / CALLS:5.1f}x "
              f"{file.split('/')[-1]}:{line} {func}")
