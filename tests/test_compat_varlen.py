"""CPU-tier tests of the FlashAttention 2 drop-ins in `dmattn_bench.compat`: `flash_attn_func` and
`flash_attn_varlen_func`, called as FlashAttention's users and transformers call them.

Kernels run through the Triton interpreter (conftest.py) on tiny fp32 shapes.
"""

import inspect

import pytest
import torch

from dmattn_bench import compat, flash_dmattn_func, flash_dmattn_varlen_func
from dmattn_bench.reference import attention, varlen_attention
from tests.test_api import F32, assert_close

EMPTY = inspect.Parameter.empty

# (name, default) in order, all positional-or-keyword, from Dao-AILab/flash-attention
# flash_attn/flash_attn_interface.py (commit 005300258a22).
FLASH_ATTN_FUNC = [
    ("q", EMPTY), ("k", EMPTY), ("v", EMPTY), ("dropout_p", 0.0), ("softmax_scale", None), ("causal", False),
    ("window_size", (-1, -1)), ("softcap", 0.0), ("alibi_slopes", None), ("deterministic", False),
    ("return_attn_probs", False),
]
FLASH_ATTN_VARLEN_FUNC = [
    ("q", EMPTY), ("k", EMPTY), ("v", EMPTY), ("cu_seqlens_q", EMPTY), ("cu_seqlens_k", EMPTY),
    ("max_seqlen_q", EMPTY), ("max_seqlen_k", EMPTY), ("dropout_p", 0.0), ("softmax_scale", None),
    ("causal", False), ("window_size", (-1, -1)), ("softcap", 0.0), ("alibi_slopes", None),
    ("deterministic", False), ("return_attn_probs", False), ("block_table", None),
]
# Our extensions, keyword only, after FlashAttention's.
EXTENSIONS = {
    "flash_attn_func": [("attn_mask", None), ("attn_bias", None)],
    "flash_attn_varlen_func": [("attn_mask", None), ("attn_bias", None), ("seqused_k", None)],
}

# Packed sequences: a zero-length one and lengths that divide no tile.
LENGTHS = [5, 0, 1, 9, 7]
H, HKV, D = 4, 2, 16


def packed(requires_grad=False):
    """q, k, v of LENGTHS packed, their prefix sums and longest length."""
    total = sum(LENGTHS)
    q, k, v = (torch.randn(total, heads, D, requires_grad=requires_grad) for heads in (H, HKV, HKV))
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, cu, max(LENGTHS)


@pytest.mark.parametrize("fn,expected", [
    pytest.param(compat.flash_attn_func, FLASH_ATTN_FUNC, id="flash_attn_func"),
    pytest.param(compat.flash_attn_varlen_func, FLASH_ATTN_VARLEN_FUNC, id="flash_attn_varlen_func"),
])
def test_signature_matches_flash_attention_2(fn, expected):
    params = list(inspect.signature(fn).parameters.values())
    ours = [p for p in params if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    extensions = [p for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY]
    assert [(p.name, p.default) for p in ours] == expected
    assert [(p.name, p.default) for p in extensions] == EXTENSIONS[fn.__name__]
    assert len(ours) + len(extensions) == len(params)


def test_varlen_with_transformers_keywords_equals_native_and_reference():
    q, k, v, cu, longest = packed(requires_grad=True)
    bias = torch.randn(HKV, q.shape[0], requires_grad=True)  # learnable, per key
    mask = torch.rand(1, q.shape[0]) > 0.2
    window = (3, 0)
    dout = torch.randn_like(q)
    leaves = [q, k, v, bias]

    def run(fn, **kwargs):
        out = fn(q, k, v, attn_mask=mask, attn_bias=bias, **kwargs)
        return (out, *torch.autograd.grad(out, leaves, dout))

    # the keywords transformers' `_flash_attention_forward` passes (modeling_flash_attention_utils.py)
    got = run(compat.flash_attn_varlen_func, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest,
              max_seqlen_k=longest, causal=True, softmax_scale=0.3, dropout_p=0.0, window_size=window,
              softcap=5.0, deterministic=False)
    native = run(flash_dmattn_varlen_func, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest,
                 max_seqlen_k=longest, is_causal=True, softmax_scale=0.3, window_size=window, softcap=5.0)
    for name, a, b in zip(("out", "dq", "dk", "dv", "dbias"), got, native):
        assert torch.equal(a, b), f"{name} differs from dmattn_bench.flash_dmattn_varlen_func"
    expected = run(varlen_attention, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest, max_seqlen_k=longest,
                   is_causal=True, softmax_scale=0.3, window_size=window, softcap=5.0)
    for name, a, b in zip(("out", "dq", "dk", "dv", "dbias"), got, expected):
        assert_close(a, b, F32, name)


def test_varlen_positional_defaults_and_lengths_as_tensors():
    q, k, v, cu, longest = packed()
    out = compat.flash_attn_varlen_func(q, k, v, cu, cu, longest, longest, 0.0, None, True, [2, 1])
    assert_close(out, varlen_attention(q, k, v, cu, cu, longest, longest, is_causal=True, window_size=(2, 1)),
                 F32, "positional, window as a list")
    # transformers derives max lengths from position ids as 0-dim tensors
    longest_t = (cu[1:] - cu[:-1]).max()
    as_tensors = compat.flash_attn_varlen_func(q, k, v, cu, cu, longest_t, longest_t)
    assert torch.equal(as_tensors, flash_dmattn_varlen_func(q, k, v, cu, cu, longest, longest))
    used = torch.tensor([3, 0, 1, 9, 2], dtype=torch.int32)
    assert_close(compat.flash_attn_varlen_func(q, k, v, cu, cu, longest, longest, causal=True, seqused_k=used),
                 varlen_attention(q, k, v, cu, cu, longest, longest, is_causal=True, seqused_k=used), F32, "seqused_k")


def test_dense_equals_native_with_window_mask_and_bias():
    B, Lq, Lk = 2, 11, 19
    q = torch.randn(B, Lq, H, D, requires_grad=True)
    k, v = (torch.randn(B, Lk, HKV, D, requires_grad=True) for _ in range(2))
    mask = torch.rand(B, 1, Lq, Lk) > 0.3
    bias = torch.randn(1, HKV, 1, Lk, requires_grad=True)
    dout = torch.randn_like(q)
    leaves = [q, k, v, bias]

    def run(fn, **kwargs):
        out = fn(q, k, v, attn_mask=mask, attn_bias=bias, **kwargs)
        return (out, *torch.autograd.grad(out, leaves, dout))

    got = run(compat.flash_attn_func, causal=True, softmax_scale=0.25, window_size=(4, 0), dropout_p=0.0,
              softcap=0.0, deterministic=True)
    native = run(flash_dmattn_func, is_causal=True, softmax_scale=0.25, window_size=(4, 0))
    for name, a, b in zip(("out", "dq", "dk", "dv", "dbias"), got, native):
        assert torch.equal(a, b), f"{name} differs from dmattn_bench.flash_dmattn_func"
    plain = compat.flash_attn_func(q.detach(), k.detach(), v.detach(), 0.0, None, True, (3, 2))
    assert_close(plain, attention(q.detach(), k.detach(), v.detach(), is_causal=True, window_size=(3, 2)),
                 F32, "positional, no mask")


CALLS = {
    "flash_attn_func": lambda q, k, v, cu, n, **kw: compat.flash_attn_func(q[None], k[None], v[None], **kw),
    "flash_attn_varlen_func": lambda q, k, v, cu, n, **kw: compat.flash_attn_varlen_func(q, k, v, cu, cu, n, n, **kw),
}


UNSUPPORTED = {"dropout_p": lambda: 0.1, "alibi_slopes": lambda: torch.ones(H), "return_attn_probs": lambda: True,
               "block_table": lambda: torch.zeros(len(LENGTHS), 1, dtype=torch.int32)}


@pytest.mark.parametrize("call,argument", [(call, argument) for call in sorted(CALLS) for argument in UNSUPPORTED
                                           if (call, argument) != ("flash_attn_func", "block_table")])
def test_unsupported_arguments_raise_naming_them(call, argument):
    q, k, v, cu, longest = packed()
    with pytest.raises(NotImplementedError, match=f"^{argument}: ") as raised:
        CALLS[call](q, k, v, cu, longest, **{argument: UNSUPPORTED[argument]()})
    assert "\n" not in str(raised.value)


def test_transformers_flash_path_runs_on_the_compat_functions(monkeypatch):
    """transformers' own `_flash_attention_forward`, with our two functions as the loaded kernel:
    the keywords it builds from their signatures, its unpad, padding-free and dense paths."""
    fa = pytest.importorskip("transformers.modeling_flash_attention_utils")
    name = "dmattn-compat"
    loaded = {"_loaded_implementation": name, "_flash_fn": compat.flash_attn_func,
              "_flash_varlen_fn": compat.flash_attn_varlen_func, "_flash_with_kvcache_fn": None,
              "_pad_fn": fa._pad_input, "_unpad_fn": fa._unpad_input,
              "_process_flash_kwargs_fn": fa._lazy_define_process_function(compat.flash_attn_varlen_func),
              "_process_with_kvcache_kwargs_fn": dict}
    for attr, value in loaded.items():
        monkeypatch.setattr(fa, attr, value)

    def forward(q, k, v, mask=None, **kwargs):
        return fa._flash_attention_forward(q, k, v, mask, query_length=q.shape[1], is_causal=True,
                                           attn_implementation=name, **kwargs)

    q, k, v, cu, longest = packed()
    cu = torch.unique_consecutive(cu)  # position ids cannot express a zero-length document
    positions = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    expected = varlen_attention(q, k, v, cu, cu, longest, longest, is_causal=True, window_size=(3, 0))
    out = forward(q[None], k[None], v[None], position_ids=positions, sliding_window=4)
    assert_close(out[0], expected, F32, "packed by position ids, sliding window 4")
    out = forward(q[None], k[None], v[None], cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest,
                  max_length_k=longest)
    assert_close(out[0], varlen_attention(q, k, v, cu, cu, longest, longest, is_causal=True), F32, "FlashAttentionKwargs")

    B, L = 2, 11
    q2, k2, v2 = (torch.randn(B, L, heads, D) for heads in (H, HKV, HKV))
    padding = torch.ones(B, L, dtype=torch.bool)
    padding[1, :4] = False  # left padding: the unpad path
    out = forward(q2, k2, v2, padding)
    assert_close(out[padding], attention(q2, k2, v2, padding[:, None, None, :], is_causal=True)[padding],
                 F32, "unpadded rows")
    out = forward(q2, k2, v2, sliding_window=3, softcap=4.0)
    assert_close(out, attention(q2, k2, v2, is_causal=True, window_size=(2, 0), softcap=4.0), F32, "dense")
