"""The first thing a process spawned to compile kernels for a GPU runs, when its parent runs them in
Triton's interpreter (TRITON_INTERPRET=1: the CPU tier, `compile-check` without a GPU).

The variable has to be gone before the process imports triton: `triton.jit` decides when it
decorates a function whether it is interpreted, and triton 3.9's Gluon, which every compile
imports, asserts that `triton.language`'s own jit functions are not. An initializer in
`dmattn_bench` came too late: unpickling it imports the package, and with it triton. This module
imports nothing that does.
"""

import os
import signal
import warnings


def compile_for_real() -> None:
    """Drop the interpreter switch, and leave Ctrl-C to the parent (it stops the workers)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ.pop("TRITON_INTERPRET", None)
    warnings.filterwarnings("ignore", message=".*TRITON_DEFAULT_FP_FUSION.*")
