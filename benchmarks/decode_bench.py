"""Decode steps (one query row per sequence, a KV cache) on the local GPU: our short-query forward
against SDPA, GPU time, eager wall time and the fraction of the HBM bandwidth its K/V reads reach.

For each (B, Lk) of the grid, bf16, H 32, Hkv 8, D 128 by default:
- ours: no mask; a padding mask (B, 1, 1, Lk) with each sequence's last 1/8 of keys masked;
  `cache_seqlens` at 7/8 of Lk (memory past it NaN-filled, never read); the same over a paged
  cache (pages of PAGE keys shuffled in a pool, a block table);
- SDPA flash (no mask: it takes none) and SDPA memory-efficient with the padding mask as a
  float mask (K/V expanded to H heads, the way a float-mask user calls it).
Every row of ours is checked against the reference first (error / DESIGN §2 bound, NaN fails).
Bandwidth: the K/V bytes a step must read (the visible part of the cache) over its GPU time,
as a fraction of a device-to-device copy's rate measured in the same run.

    python benchmarks/decode_bench.py [--json out.json] [--heads 32 --heads-kv 8 --head-dim 128]
    python benchmarks/decode_bench.py --plot out.json --png out.png   # the figure, from a run's JSON

Prints one markdown table (stdout); progress to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from dmattn_bench import flash_dmattn_func
from dmattn_bench.reference import attention
from dmattn_bench.timing import eager_wall_ms, time_kernel
from dmattn_bench.validator import compare

GRID = ((1, 2048), (1, 8192), (8, 4096), (32, 4096), (64, 2048), (8, 32768), (64, 16384))
PAGE = 256  # keys per page of the paged variant (vLLM's and FlashAttention's common sizes: 16-256)
COPY_BYTES = 1 << 30


def copy_bandwidth(device) -> float:
    """Bytes per second of a 1 GiB device-to-device copy (read + write counted)."""
    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    timing = time_kernel(lambda: dst.copy_(src), device, repeats=20)
    return 2 * COPY_BYTES / (timing.median_ms * 1e-3)


def _check(out, q, k, v, mask, seqlens) -> float:
    """Error / bound of `out` by DESIGN §2 (`validator.compare`: the fp32 reference against the
    bf16 one); inf when anything is not finite."""
    high = attention(q, k, v, mask, cache_seqlens=seqlens)
    low = attention(q, k, v, mask, cache_seqlens=seqlens, compute_dtype=q.dtype)
    return compare("out", out, high, low, q.dtype).ratio


def plot(json_path: str, png_path: str) -> None:
    """GPU time over SDPA flash's, per shape and variant, from a run's JSON (no GPU needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(json_path) as f:
        run = json.load(f)
    rows = [r for r in run["rows"] if "over_sdpa_flash" in r and not r["variant"].startswith("SDPA flash")]
    shapes = list(dict.fromkeys((r["batch"], r["seqlen_k"]) for r in rows))
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    width = 0.8 / len(variants)
    fig, ax = plt.subplots(figsize=(10, 4.5))
    for index, variant in enumerate(variants):
        values = [next((r["over_sdpa_flash"] for r in rows if (r["batch"], r["seqlen_k"]) == shape
                        and r["variant"] == variant), float("nan")) for shape in shapes]
        ax.bar([x + index * width for x in range(len(shapes))], values, width, label=variant)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([x + width * (len(variants) - 1) / 2 for x in range(len(shapes))],
                  [f"B{b} Lk{lk}" for b, lk in shapes])
    ax.set_ylabel("GPU time / SDPA flash (no mask)")
    ax.set_yscale("log")
    ax.set_title(f"decode step, {run['device']}: lower is faster")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plot", metavar="JSON", help="draw the figure of a run's JSON and exit")
    parser.add_argument("--png", default="decode.png", help="where --plot writes the figure")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--heads-kv", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args()
    if args.plot:
        plot(args.plot, args.png)
        return
    device = torch.device("cuda")
    dtype = torch.bfloat16
    heads, heads_kv, head_dim = args.heads, args.heads_kv, args.head_dim
    bandwidth = copy_bandwidth(device)
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s", file=sys.stderr)
    rows = []
    for batch, seqlen_k in GRID:
        g = torch.Generator(device=device).manual_seed(0)
        q = torch.randn(batch, 1, heads, head_dim, device=device, dtype=dtype, generator=g)
        k, v = (torch.randn(batch, seqlen_k, heads_kv, head_dim, device=device, dtype=dtype, generator=g)
                for _ in range(2))
        valid = seqlen_k - seqlen_k // 8
        mask = torch.arange(seqlen_k, device=device).view(1, 1, 1, seqlen_k) < valid
        mask = mask.expand(batch, 1, 1, seqlen_k).contiguous()
        seqlens = torch.full((batch,), valid, dtype=torch.int32, device=device)
        k_cache, v_cache = k.clone(), v.clone()
        k_cache[:, valid:], v_cache[:, valid:] = float("nan"), float("nan")
        pages = seqlen_k // PAGE
        order = torch.randperm(batch * pages, device=device, generator=g)  # page p of the pool holds order[p]
        table = torch.empty_like(order).scatter_(0, order, torch.arange(batch * pages, device=device))
        table = table.view(batch, pages).to(torch.int32)
        k_pages, v_pages = (t.view(batch * pages, PAGE, heads_kv, head_dim)[order] for t in (k_cache, v_cache))
        kv_bytes = {"all": 2 * batch * seqlen_k * heads_kv * head_dim * 2,
                    "valid": 2 * batch * valid * heads_kv * head_dim * 2}
        # name -> (call, K/V bytes it must read, what its check compares, SDPA's kernel choice); the
        # choice is entered once around a variant's timing (entering it costs more host time than
        # a decode step)
        variants = {
            "ours, no mask": (lambda: flash_dmattn_func(q, k, v), "all", (k, v, None, None), None),
            "ours, padding mask": (lambda: flash_dmattn_func(q, k, v, mask), "valid", (k, v, mask, None), None),
            "ours, cache_seqlens": (lambda: flash_dmattn_func(q, k_cache, v_cache, cache_seqlens=seqlens), "valid",
                                    (k_cache, v_cache, None, seqlens), None),
            f"ours, paged ({PAGE}), cache_seqlens": (
                lambda: flash_dmattn_func(q, k_pages, v_pages, cache_seqlens=seqlens, block_table=table), "valid",
                (k_cache, v_cache, None, seqlens), None),
        }
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        float_mask = torch.zeros(batch, heads, 1, seqlen_k, device=device, dtype=dtype).masked_fill(~mask, float("-inf"))
        kt_full, vt_full = (t.repeat_interleave(heads // heads_kv, 1) for t in (kt, vt))
        variants["SDPA flash, no mask"] = (lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True),
                                           "all", None, SDPBackend.FLASH_ATTENTION)
        variants["SDPA efficient, padding mask"] = (
            lambda: F.scaled_dot_product_attention(qt, kt_full, vt_full, attn_mask=float_mask), "valid", None,
            SDPBackend.EFFICIENT_ATTENTION)
        flash_ms = None
        for name, (fn, read, check, sdpa_backend) in variants.items():
            print(f"B{batch} Lk{seqlen_k} {name}", file=sys.stderr, flush=True)
            row = dict(batch=batch, seqlen_k=seqlen_k, variant=name)
            try:
                with torch.no_grad(), sdpa_kernel(sdpa_backend) if sdpa_backend else contextlib.nullcontext():
                    if check is not None:
                        row["error_over_bound"] = _check(fn(), q, *check)
                    timing = time_kernel(fn, device, repeats=30)
                    row.update(gpu_ms=timing.median_ms, host_ms=timing.host_ms,
                               wall_ms=eager_wall_ms(fn, device, calls=50, loops=5))
                row["bandwidth_fraction"] = kv_bytes[read] / (timing.median_ms * 1e-3) / bandwidth
                if name.startswith("SDPA flash"):
                    flash_ms = timing.median_ms
            except Exception as exc:  # a peer that cannot take this shape is a row with its reason
                row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:100]}"
            rows.append(row)
        for row in rows[-len(variants):]:
            if flash_ms and "gpu_ms" in row:
                row["over_sdpa_flash"] = row["gpu_ms"] / flash_ms
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, H{heads} Hkv{heads_kv} D{head_dim}, "
          f"copy {bandwidth / 1e12:.2f} TB/s; GPU and eager wall ms per step (medians)\n")
    print("| B | Lk | variant | GPU ms | eager wall ms | wall / GPU | K/V read / copy BW | vs SDPA flash | err / bound |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        if "error" in row:
            print(f"| {row['batch']} | {row['seqlen_k']} | {row['variant']} | {row['error']} | | | | | |")
            continue
        err = row.get("error_over_bound")
        print(f"| {row['batch']} | {row['seqlen_k']} | {row['variant']} | {row['gpu_ms']:.4f} | {row['wall_ms']:.4f} "
              f"| {row['wall_ms'] / row['gpu_ms']:.2f} | {row['bandwidth_fraction']:.0%} "
              f"| {row.get('over_sdpa_flash', float('nan')):.2f}x | {'' if err is None else f'{err:.3f}'} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                           copy_bandwidth=bandwidth, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
