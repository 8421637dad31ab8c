"""The block-sparse schedule: `schedule.block_lists` against a direct pooling in torch."""

import pytest
import torch

from dmattn_kernels.runtime.operands import broadcast_strides, words_readable
from dmattn_kernels.triton import schedule
from dmattn_kernels.triton.activity import CELL, WORD_BYTES


def expected_lists(active: torch.Tensor, block_rows: int, block_cols: int, key_major: bool) -> torch.Tensor:
    """Each row: [count, active tile indices increasing, skipped tile indices increasing]."""
    rows, cols = block_rows // CELL, block_cols // CELL
    batch, heads, cell_rows, cell_cols = active.shape
    tile_rows, tile_cols = -(-cell_rows // rows), -(-cell_cols // cols)
    padded = torch.zeros(batch, heads, tile_rows * rows, tile_cols * cols, dtype=torch.bool)
    padded[:, :, :cell_rows, :cell_cols] = active != 0
    tiles = padded.reshape(batch, heads, tile_rows, rows, tile_cols, cols).any(5).any(3)
    if key_major:
        tiles = tiles.transpose(-1, -2)
    out = torch.empty(*tiles.shape[:-1], 1 + tiles.shape[-1], dtype=torch.int32)
    for index in torch.cartesian_prod(*(torch.arange(n) for n in tiles.shape[:-1])):
        row = tiles[tuple(index)]
        on, off = row.nonzero().flatten(), (~row).nonzero().flatten()
        out[tuple(index)] = torch.cat([torch.tensor([len(on)]), on, off]).to(torch.int32)
    return out


@pytest.mark.parametrize("key_major", [False, True], ids=["query-major", "key-major"])
@pytest.mark.parametrize("block_rows, block_cols", [(16, 16), (32, 64), (64, 32)])
@pytest.mark.parametrize("cell_shape", [(5, 7), (8, 8), (3, 19)])
def test_block_lists_match_a_direct_pooling(key_major, block_rows, block_cols, cell_shape):
    generator = torch.Generator().manual_seed(sum(cell_shape) + block_rows + 3 * block_cols)
    active = (torch.rand(2, 3, *cell_shape, generator=generator) < 0.3).to(torch.int8)
    active[0, 0] = 0  # a slice with nothing active: every row lists only skipped tiles
    active[1, 2] = 1  # a slice with everything active
    got = schedule.block_lists(active, block_rows, block_cols, key_major=key_major)
    assert torch.equal(got, expected_lists(active, block_rows, block_cols, key_major))


def test_block_lists_read_broadcast_views():
    """A (1, 1, R, C) summary expanded over batch and heads (stride 0) is read, not copied."""
    active = (torch.rand(1, 1, 6, 9, generator=torch.Generator().manual_seed(1)) < 0.5).to(torch.int8)
    got = schedule.block_lists(active.expand(2, 2, 6, 9), 32, 16)
    assert torch.equal(got, expected_lists(active.expand(2, 2, 6, 9).contiguous(), 32, 16, False))


def expected_activity(mask: torch.Tensor, seqlen_q: int, seqlen_k: int, causal: bool) -> torch.Tensor:
    """The cell summary pooled directly in torch from the full visibility rule."""
    keep = mask.expand(mask.shape[0], mask.shape[1], seqlen_q, seqlen_k) != 0
    rows, cols = torch.arange(seqlen_q)[:, None], torch.arange(seqlen_k)[None, :]
    visible = keep & (cols <= rows + seqlen_k - seqlen_q) if causal else keep
    cell_rows, cell_cols = -(-seqlen_q // CELL), -(-seqlen_k // CELL)
    padded = torch.zeros(*keep.shape[:2], cell_rows * CELL, cell_cols * CELL, dtype=torch.bool)
    padded[..., :seqlen_q, :seqlen_k] = visible
    return padded.reshape(*keep.shape[:2], cell_rows, CELL, cell_cols, CELL).any(5).any(3).to(torch.int8)


def _words_readable(mask: torch.Tensor) -> bool:
    """Whether the activity pass reads `mask`'s interior tiles as int64 words."""
    return words_readable(broadcast_strides(mask.shape, mask.stride()), mask.element_size(), mask.data_ptr(),
                          WORD_BYTES)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("seqlen_q, seqlen_k", [(320, 512), (512, 300), (64, 256), (17, 1000), (100, 37)])
def test_tile_activity_matches_a_direct_pooling(causal, seqlen_q, seqlen_k):
    """Interior tiles of 8-byte-aligned rows are read as int64 words, the others byte by byte:
    sparse masks (a few visible positions per cell) catch a word or cell boundary off by one."""
    generator = torch.Generator().manual_seed(seqlen_q + 7 * seqlen_k + causal)
    mask = torch.rand(2, 3, seqlen_q, seqlen_k, generator=generator) < 0.01
    assert _words_readable(mask) == (seqlen_k % 8 == 0)
    got = schedule.tile_activity(mask, seqlen_q, seqlen_k, causal)
    assert torch.equal(got, expected_activity(mask, seqlen_q, seqlen_k, causal))


@pytest.mark.parametrize("view", ["key-broadcast", "query-broadcast", "offset-slice"])
def test_tile_activity_reads_views(view):
    """Broadcast masks (stride 0) and a slice that starts off the 8-byte grid (byte reads)."""
    generator = torch.Generator().manual_seed(3)
    if view == "key-broadcast":
        mask = (torch.rand(1, 2, 300, 1, generator=generator) < 0.5).expand(1, 2, 300, 256)
    elif view == "query-broadcast":
        mask = (torch.rand(2, 1, 1, 512, generator=generator) < 0.02).expand(2, 1, 320, 512)
    else:
        mask = (torch.rand(1, 1, 256, 513, generator=generator) < 0.02)[..., 1:]
        assert not _words_readable(mask)
    got = schedule.tile_activity(mask, mask.shape[2], mask.shape[3], True)
    assert torch.equal(got, expected_activity(mask, mask.shape[2], mask.shape[3], True))
