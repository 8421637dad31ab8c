"""Session 12 probe: the mask's activity pass, its reuse by the backward, and the fp32-bias
fallback of the forward, on W1/W2 of configs/workloads/peers.yaml (same run, fixed configs, `launch`
called directly, medians of 20 with the L2 flushed before each).

Run from the repository root on a GPU: `python results/bench/session12_probe.py`. Optional
experiment modules (not shipped) are compared when `.scratch/` holds them.
"""

import importlib
import sys
from pathlib import Path

import torch
import triton

from dmattn_bench.bench import build_bench_inputs, load_peer_workloads
from dmattn_bench.space import BwdConfig, FwdConfig
from dmattn_bench.timing import time_kernel
from dmattn_kernels.triton import launch
from dmattn_kernels.triton.activity import CELL, WORD_BYTES, tile_activity_kernel

REPEATS = 20
FWD_CONFIGS = [FwdConfig(128, 128, 8, 2), FwdConfig(64, 128, 4, 2), FwdConfig(128, 64, 8, 3), FwdConfig(64, 64, 4, 2)]
BWD_CONFIG = BwdConfig(64, 128, 64, 32, 8, 2)


def activity_pass(mask, seqlen, words):
    mask_arg = mask.view(torch.uint8)
    out = torch.zeros(launch.activity_shape(mask.shape, seqlen, seqlen), dtype=torch.int8, device=mask.device)
    grid = (triton.cdiv(seqlen, launch.ACTIVITY_BLOCK_M), triton.cdiv(seqlen, launch.ACTIVITY_BLOCK_N),
            mask.shape[0] * mask.shape[1])

    def run():
        tile_activity_kernel[grid](mask_arg, out, *launch._zero_size1_strides(mask_arg), *out.stride(), mask.shape[1],
                                   seqlen, seqlen, IS_CAUSAL=True, BLOCK_M=launch.ACTIVITY_BLOCK_M,
                                   BLOCK_N=launch.ACTIVITY_BLOCK_N, CELL=CELL, WORDS=words, WORD=WORD_BYTES,
                                   num_warps=8)
    return run, out


def main():
    device = torch.device("cuda")
    print(f"# {torch.cuda.get_device_name(device)}, torch {torch.__version__}", flush=True)
    rows = []
    scratch = Path(".scratch")
    variants = {"main": launch.flash_fwd_kernel}
    if (scratch / "fwd_inplace.py").exists():
        sys.path.insert(0, str(scratch))
        variants["inplace-mask"] = importlib.import_module("fwd_inplace").flash_fwd_kernel
    for pw in load_peer_workloads("configs/workloads/peers.yaml", names=["W1", "W2"]):
        w = pw.workload
        inputs = build_bench_inputs(pw, device)
        q, k, v, mask, bias = inputs.q, inputs.k, inputs.v, inputs.mask, inputs.bias.detach()
        name = pw.name.split()[0]
        # -- the activity pass, bytes vs words --
        got = {}
        for words in (False, True):
            run, out = activity_pass(mask, w.seqlen_q, words)
            t = time_kernel(run, device, repeats=REPEATS)
            got[words] = out.clone()
            gbps = mask.numel() / 2 / (t.median_ms * 1e-3) / 1e9
            rows.append((name, f"activity words={words}", t.median_ms, t.spread, f"{gbps:.0f} GB/s causal half"))
        rows.append((name, "activity words == bytes", float(torch.equal(got[False], got[True])), 0.0, ""))
        # -- forward: shipped kernel and experiment variants, bf16 bias and fp32 bias --
        options = dict(is_causal=True, softmax_scale=w.head_dim ** -0.5, softcap=0.0)
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], dtype=torch.float32, device=device)
        reference_out = {}
        for variant, kernel in variants.items():
            launch.flash_fwd_kernel = kernel
            for config in FWD_CONFIGS:
                for bias_in in (bias, bias.float()):
                    tag = "fp32 bias" if bias_in.dtype == torch.float32 else "bf16 bias"
                    if tag == "fp32 bias" and (variant != "main" or config != FWD_CONFIGS[0]):
                        continue
                    try:
                        def fwd():
                            launch.attention_forward(q, k, v, mask, bias_in, config=config, out=out, lse=lse, **options)
                        t = time_kernel(fwd, device, repeats=REPEATS)
                        key = config  # the fp32-bias rows compare with the bf16-bias run
                        if key not in reference_out:
                            reference_out[key] = out.clone()
                        diff = (out.float() - reference_out[key].float()).abs().max().item()
                        finite = bool(torch.isfinite(out).all())
                        rows.append((name, f"fwd {variant} {config.block_m}x{config.block_n} w{config.num_warps} "
                                           f"s{config.num_stages} {tag}", t.median_ms, t.spread,
                                     f"finite={finite} max|d main|={diff:.2e}"))
                    except Exception as exc:  # noqa: BLE001 - a probe row, not a crash
                        rows.append((name, f"fwd {variant} {config} {tag}", float("nan"), 0.0, repr(exc)[:120]))
        launch.flash_fwd_kernel = variants["main"]
        learned = {str(key[0]): str(config) for key, config in launch._FITTED_FWD.items()}
        rows.append((name, "fp32-bias fallback configs learned", float(len(learned)), 0.0, str(learned)))
        # -- backward: with the forward's activity vs reading the mask again --
        launch.attention_forward(q, k, v, mask, bias, config=FWD_CONFIGS[1], out=out, lse=lse, **options)
        activity = launch.tile_activity(mask, w.seqlen_q, w.seqlen_k, True)
        dout = torch.randn_like(q)
        grads = {}
        for reuse in (False, True):
            dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
            dbias = torch.empty_like(bias)

            def bwd():
                launch.attention_backward(dout, q, k, v, out, lse, mask, bias, config=BWD_CONFIG, dq=dq, dk=dk, dv=dv,
                                          dbias=dbias, activity=activity if reuse else None, **options)
            t = time_kernel(bwd, device, repeats=REPEATS)
            grads[reuse] = [x.clone() for x in (dq, dk, dv, dbias)]
            rows.append((name, f"bwd 64x128 dq64x32 w8 s2 reuse_activity={reuse}", t.median_ms, t.spread, ""))
        same = all(torch.equal(a, b) for a, b in zip(grads[False], grads[True]))
        rows.append((name, "bwd grads bitwise equal with reuse", float(same), 0.0, ""))
        del inputs, q, k, v, mask, bias
        torch.cuda.empty_cache()
    print("| workload | what | median ms | spread | note |")
    print("|---|---|---|---|---|")
    for row in rows:
        print(f"| {row[0]} | {row[1]} | {row[2]:.4f} | {row[3]:.1%} | {row[4]} |")


if __name__ == "__main__":
    main()
