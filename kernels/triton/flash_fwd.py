"""Flash dynamic-mask attention, forward, in Triton.

Layouts (strides are passed, only the head dim must be contiguous):
    q    (B, Lq, H, D)        k, v (B, Lk, Hkv, D)       query head h reads kv head h // GROUP
    mask (B|1, H|Hkv|1, Lq|1, Lk|1) as stride-0 views     bias: same broadcast rule; one whose
    query dim broadcasts (BIAS_PER_KEY) is read as one vector per key tile (`common.load_bias`)
    out  (B, Lq, H, D)        lse  (B, H, Lq) fp32
Packed sequences (VARLEN): B = 1 and program b works on sequence b (`common.packed_sequence`):
its rows start at cu_seqlens_q[b] of q, out and lse, its keys at cu_seqlens_k[b] of k and v, and
the mask and bias move by stride_ms / stride_bs per key it starts at (a per-key layout's key
stride; 0 for a per-query-row layout (H|Hkv|1, total_q, max_seqlen_k), whose column j is key j of
the row's own sequence) and by their row stride per row it starts at.

Math, per (b, h) and query row i (scores as in `common.py`):
    m_i   = max_j s_ij
    l_i   = sum_j exp(s_ij - m_i)
    out_i = sum_j exp(s_ij - m_i) v_j / l_i
    lse_i = m_i + log(l_i)
computed online over key tiles (FlashAttention-2). A row with no visible key (m_i = -inf) is
"dead": out_i = 0, lse_i = -inf, never NaN. On 16-bit inputs m is kept in log2 units (m' =
m * log2(e)) and exp(s - m) = exp2(fma(s, log2(e), -m')): one FMA per element, the factor riding
on it (with neither bias nor softcap s is the raw q.k and the FMA takes scale * log2(e)); lse_i =
m'_i / log2(e) + log(l_i). fp32 keeps natural units (`score_dot` says why).

Skipped work: key tiles beyond the causal diagonal or outside the window (HAS_WINDOW) are
outside the loop bounds. Interior tiles (inside Lk and the window of every row of the block, left
of the diagonal of its first row) skip the bounds, causal and window tests: without a mask they
need no visibility test at all, with one only the mask's. The window's leading edge tiles come
first, the interior tiles next, the diagonal (trailing window edge) and the Lk tail last. With a
mask of a dense call the loops walk only the tiles the activity summary lists (`activity.py`): a
tile with no visible position loads no K, V, mask or bias and issues no dot, and the loops have
no branch to stop Triton from pipelining loads. Packed sequences read their mask tile by tile
within their bounds (the activity summary is laid out by batch row, not by sequence).
"""

import triton
import triton.language as tl

from dmattn_kernels.triton.common import (
    LOG2E,
    above_by_an_ulp,
    key_tiles,
    listed_below,
    listed_block,
    load_keep,
    packed_sequence,
    score_dot,
    scores_tile,
    visible_tile,
    window_key_range,
)


@triton.jit
def _load_kv_tile(desc, base, b, h_kv, start_n, offs_d, stride_n, stride_d, seqlen_k, HEAD_DIM: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, CHECK_KEYS: tl.constexpr, USE_TMA: tl.constexpr):
    """The (BLOCK_N, BLOCK_D) K or V tile of keys start_n.., 0 on rows past Lk and lanes past HEAD_DIM.

    USE_TMA: a bulk tensor copy through `desc`, a (B, Lk, Hkv, HEAD_DIM) descriptor that
    zero-fills past its bounds, so no lane computes an address or a predicate (H200, W3 forward
    64x64 w4 s3: 0.316 -> 0.310 ms, commit e3911c9). Otherwise pointer loads from
    `base`; interior tiles (CHECK_KEYS off: the caller knows them inside Lk) of a power-of-two
    head dim load with no predicate at all.
    """
    if USE_TMA:
        return desc.load([b, start_n, h_kv, 0]).reshape(BLOCK_N, BLOCK_D)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    ptrs = base + offs_n[:, None] * stride_n + offs_d[None, :] * stride_d
    if CHECK_KEYS:
        return tl.load(ptrs, mask=(offs_n[:, None] < seqlen_k) & (offs_d[None, :] < HEAD_DIM), other=0.0)
    elif BLOCK_D == HEAD_DIM:
        return tl.load(ptrs)
    else:
        return tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)


@triton.jit
def _online_softmax_step(
    q,
    m_i,
    l_i,
    acc,
    k_desc,
    v_desc,
    k_base,
    v_base,
    bias_base,
    b,
    h_kv,
    offs_m,
    start_n,
    offs_d,
    visible,
    stride_kn,
    stride_kd,
    stride_vn,
    stride_vd,
    stride_bm,
    stride_bn,
    seqlen_q,
    seqlen_k,
    softmax_scale,
    softcap,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    MASKED: tl.constexpr,
    EDGE: tl.constexpr,
    UNITS: tl.constexpr,
    USE_TMA: tl.constexpr,
    BIAS_PER_KEY: tl.constexpr,
):
    """One key tile of the online softmax. MASKED: apply `visible` (else the tile is wholly
    visible); EDGE: the tile may cross Lk or the causal diagonal (else `visible_tile`'s interior)."""
    # -- load k, v (rows past Lk and lanes past HEAD_DIM read as 0, never as memory) --
    k = _load_kv_tile(k_desc, k_base, b, h_kv, start_n, offs_d, stride_kn, stride_kd, seqlen_k, HEAD_DIM, BLOCK_N,
                      BLOCK_D, EDGE, USE_TMA)
    qk = score_dot(q, tl.trans(k))
    offs_n = start_n + tl.arange(0, BLOCK_N)
    if HAS_BIAS or HAS_SOFTCAP:
        s, _ = scores_tile(
            qk, bias_base, offs_m[:, None], offs_n[None, :], stride_bm, stride_bn, visible, seqlen_q, seqlen_k,
            softmax_scale, softcap, HAS_SOFTCAP, HAS_BIAS, MASKED, EDGE, BIAS_PER_KEY,
        )
        # natural units: UNITS rides on the exp2 FMA below, not on a multiply per element of s
        # and of the bias (H200, W1 forward 128x128 w8 s2, with the interior loop: -62 of 1211
        # instructions per step in the sm90 SASS, 0.787 -> 0.709 ms, commit fe4de37)
        s_scale = UNITS
        row_max = tl.max(s, 1) * s_scale
    else:
        # s = qk * scale' with scale' = scale * UNITS > 0, so max_j s = scale' * max_j qk exactly
        # (rounding is monotone) and exp2 below takes qk * scale' - m as one FMA per element, an
        # explicit one (Triton 3.10 turns implicit FP fusion off by default)
        # (H200, W3 forward 64x64 w4 s3: 0.322 -> 0.316 ms, commit e3911c9)
        s = tl.where(visible, qk, float("-inf")) if MASKED else qk
        s_scale = softmax_scale * UNITS
        row_max = tl.max(s, 1) * s_scale
    # -- online softmax, m in UNITS (LOG2E: log2 units, exp2 takes s * s_scale - m as it is; 1:
    # natural units, scaled by LOG2E); a row that has seen nothing visible keeps m = -inf and
    # shifts by 0. Only an excluded position or a -inf bias makes a score -inf: a wholly visible
    # tile without bias needs no test (H200, W3 forward: 1.196 -> 1.188 x cuDNN). In log2 units the
    # shift is the row max an ulp up: the FMA takes the exact product s * s_scale, up to half an ulp
    # above its rounded max, which at |s| ~ 1e9 (a -1e9 fp32 bias on a whole row) is 64: p was
    # 2^64, inf once cast to fp16, and out NaN. An ulp up keeps every exp2 argument <= 0, p <= 1,
    # at one step per row, not per element; past |s| ~ 5e8 the ulp underflows every p and the row
    # comes out dead (out 0), never NaN. fp32 (s_scale 1 with a bias) needs none of it --
    if UNITS == 1.0:
        m_new = tl.maximum(m_i, row_max)
    else:
        m_new = tl.maximum(m_i, above_by_an_ulp(row_max))
    if MASKED or HAS_BIAS:
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_shift = m_new
    alpha = tl.exp2((m_i - m_shift) * (LOG2E / UNITS))
    p = tl.exp2(tl.fma(s, s_scale, -m_shift[:, None]) * (LOG2E / UNITS))
    l_i = l_i * alpha + tl.sum(p, 1)
    v = _load_kv_tile(v_desc, v_base, b, h_kv, start_n, offs_d, stride_vn, stride_vd, seqlen_k, HEAD_DIM, BLOCK_N,
                      BLOCK_D, EDGE, USE_TMA)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def _prefetch_keep(mask_base, blocks, first, i, num_blocks, offs_m, stride_mm, stride_mn, seqlen_q, seqlen_k,
                   BLOCK_N: tl.constexpr, HAS_MASK: tl.constexpr, LISTED: tl.constexpr):
    """The mask tile of the loop's i-th key tile (0 past the loop's end, or without a mask)."""
    offs_n = listed_block(blocks, i, num_blocks, LISTED, first) * BLOCK_N + tl.arange(0, BLOCK_N)
    return load_keep(mask_base, offs_m[:, None], offs_n[None, :], stride_mm, stride_mn, seqlen_q, seqlen_k,
                     i < num_blocks, HAS_MASK)


@triton.jit
def _listed_step(
    q, m_i, l_i, acc, keep, k_desc, v_desc, k_base, v_base, mask_base, bias_base, blocks, first, i, num_blocks,
    b, h_kv, offs_m, offs_d, stride_kn, stride_kd, stride_vn, stride_vd, stride_mm, stride_mn,
    stride_bm, stride_bn, seqlen_q, seqlen_k, softmax_scale, softcap, window_left, window_right,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, IS_CAUSAL: tl.constexpr,
    HAS_MASK: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_BIAS: tl.constexpr, EDGE: tl.constexpr,
    UNITS: tl.constexpr, USE_TMA: tl.constexpr, BIAS_PER_KEY: tl.constexpr, LISTED: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
):
    """The loop's i-th key tile, whose mask tile `keep` the previous step loaded; returns the
    updated (m_i, l_i, acc) and the next tile's mask. Triton's pipeliner leaves the byte-wide mask
    load in place, so it is issued one tile ahead (`load_keep`)."""
    start_n = listed_block(blocks, i, num_blocks, LISTED, first) * BLOCK_N
    keep_next = _prefetch_keep(mask_base, blocks, first, i + 1, num_blocks, offs_m, stride_mm, stride_mn, seqlen_q,
                               seqlen_k, BLOCK_N, HAS_MASK, LISTED)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    visible = visible_tile(keep, offs_m[:, None], offs_n[None, :], seqlen_q, seqlen_k, IS_CAUSAL, HAS_MASK, EDGE,
                           HAS_WINDOW, window_left, window_right)
    m_i, l_i, acc = _online_softmax_step(
        q, m_i, l_i, acc, k_desc, v_desc, k_base, v_base, bias_base, b, h_kv, offs_m, start_n, offs_d, visible,
        stride_kn, stride_kd, stride_vn, stride_vd, stride_bm, stride_bn, seqlen_q, seqlen_k, softmax_scale,
        softcap, HEAD_DIM, BLOCK_N, BLOCK_D, HAS_SOFTCAP, HAS_BIAS, HAS_MASK or EDGE, EDGE, UNITS, USE_TMA,
        BIAS_PER_KEY,
    )
    return m_i, l_i, acc, keep_next


@triton.jit
def flash_fwd_kernel(
    q_ptr, k_ptr, v_ptr, mask_ptr, bias_ptr, out_ptr, lse_ptr, blocks_ptr, cu_seqlens_q_ptr, cu_seqlens_k_ptr,
    seqused_k_ptr, k_desc, v_desc,
    stride_qb, stride_qm, stride_qh, stride_qd,
    stride_kb, stride_kn, stride_kh, stride_kd,
    stride_vb, stride_vn, stride_vh, stride_vd,
    stride_mb, stride_mh, stride_mm, stride_mn,
    stride_bb, stride_bh, stride_bm, stride_bn,
    stride_ob, stride_om, stride_oh, stride_od,
    stride_lb, stride_lh, stride_lm,
    stride_blb, stride_blh, stride_blm,
    stride_ms, stride_bs,
    num_heads, seqlen_q, seqlen_k,
    mask_head_div, bias_head_div,
    softmax_scale, softcap,
    window_left, window_right,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    HAS_MASK: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    USE_TMA: tl.constexpr,
    BIAS_PER_KEY: tl.constexpr,
    LISTED: tl.constexpr,
    VARLEN: tl.constexpr,
    HAS_SEQUSED: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
):
    """LISTED: the mask comes with its activity schedule (`blocks_ptr`); VARLEN: packed
    sequences (module docstring), seqlen_q / seqlen_k their longest, HAS_SEQUSED: seqused_k
    gives their key counts; HAS_WINDOW: the sliding window (window_left, window_right)."""
    tl.static_assert(BLOCK_D >= HEAD_DIM)
    tl.static_assert(not (VARLEN and (USE_TMA or LISTED)))
    tl.static_assert(BLOCK_M >= 16 and BLOCK_N >= 16)
    # 16-bit inputs keep scores in log2 units (`scores_tile`); fp32 (the interpreter tier) keeps
    # natural units, so its scores equal the backward's recomputed ones bit for bit (`score_dot`)
    UNITS: tl.constexpr = 1.0 if q_ptr.dtype.element_ty == tl.float32 else LOG2E
    # causal: the last query blocks do the most work; scheduled first, they do not trail the grid
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // num_heads).to(tl.int64)
    h = (pid_bh % num_heads).to(tl.int64)
    h_kv = h // GROUP
    b_tma, h_kv_tma = b.to(tl.int32), h_kv.to(tl.int32)  # descriptor coordinates are 32-bit

    if VARLEN:
        q_start, k_start, seqlen_q, seqlen_k = packed_sequence(cu_seqlens_q_ptr, cu_seqlens_k_ptr, seqused_k_ptr, b,
                                                               seqlen_q, seqlen_k, HAS_SEQUSED)
        if pid_m * BLOCK_M >= seqlen_q:  # the grid covers the longest sequence
            return
        q_row0 = q_start * stride_qm
        o_row0 = q_start * stride_om
        l_row0 = q_start * stride_lm
        k_row0 = k_start * stride_kn
        v_row0 = k_start * stride_vn
        mask_row0 = q_start * stride_mm + k_start * stride_ms
        bias_row0 = q_start * stride_bm + k_start * stride_bs
    else:
        q_row0 = b * stride_qb
        o_row0 = b * stride_ob
        l_row0 = b * stride_lb
        k_row0 = b * stride_kb
        v_row0 = b * stride_vb
        mask_row0 = b * stride_mb
        bias_row0 = b * stride_bb
    q_base = q_ptr + q_row0 + h * stride_qh
    k_base = k_ptr + k_row0 + h_kv * stride_kh
    v_base = v_ptr + v_row0 + h_kv * stride_vh
    mask_base = mask_ptr + mask_row0 + (h // mask_head_div) * stride_mh
    bias_base = bias_ptr + bias_row0 + (h // bias_head_div) * stride_bh

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q_in = (offs_m[:, None] < seqlen_q) & (offs_d[None, :] < HEAD_DIM)
    q = tl.load(q_base + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd, mask=q_in, other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    blocks, first, num_blocks = key_tiles(
        blocks_ptr, b * stride_blb + (h // mask_head_div) * stride_blh + pid_m * stride_blm, pid_m, seqlen_q,
        seqlen_k, window_left, window_right, BLOCK_M, BLOCK_N, IS_CAUSAL, LISTED, HAS_WINDOW)
    # Interior key tiles lie inside Lk, left of the causal diagonal of the block's first row and
    # inside every row's window: every row sees them whole but for the mask (rows past Lq read
    # q = 0, stay finite and are never stored). With a window its leading edge tiles come first.
    interior_end = seqlen_k // BLOCK_N
    if IS_CAUSAL:
        interior_end = tl.minimum(interior_end, tl.maximum(pid_m * BLOCK_M + seqlen_k - seqlen_q + 1, 0) // BLOCK_N)
    num_lead = 0
    if HAS_WINDOW:
        # the block's last row sees keys from lo on, its first row up to hi - 1
        lo, _ = window_key_range(pid_m * BLOCK_M + BLOCK_M - 1, pid_m * BLOCK_M + BLOCK_M - 1, seqlen_q, seqlen_k,
                                 window_left, window_right)
        _, hi = window_key_range(pid_m * BLOCK_M, pid_m * BLOCK_M, seqlen_q, seqlen_k, window_left, window_right)
        interior_end = tl.minimum(interior_end, hi // BLOCK_N)
        num_lead = listed_below(blocks, num_blocks, tl.cdiv(lo, BLOCK_N), LISTED, first)
    num_interior = tl.maximum(listed_below(blocks, num_blocks, interior_end, LISTED, first), num_lead)

    # the mask of the first tile; each step then loads the next one's (`load_keep`)
    keep = _prefetch_keep(mask_base, blocks, first, 0, num_blocks, offs_m, stride_mm, stride_mn, seqlen_q, seqlen_k,
                          BLOCK_N, HAS_MASK, LISTED)
    if HAS_WINDOW:
        for i in range(0, num_lead):
            m_i, l_i, acc, keep = _listed_step(
                q, m_i, l_i, acc, keep, k_desc, v_desc, k_base, v_base, mask_base, bias_base, blocks, first, i,
                num_blocks, b_tma, h_kv_tma, offs_m, offs_d, stride_kn, stride_kd, stride_vn, stride_vd, stride_mm,
                stride_mn, stride_bm, stride_bn, seqlen_q, seqlen_k, softmax_scale, softcap, window_left,
                window_right, HEAD_DIM, BLOCK_N, BLOCK_D, IS_CAUSAL, HAS_MASK, HAS_SOFTCAP, HAS_BIAS, True, UNITS,
                USE_TMA, BIAS_PER_KEY, LISTED, HAS_WINDOW,
            )
    for i in range(num_lead, num_interior):
        m_i, l_i, acc, keep = _listed_step(
            q, m_i, l_i, acc, keep, k_desc, v_desc, k_base, v_base, mask_base, bias_base, blocks, first, i,
            num_blocks, b_tma, h_kv_tma, offs_m, offs_d, stride_kn, stride_kd, stride_vn, stride_vd, stride_mm,
            stride_mn, stride_bm, stride_bn, seqlen_q, seqlen_k, softmax_scale, softcap, window_left, window_right,
            HEAD_DIM, BLOCK_N, BLOCK_D, IS_CAUSAL, HAS_MASK, HAS_SOFTCAP, HAS_BIAS, False, UNITS, USE_TMA,
            BIAS_PER_KEY, LISTED, HAS_WINDOW,
        )
    # Not `num_stages=1` without a mask, though this loop then holds only the diagonal tiles and the
    # Lk tail (H200, W3 forward 64x64 w4 s3: 1.188 -> 1.178 x cuDNN): with seqlen_k specialized to
    # 1, Triton 3.6's ptxas crashed (-11) on fwd 64x64 w4 s2 (adversarial case single_key_lk1)
    for i in range(num_interior, num_blocks):
        m_i, l_i, acc, keep = _listed_step(
            q, m_i, l_i, acc, keep, k_desc, v_desc, k_base, v_base, mask_base, bias_base, blocks, first, i,
            num_blocks, b_tma, h_kv_tma, offs_m, offs_d, stride_kn, stride_kd, stride_vn, stride_vd, stride_mm,
            stride_mn, stride_bm, stride_bn, seqlen_q, seqlen_k, softmax_scale, softcap, window_left, window_right,
            HEAD_DIM, BLOCK_N, BLOCK_D, IS_CAUSAL, HAS_MASK, HAS_SOFTCAP, HAS_BIAS, True, UNITS, USE_TMA,
            BIAS_PER_KEY, LISTED, HAS_WINDOW,
        )

    # epilogue: a row with a visible key has l_i > 0 (its max contributes about exp(0) = 1); l_i == 0 is dead
    dead = l_i == 0.0
    l_safe = tl.where(dead, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(dead, float("-inf"), m_i / UNITS + tl.log(l_safe))
    out_base = out_ptr + o_row0 + h * stride_oh
    tl.store(out_base + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od, out.to(out_ptr.dtype.element_ty), mask=q_in)
    lse_base = lse_ptr + l_row0 + h * stride_lh
    tl.store(lse_base + offs_m * stride_lm, lse, mask=offs_m < seqlen_q)
