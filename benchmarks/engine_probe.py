"""Where an eager step's host time goes around our backward: timestamps at the call of
`torch.autograd.grad`, at the entry and exit of `plan.AttentionFunction.backward` (run on the autograd
engine's device thread) and at the return, medians over calls with a GPU spin ahead of each; and,
as the engine's floor, the same for an identity Function and for a Function with our signature
whose backward returns precomputed gradients at once.

    python -m benchmarks engine-probe

Prints one markdown table (stdout).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch

from benchmarks import host_overhead
from benchmarks.backward_host import CALLS, SPIN_CYCLES
from dmattn_bench import flash_dmattn_func
from dmattn_bench import plan as plans
from dmattn_bench.bench.operators import operator

STAMPS: dict[str, float] = {}  # "grad" (autograd.grad called), "enter" / "exit" (the backward)


def _median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1e3


def timed(fn) -> dict[str, float]:
    """Medians (ms) of a call's total host time and of its three legs around the backward."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    legs = {"total": [], "to_backward": [], "in_backward": [], "after_backward": []}
    for index in range(CALLS):
        torch.cuda._sleep(SPIN_CYCLES)
        STAMPS.clear()
        begin = time.perf_counter()
        fn()
        end = time.perf_counter()
        legs["total"].append(end - begin)
        if "enter" in STAMPS:
            legs["to_backward"].append(STAMPS["enter"] - STAMPS["grad"])
            legs["in_backward"].append(STAMPS["exit"] - STAMPS["enter"])
            legs["after_backward"].append(end - STAMPS["exit"])
        if index % 20 == 19:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return {name: _median_ms(samples) for name, samples in legs.items() if samples}


def grad(out, inputs, grad_out):
    STAMPS["grad"] = time.perf_counter()
    return torch.autograd.grad(out, inputs, grad_out)


class Identity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad_out):
        STAMPS["enter"] = STAMPS["exit"] = time.perf_counter()
        return grad_out


class Precomputed(torch.autograd.Function):
    """Our Function's inputs, outputs and saved tensors; its backward returns `grads` at once."""

    grads: tuple = ()

    @staticmethod
    def forward(ctx, plan, q, k, v, mask, bias):
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], device=q.device)
        ctx.save_for_backward(q, k, v, out, lse, mask, bias, None)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        STAMPS["enter"] = time.perf_counter()
        ctx.saved_tensors
        dq, dk, dv, dbias = Precomputed.grads
        STAMPS["exit"] = time.perf_counter()
        return None, dq, dk, dv, None, dbias


@operator("engine-probe", help="Where an eager step's host time goes around our backward in the autograd engine")
def main(argv: list[str]) -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    device = torch.device("cuda")
    original = plans.AttentionFunction.backward

    def stamped_backward(ctx, dout, dlse):
        STAMPS["enter"] = time.perf_counter()
        result = original(ctx, dout, dlse)
        STAMPS["exit"] = time.perf_counter()
        return result

    plans.AttentionFunction.backward = staticmethod(stamped_backward)
    rows = []
    x = torch.randn(1 << 20, device=device, requires_grad=True)
    x_grad = torch.randn_like(x)
    rows.append(("identity Function, 1 input", timed(lambda: grad(Identity.apply(x), x, x_grad))))
    for prefix in ("small", "W3", "W2"):
        _, shape = next((n, s) for n, s in host_overhead._scenarios(device).items() if n.startswith(prefix))
        q, k, v, mask, bias, causal, leaves = host_overhead._inputs(shape, device, True)
        grad_out = torch.randn_like(q)

        def call():
            return flash_dmattn_func(q, k, v, mask, bias, is_causal=causal)

        rows.append((f"{prefix}: ours", timed(lambda: grad(call(), leaves, grad_out))))
        gc.disable()
        rows.append((f"{prefix}: ours, gc off", timed(lambda: grad(call(), leaves, grad_out))))
        gc.enable()
        Precomputed.grads = torch.autograd.grad(call(), leaves, grad_out) + ((None,) if bias is None else ())
        rows.append((f"{prefix}: our signature, backward returns at once",
                     timed(lambda: grad(Precomputed.apply(None, q, k, v, mask, bias)[0], leaves, grad_out))))
        rows.append((f"{prefix}: ours, forward only (inputs need grad)", timed(call)))
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; host ms, medians of {CALLS}\n")
    print("| what | total | autograd.grad -> backward | in backward | backward -> return |")
    print("|---|---|---|---|---|")
    for name, legs in rows:
        print(f"| {name} | {legs['total']:.3f} | {legs.get('to_backward', 0):.3f} | {legs.get('in_backward', 0):.3f} "
              f"| {legs.get('after_backward', 0):.3f} |")
