"""The adversarial suite of DESIGN.md §2: case definitions and their input builders.

A `Case` is a small declarative record; `build_inputs` turns it into tensors. Cases that depend
on tile sizes (fully masked tiles, a mask that is True only in tile corners, window edges on tile
edges) are built on the tile sizes of the configuration under test, so each config is attacked on
its own tiles.

Two suites of each size: the dense calls' (`SUITES`), and the packed-sequence and sliding-window
calls' (`varlen_cases`, for the table keys with `packed` or `window`), chosen by
`adversarial_cases(..., varlen=True)`.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from dmattn_bench.space import MAX_DECODE_QUERIES, operand_kind
# the case record and what its builders share (imported from here by the rest of the tuner)
from dmattn_bench.tuning.case import (KEEP_PROBABILITY, LARGE_BIAS, NAN_TAIL, NO_WINDOW, Case, Inputs,  # noqa: F401
                                      window_visible)
from dmattn_bench.tuning.varlen_cases import VARLEN_SUITES, build_packed_inputs

MASK_KINDS = ("none", "random", "dead_rows", "all_false", "corner", "tile_holes", "window")
MASK_SHAPES = ("full", "kv_head", "key")  # (B,H,Lq,Lk), (B,Hkv,Lq,Lk), (B,1,1,Lk)
# workload/table mask kind -> the builder's mask shape (a "per_key" mask is the key-only one)
MASK_SHAPE_OF_KIND = {"full": "full", "kv_head": "kv_head", "per_key": "key"}
BIAS_KINDS = ("none", "full", "kv_head", "per_key")  # ..., (B,Hkv,1,Lk)
POISONS = (None, "nan", "+inf", "-inf", "finfo.min")
LARGE_LOGIT_FACTOR = 8.0  # q and k scaled x8: logits of O(100) stress the online max
# cache lengths of a `cache_lengths` case, sequence b taking entry b % 4 (in keys): the whole
# cache, about half of it (odd: a tile straddles it), none (a dead sequence), one key
CACHE_LENGTHS = (lambda lk: lk, lambda lk: lk // 2 + 1, lambda lk: 0, lambda lk: 1)


def _within(buffer_shape, values: torch.Tensor, fill) -> torch.Tensor:
    """`values` placed at the start of a larger `fill`-tailed buffer, returned as a view."""
    buffer = torch.full(buffer_shape, fill, dtype=values.dtype, device=values.device)
    view = buffer[tuple(slice(0, n) for n in values.shape)]
    view.copy_(values)
    return view


def _causal_visible(lq: int, lk: int, device) -> torch.Tensor:
    rows = torch.arange(lq, device=device)[:, None]
    cols = torch.arange(lk, device=device)[None, :]
    return cols <= rows + (lk - lq)


def _mask_values(case: Case, shape, generator, device) -> torch.Tensor:
    """The boolean mask values of `shape` = (b, h, lq|1, lk) for the case's mask kind."""
    b, h, lq, lk = shape
    rows = torch.arange(lq, device=device)[:, None]
    cols = torch.arange(lk, device=device)[None, :]
    if case.mask == "all_false":
        return torch.zeros(shape, dtype=torch.bool, device=device)
    if case.mask == "corner":
        corner = (rows % case.tile_m == case.tile_m - 1) & (cols % case.tile_n == case.tile_n - 1)
        return corner.expand(shape).clone()
    if case.mask == "window":
        offset = case.seqlen_k - case.seqlen_q
        inside = (cols <= rows + offset) & (cols > rows + offset - case.window)
        return inside.expand(shape).clone()
    keep = torch.rand(shape, generator=generator, device=device) < KEEP_PROBABILITY
    if case.mask == "dead_rows" and lq > 1:
        keep[..., 0, :] = False
        keep[..., lq // 2, :] = False
    if case.mask == "tile_holes":
        tile_row = rows // case.tile_m
        tile_col = cols // case.tile_n
        keep &= ((tile_row + tile_col) % 2 == 1)  # checkerboard of fully masked tiles
    return keep


def _mask_shape(case: Case) -> tuple[int, int, int, int]:
    b, h, hkv, lq, lk = case.batch, case.heads, case.heads_kv, case.seqlen_q, case.seqlen_k
    return {"full": (b, h, lq, lk), "kv_head": (b, hkv, lq, lk), "key": (b, 1, 1, lk)}[case.mask_shape]


def _bias_shape(case: Case) -> tuple[int, int, int, int]:
    b, h, hkv, lq, lk = case.batch, case.heads, case.heads_kv, case.seqlen_q, case.seqlen_k
    return {"full": (b, h, lq, lk), "kv_head": (b, hkv, lq, lk), "per_key": (b, hkv, 1, lk)}[case.bias]


def bias_kind(case: Case) -> str:
    """The `TableKey` bias kind a call of this case looks up (`space.operand_kind` of its bias as
    the kernels see it: a per-key bias of a one-row query has rows); "+grad" left out."""
    if case.bias == "none":
        return "none"
    return operand_kind(_bias_shape(case), case.heads, case.heads_kv, case.seqlen_q)


def specialization_class(case: Case, dtype: str) -> tuple:
    """What of a case's inputs, besides the config, decides which kernels a launch compiles: the
    dtype, the features and head dim (constexprs), the GQA group, for the lengths, head counts
    and the operands' contiguous strides whether each is 1, a multiple of 16 (what Triton
    specializes an int on) and whether it needs 64 bits, and whether the mask's rows are 8-byte
    aligned (the activity pass then reads it as words). Ints derived from those (lse, block-list
    and dBias-partial strides) are left out. The values in
    the tensors (poisons, mask patterns, scales) decide nothing. Views into larger buffers have
    strides of their own: such a case is a class alone. Inputs that differ only in batch, or in
    lengths of one class, share their compiled kernels; a class too coarse for some kernel
    costs a wait and a compile of its own, never a wrong kernel. A window is a constexpr flag
    (any bounded side); packed inputs are views into NaN-surrounded buffers: a class alone."""
    def strides(shape, broadcast: bool = False) -> list[int]:
        """Contiguous strides of `shape` but the last (1); a broadcast operand's size-1 dims are
        launched with stride 0 (`operands.broadcast_strides`) and drop out."""
        return [math.prod(shape[dim + 1:]) for dim in range(len(shape) - 1) if shape[dim] > 1 or not broadcast]

    b, h, hkv, lq, lk, d = case.batch, case.heads, case.heads_kv, case.seqlen_q, case.seqlen_k, case.head_dim
    ints = [lq, lk, h, hkv, *strides((b, lq, h, d)), *strides((b, lk, hkv, d))]
    mask_words = None
    if case.mask != "none":
        mask_strides = strides(_mask_shape(case), broadcast=True)
        ints += mask_strides
        mask_words = all(stride % 8 == 0 for stride in mask_strides)
    if case.bias != "none":
        ints += strides(_bias_shape(case), broadcast=True)
    return (dtype, d, case.causal, case.mask != "none" and case.mask_shape, mask_words, case.bias, case.bias_grad,
            case.bias_fp32, case.softcap > 0, h // hkv, b == 1,
            tuple((value == 1, value % 16 == 0, value >= 2**31) for value in ints),
            case.name if case.sliced or case.bhld_views or case.packed else None, case.window_size != NO_WINDOW)


def _excluded_positions(case: Case, mask: torch.Tensor | None, bias_shape, device) -> torch.Tensor:
    """Bias positions that no query head ever sees (mask False for all its readers, causal, or
    outside the window)."""
    b, hb, lqb, lk = bias_shape
    excluded = torch.zeros(bias_shape, dtype=torch.bool, device=device)
    if mask is not None and lqb > 1:
        m = mask.expand(case.batch, mask.shape[1], case.seqlen_q, lk)
        if mask.shape[1] != hb:
            if hb == case.heads and mask.shape[1] == case.heads_kv:
                m = m.repeat_interleave(case.heads // case.heads_kv, dim=1)
            else:
                m = m.any(dim=1, keepdim=True).expand(case.batch, hb, case.seqlen_q, lk)
        excluded |= ~m[:b]
    if case.causal and lqb > 1:
        excluded |= ~_causal_visible(case.seqlen_q, lk, device)
    if case.window_size != NO_WINDOW and lqb > 1:
        excluded |= ~window_visible(case.seqlen_q, lk, case.window_size, device)
    return excluded


def unwritten_allowed(case: Case) -> bool:
    """Whether a launch that runs nothing needs only the shapes of the case's inputs: not of a
    case with sequence or cache lengths or a page table (the launchers read them), or with
    tails and poison placed by value."""
    return not (case.packed or case.sliced or case.cache_lengths or case.page or case.bias_poison is not None
                or case.bias_neg_inf_allowed)


def unwritten_inputs(case: Case, dtype: torch.dtype, device) -> Inputs:
    """`build_inputs`'s tensors for a case that allows it (`unwritten_allowed`): the same
    shapes, views and dtypes, allocated and never written. What the tuner's compile workers
    launch with (`trials.warm_job`): a compile-only launch reads no value, and a draw is GPU
    work that time-slices with the measuring worker's timed kernels (a full B4 H16 L4096 mask
    and bias are 2 x 268M draws)."""
    assert unwritten_allowed(case), case.name
    b, h, hkv, lq, lk, d = case.batch, case.heads, case.heads_kv, case.seqlen_q, case.seqlen_k, case.head_dim

    def empty(shape, dt=dtype):
        return torch.empty(shape, dtype=dt, device=device)

    if case.bhld_views:
        q = empty((b, h, lq, d)).transpose(1, 2)
        k, v = empty((b, hkv, lk, d)).transpose(1, 2), empty((b, hkv, lk, d)).transpose(1, 2)
    else:
        q, k, v = empty((b, lq, h, d)), empty((b, lk, hkv, d)), empty((b, lk, hkv, d))
    mask = None if case.mask == "none" else empty(_mask_shape(case), torch.bool)
    bias = None if case.bias == "none" else empty(_bias_shape(case), torch.float32 if case.bias_fp32 else dtype)
    return Inputs(q, k, v, mask, bias, empty((b, lq, h, d)))


def build_inputs(case: Case, dtype: torch.dtype, device, seed: int = 0) -> Inputs:
    """Random inputs for `case` (seeded), with every adversarial feature applied."""
    generator = torch.Generator(device=device).manual_seed(seed)
    if case.packed:
        return build_packed_inputs(case, dtype, device, generator)

    def randn(shape, scale=1.0, dt=dtype):
        # scaled in place: a copy would be a second float32 tensor of the bias's size at its peak
        return torch.randn(shape, generator=generator, device=device, dtype=torch.float32).mul_(scale).to(dt)

    b, h, hkv, lq, lk, d = case.batch, case.heads, case.heads_kv, case.seqlen_q, case.seqlen_k, case.head_dim
    if case.bhld_views:
        q = randn((b, h, lq, d), case.logit_factor).transpose(1, 2)
    else:
        q = randn((b, lq, h, d), case.logit_factor)

    def kv_tensor(scale):
        if case.sliced:
            return _within((b, lk + NAN_TAIL, hkv + 1, d + 8), randn((b, lk, hkv, d), scale), float("nan"))
        if case.bhld_views:
            return randn((b, hkv, lk, d), scale).transpose(1, 2)
        return randn((b, lk, hkv, d), scale)

    k = kv_tensor(case.logit_factor)
    v = kv_tensor(1.0)

    mask = None
    if case.mask != "none":
        shape = _mask_shape(case)
        values = _mask_values(case, shape, generator, device)
        if case.sliced:
            padded = tuple(n + NAN_TAIL if n > 1 else n for n in shape)
            # the tails hold True: reading them would let excluded keys in
            mask = _within(padded, values, True)
        else:
            mask = values

    bias = None
    if case.bias != "none":
        bias_dtype = torch.float32 if case.bias_fp32 else dtype
        shape = _bias_shape(case)
        scale = LARGE_BIAS[dtype] if case.large_bias else 1.0
        values = randn(shape, scale, torch.float32)
        if case.bias_poison is not None:
            poison = {"nan": float("nan"), "+inf": float("inf"), "-inf": float("-inf"),
                      "finfo.min": torch.finfo(bias_dtype).min}[case.bias_poison]
            values[_excluded_positions(case, mask, shape, device)] = poison
        if case.bias_neg_inf_allowed:
            holes = torch.rand(shape, generator=generator, device=device) < 0.1
            values[holes] = float("-inf")
            values[..., shape[2] // 2, :] = float("-inf")  # a row dead through its bias alone
        values = values.to(bias_dtype)
        if case.sliced:
            padded = tuple(n + NAN_TAIL if n > 1 else n for n in shape)
            bias = _within(padded, values, float("nan"))
        else:
            bias = values
    dout = randn((b, lq, h, d))
    cache_seqlens = None
    if case.cache_lengths:
        lengths = [CACHE_LENGTHS[index % len(CACHE_LENGTHS)](lk) for index in range(b)]
        cache_seqlens = torch.tensor(lengths, dtype=torch.int32, device=device)
        for index, length in enumerate(lengths):  # what lies past a length is never read
            k[index, length:] = float("nan")
            v[index, length:] = float("nan")
    block_table = None
    if case.page:
        k, v, block_table = paged_cache(k, v, case.page, generator, cache_seqlens, case.pages_out_of_range)
    return Inputs(q, k, v, mask, bias, dout, cache_seqlens, block_table)


# Table entries that name no block of a pool of n: before it, just past it, and far past it
OUT_OF_RANGE_PAGES = (lambda n: -1, lambda n: n, lambda n: 2 ** 31 - 1)


def paged_cache(k, v, page: int, generator, cache_seqlens=None, out_of_range: bool = False):
    """k and v (B, Lk, Hkv, D) as a paged cache: (blocks, page, Hkv, D) with every sequence's pages
    scattered in a shuffled pool of NaN-filled blocks, and the (B, pages) int32 block table; with
    `cache_seqlens`, a table entry whose keys all lie past a sequence's length holds -1 (it must
    never be read). `out_of_range`: every third entry of a row (from its second) names no block
    (`OUT_OF_RANGE_PAGES` in turn), so its keys are excluded; the pool is then a view between two
    NaN blocks, which a read of block -1 or of block n would reach."""
    batch, seqlen_k, heads_kv, head_dim = k.shape
    pages = -(-seqlen_k // page)
    spare = 3  # blocks no sequence uses
    order = torch.randperm(batch * pages + spare, generator=generator, device=k.device)
    table = order[:batch * pages].view(batch, pages).to(torch.int32)
    pools = []
    for t in (k, v):
        pool = torch.full((batch * pages + spare, page, heads_kv, head_dim), float("nan"), dtype=t.dtype,
                          device=t.device)
        padded = torch.full((batch, pages * page, heads_kv, head_dim), float("nan"), dtype=t.dtype, device=t.device)
        padded[:, :seqlen_k] = t
        pool[table.view(-1).long()] = padded.view(batch * pages, page, heads_kv, head_dim)
        pools.append(pool)
    if out_of_range:
        blocks = batch * pages + spare
        pools = [torch.cat([torch.full_like(pool[:1], float("nan")), pool, torch.full_like(pool[:1], float("nan"))])
                 [1:-1] for pool in pools]
        for index, (b, p) in enumerate((b, p) for b in range(batch) for p in range(1, pages, 3)):
            table[b, p] = OUT_OF_RANGE_PAGES[index % len(OUT_OF_RANGE_PAGES)](blocks)
    if cache_seqlens is not None:
        unused = torch.arange(pages, device=k.device) * page >= cache_seqlens.unsqueeze(1)
        table = torch.where(unused, torch.full_like(table, -1), table)
    return pools[0], pools[1], table


def _quick_cases() -> list[Case]:
    """CPU-interpreter sized: every §2 feature, lengths <= 136."""
    return [
        Case("sliced_nan_tails", batch=2, heads=4, heads_kv=2, seqlen_q=17, seqlen_k=40, head_dim=40,
             mask="random", mask_shape="kv_head", bias="full", sliced=True),
        Case("bias_nan_at_masked", seqlen_q=20, seqlen_k=33, mask="random", bias="full", bias_poison="nan", causal=True),
        Case("bias_posinf_at_masked", seqlen_q=20, seqlen_k=33, mask="random", bias="full", bias_poison="+inf"),
        Case("bias_neginf_at_masked", seqlen_q=20, seqlen_k=33, mask="random", bias="full", bias_poison="-inf"),
        Case("bias_finfo_min_at_masked", seqlen_q=20, seqlen_k=33, mask="random", mask_shape="kv_head",
             heads=4, heads_kv=2, bias="kv_head", bias_poison="finfo.min"),
        Case("bias_neginf_at_allowed", seqlen_q=20, seqlen_k=33, mask="random", bias="full", bias_neg_inf_allowed=True),
        Case("dead_rows", heads=4, heads_kv=1, seqlen_q=24, seqlen_k=40, mask="dead_rows", bias="per_key"),
        Case("fully_masked_tiles", seqlen_q=40, seqlen_k=40, mask="tile_holes", bias="full"),
        Case("all_false_mask", seqlen_q=17, seqlen_k=24, mask="all_false", bias="full"),
        Case("tile_corner_mask", seqlen_q=40, seqlen_k=40, mask="corner", bias="kv_head", heads=2, heads_kv=1),
        Case("causal_lq_lt_lk", seqlen_q=17, seqlen_k=40, causal=True, mask="random", mask_shape="key"),
        Case("causal_lq_gt_lk", seqlen_q=40, seqlen_k=17, causal=True, bias="full"),
        Case("decode_lq1", seqlen_q=1, seqlen_k=113, causal=True, bias="per_key", mask="random"),
        Case("single_key_lk1", seqlen_q=17, seqlen_k=1, causal=True, bias="full"),
        Case("odd_lengths_113", heads=1, heads_kv=1, seqlen_q=113, seqlen_k=113, head_dim=72, mask="random", bias="per_key"),
        Case("head_dim_40_gqa", heads=4, heads_kv=2, seqlen_q=17, seqlen_k=17, head_dim=40, bias="kv_head", mask="random"),
        Case("large_logits", seqlen_q=33, seqlen_k=33, logit_factor=LARGE_LOGIT_FACTOR, mask="random", bias="full"),
        Case("large_bias", seqlen_q=33, seqlen_k=33, large_bias=True, mask="random", bias="full"),
        # no mask: interior key tiles test nothing, so query rows past Lq (20 fits no tile) see
        # the per-key bias too; 136 keys leave a whole 128-key tile inside Lk
        Case("large_per_key_bias_no_mask", heads=2, heads_kv=1, seqlen_q=20, seqlen_k=136, large_bias=True,
             bias="per_key"),
        Case("softcap_mask_bias", seqlen_q=33, seqlen_k=33, softcap=5.0, mask="random", bias="full", causal=True),
        Case("bhld_views_mqa", heads=4, heads_kv=1, seqlen_q=24, seqlen_k=24, bhld_views=True, bias="per_key", mask="random"),
        Case("fp32_bias", seqlen_q=24, seqlen_k=24, bias="full", bias_fp32=True, mask="random"),
        # 16-divisible lengths take another Triton specialization, which can pipeline the bias tile
        # and need more shared memory (H200: fwd 64x128 w8 s3, D128, ran out at L1024, not at L1000)
        Case("lengths_multiple_of_16", seqlen_q=32, seqlen_k=48, head_dim=128, mask="random", bias="full",
             causal=True),
        Case("fp32_bias_lengths_multiple_of_16", seqlen_q=32, seqlen_k=48, head_dim=128, bias="full",
             bias_fp32=True, mask="random"),
    ]


def _full_cases() -> list[Case]:
    """GPU sized: the quick cases plus the lengths, head dims and seed cases of §2."""
    cases = [replace(c, batch=2 * c.batch) for c in _quick_cases()]
    cases += [
        Case("len_203_d96", seqlen_q=203, seqlen_k=203, head_dim=96, mask="random", bias="full"),
        Case("len_1000_d192", seqlen_q=1000, seqlen_k=1000, head_dim=192, mask="random", mask_shape="key", bias="kv_head"),
        Case("len_4097_causal", heads=2, heads_kv=1, seqlen_q=4097, seqlen_k=4097, head_dim=64, causal=True, mask="random",
             mask_shape="kv_head", bias="per_key"),
        Case("head_dim_72", seqlen_q=113, seqlen_k=203, head_dim=72, mask="random", bias="per_key"),
        Case("head_dim_192_causal", seqlen_q=203, seqlen_k=113, head_dim=192, causal=True, bias="full"),
        # query tiles of rows that all see no key (causal, Lq - Lk >= 64) at a head dim the
        # warp-specialized backward takes: no key block visits them (found by review)
        Case("causal_dead_tiles_d128", seqlen_q=203, seqlen_k=113, head_dim=128, causal=True),
        Case("seed_long_window_bf16", batch=1, heads=8, heads_kv=8, seqlen_q=4096, seqlen_k=4096, head_dim=128,
             mask="window", window=2048, bias="full"),
        # found by the tuner's on-shape check: the pipelined (maskless) dK path at D=128, GQA
        Case("gqa_causal_no_mask_d128", batch=2, heads=8, heads_kv=2, seqlen_q=1000, seqlen_k=1000, head_dim=128,
             causal=True),
        Case("seed_short_causal", batch=1, heads=1, heads_kv=1, seqlen_q=256, seqlen_k=256, head_dim=64, causal=True),
    ]
    return cases


SUITES = {"quick": _quick_cases, "full": _full_cases}


LONG_CACHE_KEYS = 16384 + 77


def _cache_cases() -> list[Case]:
    """Decode over a KV cache: per-sequence lengths over NaN-filled tails, with the operands a
    serving step carries (a padding mask, a per-key bias, GQA groups packed in one tile)."""
    return [
        Case("cache_lengths_decode", batch=4, heads=8, heads_kv=2, seqlen_q=1, seqlen_k=113, mask="random",
             mask_shape="key", bias="per_key", cache_lengths=True),
        Case("cache_lengths_causal_lq3", batch=4, heads=4, heads_kv=1, seqlen_q=3, seqlen_k=70, causal=True,
             mask="random", mask_shape="kv_head", bias="full", cache_lengths=True),
        Case("cache_lengths_sliced_softcap", batch=4, heads=2, heads_kv=2, seqlen_q=2, seqlen_k=40, head_dim=40,
             softcap=5.0, bias="kv_head", bias_poison="nan", mask="random", sliced=True, cache_lengths=True),
        # the wide head dims' class (its own config) and a GQA group of 8 in one tile
        Case("cache_lengths_d256_gqa8", batch=4, heads=8, heads_kv=1, seqlen_q=1, seqlen_k=150, head_dim=256,
             mask="random", mask_shape="key", bias="per_key", cache_lengths=True),
        Case("decode_d192_causal_lq5", batch=2, heads=4, heads_kv=2, seqlen_q=5, seqlen_k=77, head_dim=192,
             causal=True, mask="random", mask_shape="kv_head", bias="full"),
        # a paged cache (a block table over a shuffled, NaN-filled pool): pages of 16 keys (one
        # tile each) and of 48 (tiles of 16 inside a page), with and without cache lengths
        Case("paged_16_cache_lengths", batch=4, heads=8, heads_kv=2, seqlen_q=1, seqlen_k=96, page=16,
             mask="random", mask_shape="key", bias="per_key", cache_lengths=True),
        Case("paged_48_causal_lq4", batch=2, heads=4, heads_kv=1, seqlen_q=4, seqlen_k=144, page=48, causal=True,
             bias="kv_head"),
        # table entries naming no block (-1, the pool's size, 2^31 - 1): their keys are excluded,
        # and nothing outside the pool is read
        Case("paged_16_pages_out_of_range", batch=4, heads=8, heads_kv=2, seqlen_q=1, seqlen_k=96, page=16,
             mask="random", mask_shape="key", bias="per_key", cache_lengths=True, pages_out_of_range=True),
        Case("paged_48_pages_out_of_range_causal", batch=3, heads=4, heads_kv=1, seqlen_q=4, seqlen_k=240, page=48,
             causal=True, bias="kv_head", pages_out_of_range=True),
        # a sliding window's last 300 keys of a cache long enough for the padding mask's span pass
        # (`decode_launch.MASK_SPAN_MIN_KEYS`): the splits cut the window, not the cache
        Case("sliding_window_long_cache", batch=2, heads=8, heads_kv=2, seqlen_q=1, seqlen_k=LONG_CACHE_KEYS,
             head_dim=64, mask="window", window=300, mask_shape="key", bias="per_key", sliced=True),
    ]


def decode_cases(suite: str, block_n: int) -> list[Case]:
    """The short-query forward's cases for a config of `block_n` key columns: those of `suite`
    with at most MAX_DECODE_QUERIES query rows (tile-aware ones on its key tile, 16 query rows: a
    KV group's rows share one tile) and the KV-cache cases."""
    cases = [case for case in adversarial_cases(suite, [(16, block_n)]) if case.seqlen_q <= MAX_DECODE_QUERIES]
    return cases + [replace(case, batch=2 * case.batch) if suite == "full" else case for case in _cache_cases()]


def window_on_tiles(rule: tuple, tile_m: int, tile_n: int) -> tuple[int, int]:
    """The window_size a `Case.window_rule` gives on tiles of tile_m x tile_n (-1: unbounded side)."""
    return tuple(-1 if side is None else side[0] * tile_m + side[1] * tile_n + side[2] for side in rule)


def adversarial_cases(suite: str, tiles: list[tuple[int, int]], varlen: bool = False) -> list[Case]:
    """The cases of `suite` (the packed-sequence and window suite with `varlen`); tile-aware
    cases are repeated for each distinct (tile_m, tile_n)."""
    if suite not in SUITES:
        raise ValueError(f"suite: got {suite!r}, expected one of {sorted(SUITES)}")
    defined = VARLEN_SUITES[suite]() if varlen else SUITES[suite]()
    cases = []
    for case in defined:
        if case.mask in ("corner", "tile_holes") or case.window_rule:
            for tile_m, tile_n in dict.fromkeys(tiles):
                tiled = replace(case, name=f"{case.name}@{tile_m}x{tile_n}", tile_m=tile_m, tile_n=tile_n)
                if case.window_rule:
                    tiled = replace(tiled, window_size=window_on_tiles(case.window_rule, tile_m, tile_n))
                cases.append(tiled)
        else:
            cases.append(case)
    return cases
