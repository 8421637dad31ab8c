// Flash dynamic-mask attention, backward, warp-specialized for SM90 (Hopper): FlashAttention-3's
// split of the backward. The math is flash_bwd.cu's (its header: P recomputed from lse, dS =
// P (dP - delta) = dBias, the softcap factor, dK and dQ scaled by softmax_scale); what changes is
// who waits for what, and that dQ is summed from shares instead of recomputed by a second kernel.
//
// A CTA owns BLOCK_N = 64 x CONSUMERS keys of one (batch, query head) (with BWD_KV_GROUP, of
// one (batch, KV head): below) and walks the query tiles of BLOCK_M = 64 rows that see them, dK
// and dV in registers. It has CONSUMERS + 1 warpgroups:
//   producer (24 registers a thread):
//     warp 0 issues TMA for K and V once, then each query tile's Q and dO into a ring of
//       STAGES slots;
//     warp 1 stages each tile's lse (log2 units; +inf for dead rows and rows past Lq, so their
//       P is 0) and delta beside them;
//     warp 2 adds each tile's dQ share from shared memory to an fp32 sum in global memory with
//       one bulk reduce-add;
//     warp 3, where dBias is stored by TMA (below) under the causal rule, writes the zeros of
//       the dBias tiles no query of the block's tiles sees, so the launcher zeroes nothing.
//   consumers, 64 keys each. Per query tile:
//     S^T = K Q^T, dP^T = V dO^T (wgmma, shared operands; P^T is computed while dP^T runs);
//     dV += P^T dO (while dS^T is computed), dK += dS^T Q (wgmma, P^T and dS^T from registers);
//     dS^T into shared memory as dS (stmatrix .trans), all consumers' keys side by side;
//     the tile's dQ share = dS K, each consumer BLOCK_D / CONSUMERS of its columns, into a
//     shared fp32 tile (two, used in turn) for warp 2.
//
// The dQ sum is deterministic: the shares of query tile m are added in key-block order, block n
// waiting on tile m's counter (global memory) until blocks 0 .. n - 1 have added theirs. A head
// slice's blocks launch in order (common.cuh: section_order; sections of slices whose Q, dO and
// dQ sums fit L2), so a block waits only for blocks launched before it, which hold an SM or are
// done (no deadlock), and causal's longest blocks start first. Every block walks its
// query tiles from the last, so the blocks of a head reach a tile at about the same step and
// block n trails block n - 1 by about one add. (Adding in descending block order forces causal's
// shortest blocks first: H100, W3 causal, 1.424 against 0.971 ms for this kernel.) Block 0
// visits every query tile that any block visits and stores its share instead of adding it, so
// the sum needs no zeroing; only the leading tiles whose rows all see no key (causal, Lq - Lk >=
// 64) are visited by none, and the launcher zeroes their sums (their dQ is 0).
// dmattn_bwd_ws_delta_kernel computes delta and zeroes the counters before, and
// dmattn_bwd_ws_dq_kernel scales the sums into dQ after.
//
// Unordered dQ (BWD_DQ_UNORDERED; BwdConfig.nondeterministic_dq): every block adds its share as
// soon as it is made, waiting for no counter, and warp 2 waits only until the bulk copy has read
// the share (not until the adds land), so dQ's last bits depend on the blocks' timing. The delta
// kernel zeroes the sums instead of the counters (a packed call's the launcher). The wait costs
// at most (H200, the tree's order against adds in no order, the backward alone) 14% on W1, 4.5%
// on W2 and 5.6% on W3: results/cuda/h200-bwd-dq-order-probe.md.
//
// Sliding window (HAS_WINDOW: FlashAttention's window_size, as common.cuh's Inputs hold it): a
// block walks only the query tiles [m_begin, m_end) whose rows' windows reach its keys, and the
// query tiles it skips are outside the loop, as in the forward. Tile m is then visited by the
// blocks from first_block(m), the one holding its first row's first key, on: that block stores
// its share and block n waits until blocks first_block(m) .. n - 1 have added theirs (the same
// order, shifted). Positions are tested in the tiles at the window's sides (`boundary`).
//
// Mask and bias (MASK_TILES, BIAS_TILES; variants.py picks as the operands' layouts allow):
//   1, a tile of rows: the producer stages each query tile's BLOCK_M x BLOCK_N tile by TMA
//     (keys contiguous, a 16-bit bias) in a ring of SCORE_STAGES slots beside the Q and dO ring,
//     released once P is taken. A consumer's fragment is S^T's, so the bias comes by ldmatrix
//     .trans, four n8 tiles' pairs an instruction; mask bytes one by one. Tile rows and keys
//     outside the operand arrive as 0: a staged mask keeps nothing there.
//   2, one row of keys (a padding mask, a per-key bias): each thread reads its two keys' values
//     into registers once.
//   0, any other layout: read from global memory at each tested position, as in flash_bwd.cu.
// With a staged tile the fp32 dQ share has one buffer, not two (the ring's room; the share's
// second buffer bought nothing: H100, W3, 1.426 against 1.423 ms on the prototype). W1's 24 KiB
// slots get one slot: a second in the room of one dS tile (the consumers then meeting once more a
// step, before writing dS) was slower, H100, W1 backward 1.495 against 1.442 ms. Bounds and
// causal are tested only in a consumer's boundary tiles; a mask in global memory wherever there
// is one.
// dBias: with a query dim and the input dtype (DBIAS_TMA, no softcap, where dS is dBias) the dS
// tile the consumers stage for dQ is also stored by TMA, one store per 64 keys; otherwise
// element by element, or without a query dim each key's dS summed over its queries in
// registers. Under GQA (DKV_FP32) each query head writes its own fp32 share of dK and dV, which
// the launcher sums.
//
// What did not pay (H100, W3 shape, bf16 B2 H16 L4096 D128 causal; these figures and the order's
// above were measured on this kernel's prototype, `benchmarks/cuda/bwd_ws_probe.py [floors]` at
// 2071c35, whose commits give each run): a tile's dQ product issued
// beside the next tile's gradients needs more than a consumer's 240 registers (ptxas C7511,
// spills); the last block casting dQ itself, instead of the dQ kernel, 1.725 against 0.997 ms for
// the whole backward; summing dQ in the dK/dV kernel of flash_bwd.cu (its header).
//
// A KV group in one CTA (BWD_KV_GROUP, GQA; BwdConfig.kv_group): the grid's slices are (batch,
// KV head), and a CTA walks its query tiles for each query head of its group, one ring of Q and
// dO across them. dK and dV stay in registers over the group and are stored once in the input
// dtype: no fp32 share per query head for the launcher to sum (H200, packed causal D128 GQA 4:
// the shares' fill, sum and cast took 0.19 of 1.8 ms a step). Each query head's tiles keep their
// own dQ sums and counters. The group's heads take turns at each query tile (HEADS_INNER), so
// the blocks of a slice reach a (head, tile) at about the same step, as without the knob; a
// head's tiles one after another made a short block wait at each head for block 0 to finish the
// head before (H200, dense B2 L4096 causal D128: fwd+bwd 1.42x the time without the knob, 1.28x
// with the heads taking turns; packed documents 1.24x, 0.96x). Under a window, whose blocks walk
// tiles as many as each other, and with per-key dBias sums (a pair of registers a key and head),
// each head's tiles run in turn, a head's sums stored when its last step ends. Staged score
// tiles and dBias by TMA are not taken (their rings and stores are per query head): a mask or
// bias of query rows is read from global memory.
//
// Transposed dK/dV (DKV_TRANSPOSED; tiles of 192 columns, D136-D192): 64 keys x 192 columns of
// dK and dV would take 192 accumulator registers a thread and spill, so the block's BLOCK_N (64
// or 96) keys are split between its two consumers instead, each holding dK^T and dV^T of its
// own (the head dim as the m of their products, its keys as the n: 144 registers at 48 keys), as
// FlashAttention-3's hdim-192 backward does. S and dP come as rows of queries; P and dS reach
// the dV^T and dK^T products through shared memory, stored transposed; dQ is summed by 64-column
// blocks (`transposed_consumer`). The ring has STAGES slots (96 keys fit one), the dQ share one
// buffer; no window, packed sequences or KV group, and the mask and bias come from global memory
// (H200, bf16 B4 H16 GQA 4 L4096 D192: the whole backward 3.02 ms causal, 5.01 not, against
// 7.07 and 13.51 ms on D256's tiles; `python -m benchmarks cuda-bwd-transposed-check`).
//
// Layouts: TMA writes each 64-column block of a tile as 128-byte rows in the 128-byte swizzle
// (sm90.cuh); rows past Lq or Lk and columns past HEAD_DIM arrive as zeros. The maps
// (`dmattn_kernels.cuda.backward`, per call) describe q and dO as (D, Lq, H, B), k and v as
// (D, Lk, Hkv, B), with boxes of 64 columns by BLOCK_M or BLOCK_N rows. A dQ share is stored in
// fragment order: pair (d, r) of consumer thread c at float2 (2 d + r) x consumer threads + c,
// so each warp's store fills 256 contiguous bytes (the dQ kernel reads rows and columns back).
//
// Compile-time parameters: those of common.cuh (WGMMA 1), BLOCK_M, BLOCK_N, SCORE_STAGES,
// MASK_TILES, BIAS_TILES, DBIAS_TMA, HAS_WINDOW, PACKED, BWD_KV_GROUP, BWD_DQ_UNORDERED,
// DKV_TRANSPOSED, and flash_bwd.cu's HAS_DBIAS, DBIAS_ROWS, DBIAS_FP32 and DKV_FP32.

#include <cuda.h>  // CUtensorMap

#include "bwd_steps.cuh"

static_assert(WGMMA, "the warp-specialized backward runs its products as wgmma (sm90)");
constexpr int CONSUMERS = NUM_WARPS / GROUP_WARPS - 1;  // warpgroup 0 produces
constexpr int CONSUMER_THREADS = CONSUMERS * GROUP_WARPS * 32;
constexpr int DQ_COLS = BLOCK_D / CONSUMERS;  // the columns of a dQ share one consumer computes
constexpr bool SCORE_TILES = (HAS_MASK && MASK_TILES == 1) || (HAS_BIAS && BIAS_TILES == 1);  // a staged ring
#if DKV_TRANSPOSED
constexpr int DQ_BUFFERS = 1;  // the room of a second share holds the P^T tile
constexpr int CONSUMER_KEYS = BLOCK_N / CONSUMERS;  // the keys a consumer owns: the n of its products
static_assert(CONSUMERS == 2 && BLOCK_D == 192 && BLOCK_M == 64 && CONSUMER_KEYS % 16 == 0,
              "transposed dK/dV: two consumers splitting the block's keys, tiles of 192 columns, query tiles of 64 rows");
#if HAS_WINDOW || PACKED || BWD_KV_GROUP
#error "transposed dK/dV: no window, packed sequences or KV group"
#endif
static_assert(!SCORE_TILES && !DBIAS_TMA, "transposed dK/dV: mask and bias from global memory, dBias stored by its threads");
#else
constexpr int DQ_BUFFERS = SCORE_TILES ? 1 : 2;  // `shared_memory.backward_shared_bytes` mirrors the layout below
static_assert(CONSUMERS >= 1 && NUM_WARPS % GROUP_WARPS == 0 && BLOCK_N == CONSUMERS * GROUP_ROWS && BLOCK_M == 64,
              "one producer warpgroup and a consumer warpgroup per 64 keys; query tiles of 64 rows");
static_assert(BLOCK_D % CONSUMERS == 0 && DQ_COLS % SWIZZLE_COLS == 0 && is_wgmma_width(DQ_COLS),
              "each consumer's dQ columns are whole 128-byte lines of K");
#endif
constexpr int PRODUCER_REGISTERS = 24;
constexpr int CONSUMER_REGISTERS_LEFT = (65536 - GROUP_WARPS * 32 * PRODUCER_REGISTERS) / CONSUMER_THREADS / 8 * 8;
constexpr int CONSUMER_REGISTERS = CONSUMER_REGISTERS_LEFT < 240 ? CONSUMER_REGISTERS_LEFT : 240;
constexpr uint32_t KV_BYTES = BLOCK_N * BLOCK_D * sizeof(elem_t), Q_BYTES = BLOCK_M * BLOCK_D * sizeof(elem_t);
constexpr uint32_t DQ_SHARE_BYTES = BLOCK_M * BLOCK_D * sizeof(float);
static_assert(!SCORE_TILES || (SCORE_STAGES >= 1 && (BLOCK_N == 64 || BLOCK_N == 128)),
              "staged mask and bias tiles: a ring slot and 64 or 128 keys (one or two 128-byte lines)");
static_assert(!(HAS_BIAS && BIAS_TILES == 1) || !BIAS_FP32, "a staged bias is 16-bit");
static_assert(!DBIAS_TMA || (HAS_DBIAS && DBIAS_ROWS && !DBIAS_FP32 && !HAS_SOFTCAP),
              "dBias stored from the dS tile: rows of the input dtype, and dS is dBias (no softcap)");
constexpr int MASK_LINE = BLOCK_N < 128 ? BLOCK_N : 128;  // a staged mask row: one line of BLOCK_N bytes
constexpr int MASK_SLOT_BYTES = HAS_MASK && MASK_TILES == 1 ? BLOCK_M * BLOCK_N : 0;  // whole KiB: BLOCK_M is 64
constexpr int BIAS_SLOT_BYTES = HAS_BIAS && BIAS_TILES == 1 ? BLOCK_M * BLOCK_N * int(sizeof(elem_t)) : 0;
constexpr int SCORE_SLOT_BYTES = MASK_SLOT_BYTES + BIAS_SLOT_BYTES;
constexpr int SCORE_SLOTS = SCORE_TILES ? SCORE_STAGES : 1;  // barrier arrays need a size
// every position's mask and bias readable (staged, in registers or absent): P is computed for
// all of a step's positions and selected, with no branch per position
constexpr bool SCORES_AT_HAND = (!HAS_MASK || MASK_TILES != 0) && (!HAS_BIAS || BIAS_TILES != 0);

struct BwdWsParams {  // `dmattn_kernels.cuda.params.BwdWsParams` mirrors it
  CUtensorMap q_map, k_map, v_map, do_map;
  CUtensorMap mask_map, bias_map, dbias_map;  // only where staged (MASK_TILES, BIAS_TILES 1) or DBIAS_TMA
  BwdParams bwd;
  // (B x H, query tiles, BLOCK_M x BLOCK_D): each tile's summed shares, fragment order (query
  // heads' slices also with BWD_KV_GROUP, whose grid slices are KV heads)
  float* dq_sum;
  int* dq_counter;  // (B x H, query tiles): the key blocks whose share is in the sum
  int section_slices;  // the launch order's sections (common.cuh: section_order)
#if PACKED
  // packed sequences in the one batch row: sequence s owns query rows [cu_seqlens_q[s],
  // cu_seqlens_q[s + 1]) and keys from cu_seqlens_k[s], the first seqused_k[s] of its span
  // (all of it where seqused_k is null), each length cut to [0, max_seqlen] as the Triton
  // kernels cut it; dq_sum and dq_counter hold head_tiles tiles a query head (`sequence_tile`)
  const int* cu_seqlens_q;
  const int* cu_seqlens_k;
  const int* seqused_k;
  int max_seqlen_q, max_seqlen_k;
  int head_tiles;
#endif
};

#if BWD_KV_GROUP
static_assert(!SCORE_TILES && !DBIAS_TMA && !DKV_FP32,
              "a KV group in one CTA: scores from registers or global memory, dBias and dK/dV stored by its threads");
#if HAS_WINDOW
// a window: each head's tiles in turn (H200, B2 L8192 window 1024 D128: fwd+bwd 0.916x the time
// without the knob, against 1.000x with the heads taking turns)
constexpr bool HEADS_INNER = false;
#else
// the group's heads take turns at each query tile, unless each head's per-key dBias sums need
// its tiles in a row (header)
constexpr bool HEADS_INNER = !(HAS_DBIAS && !DBIAS_ROWS);
#endif
#endif

#if PACKED
static_assert((!HAS_MASK || MASK_TILES != 1) && (!HAS_BIAS || BIAS_TILES != 1),
              "packed sequences: a mask and bias of one row of keys (per key) only");

// Sequence `sequence`'s first tile among a query head's dq_sum tiles and counters: its first
// row's tile plus one per earlier sequence, so the sequences' tiles never overlap (rows q0 ..
// q0 + L - 1 span at most q0 / BLOCK_M .. (q0 + L - 1) / BLOCK_M) and a head holds
// cdiv(total_q, BLOCK_M) + sequences of them (`backward.packed_head_tiles`): O(total), not
// sequences x the longest.
__device__ __forceinline__ int sequence_tile(const BwdWsParams& p, int sequence) {
  return p.cu_seqlens_q[sequence] / BLOCK_M + sequence;
}
#endif

__device__ __forceinline__ void consumers_sync() {
  asm volatile("bar.sync 1, %0;\n" :: "n"(CONSUMER_THREADS) : "memory");
}

#if DKV_TRANSPOSED
// dQ = dS K for the 64 columns of block `column_block`, over the keys [16 first_step, + 16 K16),
// issued: A dS from the dS^T tile (MN-major), B that column block of K (MN-major).
template <int K16>
__device__ __forceinline__ void transposed_dq_product(float (&dq)[SWIZZLE_COLS / 8][4], const elem_t* ds_tile,
                                                      const elem_t* k_smem, int column_block, int first_step) {
  const elem_t* k_columns = k_smem + column_block * BLOCK_N * SWIZZLE_COLS;
#pragma unroll
  for (int kk = 0; kk < K16; ++kk)
    WgmmaTransposed<SWIZZLE_COLS>::template ss<1, 1>(dq, mn_major(ds_tile, BLOCK_N, first_step + kk),
                                                     mn_major(k_columns, BLOCK_N, first_step + kk), kk > 0);
}

// acc (dK^T or dV^T: BLOCK_D x a consumer's keys, in 64-column blocks of the head dim) += A^T B,
// issued and committed: A the query tile `queries` (Q or dO; MN-major, the transpose flag), B the
// consumer's rows of a transposed tile (dS^T or P^T: rows are keys, K-major).
__device__ __forceinline__ void add_transposed_product(float (&acc)[BLOCK_D / SWIZZLE_COLS][CONSUMER_KEYS / 8][4],
                                                       const elem_t* queries, const elem_t* keys_tile, int group_key0) {
#pragma unroll
  for (int b = 0; b < BLOCK_D / SWIZZLE_COLS; ++b) touch(acc[b]);
  wgmma_fence();
#pragma unroll
  for (int b = 0; b < BLOCK_D / SWIZZLE_COLS; ++b)
#pragma unroll
    for (int kk = 0; kk < BLOCK_M / 16; ++kk)
      WgmmaTransposed<CONSUMER_KEYS>::template ss<1, 0>(acc[b], mn_major(queries + b * BLOCK_M * SWIZZLE_COLS, BLOCK_M, kk),
                                                        k_major(keys_tile, BLOCK_N, group_key0, kk), 1);
  wgmma_commit();
}

// Where a consumer thread's pair (d, r) of column block `column_block` goes in the dQ share: the
// fragment order the dQ kernel reads, as if consumer c had computed columns [c DQ_COLS, +
// DQ_COLS) (the pair of row 16 w4 + g + 8 r, columns 8 n8 + 2 t at float2 (2 (n8 % (DQ_COLS / 8))
// + r) x consumer threads + (n8 / (DQ_COLS / 8) x 4 + w4) x 32 + lane).
__device__ __forceinline__ int transposed_share_index(int column_block, int d, int r, int w4, int lane) {
  const int n8 = column_block * (SWIZZLE_COLS / 8) + d, owner = n8 / (DQ_COLS / 8);
  return (2 * (n8 % (DQ_COLS / 8)) + r) * CONSUMER_THREADS + (owner * GROUP_WARPS + w4) * 32 + lane;
}

// The consumers of the transposed layout (DKV_TRANSPOSED, header): consumer `group` owns keys
// [group_key0, + CONSUMER_KEYS) of the block. Per query tile it computes S = Q K^T and dP = dO V^T
// for them (64 rows x its keys), stages P and dS transposed (rows = keys) and adds
// dV^T += dO^T P and dK^T += Q^T dS, BLOCK_D x its keys in three m64 blocks of head-dim rows;
// then the tile's dQ = dS K by 64-column blocks (an MN-major operand starts on a block): consumer
// c block c over all keys, and block 2 over its own keys, the two halves added in the share. Both
// consumers run the same products (wgmma in a branch of one consumer only is serialized by ptxas,
// C7520), so a consumer whose keys no query of a causal tile sees computes a dS of zeros.
// Fragment (n, c) of S and dP: query row first_row + 16 w4 + g + 8 (c / 2), key
// group_first_key + 8 n + 2 t + c % 2. Of dK^T and dV^T block b: column 64 b + 16 w4 + g + 8 (c / 2),
// the same key.
template <typename TileAt>
__device__ __forceinline__ void transposed_consumer(const BwdParams& bwd, const HeadSlices& at, const ScoreRule& rule,
                                                    int n_block, int steps, TileAt tile_at,
                                                    const elem_t* k_smem, const elem_t* v_smem, const elem_t* q_smem,
                                                    const elem_t* do_smem, elem_t* ds_smem, elem_t* pt_smem,
                                                    float* dq_smem, const float* lse_smem, const float* delta_smem,
                                                    uint64_t* kv_full, uint64_t* full, uint64_t* empty,
                                                    uint64_t* dq_full, uint64_t* dq_empty) {
  const Inputs& in = bwd.in;
  constexpr int KEY_TILES = CONSUMER_KEYS / 8, COLUMN_BLOCKS = BLOCK_D / SWIZZLE_COLS;
  const int warp = threadIdx.x / 32 - GROUP_WARPS, lane = threadIdx.x % 32;  // warp among the consumers
  const int g = lane / 4, t = lane % 4, w4 = warp % GROUP_WARPS;
  const int group = warp / GROUP_WARPS, group_key0 = group * CONSUMER_KEYS;
  const int group_first_key = n_block * BLOCK_N + group_key0;
  const float scale_log2 = in.softmax_scale * LOG2E;
  float dkt_acc[COLUMN_BLOCKS][KEY_TILES][4] = {}, dvt_acc[COLUMN_BLOCKS][KEY_TILES][4] = {};
  float dbias_sum[KEY_TILES][2] = {};  // per key, this thread's rows summed (HAS_DBIAS, !DBIAS_ROWS)
  dbias_t* dbias = HAS_DBIAS ? bwd.dbias + at.batch * bwd.dbias_stride[0] + at.head * bwd.dbias_stride[1] : nullptr;
  auto key_of = [&](int n, int c) { return group_first_key + 8 * n + 2 * t + c % 2; };
  // dBias of one position (the other consumers' rule: stored, or summed per key)
  auto add_dbias = [&](float value, int row, int n, int c) {
    const int key = key_of(n, c);
    if (HAS_DBIAS && DBIAS_ROWS && row < in.seqlen_q && key < in.seqlen_k)
      dbias[row * bwd.dbias_stride[2] + key * bwd.dbias_stride[3]] = static_cast<dbias_t>(value);
    if (HAS_DBIAS && !DBIAS_ROWS) dbias_sum[n][c % 2] += value;
  };
  // a fragment of this consumer's keys (rows = queries) into a BLOCK_N x BLOCK_M tile whose rows
  // are keys: matrix i of k-step kk holds queries 16 w4 + 8 (i % 2) .. + 7 of keys
  // 16 kk + 8 (i / 2) .. + 7, stored transposed
  auto store_transposed = [&](elem_t* tile, const uint32_t (&frag)[KEY_TILES / 2][4]) {
    const int i = lane / 8;
#pragma unroll
    for (int kk = 0; kk < KEY_TILES / 2; ++kk)
      stmatrix_x4_trans(frag[kk], tile + swizzled(group_key0 + 16 * kk + 8 * (i / 2) + lane % 8, 16 * w4 + 8 * (i % 2),
                                                  BLOCK_N));
  };
  auto group_sync = [&] {  // this consumer's warpgroup (named barriers 2, 3)
    asm volatile("bar.sync %0, %1;\n" :: "r"(2 + group), "n"(GROUP_WARPS * 32) : "memory");
  };
  // consumer 0's half of dQ block 2 is in the share before consumer 1 adds its own (named barrier 4)
  auto half_sync = [&] {
    if (group == 0)
      asm volatile("bar.arrive 4, %0;\n" :: "n"(CONSUMER_THREADS) : "memory");
    else
      asm volatile("bar.sync 4, %0;\n" :: "n"(CONSUMER_THREADS) : "memory");
  };
  barrier_wait(kv_full, 0);

  for (int step = 0; step < steps; ++step) {
    const int m = tile_at(step), slot = step % STAGES;
    barrier_wait(&full[slot], (step / STAGES) & 1);
    const elem_t* q_tile = q_smem + slot * BLOCK_M * BLOCK_D;
    const elem_t* do_tile = do_smem + slot * BLOCK_M * BLOCK_D;
    const int first_row = m * BLOCK_M, tile_row = 16 * w4 + g;  // this thread's rows: tile_row, tile_row + 8
    const float2 lse = make_float2(lse_smem[slot * BLOCK_M + tile_row], lse_smem[slot * BLOCK_M + tile_row + 8]);
    const float2 delta = make_float2(delta_smem[slot * BLOCK_M + tile_row], delta_smem[slot * BLOCK_M + tile_row + 8]);
    auto row_of = [&](int c) { return first_row + tile_row + 8 * (c / 2); };
    // Bounds and causal are tested only where some query of the tile misses some key of this
    // consumer; a mask (global memory) at every position.
    const bool check = HAS_MASK || first_row + BLOCK_M > in.seqlen_q || group_first_key + CONSUMER_KEYS > in.seqlen_k ||
                       (IS_CAUSAL && group_first_key + CONSUMER_KEYS - 1 > first_row + rule.offset);
    elem_t* ds_tile = ds_smem + (step % 2) * BLOCK_M * BLOCK_N;
    uint32_t ds_frag[KEY_TILES / 2][4];
    {
      float s[KEY_TILES][4], dp[KEY_TILES][4];  // the first k-step overwrites (scale-d 0)
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < BLOCK_D / 16; ++kk)
        WgmmaTransposed<CONSUMER_KEYS>::template ss<0, 0>(s, k_major(q_tile, BLOCK_M, 0, kk),
                                                          k_major(k_smem, BLOCK_N, group_key0, kk), kk > 0);
      wgmma_commit();
#pragma unroll
      for (int kk = 0; kk < BLOCK_D / 16; ++kk)
        WgmmaTransposed<CONSUMER_KEYS>::template ss<0, 0>(dp, k_major(do_tile, BLOCK_M, 0, kk),
                                                          k_major(v_smem, BLOCK_N, group_key0, kk), kk > 0);
      wgmma_commit();
      wgmma_wait<HAS_SOFTCAP ? 0 : 1>();  // S is in (with a softcap dP too: dS needs the capped score); dP runs on
      touch(s);
      if (HAS_SOFTCAP) touch(dp);
#pragma unroll
      for (int n = 0; n < KEY_TILES; ++n)
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const int row = row_of(c), key = key_of(n, c);
          const bool allowed = !check || rule.visible(row, key);
          float prob = 0.f, dbias_value = 0.f, ds = 0.f;
          if (allowed) {  // a bias is read only where visible (elsewhere it may be NaN or outside the operand)
            const float capped = rule.capped(s[n][c]);
            const float x = HAS_BIAS ? rule.score(capped, row, key) * LOG2E
                                     : (HAS_SOFTCAP ? capped * LOG2E : s[n][c] * scale_log2);
            prob = exp2_ftz(x - (c / 2 ? lse.y : lse.x));
            if (HAS_SOFTCAP) {
              const float tanh_value = capped / rule.softcap;
              dbias_value = prob * (dp[n][c] - (c / 2 ? delta.y : delta.x));
              ds = dbias_value * (1.f - tanh_value * tanh_value);
            }
          }
          s[n][c] = prob;
          if (HAS_SOFTCAP) {
            dp[n][c] = ds;
            add_dbias(dbias_value, row, n, c);
          }
        }
      uint32_t p_frag[KEY_TILES / 2][4];
#pragma unroll
      for (int kk = 0; kk < KEY_TILES / 2; ++kk) accumulator_to_a(p_frag[kk], s, kk);
#if STAGES > 1
      // the last step's dV^T product of every warp of the consumer has read P^T (with one ring
      // slot, the wait for this tile's Q and dO came after every consumer thread's release)
      group_sync();
#endif
      store_transposed(pt_smem, p_frag);
      fence_async_shared();
      group_sync();  // the consumer's P^T rows are in
      add_transposed_product(dvt_acc, do_tile, pt_smem, group_key0);  // dV^T += dO^T P
      if (!HAS_SOFTCAP) {
        wgmma_wait<1>();  // dP is in; dV^T's product runs on
        touch(dp);
#pragma unroll
        for (int n = 0; n < KEY_TILES; ++n)
#pragma unroll
          for (int c = 0; c < 4; ++c) {
            dp[n][c] = s[n][c] * (dp[n][c] - (c / 2 ? delta.y : delta.x));
            add_dbias(dp[n][c], row_of(c), n, c);
          }
      }
#pragma unroll
      for (int kk = 0; kk < KEY_TILES / 2; ++kk) accumulator_to_a(ds_frag[kk], dp, kk);
    }
    store_transposed(ds_tile, ds_frag);
    fence_async_shared();
    consumers_sync();  // every consumer's dS^T is in
    add_transposed_product(dkt_acc, q_tile, ds_tile, group_key0);  // dK^T += Q^T dS
    float dq_own[SWIZZLE_COLS / 8][4], dq_half[SWIZZLE_COLS / 8][4];  // column block `group`; block 2, own keys
    transposed_dq_product<BLOCK_N / 16>(dq_own, ds_tile, k_smem, group, 0);
    transposed_dq_product<CONSUMER_KEYS / 16>(dq_half, ds_tile, k_smem, 2, group_key0 / 16);
    wgmma_commit();
    wgmma_wait<1>();  // dK^T and dV^T are in
#pragma unroll
    for (int b = 0; b < COLUMN_BLOCKS; ++b) {
      touch(dkt_acc[b]);
      touch(dvt_acc[b]);
    }
    barrier_arrive(&empty[slot]);  // Q, dO, lse and delta of the slot are read
    wgmma_wait<0>();
    touch(dq_own);
    touch(dq_half);
    float2* share = reinterpret_cast<float2*>(dq_smem);  // DQ_BUFFERS is 1
    if (step >= 1) barrier_wait(&dq_empty[0], (step - 1) & 1);  // warp 2 has added the last share
#pragma unroll
    for (int d = 0; d < SWIZZLE_COLS / 8; ++d)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        share[transposed_share_index(group, d, r, w4, lane)] = make_float2(dq_own[d][2 * r], dq_own[d][2 * r + 1]);
        if (group == 0)  // block 2's first half; consumer 1 adds the second at the same positions
          share[transposed_share_index(2, d, r, w4, lane)] = make_float2(dq_half[d][2 * r], dq_half[d][2 * r + 1]);
      }
    half_sync();
    if (group == 1) {
#pragma unroll
      for (int d = 0; d < SWIZZLE_COLS / 8; ++d)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          float2& sum = share[transposed_share_index(2, d, r, w4, lane)];
          sum = make_float2(sum.x + dq_half[d][2 * r], sum.y + dq_half[d][2 * r + 1]);
        }
    }
    fence_async_shared();
    barrier_arrive(&dq_full[0]);
  }

  if (HAS_DBIAS && !DBIAS_ROWS) {  // each key's dS summed over the rows: lanes of one t, then the group's warps
    float* partial = reinterpret_cast<float*>(pt_smem + group_key0 * BLOCK_M);  // the consumer's own P^T rows
    group_sync();  // its last dV^T product has read them
#pragma unroll
    for (int n = 0; n < KEY_TILES; ++n)
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        float sum = dbias_sum[n][j];
        sum += __shfl_xor_sync(0xffffffff, sum, 4);
        sum += __shfl_xor_sync(0xffffffff, sum, 8);
        sum += __shfl_xor_sync(0xffffffff, sum, 16);
        if (g == 0) partial[w4 * CONSUMER_KEYS + 8 * n + 2 * t + j] = sum;
      }
    group_sync();
    const int key = threadIdx.x % (GROUP_WARPS * 32);
    if (key < CONSUMER_KEYS && group_first_key + key < in.seqlen_k)
      dbias[(group_first_key + key) * bwd.dbias_stride[3]] =
          static_cast<dbias_t>(partial[key] + partial[CONSUMER_KEYS + key] + partial[2 * CONSUMER_KEYS + key] +
                               partial[3 * CONSUMER_KEYS + key]);
  }
  // Every key of the consumer is written, also one that no query sees (its gradients are 0).
  const int dkv_head = DKV_FP32 ? at.head : at.kv_head;
  dkv_t* dk = bwd.dk + at.batch * bwd.dk_stride[0] + dkv_head * bwd.dk_stride[2];
  dkv_t* dv = bwd.dv + at.batch * bwd.dv_stride[0] + dkv_head * bwd.dv_stride[2];
#pragma unroll
  for (int b = 0; b < COLUMN_BLOCKS; ++b)
#pragma unroll
    for (int n = 0; n < KEY_TILES; ++n)
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int col = SWIZZLE_COLS * b + 16 * w4 + g + 8 * (c / 2), key = key_of(n, c);
        if (key < in.seqlen_k && col < HEAD_DIM) {
          dk[key * bwd.dk_stride[1] + col] = static_cast<dkv_t>(dkt_acc[b][n][c] * in.softmax_scale);
          dv[key * bwd.dv_stride[1] + col] = static_cast<dkv_t>(dvt_acc[b][n][c]);
        }
      }
}
#endif

extern "C" __global__ void __launch_bounds__(THREADS, 1) dmattn_bwd_ws_kernel(const __grid_constant__ BwdWsParams p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __shared__ __align__(8) uint64_t kv_full, full[STAGES], empty[STAGES], dq_full[DQ_BUFFERS], dq_empty[DQ_BUFFERS];
  __shared__ __align__(8) uint64_t score_full[SCORE_SLOTS], score_empty[SCORE_SLOTS];
  elem_t* k_smem = shared_tiles(smem_raw);
  elem_t* v_smem = k_smem + BLOCK_N * BLOCK_D;
  elem_t* q_smem = v_smem + BLOCK_N * BLOCK_D;             // ring of STAGES query tiles
  elem_t* do_smem = q_smem + STAGES * BLOCK_M * BLOCK_D;    // and their dO tiles
  elem_t* ds_smem = do_smem + STAGES * BLOCK_M * BLOCK_D;   // two dS tiles, BLOCK_M x BLOCK_N
#if DKV_TRANSPOSED
  elem_t* pt_smem = ds_smem + 2 * BLOCK_M * BLOCK_N;  // the P^T tile, BLOCK_N x BLOCK_M
  float* dq_smem = reinterpret_cast<float*>(pt_smem + BLOCK_M * BLOCK_N);  // DQ_BUFFERS shares
#else
  float* dq_smem = reinterpret_cast<float*>(ds_smem + 2 * BLOCK_M * BLOCK_N);  // DQ_BUFFERS shares
#endif
  // the score ring's slots (the mask tile, then the bias tile; whole KiB, as TMA's swizzle needs)
  unsigned char* score_smem = reinterpret_cast<unsigned char*>(dq_smem + DQ_BUFFERS * BLOCK_M * BLOCK_D);
  float* lse_smem = reinterpret_cast<float*>(score_smem + SCORE_SLOTS * SCORE_SLOT_BYTES);  // STAGES x BLOCK_M
  float* delta_smem = lse_smem + STAGES * BLOCK_M;

#if PACKED
  // slice = sequence x H + head; `bwd` is the sequence's view of the batch row: its lengths, and
  // its rows' lse, delta, dK, dV, per-key mask, bias and dBias from its first row and key
  const SectionOrder order = section_order(p.section_slices);
#if BWD_KV_GROUP
  const int sequence = order.slice / (p.bwd.in.num_heads / p.bwd.in.group);  // slice = sequence x Hkv + KV head
#else
  const int sequence = order.slice / p.bwd.in.num_heads;
#endif
  const int q0 = p.cu_seqlens_q[sequence], k0 = p.cu_seqlens_k[sequence];
  const int2 lengths = sequence_lengths(p, sequence);
  if (order.block * BLOCK_N >= lengths.y) return;  // no key of the sequence in the block
  BwdParams bwd = p.bwd;
  bwd.in.seqlen_q = lengths.x;
  bwd.in.seqlen_k = lengths.y;
  if (HAS_MASK) bwd.in.mask += k0 * bwd.in.mask_stride[3];
  if (HAS_BIAS) bwd.in.bias += k0 * bwd.in.bias_stride[3];
  if (HAS_DBIAS) bwd.dbias += k0 * bwd.dbias_stride[3];
  bwd.lse += q0 * bwd.lse_stride[2];
  bwd.delta += q0 * bwd.delta_stride[2];
  bwd.dk += k0 * bwd.dk_stride[1];
  bwd.dv += k0 * bwd.dv_stride[1];
  const Inputs& in = bwd.in;
#if BWD_KV_GROUP
  HeadSlices at = head_slices(in, order.slice % (in.num_heads / in.group) * in.group);  // the group's first head
#else
  const HeadSlices at = head_slices(in, order.slice % in.num_heads);  // batch 0
#endif
#else
  const BwdParams& bwd = p.bwd;
  const Inputs& in = bwd.in;
  const SectionOrder order = section_order(p.section_slices);  // key blocks in order within a section
#if BWD_KV_GROUP
  const int kv_heads = in.num_heads / in.group;  // slice = batch x Hkv + KV head; at: its group's first head
  HeadSlices at = head_slices(in, order.slice / kv_heads * in.num_heads + order.slice % kv_heads * in.group);
#else
  const HeadSlices at = head_slices(in, order.slice);
#endif
#endif
#if BWD_KV_GROUP
  ScoreRule rule = score_rule(in, at);  // the consumers' follows the head
#else
  const ScoreRule rule = score_rule(in, at);
#endif
  const int n_block = order.block;
  const int m_tiles = (in.seqlen_q + BLOCK_M - 1) / BLOCK_M;
  // causal: the query tiles before m_begin see no key of this block
#if HAS_WINDOW
  // a window: the block's keys are seen by rows [n_block BLOCK_N - offset - right, its last key
  // - offset + left] (the right side 0 under the causal rule), its query tiles [m_begin, m_end)
  const int right_reach = IS_CAUSAL ? 0 : in.window_right;
  const int m_begin = max(0, n_block * BLOCK_N - rule.offset - right_reach) / BLOCK_M;
  const int m_end = (min(in.seqlen_q, max(0, (n_block + 1) * BLOCK_N - rule.offset + in.window_left)) + BLOCK_M - 1) /
                    BLOCK_M;
#if BWD_KV_GROUP
  const int head_steps = max(0, m_end - m_begin), steps = in.group * head_steps;
  auto tile_at = [&](int step) { return m_end - 1 - (HEADS_INNER ? step / in.group : step % head_steps); };
#else
  const int steps = max(0, m_end - m_begin);
  auto tile_at = [&](int step) { return m_end - 1 - step; };
#endif
  // the first key block that visits tile m: the one holding its first row's first key
  auto first_block = [&](int m) { return max(0, m * BLOCK_M + rule.offset - in.window_left) / BLOCK_N; };
#else
  const int m_begin = IS_CAUSAL ? max(0, n_block * BLOCK_N - rule.offset) / BLOCK_M : 0;
#if BWD_KV_GROUP
  const int head_steps = m_tiles - m_begin, steps = in.group * head_steps;
  auto tile_at = [&](int step) {  // the last tile first
    return m_tiles - 1 - (HEADS_INNER ? step / in.group : step % head_steps);
  };
#else
  const int steps = m_tiles - m_begin;
  auto tile_at = [&](int step) { return m_tiles - 1 - step; };  // the last tile first
#endif
#endif
#if BWD_KV_GROUP
  // the group's query head of step `step` (0 .. group - 1), and whether it is another than the
  // step before's (each role then moves its pointers to it)
  auto head_of = [&](int step) { return HEADS_INNER ? step % in.group : step / head_steps; };
  auto next_head = [&](int step) { return step > 0 && head_of(step) != head_of(step - 1); };
  const int first_head = at.head;
#endif

  if (threadIdx.x == 0) {
    barrier_init(&kv_full, 1);
    for (int slot = 0; slot < STAGES; ++slot) {
      barrier_init(&full[slot], 1 + 32);  // warp 0's copies, warp 1's lanes
      barrier_init(&empty[slot], CONSUMER_THREADS);
    }
    for (int buffer = 0; buffer < DQ_BUFFERS; ++buffer) {
      barrier_init(&dq_full[buffer], CONSUMER_THREADS);
      barrier_init(&dq_empty[buffer], 1);
    }
    for (int slot = 0; slot < SCORE_SLOTS; ++slot) {
      barrier_init(&score_full[slot], 1);
      barrier_init(&score_empty[slot], CONSUMER_THREADS);
    }
    fence_barrier_init();
  }
  __syncthreads();

  if (threadIdx.x < GROUP_WARPS * 32) {
    // -- producer --
    registers_release<PRODUCER_REGISTERS>();
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (warp == 0 && lane == 0) {
      barrier_arrive_expecting(&kv_full, 2 * KV_BYTES);
#if PACKED
      load_tile_tma<BLOCK_N>(k_smem, &p.k_map, k0 + n_block * BLOCK_N, at.kv_head, 0, &kv_full);
      load_tile_tma<BLOCK_N>(v_smem, &p.v_map, k0 + n_block * BLOCK_N, at.kv_head, 0, &kv_full);
#else
      load_tile_tma<BLOCK_N>(k_smem, &p.k_map, n_block * BLOCK_N, at.kv_head, at.batch, &kv_full);
      load_tile_tma<BLOCK_N>(v_smem, &p.v_map, n_block * BLOCK_N, at.kv_head, at.batch, &kv_full);
#endif
      for (int step = 0; step < steps; ++step) {
        const int m = tile_at(step), slot = step % STAGES;
#if BWD_KV_GROUP
        if (next_head(step)) at.head = first_head + head_of(step);
#endif
        if (step >= STAGES) barrier_wait(&empty[slot], (step / STAGES - 1) & 1);
        barrier_arrive_expecting(&full[slot], 2 * Q_BYTES);
#if PACKED
        load_tile_tma<BLOCK_M>(q_smem + slot * BLOCK_M * BLOCK_D, &p.q_map, q0 + m * BLOCK_M, at.head, 0, &full[slot]);
        load_tile_tma<BLOCK_M>(do_smem + slot * BLOCK_M * BLOCK_D, &p.do_map, q0 + m * BLOCK_M, at.head, 0,
                               &full[slot]);
#else
        load_tile_tma<BLOCK_M>(q_smem + slot * BLOCK_M * BLOCK_D, &p.q_map, m * BLOCK_M, at.head, at.batch, &full[slot]);
        load_tile_tma<BLOCK_M>(do_smem + slot * BLOCK_M * BLOCK_D, &p.do_map, m * BLOCK_M, at.head, at.batch,
                               &full[slot]);
#endif
        if (SCORE_TILES) {
          const int score_slot = step % SCORE_SLOTS;
          if (step >= SCORE_SLOTS) barrier_wait(&score_empty[score_slot], (step / SCORE_SLOTS - 1) & 1);
          unsigned char* tile = score_smem + score_slot * SCORE_SLOT_BYTES;
          barrier_arrive_expecting(&score_full[score_slot], SCORE_SLOT_BYTES);
          // a broadcast dim (stride 0) is a size-1 dim of the map: coordinate 0
          if (MASK_SLOT_BYTES)
            tma_load(tile, &p.mask_map, n_block * BLOCK_N, m * BLOCK_M, in.mask_stride[1] ? at.head / in.mask_head_div : 0,
                     in.mask_stride[0] ? at.batch : 0, &score_full[score_slot]);
          if (BIAS_SLOT_BYTES) {
#pragma unroll
            for (int block = 0; block < BLOCK_N / SWIZZLE_COLS; ++block)
              tma_load(tile + MASK_SLOT_BYTES + block * BLOCK_M * SWIZZLE_COLS * int(sizeof(elem_t)), &p.bias_map,
                       n_block * BLOCK_N + block * SWIZZLE_COLS, m * BLOCK_M,
                       in.bias_stride[1] ? at.head / in.bias_head_div : 0, in.bias_stride[0] ? at.batch : 0,
                       &score_full[score_slot]);
          }
        }
      }
    } else if (warp == 1) {
#if BWD_KV_GROUP
      const GradSlices first_grads = grad_slices(bwd, at);
      GradSlices grads = first_grads;
#else
      const GradSlices grads = grad_slices(bwd, at);
#endif
      for (int step = 0; step < steps; ++step) {
        const int m = tile_at(step), slot = step % STAGES;
#if BWD_KV_GROUP
        if (next_head(step)) {
          grads.lse = first_grads.lse + head_of(step) * bwd.lse_stride[1];
          grads.delta = first_grads.delta + head_of(step) * bwd.delta_stride[1];
        }
#endif
        if (step >= STAGES) barrier_wait(&empty[slot], (step / STAGES - 1) & 1);
        for (int r = lane; r < BLOCK_M; r += 32) {
          const int row = m * BLOCK_M + r;
          lse_smem[slot * BLOCK_M + r] = row_lse(grads.lse, bwd.lse_stride[2], row, in.seqlen_q) * LOG2E;
          delta_smem[slot * BLOCK_M + r] = row < in.seqlen_q ? grads.delta[row * bwd.delta_stride[2]] : 0.f;
        }
        barrier_arrive(&full[slot]);
      }
#if HAS_WINDOW
    } else if (DBIAS_TMA && warp == 3) {
#else
    } else if (DBIAS_TMA && IS_CAUSAL && warp == 3) {
#endif
      // the query tiles before m_begin, 16 bytes a lane: each row's BLOCK_N keys in BLOCK_N / 8 lanes
      constexpr int ROW_LANES = BLOCK_N / 8, ROWS_AT_ONCE = 32 / ROW_LANES;
      const int key = n_block * BLOCK_N + lane % ROW_LANES * 8, rows_end = min(m_begin * BLOCK_M, in.seqlen_q);
      if (key < in.seqlen_k) {  // Lk is a multiple of 8 (the target's rows are on 16-byte boundaries)
        dbias_t* column = bwd.dbias + at.batch * bwd.dbias_stride[0] + at.head * bwd.dbias_stride[1] + key;
        for (int row = lane / ROW_LANES; row < rows_end; row += ROWS_AT_ONCE)
          *reinterpret_cast<uint4*>(column + row * bwd.dbias_stride[2]) = make_uint4(0, 0, 0, 0);
#if HAS_WINDOW
        // and those from m_end on, past the window's left side
        for (int row = m_end * BLOCK_M + lane / ROW_LANES; row < in.seqlen_q; row += ROWS_AT_ONCE)
          *reinterpret_cast<uint4*>(column + row * bwd.dbias_stride[2]) = make_uint4(0, 0, 0, 0);
#endif
      }
    } else if (warp == 2 && lane == 0) {
#if PACKED
      const int64_t first_tile = int64_t(at.head) * p.head_tiles + sequence_tile(p, sequence);
      float* sums = p.dq_sum + first_tile * BLOCK_M * BLOCK_D;
      int* counters = p.dq_counter + first_tile;
#elif BWD_KV_GROUP
      const int query_slice = at.batch * in.num_heads + at.head;  // the group's first head
      float* sums = p.dq_sum + int64_t(query_slice) * m_tiles * BLOCK_M * BLOCK_D;
      int* counters = p.dq_counter + query_slice * m_tiles;
#else
      float* sums = p.dq_sum + int64_t(order.slice) * m_tiles * BLOCK_M * BLOCK_D;
      int* counters = p.dq_counter + order.slice * m_tiles;
#endif
#if BWD_KV_GROUP && PACKED
      const int64_t head_tiles = p.head_tiles;  // a query head's sums and counters
#elif BWD_KV_GROUP
      const int64_t head_tiles = m_tiles;
#endif
#if BWD_KV_GROUP
      float* const first_sums = sums;
      int* const first_counters = counters;
#endif
      for (int step = 0; step < steps; ++step) {
        const int m = tile_at(step), buffer = step % DQ_BUFFERS;
#if BWD_KV_GROUP
        if (next_head(step)) {
          sums = first_sums + head_of(step) * head_tiles * BLOCK_M * BLOCK_D;
          counters = first_counters + head_of(step) * head_tiles;
        }
#endif
        barrier_wait(&dq_full[buffer], (step / DQ_BUFFERS) & 1);
#if BWD_DQ_UNORDERED
        float* sum = sums + int64_t(m) * BLOCK_M * BLOCK_D;
        const uint32_t share = shared_address(dq_smem + buffer * BLOCK_M * BLOCK_D);
        asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n"
                     :: "l"(sum), "r"(share), "n"(DQ_SHARE_BYTES) : "memory");
        bulk_commit();
        bulk_wait<0, true>();  // the share is read: its buffer is free
#else
        int added;  // blocks 0 .. n_block - 1 visit tile m too (their m_begin is no later)
        do asm volatile("ld.relaxed.gpu.global.b32 %0, [%1];\n" : "=r"(added) : "l"(counters + m) : "memory");
#if HAS_WINDOW
        while (added != n_block - first_block(m));  // a window: blocks first_block(m) .. n_block - 1 do
#else
        while (added != n_block);
#endif
        asm volatile("fence.acq_rel.gpu;\n" ::: "memory");
        float* sum = sums + int64_t(m) * BLOCK_M * BLOCK_D;
        const uint32_t share = shared_address(dq_smem + buffer * BLOCK_M * BLOCK_D);
#if HAS_WINDOW
        if (n_block == first_block(m))
#else
        if (n_block == 0)
#endif
          asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n"
                       :: "l"(sum), "r"(share), "n"(DQ_SHARE_BYTES) : "memory");
        else
          asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n"
                       :: "l"(sum), "r"(share), "n"(DQ_SHARE_BYTES) : "memory");
        bulk_commit();
        bulk_wait<0, false>();  // in global memory: the next block's turn
        asm volatile("red.release.gpu.global.add.s32 [%0], 1;\n" :: "l"(counters + m) : "memory");
#endif
        barrier_arrive(&dq_empty[buffer]);
      }
    }
    return;
  }

  // -- consumers --
  registers_claim<CONSUMER_REGISTERS>();
#if DKV_TRANSPOSED
  transposed_consumer(bwd, at, rule, n_block, steps, tile_at, k_smem, v_smem, q_smem, do_smem, ds_smem, pt_smem,
                      dq_smem, lse_smem, delta_smem, &kv_full, full, empty, dq_full, dq_empty);
#else
  const int warp = threadIdx.x / 32 - GROUP_WARPS, lane = threadIdx.x % 32;  // warp among the consumers
  const int g = lane / 4, t = lane % 4;
  const int group = warp / GROUP_WARPS, group_key0 = group * GROUP_ROWS;  // the consumer's keys in the block
  const int group_first_key = n_block * BLOCK_N + group_key0;
  const int warp_key0 = group_key0 + (warp % GROUP_WARPS) * 16;  // the warp's 16 keys in the block
  const int key0 = n_block * BLOCK_N + warp_key0 + g;  // this thread's keys: key0, key0 + 8
  const float scale_log2 = in.softmax_scale * LOG2E;
  float dk_acc[BLOCK_D / 8][4] = {}, dv_acc[BLOCK_D / 8][4] = {};
  float dbias_sum[2] = {0.f, 0.f};  // per key, summed over every query (HAS_DBIAS, !DBIAS_ROWS)
  dbias_t* dbias = HAS_DBIAS ? bwd.dbias + at.batch * bwd.dbias_stride[0] + at.head * bwd.dbias_stride[1] : nullptr;
  // a mask or bias of one row of keys (TILES 2): this thread's two keys' values, read once
  bool key_kept[2] = {true, true};
  float key_bias[2] = {0.f, 0.f};
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int key = key0 + 8 * r;
    if (key < in.seqlen_k) {
      if (HAS_MASK && MASK_TILES == 2) key_kept[r] = rule.mask[key * rule.mask_col] != 0;
      if (HAS_BIAS && BIAS_TILES == 2) key_bias[r] = static_cast<float>(rule.bias[key * rule.bias_col]);
    }
  }
  const bool stores_dbias = DBIAS_TMA && warp == 0 && lane == 0;  // the thread that stores dS tiles as dBias
#if BWD_KV_GROUP
  // query head `head` of the group next: the finished head's per-key dBias sums stored (heads
  // in turn: the kernel's end stores the last head's), its rule, key values and dBias row. (The
  // kernel's end and the reads above, written again here: shared, they would change every other
  // variant's specialised source, and so every shipped table entry's stamp.)
  dbias_t* const first_dbias = dbias;
  auto start_head = [&](int head) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int key = key0 + r * 8;
      if (HAS_DBIAS && !DBIAS_ROWS) {
        dbias_sum[r] += __shfl_xor_sync(0xffffffff, dbias_sum[r], 1);
        dbias_sum[r] += __shfl_xor_sync(0xffffffff, dbias_sum[r], 2);
        if (t == 0 && key < in.seqlen_k) dbias[key * bwd.dbias_stride[3]] = static_cast<dbias_t>(dbias_sum[r]);
        dbias_sum[r] = 0.f;
      }
    }
    at.head = first_head + head;
    rule = score_rule(in, at);
    if (HAS_DBIAS) dbias = first_dbias + head * bwd.dbias_stride[1];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int key = key0 + 8 * r;
      if (key < in.seqlen_k) {
        if (HAS_MASK && MASK_TILES == 2) key_kept[r] = rule.mask[key * rule.mask_col] != 0;
        if (HAS_BIAS && BIAS_TILES == 2) key_bias[r] = static_cast<float>(rule.bias[key * rule.bias_col]);
      }
    }
  };
#endif
  barrier_wait(&kv_full, 0);
#if PACKED
  if (n_block * BLOCK_N + BLOCK_N > in.seqlen_k) {  // the sequence's last block: the rows past its keys
    const int key_rows = in.seqlen_k - n_block * BLOCK_N, thread = threadIdx.x - GROUP_WARPS * 32;
    clear_rows<BLOCK_N>(k_smem, key_rows, thread, CONSUMER_THREADS);
    clear_rows<BLOCK_N>(v_smem, key_rows, thread, CONSUMER_THREADS);
    fence_async_shared();
    consumers_sync();
  }
#endif

  for (int step = 0; step < steps; ++step) {
    const int m = tile_at(step), slot = step % STAGES;
#if BWD_KV_GROUP
    if (next_head(step)) start_head(head_of(step));
#endif
    barrier_wait(&full[slot], (step / STAGES) & 1);
#if PACKED
    if ((m + 1) * BLOCK_M > in.seqlen_q) {  // the sequence's last query tile: the rows past its end
      const int rows = in.seqlen_q - m * BLOCK_M, thread = threadIdx.x - GROUP_WARPS * 32;
      clear_rows<BLOCK_M>(q_smem + slot * BLOCK_M * BLOCK_D, rows, thread, CONSUMER_THREADS);
      clear_rows<BLOCK_M>(do_smem + slot * BLOCK_M * BLOCK_D, rows, thread, CONSUMER_THREADS);
      fence_async_shared();
      consumers_sync();
    }
#endif
    const elem_t* q_tile = q_smem + slot * BLOCK_M * BLOCK_D;
    const elem_t* do_tile = do_smem + slot * BLOCK_M * BLOCK_D;
    const float* lse_tile = lse_smem + slot * BLOCK_M;
    const float* delta_tile = delta_smem + slot * BLOCK_M;
    const int score_slot = step % SCORE_SLOTS;
    const unsigned char* mask_tile = score_smem + score_slot * SCORE_SLOT_BYTES;
    const elem_t* bias_tile = reinterpret_cast<const elem_t*>(mask_tile + MASK_SLOT_BYTES);
    auto take_scores = [&] {
      if (SCORE_TILES) barrier_wait(&score_full[score_slot], (step / SCORE_SLOTS) & 1);
    };
    auto release_scores = [&] {  // the producer may refill the slot
      if (SCORE_TILES) barrier_arrive(&score_empty[score_slot]);
    };

    // Bounds and causal are tested only where some query of the tile misses some key of this
    // consumer; a mask in global memory at every position.
    const int first_row = m * BLOCK_M;
    const bool boundary = first_row + BLOCK_M > in.seqlen_q || group_first_key + GROUP_ROWS > in.seqlen_k ||
                          (IS_CAUSAL && group_first_key + GROUP_ROWS - 1 > first_row + rule.offset)
#if HAS_WINDOW
                          // the window's sides: the tile's last row misses the consumer's first
                          // key, or its first row the consumer's last
                          || group_first_key < first_row + BLOCK_M - 1 + rule.offset - in.window_left ||
                          group_first_key + GROUP_ROWS - 1 > first_row + rule.offset + right_reach
#endif
        ;
    const bool check = (HAS_MASK && MASK_TILES == 0) || boundary;
    // Fragment (n, c) of S^T is key key0 + 8 (c / 2), query row first_row + 8 n + 2 t + c % 2.
    auto row_of = [&](int n, int c) { return first_row + n * 8 + 2 * t + c % 2; };
    auto key_of = [&](int c) { return key0 + (c / 2) * 8; };
    // With the mask staged or in registers the test reads every byte unconditionally (& and not
    // &&): a short-circuited shared load made each position a branch of its own, and the 32 of a
    // step ran one after another.
    auto visible = [&](int n, int c) {
      const int row = row_of(n, c), key = key_of(c);
      bool allowed = !check || (MASK_TILES == 0 ? rule.visible(row, key) : rule.reached(row, key));
      if (HAS_MASK && MASK_TILES == 1)
        allowed &= mask_tile[StagedScores::offset<BLOCK_M, MASK_LINE>(8 * n, 2 * t + c % 2,
                                                                       warp_key0 + g + 8 * (c / 2))] != 0;
      if (HAS_MASK && MASK_TILES == 2) allowed &= key_kept[c / 2];
      return allowed;
    };
    // A staged bias of n8 tiles n2 and n2 + 1 as S^T's fragments: matrix i of the ldmatrix is
    // query rows 8 (n2 + i / 2) .. + 7 at keys warp_key0 + 8 (i % 2) .. + 7, transposed, so
    // pairs[2 h + c / 2] holds (n2 + h, c) and (n2 + h, c + 1).
    auto staged_bias = [&](uint32_t (&pairs)[4], int n2) {
      if (HAS_BIAS && BIAS_TILES == 1) {
        const int i = lane / 8;
        ldmatrix_x4_trans(pairs, bias_tile + swizzled(8 * (n2 + i / 2) + lane % 8, warp_key0 + 8 * (i % 2), BLOCK_M));
      }
    };
    // capped + the bias at a visible position (elsewhere a bias may be NaN or outside the operand;
    // staged or in registers it is read anyway, and the select after the exp drops it)
    auto biased = [&](float capped, int n, int c, const uint32_t (&pairs)[4]) {
      if (!HAS_BIAS) return capped;
      if (BIAS_TILES == 1) {
        const float2 pair = unpack2(pairs[2 * (n % 2) + c / 2]);
        return capped + (c % 2 ? pair.y : pair.x);
      }
      if (BIAS_TILES == 2) return capped + key_bias[c / 2];
      return rule.score(capped, row_of(n, c), key_of(c));
    };
    // dBias of one position (flash_bwd.cu's rule: stored, or summed per key; DBIAS_TMA: below)
    auto add_dbias = [&](float value, int n, int c) {
      const int row = row_of(n, c), key = key_of(c);
      if (HAS_DBIAS && DBIAS_ROWS && !DBIAS_TMA && row < in.seqlen_q && key < in.seqlen_k)
        dbias[row * bwd.dbias_stride[2] + key * bwd.dbias_stride[3]] = static_cast<dbias_t>(value);
      if (HAS_DBIAS && !DBIAS_ROWS) dbias_sum[c / 2] += value;
    };

    // causal: no query of the tile sees a key of this consumer (the block's first tile, for all
    // but its first consumer): its dS is 0, and of its products only dQ's, which reads every
    // consumer's dS, runs
    const bool hidden = IS_CAUSAL && group_first_key > first_row + BLOCK_M - 1 + rule.offset
#if HAS_WINDOW
                        // or the consumer's keys lie before the tile's first row's window, or
                        // (not causal) after its last row's
                        || group_first_key + GROUP_ROWS - 1 < first_row + rule.offset - in.window_left ||
                        group_first_key > first_row + BLOCK_M - 1 + rule.offset + right_reach
#endif
        ;
    float s[BLOCK_M / 8][4], dp[BLOCK_M / 8][4];  // the first k-step overwrites (scale-d 0)
    uint32_t p_frag[BLOCK_M / 16][4], ds_frag[BLOCK_M / 16][4];
    if (hidden) {
      take_scores();
      release_scores();
#pragma unroll
      for (int kk = 0; kk < BLOCK_M / 16; ++kk) ds_frag[kk][0] = ds_frag[kk][1] = ds_frag[kk][2] = ds_frag[kk][3] = 0;
    } else if constexpr (!HAS_SOFTCAP) {
      wgmma_fence();
      wgmma_abt(s, k_smem, BLOCK_N, group_key0, q_tile);
      wgmma_commit();
      wgmma_abt(dp, v_smem, BLOCK_N, group_key0, do_tile);
      wgmma_commit();
      take_scores();
      wgmma_wait<1>();  // S^T is in; dP^T runs on
      touch(s);
#pragma unroll
      for (int n2 = 0; n2 < BLOCK_M / 8; n2 += 2) {
        uint32_t bias_pairs[4];
        staged_bias(bias_pairs, n2);
#pragma unroll
        for (int n = n2; n < n2 + 2; ++n) {
          const float2 lse = *reinterpret_cast<const float2*>(lse_tile + 8 * n + 2 * t);  // rows of c % 2 = 0, 1
#pragma unroll
          for (int c = 0; c < 4; ++c) {
            const bool allowed = visible(n, c);
            float prob = 0.f;
            if (SCORES_AT_HAND || allowed) {
              const float x = HAS_BIAS ? biased(s[n][c] * in.softmax_scale, n, c, bias_pairs) * LOG2E : s[n][c] * scale_log2;
              prob = exp2_ftz(x - (c % 2 ? lse.y : lse.x));
            }
            s[n][c] = allowed ? prob : 0.f;
          }
        }
      }
      release_scores();
#pragma unroll
      for (int kk = 0; kk < BLOCK_M / 16; ++kk) accumulator_to_a(p_frag[kk], s, kk);
      touch(dv_acc);  // its zero-fill stays before the fence (PTX: no register writes after it)
      wgmma_fence();
      wgmma_ab(dv_acc, p_frag, do_tile);
      wgmma_commit();
      wgmma_wait<1>();  // dP^T is in; dV's product runs on
      touch(dp);
#pragma unroll
      for (int n = 0; n < BLOCK_M / 8; ++n) {
        const float2 delta = *reinterpret_cast<const float2*>(delta_tile + 8 * n + 2 * t);
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          dp[n][c] = s[n][c] * (dp[n][c] - (c % 2 ? delta.y : delta.x));
          add_dbias(dp[n][c], n, c);
        }
      }
#pragma unroll
      for (int kk = 0; kk < BLOCK_M / 16; ++kk) accumulator_to_a(ds_frag[kk], dp, kk);
      touch(dk_acc);
      wgmma_fence();
      wgmma_ab(dk_acc, ds_frag, q_tile);
      wgmma_commit();
    } else {  // dS needs the capped score beside P: both products first
      wgmma_fence();
      wgmma_abt(s, k_smem, BLOCK_N, group_key0, q_tile);
      wgmma_abt(dp, v_smem, BLOCK_N, group_key0, do_tile);
      wgmma_commit();
      take_scores();
      wgmma_wait<0>();
      touch(s);
      touch(dp);
#pragma unroll
      for (int n2 = 0; n2 < BLOCK_M / 8; n2 += 2) {
        uint32_t bias_pairs[4];
        staged_bias(bias_pairs, n2);
#pragma unroll
        for (int n = n2; n < n2 + 2; ++n) {
          const float2 lse = *reinterpret_cast<const float2*>(lse_tile + 8 * n + 2 * t);
          const float2 delta = *reinterpret_cast<const float2*>(delta_tile + 8 * n + 2 * t);
#pragma unroll
          for (int c = 0; c < 4; ++c) {
            const bool allowed = visible(n, c);
            float prob = 0.f, dbias_value = 0.f, ds = 0.f;
            if (SCORES_AT_HAND || allowed) {
              const float capped = rule.capped(s[n][c]), tanh_value = capped / rule.softcap;
              prob = exp2_ftz(biased(capped, n, c, bias_pairs) * LOG2E - (c % 2 ? lse.y : lse.x));
              prob = allowed ? prob : 0.f;
              dbias_value = prob * (dp[n][c] - (c % 2 ? delta.y : delta.x));
              ds = dbias_value * (1.f - tanh_value * tanh_value);
            }
            s[n][c] = prob;
            dp[n][c] = ds;
            add_dbias(dbias_value, n, c);
          }
        }
      }
      release_scores();
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
    }

    // dS^T -> dS in shared memory: each 8 x 8 block of a fragment as 8 query rows of 8 keys
    elem_t* ds_tile = ds_smem + (step % 2) * BLOCK_M * BLOCK_N;
    {
      const int block = lane / 8, key = group_key0 + (warp % GROUP_WARPS) * 16 + (block % 2) * 8;
#pragma unroll
      for (int kk = 0; kk < BLOCK_M / 16; ++kk)
        stmatrix_x4_trans(ds_frag[kk], ds_tile + swizzled(kk * 16 + (block / 2) * 8 + lane % 8, key, BLOCK_M));
    }
    fence_async_shared();
    if (stores_dbias) bulk_wait<0, true>();  // the last tile's store has read its dS: the other buffer is free
    consumers_sync();  // every consumer's dS is in
    if (stores_dbias) {  // the tile's dBias: its dS as staged, a box per 64 keys
#pragma unroll
      for (int block = 0; block < BLOCK_N / SWIZZLE_COLS; ++block)
        tma_store(&p.dbias_map, ds_tile + block * BLOCK_M * SWIZZLE_COLS, n_block * BLOCK_N + block * SWIZZLE_COLS,
                  first_row, at.head, at.batch);
      bulk_commit();
    }
    float dq[DQ_COLS / 8][4];
    wgmma_fence();
    wgmma_ab_ss<DQ_COLS / 8, BLOCK_N / 16>(dq, ds_tile, k_smem + group * (DQ_COLS / SWIZZLE_COLS) * BLOCK_N * SWIZZLE_COLS);
    wgmma_commit();
    wgmma_wait<0>();
    touch(dv_acc);
    touch(dk_acc);
    touch(dq);
    barrier_arrive(&empty[slot]);  // Q, dO, lse and delta of the slot are read

    const int buffer = step % DQ_BUFFERS;
    if (step >= DQ_BUFFERS) barrier_wait(&dq_empty[buffer], (step / DQ_BUFFERS - 1) & 1);  // warp 2 has added it
    float2* share = reinterpret_cast<float2*>(dq_smem + buffer * BLOCK_M * BLOCK_D) + warp * 32 + lane;
#pragma unroll
    for (int d = 0; d < DQ_COLS / 8; ++d)
#pragma unroll
      for (int r = 0; r < 2; ++r) share[(2 * d + r) * CONSUMER_THREADS] = make_float2(dq[d][2 * r], dq[d][2 * r + 1]);
    fence_async_shared();
    barrier_arrive(&dq_full[buffer]);
  }

  if (stores_dbias) bulk_wait<0, false>();  // no store reads shared memory past the block's end
#if BWD_KV_GROUP
  if (HAS_DBIAS && !DBIAS_ROWS && steps == 0)  // no query tile sees the block: every head's sums are 0
    for (int head = 1; head < in.group; ++head) start_head(head);  // the last head's are stored below
#endif
  // Every key of the block is written, also one that no query sees (its gradients are 0).
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int key = key0 + r * 8;
    if (HAS_DBIAS && !DBIAS_ROWS) {
      dbias_sum[r] += __shfl_xor_sync(0xffffffff, dbias_sum[r], 1);
      dbias_sum[r] += __shfl_xor_sync(0xffffffff, dbias_sum[r], 2);
      if (t == 0 && key < in.seqlen_k) dbias[key * bwd.dbias_stride[3]] = static_cast<dbias_t>(dbias_sum[r]);
    }
    if (key >= in.seqlen_k) continue;
    const int dkv_head = DKV_FP32 ? at.head : at.kv_head;
    dkv_t* dk = bwd.dk + at.batch * bwd.dk_stride[0] + key * bwd.dk_stride[1] + dkv_head * bwd.dk_stride[2];
    dkv_t* dv = bwd.dv + at.batch * bwd.dv_stride[0] + key * bwd.dv_stride[1] + dkv_head * bwd.dv_stride[2];
#pragma unroll
    for (int d = 0; d < BLOCK_D / 8; ++d) {
      const int col = d * 8 + 2 * t;
      if (col < HEAD_DIM) {
        store_pair(dk + col, dk_acc[d][2 * r] * in.softmax_scale, dk_acc[d][2 * r + 1] * in.softmax_scale);
        store_pair(dv + col, dv_acc[d][2 * r], dv_acc[d][2 * r + 1]);
      }
    }
  }
#endif
}

// delta (bwd_steps.cuh), and the counters of the query tiles starting in the CTA's rows zeroed
// for the kernel above.
extern "C" __global__ void __launch_bounds__(THREADS) dmattn_bwd_ws_delta_kernel(const __grid_constant__ BwdWsParams p) {
  store_deltas(p.bwd);
#if !PACKED  // a packed call's counters and sums are per sequence's tile: the launcher zeroes them
  const int seqlen_q = p.bwd.in.seqlen_q, m_tiles = (seqlen_q + BLOCK_M - 1) / BLOCK_M;
  const int first = blockIdx.x * DELTA_ROWS_PER_BLOCK, end = min(first + DELTA_ROWS_PER_BLOCK, seqlen_q);
#if BWD_DQ_UNORDERED
  // the sums of the query tiles whose first row is among this CTA's rows
  const int first_tile = (first + BLOCK_M - 1) / BLOCK_M, end_tile = (end + BLOCK_M - 1) / BLOCK_M;
  constexpr int TILE_CHUNKS = BLOCK_M * BLOCK_D / 4;  // a tile's sum in float4s
  float4* sums = reinterpret_cast<float4*>(p.dq_sum + (int64_t(blockIdx.y) * m_tiles + first_tile) * BLOCK_M * BLOCK_D);
  for (int chunk = threadIdx.x; chunk < (end_tile - first_tile) * TILE_CHUNKS; chunk += THREADS)
    sums[chunk] = make_float4(0.f, 0.f, 0.f, 0.f);
#else
  const int m = (first + BLOCK_M - 1) / BLOCK_M + threadIdx.x;
  if (m * BLOCK_M < end) p.dq_counter[blockIdx.y * m_tiles + m] = 0;
#endif
#endif
}

// dQ = softmax_scale x the summed shares, in the input dtype: a thread per two columns of
// DQ_ROWS rows (fewer rows a thread, and its index math outweighed its 8-byte loads: H200, W3,
// 45 us for one row; `python -m benchmarks cuda-bwd-ws-check time`). `backward.DQ_CAST_ROWS` mirrors the count.
constexpr int DQ_ROWS = 4;
static_assert(8 % DQ_ROWS == 0, "a thread's rows share a tile and its r");

extern "C" __global__ void __launch_bounds__(THREADS) dmattn_bwd_ws_dq_kernel(const __grid_constant__ BwdWsParams p) {
  const BwdParams& bwd = p.bwd;
  const int pair = blockIdx.x * THREADS + threadIdx.x, row0 = pair / (BLOCK_D / 2) * DQ_ROWS;
  const int col = pair % (BLOCK_D / 2) * 2;
#if PACKED
  // slice = sequence x H + head: the sequence's rows from its first, in the one batch row
  const int slice = blockIdx.y, sequence = slice / bwd.in.num_heads, head = slice % bwd.in.num_heads;
  const int2 lengths = sequence_lengths(p, sequence);
  const int seqlen_q = lengths.x;
  if (row0 >= seqlen_q || col >= HEAD_DIM) return;
  elem_t* dq = bwd.dq + (p.cu_seqlens_q[sequence] + row0) * bwd.dq_stride[1] + head * bwd.dq_stride[2] + col;
  // the tiles no key block visits (the sequence has no key, or causal rows before its first
  // key's row: `backward.unvisited_query_tiles`) hold no sum: their rows' dQ is 0
  const int m_tiles = (seqlen_q + BLOCK_M - 1) / BLOCK_M;
  int unvisited = lengths.y == 0 ? m_tiles : IS_CAUSAL ? max(0, seqlen_q - lengths.y) / BLOCK_M : 0;
#if HAS_WINDOW
  if (!IS_CAUSAL && lengths.y > 0) unvisited = max(0, seqlen_q - lengths.y - bwd.in.window_right) / BLOCK_M;
#endif
  if (row0 / BLOCK_M < unvisited) {
#pragma unroll
    for (int r = 0; r < DQ_ROWS; ++r)
      if (row0 + r < seqlen_q) store_pair(dq + r * bwd.dq_stride[1], 0.f, 0.f);
    return;
  }
  const float2* tile = reinterpret_cast<const float2*>(
      p.dq_sum + (int64_t(head) * p.head_tiles + sequence_tile(p, sequence) + row0 / BLOCK_M) * BLOCK_M * BLOCK_D);
#else
  if (row0 >= bwd.in.seqlen_q || col >= HEAD_DIM) return;
  const int slice = blockIdx.y, batch = slice / bwd.in.num_heads, head = slice % bwd.in.num_heads;
  const int m_tiles = (bwd.in.seqlen_q + BLOCK_M - 1) / BLOCK_M;
  const float2* tile = reinterpret_cast<const float2*>(p.dq_sum + (int64_t(slice) * m_tiles + row0 / BLOCK_M) *
                                                                     BLOCK_M * BLOCK_D);
#endif
  // the share's fragment order (the kernel above): warp w4 of consumer `group` holds rows
  // 16 w4 + g + 8 r, columns group x DQ_COLS + 8 d + 2 t (DQ_ROWS divides 8: one tile, one r)
  const int group = col / DQ_COLS, d = col % DQ_COLS / 8, t = col % 8 / 2, tile_row0 = row0 % BLOCK_M;
  const float2* sums = tile + (2 * d + tile_row0 % 16 / 8) * CONSUMER_THREADS +
                       (group * GROUP_WARPS + tile_row0 / 16) * 32 + tile_row0 % 8 * 4 + t;
  float2 sum[DQ_ROWS];
#pragma unroll
  for (int r = 0; r < DQ_ROWS; ++r) sum[r] = sums[4 * r];  // rows g, g + 1, ...: lanes 4 apart
#if PACKED
#pragma unroll
  for (int r = 0; r < DQ_ROWS; ++r)
    if (row0 + r < seqlen_q)
      store_pair(dq + r * bwd.dq_stride[1], sum[r].x * bwd.in.softmax_scale, sum[r].y * bwd.in.softmax_scale);
#else
  elem_t* dq = bwd.dq + batch * bwd.dq_stride[0] + row0 * bwd.dq_stride[1] + head * bwd.dq_stride[2] + col;
#pragma unroll
  for (int r = 0; r < DQ_ROWS; ++r)
    if (row0 + r < bwd.in.seqlen_q)
      store_pair(dq + r * bwd.dq_stride[1], sum[r].x * bwd.in.softmax_scale, sum[r].y * bwd.in.softmax_scale);
#endif
}
