"""Triton flash dynamic-mask attention: forward, backward, explicit-config launchers."""

from dmattn_kernels.triton.launch import attention_backward, attention_forward, head_block, is_supported

__all__ = ["attention_forward", "attention_backward", "head_block", "is_supported"]
