"""Workloads: the shapes the tuner tunes for, read from `configs/workloads/*.yaml` or `configs/ci.yaml`.

A grid is the Cartesian product of its axes (head_dim, seqlen, causal, gqa_ratio, variants,
dtype, and optionally window), or a list of such products whose union it is (a sampled grid:
each product covers some axes densely, together they span the others; an item may be another
grid, by a YAML alias); the batch is chosen so every shape carries about `tokens` tokens of key
length (batch x seqlen). Lq = Lk = seqlen, unless the grid has a `seqlen_q` axis: then each query
length runs against a key (cache) length of seqlen, a KV-cache shape (`Workload.directions`).

A grid of packed sequences (a varlen call) has a `documents` axis instead of `seqlen` and
`tokens`: each value a list of document lengths, packed into one call (every query sees the keys
of its own document only; a document's queries and keys line up). A `window` axis holds
FlashAttention's sliding windows, [left, right] each ([-1, -1]: none), for dense and packed grids.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from dmattn_bench.space import (DTYPES, MAX_DECODE_QUERIES, OPERAND_KINDS, TableKey, is_valid_head_dim, load_yaml,
                                operand_kind, seqlen_bucket, window_bucket)
from dmattn_bench.tuning.adversarial import MASK_SHAPE_OF_KIND, NO_WINDOW, Case

_BIAS_KINDS = ("none", "full", "kv_head", "per_key")
GRID_KEYS = {"tokens", "heads", "head_dim", "seqlen", "causal", "gqa_ratio", "variants", "dtype"}
OPTIONAL_GRID_KEYS = {"seqlen_q", "window"}  # query lengths apart from the key length; sliding windows
# a packed grid's keys: `documents` in place of `seqlen` and `tokens` (a dense grid's only)
PACKED_GRID_KEYS = (GRID_KEYS - {"tokens", "seqlen"}) | {"documents"}
DENSE_ONLY_KEYS = {"tokens", "seqlen", "seqlen_q"}


def visible_pairs(seqlen_q: int, seqlen_k: int, causal: bool, window: tuple[int, int] = NO_WINDOW) -> int:
    """(query, key) pairs of one sequence that the causal rule and the window leave (both bottom-right
    aligned; the mask's sparsity is not counted)."""
    left, right = window
    offset = seqlen_k - seqlen_q
    pairs = 0
    for i in range(seqlen_q):
        low = 0 if left < 0 else max(0, i + offset - left)
        high = seqlen_k - 1
        if causal:
            high = min(high, i + offset)
        if right >= 0:
            high = min(high, i + offset + right)
        pairs += max(0, high - low + 1)
    return pairs


@dataclass(frozen=True)
class Workload:
    """One problem shape with its features and dtype."""

    batch: int
    heads: int
    heads_kv: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    causal: bool
    mask: str  # none | full | kv_head | per_key
    bias: str  # none | full | kv_head | per_key
    bias_grad: bool
    dtype: str  # bf16 | fp16 | fp32
    # packed sequences: each document's tokens (its queries and keys), packed into one call of
    # batch 1 with seqlen_q = seqlen_k = the longest; empty for a dense call
    documents: tuple[int, ...] = ()
    window: tuple[int, int] = NO_WINDOW  # FlashAttention's sliding window (left, right)

    @property
    def packed(self) -> bool:
        return bool(self.documents)

    @property
    def label(self) -> str:
        gqa = f" gqa{self.heads // self.heads_kv}" if self.heads != self.heads_kv else ""
        window = "" if self.window == NO_WINDOW else f" window {self.window[0]},{self.window[1]}"
        tokens = (f"packed {len(self.documents)} docs {sum(self.documents)} tokens max {max(self.documents)}"
                  if self.packed else f"B{self.batch}")
        shape = f"L{self.seqlen_q}x{self.seqlen_k} " if not self.packed else ""
        return (f"{self.dtype} {tokens} H{self.heads}{gqa} {shape}D{self.head_dim}"
                f"{' causal' if self.causal else ''}{window} mask={self.mask} bias={self.bias}"
                f"{'+grad' if self.bias_grad else ''}")

    def case(self) -> Case:
        """The input builder's description (random mask keeping 70%, unit-scale bias)."""
        return Case(
            name=self.label, batch=self.batch, heads=self.heads, heads_kv=self.heads_kv,
            seqlen_q=self.seqlen_q, seqlen_k=self.seqlen_k, head_dim=self.head_dim, causal=self.causal,
            mask="none" if self.mask == "none" else "random", mask_shape=MASK_SHAPE_OF_KIND.get(self.mask, "full"),
            bias=self.bias, bias_grad=self.bias_grad, documents=self.documents, window_size=self.window,
        )

    def operand_dims(self, which: str) -> tuple[int, int, int, int] | None:
        """A mask's or bias's 4-D dims as the kernels see them: a packed call's as the launchers'
        views of one batch row ((1, Hkv|1, 1, total) per key, (1, H|Hkv, total, longest) per row)."""
        kind = self.mask if which == "mask" else self.bias
        b, h, hkv, lq, lk = self.batch, self.heads, self.heads_kv, self.seqlen_q, self.seqlen_k
        rows = lq
        if self.packed:
            b, rows = 1, sum(self.documents)
        if kind == "none":
            return None
        if kind == "per_key":
            keys = rows if self.packed else lk
            return (b, 1, 1, keys) if which == "mask" else (b, hkv, 1, keys)
        return (b, h if kind == "full" else hkv, rows, lk)

    def tensor_bytes(self) -> int:
        """GPU bytes a compile job holds at its peak for this workload (`trials._Problem` without
        its reference): Q, dO, the output and dQ; K, V, dK and dV; the mask; the bias and its
        gradient; and, while they are drawn, the float32 values of the larger of mask and bias
        (`adversarial.build_inputs`). The pool's size on a GPU counts them
        (`workers.worker_count`): without the float32 values, compile workers of a full mask and
        bias at B4 H16 L4096 held 9.85 GB each where 5.4 GB were counted, and the H200's
        measuring worker ran out of memory beside them."""
        item = 4 if self.dtype == "fp32" else 2
        rows = sum(self.documents) if self.packed else self.batch * self.seqlen_q
        keys = sum(self.documents) if self.packed else self.batch * self.seqlen_k
        total = 4 * rows * self.heads * self.head_dim * item + 4 * keys * self.heads_kv * self.head_dim * item
        mask, bias = self.operand_dims("mask"), self.operand_dims("bias")
        if mask is not None:
            total += math.prod(mask)
        if bias is not None:
            total += math.prod(bias) * item * (2 if self.bias_grad else 1)
        drawn = max((math.prod(dims) for dims in (mask, bias) if dims is not None), default=0)
        return total + 4 * drawn

    def directions(self, with_decode: bool = True) -> tuple[str, ...]:
        """The directions this shape is tuned in: the short-query forward ("decode") where a call
        of it without gradient runs that (Lq <= MAX_DECODE_QUERIES) and `with_decode` (the tune
        has a decode space), and the prefill pair unless it is a KV-cache shape (fewer query
        rows than keys, up to that bound: a serving step, which needs no gradient). Packed
        sequences run the prefill pair only."""
        if self.packed:
            return ("fwd", "bwd")
        decodes = self.seqlen_q <= MAX_DECODE_QUERIES
        prefill = () if decodes and self.seqlen_q < self.seqlen_k else ("fwd", "bwd")
        return prefill + (("decode",) if decodes and with_decode else ())

    def key(self, direction: str) -> TableKey:
        """The dispatch-table key, derived exactly as the runtime derives it from tensors
        (`plan.table_keys`: a packed call's operand kinds from its (1, total, H, D) views, its
        buckets from its longest document)."""
        rows = sum(self.documents) if self.packed else self.seqlen_q
        bias = operand_kind(self.operand_dims("bias"), self.heads, self.heads_kv, rows)
        if direction == "bwd" and bias != "none" and self.bias_grad:
            bias += "+grad"
        return TableKey(
            direction=direction, dtype=self.dtype, head_dim=self.head_dim, causal=self.causal,
            mask=operand_kind(self.operand_dims("mask"), self.heads, self.heads_kv, rows),
            bias=bias, gqa_ratio=self.heads // self.heads_kv,
            seqlen_q_bucket=seqlen_bucket(self.seqlen_q), seqlen_k_bucket=seqlen_bucket(self.seqlen_k),
            packed=self.packed, window=window_bucket(self.window, self.causal),
        )

    def visible_pairs(self) -> int:
        """(query, key) pairs of one batch row that the causal rule and the window leave, over
        its documents when packed (the mask's sparsity is not counted)."""
        if self.packed:
            return sum(visible_pairs(n, n, self.causal, self.window) for n in self.documents)
        return visible_pairs(self.seqlen_q, self.seqlen_k, self.causal, self.window)

    def flops(self, direction: str) -> float:
        """Matmul FLOPs actually needed: 2 GEMMs forward (either forward kernel), 5 backward
        (FlashAttention's count)."""
        per_pair = 2 * 2 * self.head_dim * (2.5 if direction == "bwd" else 1)
        return float(per_pair * self.batch * self.heads * self.visible_pairs())

    def to_dict(self) -> dict:
        return asdict(self)


def _axis(grid: dict, name: str, where: str) -> list:
    value = grid[name]
    values = value if isinstance(value, list) else [value]
    if not values:
        raise ValueError(f"{where}.{name}: expected a non-empty list")
    return values


def positive_int(value, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{where}: got {value!r}, expected a positive integer")
    return value


def _checked_axes(grid: dict, where: str) -> list[list]:
    """The head_dim, seqlen (or documents), causal, gqa_ratio, variants and window axes, each
    value checked."""
    head_dims = [positive_int(d, f"{where}.head_dim") for d in _axis(grid, "head_dim", where)]
    for head_dim in head_dims:
        if not is_valid_head_dim(head_dim):
            raise ValueError(f"{where}.head_dim: got {head_dim}, expected a multiple of 8 in [8, 256]")
    if "documents" in grid:
        lengths = [_documents(value, f"{where}.documents") for value in _axis(grid, "documents", where)]
    else:
        lengths = [positive_int(n, f"{where}.seqlen") for n in _axis(grid, "seqlen", where)]
    causals = _axis(grid, "causal", where)
    if any(not isinstance(c, bool) for c in causals):
        raise ValueError(f"{where}.causal: got {causals}, expected true/false values")
    gqa_ratios = [positive_int(g, f"{where}.gqa_ratio") for g in _axis(grid, "gqa_ratio", where)]
    variants = _axis(grid, "variants", where)
    if any(not isinstance(v, dict) for v in variants):
        raise ValueError(f"{where}.variants: expected mappings like {{mask: full, bias: per_key, bias_grad: true}}")
    windows = [_window(value, f"{where}.window") for value in _axis(grid, "window", where)] if "window" in grid \
        else [NO_WINDOW]
    return [head_dims, lengths, causals, gqa_ratios, variants, windows]


def _documents(value, where: str) -> tuple[int, ...]:
    """One value of a `documents` axis: a non-empty list of document lengths."""
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where}: got {value!r}, expected a list of document lengths per value "
                         f"(documents: [[4096, 700, ...]])")
    return tuple(positive_int(n, where) for n in value)


def _window(value, where: str) -> tuple[int, int]:
    """One value of a `window` axis: [left, right], each an int >= -1 (-1: unbounded side)."""
    if (not isinstance(value, list) or len(value) != 2
            or any(isinstance(n, bool) or not isinstance(n, int) or n < -1 for n in value)):
        raise ValueError(f"{where}: got {value!r}, expected [left, right] pairs of ints >= -1 (window: [[1023, 0]])")
    return (value[0], value[1])


def _expand(grid: dict, where: str, dtypes: list[str] | None) -> list[Workload]:
    if not isinstance(grid, dict):
        raise ValueError(f"{where}: expected a mapping of {sorted(GRID_KEYS)}")
    packed = "documents" in grid
    required = PACKED_GRID_KEYS if packed else GRID_KEYS
    allowed = required | OPTIONAL_GRID_KEYS
    if packed:
        allowed -= DENSE_ONLY_KEYS
    unknown = sorted(set(grid) - allowed)
    missing = sorted(required - set(grid))
    if unknown or missing:
        kind = " (a packed grid: `documents` in place of `seqlen` and `tokens`)" if packed else ""
        raise ValueError(f"{where}: unknown keys {unknown}, missing keys {missing}{kind}")
    heads = positive_int(grid["heads"], f"{where}.heads")
    tokens = None if packed else positive_int(grid["tokens"], f"{where}.tokens")
    workloads = []
    axes = _checked_axes(grid, where)
    query_lengths = None
    if "seqlen_q" in grid:
        query_lengths = [positive_int(n, f"{where}.seqlen_q") for n in _axis(grid, "seqlen_q", where)]
    for dtype in dtypes or _axis(grid, "dtype", where):
        if dtype not in DTYPES:
            raise ValueError(f"{where}.dtype: got {dtype!r}, expected one of {tuple(DTYPES)}")
        for head_dim, length, causal, gqa, variant, window in itertools.product(*axes):
            mask, bias = variant.get("mask", "none"), variant.get("bias", "none")
            if mask not in OPERAND_KINDS or bias not in _BIAS_KINDS:
                raise ValueError(f"{where}.variants: unknown kind in {variant}")
            if heads % int(gqa):
                raise ValueError(f"{where}.gqa_ratio: {gqa} does not divide heads={heads}")
            common = dict(heads=heads, heads_kv=heads // int(gqa), head_dim=int(head_dim), causal=bool(causal),
                          mask=mask, bias=bias, bias_grad=bool(variant.get("bias_grad", False)) and bias != "none",
                          dtype=dtype, window=window)
            if packed:
                longest = max(length)
                workloads.append(Workload(batch=1, seqlen_q=longest, seqlen_k=longest, documents=length, **common))
                continue
            for seqlen_q in query_lengths or [length]:
                workloads.append(Workload(batch=max(1, tokens // int(length)), seqlen_q=int(seqlen_q),
                                          seqlen_k=int(length), **common))
    return workloads


def _products(grid) -> list:
    """A grid's products: itself, or its list's items, a nested list (another grid's, by a YAML
    alias) flattened into it."""
    if not isinstance(grid, list):
        return [grid]
    return [product for item in grid for product in _products(item)]


def reject_table(path: Path, document: dict) -> None:
    """Raises ValueError when a file given as workloads is a dispatch table (a mistake both `tune`
    and `bench` name the same way)."""
    if "entries" in document and "schema_version" in document:
        raise ValueError(f"{path}: this is a dispatch table (the dispatch table's format: what `tune` writes and "
                         f"`--table` reads), not a workloads file")


def load_workloads(path: str | Path, grid: str = "default", dtypes: list[str] | None = None) -> list[Workload]:
    """The workloads of `grid` in a workloads YAML (or the `workloads:` section of configs/ci.yaml).

    Raises:
        ValueError: a missing grid or a malformed axis, naming the file and the key.
    """
    path = Path(path)
    document = load_yaml(path)
    if not isinstance(document, dict):
        raise ValueError(f"{path}: expected a mapping of grids")
    reject_table(path, document)
    grids = document.get("workloads", document)
    if not isinstance(grids, dict):
        raise ValueError(f"{path}: `workloads:` is not a mapping of grids (a list of named workloads is "
                         f"the bench's format: `dmattn-bench bench --workloads`)")
    if grid not in grids:
        raise ValueError(f"{path}: no grid {grid!r}; it has {sorted(grids)}")
    products = _products(grids[grid])
    if not products:
        raise ValueError(f"{path}:{grid}: an empty list of grids")
    workloads = [w for index, product in enumerate(products)
                 for w in _expand(product, f"{path}:{grid}" + (f"[{index}]" if len(products) > 1 else ""), dtypes)]
    return list(dict.fromkeys(workloads))  # a shape two products share is tuned once


STALE_TOKENS, STALE_HEADS = 8192, 16  # the shape of a re-tuned key: default.yaml's tokens and heads


def workload_of_key(key: TableKey, small: bool = False) -> Workload | None:
    """A workload whose `key(key.direction)` is `key` (`tune --stale`: a table entry tuned again),
    with default.yaml's tokens and heads; None for a key no workload describes (a GQA ratio that
    does not divide the heads, a kind only a broadcast of other dims gives, a packed key whose
    query and key buckets differ: a workload's documents line up).

    A workload's operand kinds name shapes (`operand_dims`), a key's what the kernels see: at one
    query row a per-key padding mask is "shared" and a per-key bias "kv_head", so each workload
    kind is tried until the key matches. `small`: one sequence and two KV heads (the interpreter's
    size). A windowed key gets its `stamps.representative_window`; a packed key documents of its
    bucket (as many as make the tokens; with `small`, one and a shorter one)."""
    from dmattn_bench.dispatch.stamps import representative_window

    heads = 2 * key.gqa_ratio if small else STALE_HEADS
    if heads % key.gqa_ratio or (key.packed and key.seqlen_q_bucket != key.seqlen_k_bucket):
        return None
    length = key.seqlen_k_bucket
    shape = dict(batch=1 if small else max(1, STALE_TOKENS // length), seqlen_q=key.seqlen_q_bucket, seqlen_k=length)
    if key.packed:
        shape = dict(batch=1, seqlen_q=length, seqlen_k=length,
                     documents=(length, length // 2 + 1) if small else (length,) * max(1, STALE_TOKENS // length))
    bias = key.bias.removesuffix("+grad")
    for mask_kind, bias_kind in itertools.product(OPERAND_KINDS, _BIAS_KINDS):
        if (mask_kind == "none") != (key.mask == "none") or (bias_kind == "none") != (bias == "none"):
            continue
        workload = Workload(
            heads=heads, heads_kv=heads // key.gqa_ratio, head_dim=key.head_dim, causal=key.causal, mask=mask_kind,
            bias=bias_kind, bias_grad=bias_kind != "none" and (key.bias.endswith("+grad") or key.direction != "bwd"),
            dtype=key.dtype, window=representative_window(key), **shape)
        if key.direction in workload.directions() and workload.key(key.direction) == key:
            return workload
    return None
