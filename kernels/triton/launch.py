"""Launchers for the Triton kernels: explicit configs in, preallocated outputs filled.

Callers (the autograd wrapper, the validator, the tuner) own allocation, so the validator can
hand in NaN-poisoned buffers and check that every element was written. Inputs arrive already
checked by `dmattn_bench.api`: q (B, Lq, H, D), k/v (B, Lk, Hkv, D) with a contiguous head dim,
mask/bias as 4-D views (B|1, H|Hkv|1, Lq|1, Lk|1) or None. Nothing here copies or pads them.
"""

from __future__ import annotations

import dataclasses
import threading
from contextlib import contextmanager

import torch
import triton
from triton.runtime.errors import OutOfResources
from triton.tools.tensor_descriptor import TensorDescriptor

from dmattn_bench.space import AttentionShape, BwdConfig, FwdConfig
from dmattn_kernels.triton.activity import CELL, WORD_BYTES, block_list_kernel, tile_activity_kernel
from dmattn_kernels.triton.flash_bwd import (
    flash_bwd_dkdv_kernel,
    flash_bwd_dq_from_ds_kernel,
    flash_bwd_dq_kernel,
    flash_bwd_preprocess_kernel,
)
from dmattn_kernels.triton.flash_fwd import flash_fwd_kernel

_MODE = threading.local()  # compile-only switch of the current thread (see `compile_only`)
_FITTED_FWD: dict[tuple, FwdConfig] = {}  # forward tiles `fitting_forward_config` learned

MAX_HEAD_DIM = 256  # the largest head dim whose fp32 accumulator tile fits the register file
MIN_BLOCK = CELL  # tl.dot needs every tile dim >= 16; the activity cells are that size
MAX_BLOCK = 256
WARP_CHOICES = (1, 2, 4, 8, 16)
MAX_STAGES = 8
PREPROCESS_BLOCK_M = 64  # delta = rowsum(dO * O) is memory-bound; any reasonable tile will do
ACTIVITY_BLOCK_M, ACTIVITY_BLOCK_N = 64, 256  # tile of the (memory-bound) activity pass; multiples of CELL
# Compute-capability majors whose forward loads K and V by bulk tensor copy (TMA descriptors).
# Measured only on sm90 (H200, flash_fwd._load_kv_tile); Blackwell has the copy engine too, but
# no sm100/sm120 GPU was available to show that it pays there.
TMA_ARCH_MAJORS = (9,)
LIST_CHUNK = 128  # tiles a block-list program pools per step (its cells: 16 x 128 x 16 at most)


@contextmanager
def compile_only():
    """Within this block the launchers compile their kernels (Triton's `warmup`) but launch none.

    The tuner compiles candidates in parallel worker processes this way: no candidate kernel
    ever runs there, so a config that faults on the GPU can only fault in the measuring worker,
    which is isolated and restarted.
    """
    previous = getattr(_MODE, "compile_only", False)
    _MODE.compile_only = True
    try:
        yield
    finally:
        _MODE.compile_only = previous


def is_compile_only() -> bool:
    return getattr(_MODE, "compile_only", False)


def _launch(kernel, grid, *args, **kwargs) -> None:
    if is_compile_only():
        kernel.warmup(*args, grid=grid, **kwargs)
    else:
        kernel[grid](*args, **kwargs)


def head_block(head_dim: int) -> int:
    """The power-of-two lane count covering `head_dim` (masked lanes handle the rest)."""
    return max(MIN_BLOCK, triton.next_power_of_2(head_dim))


def _check_block(name: str, value: int) -> str | None:
    if value < MIN_BLOCK or value > MAX_BLOCK or value & (value - 1):
        return f"{name}={value} is not a power of two in [{MIN_BLOCK}, {MAX_BLOCK}]"
    return None


def is_supported(config: FwdConfig | BwdConfig, shape: AttentionShape) -> str | None:
    """The reason `config` cannot run `shape`, or None when it can.

    Only structural limits live here; shared-memory and register fit per arch are pruned by
    cross-compilation in the tuner.
    """
    if shape.head_dim > MAX_HEAD_DIM or shape.head_dim % 8:
        return f"head_dim={shape.head_dim} is not a multiple of 8 in [8, {MAX_HEAD_DIM}]"
    if shape.num_heads % shape.num_heads_kv:
        return f"num_heads={shape.num_heads} is not a multiple of num_heads_kv={shape.num_heads_kv}"
    blocks = ["block_m", "block_n"] + (["block_m_dq", "block_n_dq"] if isinstance(config, BwdConfig) else [])
    for name in blocks:
        reason = _check_block(name, getattr(config, name))
        if reason:
            return reason
    if config.num_warps not in WARP_CHOICES:
        return f"num_warps={config.num_warps} is not one of {WARP_CHOICES}"
    if not 1 <= config.num_stages <= MAX_STAGES:
        return f"num_stages={config.num_stages} is not in [1, {MAX_STAGES}]"
    return None


def _broadcast_operand(t: torch.Tensor | None, num_heads: int, group: int, fallback: torch.Tensor):
    """Pointer, 4 strides and head divisor of a broadcast mask/bias view (stride 0 on size-1 dims).

    A head dim of H maps query head h to slice h; of Hkv (when H != Hkv) to slice h // group.
    """
    if t is None:
        return fallback, (0, 0, 0, 0), 1
    if t.dtype == torch.bool:
        t = t.view(torch.uint8)  # same itemsize: a reinterpretation, not a copy
    strides = _zero_size1_strides(t)
    head_div = group if (t.shape[1] != num_heads and t.shape[1] != 1) else 1
    return t, strides, head_div


def bias_per_key(strides: tuple[int, ...], bias: torch.Tensor | None) -> bool:
    """Whether the kernels read the bias as one value per key (`common.load_bias`): its query
    dim broadcasts (stride 0 in the (batch, head, query, key) `strides` of `_broadcast_operand`)."""
    return bias is not None and strides[2] == 0


def _zero_size1_strides(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(0 if size == 1 else stride for size, stride in zip(t.shape, t.stride()))


def mask_words_readable(mask: torch.Tensor) -> bool:
    """Whether `tile_activity_kernel` may read the mask's interior tiles as int64 words: its key
    dim is contiguous and every row starts 8-byte aligned (broadcast dims have stride 0)."""
    strides = _zero_size1_strides(mask)
    return (strides[3] == 1 and mask.element_size() == 1 and mask.data_ptr() % WORD_BYTES == 0
            and all(stride % WORD_BYTES == 0 for stride in strides[:3]))


def activity_shape(mask_shape, seqlen_q: int, seqlen_k: int) -> tuple[int, int, int, int]:
    """Shape of `tile_activity`'s summary for a 4-D mask of `mask_shape`."""
    return (mask_shape[0], mask_shape[1], triton.cdiv(seqlen_q, CELL), triton.cdiv(seqlen_k, CELL))


def tile_activity(mask: torch.Tensor, seqlen_q: int, seqlen_k: int, is_causal: bool,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """(Bm, Hm, ceil(Lq/CELL), ceil(Lk/CELL)) int8: 1 where a CELL x CELL cell of the mask's own
    batch and head slices holds a visible position (`activity.py`). One read of the mask.

    `out`, when given, is a buffer of that shape to fill (every element is written)."""
    mask_arg = mask.view(torch.uint8) if mask.dtype == torch.bool else mask
    batch_m, heads_m = mask.shape[0], mask.shape[1]
    shape = activity_shape(mask.shape, seqlen_q, seqlen_k)
    if out is None:
        out = torch.zeros(shape, dtype=torch.int8, device=mask.device)
    else:
        out.zero_()  # tiles past the causal diagonal are skipped by the kernel
    _launch(
        tile_activity_kernel,
        (triton.cdiv(seqlen_q, ACTIVITY_BLOCK_M), triton.cdiv(seqlen_k, ACTIVITY_BLOCK_N), batch_m * heads_m),
        mask_arg, out, *_zero_size1_strides(mask_arg), *out.stride(), heads_m, seqlen_q, seqlen_k,
        IS_CAUSAL=is_causal, BLOCK_M=ACTIVITY_BLOCK_M, BLOCK_N=ACTIVITY_BLOCK_N, CELL=CELL,
        WORDS=mask_words_readable(mask_arg), WORD=WORD_BYTES, num_warps=8,
    )
    return out


def block_lists(active: torch.Tensor, block_rows: int, block_cols: int, *, key_major: bool = False) -> torch.Tensor:
    """Per tile row, the tiles a kernel must visit: (Bm, Hm, rows, 1 + cols) int32, each row
    [count, index_0, ..., index_{count-1}, skipped indices...], active and skipped tiles each
    in increasing order (`activity.block_list_kernel`).

    `active` (from `tile_activity`) is pooled to (block_rows x block_cols) tiles of the
    (query x key) plane. key_major: one row per key tile listing query tiles (the dK/dV kernel).
    """
    batch_m, heads_m, cell_rows, cell_cols = active.shape
    rows, cols = block_rows // CELL, block_cols // CELL
    stride_b, stride_h, stride_r, stride_c = active.stride()
    if key_major:
        own, listed, own_cells, list_cells, stride_own, stride_list = cols, rows, cell_cols, cell_rows, stride_c, stride_r
    else:
        own, listed, own_cells, list_cells, stride_own, stride_list = rows, cols, cell_rows, cell_cols, stride_r, stride_c
    num_rows, num_tiles = triton.cdiv(own_cells, own), triton.cdiv(list_cells, listed)
    lists = torch.empty((batch_m, heads_m, num_rows, 1 + num_tiles), dtype=torch.int32, device=active.device)
    _launch(
        block_list_kernel, (num_rows, batch_m * heads_m),
        active, lists, stride_b, stride_h, stride_own, stride_list, *lists.stride()[:3],
        heads_m, own_cells, list_cells, num_tiles,
        OWN_CELLS=own, LIST_CELLS=listed, CHUNK=min(LIST_CHUNK, triton.next_power_of_2(num_tiles)), num_warps=4,
    )
    return lists


def kv_by_tma(k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the forward loads K and V through TMA descriptors: on a GPU of TMA_ARCH_MAJORS,
    when both meet the copy engine's alignment (16-byte base and strides); else pointer loads.

    A single key (Lk = 1) takes pointer loads: Triton turns an int argument equal to 1 into a
    constant, and with it the pipelined descriptor variant crashed Triton 3.6's ptxas (error
    -11; H200, adversarial case single_key_lk1, every config with num_stages > 1).
    """
    if not k.is_cuda or k.shape[1] == 1 or torch.cuda.get_device_capability(k.device)[0] not in TMA_ARCH_MAJORS:
        return False
    return all(t.data_ptr() % 16 == 0 and all(stride * t.element_size() % 16 == 0 for stride in t.stride()[:-1])
               for t in (k, v))


def kv_descriptors(k: torch.Tensor, v: torch.Tensor, block_n: int, block_d: int, use_tma: bool):
    """The forward's `k_desc, v_desc`: (B, Lk, Hkv, D) descriptors of (1, block_n, 1, block_d) tiles
    (zero-filled past Lk and D) when `use_tma`, else k and v themselves (unused pointers)."""
    if not use_tma:
        return k, v
    return tuple(TensorDescriptor(t, list(t.shape), list(t.stride()), [1, block_n, 1, block_d]) for t in (k, v))


def _block_list_args(blocks: torch.Tensor | None, fallback: torch.Tensor):
    """Pointer and (batch, head, row) strides of a block list; stride 0 on broadcast dims."""
    if blocks is None:
        return fallback, (0, 0, 0)
    return blocks, _zero_size1_strides(blocks)[:3]


def attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    bias: torch.Tensor | None,
    *,
    is_causal: bool,
    softmax_scale: float,
    softcap: float,
    config: FwdConfig,
    out: torch.Tensor,
    lse: torch.Tensor,
    activity: torch.Tensor | None = None,
) -> None:
    """Writes out (B, Lq, H, D) and lse (B, H, Lq) fp32 for one forward call, and, when a mask
    and an `activity` buffer (`activity_shape`) are given, the mask's tile activity into it, for
    the backward of the same call (`attention_backward`).

    An fp32 bias under 16-bit inputs runs `config` with key tiles halved until it fits the GPU's
    shared memory (`fitting_forward_config`)."""
    fp32_bias = bias is not None and bias.dtype == torch.float32 and q.dtype != torch.float32
    # what decides the kernel's shared memory beside the tiles (Triton specializes 16-divisible ints)
    if fp32_bias:
        fit_key = (config, q.dtype, q.device, q.shape[-1], mask is None, is_causal, softcap > 0,
                   _zero_size1_strides(bias), q.shape[1] % 16, k.shape[1] % 16)
        config = _FITTED_FWD.get(fit_key, config)
    while True:
        try:
            _forward(q, k, v, mask, bias, is_causal=is_causal, softmax_scale=softmax_scale, softcap=softcap,
                     config=config, out=out, lse=lse, activity=activity)
            return
        except OutOfResources:
            if not fp32_bias or config.block_n <= MIN_BLOCK:
                raise
            config = fitting_forward_config(config)
            _FITTED_FWD[fit_key] = config


def fitting_forward_config(config: FwdConfig) -> FwdConfig:
    """The forward tiles tried when `config` does not fit with an fp32 bias: key tiles halved.

    A table key has no bias dtype, so its config was tuned on a 16-bit bias, and an fp32 bias
    tile takes twice the shared memory per stage (sm90, Triton 3.6, D128: fwd 128x128 w8 s2 needs
    214016 B with a bf16 bias, 246784 B with an fp32 one, over the 232448 B limit). Halving the
    key tile keeps the pipeline: one stage instead (the other way to fit) ran W1 in 1.509 ms
    against 0.693 ms with the bf16 bias (H100, `results/bench/session12-h100-probe.txt`).
    `prune` checks that the halved tiles fit.
    """
    return dataclasses.replace(config, block_n=config.block_n // 2)


def _forward(q, k, v, mask, bias, *, is_causal, softmax_scale, softcap, config, out, lse, activity) -> None:
    batch, seqlen_q, num_heads, head_dim = q.shape
    seqlen_k, num_heads_kv = k.shape[1], k.shape[2]
    group = num_heads // num_heads_kv
    mask_arg, mask_strides, mask_head_div = _broadcast_operand(mask, num_heads, group, q)
    bias_arg, bias_strides, bias_head_div = _broadcast_operand(bias, num_heads, group, q)
    blocks = None
    if mask is not None:
        blocks = block_lists(tile_activity(mask, seqlen_q, seqlen_k, is_causal, out=activity), config.block_m,
                             config.block_n)
    blocks_arg, blocks_strides = _block_list_args(blocks, q)
    use_tma = kv_by_tma(k, v)
    k_desc, v_desc = kv_descriptors(k, v, config.block_n, head_block(head_dim), use_tma)
    grid = (triton.cdiv(seqlen_q, config.block_m), batch * num_heads)
    _launch(
        flash_fwd_kernel, grid,
        q, k, v, mask_arg, bias_arg, out, lse, blocks_arg, k_desc, v_desc,
        *q.stride(), *k.stride(), *v.stride(), *mask_strides, *bias_strides, *out.stride(), *lse.stride(),
        *blocks_strides,
        num_heads, seqlen_q, seqlen_k,
        mask_head_div, bias_head_div,
        softmax_scale, softcap if softcap > 0 else 1.0,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_D=head_block(head_dim),
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        IS_CAUSAL=is_causal,
        HAS_MASK=mask is not None,
        HAS_BIAS=bias is not None,
        HAS_SOFTCAP=softcap > 0,
        USE_TMA=use_tma,
        BIAS_PER_KEY=bias_per_key(bias_strides, bias),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )


def _dbias_partial(dbias: torch.Tensor, batch, num_heads, group, seqlen_q, seqlen_k, block_m):
    """The buffer the dK/dV kernel writes dBias into, and the kernel mode that fills it.

    Split mode (one program per query head) writes (B, H, Lq or one row per query block, Lk).
    Group mode (one program per kv head, looping over its query heads) is chosen for a bias with
    query rows and fewer heads than the query, (B, Hkv|1, Lq, Lk) under GQA: it sums dS over the
    group in registers and writes (B, Hkv, Lq, Lk), 1/GROUP of split mode's fp32 partial (which
    was 2 GiB at B2 H16 L4096) and none at all for a contiguous (B, Hkv, Lq, Lk) bias. Everywhere
    else split mode stays: per-kv-head programs leave most SMs idle (flash_bwd.py docstring).

    Returns:
        (partial, rows, heads_per_program): the kernel target (`dbias` itself when the shapes
        agree; never zero-filled: the kernel writes every element, skipped tiles as zeros),
        whether it keeps query rows, and the kernel's HEADS_PER_PROGRAM (1: split mode, `group`:
        group mode).
    """
    rows = dbias.shape[2] != 1 or seqlen_q == 1
    heads_per_program = group if rows and dbias.shape[1] < num_heads else 1
    partial_shape = (batch, num_heads // heads_per_program, seqlen_q if rows else triton.cdiv(seqlen_q, block_m),
                     seqlen_k)
    if tuple(dbias.shape) == partial_shape and dbias.is_contiguous():
        return dbias, rows, heads_per_program
    return torch.empty(partial_shape, dtype=torch.float32, device=dbias.device), rows, heads_per_program


def _finish_dbias(partial: torch.Tensor, dbias: torch.Tensor) -> None:
    """Sums the partials into the bias's broadcast shape in a fixed order (deterministic): the
    query heads of each GQA group when the bias has one slice per kv head, then every dim the
    bias broadcasts (size 1)."""
    heads = dbias.shape[1]
    if heads not in (1, partial.shape[1]):
        partial = partial.unflatten(1, (heads, -1)).sum(2)
    reduce_dims = tuple(dim for dim in range(4) if dbias.shape[dim] == 1 and partial.shape[dim] != 1)
    dbias.copy_(partial.sum(dim=reduce_dims, keepdim=True) if reduce_dims else partial)


def delta_with_lse_grad(delta: torch.Tensor, dlse: torch.Tensor | None, lse: torch.Tensor) -> None:
    """delta - dlse in place: the backward kernels compute dS = P * (dP - delta), and a gradient
    on lse adds P * dlse to it. A dead row (lse = -inf) contributes nothing: its dlse is dropped,
    since a merge of partial attentions often sends NaN there (logaddexp(-inf, -inf)) and
    0 * NaN would reach every key of the head."""
    if dlse is not None:
        delta.sub_(torch.where(lse == float("-inf"), 0.0, dlse))


def attention_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    mask: torch.Tensor | None,
    bias: torch.Tensor | None,
    *,
    is_causal: bool,
    softmax_scale: float,
    softcap: float,
    config: BwdConfig,
    dq: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    dbias: torch.Tensor | None,
    activity: torch.Tensor | None = None,
    dlse: torch.Tensor | None = None,
) -> None:
    """Writes dq, dk, dv and, when given, dbias (the bias's own 4-D shape and dtype).

    `dlse`: the gradient reaching lse, (B, H, Lq) fp32. d lse_i / d s_ij = P_ij, so it adds
    P * dlse to dS, which is dS with delta - dlse for delta (`delta_with_lse_grad`).

    `activity`: the mask's tile activity as the forward of this call wrote it (`tile_activity`);
    without it the mask is read again (W1, the bench's full (B, H, L, L) mask, H100: 2.254 ->
    2.129 ms for the backward with it, `results/bench/session12-h100-probe.txt`)."""
    batch, seqlen_q, num_heads, head_dim = q.shape
    seqlen_k, num_heads_kv = k.shape[1], k.shape[2]
    group = num_heads // num_heads_kv
    block_d = head_block(head_dim)
    mask_arg, mask_strides, mask_head_div = _broadcast_operand(mask, num_heads, group, q)
    bias_arg, bias_strides, bias_head_div = _broadcast_operand(bias, num_heads, group, q)
    flags = dict(
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d, IS_CAUSAL=is_causal,
        HAS_MASK=mask is not None, HAS_BIAS=bias is not None, HAS_SOFTCAP=softcap > 0,
        BIAS_PER_KEY=bias_per_key(bias_strides, bias),
    )
    scalars = (mask_head_div, bias_head_div, softmax_scale, softcap if softcap > 0 else 1.0)
    if dbias is not None:
        partial, rows, heads_per_program = _dbias_partial(
            dbias, batch, num_heads, group, seqlen_q, seqlen_k, config.block_m)
    else:
        partial, rows, heads_per_program = q, True, 1
    kv_blocks = q_blocks = None
    if mask is not None:
        # one read of the mask, the forward's, serves both kernels' schedules
        active = activity if activity is not None else tile_activity(mask, seqlen_q, seqlen_k, is_causal)
        kv_active = active
        if heads_per_program > 1 and mask.shape[1] == num_heads:
            # group mode visits the union of its query heads' tiles (each tile still applies its
            # own head's mask); a mask with Hkv or 1 heads already has one list per kv head
            kv_active = active.unflatten(1, (num_heads_kv, group)).amax(2)
        kv_blocks = block_lists(kv_active, config.block_m, config.block_n, key_major=True)
        q_blocks = block_lists(active, config.block_m_dq, config.block_n_dq)
    kv_blocks_arg, kv_blocks_strides = _block_list_args(kv_blocks, q)
    q_blocks_arg, q_blocks_strides = _block_list_args(q_blocks, q)

    # -- delta = rowsum(dO * O) --
    delta = torch.empty_like(lse)
    _launch(
        flash_bwd_preprocess_kernel, (triton.cdiv(seqlen_q, PREPROCESS_BLOCK_M), batch * num_heads),
        out, dout, delta, *out.stride(), *dout.stride(), *delta.stride(), num_heads, seqlen_q,
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=PREPROCESS_BLOCK_M,
    )
    delta_with_lse_grad(delta, dlse, lse)

    # -- dK, dV (and dBias partials): one program per key block and query head (split mode) or
    # kv head (group mode) --
    split_gqa = group > 1 and heads_per_program == 1
    if split_gqa:
        # each query head's share, summed per group below (fixed order: deterministic, no atomics)
        dk_share = torch.empty((batch, seqlen_k, num_heads, head_dim), dtype=torch.float32, device=q.device)
        dv_share = torch.empty_like(dk_share)
    else:
        dk_share, dv_share = dk, dv
    partial_strides = partial.stride() if dbias is not None else (0, 0, 0, 0)
    _launch(
        flash_bwd_dkdv_kernel, (triton.cdiv(seqlen_k, config.block_n), batch * num_heads // heads_per_program),
        q, k, v, mask_arg, bias_arg, dout, lse, delta, dk_share, dv_share, partial, kv_blocks_arg,
        *q.stride(), *k.stride(), *v.stride(), *mask_strides, *bias_strides, *dout.stride(),
        *lse.stride(), *dk_share.stride(), *dv_share.stride(), *partial_strides, *kv_blocks_strides,
        num_heads, seqlen_q, seqlen_k, *scalars,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        HAS_DBIAS=dbias is not None, DBIAS_ROWS=rows, HEADS_PER_PROGRAM=heads_per_program,
        num_warps=config.num_warps, num_stages=config.num_stages, **flags,
    )
    if split_gqa:
        dk.copy_(dk_share.unflatten(2, (num_heads_kv, group)).sum(3))
        dv.copy_(dv_share.unflatten(2, (num_heads_kv, group)).sum(3))

    # -- dQ: one program per query block and query head; from the stored dS when the dK/dV
    # kernel wrote it whole, as the gradient of a full per-head bias without softcap --
    if partial is dbias and rows and heads_per_program == 1 and softcap <= 0:
        _launch(
            flash_bwd_dq_from_ds_kernel, (triton.cdiv(seqlen_q, config.block_m_dq), batch * num_heads),
            dbias, k, dq, q_blocks_arg, *dbias.stride(), *k.stride(), *dq.stride(), *q_blocks_strides,
            num_heads, seqlen_q, seqlen_k, mask_head_div, softmax_scale,
            GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=config.block_m_dq, BLOCK_N=config.block_n_dq,
            IS_CAUSAL=is_causal, HAS_MASK=mask is not None,
            num_warps=config.num_warps, num_stages=config.num_stages,
        )
    else:
        _launch(
            flash_bwd_dq_kernel, (triton.cdiv(seqlen_q, config.block_m_dq), batch * num_heads),
            q, k, v, mask_arg, bias_arg, dout, lse, delta, dq, q_blocks_arg,
            *q.stride(), *k.stride(), *v.stride(), *mask_strides, *bias_strides, *dout.stride(),
            *lse.stride(), *dq.stride(), *q_blocks_strides,
            num_heads, seqlen_q, seqlen_k, *scalars,
            BLOCK_M=config.block_m_dq, BLOCK_N=config.block_n_dq,
            num_warps=config.num_warps, num_stages=config.num_stages, **flags,
        )

    # -- finish dBias: sum what the kernel kept apart --
    if dbias is not None and partial is not dbias:
        _finish_dbias(partial, dbias)
