"""Triton flash dynamic-mask attention: forward, backward, explicit-config launchers."""

from dmattn_kernels.runtime.launch_context import compile_only, is_compile_only
from dmattn_kernels.triton.backward import BackwardPlan
from dmattn_kernels.triton.forward import ForwardPlan
from dmattn_kernels.triton.launch import attention_backward, attention_forward, is_supported, kernel_keys
from dmattn_kernels.triton.layouts import head_block

__all__ = [
    "BackwardPlan", "ForwardPlan", "attention_forward", "attention_backward", "compile_only", "head_block",
    "is_compile_only", "is_supported", "kernel_keys",
]
