"""`flash_dmattn_func`: argument checks, normalisation to broadcast views, autograd wiring.

The wrapper never copies, pads or materialises q, k, v, the mask or the bias: a mask/bias of
fewer than 4 dims is left-padded by a view, size-1 dims are read with stride 0, a bool mask is
reinterpreted as uint8 (same itemsize), and q/k/v only need a contiguous last dim.
"""

from __future__ import annotations

import functools
import math
import os

import torch

from dmattn_bench import dispatch, reference
from dmattn_bench.registry import Backend, default_configs, get_backend, interpreter_enabled
from dmattn_bench.space import BwdConfig, FwdConfig, TableKey, operand_kind, seqlen_bucket

_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}

GPU_DTYPES = (torch.float16, torch.bfloat16)
# The Triton interpreter runs numpy, which has no bfloat16 arithmetic.
INTERPRETER_DTYPES = (torch.float32, torch.float16)


def _as_4d(t: torch.Tensor | None) -> torch.Tensor | None:
    """Left-pads a broadcastable mask/bias to 4-D (a view, never a copy)."""
    if t is None or t.dim() == 4:
        return t
    return t[(None,) * (4 - t.dim())]


def _check_kernel_inputs(query, key, value, attn_bias) -> None:
    """Checks what the fused kernels need beyond the shared contract checks."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.stride(-1) != 1:
            raise ValueError(
                f"{name}: got strides {tuple(t.stride())} for shape {tuple(t.shape)}, expected the "
                f"last (head) dim to have stride 1 (call .contiguous() on it)"
            )
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
                f"{name}: got dtype {t.dtype}, expected {query.dtype if t is not query else allowed} "
                f"{where}"
            )
    if attn_bias is not None and attn_bias.dtype not in (query.dtype, torch.float32):
        raise TypeError(f"attn_bias: got dtype {attn_bias.dtype}, expected {query.dtype} or torch.float32")
    if query.shape[-1] % 8 or query.shape[-1] > 256:
        raise ValueError(
            f"query: got head dim {query.shape[-1]} (shape {tuple(query.shape)}), expected a "
            f"multiple of 8 that is at most 256"
        )


class _FlashDMAttnFunction(torch.autograd.Function):
    """Autograd wiring only: all numerics live in the backend's launchers."""

    @staticmethod
    def forward(ctx, q, k, v, mask, bias, backend: Backend, bwd_backend: Backend, fwd_config, bwd_config,
                is_causal, softmax_scale, softcap):
        batch, seqlen_q, num_heads, _ = q.shape
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        lse = torch.empty((batch, num_heads, seqlen_q), dtype=torch.float32, device=q.device)
        backend.forward(
            q, k, v, mask, bias, is_causal=is_causal, softmax_scale=softmax_scale, softcap=softcap,
            config=fwd_config, out=out, lse=lse,
        )
        ctx.save_for_backward(q, k, v, out, lse, mask, bias)
        ctx.backend, ctx.bwd_config = bwd_backend, bwd_config
        ctx.options = dict(is_causal=is_causal, softmax_scale=softmax_scale, softcap=softcap)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, mask, bias = ctx.saved_tensors
        if dout.stride(-1) != 1:
            dout = dout.contiguous()  # a copy of the incoming gradient, never of an input
        dq = torch.empty_like(q, memory_format=torch.contiguous_format)
        dk = torch.empty_like(k, memory_format=torch.contiguous_format)
        dv = torch.empty_like(v, memory_format=torch.contiguous_format)
        needs_dbias = bias is not None and ctx.needs_input_grad[4]
        dbias = torch.empty(bias.shape, dtype=bias.dtype, device=bias.device) if needs_dbias else None
        ctx.backend.backward(
            dout, q, k, v, out, lse, mask, bias, config=ctx.bwd_config, dq=dq, dk=dk, dv=dv,
            dbias=dbias, **ctx.options,
        )
        return dq, dk, dv, None, dbias, None, None, None, None, None, None, None


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
    *,
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
        softmax_scale: defaults to 1/sqrt(D).
        softcap: > 0 applies `softcap * tanh(S / softcap)` before the bias; 0 disables.
        return_lse: also return the (B, H, Lq) fp32 natural-log sum-exp (not differentiable).
        backend: "auto" (the dispatch table, else the heuristic default), "triton" or "reference".
        table: a dispatch-table path for this call (overrides `use_table` and DMATTN_BENCH_TABLE).
        fwd_config, bwd_config: explicit kernel tiles, overriding the table for that direction.

    Returns:
        out (B, Lq, H, D) in the query's dtype, or (out, lse) with `return_lse`.

    Raises:
        ValueError / TypeError: a bad shape, stride, device or dtype, naming the argument, the
            shape received and the shape expected.
    """
    for name, t in (("query", query), ("key", key), ("value", value), ("attn_mask", attn_mask),
                    ("attn_bias", attn_bias)):
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: got {type(t).__name__}, expected a torch.Tensor")
    reference.check_inputs(query, key, value, attn_mask, attn_bias)
    if softcap < 0 or not math.isfinite(softcap):
        raise ValueError(f"softcap: got {softcap}, expected a finite value >= 0 (0 disables soft-capping)")
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(query.shape[-1])

    if backend == "reference":
        out, lse = reference.attention(
            query, key, value, attn_mask, attn_bias, is_causal=is_causal,
            softmax_scale=softmax_scale, softcap=softcap, return_lse=True,
        )
        return (out, lse.float()) if return_lse else out
    if backend != "auto":
        get_backend(backend)  # names the known backends on a typo
    _check_kernel_inputs(query, key, value, attn_bias)
    mask4, bias4 = _as_4d(attn_mask), _as_4d(attn_bias)
    (fwd_backend, fwd_config), (bwd_backend, bwd_config) = _select(
        query, key, mask4, bias4, bool(is_causal), backend, table, fwd_config, bwd_config
    )
    out, lse = _FlashDMAttnFunction.apply(
        query, key, value, mask4, bias4, fwd_backend, bwd_backend, fwd_config, bwd_config,
        bool(is_causal), float(softmax_scale), float(softcap),
    )
    return (out, lse) if return_lse else out


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
    common = dict(dtype=_DTYPE_NAMES[dtype], head_dim=head_dim, causal=is_causal, mask=mask_kind,
                  gqa_ratio=num_heads // num_heads_kv, seqlen_q_bucket=seqlen_bucket(seqlen_q),
                  seqlen_k_bucket=seqlen_bucket(seqlen_k))
    bwd_bias = bias_kind + "+grad" if bias_requires_grad and bias_kind != "none" else bias_kind
    return TableKey(direction="fwd", bias=bias_kind, **common), TableKey(direction="bwd", bias=bwd_bias, **common)


def _select(query, key, mask4, bias4, is_causal, backend, table, fwd_config, bwd_config):
    """(backend, config) per direction: explicit configs, else the dispatch table / default."""
    if backend != "auto":
        chosen = get_backend(backend)
        default_fwd, default_bwd = default_configs(query.shape[-1], query.device)
        return (chosen, fwd_config or default_fwd), (chosen, bwd_config or default_bwd)
    fwd_key, bwd_key = table_keys(query, key, mask4, bias4, is_causal, bias4 is not None and bias4.requires_grad)
    env = os.environ.get(dispatch.ENV_VAR)
    picks = []
    for explicit, table_key in ((fwd_config, fwd_key), (bwd_config, bwd_key)):
        if explicit is not None:
            picks.append((get_backend("triton"), explicit))
        else:
            choice = dispatch.choose(table_key, query.device, table=table, env=env)
            picks.append((get_backend(choice.backend), choice.config))
    return picks[0], picks[1]


def dispatch_overhead_us(device: torch.device | str, calls: int = 2000) -> float:
    """Host time `backend="auto"` adds to a call over launching the kernels directly.

    That is the key derivation plus the (cached) table lookup, i.e. `_select`; median over
    `calls` after a warm-up call. The kernels are the same whichever way the config was chosen.
    """
    import statistics
    import time

    device = torch.device(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    q = torch.zeros(1, 128, 8, 64, dtype=dtype, device=device)
    k = torch.zeros(1, 128, 2, 64, dtype=dtype, device=device)
    mask = torch.ones(1, 2, 128, 128, dtype=torch.bool, device=device)
    bias = torch.zeros(1, 2, 1, 128, dtype=dtype, device=device, requires_grad=True)
    _select(q, k, mask, bias, True, "auto", None, None, None)  # warm the caches
    times = []
    for _ in range(calls):
        begin = time.perf_counter()
        _select(q, k, mask, bias, True, "auto", None, None, None)
        times.append(time.perf_counter() - begin)
    return round(statistics.median(times) * 1e6, 2)
