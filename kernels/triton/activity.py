"""Which tiles of a dynamic mask hold any visible position: the block-sparse schedule.

`tile_activity_kernel` reads the mask once per call and writes one byte per CELL x CELL cell
(CELL = 16, the smallest tile a kernel uses):

    active[b, h, r, c] = any(visible_ij for i in cell row r, j in cell column c)

with visible_ij the full rule of `common.visible_tile` (bounds, causal, window, mask). Each attention
kernel then pools the cells to its own tile shape and walks a compacted, increasing list of the
active tiles (`block_list_kernel`, one program per list row), so its key (or query) loop has no
data-dependent branch and Triton can software-pipeline its loads; tiles with no visible position
cost nothing. The forward's summary is kept for the backward of the same call (`ops`), so the
mask is read for it once per training step.

Interior tiles (inside Lq and Lk, left of the causal diagonal) of a mask with contiguous,
8-byte-aligned rows are read as int64 words: the pass is memory-bound, and one test per eight
bytes leaves the loads, not the reduction, as its cost.
"""

import triton
import triton.language as tl

from dmattn_kernels.triton.common import load_keep, visible_tile, window_key_range

CELL = 16  # rows and columns of a cell: the smallest tile any kernel uses (tl.dot's minimum)
WORD_BYTES = 8  # mask bytes per int64 word of an interior tile (`tile_activity_kernel`)


@triton.jit
def _word_cells(mask_base, offs_m, pid_n, stride_mm, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                CELL: tl.constexpr, WORD: tl.constexpr):
    """Cell activity of an interior tile (the mask alone decides) from int64 words: a word is
    nonzero iff one of its WORD mask bytes is."""
    offs_w = pid_n * (BLOCK_N // WORD) + tl.arange(0, BLOCK_N // WORD)
    words = tl.load(mask_base.to(tl.pointer_type(tl.int64)) + offs_m[:, None] * (stride_mm // WORD) + offs_w[None, :])
    cells = tl.reshape((words != 0).to(tl.int32), [BLOCK_M // CELL, CELL, BLOCK_N // CELL, CELL // WORD])
    return tl.max(tl.max(cells, 3), 1)


@triton.jit
def _byte_cells(mask_base, offs_m, pid_n, stride_mm, stride_mn, seqlen_q, seqlen_k, window_left, window_right,
                IS_CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CELL: tl.constexpr,
                HAS_WINDOW: tl.constexpr):
    """Cell activity of any tile under the full visibility rule, one mask byte at a time."""
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    keep = load_keep(mask_base, offs_m[:, None], offs_n[None, :], stride_mm, stride_mn, seqlen_q, seqlen_k,
                     True, True)
    visible = visible_tile(keep, offs_m[:, None], offs_n[None, :], seqlen_q, seqlen_k, IS_CAUSAL, True, True,
                           HAS_WINDOW, window_left, window_right)
    cells = tl.reshape(visible.to(tl.int32), [BLOCK_M // CELL, CELL, BLOCK_N // CELL, CELL])
    return tl.max(tl.max(cells, 3), 1)


@triton.jit
def tile_activity_kernel(
    mask_ptr, active_ptr,
    stride_mb, stride_mh, stride_mm, stride_mn,
    stride_ab, stride_ah, stride_am, stride_an,
    num_mask_heads, seqlen_q, seqlen_k,
    window_left, window_right,
    IS_CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CELL: tl.constexpr,
    WORDS: tl.constexpr,
    WORD: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
):
    """Writes every cell of `active` (no zero-filled output needed).

    WORDS: the mask rows are contiguous and WORD-byte aligned (`operands.words_readable`), so
    an interior tile is read as int64 words of WORD (8) mask bytes: a word is nonzero iff one of
    its bytes is. Tiles that cross Lq, Lk or the causal diagonal test each byte (`visible_tile`)."""
    tl.static_assert(BLOCK_M % CELL == 0 and BLOCK_N % CELL == 0 and CELL % WORD == 0 and WORD == 8)
    # one program per (BLOCK_M x BLOCK_N) tile: the pass is memory-bound and needs every load in
    # flight at once (a program walking a whole row strip ran at a fifth of HBM speed, H100)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_bh = tl.program_id(2)
    b = (pid_bh // num_mask_heads).to(tl.int64)
    h = (pid_bh % num_mask_heads).to(tl.int64)
    cell_rows = pid_m * (BLOCK_M // CELL) + tl.arange(0, BLOCK_M // CELL)
    cell_cols = pid_n * (BLOCK_N // CELL) + tl.arange(0, BLOCK_N // CELL)
    in_range = (cell_rows[:, None] * CELL < seqlen_q) & (cell_cols[None, :] * CELL < seqlen_k)
    active_tile = active_ptr + b * stride_ab + h * stride_ah + cell_rows[:, None] * stride_am + cell_cols[None, :] * stride_an
    if IS_CAUSAL:
        if pid_n * BLOCK_N > (pid_m + 1) * BLOCK_M - 1 + seqlen_k - seqlen_q:
            # entirely past the causal diagonal: no mask read, its cells written 0 here (the
            # output needs no zero-filling launch of its own)
            tl.store(active_tile, tl.zeros([BLOCK_M // CELL, BLOCK_N // CELL], dtype=tl.int8), mask=in_range)
            return
    if HAS_WINDOW:
        lo, hi = window_key_range(pid_m * BLOCK_M, pid_m * BLOCK_M + BLOCK_M - 1, seqlen_q, seqlen_k, window_left,
                                  window_right)
        if (pid_n * BLOCK_N >= hi) | ((pid_n + 1) * BLOCK_N <= lo):  # wholly outside the window: as above
            tl.store(active_tile, tl.zeros([BLOCK_M // CELL, BLOCK_N // CELL], dtype=tl.int8), mask=in_range)
            return
    mask_base = mask_ptr + b * stride_mb + h * stride_mh
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    interior = ((pid_m + 1) * BLOCK_M <= seqlen_q) & ((pid_n + 1) * BLOCK_N <= seqlen_k)
    if IS_CAUSAL:
        # the tile's last key is visible from its first query
        interior = interior & ((pid_n + 1) * BLOCK_N - 1 <= pid_m * BLOCK_M + seqlen_k - seqlen_q)
    if HAS_WINDOW:
        # every key of the tile inside every row's window: the last row's lower bound, the first's upper
        lo_all, _ = window_key_range(pid_m * BLOCK_M + BLOCK_M - 1, pid_m * BLOCK_M + BLOCK_M - 1, seqlen_q, seqlen_k,
                                     window_left, window_right)
        _, hi_all = window_key_range(pid_m * BLOCK_M, pid_m * BLOCK_M, seqlen_q, seqlen_k, window_left, window_right)
        interior = interior & (pid_n * BLOCK_N >= lo_all) & ((pid_n + 1) * BLOCK_N <= hi_all)
    if WORDS:
        if interior:
            cells = _word_cells(mask_base, offs_m, pid_n, stride_mm, BLOCK_M, BLOCK_N, CELL, WORD)
        else:
            cells = _byte_cells(mask_base, offs_m, pid_n, stride_mm, stride_mn, seqlen_q, seqlen_k, window_left,
                                window_right, IS_CAUSAL, BLOCK_M, BLOCK_N, CELL, HAS_WINDOW)
    else:
        cells = _byte_cells(mask_base, offs_m, pid_n, stride_mm, stride_mn, seqlen_q, seqlen_k, window_left,
                            window_right, IS_CAUSAL, BLOCK_M, BLOCK_N, CELL, HAS_WINDOW)
    tl.store(active_tile, cells.to(tl.int8), mask=in_range)


@triton.jit
def _chunk_activity(cells_base, own, start, stride_list, own_cells, list_cells, num_tiles,
                    LIST_CELLS: tl.constexpr, CHUNK: tl.constexpr):
    """1 for each of the tiles start .. start + CHUNK - 1 holding an active cell, else 0 (int32)."""
    tiles = start + tl.arange(0, CHUNK)
    cell = tiles[None, :, None] * LIST_CELLS + tl.arange(0, LIST_CELLS)[None, None, :]
    inside = (own[:, None, None] < own_cells) & (cell < list_cells) & (tiles[None, :, None] < num_tiles)
    cells = tl.load(cells_base + cell * stride_list, mask=inside, other=0)
    return tl.max(tl.max(cells.to(tl.int32), 2), 0)


@triton.jit
def block_list_row(
    active_ptr, lists_ptr, row, pid_bh,
    stride_ab, stride_ah, stride_own, stride_list,
    stride_lb, stride_lh, stride_lr,
    num_heads, own_cells, list_cells, num_tiles,
    OWN_CELLS: tl.constexpr,
    LIST_CELLS: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """One row of `schedule.block_lists`: the tiles one program of an attention kernel visits.

    The program's own tile spans OWN_CELLS cells along its axis (query cells for a query-major
    list, key cells for a key-major one); the listed tiles span LIST_CELLS cells along the other
    axis. A tile is active when any of its cells is. The row is written whole:

        [count, active tile indices increasing..., skipped tile indices increasing...]

    (the dK/dV kernel writes zero dBias tiles from the skipped part). Two passes over the tiles
    in CHUNK-sized steps: the first counts the active ones, the second places every index.
    `pid_bh` = batch * num_heads + head of the activity's own (broadcast) dims.
    """
    b = (pid_bh // num_heads).to(tl.int64)
    h = (pid_bh % num_heads).to(tl.int64)
    own = row * OWN_CELLS + tl.arange(0, OWN_CELLS)
    cells_base = active_ptr + b * stride_ab + h * stride_ah + own[:, None, None] * stride_own
    list_row = lists_ptr + b * stride_lb + h * stride_lh + row * stride_lr
    count = 0
    for start in range(0, num_tiles, CHUNK):
        count += tl.sum(_chunk_activity(cells_base, own, start, stride_list, own_cells, list_cells, num_tiles,
                                        LIST_CELLS, CHUNK), 0)
    tl.store(list_row, count)
    placed_active = 0
    placed_skipped = 0
    for start in range(0, num_tiles, CHUNK):
        tiles = start + tl.arange(0, CHUNK)
        active = _chunk_activity(cells_base, own, start, stride_list, own_cells, list_cells, num_tiles,
                                 LIST_CELLS, CHUNK)
        skipped = tl.where(tiles < num_tiles, 1 - active, 0)
        position = tl.where(active != 0, placed_active + tl.cumsum(active, 0) - 1,
                            count + placed_skipped + tl.cumsum(skipped, 0) - 1)
        tl.store(list_row + 1 + position, tiles, mask=tiles < num_tiles)
        placed_active += tl.sum(active, 0)
        placed_skipped += tl.sum(skipped, 0)


@triton.jit
def block_list_kernel(
    active_ptr, lists_ptr,
    stride_ab, stride_ah, stride_own, stride_list,
    stride_lb, stride_lh, stride_lr,
    num_heads, own_cells, list_cells, num_tiles,
    OWN_CELLS: tl.constexpr,
    LIST_CELLS: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """The forward's block lists: one program per list row (`block_list_row`); the backward
    builds its two in its preprocess launch."""
    block_list_row(active_ptr, lists_ptr, tl.program_id(0), tl.program_id(1), stride_ab, stride_ah, stride_own,
                   stride_list, stride_lb, stride_lh, stride_lr, num_heads, own_cells, list_cells, num_tiles,
                   OWN_CELLS, LIST_CELLS, CHUNK)
