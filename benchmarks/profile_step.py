"""Where the time of a bench workload's forward+backward goes: torch.profiler over our call as the
bench makes it (the `dmattn` peer: `flash_dmattn_func`, or `flash_dmattn_varlen_func` on packed
documents) with a table, CUDA time per kernel, summed over PROFILED_STEPS steps after a warm-up.

Run from the repository root on a GPU:
`python -m benchmarks profile-step results/bench/h100-peers-table.yaml` (W1 and W2), or
`python -m benchmarks profile-step results/tables/nvidia-h200-sm90.yaml --workloads
configs/workloads/packed.yaml --only window`.
"""

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from dmattn_bench.bench import packed_peers, peers
from dmattn_bench.bench.harness import build_bench_inputs, load_peer_workloads
from dmattn_bench.bench.operators import operator

WARMUP_STEPS = 3
PROFILED_STEPS = 5
PEER_WORKLOADS = "configs/workloads/peers.yaml"


def _step(pw, table: str, device):
    """One forward+backward of workload `pw` as the bench runs ours, with `table`."""
    inputs = build_bench_inputs(pw, device)
    ours = (packed_peers.PEERS if pw.layout is not None else peers.PEERS)[peers.OURS]
    prepared = ours(inputs, table)
    out = prepared.forward()
    grad_out = torch.randn_like(out)

    def step():
        prepared.forward().backward(grad_out)

    return step


def training_steps(table: str, warmup: int, workloads: str = PEER_WORKLOADS, names=("W1", "W2")):
    """(workload name, step) for the workloads of `workloads` whose names start with one of
    `names`, each step run `warmup` times and synchronised before it is handed out."""
    device = torch.device("cuda")
    for pw in load_peer_workloads(workloads, names=list(names)):
        step = _step(pw, table, device)
        for _ in range(warmup):
            step()
        torch.cuda.synchronize()
        yield pw.name, step


@operator("profile-step", help="CUDA time per kernel of a bench workload's forward+backward (torch.profiler)")
def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("table", help="the dispatch table the steps run with")
    parser.add_argument("--workloads", default=PEER_WORKLOADS, help="a bench workloads file")
    parser.add_argument("--only", nargs="+", default=["W1", "W2"], help="workload name prefixes")
    args = parser.parse_args(argv)
    print(f"# {torch.cuda.get_device_name()}, table {args.table}")
    for name, step in training_steps(args.table, WARMUP_STEPS, args.workloads, args.only):
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
