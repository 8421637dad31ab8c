"""Host time of one Triton kernel launch through each entry point, on the local GPU.

The kernel is the backward's delta pass (`flash_bwd_preprocess_kernel`, 22 arguments); the GPU
is kept busy by a spin so no launch waits on the queue. Entry points:
- jit: `kernel[grid](*args, **constexprs)`, the JIT's binder, specialization key and cache
  lookup on every call;
- compiled[grid]: the `CompiledKernel` the JIT returned, called as `compiled[grid](*args)`
  (launch metadata, stream and device queried per call);
- handle: that kernel's launcher called directly, as `launching.Launch` does after its first run.

    python -m benchmarks launch-entry-points

Prints a markdown table of median microseconds per launch (stdout).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import triton

from dmattn_bench.bench.operators import operator
from dmattn_kernels.triton import launching
from dmattn_kernels.triton.flash_bwd import flash_bwd_preprocess_kernel

LAUNCHES, ROUNDS = 200, 7


@operator("launch-entry-points", help="Host µs of one Triton kernel launch through each entry point")
def main(argv: list[str]) -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    batch, seqlen, heads, head_dim = 1, 128, 8, 64
    out = torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    dout = torch.randn_like(out)
    lse = torch.randn(batch, heads, seqlen, device="cuda")
    delta = torch.empty_like(lse)
    grid = (triton.cdiv(seqlen, 64), batch * heads)
    tensors = (out, dout, delta, lse, lse)
    scalars = (*out.stride(), *dout.stride(), *delta.stride(), *lse.stride(), *lse.stride(), heads, seqlen)
    constexprs = dict(HEAD_DIM=head_dim, BLOCK_D=head_dim, BLOCK_M=64, HAS_DLSE=True)
    compiled = flash_bwd_preprocess_kernel[grid](*tensors, *scalars, **constexprs)
    planned = launching.Launch(flash_bwd_preprocess_kernel, grid, scalars, constexprs, num_warps=4)
    planned(*tensors)  # the JIT path once: it keeps the handle
    all_args = (*tensors, *scalars, *constexprs.values())
    entry_points = {
        "jit": lambda: flash_bwd_preprocess_kernel[grid](*tensors, *scalars, **constexprs),
        "compiled[grid]": lambda: compiled[grid + (1,)](*all_args),
        "handle (launching.Launch)": lambda: planned(*tensors),
    }
    print(f"triton {triton.__version__}, torch {torch.__version__}, {torch.cuda.get_device_name()}")
    print("| entry point | µs per launch (median of 7 rounds of 200) |")
    print("|---|---|")
    for name, fn in entry_points.items():
        rounds = []
        for _ in range(ROUNDS):
            torch.cuda._sleep(50_000_000)
            begin = time.perf_counter()
            for _ in range(LAUNCHES):
                fn()
            rounds.append((time.perf_counter() - begin) / LAUNCHES * 1e6)
            torch.cuda.synchronize()
        print(f"| {name} | {statistics.median(rounds):.1f} |")
