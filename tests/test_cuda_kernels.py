"""The CUDA kernels without a GPU: every candidate of the CUDA search spaces (forward and
backward) builds with nvcc for sm80, sm90 and sm120, the launcher's parameter blocks match the
compiled kernels', and the launcher's structural rules, defaults and -D lists. (They run on GPUs
in the GPU tier and `benchmarks/cuda/`.)"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from dmattn_bench.registry import get_backend
from dmattn_bench.space import AttentionShape, BwdConfig, FwdConfig, Packing, config_label
from dmattn_bench.tiles import default_entries
from dmattn_kernels.cuda import backward, build, driver, forward, params, rules, shared_memory, variants

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
    from dmattn_bench.tuning.cuda_check import check_cuda_space

    candidates = check_cuda_space(SPACE_DIR, ["sm80", "sm90", "sm120"], [64, 128], "bf16")
    assert [c for c in candidates if c.status == "compile_error"] == []
    for arch in ("sm80", "sm90", "sm120"):
        for direction in ("fwd", "bwd"):
            fits = [c for c in candidates if c.arch == arch and c.direction == direction and c.status == "fits"]
            # registers come from the cubins; spills are data (BLOCK_N=128 at D=128 spills a little)
            assert fits and all(c.registers and c.stack_bytes is not None for c in fits), (arch, direction)
    ruled_out = {c.check for c in candidates if c.status == "unsupported"}
    assert ruled_out <= {"structure", "shared", "registers"}
    # a cubin per feature variant (cuda_check.VARIANTS) of each candidate that fits
    assert len(list(cubin_cache.rglob("*.cubin"))) == 3 * sum(c.status == "fits" for c in candidates)


def _parameter_sizes(cubin: Path) -> list[int]:
    import triton

    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    elf = subprocess.run([str(cuobjdump), "-elf", str(cubin)], capture_output=True, text=True, check=True).stdout
    return [int(size, 16) for size in re.findall(r"EIATTR_KPARAM_INFO.*?Size\s*:\s*0x([0-9a-f]+)", elf, re.S)]


@needs_nvcc
def test_the_launcher_parameter_blocks_are_the_kernels(cubin_cache):
    """The ctypes structs the launcher passes have the size of each kernel's one parameter."""
    for head_dim in (72, 128):  # mma.sync and wgmma (the tile allows it on sm90 at 128)
        flags = variants.variant(FwdConfig(64, 64, 4, 2), head_dim, torch.float16, torch.float32, arch="sm90",
                                 is_causal=True, has_mask=True, softcap=0.0)
        assert _parameter_sizes(build.build("fwd", "sm90", flags)) == [ctypes.sizeof(params.FwdParams)] == [272]
    flags = variants.backward_variant(BwdConfig(32, 64, 64, 32, 4, 2), 72, torch.bfloat16, torch.float32, arch="sm90",
                                      is_causal=True, has_mask=True, softcap=0.0, group=2, dbias=(True, torch.float32))
    # the delta, dK/dV and dQ kernels all take BwdParams
    assert _parameter_sizes(build.build("bwd", "sm90", flags)) == [ctypes.sizeof(params.BwdParams)] * 3 == [472] * 3
    # the warp-specialized backward's three kernels take seven tensor maps, BwdParams and its dQ buffers
    flags = variants.backward_variant(BwdConfig(64, 128, 64, 128, 12, 2), 128, torch.bfloat16, torch.bfloat16,
                                      arch="sm90", is_causal=True, has_mask=True, softcap=0.0, group=2,
                                      dbias=(True, torch.float32))
    assert _parameter_sizes(build.build("bwd_ws", "sm90", flags)) == [ctypes.sizeof(params.BwdWsParams)] * 3
    assert ctypes.sizeof(params.BwdWsParams) == 1408
    assert params.BwdWsParams.backward.offset == 7 * 128


@needs_nvcc
def test_the_warp_specialized_forward_takes_its_tensor_maps_and_the_forward_s_parameters(cubin_cache):
    """Five 128-byte tensor maps (128-byte aligned), then FwdParams, padded to a multiple of 128."""
    flags = variants.variant(FwdConfig(128, 128, 12, 2), 128, torch.bfloat16, torch.bfloat16, arch="sm90",
                             is_causal=True, has_mask=True, softcap=0.0)
    assert _parameter_sizes(build.build("fwd_ws", "sm90", flags)) == [ctypes.sizeof(params.WsParams)] == [1024]
    assert params.WsParams.forward.offset == 5 * 128


def test_the_warp_specialized_forward_is_a_producer_warpgroup_beside_one_per_64_rows():
    assert rules.warp_specialized(FwdConfig(128, 128, 12, 2), 128, "sm90")
    assert rules.warp_specialized(FwdConfig(64, 64, 8, 2), 64, "sm90")
    assert rules.warp_specialized(FwdConfig(128, 64, 12, 2), 120, "sm90")  # padded to 128
    assert rules.warp_specialized(FwdConfig(192, 64, 16, 2), 128, "sm90")  # three consumers
    assert rules.warp_specialized(FwdConfig(128, 128, 12, 2), 96, "sm90")  # on 128 columns (below)
    assert not rules.warp_specialized(FwdConfig(128, 128, 12, 2), 128, "sm80")  # TMA and wgmma: Hopper
    assert not rules.warp_specialized(FwdConfig(128, 128, 8, 2), 128, "sm90")  # the wgmma forward's shape
    assert rules.forward_kernel(FwdConfig(128, 128, 12, 2), 128, "sm90") == "fwd_ws"
    assert rules.forward_kernel(FwdConfig(128, 128, 8, 2), 128, "sm90") == "fwd"
    shape = AttentionShape(1, 16, 16, 2, 1, 128)
    assert rules.is_supported(FwdConfig(128, 128, 12, 2), shape) is None
    assert "block_n=16 is not one of" in rules.is_supported(FwdConfig(128, 16, 12, 2), shape)
    assert rules.is_supported(FwdConfig(128, 128, 12, 2), replace(shape, head_dim=96)) is None
    assert "at most 12 warps" in rules.is_supported(FwdConfig(192, 64, 16, 2), replace(shape, head_dim=200))
    assert "sm90 only (here: sm80)" in rules.arch_reason(FwdConfig(128, 128, 12, 2), 128, "sm80")
    assert rules.arch_reason(FwdConfig(128, 128, 12, 2), 128, "sm90") is None
    assert rules.arch_reason(FwdConfig(128, 128, 8, 2), 128, "sm80") is None


def test_the_warp_specialized_forward_runs_head_dims_between_multiples_of_64_on_the_next():
    """At D80 and D96 both backends multiply 128 columns (Triton's tiles are powers of two), and on
    an H200 the warp-specialized forward took 0.490 ms at D128 causal where the tuned Triton
    forward took 0.586 / 0.585 at D80 / D96 (results/bench/h200-sweep.md). So it runs such a head
    dim on the tiles of the next multiple of 64: its variant alone adds SWIZZLE_PADDED (the others
    keep the code, and the stamps, they had), and its shared memory is the wider tiles'."""
    ws = FwdConfig(128, 128, 12, 2, overlap=1, persistent=1)

    def flags(head_dim):
        return variants.variant(ws, head_dim, torch.bfloat16, torch.bfloat16, arch="sm90", is_causal=False,
                                has_mask=True, softcap=0.0)

    assert [rules.swizzled_head_dim(d) for d in (40, 64, 80, 96, 120, 128, 136, 192, 256)] == [
        64, 64, 128, 128, 128, 128, 192, 192, 256]
    for head_dim in (40, 80, 96, 136):
        assert "-DSWIZZLE_PADDED=1" in flags(head_dim)
        wider = -(-head_dim // 64) * 64
        assert shared_memory.forward_shared_bytes(ws, head_dim, "sm90") == shared_memory.forward_shared_bytes(
            ws, wider, "sm90")
    for head_dim in (64, 120, 128, 192):  # 120: its 16-column padding is already whole lines
        assert not any("SWIZZLE_PADDED" in flag for flag in flags(head_dim))
    # the plain wgmma forward and every other kernel keep the 16-column padding
    plain = FwdConfig(128, 128, 8, 2)
    assert not rules.uses_wgmma(plain, 96, "sm90")
    assert shared_memory.forward_shared_bytes(plain, 96, "sm90") < shared_memory.forward_shared_bytes(plain, 128, "sm90")


@needs_nvcc
def test_the_warp_specialized_forward_at_d96_builds_as_d128_does(cubin_cache):
    """nvcc builds the D96 variants (one item a CTA, and overlapped and persistent) with the D128
    ones' registers and stack and no local memory: the same tiles, another store mask."""
    import triton

    def usage(head_dim, config):
        flags = variants.variant(config, head_dim, torch.bfloat16, torch.bfloat16, arch="sm90", is_causal=True,
                                 has_mask=True, softcap=0.0)
        cubin = build.build("fwd_ws", "sm90", flags)
        cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        text = subprocess.run([str(cuobjdump), "-res-usage", str(cubin)], capture_output=True, text=True,
                              check=True).stdout
        return re.search(r"REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", text).groups()

    for config in (FwdConfig(128, 128, 12, 2), FwdConfig(128, 128, 12, 2, overlap=1, persistent=1)):
        assert usage(96, config) == usage(128, config)
        assert usage(96, config)[2] == "0"  # no local memory (spills)


def test_masks_and_16_bit_biases_are_staged_where_tma_can_take_their_rows():
    rows, keys, none = shared_memory.TILES_OF_ROWS, shared_memory.TILES_OF_KEYS, shared_memory.NOT_STAGED
    full = torch.zeros(2, 4, 64, 64, dtype=torch.uint8)
    assert variants.staged_tiles(full, 64) == rows
    assert variants.staged_tiles(torch.zeros(2, 1, 1, 64, dtype=torch.uint8), 64) == keys  # a padding mask
    assert variants.staged_tiles(torch.zeros(1, 4, 64, 64, dtype=torch.bfloat16), 64) == rows
    assert variants.staged_tiles(torch.zeros(2, 4, 1, 64, dtype=torch.bfloat16), 64) == keys  # per-key bias
    assert variants.staged_tiles(None, 64) == none
    assert variants.staged_tiles(full.transpose(2, 3), 64) == none  # keys not contiguous
    assert variants.staged_tiles(full[:, :1].expand(2, 4, 64, 64), 64) == none  # stride 0 over 4 heads
    assert variants.staged_tiles(torch.zeros(2, 4, 64, 72, dtype=torch.uint8), 64) == none  # 72-byte rows
    assert variants.staged_tiles(torch.zeros(2, 4, 64, 1, dtype=torch.uint8), 64) == none  # one key for all
    assert variants.staged_tiles(torch.zeros(2, 4, 32, 64, dtype=torch.uint8), 64) == none  # neither Lq nor 1 row

    def staging(bias_dtype, has_mask=True, mask_tiles=rows, bias_tiles=rows):
        flags = variants.variant(FwdConfig(128, 64, 12, 2), 128, torch.bfloat16, bias_dtype, arch="sm90",
                                 is_causal=True, has_mask=has_mask, softcap=0.0, mask_tiles=mask_tiles,
                                 bias_tiles=bias_tiles)
        return [flag for flag in flags if "TILES" in flag or "SCORE_STAGES" in flag]

    assert staging(torch.bfloat16) == ["-DSCORE_STAGES=2", "-DMASK_TILES=1", "-DBIAS_TILES=1"]
    assert staging(torch.float32) == ["-DSCORE_STAGES=2", "-DMASK_TILES=1", "-DBIAS_TILES=0"]  # fp32: global
    assert staging(torch.float16, has_mask=False, bias_tiles=keys) == [
        "-DSCORE_STAGES=2", "-DMASK_TILES=0", "-DBIAS_TILES=2"]
    assert staging(None, has_mask=False) == ["-DSCORE_STAGES=0", "-DMASK_TILES=0", "-DBIAS_TILES=0"]


def test_the_staged_ring_takes_what_is_left_beside_q_and_the_k_and_v_rings():
    rows, keys = shared_memory.TILES_OF_ROWS, shared_memory.TILES_OF_KEYS
    wide, narrow, deep = FwdConfig(128, 128, 12, 2), FwdConfig(128, 64, 12, 2), FwdConfig(128, 128, 12, 3)
    base = (128 + 2 * 2 * 128) * 128 * 2 + 1024  # Q, two 2-stage rings of 128 x 128 tiles, alignment slack
    assert shared_memory.score_slot_bytes(wide, rows, rows) == 128 * 128 * 3  # a mask byte and a bf16 per position
    assert shared_memory.score_slot_bytes(wide, rows, keys) == 128 * 128 + 1024  # one 256-byte bias row, on 1 KiB
    # a full mask and bias fit one slot beside 128-key rings, a full mask and per-key bias two
    assert shared_memory.score_stages(wide, 128, rows, rows) == 1
    assert shared_memory.forward_shared_bytes(wide, 128, "sm90", rows, rows) == base + 128 * 128 * 3
    assert shared_memory.score_stages(wide, 128, rows, keys) == 2
    assert shared_memory.score_stages(narrow, 128, rows, rows) == 2
    assert shared_memory.score_stages(deep, 128, keys, keys) == 0  # 3-stage 128-key rings leave no room
    none = shared_memory.NOT_STAGED
    assert shared_memory.forward_shared_bytes(wide, 128, "sm90", none, none) == base
    room = shared_memory.SM90_SHARED_BYTES - shared_memory.WS_STATIC_BYTES
    for config in (wide, narrow, deep):  # the largest staging bounds what prune and compile-check see
        assert shared_memory.forward_shared_bytes(config, 128, "sm90") <= room


def test_a_forward_signature_is_checked_and_planned_once(monkeypatch):
    """The launcher's checks, variant and launch geometry depend on the tensors' layouts only:
    built on a signature's first call, reused by the next (a call then fills pointers and maps)."""
    built = []

    class Recorder:
        def __init__(self, source, device, flags):
            built.append(flags)
            self.source, self.flags = source, flags

    monkeypatch.setattr(forward, "arch_of", lambda device: "sm90")
    monkeypatch.setattr(forward, "Launcher", Recorder)
    forward._signature_launch.cache_clear()
    cuda = torch.device("cuda", 0)

    def layout(shape, dtype=torch.bfloat16, offset=0):  # `offset`: the data's address modulo 16
        return tuple(shape), torch.empty(shape, dtype=dtype, device="meta").stride(), dtype, cuda, offset

    q, k = layout((2, 256, 4, 128)), layout((2, 256, 1, 128))
    padding, per_key = layout((2, 1, 1, 256), torch.bool), layout((2, 4, 1, 256))
    config = FwdConfig(128, 128, 12, 2)
    plan = forward._forward_launch((q, k, k, padding, per_key, q), True, 0.0, config)
    assert forward._forward_launch((q, k, k, padding, per_key, q), True, 0.0, config) is plan and len(built) == 1
    assert plan.name == b"dmattn_fwd_ws_kernel" and plan.grid == (8, 2)
    assert [(field, rows, line, swizzle) for field, _, _, rows, line, swizzle in plan.maps] == [
        ("q_map", 128, 128, 128), ("k_map", 128, 128, 128), ("v_map", 128, 128, 128),
        ("mask_map", 1, 128, 0), ("bias_map", 1, 256, 0)]  # one unswizzled row of keys each
    keys = shared_memory.TILES_OF_KEYS
    assert plan.shared == shared_memory.forward_shared_bytes(config, 128, "sm90", keys, keys)
    with pytest.raises(ValueError, match=r"out: the cuda backend needs rows on 16-byte boundaries, .* at offset 8"):
        forward._forward_launch((q, k, k, None, None, layout((2, 256, 4, 128), offset=8)), True, 0.0, config)
    # a mask whose data starts off a 16-byte boundary is read from global memory, not staged
    assert forward._forward_launch((q, k, k, layout((2, 1, 1, 256), torch.bool, offset=8), None, q), True,
                                   0.0, config).maps[3:] == ()
    monkeypatch.setattr(forward, "arch_of", lambda device: "sm80")
    with pytest.raises(ValueError, match=r"config: 128 rows on 12 warps .* sm90 only \(here: sm80\)"):
        forward._forward_launch((q, k, k, None, None, q), True, 0.0, config)
    forward._signature_launch.cache_clear()


@pytest.mark.parametrize("operands", ["none", "mask and bias"])
def test_a_forward_call_fills_its_addresses_into_the_signature_s_parameters(operands):
    """A call copies its signature's FwdParams (every address 0) and fills in its tensors'
    addresses: the same bytes as building the structure from the tensors."""
    q, k, v = torch.randn(2, 40, 4, 64), torch.randn(2, 48, 2, 64), torch.randn(2, 48, 2, 64)
    mask = torch.rand(2, 2, 40, 48) > 0.5 if operands != "none" else None
    bias = torch.randn(2, 1, 1, 48) if operands != "none" else None
    out, lse = torch.empty_like(q), torch.empty(2, 4, 40)
    built = params.FwdParams(params.inputs(q, k, v, mask, bias, 0.125, 0.0), out.data_ptr(), lse.data_ptr(),
                             out.stride()[:3], lse.stride())
    layouts = tuple(forward._layout(t) for t in (q, k, v, mask, bias, out))
    filled = params.FwdParams.from_buffer_copy(forward._forward_template(layouts, 0.125, 0.0, lse.stride()))
    forward._fill_addresses(filled, q, k, v, mask, bias, out, lse)
    assert bytes(filled) == bytes(built) and filled.inputs.q == q.data_ptr() and filled.lse == lse.data_ptr()


@needs_nvcc
def test_a_build_failure_names_nvcc_s_error(cubin_cache):
    with pytest.raises(build.CudaBuildError, match=r"common.cuh\(\d+\): error: identifier \"HEAD_DIM\" is undefined"):
        build.build("fwd", "sm90", ("-DELEMENT=1",))


def test_launcher_rules_and_variant_flags():
    assert rules.is_supported(FwdConfig(64, 64, 4, 2), SHAPE) is None
    # the warp-specialized forward's three consumer warpgroups build up to head dim 192
    wide = replace(SHAPE, head_dim=256)
    assert "needs at most 12 warps" in rules.is_supported(FwdConfig(192, 64, 16, 2), wide)
    assert rules.is_supported(FwdConfig(128, 64, 12, 2), wide) is None
    assert rules.is_supported(FwdConfig(192, 64, 16, 2), replace(SHAPE, head_dim=192)) is None
    assert rules.is_supported(FwdConfig(128, 64, 4, 2), SHAPE) is None  # two m16 tiles per warp
    assert "block_m=96 is not 16 or 32 x num_warps=4" in rules.is_supported(FwdConfig(96, 64, 4, 2), SHAPE)
    assert "block_m=256 is not 16 or 32 x num_warps=4" in rules.is_supported(FwdConfig(256, 64, 4, 2), SHAPE)
    assert rules.is_supported(BwdConfig(32, 64, 64, 32, 4, 2), SHAPE) is None
    assert "block_n=128 is not 16 x num_warps" in rules.is_supported(BwdConfig(32, 128, 64, 32, 4, 2), SHAPE)
    assert "block_m_dq=128 is not 16 x num_warps" in rules.is_supported(BwdConfig(32, 64, 128, 32, 4, 2), SHAPE)
    assert "block_n_dq=48 is not one of" in rules.is_supported(BwdConfig(32, 64, 64, 48, 4, 2), SHAPE)
    # Q, two 2-stage rings of K and V, rows of the head dim padded to 80 plus 8 elements, 2 bytes
    assert shared_memory.forward_shared_bytes(FwdConfig(64, 32, 4, 2), 72) == (64 + 2 * 2 * 32) * 88 * 2
    # dK/dV: K, V and 2-stage rings of Q and dO tiles plus their fp32 lse and delta; dQ: Q, dO, K and V rings
    assert shared_memory.backward_shared_bytes(BwdConfig(32, 64, 64, 16, 4, 2), 72) == {
        "dkdv": (2 * 64 + 2 * 2 * 32) * 88 * 2 + 2 * 2 * 32 * 4, "dq": (2 * 64 + 2 * 2 * 16) * 88 * 2}
    flags = variants.variant(FwdConfig(64, 32, 4, 3), 72, torch.bfloat16, None, arch="sm90", is_causal=False,
                             has_mask=True, softcap=30.0)
    assert flags == ("-DELEMENT=1", "-DBIAS_FP32=0", "-DHEAD_DIM=72", "-DNUM_WARPS=4", "-DSTAGES=3", "-DIS_CAUSAL=0",
                     "-DHAS_MASK=1", "-DHAS_BIAS=0", "-DHAS_SOFTCAP=1", "-DBLOCK_M=64", "-DBLOCK_N=32", "-DWGMMA=0")
    flags = variants.backward_variant(BwdConfig(16, 64, 64, 32, 4, 1), 64, torch.float16, torch.float16,
                                      arch="sm90", is_causal=True, has_mask=False, softcap=0.0, group=1,
                                      dbias=(False, torch.float16))
    assert flags[-7:] == ("-DHAS_DBIAS=1", "-DDBIAS_ROWS=0", "-DDBIAS_FP32=0", "-DDKV_FP32=0", "-DDKDV_BLOCK_M=16",
                          "-DDQ_BLOCK_N=32", "-DWGMMA=0")  # no m64n16 product for the 16-query tiles


WS_BWD = BwdConfig(64, 128, 64, 128, 12, 2)


def test_the_warp_specialized_backward_is_a_producer_warpgroup_beside_one_per_64_keys():
    assert rules.backward_warp_specialized(WS_BWD, 128, "sm90")
    assert rules.backward_warp_specialized(WS_BWD, 120, "sm90")  # padded to 128
    assert rules.backward_warp_specialized(BwdConfig(64, 64, 64, 64, 8, 2), 64, "sm90")  # one consumer
    assert not rules.backward_warp_specialized(WS_BWD, 64, "sm90")  # 64 columns do not split between two
    assert not rules.backward_warp_specialized(WS_BWD, 128, "sm80")
    assert not rules.backward_warp_specialized(BwdConfig(64, 128, 128, 64, 8, 2), 128, "sm90")  # flash_bwd.cu's
    assert rules.backward_kernel(WS_BWD, 128, "sm90") == "bwd_ws"
    assert rules.backward_kernel(WS_BWD, 128, "sm80") == "bwd"
    shape = AttentionShape(1, 16, 16, 2, 1, 128)
    assert rules.is_supported(WS_BWD, shape) is None
    assert rules.is_supported(WS_BWD, replace(shape, head_dim=96)) is None  # on the tiles of 128
    assert "head_dim=136 is over 128" in rules.is_supported(WS_BWD, replace(shape, head_dim=136))
    assert "tiles of 64 columns, which do not split into 64-column blocks among block_n / 64 = 2 consumer" in \
        rules.is_supported(WS_BWD, replace(shape, head_dim=64))
    assert "block_m=32 is not 64" in rules.is_supported(BwdConfig(32, 128, 64, 128, 12, 2), shape)
    assert "is not block_m x block_n = 64x128" in rules.is_supported(BwdConfig(64, 128, 64, 64, 12, 2), shape)
    assert "sm90 only (here: sm120)" in rules.arch_reason(WS_BWD, 128, "sm120")
    assert rules.arch_reason(WS_BWD, 128, "sm90") is None
    # K and V, 2-stage rings of Q and dO, two dS tiles, two fp32 dQ shares, lse and delta, the swizzle slack
    assert shared_memory.backward_shared_bytes(WS_BWD, 128, "sm90") == {
        "ws": (2 * 128 + 2 * 2 * 64) * 128 * 2 + 1024 + 2 * 64 * 128 * 2 + 2 * 64 * 128 * 4 + 2 * 2 * 64 * 4}
    assert shared_memory.shared_bytes(WS_BWD, 128, "sm90") <= shared_memory.SM90_SHARED_BYTES
    flags = variants.backward_variant(WS_BWD, 128, torch.bfloat16, None, arch="sm90", is_causal=True, has_mask=False,
                                      softcap=0.0, group=4, dbias=None)
    assert flags[-11:] == ("-DHAS_DBIAS=0", "-DDBIAS_ROWS=0", "-DDBIAS_FP32=1", "-DDKV_FP32=1", "-DBLOCK_M=64",
                           "-DBLOCK_N=128", "-DWGMMA=1", "-DSCORE_STAGES=0", "-DMASK_TILES=0", "-DBIAS_TILES=0",
                           "-DDBIAS_TMA=0")


def _staging_flags(flags: tuple[str, ...]) -> dict[str, int]:
    names = ("SCORE_STAGES", "MASK_TILES", "BIAS_TILES", "DBIAS_TMA")
    return {flag[2:].split("=")[0]: int(flag.split("=")[1]) for flag in flags if flag[2:].split("=")[0] in names}


def test_the_warp_specialized_backward_stages_mask_and_bias_where_its_ring_fits():
    rows, keys, none = shared_memory.TILES_OF_ROWS, shared_memory.TILES_OF_KEYS, shared_memory.NOT_STAGED
    bf16 = torch.bfloat16

    def flags(mask_tiles, bias_tiles, bias_dtype=bf16, dbias=(True, bf16), softcap=0.0, config=WS_BWD, head_dim=128):
        return _staging_flags(variants.backward_variant(
            config, head_dim, bf16, bias_dtype, arch="sm90", is_causal=True, has_mask=mask_tiles is not None,
            softcap=softcap, group=1, dbias=dbias, mask_tiles=none if mask_tiles is None else mask_tiles,
            bias_tiles=bias_tiles))

    dense = shared_memory.backward_shared_bytes(WS_BWD, 128, "sm90")["ws"]
    # W1: a mask and a bf16 bias of rows, 8 + 16 KiB a slot: one slot, in the room of one fp32 dQ share
    assert flags(rows, rows) == dict(SCORE_STAGES=1, MASK_TILES=1, BIAS_TILES=1, DBIAS_TMA=1)
    assert (shared_memory.backward_shared_bytes(WS_BWD, 128, "sm90", rows, rows)["ws"]
            == dense - 64 * 128 * 4 + 64 * 128 * 3)
    # W2: a mask of rows (8 KiB) and a per-key bias (registers): two slots
    assert flags(rows, keys, dbias=(False, torch.float32)) == dict(SCORE_STAGES=2, MASK_TILES=1, BIAS_TILES=2,
                                                                   DBIAS_TMA=0)
    # an fp32 bias is read from global memory; a padding mask goes to registers and needs no ring
    assert flags(rows, rows, torch.float32, (True, torch.float32)) == dict(SCORE_STAGES=2, MASK_TILES=1,
                                                                           BIAS_TILES=0, DBIAS_TMA=0)
    assert flags(keys, None, None, None) == dict(SCORE_STAGES=0, MASK_TILES=2, BIAS_TILES=0, DBIAS_TMA=0)
    # dBias by TMA only where dS is dBias (no softcap) and the target is rows of the input dtype
    assert flags(rows, rows, softcap=30.0)["DBIAS_TMA"] == 0
    assert flags(rows, rows, dbias=(True, torch.float32))["DBIAS_TMA"] == 0
    assert flags(rows, rows, dbias=(False, bf16))["DBIAS_TMA"] == 0
    # no slot beside 4-stage rings: tiles of rows from global memory, a row of keys still in registers
    deep = BwdConfig(64, 128, 64, 128, 12, 4)
    assert flags(rows, keys, config=deep) == dict(SCORE_STAGES=0, MASK_TILES=0, BIAS_TILES=2, DBIAS_TMA=1)
    for mask_tiles, bias_tiles in ((rows, rows), (rows, keys), (none, rows)):
        assert shared_memory.backward_shared_bytes(WS_BWD, 128, "sm90", mask_tiles, bias_tiles)["ws"] \
            + shared_memory.WS_STATIC_BYTES <= shared_memory.SM90_SHARED_BYTES


def test_the_warp_specialized_backward_runs_head_dims_up_to_128_on_tiles_of_64_or_128():
    """As the forward (above): at D80 and D96 the backward multiplies the 128 columns of D128's tiles
    (Triton's too are powers of two), TMA filling those past the head dim with zeros, which add
    nothing to S, dP, dK, dV or the dQ shares. Its variant alone adds SWIZZLE_PADDED, and its
    shared memory, dQ sums and dQ cast are the wider tiles'."""
    one_consumer = BwdConfig(64, 64, 64, 64, 8, 2)

    def flags(config, head_dim):
        return variants.backward_variant(config, head_dim, torch.bfloat16, torch.bfloat16, arch="sm90",
                                         is_causal=False, has_mask=True, softcap=0.0, group=1, dbias=(True, torch.bfloat16))

    for config, head_dims in ((WS_BWD, (72, 80, 96, 112)), (one_consumer, (8, 32, 40, 48))):
        for head_dim in head_dims:
            wider = rules.swizzled_head_dim(head_dim)
            assert rules.backward_warp_specialized(config, head_dim, "sm90")
            assert rules.tile_columns(config, head_dim, "sm90") == wider
            assert "-DSWIZZLE_PADDED=1" in flags(config, head_dim)
            assert shared_memory.backward_shared_bytes(config, head_dim, "sm90") == \
                shared_memory.backward_shared_bytes(config, wider, "sm90")
    for config, head_dim in ((WS_BWD, 120), (WS_BWD, 128), (one_consumer, 64)):  # whole lines already
        assert not any("SWIZZLE_PADDED" in flag for flag in flags(config, head_dim))
    # 64 keys split any width of one or two lines among their one consumer; 128 keys need two
    assert rules.backward_warp_specialized(one_consumer, 96, "sm90")
    assert not rules.backward_warp_specialized(WS_BWD, 40, "sm90")
    # the mma.sync backward keeps the 16-column padding
    plain = BwdConfig(64, 64, 64, 64, 4, 2)
    assert rules.tile_columns(plain, 96, "sm90") == 96 and not rules.backward_warp_specialized(plain, 96, "sm90")


@needs_nvcc
def test_the_warp_specialized_backward_at_d96_builds_as_d128_does(cubin_cache):
    """nvcc builds the D96 backward variants (a mask and bias of rows staged, dBias by TMA; and a
    KV group) with the D128 ones' registers and stack and no local memory, and one consumer's D32
    variant as its D64 one."""
    import triton

    def usage(head_dim, config, **features):
        flags = variants.backward_variant(config, head_dim, torch.bfloat16, torch.bfloat16, arch="sm90",
                                          is_causal=True, has_mask=True, softcap=0.0, **features)
        cubin = build.build("bwd_ws", "sm90", flags)
        cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        text = subprocess.run([str(cuobjdump), "-res-usage", str(cubin)], capture_output=True, text=True,
                              check=True).stdout
        found = re.search(r"Function dmattn_bwd_ws_kernel:\s*REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", text)
        return found.groups()

    for config, features, narrow, wide in (
            (WS_BWD, dict(group=1, dbias=(True, torch.bfloat16)), 96, 128),
            (BwdConfig(64, 128, 64, 128, 12, 2, kv_group=1), dict(group=4, dbias=(False, torch.float32)), 96, 128),
            (BwdConfig(64, 64, 64, 64, 8, 2), dict(group=1, dbias=(True, torch.bfloat16)), 32, 64)):
        narrow_usage = usage(narrow, config, **features)
        assert narrow_usage == usage(wide, config, **features)
        assert narrow_usage[2] == "0"  # no local memory (spills)


TRANSPOSED_BWD = BwdConfig(64, 96, 64, 96, 12, 1)


def test_head_dims_129_to_192_run_the_transposed_backward_and_only_there():
    """block_n 64 or 96 on 12 warps names the warp-specialized backward's transposed layout, on
    tiles of 192 columns (D136-D184 padded, TMA filling the rest with zeros); elsewhere it is
    refused with a reason, as are a KV group, a window and packed sequences, and the regular
    shapes stop at 128. Its variant stages nothing and stores dBias itself."""
    def shape(head_dim):
        return AttentionShape(2, 128, 128, 4, 1, head_dim, True, True, True, True)

    for config in (TRANSPOSED_BWD, BwdConfig(64, 64, 64, 64, 12, 2)):
        for head_dim in (136, 160, 184, 192):
            assert rules.is_supported(config, shape(head_dim)) is None
            assert rules.transposed_backward(config, head_dim, "sm90")
            assert rules.backward_warp_specialized(config, head_dim, "sm90")
            assert rules.tile_columns(config, head_dim, "sm90") == 192
        for head_dim in (64, 128, 200, 256):
            assert "runs head dims 136-192" in rules.is_supported(config, shape(head_dim))
            assert not rules.backward_warp_specialized(config, head_dim, "sm90")
        assert not rules.transposed_backward(config, 192, "sm80")
        assert "sm90 only" in rules.arch_reason(config, 192, "sm80")
        for feature in ("a sliding window", "a packed call"):
            assert "transposed" in variants.backward_feature_reason(config, 192, "sm90", feature)
    assert "kv_group=1 is not a knob" in rules.is_supported(replace(TRANSPOSED_BWD, kv_group=1), shape(192))
    assert "block_n in (64, 96) on 12 warps" in rules.is_supported(WS_BWD, shape(192))
    flags = variants.backward_variant(TRANSPOSED_BWD, 160, torch.bfloat16, torch.bfloat16, arch="sm90",
                                      is_causal=True, has_mask=True, softcap=0.0, group=4,
                                      dbias=(True, torch.bfloat16))
    for flag in ("-DDKV_TRANSPOSED=1", "-DSWIZZLE_PADDED=1", "-DSCORE_STAGES=0", "-DMASK_TILES=0", "-DBIAS_TILES=0",
                 "-DDBIAS_TMA=0", "-DDKV_FP32=1"):
        assert flag in flags
    assert variants.backward_staging(TRANSPOSED_BWD, 192, True, torch.bfloat16, shared_memory.TILES_OF_ROWS,
                                     shared_memory.TILES_OF_ROWS) == (0, 0, 0)
    assert not any("DKV_TRANSPOSED" in flag for flag in variants.backward_variant(
        WS_BWD, 128, torch.bfloat16, None, arch="sm90", is_causal=True, has_mask=False, softcap=0.0, group=1,
        dbias=None))


def test_the_transposed_backward_fits_hopper_with_one_ring_slot_of_96_keys():
    """Its shared memory (flash_bwd_ws.cu's layout: K and V, the Q and dO ring, two dS^T tiles and
    the P^T tile, one fp32 dQ share, lse and delta) fits an SM90 block for 96 keys with one ring
    slot and for 64 keys with two, not for 96 keys with two."""
    from dmattn_bench.hardware import ARCH_LIMITS

    limit = ARCH_LIMITS["sm90"].shared_memory_per_block
    tiles = (2 * 96 + 2 * 64) * 192 * 2 + 3 * 64 * 96 * 2
    assert shared_memory.backward_shared_bytes(TRANSPOSED_BWD, 192, "sm90")["ws"] == (
        tiles + 64 * 192 * 4 + 2 * 64 * 4 + shared_memory.SWIZZLE_SLACK)
    assert shared_memory.backward_shared_bytes(TRANSPOSED_BWD, 192, "sm90")["ws"] <= limit
    assert shared_memory.backward_shared_bytes(BwdConfig(64, 64, 64, 64, 12, 2), 192, "sm90")["ws"] <= limit
    assert shared_memory.backward_shared_bytes(replace(TRANSPOSED_BWD, num_stages=2), 192, "sm90")["ws"] > limit


@needs_nvcc
def test_the_transposed_backward_keeps_its_accumulators_in_registers(cubin_cache):
    """nvcc builds the transposed layout's variants without a mask or bias (96 and 64 keys, and 96
    under GQA's fp32 shares) with at most 24 bytes of stack and no local memory: two consumers keep
    dK^T and dV^T of 48 keys x 192 columns (144 registers) in the 240 each is given. (Its builds
    that read a mask or bias from global memory at every position spill more, 384-664 bytes: the
    tuner times those against the Triton backward.)"""
    import triton

    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    for config, group, bias_dtype, dbias in ((TRANSPOSED_BWD, 1, None, None),
                                             (BwdConfig(64, 64, 64, 64, 12, 2), 1, None, None),
                                             (TRANSPOSED_BWD, 4, None, None)):
        flags = variants.backward_variant(config, 192, torch.bfloat16, bias_dtype, arch="sm90", is_causal=True,
                                          has_mask=False, softcap=0.0, group=group, dbias=dbias)
        text = subprocess.run([str(cuobjdump), "-res-usage", str(build.build("bwd_ws", "sm90", flags))],
                              capture_output=True, text=True, check=True).stdout
        found = re.search(r"Function dmattn_bwd_ws_kernel:\s*REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", text)
        assert found and int(found.group(2)) <= 24 and found.group(3) == "0", (config, group, text)


def test_the_warp_specialized_backward_zeroes_the_dq_sums_of_tiles_no_key_block_visits():
    """Block n walks query tiles from (n x block_n - (Lk - Lq)) // 64 on (flash_bwd_ws.cu's m_begin):
    the tiles before block 0's start are visited by none, and exactly those hold only rows that
    see no key (causal: row + Lk - Lq < 0)."""
    for seqlen_q, seqlen_k in ((203, 113), (4097, 1), (40, 17), (113, 203), (128, 64), (127, 64)):
        m_begin = max(0, seqlen_q - seqlen_k) // 64
        tiles = -(-seqlen_q // 64)
        dead_tiles = sum(all(row + seqlen_k - seqlen_q < 0 for row in range(m * 64, min(seqlen_q, m * 64 + 64)))
                         for m in range(tiles))
        assert backward.unvisited_query_tiles(seqlen_q, seqlen_k, 64, True) == m_begin == dead_tiles
        assert backward.unvisited_query_tiles(seqlen_q, seqlen_k, 64, False) == 0


def test_an_expanded_gradient_is_a_broadcast_dim_but_a_size_1_dim_is_not():
    assert backward.has_broadcast_dim(torch.zeros(2, 1, 4, 8).expand(2, 16, 4, 8))  # d(out.mean(1))
    assert not backward.has_broadcast_dim(torch.zeros(2, 16, 4, 8))
    assert not backward.has_broadcast_dim(torch.zeros(2, 1, 4, 8).expand(2, 1, 4, 8))


def test_a_warp_specialized_backward_config_off_sm90_is_refused_before_any_launch(monkeypatch):
    """Its shape would otherwise build flash_bwd.cu with 12 warps, 192 keys, in a CTA sized for 128."""
    monkeypatch.setattr(backward, "check_query", lambda q: None)
    monkeypatch.setattr(backward, "arch_of", lambda device: "sm80")
    q = torch.zeros(1, 64, 2, 128, dtype=torch.bfloat16)
    lse = torch.zeros(1, 2, 64)
    with pytest.raises(ValueError, match=r"config: 128 keys on 12 warps is the warp-specialized backward, which "
                                         r"runs on sm90 only \(here: sm80\)"):
        backward.attention_backward(q, q, q, q, q, lse, None, None, is_causal=True, softmax_scale=0.1, softcap=0.0,
                                    config=WS_BWD, dq=q, dk=q, dv=q, dbias=None)


def test_the_delta_kernels_cover_their_rows_with_a_lane_per_16_bytes():
    # 16 lanes a 128-column row, so a warp holds two rows, four times over
    assert backward.delta_rows_per_block(128, 12) == 12 * 2 * 4
    assert backward.delta_rows_per_block(80, 4) == 4 * 2 * 4  # 10 chunks, 16 lanes
    assert backward.delta_rows_per_block(256, 4) == 4 * 1 * 4
    assert backward.delta_rows_per_block(16, 4) == 4 * 16 * 4
    # the kernel's columns (common.cuh: BLOCK_D): D32 runs on 64 in the warp-specialized backward
    ws, plain = BwdConfig(64, 64, 64, 64, 8, 2), BwdConfig(64, 64, 64, 64, 4, 2)
    assert rules.tile_columns(ws, 32, "sm90") == 64 and rules.tile_columns(plain, 32, "sm90") == 32
    assert backward.delta_rows_per_block(64, 8) == 8 * 4 * 4 != backward.delta_rows_per_block(32, 8)


def test_the_cuda_backend_is_registered_and_refuses_cpu_tensors():
    backend = get_backend("cuda")
    q = torch.zeros(1, 16, 2, 64, dtype=torch.float16)
    out, lse = torch.empty_like(q), torch.empty(1, 2, 16)
    with pytest.raises(ValueError, match="query: the cuda backend runs on CUDA tensors"):
        backend.forward(q, q, q, None, None, is_causal=False, softmax_scale=0.125, softcap=0.0,
                        config=FwdConfig(64, 64, 4, 2), out=out, lse=lse)
    # one cubin per launch, keyed by what becomes its -D list
    shape = AttentionShape(1, 16, 16, 2, 1, 64, has_bias=True, bias_requires_grad=True)
    assert len(backend.kernels("bwd", BwdConfig(32, 64, 64, 32, 4, 2), shape)) == 1
    assert backend.kernels("fwd", FwdConfig(64, 64, 4, 2), shape) != backend.kernels("fwd", FwdConfig(64, 32, 4, 2), shape)


def test_cuda_defaults_fit_the_smallest_shared_memory_without_a_gpu():
    """Without a GPU to ask, the defaults are those that fit 99 KiB (SM86/SM120) at each class's
    largest head dim, and they pass the launcher's structural rules."""
    for low, high, fwd, bwd in default_entries("cpu", "cuda"):
        shape = AttentionShape(1, 16, 16, 2, 1, high)
        assert rules.is_supported(fwd, shape) is None and rules.is_supported(bwd, shape) is None
        assert max(shared_memory.shared_bytes(config, high) for config in (fwd, bwd)) <= 101376, (low, high)


def test_the_sm90_defaults_run_wgmma_where_it_pays_and_fit_hopper():
    from dmattn_bench.hardware import ARCH_LIMITS
    from dmattn_bench.tiles import CUDA_SM90_DEFAULTS

    limit = ARCH_LIMITS["sm90"].shared_memory_per_block
    for high, fwds, bwds in CUDA_SM90_DEFAULTS:
        shape = AttentionShape(1, 16, 16, 2, 1, high)
        for config in fwds + bwds:
            assert rules.is_supported(config, shape) is None
        assert shared_memory.shared_bytes(fwds[0], high, "sm90") <= limit
        assert shared_memory.shared_bytes(bwds[0], high, "sm90") <= limit
        assert rules.uses_wgmma(fwds[0], high, "sm90") or rules.warp_specialized(fwds[0], high, "sm90")
        # wgmma (D136-D192 in the warp-specialized backward's transposed layout) up to 192
        assert (rules.uses_wgmma(bwds[0], high, "sm90")
                or rules.backward_warp_specialized(bwds[0], high, "sm90")) == (high <= rules.TRANSPOSED_BWD_COLUMNS)
    # a class's defaults run every head dim in it (the warp-specialized kernels D72-D128 on D128's tiles)
    low = 8
    for high, fwds, bwds in CUDA_SM90_DEFAULTS:
        for head_dim in range(low, high + 1, 8):
            shape = AttentionShape(1, 16, 16, 2, 1, head_dim)
            for config in (fwds[0], bwds[0]):
                assert rules.is_supported(config, shape) is None and rules.arch_reason(config, head_dim, "sm90") is None
        low = high + 8


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what a machine without a GPU reports")
def test_info_says_which_backends_can_run_here():
    import json

    from click.testing import CliRunner

    from dmattn_bench.cli.info import info

    result = CliRunner().invoke(info, ["--format", "json"])
    assert result.exit_code == 0, result.output
    backends = json.loads(result.stdout)["backends"]
    assert backends == {"triton": "interpreter (no GPU)", "cuda": "unavailable: no CUDA GPU", "reference": "available"}


def test_a_grid_over_cuda_s_y_limit_is_a_clear_error():
    """Query blocks sit on grid y (the forward's longest causal blocks start first), so a query
    longer than 65535 blocks is refused before the driver sees the launch."""
    launcher = driver.Launcher.__new__(driver.Launcher)  # no cubin needed: the check comes first
    with pytest.raises(ValueError, match=r"dmattn_fwd_kernel: needs 65536 CTAs on grid y, over CUDA's limit of 65535"):
        launcher(b"dmattn_fwd_kernel", (32, 65536), 4, 0, None)


def test_the_forward_runs_wgmma_only_where_sm90_and_the_tile_allow_it():
    assert rules.uses_wgmma(FwdConfig(128, 128, 8, 2), 128, "sm90")
    assert rules.uses_wgmma(FwdConfig(64, 64, 4, 2), 120, "sm90")  # padded to 128: zero lanes past 120
    assert not rules.uses_wgmma(FwdConfig(128, 128, 8, 2), 128, "sm80")  # no wgmma before Hopper
    assert not rules.uses_wgmma(FwdConfig(128, 128, 8, 2), 128, "sm120")  # nor on consumer Blackwell
    assert not rules.uses_wgmma(FwdConfig(128, 64, 4, 2), 128, "sm90")  # 32 rows per warp
    assert not rules.uses_wgmma(FwdConfig(64, 64, 2, 2), 128, "sm90")  # half a warpgroup
    assert not rules.uses_wgmma(FwdConfig(128, 16, 8, 2), 128, "sm90")  # no m64n16 product
    assert not rules.uses_wgmma(FwdConfig(128, 64, 8, 2), 96, "sm90")  # 96 is not whole 128-byte lines
    flags = variants.variant(FwdConfig(128, 64, 8, 2), 128, torch.bfloat16, None, arch="sm90", is_causal=True,
                             has_mask=False, softcap=0.0)
    assert flags[-1] == "-DWGMMA=1"
    assert rules.uses_wgmma(BwdConfig(64, 128, 128, 64, 8, 2), 128, "sm90")
    assert not rules.uses_wgmma(BwdConfig(16, 64, 64, 32, 4, 1), 128, "sm90")  # 16-query tiles
    assert not rules.uses_wgmma(BwdConfig(64, 32, 32, 64, 2, 2), 128, "sm90")  # half a warpgroup
    assert not rules.uses_wgmma(BwdConfig(32, 64, 64, 32, 4, 1), 256, "sm90")  # dK/dV accumulators would spill
    assert rules.uses_wgmma(FwdConfig(128, 64, 8, 2), 256, "sm90")  # the forward holds one accumulator


def test_wgmma_tiles_are_unpadded_and_aligned_in_shared_memory():
    fwd = FwdConfig(128, 128, 8, 3)
    # Q and two 3-stage rings of 128 x 128 tiles, 2 bytes, no row pad, 1 KiB of alignment slack
    assert shared_memory.forward_shared_bytes(fwd, 128, "sm90") == (128 + 2 * 3 * 128) * 128 * 2 + 1024 == 230400
    assert shared_memory.forward_shared_bytes(fwd, 128, "sm80") == (128 + 2 * 3 * 128) * 136 * 2
    # without an arch the padded layout bounds both (at least 128 rows)
    assert shared_memory.shared_bytes(fwd, 128) >= max(shared_memory.shared_bytes(fwd, 128, arch)
                                                       for arch in ("sm80", "sm90"))
    bwd = BwdConfig(64, 128, 128, 64, 8, 2)
    assert shared_memory.backward_shared_bytes(bwd, 128, "sm90") == {
        "dkdv": (2 * 128 + 2 * 2 * 64) * 128 * 2 + 1024 + 2 * 2 * 64 * 4, "dq": (2 * 128 + 2 * 2 * 64) * 128 * 2 + 1024}
    assert shared_memory.shared_bytes(bwd, 128) >= shared_memory.shared_bytes(bwd, 128, "sm90")



@needs_nvcc
def test_a_wheel_install_builds_a_cuda_kernel(installed_wheel, tmp_path):
    """Installed from a wheel, the cuda backend finds every source its kernels include (the .cuh
    headers are package data) and nvcc builds one of them."""
    import sys

    site, _ = installed_wheel
    probe = ("import torch; from dmattn_bench.space import FwdConfig; from dmattn_kernels.cuda import build, variant; "
             "flags = variant(FwdConfig(64, 64, 4, 2), 72, torch.float16, None, arch='sm80', is_causal=True, "
             "has_mask=True, softcap=0.0); print(build.KERNEL_DIR); print(build.build('fwd', 'sm80', flags).stat().st_size)")
    done = subprocess.run([sys.executable, "-I", "-c", f"import sys; sys.path.insert(0, {str(site)!r}); {probe}"],
                          capture_output=True, text=True, cwd=tmp_path,
                          env={**os.environ, "DMATTN_BENCH_CACHE": str(tmp_path / "cache")})
    assert done.returncode == 0, done.stderr.strip().splitlines()[-1:]
    kernel_dir, cubin_bytes = done.stdout.splitlines()
    assert kernel_dir == str(site / "dmattn_kernels" / "cuda")
    assert int(cubin_bytes) > 0


def test_the_launch_order_sections_hold_the_head_slices_whose_operands_fit_l2():
    """common.cuh's section_order: as many head slices at once as re-read L2_SECTION_BYTES."""
    kv_bytes = 2 * 4096 * 128 * 2  # K and V of one head, L4096 D128 bf16: 2 MiB
    assert forward.section_slices(32, kv_bytes) == forward.L2_SECTION_BYTES // kv_bytes == 16
    assert forward.section_slices(32, kv_bytes, sharing=4) == 32  # a GQA group's heads share theirs
    assert forward.section_slices(32, forward.L2_SECTION_BYTES * 2) == 1  # at least one slice
    assert forward.section_slices(6, kv_bytes) == 6  # at most every slice
    # the section count sits after the parameters both kernels read (padding keeps the sizes)
    assert params.WsParams.section_slices.offset == 5 * 128 + ctypes.sizeof(params.FwdParams)
    assert params.BwdWsParams.section_slices.offset == 7 * 128 + ctypes.sizeof(params.BwdParams) + 16


def test_a_persistent_forward_schedule_gives_every_item_once_in_launch_order_and_balances_the_ctas():
    """forward.persistent_schedule: W3's causal grid (32 head slices x 32 query blocks of 128 rows,
    4096 keys) over 132 CTAs."""
    config = FwdConfig(128, 128, 12, 2, overlap=1, persistent=1)
    tiles = [forward._key_tiles(block, config, 4096, 4096, True) for block in range(32)]
    assert tiles[0] == 1 and tiles[31] == 32  # a causal block walks the key tiles up to its diagonal
    schedule = forward.persistent_schedule((32, 32), 16, tiles, 132)
    offsets, items = schedule[:133], schedule[133:]
    assert offsets[0] == 0 and offsets[-1] == len(items) == 32 * 32
    assert sorted(items) == list(range(32 * 32))
    lists = [items[offsets[c]:offsets[c + 1]] for c in range(132)]
    assert all(cta_items == sorted(cta_items) for cta_items in lists)  # each CTA walks the launch order

    def cost(index):  # common.cuh's section_order: the item's query block, longest rows first
        block = index % (16 * 32) // 16
        return tiles[31 - block] + forward.ITEM_TILES

    loads = [sum(cost(i) for i in cta_items) for cta_items in lists]
    mean = sum(loads) / 132
    assert max(loads) <= mean + max(tiles) + forward.ITEM_TILES  # no CTA waits on more than one item's worth


# The warp-specialized forward's -D list at 128x128 w12 s2, D128, causal, bf16 mask and bias rows
# staged: the variant as it was before the kernel knobs (a knob off must leave it so, for the
# tables' per-entry code stamps and the cubin cache).
WS_FLAGS = ("-DELEMENT=1", "-DBIAS_FP32=0", "-DHEAD_DIM=128", "-DNUM_WARPS=12", "-DSTAGES=2", "-DIS_CAUSAL=1",
            "-DHAS_MASK=1", "-DHAS_BIAS=1", "-DHAS_SOFTCAP=0", "-DBLOCK_M=128", "-DBLOCK_N=128", "-DWGMMA=1",
            "-DSCORE_STAGES=1", "-DMASK_TILES=1", "-DBIAS_TILES=1")


def _ws_flags(config: FwdConfig, arch: str = "sm90") -> tuple[str, ...]:
    return variants.variant(config, 128, torch.bfloat16, torch.bfloat16, arch=arch, is_causal=True, has_mask=True,
                            softcap=0.0)


def test_a_kernel_knob_off_adds_no_define_and_a_knob_on_adds_its_own():
    ws = FwdConfig(128, 128, 12, 2)
    assert _ws_flags(ws) == _ws_flags(replace(ws, overlap=0, persistent=0)) == WS_FLAGS
    assert _ws_flags(replace(ws, overlap=1)) == (*WS_FLAGS, "-DFWD_OVERLAP=1")
    assert _ws_flags(replace(ws, overlap=1, persistent=1)) == (*WS_FLAGS, "-DFWD_OVERLAP=1", "-DFWD_PERSISTENT=1")
    # out's staged rows leave a full mask and bias no slot: they are read from global memory
    unstaged = tuple(flag.replace("=1", "=0") if "TILES" in flag or "SCORE_STAGES" in flag else flag for flag in WS_FLAGS)
    assert _ws_flags(replace(ws, overlap=1, tma_store=1)) == (*unstaged, "-DFWD_OVERLAP=1", "-DFWD_TMA_STORE=1")
    assert not any("FWD_" in flag for flag in _ws_flags(FwdConfig(128, 64, 8, 2)))  # flash_fwd.cu has no knobs
    with pytest.raises(ValueError, match=r"overlap=1: a knob of the warp-specialized forward only"):
        _ws_flags(FwdConfig(128, 64, 8, 2, overlap=1))
    with pytest.raises(ValueError, match=r"knobs of the warp-specialized forward, on sm90 only \(here: sm80\)"):
        _ws_flags(replace(ws, overlap=1), arch="sm80")


def test_the_kernel_knobs_are_0_or_1_on_the_warp_specialized_forward_and_persistent_needs_overlap():
    shape = AttentionShape(1, 16, 16, 2, 1, 128)
    ws = FwdConfig(128, 128, 12, 2)
    assert rules.is_supported(replace(ws, overlap=1), shape) is None
    assert rules.is_supported(replace(ws, overlap=1, persistent=1), shape) is None
    with pytest.raises(ValueError, match=r"FwdConfig.overlap: got 2, expected 0 \(off\) or 1 \(on\)"):
        replace(ws, overlap=2)  # a config is built checked (`space._check_fields`)
    assert rules.is_supported(replace(ws, persistent=1), shape) == (
        "persistent=1 needs overlap=1 (the persistent launch walks the overlapped forward's work items)")
    assert rules.is_supported(replace(ws, overlap=1, persistent=1, tma_store=1), shape) is None
    assert rules.is_supported(replace(ws, tma_store=1), shape) == (
        "tma_store=1 needs overlap=1 (out is stored by TMA in the overlapped forward's epilogue)")
    assert rules.is_supported(FwdConfig(128, 64, 8, 2, overlap=1, persistent=1), shape) == (
        "overlap=1 and persistent=1: a knob of the warp-specialized forward only (block_m in (64, 128, 192) on "
        "block_m / 16 + 4 warps), not of 128 rows on 8 warps")
    # the warp-specialized forward's own rules still hold with a knob on
    assert "at most 12 warps" in rules.is_supported(FwdConfig(192, 64, 16, 2, overlap=1), replace(shape, head_dim=256))
    assert "sm90 only (here: sm80)" in rules.arch_reason(replace(ws, overlap=1), 128, "sm80")
    triton = get_backend("triton").is_supported
    assert triton(FwdConfig(64, 64, 4, 2), shape) is None
    for knob in ("overlap", "tma_store"):
        assert triton(replace(FwdConfig(64, 64, 4, 2), **{knob: 1}), shape) == (
            "overlap, persistent and tma_store are knobs of the CUDA warp-specialized forward; the Triton forward "
            "has none (leave them 0)")


def test_the_warp_specialized_space_prunes_knobs_without_overlap_before_compiling():
    """configs/space/cuda-fwd-ws.yaml crosses the three knobs; persistent or tma_store without
    overlap is ruled out by its structure (is_supported's reason); the other knob sets are
    candidates wherever their tiles are, tma_store only where out's rows also fit in shared memory."""
    from itertools import product

    from dmattn_bench.hardware import parse_arch
    from dmattn_bench.tuning.prune import load_space, precheck

    def verdict(config):
        return precheck("fwd", config, parse_arch("sm90"), 128, "bf16", "cuda")

    configs = load_space(SPACE_DIR / "cuda-fwd-ws.yaml", "cuda", "fwd", "sm90")
    assert {(c.overlap, c.persistent, c.tma_store) for c in configs} == set(product((0, 1), repeat=3))
    for config in configs:
        tiles_alone = verdict(replace(config, overlap=0, persistent=0, tma_store=0))
        pruned = verdict(config)
        if not config.overlap and (config.persistent or config.tma_store):
            assert (pruned.status, pruned.check) == ("unsupported", "structure")
            knob = "persistent" if config.persistent else "tma_store"
            assert pruned.reason.startswith(f"{knob}=1 needs overlap=1")
        elif config.tma_store and tiles_alone is None and pruned is not None:
            assert pruned.check == "shared", config
        else:
            assert (pruned is None) == (tiles_alone is None), config
    candidates = [c for c in configs if verdict(c) is None]
    tiles = sum(1 for c in candidates if not c.overlap and not c.persistent and not c.tma_store)
    assert sum(1 for c in candidates if not c.tma_store) == 3 * tiles
    assert 0 < sum(c.tma_store for c in candidates) < 2 * tiles  # some tiles leave no room for out's rows


@pytest.fixture
def sm90_forward_plans(monkeypatch):
    """Forward plans made as on an SM90 GPU of 3 SMs, without one: the flags each launcher would
    build with (`built`), and the layouts of a causal B2 L300 D128 call's q (4 heads) and k (1)."""
    built = []
    monkeypatch.setattr(forward, "arch_of", lambda device: "sm90")
    monkeypatch.setattr(forward, "Launcher", lambda source, device, flags: built.append(flags))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: type("SM", (), {"multi_processor_count": 3}))
    forward._signature_launch.cache_clear()
    forward._persistent_launch.cache_clear()
    cpu = torch.device("cpu")
    q = ((2, 300, 4, 128), torch.empty(2, 300, 4, 128, device="meta").stride(), torch.bfloat16, cpu, 0)
    k = ((2, 300, 1, 128), torch.empty(2, 300, 1, 128, device="meta").stride(), torch.bfloat16, cpu, 0)
    yield built, q, k
    forward._signature_launch.cache_clear()
    forward._persistent_launch.cache_clear()


def test_a_persistent_forward_plans_its_items_and_launches_a_cta_per_sm_over_their_schedule(sm90_forward_plans):
    """The knobs travel in the plan: overlap alone launches the grid of items with WsParams,
    persistent a CTA per SM (at most one per item) with the schedule in PersistentWsParams."""
    built, q, k = sm90_forward_plans
    cpu = torch.device("cpu")
    forward_params = params.FwdParams()
    overlap = forward._forward_launch((q, k, k, None, None, q), True, 0.0, FwdConfig(128, 128, 12, 2, overlap=1))
    assert overlap.tiles == () and overlap.launch_grid(cpu) == ((8, 3), None) and built[-1][-1] == "-DFWD_OVERLAP=1"
    assert type(overlap.ws_params(forward_params, None)) is params.WsParams
    plan = forward._forward_launch((q, k, k, None, None, q), True, 0.0, FwdConfig(128, 128, 12, 2, 1, 1))
    assert built[-1][-2:] == ("-DFWD_OVERLAP=1", "-DFWD_PERSISTENT=1")
    assert plan.grid == plan.items == (8, 3) and plan.tiles == (1, 2, 3)  # 300 causal rows: 128, 256, 300 keys
    grid, schedule = plan.launch_grid(cpu)
    assert grid == (3, 1)
    assert schedule.tolist() == forward.persistent_schedule((8, 3), plan.section_slices, [1, 2, 3], 3)
    block = plan.ws_params(forward_params, schedule)
    assert type(block) is params.PersistentWsParams
    assert (block.item_columns, block.item_rows, block.schedule) == (8, 3, schedule.data_ptr())


@needs_nvcc
def test_the_forward_s_knobs_build_for_sm90_and_take_their_parameter_blocks(cubin_cache):
    """Overlap alone keeps WsParams; persistent adds the work items and the schedule after the
    section count (PersistentWsParams), still one 1024-byte block."""
    config = FwdConfig(128, 128, 12, 2, overlap=1)
    assert _parameter_sizes(build.build("fwd_ws", "sm90", _ws_flags(config))) == [ctypes.sizeof(params.WsParams)]
    flags = _ws_flags(replace(config, persistent=1))
    assert _parameter_sizes(build.build("fwd_ws", "sm90", flags)) == [ctypes.sizeof(params.PersistentWsParams)]
    assert ctypes.sizeof(params.PersistentWsParams) == 1024
    persistent, base = params.PersistentWsParams, params.WsParams.section_slices.offset
    assert persistent.section_slices.offset == base and persistent.forward.offset == params.WsParams.forward.offset
    assert (persistent.item_columns.offset, persistent.item_rows.offset, persistent.schedule.offset) == (
        base + 4, base + 8, base + 16)
    # three consumers, a full mask and an fp32 bias read from global memory, softcap
    for knobs in (dict(overlap=1), dict(overlap=1, persistent=1)):
        build.build("fwd_ws", "sm90", variants.variant(FwdConfig(192, 64, 16, 2, **knobs), 128, torch.float16,
                                                       torch.float32, arch="sm90", is_causal=False, has_mask=True,
                                                       softcap=30.0))


def test_a_tma_store_of_out_stages_its_rows_beside_the_tiles_and_refuses_packed_sequences():
    """tma_store adds a consumer's rows of out (64 x the swizzled head dim) per consumer to the
    forward's shared memory, before the staged mask and bias ring takes what is left, and a
    packed call, whose boxes would write the next sequence's rows, refuses it."""
    base = FwdConfig(128, 128, 12, 2, overlap=1, persistent=1)
    store = replace(base, tma_store=1)
    none, rows = shared_memory.NOT_STAGED, shared_memory.TILES_OF_ROWS
    for head_dim in (64, 96, 128):
        assert (shared_memory.forward_shared_bytes(store, head_dim, "sm90", none, none)
                - shared_memory.forward_shared_bytes(base, head_dim, "sm90", none, none)) == 128 * (
                    rules.swizzled_head_dim(head_dim) * 2)
    # a full mask and bias: one slot beside the rings, none left once out's rows take 32 KiB
    assert shared_memory.score_stages(base, 128, rows, rows) == 1
    assert shared_memory.score_stages(store, 128, rows, rows) == 0
    with pytest.raises(ValueError, match="tma_store=1 stores boxes of 64 rows"):
        variants.variant(store, 128, torch.bfloat16, None, arch="sm90", is_causal=True, has_mask=False, softcap=0.0,
                         packed=True)
    assert "tma_store" in variants.forward_packed_reason(store, 128, "sm90")
    assert variants.forward_packed_reason(base, 128, "sm90") is None


def test_a_tma_store_forward_plans_out_s_map_last_and_from_the_program_s_out(sm90_forward_plans):
    """The plan of a tma_store config maps out (operand 5) as q's rows load, 64 rows a box, and
    passes it in the parameter block's last field (OutMap*WsParams); its native program's map of
    out is of the program's own allocation of out (`native.allocated(0)`), the others of its inputs."""
    from dmattn_kernels.runtime import native

    built, q, k = sm90_forward_plans
    cpu = torch.device("cpu")
    for persistent in (0, 1):
        expected = params.ws_params_type(False, bool(persistent), False, True)
        config = FwdConfig(128, 128, 12, 2, overlap=1, persistent=persistent, tma_store=1)
        plan = forward._forward_launch((q, k, k, None, None, q), True, 0.0, config)
        assert built[-1][-1] == "-DFWD_TMA_STORE=1" and plan.tma_store
        assert plan.maps[-1] == ("o_map", 5, forward.ROWS_OF, 64, forward.TMA_LINE, forward.TMA_LINE)
        schedule = plan.launch_grid(cpu)[1]
        block = plan.ws_params(params.FwdParams(), schedule)
        assert type(block) is expected and expected.o_map.offset == ctypes.sizeof(expected) - 128
        _, _, descriptors = forward._native_parameters((q, k, k, None, None, q), 0.1, 0.0, (1200, 300, 1), plan,
                                                       schedule)
        assert descriptors == [(expected.q_map.offset, native.given(0)), (expected.k_map.offset, native.given(1)),
                               (expected.v_map.offset, native.given(2)), (expected.o_map.offset, native.allocated(0))]
    untouched = forward._forward_launch((q, k, k, None, None, q), True, 0.0, FwdConfig(128, 128, 12, 2, 1, 1))
    assert not untouched.tma_store and [m[0] for m in untouched.maps] == ["q_map", "k_map", "v_map"]


@needs_nvcc
def test_a_tma_store_forward_builds_with_out_s_map_after_the_other_fields(cubin_cache):
    """FWD_TMA_STORE appends out's map to every WsParams it builds with (one item a CTA or
    persistent, a window), each kernel's parameter block the size of its ctypes mirror, and its
    consumers spill nothing without a mask or bias."""
    import triton

    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    for persistent, window in ((0, False), (1, False), (0, True), (1, True)):
        config = FwdConfig(128, 128, 12, 2, overlap=1, persistent=persistent, tma_store=1)
        flags = variants.variant(config, 128, torch.bfloat16, None, arch="sm90", is_causal=True, has_mask=False,
                                 softcap=0.0, window=window)
        cubin = build.build("fwd_ws", "sm90", flags)
        mirror = params.ws_params_type(window, bool(persistent), False, True)
        assert _parameter_sizes(cubin) == [ctypes.sizeof(mirror)]
        assert mirror.o_map.offset == ctypes.sizeof(params.ws_params_type(window, bool(persistent), False))
        usage = subprocess.run([str(cuobjdump), "-res-usage", str(cubin)], capture_output=True, text=True,
                               check=True).stdout
        assert re.search(r"STACK:0 ", usage), usage


@needs_nvcc
def test_a_window_builds_into_the_overlapped_forward_and_takes_its_sides_after_the_inputs(cubin_cache):
    """HAS_WINDOW appends the window's sides to Inputs (WindowedInputs), so the overlapped
    forward's parameter block grows by nothing a map or FwdParams' later fields would miss."""
    config = FwdConfig(128, 128, 12, 2, overlap=1)
    flags = variants.variant(config, 128, torch.bfloat16, torch.bfloat16, arch="sm90", is_causal=True,
                             has_mask=True, softcap=0.0, window=True)
    assert flags[-1] == "-DHAS_WINDOW=1" and "-DHAS_WINDOW=1" not in _ws_flags(config)
    assert _parameter_sizes(build.build("fwd_ws", "sm90", flags)) == [ctypes.sizeof(params.WindowedWsParams)]
    assert params.WindowedInputs.window_left.offset == ctypes.sizeof(params.Inputs)
    assert params.WindowedWsParams.forward.offset == params.WsParams.forward.offset
    assert (params.WindowedFwdParams.out.offset - params.FwdParams.out.offset
            == ctypes.sizeof(params.WindowedInputs) - ctypes.sizeof(params.Inputs))
    # three consumers, not causal, an fp32 bias read from global memory, softcap
    build.build("fwd_ws", "sm90", variants.variant(FwdConfig(192, 64, 16, 2, overlap=1), 64, torch.float16,
                                                   torch.float32, arch="sm90", is_causal=False, has_mask=True,
                                                   softcap=30.0, window=True))
    # persistent: the work items and the schedule after the windowed forward's fields
    persistent = variants.variant(replace(config, persistent=1), 128, torch.bfloat16, None, arch="sm90",
                                  is_causal=True, has_mask=False, softcap=0.0, window=True)
    assert _parameter_sizes(build.build("fwd_ws", "sm90", persistent)) == [
        ctypes.sizeof(params.WindowedPersistentWsParams)]
    assert params.WindowedPersistentWsParams.item_columns.offset == params.WindowedWsParams.section_slices.offset + 4


@pytest.mark.parametrize("config, arch", [(FwdConfig(128, 128, 12, 2), "sm90"),
                                          (FwdConfig(128, 64, 4, 2), "sm90"),
                                          (FwdConfig(128, 128, 12, 2, overlap=1), "sm80")],
                         ids=["one-tile-at-a-time", "mma-sync", "sm80"])
def test_a_window_on_any_other_cuda_forward_is_refused_before_a_build(config, arch):
    with pytest.raises(ValueError, match="sliding window runs in the CUDA forward's overlapped"):
        variants.variant(config, 128, torch.bfloat16, None, arch=arch, is_causal=True, has_mask=False, softcap=0.0,
                         window=True)


@pytest.mark.parametrize("is_causal", [True, False])
@pytest.mark.parametrize("seqlens", [(1000, 1000), (333, 1000), (1000, 333)])
def test_a_persistent_window_s_item_costs_are_the_key_tiles_its_rows_see(is_causal, seqlens):
    """`forward._key_tiles` under a window: from the tile of the block's first visible key to the
    tile of its last, as common.cuh's key_tiles walks them (checked against every row's keys)."""
    from dmattn_kernels.configs import window_bounds

    config = FwdConfig(128, 64, 12, 3, overlap=1, persistent=1)
    seqlen_q, seqlen_k = seqlens
    for window in ((100, 0), (200, 37), (-1, 50)):
        _, left, right = window_bounds(window, is_causal, seqlen_q, seqlen_k)
        offset = seqlen_k - seqlen_q
        for m_block in range(-(-seqlen_q // config.block_m)):
            keys = [j for i in range(m_block * 128, min((m_block + 1) * 128, seqlen_q))
                    for j in range(max(0, i + offset - left), min(seqlen_k, i + offset + right + 1))
                    if not is_causal or j <= i + offset]
            expected = (max(keys) // 64 - min(keys) // 64 + 1) if keys else 0
            assert forward._key_tiles(m_block, config, seqlen_q, seqlen_k, is_causal, (left, right)) >= expected
            # the kernel's bound counts at most the block's rows past Lq (never read): no fewer tiles
            assert forward._key_tiles(m_block, config, seqlen_q, seqlen_k, is_causal, (left, right)) <= expected + 1


@needs_nvcc
def test_a_window_builds_into_the_warp_specialized_backward_and_takes_its_sides_after_the_inputs(cubin_cache):
    """HAS_WINDOW appends the window's sides to the backward's Inputs too: its three kernels take
    `WindowedBwdWsParams`, whose later fields move by the sides' bytes."""
    config = BwdConfig(64, 128, 64, 128, 12, 2)
    common = dict(arch="sm90", group=2, dbias=(True, torch.bfloat16))
    flags = variants.backward_variant(config, 128, torch.bfloat16, torch.bfloat16, is_causal=True, has_mask=True,
                                      softcap=0.0, window=True, **common)
    assert "-DHAS_WINDOW=1" in flags and "-DDBIAS_TMA=1" in flags
    assert "-DHAS_WINDOW=1" not in variants.backward_variant(config, 128, torch.bfloat16, torch.bfloat16,
                                                             is_causal=True, has_mask=True, softcap=0.0, **common)
    assert _parameter_sizes(build.build("bwd_ws", "sm90", flags)) == [ctypes.sizeof(params.WindowedBwdWsParams)] * 3
    assert params.WindowedBwdWsParams.backward.offset == params.BwdWsParams.backward.offset
    assert (params.WindowedBwdParams.out.offset - params.BwdParams.out.offset
            == ctypes.sizeof(params.WindowedInputs) - ctypes.sizeof(params.Inputs))
    # one consumer, not causal, a per-key bias in registers, softcap, fp16
    build.build("bwd_ws", "sm90", variants.backward_variant(
        BwdConfig(64, 64, 64, 64, 8, 2), 64, torch.float16, torch.float16, is_causal=False, has_mask=False,
        softcap=30.0, window=True, bias_tiles=shared_memory.TILES_OF_KEYS, arch="sm90", group=1,
        dbias=(False, torch.float32)))


@pytest.mark.parametrize("config, arch", [(BwdConfig(64, 64, 64, 64, 4, 2), "sm90"),
                                          (BwdConfig(64, 128, 64, 128, 12, 2), "sm80")], ids=["mma-sync", "sm80"])
def test_a_window_on_any_other_cuda_backward_is_refused_before_a_build(config, arch):
    with pytest.raises(ValueError, match="sliding window runs in the CUDA backward's warp-specialized kernel only"):
        variants.backward_variant(config, 128, torch.bfloat16, None, arch=arch, is_causal=True, has_mask=False,
                                  softcap=0.0, group=1, dbias=None, window=True)


@pytest.mark.parametrize("seqlen_q, seqlen_k", [(300, 300), (203, 113), (113, 203), (64, 640)])
@pytest.mark.parametrize("is_causal, left, right", [(True, 100, 0), (True, 64, 0), (False, 70, 30),
                                                    (False, 0, 0), (False, 500, 129)])
def test_the_windowed_backward_s_blocks_visit_exactly_the_query_tiles_that_see_them(seqlen_q, seqlen_k, is_causal,
                                                                                      left, right):
    """flash_bwd_ws.cu under HAS_WINDOW, its arithmetic written out: block n walks query tiles
    [m_begin, m_end), and tile m's shares are summed from first_block(m) on. Checked against the
    rule itself (which rows see which keys): a block visits every tile one of whose rows sees one
    of its keys; the blocks visiting a tile are consecutive from first_block(m); the tiles no block
    visits are `unvisited_query_tiles`, all of whose rows see no key."""
    block_m, block_n = 64, 128
    offset = seqlen_k - seqlen_q
    right_reach = 0 if is_causal else right

    def sees(row, key):
        return (key >= row + offset - left and key <= row + offset + right_reach and key < seqlen_k)

    m_tiles, n_blocks = -(-seqlen_q // block_m), -(-seqlen_k // block_n)
    visitors = {m: [] for m in range(m_tiles)}
    for n in range(n_blocks):
        m_begin = max(0, n * block_n - offset - right_reach) // block_m
        m_end = (min(seqlen_q, max(0, (n + 1) * block_n - offset + left)) + block_m - 1) // block_m
        for m in range(m_begin, m_end):
            visitors[m].append(n)
        needed = {row // block_m for row in range(seqlen_q)
                  for key in range(n * block_n, min(seqlen_k, (n + 1) * block_n)) if sees(row, key)}
        assert needed <= set(range(m_begin, m_end)), n
    for m, blocks in visitors.items():
        if blocks:
            first = max(0, m * block_m + offset - left) // block_n
            assert blocks == list(range(first, first + len(blocks))), m
    unvisited = [m for m, blocks in visitors.items() if not blocks]
    sides = (left, seqlen_q + seqlen_k if is_causal else right)
    assert unvisited == list(range(backward.unvisited_query_tiles(seqlen_q, seqlen_k, block_m, is_causal, sides)))
    assert not any(sees(row, key) for m in unvisited for row in range(m * block_m, min(seqlen_q, m * block_m + 64))
                   for key in range(seqlen_k))


@needs_nvcc
def test_packed_sequences_build_into_the_warp_specialized_backward_with_their_fields_last(cubin_cache):
    """PACKED appends the sequences' offsets and lengths to BwdWsParams (a per-key mask and bias
    read at the sequence's keys; with a window too), and refuses a config that is not the
    warp-specialized backward."""
    config = BwdConfig(64, 128, 64, 128, 12, 2)
    common = dict(arch="sm90", group=4, dbias=(False, torch.float32))
    flags = variants.backward_variant(config, 128, torch.bfloat16, torch.bfloat16, is_causal=True, has_mask=True,
                                      softcap=0.0, mask_tiles=shared_memory.TILES_OF_KEYS,
                                      bias_tiles=shared_memory.TILES_OF_KEYS, packed=True, **common)
    assert "-DPACKED=1" in flags
    assert _parameter_sizes(build.build("bwd_ws", "sm90", flags)) == [ctypes.sizeof(params.PackedBwdWsParams)] * 3
    assert params.PackedBwdWsParams.cu_seqlens_q.offset > params.PackedBwdWsParams.section_slices.offset
    assert params.bwd_ws_params_type(True, True) is params.WindowedPackedBwdWsParams
    windowed = variants.backward_variant(BwdConfig(64, 64, 64, 64, 8, 2), 64, torch.float16, None, is_causal=False,
                                         has_mask=False, softcap=0.0, packed=True, window=True, arch="sm90", group=1,
                                         dbias=None)
    assert _parameter_sizes(build.build("bwd_ws", "sm90", windowed)) == [
        ctypes.sizeof(params.WindowedPackedBwdWsParams)] * 3
    with pytest.raises(ValueError, match="a packed call runs in the CUDA backward's warp-specialized kernel only"):
        variants.backward_variant(BwdConfig(64, 64, 64, 64, 4, 2), 128, torch.bfloat16, None, is_causal=True,
                                  has_mask=False, softcap=0.0, packed=True, **common)
    assert variants.backward_packed_reason(True, False) and variants.backward_packed_reason(False, True)
    assert variants.backward_packed_reason(False, False) is None


@pytest.mark.parametrize("lengths", [(0, 1, 63, 64, 65, 200, 0), (1000,), (7,) * 20, (64, 64, 64), (0, 0)])
def test_the_packed_backward_s_dq_tiles_of_two_sequences_never_overlap_and_fit_a_head(lengths):
    """flash_bwd_ws.cu under PACKED, its arithmetic written out: sequence s's dQ sums start at
    tile cu_seqlens_q[s] // 64 + s (sequence_tile) and take cdiv(L_s, 64) tiles; no two
    sequences share one, and all lie below `packed_head_tiles` (O(total), not sequences x the
    longest)."""
    block_m, starts = 64, [0]
    for length in lengths:
        starts.append(starts[-1] + length)
    taken = set()
    for s, length in enumerate(lengths):
        first = starts[s] // block_m + s
        tiles = set(range(first, first + -(-length // block_m)))
        assert not tiles & taken, s
        taken |= tiles
    assert all(tile < backward.packed_head_tiles(starts[-1], block_m, len(lengths)) for tile in taken)


def test_a_packed_backward_of_empty_sequences_launches_nothing_and_leaves_zero_gradients(monkeypatch):
    """No sequence, or none with a query row or a key: the warp-specialized backward has no block
    to run (a grid or tensor map of size 0 would fail), and the gradients of the rows no sequence
    owns are zero."""
    launches = []

    class Recorder:
        def __init__(self, source, device, flags):
            assert "-DPACKED=1" in flags

        def __call__(self, name, *args):
            launches.append(name)

    monkeypatch.setattr(backward, "check_query", lambda q: None)
    monkeypatch.setattr(backward, "arch_of", lambda device: "sm90")
    monkeypatch.setattr(backward, "Launcher", Recorder)
    q = torch.randn(1, 64, 4, 128).to(torch.bfloat16)
    k = torch.randn(1, 48, 2, 128).to(torch.bfloat16)
    lse = torch.zeros(1, 4, 64)
    for sequences, max_q, max_k in ((0, 16, 16), (2, 0, 16), (2, 16, 0)):
        cu_q, cu_k = torch.zeros(sequences + 1, dtype=torch.int32), torch.zeros(sequences + 1, dtype=torch.int32)
        dq, dk, dv = (torch.full_like(t, float("nan")) for t in (q, k, k))
        backward.attention_backward(q, q, k, k, q, lse, None, None, is_causal=True, softmax_scale=0.1, softcap=0.0,
                                    config=WS_BWD, dq=dq, dk=dk, dv=dv, dbias=None,
                                    packing=Packing(sequences, max_q, max_k, False, False, False),
                                    sequences=(cu_q, cu_k, None))
        assert launches == [] and all(bool((t == 0).all()) for t in (dq, dk, dv)), (sequences, max_q, max_k)


@needs_nvcc
def test_packed_sequences_build_into_the_overlapped_forward_with_their_fields_last(cubin_cache):
    """PACKED appends the sequences' offsets and lengths to WsParams (no mask or bias, a staged
    per-key mask and bias, a window, persistent), and refuses a config other than the overlapped
    forward."""
    config = FwdConfig(128, 128, 12, 2, overlap=1)
    common = dict(arch="sm90", is_causal=True, softcap=0.0, packed=True)
    plain = variants.variant(config, 128, torch.bfloat16, None, has_mask=False, **common)
    staged = variants.variant(config, 128, torch.bfloat16, torch.bfloat16, has_mask=True,
                              mask_tiles=shared_memory.TILES_OF_KEYS, bias_tiles=shared_memory.TILES_OF_KEYS, **common)
    assert "-DPACKED=1" in plain and "-DMASK_TILES=2" in staged and "-DBIAS_TILES=2" in staged
    for flags in (plain, staged):
        assert _parameter_sizes(build.build("fwd_ws", "sm90", flags)) == [ctypes.sizeof(params.PackedWsParams)]
    assert params.PackedWsParams.cu_seqlens_q.offset > params.PackedWsParams.section_slices.offset
    windowed = variants.variant(FwdConfig(64, 64, 8, 2, overlap=1), 64, torch.float16, None, has_mask=False,
                                window=True, **common)
    assert _parameter_sizes(build.build("fwd_ws", "sm90", windowed)) == [ctypes.sizeof(params.WindowedPackedWsParams)]
    assert params.ws_params_type(True, False, True) is params.WindowedPackedWsParams
    persistent = variants.variant(FwdConfig(128, 128, 12, 2, overlap=1, persistent=1), 128, torch.bfloat16, None,
                                  has_mask=False, **common)
    persistent_params = params.ws_params_type(False, True, True)
    assert _parameter_sizes(build.build("fwd_ws", "sm90", persistent)) == [ctypes.sizeof(persistent_params)]
    assert persistent_params.item_counter.offset > persistent_params.schedule.offset
    for refused in (FwdConfig(128, 128, 12, 2), FwdConfig(128, 64, 8, 2)):
        with pytest.raises(ValueError, match="a packed call runs in the CUDA forward's overlapped"):
            variants.variant(refused, 128, torch.bfloat16, None, has_mask=False, **common)


def test_a_packed_forward_passes_its_sequences_and_a_persistent_one_a_zeroed_item_counter(monkeypatch):
    """The packed forward's parameters hold the sequences' prefix sums and longest lengths, its
    grid the sequences x heads by the longest sequence's blocks; persistent, a CTA per SM (at most
    one per item) and a counter at 0 that its CTAs take items from (the host cannot order items it
    has no lengths for). Without keys it launches (its rows are dead: out 0, lse -inf); with no
    sequence, or none with a query row, nothing launches."""
    launches = []

    class Recorder:
        def __init__(self, source, device, flags):
            assert "-DPACKED=1" in flags

        def __call__(self, name, grid, num_warps, shared, parameters):
            counter = parameters.item_counter and ctypes.c_int.from_address(parameters.item_counter).value
            launches.append((grid, parameters.cu_seqlens_q, parameters.max_seqlen_q, parameters.max_seqlen_k,
                             parameters.schedule if hasattr(parameters, "schedule") else None, counter))

    monkeypatch.setattr(forward, "check_query", lambda q: None)
    monkeypatch.setattr(forward, "arch_of", lambda device: "sm90")
    monkeypatch.setattr(forward, "Launcher", Recorder)
    monkeypatch.setattr(forward, "_sm_count", lambda device: 6)
    monkeypatch.setattr(forward._ForwardLaunch, "tensor_maps", lambda self, operands: {})
    q, k = torch.randn(1, 300, 4, 128).to(torch.bfloat16), torch.randn(1, 90, 2, 128).to(torch.bfloat16)
    cu_q, cu_k = torch.tensor([0, 260, 300], dtype=torch.int32), torch.tensor([0, 50, 90], dtype=torch.int32)
    overlapped = FwdConfig(128, 128, 12, 2, overlap=1)
    for config, packing in ((overlapped, Packing(2, 260, 50)), (replace(overlapped, persistent=1), Packing(2, 260, 50)),
                            (overlapped, Packing(2, 260, 0)),  # no keys: every row dead, stored by the kernel
                            (overlapped, Packing(0, 260, 50)), (overlapped, Packing(2, 0, 50))):
        forward.attention_forward(q, k, k, None, None, is_causal=True, softmax_scale=0.1, softcap=0.0, config=config,
                                  out=torch.empty_like(q), lse=torch.empty(1, 4, 300), packing=packing,
                                  sequences=(cu_q, cu_k, None))
    # a CTA per item: 2 sequences x 4 heads by cdiv(260, 128) blocks; persistent: 6 CTAs
    assert launches == [((8, 3), cu_q.data_ptr(), 260, 50, None, None),
                        ((6, 1), cu_q.data_ptr(), 260, 50, None, 0),
                        ((8, 3), cu_q.data_ptr(), 260, 0, None, None)]


def test_a_packed_cuda_forward_entry_s_stamp_holds_its_kernel_however_often_it_is_taken():
    """The stamp of a CUDA packed forward entry digests the warp-specialized forward (PACKED) it
    runs, and the same on every computation in a process: its launch plans are cached per call
    signature, so a plan for a stamp is built anew each time (the Launcher records the program),
    and a helper kernel of the other backend never stands in for the CUDA ones."""
    from dmattn_bench.dispatch import stamps
    from dmattn_bench.space import TableKey

    key = TableKey("fwd", "bf16", 128, True, "none", "none", 4, 4096, 4096, packed=True)
    config = FwdConfig(128, 128, 12, 2, overlap=1, persistent=1)
    for _ in range(2):
        calls = list(stamps.entry_programs("cuda", key, config, "sm90", 132))
        assert calls and all(programs and {(p.backend, p.name) for p in programs} == {("cuda", "fwd_ws")}
                             and ("-D", "-DPACKED=1") in programs[0].parameters for _, programs in calls)


def test_a_kv_group_is_a_knob_of_the_warp_specialized_backward_on_grouped_heads():
    """BwdConfig.kv_group (flash_bwd_ws.cu's BWD_KV_GROUP): supported on the warp-specialized
    backward's shape for a GQA call; refused, naming why, with one query head a KV head, on any
    other CUDA backward, on sm80 and by the Triton backend; the tuner's structural precheck keeps
    it (its worst shape groups heads), so a GQA workload times it."""
    from dmattn_bench.tuning.prune import _worst_shape

    grouped = replace(WS_BWD, kv_group=1)
    shape = AttentionShape(2, 256, 256, 8, 2, 128, is_causal=True)
    assert rules.is_supported(grouped, shape) is None
    assert "needs grouped query heads" in rules.is_supported(grouped, replace(shape, num_heads_kv=8))
    assert "a knob of the warp-specialized backward only" in rules.is_supported(
        BwdConfig(64, 128, 128, 64, 8, 2, kv_group=1), shape)
    assert "runs on sm90 only" in rules.arch_reason(grouped, 128, "sm80")
    assert "the Triton backward has none" in get_backend("triton").is_supported(grouped, shape)
    assert get_backend("cuda").is_supported(grouped, _worst_shape(128)) is None


def test_a_kv_group_variant_sums_dk_and_dv_in_the_kernel_and_stages_no_tiles_of_rows():
    """The variant's -D list: BWD_KV_GROUP on, no fp32 dK/dV shares (DKV_FP32 0 under GQA), a
    mask and bias of query rows read from global memory (MASK_TILES, BIAS_TILES 0) and dBias
    stored by its threads (DBIAS_TMA 0), where the same call without the knob stages and stores
    them by TMA."""
    common = dict(arch="sm90", is_causal=True, has_mask=True, softcap=0.0, group=4, dbias=(True, torch.bfloat16))
    plain = variants.backward_variant(WS_BWD, 128, torch.bfloat16, torch.bfloat16, **common)
    grouped = variants.backward_variant(replace(WS_BWD, kv_group=1), 128, torch.bfloat16, torch.bfloat16, **common)
    assert {"-DDKV_FP32=1", "-DMASK_TILES=1", "-DBIAS_TILES=1", "-DDBIAS_TMA=1"} <= set(plain)
    assert "-DBWD_KV_GROUP=1" not in plain
    assert {"-DBWD_KV_GROUP=1", "-DDKV_FP32=0", "-DMASK_TILES=0", "-DBIAS_TILES=0", "-DDBIAS_TMA=0"} <= set(grouped)
    per_key = variants.backward_variant(replace(WS_BWD, kv_group=1), 128, torch.bfloat16, torch.bfloat16,
                                        mask_tiles=shared_memory.TILES_OF_KEYS, bias_tiles=shared_memory.TILES_OF_KEYS,
                                        **common)
    assert {"-DMASK_TILES=2", "-DBIAS_TILES=2"} <= set(per_key)  # a row of keys stays in registers


@pytest.mark.parametrize("kv_group", [0, 1])
def test_a_kv_group_backward_launches_a_cta_per_kv_head_and_writes_dk_and_dv_itself(monkeypatch, kv_group):
    """With kv_group the main kernel's grid is B x Hkv slices by key blocks (a CTA walks its
    group's query heads), the dQ kernel's stays B x H, and dK and dV are the kernel's targets
    (no fp32 share per query head for the launcher to sum); without it, B x H slices writing
    shares."""
    launches = []

    class Recorder:
        def __init__(self, source, device, flags):
            assert ("-DBWD_KV_GROUP=1" in flags) == bool(kv_group)

        def __call__(self, name, grid, num_warps, shared, parameters):
            launches.append((name, grid, parameters.backward.dk))

    class Maps:  # no driver on the CPU: the maps' bytes are not looked at here
        @staticmethod
        def tensor_map(*args):
            return params.TensorMap()

    monkeypatch.setattr(backward, "check_query", lambda q: None)
    monkeypatch.setattr(backward, "arch_of", lambda device: "sm90")
    monkeypatch.setattr(backward, "Launcher", Recorder)
    monkeypatch.setattr(backward, "the_driver", Maps)
    batch, seqlen, heads, heads_kv = 2, 256, 8, 2
    q = torch.randn(batch, seqlen, heads, 128).to(torch.bfloat16)
    k = torch.randn(batch, seqlen, heads_kv, 128).to(torch.bfloat16)
    lse = torch.zeros(batch, heads, seqlen)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(k)
    backward.attention_backward(q, q, k, k, q, lse, None, None, is_causal=True, softmax_scale=0.1, softcap=0.0,
                                config=replace(WS_BWD, kv_group=kv_group), dq=dq, dk=dk, dv=dv, dbias=None)
    grids = {name: (grid, target) for name, grid, target in launches}
    kernel_grid, kernel_dk = grids[b"dmattn_bwd_ws_kernel"]
    assert kernel_grid == ((batch * heads_kv if kv_group else batch * heads), seqlen // WS_BWD.block_n)
    assert grids[b"dmattn_bwd_ws_dq_kernel"][0][1] == batch * heads
    assert (kernel_dk == dk.data_ptr()) == bool(kv_group)


@needs_nvcc
def test_a_kv_group_builds_into_the_warp_specialized_backward_with_its_parameter_blocks(cubin_cache):
    """BWD_KV_GROUP adds no parameter: dense, windowed and packed variants (a per-key mask and a
    learnable per-key bias, summed per query head) take the blocks they take without it."""
    grouped = replace(WS_BWD, kv_group=1)
    common = dict(arch="sm90", group=4, has_mask=True, mask_tiles=shared_memory.TILES_OF_KEYS,
                  bias_tiles=shared_memory.TILES_OF_KEYS, dbias=(False, torch.float32))
    for window, packed in ((False, False), (True, False), (False, True)):
        flags = variants.backward_variant(grouped, 128, torch.bfloat16, torch.bfloat16, is_causal=not window,
                                          softcap=0.0, window=window, packed=packed, **common)
        assert _parameter_sizes(build.build("bwd_ws", "sm90", flags)) == [
            ctypes.sizeof(params.bwd_ws_params_type(window, packed))] * 3


def test_nondeterministic_dq_is_a_knob_of_the_warp_specialized_backward_the_table_names():
    """BwdConfig.nondeterministic_dq (flash_bwd_ws.cu's BWD_DQ_UNORDERED): supported on the
    warp-specialized backward's shapes (transposed and with a KV group too), refused naming why
    on any other CUDA backward and by the Triton backend; its label, and so the table entry,
    says it, and `ordered` is the same config without it."""
    unordered = replace(WS_BWD, nondeterministic_dq=1)
    shape = AttentionShape(2, 256, 256, 8, 2, 128, is_causal=True)
    for config in (unordered, replace(unordered, kv_group=1)):
        assert rules.is_supported(config, shape) is None
    assert rules.is_supported(replace(TRANSPOSED_BWD, nondeterministic_dq=1), replace(shape, head_dim=192)) is None
    assert "a knob of the warp-specialized backward only" in rules.is_supported(
        BwdConfig(32, 64, 64, 32, 4, 2, nondeterministic_dq=1), shape)
    assert rules.is_supported(BwdConfig(32, 64, 64, 32, 4, 2, kv_group=1, nondeterministic_dq=1), shape).startswith(
        "kv_group=1 and nondeterministic_dq=1: a knob of the warp-specialized backward only")
    assert "nondeterministic_dq: knobs of the CUDA warp-specialized backward" in get_backend("triton").is_supported(
        unordered, shape)
    assert config_label(unordered).endswith(" nondeterministic_dq") and unordered.to_dict()["nondeterministic_dq"] == 1
    assert not unordered.deterministic and unordered.ordered() == WS_BWD and WS_BWD.deterministic
    common = dict(arch="sm90", is_causal=True, has_mask=False, softcap=0.0, group=1, dbias=None)
    assert "-DBWD_DQ_UNORDERED=1" in variants.backward_variant(unordered, 128, torch.bfloat16, None, **common)
    assert not any("BWD_DQ_UNORDERED" in flag for flag in variants.backward_variant(WS_BWD, 128, torch.bfloat16,
                                                                                       None, **common))


@needs_nvcc
def test_nondeterministic_dq_builds_into_every_warp_specialized_backward_with_its_parameter_blocks(cubin_cache):
    """BWD_DQ_UNORDERED adds no parameter: dense, windowed, packed, KV-group and transposed
    variants take the blocks they take without it."""
    unordered = replace(WS_BWD, nondeterministic_dq=1)
    per_key = dict(has_mask=True, mask_tiles=shared_memory.TILES_OF_KEYS, bias_tiles=shared_memory.TILES_OF_KEYS,
                   dbias=(False, torch.float32))
    calls = [(unordered, 128, 1, False, False), (unordered, 128, 1, True, False), (unordered, 128, 1, False, True),
             (replace(unordered, kv_group=1), 128, 4, False, False),
             (replace(TRANSPOSED_BWD, nondeterministic_dq=1), 192, 1, False, False)]
    for config, head_dim, group, window, packed in calls:
        flags = variants.backward_variant(config, head_dim, torch.bfloat16, torch.bfloat16, arch="sm90",
                                          is_causal=not window, softcap=0.0, group=group, window=window,
                                          packed=packed, **per_key)
        assert "-DBWD_DQ_UNORDERED=1" in flags
        assert _parameter_sizes(build.build("bwd_ws", "sm90", flags)) == [
            ctypes.sizeof(params.bwd_ws_params_type(window, packed))] * 3
