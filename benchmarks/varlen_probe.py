"""Where packed documents lose speed against a dense batch (issue 56): GPU ms of the packed
forward and backward over a sweep of Triton tiles, on the issue's 8 documents (16384 tokens) and
on 4 documents of 4096 tokens, beside a dense B4 L4096 call of the same work with the same tiles
(the dense path reads K and V through TMA; the packed one by pointer loads), and the dense call's
own choice (`auto`: the table, CUDA where it holds the key). bf16 causal H16 Hkv4 D128; GPU ms by
`timing.time_kernel` (L2 flushed, median of 20).

    python -m benchmarks varlen-probe [--backward]
    python -m benchmarks varlen-probe --padded-rows   # K/V rows padded past the head dim, as the
                                                      # adversarial suite lays them out, against contiguous

One markdown table on stdout."""

import argparse

import torch

from dmattn_bench import flash_dmattn_func, flash_dmattn_varlen_func
from dmattn_bench.bench.operators import operator
from dmattn_bench.space import BwdConfig, FwdConfig
from dmattn_bench.tuning.timing import time_kernel

ISSUE_DOCUMENTS = [4096, 700, 2900, 1500, 3100, 1024, 1964, 1100]
FORWARD_TILES = [FwdConfig(64, 64, 4, 3), FwdConfig(128, 64, 8, 3), FwdConfig(128, 128, 8, 2),
                 FwdConfig(128, 64, 4, 2), FwdConfig(64, 128, 4, 2), FwdConfig(128, 32, 4, 3)]
BACKWARD_TILES = [BwdConfig(64, 64, 128, 32, 4, 2), BwdConfig(64, 64, 64, 64, 4, 2), BwdConfig(64, 128, 128, 64, 8, 2),
                  BwdConfig(128, 64, 64, 128, 8, 2), BwdConfig(32, 128, 128, 64, 8, 2)]


def _label(config) -> str:
    return " ".join(f"{name}{value}" for name, value in config.to_dict().items())


def _tensors(documents, heads, heads_kv, head_dim, device):
    total = sum(documents)
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(total, h, head_dim, device=device, dtype=torch.bfloat16, generator=g, requires_grad=True)
               for h in (heads, heads_kv, heads_kv))
    cu = torch.tensor([0] + torch.tensor(documents).cumsum(0).tolist(), dtype=torch.int32, device=device)
    return q, k, v, cu


@operator("varlen-probe", help="GPU ms of packed documents over Triton tiles, beside a dense batch of the same work")
def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks varlen-probe", description=__doc__.splitlines()[0])
    parser.add_argument("--backward", action="store_true", help="also time forward+backward over backward tiles")
    parser.add_argument("--padded-rows", action="store_true",
                        help="only the forward on K/V rows padded past the head dim (the adversarial suite's "
                             "layout, strides no multiple of 16) against contiguous rows, the issue's documents")
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    rows = []
    if args.padded_rows:
        q, k, v, cu = _tensors(ISSUE_DOCUMENTS, 16, 4, 128, device)
        padded = [torch.zeros(t.shape[0], t.shape[1], 136, device=device, dtype=t.dtype)[..., :128] for t in (k, v)]
        for target, source in zip(padded, (k, v)):
            target.copy_(source.detach())
        longest = max(ISSUE_DOCUMENTS)
        for config in (FwdConfig(128, 64, 8, 3), FwdConfig(64, 64, 4, 3)):
            for label, keys, values in (("contiguous K/V", k, v), ("K/V padded to 136", *padded)):
                with torch.no_grad():
                    call = lambda: flash_dmattn_varlen_func(q, keys, values, cu, cu, longest, longest, is_causal=True,
                                                            backend="triton", fwd_config=config)
                    rows.append((label, "fwd", _label(config), time_kernel(call, device).median_ms))
    for label, documents in (() if args.padded_rows else (("issue 8 docs", ISSUE_DOCUMENTS), ("4 x 4096", [4096] * 4))):
        q, k, v, cu = _tensors(documents, 16, 4, 128, device)
        longest = max(documents)
        for config in FORWARD_TILES:
            with torch.no_grad():
                call = lambda: flash_dmattn_varlen_func(q, k, v, cu, cu, longest, longest, is_causal=True,
                                                        backend="triton", fwd_config=config)
                rows.append((label, "fwd", _label(config), time_kernel(call, device).median_ms))
        if args.backward:
            out = flash_dmattn_varlen_func(q, k, v, cu, cu, longest, longest, is_causal=True, backend="triton",
                                           fwd_config=FwdConfig(128, 64, 8, 3))
            grad = torch.randn_like(out)
            for config in BACKWARD_TILES:
                def step():
                    out = flash_dmattn_varlen_func(q, k, v, cu, cu, longest, longest, is_causal=True,
                                                   backend="triton", fwd_config=FwdConfig(128, 64, 8, 3),
                                                   bwd_config=config)
                    torch.autograd.grad(out, (q, k, v), grad)
                rows.append((label, "fwd+bwd", _label(config), time_kernel(step, device).median_ms))
    if not args.padded_rows:
        dense = [t.detach().reshape(4, 4096, *t.shape[1:]) for t in _tensors([4096] * 4, 16, 4, 128, device)[:3]]
        with torch.no_grad():
            for config in FORWARD_TILES:
                call = lambda: flash_dmattn_func(*dense, is_causal=True, backend="triton", fwd_config=config)
                rows.append(("dense B4 L4096", "fwd", _label(config), time_kernel(call, device).median_ms))
            call = lambda: flash_dmattn_func(*dense, is_causal=True)
            rows.append(("dense B4 L4096", "fwd", "auto", time_kernel(call, device).median_ms))
    print("| problem | pass | config | GPU ms |")
    print("|---|---|---|---|")
    for label, direction, config, ms in rows:
        print(f"| {label} | {direction} | {config} | {ms:.4f} |")
