"""The native launch path: a plan's allocations and launches in one C++ call.

Launching through Triton's C launcher (`handles.DirectLaunch`) still costs the host, per kernel,
an argument parse with a Python `data_ptr()` call per tensor, and per output a `torch.empty` from
Python. A runtime plan's calls repeat one signature, so after its first run (which compiles its
kernels) the plan hands `program` plain data: its allocations, views into them, and per kernel
the compiled function, grid and a parameter template whose tensor addresses and TMA descriptors
the run fills in. `native_launch.cpp` then runs a call as one Python-to-C++ call, and gives
the plan cache its key's tensor part (`signature`).

The parameter layout is Triton's own (3.6 to 3.9, `SUPPORTED_TRITON`): each non-constexpr
argument of the signature with host tensor descriptors expanded into (CUtensorMap, shape as i32,
strides as i64), then the global and profile scratch pointers. `program` answers None for
anything else: another Triton, a kernel that needs scratch memory, clusters, cooperative or
programmatic launch, an unknown argument type, a launcher `handles.direct_launch` did not build.
The caller keeps its Python launches then.

The module also holds the front end's eager entry (`entry`, `learn`, `configure`), which
`dmattn_bench.entry` wires to the dispatcher when the module loads (`on_load`): this package
imports nothing of the front end.

The module is compiled with the system C++ compiler against the installed torch on the first
GPU plan (about 15 s, once per torch and Python version: cached under $DMATTN_BENCH_CACHE or
~/.cache/dmattn_bench/native). A run of several kernels is one CUDA graph launch, its nodes'
parameters replaced per run (not while the stream is being captured; `DMATTN_BENCH_LAUNCH_GRAPHS=0`
launches each kernel on its own). `DMATTN_BENCH_NATIVE=0` turns the path off; a failed build warns
once and leaves it off, and later processes do not try again until its record
(`build.failed` beside the module) is deleted.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import struct
import sys
import sysconfig
import threading
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch

from dmattn_kernels.compile_into import CompileFailed, compile_into

SOURCE = Path(__file__).with_name("native_launch.cpp")
MODULE_NAME = "dmattn_native"
ENV_VAR = "DMATTN_BENCH_NATIVE"
BUILD_TIMEOUT_S = 300

INPUT, ALLOCATION = 0, 1  # where a kernel's tensor argument comes from (native_launch.cpp's Source)
DESCRIPTOR_BYTES = 128  # sizeof(CUtensorMap), also its alignment in the parameter buffer
MAX_SHARED_BYTES = 228 * 1024  # above this Triton launches with an attribute cuLaunchKernel cannot set
# Triton versions whose launchers lay kernel parameters out as `kernel_spec` does (read in 3.6's
# and 3.9's nvidia driver; 3.7 and 3.8 lie between them)
SUPPORTED_TRITON = ((3, 6), (3, 7), (3, 8), (3, 9))
SCALAR_FORMATS = {"i1": "b", "i8": "b", "i16": "h", "i32": "i", "i64": "q", "u1": "B", "u8": "B", "u16": "H",
                  "u32": "I", "u64": "Q", "fp16": "e", "fp32": "f", "f32": "f", "fp64": "d"}


def given(index: int) -> tuple[int, int, int]:
    """A kernel's tensor argument read from the run's input `index`."""
    return INPUT, index, 0


def allocated(index: int, offset: int = 0) -> tuple[int, int, int]:
    """A kernel's tensor argument at byte `offset` of the run's allocation `index`."""
    return ALLOCATION, index, offset


# -- the module ---------------------------------------------------------------------------------------

_LOCK = threading.Lock()
_STATE: dict[str, object] = {}  # "module": the loaded module, or None after a failed or disabled build
_ON_LOAD: list = []  # callables given the module once it loads (`on_load`)


def _compile_command(output: Path) -> list[str]:
    from torch.utils.cpp_extension import include_paths

    torch_lib = Path(torch.__file__).parent / "lib"
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [os.environ.get("CXX", "c++"), "-O2", "-shared", "-fPIC", "-std=c++17", "-w",
            f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *(f"-I{path}" for path in include_paths()),
            f"-I{sysconfig.get_paths()['include']}", str(SOURCE), "-o", str(output), f"-L{torch_lib}",
            "-ltorch_python", "-ltorch", "-ltorch_cpu", "-lc10", f"-Wl,-rpath,{torch_lib}", "-ldl"]


def module_path() -> Path:
    """Where the module for this source, torch and Python is (or will be) built."""
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join((torch.__version__, sys.version)).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("DMATTN_BENCH_CACHE", Path.home() / ".cache" / "dmattn_bench"))
    return cache / "native" / key / f"{MODULE_NAME}{sysconfig.get_config_var('EXT_SUFFIX')}"


def build() -> Path:
    """The compiled module, built now unless cached (one builder at a time per cache: a lock file).

    Raises:
        RuntimeError: no C++ compiler, or it failed (its first error line) or timed out.
    """
    import fcntl

    target = module_path()
    if target.exists():
        return target
    failed = target.parent / "build.failed"
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.exists():  # built while this process waited
            return target
        if failed.exists():
            raise RuntimeError(f"{failed.read_text().strip()} (an earlier build; delete {failed} to try again)")
        try:
            return _compile(target)
        except RuntimeError as error:
            failed.write_text(str(error))
            raise


def _compile(target: Path) -> Path:
    command = _compile_command(target)
    if shutil.which(command[0]) is None:
        raise RuntimeError(f"no C++ compiler ({command[0]}; set CXX)")
    print("dmattn-bench: building the native launch path (once per torch and Python version, about 15 s)",
          file=sys.stderr)
    try:
        return compile_into(target, command, BUILD_TIMEOUT_S)
    except CompileFailed as failure:
        raise RuntimeError(f"the C++ compiler failed: {failure}") from None


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(MODULE_NAME, path)
    loaded = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loaded)
    return loaded


def on_load(callback) -> None:
    """Calls `callback(module)` when the module loads (at once if it has): the front end wires its
    entry there. A callback's RuntimeError, OSError or ImportError turns the path off, as a
    failed build does."""
    _ON_LOAD.append(callback)
    loaded_now = _STATE.get("module")
    if loaded_now is not None:
        callback(loaded_now)


def module():
    """The native module, built on first use; None when `DMATTN_BENCH_NATIVE=0` or its build
    failed (warned once)."""
    if "module" in _STATE:
        return _STATE["module"]
    with _LOCK:
        if "module" not in _STATE:
            loaded = None
            if os.environ.get(ENV_VAR, "1") != "0":
                try:
                    loaded = _load(build())
                    for callback in _ON_LOAD:
                        callback(loaded)
                except (RuntimeError, OSError, ImportError) as error:
                    loaded = None
                    warnings.warn(f"dmattn-bench: the native launch path is off ({error}); kernels launch "
                                  f"through Triton's launchers", RuntimeWarning, stacklevel=2)
            _STATE["module"] = loaded
    return _STATE["module"]


def loaded():
    """The native module if a plan already loaded it, else None (never builds)."""
    return _STATE.get("module")


@contextmanager
def disabled():
    """Programs asked for inside are None (their plans launch from Python); the module stays
    loaded for afterwards."""
    before = module()
    _STATE["module"] = None
    try:
        yield before
    finally:
        _STATE["module"] = before


# -- programs ----------------------------------------------------------------------------------------


class Program:
    """`program(stream, *inputs)` runs a plan's allocations and launches on the inputs (tensors
    or None, in the plan's order) and returns the plan's outputs. It keeps its compiled kernels
    alive: the program launches their functions, which unloading a kernel would free."""

    __slots__ = ("run", "handle", "kernels")

    def __init__(self, run, handle, kernels: list):
        self.run, self.handle, self.kernels = run, handle, kernels

    def __call__(self, stream: int, *inputs):
        return self.run(self.handle, stream, *inputs)


def _triton_version() -> tuple[int, int]:
    import triton

    return tuple(int(part) for part in triton.__version__.split(".")[:2])


def _descriptor_encoder(launch, sources: list[tuple[int, int, int]]):
    """`encode(inputs, allocations)`: the CUtensorMaps of `launch`'s descriptors on the run's
    inputs, encoded by Triton's own wrapper (`DirectLaunch.encode`); the descriptors are its last
    tensor arguments, each of an input (`kernel_spec` declines others)."""
    from dmattn_kernels.triton.handles import descriptor_on

    direct, positions = launch.launcher, sorted(launch.descriptors)

    def encode(inputs: tuple, allocations: tuple) -> list:
        del allocations
        tensors = [0] * positions[0] + [descriptor_on(launch.descriptors[p], inputs[sources[p][1]]) for p in positions]
        flat = direct.encode([*tensors, *direct.tail])
        return [item for item in flat if type(item).__name__ == "PyCUtensorMap"]

    return encode


def kernel_spec(launch, sources: list[tuple[int, int, int]]) -> tuple | None:
    """`native_launch.cpp`'s description of one compiled `launching.Launch` whose tensor
    arguments come from `sources` (`given`, `allocated`); None where the kernel cannot go native
    (module docstring)."""
    from dmattn_kernels.triton.handles import DirectLaunch

    direct = launch.launcher
    if not isinstance(direct, DirectLaunch) or direct.compiled is None or _triton_version() not in SUPPORTED_TRITON:
        return None
    compiled = direct.compiled
    run, metadata = compiled.run, compiled.metadata
    if (run.global_scratch_size or run.profile_scratch_size or run.launch_cooperative_grid or run.launch_pdl
            or getattr(run, "gsan_enabled", False) or getattr(metadata, "num_ctas", 1) != 1
            or metadata.shared > MAX_SHARED_BYTES):
        return None
    types = list(compiled.src.signature.values())
    values = [None] * len(sources) + list(direct.tail)
    if len(types) != len(values) or any(isinstance(ty, tuple) for ty in types):  # tuple arguments: none of ours
        return None
    descriptor_meta = list(getattr(metadata, "tensordesc_meta", None) or [])
    params, offsets, pointers, descriptors = bytearray(), [], [], []

    def place(size: int, alignment: int) -> int:
        params.extend(bytes(-len(params) % alignment))
        offsets.append(len(params))
        params.extend(bytes(size))
        return offsets[-1]

    for position, (ty, value) in enumerate(zip(types, values)):
        if ty == "constexpr":
            continue
        if ty.startswith("tensordesc"):
            meta = descriptor_meta.pop(0) if descriptor_meta else None
            template = launch.descriptors.get(position)
            if meta is None or template is None or sources[position][0] != INPUT:
                return None
            descriptors.append((place(DESCRIPTOR_BYTES, DESCRIPTOR_BYTES), *sources[position][:2]))
            for size in template.shape:
                struct.pack_into("i", params, place(4, 4), size)
            for stride in template.strides:
                struct.pack_into("q", params, place(8, 8), stride)
            continue
        if ty.startswith("*"):
            if position >= len(sources):
                return None
            pointers.append((place(8, 8), *sources[position]))
            continue
        form = SCALAR_FORMATS.get(ty)
        if form is None or value is None:
            return None
        size = struct.calcsize(form)
        struct.pack_into(form, params, place(size, size), value)
    place(8, 8)  # the global and profile scratch pointers: null
    place(8, 8)

    encode = _descriptor_encoder(launch, sources) if descriptors else None
    return (compiled.function, tuple(launch.grid), 32 * metadata.num_warps, metadata.shared, bytes(params),
            offsets, pointers, descriptors, encode)


def structure_spec(function: int, grid: tuple[int, ...], threads: int, shared: int, template: bytes,
                   pointers: list[tuple[int, tuple[int, int, int]]],
                   descriptors: list[tuple[int, tuple[int, int, int]]], encode=None) -> tuple:
    """`native_launch.cpp`'s description of a kernel whose one parameter is a structure passed by
    value (the CUDA backend's): `template` its bytes with every address and tensor map zero,
    `pointers` (offset, source: `given`, `allocated`) per address to fill, `descriptors` (offset,
    source: `given`, `allocated` at offset 0) per 128-byte tensor map, which `encode(inputs,
    allocations)` returns as bytes, in that order, for inputs at addresses the program has not
    seen. A map of an allocation is moved to each run's own by the driver
    (cuTensorMapReplaceAddress), not encoded anew."""
    if any(source[2] for _, source in descriptors):
        raise ValueError("a tensor map covers its tensor from its start: no offset into an allocation")
    return (function, (*grid, 1, 1)[:3], threads, shared, template, [0],
            [(offset, *source) for offset, source in pointers],
            [(offset, *source[:2]) for offset, source in descriptors], encode)


def program(device: torch.device, num_inputs: int, allocations: list, views: list, kernels: list,
            returns: tuple) -> Program | None:
    """A `Program` of Triton `kernels` ((`launching.Launch`, its tensors' sources) in launch
    order) with `allocations` ((shape, dtype) each), `views` ((allocation, element offset, shape,
    dtype): a contiguous view) and `returns` (indices into allocations then views, -1 for None);
    None where the module is off or a kernel cannot go native."""
    specs = [kernel_spec(launch, sources) for launch, sources in kernels]
    if any(spec is None for spec in specs):
        return None
    return program_of_specs(device, num_inputs, allocations, views, specs, returns,
                            [launch.launcher.compiled for launch, _ in kernels])


def program_of_specs(device: torch.device, num_inputs: int, allocations: list, views: list, specs: list,
                     returns: tuple, owners: list) -> Program | None:
    """`program` of ready kernel descriptions (`kernel_spec`, `structure_spec`); `owners` keep
    their functions loaded while the program lives. None where the module is off."""
    native = module()
    if native is None or device.type != "cuda":
        return None
    try:
        handle = native.program(device.index if device.index is not None else torch.cuda.current_device(),
                                num_inputs, allocations, views, specs, list(returns))
    except (ValueError, TypeError):  # past the module's limits (parameters, kernels, inputs)
        return None
    return Program(native.run, handle, owners)
