"""Test-only fault injection, loaded as a plugin: DMATTN_BENCH_PLUGINS=tests.fault_injection.

DMATTN_FAULTS maps forward tiles (block_m x block_n) to faults, e.g. "32x16=abort,64x16=hang".
A Triton forward candidate with such tiles then:
  abort  kills its process (like a segfault or a device-side assert),
  hang   never returns,
  nan    writes NaN into its output,
  raise  raises an exception,
  ima    (CUDA only) launches a kernel that stores 2^40 elements past a real allocation: an
         illegal memory access, which poisons the process's CUDA context;
  oom    raises CUDA's out-of-memory error on its first run only (a marker file in the folder
         DMATTN_FAULTS_STATE names), as a trial crowded by other processes' tensors would.
Every other candidate runs the real kernels. Compile-only passes (the tuner's parallel compile
workers) are left alone: a fault can only strike where a candidate really runs.
"""

from __future__ import annotations

import os
import time

import torch
import triton
import triton.language as tl

from dmattn_bench import registry
from dmattn_kernels.triton import is_compile_only

FAULTS = dict(item.split("=") for item in os.environ.get("DMATTN_FAULTS", "").split(",") if item)
# Far past any allocation. The offset is applied inside the kernel: Triton checks that a pointer
# argument itself is device memory, so the base must be a real tensor.
UNMAPPED_ELEMENTS = 1 << 40


@triton.jit
def _store_far_away(ptr, offset):
    tl.store(ptr + offset + tl.arange(0, 16), tl.full([16], 1.0, tl.float32))


def _illegal_memory_access(out: torch.Tensor) -> None:
    target = torch.empty(16, dtype=torch.float32, device=out.device)
    _store_far_away[(1,)](target, UNMAPPED_ELEMENTS)
    torch.cuda.synchronize()


def _faulty_forward(real_forward):
    def forward(q, k, v, mask, bias, *, config, out, lse, **options):
        fault = FAULTS.get(f"{config.block_m}x{config.block_n}")
        if fault is None or is_compile_only():
            return real_forward(q, k, v, mask, bias, config=config, out=out, lse=lse, **options)
        if fault == "abort":
            os.abort()
        if fault == "hang":
            time.sleep(3600)
        if fault == "raise":
            raise RuntimeError("injected failure")
        if fault == "oom":
            marker = os.path.join(os.environ["DMATTN_FAULTS_STATE"], f"{config.block_m}x{config.block_n}")
            if not os.path.exists(marker):
                open(marker, "w").close()
                raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.00 GiB (injected)")
            return real_forward(q, k, v, mask, bias, config=config, out=out, lse=lse, **options)
        if fault == "ima":
            _illegal_memory_access(out)
        real_forward(q, k, v, mask, bias, config=config, out=out, lse=lse, **options)
        out.fill_(float("nan"))  # "nan"

    return forward


_real = registry.get_backend("triton")
registry.override_backend(registry.Backend("triton", _faulty_forward(_real.forward), _real.backward, _real.is_supported,
                                           _real.kernels))
