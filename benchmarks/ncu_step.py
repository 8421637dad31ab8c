"""One W1 and one W2 forward+backward through `flash_dmattn_func` with a bench table, bracketed by
cudaProfilerStart/Stop, for Nsight Compute to read the hardware counters of every kernel of it.

Run from the repository root on a GPU (ncu must leave the clocks alone):
`ncu --clock-control none --profile-from-start off --section SpeedOfLight --section WarpStateStats \
 --section Occupancy --section LaunchStats --csv --page details \
 python benchmarks/ncu_step.py results/bench/h100-peers-table.yaml`.
"""

import sys

import torch

from profile_step import training_steps

WARMUP_STEPS = 2


def main(table: str) -> None:
    for name, step in training_steps(table, WARMUP_STEPS):
        print(f"# {name}: profiled step", file=sys.stderr)
        torch.cuda.profiler.start()
        step()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()


if __name__ == "__main__":
    main(sys.argv[1])
