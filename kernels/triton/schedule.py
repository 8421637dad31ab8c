"""The mask's block-sparse schedule, shared by the forward and the backward plans: the mask's tile
activity (`tile_activity_kernel`, one read of the mask) and, pooled from it to a kernel's tiles,
the block lists that kernel visits (`block_list_kernel`).
"""

from __future__ import annotations

import torch
import triton

from dmattn_kernels.configs import window_bounds
from dmattn_kernels.runtime.operands import broadcast_strides, contiguous_strides, padded_shape, words_readable
from dmattn_kernels.triton.activity import CELL, WORD_BYTES, block_list_kernel, tile_activity_kernel
from dmattn_kernels.triton.launching import Launch
from dmattn_kernels.triton.layouts import activity_shape

ACTIVITY_BLOCK_M, ACTIVITY_BLOCK_N = 64, 256  # tile of the (memory-bound) activity pass; multiples of CELL
ACTIVITY_NUM_WARPS = 8
LIST_NUM_WARPS = 4  # a block-list program handles one row of tiles: little work
LIST_CHUNK = 128  # tiles a block-list program pools per step (its cells: 16 x 128 x 16 at most)


class ActivityPass:
    """`tile_activity_kernel` for one mask layout: (Bm, Hm, ceil(Lq/CELL), ceil(Lk/CELL)) int8.

    Built from the mask's layout alone: its 4-D shape and broadcast strides (`CallLayout`), its
    element size and its address (whether the kernel reads interior tiles as int64 words:
    `operands.words_readable`)."""

    def __init__(self, mask_shape: tuple[int, ...], mask_strides: tuple[int, ...], itemsize: int, address: int,
                 seqlen_q: int, seqlen_k: int, is_causal: bool, window: tuple[int, int] = (-1, -1)):
        batch_m, heads_m = mask_shape[0], mask_shape[1]
        has_window, window_left, window_right = window_bounds(window, is_causal, seqlen_q, seqlen_k)
        self.shape = activity_shape(mask_shape, seqlen_q, seqlen_k)
        self.launch = Launch(
            tile_activity_kernel,
            (triton.cdiv(seqlen_q, ACTIVITY_BLOCK_M), triton.cdiv(seqlen_k, ACTIVITY_BLOCK_N), batch_m * heads_m),
            (*mask_strides, *contiguous_strides(self.shape), heads_m, seqlen_q, seqlen_k, window_left, window_right),
            dict(IS_CAUSAL=is_causal, BLOCK_M=ACTIVITY_BLOCK_M, BLOCK_N=ACTIVITY_BLOCK_N, CELL=CELL,
                 WORDS=words_readable(mask_strides, itemsize, address, WORD_BYTES), WORD=WORD_BYTES,
                 HAS_WINDOW=has_window),
            num_warps=ACTIVITY_NUM_WARPS,
        )

    def __call__(self, mask: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """`out`: a contiguous buffer of `self.shape` to fill (every element is written)."""
        if out is None:
            out = torch.empty(self.shape, dtype=torch.int8, device=mask.device)
        self.launch(mask, out)
        return out


class BlockLists:
    """`block_list_kernel` for one activity shape and tile shape: (Bm, Hm, rows, 1 + cols) int32,
    each row [count, active indices..., skipped indices...] (`block_lists`)."""

    def __init__(self, active_shape, block_rows: int, block_cols: int, key_major: bool):
        batch_m, heads_m, cell_rows, cell_cols = active_shape
        stride_b, stride_h, stride_r, stride_c = contiguous_strides(active_shape)
        rows, cols = block_rows // CELL, block_cols // CELL
        if key_major:
            own, listed, own_cells, list_cells = cols, rows, cell_cols, cell_rows
            stride_own, stride_list = stride_c, stride_r
        else:
            own, listed, own_cells, list_cells = rows, cols, cell_rows, cell_cols
            stride_own, stride_list = stride_r, stride_c
        num_rows, num_tiles = triton.cdiv(own_cells, own), triton.cdiv(list_cells, listed)
        self.shape = (batch_m, heads_m, num_rows, 1 + num_tiles)
        lists_strides = contiguous_strides(self.shape)
        # what a kernel reading the lists receives: (batch, head, row) strides, 0 on broadcast dims
        self.strides = broadcast_strides(self.shape, lists_strides)[:3]
        # `activity.block_list_row`'s arguments after its pointers and row, and its program count
        self.scalars = (stride_b, stride_h, stride_own, stride_list, *lists_strides[:3], heads_m, own_cells,
                        list_cells, num_tiles)
        self.cells = (own, listed, min(LIST_CHUNK, triton.next_power_of_2(num_tiles)))  # OWN_CELLS, LIST_CELLS, CHUNK
        self.rows, self.programs = num_rows, num_rows * batch_m * heads_m
        self.launch = Launch(
            block_list_kernel, (num_rows, batch_m * heads_m), self.scalars,
            dict(zip(("OWN_CELLS", "LIST_CELLS", "CHUNK"), self.cells)), num_warps=LIST_NUM_WARPS,
        )

    def __call__(self, active: torch.Tensor) -> torch.Tensor:
        lists = torch.empty(self.shape, dtype=torch.int32, device=active.device)
        self.launch(active, lists)
        return lists


def list_strides(lists: BlockLists | None) -> tuple[int, int, int]:
    """The (batch, head, row) strides a kernel reads `lists` with; zeros where there are none (no mask)."""
    return (0, 0, 0) if lists is None else lists.strides


def tile_activity(mask: torch.Tensor, seqlen_q: int, seqlen_k: int, is_causal: bool,
                  out: torch.Tensor | None = None, window: tuple[int, int] = (-1, -1)) -> torch.Tensor:
    """(Bm, Hm, ceil(Lq/CELL), ceil(Lk/CELL)) int8: 1 where a CELL x CELL cell of the mask's own
    batch and head slices holds a visible position (`activity.py`). One read of the mask.

    `out`, when given, is a contiguous buffer of that shape to fill (every element is written)."""
    shape, strides = tuple(mask.shape), mask.stride()
    activity = ActivityPass(padded_shape(shape), broadcast_strides(shape, strides), mask.element_size(),
                            mask.data_ptr(), seqlen_q, seqlen_k, is_causal, window)
    return activity(mask, out)


def block_lists(active: torch.Tensor, block_rows: int, block_cols: int, *, key_major: bool = False) -> torch.Tensor:
    """Per tile row, the tiles a kernel must visit: (Bm, Hm, rows, 1 + cols) int32, each row
    [count, index_0, ..., index_{count-1}, skipped indices...], active and skipped tiles each
    in increasing order (`activity.block_list_kernel`).

    `active` (from `tile_activity`, contiguous) is pooled to (block_rows x block_cols) tiles of the
    (query x key) plane. key_major: one row per key tile listing query tiles (the dK/dV kernel).
    """
    return BlockLists(tuple(active.shape), block_rows, block_cols, key_major)(active.contiguous())
