"""What a tune of a workloads grid would run on an arch, counted without a GPU: workloads, table
keys, candidate trials, those a check without compiling leaves (the compile jobs), and the
kernels those jobs compile, keyed per workload (each workload compiling its own) and per
`tuner.specialization_class` (workloads of one class sharing them).

    python -m benchmarks tune-plan --grid default
    python -m benchmarks tune-plan --grid wide --dtype bf16 --dtype fp16

Candidates are the arch's search space (`configs/space/triton-*.yaml`); the heuristic default a
GPU tune adds first is in that space on sm90. Prints one markdown table (stdout).
"""

from __future__ import annotations

import argparse

from dmattn_bench.bench.operators import operator
from dmattn_bench.hardware import ARCH_LIMITS
from dmattn_bench.registry import get_backend
from dmattn_bench.space import CONFIGS_DIR
from dmattn_bench.tuning.prune import load_space, precheck
from dmattn_bench.tuning.trials import shape_of_workload
from dmattn_bench.tuning.tuner import compile_keys
from dmattn_bench.tuning.workloads import load_workloads


@operator("tune-plan", help="What a tune of a workloads grid would run on an arch, counted without a GPU")
def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default=str(CONFIGS_DIR / "workloads" / "default.yaml"))
    parser.add_argument("--grid", default="default")
    parser.add_argument("--dtype", action="append", help="as tune's --dtype (repeatable); default: the grid's")
    parser.add_argument("--arch", default="sm90", choices=sorted(ARCH_LIMITS))
    args = parser.parse_args(argv)
    limits = ARCH_LIMITS[args.arch]
    backend = get_backend("triton")
    workloads = load_workloads(args.workloads, args.grid, args.dtype)
    spaces = {d: load_space(CONFIGS_DIR / "space" / f"triton-{d}.yaml", "triton", d, args.arch) for d in ("fwd", "bwd")}
    trials = [(w, d, c, False) for w in workloads for d in ("fwd", "bwd") for c in spaces[d]]
    jobs = [(w, d, c, "triton") for w, d, c, _ in trials
            if backend.is_supported(c, shape_of_workload(w)) is None
            and precheck(d, c, limits, w.head_dim, w.dtype, "triton") is None]
    per_workload = {(w.label, *kernel) for w, d, c, _ in jobs for kernel in backend.kernels(d, c, shape_of_workload(w))}
    shared = {kernel for kernels in compile_keys(jobs, backend) for kernel in kernels}
    keys = {w.key(d) for w in workloads for d in ("fwd", "bwd")}
    print(f"| grid | arch | workloads | table keys | trials | compile jobs | kernels, per workload | "
          f"kernels, per specialization class |\n|---|---|---|---|---|---|---|---|\n"
          f"| {args.grid} ({', '.join(sorted({w.dtype for w in workloads}))}) | {args.arch} | {len(workloads)} | "
          f"{len(keys)} | {len(trials)} | {len(jobs)} | {len(per_workload)} | {len(shared)} |")
