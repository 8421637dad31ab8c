"""Operand layouts: how a launcher hands a mask, a bias or a scratch buffer to a kernel. The one
normaliser of broadcast strides and head divisors, shared by the Triton and CUDA launchers.

A mask or bias arrives as a 4-D view (B|1, H|Hkv|1, Lq|1, Lk|1); a size-1 dim is read with
stride 0, whatever stride the view carries there.
"""

from __future__ import annotations

import torch
import triton

from dmattn_kernels.triton.activity import CELL, WORD_BYTES


def zero_size1_strides(t: torch.Tensor | None) -> tuple[int, ...]:
    """`t`'s strides with 0 on its size-1 dims; four 0s for no tensor."""
    if t is None:
        return (0, 0, 0, 0)
    return tuple(0 if size == 1 else stride for size, stride in zip(t.shape, t.stride()))


def contiguous_strides(shape) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def broadcast_layout(t: torch.Tensor | None, num_heads: int, group: int) -> tuple[tuple[int, ...], int]:
    """4 strides (0 on size-1 dims) and head divisor of a broadcast mask/bias view.

    A head dim of H maps query head h to slice h; of Hkv (when H != Hkv) to slice h // group.
    """
    if t is None:
        return (0, 0, 0, 0), 1
    head_div = group if (t.shape[1] != num_heads and t.shape[1] != 1) else 1
    return zero_size1_strides(t), head_div


def bias_per_key(strides: tuple[int, ...], bias: torch.Tensor | None) -> bool:
    """Whether the kernels read the bias as one value per key (`common.load_bias`): its query
    dim broadcasts (stride 0 in the (batch, head, query, key) `strides` of `broadcast_layout`)."""
    return bias is not None and strides[2] == 0


def mask_words_readable(mask: torch.Tensor) -> bool:
    """Whether `tile_activity_kernel` may read the mask's interior tiles as int64 words: its key
    dim is contiguous and every row starts 8-byte aligned (broadcast dims have stride 0)."""
    strides = zero_size1_strides(mask)
    return (strides[3] == 1 and mask.element_size() == 1 and mask.data_ptr() % WORD_BYTES == 0
            and all(stride % WORD_BYTES == 0 for stride in strides[:3]))


def activity_shape(mask_shape, seqlen_q: int, seqlen_k: int) -> tuple[int, int, int, int]:
    """Shape of `tile_activity`'s summary for a 4-D mask of `mask_shape`."""
    return (mask_shape[0], mask_shape[1], triton.cdiv(seqlen_q, CELL), triton.cdiv(seqlen_k, CELL))
