"""Triton flash dynamic-mask attention: forward, backward, explicit-config launchers."""

from dmattn_kernels.triton.launch import (
    BackwardPlan,
    ForwardPlan,
    attention_backward,
    attention_forward,
    compile_only,
    head_block,
    is_compile_only,
    is_supported,
)

__all__ = [
    "BackwardPlan", "ForwardPlan", "attention_forward", "attention_backward", "compile_only", "head_block", "is_compile_only", "is_supported",
]
