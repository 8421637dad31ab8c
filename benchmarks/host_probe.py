"""Warm host microseconds per eager call: ours and SDPA, forward, forward+backward and decode.

Each figure is the median over rounds of N back-to-back calls enqueued behind a GPU spin (so no
call waits on the GPU), divided by N. Run it with another checkout's packages first on
PYTHONPATH to compare versions on one machine, from the repository root (`-P` keeps the current
folder's packages from coming before PYTHONPATH's):

    python -m benchmarks host-probe --label after
    PYTHONPATH=/path/to/old/packages:$PWD python -P -m benchmarks host-probe --label before

`--decode` times the bench's B1 decode steps instead (`configs/workloads/peers-decode.yaml`, D1
and D2, each length variant) as `dmattn-bench bench` does, with more eager loops: ours and SDPA
flash, host µs, GPU µs and eager wall µs per call, and the wall over the GPU time. With
`--native-source FILE` ours runs a native launch path built from another `native_launch.cpp`
(an A/B of the host path alone, each in its own process):

    python -m benchmarks host-probe --decode --label after
    git show HEAD~1:kernels/runtime/native_launch.cpp > /tmp/before.cpp
    python -m benchmarks host-probe --decode --label before --native-source /tmp/before.cpp

Prints one markdown table (stdout).
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from benchmarks import host_overhead
from dmattn_bench import flash_dmattn_func
from dmattn_bench.bench.operators import operator
from dmattn_bench.tuning.timing import host_us

def _decode_inputs(batch, seqlen_k, padded, device):
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(batch, 1, 32, 128, device=device, dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(batch, seqlen_k, 8, 128, device=device, dtype=torch.bfloat16, generator=g) for _ in range(2))
    lengths = torch.full((batch,), seqlen_k - 100, dtype=torch.int32, device=device)
    mask = None
    if padded:
        mask = (torch.arange(seqlen_k, device=device) < seqlen_k - 100).expand(batch, 1, 1, seqlen_k)
    return q, k, v, mask, lengths


def _plan_key(q, k, v, mask, bias, causal) -> tuple:
    """The plan key `flash_dmattn_func` builds for a call with these tensors and default options."""
    from dmattn_bench import plan as plans

    return plans.signature(plans.tensor_layouts(q, k, v, mask, bias, None, None), bool, causal, type(None), None,
                           float, 0.0, "auto", None, None, None, False)


def pieces(device) -> list[tuple[str, float]]:
    """Host cost of the operations a call is made of (the current checkout's only)."""
    from torch._subclasses.fake_tensor import is_fake

    from dmattn_bench import api
    from dmattn_kernels.runtime import launch_context

    q, k, v, mask, bias, causal, _ = host_overhead._inputs(next(iter(host_overhead._scenarios(device).values())),
                                                            device, False)
    buffer = torch.empty(1 << 20, dtype=torch.uint8, device=device)
    shape = (2, 16, 4096)
    return [
        ("torch.empty", host_us(lambda: torch.empty(shape, dtype=torch.float32, device=device))),
        ("torch.empty_like(q)", host_us(lambda: torch.empty_like(q))),
        ("q.new_empty(shape)", host_us(lambda: q.new_empty(q.shape))),
        ("q.new_empty(n, dtype=uint8)", host_us(lambda: q.new_empty(1 << 16, dtype=torch.uint8))),
        ("torch.empty(n, dtype=uint8, device)", host_us(lambda: torch.empty(1 << 16, dtype=torch.uint8, device=device))),
        ("launch_stream", host_us(launch_context.launch_stream)),
        ("slice + view dtype + view shape", host_us(lambda: buffer[256:256 + 4 * 2 * 16 * 4096].view(torch.float32)
                                                    .view(shape))),
        ("view dtype + as_strided", host_us(lambda: buffer.view(torch.float32).as_strided(shape, (65536, 4096, 1), 64))),
        ("data_ptr", host_us(buffer.data_ptr)),
        ("torch.compiler.is_compiling", host_us(torch.compiler.is_compiling)),
        ("is_fake", host_us(lambda: is_fake(q))),
        ("api._needs_grad", host_us(lambda: api._needs_grad(q, k, v, bias))),
        ("plan.signature", host_us(lambda: _plan_key(q, k, v, mask, bias, causal))),
    ]


def ab(device) -> list[tuple[str, float]]:
    """Our launch paths in one process: one native call per run (`kernels/runtime/native.py`), the C launcher
    per kernel (`handles.DirectLaunch`) and Triton's `CompiledKernel.run`; medians of
    interleaved rounds of the small step (forward without and with a gradient, forward+backward)
    and of a decode step (B1 Lk8192, padding mask)."""
    from contextlib import nullcontext

    from dmattn_bench import plan as plans
    from dmattn_bench import entry as eager_entry
    from dmattn_kernels.triton import launch, launching

    shape = next(s for n, s in host_overhead._scenarios(device).items() if n.startswith("small"))
    q, k, v, mask, bias, causal, leaves = host_overhead._inputs(shape, device, True)
    grad_out = torch.randn_like(q)
    dq, dk, dv, dmask, _ = _decode_inputs(1, 8192, True, device)
    calls = {
        "fwd, no grad": lambda: flash_dmattn_func(q.detach(), k.detach(), v.detach(), mask, bias.detach(),
                                                  is_causal=causal),
        "fwd": lambda: flash_dmattn_func(q, k, v, mask, bias, is_causal=causal),
        "fwd+bwd": lambda: torch.autograd.grad(flash_dmattn_func(q, k, v, mask, bias, is_causal=causal), leaves,
                                               grad_out),
        "decode B1 Lk8192, padding mask": lambda: flash_dmattn_func(dq, dk, dv, dmask),
    }
    direct = launching.direct_launch
    ways = {"native call (native.Program)": (direct, nullcontext),
            "C launcher (handles.DirectLaunch)": (direct, eager_entry.switched_off),
            "Triton's CompiledKernel.run": (lambda *a: None, eager_entry.switched_off)}
    samples: dict[str, list[float]] = {}
    for _ in range(5):
        for way, (launcher, context) in ways.items():
            launching.direct_launch = launcher
            with context():
                plans.clear()
                launch.clear_plans()
                for name, fn in calls.items():
                    samples.setdefault(f"{name}, {way}", []).append(host_us(fn, n=30))
    launching.direct_launch = direct
    return [(name, statistics.median(values)) for name, values in samples.items()]


def cuda_forward(device) -> list[tuple[str, float]]:
    """The CUDA backend's forward without gradient in one process, medians of interleaved rounds
    per scenario (W1-W3, the small step): its native program (through the eager entry), its
    launch from Python (`eager_entry.switched_off`), and the Triton forward beside."""
    from contextlib import nullcontext

    from dmattn_bench import entry as eager_entry
    from dmattn_bench import plan as plans

    samples: dict[str, list[float]] = {}
    scenarios = {n.split(" (")[0]: s for n, s in host_overhead._scenarios(device).items() if n[:2] in ("W1", "W2", "W3", "sm")}
    ways = {"cuda, native": ("cuda", nullcontext), "cuda, Python launch": ("cuda", eager_entry.switched_off),
            "triton, native": ("triton", nullcontext)}
    for name, shape in scenarios.items():
        q, k, v, mask, bias, causal, _ = host_overhead._inputs(shape, device, False)
        for _ in range(3):
            for way, (backend, context) in ways.items():
                with context():
                    plans.clear()
                    samples.setdefault(f"{name} fwd, {way}", []).append(host_us(
                        lambda: flash_dmattn_func(q, k, v, mask, bias, is_causal=causal, backend=backend), n=30))
        del q, k, v, mask, bias
        torch.cuda.empty_cache()
    return [(name, statistics.median(values)) for name, values in samples.items()]


def breakdown(device) -> list[tuple[str, float]]:
    """Where a forward's host time goes (no gradient; W1 and W2 masked, W3 dense): the whole call,
    the plan's run, its lookup, its native program, a native program of the allocations alone and
    an empty one, and SDPA beside it (memory-efficient with the float mask; W3: flash)."""
    from dmattn_bench import plan as plans
    from dmattn_kernels.runtime import launch_context, native

    rows = []
    for name in ("W2", "W1", "W3"):
        shape = next(s for n, s in host_overhead._scenarios(device).items() if n.startswith(name))
        q, k, v, mask, bias, causal, _ = host_overhead._inputs(shape, device, False)
        call = lambda: flash_dmattn_func(q, k, v, mask, bias, is_causal=causal)
        rows.append((f"{name}: flash_dmattn_func", host_us(call)))
        plan = list(plans.PLANS._plans.values())[-1]  # the call's: the last built
        forward = plan._fwd_launch
        rows.append((f"{name}: plan.infer", host_us(lambda: plan.infer(q, k, v, mask, bias, None, None, False))))
        rows.append((f"{name}: plan lookup (signature + get)",
                     host_us(lambda: plans.PLANS.get(_plan_key(q, k, v, mask, bias, causal)))))
        stream = launch_context.launch_stream()
        for kind, program in forward.native.items():
            rows.append((f"{name}: native program {kind}", host_us(lambda: program(stream, q, k, v, mask, bias))))
        allocations = [(forward.out_shape, forward.out_dtype), (forward.lse_shape, torch.float32)]
        empty = native.program(q.device, 5, allocations, [], [], (0, 1))
        rows.append((f"{name}: native, 2 allocations, no kernel", host_us(lambda: empty(stream, q, k, v, mask, bias))))
        bare = native.program(q.device, 5, [], [], [], ())
        rows.append((f"{name}: native, nothing", host_us(lambda: bare(stream, q, k, v, mask, bias))))
        fn, context = host_overhead._sdpa(shape, device, False)
        with context, torch.no_grad():
            rows.append((f"{name}: SDPA", host_us(fn)))
        del q, k, v, mask, bias, fn
        torch.cuda.empty_cache()
    return rows


DECODE_WORKLOADS = ("D1 ", "D2 ")  # name prefixes: the space keeps D10 and D11 out
DECODE_WALL_LOOPS = 21  # the bench's eager loop (20 calls) repeated more often than its 5


def decode_steps(device) -> list[tuple[str, float, float, float]]:
    """(row, host µs, GPU µs, eager wall µs) of ours and SDPA flash on the bench's B1 decode steps."""
    from pathlib import Path

    from dmattn_bench.bench import harness
    from dmattn_bench.bench import peers
    from dmattn_bench.tuning.timing import eager_wall_ms, time_kernel

    path = Path(__file__).resolve().parents[1] / "configs" / "workloads" / "peers-decode.yaml"
    rows = []
    for workload in harness.load_peer_workloads(path, names=list(DECODE_WORKLOADS)):
        inputs = harness.build_bench_inputs(workload, device)
        for peer in (peers.OURS, "sdpa-flash-dense"):
            if peer != peers.OURS and workload.decode.lengths != "none":
                continue  # SDPA flash takes no lengths: one row per cache
            prepared = peers.PEERS[peer](inputs, None)
            with prepared.context(), torch.no_grad():
                gpu_ms = time_kernel(prepared.forward, device).median_ms
                host = host_us(prepared.forward)
                wall_ms = eager_wall_ms(prepared.forward, device, harness.EAGER_LOOP_GPU[0], DECODE_WALL_LOOPS)
            rows.append((f"{workload.name} {peer}", host, gpu_ms * 1e3, wall_ms * 1e3))
        del inputs
    return rows


@operator("host-probe", help="Warm host µs per eager call: ours and SDPA, forward, forward+backward and decode")
def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", default="ours")
    parser.add_argument("--pieces", action="store_true", help="also time the operations a call is made of")
    parser.add_argument("--ab", action="store_true", help="only compare the two launch paths, in one process")
    parser.add_argument("--breakdown", action="store_true", help="only where a masked forward's host time goes")
    parser.add_argument("--decode", action="store_true", help="only the bench's B1 decode steps, eager wall beside")
    parser.add_argument("--cuda", action="store_true", help="only the CUDA forward: native program, Python launch")
    parser.add_argument("--native-source", help="build the native launch path from this native_launch.cpp")
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    if args.native_source:
        from pathlib import Path

        from dmattn_kernels.runtime import native

        native.SOURCE = Path(args.native_source).resolve()
    if args.decode:
        print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
        print(f"| {args.label} | host µs | GPU µs | wall µs | wall / GPU |\n|---|---|---|---|---|")
        for name, host, gpu, wall in decode_steps(device):
            print(f"| {name} | {host:.1f} | {gpu:.1f} | {wall:.1f} | {wall / gpu:.2f} |")
        return
    if args.ab or args.breakdown or args.cuda:
        for name, value in (ab(device) if args.ab else cuda_forward(device) if args.cuda else breakdown(device)):
            print(f"| {name} | {value:.1f} |")
        return
    rows = pieces(device) if args.pieces else []
    scenarios = host_overhead._scenarios(device)
    for name, shape in scenarios.items():
        short = name.split(" (")[0]
        q, k, v, mask, bias, causal, leaves = host_overhead._inputs(shape, device, False)
        rows.append((f"{short} fwd", host_us(lambda: flash_dmattn_func(q, k, v, mask, bias, is_causal=causal))))
        if short in ("small step", "tiny"):
            q, k, v, mask, bias, causal, leaves = host_overhead._inputs(shape, device, True)
            grad_out = torch.randn_like(q)
            rows.append((f"{short} fwd (inputs need grad)",
                         host_us(lambda: flash_dmattn_func(q, k, v, mask, bias, is_causal=causal))))
            rows.append((f"{short} fwd+bwd (autograd.grad)", host_us(lambda: torch.autograd.grad(
                flash_dmattn_func(q, k, v, mask, bias, is_causal=causal), leaves, grad_out), n=30)))
        del q, k, v, mask, bias, leaves
        torch.cuda.empty_cache()
    for batch, seqlen_k in ((1, 8192), (8, 4096)):
        q, k, v, mask, lengths = _decode_inputs(batch, seqlen_k, True, device)
        rows.append((f"decode B{batch} Lk{seqlen_k} padding mask", host_us(lambda: flash_dmattn_func(q, k, v, mask))))
        rows.append((f"decode B{batch} Lk{seqlen_k} cache_seqlens",
                     host_us(lambda: flash_dmattn_func(q, k, v, cache_seqlens=lengths))))
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            rows.append((f"decode B{batch} Lk{seqlen_k} SDPA flash (no mask)",
                         host_us(lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True))))
    for name in ("W2", "W3", "small", "tiny"):
        shape = next(s for n, s in scenarios.items() if n.startswith(name))
        fn, context = host_overhead._sdpa(shape, device, False)
        with context:
            rows.append((f"{name} fwd SDPA", host_us(fn)))
        torch.cuda.empty_cache()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"| call | {args.label}: host µs |\n|---|---|")
    for name, value in rows:
        print(f"| {name} | {value:.1f} |")
