"""One W1 and one W2 forward+backward through `flash_dmattn_func` with a bench table, bracketed by
cudaProfilerStart/Stop, for Nsight Compute to read the hardware counters of every kernel of it.

Run from the repository root on a GPU (ncu must leave the clocks alone):
`ncu --clock-control none --profile-from-start off --section SpeedOfLight --section WarpStateStats \
 --section Occupancy --section LaunchStats --csv --page details \
 python benchmarks/ncu_step.py results/bench/h100-peers-table.yaml`.
"""

import sys

import torch

from dmattn_bench import flash_dmattn_func
from dmattn_bench.bench import build_bench_inputs, load_peer_workloads

WARMUP_STEPS = 2


def main(table: str) -> None:
    device = torch.device("cuda")
    for pw in load_peer_workloads("configs/workloads/peers.yaml", names=["W1", "W2"]):
        inputs = build_bench_inputs(pw, device)
        q, k, v = (t.requires_grad_() for t in (inputs.q, inputs.k, inputs.v))
        grad_out = torch.randn_like(q)

        def step():
            out = flash_dmattn_func(q, k, v, attn_mask=inputs.mask, attn_bias=inputs.bias, is_causal=True,
                                    table=table)
            out.backward(grad_out)

        for _ in range(WARMUP_STEPS):
            step()
        torch.cuda.synchronize()
        print(f"# {pw.name}: profiled step", file=sys.stderr)
        torch.cuda.profiler.start()
        step()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
        del inputs, q, k, v
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1])
