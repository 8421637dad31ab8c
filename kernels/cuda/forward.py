"""The CUDA forward's launch: a signature's checks, variant, cubin and geometry planned once
(`_signature_launch`), a call's parameters filled from the signature's template, and the plan
(`ForwardPlan`) that builds the native program running later calls in one C++ call.

The warp-specialized forward (flash_fwd_ws.cu) also gets its tensor maps, the head slices it
runs at once (`section_slices`) and, launched persistent, its work items' schedule
(`persistent_schedule`). A sliding window (FlashAttention's `window_size`) runs in its overlapped
kernel (`variants.window_reason`), its sides in the call's parameters (and, launched persistent, in
the schedule's item costs). So do packed sequences (`configs.Packing`): their items are sequences x
heads by the longest sequence's query blocks, each call passes the sequences' prefix sums and,
launched persistent, a zeroed item counter in place of a schedule (the lengths are on the device).
"""

from __future__ import annotations

import ctypes
import heapq
import itertools
from functools import lru_cache
from typing import NamedTuple

import torch
import triton

from dmattn_kernels import target
from dmattn_kernels.configs import FwdConfig, Packing, window_bounds
from dmattn_kernels.cuda.driver import KEYS_OF, ROWS_OF, TMA_LINE, Launcher, arch_of, the_driver
from dmattn_kernels.cuda.params import (FwdParams, Inputs, TensorMap, WindowedFwdParams, address, inputs,
                                        with_window, ws_params_type)
from dmattn_kernels.cuda.rules import (GROUP_ROWS, check_arch, check_config, check_query, check_rows, forward_kernel,
                                       padded_head_dim)
from dmattn_kernels.cuda.shared_memory import NOT_STAGED, TILES_OF_KEYS, TILES_OF_ROWS, forward_shared_bytes
from dmattn_kernels.cuda.variants import backward_packed_reason, staged_layout, staging, variant
from dmattn_kernels.runtime import launch_context, native
from dmattn_kernels.runtime.launch_context import is_compile_only, launch_stream
from dmattn_kernels.runtime.operands import padded

# what the head slices a warp-specialized kernel runs at once re-read from L2 (`section_slices`)
L2_SECTION_BYTES = 32 << 20
# A work item's fixed cost in a persistent forward's schedule (`persistent_schedule`), in key tiles:
# its Q load and its rows' store
ITEM_TILES = 1


class _ForwardLaunch(NamedTuple):
    """What every forward call of one signature launches (`_forward_launch`)."""

    launcher: Launcher
    name: bytes
    grid: tuple[int, int]
    shared: int
    # the warp-specialized forward's tensor maps: (WsParams field, operand: 0 q, 1 k, 2 v, 3
    # mask, 4 bias, 5 out; dims order, box rows, box line bytes, swizzle)
    maps: tuple[tuple[str, int, tuple[int, int, int, int], int, int, int], ...]
    section_slices: int = 0  # the warp-specialized forward's launch order (`section_slices`; flash_fwd.cu has none)
    items: tuple[int, int] = (0, 0)  # the warp-specialized forward's work items: head slices x query blocks
    tiles: tuple[int, ...] = ()  # its query blocks' key tiles where it launches persistent (FwdConfig.persistent)
    windowed: bool = False  # built with HAS_WINDOW: its parameters are the Windowed structures
    packed: bool = False  # built with PACKED: its parameters take the sequences' (`ws_params`)
    persistent: bool = False  # built with FWD_PERSISTENT: a CTA per SM walks items
    tma_store: bool = False  # built with FWD_TMA_STORE: its parameters end with out's map

    def launch_grid(self, device: torch.device) -> tuple[tuple[int, int], torch.Tensor | None]:
        """The grid on `device`, and a persistent launch's schedule (`persistent_schedule`; a packed
        launch's CTAs take items from a counter instead)."""
        if not self.persistent:
            return self.grid, None
        if self.packed:
            return (min(_sm_count(device), self.items[0] * self.items[1]), 1), None
        return _persistent_launch(device, self.items, self.section_slices, self.tiles)

    def ws_params(self, forward: FwdParams, schedule: torch.Tensor | None, sequences: dict | None = None,
                  **maps) -> ctypes.Structure:
        """The warp-specialized forward's parameters around a call's FwdParams (`params.ws_params_type`):
        with a persistent launch's schedule, or a packed call's `sequences` (`sequence_fields`)."""
        fields = dict(forward=forward, section_slices=self.section_slices, **maps)
        if self.persistent:
            fields.update(item_columns=self.items[0], item_rows=self.items[1], schedule=address(schedule))
        if self.packed:
            fields.update(sequences)
        return ws_params_type(self.windowed, self.persistent, self.packed, self.tma_store)(**fields)

    def tensor_maps(self, operands: tuple) -> dict[str, TensorMap]:
        """A call's tensor maps by `WsParams` field, of its operands (q, k, v, mask, bias, out)."""
        driver = the_driver()
        return {field: driver.tensor_map(operands[index], order, rows, line, swizzle)
                for field, index, order, rows, line, swizzle in self.maps}


@lru_cache(maxsize=16)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


@lru_cache(maxsize=256)
def _persistent_launch(device: torch.device, items: tuple[int, int], sections: int,
                       tiles: tuple[int, ...]) -> tuple[tuple[int, int], torch.Tensor]:
    """A persistent forward's grid (a CTA per SM, at most one per item) and schedule on `device`,
    made on the signature's first launch (a plan may be built for a GPU that is not here)."""
    ctas = min(_sm_count(device), items[0] * items[1])
    schedule = persistent_schedule(items, sections, list(tiles), ctas)
    return (ctas, 1), torch.tensor(schedule, dtype=torch.int32, device=device)


def _layout(t: torch.Tensor | None) -> tuple | None:
    """What of a tensor decides a forward's checks, variant and launch: all but its data (and
    its address modulo 16: cp.async and TMA need 16-byte boundaries), 4-D (a mask or bias of
    fewer dims as the view it broadcasts as: `operands.padded`)."""
    if t is None:
        return None
    shape, strides = padded(t.shape, t.stride())
    return shape, strides, t.dtype, t.device, t.data_ptr() % 16


def _meta_tensors(layouts: tuple) -> list[torch.Tensor | None]:
    """Data-less tensors of the `_layout`s of a signature (None stays None)."""
    return [None if layout is None else torch.empty_strided(layout[0], layout[1], dtype=layout[2], device="meta")
            for layout in layouts]


def _forward_launch(layouts: tuple, is_causal: bool, softcap: float, config: FwdConfig,
                    window_sides: tuple[int, int] | None = None, packing: Packing | None = None) -> _ForwardLaunch:
    """`_signature_launch` for the arch of the layouts' device (or the one planned for: then built
    anew, so that its launcher records its program for every plan, not for the first only)."""
    signature = (layouts, is_causal, softcap, config, arch_of(layouts[0][3]), window_sides, packing)
    if target.planned_arch() is not None:
        return _signature_launch.__wrapped__(*signature)
    return _signature_launch(*signature)


@lru_cache(maxsize=256)
def _signature_launch(layouts: tuple, is_causal: bool, softcap: float, config: FwdConfig, arch: str,
                      window_sides: tuple[int, int] | None = None, packing: Packing | None = None) -> _ForwardLaunch:
    """The checks, variant, cubin and launch geometry of a forward signature, done once: a call
    then only fills its pointers (and its tensor maps) and launches. `window_sides`: a sliding
    window's (left, right) as the kernel takes them (`kernel_window_sides`), None without one.
    `packing`: packed sequences (`configs.Packing`: the layouts are one batch row's)."""
    windowed, packed = window_sides is not None, packing is not None
    (q_shape, _, dtype, device, _), _, _, mask_layout, bias_layout, _ = layouts
    batch, seqlen_q, num_heads, head_dim = q_shape
    q, k, _, mask, bias, _ = _meta_tensors(layouts)
    check_config(config, q, k, mask, bias, is_causal, softcap, False)
    for name, layout in zip(("query", "key", "value", None, None, "out"), layouts):
        if name is not None:
            check_rows(name, layout[1], layout[4])
    check_arch(config, head_dim, arch)
    if packed:
        reason = backward_packed_reason(mask is not None and not packing.mask_per_key,
                                        bias is not None and not packing.bias_per_key)
        if reason:
            raise ValueError(reason)
    source = forward_kernel(config, head_dim, arch)

    def tiles(t, layout):  # `staged_tiles`, with the data's address from the signature
        if layout is None or layout[4]:
            return NOT_STAGED
        return staged_layout(layout[0], layout[1], t.element_size(), seqlen_q)

    bias_dtype = None if bias is None else bias.dtype
    mask_tiles, bias_tiles = tiles(mask, mask_layout), tiles(bias, bias_layout)
    flags = variant(config, head_dim, dtype, bias_dtype, arch=arch, is_causal=is_causal, has_mask=mask is not None,
                    softcap=softcap, mask_tiles=mask_tiles, bias_tiles=bias_tiles, window=windowed, packed=packed)
    launcher = Launcher(source, device, flags)
    grid = (batch * num_heads, triton.cdiv(seqlen_q, config.block_m))
    seqlen_k = k.shape[1]
    if packed:  # head slices: sequences x heads, each over the longest sequence's query blocks
        grid = (packing.num_sequences * num_heads, triton.cdiv(packing.max_seqlen_q, config.block_m))
        seqlen_k = packing.max_seqlen_k
    if source != "fwd_ws":
        return _ForwardLaunch(launcher, b"dmattn_fwd_kernel", grid, forward_shared_bytes(config, head_dim, arch), ())
    _, mask_tiles, bias_tiles = staging(config, head_dim, mask is not None, bias_dtype, mask_tiles, bias_tiles)
    maps = [("q_map", 0, ROWS_OF, config.block_m, TMA_LINE, TMA_LINE),
            ("k_map", 1, ROWS_OF, config.block_n, TMA_LINE, TMA_LINE),
            ("v_map", 2, ROWS_OF, config.block_n, TMA_LINE, TMA_LINE)]
    if config.tma_store:  # a consumer's rows of out, as q's rows load
        maps.append(("o_map", 5, ROWS_OF, GROUP_ROWS, TMA_LINE, TMA_LINE))
    # a mask box is block_n bytes wide, a bias box of rows one 128-byte line; a single row of keys
    # is one box, not swizzled
    mask_line = min(config.block_n, TMA_LINE)
    if mask_tiles == TILES_OF_ROWS:
        maps.append(("mask_map", 3, KEYS_OF, config.block_m, mask_line, mask_line))
    elif mask_tiles == TILES_OF_KEYS:
        maps.append(("mask_map", 3, KEYS_OF, 1, mask_line, 0))
    if bias_tiles == TILES_OF_ROWS:
        maps.append(("bias_map", 4, KEYS_OF, config.block_m, TMA_LINE, TMA_LINE))
    elif bias_tiles == TILES_OF_KEYS:
        maps.append(("bias_map", 4, KEYS_OF, 1, config.block_n * bias.element_size(), 0))
    shared = forward_shared_bytes(config, head_dim, arch, mask_tiles, bias_tiles)
    kv_bytes = 2 * seqlen_k * padded_head_dim(head_dim) * dtype.itemsize  # K and V, shared by a group's heads
    sections = section_slices(grid[0], kv_bytes, num_heads // k.shape[2])
    tiles = (tuple(_key_tiles(block, config, seqlen_q, k.shape[1], is_causal, window_sides) for block in range(grid[1]))
             if config.persistent and not packed else ())
    return _ForwardLaunch(launcher, b"dmattn_fwd_ws_kernel", grid, shared, tuple(maps), sections, grid, tiles,
                          windowed, packed, bool(config.persistent), bool(config.tma_store))


def _key_tiles(m_block: int, config: FwdConfig, seqlen_q: int, seqlen_k: int, is_causal: bool,
               window_sides: tuple[int, int] | None = None) -> int:
    """The key tiles query block `m_block` walks (common.cuh's KeyTiles: block, less first under a
    window of (left, right) sides)."""
    offset, row_end = seqlen_k - seqlen_q, (m_block + 1) * config.block_m
    keys = min(seqlen_k, max(0, row_end + offset)) if is_causal else seqlen_k
    if window_sides is None:
        return triton.cdiv(keys, config.block_n)
    left, right = window_sides
    keys = min(keys, max(0, row_end + offset + right))
    first = max(0, m_block * config.block_m + offset - left) // config.block_n
    return max(0, triton.cdiv(keys, config.block_n) - first)


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
    return min(slices, max(1, L2_SECTION_BYTES // max(1, reread_bytes)) * sharing)  # no keys: nothing re-read


@lru_cache(maxsize=256)
def _forward_template(layouts: tuple, softmax_scale: float, softcap: float, lse_stride: tuple,
                      window_sides: tuple[int, int] | None = None) -> bytes:
    """A forward signature's FwdParams with every address 0: a call copies it and fills in its
    tensors' addresses (`_fill_addresses`) instead of building the structure field by field.
    With `window_sides` (left, right: `window_bounds`), a `WindowedFwdParams`."""
    q, k, v, mask, bias, out = _meta_tensors(layouts)
    template = inputs(q, k, v, mask, bias, softmax_scale, softcap, address=lambda t: 0)
    if window_sides is None:
        return bytes(FwdParams(template, 0, 0, out.stride()[:3], lse_stride))
    return bytes(WindowedFwdParams(with_window(template, window_sides), 0, 0, out.stride()[:3], lse_stride))


def kernel_window_sides(window: tuple[int, int], is_causal: bool, q_shape: tuple,
                        seqlen_k: int) -> tuple[int, int] | None:
    """A call's window as the CUDA kernels take it (`window_bounds`: (left, right)), or None where
    it has none; both directions' launchers build their parameters from it."""
    has_window, left, right = window_bounds(window, is_causal, q_shape[1], seqlen_k)
    return (left, right) if has_window else None


def sequence_fields(packing: Packing, sequences: tuple) -> dict:
    """A packed call's fields of either warp-specialized kernel's parameters: the sequences'
    (cu_seqlens_q, cu_seqlens_k, seqused_k or None) addresses and the longest lengths."""
    cu_seqlens_q, cu_seqlens_k, seqused_k = sequences
    return dict(cu_seqlens_q=cu_seqlens_q.data_ptr(), cu_seqlens_k=cu_seqlens_k.data_ptr(),
                seqused_k=address(seqused_k), max_seqlen_q=packing.max_seqlen_q, max_seqlen_k=packing.max_seqlen_k)


def _fill_addresses(params: FwdParams, q, k, v, mask, bias, out, lse) -> None:
    inputs = params.inputs
    inputs.q, inputs.k, inputs.v = q.data_ptr(), k.data_ptr(), v.data_ptr()
    inputs.mask, inputs.bias = address(mask), address(bias)
    params.out, params.lse = out.data_ptr(), lse.data_ptr()


def attention_forward(q, k, v, mask, bias, *, is_causal: bool, softmax_scale: float, softcap: float,
                      config: FwdConfig, out: torch.Tensor, lse: torch.Tensor,
                      window: tuple[int, int] = (-1, -1), packing: Packing | None = None,
                      sequences: tuple = (None, None, None)) -> None:
    """Writes out (B, Lq, H, D) and lse (B, H, Lq) fp32 for one forward call; the mask and bias as
    the caller passed them (up to 4 dims, broadcastable as (B|1, H|Hkv|1, Lq|1, Lk|1)); `window`:
    FlashAttention's (left, right) sliding window. Packed sequences (`packing`, `configs.Packing`:
    the tensors are one batch row; `sequences`: (cu_seqlens_q, cu_seqlens_k, seqused_k or None))
    write only their sequences' rows, with a per-key mask and bias or none."""
    check_query(q)
    layouts = tuple(_layout(t) for t in (q, k, v, mask, bias, out))
    sides = kernel_window_sides(window, is_causal, q.shape, k.shape[1])
    plan = _forward_launch(layouts, is_causal, softcap, config, sides, packing)
    if is_compile_only() or 0 in plan.grid:  # packed: no sequence, or every one empty
        return
    params_type = FwdParams if sides is None else WindowedFwdParams
    params = params_type.from_buffer_copy(_forward_template(layouts, softmax_scale, softcap, lse.stride(), sides))
    _fill_addresses(params, q, k, v, mask, bias, out, lse)
    grid, schedule = plan.launch_grid(q.device)
    if plan.maps:
        packed = None
        if packing is not None:
            # persistent: the counter its CTAs take items from, zeroed
            counter = torch.zeros(1, dtype=torch.int32, device=q.device) if plan.persistent else None
            packed = dict(sequence_fields(packing, sequences), item_counter=address(counter))
        params = plan.ws_params(params, schedule, packed, **plan.tensor_maps((q, k, v, mask, bias, out)))
    plan.launcher(plan.name, grid, config.num_warps, plan.shared, params)


def _native_parameters(layouts: tuple, softmax_scale: float, softcap: float, lse_stride: tuple,
                       plan: _ForwardLaunch, schedule: torch.Tensor | None,
                       window_sides: tuple[int, int] | None = None) -> tuple[bytes, list, list]:
    """A forward signature's parameters for a native program (`dmattn_kernels.runtime.native.structure_spec`):
    the template (its FwdParams, inside a WsParams where the kernel reads tensor maps, with a
    persistent launch's schedule), the address slots (q, k, v, the mask and bias where given, then
    the program's out and lse allocations) and the map slots (`_ForwardLaunch.maps`' operands: the
    inputs, and out's allocation for `tma_store`)."""
    forward_type = FwdParams if window_sides is None else WindowedFwdParams
    forward = forward_type.from_buffer_copy(_forward_template(layouts, softmax_scale, softcap, lse_stride, window_sides))
    maps = plan.maps
    params = plan.ws_params(forward, schedule) if maps else forward
    base = type(params).forward.offset if maps else 0
    inputs = base + forward_type.inputs.offset
    pointers = [(inputs + getattr(Inputs, name).offset, native.given(index))
                for index, name in enumerate(("q", "k", "v", "mask", "bias")) if layouts[index] is not None]
    pointers += [(base + forward_type.out.offset, native.allocated(0)),
                 (base + forward_type.lse.offset, native.allocated(1))]
    operands = (*(native.given(index) for index in range(5)), native.allocated(0))  # q, k, v, mask, bias, out
    descriptors = [(getattr(type(params), field).offset, operands[operand]) for field, operand, *_ in maps]
    return bytes(params), pointers, descriptors


class ForwardPlan:
    """A forward call's launch for one signature (`dmattn_bench.plan`): `plan(q, k, v, mask, bias,
    out, lse)` launches into given outputs, `plan.allocate_and_run(...)` allocates them first (the
    runtime's call). The mask and bias come as the caller passed them (any dims up to 4).

    A run of `allocate_and_run` from Python builds the program of the later ones
    (`dmattn_kernels.runtime.native`): the same two allocations and one launch in one C++ call, the
    parameters copied from the signature's template with the call's addresses and, for the
    warp-specialized forward, its tensor maps filled in (encoded again only for new input
    addresses; `tma_store`'s map of out moved to each run's allocation). A packed call
    (`packing`, `configs.Packing`) runs into given outputs, given its sequences on each run
    (`sequences`: cu_seqlens_q, cu_seqlens_k, seqused_k or None); it writes only its sequences'
    rows (the caller fills the rest: `dmattn_bench.plan`).
    """

    leaves_activity = False  # no tile activity for the backward (the Triton forward's schedule)
    fills_unowned = False  # a packed run leaves the rows no sequence owns to the caller

    def __init__(self, q, k, v, mask, bias, *, is_causal: bool, softmax_scale: float, softcap: float,
                 config: FwdConfig, out: torch.Tensor, lse: torch.Tensor, window: tuple[int, int] = (-1, -1),
                 packing: Packing | None = None):
        # a launch's checks and variant are `_forward_launch`'s, per signature
        self.window_sides = kernel_window_sides(window, is_causal, q.shape, k.shape[1])
        del q, k, v, mask, bias
        self.options = dict(is_causal=is_causal, softmax_scale=softmax_scale, softcap=softcap, window=window,
                            packing=packing)
        self.config = config
        self.out_shape, self.out_dtype, self.lse_shape = tuple(out.shape), out.dtype, tuple(lse.shape)
        self.native: native.Program | None = None  # `allocate_and_run`'s, once a run built it
        self.native_tried = False

    def __call__(self, q, k, v, mask, bias, out, lse, activity=None, sequences=(None, None, None)) -> None:
        del activity
        attention_forward(q, k, v, mask, bias, config=self.config, out=out, lse=lse, sequences=sequences,
                          **self.options)

    def native_program(self, keep_lse: bool) -> native.Program | None:
        """The program a call without gradient runs (lse is its own tensor either way)."""
        del keep_lse
        return self.native

    def allocate_and_run(self, q, k, v, mask, bias, keep_activity: bool, keep_lse: bool = True) -> tuple:
        """(out, lse, None) in new tensors (`keep_activity` and `keep_lse` change nothing here); a
        dense call's (a packed one runs into given outputs)."""
        del keep_activity, keep_lse
        stream = launch_stream()
        # the program launches on the current device's stream; on another, `Launcher` switches
        if (self.native is not None and stream is not None and not launch_context.LAUNCH_OBSERVERS
                and q.get_device() == torch.cuda.current_device()):
            return self.native(stream, q, k, v, mask, bias)
        out = torch.empty(self.out_shape, dtype=self.out_dtype, device=q.device)
        lse = torch.empty(self.lse_shape, dtype=torch.float32, device=q.device)
        self(q, k, v, mask, bias, out, lse)
        if stream is not None and not self.native_tried:
            self.native_tried = True
            self.native = self._native_program(q, k, v, mask, bias, out, lse)
        return out, lse, None

    def _native_program(self, q, k, v, mask, bias, out, lse) -> native.Program | None:
        layouts = tuple(_layout(t) for t in (q, k, v, mask, bias, out))
        options = self.options
        plan = _forward_launch(layouts, options["is_causal"], options["softcap"], self.config, self.window_sides)
        grid, schedule = plan.launch_grid(q.device)
        template, pointers, descriptors = _native_parameters(layouts, options["softmax_scale"], options["softcap"],
                                                             lse.stride(), plan, schedule, self.window_sides)

        def encode(given: tuple, allocations: tuple) -> list[bytes]:  # the mask and bias as passed
            return [bytes(tensor_map) for tensor_map in plan.tensor_maps((*given[:5], allocations[0])).values()]

        spec = native.structure_spec(plan.launcher.function(plan.name, plan.shared), grid, 32 * self.config.num_warps,
                                     plan.shared, template, pointers, descriptors, encode if plan.maps else None)
        # the schedule's address is in the template: the program keeps it, whatever the cache drops
        owners = [plan.launcher] + ([schedule] if schedule is not None else [])
        outputs = [(self.out_shape, self.out_dtype), (self.lse_shape, torch.float32)]
        return native.program_of_specs(q.device, 5, outputs, [], [spec], (0, 1, -1), owners)
