"""The kernels' parameter blocks as ctypes structures, field for field, and their builders.

A launch passes one structure by address (`driver.Driver.launch`); a native program copies a
signature's bytes and fills in a call's addresses (`forward._native_parameters`). The CUDA
structures each one mirrors name it in a comment.
"""

from __future__ import annotations

import ctypes

import torch

from dmattn_kernels.runtime.operands import broadcast_layout

TENSOR_MAP_ALIGN = 128  # bytes: a CUtensorMap kernel parameter's alignment, so a block of them pads to it


def _pointers(*names: str) -> list[tuple[str, type]]:
    return [(name, ctypes.c_void_p) for name in names]


def _strides(*names: str, count: int = 3) -> list[tuple[str, type]]:
    return [(name, ctypes.c_int64 * count) for name in names]


def _padded(fields: list[tuple[str, type]]) -> list[tuple[str, type]]:
    """`fields`, then the padding that makes their structure a multiple of TENSOR_MAP_ALIGN bytes
    (a parameter block that holds tensor maps)."""
    class Fields(ctypes.Structure):
        _fields_ = fields

    return fields + [("padding", ctypes.c_char * (-ctypes.sizeof(Fields) % TENSOR_MAP_ALIGN))]


class Inputs(ctypes.Structure):
    """common.cuh's Inputs, field for field."""

    _fields_ = (_pointers("q", "k", "v", "mask", "bias") + _strides("q_stride", "k_stride", "v_stride")
                + _strides("mask_stride", "bias_stride", count=4)
                + [(name, ctypes.c_int) for name in ("num_heads", "seqlen_q", "seqlen_k", "group", "mask_head_div",
                                                     "bias_head_div")]
                + [("softmax_scale", ctypes.c_float), ("softcap", ctypes.c_float)])


class WindowedInputs(Inputs):
    """common.cuh's Inputs built with HAS_WINDOW: `Inputs`' fields, then the window's sides."""

    _fields_ = [("window_left", ctypes.c_int), ("window_right", ctypes.c_int)]


class FwdParams(ctypes.Structure):
    """flash_fwd.cu's FwdParams, field for field."""

    _fields_ = [("inputs", Inputs)] + _pointers("out", "lse") + _strides("out_stride", "lse_stride")


class WindowedFwdParams(ctypes.Structure):
    """fwd_steps.cuh's FwdParams built with HAS_WINDOW (its Inputs are `WindowedInputs`)."""

    _fields_ = [("inputs", WindowedInputs)] + FwdParams._fields_[1:]


class TensorMap(ctypes.Structure):
    """cuda.h's CUtensorMap: 128 opaque bytes the driver fills (128-byte aligned in the kernel's
    parameters, which `WsParams` keeps by putting the maps first)."""

    _fields_ = [("opaque", ctypes.c_uint64 * 16)]


_MAPS = ("q_map", "k_map", "v_map", "mask_map", "bias_map")


class WsParams(ctypes.Structure):
    """flash_fwd_ws.cu's WsParams, field for field, padded to its 128-byte multiple."""

    _fields_ = _padded([(name, TensorMap) for name in _MAPS]
                       + [("forward", FwdParams), ("section_slices", ctypes.c_int)])


class WindowedWsParams(ctypes.Structure):
    """flash_fwd_ws.cu's WsParams built with HAS_WINDOW (its FwdParams are `WindowedFwdParams`)."""

    _fields_ = _padded([(name, TensorMap) for name in _MAPS]
                       + [("forward", WindowedFwdParams), ("section_slices", ctypes.c_int)])


_PERSISTENT_FIELDS = [(name, ctypes.c_int) for name in ("item_columns", "item_rows")] + [("schedule", ctypes.c_void_p)]


class PersistentWsParams(ctypes.Structure):
    """flash_fwd_ws.cu's WsParams built with FWD_PERSISTENT (FwdConfig.persistent): `WsParams`'
    fields, then the work items and the schedule, padded to its 128-byte multiple."""

    _fields_ = _padded(WsParams._fields_[:-1] + _PERSISTENT_FIELDS)


class WindowedPersistentWsParams(ctypes.Structure):
    """flash_fwd_ws.cu's WsParams built with FWD_PERSISTENT and HAS_WINDOW: `WindowedWsParams`'
    fields, then the work items and the schedule."""

    _fields_ = _padded(WindowedWsParams._fields_[:-1] + _PERSISTENT_FIELDS)


_SEQUENCE_POINTERS = ("cu_seqlens_q", "cu_seqlens_k", "seqused_k")
# flash_fwd_ws.cu's WsParams built with PACKED: after the rest, the sequences' offsets and lengths
# and the persistent launch's item counter
_PACKED_FIELDS = (_pointers(*_SEQUENCE_POINTERS) + [(name, ctypes.c_int) for name in ("max_seqlen_q", "max_seqlen_k")]
                  + _pointers("item_counter"))


def _packed_ws_params(base: type) -> type:
    """`base`'s WsParams fields, then `_PACKED_FIELDS`, padded to its 128-byte multiple."""
    return type(f"Packed{base.__name__}", (ctypes.Structure,), {
        "_fields_": _padded(base._fields_[:-1] + _PACKED_FIELDS),
        "__doc__": f"flash_fwd_ws.cu's WsParams built as `{base.__name__}` and with PACKED."})


def _out_map_ws_params(base: type) -> type:
    """`base`'s WsParams fields (padded: the map that follows keeps its 128-byte alignment), then
    the out map of FWD_TMA_STORE."""
    return type(f"OutMap{base.__name__}", (ctypes.Structure,), {
        "_fields_": base._fields_ + [("o_map", TensorMap)],
        "__doc__": f"flash_fwd_ws.cu's WsParams built as `{base.__name__}` and with FWD_TMA_STORE."})


# by (windowed, persistent, packed, tma_store); packed sequences take no TMA store of out
_WS_PARAMS = {(windowed, persistent, False, False): base for (windowed, persistent), base in (
    ((False, False), WsParams), ((True, False), WindowedWsParams), ((False, True), PersistentWsParams),
    ((True, True), WindowedPersistentWsParams))}
_WS_PARAMS.update({(windowed, persistent, True, False): _packed_ws_params(base)
                   for (windowed, persistent, _, _), base in list(_WS_PARAMS.items())})
_WS_PARAMS.update({(windowed, persistent, False, True): _out_map_ws_params(base)
                   for (windowed, persistent, packed, _), base in list(_WS_PARAMS.items()) if not packed})
PackedWsParams = _WS_PARAMS[False, False, True, False]
WindowedPackedWsParams = _WS_PARAMS[True, False, True, False]


def ws_params_type(windowed: bool, persistent: bool, packed: bool, tma_store: bool = False) -> type:
    """The WsParams structure of a warp-specialized forward variant."""
    return _WS_PARAMS[windowed, persistent, packed, tma_store]


class BwdParams(ctypes.Structure):
    """bwd_steps.cuh's BwdParams (both backwards'), field for field."""

    _fields_ = ([("inputs", Inputs)] + _pointers("out", "dout", "lse", "delta", "dq", "dk", "dv", "dbias")
                + _strides("out_stride", "dout_stride", "dq_stride", "dk_stride", "dv_stride", "lse_stride",
                           "delta_stride")
                + _strides("dbias_stride", count=4))


class WindowedBwdParams(ctypes.Structure):
    """bwd_steps.cuh's BwdParams built with HAS_WINDOW (its Inputs are `WindowedInputs`)."""

    _fields_ = [("inputs", WindowedInputs)] + BwdParams._fields_[1:]


_BWD_MAPS = ("q_map", "k_map", "v_map", "do_map", "mask_map", "bias_map", "dbias_map")


def _bwd_ws_fields(backward: type, packed: bool) -> list[tuple[str, type]]:
    """flash_bwd_ws.cu's BwdWsParams with `backward` as its BwdParams and, built with PACKED, the
    sequences' fields after the rest, padded to its 128-byte multiple."""
    sequences = (_pointers(*_SEQUENCE_POINTERS)
                 + [(name, ctypes.c_int) for name in ("max_seqlen_q", "max_seqlen_k", "head_tiles")])
    return _padded([(name, TensorMap) for name in _BWD_MAPS] + [("backward", backward)]
                   + _pointers("dq_sum", "dq_counter") + [("section_slices", ctypes.c_int)]
                   + (sequences if packed else []))


class BwdWsParams(ctypes.Structure):
    """flash_bwd_ws.cu's BwdWsParams, field for field, padded to its 128-byte multiple."""

    _fields_ = _bwd_ws_fields(BwdParams, packed=False)


class WindowedBwdWsParams(ctypes.Structure):
    """flash_bwd_ws.cu's BwdWsParams built with HAS_WINDOW (its BwdParams are `WindowedBwdParams`)."""

    _fields_ = _bwd_ws_fields(WindowedBwdParams, packed=False)


class PackedBwdWsParams(ctypes.Structure):
    """flash_bwd_ws.cu's BwdWsParams built with PACKED: the sequences' offsets and lengths after
    `BwdWsParams`' fields."""

    _fields_ = _bwd_ws_fields(BwdParams, packed=True)


class WindowedPackedBwdWsParams(ctypes.Structure):
    """flash_bwd_ws.cu's BwdWsParams built with HAS_WINDOW and PACKED."""

    _fields_ = _bwd_ws_fields(WindowedBwdParams, packed=True)


def bwd_ws_params_type(windowed: bool, packed: bool) -> type:
    """The BwdWsParams structure of a warp-specialized backward variant."""
    return {(False, False): BwdWsParams, (True, False): WindowedBwdWsParams, (False, True): PackedBwdWsParams,
            (True, True): WindowedPackedBwdWsParams}[windowed, packed]


def with_window(template: Inputs, window_sides: tuple[int, int]) -> WindowedInputs:
    """`template`'s fields, then a window's (left, right) sides (`configs.window_bounds`)."""
    extended = WindowedInputs.from_buffer_copy(bytes(template) + bytes(ctypes.sizeof(WindowedInputs)
                                                                       - ctypes.sizeof(Inputs)))
    extended.window_left, extended.window_right = window_sides
    return extended


def address(t: torch.Tensor | None) -> int:
    return t.data_ptr() if t is not None else 0


def inputs(q, k, v, mask, bias, softmax_scale: float, softcap: float, address=address) -> Inputs:
    """The Inputs of a call's tensors (`address`: where each is; 0 everywhere for a template). The
    mask and bias as the caller passed them (up to 4 dims): their strides and head divisors are
    the operand normaliser's (`operands.broadcast_layout`)."""
    num_heads = q.shape[2]
    group = num_heads // k.shape[2]
    if mask is not None and mask.dtype == torch.bool:
        mask = mask.view(torch.uint8)  # same itemsize: a reinterpretation, not a copy
    mask_strides, mask_head_div = broadcast_layout(None if mask is None else (mask.shape, mask.stride()),
                                                   num_heads, group)
    bias_strides, bias_head_div = broadcast_layout(None if bias is None else (bias.shape, bias.stride()),
                                                   num_heads, group)
    return Inputs(
        address(q), address(k), address(v), address(mask), address(bias), q.stride()[:3], k.stride()[:3],
        v.stride()[:3], mask_strides, bias_strides, num_heads, q.shape[1], k.shape[1], group, mask_head_div,
        bias_head_div, softmax_scale, softcap if softcap > 0 else 1.0,
    )
