"""Launchers for the Triton kernels: explicit configs in, preallocated outputs filled.

Callers (the runtime plan, the validator, the tuner) own the outputs, so the validator can hand
in NaN-poisoned buffers and check that every element was written. Inputs arrive already checked
by `dmattn_bench.checks`: q (B, Lq, H, D), k/v (B, Lk, Hkv, D) with a contiguous head dim, mask/bias
as the caller passed them (up to 4 dims, broadcastable as (B|1, H|Hkv|1, Lq|1, Lk|1)) or None.
Nothing here copies or pads them.

A launch plan (`forward.ForwardPlan`, `backward.BackwardPlan`) holds what a call needs that does
not depend on its data: grids, strides, head divisors, flags, scratch shapes and, after its first
run, each kernel's compiled handle (`launching.Launch`). Running a plan costs its allocations and
one launcher call per kernel. The runtime (`dmattn_bench.plan`) keeps the plans it builds;
`attention_forward` and `attention_backward`, the backend interface of the validator and the
tuner, cache theirs by the call's signature. This module holds that interface: which configs
run (`is_supported`), what a config compiles to (`KERNELS`, `tile_constexprs`, `kernel_keys`)
and the cached entry points (the shared memory a forward needs is its plan's:
`ForwardPlan.shared_bytes`).
"""

from __future__ import annotations

from typing import Callable

import torch

from dmattn_kernels.configs import AttentionShape, BwdConfig, DecodeConfig, FwdConfig, Packing, shape_problem
from dmattn_kernels.runtime.plan_cache import PlanCache, python_tensor_layouts
from dmattn_kernels.triton.backward import BackwardPlan
from dmattn_kernels.triton.decode_launch import MASK_SCAN_KEYS, MAX_BLOCK_M
from dmattn_kernels.triton.forward import ForwardPlan
from dmattn_kernels.triton.layouts import MIN_BLOCK

MAX_BLOCK = 256
WARP_CHOICES = (1, 2, 4, 8, 16)
MAX_STAGES = 8
PLAN_CACHE_SIZE = 512  # signatures whose plans `attention_forward` / `attention_backward` keep
# The kernels of a direction that have tunables (the bwd preprocess kernel has a fixed tile).
KERNELS = {"fwd": ("flash_fwd_kernel",),
           "bwd": ("flash_bwd_dkdv_kernel", "flash_bwd_dq_kernel", "flash_bwd_dq_from_ds_kernel"),
           "decode": ("flash_decode_kernel",)}


def _check_block(name: str, value: int) -> str | None:
    if value < MIN_BLOCK or value > MAX_BLOCK or value & (value - 1):
        return f"{name}={value} is not a power of two in [{MIN_BLOCK}, {MAX_BLOCK}]"
    return None


def is_supported(config: FwdConfig | BwdConfig | DecodeConfig, shape: AttentionShape) -> str | None:
    """The reason `config` cannot run `shape`, or None when it can.

    Only structural limits live here; shared-memory and register fit per arch are pruned by
    cross-compilation in the tuner.
    """
    reason = shape_problem(shape)
    if reason:
        return reason
    if isinstance(config, FwdConfig) and config.knobs_on():
        return ("overlap, persistent and tma_store are knobs of the CUDA warp-specialized forward; the Triton "
                "forward has none (leave them 0)")
    if isinstance(config, BwdConfig) and config.knobs_on():
        return (f"{' and '.join(config.knobs_on())}: knobs of the CUDA warp-specialized backward; the Triton "
                "backward has none (leave them 0)")
    if isinstance(config, DecodeConfig):  # num_splits is checked when the config is built
        blocks = ["block_n"]
    else:
        blocks = ["block_m", "block_n"] + (["block_m_dq", "block_n_dq"] if isinstance(config, BwdConfig) else [])
    for name in blocks:
        reason = _check_block(name, getattr(config, name))
        if reason:
            return reason
    if config.num_warps not in WARP_CHOICES:
        return f"num_warps={config.num_warps} is not one of {WARP_CHOICES}"
    if not 1 <= config.num_stages <= MAX_STAGES:
        return f"num_stages={config.num_stages} is not in [1, {MAX_STAGES}]"
    return None


# -- what a config compiles to ----------------------------------------------------------------------


def tile_constexprs(kernel_name: str, config: FwdConfig | BwdConfig | DecodeConfig) -> dict[str, int]:
    """The tile sizes the plans give kernel `kernel_name` of `KERNELS` from `config` (the
    short-query forward's rows: the most `decode_launch` packs into one tile)."""
    if kernel_name in ("flash_bwd_dq_kernel", "flash_bwd_dq_from_ds_kernel"):
        return {"BLOCK_M": config.block_m_dq, "BLOCK_N": config.block_n_dq}
    if kernel_name == "flash_decode_kernel":
        return {"BLOCK_M": MAX_BLOCK_M, "BLOCK_N": config.block_n, "MASK_SCAN": MASK_SCAN_KEYS}
    return {"BLOCK_M": config.block_m, "BLOCK_N": config.block_n}


def kernel_keys(direction: str, config: FwdConfig | BwdConfig | DecodeConfig,
                shape: AttentionShape) -> tuple[tuple, ...]:
    """The kernels one launch of `direction` compiles, each keyed by what it reads of the config:
    its tiles (`tile_constexprs`), warps and stages. The mask's activity pass and the backward's
    delta pass read none of it. So the 32 sm90 backward candidates need 8 dK/dV kernels and 8 of
    each dQ kernel, not 32 of each."""
    if direction == "decode":  # the span pass and the combine read no tunable (and run by shape)
        return (("decode_mask_span_kernel",), ("flash_decode_kernel", config.block_n, config.num_warps,
                                               config.num_stages), ("decode_combine_kernel",))
    shared = (("tile_activity_kernel",),) if shape.has_mask else ()
    if direction == "bwd":
        shared += (("flash_bwd_preprocess_kernel",),)
    return shared + tuple((name, *tile_constexprs(name, config).values(), config.num_warps, config.num_stages)
                          for name in KERNELS[direction])


# -- the backend interface: plans cached by signature ----------------------------------------------


_plans = PlanCache(PLAN_CACHE_SIZE)


def clear_plans() -> None:
    """Forgets the plans `attention_forward` / `attention_backward` keep (tests that change how a
    plan is built, e.g. the K/V load path)."""
    _plans.clear()


def _cached_plan(direction: str, tensors: tuple, options: dict, build: Callable[[], object]):
    """The plan `_plans` keeps for a call of `direction` on `tensors` with `options`, built on a miss."""
    return _plans.get_or_build((direction, python_tensor_layouts(*tensors), tuple(options.values())), build)


def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                      bias: torch.Tensor | None, *, is_causal: bool, softmax_scale: float, softcap: float,
                      config: FwdConfig, out: torch.Tensor, lse: torch.Tensor,
                      activity: torch.Tensor | None = None, window: tuple[int, int] = (-1, -1),
                      packing: Packing | None = None, sequences: tuple = (None, None, None)) -> None:
    """Writes out (B, Lq, H, D) and lse (B, H, Lq) fp32 for one forward call, and, when a mask
    and an `activity` buffer (`activity_shape`, contiguous) are given, the mask's tile activity
    into it, for the backward of the same call (`attention_backward`). Runs `config` as given
    (the runtime fits an fp32 bias's tiles before: `dmattn_bench.tiles`).

    `window`: FlashAttention's (left, right) sliding window. `packing` (`configs.Packing`): the
    operands are packed sequences in its 4-D views and `sequences` holds (cu_seqlens_q,
    cu_seqlens_k, seqused_k or None); out's and lse's rows no sequence owns are left as given."""
    options = dict(is_causal=is_causal, softmax_scale=softmax_scale, softcap=softcap, config=config, window=window,
                   packing=packing)
    plan = _cached_plan("fwd", (q, k, v, mask, bias, out, lse), options,
                        lambda: ForwardPlan(q, k, v, mask, bias, out=out, lse=lse, **options))
    plan(q, k, v, mask, bias, out, lse, activity, sequences)


def attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                       lse: torch.Tensor, mask: torch.Tensor | None, bias: torch.Tensor | None, *, is_causal: bool,
                       softmax_scale: float, softcap: float, config: BwdConfig, dq: torch.Tensor, dk: torch.Tensor,
                       dv: torch.Tensor, dbias: torch.Tensor | None, activity: torch.Tensor | None = None,
                       dlse: torch.Tensor | None = None, window: tuple[int, int] = (-1, -1),
                       packing: Packing | None = None, sequences: tuple = (None, None, None)) -> None:
    """Writes dq, dk, dv and, when given, dbias (the bias's 4-D broadcast shape and its dtype).

    `dlse`: the gradient reaching lse, (B, H, Lq) fp32. d lse_i / d s_ij = P_ij, so it adds
    P * dlse to dS, which is dS with delta - dlse for delta.

    `activity`: the mask's tile activity as the forward of this call wrote it (`tile_activity`);
    without it the mask is read again (W1, the bench's full (B, H, L, L) mask, H100: 2.254 ->
    2.129 ms for the backward with it).

    `window`, `packing`, `sequences` as `attention_forward`'s; a packed call's gradients are
    zero-filled first (rows no sequence owns are written by no program)."""
    options = dict(is_causal=is_causal, softmax_scale=softmax_scale, softcap=softcap, config=config, window=window,
                   packing=packing)
    plan = _cached_plan("bwd", (dout, q, k, v, out, lse, mask, bias, dq, dk, dv, dbias, dlse), options,
                        lambda: BackwardPlan(dout, q, k, v, out, lse, mask, bias, dq=dq, dk=dk, dv=dv, dbias=dbias,
                                             dlse=dlse, **options))
    plan(dout, q, k, v, out, lse, mask, bias, dq, dk, dv, dbias, activity, dlse, sequences)
