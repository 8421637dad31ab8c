"""The warp-specialized CUDA kernels (kernels/cuda/flash_fwd_ws.cu, flash_bwd_ws.cu) on the bench's
W1-W3 shapes (`configs/workloads/peers.yaml`), forward alone and backward alone, GPU time
(`timing.time_kernel`, L2 flushed before each run) at each L2 budget of their launch order's
sections (`forward.L2_SECTION_BYTES`, MiB; 0: one section of every head slice, the order before
sections). Each budget's outputs are compared bitwise with the first budget's (the order moves
CTAs, not arithmetic).

    python -m benchmarks cuda-section-probe [--budgets 0,32,16,8] [--fwd 128x128w12s2,192x64w16s2]
        [--bwd 64x128w12s2]

Prints one markdown table (stdout); progress to stderr."""

import argparse
import sys

import torch

from dmattn_bench.bench.harness import build_bench_inputs, load_peer_workloads
from dmattn_bench.bench.operators import operator
from dmattn_bench.registry import get_backend
from dmattn_bench.space import BwdConfig, FwdConfig
from dmattn_bench.tuning.timing import time_kernel
from dmattn_kernels.cuda import build, forward


def parse_config(text: str, direction: str) -> FwdConfig | BwdConfig:
    tiles, rest = text.split("w")
    warps, stages = (int(n) for n in rest.split("s"))
    block_m, block_n = (int(n) for n in tiles.split("x"))
    if direction == "fwd":
        return FwdConfig(block_m, block_n, warps, stages)
    return BwdConfig(block_m, block_n, block_m, block_n, warps, stages)


def bench_call(pw, device):
    """A bench workload's inputs, its operands (the bias detached), the call's options, and for a
    backward the CUDA forward's out and lse (128x128 w12 s2) and a random dout."""
    x = build_bench_inputs(pw, device)
    operands = (x.q, x.k, x.v, x.mask, x.bias.detach() if x.bias is not None else None)
    q = x.q
    options = dict(is_causal=x.is_causal, softmax_scale=q.shape[-1] ** -0.5, softcap=0.0)
    out, lse = torch.empty_like(q), torch.empty(q.shape[0], q.shape[2], q.shape[1], device=device)
    get_backend("cuda").forward(*operands, config=FwdConfig(128, 128, 12, 2), out=out, lse=lse, **options)
    return x, operands, options, (out, lse, torch.randn_like(q))


def flops(pw, direction: str) -> float:
    """The workload's FLOPs in one direction over the keys it reads (`bench.flops_needed`'s rule)."""
    return pw.workload.flops(direction) * pw.keys_read / pw.workload.seqlen_k


def building(kernel: str, source: str):
    """The launcher's cubin lookup with `kernel` ("fwd_ws", "bwd_ws") built from build name `source`:
    the kernel's own, or a probe's variant's (`build.SOURCES`), so each has its own cache key."""
    return lambda direction, arch, flags: build.build(source if direction == kernel else direction, arch, flags)


def print_table(title: str, columns: tuple[str, ...], rows: list[tuple[str, ...]]) -> None:
    """A probe's result: a title line, then a markdown table (stdout)."""
    print(title)
    print("\n| " + " | ".join(columns) + " |\n" + "|---" * len(columns) + "|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


@operator("cuda-section-probe", help="Warp-specialized CUDA kernels on W1-W3 by L2 section budget")
def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budgets", default="0,32,16,8", help="L2_SECTION_BYTES in MiB (0: every slice at once)")
    parser.add_argument("--fwd", default="128x128w12s2,192x64w16s2", help="forward configs ('' for none)")
    parser.add_argument("--bwd", default="64x128w12s2", help="backward configs ('' for none)")
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    cuda = get_backend("cuda")
    budgets = [int(b) for b in args.budgets.split(",")]
    configs = [("fwd", parse_config(c, "fwd"), c) for c in args.fwd.split(",") if c]
    configs += [("bwd", parse_config(c, "bwd"), c) for c in args.bwd.split(",") if c]
    rows = []
    for pw in load_peer_workloads("configs/workloads/peers.yaml"):
        x, (q, k, v, mask, bias), options, (out, lse, dout) = bench_call(pw, device)
        for direction, config, text in configs:
            first = None
            for budget in budgets:
                forward.L2_SECTION_BYTES = (budget << 20) if budget else 1 << 62
                forward._signature_launch.cache_clear()
                if direction == "fwd":
                    results = dict(out=torch.empty_like(q), lse=torch.empty_like(lse))

                    def run(r=results, c=config):
                        cuda.forward(q, k, v, mask, bias, config=c, **r, **options)
                else:
                    results = dict(dq=torch.empty_like(q), dk=torch.empty_like(k), dv=torch.empty_like(v),
                                   dbias=torch.empty_like(bias) if bias is not None and x.bias.requires_grad else None)

                    def run(r=results, c=config):
                        cuda.backward(dout, q, k, v, out, lse, mask, bias, config=c, **r, **options)

                try:
                    ms = time_kernel(run, device, repeats=30).median_ms
                    run()
                    done = {n: t.clone() for n, t in results.items() if t is not None}
                    same = "-" if first is None else str(all(torch.equal(first[n], done[n]) for n in done))
                    first = first or done
                    rows.append((pw.name, direction, text, str(budget or "all"), f"{ms:.3f}",
                                 f"{flops(pw, direction) / ms / 1e9:.0f}", same))
                except Exception as exc:  # a failed variant is a row, not the end of the probe
                    rows.append((pw.name, direction, text, str(budget), "error", str(exc).splitlines()[0][:160], "-"))
                print(rows[-1], file=sys.stderr, flush=True)
    print_table(f"GPU: {torch.cuda.get_device_name()}", ("workload", "direction", "config", "L2 budget MiB", "GPU ms",
                                                         "TFLOP/s", "bitwise = first budget"), rows)
