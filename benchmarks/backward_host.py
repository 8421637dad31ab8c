"""Where the host time of an eager forward+backward goes, against the autograd engine's own floor.

For each scenario of `benchmarks/host_overhead.py` (bf16, on the local GPU), warm host time per
call (a GPU spin ahead of every call keeps the queue from blocking; no sync between calls;
median) of:
- fwd / fwd (grad): our forward without and with inputs that need a gradient;
- fwd+bwd grad / fwd+bwd .backward: the forward and `torch.autograd.grad`, or `.backward()`
  accumulating into `.grad` (what `dmattn-bench bench` times);
- inside backward: the time spent in `plan.AttentionFunction.backward` on the engine's thread;
- plan.backward: the same backward called directly on the calling thread (no engine), and the
  time of its kernel launches;
and, as floors: one C++ op (`x * 2`) and one Python `autograd.Function` (identity) through
`torch.autograd.grad`, and SDPA's dense flash forward+backward on the W3 shape.

    python -m benchmarks backward-host [--profile W2]

Prints one markdown table (stdout); with --profile, the top functions of the forward and of the
direct backward.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from benchmarks import host_overhead
from dmattn_bench.bench.operators import operator

SPIN_CYCLES = 2_000_000  # about 1 ms on an H100: longer than one call's host time
CALLS = 60


def warm_host_ms(fn, calls: int = CALLS) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    samples = []
    for index in range(calls):
        torch.cuda._sleep(SPIN_CYCLES)
        begin = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - begin)
        if index % 20 == 19:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return statistics.median(samples) * 1e3


class _Identity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


def floors(device) -> list[tuple[str, float]]:
    x = torch.randn(1 << 20, device=device, requires_grad=True)
    g = torch.randn_like(x)
    rows = [("floor: C++ op x*2, autograd.grad", warm_host_ms(lambda: torch.autograd.grad(x * 2, x, g))),
            ("floor: Python Function identity, autograd.grad",
             warm_host_ms(lambda: torch.autograd.grad(_Identity.apply(x), x, g))),
            ("floor: Python Function identity, forward only", warm_host_ms(lambda: _Identity.apply(x)))]
    q, k, v = (torch.randn(2, 16, 4096, 128, device=device, dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    grad_out = torch.randn_like(q)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        rows.append(("SDPA flash W3 fwd", warm_host_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))))
        rows.append(("SDPA flash W3 fwd+bwd, autograd.grad", warm_host_ms(lambda: torch.autograd.grad(
            F.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v), grad_out))))
    return rows


def _print_profile(title: str, fn, calls: int = 200, top: int = 20) -> None:
    profiler = cProfile.Profile()
    for _ in range(calls):
        torch.cuda._sleep(SPIN_CYCLES)
        profiler.enable()
        fn()
        profiler.disable()
        torch.cuda.synchronize()
    print(f"\n{title}, own time per call:")
    for (file, line, func), (_, count, tottime, cumtime, _) in sorted(
            pstats.Stats(profiler).stats.items(), key=lambda item: -item[1][2])[:top]:
        print(f"{tottime / calls * 1e6:8.1f} us own {cumtime / calls * 1e6:8.1f} us cum {count / calls:5.1f}x "
              f"{file.split('/')[-1]}:{line} {func}")


def ours(name, shape, device, profile: bool) -> list[tuple[str, float]]:
    from dmattn_bench import flash_dmattn_func
    from dmattn_bench import plan as plans
    import dmattn_kernels.triton.launching as launching

    q, k, v, mask, bias, causal, leaves = host_overhead._inputs(shape, device, True)
    grad_out = torch.randn_like(q)
    detached = [t.detach() for t in (q, k, v)]
    bias_detached = None if bias is None else bias.detach()

    def call():
        return flash_dmattn_func(q, k, v, mask, bias, is_causal=causal)

    rows = [(f"{name}: fwd", warm_host_ms(lambda: flash_dmattn_func(*detached, mask, bias_detached, is_causal=causal))),
            (f"{name}: fwd (grad)", warm_host_ms(call)),
            (f"{name}: fwd+bwd grad", warm_host_ms(lambda: torch.autograd.grad(call(), leaves, grad_out)))]

    def accumulate():
        call().backward(grad_out)
    rows.append((f"{name}: fwd+bwd .backward", warm_host_ms(accumulate)))

    inside = []
    original = plans.AttentionFunction.backward

    def timed_backward(ctx, dout, dlse):
        begin = time.perf_counter()
        result = original(ctx, dout, dlse)
        inside.append(time.perf_counter() - begin)
        return result
    plans.AttentionFunction.backward = staticmethod(timed_backward)
    try:
        warm_host_ms(lambda: torch.autograd.grad(call(), leaves, grad_out))
    finally:
        plans.AttentionFunction.backward = staticmethod(original)
    rows.append((f"{name}: inside backward", statistics.median(inside) * 1e3))

    kept = call()  # alive while its saved tensors are read (an output's saved copy needs it)
    context = kept.grad_fn  # a Python Function's node is its context: the plan and saved tensors
    plan, saved = context.plan, context.saved_tensors
    bias_grad = bias is not None and bias.requires_grad

    def direct():
        plan.backward(grad_out, *saved, None, bias_grad)
    rows.append((f"{name}: plan.backward direct", warm_host_ms(direct)))

    launch_time = []
    method = "run" if hasattr(launching.Launch, "run") else "__call__"  # what a plan calls per kernel
    original_call = getattr(launching.Launch, method)

    def timed_call(self, *args):
        begin = time.perf_counter()
        original_call(self, *args)
        launch_time.append(time.perf_counter() - begin)
    setattr(launching.Launch, method, timed_call)
    try:
        direct()
        launch_time.clear()
        direct()
        count = len(launch_time)
    finally:
        setattr(launching.Launch, method, original_call)
    rows.append((f"{name}: its {count} launches", sum(launch_time) * 1e3))
    torch.cuda.synchronize()

    if profile:
        forward = lambda: flash_dmattn_func(*detached, mask, bias_detached, is_causal=causal)  # noqa: E731
        for what, fn in (("forward (no grad)", forward), ("plan.backward direct", direct)):
            _print_profile(f"{name} {what}", fn)
    return rows


@operator("backward-host", help="Host time of an eager forward+backward against the autograd engine's own floor")
def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", action="append", default=[], help="scenario name prefix to profile")
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    rows = floors(device)
    for name, shape in host_overhead._scenarios(device).items():
        short = name.split(" (")[0]
        rows += ours(short, shape, device, any(name.startswith(p) for p in args.profile))
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}; warm host ms per call, median of {CALLS}\n")
    print("| what | host ms |\n|---|---|")
    for what, ms in rows:
        print(f"| {what} | {ms:.3f} |")
