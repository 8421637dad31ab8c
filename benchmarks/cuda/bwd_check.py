"""CUDA backward on the GPU: the full adversarial suite, forward + backward through the cuda
backend, for several config pairs in bf16 and fp16; then W3 dense causal (B2 H16 L4096 D128
bf16) forward and backward timing of CUDA configs against the Triton kernels and SDPA.

    python -m benchmarks cuda-bwd-check [suite|time|all]   (prints a short report)
"""
import argparse
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import torch
import torch.nn.functional as F

from dmattn_bench.bench.operators import operator
from dmattn_bench.registry import get_backend
from dmattn_bench.space import BwdConfig, FwdConfig, config_label
from dmattn_bench.tuning.adversarial import adversarial_cases, build_inputs
from dmattn_bench.tuning.timing import time_kernel
from dmattn_bench.tuning.validator import check_case, config_tiles, run_kernel

DTYPES = (torch.bfloat16, torch.float16)
# On sm90 the first two pairs run wgmma in both directions where the head dim pads to a multiple
# of 64, the third in the backward only; most suite cases use head dim 32 (mma.sync), so the
# wgmma pairs run the suite again at head dims 64 and 128.
WGMMA_PAIRS = 2
PAIRS = [
    (FwdConfig(128, 128, 8, 2), BwdConfig(64, 128, 128, 64, 8, 2)),
    (FwdConfig(64, 64, 4, 2), BwdConfig(32, 64, 64, 32, 4, 2)),
    (FwdConfig(128, 64, 4, 2), BwdConfig(64, 64, 64, 64, 4, 2)),
    (FwdConfig(128, 64, 8, 2), BwdConfig(32, 64, 64, 32, 4, 2)),
    (FwdConfig(64, 32, 4, 1), BwdConfig(16, 64, 64, 16, 4, 1)),
    (FwdConfig(32, 32, 2, 3), BwdConfig(32, 32, 32, 16, 2, 3)),
]


def suite(index, fwd, bwd):
    cases = adversarial_cases("full", config_tiles(fwd, bwd))
    if index >= WGMMA_PAIRS:
        return cases
    return cases + [replace(c, name=f"{c.name}@d{d}", head_dim=d) for d in (64, 128) for c in cases if c.head_dim < d]


def check_suite(cuda) -> None:
    """The suite of every config pair in both dtypes, the variants built in parallel first."""
    # build every variant the suite needs in parallel (nvcc runs as a subprocess per variant)
    start = time.time()
    jobs = [(fwd, bwd, case, dtype) for i, (fwd, bwd) in enumerate(PAIRS) for case in suite(i, fwd, bwd)
            for dtype in DTYPES]
    errors = []

    def warm(job):
        fwd, bwd, case, dtype = job
        try:
            inputs = build_inputs(case, dtype, "cuda", 0)
            with cuda.compile_only():
                run_kernel(cuda, inputs, case, fwd, bwd)
        except Exception as exc:  # noqa: BLE001
            errors.append(f"{case.name}: {type(exc).__name__}: {str(exc)[:200]}")

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(warm, jobs))
    print(f"built the variants of {len(jobs)} case runs in {time.time() - start:.1f} s, {len(errors)} errors", flush=True)
    for error in sorted(set(errors))[:5]:
        print("  ", error)
    worst, fails, count = {}, [], 0
    start = time.time()
    for i, (fwd, bwd) in enumerate(PAIRS):
        for dtype in DTYPES:
            for case in suite(i, fwd, bwd):
                result = check_case(cuda, case, dtype, "cuda", fwd, bwd)
                count += 1
                if result.status != "ok":
                    fails.append(f"{config_label(fwd)} / {config_label(bwd)} {str(dtype)[6:]} {case.name}: "
                                 f"{result.status} {result.reason[:160]}")
                for name, check in result.checks.items():
                    worst[name] = max(worst.get(name, 0.0), check.ratio)
    print(f"suite: {count} case runs in {time.time() - start:.0f} s, {len(fails)} not ok; worst error/bound "
          + ", ".join(f"{n} {r:.3f}" for n, r in worst.items()), flush=True)
    for line in fails[:25]:
        print("  FAIL", line)


def time_w3() -> None:
    """W3's forward and backward GPU time: CUDA configs, the Triton kernels and SDPA."""
    B, H, L, D = 2, 16, 4096, 128
    dtype = torch.bfloat16
    torch.manual_seed(0)
    q, k, v, dout = (torch.randn(B, L, H, D, device="cuda", dtype=dtype) for _ in range(4))
    options = dict(is_causal=True, softmax_scale=D ** -0.5, softcap=0.0)
    out = torch.empty_like(q)
    lse = torch.empty(B, H, L, device="cuda", dtype=torch.float32)
    get_backend("triton").forward(q, k, v, None, None, config=FwdConfig(64, 64, 4, 3), out=out, lse=lse, **options)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    fwd_flops = 4 * B * H * L * L * D / 2  # the causal half
    rows = []

    def record(label, direction, fn):
        try:
            ms = time_kernel(fn, "cuda").median_ms
            flops = fwd_flops * (2.5 if direction == "bwd" else 1.0)
            rows.append((label, direction, ms, flops / ms / 1e9))
        except Exception as exc:  # noqa: BLE001
            rows.append((label + f" ({type(exc).__name__}: {str(exc)[:80]})", direction, float("nan"), float("nan")))

    for name in ("cuda", "triton"):
        backend = get_backend(name)
        fwds = ([FwdConfig(128, 64, 4, 2), FwdConfig(128, 128, 8, 2), FwdConfig(128, 128, 8, 3),
                 FwdConfig(128, 64, 8, 2)] if name == "cuda" else [FwdConfig(64, 64, 4, 3)])
        bwds = ([BwdConfig(64, 64, 64, 64, 4, 2), BwdConfig(32, 64, 64, 32, 4, 2), BwdConfig(64, 128, 128, 64, 8, 2),
                 BwdConfig(32, 128, 128, 32, 8, 2), BwdConfig(64, 128, 128, 128, 8, 2),
                 BwdConfig(128, 128, 128, 64, 8, 2), BwdConfig(64, 128, 128, 64, 8, 3), BwdConfig(64, 64, 64, 128, 4, 2),
                 BwdConfig(128, 64, 64, 128, 4, 2)]
                if name == "cuda" else [BwdConfig(32, 64, 64, 32, 4, 2), BwdConfig(64, 128, 128, 64, 8, 2)])
        for config in fwds:
            o2, l2 = torch.empty_like(q), torch.empty_like(lse)
            record(f"{name} {config_label(config)}", "fwd",
                   lambda c=config: backend.forward(q, k, v, None, None, config=c, out=o2, lse=l2, **options))
        for config in bwds:
            record(f"{name} {config_label(config)}", "bwd",
                   lambda c=config: backend.backward(dout, q, k, v, out, lse, None, None, config=c, dq=dq, dk=dk,
                                                     dv=dv, dbias=None, **options))
    qt, kt, vt = (t.transpose(1, 2).detach().requires_grad_() for t in (q, k, v))
    dt = dout.transpose(1, 2)
    from torch.nn.attention import SDPBackend, sdpa_kernel
    for label, kernel in (("sdpa flash", SDPBackend.FLASH_ATTENTION), ("sdpa cudnn", SDPBackend.CUDNN_ATTENTION)):
        with sdpa_kernel(kernel):
            record(label, "fwd", lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True))
            result = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
            record(label, "bwd", lambda: torch.autograd.grad(result, (qt, kt, vt), dt, retain_graph=True))
    print(f"W3 B{B} H{H} L{L} D{D} causal bf16; TFLOP/s over the causal half (bwd: 2.5x the fwd FLOPs)")
    for label, direction, ms, tflops in rows:
        print(f"  {direction} {label:44s} {ms:8.4f} ms {tflops:6.0f} TFLOP/s")


@operator("cuda-bwd-check", help="CUDA backward: the full adversarial suite, then W3 timing against Triton and SDPA")
def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", nargs="?", choices=("suite", "time", "all"), default="all",
                        help="the suite, the W3 timing or both (default: all)")
    what = parser.parse_args(argv).what
    print(torch.cuda.get_device_name(), flush=True)
    if what in ("suite", "all"):
        check_suite(get_backend("cuda"))
    if what in ("time", "all"):
        time_w3()
