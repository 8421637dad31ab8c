"""CPU-tier tests of the public wrapper `flash_dmattn_func` (DESIGN.md §1) on the Triton backend.

Kernels run through the Triton interpreter (set up in conftest.py) on tiny shapes and are
compared with `dmattn_bench.reference.attention` run on fp64 copies of the inputs. This is a
functional test: the strict equivalence bound of DESIGN.md §2 is the validator's job.
"""

import math

import pytest
import torch

from dmattn_bench import BwdConfig, FwdConfig, flash_dmattn_func, plan
from dmattn_bench.reference import attention
from dmattn_bench.registry import interpreter_enabled
import dmattn_kernels.runtime.launch_context as launch_context
import dmattn_kernels.triton.backward as backward
import dmattn_kernels.triton.forward as forward
import dmattn_kernels.triton.launch as launch

F16, F32, F64 = torch.float16, torch.float32, torch.float64

# Max abs error allowed, relative to max(1, max|ref|) of the tensor compared.
TOL = {F32: 1e-4, F16: 2e-2}

# The interpreter's defaults, and a non-default pair with unequal tiles (a dBias partial with
# fewer rows than Lq, dQ tiles different from dK/dV tiles).
FWD_SMALL, BWD_SMALL = FwdConfig(16, 16, 1, 1), BwdConfig(16, 16, 16, 16, 1, 1)
FWD_WIDE, BWD_WIDE = FwdConfig(32, 16, 1, 1), BwdConfig(16, 32, 32, 16, 2, 1)


# ----------------------------------------------------------------------------- helpers


def assert_close(actual, expected, dtype, what):
    """Max abs error <= TOL[dtype] * max(1, max|expected|); equal infinities count as exact."""
    assert actual is not None, f"{what}: got None"
    assert tuple(actual.shape) == tuple(expected.shape), (
        f"{what}: got shape {tuple(actual.shape)}, expected {tuple(expected.shape)}"
    )
    a, e = actual.detach().to(F64), expected.detach().to(F64)
    err = torch.where(a == e, torch.zeros_like(a), (a - e).abs())
    err = torch.nan_to_num(err, nan=math.inf)
    finite = e[torch.isfinite(e)]
    scale = max(1.0, finite.abs().max().item() if finite.numel() else 0.0)
    bound = TOL[dtype] * scale
    worst = err.max().item() if err.numel() else 0.0
    if not worst <= bound:
        idx = tuple(int(i) for i in torch.unravel_index(err.argmax(), err.shape))
        raise AssertionError(
            f"{what}: max abs err {worst:.3e} at {idx} (got {a[idx].item():.6g}, ref "
            f"{e[idx].item():.6g}) > bound {bound:.3e} (ratio {worst / bound:.2f})"
        )


def qkv(B, H, Hkv, Lq, Lk, D, dtype):
    q = torch.randn(B, Lq, H, D, dtype=dtype)
    k = torch.randn(B, Lk, Hkv, D, dtype=dtype)
    v = torch.randn(B, Lk, Hkv, D, dtype=dtype)
    return [t.requires_grad_() for t in (q, k, v)]


def random_mask(shape):
    return torch.rand(shape) > 0.3


def reference(q, k, v, mask, bias, dout, **kwargs):
    """(out, lse, dq, dk, dv, dbias) of the reference on fp64 copies; dbias None without grad."""
    leaves = [t.detach().to(F64).requires_grad_() for t in (q, k, v)]
    bias64 = None
    if bias is not None:
        bias64 = bias.detach().to(F64).requires_grad_(bias.requires_grad)
    out, lse = attention(*leaves, mask, bias64, return_lse=True, **kwargs)
    inputs = leaves + ([bias64] if bias is not None and bias.requires_grad else [])
    grads = list(torch.autograd.grad(out, inputs, dout.to(F64)))
    return (out, lse, *grads[:3], grads[3] if len(grads) > 3 else None)


def kernel(q, k, v, mask, bias, dout, fwd=FWD_SMALL, bwd=BWD_SMALL, grad_inputs=None, **kwargs):
    """(out, lse, *grads) of the Triton backend; grads w.r.t. `grad_inputs` (default q, k, v[, bias])."""
    out, lse = flash_dmattn_func(
        q, k, v, mask, bias, return_lse=True, backend="triton", fwd_config=fwd, bwd_config=bwd,
        **kwargs,
    )
    if grad_inputs is None:
        grad_inputs = [q, k, v] + ([bias] if bias is not None and bias.requires_grad else [])
    grads = torch.autograd.grad(out, grad_inputs, dout)
    return (out, lse, *grads)


def compare_all(got, ref, dtype, case):
    names = ("out", "lse", "dq", "dk", "dv", "dbias")
    for name, g, r in zip(names, got, ref):
        if r is None:
            continue
        assert_close(g, r, F32 if name == "lse" else dtype, f"{case} {name}")


# ----------------------------------------------------------------------------- correctness

# (dtype, B, H, Hkv, Lq, Lk, D, mask shape, bias shape, bias dtype, causal, extra kwargs, configs)
CASES = [
    pytest.param(F32, 2, 2, 2, 33, 40, 40, "BHLL", "BHLL", F32, False, {}, (FWD_SMALL, BWD_SMALL),
                 id="fp32-mha-d40"),
    pytest.param(F16, 1, 4, 2, 24, 17, 16, "BKLL", "1HLL", F16, True, {}, (FWD_WIDE, BWD_WIDE),
                 id="fp16-gqa-causal-lq>lk-deadrows"),
    pytest.param(F32, 2, 2, 1, 17, 33, 16, "B11L", "BHLL", F32, True, {"softmax_scale": 0.3},
                 (FWD_WIDE, BWD_WIDE), id="fp32-mqa-causal-lq<lk"),
    pytest.param(F16, 1, 4, 2, 40, 24, 40, "LL", "1K1L", F32, False, {"softcap": 5.0},
                 (FWD_SMALL, BWD_SMALL), id="fp16-gqa-softcap-fp32bias"),
]


def _shape(code, B, H, Hkv, Lq, Lk):
    sizes = {"B": B, "H": H, "K": Hkv, "L": None, "1": 1}
    if code == "LL":
        return (Lq, Lk)
    dims = [sizes[c] for c in code]
    dims[2] = Lq if code[2] == "L" else 1
    dims[3] = Lk if code[3] == "L" else 1
    return tuple(dims)


@pytest.mark.parametrize("dtype,B,H,Hkv,Lq,Lk,D,mcode,bcode,bdtype,causal,extra,configs", CASES)
def test_matches_reference(dtype, B, H, Hkv, Lq, Lk, D, mcode, bcode, bdtype, causal, extra, configs):
    q, k, v = qkv(B, H, Hkv, Lq, Lk, D, dtype)
    mask = random_mask(_shape(mcode, B, H, Hkv, Lq, Lk))
    bias = torch.randn(_shape(bcode, B, H, Hkv, Lq, Lk), dtype=bdtype).requires_grad_()
    dout = torch.randn(B, Lq, H, D, dtype=dtype)
    fwd, bwd = configs
    got = kernel(q, k, v, mask, bias, dout, fwd, bwd, is_causal=causal, **extra)
    ref = reference(q, k, v, mask, bias, dout, is_causal=causal, **extra)
    compare_all(got, ref, dtype, f"{fwd} {bwd}")
    out, lse, dq, dk, dv, dbias = got
    assert out.dtype == dtype and lse.dtype == F32 and tuple(lse.shape) == (B, H, Lq)
    assert (dq.dtype, dk.dtype, dv.dtype, dbias.dtype) == (dtype, dtype, dtype, bdtype)


# (bias shape code, q dtype, bias dtype, configs); B=2, H=4, Hkv=2 so every broadcast dim differs.
DBIAS_CASES = [
    pytest.param("BHLL", F16, F32, (FWD_SMALL, BWD_SMALL), id="BHLL-fp16q-fp32bias"),
    pytest.param("1KLL", F32, F32, (FWD_WIDE, BWD_WIDE), id="1KLL-fp32"),
    pytest.param("BK1L", F16, F16, (FWD_WIDE, BWD_WIDE), id="BK1L-gqa-fp16"),
    pytest.param("B11L", F32, F32, (FWD_SMALL, BWD_SMALL), id="B11L-fp32"),
    pytest.param("11L1", F16, F32, (FWD_SMALL, BWD_WIDE), id="11L1-fp16q-fp32bias"),
    # every dim summed: batch, heads, rows of query blocks and keys in one program
    pytest.param("1K11", F32, F32, (FWD_SMALL, BWD_SMALL), id="1K11-fp32"),
]


@pytest.mark.parametrize("bcode,dtype,bdtype,configs", DBIAS_CASES)
def test_dbias_broadcast_shapes(bcode, dtype, bdtype, configs):
    B, H, Hkv, Lq, Lk, D = 2, 4, 2, 20, 24, 16
    q, k, v = qkv(B, H, Hkv, Lq, Lk, D, dtype)
    mask = random_mask((B, 1, Lq, Lk))
    bias = torch.randn(_shape(bcode, B, H, Hkv, Lq, Lk), dtype=bdtype).requires_grad_()
    dout = torch.randn(B, Lq, H, D, dtype=dtype)
    got = kernel(q, k, v, mask, bias, dout, *configs)
    ref = reference(q, k, v, mask, bias, dout)
    compare_all(got, ref, dtype, f"bias {tuple(bias.shape)}")
    dq, dk, dv, dbias = got[2:]
    assert (dq.dtype, dk.dtype, dv.dtype) == (dtype,) * 3
    assert dbias.shape == bias.shape and dbias.dtype == bias.dtype


def test_bias_without_grad_gets_no_dbias():
    B, H, Hkv, Lq, Lk, D = 1, 2, 2, 20, 20, 16
    q, k, v = qkv(B, H, Hkv, Lq, Lk, D, F32)
    bias = torch.randn(B, H, Lq, Lk)
    dout = torch.randn(B, Lq, H, D)
    out = flash_dmattn_func(q, k, v, None, bias, backend="triton", fwd_config=FWD_SMALL,
                            bwd_config=BWD_SMALL)
    out.backward(dout)
    assert bias.grad is None
    ref = reference(q, k, v, None, bias, dout)
    compare_all((out, None, q.grad, k.grad, v.grad), ref[:1] + (None,) + ref[2:5], F32, "no-dbias")


# ----------------------------------------------------------------------------- no copies


class _PointerSpy:
    """Stands in for a Triton kernel; records the data_ptr of its first 5 args (q, k, v, mask, bias)."""

    def __init__(self, kernel_fn, name, log, operands):
        self.kernel_fn, self.name, self.log, self.operands = kernel_fn, name, log, operands

    def __getitem__(self, grid):
        launch_fn = self.kernel_fn[grid]

        def call(*args, **kwargs):
            self.log.append((self.name, [args[i].data_ptr() for i in self.operands]))
            return launch_fn(*args, **kwargs)

        return call


@pytest.fixture
def pointer_log(monkeypatch):
    """Every q/k/v/mask/bias pointer handed to the forward, dK/dV and dQ kernels (the dQ-from-dS
    kernel reads only k of them)."""
    log = []
    for module, name in ((forward, "flash_fwd_kernel"), (backward, "flash_bwd_dkdv_kernel"),
                         (backward, "flash_bwd_dq_kernel")):
        monkeypatch.setattr(module, name, _PointerSpy(getattr(module, name), name, log, range(5)))
    name = "flash_bwd_dq_from_ds_kernel"
    monkeypatch.setattr(backward, name, _PointerSpy(getattr(backward, name), name, log, [1]))
    plan.clear()  # plans built before hold the kernels themselves
    yield log
    plan.clear()


def _assert_pointers(log, tensors):
    expected = [t.data_ptr() for t in tensors]
    names = {name for name, _ in log}
    assert {"flash_fwd_kernel", "flash_bwd_dkdv_kernel"} <= names, names
    assert len(names & {"flash_bwd_dq_kernel", "flash_bwd_dq_from_ds_kernel"}) == 1, names
    for name, got in log:
        want = expected[1:2] if name == "flash_bwd_dq_from_ds_kernel" else expected
        assert got == want, f"{name}: got pointers {got}, expected the user tensors' {want}"


def test_bhld_views_stride0_mask_and_1d_bias_are_not_copied(pointer_log):
    B, H, Hkv, Lq, Lk, D = 2, 2, 1, 17, 24, 40
    q_base = torch.randn(B, H, Lq, D, requires_grad=True)
    k_base = torch.randn(B, Hkv, Lk, D, requires_grad=True)
    v_base = torch.randn(B, Hkv, Lk, D, requires_grad=True)
    q, k, v = (t.transpose(1, 2) for t in (q_base, k_base, v_base))  # BHLD views of BLHD
    assert not q.is_contiguous() and q.stride(-1) == 1
    mask = random_mask((1, 1, 1, Lk)).expand(B, H, Lq, Lk)
    bias = torch.randn(Lk, requires_grad=True)
    dout = torch.randn(B, Lq, H, D)

    got = kernel(q, k, v, mask, bias, dout, grad_inputs=[q_base, k_base, v_base, bias])
    _assert_pointers(pointer_log, (q, k, v, mask, bias))
    got = got[:2] + tuple(g.transpose(1, 2) for g in got[2:5]) + got[5:]

    # The same values laid out contiguously: the same arithmetic, so bitwise the same results.
    pointer_log.clear()
    qc, kc, vc = (t.detach().contiguous().requires_grad_() for t in (q, k, v))
    bias_c = bias.detach().clone().requires_grad_()
    contiguous = kernel(qc, kc, vc, mask, bias_c, dout)
    _assert_pointers(pointer_log, (qc, kc, vc, mask, bias_c))
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv", "dbias"), got, contiguous):
        assert torch.equal(a, b), f"{name}: BHLD-view result differs from contiguous result"

    compare_all(got, reference(q, k, v, mask, bias, dout), F32, "bhld-views")


def test_expanded_bias_and_2d_mask_are_not_copied(pointer_log):
    B, H, Hkv, Lq, Lk, D = 2, 2, 2, 20, 17, 16
    q, k, v = qkv(B, H, Hkv, Lq, Lk, D, F16)
    bias_base = torch.randn(1, H, 1, Lk, requires_grad=True)
    bias = bias_base.expand(B, H, Lq, Lk)
    mask = random_mask((Lq, Lk))
    dout = torch.randn(B, Lq, H, D, dtype=F16)
    got = kernel(q, k, v, mask, bias, dout, FWD_WIDE, BWD_WIDE, grad_inputs=[q, k, v, bias_base])
    _assert_pointers(pointer_log, (q, k, v, mask, bias))
    ref = reference(q, k, v, mask, bias_base, dout)
    compare_all(got, ref, F16, "expanded-bias")
    assert got[5].shape == bias_base.shape and got[5].dtype == F32


# ----------------------------------------------------------------------------- lse, backends


@pytest.mark.parametrize("dtype", [F32, F16], ids=["fp32", "fp16"])
def test_return_lse_and_reference_backend(dtype):
    B, H, Lq, Lk, D = 1, 2, 17, 20, 16
    q, k, v = (t.detach() for t in qkv(B, H, H, Lq, Lk, D, dtype))
    mask = random_mask((B, H, Lq, Lk))
    result = flash_dmattn_func(q, k, v, mask, backend="triton", return_lse=True,
                               fwd_config=FWD_SMALL)
    assert isinstance(result, tuple) and len(result) == 2
    out, lse = result
    assert out.dtype == dtype and tuple(out.shape) == (B, Lq, H, D)
    assert lse.dtype == F32 and tuple(lse.shape) == (B, H, Lq)
    plain = flash_dmattn_func(q, k, v, mask, backend="triton", fwd_config=FWD_SMALL)
    assert isinstance(plain, torch.Tensor) and torch.equal(plain, out)

    ref_out, ref_lse = flash_dmattn_func(q, k, v, mask, backend="reference", return_lse=True)
    assert ref_out.dtype == dtype
    assert_close(out, ref_out, dtype, "triton vs reference backend out")
    assert_close(lse, ref_lse, F32, "triton vs reference backend lse")


@pytest.mark.parametrize("dtype,uses_out", [(F32, True), (F16, True), (F32, False)],
                         ids=["fp32-out-and-lse", "fp16-out-and-lse", "fp32-lse-alone"])
def test_a_loss_through_lse_gets_its_gradient(dtype, uses_out):
    """Merging partial attentions weighs each by exp(lse): the gradient reaching lse must flow
    into dq, dk and dbias (dv does not depend on lse). Before, lse was non-differentiable and a
    loss using it lost that part of its gradient without a word. Dead rows (lse = -inf) are
    kept out of the loss, as a merge does."""
    B, H, Hkv, Lq, Lk, D = 1, 4, 2, 33, 40, 16
    q, k, v = qkv(B, H, Hkv, Lq, Lk, D, dtype)
    mask = random_mask((B, Hkv, Lq, Lk))
    mask[..., 3, :] = False  # a dead row
    bias = torch.randn(B, Hkv, 1, Lk, requires_grad=True)
    dout = torch.randn(B, Lq, H, D, dtype=F64)
    weight = torch.randn(B, H, Lq, dtype=F64)

    def loss(out, lse):
        from_lse = (torch.where(torch.isfinite(lse), lse, 0.0).to(F64) * weight).sum()
        return from_lse + ((out.to(F64) * dout).sum() if uses_out else 0.0)

    got = flash_dmattn_func(q, k, v, mask, bias, is_causal=True, return_lse=True, backend="triton",
                            fwd_config=FWD_WIDE, bwd_config=BWD_WIDE)
    got_grads = torch.autograd.grad(loss(*got), (q, k, v, bias), allow_unused=True)
    leaves = [t.detach().to(F64).requires_grad_() for t in (q, k, v, bias)]
    expected = attention(*leaves[:3], mask, leaves[3], is_causal=True, return_lse=True)
    expected_grads = torch.autograd.grad(loss(*expected), leaves, allow_unused=True)
    for name, a, e in zip(("dq", "dk", "dv", "dbias"), got_grads, expected_grads):
        if e is None or (not uses_out and name == "dv"):
            assert a is None or not a.abs().any(), f"{name}: the loss does not depend on it"
            continue
        assert_close(a, e, dtype, name)
    assert got_grads[0][:, 3].abs().max() == 0  # the dead row


def test_a_nan_lse_gradient_on_a_dead_row_changes_nothing():
    """Merging partial attentions with logaddexp sends NaN to the lse of a row dead in every
    part (logaddexp(-inf, -inf) has a NaN gradient). A dead row contributes nothing: that NaN
    must not reach dK (0 * NaN in dS) or anything else."""
    B, H, Lq, Lk, D = 1, 2, 20, 24, 16
    q, k, v = qkv(B, H, H, Lq, Lk, D, F32)
    mask = random_mask((B, H, Lq, Lk))
    mask[..., 7, :] = False
    out, lse = flash_dmattn_func(q, k, v, mask, return_lse=True, backend="triton",
                                 fwd_config=FWD_SMALL, bwd_config=BWD_SMALL)
    dlse = torch.randn(B, H, Lq)
    dlse[..., 7] = float("nan")
    torch.autograd.backward([out, lse], [torch.randn_like(out), dlse])
    for name, t in (("dq", q.grad), ("dk", k.grad), ("dv", v.grad)):
        assert torch.isfinite(t).all(), f"{name}: {(~torch.isfinite(t)).sum().item()} non-finite"
    assert q.grad[:, 7].abs().max() == 0


def test_reference_backend_lse_is_float32():
    q, k, v = (t.detach() for t in qkv(1, 2, 2, 8, 8, 16, F32))
    _, lse = flash_dmattn_func(q, k, v, backend="reference", return_lse=True)
    assert lse.dtype == F32


# ----------------------------------------------------------------------------- determinism


@pytest.mark.parametrize("dtype", [F16, F32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("row_bias", [-1e8, -9e8, -1e9, -1e12])
def test_a_row_of_huge_fp32_bias_stays_finite(dtype, row_bias):
    """An HF-style additive padding mask (-1e9 on a whole query row) as an fp32 bias: scores
    beyond fp32's resolution. The row's values cannot match the fp64 reference, but nothing may
    turn NaN or inf (before the fp16 forward's row max was moved up an ulp, the -1e9 row came out
    NaN and the backward spread it over dK). From about -5e8 a 16-bit call may return the row
    dead; fp32, whose exp2 argument is exact, keeps it alive."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, L, 2, 32, dtype=dtype, requires_grad=True) for L in (20, 24, 24))
    bias = torch.randn(1, 1, 20, 24, dtype=F32)
    bias[..., 5, :] = row_bias
    bias.requires_grad_()
    out, lse = flash_dmattn_func(q, k, v, attn_bias=bias, return_lse=True, backend="triton",
                                 fwd_config=FWD_SMALL, bwd_config=BWD_SMALL)
    out.float().square().sum().backward()
    for name, tensor in (("out", out), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad), ("dbias", bias.grad)):
        assert torch.isfinite(tensor).all(), f"{name}: {(~torch.isfinite(tensor)).sum().item()} non-finite"
    assert not lse.isnan().any() and not (lse == float("inf")).any()
    if dtype == F32:
        assert torch.isfinite(lse[..., 5]).all(), "fp32 reported a live row dead"
    rows = [i for i in range(20) if i != 5]  # the other rows are ordinary attention
    expected = attention(q.detach().double(), k.detach().double(), v.detach().double(), attn_bias=bias.detach().double())
    assert (out[:, rows].double() - expected[:, rows]).abs().max() < TOL[dtype]


def test_repeat_runs_are_bitwise_identical():
    B, H, Hkv, Lq, Lk, D = 2, 4, 2, 33, 33, 16
    q, k, v = qkv(B, H, Hkv, Lq, Lk, D, F16)
    mask = random_mask((B, H, Lq, Lk))
    bias = torch.randn(B, Hkv, 1, Lk, requires_grad=True)  # dBias summed over rows: a reduction
    dout = torch.randn(B, Lq, H, D, dtype=F16)
    first = kernel(q, k, v, mask, bias, dout, FWD_WIDE, BWD_WIDE, is_causal=True)
    second = kernel(q, k, v, mask, bias, dout, FWD_WIDE, BWD_WIDE, is_causal=True)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv", "dbias"), first, second):
        assert torch.equal(a, b), f"{name}: two identical runs differ"


# ----------------------------------------------------------------------------- errors


def _err_inputs(dtype=F32, D=16, H=2, Hkv=2):
    return (torch.randn(2, 5, H, D, dtype=dtype), torch.randn(2, 7, Hkv, D, dtype=dtype),
            torch.randn(2, 7, Hkv, D, dtype=dtype))


def _wrong_mask():
    mask = torch.ones(2, 3, 5, 7, dtype=torch.bool)
    return (*_err_inputs(), mask), {}, ValueError, ["attn_mask", "(2, 3, 5, 7)"]


def _key_other_d():
    q, k, v = _err_inputs()
    return (q, torch.randn(2, 7, 2, 24), torch.randn(2, 7, 2, 24)), {}, ValueError, ["key", "(2, 7, 2, 24)"]


def _heads_not_divisible():
    return _err_inputs(H=3, Hkv=2), {}, ValueError, ["key", "Hkv"]


def _float_mask():
    return (*_err_inputs(), torch.ones(2, 2, 5, 7)), {}, TypeError, ["attn_mask", "torch.float32"]


def _head_dim_36():
    return _err_inputs(D=36), {}, ValueError, ["head dim", "36"]


def _bf16_on_cpu():
    return _err_inputs(dtype=torch.bfloat16), {}, TypeError, ["query", "bfloat16", "interpreter"]


def _query_stride():
    q, k, v = _err_inputs()
    q = torch.randn(2, 5, 2, 32)[..., ::2]
    return (q, k, v), {}, ValueError, ["query", "stride"]


def _unknown_backend():
    return _err_inputs(), {"backend": "nope"}, ValueError, ["backend", "nope"]


def _non_tensor_query():
    q, k, v = _err_inputs()
    return (q.tolist(), k, v), {}, TypeError, ["query", "list"]


def _negative_softcap():
    return _err_inputs(), {"softcap": -1.0}, ValueError, ["softcap", "-1.0"]


def _zero_softmax_scale():
    return _err_inputs(), {"softmax_scale": 0.0}, ValueError, ["softmax_scale", "0.0"]


def _negative_softmax_scale():
    return _err_inputs(), {"softmax_scale": -0.125}, ValueError, ["softmax_scale", "-0.125"]


def _return_lse_string():
    """Issue 54: "no" is truthy, and returned a tuple on 0f8f85e."""
    return _err_inputs(), {"return_lse": "no"}, TypeError, ["return_lse", "'no'", "True or False"]


def _return_lse_int():
    return _err_inputs(), {"return_lse": 1}, TypeError, ["return_lse", "int 1"]


def _is_causal_none():
    return _err_inputs(), {"is_causal": None}, TypeError, ["is_causal", "NoneType"]


def _fwd_tile_the_backend_cannot_run():
    """A multiple of 16 that is no power of two: a config any kernel may take, but not Triton's."""
    return _err_inputs(), {"fwd_config": FwdConfig(48, 16, 1, 1)}, ValueError, [
        "fwd_config", "block_m=48 is not a power of two", "triton backend"]


def _knob_on_the_triton_backend():
    """On 0f8f85e the knobs of the CUDA forward ran silently on the Triton one."""
    return _err_inputs(), {"fwd_config": FwdConfig(128, 128, 12, 2, overlap=1)}, ValueError, [
        "fwd_config", "overlap, persistent and tma_store", "triton backend"]


def _bwd_tile_the_backend_cannot_run():
    q, k, v = (t.requires_grad_() for t in _err_inputs())
    return (q, k, v), {"bwd_config": BwdConfig(block_n=48)}, ValueError, ["bwd_config", "block_n=48"]


ERROR_CASES = [_wrong_mask, _key_other_d, _heads_not_divisible, _float_mask, _head_dim_36,
               _bf16_on_cpu, _query_stride, _unknown_backend, _non_tensor_query, _negative_softcap,
               _zero_softmax_scale, _negative_softmax_scale, _return_lse_string, _return_lse_int, _is_causal_none,
               _fwd_tile_the_backend_cannot_run, _knob_on_the_triton_backend, _bwd_tile_the_backend_cannot_run]


@pytest.mark.parametrize("make", ERROR_CASES, ids=[f.__name__.lstrip("_") for f in ERROR_CASES])
def test_errors_name_the_argument(make, monkeypatch):
    if make is _bf16_on_cpu and not interpreter_enabled():
        pytest.skip("the bf16 rule checked here is the interpreter's")
    args, kwargs, exc, needles = make()
    kwargs.setdefault("backend", "triton")

    def no_launch(*_, **__):
        raise AssertionError("a kernel was launched for invalid inputs")

    monkeypatch.setattr(forward, "flash_fwd_kernel", type("NoLaunch", (), {"__getitem__": no_launch})())
    with pytest.raises(exc) as info:
        flash_dmattn_func(*args, **kwargs)
    message = str(info.value)
    assert "\n" not in message, f"multi-line message: {message!r}"
    for needle in needles:
        assert needle in message, f"{needle!r} not in {message!r}"


def test_a_training_step_reads_the_mask_for_its_schedule_once(monkeypatch):
    """The forward's tile-activity summary is kept for the backward of the same call, so forward
    + backward run the activity pass once; the gradients are those of a backward that reads
    the mask itself."""
    launched = []
    monkeypatch.setattr(launch_context, "LAUNCH_OBSERVERS", [launched.append])
    generator = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(1, 40, 2, 16, generator=generator, requires_grad=True) for _ in range(3))
    mask = torch.rand(1, 2, 40, 40, generator=generator) < 0.4
    bias = torch.randn(1, 2, 40, 40, generator=generator, requires_grad=True)
    flash_dmattn_func(q, k, v, attn_mask=mask, attn_bias=bias, is_causal=True, fwd_config=FWD_SMALL,
                      bwd_config=BWD_WIDE).sum().backward()
    assert launched.count("tile_activity_kernel") == 1
    grads = [t.grad.clone() for t in (q, k, v, bias)]
    dq, dk, dv, dbias = (torch.empty_like(t) for t in (q, k, v, bias))
    out, lse = flash_dmattn_func(q, k, v, attn_mask=mask, attn_bias=bias, is_causal=True, fwd_config=FWD_SMALL,
                                 return_lse=True)
    launch.attention_backward(torch.ones_like(out), q.detach(), k.detach(), v.detach(), out.detach(), lse, mask,
                              bias.detach(), is_causal=True, softmax_scale=16 ** -0.5, softcap=0.0, config=BWD_WIDE,
                              dq=dq, dk=dk, dv=dv, dbias=dbias)
    for got, expected in zip(grads, (dq, dk, dv, dbias)):
        assert torch.equal(got, expected)


def test_a_forward_without_a_summary_leaves_the_backward_to_read_the_mask():
    """Only the Triton forward writes the mask's tile activity; after another backend's forward
    the plan hands the backward none (it reads the mask itself) instead of an unfilled buffer."""
    generator = torch.Generator().manual_seed(12)
    q, k = torch.randn(1, 33, 2, 16, generator=generator), torch.randn(1, 50, 2, 16, generator=generator)
    mask = torch.rand(1, 1, 33, 50, generator=generator) < 0.1
    options = dict(is_causal=True, softmax_scale=0.25, softcap=0.0, table=None, fwd_config=None, bwd_config=None,
                   bias_requires_grad=False)
    assert plan.AttentionPlan(q, k, k, mask, None, backend="triton", **options).fills_activity
    assert not plan.AttentionPlan(q, k, k, mask, None, backend="reference", **options).fills_activity
    assert not plan.AttentionPlan(q, k, k, None, None, backend="triton", **options).fills_activity


@pytest.mark.parametrize("flag", ["is_causal", "deterministic", "return_attn_probs"])
def test_the_compat_flags_are_bools_or_none(flag):
    """flash-dmattn's signature takes None for its flags; anything else but a bool is named."""
    from dmattn_bench import compat

    q, k, v = _err_inputs()
    assert compat.flash_dmattn_func(q, k, v, **{flag: None}).shape == q.shape
    with pytest.raises(TypeError, match=f"{flag}: got str 'yes', expected True, False or None"):
        compat.flash_dmattn_func(q, k, v, **{flag: "yes"})
    with pytest.raises(TypeError, match="is_causal: got int 1, expected True or False"):
        compat.triton_dmattn_func(q, k, v, is_causal=1)


def test_a_cached_plan_still_checks_return_lse():
    """return_lse is not in a plan's signature: a call of a known signature checks it too."""
    q, k, v = _err_inputs()
    assert isinstance(flash_dmattn_func(q, k, v, return_lse=True), tuple)
    with pytest.raises(TypeError, match="return_lse: got str 'no'"):
        flash_dmattn_func(q, k, v, return_lse="no")
