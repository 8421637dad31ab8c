"""One W1 and one W2 forward+backward through `flash_dmattn_func` with a bench table, bracketed by
cudaProfilerStart/Stop, for Nsight Compute to read the hardware counters of every kernel of it.

Run from the repository root on a GPU (ncu must leave the clocks alone):
`ncu --clock-control none --profile-from-start off --section SpeedOfLight --section WarpStateStats \
 --section Occupancy --section LaunchStats --csv --page details \
 python -m benchmarks ncu-step results/bench/h100-peers-table.yaml`.
"""

import argparse
import sys

import torch

from benchmarks.profile_step import training_steps
from dmattn_bench.bench.operators import operator

WARMUP_STEPS = 2


@operator("ncu-step", help="One W1 and one W2 forward+backward bracketed by cudaProfilerStart/Stop for Nsight Compute")
def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("table", help="the dispatch table the steps run with")
    args = parser.parse_args(argv)
    for name, step in training_steps(args.table, WARMUP_STEPS):
        print(f"# {name}: profiled step", file=sys.stderr)
        torch.cuda.profiler.start()
        step()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
