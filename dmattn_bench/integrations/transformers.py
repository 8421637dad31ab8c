"""`attn_implementation="dmattn"` for Hugging Face transformers models.

    from dmattn_bench.integrations.transformers import register

    register()
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="dmattn")
    # or: model.set_attn_implementation("dmattn")

`register()` adds `attention_forward` to transformers' `AttentionInterface` and `sdpa_mask` to
its `AttentionMaskInterface` under the same name. The mask entry is needed: a name missing
from `AttentionMaskInterface` makes `create_causal_mask` and friends return None, which would
drop padding masks silently. `sdpa_mask` gives what we want: None for a plain causal or full
pattern (we then use our causal rule and read no mask at all), else a bool
(B, 1, Lq, Lk) mask with causality, padding, sliding windows and packed sequences folded in.

Packed rows (padding-free training, e.g. `DataCollatorWithFlattening`: one batch row holding
several documents) run `dmattn_bench.flash_dmattn_varlen_func` on (L, H, D) views of the row,
so no program reads another document's keys or any mask. A row is packed when (the first two as
in transformers' FlashAttention path, `_flash_attention_forward` of transformers 5.24):

- the call has no mask and carries the `FlashAttentionKwargs` `cu_seq_lens_q`, `cu_seq_lens_k`,
  `max_length_q` and `max_length_k` (`PACKED_KWARGS`): they are used as given;
- the call has no mask, batch size 1 and `position_ids` that restart: a new document wherever a
  position is not its predecessor's plus one (transformers' `find_packed_sequence_indices`);
- the call has a bool (1, 1, L, L) mask of the pattern `sdpa_mask` builds for such a row, which
  transformers does whenever position ids restart and no padding mask is given: causal within
  each document, optionally a sliding window, nothing else. The pattern is checked on the mask,
  element by element, once per mask tensor (every layer of a forward gets the same one), so a
  mask holding anything more (padding, a bidirectional prefix) is read as before. The
  documents are the mask's, split further where `position_ids` or the `FlashAttentionKwargs`
  restart; the window is the mask's. A checked mask of one document runs the dense call with
  the causal rule and the window instead of reading the mask.

A `sliding_window` keyword (Mistral, Qwen2, Gemma pass one) applies when there is no mask and
the keys outnumber it, as `window_size=(sliding_window - 1, 0)` under the causal rule and
`(sliding_window - 1, sliding_window - 1)` without it, in the dense and the packed call alike:
transformers' FlashAttention rule (`_process_flash_attention_kwargs`). Under `torch.compile`
only the `FlashAttentionKwargs` are read (no host sync, no graph break): the mask transformers
builds for a packed row is then read as a mask.

Importing this module does not import transformers; `register()` does.
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

import torch

from dmattn_bench import api, varlen
from dmattn_bench.plan import NO_WINDOW

__all__ = ["ATTN_IMPLEMENTATION", "PACKED_KWARGS", "attention_forward", "register"]

ATTN_IMPLEMENTATION = "dmattn"

# Our kernels take fp16/bf16 on a GPU; fp32 only runs in the Triton interpreter.
_GPU_DTYPES = (torch.float16, torch.bfloat16)

# transformers' `FlashAttentionKwargs` (modeling_flash_attention_utils.py): the packed documents'
# prefix sums and longest lengths a flattening collator hands every attention call.
PACKED_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")

# Mask rows compared with the packed pattern at a time: the comparison's temporaries stay
# (rows, L) bools instead of (L, L).
_PATTERN_ROWS = 1024

# Documents read per set of tensors: a forward hands every layer the same position ids and mask
# (a full and a sliding one in hybrid models), so a few entries serve it.
_CACHE_ENTRIES = 8


def register() -> str:
    """Registers "dmattn" with transformers' attention and mask interfaces; idempotent.

    Returns:
        The implementation name to pass as `attn_implementation`.

    Raises:
        ImportError: transformers is not installed (`pip install dmattn-bench[transformers]`).
    """
    try:
        from transformers import AttentionInterface, AttentionMaskInterface
        from transformers.masking_utils import sdpa_mask
    except ImportError as err:
        raise ImportError(
            f"dmattn_bench.integrations.transformers.register: {err}; install transformers "
            f"(pip install 'dmattn-bench[transformers]')"
        ) from err
    # `register` updates a class-wide dict: registering again replaces the entry with itself.
    AttentionInterface.register(ATTN_IMPLEMENTATION, attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)
    return ATTN_IMPLEMENTATION


def _target_dtype(query: torch.Tensor, module: torch.nn.Module) -> torch.dtype | None:
    """The half dtype to run an fp32 query in on a GPU, as transformers' FlashAttention does.

    fp32 queries on a GPU come from fp32 layer norms (PEFT) or autocast; the kernels need
    fp16/bf16. Returns None when no cast is needed or none is known.
    """
    if query.device.type != "cuda" or query.dtype != torch.float32:
        return None
    if torch.is_autocast_enabled("cuda"):
        dtype = torch.get_autocast_dtype("cuda")
    else:
        linear = next((m for m in module.modules() if isinstance(m, torch.nn.Linear)), None)
        dtype = None if linear is None else linear.weight.dtype
    return dtype if dtype in _GPU_DTYPES else None


def _version(t: torch.Tensor) -> int | None:
    """A tensor's in-place write counter; inference tensors keep none."""
    try:
        return t._version
    except RuntimeError:
        return None


class _ByTensors:
    """Results read from tensors' data, kept while those very tensors live unchanged: keyed by
    their ids, an entry holds weak references and versions, so a freed tensor whose id is reused,
    or one written in place, misses."""

    MISS = object()

    def __init__(self, size: int):
        self._size = size
        self._entries = {}

    def get(self, scalars: tuple, tensors: tuple):
        entry = self._entries.get((scalars, tuple(map(id, tensors))))
        if entry is None:
            return self.MISS
        refs, versions, value = entry
        for t, ref, version in zip(tensors, refs, versions):
            if t is not None and (ref() is not t or _version(t) != version):
                return self.MISS
        return value

    def put(self, scalars: tuple, tensors: tuple, value) -> None:
        if len(self._entries) >= self._size:
            self._entries.pop(next(iter(self._entries)))  # the oldest
        self._entries[(scalars, tuple(map(id, tensors)))] = (
            tuple(None if t is None else weakref.ref(t) for t in tensors),
            tuple(None if t is None else _version(t) for t in tensors), value)


_DOCUMENTS = _ByTensors(_CACHE_ENTRIES)


class _Rows(NamedTuple):
    """How a call runs without its mask: over packed documents (`cu_seqlens_*` set), or dense."""

    cu_seqlens_q: torch.Tensor | None
    cu_seqlens_k: torch.Tensor | None
    max_seqlen_q: int
    max_seqlen_k: int
    is_causal: bool
    window: tuple[int, int]


def _sliding_window(sliding_window: int | None, causal: bool, key_length: int) -> tuple[int, int]:
    """transformers' FlashAttention rule (`_process_flash_attention_kwargs`): `sliding_window`
    tokens, the query's own included, once the keys outnumber it; both sides without causality."""
    if sliding_window is None or key_length <= sliding_window:
        return NO_WINDOW
    return sliding_window - 1, 0 if causal else sliding_window - 1


def _mask_pattern(mask: torch.Tensor) -> tuple[torch.Tensor, int] | None:
    """Whether an (L, L) bool mask is causal within documents and a window, and nothing else.

    Row i starts a document iff it does not see key i - 1; the window is the most keys a row sees.
    Returns (the rows that start a document as an (L,) bool, the window) when every element
    matches that pattern, else None.
    """
    length = mask.shape[0]
    starts = torch.ones(length, dtype=torch.bool, device=mask.device)
    starts[1:] = ~mask.diagonal(-1)
    width = int(mask.sum(-1).max())
    if width < 1:
        return None
    document = starts.cumsum(0)
    cols = torch.arange(length, device=mask.device)
    for first in range(0, length, _PATTERN_ROWS):
        rows = cols[first:first + _PATTERN_ROWS, None]
        expected = ((document[first:first + _PATTERN_ROWS, None] == document) & (cols <= rows)
                    & (cols > rows - width))
        if not torch.equal(mask[first:first + _PATTERN_ROWS], expected):
            return None
    return starts, width


def _read_documents(mask, position_ids, cu_seq_lens, length, device):
    """The documents of one packed batch row of `length` tokens (module docstring).

    Returns (cu_seqlens int32 on `device`, the longest document, the mask's window), or None: a
    mask of another pattern, or no mask and a single document.
    """
    starts = torch.zeros(length, dtype=torch.bool, device=device)
    window = None
    if mask is not None:
        pattern = _mask_pattern(mask[0, 0])
        if pattern is None:
            return None
        starts, window = pattern
    if position_ids is not None and position_ids.numel() == length:
        positions = position_ids.reshape(-1).to(device)
        starts[1:] |= positions[1:] != positions[:-1] + 1
    if cu_seq_lens is not None:
        bounds_q, bounds_k = (t.tolist() for t in cu_seq_lens)
        if (bounds_q == bounds_k and bounds_q[0] == 0 and bounds_q[-1] == length
                and all(a <= b for a, b in zip(bounds_q, bounds_q[1:]))):  # prefix sums of these rows
            starts[bounds_q[1:-1]] = True
    starts[0] = True
    bounds = torch.nonzero(starts).flatten().tolist() + [length]  # the host sync
    if mask is None and len(bounds) == 2:
        return None
    longest = max(end - begin for begin, end in zip(bounds, bounds[1:]))
    window = (window - 1, 0) if window is not None and window < longest else NO_WINDOW
    return torch.tensor(bounds, dtype=torch.int32, device=device), longest, window


def _documents(mask, position_ids, cu_seq_lens, length, device):
    """`_read_documents`, once per set of tensors."""
    tensors = (mask, position_ids, *(cu_seq_lens or (None, None)))
    found = _DOCUMENTS.get((length, str(device)), tensors)
    if found is _DOCUMENTS.MISS:
        found = _read_documents(mask, position_ids, cu_seq_lens, length, device)
        _DOCUMENTS.put((length, str(device)), tensors, found)
    return found


def _packed_rows(query, key, attention_mask, causal, sliding_window, kwargs) -> _Rows | None:
    """How the call runs without reading its mask (module docstring), or None: as before."""
    batch, _, length, _ = query.shape
    packed = [kwargs.get(name) for name in PACKED_KWARGS]
    packed = packed if all(x is not None for x in packed) else None
    if attention_mask is None and packed is not None:
        if batch != 1:
            raise NotImplementedError(
                f"cu_seq_lens_q: packed sequences come as one batch row, got a batch of {batch}; flatten the "
                f"batch into one row (transformers' DataCollatorWithFlattening does)")
        cu_q, cu_k = (t.to(device=query.device, dtype=torch.int32) for t in packed[:2])
        return _Rows(cu_q, cu_k, int(packed[2]), int(packed[3]), causal,
                     _sliding_window(sliding_window, causal, key.shape[2]))
    if torch.compiler.is_compiling() or batch != 1 or length < 2 or key.shape[2] != length:
        return None
    if attention_mask is not None and (attention_mask.dtype != torch.bool
                                       or tuple(attention_mask.shape) != (1, 1, length, length)):
        return None
    position_ids = kwargs.get("position_ids")
    if attention_mask is None and position_ids is None:
        return None
    found = _documents(attention_mask, position_ids, None if packed is None else packed[:2], length,
                       query.device)
    if found is None:
        return None
    cu_seqlens, longest, window = found
    if attention_mask is None:
        return _Rows(cu_seqlens, cu_seqlens, longest, longest, causal,
                     _sliding_window(sliding_window, causal, length))
    if cu_seqlens.shape[0] == 2:  # one document: the causal rule and the window say it all
        return _Rows(None, None, length, length, True, window)
    return _Rows(cu_seqlens, cu_seqlens, longest, longest, True, window)


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    softcap: float | None = None,
    is_causal: bool | None = None,
    sliding_window: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function protocol on top of `dmattn_bench.flash_dmattn_func`.

    Args:
        module: The calling attention module (reads `is_causal`).
        query: (B, H, Lq, D), transformers' layout.
        key, value: (B, Hkv, Lk, D); GQA runs natively (no `repeat_kv`).
        attention_mask: None, a bool (or 0/1 integer) mask, True = attend, or an additive
            float mask; 4-D, broadcastable as (B|1, H|Hkv|1, Lq|1, Lk|1). A bool mask becomes
            `attn_mask`, a float mask `attn_bias`, without copies.
        dropout: must be 0 (no attention dropout in our kernels).
        scaling: softmax scale, default 1/sqrt(D).
        softcap: None or 0 disables soft-capping.
        is_causal: overrides `module.is_causal`; used only when there is no mask, as in
            transformers' SDPA path.
        sliding_window: the layer's window in tokens (None: none); applied when there is no mask
            (module docstring).
        **kwargs: other transformers kwargs: `position_ids` and the `FlashAttentionKwargs`
            (`PACKED_KWARGS`) mark packed rows (module docstring); `s_aux`, `position_bias` and
            a paged `cache` are not supported and raise.

    Returns:
        (out, None) with out (B, Lq, H, D) contiguous, like transformers' SDPA and FlashAttention.
    """
    if dropout:
        raise NotImplementedError(
            f"dropout: got {dropout}, but attn_implementation='dmattn' has no attention dropout; "
            f"set the model's attention dropout (e.g. config.attention_dropout) to 0.0"
        )
    for name in ("s_aux", "position_bias", "cache"):
        if kwargs.get(name) is not None:
            raise NotImplementedError(
                f"{name}: not supported by attn_implementation='dmattn'; use 'sdpa' or 'eager' "
                f"for this model"
            )
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    causal_rule = bool(is_causal)  # the layer's, for the window's right side
    softcap = 0.0 if softcap is None else float(softcap)
    rows = _packed_rows(query, key, attention_mask, causal_rule, sliding_window, kwargs)
    if rows is not None:
        return _run_rows(module, query, key, value, rows, scaling, softcap), None
    seqlen_q = query.shape[2]
    # As transformers' SDPA path: a mask already holds causality (and offsets for caches); with
    # no mask, causal applies only to prefill (a single decode query sees every key).
    is_causal = bool(is_causal) and attention_mask is None and seqlen_q > 1
    if is_causal and key.shape[2] > seqlen_q:
        # sdpa_mask returns None for an empty static cache's prefill only because SDPA aligns
        # `is_causal` top-left: the keys past Lq are unwritten cache slots. Drop them (a view)
        # so that our bottom-right rule means the same thing.
        key, value = key[:, :, :seqlen_q], value[:, :, :seqlen_q]

    attn_mask = attn_bias = None
    if attention_mask is not None:
        if attention_mask.is_floating_point():
            attn_bias = attention_mask
        else:
            attn_mask = attention_mask

    # (B, H, L, D) -> (B, L, H, D) views: the API needs only a unit-stride head dim.
    query, key, value = (t.transpose(1, 2) for t in (query, key, value))
    target = _target_dtype(query, module)
    if target is not None:
        query, key, value = (t.to(target) for t in (query, key, value))
    # a mask already holds the window (transformers' sliding-window masks)
    window = NO_WINDOW if attention_mask is not None else _sliding_window(sliding_window, causal_rule, key.shape[1])
    out = api.flash_dmattn_func(
        query, key, value, attn_mask, attn_bias, is_causal=is_causal, softmax_scale=scaling, softcap=softcap,
        window_size=window,
    )
    return out, None


def _run_rows(module, query, key, value, rows: _Rows, scaling, softcap) -> torch.Tensor:
    """`attention_forward` of a call `_packed_rows` planned: (1, L, H, D) out."""
    if rows.cu_seqlens_q is None:
        query, key, value = (t.transpose(1, 2) for t in (query, key, value))
    else:  # (1, H, L, D) -> (L, H, D) views of the one batch row
        query, key, value = (t[0].transpose(0, 1) for t in (query, key, value))
    target = _target_dtype(query, module)
    if target is not None:
        query, key, value = (t.to(target) for t in (query, key, value))
    if rows.cu_seqlens_q is None:
        return api.flash_dmattn_func(query, key, value, is_causal=rows.is_causal, softmax_scale=scaling,
                                     softcap=softcap, window_size=rows.window)
    out = varlen.flash_dmattn_varlen_func(
        query, key, value, rows.cu_seqlens_q, rows.cu_seqlens_k, rows.max_seqlen_q, rows.max_seqlen_k,
        is_causal=rows.is_causal, window_size=rows.window, softcap=softcap, softmax_scale=scaling)
    return out[None]
