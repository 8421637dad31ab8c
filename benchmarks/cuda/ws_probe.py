"""The SM90 warp-specialized CUDA forward (flash_fwd_ws.cu) on the GPU: the adversarial suite
(forward alone) through its configs at head dims 64 and 128 in bf16 and fp16, then the bench's
W1-W3 forward (`configs/workloads/peers.yaml`, no gradient) against the Triton forward the
runtime picks, the CUDA wgmma forward and SDPA, GPU time (`timing.time_kernel`, L2 flushed) and
the host's time to enqueue a call (`timing.host_us`: warm, behind a GPU spin).

    python -m benchmarks cuda-ws-probe [--suite quick|full] [--configs 128x128w12s2,...]
        [--score-stages 2,4]

`--score-stages` times each config once per cap on its ring of staged mask and bias tiles
(`shared_memory.MAX_SCORE_STAGES`; the kernel gets as many slots as fit, up to the cap).

Prints one markdown table (stdout); progress to stderr."""

import argparse
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import torch
import torch.nn.functional as F

from dmattn_bench import flash_dmattn_func
from dmattn_bench.bench.harness import build_bench_inputs, flops_needed, load_peer_workloads
from dmattn_bench.bench.operators import operator
from dmattn_bench.registry import get_backend
from dmattn_bench.space import FwdConfig
from dmattn_bench.tuning.adversarial import adversarial_cases
from dmattn_bench.tuning.timing import host_us, time_kernel
from dmattn_bench.tuning.validator import check_case, config_tiles
from dmattn_kernels.cuda import build, driver, forward, rules, shared_memory, variants


def parse_config(text: str) -> FwdConfig:
    tiles, rest = text.split("w")
    warps, stages = rest.split("s")
    block_m, block_n = tiles.split("x")
    return FwdConfig(int(block_m), int(block_n), int(warps), int(stages))


def suite_cases(config, level: str):
    """The suite's cases at head dims 64 and 128 (the warp-specialized forward's padded head dim
    is a multiple of 64; most cases use 32)."""
    cases = adversarial_cases(level, config_tiles(config, None))
    return [replace(c, name=f"{c.name}@d{d}", head_dim=d) for d in (64, 128) for c in cases if c.head_dim <= d]


def build_all(arch: str, jobs: set) -> None:
    """nvcc builds the (source, flags) `jobs` for `arch` in parallel."""
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda job: build.build(job[0], arch, job[1]), sorted(jobs)))


def prebuild(configs, level: str) -> None:
    """nvcc builds every variant the suite needs, in parallel (check_case would build them one by one)."""
    arch = driver.arch_of(torch.device("cuda"))
    jobs = set()
    for config in configs:
        for case in suite_cases(config, level):
            for dtype in (torch.bfloat16, torch.float16):
                bias_dtype = (torch.float32 if case.bias_fp32 else dtype) if case.bias != "none" else None
                flags = variants.variant(config, case.head_dim, dtype, bias_dtype, arch=arch, is_causal=case.causal,
                                         has_mask=case.mask != "none", softcap=case.softcap)
                jobs.add((rules.forward_kernel(config, case.head_dim, arch), flags))
    build_all(arch, jobs)


def prebuild_timed(workloads, configs, caps) -> None:
    """nvcc builds the variants the timed calls run, in parallel: each workload's operands under
    each config and score ring cap."""
    arch = driver.arch_of(torch.device("cuda"))
    jobs = set()
    for x in workloads:
        for cap in caps:
            shared_memory.MAX_SCORE_STAGES = cap
            for config in configs:
                bias_dtype = None if x.bias is None else x.bias.dtype
                flags = variants.variant(config, x.q.shape[-1], x.q.dtype, bias_dtype, arch=arch,
                                         is_causal=x.is_causal, has_mask=x.mask is not None, softcap=0.0,
                                         mask_tiles=variants.staged_tiles(x.mask, x.q.shape[1]),
                                         bias_tiles=variants.staged_tiles(x.bias, x.q.shape[1]))
                jobs.add((rules.forward_kernel(config, x.q.shape[-1], arch), flags))
    build_all(arch, jobs)


def with_score_stages(cap: int, call):
    """`call` with the staged ring capped at `cap` slots (the launch plans are rebuilt on a change)."""
    def capped():
        if shared_memory.MAX_SCORE_STAGES != cap:
            shared_memory.MAX_SCORE_STAGES = cap
            forward._signature_launch.cache_clear()
        return call()
    return capped


def suite(configs, level: str) -> list[str]:
    cuda = get_backend("cuda")
    failures, runs = [], 0
    prebuild(configs, level)
    for config in configs:
        cases = suite_cases(config, level)
        for dtype in (torch.bfloat16, torch.float16):
            for case in cases:
                result = check_case(cuda, case, dtype, "cuda", config, None)
                runs += 1
                if result.status != "ok":
                    failures.append(f"{config} {dtype} {case.name}: {result.status} {result.reason}"[:300])
        print(f"suite {config}: {runs} runs, {len(failures)} failures so far", file=sys.stderr, flush=True)
    return [f"suite ({level}): {runs} case runs, {len(failures)} failures"] + failures[:20]


@operator("cuda-ws-probe", help="Warp-specialized CUDA forward: suite, then W1-W3 against Triton, CUDA wgmma and SDPA")
def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", default="quick", choices=("none", "quick", "full"))
    parser.add_argument("--configs", default="128x128w12s2,128x64w12s2,64x128w8s2")
    parser.add_argument("--baseline", default="128x128w8s2", help="the CUDA wgmma forward's config")
    parser.add_argument("--score-stages", default=str(shared_memory.MAX_SCORE_STAGES),
                        help="caps on the staged mask and bias ring to time each config at")
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    configs = [parse_config(c) for c in args.configs.split(",")]
    caps = [int(c) for c in args.score_stages.split(",")]
    default_cap = shared_memory.MAX_SCORE_STAGES
    lines = [f"GPU: {torch.cuda.get_device_name()}"]
    if args.suite != "none":
        start = time.time()
        lines += suite(configs, args.suite)
        lines.append(f"suite took {time.time() - start:.0f} s")
    rows = []
    peers = [(pw, build_bench_inputs(pw, device)) for pw in load_peer_workloads("configs/workloads/peers.yaml")]
    prebuild_timed([x for _, x in peers], [parse_config(args.baseline)] + configs, caps)
    shared_memory.MAX_SCORE_STAGES = default_cap
    for pw, x in peers:
        q, k, v, mask, bias = x.q, x.k, x.v, x.mask, x.bias.detach() if x.bias is not None else None
        flops = flops_needed(pw, "fwd")
        reference = flash_dmattn_func(q, k, v, mask, bias, is_causal=x.is_causal, backend="triton")
        calls = {"triton (runtime's pick)": lambda: flash_dmattn_func(q, k, v, mask, bias, is_causal=x.is_causal,
                                                                      backend="triton")}
        for config in [parse_config(args.baseline)] + configs:
            for cap in caps if rules.warp_specialized(config, q.shape[-1], "sm90") else [default_cap]:
                ring = f" ring<={cap}" if len(caps) > 1 else ""
                calls[f"cuda {config.block_m}x{config.block_n} w{config.num_warps} s{config.num_stages}{ring}"] = (
                    with_score_stages(cap, lambda c=config: flash_dmattn_func(
                        q, k, v, mask, bias, is_causal=x.is_causal, backend="cuda", fwd_config=c)))
        if mask is None and bias is None:
            qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
            for name, sdpa in (("sdpa cudnn", torch.nn.attention.SDPBackend.CUDNN_ATTENTION),
                               ("sdpa flash", torch.nn.attention.SDPBackend.FLASH_ATTENTION)):
                def call(b=sdpa):
                    with torch.nn.attention.sdpa_kernel(b):
                        return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
                calls[name] = call
        for name, call in calls.items():
            try:
                out = call()
                if out.shape != reference.shape:
                    out = out.transpose(1, 2)
                diff = (out.float() - reference.float()).abs().max().item()
                ms = time_kernel(call, device, repeats=30).median_ms
                rows.append((pw.name, name, f"{ms:.3f}", f"{host_us(call, 20):.1f}", f"{flops / ms / 1e9:.0f}",
                             f"{diff:.2e}"))
            except Exception as exc:  # a failed variant is a row, not the end of the probe
                rows.append((pw.name, name, "error", "-", str(exc).splitlines()[0][:120], "-"))
            print(rows[-1], file=sys.stderr, flush=True)
    print("\n".join(lines))
    print("\n| workload | kernel | GPU ms | host us | TFLOP/s | max diff vs triton |\n|---|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
