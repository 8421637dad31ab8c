"""Builds the CUDA kernels on first use: nvcc -> cubin, cached on disk.

Toolchain: `nvcc -cubin` of one .cu file per (direction, arch, config, feature flags), loaded through the
CUDA driver API (ctypes on libcuda, see `driver.py`). Each build is one nvcc process (about 1.6 s
for the forward on a 2-core CPU), so a search space compiles in parallel processes, and no
Python extension is built: torch's cpp_extension would compile torch's headers into every
variant and take tens of seconds each.

The cache key is (kernel source hash, arch, the -D list), under $DMATTN_BENCH_CACHE or
~/.cache/dmattn_bench/cuda. Writes are atomic (rename), so concurrent builders at worst
compile the same cubin twice.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from functools import lru_cache
from pathlib import Path

from dmattn_kernels.compile_into import CompileFailed, compile_into

KERNEL_DIR = Path(__file__).parent
# each includes common.cuh; "fwd_ws" and "bwd_ws" are the SM90 warp-specialized kernels
# (rules.forward_kernel, rules.backward_kernel)
SOURCES = {"fwd": KERNEL_DIR / "flash_fwd.cu", "fwd_ws": KERNEL_DIR / "flash_fwd_ws.cu", "bwd": KERNEL_DIR / "flash_bwd.cu",
           "bwd_ws": KERNEL_DIR / "flash_bwd_ws.cu"}
# sm_90a, not sm_90: wgmma is an arch-specific feature (the "a" target), and such a cubin loads
# on SM90 GPUs only, which is all an sm90 build is for.
ARCH_FLAGS = {"sm80": "sm_80", "sm86": "sm_86", "sm89": "sm_89", "sm90": "sm_90a", "sm120": "sm_120"}
NVCC_OPTIONS = ("-cubin", "-O3", "-std=c++17")  # part of the cache key, unlike the include path
NVCC_TIMEOUT_S = 300
ELEMENTS = {"fp16": 0, "bf16": 1}


class CudaBuildError(RuntimeError):
    """nvcc is missing or rejected a kernel variant (the message holds its first error line)."""


def defines(element: str, head_dim: int, num_warps: int, num_stages: int, *, bias_fp32: bool, is_causal: bool,
            has_mask: bool, has_bias: bool, has_softcap: bool, **kernel_own: int | bool) -> tuple[str, ...]:
    """The -D list of one variant: the only place run-time choices become the kernels'
    compile-time parameters (common.cuh's, then `kernel_own`: the forward's BLOCK_N, the
    backward's tiles and dBias/dK/dV layouts; see each .cu file's header)."""
    if element not in ELEMENTS:
        raise ValueError(f"element: got {element!r}, expected one of {sorted(ELEMENTS)}")
    values = dict(ELEMENT=ELEMENTS[element], BIAS_FP32=bias_fp32, HEAD_DIM=head_dim, NUM_WARPS=num_warps,
                  STAGES=num_stages, IS_CAUSAL=is_causal, HAS_MASK=has_mask, HAS_BIAS=has_bias,
                  HAS_SOFTCAP=has_softcap, **kernel_own)
    return tuple(f"-D{name}={int(value)}" for name, value in values.items())


def nvcc() -> str:
    """Path of nvcc: $CUDA_HOME/bin/nvcc, else the one on PATH."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    candidate = Path(home, "bin", "nvcc") if home else None
    if candidate is not None and candidate.exists():
        return str(candidate)
    found = shutil.which("nvcc")
    if found is None:
        raise CudaBuildError("nvcc not found: the cuda backend builds its kernels with it (set CUDA_HOME or PATH)")
    return found


@lru_cache(maxsize=None)
def source_hash() -> str:
    """sha256 of every kernel source and header: a cubin built from other sources is never reused."""
    digest = hashlib.sha256()
    for path in sorted(KERNEL_DIR.glob("*.cu")) + sorted(KERNEL_DIR.glob("*.cuh")):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def cache_dir() -> Path:
    return Path(os.environ.get("DMATTN_BENCH_CACHE", Path.home() / ".cache" / "dmattn_bench")) / "cuda"


def build(direction: str, arch: str, flags: tuple[str, ...]) -> Path:
    """The cubin of one variant for `arch` ("sm90"), compiled now unless cached.

    Raises:
        CudaBuildError: nvcc is missing, failed or timed out.
    """
    if arch not in ARCH_FLAGS:
        raise ValueError(f"arch: got {arch!r}, expected one of {sorted(ARCH_FLAGS)}")
    # the target and nvcc flags too: a cubin built for sm_90 must not stand in for an sm_90a one
    key = hashlib.sha256(" ".join((direction, ARCH_FLAGS[arch], *NVCC_OPTIONS, *flags)).encode()).hexdigest()[:24]
    target = cache_dir() / source_hash() / arch / f"{direction}-{key}.cubin"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    command = [nvcc(), *NVCC_OPTIONS, f"-I{KERNEL_DIR}", f"-arch={ARCH_FLAGS[arch]}", *flags, "-o", str(target),
               str(SOURCES[direction])]
    try:
        return compile_into(target, command, NVCC_TIMEOUT_S)
    except CompileFailed as failure:
        raise CudaBuildError(f"nvcc failed for {arch} {' '.join(flags)}: {failure}") from None
