"""Tests for the eager reference (dmattn_bench/reference.py) against an independent naive loop."""

import math

import pytest
import torch

from dmattn_bench.reference import attention, broadcast_dims, check_inputs

F64 = torch.float64


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _qkv(B, H, Hkv, Lq, Lk, D, dtype=F64, seed=0, grad=True):
    g = _gen(seed)
    q = torch.randn(B, Lq, H, D, generator=g, dtype=dtype)
    k = torch.randn(B, Lk, Hkv, D, generator=g, dtype=dtype)
    v = torch.randn(B, Lk, Hkv, D, generator=g, dtype=dtype)
    return [t.requires_grad_(grad) for t in (q, k, v)]


def _pick(t, b, h, H, Hkv):
    """Independent broadcasting: the (Lq|1, Lk|1) slice of a mask/bias for batch b, head h."""
    t = t.reshape((1,) * (4 - t.dim()) + tuple(t.shape))
    tb = b if t.shape[0] > 1 else 0
    if t.shape[1] == H:
        th = h
    elif t.shape[1] == Hkv:
        th = h // (H // Hkv)
    else:
        th = 0
    return t[tb, th]


def naive(q, k, v, mask=None, bias=None, causal=False, scale=None, softcap=0.0):
    """Per-(batch, head) loop with torch.softmax; dead rows set to 0 / -inf explicitly."""
    B, Lq, H, D = q.shape
    Lk, Hkv = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    outs, lses = [], []
    for b in range(B):
        for h in range(H):
            kh = h // (H // Hkv)
            s = scale * q[b, :, h] @ k[b, :, kh].T
            if softcap > 0:
                s = softcap * torch.tanh(s / softcap)
            if bias is not None:
                s = s + _pick(bias, b, h, H, Hkv).to(s.dtype).expand(Lq, Lk)
            vis = torch.ones(Lq, Lk, dtype=torch.bool)
            if mask is not None:
                vis = vis & _pick(mask, b, h, H, Hkv).bool().expand(Lq, Lk)
            if causal:
                for i in range(Lq):
                    for j in range(Lk):
                        vis[i, j] &= j <= i + Lk - Lq
            s = s.masked_fill(~vis, -math.inf)
            dead = (s == -math.inf).all(-1, keepdim=True)
            p = torch.where(dead, 0.0, torch.softmax(s, -1))
            outs.append(p @ v[b, :, kh])
            lses.append(torch.logsumexp(s, -1))
    out = torch.stack(outs).reshape(B, H, Lq, D).transpose(1, 2)
    return out, torch.stack(lses).reshape(B, H, Lq)


NAIVE_CASES = [
    # B, H, Hkv, Lq, Lk, D, mask shape, bias shape, causal, softcap, grads (no dead rows)
    (2, 4, 4, 5, 7, 8, "BHLL", "BHLL", False, 0.0, True),
    (2, 4, 2, 5, 7, 8, "BKLL", "1K1L", False, 5.0, True),
    (2, 4, 1, 3, 6, 8, "B11L", "BHLL", True, 0.0, True),
    (1, 4, 2, 6, 3, 16, None, "11L1", True, 2.0, False),  # Lq > Lk: rows 0..2 are dead
    (1, 2, 2, 4, 9, 8, "L", None, True, 0.0, True),
]


def _make_shape(code, B, H, Hkv, Lq, Lk):
    sizes = {"B": B, "H": H, "K": Hkv, "1": 1}
    if code == "L":
        return (Lk,)
    return tuple(sizes.get(c, Lq if i == 2 else Lk) for i, c in enumerate(code))


@pytest.mark.parametrize("B,H,Hkv,Lq,Lk,D,mcode,bcode,causal,softcap,grads", NAIVE_CASES)
def test_matches_naive(B, H, Hkv, Lq, Lk, D, mcode, bcode, causal, softcap, grads):
    q, k, v = _qkv(B, H, Hkv, Lq, Lk, D, seed=1)
    g = _gen(2)
    mask = bias = None
    if mcode:
        mask = torch.rand(_make_shape(mcode, B, H, Hkv, Lq, Lk), generator=g) < 0.7
        mask[..., 0] = True  # keep every row alive (except where causal kills it)
        if causal:
            mask[..., -1] = True
    if bcode:
        bias = torch.randn(_make_shape(bcode, B, H, Hkv, Lq, Lk), generator=g, dtype=F64)
        bias.requires_grad_(True)
    kw = dict(attn_mask=mask, attn_bias=bias, is_causal=causal, softcap=softcap)
    out, lse = attention(q, k, v, return_lse=True, **kw)
    n_out, n_lse = naive(q, k, v, mask, bias, causal, softcap=softcap)
    torch.testing.assert_close(out, n_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, n_lse, rtol=1e-12, atol=1e-12)
    if grads:
        w = torch.randn(out.shape, generator=g, dtype=F64)
        inputs = [t for t in (q, k, v, bias) if t is not None]
        got = torch.autograd.grad((out * w).sum() + lse.sum(), inputs)
        want = torch.autograd.grad((n_out * w).sum() + n_lse.sum(), inputs)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def _one_hot_values(Lk, D):
    v = torch.zeros(1, Lk, 1, D, dtype=F64)
    v[0, torch.arange(Lk), 0, torch.arange(Lk)] = 1.0
    return v


def test_causal_bottom_right_lq_lt_lk():
    # q = 0 gives uniform weights over the visible keys; one-hot values reveal which.
    q, k = torch.zeros(1, 2, 1, 8, dtype=F64), torch.randn(1, 5, 1, 8, dtype=F64)
    v = _one_hot_values(5, 8)
    out = attention(q, k, v, is_causal=True)[0, :, 0, :5]
    torch.testing.assert_close(out[0], torch.tensor([0.25, 0.25, 0.25, 0.25, 0.0], dtype=F64))
    torch.testing.assert_close(out[1], torch.full((5,), 0.2, dtype=F64))


def test_causal_bottom_right_lq_gt_lk():
    q, k = torch.zeros(1, 5, 1, 8, dtype=F64), torch.randn(1, 2, 1, 8, dtype=F64)
    v = _one_hot_values(2, 8)
    out, lse = attention(q, k, v, is_causal=True, return_lse=True)
    assert torch.equal(out[0, :3], torch.zeros(3, 1, 8, dtype=F64))
    assert torch.equal(lse[0, 0, :3], torch.full((3,), -math.inf, dtype=F64))
    torch.testing.assert_close(out[0, 3, 0, :2], torch.tensor([1.0, 0.0], dtype=F64))
    torch.testing.assert_close(out[0, 4, 0, :2], torch.tensor([0.5, 0.5], dtype=F64))
    torch.testing.assert_close(lse[0, 0, 4], torch.tensor(math.log(2.0), dtype=F64))


def _loss_and_grads(out, lse, inputs, seed=3):
    w = torch.randn(out.shape, generator=_gen(seed), dtype=out.dtype)
    loss = (out * w).sum() + torch.where(torch.isfinite(lse), lse, 0.0).sum()
    return torch.autograd.grad(loss, inputs)


@pytest.mark.parametrize("how", ["all_false_mask", "neg_inf_bias"])
def test_dead_rows(how):
    B, H, Hkv, Lq, Lk, D = 2, 2, 1, 4, 6, 8
    q, k, v = _qkv(B, H, Hkv, Lq, Lk, D, seed=4)
    mask = torch.rand(B, H, Lq, Lk, generator=_gen(5)) < 0.6
    mask[..., 0] = True
    bias = torch.randn(B, H, Lq, Lk, generator=_gen(6), dtype=F64)
    if how == "all_false_mask":
        mask[1, 0, 2] = False
    else:  # -inf on every allowed key of the row acts as a mask
        bias[1, 0, 2] = torch.where(mask[1, 0, 2], -math.inf, bias[1, 0, 2])
    bias.requires_grad_(True)
    out, lse = attention(q, k, v, mask, bias, return_lse=True)
    assert torch.equal(out[1, 2, 0], torch.zeros(D, dtype=F64))
    assert lse[1, 0, 2] == -math.inf
    assert torch.isfinite(out).all() and torch.isfinite(lse[lse != -math.inf]).all()
    assert (lse == -math.inf).sum() == 1
    dq, dk, dv, dbias = _loss_and_grads(out, lse, [q, k, v, bias])
    for grad in (dq, dk, dv, dbias):
        assert torch.isfinite(grad).all()
    assert torch.equal(dq[1, 2, 0], torch.zeros(D, dtype=F64))
    assert torch.equal(dbias[1, 0, 2], torch.zeros(Lk, dtype=F64))
    assert dq.abs().sum() > 0


@pytest.mark.parametrize("fill", [math.nan, math.inf, -math.inf, torch.finfo(F64).min])
def test_nonfinite_bias_at_masked_positions_is_ignored(fill):
    B, H, Hkv, Lq, Lk, D = 1, 2, 2, 5, 7, 8
    q, k, v = _qkv(B, H, Hkv, Lq, Lk, D, seed=7)
    mask = torch.rand(B, H, Lq, Lk, generator=_gen(8)) < 0.5
    mask[..., 0] = True
    base = torch.randn(B, H, Lq, Lk, generator=_gen(9), dtype=F64).masked_fill(~mask, 0.0)
    poisoned = base.masked_fill(~mask, fill)
    results = []
    for bias in (base, poisoned):
        bias = bias.clone().requires_grad_(True)
        out, lse = attention(q, k, v, mask, bias, is_causal=True, return_lse=True)
        results.append((out, lse, *_loss_and_grads(out, lse, [q, k, v, bias])))
    for clean, dirty in zip(*results):
        assert torch.equal(clean, dirty)
    dbias = results[1][-1]
    assert torch.isfinite(dbias).all() and torch.equal(dbias[~mask], torch.zeros_like(dbias[~mask]))


BIAS_SHAPES = ["BHLL", "1HLL", "BKLL", "BK1L", "B11L", "11L1", "LL"]


@pytest.mark.parametrize("code", BIAS_SHAPES)
@pytest.mark.parametrize("bias_dtype", [torch.float32, torch.float16])
def test_dbias_broadcast_shapes(code, bias_dtype):
    B, H, Hkv, Lq, Lk, D = 2, 4, 2, 3, 5, 8
    group = H // Hkv
    q, k, v = _qkv(B, H, Hkv, Lq, Lk, D, seed=10)
    shape = (Lq, Lk) if code == "LL" else _make_shape(code, B, H, Hkv, Lq, Lk)
    bias = torch.randn(shape, generator=_gen(11)).to(bias_dtype).requires_grad_(True)
    mask = torch.rand(B, 1, Lq, Lk, generator=_gen(12)) < 0.7
    out, lse = attention(q, k, v, mask, bias, return_lse=True)
    (dbias,) = _loss_and_grads(out, lse, [bias])
    assert dbias.shape == bias.shape and dbias.dtype == bias.dtype

    b4 = bias.detach().reshape((1,) * (4 - bias.dim()) + shape)
    if b4.shape[1] == Hkv:
        b4 = b4.repeat_interleave(group, dim=1)
    full = b4.expand(B, H, Lq, Lk).clone().requires_grad_(True)
    out_f, lse_f = attention(q, k, v, mask, full, return_lse=True)
    (dfull,) = _loss_and_grads(out_f, lse_f, [full])
    want = dfull.double()
    if len(shape) == 2 or shape[0] == 1:
        want = want.sum(0, keepdim=True)
    s4 = (1,) * (4 - len(shape)) + shape
    if s4[1] == Hkv:
        want = want.reshape(want.shape[0], Hkv, group, Lq, Lk).sum(2)
    elif s4[1] == 1:
        want = want.sum(1, keepdim=True)
    for dim in (2, 3):
        if s4[dim] == 1:
            want = want.sum(dim, keepdim=True)
    tol = 1e-6 if bias_dtype == torch.float32 else 2e-3
    torch.testing.assert_close(dbias.double(), want.reshape(shape).to(bias_dtype).double(),
                               rtol=tol, atol=tol)
    assert dbias.abs().sum() > 0


def test_gradcheck():
    B, H, Hkv, Lq, Lk, D = 1, 2, 1, 3, 4, 4
    q, k, v = _qkv(B, H, Hkv, Lq, Lk, D, seed=13)
    mask = torch.rand(B, H, Lq, Lk, generator=_gen(14)) < 0.5
    mask[..., torch.arange(Lq), torch.arange(Lq)] = True  # visible under causal: no dead row
    bias = torch.randn(1, H, Lq, Lk, generator=_gen(15), dtype=F64)
    bias = bias.masked_fill(~mask[:1], math.nan).requires_grad_(True)  # NaN where masked

    def fn(q, k, v, bias):
        return attention(q, k, v, mask, bias, is_causal=True, softcap=1.5, return_lse=True)

    assert torch.autograd.gradcheck(fn, (q, k, v, bias), eps=1e-6, atol=1e-8)


def test_low_precision_compute_dtype():
    B, H, Hkv, Lq, Lk, D = 1, 2, 1, 16, 24, 32
    q, k, v = _qkv(B, H, Hkv, Lq, Lk, D, dtype=torch.float32, seed=16, grad=False)
    bias = torch.randn(1, H, Lq, Lk, generator=_gen(17))
    ref, ref_lse = attention(q, k, v, attn_bias=bias, return_lse=True)
    low, low_lse = attention(q, k, v, attn_bias=bias, return_lse=True, compute_dtype=torch.float16)
    assert ref.dtype == low.dtype == torch.float32
    assert ref_lse.dtype == F64 and low_lse.dtype == torch.float32
    err = (ref - low).abs().max().item()
    assert 0 < err < 1e-2
    assert 0 < (ref_lse - low_lse).abs().max().item() < 1e-2


def test_dtypes_of_outputs_and_grads():
    q, k, v = _qkv(1, 2, 2, 3, 4, 8, dtype=torch.float32, seed=18)
    bias = torch.randn(1, 2, 3, 4, dtype=torch.bfloat16, requires_grad=True)
    out = attention(q, k, v, attn_bias=bias)
    assert out.dtype == torch.float32 and out.shape == (1, 3, 2, 8)
    grads = torch.autograd.grad(out.sum(), [q, k, v, bias])
    assert [g.dtype for g in grads] == [torch.float32] * 3 + [torch.bfloat16]


def test_integer_mask_equals_bool_mask():
    q, k, v = _qkv(1, 2, 2, 3, 5, 8, seed=19, grad=False)
    mask = torch.rand(1, 2, 3, 5, generator=_gen(20)) < 0.6
    mask[..., 0] = True
    assert torch.equal(attention(q, k, v, mask), attention(q, k, v, mask.to(torch.uint8)))


def test_errors():
    q, k, v = _qkv(2, 4, 2, 5, 7, 8, grad=False)
    bad = torch.ones(2, 3, 5, 7, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"attn_mask.*\(2, 3, 5, 7\)"):
        attention(q, k, v, attn_mask=bad)
    with pytest.raises(ValueError, match=r"attn_bias.*\(5, 6\)"):
        attention(q, k, v, attn_bias=torch.zeros(5, 6, dtype=F64))
    k3, v3 = torch.randn(2, 7, 3, 8, dtype=F64), torch.randn(2, 7, 3, 8, dtype=F64)
    with pytest.raises(ValueError, match="Hkv=3"):
        attention(q, k3, v3)
    with pytest.raises(TypeError, match="attn_mask"):
        attention(q, k, v, attn_mask=torch.ones(5, 7))
    with pytest.raises(TypeError, match="attn_bias"):
        attention(q, k, v, attn_bias=torch.ones(5, 7, dtype=torch.int64))
    with pytest.raises(ValueError, match="value"):
        attention(q, k, v[:, :6])
    with pytest.raises(ValueError, match="query"):
        attention(q[0], k, v)
    with pytest.raises(ValueError, match="softcap"):
        attention(q, k, v, softcap=-1.0)


def test_broadcast_dims_and_check_inputs():
    assert broadcast_dims((7,), "attn_bias", 2, 4, 2, 5, 7) == (1, 1, 1, 7)
    assert broadcast_dims((2, 2, 1, 7), "attn_bias", 2, 4, 2, 5, 7) == (2, 2, 1, 7)
    with pytest.raises(ValueError, match="at most 4-D"):
        broadcast_dims((1, 1, 1, 1, 7), "attn_bias", 2, 4, 2, 5, 7)
    q, k, v = _qkv(2, 4, 2, 5, 7, 8, grad=False)
    mask, bias = torch.ones(5, 7, dtype=torch.bool), torch.zeros(2, 1, 5, 1)
    assert check_inputs(q, k, v, mask, bias) is None
