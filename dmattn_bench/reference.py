"""Eager PyTorch reference for flash dynamic-mask attention (DESIGN.md section 1).

This is the single implementation of the attention contract that tests, the validator and the
benchmarks compare kernels against. It favours clarity over speed: every score matrix is
materialised in ``compute_dtype`` (fp64 on CPU, fp32 on GPU by default).

For query head ``h`` (KV head ``h // (H // Hkv)``), query row ``i`` and key ``j``::

    S[i, j] = softmax_scale * <q_i, k_j>
    S[i, j] = softcap * tanh(S[i, j] / softcap)          if softcap > 0
    S[i, j] = S[i, j] + bias[i, j]                        bias is not scaled
    S[i, j] = -inf  unless  mask[i, j] and (not is_causal or j <= i + Lk - Lq)
                            and i + Lk - Lq - left <= j <= i + Lk - Lq + right
with ``window_size = (left, right)`` (FlashAttention's sliding window: inclusive, bottom-right
aligned like the causal rule, -1 for an unbounded side).
with ``cache_seqlens``, sequence b has Lk_b = clamp(cache_seqlens[b], 0, Lk) keys: keys at or past
Lk_b are excluded (their K and V never reach a product) and Lk_b replaces Lk in the causal rule.
With ``block_table`` (B, pages) the cache is paged: key and value are (blocks, page, Hkv, D), and
key j of sequence b is block ``block_table[b, j // page]``'s row ``j % page`` (Lk = pages * page);
an entry whose keys all lie at or past Lk_b is never used, and the keys of an entry outside
``[0, blocks)`` (-1, ``blocks``, any index no block has) are excluded, as if masked.
    lse[i]  = log(sum_j exp(S[i, j]))
    out[i]  = sum_j exp(S[i, j] - lse[i]) * v_j

Packed sequences (:func:`varlen_attention`, FlashAttention's varlen convention): q is
(total_q, H, D), k and v (total_k, Hkv, D), and sequence s has queries cu_seqlens_q[s]:cu_seqlens_q[s+1]
and keys cu_seqlens_k[s]:cu_seqlens_k[s] + Lk_s (Lk_s = seqused_k[s], else the cu_seqlens_k span). Each
sequence is the dense case above with B = 1, Lq = Lq_s, Lk = Lk_s. A mask or bias is per key
(H|Hkv|1, total_k) or per query row (H|Hkv|1, total_q, max_seqlen_k), column j of row i being key j of
row i's own sequence.

A dead row (no visible key, or only ``-inf`` scores) gives ``out = 0``, ``lse = -inf`` and zero
gradients; nothing in the forward or backward pass is NaN.
"""

from __future__ import annotations

import math
import numbers

import torch

__all__ = ["attention", "broadcast_dims", "check_inputs", "check_varlen_inputs", "check_window", "varlen_attention",
           "varlen_layout"]

MASK_BIAS_LAYOUT = "(B|1, H|Hkv|1, Lq|1, Lk|1)"
PAGE_MULTIPLE = 16  # keys per page of a paged cache are a multiple of this (the kernels' smallest key tile)


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def broadcast_dims(shape: tuple[int, ...], name: str, B: int, H: int, Hkv: int, Lq: int,
                   Lk: int) -> tuple[int, int, int, int]:
    """Validates a mask or bias shape and returns it left-padded to 4-D.

    Allowed dims after left-padding with 1s are ``(B|1, H|Hkv|1, Lq|1, Lk|1)``. A head dim of
    ``Hkv`` means one mask/bias per KV head, shared by its query-head group.

    Args:
        shape: The mask's or bias's shape.
        name: Argument name used in error messages (``"attn_mask"`` or ``"attn_bias"``).
        B, H, Hkv, Lq, Lk: Batch, query heads, KV heads, query length, key length.

    Returns:
        The 4-D shape ``(b, h, lq, lk)`` after left-padding.

    Raises:
        ValueError: If ``shape`` has more than 4 dims or a dim that cannot broadcast.
    """
    heads = f"{H}|1" if H == Hkv else f"{H}|{Hkv}|1"
    expected = f"{MASK_BIAS_LAYOUT} = ({B}|1, {heads}, {Lq}|1, {Lk}|1)"
    shape = tuple(shape)
    if len(shape) > 4:
        raise ValueError(f"{name}: got shape {shape} ({len(shape)}-D), expected at most 4-D "
                         f"broadcastable to {expected}")
    dims = (1,) * (4 - len(shape)) + shape
    allowed = ((B, 1), (H, Hkv, 1), (Lq, 1), (Lk, 1))
    if any(d not in ok for d, ok in zip(dims, allowed)):
        raise ValueError(f"{name}: got shape {shape}, expected broadcastable to {expected}")
    return dims  # type: ignore[return-value]


def _check_operands(operands) -> None:
    """Checks each ``(name, tensor, layout)`` of query, key, value: its rank (the layout's) and a
    floating dtype, and the query's head dim (first operand) >= 1."""
    for name, t, layout in operands:
        rank = layout.count(",") + 1
        if t.dim() != rank:
            raise ValueError(f"{name}: got shape {_shape(t)}, expected {rank}-D {layout}")
        if not t.is_floating_point():
            raise TypeError(f"{name}: got dtype {t.dtype}, expected a floating dtype")
    name, query, _ = operands[0]
    if query.shape[-1] == 0:
        raise ValueError(f"{name}: got shape {_shape(query)} with head dim 0, expected D >= 1")


def _check_kv_heads(key_name: str, key: torch.Tensor, value_name: str, value: torch.Tensor, H: int) -> None:
    """Checks that the KV heads (key's dim -2) divide the query's ``H`` and that value is key's shape."""
    Hkv = key.shape[-2]
    if Hkv == 0 or H % Hkv != 0:
        raise ValueError(f"{key_name}: got shape {_shape(key)} with Hkv={Hkv} heads, expected Hkv "
                         f"to divide the query's H={H} heads")
    if value.shape != key.shape:
        raise ValueError(f"{value_name}: got shape {_shape(value)}, expected {_shape(key)} ({key_name}'s shape)")


def _check_devices(query_name: str, query: torch.Tensor, named) -> None:
    """Checks that every given ``(name, tensor or None)`` lives on the query's device."""
    for name, t in named:
        if t is not None and t.device != query.device:
            raise ValueError(f"{name}: got device {t.device}, expected {query.device} "
                             f"({query_name}'s device)")


def _check_mask_bias_dtypes(attn_mask: torch.Tensor | None, attn_bias: torch.Tensor | None) -> None:
    """A mask is bool or integer (0/1, checked where data is read); a bias is floating."""
    if attn_mask is not None and (attn_mask.is_floating_point() or attn_mask.is_complex()):
        raise TypeError(f"attn_mask: got dtype {attn_mask.dtype}, expected torch.bool "
                        f"(or an integer dtype holding 0/1); True = attend")
    if attn_bias is not None and not attn_bias.is_floating_point():
        raise TypeError(f"attn_bias: got dtype {attn_bias.dtype}, expected a floating dtype")


def check_inputs(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    attn_bias: torch.Tensor | None,
    cache_seqlens: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
) -> None:
    """Checks the shapes, dtypes and devices shared by every attention backend.

    Args:
        query: ``(B, Lq, H, D)`` floating tensor.
        key: ``(B, Lk, Hkv, D)`` floating tensor with ``H % Hkv == 0``.
        value: Same shape as ``key``.
        attn_mask: ``None`` or a bool/integer tensor broadcastable as in :func:`broadcast_dims`.
        attn_bias: ``None`` or a floating tensor broadcastable as in :func:`broadcast_dims`.
        cache_seqlens: ``None`` or a ``(B,)`` int32 tensor of key lengths.
        block_table: ``None`` or a ``(B, pages)`` int32 tensor: key/value are then paged,
            ``(blocks, page, Hkv, D)`` with a page of a multiple of 16 keys.

    Raises:
        ValueError: On a bad shape or device; the message names the argument, the shape
            received and the shape expected.
        TypeError: On a bad dtype.
    """
    _check_operands((("query", query, "(B, Lq, H, D)"), ("key", key, "(B, Lk, Hkv, D)"),
                     ("value", value, "(B, Lk, Hkv, D)")))
    B, Lq, H, D = query.shape
    _, Lk, Hkv, _ = key.shape
    if block_table is not None:
        if block_table.dtype != torch.int32:
            raise TypeError(f"block_table: got dtype {block_table.dtype}, expected torch.int32")
        if block_table.dim() != 2 or block_table.shape[0] != B:
            raise ValueError(f"block_table: got shape {_shape(block_table)}, expected (B, pages) = ({B}, pages)")
        if block_table.shape[1] > 1 and block_table.stride(1) != 1:  # the kernel steps through a row by 1
            raise ValueError(f"block_table: got strides {tuple(block_table.stride())}, expected stride 1 along "
                             f"the pages (pass block_table.contiguous())")
        if Lk % PAGE_MULTIPLE or Lk == 0:
            raise ValueError(f"key: got shape {_shape(key)} with a block_table, expected (blocks, page, Hkv, D) "
                             f"with a page of a multiple of {PAGE_MULTIPLE} keys")
        Lk = cache_length(key, block_table)  # the logical length the mask and bias broadcast over
    if (block_table is None and key.shape[0] != B) or key.shape[3] != D:
        layout = f"(B={B}, Lk, Hkv, D={D})" if block_table is None else f"(blocks, page, Hkv, D={D})"
        raise ValueError(f"key: got shape {_shape(key)}, expected {layout} to match query {_shape(query)}")
    _check_kv_heads("key", key, "value", value, H)
    if cache_seqlens is not None:
        if cache_seqlens.dtype != torch.int32:
            raise TypeError(f"cache_seqlens: got dtype {cache_seqlens.dtype}, expected torch.int32")
        if tuple(cache_seqlens.shape) != (B,):
            raise ValueError(f"cache_seqlens: got shape {_shape(cache_seqlens)}, expected (B,) = ({B},)")
        if B > 1 and cache_seqlens.stride(0) != 1:  # the kernel reads sequence b's length at offset b
            raise ValueError(f"cache_seqlens: got stride {cache_seqlens.stride(0)}, expected 1 "
                             f"(pass cache_seqlens.contiguous())")
    _check_devices("query", query, (("key", key), ("value", value), ("attn_mask", attn_mask),
                                    ("attn_bias", attn_bias), ("cache_seqlens", cache_seqlens),
                                    ("block_table", block_table)))
    _check_mask_bias_dtypes(attn_mask, attn_bias)
    if attn_mask is not None:
        broadcast_dims(attn_mask.shape, "attn_mask", B, H, Hkv, Lq, Lk)
    if attn_bias is not None:
        broadcast_dims(attn_bias.shape, "attn_bias", B, H, Hkv, Lq, Lk)


def check_window(window_size) -> tuple[int, int]:
    """``window_size`` as ``(left, right)`` ints, each >= -1 (-1: unbounded side).

    Raises:
        ValueError: Not a pair of integers >= -1.
    """
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or any(isinstance(w, bool) or not isinstance(w, int) or w < -1 for w in window_size)):
        raise ValueError(f"window_size: got {window_size!r}, expected (left, right), two ints >= -1 "
                         f"(-1: unbounded side)")
    return int(window_size[0]), int(window_size[1])


def _expand_scores_like(
    t: torch.Tensor, name: str, B: int, H: int, Hkv: int, Lq: int, Lk: int
) -> torch.Tensor:
    """Broadcasts a mask/bias to ``(B, H, Lq, Lk)`` through autograd-aware views.

    ``reshape``, ``repeat_interleave`` and ``expand`` all have backward passes that sum over the
    broadcast dims, so a bias gradient comes back in the bias's own shape.
    """
    dims = broadcast_dims(t.shape, name, B, H, Hkv, Lq, Lk)
    t = t.reshape(dims)
    if dims[1] == Hkv and Hkv != H:
        t = t.repeat_interleave(H // Hkv, dim=1)  # query head h reads KV head h // group
    return t.expand(B, H, Lq, Lk)


def _compute_dtype(compute_dtype: torch.dtype | None, device: torch.device) -> torch.dtype:
    """``compute_dtype``, defaulting to fp64 on CPU and fp32 elsewhere."""
    if compute_dtype is not None:
        return compute_dtype
    return torch.float64 if device.type == "cpu" else torch.float32


def _lse_dtype(compute_dtype: torch.dtype) -> torch.dtype:
    """The lse's dtype: fp32 unless the computation ran wider (what the kernels write)."""
    return torch.float32 if torch.finfo(compute_dtype).bits <= 32 else compute_dtype


def cache_length(key: torch.Tensor, block_table: torch.Tensor | None) -> int:
    """The keys per sequence a call's key covers: Lk, or a paged cache's pages * page."""
    return key.shape[1] * (1 if block_table is None else block_table.shape[1])


def _gather_pages(key, value, block_table, cache_seqlens):
    """A paged cache's (B, pages * page, Hkv, D) key and value, and which of those keys lie on a
    block of the cache ((B, pages * page) bool). An entry no kept key reads (past cache_seqlens)
    may hold anything, and an entry outside the cache names no block: both read block 0 instead."""
    page = key.shape[1]
    pages = block_table.to(torch.int64)
    on_cache = (pages >= 0) & (pages < key.shape[0])
    used = on_cache
    if cache_seqlens is not None:
        first_key = torch.arange(pages.shape[1], device=pages.device) * page
        used = used & (first_key < cache_seqlens.to(torch.int64).unsqueeze(1))
    pages = torch.where(used, pages, 0)
    return key[pages].flatten(1, 2), value[pages].flatten(1, 2), on_cache.repeat_interleave(page, dim=1)


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    attn_bias: torch.Tensor | None = None,
    is_causal: bool = False,
    softmax_scale: float | None = None,
    softcap: float = 0.0,
    return_lse: bool = False,
    compute_dtype: torch.dtype | None = None,
    cache_seqlens: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    window_size: tuple[int, int] = (-1, -1),
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Dynamic-mask attention, computed eagerly in ``compute_dtype``.

    Scores are ``S = softmax_scale * Q K^T``, soft-capped as ``softcap * tanh(S / softcap)`` when
    ``softcap > 0``, plus ``attn_bias`` (unscaled). Positions excluded by ``attn_mask`` or the
    bottom-right causal rule (key ``j`` visible from query ``i`` iff ``j <= i + Lk - Lq``) become
    ``-inf`` through ``torch.where``, so any bias value there (NaN, +-inf) is ignored and gets
    zero gradient. Then ``out = softmax(S) V`` and ``lse = logsumexp(S)``.

    Args:
        query: ``(B, Lq, H, D)``.
        key: ``(B, Lk, Hkv, D)``, ``H % Hkv == 0`` (GQA/MQA: query head ``h`` uses KV head
            ``h // (H // Hkv)``).
        value: ``(B, Lk, Hkv, D)``.
        attn_mask: Optional bool (or integer, nonzero = True) mask, True = attend, broadcastable
            with dims ``(B|1, H|Hkv|1, Lq|1, Lk|1)``.
        attn_bias: Optional floating bias, same broadcasting rule. Differentiable; its gradient
            has the bias's shape and dtype, summed over broadcast dims.
        is_causal: Apply the bottom-right aligned causal rule (ANDed with the mask).
        softmax_scale: Score scale, default ``1 / sqrt(D)``.
        softcap: Soft-capping value; 0 disables.
        return_lse: Also return the natural-log ``lse`` of shape ``(B, H, Lq)``.
        compute_dtype: Dtype of the whole computation. Defaults to fp64 on CPU and fp32 on GPU;
            ``query.dtype`` runs the same math in low precision.
        cache_seqlens: Optional ``(B,)`` int32 key lengths (module docstring), clamped to
            ``[0, Lk]``; what lies past them in ``key`` and ``value`` is never used.
        block_table: Optional ``(B, pages)`` int32: a paged ``key``/``value`` (module docstring).
        window_size: ``(left, right)``: key ``j`` is visible from query ``i`` only within
            ``[i + Lk - Lq - left, i + Lk - Lq + right]`` (Lk as in the causal rule), -1 for an
            unbounded side; ANDed with the mask and the causal rule.

    Returns:
        ``out`` of shape ``(B, Lq, H, D)`` in ``query.dtype``, or ``(out, lse)`` where ``lse``
        is fp32 when ``compute_dtype`` is fp32 or narrower, else ``compute_dtype``. Dead rows
        give ``out = 0`` and ``lse = -inf``.

    Raises:
        ValueError: On bad shapes, devices or a negative ``softcap``.
        TypeError: On bad dtypes.
    """
    check_inputs(query, key, value, attn_mask, attn_bias, cache_seqlens, block_table)
    left, right = check_window(window_size)
    if softcap < 0:
        raise ValueError(f"softcap: got {softcap}, expected >= 0 (0 disables soft-capping)")
    on_cache = None  # (B, Lk): the keys of a paged cache that lie on one of its blocks
    if block_table is not None:
        key, value, on_cache = _gather_pages(key, value, block_table, cache_seqlens)
    B, Lq, H, D = query.shape
    Lk, Hkv = key.shape[1], key.shape[2]
    group = H // Hkv
    compute_dtype = _compute_dtype(compute_dtype, query.device)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(D)

    # -- to (B, H, L, D) in compute_dtype; the casts stay in the graph so grads keep dtypes --
    q = query.to(compute_dtype).transpose(1, 2)
    k = key.to(compute_dtype).transpose(1, 2).repeat_interleave(group, dim=1)
    v = value.to(compute_dtype).transpose(1, 2).repeat_interleave(group, dim=1)
    key_lengths = in_cache = None
    if cache_seqlens is not None:
        # (B, 1, 1, 1) lengths; K and V past them are zeroed so a NaN tail never reaches a product
        key_lengths = cache_seqlens.to(torch.int64).clamp(0, Lk).view(B, 1, 1, 1)
        in_cache = torch.arange(Lk, device=query.device) < key_lengths  # (B, 1, 1, Lk)
    if on_cache is not None:
        on_cache = on_cache.view(B, 1, 1, Lk)
        in_cache = on_cache if in_cache is None else in_cache & on_cache
    if in_cache is not None:
        zero = torch.zeros((), dtype=compute_dtype, device=query.device)
        k, v = (torch.where(in_cache.transpose(-1, -2), t, zero) for t in (k, v))

    # -- scores --
    s = softmax_scale * (q @ k.transpose(-1, -2))
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    if attn_bias is not None:
        s = s + _expand_scores_like(attn_bias.to(compute_dtype), "attn_bias", B, H, Hkv, Lq, Lk)

    # -- visibility: mask AND causal; excluded scores are replaced, never added to --
    visible = None
    if attn_mask is not None:
        mask = attn_mask if attn_mask.dtype == torch.bool else attn_mask != 0
        visible = _expand_scores_like(mask, "attn_mask", B, H, Hkv, Lq, Lk)
    rows = torch.arange(Lq, device=query.device).unsqueeze(-1)
    cols = torch.arange(Lk, device=query.device)
    if in_cache is not None:
        visible = in_cache if visible is None else visible & in_cache
    diagonal = rows + ((Lk if key_lengths is None else key_lengths) - Lq)  # key j = i + Lk - Lq
    if is_causal:
        causal = cols <= diagonal
        visible = causal if visible is None else visible & causal
    for bounded, inside in ((left >= 0, lambda: cols >= diagonal - left), (right >= 0, lambda: cols <= diagonal + right)):
        if bounded:
            visible = inside() if visible is None else visible & inside()
    if visible is not None:
        s = torch.where(visible, s, torch.full((), -math.inf, dtype=compute_dtype,
                                               device=query.device))

    # -- softmax, safe on dead rows: no log(0), no 0/0 in either branch of any where --
    if Lk > 0:
        m = s.amax(dim=-1, keepdim=True).detach()  # softmax is shift invariant
    else:
        m = s.new_full((B, H, Lq, 1), -math.inf)
    dead = m == -math.inf
    m_safe = torch.where(dead, torch.zeros_like(m), m)
    e = torch.exp(s - m_safe)  # exactly 0 wherever s == -inf
    l = e.sum(dim=-1, keepdim=True)
    l_safe = torch.where(l == 0, torch.ones_like(l), l)
    out = (e / l_safe) @ v
    out = out.transpose(1, 2).to(query.dtype).contiguous()
    if not return_lse:
        return out

    lse = torch.where(dead, torch.full_like(m, -math.inf), m_safe + torch.log(l_safe))
    return out, lse.squeeze(-1).to(_lse_dtype(compute_dtype))


# -- packed sequences (FlashAttention's varlen convention), built on `attention` per sequence --

VARLEN_LAYOUTS = ("per_key", "per_row")


def varlen_layout(shape: tuple[int, ...], name: str, H: int, Hkv: int, total_q: int, total_k: int,
                  max_seqlen_k: int) -> str:
    """Which packed layout a varlen mask or bias has, decided by its shape alone.

    ``(H|Hkv|1, total_k)`` is ``"per_key"``: sequence ``s`` reads columns ``cu_k[s]:cu_k[s] + Lk_s``
    for all of its queries. ``(H|Hkv|1, total_q, max_seqlen_k)`` is ``"per_row"``: column ``j`` of
    row ``i`` is key ``j`` of row ``i``'s own sequence. The ranks differ, so no shape is both.

    Args:
        shape: The mask's or bias's shape.
        name: Argument name used in error messages (``"attn_mask"`` or ``"attn_bias"``).
        H, Hkv: Query heads and KV heads.
        total_q, total_k: Packed query rows and keys (``q.shape[0]``, ``k.shape[0]``).
        max_seqlen_k: The call's ``max_seqlen_k``.

    Returns:
        ``"per_key"`` or ``"per_row"``.

    Raises:
        ValueError: If ``shape`` is neither layout.
    """
    shape = tuple(shape)
    trailing = {2: (total_k,), 3: (total_q, max_seqlen_k)}
    if len(shape) in trailing and shape[0] in (H, Hkv, 1) and shape[1:] == trailing[len(shape)]:
        return VARLEN_LAYOUTS[len(shape) - 2]
    heads = f"{H}|1" if H == Hkv else f"{H}|{Hkv}|1"
    raise ValueError(f"{name}: got shape {shape}, expected per key (H|Hkv|1, total_k) = ({heads}, {total_k}) "
                     f"or per query row (H|Hkv|1, total_q, max_seqlen_k) = ({heads}, {total_q}, {max_seqlen_k})")


def _check_unit_stride(name: str, t: torch.Tensor) -> None:
    """The kernels read entry ``s`` of a per-sequence vector at offset ``s``."""
    if t.dim() == 1 and t.shape[0] > 1 and t.stride(0) != 1:
        raise ValueError(f"{name}: got stride {t.stride(0)}, expected 1 (pass {name}.contiguous())")


def check_varlen_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    attn_mask: torch.Tensor | None,
    attn_bias: torch.Tensor | None,
    seqused_k: torch.Tensor | None = None,
) -> None:
    """Checks a packed-sequence call's shapes, dtypes and devices without reading tensor data.

    Args:
        q: ``(total_q, H, D)`` floating tensor.
        k: ``(total_k, Hkv, D)`` floating tensor with ``H % Hkv == 0``.
        v: Same shape as ``k``.
        cu_seqlens_q, cu_seqlens_k: ``(N+1,)`` int32 prefix sums, stride 1.
        max_seqlen_q, max_seqlen_k: Python ints >= 0.
        attn_mask: ``None`` or a bool/integer tensor in a layout of :func:`varlen_layout`.
        attn_bias: ``None`` or a floating tensor in a layout of :func:`varlen_layout`.
        seqused_k: ``None`` or an ``(N,)`` int32 tensor of keys used per sequence, stride 1.

    Raises:
        ValueError: On a bad shape, stride, length or device; the message names the argument,
            what it got and what is expected.
        TypeError: On a bad dtype or a non-integer length.
    """
    _check_operands((("q", q, "(total_q, H, D)"), ("k", k, "(total_k, Hkv, D)"), ("v", v, "(total_k, Hkv, D)")))
    total_q, H, D = q.shape
    total_k, Hkv, _ = k.shape
    if k.shape[2] != D:
        raise ValueError(f"k: got shape {_shape(k)}, expected (total_k, Hkv, D={D}) to match q {_shape(q)}")
    _check_kv_heads("k", k, "v", v, H)
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if t.dtype != torch.int32:
            raise TypeError(f"{name}: got dtype {t.dtype}, expected torch.int32")
        if t.dim() != 1 or t.shape[0] == 0:
            raise ValueError(f"{name}: got shape {_shape(t)}, expected (N+1,) prefix sums of N >= 0 sequences")
        _check_unit_stride(name, t)
    N = cu_seqlens_q.shape[0] - 1
    if cu_seqlens_k.shape != cu_seqlens_q.shape:
        raise ValueError(f"cu_seqlens_k: got shape {_shape(cu_seqlens_k)}, expected (N+1,) = ({N + 1},) "
                         f"(cu_seqlens_q's shape)")
    for name, n in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(n, bool) or not isinstance(n, numbers.Integral):
            raise TypeError(f"{name}: got {type(n).__name__} {n!r}, expected an int >= 0")
        if n < 0:
            raise ValueError(f"{name}: got {n}, expected an int >= 0 (the longest sequence's length)")
    if seqused_k is not None:
        if seqused_k.dtype != torch.int32:
            raise TypeError(f"seqused_k: got dtype {seqused_k.dtype}, expected torch.int32")
        if tuple(seqused_k.shape) != (N,):
            raise ValueError(f"seqused_k: got shape {_shape(seqused_k)}, expected (N,) = ({N},)")
        _check_unit_stride("seqused_k", seqused_k)
    _check_devices("q", q, (("k", k), ("v", v), ("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k),
                            ("seqused_k", seqused_k), ("attn_mask", attn_mask), ("attn_bias", attn_bias)))
    _check_mask_bias_dtypes(attn_mask, attn_bias)
    for name, t in (("attn_mask", attn_mask), ("attn_bias", attn_bias)):
        if t is not None:
            varlen_layout(t.shape, name, H, Hkv, total_q, total_k, max_seqlen_k)


def _sequence_bounds(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k, total_q, total_k):
    """Reads the prefix sums (a host sync; the reference is eager) and checks them.

    Returns:
        ``(bounds, first_row, end_row)``: ``bounds`` holds ``(q0, Lq_s, k0, Lk_s)`` per sequence;
        rows before ``first_row`` or from ``end_row`` on belong to no sequence.

    Raises:
        ValueError: Prefix sums that decrease, start below 0 or end past the packed total; a
            ``seqused_k`` outside ``[0, span]``; a sequence longer than its ``max_seqlen_*``.
    """
    prefix_sums = {}
    for name, t, total_name, total in (("cu_seqlens_q", cu_seqlens_q, "total_q", total_q),
                                       ("cu_seqlens_k", cu_seqlens_k, "total_k", total_k)):
        cu = t.tolist()
        if cu[0] < 0:
            raise ValueError(f"{name}: got first entry {cu[0]}, expected prefix sums starting at >= 0")
        for s in range(len(cu) - 1):
            if cu[s + 1] < cu[s]:
                raise ValueError(f"{name}: got entry [{s + 1}] = {cu[s + 1]} after {cu[s]}, expected "
                                 f"non-decreasing prefix sums")
        if cu[-1] > total:
            raise ValueError(f"{name}: got last entry {cu[-1]}, expected at most {total_name} = {total}")
        prefix_sums[name] = cu
    cu_q, cu_k = prefix_sums["cu_seqlens_q"], prefix_sums["cu_seqlens_k"]
    used = None if seqused_k is None else seqused_k.tolist()
    bounds = []
    for s in range(len(cu_q) - 1):
        q0, lq, k0, span = cu_q[s], cu_q[s + 1] - cu_q[s], cu_k[s], cu_k[s + 1] - cu_k[s]
        lk = span if used is None else used[s]
        if not 0 <= lk <= span:  # past its span a sequence would read the next one's keys
            raise ValueError(f"seqused_k: sequence {s} uses {lk} keys, expected 0..{span} "
                             f"(its span cu_seqlens_k[{s}:{s + 2}] = {k0}, {k0 + span})")
        if lq > max_seqlen_q:
            raise ValueError(f"cu_seqlens_q: sequence {s} has {lq} queries, expected at most "
                             f"max_seqlen_q = {max_seqlen_q}")
        if lk > max_seqlen_k:
            source = "cu_seqlens_k" if used is None else "seqused_k"
            raise ValueError(f"{source}: sequence {s} has {lk} keys, expected at most "
                             f"max_seqlen_k = {max_seqlen_k}")
        bounds.append((q0, lq, k0, lk))
    return bounds, cu_q[0], cu_q[-1]


def _sequence_part(t: torch.Tensor | None, layout: str | None, q0: int, lq: int, k0: int, lk: int):
    """One sequence's slice of a packed mask or bias, in `attention`'s broadcast layout:
    ``(heads, 1, Lk_s)`` per key, ``(heads, Lq_s, Lk_s)`` per row. Slicing is differentiable, so
    a bias gradient lands back in the packed bias (0 wherever no sequence reads)."""
    if t is None:
        return None
    if layout == "per_key":
        return t[:, k0:k0 + lk].unsqueeze(1)
    return t[:, q0:q0 + lq, :lk]


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    attn_mask: torch.Tensor | None = None,
    attn_bias: torch.Tensor | None = None,
    is_causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    softmax_scale: float | None = None,
    return_lse: bool = False,
    compute_dtype: torch.dtype | None = None,
    seqused_k: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention over packed sequences: :func:`attention` on each sequence, one call apiece.

    Sequence ``s`` has queries ``cu_seqlens_q[s]:cu_seqlens_q[s+1]`` and keys
    ``cu_seqlens_k[s]:cu_seqlens_k[s] + Lk_s``, with ``Lk_s = seqused_k[s]`` if given, else
    ``cu_seqlens_k[s+1] - cu_seqlens_k[s]``. Only those rows and keys are sliced out, so another
    sequence's keys, keys past ``Lk_s`` and memory past the last prefix sum never reach a result.
    The causal rule and the window are bottom-right aligned per sequence (``Lk_s - Lq_s``).

    Args:
        q: ``(total_q, H, D)``.
        k, v: ``(total_k, Hkv, D)``, ``H % Hkv == 0``.
        cu_seqlens_q, cu_seqlens_k: ``(N+1,)`` int32 prefix sums, non-decreasing; zero-length
            sequences allowed.
        max_seqlen_q, max_seqlen_k: Upper bounds on ``Lq_s`` and ``Lk_s``; a longer sequence is
            a ValueError.
        attn_mask: Optional bool (or 0/1 integer) mask, True = attend, per key
            ``(H|Hkv|1, total_k)`` or per query row ``(H|Hkv|1, total_q, max_seqlen_k)``
            (:func:`varlen_layout`).
        attn_bias: Optional floating bias in the same two layouts. Differentiable; its gradient
            has the bias's shape, 0 at entries no sequence reads.
        is_causal, window_size, softcap, softmax_scale, compute_dtype: As in :func:`attention`.
        return_lse: Also return the natural-log ``lse`` of shape ``(H, total_q)``.
        seqused_k: Optional ``(N,)`` int32 keys used per sequence, each within its
            ``cu_seqlens_k`` span.

    Returns:
        ``out`` of shape ``(total_q, H, D)`` in ``q.dtype``, or ``(out, lse)`` with ``lse`` in
        :func:`attention`'s lse dtype. Rows of no sequence and dead rows give ``out = 0`` and
        ``lse = -inf``.

    Raises:
        ValueError: On bad shapes, devices, prefix sums or lengths, or a negative ``softcap``.
        TypeError: On bad dtypes.
    """
    check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, attn_mask, attn_bias,
                        seqused_k)
    check_window(window_size)
    if softcap < 0:
        raise ValueError(f"softcap: got {softcap}, expected >= 0 (0 disables soft-capping)")
    total_q, H, D = q.shape
    total_k, Hkv, _ = k.shape
    layouts = {name: varlen_layout(t.shape, name, H, Hkv, total_q, total_k, max_seqlen_k)
               for name, t in (("attn_mask", attn_mask), ("attn_bias", attn_bias)) if t is not None}
    bounds, first_row, end_row = _sequence_bounds(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                                  seqused_k, total_q, total_k)
    compute_dtype = _compute_dtype(compute_dtype, q.device)
    lse_dtype = _lse_dtype(compute_dtype)

    def no_sequence(rows: int) -> tuple[torch.Tensor, torch.Tensor]:  # dead rows: out 0, lse -inf
        return q.new_zeros(rows, H, D), torch.full((H, rows), -math.inf, dtype=lse_dtype, device=q.device)

    pieces = [no_sequence(first_row)]
    for q0, lq, k0, lk in bounds:
        if lq == 0:
            continue
        out, lse = attention(
            q[q0:q0 + lq].unsqueeze(0), k[k0:k0 + lk].unsqueeze(0), v[k0:k0 + lk].unsqueeze(0),
            _sequence_part(attn_mask, layouts.get("attn_mask"), q0, lq, k0, lk),
            _sequence_part(attn_bias, layouts.get("attn_bias"), q0, lq, k0, lk),
            is_causal=is_causal, softmax_scale=softmax_scale, softcap=softcap, return_lse=True,
            compute_dtype=compute_dtype, window_size=window_size)
        pieces.append((out[0], lse[0]))
    pieces.append(no_sequence(total_q - end_row))
    out = torch.cat([out for out, _ in pieces])
    return (out, torch.cat([lse for _, lse in pieces], dim=1)) if return_lse else out
