"""What the Triton plans read of a call's operands (`CallLayout`): sizes, the GQA group, the lanes a
tile spans over the head dim (`head_block`), and the mask's and bias's layouts as the shared
operand normaliser gives them (`dmattn_kernels.runtime.operands`), from shapes and strides only.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import triton

from dmattn_kernels.runtime.operands import Geometry, broadcast_layout, padded_shape
from dmattn_kernels.triton.activity import CELL

MIN_BLOCK = CELL  # tl.dot needs every tile dim >= 16; the activity cells are that size


def head_block(head_dim: int) -> int:
    """The power-of-two lane count covering `head_dim` (masked lanes handle the rest)."""
    return max(MIN_BLOCK, triton.next_power_of_2(head_dim))


@dataclasses.dataclass(frozen=True)
class CallLayout:
    """What a Triton plan reads of a call's q, k, mask and bias: its sizes, the GQA group, the head
    dim's lanes (`head_block`), the mask's 4-D shape, and the mask's and bias's strides and head
    divisors (`operands.broadcast_layout`)."""

    batch: int  # q's (B, Lq, H, D), then k's (Lk, Hkv)
    seqlen_q: int
    num_heads: int
    head_dim: int
    seqlen_k: int
    num_heads_kv: int
    group: int
    block_d: int
    mask_shape: tuple[int, ...] | None  # (B|1, H|Hkv|1, Lq|1, Lk|1); None without a mask
    mask_strides: tuple[int, ...]
    mask_head_div: int
    bias_strides: tuple[int, ...]
    bias_head_div: int
    bias_per_key: bool  # the kernels read the bias as one value per key (`common.load_bias`)

    @classmethod
    def of(cls, q_shape: Sequence[int], k_shape: Sequence[int], mask: Geometry | None,
           bias: Geometry | None) -> CallLayout:
        """The layout of a call of q and k of these shapes and a mask and bias of these
        geometries ((shape, strides) as the caller passed them; None: no operand)."""
        batch, seqlen_q, num_heads, head_dim = q_shape
        seqlen_k, num_heads_kv = k_shape[1], k_shape[2]
        group = num_heads // num_heads_kv
        mask_strides, mask_head_div = broadcast_layout(mask, num_heads, group)
        bias_strides, bias_head_div = broadcast_layout(bias, num_heads, group)
        return cls(batch, seqlen_q, num_heads, head_dim, seqlen_k, num_heads_kv, group, head_block(head_dim),
                   None if mask is None else padded_shape(mask[0]), mask_strides, mask_head_div, bias_strides,
                   bias_head_div, bias is not None and bias_strides[2] == 0)


def activity_shape(mask_shape: Sequence[int], seqlen_q: int, seqlen_k: int) -> tuple[int, int, int, int]:
    """Shape of `tile_activity`'s summary for a mask of `mask_shape` (up to 4 dims)."""
    batch, heads = padded_shape(mask_shape)[:2]
    return (batch, heads, triton.cdiv(seqlen_q, CELL), triton.cdiv(seqlen_k, CELL))
