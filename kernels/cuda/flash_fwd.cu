// Flash dynamic-mask attention, forward (FlashAttention-2 style) for SM80, SM90 and SM120.
//
// One CTA owns BLOCK_M query rows of one (batch, head); warp w owns the WARP_M = BLOCK_M /
// NUM_WARPS rows [WARP_M w, WARP_M (w + 1)), as WARP_TILES (1 or 2) m16 tiles. For each key
// tile j of BLOCK_N keys (only those the causal rule can reach):
//
//   S   = softmax_scale * Q K_j^T                      (mma.sync m16n8k16, fp32 accumulators)
//   S   = softcap * tanh(S / softcap)                  (HAS_SOFTCAP)
//   S   = allowed ? S + bias : -inf                    (allowed = in bounds, causal, mask)
//   m'  = max(m, rowmax S);  P = exp(S - m');  l = l * exp(m - m') + rowsum P
//   acc = acc * exp(m - m') + P V_j                    (P rounded to the input dtype, as FA2)
//
// and at the end out = acc / l, lse = m + log l; a row that saw no allowed key (l == 0) gets
// out = 0 and lse = -inf. The bias is read only where `allowed` holds, so NaN or inf at
// excluded positions never reaches S; a -inf bias at an allowed position only zeroes P.
//
// Where `allowed` is tested: without a mask, a key tile that lies inside the sequence bounds and
// at or below the causal diagonal of every row of the warp is allowed everywhere, so only the
// boundary tiles (the diagonal, the last key tile, the last query block) test each position. A
// tile wholly above the diagonal of the warp's rows is excluded everywhere: the warp skips its
// products (the CTA still loads it for the warps below the diagonal).
//
// Why up to two m16 tiles per warp: each K or V fragment read from shared memory (ldmatrix)
// then feeds four mma instead of two. With one tile per warp the H200 forward was bound by
// shared memory reads (205 TFLOP/s on W3, 2026-11-22). Q is re-read from shared
// memory per key tile instead of held in registers: that leaves room for the 32-row
// accumulators.
//
// Order: CTAs start in grid order (x fastest), so with the (batch, head) slice on x and query
// blocks on y taken last to first, every head's longest causal blocks run first and the short
// ones fill the tail. In the first order (query blocks on x, first to last) the H200 W3 forward
// kept its SMs busy 80% of the time (ncu: executed IPC 1.61 elapsed vs 2.00 active).
//
// Memory: K and V tiles go global -> shared through cp.async in a ring of STAGES buffers, rows
// past the sequence end and lanes past HEAD_DIM zero-filled (never read), so 0 * NaN cannot
// happen. For ldmatrix, shared rows are padded by 16 bytes: consecutive rows start in different
// banks, and ldmatrix reads 8 rows without conflicts (wgmma tiles are swizzled instead).
//
// SM90 (WGMMA, rules.uses_wgmma picks it on sm90 where the tile allows): the two products run as
// wgmma.mma_async on shared operands (Q, K, V in the swizzled layout of sm90.cuh; P from
// registers), one m64 product per warpgroup of four warps. Each warp still owns 16 rows and
// the same accumulator fragments, so the score rule and the online softmax are one code. The
// warpgroup issues its products together, so it skips a tile only when the causal rule hides
// it from all its 64 rows.
//
// Compile-time parameters: those of common.cuh, and BLOCK_M and BLOCK_N.

#include "fwd_steps.cuh"

#if HAS_WINDOW
#error "a sliding window runs in the overlapped warp-specialized forward only (flash_fwd_ws.cu)"
#endif

constexpr int WARP_TILES = BLOCK_M / (WARP_ROWS * NUM_WARPS);  // m16 tiles per warp
constexpr int WARP_M = WARP_ROWS * WARP_TILES;                 // query rows per warp
static_assert(WARP_TILES * WARP_ROWS * NUM_WARPS == BLOCK_M && (WARP_TILES == 1 || WARP_TILES == 2),
              "BLOCK_M must be 16 or 32 rows per warp");
#if WGMMA
static_assert(WARP_TILES == 1, "wgmma: 16 rows per warp");
static_assert(is_wgmma_width(BLOCK_N), "wgmma: no m64nN product for this BLOCK_N");
#endif

extern "C" __global__ void __launch_bounds__(THREADS) dmattn_fwd_kernel(const FwdParams p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  elem_t* q_smem = shared_tiles(smem_raw);
  elem_t* k_smem = q_smem + BLOCK_M * ROW;
  elem_t* v_smem = k_smem + STAGES * BLOCK_N * ROW;

  const Inputs& in = p.in;
  const HeadSlices at = head_slices(in, blockIdx.x);
  const ScoreRule rule = score_rule(in, at);
  const int m_block = gridDim.y - 1 - blockIdx.y;  // the longest causal rows first: see the header
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;  // mma fragment coordinates: row group, column pair
  const int warp_row0 = m_block * BLOCK_M + warp * WARP_M;  // this warp's first query row
#if !WGMMA
  const elem_t* q_warp = q_smem + warp * WARP_M * ROW;
#endif

  const KeyTiles tiles = key_tiles<BLOCK_N>(rule, (m_block + 1) * BLOCK_M, warp_row0, WARP_M);
  const int n_tiles = tiles.block;
#if WGMMA
  const int group_row0 = (warp / GROUP_WARPS) * GROUP_ROWS;  // the warpgroup's rows of Q: its products'
#endif

  load_tile<BLOCK_M>(q_smem, at.q, in.q_stride[1], m_block * BLOCK_M, in.seqlen_q);
  commit_group();  // Q is a group of its own: every later wait also covers it
  for (int s = 0; s < STAGES - 1; ++s) {  // prologue: the first STAGES - 1 key tiles
    if (s < n_tiles) load_kv_tile<BLOCK_N>(k_smem, v_smem, at, in, s, s);
    commit_group();
  }

  float acc[WARP_TILES][BLOCK_D / 8][4] = {};
  float row_max[WARP_TILES][2], row_sum[WARP_TILES][2];
#pragma unroll
  for (int mt = 0; mt < WARP_TILES; ++mt) {
    row_max[mt][0] = row_max[mt][1] = -INFINITY;
    row_sum[mt][0] = row_sum[mt][1] = 0.f;
  }

  for (int j = 0; j < n_tiles; ++j) {
    const int ahead = j + STAGES - 1;  // keep STAGES - 1 tiles in flight
    if (ahead < n_tiles) load_kv_tile<BLOCK_N>(k_smem, v_smem, at, in, ahead, ahead % STAGES);
    commit_group();
    wait_group<STAGES - 1>();  // Q and tile j have landed (only later tiles may be in flight)
    __syncthreads();
    if (j < tiles.reached) {
      const elem_t* k_tile = k_smem + (j % STAGES) * BLOCK_N * ROW;
      const elem_t* v_tile = v_smem + (j % STAGES) * BLOCK_N * ROW;

      // S = Q K^T
#if WGMMA
      float s[WARP_TILES][BLOCK_N / 8][4];  // the first k-step overwrites (scale-d 0)
      wgmma_fence();
      wgmma_abt(s[0], q_smem, BLOCK_M, group_row0, k_tile);
      wgmma_commit();
      wgmma_wait<0>();
      touch(s[0]);
#else
      float s[WARP_TILES][BLOCK_N / 8][4] = {};
#pragma unroll
      for (int kk = 0; kk < BLOCK_D / 16; ++kk) {
        uint32_t q_frag[WARP_TILES][4];
#pragma unroll
        for (int mt = 0; mt < WARP_TILES; ++mt) load_a(q_frag[mt], q_warp + mt * 16 * ROW, kk, lane);
        mma_abt(s, q_frag, k_tile, kk, lane);
      }
#endif
      const StagedScores none = {nullptr, nullptr, 0};  // mask and bias read from global memory
      if (j < tiles.inside)
        scores<false, 0, 0>(s, rule, none, warp_row0, j * BLOCK_N, g, t);
      else
        scores<true, 0, 0>(s, rule, none, warp_row0, j * BLOCK_N, g, t);

      online_softmax(s, row_max, row_sum, acc);

      // acc += P V: the S accumulators of two n8 tiles form one 16x16 A fragment
#if WGMMA
      uint32_t p_frag[BLOCK_N / 16][4];  // all of them first: wgmma then reads registers no one writes
#pragma unroll
      for (int kk = 0; kk < BLOCK_N / 16; ++kk) accumulator_to_a(p_frag[kk], s[0], kk);
      touch(acc[0]);  // the rescale's writes stay before the fence (PTX: no register writes after it)
      wgmma_fence();
      wgmma_ab(acc[0], p_frag, v_tile);
      wgmma_commit();
      wgmma_wait<0>();
      touch(acc[0]);
#else
#pragma unroll
      for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
        uint32_t p_frag[WARP_TILES][4];
#pragma unroll
        for (int mt = 0; mt < WARP_TILES; ++mt) accumulator_to_a(p_frag[mt], s[mt], kk);
        mma_ab(acc, p_frag, v_tile, kk, lane);
      }
#endif
    }
    __syncthreads();  // the next iteration's loads overwrite the slot just read
  }
  wait_group<0>();

  store_rows(p, at, acc, row_max, row_sum, warp_row0, g, t);
}
