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
// Compile-time parameters (one -D each; `dmattn_kernels.cuda.build` is the only place that
// sets them): ELEMENT (0 fp16, 1 bf16), BIAS_FP32, HEAD_DIM, BLOCK_N, NUM_WARPS, STAGES,
// IS_CAUSAL, HAS_MASK, HAS_BIAS, HAS_SOFTCAP.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#if ELEMENT == 1
typedef __nv_bfloat16 elem_t;
typedef __nv_bfloat162 elem2_t;
#define MMA_TYPE "bf16"
__device__ __forceinline__ elem2_t pack2(float a, float b) { return __floats2bfloat162_rn(a, b); }
#else
typedef __half elem_t;
typedef __half2 elem2_t;
#define MMA_TYPE "f16"
__device__ __forceinline__ elem2_t pack2(float a, float b) { return __floats2half2_rn(a, b); }
#endif

#if BIAS_FP32
typedef float bias_t;
__device__ __forceinline__ float bias_value(bias_t x) { return x; }
#else
typedef elem_t bias_t;
__device__ __forceinline__ float bias_value(bias_t x) { return static_cast<float>(x); }
#endif

constexpr int BLOCK_M = 16 * NUM_WARPS;
constexpr int BLOCK_D = (HEAD_DIM + 15) / 16 * 16;  // the mma k-step is 16
constexpr int ROW = BLOCK_D + 8;                     // shared row length in elements (16 B pad)
constexpr int CHUNKS = BLOCK_D / 8;                  // 16-byte chunks per row
constexpr int THREADS = NUM_WARPS * 32;
constexpr float LOG2E = 1.4426950408889634f;

struct FwdParams {
  const elem_t* q;
  const elem_t* k;
  const elem_t* v;
  const uint8_t* mask;
  const bias_t* bias;
  elem_t* out;
  float* lse;
  int64_t q_stride[3];     // batch, row, head (the head dim is contiguous)
  int64_t k_stride[3];
  int64_t v_stride[3];
  int64_t out_stride[3];
  int64_t mask_stride[4];  // batch, head, query, key (0 on broadcast dims)
  int64_t bias_stride[4];
  int64_t lse_stride[3];   // batch, head, query
  int num_heads;
  int seqlen_q;
  int seqlen_k;
  int group;               // query heads per kv head
  int mask_head_div;       // query head h reads mask slice h / mask_head_div
  int bias_head_div;
  float softmax_scale;
  float softcap;
};

__device__ __forceinline__ uint32_t shared_address(const void* pointer) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(pointer));
}

// 16 bytes global -> shared; `valid == false` writes zeros and reads nothing.
__device__ __forceinline__ void copy_chunk(elem_t* dst, const elem_t* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
               :: "r"(shared_address(dst)), "l"(src), "r"(valid ? 16 : 0));
}

__device__ __forceinline__ void commit_group() { asm volatile("cp.async.commit_group;\n" ::); }

template <int N>
__device__ __forceinline__ void wait_group() { asm volatile("cp.async.wait_group %0;\n" :: "n"(N)); }

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const elem_t* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(shared_address(p)));
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const elem_t* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(shared_address(p)));
}

// c[4] += a[4] (16x16, row) * b[2] (16x8, col), fp32 accumulate.
__device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." MMA_TYPE "." MMA_TYPE ".f32 "
               "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t as_u32(elem2_t x) { return *reinterpret_cast<uint32_t*>(&x); }

// rows x BLOCK_D tile of a (batch, head) slice starting at row `first`, rows past `rows_end`
// and lanes past HEAD_DIM zero-filled.
template <int ROWS>
__device__ __forceinline__ void load_tile(elem_t* dst, const elem_t* base, int64_t row_stride, int first,
                                          int rows_end) {
  for (int c = threadIdx.x; c < ROWS * CHUNKS; c += THREADS) {
    const int r = c / CHUNKS, d = (c % CHUNKS) * 8;
    const bool valid = first + r < rows_end && d < HEAD_DIM;
    copy_chunk(dst + r * ROW + d, valid ? base + (first + r) * row_stride + d : base, valid);
  }
}

extern "C" __global__ void __launch_bounds__(THREADS) dmattn_fwd_kernel(const FwdParams p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  elem_t* q_smem = reinterpret_cast<elem_t*>(smem_raw);
  elem_t* k_smem = q_smem + BLOCK_M * ROW;
  elem_t* v_smem = k_smem + STAGES * BLOCK_N * ROW;

  const int m_block = blockIdx.x;
  const int batch = blockIdx.y / p.num_heads, head = blockIdx.y % p.num_heads;
  const int kv_head = head / p.group;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;  // mma fragment coordinates: row group, column pair
  const int row0 = m_block * BLOCK_M + warp * 16 + g;  // this thread's rows: row0, row0 + 8
  const int offset = p.seqlen_k - p.seqlen_q;          // bottom-right causal alignment

  const elem_t* q = p.q + batch * p.q_stride[0] + head * p.q_stride[2];
  const elem_t* k = p.k + batch * p.k_stride[0] + kv_head * p.k_stride[2];
  const elem_t* v = p.v + batch * p.v_stride[0] + kv_head * p.v_stride[2];
  const uint8_t* mask = HAS_MASK ? p.mask + batch * p.mask_stride[0] + (head / p.mask_head_div) * p.mask_stride[1]
                                 : nullptr;
  const bias_t* bias = HAS_BIAS ? p.bias + batch * p.bias_stride[0] + (head / p.bias_head_div) * p.bias_stride[1]
                                : nullptr;

  // key tiles the causal rule lets this query block reach
  int n_end = p.seqlen_k;
  if (IS_CAUSAL) n_end = min(n_end, max(0, (m_block + 1) * BLOCK_M + offset));
  const int n_tiles = (n_end + BLOCK_N - 1) / BLOCK_N;

  load_tile<BLOCK_M>(q_smem, q, p.q_stride[1], m_block * BLOCK_M, p.seqlen_q);
  commit_group();  // Q is a group of its own: every later wait also covers it
  for (int s = 0; s < STAGES - 1; ++s) {  // prologue: the first STAGES - 1 key tiles
    if (s < n_tiles) {
      load_tile<BLOCK_N>(k_smem + s * BLOCK_N * ROW, k, p.k_stride[1], s * BLOCK_N, p.seqlen_k);
      load_tile<BLOCK_N>(v_smem + s * BLOCK_N * ROW, v, p.v_stride[1], s * BLOCK_N, p.seqlen_k);
    }
    commit_group();
  }

  float acc[BLOCK_D / 8][4] = {};
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.f, 0.f};
  uint32_t q_frag[BLOCK_D / 16][4];

  for (int j = 0; j < n_tiles; ++j) {
    const int ahead = j + STAGES - 1;  // keep STAGES - 1 tiles in flight
    if (ahead < n_tiles) {
      load_tile<BLOCK_N>(k_smem + (ahead % STAGES) * BLOCK_N * ROW, k, p.k_stride[1], ahead * BLOCK_N, p.seqlen_k);
      load_tile<BLOCK_N>(v_smem + (ahead % STAGES) * BLOCK_N * ROW, v, p.v_stride[1], ahead * BLOCK_N, p.seqlen_k);
    }
    commit_group();
    wait_group<STAGES - 1>();  // Q and tile j have landed (only later tiles may be in flight)
    __syncthreads();
    if (j == 0) {
      for (int kk = 0; kk < BLOCK_D / 16; ++kk)
        ldmatrix_x4(q_frag[kk], q_smem + (warp * 16 + lane % 16) * ROW + kk * 16 + (lane / 16) * 8);
    }
    const elem_t* k_tile = k_smem + (j % STAGES) * BLOCK_N * ROW;
    const elem_t* v_tile = v_smem + (j % STAGES) * BLOCK_N * ROW;

    // S = Q K^T: n8 tiles in pairs (one ldmatrix.x4 gives two n8 tiles' b0, b1)
    float s[BLOCK_N / 8][4] = {};
#pragma unroll
    for (int kk = 0; kk < BLOCK_D / 16; ++kk) {
#pragma unroll
      for (int nn = 0; nn < BLOCK_N / 16; ++nn) {
        uint32_t b[4];
        ldmatrix_x4(b, k_tile + (nn * 16 + (lane & 7) + ((lane >> 4) << 3)) * ROW + kk * 16 + ((lane >> 3) & 1) * 8);
        mma(s[2 * nn], q_frag[kk], b[0], b[1]);
        mma(s[2 * nn + 1], q_frag[kk], b[2], b[3]);
      }
    }

    // scores, exclusions and the online softmax; c = 0, 1: row0; c = 2, 3: row0 + 8
    float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int n = 0; n < BLOCK_N / 8; ++n) {
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int row = row0 + (c / 2) * 8, col = j * BLOCK_N + n * 8 + 2 * t + (c % 2);
        float x = s[n][c] * p.softmax_scale;
        if (HAS_SOFTCAP) x = p.softcap * tanhf(x / p.softcap);
        bool allowed = row < p.seqlen_q && col < p.seqlen_k;
        if (IS_CAUSAL) allowed = allowed && col <= row + offset;
        if (HAS_MASK && allowed) allowed = mask[row * p.mask_stride[2] + col * p.mask_stride[3]] != 0;
        if (HAS_BIAS && allowed) x += bias_value(bias[row * p.bias_stride[2] + col * p.bias_stride[3]]);
        s[n][c] = allowed ? x : -INFINITY;
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
      uint32_t a[4] = {as_u32(pack2(s[2 * kk][0], s[2 * kk][1])), as_u32(pack2(s[2 * kk][2], s[2 * kk][3])),
                       as_u32(pack2(s[2 * kk + 1][0], s[2 * kk + 1][1])),
                       as_u32(pack2(s[2 * kk + 1][2], s[2 * kk + 1][3]))};
#pragma unroll
      for (int dd = 0; dd < BLOCK_D / 16; ++dd) {
        uint32_t b[4];
        ldmatrix_x4_trans(b, v_tile + (kk * 16 + (lane & 15)) * ROW + dd * 16 + (lane >> 4) * 8);
        mma(acc[2 * dd], a, b[0], b[1]);
        mma(acc[2 * dd + 1], a, b[2], b[3]);
      }
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
    if (row >= p.seqlen_q) continue;
    const bool dead = row_sum[r] == 0.f;
    const float inverse = dead ? 0.f : 1.f / row_sum[r];
    elem_t* out = p.out + batch * p.out_stride[0] + row * p.out_stride[1] + head * p.out_stride[2];
#pragma unroll
    for (int d = 0; d < BLOCK_D / 8; ++d) {
      const int col = d * 8 + 2 * t;
      if (col < HEAD_DIM)  // HEAD_DIM is a multiple of 8: the pair is in or out together
        *reinterpret_cast<elem2_t*>(out + col) = pack2(acc[d][2 * r] * inverse, acc[d][2 * r + 1] * inverse);
    }
    if (t == 0)
      p.lse[batch * p.lse_stride[0] + head * p.lse_stride[1] + row * p.lse_stride[2]] =
          dead ? -INFINITY : row_max[r] + logf(row_sum[r]);
  }
}
