"""The forward's K/V loads through TMA descriptors (`forward.kv_by_tma`, used on sm90) against its
pointer loads: the same bits, on ragged shapes where the descriptor's zero fill does the
bounds checks. The interpreter runs descriptor loads, so the CPU tier checks both paths; the
GPU tier's full suite runs the descriptor path on a Hopper GPU.
"""

import pytest
import torch

from dmattn_bench.space import FwdConfig
from dmattn_kernels.triton import forward, handles, launch

CASES = {
    # name: (Lq, Lk, H, Hkv, D, causal, mask, bias)
    "ragged-keys-gqa-mask-bias": (40, 72, 4, 2, 24, True, True, True),
    "keys-shorter-than-queries": (72, 40, 2, 2, 32, True, False, False),
    "dense-noncausal-padded-head": (48, 48, 2, 1, 40, False, False, True),
}


def _forward(q, k, v, mask, bias, causal, config):
    out = torch.full_like(q, float("nan"))
    lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("nan"))
    launch.attention_forward(q, k, v, mask, bias, is_causal=causal, softmax_scale=q.shape[-1] ** -0.5,
                             softcap=0.0, config=config, out=out, lse=lse)
    return out, lse


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_descriptor_loads_equal_pointer_loads(monkeypatch, case, dtype):
    seqlen_q, seqlen_k, heads, heads_kv, head_dim, causal, with_mask, with_bias = CASES[case]
    generator = torch.Generator().manual_seed(len(case))
    q = torch.randn(2, seqlen_q, heads, head_dim, generator=generator).to(dtype)
    k = torch.randn(2, seqlen_k, heads_kv, head_dim, generator=generator).to(dtype)
    v = torch.randn(2, seqlen_k, heads_kv, head_dim, generator=generator).to(dtype)
    mask = torch.rand(2, heads_kv, seqlen_q, seqlen_k, generator=generator) > 0.4 if with_mask else None
    if mask is not None:
        mask[0, 0, 3] = False  # a dead row: out 0, lse -inf on both paths
    bias = torch.randn(2, heads, seqlen_q, seqlen_k, generator=generator).to(dtype) if with_bias else None
    config = FwdConfig(32, 32, 4, 2)

    built = []
    plan = launch.ForwardPlan
    monkeypatch.setattr(launch, "ForwardPlan", lambda *a, **k: built.append(plan(*a, **k)) or built[-1])
    monkeypatch.setattr(forward, "kv_by_tma", lambda k, v: False)
    launch.clear_plans()  # a plan keeps its load path: each variant needs its own
    out_ptr, lse_ptr = _forward(q, k, v, mask, bias, causal, config)
    monkeypatch.setattr(forward, "kv_by_tma", lambda k, v: True)
    launch.clear_plans()
    out_tma, lse_tma = _forward(q, k, v, mask, bias, causal, config)
    launch.clear_plans()
    assert [p.use_tma for p in built] == [False, True]

    assert torch.isfinite(out_tma).all()
    assert not torch.isnan(lse_tma).any()
    assert torch.equal(out_tma, out_ptr)
    assert torch.equal(lse_tma, lse_ptr)
    if mask is not None:
        assert torch.all(out_tma[0, 3, 0] == 0) and lse_tma[0, 0, 3] == float("-inf")


def test_cpu_tensors_take_pointer_loads():
    k = torch.zeros(1, 16, 1, 16, dtype=torch.float16)
    assert forward.kv_by_tma(k, k) is False


def test_descriptors_cover_the_whole_key_tensor():
    """A plan checks the descriptor once and keeps no tensor; each run's copy carries its own."""
    k = torch.zeros(2, 40, 3, 24, dtype=torch.float16)
    template = handles.descriptor_template(k, [1, 32, 1, 32])
    assert template.base is None
    k_desc = handles.descriptor_on(template, k)
    assert k_desc.base is k
    assert list(k_desc.shape) == [2, 40, 3, 24]
    assert list(k_desc.strides) == list(k.stride())
    assert list(k_desc.block_shape) == [1, 32, 1, 32]
