"""`dmattn-bench bench`: our dispatch-selected kernel against its peers, same run, same GPU.

For each workload of `configs/workloads/peers.yaml` (prefill: forward and forward+backward),
`peers-decode.yaml` (decode steps: forward only, no gradient) or `packed.yaml` (packed documents
and sliding windows, `bench.packed`: forward and forward+backward) and each peer
(`dmattn_bench.bench.peers`; on packed and window workloads `bench.packed_peers`), every
direction is timed with `timing.time_kernel` (warm-up, L2 flushed, median and spread) and
`timing.eager_wall_ms`. Reported per row:

- ms (median, p20-p80 spread) of GPU time, and beside it the host's own time to enqueue one call
  and the eager wall time per call (back-to-back calls, one sync): a CUDA-graph user sees the
  first, an eager loop the last;
- TFLOP/s over the work actually needed: the matmuls of the
  (query, key) pairs the causal rule leaves (2 GEMMs forward, 5 backward; FlashAttention's count);
  on packed and window workloads, the pairs their documents, window and mask keep (`packed.kept_pairs`);
- the floor: max(FLOPs / tensor-core peak, bytes that must move / HBM bandwidth) for this GPU
  (`hardware.device_peaks`), and the fraction of it reached;
- in a decode step, the K/V bytes it must read over its GPU time as a fraction of a device
  copy's rate measured in the same run (`copy_rate`): how close to HBM speed the step streams;
- ours / peer on GPU time and on eager wall time (below 1: we are faster);
- for our own forward, its error against the reference over the DESIGN §2 bound (over 1: the
  row fails); for peers computing the same function, max |out - ours| as a check that they do.

A peer that fails (not installed, out of resources, unsupported, needs a GPU) is a row with its
error; `failed_rows_of_ours` tells the command whether our own kernel failed.
"""

from __future__ import annotations

import gc
import itertools
import math
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path

import torch

from dmattn_bench import hardware, output
from dmattn_bench.bench import packed, packed_peers
from dmattn_bench.bench.packed import Layout, PackedInputs
from dmattn_bench.bench.peers import (OURS, OURS_PEERS, PEERS, STRUCTURED_ONLY, BenchInputs, DecodeOperands, Prepared,
                                      unavailable_reason)
from dmattn_bench.reference import PAGE_MULTIPLE, attention
from dmattn_bench.space import DTYPES, MAX_DECODE_QUERIES, is_valid_head_dim, load_yaml
from dmattn_bench.tuning.adversarial import paged_cache
from dmattn_bench.tuning.timing import eager_wall_ms, time_kernel
from dmattn_bench.tuning.validator import TensorCheck, compare
from dmattn_bench.tuning.workloads import Workload, positive_int, reject_table

DIRECTIONS = ("fwd", "fwd+bwd")
_MASK_KINDS = ("full", "kv_head", "per_key")  # per_key: (B, 1, 1, Lk), one row for every query
_BIAS_KINDS = ("full", "kv_head", "per_key")
_SHAPE_KEYS = {"name", "batch", "heads", "heads_kv", "head_dim", "dtype"}
_PREFILL_KEYS = _SHAPE_KEYS | {"seqlen", "causal", "bias", "mask"}
_DECODE_KEYS = _SHAPE_KEYS | {"seqlen_q", "seqlen_k", "filled", "lengths"}  # and `page` with the paged variant
# How ours is told each sequence's length in a decode step (`configs/workloads/peers-decode.yaml`)
LENGTH_VARIANTS = ("none", "mask", "cache_seqlens", "paged")
COPY_BYTES = 1 << 30  # the device copy behind the bandwidth fraction: far past any L2, so it streams HBM
# The eager loop behind `wall ms`, (calls per loop, loops). On a GPU 15 loops, not 5: five loops
# of a decode step last about a millisecond, and one stall about that long made a row's median
# (H100, D3 B8 Lk4k paged: 0.157 ms a call, against 0.055 ms of GPU time and 0.016 ms of host
# time; 0.054 in the run before). In the interpreter a call takes up to a second and its
# times rank nothing: one loop of 2 calls fills the column end to end, where 15 x 20 would make a
# CPU bench run many times longer.
EAGER_LOOP_GPU = (20, 15)
EAGER_LOOP_CPU = (2, 1)


def eager_loop(device: torch.device | str) -> tuple[int, int]:
    """(calls per loop, loops) of the eager wall time on `device`."""
    return EAGER_LOOP_GPU if torch.device(device).type == "cuda" else EAGER_LOOP_CPU


@dataclass(frozen=True)
class DecodeCache:
    """A decode workload's KV cache: how many of its keys hold data, and how ours is told."""

    lengths: str  # one of LENGTH_VARIANTS
    filled: int  # keys of each sequence that hold data (all Lk with "none"); the rest is unused tail
    page: int | None  # keys per page with "paged"


@dataclass(frozen=True)
class PeerWorkload:
    """One bench problem: the shape and features, plus how its dynamic mask is chosen."""

    name: str
    workload: Workload
    keep: tuple[str, float] | None  # ("top_fraction", f) or ("top_k", n); None without a mask
    decode: DecodeCache | None = None  # a decode step: forward only, no gradient
    layout: Layout | None = None  # packed documents or a sliding window (`bench.packed`)

    @property
    def directions(self) -> tuple[str, ...]:
        return ("fwd",) if self.decode is not None else DIRECTIONS

    @property
    def keys_read(self) -> int:
        """Keys per sequence a forward must read: a decode step never needs its cache's tail."""
        return self.workload.seqlen_k if self.decode is None else self.decode.filled

    def describe(self) -> str:
        if self.layout is not None:
            return f"{self.name}: {packed.describe(self.workload, self.layout)}"
        keep = "" if self.keep is None else f" keep {self.keep[0]}={self.keep[1]:g}"
        cache = self.decode
        if cache is not None and cache.lengths != "none":
            page = f" in pages of {cache.page}" if cache.page is not None else ""
            keep = f"; {cache.filled} of {self.workload.seqlen_k} keys filled, told by {cache.lengths}{page}"
        return f"{self.name}: {self.workload.label}{keep}"


def _positive(entry: dict, key: str, where: str) -> int:
    return positive_int(entry[key], f"{where}.{key}")


def _dtype_and_heads(entry: dict, where: str, dtype_override: str | None) -> tuple[str, int, int]:
    dtype = dtype_override or entry["dtype"]
    if dtype not in DTYPES:
        raise ValueError(f"{where}.dtype: got {dtype!r}, expected one of {tuple(DTYPES)}")
    heads, heads_kv = _positive(entry, "heads", where), _positive(entry, "heads_kv", where)
    if heads % heads_kv:
        raise ValueError(f"{where}: heads_kv={heads_kv} does not divide heads={heads}")
    return dtype, heads, heads_kv


# A grid entry's keys (`_expand_grid`): each a list, expanded as their product
_GRID_LISTS = ("head_dim", "causal", "gqa", "seqlen", "dtype", "variants")
_GRID_KEYS = {"name", "tokens", "heads", *_GRID_LISTS}


def _grid_name(prefix: str, head_dim: int, causal: bool, gqa: int, seqlen: int, dtype: str, variant: dict) -> str:
    def kind(operand) -> str:  # malformed operands are `_parse_prefill`'s to refuse
        if not isinstance(operand, dict):
            return str(operand)
        keep = "".join(f" {rule}={amount}" for rule, amount in (operand.get("keep") or {}).items())
        return f"{operand.get('kind')}{keep}" + ("+grad" if operand.get("grad") else "")

    return (f"{prefix} D{head_dim} {'causal' if causal else 'full'} gqa{gqa} L{seqlen} "
            f"{kind(variant['mask'])}/{kind(variant['bias'])} {dtype}")


def _expand_grid(grid, where: str, dtype_override: str | None) -> list[dict]:
    """A grid entry's prefill entries: the product of its lists (`_GRID_LISTS`; `dtype_override`
    in place of its dtypes), each with `tokens // seqlen` sequences (at least one) of `heads`
    query heads and heads / gqa KV heads, named by what sets it apart (`_grid_name`)."""
    if not isinstance(grid, dict) or set(grid) != _GRID_KEYS:
        keys = sorted(grid) if isinstance(grid, dict) else type(grid).__name__
        raise ValueError(f"{where}.grid: expected keys {sorted(_GRID_KEYS)}, got {keys}")
    for name in _GRID_LISTS:
        if not isinstance(grid[name], list) or not grid[name]:
            raise ValueError(f"{where}.grid.{name}: expected a non-empty list, got {grid[name]!r}")
    tokens, heads = positive_int(grid["tokens"], f"{where}.grid.tokens"), positive_int(grid["heads"], f"{where}.grid.heads")
    lists = [grid[name] if name != "dtype" or dtype_override is None else [dtype_override] for name in _GRID_LISTS]
    entries = []
    for head_dim, causal, gqa, seqlen, dtype, variant in itertools.product(*lists):
        if not isinstance(variant, dict) or set(variant) != {"mask", "bias"}:
            raise ValueError(f"{where}.grid.variants: each is {{mask, bias}}, got {variant!r}")
        gqa, seqlen = positive_int(gqa, f"{where}.grid.gqa"), positive_int(seqlen, f"{where}.grid.seqlen")
        if heads % gqa:
            raise ValueError(f"{where}.grid.gqa: {gqa} does not divide heads={heads}")
        entries.append(dict(name=_grid_name(str(grid["name"]), head_dim, bool(causal), gqa, seqlen, dtype, variant),
                            batch=max(1, tokens // seqlen), heads=heads, heads_kv=heads // gqa, seqlen=seqlen,
                            head_dim=head_dim, causal=causal, dtype=dtype, **variant))
    return entries


def _parse(entry, where: str, dtype_override: str | None) -> list[PeerWorkload]:
    """A prefill entry's workload, those of a grid entry (`_expand_grid`), one decode workload per
    length variant of a decode entry, or a packed or window workload (`packed.parse_structured`)."""
    if isinstance(entry, dict) and set(entry) == {"grid"}:
        return [_parse_prefill(one, f"{where} ({one['name']})", dtype_override)
                for one in _expand_grid(entry["grid"], where, dtype_override)]
    if isinstance(entry, dict) and packed.STRUCTURE_KEYS & set(entry):
        dtype, heads, heads_kv = _dtype_and_heads(entry, where, dtype_override)
        workload, layout = packed.parse_structured(entry, where, dtype, heads, heads_kv)
        return [PeerWorkload(str(entry["name"]), workload, None, layout=layout)]
    if isinstance(entry, dict) and set(entry) == _PREFILL_KEYS:
        return [_parse_prefill(entry, where, dtype_override)]
    if isinstance(entry, dict) and set(entry) - {"page"} == _DECODE_KEYS:
        return _parse_decode(entry, where, dtype_override)
    keys = sorted(entry) if isinstance(entry, dict) else type(entry).__name__
    raise ValueError(f"{where}: expected keys {sorted(_PREFILL_KEYS)} (prefill) or {sorted(_DECODE_KEYS)} "
                     f"and page with the paged variant (decode), got {keys} (packed documents and sliding windows: "
                     "with documents or window)")


def _parse_prefill(entry: dict, where: str, dtype_override: str | None) -> PeerWorkload:
    bias, mask = entry["bias"], entry["mask"]
    bias_kind = "none" if bias == "none" else bias.get("kind")
    mask_kind = "none" if mask == "none" else mask.get("kind")
    if bias_kind not in ("none", *_BIAS_KINDS):
        raise ValueError(f"{where}.bias: got {bias!r}, expected none or {{kind: {'|'.join(_BIAS_KINDS)}, grad: bool}}")
    if mask_kind not in ("none", *_MASK_KINDS):
        raise ValueError(f"{where}.mask: got {mask!r}, expected none or {{kind: {'|'.join(_MASK_KINDS)}, keep: ...}}")
    keep = None
    if mask_kind != "none":
        rule = mask.get("keep")
        if not (isinstance(rule, dict) and len(rule) == 1 and next(iter(rule)) in ("top_fraction", "top_k")):
            raise ValueError(f"{where}.mask.keep: got {rule!r}, expected {{top_fraction: f}} or {{top_k: n}}")
        if bias_kind == "none":
            raise ValueError(f"{where}.mask: the keep rule ranks keys by bias, so the workload needs a bias")
        if mask_kind == "per_key" and bias_kind != "per_key":
            raise ValueError(f"{where}.mask: a per_key mask ranks the keys by a per_key bias, got bias {bias_kind}")
        keep = next(iter(rule.items()))
    dtype, heads, heads_kv = _dtype_and_heads(entry, where, dtype_override)
    workload = Workload(
        batch=_positive(entry, "batch", where), heads=heads, heads_kv=heads_kv,
        seqlen_q=_positive(entry, "seqlen", where), seqlen_k=entry["seqlen"],
        head_dim=_positive(entry, "head_dim", where), causal=bool(entry["causal"]),
        mask=mask_kind, bias=bias_kind, bias_grad=bias_kind != "none" and bool(bias.get("grad", False)),
        dtype=dtype,
    )
    return PeerWorkload(str(entry["name"]), workload, keep)


def _parse_decode(entry: dict, where: str, dtype_override: str | None) -> list[PeerWorkload]:
    dtype, heads, heads_kv = _dtype_and_heads(entry, where, dtype_override)
    batch, seqlen_q, seqlen_k = (_positive(entry, key, where) for key in ("batch", "seqlen_q", "seqlen_k"))
    if seqlen_q > MAX_DECODE_QUERIES:
        raise ValueError(f"{where}.seqlen_q: got {seqlen_q}, expected at most {MAX_DECODE_QUERIES} (the "
                         "short-query forward's query rows; a longer query is a prefill workload)")
    head_dim = _positive(entry, "head_dim", where)
    if not is_valid_head_dim(head_dim):
        raise ValueError(f"{where}.head_dim: got {head_dim}, expected a multiple of 8 in [8, 256]")
    filled = entry["filled"]
    if isinstance(filled, bool) or not isinstance(filled, (int, float)) or not 0 < filled <= 1:
        raise ValueError(f"{where}.filled: got {filled!r}, expected the fraction in (0, 1] of each sequence's "
                         "keys that hold data")
    lengths = entry["lengths"]
    if (not isinstance(lengths, list) or not lengths or len(set(map(str, lengths))) != len(lengths)
            or any(variant not in LENGTH_VARIANTS for variant in lengths)):
        raise ValueError(f"{where}.lengths: got {lengths!r}, expected a list of distinct variants from "
                         f"{', '.join(LENGTH_VARIANTS)}")
    page = entry.get("page")
    if ("paged" in lengths) != ("page" in entry):
        raise ValueError(f"{where}.page: " + ("the paged variant needs the keys per page" if "paged" in lengths
                                              else "given without the paged variant in lengths"))
    if page is not None and (isinstance(page, bool) or not isinstance(page, int) or page < 1
                             or page % PAGE_MULTIPLE or seqlen_k % page):
        raise ValueError(f"{where}.page: got {page!r}, expected a multiple of {PAGE_MULTIPLE} that divides "
                         f"seqlen_k={seqlen_k}")
    workloads = []
    for variant in lengths:
        workload = Workload(
            batch=batch, heads=heads, heads_kv=heads_kv, seqlen_q=seqlen_q, seqlen_k=seqlen_k, head_dim=head_dim,
            causal=False, mask="per_key" if variant == "mask" else "none", bias="none", bias_grad=False, dtype=dtype)
        cache = DecodeCache(variant, seqlen_k if variant == "none" else math.ceil(filled * seqlen_k),
                            page if variant == "paged" else None)
        workloads.append(PeerWorkload(f"{entry['name']} {variant}", workload, None, cache))
    return workloads


def load_peer_workloads(path: str | Path, dtype: str | None = None, names: list[str] | None = None) -> list[PeerWorkload]:
    """The `workloads:` list of a peers YAML, optionally only those whose name starts with one of `names`.

    Raises:
        ValueError: a malformed entry (naming the file, the entry and the key), two workloads of
            one name, or no match.
    """
    path = Path(path)
    document = load_yaml(path)
    if isinstance(document, dict):
        reject_table(path, document)
    if not isinstance(document, dict) or not isinstance(document.get("workloads"), list):
        raise ValueError(f"{path}: expected a mapping with a `workloads:` list")
    workloads = [workload for i, entry in enumerate(document["workloads"])
                 for workload in _parse(entry, f"{path}:workloads[{i}]", dtype)]
    seen = set()
    for workload in workloads:  # rows pair with ours by workload name (`fill_ratios`)
        if workload.name in seen:
            raise ValueError(f"{path}: two workloads are named {workload.name!r}")
        seen.add(workload.name)
    if names:
        workloads = [w for w in workloads if any(w.name.startswith(n) for n in names)]
        if not workloads:
            raise ValueError(f"--only: no workload of {path} starts with {names}")
    return workloads


def timed_directions(pw: PeerWorkload, directions=DIRECTIONS) -> tuple[str, ...]:
    """The directions of `pw` a run times: those of `directions` it has (a decode step: the forward)."""
    return tuple(d for d in pw.directions if d in directions)


# -- inputs -----------------------------------------------------------------------------------


def _keep_top_of_causal_prefix(bias_rows: torch.Tensor, keep: tuple[str, float], causal: bool) -> torch.Tensor:
    """For each row i of a (Lq, Lk) bias slice, True at the keys its keep rule selects among the
    visible ones (the causal prefix j <= i + Lk - Lq when causal), ranked by bias."""
    seqlen_q, seqlen_k = bias_rows.shape
    rows = torch.arange(seqlen_q, device=bias_rows.device)
    visible_count = (rows + seqlen_k - seqlen_q + 1).clamp(0, seqlen_k) if causal else torch.full_like(rows, seqlen_k)
    rule, amount = keep
    count = (visible_count * amount).ceil().long() if rule == "top_fraction" else visible_count.clamp(max=int(amount))
    scores = bias_rows.float()
    if causal:
        cols = torch.arange(seqlen_k, device=bias_rows.device)
        scores = scores.masked_fill(cols[None, :] > rows[:, None] + (seqlen_k - seqlen_q), float("-inf"))
    order = scores.argsort(dim=-1, descending=True, stable=True)
    rank = torch.empty_like(order)
    rank.scatter_(-1, order, torch.arange(seqlen_k, device=order.device).expand_as(order))
    return rank < count[:, None]


def build_bench_inputs(pw: PeerWorkload, device: torch.device | str, seed: int = 0) -> BenchInputs | PackedInputs:
    """Seeded inputs for a bench workload; the mask is built slice by slice from the bias, or in a
    decode step from the cache's lengths; a packed or window workload's by `packed.build_inputs`."""
    w = pw.workload
    if pw.layout is not None:
        return packed.build_inputs(w, pw.layout, device, seed)
    dtype = DTYPES[w.dtype]
    generator = torch.Generator(device=device).manual_seed(seed)

    def randn(shape, dt=dtype):
        return torch.randn(shape, generator=generator, device=device, dtype=torch.float32).to(dt)

    q = randn((w.batch, w.seqlen_q, w.heads, w.head_dim))
    k = randn((w.batch, w.seqlen_k, w.heads_kv, w.head_dim))
    v = randn((w.batch, w.seqlen_k, w.heads_kv, w.head_dim))
    if pw.decode is not None:
        return _decode_inputs(pw.decode, q, k, v, generator)
    bias = None
    if w.bias != "none":
        bias = randn(w.operand_dims("bias")).requires_grad_(w.bias_grad)
    mask = None
    if w.mask != "none":
        mask_dims = w.operand_dims("mask")
        mask = torch.empty(mask_dims, dtype=torch.bool, device=device)
        for b in range(mask_dims[0]):
            for h in range(mask_dims[1]):
                # the mask of head h ranks the keys by its own bias row (its group's for GQA; a
                # per-key mask, one row for every head, by the first KV head's, over all keys)
                bias_h = h * bias.shape[1] // mask_dims[1]
                rows = bias.detach()[b, bias_h].expand(mask_dims[2], w.seqlen_k)
                mask[b, h] = _keep_top_of_causal_prefix(rows, pw.keep, w.causal and mask_dims[2] > 1)
                if w.causal and mask_dims[2] == 1:  # the keys every causal row sees stay: no row is dead
                    mask[b, h, :, :max(1, w.seqlen_k - w.seqlen_q + 1)] = True
    return BenchInputs(q, k, v, mask, bias, w.causal)


def _decode_inputs(cache: DecodeCache, q, k, v, generator: torch.Generator) -> BenchInputs:
    """A decode step: each sequence's first `cache.filled` keys hold data. The peers and the
    reference read k, v and the padding mask; ours reads what `cache.lengths` says: the same
    mask, or `cache_seqlens` over a copy whose tail holds NaN (never to be read), as it is or in
    pages shuffled through a pool with a block table."""
    batch, seqlen_k = k.shape[:2]
    if cache.lengths == "none":
        return BenchInputs(q, k, v, None, None, False, DecodeOperands(k, v, None, None, None))
    padding = (torch.arange(seqlen_k, device=k.device) < cache.filled).expand(batch, 1, 1, seqlen_k).contiguous()
    if cache.lengths == "mask":
        return BenchInputs(q, k, v, padding, None, False, DecodeOperands(k, v, padding, None, None))
    seqlens = torch.full((batch,), cache.filled, dtype=torch.int32, device=k.device)
    k_cache, v_cache = (t.clone() for t in (k, v))
    k_cache[:, cache.filled:], v_cache[:, cache.filled:] = float("nan"), float("nan")
    block_table = None
    if cache.lengths == "paged":
        k_cache, v_cache, block_table = paged_cache(k_cache, v_cache, cache.page, generator, seqlens)
    return BenchInputs(q, k, v, padding, None, False, DecodeOperands(k_cache, v_cache, None, seqlens, block_table))


# -- what the floor is --------------------------------------------------------------------------


def _operand_bytes(w: Workload, which: str, itemsize: int) -> float:
    """Bytes of the mask or bias a kernel must read: the causal part when it spans (Lq, Lk)."""
    dims = w.operand_dims(which)
    if dims is None:
        return 0.0
    spans_rows = dims[2] > 1
    fraction = w.visible_pairs() / (w.seqlen_q * w.seqlen_k) if spans_rows else 1.0
    return math.prod(dims) * itemsize * fraction


def kv_bytes(pw: PeerWorkload) -> float:
    """Bytes of K and V a forward must read: `keys_read` keys of each sequence."""
    w = pw.workload
    return 2.0 * w.batch * pw.keys_read * w.heads_kv * w.head_dim * DTYPES[w.dtype].itemsize


def bytes_needed(pw: PeerWorkload, direction: str, inputs: PackedInputs | None = None) -> float:
    """Bytes that must cross HBM: q, k, v, out (+lse), mask and bias over the causal part;
    the backward also reads dout and them again and writes dq, dk, dv and dbias. A packed or
    window workload's from its inputs (`packed.bytes_needed`)."""
    if pw.layout is not None:
        return packed.bytes_needed(inputs, direction)
    w = pw.workload
    item = DTYPES[w.dtype].itemsize
    qo = w.batch * w.seqlen_q * w.heads * w.head_dim * item
    kv = kv_bytes(pw)
    lse = w.batch * w.heads * w.seqlen_q * 4
    bias_bytes = _operand_bytes(w, "bias", item)
    operands = _operand_bytes(w, "mask", 1) + bias_bytes
    forward = qo + kv + qo + lse + operands
    if direction == "fwd":
        return forward
    backward = 3 * qo + kv + lse + operands + qo + kv + (bias_bytes if w.bias_grad else 0.0)
    return forward + backward


def flops_needed(pw: PeerWorkload, direction: str, inputs: PackedInputs | None = None) -> float:
    """The workload's FLOPs (`Workload.flops`) over the keys it must read: a decode step's
    unfilled tail needs none. A packed or window workload's over the pairs its inputs keep
    (`packed.flops_needed`)."""
    if pw.layout is not None:
        return packed.flops_needed(inputs, direction)
    w = pw.workload
    flops = w.flops("fwd") + (w.flops("bwd") if direction == "fwd+bwd" else 0.0)
    return flops * pw.keys_read / w.seqlen_k


def floor_ms(pw: PeerWorkload, direction: str, peaks: hardware.DevicePeaks | None,
             inputs: PackedInputs | None = None) -> float | None:
    if peaks is None:
        return None
    return 1e3 * max(flops_needed(pw, direction, inputs) / peaks.tensor_flops,
                     bytes_needed(pw, direction, inputs) / peaks.hbm_bytes_per_s)


def copy_rate(device: torch.device | str) -> float:
    """Bytes per second, read and write counted, of a `COPY_BYTES` device-to-device copy: what a
    streaming kernel can get from this GPU's memory, measured rather than read off a datasheet."""
    source = torch.empty(COPY_BYTES, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    timing = time_kernel(lambda: target.copy_(source), device, repeats=20)
    return 2 * COPY_BYTES / (timing.median_ms * 1e-3)


def kv_bandwidth_fraction(pw: PeerWorkload, median_ms: float, copy_bytes_per_s: float | None) -> float | None:
    """A decode step's K/V bytes (`kv_bytes`) over its GPU time, as a fraction of the copy rate;
    None for a prefill workload (bound by compute) or without a copy rate."""
    if pw.decode is None or copy_bytes_per_s is None:
        return None
    return kv_bytes(pw) / (median_ms * 1e-3) / copy_bytes_per_s


def check_against_reference(out: torch.Tensor, inputs: BenchInputs) -> TensorCheck:
    """Our forward's `out` by DESIGN §2 (`validator.compare`): against the reference of the
    workload's function (`BenchInputs` as the peers take it), its bound from the same reference
    run in the inputs' dtype. Not finite anywhere: ratio inf."""
    args = (inputs.q, inputs.k, inputs.v, inputs.mask, inputs.bias, inputs.is_causal)
    with torch.no_grad():
        high = attention(*args)
        low = attention(*args, compute_dtype=inputs.q.dtype)
    return compare("out", out, high, low, inputs.q.dtype)


# -- running ------------------------------------------------------------------------------------


@dataclass
class Row:
    """One (workload, peer, direction) measurement, or its error."""

    workload: str
    peer: str
    direction: str
    status: str  # ok | error
    error: str = ""
    median_ms: float | None = None
    p20_ms: float | None = None
    p80_ms: float | None = None
    spread: float | None = None
    host_ms: float | None = None  # host time of one call, which the timing hides (`timing.py`)
    wall_ms: float | None = None  # eager wall time per call (`timing.eager_wall_ms`)
    tflops: float | None = None
    floor_ms: float | None = None
    floor_fraction: float | None = None
    kv_bandwidth_fraction: float | None = None  # decode steps (`kv_bandwidth_fraction`)
    ours_over_peer_gpu: float | None = None  # our median_ms over this row's
    ours_over_peer_wall: float | None = None  # our wall_ms over this row's
    max_abs_diff_vs_ours: float | None = None
    error_over_bound: float | None = None  # our forward's (`check_against_reference`), when finite
    setup_ms: float | None = None
    note: str = ""

    def to_dict(self) -> dict:
        # six significant digits: milliseconds and fp32 differences of 1e-7 alike survive
        return {key: (float(f"{value:.6g}") if isinstance(value, float) else value) for key, value in asdict(self).items()}

    @classmethod
    def from_dict(cls, data) -> Row:
        """A row of a saved report, also of one from before the eager wall time, whose single
        `ours_over_peer` was the GPU-time ratio.

        Raises:
            ValueError: not a mapping, a key no row has, or a required key missing.
        """
        if not isinstance(data, dict):
            raise ValueError(f"a row is {type(data).__name__}, expected a mapping")
        data = dict(data)
        if "ours_over_peer" in data:
            data["ours_over_peer_gpu"] = data.pop("ours_over_peer")
        known = {field.name: field for field in fields(cls)}
        unknown = sorted(set(data) - set(known))
        missing = sorted(name for name, field in known.items()
                         if field.default is MISSING and field.default_factory is MISSING and name not in data)
        if unknown or missing:
            raise ValueError(f"a row has unknown keys {unknown} or lacks {missing}")
        return cls(**data)


class _Unavailable(Exception):
    """A peer that cannot run on this device; its reason is already one line."""


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300]}"


def _fwd_bwd(prepared: Prepared, grad_out: torch.Tensor):
    def run():
        for leaf in prepared.leaves:
            leaf.grad = None
        prepared.forward().backward(grad_out)

    return run


def _as_blhd(out: torch.Tensor, layout: str) -> torch.Tensor:
    """A peer's out in (B, L, H, D) order; packed (total, H, D) ("thd") as (1, total, H, D)."""
    return out.transpose(1, 2) if layout == "bhld" else out.unsqueeze(0) if layout == "thd" else out


def _prepare(pw: PeerWorkload, peer: str, inputs, table: str | None, device) -> Prepared:
    """The peer ready for this workload (`peers.PEERS`, or `packed_peers.PEERS` on a packed or
    window workload), after asking whether it can run it here.

    Raises:
        _Unavailable: it cannot, with the reason in one line.
    """
    if pw.layout is not None:
        reason = packed_peers.unavailable_reason(peer, device, inputs)
        builders = packed_peers.PEERS
    else:
        reason = (unavailable_reason(peer, device) if peer not in STRUCTURED_ONLY
                  else "runs only packed-document and sliding-window workloads")
        builders = PEERS
    if reason is not None:
        raise _Unavailable(reason)
    return builders[peer](inputs, table)


class _Mismatch(Exception):
    """Our forward failed its check against the reference; the reason is already one line."""


def _measure_peer(pw: PeerWorkload, peer: str, inputs: BenchInputs, table: str | None, device, repeats: int,
                  peaks, copy_bytes_per_s: float | None, ours_out: torch.Tensor | None,
                  advance, directions: tuple[str, ...]) -> tuple[list[Row], torch.Tensor | None]:
    rows: list[Row] = []
    out = None
    try:
        prepared = _prepare(pw, peer, inputs, table, device)
    except Exception as exc:  # a peer that cannot even be set up is data
        error = str(exc) if isinstance(exc, _Unavailable) else _one_line(exc)
        for direction in directions:
            rows.append(Row(pw.name, peer, direction, "error", error=error))
            advance(f"{pw.name} {peer} {direction}: error")
        return rows, None
    calls, loops = eager_loop(device)  # time_kernel's warm-up serves the eager loop too
    with prepared.context():  # the peer's own set-up for every call (SDPA's kernel choice)
        for direction in directions:
            row = Row(pw.name, peer, direction, "ok", setup_ms=prepared.setup_ms, note=prepared.note)
            try:
                if direction == "fwd":
                    with torch.no_grad():
                        out = _as_blhd(prepared.forward(), prepared.layout).detach()
                        if peer in OURS_PEERS:  # a wrong answer's speed is no result
                            check = (packed.check_against_reference if pw.layout is not None
                                     else check_against_reference)(out, inputs)
                            row.error_over_bound = check.ratio if check.finite else None
                            if not check.passed:
                                raise _Mismatch(f"against the reference, {check.failure()}")
                        timing = time_kernel(prepared.forward, device, repeats=repeats)
                        wall_ms = eager_wall_ms(prepared.forward, device, calls, loops, warmup=0)
                        if ours_out is not None and prepared.semantic:
                            # the same values in token order: a packed peer's (1, total, H, D)
                            # against ours' (B, L, H, D) on a dense batch
                            diff = out.float().reshape(ours_out.shape) - ours_out.float()
                            row.max_abs_diff_vs_ours = diff.abs().max().item()
                else:
                    grad_out = torch.ones_like(prepared.forward().detach()) / math.sqrt(pw.workload.head_dim)
                    timing = time_kernel(_fwd_bwd(prepared, grad_out), device, repeats=repeats)
                    wall_ms = eager_wall_ms(_fwd_bwd(prepared, grad_out), device, calls, loops, warmup=0)
            except _Mismatch as exc:
                row.status, row.error = "error", str(exc)
            except Exception as exc:  # a failing peer is a row, whatever failed
                row.status, row.error = "error", _one_line(exc)
            else:
                row.median_ms, row.p20_ms, row.p80_ms, row.spread, row.host_ms = (
                    timing.median_ms, timing.p20_ms, timing.p80_ms, timing.spread, timing.host_ms)
                row.wall_ms = wall_ms
                row.tflops = flops_needed(pw, direction, inputs) / (timing.median_ms * 1e-3) / 1e12
                row.floor_ms = floor_ms(pw, direction, peaks, inputs)
                if row.floor_ms is not None:
                    row.floor_fraction = row.floor_ms / timing.median_ms
                row.kv_bandwidth_fraction = kv_bandwidth_fraction(pw, timing.median_ms, copy_bytes_per_s)
            rows.append(row)
            advance(f"{pw.name} {peer} {direction}: {row.status}")
    del prepared
    return rows, out


class BenchInterrupted(KeyboardInterrupt):
    """A bench stopped by Ctrl-C or SIGTERM, with the rows it finished (ratios filled) and how many
    it planned: the caller reports them instead of losing them."""

    def __init__(self, rows: list[Row], planned: int):
        super().__init__(f"interrupted after {len(rows)} of {planned} rows")
        self.rows, self.planned = rows, planned


def run_bench(workloads: list[PeerWorkload], peers: list[str], device, table: str | None = None,
              repeats: int = 20, copy_bytes_per_s: float | None = None,
              directions: tuple[str, ...] = DIRECTIONS) -> list[Row]:
    """Every (workload, peer, direction of `directions` it has: `timed_directions`); ours first in
    each workload so ratios can be filled. The eager wall time runs `eager_loop(device)` calls;
    decode rows get their bandwidth fraction of `copy_bytes_per_s` (`copy_rate`) when it is given.

    Raises:
        BenchInterrupted: on KeyboardInterrupt, with the rows of every peer that finished."""
    device = torch.device(device)
    rows: list[Row] = []
    total = sum(len(timed_directions(pw, directions)) for pw in workloads) * len(peers)
    try:
        _measure_all(workloads, peers, device, table, repeats, copy_bytes_per_s, directions, rows, total)
    except KeyboardInterrupt:
        fill_ratios(rows)
        raise BenchInterrupted(rows, total) from None
    fill_ratios(rows)
    return rows


def _measure_all(workloads, peers, device, table, repeats, copy_bytes_per_s, directions, rows: list[Row],
                 total: int) -> None:
    """`run_bench`'s measurements, each peer's rows appended to `rows` as they finish."""
    peaks = hardware.device_peaks(device)
    with output.progress("bench", total=total) as advance:
        for pw in workloads:
            output.info(f"workload {pw.describe()}")
            inputs = build_bench_inputs(pw, device)
            ours_out = None
            for peer in peers:
                peer_rows, out = _measure_peer(pw, peer, inputs, table, device, repeats, peaks, copy_bytes_per_s,
                                               ours_out, advance, timed_directions(pw, directions))
                if peer == OURS:
                    ours_out = out
                rows.extend(peer_rows)
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            del inputs, ours_out


def fill_ratios(rows: list[Row]) -> None:
    """Each row's ours/peer on GPU time (median_ms) and on eager wall time (wall_ms), where both
    our row of its workload and direction and its own have the time."""
    ours = {(r.workload, r.direction): r for r in rows if r.peer == OURS and r.status == "ok"}
    for row in rows:
        mine = ours.get((row.workload, row.direction))
        if mine is None:
            continue
        if mine.median_ms is not None and row.median_ms:
            row.ours_over_peer_gpu = mine.median_ms / row.median_ms
        if mine.wall_ms is not None and row.wall_ms:
            row.ours_over_peer_wall = mine.wall_ms / row.wall_ms


def standing(rows: list[Row]) -> dict[str, dict[str, dict]]:
    """Per peer and direction, how ours stands against it over the workloads both ran: the
    geometric means of ours/peer on GPU time and on eager wall time, and the workloads where ours
    took longer on GPU time (`losing`, worst first)."""
    ratios: dict[tuple[str, str], list[Row]] = {}
    for row in rows:
        if row.peer != OURS and row.status == "ok" and row.ours_over_peer_gpu is not None:
            ratios.setdefault((row.peer, row.direction), []).append(row)

    def geomean(values: list[float]) -> float | None:
        return round(math.exp(sum(map(math.log, values)) / len(values)), 4) if values else None

    result: dict[str, dict[str, dict]] = {}
    for (peer, direction), mine in ratios.items():
        losing = sorted((r for r in mine if r.ours_over_peer_gpu > 1), key=lambda r: -r.ours_over_peer_gpu)
        result.setdefault(peer, {})[direction] = {
            "workloads": len(mine), "geomean_gpu": geomean([r.ours_over_peer_gpu for r in mine]),
            "geomean_wall": geomean([r.ours_over_peer_wall for r in mine if r.ours_over_peer_wall]),
            "losing": [[r.workload, round(r.ours_over_peer_gpu, 4)] for r in losing]}
    return result


def failed_rows_of_ours(rows: list[Row]) -> list[Row]:
    """Our own rows (peer `dmattn`) that ended in an error: the run failed at its one job."""
    return [row for row in rows if row.peer == OURS and row.status != "ok"]
