"""The -D list of the CUDA variant a call needs (`variant`, `backward_variant`), and how the
warp-specialized kernels stage a call's mask and bias through TMA (`staged_tiles`, `staging`).

The -D list is all a launch compiles to: a table entry's stamp hashes the source these flags
specialise (`build.defines` turns them into nvcc's -D options).
"""

from __future__ import annotations

import torch

from dmattn_kernels.configs import BwdConfig, FwdConfig
from dmattn_kernels.cuda.build import defines
from dmattn_kernels.cuda.rules import (backward_warp_specialized, element_name, knob_reason, padded_head_dim,
                                       swizzled_head_dim, transposed_backward, uses_wgmma, warp_specialized)
from dmattn_kernels.cuda.shared_memory import (NOT_STAGED, TILES_OF_KEYS, TILES_OF_ROWS, backward_score_stages,
                                               score_stages)
from dmattn_kernels.runtime.operands import padded

def _features(bias_dtype: torch.dtype | None, is_causal: bool, has_mask: bool, softcap: float) -> dict[str, bool]:
    return dict(bias_fp32=bias_dtype == torch.float32, is_causal=is_causal, has_mask=has_mask,
                has_bias=bias_dtype is not None, has_softcap=softcap > 0)


def _swizzle_padding(head_dim: int) -> dict[str, bool]:
    """A warp-specialized kernel's SWIZZLE_PADDED define (common.cuh: tiles of whole swizzle lines)
    where `head_dim` padded to the mma k-step is not such a width; absent elsewhere, so every
    other variant keeps its code, and its stamp."""
    return {"SWIZZLE_PADDED": True} if swizzled_head_dim(head_dim) != padded_head_dim(head_dim) else {}


def variant(config: FwdConfig, head_dim: int, dtype: torch.dtype, bias_dtype: torch.dtype | None, *, arch: str,
            is_causal: bool, has_mask: bool, softcap: float, mask_tiles: int = TILES_OF_ROWS,
            bias_tiles: int = TILES_OF_ROWS, window: bool = False, packed: bool = False) -> tuple[str, ...]:
    """The -D list of the forward variant a call needs on `arch` ("sm90"). The warp-specialized
    forward stages the mask and a 16-bit bias in shared memory where there is room, as the call's
    operands allow (`mask_tiles`, `bias_tiles`: `staged_tiles`). Its knobs, where on, add
    FWD_OVERLAP and FWD_PERSISTENT, a sliding window (`window`) HAS_WINDOW and packed sequences
    (`packed`: no mask or bias of query rows, the caller's check, `backward_packed_reason`)
    PACKED; a knob or feature off adds nothing, so its variant is the code it was added to.

    Raises:
        ValueError: a knob on for a config that is not the warp-specialized forward on `arch`, a
            window or packed sequences for one that is not its overlapped kernel (`window_reason`,
            `forward_packed_reason`).
    """
    reason = window_reason(config, head_dim, arch) if window else None
    reason = reason or (forward_packed_reason(config, head_dim, arch) if packed else None)
    if reason:
        raise ValueError(f"config: {reason}")
    own = dict(BLOCK_M=config.block_m, BLOCK_N=config.block_n)
    if warp_specialized(config, head_dim, arch):
        stages, mask_tiles, bias_tiles = staging(config, head_dim, has_mask, bias_dtype, mask_tiles, bias_tiles)
        own.update(WGMMA=True, SCORE_STAGES=stages, MASK_TILES=mask_tiles, BIAS_TILES=bias_tiles)
        own.update(_swizzle_padding(head_dim))
        own.update({name: True for name, on in (("FWD_OVERLAP", config.overlap), ("FWD_PERSISTENT", config.persistent),
                                                ("FWD_TMA_STORE", config.tma_store), ("HAS_WINDOW", window),
                                                ("PACKED", packed)) if on})
    elif config.knobs_on():
        reason = knob_reason(config) or ("overlap, persistent and tma_store: knobs of the warp-specialized forward, "
                                         "on sm90 only")
        raise ValueError(f"config: {reason} (here: {arch})")
    else:
        own.update(WGMMA=uses_wgmma(config, head_dim, arch))
    return defines(element_name(dtype), head_dim, config.num_warps, config.num_stages,
                   **_features(bias_dtype, is_causal, has_mask, softcap), **own)


def window_reason(config: FwdConfig, head_dim: int, arch: str | None) -> str | None:
    """Why `config`'s CUDA forward runs no sliding window on `arch`, or None: only the overlapped
    warp-specialized forward (one item per CTA or persistent) walks a window's key tiles
    (flash_fwd_ws.cu)."""
    if warp_specialized(config, head_dim, arch) and config.overlap:
        return None
    return (f"a sliding window runs in the CUDA forward's overlapped warp-specialized kernel only (sm90, "
            f"block_m / 16 + 4 warps, overlap=1), not {config.to_dict()} on {arch}")


def forward_packed_reason(config: FwdConfig, head_dim: int, arch: str | None) -> str | None:
    """Why `config`'s CUDA forward runs no packed call on `arch`, or None: only the overlapped
    warp-specialized forward (one item per CTA or persistent) walks a sequence's rows
    (flash_fwd_ws.cu), and not with tma_store (a box of out would write the next sequence's rows)."""
    if config.tma_store:
        return "a packed call writes its sequences' rows one by one: tma_store=1 stores boxes of 64 rows"
    if warp_specialized(config, head_dim, arch) and config.overlap:
        return None
    return (f"a packed call runs in the CUDA forward's overlapped warp-specialized kernel only (sm90, "
            f"block_m / 16 + 4 warps, overlap=1), not {config.to_dict()} on {arch}")


def backward_feature_reason(config: BwdConfig, head_dim: int, arch: str | None, feature: str) -> str | None:
    """Why `config`'s CUDA backward runs no call with `feature` ("a sliding window", "a packed
    call") on `arch`, or None: only the warp-specialized backward walks a window's query tiles
    and a sequence's keys (flash_bwd_ws.cu), and not in its transposed layout (head dims 136-192)."""
    if transposed_backward(config, head_dim, arch):
        return (f"{feature} does not run in the CUDA backward's transposed warp-specialized layout (head dims "
                f"136-192: {config.to_dict()})")
    if backward_warp_specialized(config, head_dim, arch):
        return None
    return (f"{feature} runs in the CUDA backward's warp-specialized kernel only (sm90, "
            f"block_n / 16 + 4 warps), not {config.to_dict()} on {arch}")


def backward_packed_reason(mask_has_rows: bool, bias_has_rows: bool) -> str | None:
    """Why the warp-specialized kernels run no call of packed sequences whose mask or bias has
    query rows (`mask_has_rows`, `bias_has_rows`), or None: they read a mask and bias of one row
    of keys (per key, or none) at the sequence's keys, and no operand of a sequence's rows."""
    if mask_has_rows or bias_has_rows:
        return ("the CUDA kernels run packed sequences with a per-key mask and bias only (or none; the Triton "
                "kernels run every layout)")
    return None


def staging(config: FwdConfig, head_dim: int, has_mask: bool, bias_dtype: torch.dtype | None, mask_tiles: int,
            bias_tiles: int) -> tuple[int, int, int]:
    """(score ring slots, MASK_TILES, BIAS_TILES) of a warp-specialized call whose operands allow
    `mask_tiles` and `bias_tiles`: only a 16-bit bias is staged, and nothing where no slot fits."""
    mask_tiles = mask_tiles if has_mask else NOT_STAGED
    bias_tiles = bias_tiles if bias_dtype in (torch.float16, torch.bfloat16) else NOT_STAGED
    stages = score_stages(config, head_dim, mask_tiles, bias_tiles)
    return (stages, mask_tiles, bias_tiles) if stages else (0, NOT_STAGED, NOT_STAGED)


def staged_tiles(t: torch.Tensor | None, seqlen_q: int) -> int:
    """How the warp-specialized forward can stage the mask or bias `t` (up to 4 dims, read as the
    4-D view it broadcasts as) through TMA: its (query, key) tiles (TILES_OF_ROWS), one row of
    keys per tile (TILES_OF_KEYS: no query dim), or not at all (NOT_STAGED: no operand, a
    broadcast key dim, keys not contiguous, or rows and slices off 16-byte boundaries)."""
    if t is None or t.data_ptr() % 16:
        return NOT_STAGED
    shape, strides = padded(t.shape, t.stride())
    return staged_layout(shape, strides, t.element_size(), seqlen_q)


def staged_layout(shape: tuple, stride: tuple, itemsize: int, seqlen_q: int) -> int:
    """`staged_tiles` of an operand whose data starts on a 16-byte boundary."""
    if shape[2] not in (1, seqlen_q) or shape[3] == 1 or stride[3] != 1:
        return NOT_STAGED
    if not all(shape[i] == 1 or (stride[i] > 0 and stride[i] * itemsize % 16 == 0) for i in range(3)):
        return NOT_STAGED
    return TILES_OF_KEYS if shape[2] == 1 else TILES_OF_ROWS


def backward_staging(config: BwdConfig, head_dim: int, has_mask: bool, bias_dtype: torch.dtype | None,
                     mask_tiles: int, bias_tiles: int) -> tuple[int, int, int]:
    """(score ring slots, MASK_TILES, BIAS_TILES) of a warp-specialized backward call whose
    operands allow `mask_tiles` and `bias_tiles` (`staged_tiles`): tiles of rows staged where
    the ring fits (a bias only if 16-bit), a row of keys read into registers; with `kv_group`
    (whose ring would be per query head) no tiles of rows; in the transposed layout none."""
    if transposed_backward(config, head_dim, "sm90"):  # its consumers read the mask and bias from global memory
        return 0, NOT_STAGED, NOT_STAGED
    mask_tiles = mask_tiles if has_mask else NOT_STAGED
    bias_tiles = bias_tiles if bias_dtype is not None else NOT_STAGED
    if config.kv_group:
        mask_tiles, bias_tiles = (NOT_STAGED if tiles == TILES_OF_ROWS else tiles for tiles in (mask_tiles, bias_tiles))
    if bias_tiles == TILES_OF_ROWS and bias_dtype not in (torch.float16, torch.bfloat16):
        bias_tiles = NOT_STAGED
    stages = backward_score_stages(config, head_dim, mask_tiles, bias_tiles)
    if not stages:  # no room: tiles of rows from global memory
        mask_tiles, bias_tiles = (NOT_STAGED if tiles == TILES_OF_ROWS else tiles for tiles in (mask_tiles, bias_tiles))
    return stages, mask_tiles, bias_tiles


def stores_dbias_by_tma(config: BwdConfig, head_dim: int, arch: str, dbias: tuple[bool, torch.dtype] | None,
                        dtype: torch.dtype, softcap: float, target_allows: bool) -> bool:
    """Whether `config`'s warp-specialized backward stores dBias from its staged dS tiles by TMA: a
    target with query rows in the input dtype whose layout allows (`target_allows`), no softcap
    (dS is dBias), and a CTA per query head staging its dS tiles (not `kv_group`, not the
    transposed layout)."""
    return (dbias is not None and dbias[0] and dbias[1] == dtype and softcap <= 0 and target_allows
            and not config.kv_group and not transposed_backward(config, head_dim, arch))


def backward_variant(config: BwdConfig, head_dim: int, dtype: torch.dtype, bias_dtype: torch.dtype | None, *,
                     arch: str, is_causal: bool, has_mask: bool, softcap: float, group: int,
                     dbias: tuple[bool, torch.dtype] | None, mask_tiles: int = TILES_OF_ROWS,
                     bias_tiles: int = TILES_OF_ROWS, dbias_tma: bool = True, window: bool = False,
                     packed: bool = False) -> tuple[str, ...]:
    """The -D list of the backward variant a call needs on `arch`; `dbias` is (rows, target
    dtype) of the dBias target (`backward._dbias_layout`) or None without dBias. The warp-specialized
    backward stages the mask and bias as the call's operands allow (`mask_tiles`, `bias_tiles`:
    `staged_tiles`; by default tiles of rows), and stores dBias rows of the input dtype by TMA
    where the target's layout allows (`dbias_tma`) and dS is dBias (no softcap); a sliding window
    (`window`) adds HAS_WINDOW, packed sequences (`packed`: no mask or bias of query rows, the
    caller's check, `backward_packed_reason`) PACKED, the knob `kv_group` BWD_KV_GROUP (dK
    and dV summed over the group in the kernel: not DKV_FP32; no staged tiles, no dBias by TMA),
    and the knob `nondeterministic_dq` BWD_DQ_UNORDERED.
    The transposed layout (`rules.transposed_backward`) adds DKV_TRANSPOSED and stages nothing:
    the mask and bias from global memory, dBias stored by its threads.

    Raises:
        ValueError: a window or packed sequences for a config that is not the warp-specialized
            backward on `arch`.
    """
    reason = None
    for feature, on in (("a sliding window", window), ("a packed call", packed)):
        reason = reason or (backward_feature_reason(config, head_dim, arch, feature) if on else None)
    if reason:
        raise ValueError(f"config: {reason}")
    rows, target_dtype = dbias if dbias is not None else (False, torch.float32)
    if backward_warp_specialized(config, head_dim, arch):
        stages, mask_tiles, bias_tiles = backward_staging(config, head_dim, has_mask, bias_dtype, mask_tiles,
                                                          bias_tiles)
        own = dict(BLOCK_M=config.block_m, BLOCK_N=config.block_n, WGMMA=True, SCORE_STAGES=stages,
                   MASK_TILES=mask_tiles, BIAS_TILES=bias_tiles,
                   DBIAS_TMA=stores_dbias_by_tma(config, head_dim, arch, dbias, dtype, softcap, dbias_tma))
        own.update(_swizzle_padding(head_dim))
        own.update({name: True for name, on in (("HAS_WINDOW", window), ("PACKED", packed),
                                                ("BWD_KV_GROUP", config.kv_group),
                                                ("BWD_DQ_UNORDERED", config.nondeterministic_dq),
                                                ("DKV_TRANSPOSED", transposed_backward(config, head_dim, arch))) if on})
    else:
        own = dict(DKDV_BLOCK_M=config.block_m, DQ_BLOCK_N=config.block_n_dq, WGMMA=uses_wgmma(config, head_dim, arch))
    return defines(element_name(dtype), head_dim, config.num_warps, config.num_stages,
                   **_features(bias_dtype, is_causal, has_mask, softcap), HAS_DBIAS=dbias is not None,
                   DBIAS_ROWS=rows, DBIAS_FP32=target_dtype == torch.float32,
                   DKV_FP32=group > 1 and not config.kv_group, **own)
