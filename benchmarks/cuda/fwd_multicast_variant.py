"""Writes a probe variant of this tree's warp-specialized forward (kernels/cuda/flash_fwd_ws.cu)
whose CTAs work in clusters of two and share every K and V tile by TMA multicast: each CTA loads
one 64-column half of the tile into both CTAs' shared memory, and a slot is refilled only once
both CTAs' consumers have released it (their own threads' arrivals and one a warp from the
peer's, `mapa` + a cluster-scope arrive). The pair walks query blocks 2 b and 2 b + 1 of one head
slice, both over the longer block's key tiles (the shorter one's consumers wait for and release
the extra tile without computing), in pairs dealt round-robin to the clusters (`--schedule-only`:
that schedule without a cluster, each CTA loading its own tiles, to tell the two apart).

W3's kernel only: D128, no staged mask or bias, persistent (`--variant-knobs
overlap+persistent+tma_store`), an even number of query blocks; the cluster size is compiled in
(`__cluster_dims__`), so the host launches it unchanged. Time it with

    python -m benchmarks cuda-fwd-multicast-variant DIR [--schedule-only]
    python -m benchmarks cuda-fwd-variants-probe --variants mc=DIR --variant-knobs overlap+persistent+tma_store \\
        --configs 128x128w12s2 --knobs overlap+persistent+tma_store --workloads configs/workloads/w3-shapes.yaml

Edits the tree's text at fixed places: a tree whose kernel moved them is a one-line error."""

import argparse
import shutil
import sys
from pathlib import Path

from dmattn_bench.bench.operators import operator

KERNELS = Path(__file__).resolve().parents[2] / "kernels" / "cuda"

CLUSTER_HELPERS = r'''// -- probe: clusters of two CTAs sharing each K and V tile by TMA multicast --
static_assert(!SCORE_TILES && FWD_PERSISTENT && BLOCK_D / SWIZZLE_COLS == 2, "multicast probe: W3's kernel");
__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t rank;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(rank));
  return rank;
}
__device__ __forceinline__ void cluster_sync_all() { asm volatile("barrier.cluster.arrive;\nbarrier.cluster.wait;\n" ::: "memory"); }
__device__ __forceinline__ void barrier_arrive_peer(uint64_t* bar, uint32_t peer) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(shared_address(bar)), "r"(peer));
  asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];\n" :: "r"(remote) : "memory");
}
// A K or V slot's release: this thread's arrival here, and one a warp on the peer's barrier.
__device__ __forceinline__ void release_kv(uint64_t* bar) {
  barrier_arrive(bar);
  __syncwarp();
  if (threadIdx.x % 32 == 0) barrier_arrive_peer(bar, cluster_rank() ^ 1);
}
__device__ __forceinline__ void tma_load_multicast(void* dst, const void* map, int c0, int c1, int c2, int c3,
                                                   uint64_t* bar, uint16_t ctas) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster"
      " [%0], [%1, {%2, %3, %4, %5}], [%6], %7;\n"
      :: "r"(shared_address(dst)), "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3),
         "r"(shared_address(bar)), "h"(ctas)
      : "memory");
}
'''

PAIR_HELPERS = r'''// Launch-order index of pair `pair`'s item for `rank`: query block 2 b + rank of the pair's slice.
__device__ __forceinline__ int pair_index(const WsParams& p, int pair, int rank) {
  const SectionOrder o = section_order(pair, p.item_columns, p.item_rows / 2, p.section_slices);
  const int section = o.slice / p.section_slices;
  const int slices = min(p.section_slices, p.item_columns - section * p.section_slices);
  return section * p.section_slices * p.item_rows + (2 * o.block + rank) * slices + (o.slice - section * p.section_slices);
}
// Its item, over the pair's longer block's key tiles (rank 0's).
__device__ __forceinline__ Item pair_item_at(const WsParams& p, int index, int rank) {
  Item item = item_at(p, index);
  if (rank == 1) item.n_tiles = key_tiles<BLOCK_N>(item.rule, item.block_row0 + 2 * BLOCK_M, item.block_row0, BLOCK_M).block;
  return item;
}
'''

SCHEDULE_ONLY_RANK = r'''__device__ __forceinline__ uint32_t cluster_rank() { return (blockIdx.y * gridDim.x + blockIdx.x) % 2; }
'''


class TreeMoved(Exception):
    pass


def replace_once(text: str, old: str, new: str) -> str:
    if old not in text:
        raise TreeMoved(f"flash_fwd_ws.cu no longer holds {old.strip().splitlines()[0]!r}")
    return text.replace(old, new, 1)


def variant(source: str, multicast: bool) -> str:
    """The tree's kernel source with the pairs' schedule, and with `multicast` the cluster's shared tiles."""
    kernel = 'extern "C" __global__ void __launch_bounds__(THREADS, 1) dmattn_fwd_ws_kernel('
    helpers = (CLUSTER_HELPERS if multicast else SCHEDULE_ONLY_RANK) + PAIR_HELPERS
    cluster = "__cluster_dims__(2, 1, 1) " if multicast else ""
    text = replace_once(source, kernel, helpers + "\n" + kernel.replace("void ", f"void {cluster}", 1))
    text = replace_once(text, '''    const int cta = blockIdx.y * gridDim.x + blockIdx.x, ctas = gridDim.x * gridDim.y;
    const int first = p.schedule ? p.schedule[cta] : 0, count = p.schedule ? p.schedule[cta + 1] - first : 1;
    for (int k = 0, ring = 0;; ++k) {
      const int index = k >= count ? items : p.schedule ? p.schedule[ctas + 1 + first + k] : cta;''', '''    const int rank = cluster_rank(), clusters = gridDim.x * gridDim.y / 2;
    const int cluster = (blockIdx.y * gridDim.x + blockIdx.x) / 2, pairs = p.item_columns * (p.item_rows / 2);
    for (int k = 0, ring = 0;; ++k) {
      const int pair = cluster + k * clusters;
      const int index = pair >= pairs ? items : pair_index(p, pair, rank);''')
    text = replace_once(text, "      const Item item = item_at(p, index);\n      const HeadSlices& at = item.at;",
                        "      const Item item = pair_item_at(p, index, rank);\n      const HeadSlices& at = item.at;")
    consumers = text.index("  // -- consumers --")
    text = text[:consumers] + replace_once(text[consumers:], "const Item item = item_at(p, index);",
                                           "const Item item = pair_item_at(p, index, cluster_rank());")
    if not multicast:
        return text
    waiting = "CONSUMER_THREADS + CONSUMER_THREADS / 32"  # the peer's arrivals: one a warp
    text = replace_once(text, "      barrier_init(&k_empty[slot], CONSUMER_THREADS);\n      barrier_init(&v_empty[slot], CONSUMER_THREADS);",
                        f"      barrier_init(&k_empty[slot], {waiting});\n      barrier_init(&v_empty[slot], {waiting});")
    text = replace_once(text, "    fence_barrier_init();\n  }\n  __syncthreads();", "    fence_barrier_init();\n  }\n  cluster_sync_all();")
    # no thread leaves before the peer is done with its barriers and shared memory
    text = replace_once(text, "    if (threadIdx.x != 0) return;", "    if (threadIdx.x == 0) {")
    text = replace_once(text, "    return;\n  }\n\n  // -- consumers --", "    }\n    cluster_sync_all();\n    return;\n  }\n\n  // -- consumers --")
    for t in ("k", "v"):
        text = replace_once(text, f'''        load_tile_tma<BLOCK_N>({t}_smem + slot * BLOCK_N * BLOCK_D, &p.{t}_map, j * BLOCK_N, at.kv_head, at.batch,
                               &{t}_full[slot]);''', f'''        tma_load_multicast({t}_smem + slot * BLOCK_N * BLOCK_D + rank * BLOCK_N * SWIZZLE_COLS, &p.{t}_map,
                           rank * SWIZZLE_COLS, j * BLOCK_N, at.kv_head, at.batch, &{t}_full[slot], 0x3);''')
    consumers = text.index("  // -- consumers --")
    end = text.index("#else  // FWD_OVERLAP: the consumer that takes one key tile at a time")
    region = text[consumers:end]
    if region.count("barrier_arrive(&k_empty[") + region.count("barrier_arrive(&v_empty[") != 5:
        raise TreeMoved("flash_fwd_ws.cu's overlapped consumers no longer release K and V at five places")
    region = region.replace("barrier_arrive(&k_empty[", "release_kv(&k_empty[").replace("barrier_arrive(&v_empty[", "release_kv(&v_empty[")
    body, kernel_end, after = region.rpartition("#endif\n}\n")
    if not kernel_end or after:
        raise TreeMoved("flash_fwd_ws.cu's overlapped kernel no longer ends its consumers' branch with '#endif }'")
    return text[:consumers] + body + "#endif\n  cluster_sync_all();\n}\n" + text[end:]


@operator("cuda-fwd-multicast-variant", help="Writes the warp-specialized forward sharing K and V across a cluster of two (a probe variant)")
def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="where the variant's flash_fwd_ws.cu and headers go (made if missing)")
    parser.add_argument("--schedule-only", action="store_true", help="the pairs' schedule alone: no cluster, no multicast")
    args = parser.parse_args(argv)
    try:
        text = variant((KERNELS / "flash_fwd_ws.cu").read_text(), multicast=not args.schedule_only)
    except TreeMoved as moved:
        sys.exit(f"cuda-fwd-multicast-variant: {moved}")
    args.folder.mkdir(parents=True, exist_ok=True)
    for header in KERNELS.glob("*.cuh"):
        shutil.copy(header, args.folder / header.name)
    (args.folder / "flash_fwd_ws.cu").write_text(text)
    print(args.folder / "flash_fwd_ws.cu")
