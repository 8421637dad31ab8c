"""`flash_dmattn_func`: the public entry. Arguments are checked once per call signature
(`dmattn_bench.checks`), when its launch plan is built (`dmattn_bench.plan`); an eager call whose
signature has a plan allocates its outputs and launches, through the plan's thin
`torch.autograd.Function` when a gradient is needed.
Under `torch.compile` the call goes through the custom ops of `dmattn_bench.ops` (fake kernels,
registered autograd), which run the same plans.

The wrapper never copies, pads or materialises q, k, v, the mask or the bias: a mask/bias of
fewer than 4 dims is read as its left-padded 4-D view, size-1 dims are read with stride 0, a bool
mask is read as bytes, and q/k/v only need a contiguous last dim.
"""

from __future__ import annotations

import dataclasses
import os

import torch
from torch._subclasses.fake_tensor import is_fake

from dmattn_bench import checks, ops, reference
from dmattn_bench import entry as eager_entry
from dmattn_bench import plan as plans
from dmattn_bench.space import BwdConfig, FwdConfig, as_4d


# DMATTN_BENCH_CHECK_PAGES=1 (read at import): every eager paged call checks its block table
# first and raises on an index outside the cache, at the cost of a host sync; without it such
# an entry's keys are excluded (the kernel never reads outside the cache), as the contract says
CHECK_PAGES = os.environ.get("DMATTN_BENCH_CHECK_PAGES", "0") not in ("", "0")


def _needs_grad(query, key, value, attn_bias) -> bool:
    """Whether autograd will ask this call for a gradient."""
    return torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad
                                        or (attn_bias is not None and attn_bias.requires_grad))


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


def flash_dmattn_func(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attn_mask: torch.Tensor | None = None, attn_bias: torch.Tensor | None = None,
                      is_causal: bool = False, softmax_scale: float | None = None, softcap: float = 0.0,
                      return_lse: bool = False, backend: str = "auto", cache_seqlens: torch.Tensor | None = None,
                      window_size: tuple[int, int] = plans.NO_WINDOW, *,
                      block_table: torch.Tensor | None = None, table: str | None = None,
                      fwd_config: FwdConfig | None = None, bwd_config: BwdConfig | None = None,
                      deterministic: bool = False):
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
        window_size: (left, right), FlashAttention's sliding window: query i sees keys
            i + Lk - Lq - left .. i + Lk - Lq + right (inclusive, bottom-right aligned like the
            causal rule, Lk the cache length with cache_seqlens), -1 for an unbounded side;
            combined with the mask, the bias and is_causal by AND. Key tiles outside every row's
            window are never loaded. The Triton kernels run it, and the CUDA forward where
            the table chooses it (not backend "cuda": the CUDA backward has no window).
        table: a dispatch-table path for this call (overrides `use_table` and DMATTN_BENCH_TABLE).
        fwd_config, bwd_config: explicit kernel tiles, overriding the table for that direction.
        deterministic: a bool: the backward gives bitwise-identical gradients on every run even
            where the table's config is marked non-deterministic (`BwdConfig.nondeterministic_dq`:
            dQ summed in no set order), which then runs in its fixed order;
            `torch.use_deterministic_algorithms(True)` does the same for every call.

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
    windowed = window_size != plans.NO_WINDOW  # the native entry keys calls without a window only
    if entry is not None and not windowed and not torch.compiler.is_compiling() and not CHECK_PAGES:
        # a call without gradient whose arguments ran before: one C++ call (`eager_entry.learn` below)
        result = entry(query, key, value, attn_mask, attn_bias, is_causal, softmax_scale, softcap, return_lse, backend,
                       cache_seqlens, block_table, table, fwd_config, bwd_config)
        if result is not None:
            return result
    checks.check_flag("return_lse", return_lse)  # not in a plan's signature: checked on every call
    checks.check_flag("deterministic", deterministic)
    if backend != "reference" and not torch.compiler.is_compiling() and not _traced(query):
        if _NATIVE_PENDING and getattr(query, "is_cuda", False):
            _load_native()
        needs_grad = False  # a non-tensor argument: the checks below raise before it matters
        try:
            needs_grad = _needs_grad(query, key, value, attn_bias)
            bias_grad = needs_grad and attn_bias is not None and attn_bias.requires_grad
            # the scalars' types too: 1 == True and 0.0 == False would share a plan, skipping the checks
            signature = plans.signature(
                plans.tensor_layouts(query, key, value, attn_mask, attn_bias, cache_seqlens, block_table),
                type(is_causal), is_causal, type(softmax_scale), softmax_scale, type(softcap), softcap, backend,
                table, fwd_config, bwd_config, bias_grad, window_size, deterministic)
            plan = plans.PLANS.get(signature)  # an unhashable window (a list) raises TypeError here
        except (AttributeError, TypeError):  # not a tensor, an unhashable option: the checks say which
            signature = plan = None
        if (isinstance(attn_mask, torch.Tensor) and attn_mask.dtype is not torch.bool
                and not attn_mask.is_floating_point() and not attn_mask.is_complex()):  # an integer mask: its values
            checks.check_mask_values(attn_mask)
        if plan is None:
            scale = checks.check_call(query, key, value, attn_mask, attn_bias, is_causal, softmax_scale, softcap,
                                      backend, fwd_config, bwd_config, cache_seqlens, block_table,
                                      needs_grad=needs_grad, real_tensors=True, window_size=window_size)
            plan = plans.AttentionPlan(query, key, value, attn_mask, attn_bias, is_causal=is_causal,
                                       softmax_scale=scale, softcap=float(softcap), backend=backend, table=table,
                                       fwd_config=fwd_config, bwd_config=bwd_config, bias_requires_grad=bias_grad,
                                       cache_seqlens=cache_seqlens, block_table=block_table,
                                       window=tuple(window_size), deterministic=deterministic)
            if signature is not None:
                plans.PLANS.put(signature, plan)
        elif cache_seqlens is not None or block_table is not None:  # no grad flag in the signature
            checks.check_no_gradient_with_cache(cache_seqlens, block_table, needs_grad)
        if CHECK_PAGES and block_table is not None:
            checks.check_pages(block_table, key.shape[0], key.shape[1], cache_seqlens)
        if needs_grad:
            out, lse = plans.AttentionFunction.apply(plan, query, key, value, attn_mask, attn_bias)
        else:
            out, lse = plan.infer(query, key, value, attn_mask, attn_bias, cache_seqlens, block_table, return_lse)
            if entry is not None and not windowed:
                eager_entry.learn(plan.native_program(return_lse), query, key, value, attn_mask, attn_bias, is_causal,
                                  softmax_scale, softcap, return_lse, backend, cache_seqlens, block_table, table,
                                  fwd_config, bwd_config)
        return (out, lse) if return_lse else out

    needs_grad = _needs_grad(query, key, value, attn_bias)
    softmax_scale = checks.check_call(query, key, value, attn_mask, attn_bias, is_causal, softmax_scale, softcap,
                                      backend, fwd_config, bwd_config, cache_seqlens, block_table,
                                      needs_grad=needs_grad, real_tensors=False, window_size=window_size)
    if CHECK_PAGES and block_table is not None and not torch.compiler.is_compiling() and not _traced(query):
        checks.check_pages(block_table, key.shape[0], key.shape[1], cache_seqlens)
    if backend == "reference":
        out, lse = reference.attention(
            query, key, value, attn_mask, attn_bias, is_causal=is_causal,
            softmax_scale=softmax_scale, softcap=softcap, return_lse=True, cache_seqlens=cache_seqlens,
            block_table=block_table, window_size=tuple(window_size),
        )
        return (out, lse.float()) if return_lse else out
    as_list = (lambda config: None if config is None else list(dataclasses.astuple(config)))  # every field, knobs at 0 too
    out, lse, _ = ops.attention_fwd(
        query, key, value, as_4d(attn_mask), as_4d(attn_bias), is_causal, softmax_scale,
        float(softcap), backend, table, as_list(fwd_config), as_list(bwd_config), cache_seqlens, block_table,
        not needs_grad, list(window_size), deterministic,
    )
    return (out, lse) if return_lse else out
