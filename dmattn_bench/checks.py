"""What a call's arguments must be, checked once per call signature (`dmattn_bench.api`):

- the contract's checks (`reference.check_inputs`: shapes, dtypes, devices and the broadcast rule
  of the mask and bias, docs/CONTRACT.md §1), which the reference runs too;
- the rest of a call's (`check_call`): flags, scalars, configs, backend names, and what the fused
  kernels need beyond the contract (strides, head dims, dtypes per device);
- the same for a packed-sequence call (`check_varlen_call`, on `reference.check_varlen_inputs`;
  `reference.varlen_layout` names its mask's and bias's layout for the launchers);
- the two checks that read data, run on every call where they apply (`check_mask_values`,
  `check_pages`).

Each raises TypeError or ValueError naming the argument, what it got and what is expected.
"""

from __future__ import annotations

import math
import numbers

import torch

from dmattn_bench.reference import check_inputs, check_varlen_inputs, check_window
from dmattn_bench.registry import get_backend, interpreter_enabled
from dmattn_bench.space import BwdConfig, FwdConfig, is_valid_head_dim

GPU_DTYPES = (torch.float16, torch.bfloat16)
# The Triton interpreter runs numpy, which has no bfloat16 arithmetic.
INTERPRETER_DTYPES = (torch.float32, torch.float16)
# How messages spell query, key and value: the dense call's names and flash_dmattn_varlen_func's
DENSE_NAMES = ("query", "key", "value")
VARLEN_NAMES = ("q", "k", "v")


def check_flag(name: str, value, optional: bool = False) -> None:
    """Raises TypeError unless `value` is a bool (or None where `optional`): a string such as
    "no" is truthy, and an int would key another launch plan than the bool it equals."""
    if not (value is True or value is False or (optional and value is None)):
        expected = "True, False or None" if optional else "True or False"
        raise TypeError(f"{name}: got {type(value).__name__} {value!r}, expected {expected}")


def _check_strides_and_head_dim(query, key, value, names=DENSE_NAMES) -> None:
    """What the fused kernels need beyond the shared contract checks."""
    for name, t in zip(names, (query, key, value)):
        if t.stride(-1) != 1 and t.shape[-1] > 1:
            raise ValueError(
                f"{name}: got strides {tuple(t.stride())} for shape {tuple(t.shape)}, expected the "
                f"last (head) dim to have stride 1 (call .contiguous() on it)"
            )
    if not is_valid_head_dim(query.shape[-1]):
        raise ValueError(
            f"{names[0]}: got head dim {query.shape[-1]} (shape {tuple(query.shape)}), expected a "
            f"multiple of 8 in [8, 256]"
        )


def check_device_and_dtypes(query, key, value, attn_bias, names=DENSE_NAMES) -> None:
    """What the fused kernels need of devices and dtypes (ValueError/TypeError naming the argument,
    spelled as `names` gives query, key and value)."""
    if query.device.type == "cuda":
        allowed, where = GPU_DTYPES, "on a GPU"
    elif interpreter_enabled():
        allowed, where = INTERPRETER_DTYPES, "in the Triton interpreter (TRITON_INTERPRET=1)"
    else:
        raise ValueError(
            f"{names[0]}: got device {query.device}, expected a CUDA tensor (or set TRITON_INTERPRET=1 "
            f"before importing dmattn_bench to run the Triton kernels on the CPU)"
        )
    for name, t in zip(names, (query, key, value)):
        if t.dtype not in allowed or t.dtype != query.dtype:
            raise TypeError(
                f"{name}: got dtype {t.dtype}, expected {query.dtype if t is not query else allowed} {where}"
            )
    if attn_bias is not None and attn_bias.dtype not in (query.dtype, torch.float32):
        expected = ("torch.float32" if query.dtype == torch.float32
                    else f"{query.dtype} (the {names[0]}'s) or torch.float32")
        raise TypeError(f"attn_bias: got dtype {attn_bias.dtype}, expected {expected}")


def check_no_gradient_with_cache(cache_seqlens, block_table, needs_grad: bool) -> None:
    """Raises ValueError when a call that needs a gradient passes a KV cache's lengths or pages
    (the short-query forward serves them, and it has no backward)."""
    for name, given in (("cache_seqlens", cache_seqlens), ("block_table", block_table)):
        if given is not None and needs_grad:
            raise ValueError(f"{name}: supported in calls that need no gradient (decode, serving); got inputs "
                             f"that require grad with grad mode on (use torch.no_grad(), or an attn_mask for training)")


def check_call(query, key, value, attn_mask, attn_bias, is_causal, softmax_scale, softcap, backend, fwd_config,
               bwd_config, cache_seqlens, block_table, *, needs_grad: bool, real_tensors: bool,
               window_size=(-1, -1)) -> float:
    """Every check of a call that depends only on its signature; returns the softmax scale.
    `real_tensors`: the tensors hold data (not meta or fake tensors being traced), so the fused
    kernels' devices and dtypes are checked too (a traced call's are checked when its op runs).

    Raises:
        TypeError / ValueError: naming the argument, what was received and what is expected.
    """
    _check_tensors((("query", query), ("key", key), ("value", value), ("attn_mask", attn_mask),
                    ("attn_bias", attn_bias), ("cache_seqlens", cache_seqlens), ("block_table", block_table)))
    check_flag("is_causal", is_causal)
    check_inputs(query, key, value, attn_mask, attn_bias, cache_seqlens, block_table)
    check_no_gradient_with_cache(cache_seqlens, block_table, needs_grad)
    check_window(window_size)
    softmax_scale = _check_scalars_and_configs(softcap, softmax_scale, query.shape[-1], backend, fwd_config,
                                               bwd_config)
    if backend != "reference":
        _check_strides_and_head_dim(query, key, value)
        if real_tensors:
            check_device_and_dtypes(query, key, value, attn_bias)
    return softmax_scale


def _check_tensors(named) -> None:
    """Raises TypeError naming the first ``(name, value)`` that is neither None nor a tensor."""
    for name, t in named:
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: got {type(t).__name__}, expected a torch.Tensor")


def _check_scalars_and_configs(softcap, softmax_scale, head_dim: int, backend, fwd_config, bwd_config) -> float:
    """The checks a dense and a packed call share beyond their tensors; returns the softmax scale."""
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap: got {type(softcap).__name__} {softcap!r}, expected a float >= 0 (0 disables)")
    if softcap < 0 or not math.isfinite(softcap):
        raise ValueError(f"softcap: got {softcap}, expected a finite value >= 0 (0 disables soft-capping)")
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(head_dim)
    # > 0: the forward takes each row's max on the unscaled q.k (max of scale * qk = scale * max qk)
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
        raise TypeError(f"softmax_scale: got {type(softmax_scale).__name__} {softmax_scale!r}, expected a float > 0")
    if not (softmax_scale > 0 and math.isfinite(softmax_scale)):
        raise ValueError(f"softmax_scale: got {softmax_scale}, expected a finite value > 0 (None: 1/sqrt(D))")
    for name, config, cls in (("fwd_config", fwd_config, FwdConfig), ("bwd_config", bwd_config, BwdConfig)):
        if config is not None and not isinstance(config, cls):
            raise TypeError(f"{name}: got {type(config).__name__}, expected a dmattn_bench.{cls.__name__}")
    if backend not in ("auto", "reference"):
        get_backend(backend)  # names the known backends on a typo
    return float(softmax_scale)


def check_varlen_call(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, attn_mask, attn_bias,
                      is_causal, window_size, softcap, softmax_scale, seqused_k, backend, fwd_config, bwd_config,
                      *, real_tensors: bool = True) -> float:
    """Every check of a packed-sequence call that depends only on its signature; returns the
    softmax scale. Reads no tensor data (no host sync): prefix sums, `seqused_k` and lengths
    against `max_seqlen_*` are the caller's promise, which only the eager reference verifies.
    `real_tensors` as in `check_call`.

    Raises:
        TypeError / ValueError: naming the argument, what was received and what is expected.
    """
    _check_tensors((("q", q), ("k", k), ("v", v), ("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k),
                    ("attn_mask", attn_mask), ("attn_bias", attn_bias), ("seqused_k", seqused_k)))
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if t is None:
            raise TypeError(f"{name}: got None, expected an (N+1,) torch.int32 tensor of prefix sums")
    check_flag("is_causal", is_causal)
    check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, attn_mask, attn_bias,
                        seqused_k)
    check_window(window_size)
    softmax_scale = _check_scalars_and_configs(softcap, softmax_scale, q.shape[-1], backend, fwd_config,
                                               bwd_config)
    if backend != "reference":
        _check_strides_and_head_dim(q, k, v, VARLEN_NAMES)
        if real_tensors:
            check_device_and_dtypes(q, k, v, attn_bias, VARLEN_NAMES)
    return softmax_scale


def check_mask_values(attn_mask: torch.Tensor) -> None:
    """An integer mask must hold 0 and 1 only. Reading it costs a reduction and a host sync per
    call (a bool mask costs neither); skipped while a CUDA graph is captured, where no sync is
    allowed."""
    if attn_mask.is_cuda and torch.cuda.is_current_stream_capturing():
        return
    outside = (attn_mask < 0) | (attn_mask > 1)
    if bool(outside.any()):
        value = attn_mask[outside].flatten()[0].item()
        raise ValueError(f"attn_mask: got an integer mask holding {value}, expected 0/1 only (or a bool mask; "
                         f"True = attend)")


def check_pages(block_table: torch.Tensor, num_blocks: int, page: int, cache_seqlens) -> None:
    """DMATTN_BENCH_CHECK_PAGES: raises ValueError naming the first entry of `block_table` that a
    kept key reads (one before cache_seqlens) and that no block of the cache has. Skipped while a
    CUDA graph is captured, where no sync is allowed."""
    if block_table.is_cuda and torch.cuda.is_current_stream_capturing():
        return
    first_key = torch.arange(block_table.shape[1], device=block_table.device) * page
    used = first_key < (block_table.shape[1] * page if cache_seqlens is None
                        else cache_seqlens.to(torch.int64).unsqueeze(1))
    outside = used & ((block_table < 0) | (block_table >= num_blocks))
    if bool(outside.any()):
        b, p = (int(i) for i in outside.nonzero()[0])
        raise ValueError(f"block_table: entry [{b}, {p}] is {int(block_table[b, p])}, outside the cache's "
                         f"{num_blocks} blocks (DMATTN_BENCH_CHECK_PAGES is set; without it those keys are excluded)")
