"""The warp-specialized CUDA backward with and without a KV group a CTA (BwdConfig.kv_group), GPU ms
of forward+backward, on the issue-56 workloads (bf16, H16 Hkv4, causal): the 8 packed documents
(16384 tokens), a sliding window of 1024 at B2 L8192, and a dense B2 L4096 batch; head dims 128
and 64. The forward is the CUDA overlapped one in every row (`FORWARD`), so rows differ by the
backward alone. GPU ms by `timing.time_kernel` (L2 flushed, median of 20).

    python -m benchmarks kv-group-ab

One markdown table on stdout."""

import argparse

import torch

from benchmarks.varlen_probe import ISSUE_DOCUMENTS
from dmattn_bench import flash_dmattn_func, flash_dmattn_varlen_func
from dmattn_bench.bench.operators import operator
from dmattn_bench.space import BwdConfig, FwdConfig, config_label
from dmattn_bench.tuning.timing import time_kernel

FORWARD = FwdConfig(128, 128, 12, 2, overlap=1, persistent=1)
BACKWARD = {128: BwdConfig(64, 128, 64, 128, 12, 2), 64: BwdConfig(64, 64, 64, 64, 8, 2)}
HEADS, HEADS_KV = 16, 4


def _leaf(shape, device, generator):
    return torch.randn(*shape, device=device, dtype=torch.bfloat16, generator=generator).requires_grad_()


def _steps(head_dim: int, device):
    """(workload label, a function of a BwdConfig that runs one forward+backward)."""
    g = torch.Generator(device=device).manual_seed(0)
    total = sum(ISSUE_DOCUMENTS)
    q, k, v = (_leaf((total, heads, head_dim), device, g) for heads in (HEADS, HEADS_KV, HEADS_KV))
    cu = torch.tensor([0, *torch.tensor(ISSUE_DOCUMENTS).cumsum(0).tolist()], dtype=torch.int32, device=device)
    longest = max(ISSUE_DOCUMENTS)
    grad = torch.randn(total, HEADS, head_dim, device=device, dtype=torch.bfloat16, generator=g)

    def packed(config):
        out = flash_dmattn_varlen_func(q, k, v, cu, cu, longest, longest, is_causal=True, backend="cuda",
                                       fwd_config=FORWARD, bwd_config=config)
        torch.autograd.grad(out, (q, k, v), grad)

    yield "packed 8 docs", packed
    for label, seqlen, window in (("window 1024 B2 L8192", 8192, (1023, 0)), ("dense B2 L4096", 4096, (-1, -1))):
        dq, dk, dv = (_leaf((2, seqlen, heads, head_dim), device, g) for heads in (HEADS, HEADS_KV, HEADS_KV))
        dense_grad = torch.randn(2, seqlen, HEADS, head_dim, device=device, dtype=torch.bfloat16, generator=g)

        def dense(config, dq=dq, dk=dk, dv=dv, dense_grad=dense_grad, window=window):
            out = flash_dmattn_func(dq, dk, dv, is_causal=True, window_size=window, backend="cuda",
                                    fwd_config=FORWARD, bwd_config=config)
            torch.autograd.grad(out, (dq, dk, dv), dense_grad)

        yield label, dense


@operator("kv-group-ab", help="GPU ms of the CUDA backward with and without a KV group a CTA (kv_group)")
def main(argv: list[str]) -> None:
    argparse.ArgumentParser(prog="python -m benchmarks kv-group-ab", description=__doc__.splitlines()[0]).parse_args(argv)
    device = torch.device("cuda")
    print("| workload | D | backward | fwd+bwd GPU ms | / kv_group 0 |")
    print("|---|---|---|---|---|")
    for head_dim, base in BACKWARD.items():
        for label, step in _steps(head_dim, device):
            times = {}
            for kv_group in (0, 1):
                config = BwdConfig(**{**base.to_dict(), "kv_group": kv_group})
                times[kv_group] = time_kernel(lambda: step(config), device).median_ms
                print(f"| {label} | {head_dim} | {config_label(config)} | {times[kv_group]:.4f} | "
                      f"{times[kv_group] / times[0]:.3f} |", flush=True)
