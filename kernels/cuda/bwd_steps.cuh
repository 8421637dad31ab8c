// The backward's parameters and per-row steps, shared by both backward kernels (flash_bwd.cu,
// every arch; flash_bwd_ws.cu, SM90 warp-specialized): the outputs' element types, BwdParams,
// delta = rowsum(dO * out) of one query row, and the per-head slices of dO, lse and delta.
#pragma once

#include "common.cuh"

#if DKV_FP32
typedef float dkv_t;
#else
typedef elem_t dkv_t;
#endif

#if DBIAS_FP32
typedef float dbias_t;
#else
typedef elem_t dbias_t;
#endif

struct BwdParams {  // `dmattn_kernels.cuda.params.BwdParams` mirrors it
  Inputs in;
  const elem_t* out;
  const elem_t* dout;
  const float* lse;
  float* delta;
  elem_t* dq;
  dkv_t* dk;               // (B, Lk, Hkv, D), or the (B, Lk, H, D) fp32 shares under DKV_FP32
  dkv_t* dv;
  dbias_t* dbias;          // (B, H, Lq|1, Lk) target
  int64_t out_stride[3];   // batch, row, head
  int64_t dout_stride[3];
  int64_t dq_stride[3];
  int64_t dk_stride[3];
  int64_t dv_stride[3];
  int64_t lse_stride[3];   // batch, head, query
  int64_t delta_stride[3];
  int64_t dbias_stride[4]; // batch, head, query (0 without DBIAS_ROWS), key
};

// delta = rowsum(dO * out), DELTA_ROWS_PER_BLOCK rows of one (batch, head) per CTA: each row's
// DELTA_ROW_LANES lanes read a 16-byte chunk of out and dO each (HEAD_DIM <= 256 is a multiple of
// 8; rows start on 16-byte boundaries: the launcher checks), and a warp has DELTA_UNROLL such
// rows per lane group in flight (a row per warp left the loads too few: H200, W3, 30 us;
// `python -m benchmarks cuda-bwd-ws-check time`).
// `backward.delta_rows_per_block` mirrors the count.
constexpr int pow2_at_least(int n) { return n <= 1 ? 1 : 2 * pow2_at_least((n + 1) / 2); }
constexpr int DELTA_ROW_LANES = pow2_at_least(BLOCK_D / 8);
constexpr int DELTA_UNROLL = 4;
constexpr int DELTA_ROWS_PER_WARP = 32 / DELTA_ROW_LANES * DELTA_UNROLL;
constexpr int DELTA_ROWS_PER_BLOCK = NUM_WARPS * DELTA_ROWS_PER_WARP;

__device__ __forceinline__ void store_deltas(const BwdParams& p) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, col = 8 * (lane % DELTA_ROW_LANES);
  const int batch = blockIdx.y / p.in.num_heads, head = blockIdx.y % p.in.num_heads;
  const int first = blockIdx.x * DELTA_ROWS_PER_BLOCK + warp * DELTA_ROWS_PER_WARP + lane / DELTA_ROW_LANES;
  const elem_t* out = p.out + batch * p.out_stride[0] + head * p.out_stride[2] + col;
  const elem_t* dout = p.dout + batch * p.dout_stride[0] + head * p.dout_stride[2] + col;
  float sum[DELTA_UNROLL];
#pragma unroll
  for (int u = 0; u < DELTA_UNROLL; ++u) {
    const int row = first + u * (32 / DELTA_ROW_LANES);
    sum[u] = 0.f;
    if (row < p.in.seqlen_q && col < HEAD_DIM) {
      const uint4 o = *reinterpret_cast<const uint4*>(out + row * p.out_stride[1]);
      const uint4 d = *reinterpret_cast<const uint4*>(dout + row * p.dout_stride[1]);
      const uint32_t os[4] = {o.x, o.y, o.z, o.w}, ds[4] = {d.x, d.y, d.z, d.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float2 a = unpack2(os[i]), b = unpack2(ds[i]);
        sum[u] += a.x * b.x + a.y * b.y;
      }
    }
  }
#pragma unroll
  for (int u = 0; u < DELTA_UNROLL; ++u) {
    const int row = first + u * (32 / DELTA_ROW_LANES);
#pragma unroll
    for (int offset = DELTA_ROW_LANES / 2; offset > 0; offset /= 2)
      sum[u] += __shfl_xor_sync(0xffffffff, sum[u], offset);
    if (lane % DELTA_ROW_LANES == 0 && row < p.in.seqlen_q)
      p.delta[batch * p.delta_stride[0] + head * p.delta_stride[1] + row * p.delta_stride[2]] = sum[u];
  }
}

// dO, lse and delta of the CTA's (batch, query head).
struct GradSlices {
  const elem_t* dout;
  const float* lse;
  const float* delta;
};

__device__ __forceinline__ GradSlices grad_slices(const BwdParams& p, const HeadSlices& at) {
  return {p.dout + at.batch * p.dout_stride[0] + at.head * p.dout_stride[2],
          p.lse + at.batch * p.lse_stride[0] + at.head * p.lse_stride[1],
          p.delta + at.batch * p.delta_stride[0] + at.head * p.delta_stride[1]};
}

// lse of a row, with a dead row's -inf (and a row past the end) turned into +inf: P = 0 there.
__device__ __forceinline__ float row_lse(const float* lse, int64_t stride, int row, int seqlen_q) {
  const float value = row < seqlen_q ? lse[row * stride] : INFINITY;
  return value == -INFINITY ? INFINITY : value;
}
