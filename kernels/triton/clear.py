"""The rows of a packed call's buffers that no sequence owns, filled on the device.

Packed sequences (`configs.Packing`) own the rows cu_seqlens[0] .. cu_seqlens[-1] - 1 of a packed
buffer: query rows of out, lse and dQ by cu_seqlens_q, key rows of dK, dV and their GQA shares
by cu_seqlens_k. The rows before and after are written by no attention program; the contract
gives them out = 0, lse = -inf and zero gradients (`reference.varlen_attention`).
`clear_unowned_rows_kernel` writes that fill value there and nowhere else, several buffers in one
launch. It reads the two prefix sums on the device, so the call stays asynchronous (the host
cannot know them without a sync), and a program whose rows all lie inside returns after those
two loads: when the sequences cover every row, the common case, no buffer's bytes move.

A buffer (a "part") is walked as (rows, heads, dim): element (r, h, d) at
r * stride_r + h * stride_h + d * stride_d, so a packed (1, total, H, D) tensor is (total, H, D)
and lse (1, H, total_q) is (total_q, H, 1).
"""

from __future__ import annotations

from typing import NamedTuple

import triton
import triton.language as tl

from dmattn_kernels.triton.launching import Launch

MAX_PARTS = tl.constexpr(3)  # the backward's dQ, dK and dV (or dK's and dV's GQA shares); the forward's 2
ROWS_PER_PROGRAM = 128  # rows a program owns: its two loads decide whether it has anything to fill
FILL_BLOCK_R, FILL_BLOCK_C = 16, 256  # the tile a filling program stores: rows x (heads * dim) columns
FILL_NUM_WARPS = 4


@triton.jit
def _fill_rows(ptr, lo, hi, heads, dim, stride_r, stride_h, stride_d, fill,
               BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Rows lo .. hi - 1 of one part set to `fill`, every head and dim."""
    columns = heads * dim
    value = (tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32) + fill).to(ptr.dtype.element_ty)
    for start_r in range(lo, hi, BLOCK_R):
        offs_r = start_r + tl.arange(0, BLOCK_R)
        for start_c in range(0, columns, BLOCK_C):
            offs_c = start_c + tl.arange(0, BLOCK_C)
            offs = (offs_r.to(tl.int64)[:, None] * stride_r + (offs_c // dim).to(tl.int64)[None, :] * stride_h
                    + (offs_c % dim).to(tl.int64)[None, :] * stride_d)
            tl.store(ptr + offs, value, mask=(offs_r[:, None] < hi) & (offs_c[None, :] < columns))


@triton.jit
def _fill_unowned(ptr, cu_seqlens_ptr, num_sequences, block, rows, heads, dim, stride_r, stride_h, stride_d, fill,
                  ROWS_PER_PROGRAM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """The rows of block `block` (ROWS_PER_PROGRAM of them) of one part that lie before
    cu_seqlens[0] or from cu_seqlens[num_sequences] on, set to `fill`. The prefix sums are
    clamped to [0, rows]; a last one below the first leaves no row owned (the attention kernels,
    launched after, still write the rows their sequences reach)."""
    first = tl.minimum(tl.maximum(tl.load(cu_seqlens_ptr), 0), rows)
    end = tl.minimum(tl.maximum(tl.load(cu_seqlens_ptr + num_sequences), first), rows)
    start = block * ROWS_PER_PROGRAM
    stop = tl.minimum(start + ROWS_PER_PROGRAM, rows)
    if start < first:
        _fill_rows(ptr, start, tl.minimum(stop, first), heads, dim, stride_r, stride_h, stride_d, fill,
                   BLOCK_R, BLOCK_C)
    if stop > end:
        _fill_rows(ptr, tl.maximum(start, end), stop, heads, dim, stride_r, stride_h, stride_d, fill,
                   BLOCK_R, BLOCK_C)


@triton.jit
def clear_unowned_rows_kernel(
    part0_ptr, part1_ptr, part2_ptr, cu_seqlens_q_ptr, cu_seqlens_k_ptr,
    num_sequences,
    rows0, heads0, dim0, stride0_r, stride0_h, stride0_d, fill0,
    rows1, heads1, dim1, stride1_r, stride1_h, stride1_d, fill1,
    rows2, heads2, dim2, stride2_r, stride2_h, stride2_d, fill2,
    PARTS: tl.constexpr,
    QUERY_PARTS: tl.constexpr,
    ROWS_PER_PROGRAM: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Parts 0 .. PARTS - 1 (module docstring), one launch of independent programs, each part
    taking cdiv(rows, ROWS_PER_PROGRAM) programs in turn: parts below QUERY_PARTS are query rows
    (owned by cu_seqlens_q), the rest key rows (cu_seqlens_k)."""
    tl.static_assert(1 <= PARTS and PARTS <= MAX_PARTS and QUERY_PARTS <= PARTS)
    pid = tl.program_id(0)
    blocks0 = tl.cdiv(rows0, ROWS_PER_PROGRAM)
    if pid < blocks0:
        cu0_ptr = cu_seqlens_q_ptr if QUERY_PARTS > 0 else cu_seqlens_k_ptr
        _fill_unowned(part0_ptr, cu0_ptr, num_sequences, pid, rows0, heads0, dim0, stride0_r, stride0_h,
                      stride0_d, fill0, ROWS_PER_PROGRAM, BLOCK_R, BLOCK_C)
        return
    pid -= blocks0
    if PARTS > 1:
        blocks1 = tl.cdiv(rows1, ROWS_PER_PROGRAM)
        if pid < blocks1:
            cu1_ptr = cu_seqlens_q_ptr if QUERY_PARTS > 1 else cu_seqlens_k_ptr
            _fill_unowned(part1_ptr, cu1_ptr, num_sequences, pid, rows1, heads1, dim1, stride1_r, stride1_h,
                          stride1_d, fill1, ROWS_PER_PROGRAM, BLOCK_R, BLOCK_C)
            return
        pid -= blocks1
    if PARTS > 2:
        cu2_ptr = cu_seqlens_q_ptr if QUERY_PARTS > 2 else cu_seqlens_k_ptr
        _fill_unowned(part2_ptr, cu2_ptr, num_sequences, pid, rows2, heads2, dim2, stride2_r, stride2_h,
                      stride2_d, fill2, ROWS_PER_PROGRAM, BLOCK_R, BLOCK_C)


# -- the launch ------------------------------------------------------------------------------------


class Part(NamedTuple):
    """One buffer's layout as `clear_unowned_rows_kernel` walks it, and what its unowned rows hold."""

    rows: int
    heads: int
    dim: int
    strides: tuple[int, int, int]  # per row, head, dim
    fill: float


def token_part(shape: tuple[int, ...], strides: tuple[int, ...], fill: float = 0.0) -> Part:
    """A packed (1, total, heads, D) buffer: out, dQ, dK, dV, a GQA share."""
    return Part(shape[1], shape[2], shape[3], tuple(strides[1:]), fill)


def lse_part(shape: tuple[int, ...], strides: tuple[int, ...]) -> Part:
    """The packed lse (1, H, total_q): a row of H values, -inf where no sequence owns it."""
    return Part(shape[2], shape[1], 1, (strides[2], strides[1], 0), float("-inf"))


class UnownedRows:
    """`clear_unowned_rows_kernel` for one plan's parts: `query_parts` owned by cu_seqlens_q,
    then `key_parts` owned by cu_seqlens_k. `run` takes their buffers in that order (tensors, or
    addresses once compiled, as any `Launch`)."""

    def __init__(self, query_parts: list[Part], key_parts: list[Part], num_sequences: int):
        parts = [*query_parts, *key_parts]
        if not 1 <= len(parts) <= MAX_PARTS.value:
            raise ValueError(f"UnownedRows: got {len(parts)} parts, expected 1 to {MAX_PARTS.value}")
        self.unused = MAX_PARTS.value - len(parts)  # part slots this plan leaves empty
        scalars = [num_sequences]
        for part in parts + [Part(0, 0, 0, (0, 0, 0), 0.0)] * self.unused:
            scalars += [part.rows, part.heads, part.dim, *part.strides, part.fill]
        self.launch = Launch(
            clear_unowned_rows_kernel, (sum(triton.cdiv(part.rows, ROWS_PER_PROGRAM) for part in parts),), scalars,
            dict(PARTS=len(parts), QUERY_PARTS=len(query_parts), ROWS_PER_PROGRAM=ROWS_PER_PROGRAM,
                 BLOCK_R=FILL_BLOCK_R, BLOCK_C=FILL_BLOCK_C),
            num_warps=FILL_NUM_WARPS,
        )

    def run(self, stream: int | None, buffers: tuple, cu_seqlens_q, cu_seqlens_k) -> None:
        self.launch.run(stream, *buffers, *(buffers[0],) * self.unused, cu_seqlens_q, cu_seqlens_k)
