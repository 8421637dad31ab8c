"""CUDA flash dynamic-mask attention (mma.sync, SM80/SM90/SM120): built on first use with nvcc."""

from dmattn_kernels.cuda.launch import ForwardPlan, attention_backward, attention_forward, compile_only, is_supported

__all__ = ["ForwardPlan", "attention_backward", "attention_forward", "compile_only", "is_supported"]
