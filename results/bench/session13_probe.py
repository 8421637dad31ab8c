"""Session 13 probe: the backward kernels with interior query/key tiles split from the edge ones
(no bounds or causal test inside), against the kernels of the previous commit, on W1-W3 of
configs/workloads/peers.yaml (same run, fixed configs, `launch.attention_backward` called
directly with the forward's activity summary, medians of 20 with the L2 flushed before each).

Run from the repository root on a GPU: `python results/bench/session13_probe.py`. The previous
kernels are compared when `.scratch/flash_bwd_old.py` holds them
(`git show fc22329:kernels/triton/flash_bwd.py`).
"""

import importlib
import sys
from pathlib import Path

import torch

from dmattn_bench.bench import build_bench_inputs, load_peer_workloads
from dmattn_bench.space import BwdConfig, FwdConfig
from dmattn_bench.timing import time_kernel
from dmattn_kernels.triton import launch

REPEATS = 20
KERNELS = ("flash_bwd_dkdv_kernel", "flash_bwd_dq_kernel", "flash_bwd_dq_from_ds_kernel")
# the session-12 tables' picks for W1 (and W2 on the H200) and for W2 on the H100
BWD_CONFIGS = [BwdConfig(64, 128, 64, 32, 8, 2), BwdConfig(64, 64, 64, 32, 4, 2)]
FWD_CONFIG = FwdConfig(128, 128, 8, 2)


def main():
    device = torch.device("cuda")
    print(f"# {torch.cuda.get_device_name(device)}, torch {torch.__version__}", flush=True)
    variants = {"new": {name: getattr(launch, name) for name in KERNELS}}
    scratch = Path(".scratch")
    if (scratch / "flash_bwd_old.py").exists():
        sys.path.insert(0, str(scratch))
        old = importlib.import_module("flash_bwd_old")
        variants["old"] = {name: getattr(old, name) for name in KERNELS}
        # the new dQ kernel with the old dK/dV kernel: which of the two changes pays
        variants["new-dq"] = dict(variants["old"], flash_bwd_dq_kernel=variants["new"]["flash_bwd_dq_kernel"])
    rows = []
    for pw in load_peer_workloads("configs/workloads/peers.yaml", names=["W1", "W2", "W3"]):
        w = pw.workload
        name = pw.name.split()[0]
        inputs = build_bench_inputs(pw, device)
        q, k, v, mask = inputs.q.detach(), inputs.k.detach(), inputs.v.detach(), inputs.mask
        bias = inputs.bias.detach() if inputs.bias is not None else None
        options = dict(is_causal=True, softmax_scale=w.head_dim ** -0.5, softcap=0.0)
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], dtype=torch.float32, device=device)
        launch.attention_forward(q, k, v, mask, bias, config=FWD_CONFIG, out=out, lse=lse, **options)
        activity = launch.tile_activity(mask, w.seqlen_q, w.seqlen_k, True) if mask is not None else None
        dout = torch.randn_like(q)
        for config in BWD_CONFIGS if name != "W3" else BWD_CONFIGS[1:]:
            grads = {}
            for variant, kernels in variants.items():
                for kernel_name, kernel in kernels.items():
                    setattr(launch, kernel_name, kernel)
                dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
                dbias = torch.empty_like(bias) if bias is not None else None

                def bwd():
                    launch.attention_backward(dout, q, k, v, out, lse, mask, bias, config=config, dq=dq, dk=dk, dv=dv,
                                              dbias=dbias, activity=activity, **options)
                tag = (f"bwd {variant} {config.block_m}x{config.block_n} dq{config.block_m_dq}x{config.block_n_dq} "
                       f"w{config.num_warps} s{config.num_stages}")
                try:
                    t = time_kernel(bwd, device, repeats=REPEATS)
                except Exception as exc:  # noqa: BLE001 - a probe row, not a crash
                    rows.append((name, tag, float("nan"), 0.0, repr(exc)[:120]))
                    continue
                grads[variant] = [x.clone() for x in (dq, dk, dv, dbias) if x is not None]
                finite = all(bool(torch.isfinite(x).all()) for x in grads[variant])
                rows.append((name, tag, t.median_ms, t.spread, f"finite={finite}"))
            for variant in grads:
                if variant != "old" and "old" in grads:
                    diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(grads[variant], grads["old"]))
                    rows.append((name, f"  {variant} vs old max|d|", diff, 0.0, ""))
        for kernel_name, kernel in variants["new"].items():
            setattr(launch, kernel_name, kernel)
        del inputs, q, k, v, mask, bias
        torch.cuda.empty_cache()
    print("| workload | what | median ms | spread | note |")
    print("|---|---|---|---|---|")
    for row in rows:
        print(f"| {row[0]} | {row[1]} | {row[2]:.4f} | {row[3]:.1%} | {row[4]} |")


if __name__ == "__main__":
    main()
