// Prototype, not a shipped kernel: a warp-specialized SM90 backward in FlashAttention-3's split,
// dense (no mask, no bias, no softcap), one query head per K/V head, head dim 128. It measures
// whether this split beats the shipped two-kernel backward before mask, bias, dBias and GQA are
// built into it. `bwd_ws_probe.py` builds, checks and times it.
//
// A CTA owns BLOCK_N = 128 keys of one (batch, head) and walks the query tiles of 64 rows that
// see them (dK, dV in registers):
//   producer warpgroup: warp 0 issues TMA for K and V once, then each query tile's Q and dO into
//     a ring of STAGES slots; warp 1 stages the tile's lse (log2 units; +inf for dead rows and rows
//     past Lq, so their P is 0) and delta; warp 2 adds each tile's dQ share from shared memory to
//     an fp32 buffer with one bulk reduce-add, in key-block order when ORDERED (deterministic).
//   two consumer warpgroups, 64 keys each. Per query tile:
//     S^T = K Q^T, dP^T = V dO^T (wgmma, shared operands);
//     P^T = exp(S^T - lse), dS^T = P^T (dP^T - delta) in registers;
//     dV += P^T dO, dK += dS^T Q (wgmma, P^T and dS^T from registers);
//     dS^T to shared memory as dS (stmatrix .trans), both warpgroups' keys side by side;
//     dQ share = dS K, each warpgroup 64 of the 128 columns, into an fp32 tile for warp 2.
//
// Compile-time parameters: common.cuh's (HEAD_DIM 128, NUM_WARPS 12, STAGES, IS_CAUSAL, WGMMA 1),
// ORDERED, and the probe's switches DQ_PERMUTED (the dQ share in fragment order), DQ_BUFFERS
// (1 or 2 share tiles), FAST_EXP (ex2.approx.ftz), LONGEST_FIRST (unordered only: key blocks
// launched in causal's longest-first order), ASCENDING (the order of the sum, see n_block), and for floors (wrong dQ): SKIP_DQ (no dQ sum),
// SPLIT_WAITS (P computed while dP^T runs, dV's product while dS is), FIRST_STORES (ascending:
// block 0 stores its share instead of adding it, so the fp32 buffer is not zeroed), SKIP_SYNC (no barrier
// between the warpgroups' dS and dQ products), SKIP_DQ_MMA (no dS
// staging, no dQ product). Figures: results/cuda/h100-bwd-ws-probe.txt. Issuing tile i's dQ
// product after tile i + 1's S^T and dP^T, to run it beside that tile's gradients, needs more
// than a consumer's 240 registers here (ptxas C7511: wgmma serialized, 580 bytes spilled). The
// last share's warp adding it and writing dQ itself, instead of the cast kernel, was slower:
// H100, W3 causal 1.725 against 0.997 ms whole, non-causal 5.445 against 1.917 (one producer
// warp of 24 registers casts a 64 x 128 tile while the blocks behind it wait).

#include <cuda.h>  // CUtensorMap

#include "common.cuh"

#ifndef ORDERED
#define ORDERED 1
#endif
#ifndef DQ_PERMUTED
#define DQ_PERMUTED 0
#endif
#ifndef FAST_EXP
#define FAST_EXP 0
#endif
#ifndef SKIP_DQ
#define SKIP_DQ 0
#endif
#ifndef DQ_BUFFERS
#define DQ_BUFFERS 1
#endif
#ifndef LONGEST_FIRST
#define LONGEST_FIRST 0
#endif
#ifndef ASCENDING
#define ASCENDING 0
#endif
#ifndef SPLIT_WAITS
#define SPLIT_WAITS 0
#endif
#ifndef FIRST_STORES
#define FIRST_STORES 0
#endif
#ifndef SKIP_SYNC
#define SKIP_SYNC 0
#endif
#ifndef SKIP_DQ_MMA
#define SKIP_DQ_MMA 0
#endif

constexpr int BLOCK_N = 128, BLOCK_M = 64, CONSUMERS = 2, CONSUMER_THREADS = CONSUMERS * GROUP_WARPS * 32;
constexpr int DQ_COLS = BLOCK_D / CONSUMERS;
static_assert(WGMMA && NUM_WARPS == (CONSUMERS + 1) * GROUP_WARPS && BLOCK_D == 128, "the prototype's one shape");
constexpr uint32_t KV_BYTES = BLOCK_N * BLOCK_D * sizeof(elem_t), Q_BYTES = BLOCK_M * BLOCK_D * sizeof(elem_t);
constexpr uint32_t DQ_TILE_BYTES = BLOCK_M * BLOCK_D * sizeof(float);

struct WsBwdParams {  // bwd_ws_probe.py mirrors it
  CUtensorMap q_map, k_map, v_map, do_map;
  const elem_t* out;   // (B, Lq, H, D), contiguous, as dout
  const elem_t* dout;
  elem_t* dq;          // (B, Lq, H, D), contiguous
  const float* lse;    // (B, H, Lq), natural log
  float* delta;        // (B, H, Lq)
  float* dq_accum;     // (B, H, query tiles x 64, 128), zeroed
  int* dq_semaphore;   // (B, H, query tiles), zeroed
  elem_t* dk;          // (B, Lk, H, D), contiguous
  elem_t* dv;
  int num_heads, seqlen_q, seqlen_k;
  float softmax_scale;
};

// flash_fwd_ws.cu's, as are the S^T and dP^T products flash_bwd.cu's: shared headers when this
// moves into kernels/ (a copy here leaves the shipped kernels' hash, and tables, as they are).
template <int ROWS>
__device__ __forceinline__ void load_tile_tma(elem_t* tile, const CUtensorMap* map, int row, int head, int batch,
                                              uint64_t* full) {
#pragma unroll
  for (int block = 0; block < BLOCK_D / SWIZZLE_COLS; ++block)
    tma_load(tile + block * ROWS * SWIZZLE_COLS, map, block * SWIZZLE_COLS, row, head, batch, full);
}

__device__ __forceinline__ void consumers_sync() {
  asm volatile("bar.sync 1, %0;\n" :: "n"(CONSUMER_THREADS) : "memory");
}

__device__ __forceinline__ void stmatrix_x4_trans(const uint32_t (&r)[4], elem_t* p) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n"
               :: "r"(shared_address(p)), "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3]) : "memory");
}

// c (64 x 8 N8) = A B: A the 64 rows of a shared tile with rows along k, B 16 K16 rows of a
// shared tile with a row per k from the column block at `b`.
template <int N8, int K16>
__device__ __forceinline__ void wgmma_ab_ss(float (&c)[N8][4], const elem_t* a, const elem_t* b) {
#pragma unroll
  for (int kk = 0; kk < K16; ++kk)
    Wgmma<N8 * 8>::template ss<1>(c, k_major(a, GROUP_ROWS, 0, kk), mn_major(b, 16 * K16, kk), kk > 0);
}

// The key blocks whose CTA visits query tile m: a prefix of the blocks.
__device__ __forceinline__ int key_blocks_reaching(int m, int offset, int n_blocks) {
  if (!IS_CAUSAL) return n_blocks;
  const int last_key = (m + 1) * BLOCK_M - 1 + offset;
  return last_key < 0 ? 0 : min(n_blocks, last_key / BLOCK_N + 1);
}

extern "C" __global__ void __launch_bounds__(THREADS, 1) bwd_ws_kernel(const __grid_constant__ WsBwdParams p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __shared__ __align__(8) uint64_t kv_full, full[STAGES], empty[STAGES], dq_full[DQ_BUFFERS], dq_empty[DQ_BUFFERS];
  elem_t* k_smem = shared_tiles(smem_raw);
  elem_t* v_smem = k_smem + BLOCK_N * BLOCK_D;
  elem_t* q_smem = v_smem + BLOCK_N * BLOCK_D;             // ring of STAGES query tiles
  elem_t* do_smem = q_smem + STAGES * BLOCK_M * BLOCK_D;    // and their dO tiles
  elem_t* ds_smem = do_smem + STAGES * BLOCK_M * BLOCK_D;   // two dS tiles, 64 rows x 128 keys
  float* dq_smem = reinterpret_cast<float*>(ds_smem + 2 * BLOCK_M * BLOCK_N);  // DQ_BUFFERS x 64 x 128
  float* lse_smem = dq_smem + DQ_BUFFERS * BLOCK_M * BLOCK_D;  // STAGES x 64
  float* delta_smem = lse_smem + STAGES * BLOCK_M;

  const int bh = blockIdx.x, batch = bh / p.num_heads, head = bh % p.num_heads;
  // Descending (ASCENDING 0): the last blocks add first, so they launch first, shortest first
  // under causal (LONGEST_FIRST launches the other way, unordered only). ASCENDING: block 0 adds
  // first and the blocks launch longest first; each walks its query tiles from the last, so all
  // blocks of a head visit a tile at the same step and block n trails block n - 1 by one add.
  const int n_blocks = gridDim.y;
  const int n_block = LONGEST_FIRST || ASCENDING ? blockIdx.y : n_blocks - 1 - blockIdx.y;
  static_assert(!(LONGEST_FIRST && ORDERED), "an ordered sum launches longest-first through ASCENDING");
  static_assert(!FIRST_STORES || (ORDERED && ASCENDING), "the first share is known in ascending order");
  const int offset = p.seqlen_k - p.seqlen_q;
  const int m_tiles = (p.seqlen_q + BLOCK_M - 1) / BLOCK_M;
  const int m_begin = IS_CAUSAL ? max(0, n_block * BLOCK_N - offset) / BLOCK_M : 0;
  auto tile_at = [&](int i) { return ASCENDING ? m_tiles - 1 - i : m_begin + i; };  // the i-th tile walked

  if (threadIdx.x == 0) {
    barrier_init(&kv_full, 1);
    for (int slot = 0; slot < STAGES; ++slot) {
      barrier_init(&full[slot], 1 + 32);
      barrier_init(&empty[slot], CONSUMER_THREADS);
    }
    for (int b = 0; b < DQ_BUFFERS; ++b) {
      barrier_init(&dq_full[b], CONSUMER_THREADS);
      barrier_init(&dq_empty[b], 1);
    }
    fence_barrier_init();
  }
  __syncthreads();

  if (threadIdx.x < GROUP_WARPS * 32) {
    registers_release<24>();
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (warp == 0 && lane == 0) {
      barrier_arrive_expecting(&kv_full, 2 * KV_BYTES);
      load_tile_tma<BLOCK_N>(k_smem, &p.k_map, n_block * BLOCK_N, head, batch, &kv_full);
      load_tile_tma<BLOCK_N>(v_smem, &p.v_map, n_block * BLOCK_N, head, batch, &kv_full);
      for (int i = 0; i < m_tiles - m_begin; ++i) {
        const int m = tile_at(i);
        const int slot = i % STAGES;
        if (i >= STAGES) barrier_wait(&empty[slot], (i / STAGES - 1) & 1);
        barrier_arrive_expecting(&full[slot], 2 * Q_BYTES);
        load_tile_tma<BLOCK_M>(q_smem + slot * BLOCK_M * BLOCK_D, &p.q_map, m * BLOCK_M, head, batch, &full[slot]);
        load_tile_tma<BLOCK_M>(do_smem + slot * BLOCK_M * BLOCK_D, &p.do_map, m * BLOCK_M, head, batch, &full[slot]);
      }
    } else if (warp == 1) {
      const float* lse = p.lse + int64_t(bh) * p.seqlen_q;
      const float* delta = p.delta + int64_t(bh) * p.seqlen_q;
      for (int i = 0; i < m_tiles - m_begin; ++i) {
        const int m = tile_at(i);
        const int slot = i % STAGES;
        if (i >= STAGES) barrier_wait(&empty[slot], (i / STAGES - 1) & 1);
        for (int r = lane; r < BLOCK_M; r += 32) {
          const int row = m * BLOCK_M + r;
          const float value = row < p.seqlen_q ? lse[row] : INFINITY;
          lse_smem[slot * BLOCK_M + r] = value == -INFINITY ? INFINITY : value * LOG2E;
          delta_smem[slot * BLOCK_M + r] = row < p.seqlen_q ? delta[row] : 0.f;
        }
        barrier_arrive(&full[slot]);
      }
    } else if (warp == 2 && lane == 0 && !SKIP_DQ) {
      float* accum = p.dq_accum + int64_t(bh) * m_tiles * BLOCK_M * BLOCK_D;
#if ORDERED
      int* counters = p.dq_semaphore + bh * m_tiles;
#endif
      for (int i = 0; i < m_tiles - m_begin; ++i) {
        const int m = tile_at(i);
        const int buffer = i % DQ_BUFFERS;
        barrier_wait(&dq_full[buffer], (i / DQ_BUFFERS) & 1);
#if ORDERED
        const int turn = ASCENDING ? n_block : key_blocks_reaching(m, offset, n_blocks) - 1 - n_block;
        int seen;
        do asm volatile("ld.relaxed.gpu.global.b32 %0, [%1];\n" : "=r"(seen) : "l"(counters + m) : "memory");
        while (seen != turn);
        asm volatile("fence.acq_rel.gpu;\n" ::: "memory");
#endif
        float* sum = accum + int64_t(m) * BLOCK_M * BLOCK_D;
        const uint32_t share = shared_address(dq_smem + buffer * BLOCK_M * BLOCK_D);
#if ORDERED && FIRST_STORES
        if (turn == 0)  // the first share is stored: the buffer needs no zeroing
          asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n"
                       :: "l"(sum), "r"(share), "n"(DQ_TILE_BYTES) : "memory");
        else
#endif
          asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n"
                       :: "l"(sum), "r"(share), "n"(DQ_TILE_BYTES) : "memory");
        asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
#if ORDERED
        asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
        asm volatile("red.release.gpu.global.add.s32 [%0], 1;\n" :: "l"(counters + m) : "memory");
#else
        asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
#endif
        barrier_arrive(&dq_empty[buffer]);
      }
      asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
    }
    return;
  }

  registers_claim<240>();
  const int warp = threadIdx.x / 32 - GROUP_WARPS, lane = threadIdx.x % 32;  // among the consumers
  const int g = lane / 4, t = lane % 4;
  const int group = warp / GROUP_WARPS, group_key0 = group * GROUP_ROWS;  // the warpgroup's keys in the block
  const int block_key0 = n_block * BLOCK_N;
  const int key0 = block_key0 + group_key0 + (warp % GROUP_WARPS) * 16 + g;  // this thread's: key0, key0 + 8
  float dk_acc[BLOCK_D / 8][4] = {}, dv_acc[BLOCK_D / 8][4] = {};
  barrier_wait(&kv_full, 0);

  for (int i = 0; i < m_tiles - m_begin; ++i) {
    const int m = tile_at(i);
    const int slot = i % STAGES;
    barrier_wait(&full[slot], (i / STAGES) & 1);
    const elem_t* q_tile = q_smem + slot * BLOCK_M * BLOCK_D;
    const elem_t* do_tile = do_smem + slot * BLOCK_M * BLOCK_D;
    const float* lse_tile = lse_smem + slot * BLOCK_M;
    const float* delta_tile = delta_smem + slot * BLOCK_M;

    // a tile with a position outside the bounds or the causal rule tests each position
    const int first_row = m * BLOCK_M, group_first_key = block_key0 + group_key0;
    const bool boundary = first_row + BLOCK_M > p.seqlen_q || group_first_key + GROUP_ROWS > p.seqlen_k ||
                          (IS_CAUSAL && group_first_key + GROUP_ROWS - 1 > first_row + offset);
    const float scale_log2 = p.softmax_scale * LOG2E;
    auto probabilities = [&](float (&s)[BLOCK_M / 8][4]) {  // S^T -> P^T, in place
#pragma unroll
      for (int n = 0; n < BLOCK_M / 8; ++n) {
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const int key = key0 + (c / 2) * 8, column = n * 8 + 2 * t + (c % 2), row = first_row + column;
          const bool visible =
              !boundary || (row < p.seqlen_q && key < p.seqlen_k && (!IS_CAUSAL || key <= row + offset));
#if FAST_EXP
          s[n][c] = visible ? exp2_ftz(fmaf(s[n][c], scale_log2, -lse_tile[column])) : 0.f;
#else
          s[n][c] = visible ? exp2f(s[n][c] * scale_log2 - lse_tile[column]) : 0.f;
#endif
        }
      }
    };
    auto score_grads = [&](const float (&prob)[BLOCK_M / 8][4], float (&dp)[BLOCK_M / 8][4]) {  // dP^T -> dS^T
#pragma unroll
      for (int n = 0; n < BLOCK_M / 8; ++n)
#pragma unroll
        for (int c = 0; c < 4; ++c) dp[n][c] = prob[n][c] * (dp[n][c] - delta_tile[n * 8 + 2 * t + (c % 2)]);
    };

    float s[BLOCK_M / 8][4], dp[BLOCK_M / 8][4];
    uint32_t p_frag[BLOCK_M / 16][4], ds_frag[BLOCK_M / 16][4];
#if SPLIT_WAITS  // P while dP^T is computed, dV += P^T dO while dS is
    wgmma_fence();
    wgmma_abt(s, k_smem, BLOCK_N, group_key0, q_tile);
    wgmma_commit();
    wgmma_abt(dp, v_smem, BLOCK_N, group_key0, do_tile);
    wgmma_commit();
    wgmma_wait<1>();
    touch(s);
    probabilities(s);
#pragma unroll
    for (int kk = 0; kk < BLOCK_M / 16; ++kk) accumulator_to_a(p_frag[kk], s, kk);
    touch(dv_acc);
    wgmma_fence();
    wgmma_ab(dv_acc, p_frag, do_tile);
    wgmma_commit();
    wgmma_wait<1>();
    touch(dp);
    score_grads(s, dp);
#pragma unroll
    for (int kk = 0; kk < BLOCK_M / 16; ++kk) accumulator_to_a(ds_frag[kk], dp, kk);
    touch(dk_acc);
    wgmma_fence();
    wgmma_ab(dk_acc, ds_frag, q_tile);
    wgmma_commit();
#else
    wgmma_fence();
    wgmma_abt(s, k_smem, BLOCK_N, group_key0, q_tile);
    wgmma_abt(dp, v_smem, BLOCK_N, group_key0, do_tile);
    wgmma_commit();
    wgmma_wait<0>();
    touch(s);
    touch(dp);
    probabilities(s);
    score_grads(s, dp);
#pragma unroll
    for (int kk = 0; kk < BLOCK_M / 16; ++kk) {
      accumulator_to_a(p_frag[kk], s, kk);
      accumulator_to_a(ds_frag[kk], dp, kk);
    }
    touch(dv_acc);
    touch(dk_acc);
    wgmma_fence();
    wgmma_ab(dv_acc, p_frag, do_tile);
    wgmma_ab(dk_acc, ds_frag, q_tile);
    wgmma_commit();
#endif

    // dS^T -> dS in shared memory: each 8 x 8 block of a fragment as 8 query rows of 8 keys
    elem_t* ds_tile = ds_smem + (i % 2) * BLOCK_M * BLOCK_N;
    float dq[DQ_COLS / 8][4] = {};
#if !SKIP_DQ_MMA
    {
      const int block = lane / 8, key = group_key0 + (warp % GROUP_WARPS) * 16 + (block % 2) * 8;
#pragma unroll
      for (int kk = 0; kk < BLOCK_M / 16; ++kk)
        stmatrix_x4_trans(ds_frag[kk], ds_tile + swizzled(kk * 16 + (block / 2) * 8 + lane % 8, key, BLOCK_M));
    }
    fence_async_shared();
#if !SKIP_SYNC
    consumers_sync();  // both warpgroups' dS are in
#endif
    touch(dq);
    wgmma_fence();
    wgmma_ab_ss<DQ_COLS / 8, BLOCK_N / 16>(dq, ds_tile, k_smem + group * (DQ_COLS / SWIZZLE_COLS) * BLOCK_N * SWIZZLE_COLS);
    wgmma_commit();
#endif
    wgmma_wait<0>();
    touch(dv_acc);
    touch(dk_acc);
    touch(dq);
    barrier_arrive(&empty[slot]);  // Q, dO, lse and delta of the slot are read

#if !SKIP_DQ
    const int buffer = i % DQ_BUFFERS;
    float* dq_share = dq_smem + buffer * BLOCK_M * BLOCK_D;
    if (i >= DQ_BUFFERS) barrier_wait(&dq_empty[buffer], (i / DQ_BUFFERS - 1) & 1);  // warp 2 is done with it
#if DQ_PERMUTED
    // in fragment order: pair (d, r) of consumer thread c at float2 (2 d + r) * 256 + c, so each
    // store of a warp fills 256 contiguous bytes (the convert step puts rows and columns back)
    {
      float2* tile = reinterpret_cast<float2*>(dq_share) + warp * 32 + lane;
#pragma unroll
      for (int d = 0; d < DQ_COLS / 8; ++d)
#pragma unroll
        for (int r = 0; r < 2; ++r) tile[(2 * d + r) * CONSUMER_THREADS] = make_float2(dq[d][2 * r], dq[d][2 * r + 1]);
    }
#else
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float* dq_row = dq_share + ((warp % GROUP_WARPS) * 16 + g + r * 8) * BLOCK_D + group * DQ_COLS;
#pragma unroll
      for (int d = 0; d < DQ_COLS / 8; ++d)
        *reinterpret_cast<float2*>(dq_row + d * 8 + 2 * t) = make_float2(dq[d][2 * r], dq[d][2 * r + 1]);
    }
#endif
    fence_async_shared();
    barrier_arrive(&dq_full[buffer]);
#endif
  }

#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int key = key0 + r * 8;
    if (key >= p.seqlen_k) continue;
    const int64_t at = ((int64_t(batch) * p.seqlen_k + key) * p.num_heads + head) * HEAD_DIM;
#pragma unroll
    for (int d = 0; d < BLOCK_D / 8; ++d) {
      const int col = d * 8 + 2 * t;
      store_pair(p.dk + at + col, dk_acc[d][2 * r] * p.softmax_scale, dk_acc[d][2 * r + 1] * p.softmax_scale);
      store_pair(p.dv + at + col, dv_acc[d][2 * r], dv_acc[d][2 * r + 1]);
    }
  }
}

// delta = rowsum(dO * out): one warp per query row.
extern "C" __global__ void __launch_bounds__(THREADS) bwd_ws_delta_kernel(const WsBwdParams p) {
  const int row = blockIdx.x * NUM_WARPS + threadIdx.x / 32, lane = threadIdx.x % 32;
  const int bh = blockIdx.y, batch = bh / p.num_heads, head = bh % p.num_heads;
  if (row >= p.seqlen_q) return;
  const int64_t at = ((int64_t(batch) * p.seqlen_q + row) * p.num_heads + head) * HEAD_DIM + 4 * lane;
  const uint2 o = *reinterpret_cast<const uint2*>(p.out + at), d = *reinterpret_cast<const uint2*>(p.dout + at);
  const float2 o0 = unpack2(o.x), o1 = unpack2(o.y), d0 = unpack2(d.x), d1 = unpack2(d.y);
  float sum = o0.x * d0.x + o0.y * d0.y + o1.x * d1.x + o1.y * d1.y;
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffff, sum, offset);
  if (lane == 0) p.delta[int64_t(bh) * p.seqlen_q + row] = sum;
}

// dQ = softmax_scale * the summed shares, in the input dtype: a thread per two columns of a row,
// read from the shares' fragment order (DQ_PERMUTED) or row-major tiles.
extern "C" __global__ void __launch_bounds__(THREADS) bwd_ws_dq_kernel(const WsBwdParams p) {
  const int pair = blockIdx.x * THREADS + threadIdx.x, row = pair / (BLOCK_D / 2), col = pair % (BLOCK_D / 2) * 2;
  const int bh = blockIdx.y, batch = bh / p.num_heads, head = bh % p.num_heads;
  if (row >= p.seqlen_q) return;
  const int m_tiles = (p.seqlen_q + BLOCK_M - 1) / BLOCK_M, tile_row = row % BLOCK_M;
  elem_t* dq = p.dq + ((int64_t(batch) * p.seqlen_q + row) * p.num_heads + head) * HEAD_DIM + col;
  if (FIRST_STORES && key_blocks_reaching(row / BLOCK_M, p.seqlen_k - p.seqlen_q,
                                          (p.seqlen_k + BLOCK_N - 1) / BLOCK_N) == 0) {
    store_pair(dq, 0.f, 0.f);  // no share was stored: the buffer was not zeroed
    return;
  }
  const float* tile = p.dq_accum + (int64_t(bh) * m_tiles + row / BLOCK_M) * BLOCK_M * BLOCK_D;
#if DQ_PERMUTED
  const int w4 = tile_row / 16, r = tile_row % 16 / 8, g = tile_row % 8;
  const int group = col / DQ_COLS, d = col % DQ_COLS / 8, t = col % 8 / 2;
  const int consumer = (group * GROUP_WARPS + w4) * 32 + g * 4 + t;
  const float2 sum = reinterpret_cast<const float2*>(tile)[(2 * d + r) * CONSUMER_THREADS + consumer];
#else
  const float2 sum = *reinterpret_cast<const float2*>(tile + tile_row * BLOCK_D + col);
#endif
  store_pair(dq, sum.x * p.softmax_scale, sum.y * p.softmax_scale);
}
