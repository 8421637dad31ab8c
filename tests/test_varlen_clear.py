"""The rows of a packed call that no sequence owns (`dmattn_kernels.triton.clear`): what the
kernel fills and leaves, and a packed training step whose every allocation starts as NaN giving
out 0, lse -inf and zero gradients there, the reference everywhere, and no whole-buffer fill in
the common case where the sequences cover every row. CPU tier: the Triton interpreter."""

import math

import pytest
import torch

from dmattn_bench import flash_dmattn_varlen_func
from dmattn_bench.reference import varlen_attention
from dmattn_kernels.triton.clear import ROWS_PER_PROGRAM, UnownedRows, lse_part, token_part
from tests.test_api import F16, F32, F64, assert_close
from tests.test_plan import counted  # noqa: F401  (a fixture)
from tests.test_varlen import SMALL, packed_operands

NAN = float("nan")
SENTINEL = 7.0  # what a row the kernel must leave holds before and after


def _prefix_sums(first: int, lengths: list[int]) -> torch.Tensor:
    return torch.tensor([first + sum(lengths[:i]) for i in range(len(lengths) + 1)], dtype=torch.int32)


# -- the kernel ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("first_q, end_q, first_k, end_k", [
    (130, 270, 5, 290),    # unowned rows on both sides of a block boundary (ROWS_PER_PROGRAM)
    (1, 299, 128, 257),    # one unowned row at either end; key rows from a block's first on
    (0, 300, 0, 300),      # the sequences cover every row: nothing moves
    (300, 300, 0, 0),      # no row owned
    (-4, 512, 7, 7),       # prefix sums past the buffer are clamped to it
])
def test_the_kernel_fills_exactly_the_rows_outside_the_sequences(first_q, end_q, first_k, end_k):
    rows = 300
    assert rows > 2 * ROWS_PER_PROGRAM  # several programs per part
    # a token buffer whose heads are not adjacent (a view with a gap between them), lse, and a
    # key-side token buffer in another dtype
    out_whole = torch.full((1, rows, 3, 8), SENTINEL, dtype=F16)
    out = out_whole[:, :, :, :5]
    lse = torch.full((1, 3, rows), SENTINEL)
    keys = torch.full((1, rows, 2, 4), SENTINEL)
    cu_q = torch.tensor([first_q, (first_q + end_q) // 2, end_q], dtype=torch.int32)
    cu_k = torch.tensor([first_k, first_k, end_k], dtype=torch.int32)
    clear = UnownedRows([token_part(out.shape, out.stride()), lse_part(lse.shape, lse.stride())],
                        [token_part(keys.shape, keys.stride())], num_sequences=2)
    clear.run(None, (out, lse, keys), cu_q, cu_k)

    def unowned(first, end):
        index = torch.arange(rows)
        first = min(max(first, 0), rows)
        return (index < first) | (index >= min(max(end, first), rows))

    for name, t, rows_of, fill in (("out", out, unowned(first_q, end_q), 0.0),
                                   ("lse", lse.transpose(1, 2), unowned(first_q, end_q), -math.inf),
                                   ("keys", keys, unowned(first_k, end_k), 0.0)):
        assert (t[0, rows_of] == fill).all(), f"{name}: an unowned row not filled"
        assert (t[0, ~rows_of] == SENTINEL).all(), f"{name}: an owned row written"
    assert (out_whole[..., 5:] == SENTINEL).all(), "out: the gap between heads written"


# -- a packed training step -------------------------------------------------------------------------


@pytest.fixture
def poisoned_allocations(monkeypatch):
    """`torch.empty` and `torch.empty_like` hand out memory full of NaN (a float tensor) or of
    0xFF bytes (a byte buffer, such as a plan's scratch: NaN once viewed as fp32), as a caching
    allocator may: an element that no kernel writes and no fill reaches shows as NaN."""
    empty, empty_like = torch.empty, torch.empty_like

    def poisoned(t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point():
            t.fill_(NAN)
        elif t.dtype == torch.uint8:
            t.fill_(0xFF)
        return t

    monkeypatch.setattr(torch, "empty", lambda *args, **kwargs: poisoned(empty(*args, **kwargs)))
    monkeypatch.setattr(torch, "empty_like", lambda *args, **kwargs: poisoned(empty_like(*args, **kwargs)))


def _packed(lengths_q, lengths_k, unowned_q, unowned_k, heads, heads_kv, dtype, mask=None, bias=None, seqused=None):
    """A packed call's inputs with `unowned_q` = (rows before the first sequence, rows after the
    last) query rows no sequence owns, `unowned_k` likewise for keys; those rows of q, k and v
    hold NaN (no kernel may read them). `mask` / `bias`: ("key" | "row", heads)."""
    (lead_q, trail_q), (lead_k, trail_k) = unowned_q, unowned_k
    cu_q, cu_k = _prefix_sums(lead_q, lengths_q), _prefix_sums(lead_k, lengths_k)
    total_q, total_k, max_k = int(cu_q[-1]) + trail_q, int(cu_k[-1]) + trail_k, max(lengths_k)
    q = torch.randn(total_q, heads, 16, dtype=dtype)
    k, v = (torch.randn(total_k, heads_kv, 16, dtype=dtype) for _ in range(2))
    for t, cu in ((q, cu_q), (k, cu_k), (v, cu_k)):
        t[:int(cu[0])] = NAN
        t[int(cu[-1]):] = NAN
    operands = packed_operands(mask, bias, total_q, total_k, max_k, dtype)
    used = None if seqused is None else torch.tensor(seqused, dtype=torch.int32)
    return q, k, v, cu_q, cu_k, max(lengths_q), max_k, operands["mask"], operands["bias"], used


def _step(case, causal):
    """out, lse and the gradients of q, k, v (and the bias, if any) of one training step."""
    q, k, v, cu_q, cu_k, max_q, max_k, mask, bias, used = case
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v) + (() if bias is None else (bias,))]
    bias_leaf = None if bias is None else leaves[3]
    out, lse = flash_dmattn_varlen_func(*leaves[:3], cu_q, cu_k, max_q, max_k, mask, bias_leaf, is_causal=causal,
                                        return_lse=True, seqused_k=used, backend="triton", **SMALL)
    generator = torch.Generator().manual_seed(1)  # one dout for every step and for the reference
    dout = torch.randn(out.shape, generator=generator).to(out.dtype)
    return out.detach(), lse.detach(), torch.autograd.grad(out, leaves, dout), dout


STEPS = {
    # split mode under GQA: dK and dV from fp32 shares, whose unowned key rows the clear fills
    "gqa": (([20, 0, 9], [25, 7, 9], (3, 5), (2, 4), 4, 2, F16), {}, True),
    # dK and dV written by the dK/dV kernel itself; a learnable per-row bias (dbias zeroed whole)
    # and seqused_k (dK and dV zeroed whole)
    "mha-row-bias-seqused": (([17, 6], [19, 8], (4, 0), (0, 3), 2, 2, F32),
                             dict(bias=("row", 2), seqused=[15, 8]), False),
    # group mode (a per-row bias with the kv heads' count): dK and dV written directly
    "gqa-group-mode": (([9, 21], [30, 5], (0, 6), (5, 0), 4, 2, F32), dict(bias=("row", 2)), True),
    # a per-key mask and a learnable per-key bias: fp32 partials (zeroed whole) and GQA shares
    "gqa-key-bias": (([18, 1, 11], [18, 4, 20], (2, 2), (3, 1), 4, 2, F32),
                     dict(mask=("key", 2), bias=("key", 1)), False),
    # the common case: the sequences cover every row
    "covering": (([20, 0, 9], [25, 7, 9], (0, 0), (0, 0), 4, 2, F32), {}, True),
}


@pytest.mark.parametrize("name", list(STEPS))
def test_a_packed_step_into_nan_memory_gives_dead_rows_and_zero_gradients_where_no_sequence_is(
        poisoned_allocations, name):
    shape, operands, causal = STEPS[name]
    dtype = shape[-1]
    case = _packed(*shape, **operands)
    q, k, v, cu_q, cu_k, max_q, max_k, mask, bias, used = case
    ref_leaves = [t.detach().to(F64).requires_grad_() for t in (q, k, v) + (() if bias is None else (bias,))]
    ref_out, ref_lse = varlen_attention(*ref_leaves[:3], cu_q, cu_k, max_q, max_k, mask,
                                        None if bias is None else ref_leaves[3], is_causal=causal, return_lse=True,
                                        seqused_k=used)
    ref_grads = None
    first_q, end_q, first_k, end_k = int(cu_q[0]), int(cu_q[-1]), int(cu_k[0]), int(cu_k[-1])
    # the first step builds the plans (and the runtime fills its first forward's outputs
    # whole); the second runs them as every later step does
    for _ in range(2):
        out, lse, grads, dout = _step(case, causal)
        if ref_grads is None:
            ref_grads = torch.autograd.grad(ref_out, ref_leaves, dout.to(F64))
        for rows, fill in ((slice(0, first_q), 0.0), (slice(end_q, None), 0.0)):
            assert (out[rows] == fill).all() and (lse[:, rows] == -math.inf).all() and (grads[0][rows] == 0).all()
        for rows in (slice(0, first_k), slice(end_k, None)):
            assert (grads[1][rows] == 0).all() and (grads[2][rows] == 0).all()
        assert_close(out, ref_out, dtype, "out")
        assert_close(lse, ref_lse, F32, "lse")
        for what, grad, ref_grad in zip(("dq", "dk", "dv", "dbias"), grads, ref_grads):
            assert torch.isfinite(grad).all(), f"{what}: not finite"
            assert_close(grad, ref_grad, dtype, what)


FILL_OPS = ("aten.fill_.Scalar", "aten.zero_.default", "aten.zeros.default", "aten.full.default")


@pytest.mark.parametrize("seqused", [False, True])
def test_a_covering_packed_step_fills_no_whole_buffer(counted, seqused):  # noqa: F811  (the fixture)
    """Once its plans exist, a packed step issues the clear kernel and no fill op of torch's (each
    read the whole buffer's bandwidth): but with seqused_k, where dK's and dV's GQA shares are
    zeroed whole (the keys past a sequence's seqused_k are written by no kernel)."""
    case = _packed([20, 0, 9], [25, 7, 9], (0, 0), (0, 0), 4, 2, F32, seqused=[25, 7, 9] if seqused else None)
    q, k, v, cu_q, cu_k, max_q, max_k, _, _, used = case
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]

    def forward():
        return flash_dmattn_varlen_func(*leaves, cu_q, cu_k, max_q, max_k, is_causal=True, seqused_k=used,
                                        backend="triton", **SMALL)

    dout = torch.randn(q.shape)
    torch.autograd.grad(forward(), leaves, dout)  # builds the plans
    launched, _, other = counted(forward)
    assert launched == ["clear_unowned_rows_kernel", "flash_fwd_kernel"]
    assert not [op for op in other if op in FILL_OPS], other
    out = forward()
    launched, _, other = counted(lambda: torch.autograd.grad(out, leaves, dout))
    assert launched == ["clear_unowned_rows_kernel", "flash_bwd_preprocess_kernel", "flash_bwd_dkdv_kernel",
                        "flash_bwd_dq_kernel", "grad_reduce_kernel"]
    assert [op for op in other if op in FILL_OPS] == (["aten.zero_.default"] * 2 if seqused else []), other
