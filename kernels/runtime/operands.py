"""The operand normaliser of both launchers: how a kernel reads a call's mask and bias, and a
contiguous buffer, from shapes, strides, element sizes and addresses alone.

A mask or bias arrives as the caller passed it: up to 4 dims, broadcastable as (B|1, H|Hkv|1,
Lq|1, Lk|1). A kernel reads it as that 4-D view: left-padded with size-1 dims, and every size-1
dim read with stride 0, whatever stride the tensor carries there. A head dim of H maps query
head h to slice h; of Hkv (when H != Hkv) to slice h // group: its head divisor.

Nothing here takes a tensor: a plan hands its call's tensors to the launches untouched, and
reads their layouts here (`geometry` is a tensor's `(shape, strides)`, None for no operand).
"""

from __future__ import annotations

from typing import Sequence

OPERAND_DIMS = 4  # (batch, head, query, key)
NO_OPERAND_STRIDES = (0, 0, 0, 0)  # what a kernel receives for an operand the call does not have

Geometry = tuple[Sequence[int], Sequence[int]]  # a tensor's (shape, strides)


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def padded(shape: Sequence[int], strides: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A mask's or bias's shape and strides as the 4-D view it broadcasts as: left-padded with
    size-1 dims of stride 0."""
    missing = OPERAND_DIMS - len(shape)
    return (1,) * missing + tuple(shape), (0,) * missing + tuple(strides)


def padded_shape(shape: Sequence[int]) -> tuple[int, ...]:
    return (1,) * (OPERAND_DIMS - len(shape)) + tuple(shape)


def broadcast_strides(shape: Sequence[int], strides: Sequence[int]) -> tuple[int, ...]:
    """The 4 strides a kernel reads a mask or bias (or a 4-D buffer) with: 0 on its size-1 and
    padded dims."""
    shape, strides = padded(shape, strides)
    return tuple(0 if size == 1 else stride for size, stride in zip(shape, strides))


def broadcast_layout(geometry: Geometry | None, num_heads: int, group: int) -> tuple[tuple[int, ...], int]:
    """The 4 strides (`broadcast_strides`) and the head divisor of a mask or bias of `geometry`;
    four 0s and 1 for none."""
    if geometry is None:
        return NO_OPERAND_STRIDES, 1
    shape, strides = geometry
    heads = padded_shape(shape)[1]
    return broadcast_strides(shape, strides), group if heads not in (num_heads, 1) else 1


def words_readable(strides: Sequence[int], itemsize: int, address: int, word_bytes: int) -> bool:
    """Whether a kernel may read a 1-byte operand of these broadcast strides (`broadcast_strides`)
    at `address` as `word_bytes`-byte words along its rows: its key dim is contiguous and every
    row starts on a word boundary."""
    return (strides[3] == 1 and itemsize == 1 and address % word_bytes == 0
            and all(stride % word_bytes == 0 for stride in strides[:3]))
