"""Flash dynamic-mask attention, forward for short queries (decode), in Triton: split-KV with the
query heads of a KV group packed into one tile.

Layouts as in `flash_fwd.py`; `seqlens` (B,) int32 optional (`cache_seqlens`): sequence b has
L_b = clamp(seqlens[b], 0, Lk) keys and every rule reads L_b for Lk, so no key at or past it is
loaded (a cache's tail may hold anything, NaN included). PAGED: k and v are (blocks, PAGE_SIZE,
Hkv, D) and key j of sequence b is row j % PAGE_SIZE of block `block_table[b, j // PAGE_SIZE]`
(Lk = pages * PAGE_SIZE); a key tile never straddles two pages (BLOCK_N divides PAGE_SIZE), so
each tile reads one table entry and then loads as from a contiguous cache. An entry outside
[0, num_blocks) names no block of the cache: its keys are excluded, as if masked, and no load
reaches past the cache.

Rows: one program owns up to BLOCK_M rows r of one (batch, kv head), r = i * GROUP + g for query
i < Lq and group member g < GROUP (query head h = h_kv * GROUP + g): a K, V, mask and bias tile
is read once for the whole group instead of once per query head, and Lq * GROUP rows fill a
tensor-core tile that one decode row alone would leave 1/16 full. Scores per row, as the prefill:

    s_rj = scale * q_r . k_j ; softcap ; + bias_rj ; -inf unless mask_rj and j < L_b and
           (not causal or j <= i_r + L_b - Lq) and
           (not HAS_WINDOW or i_r + L_b - Lq - left <= j <= i_r + L_b - Lq + right)

HAS_WINDOW: a sliding window (FlashAttention's `window_size`, inclusive, bottom-right aligned per
sequence) with bounds `window_left`, `window_right` >= 0, runtime ints: one compile serves every
window (`configs.window_bounds` gives an unbounded side a bound that excludes no key). A
program's rows see keys [lo, hi] = [its first row's lower bound, its last row's upper bound] at
most (both grow with i), and that span, not the cache, is what its splits cut: a key tile wholly
outside it is never visited (no K, V, mask, bias or page-table read), so a 1k window over a 128k
cache costs ~1k keys per program. Inside a visited tile, keys before lo read as 0 like keys past
the range, and each row's own bounds exclude the rest per element, as the causal rule does.

Split-KV: the keys are cut into `num_splits` ranges of `keys_per_split` (a multiple of BLOCK_N),
one program each, so a short query still fills the GPU; with `seqlens` the ranges cut each
sequence's own L_b keys evenly (ceil(ceil(L_b / BLOCK_N) / num_splits) tiles each). With a mask
shared by a program's rows (a padding mask), a program first scans its range of the mask,
MASK_SCAN keys at a time, and reads K and V only from the first key kept to the last: a padding
mask's tail (and head) is never read, as a tail past L_b is not. MASK_SPANS: the kept span of
each padding-mask row was found first (`decode_mask_span_kernel`, per chunk of keys), and the
splits cut that span evenly, as they cut L_b: a short window of a long cache (a sliding window,
a cache allocated far past its filled length) spreads over every split instead of the few whose
ranges hold it. With a window (the launcher runs the pass only where it has no left bound) the
splits cut that span up to the window's end.

Each program keeps the online softmax over its range (natural units, fp32: m_r = running max,
l_r = sum exp(s - m_r)) and, with one split, writes out and lse itself; with several it writes
its partial o_rs = acc / l (0 if dead) and lse_rs = m + log l (-inf if dead), and
`decode_combine_kernel` merges them in split order (deterministic):

    lse_r = M + log(sum_s exp(lse_rs - M)),  M = max_s lse_rs ;  out_r = sum_s exp(lse_rs - lse_r) o_rs

A row with no visible key anywhere has every lse_rs = -inf: out 0, lse -inf, never NaN.
"""

import triton
import triton.language as tl

from dmattn_kernels.triton.common import tanh


# the window's bounds are not specialized on (a value of 1, a multiple of 16): one compile serves
# every window a model's layers use
@triton.jit(do_not_specialize=["window_left", "window_right"])
def flash_decode_kernel(
    q_ptr, k_ptr, v_ptr, mask_ptr, bias_ptr, seqlens_ptr, block_table_ptr, spans_ptr, out_ptr, lse_ptr,
    stride_qb, stride_qm, stride_qh, stride_qd,
    stride_kb, stride_kn, stride_kh, stride_kd,
    stride_vb, stride_vn, stride_vh, stride_vd,
    stride_mb, stride_mh, stride_mm, stride_mn,
    stride_bb, stride_bh, stride_bm, stride_bn,
    stride_os, stride_ob, stride_om, stride_oh, stride_od,
    stride_ls, stride_lb, stride_lh, stride_lm,
    stride_tb, num_blocks,
    num_heads_kv, seqlen_q, seqlen_k, keys_per_split, num_span_chunks,
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
    HAS_SEQLENS: tl.constexpr,
    MASK_SHARED: tl.constexpr,
    BIAS_SHARED: tl.constexpr,
    PAGED: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    MASK_SCAN: tl.constexpr,
    MASK_SPANS: tl.constexpr,
    SPAN_CHUNKS: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
):
    """Grid (num_splits, B * Hkv, ceil(Lq * GROUP / BLOCK_M)). MASK_SHARED / BIAS_SHARED: every
    row of a program reads the same mask / bias row (no query dim, one head per KV group or
    none: a padding mask, a per-key bias), loaded once per key tile as a vector. `out`/`lse` are the final
    (B, Lq, H, D) / (B, H, Lq) tensors with one split (stride_os = stride_ls = 0), else the fp32
    partials (splits, B, Lq, H, D) / (splits, B, H, Lq). MASK_SPANS (with MASK_SHARED): `spans`
    holds `decode_mask_span_kernel`'s (B * Hkv, 2, num_span_chunks) chunk spans; SPAN_CHUNKS >=
    num_span_chunks. HAS_WINDOW: `window_left`, `window_right` >= 0 bound each row's keys (module
    docstring); read only under it."""
    tl.static_assert(BLOCK_D >= HEAD_DIM)
    tl.static_assert(not MASK_SPANS or (HAS_MASK and MASK_SHARED))
    tl.static_assert(BLOCK_M >= 16 and BLOCK_N >= 16)
    tl.static_assert(not PAGED or PAGE_SIZE % BLOCK_N == 0)
    split = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // num_heads_kv).to(tl.int64)
    h_kv = (pid_bh % num_heads_kv).to(tl.int64)
    seqlen_b = seqlen_k
    if HAS_SEQLENS:
        seqlen_b = tl.minimum(tl.maximum(tl.load(seqlens_ptr + b), 0), seqlen_k)

    # -- this program's rows: r = i * GROUP + g --
    offs_r = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    query = offs_r // GROUP
    head = h_kv * GROUP + offs_r % GROUP
    row_in = query < seqlen_q
    offs_d = tl.arange(0, BLOCK_D)
    q = tl.load(q_ptr + b * stride_qb + query[:, None] * stride_qm + head[:, None] * stride_qh
                + offs_d[None, :] * stride_qd, mask=row_in[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    mask_rows = mask_ptr + b * stride_mb + (head // mask_head_div) * stride_mh + query * stride_mm
    bias_rows = bias_ptr + b * stride_bb + (head // bias_head_div) * stride_bh + query * stride_bm
    mask_row = mask_ptr + b * stride_mb + (h_kv * GROUP // mask_head_div) * stride_mh  # MASK_SHARED
    bias_row = bias_ptr + b * stride_bb + (h_kv * GROUP // bias_head_div) * stride_bh  # BIAS_SHARED
    k_base = k_ptr + b * stride_kb + h_kv * stride_kh
    v_base = v_ptr + b * stride_vb + h_kv * stride_vh
    pages = block_table_ptr + b * stride_tb  # PAGED: this sequence's row of the block table
    # the last key each row may see: L_b - 1, or its causal diagonal i + L_b - Lq
    last_key = tl.full([BLOCK_M], 0, tl.int32) + seqlen_b - 1
    if IS_CAUSAL:
        last_key = query + seqlen_b - seqlen_q
    if HAS_WINDOW:
        # each row's keys [first_key, last_key] (first_key < 0, last_key >= L_b: that side unbounded);
        # the program's span from its first row's lower bound to its last row's upper bound
        diagonal = query + seqlen_b - seqlen_q
        first_key = diagonal - window_left
        last_key = tl.minimum(last_key, diagonal + window_right)
        window_start = tl.maximum(tl.min(tl.where(row_in, first_key, seqlen_b), 0), 0)
        window_end = tl.minimum(tl.max(tl.where(row_in, last_key, -1), 0) + 1, seqlen_b)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if HAS_SEQLENS:  # this sequence's own keys cut evenly, so no split waits on a longer one
        keys_per_split = tl.cdiv(tl.cdiv(seqlen_b, BLOCK_N), tl.num_programs(0)) * BLOCK_N
    start = split * keys_per_split
    end = tl.minimum(start + keys_per_split, seqlen_b)
    if MASK_SPANS:  # the splits cut the span the mask keeps, on the tile grid, evenly
        offs_c = tl.arange(0, SPAN_CHUNKS)
        chunk_spans = spans_ptr + pid_bh.to(tl.int64) * 2 * num_span_chunks + offs_c
        chunk_in = offs_c < num_span_chunks
        span_start = tl.min(tl.load(chunk_spans, mask=chunk_in, other=seqlen_k), 0) // BLOCK_N * BLOCK_N
        span_end = tl.maximum(tl.minimum(tl.max(tl.load(chunk_spans + num_span_chunks, mask=chunk_in, other=0), 0),
                                         seqlen_b), span_start)
        if HAS_WINDOW:  # up to the window's end (no span pass runs under a left bound: `decode_launch`)
            span_end = tl.maximum(tl.minimum(span_end, window_end), span_start)
        keys_per_split = tl.cdiv(tl.cdiv(span_end - span_start, BLOCK_N), tl.num_programs(0)) * BLOCK_N
        start = span_start + split * keys_per_split
        end = tl.minimum(start + keys_per_split, span_end)
    elif HAS_WINDOW:  # the splits cut the window's span, on the tile grid, evenly
        span_start = window_start // BLOCK_N * BLOCK_N
        span_end = tl.maximum(window_end, span_start)
        keys_per_split = tl.cdiv(tl.cdiv(span_end - span_start, BLOCK_N), tl.num_programs(0)) * BLOCK_N
        start = span_start + split * keys_per_split
        end = tl.minimum(start + keys_per_split, span_end)
    if HAS_WINDOW:
        start = tl.maximum(start, window_start)  # the mask scan below reads no flag before the window
    if HAS_MASK and MASK_SHARED:
        # the range shrunk to the key tiles from the first key the mask keeps to the last: a
        # padding mask's tail costs no K/V reads. The span is found first so that no K/V load
        # waits on a mask load (which would stop the loop's loads being issued ahead).
        first, last = end, start - 1
        for scan in range(start, end, MASK_SCAN):
            offs_scan = scan + tl.arange(0, MASK_SCAN)
            keep = tl.load(mask_row + offs_scan * stride_mn, mask=offs_scan < end, other=0) != 0
            first = tl.minimum(first, tl.min(tl.where(keep, offs_scan, end), 0))
            last = tl.maximum(last, tl.max(tl.where(keep, offs_scan, start - 1), 0))
        start = tl.maximum(start, first // BLOCK_N * BLOCK_N)  # on the tile grid (and a page's)
        end = last + 1
    if HAS_WINDOW:  # back on the tile grid (a page's); an empty range stays empty
        start = tl.where(start < end, start // BLOCK_N * BLOCK_N, start)
    for start_n in range(start, end, BLOCK_N):
        # -- load k, v: keys outside the range and lanes past HEAD_DIM read as 0, never as memory --
        offs_n = start_n + tl.arange(0, BLOCK_N)
        tile_end = end
        rows = offs_n
        k_tile, v_tile = k_base, v_base
        if PAGED:
            block = tl.load(pages + start_n // PAGE_SIZE).to(tl.int64)
            page_in = (block >= 0) & (block < num_blocks)
            tile_end = tl.where(page_in, end, start_n)  # an entry naming no block: its keys are excluded
            block = tl.where(page_in, block, 0)
            rows = start_n % PAGE_SIZE + tl.arange(0, BLOCK_N)
            k_tile = k_ptr + block * stride_kb + h_kv * stride_kh
            v_tile = v_ptr + block * stride_vb + h_kv * stride_vh
        key_in = offs_n < tile_end
        if HAS_MASK and MASK_SHARED:
            key_in = key_in & (offs_n >= first)  # nor the keys before the span in its first tile
        if HAS_WINDOW:
            key_in = key_in & (offs_n >= window_start)  # nor the keys before the window in its first tile
        kv_in = key_in[:, None] & (offs_d[None, :] < HEAD_DIM)
        k = tl.load(k_tile + rows[:, None] * stride_kn + offs_d[None, :] * stride_kd, mask=kv_in, other=0.0)
        v = tl.load(v_tile + rows[:, None] * stride_vn + offs_d[None, :] * stride_vd, mask=kv_in, other=0.0)
        visible = row_in[:, None] & key_in[None, :] & (offs_n[None, :] <= last_key[:, None])
        if HAS_WINDOW:
            visible = visible & (offs_n[None, :] >= first_key[:, None])
        if HAS_MASK:
            if MASK_SHARED:
                keep = tl.load(mask_row + offs_n * stride_mn, mask=key_in, other=0)
                visible = visible & (keep[None, :] != 0)
            else:
                keep = tl.load(mask_rows[:, None] + offs_n[None, :] * stride_mn, mask=visible, other=0)
                visible = visible & (keep != 0)
        # -- scores (fp32): scale, softcap, bias; excluded positions replaced, never added to --
        s = tl.dot(q, tl.trans(k)) * softmax_scale
        if HAS_SOFTCAP:
            s = softcap * tanh(s / softcap)
        if HAS_BIAS:
            if BIAS_SHARED:
                s += tl.load(bias_row + offs_n * stride_bn, mask=key_in, other=0.0).to(tl.float32)[None, :]
            else:
                s += tl.load(bias_rows[:, None] + offs_n[None, :] * stride_bn, mask=visible, other=0.0).to(tl.float32)
        s = tl.where(visible, s, float("-inf"))
        # -- online softmax; a row that has seen nothing visible keeps m = -inf and shifts by 0 --
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_shift)
        p = tl.exp(s - m_shift[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    # epilogue: the split's (or the whole row's) normalised output and lse
    dead = l_i == 0.0
    l_safe = tl.where(dead, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(dead, float("-inf"), m_i + tl.log(l_safe))
    out_ptrs = (out_ptr + split * stride_os + b * stride_ob + query[:, None] * stride_om + head[:, None] * stride_oh
                + offs_d[None, :] * stride_od)
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_in[:, None] & (offs_d[None, :] < HEAD_DIM))
    tl.store(lse_ptr + split * stride_ls + b * stride_lb + head * stride_lh + query * stride_lm, lse, mask=row_in)


@triton.jit
def decode_mask_span_kernel(
    mask_ptr, spans_ptr,
    stride_mb, stride_mh, stride_mn,
    num_heads_kv, seqlen_k, mask_head_div, num_chunks,
    GROUP: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """Grid (B * Hkv, num_chunks): the keys a padding-mask row (the one `flash_decode_kernel`'s
    programs of that (batch, kv head) share) keeps in chunk c = keys [c * CHUNK, (c + 1) * CHUNK):
    spans[bh, 0, c] = the first kept key (Lk if none), spans[bh, 1, c] = one past the last (0 if
    none). Every element is written."""
    pid_bh = tl.program_id(0)
    chunk = tl.program_id(1)
    b = (pid_bh // num_heads_kv).to(tl.int64)
    h_kv = (pid_bh % num_heads_kv).to(tl.int64)
    offs_n = chunk * CHUNK + tl.arange(0, CHUNK)
    keep = tl.load(mask_ptr + b * stride_mb + (h_kv * GROUP // mask_head_div) * stride_mh + offs_n * stride_mn,
                   mask=offs_n < seqlen_k, other=0) != 0
    spans = spans_ptr + pid_bh.to(tl.int64) * 2 * num_chunks + chunk
    tl.store(spans, tl.min(tl.where(keep, offs_n, seqlen_k), 0))
    tl.store(spans + num_chunks, tl.max(tl.where(keep, offs_n + 1, 0), 0))


@triton.jit
def decode_combine_kernel(
    partial_out_ptr, partial_lse_ptr, out_ptr, lse_ptr,
    stride_pos, stride_pob, stride_pom, stride_poh, stride_pod,
    stride_pls, stride_plb, stride_plh, stride_plm,
    stride_ob, stride_om, stride_oh, stride_od,
    stride_lb, stride_lh, stride_lm,
    num_heads, seqlen_q, num_splits,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """One query row (b, i, h) per program: the splits' partials merged by their lse (module
    docstring), in split order. BLOCK_S >= num_splits."""
    pid = tl.program_id(0)
    h = (pid % num_heads).to(tl.int64)
    i = ((pid // num_heads) % seqlen_q).to(tl.int64)
    b = (pid // (num_heads * seqlen_q)).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    split_in = offs_s < num_splits
    lse_s = tl.load(partial_lse_ptr + offs_s * stride_pls + b * stride_plb + h * stride_plh + i * stride_plm,
                    mask=split_in, other=float("-inf"))
    lse_max = tl.max(lse_s, 0)
    dead = lse_max == float("-inf")
    shift = tl.where(dead, 0.0, lse_max)
    weight = tl.exp(lse_s - shift)  # 0 for dead splits and lanes past num_splits
    total = tl.sum(weight, 0)
    total_safe = tl.where(dead, 1.0, total)
    partial = tl.load(partial_out_ptr + offs_s[:, None] * stride_pos + b * stride_pob + i * stride_pom
                      + h * stride_poh + offs_d[None, :] * stride_pod,
                      mask=split_in[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    out = tl.sum(partial * (weight / total_safe)[:, None], 0)
    lse = tl.where(dead, float("-inf"), shift + tl.log(total_safe))
    tl.store(out_ptr + b * stride_ob + i * stride_om + h * stride_oh + offs_d * stride_od,
             out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)
    tl.store(lse_ptr + b * stride_lb + h * stride_lh + i * stride_lm, lse)
