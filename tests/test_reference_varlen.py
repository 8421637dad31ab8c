"""Tests for the packed-sequence reference (`reference.varlen_attention`), its argument checks
(`checks.check_varlen_call`) and the dense reference's `window_size`.

The varlen reference is compared with the dense reference on a padded batch built here, one batch
row per sequence, with the causal rule, the window and the sequence bounds written out as an
explicit boolean mask (the dense call gets no `is_causal`, `window_size` or `cache_seqlens`).
"""

import math

import pytest
import torch

from dmattn_bench import checks
from dmattn_bench.reference import attention, varlen_attention, varlen_layout

F64 = torch.float64
H, HKV, D = 4, 2, 8
SPARE = 3  # rows and keys past the last prefix sum: memory past `total` that no sequence owns

# Per sequence: queries, keys in the cu_seqlens_k span, keys used when seqused_k is given. Covers an
# empty sequence, a one-token one, a sequence with queries and no keys, Lq > Lk and Lq < Lk.
LENS_Q = (3, 0, 1, 5, 2, 2, 4)
LENS_K = (4, 2, 1, 3, 6, 0, 5)
USED_K = (4, 1, 1, 2, 3, 0, 5)  # shorter than the span for sequences 1, 3 and 4


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _prefix_sums(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


class Packed:
    """A packed batch: inputs of `varlen_attention`, plus each sequence's bounds for the padded
    dense construction."""

    def __init__(self, seed=0, used=False, mask_layout=None, mask_heads=H, bias_layout=None, bias_heads=H):
        g = _gen(seed)
        self.cu_q, self.cu_k = _prefix_sums(LENS_Q), _prefix_sums(LENS_K)
        self.lens_k = USED_K if used else LENS_K
        self.seqused_k = torch.tensor(USED_K, dtype=torch.int32) if used else None
        self.total_q, self.total_k = int(self.cu_q[-1]) + SPARE, int(self.cu_k[-1]) + SPARE
        self.max_q, self.max_k = max(LENS_Q), max(self.lens_k)
        self.q = torch.randn(self.total_q, H, D, generator=g, dtype=F64)
        self.k = torch.randn(self.total_k, HKV, D, generator=g, dtype=F64)
        self.v = torch.randn(self.total_k, HKV, D, generator=g, dtype=F64)
        self.mask_layout, self.bias_layout = mask_layout, bias_layout
        self.mask = self.bias = None
        if mask_layout:
            self.mask = torch.rand(self._layout_shape(mask_layout, mask_heads), generator=g) < 0.75
        if bias_layout:
            self.bias = torch.randn(self._layout_shape(bias_layout, bias_heads), generator=g, dtype=F64)

    def _layout_shape(self, layout, heads):
        return (heads, self.total_k) if layout == "per_key" else (heads, self.total_q, self.max_k)

    def bounds(self):
        """(first query, queries, first key, keys) of each sequence."""
        return [(int(self.cu_q[s]), LENS_Q[s], int(self.cu_k[s]), self.lens_k[s]) for s in range(len(LENS_Q))]

    def call(self, q=None, k=None, v=None, mask=None, bias=None, **kw):
        return varlen_attention(
            self.q if q is None else q, self.k if k is None else k, self.v if v is None else v,
            self.cu_q, self.cu_k, self.max_q, self.max_k,
            attn_mask=self.mask if mask is None else mask, attn_bias=self.bias if bias is None else bias,
            seqused_k=self.seqused_k, return_lse=True, **kw)


def _gather(source, index, valid, fill):
    """source[index] where valid, else fill: differentiable in source, never reads it where invalid."""
    picked = source[index.clamp(min=0)]
    valid = valid.reshape(valid.shape + (1,) * (picked.dim() - valid.dim()))
    return torch.where(valid, picked, torch.full((), fill, dtype=picked.dtype))


def padded_dense(p: Packed, q, k, v, mask, bias, is_causal=False, window_size=(-1, -1)):
    """The packed call as one dense call: sequence s is batch row s, its queries left-padded to
    Lq_max (so its last query is the last row), its keys right-padded to Lk_max. Returns (out, lse)
    unpacked to the varlen layouts, rows of no sequence 0 / -inf."""
    bounds = p.bounds()
    N, Lqp, Lkp = len(bounds), p.max_q, p.max_k
    q_index = torch.full((N, Lqp), -1)
    k_index = torch.full((N, Lkp), -1)
    visible = torch.zeros(N, 1, Lqp, Lkp, dtype=torch.bool)
    left, right = window_size
    for s, (q0, lq, k0, lk) in enumerate(bounds):
        pad = Lqp - lq
        q_index[s, pad:] = torch.arange(q0, q0 + lq)
        k_index[s, :lk] = torch.arange(k0, k0 + lk)
        for i in range(lq):
            diagonal = i + lk - lq
            for j in range(lk):
                visible[s, 0, pad + i, j] = ((not is_causal or j <= diagonal)
                                             and (left < 0 or j >= diagonal - left)
                                             and (right < 0 or j <= diagonal + right))
    q_valid, k_valid = q_index >= 0, k_index >= 0
    qd, kd, vd = _gather(q, q_index, q_valid, 0.0), _gather(k, k_index, k_valid, 0.0), _gather(v, k_index, k_valid, 0.0)

    def dense(t, layout, fill):  # (heads, ...) packed -> (N, heads, Lqp|1, Lkp)
        if layout == "per_key":
            return _gather(t.T, k_index, k_valid, fill).permute(0, 2, 1).unsqueeze(2)
        rows = _gather(t.transpose(0, 1), q_index, q_valid, fill)  # (N, Lqp, heads, max_k)
        return rows.permute(0, 2, 1, 3)[..., :Lkp]

    dense_mask = visible if mask is None else visible & dense(mask, p.mask_layout, False)
    dense_bias = None if bias is None else dense(bias, p.bias_layout, 0.0)
    out, lse = attention(qd, kd, vd, dense_mask, dense_bias, return_lse=True)
    outs, lses = [], []
    for s, (q0, lq, _, _) in enumerate(bounds):
        outs.append(out[s, Lqp - lq:])
        lses.append(lse[s, :, Lqp - lq:])
    spare = p.total_q - int(p.cu_q[-1])
    outs.append(torch.zeros(spare, H, D, dtype=F64))
    lses.append(torch.full((H, spare), -math.inf, dtype=F64))
    return torch.cat(outs), torch.cat(lses, dim=1)


def _loss(out, lse, seed=7):
    w = torch.randn(out.shape, generator=_gen(seed), dtype=out.dtype)
    return (out * w).sum() + torch.where(torch.isfinite(lse), lse, 0.0).sum()


LAYOUT_CASES = [
    # mask layout, mask heads, bias layout, bias heads
    (None, H, None, H),
    ("per_key", H, None, H),
    ("per_row", HKV, None, H),
    (None, H, "per_key", HKV),
    (None, H, "per_row", 1),
    ("per_key", 1, "per_row", H),
    ("per_row", H, "per_key", 1),
    ("per_row", 1, "per_row", HKV),
    ("per_key", HKV, "per_key", H),
]
RULE_CASES = [
    # is_causal, window_size, seqused_k
    (False, (-1, -1), False),
    (True, (-1, -1), False),
    (True, (-1, -1), True),
    (False, (2, 1), False),
    (False, (-1, 0), True),
    (True, (2, 1), True),
]


@pytest.mark.parametrize("causal,window,used", RULE_CASES)
@pytest.mark.parametrize("mask_layout,mask_heads,bias_layout,bias_heads", LAYOUT_CASES)
def test_matches_padded_dense(mask_layout, mask_heads, bias_layout, bias_heads, causal, window, used):
    p = Packed(seed=1, used=used, mask_layout=mask_layout, mask_heads=mask_heads, bias_layout=bias_layout,
               bias_heads=bias_heads)
    leaves = [t.clone().requires_grad_(True) for t in (p.q, p.k, p.v)]
    if p.bias is not None:
        leaves.append(p.bias.clone().requires_grad_(True))
    q, k, v, bias = (*leaves, None)[:4]
    out, lse = p.call(q, k, v, bias=bias, is_causal=causal, window_size=window)
    want_out, want_lse = padded_dense(p, q, k, v, p.mask, bias, causal, window)

    assert out.shape == (p.total_q, H, D) and out.dtype == F64
    assert lse.shape == (H, p.total_q) and lse.dtype == F64
    torch.testing.assert_close(out, want_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, want_lse, rtol=1e-12, atol=1e-12)
    assert torch.isfinite(out).all() and not lse.isnan().any()
    got = torch.autograd.grad(_loss(out, lse), leaves)
    want = torch.autograd.grad(_loss(want_out, want_lse), leaves)
    for a, b in zip(got, want):
        assert a.shape == b.shape and torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    if bias is not None:
        assert got[-1].shape == p.bias.shape


def test_rows_of_no_sequence_and_keyless_sequences_are_dead():
    p = Packed(seed=2)
    out, lse = p.call(is_causal=True)
    keyless = LENS_K.index(0)
    rows = [*range(int(p.cu_q[keyless]), int(p.cu_q[keyless + 1])), *range(int(p.cu_q[-1]), p.total_q)]
    assert torch.equal(out[rows], torch.zeros(len(rows), H, D, dtype=F64))
    assert torch.equal(lse[:, rows], torch.full((H, len(rows)), -math.inf, dtype=F64))


def test_one_token_sequence_is_its_value():
    # Sequence 2 has one query and one key: softmax over one key returns that key's value.
    p = Packed(seed=3)
    out = p.call()[0]
    q0, k0 = int(p.cu_q[2]), int(p.cu_k[2])
    torch.testing.assert_close(out[q0], p.v[k0].repeat_interleave(H // HKV, dim=0), rtol=0, atol=1e-14)


@pytest.mark.parametrize("bias_layout", ["per_key", "per_row"])
def test_unread_memory_never_reaches_a_result(bias_layout):
    """NaN in keys past seqused_k, past total_k, rows past total_q and every bias/mask entry no
    sequence reads: out, lse and all gradients are bitwise those of the clean inputs."""
    p = Packed(seed=4, used=True, mask_layout="per_row", mask_heads=1, bias_layout=bias_layout, bias_heads=H)
    read_k = torch.zeros(p.total_k, dtype=torch.bool)
    read_q = torch.zeros(p.total_q, dtype=torch.bool)
    read_cols = torch.zeros(p.total_q, p.max_k, dtype=torch.bool)
    for q0, lq, k0, lk in p.bounds():
        read_k[k0:k0 + lk] = True
        read_q[q0:q0 + lq] = True
        read_cols[q0:q0 + lq, :lk] = True
    assert (~read_k).sum() > SPARE and (~read_cols[read_q]).any()  # the case poisons inside spans too
    poisoned = {
        "q": p.q.masked_fill(~read_q[:, None, None], math.nan),
        "k": p.k.masked_fill(~read_k[:, None, None], math.nan),
        "v": p.v.masked_fill(~read_k[:, None, None], math.inf),
        "bias": p.bias.masked_fill(~(read_k if bias_layout == "per_key" else read_cols), math.nan),
        # an unread mask entry of True must not open a key either
        "mask": p.mask | ~read_cols,
    }
    results = []
    for inputs in ({"q": p.q, "k": p.k, "v": p.v, "bias": p.bias, "mask": p.mask}, poisoned):
        leaves = {name: inputs[name].clone().requires_grad_(True) for name in ("q", "k", "v", "bias")}
        out, lse = p.call(mask=inputs["mask"], is_causal=True, window_size=(3, -1), **leaves)
        results.append((out, lse, *torch.autograd.grad(_loss(out, lse), list(leaves.values()))))
    for clean, dirty in zip(*results):
        assert torch.equal(clean, dirty)
    dbias = results[1][-1]
    unread = ~read_k if bias_layout == "per_key" else ~read_cols
    assert torch.equal(dbias[:, unread], torch.zeros_like(dbias[:, unread]))


def test_other_sequences_keys_never_reach_a_sequence():
    p = Packed(seed=5, mask_layout="per_key", mask_heads=HKV, bias_layout="per_key", bias_heads=1)
    clean_out, clean_lse = p.call(is_causal=True)
    victim = 4
    _, _, k0, lk = p.bounds()[victim]
    k, v, bias = p.k.clone(), p.v.clone(), p.bias.clone()
    k[k0:k0 + lk], v[k0:k0 + lk], bias[:, k0:k0 + lk] = math.nan, math.nan, math.nan
    out, lse = p.call(k=k, v=v, bias=bias, is_causal=True)
    q0, lq = int(p.cu_q[victim]), LENS_Q[victim]
    others = torch.ones(p.total_q, dtype=torch.bool)
    others[q0:q0 + lq] = False
    assert torch.equal(out[others], clean_out[others])
    assert torch.equal(lse[:, others], clean_lse[:, others])
    assert out[q0:q0 + lq].isnan().all()  # the poison did land on its own sequence


def test_lse_is_fp32_for_fp32_compute_and_out_keeps_q_dtype():
    p = Packed(seed=6, bias_layout="per_key", bias_heads=H)
    out, lse = varlen_attention(p.q.float(), p.k.float(), p.v.float(), p.cu_q, p.cu_k, p.max_q, p.max_k,
                                attn_bias=p.bias.float(), return_lse=True, compute_dtype=torch.float32)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32


def test_no_sequences():
    q, k = torch.randn(2, H, D, dtype=F64), torch.randn(3, HKV, D, dtype=F64)
    cu = torch.zeros(1, dtype=torch.int32)
    out, lse = varlen_attention(q, k, k, cu, cu, 0, 0, return_lse=True)
    assert torch.equal(out, torch.zeros_like(q)) and torch.equal(lse, torch.full((H, 2), -math.inf, dtype=F64))


def test_layout_is_decided_by_shape():
    assert varlen_layout((HKV, 9), "attn_bias", H, HKV, 7, 9, 5) == "per_key"
    assert varlen_layout((1, 7, 5), "attn_mask", H, HKV, 7, 9, 5) == "per_row"
    with pytest.raises(ValueError, match=r"attn_mask: got shape \(3, 9\), expected per key \(H\|Hkv\|1, "
                                         r"total_k\) = \(4\|2\|1, 9\) or per query row"):
        varlen_layout((3, 9), "attn_mask", H, HKV, 7, 9, 5)


# -- data checks of the eager reference (it reads cu_seqlens) --

@pytest.mark.parametrize("change,error", [
    (dict(max_q=4), r"cu_seqlens_q: sequence 3 has 5 queries, expected at most max_seqlen_q = 4"),
    (dict(max_k=5), r"cu_seqlens_k: sequence 4 has 6 keys, expected at most max_seqlen_k = 5"),
    (dict(cu_q=[0, 3, 2, 3, 8, 10, 12, 16]), r"cu_seqlens_q: got entry \[2\] = 2 after 3, expected non-decreasing"),
    (dict(cu_k=[0, 4, 6, 7, 10, 16, 16, 40]), r"cu_seqlens_k: got last entry 40, expected at most total_k = 24"),
    (dict(seqused_k=[4, 3, 1, 2, 3, 0, 5]), r"seqused_k: sequence 1 uses 3 keys, expected 0\.\.2"),
])
def test_reference_reads_and_checks_the_prefix_sums(change, error):
    p = Packed(seed=7)
    args = dict(cu_q=p.cu_q, cu_k=p.cu_k, max_q=p.max_q, max_k=p.max_k, seqused_k=None)
    args.update({name: torch.tensor(x, dtype=torch.int32) if isinstance(x, list) else x for name, x in change.items()})
    with pytest.raises(ValueError, match=error):
        varlen_attention(p.q, p.k, p.v, args["cu_q"], args["cu_k"], args["max_q"], args["max_k"],
                         seqused_k=args["seqused_k"])


# -- signature checks (no data read) --

def _call_args(**change):
    p = Packed(seed=8, mask_layout="per_key", mask_heads=H, bias_layout="per_row", bias_heads=HKV)
    args = dict(q=p.q, k=p.k, v=p.v, cu_seqlens_q=p.cu_q, cu_seqlens_k=p.cu_k, max_seqlen_q=p.max_q,
                max_seqlen_k=p.max_k, attn_mask=p.mask, attn_bias=p.bias, is_causal=False, window_size=(-1, -1),
                softcap=0.0, softmax_scale=None, seqused_k=None, backend="reference", fwd_config=None,
                bwd_config=None)
    args.update(change)
    return args


def test_check_varlen_call_returns_the_default_scale():
    assert checks.check_varlen_call(**_call_args()) == pytest.approx(1 / math.sqrt(D))
    assert checks.check_varlen_call(**_call_args(softmax_scale=0.5)) == 0.5


TOTAL_Q, TOTAL_K = sum(LENS_Q) + SPARE, sum(LENS_K) + SPARE  # 20, 24: the messages below spell them out
_Q, _K = torch.zeros(TOTAL_Q, H, D, dtype=F64), torch.zeros(TOTAL_K, HKV, D, dtype=F64)
_CU = torch.zeros(len(LENS_Q) + 1, dtype=torch.int32)


@pytest.mark.parametrize("change,exc,error", [
    (dict(q=_Q[0]), ValueError, r"q: got shape \(4, 8\), expected 3-D \(total_q, H, D\)"),
    (dict(k=torch.zeros(24, 3, D, dtype=F64)), ValueError, r"k: got shape \(24, 3, 8\) with Hkv=3 heads"),
    (dict(v=_K[:20]), ValueError, r"v: got shape \(20, 2, 8\), expected \(24, 2, 8\) \(k's shape\)"),
    (dict(k=torch.zeros(24, HKV, 16, dtype=F64)), ValueError,
     r"k: got shape \(24, 2, 16\), expected \(total_k, Hkv, D=8\)"),
    (dict(q=_Q.int()), TypeError, r"q: got dtype torch.int32, expected a floating dtype"),
    (dict(cu_seqlens_q=_CU.long()), TypeError, r"cu_seqlens_q: got dtype torch.int64, expected torch.int32"),
    (dict(cu_seqlens_k=_CU[:5]), ValueError, r"cu_seqlens_k: got shape \(5,\), expected \(N\+1,\) = \(8,\)"),
    (dict(cu_seqlens_q=torch.zeros(0, dtype=torch.int32)), ValueError,
     r"cu_seqlens_q: got shape \(0,\), expected \(N\+1,\)"),
    (dict(cu_seqlens_q=torch.zeros(16, dtype=torch.int32)[::2]), ValueError, r"cu_seqlens_q: got stride 2, expected 1"),
    (dict(cu_seqlens_k=[0, 1]), TypeError, r"cu_seqlens_k: got list, expected a torch.Tensor"),
    (dict(max_seqlen_q=5.0), TypeError, r"max_seqlen_q: got float 5.0, expected an int >= 0"),
    (dict(max_seqlen_k=-1), ValueError, r"max_seqlen_k: got -1, expected an int >= 0"),
    (dict(seqused_k=torch.zeros(8, dtype=torch.int32)), ValueError,
     r"seqused_k: got shape \(8,\), expected \(N,\) = \(7,\)"),
    (dict(seqused_k=torch.zeros(7)), TypeError, r"seqused_k: got dtype torch.float32, expected torch.int32"),
    (dict(attn_mask=torch.zeros(H, 23, dtype=torch.bool)), ValueError,
     r"attn_mask: got shape \(4, 23\), expected per key \(H\|Hkv\|1, total_k\) = \(4\|2\|1, 24\) or per query row "
     r"\(H\|Hkv\|1, total_q, max_seqlen_k\) = \(4\|2\|1, 20, 6\)"),
    (dict(attn_bias=torch.zeros(1, 1, 20, 6, dtype=F64)), ValueError,
     r"attn_bias: got shape \(1, 1, 20, 6\), expected per key"),
    (dict(attn_bias=torch.zeros(H, 20, 5, dtype=F64)), ValueError,
     r"attn_bias: got shape \(4, 20, 5\), expected per key"),
    (dict(attn_mask=torch.zeros(H, 24)), TypeError, r"attn_mask: got dtype torch.float32, expected torch.bool"),
    (dict(attn_bias=torch.zeros(H, 24, dtype=torch.int32)), TypeError,
     r"attn_bias: got dtype torch.int32, expected a floating"),
    (dict(attn_bias=torch.zeros(H, 24, dtype=F64, device="meta")), ValueError,
     r"attn_bias: got device meta, expected cpu \(q's device\)"),
    (dict(is_causal=1), TypeError, r"is_causal: got int 1, expected True or False"),
    (dict(window_size=(2,)), ValueError, r"window_size: got \(2,\), expected \(left, right\)"),
    (dict(window_size=(-2, 0)), ValueError, r"window_size: got \(-2, 0\), expected \(left, right\), two ints >= -1"),
    (dict(softcap=-1.0), ValueError, r"softcap: got -1.0, expected a finite value >= 0"),
    (dict(softmax_scale=0.0), ValueError, r"softmax_scale: got 0.0, expected a finite value > 0"),
    (dict(backend="tpu"), ValueError, r"tpu"),
    (dict(backend="triton", q=torch.zeros(20, D, H, dtype=F64).transpose(1, 2)), ValueError,
     r"q: got strides \(32, 1, 4\) for shape \(20, 4, 8\), expected the last \(head\) dim to have stride 1"),
])
def test_check_varlen_call_errors_name_the_argument(change, exc, error):
    with pytest.raises(exc, match=error) as info:
        checks.check_varlen_call(**_call_args(**change))
    assert "\n" not in str(info.value)


def test_check_varlen_call_accepts_strided_masks_and_biases():
    # The kernels take a mask's and a bias's strides: a transposed or sliced view needs no copy.
    bias = torch.zeros(TOTAL_K, H, dtype=F64).T
    mask = torch.zeros(H, TOTAL_Q, 12, dtype=torch.bool)[:, :, ::2]
    assert checks.check_varlen_call(**_call_args(attn_bias=bias, attn_mask=mask, backend="reference")) > 0


# -- the dense reference's window --

def _band(B, Lq, Lk, window, key_lengths):
    """(B, 1, Lq, Lk) explicit window mask, bottom-right aligned on each batch row's key length."""
    left, right = window
    band = torch.zeros(B, 1, Lq, Lk, dtype=torch.bool)
    for b in range(B):
        for i in range(Lq):
            diagonal = i + key_lengths[b] - Lq
            for j in range(Lk):
                band[b, 0, i, j] = (left < 0 or j >= diagonal - left) and (right < 0 or j <= diagonal + right)
    return band


@pytest.mark.parametrize("window", [(2, 1), (-1, 0), (0, -1), (0, 0), (3, -1)])
@pytest.mark.parametrize("Lq,Lk,cache", [(5, 5, None), (3, 7, None), (7, 3, None), (4, 8, (5, 8))])
def test_window_matches_an_explicit_band_mask(window, Lq, Lk, cache):
    B = 2
    g = _gen(9)
    q = torch.randn(B, Lq, H, D, generator=g, dtype=F64, requires_grad=True)
    k = torch.randn(B, Lk, HKV, D, generator=g, dtype=F64, requires_grad=True)
    v = torch.randn(B, Lk, HKV, D, generator=g, dtype=F64, requires_grad=True)
    bias = torch.randn(B, 1, Lq, Lk, generator=g, dtype=F64, requires_grad=True)
    cache_seqlens = None if cache is None else torch.tensor(cache, dtype=torch.int32)
    band = _band(B, Lq, Lk, window, cache or (Lk,) * B)
    results = []
    for kw in (dict(window_size=window), dict(attn_mask=band)):
        out, lse = attention(q, k, v, attn_bias=bias, return_lse=True, cache_seqlens=cache_seqlens, **kw)
        results.append((out, lse, *torch.autograd.grad(_loss(out, lse), [q, k, v, bias])))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert torch.isfinite(results[0][0]).all()
