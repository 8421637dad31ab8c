"""CPU-tier tests of `attn_implementation="dmattn"` for transformers models.

A tiny randomly initialised Llama (no downloads) runs in fp32 through the Triton interpreter
(conftest.py) and is compared with the same weights under transformers' eager attention.
"""

import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

from dmattn_bench import api  # noqa: E402
from dmattn_bench.integrations.transformers import (  # noqa: E402
    ATTN_IMPLEMENTATION, attention_forward, register,
)
from tests.test_api import F32, assert_close  # noqa: E402

NUM_LAYERS = 2


def tiny_llama(attn_implementation):
    # A config per model: `set_attn_implementation` and the model share their config object.
    config = transformers.LlamaConfig(
        hidden_size=64, num_hidden_layers=NUM_LAYERS, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=128, vocab_size=128, attn_implementation=attn_implementation,
    )
    return transformers.LlamaForCausalLM(config)


@pytest.fixture
def api_calls(monkeypatch):
    """Records every call of `dmattn_bench.api.flash_dmattn_func` (the integration's only entry)."""
    calls = []
    original = api.flash_dmattn_func

    def counting(query, key, value, attn_mask=None, attn_bias=None, **kwargs):
        calls.append(dict(kwargs, key_len=key.shape[1], query=query, attn_mask=attn_mask, attn_bias=attn_bias))
        return original(query, key, value, attn_mask, attn_bias, **kwargs)

    monkeypatch.setattr(api, "flash_dmattn_func", counting)
    return calls


def test_import_does_not_import_transformers_and_register_is_idempotent():
    code = ("import sys, dmattn_bench.compat, dmattn_bench.integrations.transformers; "
            "assert 'transformers' not in sys.modules, 'transformers imported before register()'")
    subprocess.run([sys.executable, "-c", code], check=True)
    assert register() == register() == ATTN_IMPLEMENTATION
    from transformers import AttentionInterface, AttentionMaskInterface

    assert AttentionInterface()[ATTN_IMPLEMENTATION] is attention_forward
    assert ATTN_IMPLEMENTATION in AttentionMaskInterface()


def test_llama_left_padding_matches_eager_forward_and_backward(api_calls):
    register()
    eager = tiny_llama("eager")
    ours = tiny_llama("eager")
    ours.load_state_dict(eager.state_dict())
    ours.set_attn_implementation(ATTN_IMPLEMENTATION)
    assert (eager.config._attn_implementation, ours.config._attn_implementation) == ("eager", "dmattn")

    input_ids = torch.randint(0, 128, (2, 12))
    attention_mask = torch.ones(2, 12, dtype=torch.long)
    attention_mask[1, :5] = 0  # left padding
    kept = attention_mask.bool()

    logits = ours(input_ids=input_ids, attention_mask=attention_mask).logits
    assert len(api_calls) == NUM_LAYERS, f"got {len(api_calls)} calls, expected one per layer"
    ref_logits = eager(input_ids=input_ids, attention_mask=attention_mask).logits
    assert torch.isfinite(logits).all()
    assert_close(logits[kept], ref_logits[kept], F32, "logits at non-padded positions")

    # Padded query rows see no key at all (ours: 0, eager: a uniform average), so the loss reads
    # only non-padded positions; the weights' gradients then must agree.
    logits[kept].square().mean().backward()
    ref_logits[kept].square().mean().backward()
    for (name, p), ref in zip(ours.named_parameters(), eager.parameters()):
        assert p.grad is not None and torch.isfinite(p.grad).all(), f"{name}: non-finite gradient"
        assert_close(p.grad, ref.grad, F32, f"d{name}")


def _eval_pair():
    """The eager model and ours with the same weights, in eval mode."""
    eager = tiny_llama("eager").eval()
    ours = tiny_llama(ATTN_IMPLEMENTATION).eval()
    ours.load_state_dict(eager.state_dict())
    return eager, ours


def test_llama_without_mask_uses_causal_rule(api_calls):
    register()
    eager, ours = _eval_pair()
    input_ids = torch.randint(0, 128, (1, 10))
    with torch.no_grad():
        logits = ours(input_ids=input_ids).logits
        assert_close(logits, eager(input_ids=input_ids).logits, F32, "logits")
    assert [c["is_causal"] for c in api_calls] == [True] * NUM_LAYERS


def test_static_cache_generation_matches_eager(api_calls):
    register()
    eager, ours = _eval_pair()
    input_ids = torch.randint(0, 128, (1, 7))
    options = dict(max_new_tokens=3, do_sample=False, cache_implementation="static", eos_token_id=None)
    tokens = ours.generate(input_ids, **options)
    assert torch.equal(tokens, eager.generate(input_ids, **options))
    # Prefill into an empty static cache comes without a mask; the unwritten cache slots are
    # dropped so that causal means the same as SDPA's top-left rule there.
    prefill = api_calls[0]
    assert prefill["is_causal"] and prefill["key_len"] == input_ids.shape[1]


class _Module(torch.nn.Module):
    is_causal = True


# transformers' additive masks hold finfo.min; numpy in the interpreter warns when the kernel
# scales it to -inf, which is the intended result.
@pytest.mark.filterwarnings("ignore:overflow encountered in multiply:RuntimeWarning")
def test_mask_conversion_and_layout(api_calls):
    B, H, Hkv, L, D = 1, 4, 2, 9, 16
    q = torch.randn(B, H, L, D)
    k, v = torch.randn(B, Hkv, L, D), torch.randn(B, Hkv, L, D)
    keep = torch.rand(B, 1, L, L) > 0.3
    additive = torch.where(keep, 0.0, torch.finfo(torch.float32).min)
    out_bool, weights = attention_forward(_Module(), q, k, v, keep, scaling=0.2)
    out_float, _ = attention_forward(_Module(), q, k, v, additive, scaling=0.2)
    (mask_call, bias_call) = api_calls
    assert weights is None and out_bool.shape == (B, L, H, D) and out_bool.is_contiguous()
    assert not mask_call["is_causal"] and mask_call["softmax_scale"] == 0.2
    # Views and the caller's own mask tensors, never copies.
    assert mask_call["query"].data_ptr() == q.data_ptr() and mask_call["query"].shape == (B, L, H, D)
    assert mask_call["attn_mask"] is keep and mask_call["attn_bias"] is None
    assert bias_call["attn_bias"] is additive and bias_call["attn_mask"] is None
    expected = api.flash_dmattn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), keep,
                                     softmax_scale=0.2)
    assert torch.equal(out_bool, expected)
    assert_close(out_float, expected, F32, "additive float mask as attn_bias")


def test_dropout_raises_naming_it():
    q = torch.randn(1, 2, 8, 16)
    with pytest.raises(NotImplementedError, match="dropout"):
        attention_forward(_Module(), q, q, q, None, dropout=0.1)
