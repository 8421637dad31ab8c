"""CUDA forward on the GPU: the full adversarial suite (forward alone) for several configs in bf16
and fp16, then W3 dense causal timing against the Triton kernel and SDPA (flash / cuDNN).

    python -m benchmarks cuda-fwd-check   (prints a short report)
"""
import argparse
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from dmattn_bench.bench.operators import operator
from dmattn_bench.registry import Backend, get_backend
from dmattn_bench.space import FwdConfig
from dmattn_bench.tuning.adversarial import adversarial_cases
from dmattn_bench.tuning.timing import time_kernel
from dmattn_bench.tuning.validator import check_case, config_tiles
from dmattn_kernels import cuda as cuda_kernels
from dmattn_kernels.cuda import build as cb

# warps owning 32 rows (block_m = 32 x num_warps) and 16 rows (16 x num_warps); on sm90 the 16-row
# configs of 4 or 8 warps run wgmma where the head dim pads to a multiple of 64
CONFIGS = [FwdConfig(128, 64, 4, 2), FwdConfig(64, 32, 2, 3), FwdConfig(128, 128, 8, 2), FwdConfig(128, 64, 8, 2),
           FwdConfig(64, 32, 4, 3), FwdConfig(32, 32, 2, 1)]
# W3 timing: B2 H16 L4096 D128 causal bf16
B, H, L, D = 2, 16, 4096, 128
CUDA_TIMED = [FwdConfig(128, 64, 4, 2), FwdConfig(128, 64, 4, 3), FwdConfig(128, 32, 4, 2), FwdConfig(128, 32, 4, 3),
              FwdConfig(256, 64, 8, 2), FwdConfig(256, 32, 8, 2), FwdConfig(64, 64, 2, 2), FwdConfig(128, 128, 4, 2),
              FwdConfig(128, 64, 8, 2), FwdConfig(128, 128, 8, 2), FwdConfig(128, 128, 8, 3), FwdConfig(128, 64, 8, 3),
              FwdConfig(64, 128, 4, 2), FwdConfig(64, 64, 4, 3)]
TRITON_TIMED = [FwdConfig(128, 128, 8, 2), FwdConfig(128, 64, 8, 3), FwdConfig(64, 64, 4, 3)]


def no_backward(*a, **k):
    raise RuntimeError("no backward")


# Most suite cases use head dim 32, which runs mma.sync everywhere; the suite runs again at head
# dims 64 and 128, where the sm90 forward's 16-row configs run wgmma.
def suite(cfg):
    cases = adversarial_cases("full", config_tiles(cfg, None))
    return cases + [replace(c, name=f"{c.name}@d{d}", head_dim=d) for d in (64, 128) for c in cases if c.head_dim < d]


def check_suite(cuda) -> None:
    """The suite of every config in both dtypes, the nvcc cache warmed in parallel first."""
    t0 = time.time()
    jobs = set()
    for cfg in CONFIGS:
        for case in suite(cfg):
            for dt in (torch.bfloat16, torch.float16):
                bias_dtype = (torch.float32 if case.bias_fp32 else dt) if case.bias != "none" else None
                arch = cuda_kernels.arch_of(torch.device("cuda"))
                jobs.add(cuda_kernels.variant(cfg, case.head_dim, dt, bias_dtype, arch=arch, is_causal=case.causal,
                                              has_mask=case.mask != "none", softcap=case.softcap))
    errors = []

    def one(flags):
        try:
            cb.build("fwd", cuda_kernels.arch_of(torch.device("cuda")), flags)
        except Exception as exc:
            errors.append(str(exc)[:300])
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(one, sorted(jobs)))
    print(f"built {len(jobs)} variants in {time.time()-t0:.1f} s, {len(errors)} errors", flush=True)
    for e in errors[:3]:
        print("  ", e)
    worst = {}
    fails = []
    count = 0
    for cfg in CONFIGS:
        for dt in (torch.bfloat16, torch.float16):
            for case in suite(cfg):
                r = check_case(cuda, case, dt, "cuda", cfg, None)
                count += 1
                if r.status != "ok":
                    fails.append(f"{cfg} {dt} {case.name}: {r.status} {r.reason}")
                for n, c in r.checks.items():
                    worst[n] = max(worst.get(n, 0), c.ratio)
    print(f"suite: {count} case runs, {len(fails)} failures, worst ratio {worst}", flush=True)
    for f in fails[:15]:
        print("  FAIL", f)


def time_w3() -> None:
    """W3's forward GPU time: CUDA configs, Triton configs, SDPA flash and cuDNN."""
    q, k, v = (torch.randn(B, L, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out = torch.empty_like(q)
    lse = torch.empty(B, H, L, device="cuda", dtype=torch.float32)
    flops = 4 * B * H * L * L * D / 2
    rows = []
    tri = get_backend("triton")
    for name, launch_fn, cfgs in (("cuda", cuda_kernels.attention_forward, CUDA_TIMED),
                                  ("triton", tri.forward, TRITON_TIMED)):
        for cfg in cfgs:
            def f(launch_fn=launch_fn, cfg=cfg):
                launch_fn(q, k, v, None, None, is_causal=True, softmax_scale=D ** -0.5, softcap=0.0, config=cfg,
                          out=out, lse=lse)
            try:
                t = time_kernel(f, "cuda", warmup=3, repeats=30)
                rows.append((f"{name} {cfg.block_m}x{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages}", t.median_ms,
                             flops / t.median_ms / 1e9))
            except Exception as exc:
                rows.append((f"{name} {cfg}", float("nan"), str(exc)[:80]))
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    for sname, sb in (("sdpa flash", SDPBackend.FLASH_ATTENTION), ("sdpa cudnn", SDPBackend.CUDNN_ATTENTION)):
        def f():
            with sdpa_kernel(sb):
                F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
        try:
            t = time_kernel(f, "cuda", warmup=3, repeats=30)
            rows.append((sname, t.median_ms, flops / t.median_ms / 1e9))
        except Exception as exc:
            rows.append((sname, float("nan"), str(exc)[:80]))
    print("W3 fwd B2 H16 L4096 D128 causal bf16 (H-GPU: %s)" % torch.cuda.get_device_name())
    for r in rows:
        print(f"  {r[0]:32s} {r[1]:8.4f} ms  {r[2] if isinstance(r[2], str) else f'{r[2]:.0f} TFLOP/s'}")


@operator("cuda-fwd-check", help="CUDA forward: the full adversarial suite, then W3 timing against Triton and SDPA")
def main(argv: list[str]) -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    check_suite(Backend("cuda", cuda_kernels.attention_forward, no_backward, cuda_kernels.is_supported))
    time_w3()
