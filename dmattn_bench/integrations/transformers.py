"""`attn_implementation="dmattn"` for Hugging Face transformers models.

    from dmattn_bench.integrations.transformers import register

    register()
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="dmattn")
    # or: model.set_attn_implementation("dmattn")

`register()` adds `attention_forward` to transformers' `AttentionInterface` and `sdpa_mask` to
its `AttentionMaskInterface` under the same name. The mask entry is needed: a name missing
from `AttentionMaskInterface` makes `create_causal_mask` and friends return None, which would
drop padding masks silently. `sdpa_mask` gives what we want: None for a plain causal or full
pattern (we then use our causal rule and read no mask at all), else a bool
(B, 1, Lq, Lk) mask with causality, padding, sliding windows and packed sequences folded in.

Importing this module does not import transformers; `register()` does.
"""

from __future__ import annotations

import torch

from dmattn_bench import api

__all__ = ["ATTN_IMPLEMENTATION", "attention_forward", "register"]

ATTN_IMPLEMENTATION = "dmattn"

# Our kernels take fp16/bf16 on a GPU; fp32 only runs in the Triton interpreter.
_GPU_DTYPES = (torch.float16, torch.bfloat16)


def register() -> str:
    """Registers "dmattn" with transformers' attention and mask interfaces; idempotent.

    Returns:
        The implementation name to pass as `attn_implementation`.

    Raises:
        ImportError: transformers is not installed (`pip install dmattn-bench[transformers]`).
    """
    try:
        from transformers import AttentionInterface, AttentionMaskInterface
        from transformers.masking_utils import sdpa_mask
    except ImportError as err:
        raise ImportError(
            f"dmattn_bench.integrations.transformers.register: {err}; install transformers "
            f"(pip install 'dmattn-bench[transformers]')"
        ) from err
    # `register` updates a class-wide dict: registering again replaces the entry with itself.
    AttentionInterface.register(ATTN_IMPLEMENTATION, attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)
    return ATTN_IMPLEMENTATION


def _target_dtype(query: torch.Tensor, module: torch.nn.Module) -> torch.dtype | None:
    """The half dtype to run an fp32 query in on a GPU, as transformers' FlashAttention does.

    fp32 queries on a GPU come from fp32 layer norms (PEFT) or autocast; the kernels need
    fp16/bf16. Returns None when no cast is needed or none is known.
    """
    if query.device.type != "cuda" or query.dtype != torch.float32:
        return None
    if torch.is_autocast_enabled("cuda"):
        dtype = torch.get_autocast_dtype("cuda")
    else:
        linear = next((m for m in module.modules() if isinstance(m, torch.nn.Linear)), None)
        dtype = None if linear is None else linear.weight.dtype
    return dtype if dtype in _GPU_DTYPES else None


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    softcap: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function protocol on top of `dmattn_bench.flash_dmattn_func`.

    Args:
        module: The calling attention module (reads `is_causal`).
        query: (B, H, Lq, D), transformers' layout.
        key, value: (B, Hkv, Lk, D); GQA runs natively (no `repeat_kv`).
        attention_mask: None, a bool (or 0/1 integer) mask, True = attend, or an additive
            float mask; 4-D, broadcastable as (B|1, H|Hkv|1, Lq|1, Lk|1). A bool mask becomes
            `attn_mask`, a float mask `attn_bias`, without copies.
        dropout: must be 0 (no attention dropout in our kernels).
        scaling: softmax scale, default 1/sqrt(D).
        softcap: None or 0 disables soft-capping.
        is_causal: overrides `module.is_causal`; used only when there is no mask, as in
            transformers' SDPA path.
        **kwargs: other transformers kwargs; `s_aux`, `position_bias` and a paged `cache` are
            not supported and raise.

    Returns:
        (out, None) with out (B, Lq, H, D) contiguous, like transformers' SDPA and FlashAttention.
    """
    if dropout:
        raise NotImplementedError(
            f"dropout: got {dropout}, but attn_implementation='dmattn' has no attention dropout; "
            f"set the model's attention dropout (e.g. config.attention_dropout) to 0.0"
        )
    for name in ("s_aux", "position_bias", "cache"):
        if kwargs.get(name) is not None:
            raise NotImplementedError(
                f"{name}: not supported by attn_implementation='dmattn'; use 'sdpa' or 'eager' "
                f"for this model"
            )
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    seqlen_q = query.shape[2]
    # As transformers' SDPA path: a mask already holds causality (and offsets for caches); with
    # no mask, causal applies only to prefill (a single decode query sees every key).
    is_causal = bool(is_causal) and attention_mask is None and seqlen_q > 1
    if is_causal and key.shape[2] > seqlen_q:
        # sdpa_mask returns None for an empty static cache's prefill only because SDPA aligns
        # `is_causal` top-left: the keys past Lq are unwritten cache slots. Drop them (a view)
        # so that our bottom-right rule means the same thing.
        key, value = key[:, :, :seqlen_q], value[:, :, :seqlen_q]

    attn_mask = attn_bias = None
    if attention_mask is not None:
        if attention_mask.is_floating_point():
            attn_bias = attention_mask
        else:
            attn_mask = attention_mask

    # (B, H, L, D) -> (B, L, H, D) views: the API needs only a unit-stride head dim.
    query, key, value = (t.transpose(1, 2) for t in (query, key, value))
    target = _target_dtype(query, module)
    if target is not None:
        query, key, value = (t.to(target) for t in (query, key, value))
    out = api.flash_dmattn_func(
        query, key, value, attn_mask, attn_bias, is_causal=is_causal, softmax_scale=scaling,
        softcap=0.0 if softcap is None else float(softcap),
    )
    return out, None
