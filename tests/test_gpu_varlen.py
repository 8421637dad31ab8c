"""GPU tier of packed sequences and the sliding window at realistic sizes, bf16 and fp16,
through the public calls with the dispatch table's (or the defaults') configs, judged by
DESIGN §2 (`validator.compare`: the reference in fp32 against the same reference in the kernel's
dtype) on out, lse and every gradient, with NaN in the memory no sequence may read.

Run with `DMATTN_TEST_GPU=1 python -m pytest -m gpu tests/test_gpu_varlen.py`. Skipped without CUDA.
"""

from __future__ import annotations

import pytest
import torch

from dmattn_bench import flash_dmattn_func, flash_dmattn_varlen_func
from dmattn_bench.reference import attention, varlen_attention
from dmattn_bench.tuning.validator import compare

pytestmark = pytest.mark.gpu

DOCUMENTS = [1024, 300, 0, 1, 717, 129, 2048]  # zero- and one-token documents, lengths no tile divides
TAIL = 64  # NaN rows past every packed tensor's last document


def _nan_tailed(rows: int, *shape, dtype) -> torch.Tensor:
    t = torch.randn(rows + TAIL, *shape, dtype=dtype, device="cuda")
    t[rows:] = float("nan")
    return t[:rows]


def _check(outputs, references_high, references_low, dtype):
    for (name, x), high, low in zip(outputs, references_high, references_low):
        check = compare(name, x.float(), high.float(), low.float(), dtype)
        assert check.passed, check.failure()


def _reference_pair(fn, inputs, grad_out, dtype):
    """(outputs, gradients) of `fn` on fp32 copies and on copies in `dtype`."""
    results = []
    for compute in (torch.float32, dtype):
        leaves = [t.detach().to(compute).requires_grad_(t.requires_grad) for t in inputs]
        out, lse = fn(*leaves)
        grads = torch.autograd.grad(out, [t for t in leaves if t.requires_grad], grad_out.to(compute))
        results.append([out, lse, *grads])
    return results


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("layouts", ["none", "key-bias+row-mask", "row-bias+key-mask"])
@pytest.mark.parametrize("window", [(-1, -1), (255, -1)], ids=["causal", "window256"])
def test_packed_documents_within_bound(dtype, layouts, window):
    heads, heads_kv, head_dim = 16, 4, 128
    cu = torch.tensor([0] + torch.tensor(DOCUMENTS).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    total, longest = int(cu[-1]), max(DOCUMENTS)
    q = _nan_tailed(total, heads, head_dim, dtype=dtype).requires_grad_()
    k, v = (_nan_tailed(total, heads_kv, head_dim, dtype=dtype).requires_grad_() for _ in range(2))
    mask = bias = None
    if layouts == "key-bias+row-mask":
        bias = _nan_tailed(heads_kv, total, dtype=dtype).requires_grad_()
        mask = torch.rand(1, total, longest, device="cuda") > 0.1
    elif layouts == "row-bias+key-mask":
        bias = torch.randn(1, total, longest, dtype=dtype, device="cuda").requires_grad_()
        mask = torch.rand(heads_kv, total, device="cuda") > 0.1
    inputs = [q, k, v] + ([bias] if bias is not None else [])
    out, lse = flash_dmattn_varlen_func(q, k, v, cu, cu, longest, longest, mask, bias, is_causal=True,
                                        window_size=window, return_lse=True)
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, inputs, grad_out)

    def reference(*leaves):
        return varlen_attention(*leaves[:3], cu, cu, longest, longest, mask, leaves[3] if bias is not None else None,
                                is_causal=True, window_size=window, return_lse=True, compute_dtype=leaves[0].dtype)

    high, low = _reference_pair(reference, inputs, grad_out, dtype)
    names = ["out", "lse", "dq", "dk", "dv", "dbias"]
    _check(list(zip(names, [out, lse, *grads])), high, low, dtype)
    again = flash_dmattn_varlen_func(q, k, v, cu, cu, longest, longest, mask, bias, is_causal=True,
                                     window_size=window)
    assert torch.equal(out, again), "a repeat run differs"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("bias_kind", ["none", "per_key"])
def test_dense_window_within_bound(dtype, bias_kind):
    batch, seqlen, heads, heads_kv, head_dim = 2, 4100, 8, 2, 128
    q = torch.randn(batch, seqlen, heads, head_dim, dtype=dtype, device="cuda", requires_grad=True)
    k, v = (torch.randn(batch, seqlen, heads_kv, head_dim, dtype=dtype, device="cuda", requires_grad=True)
            for _ in range(2))
    bias = None
    if bias_kind == "per_key":
        bias = torch.randn(batch, heads_kv, 1, seqlen, dtype=dtype, device="cuda", requires_grad=True)
    inputs = [q, k, v] + ([bias] if bias is not None else [])
    out, lse = flash_dmattn_func(q, k, v, None, bias, is_causal=True, window_size=(1023, -1), return_lse=True)
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, inputs, grad_out)

    def reference(*leaves):
        return attention(*leaves[:3], None, leaves[3] if bias is not None else None, is_causal=True,
                         window_size=(1023, -1), return_lse=True, compute_dtype=leaves[0].dtype)

    high, low = _reference_pair(reference, inputs, grad_out, dtype)
    _check(list(zip(["out", "lse", "dq", "dk", "dv", "dbias"], [out, lse, *grads])), high, low, dtype)
