"""The forward's launch plan (`ForwardPlan`): with a mask, the activity pass, the block lists of
the config's tiles and the forward kernel; without, the forward alone. Also whether its K and V
loads go through TMA descriptors (`kv_by_tma`), and the shared memory the forward kernel compiles
to for a plan's call (`ForwardPlan.shared_bytes`).
"""

from __future__ import annotations

import torch
import triton
from triton.runtime.jit import MockTensor

from dmattn_kernels import target
from dmattn_kernels.configs import FwdConfig, Packing, window_bounds
from dmattn_kernels.runtime import launch_context, native
from dmattn_kernels.runtime.launch_context import launch_stream
from dmattn_kernels.triton.clear import UnownedRows, lse_part, token_part
from dmattn_kernels.triton.flash_fwd import flash_fwd_kernel
from dmattn_kernels.triton.handles import descriptor_template
from dmattn_kernels.triton.launching import Launch, Workspace
from dmattn_kernels.triton.layouts import CallLayout
from dmattn_kernels.triton.schedule import ActivityPass, BlockLists

# Compute-capability majors whose forward loads K and V by bulk tensor copy (TMA descriptors).
# Measured only on sm90 (H200, flash_fwd._load_kv_tile); Blackwell has the copy engine too, but
# no sm100/sm120 GPU was available to show that it pays there.
TMA_ARCH_MAJORS = (9,)


def kv_by_tma(k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the forward loads K and V through TMA descriptors: on a GPU of TMA_ARCH_MAJORS,
    when both meet the copy engine's alignment (16-byte base and strides); else pointer loads.

    A single key (Lk = 1) takes pointer loads: Triton turns an int argument equal to 1 into a
    constant, and with it the pipelined descriptor variant crashed Triton 3.6's ptxas (error
    -11; H200, adversarial case single_key_lk1, every config with num_stages > 1). Packed
    sequences take pointer loads too (`ForwardPlan`): a descriptor zero-fills past the tensor,
    not past a sequence, and would read the next sequence's keys.
    """
    major = target.planned_major()
    if major is None:
        major = torch.cuda.get_device_capability(k.device)[0] if k.is_cuda else None
    if k.shape[1] == 1 or major not in TMA_ARCH_MAJORS:
        return False
    return all(t.data_ptr() % 16 == 0 and all(stride * t.element_size() % 16 == 0 for stride in t.stride()[:-1])
               for t in (k, v))


class _Unplaced(MockTensor):
    """What the JIT specializes a tensor argument on, without its data: its dtype and its address
    modulo 16 (`ForwardPlan.shared_bytes` compiles on these)."""

    def __init__(self, dtype: torch.dtype, misalignment: int):
        super().__init__(dtype)
        self.misalignment = misalignment

    def data_ptr(self) -> int:
        return self.misalignment


class ForwardPlan:
    """A forward call's launches for one signature; `plan(q, k, v, mask, bias, out, lse, activity)`
    runs them on tensors of that signature into given outputs, `plan.allocate_and_run(...)`
    allocates them first (the runtime's call). The mask and bias come as the caller passed them
    (up to 4 dims, broadcastable as (B|1, H|Hkv|1, Lq|1, Lk|1)): the plan reads their layouts,
    the kernels their data.

    With a mask: the activity pass (into `activity`, or a scratch buffer), the block lists of this
    config's tiles, then the forward; without: the forward alone. `window`: FlashAttention's
    (left, right) sliding window. `packing`: packed sequences (`configs.Packing`, whose layouts
    the operands then have), each run given the sequences' (cu_seqlens_q, cu_seqlens_k,
    seqused_k or None) as `sequences`; their mask is read tile by tile without an activity pass
    (its summary is laid out by batch row, not by sequence). `allocate_and_run` fills the rows of
    out and lse that no sequence owns, which no program of the forward writes
    (`clear.UnownedRows`); a run into given outputs leaves them as given.
    """

    leaves_activity = True  # with a mask, its tile activity for the backward (`allocate_and_run`)
    fills_unowned = True  # a packed `allocate_and_run` fills the rows no sequence owns (`clear.UnownedRows`)

    def __init__(self, q, k, v, mask, bias, *, is_causal: bool, softmax_scale: float, softcap: float,
                 config: FwdConfig, out: torch.Tensor, lse: torch.Tensor, window: tuple[int, int] = (-1, -1),
                 packing: Packing | None = None):
        # the layout helpers take the mask's and bias's shapes, strides, element size and address,
        # never the tensors: a call's mask goes from this module straight to its launches
        layout = CallLayout.of(q.shape, k.shape, None if mask is None else (mask.shape, mask.stride()),
                               None if bias is None else (bias.shape, bias.stride()))
        self.config = config
        self.out_shape, self.out_dtype = tuple(out.shape), out.dtype
        self.out_like_q = q.is_contiguous() and q.dtype == out.dtype  # `empty_like(q)` costs the host less
        self.activity = self.lists = None
        blocks_strides = (0, 0, 0)
        self.lse_shape = tuple(lse.shape)
        self.workspace = None  # `allocate_and_run`'s scratch: the mask's schedule
        self.packing = packing
        seqlen_q, seqlen_k, programs = layout.seqlen_q, layout.seqlen_k, layout.batch
        if packing is not None:
            seqlen_q, seqlen_k, programs = packing.max_seqlen_q, packing.max_seqlen_k, packing.num_sequences
        has_window, window_left, window_right = window_bounds(window, is_causal, seqlen_q, seqlen_k)
        if mask is not None and packing is None:
            self.activity = ActivityPass(layout.mask_shape, layout.mask_strides, mask.element_size(), mask.data_ptr(),
                                         layout.seqlen_q, layout.seqlen_k, is_causal, window)
            self.lists = BlockLists(self.activity.shape, config.block_m, config.block_n, key_major=False)
            blocks_strides = self.lists.strides
            self.workspace = Workspace({"lse": (self.lse_shape, torch.float32),
                                        "activity": (self.activity.shape, torch.int8),
                                        "blocks": (self.lists.shape, torch.int32)})
        self.use_tma = packing is None and kv_by_tma(k, v)
        # the kernel's k_desc and v_desc (arguments 11 and 12: `_forward_tensors`), last: a compiled
        # launcher takes descriptors only there (`handles.direct_launch`)
        descriptors = None
        if self.use_tma:
            kv_block = [1, config.block_n, 1, layout.block_d]  # zero-filled past Lk and D
            descriptors = {11: descriptor_template(k, kv_block), 12: descriptor_template(v, kv_block)}
        # a packed sequence's mask and bias move by their key stride per key it starts at when
        # they are per key, not at all when per query row (`flash_fwd` module docstring)
        sequence_strides = (0, 0) if packing is None else (
            layout.mask_strides[3] if packing.mask_per_key else 0, layout.bias_strides[3] if packing.bias_per_key else 0)
        self.forward = Launch(
            flash_fwd_kernel, (triton.cdiv(seqlen_q, config.block_m), programs * layout.num_heads),
            (*q.stride(), *k.stride(), *v.stride(), *layout.mask_strides, *layout.bias_strides, *out.stride(),
             *lse.stride(), *blocks_strides, *sequence_strides, layout.num_heads, seqlen_q, seqlen_k,
             layout.mask_head_div, layout.bias_head_div, softmax_scale, softcap if softcap > 0 else 1.0,
             window_left, window_right),
            dict(GROUP=layout.group, HEAD_DIM=layout.head_dim, BLOCK_D=layout.block_d, BLOCK_M=config.block_m,
                 BLOCK_N=config.block_n, IS_CAUSAL=is_causal, HAS_MASK=mask is not None, HAS_BIAS=bias is not None,
                 HAS_SOFTCAP=softcap > 0, USE_TMA=self.use_tma, BIAS_PER_KEY=layout.bias_per_key,
                 LISTED=self.activity is not None, VARLEN=packing is not None,
                 HAS_SEQUSED=packing is not None and packing.seqused_k, HAS_WINDOW=has_window),
            descriptors, num_warps=config.num_warps, num_stages=config.num_stages,
        )
        # what the JIT specializes the forward's tensor arguments on, in their order: dtype (a bool
        # mask launches as uint8) and address modulo 16; a block list is a fresh int32 buffer
        kinds = [None if t is None else (torch.uint8 if t.dtype is torch.bool else t.dtype, t.data_ptr() & 15)
                 for t in (q, k, v, mask, bias, out, lse)]
        sequences = (None, None, None) if packing is None else ((torch.int32, 0),) * (3 if packing.seqused_k else 2)
        self.compiled_on = self._forward_tensors(*kinds, (torch.int32, 0) if self.activity is not None else kinds[0],
                                                 sequences)
        self.has_mask, self.has_bias = mask is not None, bias is not None
        self.unowned = None if packing is None else UnownedRows(
            [token_part(out.shape, out.stride()), lse_part(lse.shape, lse.stride())], [], packing.num_sequences)
        # (keep_activity, lse in the scratch buffer) -> that run's `native.Program` (None: not native)
        self.native: dict[tuple[bool, bool], object] = {}

    def __call__(self, q, k, v, mask, bias, out, lse, activity=None, sequences=(None, None, None)) -> None:
        stream = launch_stream()
        blocks = q  # an unused pointer without a mask
        if self.activity is not None:
            if activity is None:
                activity = torch.empty(self.activity.shape, dtype=torch.int8, device=q.device)
            blocks = torch.empty(self.lists.shape, dtype=torch.int32, device=q.device)
        # the forward's arguments before the first launch: once the mask is handed to a launch,
        # nothing of this module takes it again
        tensors = self._forward_tensors(q, k, v, mask, bias, out, lse, blocks, sequences)
        if self.activity is not None:
            self.activity.launch.run(stream, mask, activity)
            self.lists.launch.run(stream, activity, blocks)
        self.forward.run(stream, *tensors)

    def shared_bytes(self) -> int:
        """Shared memory the forward kernel compiles to for this plan's call: compiled (Triton's
        `warmup`, nothing launched; its cache makes a repeat cheap) on stand-ins of the call's
        tensors with what the JIT specializes on, so the plan keeps none of them.

        Raises:
            RuntimeError: in the interpreter, which compiles nothing.
        """
        compiled = self.forward.compile(*(_Unplaced(dtype, misalignment) for dtype, misalignment in self.compiled_on))
        if compiled is None:
            raise RuntimeError("ForwardPlan.shared_bytes: the Triton interpreter compiles no kernel (TRITON_INTERPRET)")
        return compiled.metadata.shared

    def allocate_and_run(self, q, k, v, mask, bias, keep_activity: bool, keep_lse: bool = True,
                         sequences=(None, None, None)) -> tuple:
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
        if program is not None and stream is not None and not launch_context.LAUNCH_OBSERVERS:
            return program(stream, q, k, v, mask, bias)
        out = torch.empty_like(q) if self.out_like_q else torch.empty(self.out_shape, dtype=self.out_dtype,
                                                                       device=q.device)
        if not lse_in_scratch:
            lse = torch.empty(self.lse_shape, dtype=torch.float32, device=q.device)
        if self.unowned is not None:
            self.unowned.run(stream, (out, lse), *sequences[:2])
        if self.activity is None:
            self.forward.run(stream, *self._forward_tensors(q, k, v, mask, bias, out, lse, q, sequences))
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
        tensors = self._forward_tensors(q, k, v, mask, bias, out, lse, blocks, sequences)
        self.activity.launch.run(stream, mask, activity)
        self.lists.launch.run(stream, activity, blocks)
        self.forward.run(stream, *tensors)
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
        if (kind in self.native or stream is None or self.packing is not None  # packed: the Python path
                or any(launch.launcher is None for launch in launches)):
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
        kernels.append((self.forward, [q, k, v, mask, bias, native.allocated(0), lse, blocks, q, q, q, k, v]))
        self.native[kind] = native.program(device, 5, allocations, views, kernels, returns)

    def _forward_tensors(self, q, k, v, mask, bias, out, lse, blocks, sequences=(None, None, None)) -> tuple:
        """The forward kernel's tensor arguments; q stands in for an absent mask, bias, block list
        or packed sequences' prefix sums and key counts (an unused pointer)."""
        return (q, k, v, q if mask is None else mask, q if bias is None else bias, out, lse, blocks,
                *(q if t is None else t for t in (tuple(sequences) + (None,) * 3)[:3]), k, v)
