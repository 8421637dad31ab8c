// Flash dynamic-mask attention, backward (FlashAttention-2 style) for SM80, SM90 and SM120:
// deterministic, no atomics.
//
// Given dO and the forward's out and lse, with the scores S of flash_fwd.cu (capped = the
// soft-capped scaled dot product, before the bias) and P = exp(S - lse) recomputed tile by tile:
//
//   delta_i = sum_d dO_id out_id                                  (dmattn_bwd_delta_kernel)
//   dV_j   += sum_i P_ij dO_i                                      (dmattn_bwd_dkdv_kernel)
//   dP_ij   = dO_i . v_j
//   dS_ij   = P_ij (dP_ij - delta_i)                               = dBias_ij
//   dS_ij  *= 1 - (capped_ij / softcap)^2                          (HAS_SOFTCAP: d tanh)
//   dK_j   += softmax_scale sum_i dS_ij q_i
//   dQ_i   += softmax_scale sum_j dS_ij k_j                        (dmattn_bwd_dq_kernel)
//
// P and dS are rounded to the input dtype before their products, as FA2 does. Excluded
// positions get P = 0 without reading the bias; a dead row (lse = -inf) is given lse = +inf,
// so its P, dS and dQ are 0.
//
// Work split (each output element has one writer, summed in a fixed order):
// - dK/dV: one CTA per (block of CTA_ROWS keys, batch, query head); warp w owns keys
//   [16w, 16w + 16) and the CTA walks the query tiles of DKDV_BLOCK_M rows the causal rule lets
//   see its keys. Products run key-major (S^T = K Q^T, dP^T = V dO^T), so P^T and dS^T are the
//   left operands of dV += P^T dO and dK += dS^T Q straight from the accumulators. Under GQA
//   (DKV_FP32) each query head writes its own fp32 share of dK/dV and the launcher sums each
//   group's shares.
// - dQ: one CTA per (block of CTA_ROWS queries, batch, query head) walking key tiles of
//   DQ_BLOCK_N, as the forward does; S and dP are recomputed there instead of accumulated with
//   atomics. Taking dQ in the dK/dV kernel instead (dS^T staged in shared memory by stmatrix,
//   dS K per warpgroup as wgmma, each query tile's shares added in key-block order behind a
//   per-tile counter) was correct and bitwise repeatable but slower on the H100 at 64x64 w4 and
//   64x128 w8: the sum of the shares in global fp32 costs more than the recomputation saves (the
//   commit that added this paragraph gives the figures).
// - dBias (HAS_DBIAS) comes from the dK/dV kernel into a target of shape (B, H, Lq|1, Lk) that
//   the launcher zeroes and, where the bias broadcasts, sums: with a query dim (DBIAS_ROWS)
//   each dS element is stored; without one each key's dS is summed over all its queries in
//   registers and stored once.
//
// Positions are tested (bounds, causal, mask) only in boundary tiles, and a warp skips the
// products of a tile that the causal rule hides from all its rows, as in the forward.
// Grid: (batch x head) on x, blocks on y in the order that starts the longest causal work
// first (the forward's header says why).
//
// Memory: Q/dO (dK/dV kernel) and K/V (dQ kernel) tiles stream through a cp.async ring of
// STAGES buffers, zero-filled past the sequence ends and HEAD_DIM, as in the forward.
//
// SM90 (WGMMA): the products run as wgmma.mma_async, one m64 product per warpgroup (its 64 keys
// in dK/dV, 64 queries in dQ): S^T, dP^T, S and dP from shared tiles, dV, dK and dQ with P^T or
// dS^T / dS from registers. The fragments each warp owns are those of mma.sync, so the
// gradient code is one; a warpgroup skips a tile only when it is hidden from all its rows.
//
// Compile-time parameters: those of common.cuh, and DKDV_BLOCK_M, DQ_BLOCK_N, HAS_DBIAS,
// DBIAS_ROWS, DBIAS_FP32 (dBias target fp32, else the input dtype), DKV_FP32 (dK/dV shares in
// fp32, else dK/dV themselves).

#include "bwd_steps.cuh"

#if HAS_WINDOW
#error "a sliding window runs in the warp-specialized kernels only (flash_fwd_ws.cu overlapped, flash_bwd_ws.cu)"
#endif

#if WGMMA
static_assert(is_wgmma_width(DKDV_BLOCK_M) && is_wgmma_width(DQ_BLOCK_N), "wgmma: no m64nN product for these tiles");
#endif

// -- delta = rowsum(dO * out) (bwd_steps.cuh) -------------------------------------------------

extern "C" __global__ void __launch_bounds__(THREADS) dmattn_bwd_delta_kernel(const BwdParams p) { store_deltas(p); }

// P and dS of one position from its dot products; 0 and 0 where excluded. `ds` before the
// softcap factor is dBias. CHECK == false: the caller knows the position is allowed (an
// interior tile, as in the forward), so no bound, causal or mask test runs.
struct Grad {
  float prob, dbias, ds;
};

template <bool CHECK>
__device__ __forceinline__ Grad position_grad(const ScoreRule& rule, float dot, float dp, float lse, float delta,
                                              int row, int col) {
  if (CHECK && !rule.visible(row, col)) return {0.f, 0.f, 0.f};
  const float capped = rule.capped(dot);
  const float prob = exp2f((rule.score(capped, row, col) - lse) * LOG2E);
  const float dbias = prob * (dp - delta);
  if (!HAS_SOFTCAP) return {prob, dbias, dbias};
  const float tanh_value = capped / rule.softcap;
  return {prob, dbias, dbias * (1.f - tanh_value * tanh_value)};
}

// -- dK, dV (and dBias) ----------------------------------------------------------------------

extern "C" __global__ void __launch_bounds__(THREADS) dmattn_bwd_dkdv_kernel(const BwdParams p) {
  constexpr int BLOCK_N = CTA_ROWS, BLOCK_M = DKDV_BLOCK_M;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  elem_t* k_smem = shared_tiles(smem_raw);
  elem_t* v_smem = k_smem + BLOCK_N * ROW;
  elem_t* q_smem = v_smem + BLOCK_N * ROW;             // ring of STAGES query tiles
  elem_t* do_smem = q_smem + STAGES * BLOCK_M * ROW;   // and their dO tiles
  float* lse_smem = reinterpret_cast<float*>(do_smem + STAGES * BLOCK_M * ROW);
  float* delta_smem = lse_smem + STAGES * BLOCK_M;

  const Inputs& in = p.in;
  const HeadSlices at = head_slices(in, blockIdx.x);
  const GradSlices grads = grad_slices(p, at);
  const ScoreRule rule = score_rule(in, at);
  const int n_block = blockIdx.y;  // causal: the first key blocks see the most queries, and run first
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const int warp_key0 = n_block * BLOCK_N + warp * 16;  // this warp's first key
  const int key0 = warp_key0 + g;                      // this thread's keys: key0, key0 + 8
#if WGMMA  // the warpgroup's products: its keys [group_key0, group_key0 + 64) of the block
  const int group_key0 = (warp / GROUP_WARPS) * GROUP_ROWS;
  const int first_key = n_block * BLOCK_N + group_key0;  // the reach test below is the warpgroup's
#else
  const int first_key = warp_key0;
#endif

  // query tiles that can see a key of this block: with causal, query i sees key j iff i >= j - offset
  const int m_begin = IS_CAUSAL ? max(0, n_block * BLOCK_N - rule.offset) / BLOCK_M : 0;
  const int m_tiles = (in.seqlen_q + BLOCK_M - 1) / BLOCK_M;

  auto load_query_tile = [&](int m, int slot) {
    load_tile<BLOCK_M>(q_smem + slot * BLOCK_M * ROW, at.q, in.q_stride[1], m * BLOCK_M, in.seqlen_q);
    load_tile<BLOCK_M>(do_smem + slot * BLOCK_M * ROW, grads.dout, p.dout_stride[1], m * BLOCK_M, in.seqlen_q);
    for (int i = threadIdx.x; i < BLOCK_M; i += THREADS) {
      const int row = m * BLOCK_M + i;
      lse_smem[slot * BLOCK_M + i] = row_lse(grads.lse, p.lse_stride[2], row, in.seqlen_q);
      delta_smem[slot * BLOCK_M + i] = row < in.seqlen_q ? grads.delta[row * p.delta_stride[2]] : 0.f;
    }
  };

  load_kv_tile<BLOCK_N>(k_smem, v_smem, at, in, n_block, 0);
  commit_group();  // K and V are a group of their own: every later wait also covers it
  for (int s = 0; s < STAGES - 1; ++s) {
    if (m_begin + s < m_tiles) load_query_tile(m_begin + s, s);
    commit_group();
  }

  float dk_acc[BLOCK_D / 8][4] = {}, dv_acc[BLOCK_D / 8][4] = {};
  float dbias_sum[2] = {0.f, 0.f};  // per key, summed over every query (HAS_DBIAS, !DBIAS_ROWS)
  dbias_t* dbias = HAS_DBIAS ? p.dbias + at.batch * p.dbias_stride[0] + at.head * p.dbias_stride[1] : nullptr;
#if !WGMMA
  const elem_t* k_warp = k_smem + warp * 16 * ROW;
  const elem_t* v_warp = v_smem + warp * 16 * ROW;
#endif

  for (int m = m_begin; m < m_tiles; ++m) {
    const int step = m - m_begin, ahead = m + STAGES - 1;
    if (ahead < m_tiles) load_query_tile(ahead, (step + STAGES - 1) % STAGES);
    commit_group();
    wait_group<STAGES - 1>();  // K, V and query tile m have landed
    __syncthreads();
    const int slot = step % STAGES;
    const elem_t* q_tile = q_smem + slot * BLOCK_M * ROW;
    const elem_t* do_tile = do_smem + slot * BLOCK_M * ROW;
    const float* lse_tile = lse_smem + slot * BLOCK_M;
    const float* delta_tile = delta_smem + slot * BLOCK_M;

    // causal: no query of this tile sees a key of this warp, whose products would all be 0
    // (the dBias target is zero already)
    const bool reached = !IS_CAUSAL || first_key <= (m + 1) * BLOCK_M - 1 + rule.offset;
    // every query of the tile sees every key of this warp: no per-position test
    const bool interior = !HAS_MASK && (m + 1) * BLOCK_M <= in.seqlen_q && warp_key0 + 16 <= in.seqlen_k &&
                          (!IS_CAUSAL || warp_key0 + 15 <= m * BLOCK_M + rule.offset);
    if (reached) {
      // S^T = K Q^T and dP^T = V dO^T: this warp's 16 keys x BLOCK_M queries
#if WGMMA
      float s[BLOCK_M / 8][4], dp[BLOCK_M / 8][4];  // the first k-step overwrites (scale-d 0)
      wgmma_fence();
      wgmma_abt(s, k_smem, BLOCK_N, group_key0, q_tile);
      wgmma_abt(dp, v_smem, BLOCK_N, group_key0, do_tile);
      wgmma_commit();
      wgmma_wait<0>();
      touch(s);
      touch(dp);
#else
      float s[BLOCK_M / 8][4] = {}, dp[BLOCK_M / 8][4] = {};
#pragma unroll
      for (int kk = 0; kk < BLOCK_D / 16; ++kk) {
        uint32_t k_frag[4], v_frag[4];
        load_a(k_frag, k_warp, kk, lane);
        load_a(v_frag, v_warp, kk, lane);
        mma_abt(s, k_frag, q_tile, kk, lane);
        mma_abt(dp, v_frag, do_tile, kk, lane);
      }
#endif

      // P^T and dS^T in place of S^T and dP^T; c = 0, 1: key0; c = 2, 3: key0 + 8
      auto gradients = [&](auto check) {
#pragma unroll
        for (int n = 0; n < BLOCK_M / 8; ++n) {
#pragma unroll
          for (int c = 0; c < 4; ++c) {
            const int key = key0 + (c / 2) * 8, column = n * 8 + 2 * t + (c % 2), row = m * BLOCK_M + column;
            const Grad grad = position_grad<decltype(check)::value>(rule, s[n][c], dp[n][c], lse_tile[column],
                                                                     delta_tile[column], row, key);
            s[n][c] = grad.prob;
            dp[n][c] = grad.ds;
            if (HAS_DBIAS && DBIAS_ROWS && row < in.seqlen_q && key < in.seqlen_k)
              dbias[row * p.dbias_stride[2] + key * p.dbias_stride[3]] = static_cast<dbias_t>(grad.dbias);
            if (HAS_DBIAS && !DBIAS_ROWS) dbias_sum[c / 2] += grad.dbias;
          }
        }
      };
      if (interior)
        gradients(Flag<false>());
      else
        gradients(Flag<true>());

      // dV += P^T dO and dK += dS^T Q
#if WGMMA
      uint32_t p_frag[BLOCK_M / 16][4], ds_frag[BLOCK_M / 16][4];  // all first, as in the forward
#pragma unroll
      for (int kk = 0; kk < BLOCK_M / 16; ++kk) {
        accumulator_to_a(p_frag[kk], s, kk);
        accumulator_to_a(ds_frag[kk], dp, kk);
      }
      touch(dv_acc);  // their zero-fill stays before the fence (PTX: no register writes after it)
      touch(dk_acc);
      wgmma_fence();
      wgmma_ab(dv_acc, p_frag, do_tile);
      wgmma_ab(dk_acc, ds_frag, q_tile);
      wgmma_commit();
      wgmma_wait<0>();
      touch(dv_acc);
      touch(dk_acc);
#else
#pragma unroll
      for (int kk = 0; kk < BLOCK_M / 16; ++kk) {
        uint32_t p_frag[4], ds_frag[4];
        accumulator_to_a(p_frag, s, kk);
        accumulator_to_a(ds_frag, dp, kk);
        mma_ab(dv_acc, p_frag, do_tile, kk, lane);
        mma_ab(dk_acc, ds_frag, q_tile, kk, lane);
      }
#endif
    }
    __syncthreads();  // the next iteration's loads overwrite the slot just read
  }
  wait_group<0>();

  // Every key of the block is written, also one that no query sees (its gradients are 0).
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int key = key0 + r * 8;
    if (HAS_DBIAS && !DBIAS_ROWS) {
      dbias_sum[r] += __shfl_xor_sync(0xffffffff, dbias_sum[r], 1);
      dbias_sum[r] += __shfl_xor_sync(0xffffffff, dbias_sum[r], 2);
      if (t == 0 && key < in.seqlen_k) dbias[key * p.dbias_stride[3]] = static_cast<dbias_t>(dbias_sum[r]);
    }
    if (key >= in.seqlen_k) continue;
    const int dkv_head = DKV_FP32 ? at.head : at.kv_head;
    dkv_t* dk = p.dk + at.batch * p.dk_stride[0] + key * p.dk_stride[1] + dkv_head * p.dk_stride[2];
    dkv_t* dv = p.dv + at.batch * p.dv_stride[0] + key * p.dv_stride[1] + dkv_head * p.dv_stride[2];
#pragma unroll
    for (int d = 0; d < BLOCK_D / 8; ++d) {
      const int col = d * 8 + 2 * t;
      if (col < HEAD_DIM) {
        store_pair(dk + col, dk_acc[d][2 * r] * in.softmax_scale, dk_acc[d][2 * r + 1] * in.softmax_scale);
        store_pair(dv + col, dv_acc[d][2 * r], dv_acc[d][2 * r + 1]);
      }
    }
  }
}

// -- dQ --------------------------------------------------------------------------------------

extern "C" __global__ void __launch_bounds__(THREADS) dmattn_bwd_dq_kernel(const BwdParams p) {
  constexpr int BLOCK_M = CTA_ROWS, BLOCK_N = DQ_BLOCK_N;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  elem_t* q_smem = shared_tiles(smem_raw);
  elem_t* do_smem = q_smem + BLOCK_M * ROW;
  elem_t* k_smem = do_smem + BLOCK_M * ROW;            // ring of STAGES key tiles
  elem_t* v_smem = k_smem + STAGES * BLOCK_N * ROW;    // and their value tiles

  const Inputs& in = p.in;
  const HeadSlices at = head_slices(in, blockIdx.x);
  const GradSlices grads = grad_slices(p, at);
  const ScoreRule rule = score_rule(in, at);
  const int m_block = gridDim.y - 1 - blockIdx.y;  // causal: the last query blocks see the most keys, and run first
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const int warp_row0 = m_block * BLOCK_M + warp * 16;  // this warp's first query row
  const int row0 = warp_row0 + g;                       // this thread's rows: row0, row0 + 8
  float lse_of_row[2], delta_of_row[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = row0 + r * 8;
    lse_of_row[r] = row_lse(grads.lse, p.lse_stride[2], row, in.seqlen_q);
    delta_of_row[r] = row < in.seqlen_q ? grads.delta[row * p.delta_stride[2]] : 0.f;
  }

  const KeyTiles tiles = key_tiles<BLOCK_N>(rule, (m_block + 1) * BLOCK_M, warp_row0, 16);
  const int n_tiles = tiles.block;
#if WGMMA
  const int group_row0 = (warp / GROUP_WARPS) * GROUP_ROWS;  // the warpgroup's rows of the block: its products'
#endif

  load_tile<BLOCK_M>(q_smem, at.q, in.q_stride[1], m_block * BLOCK_M, in.seqlen_q);
  load_tile<BLOCK_M>(do_smem, grads.dout, p.dout_stride[1], m_block * BLOCK_M, in.seqlen_q);
  commit_group();
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < n_tiles) load_kv_tile<BLOCK_N>(k_smem, v_smem, at, in, s, s);
    commit_group();
  }

  float dq_acc[BLOCK_D / 8][4] = {};
#if !WGMMA  // mma.sync: this warp's Q and dO rows as A fragments, loaded once (wgmma reads shared)
  uint32_t q_frag[BLOCK_D / 16][4], do_frag[BLOCK_D / 16][4];
#endif

  for (int j = 0; j < n_tiles; ++j) {
    const int ahead = j + STAGES - 1;
    if (ahead < n_tiles) load_kv_tile<BLOCK_N>(k_smem, v_smem, at, in, ahead, ahead % STAGES);
    commit_group();
    wait_group<STAGES - 1>();  // Q, dO and key tile j have landed
    __syncthreads();
#if !WGMMA
    if (j == 0) {
      for (int kk = 0; kk < BLOCK_D / 16; ++kk) {
        load_a(q_frag[kk], q_smem + warp * 16 * ROW, kk, lane);
        load_a(do_frag[kk], do_smem + warp * 16 * ROW, kk, lane);
      }
    }
#endif
    if (j < tiles.reached) {
      const elem_t* k_tile = k_smem + (j % STAGES) * BLOCK_N * ROW;
      const elem_t* v_tile = v_smem + (j % STAGES) * BLOCK_N * ROW;

      // S = Q K^T and dP = dO V^T
#if WGMMA
      float s[BLOCK_N / 8][4], dp[BLOCK_N / 8][4];  // the first k-step overwrites (scale-d 0)
      wgmma_fence();
      wgmma_abt(s, q_smem, BLOCK_M, group_row0, k_tile);
      wgmma_abt(dp, do_smem, BLOCK_M, group_row0, v_tile);
      wgmma_commit();
      wgmma_wait<0>();
      touch(s);
      touch(dp);
#else
      float s[BLOCK_N / 8][4] = {}, dp[BLOCK_N / 8][4] = {};
#pragma unroll
      for (int kk = 0; kk < BLOCK_D / 16; ++kk) {
        mma_abt(s, q_frag[kk], k_tile, kk, lane);
        mma_abt(dp, do_frag[kk], v_tile, kk, lane);
      }
#endif

      // dS in place of dP; c = 0, 1: row0; c = 2, 3: row0 + 8
      auto gradients = [&](auto check) {
#pragma unroll
        for (int n = 0; n < BLOCK_N / 8; ++n) {
#pragma unroll
          for (int c = 0; c < 4; ++c) {
            const int row = row0 + (c / 2) * 8, key = j * BLOCK_N + n * 8 + 2 * t + (c % 2);
            dp[n][c] = position_grad<decltype(check)::value>(rule, s[n][c], dp[n][c], lse_of_row[c / 2],
                                                              delta_of_row[c / 2], row, key).ds;
          }
        }
      };
      if (j < tiles.interior)
        gradients(Flag<false>());
      else
        gradients(Flag<true>());

      // dQ += dS K
#if WGMMA
      uint32_t ds_frag[BLOCK_N / 16][4];
#pragma unroll
      for (int kk = 0; kk < BLOCK_N / 16; ++kk) accumulator_to_a(ds_frag[kk], dp, kk);
      touch(dq_acc);  // its zero-fill stays before the fence (PTX: no register writes after it)
      wgmma_fence();
      wgmma_ab(dq_acc, ds_frag, k_tile);
      wgmma_commit();
      wgmma_wait<0>();
      touch(dq_acc);
#else
#pragma unroll
      for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
        uint32_t ds_frag[4];
        accumulator_to_a(ds_frag, dp, kk);
        mma_ab(dq_acc, ds_frag, k_tile, kk, lane);
      }
#endif
    }
    __syncthreads();
  }
  wait_group<0>();

#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = row0 + r * 8;
    if (row >= in.seqlen_q) continue;
    elem_t* dq = p.dq + at.batch * p.dq_stride[0] + row * p.dq_stride[1] + at.head * p.dq_stride[2];
#pragma unroll
    for (int d = 0; d < BLOCK_D / 8; ++d) {
      const int col = d * 8 + 2 * t;
      if (col < HEAD_DIM)
        store_pair(dq + col, dq_acc[d][2 * r] * in.softmax_scale, dq_acc[d][2 * r + 1] * in.softmax_scale);
    }
  }
}
