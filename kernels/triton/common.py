"""Triton helpers shared by the forward and backward dynamic-mask attention kernels.

Both directions must agree bit for bit on which positions are visible and on the scores, so the
visibility rule and the score pipeline live here once:

    visible_ij = (i < Lq) & (j < Lk) & [causal: j <= i + Lk - Lq] & [mask: mask_ij != 0]
                 & [window: i + Lk - Lq - left <= j <= i + Lk - Lq + right]
    s_ij       = scale * q_i . k_j
    s_ij       = softcap * tanh(s_ij / softcap)        (softcap > 0)
    s_ij       = s_ij + bias_ij                        (bias present; never scaled)
    s_ij       = -inf where not visible_ij             (bias at excluded positions is ignored)

Packed sequences (VARLEN in the kernels): program b works on sequence b of cu_seqlens, whose Lq
and Lk replace the call's (`packed_sequence`); rows and keys are counted from the sequence's
first, so every rule above, the causal diagonal included, holds per sequence. A window side the
caller leaves unbounded (-1) arrives as Lq + Lk of the call: wider than any row's keys.
"""

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)  # 1/ln(2): exp(x) == exp2(x * LOG2E); exp2 is the native unit
FP32_EPS = tl.constexpr(1.1920928955078125e-07)  # 2^-23: x * (1 + FP32_EPS) is at least one ulp above x > 0


@triton.jit
def above_by_an_ulp(x):
    """x moved up (towards +inf) by one to two ulps; +-inf and 0 unchanged, never NaN (a finite x
    within 2 ulps of the largest float becomes +inf)."""
    return tl.maximum(x * (1.0 + FP32_EPS), x * (1.0 - FP32_EPS))


@triton.jit
def tanh(x):
    """tanh(x) = 1 - 2 / (exp(2x) + 1): saturates to +-1 (exp overflows to inf, 2/inf = 0)
    instead of producing inf/inf, and needs no libdevice call, so it also runs in the interpreter."""
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def load_keep(mask_base, rows, cols, stride_mm, stride_mn, seqlen_q, seqlen_k, wanted, HAS_MASK: tl.constexpr):
    """The mask tile at `rows` x `cols` (index tensors as in `visible_tile`); 0 outside the
    sequence bounds, so memory past a sliced mask's logical extent is never read, and everywhere
    when `wanted` is false (a prefetch past the end of a tile list). Without a mask: 0.

    The attention loops load the next tile's mask one iteration ahead and carry it. Triton's
    pipeliner leaves this byte-wide load where it is (sm90 TTGIR, triton 3.9: a plain tt.load
    feeding a convert_layout, where the bias, K and V loads of the same loop become async
    copies), so loaded in place every tile waited a full memory latency before its first dot.

    The load is predicated on the bounds alone, not on the causal rule: a per-element predicate
    keeps Triton from vectorising it (one byte per load instruction; H100, 2026-11-21, commit dbbaa01:
    the W1 forward took 2.12 ms before this and the same change in `scores_tile`).
    """
    if HAS_MASK:
        # `wanted` enters through the bound: the interpreter rejects a mask that ANDs in a scalar
        in_bounds = (rows < seqlen_q) & (cols < tl.where(wanted, seqlen_k, 0))
        return tl.load(mask_base + rows * stride_mm + cols * stride_mn, mask=in_bounds, other=0)
    else:
        return 0


@triton.jit
def packed_sequence(cu_seqlens_q_ptr, cu_seqlens_k_ptr, seqused_k_ptr, b, max_seqlen_q, max_seqlen_k,
                    HAS_SEQUSED: tl.constexpr):
    """(first query row, first key row, Lq, Lk) of packed sequence b: rows cu_seqlens_q[b] ..
    cu_seqlens_q[b + 1] - 1, keys from cu_seqlens_k[b], seqused_k[b] of them when given, else up
    to cu_seqlens_k[b + 1]. The lengths are clamped to [0, max_seqlen]: the grid covers
    max_seqlen_q rows and a per-row mask has max_seqlen_k columns, so no program reads past them
    whatever the prefix sums hold. The row offsets are int64 (they scale strides)."""
    q_start = tl.load(cu_seqlens_q_ptr + b)
    k_start = tl.load(cu_seqlens_k_ptr + b)
    seqlen_q = tl.load(cu_seqlens_q_ptr + b + 1) - q_start
    if HAS_SEQUSED:
        seqlen_k = tl.load(seqused_k_ptr + b)
    else:
        seqlen_k = tl.load(cu_seqlens_k_ptr + b + 1) - k_start
    seqlen_q = tl.minimum(tl.maximum(seqlen_q, 0), max_seqlen_q)
    seqlen_k = tl.minimum(tl.maximum(seqlen_k, 0), max_seqlen_k)
    return q_start.to(tl.int64), k_start.to(tl.int64), seqlen_q, seqlen_k


@triton.jit
def window_key_range(first_row, last_row, seqlen_q, seqlen_k, window_left, window_right):
    """[lo, hi): the keys rows first_row .. last_row see under the window (before the mask),
    clipped to [0, Lk]; lo >= hi when they see none. Row i sees i + Lk - Lq - left ..
    i + Lk - Lq + right."""
    lo = tl.maximum(first_row + (seqlen_k - seqlen_q) - window_left, 0)
    hi = tl.minimum(last_row + (seqlen_k - seqlen_q) + window_right + 1, seqlen_k)
    return lo, hi


@triton.jit
def window_query_range(first_key, last_key, seqlen_q, seqlen_k, window_left, window_right):
    """[lo, hi): the query rows that see any of keys first_key .. last_key under the window,
    clipped to [0, Lq] (`window_key_range` turned around)."""
    lo = tl.maximum(first_key - (seqlen_k - seqlen_q) - window_right, 0)
    hi = tl.minimum(last_key - (seqlen_k - seqlen_q) + window_left + 1, seqlen_q)
    return lo, hi


@triton.jit
def visible_tile(
    keep,
    rows,
    cols,
    seqlen_q,
    seqlen_k,
    IS_CAUSAL: tl.constexpr,
    HAS_MASK: tl.constexpr,
    EDGE: tl.constexpr = True,
    HAS_WINDOW: tl.constexpr = False,
    window_left=0,
    window_right=0,
):
    """Boolean tile of positions that take part in the softmax.

    `rows` (query indices) and `cols` (key indices) are broadcastable 2-D index tensors:
    `offs_m[:, None], offs_n[None, :]` gives a (BLOCK_M, BLOCK_N) tile, `offs_m[None, :],
    offs_n[:, None]` its key-major transpose. `keep` is the mask tile from `load_keep` at the
    same indices (ignored without a mask).

    EDGE=False is for an interior tile: the caller knows every key of it inside Lk and seen by
    every query of it under the causal rule and the window, so only the mask and the query bound
    decide. HAS_WINDOW: keys outside row i's window_left/window_right are excluded. The
    full rule costs integer instructions on every element of every tile (sm90 SASS counts in
    commit fe4de37).
    """
    if EDGE:
        visible = (rows < seqlen_q) & (cols < seqlen_k)
        if IS_CAUSAL:
            # bottom-right alignment: query i sees key j iff j <= i + Lk - Lq
            visible = visible & (cols <= rows + (seqlen_k - seqlen_q))
        if HAS_WINDOW:
            diagonal = rows + (seqlen_k - seqlen_q)
            visible = visible & (cols >= diagonal - window_left) & (cols <= diagonal + window_right)
        if HAS_MASK:
            visible = visible & (keep != 0)
    elif HAS_MASK:
        visible = keep != 0  # the whole rule here: `load_keep` reads 0 past Lq
    else:
        visible = rows < seqlen_q
    return visible


@triton.jit
def score_dot(a, b):
    """a @ b for the scores; fp32 inputs (the interpreter tier) take exact fp64 products.

    fp32: one rounding of an exact product, so the backward's recomputed scores equal the
    forward's bit for bit whatever the tile shapes. With logits near 250 one ulp of
    disagreement is 1.5e-5 relative in P; measured: dV 3x over the §2 bound (large_logits case,
    forward 16x32 vs backward 32x16 tiles, interpreter, 2026-11-21).
    """
    if a.dtype == tl.float32:
        return tl.dot(a.to(tl.float64), b.to(tl.float64)).to(tl.float32)
    else:
        return tl.dot(a, b)


@triton.jit
def load_bias(bias_base, rows, cols, stride_bm, stride_bn, seqlen_q, seqlen_k, wanted, EDGE: tl.constexpr,
              BIAS_PER_KEY: tl.constexpr):
    """The bias at `rows` x `cols` (index tensors as in `visible_tile`), 0 outside the sequence
    bounds and everywhere when `wanted` is false (a prefetch past a tile list's end).

    EDGE=False: the caller knows every key inside Lk, so only the query bound is tested.
    BIAS_PER_KEY: the row stride is 0, so the bias is one value per key: only the key vector is
    read, (1, N) or (N, 1) as `cols` is, and it broadcasts over the queries where it is added.
    A full tile of a stride-0 bias costs the same loads, shared-memory staging and conversions as
    a real one (H100, W2's (B, Hkv, 1, L) bias, tile -> vector: forward 128x128 w8 s2 0.682 ->
    0.522 ms, backward 64x64 dq64x32 w4 s2 2.485 -> 1.863 ms, commit 6bba9a8).
    """
    if BIAS_PER_KEY:
        if EDGE:
            return tl.load(bias_base + cols * stride_bn, mask=cols < tl.where(wanted, seqlen_k, 0), other=0.0)
        else:
            return tl.load(bias_base + cols * stride_bn)
    else:
        # `wanted` enters through the bound: the interpreter rejects a mask that ANDs in a scalar
        if EDGE:
            in_bounds = (rows < tl.where(wanted, seqlen_q, 0)) & (cols < seqlen_k)
        else:
            in_bounds = rows < tl.where(wanted, seqlen_q, 0)
        return tl.load(bias_base + rows * stride_bm + cols * stride_bn, mask=in_bounds, other=0.0)


@triton.jit
def scores_tile(
    qk,
    bias_base,
    rows,
    cols,
    stride_bm,
    stride_bn,
    visible,
    seqlen_q,
    seqlen_k,
    softmax_scale,
    softcap,
    HAS_SOFTCAP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    MASKED: tl.constexpr = True,
    EDGE: tl.constexpr = True,
    BIAS_PER_KEY: tl.constexpr = False,
):
    """Scores of one tile from its raw q.k products, -inf where not visible.

    MASKED=False is for tiles the caller knows to be wholly visible: `visible` is then ignored.
    EDGE=False is for an interior tile (`visible_tile`): the bias load checks the query bound only.
    BIAS_PER_KEY: the bias broadcasts over the queries (its row stride is 0, e.g. (B, Hkv, 1, Lk)):
    one value per key is read and added along `rows` (`load_bias`).

    The bias is read everywhere inside the sequence bounds and discarded by the final `where`
    at excluded positions, so NaN/inf there never reaches a result; predicating its load on
    `visible` instead would make it wait for the mask load and defeat vectorisation.

    Returns:
        (s, capped): the masked scores (fp32) and tanh(scale*qk/softcap) (the softcap backward
        needs 1 - capped^2; it is a dummy when HAS_SOFTCAP is off).
    """
    if HAS_SOFTCAP:
        capped = tanh(qk * softmax_scale / softcap)
        s = softcap * capped
    else:
        s = qk * softmax_scale
        capped = s
    if HAS_BIAS:
        bias = load_bias(bias_base, rows, cols, stride_bm, stride_bn, seqlen_q, seqlen_k, True, EDGE, BIAS_PER_KEY)
        s = s + bias.to(tl.float32)
    if MASKED:
        s = tl.where(visible, s, float("-inf"))
    return s, capped


@triton.jit
def listed_block(blocks, i, num_blocks, LISTED: tl.constexpr, first=0):
    """The i-th tile index a loop visits (0 for i >= num_blocks with a list, a prefetch past the end).

    LISTED (a mask with its activity schedule): `blocks` points at one row of
    `schedule.block_lists`: [count, index_0, index_1, ...], the tiles that hold a visible
    position, increasing. Without one every tile in the loop bounds is visited, from `first`.
    """
    if LISTED:
        return tl.load(blocks + 1 + i, mask=i < num_blocks, other=0)
    else:
        return first + i


@triton.jit
def listed_below(blocks, num_blocks, bound, LISTED: tl.constexpr, first=0, CHUNK: tl.constexpr = 64):
    """How many of the first `num_blocks` tiles a loop visits have an index below `bound`.

    With a list the indices increase (`listed_block`), so these are the first ones; the
    scan reads the list once per program. Without one the loop visits first, first + 1, ... itself.
    """
    if LISTED:
        count = 0
        for start in range(0, num_blocks, CHUNK):
            at = start + tl.arange(0, CHUNK)
            tiles = tl.load(blocks + 1 + at, mask=at < num_blocks, other=0)
            count += tl.sum(((tiles < bound) & (at < num_blocks)).to(tl.int32), 0)
        return count
    else:
        return tl.minimum(tl.maximum(bound - first, 0), num_blocks)


@triton.jit
def key_tiles(blocks_ptr, list_offset, pid_m, seqlen_q, seqlen_k, window_left, window_right, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr, LISTED: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """The key tiles query block `pid_m` visits, as (blocks, first, count) for `listed_block`.

    LISTED: the block-list row at `blocks_ptr + list_offset` (`schedule.block_lists`; its
    activity pass applied the causal rule and the window). Otherwise every tile up to Lk or,
    causal, up to the diagonal of the block's last row; with a window, from the tile of the
    block's first row's first key to that of its last row's last.
    """
    first = 0
    if LISTED:
        blocks = blocks_ptr + list_offset
        num_blocks = tl.load(blocks)
    else:
        blocks = blocks_ptr
        n_end = seqlen_k
        if IS_CAUSAL:
            # the last row of the block sees keys up to (pid_m + 1) * BLOCK_M - 1 + Lk - Lq
            n_end = tl.minimum(seqlen_k, (pid_m + 1) * BLOCK_M + seqlen_k - seqlen_q)
        if HAS_WINDOW:
            n_start, n_end_window = window_key_range(pid_m * BLOCK_M, pid_m * BLOCK_M + BLOCK_M - 1, seqlen_q,
                                                     seqlen_k, window_left, window_right)
            n_end = tl.minimum(n_end, n_end_window)
            first = n_start // BLOCK_N
        num_blocks = tl.maximum(tl.cdiv(n_end, BLOCK_N) - first, 0)
    return blocks, first, num_blocks
