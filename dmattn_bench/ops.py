"""The attention kernels as `torch.library` custom ops, with fake (meta) kernels and autograd:
the path `torch.compile` traces (eager calls take `api`'s shorter path to the same plans).

`torch.compile(model, fullgraph=True)` traces `flash_dmattn_func` into one opaque op per
direction, with no graph break; the fake kernels give output shapes without running anything.
Each op runs its call's launch plan (`dmattn_bench.plan`), built on the host at run time once per
signature: a training step warmed up before CUDA-graph capture does no table I/O and no host
synchronisation while captured.

Configs cross the op boundary as plain int lists (`FwdConfig` / `BwdConfig` field order).
"""

from __future__ import annotations

import torch

from dmattn_bench import checks
from dmattn_bench import plan as plans
from dmattn_bench.space import BwdConfig, FwdConfig


def _as_config(values: list[int] | None, cls):
    return None if values is None else cls(*values)


def plan_for(query, key, value, mask, bias, is_causal: bool, softmax_scale: float, softcap: float, backend: str,
             table: str | None, fwd_config: FwdConfig | None, bwd_config: BwdConfig | None,
             bias_requires_grad: bool, cache_seqlens: torch.Tensor | None = None,
             block_table: torch.Tensor | None = None, window: list[int] | None = None,
             deterministic: bool = False) -> plans.AttentionPlan:
    """The call's plan, built (after the device and dtype checks) on its signature's first call."""
    window = plans.NO_WINDOW if window is None else tuple(window)
    options = (is_causal, softmax_scale, softcap, backend, table, fwd_config, bwd_config, bias_requires_grad, window,
               deterministic)

    def build() -> plans.AttentionPlan:
        checks.check_device_and_dtypes(query, key, value, bias)
        return plans.AttentionPlan(query, key, value, mask, bias, is_causal=is_causal, softmax_scale=softmax_scale,
                                   softcap=softcap, backend=backend, table=table, fwd_config=fwd_config,
                                   bwd_config=bwd_config, bias_requires_grad=bias_requires_grad,
                                   cache_seqlens=cache_seqlens, block_table=block_table, window=window,
                                   deterministic=deterministic)

    layouts = plans.tensor_layouts(query, key, value, mask, bias, cache_seqlens, block_table)
    return plans.PLANS.get_or_build(plans.signature(layouts, *options), build)


def _activity_shape(mask, query, key) -> tuple[int, ...]:
    if mask is None:
        return (0,)
    # imported on first use: importing the Triton kernels fixes whether the interpreter runs them
    from dmattn_kernels.triton.layouts import activity_shape

    return activity_shape(mask.shape, query.shape[1], key.shape[1])


@torch.library.custom_op("dmattn_bench::attention_fwd", mutates_args=())
def attention_fwd(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
    bias: torch.Tensor | None, is_causal: bool, softmax_scale: float, softcap: float, backend: str,
    table: str | None, fwd_config: list[int] | None, bwd_config: list[int] | None,
    cache_seqlens: torch.Tensor | None = None, block_table: torch.Tensor | None = None, inference: bool = False,
    window: list[int] | None = None, deterministic: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """out (B, Lq, H, D), lse (B, H, Lq) fp32 and, with a mask, its tile-activity summary (int8,
    `layouts.activity_shape`; empty without a mask), which the backward reuses instead of reading
    the mask again where the forward filled it (`AttentionPlan.fills_activity`).
    `inference`: no gradient will be asked for (`AttentionPlan.infer`; the summary is empty).
    `window`: window_size as [left, right] (None: no window). `deterministic`: the call's, for its
    backward (`AttentionPlan.bwd_deterministic`)."""
    plan = plan_for(query, key, value, mask, bias, is_causal, softmax_scale, softcap, backend, table,
                    _as_config(fwd_config, FwdConfig), _as_config(bwd_config, BwdConfig), False, cache_seqlens,
                    block_table, window, deterministic)
    if inference:
        out, lse = plan.infer(query, key, value, mask, bias, cache_seqlens, block_table)
        return out, lse, query.new_empty(0, dtype=torch.int8)
    out, lse, activity = plan.forward(query, key, value, mask, bias)
    if mask is None:
        return out, lse, query.new_empty(0, dtype=torch.int8)
    if activity is None:
        # the forward filled none; the backward op may build its plan on another choice (the table
        # changed in between) and trust this buffer: every tile marked active costs it speed,
        # never correctness
        activity = query.new_ones(_activity_shape(mask, query, key), dtype=torch.int8)
    return out, lse, activity


@attention_fwd.register_fake
def _attention_fwd_fake(query, key, value, mask, bias, is_causal, softmax_scale, softcap, backend, table,
                        fwd_config, bwd_config, cache_seqlens=None, block_table=None, inference=False, window=None,
                        deterministic=False):
    batch, seqlen_q, num_heads, _ = query.shape
    return (query.new_empty(query.shape),
            query.new_empty((batch, num_heads, seqlen_q), dtype=torch.float32),
            query.new_empty((0,) if inference else _activity_shape(mask, query, key), dtype=torch.int8))


@torch.library.custom_op("dmattn_bench::attention_bwd", mutates_args=())
def attention_bwd(
    dout: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, out: torch.Tensor,
    lse: torch.Tensor, mask: torch.Tensor | None, bias: torch.Tensor | None, is_causal: bool,
    softmax_scale: float, softcap: float, bias_requires_grad: bool, backend: str, table: str | None,
    fwd_config: list[int] | None, bwd_config: list[int] | None, activity: torch.Tensor | None = None,
    dlse: torch.Tensor | None = None, window: list[int] | None = None, deterministic: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv and dbias (the bias's 4-D shape and dtype; empty when it needs no gradient).
    `activity`: the forward's tile-activity summary of `mask`; `dlse`: the gradient reaching lse,
    None when the loss does not use it."""
    plan = plan_for(query, key, value, mask, bias, is_causal, softmax_scale, softcap, backend, table,
                    _as_config(fwd_config, FwdConfig), _as_config(bwd_config, BwdConfig), bias_requires_grad,
                    window=window, deterministic=deterministic)
    dq, dk, dv, dbias = plan.backward(dout, query, key, value, out, lse, mask, bias,
                                      activity if plan.fills_activity else None, dlse, bias_requires_grad)
    return dq, dk, dv, dbias if dbias is not None else query.new_empty(0)


@attention_bwd.register_fake
def _attention_bwd_fake(dout, query, key, value, out, lse, mask, bias, is_causal, softmax_scale, softcap,
                        bias_requires_grad, backend, table, fwd_config, bwd_config, activity=None, dlse=None,
                        window=None, deterministic=False):
    dbias = bias.new_empty(bias.shape) if bias_requires_grad else query.new_empty(0)
    return query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape), dbias


def _setup_context(ctx, inputs, output):
    query, key, value, mask, bias, is_causal, softmax_scale, softcap, backend, table, fwd_config, bwd_config = inputs[:12]
    out, lse, activity = output
    ctx.save_for_backward(query, key, value, out, lse, mask, bias, activity)
    ctx.options = (is_causal, softmax_scale, softcap)
    ctx.dispatch = (backend, table, fwd_config, bwd_config)
    ctx.window = inputs[15] if len(inputs) > 15 else None
    ctx.deterministic = inputs[16] if len(inputs) > 16 else False
    ctx.mark_non_differentiable(activity)
    ctx.set_materialize_grads(False)  # an lse the loss does not use sends None, not zeros


def _backward(ctx, dout, dlse, _dactivity):
    query, key, value, out, lse, mask, bias, activity = ctx.saved_tensors
    is_causal, softmax_scale, softcap = ctx.options
    backend, table, fwd_config, bwd_config = ctx.dispatch
    bias_requires_grad = bias is not None and ctx.needs_input_grad[4]
    if dout is None:  # the loss reads lse alone
        dout = torch.zeros_like(out)
    dq, dk, dv, dbias = attention_bwd(dout, query, key, value, out, lse, mask, bias, is_causal, softmax_scale,
                                      softcap, bias_requires_grad, backend, table, fwd_config, bwd_config,
                                      activity if mask is not None else None, dlse, ctx.window, ctx.deterministic)
    return (dq, dk, dv, None, dbias if bias_requires_grad else None,
            None, None, None, None, None, None, None, None, None, None, None, None)


attention_fwd.register_autograd(_backward, setup_context=_setup_context)


def dispatch_overhead_us(device: torch.device | str, calls: int = 2000) -> float:
    """Host time a call spends finding its plan (the signature and one cache lookup), which is
    all `backend="auto"` adds once the plan exists; median over `calls`."""
    import statistics
    import time

    device = torch.device(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    q = torch.zeros(1, 128, 8, 64, dtype=dtype, device=device)
    k = torch.zeros(1, 128, 2, 64, dtype=dtype, device=device)
    mask = torch.ones(1, 2, 128, 128, dtype=torch.bool, device=device)
    bias = torch.zeros(1, 2, 1, 128, dtype=dtype, device=device)
    options = (True, 0.125, 0.0, "auto", None, None, None, True)
    times = []  # a lookup costs the same whether or not the signature has a plan
    for _ in range(calls):
        begin = time.perf_counter()
        plans.PLANS.get(plans.signature(plans.tensor_layouts(q, k, k, mask, bias, None, None), *options))
        times.append(time.perf_counter() - begin)
    return round(statistics.median(times) * 1e6, 2)
