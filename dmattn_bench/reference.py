"""Eager PyTorch reference for flash dynamic-mask attention (DESIGN.md section 1).

This is the single implementation of the attention contract that tests, the validator and the
benchmarks compare kernels against. It favours clarity over speed: every score matrix is
materialised in ``compute_dtype`` (fp64 on CPU, fp32 on GPU by default).

For query head ``h`` (KV head ``h // (H // Hkv)``), query row ``i`` and key ``j``::

    S[i, j] = softmax_scale * <q_i, k_j>
    S[i, j] = softcap * tanh(S[i, j] / softcap)          if softcap > 0
    S[i, j] = S[i, j] + bias[i, j]                        bias is not scaled
    S[i, j] = -inf  unless  mask[i, j] and (not is_causal or j <= i + Lk - Lq)
with ``cache_seqlens``, sequence b has Lk_b = clamp(cache_seqlens[b], 0, Lk) keys: keys at or past
Lk_b are excluded (their K and V never reach a product) and Lk_b replaces Lk in the causal rule.
With ``block_table`` (B, pages) the cache is paged: key and value are (blocks, page, Hkv, D), and
key j of sequence b is block ``block_table[b, j // page]``'s row ``j % page`` (Lk = pages * page);
an entry whose keys all lie at or past Lk_b is never used, and the keys of an entry outside
``[0, blocks)`` (-1, ``blocks``, any index no block has) are excluded, as if masked.
    lse[i]  = log(sum_j exp(S[i, j]))
    out[i]  = sum_j exp(S[i, j] - lse[i]) * v_j

A dead row (no visible key, or only ``-inf`` scores) gives ``out = 0``, ``lse = -inf`` and zero
gradients; nothing in the forward or backward pass is NaN.
"""

from __future__ import annotations

import math

import torch

__all__ = ["attention", "broadcast_dims", "check_inputs"]

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
    for name, t, layout in (("query", query, "(B, Lq, H, D)"), ("key", key, "(B, Lk, Hkv, D)"),
                            ("value", value, "(B, Lk, Hkv, D)")):
        if t.dim() != 4:
            raise ValueError(f"{name}: got shape {_shape(t)}, expected 4-D {layout}")
        if not t.is_floating_point():
            raise TypeError(f"{name}: got dtype {t.dtype}, expected a floating dtype")
    B, Lq, H, D = query.shape
    _, Lk, Hkv, _ = key.shape
    if D == 0:
        raise ValueError(f"query: got shape {_shape(query)} with head dim 0, expected D >= 1")
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
    if Hkv == 0 or H % Hkv != 0:
        raise ValueError(f"key: got shape {_shape(key)} with Hkv={Hkv} heads, expected Hkv "
                         f"to divide the query's H={H} heads")
    if value.shape != key.shape:
        raise ValueError(f"value: got shape {_shape(value)}, expected {_shape(key)} (key's shape)")
    if cache_seqlens is not None:
        if cache_seqlens.dtype != torch.int32:
            raise TypeError(f"cache_seqlens: got dtype {cache_seqlens.dtype}, expected torch.int32")
        if tuple(cache_seqlens.shape) != (B,):
            raise ValueError(f"cache_seqlens: got shape {_shape(cache_seqlens)}, expected (B,) = ({B},)")
        if B > 1 and cache_seqlens.stride(0) != 1:  # the kernel reads sequence b's length at offset b
            raise ValueError(f"cache_seqlens: got stride {cache_seqlens.stride(0)}, expected 1 "
                             f"(pass cache_seqlens.contiguous())")
    for name, t in (("key", key), ("value", value), ("attn_mask", attn_mask),
                    ("attn_bias", attn_bias), ("cache_seqlens", cache_seqlens), ("block_table", block_table)):
        if t is not None and t.device != query.device:
            raise ValueError(f"{name}: got device {t.device}, expected {query.device} "
                             f"(query's device)")
    if attn_mask is not None:
        if attn_mask.is_floating_point() or attn_mask.is_complex():
            raise TypeError(f"attn_mask: got dtype {attn_mask.dtype}, expected torch.bool "
                            f"(or an integer dtype holding 0/1); True = attend")
        broadcast_dims(attn_mask.shape, "attn_mask", B, H, Hkv, Lq, Lk)
    if attn_bias is not None:
        if not attn_bias.is_floating_point():
            raise TypeError(f"attn_bias: got dtype {attn_bias.dtype}, expected a floating dtype")
        broadcast_dims(attn_bias.shape, "attn_bias", B, H, Hkv, Lq, Lk)


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

    Returns:
        ``out`` of shape ``(B, Lq, H, D)`` in ``query.dtype``, or ``(out, lse)`` where ``lse``
        is fp32 when ``compute_dtype`` is fp32 or narrower, else ``compute_dtype``. Dead rows
        give ``out = 0`` and ``lse = -inf``.

    Raises:
        ValueError: On bad shapes, devices or a negative ``softcap``.
        TypeError: On bad dtypes.
    """
    check_inputs(query, key, value, attn_mask, attn_bias, cache_seqlens, block_table)
    if softcap < 0:
        raise ValueError(f"softcap: got {softcap}, expected >= 0 (0 disables soft-capping)")
    on_cache = None  # (B, Lk): the keys of a paged cache that lie on one of its blocks
    if block_table is not None:
        key, value, on_cache = _gather_pages(key, value, block_table, cache_seqlens)
    B, Lq, H, D = query.shape
    Lk, Hkv = key.shape[1], key.shape[2]
    group = H // Hkv
    if compute_dtype is None:
        compute_dtype = torch.float64 if query.device.type == "cpu" else torch.float32
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
    if is_causal:
        causal = cols <= rows + ((Lk if key_lengths is None else key_lengths) - Lq)
        visible = causal if visible is None else visible & causal
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
    lse = lse.squeeze(-1)
    if torch.finfo(compute_dtype).bits <= 32:
        lse = lse.to(torch.float32)
    return out, lse
