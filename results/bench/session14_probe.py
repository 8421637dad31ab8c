"""Session 14 probe: the kernels of the working tree against those of the last commit, on W1-W3
of configs/workloads/peers.yaml (same run, fixed configs, `launch` called directly, medians of
20 with the L2 flushed before each). What changed: a bias whose query dim broadcasts (W2's
(B, Hkv, 1, L)) is read as one vector per key tile (forward, dQ) or once per key block (dK/dV)
instead of as a full tile; the dK/dV kernel loads a full bias one query tile ahead, like the mask.

Run from the repository root on a GPU: `python results/bench/session14_probe.py`. The previous
kernels are compared when `.scratch/oldpkg/dmattn_kernels_old` holds them (`git archive HEAD
kernels`, the package renamed).
"""

import importlib
import sys
from pathlib import Path

import torch

from dmattn_bench.bench import build_bench_inputs, load_peer_workloads
from dmattn_bench.space import BwdConfig, FwdConfig
from dmattn_bench.timing import time_kernel

REPEATS = 20
FWD_CONFIGS = [FwdConfig(128, 128, 8, 2)]
BWD_CONFIGS = {"W1": [BwdConfig(32, 128, 64, 64, 8, 2), BwdConfig(64, 128, 64, 64, 8, 2)],
               "W2": [BwdConfig(64, 64, 64, 32, 4, 2), BwdConfig(32, 128, 64, 32, 8, 2)],
               "W3": [BwdConfig(64, 64, 64, 64, 4, 2)]}


def main():
    device = torch.device("cuda")
    print(f"# {torch.cuda.get_device_name(device)}, torch {torch.__version__}", flush=True)
    launches = {"new": importlib.import_module("dmattn_kernels.triton.launch")}
    old_root = Path(".scratch/oldpkg")
    if (old_root / "dmattn_kernels_old").exists():
        sys.path.insert(0, str(old_root))
        launches["old"] = importlib.import_module("dmattn_kernels_old.triton.launch")
    rows = []
    for pw in load_peer_workloads("configs/workloads/peers.yaml", names=["W1", "W2", "W3"]):
        w = pw.workload
        name = pw.name.split()[0]
        inputs = build_bench_inputs(pw, device)
        q, k, v, mask = inputs.q.detach(), inputs.k.detach(), inputs.v.detach(), inputs.mask
        bias = inputs.bias.detach() if inputs.bias is not None else None
        options = dict(is_causal=True, softmax_scale=w.head_dim ** -0.5, softcap=0.0)
        dout = torch.randn_like(q)
        results = {}
        for config in FWD_CONFIGS:
            for variant, launch in launches.items():
                out = torch.empty_like(q)
                lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], dtype=torch.float32, device=device)

                def fwd():
                    launch.attention_forward(q, k, v, mask, bias, config=config, out=out, lse=lse, **options)
                t = time_kernel(fwd, device, repeats=REPEATS)
                results[("fwd", variant)] = (out.clone(), lse.clone())
                rows.append((name, f"fwd {variant} {config.block_m}x{config.block_n} w{config.num_warps} "
                             f"s{config.num_stages}", t.median_ms, t.spread, f"finite={bool(torch.isfinite(out).all())}"))
        out, lse = results[("fwd", "new")]
        if "old" in launches:
            o_old, l_old = results[("fwd", "old")]
            rows.append((name, "  fwd new vs old max|d| out", (out.float() - o_old.float()).abs().max().item(), 0.0, ""))
        activity = launches["new"].tile_activity(mask, w.seqlen_q, w.seqlen_k, True) if mask is not None else None
        for config in BWD_CONFIGS[name]:
            grads = {}
            for variant, launch in launches.items():
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
            if "old" in grads and "new" in grads:
                diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(grads["new"], grads["old"]))
                rows.append((name, "  bwd new vs old max|d|", diff, 0.0, ""))
        del inputs, q, k, v, mask, bias
        torch.cuda.empty_cache()
    print("| workload | what | median ms | spread | note |")
    print("|---|---|---|---|---|")
    for row in rows:
        print(f"| {row[0]} | {row[1]} | {row[2]:.4f} | {row[3]:.1%} | {row[4]} |")


if __name__ == "__main__":
    main()
