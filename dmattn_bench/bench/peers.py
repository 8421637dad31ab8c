"""The kernels `dmattn-bench bench` measures side by side: ours (dispatch-selected) and its peers.
(Packed-document and sliding-window workloads have their own, `bench.packed_peers`.)

Every peer is prepared once per workload (layout copies, block masks, float masks: setup, not
timed) into a `Prepared`: a call that runs the forward on the prepared tensors, and the leaves the
backward differentiates. A peer that cannot run raises; the bench records the error as a row.

Peers computing the same function as ours (FlexAttention, SDPA with a float mask, flash-dmattn)
get the same mask and bias; the dense-causal speed references (SDPA flash, SDPA cuDNN) get only
q, k, v and the causal rule. A peer that cannot run on this device says why before any of its
work is done (`unavailable_reason`).

In a decode step (`BenchInputs.decode`) ours reads the KV cache the way the workload tells it
(a padding mask, `cache_seqlens` over a cache whose tail holds NaN, or pages and a block table)
and runs without gradient; the peers read a clean copy of the cache with the same lengths as a
padding mask (`BenchInputs.mask`).
"""

from __future__ import annotations

import contextlib
import importlib.util
import time
from dataclasses import dataclass
from typing import Callable, ContextManager

import torch

from dmattn_bench import plan
from dmattn_bench.api import flash_dmattn_func
from dmattn_bench.space import as_4d, config_label

OURS = "dmattn"
# ours and each bundled backend of ours: their forward rows are checked against the reference
OURS_PEERS = (OURS, "ours-triton", "ours-cuda")


@dataclass
class Prepared:
    """One peer ready to run one workload."""

    forward: Callable[[], torch.Tensor]  # returns out in (B, Lq, H, D) order or (B, H, Lq, D), see `layout`
    leaves: list[torch.Tensor]  # what its backward produces gradients for
    setup_ms: float | None = None  # one-off work per mask (e.g. FlexAttention's block mask)
    note: str = ""
    layout: str = "blhd"  # "blhd" or "bhld": how to compare its output with ours
    semantic: bool = True  # computes the workload's function (False: a dense speed reference)
    # entered once around all of the peer's calls, outside their timing (SDPA's kernel choice:
    # entering `sdpa_kernel` costs more host time than the call it chooses for)
    context: Callable[[], ContextManager] = contextlib.nullcontext


@dataclass(frozen=True)
class DecodeOperands:
    """What ours reads in a decode step besides q, as the workload tells it each sequence's length."""

    k: torch.Tensor  # (B, Lk, Hkv, D), or a page pool (pages, page, Hkv, D) read through `block_table`
    v: torch.Tensor
    mask: torch.Tensor | None  # the padding mask (B, 1, 1, Lk) when it says the lengths
    cache_seqlens: torch.Tensor | None  # (B,) int32 when they do; K/V past them hold NaN
    block_table: torch.Tensor | None  # (B, Lk / page) int32 over the pool


@dataclass(frozen=True)
class BenchInputs:
    """A workload's tensors in the contract's layout (q (B, L, H, D), k/v (B, L, Hkv, D)): the
    workload's function, as the reference and the peers take it."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    mask: torch.Tensor | None  # bool, 4-D
    bias: torch.Tensor | None  # 4-D, requires grad when the workload's bias is learnable
    is_causal: bool
    decode: DecodeOperands | None = None  # a decode step (forward only): what ours reads instead


def _leaf(t: torch.Tensor, requires_grad: bool = True) -> torch.Tensor:
    return t.detach().clone().requires_grad_(requires_grad)


def _bhld_leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().transpose(1, 2).contiguous().requires_grad_()


def _bias_leaf(inputs: BenchInputs) -> torch.Tensor | None:
    """The workload's bias as a fresh leaf, learnable when the workload's is."""
    return None if inputs.bias is None else _leaf(inputs.bias, inputs.bias.requires_grad)


def _grad_leaves(q, k, v, bias) -> list[torch.Tensor]:
    """What a backward differentiates: q, k, v, and the bias when it is learnable."""
    return [q, k, v] + ([bias] if bias is not None and bias.requires_grad else [])


def _chosen(direction: str, q, k, mask, bias, is_causal: bool, backend: str, table: str | None) -> str:
    """"<backend> <direction> <config>" of what the dispatch runs `direction` with."""
    learnable = bias is not None and bias.requires_grad
    chosen_backend, config = plan.select(direction, q, k, as_4d(mask), as_4d(bias), is_causal, backend, table, None,
                                         learnable)
    return f"{chosen_backend.name} {direction} {config_label(config)}"


def _ours(inputs: BenchInputs, table: str | None, backend: str = "auto") -> Prepared:
    """Our kernels as the dispatch picks them ("auto": the table, else the defaults), or one
    backend's with its defaults."""
    if inputs.decode is not None:
        return _ours_decoding(inputs, table, backend)
    q, k, v = (_leaf(t) for t in (inputs.q, inputs.k, inputs.v))
    bias = _bias_leaf(inputs)

    def forward():
        return flash_dmattn_func(q, k, v, inputs.mask, bias, is_causal=inputs.is_causal, backend=backend, table=table)

    # a table tuned over both backends may pick a different one per direction
    note = ", ".join(_chosen(d, q, k, inputs.mask, bias, inputs.is_causal, backend, table) for d in ("fwd", "bwd"))
    return Prepared(forward, _grad_leaves(q, k, v, bias), note=note)


def _ours_decoding(inputs: BenchInputs, table: str | None, backend: str) -> Prepared:
    """One decode step of ours: no gradient, the cache read as `inputs.decode` says."""
    q, step = inputs.q, inputs.decode

    def forward():
        return flash_dmattn_func(q, step.k, step.v, step.mask, inputs.bias, is_causal=inputs.is_causal,
                                 backend=backend, table=table, cache_seqlens=step.cache_seqlens,
                                 block_table=step.block_table)

    # a call without gradient and with at most MAX_DECODE_QUERIES query rows (a decode workload
    # has no more) runs the short-query forward on "auto" and "triton" (`flash_dmattn_func`)
    if backend in ("auto", "triton"):
        _, config = plan.select("decode", q, step.k, as_4d(step.mask), as_4d(inputs.bias), inputs.is_causal, backend,
                                table, None, False, block_table=step.block_table)
        note = f"triton short-query fwd {config_label(config)}"
    else:
        note = _chosen("fwd", q, step.k, step.mask, inputs.bias, inputs.is_causal, backend, table)
    return Prepared(forward, [], note=note)


def _index(operand: torch.Tensor, b, h, q_idx, kv_idx, group_div: int):
    """operand[b, h // group_div, q, kv] with size-1 (broadcast) dims read at 0."""
    dims = operand.shape
    zero = torch.zeros_like(q_idx)
    return operand[
        b if dims[0] > 1 else zero,
        h // group_div if dims[1] > 1 else zero,
        q_idx if dims[2] > 1 else zero,
        kv_idx if dims[3] > 1 else zero,
    ]


def _flex(inputs: BenchInputs, kernel_options: dict | None) -> Prepared:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    q, k, v = (_bhld_leaf(t) for t in (inputs.q, inputs.k, inputs.v))
    batch, heads, seqlen_q, _ = q.shape
    heads_kv, seqlen_k = k.shape[1], k.shape[2]
    mask, bias = inputs.mask, _bias_leaf(inputs)
    offset = seqlen_k - seqlen_q
    mask_div = heads // mask.shape[1] if mask is not None and mask.shape[1] > 1 else 1
    bias_div = heads // bias.shape[1] if bias is not None and bias.shape[1] > 1 else 1

    def mask_mod(b, h, q_idx, kv_idx):
        keep = kv_idx <= q_idx + offset if inputs.is_causal else kv_idx >= 0
        if mask is not None:
            keep = keep & _index(mask, b, h, q_idx, kv_idx, mask_div)
        return keep

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + _index(bias, b, h, q_idx, kv_idx, bias_div).to(score.dtype)

    # every workload's mask_mod/score_mod closures are new functions: without a reset they count
    # as recompiles of one frame, and past dynamo's limit flex_attention silently runs eagerly
    # (20 ms instead of 0.4 ms on W3, H100, 2026-11-21)
    torch._dynamo.reset()
    begin = time.perf_counter()
    # a mask that broadcasts over batch or heads (a decode step's padding mask is (B, 1, 1, Lk))
    # gets a block mask that broadcasts too: built once per distinct row, not per query head
    block_mask = create_block_mask(mask_mod, batch if mask is not None and mask.shape[0] > 1 else None,
                                   heads if mask is not None and mask.shape[1] > 1 else None, seqlen_q, seqlen_k,
                                   device=q.device)
    if q.is_cuda:
        torch.cuda.synchronize()
    setup_ms = (time.perf_counter() - begin) * 1e3
    compiled = torch.compile(flex_attention, dynamic=False)

    def forward():
        return compiled(q, k, v, score_mod=score_mod if bias is not None else None, block_mask=block_mask,
                        enable_gqa=heads != heads_kv, kernel_options=kernel_options)

    leaves = _grad_leaves(q, k, v, bias)
    note = "block mask built once (setup_ms, after compiling create_block_mask)"
    if kernel_options:
        note += "; backward tiles " + ",".join(f"{key}={value}" for key, value in kernel_options.items())
    return Prepared(forward, leaves, setup_ms=setup_ms, note=note, layout="bhld")


def _float_mask(inputs: BenchInputs, heads: int) -> torch.Tensor:
    """bias where visible, -inf elsewhere, (B, H|1, Lq, Lk) in q's dtype (SDPA's additive mask)."""
    batch, seqlen_q, _, _ = inputs.q.shape
    seqlen_k = inputs.k.shape[1]
    visible = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=inputs.q.device)
    if inputs.is_causal:
        visible = visible.tril(seqlen_k - seqlen_q)
    visible = visible.expand(batch, 1, seqlen_q, seqlen_k)
    if inputs.mask is not None:
        visible = visible & _repeat_heads(inputs.mask, heads)
    bias = torch.zeros((), dtype=inputs.q.dtype, device=inputs.q.device)
    if inputs.bias is not None:
        bias = _repeat_heads(inputs.bias.detach(), heads).to(inputs.q.dtype)
    return torch.where(visible, bias, torch.tensor(float("-inf"), dtype=inputs.q.dtype, device=inputs.q.device))


def _repeat_heads(operand: torch.Tensor, heads: int) -> torch.Tensor:
    if operand.shape[1] in (1, heads):
        return operand
    return operand.repeat_interleave(heads // operand.shape[1], dim=1)


# SDPA kernels that take GQA K/V as they are (`enable_gqa`); the others get K/V repeated to H
# heads. Repeating costs the flash kernel H / Hkv times the K/V reads, which are the whole of a
# decode step's work (issue #27).
SDPA_NATIVE_GQA = ("flash",)


def _sdpa(inputs: BenchInputs, kernel: str, dense: bool) -> Prepared:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"efficient": SDPBackend.EFFICIENT_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
               "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}[kernel]
    q, k, v = (_bhld_leaf(t) for t in (inputs.q, inputs.k, inputs.v))
    heads, heads_kv = q.shape[1], k.shape[1]
    float_mask = None
    note = (f"dense {'causal ' if inputs.is_causal else ''}speed reference: no mask, no bias" if dense
            else "float mask = bias or -inf, built once; no dbias")
    if not dense and (inputs.mask is not None or inputs.bias is not None):
        float_mask = _float_mask(inputs, heads)
    causal = inputs.is_causal and float_mask is None
    gqa = heads != heads_kv and kernel in SDPA_NATIVE_GQA
    if heads != heads_kv and not gqa:
        # repeated once, outside the timed call
        k, v = (_leaf(t.detach().repeat_interleave(heads // heads_kv, dim=1)) for t in (k, v))
        note += f"; K/V repeated to {heads} heads"
    elif gqa:
        note += "; GQA through enable_gqa"

    def forward():
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=float_mask, is_causal=causal,
                                                                enable_gqa=gqa)

    # a dense reference computes the workload's own function when it has no mask and no bias
    semantic = not dense or (inputs.mask is None and inputs.bias is None)
    return Prepared(forward, [q, k, v], note=note, layout="bhld", semantic=semantic,
                    context=lambda: sdpa_kernel(backend))


def _flash_dmattn(inputs: BenchInputs) -> Prepared:
    if importlib.util.find_spec("flash_dmattn") is None:
        raise RuntimeError("flash_dmattn is not installed (pip install flash-dmattn)")
    import flash_dmattn

    q, k, v = (_leaf(t) for t in (inputs.q, inputs.k, inputs.v))
    bias = _bias_leaf(inputs)

    def forward():
        return flash_dmattn.flash_dmattn_func(q, k, v, attn_mask=inputs.mask, attn_bias=bias,
                                              is_causal=inputs.is_causal)

    return Prepared(forward, _grad_leaves(q, k, v, bias), note=f"flash_dmattn {getattr(flash_dmattn, '__version__', '?')}")


# Smaller backward tiles than FlexAttention's defaults, which run out of shared memory on the
# W1 backward (D128 with a captured bias gradient; issue #5's H200 figures).
FLEX_SMALL_BACKWARD = {"BLOCK_M1": 32, "BLOCK_N1": 64, "BLOCK_M2": 64, "BLOCK_N2": 32}

PEERS: dict[str, Callable[[BenchInputs, str | None], Prepared]] = {
    OURS: lambda inputs, table: _ours(inputs, table),
    # each bundled backend with its defaults, whichever the dispatch would pick
    "ours-triton": lambda inputs, table: _ours(inputs, table, "triton"),
    "ours-cuda": lambda inputs, table: _ours(inputs, table, "cuda"),
    "flex": lambda inputs, table: _flex(inputs, None),
    "flex-small-bwd": lambda inputs, table: _flex(inputs, FLEX_SMALL_BACKWARD),
    "sdpa-efficient": lambda inputs, table: _sdpa(inputs, "efficient", dense=False),
    # materialises (B, H, Lq, Lk) scores: a semantic cross-check (and the CPU tests' peer), not a default
    "sdpa-math": lambda inputs, table: _sdpa(inputs, "math", dense=False),
    "sdpa-flash-dense": lambda inputs, table: _sdpa(inputs, "flash", dense=True),
    "sdpa-cudnn-dense": lambda inputs, table: _sdpa(inputs, "cudnn", dense=True),
    "flash-dmattn": lambda inputs, table: _flash_dmattn(inputs),
}


# Peers whose kernels run only on a CUDA GPU, and why. Elsewhere their rows say so rather than
# what torch raises there (FlexAttention "does not support backward on CPU" even for a forward
# row, SDPA "turning off both the math kernel and the fused kernels"). SDPA's flash kernel has a
# CPU implementation and runs.
CUDA_ONLY = {
    "ours-cuda": "the cuda backend's kernels run only there",
    "flex": "FlexAttention has no CPU backward",
    "flex-small-bwd": "FlexAttention has no CPU backward",
    "sdpa-efficient": "SDPA's memory-efficient kernel is CUDA-only",
    "sdpa-cudnn-dense": "cuDNN attention is CUDA-only",
    "flash-dmattn": "its kernels are CUDA-only",
}


def unavailable_reason(peer: str, device: torch.device | str) -> str | None:
    """Why `peer` cannot run on `device`, in one line; None when it can."""
    if peer in CUDA_ONLY and torch.device(device).type != "cuda":
        return f"needs a CUDA GPU ({CUDA_ONLY[peer]})"
    return None


# What `bench` runs without --peers (issue #5's list); sdpa-math is opt-in.
DEFAULT_PEERS = ("flex", "flex-small-bwd", "sdpa-efficient", "sdpa-flash-dense", "sdpa-cudnn-dense", "flash-dmattn")
# ... and on decode workloads (issue #27's list): SDPA flash takes no mask, the memory-efficient
# kernel takes the padding as a float mask, FlexAttention as a mask_mod
DECODE_PEERS = ("sdpa-flash-dense", "sdpa-efficient", "flex")
# Peers of the packed-document and sliding-window workloads alone (`bench.packed_peers` builds
# them, and its own ours and flex for those workloads); on W1-W3 and decode steps their rows say so
STRUCTURED_ONLY = ("flex-rebuild", "varlen-attn", "sdpa-per-doc")
# ... and what `bench` runs on them without --peers (issue 56's list)
PACKED_PEERS = ("flex", *STRUCTURED_ONLY)
# Group names (DESIGN §4 writes `--peers flex,sdpa,...`).
PEER_GROUPS = {"sdpa": ("sdpa-efficient", "sdpa-flash-dense", "sdpa-cudnn-dense"),
               "flex-all": ("flex", "flex-small-bwd")}


def parse_peers(text: str) -> list[str]:
    """`"flex,sdpa"` -> the peer names (groups expanded), ours first (always measured: ratios need it).

    Raises:
        ValueError: an unknown peer name.
    """
    names = []
    for name in (part.strip() for part in text.split(",")):
        names.extend(PEER_GROUPS.get(name, (name,)) if name else ())
    known = (*PEERS, *STRUCTURED_ONLY)
    unknown = [name for name in names if name not in known]
    if unknown:
        raise ValueError(f"--peers: unknown {unknown}, expected names from {', '.join([*known, *PEER_GROUPS])}")
    return [OURS] + [name for name in dict.fromkeys(names) if name != OURS]
