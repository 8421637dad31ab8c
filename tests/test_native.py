"""The native launch path (`kernels/runtime/native.py`, `native_launch.cpp`) on the CPU: the module
builds against the installed torch, keys tensors as exactly as the Python plan key does, and puts
each parameter of a compiled kernel where Triton's launchers put it (`pack` runs a program
without launching: each kernel's filled parameter bytes). The GPU tier launches real kernels
through it and compares them bitwise with the Python launches."""

import shutil
import struct
import types

import pytest
import torch

from dmattn_kernels.runtime import native
from dmattn_kernels.triton import handles

nvidia = pytest.importorskip("triton.backends.nvidia.driver")


@pytest.fixture(scope="module")
def module(tmp_path_factory):
    if shutil.which("c++") is None:
        pytest.skip("no C++ compiler")
    return native._load(native.build())


def test_the_key_tells_apart_what_the_python_key_tells_apart(module):
    storage = torch.zeros(2 * 8 * 4 * 16 + 8, dtype=torch.float16)
    base = storage[:1024].view(2, 8, 4, 16)
    same = [torch.ones_like(base), storage[8:1032].view(2, 8, 4, 16)]  # 16 bytes on: the same alignment
    others = [base.float(), base.transpose(1, 2), base[:, :4], storage[1:1025].view(2, 8, 4, 16),
              base[:1].expand(2, 8, 4, 16), base.view(2, 8, 64)]
    key = module.signature(base, None)
    assert all(module.signature(t, None) == key for t in same)
    keys = {module.signature(t, None) for t in others}
    assert len(keys) == len(others) and key not in keys
    assert module.signature(None, base) != key
    with pytest.raises(TypeError, match="argument 1"):
        module.signature(base, 3)


def _compiled(signature: dict, num_warps: int = 4, shared: int = 2048):
    run = object.__new__(nvidia.CudaLauncher)
    run.launch = lambda *args: None
    run.global_scratch_size = run.profile_scratch_size = 0
    run.launch_cooperative_grid = run.launch_pdl = False
    run.gsan_enabled = False
    if not hasattr(nvidia, "_BASE_ARGS_FORMAT_LEN"):
        run.arg_annotations, run.kernel_signature = ("annotations",), b"signature"
    meta = [{"swizzle": 3, "elem_size": 2, "elem_type": 10, "block_size": [1, 32, 1, 64], "fp4_padded": False}
            for ty in signature.values() if ty.startswith("tensordesc")]
    return types.SimpleNamespace(run=run, src=types.SimpleNamespace(signature=signature), function=4321,
                                 metadata=types.SimpleNamespace(tensordesc_meta=meta or None, num_warps=num_warps,
                                                                shared=shared, num_ctas=1),
                                 packed_metadata=(num_warps, 1, shared))


def _launch(compiled, num_tensors: int, tail: tuple, descriptors: dict | None = None):
    direct = handles.DirectLaunch(None, (3, 2, 1), (), True, tail, [], None, compiled)
    return types.SimpleNamespace(launcher=direct, descriptors=descriptors or {}, grid=(3, 2, 1))


# three tensors, then an int, a float, a constexpr and a 64-bit int, as our kernels order them
SIGNATURE = {"x": "*fp16", "y": "*i8", "out": "*fp32", "n": "i32", "scale": "fp32", "BLOCK": "constexpr",
             "stride": "i64"}


def test_a_program_fills_addresses_and_scalars_where_triton_puts_them(module):
    launch = _launch(_compiled(SIGNATURE), 3, (7, 0.5, 64, 1 << 40))
    spec = native.kernel_spec(launch, [native.given(0), native.given(1), native.allocated(1, 512)])
    assert spec is not None
    function, grid, block, shared, params, offsets, pointers, descriptors, encode = spec
    assert (function, grid, block, shared) == (4321, (3, 2, 1), 128, 2048)
    # x, y, out, n, scale, stride, then the two scratch pointers (the constexpr has no parameter)
    assert offsets == [0, 8, 16, 24, 28, 32, 40, 48] and len(params) == 56
    assert descriptors == [] and encode is None
    handle = module.program(0, 2, [((4, 5), torch.float16), ((1024,), torch.uint8)],
                            [(1, 128, (3, 7), torch.float32)], [spec], [0, 2, -1])
    x, y = torch.randn(6, dtype=torch.float16), torch.zeros(9, dtype=torch.int8)
    (out, view, nothing), (filled,) = module.pack(handle, 0, x, y)
    assert out.shape == (4, 5) and out.dtype == torch.float16 and nothing is None
    assert view.shape == (3, 7) and view.dtype == torch.float32 and view.is_contiguous()
    values = struct.unpack_from("<QQQifqQQ", filled)
    assert values == (x.data_ptr(), y.data_ptr(), view.data_ptr(), 7, 0.5, 1 << 40, 0, 0)
    (_, view_again, _), (again,) = module.pack(handle, 0, x, torch.zeros(9, dtype=torch.int8))
    assert struct.unpack_from("<Q", again, 8) != struct.unpack_from("<Q", filled, 8)  # each run's own addresses
    with pytest.raises(TypeError, match="input 1 is None where the kernel reads a tensor"):
        module.pack(handle, 0, x, None)


def test_descriptors_take_an_aligned_map_then_their_shape_and_strides():
    signature = {"q": "*bf16", "k_desc": "tensordesc<bf16[1, 32, 1, 64]>", "n": "i32"}
    k = torch.zeros(2, 40, 2, 64, dtype=torch.bfloat16)
    template = handles.descriptor_template(k, [1, 32, 1, 64])
    spec = native.kernel_spec(_launch(_compiled(signature), 2, (40,), {1: template}),
                              [native.given(0), native.given(1)])
    _, _, _, _, params, offsets, pointers, descriptors, encode = spec
    # q; the map at 128; its four i32 sizes and four i64 strides; n; the scratch pointers
    assert offsets[:2] == [0, 128] and descriptors == [(128, native.INPUT, 1)] and pointers == [(0, native.INPUT, 0, 0)]
    sizes = struct.unpack_from("<4i", params, offsets[2])
    strides = struct.unpack_from("<4q", params, offsets[6])
    assert sizes == tuple(k.shape) and strides == k.stride()
    assert struct.unpack_from("<i", params, offsets[10]) == (40,) and callable(encode)


@pytest.mark.parametrize("operands", ["none", "mask_bias_maps", "mask_bias_maps_persistent",
                                      "mask_bias_maps_persistent_tma_store"])
def test_a_cuda_forward_program_fills_the_structure_a_python_launch_builds(module, operands):
    """The CUDA forward's program copies its signature's parameters and fills in the call's
    addresses, its allocations' and (warp-specialized) its tensor maps: the bytes the Python
    launch builds field by field; a persistent launch's (FwdConfig.persistent) with its work
    items and schedule; with `tma_store`, out's map encoded on the program's own allocation of
    out (on a GPU the driver moves it to each run's; `pack` has no driver: each run's encoded)."""
    from dmattn_kernels.cuda import forward, params

    q = torch.randn(2, 40, 4, 64, dtype=torch.float16)
    k, v = torch.randn(2, 48, 2, 64, dtype=torch.float16), torch.randn(2, 48, 2, 64, dtype=torch.float16)
    mask = torch.rand(2, 2, 40, 48) > 0.5 if operands != "none" else None
    bias = torch.randn(2, 1, 1, 48, dtype=torch.float16) if operands != "none" else None
    # two of the maps a warp-specialized launch takes (fields and operands as `_forward_launch`'s)
    maps = (("q_map", 0, (3, 1, 2, 0), 128, 128, 128), ("mask_map", 3, (3, 2, 1, 0), 128, 64, 64)) if mask is not None else ()
    tma_store = operands.endswith("tma_store")
    if tma_store:
        maps += (("o_map", 5, (3, 1, 2, 0), 64, 128, 128),)
    layouts = tuple(forward._layout(t) for t in (q, k, v, mask, bias, torch.empty_like(q)))
    persistent = "persistent" in operands
    schedule = torch.zeros(3, dtype=torch.int32) if persistent else None  # the template holds its address
    plan = forward._ForwardLaunch(None, b"", (8, 2), 4096, maps, 6, (8, 2), (1, 1) if persistent else (),
                                  persistent=persistent, tma_store=tma_store)
    template, pointers, descriptors = forward._native_parameters(layouts, 0.125, 0.0, (160, 40, 1), plan, schedule)

    def encode(inputs, allocations):  # a map per slot: its operand, then the address it maps
        assert inputs[3] is mask and len(allocations) == 2 and allocations[0].shape == q.shape
        operands = (*inputs, allocations[0])
        return [bytes([operand + 1]) * 120 + struct.pack("<Q", operands[operand].data_ptr())
                for _, operand, *_ in maps]

    def tensor_map(operand: int, tensor: torch.Tensor):
        return params.TensorMap.from_buffer_copy(bytes([operand + 1]) * 120 + struct.pack("<Q", tensor.data_ptr()))

    spec = native.structure_spec(1234, (8, 2), 384, 4096, template, pointers, descriptors, encode)
    handle = module.program(0, 5, [(tuple(q.shape), q.dtype), ((2, 4, 40), torch.float32)], [], [spec], [0, 1, -1])
    outs = []
    for _ in range(2):  # the second run's out is a new allocation (the first is still held)
        (out, lse, nothing), (filled,) = module.pack(handle, 0, q, k, v, mask, bias)
        outs.append(out)
        assert nothing is None and out.shape == q.shape and lse.shape == (2, 4, 40)
        built = params.FwdParams(params.inputs(q, k, v, mask, bias, 0.125, 0.0), out.data_ptr(), lse.data_ptr(),
                                 out.stride()[:3], lse.stride())
        encoded = dict(q_map=tensor_map(0, q), mask_map=tensor_map(3, mask)) if mask is not None else {}
        if tma_store:
            encoded["o_map"] = tensor_map(5, out)
        if persistent:
            built = params.ws_params_type(False, True, False, tma_store)(
                forward=built, section_slices=6, item_columns=8, item_rows=2, schedule=schedule.data_ptr(), **encoded)
        elif mask is not None:
            built = params.WsParams(forward=built, section_slices=6, **encoded)
        assert filled == bytes(built)
    assert outs[0].data_ptr() != outs[1].data_ptr()


def test_a_program_s_tensor_maps_are_of_an_input_or_a_whole_allocation(module):
    """A descriptor slot names an input or an allocation the program has (else the program is
    refused), and maps its tensor from the start (no offset into an allocation)."""
    allocations = [((4, 64), torch.float16)]
    with pytest.raises(ValueError, match="no offset"):
        native.structure_spec(1, (1,), 128, 0, bytes(256), [], [(128, native.allocated(0, 512))], lambda *_: [])
    for source in (native.given(1), native.allocated(1)):
        spec = native.structure_spec(1, (1,), 128, 0, bytes(256), [], [(128, source)], lambda *_: [])
        with pytest.raises(ValueError, match="descriptor slot reads no input or allocation"):
            module.program(0, 1, allocations, [], [spec], [0])


@pytest.mark.parametrize("change", ["scratch", "cluster", "shared", "tuple", "pointer_in_tail"])
def test_kernels_the_path_does_not_take_are_declined(change):
    signature = dict(SIGNATURE)
    compiled = _compiled(signature)
    sources = [native.given(0), native.given(1), native.given(0)]
    tail = (7, 0.5, 64, 3)
    if change == "scratch":
        compiled.run.global_scratch_size = 64
    elif change == "cluster":
        compiled.metadata.num_ctas = 2
    elif change == "shared":
        compiled.metadata.shared = native.MAX_SHARED_BYTES + 1
    elif change == "tuple":
        signature["pair"] = ("i32", "i32")
        tail = tail + ((1, 2),)
    else:
        sources = sources[:2]  # `out` would be a pointer among the scalars
        tail = (None, 7, 0.5, 64, 3)
    assert native.kernel_spec(_launch(compiled, len(sources), tail), sources) is None


def test_a_triton_whose_launcher_layout_is_unread_is_declined(monkeypatch):
    launch = _launch(_compiled(SIGNATURE), 3, (7, 0.5, 64, 3))
    sources = [native.given(0), native.given(1), native.given(0)]
    assert native.kernel_spec(launch, sources) is not None
    monkeypatch.setattr(native, "_triton_version", lambda: (3, 10))
    assert native.kernel_spec(launch, sources) is None


def test_a_failed_build_is_recorded_and_not_retried_by_later_processes(monkeypatch, tmp_path):
    """A compiler that fails leaves a record beside the module: the next build (another process
    of a job) reports it at once instead of compiling again, until the record is deleted."""
    monkeypatch.setenv("DMATTN_BENCH_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "false")  # runs and fails
    with pytest.raises(RuntimeError, match=r"compiler failed: 1$"):
        native.build()
    record = native.module_path().parent / "build.failed"
    assert record.exists()
    monkeypatch.setenv("CXX", "c++")
    with pytest.raises(RuntimeError, match=r"compiler failed: 1 \(an earlier build; delete"):
        native.build()
    record.unlink()
    monkeypatch.setenv("CXX", "false")
    with pytest.raises(RuntimeError, match=r"compiler failed: 1$"):  # it compiled again
        native.build()


def test_the_eager_entry_learns_only_calls_it_can_serve(module):
    """The eager entry (`dmattn_bench.entry.ENTRY`) serves plain CUDA tensors only: a CPU call is neither
    learned nor served, and a call of the wrong arity is a TypeError, not a silent None."""
    q = k = v = torch.zeros(1, 16, 1, 16)
    arguments = (q, k, v, None, None, False, None, 0.0, False, "auto", None, None, None, None, None)
    assert module.learn(object(), *arguments) is False
    assert module.entry(*arguments) is None
    with pytest.raises(TypeError):
        module.entry(*arguments[:-1])
    module.forget()
