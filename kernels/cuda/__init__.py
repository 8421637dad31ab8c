"""CUDA flash dynamic-mask attention (mma.sync, SM80/SM90/SM120): built on first use with nvcc.

Launchers for the CUDA kernels: explicit configs in, preallocated outputs filled. The same
interface as `dmattn_kernels.triton` (inputs already checked by `dmattn_bench.checks`). Cubins come
from `build.py` and are launched through the CUDA driver API over ctypes (`driver.py`).

Modules, one concern each: `params` (the kernels' parameter blocks), `driver` (libcuda and the
launcher), `rules` (the kernel a config names, `is_supported`, `kernel_keys`, a call's checks),
`shared_memory` (the shared-memory model), `variants` (a call's -D list and mask/bias staging),
`forward` and `backward` (the launches). What they share with the Triton launchers (the operand
normaliser, the compile-only switch, the launch stream) is `dmattn_kernels.runtime`'s.
"""

from dmattn_kernels.cuda.backward import attention_backward
from dmattn_kernels.cuda.driver import OutOfResources, arch_of
from dmattn_kernels.cuda.forward import ForwardPlan, attention_forward
from dmattn_kernels.cuda.rules import (arch_reason, backward_kernel, backward_warp_specialized, forward_kernel,
                                       is_supported, kernel_keys, uses_wgmma, warp_specialized)
from dmattn_kernels.cuda.shared_memory import shared_bytes
from dmattn_kernels.cuda.variants import backward_variant, variant
# One compile-only switch for every bundled kernel (the tuner's compile workers: within
# `compile_only()` the launchers build what a launch needs and launch nothing).
from dmattn_kernels.runtime.launch_context import compile_only

__all__ = ["ForwardPlan", "OutOfResources", "arch_of", "arch_reason", "attention_backward", "attention_forward",
           "backward_kernel", "backward_variant", "backward_warp_specialized", "compile_only", "forward_kernel",
           "is_supported", "kernel_keys", "shared_bytes", "uses_wgmma", "variant", "warp_specialized"]
