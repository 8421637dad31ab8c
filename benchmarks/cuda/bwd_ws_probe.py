"""The warp-specialized backward prototype (flash_bwd_ws_probe.cu) on an SM90 GPU: checks it
against an fp32 autograd reference beside the shipped backwards, then times it on W3's shape
(bf16 B2 H16 L4096 D128, causal and not) against them: the Triton backward at the tables'
W3 config and the CUDA backward's default. Prints a short table.

Usage: python3 benchmarks/cuda/bwd_ws_probe.py [floors]
    floors: the main kernel's time on W3 causal with parts of it switched off (where the time goes)
"""
import ctypes
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

import torch

from dmattn_bench.registry import get_backend
from dmattn_bench.space import BwdConfig, FwdConfig
from dmattn_bench.timing import time_kernel
from dmattn_kernels.cuda import build, launch

HERE = Path(__file__).parent
BLOCK_N, BLOCK_M, HEAD_DIM, THREADS = 128, 64, 128, 384
ROWS_PER_DELTA_BLOCK = THREADS // 32  # bwd_ws_delta_kernel: a warp per query row


def shared_bytes(stages: int, dq_buffers: int) -> int:
    """flash_bwd_ws_probe.cu's dynamic shared memory: K and V, the Q and dO rings, two dS tiles,
    the fp32 dQ share tiles, the lse and delta rings, and the slack to a 1024-byte boundary."""
    tile = 2 * HEAD_DIM  # bytes of a 16-bit row
    return (2 * BLOCK_N * tile + 2 * stages * BLOCK_M * tile + 2 * BLOCK_M * BLOCK_N * 2
            + dq_buffers * BLOCK_M * HEAD_DIM * 4 + 2 * stages * BLOCK_M * 4 + 1024)

TRITON_W3 = BwdConfig(64, 64, 64, 64, 4, 2)
CUDA_DEFAULT = BwdConfig(64, 64, 64, 64, 4, 2)


class Params(ctypes.Structure):
    _fields_ = ([(name, launch._TensorMap) for name in ("q_map", "k_map", "v_map", "do_map")]
                + [(name, ctypes.c_void_p) for name in ("out", "dout", "dq", "lse", "delta", "dq_accum", "dq_semaphore",
                                                        "dk", "dv")]
                + [("num_heads", ctypes.c_int), ("seqlen_q", ctypes.c_int), ("seqlen_k", ctypes.c_int),
                   ("softmax_scale", ctypes.c_float)])


def cubin(causal: bool, ordered: bool, switches: dict) -> str:
    flags = tuple(f"-D{k}={int(v)}" for k, v in {**dict(ELEMENT=1, BIAS_FP32=0, HEAD_DIM=HEAD_DIM, NUM_WARPS=12,
                                                          STAGES=2, IS_CAUSAL=causal, HAS_MASK=0, HAS_BIAS=0,
                                                          HAS_SOFTCAP=0, WGMMA=1, ORDERED=ordered),
                                                   **switches}.items())
    return _built(flags)  # (ORDERED in `switches` wins over `ordered`)


@lru_cache(maxsize=None)
def _built(flags: tuple[str, ...]) -> str:
    """The prototype's cubin for `flags`, compiled once per process."""
    out = Path(tempfile.gettempdir()) / f"bwd_ws_{'_'.join(flags).replace('-D', '').replace('=', '')}.cubin"
    subprocess.run([build.nvcc(), "-cubin", "-O3", "-std=c++17", f"-I{build.KERNEL_DIR}", "-arch=sm_90a", *flags,
                    "-o", str(out), str(HERE / "flash_bwd_ws_probe.cu")], check=True)
    return str(out)


def runner(q, k, v, out, lse, dout, dq, dk, dv, causal: bool, ordered: bool, **switches):
    """A callable running the prototype's whole backward (delta, buffers, kernel, dQ cast)."""
    batch, seqlen_q, heads, dim = q.shape
    seqlen_k = k.shape[1]
    driver = launch._the_driver()
    shared = shared_bytes(switches.get("STAGES", 2), switches.get("DQ_BUFFERS", 1))
    built = cubin(causal, ordered, switches)
    device = torch.cuda.current_device()
    function = driver.function(device, built, b"bwd_ws_kernel", shared)
    delta_kernel = driver.function(device, built, b"bwd_ws_delta_kernel", 0)
    dq_kernel = driver.function(device, built, b"bwd_ws_dq_kernel", 0)
    m_tiles = -(-seqlen_q // BLOCK_M)
    # NaN where each call stores before it adds: an element left unwritten shows in dq
    accum = torch.full((batch, heads, m_tiles * BLOCK_M, dim), float("nan") if switches.get("FIRST_STORES") else 0.0,
                       device="cuda")
    semaphore = torch.zeros(batch, heads, m_tiles, dtype=torch.int32, device="cuda")
    delta = torch.empty(batch, heads, seqlen_q, device="cuda")
    rows = (3, 1, 2, 0)
    params = Params(driver.tensor_map(q, rows, BLOCK_M, 128, 128), driver.tensor_map(k, rows, BLOCK_N, 128, 128),
                    driver.tensor_map(v, rows, BLOCK_N, 128, 128), driver.tensor_map(dout, rows, BLOCK_M, 128, 128),
                    out.data_ptr(), dout.data_ptr(), dq.data_ptr(), lse.data_ptr(), delta.data_ptr(),
                    accum.data_ptr(), semaphore.data_ptr(), dk.data_ptr(),
                    dv.data_ptr(), heads, seqlen_q, seqlen_k, dim ** -0.5)
    grid = (batch * heads, -(-seqlen_k // BLOCK_N))

    def run():
        stream = torch.cuda.current_stream().cuda_stream
        if not switches.get("FIRST_STORES"):
            accum.zero_()
        semaphore.zero_()
        driver.launch(delta_kernel, (-(-seqlen_q // ROWS_PER_DELTA_BLOCK), batch * heads), THREADS, 0, stream,
                      params)
        driver.launch(function, grid, THREADS, shared, stream, params)
        driver.launch(dq_kernel, (-(-seqlen_q * dim // 2 // THREADS), batch * heads), THREADS, 0, stream, params)

    def kernel_only():  # the main kernel's own time (its counters reset; the sums grow, unread)
        semaphore.zero_()
        driver.launch(function, grid, THREADS, shared, torch.cuda.current_stream().cuda_stream, params)
    run.kernel_only = kernel_only
    return run


def reference(q, k, v, dout, causal):
    qf, kf, vf = (t.float().transpose(1, 2).requires_grad_() for t in (q, k, v))
    scores = qf @ kf.transpose(-1, -2) * q.shape[-1] ** -0.5
    if causal:
        lq, lk = q.shape[1], k.shape[1]
        keep = torch.ones(lq, lk, dtype=torch.bool, device="cuda").tril(lk - lq)
        scores = scores.masked_fill(~keep, float("-inf"))
    out = torch.softmax(scores, -1) @ vf
    out.backward(dout.float().transpose(1, 2))
    return [t.grad.transpose(1, 2) for t in (qf, kf, vf)]


BEST = dict(DQ_PERMUTED=1, FAST_EXP=1, DQ_BUFFERS=2, ASCENDING=1)  # the switches that were no slower
FLOORS = [dict(SKIP_DQ=1), dict(SKIP_DQ=1, FAST_EXP=1), dict(SKIP_DQ=1, SKIP_SYNC=1),
          dict(SKIP_DQ=1, SKIP_DQ_MMA=1), dict(DQ_PERMUTED=1, FAST_EXP=1),
          dict(DQ_PERMUTED=1, FAST_EXP=1, DQ_BUFFERS=2), dict(DQ_PERMUTED=1, FAST_EXP=1, DQ_BUFFERS=2, ORDERED=0),
          dict(DQ_PERMUTED=1, FAST_EXP=1, DQ_BUFFERS=2, ORDERED=0, LONGEST_FIRST=1),
          dict(SKIP_DQ=1, FAST_EXP=1, ORDERED=0, LONGEST_FIRST=1),
          dict(DQ_PERMUTED=1, FAST_EXP=1, DQ_BUFFERS=2, ASCENDING=1),
          dict(DQ_PERMUTED=1, FAST_EXP=1, DQ_BUFFERS=2, ASCENDING=1, ORDERED=0)]


def floors():
    """The main kernel's time on W3 (causal) with parts left out (dQ wrong): where its time goes."""
    torch.manual_seed(0)
    q, k, v, dout = (torch.randn(2, 4096, 16, 128, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    out, lse = torch.empty_like(q), torch.empty(2, 16, 4096, device="cuda")
    get_backend("cuda").forward(q, k, v, None, None, config=FwdConfig(128, 128, 12, 2), out=out, lse=lse,
                                is_causal=True, softmax_scale=128 ** -0.5, softcap=0.0)
    g = [torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)]
    print("\nW3 causal, main kernel only | gpu ms")
    for switches in FLOORS:
        run = runner(q, k, v, out, lse, dout, *g, True, True, **switches)
        run()
        print(f"{switches} | {time_kernel(run.kernel_only, 'cuda').median_ms:.3f}", flush=True)


def main():
    print(torch.cuda.get_device_name(), flush=True)
    cuda, triton = get_backend("cuda"), get_backend("triton")
    rows = []
    for batch, heads, seqlen_q, seqlen_k, causal, timed in ((1, 2, 1000, 1000, True, False),
                                                            (1, 2, 700, 1200, True, False),
                                                            (1, 2, 1200, 700, True, False),
                                                            (1, 2, 1000, 777, False, False),
                                                            (2, 16, 4096, 4096, True, True),
                                                            (2, 16, 4096, 4096, False, True)):
        torch.manual_seed(0)
        q = torch.randn(batch, seqlen_q, heads, 128, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(batch, seqlen_k, heads, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        dout = torch.randn_like(q)
        options = dict(is_causal=causal, softmax_scale=128 ** -0.5, softcap=0.0)
        out, lse = torch.empty_like(q), torch.empty(batch, heads, seqlen_q, device="cuda")
        cuda.forward(q, k, v, None, None, config=FwdConfig(128, 128, 12, 2), out=out, lse=lse, **options)
        expected = reference(q, k, v, dout, causal) if not timed else None
        shape = f"B{batch} H{heads} {seqlen_q}x{seqlen_k} {'causal' if causal else 'full'}"
        grads = {}
        variants = [("triton 64x64 w4", lambda g: lambda: triton.backward(
                        dout, q, k, v, out, lse, None, None, config=TRITON_W3, dq=g[0], dk=g[1], dv=g[2], dbias=None,
                        **options)),
                    ("cuda 64x64 w4 (two kernels)", lambda g: lambda: cuda.backward(
                        dout, q, k, v, out, lse, None, None, config=CUDA_DEFAULT, dq=g[0], dk=g[1], dv=g[2],
                        dbias=None, **options)),
                    ("ws prototype (deterministic)", lambda g: runner(q, k, v, out, lse, dout, *g, causal, True,
                                                                      **BEST)),
                    ("ws prototype (unordered)", lambda g: runner(q, k, v, out, lse, dout, *g, causal, False,
                                                                  **BEST)),
                    ("ws prototype (deterministic), split waits", lambda g: runner(
                        q, k, v, out, lse, dout, *g, causal, True, SPLIT_WAITS=1, **BEST)),
                    ("ws prototype (deterministic), split waits, first stores", lambda g: runner(
                        q, k, v, out, lse, dout, *g, causal, True, SPLIT_WAITS=1, FIRST_STORES=1, **BEST))]
        for label, make in variants:
            g = [torch.full_like(q, float("nan")), torch.full_like(k, float("nan")), torch.full_like(v, float("nan"))]
            run = make(g)
            run()
            torch.cuda.synchronize()
            first = [x.clone() for x in g]
            run()
            torch.cuda.synchronize()
            repeat = all(torch.equal(a, b) for a, b in zip(first, g))
            error = "-"
            if expected is not None:
                error = " ".join(f"{(a.float() - b).abs().max().item():.2e}" for a, b in zip(g, expected))
            finite = all(torch.isfinite(x).all().item() for x in g)
            ms = time_kernel(run, "cuda").median_ms if timed else float("nan")
            rows.append((shape, label, ms, repeat, finite, error))
            print(rows[-1], flush=True)
            if timed and hasattr(run, "kernel_only"):
                rows.append((shape, label + ": main kernel only", time_kernel(run.kernel_only, "cuda").median_ms,
                             "-", "-", "-"))
    print("\nshape | backward | gpu ms | repeat bitwise | finite | max|err| vs fp32 autograd (dq dk dv)")
    for shape, label, ms, repeat, finite, error in rows:
        print(f"{shape} | {label} | {ms:.3f} | {repeat} | {finite} | {error}")


if __name__ == "__main__":
    import sys
    floors() if sys.argv[1:] == ["floors"] else main()
