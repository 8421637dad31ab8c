"""`flash_dmattn_varlen_func`: attention over packed sequences (FlashAttention's varlen
convention) with a dynamic mask and a learnable bias.

Sequence s has the query rows cu_seqlens_q[s] .. cu_seqlens_q[s + 1] - 1 of q and the keys from
cu_seqlens_k[s] of k and v (seqused_k[s] of them when given, else up to cu_seqlens_k[s + 1]).
Every rule of the dense call (DESIGN §1) holds per sequence: causal and the window are
bottom-right aligned to the sequence's own lengths, a row sees no other sequence's keys.

The call runs the dense call's plan (`plan.AttentionPlan`) on one batch row: q, k, v and out as
(1, total, heads, D) views, lse (1, H, total_q), the mask and bias as (1, H|Hkv|1, 1, total_k)
views when per key or (1, H|Hkv|1, total_q, max_seqlen_k) when per query row
(`configs.Packing`); the Triton kernels give each sequence its own programs. Nothing is copied.
No custom op takes packed sequences yet (the dense call has `ops`): the call is for eager code;
`torch.compile` of it is not tested.
"""

from __future__ import annotations

import torch

from dmattn_bench import checks, reference
from dmattn_bench import plan as plans
from dmattn_bench.space import BwdConfig, FwdConfig
from dmattn_kernels.configs import Packing


def _packed_view(t: torch.Tensor | None, layout: str | None) -> torch.Tensor | None:
    """A mask's or bias's 4-D view of one batch row (module docstring)."""
    if t is None:
        return None
    return t[None, :, None, :] if layout == reference.VARLEN_LAYOUTS[0] else t[None]


def flash_dmattn_varlen_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                             cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                             attn_mask: torch.Tensor | None = None, attn_bias: torch.Tensor | None = None,
                             is_causal: bool = False, window_size: tuple[int, int] = plans.NO_WINDOW,
                             softcap: float = 0.0, softmax_scale: float | None = None, return_lse: bool = False,
                             seqused_k: torch.Tensor | None = None, *, backend: str = "auto", table: str | None = None,
                             fwd_config: FwdConfig | None = None, bwd_config: BwdConfig | None = None,
                             deterministic: bool = False):
    """Flash attention over packed sequences with a boolean dynamic mask and an additive learnable bias.

    Args:
        q: (total_q, H, D), fp16/bf16 on GPU (fp32/fp16 in the Triton interpreter).
        k, v: (total_k, Hkv, D) with H % Hkv == 0.
        cu_seqlens_q, cu_seqlens_k: (N + 1,) int32 prefix sums of the N sequences' lengths;
            zero-length sequences are allowed. As in FlashAttention they must not decrease and
            must lie in [0, total]: their values are on the device and are not checked (that
            would need a sync), and others are undefined (the CUDA backward may not return).
        max_seqlen_q, max_seqlen_k: ints, the longest sequence's lengths (the grids cover them; a
            longer sequence is cut to them, so no program reads past its own sequence or the
            packed tensors).
        attn_mask: bool (or 0/1 integer), True = attend: per key (H|Hkv|1, total_k), or per query
            row (H|Hkv|1, total_q, max_seqlen_k), where column j of row i is key j of row i's
            own sequence.
        attn_bias: the query's dtype or fp32, in either layout of the mask; learnable: its
            gradient has its shape.
        is_causal: bottom-right aligned per sequence (key j of a sequence of Lq rows and Lk keys is
            visible from its row i iff j <= i + Lk - Lq), ANDed with the mask.
        window_size: (left, right) as in `flash_dmattn_func`, per sequence.
        softcap, softmax_scale, return_lse: as in `flash_dmattn_func`.
        seqused_k: (N,) int32, the keys sequence s uses (from cu_seqlens_k[s]), as FlashAttention's.
        backend: "auto" (the dispatch table, else the default), "triton" or "reference".
        table, fwd_config, bwd_config, deterministic: as in `flash_dmattn_func`.

    Returns:
        out (total_q, H, D) in q's dtype, or (out, lse) with `return_lse`, lse (H, total_q) fp32.
        Rows no sequence owns are dead: out 0, lse -inf.

    Raises:
        ValueError / TypeError: a bad shape, stride, device, dtype or option, naming the argument,
            what it got and what is expected.
    """
    checks.check_flag("return_lse", return_lse)
    checks.check_flag("deterministic", deterministic)
    if backend == "reference":
        checks.check_varlen_call(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, attn_mask,
                                 attn_bias, is_causal, window_size, softcap, softmax_scale, seqused_k, backend,
                                 fwd_config, bwd_config, real_tensors=False)
        result = reference.varlen_attention(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, attn_mask, attn_bias,
            is_causal=is_causal, window_size=tuple(window_size), softcap=softcap, softmax_scale=softmax_scale,
            return_lse=return_lse, seqused_k=seqused_k)
        return (result[0], result[1].float()) if return_lse else result
    needs_grad = False  # a non-tensor argument: the checks below raise before it matters
    try:
        needs_grad = torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (q, k, v, attn_bias))
        bias_grad = needs_grad and attn_bias is not None and attn_bias.requires_grad
        # the scalars' types too: 1 == True and 0.0 == False would share a plan, skipping the checks
        signature = plans.signature(
            plans.python_tensor_layouts(q, k, v, attn_mask, attn_bias, cu_seqlens_q, cu_seqlens_k, seqused_k),
            "varlen", type(max_seqlen_q), max_seqlen_q, type(max_seqlen_k), max_seqlen_k, type(is_causal), is_causal,
            window_size, type(softmax_scale), softmax_scale, type(softcap), softcap, backend, table, fwd_config,
            bwd_config, bias_grad, deterministic)
        cached = plans.PLANS.get(signature)  # (plan, the mask's and bias's layouts)
    except (AttributeError, TypeError):  # not a tensor, an unhashable option: the checks say which
        signature = cached = None
    if (isinstance(attn_mask, torch.Tensor) and attn_mask.dtype is not torch.bool
            and not attn_mask.is_floating_point() and not attn_mask.is_complex()):  # an integer mask: its values
        checks.check_mask_values(attn_mask)
    if cached is None:
        scale = checks.check_varlen_call(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, attn_mask,
                                         attn_bias, is_causal, window_size, softcap, softmax_scale, seqused_k,
                                         backend, fwd_config, bwd_config)
        num_heads, num_heads_kv = q.shape[1], k.shape[1]
        layouts = [None if t is None else reference.varlen_layout(t.shape, name, num_heads, num_heads_kv, q.shape[0],
                                                                  k.shape[0], max_seqlen_k)
                   for name, t in (("attn_mask", attn_mask), ("attn_bias", attn_bias))]
        packing = Packing(cu_seqlens_q.shape[0] - 1, max_seqlen_q, max_seqlen_k, seqused_k is not None,
                          layouts[0] == reference.VARLEN_LAYOUTS[0], layouts[1] == reference.VARLEN_LAYOUTS[0])
        plan = plans.AttentionPlan(q[None], k[None], v[None], _packed_view(attn_mask, layouts[0]),
                                   _packed_view(attn_bias, layouts[1]), is_causal=is_causal, softmax_scale=scale,
                                   softcap=float(softcap), backend=backend, table=table, fwd_config=fwd_config,
                                   bwd_config=bwd_config, bias_requires_grad=bias_grad, window=tuple(window_size),
                                   packing=packing, deterministic=deterministic)
        cached = (plan, layouts)
        if signature is not None:
            plans.PLANS.put(signature, cached)
    plan, (mask_layout, bias_layout) = cached
    operands = (q[None], k[None], v[None], _packed_view(attn_mask, mask_layout), _packed_view(attn_bias, bias_layout))
    sequences = (cu_seqlens_q, cu_seqlens_k, seqused_k)
    if needs_grad:
        out, lse = plans.AttentionFunction.apply(plan, *operands, sequences)
    else:
        out, lse = plan.infer(*operands, sequences=sequences)
    return (out[0], lse[0]) if return_lse else out[0]
