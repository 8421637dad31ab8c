"""Long rows with a large row max (review of the online-softmax rescale): CUDA forward vs a
float64 softmax, one query block over 32768 keys (512 tiles of 64), non-causal, bf16.

A rescale factor that is not exactly 1 when the row max is unchanged compounds over the tiles
and weights early keys apart from late ones; this check makes that visible.

    python -m benchmarks cuda-long-row-check   (on a CUDA GPU)
"""
import argparse

import torch

from dmattn_bench.bench.operators import operator
from dmattn_bench.registry import get_backend
from dmattn_bench.space import FwdConfig

B, H, LQ, LK, D = 1, 2, 128, 32768, 128


@operator("cuda-long-row-check", help="CUDA forward over 32768 keys with a large row max against a float64 softmax")
def main(argv: list[str]) -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    cuda = get_backend("cuda")
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, L, H, D, device="cuda", dtype=torch.bfloat16) for L in (LQ, LK, LK))
    scale = D ** -0.5
    exact_scores = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) * scale
    for label, offset in (("bias -1e4 + N(0,1)", -1e4), ("bias +1e3 + N(0,1)", 1e3), ("no offset", 0.0)):
        bias = (offset + torch.randn(B, H, LQ, LK, device="cuda")).to(torch.bfloat16)
        scores = exact_scores + bias.double()
        lse_ref = torch.logsumexp(scores, dim=-1)
        out_ref = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(scores, dim=-1), v.double())
        for config in (FwdConfig(128, 64, 4, 2), FwdConfig(64, 64, 4, 2)):
            out = torch.empty_like(q)
            lse = torch.empty(B, H, LQ, device="cuda", dtype=torch.float32)
            cuda.forward(q, k, v, None, bias, is_causal=False, softmax_scale=scale, softcap=0.0, config=config,
                         out=out, lse=lse)
            out_err = (out.double() - out_ref).abs().max().item() / out_ref.abs().max().item()
            lse_err = (lse.double() - lse_ref).abs().max().item()
            print(f"{label:20s} {config.block_m}x{config.block_n} w{config.num_warps}: out max|err|/max|ref| "
                  f"{out_err:.2e}, lse max|err| {lse_err:.2e}", flush=True)
