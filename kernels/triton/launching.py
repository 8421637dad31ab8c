"""What the Triton launch plans (`forward.ForwardPlan`, `backward.BackwardPlan`,
`decode_launch.DecodePlan`) launch through: one kernel's launch (`Launch`) and a run's scratch in
one allocation (`Workspace`). The compile-only switch, the launch observers and the stream a run's
launches take are both launchers' (`dmattn_kernels.runtime.launch_context`).

A plan builds one `Launch` per kernel: grid, scalars and constexprs fixed, and after its first run
the kernel's compiled handle, so running a plan costs its allocations and one launcher call per
kernel.
"""

from __future__ import annotations

import os

import torch

from dmattn_kernels import target
from dmattn_kernels.runtime import launch_context
from dmattn_kernels.runtime.launch_context import is_compile_only, launch_stream
from dmattn_kernels.runtime.operands import contiguous_strides
from dmattn_kernels.triton.handles import descriptor_on, direct_launch


# -- one kernel launch -----------------------------------------------------------------------------


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


class Launch:
    """One kernel of a plan: grid, scalar arguments and constexprs fixed; tensors given per run.

    The first run goes through Triton's JIT, which compiles the kernel for these arguments (or
    finds it in its caches); later runs call the compiled kernel's C launcher directly
    (`handles.DirectLaunch`), skipping the JIT's binder, specialization key and cache lookup and
    the compiled kernel's Python wrappers. The specialization cannot change between runs of a
    plan: its signature holds every shape, stride, dtype and 16-byte alignment the JIT
    specializes on. In the interpreter, within `compile_only()` and while a Triton launch hook is
    set (a profiler), every run takes the JIT path.

    Tensors come first in every kernel's parameters, so a run's arguments are the tensors, then
    the fixed tail. A tensor at a position of `descriptors` is read through a copy of the
    `TensorDescriptor` template there. A bool tensor is viewed as uint8 on the JIT path (same
    itemsize; the C launcher reads only its data pointer).
    """

    __slots__ = ("kernel", "name", "grid", "scalars", "constexprs", "options", "descriptors", "launcher")

    def __init__(self, kernel, grid, scalars, constexprs: dict, descriptors: dict | None = None, **options):
        self.kernel = kernel
        self.name = kernel.__name__ if hasattr(kernel, "__name__") else type(kernel).__name__
        self.grid = tuple(grid) + (1,) * (3 - len(grid))
        self.scalars = tuple(scalars)
        self.constexprs = constexprs
        self.descriptors = descriptors or {}
        self.options = options
        self.launcher = None  # `launcher(stream, args)`, after the first run compiled the kernel
        if target.planned_arch() is not None:  # planning a table entry's stamp (no cost otherwise)
            target.record(self.program())

    def program(self) -> target.Program:
        """The kernel and the compile-time parameters this launch passes (a table entry's stamp,
        the adversarial-case ledger)."""
        parameters = tuple(sorted({**self.constexprs, **self.options}.items()))
        return target.Program("triton", self.name, self.kernel, parameters)

    def __call__(self, *tensors) -> None:
        self.run(launch_stream(), *tensors)

    def run(self, stream: int | None, *args) -> None:
        """Launches on `stream` (`launch_stream()`, read once by a plan for all its kernels): the
        compiled launcher when there is one and a stream, else the JIT. A pointer may be passed
        as its address (an int) once the kernel is compiled."""
        observers = launch_context.LAUNCH_OBSERVERS
        if observers:
            for observer in observers:
                observer(self.name)
            if launch_context.PROGRAM_OBSERVERS:
                program = self.program()
                for observer in launch_context.PROGRAM_OBSERVERS:
                    observer(program)
        if stream is not None and self.launcher is not None:
            self.launcher(stream, args)
            return
        self._jit(args)

    def _jit_args(self, tensors) -> list:
        return [descriptor_on(self.descriptors[i], t) if i in self.descriptors
                else t.view(torch.uint8) if getattr(t, "dtype", None) is torch.bool else t
                for i, t in enumerate(tensors)]

    def compile(self, *tensors):
        """The compiled kernel for these tensors (Triton's `warmup`: nothing is launched)."""
        return self.kernel.warmup(*self._jit_args(tensors), *self.scalars, grid=self.grid, **self.constexprs,
                                  **self.options)

    def _jit(self, tensors) -> None:
        if is_compile_only():
            self.compile(*tensors)
            return
        compiled = self.kernel[self.grid](*self._jit_args(tensors), *self.scalars, **self.constexprs, **self.options)
        if compiled is None or _interpreted() or not hasattr(compiled, "packed_metadata"):
            return
        positional = len(tensors) + len(self.scalars)
        tail = self.scalars + tuple(self.constexprs[name] for name in self.kernel.arg_names[positional:])
        self.launcher = direct_launch(compiled, self.grid, len(tensors), tail, self.descriptors) or _RunLaunch(
            compiled, self.grid, tail, self._jit_args)


class _RunLaunch:
    """The compiled kernel's own `run`, for a Triton whose C launcher `handles` does not know."""

    __slots__ = ("run", "grid", "function", "metadata", "tail", "jit_args")

    def __init__(self, compiled, grid: tuple, tail: tuple, jit_args):
        self.run, self.grid, self.tail, self.jit_args = compiled.run, grid, tail, jit_args
        self.function, self.metadata = compiled.function, compiled.packed_metadata

    def __call__(self, stream: int, args: tuple) -> None:
        self.run(*self.grid, stream, self.function, self.metadata, None, None, None, *self.jit_args(args), *self.tail)


# -- a run's scratch -------------------------------------------------------------------------------


class Workspace:
    """A run's scratch buffers, dead once its kernels are done, in one allocation: each at a byte
    offset that keeps the 16-byte alignment Triton specializes pointers on.

    A plan hands its kernels each buffer's address once they are compiled (`pointers`), and a
    tensor view of it on the JIT path and to host ops (`tensor`). Like a buffer of its own, the
    allocation returns to PyTorch's caching allocator when the run's last reference goes, and
    the stream order keeps a later run from reusing it before these kernels finish.
    """

    alignment = 256  # bytes; what the caching allocator aligns its own blocks to (or more)

    def __init__(self, parts: dict[str, tuple[tuple[int, ...], torch.dtype]]):
        self.layout: dict[str, tuple[int, tuple[int, ...], torch.dtype, int]] = {}
        self.views: dict[str, tuple] = {}  # name -> (dtype, shape, strides, element offset)
        offset = 0
        for name, (shape, dtype) in parts.items():
            nbytes = dtype.itemsize
            for size in shape:
                nbytes *= size
            self.layout[name] = (offset, shape, dtype, nbytes)
            self.views[name] = (dtype, shape, contiguous_strides(shape), offset // dtype.itemsize)
            offset += -(-nbytes // self.alignment) * self.alignment
        self.nbytes = offset

    def allocate(self, device: torch.device) -> torch.Tensor:
        return torch.empty(self.nbytes, dtype=torch.uint8, device=device)

    def tensor(self, buffer: torch.Tensor, name: str) -> torch.Tensor:
        dtype, shape, strides, offset = self.views[name]
        return buffer.view(dtype).as_strided(shape, strides, offset)

    def part(self, buffer: torch.Tensor, name: str, by_address: bool):
        """`name`'s address (for compiled launchers: `by_address`) or its tensor view."""
        return buffer.data_ptr() + self.layout[name][0] if by_address else self.tensor(buffer, name)

    def pointers(self, buffer: torch.Tensor) -> dict[str, int]:
        base = buffer.data_ptr()
        return {name: base + offset for name, (offset, _, _, _) in self.layout.items()}

    def tensors(self, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        return {name: self.tensor(buffer, name) for name in self.layout}
