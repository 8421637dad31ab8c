"""The CUDA forward kernel without a GPU: every candidate of the CUDA search space builds with
nvcc for sm80, sm90 and sm120, the launcher's parameter block matches the compiled kernel's,
and the launcher's structural rules. (It runs on GPUs in results/cuda/.)"""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from dmattn_bench.space import AttentionShape, BwdConfig, FwdConfig
from dmattn_kernels.cuda import build, launch

SPACE_DIR = Path(__file__).parents[1] / "configs" / "space"
needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
SHAPE = AttentionShape(batch=1, seqlen_q=8, seqlen_k=8, num_heads=2, num_heads_kv=1, head_dim=72, is_causal=True,
                       has_mask=True, has_bias=True, bias_requires_grad=False)


@pytest.fixture(scope="module")
def cubin_cache(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cuda-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DMATTN_BENCH_CACHE", str(cache))
        yield cache


@needs_nvcc
def test_every_cuda_candidate_builds_for_sm80_sm90_and_sm120(cubin_cache):
    """What CI's compile-check covers: each candidate either fits or is ruled out by a stated
    limit, and none fails to compile."""
    from dmattn_bench.cuda_check import check_cuda_space

    candidates = check_cuda_space(SPACE_DIR, ["sm80", "sm90", "sm120"], [64, 128], "bf16")
    assert [c for c in candidates if c.status == "compile_error"] == []
    for arch in ("sm80", "sm90", "sm120"):
        fits = [c for c in candidates if c.arch == arch and c.status == "fits"]
        # registers come from the cubins; spills are data (BLOCK_N=128 at D=128 spills a little)
        assert fits and all(c.registers and c.stack_bytes is not None for c in fits), arch
    ruled_out = {c.check for c in candidates if c.status == "unsupported"}
    assert ruled_out <= {"structure", "shared", "registers"}
    assert len(list(cubin_cache.rglob("*.cubin"))) == 2 * sum(c.status == "fits" for c in candidates)


@needs_nvcc
def test_the_launcher_parameter_block_is_the_kernels(cubin_cache):
    """The ctypes struct the launcher passes has the size of the kernel's one parameter."""
    flags = launch.variant(FwdConfig(64, 64, 4, 2), 72, torch.float16, torch.float32, is_causal=True, has_mask=True,
                           softcap=0.0)
    cubin = build.build("fwd", "sm90", flags)
    import triton

    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    elf = subprocess.run([str(cuobjdump), "-elf", str(cubin)], capture_output=True, text=True, check=True).stdout
    sizes = [int(size, 16) for size in re.findall(r"EIATTR_KPARAM_INFO.*?Size\s*:\s*0x([0-9a-f]+)", elf, re.S)]
    assert sizes == [ctypes.sizeof(launch._FwdParams)] == [272]


@needs_nvcc
def test_a_build_failure_names_nvcc_s_error(cubin_cache):
    with pytest.raises(build.CudaBuildError, match="NUM_WARPS"):
        build.build("fwd", "sm90", ("-DELEMENT=1",))


def test_launcher_rules_and_variant_flags():
    assert launch.is_supported(FwdConfig(64, 64, 4, 2), SHAPE) is None
    assert "16 x num_warps" in launch.is_supported(FwdConfig(128, 64, 4, 2), SHAPE)
    assert "no backward" in launch.is_supported(BwdConfig(32, 64, 64, 32, 4, 2), SHAPE)
    # Q, two 2-stage rings of K and V, rows of the head dim padded to 80 plus 8 elements, 2 bytes
    assert launch.forward_shared_bytes(FwdConfig(64, 32, 4, 2), 72) == (64 + 2 * 2 * 32) * 88 * 2
    flags = launch.variant(FwdConfig(64, 32, 4, 3), 72, torch.bfloat16, None, is_causal=False, has_mask=True,
                           softcap=30.0)
    assert flags == ("-DELEMENT=1", "-DBIAS_FP32=0", "-DHEAD_DIM=72", "-DBLOCK_N=32", "-DNUM_WARPS=4",
                     "-DSTAGES=3", "-DIS_CAUSAL=0", "-DHAS_MASK=1", "-DHAS_BIAS=0", "-DHAS_SOFTCAP=1")
