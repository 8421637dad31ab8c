// SM90 (Hopper) only: shared tiles in the layout wgmma reads, matrix descriptors and the
// warpgroup fences. Included by the kernels when WGMMA is set (build.py: sm90, head dim a
// multiple of 64, 16 rows per warp).
//
// Layout (PTX ISA "shared memory matrix layout", 128-byte swizzle): a ROWS x BLOCK_D tile is
// BLOCK_D / 64 column blocks of ROWS x 64 elements, one 128-byte line per row; in line r the
// 16-byte chunk c sits at chunk c ^ (r % 8). Eight lines form a 1024-byte swizzle atom, so
// blocks start on 1024-byte boundaries. The same bytes serve both operand roles: a tile whose
// rows run along the product's k (K^T in S = Q K^T: "K-major") and one whose rows are k
// (V in P V: "MN-major", wgmma's transpose flag).
#pragma once

#include "wgmma.cuh"

constexpr int SWIZZLE_COLS = 64;      // elements per 128-byte line
constexpr int SWIZZLE_ATOM = 1024;    // bytes: 8 lines
constexpr int GROUP_WARPS = 4;        // a warpgroup: the warps that issue one wgmma
constexpr int GROUP_ROWS = 64;        // rows of its m64 products, 16 per warp
static_assert(BLOCK_D % SWIZZLE_COLS == 0, "wgmma: the head dim must pad to a multiple of 64");
static_assert(NUM_WARPS % GROUP_WARPS == 0, "wgmma: whole warpgroups");

// The widths wgmma.cuh spells out (products over key or query tiles and over BLOCK_D).
constexpr bool is_wgmma_width(int n) { return n == 32 || n == 64 || n == 128 || n == 192 || n == 256; }
static_assert(is_wgmma_width(BLOCK_D), "wgmma: no m64nN product for this BLOCK_D");

// Element offset of (row, col) in a tile of `rows` rows.
__device__ __forceinline__ int swizzled(int row, int col, int rows) {
  return (col / SWIZZLE_COLS) * rows * SWIZZLE_COLS + row * SWIZZLE_COLS +
         (((col % SWIZZLE_COLS) / 8) ^ (row % 8)) * 8 + col % 8;
}

// Matrix descriptor: start address, leading and stride byte offsets, 128-byte swizzle (mode 1).
__device__ __forceinline__ uint64_t descriptor(const elem_t* start, uint32_t leading_bytes, uint32_t stride_bytes) {
  const uint64_t address = shared_address(start);
  return ((address & 0x3FFFF) >> 4) | (uint64_t((leading_bytes & 0x3FFFF) >> 4) << 16) |
         (uint64_t((stride_bytes & 0x3FFFF) >> 4) << 32) | (1ull << 62);
}

// The operand of k-step kk for rows [row0, row0 + 8 n) of a tile whose rows run along k
// (K-major: Q and K in S = Q K^T). Within a 128-byte line the k-steps sit 32 bytes apart; the
// hardware applies the swizzle to the address it forms, so the start moves unswizzled.
__device__ __forceinline__ uint64_t k_major(const elem_t* tile, int rows, int row0, int kk) {
  const elem_t* start = tile + (kk * 16 / SWIZZLE_COLS) * rows * SWIZZLE_COLS + row0 * SWIZZLE_COLS + (kk * 16) % SWIZZLE_COLS;
  return descriptor(start, 16, SWIZZLE_ATOM);  // leading offset unused: one k-step stays in a line
}

// The operand of k-step kk (rows [16 kk, 16 kk + 16)) of a tile whose rows are k and whose
// columns are the product's n (MN-major: V in P V); consecutive column blocks of 64 lie
// `rows` lines apart.
__device__ __forceinline__ uint64_t mn_major(const elem_t* tile, int rows, int kk) {
  return descriptor(tile + kk * 16 * SWIZZLE_COLS, rows * 128, SWIZZLE_ATOM);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" :: "n"(N) : "memory"); }

// c = A B^T over BLOCK_D, issued (the caller fences, commits and waits): A the 64 rows
// [a_row0, a_row0 + 64) of a shared tile of a_rows rows, B a shared tile of 8 N8 rows, both
// with rows along k (S = Q K^T, dP = dO V^T and their transposes). The first k-step overwrites c.
template <int N8>
__device__ __forceinline__ void wgmma_abt(float (&c)[N8][4], const elem_t* a, int a_rows, int a_row0, const elem_t* b) {
#pragma unroll
  for (int kk = 0; kk < BLOCK_D / 16; ++kk)
    Wgmma<N8 * 8>::template ss<0>(c, k_major(a, a_rows, a_row0, kk), k_major(b, N8 * 8, 0, kk), kk > 0);
}

// c (64 x BLOCK_D) += A B, issued: A the K16 k-steps of this warp's rows in registers (P, P^T,
// dS^T, dS), B a shared tile of 16 K16 rows, one row per k (V, dO, Q, K).
template <int K16>
__device__ __forceinline__ void wgmma_ab(float (&c)[BLOCK_D / 8][4], const uint32_t (&a)[K16][4], const elem_t* b) {
#pragma unroll
  for (int kk = 0; kk < K16; ++kk) Wgmma<BLOCK_D>::template rs<1>(c, a[kk], mn_major(b, 16 * K16, kk), 1);
}

// c (64 x 8 N8) = A B, issued: A the 64 rows of a shared tile with rows along k (K16 k-steps),
// B 16 K16 rows of a shared tile, one row per k, from the column block at `b` (dQ = dS K).
template <int N8, int K16>
__device__ __forceinline__ void wgmma_ab_ss(float (&c)[N8][4], const elem_t* a, const elem_t* b) {
#pragma unroll
  for (int kk = 0; kk < K16; ++kk)
    Wgmma<N8 * 8>::template ss<1>(c, k_major(a, GROUP_ROWS, 0, kk), mn_major(b, 16 * K16, kk), kk > 0);
}

// Four 8 x 8 blocks of 16-bit values to shared memory, each transposed (a fragment's rows become
// columns): lanes 8 i .. 8 i + 7 give the row addresses of block i.
__device__ __forceinline__ void stmatrix_x4_trans(const uint32_t (&r)[4], elem_t* p) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n"
               :: "r"(shared_address(p)), "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3]) : "memory");
}

// Pins accumulators in program order around wgmma: the compiler sees them read and written here.
template <int N8>
__device__ __forceinline__ void touch(float (&d)[N8][4]) {
#pragma unroll
  for (int n = 0; n < N8; ++n)
#pragma unroll
    for (int c = 0; c < 4; ++c) asm volatile("" : "+f"(d[n][c])::"memory");
}

// -- warp specialization (flash_fwd_ws.cu, flash_bwd_ws.cu): mbarriers, TMA copies, register reallocation --

// An mbarrier completes a phase when `count` arrivals and the transaction bytes announced with
// them have come; waiters name the phase by its parity.
__device__ __forceinline__ void barrier_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" :: "r"(shared_address(bar)), "r"(count) : "memory");
}

// Makes initialized barriers visible to the async proxy (the TMA unit's complete_tx).
__device__ __forceinline__ void fence_barrier_init() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }

__device__ __forceinline__ void barrier_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" :: "r"(shared_address(bar)) : "memory");
}

// One arrival that also announces `bytes` the copies signalling this barrier will bring.
__device__ __forceinline__ void barrier_arrive_expecting(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n"
               :: "r"(shared_address(bar)), "r"(bytes) : "memory");
}

__device__ __forceinline__ void barrier_wait(uint64_t* bar, int parity) {
  asm volatile(
      "{\n.reg .pred done;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n}\n"
      :: "r"(shared_address(bar)), "r"(parity) : "memory");
}

#if FWD_OVERLAP  // flash_fwd_ws.cu's consumers taking turns (FwdConfig.overlap)
// Named barrier `id` (1..15; 0 is __syncthreads') of `count` threads: sync waits for the
// phase to complete, arrive counts toward it without waiting.
__device__ __forceinline__ void named_barrier_sync(int id, int count) {
  asm volatile("bar.sync %0, %1;\n" :: "r"(id), "r"(count) : "memory");
}
__device__ __forceinline__ void named_barrier_arrive(int id, int count) {
  asm volatile("bar.arrive %0, %1;\n" :: "r"(id), "r"(count) : "memory");
}
#endif

// A box of a 4-D tensor map at coordinates (c0 fastest) into shared memory, completing its bytes
// on `bar`. Elements outside the tensor arrive as zeros.
__device__ __forceinline__ void tma_load(void* dst, const void* map, int c0, int c1, int c2, int c3, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], [%6];\n"
      :: "r"(shared_address(dst)), "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3),
         "r"(shared_address(bar))
      : "memory");
}

// A box of shared memory to a 4-D tensor map at coordinates (c0 fastest), in the issuing thread's
// bulk group; elements outside the tensor are not written. The writers of the box fence their
// writes to the async proxy (`fence_async_shared`) before the barrier that lets this thread issue.
__device__ __forceinline__ void tma_store(const void* map, const void* src, int c0, int c1, int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n"
      :: "l"(reinterpret_cast<uint64_t>(map)), "r"(shared_address(src)), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}

__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }

// All but the newest N of this thread's bulk groups have read their shared memory (READ_ONLY),
// or are complete.
template <int N, bool READ_ONLY>
__device__ __forceinline__ void bulk_wait() {
  if (READ_ONLY)
    asm volatile("cp.async.bulk.wait_group.read %0;\n" :: "n"(N) : "memory");
  else
    asm volatile("cp.async.bulk.wait_group %0;\n" :: "n"(N) : "memory");
}

// The BLOCK_D / 64 boxes of one ROWS-row tile starting at row `row` of `map`'s (head, batch)
// slice: a (B, L, H, D) tensor mapped as (D, L, H, B), a box per 64 columns.
template <int ROWS>
__device__ __forceinline__ void load_tile_tma(elem_t* tile, const void* map, int row, int head, int batch,
                                              uint64_t* full) {
#pragma unroll
  for (int block = 0; block < BLOCK_D / SWIZZLE_COLS; ++block)
    tma_load(tile + block * ROWS * SWIZZLE_COLS, map, block * SWIZZLE_COLS, row, head, batch, full);
}

#if PACKED  // packed sequences (flash_fwd_ws.cu, flash_bwd_ws.cu): their parameters' cu_seqlens_q/k, seqused_k, max_seqlen_q/k
// The lengths of sequence `sequence`: (query rows, keys), cut to [0, max_seqlen] as the Triton
// kernels cut them (so its tiles stay inside the grid, and below the next sequence's dQ tiles).
template <typename Params>
__device__ __forceinline__ int2 sequence_lengths(const Params& p, int sequence) {
  const int keys = p.seqused_k ? p.seqused_k[sequence] : p.cu_seqlens_k[sequence + 1] - p.cu_seqlens_k[sequence];
  const int rows = p.cu_seqlens_q[sequence + 1] - p.cu_seqlens_q[sequence];
  return make_int2(min(max(rows, 0), p.max_seqlen_q), min(max(keys, 0), p.max_seqlen_k));
}

// Rows [first, ROWS) of a tile as TMA stages it (a box of ROWS 128-byte lines per 64 columns,
// swizzled within each line) set to zero, 16 bytes a thread at a time: rows of the next sequence
// that a box read, whose K, V, Q or dO would reach a product as 0 x NaN.
template <int ROWS>
__device__ __forceinline__ void clear_rows(elem_t* tile, int first, int thread, int threads) {
  constexpr int LINE_CHUNKS = SWIZZLE_COLS * int(sizeof(elem_t)) / 16;
  first = max(first, 0);
  const int block_chunks = (ROWS - first) * LINE_CHUNKS;
  for (int i = thread; i < block_chunks * (BLOCK_D / SWIZZLE_COLS); i += threads) {
    const int block = i / block_chunks, row = first + i % block_chunks / LINE_CHUNKS, chunk = i % LINE_CHUNKS;
    *reinterpret_cast<uint4*>(tile + (block * ROWS + row) * SWIZZLE_COLS + chunk * 8) = make_uint4(0, 0, 0, 0);
  }
}
#endif

// A warpgroup gives back or takes registers (per thread; a multiple of 8 in [24, 256]).
template <int N>
__device__ __forceinline__ void registers_release() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" :: "n"(N)); }
template <int N>
__device__ __forceinline__ void registers_claim() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" :: "n"(N)); }
