"""The short-query forward's sliding window (`flash_decode.py`'s HAS_WINDOW, `DecodePlan(window=)`)
against the reference's `window_size` by DESIGN §2: windows narrower than a key tile and on tile
corners, a left or right side alone, per-sequence cache lengths (dead rows), masks, biases,
a paged cache, several query rows whose windows differ, several row blocks and split counts.

Beyond the result, the reads: K, V and the bias hold NaN outside every row's window (a product
with one would show), and the interpreter's loads are traced (`loads`), so a test sees every
element a kernel read. The key tiles a program visits are counted by the page-table entries it
reads (one per visited tile) and by its dots (two per tile).
"""

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from dmattn_bench.reference import attention
from dmattn_bench.registry import interpreter_enabled
from dmattn_bench.space import DecodeConfig
from dmattn_bench.tuning.adversarial import paged_cache
from dmattn_bench.tuning.validator import compare

ROOT = Path(__file__).resolve().parents[1]
F32, F16 = torch.float32, torch.float16
interpreted = pytest.mark.skipif(not interpreter_enabled(), reason="the CPU tier runs the kernels in the interpreter")
INTERPRETER_SMS = 4


# -- what the reference says each row sees ---------------------------------------------------------


def row_windows(seqlen_q: int, lengths: list[int], window: tuple[int, int], causal: bool) -> list[list[range]]:
    """Per sequence and query row, the keys the window and the causal rule leave it (possibly none)."""
    left, right = window
    windows = []
    for length in lengths:
        rows = []
        for i in range(seqlen_q):
            diagonal = i + length - seqlen_q
            first = 0 if left < 0 else max(diagonal - left, 0)
            last = length - 1 if right < 0 else min(diagonal + right, length - 1)
            if causal:
                last = min(last, diagonal)
            rows.append(range(first, last + 1))
        windows.append(rows)
    return windows


def union(rows: list[range]) -> set[int]:
    return {j for keys in rows for j in keys}


# -- inputs ----------------------------------------------------------------------------------------

SHAPES = {"key": lambda b, lq, h, hkv, lk: (b, 1, 1, lk), "per_key": lambda b, lq, h, hkv, lk: (b, hkv, 1, lk),
          "kv_head": lambda b, lq, h, hkv, lk: (b, hkv, lq, lk), "full": lambda b, lq, h, hkv, lk: (b, h, lq, lk)}


def make_case(seed, batch, seqlen_q, heads, heads_kv, seqlen_k, head_dim, dtype, mask, bias):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seqlen_q, heads, head_dim, generator=generator).to(dtype)
    k, v = (torch.randn(batch, seqlen_k, heads_kv, head_dim, generator=generator).to(dtype) for _ in range(2))
    shape = lambda kind: SHAPES[kind](batch, seqlen_q, heads, heads_kv, seqlen_k)  # noqa: E731
    mask = None if mask is None else torch.rand(shape(mask), generator=generator) < 0.7
    bias = None if bias is None else torch.randn(shape(bias), generator=generator).to(dtype)
    return q, k, v, mask, bias


def poisoned(k, v, bias, windows):
    """k, v and bias with NaN wherever no row may read them: K and V outside every row's window of
    their sequence, the bias outside its row's window (outside every row's, for a bias without rows)."""
    k, v = k.clone(), v.clone()
    for b, rows in enumerate(windows):
        outside = torch.tensor([j not in union(rows) for j in range(k.shape[1])])
        k[b, outside] = float("nan")
        v[b, outside] = float("nan")
    if bias is not None:
        bias = bias.clone()
        for b, rows in enumerate(windows):
            for i in range(bias.shape[2]):
                keys = union(rows) if bias.shape[2] == 1 else set(rows[i])
                bias[b, :, i, [j for j in range(bias.shape[3]) if j not in keys]] = float("nan")
    return k, v, bias


# -- running and tracing ---------------------------------------------------------------------------


@pytest.fixture
def loads(monkeypatch):
    """Per program (its grid index), the addresses every interpreted load reads (only the lanes
    the load's mask keeps) and the count of dots, from here to the test's end."""
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if not hasattr(builder, "create_masked_load") or not hasattr(builder, "create_dot"):
        pytest.skip("this Triton's interpreter has no load and dot hooks to trace")
    traced = {"addresses": [], "dots": Counter()}
    load, dot = builder.create_masked_load, builder.create_dot

    def masked_load(self, ptrs, mask, *args):
        addresses = np.asarray(ptrs.data[np.broadcast_to(mask.data, ptrs.data.shape)]).ravel().astype(np.uint64)
        traced["addresses"].append((tuple(self.grid_idx), addresses))
        return load(self, ptrs, mask, *args)

    def counted_dot(self, *args):
        traced["dots"][tuple(self.grid_idx)] += 1
        return dot(self, *args)

    monkeypatch.setattr(builder, "create_masked_load", masked_load)
    monkeypatch.setattr(builder, "create_dot", counted_dot)
    return traced


def elements_read(traced, t: torch.Tensor, program: tuple | None = None) -> np.ndarray:
    """The indices (one row per element, `t`'s dims) of the elements of contiguous `t` the traced
    loads read (those of one program where given)."""
    assert t.is_contiguous()
    addresses = np.concatenate([a for where, a in traced["addresses"] if program in (None, where)]
                               or [np.zeros(0, np.uint64)])
    base, size = t.data_ptr(), t.numel() * t.element_size()
    inside = addresses[(addresses >= base) & (addresses < base + size)]
    flat = (inside - np.uint64(base)) // np.uint64(t.element_size())
    return np.stack(np.unravel_index(flat.astype(np.int64), tuple(t.shape)), axis=1)


def run(q, k, v, mask, bias, seqlens=None, block_table=None, *, window, causal=False, softcap=0.0, block_n=16,
        splits=0):
    """The short-query forward into NaN-poisoned out and lse (DESIGN §2.3): (out, lse, plan)."""
    from dmattn_kernels.triton.decode_launch import DecodePlan

    out = torch.full(q.shape, float("nan"), dtype=q.dtype)
    lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("nan"))
    launch = DecodePlan(q, k, v, mask, bias, seqlens, block_table, is_causal=causal,
                        softmax_scale=q.shape[-1] ** -0.5, softcap=softcap, config=DecodeConfig(block_n, 1, 1, splits),
                        out=out, lse=lse, num_sms=INTERPRETER_SMS, window=window)
    launch(q, k, v, mask, bias, seqlens, block_table, out, lse)
    return out, lse, launch


def check_against_reference(out, lse, q, k, v, mask, bias, seqlens, *, window, causal=False, softcap=0.0):
    """DESIGN §2 rules 1 and 2 (the project's decode tests' rule) against the reference on clean
    inputs, and dead rows exactly 0 / -inf."""
    options = dict(is_causal=causal, softcap=softcap, cache_seqlens=seqlens, window_size=window, return_lse=True)
    high = attention(q, k, v, mask, bias, **options)
    low = attention(q, k, v, mask, bias, compute_dtype=q.dtype, **options)
    for name, got, ref, ref_low in (("out", out, high[0], low[0]), ("lse", lse, high[1], low[1])):
        result = compare(name, got, ref, ref_low, q.dtype)
        assert result.passed, f"{name}: {result}"
    dead = high[1] == float("-inf")  # (B, H, Lq)
    assert bool((lse[dead] == float("-inf")).all())
    assert bool((out.transpose(1, 2)[dead] == 0).all())
    return dead


def program_queries(launch, program: tuple, seqlen_q: int) -> range:
    """The query rows of the decode program at grid index (split, b * Hkv + h_kv, row block)."""
    block_m, group = launch.decode.constexprs["BLOCK_M"], launch.decode.constexprs["GROUP"]
    return range(program[2] * block_m // group, min(((program[2] + 1) * block_m - 1) // group + 1, seqlen_q))


def assert_reads_inside(traced, tensor, windows, launch, key_dim: int, row_dim: int | None = None):
    """Every element of `tensor` a decode program read lies inside the window of one of its own
    query rows (of the row the element belongs to, for a tensor with a query dim `row_dim` > 1)."""
    seqlen_q, heads_kv = len(windows[0]), launch.decode.grid[1] // len(windows)
    programs = {where for where, _ in traced["addresses"]}
    for program in programs:
        b = program[1] // heads_kv
        queries = program_queries(launch, program, seqlen_q)
        allowed = union([windows[b][i] for i in queries])
        for index in elements_read(traced, tensor, program):
            assert int(index[0]) == b, f"program {program} read sequence {int(index[0])}'s element"
            j = int(index[key_dim])
            has_rows = row_dim is not None and tensor.shape[row_dim] > 1
            keys = set(windows[b][int(index[row_dim])]) if has_rows else allowed
            assert j in keys, f"program {program} read {tuple(index.tolist())}: key {j} outside its rows' windows"


CASES = [
    # (batch, Lq, H, Hkv, Lk, D, dtype, mask, bias, causal, softcap, window, cache lengths)
    pytest.param(2, 1, 8, 2, 100, 32, F32, None, None, True, 0.0, (5, -1), None, id="narrower-than-a-tile"),
    pytest.param(2, 4, 8, 2, 100, 32, F16, None, None, True, 0.0, (3, 0), None, id="narrower-than-a-tile-lq4-fp16"),
    # Lq=1: keys [64, 95], tiles 4 and 5 of 16 exactly
    pytest.param(1, 1, 4, 2, 96, 32, F32, None, None, False, 0.0, (31, -1), None, id="tile-corners"),
    # Lq=4: rows' lower bounds 32..35, the last row's upper bound 95 (the end of tile 5)
    pytest.param(1, 4, 4, 2, 96, 32, F16, None, "per_key", True, 0.0, (60, -1), None, id="tile-corners-lq4-fp16"),
    pytest.param(2, 4, 8, 2, 80, 32, F32, None, None, False, 0.0, (0, 2), None, id="left0-right2-noncausal"),
    pytest.param(2, 4, 4, 4, 70, 16, F32, None, "full", False, 0.0, (-1, 1), None, id="right-only-noncausal"),
    # sequence 1 (2 keys): rows 0 and 1 see no key; sequence 2 has none
    pytest.param(4, 4, 8, 2, 90, 32, F32, None, None, False, 0.0, (1, 0), [90, 2, 0, 37], id="seqlens-dead-rows"),
    pytest.param(3, 4, 8, 2, 90, 32, F16, None, None, True, 0.0, (20, -1), [90, 33, 5], id="seqlens-fp16"),
    pytest.param(2, 4, 8, 2, 120, 32, F16, "kv_head", "full", True, 0.0, (40, -1), [120, 57], id="mask-bias-fp16"),
    pytest.param(2, 1, 8, 2, 150, 32, F32, "key", "per_key", False, 0.0, (50, 0), [150, 77], id="padding-mask"),
    pytest.param(2, 3, 4, 4, 64, 40, F32, "full", "full", False, 5.0, (9, 1), [64, 30], id="mha-d40-softcap"),
    # 24 queries x a group of 4: two row blocks of 64 rows, each with its own span
    pytest.param(1, 24, 8, 2, 200, 16, F32, None, "per_key", True, 0.0, (30, -1), None, id="two-row-blocks"),
    pytest.param(2, 24, 8, 2, 160, 16, F32, "key", None, False, 0.0, (10, 3), [160, 70], id="two-row-blocks-right"),
]


@interpreted
@pytest.mark.parametrize("splits", [1, 3, 0], ids=["1-split", "3-splits", "auto-splits"])
@pytest.mark.parametrize("batch, seqlen_q, heads, heads_kv, seqlen_k, head_dim, dtype, mask, bias, causal, softcap, "
                         "window, seqlens", CASES)
def test_matches_reference_and_reads_only_the_window(loads, splits, batch, seqlen_q, heads, heads_kv, seqlen_k,
                                                     head_dim, dtype, mask, bias, causal, softcap, window, seqlens):
    """out and lse within the §2 bound of the reference's window; NaN in K, V and the bias outside
    the window reaches neither; no K, V, mask or bias element outside a window is read."""
    q, k, v, mask, bias = make_case(1, batch, seqlen_q, heads, heads_kv, seqlen_k, head_dim, dtype, mask, bias)
    lengths = [seqlen_k] * batch if seqlens is None else [max(0, min(n, seqlen_k)) for n in seqlens]
    seqlens = None if seqlens is None else torch.tensor(seqlens, dtype=torch.int32)
    windows = row_windows(seqlen_q, lengths, window, causal)
    k_read, v_read, bias_read = poisoned(k, v, bias, windows)
    out, lse, launch = run(q, k_read, v_read, mask, bias_read, seqlens, window=window, causal=causal, softcap=softcap,
                           splits=splits)
    assert launch.decode.constexprs["HAS_WINDOW"]
    check_against_reference(out, lse, q, k, v, mask, bias, seqlens, window=window, causal=causal, softcap=softcap)
    assert len(elements_read(loads, k_read)) > 0  # the trace sees the loads
    for t in (k_read, v_read):
        assert_reads_inside(loads, t, windows, launch, key_dim=1)
    for t in (mask, bias_read):
        if t is not None:
            assert_reads_inside(loads, t, windows, launch, key_dim=3, row_dim=2)


@interpreted
@pytest.mark.parametrize("page", [16, 32])
@pytest.mark.parametrize("seqlen_q, window, causal, lengths", [
    (1, (31, -1), True, [96, 70]),   # sequence 0: keys [64, 95], tiles 4-5; sequence 1: [38, 69]
    (4, (17, 0), False, [96, 50]),  # rows' windows [75, 92] ... [78, 95]; [29, 46] ... [32, 49]
    (4, (5, -1), True, [96, 3]),    # sequence 1: row 0 sees no key
], ids=["lq1", "lq4", "lq4-dead-rows"])
def test_a_paged_cache_visits_only_the_pages_of_the_window(loads, page, seqlen_q, window, causal, lengths):
    """Through a block table over a NaN-filled pool, with NaN outside the window as well: the
    reference's result, and the table entries read, one per key tile visited, are exactly the
    pages the window's keys lie on."""
    q, k, v, mask, bias = make_case(2, 2, seqlen_q, 8, 2, 96, 32, F32, "kv_head", None)
    seqlens = torch.tensor(lengths, dtype=torch.int32)
    windows = row_windows(seqlen_q, lengths, window, causal)
    k_read, v_read, _ = poisoned(k, v, None, windows)
    k_pool, v_pool, table = paged_cache(k_read, v_read, page, torch.Generator().manual_seed(3), seqlens)
    for splits in (1, 4):
        loads["addresses"].clear()
        out, lse, _ = run(q, k_pool, v_pool, mask, None, seqlens, table, window=window, causal=causal, splits=splits)
        check_against_reference(out, lse, q, k, v, mask, None, seqlens, window=window, causal=causal)
        read = {(int(b), int(p)) for b, p in elements_read(loads, table)}
        expected = {(b, j // page) for b, rows in enumerate(windows) for j in union(rows)}
        assert read == expected, (f"splits={splits}: pages read beyond the window {sorted(read - expected)}, "
                                  f"missed {sorted(expected - read)}")


@interpreted
@pytest.mark.parametrize("window, tiles", [((31, -1), 2), ((40, -1), 3), ((0, -1), 1)])
def test_a_short_window_of_a_long_cache_costs_its_own_tiles(loads, window, tiles):
    """A window of a few tiles at the end of a 1024-key cache: the programs visit only the tiles
    the window touches (two dots each), and the splits share them evenly."""
    batch, heads_kv = 2, 2
    q, k, v, _, _ = make_case(3, batch, 1, 8, heads_kv, 1024, 16, F32, None, None)
    for splits in (1, 4, 0):
        loads["dots"].clear()
        out, lse, launch = run(q, k, v, None, None, window=window, causal=True, splits=splits)
        check_against_reference(out, lse, q, k, v, None, None, None, window=window, causal=True)
        assert launch.splits <= tiles + 1
        assert sum(loads["dots"].values()) == 2 * tiles * batch * heads_kv, f"splits={splits}"
        assert max(loads["dots"].values()) == 2 * -(-tiles // launch.splits), f"splits={splits}: {loads['dots']}"


@interpreted
def test_a_window_that_no_key_is_in_gives_dead_rows(loads):
    """A mask that keeps no key inside the window (only keys outside it) and a sequence too short
    for its rows' windows: dead rows, out 0 and lse -inf, and nothing outside the window read."""
    batch, seqlen_q, seqlen_k = 2, 4, 64
    q, k, v, _, _ = make_case(4, batch, seqlen_q, 4, 2, seqlen_k, 16, F32, None, None)
    window = (3, 0)
    windows = row_windows(seqlen_q, [seqlen_k, 2], window, False)
    mask = torch.ones(batch, 1, 1, seqlen_k, dtype=torch.bool)
    mask[0, ..., 57:] = False  # sequence 0's rows see keys 57-63 at most
    seqlens = torch.tensor([seqlen_k, 2], dtype=torch.int32)
    k_read, v_read, _ = poisoned(k, v, None, windows)
    out, lse, launch = run(q, k_read, v_read, mask, None, seqlens, window=window, splits=2)
    dead = check_against_reference(out, lse, q, k, v, mask, None, seqlens, window=window)
    assert bool(dead[0].all()) and bool(dead[1, :, :2].all()) and not bool(dead[1, :, 2:].any())
    assert_reads_inside(loads, mask, windows, launch, key_dim=3)


@pytest.fixture
def span_pass(monkeypatch):
    """The padding mask's span pass on every cache, in 32-key chunks (a span crosses several)."""
    from dmattn_kernels.triton import decode_launch

    monkeypatch.setattr(decode_launch, "MASK_SPAN_MIN_KEYS", 0)
    monkeypatch.setattr(decode_launch, "MASK_SPAN_CHUNK", 32)


@interpreted
@pytest.mark.parametrize("seqlen_q, window, causal, runs_pass", [
    (4, (-1, 1), False, True), (4, (-1, 0), False, True), (24, (-1, 3), False, True),  # 24: two row blocks
    (4, (20, -1), True, False), (4, (7, 2), False, False)])
def test_the_span_pass_runs_only_under_a_window_without_a_left_bound(loads, span_pass, seqlen_q, window, causal,
                                                                    runs_pass):
    """Where the window leaves the left side unbounded, the rows' windows together span every key
    of the sequence and the span pass runs as without a window, the splits cutting its span up to
    each program's window's end (a program of the first rows stops before the last keys); under a
    left bound the window is the span, no pass runs and no mask flag outside the window is read."""
    batch, seqlen_k = 3, 150
    q, k, v, _, _ = make_case(5, batch, seqlen_q, 8, 2, seqlen_k, 32, F32, None, None)
    keys = torch.arange(seqlen_k)
    mask = torch.stack([(keys >= 37) & (keys < 140), (keys < 9) | (keys > 120), keys == 149])
    mask = mask.view(batch, 1, 1, seqlen_k)
    windows = row_windows(seqlen_q, [seqlen_k] * batch, window, causal)
    k_read, v_read, _ = poisoned(k, v, None, windows)
    for splits in (1, 4):
        loads["addresses"].clear()
        out, lse, launch = run(q, k_read, v_read, mask, None, window=window, causal=causal, splits=splits)
        assert (launch.spans is not None) == (runs_pass and launch.splits > 1)  # one split cuts nothing
        check_against_reference(out, lse, q, k, v, mask, None, None, window=window, causal=causal)
        assert_reads_inside(loads, k_read, windows, launch, key_dim=1)
        if not runs_pass:
            assert_reads_inside(loads, mask, windows, launch, key_dim=3)


@pytest.mark.parametrize("window, seqlen_q, causal, has_window", [
    ((-1, -1), 4, False, False),
    ((-1, 5), 4, True, False),    # the causal rule bounds the right side already
    ((-1, 3), 4, False, False),   # right >= Lq - 1: the last key is in every row's window
    ((99, -1), 1, True, False),   # left >= Lk - 1: so is key 0
    ((99, 2), 4, False, True),
    ((-1, 2), 4, False, True),
    ((98, 0), 4, True, True),
    ((0, 0), 1, False, True),
])
def test_a_window_runs_the_windowed_kernel_where_it_excludes_a_key(window, seqlen_q, causal, has_window):
    """HAS_WINDOW where some row's window leaves out a key of a 100-key cache, else the plain kernel."""
    from dmattn_kernels.triton.decode_launch import DecodePlan

    q, k, v, _, _ = make_case(7, 1, seqlen_q, 4, 2, 100, 16, F32, None, None)
    launch = DecodePlan(q, k, v, None, None, None, None, is_causal=causal, softmax_scale=0.25, softcap=0.0,
                        config=DecodeConfig(16, 1, 1, 0), out=torch.empty_like(q), lse=torch.empty(1, 4, seqlen_q),
                        num_sms=INTERPRETER_SMS, window=window)
    assert launch.decode.constexprs["HAS_WINDOW"] == has_window


@interpreted
def test_a_window_that_excludes_nothing_runs_the_plain_kernel():
    """A window no key is outside of runs without HAS_WINDOW, bit for bit the call without one."""
    q, k, v, mask, bias = make_case(6, 2, 4, 8, 2, 70, 16, F32, "kv_head", "per_key")
    plain = run(q, k, v, mask, bias, window=(-1, -1), causal=True, splits=3)
    for window in ((69, -1), (-1, 7), (500, 500)):
        windowed = run(q, k, v, mask, bias, window=window, causal=True, splits=3)
        assert not windowed[2].decode.constexprs["HAS_WINDOW"]
        assert torch.equal(windowed[0], plain[0]) and torch.equal(windowed[1], plain[1])


# cross-compiles the windowed variants in this child's process, its kernels JIT functions (not interpreted)
CROSS_COMPILE = """
import json, sys
from dmattn_bench.space import DecodeConfig
from dmattn_bench.tuning.prune import compile_candidate
candidate = compile_candidate("decode", DecodeConfig(64, 4, 2, 0), sys.argv[1], 128, "bf16",
                              features=json.loads(sys.argv[2]))
print(json.dumps([candidate.status, candidate.reason]))
"""


@pytest.mark.parametrize("arch", ["sm90"])
def test_the_windowed_kernel_cross_compiles(arch):
    """The window's code compiles for the GPU (`prune.compile_candidate`: `triton.compile` with a
    cuda GPUTarget, no GPU needed), in a child process whose kernels are not interpreted: paged
    and contiguous, with a shared mask's scan and with the span pass, with and without a mask."""
    pytest.importorskip("triton.backends.nvidia", reason="this Triton has no CUDA backend to cross-compile with")
    variants = [dict(HAS_WINDOW=True),
                dict(HAS_WINDOW=True, PAGED=False, PAGE_SIZE=0, MASK_SHARED=True, BIAS_SHARED=True),
                dict(HAS_WINDOW=True, MASK_SHARED=True, MASK_SPANS=True, SPAN_CHUNKS=16),
                dict(HAS_WINDOW=True, IS_CAUSAL=False, HAS_MASK=False, HAS_BIAS=False, HAS_SEQLENS=False,
                     PAGED=False, PAGE_SIZE=0)]
    environment = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", CROSS_COMPILE, arch, json.dumps(variants)], capture_output=True,
                          text=True, env=environment, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    status, reason = json.loads(done.stdout.splitlines()[-1])
    assert status == "fits", reason
