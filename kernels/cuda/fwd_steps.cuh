// The forward's per-tile math on mma fragments, shared by both forward kernels (flash_fwd.cu,
// every arch; flash_fwd_ws.cu, SM90 warp-specialized): the score rule applied to S, the online
// softmax, and the epilogue. A warp owns MT m16 tiles of query rows; S holds N8 n8 tiles of one
// key tile. Fragment (mt, n, c) of S sits at row `warp_row0 + 16 mt + g + 8 (c / 2)`, column
// `col0 + 8 n + 2 t + c % 2` (common.cuh's fragment coordinates).
//
// FWD_OVERLAP (flash_fwd_ws.cu's overlapped consumers only; flash_fwd.cu is never built with it)
// splits the online softmax into `softmax_tile`, `rows_moved` and `rescale_rows`, so that acc is
// rescaled apart from the exps, keeps scores as dots where the scale can go into the exp, and
// without a window tests a position's reach against its row's last key (`last_reached`).
#pragma once

#include "common.cuh"

struct FwdParams {  // `dmattn_kernels.cuda.params.FwdParams` mirrors it
  Inputs in;
  elem_t* out;
  float* lse;
  int64_t out_stride[3];   // batch, row, head
  int64_t lse_stride[3];   // batch, head, query
};

#if FWD_OVERLAP  // flash_fwd_ws.cu's overlapped consumers (FwdConfig.overlap)
// Without bias or softcap a score is scale * dot: `scores` leaves the dot, the scale goes into
// the exp's FFMA (`log2_scale`), and a row's max is kept in dots (`store_rows` scales it).
constexpr bool SCALE_IN_EXP = !HAS_BIAS && !HAS_SOFTCAP;

// The softmax's exp2 factor: log2(e), times the scale where the scores are dots.
__device__ __forceinline__ float log2_scale(const Inputs& in) { return SCALE_IN_EXP ? in.softmax_scale * LOG2E : LOG2E; }

// v[0] op ... op v[N - 1] as a tree: log2(N) dependent steps, not N (a row's max, its sum).
template <int N, typename Op>
__device__ __forceinline__ float tree_reduce(float (&v)[N], Op op) {
#pragma unroll
  for (int level = 0; (1 << level) < N; ++level)
#pragma unroll
    for (int i = 0; i + (1 << level) < N; i += 2 << level) v[i] = op(v[i], v[i + (1 << level)]);
  return v[0];
}

#if !HAS_WINDOW
// The last key `row` reaches (-1 past the queries): without a window, `rule.reached(row, col)`
// is `col <= last_reached(rule, row)`, one test a position of a tile instead of three.
__device__ __forceinline__ int last_reached(const ScoreRule& rule, int row) {
  if (row >= rule.seqlen_q) return -1;
  return IS_CAUSAL ? min(rule.seqlen_k - 1, row + rule.offset) : rule.seqlen_k - 1;
}
#endif
#endif

// S of one key tile -> scores, in place: -inf where excluded. REACH == false is a tile the
// caller knows every row reaches (KeyTiles::inside): no bound or causal test, only the mask's.
// The mask and bias come from tiles of MASK_ROWS and BIAS_ROWS rows `staged` holds, or from
// global memory (`rule`) where those are 0. Each thread takes its two adjacent columns of a row
// at once; a staged bias comes by ldmatrix, four such pairs (rows g and g + 8 of two n8 tiles)
// an instruction, since its fragment is the accumulator's.
template <bool REACH, int MASK_ROWS, int BIAS_ROWS, int MT, int N8>
__device__ __forceinline__ void scores(float (&s)[MT][N8][4], const ScoreRule& rule, const StagedScores& staged,
                                       int warp_row0, int col0, int g, int t) {
  static_assert(N8 % 2 == 0, "key tiles of whole 16-key steps");
  constexpr int MASK_LINE = N8 * 8 < 128 ? N8 * 8 : 128;
  constexpr int BIAS_LINE = 128;
  const int lane = 4 * g + t;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    const int tile_row0 = warp_row0 + mt * 16 - staged.row0;  // in a staged tile: a multiple of 16
#pragma unroll
    for (int n2 = 0; n2 < N8; n2 += 2) {
      // matrix q of the ldmatrix: n8 tile n2 + q / 2, rows + 8 (q % 2); each lane names one 16-byte row
      uint32_t bias_pairs[4] = {};
      if (HAS_BIAS && BIAS_ROWS) {
        const int q = lane / 8;
        ldmatrix_x4(bias_pairs, reinterpret_cast<const elem_t*>(staged.bias + StagedScores::offset<BIAS_ROWS, BIAS_LINE>(
                                                                                  tile_row0 + (q % 2) * 8, lane % 8,
                                                                                  (n2 + q / 2) * 16)));
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int n = n2 + h;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int row = warp_row0 + mt * 16 + g + r * 8, col = col0 + n * 8 + 2 * t;
#if FWD_OVERLAP && !HAS_WINDOW
          const int last = last_reached(rule, row);
#endif
          uint16_t kept = 0x0101;  // a staged mask pair
          if (HAS_MASK && MASK_ROWS)
            kept = *reinterpret_cast<const uint16_t*>(
                staged.mask + StagedScores::offset<MASK_ROWS, MASK_LINE>(tile_row0 + r * 8, g, n * 8 + 2 * t));
          const float2 bias = unpack2(bias_pairs[2 * h + r]);
#pragma unroll
          for (int e = 0; e < 2; ++e) {
#if FWD_OVERLAP && !HAS_WINDOW
            bool allowed = !REACH || col + e <= last;
#else
            bool allowed = !REACH || rule.reached(row, col + e);
#endif
            // a mask in global memory is read only where reached: past the sequences it may not exist
            if (HAS_MASK)
              allowed = allowed && (MASK_ROWS ? ((kept >> (8 * e)) & 0xff) != 0
                                              : rule.mask[row * rule.mask_row + (col + e) * rule.mask_col] != 0);
#if FWD_OVERLAP
            const float capped = SCALE_IN_EXP ? s[mt][n][2 * r + e] : rule.capped(s[mt][n][2 * r + e]);  // a dot, or a score
#else
            const float capped = rule.capped(s[mt][n][2 * r + e]);
#endif
            const float staged_bias = e == 0 ? bias.x : bias.y;
            // the global bias is read only where allowed: excluded positions may lie outside it
            s[mt][n][2 * r + e] = !allowed                ? -INFINITY
                                  : HAS_BIAS && BIAS_ROWS ? capped + staged_bias
                                                          : rule.score(capped, row, col + e);
          }
        }
      }
    }
  }
}

#if FWD_OVERLAP
// One key tile of the online softmax: scores s -> P (in place, fp32), the row max and sum
// updated, and the factor each row's acc is to be rescaled by (`rescale_rows`; apart, so a
// kernel can run this while a product still writes acc). P = exp2(s L - m L) with L =
// `log2_scale`. r = 0: row g (c = 0, 1), r = 1: row g + 8 (c = 2, 3) of tile mt.
template <int MT, int N8>
__device__ __forceinline__ void softmax_tile(float (&s)[MT][N8][4], float (&row_max)[MT][2], float (&row_sum)[MT][2],
                                             float (&rescale)[MT][2], float log2_scale) {
  const auto max = [](float a, float b) { return fmaxf(a, b); };
  const auto add = [](float a, float b) { return a + b; };
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float part[N8];  // the row's pairs, reduced
#pragma unroll
      for (int n = 0; n < N8; ++n) part[n] = fmaxf(s[mt][n][2 * r], s[mt][n][2 * r + 1]);
      float tile_max = tree_reduce(part, max);
      tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffff, tile_max, 1));
      tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffff, tile_max, 2));
      // An ulp up: the FFMA below takes the exact product S L, up to half an ulp above the
      // rounded base; at |S| ~ 1e9 (a -1e9 fp32 bias on a whole row) P was 2^64, inf in fp16.
      // The max moves only where the tile's passes it by more than 8 / L (FlashAttention-4's
      // rescale threshold): P stays below 2^8, which bf16, fp16 and the fp32 sums hold, and past
      // the first tiles a warp's rows rarely move, so `rows_moved` skips acc's multiplies (H200,
      // W3 at 128x128 w12 s2 overlap persistent tma_store: 0.240 -> 0.235 ms). From -inf (no
      // key allowed yet) any finite max moves it.
      const float raised = above_by_an_ulp(tile_max);
      const float new_max = (raised - row_max[mt][r]) * log2_scale > 8.f ? raised : row_max[mt][r];
      // a row with nothing allowed yet keeps max -inf: subtract 0 so exp(-inf - -inf) never runs
      const float shift = new_max == -INFINITY ? 0.f : new_max;
      // Difference first, so an unchanged max rescales by exactly 1. exp2(m L - round(m L))
      // (one FFMA) is 2^delta with delta up to half an ulp of m L: applied once per key tile
      // it weights early and late tiles apart, 0.6% over 64 tiles at a row max of -1e4.
      rescale[mt][r] = exp2_ftz((row_max[mt][r] - shift) * log2_scale);
      const float base = shift * log2_scale;  // P = exp2(S L - base): the same base for every P of the tile
      row_max[mt][r] = new_max;
#pragma unroll
      for (int n = 0; n < N8; ++n) {
        s[mt][n][2 * r] = exp2_ftz(fmaf(s[mt][n][2 * r], log2_scale, -base));
        s[mt][n][2 * r + 1] = exp2_ftz(fmaf(s[mt][n][2 * r + 1], log2_scale, -base));
        part[n] = s[mt][n][2 * r] + s[mt][n][2 * r + 1];
      }
      row_sum[mt][r] = row_sum[mt][r] * rescale[mt][r] + tree_reduce(part, add);
    }
  }
}

// Whether acc is to be rescaled: some row of the warp moved its max (a factor other than 1).
// Once the rows' maxes have settled (most later tiles) the multiplies are skipped. The row sums
// take part, though never negative, so that the vote comes after the tile's exps: a kernel that
// waits for a product only in the branches of this vote (flash_fwd_ws.cu) gets the softmax
// scheduled before that wait.
template <int MT>
__device__ __forceinline__ bool rows_moved(const float (&rescale)[MT][2], const float (&row_sum)[MT][2]) {
  bool settled = true;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) settled = settled && rescale[mt][r] == 1.f && row_sum[mt][r] >= 0.f;
  return !__all_sync(0xffffffff, settled);
}

// acc's rows times softmax_tile's factors.
template <int MT>
__device__ __forceinline__ void rescale_rows(float (&acc)[MT][BLOCK_D / 8][4], const float (&rescale)[MT][2]) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int d = 0; d < BLOCK_D / 8; ++d)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[mt][d][c] *= rescale[mt][c / 2];
}
#else
// One key tile of the online softmax: scores s -> P (in place, fp32), the row max and sum
// updated, acc rescaled. r = 0: row g (c = 0, 1), r = 1: row g + 8 (c = 2, 3) of tile mt.
template <int MT, int N8>
__device__ __forceinline__ void online_softmax(float (&s)[MT][N8][4], float (&row_max)[MT][2], float (&row_sum)[MT][2],
                                               float (&acc)[MT][BLOCK_D / 8][4]) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float tile_max = -INFINITY;
#pragma unroll
      for (int n = 0; n < N8; ++n) tile_max = fmaxf(tile_max, fmaxf(s[mt][n][2 * r], s[mt][n][2 * r + 1]));
      tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffff, tile_max, 1));
      tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffff, tile_max, 2));
      // An ulp up: the FFMA below takes the exact product S L, up to half an ulp above the
      // rounded base; at |S| ~ 1e9 (a -1e9 fp32 bias on a whole row) P was 2^64, inf in fp16.
      const float new_max = fmaxf(row_max[mt][r], above_by_an_ulp(tile_max));
      // a row with nothing allowed yet keeps max -inf: subtract 0 so exp(-inf - -inf) never runs
      const float shift = new_max == -INFINITY ? 0.f : new_max;
      // Difference first, so an unchanged max rescales by exactly 1. exp2(m L - round(m L))
      // (one FFMA) is 2^delta with delta up to half an ulp of m L: applied once per key tile
      // it weights early and late tiles apart, 0.6% over 64 tiles at a row max of -1e4.
      const float rescale = exp2_ftz((row_max[mt][r] - shift) * LOG2E);
      const float base = shift * LOG2E;  // P = exp2(S L - base): the same base for every P of the tile
      row_max[mt][r] = new_max;
      float sum = 0.f;
#pragma unroll
      for (int n = 0; n < N8; ++n) {
        s[mt][n][2 * r] = exp2_ftz(fmaf(s[mt][n][2 * r], LOG2E, -base));
        s[mt][n][2 * r + 1] = exp2_ftz(fmaf(s[mt][n][2 * r + 1], LOG2E, -base));
        sum += s[mt][n][2 * r] + s[mt][n][2 * r + 1];
      }
      row_sum[mt][r] = row_sum[mt][r] * rescale + sum;
      // Once a row's max has settled (most later tiles) the rescale is 1 for the warp's rows:
      // skip its multiplies then.
      if (!__all_sync(0xffffffff, rescale == 1.f)) {
#pragma unroll
        for (int d = 0; d < BLOCK_D / 8; ++d) {
          acc[mt][d][2 * r] *= rescale;
          acc[mt][d][2 * r + 1] *= rescale;
        }
      }
    }
  }
}
#endif

// out = acc / l, lse = m + log l for this warp's rows (m scaled where FWD_OVERLAP keeps it in
// dots); rows with l == 0 saw no allowed key (dead rows: out 0, lse -inf).
template <int MT>
__device__ __forceinline__ void store_rows(const FwdParams& p, const HeadSlices& at, const float (&acc)[MT][BLOCK_D / 8][4],
                                           const float (&row_max)[MT][2], const float (&row_sum)[MT][2], int warp_row0,
                                           int g, int t) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float sum = row_sum[mt][r];
      sum += __shfl_xor_sync(0xffffffff, sum, 1);
      sum += __shfl_xor_sync(0xffffffff, sum, 2);
      const int row = warp_row0 + mt * 16 + r * 8 + g;
      if (row >= p.in.seqlen_q) continue;
      const bool dead = sum == 0.f;
      const float inverse = dead ? 0.f : 1.f / sum;
      elem_t* out = p.out + at.batch * p.out_stride[0] + row * p.out_stride[1] + at.head * p.out_stride[2];
#pragma unroll
      for (int d = 0; d < BLOCK_D / 8; ++d) {
        const int col = d * 8 + 2 * t;
        if (col < HEAD_DIM)  // HEAD_DIM is a multiple of 8: the pair is in or out together
          store_pair(out + col, acc[mt][d][2 * r] * inverse, acc[mt][d][2 * r + 1] * inverse);
      }
      if (t == 0)
        p.lse[at.batch * p.lse_stride[0] + at.head * p.lse_stride[1] + row * p.lse_stride[2]] =
#if FWD_OVERLAP
            dead ? -INFINITY : row_max[mt][r] * (SCALE_IN_EXP ? p.in.softmax_scale : 1.f) + logf(sum);
#else
            dead ? -INFINITY : row_max[mt][r] + logf(sum);
#endif
    }
  }
}
