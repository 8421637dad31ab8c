"""The warp-specialized CUDA backward (kernels/cuda/flash_bwd_ws.cu) on an SM90 GPU: the full
adversarial suite, backward alone, for its configs in bf16 and fp16; then the whole backward's
GPU time on W3's shape (bf16 B2 H16 L4096 D128, causal and not) beside the Triton backward at
the tables' config and the two-kernel CUDA backward. Prints a short report.

    python -m benchmarks cuda-bwd-ws-check [suite|time|all]

Exits 1 when a suite case fails (before the timing).
"""
import argparse
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from dmattn_bench.bench.operators import operator
from dmattn_bench.registry import get_backend
from dmattn_bench.space import BwdConfig, FwdConfig, config_label
from dmattn_bench.tuning.adversarial import build_inputs
from dmattn_bench.tuning.timing import time_kernel
from dmattn_bench.tuning.validator import check_case, config_suite, run_kernel

WS_CONFIGS = (BwdConfig(64, 128, 64, 128, 12, 2), BwdConfig(64, 64, 64, 64, 8, 2))
DTYPES = (torch.bfloat16, torch.float16)


def check_suite(cuda, jobs=None) -> bool:
    """The suite of each warp-specialized config in both dtypes, or the (config, case, dtype)
    `jobs` given, the variants built in parallel first; whether every case passed."""
    if jobs is None:
        jobs = [(bwd, case, dtype) for bwd in WS_CONFIGS for case in config_suite("cuda", "full", None, bwd)
                for dtype in DTYPES]
    start, errors = time.time(), []

    def build(job):  # every variant the suite needs, nvcc in parallel processes
        bwd, case, dtype = job
        try:
            inputs = build_inputs(case, dtype, "cuda", 0)
            stand_in = (torch.empty_like(inputs.q), torch.empty(inputs.q.shape[0], inputs.q.shape[2],
                                                                inputs.q.shape[1], device="cuda"))
            with cuda.compile_only():
                run_kernel(cuda, inputs, case, None, bwd, forward=stand_in)
        except Exception as exc:  # noqa: BLE001
            errors.append(f"{case.name}: {type(exc).__name__}: {str(exc)[:200]}")

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(build, jobs))
    print(f"built the variants of {len(jobs)} case runs in {time.time() - start:.0f} s, {len(errors)} errors", flush=True)
    for error in sorted(set(errors))[:5]:
        print("  ", error)
    worst, fails, start = {}, [], time.time()
    for bwd, case, dtype in jobs:
        result = check_case(cuda, case, dtype, "cuda", None, bwd)
        if result.status not in ("ok", "unsupported"):  # a head dim it cannot take is left to other configs
            fails.append(f"{config_label(bwd)} {str(dtype)[6:]} {case.name}: {result.status} {result.reason[:160]}")
        for name, check in result.checks.items():
            worst[name] = max(worst.get(name, 0.0), check.ratio)
    print(f"suite: {len(jobs)} case runs in {time.time() - start:.0f} s, {len(fails)} not ok; worst error/bound "
          + ", ".join(f"{n} {r:.3f}" for n, r in sorted(worst.items())), flush=True)
    for line in fails[:25]:
        print("  FAIL", line)
    return not fails


def kernel_times(run, repeats: int = 20) -> list[tuple[str, float]]:
    """Each GPU kernel's mean time over `repeats` runs of `run` (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            run()
        torch.cuda.synchronize()
    times = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            times[event.name] = times.get(event.name, 0.0) + event.device_time / 1e3 / repeats
    return sorted(times.items(), key=lambda item: -item[1])


def time_w3(cuda, triton) -> None:
    """W3's whole backward, causal and not: Triton, the two-kernel CUDA backward and the
    warp-specialized one (its kernels' times too)."""
    B, H, L, D = 2, 16, 4096, 128
    rows = []
    for causal in (True, False):
        torch.manual_seed(0)
        q, k, v, dout = (torch.randn(B, L, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        options = dict(is_causal=causal, softmax_scale=D ** -0.5, softcap=0.0)
        out, lse = torch.empty_like(q), torch.empty(B, H, L, device="cuda")
        cuda.forward(q, k, v, None, None, config=FwdConfig(128, 128, 12, 2), out=out, lse=lse, **options)
        grads = {}
        for backend, config in ((triton, BwdConfig(64, 64, 64, 64, 4, 2)), (cuda, BwdConfig(64, 64, 64, 64, 4, 2)),
                                *((cuda, c) for c in WS_CONFIGS)):
            g = dict(dq=torch.empty_like(q), dk=torch.empty_like(k), dv=torch.empty_like(v))

            def run(b=backend, c=config, g=g):
                b.backward(dout, q, k, v, out, lse, None, None, config=c, dbias=None, **g, **options)

            label = f"{backend.name} {config_label(config)}"
            ms = time_kernel(run, "cuda").median_ms
            grads[label] = g
            first = {n: t.clone() for n, t in g.items()}
            run()
            repeat = all(torch.equal(first[n], g[n]) for n in g)
            reference = next(iter(grads.values()))  # the Triton backward's
            diff = max((g[n].float() - reference[n].float()).abs().max().item() for n in g)
            rows.append((f"W3 {'causal' if causal else 'full'}", label, ms, repeat, diff))
            print(rows[-1], flush=True)
            if backend is cuda and config == WS_CONFIGS[0]:  # where its time goes, kernel by kernel
                rows += [(f"W3 {'causal' if causal else 'full'}", f"  {name}", ms, "-", float("nan"))
                         for name, ms in kernel_times(run)]
    print("\nshape | backward | gpu ms (median, whole backward) | repeats bitwise | max|diff| vs the Triton backward")
    for shape, label, ms, repeat, diff in rows:
        print(f"{shape} | {label} | {ms:.3f} | {repeat} | {diff:.2e}")
    print("(rows indented: the profiler's mean per kernel, without the L2 flush)")


@operator("cuda-bwd-ws-check", help="Warp-specialized CUDA backward: the full adversarial suite, then W3 timing")
def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", nargs="?", choices=("suite", "time", "all"), default="all",
                        help="the suite, the W3 timing or both (default: all)")
    what = parser.parse_args(argv).what
    cuda, triton = get_backend("cuda"), get_backend("triton")
    print(torch.cuda.get_device_name(), flush=True)
    if what in ("suite", "all") and not check_suite(cuda):
        return 1
    if what in ("time", "all"):
        time_w3(cuda, triton)
    return 0
