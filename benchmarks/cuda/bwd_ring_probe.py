"""The warp-specialized CUDA backward (kernels/cuda/flash_bwd_ws.cu) on the bench's W1-W3 shapes
(`configs/workloads/peers.yaml`), backward alone, GPU time (`timing.time_kernel`, L2 flushed):
this tree's kernel at each cap on its ring of staged mask and bias tiles (`--caps`:
`shared_memory.MAX_SCORE_STAGES`) against a baseline source of the same kernel with the same host side
(`--baseline`, e.g. `git show REV:kernels/cuda/flash_bwd_ws.cu`), built beside it. Each
variant's gradients are compared bitwise with the first variant's (the kernels change scheduling,
not arithmetic) and against the Triton backward's (`flash_dmattn_func`).

    python -m benchmarks cuda-bwd-ring-probe [--baseline PATH] [--config 64x128w12s2] [--caps 1,2]

Prints one markdown table (stdout); progress to stderr."""

import argparse
import sys

import torch

from benchmarks.cuda.section_probe import bench_call, building, parse_config, print_table
from dmattn_bench import flash_dmattn_func
from dmattn_bench.bench.harness import load_peer_workloads
from dmattn_bench.bench.operators import operator
from dmattn_bench.registry import get_backend
from dmattn_bench.tuning.timing import time_kernel
from dmattn_kernels.cuda import build, driver, shared_memory
from dmattn_kernels.cuda.variants import backward_staging, staged_tiles

BASELINE = "bwd_ws_baseline"  # the baseline's build name: its own cache key beside "bwd_ws"


@operator("cuda-bwd-ring-probe", help="Warp-specialized CUDA backward on W1-W3 per ring cap, against a baseline source")
def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", help="a flash_bwd_ws.cu to time beside this tree's, at the default cap")
    parser.add_argument("--config", default="64x128w12s2")
    parser.add_argument("--caps", default=str(shared_memory.MAX_SCORE_STAGES),
                        help="ring caps to time this tree's kernel at")
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    config = parse_config(args.config, "bwd")
    cuda = get_backend("cuda")
    variants = [(f"this tree, ring <= {cap}", "bwd_ws", int(cap)) for cap in args.caps.split(",")]
    if args.baseline:
        build.SOURCES[BASELINE] = args.baseline
        variants.insert(0, ("baseline", BASELINE, shared_memory.MAX_SCORE_STAGES))
    rows = []
    for pw in load_peer_workloads("configs/workloads/peers.yaml"):
        x, (q, k, v, mask, bias), options, (out, lse, dout) = bench_call(pw, device)

        def grads():
            g = dict(dq=torch.empty_like(q), dk=torch.empty_like(k), dv=torch.empty_like(v))
            g["dbias"] = torch.empty_like(bias) if bias is not None and x.bias.requires_grad else None
            return g

        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        bias_leaf = None if bias is None else bias.detach().requires_grad_(x.bias.requires_grad)
        flash_dmattn_func(*leaves, mask, bias_leaf, is_causal=x.is_causal, backend="triton").backward(dout)
        reference = dict(dq=leaves[0].grad, dk=leaves[1].grad, dv=leaves[2].grad,
                         dbias=None if bias_leaf is None else bias_leaf.grad)
        first = None
        for label, source, cap in variants:
            slots = _slots(config, q, mask, bias, cap)
            driver._built = building("bwd_ws", source)
            g = grads()

            def run(g=g):
                cuda.backward(dout, q, k, v, out, lse, mask, bias, config=config, **g, **options)

            try:
                ms = time_kernel(run, device).median_ms
                run()
                same = "-" if first is None else str(all(
                    (first[n] is None and g[n] is None) or torch.equal(first[n], g[n]) for n in g))
                first = first or {n: None if t is None else t.clone() for n, t in g.items()}
                diff = max((g[n].float() - reference[n].float()).abs().max().item() for n in g if g[n] is not None)
                rows.append((pw.name, f"{label} ({slots} slots)", f"{ms:.3f}", same, f"{diff:.2e}"))
            except Exception as exc:  # a failed variant is a row, not the end of the probe
                rows.append((pw.name, label, "error", "-", str(exc).splitlines()[0][:160]))
            print(rows[-1], file=sys.stderr, flush=True)
    print_table(f"GPU: {torch.cuda.get_device_name()}, config {args.config}",
                ("workload", "backward", "GPU ms", "bitwise = first row", "max diff vs triton"), rows)


def _slots(config, q, mask, bias, cap):
    """Sets the ring cap to `cap`; the slots the launcher then gives this call's operands."""
    shared_memory.MAX_SCORE_STAGES = cap
    return backward_staging(config, q.shape[-1], mask is not None, None if bias is None else bias.dtype,
                            staged_tiles(mask, q.shape[1]), staged_tiles(bias, q.shape[1]))[0]
