"""Where the time of W1/W2 forward+backward goes: torch.profiler over `flash_dmattn_func` with a
bench table, CUDA time per kernel, summed over PROFILED_STEPS steps after a warm-up.

Run from the repository root on a GPU:
`python -m benchmarks profile-step results/bench/h100-peers-table.yaml`.
"""

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from dmattn_bench import flash_dmattn_func
from dmattn_bench.bench.harness import build_bench_inputs, load_peer_workloads
from dmattn_bench.bench.operators import operator

WARMUP_STEPS = 3
PROFILED_STEPS = 5


def _step(pw, table: str, device):
    """One forward+backward of workload `pw` through `flash_dmattn_func` with `table`."""
    inputs = build_bench_inputs(pw, device)
    q, k, v = (t.requires_grad_() for t in (inputs.q, inputs.k, inputs.v))
    grad_out = torch.randn_like(q)

    def step():
        out = flash_dmattn_func(q, k, v, attn_mask=inputs.mask, attn_bias=inputs.bias, is_causal=True, table=table)
        out.backward(grad_out)

    return step


def training_steps(table: str, warmup: int):
    """(workload name, step) for W1 and W2 of the peer workloads, each step run `warmup` times
    and synchronised before it is handed out."""
    device = torch.device("cuda")
    for pw in load_peer_workloads("configs/workloads/peers.yaml", names=["W1", "W2"]):
        step = _step(pw, table, device)
        for _ in range(warmup):
            step()
        torch.cuda.synchronize()
        yield pw.name, step


@operator("profile-step", help="CUDA time per kernel of W1/W2 forward+backward (torch.profiler)")
def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("table", help="the dispatch table the steps run with")
    table = parser.parse_args(argv).table
    print(f"# {torch.cuda.get_device_name()}, table {table}")
    for name, step in training_steps(table, WARMUP_STEPS):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(PROFILED_STEPS):
                step()
            torch.cuda.synchronize()
        print(f"\n## {name}: CUDA time per step (ms), {PROFILED_STEPS} steps")
        events = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)
        total = sum(e.device_time_total for e in events)
        for e in events:
            if e.device_time_total / total < 0.002:
                continue
            print(f"{e.device_time_total / PROFILED_STEPS / 1e3:8.4f}  x{e.count // PROFILED_STEPS:<3d} {e.key[:110]}")
        print(f"{total / PROFILED_STEPS / 1e3:8.4f}  total")
