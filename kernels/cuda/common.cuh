// Shared by flash_fwd.cu and flash_bwd.cu: element types, tile traits, the PTX wrappers
// (cp.async, ldmatrix, mma.sync m16n8k16) and the score rule of DESIGN §1.
//
// Compile-time parameters (one -D each; `dmattn_kernels.cuda.build.defines` is the only place
// that sets them): ELEMENT (0 fp16, 1 bf16), BIAS_FP32, HEAD_DIM, NUM_WARPS, STAGES, IS_CAUSAL,
// HAS_MASK, HAS_BIAS, HAS_SOFTCAP, each kernel's own tile sizes, WGMMA (SM90 products
// through wgmma.mma_async, shared tiles in its swizzled layout: sm90.cuh; default 0) and
// HAS_WINDOW (a sliding window: Inputs' window_left and window_right; undefined is 0, and only
// the warp-specialized kernels take it: the overlapped forward and the backward), and
// SWIZZLE_PADDED (undefined is 0: below).
//
// Fragment coordinates (PTX ISA, mma.m16n8k16): lane = 4 g + t. A (16x16) holds rows g and
// g + 8, columns 2t, 2t + 1 and 8 + 2t, 9 + 2t; a C/D accumulator c[4] of a 16x8 tile holds
// (g, 2t), (g, 2t + 1), (g + 8, 2t), (g + 8, 2t + 1). Two n8 accumulators side by side are,
// packed to 16 bits, one A fragment: that is how P and dS feed the next product without a trip
// through shared memory.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#if ELEMENT == 1
typedef __nv_bfloat16 elem_t;
typedef __nv_bfloat162 elem2_t;
#define MMA_TYPE "bf16"
__device__ __forceinline__ elem2_t pack2(float a, float b) { return __floats2bfloat162_rn(a, b); }
// A bf16 is an fp32's upper half: one shift or AND each (the intrinsics move the upper one down first)
__device__ __forceinline__ float2 unpack2(uint32_t pair) {
  return make_float2(__uint_as_float(pair << 16), __uint_as_float(pair & 0xffff0000u));
}
#else
typedef __half elem_t;
typedef __half2 elem2_t;
#define MMA_TYPE "f16"
__device__ __forceinline__ elem2_t pack2(float a, float b) { return __floats2half2_rn(a, b); }
__device__ __forceinline__ float2 unpack2(uint32_t pair) {
  return __half22float2(*reinterpret_cast<const __half2*>(&pair));
}
#endif

#ifndef WGMMA
#define WGMMA 0
#endif

#if BIAS_FP32
typedef float bias_t;
#else
typedef elem_t bias_t;
#endif

constexpr int WARP_ROWS = 16;                        // rows of the mma tile a warp owns
#if SWIZZLE_PADDED
// the warp-specialized kernels at a head dim that is not a multiple of 64 (variants.variant,
// variants.backward_variant): tiles of whole 128-byte swizzle lines, the columns past HEAD_DIM
// zeros from TMA
constexpr int BLOCK_D = (HEAD_DIM + 63) / 64 * 64;
#else
constexpr int BLOCK_D = (HEAD_DIM + 15) / 16 * 16;  // the mma k-step is 16
#endif
// Shared row length in elements: ldmatrix tiles pad each row by 16 B, so the 8 rows one ldmatrix
// reads start in different banks; wgmma tiles are swizzled instead (sm90.cuh), unpadded.
constexpr int ROW = WGMMA ? BLOCK_D : BLOCK_D + 8;
constexpr int CHUNKS = BLOCK_D / 8;                  // 16-byte chunks per row
constexpr int THREADS = NUM_WARPS * 32;
constexpr int CTA_ROWS = WARP_ROWS * NUM_WARPS;     // rows a backward CTA owns: dQ query rows, dK/dV keys
constexpr float LOG2E = 1.4426950408889634f;
constexpr float FP32_EPS = 1.1920928955078125e-07f;  // 2^-23: x * (1 + FP32_EPS) is at least an ulp above x > 0

// x moved up (towards +inf) by one to two ulps; +-inf and 0 unchanged, never NaN.
__device__ __forceinline__ float above_by_an_ulp(float x) { return fmaxf(x * (1.f + FP32_EPS), x * (1.f - FP32_EPS)); }

// 2^x on the SFU alone, results below 2^-126 flushed to 0: exp2f adds a range test and two
// multiplies to keep those as subnormals, three instructions per probability. A probability is
// at most 2^(an ulp) of its row's running max, so a flushed one is under 2^-126 of the row's sum.
__device__ __forceinline__ float exp2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// A compile-time flag as a value: `f(Flag<true>())` instantiates a generic lambda's body
// for one case (C++17 has no lambda template parameters).
template <bool B>
struct Flag {
  static constexpr bool value = B;
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

// cp.async and plain stores write through the generic proxy, wgmma reads through the async
// proxy: each writer fences its own writes before the barrier that publishes them.
__device__ __forceinline__ void fence_async_shared() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// All but the newest N cp.async groups have landed (and, for wgmma, are visible to it once the
// caller's barrier publishes them).
template <int N>
__device__ __forceinline__ void wait_group() {
  asm volatile("cp.async.wait_group %0;\n" :: "n"(N));
#if WGMMA
  fence_async_shared();
#endif
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const elem_t* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(shared_address(p)));
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const elem_t* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(shared_address(p)));
}

// The A fragment of rows [0, 16) x columns [16 kk, 16 kk + 16) of a row-major shared tile.
__device__ __forceinline__ void load_a(uint32_t (&a)[4], const elem_t* tile, int kk, int lane) {
  ldmatrix_x4(a, tile + (lane % 16) * ROW + kk * 16 + (lane / 16) * 8);
}

// B fragments of two n8 tiles (b[0..1]: rows 16 nn + [0, 8), b[2..3]: + [8, 16)) of a product
// X Y^T, Y stored row-major (one row per output column), k-step kk.
__device__ __forceinline__ void load_b(uint32_t (&b)[4], const elem_t* tile, int nn, int kk, int lane) {
  ldmatrix_x4(b, tile + (nn * 16 + (lane & 7) + ((lane >> 4) << 3)) * ROW + kk * 16 + ((lane >> 3) & 1) * 8);
}

// B fragments of two n8 tiles (columns 16 dd + [0, 8) and + [8, 16)) of a product X Y, Y stored
// row-major (one row per k), k-step kk: ldmatrix.trans.
__device__ __forceinline__ void load_b_trans(uint32_t (&b)[4], const elem_t* tile, int kk, int dd, int lane) {
  ldmatrix_x4_trans(b, tile + (kk * 16 + (lane & 15)) * ROW + dd * 16 + (lane >> 4) * 8);
}

// c[4] += a[4] (16x16, row) * b[2] (16x8, col), fp32 accumulate.
__device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." MMA_TYPE "." MMA_TYPE ".f32 "
               "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t as_u32(elem2_t x) { return *reinterpret_cast<uint32_t*>(&x); }

// The A fragment of k-step kk of a product whose left operand is an fp32 accumulator of n8
// tiles (P or dS), rounded to the input dtype.
template <int N8>
__device__ __forceinline__ void accumulator_to_a(uint32_t (&a)[4], const float (&x)[N8][4], int kk) {
  a[0] = as_u32(pack2(x[2 * kk][0], x[2 * kk][1]));
  a[1] = as_u32(pack2(x[2 * kk][2], x[2 * kk][3]));
  a[2] = as_u32(pack2(x[2 * kk + 1][0], x[2 * kk + 1][1]));
  a[3] = as_u32(pack2(x[2 * kk + 1][2], x[2 * kk + 1][3]));
}

// c[mt][n8] and c[mt][n8 + 1] += a[mt] x the two n8 B fragments b[0..1], b[2..3], for each of the
// MT m16 tiles: one loaded B fragment pair feeds 2 MT products.
template <int MT, int N8>
__device__ __forceinline__ void mma_tiles(float (&c)[MT][N8][4], int n8, const uint32_t (&a)[MT][4],
                                          const uint32_t (&b)[4]) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    mma(c[mt][n8], a[mt], b[0], b[1]);
    mma(c[mt][n8 + 1], a[mt], b[2], b[3]);
  }
}

// c (MT m16 tiles x 8 N8) += a (MT m16 tiles of this warp's rows, k-step kk) x Y^T, Y the first
// 8 N8 rows of a row-major shared tile (one row per output column): S = Q K^T, dP = dO V^T and
// their transposes. Shared-memory traffic per mma falls as a warp owns more m16 tiles.
template <int MT, int N8>
__device__ __forceinline__ void mma_abt(float (&c)[MT][N8][4], const uint32_t (&a)[MT][4], const elem_t* tile, int kk,
                                        int lane) {
#pragma unroll
  for (int nn = 0; nn < N8 / 2; ++nn) {
    uint32_t b[4];
    load_b(b, tile, nn, kk, lane);
    mma_tiles(c, 2 * nn, a, b);
  }
}

template <int N8>
__device__ __forceinline__ void mma_abt(float (&c)[N8][4], const uint32_t (&a)[4], const elem_t* tile, int kk, int lane) {
  mma_abt<1, N8>(reinterpret_cast<float (&)[1][N8][4]>(c), reinterpret_cast<const uint32_t (&)[1][4]>(a), tile, kk,
                 lane);
}

// acc (MT m16 tiles x BLOCK_D) += a (k-step kk of P or dS, MT m16 tiles) x rows [16 kk, 16 kk + 16)
// of a row-major shared tile (one row per k): out += P V, dV += P^T dO, dK += dS^T Q, dQ += dS K.
template <int MT>
__device__ __forceinline__ void mma_ab(float (&acc)[MT][BLOCK_D / 8][4], const uint32_t (&a)[MT][4], const elem_t* tile,
                                       int kk, int lane) {
#pragma unroll
  for (int dd = 0; dd < BLOCK_D / 16; ++dd) {
    uint32_t b[4];
    load_b_trans(b, tile, kk, dd, lane);
    mma_tiles(acc, 2 * dd, a, b);
  }
}

__device__ __forceinline__ void mma_ab(float (&acc)[BLOCK_D / 8][4], const uint32_t (&a)[4], const elem_t* tile, int kk,
                                       int lane) {
  mma_ab<1>(reinterpret_cast<float (&)[1][BLOCK_D / 8][4]>(acc), reinterpret_cast<const uint32_t (&)[1][4]>(a), tile,
            kk, lane);
}

#if WGMMA
#include "sm90.cuh"
#endif

// The start of a kernel's dynamic shared memory as tiles: wgmma's swizzle atoms start on
// 1024-byte boundaries (shared_memory.py reserves the slack).
__device__ __forceinline__ elem_t* shared_tiles(unsigned char* raw) {
#if WGMMA
  return reinterpret_cast<elem_t*>(raw + (-shared_address(raw) & (SWIZZLE_ATOM - 1)));
#else
  return reinterpret_cast<elem_t*>(raw);
#endif
}

// Where element (row, col) of a ROWS-row shared tile lives.
template <int ROWS>
__device__ __forceinline__ int tile_offset(int row, int col) {
#if WGMMA
  return swizzled(row, col, ROWS);
#else
  return row * ROW + col;
#endif
}

// ROWS x BLOCK_D tile of a (batch, head) slice starting at row `first`; rows past `rows_end`
// and lanes past HEAD_DIM zero-filled (never read). Thread i copies the 16-byte chunk i % CHUNKS
// of rows i / CHUNKS + k THREADS / CHUNKS: its source address steps by a constant, so a copy
// costs one 64-bit add, not a row-times-stride product (the index math once outnumbered the
// copies in the H200 forward's instruction counts).
template <int ROWS>
__device__ __forceinline__ void load_tile(elem_t* dst, const elem_t* base, int64_t row_stride, int first,
                                          int rows_end) {
  if constexpr (THREADS % CHUNKS == 0) {
    constexpr int ROW_STEP = THREADS / CHUNKS, PASSES = (ROWS + ROW_STEP - 1) / ROW_STEP;
    const int r0 = threadIdx.x / CHUNKS, d = (threadIdx.x % CHUNKS) * 8;
    const elem_t* src = base + (first + r0) * row_stride + d;
#pragma unroll
    for (int pass = 0; pass < PASSES; ++pass, src += ROW_STEP * row_stride) {
      const int r = r0 + pass * ROW_STEP;
      if (ROWS % ROW_STEP == 0 || r < ROWS) {
        const bool valid = first + r < rows_end && d < HEAD_DIM;
        copy_chunk(dst + tile_offset<ROWS>(r, d), valid ? src : base, valid);
      }
    }
  } else {  // head dims whose chunk count does not divide the thread count (BLOCK_D 48, 80, ...)
    for (int c = threadIdx.x; c < ROWS * CHUNKS; c += THREADS) {
      const int r = c / CHUNKS, d = (c % CHUNKS) * 8;
      const bool valid = first + r < rows_end && d < HEAD_DIM;
      copy_chunk(dst + tile_offset<ROWS>(r, d), valid ? base + (first + r) * row_stride + d : base, valid);
    }
  }
}

// What both directions read: q (B, Lq, H, D), k and v (B, Lk, Hkv, D) with a contiguous head
// dim, and mask and bias as 4-D broadcast views. `dmattn_kernels.cuda.params.Inputs` mirrors it.
struct Inputs {
  const elem_t* q;
  const elem_t* k;
  const elem_t* v;
  const uint8_t* mask;
  const bias_t* bias;
  int64_t q_stride[3];     // batch, row, head (the head dim is contiguous)
  int64_t k_stride[3];
  int64_t v_stride[3];
  int64_t mask_stride[4];  // batch, head, query, key (0 on broadcast dims)
  int64_t bias_stride[4];
  int num_heads;
  int seqlen_q;
  int seqlen_k;
  int group;               // query heads per kv head
  int mask_head_div;       // query head h reads mask slice h / mask_head_div
  int bias_head_div;
  float softmax_scale;
  float softcap;           // 1 when HAS_SOFTCAP is off (never divided by then)
#if HAS_WINDOW
  // FlashAttention's window, bottom-right aligned: row i sees keys [i + offset - window_left,
  // i + offset + window_right] (offset = seqlen_k - seqlen_q); an unbounded side is Lq + Lk
  int window_left, window_right;
#endif
};

// The (batch, query head) a CTA works on and the q, k, v slices it reads.
struct HeadSlices {
  int batch, head, kv_head;
  const elem_t* q;
  const elem_t* k;
  const elem_t* v;
};

// A warp-specialized kernel's CTA in launch order (blockIdx.x + gridDim.x blockIdx.y): the head
// slices (gridDim.x of them) in sections of `section_slices`, whose operands re-read from L2 fit
// it together (forward.section_slices); in a section, blocks (gridDim.y of them) in order, head
// slices varying fastest, so the CTAs resident at once share blocks' worth of work and the
// section's operands. The last section may be short.
struct SectionOrder {
  int slice, block;
};

#if FWD_OVERLAP  // flash_fwd_ws.cu's overlapped forward walks work items, a CTA's own or a schedule's
// Work item `cta` in that order, of `columns` head slices x `rows` blocks.
__device__ __forceinline__ SectionOrder section_order(int cta, int columns, int rows, int section_slices) {
  const int section_ctas = section_slices * rows;
  const int section = cta / section_ctas, in_section = cta % section_ctas;
  const int slices = min(section_slices, columns - section * section_slices);
  return {section * section_slices + in_section % slices, in_section / slices};
}

// The CTA's own place: the grid is (slices, blocks).
__device__ __forceinline__ SectionOrder section_order(int section_slices) {
  return section_order(blockIdx.y * gridDim.x + blockIdx.x, gridDim.x, gridDim.y, section_slices);
}
#else
__device__ __forceinline__ SectionOrder section_order(int section_slices) {
  const int cta = blockIdx.y * gridDim.x + blockIdx.x, section_ctas = section_slices * gridDim.y;
  const int section = cta / section_ctas, in_section = cta % section_ctas;
  const int slices = min(section_slices, int(gridDim.x) - section * section_slices);
  return {section * section_slices + in_section % slices, in_section / slices};
}
#endif

// `slice` = batch * num_heads + query head: the grid index the kernel keeps for it.
__device__ __forceinline__ HeadSlices head_slices(const Inputs& in, int slice) {
  HeadSlices at;
  at.batch = slice / in.num_heads;
  at.head = slice % in.num_heads;
  at.kv_head = at.head / in.group;
  at.q = in.q + at.batch * in.q_stride[0] + at.head * in.q_stride[2];
  at.k = in.k + at.batch * in.k_stride[0] + at.kv_head * in.k_stride[2];
  at.v = in.v + at.batch * in.v_stride[0] + at.kv_head * in.v_stride[2];
  return at;
}

// Where scores may be read: the (batch, head) slices of mask and bias, their row and column
// strides (0 on broadcast dims), the sequence bounds and the bottom-right causal offset.
struct ScoreRule {
  const uint8_t* mask;
  const bias_t* bias;
  int64_t mask_row, mask_col, bias_row, bias_col;
  int seqlen_q, seqlen_k, offset;
  float scale, softcap;
#if HAS_WINDOW
  int window_left, window_right;
#endif

  // DESIGN §1: whether key `col` is visible from query `row`. Excluded positions never read
  // the bias, so NaN or inf stored there cannot reach a result.
  __device__ __forceinline__ bool visible(int row, int col) const {
    bool allowed = reached(row, col);
    if (HAS_MASK && allowed) allowed = mask[row * mask_row + col * mask_col] != 0;
    return allowed;
  }

  // Inside both sequences and, when causal, at or left of the row's diagonal: visible but for
  // the mask.
  __device__ __forceinline__ bool reached(int row, int col) const {
    const bool inside = row < seqlen_q && col < seqlen_k;
#if HAS_WINDOW
    const bool in_window = col >= row + offset - window_left && col <= row + offset + window_right;
    return IS_CAUSAL ? inside && in_window && col <= row + offset : inside && in_window;
#else
    return IS_CAUSAL ? inside && col <= row + offset : inside;
#endif
  }

  // scale * dot, soft-capped (HAS_SOFTCAP), before the bias.
  __device__ __forceinline__ float capped(float dot) const {
    const float x = dot * scale;
    return HAS_SOFTCAP ? softcap * tanhf(x / softcap) : x;
  }

  // The score of a visible position: capped + bias.
  __device__ __forceinline__ float score(float capped_dot, int row, int col) const {
    return HAS_BIAS ? capped_dot + static_cast<float>(bias[row * bias_row + col * bias_col]) : capped_dot;
  }
};

__device__ __forceinline__ ScoreRule score_rule(const Inputs& in, const HeadSlices& at) {
  const int batch = at.batch, head = at.head;
  ScoreRule rule;
  rule.mask = HAS_MASK ? in.mask + batch * in.mask_stride[0] + (head / in.mask_head_div) * in.mask_stride[1] : nullptr;
  rule.bias = HAS_BIAS ? in.bias + batch * in.bias_stride[0] + (head / in.bias_head_div) * in.bias_stride[1] : nullptr;
  rule.mask_row = in.mask_stride[2];
  rule.mask_col = in.mask_stride[3];
  rule.bias_row = in.bias_stride[2];
  rule.bias_col = in.bias_stride[3];
  rule.seqlen_q = in.seqlen_q;
  rule.seqlen_k = in.seqlen_k;
  rule.offset = in.seqlen_k - in.seqlen_q;
  rule.scale = in.softmax_scale;
  rule.softcap = in.softcap;
#if HAS_WINDOW
  rule.window_left = in.window_left;
  rule.window_right = in.window_right;
#endif
  return rule;
}

// The mask and bias of one key tile that TMA staged in shared memory (flash_fwd_ws.cu, flash_bwd_ws.cu): a tile
// of ROWS rows (the block's query rows, or 1 for an operand without a query dim) whose rows are
// split into lines of at most 128 bytes, each line width a column block of ROWS lines in the
// swizzle of that width (a single row is not swizzled). Rows and columns outside the operand
// arrive as 0, so a staged mask keeps nothing there.
struct StagedScores {
  const unsigned char* mask;
  const unsigned char* bias;
  int row0;  // the tile's first query row (its first key is the one of S's tile)

  // Byte `byte` of tile row `row0 + r8` (row0 a multiple of 8, r8 < 8) in a tile of ROWS lines
  // of LINE bytes (64 or 128): the 16-byte chunk index XORed with address bits [7, 7 +
  // log2(LINE / 16)), as TMA's swizzle writes it, which for such a row depend on r8 alone.
  template <int ROWS, int LINE>
  static __device__ __forceinline__ int offset(int row0, int r8, int byte) {
    static_assert(ROWS <= 1 || LINE == 64 || LINE == 128, "TMA swizzles 64- and 128-byte lines here");
    if (ROWS == 1) return byte;
    const int chunk_xor = (LINE == 128 ? r8 : r8 / 2) << 4;
    return byte / LINE * ROWS * LINE + (row0 + r8) * LINE + ((byte % LINE) ^ chunk_xor);
  }
};

// The key tiles of KEYS keys that a query block walks (the forward and dQ kernels): the block
// reaches tiles [0, block); every row of one warp's rows [warp_row0, warp_row0 + warp_rows)
// reaches every key of tiles [0, inside) (in bounds and, when causal, at or left of the
// diagonal), so only the mask decides there; it sees every key of tiles [0, interior) (`inside`
// without a mask), so only tiles from `interior` on test positions. No row that issues the
// warp's products sees a key of tiles [reached, block) (causal), so the warp skips them: under
// wgmma those rows are its warpgroup's 64 (all four warps issue each product; blocks hold whole
// warpgroups, so the group starts on a multiple of 64), else its own.
// With a window the tiles start at `first` (the first that any row from warp_row0 on sees), and
// the warp's rows reach every key of tiles [inside_first, inside) only: the window's leading
// edge lies before, its trailing edge (with the diagonal) after.
struct KeyTiles {
  int block, inside, interior, reached;
#if HAS_WINDOW
  int first, inside_first;
#endif
};

template <int KEYS>
__device__ __forceinline__ KeyTiles key_tiles(const ScoreRule& rule, int block_row_end, int warp_row0,
                                              int warp_rows) {
  int block_keys = rule.seqlen_k;
  if (IS_CAUSAL) block_keys = min(block_keys, max(0, block_row_end + rule.offset));
  int interior_keys = warp_row0 + warp_rows <= rule.seqlen_q ? rule.seqlen_k : 0;
  if (IS_CAUSAL) interior_keys = min(interior_keys, max(0, warp_row0 + rule.offset + 1));
#if HAS_WINDOW
  block_keys = min(block_keys, max(0, block_row_end + rule.offset + rule.window_right));
  interior_keys = min(interior_keys, max(0, warp_row0 + rule.offset + rule.window_right + 1));
#endif
  KeyTiles tiles;
#if HAS_WINDOW
  tiles.first = max(0, warp_row0 + rule.offset - rule.window_left) / KEYS;
  tiles.inside_first = (max(0, warp_row0 + warp_rows - 1 + rule.offset - rule.window_left) + KEYS - 1) / KEYS;
#endif
  tiles.block = (block_keys + KEYS - 1) / KEYS;
  tiles.inside = interior_keys / KEYS;
  tiles.interior = HAS_MASK ? 0 : tiles.inside;
#if WGMMA
  const int issue_row_end = warp_row0 / GROUP_ROWS * GROUP_ROWS + GROUP_ROWS;
#else
  const int issue_row_end = warp_row0 + warp_rows;
#endif
  tiles.reached = IS_CAUSAL ? (max(0, issue_row_end + rule.offset) + KEYS - 1) / KEYS : tiles.block;
  return tiles;
}

// Two adjacent columns of an output row (the column is even: 4- or 8-byte aligned).
__device__ __forceinline__ void store_pair(float* dst, float a, float b) {
  *reinterpret_cast<float2*>(dst) = make_float2(a, b);
}
__device__ __forceinline__ void store_pair(elem_t* dst, float a, float b) {
  *reinterpret_cast<elem2_t*>(dst) = pack2(a, b);
}

// Key tile `tile` of K and V into slot `slot` of their rings (the forward and dQ kernels).
template <int KEYS>
__device__ __forceinline__ void load_kv_tile(elem_t* k_ring, elem_t* v_ring, const HeadSlices& at, const Inputs& in,
                                             int tile, int slot) {
  load_tile<KEYS>(k_ring + slot * KEYS * ROW, at.k, in.k_stride[1], tile * KEYS, in.seqlen_k);
  load_tile<KEYS>(v_ring + slot * KEYS * ROW, at.v, in.v_stride[1], tile * KEYS, in.seqlen_k);
}
