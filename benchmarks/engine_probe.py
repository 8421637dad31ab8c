"""Where an eager step's host time goes around our backward: timestamps at the call of
`torch.autograd.grad`, at the entry and exit of `_Attention.backward` (run on the autograd
engine's device thread) and at the return, medians over calls with a GPU spin ahead of each; and,
as the engine's floor, the same for an identity Function and for a Function with our signature
whose backward returns precomputed gradients at once.

    python benchmarks/engine_probe.py

Prints one markdown table (stdout).
"""
import gc, statistics, sys, time
import torch
import host_overhead
from dmattn_bench import api, flash_dmattn_func

SPIN = 2_000_000
device = torch.device("cuda")
stamps = {}

def med(xs): return statistics.median(xs) * 1e3

def run(fn, calls=60):
    for _ in range(3): fn()
    torch.cuda.synchronize()
    rows = {"total": [], "to_bwd": [], "in_bwd": [], "from_bwd": []}
    for i in range(calls):
        torch.cuda._sleep(SPIN)
        t0 = time.perf_counter()
        stamps.clear()
        stamps["t0"] = None
        fn()
        t3 = time.perf_counter()
        rows["total"].append(t3 - t0)
        if "t1" in stamps:
            rows["to_bwd"].append(stamps["t1"] - stamps["tg"])
            rows["in_bwd"].append(stamps["t2"] - stamps["t1"])
            rows["from_bwd"].append(t3 - stamps["t2"])
        if i % 20 == 19: torch.cuda.synchronize()
    torch.cuda.synchronize()
    return {k: med(v) for k, v in rows.items() if v}

def grad(out, leaves, g):
    stamps["tg"] = time.perf_counter()
    return torch.autograd.grad(out, leaves, g)

class Ident(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)
    @staticmethod
    def backward(ctx, g):
        stamps["t1"] = time.perf_counter(); stamps["t2"] = time.perf_counter()
        return g

class Fake6(torch.autograd.Function):
    grads = None
    @staticmethod
    def forward(ctx, plan, q, k, v, m, b):
        out = torch.empty_like(q); lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], device=q.device)
        ctx.save_for_backward(q, k, v, out, lse, m, b, None)
        ctx.set_materialize_grads(False)
        return out, lse
    @staticmethod
    def backward(ctx, dout, dlse):
        stamps["t1"] = time.perf_counter()
        ctx.saved_tensors
        dq, dk, dv, db = Fake6.grads
        r = (None, dq, dk, dv, None, db)
        stamps["t2"] = time.perf_counter()
        return r

original = api._Attention.backward
def timed_backward(ctx, dout, dlse):
    stamps["t1"] = time.perf_counter()
    r = original(ctx, dout, dlse)
    stamps["t2"] = time.perf_counter()
    return r
api._Attention.backward = staticmethod(timed_backward)

results = []
x = torch.randn(1 << 20, device=device, requires_grad=True); gx = torch.randn_like(x)
results.append(("identity 1 input", run(lambda: grad(Ident.apply(x), x, gx))))
for name in ("small", "W3", "W2"):
    key, shape = next((n, s) for n, s in host_overhead._scenarios(device).items() if n.startswith(name))
    q, k, v, mask, bias, causal, leaves = host_overhead._inputs(shape, device, True)
    g = torch.randn_like(q)
    call = lambda: flash_dmattn_func(q, k, v, mask, bias, is_causal=causal)
    results.append((f"{name} ours", run(lambda: grad(call(), leaves, g))))
    gc.disable()
    results.append((f"{name} ours gc off", run(lambda: grad(call(), leaves, g))))
    gc.enable()
    Fake6.grads = torch.autograd.grad(call(), leaves, g) + ((None,) if bias is None else ())
    results.append((f"{name} fake backward, our signature", run(lambda: grad(Fake6.apply(None, q, k, v, mask, bias)[0], leaves, g))))
    results.append((f"{name} ours fwd only (grad)", run(call)))
    # the engine on the calling thread? compare .backward
    def acc():
        out = call(); stamps["tg"] = time.perf_counter(); out.backward(g)
    for t in leaves: t.grad = None
    results.append((f"{name} ours .backward accumulate", run(acc)))
print(f"{torch.cuda.get_device_name()} torch {torch.__version__}; host ms, medians")
print("| what | total | grad call -> bwd entry | in bwd | bwd exit -> grad returns |")
print("|---|---|---|---|---|")
for name, r in results:
    print(f"| {name} | {r['total']:.3f} | {r.get('to_bwd', 0):.3f} | {r.get('in_bwd', 0):.3f} | {r.get('from_bwd', 0):.3f} |")
