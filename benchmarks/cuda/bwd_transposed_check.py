"""The warp-specialized CUDA backward's transposed layout (flash_bwd_ws.cu's DKV_TRANSPOSED, head
dims 129-192) on an SM90 GPU: the full adversarial suite, backward alone, at D192 and D160 (every
case moved there) in bf16 and fp16; then the whole backward's GPU time on the sweep's D192 rows
(bf16 B4 H16 Hkv4 L4096, causal and not) beside the H200 table's configs and SDPA-flash's
backward. Prints a short report.

    python -m benchmarks cuda-bwd-transposed-check [suite|time|all]

Exits 1 when a suite case fails (before the timing).
"""
import argparse
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import torch

from benchmarks.cuda.bwd_ws_check import kernel_times
from dmattn_bench.bench.operators import operator
from dmattn_bench.registry import get_backend
from dmattn_bench.space import BwdConfig, FwdConfig, config_label
from dmattn_bench.tuning.adversarial import build_inputs
from dmattn_bench.tuning.timing import time_kernel
from dmattn_bench.tuning.validator import check_case, config_suite, run_kernel

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


def check_suite(cuda) -> bool:
    """Every suite job, the variants built in parallel first; whether every case passed."""
    jobs = suite_jobs()
    start, errors = time.time(), []

    def build(job):
        bwd, case, dtype = job
        try:
            inputs = build_inputs(case, dtype, "cuda", 0)
            stand_in = (torch.empty_like(inputs.q), torch.empty(inputs.q.shape[0], inputs.q.shape[2],
                                                                inputs.q.shape[1], device="cuda"))
            with cuda.compile_only():
                run_kernel(cuda, inputs, case, None, bwd, forward=stand_in)
        except Exception as exc:  # noqa: BLE001
            errors.append(f"{case.name}: {type(exc).__name__}: {str(exc)[:200]}")

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(build, jobs))
    print(f"built the variants of {len(jobs)} case runs in {time.time() - start:.0f} s, {len(errors)} errors", flush=True)
    for error in sorted(set(errors))[:5]:
        print("  ", error)
    worst, fails, start = {}, [], time.time()
    for bwd, case, dtype in jobs:
        result = check_case(cuda, case, dtype, "cuda", None, bwd)
        if result.status not in ("ok", "unsupported"):
            fails.append(f"{config_label(bwd)} {str(dtype)[6:]} {case.name}: {result.status} {result.reason[:160]}")
        for name, check in result.checks.items():
            worst[name] = max(worst.get(name, 0.0), check.ratio)
    print(f"suite: {len(jobs)} case runs in {time.time() - start:.0f} s, {len(fails)} not ok; worst error/bound "
          + ", ".join(f"{n} {r:.3f}" for n, r in sorted(worst.items())), flush=True)
    for line in fails[:25]:
        print("  FAIL", line)
    return not fails


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
          help="Transposed warp-specialized CUDA backward (D129-192): the full suite, then the D192 sweep rows' timing")
def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", nargs="?", choices=("suite", "time", "all"), default="all",
                        help="the suite, the D192 timing or both (default: all)")
    what = parser.parse_args(argv).what
    print(torch.cuda.get_device_name(), flush=True)
    if what in ("time", "all"):
        time_d192()
    if what in ("suite", "all") and not check_suite(get_backend("cuda")):
        return 1
    return 0
