"""CUDA fwd/bwd configs per head dim on B2 H16 L4096 causal bf16 (W3 shape at D=128): the
measurements behind tiles.CUDA_SM90_DEFAULTS (h200-wgmma-defaults-sweep.txt; the earlier
mma.sync-only run behind CUDA_DEFAULTS is h200-defaults-sweep.txt).

    python -m benchmarks cuda-defaults-sweep   (on a CUDA GPU; prints one line per config)
"""
import argparse

import torch

from dmattn_bench.bench.operators import operator
from dmattn_bench.registry import get_backend
from dmattn_bench.space import BwdConfig, FwdConfig, config_label
from dmattn_bench.tuning.timing import time_kernel

# On sm90 the configs of 16 rows per warp in whole warpgroups run wgmma (dmattn_kernels.cuda.uses_wgmma), the
# others (32 rows per warp, 2 warps, 16-row tiles) mma.sync.
FWD = {64: [(128, 128, 8, 2), (128, 64, 8, 2), (128, 128, 8, 3), (64, 128, 4, 2), (64, 64, 4, 2), (128, 64, 4, 2)],
       128: [(128, 128, 8, 2), (128, 128, 8, 3), (128, 64, 8, 2), (128, 64, 8, 3), (64, 128, 4, 2), (64, 64, 4, 3),
             (128, 64, 4, 2)],
       256: [(128, 64, 8, 2), (128, 32, 8, 2), (64, 64, 4, 2), (64, 32, 4, 2), (128, 64, 8, 1), (128, 32, 8, 3)]}
BWD = {64: [(64, 64, 64, 64, 4, 2), (128, 64, 64, 128, 4, 2), (64, 128, 128, 64, 8, 2), (128, 128, 128, 128, 8, 2),
            (64, 64, 64, 128, 4, 2), (128, 64, 64, 64, 4, 2)],
       128: [(64, 64, 64, 64, 4, 2), (64, 64, 64, 64, 4, 3), (32, 64, 64, 64, 4, 2), (64, 64, 64, 32, 4, 2),
             (64, 128, 128, 128, 8, 2), (64, 128, 128, 64, 8, 2)],
       256: [(32, 64, 64, 32, 4, 1), (32, 64, 64, 32, 4, 2), (16, 64, 64, 16, 4, 1), (16, 64, 64, 16, 4, 2),
             (64, 64, 64, 64, 4, 1)]}
B, H, L = 2, 16, 4096


@operator("cuda-defaults-sweep", help="CUDA forward and backward configs per head dim on W3's shape")
def main(argv: list[str]) -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    cuda = get_backend("cuda")
    for D in (64, 128, 256):
        q, k, v, do = (torch.randn(B, L, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        out = torch.empty_like(q); lse = torch.empty(B, H, L, device="cuda", dtype=torch.float32)
        opts = dict(is_causal=True, softmax_scale=D ** -0.5, softcap=0.0)
        flops = 4 * B * H * L * L * D / 2
        get_backend("triton").forward(q, k, v, None, None, config=FwdConfig(64, 32, 4, 2), out=out, lse=lse, **opts)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        for c in FWD[D]:
            cfg = FwdConfig(*c); o2, l2 = torch.empty_like(q), torch.empty_like(lse)
            try:
                ms = time_kernel(lambda: cuda.forward(q, k, v, None, None, config=cfg, out=o2, lse=l2, **opts),
                                 "cuda").median_ms
                print(f"D{D} fwd {config_label(cfg):28s} {ms:7.4f} ms {flops / ms / 1e9:5.0f} TFLOP/s", flush=True)
            except Exception as e:
                print(f"D{D} fwd {config_label(cfg):28s} {type(e).__name__}: {str(e)[:90]}")
        for c in BWD[D]:
            cfg = BwdConfig(*c)
            try:
                ms = time_kernel(lambda: cuda.backward(do, q, k, v, out, lse, None, None, config=cfg, dq=dq, dk=dk,
                                                       dv=dv, dbias=None, **opts), "cuda").median_ms
                print(f"D{D} bwd {config_label(cfg):28s} {ms:7.4f} ms {2.5 * flops / ms / 1e9:5.0f} TFLOP/s",
                      flush=True)
            except Exception as e:
                print(f"D{D} bwd {config_label(cfg):28s} {type(e).__name__}: {str(e)[:90]}")
