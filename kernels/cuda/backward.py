"""The CUDA backward's launches: delta, dK/dV and dQ (flash_bwd.cu), or the warp-specialized
backward's delta, one dK/dV/dQ kernel and its dQ cast (flash_bwd_ws.cu); then the GQA groups'
dK and dV summed and dBias reduced into the bias's shape where the kernel could not write it.

Two steps run on the host between and after the launches, as torch ops on the launches' stream:
the lse gradient folded into delta (`delta_with_lse_grad`) and the dBias partials summed into the
bias's broadcast shape (`finish_dbias`). The Triton backward does both in its own kernels
(`flash_bwd_preprocess_kernel`, `grad_reduce_kernel`).
"""

from __future__ import annotations

import torch
import triton

from dmattn_kernels.configs import BwdConfig, Packing
from dmattn_kernels.cuda.driver import KEYS_OF, ROWS_OF, TMA_LINE, Launcher, arch_of, the_driver
from dmattn_kernels.cuda.forward import kernel_window_sides, section_slices, sequence_fields
from dmattn_kernels.cuda.params import BwdParams, WindowedBwdParams, bwd_ws_params_type, inputs, with_window
from dmattn_kernels.cuda.rules import (backward_kernel, check_aligned, check_arch, check_config, check_query,
                                       tile_columns)
from dmattn_kernels.cuda.shared_memory import NOT_STAGED, TILES_OF_ROWS, backward_shared_bytes
from dmattn_kernels.cuda.variants import (backward_packed_reason, backward_staging, backward_variant, staged_tiles,
                                          stores_dbias_by_tma)
from dmattn_kernels.runtime.launch_context import is_compile_only
from dmattn_kernels.runtime.operands import NO_OPERAND_STRIDES, broadcast_strides

DELTA_UNROLL = 4  # bwd_steps.cuh's: rows of delta per lane group of a warp
DQ_CAST_ROWS = 4  # flash_bwd_ws.cu's DQ_ROWS: rows of dQ per thread of its dQ kernel


class _PartialSum:
    """dBias from the kernel's fp32 partials (`partial_shape`): one sum over the query heads of
    each GQA group and every dim the bias broadcasts, in a fixed order (deterministic), then the
    cast into dbias. The partials are read as (B, bias heads, heads per bias head, rows, keys)."""

    def __init__(self, partial_shape: tuple[int, ...], dbias_shape: tuple[int, ...]):
        batch, heads, rows, keys = partial_shape
        group = heads // dbias_shape[1]
        self.view = (batch, dbias_shape[1], group, rows, keys)
        target = (dbias_shape[0], dbias_shape[1], 1, dbias_shape[2], dbias_shape[3])
        self.dims = tuple(dim for dim, (size, kept) in enumerate(zip(self.view, target)) if size != kept)

    def __call__(self, partial: torch.Tensor, dbias: torch.Tensor) -> None:
        summed = partial.view(self.view)
        if self.dims:
            summed = summed.sum(dim=self.dims, keepdim=True)
        dbias.copy_(summed.view(dbias.shape))


def finish_dbias(partial: torch.Tensor, dbias: torch.Tensor) -> None:
    """`_PartialSum` for one call: the dBias partials of the dK/dV kernel summed into dbias."""
    _PartialSum(tuple(partial.shape), tuple(dbias.shape))(partial, dbias)


def delta_with_lse_grad(delta: torch.Tensor, dlse: torch.Tensor | None, lse: torch.Tensor) -> None:
    """delta - dlse in place, a dead row's dlse dropped (the kernels compute delta without it)."""
    if dlse is not None:
        delta.sub_(torch.where(lse == float("-inf"), 0.0, dlse))


def has_broadcast_dim(t: torch.Tensor) -> bool:
    """Whether a dim of more than one element has stride 0 (an expanded tensor, such as the
    gradient of a mean over the query rows)."""
    return any(size > 1 and stride == 0 for size, stride in zip(t.shape, t.stride()))


def _dbias_layout(dbias: torch.Tensor, batch: int, num_heads: int, seqlen_q: int, seqlen_k: int):
    """Where the dK/dV kernel writes dBias: (shape, rows, in_place). The target is (B, H, Lq, Lk)
    for a bias with a query dim, else (B, H, 1, Lk) (each key's dS summed over its queries in the
    kernel); it is `dbias` itself when the shapes agree (in_place), else an fp32 buffer the
    launcher reduces into `dbias`."""
    rows = dbias.shape[2] != 1
    shape = (batch, num_heads, seqlen_q if rows else 1, seqlen_k)
    return shape, rows, tuple(dbias.shape) == shape and dbias.is_contiguous()


def attention_backward(dout, q, k, v, out, lse, mask, bias, *, is_causal: bool, softmax_scale: float, softcap: float,
                       config: BwdConfig, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor,
                       dbias: torch.Tensor | None, dlse: torch.Tensor | None = None,
                       window: tuple[int, int] = (-1, -1), packing: Packing | None = None,
                       sequences: tuple = (None, None, None)) -> None:
    """Writes dq, dk, dv and, when given, dbias (the bias's 4-D broadcast shape and its dtype);
    `dlse`, a gradient reaching lse, as in the Triton launcher (folded into delta here:
    `delta_with_lse_grad`). The mask and bias as the caller passed them (up to 4 dims, as
    `attention_forward`'s); `window`: FlashAttention's (left, right) sliding window, which the
    warp-specialized backward runs (`variants.backward_feature_reason`), as it runs packed
    sequences (`packing`, `configs.Packing`: the tensors are one batch row; `sequences`:
    cu_seqlens_q, cu_seqlens_k and seqused_k or None) with a per-key mask and bias or none
    (`variants.backward_packed_reason`). Rows and keys no sequence owns get zero gradients."""
    batch, seqlen_q, num_heads, head_dim = q.shape
    seqlen_k, num_heads_kv = k.shape[1], k.shape[2]
    group = num_heads // num_heads_kv
    window_sides = kernel_window_sides(window, is_causal, q.shape, seqlen_k)
    has_window = window_sides is not None
    check_query(q)
    check_config(config, q, k, mask, bias, is_causal, softcap, dbias is not None)
    if packing is not None:
        reason = backward_packed_reason(mask is not None and not packing.mask_per_key,
                                        bias is not None and not packing.bias_per_key)
        if reason:
            raise ValueError(f"config: {reason}")
    arch = arch_of(q.device)
    check_arch(config, head_dim, arch)
    source = backward_kernel(config, head_dim, arch)
    if source == "bwd_ws" and has_broadcast_dim(dout):
        dout = dout.contiguous()  # its tensor map takes no stride-0 dim: a copy of the incoming gradient
    for name, t in (("query", q), ("key", k), ("value", v), ("out", out), ("grad_out", dout), ("dq", dq),
                    ("dk", dk), ("dv", dv)):
        check_aligned(name, t)
    layout = None if dbias is None else _dbias_layout(dbias, batch, num_heads, seqlen_q, seqlen_k)
    bias_dtype = bias.dtype if bias is not None else None
    staging = (0, NOT_STAGED, NOT_STAGED)
    if source == "bwd_ws":
        staging = backward_staging(config, head_dim, mask is not None, bias_dtype, staged_tiles(mask, seqlen_q),
                                   staged_tiles(bias, seqlen_q))
    target_kind = None if layout is None else (layout[1], dbias.dtype if layout[2] else torch.float32)
    # a TMA store needs the target in place (`_dbias_layout`) and on 16-byte boundaries
    target_allows = layout is not None and layout[2] and staged_tiles(dbias, seqlen_q) == TILES_OF_ROWS
    flags = backward_variant(config, head_dim, q.dtype, bias_dtype, arch=arch, is_causal=is_causal,
                             has_mask=mask is not None, softcap=softcap, group=group, dbias=target_kind,
                             mask_tiles=staging[1], bias_tiles=staging[2], dbias_tma=target_allows,
                             window=has_window, packed=packing is not None)
    launcher = Launcher(source, q.device, flags)
    if is_compile_only():
        return
    stored_by_tma = source == "bwd_ws" and stores_dbias_by_tma(config, head_dim, arch, target_kind, q.dtype, softcap,
                                                               target_allows)
    target = None
    if stored_by_tma:  # the warp-specialized kernel writes every element, the zeros the causal rule skips too
        target = dbias
    elif layout is not None:  # zeroed: tiles the causal rule skips are never written
        shape, _, in_place = layout
        target = dbias.zero_() if in_place else torch.zeros(shape, dtype=torch.float32, device=dbias.device)
    delta = torch.empty((batch, num_heads, seqlen_q), dtype=torch.float32, device=q.device)
    # packed: the rows and keys no sequence owns (or past seqused_k) are written by no block
    allocate = torch.empty if packing is None else torch.zeros
    shares = group > 1 and not config.kv_group
    if shares:  # each query head's share, summed per group below (fixed order: deterministic)
        dk_share = allocate((batch, seqlen_k, num_heads, head_dim), dtype=torch.float32, device=q.device)
        dv_share = allocate(dk_share.shape, dtype=torch.float32, device=q.device)
    else:
        dk_share, dv_share = (dk, dv) if packing is None else (dk.zero_(), dv.zero_())
    if packing is not None:
        dq.zero_()
    call_inputs = inputs(q, k, v, mask, bias, softmax_scale, softcap)
    if has_window:
        call_inputs = with_window(call_inputs, window_sides)
    params = (WindowedBwdParams if has_window else BwdParams)(
        call_inputs, out.data_ptr(), dout.data_ptr(), lse.data_ptr(), delta.data_ptr(), dq.data_ptr(),
        dk_share.data_ptr(), dv_share.data_ptr(), target.data_ptr() if target is not None else 0,
        out.stride()[:3], dout.stride()[:3], dq.stride()[:3], dk_share.stride()[:3], dv_share.stride()[:3],
        lse.stride(), delta.stride(),
        NO_OPERAND_STRIDES if target is None else broadcast_strides(target.shape, target.stride()),
    )
    heads = batch * num_heads
    shared = backward_shared_bytes(config, head_dim, arch, staging[1], staging[2])
    if source == "bwd_ws":
        _run_warp_specialized_backward(launcher, config, params, shared["ws"], q, k, v, dout, delta, dlse, lse,
                                       is_causal, window_sides,
                                       mask if staging[1] == TILES_OF_ROWS else None,
                                       bias if staging[2] == TILES_OF_ROWS else None,
                                       target if stored_by_tma else None, packing, sequences)
    else:
        delta_rows = delta_rows_per_block(tile_columns(config, head_dim, arch), config.num_warps)
        launcher(b"dmattn_bwd_delta_kernel", (triton.cdiv(seqlen_q, delta_rows), heads), config.num_warps, 0, params)
        delta_with_lse_grad(delta, dlse, lse)  # on the launches' stream (the current one), between them
        launcher(b"dmattn_bwd_dkdv_kernel", (heads, triton.cdiv(seqlen_k, config.block_n)), config.num_warps,
                 shared["dkdv"], params)
        launcher(b"dmattn_bwd_dq_kernel", (heads, triton.cdiv(seqlen_q, config.block_m_dq)), config.num_warps,
                 shared["dq"], params)
    if shares:
        dk.copy_(dk_share.unflatten(2, (num_heads_kv, group)).sum(3))
        dv.copy_(dv_share.unflatten(2, (num_heads_kv, group)).sum(3))
    if target is not None and target is not dbias:
        finish_dbias(target, dbias)


def delta_rows_per_block(columns: int, num_warps: int) -> int:
    """Query rows of one CTA of the backward's delta kernels (bwd_steps.cuh: DELTA_ROWS_PER_BLOCK)
    on tiles of `columns` (`rules.tile_columns`): a lane per 16-byte chunk of a row, lane groups a
    power of two, DELTA_UNROLL rows a group."""
    chunks = columns // 8
    return num_warps * 32 // (1 << (chunks - 1).bit_length()) * DELTA_UNROLL


def unvisited_query_tiles(seqlen_q: int, seqlen_k: int, block_m: int, is_causal: bool,
                          window_sides: tuple[int, int] | None = None) -> int:
    """The leading query tiles of the warp-specialized backward that no key block visits: under
    the causal rule, tiles whose rows all come before the first row that sees a key (row
    Lq - Lk), which exist when Lq - Lk >= block_m; under a window's bounded right side (not
    causal), before row Lq - Lk - right. Their dQ sums are never stored. (A window's left side
    leaves no row without keys: row i < Lq sees key i + Lk - Lq - left < Lk at the latest.)"""
    if is_causal:
        return max(0, seqlen_q - seqlen_k) // block_m
    if window_sides is None:
        return 0
    return max(0, seqlen_q - seqlen_k - window_sides[1]) // block_m


def packed_head_tiles(total_q: int, block_m: int, sequences: int) -> int:
    """The dQ sums' tiles of one query head in a packed call of the warp-specialized backward:
    sequence s's start at cu_seqlens_q[s] // block_m + s (flash_bwd_ws.cu: sequence_tile), so
    they never overlap, and the last ends below cdiv(total_q, block_m) + sequences."""
    return triton.cdiv(total_q, block_m) + sequences


def _run_warp_specialized_backward(launcher: Launcher, config: BwdConfig, params: BwdParams, shared: int, q, k, v,
                                   dout, delta, dlse, lse, is_causal: bool, window_sides, staged_mask, staged_bias,
                                   dbias_target, packing: Packing | None = None, sequences=(None, None, None)) -> None:
    """flash_bwd_ws.cu's three launches: delta (and the dQ counters zeroed), the kernel, dQ from
    its summed shares. The sums are not zeroed: each tile's first share is stored, not added;
    only the tiles no key block visits (`unvisited_query_tiles`: rows that see no key, whose dQ
    is 0) are zeroed here. `window_sides`: a window's (left, right) as the kernel takes them, or
    None. `staged_mask` and `staged_bias` are the operands staged as tiles of rows, `dbias_target`
    the dBias the kernel stores by TMA (each None where not). Packed (`packing`, `sequences`):
    the head slices are sequences x heads, each walking the longest sequence's blocks; the dQ sums
    and counters are a query head's `packed_head_tiles`, the counters zeroed here, and the dQ
    kernel writes zeros for the tiles no block visits. With `config.kv_group` the kernel's slices
    are KV heads (BWD_KV_GROUP), each walking its group's query heads; the dQ kernel's stay query
    heads. With `config.nondeterministic_dq` every share is added, so every sum starts at zero:
    the delta kernel zeroes them, a packed call's here."""
    batch, seqlen_q, num_heads, head_dim = q.shape
    columns = tile_columns(config, head_dim, "sm90")  # the kernel's BLOCK_D: D80 and D96 on tiles of 128
    heads_per_cta = num_heads // k.shape[2] if config.kv_group else 1  # a KV group's query heads, or one
    if packing is None:
        slices, rows, keys = batch * num_heads, seqlen_q, k.shape[1]
        tiles = (slices, triton.cdiv(seqlen_q, config.block_m))
        dq_sum = torch.empty((*tiles, config.block_m * columns), dtype=torch.float32, device=q.device)
        if not config.nondeterministic_dq:  # with it the delta kernel zeroes every sum
            dq_sum[:, :unvisited_query_tiles(seqlen_q, k.shape[1], config.block_m, is_causal, window_sides)].zero_()
        dq_counter = torch.empty(tiles, dtype=torch.int32, device=q.device)  # the delta kernel zeroes them
    else:
        slices, rows, keys = packing.num_sequences * num_heads, packing.max_seqlen_q, packing.max_seqlen_k
        if slices == 0 or rows == 0 or keys == 0:  # no sequence, or every one empty: dQ, dK, dV stay zero
            return
        tiles = (num_heads, packed_head_tiles(seqlen_q, config.block_m, packing.num_sequences))
        allocate = torch.zeros if config.nondeterministic_dq else torch.empty  # every share is added
        dq_sum = allocate((*tiles, config.block_m * columns), dtype=torch.float32, device=q.device)
        dq_counter = torch.zeros(tiles, dtype=torch.int32, device=q.device)
    driver = the_driver()
    maps = {name: driver.tensor_map(t, ROWS_OF, box_rows, TMA_LINE, TMA_LINE)
            for name, t, box_rows in (("q_map", q, config.block_m), ("k_map", k, config.block_n),
                                      ("v_map", v, config.block_n), ("do_map", dout, config.block_m))}
    mask_line = min(config.block_n, TMA_LINE)
    if staged_mask is not None:  # a box of block_n bytes a row
        maps["mask_map"] = driver.tensor_map(staged_mask, KEYS_OF, config.block_m, mask_line, mask_line)
    for name, t in (("bias_map", staged_bias), ("dbias_map", dbias_target)):  # boxes of 128-byte lines
        if t is not None:
            maps[name] = driver.tensor_map(t, KEYS_OF, config.block_m, TMA_LINE, TMA_LINE)
    # Q and dO (TMA reads no column past the head dim) and the fp32 dQ sums of a kernel slice: its query heads'
    reread_bytes = heads_per_cta * rows * (2 * head_dim * q.element_size() + 4 * columns)
    packed = {} if packing is None else dict(sequence_fields(packing, sequences), head_tiles=tiles[1])
    ws_params = bwd_ws_params_type(window_sides is not None, packing is not None)(
        backward=params, dq_sum=dq_sum.data_ptr(), dq_counter=dq_counter.data_ptr(),
        section_slices=section_slices(slices // heads_per_cta, reread_bytes), **maps, **packed)
    delta_rows = delta_rows_per_block(columns, config.num_warps)
    launcher(b"dmattn_bwd_ws_delta_kernel", (triton.cdiv(seqlen_q, delta_rows), batch * num_heads), config.num_warps,
             0, ws_params)
    delta_with_lse_grad(delta, dlse, lse)
    launcher(b"dmattn_bwd_ws_kernel", (slices // heads_per_cta, triton.cdiv(keys, config.block_n)), config.num_warps,
             shared, ws_params)
    pairs = triton.cdiv(rows, DQ_CAST_ROWS) * columns // 2  # a thread per two columns of DQ_CAST_ROWS rows
    launcher(b"dmattn_bwd_ws_dq_kernel", (triton.cdiv(pairs, 32 * config.num_warps), slices), config.num_warps, 0,
             ws_params)
