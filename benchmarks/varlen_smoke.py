"""A first look at packed sequences and the sliding window on a GPU (issue 56): the largest
error of out and of every gradient relative to the reference's largest magnitude, bf16, on small
packings and a dense window; then GPU ms (CUDA events, median of 20 hot calls) of ours against
FlexAttention with its block mask built once, on the issue's workloads (8 packed documents of
16384 tokens causal, with and without a per-key bias and a per-row mask; B2 L8192 window 1024),
H16 Hkv4 D128. The bench (`dmattn-bench bench --workloads configs/workloads/packed.yaml`) is the
report; this is its quick check.

    python -m benchmarks varlen-smoke

Errors go to stderr, the timing table to stdout."""

import argparse
import statistics
import sys

import torch

from dmattn_bench import flash_dmattn_func, flash_dmattn_varlen_func
from dmattn_bench.bench.operators import operator
from dmattn_bench.reference import attention, varlen_attention

parser = argparse.ArgumentParser(prog="python -m benchmarks varlen-smoke", description=__doc__.splitlines()[0])


@operator("varlen-smoke", help="Errors and GPU ms of packed sequences and windows against FlexAttention (a quick check)")
def main(argv: list[str]) -> None:
    parser.parse_args(argv)
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    H, HKV, D = 16, 4, 128
    DOCS = [4096, 700, 2900, 1500, 3100, 1024, 1964, 1100]


    def med_ms(fn, reps=20):
        for _ in range(3):
            fn()
        times = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(); fn(); b.record(); torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
        return statistics.median(times)


    def rel(a, b):
        a, b = a.float(), b.float()
        return ((a - b).abs().max() / b.abs().max().clamp_min(1)).item()


    cu = torch.tensor([0] + torch.tensor(DOCS).cumsum(0).tolist(), dtype=torch.int32, device=dev)
    T, M = int(cu[-1]), max(DOCS)
    q = torch.randn(T, H, D, device=dev, dtype=dt, requires_grad=True)
    k = torch.randn(T, HKV, D, device=dev, dtype=dt, requires_grad=True)
    v = torch.randn(T, HKV, D, device=dev, dtype=dt, requires_grad=True)
    bias = torch.randn(HKV, T, device=dev, dtype=dt, requires_grad=True)
    mask = torch.rand(1, T, M, device=dev) > 0.1

    # correctness on a smaller packing (the reference materialises scores)
    small = [300, 0, 1, 517, 64, 129]
    cs = torch.tensor([0] + torch.tensor(small).cumsum(0).tolist(), dtype=torch.int32, device=dev)
    ts, ms = int(cs[-1]), max(small)
    qs, ks, vs = (torch.randn(ts, h, D, device=dev, dtype=dt, requires_grad=True) for h in (H, HKV, HKV))
    bs = torch.randn(HKV, ts, device=dev, dtype=dt, requires_grad=True)
    mk = torch.rand(1, ts, ms, device=dev) > 0.2
    for causal, window, m, b in [(True, (-1, -1), None, None), (True, (63, -1), mk, bs), (False, (40, 7), mk, None)]:
        out = flash_dmattn_varlen_func(qs, ks, vs, cs, cs, ms, ms, m, b, is_causal=causal, window_size=window)
        do = torch.randn_like(out)
        ins = [qs, ks, vs] + ([b] if b is not None else [])
        g = torch.autograd.grad(out, ins, do)
        leaves = [t.detach().float().requires_grad_() for t in ins]
        ref = varlen_attention(*leaves[:3], cs, cs, ms, ms, m, leaves[3] if b is not None else None, is_causal=causal,
                               window_size=window)
        rg = torch.autograd.grad(ref, leaves, do.float())
        print("varlen", causal, window, m is not None, b is not None, "rel err out", round(rel(out, ref), 5),
              "grads", [round(rel(x, y), 5) for x, y in zip(g, rg)], file=sys.stderr)
    qd, kd, vd = (torch.randn(2, 777, h, D, device=dev, dtype=dt, requires_grad=True) for h in (H, HKV, HKV))
    out = flash_dmattn_func(qd, kd, vd, is_causal=True, window_size=(255, -1))
    g = torch.autograd.grad(out, [qd, kd, vd], torch.ones_like(out))
    leaves = [t.detach().float().requires_grad_() for t in (qd, kd, vd)]
    ref = attention(*leaves, is_causal=True, window_size=(255, -1))
    rg = torch.autograd.grad(ref, leaves, torch.ones_like(ref))
    print("dense window rel err", round(rel(out, ref), 5), [round(rel(x, y), 5) for x, y in zip(g, rg)], file=sys.stderr)

    rows = []
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    flex = torch.compile(flex_attention)
    doc = torch.repeat_interleave(torch.arange(len(DOCS), device=dev), torch.tensor(DOCS, device=dev))
    pos = torch.arange(T, device=dev) - cu[:-1].long()[doc]


    def doc_causal(b, h, qi, ki):
        return (doc[qi] == doc[ki]) & (ki <= qi)


    bm = create_block_mask(doc_causal, 1, 1, T, T, device=dev)
    qf, kf, vf = (t.detach().transpose(0, 1)[None].requires_grad_() for t in (q, k, v))


    def fl_fwd():
        return flex(qf, kf, vf, block_mask=bm, enable_gqa=True)


    def ours_fwd():
        return flash_dmattn_varlen_func(q, k, v, cu, cu, M, M, is_causal=True)


    with torch.no_grad():
        rows.append(("packed fwd", med_ms(ours_fwd), med_ms(fl_fwd)))
    rows.append(("packed fwd+bwd", med_ms(lambda: ours_fwd().sum().backward()), med_ms(lambda: fl_fwd().sum().backward())))


    def ours_bm():
        return flash_dmattn_varlen_func(q, k, v, cu, cu, M, M, mask, bias, is_causal=True)


    bias_f = bias.detach().requires_grad_()


    def fl_bm():
        def score_mod(s, b, h, qi, ki):
            return s + bias_f[h // (H // HKV), ki]

        def mm(b, h, qi, ki):
            return doc_causal(b, h, qi, ki) & mask[0, qi, (ki - cu.long()[doc[ki]]).clamp(0, M - 1)]

        return flex(qf, kf, vf, score_mod=score_mod, block_mask=bm2, enable_gqa=True)


    def mm(b, h, qi, ki):
        return doc_causal(b, h, qi, ki) & mask[0, qi, (ki - cu.long()[doc[ki]]).clamp(0, M - 1)]


    bm2 = create_block_mask(mm, 1, 1, T, T, device=dev)
    with torch.no_grad():
        rows.append(("packed bias+mask fwd", med_ms(ours_bm), med_ms(fl_bm)))
    rows.append(("packed bias+mask fwd+bwd", med_ms(lambda: ours_bm().sum().backward()),
                 med_ms(lambda: fl_bm().sum().backward())))

    B, L = 2, 8192
    qw, kw, vw = (torch.randn(B, L, h, D, device=dev, dtype=dt, requires_grad=True) for h in (H, HKV, HKV))
    bmw = create_block_mask(lambda b, h, qi, ki: (ki <= qi) & (ki > qi - 1024), B, 1, L, L, device=dev)
    qwf, kwf, vwf = (t.detach().transpose(1, 2).requires_grad_() for t in (qw, kw, vw))


    def ours_w():
        return flash_dmattn_func(qw, kw, vw, is_causal=True, window_size=(1023, -1))


    def fl_w():
        return flex(qwf, kwf, vwf, block_mask=bmw, enable_gqa=True)


    with torch.no_grad():
        rows.append(("window1024 fwd", med_ms(ours_w), med_ms(fl_w)))
    rows.append(("window1024 fwd+bwd", med_ms(lambda: ours_w().sum().backward()), med_ms(lambda: fl_w().sum().backward())))
    print(f"{'row':28s} {'ours ms':>8s} {'flex ms':>8s} {'ratio':>6s}")
    for name, a, b in rows:
        print(f"{name:28s} {a:8.3f} {b:8.3f} {a / b:6.2f}")
