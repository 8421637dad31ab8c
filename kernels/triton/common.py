"""Triton helpers shared by the forward and backward dynamic-mask attention kernels.

Both directions must agree bit for bit on which positions are visible and on the scores, so the
visibility rule and the score pipeline live here once:

    visible_ij = (i < Lq) & (j < Lk) & [causal: j <= i + Lk - Lq] & [mask: mask_ij != 0]
    s_ij       = scale * q_i . k_j
    s_ij       = softcap * tanh(s_ij / softcap)        (softcap > 0)
    s_ij       = s_ij + bias_ij                        (bias present; never scaled)
    s_ij       = -inf where not visible_ij             (bias at excluded positions is ignored)
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
def visible_tile(
    keep,
    rows,
    cols,
    seqlen_q,
    seqlen_k,
    IS_CAUSAL: tl.constexpr,
    HAS_MASK: tl.constexpr,
    EDGE: tl.constexpr = True,
):
    """Boolean tile of positions that take part in the softmax.

    `rows` (query indices) and `cols` (key indices) are broadcastable 2-D index tensors:
    `offs_m[:, None], offs_n[None, :]` gives a (BLOCK_M, BLOCK_N) tile, `offs_m[None, :],
    offs_n[:, None]` its key-major transpose. `keep` is the mask tile from `load_keep` at the
    same indices (ignored without a mask).

    EDGE=False is for an interior tile: the caller knows every key of it inside Lk and seen by
    every query of it under the causal rule, so only the mask and the query bound decide. The
    full rule costs integer instructions on every element of every tile (sm90 SASS counts in
    commit fe4de37).
    """
    if EDGE:
        visible = (rows < seqlen_q) & (cols < seqlen_k)
        if IS_CAUSAL:
            # bottom-right alignment: query i sees key j iff j <= i + Lk - Lq
            visible = visible & (cols <= rows + (seqlen_k - seqlen_q))
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
def listed_block(blocks, i, num_blocks, HAS_MASK: tl.constexpr):
    """The i-th tile index a loop visits (0 for i >= num_blocks, a prefetch past the end).

    With a mask, `blocks` points at one row of `schedule.block_lists`: [count, index_0, index_1,
    ...], the tiles that hold a visible position, increasing. Without one every tile in the loop
    bounds is visited and the index is `i` itself.
    """
    if HAS_MASK:
        return tl.load(blocks + 1 + i, mask=i < num_blocks, other=0)
    else:
        return i


@triton.jit
def listed_below(blocks, num_blocks, bound, HAS_MASK: tl.constexpr, CHUNK: tl.constexpr = 64):
    """How many of the first `num_blocks` tiles a loop visits have an index below `bound`.

    With a mask the listed indices increase (`listed_block`), so these are the first ones; the
    scan reads the list once per program. Without a mask the loop visits 0, 1, ... itself.
    """
    if HAS_MASK:
        count = 0
        for start in range(0, num_blocks, CHUNK):
            at = start + tl.arange(0, CHUNK)
            tiles = tl.load(blocks + 1 + at, mask=at < num_blocks, other=0)
            count += tl.sum(((tiles < bound) & (at < num_blocks)).to(tl.int32), 0)
        return count
    else:
        return tl.minimum(tl.maximum(bound, 0), num_blocks)


@triton.jit
def key_tiles(blocks_ptr, list_offset, pid_m, seqlen_q, seqlen_k, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              IS_CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr):
    """The key tiles query block `pid_m` visits, as (blocks, count) for `listed_block`.

    With a mask: the block-list row at `blocks_ptr + list_offset` (`schedule.block_lists`).
    Without one: every tile up to Lk or, causal, up to the diagonal of the block's last row.
    """
    if HAS_MASK:
        blocks = blocks_ptr + list_offset
        num_blocks = tl.load(blocks)
    else:
        blocks = blocks_ptr
        n_end = seqlen_k
        if IS_CAUSAL:
            # the last row of the block sees keys up to (pid_m + 1) * BLOCK_M - 1 + Lk - Lq
            n_end = tl.minimum(seqlen_k, (pid_m + 1) * BLOCK_M + seqlen_k - seqlen_q)
        num_blocks = tl.cdiv(n_end, BLOCK_N)
    return blocks, num_blocks
