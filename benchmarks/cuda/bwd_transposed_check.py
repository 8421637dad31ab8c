"""The warp-specialized CUDA backward's transposed layout (flash_bwd_ws.cu's DKV_TRANSPOSED, head
dims 136-192) on an SM90 GPU: the full adversarial suite, backward alone, at D192 and D160 (every
case moved there) in bf16 and fp16; then the whole backward's GPU time on the sweep's D192 rows
(bf16 B4 H16 Hkv4 L4096, causal and not) beside the H200 table's configs and SDPA-flash's
backward. Prints a short report.

    python -m benchmarks cuda-bwd-transposed-check [suite|time|all]

Exits 1 when a suite case fails (before the timing).
"""
import argparse
from dataclasses import replace

import torch

from benchmarks.cuda.bwd_ws_check import check_suite, kernel_times
from dmattn_bench.bench.operators import operator
from dmattn_bench.registry import get_backend
from dmattn_bench.space import BwdConfig, FwdConfig, config_label
from dmattn_bench.tuning.timing import time_kernel
from dmattn_bench.tuning.validator import config_suite

TRANSPOSED_CONFIGS = (BwdConfig(64, 96, 64, 96, 12, 1), BwdConfig(64, 64, 64, 64, 12, 2))
HEAD_DIMS = (192, 160)  # 160 runs on tiles of 192 (SWIZZLE_PADDED)
DTYPES = (torch.bfloat16, torch.float16)
# The H200 table's D192 backward entries for the sweep's dense rows (results/tables/nvidia-h200-sm90.yaml)
TABLE = {True: ("cuda", BwdConfig(64, 128, 128, 64, 8, 2)), False: ("triton", BwdConfig(64, 64, 64, 64, 8, 2))}
FORWARD = FwdConfig(128, 64, 12, 3)  # the table's D192 forward


def suite_jobs():
    """(config, case, dtype) of every suite case at each of HEAD_DIMS, for each config."""
    return [(bwd, replace(case, name=f"{case.name}@d{head_dim}", head_dim=head_dim), dtype)
            for bwd in TRANSPOSED_CONFIGS for case in config_suite("cuda", "full", None, bwd)
            for head_dim in HEAD_DIMS for dtype in DTYPES]


def time_d192() -> None:
    """The sweep's D192 backward, causal and not: the table's config, each transposed config,
    SDPA-flash's backward (its kernels through autograd, K and V repeated to the query heads)."""
    cuda, triton = get_backend("cuda"), get_backend("triton")
    B, H, HKV, L, D = 4, 16, 4, 4096, 192
    rows = []
    for causal in (True, False):
        torch.manual_seed(0)
        q, dout = (torch.randn(B, L, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        k, v = (torch.randn(B, L, HKV, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        options = dict(is_causal=causal, softmax_scale=D ** -0.5, softcap=0.0)
        out, lse = torch.empty_like(q), torch.empty(B, H, L, device="cuda")
        cuda.forward(q, k, v, None, None, config=FORWARD, out=out, lse=lse, **options)
        shape = f"D192 {'causal' if causal else 'full'}"
        reference = None
        backend_name, table_config = TABLE[causal]
        for backend, config in (((triton if backend_name == "triton" else cuda), table_config),
                                *((cuda, c) for c in TRANSPOSED_CONFIGS)):
            g = dict(dq=torch.empty_like(q), dk=torch.empty_like(k), dv=torch.empty_like(v))

            def run(b=backend, c=config, g=g):
                b.backward(dout, q, k, v, out, lse, None, None, config=c, dbias=None, **g, **options)

            label = f"{backend.name} {config_label(config)}"
            ms = time_kernel(run, "cuda").median_ms
            run()
            reference = reference or {n: t.float().clone() for n, t in g.items()}
            diff = max((g[n].float() - reference[n]).abs().max().item() for n in g)
            finite = all(torch.isfinite(t).all().item() for t in g.values())
            rows.append((shape, label, ms, finite, diff))
            print(rows[-1], flush=True)
            if config == TRANSPOSED_CONFIGS[0]:
                rows += [(shape, f"  {name}", ms, "-", float("nan")) for name, ms in kernel_times(run)]
        from torch.nn.attention import SDPBackend, sdpa_kernel

        qs, ks, vs = (t.transpose(1, 2).detach().requires_grad_() for t in
                      (q, k.repeat_interleave(H // HKV, dim=2), v.repeat_interleave(H // HKV, dim=2)))
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            o = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=causal)
        grad = dout.transpose(1, 2)

        def sdpa_backward():
            torch.autograd.grad(o, (qs, ks, vs), grad, retain_graph=True)

        rows.append((shape, "sdpa-flash backward", time_kernel(sdpa_backward, "cuda").median_ms, True, float("nan")))
        print(rows[-1], flush=True)
    print("\nshape | backward | gpu ms (median, whole backward) | finite | max|diff| vs the table's config")
    for shape, label, ms, finite, diff in rows:
        print(f"{shape} | {label} | {ms:.3f} | {finite} | {diff:.2e}")
    print("(rows indented: the profiler's mean per kernel, without the L2 flush)")


@operator("cuda-bwd-transposed-check",
          help="Transposed warp-specialized CUDA backward (D136-D192): the full suite, then the D192 sweep rows' timing")
def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", nargs="?", choices=("suite", "time", "all"), default="all",
                        help="the suite, the D192 timing or both (default: all)")
    what = parser.parse_args(argv).what
    print(torch.cuda.get_device_name(), flush=True)
    if what in ("time", "all"):
        time_d192()
    if what in ("suite", "all") and not check_suite(get_backend("cuda"), suite_jobs()):
        return 1
    return 0
