"""The warp-specialized CUDA forward (kernels/cuda/flash_fwd_ws.cu) on the bench's W1-W3 shapes
(`configs/workloads/peers.yaml`, or `--workloads`), forward alone, GPU time
(`timing.time_kernel`, L2 flushed): other sources of that kernel with the same host side
(`--variants NAME=DIR,...`: each DIR a flash_fwd_ws.cu and the headers it includes, e.g. from
`git show REV:...`), built beside it at the knobs `--variant-knobs` names (default off), then
this tree's at each set of kernel knobs (`--knobs`: FwdConfig.overlap, persistent; "off" for
none). Each variant's out and lse are compared bitwise with the first variant's (overlap's
softmax rounds otherwise: the scale in the exp, rows reduced as trees; persistent moves work
items, not arithmetic), and out against the Triton forward's (`flash_dmattn_func`).

    python -m benchmarks cuda-fwd-variants-probe [--variants baseline=DIR,...] [--variant-knobs overlap]
        [--configs 128x128w12s2,192x64w16s2] [--knobs off,overlap,overlap+persistent]
        [--workloads configs/workloads/peers.yaml]

Prints one markdown table (stdout); progress to stderr."""

import argparse
import hashlib
import sys
from dataclasses import replace
from pathlib import Path

import torch

from benchmarks.cuda.section_probe import bench_call, building, flops, parse_config, print_table
from dmattn_bench import flash_dmattn_func
from dmattn_bench.bench.harness import load_peer_workloads
from dmattn_bench.bench.operators import operator
from dmattn_bench.registry import get_backend
from dmattn_bench.space import FWD_KNOBS
from dmattn_bench.tuning.timing import time_kernel
from dmattn_kernels.cuda import build, driver, forward


@operator("cuda-fwd-variants-probe", help="Warp-specialized CUDA forward on W1-W3: other sources and kernel knobs")
def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default="", help="NAME=DIR,...: folders with a flash_fwd_ws.cu (and the "
                        "headers it includes) to time, knobs off, before this tree's")
    parser.add_argument("--configs", default="128x128w12s2,192x64w16s2")
    parser.add_argument("--knobs", default="off,overlap,overlap+persistent",
                        help=f"sets of kernel knobs ({', '.join(FWD_KNOBS)}) joined by '+', 'off' for none: this "
                        "tree's kernel is timed at each (default: off,overlap,overlap+persistent)")
    parser.add_argument("--variant-knobs", default="off",
                        help="the kernel knobs the --variants are timed at ('+'-joined, or 'off')")
    parser.add_argument("--workloads", default="configs/workloads/peers.yaml", help="a workloads file of peers.yaml's form")
    args = parser.parse_args(argv)
    knob_sets = [{} if text == "off" else dict.fromkeys(text.split("+"), 1) for text in args.knobs.split(",")]
    variant_knobs = {} if args.variant_knobs == "off" else dict.fromkeys(args.variant_knobs.split("+"), 1)
    unknown = sorted({name for knobs in [*knob_sets, variant_knobs] for name in knobs} - set(FWD_KNOBS))
    if unknown:
        parser.error(f"--knobs, --variant-knobs: unknown knob(s) {unknown}; expected {list(FWD_KNOBS)} joined by '+', or 'off'")
    device = torch.device("cuda")
    cuda = get_backend("cuda")
    variants = []
    for item in filter(None, args.variants.split(",")):
        name, folder = item.split("=", 1)
        # the build cache keys the package's sources, not a variant's: its build name carries its own
        digest = hashlib.sha256(b"".join(f.read_bytes() for f in sorted(Path(folder).glob("*.cu*")))).hexdigest()[:12]
        build.SOURCES[f"fwd_ws_{name}_{digest}"] = Path(folder) / "flash_fwd_ws.cu"
        variants.append((name, f"fwd_ws_{name}_{digest}", variant_knobs))
    variants += [(f"this tree {'+'.join(knobs) or 'off'}", "fwd_ws", knobs) for knobs in knob_sets]
    rows = []
    for pw in load_peer_workloads(args.workloads):
        x, (q, k, v, mask, bias), options, _ = bench_call(pw, device)
        with torch.no_grad():
            reference = flash_dmattn_func(q, k, v, mask, bias, is_causal=x.is_causal, backend="triton")
        for text in args.configs.split(","):
            tiles = parse_config(text, "fwd")
            first = None
            for label, source, knobs in variants:
                config = replace(tiles, **knobs)
                driver._built = building("fwd_ws", source)
                forward._signature_launch.cache_clear()  # a plan holds its launcher's cubin
                results = dict(out=torch.empty_like(q), lse=torch.empty(q.shape[0], q.shape[2], q.shape[1], device=device))

                def run(r=results, config=config):
                    cuda.forward(q, k, v, mask, bias, config=config, **r, **options)

                try:
                    ms = time_kernel(run, device, repeats=30).median_ms
                    run()
                    done = {n: t.clone() for n, t in results.items()}
                    same = "-" if first is None else str(all(torch.equal(first[n], done[n]) for n in done))
                    first = first or done
                    diff = (done["out"].float() - reference.float()).abs().max().item()
                    rows.append((pw.name, text, label, f"{ms:.3f}", f"{flops(pw, 'fwd') / ms / 1e9:.0f}", same,
                                 f"{diff:.2e}"))
                except Exception as exc:  # a failed variant is a row, not the end of the probe
                    rows.append((pw.name, text, label, "error", "-", "-", str(exc).splitlines()[0][:160]))
                print(rows[-1], file=sys.stderr, flush=True)
    print_table(f"GPU: {torch.cuda.get_device_name()}", ("workload", "config", "forward", "GPU ms", "TFLOP/s",
                                                         "bitwise = first row", "max diff vs triton"), rows)
