"""An adversarial case (`Case`: a small declarative record), the tensors built for it (`Inputs`),
and what the dense builder (`adversarial.build_inputs`) and the packed one
(`varlen_cases.build_packed_inputs`) share.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

NO_WINDOW = (-1, -1)  # window_size without a window
KEEP_PROBABILITY = 0.7  # random masks keep 70% of positions: most tiles mixed, a few rows sparse
NAN_TAIL = 7  # extra rows/cols of NaN around sliced operands: odd so it straddles any tile
LARGE_BIAS = {torch.bfloat16: 1e4, torch.float16: 1e3, torch.float32: 1e3}


@dataclass(frozen=True)
class Case:
    """One adversarial input configuration (sizes, features, and what is poisoned)."""

    name: str
    batch: int = 1
    heads: int = 2
    heads_kv: int = 2
    seqlen_q: int = 33
    seqlen_k: int = 33
    head_dim: int = 32
    causal: bool = False
    mask: str = "none"
    mask_shape: str = "full"
    bias: str = "none"
    bias_grad: bool = True
    bias_fp32: bool = False
    bias_poison: str | None = None  # value written into the bias wherever it is excluded
    bias_neg_inf_allowed: bool = False  # -inf bias at some allowed positions (one whole row)
    sliced: bool = False  # k, v, mask and bias are views into larger NaN-tailed buffers
    bhld_views: bool = False  # q, k, v are transposes of contiguous (B, H, L, D) tensors
    logit_factor: float = 1.0
    large_bias: bool = False
    softcap: float = 0.0
    window: int = 0  # for mask="window": keys i - window < j <= i (bottom-right aligned)
    cache_lengths: bool = False  # per-sequence `cache_seqlens` (`adversarial.CACHE_LENGTHS`), K/V NaN past them
    page: int = 0  # > 0: k and v are a paged cache of pages this long (`adversarial.build_inputs`)
    pages_out_of_range: bool = False  # with page: some used table entries name no block (`adversarial.paged_cache`)
    tile_m: int = 16  # tile sizes the tile-aware masks are built on (set from the config)
    tile_n: int = 16
    tags: tuple[str, ...] = field(default=())
    # FlashAttention's sliding window (left, right), run by the kernels (`window` above is a mask's)
    window_size: tuple[int, int] = NO_WINDOW
    # a window on the config's tiles (`adversarial.window_on_tiles`): per side (a, b, c) for a * tile_m +
    # b * tile_n + c keys, or None for an unbounded side; sets window_size when the suite is built
    window_rule: tuple = ()
    # packed sequences (a varlen call, `varlen_cases.build_packed_inputs`): each sequence's query
    # rows; empty for a dense call. batch, seqlen_q and seqlen_k are then unused
    documents: tuple[int, ...] = ()
    documents_k: tuple[int, ...] = ()  # each sequence's key span (default: its query rows)
    seqused: tuple[int, ...] = ()  # keys each sequence uses (seqused_k), within its span; empty: all
    unowned: int = 0  # rows and keys no sequence owns, before the first sequence and after the last
    dead_documents: tuple[int, ...] = ()  # sequences whose mask excludes every key

    @property
    def packed(self) -> bool:
        return bool(self.documents)

    def key(self) -> str:
        return self.name


@dataclass
class Inputs:
    """Tensors of one case, as the user would pass them."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    mask: torch.Tensor | None
    bias: torch.Tensor | None
    dout: torch.Tensor
    cache_seqlens: torch.Tensor | None = None
    block_table: torch.Tensor | None = None
    # packed sequences: q (total_q, H, D), k/v (total_k, Hkv, D), a mask or bias per key
    # (H|Hkv|1, total_k) or per row (H|Hkv|1, total_q, max_seqlen_k), as flash_dmattn_varlen_func takes them
    sequences: tuple | None = None  # (cu_seqlens_q, cu_seqlens_k, seqused_k or None), int32
    max_seqlens: tuple[int, int] = (0, 0)  # (max_seqlen_q, max_seqlen_k)
    owned_rows: tuple[int, int] | None = None  # the query rows the sequences own: [first, end)


def window_visible(lq: int, lk: int, window_size: tuple[int, int], device) -> torch.Tensor:
    """(lq, lk) bool: the keys FlashAttention's bottom-right aligned window (left, right) keeps
    for each row (-1: that side unbounded); the causal rule is applied apart."""
    left, right = window_size
    rows = torch.arange(lq, device=device)[:, None] + (lk - lq)
    cols = torch.arange(lk, device=device)[None, :]
    visible = torch.ones(lq, lk, dtype=torch.bool, device=device)
    if left >= 0:
        visible &= cols >= rows - left
    if right >= 0:
        visible &= cols <= rows + right
    return visible
