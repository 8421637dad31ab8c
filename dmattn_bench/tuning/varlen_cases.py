"""The packed-sequence and sliding-window half of the adversarial suite (DESIGN §2), which the
configs of dispatch-table keys with `packed` or `window` run (`adversarial_cases(..., varlen=True)`),
and the input builder of a packed case (`build_packed_inputs`).

A packed case's inputs are FlashAttention's varlen operands as `flash_dmattn_varlen_func` takes
them (q (total_q, H, D), k and v (total_k, Hkv, D), a mask or bias per key (H|Hkv|1, total_k) or
per query row (H|Hkv|1, total_q, max_seqlen_k)), each a view into a larger buffer whose memory
around it (before the first row, past `total`, past a row's last column) holds NaN, or True for
a mask; the suite's cases (`sliced`) also hold NaN past the head dim of each K and V row. Inside, NaN wherever no query row may read:

- the keys (K, V and a per-key bias) of a sequence without query rows: the cases put such
  sequences between live ones, so a program that reads its neighbour's keys meets NaN;
- keys past a sequence's `seqused_k` count, and the rows and keys no sequence owns (`Case.unowned`);
- a per-row bias's columns past its sequence's keys (a per-row mask holds True there: reading it
  would let a key in), and, with `bias_poison`, the bias wherever the mask, the causal rule or
  the window excludes a key.

Any read outside a program's own sequence and window reaches a result as NaN (predicated loads
give 0, and 0 * NaN is NaN).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import accumulate

import torch

from dmattn_bench.tuning.case import KEEP_PROBABILITY, LARGE_BIAS, NAN_TAIL, NO_WINDOW, Case, Inputs, window_visible

NAN_PAST_HEAD_DIM = 8  # NaN lanes past the head dim of a sliced packed case's K and V rows
# Window rules (`Case.window_rule`): per side (a, b, c) for a * tile_m + b * tile_n + c keys, None unbounded
KEY_TILE = (0, 1, 0)  # a key tile: the window's edge on a key-tile edge for rows on a query-tile edge
KEY_TILE_LESS_ONE = (0, 1, -1)  # one key short: the edge one column inside a tile
ROW_TILE = (1, 0, 0)  # a query tile
ROW_TILE_LESS_ONE = (1, 0, -1)


@dataclass(frozen=True)
class PackedLayout:
    """Where a packed case's sequences lie: prefix sums, key counts and totals."""

    queries: tuple[int, ...]  # query rows per sequence
    used: tuple[int, ...]  # keys per sequence (seqused_k, else the span)
    cu_seqlens_q: tuple[int, ...]
    cu_seqlens_k: tuple[int, ...]
    total_q: int
    total_k: int

    @property
    def max_seqlens(self) -> tuple[int, int]:
        return max(self.queries, default=0), max(self.used, default=0)


def packed_layout(case: Case) -> PackedLayout:
    """The layout of `case.documents` (and `documents_k`, `seqused`, `unowned`)."""
    spans = case.documents_k or case.documents
    if len(spans) != len(case.documents) or (case.seqused and len(case.seqused) != len(spans)):
        raise ValueError(f"{case.name}: documents, documents_k and seqused name different sequence counts")
    used = case.seqused or spans
    if any(not 0 <= n <= span for n, span in zip(used, spans)):
        raise ValueError(f"{case.name}: seqused {used} outside the spans {spans}")
    cu_q = tuple(accumulate(case.documents, initial=case.unowned))
    cu_k = tuple(accumulate(spans, initial=case.unowned))
    return PackedLayout(tuple(case.documents), tuple(used), cu_q, cu_k, cu_q[-1] + case.unowned,
                        cu_k[-1] + case.unowned)


def _surrounded(values: torch.Tensor, dim: int, fill, extra_last: int = 0) -> torch.Tensor:
    """`values` as a view into a `fill` buffer with NAN_TAIL more entries before and after it
    along `dim`, and `extra_last` more along the last dim."""
    shape = list(values.shape)
    shape[dim] += 2 * NAN_TAIL
    shape[-1] += extra_last
    buffer = torch.full(shape, fill, dtype=values.dtype, device=values.device)
    view = buffer.narrow(dim, NAN_TAIL, values.shape[dim])[..., :values.shape[-1]]
    view.copy_(values)
    return view


def _per_head(mask: torch.Tensor, heads: int, group: int) -> torch.Tensor:
    """A per-row mask's (h, Lq, Lk) slice seen from `heads` heads (a bias's): the positions a
    head of the bias serves is kept if any query head it serves keeps it."""
    if mask.shape[0] == heads or mask.shape[0] == 1:
        return mask.expand(heads, *mask.shape[1:])
    if mask.shape[0] < heads:  # a mask per KV head read by a bias per query head
        return mask.repeat_interleave(group, dim=0)
    return mask.view(heads, -1, *mask.shape[1:]).any(dim=1)  # a mask per query head, a bias per KV head


def _reads(layout: PackedLayout, device) -> torch.Tensor:
    """(total_k,) bool: the keys some query row may read (those of sequences with query rows,
    up to their key counts)."""
    read = torch.zeros(layout.total_k, dtype=torch.bool, device=device)
    for s, (rows, keys) in enumerate(zip(layout.queries, layout.used)):
        if rows:
            read[layout.cu_seqlens_k[s]:layout.cu_seqlens_k[s] + keys] = True
    return read


def _packed_mask(case: Case, layout: PackedLayout, generator, device) -> torch.Tensor:
    """(1, total_k) per key (`mask_shape` "key") or (H|Hkv, total_q, max_seqlen_k) per row."""
    cu_q, cu_k = layout.cu_seqlens_q, layout.cu_seqlens_k
    if case.mask_shape == "key":
        keep = torch.rand((1, layout.total_k), generator=generator, device=device) < KEEP_PROBABILITY
        keep[:, ~_reads(layout, device)] = True  # reading one would let a key in
        for s in case.dead_documents:
            keep[:, cu_k[s]:cu_k[s + 1]] = False
        return _surrounded(keep, 1, True)
    heads = case.heads if case.mask_shape == "full" else case.heads_kv
    max_k = layout.max_seqlens[1]
    keep = torch.rand((heads, layout.total_q, max_k), generator=generator, device=device) < KEEP_PROBABILITY
    owned = torch.zeros(layout.total_q, dtype=torch.bool, device=device)
    for s, keys in enumerate(layout.used):
        rows = slice(cu_q[s], cu_q[s + 1])
        owned[rows] = True
        keep[:, rows, keys:] = True  # columns past the sequence's keys
        if s in case.dead_documents:
            keep[:, rows, :keys] = False
    keep[:, ~owned] = True
    return _surrounded(keep, 1, True, extra_last=NAN_TAIL)


def _packed_bias(case: Case, layout: PackedLayout, mask: torch.Tensor | None, dtype, generator, device):
    """(Hkv, total_k) per key (`bias` "per_key") or (H|Hkv, total_q, max_seqlen_k) per row, NaN
    wherever no row may read it (module docstring)."""
    bias_dtype = torch.float32 if case.bias_fp32 else dtype
    scale = LARGE_BIAS[dtype] if case.large_bias else 1.0
    cu_q, cu_k = layout.cu_seqlens_q, layout.cu_seqlens_k
    if case.bias == "per_key":
        values = torch.randn((case.heads_kv, layout.total_k), generator=generator, device=device) * scale
        values[:, ~_reads(layout, device)] = float("nan")
        return _surrounded(values.to(bias_dtype), 1, float("nan"))
    heads = case.heads if case.bias == "full" else case.heads_kv
    max_k = layout.max_seqlens[1]
    values = torch.randn((heads, layout.total_q, max_k), generator=generator, device=device) * scale
    owned = torch.zeros(layout.total_q, dtype=torch.bool, device=device)
    poison = {None: None, "nan": float("nan"), "+inf": float("inf"), "-inf": float("-inf"),
              "finfo.min": torch.finfo(bias_dtype).min}[case.bias_poison]
    for s, (lq, lk) in enumerate(zip(layout.queries, layout.used)):
        rows = slice(cu_q[s], cu_q[s + 1])
        owned[rows] = True
        values[:, rows, lk:] = float("nan")  # columns past the sequence's keys
        if poison is None or not lq:
            continue
        excluded = torch.zeros((heads, lq, lk), dtype=torch.bool, device=device)
        if case.causal:
            excluded |= ~window_visible(lq, lk, (-1, 0), device)
        if case.window_size != NO_WINDOW:
            excluded |= ~window_visible(lq, lk, case.window_size, device)
        if mask is not None:
            seen = mask[:, cu_k[s]:cu_k[s] + lk].unsqueeze(1) if mask.dim() == 2 else mask[:, rows, :lk]
            excluded |= ~_per_head(seen.expand(seen.shape[0], lq, lk), heads, case.heads // case.heads_kv)
        part = values[:, rows, :lk]
        part[excluded] = poison
    values[:, ~owned] = float("nan")
    return _surrounded(values.to(bias_dtype), 1, float("nan"), extra_last=NAN_TAIL)


def build_packed_inputs(case: Case, dtype: torch.dtype, device, generator) -> Inputs:
    """A packed case's inputs (`adversarial.build_inputs` for a case with `documents`)."""
    layout = packed_layout(case)
    heads, heads_kv, head_dim = case.heads, case.heads_kv, case.head_dim

    def randn(shape, scale=1.0):
        return (torch.randn(shape, generator=generator, device=device, dtype=torch.float32) * scale).to(dtype)

    first, end = layout.cu_seqlens_q[0], layout.cu_seqlens_q[-1]
    q = randn((layout.total_q, heads, head_dim), case.logit_factor)
    q[:first] = float("nan")  # rows no sequence owns: never read
    q[end:] = float("nan")
    unread = ~_reads(layout, device)
    k, v = randn((layout.total_k, heads_kv, head_dim), case.logit_factor), randn((layout.total_k, heads_kv, head_dim))
    k[unread] = float("nan")
    v[unread] = float("nan")
    mask = None if case.mask == "none" else _packed_mask(case, layout, generator, device)
    bias = None if case.bias == "none" else _packed_bias(case, layout, mask, dtype, generator, device)
    int32 = dict(dtype=torch.int32, device=device)
    sequences = (torch.tensor(layout.cu_seqlens_q, **int32), torch.tensor(layout.cu_seqlens_k, **int32),
                 torch.tensor(layout.used, **int32) if case.seqused else None)
    # NaN past the head dim makes the K/V rows' strides no multiple of 16 elements, so Triton
    # cannot vectorise their loads: the suite's cases (sliced) have it, a tuning workload keeps a
    # user's contiguous rows, or it times other code than calls run (H200, packed causal forward:
    # 1.9x slower at 128x64 w8 s3, 2.8x at 64x64 w4 s3; `python -m benchmarks varlen-probe --padded-rows`)
    past_head_dim = NAN_PAST_HEAD_DIM if case.sliced else 0
    return Inputs(_surrounded(q, 0, float("nan")), _surrounded(k, 0, float("nan"), extra_last=past_head_dim),
                  _surrounded(v, 0, float("nan"), extra_last=past_head_dim), mask, bias,
                  randn((layout.total_q, heads, head_dim)),
                  sequences=sequences, max_seqlens=layout.max_seqlens, owned_rows=(first, end))


def _quick_cases() -> list[Case]:
    """CPU-interpreter sized: lengths that divide no tile, each §2 packed and window feature."""
    return [
        # zero- and one-token sequences, a row with no key (dead), and key-only sequences of NaN
        Case("packed_zero_one_token", heads=4, heads_kv=2, causal=True, bias="per_key",
             documents=(17, 0, 1, 0, 1, 33, 0), documents_k=(17, 9, 1, 0, 0, 33, 5)),
        # NaN in every other sequence (no query rows) and in the rows and keys no sequence owns;
        # per-row mask and bias
        Case("packed_nan_neighbours_per_row", heads=4, heads_kv=2, mask="random", mask_shape="kv_head", bias="full",
             documents=(20, 0, 37, 0, 19), documents_k=(20, 11, 37, 16, 19), unowned=3),
        # key counts from seqused_k (the rest of each span NaN, a sequence using none: dead rows),
        # causal with more keys than queries; a per-key mask and bias
        Case("packed_seqused_per_key", heads=2, heads_kv=1, causal=True, mask="random", mask_shape="key",
             bias="per_key", documents=(29, 40, 3, 6), documents_k=(35, 48, 3, 9), seqused=(33, 41, 0, 9)),
        # a fully masked document: its rows are dead (out 0, lse -inf, no gradient); the bias NaN
        # wherever the mask or the causal rule excludes a key
        Case("packed_dead_document", heads=4, heads_kv=2, causal=True, mask="random", mask_shape="full",
             bias="kv_head", bias_poison="nan", documents=(24, 18, 40), dead_documents=(1,)),
        Case("packed_per_key_mask_dead_document", heads=2, heads_kv=2, mask="random", mask_shape="key", bias="full",
             documents=(21, 0, 30), documents_k=(21, 6, 30), dead_documents=(2,)),
        # fewer and more queries than keys (bottom-right causal per sequence), softcap, fp32 bias
        Case("packed_lq_ne_lk_softcap", heads=2, heads_kv=1, causal=True, softcap=5.0, bias="per_key", bias_fp32=True,
             documents=(5, 33, 17), documents_k=(40, 20, 17)),
        # window edges on the config's tiles, dense: the left edge a key tile before the diagonal
        Case("window_causal_key_tile", heads=4, heads_kv=2, seqlen_q=70, seqlen_k=70, causal=True, bias="per_key",
             window_rule=(KEY_TILE, None)),
        # both sides bounded, Lq < Lk, NaN bias outside the window and the mask
        Case("window_both_sides", heads=4, heads_kv=2, seqlen_q=61, seqlen_k=77, mask="random", mask_shape="kv_head",
             bias="full", bias_poison="nan", window_rule=(KEY_TILE_LESS_ONE, ROW_TILE)),
        # Lq > Lk: rows above the window see no key (dead rows)
        Case("window_row_tile_lq_gt_lk", heads=2, heads_kv=1, seqlen_q=77, seqlen_k=45, bias="kv_head",
             window_rule=(ROW_TILE, KEY_TILE_LESS_ONE)),
        Case("window_right_side_only", heads=2, heads_kv=2, seqlen_q=50, seqlen_k=50, mask="random", bias="per_key",
             window_rule=(None, KEY_TILE)),
        # packed with a window on the tiles: each sequence's window on its own rows
        Case("packed_window_causal", heads=4, heads_kv=2, causal=True, mask="random", mask_shape="kv_head",
             bias="per_key", documents=(45, 0, 70, 1), documents_k=(45, 13, 70, 1),
             window_rule=(KEY_TILE_LESS_ONE, None)),
        Case("packed_window_both_sides", heads=2, heads_kv=1, bias="full", bias_poison="nan",
             documents=(40, 52), documents_k=(56, 30), window_rule=(ROW_TILE_LESS_ONE, KEY_TILE)),
    ]


def _full_cases() -> list[Case]:
    """GPU sized: the quick cases (a dense one with two sequences) plus long documents, the head
    dims of §2 and windows of several tiles."""
    cases = [c if c.packed else replace(c, batch=2 * c.batch) for c in _quick_cases()]
    cases += [
        Case("packed_long_documents_d128", heads=8, heads_kv=2, head_dim=128, causal=True, mask="random",
             mask_shape="kv_head", bias="per_key", documents=(1000, 0, 4097, 1, 203, 0, 700),
             documents_k=(1000, 77, 4097, 1, 203, 300, 700)),
        Case("packed_seqused_d64", heads=4, heads_kv=4, head_dim=64, mask="random", mask_shape="key", bias="full",
             documents=(513, 129, 1000), documents_k=(600, 200, 1000), seqused=(513, 150, 999), unowned=5),
        Case("packed_head_dims_72", heads=4, heads_kv=2, head_dim=72, causal=True, bias="kv_head",
             documents=(113, 0, 203), documents_k=(113, 40, 203)),
        Case("packed_head_dims_192", heads=2, heads_kv=1, head_dim=192, bias="per_key", mask="random",
             mask_shape="key", documents=(203, 17, 1), documents_k=(150, 17, 1)),
        Case("window_keys_tiles_long_d128", heads=4, heads_kv=2, seqlen_q=1000, seqlen_k=1000, head_dim=128,
             causal=True, bias="per_key", window_rule=((0, 4, 0), None)),
        Case("window_both_long_d64", heads=4, heads_kv=2, seqlen_q=1000, seqlen_k=1100, head_dim=64, mask="random",
             bias="full", bias_poison="nan", window_rule=((2, 0, -1), (0, 2, 0))),
        Case("packed_window_long_d128", heads=4, heads_kv=2, head_dim=128, causal=True, bias="per_key",
             documents=(900, 0, 1500, 17), documents_k=(900, 64, 1500, 17), window_rule=((0, 4, -1), None)),
        # the long-sequence case of §2 with the kernels' window instead of a window mask
        Case("seed_long_window_1024_bf16", heads=8, heads_kv=2, seqlen_q=4096, seqlen_k=4096, head_dim=128,
             causal=True, window_size=(1023, 0), bias="per_key"),
    ]
    return cases


def _sliced(build):
    """The cases of `build` with their packed K/V as views with NaN past the head dim too (`sliced`)."""
    return lambda: [replace(c, sliced=True) if c.packed else c for c in build()]


VARLEN_SUITES = {"quick": _sliced(_quick_cases), "full": _sliced(_full_cases)}
