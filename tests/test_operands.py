"""The launchers' one operand normaliser (`dmattn_kernels.runtime.operands`): a mask or bias of
fewer than 4 dims, given straight to either launcher, runs as its 4-D broadcast view does."""

import ast
from pathlib import Path

import pytest
import torch

from dmattn_kernels import target
from dmattn_kernels.configs import BwdConfig, DecodeConfig, FwdConfig
from dmattn_kernels.runtime import operands
from dmattn_kernels.triton import launch
from dmattn_kernels.triton.backward import BackwardPlan
from dmattn_kernels.triton.decode_launch import DecodePlan
from dmattn_kernels.triton.forward import ForwardPlan

KERNELS = Path(__file__).resolve().parents[1] / "kernels"
BATCH, HEADS, HEADS_KV, SEQLEN_Q, SEQLEN_K, DIM = 2, 4, 2, 24, 40, 16


def as_4d(t: torch.Tensor | None) -> torch.Tensor | None:
    """The 4-D broadcast view of a mask or bias: left-padded with size-1 dims (no copy)."""
    return t if t is None or t.dim() == 4 else t[(None,) * (4 - t.dim())]


def test_the_cuda_launchers_import_nothing_of_the_triton_ones():
    imported = {path.name: sorted(node.module for node in ast.walk(ast.parse(path.read_text()))
                                  if isinstance(node, ast.ImportFrom) and node.module
                                  and node.module.startswith("dmattn_kernels.triton"))
                for path in sorted((KERNELS / "cuda").glob("*.py"))}
    assert not {name: modules for name, modules in imported.items() if modules}


@pytest.mark.parametrize("shape", [(40,), (24, 40), (24, 1), (4, 24, 40), (2, 1, 40), (1, 40), (2, 4, 24, 40)])
def test_a_layout_is_its_4d_views(shape):
    """Strides 0 on size-1 and padded dims, the 4-D view's shape, and the head divisor of the
    view's head dim, from the shape and strides alone."""
    t = torch.empty(shape)
    view = as_4d(t)
    zeroed = tuple(0 if size == 1 else stride for size, stride in zip(view.shape, view.stride()))
    assert operands.padded(t.shape, t.stride())[0] == tuple(view.shape)
    assert operands.broadcast_strides(t.shape, t.stride()) == zeroed
    for num_heads, group in ((4, 2), (2, 1), (8, 4)):
        heads = view.shape[1]
        divisor = group if heads not in (num_heads, 1) else 1
        assert operands.broadcast_layout((t.shape, t.stride()), num_heads, group) == (zeroed, divisor)
    assert operands.broadcast_layout(None, 4, 2) == (operands.NO_OPERAND_STRIDES, 1)


def test_rows_are_read_as_words_only_when_contiguous_aligned_and_one_byte_wide():
    mask = torch.zeros(2, 24, 64, dtype=torch.uint8)
    strides = operands.broadcast_strides(mask.shape, mask.stride())
    assert operands.words_readable(strides, 1, 0, 8)
    assert not operands.words_readable(strides, 1, 4, 8)  # the data off the word grid
    assert not operands.words_readable(strides, 2, 0, 8)  # not one byte an element
    odd_rows = torch.zeros(2, 24, 63, dtype=torch.uint8)  # rows of 63 bytes: off the word grid from the second
    assert not operands.words_readable(operands.broadcast_strides(odd_rows.shape, odd_rows.stride()), 1, 0, 8)
    expanded = torch.zeros(24, 1, dtype=torch.uint8).expand(24, 64)  # a broadcast key dim
    assert not operands.words_readable(operands.broadcast_strides(expanded.shape, expanded.stride()), 1, 0, 8)


# (mask dims, bias dims) broadcastable as (B|1, H|Hkv|1, Lq|1, Lk|1) with fewer than 4 dims: "q" and
# "k" stand for the call's Lq and Lk
FEWER_DIMS = [(("q", "k"), ("k",)), (("k",), (HEADS, "q", "k")), ((HEADS_KV, 1, "k"), ("q", "k")),
              ((HEADS, "q", "k"), (HEADS_KV, 1, "k"))]


def _shape(dims, seqlen_q: int, seqlen_k: int) -> tuple[int, ...]:
    return tuple({"q": seqlen_q, "k": seqlen_k}.get(size, size) for size in dims)


def _call(seed: int, mask_dims, bias_dims, mask_dtype=torch.bool, seqlen_q: int = SEQLEN_Q):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(BATCH, seqlen_q, HEADS, DIM, generator=generator)
    k, v = (torch.randn(BATCH, SEQLEN_K, HEADS_KV, DIM, generator=generator) for _ in range(2))
    mask = (torch.rand(_shape(mask_dims, seqlen_q, SEQLEN_K), generator=generator) < 0.6).to(mask_dtype)
    bias = None if bias_dims is None else torch.randn(_shape(bias_dims, seqlen_q, SEQLEN_K), generator=generator)
    return q, k, v, mask, bias


def _launch_view(launch_) -> tuple:
    return (launch_.name, launch_.grid, launch_.scalars, launch_.constexprs, launch_.options)


@pytest.mark.parametrize("mask_dims, bias_dims", FEWER_DIMS)
def test_the_triton_plans_of_a_mask_and_bias_as_given_are_those_of_their_4d_views(mask_dims, bias_dims):
    q, k, v, mask, bias = _call(0, mask_dims, bias_dims)
    short_q, _, _, short_mask, short_bias = _call(0, mask_dims, bias_dims, seqlen_q=2)  # the short-query forward's
    options = dict(is_causal=True, softmax_scale=DIM ** -0.5, softcap=0.0)
    out, lse = torch.empty_like(q), torch.empty(BATCH, HEADS, SEQLEN_Q)
    plans = []
    for view in (lambda t: t, as_4d):
        with target.planning_for("sm90"):  # the TMA forward's descriptors too
            forward = ForwardPlan(q, k, v, view(mask), view(bias), config=FwdConfig(16, 32, 4, 2), out=out, lse=lse,
                                  **options)
        backward = BackwardPlan(out, q, k, v, out, lse, view(mask), view(bias), config=BwdConfig(16, 32, 32, 16, 4, 1),
                                dq=torch.empty_like(q), dk=torch.empty_like(k), dv=torch.empty_like(v),
                                dbias=torch.empty(as_4d(bias).shape), dlse=None, **options)
        decode = DecodePlan(short_q, k, v, view(short_mask), view(short_bias), None, None,
                            config=DecodeConfig(16, 4, 1, 2), out=torch.empty_like(short_q),
                            lse=torch.empty(BATCH, HEADS, 2), num_sms=4, **options)
        plans.append([_launch_view(forward.forward), _launch_view(forward.activity.launch), forward.compiled_on,
                      [_launch_view(item) for item in backward.launches], _launch_view(backward.activity.launch),
                      [_launch_view(item) for item in decode._launches()]])
    assert plans[0] == plans[1]


@pytest.mark.parametrize("mask_dims, bias_dims", FEWER_DIMS[:2])
def test_the_triton_launchers_run_a_mask_and_bias_as_given_as_their_4d_views(mask_dims, bias_dims):
    """Forward and backward of the launchers' cached entry points, bitwise."""
    q, k, v, mask, bias = _call(1, mask_dims, bias_dims, mask_dtype=torch.uint8)
    options = dict(is_causal=False, softmax_scale=DIM ** -0.5, softcap=0.0)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(2))
    results = []
    for given_mask, given_bias in ((mask, bias), (as_4d(mask), as_4d(bias))):
        out, lse = torch.empty_like(q), torch.empty(BATCH, HEADS, SEQLEN_Q)
        launch.attention_forward(q, k, v, given_mask, given_bias, config=FwdConfig(16, 16, 4, 1), out=out, lse=lse,
                                 **options)
        dq, dk, dv = (torch.full_like(t, float("nan")) for t in (q, k, v))
        dbias = torch.full(as_4d(bias).shape, float("nan"))
        launch.attention_backward(dout, q, k, v, out, lse, given_mask, given_bias,
                                  config=BwdConfig(16, 16, 16, 16, 4, 1), dq=dq, dk=dk, dv=dv, dbias=dbias, **options)
        results.append((out, lse, dq, dk, dv, dbias))
    for as_given, as_view in zip(*results):
        assert torch.isfinite(as_given).all()
        assert torch.equal(as_given, as_view)


def test_a_plans_shared_bytes_need_a_compiling_triton():
    """`ForwardPlan.shared_bytes` compiles the forward kernel (the GPU tier checks its figure);
    the interpreter compiles nothing."""
    q, k, v, mask, bias = _call(3, ("q", "k"), None)
    plan = ForwardPlan(q, k, v, mask, bias, is_causal=False, softmax_scale=1.0, softcap=0.0,
                       config=FwdConfig(16, 16, 4, 1), out=torch.empty_like(q), lse=torch.empty(BATCH, HEADS, SEQLEN_Q))
    with pytest.raises(RuntimeError, match="interpreter"):
        plan.shared_bytes()


@pytest.mark.parametrize("mask_dims, bias_dims", FEWER_DIMS)
@pytest.mark.parametrize("arch", ["sm90", "sm80"])
def test_the_cuda_launches_of_a_mask_and_bias_as_given_are_those_of_their_4d_views(monkeypatch, arch, mask_dims,
                                                                                     bias_dims):
    """Every launch's parameter block (tensor maps included) and -D list, for the forward's plan
    and entry point and the backward, planned on data-less tensors."""
    from dmattn_kernels.cuda import attention_backward, attention_forward, backward, driver, forward
    from dmattn_kernels.cuda.params import TensorMap

    launched = []
    monkeypatch.setattr(driver.Launcher, "__call__", lambda self, name, grid, warps, shared, params: launched.append(
        (name, grid, warps, shared, bytes(params))))

    class Maps:  # a map's bytes: what it was encoded from, as the driver reads it (`operands.padded`)
        @staticmethod
        def tensor_map(t, order, rows, line, swizzle):
            shape, strides = operands.padded(t.shape, t.stride())
            strides = tuple(stride if size > 1 else 16 for size, stride in zip(shape, strides))
            text = repr((shape, strides, t.dtype, order, rows, line, swizzle)).encode()[:128].ljust(128, b"\0")
            return TensorMap.from_buffer_copy(text)

    monkeypatch.setattr(forward, "the_driver", Maps)
    monkeypatch.setattr(backward, "the_driver", Maps)
    meta = dict(device="meta", dtype=torch.bfloat16)
    seqlen_q, seqlen_k = 64, 128  # the kernels' tiles: 16-byte rows, whole warp-specialized tiles
    q = torch.empty(BATCH, seqlen_q, HEADS, 128, **meta)
    k, v = (torch.empty(BATCH, seqlen_k, HEADS_KV, 128, **meta) for _ in range(2))
    mask = torch.empty(_shape(mask_dims, seqlen_q, seqlen_k), device="meta", dtype=torch.bool)
    bias = torch.empty(_shape(bias_dims, seqlen_q, seqlen_k), **meta)
    out, lse = torch.empty_like(q), torch.empty(BATCH, HEADS, seqlen_q, device="meta")
    options = dict(is_causal=True, softmax_scale=0.125, softcap=0.0)
    runs = []
    for given_mask, given_bias in ((mask, bias), (as_4d(mask), as_4d(bias))):
        launched.clear()
        forward._signature_launch.cache_clear()  # each run plans its signature anew (and records its programs)
        with target.planning_for(arch) as programs:
            for config in (FwdConfig(64, 64, 4, 2), FwdConfig(128, 128, 12, 2)):
                if arch == "sm90" or config.num_warps == 4:
                    attention_forward(q, k, v, given_mask, given_bias, config=config, out=out, lse=lse, **options)
                    forward.ForwardPlan(q, k, v, given_mask, given_bias, config=config, out=out, lse=lse,
                                        **options)(q, k, v, given_mask, given_bias, out, lse)
            for config in (BwdConfig(32, 64, 64, 32, 4, 2), BwdConfig(64, 128, 64, 128, 12, 2)):
                if arch == "sm90" or config.num_warps == 4:
                    attention_backward(out, q, k, v, out, lse, given_mask, given_bias, config=config,
                                       dq=torch.empty_like(q), dk=torch.empty_like(k), dv=torch.empty_like(v),
                                       dbias=torch.empty(as_4d(bias).shape, **meta), **options)
        runs.append((list(launched), list(programs)))
    assert runs[0] == runs[1] and runs[0][0]
