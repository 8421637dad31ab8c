"""The kernels `dmattn-bench bench` measures on packed-document and sliding-window workloads
(`bench.packed`), each prepared once per workload into a `peers.Prepared` as the dense peers are:

- ours: `flash_dmattn_varlen_func` on the packed tensors, or `flash_dmattn_func` with
  `window_size` on a dense batch (`dmattn`, and one backend's defaults: `ours-triton`, `ours-cuda`);
- `flex`: FlexAttention compiled as `peers._flex` compiles it, with a block mask of the documents
  (and window, and dynamic mask, read by its mask_mod) built once outside the timed call, and a
  score_mod adding the bias;
- `flex-rebuild`: the same with `create_block_mask` inside every timed call: in training the
  documents change with every batch, so FlexAttention pays the block mask every step;
- `varlen-attn`: torch's `torch.nn.attention.varlen.varlen_attn` (torch >= 2.10; FlashAttention's
  varlen kernels): causal rule and window, no mask, no bias;
- `sdpa-per-doc`: one SDPA call (flash kernel) per document in a Python loop, causal; no window,
  mask or bias.

A peer that cannot run a workload says why in one line (`unavailable_reason`) before any of its
work is done. Outputs come back in token order: (total, H, D) ("thd"), (B, H, L, D) or (1, H,
total, D) ("bhld"), or ours' (B, L, H, D) on a dense batch.
"""

from __future__ import annotations

import importlib.util
import inspect
import time
from typing import Callable

import torch

from dmattn_bench.bench.packed import PackedInputs, positions
from dmattn_bench.bench.peers import OURS, Prepared, _bias_leaf, _grad_leaves, _leaf

# Blocks of FlexAttention's block mask (its default): the granularity at which it skips work
FLEX_BLOCK = 128


def _dense(t: torch.Tensor, batch: int) -> torch.Tensor:
    """(total, heads, D) -> (B, L, heads, D): a view of the same memory."""
    return t.view(batch, t.shape[0] // batch, *t.shape[1:])


def _ours(inputs: PackedInputs, table: str | None, backend: str = "auto") -> Prepared:
    """Ours as the dispatch picks it ("auto") or one backend's defaults: the varlen call on packed
    documents, the dense call with its window on a dense batch."""
    causal, window = inputs.is_causal, inputs.window
    if inputs.batch is None:
        bias = _bias_leaf(inputs)
        from dmattn_bench import flash_dmattn_varlen_func  # issue 56

        q, k, v = (_leaf(t) for t in (inputs.q, inputs.k, inputs.v))
        max_seqlen = inputs.layout.max_seqlen

        def forward():
            return flash_dmattn_varlen_func(q, k, v, inputs.cu_seqlens, inputs.cu_seqlens, max_seqlen, max_seqlen,
                                            attn_mask=inputs.mask, attn_bias=bias, is_causal=causal,
                                            window_size=window, backend=backend, table=table)

        return Prepared(forward, _grad_leaves(q, k, v, bias), note=f"flash_dmattn_varlen_func backend={backend}",
                        layout="thd")
    from dmattn_bench import flash_dmattn_func

    batch = inputs.batch
    q, k, v = (_leaf(_dense(t, batch)) for t in (inputs.q, inputs.k, inputs.v))
    seqlen = q.shape[1]
    dense_bias = None
    if inputs.bias is not None:  # (Hkv, B*L) -> (B, Hkv, 1, L), learnable as the workload's is
        dense_bias = _leaf(inputs.bias.detach().view(-1, batch, seqlen).transpose(0, 1).unsqueeze(2).contiguous(),
                           inputs.bias.requires_grad)
    mask = None
    if inputs.mask is not None:  # (heads, B*L, L) -> (B, heads, L, L), copied once here
        mask = inputs.mask.view(-1, batch, seqlen, seqlen).transpose(0, 1).contiguous()

    def forward():
        return flash_dmattn_func(q, k, v, mask, dense_bias, is_causal=causal, backend=backend, table=table,
                                 window_size=window)

    return Prepared(forward, _grad_leaves(q, k, v, dense_bias),
                    note=f"flash_dmattn_func window_size={window} backend={backend}")


def document_mask_mod(doc_id: torch.Tensor, doc_start: torch.Tensor, seqlen: int, is_causal: bool,
                      window: tuple[int, int], mask: torch.Tensor | None, heads: int) -> Callable:
    """FlexAttention's mask_mod of a packed or dense-window workload: `bench.packed`'s visibility
    rule on tensors of query and key indices (flex's own, or any broadcasting index tensors).

    Args:
        doc_id: (total,) the document of each token; doc_start: (total,) its document's first token.
        seqlen: tokens per batch row of flex's (B, H, seqlen, D) layout (a packed workload: total).
        mask: the per-row mask (H|Hkv, total, max_seqlen) or None; heads: H.
    """
    left, right = window
    group = heads // mask.shape[0] if mask is not None else 1

    def mask_mod(b, h, q_idx, kv_idx):
        q_token, kv_token = b * seqlen + q_idx, b * seqlen + kv_idx
        keep = doc_id[q_token] == doc_id[kv_token]
        if is_causal:
            keep = keep & (kv_idx <= q_idx)
        if left >= 0:
            keep = keep & (kv_idx >= q_idx - left)
        if right >= 0:
            keep = keep & (kv_idx <= q_idx + right)
        if mask is not None:
            # column j of a row is key j of its own document; other documents' keys are already out
            column = (kv_token - doc_start[q_token]).clamp(0, mask.shape[-1] - 1)
            keep = keep & mask[h // group, q_token, column]
        return keep

    return mask_mod


def _doc_index(inputs: PackedInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """(total,) each token's document and its document's first token."""
    device = inputs.q.device
    lengths = torch.tensor(inputs.layout.documents, device=device)
    doc_id = torch.repeat_interleave(torch.arange(len(lengths), device=device), lengths)
    return doc_id, torch.arange(inputs.q.shape[0], device=device) - positions(inputs.layout.documents, device)


def _flex(inputs: PackedInputs, rebuild: bool) -> Prepared:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    batch = inputs.batch or 1
    q, k, v = (_dense(t.detach(), batch).transpose(1, 2).contiguous().requires_grad_()
               for t in (inputs.q, inputs.k, inputs.v))
    heads, seqlen = q.shape[1], q.shape[2]
    heads_kv = k.shape[1]
    mask, bias = inputs.mask, _bias_leaf(inputs)
    doc_id, doc_start = _doc_index(inputs)
    mask_mod = document_mask_mod(doc_id, doc_start, seqlen, inputs.is_causal, inputs.window, mask, heads)
    bias_group = heads // heads_kv

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + bias[h // bias_group, b * seqlen + kv_idx].to(score.dtype)

    # without a mask every batch row and head sees the same pattern: one block mask row for all
    mask_batch = batch if mask is not None and batch > 1 else None
    mask_heads = heads if mask is not None else None

    def build():
        # compiled: eagerly create_block_mask materialises (B, H, L, L) index tensors, which for
        # 16k tokens and 16 heads alone are tens of GB
        return create_block_mask(mask_mod, mask_batch, mask_heads, seqlen, seqlen, device=q.device,
                                 BLOCK_SIZE=FLEX_BLOCK, _compile=True)

    # new closures per workload: reset, or dynamo counts them as recompiles of one frame and past
    # its limit runs flex_attention eagerly (`peers._flex`)
    torch._dynamo.reset()
    compiled = torch.compile(flex_attention, dynamic=False)
    extra = dict(score_mod=score_mod if bias is not None else None, enable_gqa=heads != heads_kv)
    if rebuild:
        def forward():
            return compiled(q, k, v, block_mask=build(), **extra)

        note = "create_block_mask (compiled) inside every timed call: documents change each batch"
        return Prepared(forward, _grad_leaves(q, k, v, bias), note=note, layout="bhld")
    build()  # its compile
    if q.is_cuda:
        torch.cuda.synchronize()
    begin = time.perf_counter()
    block_mask = build()
    if q.is_cuda:
        torch.cuda.synchronize()
    setup_ms = (time.perf_counter() - begin) * 1e3

    def forward():
        return compiled(q, k, v, block_mask=block_mask, **extra)

    note = "block mask built once outside the timed call (setup ms: one build, compiled and warm)"
    return Prepared(forward, _grad_leaves(q, k, v, bias), setup_ms=setup_ms, note=note, layout="bhld")


def _varlen_parameters() -> dict:
    from torch.nn.attention.varlen import varlen_attn

    return dict(inspect.signature(varlen_attn).parameters)


def _varlen_attn(inputs: PackedInputs) -> Prepared:
    from torch.nn.attention.varlen import varlen_attn

    params = _varlen_parameters()
    q, k, v = (_leaf(t) for t in (inputs.q, inputs.k, inputs.v))
    heads, heads_kv = q.shape[1], k.shape[1]
    options, note = {}, "torch.nn.attention.varlen.varlen_attn"
    if "window_size" in params:  # torch >= 2.11: the causal rule is the window's right side 0
        left, right = inputs.window
        options["window_size"] = (left, 0 if inputs.is_causal else right)
    else:  # torch 2.10
        options["is_causal"] = inputs.is_causal
    if heads != heads_kv:
        if "enable_gqa" in params:
            options["enable_gqa"] = True
            note += "; GQA through enable_gqa"
        else:  # repeated once, outside the timed call
            k, v = (_leaf(t.detach().repeat_interleave(heads // heads_kv, dim=1)) for t in (k, v))
            note += f"; K/V repeated to {heads} heads"
    max_seqlen = inputs.layout.max_seqlen

    def forward():
        return varlen_attn(q, k, v, inputs.cu_seqlens, inputs.cu_seqlens, max_seqlen, max_seqlen, **options)

    return Prepared(forward, [q, k, v], note=note, layout="thd")


def _sdpa_per_doc(inputs: PackedInputs) -> Prepared:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = (_leaf(t) for t in (inputs.q, inputs.k, inputs.v))
    gqa = q.shape[1] != k.shape[1]
    bounds = inputs.bounds()

    def per_doc(t: torch.Tensor, start: int, end: int) -> torch.Tensor:
        return t[start:end].unsqueeze(0).transpose(1, 2)  # (1, heads, n, D), a view

    def forward():
        outs = [torch.nn.functional.scaled_dot_product_attention(
                    per_doc(q, start, end), per_doc(k, start, end), per_doc(v, start, end),
                    is_causal=inputs.is_causal, enable_gqa=gqa)
                for start, end in bounds]
        return torch.cat(outs, dim=2)

    note = f"{len(bounds)} SDPA flash calls, one per document, outputs concatenated"
    return Prepared(forward, [q, k, v], note=note, layout="bhld",
                    context=lambda: sdpa_kernel(SDPBackend.FLASH_ATTENTION))


PEERS: dict[str, Callable[[PackedInputs, str | None], Prepared]] = {
    OURS: lambda inputs, table: _ours(inputs, table),
    "ours-triton": lambda inputs, table: _ours(inputs, table, "triton"),
    "ours-cuda": lambda inputs, table: _ours(inputs, table, "cuda"),
    "flex": lambda inputs, table: _flex(inputs, rebuild=False),
    "flex-rebuild": lambda inputs, table: _flex(inputs, rebuild=True),
    "varlen-attn": lambda inputs, table: _varlen_attn(inputs),
    "sdpa-per-doc": lambda inputs, table: _sdpa_per_doc(inputs),
}

# Peers whose kernels run only on a CUDA GPU, and why (as `peers.CUDA_ONLY`)
CUDA_ONLY = {
    "ours-cuda": "the cuda backend's kernels run only there",
    "flex": "FlexAttention has no CPU backward",
    "flex-rebuild": "FlexAttention has no CPU backward",
    "varlen-attn": "varlen_attn runs FlashAttention's CUDA kernels",
}


def unavailable_reason(peer: str, device: torch.device | str, inputs: PackedInputs) -> str | None:
    """Why `peer` cannot run this workload on `device`, in one line; None when it can."""
    if peer not in PEERS:
        return "a peer of the dense workloads: packed documents and windows are not wired for it"
    operands = inputs.mask is not None or inputs.bias is not None
    if peer == "varlen-attn":
        if importlib.util.find_spec("torch.nn.attention.varlen") is None:
            return f"torch {torch.__version__} has no torch.nn.attention.varlen.varlen_attn (torch >= 2.10)"
        if operands:
            return "varlen_attn takes no mask and no bias"
        if inputs.window != (-1, -1) and "window_size" not in _varlen_parameters():
            return f"torch {torch.__version__}'s varlen_attn has no window_size (torch >= 2.11)"
    if peer == "sdpa-per-doc":
        if inputs.window != (-1, -1):
            return "SDPA has no sliding window (a window would need a float mask per document)"
        if operands:
            return "SDPA's flash kernel takes no mask and no bias"
    if peer in CUDA_ONLY and torch.device(device).type != "cuda":
        return f"needs a CUDA GPU ({CUDA_ONLY[peer]})"
    return None
