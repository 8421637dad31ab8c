// Flash dynamic-mask attention, forward (FlashAttention-2 style) for SM80, SM90 and SM120.
//
// One CTA owns BLOCK_M = 16 * NUM_WARPS query rows of one (batch, head); warp w owns rows
// [16w, 16w + 16). For each key tile j of BLOCK_N keys (only those the causal rule can reach):
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
// Memory: K and V tiles go global -> shared through cp.async in a ring of STAGES buffers, rows
// past the sequence end and lanes past HEAD_DIM zero-filled (never read), so 0 * NaN cannot
// happen. Shared rows are padded by 16 bytes: consecutive rows start in different banks, and
// ldmatrix reads 8 rows without conflicts.
//
// Compile-time parameters: those of common.cuh, and BLOCK_N.

#include "common.cuh"

constexpr int BLOCK_M = CTA_ROWS;

struct FwdParams {  // `dmattn_kernels.cuda.launch._FwdParams` mirrors it
  Inputs in;
  elem_t* out;
  float* lse;
  int64_t out_stride[3];   // batch, row, head
  int64_t lse_stride[3];   // batch, head, query
};

extern "C" __global__ void __launch_bounds__(THREADS) dmattn_fwd_kernel(const FwdParams p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  elem_t* q_smem = reinterpret_cast<elem_t*>(smem_raw);
  elem_t* k_smem = q_smem + BLOCK_M * ROW;
  elem_t* v_smem = k_smem + STAGES * BLOCK_N * ROW;

  const Inputs& in = p.in;
  const HeadSlices at = head_slices(in);
  const ScoreRule rule = score_rule(in, at);
  const int m_block = blockIdx.x;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;  // mma fragment coordinates: row group, column pair
  const int row0 = m_block * BLOCK_M + warp * 16 + g;  // this thread's rows: row0, row0 + 8

  // key tiles the causal rule lets this query block reach
  int n_end = in.seqlen_k;
  if (IS_CAUSAL) n_end = min(n_end, max(0, (m_block + 1) * BLOCK_M + rule.offset));
  const int n_tiles = (n_end + BLOCK_N - 1) / BLOCK_N;

  load_tile<BLOCK_M>(q_smem, at.q, in.q_stride[1], m_block * BLOCK_M, in.seqlen_q);
  commit_group();  // Q is a group of its own: every later wait also covers it
  for (int s = 0; s < STAGES - 1; ++s) {  // prologue: the first STAGES - 1 key tiles
    if (s < n_tiles) load_kv_tile<BLOCK_N>(k_smem, v_smem, at, in, s, s);
    commit_group();
  }

  float acc[BLOCK_D / 8][4] = {};
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.f, 0.f};
  uint32_t q_frag[BLOCK_D / 16][4];

  for (int j = 0; j < n_tiles; ++j) {
    const int ahead = j + STAGES - 1;  // keep STAGES - 1 tiles in flight
    if (ahead < n_tiles) load_kv_tile<BLOCK_N>(k_smem, v_smem, at, in, ahead, ahead % STAGES);
    commit_group();
    wait_group<STAGES - 1>();  // Q and tile j have landed (only later tiles may be in flight)
    __syncthreads();
    if (j == 0) {
      for (int kk = 0; kk < BLOCK_D / 16; ++kk)
        load_a(q_frag[kk], q_smem + warp * 16 * ROW, kk, lane);
    }
    const elem_t* k_tile = k_smem + (j % STAGES) * BLOCK_N * ROW;
    const elem_t* v_tile = v_smem + (j % STAGES) * BLOCK_N * ROW;

    // S = Q K^T
    float s[BLOCK_N / 8][4] = {};
#pragma unroll
    for (int kk = 0; kk < BLOCK_D / 16; ++kk) mma_abt(s, q_frag[kk], k_tile, kk, lane);

    // scores, exclusions and the online softmax; c = 0, 1: row0; c = 2, 3: row0 + 8
    float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int n = 0; n < BLOCK_N / 8; ++n) {
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int row = row0 + (c / 2) * 8, col = j * BLOCK_N + n * 8 + 2 * t + (c % 2);
        s[n][c] = rule.visible(row, col) ? rule.score(rule.capped(s[n][c]), row, col) : -INFINITY;
        tile_max[c / 2] = fmaxf(tile_max[c / 2], s[n][c]);
      }
    }
    float scale[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffff, tile_max[r], 1));
      tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffff, tile_max[r], 2));
      const float new_max = fmaxf(row_max[r], tile_max[r]);
      // a row with nothing allowed yet keeps max -inf: subtract 0 so exp(-inf - -inf) never runs
      const float base = new_max == -INFINITY ? 0.f : new_max;
      scale[r] = exp2f((row_max[r] - base) * LOG2E);
      row_max[r] = new_max;
      row_sum[r] *= scale[r];
#pragma unroll
      for (int n = 0; n < BLOCK_N / 8; ++n) {
        s[n][2 * r] = exp2f((s[n][2 * r] - base) * LOG2E);
        s[n][2 * r + 1] = exp2f((s[n][2 * r + 1] - base) * LOG2E);
        row_sum[r] += s[n][2 * r] + s[n][2 * r + 1];
      }
    }
#pragma unroll
    for (int d = 0; d < BLOCK_D / 8; ++d) {
      acc[d][0] *= scale[0]; acc[d][1] *= scale[0];
      acc[d][2] *= scale[1]; acc[d][3] *= scale[1];
    }

    // acc += P V: the S accumulators of two n8 tiles form one 16x16 A fragment
#pragma unroll
    for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
      uint32_t a[4];
      accumulator_to_a(a, s, kk);
      mma_ab(acc, a, v_tile, kk, lane);
    }
    __syncthreads();  // the next iteration's loads overwrite the slot just read
  }
  wait_group<0>();

  // out = acc / l, lse = m + log l; rows with l == 0 saw no allowed key (dead rows)
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    row_sum[r] += __shfl_xor_sync(0xffffffff, row_sum[r], 1);
    row_sum[r] += __shfl_xor_sync(0xffffffff, row_sum[r], 2);
    const int row = row0 + r * 8;
    if (row >= in.seqlen_q) continue;
    const bool dead = row_sum[r] == 0.f;
    const float inverse = dead ? 0.f : 1.f / row_sum[r];
    elem_t* out = p.out + at.batch * p.out_stride[0] + row * p.out_stride[1] + at.head * p.out_stride[2];
#pragma unroll
    for (int d = 0; d < BLOCK_D / 8; ++d) {
      const int col = d * 8 + 2 * t;
      if (col < HEAD_DIM)  // HEAD_DIM is a multiple of 8: the pair is in or out together
        store_pair(out + col, acc[d][2 * r] * inverse, acc[d][2 * r + 1] * inverse);
    }
    if (t == 0)
      p.lse[at.batch * p.lse_stride[0] + at.head * p.lse_stride[1] + row * p.lse_stride[2]] =
          dead ? -INFINITY : row_max[r] + logf(row_sum[r]);
  }
}
