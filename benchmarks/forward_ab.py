"""GPU and host time of a forward without gradient on masked workloads (dense-random, tile-sparse,
padding, sliding window), one checkout against another on the same GPU: run it once with the
other checkout's packages first on PYTHONPATH (a folder holding its dmattn_bench, its kernels as
dmattn_kernels, and its configs) and once with this one's, so both run the same tiles whatever
table each would pick, and the second compares its outputs with the first's. From the repository
root (`-P` keeps the current folder's packages from coming before PYTHONPATH's; the configs
file holds each workload's backend and config, the first run's table choice):

    PYTHONPATH=old:$PWD python -P -m benchmarks forward-ab --label before --table T.yaml \
        --write-configs c.json --save b.pt
    python -m benchmarks forward-ab --label after --read-configs c.json --compare b.pt

Prints one markdown table (stdout): GPU ms (`timing.time_kernel`), host µs per call
(`timing.host_us`), the largest difference from the saved outputs."""

import argparse
import json
from pathlib import Path

import torch

from dmattn_bench import flash_dmattn_func
from dmattn_bench import plan as plans
from dmattn_bench.bench.operators import operator
from dmattn_bench.space import FwdConfig, as_4d
from dmattn_bench.tuning.timing import host_us, time_kernel


def workloads(device):
    g = torch.Generator(device=device).manual_seed(0)
    bf = torch.bfloat16

    def qkv(b, l, h, hk, d=128):
        return (torch.randn(b, l, h, d, device=device, dtype=bf, generator=g),
                torch.randn(b, l, hk, d, device=device, dtype=bf, generator=g),
                torch.randn(b, l, hk, d, device=device, dtype=bf, generator=g))

    q, k, v = qkv(2, 4096, 16, 16)
    yield "W1 full mask+bias", (q, k, v, torch.rand(2, 16, 4096, 4096, device=device, generator=g) < 0.5,
                                torch.randn(2, 16, 4096, 4096, device=device, dtype=bf, generator=g), True)
    q, k, v = qkv(2, 4096, 16, 4)
    mask = torch.rand(2, 4, 4096, 4096, device=device, generator=g) < 0.5
    bias = torch.randn(2, 4, 1, 4096, device=device, dtype=bf, generator=g)
    yield "W2 kv mask, per-key bias", (q, k, v, mask, bias, True)
    tiles = torch.rand(2, 4, 16, 16, device=device, generator=g) < 0.25
    sparse = mask & tiles.repeat_interleave(256, 2).repeat_interleave(256, 3)
    yield "W2, 25% of 256x256 tiles", (q, k, v, sparse, bias, True)
    pad = (torch.arange(4096, device=device) < 3072).expand(2, 1, 1, 4096)
    yield "padding mask, non-causal", (q, k, v, pad, bias, False)
    q, k, v = qkv(1, 8192, 16, 4)
    i = torch.arange(8192, device=device)
    band = ((i[None, :] > i[:, None] - 1024)).expand(1, 1, 8192, 8192)
    yield "L8192 window 1024, causal", (q, k, v, band, torch.randn(1, 4, 1, 8192, device=device, dtype=bf,
                                                                   generator=g), True)


@operator("forward-ab", help="GPU and host time of masked forwards, one checkout against another on one GPU")
def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", required=True)
    parser.add_argument("--table")
    parser.add_argument("--write-configs")
    parser.add_argument("--read-configs")
    parser.add_argument("--save")
    parser.add_argument("--compare")
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    configs = json.loads(Path(args.read_configs).read_text()) if args.read_configs else {}
    earlier = torch.load(args.compare) if args.compare else {}
    outputs, rows = {}, []
    for name, (q, k, v, mask, bias, causal) in workloads(device):
        if name not in configs:
            backend, config = plans.select("fwd", q, k, as_4d(mask), as_4d(bias), causal, "auto", args.table, None,
                                           False)
            configs[name] = dict(backend=backend.name, config=config.to_dict())
        backend, config = configs[name]["backend"], FwdConfig(**configs[name]["config"])
        call = lambda: flash_dmattn_func(q, k, v, mask, bias, is_causal=causal, fwd_config=config, backend=backend)
        out = call()
        outputs[name] = out.cpu()
        diff = (out.float().cpu() - earlier[name].float()).abs().max().item() if name in earlier else float("nan")
        gpu = time_kernel(call, device, repeats=30).median_ms
        rows.append((name, config, gpu, host_us(call), diff))
        print(rows[-1], flush=True)
    if args.write_configs:
        Path(args.write_configs).write_text(json.dumps(configs))
    if args.save:
        torch.save(outputs, args.save)
    print(f"| workload | config | {args.label}: GPU ms | host us | max diff |\n|---|---|---|---|---|")
    for name, config, gpu, host, diff in rows:
        print(f"| {name} | {config} | {gpu:.3f} | {host:.1f} | {diff:.3g} |")
