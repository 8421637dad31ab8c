"""Flash dynamic-mask attention, backward, in Triton: deterministic, no atomics.

Given dO and the forward's out and lse (layouts as in `flash_fwd.py`), with scores s as in
`common.py` and P_ij = exp(s_ij - lse_i) recomputed tile by tile:
    delta_i = sum_d dO_id * out_id  - dlse_i                 (`flash_bwd_preprocess_kernel`; dlse: a
                                                              loss through lse)
    dV_j   += sum_i P_ij dO_i
    dP_ij   = dO_i . v_j
    dS_ij   = P_ij (dP_ij - delta_i)                          = dBias_ij (before broadcast sums)
    dS_ij  *= 1 - tanh^2(scale q_i.k_j / softcap)             (softcap > 0)
    dK_j   += scale * sum_i dS_ij q_i
    dQ_i   += scale * sum_j dS_ij k_j
Dead rows have lse = -inf; they are given lse = +inf here so P = exp(s - inf) = 0 and they
contribute nothing (their dQ row is 0).

Work split (FlashAttention-2 style, without atomics, so results are bitwise reproducible):
- `flash_bwd_dkdv_kernel`, split mode (HEADS_PER_PROGRAM = 1, the default): one program per
  (key block, batch, query head), looping over the query blocks. Under GQA each program writes
  its query head's share of dK/dV (fp32, (B, Lk, H, D)) and `grad_reduce_kernel` sums each
  group's shares in a fixed order: 4x the programs of one per kv head looping over its group, which left most
  SMs idle (W2, H100: dK/dV 3.0 ms vs 1.85 ms for the same FLOPs without GQA, 2026-11-21).
- `flash_bwd_dkdv_kernel`, group mode (HEADS_PER_PROGRAM = GROUP): one program per (key block,
  batch, kv head), looping over the query blocks and, inside, over the GROUP query heads; dK/dV
  are summed over the group in registers and written as they are. The launcher picks it only
  for a bias with query rows and fewer heads than the query under GQA (see dBias partials).
- `flash_bwd_dq_kernel`: one program per (query block, batch, query head), looping over keys.
- `flash_bwd_dq_from_ds_kernel` replaces it when the dK/dV kernel stored dS whole: the gradient
  of a full (B, H, Lq, Lk) bias without softcap is dS itself, so dQ = scale * dS K reads dS
  instead of recomputing P and dP from q, k, v, dO, the mask and the bias (W1, H200: 0.35 ms
  against 0.79 ms).

dBias partials: the dK/dV kernel writes into `dbias_ptr`, shaped (B, H / HEADS_PER_PROGRAM, Rp, Lk),
where
    Rp = Lq  if the bias has a query dim (DBIAS_ROWS), else the number of query blocks (each
         block's rows are summed in registers).
Split mode keeps one slice per query head; a (B, Hkv|1, Lq, Lk) bias would need an fp32
(B, H, Lq, Lk) partial, 2 GiB at B2 H16 L4096. Group mode sums dS over the group in a register
tile and stores it once per query block, so the partial is (B, Hkv, Lq, Lk): the bias's own
gradient when the bias is (B, Hkv, Lq, Lk). Each element has exactly one writer, and every
element is written: the tiles a key block skips get zeros, so no buffer is zero-filled first.
`grad_reduce_kernel` sums the remaining broadcast dims (and, in the same launch, the GQA shares).

Packed sequences (VARLEN) and the sliding window (HAS_WINDOW) as in `flash_fwd.py`: a program
works on one sequence, counts rows and keys from its first, and leaves the tiles outside its
sequence and window out of its loop bounds; dQ, dK, dV and dBias rows no sequence owns are
left as the launcher zero-filled them. dBias partials of a packed call are per packed key
(a per-key bias: one row per query block of the sequence) or per packed query row (a per-row
bias, whose column j is the row's own sequence's key j).

Skipped work: with a mask both kernels walk only the tiles the activity summary lists
(`activity.py`, `schedule.block_lists`); in group mode that is the union of the group's lists, and
each tile still applies its own query head's mask. Tiles wholly inside the bounds and the causal
rule (interior) skip those tests, as in the forward: the dK/dV kernel always, the dQ kernel
without a mask (see each for the measurements).

Orientation: the dK/dV kernel works on key-major tiles (S^T, P^T, dS^T of shape
(BLOCK_N, BLOCK_M), as in Triton's fused-attention tutorial), so the products dV += P^T dO and
dK += dS^T Q take an MMA result as the left operand directly. Transposing an MMA result in
registers (`tl.trans(ds)`) is miscompiled on Hopper by Triton 3.4+ (fla-org/flash-linear-attention
PR #826); measured here before the change: dK 5-21x over the §2 bound, dV exact, H200, bf16,
D=128, BLOCK_M=32, no mask, triton 3.6, 2026-11-21.
"""

import triton
import triton.language as tl

from dmattn_kernels.triton.activity import block_list_row
from dmattn_kernels.triton.common import (
    LOG2E,
    key_tiles,
    listed_below,
    listed_block,
    load_bias,
    load_keep,
    packed_sequence,
    score_dot,
    scores_tile,
    visible_tile,
    window_key_range,
    window_query_range,
)


@triton.jit
def _delta_rows(out_ptr, dout_ptr, delta_ptr, lse_ptr, dlse_ptr, pid_m, pid_bh,
                stride_ob, stride_om, stride_oh, stride_od,
                stride_dob, stride_dom, stride_doh, stride_dod,
                stride_deltab, stride_deltah, stride_deltam,
                stride_lb, stride_lh, stride_lm,
                stride_dlb, stride_dlh, stride_dlm,
                num_heads, seqlen_q,
                HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, HAS_DLSE: tl.constexpr):
    """delta = rowsum(dO * O) - dlse for BLOCK_M query rows of one (batch, head).

    The kernels below compute dS = P * (dP - delta); a gradient reaching lse adds P * dlse
    (d lse_i / d s_ij = P_ij), hence the subtraction. A dead row (lse = -inf) drops its dlse: a
    merge of partial attentions often sends NaN there (logaddexp(-inf, -inf)), and 0 * NaN
    would reach every key of the head."""
    b = (pid_bh // num_heads).to(tl.int64)
    h = (pid_bh % num_heads).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_in = offs_m < seqlen_q
    tile_in = row_in[:, None] & (offs_d[None, :] < HEAD_DIM)
    out = tl.load(out_ptr + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od, mask=tile_in, other=0.0)
    dout = tl.load(dout_ptr + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_dom + offs_d[None, :] * stride_dod, mask=tile_in, other=0.0)
    delta = tl.sum(out.to(tl.float32) * dout.to(tl.float32), 1)
    if HAS_DLSE:
        lse = tl.load(lse_ptr + b * stride_lb + h * stride_lh + offs_m * stride_lm, mask=row_in, other=0.0)
        dlse = tl.load(dlse_ptr + b * stride_dlb + h * stride_dlh + offs_m * stride_dlm, mask=row_in, other=0.0)
        delta -= tl.where(lse == float("-inf"), 0.0, dlse)
    tl.store(delta_ptr + b * stride_deltab + h * stride_deltah + offs_m * stride_deltam, delta, mask=row_in)


@triton.jit
def flash_bwd_preprocess_kernel(
    out_ptr, dout_ptr, delta_ptr, lse_ptr, dlse_ptr, kv_active_ptr, kv_lists_ptr, q_active_ptr, q_lists_ptr,
    stride_ob, stride_om, stride_oh, stride_od,
    stride_dob, stride_dom, stride_doh, stride_dod,
    stride_deltab, stride_deltah, stride_deltam,
    stride_lb, stride_lh, stride_lm,
    stride_dlb, stride_dlh, stride_dlm,
    num_heads, seqlen_q, delta_blocks,
    stride_kvab, stride_kvah, stride_kv_own, stride_kv_list, stride_kvlb, stride_kvlh, stride_kvlr,
    kv_list_heads, kv_own_cells, kv_list_cells, kv_num_tiles, kv_rows, kv_programs,
    stride_qab, stride_qah, stride_q_own, stride_q_list, stride_qlb, stride_qlh, stride_qlr,
    q_list_heads, q_own_cells, q_list_cells, q_num_tiles, q_rows, q_programs,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HAS_DLSE: tl.constexpr,
    HAS_MASK: tl.constexpr,
    KV_OWN_CELLS: tl.constexpr,
    KV_LIST_CELLS: tl.constexpr,
    KV_CHUNK: tl.constexpr,
    Q_OWN_CELLS: tl.constexpr,
    Q_LIST_CELLS: tl.constexpr,
    Q_CHUNK: tl.constexpr,
):
    """What the dK/dV and dQ kernels read besides the forward's tensors, in one launch of
    independent programs (one launch instead of three: host time per call):

        programs [0, kv_programs)               the dK/dV kernel's key-major block lists, one row each
        [kv_programs, + q_programs)             the dQ kernel's query-major block lists, one row each
        the rest                                delta for BLOCK_M query rows of one (batch, head)

    The lists exist with a mask only (HAS_MASK; `activity.block_list_row`, from the forward's
    tile activity); without one both counts are 0."""
    pid = tl.program_id(0)
    if HAS_MASK:
        if pid < kv_programs:
            block_list_row(kv_active_ptr, kv_lists_ptr, pid % kv_rows, pid // kv_rows,
                           stride_kvab, stride_kvah, stride_kv_own, stride_kv_list, stride_kvlb, stride_kvlh,
                           stride_kvlr, kv_list_heads, kv_own_cells, kv_list_cells, kv_num_tiles,
                           KV_OWN_CELLS, KV_LIST_CELLS, KV_CHUNK)
            return
        pid -= kv_programs
        if pid < q_programs:
            block_list_row(q_active_ptr, q_lists_ptr, pid % q_rows, pid // q_rows,
                           stride_qab, stride_qah, stride_q_own, stride_q_list, stride_qlb, stride_qlh,
                           stride_qlr, q_list_heads, q_own_cells, q_list_cells, q_num_tiles,
                           Q_OWN_CELLS, Q_LIST_CELLS, Q_CHUNK)
            return
        pid -= q_programs
    _delta_rows(out_ptr, dout_ptr, delta_ptr, lse_ptr, dlse_ptr, pid % delta_blocks, pid // delta_blocks,
                stride_ob, stride_om, stride_oh, stride_od, stride_dob, stride_dom, stride_doh, stride_dod,
                stride_deltab, stride_deltah, stride_deltam, stride_lb, stride_lh, stride_lm,
                stride_dlb, stride_dlh, stride_dlm, num_heads, seqlen_q, HEAD_DIM, BLOCK_D, BLOCK_M, HAS_DLSE)


@triton.jit
def _share_sum(dk_share_ptr, dv_share_ptr, dk_ptr, dv_ptr, pid_n, pid_bh,
               stride_sb, stride_sn, stride_sh, stride_sd,
               stride_dkb, stride_dkn, stride_dkh, stride_dkd,
               stride_dvb, stride_dvn, stride_dvh, stride_dvd,
               num_heads_kv, seqlen_k,
               GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    """dK[b, n, hk] = sum over g < GROUP of dK_share[b, n, hk * GROUP + g] (dV likewise), in fp32,
    g in increasing order, for BLOCK_N keys of one (batch, kv head). The shares have one layout."""
    b = (pid_bh // num_heads_kv).to(tl.int64)
    head_kv = (pid_bh % num_heads_kv).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    tile_in = (offs_n[:, None] < seqlen_k) & (offs_d[None, :] < HEAD_DIM)
    share = b * stride_sb + offs_n[:, None] * stride_sn + offs_d[None, :] * stride_sd
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    for g in tl.static_range(GROUP):
        head_share = share + (head_kv * GROUP + g) * stride_sh
        dk += tl.load(dk_share_ptr + head_share, mask=tile_in, other=0.0)
        dv += tl.load(dv_share_ptr + head_share, mask=tile_in, other=0.0)
    tl.store(dk_ptr + b * stride_dkb + head_kv * stride_dkh + offs_n[:, None] * stride_dkn + offs_d[None, :] * stride_dkd,
             dk.to(dk_ptr.dtype.element_ty), mask=tile_in)
    tl.store(dv_ptr + b * stride_dvb + head_kv * stride_dvh + offs_n[:, None] * stride_dvn + offs_d[None, :] * stride_dvd,
             dv.to(dv_ptr.dtype.element_ty), mask=tile_in)


@triton.jit
def _partial_sum(partial_ptr, dbias_ptr, pid,
                 stride_pb, stride_ph, stride_pr, stride_pk,
                 stride_dbb, stride_dbh, stride_dbr, stride_dbk,
                 partial_rows, partial_keys, batches_summed, heads_summed, dbias_heads, row_tiles, key_tiles,
                 ROW_SUM: tl.constexpr, KEY_SUM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """One (BLOCK_R x BLOCK_K) tile of dBias (B|1, Hd, Rd, Kd) from the fp32 partials
    (B, Hd * heads_summed, R, K):

        dbias[b', h', r', k'] = sum over b, g, r, k of partial[b, h' * heads_summed + g, r, k]

    with b over the batch when dBias has one (batches_summed = B) else b = b', r over every
    partial row when ROW_SUM (Rd = 1 < R) else r = r', k likewise with KEY_SUM; in a fixed order
    (deterministic), cast to dBias's dtype once."""
    key_tile = pid % key_tiles
    pid //= key_tiles
    row_tile = pid % row_tiles
    pid_bh = pid // row_tiles
    b_out = (pid_bh // dbias_heads).to(tl.int64)
    h_out = (pid_bh % dbias_heads).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    offs_k = tl.arange(0, BLOCK_K)
    # a summed dim is walked whole by one program; a kept one is this program's tile of it
    first_r = row_tile * BLOCK_R
    r_steps = 1
    if ROW_SUM:
        first_r = 0
        r_steps = tl.cdiv(partial_rows, BLOCK_R)
    first_k = key_tile * BLOCK_K
    k_steps = 1
    if KEY_SUM:
        first_k = 0
        k_steps = tl.cdiv(partial_keys, BLOCK_K)
    acc = tl.zeros([BLOCK_R, BLOCK_K], dtype=tl.float32)
    for batch in range(batches_summed):
        for g in range(heads_summed):
            base = partial_ptr + (b_out + batch) * stride_pb + (h_out * heads_summed + g) * stride_ph
            for r_step in range(r_steps):
                rows = first_r + r_step * BLOCK_R + offs_r
                for k_step in range(k_steps):
                    keys = first_k + k_step * BLOCK_K + offs_k
                    acc += tl.load(base + rows[:, None] * stride_pr + keys[None, :] * stride_pk,
                                   mask=(rows[:, None] < partial_rows) & (keys[None, :] < partial_keys), other=0.0)
    # -- store: the summed dims collapse to their one row / column --
    out_base = dbias_ptr + b_out * stride_dbb + h_out * stride_dbh
    out_dtype = dbias_ptr.dtype.element_ty
    rows = first_r + offs_r
    keys = first_k + offs_k
    if ROW_SUM:
        if KEY_SUM:
            tl.store(out_base, tl.sum(tl.sum(acc, 1), 0).to(out_dtype))
        else:
            tl.store(out_base + keys * stride_dbk, tl.sum(acc, 0).to(out_dtype), mask=keys < partial_keys)
    else:
        if KEY_SUM:
            tl.store(out_base + rows * stride_dbr, tl.sum(acc, 1).to(out_dtype), mask=rows < partial_rows)
        else:
            tl.store(out_base + rows[:, None] * stride_dbr + keys[None, :] * stride_dbk, acc.to(out_dtype),
                     mask=(rows[:, None] < partial_rows) & (keys[None, :] < partial_keys))


@triton.jit
def grad_reduce_kernel(
    dk_share_ptr, dv_share_ptr, dk_ptr, dv_ptr, partial_ptr, dbias_ptr,
    stride_sb, stride_sn, stride_sh, stride_sd,
    stride_dkb, stride_dkn, stride_dkh, stride_dkd,
    stride_dvb, stride_dvn, stride_dvh, stride_dvd,
    num_heads_kv, seqlen_k, share_blocks, share_programs,
    stride_pb, stride_ph, stride_pr, stride_pk,
    stride_dbb, stride_dbh, stride_dbr, stride_dbk,
    partial_rows, partial_keys, batches_summed, heads_summed, dbias_heads, row_tiles, key_tiles,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_SHARES: tl.constexpr,
    HAS_PARTIAL: tl.constexpr,
    ROW_SUM: tl.constexpr,
    KEY_SUM: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """The backward's sums after its main kernels, deterministic (no atomics), in one launch of
    independent programs:

        programs [0, share_programs)   dK and dV from the split-mode kernel's per-query-head fp32
                                       shares under GQA (`_share_sum`; HAS_SHARES)
        the rest                       dBias from the dK/dV kernel's fp32 partials, every broadcast
                                       dim summed (`_partial_sum`; HAS_PARTIAL)
    """
    pid = tl.program_id(0)
    if HAS_SHARES:
        if pid < share_programs:
            _share_sum(dk_share_ptr, dv_share_ptr, dk_ptr, dv_ptr, pid % share_blocks, pid // share_blocks,
                       stride_sb, stride_sn, stride_sh, stride_sd, stride_dkb, stride_dkn, stride_dkh, stride_dkd,
                       stride_dvb, stride_dvn, stride_dvh, stride_dvd, num_heads_kv, seqlen_k,
                       GROUP, HEAD_DIM, BLOCK_D, BLOCK_N)
            return
        pid -= share_programs
    if HAS_PARTIAL:
        _partial_sum(partial_ptr, dbias_ptr, pid, stride_pb, stride_ph, stride_pr, stride_pk,
                     stride_dbb, stride_dbh, stride_dbr, stride_dbk, partial_rows, partial_keys, batches_summed,
                     heads_summed, dbias_heads, row_tiles, key_tiles, ROW_SUM, KEY_SUM, BLOCK_R, BLOCK_K)


@triton.jit
def _load_row_stats(lse_ptr, delta_ptr, offs_m, stride_lm, seqlen_q):
    """lse and delta of a query block; dead rows (lse = -inf) and rows past Lq become +inf so
    that P = 0. A row past Lq reads q = dO = 0 but still its per-key bias: with lse = 0 its P was
    exp(bias), inf in fp16 from a bias of 11.1 (fp32: 88.8), and inf * dO = NaN in dV."""
    row_in = offs_m < seqlen_q
    lse = tl.load(lse_ptr + offs_m * stride_lm, mask=row_in, other=float("inf"))
    lse = tl.where(lse == float("-inf"), float("inf"), lse)
    delta = tl.load(delta_ptr + offs_m * stride_lm, mask=row_in, other=0.0)
    return lse, delta


@triton.jit
def _store_dbias_t(dbias_base, ds_t, start_m, offs_m, offs_n, stride_dbm, stride_dbn, seqlen_q, seqlen_k,
                   BLOCK_M: tl.constexpr, DBIAS_ROWS: tl.constexpr, EDGE: tl.constexpr = True):
    """Stores a key-major dBias tile (DBIAS_ROWS) through transposed addresses, or the row-sum
    vector of one query block at partial row start_m // BLOCK_M. EDGE=False: the caller knows
    the key block inside Lk, so only the query bound is tested."""
    if DBIAS_ROWS:
        if EDGE:
            tile_in = (offs_n[:, None] < seqlen_k) & (offs_m[None, :] < seqlen_q)
        else:
            tile_in = offs_m[None, :] < seqlen_q
        tl.store(dbias_base + offs_n[:, None] * stride_dbn + offs_m[None, :] * stride_dbm,
                 ds_t.to(dbias_base.dtype.element_ty), mask=tile_in)
    else:
        row = start_m // BLOCK_M
        tl.store(dbias_base + row * stride_dbm + offs_n * stride_dbn, ds_t.to(dbias_base.dtype.element_ty),
                 mask=offs_n < seqlen_k)


@triton.jit
def _dkdv_query_tile(
    dk, dv, keep, bias_t, k, v, q_base, dout_base, lse_base, delta_base, dbias_base, mask_base, bias_base, blocks,
    i, num_blocks, m_first, h_first, offs_n, offs_d,
    stride_qm, stride_qh, stride_qd, stride_dom, stride_doh, stride_dod, stride_lh, stride_lm,
    stride_mh, stride_mm, stride_mn, stride_bh, stride_bm, stride_bn, stride_dbm, stride_dbn,
    seqlen_q, seqlen_k, mask_head_div, bias_head_div, softmax_scale, softcap, window_left, window_right,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr,
    HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_DBIAS: tl.constexpr,
    DBIAS_ROWS: tl.constexpr, HEADS_PER_PROGRAM: tl.constexpr, PREFETCH: tl.constexpr, EDGE: tl.constexpr,
    BIAS_PER_KEY: tl.constexpr, LISTED: tl.constexpr, HAS_WINDOW: tl.constexpr,
):
    """The loop's i-th query tile of one key block, whose mask tile `keep` and bias `bias_t` the
    previous step loaded: returns dk, dv updated and the next tile's mask and bias. EDGE: the
    tile may cross Lq, Lk or the causal diagonal. Else the caller knows the key block inside Lk
    and every query of the tile at or below the diagonal of its last key: only the mask and the
    query bound decide (`common.visible_tile`), as in the forward's interior loop.

    `bias_t` (split mode only, `_first_bias_t`): a per-key bias is the key block's own vector,
    loaded once; a full one is the key-major tile, loaded one step ahead like the mask (the
    pipeliner prefetched it only from the end of the previous step, after the last product; H100,
    W1 backward 32x128 dq64x64 w8 s2: 1.893 -> 1.751 ms, though 64x128 went 1.959 -> 2.179,
    commit 6bba9a8)."""
    start_m = listed_block(blocks, i, num_blocks, LISTED, m_first) * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    next_m = listed_block(blocks, i + 1, num_blocks, LISTED, m_first) * BLOCK_M + tl.arange(0, BLOCK_M)
    keep_next = load_keep(mask_base, next_m[None, :], offs_n[:, None], stride_mm, stride_mn, seqlen_q, seqlen_k,
                          i + 1 < num_blocks, PREFETCH)
    # split mode carries the bias (`_first_bias_t`); group mode reads one per query head in place
    BIAS_AHEAD: tl.constexpr = HAS_BIAS and HEADS_PER_PROGRAM == 1
    if BIAS_AHEAD and not BIAS_PER_KEY:
        bias_next = load_bias(bias_base, next_m[None, :], offs_n[:, None], stride_bm, stride_bn, seqlen_q, seqlen_k,
                              i + 1 < num_blocks, True, False)
    else:
        bias_next = bias_t
    q_in = (offs_m[:, None] < seqlen_q) & (offs_d[None, :] < HEAD_DIM)
    if HEADS_PER_PROGRAM > 1:
        db_t = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)  # dS^T summed over the group
    # a dynamic loop: unrolling it would copy the whole body GROUP times. In split mode its one
    # iteration folds away: sm80/sm90 PTX of 4 split-mode variants (bf16, D128, 64x128 tiles)
    # equals the PTX from before group mode existed but for register numbering, 2026-11-21.
    for g in range(0, HEADS_PER_PROGRAM):
        h = h_first + g
        # h_first is a multiple of both head divisors (1 or GROUP): h // div = h_first // div + g // div
        mask_base_h = mask_base + (g // mask_head_div) * stride_mh
        bias_base_h = bias_base + (g // bias_head_div) * stride_bh
        # key-major tile: rows of the tile are keys, columns are queries
        if HEADS_PER_PROGRAM > 1:
            keep_h = load_keep(mask_base_h, offs_m[None, :], offs_n[:, None], stride_mm, stride_mn, seqlen_q,
                               seqlen_k, True, HAS_MASK)
        else:
            keep_h = keep
        visible_t = visible_tile(keep_h, offs_m[None, :], offs_n[:, None], seqlen_q, seqlen_k, IS_CAUSAL, HAS_MASK,
                                 EDGE, HAS_WINDOW, window_left, window_right)
        # -- load q, dO and the row statistics of this query head --
        q = tl.load(q_base + h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd, mask=q_in,
                    other=0.0)
        dout = tl.load(dout_base + h * stride_doh + offs_m[:, None] * stride_dom + offs_d[None, :] * stride_dod,
                       mask=q_in, other=0.0)
        lse, delta = _load_row_stats(lse_base + h * stride_lh, delta_base + h * stride_lh, offs_m, stride_lm, seqlen_q)
        # -- recompute P^T, then dV, dS^T, dK (an interior tile without a mask tests nothing: a
        # query past Lq reads q = dO = 0, lse = +inf, delta = 0, so P = 0 and it adds 0 to dK and
        # dV; its dBias column is not stored) --
        s_t, capped_t = scores_tile(
            score_dot(k, tl.trans(q)), bias_base_h, offs_m[None, :], offs_n[:, None], stride_bm, stride_bn,
            visible_t, seqlen_q, seqlen_k, softmax_scale, softcap, HAS_SOFTCAP, HAS_BIAS and not BIAS_AHEAD,
            (HAS_MASK or EDGE) and not BIAS_AHEAD, EDGE, BIAS_PER_KEY,
        )
        if BIAS_AHEAD:
            s_t = s_t + bias_t.to(tl.float32)
            if HAS_MASK or EDGE:
                s_t = tl.where(visible_t, s_t, float("-inf"))
        p_t = tl.exp2((s_t - lse[None, :]) * LOG2E)
        dv += tl.dot(p_t.to(dout.dtype), dout)
        dp_t = tl.dot(v, tl.trans(dout))
        ds_t = p_t * (dp_t - delta[None, :])
        ds_raw_t = ds_t
        if HAS_SOFTCAP:
            ds_raw_t = ds_t * (1.0 - capped_t * capped_t)
        dk += tl.dot(ds_raw_t.to(q.dtype), q)
        if HAS_DBIAS:
            if HEADS_PER_PROGRAM == 1:
                db = ds_t if DBIAS_ROWS else tl.sum(ds_t, 1)
                _store_dbias_t(dbias_base, db, start_m, offs_m, offs_n, stride_dbm, stride_dbn, seqlen_q, seqlen_k,
                               BLOCK_M, DBIAS_ROWS, EDGE)
            else:
                db_t += ds_t
    if HEADS_PER_PROGRAM > 1:
        # one store per query block: the (b, h_kv) tile of a (B, Hkv, Lq, Lk) partial
        _store_dbias_t(dbias_base, db_t, start_m, offs_m, offs_n, stride_dbm, stride_dbn, seqlen_q, seqlen_k,
                       BLOCK_M, DBIAS_ROWS, EDGE)
    return dk, dv, keep_next, bias_next


@triton.jit
def _first_bias_t(bias_base, first_m, offs_n, stride_bm, stride_bn, seqlen_q, seqlen_k, wanted, HAS_BIAS: tl.constexpr,
                  HEADS_PER_PROGRAM: tl.constexpr, BIAS_PER_KEY: tl.constexpr):
    """The bias a dK/dV loop starts with (`_dkdv_query_tile`): the key block's vector (N, 1) of a
    per-key bias, else the key-major tile of query tile `first_m`; 0 when not carried."""
    if HAS_BIAS and HEADS_PER_PROGRAM == 1:
        if BIAS_PER_KEY:
            return load_bias(bias_base, first_m[None, :], offs_n[:, None], stride_bm, stride_bn, seqlen_q, seqlen_k,
                             True, True, True)
        else:
            return load_bias(bias_base, first_m[None, :], offs_n[:, None], stride_bm, stride_bn, seqlen_q, seqlen_k,
                             wanted, True, False)
    else:
        return 0


@triton.jit
def flash_bwd_dkdv_kernel(
    q_ptr, k_ptr, v_ptr, mask_ptr, bias_ptr, dout_ptr, lse_ptr, delta_ptr,
    dk_ptr, dv_ptr, dbias_ptr, blocks_ptr, cu_seqlens_q_ptr, cu_seqlens_k_ptr, seqused_k_ptr,
    stride_qb, stride_qm, stride_qh, stride_qd,
    stride_kb, stride_kn, stride_kh, stride_kd,
    stride_vb, stride_vn, stride_vh, stride_vd,
    stride_mb, stride_mh, stride_mm, stride_mn,
    stride_bb, stride_bh, stride_bm, stride_bn,
    stride_dob, stride_dom, stride_doh, stride_dod,
    stride_lb, stride_lh, stride_lm,
    stride_dkb, stride_dkn, stride_dkh, stride_dkd,
    stride_dvb, stride_dvn, stride_dvh, stride_dvd,
    stride_dbb, stride_dbh, stride_dbm, stride_dbn,
    stride_blb, stride_blh, stride_bln,
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
    HAS_DBIAS: tl.constexpr,
    DBIAS_ROWS: tl.constexpr,
    HEADS_PER_PROGRAM: tl.constexpr,
    BIAS_PER_KEY: tl.constexpr,
    LISTED: tl.constexpr,
    VARLEN: tl.constexpr,
    HAS_SEQUSED: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
):
    """LISTED, VARLEN, HAS_SEQUSED, HAS_WINDOW as in `flash_fwd.flash_fwd_kernel`."""
    tl.static_assert(BLOCK_D >= HEAD_DIM)
    tl.static_assert(BLOCK_M >= 16 and BLOCK_N >= 16)
    tl.static_assert(not (VARLEN and LISTED))
    # group mode serves one case only, a per-kv-head dBias with query rows (module docstring)
    tl.static_assert(HEADS_PER_PROGRAM == 1 or (HEADS_PER_PROGRAM == GROUP and HAS_DBIAS and DBIAS_ROWS))
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    program_heads = num_heads // HEADS_PER_PROGRAM
    b = (pid_bh // program_heads).to(tl.int64)
    # this program's slot of dk/dv and of the dBias partial: its query head (split mode; under GQA
    # dk/dv are per-query-head shares) or its kv head (group mode)
    slot = (pid_bh % program_heads).to(tl.int64)
    h_first = slot * HEADS_PER_PROGRAM
    h_kv = h_first // GROUP

    if VARLEN:
        q_start, k_start, seqlen_q, seqlen_k = packed_sequence(cu_seqlens_q_ptr, cu_seqlens_k_ptr, seqused_k_ptr, b,
                                                               seqlen_q, seqlen_k, HAS_SEQUSED)
        if pid_n * BLOCK_N >= seqlen_k:  # the grid covers the longest sequence
            return
        q_row0 = q_start * stride_qm
        do_row0 = q_start * stride_dom
        l_row0 = q_start * stride_lm
        k_row0 = k_start * stride_kn
        v_row0 = k_start * stride_vn
        dk_row0 = k_start * stride_dkn
        dv_row0 = k_start * stride_dvn
        mask_row0 = q_start * stride_mm + k_start * stride_ms
        bias_row0 = q_start * stride_bm + k_start * stride_bs
        # a per-row bias's partial has the bias's own columns; a per-key one's, one row per query block
        dbias_row0 = q_start * stride_dbm if DBIAS_ROWS else k_start * stride_dbn
    else:
        q_row0 = b * stride_qb
        do_row0 = b * stride_dob
        l_row0 = b * stride_lb
        k_row0 = b * stride_kb
        v_row0 = b * stride_vb
        dk_row0 = b * stride_dkb
        dv_row0 = b * stride_dvb
        mask_row0 = b * stride_mb
        bias_row0 = b * stride_bb
        dbias_row0 = b * stride_dbb
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    kv_in = (offs_n[:, None] < seqlen_k) & (offs_d[None, :] < HEAD_DIM)
    k = tl.load(k_ptr + k_row0 + h_kv * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd, mask=kv_in, other=0.0)
    v = tl.load(v_ptr + v_row0 + h_kv * stride_vh + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd, mask=kv_in, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)

    m_end = tl.cdiv(seqlen_q, BLOCK_M)
    if LISTED:
        # the active query tiles of this key block (key-major `schedule.block_lists`)
        # (group mode: the union over the group's query heads, one list per kv head)
        list_head = h_first // mask_head_div if HEADS_PER_PROGRAM == 1 else slot
        blocks = blocks_ptr + b * stride_blb + list_head * stride_blh + pid_n * stride_bln
        num_blocks = tl.load(blocks)
        m_first = 0
    else:
        blocks = blocks_ptr
        m_first = 0
        if IS_CAUSAL:
            # the first query that sees key n0 is n0 - (Lk - Lq); earlier query blocks are all excluded
            m_first = tl.maximum(pid_n * BLOCK_N - (seqlen_k - seqlen_q), 0) // BLOCK_M
        if HAS_WINDOW:
            m_lo, m_hi = window_query_range(pid_n * BLOCK_N, pid_n * BLOCK_N + BLOCK_N - 1, seqlen_q, seqlen_k,
                                            window_left, window_right)
            m_first = tl.maximum(m_first, m_lo // BLOCK_M)
            m_end = tl.minimum(m_end, tl.cdiv(m_hi, BLOCK_M))
        num_blocks = tl.maximum(m_end - m_first, 0)

    mask_base = mask_ptr + mask_row0 + (h_first // mask_head_div) * stride_mh
    bias_base = bias_ptr + bias_row0 + (h_first // bias_head_div) * stride_bh
    # split mode: the mask of the first tile; each iteration then loads the next one's
    # (`common.load_keep`). Group mode loads each query head's tile in place.
    PREFETCH: tl.constexpr = HAS_MASK and HEADS_PER_PROGRAM == 1
    # Query tiles at or below the causal diagonal of the block's last key, the block inside Lk,
    # are interior: every position passes the bounds and the causal rule but for the query bound,
    # so their loop tests only that and the mask. The list has the diagonal tiles first; they run
    # last, in a loop of their own. In the other order the interior loop spilled (sm90, 64x128 w8
    # s2: 95 local loads and stores per tile against 8) and W1's backward took 2.41 ms against
    # 2.13 before the split; interior first, 2.10 (H100, commit eda6b11).
    # With a window, query tiles past the last one whose rows all see the block's first key
    # (its window's left edge) are edge tiles too: they follow the interior ones in the list and
    # run last, in a third loop.
    if IS_CAUSAL:
        first_interior = tl.cdiv(tl.maximum(pid_n * BLOCK_N + BLOCK_N - 1 - (seqlen_k - seqlen_q), 0), BLOCK_M)
    else:
        first_interior = 0
    interior_end = num_blocks
    if HAS_WINDOW:
        # rows from m_lo on see the block's last key (the window's right side), rows up to
        # m_hi - 1 its first (the left side)
        m_lo, _ = window_query_range(pid_n * BLOCK_N + BLOCK_N - 1, pid_n * BLOCK_N + BLOCK_N - 1, seqlen_q, seqlen_k,
                                     window_left, window_right)
        _, m_hi = window_query_range(pid_n * BLOCK_N, pid_n * BLOCK_N, seqlen_q, seqlen_k, window_left, window_right)
        first_interior = tl.maximum(first_interior, tl.cdiv(m_lo, BLOCK_M))
        interior_end = listed_below(blocks, num_blocks, m_hi // BLOCK_M, LISTED, m_first)
    if pid_n * BLOCK_N + BLOCK_N <= seqlen_k:
        num_edge = tl.minimum(listed_below(blocks, num_blocks, first_interior, LISTED, m_first), interior_end)
    else:
        num_edge = num_blocks
        interior_end = num_blocks
    first_m = listed_block(blocks, 0, num_blocks, LISTED, m_first) * BLOCK_M + tl.arange(0, BLOCK_M)
    edge_m = listed_block(blocks, num_edge, num_blocks, LISTED, m_first) * BLOCK_M + tl.arange(0, BLOCK_M)
    keep = load_keep(mask_base, edge_m[None, :], offs_n[:, None], stride_mm, stride_mn, seqlen_q, seqlen_k,
                     num_edge < interior_end, PREFETCH)
    bias_t = _first_bias_t(bias_base, edge_m, offs_n, stride_bm, stride_bn, seqlen_q, seqlen_k,
                           num_edge < interior_end, HAS_BIAS, HEADS_PER_PROGRAM, BIAS_PER_KEY)
    q_base = q_ptr + q_row0
    dout_base = dout_ptr + do_row0
    lse_base = lse_ptr + l_row0
    delta_base = delta_ptr + l_row0
    dbias_base = dbias_ptr + dbias_row0 + slot * stride_dbh
    for i in range(num_edge, interior_end):
        dk, dv, keep, bias_t = _dkdv_query_tile(
            dk, dv, keep, bias_t, k, v, q_base, dout_base, lse_base, delta_base, dbias_base, mask_base, bias_base,
            blocks, i, num_blocks, m_first, h_first, offs_n, offs_d, stride_qm, stride_qh, stride_qd, stride_dom, stride_doh,
            stride_dod, stride_lh, stride_lm, stride_mh, stride_mm, stride_mn, stride_bh, stride_bm, stride_bn,
            stride_dbm, stride_dbn, seqlen_q, seqlen_k, mask_head_div, bias_head_div, softmax_scale, softcap,
            window_left, window_right, HEAD_DIM, BLOCK_M, BLOCK_N, IS_CAUSAL, HAS_MASK, HAS_BIAS, HAS_SOFTCAP,
            HAS_DBIAS, DBIAS_ROWS, HEADS_PER_PROGRAM, PREFETCH, False, BIAS_PER_KEY, LISTED, HAS_WINDOW,
        )
    # the diagonal tiles last: their first mask tile is loaded here, the chain then goes on
    keep = load_keep(mask_base, first_m[None, :], offs_n[:, None], stride_mm, stride_mn, seqlen_q, seqlen_k,
                     num_edge > 0, PREFETCH)
    bias_t = _first_bias_t(bias_base, first_m, offs_n, stride_bm, stride_bn, seqlen_q, seqlen_k, num_edge > 0,
                           HAS_BIAS, HEADS_PER_PROGRAM, BIAS_PER_KEY)
    for i in range(0, num_edge):
        dk, dv, keep, bias_t = _dkdv_query_tile(
            dk, dv, keep, bias_t, k, v, q_base, dout_base, lse_base, delta_base, dbias_base, mask_base, bias_base,
            blocks, i, num_blocks, m_first, h_first, offs_n, offs_d, stride_qm, stride_qh, stride_qd, stride_dom, stride_doh,
            stride_dod, stride_lh, stride_lm, stride_mh, stride_mm, stride_mn, stride_bh, stride_bm, stride_bn,
            stride_dbm, stride_dbn, seqlen_q, seqlen_k, mask_head_div, bias_head_div, softmax_scale, softcap,
            window_left, window_right, HEAD_DIM, BLOCK_M, BLOCK_N, IS_CAUSAL, HAS_MASK, HAS_BIAS, HAS_SOFTCAP,
            HAS_DBIAS, DBIAS_ROWS, HEADS_PER_PROGRAM, PREFETCH, True, BIAS_PER_KEY, LISTED, HAS_WINDOW,
        )
    if HAS_WINDOW:
        # the window's left-edge tiles: their first mask tile and bias are loaded here
        trail_m = listed_block(blocks, interior_end, num_blocks, LISTED, m_first) * BLOCK_M + tl.arange(0, BLOCK_M)
        keep = load_keep(mask_base, trail_m[None, :], offs_n[:, None], stride_mm, stride_mn, seqlen_q, seqlen_k,
                         interior_end < num_blocks, PREFETCH)
        bias_t = _first_bias_t(bias_base, trail_m, offs_n, stride_bm, stride_bn, seqlen_q, seqlen_k,
                               interior_end < num_blocks, HAS_BIAS, HEADS_PER_PROGRAM, BIAS_PER_KEY)
        for i in range(interior_end, num_blocks):
            dk, dv, keep, bias_t = _dkdv_query_tile(
                dk, dv, keep, bias_t, k, v, q_base, dout_base, lse_base, delta_base, dbias_base, mask_base, bias_base,
                blocks, i, num_blocks, m_first, h_first, offs_n, offs_d, stride_qm, stride_qh, stride_qd, stride_dom,
                stride_doh, stride_dod, stride_lh, stride_lm, stride_mh, stride_mm, stride_mn, stride_bh, stride_bm,
                stride_bn, stride_dbm, stride_dbn, seqlen_q, seqlen_k, mask_head_div, bias_head_div, softmax_scale,
                softcap, window_left, window_right, HEAD_DIM, BLOCK_M, BLOCK_N, IS_CAUSAL, HAS_MASK, HAS_BIAS,
                HAS_SOFTCAP, HAS_DBIAS, DBIAS_ROWS, HEADS_PER_PROGRAM, PREFETCH, True, BIAS_PER_KEY, LISTED,
                HAS_WINDOW,
            )

    if HAS_DBIAS:
        # the query tiles this key block skips hold no visible position: their dS is 0. Written
        # here, every dBias element is written exactly once and the buffer needs no zero fill
        # (a fill of the full (B, H, L, L) bias first cost 0.32 ms at W1 on the H200).
        if DBIAS_ROWS:
            zeros_t = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        else:
            zeros_t = tl.zeros([BLOCK_N], dtype=tl.float32)
        # the list row continues past its count with the skipped tiles (`schedule.block_lists`);
        # without one they are those before m_first and from m_first + num_blocks on
        num_skipped = tl.cdiv(seqlen_q, BLOCK_M) - num_blocks
        for j in range(0, num_skipped):
            if LISTED:
                start_m = tl.load(blocks + 1 + num_blocks + j) * BLOCK_M
            else:
                start_m = tl.where(j < m_first, j, j + num_blocks) * BLOCK_M
            offs_m = start_m + tl.arange(0, BLOCK_M)
            _store_dbias_t(dbias_base, zeros_t, start_m, offs_m, offs_n, stride_dbm, stride_dbn, seqlen_q, seqlen_k,
                           BLOCK_M, DBIAS_ROWS)

    # epilogue
    dk = dk * softmax_scale
    # dk_ptr/dv_ptr hold one share per query head in split mode under GQA (the launcher sums the
    # groups), else the kv head's dK/dV
    tl.store(dk_ptr + dk_row0 + slot * stride_dkh + offs_n[:, None] * stride_dkn + offs_d[None, :] * stride_dkd, dk.to(dk_ptr.dtype.element_ty), mask=kv_in)
    tl.store(dv_ptr + dv_row0 + slot * stride_dvh + offs_n[:, None] * stride_dvn + offs_d[None, :] * stride_dvd, dv.to(dv_ptr.dtype.element_ty), mask=kv_in)


@triton.jit
def _dq_key_tile(
    dq, keep, q, dout, lse, delta, k_base, v_base, mask_base, bias_base, blocks, first, i, num_blocks, offs_m, offs_d,
    stride_kn, stride_kd, stride_vn, stride_vd, stride_mm, stride_mn, stride_bm, stride_bn, seqlen_q, seqlen_k,
    softmax_scale, softcap, window_left, window_right, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, EDGE: tl.constexpr, BIAS_PER_KEY: tl.constexpr, LISTED: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
):
    """The loop's i-th key tile of one query block, whose mask tile `keep` the previous step
    loaded: returns dq updated and the next tile's mask. EDGE as in the forward's
    `_online_softmax_step`: off, the tile is inside Lk and left of the block's diagonal."""
    offs_n = listed_block(blocks, i, num_blocks, LISTED, first) * BLOCK_N + tl.arange(0, BLOCK_N)
    next_n = listed_block(blocks, i + 1, num_blocks, LISTED, first) * BLOCK_N + tl.arange(0, BLOCK_N)
    keep_next = load_keep(mask_base, offs_m[:, None], next_n[None, :], stride_mm, stride_mn, seqlen_q, seqlen_k,
                          i + 1 < num_blocks, HAS_MASK)
    visible = visible_tile(keep, offs_m[:, None], offs_n[None, :], seqlen_q, seqlen_k, IS_CAUSAL, HAS_MASK, EDGE,
                           HAS_WINDOW, window_left, window_right)
    if EDGE:
        kv_in = (offs_n[:, None] < seqlen_k) & (offs_d[None, :] < HEAD_DIM)
    else:
        kv_in = offs_d[None, :] < HEAD_DIM
    k_ptrs = k_base + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd
    v_ptrs = v_base + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd
    if EDGE or BLOCK_D != HEAD_DIM:
        k = tl.load(k_ptrs, mask=kv_in, other=0.0)
        v = tl.load(v_ptrs, mask=kv_in, other=0.0)
    else:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    # -- recompute P, then dS = P (dP - delta); rows past Lq are never stored --
    s, capped = scores_tile(
        score_dot(q, tl.trans(k)), bias_base, offs_m[:, None], offs_n[None, :], stride_bm, stride_bn,
        visible, seqlen_q, seqlen_k, softmax_scale, softcap, HAS_SOFTCAP, HAS_BIAS, HAS_MASK or EDGE, EDGE,
        BIAS_PER_KEY,
    )
    p = tl.exp2((s - lse[:, None]) * LOG2E)
    dp = tl.dot(dout, tl.trans(v))
    ds = p * (dp - delta[:, None])
    if HAS_SOFTCAP:
        ds = ds * (1.0 - capped * capped)
    dq += tl.dot(ds.to(k.dtype), k)
    return dq, keep_next


@triton.jit
def flash_bwd_dq_kernel(
    q_ptr, k_ptr, v_ptr, mask_ptr, bias_ptr, dout_ptr, lse_ptr, delta_ptr, dq_ptr, blocks_ptr,
    cu_seqlens_q_ptr, cu_seqlens_k_ptr, seqused_k_ptr,
    stride_qb, stride_qm, stride_qh, stride_qd,
    stride_kb, stride_kn, stride_kh, stride_kd,
    stride_vb, stride_vn, stride_vh, stride_vd,
    stride_mb, stride_mh, stride_mm, stride_mn,
    stride_bb, stride_bh, stride_bm, stride_bn,
    stride_dob, stride_dom, stride_doh, stride_dod,
    stride_lb, stride_lh, stride_lm,
    stride_dqb, stride_dqm, stride_dqh, stride_dqd,
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
    BIAS_PER_KEY: tl.constexpr,
    LISTED: tl.constexpr,
    VARLEN: tl.constexpr,
    HAS_SEQUSED: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
):
    """LISTED, VARLEN, HAS_SEQUSED, HAS_WINDOW as in `flash_fwd.flash_fwd_kernel`."""
    tl.static_assert(BLOCK_D >= HEAD_DIM)
    tl.static_assert(BLOCK_M >= 16 and BLOCK_N >= 16)
    tl.static_assert(not (VARLEN and LISTED))
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // num_heads).to(tl.int64)
    h = (pid_bh % num_heads).to(tl.int64)
    h_kv = h // GROUP

    if VARLEN:
        q_start, k_start, seqlen_q, seqlen_k = packed_sequence(cu_seqlens_q_ptr, cu_seqlens_k_ptr, seqused_k_ptr, b,
                                                               seqlen_q, seqlen_k, HAS_SEQUSED)
        if pid_m * BLOCK_M >= seqlen_q:  # the grid covers the longest sequence
            return
        q_row0 = q_start * stride_qm
        do_row0 = q_start * stride_dom
        l_row0 = q_start * stride_lm
        dq_row0 = q_start * stride_dqm
        k_row0 = k_start * stride_kn
        v_row0 = k_start * stride_vn
        mask_row0 = q_start * stride_mm + k_start * stride_ms
        bias_row0 = q_start * stride_bm + k_start * stride_bs
    else:
        q_row0 = b * stride_qb
        do_row0 = b * stride_dob
        l_row0 = b * stride_lb
        dq_row0 = b * stride_dqb
        k_row0 = b * stride_kb
        v_row0 = b * stride_vb
        mask_row0 = b * stride_mb
        bias_row0 = b * stride_bb
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q_in = (offs_m[:, None] < seqlen_q) & (offs_d[None, :] < HEAD_DIM)
    q = tl.load(q_ptr + q_row0 + h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd, mask=q_in, other=0.0)
    dout = tl.load(dout_ptr + do_row0 + h * stride_doh + offs_m[:, None] * stride_dom + offs_d[None, :] * stride_dod, mask=q_in, other=0.0)
    row_base = l_row0 + h * stride_lh
    lse, delta = _load_row_stats(lse_ptr + row_base, delta_ptr + row_base, offs_m, stride_lm, seqlen_q)
    k_base = k_ptr + k_row0 + h_kv * stride_kh
    v_base = v_ptr + v_row0 + h_kv * stride_vh
    mask_base = mask_ptr + mask_row0 + (h // mask_head_div) * stride_mh
    bias_base = bias_ptr + bias_row0 + (h // bias_head_div) * stride_bh
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    blocks, first, num_blocks = key_tiles(
        blocks_ptr, b * stride_blb + (h // mask_head_div) * stride_blh + pid_m * stride_blm, pid_m, seqlen_q,
        seqlen_k, window_left, window_right, BLOCK_M, BLOCK_N, IS_CAUSAL, LISTED, HAS_WINDOW)

    # Without a mask, interior key tiles (inside Lk, left of the causal diagonal of the block's
    # first row, as in `flash_fwd.py`) take a loop of their own that tests nothing: W3, H100,
    # backward 64x64 dq64x32 w4 s2, 1.206 -> 1.159 ms. With a mask the same split measured
    # slower (W2 2.497 -> 2.548 ms), so every tile takes the edge loop
    # (H100, commit eda6b11).
    # With a window the interior tiles sit between its two edges, as in `flash_fwd.py`.
    SPLIT: tl.constexpr = not HAS_MASK
    num_lead = 0
    num_interior = 0
    if SPLIT:
        interior_end = seqlen_k // BLOCK_N
        if IS_CAUSAL:
            interior_end = tl.minimum(interior_end,
                                      tl.maximum(pid_m * BLOCK_M + seqlen_k - seqlen_q + 1, 0) // BLOCK_N)
        if HAS_WINDOW:
            lo, _ = window_key_range(pid_m * BLOCK_M + BLOCK_M - 1, pid_m * BLOCK_M + BLOCK_M - 1, seqlen_q, seqlen_k,
                                     window_left, window_right)
            _, hi = window_key_range(pid_m * BLOCK_M, pid_m * BLOCK_M, seqlen_q, seqlen_k, window_left, window_right)
            interior_end = tl.minimum(interior_end, hi // BLOCK_N)
            num_lead = listed_below(blocks, num_blocks, tl.cdiv(lo, BLOCK_N), LISTED, first)
        num_interior = tl.maximum(listed_below(blocks, num_blocks, interior_end, LISTED, first), num_lead)

    # the mask of the first tile; each iteration then loads the next one's (`common.load_keep`)
    first_n = listed_block(blocks, 0, num_blocks, LISTED, first) * BLOCK_N + tl.arange(0, BLOCK_N)
    keep = load_keep(mask_base, offs_m[:, None], first_n[None, :], stride_mm, stride_mn, seqlen_q, seqlen_k,
                     num_blocks > 0, HAS_MASK)
    if SPLIT and HAS_WINDOW:
        for i in range(0, num_lead):
            dq, keep = _dq_key_tile(
                dq, keep, q, dout, lse, delta, k_base, v_base, mask_base, bias_base, blocks, first, i, num_blocks,
                offs_m, offs_d, stride_kn, stride_kd, stride_vn, stride_vd, stride_mm, stride_mn, stride_bm,
                stride_bn, seqlen_q, seqlen_k, softmax_scale, softcap, window_left, window_right, HEAD_DIM, BLOCK_D,
                BLOCK_N, IS_CAUSAL, HAS_MASK, HAS_BIAS, HAS_SOFTCAP, True, BIAS_PER_KEY, LISTED, HAS_WINDOW,
            )
    for i in range(num_lead, num_interior):
        dq, keep = _dq_key_tile(
            dq, keep, q, dout, lse, delta, k_base, v_base, mask_base, bias_base, blocks, first, i, num_blocks, offs_m,
            offs_d, stride_kn, stride_kd, stride_vn, stride_vd, stride_mm, stride_mn, stride_bm, stride_bn, seqlen_q,
            seqlen_k, softmax_scale, softcap, window_left, window_right, HEAD_DIM, BLOCK_D, BLOCK_N, IS_CAUSAL,
            HAS_MASK, HAS_BIAS, HAS_SOFTCAP, False, BIAS_PER_KEY, LISTED, HAS_WINDOW,
        )
    for i in range(num_interior, num_blocks):
        dq, keep = _dq_key_tile(
            dq, keep, q, dout, lse, delta, k_base, v_base, mask_base, bias_base, blocks, first, i, num_blocks, offs_m,
            offs_d, stride_kn, stride_kd, stride_vn, stride_vd, stride_mm, stride_mn, stride_bm, stride_bn, seqlen_q,
            seqlen_k, softmax_scale, softcap, window_left, window_right, HEAD_DIM, BLOCK_D, BLOCK_N, IS_CAUSAL,
            HAS_MASK, HAS_BIAS, HAS_SOFTCAP, True, BIAS_PER_KEY, LISTED, HAS_WINDOW,
        )

    # epilogue
    dq = dq * softmax_scale
    tl.store(dq_ptr + dq_row0 + h * stride_dqh + offs_m[:, None] * stride_dqm + offs_d[None, :] * stride_dqd, dq.to(dq_ptr.dtype.element_ty), mask=q_in)


@triton.jit
def flash_bwd_dq_from_ds_kernel(
    ds_ptr, k_ptr, dq_ptr, blocks_ptr,
    stride_dsb, stride_dsh, stride_dsm, stride_dsn,
    stride_kb, stride_kn, stride_kh, stride_kd,
    stride_dqb, stride_dqm, stride_dqh, stride_dqd,
    stride_blb, stride_blh, stride_blm,
    num_heads, seqlen_q, seqlen_k,
    mask_head_div, softmax_scale,
    window_left, window_right,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    HAS_MASK: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
):
    """dQ_i = scale * sum_j dS_ij k_j from a dS the dK/dV kernel already wrote: the gradient of a
    full (B, H, Lq, Lk) bias is dS itself (no softcap). One program per (query block, batch,
    query head), walking the same key tiles as `flash_bwd_dq_kernel`; it reads dS where that
    kernel recomputes P and dP from q, k, v, dO, the mask and the bias. dS is rounded to the
    bias dtype on store; the dot takes it in k's dtype, the rounding `flash_bwd_dq_kernel` applies.
    """
    tl.static_assert(BLOCK_D >= HEAD_DIM)
    tl.static_assert(BLOCK_M >= 16 and BLOCK_N >= 16)
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // num_heads).to(tl.int64)
    h = (pid_bh % num_heads).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    ds_base = ds_ptr + b * stride_dsb + h * stride_dsh
    k_base = k_ptr + b * stride_kb + (h // GROUP) * stride_kh
    blocks, first, num_blocks = key_tiles(
        blocks_ptr, b * stride_blb + (h // mask_head_div) * stride_blh + pid_m * stride_blm, pid_m, seqlen_q,
        seqlen_k, window_left, window_right, BLOCK_M, BLOCK_N, IS_CAUSAL, HAS_MASK, HAS_WINDOW)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for i in range(0, num_blocks):
        offs_n = listed_block(blocks, i, num_blocks, HAS_MASK, first) * BLOCK_N + tl.arange(0, BLOCK_N)
        ds_in = (offs_m[:, None] < seqlen_q) & (offs_n[None, :] < seqlen_k)
        ds = tl.load(ds_base + offs_m[:, None] * stride_dsm + offs_n[None, :] * stride_dsn, mask=ds_in, other=0.0)
        kv_in = (offs_n[:, None] < seqlen_k) & (offs_d[None, :] < HEAD_DIM)
        k = tl.load(k_base + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd, mask=kv_in, other=0.0)
        dq += tl.dot(ds.to(k.dtype), k)
    dq = dq * softmax_scale
    q_in = (offs_m[:, None] < seqlen_q) & (offs_d[None, :] < HEAD_DIM)
    tl.store(dq_ptr + b * stride_dqb + h * stride_dqh + offs_m[:, None] * stride_dqm + offs_d[None, :] * stride_dqd,
             dq.to(dq_ptr.dtype.element_ty), mask=q_in)
