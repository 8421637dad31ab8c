"""`handles.DirectLaunch` hands the C launcher what the installed Triton's own `CudaLauncher`
would: the same arguments, descriptors expanded the same way, whatever the Triton version's
calling convention. A recording function stands in for the C launcher (no GPU needed); the GPU
tier launches real kernels through the direct path."""

import types

import pytest
import torch
import triton

from dmattn_kernels.triton import handles

nvidia = pytest.importorskip("triton.backends.nvidia.driver")

# a kernel of three tensors, two descriptors, an int and a constexpr (tensors first, as ours)
SIGNATURE = {"q": "*bf16", "out": "*bf16", "lse": "*fp32",
             "k_desc": "tensordesc<bf16[1, 32, 1, 64]>", "v_desc": "tensordesc<bf16[1, 32, 1, 64]>",
             "n": "i32", "BLOCK": "constexpr"}


class _Recorder:
    """Stands in for the C launcher (a builtin, not a Python function): keeps each call's arguments."""

    def __init__(self):
        self.calls = []

    def __call__(self, *args):
        self.calls.append(args)


def _compiled(recorder, signature):
    """A compiled kernel as the JIT returns it, its C launcher replaced by `recorder`."""
    run = object.__new__(nvidia.CudaLauncher)
    tensordesc_meta = [None for ty in signature.values() if ty.startswith("tensordesc")]
    run.launch = nvidia.wrap_handle_tensordesc(recorder, dict(signature), tensordesc_meta)
    run.global_scratch_size = run.profile_scratch_size = 0
    run.global_scratch_align = run.profile_scratch_align = 1
    run.launch_cooperative_grid = run.launch_pdl = False
    run.num_ctas = 1
    run.gsan_enabled = False
    if not hasattr(nvidia, "_BASE_ARGS_FORMAT_LEN"):  # 3.7+: one launcher, arguments annotated
        run.arg_annotations, run.kernel_signature = ("annotations",), b"signature"
    return types.SimpleNamespace(run=run, src=types.SimpleNamespace(signature=signature),
                                 metadata=types.SimpleNamespace(tensordesc_meta=tensordesc_meta), function=1234,
                                 packed_metadata=(4, 1, 0))


def _same(a, b) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return a is b
    return a == b


@pytest.mark.parametrize("with_descriptors", [True, False], ids=["descriptors", "pointers"])
def test_direct_launch_passes_what_triton_passes(monkeypatch, with_descriptors):
    signature = SIGNATURE if with_descriptors else {name: ty for name, ty in SIGNATURE.items() if "desc" not in ty}
    recorder = _Recorder()
    calls = recorder.calls
    compiled = _compiled(recorder, signature)
    q, out, k, v = (torch.zeros(1, 40, 2, 64, dtype=torch.bfloat16) for _ in range(4))
    lse = torch.zeros(1, 2, 40)
    grid, stream, tail = (3, 2, 1), 77, (40, 32)
    template = handles.descriptor_template(k, [1, 32, 1, 64])
    descriptors = {3: template, 4: template} if with_descriptors else {}
    tensors = (q, out, lse) + ((k, v) if with_descriptors else ())

    # Triton's launcher asks for the active driver (none on a CPU machine); it needs nothing of it
    # for a kernel without scratch
    monkeypatch.setattr(triton.runtime.driver, "_active", types.SimpleNamespace())
    as_triton = tuple(handles.descriptor_on(descriptors[i], t) if i in descriptors else t
                      for i, t in enumerate(tensors))
    compiled.run(*grid, stream, compiled.function, compiled.packed_metadata, None, None, None, *as_triton, *tail)
    direct = handles.direct_launch(compiled, grid, len(tensors), tail, descriptors)
    assert direct is not None
    direct(stream, tensors)
    direct(stream, tensors)  # the second run reuses the encoded descriptors
    assert len(calls) == 3
    assert _same(calls[1], calls[0]) and _same(calls[2], calls[0])


def test_direct_launch_declines_descriptors_before_pointers():
    """Descriptors must be the last tensor arguments (the forward's k_desc and v_desc are)."""
    compiled = _compiled(_Recorder(), SIGNATURE)
    k = torch.zeros(1, 40, 2, 64, dtype=torch.bfloat16)
    template = handles.descriptor_template(k, [1, 32, 1, 64])
    assert handles.direct_launch(compiled, (1, 1, 1), 5, (40, 32), {0: template, 3: template}) is None


def test_direct_launch_declines_kernels_that_need_scratch():
    compiled = _compiled(_Recorder(), SIGNATURE)
    compiled.run.global_scratch_size = 128
    assert handles.direct_launch(compiled, (1, 1, 1), 5, (40, 32), {}) is None
