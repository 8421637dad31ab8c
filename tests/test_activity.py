"""The block-sparse schedule: `launch.block_lists` against a direct pooling in torch."""

import pytest
import torch

from dmattn_kernels.triton import launch
from dmattn_kernels.triton.activity import CELL


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
    got = launch.block_lists(active, block_rows, block_cols, key_major=key_major)
    assert torch.equal(got, expected_lists(active, block_rows, block_cols, key_major))


def test_block_lists_read_broadcast_views():
    """A (1, 1, R, C) summary expanded over batch and heads (stride 0) is read, not copied."""
    active = (torch.rand(1, 1, 6, 9, generator=torch.Generator().manual_seed(1)) < 0.5).to(torch.int8)
    got = launch.block_lists(active.expand(2, 2, 6, 9), 32, 16)
    assert torch.equal(got, expected_lists(active.expand(2, 2, 6, 9).contiguous(), 32, 16, False))
