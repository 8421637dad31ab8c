"""The one place a config is chosen (FlashAttention's `hopper/tile_size.h` is the model).

A call's config for one direction (forward, backward, short-query forward) comes from the first
of:

1. an explicit `fwd_config` / `bwd_config` (refused here when the backend cannot run it on the
   call's shape: `check_explicit`);
2. an entry of the dispatch table for the call's key, or the nearest current entry
   (`dispatch.lookup`: which table, which entry, whether it is current);
3. the learned default of the GPU's arch family, direction, head-dim class, dtype and bias kind
   (`configs/defaults.yaml`, written offline by `python -m benchmarks learn-defaults`);
4. the heuristic default of the head-dim class (the tables below, with their evidence);

and then the fit rule: a forward config whose tiles do not fit the GPU's shared memory with the
call's operands has its key tiles halved (`fit_forward`). The shared memory a config needs is
the launcher's model, which this module only compares with the GPU's limit: the CUDA kernels'
formula (`dmattn_kernels.cuda.shared_bytes`; `_first_fitting` picks the CUDA defaults that fit
by it) and the Triton forward plan's compiled kernel (`ForwardPlan.shared_bytes`).

A forced backend (`backend="cuda"` or `"triton"` without an explicit config) skips the table and
takes that backend's default. The CUDA kernels run windows and packed sequences (with a per-key
mask and bias or none) only in the forward's overlapped warp-specialized kernel and the
warp-specialized backward: a key they cannot run (`TableKey.packed`, `TableKey.window`) never gets
them (`key_problem`), and forcing them on one (or a config that cannot) is a ValueError.
"""

from __future__ import annotations

import os
from dataclasses import replace
from functools import lru_cache
from typing import Callable

import torch

from dmattn_bench.dispatch import lookup
from dmattn_bench.dispatch.lookup import Choice
from dmattn_bench.hardware import ARCH_LIMITS, ArchLimits, local_limits
from dmattn_bench.space import (CONFIGS_DIR, AttentionShape, BwdConfig, DecodeConfig, FwdConfig, TableKey,
                                bias_has_rows, key_problem, load_yaml)

DEFAULT_BACKEND = "triton"  # the backend of every default (the CUDA kernels run where a table says so)

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
# `python -m benchmarks cuda-defaults-sweep`): the first whose shared memory fits the GPU at the
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
# On SM90, where configs of 16 rows per warp in whole warpgroups run wgmma (`uses_wgmma`):
# H200, same shapes and command (2026-11-22). Forward, TFLOP/s:
# D64 64x128 w4 337, D128 128x128 w8 363, D256 128x64 w8 423; backward: D64 128x64 dq64x64 w4
# 271, D128 64x64 dq64x64 w4 317. The D256 backward stays on mma.sync (WGMMA_BWD_MAX_HEAD_DIM).
# Head dims 72-128 run the warp-specialized forward (`warp_specialized`; those below 128 on its
# tiles): H200, the bench's W1-W3 forward (bf16 B2 H16 L4096 D128
# causal; `python -m benchmarks cuda-ws-probe`, 2026-11-26), 128x128 w12 s2 against 128x128 w8:
# W3 0.290 / 0.380 ms, W1 (full mask and bias) 0.522 / 1.537, W2 (kv-head mask, per-key bias)
# 0.417 / 1.080. Its backward is the warp-specialized one (`backward_warp_specialized`): H100,
# W3 causal and not, the whole backward 1.007 / 1.595 ms against 1.078 / 2.029 for 64x64 dq64x64
# w4 (`python -m benchmarks cuda-bwd-ws-check time`, 2026-11-27). Both kernels won every D80 and
# D96 key of the H200 sweep, both directions, over the mma.sync defaults and every Triton
# candidate (`results/tune/h200-sweep-swizzled.json`: 2.60x over the defaults, 2026-11-30).
# Head dims 136-192 run the warp-specialized backward's transposed layout (`transposed_backward`):
# it won both D192 keys of the H200 sweep over every Triton and CUDA candidate, 64x96 w12 s1 at
# 3.016 ms causal and 5.040 ms not (bf16 B4 H16 gqa4 L4096), 2.34x and 2.66x the tables' choices
# (`results/tune/h200-sweep-d192.json`, 2026-11-30).
CUDA_SM90_DEFAULTS = (
    (64, (FwdConfig(64, 128, 4, 2), FwdConfig(64, 64, 4, 2)),
     (BwdConfig(128, 64, 64, 64, 4, 2), BwdConfig(64, 64, 64, 64, 4, 2))),
    (128, (FwdConfig(128, 128, 12, 2), FwdConfig(128, 128, 8, 2)),
     (BwdConfig(64, 128, 64, 128, 12, 2), BwdConfig(64, 64, 64, 64, 4, 2), BwdConfig(32, 64, 64, 32, 4, 2))),
    (192, (FwdConfig(128, 64, 8, 2), FwdConfig(64, 32, 4, 2)),
     (BwdConfig(64, 96, 64, 96, 12, 1), BwdConfig(32, 64, 64, 32, 4, 1), BwdConfig(16, 64, 64, 16, 4, 1))),
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

DEFAULTS_FILE = CONFIGS_DIR / "defaults.yaml"  # the learned defaults, written by `python -m benchmarks learn-defaults`
LOWEST_HEAD_DIM = 8
HEAD_DIM_STEP = 8  # a class holds the head dims (multiples of 8) above the previous class's bound
# tl.dot's smallest tile dim: the fit rule stops halving a key tile there
MIN_KEY_TILE = 16
_CONFIG_CLASSES = {"fwd": FwdConfig, "bwd": BwdConfig}


# -- explicit configs ----------------------------------------------------------------------------


def check_explicit(backend, shape: AttentionShape, **configs) -> None:
    """Raises ValueError when `backend` (a registry Backend) cannot run an explicit config of
    `configs` (`fwd_config=...`) on this call's shape; a table's entries and the defaults were
    checked when they were tuned."""
    for name, config in configs.items():
        reason = None if config is None else backend.is_supported(config, shape)
        if reason:
            raise ValueError(f"{name}: {reason} (the {backend.name} backend cannot run it)")


# -- learned defaults ----------------------------------------------------------------------------


@lru_cache(maxsize=1)
def learned_defaults() -> dict[tuple, FwdConfig | BwdConfig]:
    """{(backend, arch family, direction, dtype, head-dim class, bias has rows): config} from
    `DEFAULTS_FILE`."""
    document = load_yaml(DEFAULTS_FILE)
    chosen = {}
    for backend, archs in document["defaults"].items():
        for arch, groups in archs.items():
            for group in groups:
                direction = group["direction"]
                for dtype in group["dtypes"]:
                    chosen[(backend, arch, direction, dtype, group["max_head_dim"], group["bias_rows"])] = \
                        _CONFIG_CLASSES[direction](**group["config"])
    return chosen


# -- heuristic defaults --------------------------------------------------------------------------


def decode_config(head_dim: int, device: torch.device | str) -> DecodeConfig:
    """The short-query forward's config for `head_dim` on `device` (`DECODE_DEFAULTS`)."""
    if torch.device(device).type != "cuda":
        return INTERPRETER_DECODE_DEFAULT
    return next(config for high, config in DECODE_DEFAULTS if head_dim <= high)


def _device_limits(device: torch.device) -> ArchLimits:
    """Limits of `device`; without a GPU to ask, the smallest of the archs the kernels target
    (SM120: 99 KiB of shared memory per block)."""
    limits = local_limits(device) if device.type == "cuda" and torch.cuda.is_available() else None
    return limits if limits is not None else ARCH_LIMITS["sm120"]


def _classes(classes) -> tuple[tuple[int, int, FwdConfig, BwdConfig], ...]:
    """(largest head dim, fwd, bwd) classes as (smallest, largest head dim, fwd, bwd)."""
    entries, low = [], LOWEST_HEAD_DIM
    for high, fwd, bwd in classes:
        entries.append((low, high, fwd, bwd))
        low = high + HEAD_DIM_STEP
    return tuple(entries)


def _first_fitting(candidates, head_dim: int, limits: ArchLimits):
    """The first CUDA config of `candidates` whose shared memory fits `limits` at `head_dim`,
    else the last (the smallest)."""
    from dmattn_kernels.cuda import shared_bytes

    return next((c for c in candidates if shared_bytes(c, head_dim, limits.arch) <= limits.shared_memory_per_block),
                candidates[-1])


@lru_cache(maxsize=None)  # a forced backend looks its defaults up on every plan it builds
def _cuda_entries(device: torch.device) -> tuple[tuple[int, int, FwdConfig, BwdConfig], ...]:
    limits = _device_limits(device)
    defaults = CUDA_SM90_DEFAULTS if limits.arch == "sm90" else CUDA_DEFAULTS
    return _classes((high, _first_fitting(fwd, high, limits), _first_fitting(bwd, high, limits))
                    for high, fwd, bwd in defaults)


@lru_cache(maxsize=None)
def default_entries_for(arch: str | None, backend: str, dtype: str | None, gpu: bool = True,
                        bias_rows: bool = False) -> tuple[tuple[int, int, FwdConfig, BwdConfig], ...]:
    """The Triton `default_entries` on a GPU of arch family `arch` ("sm90"), or in the interpreter
    (`gpu` False). An arch, dtype and bias with rows or not that `configs/defaults.yaml` covers
    take its learned configs, class by class and direction by direction; the rest, the heuristics
    above."""
    if not gpu:
        return _classes((INTERPRETER_DEFAULT,))
    learned = learned_defaults()
    return _classes((high, learned.get((backend, arch, "fwd", dtype, high, bias_rows), fwd),
                     learned.get((backend, arch, "bwd", dtype, high, bias_rows), bwd))
                    for high, fwd, bwd in GPU_DEFAULTS)


def default_entries(device: torch.device | str, backend: str = DEFAULT_BACKEND, dtype: str | None = None,
                    bias_rows: bool = False) -> tuple[tuple[int, int, FwdConfig, BwdConfig], ...]:
    """The default configs of `backend` for `dtype` ("bf16", ...; None: the heuristics alone) and
    a bias with rows or not (`space.bias_has_rows`) as (smallest head dim, largest head dim, fwd,
    bwd) classes."""
    device = torch.device(device)
    if backend == "cuda":
        return _cuda_entries(device)
    gpu = device.type == "cuda"
    return default_entries_for(_device_limits(device).arch if gpu else None, backend, dtype, gpu, bias_rows)


def _class_configs(head_dim: int, entries) -> tuple[FwdConfig, BwdConfig]:
    """(fwd, bwd) of the class of `entries` (`default_entries`) that holds `head_dim`."""
    for low, high, fwd, bwd in entries:
        if low <= head_dim <= high:
            return fwd, bwd
    raise ValueError(f"head_dim: got {head_dim}, expected a multiple of 8 in [8, 256]")


def default_configs(head_dim: int, device: torch.device | str, backend: str = DEFAULT_BACKEND,
                    dtype: str | None = None, bias: str = "none") -> tuple[FwdConfig, BwdConfig]:
    """The configs of `backend` used for `head_dim` (and `dtype` and `bias`, a `TableKey.bias`
    kind) when no tuned table has an entry."""
    return _class_configs(head_dim, default_entries(device, backend, dtype, bias_has_rows(bias)))


def default_choice(key: TableKey, device: torch.device | str | None, backend: str = DEFAULT_BACKEND,
                   arch: str | None = None) -> Choice:
    """The default (learned, else heuristic) of `backend` for `key` on `device` (None: the current
    GPU, else the interpreter); `arch`: the defaults of that arch family's GPUs instead (a Triton
    backend's, for judging a choice offline on another GPU's journals)."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if key.direction == "decode":
        return Choice(backend, decode_config(key.head_dim, device if arch is None else "cuda"), "default")
    if arch is None:
        fwd, bwd = default_configs(key.head_dim, device, backend, key.dtype, key.bias)
    else:
        fwd, bwd = _class_configs(key.head_dim, default_entries_for(arch, backend, key.dtype, True,
                                                                    bias_has_rows(key.bias)))
    return Choice(backend, fwd if key.direction == "fwd" else bwd, "default")


# -- the order ----------------------------------------------------------------------------------------


def choose(key: TableKey, device: torch.device | str | None = None, *, backend: str = "auto",
           table: str | os.PathLike | None = None, explicit: FwdConfig | BwdConfig | None = None,
           env: str | None | object = lookup.READ_ENV) -> Choice:
    """What a call of `key` on `device` runs (module docstring): `explicit` on the backend asked
    for; else, for `backend` "auto", the table's entry (`table`, else `dispatch.use_table`'s, else
    DMATTN_BENCH_TABLE's (`env`: its value when the caller read it), else the shipped one), else
    the default; for a forced backend, its default.

    Raises:
        ValueError: a head_dim no default covers, or a forced backend that cannot run the key with
            the config it would run (`key_problem`); never because of a table.
    """
    if backend != "auto":
        reason = key_problem(backend, key)
        if reason is None:
            choice = Choice(backend, explicit, "explicit") if explicit is not None else default_choice(key, device, backend)
            reason = key_problem(backend, key, choice.config)
        if reason:
            raise ValueError(f"backend: got {backend!r}, but {reason}; use backend='auto' or 'triton'")
        return choice
    if explicit is not None:
        return Choice(DEFAULT_BACKEND, explicit, "explicit")
    entry = lookup.table_choice(key, device, table=table, env=env)
    return entry if entry is not None else default_choice(key, device)


# -- the fit rule ----------------------------------------------------------------------------------


def shared_memory_limit(device: torch.device) -> int | None:
    """Shared memory per block of a GPU; None where none applies (the interpreter)."""
    if device.type != "cuda":
        return None
    limits = local_limits(device)
    return None if limits is None else limits.shared_memory_per_block


def fit_forward(backend_name: str, config: FwdConfig, build: Callable[[FwdConfig], object], *, q_dtype: torch.dtype,
                bias_dtype: torch.dtype | None, limit: int | None) -> tuple[FwdConfig, object]:
    """The config a forward runs and its launch plan (`build(config)`): `config`, or, where the
    fit applies, its key tiles halved until the plan's shared memory (`plan.shared_bytes()`, the
    launcher's model: its compiled kernel) fits `limit` (the GPU's shared memory per block) or the
    tile is `MIN_KEY_TILE`. The plan that fits is the one returned: nothing is built twice.

    The fit applies to the Triton forward under 16-bit inputs with an fp32 bias on a GPU (None:
    no limit, the interpreter). A table key has no bias dtype, so a config tuned on a 16-bit bias
    can need more shared memory than the GPU has with an fp32 one, whose tile takes twice the
    shared memory per stage (sm90, Triton 3.6, D128: fwd 128x128 w8 s2 needs 214016 B with a bf16
    bias, 246784 B with an fp32 one, over the 232448 B limit). Halving the key tile keeps the
    pipeline: one stage instead (the other way to fit) ran W1 in 1.509 ms against 0.693 ms with
    the bf16 bias (H100). `prune` checks that the halved tiles fit.
    """
    plan = build(config)
    if backend_name != "triton" or bias_dtype != torch.float32 or q_dtype == torch.float32 or limit is None:
        return config, plan
    while config.block_n > MIN_KEY_TILE and plan.shared_bytes() > limit:
        config = replace(config, block_n=config.block_n // 2)
        plan = build(config)
    return config, plan
