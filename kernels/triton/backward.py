"""The backward's launch plan (`BackwardPlan`).

A plan's launches: with packed sequences first the fill of the rows no sequence owns
(`clear.UnownedRows`), then the preprocess (delta with dlse folded in, and with a mask the block
lists of both kernels' tiles), dK/dV (and dBias partials), dQ, then, where there is anything to
sum, one reduction (`grad_reduce_kernel`).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch
import triton

from dmattn_kernels.configs import BwdConfig, Packing, window_bounds
from dmattn_kernels.runtime import launch_context, native
from dmattn_kernels.runtime.launch_context import launch_stream
from dmattn_kernels.runtime.operands import contiguous_strides
from dmattn_kernels.triton.clear import UnownedRows, token_part
from dmattn_kernels.triton.flash_bwd import (
    flash_bwd_dkdv_kernel,
    flash_bwd_dq_from_ds_kernel,
    flash_bwd_dq_kernel,
    flash_bwd_preprocess_kernel,
    grad_reduce_kernel,
)
from dmattn_kernels.triton.launching import Launch, Workspace
from dmattn_kernels.triton.layouts import CallLayout
from dmattn_kernels.triton.schedule import ActivityPass, BlockLists, list_strides

PREPROCESS_BLOCK_M = 64  # delta = rowsum(dO * O) is memory-bound; any reasonable tile will do
PREPROCESS_NUM_WARPS = 4  # the backward's preprocess launch: delta rows and block-list rows alike
GQA_SUM_BLOCK_N = 64  # keys per program of the (memory-bound) GQA share sum
# dBias tile per program of the (memory-bound) partial sum: rows x keys, fp32
DBIAS_SUM_BLOCK_R, DBIAS_SUM_BLOCK_K = 8, 128
REDUCE_NUM_WARPS = 4


# -- the plan --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Call(CallLayout):
    """A backward call's layout and options, as its launches read them."""

    is_causal: bool
    has_mask: bool
    softmax_scale: float
    softcap: float
    flags: dict  # the constexprs the dK/dV and dQ kernels share
    scalars: tuple  # their last scalar arguments: head divisors, scale, softcap, window
    packing: Packing | None  # packed sequences (`configs.Packing`)
    programs: int  # batch rows, or packed sequences
    rows: int  # query rows and keys a program's grid covers: Lq and Lk, or the longest sequence's
    keys: int
    window: tuple[int, int]
    sequence_strides: tuple[int, int]  # the mask's and bias's offset per key a packed sequence starts at

    @classmethod
    def of(cls, q, k, mask, bias, is_causal: bool, softmax_scale: float, softcap: float,
           window: tuple[int, int] = (-1, -1), packing: Packing | None = None) -> _Call:
        """The call's layout, the mask and bias read by their shapes and strides (as passed: up to 4 dims)."""
        layout = CallLayout.of(q.shape, k.shape, None if mask is None else (mask.shape, mask.stride()),
                               None if bias is None else (bias.shape, bias.stride()))
        programs, rows, keys = layout.batch, layout.seqlen_q, layout.seqlen_k
        sequence_strides = (0, 0)
        if packing is not None:
            programs, rows, keys = packing.num_sequences, packing.max_seqlen_q, packing.max_seqlen_k
            sequence_strides = (layout.mask_strides[3] if packing.mask_per_key else 0,
                                layout.bias_strides[3] if packing.bias_per_key else 0)
        has_window, window_left, window_right = window_bounds(window, is_causal, rows, keys)
        flags = dict(GROUP=layout.group, HEAD_DIM=layout.head_dim, BLOCK_D=layout.block_d, IS_CAUSAL=is_causal,
                     HAS_MASK=mask is not None, HAS_BIAS=bias is not None, HAS_SOFTCAP=softcap > 0,
                     BIAS_PER_KEY=layout.bias_per_key, LISTED=mask is not None and packing is None,
                     VARLEN=packing is not None, HAS_SEQUSED=packing is not None and packing.seqused_k,
                     HAS_WINDOW=has_window)
        scalars = (layout.mask_head_div, layout.bias_head_div, softmax_scale, softcap if softcap > 0 else 1.0,
                   window_left, window_right)
        return cls(**vars(layout), is_causal=is_causal, has_mask=mask is not None, softmax_scale=softmax_scale,
                   softcap=softcap, flags=flags, scalars=scalars, packing=packing, programs=programs, rows=rows,
                   keys=keys, window=window, sequence_strides=sequence_strides)


class _DbiasTarget(NamedTuple):
    """Where the dK/dV kernel writes dBias (`BackwardPlan._dbias_target`)."""

    rows: bool  # a row per query row (else one per query block)
    heads_per_program: int  # query heads a dK/dV program loops over: GROUP in group mode, else 1
    strides: tuple[int, ...]  # of what it writes: dbias itself or the fp32 partial (zeros without dbias)
    partial_shape: tuple[int, ...] | None  # the fp32 partial; None: the kernel writes dbias itself (or none)


def _dbias_sum(partial_shape, partial_strides, dbias) -> tuple[tuple, dict, int]:
    """`grad_reduce_kernel`'s dBias part: its scalars, flags and program count (none without partials)."""
    if partial_shape is None:
        return (0,) * 15, dict(ROW_SUM=False, KEY_SUM=False), 0
    partial_batch, partial_heads, partial_rows, partial_keys = partial_shape
    dbias_batch, dbias_heads, dbias_rows, dbias_keys = dbias.shape
    row_sum = dbias_rows == 1 and partial_rows > 1
    key_sum = dbias_keys == 1 and partial_keys > 1
    row_tiles = 1 if row_sum else triton.cdiv(dbias_rows, DBIAS_SUM_BLOCK_R)
    key_tiles = 1 if key_sum else triton.cdiv(dbias_keys, DBIAS_SUM_BLOCK_K)
    scalars = (*partial_strides, *dbias.stride(), partial_rows, partial_keys, partial_batch // dbias_batch,
               partial_heads // dbias_heads, dbias_heads, row_tiles, key_tiles)
    return scalars, dict(ROW_SUM=row_sum, KEY_SUM=key_sum), dbias_batch * dbias_heads * row_tiles * key_tiles


class BackwardPlan:
    """A backward call's launches for one signature; `plan(dout, q, k, v, out, lse, mask, bias, dq,
    dk, dv, dbias, activity, dlse)` runs them.

    Launches: the preprocess (delta with dlse folded in, and with a mask the block lists of both
    kernels' tiles from the forward's activity, or from one more activity pass without it), dK/dV
    (and dBias partials), dQ, then, where there is anything to sum, one reduction (the GQA shares
    of dK/dV and dBias's broadcast dims where the kernel kept them apart).

    The mask and bias come as the caller passed them (up to 4 dims, as `forward.ForwardPlan`'s);
    dbias is the bias's 4-D broadcast shape. `window` and `packing` as `forward.ForwardPlan`'s
    (each run then given `sequences`); a packed run first zeroes what no program writes
    (`_clear_unwritten`).
    """

    def __init__(self, dout, q, k, v, out, lse, mask, bias, *, is_causal: bool, softmax_scale: float, softcap: float,
                 config: BwdConfig, dq, dk, dv, dbias, dlse, window: tuple[int, int] = (-1, -1),
                 packing: Packing | None = None):
        call = _Call.of(q, k, mask, bias, is_causal, softmax_scale, softcap, window, packing)
        self.packing = packing
        self.device, self.lse_shape = q.device, tuple(lse.shape)
        self.num_heads_kv, self.group = call.num_heads_kv, call.group
        dbias_target = self._dbias_target(call, config, dbias)
        self.partial_shape = dbias_target.partial_shape
        self._schedules(call, config, mask, dbias_target.heads_per_program)
        self.preprocess = self._preprocess_launch(call, dout, out, lse, dlse)
        self.dkdv = self._dkdv_launch(call, config, dbias_target, q, k, v, dout, lse, dk, dv, dbias)
        self.dq = self._dq_launch(call, config, dbias_target, q, k, v, dout, lse, dq, dbias)
        self.reduce = self._reduce_launch(call, dbias_target, dk, dv, dbias)
        self.workspace = self._scratch()
        self.unowned = self._unowned_rows(call, dq, dk, dv)
        self.launches = [launch for launch in (self.preprocess, self.dkdv, self.dq, self.reduce) if launch is not None]
        if self.unowned is not None:
            self.launches.insert(0, self.unowned.launch)
        self.compiled = False  # every launch has its compiled launcher (after the first run)
        self.native = None  # `allocate_and_run`'s `native.Program`, once the kernels are compiled
        self.native_tried = False
        self.native_own_activity = False  # the program runs the activity pass (the forward left none)

    @staticmethod
    def _dbias_target(call: _Call, config: BwdConfig, dbias) -> _DbiasTarget:
        """Where the dK/dV kernel writes dBias. Split mode (one program per query head) writes
        (B, H, Lq or one row per query block, Lk). Group mode (one program per kv head, looping over
        its query heads) is chosen for a bias with query rows and fewer heads than the query,
        (B, Hkv|1, Lq, Lk) under GQA: it sums dS over the group in registers and writes
        (B, Hkv, Lq, Lk), 1/GROUP of split mode's fp32 partial (2 GiB at B2 H16 L4096) and none
        at all for a contiguous (B, Hkv, Lq, Lk) bias. Everywhere else split mode stays:
        per-kv-head programs leave most SMs idle (flash_bwd.py docstring). The target is dbias
        itself where the shapes agree (never zero-filled: the kernel writes every element,
        skipped tiles as zeros), else fp32 scratch summed by `grad_reduce_kernel`."""
        if dbias is None:
            return _DbiasTarget(True, 1, (0, 0, 0, 0), None)
        if call.packing is not None:  # a per-row bias has rows; a per-key one a row per query block
            rows = not call.packing.bias_per_key
        else:
            rows = dbias.shape[2] != 1 or call.seqlen_q == 1
        heads_per_program = call.group if rows and dbias.shape[1] < call.num_heads else 1
        # a packed per-row bias's columns are keys of the row's own sequence: max_seqlen_k of them
        keys = call.seqlen_k if call.packing is None or call.packing.bias_per_key else call.packing.max_seqlen_k
        shape = (call.batch, call.num_heads // heads_per_program,
                 call.seqlen_q if rows else triton.cdiv(call.rows, config.block_m), keys)
        if tuple(dbias.shape) == shape and dbias.is_contiguous():
            return _DbiasTarget(rows, heads_per_program, dbias.stride(), None)
        return _DbiasTarget(rows, heads_per_program, contiguous_strides(shape), shape)

    def _schedules(self, call: _Call, config: BwdConfig, mask, heads_per_program: int) -> None:
        """With a mask, its activity pass and the block lists of both kernels' tiles."""
        self.activity = self.kv_lists = self.q_lists = None
        self.group_union = False
        if mask is None or call.packing is not None:  # a packed call reads its mask tile by tile
            return
        self.activity = ActivityPass(call.mask_shape, call.mask_strides, mask.element_size(), mask.data_ptr(),
                                     call.seqlen_q, call.seqlen_k, call.is_causal, call.window)
        kv_active_shape = self.activity.shape
        # group mode visits the union of its query heads' tiles (each tile still applies its
        # own head's mask); a mask with Hkv or 1 heads already has one list per kv head
        self.group_union = heads_per_program > 1 and call.mask_shape[1] == call.num_heads
        if self.group_union:
            kv_active_shape = (kv_active_shape[0], call.num_heads_kv, *kv_active_shape[2:])
        self.kv_lists = BlockLists(kv_active_shape, config.block_m, config.block_n, key_major=True)
        self.q_lists = BlockLists(self.activity.shape, config.block_m_dq, config.block_n_dq, key_major=False)

    def _preprocess_launch(self, call: _Call, dout, out, lse, dlse) -> Launch:
        """One launch: delta = rowsum(dO * O) - dlse and, with a mask, both kernels' block lists."""
        delta_strides = contiguous_strides(lse.shape)
        delta_blocks = triton.cdiv(call.seqlen_q, PREPROCESS_BLOCK_M)
        list_scalars, list_cells = [], {}
        for name, lists in (("KV", self.kv_lists), ("Q", self.q_lists)):
            # without a mask no program builds lists: zero programs, placeholder tiles
            list_scalars += [*lists.scalars, lists.rows, lists.programs] if lists is not None else [0] * 13
            cells = lists.cells if lists is not None else (1, 1, 1)
            list_cells.update({f"{name}_OWN_CELLS": cells[0], f"{name}_LIST_CELLS": cells[1],
                               f"{name}_CHUNK": cells[2]})
        list_programs = sum(lists.programs for lists in (self.kv_lists, self.q_lists) if lists is not None)
        return Launch(
            flash_bwd_preprocess_kernel, (list_programs + delta_blocks * call.batch * call.num_heads,),
            (*out.stride(), *dout.stride(), *delta_strides, *lse.stride(),
             *(dlse.stride() if dlse is not None else (0, 0, 0)), call.num_heads, call.seqlen_q, delta_blocks,
             *list_scalars),
            dict(HEAD_DIM=call.head_dim, BLOCK_D=call.block_d, BLOCK_M=PREPROCESS_BLOCK_M, HAS_DLSE=dlse is not None,
                 HAS_MASK=self.activity is not None, **list_cells),
            num_warps=PREPROCESS_NUM_WARPS,
        )

    def _dkdv_launch(self, call: _Call, config: BwdConfig, dbias_target: _DbiasTarget, q, k, v, dout, lse, dk, dv,
                     dbias) -> Launch:
        """dK, dV (and dBias partials): one program per key block and query head (split mode) or
        kv head (group mode); under GQA in split mode each query head's fp32 share (`share_shape`),
        summed by `grad_reduce_kernel` in a fixed order (deterministic, no atomics)."""
        self.share_shape = None
        dk_strides, dv_strides = dk.stride(), dv.stride()
        if call.group > 1 and dbias_target.heads_per_program == 1:
            self.share_shape = (call.batch, call.seqlen_k, call.num_heads, call.head_dim)
            dk_strides = dv_strides = contiguous_strides(self.share_shape)
        return Launch(
            flash_bwd_dkdv_kernel,
            (triton.cdiv(call.keys, config.block_n), call.programs * call.num_heads // dbias_target.heads_per_program),
            (*q.stride(), *k.stride(), *v.stride(), *call.mask_strides, *call.bias_strides, *dout.stride(),
             *lse.stride(), *dk_strides, *dv_strides, *dbias_target.strides, *list_strides(self.kv_lists),
             *call.sequence_strides, call.num_heads, call.rows, call.keys, *call.scalars),
            dict(BLOCK_M=config.block_m, BLOCK_N=config.block_n, HAS_DBIAS=dbias is not None,
                 DBIAS_ROWS=dbias_target.rows, HEADS_PER_PROGRAM=dbias_target.heads_per_program, **call.flags),
            num_warps=config.num_warps, num_stages=config.num_stages,
        )

    def _dq_launch(self, call: _Call, config: BwdConfig, dbias_target: _DbiasTarget, q, k, v, dout, lse, dq,
                   dbias) -> Launch:
        """dQ: one program per query block and query head; from the stored dS when the dK/dV
        kernel wrote it whole, as the gradient of a full per-head bias without softcap."""
        self.dq_from_ds = (dbias is not None and self.partial_shape is None and dbias_target.rows
                           and dbias_target.heads_per_program == 1 and call.softcap <= 0 and call.packing is None)
        grid = (triton.cdiv(call.rows, config.block_m_dq), call.programs * call.num_heads)
        q_blocks_strides = list_strides(self.q_lists)
        if self.dq_from_ds:
            return Launch(
                flash_bwd_dq_from_ds_kernel, grid,
                (*dbias.stride(), *k.stride(), *dq.stride(), *q_blocks_strides,
                 call.num_heads, call.seqlen_q, call.seqlen_k, call.mask_head_div, call.softmax_scale,
                 *call.scalars[-2:]),
                dict(GROUP=call.group, HEAD_DIM=call.head_dim, BLOCK_D=call.block_d, BLOCK_M=config.block_m_dq,
                     BLOCK_N=config.block_n_dq, IS_CAUSAL=call.is_causal, HAS_MASK=call.has_mask,
                     HAS_WINDOW=call.flags["HAS_WINDOW"]),
                num_warps=config.num_warps, num_stages=config.num_stages,
            )
        return Launch(
            flash_bwd_dq_kernel, grid,
            (*q.stride(), *k.stride(), *v.stride(), *call.mask_strides, *call.bias_strides, *dout.stride(),
             *lse.stride(), *dq.stride(), *q_blocks_strides, *call.sequence_strides, call.num_heads, call.rows,
             call.keys, *call.scalars),
            dict(BLOCK_M=config.block_m_dq, BLOCK_N=config.block_n_dq, **call.flags),
            num_warps=config.num_warps, num_stages=config.num_stages,
        )

    def _reduce_launch(self, call: _Call, dbias_target: _DbiasTarget, dk, dv, dbias) -> Launch | None:
        """The sums after the main kernels, one launch: the GQA shares and dBias's broadcast dims;
        None where there is nothing to sum."""
        if self.share_shape is None and self.partial_shape is None:
            return None
        share_blocks = triton.cdiv(call.seqlen_k, GQA_SUM_BLOCK_N)
        share_programs = share_blocks * call.batch * call.num_heads_kv if self.share_shape is not None else 0
        share_strides = contiguous_strides(self.share_shape) if self.share_shape is not None else (0, 0, 0, 0)
        partial_scalars, partial_flags, partial_programs = _dbias_sum(self.partial_shape, dbias_target.strides, dbias)
        return Launch(
            grad_reduce_kernel, (share_programs + partial_programs,),
            (*share_strides, *dk.stride(), *dv.stride(), call.num_heads_kv, call.seqlen_k, share_blocks, share_programs,
             *partial_scalars),
            dict(GROUP=call.group, HEAD_DIM=call.head_dim, BLOCK_D=call.block_d, BLOCK_N=GQA_SUM_BLOCK_N,
                 HAS_SHARES=self.share_shape is not None, HAS_PARTIAL=self.partial_shape is not None,
                 BLOCK_R=DBIAS_SUM_BLOCK_R, BLOCK_K=DBIAS_SUM_BLOCK_K, **partial_flags),
            num_warps=REDUCE_NUM_WARPS,
        )

    def _scratch(self) -> Workspace:
        """Everything a run writes that dies with it, in one allocation."""
        parts = {"delta": (self.lse_shape, torch.float32)}
        if self.activity is not None:
            parts.update(kv_blocks=(self.kv_lists.shape, torch.int32), q_blocks=(self.q_lists.shape, torch.int32))
        if self.partial_shape is not None:
            parts["partial"] = (self.partial_shape, torch.float32)
        if self.share_shape is not None:
            parts.update(dk_share=(self.share_shape, torch.float32), dv_share=(self.share_shape, torch.float32))
        return Workspace(parts)

    def _unowned_rows(self, call: _Call, dq, dk, dv) -> UnownedRows | None:
        """A packed run's fill of the rows no sequence owns (`clear.UnownedRows`): dQ's, and the
        key rows of what the dK/dV kernel writes, dK and dV or, in split mode under GQA, their
        shares (`grad_reduce_kernel` sums every key row of those, writing dK and dV whole). With
        seqused_k the keys a sequence does not use are unwritten inside it too: those buffers
        are zero-filled whole instead (`_clear_unwritten`)."""
        if call.packing is None:
            return None
        key_parts = []
        if not call.packing.seqused_k:
            if self.share_shape is not None:
                key_parts = [token_part(self.share_shape, contiguous_strides(self.share_shape))] * 2
            else:
                key_parts = [token_part(dk.shape, dk.stride()), token_part(dv.shape, dv.stride())]
        return UnownedRows([token_part(dq.shape, dq.stride())], key_parts, call.packing.num_sequences)

    def _clear_unwritten(self, stream, buffer, scratch, dq, dk, dv, dbias, cu_seqlens_q, cu_seqlens_k) -> None:
        """Before a packed run's kernels, zeros where none of them writes: the rows no sequence
        owns (`_unowned_rows`), and whole buffers where unwritten elements lie inside the
        sequences too: dK and dV (or their shares) with seqused_k, and always the dBias target
        (dbias, or its fp32 partial when `grad_reduce_kernel` sums it into dbias): no program
        writes a per-row bias's columns past its sequence's keys, nor a per-key bias's partial
        rows past its sequence's query blocks or the keys of a sequence without query rows."""
        if self.packing.seqused_k:
            if self.share_shape is not None:
                self.workspace.tensor(buffer, "dk_share").zero_()
                self.workspace.tensor(buffer, "dv_share").zero_()
            else:
                dk.zero_()
                dv.zero_()
            key_rows = ()
        elif self.share_shape is not None:
            key_rows = (scratch["dk_share"], scratch["dv_share"])
        else:
            key_rows = (dk, dv)
        if dbias is not None:
            (dbias if self.partial_shape is None else self.workspace.tensor(buffer, "partial")).zero_()
        self.unowned.run(stream, (dq, *key_rows), cu_seqlens_q, cu_seqlens_k)

    def allocate_and_run(self, dout, q, k, v, out, lse, mask, bias, activity, dlse) -> tuple | None:
        """(dq, dk, dv, dbias or None) in new tensors (dbias 4-D) as one native call, once a run
        from Python compiled the kernels; None before that (the caller allocates and calls the
        plan) and where the path is off."""
        if self.native is None or (mask is not None and (activity is None) != self.native_own_activity):
            return None
        stream = launch_stream()
        if stream is None or launch_context.LAUNCH_OBSERVERS:
            return None
        return self.native(stream, dout, q, k, v, out, lse, mask, bias, activity, dlse)

    def _go_native(self, device, mask, bias, dq, dk, dv, dbias, activity, dlse) -> None:
        """`allocate_and_run`'s program: the gradients (shapes and dtypes of this run's), one
        scratch buffer, the launches of `__call__` with the same arguments. A mask whose forward
        left no activity (the CUDA forward's) gets its activity pass in the program, into a buffer
        of its own. A group-mode union of the mask's activity (a torch op) stays in Python."""
        self.native_tried = True
        if self.group_union or self.packing is not None:  # packed calls stay on the Python path
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
                                 kv_blocks, q, q, q])]
        if self.dq_from_ds:
            kernels.append((self.dq, [dbias_out, k, dq_out, q_blocks]))
        else:
            kernels.append((self.dq, [q, k, v, mask_arg, bias_arg, dout, lse, delta, dq_out, q_blocks, q, q, q]))
        if self.reduce is not None:
            kernels.append((self.reduce, [dk_share, dv_share, dk_out, dv_out, partial, dbias_out]))
        self.native = native.program(device, 10, allocations, [], kernels,
                                     (0, 1, 2, 3 if dbias is not None else -1))

    def __call__(self, dout, q, k, v, out, lse, mask, bias, dq, dk, dv, dbias, activity=None, dlse=None,
                 sequences=(None, None, None)) -> None:
        stream = launch_stream()
        buffer = self.workspace.allocate(self.device)
        sequences = tuple(q if t is None else t for t in (tuple(sequences) + (None,) * 3)[:3])
        # addresses once every kernel is compiled; tensors for the JIT (the first run, a profiler)
        by_address = stream is not None and self.compiled
        scratch = self.workspace.pointers(buffer) if by_address else self.workspace.tensors(buffer)
        if self.packing is not None:
            self._clear_unwritten(stream, buffer, scratch, dq, dk, dv, dbias, *sequences[:2])
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
        self.dkdv.run(stream, q, k, v, mask_arg, bias_arg, dout, lse, delta, dk_share, dv_share, partial, kv_blocks,
                      *sequences)
        if self.dq_from_ds:
            self.dq.run(stream, dbias, k, dq, q_blocks)
        else:
            self.dq.run(stream, q, k, v, mask_arg, bias_arg, dout, lse, delta, dq, q_blocks, *sequences)
        if self.reduce is not None:
            self.reduce.run(stream, dk_share, dv_share, dk, dv, partial, q if dbias is None else dbias)
        if not self.compiled:
            self.compiled = all(launch.launcher is not None for launch in self.launches)

    def run_and_prepare(self, dout, q, k, v, out, lse, mask, bias, dq, dk, dv, dbias, activity=None,
                        dlse=None, sequences=(None, None, None)) -> None:
        """`__call__` for the runtime: once the kernels are compiled it also builds the program
        of its later runs (`allocate_and_run`; the validator's and tuner's plans build none)."""
        self(dout, q, k, v, out, lse, mask, bias, dq, dk, dv, dbias, activity, dlse, sequences)
        if self.compiled and not self.native_tried and launch_stream() is not None:
            self._go_native(q.device, mask, bias, dq, dk, dv, dbias, activity, dlse)

