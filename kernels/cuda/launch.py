"""Launchers for the CUDA kernels: explicit configs in, preallocated outputs filled.

The same interface as `dmattn_kernels.triton` (inputs already checked by `dmattn_bench.api`).
Cubins come from `build.py` and are launched through the CUDA driver API over ctypes
(libcuda.so.1, which the NVIDIA driver installs and torch already uses): no extra package and
no compiled extension. Only the forward exists so far.
"""

from __future__ import annotations

import ctypes
import threading
from functools import lru_cache

import torch

from dmattn_bench.space import AttentionShape, FwdConfig
from dmattn_kernels.cuda.build import build, defines

MAX_HEAD_DIM = 256
WARP_CHOICES = (2, 4, 8)  # a warp owns 16 query rows: block_m = 16 * num_warps
BLOCK_N_CHOICES = (16, 32, 64, 128)
MAX_STAGES = 4
KERNEL_NAME = b"dmattn_fwd_kernel"
SHARED_PAD = 8  # elements per shared row beyond the padded head dim (flash_fwd.cu: ROW)
_CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
_CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN = 97


class OutOfResources(RuntimeError):
    """The config needs more shared memory than this GPU gives a block (a trial's `unsupported`)."""


class _FwdParams(ctypes.Structure):
    """flash_fwd.cu's FwdParams, field for field."""

    _fields_ = [(name, ctypes.c_void_p) for name in ("q", "k", "v", "mask", "bias", "out", "lse")] + [
        ("q_stride", ctypes.c_int64 * 3), ("k_stride", ctypes.c_int64 * 3), ("v_stride", ctypes.c_int64 * 3),
        ("out_stride", ctypes.c_int64 * 3), ("mask_stride", ctypes.c_int64 * 4), ("bias_stride", ctypes.c_int64 * 4),
        ("lse_stride", ctypes.c_int64 * 3),
    ] + [(name, ctypes.c_int) for name in ("num_heads", "seqlen_q", "seqlen_k", "group", "mask_head_div",
                                          "bias_head_div")] + [
        ("softmax_scale", ctypes.c_float), ("softcap", ctypes.c_float),
    ]


class _Driver:
    """The few driver entry points the launcher needs, loaded once."""

    def __init__(self):
        self.lib = ctypes.CDLL("libcuda.so.1")
        self.functions: dict[tuple[int, str], tuple[ctypes.c_void_p, int]] = {}
        self.lock = threading.Lock()

    def check(self, result: int, what: str) -> None:
        if result != 0:
            name = ctypes.c_char_p()
            self.lib.cuGetErrorName(result, ctypes.byref(name))
            raise RuntimeError(f"CUDA error in {what}: {name.value.decode() if name.value else result}")

    def function(self, device: int, cubin: str, shared_bytes: int) -> ctypes.c_void_p:
        """The kernel of `cubin` loaded in `device`'s primary context, allowed `shared_bytes`."""
        with self.lock:
            entry = self.functions.get((device, cubin))
            if entry is None:
                module, function = ctypes.c_void_p(), ctypes.c_void_p()
                image = open(cubin, "rb").read()
                self.check(self.lib.cuModuleLoadData(ctypes.byref(module), image), "cuModuleLoadData")
                self.check(self.lib.cuModuleGetFunction(ctypes.byref(function), module, KERNEL_NAME),
                           "cuModuleGetFunction")
                entry = self.functions[(device, cubin)] = (function, 0)
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
                self.functions[(device, cubin)] = (function, shared_bytes)
            return function

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
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm{major}{minor}"


def padded_head_dim(head_dim: int) -> int:
    return (head_dim + 15) // 16 * 16


def forward_shared_bytes(config: FwdConfig, head_dim: int) -> int:
    """flash_fwd.cu's dynamic shared memory: Q, and K and V rings of num_stages tiles, 2-byte
    elements, rows padded."""
    rows = config.block_m + 2 * config.num_stages * config.block_n
    return rows * (padded_head_dim(head_dim) + SHARED_PAD) * 2


def is_supported(config, shape: AttentionShape) -> str | None:
    """The reason `config` cannot run `shape` on this backend, or None when it can."""
    if not isinstance(config, FwdConfig):
        return "the cuda backend has no backward kernel yet"
    if shape.head_dim > MAX_HEAD_DIM or shape.head_dim % 8:
        return f"head_dim={shape.head_dim} is not a multiple of 8 in [8, {MAX_HEAD_DIM}]"
    if config.num_warps not in WARP_CHOICES:
        return f"num_warps={config.num_warps} is not one of {WARP_CHOICES}"
    if config.block_m != 16 * config.num_warps:
        return f"block_m={config.block_m} is not 16 x num_warps={config.num_warps} (a warp owns 16 rows)"
    if config.block_n not in BLOCK_N_CHOICES:
        return f"block_n={config.block_n} is not one of {BLOCK_N_CHOICES}"
    if not 1 <= config.num_stages <= MAX_STAGES:
        return f"num_stages={config.num_stages} is not in [1, {MAX_STAGES}]"
    return None


def _strides(t: torch.Tensor | None, count: int) -> tuple[int, ...]:
    if t is None:
        return (0,) * count
    return tuple(0 if size == 1 else stride for size, stride in zip(t.shape, t.stride()))[:count]


def _check_aligned(name: str, t: torch.Tensor) -> None:
    # cp.async moves 16-byte chunks: each row of the head dim must start on a 16-byte boundary
    if t.data_ptr() % 16 or any(stride % 8 for stride in t.stride()[:3]):
        raise ValueError(f"{name}: the cuda backend needs rows on 16-byte boundaries, got strides "
                         f"{tuple(t.stride())} at offset {t.data_ptr() % 16}")


def variant(config: FwdConfig, head_dim: int, dtype: torch.dtype, bias_dtype: torch.dtype | None, *,
            is_causal: bool, has_mask: bool, softcap: float) -> tuple[str, ...]:
    """The -D list of the forward variant a call needs."""
    return defines(head_dim, config.block_n, config.num_warps, config.num_stages,
                   "bf16" if dtype == torch.bfloat16 else "fp16", bias_dtype == torch.float32, is_causal, has_mask,
                   bias_dtype is not None, softcap > 0)


def attention_forward(q, k, v, mask, bias, *, is_causal: bool, softmax_scale: float, softcap: float,
                      config: FwdConfig, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Writes out (B, Lq, H, D) and lse (B, H, Lq) fp32 for one forward call."""
    batch, seqlen_q, num_heads, head_dim = q.shape
    seqlen_k, num_heads_kv = k.shape[1], k.shape[2]
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"query: the cuda backend runs fp16 and bf16, got {q.dtype}")
    reason = is_supported(config, AttentionShape(batch=batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
                                                 num_heads=num_heads, num_heads_kv=num_heads_kv, head_dim=head_dim,
                                                 is_causal=is_causal, has_mask=mask is not None,
                                                 has_bias=bias is not None, bias_requires_grad=False,
                                                 softcap=softcap))
    if reason:
        raise ValueError(f"config: {reason}")
    for name, t in (("query", q), ("key", k), ("value", v), ("out", out)):
        _check_aligned(name, t)
    group = num_heads // num_heads_kv
    if mask is not None and mask.dtype == torch.bool:
        mask = mask.view(torch.uint8)
    device = q.device.index if q.device.index is not None else torch.cuda.current_device()
    flags = variant(config, head_dim, q.dtype, bias.dtype if bias is not None else None, is_causal=is_causal,
                    has_mask=mask is not None, softcap=softcap)
    cubin = _built("fwd", arch_of(q.device), flags)
    shared_bytes = forward_shared_bytes(config, head_dim)
    driver = _the_driver()

    def head_divisor(t):
        return group if t is not None and t.shape[1] not in (num_heads, 1) else 1

    params = _FwdParams(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), mask.data_ptr() if mask is not None else 0,
        bias.data_ptr() if bias is not None else 0, out.data_ptr(), lse.data_ptr(),
        (ctypes.c_int64 * 3)(*q.stride()[:3]), (ctypes.c_int64 * 3)(*k.stride()[:3]),
        (ctypes.c_int64 * 3)(*v.stride()[:3]), (ctypes.c_int64 * 3)(*out.stride()[:3]),
        (ctypes.c_int64 * 4)(*_strides(mask, 4)), (ctypes.c_int64 * 4)(*_strides(bias, 4)),
        (ctypes.c_int64 * 3)(*lse.stride()), num_heads, seqlen_q, seqlen_k, group, head_divisor(mask),
        head_divisor(bias), softmax_scale, softcap if softcap > 0 else 1.0,
    )
    grid = ((seqlen_q + config.block_m - 1) // config.block_m, batch * num_heads)
    with torch.cuda.device(device):  # the runtime makes the device's primary context current
        function = driver.function(device, str(cubin), shared_bytes)
        driver.launch(function, grid, 32 * config.num_warps, shared_bytes,
                      torch.cuda.current_stream(device).cuda_stream, params)
