"""The CUDA driver API over ctypes, and the launcher that runs one cubin's kernels.

Cubins come from `build.py` and are launched through libcuda.so.1, which the NVIDIA driver
installs and torch already uses: no extra package and no compiled extension. Modules and
functions are loaded once per device, TMA tensor maps encoded once per address and layout.
"""

from __future__ import annotations

import ctypes
import threading
from functools import lru_cache

import torch

from dmattn_kernels import target
from dmattn_kernels.cuda.build import build
from dmattn_kernels.cuda.params import TensorMap
from dmattn_kernels.runtime import launch_context
from dmattn_kernels.runtime.operands import padded

MAX_GRID_Y = 65535  # CUDA's limit on gridDim.y
_CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
_CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN = 97
# cuTensorMapEncodeTiled's enums (cuda.h): element types, the 128-byte swizzle wgmma reads, L2
# promotion of 256-byte lines, out-of-bounds elements filled with zeros
_CU_TENSOR_MAP_DATA_TYPE = {torch.bool: 0, torch.uint8: 0, torch.float16: 6, torch.bfloat16: 9}
_CU_TENSOR_MAP_SWIZZLE = {0: 0, 64: 2, 128: 3}  # by the bytes of a swizzled line (0: none)
_CU_TENSOR_MAP_L2_PROMOTION_256B = 3
TMA_LINE = 128  # bytes of a box's row: one swizzled line (flash_fwd_ws.cu)
_TENSOR_MAP_CACHE = 256  # encoded maps kept by (address, dims, strides, box)
# `Driver.tensor_map` dims orders (fastest first): (B, L, H, D) tensors as (D, L, H, B), boxes of rows;
# (B, H, Lq, Lk) masks and biases as (Lk, Lq, H, B), boxes of keys
ROWS_OF, KEYS_OF = (3, 1, 2, 0), (3, 2, 1, 0)


class OutOfResources(RuntimeError):
    """The config needs more shared memory than this GPU gives a block (a trial's `unsupported`)."""


class Driver:
    """The few driver entry points the launcher needs, loaded once."""

    def __init__(self):
        self.lib = ctypes.CDLL("libcuda.so.1")
        self.modules: dict[tuple[int, str], ctypes.c_void_p] = {}
        self.functions: dict[tuple[int, str, bytes], tuple[ctypes.c_void_p, int]] = {}
        self.tensor_maps: dict[tuple, TensorMap] = {}
        self.lock = threading.Lock()
        self.thread = threading.local()  # `make_current`'s device on each thread

    def make_current(self, device: int) -> None:
        """Makes `device`'s primary context current on this thread where no context is. Torch's
        device guard skips cudaSetDevice when the index already matches, so a thread that made no
        runtime call that launches (autograd's backward thread, when our backward is the first
        work of a step) can have none, and every driver call then fails with
        CUDA_ERROR_INVALID_CONTEXT. Checked once per thread and device."""
        if getattr(self.thread, "device", None) == device:
            return
        current = ctypes.c_void_p()
        self.check(self.lib.cuCtxGetCurrent(ctypes.byref(current)), "cuCtxGetCurrent")
        if not current.value:
            handle, context = ctypes.c_int(), ctypes.c_void_p()
            self.check(self.lib.cuDeviceGet(ctypes.byref(handle), device), "cuDeviceGet")
            self.check(self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(context), handle), "cuDevicePrimaryCtxRetain")
            self.check(self.lib.cuCtxSetCurrent(context), "cuCtxSetCurrent")
        self.thread.device = device

    def check(self, result: int, what: str) -> None:
        if result != 0:
            name = ctypes.c_char_p()
            self.lib.cuGetErrorName(result, ctypes.byref(name))
            raise RuntimeError(f"CUDA error in {what}: {name.value.decode() if name.value else result}")

    def function(self, device: int, cubin: str, name: bytes, shared_bytes: int) -> ctypes.c_void_p:
        """Kernel `name` of `cubin`, loaded in `device`'s primary context, allowed `shared_bytes`.

        Raises:
            OutOfResources: `shared_bytes` is over this GPU's per-block limit.
        """
        with self.lock:
            module = self.modules.get((device, cubin))
            if module is None:
                module = ctypes.c_void_p()
                with open(cubin, "rb") as handle:
                    image = handle.read()
                self.check(self.lib.cuModuleLoadData(ctypes.byref(module), image), "cuModuleLoadData")
                self.modules[(device, cubin)] = module
            entry = self.functions.get((device, cubin, name))
            if entry is None:
                function = ctypes.c_void_p()
                self.check(self.lib.cuModuleGetFunction(ctypes.byref(function), module, name), "cuModuleGetFunction")
                entry = self.functions[(device, cubin, name)] = (function, 0)
            function, allowed = entry
            if shared_bytes > allowed:
                limit = ctypes.c_int()
                self.check(self.lib.cuDeviceGetAttribute(ctypes.byref(limit),
                                                         _CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
                                                         device), "cuDeviceGetAttribute")
                if shared_bytes > limit.value:
                    raise OutOfResources(f"shared memory {shared_bytes} B > {limit.value} B per block on this GPU")
                self.check(self.lib.cuFuncSetAttribute(function, _CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                                       shared_bytes), "cuFuncSetAttribute")
                self.functions[(device, cubin, name)] = (function, shared_bytes)
            return function

    def tensor_map(self, t: torch.Tensor, order: tuple[int, int, int, int], box_rows: int, line: int,
                   swizzle: int) -> TensorMap:
        """A TMA map of `t` as 4-D (a mask or bias of fewer dims as the view it broadcasts as:
        `operands.padded`) with its dims taken in `order` (fastest first; the first is
        contiguous), whose boxes are `line` bytes by `box_rows` rows of one slice of the last two,
        in the swizzle of `swizzle`-byte lines (0: none). A map holds only the address, dims and
        strides it was made of, so one made for the same ones is reused (a loop that gets its
        freed buffers back encodes none)."""
        shape, strides = padded(t.shape, t.stride())
        key = (t.data_ptr(), shape, strides, t.dtype, order, box_rows, line, swizzle)
        tensor_map = self.tensor_maps.get(key)
        if tensor_map is None:
            self.make_current(t.device.index if t.device.index is not None else torch.cuda.current_device())
            if len(self.tensor_maps) >= _TENSOR_MAP_CACHE:
                self.tensor_maps.clear()
            tensor_map = self.tensor_maps[key] = self._encode(t.data_ptr(), t.dtype, shape, strides, order, box_rows,
                                                              line, swizzle)
        return tensor_map

    def _encode(self, address: int, dtype: torch.dtype, shape: tuple[int, ...], stride: tuple[int, ...],
                order: tuple[int, int, int, int], box_rows: int, line: int, swizzle: int) -> TensorMap:
        size = dtype.itemsize
        dims = (ctypes.c_uint64 * 4)(*(shape[i] for i in order))
        # a size-1 dim is only ever at coordinate 0: any stride the driver accepts will do
        strides = (ctypes.c_uint64 * 3)(*(stride[i] * size if shape[i] > 1 else 16 for i in order[1:]))
        box = (ctypes.c_uint32 * 4)(line // size, box_rows, 1, 1)
        element_strides = (ctypes.c_uint32 * 4)(1, 1, 1, 1)
        # the driver writes the map to a 64-byte aligned address; ctypes allocates on 16
        scratch = ctypes.create_string_buffer(2 * ctypes.sizeof(TensorMap))
        map_address = -(-ctypes.addressof(scratch) // 128) * 128
        self.check(self.lib.cuTensorMapEncodeTiled(
            ctypes.c_void_p(map_address), _CU_TENSOR_MAP_DATA_TYPE[dtype], 4, ctypes.c_void_p(address), dims,
            strides, box, element_strides, 0, _CU_TENSOR_MAP_SWIZZLE[swizzle], _CU_TENSOR_MAP_L2_PROMOTION_256B, 0),
            "cuTensorMapEncodeTiled")
        return TensorMap.from_buffer_copy(ctypes.string_at(map_address, ctypes.sizeof(TensorMap)))

    def launch(self, function, grid: tuple[int, int], threads: int, shared_bytes: int, stream: int, params) -> None:
        arguments = (ctypes.c_void_p * 1)(ctypes.addressof(params))
        self.check(self.lib.cuLaunchKernel(function, grid[0], grid[1], 1, threads, 1, 1, shared_bytes,
                                           ctypes.c_void_p(stream), arguments, None), "cuLaunchKernel")


_driver: Driver | None = None
_built = lru_cache(maxsize=None)(build)  # a launch after the first pays no file-system lookup


def the_driver() -> Driver:
    global _driver
    if _driver is None:
        _driver = Driver()
    return _driver


def arch_of(device: torch.device) -> str:
    """The arch kernels are built for on `device` ("sm90"), or the one being planned for."""
    planned = target.planned_arch()
    return planned if planned is not None else _device_arch(device)


@lru_cache(maxsize=None)
def _device_arch(device: torch.device) -> str:  # read once per device: a forward call asks every time
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm{major}{minor}"


class Launcher:
    """Runs the kernels of one cubin on the current stream of the inputs' device (or, in
    compile-only mode, only makes sure the cubin is built)."""

    def __init__(self, direction: str, device: torch.device, flags: tuple[str, ...]):
        self.direction, self.flags = direction, flags
        if target.planned_arch() is not None:  # planning a table entry's stamp: nothing is built
            target.record(self.program())
            return
        self.cubin = str(_built(direction, arch_of(device), flags))
        self.device = device.index if device.index is not None else torch.cuda.current_device()

    def program(self) -> target.Program:
        """What the cubin is built from (a table entry's stamp, the adversarial-case ledger)."""
        return target.Program("cuda", self.direction, None, tuple(sorted(("-D", flag) for flag in self.flags)))

    def __call__(self, name: bytes, grid: tuple[int, int], num_warps: int, shared_bytes: int, params) -> None:
        if launch_context.PROGRAM_OBSERVERS:
            program = self.program()
            for observer in launch_context.PROGRAM_OBSERVERS:
                observer(program)
        if grid[1] > MAX_GRID_Y:
            raise ValueError(f"{name.decode()}: needs {grid[1]} CTAs on grid y, over CUDA's limit of {MAX_GRID_Y} "
                             "(fewer heads x batch in the backward, or a shorter query in the forward)")
        driver = the_driver()
        if torch.cuda.current_device() == self.device:  # its primary context is current: no switch
            self._launch(driver, name, grid, num_warps, shared_bytes, params)
        else:
            with torch.cuda.device(self.device):  # the runtime makes the device's primary context current
                self._launch(driver, name, grid, num_warps, shared_bytes, params)

    def function(self, name: bytes, shared_bytes: int) -> int:
        """The address of kernel `name`'s CUfunction, allowed `shared_bytes` (a native program's;
        loaded by a launch before, so no driver call)."""
        return the_driver().function(self.device, self.cubin, name, shared_bytes).value

    def _launch(self, driver: "Driver", name: bytes, grid: tuple[int, int], num_warps: int, shared_bytes: int,
                params) -> None:
        driver.make_current(self.device)
        function = driver.function(self.device, self.cubin, name, shared_bytes)
        driver.launch(function, grid, 32 * num_warps, shared_bytes, torch._C._cuda_getCurrentRawStream(self.device),
                      params)

