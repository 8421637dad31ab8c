import importlib.util, sys, torch
from dmattn_bench.space import FwdConfig
from dmattn_bench.timing import time_kernel
from dmattn_kernels.triton import launch
from torch.nn.attention import sdpa_kernel, SDPBackend
mods = {"v0": launch.flash_fwd_kernel}
for v in ("v1", "v2", "v3"):
    spec = importlib.util.spec_from_file_location(f"fwd_{v}", f".devfiles/fwd_{v}.py")
    m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); mods[v] = m.flash_fwd_kernel
B, H, L, D = 2, 16, 4096, 128
torch.manual_seed(0)
q, k, v = (torch.randn(B, L, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
qt, kt_, vt = (x.transpose(1, 2) for x in (q, k, v))
ref = torch.nn.functional.scaled_dot_product_attention(qt, kt_, vt, is_causal=True).transpose(1, 2)
def cudnn():
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        return torch.nn.functional.scaled_dot_product_attention(qt, kt_, vt, is_causal=True)
out = torch.empty_like(q); lse = torch.empty((B, H, L), device="cuda", dtype=torch.float32)
rows = []
for rnd in range(3):
    t = time_kernel(cudnn, "cuda", repeats=30).median_ms; rows.append(f"r{rnd} cudnn {t:.4f}"); base = t
    for name, kern in mods.items():
        launch.flash_fwd_kernel = kern
        for s in ["64,64,4,3"]:
            c = FwdConfig(*map(int, s.split(",")))
            f = lambda: launch.attention_forward(q, k, v, None, None, is_causal=True, softmax_scale=D**-0.5, softcap=0.0, config=c, out=out, lse=lse)
            try:
                f(); torch.cuda.synchronize(); err = (out - ref).abs().max().item()
                t = time_kernel(f, "cuda", repeats=30).median_ms
                rows.append(f"r{rnd} {name} {s} {t:.4f} ratio {t / base:.3f} err {err:.1e}")
            except Exception as e:
                rows.append(f"r{rnd} {name} {s} ERR {str(e).splitlines()[0][:90]}")
        print(rows[-1], flush=True)
print("== summary"); print("\n".join(rows))
