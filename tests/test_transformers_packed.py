"""CPU-tier tests of packed rows and sliding windows under `attn_implementation="dmattn"`.

Tiny randomly initialised Llama and Mistral models (no downloads) run in fp32 through the Triton
interpreter (conftest.py). A packed row (several documents in one batch row, as transformers'
`DataCollatorWithFlattening` builds it) must give each document's logits and gradients as if it
ran alone, through `flash_dmattn_varlen_func` and without reading a mask.
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from dmattn_bench import api, varlen  # noqa: E402
from dmattn_bench.integrations import transformers as integration  # noqa: E402
from tests.test_api import F32, assert_close  # noqa: E402

NUM_LAYERS = 2
VOCAB = 128
LENGTHS = [5, 1, 9, 7]  # documents of one packed row: one of a single token, none a tile's multiple
SLIDING_WINDOW = 4  # shorter than most documents, so that it cuts


def tiny(kind, attn_implementation):
    """A tiny random model: "llama", or "mistral" with a sliding window of SLIDING_WINDOW."""
    config_class, model_class, extra = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, {"sliding_window": SLIDING_WINDOW}),
    }[kind]
    config = config_class(hidden_size=64, num_hidden_layers=NUM_LAYERS, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=16, intermediate_size=128, vocab_size=VOCAB, attn_implementation=attn_implementation,
                          **extra)
    return model_class(config)


def pair(kind, reference="eager"):
    """The reference model and ours with the same weights."""
    integration.register()
    ref = tiny(kind, reference)
    ours = tiny(kind, integration.ATTN_IMPLEMENTATION)
    ours.load_state_dict(ref.state_dict())
    return ref, ours


@pytest.fixture
def calls(monkeypatch):
    """Records every dense and packed call the integration makes."""
    made = []
    dense, packed = api.flash_dmattn_func, varlen.flash_dmattn_varlen_func

    def counting_dense(query, key, value, attn_mask=None, attn_bias=None, **kwargs):
        made.append(dict(kwargs, kind="dense", query=query, attn_mask=attn_mask, attn_bias=attn_bias))
        return dense(query, key, value, attn_mask, attn_bias, **kwargs)

    def counting_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **kwargs):
        made.append(dict(kwargs, kind="packed", query=q, cu_seqlens_q=cu_seqlens_q.tolist(),
                         cu_seqlens_k=cu_seqlens_k.tolist(), max_seqlen_q=max_seqlen_q))
        return packed(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **kwargs)

    monkeypatch.setattr(api, "flash_dmattn_func", counting_dense)
    monkeypatch.setattr(varlen, "flash_dmattn_varlen_func", counting_packed)
    return made


def documents():
    """The documents' token ids, and the packed row's ids, position ids and FlashAttentionKwargs as
    `DataCollatorWithFlattening(return_flash_attn_kwargs=True)` gives them."""
    docs = [torch.randint(0, VOCAB, (n,)) for n in LENGTHS]
    collate = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)
    batch = collate([{"input_ids": d.tolist()} for d in docs])
    return docs, batch


PACKED_INPUTS = {
    "position_ids": ("input_ids", "position_ids"),
    "flash_attn_kwargs": ("input_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"),
    "both": ("input_ids", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"),
}
CU_SEQLENS = [0, 5, 6, 15, 22]


def test_the_collator_gives_the_names_we_read():
    _, batch = documents()
    assert set(integration.PACKED_KWARGS) <= set(batch)
    assert batch["cu_seq_lens_q"].tolist() == CU_SEQLENS and batch["max_length_q"] == max(LENGTHS)
    assert batch["cu_seq_lens_q"].dtype == torch.int32 and batch["input_ids"].shape == (1, sum(LENGTHS))


@pytest.mark.parametrize("kind", ["llama", "mistral"])
@pytest.mark.parametrize("given", sorted(PACKED_INPUTS))
def test_packed_row_equals_each_document_alone(kind, given, calls):
    ref, ours = pair(kind)
    docs, batch = documents()
    inputs = {name: batch[name] for name in PACKED_INPUTS[given]}
    logits = ours(**inputs).logits
    # causal and the window per document: a mask built from position ids is checked and not read
    assert [c["kind"] for c in calls] == ["packed"] * NUM_LAYERS
    window = (SLIDING_WINDOW - 1, 0) if kind == "mistral" else (-1, -1)
    for call in calls:
        assert call["cu_seqlens_q"] == call["cu_seqlens_k"] == CU_SEQLENS
        assert call["is_causal"] and call["window_size"] == window and call["max_seqlen_q"] == max(LENGTHS)
    alone = [ref(input_ids=d[None]).logits[0] for d in docs]
    assert_close(logits[0], torch.cat(alone), F32, "packed logits")

    # a training step: the packed row's loss is the documents' losses summed
    logits[0].square().mean(-1).sum().backward()
    sum(a.square().mean(-1).sum() for a in alone).backward()
    for (name, p), r in zip(ours.named_parameters(), ref.parameters()):
        assert p.grad is not None and torch.isfinite(p.grad).all(), f"{name}: non-finite gradient"
        assert_close(p.grad, r.grad, F32, f"d{name}")


def test_packed_call_takes_views_of_the_row(calls):
    B, H, Hkv, L, D = 1, 4, 2, 22, 16
    q = torch.randn(B, H, L, D)
    k, v = torch.randn(B, Hkv, L, D), torch.randn(B, Hkv, L, D)
    cu = torch.tensor(CU_SEQLENS, dtype=torch.int32)
    out, weights = integration.attention_forward(
        torch.nn.Module(), q, k, v, None, scaling=0.3, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
        max_length_q=max(LENGTHS), max_length_k=max(LENGTHS))
    (call,) = calls
    assert weights is None and out.shape == (B, L, H, D) and out.is_contiguous()
    assert call["query"].data_ptr() == q.data_ptr() and call["query"].shape == (L, H, D)
    assert call["is_causal"] and call["softmax_scale"] == 0.3


def test_mistral_sliding_window_matches_sdpa(calls):
    ref, ours = pair("mistral", reference="sdpa")
    ref.eval(), ours.eval()
    input_ids = torch.randint(0, VOCAB, (1, 13))
    with torch.no_grad():
        logits = ours(input_ids=input_ids).logits
        assert_close(logits, ref(input_ids=input_ids).logits, F32, "logits")
    # transformers' sliding-window mask is checked once and replaced by the window: no mask read
    assert [(c["kind"], c["attn_mask"], c["window_size"], c["is_causal"]) for c in calls] == \
        [("dense", None, (SLIDING_WINDOW - 1, 0), True)] * NUM_LAYERS


def test_sliding_window_keyword_without_mask(calls):
    B, H, L, D = 2, 2, 9, 16
    q, k, v = (torch.randn(B, H, L, D) for _ in range(3))

    class Layer(torch.nn.Module):
        is_causal = True

    for window, expected in ((SLIDING_WINDOW, (SLIDING_WINDOW - 1, 0)), (L, (-1, -1)), (None, (-1, -1))):
        calls.clear()
        out, _ = integration.attention_forward(Layer(), q, k, v, None, sliding_window=window)
        assert calls[0]["window_size"] == expected, f"sliding_window={window}"
        reference = api.flash_dmattn_func(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True,
                                          window_size=expected)
        assert torch.equal(out, reference)
    calls.clear()
    Layer.is_causal = False  # an encoder's window reaches both ways
    integration.attention_forward(Layer(), q, k, v, None, sliding_window=SLIDING_WINDOW)
    assert calls[0]["window_size"] == (SLIDING_WINDOW - 1, SLIDING_WINDOW - 1) and not calls[0]["is_causal"]


def test_a_mask_with_padding_is_read_as_before(calls):
    ref, ours = pair("llama")
    input_ids = torch.randint(0, VOCAB, (1, 12))
    attention_mask = torch.ones(1, 12, dtype=torch.long)
    attention_mask[0, :3] = 0  # left padding in a batch of one: not the packed pattern
    kept = attention_mask.bool()
    with torch.no_grad():
        logits = ours(input_ids=input_ids, attention_mask=attention_mask).logits
        assert_close(logits[kept], ref(input_ids=input_ids, attention_mask=attention_mask).logits[kept], F32, "logits")
    assert all(c["kind"] == "dense" and c["attn_mask"] is not None for c in calls)


def test_a_mask_is_checked_once_per_forward(monkeypatch):
    read = []
    original = integration._read_documents

    def counting(*args):
        read.append(args)
        return original(*args)

    monkeypatch.setattr(integration, "_read_documents", counting)
    _, ours = pair("mistral")
    _, batch = documents()
    with torch.no_grad():
        ours(input_ids=batch["input_ids"], position_ids=batch["position_ids"])
    assert len(read) == 1, f"{len(read)} reads for one forward of {NUM_LAYERS} layers"
    mask = torch.ones(1, 1, 6, 6, dtype=torch.bool).tril()
    assert integration._documents(mask, None, None, 6, mask.device) is not None
    mask[..., 3:, :3] = False  # written in place (two documents now): read again
    assert integration._documents(mask, None, None, 6, mask.device)[0].tolist() == [0, 3, 6]
    assert len(read) == 3


def test_packed_kwargs_need_one_batch_row():
    q = torch.randn(2, 2, 6, 16)
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="^cu_seq_lens_q: .*batch of 2"):
        integration.attention_forward(torch.nn.Module(), q, q, q, None, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                                      max_length_q=4, max_length_k=4)
