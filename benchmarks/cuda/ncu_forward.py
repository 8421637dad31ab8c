"""The CUDA backend's forward of the bench's W1-W3 (`configs/workloads/peers.yaml`, the runtime's
table or defaults), one profiled call each after two warm-ups, bracketed by cudaProfilerStart/Stop
for Nsight Compute. Run from the repository root on a GPU (ncu must leave the clocks alone):

    ncu --clock-control none --profile-from-start off --kernel-name regex:dmattn_fwd_ws_kernel \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
        --section SchedulerStats --csv --page details python3 -m benchmarks cuda-ncu-forward
"""

import argparse
import sys

import torch

from dmattn_bench import flash_dmattn_func
from dmattn_bench.bench.harness import build_bench_inputs, load_peer_workloads
from dmattn_bench.bench.operators import operator


@operator("cuda-ncu-forward", help="The CUDA forward of W1-W3 bracketed by cudaProfilerStart/Stop for Nsight Compute")
def main(argv: list[str]) -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    for pw in load_peer_workloads("configs/workloads/peers.yaml"):
        x = build_bench_inputs(pw, "cuda")
        bias = x.bias.detach() if x.bias is not None else None

        def call():
            return flash_dmattn_func(x.q, x.k, x.v, x.mask, bias, is_causal=x.is_causal, backend="cuda")

        call()
        call()
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        call()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
        print(f"# {pw.name}: profiled", file=sys.stderr)
