"""`flash_dmattn_func`: argument checks and normalisation to broadcast views; the kernels run
behind the custom ops of `dmattn_bench.ops` (autograd, torch.compile and CUDA graphs live there).

The wrapper never copies, pads or materialises q, k, v, the mask or the bias: a mask/bias of
fewer than 4 dims is left-padded by a view, size-1 dims are read with stride 0, a bool mask is
reinterpreted as uint8 (same itemsize), and q/k/v only need a contiguous last dim.
"""

from __future__ import annotations

import math

import torch

from dmattn_bench import ops, reference
from dmattn_bench.registry import get_backend
from dmattn_bench.space import BwdConfig, FwdConfig, as_4d, is_valid_head_dim


def _check_strides_and_head_dim(query, key, value) -> None:
    """What the fused kernels need beyond the shared contract checks (dtypes and devices are
    checked inside the op, where reading the environment costs no graph break)."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.stride(-1) != 1:
            raise ValueError(
                f"{name}: got strides {tuple(t.stride())} for shape {tuple(t.shape)}, expected the "
                f"last (head) dim to have stride 1 (call .contiguous() on it)"
            )
    if not is_valid_head_dim(query.shape[-1]):
        raise ValueError(
            f"query: got head dim {query.shape[-1]} (shape {tuple(query.shape)}), expected a "
            f"multiple of 8 in [8, 256]"
        )


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
        softmax_scale: > 0; defaults to 1/sqrt(D).
        softcap: > 0 applies `softcap * tanh(S / softcap)` before the bias; 0 disables.
        return_lse: also return the (B, H, Lq) fp32 natural-log sum-exp; a loss may use it (its
            gradient flows into dq, dk and dbias, as for merging partial attentions).
        backend: "auto" (the dispatch table, else the heuristic default), "triton", "cuda" (GPU only)
            or "reference".
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
    # > 0: the forward takes each row's max on the unscaled q.k (max of scale * qk = scale * max qk)
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
        raise TypeError(f"softmax_scale: got {type(softmax_scale).__name__} {softmax_scale!r}, expected a float > 0")
    if not (softmax_scale > 0 and math.isfinite(softmax_scale)):
        raise ValueError(f"softmax_scale: got {softmax_scale}, expected a finite value > 0 (None: 1/sqrt(D))")

    if backend == "reference":
        out, lse = reference.attention(
            query, key, value, attn_mask, attn_bias, is_causal=is_causal,
            softmax_scale=softmax_scale, softcap=softcap, return_lse=True,
        )
        return (out, lse.float()) if return_lse else out
    if backend != "auto":
        get_backend(backend)  # names the known backends on a typo
    _check_strides_and_head_dim(query, key, value)
    as_list = (lambda config: None if config is None else list(config.to_dict().values()))
    out, lse, _ = ops.attention_fwd(
        query, key, value, as_4d(attn_mask), as_4d(attn_bias), bool(is_causal), float(softmax_scale),
        float(softcap), backend, table, as_list(fwd_config), as_list(bwd_config),
    )
    return (out, lse) if return_lse else out
