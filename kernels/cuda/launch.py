"""Launchers for the CUDA kernels: explicit configs in, preallocated outputs filled.

The same interface as `dmattn_kernels.triton` (inputs already checked by `dmattn_bench.api`).
Cubins come from `build.py` and are launched through the CUDA driver API over ctypes
(libcuda.so.1, which the NVIDIA driver installs and torch already uses): no extra package and
no compiled extension.
"""

from __future__ import annotations

import ctypes
import heapq
import itertools
import threading
from functools import lru_cache
from typing import NamedTuple

import torch
import triton

from dmattn_kernels.runtime import native
from dmattn_kernels.configs import AttentionShape, BwdConfig, FwdConfig, as_4d, shape_problem
from dmattn_kernels import target
from dmattn_kernels.cuda.build import build, defines
# One compile-only switch for every bundled kernel (the tuner's compile workers: within
# `compile_only()` the launchers build what a launch needs and launch nothing), the one
# fixed-order reduction of dBias partials into the bias's broadcast shape, and the one operand
# normaliser (broadcast strides).
from dmattn_kernels.triton.launch import (  # noqa: F401 (compile_only, is_compile_only re-exported)
    LAUNCH_OBSERVERS, _finish_dbias, compile_only, delta_with_lse_grad, is_compile_only, launch_stream)
from dmattn_kernels.triton.layouts import zero_size1_strides

WARP_CHOICES = (2, 4, 8)
# Rows a warp owns, as m16 tiles: forward block_m = 16 or 32 x num_warps (flash_fwd.cu: WARP_TILES),
# backward block_n and block_m_dq = 16 x num_warps.
FORWARD_WARP_ROWS = (16, 32)
INNER_CHOICES = (16, 32, 64, 128)  # the tiles a CTA walks: fwd block_n, bwd block_m and block_n_dq
MAX_STAGES = 4
MAX_GRID_Y = 65535  # CUDA's limit on gridDim.y
WGMMA_TILES = (32, 64, 128)  # inner tiles with an m64nN wgmma product (sm90.cuh: is_wgmma_width)
# Query rows of a warp-specialized forward CTA: 64 per consumer warpgroup, one to three consumers
# (plus the producer: 8, 12 or 16 warps)
WS_BLOCK_M = (64, 128, 192)
# The warp-specialized backward (flash_bwd_ws.cu): keys of a CTA, 64 per consumer warpgroup (plus
# the producer: 8 or 12 warps), walking query tiles of 64 rows; its dQ shares are those tiles
# (block_m_dq = block_m, block_n_dq = block_n)
WS_BWD_BLOCK_N = (64, 128)
WS_BWD_BLOCK_M = 64
DELTA_UNROLL = 4  # bwd_steps.cuh's: rows of delta per lane group of a warp
DQ_CAST_ROWS = 4  # flash_bwd_ws.cu's DQ_ROWS: rows of dQ per thread of its dQ kernel
WARPGROUP = 4  # warps that issue one wgmma together
SWIZZLE_SLACK = 1024  # bytes a wgmma kernel may skip to align its tiles (sm90.cuh: SWIZZLE_ATOM)
# Above it a dK/dV thread holds 2 x head_dim / 2 fp32 accumulators (192 or more registers) plus
# its S^T and dP^T fragments, and spills heavily (at 128 only the largest 4-warp tiles spill a
# little, 128x64 w4: the tuner measures those): H200, B2 H16 L4096
# D256 causal bf16, 32x64 dq64x32 w4 s1: 9.79 ms through wgmma vs 5.90 ms through mma.sync
# (`python3 benchmarks/cuda/defaults_sweep.py`, 2026-11-22).
WGMMA_BWD_MAX_HEAD_DIM = 128
SHARED_PAD = 8  # elements per shared row beyond the padded head dim (common.cuh: ROW)
_CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
_CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN = 97
# cuTensorMapEncodeTiled's enums (cuda.h): element types, the 128-byte swizzle wgmma reads, L2
# promotion of 256-byte lines, out-of-bounds elements filled with zeros
_CU_TENSOR_MAP_DATA_TYPE = {torch.bool: 0, torch.uint8: 0, torch.float16: 6, torch.bfloat16: 9}
_CU_TENSOR_MAP_SWIZZLE = {0: 0, 64: 2, 128: 3}  # by the bytes of a swizzled line (0: none)
_CU_TENSOR_MAP_L2_PROMOTION_256B = 3
_TMA_LINE = 128  # bytes of a box's row: one swizzled line (flash_fwd_ws.cu)
_TENSOR_MAP_CACHE = 256  # encoded maps kept by (address, dims, strides, box)
SM90_SHARED_BYTES = 232448  # opt-in shared memory per block on H100 and H200
# Static shared memory of the warp-specialized forward beside its dynamic tiles: its barriers and
# what ptxas reserves (cuobjdump -res-usage: 1088-1104 bytes), with room to spare
WS_STATIC_BYTES = 2048
# flash_fwd_ws.cu's MASK_TILES and BIAS_TILES: how a mask or bias reaches the scores
NOT_STAGED, TILES_OF_ROWS, TILES_OF_KEYS = 0, 1, 2
MAX_SCORE_STAGES = 2  # the deepest ring of staged mask and bias tiles (4: no faster, H100)
# what the head slices a warp-specialized kernel runs at once re-read from L2 (`section_slices`)
L2_SECTION_BYTES = 32 << 20
# A work item's fixed cost in a persistent forward's schedule (`persistent_schedule`), in key tiles:
# its Q load and its rows' store
ITEM_TILES = 1

class OutOfResources(RuntimeError):
    """The config needs more shared memory than this GPU gives a block (a trial's `unsupported`)."""


def _pointers(*names: str) -> list[tuple[str, type]]:
    return [(name, ctypes.c_void_p) for name in names]


def _strides(*names: str, count: int = 3) -> list[tuple[str, type]]:
    return [(name, ctypes.c_int64 * count) for name in names]


class _Inputs(ctypes.Structure):
    """common.cuh's Inputs, field for field."""

    _fields_ = (_pointers("q", "k", "v", "mask", "bias") + _strides("q_stride", "k_stride", "v_stride")
                + _strides("mask_stride", "bias_stride", count=4)
                + [(name, ctypes.c_int) for name in ("num_heads", "seqlen_q", "seqlen_k", "group", "mask_head_div",
                                                     "bias_head_div")]
                + [("softmax_scale", ctypes.c_float), ("softcap", ctypes.c_float)])


class _FwdParams(ctypes.Structure):
    """flash_fwd.cu's FwdParams, field for field."""

    _fields_ = [("inputs", _Inputs)] + _pointers("out", "lse") + _strides("out_stride", "lse_stride")


class _TensorMap(ctypes.Structure):
    """cuda.h's CUtensorMap: 128 opaque bytes the driver fills (128-byte aligned in the kernel's
    parameters, which `_WsParams` keeps by putting the maps first)."""

    _fields_ = [("opaque", ctypes.c_uint64 * 16)]


_MAPS = ("q_map", "k_map", "v_map", "mask_map", "bias_map")


class _WsParams(ctypes.Structure):
    """flash_fwd_ws.cu's WsParams, field for field, padded to its 128-byte multiple."""

    _fields_ = ([(name, _TensorMap) for name in _MAPS] + [("forward", _FwdParams), ("section_slices", ctypes.c_int)]
                + [("padding", ctypes.c_char * (-(len(_MAPS) * ctypes.sizeof(_TensorMap) + ctypes.sizeof(_FwdParams)
                                                  + ctypes.sizeof(ctypes.c_int)) % 128))])


class _PersistentWsFields(ctypes.Structure):  # `_PersistentWsParams` before its padding, for its size
    _fields_ = (_WsParams._fields_[:-1] + [(name, ctypes.c_int) for name in ("item_columns", "item_rows")]
                + [("schedule", ctypes.c_void_p)])


class _PersistentWsParams(ctypes.Structure):
    """flash_fwd_ws.cu's WsParams built with FWD_PERSISTENT (FwdConfig.persistent): `_WsParams`'
    fields, then the work items and the schedule, padded to its 128-byte multiple."""

    _fields_ = _PersistentWsFields._fields_ + [("padding", ctypes.c_char * (-ctypes.sizeof(_PersistentWsFields) % 128))]


class _BwdParams(ctypes.Structure):
    """bwd_steps.cuh's BwdParams (both backwards'), field for field."""

    _fields_ = ([("inputs", _Inputs)] + _pointers("out", "dout", "lse", "delta", "dq", "dk", "dv", "dbias")
                + _strides("out_stride", "dout_stride", "dq_stride", "dk_stride", "dv_stride", "lse_stride",
                           "delta_stride")
                + _strides("dbias_stride", count=4))


_BWD_MAPS = ("q_map", "k_map", "v_map", "do_map", "mask_map", "bias_map", "dbias_map")


class _BwdWsParams(ctypes.Structure):
    """flash_bwd_ws.cu's BwdWsParams, field for field, padded to its 128-byte multiple."""

    _fields_ = ([(name, _TensorMap) for name in _BWD_MAPS] + [("backward", _BwdParams)]
                + _pointers("dq_sum", "dq_counter") + [("section_slices", ctypes.c_int)]
                + [("padding", ctypes.c_char * (-(len(_BWD_MAPS) * ctypes.sizeof(_TensorMap)
                                                  + ctypes.sizeof(_BwdParams) + 16 + 4) % 128))])


class _Driver:
    """The few driver entry points the launcher needs, loaded once."""

    def __init__(self):
        self.lib = ctypes.CDLL("libcuda.so.1")
        self.modules: dict[tuple[int, str], ctypes.c_void_p] = {}
        self.functions: dict[tuple[int, str, bytes], tuple[ctypes.c_void_p, int]] = {}
        self.tensor_maps: dict[tuple, _TensorMap] = {}
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
                   swizzle: int) -> _TensorMap:
        """A TMA map of the 4-D tensor `t` with its dims taken in `order` (fastest first; the
        first is contiguous), whose boxes are `line` bytes by `box_rows` rows of one slice of the
        last two, in the swizzle of `swizzle`-byte lines (0: none). A map holds only the address,
        dims and strides it was made of, so one made for the same ones is reused (a loop that
        gets its freed buffers back encodes none)."""
        key = (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, order, box_rows, line, swizzle)
        tensor_map = self.tensor_maps.get(key)
        if tensor_map is None:
            self.make_current(t.device.index if t.device.index is not None else torch.cuda.current_device())
            if len(self.tensor_maps) >= _TENSOR_MAP_CACHE:
                self.tensor_maps.clear()
            tensor_map = self.tensor_maps[key] = self._encode(t, order, box_rows, line, swizzle)
        return tensor_map

    def _encode(self, t: torch.Tensor, order: tuple[int, int, int, int], box_rows: int, line: int,
                swizzle: int) -> _TensorMap:
        size = t.element_size()
        dims = (ctypes.c_uint64 * 4)(*(t.shape[i] for i in order))
        # a size-1 dim is only ever at coordinate 0: any stride the driver accepts will do
        strides = (ctypes.c_uint64 * 3)(*(t.stride(i) * size if t.shape[i] > 1 else 16 for i in order[1:]))
        box = (ctypes.c_uint32 * 4)(line // size, box_rows, 1, 1)
        element_strides = (ctypes.c_uint32 * 4)(1, 1, 1, 1)
        # the driver writes the map to a 64-byte aligned address; ctypes allocates on 16
        scratch = ctypes.create_string_buffer(2 * ctypes.sizeof(_TensorMap))
        address = -(-ctypes.addressof(scratch) // 128) * 128
        self.check(self.lib.cuTensorMapEncodeTiled(
            ctypes.c_void_p(address), _CU_TENSOR_MAP_DATA_TYPE[t.dtype], 4, ctypes.c_void_p(t.data_ptr()), dims,
            strides, box, element_strides, 0, _CU_TENSOR_MAP_SWIZZLE[swizzle], _CU_TENSOR_MAP_L2_PROMOTION_256B, 0),
            "cuTensorMapEncodeTiled")
        return _TensorMap.from_buffer_copy(ctypes.string_at(address, ctypes.sizeof(_TensorMap)))

    def launch(self, function, grid: tuple[int, int], threads: int, shared_bytes: int, stream: int, params) -> None:
        arguments = (ctypes.c_void_p * 1)(ctypes.addressof(params))
        self.check(self.lib.cuLaunchKernel(function, grid[0], grid[1], 1, threads, 1, 1, shared_bytes,
                                           ctypes.c_void_p(stream), arguments, None), "cuLaunchKernel")


_driver: _Driver | None = None
_built = lru_cache(maxsize=None)(build)  # a launch after the first pays no file-system lookup


def _the_driver() -> _Driver:
    global _driver
    if _driver is None:
        _driver = _Driver()
    return _driver


def arch_of(device: torch.device) -> str:
    """The arch kernels are built for on `device` ("sm90"), or the one being planned for."""
    planned = target.planned_arch()
    return planned if planned is not None else _device_arch(device)


@lru_cache(maxsize=None)
def _device_arch(device: torch.device) -> str:  # read once per device: a forward call asks every time
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm{major}{minor}"


def padded_head_dim(head_dim: int) -> int:
    return (head_dim + 15) // 16 * 16


def uses_wgmma(config: FwdConfig | BwdConfig, head_dim: int, arch: str | None) -> bool:
    """Whether `config`'s kernels run their products as SM90 wgmma (sm90.cuh): on SM90, with 16
    rows per warp in whole warpgroups, inner tiles wgmma has a width for, and a head dim padded to
    a multiple of 64 (the 128-byte swizzle line); elsewhere mma.sync.

    The backward also needs a head dim of at most 128 (WGMMA_BWD_MAX_HEAD_DIM).
    """
    padded = padded_head_dim(head_dim)
    if arch != "sm90" or config.num_warps % WARPGROUP or padded % 64:
        return False
    if isinstance(config, FwdConfig):
        return config.block_m == 16 * config.num_warps and config.block_n in WGMMA_TILES
    return padded <= WGMMA_BWD_MAX_HEAD_DIM and config.block_m in WGMMA_TILES and config.block_n_dq in WGMMA_TILES


def warp_specialized(config: FwdConfig, head_dim: int, arch: str | None) -> bool:
    """Whether `config` names the SM90 warp-specialized forward (flash_fwd_ws.cu): a producer
    warpgroup plus one consumer warpgroup per 64 query rows, so num_warps = block_m / 16 + 4, on
    SM90 with a head dim padded to a multiple of 64 and a key tile wgmma has a width for."""
    return (arch == "sm90" and padded_head_dim(head_dim) % 64 == 0 and config.block_m % 64 == 0
            and config.num_warps == config.block_m // 16 + WARPGROUP and config.block_n in WGMMA_TILES)


def backward_warp_specialized(config: BwdConfig, head_dim: int, arch: str | None) -> bool:
    """Whether `config` names the SM90 warp-specialized backward (flash_bwd_ws.cu): a producer
    warpgroup plus one consumer warpgroup per 64 keys, so num_warps = block_n / 16 + 4, on SM90
    with a head dim padded to 64 or 128 whose columns split into whole 64-column blocks among the
    consumers (their dQ products)."""
    return arch == "sm90" and _is_warp_specialized_shape(config) and _splits_head_dim(config, head_dim)


def _splits_head_dim(config: BwdConfig, head_dim: int) -> bool:
    """The warp-specialized backward's head-dim rule: padded to 64 or 128, in whole 64-column
    blocks for each of its block_n / 64 consumer warpgroups."""
    padded = padded_head_dim(head_dim)
    return padded in (64, 128) and padded % config.block_n == 0


def _is_warp_specialized_shape(config: FwdConfig | BwdConfig) -> bool:
    """A warp-specialized kernel's tile shape, on any arch (`warp_specialized` and
    `backward_warp_specialized` add the arch): the forward's query rows, or the backward's keys,
    at 16 a warp plus a producer warpgroup."""
    if isinstance(config, FwdConfig):
        return config.block_m in WS_BLOCK_M and config.num_warps == config.block_m // 16 + WARPGROUP
    return config.block_n in WS_BWD_BLOCK_N and config.num_warps == config.block_n // 16 + WARPGROUP


def arch_reason(config: FwdConfig | BwdConfig, head_dim: int, arch: str) -> str | None:
    """The reason `config` cannot run on `arch` though its shape is supported, or None."""
    if isinstance(config, BwdConfig):
        if _is_warp_specialized_shape(config) and arch != "sm90":
            return (f"{config.block_n} keys on {config.num_warps} warps is the warp-specialized backward, which "
                    f"runs on sm90 only (here: {arch})")
        return None
    if _is_warp_specialized_shape(config) and not warp_specialized(config, head_dim, arch):
        return (f"{config.block_m} rows on {config.num_warps} warps is the warp-specialized forward, which runs "
                f"on sm90 only (here: {arch})")
    return None


def forward_kernel(config: FwdConfig, head_dim: int, arch: str | None) -> str:
    """The forward source `config` runs on `arch`: "fwd_ws" (flash_fwd_ws.cu) or "fwd" (flash_fwd.cu)."""
    return "fwd_ws" if warp_specialized(config, head_dim, arch) else "fwd"


def backward_kernel(config: BwdConfig, head_dim: int, arch: str | None) -> str:
    """The backward source `config` runs on `arch`: "bwd_ws" (flash_bwd_ws.cu) or "bwd" (flash_bwd.cu)."""
    return "bwd_ws" if backward_warp_specialized(config, head_dim, arch) else "bwd"


def score_slot_bytes(config: FwdConfig, mask_tiles: int, bias_tiles: int) -> int:
    """Bytes of one slot of the warp-specialized forward's staged mask and bias ring: each tile
    (block_m rows, or one for TILES_OF_KEYS; a mask byte or a 16-bit bias per key) on 1 KiB
    bounds (flash_fwd_ws.cu: SCORE_SLOT_BYTES)."""
    def rows(tiles: int) -> int:
        return {NOT_STAGED: 0, TILES_OF_ROWS: config.block_m, TILES_OF_KEYS: 1}[tiles]

    def kib(size: int) -> int:
        return -(-size // 1024) * 1024

    return kib(rows(mask_tiles) * config.block_n) + kib(rows(bias_tiles) * config.block_n * 2)


def score_stages(config: FwdConfig, head_dim: int, mask_tiles: int = TILES_OF_ROWS,
                 bias_tiles: int = TILES_OF_ROWS) -> int:
    """Slots of the warp-specialized forward's ring of staged mask and bias tiles: as many as fit
    beside Q and the K and V rings in an SM90 block's shared memory, up to MAX_SCORE_STAGES, or
    none (the mask and bias are then read from global memory). Tiles of 64 or 128 keys only: one
    or two 128-byte lines per bias row."""
    slot = score_slot_bytes(config, mask_tiles, bias_tiles)
    if config.block_n not in (64, 128) or slot == 0:
        return 0
    base = _forward_tile_bytes(config, head_dim, True)
    for stages in range(MAX_SCORE_STAGES, 0, -1):
        if base + stages * slot + WS_STATIC_BYTES <= SM90_SHARED_BYTES:
            return stages
    return 0


def _forward_tile_bytes(config: FwdConfig, head_dim: int, wgmma: bool) -> int:
    """Shared bytes of the forward's Q tile and its K and V rings."""
    return _tile_bytes(config.block_m + 2 * config.num_stages * config.block_n, head_dim, wgmma)


def _tile_bytes(rows: int, head_dim: int, wgmma: bool) -> int:
    """Shared bytes of `rows` tile rows: padded rows for ldmatrix, or swizzled ones plus the
    alignment slack for wgmma (common.cuh: ROW)."""
    if wgmma:
        return rows * padded_head_dim(head_dim) * 2 + SWIZZLE_SLACK
    return rows * (padded_head_dim(head_dim) + SHARED_PAD) * 2


def forward_shared_bytes(config: FwdConfig, head_dim: int, arch: str | None = None, mask_tiles: int = TILES_OF_ROWS,
                         bias_tiles: int = TILES_OF_ROWS) -> int:
    """The forward's dynamic shared memory on `arch`: Q, and K and V rings of num_stages tiles;
    the warp-specialized forward's also its ring of staged mask and bias tiles (as the call's
    operands are staged; by default the largest, a mask and a bias of rows).

    Without an arch, the mma.sync layout's: with at least 128 rows (64 query rows and two
    32-key tiles) it bounds the wgmma layout's too.
    """
    if warp_specialized(config, head_dim, arch):  # and its ring of mask and bias tiles
        return (_forward_tile_bytes(config, head_dim, True)
                + score_stages(config, head_dim, mask_tiles, bias_tiles) * score_slot_bytes(config, mask_tiles, bias_tiles))
    return _forward_tile_bytes(config, head_dim, uses_wgmma(config, head_dim, arch))


def backward_score_slot_bytes(config: BwdConfig, mask_tiles: int, bias_tiles: int) -> int:
    """Bytes of one slot of the warp-specialized backward's ring of staged mask and bias tiles:
    a query tile's mask bytes and 16-bit bias of its block_n keys (TILES_OF_ROWS; an operand of
    one row of keys is read into registers instead: flash_bwd_ws.cu's SCORE_SLOT_BYTES)."""
    tile = config.block_m * config.block_n
    return (tile if mask_tiles == TILES_OF_ROWS else 0) + (2 * tile if bias_tiles == TILES_OF_ROWS else 0)


def _backward_ws_bytes(config: BwdConfig, head_dim: int, score_stages: int, slot: int) -> int:
    """flash_bwd_ws.cu's dynamic shared memory: K and V, the Q and dO rings, two dS tiles, the fp32
    dQ shares (one beside a ring of staged tiles, else two), that ring, the lse and delta rings."""
    ring = config.num_stages * config.block_m
    dq_shares = (1 if score_stages else 2) * config.block_m * padded_head_dim(head_dim) * 4
    return (_tile_bytes(2 * config.block_n + 2 * ring, head_dim, True) + 2 * config.block_m * config.block_n * 2
            + dq_shares + score_stages * slot + 2 * ring * 4)


def backward_score_stages(config: BwdConfig, head_dim: int, mask_tiles: int, bias_tiles: int) -> int:
    """Slots of the warp-specialized backward's ring of staged mask and bias tiles: as many as fit
    an SM90 block's shared memory, up to MAX_SCORE_STAGES, or none (read from global memory)."""
    slot = backward_score_slot_bytes(config, mask_tiles, bias_tiles)
    if config.block_n not in (64, 128) or slot == 0:
        return 0
    for stages in range(MAX_SCORE_STAGES, 0, -1):
        if _backward_ws_bytes(config, head_dim, stages, slot) + WS_STATIC_BYTES <= SM90_SHARED_BYTES:
            return stages
    return 0


def backward_shared_bytes(config: BwdConfig, head_dim: int, arch: str | None = None, mask_tiles: int = NOT_STAGED,
                          bias_tiles: int = NOT_STAGED) -> dict[str, int]:
    """The backward's dynamic shared memory per kernel on `arch` (as the forward's). flash_bwd.cu:
    dK/dV holds K, V and rings of Q and dO tiles with their lse and delta (fp32); dQ holds Q, dO
    and rings of K and V tiles. flash_bwd_ws.cu: its one kernel's (`ws`), with the ring of
    staged tiles a call's operands get (`_backward_staging`; by default none, the largest)."""
    ring = config.num_stages * config.block_m
    if backward_warp_specialized(config, head_dim, arch):
        stages = backward_score_stages(config, head_dim, mask_tiles, bias_tiles)
        return {"ws": _backward_ws_bytes(config, head_dim, stages,
                                         backward_score_slot_bytes(config, mask_tiles, bias_tiles))}
    wgmma = uses_wgmma(config, head_dim, arch)
    return {
        "dkdv": _tile_bytes(2 * config.block_n + 2 * ring, head_dim, wgmma) + 2 * ring * 4,
        "dq": _tile_bytes(2 * config.block_m_dq + 2 * config.num_stages * config.block_n_dq, head_dim, wgmma),
    }


def shared_bytes(config: FwdConfig | BwdConfig, head_dim: int, arch: str | None = None) -> int:
    """The most dynamic shared memory one kernel of `config`'s direction asks for on `arch`."""
    if isinstance(config, FwdConfig):
        return forward_shared_bytes(config, head_dim, arch)
    return max(backward_shared_bytes(config, head_dim, arch).values())


def is_supported(config: FwdConfig | BwdConfig, shape: AttentionShape) -> str | None:
    """The reason `config` cannot run `shape` on this backend, or None when it can.

    Shared memory per arch is checked at launch (`OutOfResources`) and by compile-check.
    """
    reason = shape_problem(shape)
    if reason:
        return reason
    if isinstance(config, FwdConfig) and (config.overlap or config.persistent):
        reason = _knob_reason(config)
        if reason:
            return reason
    if isinstance(config, BwdConfig) and _is_warp_specialized_shape(config):  # `backward_warp_specialized`
        return _warp_specialized_backward_reason(config, shape.head_dim)
    if _is_warp_specialized_shape(config):  # the SM90 warp-specialized forward (`warp_specialized`)
        if config.block_n not in WGMMA_TILES:
            return f"block_n={config.block_n} is not one of {WGMMA_TILES} (warp-specialized forward: wgmma widths)"
        if padded_head_dim(shape.head_dim) % 64:
            return f"head_dim={shape.head_dim} does not pad to a multiple of 64 (warp-specialized forward)"
        # 16 warps leave ptxas 128 registers a thread, and a consumer's wgmma at head dim 256
        # needs 158 (ptxas C7602); 192 builds (nvcc 13, sm_90a)
        if config.num_warps > 12 and padded_head_dim(shape.head_dim) > 192:
            return (f"head_dim={shape.head_dim} needs at most 12 warps in the warp-specialized forward "
                    f"(num_warps={config.num_warps}: too few registers a thread for its products)")
        if not 1 <= config.num_stages <= MAX_STAGES:
            return f"num_stages={config.num_stages} is not in [1, {MAX_STAGES}]"
        return None
    if config.num_warps not in WARP_CHOICES:
        return f"num_warps={config.num_warps} is not one of {WARP_CHOICES}"
    owned = ("block_m",) if isinstance(config, FwdConfig) else ("block_n", "block_m_dq")
    walked = ("block_n",) if isinstance(config, FwdConfig) else ("block_m", "block_n_dq")
    rows_per_warp = FORWARD_WARP_ROWS if isinstance(config, FwdConfig) else (16,)
    for name in owned:
        if getattr(config, name) not in tuple(rows * config.num_warps for rows in rows_per_warp):
            return (f"{name}={getattr(config, name)} is not {' or '.join(map(str, rows_per_warp))} x "
                    f"num_warps={config.num_warps} (the rows a warp owns)")
    for name in walked:
        if getattr(config, name) not in INNER_CHOICES:
            return f"{name}={getattr(config, name)} is not one of {INNER_CHOICES}"
    if not 1 <= config.num_stages <= MAX_STAGES:
        return f"num_stages={config.num_stages} is not in [1, {MAX_STAGES}]"
    return None


def _knob_reason(config: FwdConfig) -> str | None:
    """`is_supported` for the forward's kernel knobs: `overlap` (flash_fwd_ws.cu's FWD_OVERLAP)
    and `persistent` (FWD_PERSISTENT) (each 0 or 1: `FwdConfig`), on the warp-specialized forward only, and a
    persistent launch only of the overlapped forward (whose consumers walk work items)."""
    if config.persistent and not config.overlap:
        return "persistent=1 needs overlap=1 (the persistent launch walks the overlapped forward's work items)"
    if not _is_warp_specialized_shape(config):
        knobs = " and ".join(f"{name}=1" for name in ("overlap", "persistent") if getattr(config, name))
        return (f"{knobs}: a knob of the warp-specialized forward only (block_m in {WS_BLOCK_M} on block_m / 16 + "
                f"{WARPGROUP} warps), not of {config.block_m} rows on {config.num_warps} warps")
    return None


def _warp_specialized_backward_reason(config: BwdConfig, head_dim: int) -> str | None:
    """`is_supported` for the warp-specialized backward's shape."""
    padded = padded_head_dim(head_dim)
    if config.block_m != WS_BWD_BLOCK_M:
        return f"block_m={config.block_m} is not {WS_BWD_BLOCK_M} (warp-specialized backward: query tiles of 64 rows)"
    if (config.block_m_dq, config.block_n_dq) != (config.block_m, config.block_n):
        return (f"block_m_dq x block_n_dq = {config.block_m_dq}x{config.block_n_dq} is not block_m x block_n = "
                f"{config.block_m}x{config.block_n} (warp-specialized backward: the dQ shares are its tiles)")
    if padded not in (64, 128):
        return f"head_dim={head_dim} does not pad to 64 or 128 (warp-specialized backward)"
    if not _splits_head_dim(config, head_dim):
        return (f"head_dim={head_dim} does not split into 64-column blocks among block_n / 64 = "
                f"{config.block_n // 64} consumer warpgroups (warp-specialized backward: their dQ products)")
    if not 1 <= config.num_stages <= MAX_STAGES:
        return f"num_stages={config.num_stages} is not in [1, {MAX_STAGES}]"
    return None


def _check_aligned(name: str, t: torch.Tensor) -> None:
    _check_rows(name, t.stride(), t.data_ptr() % 16)


def _check_rows(name: str, stride: tuple[int, ...], offset: int) -> None:
    # cp.async and TMA move 16-byte chunks: each row of the head dim must start on a 16-byte
    # boundary (`offset`: the data's address modulo 16)
    if offset or any(s % 8 for s in stride[:3]):
        raise ValueError(f"{name}: the cuda backend needs rows on 16-byte boundaries, got strides "
                         f"{tuple(stride)} at offset {offset}")


def _element(dtype: torch.dtype) -> str:
    if dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"query: the cuda backend runs fp16 and bf16, got {dtype}")
    return "bf16" if dtype == torch.bfloat16 else "fp16"


def _check_tensor(q: torch.Tensor) -> None:
    planning = q.device.type == "meta" and target.planned_arch() is not None  # data-less tensors of a plan
    if q.device.type != "cuda" and not planning:
        raise ValueError(f"query: the cuda backend runs on CUDA tensors, got device {q.device}")
    _element(q.dtype)


def _features(bias_dtype: torch.dtype | None, is_causal: bool, has_mask: bool, softcap: float) -> dict[str, bool]:
    return dict(bias_fp32=bias_dtype == torch.float32, is_causal=is_causal, has_mask=has_mask,
                has_bias=bias_dtype is not None, has_softcap=softcap > 0)


def variant(config: FwdConfig, head_dim: int, dtype: torch.dtype, bias_dtype: torch.dtype | None, *, arch: str,
            is_causal: bool, has_mask: bool, softcap: float, mask_tiles: int = TILES_OF_ROWS,
            bias_tiles: int = TILES_OF_ROWS) -> tuple[str, ...]:
    """The -D list of the forward variant a call needs on `arch` ("sm90"). The warp-specialized
    forward stages the mask and a 16-bit bias in shared memory where there is room, as the call's
    operands allow (`mask_tiles`, `bias_tiles`: `staged_tiles`). Its knobs, where on, add
    FWD_OVERLAP and FWD_PERSISTENT; a knob off adds nothing, so its variant is the code the knob
    was added to.

    Raises:
        ValueError: a knob on for a config that is not the warp-specialized forward on `arch`.
    """
    own = dict(BLOCK_M=config.block_m, BLOCK_N=config.block_n)
    if warp_specialized(config, head_dim, arch):
        stages, mask_tiles, bias_tiles = _staging(config, head_dim, has_mask, bias_dtype, mask_tiles, bias_tiles)
        own.update(WGMMA=True, SCORE_STAGES=stages, MASK_TILES=mask_tiles, BIAS_TILES=bias_tiles)
        own.update({name: True for name, on in (("FWD_OVERLAP", config.overlap), ("FWD_PERSISTENT", config.persistent))
                    if on})
    elif config.overlap or config.persistent:
        reason = _knob_reason(config) or "overlap and persistent: knobs of the warp-specialized forward, on sm90 only"
        raise ValueError(f"config: {reason} (here: {arch})")
    else:
        own.update(WGMMA=uses_wgmma(config, head_dim, arch))
    return defines(_element(dtype), head_dim, config.num_warps, config.num_stages,
                   **_features(bias_dtype, is_causal, has_mask, softcap), **own)


def _staging(config: FwdConfig, head_dim: int, has_mask: bool, bias_dtype: torch.dtype | None, mask_tiles: int,
             bias_tiles: int) -> tuple[int, int, int]:
    """(score ring slots, MASK_TILES, BIAS_TILES) of a warp-specialized call whose operands allow
    `mask_tiles` and `bias_tiles`: only a 16-bit bias is staged, and nothing where no slot fits."""
    mask_tiles = mask_tiles if has_mask else NOT_STAGED
    bias_tiles = bias_tiles if bias_dtype in (torch.float16, torch.bfloat16) else NOT_STAGED
    stages = score_stages(config, head_dim, mask_tiles, bias_tiles)
    return (stages, mask_tiles, bias_tiles) if stages else (0, NOT_STAGED, NOT_STAGED)


def staged_tiles(t: torch.Tensor | None, seqlen_q: int) -> int:
    """How the warp-specialized forward can stage the 4-D mask or bias `t` through TMA: its
    (query, key) tiles (TILES_OF_ROWS), one row of keys per tile (TILES_OF_KEYS: no query dim),
    or not at all (NOT_STAGED: no operand, a broadcast key dim, keys not contiguous, or rows and
    slices off 16-byte boundaries)."""
    if t is None or t.data_ptr() % 16:
        return NOT_STAGED
    return _staged_layout(tuple(t.shape), t.stride(), t.element_size(), seqlen_q)


def _staged_layout(shape: tuple, stride: tuple, itemsize: int, seqlen_q: int) -> int:
    """`staged_tiles` of an operand whose data starts on a 16-byte boundary."""
    if shape[2] not in (1, seqlen_q) or shape[3] == 1 or stride[3] != 1:
        return NOT_STAGED
    if not all(shape[i] == 1 or (stride[i] > 0 and stride[i] * itemsize % 16 == 0) for i in range(3)):
        return NOT_STAGED
    return TILES_OF_KEYS if shape[2] == 1 else TILES_OF_ROWS


def _backward_staging(config: BwdConfig, head_dim: int, has_mask: bool, bias_dtype: torch.dtype | None,
                      mask_tiles: int, bias_tiles: int) -> tuple[int, int, int]:
    """(score ring slots, MASK_TILES, BIAS_TILES) of a warp-specialized backward call whose
    operands allow `mask_tiles` and `bias_tiles` (`staged_tiles`): tiles of rows staged where
    the ring fits (a bias only if 16-bit), a row of keys read into registers."""
    mask_tiles = mask_tiles if has_mask else NOT_STAGED
    bias_tiles = bias_tiles if bias_dtype is not None else NOT_STAGED
    if bias_tiles == TILES_OF_ROWS and bias_dtype not in (torch.float16, torch.bfloat16):
        bias_tiles = NOT_STAGED
    stages = backward_score_stages(config, head_dim, mask_tiles, bias_tiles)
    if not stages:  # no room: tiles of rows from global memory
        mask_tiles, bias_tiles = (NOT_STAGED if tiles == TILES_OF_ROWS else tiles for tiles in (mask_tiles, bias_tiles))
    return stages, mask_tiles, bias_tiles


def _stores_dbias_by_tma(dbias: tuple[bool, torch.dtype] | None, dtype: torch.dtype, softcap: float,
                        target_allows: bool) -> bool:
    """Whether the warp-specialized backward stores dBias from its staged dS tiles by TMA: a
    target with query rows in the input dtype whose layout allows (`target_allows`), and no
    softcap (dS is dBias)."""
    return dbias is not None and dbias[0] and dbias[1] == dtype and softcap <= 0 and target_allows


def backward_variant(config: BwdConfig, head_dim: int, dtype: torch.dtype, bias_dtype: torch.dtype | None, *,
                     arch: str, is_causal: bool, has_mask: bool, softcap: float, group: int,
                     dbias: tuple[bool, torch.dtype] | None, mask_tiles: int = TILES_OF_ROWS,
                     bias_tiles: int = TILES_OF_ROWS, dbias_tma: bool = True) -> tuple[str, ...]:
    """The -D list of the backward variant a call needs on `arch`; `dbias` is (rows, target
    dtype) of the dBias target (`_dbias_target`) or None without dBias. The warp-specialized
    backward stages the mask and bias as the call's operands allow (`mask_tiles`, `bias_tiles`:
    `staged_tiles`; by default tiles of rows), and stores dBias rows of the input dtype by TMA
    where the target's layout allows (`dbias_tma`) and dS is dBias (no softcap)."""
    rows, target_dtype = dbias if dbias is not None else (False, torch.float32)
    if backward_warp_specialized(config, head_dim, arch):
        stages, mask_tiles, bias_tiles = _backward_staging(config, head_dim, has_mask, bias_dtype, mask_tiles,
                                                           bias_tiles)
        own = dict(BLOCK_M=config.block_m, BLOCK_N=config.block_n, WGMMA=True, SCORE_STAGES=stages,
                   MASK_TILES=mask_tiles, BIAS_TILES=bias_tiles,
                   DBIAS_TMA=_stores_dbias_by_tma(dbias, dtype, softcap, dbias_tma))
    else:
        own = dict(DKDV_BLOCK_M=config.block_m, DQ_BLOCK_N=config.block_n_dq, WGMMA=uses_wgmma(config, head_dim, arch))
    return defines(_element(dtype), head_dim, config.num_warps, config.num_stages,
                   **_features(bias_dtype, is_causal, has_mask, softcap), HAS_DBIAS=dbias is not None,
                   DBIAS_ROWS=rows, DBIAS_FP32=target_dtype == torch.float32, DKV_FP32=group > 1, **own)


def _check_call(config, q, k, mask, bias, is_causal: bool, softcap: float, bias_requires_grad: bool) -> None:
    batch, seqlen_q, num_heads, head_dim = q.shape
    reason = is_supported(config, AttentionShape(
        batch=batch, seqlen_q=seqlen_q, seqlen_k=k.shape[1], num_heads=num_heads, num_heads_kv=k.shape[2],
        head_dim=head_dim, is_causal=is_causal, has_mask=mask is not None, has_bias=bias is not None,
        bias_requires_grad=bias_requires_grad, softcap=softcap))
    if reason:
        raise ValueError(f"config: {reason}")


def _address(t: torch.Tensor | None) -> int:
    return t.data_ptr() if t is not None else 0


def _inputs(q, k, v, mask, bias, softmax_scale: float, softcap: float, address=_address) -> _Inputs:
    num_heads = q.shape[2]
    group = num_heads // k.shape[2]
    if mask is not None and mask.dtype == torch.bool:
        mask = mask.view(torch.uint8)  # same itemsize: a reinterpretation, not a copy

    def head_divisor(t):  # a head dim of Hkv maps query head h to slice h // group
        return group if t is not None and t.shape[1] not in (num_heads, 1) else 1

    return _Inputs(
        address(q), address(k), address(v), address(mask), address(bias), q.stride()[:3], k.stride()[:3], v.stride()[:3],
        zero_size1_strides(mask), zero_size1_strides(bias), num_heads, q.shape[1], k.shape[1], group,
        head_divisor(mask), head_divisor(bias), softmax_scale, softcap if softcap > 0 else 1.0,
    )


class _Launcher:
    """Runs the kernels of one cubin on the current stream of the inputs' device (or, in
    compile-only mode, only makes sure the cubin is built)."""

    def __init__(self, direction: str, device: torch.device, flags: tuple[str, ...]):
        if target.planned_arch() is not None:  # planning a table entry's stamp: nothing is built
            target.record(target.Program("cuda", direction, None, tuple(sorted(("-D", flag) for flag in flags))))
            return
        self.cubin = str(_built(direction, arch_of(device), flags))
        self.device = device.index if device.index is not None else torch.cuda.current_device()

    def __call__(self, name: bytes, grid: tuple[int, int], num_warps: int, shared_bytes: int, params) -> None:
        if grid[1] > MAX_GRID_Y:
            raise ValueError(f"{name.decode()}: needs {grid[1]} CTAs on grid y, over CUDA's limit of {MAX_GRID_Y} "
                             "(fewer heads x batch in the backward, or a shorter query in the forward)")
        driver = _the_driver()
        if torch.cuda.current_device() == self.device:  # its primary context is current: no switch
            self._launch(driver, name, grid, num_warps, shared_bytes, params)
        else:
            with torch.cuda.device(self.device):  # the runtime makes the device's primary context current
                self._launch(driver, name, grid, num_warps, shared_bytes, params)

    def function(self, name: bytes, shared_bytes: int) -> int:
        """The address of kernel `name`'s CUfunction, allowed `shared_bytes` (a native program's;
        loaded by a launch before, so no driver call)."""
        return _the_driver().function(self.device, self.cubin, name, shared_bytes).value

    def _launch(self, driver: "_Driver", name: bytes, grid: tuple[int, int], num_warps: int, shared_bytes: int,
                params) -> None:
        driver.make_current(self.device)
        function = driver.function(self.device, self.cubin, name, shared_bytes)
        driver.launch(function, grid, 32 * num_warps, shared_bytes, torch._C._cuda_getCurrentRawStream(self.device),
                      params)


class _ForwardLaunch(NamedTuple):
    """What every forward call of one signature launches (`_forward_launch`)."""

    launcher: _Launcher
    name: bytes
    grid: tuple[int, int]
    shared: int
    # the warp-specialized forward's tensor maps: (_WsParams field, operand: 0 q, 1 k, 2 v, 3
    # mask, 4 bias; dims order, box rows, box line bytes, swizzle)
    maps: tuple[tuple[str, int, tuple[int, int, int, int], int, int, int], ...]
    section_slices: int = 0  # the warp-specialized forward's launch order (`section_slices`; flash_fwd.cu has none)
    items: tuple[int, int] = (0, 0)  # the warp-specialized forward's work items: head slices x query blocks
    tiles: tuple[int, ...] = ()  # its query blocks' key tiles where it launches persistent (FwdConfig.persistent)

    def launch_grid(self, device: torch.device) -> tuple[tuple[int, int], torch.Tensor | None]:
        """The grid on `device`, and a persistent launch's schedule (`persistent_schedule`)."""
        if not self.tiles:
            return self.grid, None
        return _persistent_launch(device, self.items, self.section_slices, self.tiles)

    def ws_params(self, forward: _FwdParams, schedule: torch.Tensor | None, **maps) -> ctypes.Structure:
        """The warp-specialized forward's parameters around a call's FwdParams: a `_WsParams`, or
        for a persistent launch a `_PersistentWsParams` with its schedule."""
        if not self.tiles:
            return _WsParams(forward=forward, section_slices=self.section_slices, **maps)
        return _PersistentWsParams(forward=forward, section_slices=self.section_slices, item_columns=self.items[0],
                                   item_rows=self.items[1], schedule=schedule.data_ptr(), **maps)


@lru_cache(maxsize=256)
def _persistent_launch(device: torch.device, items: tuple[int, int], sections: int,
                       tiles: tuple[int, ...]) -> tuple[tuple[int, int], torch.Tensor]:
    """A persistent forward's grid (a CTA per SM, at most one per item) and schedule on `device`,
    made on the signature's first launch (a plan may be built for a GPU that is not here)."""
    ctas = min(torch.cuda.get_device_properties(device).multi_processor_count, items[0] * items[1])
    schedule = persistent_schedule(items, sections, list(tiles), ctas)
    return (ctas, 1), torch.tensor(schedule, dtype=torch.int32, device=device)


def _layout(t: torch.Tensor | None) -> tuple | None:
    """What of a tensor decides a forward's checks, variant and launch: all but its data (and
    its address modulo 16: cp.async and TMA need 16-byte boundaries)."""
    if t is None:
        return None
    return tuple(t.shape), t.stride(), t.dtype, t.device, t.data_ptr() % 16


def _meta_tensors(layouts: tuple) -> list[torch.Tensor | None]:
    """Data-less tensors of the `_layout`s of a signature (None stays None)."""
    return [None if layout is None else torch.empty_strided(layout[0], layout[1], dtype=layout[2], device="meta")
            for layout in layouts]


def _forward_launch(layouts: tuple, is_causal: bool, softcap: float, config: FwdConfig) -> _ForwardLaunch:
    """`_signature_launch` for the arch of the layouts' device (or the one planned for)."""
    return _signature_launch(layouts, is_causal, softcap, config, arch_of(layouts[0][3]))


@lru_cache(maxsize=256)
def _signature_launch(layouts: tuple, is_causal: bool, softcap: float, config: FwdConfig, arch: str) -> _ForwardLaunch:
    """The checks, variant, cubin and launch geometry of a forward signature, done once: a call
    then only fills its pointers (and its tensor maps) and launches."""
    (q_shape, _, dtype, device, _), _, _, mask_layout, bias_layout, _ = layouts
    batch, seqlen_q, num_heads, head_dim = q_shape
    q, k, _, mask, bias, _ = _meta_tensors(layouts)
    _check_call(config, q, k, mask, bias, is_causal, softcap, False)
    for name, layout in zip(("query", "key", "value", None, None, "out"), layouts):
        if name is not None:
            _check_rows(name, layout[1], layout[4])
    reason = arch_reason(config, head_dim, arch)
    if reason:
        raise ValueError(f"config: {reason}")
    source = forward_kernel(config, head_dim, arch)

    def tiles(t, layout):  # `staged_tiles`, with the data's address from the signature
        if layout is None or layout[4]:
            return NOT_STAGED
        return _staged_layout(layout[0], layout[1], t.element_size(), seqlen_q)

    bias_dtype = None if bias is None else bias.dtype
    mask_tiles, bias_tiles = tiles(mask, mask_layout), tiles(bias, bias_layout)
    flags = variant(config, head_dim, dtype, bias_dtype, arch=arch, is_causal=is_causal, has_mask=mask is not None,
                    softcap=softcap, mask_tiles=mask_tiles, bias_tiles=bias_tiles)
    launcher = _Launcher(source, device, flags)
    grid = (batch * num_heads, triton.cdiv(seqlen_q, config.block_m))
    if source != "fwd_ws":
        return _ForwardLaunch(launcher, b"dmattn_fwd_kernel", grid, forward_shared_bytes(config, head_dim, arch), ())
    _, mask_tiles, bias_tiles = _staging(config, head_dim, mask is not None, bias_dtype, mask_tiles, bias_tiles)
    rows_of, keys_of = (3, 1, 2, 0), (3, 2, 1, 0)  # (B, L, H, D) as (D, L, H, B); (B, H, Lq, Lk) as (Lk, Lq, H, B)
    maps = [("q_map", 0, rows_of, config.block_m, _TMA_LINE, _TMA_LINE),
            ("k_map", 1, rows_of, config.block_n, _TMA_LINE, _TMA_LINE),
            ("v_map", 2, rows_of, config.block_n, _TMA_LINE, _TMA_LINE)]
    # a mask box is block_n bytes wide, a bias box of rows one 128-byte line; a single row of keys
    # is one box, not swizzled
    if mask_tiles == TILES_OF_ROWS:
        maps.append(("mask_map", 3, keys_of, config.block_m, min(config.block_n, _TMA_LINE), min(config.block_n, _TMA_LINE)))
    elif mask_tiles == TILES_OF_KEYS:
        maps.append(("mask_map", 3, keys_of, 1, min(config.block_n, _TMA_LINE), 0))
    if bias_tiles == TILES_OF_ROWS:
        maps.append(("bias_map", 4, keys_of, config.block_m, _TMA_LINE, _TMA_LINE))
    elif bias_tiles == TILES_OF_KEYS:
        maps.append(("bias_map", 4, keys_of, 1, config.block_n * bias.element_size(), 0))
    shared = forward_shared_bytes(config, head_dim, arch, mask_tiles, bias_tiles)
    kv_bytes = 2 * k.shape[1] * padded_head_dim(head_dim) * dtype.itemsize  # K and V, shared by a group's heads
    sections = section_slices(batch * num_heads, kv_bytes, num_heads // k.shape[2])
    tiles = (tuple(_key_tiles(block, config, seqlen_q, k.shape[1], is_causal) for block in range(grid[1]))
             if config.persistent else ())
    return _ForwardLaunch(launcher, b"dmattn_fwd_ws_kernel", grid, shared, tuple(maps), sections, grid, tiles)


def _key_tiles(m_block: int, config: FwdConfig, seqlen_q: int, seqlen_k: int, is_causal: bool) -> int:
    """The key tiles query block `m_block` walks (common.cuh's KeyTiles::block)."""
    keys = min(seqlen_k, max(0, (m_block + 1) * config.block_m + seqlen_k - seqlen_q)) if is_causal else seqlen_k
    return triton.cdiv(keys, config.block_n)


def persistent_schedule(items: tuple[int, int], section_slices: int, tiles: list[int], ctas: int) -> list[int]:
    """A persistent forward's items per CTA (flash_fwd_ws.cu's WsParams.schedule): the items of
    the (head slices, query blocks) grid `items` in launch order (common.cuh's section_order),
    each to the CTA that is free first, as the block scheduler hands out a grid's CTAs; an item
    costs the key tiles of its query block (`tiles`) plus ITEM_TILES. Returns the CTAs' offsets
    (ctas + 1) then their items."""
    columns, rows = items
    free = [(0, cta) for cta in range(ctas)]
    taken: list[list[int]] = [[] for _ in range(ctas)]
    for index in range(columns * rows):
        section, in_section = divmod(index, section_slices * rows)
        block = in_section // min(section_slices, columns - section * section_slices)
        time, cta = heapq.heappop(free)
        taken[cta].append(index)
        heapq.heappush(free, (time + tiles[rows - 1 - block] + ITEM_TILES, cta))
    return list(itertools.accumulate([0] + [len(t) for t in taken])) + [index for t in taken for index in t]


def section_slices(slices: int, reread_bytes: int, sharing: int = 1) -> int:
    """Head slices per section of a warp-specialized kernel's launch order (common.cuh:
    section_order): as many as fit L2_SECTION_BYTES with the operand bytes each group of `sharing`
    slices re-reads from L2 (the forward's K and V, the backward's Q, dO and dQ sums), at least one
    group, at most every slice."""
    return min(slices, max(1, L2_SECTION_BYTES // reread_bytes) * sharing)


@lru_cache(maxsize=256)
def _forward_template(layouts: tuple, softmax_scale: float, softcap: float, lse_stride: tuple) -> bytes:
    """A forward signature's FwdParams with every address 0: a call copies it and fills in its
    tensors' addresses (`_fill_addresses`) instead of building the structure field by field."""
    q, k, v, mask, bias, out = _meta_tensors(layouts)
    inputs = _inputs(q, k, v, mask, bias, softmax_scale, softcap, address=lambda t: 0)
    return bytes(_FwdParams(inputs, 0, 0, out.stride()[:3], lse_stride))


def _fill_addresses(params: _FwdParams, q, k, v, mask, bias, out, lse) -> None:
    inputs = params.inputs
    inputs.q, inputs.k, inputs.v = q.data_ptr(), k.data_ptr(), v.data_ptr()
    inputs.mask, inputs.bias = _address(mask), _address(bias)
    params.out, params.lse = out.data_ptr(), lse.data_ptr()


def attention_forward(q, k, v, mask, bias, *, is_causal: bool, softmax_scale: float, softcap: float,
                      config: FwdConfig, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Writes out (B, Lq, H, D) and lse (B, H, Lq) fp32 for one forward call."""
    _check_tensor(q)
    layouts = tuple(_layout(t) for t in (q, k, v, mask, bias, out))
    plan = _forward_launch(layouts, is_causal, softcap, config)
    if is_compile_only():
        return
    params = _FwdParams.from_buffer_copy(_forward_template(layouts, softmax_scale, softcap, lse.stride()))
    _fill_addresses(params, q, k, v, mask, bias, out, lse)
    grid, schedule = plan.launch_grid(q.device)
    if plan.maps:
        operands, driver = (q, k, v, mask, bias), _the_driver()
        params = plan.ws_params(params, schedule,
                                **{field: driver.tensor_map(operands[index], order, rows, line, swizzle)
                                   for field, index, order, rows, line, swizzle in plan.maps})
    plan.launcher(plan.name, grid, config.num_warps, plan.shared, params)


def _native_parameters(layouts: tuple, softmax_scale: float, softcap: float, lse_stride: tuple,
                       plan: _ForwardLaunch, schedule: torch.Tensor | None) -> tuple[bytes, list, list]:
    """A forward signature's parameters for a native program (`dmattn_bench.native.structure_spec`):
    the template (its FwdParams, inside a WsParams where the kernel reads tensor maps, with a
    persistent launch's schedule), the address slots (q, k, v, the mask and bias where given, then
    the program's out and lse allocations) and the map slots (`_ForwardLaunch.maps`' operands)."""
    forward = _FwdParams.from_buffer_copy(_forward_template(layouts, softmax_scale, softcap, lse_stride))
    maps = plan.maps
    params = plan.ws_params(forward, schedule) if maps else forward
    base = type(params).forward.offset if maps else 0
    inputs = base + _FwdParams.inputs.offset
    pointers = [(inputs + getattr(_Inputs, name).offset, native.given(index))
                for index, name in enumerate(("q", "k", "v", "mask", "bias")) if layouts[index] is not None]
    pointers += [(base + _FwdParams.out.offset, native.allocated(0)), (base + _FwdParams.lse.offset, native.allocated(1))]
    descriptors = [(getattr(type(params), field).offset, operand) for field, operand, *_ in maps]
    return bytes(params), pointers, descriptors


class ForwardPlan:
    """A forward call's launch for one signature (`dmattn_bench.plan`): `plan(q, k, v, mask, bias,
    out, lse)` launches into given outputs, `plan.allocate_and_run(...)` allocates them first (the
    runtime's call). The mask and bias come as the caller passed them (any dims up to 4).

    A run of `allocate_and_run` from Python builds the program of the later ones
    (`dmattn_bench.native`): the same two allocations and one launch in one C++ call, the
    parameters copied from the signature's template with the call's addresses and, for the
    warp-specialized forward, its tensor maps filled in (encoded again only for new addresses).
    """

    leaves_activity = False  # no tile activity for the backward (the Triton forward's schedule)

    def __init__(self, q, k, v, mask, bias, *, is_causal: bool, softmax_scale: float, softcap: float,
                 config: FwdConfig, out: torch.Tensor, lse: torch.Tensor):
        del q, k, v, mask, bias  # a launch's checks and variant are `_forward_launch`'s, per signature
        self.options = dict(is_causal=is_causal, softmax_scale=softmax_scale, softcap=softcap)
        self.config = config
        self.out_shape, self.out_dtype, self.lse_shape = tuple(out.shape), out.dtype, tuple(lse.shape)
        self.native: native.Program | None = None  # `allocate_and_run`'s, once a run built it
        self.native_tried = False

    def __call__(self, q, k, v, mask, bias, out, lse, activity=None) -> None:
        del activity
        attention_forward(q, k, v, as_4d(mask), as_4d(bias), config=self.config, out=out, lse=lse, **self.options)

    def native_program(self, keep_lse: bool) -> native.Program | None:
        """The program a call without gradient runs (lse is its own tensor either way)."""
        del keep_lse
        return self.native

    def allocate_and_run(self, q, k, v, mask, bias, keep_activity: bool, keep_lse: bool = True) -> tuple:
        """(out, lse, None) in new tensors (`keep_activity` and `keep_lse` change nothing here)."""
        del keep_activity, keep_lse
        stream = launch_stream()
        # the program launches on the current device's stream; on another, `_Launcher` switches
        if (self.native is not None and stream is not None and not LAUNCH_OBSERVERS
                and q.get_device() == torch.cuda.current_device()):
            return self.native(stream, q, k, v, mask, bias)
        out = torch.empty(self.out_shape, dtype=self.out_dtype, device=q.device)
        lse = torch.empty(self.lse_shape, dtype=torch.float32, device=q.device)
        self(q, k, v, mask, bias, out, lse)
        if stream is not None and not self.native_tried:
            self.native_tried = True
            self.native = self._native_program(q, k, v, as_4d(mask), as_4d(bias), out, lse)
        return out, lse, None

    def _native_program(self, q, k, v, mask, bias, out, lse) -> native.Program | None:
        layouts = tuple(_layout(t) for t in (q, k, v, mask, bias, out))
        options = self.options
        plan = _forward_launch(layouts, options["is_causal"], options["softcap"], self.config)
        grid, schedule = plan.launch_grid(q.device)
        template, pointers, descriptors = _native_parameters(layouts, options["softmax_scale"], options["softcap"],
                                                             lse.stride(), plan, schedule)
        encode = None
        if plan.maps:
            driver = _the_driver()

            def encode(inputs: tuple) -> list[bytes]:  # the program's inputs: the mask and bias as passed
                operands = (*inputs[:3], as_4d(inputs[3]), as_4d(inputs[4]))
                return [bytes(driver.tensor_map(operands[index], order, rows, line, swizzle))
                        for _, index, order, rows, line, swizzle in plan.maps]

        spec = native.structure_spec(plan.launcher.function(plan.name, plan.shared), grid,
                                     32 * self.config.num_warps, plan.shared, template, pointers, descriptors, encode)
        # the schedule's address is in the template: the program keeps it, whatever the cache drops
        owners = [plan.launcher] + ([schedule] if schedule is not None else [])
        return native.program_of_specs(q.device, 5, [(self.out_shape, self.out_dtype), (self.lse_shape, torch.float32)],
                                       [], [spec], (0, 1, -1), owners)


def has_broadcast_dim(t: torch.Tensor) -> bool:
    """Whether a dim of more than one element has stride 0 (an expanded tensor, such as the
    gradient of a mean over the query rows)."""
    return any(size > 1 and stride == 0 for size, stride in zip(t.shape, t.stride()))


def _dbias_layout(dbias: torch.Tensor, batch: int, num_heads: int, seqlen_q: int, seqlen_k: int):
    """Where the dK/dV kernel writes dBias: (shape, rows, in_place). The target is (B, H, Lq, Lk)
    for a bias with a query dim, else (B, H, 1, Lk) (each key's dS summed over its queries in the
    kernel); it is `dbias` itself when the shapes agree (in_place), else an fp32 buffer the
    launcher reduces into `dbias`."""
    rows = dbias.shape[2] != 1
    shape = (batch, num_heads, seqlen_q if rows else 1, seqlen_k)
    return shape, rows, tuple(dbias.shape) == shape and dbias.is_contiguous()


def attention_backward(dout, q, k, v, out, lse, mask, bias, *, is_causal: bool, softmax_scale: float, softcap: float,
                       config: BwdConfig, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor,
                       dbias: torch.Tensor | None, dlse: torch.Tensor | None = None) -> None:
    """Writes dq, dk, dv and, when given, dbias (the bias's own 4-D shape and dtype); `dlse`, a
    gradient reaching lse, as in the Triton launcher (`delta_with_lse_grad`)."""
    batch, seqlen_q, num_heads, head_dim = q.shape
    seqlen_k, num_heads_kv = k.shape[1], k.shape[2]
    group = num_heads // num_heads_kv
    _check_tensor(q)
    _check_call(config, q, k, mask, bias, is_causal, softcap, dbias is not None)
    arch = arch_of(q.device)
    reason = arch_reason(config, head_dim, arch)
    if reason:
        raise ValueError(f"config: {reason}")
    source = backward_kernel(config, head_dim, arch)
    if source == "bwd_ws" and has_broadcast_dim(dout):
        dout = dout.contiguous()  # its tensor map takes no stride-0 dim: a copy of the incoming gradient
    for name, t in (("query", q), ("key", k), ("value", v), ("out", out), ("grad_out", dout), ("dq", dq),
                    ("dk", dk), ("dv", dv)):
        _check_aligned(name, t)
    layout = None if dbias is None else _dbias_layout(dbias, batch, num_heads, seqlen_q, seqlen_k)
    bias_dtype = bias.dtype if bias is not None else None
    staging = (0, NOT_STAGED, NOT_STAGED)
    if source == "bwd_ws":
        staging = _backward_staging(config, head_dim, mask is not None, bias_dtype, staged_tiles(mask, seqlen_q),
                                    staged_tiles(bias, seqlen_q))
    target_kind = None if layout is None else (layout[1], dbias.dtype if layout[2] else torch.float32)
    # a TMA store needs the target in place (`_dbias_layout`), on 16-byte boundaries
    target_allows = layout is not None and layout[2] and staged_tiles(dbias, seqlen_q) == TILES_OF_ROWS
    flags = backward_variant(config, head_dim, q.dtype, bias_dtype, arch=arch, is_causal=is_causal,
                             has_mask=mask is not None, softcap=softcap, group=group, dbias=target_kind,
                             mask_tiles=staging[1], bias_tiles=staging[2], dbias_tma=target_allows)
    launcher = _Launcher(source, q.device, flags)
    if is_compile_only():
        return
    stored_by_tma = source == "bwd_ws" and _stores_dbias_by_tma(target_kind, q.dtype, softcap, target_allows)
    target = None
    if stored_by_tma:  # the warp-specialized kernel writes every element, the zeros the causal rule skips too
        target = dbias
    elif layout is not None:  # zeroed: tiles the causal rule skips are never written
        shape, _, in_place = layout
        target = dbias.zero_() if in_place else torch.zeros(shape, dtype=torch.float32, device=dbias.device)
    delta = torch.empty((batch, num_heads, seqlen_q), dtype=torch.float32, device=q.device)
    if group > 1:  # each query head's share, summed per group below (fixed order: deterministic)
        dk_share = torch.empty((batch, seqlen_k, num_heads, head_dim), dtype=torch.float32, device=q.device)
        dv_share = torch.empty_like(dk_share)
    else:
        dk_share, dv_share = dk, dv
    params = _BwdParams(
        _inputs(q, k, v, mask, bias, softmax_scale, softcap), out.data_ptr(), dout.data_ptr(), lse.data_ptr(),
        delta.data_ptr(), dq.data_ptr(), dk_share.data_ptr(), dv_share.data_ptr(),
        target.data_ptr() if target is not None else 0, out.stride()[:3], dout.stride()[:3], dq.stride()[:3],
        dk_share.stride()[:3], dv_share.stride()[:3], lse.stride(), delta.stride(),
        zero_size1_strides(target),
    )
    heads = batch * num_heads
    shared = backward_shared_bytes(config, head_dim, arch, staging[1], staging[2])
    if source == "bwd_ws":
        _run_warp_specialized_backward(launcher, config, params, shared["ws"], q, k, v, dout, delta, dlse, lse,
                                       is_causal, mask if staging[1] == TILES_OF_ROWS else None,
                                       bias if staging[2] == TILES_OF_ROWS else None,
                                       target if stored_by_tma else None)
    else:
        launcher(b"dmattn_bwd_delta_kernel", (triton.cdiv(seqlen_q, delta_rows_per_block(head_dim, config.num_warps)),
                                              heads), config.num_warps, 0, params)
        delta_with_lse_grad(delta, dlse, lse)  # on the launches' stream (the current one), between them
        launcher(b"dmattn_bwd_dkdv_kernel", (heads, triton.cdiv(seqlen_k, config.block_n)), config.num_warps,
                 shared["dkdv"], params)
        launcher(b"dmattn_bwd_dq_kernel", (heads, triton.cdiv(seqlen_q, config.block_m_dq)), config.num_warps,
                 shared["dq"], params)
    if group > 1:
        dk.copy_(dk_share.unflatten(2, (num_heads_kv, group)).sum(3))
        dv.copy_(dv_share.unflatten(2, (num_heads_kv, group)).sum(3))
    if target is not None and target is not dbias:
        _finish_dbias(target, dbias)


def delta_rows_per_block(head_dim: int, num_warps: int) -> int:
    """Query rows of one CTA of the backward's delta kernels (bwd_steps.cuh: DELTA_ROWS_PER_BLOCK):
    a lane per 16-byte chunk of a row, lane groups a power of two, DELTA_UNROLL rows a group."""
    chunks = padded_head_dim(head_dim) // 8
    return num_warps * 32 // (1 << (chunks - 1).bit_length()) * DELTA_UNROLL


def unvisited_query_tiles(seqlen_q: int, seqlen_k: int, block_m: int, is_causal: bool) -> int:
    """The leading query tiles of the warp-specialized backward that no key block visits: under
    the causal rule, tiles whose rows all come before the first row that sees a key (row
    Lq - Lk), which exist when Lq - Lk >= block_m. Their dQ sums are never stored."""
    return max(0, seqlen_q - seqlen_k) // block_m if is_causal else 0


def _run_warp_specialized_backward(launcher: _Launcher, config: BwdConfig, params: _BwdParams, shared: int, q, k, v,
                                   dout, delta, dlse, lse, is_causal: bool, staged_mask, staged_bias,
                                   dbias_target) -> None:
    """flash_bwd_ws.cu's three launches: delta (and the dQ counters zeroed), the kernel, dQ from
    its summed shares. The sums are not zeroed: each tile's first share is stored, not added;
    only the tiles no key block visits (`unvisited_query_tiles`: rows that see no key, whose dQ
    is 0) are zeroed here. `staged_mask` and `staged_bias` are the operands staged as tiles of
    rows, `dbias_target` the dBias the kernel stores by TMA (each None where not)."""
    batch, seqlen_q, num_heads, head_dim = q.shape
    heads, m_tiles = batch * num_heads, triton.cdiv(seqlen_q, config.block_m)
    padded = padded_head_dim(head_dim)
    dq_sum = torch.empty((heads, m_tiles, config.block_m * padded), dtype=torch.float32, device=q.device)
    dq_sum[:, :unvisited_query_tiles(seqlen_q, k.shape[1], config.block_m, is_causal)].zero_()
    dq_counter = torch.empty((heads, m_tiles), dtype=torch.int32, device=q.device)
    driver, rows_of = _the_driver(), (3, 1, 2, 0)  # (B, L, H, D) as (D, L, H, B)
    maps = {name: driver.tensor_map(t, rows_of, rows, _TMA_LINE, _TMA_LINE)
            for name, t, rows in (("q_map", q, config.block_m), ("k_map", k, config.block_n),
                                  ("v_map", v, config.block_n), ("do_map", dout, config.block_m))}
    keys_of, mask_line = (3, 2, 1, 0), min(config.block_n, _TMA_LINE)  # (B, H, Lq, Lk) as (Lk, Lq, H, B)
    if staged_mask is not None:  # a box of block_n bytes a row
        maps["mask_map"] = driver.tensor_map(staged_mask, keys_of, config.block_m, mask_line, mask_line)
    for name, t in (("bias_map", staged_bias), ("dbias_map", dbias_target)):  # boxes of 128-byte lines
        if t is not None:
            maps[name] = driver.tensor_map(t, keys_of, config.block_m, _TMA_LINE, _TMA_LINE)
    reread_bytes = seqlen_q * padded * (2 * q.element_size() + 4)  # Q, dO and the fp32 dQ sums of a slice
    ws_params = _BwdWsParams(backward=params, dq_sum=dq_sum.data_ptr(), dq_counter=dq_counter.data_ptr(),
                             section_slices=section_slices(heads, reread_bytes), **maps)
    delta_rows = delta_rows_per_block(head_dim, config.num_warps)
    launcher(b"dmattn_bwd_ws_delta_kernel", (triton.cdiv(seqlen_q, delta_rows), heads), config.num_warps, 0, ws_params)
    delta_with_lse_grad(delta, dlse, lse)
    launcher(b"dmattn_bwd_ws_kernel", (heads, triton.cdiv(k.shape[1], config.block_n)), config.num_warps,
             shared, ws_params)
    pairs = triton.cdiv(seqlen_q, DQ_CAST_ROWS) * padded // 2  # a thread per two columns of DQ_CAST_ROWS rows
    launcher(b"dmattn_bwd_ws_dq_kernel", (triton.cdiv(pairs, 32 * config.num_warps), heads), config.num_warps, 0,
             ws_params)
