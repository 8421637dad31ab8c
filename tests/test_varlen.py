"""CPU-tier tests of packed sequences (`flash_dmattn_varlen_func`) and the sliding window
(`window_size` on both calls) on the Triton kernels, through the interpreter, against the
single reference (`reference.varlen_attention`, `reference.attention`) on fp64 copies.

Every packed case puts NaN in memory no sequence may read (past `total`, between a sequence's
used keys and the next one's first) so that a kernel reading it fails; the tile sizes are small
and odd lengths divide none of them.
"""

import pytest
import torch

from dmattn_bench import BwdConfig, FwdConfig, flash_dmattn_func, flash_dmattn_varlen_func
from dmattn_bench.reference import attention, varlen_attention
from tests.test_api import F16, F32, F64, assert_close

SMALL = dict(fwd_config=FwdConfig(16, 16, 1, 1), bwd_config=BwdConfig(16, 16, 16, 16, 1, 1))
WIDE = dict(fwd_config=FwdConfig(32, 16, 1, 1), bwd_config=BwdConfig(16, 32, 32, 16, 2, 1))
TAIL = 5  # rows of NaN past the packed tensors' last sequence


def prefix_sums(lengths):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)


def packed_operands(mask, bias, total_q: int, total_k: int, max_k: int, dtype) -> dict:
    """A random mask and bias of packed sequences by layout (each None, or ("key" | "row", head
    count)): (heads, total_k) per key, (heads, total_q, max_k) per query row."""
    operands = {}
    for name, layout in (("mask", mask), ("bias", bias)):
        if layout is None:
            operands[name] = None
            continue
        kind, count = layout
        shape = (count, total_k) if kind == "key" else (count, total_q, max_k)
        operands[name] = torch.rand(shape) > 0.25 if name == "mask" else torch.randn(shape, dtype=dtype)
    return operands


def packed_case(lengths_q, lengths_k, heads, heads_kv, head_dim, dtype, mask=None, bias=None, seqused=None):
    """q, k, v (and a mask and bias in `mask` / `bias` layout: "key" or "row" with a head count)
    of packed sequences, as views of buffers whose rows past `total` hold NaN; with `seqused`,
    the keys past each sequence's used ones hold NaN too."""
    cu_q, cu_k = prefix_sums(lengths_q), prefix_sums(lengths_k)
    total_q, total_k, max_k = int(cu_q[-1]), int(cu_k[-1]), max(lengths_k)

    def buffer(rows, *shape):
        t = torch.randn(rows + TAIL, *shape, dtype=dtype)
        t[rows:] = float("nan")
        return t[:rows]

    q, k, v = buffer(total_q, heads, head_dim), buffer(total_k, heads_kv, head_dim), buffer(total_k, heads_kv, head_dim)
    used = None
    if seqused is not None:
        used = torch.tensor(seqused, dtype=torch.int32)
        for s, n in enumerate(seqused):  # keys a sequence does not use: never read
            k.data[int(cu_k[s]) + n:int(cu_k[s + 1])] = float("nan")
            v.data[int(cu_k[s]) + n:int(cu_k[s + 1])] = float("nan")
    operands = packed_operands(mask, bias, total_q, total_k, max_k, dtype)
    return q, k, v, cu_q, cu_k, max(lengths_q), max_k, operands["mask"], operands["bias"], used


def check_packed(case, dtype, causal, window, config, bias_grad=True):
    q, k, v, cu_q, cu_k, max_q, max_k, mask, bias, used = case
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    bias_leaf = None if bias is None else bias.detach().clone().requires_grad_(bias_grad)
    out, lse = flash_dmattn_varlen_func(*leaves, cu_q, cu_k, max_q, max_k, mask, bias_leaf, is_causal=causal,
                                        window_size=window, return_lse=True, seqused_k=used, backend="triton",
                                        **config)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves + ([bias_leaf] if bias_grad and bias is not None else []), dout)
    ref_leaves = [t.detach().to(F64).requires_grad_() for t in (q, k, v)]
    ref_bias = None if bias is None else bias.detach().to(F64).requires_grad_(bias_grad)
    ref_out, ref_lse = varlen_attention(*ref_leaves, cu_q, cu_k, max_q, max_k, mask, ref_bias, is_causal=causal,
                                        window_size=window, return_lse=True, seqused_k=used)
    ref_grads = torch.autograd.grad(ref_out, ref_leaves + ([ref_bias] if bias_grad and bias is not None else []),
                                    dout.to(F64))
    assert_close(out, ref_out, dtype, "out")
    assert_close(lse, ref_lse, F32, "lse")
    for name, grad, ref_grad in zip(("dq", "dk", "dv", "dbias"), grads, ref_grads):
        assert torch.isfinite(grad).all(), f"{name}: not finite"
        assert_close(grad, ref_grad, dtype, name)
    return out, grads


@pytest.mark.parametrize("causal, window", [(False, (-1, -1)), (True, (-1, -1)), (True, (6, -1)), (False, (4, 2))])
@pytest.mark.parametrize("mask, bias", [(None, None), (("key", 2), ("key", 1)), (("row", 1), ("row", 4)),
                                        (("row", 4), ("key", 2))])
def test_packed_matches_reference(causal, window, mask, bias):
    # zero-length, one-token and tile-straddling sequences; Lq != Lk both ways
    case = packed_case([20, 0, 1, 37, 5], [25, 7, 1, 30, 9], 4, 2, 32, F32, mask, bias)
    check_packed(case, F32, causal, window, SMALL)


@pytest.mark.parametrize("config", [SMALL, WIDE], ids=["small", "wide"])
def test_packed_fp16_gqa_seqused(config):
    case = packed_case([17, 33, 0, 8], [40, 19, 3, 8], 4, 1, 40, F16, ("key", 1), ("row", 1),
                       seqused=[31, 19, 0, 2])
    check_packed(case, F16, True, (-1, -1), config)


def test_packed_dead_documents_and_determinism():
    # a document with no visible key at all: out 0, lse -inf, no gradient
    q, k, v, cu_q, cu_k, max_q, max_k, _, bias, used = packed_case([9, 21], [9, 21], 2, 2, 16, F32, None, ("key", 2))
    mask = torch.ones(1, int(cu_k[-1]), dtype=torch.bool)
    mask[:, :9] = False
    case = (q, k, v, cu_q, cu_k, max_q, max_k, mask, bias, used)
    torch.manual_seed(1)  # the same dout both times
    out, grads = check_packed(case, F32, False, (-1, -1), SMALL)
    assert (out[:9] == 0).all()
    assert (grads[0][:9] == 0).all()
    torch.manual_seed(1)
    again, grads_again = check_packed(case, F32, False, (-1, -1), SMALL)
    assert torch.equal(out, again) and all(torch.equal(a, b) for a, b in zip(grads, grads_again))


def test_packed_without_gradient_and_unowned_rows():
    # rows past the last sequence's end belong to no sequence: dead (out 0, lse -inf)
    q, k, v, cu_q, cu_k, max_q, max_k, _, _, _ = packed_case([12, 7], [12, 7], 2, 2, 16, F32)
    cu_q_short = cu_q.clone()
    cu_q_short[-1] -= 3
    with torch.no_grad():
        out, lse = flash_dmattn_varlen_func(q, k, v, cu_q_short, cu_k, max_q, max_k, is_causal=True,
                                            return_lse=True, backend="triton", **SMALL)
    ref, ref_lse = varlen_attention(q.to(F64), k.to(F64), v.to(F64), cu_q_short, cu_k, max_q, max_k, is_causal=True,
                                    return_lse=True)
    assert_close(out, ref, F32, "out")
    assert (out[-3:] == 0).all() and (lse[:, -3:] == float("-inf")).all()


@pytest.mark.parametrize("lengths, window, causal", [
    ((48, 48), (16, -1), True),    # window edges on tile corners
    ((48, 48), (15, 0), False),
    ((37, 70), (20, 9), False),    # Lq < Lk: the window rides the bottom-right diagonal
    ((70, 37), (3, 3), False),     # Lq > Lk: leading rows see nothing (dead)
    ((33, 33), (0, 0), False),     # each row its diagonal key alone
])
@pytest.mark.parametrize("operands", ["none", "mask+bias"])
def test_dense_window_matches_reference(lengths, window, causal, operands):
    seqlen_q, seqlen_k = lengths
    q, k, v = (torch.randn(2, n, h, 32).requires_grad_() for n, h in ((seqlen_q, 4), (seqlen_k, 2), (seqlen_k, 2)))
    mask = bias = None
    if operands == "mask+bias":
        mask = torch.rand(2, 2, seqlen_q, seqlen_k) > 0.2
        bias = torch.randn(2, 1, 1, seqlen_k).requires_grad_()
    out, lse = flash_dmattn_func(q, k, v, mask, bias, is_causal=causal, window_size=window, return_lse=True,
                                 backend="triton", **SMALL)
    dout = torch.randn_like(out)
    inputs = [q, k, v] + ([bias] if bias is not None else [])
    grads = torch.autograd.grad(out, inputs, dout)
    leaves = [t.detach().to(F64).requires_grad_() for t in inputs]
    ref_out, ref_lse = attention(*leaves[:3], mask, leaves[3] if bias is not None else None, is_causal=causal,
                                 window_size=window, return_lse=True)
    ref_grads = torch.autograd.grad(ref_out, leaves, dout.to(F64))
    assert_close(out, ref_out, F32, "out")
    assert_close(lse, ref_lse, F32, "lse")
    for name, grad, ref_grad in zip(("dq", "dk", "dv", "dbias"), grads, ref_grads):
        assert_close(grad, ref_grad, F32, name)


def test_dense_window_without_gradient():
    q, k, v = (torch.randn(1, 40, 2, 16) for _ in range(3))
    with torch.no_grad():
        out = flash_dmattn_func(q, k, v, window_size=(7, 2), backend="triton", **SMALL)
    assert_close(out, attention(q.to(F64), k.to(F64), v.to(F64), window_size=(7, 2)), F32, "out")


@pytest.mark.parametrize("window, message", [((-2, 0), "window_size"), ((1,), "window_size"), ("left", "window_size")])
def test_bad_window_is_one_line_error(window, message):
    q, k, v = (torch.randn(1, 8, 2, 16) for _ in range(3))
    with pytest.raises(ValueError, match=message):
        flash_dmattn_func(q, k, v, window_size=window)


def test_cuda_backend_refuses_window_and_packing():
    q, k, v = (torch.randn(1, 8, 2, 16) for _ in range(3))
    with pytest.raises(ValueError, match="cuda"):
        flash_dmattn_func(q, k, v, window_size=(4, 0), backend="cuda")
    cu = prefix_sums([8])
    with pytest.raises(ValueError, match="cuda"):
        flash_dmattn_varlen_func(q[0], k[0], v[0], cu, cu, 8, 8, backend="cuda")
