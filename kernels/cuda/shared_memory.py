"""The CUDA kernels' dynamic shared memory, from a config alone: the one model the launchers
launch with and the tuner prunes by (`shared_bytes`), including how many slots of staged mask and
bias tiles the warp-specialized kernels' rings get.
"""

from __future__ import annotations

from typing import Callable

from dmattn_kernels.configs import BwdConfig, FwdConfig
from dmattn_kernels.cuda.rules import (backward_warp_specialized, padded_head_dim, swizzled_head_dim,
                                       transposed_backward, uses_wgmma, warp_specialized)

SWIZZLE_SLACK = 1024  # bytes a wgmma kernel may skip to align its tiles (sm90.cuh: SWIZZLE_ATOM)
SHARED_PAD = 8  # elements per shared row beyond the padded head dim (common.cuh: ROW)
SM90_SHARED_BYTES = 232448  # opt-in shared memory per block on H100 and H200
# Static shared memory of the warp-specialized forward beside its dynamic tiles: its barriers and
# what ptxas reserves (cuobjdump -res-usage: 1088-1104 bytes), with room to spare
WS_STATIC_BYTES = 2048
# flash_fwd_ws.cu's MASK_TILES and BIAS_TILES: how a mask or bias reaches the scores
NOT_STAGED, TILES_OF_ROWS, TILES_OF_KEYS = 0, 1, 2
MAX_SCORE_STAGES = 2  # the deepest ring of staged mask and bias tiles (4: no faster, H100)


def score_slot_bytes(config: FwdConfig, mask_tiles: int, bias_tiles: int) -> int:
    """Bytes of one slot of the warp-specialized forward's staged mask and bias ring: each tile
    (block_m rows, or one for TILES_OF_KEYS; a mask byte or a 16-bit bias per key) on 1 KiB
    bounds (flash_fwd_ws.cu: SCORE_SLOT_BYTES)."""
    def rows(tiles: int) -> int:
        return {NOT_STAGED: 0, TILES_OF_ROWS: config.block_m, TILES_OF_KEYS: 1}[tiles]

    def kib(size: int) -> int:
        return -(-size // 1024) * 1024

    return kib(rows(mask_tiles) * config.block_n) + kib(rows(bias_tiles) * config.block_n * 2)


def score_stages(config: FwdConfig, head_dim: int, mask_tiles: int = TILES_OF_ROWS,
                 bias_tiles: int = TILES_OF_ROWS) -> int:
    """Slots of the warp-specialized forward's ring of staged mask and bias tiles: as many as fit
    beside Q and the K and V rings in an SM90 block's shared memory, up to MAX_SCORE_STAGES, or
    none (the mask and bias are then read from global memory). Tiles of 64 or 128 keys only: one
    or two 128-byte lines per bias row."""
    slot = score_slot_bytes(config, mask_tiles, bias_tiles)
    base = _forward_tile_bytes(config, head_dim, True)
    return _ring_stages(config.block_n, slot, lambda stages: base + stages * slot)


def _ring_stages(block_n: int, slot: int, kernel_bytes: Callable[[int], int]) -> int:
    """The most slots, up to MAX_SCORE_STAGES, of a warp-specialized kernel's ring of staged tiles
    of `slot` bytes each for which its dynamic shared memory (`kernel_bytes(slots)`) fits an SM90
    block beside WS_STATIC_BYTES, or none: tiles of 64 or 128 keys only."""
    if block_n not in (64, 128) or slot == 0:
        return 0
    for stages in range(MAX_SCORE_STAGES, 0, -1):
        if kernel_bytes(stages) + WS_STATIC_BYTES <= SM90_SHARED_BYTES:
            return stages
    return 0


def _forward_tile_bytes(config: FwdConfig, head_dim: int, wgmma: bool) -> int:
    """Shared bytes of the forward's Q tile and its K and V rings, and with tma_store the rows of
    out its consumers stage (flash_fwd_ws.cu: OUT_SHARE_BYTES each)."""
    rows = config.block_m * (2 if config.tma_store else 1) + 2 * config.num_stages * config.block_n
    return _tile_bytes(rows, head_dim, wgmma)


def _tile_bytes(rows: int, head_dim: int, wgmma: bool) -> int:
    """Shared bytes of `rows` tile rows: padded rows for ldmatrix, or swizzled ones plus the
    alignment slack for wgmma (common.cuh: ROW)."""
    if wgmma:
        return rows * swizzled_head_dim(head_dim) * 2 + SWIZZLE_SLACK
    return rows * (padded_head_dim(head_dim) + SHARED_PAD) * 2


def forward_shared_bytes(config: FwdConfig, head_dim: int, arch: str | None = None, mask_tiles: int = TILES_OF_ROWS,
                         bias_tiles: int = TILES_OF_ROWS) -> int:
    """The forward's dynamic shared memory on `arch`: Q, and K and V rings of num_stages tiles;
    the warp-specialized forward's also its ring of staged mask and bias tiles (as the call's
    operands are staged; by default the largest, a mask and a bias of rows).

    Without an arch, the mma.sync layout's: with at least 128 rows (64 query rows and two
    32-key tiles) it bounds the wgmma layout's too.
    """
    if warp_specialized(config, head_dim, arch):  # and its ring of mask and bias tiles
        slots = score_stages(config, head_dim, mask_tiles, bias_tiles)
        return _forward_tile_bytes(config, head_dim, True) + slots * score_slot_bytes(config, mask_tiles, bias_tiles)
    return _forward_tile_bytes(config, head_dim, uses_wgmma(config, head_dim, arch))


def backward_score_slot_bytes(config: BwdConfig, mask_tiles: int, bias_tiles: int) -> int:
    """Bytes of one slot of the warp-specialized backward's ring of staged mask and bias tiles:
    a query tile's mask bytes and 16-bit bias of its block_n keys (TILES_OF_ROWS; an operand of
    one row of keys is read into registers instead: flash_bwd_ws.cu's SCORE_SLOT_BYTES)."""
    tile = config.block_m * config.block_n
    return (tile if mask_tiles == TILES_OF_ROWS else 0) + (2 * tile if bias_tiles == TILES_OF_ROWS else 0)


def _backward_ws_bytes(config: BwdConfig, head_dim: int, score_stages: int, slot: int) -> int:
    """flash_bwd_ws.cu's dynamic shared memory: K and V, the Q and dO rings, two dS tiles (and the
    transposed layout's P^T tile), the fp32 dQ shares (one beside a ring of staged tiles or in the
    transposed layout, else two), that ring, the lse and delta rings."""
    ring = config.num_stages * config.block_m
    transposed = transposed_backward(config, head_dim, "sm90")  # a P^T tile in the room of a second share
    dq_shares = (1 if score_stages or transposed else 2) * config.block_m * swizzled_head_dim(head_dim) * 4
    score_tiles = (3 if transposed else 2) * config.block_m * config.block_n * 2
    return (_tile_bytes(2 * config.block_n + 2 * ring, head_dim, True) + score_tiles + dq_shares
            + score_stages * slot + 2 * ring * 4)


def backward_score_stages(config: BwdConfig, head_dim: int, mask_tiles: int, bias_tiles: int) -> int:
    """Slots of the warp-specialized backward's ring of staged mask and bias tiles: as many as fit
    an SM90 block's shared memory, up to MAX_SCORE_STAGES, or none (read from global memory)."""
    slot = backward_score_slot_bytes(config, mask_tiles, bias_tiles)
    return _ring_stages(config.block_n, slot, lambda stages: _backward_ws_bytes(config, head_dim, stages, slot))


def backward_shared_bytes(config: BwdConfig, head_dim: int, arch: str | None = None, mask_tiles: int = NOT_STAGED,
                          bias_tiles: int = NOT_STAGED) -> dict[str, int]:
    """The backward's dynamic shared memory per kernel on `arch` (as the forward's). flash_bwd.cu:
    dK/dV holds K, V and rings of Q and dO tiles with their lse and delta (fp32); dQ holds Q, dO
    and rings of K and V tiles. flash_bwd_ws.cu: its one kernel's (`ws`), with the ring of
    staged tiles a call's operands get (`backward_staging`; by default none, the largest)."""
    ring = config.num_stages * config.block_m
    if backward_warp_specialized(config, head_dim, arch):
        stages = backward_score_stages(config, head_dim, mask_tiles, bias_tiles)
        return {"ws": _backward_ws_bytes(config, head_dim, stages,
                                         backward_score_slot_bytes(config, mask_tiles, bias_tiles))}
    wgmma = uses_wgmma(config, head_dim, arch)
    return {
        "dkdv": _tile_bytes(2 * config.block_n + 2 * ring, head_dim, wgmma) + 2 * ring * 4,
        "dq": _tile_bytes(2 * config.block_m_dq + 2 * config.num_stages * config.block_n_dq, head_dim, wgmma),
    }


def shared_bytes(config: FwdConfig | BwdConfig, head_dim: int, arch: str | None = None) -> int:
    """The most dynamic shared memory one kernel of `config`'s direction asks for on `arch`."""
    if isinstance(config, FwdConfig):
        return forward_shared_bytes(config, head_dim, arch)
    return max(backward_shared_bytes(config, head_dim, arch).values())

