"""The attention kernels as `torch.library` custom ops, with fake (meta) kernels and autograd.

`torch.compile(model, fullgraph=True)` traces `flash_dmattn_func` into one opaque op per
direction, with no graph break; the fake kernels give output shapes without running anything.
The dispatch decision (table lookup, cached) is made inside the op, so it is made on the host at
run time, once per shape: a training step warmed up before CUDA-graph capture does no table I/O
and no host synchronisation while captured.

Configs cross the op boundary as plain int lists (`FwdConfig` / `BwdConfig` field order).
"""

from __future__ import annotations

import functools
import os

import torch

from dmattn_bench import dispatch
from dmattn_bench.registry import default_configs, get_backend, interpreter_enabled
from dmattn_bench.space import DTYPE_NAMES, BwdConfig, FwdConfig, TableKey, operand_kind, seqlen_bucket

GPU_DTYPES = (torch.float16, torch.bfloat16)
# The Triton interpreter runs numpy, which has no bfloat16 arithmetic.
INTERPRETER_DTYPES = (torch.float32, torch.float16)
_CONFIG_CLASSES = {"fwd": FwdConfig, "bwd": BwdConfig}


def check_device_and_dtypes(query, key, value, attn_bias) -> None:
    """What the fused kernels need of devices and dtypes (ValueError/TypeError naming the argument)."""
    if query.device.type == "cuda":
        allowed, where = GPU_DTYPES, "on a GPU"
    elif interpreter_enabled():
        allowed, where = INTERPRETER_DTYPES, "in the Triton interpreter (TRITON_INTERPRET=1)"
    else:
        raise ValueError(
            f"query: got device {query.device}, expected a CUDA tensor (or set TRITON_INTERPRET=1 "
            f"before importing dmattn_bench to run the Triton kernels on the CPU)"
        )
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.dtype not in allowed or t.dtype != query.dtype:
            raise TypeError(
                f"{name}: got dtype {t.dtype}, expected {query.dtype if t is not query else allowed} {where}"
            )
    if attn_bias is not None and attn_bias.dtype not in (query.dtype, torch.float32):
        expected = "torch.float32" if query.dtype == torch.float32 else f"{query.dtype} (the query's) or torch.float32"
        raise TypeError(f"attn_bias: got dtype {attn_bias.dtype}, expected {expected}")


# -- dispatch -----------------------------------------------------------------------------------


def table_keys(query, key, mask4, bias4, is_causal: bool, bias_requires_grad: bool) -> tuple[TableKey, TableKey]:
    """The (fwd, bwd) dispatch keys of a call, derived as the tuner derives them for workloads."""
    return _table_keys(
        tuple(query.shape), key.shape[1], key.shape[2], query.dtype,
        None if mask4 is None else tuple(mask4.shape), None if bias4 is None else tuple(bias4.shape),
        is_causal, bias_requires_grad,
    )


@functools.lru_cache(maxsize=4096)
def _table_keys(q_shape, seqlen_k, num_heads_kv, dtype, mask_dims, bias_dims, is_causal, bias_requires_grad):
    # cached on plain tuples: a training loop repeats a handful of shapes, and building the
    # frozen keys is most of the dispatch cost
    batch, seqlen_q, num_heads, head_dim = q_shape
    mask_kind = operand_kind(mask_dims, num_heads, num_heads_kv, seqlen_q)
    bias_kind = operand_kind(bias_dims, num_heads, num_heads_kv, seqlen_q)
    common = dict(dtype=DTYPE_NAMES[dtype], head_dim=head_dim, causal=is_causal, mask=mask_kind,
                  gqa_ratio=num_heads // num_heads_kv, seqlen_q_bucket=seqlen_bucket(seqlen_q),
                  seqlen_k_bucket=seqlen_bucket(seqlen_k))
    bwd_bias = bias_kind + "+grad" if bias_requires_grad and bias_kind != "none" else bias_kind
    return TableKey(direction="fwd", bias=bias_kind, **common), TableKey(direction="bwd", bias=bwd_bias, **common)


def select(direction: str, query, key, mask4, bias4, is_causal: bool, backend: str, table: str | None,
           explicit: list[int] | None, bias_requires_grad: bool):
    """(Backend, config) for one direction: an explicit config, else the table, else the default."""
    if explicit is not None:
        name = "triton" if backend == "auto" else backend
        return get_backend(name), _CONFIG_CLASSES[direction](*explicit)
    if backend != "auto":
        fwd, bwd = default_configs(query.shape[-1], query.device, backend)
        return get_backend(backend), fwd if direction == "fwd" else bwd
    keys = table_keys(query, key, mask4, bias4, is_causal, bias_requires_grad)
    choice = dispatch.choose(keys[0] if direction == "fwd" else keys[1], query.device, table=table,
                             env=os.environ.get(dispatch.ENV_VAR))
    return get_backend(choice.backend), choice.config


# -- the mask's tile activity, kept from the forward for the backward -------------------------------


def _activity_shape(mask: torch.Tensor | None, query, key) -> tuple[int, ...]:
    """Shape of the forward's tile-activity summary of `mask` (`activity.py`): empty without one."""
    if mask is None:
        return (0,)
    from dmattn_kernels.triton.launch import activity_shape  # imported on first use (registry)

    return activity_shape(mask.shape, query.shape[1], key.shape[1])


def _fill_activity(chosen, mask, query, key, is_causal: bool, activity: torch.Tensor) -> None:
    """Fills `activity` for a forward that did not (a backend other than Triton), so the backward
    of the call can rely on it whichever backend it takes."""
    if mask is not None and chosen.name != "triton":
        from dmattn_kernels.triton.launch import tile_activity

        tile_activity(mask, query.shape[1], key.shape[1], is_causal, out=activity)


# -- the ops ------------------------------------------------------------------------------------


@torch.library.custom_op("dmattn_bench::attention_fwd", mutates_args=())
def attention_fwd(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
    bias: torch.Tensor | None, is_causal: bool, softmax_scale: float, softcap: float, backend: str,
    table: str | None, fwd_config: list[int] | None, bwd_config: list[int] | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """out (B, Lq, H, D), lse (B, H, Lq) fp32 and, with a mask, its tile-activity summary (int8,
    `launch.activity_shape`; empty without a mask), which the backward reuses instead of reading
    the mask again. `bwd_config` rides along for the backward."""
    del bwd_config
    check_device_and_dtypes(query, key, value, bias)
    chosen, config = select("fwd", query, key, mask, bias, is_causal, backend, table, fwd_config, False)
    batch, seqlen_q, num_heads, _ = query.shape
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    lse = torch.empty((batch, num_heads, seqlen_q), dtype=torch.float32, device=query.device)
    activity = torch.empty(_activity_shape(mask, query, key), dtype=torch.int8, device=query.device)
    extra = {"activity": activity} if mask is not None and chosen.name == "triton" else {}
    chosen.forward(query, key, value, mask, bias, is_causal=is_causal, softmax_scale=softmax_scale,
                   softcap=softcap, config=config, out=out, lse=lse, **extra)
    _fill_activity(chosen, mask, query, key, is_causal, activity)
    return out, lse, activity


@attention_fwd.register_fake
def _attention_fwd_fake(query, key, value, mask, bias, is_causal, softmax_scale, softcap, backend, table,
                        fwd_config, bwd_config):
    batch, seqlen_q, num_heads, _ = query.shape
    return (query.new_empty(query.shape),
            query.new_empty((batch, num_heads, seqlen_q), dtype=torch.float32),
            query.new_empty(_activity_shape(mask, query, key), dtype=torch.int8))


@torch.library.custom_op("dmattn_bench::attention_bwd", mutates_args=())
def attention_bwd(
    dout: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, out: torch.Tensor,
    lse: torch.Tensor, mask: torch.Tensor | None, bias: torch.Tensor | None, is_causal: bool,
    softmax_scale: float, softcap: float, bias_requires_grad: bool, backend: str, table: str | None,
    bwd_config: list[int] | None, activity: torch.Tensor | None = None, dlse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv and dbias (the bias's 4-D shape and dtype; empty when it needs no gradient).
    `activity`: the forward's tile-activity summary of `mask` (the Triton backward reuses it);
    `dlse`: the gradient reaching lse, None when the loss does not use it."""
    chosen, config = select("bwd", query, key, mask, bias, is_causal, backend, table, bwd_config,
                            bias_requires_grad)
    if dout.stride(-1) != 1:
        dout = dout.contiguous()  # a copy of the incoming gradient, never of an input
    dq = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    dk = torch.empty(key.shape, dtype=key.dtype, device=key.device)
    dv = torch.empty(value.shape, dtype=value.dtype, device=value.device)
    dbias = torch.empty(bias.shape, dtype=bias.dtype, device=bias.device) if bias_requires_grad else None
    extra = {"activity": activity} if activity is not None and chosen.name == "triton" else {}
    if dlse is not None:
        extra["dlse"] = dlse
    chosen.backward(dout, query, key, value, out, lse, mask, bias, is_causal=is_causal,
                    softmax_scale=softmax_scale, softcap=softcap, config=config, dq=dq, dk=dk, dv=dv, dbias=dbias,
                    **extra)
    return dq, dk, dv, dbias if dbias is not None else query.new_empty(0)


@attention_bwd.register_fake
def _attention_bwd_fake(dout, query, key, value, out, lse, mask, bias, is_causal, softmax_scale, softcap,
                        bias_requires_grad, backend, table, bwd_config, activity=None, dlse=None):
    dbias = bias.new_empty(bias.shape) if bias_requires_grad else query.new_empty(0)
    return query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape), dbias


def _setup_context(ctx, inputs, output):
    query, key, value, mask, bias, is_causal, softmax_scale, softcap, backend, table, _, bwd_config = inputs
    out, lse, activity = output
    ctx.save_for_backward(query, key, value, out, lse, mask, bias, activity)
    ctx.options = (is_causal, softmax_scale, softcap)
    ctx.dispatch = (backend, table, bwd_config)
    ctx.mark_non_differentiable(activity)
    ctx.set_materialize_grads(False)  # an lse the loss does not use sends None, not zeros


def _backward(ctx, dout, dlse, _dactivity):
    query, key, value, out, lse, mask, bias, activity = ctx.saved_tensors
    is_causal, softmax_scale, softcap = ctx.options
    backend, table, bwd_config = ctx.dispatch
    bias_requires_grad = bias is not None and ctx.needs_input_grad[4]
    if dout is None:  # the loss reads lse alone
        dout = torch.zeros_like(out)
    dq, dk, dv, dbias = attention_bwd(dout, query, key, value, out, lse, mask, bias, is_causal, softmax_scale,
                                      softcap, bias_requires_grad, backend, table, bwd_config,
                                      activity if mask is not None else None, dlse)
    return (dq, dk, dv, None, dbias if bias_requires_grad else None,
            None, None, None, None, None, None, None)


attention_fwd.register_autograd(_backward, setup_context=_setup_context)


def dispatch_overhead_us(device: torch.device | str, calls: int = 2000) -> float:
    """Host time `backend="auto"` adds to a call over launching the kernels directly.

    That is the key derivation plus the (cached) table lookup for both directions; median over
    `calls` after a warm-up call. The kernels are the same whichever way the config was chosen.
    """
    import statistics
    import time

    device = torch.device(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    q = torch.zeros(1, 128, 8, 64, dtype=dtype, device=device)
    k = torch.zeros(1, 128, 2, 64, dtype=dtype, device=device)
    mask = torch.ones(1, 2, 128, 128, dtype=torch.bool, device=device)
    bias = torch.zeros(1, 2, 1, 128, dtype=dtype, device=device)

    def both():
        select("fwd", q, k, mask, bias, True, "auto", None, None, False)
        select("bwd", q, k, mask, bias, True, "auto", None, None, True)

    both()  # warm the caches
    times = []
    for _ in range(calls):
        begin = time.perf_counter()
        both()
        times.append(time.perf_counter() - begin)
    return round(statistics.median(times) * 1e6, 2)
