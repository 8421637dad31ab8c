// The forward's per-tile math on mma fragments, shared by both forward kernels (flash_fwd.cu,
// every arch; flash_fwd_ws.cu, SM90 warp-specialized): the score rule applied to S, the online
// softmax, and the epilogue. A warp owns MT m16 tiles of query rows; S holds N8 n8 tiles of one
// key tile. Fragment (mt, n, c) of S sits at row `warp_row0 + 16 mt + g + 8 (c / 2)`, column
// `col0 + 8 n + 2 t + c % 2` (common.cuh's fragment coordinates).
#pragma once

#include "common.cuh"

struct FwdParams {  // `dmattn_kernels.cuda.launch._FwdParams` mirrors it
  Inputs in;
  elem_t* out;
  float* lse;
  int64_t out_stride[3];   // batch, row, head
  int64_t lse_stride[3];   // batch, head, query
};

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
          uint16_t kept = 0x0101;  // a staged mask pair
          if (HAS_MASK && MASK_ROWS)
            kept = *reinterpret_cast<const uint16_t*>(
                staged.mask + StagedScores::offset<MASK_ROWS, MASK_LINE>(tile_row0 + r * 8, g, n * 8 + 2 * t));
          const float2 bias = unpack2(bias_pairs[2 * h + r]);
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            bool allowed = !REACH || rule.reached(row, col + e);
            // a mask in global memory is read only where reached: past the sequences it may not exist
            if (HAS_MASK)
              allowed = allowed && (MASK_ROWS ? ((kept >> (8 * e)) & 0xff) != 0
                                              : rule.mask[row * rule.mask_row + (col + e) * rule.mask_col] != 0);
            const float capped = rule.capped(s[mt][n][2 * r + e]);
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

// out = acc / l, lse = m + log l for this warp's rows; rows with l == 0 saw no allowed key (dead
// rows: out 0, lse -inf).
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
            dead ? -INFINITY : row_max[mt][r] + logf(sum);
    }
  }
}
