"""A call's launch plan: what a `flash_dmattn_func` call needs that does not depend on its data,
built by its first call and reused by every later call of the same signature and by their
backward passes.

A signature is the shapes, strides, dtypes, device and 16-byte alignment of q, k, v, the mask and
the bias, the flags and scalars, the backend, table and configs asked for, whether the bias needs
a gradient, and the dispatch state (the table the environment names, `use_table`, the backends
replaced: `registry.overrides`). Building a plan chooses the forward's backend and config
(`dmattn_bench.tiles`, once per signature and direction; the backward's and the short-query
forward's on their first use) and, on the first run of each direction, prepares its launches
(the backends' `ForwardPlan`, Triton's `BackwardPlan` and `DecodePlan`: grids, strides, flags,
compiled handles, native programs; a forward's config fitted to the GPU there). Running one
allocates the outputs and launches. The mask and bias reach the launchers as the caller passed
them.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Callable

import torch

from dmattn_bench import dispatch, registry, tiles
from dmattn_bench.reference import cache_length
from dmattn_bench.registry import get_backend
from dmattn_bench.space import (DTYPE_NAMES, MAX_DECODE_QUERIES, AttentionShape, BwdConfig, FwdConfig, TableKey,
                                operand_kind, seqlen_bucket, window_bucket)
from dmattn_kernels.configs import Packing
from dmattn_kernels.runtime import native
from dmattn_kernels.runtime.launch_context import launch_stream
from dmattn_kernels.runtime.operands import padded_shape
from dmattn_kernels.runtime.plan_cache import PlanCache, python_tensor_layouts

INTERPRETER_SMS = 4
NO_WINDOW = (-1, -1)  # window_size's default: no sliding window
NO_SEQUENCES = (None, None, None)  # a dense call's (cu_seqlens_q, cu_seqlens_k, seqused_k)


def table_keys(q_shape, seqlen_k: int, num_heads_kv: int, dtype: torch.dtype, mask_dims, bias_dims,
               is_causal: bool, bias_requires_grad: bool, window: tuple[int, int] = NO_WINDOW,
               packing: Packing | None = None) -> tuple[TableKey, TableKey]:
    """The (fwd, bwd) dispatch keys of a call, derived as the tuner derives them for workloads
    (a packed call's lengths are its longest sequence's; `q_shape` is its (1, total_q, H, D) view)."""
    batch, seqlen_q, num_heads, head_dim = q_shape
    mask_kind = operand_kind(mask_dims, num_heads, num_heads_kv, seqlen_q)
    bias_kind = operand_kind(bias_dims, num_heads, num_heads_kv, seqlen_q)
    if packing is not None:
        seqlen_q = packing.max_seqlen_q
    common = dict(dtype=DTYPE_NAMES[dtype], head_dim=head_dim, causal=is_causal, mask=mask_kind,
                  gqa_ratio=num_heads // num_heads_kv, seqlen_q_bucket=seqlen_bucket(seqlen_q),
                  seqlen_k_bucket=seqlen_bucket(seqlen_k), packed=packing is not None,
                  window=window_bucket(window, is_causal))
    bwd_bias = bias_kind + "+grad" if bias_requires_grad and bias_kind != "none" else bias_kind
    return TableKey(direction="fwd", bias=bias_kind, **common), TableKey(direction="bwd", bias=bwd_bias, **common)


def _choose(key: TableKey, device: torch.device, backend: str, table: str | None,
            explicit: FwdConfig | BwdConfig | None, env: str | None):
    """(Backend, config) for one direction's key (`tiles.choose`)."""
    choice = tiles.choose(key, device, backend=backend, table=table, explicit=explicit, env=env)
    return get_backend(choice.backend), choice.config


def direction_key(keys: tuple[TableKey, TableKey], direction: str) -> TableKey:
    """The key of `direction` among a call's `table_keys`: the short-query forward ("decode")
    runs under the forward's key in its own direction."""
    if direction == "decode":
        return replace(keys[0], direction="decode")
    return keys[0 if direction == "fwd" else 1]


def select(direction: str, query, key, mask4, bias4, is_causal: bool, backend: str, table: str | None,
           explicit: FwdConfig | BwdConfig | None, bias_requires_grad: bool, block_table=None,
           window: tuple[int, int] = NO_WINDOW):
    """(Backend, config) a call of these arguments runs `direction` with, before the fp32-bias fit
    (`block_table`: `key` is a paged cache's pool)."""
    keys = table_keys(tuple(query.shape), cache_length(key, block_table), key.shape[2], query.dtype,
                      None if mask4 is None else tuple(mask4.shape), None if bias4 is None else tuple(bias4.shape),
                      is_causal, bias_requires_grad, window)
    return _choose(direction_key(keys, direction), query.device, backend, table, explicit,
                   os.environ.get(dispatch.ENV_VAR))


def sm_count(device: torch.device) -> int:
    """The GPU's streaming multiprocessors (the decode split count aims at them); a few in the
    interpreter, so its calls split the keys too."""
    if device.type != "cuda":
        return INTERPRETER_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


class AttentionPlan:
    """One call signature's choices and launches (module docstring).

    `window`: FlashAttention's (left, right) sliding window. `packing`: a packed call
    (`dmattn_bench.varlen`), whose operands are the 4-D views of `configs.Packing` and whose runs
    take their `sequences` (cu_seqlens_q, cu_seqlens_k, seqused_k or None); the Triton kernels
    run both, never the short-query forward; the CUDA kernels run both in their warp-specialized
    kernels only (the forward's overlapped one), where the table or an explicit config chooses
    them (`tiles.key_problem`)."""

    def __init__(self, q, k, v, mask, bias, *, is_causal: bool, softmax_scale: float, softcap: float, backend: str,
                 table: str | None, fwd_config: FwdConfig | None, bwd_config: BwdConfig | None,
                 bias_requires_grad: bool, cache_seqlens: torch.Tensor | None = None,
                 block_table: torch.Tensor | None = None, window: tuple[int, int] = NO_WINDOW,
                 packing: Packing | None = None, deterministic: bool = False):
        batch, seqlen_q, num_heads, _ = q.shape
        # a paged cache is (blocks, page, Hkv, D): its logical length is the table's pages x page
        seqlen_k = cache_length(k, block_table)
        self.options = dict(is_causal=is_causal, softmax_scale=softmax_scale, softcap=softcap)
        # passed to the launchers only when set: the CUDA launchers take packing and a window only
        # in their warp-specialized kernels (`tiles.key_problem`)
        self.options.update({name: value for name, value, unset in (("window", window, NO_WINDOW),
                                                                   ("packing", packing, None)) if value != unset})
        self.packing = packing
        if packing is not None:  # a packed call's grids cover its longest sequence
            seqlen_k = packing.max_seqlen_k if k.shape[1] else 0
        self.device, self.dtype = q.device, q.dtype
        self.out_shape, self.lse_shape = tuple(q.shape), (batch, num_heads, seqlen_q)
        self.k_shape = tuple(k.shape)
        # a contiguous input's gradient is allocated as `empty_like` it (a shape tuple costs the
        # host more to parse than a tensor: 2.7 against 4.5 µs, H100 host, `python -m benchmarks host-probe --pieces`)
        self.contiguous = tuple(t.is_contiguous() for t in (q, k, v))
        # the mask and bias go to the launchers as the caller passed them (up to 4-D, broadcastable);
        # dBias is built in the bias's 4-D form and handed back in the caller's shape (a view: the
        # 4-D form only prepends size-1 dims)
        mask_dims = None if mask is None else padded_shape(mask.shape)
        bias_dims = None if bias is None else padded_shape(bias.shape)
        self.bias_shape, self.bias4_shape = None if bias is None else tuple(bias.shape), bias_dims
        self.bias_dtype = None if bias is None else bias.dtype
        self.activity_shape = None  # without a mask there is no tile summary (nor for packed sequences)
        if mask is not None and packing is None:
            # imported on first use: importing the Triton kernels fixes whether the interpreter runs them
            from dmattn_kernels.triton.layouts import activity_shape

            self.activity_shape = activity_shape(mask_dims, seqlen_q, seqlen_k)
        # nothing to compute: no query rows (empty outputs), or no keys (every row dead)
        self.no_rows = batch * seqlen_q * num_heads == 0
        self.no_keys = seqlen_k == 0
        self._requested = (backend, table, bwd_config)
        self._keys = None if self.no_rows or self.no_keys else table_keys(
            tuple(q.shape), seqlen_k, k.shape[2], q.dtype, mask_dims, bias_dims, is_causal, bias_requires_grad,
            window, packing)
        self._env = os.environ.get(dispatch.ENV_VAR)
        if not (self.no_rows or self.no_keys):
            rows = seqlen_q if packing is None else packing.max_seqlen_q
            shape = AttentionShape(batch, rows, seqlen_k, num_heads, k.shape[2], q.shape[-1], is_causal,
                                   mask is not None, bias is not None, bias_requires_grad, softcap)
            tiles.check_explicit(get_backend("triton" if backend == "auto" else backend), shape,
                                 fwd_config=fwd_config, bwd_config=bwd_config)
        self.fwd_backend = self.fwd_config = None
        if not (self.no_rows or self.no_keys or block_table is not None):  # a paged cache only decodes
            # the config may yet be fitted to the GPU when the forward's plan is built (`forward`)
            self.fwd_backend, self.fwd_config = self._choose("fwd", fwd_config)
        # whether the forward leaves the mask's tile activity for the backward (Triton's does)
        self.fills_activity = self.fwd_backend is not None and mask is not None and packing is None and getattr(
            self.fwd_backend.forward_plan, "leaves_activity", False)
        # a call that needs no gradient runs the short-query forward when it has few query rows
        # and no explicit tiles (`decode_launch`); `cache_seqlens` and `block_table` need it
        self.decodes = (backend in ("auto", "triton") and fwd_config is None and not (self.no_rows or self.no_keys)
                        and seqlen_q <= MAX_DECODE_QUERIES and packing is None
                        and (q.is_cuda or registry.interpreter_enabled()))
        for name, given in (("cache_seqlens", cache_seqlens), ("block_table", block_table)):
            if given is not None and not self.decodes:
                raise ValueError(
                    f"{name}: supported by the short-query forward only (Lq <= {MAX_DECODE_QUERIES}, backend "
                    f"'auto' or 'triton', no fwd_config, no gradient); got Lq={seqlen_q}, backend {backend!r}"
                    + (", a fwd_config" if fwd_config is not None else ""))
        self._decode_launch = None
        self._fwd_launch = None
        self._unowned = None  # a packed call's fill of the rows no sequence owns (`_packed_outputs`)
        self.deterministic = deterministic
        self._bwd_choices: dict[bool, tuple] = {}  # by whether the backward must be deterministic
        self._bwd_launches: dict[tuple, object] = {}

    def _choose(self, direction: str, explicit):
        backend, table, _ = self._requested
        return _choose(direction_key(self._keys, direction), self.device, backend, table, explicit, self._env)

    def bwd_deterministic(self) -> bool:
        """Whether this backward must give bitwise-identical gradients on every run: the call asked
        (`deterministic`) or `torch.use_deterministic_algorithms(True)` is on."""
        return self.deterministic or torch.are_deterministic_algorithms_enabled()

    def bwd_choice(self, deterministic: bool = False):
        """The backward's (backend, config), chosen on first use: a call that never runs a backward
        never looks it up. `deterministic`: a config marked non-deterministic (DESIGN.md §1) runs
        in its fixed order instead (`BwdConfig.ordered`)."""
        choice = self._bwd_choices.get(deterministic)
        if choice is None:
            backend, config = self._choose("bwd", self._requested[2])
            if deterministic and not config.deterministic:
                config = config.ordered()
            choice = self._bwd_choices[deterministic] = (backend, config)
        return choice

    # -- forward ---------------------------------------------------------------------------------

    def forward(self, q, k, v, mask, bias, keep_activity: bool = True, keep_lse: bool = True,
                sequences: tuple = NO_SEQUENCES) -> tuple:
        """out, lse and, if `keep_activity` and the forward fills one (`fills_activity`), the mask's
        tile activity for the backward (`activity_shape`), else None.
        The mask and bias as the caller passed them (broadcastable, any dims up to 4).
        `keep_lse=False`: the caller drops lse, which may then be a view of the run's scratch.
        `sequences`: a packed call's (class docstring)."""
        launch = self._fwd_launch
        if launch is not None:  # every call after the first of a forward with a plan (Triton's, CUDA's)
            if self.packing is None:
                return launch.allocate_and_run(q, k, v, mask, bias, keep_activity, keep_lse)
            if launch.fills_unowned:  # Triton's: its plan (and stamp) hold the fill kernel
                return launch.allocate_and_run(q, k, v, mask, bias, keep_activity, keep_lse, sequences)
            out, lse = self._packed_outputs(sequences)
            launch(q, k, v, mask, bias, out, lse, None, sequences=sequences)
            return out, lse, None
        device = self.device
        if self.packing is not None and not (self.no_rows or self.no_keys):
            out, lse = self._packed_outputs(sequences)
        else:
            out = torch.empty(self.out_shape, dtype=self.dtype, device=device)
            lse = torch.empty(self.lse_shape, dtype=torch.float32, device=device)
        if self.no_rows or self.no_keys:  # every row is dead: out 0, lse -inf
            out.zero_()
            lse.fill_(float("-inf"))
            return out, lse, None
        backend = self.fwd_backend
        packed = {} if self.packing is None else {"sequences": sequences}
        if backend.forward_plan is None:
            backend.forward(q, k, v, mask, bias, config=self.fwd_config, out=out, lse=lse, **self.options, **packed)
            return out, lse, None
        activity = None
        if keep_activity and self.fills_activity:
            activity = torch.empty(self.activity_shape, dtype=torch.int8, device=device)
        # built from the first call's tensors (the kernels read only their pointers later), its
        # config fitted to the GPU's shared memory where it may not fit (`tiles.fit_forward`)
        self.fwd_config, launch = tiles.fit_forward(
            backend.name, self.fwd_config, lambda config: backend.forward_plan(
                q, k, v, mask, bias, config=config, out=out, lse=lse, **self.options),
            q_dtype=self.dtype, bias_dtype=self.bias_dtype, limit=tiles.shared_memory_limit(device))
        self._fwd_launch = launch
        launch(q, k, v, mask, bias, out, lse, activity, **packed)
        return out, lse, activity

    def _packed_outputs(self, sequences: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        """A packed call's out and lse, the rows no sequence owns filled on the device (out 0,
        lse -inf: no program of either backend's forward writes them), the rest left to the
        forward (`clear.UnownedRows`, built on the first call): the first call's, and every call's
        of a plan that does not fill them itself (CUDA's, whose launchers import nothing of the
        Triton ones)."""
        out = torch.empty(self.out_shape, dtype=self.dtype, device=self.device)
        lse = torch.empty(self.lse_shape, dtype=torch.float32, device=self.device)
        if self._unowned is None:
            # imported on first use: importing the Triton kernels fixes whether the interpreter runs them
            from dmattn_kernels.triton.clear import UnownedRows, lse_part, token_part

            self._unowned = UnownedRows([token_part(out.shape, out.stride()), lse_part(lse.shape, lse.stride())], [],
                                        self.packing.num_sequences)
        self._unowned.run(launch_stream(), (out, lse), *sequences[:2])
        return out, lse

    def infer(self, q, k, v, mask, bias, cache_seqlens=None, block_table=None,
              keep_lse: bool = True, sequences: tuple = NO_SEQUENCES) -> tuple[torch.Tensor, torch.Tensor]:
        """out and lse of a call that needs no gradient: the short-query forward where `decodes`,
        else `forward`'s (its tile activity unused). `keep_lse=False`: the caller drops lse, which
        may then be a view of the run's scratch buffer (a kept one would keep the buffer alive)."""
        if not self.decodes:
            out, lse, _ = self.forward(q, k, v, mask, bias, keep_activity=False, keep_lse=keep_lse,
                                       sequences=sequences)
            return out, lse
        launch = self._decode_launch
        if launch is None:
            from dmattn_kernels.triton.decode_launch import DecodePlan

            out = torch.empty(self.out_shape, dtype=self.dtype, device=self.device)
            lse = torch.empty(self.lse_shape, dtype=torch.float32, device=self.device)
            _, config = self._choose("decode", None)
            launch = self._decode_launch = DecodePlan(
                q, k, v, mask, bias, cache_seqlens, block_table, **self.options,
                config=config, out=out, lse=lse, num_sms=sm_count(self.device))
        return launch.allocate_and_run(q, k, v, mask, bias, cache_seqlens, block_table, keep_lse)

    def native_program(self, keep_lse: bool):
        """The native program `infer(..., keep_lse)` now runs for this signature, None while there
        is none (before its kernels are compiled, a plan without the native path)."""
        if self.decodes:
            return None if self._decode_launch is None else self._decode_launch.native.get(keep_lse)
        return None if self._fwd_launch is None else self._fwd_launch.native_program(keep_lse)

    # -- backward --------------------------------------------------------------------------------

    def backward(self, dout, q, k, v, out, lse, mask, bias, activity, dlse, bias_requires_grad: bool,
                 sequences: tuple = NO_SEQUENCES):
        """dq, dk, dv and dbias (None unless `bias_requires_grad`). `activity`: the forward's
        summary when it filled one (`fills_activity`), else None. `sequences`: a packed call's."""
        device = self.device
        if dout.stride(-1) != 1:
            dout = dout.contiguous()  # a copy of the incoming gradient, never of an input
        # the incoming gradients' layouts vary between callers (an expanded dout, an lse gradient)
        deterministic = self.bwd_deterministic()
        layout = (dout.stride(), dout.data_ptr() & 15, None if dlse is None else (dlse.stride(), dlse.data_ptr() & 15),
                  bias_requires_grad, deterministic)
        launch = self._bwd_launches.get(layout)
        if launch is not None:  # a Triton plan: once compiled, it allocates and launches in one native call
            grads = launch.allocate_and_run(dout, q, k, v, out, lse, mask, bias, activity, dlse)
            if grads is not None:
                dq, dk, dv, dbias = grads
                return dq, dk, dv, None if dbias is None else dbias.view(self.bias_shape)
        dq, dk, dv = (torch.empty_like(t) if contiguous else torch.empty(t.shape, dtype=self.dtype, device=device)
                      for t, contiguous in zip((q, k, v), self.contiguous))
        dbias = torch.empty(self.bias4_shape, dtype=self.bias_dtype, device=device) if bias_requires_grad else None
        grad_bias = None if dbias is None else dbias.view(self.bias_shape)
        if self.no_rows or self.no_keys:
            for grad in (dq, dk, dv, dbias):
                if grad is not None:
                    grad.zero_()  # no visible key anywhere: nothing flows back
            return dq, dk, dv, grad_bias
        backend, config = self.bwd_choice(deterministic)
        packed = {} if self.packing is None else {"sequences": sequences}
        if backend.backward_plan is None:
            extra = dict(packed) if dlse is None else {"dlse": dlse, **packed}
            if activity is not None and backend.name == "triton":
                extra["activity"] = activity
            backend.backward(dout, q, k, v, out, lse, mask, bias, config=config, dq=dq, dk=dk, dv=dv,
                             dbias=dbias, **self.options, **extra)
            return dq, dk, dv, grad_bias
        if launch is None:
            launch = self._bwd_launches[layout] = backend.backward_plan(
                dout, q, k, v, out, lse, mask, bias, config=config, dq=dq, dk=dk, dv=dv, dbias=dbias,
                dlse=dlse, **self.options)
        launch.run_and_prepare(dout, q, k, v, out, lse, mask, bias, dq, dk, dv, dbias, activity, dlse, **packed)
        return dq, dk, dv, grad_bias


class AttentionFunction(torch.autograd.Function):
    """An eager call with a gradient: the plan's forward, and its backward from the context."""

    @staticmethod
    def forward(ctx, plan: AttentionPlan, query, key, value, attn_mask, attn_bias, sequences=NO_SEQUENCES):
        out, lse, activity = plan.forward(query, key, value, attn_mask, attn_bias, sequences=sequences)
        ctx.save_for_backward(query, key, value, out, lse, attn_mask, attn_bias,
                              activity if plan.fills_activity else None)
        ctx.plan = plan
        ctx.sequences = sequences
        ctx.set_materialize_grads(False)  # an lse the loss does not use sends None, not zeros
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        query, key, value, out, lse, attn_mask, attn_bias, activity = ctx.saved_tensors
        if dout is None:  # the loss reads lse alone
            dout = torch.zeros_like(out)
        bias_requires_grad = attn_bias is not None and ctx.needs_input_grad[5]
        dq, dk, dv, dbias = ctx.plan.backward(dout, query, key, value, out, lse, attn_mask, attn_bias, activity,
                                              dlse, bias_requires_grad, ctx.sequences)
        return None, dq, dk, dv, None, dbias, None


# -- the plan cache ---------------------------------------------------------------------------------


# the tensors' part of a plan key, `tensor_layouts(q, k, v, mask, bias, cache_seqlens, block_table)`:
# `python_tensor_layouts`, or the native launch path's equivalent once a GPU plan has loaded it
# (`use_tensor_layouts`)
tensor_layouts: Callable[..., object] = python_tensor_layouts


def use_tensor_layouts(layouts: Callable[..., object]) -> None:
    """Keys plans by `layouts(q, k, v, mask, bias, cache_seqlens, block_table)` from now on: a
    value that equals another exactly when the tensors' shapes, strides, dtypes, devices and
    16-byte alignments do, raising TypeError on a non-tensor. Plans keyed before stay unused."""
    global tensor_layouts
    tensor_layouts = layouts


def signature(layouts, *options) -> tuple:
    """The plan key of a call (module docstring) from its tensors' `tensor_layouts` and its other
    arguments."""
    return (layouts, os.environ.get(dispatch.ENV_VAR), dispatch.DISPATCHER.generation, registry.overrides, *options)


PLANS = PlanCache(1024)  # the runtime's plans (a training or serving loop repeats a handful of signatures)


def clear() -> None:
    """Forgets every plan (tests; a process that edits its kernels' configs at run time), and the
    programs the native entry runs for them."""
    PLANS.clear()
    loaded = native.loaded()
    if loaded is not None:
        loaded.forget()
