"""The one list of attention backends: name, launchers, support check.

Every backend has the same launch interface so the autograd wrapper, the validator and the
tuner treat them alike: inputs already checked by `dmattn_bench.checks` (the mask and bias
broadcastable, of up to 4 dims: the launchers read them as 4-D), outputs preallocated by the
caller.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable, ContextManager

import torch

from dmattn_bench import reference, sourcehash
from dmattn_bench.space import AttentionShape, BwdConfig, FwdConfig, as_4d


def interpreter_enabled() -> bool:
    """Whether Triton runs kernels on the CPU through its interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _no_kernels(direction: str, config, shape: AttentionShape) -> tuple[tuple, ...]:
    del direction, config, shape
    return ()


@dataclass(frozen=True)
class Backend:
    """A kernel family. `forward`/`backward` fill preallocated outputs (see `dmattn_kernels`).

    `kernels(direction, config, shape)` names what one launch compiles, one key per kernel; two
    launches on the same inputs whose keys meet share that compiled kernel. The tuner uses it to
    compile each kernel once instead of in several processes at the same time; a wrong key costs
    a duplicate compilation or a wait, never a wrong result.

    Within `compile_only()` the launchers compile what a launch needs and launch nothing (the
    tuner's compile workers).

    `forward_plan` / `backward_plan`, where a backend has them, build a launch plan from a call's
    arguments (the launchers' own, less the data-only ones): a callable that runs the call's
    kernels on tensors of the same signature (`dmattn_bench.plan`). Without them the runtime calls
    `forward` / `backward`.
    """

    name: str
    forward: Callable[..., None]
    backward: Callable[..., None]
    is_supported: Callable[[FwdConfig | BwdConfig, AttentionShape], str | None]
    kernels: Callable[[str, FwdConfig | BwdConfig, AttentionShape], tuple[tuple, ...]] = _no_kernels
    compile_only: Callable[[], ContextManager] = contextlib.nullcontext
    forward_plan: Callable[..., Callable[..., None]] | None = None
    backward_plan: Callable[..., Callable[..., None]] | None = None


NO_WINDOW = (-1, -1)
NO_SEQUENCES = (None, None, None)


def _packed_operand(t: torch.Tensor | None, per_key: bool) -> torch.Tensor | None:
    """A packed call's mask or bias as the launchers take it (`configs.Packing`: (1, H|Hkv|1, 1,
    total_k) per key, (1, H|Hkv|1, total_q, max_seqlen_k) per row) in `reference.varlen_attention`'s
    layout: (H|Hkv|1, total_k) or (H|Hkv|1, total_q, max_seqlen_k), a view."""
    if t is None:
        return None
    t = as_4d(t)
    return t[0, :, 0, :] if per_key else t[0]


def _reference_call(q, k, v, mask, bias, *, is_causal, softmax_scale, softcap, window, packing, sequences,
                    compute_dtype=None):
    """(out, lse) of the reference in the launchers' layouts: a dense call's, or a packed one's
    (4-D views of one batch row, `configs.Packing`) through `reference.varlen_attention`."""
    options = dict(is_causal=is_causal, softmax_scale=softmax_scale, softcap=softcap, return_lse=True,
                   window_size=tuple(window), compute_dtype=compute_dtype)
    if packing is None:
        return reference.attention(q, k, v, mask, bias, **options)
    cu_seqlens_q, cu_seqlens_k, seqused_k = sequences
    out, lse = reference.varlen_attention(
        q[0], k[0], v[0], cu_seqlens_q, cu_seqlens_k, packing.max_seqlen_q, packing.max_seqlen_k,
        _packed_operand(mask, packing.mask_per_key), _packed_operand(bias, packing.bias_per_key),
        seqused_k=seqused_k if packing.seqused_k else None, **options)
    return out.unsqueeze(0), lse.unsqueeze(0)


def _reference_forward(q, k, v, mask, bias, *, is_causal, softmax_scale, softcap, config, out, lse,
                       window=NO_WINDOW, packing=None, sequences=NO_SEQUENCES):
    """The launchers' forward interface on the reference; a packed call writes only the rows its
    sequences own, leaving the rest as given (as the Triton launcher does)."""
    del config  # the reference has no tiles
    with torch.no_grad():
        result, result_lse = _reference_call(q, k, v, mask, bias, is_causal=is_causal, softmax_scale=softmax_scale,
                                             softcap=softcap, window=window, packing=packing, sequences=sequences)
    rows = slice(None)
    if packing is not None:
        cu_seqlens_q = sequences[0]
        rows = slice(int(cu_seqlens_q[0]), int(cu_seqlens_q[-1]))
    out[:, rows].copy_(result[:, rows])
    lse[:, :, rows].copy_(result_lse[:, :, rows])


def _reference_backward(dout, q, k, v, out, lse, mask, bias, *, is_causal, softmax_scale, softcap,
                        config, dq, dk, dv, dbias, dlse=None, window=NO_WINDOW, packing=None, sequences=NO_SEQUENCES):
    del out, lse, config  # recomputed by autograd through the reference
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    bias_leaf = bias.detach().requires_grad_(dbias is not None) if bias is not None else None
    with torch.enable_grad():
        result, result_lse = _reference_call(*leaves, mask, bias_leaf, is_causal=is_causal,
                                             softmax_scale=softmax_scale, softcap=softcap, window=window,
                                             packing=packing, sequences=sequences)
        inputs = leaves + ([bias_leaf] if dbias is not None else [])
        outputs, grads_in = ([result], [dout]) if dlse is None else ([result, result_lse], [dout, dlse])
        grads = torch.autograd.grad(outputs, inputs, grads_in, allow_unused=True)
    for target, grad in zip((dq, dk, dv, dbias), grads):
        if target is not None:
            target.copy_(grad.reshape(target.shape) if grad is not None else torch.zeros_like(target))


def _reference_is_supported(config, shape) -> str | None:
    del config, shape
    return None


def _kernel_backend(name: str) -> Backend:
    """A bundled kernel family, from its package's launchers. Imported on first use: importing the
    Triton kernels fixes whether the interpreter is used."""
    package = importlib.import_module(KERNEL_PACKAGES[name])
    return Backend(
        name=name,
        forward=package.attention_forward,
        backward=package.attention_backward,
        is_supported=package.is_supported,
        kernels=package.kernel_keys,
        compile_only=package.compile_only,
        forward_plan=getattr(package, "ForwardPlan", None),
        backward_plan=getattr(package, "BackwardPlan", None),
    )


_REFERENCE = Backend("reference", _reference_forward, _reference_backward, _reference_is_supported)
BACKEND_NAMES = ("triton", "cuda", "reference")
_loaded: dict[str, Backend] = {"reference": _REFERENCE}


# Where each kernel backend's sources live (a package of the project's own `dmattn_kernels`), and
# how its hash reads them (`sourcehash`).
KERNEL_PACKAGES = {"triton": "dmattn_kernels.triton", "cuda": "dmattn_kernels.cuda", "reference": "dmattn_bench.reference"}
_SOURCE_HASHES = {"triton": sourcehash.triton_package_hash, "cuda": sourcehash.cuda_package_hash}


@lru_cache(maxsize=None)
def kernel_source_hash(name: str) -> str:
    """The hash of what decides backend `name`'s results and speed: its kernels and the launch
    parameters they receive, not docstrings, comments or the host code around them
    (`sourcehash`). A table validated on another hash is stale for that backend.

    Read from the files (never by importing the kernels), so it is safe before the interpreter
    switch; cached for the process.

    Raises:
        ValueError: the backend's sources cannot be found.
    """
    spec = importlib.util.find_spec(KERNEL_PACKAGES[name])
    if spec is None or spec.origin is None:
        raise ValueError(f"backend: cannot locate the sources of {name!r}")
    origin = Path(spec.origin)
    if origin.name == "__init__.py":
        return _SOURCE_HASHES[name](origin.parent)
    return sourcehash.python_module_hash(origin)


overrides = 0  # how many times a backend was replaced: a call's plan keeps the backend it chose
PLUGINS_ENV = "DMATTN_BENCH_PLUGINS"  # comma-separated modules imported when backends first load
_plugins_loaded = False


def override_backend(backend: Backend) -> None:
    """Replaces the implementation behind a backend name (for plugins: instrumented kernels,
    fault injection in tests, experiments). The name must be a known one."""
    global overrides
    if backend.name not in BACKEND_NAMES:
        raise ValueError(f"backend: got {backend.name!r}, expected one of {BACKEND_NAMES}")
    _loaded[backend.name] = backend
    overrides += 1


def _load_plugins() -> None:
    """Imports the modules named in DMATTN_BENCH_PLUGINS once (they may call override_backend).

    Spawned workers inherit the environment, so a plugin applies to them too.
    """
    global _plugins_loaded
    if _plugins_loaded:
        return
    _plugins_loaded = True
    for module in filter(None, (m.strip() for m in os.environ.get(PLUGINS_ENV, "").split(","))):
        importlib.import_module(module)


def get_backend(name: str) -> Backend:
    """The backend called `name`.

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    if name not in BACKEND_NAMES:
        raise ValueError(f"backend: got {name!r}, expected one of {('auto',) + BACKEND_NAMES}")
    if name not in _loaded:
        _loaded[name] = _kernel_backend(name)
    _load_plugins()
    return _loaded[name]
