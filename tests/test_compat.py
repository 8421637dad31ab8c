"""CPU-tier tests of the flash-dmattn 1.2 drop-ins in `dmattn_bench.compat`.

Kernels run through the Triton interpreter (conftest.py) on tiny fp32 shapes.
"""

import inspect
import math

import pytest
import torch

from dmattn_bench import compat, flash_dmattn_func
from dmattn_bench.reference import attention
from tests.test_api import F32, TOL, assert_close

EMPTY = inspect.Parameter.empty

# (name, default) in order, all positional-or-keyword, copied from flash-dmattn 1.2.2
# (PyPI sdist flash_dmattn-1.2.2.tar.gz, sha256 19187214989acc5c93269c54a27dda61d734c8d8091e30ab0d62f98ff1e3f265;
# same signatures in SmallDoges/flash-dmattn ddc8cd5ff1274f1751242dbfca388b776fd4739e and
# b7deeba48b7b3850140fe63af557f7706176f74a).
# flash_dmattn/flash_dmattn_interface.py
FLASH_DMATTN_FUNC_1_2 = [
    ("query", EMPTY), ("key", EMPTY), ("value", EMPTY), ("attn_mask", None), ("attn_bias", None),
    ("softmax_scale", None), ("is_causal", None), ("softcap", None), ("deterministic", None),
    ("return_attn_probs", None),
]
# flash_dmattn/flash_dmattn_triton.py: is_causal comes before softmax_scale here.
TRITON_DMATTN_FUNC_1_2 = [
    ("query", EMPTY), ("key", EMPTY), ("value", EMPTY), ("attn_mask", None), ("attn_bias", None),
    ("is_causal", False), ("softmax_scale", None),
]


def qkv(B, H, Hkv, Lq, Lk, D):
    return [torch.randn(shape).requires_grad_() for shape in
            ((B, Lq, H, D), (B, Lk, Hkv, D), (B, Lk, Hkv, D))]


@pytest.mark.parametrize("fn,expected", [
    pytest.param(compat.flash_dmattn_func, FLASH_DMATTN_FUNC_1_2, id="flash_dmattn_func"),
    pytest.param(compat.triton_dmattn_func, TRITON_DMATTN_FUNC_1_2, id="triton_dmattn_func"),
])
def test_signature_matches_flash_dmattn_1_2(fn, expected):
    params = list(inspect.signature(fn).parameters.values())
    assert [(p.name, p.default) for p in params] == expected
    assert {p.kind for p in params} == {inspect.Parameter.POSITIONAL_OR_KEYWORD}


def test_both_equal_the_native_api_with_mask_bias_causal():
    B, H, Hkv, Lq, Lk, D = 2, 2, 1, 13, 18, 16
    q, k, v = qkv(B, H, Hkv, Lq, Lk, D)
    mask = torch.rand(B, Hkv, Lq, Lk) > 0.3
    bias = torch.randn(B, 1, Lq, Lk, requires_grad=True)
    dout = torch.randn(B, Lq, H, D)
    leaves = [q, k, v, bias]

    def run(fn, *args, attn_mask=mask, **kwargs):
        out = fn(q, k, v, attn_mask, bias, *args, **kwargs)
        return (out, *torch.autograd.grad(out, leaves, dout))

    native = run(flash_dmattn_func, is_causal=True, softmax_scale=0.3)
    results = {
        "flash_dmattn_func positional": run(compat.flash_dmattn_func, 0.3, True, None, True),
        "flash_dmattn_func keywords": run(compat.flash_dmattn_func, softmax_scale=0.3, is_causal=True),
        "triton_dmattn_func positional": run(compat.triton_dmattn_func, True, 0.3),
        # flash-dmattn's Triton mask format: float, > 0 = attend
        "triton_dmattn_func float mask": run(compat.triton_dmattn_func, True, 0.3, attn_mask=mask.float()),
    }
    for case, got in results.items():
        for name, a, b in zip(("out", "dq", "dk", "dv", "dbias"), got, native):
            assert torch.equal(a, b), f"{case}: {name} differs from dmattn_bench.flash_dmattn_func"


@pytest.mark.parametrize("fn", [compat.flash_dmattn_func, compat.triton_dmattn_func],
                         ids=["flash_dmattn_func", "triton_dmattn_func"])
def test_causal_lq_lt_lk_is_bottom_right(fn):
    B, H, Lq, Lk, D = 1, 2, 5, 21, 16
    q, k, v = (t.detach() for t in qkv(B, H, H, Lq, Lk, D))
    out = fn(q, k, v, is_causal=True)
    assert_close(out, attention(q, k, v, is_causal=True), F32, "bottom-right causal")
    # The same rule spelled out: query i sees keys j <= i + Lk - Lq. Top-left (j <= i, what
    # flash-dmattn's Triton kernel does) would differ by a wide margin.
    rows, cols = torch.arange(Lq)[:, None], torch.arange(Lk)[None, :]
    bottom_right, top_left = cols <= rows + Lk - Lq, cols <= rows
    assert_close(out, attention(q, k, v, bottom_right), F32, "explicit bottom-right mask")
    assert (out - attention(q, k, v, top_left)).abs().max() > 10 * TOL[F32]


def test_return_attn_probs_raises_naming_it():
    q, k, v = (t.detach() for t in qkv(1, 2, 2, 8, 8, 16))
    with pytest.raises(NotImplementedError, match="return_attn_probs"):
        compat.flash_dmattn_func(q, k, v, return_attn_probs=True)


@pytest.mark.parametrize("deterministic, passed", [(None, False), (False, False), (True, True)])
def test_deterministic_is_passed_on(monkeypatch, deterministic, passed):
    """flash-dmattn's and FlashAttention's `deterministic` reach `dmattn_bench.flash_dmattn_func`
    (a table's config marked non-deterministic then runs in order)."""
    seen = []
    monkeypatch.setattr(compat.api, "flash_dmattn_func", lambda *args, **kwargs: seen.append(kwargs["deterministic"]))
    q, k, v = (t.detach() for t in qkv(1, 2, 2, 8, 8, 16))
    compat.flash_dmattn_func(q, k, v, deterministic=deterministic)
    compat.flash_attn_func(q, k, v, deterministic=deterministic)
    assert seen == [passed, passed]


def test_noop_arguments_are_accepted():
    B, H, Lq, Lk, D = 1, 2, 9, 9, 16
    q, k, v = (t.detach() for t in qkv(B, H, H, Lq, Lk, D))
    expected = flash_dmattn_func(q, k, v, softcap=2.0)
    for deterministic in (None, False, True):
        out = compat.flash_dmattn_func(q, k, v, softcap=2.0, deterministic=deterministic,
                                       return_attn_probs=False)
        assert torch.equal(out, expected), f"deterministic={deterministic}"
    # softcap=None disables soft-capping, as in flash-dmattn
    assert torch.equal(compat.flash_dmattn_func(q, k, v, softcap=None), flash_dmattn_func(q, k, v))
    assert_close(compat.flash_dmattn_func(q, k, v), attention(q, k, v, softmax_scale=1 / math.sqrt(D)),
                 F32, "defaults")
