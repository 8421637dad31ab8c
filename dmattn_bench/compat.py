"""Drop-in replacements for flash-dmattn 1.2's `flash_dmattn_func` and `triton_dmattn_func`, and
for FlashAttention 2's `flash_attn_func` and `flash_attn_varlen_func`.

Switching is one import::

    # from flash_dmattn import flash_dmattn_func, triton_dmattn_func
    from dmattn_bench.compat import flash_dmattn_func, triton_dmattn_func
    # from flash_attn import flash_attn_func, flash_attn_varlen_func
    from dmattn_bench.compat import flash_attn_func, flash_attn_varlen_func

**FlashAttention 2.** `flash_attn_func` and `flash_attn_varlen_func` keep the argument names,
positional order and defaults of ``flash_attn/flash_attn_interface.py`` (Dao-AILab/flash-attention,
read at commit ``005300258a22``): q ``(B, Lq, H, D)`` / ``(total_q, H, D)``, k/v with ``Hkv``
heads, ``cu_seqlens_*`` int32 prefix sums, causal and ``window_size`` bottom-right aligned (per
sequence in varlen), ``softcap``. They run on `dmattn_bench.flash_dmattn_func` and
`dmattn_bench.flash_dmattn_varlen_func`, so a module holding both names serves as the kernel that
transformers' FlashAttention path loads (it passes ``cu_seqlens_q``, ``cu_seqlens_k``,
``max_seqlen_q``, ``max_seqlen_k``, ``causal``, ``softmax_scale``, ``dropout_p``, ``window_size``,
``softcap`` and ``deterministic`` by keyword, and only those our signatures name). Beyond
FlashAttention, both take keyword-only ``attn_mask`` and ``attn_bias`` (the dynamic mask and the
learnable bias, in the layouts of the functions they run on; the varlen one also
``seqused_k``). ``max_seqlen_*`` given as 0-dim tensors (transformers derives them so) are read
as ints, one host sync each. ``deterministic=True`` is passed on: the backward then runs in its
fixed order where the table's config is marked non-deterministic (DESIGN.md §1; every other
config is deterministic anyway). What we cannot honour raises `NotImplementedError` naming the
argument: ``dropout_p`` other than 0 (our kernels have no attention dropout),
``alibi_slopes`` (give the ALiBi term as ``attn_bias`` instead), ``return_attn_probs=True``
(the probabilities are never materialised) and ``block_table`` (paged caches go through
`dmattn_bench.flash_dmattn_func(..., block_table=...)`).

**flash-dmattn.** `flash_dmattn_func` and `triton_dmattn_func` keep flash-dmattn's argument
names, positional order and defaults exactly, as released in flash-dmattn 1.2.2
(``flash_dmattn/flash_dmattn_interface.py`` and ``flash_dmattn/flash_dmattn_triton.py`` of the
PyPI sdist ``flash_dmattn-1.2.2.tar.gz``, sha256
``19187214989acc5c93269c54a27dda61d734c8d8091e30ab0d62f98ff1e3f265``). The same signatures
are in SmallDoges/flash-dmattn at commits ``ddc8cd5ff127`` (interface) and ``b7deeba48b7b``
(triton). Note that the two differ in positional order: the CUDA function
takes ``softmax_scale`` before ``is_causal``, the Triton function ``is_causal`` first. Both
take the same layout, q ``(B, Lq, H, D)`` and k/v ``(B, Lk, Hkv, D)``, as
`dmattn_bench.flash_dmattn_func` does, and both run on our kernels (`backend="auto"`).

Of flash-dmattn's arguments, ``return_attn_probs=True`` raises
(`NotImplementedError`: the probabilities are never materialised; use
`dmattn_bench.flash_dmattn_func(..., return_lse=True)` for the log-sum-exp). ``deterministic``
is passed on, as for FlashAttention's functions.

Where flash-dmattn 1.2.2 is buggy or narrower, we differ on purpose (DESIGN.md §1 is the
contract; `dmattn_bench.reference.attention` implements it):

- **Causal alignment.** Its Triton kernel aligns the causal mask top-left
  (``i >= j``) whatever Lq and Lk are; its CUDA kernel aligns it bottom-right. Both of our
  functions align bottom-right (key ``j`` visible from query ``i`` iff ``j <= i + Lk - Lq``),
  like its CUDA kernel and FlashAttention 2.1+. `triton_dmattn_func` results therefore change
  when ``is_causal`` and ``Lq != Lk``.
- **Rows with no visible key.** Its Triton kernel returns NaN there (``exp(-inf - -inf)``).
  Its CUDA wrapper runs ``nan_to_num_(nan=0, posinf=0, neginf=0)`` over ``out`` and over
  dq/dk/dv/dbias after every call, which zeroes those rows but also silently zeroes any
  NaN/inf produced anywhere else. We return 0 with zero gradients by construction and scrub
  nothing.
- **Mask and bias shapes.** Its Triton kernel takes only full ``(B, H, Lq, Lk)`` masks and
  biases and materialises an all-ones mask and an all-zeros bias of that size when they are
  None; its CUDA wrapper needs 4-D tensors and pads (copies) the mask and bias along Lk to a
  multiple of 128 on every call. We accept any ``(B|1, H|Hkv|1, Lq|1, Lk|1)`` shape, including
  fewer than 4 dims, and never copy, pad or materialise them.
- **Mask dtype.** Its CUDA kernel requires a bool mask; its Triton kernel converts a bool mask
  to float and treats ``mask > 0`` as visible. We take bool (or 0/1 integer) masks as they are;
  a floating mask is converted here with ``attn_mask > 0`` (one bool copy), as its Triton path
  does.
- **GQA / MQA.** Its Triton kernel requires ``Hkv == H``; both of ours accept ``H % Hkv == 0``.
- **Softcap** (CUDA only there). In the 1.2.2 sources (``csrc/flash_dmattn/flash_api.cpp``
  ``set_params_fprop``, ``src/flash_fwd_kernel.h``, ``src/softmax.h``) Q is pre-scaled by
  ``softcap``, the bias is added before the ``tanh``, and the softmax runs with scale 1, which
  gives ``softmax(tanh(scale * QK^T + bias * scale / softcap))``. We compute
  ``softmax(softcap * tanh(scale * QK^T / softcap) + bias)``, the usual definition (Gemma 2,
  FlashAttention). This reading of their kernel was not run on a GPU.
- **softmax_scale=0.0.** Its Triton path uses ``softmax_scale or 1/sqrt(D)``, so 0.0 means the
  default; we honour 0.0 as given.
- **Head dim and dtypes.** Its CUDA wrapper pads a head dim that is not a multiple of 8 (a
  copy of q/k/v); its Triton kernel allows only D <= 128 and fp16/bf16. We take D <= 256, a
  multiple of 8, without copies, and raise `ValueError` otherwise; fp16/bf16 on a GPU, fp32
  and fp16 in the Triton interpreter. Bias may be the query's dtype or fp32 in both functions
  (its CUDA kernel required the query's dtype).
- **dBias.** Our bias gradient has the bias's own shape, summed over every broadcast dim.
"""

from __future__ import annotations

import torch

from dmattn_bench import api, checks, varlen
from dmattn_bench.plan import NO_WINDOW

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "flash_dmattn_func", "triton_dmattn_func"]


def _bool_mask(attn_mask: torch.Tensor | None) -> torch.Tensor | None:
    """A floating 1/0 mask (flash-dmattn's Triton format) as bool, True where `mask > 0`."""
    if attn_mask is not None and attn_mask.is_floating_point():
        return attn_mask > 0
    return attn_mask


def flash_dmattn_func(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attn_mask: torch.Tensor | None = None, attn_bias: torch.Tensor | None = None,
                      softmax_scale: float | None = None, is_causal: bool | None = None, softcap: float | None = None,
                      deterministic: bool | None = None, return_attn_probs: bool | None = None) -> torch.Tensor:
    """flash-dmattn 1.2's CUDA `flash_dmattn_func`, run on dmattn-bench kernels.

    Args:
        query: (B, Lq, H, D).
        key, value: (B, Lk, Hkv, D) with H % Hkv == 0.
        attn_mask: bool, broadcastable as (B|1, H|Hkv|1, Lq|1, Lk|1); True = attend. A
            floating mask counts `> 0` as attend.
        attn_bias: query's dtype or fp32, same broadcast rule; added after scaling.
        softmax_scale: default 1/sqrt(D).
        is_causal: bottom-right aligned; None means False.
        softcap: > 0 soft-caps the scaled scores before the bias; None or 0 disables.
        deterministic: True: bitwise-identical gradients on every run (`dmattn_bench.flash_dmattn_func`);
            None means False.
        return_attn_probs: only None/False; True raises NotImplementedError.

    Returns:
        out (B, Lq, H, D) in the query's dtype.
    """
    for name, flag in (("is_causal", is_causal), ("deterministic", deterministic),
                       ("return_attn_probs", return_attn_probs)):
        checks.check_flag(name, flag, optional=True)
    if return_attn_probs:
        raise NotImplementedError(
            "return_attn_probs: got True, but dmattn-bench never materialises the attention "
            "probabilities; pass return_attn_probs=None/False, or call "
            "dmattn_bench.flash_dmattn_func(..., return_lse=True) for the log-sum-exp"
        )
    return api.flash_dmattn_func(
        query, key, value, _bool_mask(attn_mask), attn_bias, is_causal=bool(is_causal),
        softmax_scale=softmax_scale, softcap=0.0 if softcap is None else float(softcap),
        deterministic=bool(deterministic),
    )


def triton_dmattn_func(query, key, value, attn_mask=None, attn_bias=None, is_causal=False, softmax_scale=None):
    """flash-dmattn 1.2's `triton_dmattn_func` (note: `is_causal` before `softmax_scale`).

    Same arguments and semantics as `flash_dmattn_func` above, except that causal attention is
    bottom-right aligned where flash-dmattn's Triton kernel aligned it top-left (see the module
    docstring). flash-dmattn's Triton function has no softcap, deterministic or
    return_attn_probs arguments, so neither does this one.
    """
    checks.check_flag("is_causal", is_causal)
    return api.flash_dmattn_func(
        query, key, value, _bool_mask(attn_mask), attn_bias, is_causal=bool(is_causal),
        softmax_scale=softmax_scale,
    )


def _check_flash_attn_options(causal, deterministic, dropout_p, alibi_slopes, return_attn_probs, block_table=None):
    """FlashAttention 2's options we take as given, or raise on, naming the argument."""
    checks.check_flag("causal", causal)
    checks.check_flag("deterministic", deterministic, optional=True)
    if dropout_p:
        raise NotImplementedError(
            f"dropout_p: got {dropout_p}, but dmattn-bench has no attention dropout; pass dropout_p=0.0 "
            f"(in transformers, set the model's attention dropout, e.g. config.attention_dropout, to 0.0)")
    if alibi_slopes is not None:
        raise NotImplementedError(
            "alibi_slopes: not supported; pass the ALiBi term as attn_bias instead (a learnable bias is added "
            "to the scaled scores)")
    if return_attn_probs:
        raise NotImplementedError(
            "return_attn_probs: got True, but dmattn-bench never materialises the attention probabilities; "
            "pass return_attn_probs=False, or call dmattn_bench's functions with return_lse=True for the log-sum-exp")
    if block_table is not None:
        raise NotImplementedError(
            "block_table: paged KV caches are not taken by flash_attn_varlen_func here; call "
            "dmattn_bench.flash_dmattn_func(q, k_cache, v_cache, block_table=..., cache_seqlens=...)")


def _window(window_size):
    """FlashAttention takes a list or a tuple; our plans key on a tuple (anything else is left to
    the checks, which name it)."""
    return tuple(window_size) if isinstance(window_size, list) else window_size


def _length(name: str, n):
    """A max_seqlen as an int: transformers may hand a 0-dim tensor (read here, a host sync)."""
    if isinstance(n, torch.Tensor):
        if n.numel() != 1 or n.is_floating_point():
            raise TypeError(f"{name}: got a tensor of shape {tuple(n.shape)} and dtype {n.dtype}, "
                            f"expected an int (or a one-element integer tensor)")
        return int(n.item())
    return n


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=NO_WINDOW, softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False, *, attn_mask=None,
                    attn_bias=None):
    """FlashAttention 2's `flash_attn_func`, run on `dmattn_bench.flash_dmattn_func`.

    Args:
        q: (B, Lq, H, D).
        k, v: (B, Lk, Hkv, D) with H % Hkv == 0.
        dropout_p: only 0; anything else raises NotImplementedError.
        softmax_scale: default 1/sqrt(D).
        causal: bottom-right aligned (FlashAttention 2.1+'s rule).
        window_size: (left, right), -1 unbounded: query i sees keys i + Lk - Lq - left ..
            i + Lk - Lq + right.
        softcap: > 0 soft-caps the scaled scores; 0 (or None) disables.
        alibi_slopes: only None; give ALiBi as `attn_bias`.
        deterministic: True: bitwise-identical gradients on every run (`dmattn_bench.flash_dmattn_func`).
        return_attn_probs: only False.
        attn_mask, attn_bias: keyword only, our extension: a bool mask and a learnable bias,
            broadcastable as (B|1, H|Hkv|1, Lq|1, Lk|1) (see `dmattn_bench.flash_dmattn_func`).

    Returns:
        out (B, Lq, H, D) in q's dtype.
    """
    _check_flash_attn_options(causal, deterministic, dropout_p, alibi_slopes, return_attn_probs)
    return api.flash_dmattn_func(q, k, v, attn_mask, attn_bias, is_causal=causal, softmax_scale=softmax_scale,
                                 softcap=0.0 if softcap is None else float(softcap), window_size=_window(window_size),
                                 deterministic=bool(deterministic))


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=NO_WINDOW, softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None, *, attn_mask=None,
                           attn_bias=None, seqused_k=None):
    """FlashAttention 2's `flash_attn_varlen_func`, run on `dmattn_bench.flash_dmattn_varlen_func`.

    Args:
        q: (total_q, H, D), the sequences' query rows one after another.
        k, v: (total_k, Hkv, D) with H % Hkv == 0.
        cu_seqlens_q, cu_seqlens_k: (N + 1,) int32 prefix sums of the N sequences' lengths.
        max_seqlen_q, max_seqlen_k: the longest sequence's lengths (ints, or one-element tensors).
        dropout_p, softmax_scale, softcap, alibi_slopes, deterministic, return_attn_probs: as in
            `flash_attn_func`.
        causal, window_size: as in `flash_attn_func`, aligned to each sequence's own lengths.
        block_table: only None (a paged cache raises NotImplementedError).
        attn_mask, attn_bias: keyword only, our extension, per key (H|Hkv|1, total_k) or per query
            row (H|Hkv|1, total_q, max_seqlen_k) (see `dmattn_bench.flash_dmattn_varlen_func`).
        seqused_k: keyword only, (N,) int32: the keys sequence s uses, from cu_seqlens_k[s].

    Returns:
        out (total_q, H, D) in q's dtype.
    """
    _check_flash_attn_options(causal, deterministic, dropout_p, alibi_slopes, return_attn_probs, block_table)
    return varlen.flash_dmattn_varlen_func(
        q, k, v, cu_seqlens_q, cu_seqlens_k, _length("max_seqlen_q", max_seqlen_q),
        _length("max_seqlen_k", max_seqlen_k), attn_mask, attn_bias, is_causal=causal,
        window_size=_window(window_size), softcap=0.0 if softcap is None else float(softcap),
        softmax_scale=softmax_scale, seqused_k=seqused_k, deterministic=bool(deterministic))
