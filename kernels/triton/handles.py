"""A compiled Triton kernel launched through its C launcher alone.

Once the JIT has compiled a kernel, `CompiledKernel.run` still does, in Python, on every launch:
a call that would allocate global and profile scratch (our kernels use none), and a pass over
the arguments that encodes a new CUtensorMap for every host tensor descriptor
(`make_tensordesc_arg`: the TMA forward has two). A launch plan fixes its arguments' layouts,
so `DirectLaunch` encodes a descriptor once per base address and calls the C launcher with what
Triton's wrappers would have handed it.

`python -m benchmarks host-probe --ab` (H100 host, triton 3.6, a masked forward of 3 launches,
the one with two K/V descriptors included): 40.8 µs per call through the C launcher against
66.5 µs through `run`.

A runtime plan goes one step further once its kernels are compiled: `dmattn_kernels.runtime.native` runs
a whole call (its allocations and every launch) as one C++ call, from the compiled kernels that
`DirectLaunch` keeps (`compiled`) and the descriptors it encodes.

Two calling conventions exist. Triton 3.6 builds one launcher module per kernel signature and
calls it with the kernel's arguments flat; 3.7 to 3.9 share one launcher that takes them as a
list, with the signature's annotations. `direct_launch` answers None for whatever it does not
recognise (a kernel that needs scratch, a sanitizer build, another backend, another layout of
Triton's launcher), and the caller keeps `run`.
"""

from __future__ import annotations

import types

import torch
from triton.tools.tensor_descriptor import TensorDescriptor


def descriptor_template(t: torch.Tensor, block_shape: list[int]) -> TensorDescriptor:
    """A descriptor of `t`'s shape and strides in `block_shape` tiles, checked once; `descriptor_on`
    gives each launch its own copy on a tensor of that layout. The template keeps no tensor."""
    template = TensorDescriptor(t, list(t.shape), list(t.stride()), block_shape)
    template.base = None
    return template


def descriptor_on(template: TensorDescriptor, t: torch.Tensor) -> TensorDescriptor:
    descriptor = object.__new__(TensorDescriptor)  # the template's checked fields, without re-checking
    descriptor.__dict__.update(template.__dict__)
    descriptor.base = t
    return descriptor


def _closure_launcher(wrapper):
    """The C launcher inside Triton's descriptor wrapper (`wrap_handle_tensordesc`'s closure), or
    the launcher itself where the kernel has no descriptor."""
    if not isinstance(wrapper, types.FunctionType):
        return wrapper
    cells = dict(zip(wrapper.__code__.co_freevars, wrapper.__closure__ or ()))
    return cells["launcher"].cell_contents if "launcher" in cells else None


class DirectLaunch:
    """`launch(stream, args)` launches the compiled kernel on `grid` with `args` (tensors, or
    addresses, then the fixed `tail`). The arguments from position `first_descriptor` on are
    tensors read through descriptors: copies of the `TensorDescriptor` templates given for them,
    encoded once per combination of their base addresses."""

    __slots__ = ("launcher", "grid", "rest", "tail", "flat", "first_descriptor", "templates", "encode", "encoded",
                 "compiled")
    cache_size = 64  # descriptor base addresses kept per kernel: a loop cycles through a few buffers

    def __init__(self, launcher, grid: tuple, rest: tuple, flat: bool, tail: tuple, templates: list, encode,
                 compiled=None):
        self.launcher, self.grid, self.rest, self.flat, self.tail = launcher, grid, rest, flat, tail
        self.templates = templates
        self.first_descriptor = -len(templates) if templates else None
        self.encode = encode
        self.encoded: dict[tuple, tuple] = {}
        self.compiled = compiled  # what the JIT returned (`native.kernel_spec` reads its signature)

    def _descriptors(self, args) -> tuple:
        """The launcher's arguments for the descriptor tensors at the end of `args`."""
        first = len(args) + self.first_descriptor
        descriptors = [descriptor_on(template, t) for template, t in zip(self.templates, args[first:])]
        flat = self.encode([*args[:first], *descriptors, *self.tail])
        if len(self.encoded) >= self.cache_size:
            self.encoded.clear()
        return tuple(flat[first:len(flat) - len(self.tail)])

    def __call__(self, stream: int, args: tuple) -> None:
        grid_x, grid_y, grid_z = self.grid
        first = self.first_descriptor
        if first is not None:
            key = tuple([t.data_ptr() for t in args[first:]])
            descriptors = self.encoded.get(key)
            if descriptors is None:
                descriptors = self.encoded[key] = self._descriptors(args)
            args = (*args[:first], *descriptors)
        if self.flat:
            self.launcher(grid_x, grid_y, grid_z, stream, *self.rest, *args, *self.tail)
        else:
            self.launcher(grid_x, grid_y, grid_z, stream, *self.rest, [*args, *self.tail])


def direct_launch(compiled, grid: tuple, num_args: int, tail: tuple, descriptors: dict) -> DirectLaunch | None:
    """A `DirectLaunch` of `compiled` (what the JIT returned) on `grid` for runs of `num_args`
    arguments, `descriptors` (position -> template) among their last; None where its launcher
    is not one of the two known layouts or the kernel needs scratch memory."""
    if sorted(descriptors) != list(range(num_args - len(descriptors), num_args)):
        return None
    templates = [descriptors[i] for i in sorted(descriptors)]
    try:
        from triton.backends.nvidia import driver as nvidia
    except ImportError:
        return None
    run = getattr(compiled, "run", None)
    if not isinstance(run, nvidia.CudaLauncher) or getattr(run, "gsan_enabled", False):
        return None
    if run.global_scratch_size or run.profile_scratch_size:
        return None
    signature = {idx: value for idx, value in compiled.src.signature.items()}
    tensordesc_meta = getattr(compiled.metadata, "tensordesc_meta", None)
    launcher = _closure_launcher(run.launch)
    if launcher is None:
        return None
    function, metadata = compiled.function, compiled.packed_metadata
    cooperative, pdl = run.launch_cooperative_grid, run.launch_pdl
    captured: list = []
    if hasattr(run, "arg_annotations"):  # 3.7-3.9: one launcher, the kernel's arguments as a list
        wrapped = nvidia.wrap_handle_tensordesc(lambda *a: captured.append(a[-1]), signature, tensordesc_meta)
        rest = (function, cooperative, pdl, metadata, None, None, None, None, None, run.arg_annotations,
                run.kernel_signature)

        def encode(kernel_args):
            captured.clear()
            wrapped(*grid, 0, *rest, kernel_args)
            return list(captured[0])

        return DirectLaunch(launcher, grid, rest, False, tail, templates, encode, compiled)
    base = getattr(nvidia, "_BASE_ARGS_FORMAT_LEN", None)
    if base != 13:  # 3.6: gridX..Z, stream, function, cooperative, pdl, 2 scratch, metadata, 3 hook args
        return None
    wrapped = nvidia.wrap_handle_tensordesc(lambda *a: captured.append(a[base:]), signature, tensordesc_meta)
    rest = (function, cooperative, pdl, None, None, metadata, None, None, None)

    def encode_flat(kernel_args):
        captured.clear()
        wrapped(*grid, 0, *rest, *kernel_args)
        return list(captured[0])

    return DirectLaunch(launcher, grid, rest, True, tail, templates, encode_flat, compiled)
