"""The short-query forward (`flash_decode.py`, `decode_launch.py`) and `cache_seqlens`: against
the reference by DESIGN §2, on the inputs decode meets (GQA groups packed into one tile, split-KV,
per-sequence cache lengths over NaN-filled cache tails, dead rows), and the entry's rules."""

import pytest
import torch

from dmattn_bench import flash_dmattn_func, plan, tiles
from dmattn_bench.reference import attention
from dmattn_bench.registry import interpreter_enabled
from dmattn_bench.space import DecodeConfig
from dmattn_bench.tuning.adversarial import paged_cache
from dmattn_bench.tuning.validator import compare

pytestmark = pytest.mark.skipif(not interpreter_enabled(), reason="the CPU tier runs the kernels in the interpreter")

F32, F16 = torch.float32, torch.float16


def _case(seed, batch, seqlen_q, heads, heads_kv, seqlen_k, head_dim, dtype, mask=None, bias=None, seqlens=None):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seqlen_q, heads, head_dim, generator=generator).to(dtype)
    k, v = (torch.randn(batch, seqlen_k, heads_kv, head_dim, generator=generator).to(dtype) for _ in range(2))
    shapes = {"key": (batch, 1, 1, seqlen_k), "kv_head": (batch, heads_kv, seqlen_q, seqlen_k),
              "full": (batch, heads, seqlen_q, seqlen_k), "per_key": (batch, heads_kv, 1, seqlen_k)}
    mask = None if mask is None else torch.rand(shapes[mask], generator=generator) < 0.7
    bias = None if bias is None else torch.randn(shapes[bias], generator=generator).to(dtype)
    if seqlens is not None:
        seqlens = torch.tensor(seqlens, dtype=torch.int32)
        for b, length in enumerate(seqlens.tolist()):
            k[b, max(length, 0):] = float("nan")  # a cache's tail: never read
            v[b, max(length, 0):] = float("nan")
    return q, k, v, mask, bias, seqlens


def _check(q, k, v, mask, bias, seqlens, cache=None, **options):
    """Ours against the reference by DESIGN §2; `cache`: the (k, v) ours reads instead of k and v
    (NaN where it must never read), the reference reading the clean k and v."""
    k_read, v_read = cache if cache is not None else (k, v)
    with torch.no_grad():
        out, lse = flash_dmattn_func(q, k_read, v_read, mask, bias, return_lse=True, cache_seqlens=seqlens, **options)
    high = attention(q, k, v, mask, bias, return_lse=True, cache_seqlens=seqlens, **options)
    low = attention(q, k, v, mask, bias, return_lse=True, cache_seqlens=seqlens, compute_dtype=q.dtype, **options)
    for name, got, ref, ref_low in (("out", out, high[0], low[0]), ("lse", lse, high[1], low[1])):
        check = compare(name, got, ref, ref_low, q.dtype)
        assert check.passed, f"{name}: {check}"
    return out, lse


CASES = [
    # (batch, Lq, H, Hkv, Lk, D, dtype, mask, bias, causal, softcap, cache lengths)
    pytest.param(2, 1, 8, 2, 100, 32, F32, None, None, False, 0.0, None, id="gqa4-decode"),
    pytest.param(2, 3, 8, 2, 100, 32, F16, "kv_head", "per_key", True, 0.0, None, id="gqa4-lq3-causal-fp16"),
    pytest.param(2, 5, 4, 4, 70, 40, F32, "full", "full", True, 5.0, None, id="mha-d40-softcap"),
    pytest.param(3, 2, 8, 2, 90, 32, F32, None, "kv_head", True, 0.0, [50, 0, 90], id="seqlens-zero-and-full"),
    pytest.param(3, 1, 4, 1, 200, 16, F16, "key", None, False, 0.0, [1, 17, 300], id="mqa-seqlens-past-lk"),
    pytest.param(1, 64, 4, 2, 64, 32, F32, None, None, True, 0.0, None, id="lq64-causal"),
    pytest.param(2, 1, 16, 2, 48, 24, F32, "key", "per_key", False, 0.0, [48, 31], id="gqa8-d24"),
]


@pytest.mark.parametrize("batch, seqlen_q, heads, heads_kv, seqlen_k, head_dim, dtype, mask, bias, causal, softcap, "
                         "seqlens", CASES)
def test_matches_reference(batch, seqlen_q, heads, heads_kv, seqlen_k, head_dim, dtype, mask, bias, causal,
                           softcap, seqlens):
    q, k, v, mask, bias, seqlens = _case(1, batch, seqlen_q, heads, heads_kv, seqlen_k, head_dim, dtype, mask, bias,
                                         seqlens)
    out, lse = _check(q, k, v, mask, bias, seqlens, is_causal=causal, softcap=softcap)
    if seqlens is not None:
        empty = seqlens <= 0
        assert bool((out[empty] == 0).all()) and bool((lse[empty] == float("-inf")).all())  # dead: 0 / -inf


def test_the_calls_decode_without_gradient_and_split_the_keys(monkeypatch):
    """The plan runs the short-query kernel for these calls (not the prefill one), in more than one
    split where the interpreter's SMs leave room; the same inputs give the same bits every call."""
    from dmattn_kernels.triton import decode_launch

    built = []
    original = decode_launch.DecodePlan.__init__
    monkeypatch.setattr(decode_launch.DecodePlan, "__init__",
                        lambda self, *a, **k: original(self, *a, **k) or built.append(self))
    plan.clear()
    q, k, v, mask, bias, _ = _case(2, 1, 1, 8, 2, 120, 32, F32, "key", "per_key")
    first = _check(q, k, v, mask, bias, None)[0]
    assert len(built) == 1 and built[0].splits > 1
    with torch.no_grad():
        assert torch.equal(flash_dmattn_func(q, k, v, mask, bias), first)
    assert len(built) == 1


def test_a_forced_split_count_gives_the_same_result_within_the_bound(monkeypatch):
    q, k, v, mask, bias, seqlens = _case(3, 2, 2, 8, 2, 150, 32, F32, "kv_head", "per_key", [150, 9])
    for splits in (1, 3, 10):
        monkeypatch.setattr(tiles, "decode_config", lambda head_dim, device, splits=splits: DecodeConfig(16, 1, 1, splits))
        plan.clear()
        _check(q, k, v, mask, bias, seqlens, is_causal=True)


@pytest.fixture(params=["own-range", "span-pass"])
def span_pass(request, monkeypatch):
    """How the splits find a padding mask's kept span: each scanning its own range of the cache,
    or the span pass first (`decode_mask_span_kernel`, on from MASK_SPAN_MIN_KEYS keys: here on
    every cache, in chunks of 32 keys so that a span crosses several) and the splits cutting the
    span."""
    from dmattn_kernels.triton import decode_launch

    if request.param == "span-pass":
        monkeypatch.setattr(decode_launch, "MASK_SPAN_MIN_KEYS", 0)
        monkeypatch.setattr(decode_launch, "MASK_SPAN_CHUNK", 32)
    plan.clear()
    return request.param


def test_a_padding_masks_tail_is_never_read(span_pass):
    """K and V past the last key a padding mask keeps are not loaded (the kernel reads only the span
    of kept keys): NaN there reaches neither out nor lse, which match the reference on a clean
    cache; a sequence the mask keeps nothing of gives dead rows."""
    batch, heads, heads_kv, seqlen_k = 3, 8, 2, 150
    q, k, v, _, _, _ = _case(11, batch, 2, heads, heads_kv, seqlen_k, 32, F32)
    lengths = torch.tensor([150, 70, 0])
    mask = (torch.arange(seqlen_k) < lengths[:, None]).view(batch, 1, 1, seqlen_k)
    tail = ~mask.view(batch, seqlen_k, 1, 1)
    cache = tuple(t.masked_fill(tail, float("nan")) for t in (k, v))
    out, lse = _check(q, k, v, mask, None, None, cache=cache)
    assert bool((out[2] == 0).all()) and bool((lse[2] == float("-inf")).all())


def test_each_split_reads_only_the_span_a_padding_mask_keeps(monkeypatch, span_pass):
    """With a padding mask each split reads K and V only from the first key its range keeps to the
    last: a window inside the cache, a hole of most of it, one last key. Keys outside the span are
    never loaded (NaN there reaches neither out nor lse), keys inside it follow the mask, and every
    split count gives the reference's result on a clean cache, with and without cache_seqlens."""
    batch, heads, heads_kv, seqlen_k = 3, 8, 2, 150
    q, k, v, _, _, _ = _case(12, batch, 1, heads, heads_kv, seqlen_k, 32, F32)
    keys = torch.arange(seqlen_k)
    mask = torch.stack([(keys >= 37) & (keys < 61), (keys < 9) | (keys == 140), keys == 149])
    kept = [keys[row].tolist() for row in mask]
    outside = torch.stack([(keys < kept_keys[0]) | (keys > kept_keys[-1]) for kept_keys in kept])
    cache = tuple(t.masked_fill(outside.view(batch, seqlen_k, 1, 1), float("nan")) for t in (k, v))
    mask = mask.view(batch, 1, 1, seqlen_k)
    seqlens = torch.tensor([150, 141, 150], dtype=torch.int32)
    for splits in (1, 4, 10):
        monkeypatch.setattr(tiles, "decode_config", lambda head_dim, device, splits=splits: DecodeConfig(16, 1, 1, splits))
        plan.clear()
        for lengths in (None, seqlens):
            _check(q, k, v, mask, None, lengths, cache=cache)


def test_the_span_pass_finds_each_rows_kept_span_across_chunks(monkeypatch):
    """`decode_mask_span_kernel` writes each chunk's first kept key and one past its last (Lk and
    0 where it keeps none), for the mask row a (batch, kv head)'s programs share: a per-key mask
    read through one head, and a kv-head mask read per head."""
    from dmattn_kernels.triton import decode_launch

    monkeypatch.setattr(decode_launch, "MASK_SPAN_MIN_KEYS", 0)
    monkeypatch.setattr(decode_launch, "MASK_SPAN_CHUNK", 32)
    seqlen_k, heads, heads_kv = 100, 4, 2
    keys = torch.arange(seqlen_k)
    for mask in (torch.stack([(keys >= 30) & (keys < 70), keys == 99]).view(2, 1, 1, seqlen_k),
                 torch.stack([keys < 5, (keys > 40) & (keys % 7 == 0), torch.zeros(seqlen_k, dtype=torch.bool),
                              keys >= 64]).view(2, heads_kv, 1, seqlen_k)):
        q, k, v, _, _, _ = _case(13, 2, 1, heads, heads_kv, seqlen_k, 16, F32)
        launch = decode_launch.DecodePlan(q, k, v, mask, None, None, None, is_causal=False, softmax_scale=0.25,
                                          softcap=0.0, config=DecodeConfig(16, 1, 1, 4), out=torch.empty_like(q),
                                          lse=torch.empty(2, heads, 1), num_sms=4)
        spans = torch.full((2 * heads_kv, 2, 4), -7, dtype=torch.int32)
        launch.spans(mask, spans)
        rows = mask.expand(2, heads_kv, 1, seqlen_k).reshape(2 * heads_kv, seqlen_k)
        expected = torch.empty_like(spans)
        for row, kept in enumerate(rows):
            for chunk in range(4):
                chunk_keys = keys[chunk * 32:(chunk + 1) * 32][kept[chunk * 32:(chunk + 1) * 32]]
                expected[row, 0, chunk] = chunk_keys.min() if len(chunk_keys) else seqlen_k
                expected[row, 1, chunk] = chunk_keys.max() + 1 if len(chunk_keys) else 0
        assert torch.equal(spans, expected)


def test_new_lengths_reuse_the_plan():
    """What a CUDA graph replays: the lengths' values change, the plan (and its launches) stay."""
    plan.clear()
    q, k, v, _, _, _ = _case(4, 2, 1, 4, 2, 64, 16, F32)
    lengths = torch.tensor([64, 64], dtype=torch.int32)
    for values in ([64, 10], [5, 33], [0, 64]):
        lengths.copy_(torch.tensor(values, dtype=torch.int32))
        _check(q, k, v, None, None, lengths)
    assert len(plan.PLANS._plans) == 1


def test_cache_seqlens_with_a_gradient_is_rejected():
    q, k, v, _, _, _ = _case(5, 1, 1, 4, 2, 32, 16, F32)
    q.requires_grad_()
    with pytest.raises(ValueError, match="cache_seqlens: supported in calls that need no gradient"):
        flash_dmattn_func(q, k, v, cache_seqlens=torch.tensor([32], dtype=torch.int32))


@pytest.mark.parametrize("seqlens, error, match", [
    (torch.tensor([8], dtype=torch.int64), TypeError, "cache_seqlens: got dtype torch.int64, expected torch.int32"),
    (torch.tensor([8, 8], dtype=torch.int32), ValueError, r"cache_seqlens: got shape \(2,\), expected \(B,\) = \(1,\)"),
    ([8], TypeError, "cache_seqlens: got list, expected a torch.Tensor"),
])
def test_bad_cache_seqlens_are_named(seqlens, error, match):
    q, k, v, _, _, _ = _case(6, 1, 1, 4, 2, 32, 16, F32)
    with torch.no_grad(), pytest.raises(error, match=match):
        flash_dmattn_func(q, k, v, cache_seqlens=seqlens)


def test_cache_seqlens_needs_a_short_query():
    q, k, v, _, _, _ = _case(7, 1, 65, 4, 2, 80, 16, F32)
    with torch.no_grad(), pytest.raises(ValueError, match="cache_seqlens: supported by the short-query forward only"):
        flash_dmattn_func(q, k, v, cache_seqlens=torch.tensor([80], dtype=torch.int32))


@pytest.mark.parametrize("page", [16, 48], ids=["page16", "page48"])
def test_a_paged_cache_gives_the_contiguous_result(page):
    """The same keys through a block table over a shuffled NaN-filled pool: the same out and lse
    as the contiguous cache, bitwise (the same tiles in the same order, from other addresses),
    and within the bound of the reference."""
    q, k, v, mask, bias, seqlens = _case(8, 2, 2, 8, 2, 96, 32, F32, "key", "per_key", [96, 40])
    k, v = (torch.nan_to_num(t, nan=0.0) for t in (k, v))  # the contiguous copy: no NaN tail
    k_pool, v_pool, table = paged_cache(k, v, page, torch.Generator().manual_seed(9))
    with torch.no_grad():
        # the interpreter's default runs 16-key tiles, which every page size takes: both calls run
        # the same tiles and splits in the same order
        contiguous = flash_dmattn_func(q, k, v, mask, bias, is_causal=True, return_lse=True, cache_seqlens=seqlens)
        paged = flash_dmattn_func(q, k_pool, v_pool, mask, bias, is_causal=True, return_lse=True,
                                  cache_seqlens=seqlens, block_table=table)
    assert all(torch.equal(a, b) for a, b in zip(contiguous, paged))
    _check(q, k_pool, v_pool, mask, bias, seqlens, is_causal=True, block_table=table)


def _pool_between_nan_blocks(blocks, page, heads_kv, head_dim, generator):
    """A (blocks, page, Hkv, D) pool that is a view between two NaN blocks: a read of block -1 or
    of block `blocks` reaches NaN."""
    pool = torch.full((blocks + 2, page, heads_kv, head_dim), float("nan"))
    pool[1:-1] = torch.randn(blocks, page, heads_kv, head_dim, generator=generator)
    return pool[1:-1]


@pytest.mark.parametrize("seqlens", [None, [48, 40, 48]], ids=["full", "cache_seqlens"])
def test_pages_outside_the_cache_are_excluded_and_never_read(seqlens):
    """Issue 54: on 0f8f85e an entry of 99 or -1 with 4 blocks, inside the sequence's length,
    returned finite output from memory the caller never passed. Entries of -1, the pool's size
    and 2^31 - 1 now exclude their keys (the reference's rule); a sequence whose pages all lie
    outside is dead (out 0, lse -inf)."""
    generator = torch.Generator().manual_seed(3)
    k_pool, v_pool = (_pool_between_nan_blocks(4, 16, 2, 32, generator) for _ in range(2))
    q = torch.randn(3, 2, 8, 32, generator=generator)
    table = torch.tensor([[2, -1, 0], [4, 1, 2 ** 31 - 1], [-1, 4, -1]], dtype=torch.int32)
    lengths = None if seqlens is None else torch.tensor(seqlens, dtype=torch.int32)
    out, lse = _check(q, k_pool, v_pool, None, None, lengths, block_table=table)
    assert torch.isfinite(out).all()
    assert torch.equal(out[2], torch.zeros_like(out[2])) and (lse[2] == float("-inf")).all()
    assert torch.isfinite(lse[:2]).all()
    # the same keys as a contiguous cache whose out-of-range pages are masked out
    k, v = (torch.cat([pool[2], pool[0], pool[0]]).unsqueeze(0) for pool in (k_pool, v_pool))
    keep = torch.tensor([True] * 16 + [False] * 16 + [True] * 16).view(1, 1, 1, 48)
    with torch.no_grad():
        alone = flash_dmattn_func(q[:1], k, v, keep, return_lse=True,
                                  cache_seqlens=None if lengths is None else lengths[:1])
    assert torch.allclose(alone[0], out[:1], atol=1e-5) and torch.allclose(alone[1], lse[:1], atol=1e-5)


def test_the_page_check_mode_raises_on_a_page_outside_the_cache(monkeypatch):
    """DMATTN_BENCH_CHECK_PAGES=1 (`api.CHECK_PAGES`): a used entry outside the cache raises,
    naming it; an entry past cache_seqlens (-1: vLLM's unused page) does not."""
    from dmattn_bench import api

    monkeypatch.setattr(api, "CHECK_PAGES", True)
    k = v = torch.randn(4, 16, 2, 32)
    q = torch.randn(2, 1, 8, 32)
    table = torch.tensor([[2, 0, 3], [1, -1, 2]], dtype=torch.int32)
    with torch.no_grad(), pytest.raises(ValueError, match=r"block_table: entry \[1, 1\] is -1, outside the "
                                                          r"cache's 4 blocks"):
        flash_dmattn_func(q, k, v, block_table=table)
    with torch.no_grad(), pytest.raises(ValueError, match=r"entry \[0, 2\] is 4"):
        flash_dmattn_func(q, k, v, block_table=torch.tensor([[2, 0, 4], [1, 0, 2]], dtype=torch.int32))
    with torch.no_grad():
        out = flash_dmattn_func(q, k, v, block_table=table, cache_seqlens=torch.tensor([48, 16], dtype=torch.int32))
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("table, key_shape, error, match", [
    (torch.zeros(1, 2, dtype=torch.int64), (4, 16, 2, 16), TypeError, "block_table: got dtype torch.int64"),
    (torch.zeros(2, 2, dtype=torch.int32), (4, 16, 2, 16), ValueError, r"block_table: got shape \(2, 2\), expected \(B, pages\) = \(1, pages\)"),
    (torch.zeros(1, 2, dtype=torch.int32), (4, 24, 2, 16), ValueError, "with a page of a multiple of 16 keys"),
    # every other entry of a row: the kernel steps through a row by 1 and would read the others
    (torch.zeros(1, 4, dtype=torch.int32)[:, ::2], (4, 16, 2, 16), ValueError,
     r"block_table: got strides \(4, 2\), expected stride 1 along the pages"),
])
def test_bad_block_tables_are_named(table, key_shape, error, match):
    q = torch.randn(1, 1, 4, 16)
    k = v = torch.randn(key_shape)
    with torch.no_grad(), pytest.raises(error, match=match):
        flash_dmattn_func(q, k, v, block_table=table)


def test_strided_cache_seqlens_are_named():
    """Sequence b's length is read at offset b: every other element of a longer tensor is refused."""
    q, k = torch.randn(2, 1, 4, 16), torch.randn(2, 32, 2, 16)
    lengths = torch.tensor([32, 0, 9, 0], dtype=torch.int32)[::2]
    with torch.no_grad(), pytest.raises(ValueError, match="cache_seqlens: got stride 2, expected 1"):
        flash_dmattn_func(q, k, k, cache_seqlens=lengths)


def test_a_paged_call_with_a_gradient_is_rejected():
    q = torch.randn(1, 1, 4, 16, requires_grad=True)
    k = v = torch.randn(4, 16, 2, 16)
    with pytest.raises(ValueError, match="block_table: supported in calls that need no gradient"):
        flash_dmattn_func(q, k, v, block_table=torch.zeros(1, 2, dtype=torch.int32))


def test_the_verify_suite_runs_the_span_pass_on_a_window_of_a_long_cache():
    """`verify` covers the span pass: a KV-cache case whose padding mask (a sliding window) sits on
    a cache at least MASK_SPAN_MIN_KEYS long, and that case matches the reference."""
    from dataclasses import replace

    from dmattn_bench.tuning.adversarial import _cache_cases, build_inputs
    from dmattn_kernels.triton import decode_launch

    long_cases = [case for case in _cache_cases()
                  if case.seqlen_k >= decode_launch.MASK_SPAN_MIN_KEYS and case.mask_shape == "key"]
    assert [case.name for case in long_cases] == ["sliding_window_long_cache"]
    case = replace(long_cases[0], head_dim=16)  # the interpreter's size; the GPU runs it whole
    inputs = build_inputs(case, torch.float32, "cpu")
    plan.clear()
    _check(inputs.q, inputs.k, inputs.v, inputs.mask, inputs.bias, None)
    (built,) = plan.PLANS._plans.values()
    assert built._decode_launch.spans is not None
