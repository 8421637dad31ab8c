"""Workloads: the shapes the tuner tunes for, read from `configs/workloads/*.yaml` or `configs/ci.yaml`.

A grid is the Cartesian product of its axes (head_dim, seqlen, causal, gqa_ratio, variants,
dtype), or a list of such products whose union it is (a sampled grid: each product covers some
axes densely, together they span the others; an item may be another grid, by a YAML alias); the
batch is chosen so every shape carries about `tokens` tokens of key length (batch x seqlen).
Lq = Lk = seqlen, unless the grid has a `seqlen_q` axis: then each query length runs against a
key (cache) length of seqlen, a KV-cache shape (`Workload.directions`).
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass
from pathlib import Path

from dmattn_bench.space import (DTYPES, MAX_DECODE_QUERIES, OPERAND_KINDS, TableKey, is_valid_head_dim, load_yaml,
                                operand_kind, seqlen_bucket)
from dmattn_bench.tuning.adversarial import MASK_SHAPE_OF_KIND, Case

_BIAS_KINDS = ("none", "full", "kv_head", "per_key")
GRID_KEYS = {"tokens", "heads", "head_dim", "seqlen", "causal", "gqa_ratio", "variants", "dtype"}
OPTIONAL_GRID_KEYS = {"seqlen_q"}  # query lengths apart from the key length


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

    @property
    def label(self) -> str:
        gqa = f" gqa{self.heads // self.heads_kv}" if self.heads != self.heads_kv else ""
        return (f"{self.dtype} B{self.batch} H{self.heads}{gqa} L{self.seqlen_q}x{self.seqlen_k} D{self.head_dim}"
                f"{' causal' if self.causal else ''} mask={self.mask} bias={self.bias}{'+grad' if self.bias_grad else ''}")

    def case(self) -> Case:
        """The input builder's description (random mask keeping 70%, unit-scale bias)."""
        return Case(
            name=self.label, batch=self.batch, heads=self.heads, heads_kv=self.heads_kv,
            seqlen_q=self.seqlen_q, seqlen_k=self.seqlen_k, head_dim=self.head_dim, causal=self.causal,
            mask="none" if self.mask == "none" else "random", mask_shape=MASK_SHAPE_OF_KIND.get(self.mask, "full"),
            bias=self.bias, bias_grad=self.bias_grad,
        )

    def operand_dims(self, which: str) -> tuple[int, int, int, int] | None:
        kind = self.mask if which == "mask" else self.bias
        b, h, hkv, lq, lk = self.batch, self.heads, self.heads_kv, self.seqlen_q, self.seqlen_k
        if kind == "none":
            return None
        if kind == "per_key":
            return (b, 1, 1, lk) if which == "mask" else (b, hkv, 1, lk)
        return (b, h if kind == "full" else hkv, lq, lk)

    def directions(self, with_decode: bool = True) -> tuple[str, ...]:
        """The directions this shape is tuned in: the short-query forward ("decode") where a call
        of it without gradient runs that (Lq <= MAX_DECODE_QUERIES) and `with_decode` (the tune
        has a decode space), and the prefill pair unless it is a KV-cache shape (fewer query
        rows than keys, up to that bound: a serving step, which needs no gradient)."""
        decodes = self.seqlen_q <= MAX_DECODE_QUERIES
        prefill = () if decodes and self.seqlen_q < self.seqlen_k else ("fwd", "bwd")
        return prefill + (("decode",) if decodes and with_decode else ())

    def key(self, direction: str) -> TableKey:
        """The dispatch-table key, derived exactly as the runtime derives it from tensors
        (`plan.table_keys`)."""
        bias = operand_kind(self.operand_dims("bias"), self.heads, self.heads_kv, self.seqlen_q)
        if direction == "bwd" and bias != "none" and self.bias_grad:
            bias += "+grad"
        return TableKey(
            direction=direction, dtype=self.dtype, head_dim=self.head_dim, causal=self.causal,
            mask=operand_kind(self.operand_dims("mask"), self.heads, self.heads_kv, self.seqlen_q),
            bias=bias, gqa_ratio=self.heads // self.heads_kv,
            seqlen_q_bucket=seqlen_bucket(self.seqlen_q), seqlen_k_bucket=seqlen_bucket(self.seqlen_k),
        )

    def visible_pairs(self) -> int:
        """(query, key) pairs the causal rule leaves (the mask's sparsity is not counted)."""
        lq, lk = self.seqlen_q, self.seqlen_k
        if not self.causal:
            return lq * lk
        return sum(max(0, min(lk, i + lk - lq + 1)) for i in range(lq))

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
    """The head_dim, seqlen, causal, gqa_ratio and variants axes, each value checked."""
    head_dims = [positive_int(d, f"{where}.head_dim") for d in _axis(grid, "head_dim", where)]
    for head_dim in head_dims:
        if not is_valid_head_dim(head_dim):
            raise ValueError(f"{where}.head_dim: got {head_dim}, expected a multiple of 8 in [8, 256]")
    seqlens = [positive_int(n, f"{where}.seqlen") for n in _axis(grid, "seqlen", where)]
    causals = _axis(grid, "causal", where)
    if any(not isinstance(c, bool) for c in causals):
        raise ValueError(f"{where}.causal: got {causals}, expected true/false values")
    gqa_ratios = [positive_int(g, f"{where}.gqa_ratio") for g in _axis(grid, "gqa_ratio", where)]
    variants = _axis(grid, "variants", where)
    if any(not isinstance(v, dict) for v in variants):
        raise ValueError(f"{where}.variants: expected mappings like {{mask: full, bias: per_key, bias_grad: true}}")
    return [head_dims, seqlens, causals, gqa_ratios, variants]


def _expand(grid: dict, where: str, dtypes: list[str] | None) -> list[Workload]:
    if not isinstance(grid, dict):
        raise ValueError(f"{where}: expected a mapping of {sorted(GRID_KEYS)}")
    unknown = sorted(set(grid) - GRID_KEYS - OPTIONAL_GRID_KEYS)
    missing = sorted(GRID_KEYS - set(grid))
    if unknown or missing:
        raise ValueError(f"{where}: unknown keys {unknown}, missing keys {missing}")
    tokens, heads = positive_int(grid["tokens"], f"{where}.tokens"), positive_int(grid["heads"], f"{where}.heads")
    workloads = []
    axes = _checked_axes(grid, where)
    query_lengths = None
    if "seqlen_q" in grid:
        query_lengths = [positive_int(n, f"{where}.seqlen_q") for n in _axis(grid, "seqlen_q", where)]
    for dtype in dtypes or _axis(grid, "dtype", where):
        if dtype not in DTYPES:
            raise ValueError(f"{where}.dtype: got {dtype!r}, expected one of {tuple(DTYPES)}")
        for head_dim, seqlen, causal, gqa, variant in itertools.product(*axes):
            mask, bias = variant.get("mask", "none"), variant.get("bias", "none")
            if mask not in OPERAND_KINDS or bias not in _BIAS_KINDS:
                raise ValueError(f"{where}.variants: unknown kind in {variant}")
            if heads % int(gqa):
                raise ValueError(f"{where}.gqa_ratio: {gqa} does not divide heads={heads}")
            for seqlen_q in query_lengths or [seqlen]:
                workloads.append(Workload(
                    batch=max(1, tokens // int(seqlen)), heads=heads, heads_kv=heads // int(gqa),
                    seqlen_q=int(seqlen_q), seqlen_k=int(seqlen), head_dim=int(head_dim), causal=bool(causal),
                    mask=mask, bias=bias, bias_grad=bool(variant.get("bias_grad", False)) and bias != "none",
                    dtype=dtype,
                ))
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
    does not divide the heads, a kind only a broadcast of other dims gives).

    A workload's operand kinds name shapes (`operand_dims`), a key's what the kernels see: at one
    query row a per-key padding mask is "shared" and a per-key bias "kv_head", so each workload
    kind is tried until the key matches. `small`: one sequence and two KV heads (the interpreter's
    size)."""
    heads = 2 * key.gqa_ratio if small else STALE_HEADS
    if heads % key.gqa_ratio:
        return None
    bias = key.bias.removesuffix("+grad")
    for mask_kind, bias_kind in itertools.product(OPERAND_KINDS, _BIAS_KINDS):
        if (mask_kind == "none") != (key.mask == "none") or (bias_kind == "none") != (bias == "none"):
            continue
        workload = Workload(
            batch=1 if small else max(1, STALE_TOKENS // key.seqlen_k_bucket), heads=heads,
            heads_kv=heads // key.gqa_ratio, seqlen_q=key.seqlen_q_bucket, seqlen_k=key.seqlen_k_bucket,
            head_dim=key.head_dim, causal=key.causal, mask=mask_kind, bias=bias_kind,
            bias_grad=bias_kind != "none" and (key.bias.endswith("+grad") or key.direction != "bwd"), dtype=key.dtype)
        if key.direction in workload.directions() and workload.key(key.direction) == key:
            return workload
    return None
