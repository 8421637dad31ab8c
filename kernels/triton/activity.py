"""Which tiles of a dynamic mask hold any visible position: the block-sparse schedule.

`tile_activity_kernel` reads the mask once per call and writes one byte per CELL x CELL cell
(CELL = 16, the smallest tile a kernel uses):

    active[b, h, r, c] = any(visible_ij for i in cell row r, j in cell column c)

with visible_ij the full rule of `common.visible_tile` (bounds, causal, mask). Each attention
kernel then pools the cells to its own tile shape and walks a compacted, increasing list of the
active tiles (`launch.block_lists`), so its key (or query) loop has no data-dependent branch and
Triton can software-pipeline its loads; tiles with no visible position cost nothing.
"""

import triton
import triton.language as tl

from dmattn_kernels.triton.common import load_keep, visible_tile

CELL = 16  # rows and columns of a cell: the smallest tile any kernel uses (tl.dot's minimum)


@triton.jit
def tile_activity_kernel(
    mask_ptr, active_ptr,
    stride_mb, stride_mh, stride_mm, stride_mn,
    stride_ab, stride_ah, stride_am, stride_an,
    num_mask_heads, seqlen_q, seqlen_k,
    IS_CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CELL: tl.constexpr,
):
    tl.static_assert(BLOCK_M % CELL == 0 and BLOCK_N % CELL == 0)
    # one program per (BLOCK_M x BLOCK_N) tile: the pass is memory-bound and needs every load in
    # flight at once (a program walking a whole row strip ran at a fifth of HBM speed, H100)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_bh = tl.program_id(2)
    if IS_CAUSAL:
        if pid_n * BLOCK_N > (pid_m + 1) * BLOCK_M - 1 + seqlen_k - seqlen_q:
            return  # entirely past the causal diagonal: its cells stay 0 (zero-initialised output)
    b = (pid_bh // num_mask_heads).to(tl.int64)
    h = (pid_bh % num_mask_heads).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    keep = load_keep(mask_ptr + b * stride_mb + h * stride_mh, offs_m[:, None], offs_n[None, :], stride_mm, stride_mn,
                     seqlen_q, seqlen_k, True, True)
    visible = visible_tile(keep, offs_m[:, None], offs_n[None, :], seqlen_q, seqlen_k, IS_CAUSAL, True)
    cells = tl.reshape(visible.to(tl.int32), [BLOCK_M // CELL, CELL, BLOCK_N // CELL, CELL])
    cells = tl.max(tl.max(cells, 3), 1)
    cell_rows = pid_m * (BLOCK_M // CELL) + tl.arange(0, BLOCK_M // CELL)
    cell_cols = pid_n * (BLOCK_N // CELL) + tl.arange(0, BLOCK_N // CELL)
    in_range = (cell_rows[:, None] * CELL < seqlen_q) & (cell_cols[None, :] * CELL < seqlen_k)
    tl.store(active_ptr + b * stride_ab + h * stride_ah + cell_rows[:, None] * stride_am + cell_cols[None, :] * stride_an,
             cells.to(tl.int8), mask=in_range)
