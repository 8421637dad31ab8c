"""Session 12 probe: the dQ kernels' key tile (block_n_dq), which the sm90 search space fixes at
32. W1 takes dQ from the stored dS (`flash_bwd_dq_from_ds_kernel`, memory-bound), W2 recomputes
it (`flash_bwd_dq_kernel`). The whole backward is timed with the dK/dV tiles fixed, so the
differences are the dQ kernel's (same run, medians of 20, L2 flushed before each).

Run from the repository root on a GPU: `python results/bench/session12_dq_probe.py`.
"""

import torch

from dmattn_bench.bench import build_bench_inputs, load_peer_workloads
from dmattn_bench.space import BwdConfig, FwdConfig
from dmattn_bench.timing import time_kernel
from dmattn_kernels.triton import launch

DQ_TILES = [(64, 32), (64, 64), (64, 128), (128, 32), (128, 64)]
DKDV = {"W1": (64, 128, 8), "W2": (64, 64, 4)}  # the bench tables' dK/dV tiles and warps


def main():
    device = torch.device("cuda")
    print(f"# {torch.cuda.get_device_name(device)}, torch {torch.__version__}", flush=True)
    print("| workload | bwd config | median ms | spread | dq max abs diff vs dq64x32 |")
    print("|---|---|---|---|---|")
    for pw in load_peer_workloads("configs/workloads/peers.yaml", names=["W1", "W2"]):
        w, name = pw.workload, pw.name.split()[0]
        inputs = build_bench_inputs(pw, device)
        q, k, v, mask, bias = inputs.q, inputs.k, inputs.v, inputs.mask, inputs.bias.detach()
        options = dict(is_causal=True, softmax_scale=w.head_dim ** -0.5, softcap=0.0)
        out, lse = torch.empty_like(q), torch.empty(q.shape[0], q.shape[2], q.shape[1], device=device)
        launch.attention_forward(q, k, v, mask, bias, config=FwdConfig(128, 128, 8, 2), out=out, lse=lse, **options)
        dout = torch.randn_like(q)
        block_m, block_n, warps = DKDV[name]
        first = None
        for dq_m, dq_n in DQ_TILES:
            config = BwdConfig(block_m, block_n, dq_m, dq_n, warps, 2)
            dq, dk, dv, dbias = (torch.empty_like(t) for t in (q, k, v, bias))
            try:
                t = time_kernel(lambda: launch.attention_backward(dout, q, k, v, out, lse, mask, bias, config=config,
                                                                  dq=dq, dk=dk, dv=dv, dbias=dbias, **options),
                                device, repeats=20)
            except Exception as exc:  # noqa: BLE001 - a probe row, not a crash
                print(f"| {name} | {config} | error | | {repr(exc)[:100]} |")
                continue
            first = dq.clone() if first is None else first
            diff = (dq.float() - first.float()).abs().max().item()
            print(f"| {name} | {block_m}x{block_n} dq{dq_m}x{dq_n} w{warps} s2 | {t.median_ms:.4f} | {t.spread:.1%} | "
                  f"{diff:.2e} |", flush=True)
        del inputs, q, k, v, mask, bias
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
