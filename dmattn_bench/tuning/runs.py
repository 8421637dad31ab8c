"""How a case runs: its inputs as the launchers take them (`launch_operands`), through a kernel
into NaN-poisoned outputs (`run_kernel`, `run_decode`) and through the single reference
(`run_reference`), each run's tensors returned in the reference's layouts: what the validator's
rules judge (`validator`) and the tuner's trials time (`trials`).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from dmattn_bench import plan, reference, tiles
from dmattn_bench.registry import Backend
from dmattn_bench.space import BwdConfig, DecodeConfig, FwdConfig, Packing, as_4d
from dmattn_bench.tuning.adversarial import NO_WINDOW, Case, Inputs


@dataclass
class Operands:
    """A case's inputs as the launchers take them: a packed call's as the 4-D views of one batch
    row (`configs.Packing`), with the options (`window`, `packing` only where set, as the runtime
    passes them) and what each run takes besides (`sequences`)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    mask: torch.Tensor | None
    bias: torch.Tensor | None
    dout: torch.Tensor
    options: dict
    runs: dict


def _packed_4d(t: torch.Tensor | None) -> torch.Tensor | None:
    """A packed mask or bias as the launchers take it: (H|Hkv|1, total_k) per key as
    (1, H|Hkv|1, 1, total_k), (H|Hkv|1, total_q, max_seqlen_k) per row as (1, ...): views."""
    if t is None:
        return None
    return t[None, :, None, :] if t.dim() == 2 else t[None]


def launch_operands(inputs: Inputs, case: Case) -> Operands:
    """The launchers' arguments for a case's inputs (`Operands`)."""
    options = dict(is_causal=case.causal, softmax_scale=case.head_dim ** -0.5, softcap=case.softcap)
    if case.window_size != NO_WINDOW:
        options["window"] = tuple(case.window_size)
    if inputs.sequences is None:
        return Operands(inputs.q, inputs.k, inputs.v, as_4d(inputs.mask), as_4d(inputs.bias), inputs.dout, options, {})
    cu_seqlens_q, _, seqused_k = inputs.sequences
    options["packing"] = Packing(
        cu_seqlens_q.shape[0] - 1, *inputs.max_seqlens, seqused_k=seqused_k is not None,
        mask_per_key=inputs.mask is not None and inputs.mask.dim() == 2,
        bias_per_key=inputs.bias is not None and inputs.bias.dim() == 2)
    return Operands(inputs.q[None], inputs.k[None], inputs.v[None], _packed_4d(inputs.mask), _packed_4d(inputs.bias),
                    inputs.dout[None], options, {"sequences": inputs.sequences})


def fill_unowned(out: torch.Tensor, lse: torch.Tensor, inputs: Inputs) -> None:
    """A packed call's out and lse rows that no sequence owns as the front end fills them before
    the forward (out 0, lse -inf; the launchers leave them as given); nothing for a dense call."""
    if inputs.owned_rows is None:
        return
    first, end = inputs.owned_rows
    for rows in (slice(0, first), slice(end, None)):
        out[:, rows] = 0
        lse[:, :, rows] = float("-inf")


def poisoned_outputs(operands: Operands, inputs: Inputs, written: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """out and lse filled with NaN, then `fill_unowned`: an element the kernel should write and
    did not fails rule 1. written=False: allocated alike and left unwritten (a compile-only launch)."""
    q = operands.q
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32, device=q.device)
    if written:
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        fill_unowned(out, lse, inputs)
    return out, lse


def user_layout(result: dict[str, torch.Tensor], inputs: Inputs) -> dict[str, torch.Tensor]:
    """A run's tensors in the layouts the reference returns them in (those a user gets): dbias
    in the bias's shape, and a packed call's without the launchers' batch row."""
    if inputs.sequences is not None:
        result = {name: t if name == "dbias" else t[0] for name, t in result.items()}
    if "dbias" in result:
        result["dbias"] = result["dbias"].view(inputs.bias.shape)
    return result


def kernel_layout(forward: tuple[torch.Tensor, torch.Tensor], inputs: Inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) in the reference's layouts (`user_layout`) as the launchers take them."""
    out, lse = forward
    return (out, lse) if inputs.sequences is None else (out[None], lse[None])


def run_kernel(backend: Backend, inputs: Inputs, case: Case, fwd_config: FwdConfig | None,
               bwd_config: BwdConfig | None, forward: tuple[torch.Tensor, torch.Tensor] | None = None
               ) -> dict[str, torch.Tensor]:
    """Forward and backward through `backend` into NaN-poisoned buffers (`poisoned_outputs`),
    returned in the reference's layouts (`user_layout`).

    Either direction can be left out (its config None). Without the forward, the backward reads
    `forward` (out, lse, in the reference's layouts), e.g. the reference's: that is how a
    backward config is checked on its own, as the tuner times it.
    """
    operands = launch_operands(inputs, case)
    q, k, v, mask, bias, options = operands.q, operands.k, operands.v, operands.mask, operands.bias, operands.options
    nan = float("nan")
    result = {}
    if fwd_config is not None:
        out, lse = poisoned_outputs(operands, inputs)
        # the tiles a call runs: an fp32 bias may halve a 16-bit bias's key tiles to fit
        if backend.forward_plan is not None:
            fwd_config, _ = tiles.fit_forward(
                backend.name, fwd_config, lambda config: backend.forward_plan(
                    q, k, v, mask, bias, config=config, out=out, lse=lse, **options),
                q_dtype=q.dtype, bias_dtype=None if bias is None else bias.dtype,
                limit=tiles.shared_memory_limit(q.device))
        backend.forward(q, k, v, mask, bias, config=fwd_config, out=out, lse=lse, **options, **operands.runs)
        result.update(out=out, lse=lse)
    else:
        out, lse = kernel_layout(forward, inputs)
    if bwd_config is None:
        return user_layout(result, inputs)
    dq = torch.full(q.shape, nan, dtype=q.dtype, device=q.device)
    dk = torch.full(k.shape, nan, dtype=k.dtype, device=k.device)
    dv = torch.full(v.shape, nan, dtype=v.dtype, device=v.device)
    with_dbias = bias is not None and case.bias_grad
    dbias = torch.full(bias.shape, nan, dtype=bias.dtype, device=bias.device) if with_dbias else None
    backend.backward(operands.dout, q, k, v, out, lse, mask, bias, config=bwd_config, dq=dq, dk=dk,
                     dv=dv, dbias=dbias, **options, **operands.runs)
    result.update(dq=dq, dk=dk, dv=dv)
    if with_dbias:
        result["dbias"] = dbias
    return user_layout(result, inputs)


def run_reference(inputs: Inputs, case: Case, compute_dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """The reference's out, lse and gradients; `compute_dtype=None` means high precision."""
    high = compute_dtype is None
    dtype = (torch.float64 if inputs.q.device.type == "cpu" else torch.float32) if high else compute_dtype

    def leaf(t):
        return t.detach().to(dtype if high else t.dtype).requires_grad_()

    q, k, v = leaf(inputs.q), leaf(inputs.k), leaf(inputs.v)
    with_dbias = inputs.bias is not None and case.bias_grad
    bias = None
    if inputs.bias is not None:
        bias = leaf(inputs.bias) if with_dbias else inputs.bias.detach().to(dtype if high else inputs.bias.dtype)
    options = dict(is_causal=case.causal, softmax_scale=case.head_dim ** -0.5, softcap=case.softcap,
                   return_lse=True, compute_dtype=dtype, window_size=tuple(case.window_size))
    with torch.enable_grad():
        if inputs.sequences is None:
            out, lse = reference.attention(q, k, v, inputs.mask, bias, cache_seqlens=inputs.cache_seqlens,
                                           block_table=inputs.block_table, **options)
        else:
            cu_seqlens_q, cu_seqlens_k, seqused_k = inputs.sequences
            out, lse = reference.varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, *inputs.max_seqlens,
                                                  inputs.mask, bias, seqused_k=seqused_k, **options)
        wrt = [q, k, v] + ([bias] if with_dbias else [])
        with warnings.catch_warnings():
            # in a fresh worker process autograd's device thread has no CUDA context yet at its
            # first matmul: torch warns once and sets the primary context (15 lines per 2-GPU tune)
            warnings.filterwarnings("ignore", message="Attempting to run cuBLAS, but there was no current CUDA context")
            grads = torch.autograd.grad(out, wrt, inputs.dout.to(out.dtype))
    result = {"out": out.detach(), "lse": lse.detach()}
    result.update(zip(("dq", "dk", "dv", "dbias"), grads))
    return result


def reference_forward(high: dict[str, torch.Tensor], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) a backward checked or timed on its own reads: the high-precision reference's,
    out rounded to the kernel's dtype."""
    return high["out"].to(dtype), high["lse"].float()


def run_decode(inputs: Inputs, case: Case, config: DecodeConfig) -> dict[str, torch.Tensor]:
    """The short-query forward (`decode_launch.DecodePlan`, the split count the runtime picks on
    this device) into NaN-poisoned out and lse."""
    from dmattn_kernels.triton.decode_launch import DecodePlan

    q = inputs.q
    out = torch.full(q.shape, float("nan"), dtype=q.dtype, device=q.device)
    lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("nan"), dtype=torch.float32, device=q.device)
    mask, bias = as_4d(inputs.mask), as_4d(inputs.bias)
    window = {} if case.window_size == NO_WINDOW else {"window": tuple(case.window_size)}
    launch = DecodePlan(q, inputs.k, inputs.v, mask, bias, inputs.cache_seqlens, inputs.block_table,
                        is_causal=case.causal, softmax_scale=case.head_dim ** -0.5, softcap=case.softcap, config=config,
                        out=out, lse=lse, num_sms=plan.sm_count(q.device), **window)
    launch(q, inputs.k, inputs.v, mask, bias, inputs.cache_seqlens, inputs.block_table, out, lse)
    return {"out": out, "lse": lse}
