"""dBias under GQA for a bias with query rows and fewer heads than the query: (B, Hkv, Lq, Lk)
and (B, 1, Lq, Lk). The dK/dV kernel runs in group mode there (one program per kv head,
`flash_bwd.py`); these tests hold it to the DESIGN §2 bound and check that it keeps no
per-query-head fp32 dBias slice (B, H, Lq, Lk)."""

from __future__ import annotations

import pytest
import torch
from dmattn_kernels.triton import backward, launch
from dmattn_kernels.triton.activity import CELL

from dmattn_bench.registry import get_backend
from dmattn_bench.space import BwdConfig, FwdConfig
from dmattn_bench.tuning.adversarial import Case, Inputs
from dmattn_bench.tuning.validator import CHECKED, compare, run_kernel, run_reference

F16, F32 = torch.float16, torch.float32
SMALL = FwdConfig(16, 16, 1, 1), BwdConfig(16, 16, 16, 16, 1, 1)
# dK/dV tiles of 16 queries x 32 keys, dQ tiles of 32 x 16: the group's union block list is
# pooled on a tile shape other than the dQ kernel's
WIDE = FwdConfig(32, 16, 2, 1), BwdConfig(16, 32, 32, 16, 2, 1)
LQ, LK, HEAD_DIM = 37, 53, 16  # lengths that divide no tile
DEAD_ROW = 5  # a query row with no visible key in every head
HEAD0_DEAD_ROW = 20  # a query row dead in query head 0 only (per-query-head masks)


def _inputs(batch, heads, heads_kv, dtype, mask_heads, bias_shape, causal) -> tuple[Inputs, Case]:
    q = torch.randn(batch, LQ, heads, HEAD_DIM).to(dtype)
    k = torch.randn(batch, LK, heads_kv, HEAD_DIM).to(dtype)
    v = torch.randn(batch, LK, heads_kv, HEAD_DIM).to(dtype)
    dout = torch.randn(batch, LQ, heads, HEAD_DIM).to(dtype)
    bias = torch.randn(bias_shape).to(dtype)
    mask = None
    if mask_heads is None:
        bias[..., DEAD_ROW, :] = float("-inf")  # dead through the bias alone
    else:
        mask = torch.rand(batch, mask_heads, LQ, LK) < 0.7
        if mask_heads == heads:
            # each query head keeps its own quarter of the 16 x 16 cells: the heads of a group
            # have different fully masked tiles, so group mode must walk the union of their lists
            cells = torch.arange(LQ)[:, None] // CELL + torch.arange(LK)[None, :] // CELL
            mask &= cells % 4 == torch.arange(heads)[:, None, None] % 4
            mask[:, 0, HEAD0_DEAD_ROW, :] = False
        mask[..., DEAD_ROW, :] = False
    case = Case("gqa_dbias", batch=batch, heads=heads, heads_kv=heads_kv, seqlen_q=LQ, seqlen_k=LK,
                head_dim=HEAD_DIM, causal=causal)
    return Inputs(q, k, v, mask, bias, dout), case


# (dtype, B, H, Hkv, mask heads ("H", "K", "1" or None), bias shape code, causal, configs)
CASES = [
    pytest.param(F32, 2, 4, 2, "H", "BKLL", True, SMALL, id="fp32-h4k2-qheadmask-kvbias-causal"),
    pytest.param(F16, 2, 4, 2, "K", "BKLL", False, WIDE, id="fp16-h4k2-kvmask-kvbias"),
    pytest.param(F32, 1, 4, 2, None, "BKLL", True, WIDE, id="fp32-h4k2-nomask-kvbias-causal"),
    pytest.param(F16, 1, 4, 2, "1", "BKLL", False, SMALL, id="fp16-h4k2-sharedmask-kvbias"),
    pytest.param(F32, 2, 4, 2, "H", "1KLL", False, WIDE, id="fp32-h4k2-qheadmask-batchbroadcast-kvbias"),
    pytest.param(F16, 2, 4, 2, "H", "B1LL", False, WIDE, id="fp16-h4k2-qheadmask-1headbias"),
    pytest.param(F32, 1, 4, 2, "K", "B1LL", True, SMALL, id="fp32-h4k2-kvmask-1headbias-causal"),
    pytest.param(F32, 1, 4, 1, "H", "B1LL", True, WIDE, id="fp32-mqa-qheadmask-1headbias-causal"),
    pytest.param(F16, 1, 4, 1, None, "B1LL", False, SMALL, id="fp16-mqa-nomask-1headbias"),
    pytest.param(F32, 2, 4, 2, "K", "11LL", True, SMALL, id="fp32-h4k2-kvmask-sharedbias-causal"),
]


def _shape(code, batch, heads_kv):
    return ({"B": batch, "1": 1}[code[0]], {"K": heads_kv, "1": 1}[code[1]], LQ, LK)


@pytest.mark.parametrize("dtype,batch,heads,heads_kv,mask_code,bias_code,causal,configs", CASES)
def test_group_mode_dbias_within_bound(dtype, batch, heads, heads_kv, mask_code, bias_code, causal, configs):
    mask_heads = {"H": heads, "K": heads_kv, "1": 1, None: None}[mask_code]
    inputs, case = _inputs(batch, heads, heads_kv, dtype, mask_heads, _shape(bias_code, batch, heads_kv), causal)
    backend = get_backend("triton")
    first = run_kernel(backend, inputs, case, *configs)  # into NaN-poisoned buffers
    second = run_kernel(backend, inputs, case, *configs)
    high, low = run_reference(inputs, case, None), run_reference(inputs, case, dtype)
    assert set(first) == set(CHECKED)
    assert torch.equal(first["dbias"][..., DEAD_ROW, :], torch.zeros_like(first["dbias"][..., DEAD_ROW, :]))
    for name in CHECKED:
        check = compare(name, first[name], high[name], low[name], dtype)
        assert check.finite, f"{name}: {check.detail}"
        assert check.passed, (
            f"{name}: error {check.error:.3g} > bound {check.bound:.3g} (x{check.ratio:.2f}), {check.detail}"
        )
        assert torch.equal(first[name], second[name]), f"{name}: a repeat run differs bitwise"


class _LaunchSpy:
    """Stands in for the dK/dV kernel: records its grid and its dk, dv and dBias targets."""

    def __init__(self, kernel_fn, log):
        self.kernel_fn, self.log = kernel_fn, log

    def __getitem__(self, grid):
        launch_fn = self.kernel_fn[grid]

        def call(*args, **kwargs):
            self.log.append({"grid": grid, "dk": args[8], "dv": args[9], "partial": args[10],
                             "heads_per_program": kwargs.get("HEADS_PER_PROGRAM", 1)})
            return launch_fn(*args, **kwargs)

        return call


def _backward(bias_shape, mask_heads, monkeypatch, batch=1, heads=4, heads_kv=2):
    """Runs the launcher's backward with spies; returns (dkdv launch record, fp32 allocations, dk, dv, dbias)."""
    inputs, _ = _inputs(batch, heads, heads_kv, F32, mask_heads, bias_shape, causal=False)
    fwd, bwd = SMALL
    options = {"is_causal": False, "softmax_scale": HEAD_DIM ** -0.5, "softcap": 0.0}
    q, k, v, mask, bias = inputs.q, inputs.k, inputs.v, inputs.mask, inputs.bias
    out, lse = torch.empty_like(q), torch.empty(batch, heads, LQ)
    launch.attention_forward(q, k, v, mask, bias, config=fwd, out=out, lse=lse, **options)
    dq, dk, dv, dbias = (torch.empty_like(t) for t in (q, k, v, bias))

    launches, allocations = [], []
    with monkeypatch.context() as patch:
        patch.setattr(backward, "flash_bwd_dkdv_kernel", _LaunchSpy(backward.flash_bwd_dkdv_kernel, launches))
        for name in ("zeros", "empty", "full"):
            original = getattr(torch, name)

            def recording(*args, _original=original, **kwargs):
                t = _original(*args, **kwargs)
                if t.dtype == F32:
                    allocations.append(tuple(t.shape))
                return t

            patch.setattr(torch, name, recording)
        launch.attention_backward(inputs.dout, q, k, v, out, lse, mask, bias, config=bwd, dq=dq, dk=dk, dv=dv,
                                  dbias=dbias, **options)
    (record,) = launches
    return record, allocations, dk, dv, dbias


@pytest.mark.parametrize("mask_heads", [4, None], ids=["qheadmask", "nomask"])
def test_kv_head_bias_grad_is_written_in_place(mask_heads, monkeypatch):
    record, allocations, dk, dv, dbias = _backward((1, 2, LQ, LK), mask_heads, monkeypatch)
    partial_is_dbias = record["partial"] is dbias
    assert partial_is_dbias, f"dBias partial {tuple(record['partial'].shape)} is not dbias itself"
    per_query_head = [s for s in allocations if len(s) == 4 and s[1] == 4 and s[2] == LQ]
    assert not per_query_head, f"fp32 per-query-head buffers allocated: {per_query_head}"
    assert record["dk"] is dk and record["dv"] is dv, "group mode sums dK/dV in registers: no share buffers"
    assert record["heads_per_program"] == 2 and record["grid"][1] == 1 * 2, record["grid"]


def test_one_head_bias_partial_has_kv_heads(monkeypatch):
    record, allocations, *_ = _backward((1, 1, LQ, LK), 4, monkeypatch)
    partial = record["partial"]
    assert (tuple(partial.shape), partial.dtype) == ((1, 2, LQ, LK), F32)
    per_query_head = [s for s in allocations if len(s) == 4 and s[1] == 4 and s[2] == LQ]
    assert not per_query_head, f"fp32 per-query-head buffers allocated: {per_query_head}"
    assert record["heads_per_program"] == 2 and record["grid"][1] == 1 * 2, record["grid"]


@pytest.mark.parametrize("bias_shape", [(1, 4, LQ, LK), (1, 2, 1, LK)], ids=["qhead-bias", "kvhead-key-bias"])
def test_other_biases_stay_in_split_mode(bias_shape, monkeypatch):
    record, _, _, _, _ = _backward(bias_shape, 4, monkeypatch)
    assert record["heads_per_program"] == 1 and record["grid"][1] == 1 * 4, record["grid"]
