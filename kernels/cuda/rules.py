"""What a CUDA config can run: the kernel each config names on an arch, `is_supported`'s
structural rules, the cubin a launch builds (`kernel_keys`), and the checks a call's tensors pass
before a launch.

Two families share the rules: the mma.sync kernels (flash_fwd.cu, flash_bwd.cu; on SM90 their
products run as wgmma where `uses_wgmma`) and the SM90 warp-specialized ones (flash_fwd_ws.cu,
flash_bwd_ws.cu: a producer warpgroup feeding consumer warpgroups through TMA).
"""

from __future__ import annotations

import torch

from dmattn_kernels import target
from dmattn_kernels.configs import AttentionShape, BwdConfig, FwdConfig, shape_problem

WARP_CHOICES = (2, 4, 8)
# Rows a warp owns, as m16 tiles: forward block_m = 16 or 32 x num_warps (flash_fwd.cu: WARP_TILES),
# backward block_n and block_m_dq = 16 x num_warps.
FORWARD_WARP_ROWS = (16, 32)
INNER_CHOICES = (16, 32, 64, 128)  # the tiles a CTA walks: fwd block_n, bwd block_m and block_n_dq
MAX_STAGES = 4
WGMMA_TILES = (32, 64, 128)  # inner tiles with an m64nN wgmma product (sm90.cuh: is_wgmma_width)
# Query rows of a warp-specialized forward CTA: 64 per consumer warpgroup, one to three consumers
# (plus the producer: 8, 12 or 16 warps)
WS_BLOCK_M = (64, 128, 192)
# The warp-specialized backward (flash_bwd_ws.cu): keys of a CTA, 64 per consumer warpgroup (plus
# the producer: 8 or 12 warps), walking query tiles of 64 rows; its dQ shares are those tiles
# (block_m_dq = block_m, block_n_dq = block_n)
WS_BWD_BLOCK_N = (64, 128)
WS_BWD_BLOCK_M = 64
# Its transposed layout (DKV_TRANSPOSED) for tiles of 192 columns (D136-D192): two consumer
# warpgroups (12 warps) splitting block_n keys, each holding dK^T and dV^T of its keys (the n of
# its products), as FlashAttention-3's hdim-192 backward does
TRANSPOSED_BWD_BLOCK_N = (64, 96)
TRANSPOSED_BWD_WARPS = 12
TRANSPOSED_BWD_COLUMNS = 192
WARPGROUP = 4  # warps that issue one wgmma together
GROUP_ROWS = 64  # query rows of a consumer warpgroup's m64 products (sm90.cuh)
# Above it a dK/dV thread holds 2 x head_dim / 2 fp32 accumulators (192 or more registers) plus
# its S^T and dP^T fragments, and spills heavily (at 128 only the largest 4-warp tiles spill a
# little, 128x64 w4: the tuner measures those): H200, B2 H16 L4096
# D256 causal bf16, 32x64 dq64x32 w4 s1: 9.79 ms through wgmma vs 5.90 ms through mma.sync
# (`python -m benchmarks cuda-defaults-sweep`, 2026-11-22).
WGMMA_BWD_MAX_HEAD_DIM = 128


def padded_head_dim(head_dim: int) -> int:
    return (head_dim + 15) // 16 * 16


SWIZZLE_COLS = 64  # columns of one 128-byte swizzle line of 16-bit elements (sm90.cuh)


def swizzled_head_dim(head_dim: int) -> int:
    """The columns of a warp-specialized kernel's tiles: whole 64-column swizzle blocks, TMA
    filling those past head_dim with zeros (common.cuh's BLOCK_D under SWIZZLE_PADDED)."""
    return -(-head_dim // SWIZZLE_COLS) * SWIZZLE_COLS


def uses_wgmma(config: FwdConfig | BwdConfig, head_dim: int, arch: str | None) -> bool:
    """Whether `config`'s kernels run their products as SM90 wgmma (sm90.cuh): on SM90, with 16
    rows per warp in whole warpgroups, inner tiles wgmma has a width for, and a head dim padded to
    a multiple of 64 (the 128-byte swizzle line); elsewhere mma.sync.

    The backward also needs a head dim of at most 128 (WGMMA_BWD_MAX_HEAD_DIM).
    """
    padded = padded_head_dim(head_dim)
    if arch != "sm90" or config.num_warps % WARPGROUP or padded % 64:
        return False
    if isinstance(config, FwdConfig):
        return config.block_m == 16 * config.num_warps and config.block_n in WGMMA_TILES
    return padded <= WGMMA_BWD_MAX_HEAD_DIM and config.block_m in WGMMA_TILES and config.block_n_dq in WGMMA_TILES


def warp_specialized(config: FwdConfig, head_dim: int, arch: str | None) -> bool:
    """Whether `config` names the SM90 warp-specialized forward (flash_fwd_ws.cu): a producer
    warpgroup plus one consumer warpgroup per 64 query rows, so num_warps = block_m / 16 + 4, on
    SM90 with a key tile wgmma has a width for. Any head dim: one that is not a multiple of 64
    runs on tiles of the next (`swizzled_head_dim`; D80 and D96 as D128)."""
    return (arch == "sm90" and config.block_m % 64 == 0
            and config.num_warps == config.block_m // 16 + WARPGROUP and config.block_n in WGMMA_TILES)


def backward_warp_specialized(config: BwdConfig, head_dim: int, arch: str | None) -> bool:
    """Whether `config` names the SM90 warp-specialized backward (flash_bwd_ws.cu): a producer
    warpgroup plus one consumer warpgroup per 64 keys, so num_warps = block_n / 16 + 4, on SM90
    with tiles of 64 or 128 columns (`swizzled_head_dim`: D80 and D96 run as D128) that split
    into whole 64-column blocks among the consumers (their dQ products); or its transposed layout
    (`transposed_backward`)."""
    if _is_transposed_shape(config):
        return transposed_backward(config, head_dim, arch)
    return arch == "sm90" and _is_warp_specialized_shape(config) and _splits_head_dim(config, head_dim)


def transposed_backward(config: BwdConfig, head_dim: int, arch: str | None) -> bool:
    """Whether `config` names the warp-specialized backward's transposed layout (flash_bwd_ws.cu's
    DKV_TRANSPOSED): block_n of 64 or 96 keys on 12 warps, on SM90, at a head dim on tiles of 192
    columns (D136-D192)."""
    return (arch == "sm90" and _is_transposed_shape(config)
            and swizzled_head_dim(head_dim) == TRANSPOSED_BWD_COLUMNS)


def _is_transposed_shape(config: BwdConfig) -> bool:
    """The transposed backward's tile shape, on any arch and head dim."""
    return config.block_n in TRANSPOSED_BWD_BLOCK_N and config.num_warps == TRANSPOSED_BWD_WARPS


def _splits_head_dim(config: BwdConfig, head_dim: int) -> bool:
    """The warp-specialized backward's head-dim rule: tiles of 64 or 128 columns, in whole
    64-column blocks for each of its block_n / 64 consumer warpgroups."""
    columns = swizzled_head_dim(head_dim)
    return columns in (64, 128) and columns % config.block_n == 0


def tile_columns(config: FwdConfig | BwdConfig, head_dim: int, arch: str | None) -> int:
    """The columns of `config`'s tiles on `arch` (common.cuh: BLOCK_D): whole swizzle blocks in the
    warp-specialized kernels, else the head dim padded to the mma k-step."""
    specialized = (warp_specialized(config, head_dim, arch) if isinstance(config, FwdConfig)
                   else backward_warp_specialized(config, head_dim, arch))
    return swizzled_head_dim(head_dim) if specialized else padded_head_dim(head_dim)


def _is_warp_specialized_shape(config: FwdConfig | BwdConfig) -> bool:
    """A warp-specialized kernel's tile shape, on any arch (`warp_specialized` and
    `backward_warp_specialized` add the arch): the forward's query rows, or the backward's keys,
    at 16 a warp plus a producer warpgroup."""
    if isinstance(config, FwdConfig):
        return config.block_m in WS_BLOCK_M and config.num_warps == config.block_m // 16 + WARPGROUP
    return ((config.block_n in WS_BWD_BLOCK_N and config.num_warps == config.block_n // 16 + WARPGROUP)
            or _is_transposed_shape(config))


def arch_reason(config: FwdConfig | BwdConfig, head_dim: int, arch: str) -> str | None:
    """The reason `config` cannot run on `arch` though its shape is supported, or None."""
    if isinstance(config, BwdConfig):
        if _is_warp_specialized_shape(config) and arch != "sm90":
            return (f"{config.block_n} keys on {config.num_warps} warps is the warp-specialized backward, which "
                    f"runs on sm90 only (here: {arch})")
        return None
    if _is_warp_specialized_shape(config) and not warp_specialized(config, head_dim, arch):
        return (f"{config.block_m} rows on {config.num_warps} warps is the warp-specialized forward, which runs "
                f"on sm90 only (here: {arch})")
    return None


def check_arch(config: FwdConfig | BwdConfig, head_dim: int, arch: str) -> None:
    """Raises ValueError with `arch_reason`, where there is one."""
    reason = arch_reason(config, head_dim, arch)
    if reason:
        raise ValueError(f"config: {reason}")


def forward_kernel(config: FwdConfig, head_dim: int, arch: str | None) -> str:
    """The forward source `config` runs on `arch`: "fwd_ws" (flash_fwd_ws.cu) or "fwd" (flash_fwd.cu)."""
    return "fwd_ws" if warp_specialized(config, head_dim, arch) else "fwd"


def backward_kernel(config: BwdConfig, head_dim: int, arch: str | None) -> str:
    """The backward source `config` runs on `arch`: "bwd_ws" (flash_bwd_ws.cu) or "bwd" (flash_bwd.cu)."""
    return "bwd_ws" if backward_warp_specialized(config, head_dim, arch) else "bwd"


def is_supported(config: FwdConfig | BwdConfig, shape: AttentionShape) -> str | None:
    """The reason `config` cannot run `shape` on this backend, or None when it can.

    Shared memory per arch is checked at launch (`OutOfResources`) and by compile-check.
    """
    reason = shape_problem(shape)
    if reason:
        return reason
    if isinstance(config, FwdConfig) and config.knobs_on():
        reason = knob_reason(config)
        if reason:
            return reason
    if isinstance(config, BwdConfig) and config.knobs_on():
        reason = bwd_knob_reason(config, shape.num_heads // shape.num_heads_kv)
        if reason:
            return reason
    if isinstance(config, BwdConfig) and _is_warp_specialized_shape(config):  # `backward_warp_specialized`
        return _warp_specialized_backward_reason(config, shape.head_dim)
    if _is_warp_specialized_shape(config):  # the SM90 warp-specialized forward (`warp_specialized`)
        if config.block_n not in WGMMA_TILES:
            return f"block_n={config.block_n} is not one of {WGMMA_TILES} (warp-specialized forward: wgmma widths)"
        # 16 warps leave ptxas 128 registers a thread, and a consumer's wgmma at head dim 256
        # needs 158 (ptxas C7602); 192 builds (nvcc 13, sm_90a)
        if config.num_warps > 12 and swizzled_head_dim(shape.head_dim) > 192:
            return (f"head_dim={shape.head_dim} needs at most 12 warps in the warp-specialized forward "
                    f"(num_warps={config.num_warps}: too few registers a thread for its products)")
        return _stages_reason(config)
    if config.num_warps not in WARP_CHOICES:
        return f"num_warps={config.num_warps} is not one of {WARP_CHOICES}"
    owned, walked, rows_per_warp = ((("block_m",), ("block_n",), FORWARD_WARP_ROWS) if isinstance(config, FwdConfig)
                                    else (("block_n", "block_m_dq"), ("block_m", "block_n_dq"), (16,)))
    for name in owned:
        if getattr(config, name) not in tuple(rows * config.num_warps for rows in rows_per_warp):
            return (f"{name}={getattr(config, name)} is not {' or '.join(map(str, rows_per_warp))} x "
                    f"num_warps={config.num_warps} (the rows a warp owns)")
    for name in walked:
        if getattr(config, name) not in INNER_CHOICES:
            return f"{name}={getattr(config, name)} is not one of {INNER_CHOICES}"
    return _stages_reason(config)


def kernel_keys(direction: str, config: FwdConfig | BwdConfig, shape: AttentionShape) -> tuple[tuple, ...]:
    """The one cubin a launch of `direction` builds: its direction, config and the feature flags
    that become its -D list (the dtype is not in the shape: two dtypes share a key and at worst
    wait for each other)."""
    features = (shape.head_dim, shape.is_causal, shape.has_mask, shape.has_bias, shape.softcap > 0)
    if direction == "bwd":
        features += (shape.bias_requires_grad, shape.num_heads > shape.num_heads_kv)
    return (("cuda", direction, *config.to_dict().values(), *features),)


def _stages_reason(config: FwdConfig | BwdConfig) -> str | None:
    """`is_supported` for num_stages, the last rule of every kernel."""
    if not 1 <= config.num_stages <= MAX_STAGES:
        return f"num_stages={config.num_stages} is not in [1, {MAX_STAGES}]"
    return None


def knob_reason(config: FwdConfig) -> str | None:
    """`is_supported` for the forward's kernel knobs: `overlap` (flash_fwd_ws.cu's FWD_OVERLAP),
    `persistent` (FWD_PERSISTENT) and `tma_store` (FWD_TMA_STORE) (each 0 or 1: `FwdConfig`), on
    the warp-specialized forward only, and a persistent launch and a TMA store of out only of the
    overlapped forward (whose consumers walk work items)."""
    if config.persistent and not config.overlap:
        return "persistent=1 needs overlap=1 (the persistent launch walks the overlapped forward's work items)"
    if config.tma_store and not config.overlap:
        return "tma_store=1 needs overlap=1 (out is stored by TMA in the overlapped forward's epilogue)"
    if not _is_warp_specialized_shape(config):
        knobs = " and ".join(f"{name}=1" for name in config.knobs_on())
        return (f"{knobs}: a knob of the warp-specialized forward only (block_m in {WS_BLOCK_M} on block_m / 16 + "
                f"{WARPGROUP} warps), not of {config.block_m} rows on {config.num_warps} warps")
    return None


def bwd_knob_reason(config: BwdConfig, group: int) -> str | None:
    """`is_supported` for the backward's kernel knobs: `kv_group` (flash_bwd_ws.cu's BWD_KV_GROUP:
    a CTA walks its KV group's query heads) and `nondeterministic_dq` (BWD_DQ_UNORDERED) (each 0
    or 1: `BwdConfig`), on the warp-specialized backward only, and a KV group only of a GQA call
    (`group` query heads a KV head)."""
    if not _is_warp_specialized_shape(config):
        knobs = " and ".join(f"{name}=1" for name in config.knobs_on())
        return (f"{knobs}: a knob of the warp-specialized backward only (block_m {WS_BWD_BLOCK_M} on block_n / 16 + "
                f"{WARPGROUP} warps), not of {config.block_m}x{config.block_n} on {config.num_warps} warps")
    if config.kv_group and group == 1:
        return "kv_group=1 needs grouped query heads (num_heads > num_heads_kv): each KV head has one query head here"
    return None


def _warp_specialized_backward_reason(config: BwdConfig, head_dim: int) -> str | None:
    """`is_supported` for the warp-specialized backward's shape."""
    columns = swizzled_head_dim(head_dim)
    if config.block_m != WS_BWD_BLOCK_M:
        return f"block_m={config.block_m} is not {WS_BWD_BLOCK_M} (warp-specialized backward: query tiles of 64 rows)"
    if (config.block_m_dq, config.block_n_dq) != (config.block_m, config.block_n):
        return (f"block_m_dq x block_n_dq = {config.block_m_dq}x{config.block_n_dq} is not block_m x block_n = "
                f"{config.block_m}x{config.block_n} (warp-specialized backward: the dQ shares are its tiles)")
    if _is_transposed_shape(config):
        if columns != TRANSPOSED_BWD_COLUMNS:
            return (f"{config.block_n} keys on {config.num_warps} warps is the transposed warp-specialized backward, "
                    f"which runs head dims 136-{TRANSPOSED_BWD_COLUMNS} (head_dim={head_dim})")
        if config.kv_group:
            return "kv_group=1 is not a knob of the transposed warp-specialized backward (head dims 136-192)"
        return _stages_reason(config)
    if columns not in (64, 128):
        return (f"head_dim={head_dim} is over {WGMMA_BWD_MAX_HEAD_DIM} (warp-specialized backward: tiles of 64 or "
                f"128 columns; head dims 136-{TRANSPOSED_BWD_COLUMNS} run block_n in {TRANSPOSED_BWD_BLOCK_N} on "
                f"{TRANSPOSED_BWD_WARPS} warps)")
    if not _splits_head_dim(config, head_dim):
        return (f"head_dim={head_dim} runs on tiles of {columns} columns, which do not split into 64-column blocks "
                f"among block_n / 64 = {config.block_n // 64} consumer warpgroups (warp-specialized backward: their "
                f"dQ products)")
    return _stages_reason(config)


def check_aligned(name: str, t: torch.Tensor) -> None:
    """`check_rows` of a tensor: its strides and its address modulo 16."""
    check_rows(name, t.stride(), t.data_ptr() % 16)


def check_rows(name: str, stride: tuple[int, ...], offset: int) -> None:
    """Raises ValueError unless each row of the head dim starts on a 16-byte boundary (`offset`:
    the data's address modulo 16): cp.async and TMA move 16-byte chunks."""
    if offset or any(s % 8 for s in stride[:3]):
        raise ValueError(f"{name}: the cuda backend needs rows on 16-byte boundaries, got strides "
                         f"{tuple(stride)} at offset {offset}")


def element_name(dtype: torch.dtype) -> str:
    """The kernels' name for the query's dtype ("bf16", "fp16"); TypeError for any other."""
    if dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"query: the cuda backend runs fp16 and bf16, got {dtype}")
    return "bf16" if dtype == torch.bfloat16 else "fp16"


def check_query(q: torch.Tensor) -> None:
    """Raises unless the query is a CUDA tensor (or a data-less one of a plan for a stamp) of a
    dtype the kernels run."""
    planning = q.device.type == "meta" and target.planned_arch() is not None  # data-less tensors of a plan
    if q.device.type != "cuda" and not planning:
        raise ValueError(f"query: the cuda backend runs on CUDA tensors, got device {q.device}")
    element_name(q.dtype)


def check_config(config, q, k, mask, bias, is_causal: bool, softcap: float, bias_requires_grad: bool) -> None:
    """Raises ValueError when `config` cannot run this call's shape (`is_supported`)."""
    batch, seqlen_q, num_heads, head_dim = q.shape
    reason = is_supported(config, AttentionShape(
        batch=batch, seqlen_q=seqlen_q, seqlen_k=k.shape[1], num_heads=num_heads, num_heads_kv=k.shape[2],
        head_dim=head_dim, is_causal=is_causal, has_mask=mask is not None, has_bias=bias is not None,
        bias_requires_grad=bias_requires_grad, softcap=softcap))
    if reason:
        raise ValueError(f"config: {reason}")

