// Flash dynamic-mask attention, forward, warp-specialized for SM90 (Hopper): FlashAttention-3's
// division of labour. The math is flash_fwd.cu's (fwd_steps.cuh: the score rule, the online
// softmax, the epilogue); what changes is who waits for what.
//
// A CTA owns BLOCK_M = 64 x CONSUMERS query rows of one (batch, head) and has CONSUMERS + 1
// warpgroups:
//   producer (warpgroup 0): one thread issues TMA bulk tensor copies, Q once, then each key
//     tile's K and V into a ring of STAGES slots; a copy completes its bytes on the slot's
//     `k_full` / `v_full` barrier (mbarrier). The warpgroup hands its registers to the
//     consumers (setmaxnreg).
//   consumers (warpgroups 1..CONSUMERS), 64 query rows each. Per key tile j:
//     wait k_full;  S = Q K_j^T (wgmma);
//     wait score_full;  scores (mask and bias from the staged tiles);  arrive score_empty;
//     online softmax in registers;
//     wait v_full;  acc += P V_j (wgmma);  arrive on the slot's `empty` barrier
//   and the producer refills a slot once every consumer thread has arrived on its `empty`.
// Loads run up to STAGES tiles ahead of the products with no CTA-wide barrier, and the
// consumers issue no copies and compute no addresses for K and V. A consumer's two products and
// its softmax run in turn; the two consumers interleave one's softmax with the other's products.
// Waiting for tile j's P V only at tile j + 1's S (the slot released then) and reading a mask
// row's 16 bytes at once for both n8 tiles were slower or no faster (H200, bench W1 and W2,
// 128x128 w12 s2, each variant against this kernel in one `ws_probe.py --suite none` call: W1
// 0.381 and 0.388 against 0.377 ms, W2 0.383 and 0.373 against 0.367), and so was an L2
// prefetch of the next tile's mask and bias by the producer (W1 0.414 against 0.377).
//
// FWD_OVERLAP (launch: FwdConfig.overlap = 1) compiles FlashAttention-3's intra-warpgroup
// overlap instead. K's slot is refilled once every consumer thread has arrived on its `k_empty`
// (S taken), V's on its `v_empty` (P V taken). Per key tile j a consumer does:
//     wait k_full[j], v_full[j-1];  issue S_j = Q K_j^T and acc += P_{j-1} V_{j-1} (wgmma);
//     wait for S_j;  arrive k_empty;  scores (mask and bias from the staged tiles);  softmax;
//     wait for P_{j-1} V_{j-1};  arrive v_empty;  rescale acc;  P_j to registers
//   so tile j's scores and softmax run while the tensor cores multiply tile j - 1's P V. With
//   two consumers they also take turns issuing (FlashAttention-3's ping-pong, named barriers),
//   so one's products run during the other's softmax. Where scores are plain scaled dots (no
//   bias, no softcap) the scale moves into the exp's FFMA, and a row's max and sum reduce as
//   trees (fwd_steps.cuh). The CTA walks work items (a block of query rows of one head slice):
//   its own, one per CTA, or with FWD_PERSISTENT its list of a schedule.
// H200, bf16 B2 H16 L4096 D128 causal, 128x128 w12 s2, forward alone (`fwd_variants_probe.py`):
// the one-tile-at-a-time consumer took 0.291 ms dense, 0.379 with a kv-head mask and a per-key
// bias (GQA 4), 0.371 with a full mask and bias; the overlapped one, in a kernel of one item
// per CTA without the items' hand-over, 0.262, 0.347 and 0.378 (the full mask and bias tiles
// fill one ring slot, whose next load the tighter loop waits for). Three consumers taking turns
// in a ring were no faster (192x64 w16 s2: 0.302 against 0.287 dense).
// What it took for ptxas to keep the overlap: every barrier wait before the fence (a wait between
// fence and wgmma serialized each k-step), K and V released apart (the V slot frees a tile
// later than K's), and the wait for P V in both branches of a vote on the row sums (with one
// wait after the softmax, ptxas scheduled the wait first and the softmax after the product).
//
// FWD_PERSISTENT (FwdConfig.persistent = 1, with overlap): a CTA per SM walks its list of work
// items (forward.persistent_schedule: launch order, each item to the CTA free first, as the block
// scheduler would hand them out); the producer hands each item's index to the consumers through
// shared memory (item_full / item_empty), and loads the next item's Q once the consumers' last
// S of the item before has landed (q_empty), so it and the next item's first tiles load while
// the consumers finish the last P V and store the rows. H200, 128x128 w12 s2, a CTA per item
// (FWD_OVERLAP alone) against persistent in one call: dense 0.262 -> 0.254 ms, kv-head mask
// 0.361 -> 0.356, full mask and bias 0.378 -> 0.371.
//
// Mask and bias (MASK_TILES, BIAS_TILES): an operand with keys contiguous (a mask, a 16-bit bias)
// is staged too, in a ring of SCORE_STAGES slots (one or two: what fits beside the K and V rings;
// variants.py picks), released as soon as the scores are taken, before the softmax. A slot holds
// the BLOCK_M x BLOCK_N tile of an operand with a row per query (TILES 1), or the one row of
// BLOCK_N keys of an operand without a query dim (TILES 2: a padding mask, a per-key bias).
// Other layouts (an fp32 bias, a mask with strides TMA cannot take) are read from global
// memory as flash_fwd.cu reads them (TILES 0).
//
// Causal: the producer loads the tiles the CTA's last row reaches; a consumer whose 64 rows see
// none of a tile skips its products but still waits for it and arrives, so every `empty` phase
// counts exactly one arrival per consumer thread (and, overlapped, still takes its turns).
//
// Layouts: TMA writes each 64-column block of a tile as rows of 128 bytes in the 128-byte
// swizzle, the layout sm90.cuh's descriptors read. Rows past Lq or Lk and columns past HEAD_DIM
// are outside the tensor maps and arrive as zeros, never read from memory. The maps
// (`dmattn_kernels.cuda.forward`, per call) describe q as (D, Lq, H, B) and k, v as
// (D, Lk, Hkv, B), fastest dim first, with boxes of 64 columns by BLOCK_M or BLOCK_N rows.
//
// Sliding window (HAS_WINDOW, overlapped): an item walks the key tiles
// [first, first + n_tiles) its rows' windows reach, the producer loading them in that order; a
// consumer counts them from 0 as without a window and tests positions in the window's edge tiles.
//
// Packed sequences (PACKED, overlapped): the items' head slices are sequences x heads over the
// longest sequence's query blocks, in one batch row. An item takes its sequence's lengths (cut to
// max_seqlen) and causal offset, loads Q, K, V and a per-key mask and bias by TMA from the
// sequence's first row and key, and stores the sequence's rows. The host cannot know which blocks
// lie past their sequence's rows (the lengths are on the device): with a CTA per item such a CTA
// returns at once; persistent, the producers take items in launch order from a counter the host
// zeroes (`item_counter`, so the CTA free first takes the next, as the block scheduler would) and
// skip those items while the consumers still work. A box may read rows past the sequence's last key (the
// next sequence's): the score rule excludes those keys (a select, so NaN there never reaches P),
// and each consumer warpgroup zeroes those rows of the V tile in shared memory before its P V,
// where 0 x NaN would reach acc.
//
// FWD_TMA_STORE (FwdConfig.tma_store = 1, with overlap, not packed): a consumer writes its rows
// of out into shared memory of its own, laid out as TMA's 128-byte swizzle reads a box of 64
// columns by 64 rows, and one of its threads stores them by the out map (`o_map`), so the rows
// leave the consumer in two instructions a 128-column tile and the bulk engine writes them while
// the consumer goes on to its next item. Rows past Lq and columns past HEAD_DIM lie outside the
// map and are not written. H200, W3's shape (bf16 B2 H16 L4096 D128 causal) at 128x128 w12 s2
// persistent: 0.252 -> 0.240 ms, not causal 0.458 -> 0.423; the stores from registers cost 6-7%
// of the causal forward, 11% at L2048 (results/cuda/h200-fwd-variants-probe.md). A native
// program encodes out's map once and has the driver move it to each call's out
// (`forward.ForwardPlan`).
//
// Compile-time parameters: those of common.cuh (WGMMA = 1), BLOCK_M, BLOCK_N, SCORE_STAGES,
// MASK_TILES and BIAS_TILES; FWD_OVERLAP, FWD_PERSISTENT, FWD_TMA_STORE and PACKED where defined
// (to 1).

#include <cuda.h>  // CUtensorMap

#include "fwd_steps.cuh"

static_assert(WGMMA, "the warp-specialized forward runs its products as wgmma (sm90)");
#if HAS_WINDOW && !FWD_OVERLAP
#error "a window runs in the overlapped forward, whose consumers walk work items"
#endif
#if PACKED && !FWD_OVERLAP
#error "packed sequences run in the overlapped forward, whose consumers walk work items"
#endif
#if FWD_TMA_STORE && (!FWD_OVERLAP || PACKED)
#error "out stored by TMA: the overlapped consumers' epilogue, not packed (a box would write the next sequence's rows)"
#endif
constexpr int CONSUMERS = NUM_WARPS / GROUP_WARPS - 1;  // warpgroup 0 produces
static_assert(CONSUMERS >= 1 && NUM_WARPS % GROUP_WARPS == 0 && BLOCK_M == CONSUMERS * GROUP_ROWS,
              "one producer warpgroup and a consumer warpgroup per 64 query rows");
static_assert(is_wgmma_width(BLOCK_N), "wgmma: no m64nN product for this BLOCK_N");
#if FWD_OVERLAP
// Two consumers take turns issuing their products: consumer c syncs on named barrier 1 + c (its
// own 128 threads and the other's 128 arriving). In a ring of three it was slower (header).
constexpr bool PINGPONG = CONSUMERS == 2;
constexpr int TURN_THREADS = 2 * GROUP_WARPS * 32;
// One thread issues every copy: the producer keeps 40 registers (at 24 its item decoding
// spilled), and each consumer thread claims its share of the rest of the SM's 64K (a multiple
// of 8, at most 240 as FlashAttention-3's consumers).
constexpr int PRODUCER_REGISTERS = 40;
#else
// One thread issues every copy: the producer keeps the fewest registers setmaxnreg allows, and
// each consumer thread claims its share of the rest of the SM's 64K (a multiple of 8, at most
// 240 as FlashAttention-3's consumers).
constexpr int PRODUCER_REGISTERS = 24;
#endif
constexpr int CONSUMER_REGISTERS_LEFT = (65536 - GROUP_WARPS * 32 * PRODUCER_REGISTERS) / (CONSUMERS * GROUP_WARPS * 32) / 8 * 8;
constexpr int CONSUMER_REGISTERS = CONSUMER_REGISTERS_LEFT < 240 ? CONSUMER_REGISTERS_LEFT : 240;
static_assert(!(MASK_TILES || BIAS_TILES) || (SCORE_STAGES >= 1 && (BLOCK_N == 64 || BLOCK_N == 128)),
              "staged mask and bias tiles: a ring slot and 64 or 128 keys (one or two 128-byte lines)");
static_assert(!BIAS_TILES || !BIAS_FP32, "a staged bias is 16-bit");
constexpr bool SCORE_TILES = MASK_TILES || BIAS_TILES;
constexpr int MASK_ROWS = MASK_TILES == 1 ? BLOCK_M : MASK_TILES == 2 ? 1 : 0;  // rows of a staged tile
constexpr int BIAS_ROWS = BIAS_TILES == 1 ? BLOCK_M : BIAS_TILES == 2 ? 1 : 0;
// A mask tile is one box (rows of BLOCK_N bytes); a bias tile of rows is boxes of 128-byte rows,
// one of a single row is one box. A slot holds the mask tile, then the bias tile.
constexpr int BIAS_LINE = 128;
constexpr int BIAS_BOXES = BIAS_ROWS == 1 ? 1 : BLOCK_N * int(sizeof(elem_t)) / BIAS_LINE;
constexpr int round_to_kib(int bytes) { return (bytes + 1023) / 1024 * 1024; }  // TMA's swizzle atoms
constexpr int MASK_SLOT_BYTES = round_to_kib(MASK_ROWS * BLOCK_N);  // shared_memory.score_slot_bytes mirrors these
constexpr int SCORE_SLOT_BYTES = MASK_SLOT_BYTES + round_to_kib(BIAS_ROWS * BLOCK_N * int(sizeof(elem_t)));
// what each full barrier expects
constexpr uint32_t Q_BYTES = BLOCK_M * BLOCK_D * sizeof(elem_t);
constexpr uint32_t KV_BYTES = BLOCK_N * BLOCK_D * sizeof(elem_t);
constexpr uint32_t SCORE_BYTES = (MASK_ROWS + BIAS_ROWS * sizeof(elem_t)) * BLOCK_N;
constexpr int SCORE_SLOTS = SCORE_TILES ? SCORE_STAGES : 1;  // barrier arrays need a size

struct WsParams {  // `dmattn_kernels.cuda.params.WsParams` mirrors it (`PersistentWsParams` with FWD_PERSISTENT)
  CUtensorMap q_map, k_map, v_map, mask_map, bias_map;  // mask_map, bias_map: only where staged
  FwdParams fwd;
  int section_slices;  // the launch order's sections (below)
#if FWD_PERSISTENT
  int item_columns, item_rows;  // the work items: head slices x query blocks
  // A persistent launch's items (`forward.persistent_schedule`): CTA c of G takes items
  // schedule[G + 1 + schedule[c]] .. schedule[G + 1 + schedule[c + 1] - 1], in order. Null: one
  // item per CTA, the CTA's own.
  const int* schedule;
#endif
#if PACKED
  // packed sequences in the one batch row: sequence s owns query rows [cu_seqlens_q[s],
  // cu_seqlens_q[s + 1]) and keys from cu_seqlens_k[s], the first seqused_k[s] of its span
  // (all of it where seqused_k is null), each length cut to [0, max_seqlen]
  const int* cu_seqlens_q;
  const int* cu_seqlens_k;
  const int* seqused_k;
  int max_seqlen_q, max_seqlen_k;
  int* item_counter;  // persistent: the items taken so far (0 at launch)
#endif
#if FWD_TMA_STORE
  alignas(128) CUtensorMap o_map;  // out as q_map describes q: (D, Lq, H, B), boxes of 64 x GROUP_ROWS
#endif
};

#if PACKED
static_assert((!HAS_MASK || MASK_TILES != 1) && (!HAS_BIAS || BIAS_TILES != 1),
              "packed sequences: a mask and bias of one row of keys (per key) only");
#endif

#if FWD_OVERLAP  // the overlapped consumers over work items; below #else, one tile at a time
// One work item: a block of BLOCK_M query rows of one head slice.
struct Item {
  HeadSlices at;
  ScoreRule rule;
  int block_row0, n_tiles;  // its first row; the key tiles its rows reach (under a window, from `first`)
#if HAS_WINDOW
  int first;  // its first key tile: the item walks tiles [first, first + n_tiles)
#endif
#if PACKED
  int q0, k0;  // its sequence's first row and key in the batch row
#endif
};

// Launch order: sections of head slices whose K and V fit L2 (common.cuh), in a section the
// longest causal rows first (flash_fwd.cu), so the items in flight at once walk as many key
// tiles and re-read K and V from L2, not memory. A slice's query blocks adjacent instead
// (sections of one slice) was slower: H100, W3 0.319 against 0.296 ms, W2 0.419 against 0.368.
__device__ __forceinline__ Item item_at(const WsParams& p, int index) {
#if FWD_PERSISTENT
  const SectionOrder order = section_order(index, p.item_columns, p.item_rows, p.section_slices);
#else
  const SectionOrder order = section_order(index, gridDim.x, gridDim.y, p.section_slices);  // the grid is the items
#endif
  Item item;
#if PACKED
  // slice = sequence x H + head; the rule is the sequence's: its lengths and causal offset, its
  // per-key mask and bias from its first key
  const int sequence = order.slice / p.fwd.in.num_heads;
  item.at = head_slices(p.fwd.in, order.slice % p.fwd.in.num_heads);  // batch 0
  item.rule = score_rule(p.fwd.in, item.at);
  item.q0 = p.cu_seqlens_q[sequence];
  item.k0 = p.cu_seqlens_k[sequence];
  const int2 lengths = sequence_lengths(p, sequence);
  item.rule.seqlen_q = lengths.x;
  item.rule.seqlen_k = lengths.y;
  item.rule.offset = lengths.y - lengths.x;
  if (HAS_MASK) item.rule.mask += item.k0 * item.rule.mask_col;
  if (HAS_BIAS) item.rule.bias += item.k0 * item.rule.bias_col;
#else
  item.at = head_slices(p.fwd.in, order.slice);
  item.rule = score_rule(p.fwd.in, item.at);
#endif
#if FWD_PERSISTENT
  item.block_row0 = (p.item_rows - 1 - order.block) * BLOCK_M;
#else
  item.block_row0 = (gridDim.y - 1 - order.block) * BLOCK_M;
#endif
#if HAS_WINDOW
  const KeyTiles tiles = key_tiles<BLOCK_N>(item.rule, item.block_row0 + BLOCK_M, item.block_row0, BLOCK_M);
  item.first = tiles.first;
  item.n_tiles = max(0, tiles.block - tiles.first);
#else
  item.n_tiles = key_tiles<BLOCK_N>(item.rule, item.block_row0 + BLOCK_M, item.block_row0, BLOCK_M).block;
#endif
#if PACKED
  if (item.block_row0 >= item.rule.seqlen_q) item.n_tiles = 0;  // past the sequence's rows: nothing to do
#endif
  return item;
}

#if FWD_TMA_STORE
// A consumer's rows of out in shared memory: BLOCK_D / 64 boxes of GROUP_ROWS rows of 128 bytes,
// each row's 16-byte chunks swizzled as TMA's 128-byte swizzle reads them (chunk ^ row % 8).
constexpr int OUT_SHARE_BYTES = GROUP_ROWS * BLOCK_D * int(sizeof(elem_t));

// out = acc / l of the consumer's rows (from first_row) into its share `out_share`, then stored
// by one thread through o_map;
// lse = m + log l stored by the threads (store_rows' rule: dead rows out 0, lse -inf). The share
// is written again only once the store before has read it (its issuer's bulk group).
__device__ __forceinline__ void store_rows_by_tma(const WsParams& p, const HeadSlices& at,
                                                  const float (&acc)[1][BLOCK_D / 8][4], const float (&row_max)[1][2],
                                                  const float (&row_sum)[1][2], int warp_row0, int first_row, int g,
                                                  int t, unsigned char* out_share, int group) {
  constexpr int GROUP_THREADS = GROUP_WARPS * 32;
  const bool issuer = threadIdx.x % GROUP_THREADS == 0;
  if (issuer) bulk_wait<0, true>();
  named_barrier_sync(5 + group, GROUP_THREADS);  // barriers 1-4: the turns, packed sequences' V tails
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float sum = row_sum[0][r];
    sum += __shfl_xor_sync(0xffffffff, sum, 1);
    sum += __shfl_xor_sync(0xffffffff, sum, 2);
    const int row = warp_row0 + r * 8 + g, share_row = row - first_row;
    const bool dead = sum == 0.f;
    const float inverse = dead ? 0.f : 1.f / sum;
#pragma unroll
    for (int d = 0; d < BLOCK_D / 8; ++d)  // columns 8 d + 2 t, + 1: chunk d % 8 of box d / 8
      *reinterpret_cast<elem2_t*>(out_share + (d / 8) * GROUP_ROWS * 128 + share_row * 128 +
                                  (((d % 8) ^ (share_row % 8)) << 4) + 4 * t) =
          pack2(acc[0][d][2 * r] * inverse, acc[0][d][2 * r + 1] * inverse);
    if (t == 0 && row < p.fwd.in.seqlen_q)
      p.fwd.lse[at.batch * p.fwd.lse_stride[0] + at.head * p.fwd.lse_stride[1] + row * p.fwd.lse_stride[2]] =
          dead ? -INFINITY : row_max[0][r] * (SCALE_IN_EXP ? p.fwd.in.softmax_scale : 1.f) + logf(sum);
  }
  fence_async_shared();
  named_barrier_sync(5 + group, GROUP_THREADS);
  if (issuer) {
#pragma unroll
    for (int box = 0; box < BLOCK_D / 64; ++box)
      tma_store(&p.o_map, out_share + box * GROUP_ROWS * 128, box * 64, first_row, at.head, at.batch);
    bulk_commit();
  }
}
#endif

extern "C" __global__ void __launch_bounds__(THREADS, 1) dmattn_fwd_ws_kernel(const __grid_constant__ WsParams p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __shared__ __align__(8) uint64_t q_full, q_empty, k_full[STAGES], v_full[STAGES], k_empty[STAGES], v_empty[STAGES];
  __shared__ __align__(8) uint64_t score_full[SCORE_SLOTS], score_empty[SCORE_SLOTS];
  __shared__ __align__(8) uint64_t item_full[2], item_empty[2];
  __shared__ int item_index[2];  // the producer's hand-over of the items it takes
  elem_t* q_smem = shared_tiles(smem_raw);
  elem_t* k_smem = q_smem + BLOCK_M * BLOCK_D;
  elem_t* v_smem = k_smem + STAGES * BLOCK_N * BLOCK_D;
  // the score ring's slots (SCORE_SLOT_BYTES each: the mask tile, then the bias tile, on 1 KiB bounds)
  unsigned char* score_smem = reinterpret_cast<unsigned char*>(v_smem + STAGES * BLOCK_N * BLOCK_D);
#if FWD_TMA_STORE
  unsigned char* out_smem = score_smem + (SCORE_TILES ? SCORE_STAGES * SCORE_SLOT_BYTES : 0);  // a share a consumer
#endif

  const Inputs& in = p.fwd.in;
#if PACKED && !FWD_PERSISTENT
  // a block past its sequence's rows (the longest sequence's blocks, a shorter one's slice): no
  // row to compute or store
  {
    const Item own = item_at(p, blockIdx.y * gridDim.x + blockIdx.x);
    if (own.block_row0 >= own.rule.seqlen_q) return;
  }
#endif
#if FWD_PERSISTENT
  const int items = p.item_columns * p.item_rows;
#else
  const int items = gridDim.x * gridDim.y;  // a CTA per item: the grid is the items
#endif
  constexpr int CONSUMER_THREADS = CONSUMERS * GROUP_WARPS * 32;

  if (threadIdx.x == 0) {
    barrier_init(&q_full, 1);
    barrier_init(&q_empty, CONSUMER_THREADS);
    for (int slot = 0; slot < STAGES; ++slot) {
      barrier_init(&k_full[slot], 1);
      barrier_init(&v_full[slot], 1);
      barrier_init(&k_empty[slot], CONSUMER_THREADS);
      barrier_init(&v_empty[slot], CONSUMER_THREADS);
    }
    for (int slot = 0; slot < SCORE_SLOTS; ++slot) {
      barrier_init(&score_full[slot], 1);
      barrier_init(&score_empty[slot], CONSUMER_THREADS);
    }
    for (int slot = 0; slot < 2; ++slot) {
      barrier_init(&item_full[slot], 1);
      barrier_init(&item_empty[slot], CONSUMER_THREADS);
    }
    fence_barrier_init();
  }
  __syncthreads();

  if (threadIdx.x < GROUP_WARPS * 32) {
    // -- producer --
    registers_release<PRODUCER_REGISTERS>();
    if (threadIdx.x != 0) return;
    // Items: the CTA's list in a persistent launch, else its own; `items` ends them. Key tiles
    // are counted across items (`ring`), so the rings' slots and phases run on from one item to
    // the next, and the next item's Q and first tiles load while the consumers finish the last.
#if FWD_PERSISTENT && PACKED
    for (int k = 0, ring = 0;; ++k) {
      int index;
      for (;;) {  // the next item in launch order with rows of its sequence (past the last: the end)
        index = atomicAdd(p.item_counter, 1);
        if (index >= items) break;
        const Item next = item_at(p, index);
        if (next.block_row0 < next.rule.seqlen_q) break;
      }
#elif FWD_PERSISTENT
    const int cta = blockIdx.y * gridDim.x + blockIdx.x, ctas = gridDim.x * gridDim.y;
    const int first = p.schedule ? p.schedule[cta] : 0, count = p.schedule ? p.schedule[cta + 1] - first : 1;
    for (int k = 0, ring = 0;; ++k) {
      const int index = k >= count ? items : p.schedule ? p.schedule[ctas + 1 + first + k] : cta;
#else
    const int cta = blockIdx.y * gridDim.x + blockIdx.x;
    for (int k = 0, ring = 0;; ++k) {
      const int index = k >= 1 ? items : cta;  // its own item, then the end
#endif
      if (k >= 2) barrier_wait(&item_empty[k % 2], (k / 2 - 1) & 1);
      item_index[k % 2] = index;
      barrier_arrive(&item_full[k % 2]);  // releases the index to the consumers' wait
      if (index >= items) break;
      const Item item = item_at(p, index);
      const HeadSlices& at = item.at;
      if (k >= 1) barrier_wait(&q_empty, (k - 1) & 1);  // the item before has taken its last S
      barrier_arrive_expecting(&q_full, Q_BYTES);
#if PACKED
      load_tile_tma<BLOCK_M>(q_smem, &p.q_map, item.q0 + item.block_row0, at.head, 0, &q_full);
#else
      load_tile_tma<BLOCK_M>(q_smem, &p.q_map, item.block_row0, at.head, at.batch, &q_full);
#endif
#if HAS_WINDOW
      for (int j = item.first; j < item.first + item.n_tiles; ++j, ++ring) {  // j: the key tile
#else
      for (int j = 0; j < item.n_tiles; ++j, ++ring) {
#endif
        const int slot = ring % STAGES;
        if (ring >= STAGES) barrier_wait(&k_empty[slot], (ring / STAGES - 1) & 1);  // S of tile ring - STAGES is done
        barrier_arrive_expecting(&k_full[slot], KV_BYTES);
#if PACKED
        load_tile_tma<BLOCK_N>(k_smem + slot * BLOCK_N * BLOCK_D, &p.k_map, item.k0 + j * BLOCK_N, at.kv_head, 0,
                               &k_full[slot]);
#else
        load_tile_tma<BLOCK_N>(k_smem + slot * BLOCK_N * BLOCK_D, &p.k_map, j * BLOCK_N, at.kv_head, at.batch,
                               &k_full[slot]);
#endif
        if (SCORE_TILES) {
          const int score_slot = ring % SCORE_SLOTS;
          if (ring >= SCORE_SLOTS) barrier_wait(&score_empty[score_slot], (ring / SCORE_SLOTS - 1) & 1);
          unsigned char* tile = score_smem + score_slot * SCORE_SLOT_BYTES;
          barrier_arrive_expecting(&score_full[score_slot], SCORE_BYTES);
          // a broadcast dim (stride 0) is a size-1 dim of the map: coordinate 0
#if PACKED
          // a row of keys (per key: the static_assert above), from the sequence's first key
          if (MASK_TILES)
            tma_load(tile, &p.mask_map, item.k0 + j * BLOCK_N, 0, in.mask_stride[1] ? at.head / in.mask_head_div : 0,
                     0, &score_full[score_slot]);
          if (BIAS_TILES)
            tma_load(tile + MASK_SLOT_BYTES, &p.bias_map, item.k0 + j * BLOCK_N, 0,
                     in.bias_stride[1] ? at.head / in.bias_head_div : 0, 0, &score_full[score_slot]);
#else
          if (MASK_TILES)
            tma_load(tile, &p.mask_map, j * BLOCK_N, MASK_ROWS == 1 ? 0 : item.block_row0,
                     in.mask_stride[1] ? at.head / in.mask_head_div : 0, in.mask_stride[0] ? at.batch : 0,
                     &score_full[score_slot]);
          if (BIAS_TILES) {
#pragma unroll
            for (int block = 0; block < BIAS_BOXES; ++block)
              tma_load(tile + MASK_SLOT_BYTES + block * BIAS_ROWS * BIAS_LINE, &p.bias_map,
                       j * BLOCK_N + block * BIAS_LINE / int(sizeof(elem_t)), BIAS_ROWS == 1 ? 0 : item.block_row0,
                       in.bias_stride[1] ? at.head / in.bias_head_div : 0, in.bias_stride[0] ? at.batch : 0,
                       &score_full[score_slot]);
          }
#endif
        }
        if (ring >= STAGES) barrier_wait(&v_empty[slot], (ring / STAGES - 1) & 1);  // P V of tile ring - STAGES is done
        barrier_arrive_expecting(&v_full[slot], KV_BYTES);
#if PACKED
        load_tile_tma<BLOCK_N>(v_smem + slot * BLOCK_N * BLOCK_D, &p.v_map, item.k0 + j * BLOCK_N, at.kv_head, 0,
                               &v_full[slot]);
#else
        load_tile_tma<BLOCK_N>(v_smem + slot * BLOCK_N * BLOCK_D, &p.v_map, j * BLOCK_N, at.kv_head, at.batch,
                               &v_full[slot]);
#endif
      }
    }
    return;
  }

  // -- consumers --
  registers_claim<CONSUMER_REGISTERS>();
  const int warp = threadIdx.x / 32 - GROUP_WARPS, lane = threadIdx.x % 32;  // warp among the consumers
  const int g = lane / 4, t = lane % 4;  // mma fragment coordinates: row group, column pair
  const int group = warp / GROUP_WARPS;
  const int group_row0 = group * GROUP_ROWS;  // the warpgroup's rows of the Q tile
  const float exp_scale = log2_scale(in);

  for (int k = 0, ring = 0;; ++k) {
    barrier_wait(&item_full[k % 2], (k / 2) & 1);
    const int index = item_index[k % 2];
    barrier_arrive(&item_empty[k % 2]);
    if (index >= items) break;
    const Item item = item_at(p, index);
    const int n_tiles = item.n_tiles, block_row0 = item.block_row0;
    const int warp_row0 = block_row0 + warp * WARP_ROWS;
    const KeyTiles tiles = key_tiles<BLOCK_N>(item.rule, block_row0 + BLOCK_M, warp_row0, WARP_ROWS);
#if HAS_WINDOW
    const int reached = max(0, min(tiles.reached - item.first, n_tiles));  // counted from item.first
#else
    const int reached = min(tiles.reached, n_tiles);
#endif

    float acc[1][BLOCK_D / 8][4] = {};
    float row_max[1][2] = {{-INFINITY, -INFINITY}}, row_sum[1][2] = {{0.f, 0.f}};
    float s[1][BLOCK_N / 8][4];
    uint32_t p_frag[BLOCK_N / 16][4];  // P of the tile before, the A operand of its P V
    float rescale[1][2];

    // Tile j of the item is tile `ring + j` of the rings. The products, issued; the caller has
    // waited for their tiles (the `full` barriers) and fenced.
    auto issue_s = [&](int j) {  // S = Q K_j^T
      wgmma_abt(s[0], q_smem, BLOCK_M, group_row0, k_smem + (ring + j) % STAGES * BLOCK_N * BLOCK_D);
      wgmma_commit();
    };
    auto issue_pv = [&](int j) {  // acc += P V_j
      wgmma_ab(acc[0], p_frag, v_smem + (ring + j) % STAGES * BLOCK_N * BLOCK_D);
      wgmma_commit();
    };
    auto wait_k = [&](int j) { barrier_wait(&k_full[(ring + j) % STAGES], ((ring + j) / STAGES) & 1); };
    auto wait_v = [&](int j) { barrier_wait(&v_full[(ring + j) % STAGES], ((ring + j) / STAGES) & 1); };
    // Tile j's S has landed: K_j's slot is free; S -> scores -> P, acc's factors in `rescale`.
    auto softmax_of = [&](int j) {
      touch(s[0]);
      barrier_arrive(&k_empty[(ring + j) % STAGES]);
      const int score_slot = (ring + j) % SCORE_SLOTS;
      StagedScores staged = {nullptr, nullptr, block_row0};
      if (SCORE_TILES) {
        const unsigned char* tile = score_smem + score_slot * SCORE_SLOT_BYTES;
        staged.mask = tile;
        staged.bias = tile + MASK_SLOT_BYTES;
        barrier_wait(&score_full[score_slot], ((ring + j) / SCORE_SLOTS) & 1);
      }
#if HAS_WINDOW
      const int key_tile = item.first + j;
      if (key_tile >= tiles.inside_first && key_tile < tiles.inside)
        scores<false, MASK_ROWS, BIAS_ROWS>(s, item.rule, staged, warp_row0, key_tile * BLOCK_N, g, t);
      else
        scores<true, MASK_ROWS, BIAS_ROWS>(s, item.rule, staged, warp_row0, key_tile * BLOCK_N, g, t);
#else
      if (j < tiles.inside)
        scores<false, MASK_ROWS, BIAS_ROWS>(s, item.rule, staged, warp_row0, j * BLOCK_N, g, t);
      else
        scores<true, MASK_ROWS, BIAS_ROWS>(s, item.rule, staged, warp_row0, j * BLOCK_N, g, t);
#endif
      if (SCORE_TILES) barrier_arrive(&score_empty[score_slot]);  // read: the producer may refill it
      softmax_tile(s, row_max, row_sum, rescale, exp_scale);
    };
    // Tile j - 1's P V has landed (acc rescaled for tile j): V_{j-1}'s slot is free; P_j staged.
    auto next_p = [&](int j) {
      touch(acc[0]);  // the rescale's writes stay before the next fence (PTX: no register writes after it)
      if (j > 0) barrier_arrive(&v_empty[(ring + j - 1) % STAGES]);
#pragma unroll
      for (int kk = 0; kk < BLOCK_N / 16; ++kk) accumulator_to_a(p_frag[kk], s[0], kk);
    };

    // FlashAttention-3's intra-warpgroup overlap: tile j's S is issued with tile j - 1's P V,
    // so tile j's scores and softmax run while the tensor cores multiply P_{j-1} V_{j-1}; only
    // acc's rescale waits for that product. The first tile is peeled (no P V before it; acc is
    // 0 and needs no rescale) so every wgmma_wait count is a constant and ptxas keeps the
    // products asynchronous; every barrier wait comes before the fence, as a wait between
    // fence and wgmma had ptxas serialize each k-step.
    // Turns (PINGPONG) at issue points 0 .. n_tiles (point p: S_p and P V_{p-1}): each consumer
    // takes one at every point, work or not, so both take n_tiles + 1. Consumer 1 opens
    // consumer 0's first turn and does not pass its last, so no arrival is left over.
    auto take_turn = [&]() {
      if (PINGPONG) named_barrier_sync(1 + group, TURN_THREADS);
    };
#if PACKED
    // Tile j's V holds rows past the sequence's last key (its last tile, partly the next
    // sequence's): this warpgroup zeroes them before its P V_j (P is 0 there; 0 x NaN is not) and
    // syncs on its own named barrier (3 + group; the turns take 1 and 2). Both warpgroups may
    // write the same zeros; each reads the tile only after its own writes.
    constexpr int GROUP_THREADS = GROUP_WARPS * 32;
    const int tail_tile = item.rule.seqlen_k / BLOCK_N, tail_keys = item.rule.seqlen_k - tail_tile * BLOCK_N;
    auto clear_tail = [&](int j) {
#if HAS_WINDOW
      const int key_tile = item.first + j;
#else
      const int key_tile = j;
#endif
      if (key_tile != tail_tile) return;
      clear_rows<BLOCK_N>(v_smem + (ring + j) % STAGES * BLOCK_N * BLOCK_D, tail_keys, threadIdx.x % GROUP_THREADS,
                          GROUP_THREADS);
      fence_async_shared();
      named_barrier_sync(3 + group, GROUP_THREADS);
    };
#endif
    auto pass_turn = [&](int point) {
      if (PINGPONG && !(group == 1 && point == n_tiles)) named_barrier_arrive(1 + (group ^ 1), TURN_THREADS);
    };
    if (PINGPONG && group == 1) named_barrier_arrive(1, TURN_THREADS);
    barrier_wait(&q_full, k & 1);
    if (reached > 0) {
      wait_k(0);
      take_turn();
      wgmma_fence();
      issue_s(0);
      pass_turn(0);
      wgmma_wait<0>();
      softmax_of(0);
      next_p(0);
    }
    for (int j = 1; j < reached; ++j) {
      wait_k(j);
      wait_v(j - 1);
#if PACKED
      clear_tail(j - 1);
#endif
      take_turn();
      wgmma_fence();
      issue_s(j);
      issue_pv(j - 1);
      pass_turn(j);
      wgmma_wait<1>();  // S_j
      softmax_of(j);
      // P_{j-1} V_{j-1}, waited for in both branches of the vote on the rows' sums: with one
      // wait after the softmax, ptxas scheduled the wait first and the softmax after the product.
      if (rows_moved(rescale, row_sum)) {
        wgmma_wait<0>();
        touch(acc[0]);
        rescale_rows(acc, rescale);
      } else {
        wgmma_wait<0>();
      }
      next_p(j);
    }
    barrier_arrive(&q_empty);  // every S of the item has landed: the producer may load the next Q
    if (reached > 0) {
      wait_v(reached - 1);
#if PACKED
      clear_tail(reached - 1);
#endif
      take_turn();
      wgmma_fence();
      issue_pv(reached - 1);
      pass_turn(reached);
      wgmma_wait<0>();
      touch(acc[0]);
      barrier_arrive(&v_empty[(ring + reached - 1) % STAGES]);
    }
    // Tiles past the warpgroup's causal reach: nothing to compute, but each phase counts every
    // consumer thread (the producer refills a slot only once all have arrived), and a thread's
    // arrival on a slot waits for the slot's load, so it never counts toward the phase before.
    for (int point = reached > 0 ? reached + 1 : 0; point <= n_tiles; ++point) {
      take_turn();
      pass_turn(point);
    }
    for (int j = reached; j < n_tiles; ++j) {
      const int slot = (ring + j) % STAGES, parity = ((ring + j) / STAGES) & 1;
      barrier_wait(&k_full[slot], parity);
      barrier_arrive(&k_empty[slot]);
      if (SCORE_TILES) {
        barrier_wait(&score_full[(ring + j) % SCORE_SLOTS], ((ring + j) / SCORE_SLOTS) & 1);
        barrier_arrive(&score_empty[(ring + j) % SCORE_SLOTS]);
      }
      barrier_wait(&v_full[slot], parity);
      barrier_arrive(&v_empty[slot]);
    }

#if PACKED
    FwdParams sequence_rows = p.fwd;  // the sequence's rows of out and lse
    sequence_rows.in.seqlen_q = item.rule.seqlen_q;
    sequence_rows.out += item.q0 * p.fwd.out_stride[1];
    sequence_rows.lse += item.q0 * p.fwd.lse_stride[2];
    store_rows(sequence_rows, item.at, acc, row_max, row_sum, warp_row0, g, t);
#elif FWD_TMA_STORE
    store_rows_by_tma(p, item.at, acc, row_max, row_sum, warp_row0, block_row0 + group_row0, g, t,
                      out_smem + group * OUT_SHARE_BYTES, group);
#else
    store_rows(p.fwd, item.at, acc, row_max, row_sum, warp_row0, g, t);
#endif
    ring += n_tiles;
  }
#if FWD_TMA_STORE
  if (threadIdx.x % (GROUP_WARPS * 32) == 0) bulk_wait<0, false>();  // the last stores, before the CTA ends
#endif
}
#else  // FWD_OVERLAP: the consumer that takes one key tile at a time
extern "C" __global__ void __launch_bounds__(THREADS, 1) dmattn_fwd_ws_kernel(const __grid_constant__ WsParams p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __shared__ __align__(8) uint64_t q_full, k_full[STAGES], v_full[STAGES], empty[STAGES];
  __shared__ __align__(8) uint64_t score_full[SCORE_SLOTS], score_empty[SCORE_SLOTS];
  elem_t* q_smem = shared_tiles(smem_raw);
  elem_t* k_smem = q_smem + BLOCK_M * BLOCK_D;
  elem_t* v_smem = k_smem + STAGES * BLOCK_N * BLOCK_D;
  // the score ring's slots (SCORE_SLOT_BYTES each: the mask tile, then the bias tile, on 1 KiB bounds)
  unsigned char* score_smem = reinterpret_cast<unsigned char*>(v_smem + STAGES * BLOCK_N * BLOCK_D);

  const Inputs& in = p.fwd.in;
  // Launch order: sections of head slices whose K and V fit L2 (common.cuh), in a section the
  // longest causal rows first (flash_fwd.cu), so the CTAs resident at once walk as many key
  // tiles and re-read K and V from L2, not memory. A slice's query blocks adjacent instead
  // (sections of one slice) was slower: H100, W3 0.319 against 0.296 ms, W2 0.419 against 0.368.
  const SectionOrder order = section_order(p.section_slices);
  const HeadSlices at = head_slices(in, order.slice);
  const ScoreRule rule = score_rule(in, at);
  const int m_block = gridDim.y - 1 - order.block;
  const int block_row0 = m_block * BLOCK_M;
  const int n_tiles = key_tiles<BLOCK_N>(rule, block_row0 + BLOCK_M, block_row0, BLOCK_M).block;

  if (threadIdx.x == 0) {
    barrier_init(&q_full, 1);
    for (int slot = 0; slot < STAGES; ++slot) {
      barrier_init(&k_full[slot], 1);
      barrier_init(&v_full[slot], 1);
      barrier_init(&empty[slot], CONSUMERS * GROUP_WARPS * 32);
    }
    for (int slot = 0; slot < SCORE_SLOTS; ++slot) {
      barrier_init(&score_full[slot], 1);
      barrier_init(&score_empty[slot], CONSUMERS * GROUP_WARPS * 32);
    }
    fence_barrier_init();
  }
  __syncthreads();

  if (threadIdx.x < GROUP_WARPS * 32) {
    // -- producer --
    registers_release<PRODUCER_REGISTERS>();
    if (threadIdx.x == 0) {
      barrier_arrive_expecting(&q_full, Q_BYTES);
      load_tile_tma<BLOCK_M>(q_smem, &p.q_map, block_row0, at.head, at.batch, &q_full);
      for (int j = 0; j < n_tiles; ++j) {
        const int slot = j % STAGES;
        if (j >= STAGES) barrier_wait(&empty[slot], (j / STAGES - 1) & 1);  // tile j - STAGES is done
        barrier_arrive_expecting(&k_full[slot], KV_BYTES);
        load_tile_tma<BLOCK_N>(k_smem + slot * BLOCK_N * BLOCK_D, &p.k_map, j * BLOCK_N, at.kv_head, at.batch,
                               &k_full[slot]);
        if (SCORE_TILES) {
          const int score_slot = j % SCORE_SLOTS;
          if (j >= SCORE_SLOTS) barrier_wait(&score_empty[score_slot], (j / SCORE_SLOTS - 1) & 1);
          unsigned char* tile = score_smem + score_slot * SCORE_SLOT_BYTES;
          barrier_arrive_expecting(&score_full[score_slot], SCORE_BYTES);
          // a broadcast dim (stride 0) is a size-1 dim of the map: coordinate 0
          if (MASK_TILES)
            tma_load(tile, &p.mask_map, j * BLOCK_N, MASK_ROWS == 1 ? 0 : block_row0,
                     in.mask_stride[1] ? at.head / in.mask_head_div : 0, in.mask_stride[0] ? at.batch : 0,
                     &score_full[score_slot]);
          if (BIAS_TILES) {
#pragma unroll
            for (int block = 0; block < BIAS_BOXES; ++block)
              tma_load(tile + MASK_SLOT_BYTES + block * BIAS_ROWS * BIAS_LINE, &p.bias_map,
                       j * BLOCK_N + block * BIAS_LINE / int(sizeof(elem_t)), BIAS_ROWS == 1 ? 0 : block_row0,
                       in.bias_stride[1] ? at.head / in.bias_head_div : 0, in.bias_stride[0] ? at.batch : 0,
                       &score_full[score_slot]);
          }
        }
        barrier_arrive_expecting(&v_full[slot], KV_BYTES);
        load_tile_tma<BLOCK_N>(v_smem + slot * BLOCK_N * BLOCK_D, &p.v_map, j * BLOCK_N, at.kv_head, at.batch,
                               &v_full[slot]);
      }
    }
    return;
  }

  // -- consumers --
  registers_claim<CONSUMER_REGISTERS>();
  const int warp = threadIdx.x / 32 - GROUP_WARPS, lane = threadIdx.x % 32;  // warp among the consumers
  const int g = lane / 4, t = lane % 4;  // mma fragment coordinates: row group, column pair
  const int warp_row0 = block_row0 + warp * WARP_ROWS;
  const int group_row0 = (warp / GROUP_WARPS) * GROUP_ROWS;  // the warpgroup's rows of the Q tile
  const KeyTiles tiles = key_tiles<BLOCK_N>(rule, block_row0 + BLOCK_M, warp_row0, WARP_ROWS);

  float acc[1][BLOCK_D / 8][4] = {};
  float row_max[1][2] = {{-INFINITY, -INFINITY}}, row_sum[1][2] = {{0.f, 0.f}};
  const int reached = min(tiles.reached, n_tiles);
  barrier_wait(&q_full, 0);
  for (int j = 0; j < reached; ++j) {
    const int slot = j % STAGES, parity = (j / STAGES) & 1;
    const int score_slot = j % SCORE_SLOTS, score_parity = (j / SCORE_SLOTS) & 1;
    barrier_wait(&k_full[slot], parity);
    float s[1][BLOCK_N / 8][4];
    wgmma_fence();
    wgmma_abt(s[0], q_smem, BLOCK_M, group_row0, k_smem + slot * BLOCK_N * BLOCK_D);
    wgmma_commit();
    wgmma_wait<0>();
    touch(s[0]);
    StagedScores staged = {nullptr, nullptr, block_row0};
    if (SCORE_TILES) {
      const unsigned char* tile = score_smem + score_slot * SCORE_SLOT_BYTES;
      staged.mask = tile;
      staged.bias = tile + MASK_SLOT_BYTES;
      barrier_wait(&score_full[score_slot], score_parity);
    }
    if (j < tiles.inside)
      scores<false, MASK_ROWS, BIAS_ROWS>(s, rule, staged, warp_row0, j * BLOCK_N, g, t);
    else
      scores<true, MASK_ROWS, BIAS_ROWS>(s, rule, staged, warp_row0, j * BLOCK_N, g, t);
    if (SCORE_TILES) barrier_arrive(&score_empty[score_slot]);  // read: the producer may refill it
    online_softmax(s, row_max, row_sum, acc);

    // acc += P V
    uint32_t p_frag[BLOCK_N / 16][4];
#pragma unroll
    for (int kk = 0; kk < BLOCK_N / 16; ++kk) accumulator_to_a(p_frag[kk], s[0], kk);
    touch(acc[0]);  // the rescale's writes stay before the fence (PTX: no register writes after it)
    barrier_wait(&v_full[slot], parity);
    wgmma_fence();
    wgmma_ab(acc[0], p_frag, v_smem + slot * BLOCK_N * BLOCK_D);
    wgmma_commit();
    wgmma_wait<0>();
    touch(acc[0]);
    barrier_arrive(&empty[slot]);  // this thread's products have read the slot
  }
  // Tiles past the warpgroup's causal reach: nothing to compute, but each phase counts every
  // consumer thread (the producer refills a slot only once all have arrived).
  for (int j = reached; j < n_tiles; ++j) {
    const int slot = j % STAGES;
    barrier_wait(&k_full[slot], (j / STAGES) & 1);
    if (SCORE_TILES) {
      barrier_wait(&score_full[j % SCORE_SLOTS], (j / SCORE_SLOTS) & 1);
      barrier_arrive(&score_empty[j % SCORE_SLOTS]);
    }
    barrier_arrive(&empty[slot]);
  }

  store_rows(p.fwd, at, acc, row_max, row_sum, warp_row0, g, t);
}
#endif  // FWD_OVERLAP
