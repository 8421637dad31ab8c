"""Test-only fault injection, loaded as a plugin: DMATTN_BENCH_PLUGINS=tests.fault_injection.

DMATTN_FAULTS maps forward `block_m` values to faults, e.g. "32=abort,64=hang,128=nan,256=raise".
A Triton forward candidate with such a block_m then:
  abort  kills its process (like a segfault or a device-side assert),
  hang   never returns,
  nan    writes NaN into its output,
  raise  raises an exception,
  ima    (CUDA only) launches a kernel that stores to an unmapped address: an illegal memory
         access, which poisons the process's CUDA context.
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
UNMAPPED = 1 << 47  # far beyond any allocation of this process


@triton.jit
def _store_anywhere(ptr):
    tl.store(ptr + tl.arange(0, 16), tl.full([16], 1.0, tl.float32))


class _Address:
    """What Triton needs of a tensor argument: an address and an element type."""

    def __init__(self, address: int):
        self.address = address
        self.dtype = torch.float32

    def data_ptr(self) -> int:
        return self.address


def _illegal_memory_access(out: torch.Tensor) -> None:
    _store_anywhere[(1,)](_Address(out.data_ptr() + UNMAPPED))
    torch.cuda.synchronize()


def _faulty_forward(real_forward):
    def forward(q, k, v, mask, bias, *, config, out, lse, **options):
        fault = FAULTS.get(str(config.block_m))
        if fault is None or is_compile_only():
            return real_forward(q, k, v, mask, bias, config=config, out=out, lse=lse, **options)
        if fault == "abort":
            os.abort()
        if fault == "hang":
            time.sleep(3600)
        if fault == "raise":
            raise RuntimeError("injected failure")
        if fault == "ima":
            _illegal_memory_access(out)
        real_forward(q, k, v, mask, bias, config=config, out=out, lse=lse, **options)
        out.fill_(float("nan"))  # "nan"

    return forward


_real = registry.get_backend("triton")
registry.override_backend(registry.Backend("triton", _faulty_forward(_real.forward), _real.backward, _real.is_supported))
