"""Bench workloads of packed documents and sliding windows (issue 56): their entries, inputs,
kept (query, key) pairs, FLOPs, bytes and reference check.

A packed workload is N documents of given lengths concatenated into `total` tokens, each query
seeing only keys of its own document (FlashAttention's varlen layout: q (total, H, D), k/v
(total, Hkv, D), `cu_seqlens` (N+1,) int32); ours runs `flash_dmattn_varlen_func`. A window
workload is a dense batch (B sequences of L) with `window_size`; ours runs `flash_dmattn_func`.
Both are held in one form, `PackedInputs`: the dense batch as B documents of L tokens, whose
packed tensors are the (B, L, ...) tensors' own memory.

Every visibility rule is per document, bottom-right aligned as in the contract (a document's
queries and keys have the same length here, so the diagonal is key j = query i):
    key j visible from query i  iff  same document
                                     and (not causal or j <= i)
                                     and (left < 0 or j >= i - left) and (right < 0 or j <= i + right)
                                     and mask[head, i, j - start of i's document]  (when there is one)
The dynamic mask is per row, (H|Hkv, total, max_seqlen): each key of a row dropped at random
with probability `drop`, the diagonal kept (no row is left without a key).

TFLOP/s count the pairs a workload keeps (`kept_pairs`: documents, causal rule, window and the
mask's drops, over every query head), with `Workload.flops`'s 4 D FLOPs per pair forward and 2.5
times that backward. (W1-W3 of peers.yaml count their causal pairs, their masks' drops not.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dmattn_bench.reference import attention
from dmattn_bench.space import DTYPES, is_valid_head_dim
from dmattn_bench.tuning.validator import TensorCheck, compare
from dmattn_bench.tuning.workloads import Workload, positive_int, visible_pairs

FLOPS_PER_PAIR_PER_DIM = 4  # Q K^T and P V: two multiply-adds per pair and head dim, forward
BWD_OVER_FWD = 2.5  # the backward's 5 GEMMs against the forward's 2 (FlashAttention's count, `Workload.flops`)
LSE_BYTES = 4  # fp32 log-sum-exp per query row and head
# Keys that make an entry a packed or window workload rather than a W1-W3 one
STRUCTURE_KEYS = {"documents", "window"}
_COMMON_KEYS = {"name", "heads", "heads_kv", "head_dim", "dtype", "causal", "bias", "mask"}
_PACKED_KEYS = _COMMON_KEYS | {"documents"}  # and optionally window
_DENSE_KEYS = _COMMON_KEYS | {"batch", "seqlen", "window"}
_MASK_KINDS = ("full", "kv_head")  # the mask's heads: H, or one per KV head


@dataclass(frozen=True)
class Layout:
    """How a workload's tokens are arranged and which pairs it keeps."""

    documents: tuple[int, ...]  # token count of each document (a dense batch: B documents of L)
    packed: bool  # ours takes the varlen call; else the dense call on (B, L, ...) views
    window: tuple[int, int]  # (left, right) keys either side of the diagonal, inclusive; -1: unbounded
    drop: float | None  # the dynamic mask's fraction of keys dropped at random; None: no mask

    @property
    def total(self) -> int:
        return sum(self.documents)

    @property
    def max_seqlen(self) -> int:
        return max(self.documents)


def _window(value, where: str) -> tuple[int, int]:
    if (not isinstance(value, list) or len(value) != 2
            or any(isinstance(side, bool) or not isinstance(side, int) or side < -1 for side in value)):
        raise ValueError(f"{where}.window: got {value!r}, expected [left, right], two ints >= -1 (-1: unbounded), "
                         "e.g. [1023, 0] for 1024 keys up to the diagonal")
    return value[0], value[1]


def _documents(value, where: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not value or any(isinstance(n, bool) or not isinstance(n, int) or n < 1
                                                       for n in value):
        raise ValueError(f"{where}.documents: got {value!r}, expected a non-empty list of token counts >= 1")
    return tuple(value)


def parse_structured(entry: dict, where: str, dtype: str, heads: int, heads_kv: int) -> tuple[Workload, Layout]:
    """A packed (`documents`) or window (`batch`, `seqlen`, `window`) entry of a peers YAML, its
    dtype and heads already checked (`harness._dtype_and_heads`).

    Raises:
        ValueError: a missing or unknown key, or a bad value, naming the entry and the key.
    """
    packed = "documents" in entry
    expected = _PACKED_KEYS if packed else _DENSE_KEYS
    if not (expected <= set(entry) <= expected | {"window"}):
        raise ValueError(f"{where}: expected keys {sorted(_PACKED_KEYS)} and optionally window (packed documents), "
                         f"or {sorted(_DENSE_KEYS)} (a dense batch with a window), got {sorted(entry)}")
    head_dim = positive_int(entry["head_dim"], f"{where}.head_dim")
    if not is_valid_head_dim(head_dim):
        raise ValueError(f"{where}.head_dim: got {head_dim}, expected a multiple of 8 in [8, 256]")
    window = _window(entry["window"], where) if "window" in entry else (-1, -1)
    if packed:
        documents = _documents(entry["documents"], where)
        batch, seqlen = 1, max(documents)  # one call; Lq = Lk = its longest document, as the tuner's packed keys
    else:
        batch, seqlen = (positive_int(entry[key], f"{where}.{key}") for key in ("batch", "seqlen"))
        documents = (seqlen,) * batch
    bias, mask = entry["bias"], entry["mask"]
    per_key = isinstance(bias, dict) and set(bias) <= {"kind", "grad"} and bias.get("kind") == "per_key"
    if bias != "none" and not per_key:
        raise ValueError(f"{where}.bias: got {bias!r}, expected none or {{kind: per_key, grad: bool}} "
                         "(one value per KV head and key: (Hkv, total) packed, (B, Hkv, 1, L) dense)")
    drop = None
    if mask != "none":
        if not (isinstance(mask, dict) and set(mask) == {"kind", "drop"} and mask["kind"] in _MASK_KINDS):
            raise ValueError(f"{where}.mask: got {mask!r}, expected none or {{kind: {'|'.join(_MASK_KINDS)}, drop: f}}")
        drop = mask["drop"]
        if isinstance(drop, bool) or not isinstance(drop, (int, float)) or not 0 <= drop < 1:
            raise ValueError(f"{where}.mask.drop: got {drop!r}, expected the fraction in [0, 1) of keys dropped")
    workload = Workload(
        batch=batch, heads=heads, heads_kv=heads_kv, seqlen_q=seqlen, seqlen_k=seqlen, head_dim=head_dim,
        causal=bool(entry["causal"]), mask="none" if drop is None else mask["kind"],
        bias="none" if bias == "none" else "per_key", bias_grad=bias != "none" and bool(bias.get("grad", False)),
        dtype=dtype)
    return workload, Layout(documents, packed, window, None if drop is None else float(drop))


def describe(w: Workload, layout: Layout) -> str:
    """One line: dtype, documents or batch, heads, window, mask and bias."""
    gqa = f" gqa{w.heads // w.heads_kv}" if w.heads != w.heads_kv else ""
    tokens = (f"{len(layout.documents)} documents {list(layout.documents)} = {layout.total} tokens" if layout.packed
              else f"B{w.batch} L{w.seqlen_q}")
    window = "" if layout.window == (-1, -1) else f" window={layout.window}"
    mask = "none" if layout.drop is None else f"{w.mask} drop {layout.drop:g}, diagonal kept"
    return (f"{w.dtype} {tokens} H{w.heads}{gqa} D{w.head_dim}{' causal' if w.causal else ''}{window} "
            f"mask={mask} bias={w.bias}{'+grad' if w.bias_grad else ''}")


# -- visibility and kept pairs -------------------------------------------------------------------


def visibility(seqlen: int, is_causal: bool, window: tuple[int, int], device=None) -> torch.Tensor:
    """(L, L) bool of one document: key j visible from query i by the causal rule and the window."""
    rows = torch.arange(seqlen, device=device)[:, None]
    cols = torch.arange(seqlen, device=device)[None, :]
    visible = torch.ones(seqlen, seqlen, dtype=torch.bool, device=device)
    left, right = window
    if is_causal:
        visible &= cols <= rows
    if left >= 0:
        visible &= cols >= rows - left
    if right >= 0:
        visible &= cols <= rows + right
    return visible


def kept_pairs(documents: tuple[int, ...], is_causal: bool, window: tuple[int, int], heads: int,
               mask: torch.Tensor | None = None) -> int:
    """The (query, key) pairs that `heads` query heads keep, exactly: each document's pairs that the
    causal rule and the window leave and, with a per-row `mask` (H|Hkv|1, total, max_seqlen), that
    its head keeps (query head h reads mask head h // (heads / mask heads)). Counted once per
    workload, on the mask's device, outside any timing."""
    device = None if mask is None else mask.device
    pairs, start = 0, 0
    for seqlen in documents:
        if mask is None:  # the tuner's count of the same rule (`workloads.visible_pairs`)
            pairs += heads * visible_pairs(seqlen, seqlen, is_causal, window)
        else:
            kept = mask[:, start:start + seqlen, :seqlen] & visibility(seqlen, is_causal, window, device)
            pairs += heads // mask.shape[0] * int(kept.sum())
        start += seqlen
    return pairs


# -- inputs ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PackedInputs:
    """A packed or window workload's tensors, packed: the workload's function as every peer and the
    reference take it (each peer re-lays them out once, outside its timing)."""

    q: torch.Tensor  # (total, H, D)
    k: torch.Tensor  # (total, Hkv, D)
    v: torch.Tensor
    cu_seqlens: torch.Tensor  # (N+1,) int32, the documents' prefix sums (queries and keys alike)
    layout: Layout
    is_causal: bool
    mask: torch.Tensor | None  # (H|Hkv, total, max_seqlen) bool: column j of row i is key j of i's document
    bias: torch.Tensor | None  # (Hkv, total): one value per KV head and key; requires grad when learnable
    kept_pairs: int  # over every query head (`kept_pairs`)
    visible_pairs: int  # of one head, without the mask's drops: where a per-row mask is read

    @property
    def window(self) -> tuple[int, int]:
        return self.layout.window

    @property
    def batch(self) -> int | None:
        """B of a dense (window) workload, whose documents are its B sequences; None when packed."""
        return None if self.layout.packed else len(self.layout.documents)

    def bounds(self) -> list[tuple[int, int]]:
        """(start, end) token of each document."""
        ends = self.cu_seqlens.tolist()
        return list(zip(ends[:-1], ends[1:]))


def cu_seqlens(documents: tuple[int, ...], device=None) -> torch.Tensor:
    """(N+1,) int32 prefix sums of the document lengths, from 0."""
    lengths = torch.tensor((0, *documents), dtype=torch.int64)
    return lengths.cumsum(0).to(device=device, dtype=torch.int32)


def positions(documents: tuple[int, ...], device=None) -> torch.Tensor:
    """(total,) int64: each token's position in its own document."""
    return torch.cat([torch.arange(n, device=device) for n in documents])


def build_inputs(w: Workload, layout: Layout, device, seed: int = 0) -> PackedInputs:
    """Seeded inputs: q, k, v, the per-key bias and the per-row mask (each key dropped with
    probability `layout.drop`, the diagonal kept), and the pairs they keep."""
    dtype = DTYPES[w.dtype]
    generator = torch.Generator(device=device).manual_seed(seed)
    total = layout.total

    def randn(shape):
        return torch.randn(shape, generator=generator, device=device, dtype=torch.float32).to(dtype)

    q = randn((total, w.heads, w.head_dim))
    k = randn((total, w.heads_kv, w.head_dim))
    v = randn((total, w.heads_kv, w.head_dim))
    bias = randn((w.heads_kv, total)).requires_grad_(w.bias_grad) if w.bias != "none" else None
    mask = None
    if layout.drop is not None:
        mask_heads = w.heads if w.mask == "full" else w.heads_kv
        mask = torch.rand((mask_heads, total, layout.max_seqlen), generator=generator, device=device) >= layout.drop
        mask[:, torch.arange(total, device=device), positions(layout.documents, device)] = True  # the diagonal
    return PackedInputs(
        q, k, v, cu_seqlens(layout.documents, device), layout, w.causal, mask, bias,
        kept_pairs=kept_pairs(layout.documents, w.causal, layout.window, w.heads, mask),
        visible_pairs=kept_pairs(layout.documents, w.causal, layout.window, 1))


# -- what the floor is ----------------------------------------------------------------------------


def flops_needed(inputs: PackedInputs, direction: str) -> float:
    """4 D FLOPs per kept pair forward; fwd+bwd adds the backward's 2.5 times that."""
    forward = FLOPS_PER_PAIR_PER_DIM * inputs.q.shape[-1] * inputs.kept_pairs
    return float(forward * (1 + BWD_OVER_FWD) if direction == "fwd+bwd" else forward)


def bytes_needed(inputs: PackedInputs, direction: str) -> float:
    """Bytes that must cross HBM, counted as `harness.bytes_needed` counts them: q, k, v, out, lse,
    the bias's (Hkv, total) and the mask where a row can see (its documents, causal rule and
    window); the backward also reads dout and them again and writes dq, dk, dv and dbias."""
    q, k = inputs.q, inputs.k
    item = q.element_size()
    qo = q.numel() * item
    kv = 2 * k.numel() * item
    lse = q.shape[0] * q.shape[1] * LSE_BYTES
    bias_bytes = 0.0 if inputs.bias is None else inputs.bias.numel() * item
    mask_bytes = 0.0 if inputs.mask is None else inputs.mask.shape[0] * inputs.visible_pairs
    operands = mask_bytes + bias_bytes
    forward = qo + kv + qo + lse + operands
    if direction == "fwd":
        return forward
    grad_bias = bias_bytes if inputs.bias is not None and inputs.bias.requires_grad else 0.0
    return forward + 3 * qo + kv + lse + operands + qo + kv + grad_bias


# -- the reference ---------------------------------------------------------------------------------


def reference_out(inputs: PackedInputs, compute_dtype: torch.dtype | None = None) -> torch.Tensor:
    """(total, H, D): `reference.attention` on each document by itself (B = 1, its slices of the
    mask and bias), the definition of the packed call."""
    window = {} if inputs.window == (-1, -1) else {"window_size": inputs.window}
    outs = []
    with torch.no_grad():
        for start, end in inputs.bounds():
            seqlen = end - start
            mask = None if inputs.mask is None else inputs.mask[:, start:end, :seqlen].unsqueeze(0)
            bias = None if inputs.bias is None else inputs.bias.detach()[:, start:end][None, :, None, :]
            q, k, v = (t[start:end].unsqueeze(0) for t in (inputs.q, inputs.k, inputs.v))
            outs.append(attention(q, k, v, mask, bias, inputs.is_causal, compute_dtype=compute_dtype, **window)[0])
    return torch.cat(outs)


def check_against_reference(out: torch.Tensor, inputs: PackedInputs) -> TensorCheck:
    """Our forward's `out` (any shape holding (total, H, D) in token order) by DESIGN §2, as
    `harness.check_against_reference` checks a dense one."""
    high = reference_out(inputs)
    low = reference_out(inputs, compute_dtype=inputs.q.dtype)
    return compare("out", out.reshape(high.shape), high, low, inputs.q.dtype)
