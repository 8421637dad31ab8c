"""`flash_dmattn_func`: the public entry. Arguments are checked once per call signature, when its
launch plan is built (`dmattn_bench.plan`); an eager call whose signature has a plan allocates
its outputs and launches, through a thin `torch.autograd.Function` when a gradient is needed.
Under `torch.compile` the call goes through the custom ops of `dmattn_bench.ops` (fake kernels,
registered autograd), which run the same plans.

The wrapper never copies, pads or materialises q, k, v, the mask or the bias: a mask/bias of
fewer than 4 dims is read as its left-padded 4-D view, size-1 dims are read with stride 0, a bool
mask is read as bytes, and q/k/v only need a contiguous last dim.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os

import torch
from torch._subclasses.fake_tensor import is_fake

from dmattn_bench import entry as eager_entry
from dmattn_bench import ops, reference
from dmattn_bench import plan as plans
from dmattn_bench.registry import get_backend
from dmattn_bench.space import BwdConfig, FwdConfig, as_4d, is_valid_head_dim


# DMATTN_BENCH_CHECK_PAGES=1 (read at import): every eager paged call checks its block table
# first and raises on an index outside the cache, at the cost of a host sync; without it such
# an entry's keys are excluded (the kernel never reads outside the cache), as the contract says
CHECK_PAGES = os.environ.get("DMATTN_BENCH_CHECK_PAGES", "0") not in ("", "0")


def check_flag(name: str, value, optional: bool = False) -> None:
    """Raises TypeError unless `value` is a bool (or None where `optional`): a string such as
    "no" is truthy, and an int would key another launch plan than the bool it equals."""
    if not (value is True or value is False or (optional and value is None)):
        expected = "True, False or None" if optional else "True or False"
        raise TypeError(f"{name}: got {type(value).__name__} {value!r}, expected {expected}")


def _check_pages(block_table: torch.Tensor, num_blocks: int, page: int, cache_seqlens) -> None:
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


def _check_strides_and_head_dim(query, key, value) -> None:
    """What the fused kernels need beyond the shared contract checks."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.stride(-1) != 1 and t.shape[-1] > 1:
            raise ValueError(
                f"{name}: got strides {tuple(t.stride())} for shape {tuple(t.shape)}, expected the "
                f"last (head) dim to have stride 1 (call .contiguous() on it)"
            )
    if not is_valid_head_dim(query.shape[-1]):
        raise ValueError(
            f"query: got head dim {query.shape[-1]} (shape {tuple(query.shape)}), expected a "
            f"multiple of 8 in [8, 256]"
        )


def _check_call(query, key, value, attn_mask, attn_bias, is_causal, softmax_scale, softcap, backend,
                fwd_config, bwd_config, cache_seqlens=None, block_table=None) -> float:
    """Every check of a call that depends only on its signature; returns the softmax scale.

    Raises:
        TypeError / ValueError: naming the argument, what was received and what is expected.
    """
    for name, t in (("query", query), ("key", key), ("value", value), ("attn_mask", attn_mask),
                    ("attn_bias", attn_bias), ("cache_seqlens", cache_seqlens), ("block_table", block_table)):
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: got {type(t).__name__}, expected a torch.Tensor")
    check_flag("is_causal", is_causal)
    reference.check_inputs(query, key, value, attn_mask, attn_bias, cache_seqlens, block_table)
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap: got {type(softcap).__name__} {softcap!r}, expected a float >= 0 (0 disables)")
    if softcap < 0 or not math.isfinite(softcap):
        raise ValueError(f"softcap: got {softcap}, expected a finite value >= 0 (0 disables soft-capping)")
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(query.shape[-1])
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
    if backend != "reference":
        _check_strides_and_head_dim(query, key, value)
    return float(softmax_scale)


def _needs_grad(query, key, value, attn_bias) -> bool:
    """Whether autograd will ask this call for a gradient."""
    return torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad
                                        or (attn_bias is not None and attn_bias.requires_grad))


def _check_no_gradient_with_cache(cache_seqlens, block_table, needs_grad: bool) -> None:
    for name, given in (("cache_seqlens", cache_seqlens), ("block_table", block_table)):
        if given is not None and needs_grad:
            raise ValueError(f"{name}: supported in calls that need no gradient (decode, serving); got inputs "
                             f"that require grad with grad mode on (use torch.no_grad(), or an attn_mask for training)")


def _check_mask_values(attn_mask: torch.Tensor) -> None:
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


def _traced(query) -> bool:
    """Meta and fake tensors (shape propagation, tracing) take the custom op, whose fake kernel
    answers them; the eager path would try to launch on them. A plain tensor (not a subclass, not
    a functional or functorch wrapper) is asked `is_meta` alone: `is_fake` costs a call 1 µs of
    host time."""
    if (type(query) is torch.Tensor and not torch._is_functional_tensor(query)
            and not torch._C._functorch.is_functorch_wrapped_tensor(query)):
        return query.is_meta
    return isinstance(query, torch.Tensor) and (query.is_meta or is_fake(query))


_NATIVE_PENDING = True  # the native launch path not yet loaded for this process's first GPU call


def _load_native() -> None:
    """Loads (or builds) the native launch path before the first GPU plan is keyed: it keys plans
    from then on (`plan.use_tensor_layouts`), so no GPU plan is built under the Python key and
    left behind."""
    global _NATIVE_PENDING
    eager_entry.load()
    _NATIVE_PENDING = False


class _Attention(torch.autograd.Function):
    """The eager call with a gradient: the plan's forward, and its backward from the context."""

    @staticmethod
    def forward(ctx, plan, query, key, value, attn_mask, attn_bias):
        out, lse, activity = plan.forward(query, key, value, attn_mask, attn_bias)
        ctx.save_for_backward(query, key, value, out, lse, attn_mask, attn_bias,
                              activity if plan.fills_activity else None)
        ctx.plan = plan
        ctx.set_materialize_grads(False)  # an lse the loss does not use sends None, not zeros
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        query, key, value, out, lse, attn_mask, attn_bias, activity = ctx.saved_tensors
        if dout is None:  # the loss reads lse alone
            dout = torch.zeros_like(out)
        bias_requires_grad = attn_bias is not None and ctx.needs_input_grad[5]
        dq, dk, dv, dbias = ctx.plan.backward(dout, query, key, value, out, lse, attn_mask, attn_bias, activity,
                                              dlse, bias_requires_grad)
        return None, dq, dk, dv, None, dbias


def flash_dmattn_func(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    attn_bias: torch.Tensor | None = None,
    is_causal: bool = False,
    softmax_scale: float | None = None,
    softcap: float = 0.0,
    return_lse: bool = False,
    backend: str = "auto",
    cache_seqlens: torch.Tensor | None = None,
    *,
    block_table: torch.Tensor | None = None,
    table: str | None = None,
    fwd_config: FwdConfig | None = None,
    bwd_config: BwdConfig | None = None,
):
    """Flash attention with a boolean dynamic mask and an additive learnable bias.

    Semantics are those of DESIGN.md §1 and `dmattn_bench.reference.attention`:
    `S = scale * Q K^T`, optionally soft-capped, plus `attn_bias`, with every position excluded by
    `attn_mask`, the bottom-right causal rule or the sequence bounds set to -inf; rows with no
    visible key return 0 (lse -inf) and contribute no gradient.

    Args:
        query: (B, Lq, H, D), fp16/bf16 on GPU (fp32/fp16 in the Triton interpreter).
        key, value: (B, Lk, Hkv, D) with H % Hkv == 0.
        attn_mask: bool (or 0/1 integer), broadcastable as (B|1, H|Hkv|1, Lq|1, Lk|1); True = attend.
        attn_bias: query's dtype or fp32, same broadcast rule; added after scaling (not scaled).
        is_causal: bottom-right aligned causal rule, combined with the mask by AND.
        softmax_scale: > 0; defaults to 1/sqrt(D).
        softcap: > 0 applies `softcap * tanh(S / softcap)` before the bias; 0 disables.
        return_lse: a bool: also return the (B, H, Lq) fp32 natural-log sum-exp; a loss may use it
            (its gradient flows into dq, dk and dbias, as for merging partial attentions).
        backend: "auto" (the dispatch table, else the heuristic default), "triton", "cuda" (GPU only)
            or "reference".
        cache_seqlens: (B,) int32, sequence b's key length when key/value are (slices of) a KV
            cache: keys at or past it are never read, and it replaces Lk in the causal rule
            (clamped to [0, Lk]). May change between CUDA-graph replays. Calls without gradient
            and at most 64 query rows (decode) only.
        block_table: (B, pages) int32, a paged KV cache (FlashAttention's and vLLM's layout):
            key/value are (blocks, page, Hkv, D), page a multiple of 16, and key j of sequence b
            is row j % page of block block_table[b, j // page] (Lk = pages * page). Entries whose
            keys all lie at or past cache_seqlens are never read; the keys of an entry outside
            [0, blocks) are excluded, as if masked (DMATTN_BENCH_CHECK_PAGES=1 raises on one
            instead, at the cost of a host sync). Same calls as cache_seqlens.
        table: a dispatch-table path for this call (overrides `use_table` and DMATTN_BENCH_TABLE).
        fwd_config, bwd_config: explicit kernel tiles, overriding the table for that direction.

    A call that needs no gradient and has at most 64 query rows runs the short-query forward
    (split-KV, a KV group's query heads in one tile); with a gradient the prefill kernels run
    forward and backward whatever Lq is.

    Returns:
        out (B, Lq, H, D) in the query's dtype, or (out, lse) with `return_lse`. Zero-length
        dims are defined: with no query row (B, Lq or H of 0) the outputs are empty; with no key
        (Lk = 0) every row is dead (out 0, lse -inf); either way nothing is launched and every
        gradient is zero.

    Raises:
        ValueError / TypeError: a bad shape, stride, device or dtype, naming the argument, the
            shape received and the shape expected; a non-bool `is_causal` or `return_lse`; an
            explicit config the backend cannot run on this shape; an integer mask
            holding values other than 0 and 1 (checked on every call: prefer a bool mask).
    """
    entry = eager_entry.ENTRY
    if entry is not None and not torch.compiler.is_compiling() and not CHECK_PAGES:
        # a call without gradient whose arguments ran before: one C++ call (`eager_entry.learn` below)
        result = entry(query, key, value, attn_mask, attn_bias, is_causal, softmax_scale, softcap, return_lse, backend,
                       cache_seqlens, block_table, table, fwd_config, bwd_config)
        if result is not None:
            return result
    check_flag("return_lse", return_lse)  # not in a plan's signature: checked on every call
    if backend != "reference" and not torch.compiler.is_compiling() and not _traced(query):
        if _NATIVE_PENDING and getattr(query, "is_cuda", False):
            _load_native()
        try:
            needs_grad = _needs_grad(query, key, value, attn_bias)
            bias_grad = needs_grad and attn_bias is not None and attn_bias.requires_grad
            # the scalars' types too: 1 == True and 0.0 == False would share a plan, skipping the checks
            signature = plans.signature(query, key, value, attn_mask, attn_bias, cache_seqlens, block_table,
                                        type(is_causal), is_causal,
                                        type(softmax_scale), softmax_scale, type(softcap), softcap, backend, table,
                                        fwd_config, bwd_config, bias_grad)
            plan = plans.PLANS.get(signature)
        except (AttributeError, TypeError):  # not a tensor, an unhashable option: the checks say which
            signature = plan = None
        if plan is None:
            scale = _check_call(query, key, value, attn_mask, attn_bias, is_causal, softmax_scale, softcap, backend,
                                fwd_config, bwd_config, cache_seqlens, block_table)
            _check_no_gradient_with_cache(cache_seqlens, block_table, needs_grad)
            ops.check_device_and_dtypes(query, key, value, attn_bias)
            plan = plans.AttentionPlan(query, key, value, attn_mask, attn_bias, is_causal=is_causal,
                                       softmax_scale=scale, softcap=float(softcap), backend=backend, table=table,
                                       fwd_config=fwd_config, bwd_config=bwd_config, bias_requires_grad=bias_grad,
                                       cache_seqlens=cache_seqlens, block_table=block_table)
            if signature is not None:
                plans.PLANS.put(signature, plan)
        elif cache_seqlens is not None or block_table is not None:
            _check_no_gradient_with_cache(cache_seqlens, block_table, needs_grad)  # no grad flag in the signature
        if attn_mask is not None and attn_mask.dtype is not torch.bool:
            _check_mask_values(attn_mask)
        if CHECK_PAGES and block_table is not None:
            _check_pages(block_table, key.shape[0], key.shape[1], cache_seqlens)
        if needs_grad:
            out, lse = _Attention.apply(plan, query, key, value, attn_mask, attn_bias)
        else:
            out, lse = plan.infer(query, key, value, attn_mask, attn_bias, cache_seqlens, block_table, return_lse)
            if entry is not None:
                eager_entry.learn(plan.native_program(return_lse), query, key, value, attn_mask, attn_bias, is_causal,
                             softmax_scale, softcap, return_lse, backend, cache_seqlens, block_table, table,
                             fwd_config, bwd_config)
        return (out, lse) if return_lse else out

    softmax_scale = _check_call(query, key, value, attn_mask, attn_bias, is_causal, softmax_scale, softcap, backend,
                                fwd_config, bwd_config, cache_seqlens, block_table)
    needs_grad = _needs_grad(query, key, value, attn_bias)
    _check_no_gradient_with_cache(cache_seqlens, block_table, needs_grad)
    if CHECK_PAGES and block_table is not None and not torch.compiler.is_compiling() and not _traced(query):
        _check_pages(block_table, key.shape[0], key.shape[1], cache_seqlens)
    if backend == "reference":
        out, lse = reference.attention(
            query, key, value, attn_mask, attn_bias, is_causal=is_causal,
            softmax_scale=softmax_scale, softcap=softcap, return_lse=True, cache_seqlens=cache_seqlens,
            block_table=block_table,
        )
        return (out, lse.float()) if return_lse else out
    as_list = (lambda config: None if config is None else list(dataclasses.astuple(config)))  # every field, knobs at 0 too
    out, lse, _ = ops.attention_fwd(
        query, key, value, as_4d(attn_mask), as_4d(attn_bias), is_causal, softmax_scale,
        float(softcap), backend, table, as_list(fwd_config), as_list(bwd_config), cache_seqlens, block_table,
        not needs_grad,
    )
    return (out, lse) if return_lse else out
