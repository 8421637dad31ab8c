"""The one list of attention backends: name, launchers, support check, default configs.

Every backend has the same launch interface so the autograd wrapper, the validator and the
tuner treat them alike: inputs already checked and normalised by `dmattn_bench.api`
(mask/bias as 4-D broadcast views), outputs preallocated by the caller.
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
from dmattn_bench.hardware import ARCH_LIMITS, local_limits
from dmattn_bench.space import AttentionShape, BwdConfig, DecodeConfig, FwdConfig, bias_has_rows


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


def _reference_forward(q, k, v, mask, bias, *, is_causal, softmax_scale, softcap, config, out, lse):
    del config  # the reference has no tiles
    with torch.no_grad():
        result, result_lse = reference.attention(
            q, k, v, mask, bias, is_causal=is_causal, softmax_scale=softmax_scale,
            softcap=softcap, return_lse=True,
        )
    out.copy_(result)
    lse.copy_(result_lse)


def _reference_backward(dout, q, k, v, out, lse, mask, bias, *, is_causal, softmax_scale, softcap,
                        config, dq, dk, dv, dbias, dlse=None):
    del out, lse, config  # recomputed by autograd through the reference
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    bias_leaf = bias.detach().requires_grad_(dbias is not None) if bias is not None else None
    with torch.enable_grad():
        result, result_lse = reference.attention(
            *leaves, mask, bias_leaf, is_causal=is_causal, softmax_scale=softmax_scale, softcap=softcap,
            return_lse=True,
        )
        inputs = leaves + ([bias_leaf] if dbias is not None else [])
        outputs, grads_in = ([result], [dout]) if dlse is None else ([result, result_lse], [dout, dlse])
        grads = torch.autograd.grad(outputs, inputs, grads_in)
    for target, grad in zip((dq, dk, dv, dbias), grads):
        target.copy_(grad)


def _reference_is_supported(config, shape) -> str | None:
    del config, shape
    return None


def _triton_kernels(direction: str, config, shape: AttentionShape) -> tuple[tuple, ...]:
    """The kernels `dmattn_kernels.triton.launch` compiles for one launch, each keyed by what it
    reads of the config: its tiles (`prune.tile_constexprs`), warps and stages. The mask's
    activity pass and the backward's delta pass read none of it. So the 32 sm90 backward
    candidates need 8 dK/dV kernels and 8 of each dQ kernel, not 32 of each."""
    from dmattn_bench.prune import KERNELS, tile_constexprs

    if direction == "decode":  # the span pass and the combine read no tunable (and run by shape)
        return (("decode_mask_span_kernel",), ("flash_decode_kernel", config.block_n, config.num_warps,
                                               config.num_stages), ("decode_combine_kernel",))
    shared = (("tile_activity_kernel",),) if shape.has_mask else ()
    if direction == "bwd":
        shared += (("flash_bwd_preprocess_kernel",),)
    return shared + tuple((name, *tile_constexprs(name, config).values(), config.num_warps, config.num_stages)
                          for name in KERNELS[direction])


def _cuda_kernels(direction: str, config, shape: AttentionShape) -> tuple[tuple, ...]:
    """The one cubin `dmattn_kernels.cuda.launch` builds for a launch: its direction, config and
    the feature flags that become its -D list (the dtype is not in the shape: two dtypes share a
    key and at worst wait for each other)."""
    features = (shape.head_dim, shape.is_causal, shape.has_mask, shape.has_bias, shape.softcap > 0)
    if direction == "bwd":
        features += (shape.bias_requires_grad, shape.num_heads > shape.num_heads_kv)
    return (("cuda", direction, *config.to_dict().values(), *features),)


def _kernel_backend(name: str) -> Backend:
    """A bundled kernel family, from its package's launchers. Imported on first use: importing the
    Triton kernels fixes whether the interpreter is used."""
    package = importlib.import_module(KERNEL_PACKAGES[name])
    return Backend(
        name=name,
        forward=package.attention_forward,
        backward=package.attention_backward,
        is_supported=package.is_supported,
        kernels=_KERNEL_KEYS[name],
        compile_only=package.compile_only,
        forward_plan=getattr(package, "ForwardPlan", None),
        backward_plan=getattr(package, "BackwardPlan", None),
    )


_KERNEL_KEYS = {"triton": _triton_kernels, "cuda": _cuda_kernels}
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


# Heuristic defaults per head-dim class: (largest head dim of the class, fwd, bwd), where
# configs/defaults.yaml learned none from the trials (`default_entries_for`). GPU tiles
# follow FlashAttention-2's Triton defaults: 128x64 forward tiles up to D=64, 64x64 beyond; the
# backward holds K, V and two (BLOCK_N, D) fp32 accumulators, so its tiles shrink as D grows.
GPU_DEFAULTS = (
    (64, FwdConfig(128, 64, 4, 3), BwdConfig(32, 64, 64, 32, 4, 2)),
    (128, FwdConfig(64, 64, 4, 3), BwdConfig(32, 64, 64, 32, 4, 2)),
    (256, FwdConfig(64, 32, 4, 2), BwdConfig(16, 32, 32, 16, 4, 1)),
)
# The CUDA kernels' defaults per class off SM90 (mma.sync), fastest first (measured on the H200
# through mma.sync, the nearest GPU we have: B2 H16 L4096 causal at D = 64, 128 and 256,
# `python3 benchmarks/cuda/defaults_sweep.py`): the first whose shared memory fits the GPU at the
# class's largest head dim is used, so an SM86 or SM120 part (99 KiB per block) gets smaller
# tiles or rings than an A100 (163 KiB).
CUDA_DEFAULTS = (
    (64, (FwdConfig(128, 64, 4, 2), FwdConfig(128, 32, 4, 2)),
     (BwdConfig(128, 64, 64, 128, 4, 2), BwdConfig(32, 64, 64, 32, 4, 2))),
    (128, (FwdConfig(128, 64, 4, 2), FwdConfig(128, 32, 4, 2), FwdConfig(64, 32, 4, 2)),
     (BwdConfig(64, 64, 64, 64, 4, 2), BwdConfig(32, 64, 64, 32, 4, 2), BwdConfig(32, 64, 64, 32, 4, 1))),
    (256, (FwdConfig(128, 32, 8, 2), FwdConfig(64, 32, 4, 2), FwdConfig(64, 32, 4, 1)),
     (BwdConfig(32, 64, 64, 32, 4, 1), BwdConfig(16, 64, 64, 16, 4, 1))),
)
# On SM90, where configs of 16 rows per warp in whole warpgroups run wgmma (launch.uses_wgmma):
# H200, same shapes and command (2026-11-22). Forward, TFLOP/s:
# D64 64x128 w4 337, D128 128x128 w8 363, D256 128x64 w8 423; backward: D64 128x64 dq64x64 w4
# 271, D128 64x64 dq64x64 w4 317. The D256 backward stays on mma.sync (WGMMA_BWD_MAX_HEAD_DIM).
# Head dim 128 runs the warp-specialized forward (launch.warp_specialized: a head dim padded to
# 128; 72-120 keep the class before): H200, the bench's W1-W3 forward (bf16 B2 H16 L4096 D128
# causal; `python3 benchmarks/cuda/ws_probe.py`, 2026-11-26), 128x128 w12 s2 against 128x128 w8:
# W3 0.290 / 0.380 ms, W1 (full mask and bias) 0.522 / 1.537, W2 (kv-head mask, per-key bias)
# 0.417 / 1.080. Its backward is the warp-specialized one (launch.backward_warp_specialized): H100,
# W3 causal and not, the whole backward 1.007 / 1.595 ms against 1.078 / 2.029 for 64x64 dq64x64
# w4 (`python3 benchmarks/cuda/bwd_ws_check.py time`, 2026-11-27).
CUDA_SM90_DEFAULTS = (
    (64, (FwdConfig(64, 128, 4, 2), FwdConfig(64, 64, 4, 2)),
     (BwdConfig(128, 64, 64, 64, 4, 2), BwdConfig(64, 64, 64, 64, 4, 2))),
    (120, (FwdConfig(128, 128, 8, 2), FwdConfig(64, 64, 4, 2)),
     (BwdConfig(64, 64, 64, 64, 4, 2), BwdConfig(32, 64, 64, 32, 4, 2))),
    (128, (FwdConfig(128, 128, 12, 2), FwdConfig(128, 128, 8, 2)),
     (BwdConfig(64, 128, 64, 128, 12, 2), BwdConfig(64, 64, 64, 64, 4, 2), BwdConfig(32, 64, 64, 32, 4, 2))),
    (256, (FwdConfig(128, 64, 8, 2), FwdConfig(64, 32, 4, 2)),
     (BwdConfig(32, 64, 64, 32, 4, 1), BwdConfig(16, 64, 64, 16, 4, 1))),
)
# The interpreter runs each tile op in numpy; small tiles waste the fewest out-of-bounds lanes.
INTERPRETER_DEFAULT = (256, FwdConfig(16, 16, 1, 1), BwdConfig(16, 16, 16, 16, 1, 1))
# The short-query forward (decode) per head-dim class: (largest head dim, config). It streams K
# and V once per KV group, so the key tile only needs to keep the loads in flight; the split
# count follows the GPU (`DecodeConfig.num_splits` 0).
DECODE_DEFAULTS = (
    (128, DecodeConfig(64, 4, 3)),
    (256, DecodeConfig(32, 4, 2)),
)
INTERPRETER_DECODE_DEFAULT = DecodeConfig(16, 1, 1)


def decode_config(head_dim: int, device: torch.device | str) -> DecodeConfig:
    """The short-query forward's config for `head_dim` on `device` (`DECODE_DEFAULTS`)."""
    if torch.device(device).type != "cuda":
        return INTERPRETER_DECODE_DEFAULT
    return next(config for high, config in DECODE_DEFAULTS if head_dim <= high)


def _device_limits(device: torch.device):
    """Limits of `device`; without a GPU to ask, the smallest of the archs the kernels target
    (SM120: 99 KiB of shared memory per block)."""
    limits = local_limits(device) if device.type == "cuda" and torch.cuda.is_available() else None
    return limits if limits is not None else ARCH_LIMITS["sm120"]


def _fitting(candidates, head_dim: int, limits):
    from dmattn_kernels.cuda.launch import shared_bytes

    return next((c for c in candidates if shared_bytes(c, head_dim, limits.arch) <= limits.shared_memory_per_block),
                candidates[-1])


def default_entries(device: torch.device | str, backend: str = "triton", dtype: str | None = None,
                    bias_rows: bool = False) -> tuple[tuple[int, int, FwdConfig, BwdConfig], ...]:
    """The default configs of `backend` for `dtype` ("bf16", ...; None: the heuristics alone) and
    a bias with rows or not (`space.bias_has_rows`) as (smallest head dim, largest head dim, fwd,
    bwd) classes."""
    device = torch.device(device)
    if backend == "cuda":
        return _cuda_entries(device)
    gpu = device.type == "cuda"
    return default_entries_for(_device_limits(device).arch if gpu else None, backend, dtype, gpu, bias_rows)


def _classes(classes) -> tuple[tuple[int, int, FwdConfig, BwdConfig], ...]:
    entries, low = [], 8
    for high, fwd, bwd in classes:
        entries.append((low, high, fwd, bwd))
        low = high + 8
    return tuple(entries)


@lru_cache(maxsize=None)  # a forced backend looks its defaults up on every plan it builds
def _cuda_entries(device: torch.device) -> tuple[tuple[int, int, FwdConfig, BwdConfig], ...]:
    limits = _device_limits(device)
    defaults = CUDA_SM90_DEFAULTS if limits.arch == "sm90" else CUDA_DEFAULTS
    return _classes((high, _fitting(fwd, high, limits), _fitting(bwd, high, limits)) for high, fwd, bwd in defaults)


@lru_cache(maxsize=None)
def default_entries_for(arch: str | None, backend: str, dtype: str | None, gpu: bool = True,
                        bias_rows: bool = False) -> tuple[tuple[int, int, FwdConfig, BwdConfig], ...]:
    """The Triton `default_entries` on a GPU of arch family `arch` ("sm90"), or in the interpreter
    (`gpu` False). An arch, dtype and bias with rows or not that `configs/defaults.yaml` covers
    take its learned configs (`dmattn_bench.defaults`), class by class and direction by direction;
    the rest, the heuristics above."""
    if not gpu:
        return _classes((INTERPRETER_DEFAULT,))
    from dmattn_bench.defaults import learned_defaults

    learned = learned_defaults()
    return _classes((high, learned.get((backend, arch, "fwd", dtype, high, bias_rows), fwd),
                     learned.get((backend, arch, "bwd", dtype, high, bias_rows), bwd))
                    for high, fwd, bwd in GPU_DEFAULTS)


def default_configs(head_dim: int, device: torch.device | str, backend: str = "triton", dtype: str | None = None,
                    bias: str = "none") -> tuple[FwdConfig, BwdConfig]:
    """The configs of `backend` used for `head_dim` (and `dtype` and `bias`, a `TableKey.bias`
    kind) when no tuned table has an entry."""
    for low, high, fwd, bwd in default_entries(device, backend, dtype, bias_has_rows(bias)):
        if low <= head_dim <= high:
            return fwd, bwd
    raise ValueError(f"head_dim: got {head_dim}, expected a multiple of 8 in [8, 256]")
