"""Host cost per call of `flash_dmattn_func` against SDPA, on the local GPU.

For each scenario and each implementation, medians of:
- host: host time to enqueue one call, no sync (a GPU spin ahead keeps the queue from blocking);
- gpu: CUDA-event time of one call, enqueued behind a spin (so it is GPU time alone);
- wall: eager wall time per call of a loop of calls with no spin, synchronised once at the end.

Run it with another checkout's package first on PYTHONPATH to compare versions on one machine,
from the repository root (`-P` keeps the current folder's packages from coming before PYTHONPATH's):

    python -m benchmarks host-overhead --label after --json after.json
    PYTHONPATH=/path/to/old/checkout-as-packages:$PWD python -P -m benchmarks host-overhead --label before

Prints one markdown table (stdout); progress to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from dmattn_bench.bench.operators import operator

SPIN_CYCLES = 20_000_000  # ~10 ms of GPU spin: longer than any call's host time here
HOST_REPEATS, GPU_REPEATS, WALL_LOOPS, WALL_CALLS = 50, 20, 5, 30


def _scenarios(device):
    """name -> (B, H, Hkv, L, D, causal, mask kind, bias kind, bias grad)."""
    return {
        "W2 masked (B2 H16/4 L4096 D128, kv mask, per-key bias)": (2, 16, 4, 4096, 128, True, "kv_head", "per_key"),
        "W1 full mask+bias (B2 H16 L4096 D128)": (2, 16, 16, 4096, 128, True, "full", "full"),
        "W3 dense causal (B2 H16 L4096 D128)": (2, 16, 16, 4096, 128, True, None, None),
        "small step (B4 H16/4 L1024 D64 causal, kv mask, per-key bias)": (4, 16, 4, 1024, 64, True, "kv_head", "per_key"),
        "tiny (B1 H16/4 L128 D64, kv mask, per-key bias)": (1, 16, 4, 128, 64, True, "kv_head", "per_key"),
    }


def _inputs(shape, device, grad):
    batch, heads, heads_kv, seqlen, head_dim, causal, mask_kind, bias_kind = shape
    g = torch.Generator(device=device).manual_seed(0)
    dtype = torch.bfloat16
    q = torch.randn(batch, seqlen, heads, head_dim, device=device, dtype=dtype, generator=g)
    k, v = (torch.randn(batch, seqlen, heads_kv, head_dim, device=device, dtype=dtype, generator=g) for _ in range(2))
    mask = bias = None
    if mask_kind == "kv_head":
        mask = torch.rand(batch, heads_kv, seqlen, seqlen, device=device, generator=g) < 0.5
    elif mask_kind == "full":
        mask = torch.rand(batch, heads, seqlen, seqlen, device=device, generator=g) < 0.5
    if bias_kind == "per_key":
        bias = torch.randn(batch, heads_kv, 1, seqlen, device=device, dtype=dtype, generator=g)
    elif bias_kind == "full":
        bias = torch.randn(batch, heads, seqlen, seqlen, device=device, dtype=dtype, generator=g)
    leaves = [q, k, v] + ([bias] if bias is not None else [])
    for t in leaves:
        t.requires_grad_(grad)
    return q, k, v, mask, bias, causal, leaves


def _ours(shape, device, backward):
    from dmattn_bench import flash_dmattn_func

    q, k, v, mask, bias, causal, leaves = _inputs(shape, device, backward)
    grad_out = torch.randn_like(q)
    if not backward:
        return (lambda: flash_dmattn_func(q, k, v, mask, bias, is_causal=causal)), contextlib.nullcontext()
    return (lambda: torch.autograd.grad(flash_dmattn_func(q, k, v, mask, bias, is_causal=causal), leaves, grad_out),
            contextlib.nullcontext())


def _sdpa(shape, device, backward):
    """SDPA flash for dense shapes; memory-efficient with the mask and bias folded into one float
    mask (the way a float-mask user calls it) otherwise."""
    q, k, v, mask, bias, causal, leaves = _inputs(shape, device, backward)
    heads, heads_kv = q.shape[2], k.shape[2]
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    float_mask = None
    if mask is not None or bias is not None:
        float_mask = torch.zeros(q.shape[0], heads, q.shape[1], k.shape[1], device=device, dtype=q.dtype)
        if bias is not None:
            float_mask = float_mask + bias.detach().repeat_interleave(heads // bias.shape[1], 1)
        if mask is not None:
            full = mask.repeat_interleave(heads // mask.shape[1], 1)
            float_mask = float_mask.masked_fill(~full, float("-inf"))
        if causal:
            float_mask = float_mask.masked_fill(
                torch.ones(q.shape[1], k.shape[1], dtype=torch.bool, device=device).triu(1), float("-inf"))
        kt, vt = (t.repeat_interleave(heads // heads_kv, 1) for t in (kt, vt))
        backend, is_causal = SDPBackend.EFFICIENT_ATTENTION, False
        leaves = leaves[:3]
    else:
        backend, is_causal = SDPBackend.FLASH_ATTENTION, causal
    grad_out = torch.randn_like(qt)
    gqa = dict(enable_gqa=True) if float_mask is None and heads != heads_kv else {}

    def call():
        return F.scaled_dot_product_attention(qt, kt, vt, attn_mask=float_mask, is_causal=is_causal, **gqa)

    # the backend is chosen once around the whole measurement (entering `sdpa_kernel` costs
    # more host time than the call itself)
    if not backward:
        return call, sdpa_kernel(backend)
    return (lambda: torch.autograd.grad(call(), leaves, grad_out)), sdpa_kernel(backend)


def _measure(fn):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    host = []
    for _ in range(HOST_REPEATS):
        torch.cuda._sleep(SPIN_CYCLES)
        begin = time.perf_counter()
        fn()
        host.append(time.perf_counter() - begin)
        torch.cuda.synchronize()
    gpu = []
    for _ in range(GPU_REPEATS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(SPIN_CYCLES)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        gpu.append(start.elapsed_time(end))
    wall = []
    for _ in range(WALL_LOOPS):
        torch.cuda.synchronize()
        begin = time.perf_counter()
        for _ in range(WALL_CALLS):
            fn()
        torch.cuda.synchronize()
        wall.append((time.perf_counter() - begin) / WALL_CALLS)
    return dict(host_ms=statistics.median(host) * 1e3, gpu_ms=statistics.median(gpu),
                wall_ms=statistics.median(wall) * 1e3)


@operator("host-overhead", help="Host, GPU and eager wall time per call of flash_dmattn_func against SDPA")
def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", default="ours")
    parser.add_argument("--json", help="also write the rows here")
    parser.add_argument("--no-sdpa", action="store_true")
    parser.add_argument("--only", action="append", help="scenario name prefix (repeatable); default: all")
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    rows = []
    for name, shape in _scenarios(device).items():
        if args.only and not any(name.startswith(prefix) for prefix in args.only):
            continue
        for direction, backward in (("fwd", False), ("fwd+bwd", True)):
            impls = [(args.label, _ours)] + ([] if args.no_sdpa else [("sdpa", _sdpa)])
            for impl, make in impls:
                print(f"{name} {direction} {impl}", file=sys.stderr, flush=True)
                try:
                    fn, context = make(shape, device, backward)
                    with context:
                        result = _measure(fn)
                except Exception as exc:  # a peer that cannot run this shape is a row with its error
                    result = dict(error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}")
                rows.append(dict(scenario=name, direction=direction, impl=impl, **result))
                torch.cuda.empty_cache()
    print("| scenario | direction | impl | host ms | gpu ms | eager wall ms | wall / gpu |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        if "error" in row:
            print(f"| {row['scenario']} | {row['direction']} | {row['impl']} | {row['error']} | | | |")
            continue
        print(f"| {row['scenario']} | {row['direction']} | {row['impl']} | {row['host_ms']:.3f} | {row['gpu_ms']:.3f} "
              f"| {row['wall_ms']:.3f} | {row['wall_ms'] / row['gpu_ms']:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), f, indent=1)
