"""Launchers for the Triton kernels: explicit configs in, preallocated outputs filled.

Callers (the runtime plan, the validator, the tuner) own the outputs, so the validator can hand
in NaN-poisoned buffers and check that every element was written. Inputs arrive already checked
by `dmattn_bench.api`: q (B, Lq, H, D), k/v (B, Lk, Hkv, D) with a contiguous head dim, mask/bias
as 4-D views (B|1, H|Hkv|1, Lq|1, Lk|1) or None. Nothing here copies or pads them.

A launch plan (`ForwardPlan`, `BackwardPlan`) holds what a call needs that does not depend on its
data: grids, strides, head divisors, flags, scratch shapes and, after its first run, each
kernel's compiled handle (`_Launch`). Running a plan costs its allocations and one launcher call
per kernel. The runtime (`dmattn_bench.plan`) keeps the plans it builds; `attention_forward` and
`attention_backward`, the backend interface of the validator and the tuner, cache theirs by the
call's signature.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from contextlib import contextmanager
from typing import Callable

import torch
import triton
from triton import knobs

from dmattn_kernels.runtime import native
from dmattn_kernels.runtime.plan_cache import PlanCache
from dmattn_kernels.configs import AttentionShape, BwdConfig, DecodeConfig, FwdConfig, shape_problem
from dmattn_kernels import target
from dmattn_kernels.triton.activity import CELL, WORD_BYTES, block_list_kernel, tile_activity_kernel
from dmattn_kernels.triton.flash_bwd import (
    flash_bwd_dkdv_kernel,
    flash_bwd_dq_from_ds_kernel,
    flash_bwd_dq_kernel,
    flash_bwd_preprocess_kernel,
    grad_reduce_kernel,
)
from dmattn_kernels.triton.flash_fwd import flash_fwd_kernel
from dmattn_kernels.triton.handles import descriptor_on, descriptor_template, direct_launch
from dmattn_kernels.triton.layouts import (activity_shape, bias_per_key, broadcast_layout, contiguous_strides,
                                           mask_words_readable, zero_size1_strides)

_MODE = threading.local()  # compile-only switch of the current thread (see `compile_only`)
# Called with each kernel's name as it is launched (or compiled in `compile_only`): launch counts
# for tests and instrumentation. Empty in normal use, where it costs one truth test per launch.
LAUNCH_OBSERVERS: list[Callable[[str], None]] = []

MIN_BLOCK = CELL  # tl.dot needs every tile dim >= 16; the activity cells are that size
MAX_BLOCK = 256
WARP_CHOICES = (1, 2, 4, 8, 16)
MAX_STAGES = 8
PREPROCESS_BLOCK_M = 64  # delta = rowsum(dO * O) is memory-bound; any reasonable tile will do
PREPROCESS_NUM_WARPS = 4  # the backward's preprocess launch: delta rows and block-list rows alike
ACTIVITY_BLOCK_M, ACTIVITY_BLOCK_N = 64, 256  # tile of the (memory-bound) activity pass; multiples of CELL
ACTIVITY_NUM_WARPS = 8
LIST_NUM_WARPS = 4  # a block-list program handles one row of tiles: little work
GQA_SUM_BLOCK_N = 64  # keys per program of the (memory-bound) GQA share sum
# dBias tile per program of the (memory-bound) partial sum: rows x keys, fp32
DBIAS_SUM_BLOCK_R, DBIAS_SUM_BLOCK_K = 8, 128
REDUCE_NUM_WARPS = 4
PLAN_CACHE_SIZE = 512  # signatures whose plans `attention_forward` / `attention_backward` keep
# Compute-capability majors whose forward loads K and V by bulk tensor copy (TMA descriptors).
# Measured only on sm90 (H200, flash_fwd._load_kv_tile); Blackwell has the copy engine too, but
# no sm100/sm120 GPU was available to show that it pays there.
TMA_ARCH_MAJORS = (9,)
LIST_CHUNK = 128  # tiles a block-list program pools per step (its cells: 16 x 128 x 16 at most)


@contextmanager
def compile_only():
    """Within this block the launchers compile their kernels (Triton's `warmup`) but launch none.

    The tuner compiles candidates in parallel worker processes this way: no candidate kernel
    ever runs there, so a config that faults on the GPU can only fault in the measuring worker,
    which is isolated and restarted.
    """
    previous = getattr(_MODE, "compile_only", False)
    _MODE.compile_only = True
    try:
        yield
    finally:
        _MODE.compile_only = previous


def is_compile_only() -> bool:
    return getattr(_MODE, "compile_only", False)


def head_block(head_dim: int) -> int:
    """The power-of-two lane count covering `head_dim` (masked lanes handle the rest)."""
    return max(MIN_BLOCK, triton.next_power_of_2(head_dim))


def _check_block(name: str, value: int) -> str | None:
    if value < MIN_BLOCK or value > MAX_BLOCK or value & (value - 1):
        return f"{name}={value} is not a power of two in [{MIN_BLOCK}, {MAX_BLOCK}]"
    return None


def is_supported(config: FwdConfig | BwdConfig | DecodeConfig, shape: AttentionShape) -> str | None:
    """The reason `config` cannot run `shape`, or None when it can.

    Only structural limits live here; shared-memory and register fit per arch are pruned by
    cross-compilation in the tuner.
    """
    reason = shape_problem(shape)
    if reason:
        return reason
    if isinstance(config, FwdConfig) and (config.overlap or config.persistent):
        return ("overlap and persistent are knobs of the CUDA warp-specialized forward; the Triton forward has "
                "neither (leave them 0)")
    if isinstance(config, DecodeConfig):  # num_splits is checked when the config is built
        blocks = ["block_n"]
    else:
        blocks = ["block_m", "block_n"] + (["block_m_dq", "block_n_dq"] if isinstance(config, BwdConfig) else [])
    for name in blocks:
        reason = _check_block(name, getattr(config, name))
        if reason:
            return reason
    if config.num_warps not in WARP_CHOICES:
        return f"num_warps={config.num_warps} is not one of {WARP_CHOICES}"
    if not 1 <= config.num_stages <= MAX_STAGES:
        return f"num_stages={config.num_stages} is not in [1, {MAX_STAGES}]"
    return None


# -- one kernel launch -----------------------------------------------------------------------------


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


class _Launch:
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
            target.record(target.Program("triton", self.name, kernel, tuple(sorted({**constexprs, **options}.items()))))

    def __call__(self, *tensors) -> None:
        self.run(launch_stream(), *tensors)

    def run(self, stream: int | None, *args) -> None:
        """Launches on `stream` (`launch_stream()`, read once by a plan for all its kernels): the
        compiled launcher when there is one and a stream, else the JIT. A pointer may be passed
        as its address (an int) once the kernel is compiled."""
        if LAUNCH_OBSERVERS:
            for observer in LAUNCH_OBSERVERS:
                observer(self.name)
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


def _hooked(hook) -> bool:
    """Whether a Triton launch hook is set: a `HookChain` (Triton 3.6+) with calls, or a callable."""
    calls = getattr(hook, "calls", hook)
    return bool(calls)


# The current device and stream, as Triton's JIT reads them before a launch, without the lazy-init
# check `torch.cuda.current_device` repeats (5 us per launch on an H100 host, cProfile of
# `benchmarks/host_profile.py`): a plan's kernels run after its first JIT launch initialised CUDA.
_current_device = torch._C._cuda_getDevice if torch.cuda.is_available() else None
_current_stream = torch._C._cuda_getCurrentRawStream if torch.cuda.is_available() else None


def launch_stream() -> int | None:
    """The current CUDA stream, for launches through compiled launchers; None where every launch
    takes the JIT: without CUDA, within `compile_only()`, and while a Triton launch hook is set
    (a profiler), which only the JIT calls. (The interpreter compiles nothing, so its launches
    never have a launcher.)"""
    runtime = knobs.runtime
    if (_current_stream is None or is_compile_only() or _hooked(runtime.launch_enter_hook)
            or _hooked(runtime.launch_exit_hook)):
        return None
    return _current_stream(_current_device())


class _Workspace:
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


# -- operand layouts (the rest: `layouts`) ----------------------------------------------------------


def kv_by_tma(k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the forward loads K and V through TMA descriptors: on a GPU of TMA_ARCH_MAJORS,
    when both meet the copy engine's alignment (16-byte base and strides); else pointer loads.

    A single key (Lk = 1) takes pointer loads: Triton turns an int argument equal to 1 into a
    constant, and with it the pipelined descriptor variant crashed Triton 3.6's ptxas (error
    -11; H200, adversarial case single_key_lk1, every config with num_stages > 1).
    """
    major = target.planned_major()
    if major is None:
        major = torch.cuda.get_device_capability(k.device)[0] if k.is_cuda else None
    if k.shape[1] == 1 or major not in TMA_ARCH_MAJORS:
        return False
    return all(t.data_ptr() % 16 == 0 and all(stride * t.element_size() % 16 == 0 for stride in t.stride()[:-1])
               for t in (k, v))


# -- the mask's tile activity and block lists ------------------------------------------------------


class _ActivityPass:
    """`tile_activity_kernel` for one mask layout: (Bm, Hm, ceil(Lq/CELL), ceil(Lk/CELL)) int8."""

    def __init__(self, mask: torch.Tensor, seqlen_q: int, seqlen_k: int, is_causal: bool):
        batch_m, heads_m = mask.shape[0], mask.shape[1]
        self.shape = activity_shape(mask.shape, seqlen_q, seqlen_k)
        self.launch = _Launch(
            tile_activity_kernel,
            (triton.cdiv(seqlen_q, ACTIVITY_BLOCK_M), triton.cdiv(seqlen_k, ACTIVITY_BLOCK_N), batch_m * heads_m),
            (*zero_size1_strides(mask), *contiguous_strides(self.shape), heads_m, seqlen_q, seqlen_k),
            dict(IS_CAUSAL=is_causal, BLOCK_M=ACTIVITY_BLOCK_M, BLOCK_N=ACTIVITY_BLOCK_N, CELL=CELL,
                 WORDS=mask_words_readable(mask), WORD=WORD_BYTES),
            num_warps=ACTIVITY_NUM_WARPS,
        )

    def __call__(self, mask: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """`out`: a contiguous buffer of `self.shape` to fill (every element is written)."""
        if out is None:
            out = torch.empty(self.shape, dtype=torch.int8, device=mask.device)
        self.launch(mask, out)
        return out


class _BlockLists:
    """`block_list_kernel` for one activity shape and tile shape: (Bm, Hm, rows, 1 + cols) int32,
    each row [count, active indices..., skipped indices...] (`block_lists`)."""

    def __init__(self, active_shape, block_rows: int, block_cols: int, key_major: bool):
        batch_m, heads_m, cell_rows, cell_cols = active_shape
        stride_b, stride_h, stride_r, stride_c = contiguous_strides(active_shape)
        rows, cols = block_rows // CELL, block_cols // CELL
        if key_major:
            own, listed, own_cells, list_cells, stride_own, stride_list = cols, rows, cell_cols, cell_rows, stride_c, stride_r
        else:
            own, listed, own_cells, list_cells, stride_own, stride_list = rows, cols, cell_rows, cell_cols, stride_r, stride_c
        num_rows, num_tiles = triton.cdiv(own_cells, own), triton.cdiv(list_cells, listed)
        self.shape = (batch_m, heads_m, num_rows, 1 + num_tiles)
        lists_strides = contiguous_strides(self.shape)
        # what a kernel reading the lists receives: (batch, head, row) strides, 0 on broadcast dims
        self.strides = tuple(0 if size == 1 else stride for size, stride in zip(self.shape, lists_strides))[:3]
        # `activity.block_list_row`'s arguments after its pointers and row, and its program count
        self.scalars = (stride_b, stride_h, stride_own, stride_list, *lists_strides[:3], heads_m, own_cells,
                        list_cells, num_tiles)
        self.cells = (own, listed, min(LIST_CHUNK, triton.next_power_of_2(num_tiles)))  # OWN_CELLS, LIST_CELLS, CHUNK
        self.rows, self.programs = num_rows, num_rows * batch_m * heads_m
        self.launch = _Launch(
            block_list_kernel, (num_rows, batch_m * heads_m), self.scalars,
            dict(zip(("OWN_CELLS", "LIST_CELLS", "CHUNK"), self.cells)), num_warps=LIST_NUM_WARPS,
        )

    def __call__(self, active: torch.Tensor) -> torch.Tensor:
        lists = torch.empty(self.shape, dtype=torch.int32, device=active.device)
        self.launch(active, lists)
        return lists


def tile_activity(mask: torch.Tensor, seqlen_q: int, seqlen_k: int, is_causal: bool,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """(Bm, Hm, ceil(Lq/CELL), ceil(Lk/CELL)) int8: 1 where a CELL x CELL cell of the mask's own
    batch and head slices holds a visible position (`activity.py`). One read of the mask.

    `out`, when given, is a contiguous buffer of that shape to fill (every element is written)."""
    return _ActivityPass(mask, seqlen_q, seqlen_k, is_causal)(mask, out)


def block_lists(active: torch.Tensor, block_rows: int, block_cols: int, *, key_major: bool = False) -> torch.Tensor:
    """Per tile row, the tiles a kernel must visit: (Bm, Hm, rows, 1 + cols) int32, each row
    [count, index_0, ..., index_{count-1}, skipped indices...], active and skipped tiles each
    in increasing order (`activity.block_list_kernel`).

    `active` (from `tile_activity`, contiguous) is pooled to (block_rows x block_cols) tiles of the
    (query x key) plane. key_major: one row per key tile listing query tiles (the dK/dV kernel).
    """
    return _BlockLists(tuple(active.shape), block_rows, block_cols, key_major)(active.contiguous())


# -- forward ---------------------------------------------------------------------------------------


class ForwardPlan:
    """A forward call's launches for one signature; `plan(q, k, v, mask, bias, out, lse, activity)`
    runs them on tensors of that signature into given outputs, `plan.allocate_and_run(...)`
    allocates them first (the runtime's call).

    With a mask: the activity pass (into `activity`, or a scratch buffer), the block lists of this
    config's tiles, then the forward; without: the forward alone.
    """

    leaves_activity = True  # with a mask, its tile activity for the backward (`allocate_and_run`)

    def __init__(self, q, k, v, mask, bias, *, is_causal: bool, softmax_scale: float, softcap: float,
                 config: FwdConfig, out: torch.Tensor, lse: torch.Tensor):
        batch, seqlen_q, num_heads, head_dim = q.shape
        seqlen_k, num_heads_kv = k.shape[1], k.shape[2]
        group = num_heads // num_heads_kv
        block_d = head_block(head_dim)
        mask_strides, mask_head_div = broadcast_layout(mask, num_heads, group)
        bias_strides, bias_head_div = broadcast_layout(bias, num_heads, group)
        self.config = config
        self.out_shape, self.out_dtype = tuple(out.shape), out.dtype
        self.out_like_q = q.is_contiguous() and q.dtype == out.dtype  # `empty_like(q)` costs the host less
        self.activity = self.lists = None
        blocks_strides = (0, 0, 0)
        self.lse_shape = tuple(lse.shape)
        self.workspace = None  # `allocate_and_run`'s scratch: the mask's schedule
        if mask is not None:
            self.activity = _ActivityPass(mask, seqlen_q, seqlen_k, is_causal)
            self.lists = _BlockLists(self.activity.shape, config.block_m, config.block_n, key_major=False)
            blocks_strides = self.lists.strides
            self.workspace = _Workspace({"lse": (self.lse_shape, torch.float32),
                                         "activity": (self.activity.shape, torch.int8),
                                         "blocks": (self.lists.shape, torch.int32)})
        self.use_tma = kv_by_tma(k, v)
        descriptors = None  # the kernel's k_desc and v_desc (arguments 8 and 9: `_forward_tensors`)
        if self.use_tma:
            kv_block = [1, config.block_n, 1, block_d]  # zero-filled past Lk and D
            descriptors = {8: descriptor_template(k, kv_block), 9: descriptor_template(v, kv_block)}
        self.forward = _Launch(
            flash_fwd_kernel, (triton.cdiv(seqlen_q, config.block_m), batch * num_heads),
            (*q.stride(), *k.stride(), *v.stride(), *mask_strides, *bias_strides, *out.stride(), *lse.stride(),
             *blocks_strides, num_heads, seqlen_q, seqlen_k, mask_head_div, bias_head_div,
             softmax_scale, softcap if softcap > 0 else 1.0),
            dict(GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
                 IS_CAUSAL=is_causal, HAS_MASK=mask is not None, HAS_BIAS=bias is not None, HAS_SOFTCAP=softcap > 0,
                 USE_TMA=self.use_tma, BIAS_PER_KEY=bias_per_key(bias_strides, bias)),
            descriptors, num_warps=config.num_warps, num_stages=config.num_stages,
        )
        self.has_mask, self.has_bias = mask is not None, bias is not None
        # (keep_activity, lse in the scratch buffer) -> that run's `native.Program` (None: not native)
        self.native: dict[tuple[bool, bool], object] = {}

    def __call__(self, q, k, v, mask, bias, out, lse, activity=None) -> None:
        stream = launch_stream()
        blocks = q  # an unused pointer without a mask
        if self.activity is not None:
            if activity is None:
                activity = torch.empty(self.activity.shape, dtype=torch.int8, device=q.device)
            self.activity.launch.run(stream, mask, activity)
            blocks = torch.empty(self.lists.shape, dtype=torch.int32, device=q.device)
            self.lists.launch.run(stream, activity, blocks)
        self.forward.run(stream, *self._forward_tensors(q, k, v, mask, bias, out, lse, blocks))

    def allocate_and_run(self, q, k, v, mask, bias, keep_activity: bool, keep_lse: bool = True) -> tuple:
        """Runs into new outputs: (out, lse, the mask's tile activity if `keep_activity` and there
        is a mask, else None).

        Outputs (and the activity a backward keeps) are tensors of their own: as views of one
        buffer, autograd's handling of views cost an eager training step more host time than the
        allocations saved. Without a gradient the schedule's scratch is one buffer, passed by
        address, and lse a view of it unless the caller keeps lse (`keep_lse`: a kept view would
        keep the whole buffer alive)."""
        stream = launch_stream()
        keep_activity = keep_activity and self.activity is not None  # without a mask there is none to keep
        lse_in_scratch = self.activity is not None and not keep_activity and not keep_lse
        program = self.native.get((keep_activity, lse_in_scratch))
        if program is not None and stream is not None and not LAUNCH_OBSERVERS:
            return program(stream, q, k, v, mask, bias)
        out = torch.empty_like(q) if self.out_like_q else torch.empty(self.out_shape, dtype=self.out_dtype,
                                                                       device=q.device)
        if not lse_in_scratch:
            lse = torch.empty(self.lse_shape, dtype=torch.float32, device=q.device)
        if self.activity is None:
            self.forward.run(stream, *self._forward_tensors(q, k, v, mask, bias, out, lse, q))
            self._go_native(stream, q.device, keep_activity, lse_in_scratch)
            return out, lse, None
        if keep_activity:
            activity = torch.empty(self.activity.shape, dtype=torch.int8, device=q.device)
            blocks = torch.empty(self.lists.shape, dtype=torch.int32, device=q.device)
        else:
            # addresses once the kernels are compiled (the forward is the last); views for the JIT
            # (the first run, a profiler)
            by_address = stream is not None and self.forward.launcher is not None
            buffer = self.workspace.allocate(q.device)
            if lse_in_scratch:
                lse = self.workspace.tensor(buffer, "lse")
            activity = self.workspace.part(buffer, "activity", by_address)
            blocks = self.workspace.part(buffer, "blocks", by_address)
        self.activity.launch.run(stream, mask, activity)
        self.lists.launch.run(stream, activity, blocks)
        self.forward.run(stream, *self._forward_tensors(q, k, v, mask, bias, out, lse, blocks))
        self._go_native(stream, q.device, keep_activity, lse_in_scratch)
        return out, lse, activity if keep_activity else None

    def native_program(self, keep_lse: bool):
        """The program `allocate_and_run` runs for a call without gradient (no activity kept; lse
        a view of the schedule's scratch unless kept), None while there is none."""
        return self.native.get((False, self.activity is not None and not keep_lse))

    def _go_native(self, stream: int | None, device: torch.device, keep_activity: bool, lse_in_scratch: bool) -> None:
        """Once every kernel is compiled, `allocate_and_run`'s later runs of this kind as one native
        call (`native.program`): the same allocations, launches and outputs."""
        launches = [self.forward] if self.activity is None else [self.activity.launch, self.lists.launch, self.forward]
        kind = (keep_activity, lse_in_scratch)
        if kind in self.native or stream is None or any(launch.launcher is None for launch in launches):
            return
        q, k, v, mask, bias = (native.given(i) for i in range(5))
        mask, bias = (mask if self.has_mask else q), (bias if self.has_bias else q)  # q: an unused pointer
        allocations, views = [(self.out_shape, self.out_dtype)], []
        kernels, blocks, returns = [], q, (0, 1, -1)
        if not lse_in_scratch:
            allocations.append((self.lse_shape, torch.float32))
            lse = native.allocated(1)
        if self.activity is not None and keep_activity:
            allocations += [(self.activity.shape, torch.int8), (self.lists.shape, torch.int32)]
            activity, blocks, returns = native.allocated(2), native.allocated(3), (0, 1, 2)
        elif self.activity is not None:  # the schedule in one scratch buffer
            scratch = len(allocations)
            offset = {name: layout[0] for name, layout in self.workspace.layout.items()}
            allocations.append(((self.workspace.nbytes,), torch.uint8))
            activity, blocks = (native.allocated(scratch, offset[name]) for name in ("activity", "blocks"))
            if lse_in_scratch:  # returned as its view
                views.append((scratch, offset["lse"] // 4, self.lse_shape, torch.float32))
                lse, returns = native.allocated(scratch, offset["lse"]), (0, 2, -1)
        if self.activity is not None:
            kernels += [(self.activity.launch, [mask, activity]), (self.lists.launch, [activity, blocks])]
        kernels.append((self.forward, [q, k, v, mask, bias, native.allocated(0), lse, blocks, k, v]))
        self.native[kind] = native.program(device, 5, allocations, views, kernels, returns)

    def _forward_tensors(self, q, k, v, mask, bias, out, lse, blocks) -> tuple:
        """The forward kernel's tensor arguments; q stands in for an absent mask, bias or block list
        (an unused pointer)."""
        return q, k, v, q if mask is None else mask, q if bias is None else bias, out, lse, blocks, k, v


# -- backward --------------------------------------------------------------------------------------


class _PartialSum:
    """dBias from the kernel's fp32 partials (`partial_shape`): one sum over the query heads of
    each GQA group and every dim the bias broadcasts, in a fixed order (deterministic), then the
    cast into dbias. The partials are read as (B, bias heads, heads per bias head, rows, keys)."""

    def __init__(self, partial_shape: tuple[int, ...], dbias_shape: tuple[int, ...]):
        batch, heads, rows, keys = partial_shape
        group = heads // dbias_shape[1]
        self.view = (batch, dbias_shape[1], group, rows, keys)
        target = (dbias_shape[0], dbias_shape[1], 1, dbias_shape[2], dbias_shape[3])
        self.dims = tuple(dim for dim, (size, kept) in enumerate(zip(self.view, target)) if size != kept)

    def __call__(self, partial: torch.Tensor, dbias: torch.Tensor) -> None:
        summed = partial.view(self.view)
        if self.dims:
            summed = summed.sum(dim=self.dims, keepdim=True)
        dbias.copy_(summed.view(dbias.shape))


def _finish_dbias(partial: torch.Tensor, dbias: torch.Tensor) -> None:
    """`_PartialSum` for one call: the CUDA backward's dBias partials (a Triton plan sums its own in
    `grad_reduce_kernel`)."""
    _PartialSum(tuple(partial.shape), tuple(dbias.shape))(partial, dbias)


def delta_with_lse_grad(delta: torch.Tensor, dlse: torch.Tensor | None, lse: torch.Tensor) -> None:
    """delta - dlse in place, a dead row's dlse dropped (what `flash_bwd_preprocess_kernel` does
    in the Triton backward; the CUDA backward computes delta without it)."""
    if dlse is not None:
        delta.sub_(torch.where(lse == float("-inf"), 0.0, dlse))


class BackwardPlan:
    """A backward call's launches for one signature; `plan(dout, q, k, v, out, lse, mask, bias, dq,
    dk, dv, dbias, activity, dlse)` runs them.

    Launches: the preprocess (delta with dlse folded in, and with a mask the block lists of both
    kernels' tiles from the forward's activity, or from one more activity pass without it), dK/dV
    (and dBias partials), dQ, then, where there is anything to sum, one reduction (the GQA shares
    of dK/dV and dBias's broadcast dims where the kernel kept them apart).
    """

    def __init__(self, dout, q, k, v, out, lse, mask, bias, *, is_causal: bool, softmax_scale: float, softcap: float,
                 config: BwdConfig, dq, dk, dv, dbias, dlse):
        batch, seqlen_q, num_heads, head_dim = q.shape
        seqlen_k, num_heads_kv = k.shape[1], k.shape[2]
        group = num_heads // num_heads_kv
        block_d = head_block(head_dim)
        device = q.device
        mask_strides, mask_head_div = broadcast_layout(mask, num_heads, group)
        bias_strides, bias_head_div = broadcast_layout(bias, num_heads, group)
        flags = dict(GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d, IS_CAUSAL=is_causal,
                     HAS_MASK=mask is not None, HAS_BIAS=bias is not None, HAS_SOFTCAP=softcap > 0,
                     BIAS_PER_KEY=bias_per_key(bias_strides, bias))
        scalars = (mask_head_div, bias_head_div, softmax_scale, softcap if softcap > 0 else 1.0)
        self.device, self.lse_shape = device, tuple(lse.shape)

        # -- dBias target. Split mode (one program per query head) writes (B, H, Lq or one row
        # per query block, Lk). Group mode (one program per kv head, looping over its query
        # heads) is chosen for a bias with query rows and fewer heads than the query,
        # (B, Hkv|1, Lq, Lk) under GQA: it sums dS over the group in registers and writes
        # (B, Hkv, Lq, Lk), 1/GROUP of split mode's fp32 partial (2 GiB at B2 H16 L4096) and none
        # at all for a contiguous (B, Hkv, Lq, Lk) bias. Everywhere else split mode stays:
        # per-kv-head programs leave most SMs idle (flash_bwd.py docstring). The target is dbias
        # itself where the shapes agree (never zero-filled: the kernel writes every element,
        # skipped tiles as zeros), else fp32 scratch summed by `grad_reduce_kernel` --
        rows, heads_per_program = True, 1
        self.partial_shape = None  # None: the kernel writes dbias itself (or there is none)
        partial_strides = (0, 0, 0, 0)
        if dbias is not None:
            rows = dbias.shape[2] != 1 or seqlen_q == 1
            heads_per_program = group if rows and dbias.shape[1] < num_heads else 1
            shape = (batch, num_heads // heads_per_program,
                     seqlen_q if rows else triton.cdiv(seqlen_q, config.block_m), seqlen_k)
            if tuple(dbias.shape) == shape and dbias.is_contiguous():
                partial_strides = dbias.stride()
            else:
                self.partial_shape = shape
                partial_strides = contiguous_strides(shape)

        # -- schedules --
        self.activity = self.kv_lists = self.q_lists = None
        self.group_union = False
        kv_blocks_strides = q_blocks_strides = (0, 0, 0)
        if mask is not None:
            self.activity = _ActivityPass(mask, seqlen_q, seqlen_k, is_causal)
            kv_active_shape = self.activity.shape
            # group mode visits the union of its query heads' tiles (each tile still applies its
            # own head's mask); a mask with Hkv or 1 heads already has one list per kv head
            self.group_union = heads_per_program > 1 and mask.shape[1] == num_heads
            if self.group_union:
                kv_active_shape = (kv_active_shape[0], num_heads_kv, *kv_active_shape[2:])
            self.kv_lists = _BlockLists(kv_active_shape, config.block_m, config.block_n, key_major=True)
            self.q_lists = _BlockLists(self.activity.shape, config.block_m_dq, config.block_n_dq, key_major=False)
            kv_blocks_strides, q_blocks_strides = self.kv_lists.strides, self.q_lists.strides
        self.num_heads_kv, self.group = num_heads_kv, group

        # -- one launch: delta = rowsum(dO * O) - dlse and, with a mask, both kernels' block lists --
        delta_strides = contiguous_strides(lse.shape)
        delta_blocks = triton.cdiv(seqlen_q, PREPROCESS_BLOCK_M)
        list_scalars, list_cells = [], {}
        for name, lists in (("KV", self.kv_lists), ("Q", self.q_lists)):
            # without a mask no program builds lists: zero programs, placeholder tiles
            list_scalars += [*lists.scalars, lists.rows, lists.programs] if lists is not None else [0] * 13
            cells = lists.cells if lists is not None else (1, 1, 1)
            list_cells.update({f"{name}_OWN_CELLS": cells[0], f"{name}_LIST_CELLS": cells[1], f"{name}_CHUNK": cells[2]})
        list_programs = sum(lists.programs for lists in (self.kv_lists, self.q_lists) if lists is not None)
        self.preprocess = _Launch(
            flash_bwd_preprocess_kernel, (list_programs + delta_blocks * batch * num_heads,),
            (*out.stride(), *dout.stride(), *delta_strides, *lse.stride(),
             *(dlse.stride() if dlse is not None else (0, 0, 0)), num_heads, seqlen_q, delta_blocks, *list_scalars),
            dict(HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=PREPROCESS_BLOCK_M, HAS_DLSE=dlse is not None,
                 HAS_MASK=mask is not None, **list_cells),
            num_warps=PREPROCESS_NUM_WARPS,
        )

        # -- dK, dV (and dBias partials): one program per key block and query head (split mode) or
        # kv head (group mode); under GQA in split mode each query head's fp32 share, summed by
        # `grad_reduce_kernel` in a fixed order (deterministic, no atomics) --
        self.share_shape = None
        dk_strides, dv_strides = dk.stride(), dv.stride()
        if group > 1 and heads_per_program == 1:
            self.share_shape = (batch, seqlen_k, num_heads, head_dim)
            dk_strides = dv_strides = contiguous_strides(self.share_shape)
        self.dkdv = _Launch(
            flash_bwd_dkdv_kernel, (triton.cdiv(seqlen_k, config.block_n), batch * num_heads // heads_per_program),
            (*q.stride(), *k.stride(), *v.stride(), *mask_strides, *bias_strides, *dout.stride(),
             *lse.stride(), *dk_strides, *dv_strides, *partial_strides, *kv_blocks_strides,
             num_heads, seqlen_q, seqlen_k, *scalars),
            dict(BLOCK_M=config.block_m, BLOCK_N=config.block_n, HAS_DBIAS=dbias is not None, DBIAS_ROWS=rows,
                 HEADS_PER_PROGRAM=heads_per_program, **flags),
            num_warps=config.num_warps, num_stages=config.num_stages,
        )

        # -- dQ: one program per query block and query head; from the stored dS when the dK/dV
        # kernel wrote it whole, as the gradient of a full per-head bias without softcap --
        self.dq_from_ds = (dbias is not None and self.partial_shape is None and rows and heads_per_program == 1
                           and softcap <= 0)
        dq_grid = (triton.cdiv(seqlen_q, config.block_m_dq), batch * num_heads)
        if self.dq_from_ds:
            self.dq = _Launch(
                flash_bwd_dq_from_ds_kernel, dq_grid,
                (*dbias.stride(), *k.stride(), *dq.stride(), *q_blocks_strides,
                 num_heads, seqlen_q, seqlen_k, mask_head_div, softmax_scale),
                dict(GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=config.block_m_dq,
                     BLOCK_N=config.block_n_dq, IS_CAUSAL=is_causal, HAS_MASK=mask is not None),
                num_warps=config.num_warps, num_stages=config.num_stages,
            )
        else:
            self.dq = _Launch(
                flash_bwd_dq_kernel, dq_grid,
                (*q.stride(), *k.stride(), *v.stride(), *mask_strides, *bias_strides, *dout.stride(),
                 *lse.stride(), *dq.stride(), *q_blocks_strides, num_heads, seqlen_q, seqlen_k, *scalars),
                dict(BLOCK_M=config.block_m_dq, BLOCK_N=config.block_n_dq, **flags),
                num_warps=config.num_warps, num_stages=config.num_stages,
            )

        # -- the sums after the main kernels, one launch: the GQA shares and dBias's broadcast dims --
        self.reduce = None
        if self.share_shape is not None or self.partial_shape is not None:
            share_blocks = triton.cdiv(seqlen_k, GQA_SUM_BLOCK_N)
            share_programs = share_blocks * batch * num_heads_kv if self.share_shape is not None else 0
            partial_scalars, partial_flags, partial_programs = (0,) * 15, dict(ROW_SUM=False, KEY_SUM=False), 0
            if self.partial_shape is not None:
                partial_batch, partial_heads, partial_rows, partial_keys = self.partial_shape
                dbias_batch, dbias_heads, dbias_rows, dbias_keys = dbias.shape
                row_sum = dbias_rows == 1 and partial_rows > 1
                key_sum = dbias_keys == 1 and partial_keys > 1
                row_tiles = 1 if row_sum else triton.cdiv(dbias_rows, DBIAS_SUM_BLOCK_R)
                key_tiles = 1 if key_sum else triton.cdiv(dbias_keys, DBIAS_SUM_BLOCK_K)
                partial_programs = dbias_batch * dbias_heads * row_tiles * key_tiles
                partial_scalars = (*partial_strides, *dbias.stride(), partial_rows, partial_keys,
                                   partial_batch // dbias_batch, partial_heads // dbias_heads, dbias_heads,
                                   row_tiles, key_tiles)
                partial_flags = dict(ROW_SUM=row_sum, KEY_SUM=key_sum)
            share_strides = dk_strides if self.share_shape is not None else (0, 0, 0, 0)
            self.reduce = _Launch(
                grad_reduce_kernel, (share_programs + partial_programs,),
                (*share_strides, *dk.stride(), *dv.stride(), num_heads_kv, seqlen_k, share_blocks, share_programs,
                 *partial_scalars),
                dict(GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_N=GQA_SUM_BLOCK_N,
                     HAS_SHARES=self.share_shape is not None, HAS_PARTIAL=self.partial_shape is not None,
                     BLOCK_R=DBIAS_SUM_BLOCK_R, BLOCK_K=DBIAS_SUM_BLOCK_K, **partial_flags),
                num_warps=REDUCE_NUM_WARPS,
            )

        # -- scratch: everything a run writes that dies with it, in one allocation --
        parts = {"delta": (self.lse_shape, torch.float32)}
        if mask is not None:
            parts.update(kv_blocks=(self.kv_lists.shape, torch.int32), q_blocks=(self.q_lists.shape, torch.int32))
        if self.partial_shape is not None:
            parts["partial"] = (self.partial_shape, torch.float32)
        if self.share_shape is not None:
            parts.update(dk_share=(self.share_shape, torch.float32), dv_share=(self.share_shape, torch.float32))
        self.workspace = _Workspace(parts)
        self.launches = [launch for launch in (self.preprocess, self.dkdv, self.dq, self.reduce) if launch is not None]
        self.compiled = False  # every launch has its compiled launcher (after the first run)
        self.native = None  # `allocate_and_run`'s `native.Program`, once the kernels are compiled
        self.native_tried = False
        self.native_own_activity = False  # the program runs the activity pass (the forward left none)

    def allocate_and_run(self, dout, q, k, v, out, lse, mask, bias, activity, dlse) -> tuple | None:
        """(dq, dk, dv, dbias or None) in new tensors (dbias 4-D) as one native call, once a run
        from Python compiled the kernels; None before that (the caller allocates and calls the
        plan) and where the path is off."""
        if self.native is None or (mask is not None and (activity is None) != self.native_own_activity):
            return None
        stream = launch_stream()
        if stream is None or LAUNCH_OBSERVERS:
            return None
        return self.native(stream, dout, q, k, v, out, lse, mask, bias, activity, dlse)

    def _go_native(self, device, mask, bias, dq, dk, dv, dbias, activity, dlse) -> None:
        """`allocate_and_run`'s program: the gradients (shapes and dtypes of this run's), one
        scratch buffer, the launches of `__call__` with the same arguments. A mask whose forward
        left no activity (the CUDA forward's) gets its activity pass in the program, into a buffer
        of its own. A group-mode union of the mask's activity (a torch op) stays in Python."""
        self.native_tried = True
        if self.group_union:
            return
        dout, q, k, v, out, lse, mask_in, bias_in, activity_in, dlse_in = (native.given(i) for i in range(10))
        allocations = [(tuple(t.shape), t.dtype) for t in (dq, dk, dv)]
        if dbias is not None:
            allocations.append((tuple(dbias.shape), dbias.dtype))
        scratch_index = len(allocations)
        allocations.append(((self.workspace.nbytes,), torch.uint8))
        # with a mask and no activity from the forward, every run lists the tiles from its own
        # pass, as `__call__` does (`allocate_and_run` declines a call of the other kind)
        own_activity = self.native_own_activity = mask is not None and activity is None
        if own_activity:
            allocations.append((self.activity.shape, torch.int8))
        scratch = {name: native.allocated(scratch_index, layout[0]) for name, layout in self.workspace.layout.items()}
        dq_out, dk_out, dv_out = native.allocated(0), native.allocated(1), native.allocated(2)
        dbias_out = native.allocated(3) if dbias is not None else q
        delta = scratch["delta"]
        active = kv_blocks = q_blocks = q
        if mask is not None:
            active = native.allocated(scratch_index + 1) if own_activity else activity_in
            kv_blocks, q_blocks = scratch["kv_blocks"], scratch["q_blocks"]
        mask_arg, bias_arg = (mask_in if mask is not None else q), (bias_in if bias is not None else q)
        partial = q if dbias is None else scratch.get("partial", dbias_out)
        dk_share, dv_share = scratch.get("dk_share", dk_out), scratch.get("dv_share", dv_out)
        kernels = [(self.activity.launch, [mask_in, active])] if own_activity else []
        kernels += [(self.preprocess, [out, dout, delta, lse, lse if dlse is None else dlse_in, active, kv_blocks,
                                       active, q_blocks]),
                    (self.dkdv, [q, k, v, mask_arg, bias_arg, dout, lse, delta, dk_share, dv_share, partial,
                                 kv_blocks])]
        if self.dq_from_ds:
            kernels.append((self.dq, [dbias_out, k, dq_out, q_blocks]))
        else:
            kernels.append((self.dq, [q, k, v, mask_arg, bias_arg, dout, lse, delta, dq_out, q_blocks]))
        if self.reduce is not None:
            kernels.append((self.reduce, [dk_share, dv_share, dk_out, dv_out, partial, dbias_out]))
        self.native = native.program(device, 10, allocations, [], kernels,
                                     (0, 1, 2, 3 if dbias is not None else -1))

    def __call__(self, dout, q, k, v, out, lse, mask, bias, dq, dk, dv, dbias, activity=None, dlse=None) -> None:
        stream = launch_stream()
        buffer = self.workspace.allocate(self.device)
        # addresses once every kernel is compiled; tensors for the JIT (the first run, a profiler)
        by_address = stream is not None and self.compiled
        scratch = self.workspace.pointers(buffer) if by_address else self.workspace.tensors(buffer)
        delta = scratch["delta"]
        active = kv_active = kv_blocks = q_blocks = q  # unused pointers without a mask
        if self.activity is not None:
            # one read of the mask, the forward's, serves both kernels' schedules
            active = kv_active = activity if activity is not None else self.activity(mask)
            if self.group_union:
                kv_active = active.unflatten(1, (self.num_heads_kv, self.group)).amax(2)
            kv_blocks, q_blocks = scratch["kv_blocks"], scratch["q_blocks"]
        self.preprocess.run(stream, out, dout, delta, lse, lse if dlse is None else dlse, kv_active, kv_blocks, active,
                            q_blocks)
        partial = q if dbias is None else scratch.get("partial", dbias)
        dk_share, dv_share = scratch.get("dk_share", dk), scratch.get("dv_share", dv)
        mask_arg = q if mask is None else mask
        bias_arg = q if bias is None else bias
        self.dkdv.run(stream, q, k, v, mask_arg, bias_arg, dout, lse, delta, dk_share, dv_share, partial, kv_blocks)
        if self.dq_from_ds:
            self.dq.run(stream, dbias, k, dq, q_blocks)
        else:
            self.dq.run(stream, q, k, v, mask_arg, bias_arg, dout, lse, delta, dq, q_blocks)
        if self.reduce is not None:
            self.reduce.run(stream, dk_share, dv_share, dk, dv, partial, q if dbias is None else dbias)
        if not self.compiled:
            self.compiled = all(launch.launcher is not None for launch in self.launches)

    def run_and_prepare(self, dout, q, k, v, out, lse, mask, bias, dq, dk, dv, dbias, activity=None,
                        dlse=None) -> None:
        """`__call__` for the runtime: once the kernels are compiled it also builds the program
        of its later runs (`allocate_and_run`; the validator's and tuner's plans build none)."""
        self(dout, q, k, v, out, lse, mask, bias, dq, dk, dv, dbias, activity, dlse)
        if self.compiled and not self.native_tried and launch_stream() is not None:
            self._go_native(q.device, mask, bias, dq, dk, dv, dbias, activity, dlse)


# -- the backend interface: plans cached by signature ----------------------------------------------


def signature(*tensors) -> tuple:
    """What a plan depends on of each tensor: shape, strides, dtype, device and where its data
    starts within 16 bytes (Triton specializes pointers on 16-byte alignment, the activity pass
    reads a mask as int64 words only when 8-byte aligned). None stays None."""
    return tuple(None if t is None else (tuple(t.shape), t.stride(), t.dtype, t.device, t.data_ptr() & 15)
                 for t in tensors)


_plans = PlanCache(PLAN_CACHE_SIZE)


def clear_plans() -> None:
    """Forgets the plans `attention_forward` / `attention_backward` keep (tests that change how a
    plan is built, e.g. the K/V load path)."""
    _plans.clear()


def attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    bias: torch.Tensor | None,
    *,
    is_causal: bool,
    softmax_scale: float,
    softcap: float,
    config: FwdConfig,
    out: torch.Tensor,
    lse: torch.Tensor,
    activity: torch.Tensor | None = None,
) -> None:
    """Writes out (B, Lq, H, D) and lse (B, H, Lq) fp32 for one forward call, and, when a mask
    and an `activity` buffer (`activity_shape`, contiguous) are given, the mask's tile activity
    into it, for the backward of the same call (`attention_backward`). Runs `config` as given
    (the runtime's plan fits an fp32 bias's tiles before: `dmattn_bench.plan`)."""
    options = dict(is_causal=is_causal, softmax_scale=softmax_scale, softcap=softcap, config=config)
    key = ("fwd", signature(q, k, v, mask, bias, out, lse), tuple(options.values()))
    plan = _plans.get_or_build(key, lambda: ForwardPlan(q, k, v, mask, bias, out=out, lse=lse, **options))
    plan(q, k, v, mask, bias, out, lse, activity)


def attention_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    mask: torch.Tensor | None,
    bias: torch.Tensor | None,
    *,
    is_causal: bool,
    softmax_scale: float,
    softcap: float,
    config: BwdConfig,
    dq: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    dbias: torch.Tensor | None,
    activity: torch.Tensor | None = None,
    dlse: torch.Tensor | None = None,
) -> None:
    """Writes dq, dk, dv and, when given, dbias (the bias's own 4-D shape and dtype).

    `dlse`: the gradient reaching lse, (B, H, Lq) fp32. d lse_i / d s_ij = P_ij, so it adds
    P * dlse to dS, which is dS with delta - dlse for delta.

    `activity`: the mask's tile activity as the forward of this call wrote it (`tile_activity`);
    without it the mask is read again (W1, the bench's full (B, H, L, L) mask, H100: 2.254 ->
    2.129 ms for the backward with it)."""
    options = dict(is_causal=is_causal, softmax_scale=softmax_scale, softcap=softcap, config=config)
    key = ("bwd", signature(dout, q, k, v, out, lse, mask, bias, dq, dk, dv, dbias, dlse), tuple(options.values()))
    plan = _plans.get_or_build(key, lambda: BackwardPlan(dout, q, k, v, out, lse, mask, bias, dq=dq, dk=dk, dv=dv,
                                                  dbias=dbias, dlse=dlse, **options))
    plan(dout, q, k, v, out, lse, mask, bias, dq, dk, dv, dbias, activity, dlse)


def fitting_forward_config(config: FwdConfig) -> FwdConfig:
    """The forward tiles tried when `config` does not fit with an fp32 bias: key tiles halved.

    A table key has no bias dtype, so its config was tuned on a 16-bit bias, and an fp32 bias
    tile takes twice the shared memory per stage (sm90, Triton 3.6, D128: fwd 128x128 w8 s2 needs
    214016 B with a bf16 bias, 246784 B with an fp32 one, over the 232448 B limit). Halving the
    key tile keeps the pipeline: one stage instead (the other way to fit) ran W1 in 1.509 ms
    against 0.693 ms with the bf16 bias (H100). `prune` checks that the halved tiles fit.
    """
    return dataclasses.replace(config, block_n=config.block_n // 2)


def forward_shared_bytes(q, k, v, mask, bias, *, is_causal: bool, softmax_scale: float, softcap: float,
                         config: FwdConfig) -> int:
    """Shared memory the forward kernel of this call needs with `config`, from compiling it for
    the current GPU (Triton's cache makes a repeat cheap); nothing is launched."""
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], dtype=torch.float32, device=q.device)
    plan = ForwardPlan(q, k, v, mask, bias, is_causal=is_causal, softmax_scale=softmax_scale, softcap=softcap,
                       config=config, out=out, lse=lse)
    blocks = torch.empty(plan.lists.shape, dtype=torch.int32, device=q.device) if plan.lists is not None else q
    return plan.forward.compile(*plan._forward_tensors(q, k, v, mask, bias, out, lse, blocks)).metadata.shared
