"""Kernel launch configurations and the problem shape they run: the tunables of each direction,
one spelling everywhere, checked when built.

A field name here is also the YAML key in `configs/` and the column of the dispatch table
(`block_m`, `block_n`, `num_warps`, `num_stages`, ...). Configs are frozen so they can key
caches and tables, and checked when built: a value no kernel could run raises there, naming the
field, instead of deep inside a compiler. A backend's `is_supported` adds its own rules.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

import torch

# -- kernel configs ------------------------------------------------------------------------------
# What any config must hold, whatever runs it; a backend's `is_supported` adds its own rules (a
# Triton tile is a power of two, a CUDA warp owns 16 or 32 rows, ...).
TILE_STEP = 16  # tile dims are whole MMA tiles: tl.dot's minimum, the CUDA kernels' m16 fragments
MAX_TILE = 256
MAX_WARPS = 16  # 512 threads: the warp-specialized forward at 192 rows (12 consumer + 4 producer warps)
MAX_STAGES = 8
MAX_SPLITS = 64  # the short-query forward's combine kernel holds one lse per split


def _field_problem(name: str, value: Any) -> str | None:
    """What is wrong with a config field's value, as "expected ..." (None when it is right)."""
    if not isinstance(value, int) or isinstance(value, bool):
        return "expected an int"
    if name.startswith("block_"):
        fits = value % TILE_STEP == 0 and TILE_STEP <= value <= MAX_TILE
        return None if fits else f"expected a multiple of {TILE_STEP} in [{TILE_STEP}, {MAX_TILE}]"
    if name == "num_warps":
        return None if 1 <= value <= MAX_WARPS else f"expected 1 to {MAX_WARPS} warps"
    if name == "num_stages":
        return None if 1 <= value <= MAX_STAGES else f"expected 1 to {MAX_STAGES} stages"
    if name == "num_splits":
        return None if 0 <= value <= MAX_SPLITS else f"expected 0 (auto) to {MAX_SPLITS}"
    return None if value in (0, 1) else "expected 0 (off) or 1 (on)"  # a kernel knob (`KNOBS`)


def check_fields(config) -> None:
    """Raises ValueError naming the first field of `config` that no kernel could run."""
    for item in fields(config):
        value = getattr(config, item.name)
        problem = _field_problem(item.name, value)
        if problem:
            raise ValueError(f"{type(config).__name__}.{item.name}: got {value!r}, {problem}")


class _Knobs:
    """What a config class with kernel knobs (`KNOBS`: each 0 or 1, off by default) answers."""

    def to_dict(self) -> dict[str, int]:
        """Its fields, the knobs only where on (an entry written before a knob existed reads the same)."""
        return {name: value for name, value in asdict(self).items() if value or name not in KNOBS[type(self)]}

    def knobs_on(self) -> tuple[str, ...]:
        """The kernel knobs this config sets, in label order (none: the plain kernel)."""
        return tuple(name for name in KNOBS[type(self)] if getattr(self, name))


@dataclass(frozen=True)
class FwdConfig(_Knobs):
    """Forward kernel tiles, and the kernel knobs of the CUDA warp-specialized forward.

    A knob is 0 (off) or 1 (on); off, the kernel compiles to the code the knob was added to, so
    `to_dict` leaves a knob out while it is 0 and a table, journal or space written before the
    knob reads the same (`config_from_dict` and `expand_grid` take it as 0 where absent).

    Attributes:
        block_m: query rows per program.
        block_n: key columns per inner-loop step.
        num_warps: warps per program.
        num_stages: software-pipelining depth of the key loop.
        overlap: 1: FlashAttention-3's consumers (flash_fwd_ws.cu's FWD_OVERLAP): a tile's S
            issued with the tile before's P V, the two consumers taking turns, the scale in the
            exp where scores are scaled dots, a row's max and sum reduced as trees.
        persistent: 1 (with overlap): a CTA per SM walking a schedule of work items
            (FWD_PERSISTENT, `forward.persistent_schedule`) instead of a CTA per item.
        tma_store: 1 (with overlap, not for packed sequences): each consumer stages its rows of
            out in shared memory and one of its threads stores them by TMA (FWD_TMA_STORE)
            instead of every thread storing its pairs.
    """

    block_m: int = 64
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    overlap: int = field(default=0, metadata={"minimum": 0})
    persistent: int = field(default=0, metadata={"minimum": 0})
    tma_store: int = field(default=0, metadata={"minimum": 0})

    def __post_init__(self) -> None:
        check_fields(self)


FWD_KNOBS = ("overlap", "persistent", "tma_store")  # FwdConfig's kernel knobs, in label order


@dataclass(frozen=True)
class BwdConfig(_Knobs):
    """Backward kernel tiles: one program per key block for dK/dV(/dBias), one per query block for dQ.

    Attributes:
        block_m: query rows per inner step of the dK/dV kernel.
        block_n: key columns owned by one dK/dV program.
        block_m_dq: query rows owned by one dQ program.
        block_n_dq: key columns per inner step of the dQ kernel.
        num_warps: warps per program (both kernels).
        num_stages: software-pipelining depth (both kernels).
        kv_group: 1 (a kernel knob, as FwdConfig's; GQA calls of the CUDA warp-specialized
            backward): a CTA walks every query head of its KV group (flash_bwd_ws.cu's
            BWD_KV_GROUP), dK and dV summed in its registers, instead of a CTA per query head
            writing an fp32 share that the launcher sums.
        nondeterministic_dq: 1 (a kernel knob of the CUDA warp-specialized backward): each key
            block adds its dQ share to the fp32 sum as soon as it is made, in no set order,
            instead of waiting its turn (flash_bwd_ws.cu's BWD_DQ_UNORDERED). dQ then differs
            between runs in its last bits: the one configuration DESIGN.md §1 lets a table mark
            non-deterministic, and the name in the entry is that mark. Under
            `torch.use_deterministic_algorithms(True)` the backward runs without it (`ordered`).
    """

    block_m: int = 32
    block_n: int = 64
    block_m_dq: int = 64
    block_n_dq: int = 32
    num_warps: int = 4
    num_stages: int = 1
    kv_group: int = field(default=0, metadata={"minimum": 0})
    nondeterministic_dq: int = field(default=0, metadata={"minimum": 0})

    def __post_init__(self) -> None:
        check_fields(self)

    @property
    def deterministic(self) -> bool:
        """Whether every run gives bitwise-identical gradients (DESIGN.md §1)."""
        return not self.nondeterministic_dq

    def ordered(self) -> "BwdConfig":
        """This config with dQ summed in its fixed order: deterministic, and runnable wherever this
        one is (the knob only drops a wait)."""
        return replace(self, nondeterministic_dq=0)


BWD_KNOBS = ("kv_group", "nondeterministic_dq")  # BwdConfig's kernel knobs
KNOBS = {FwdConfig: FWD_KNOBS, BwdConfig: BWD_KNOBS}  # each config class's knobs, in label order


@dataclass(frozen=True)
class DecodeConfig:
    """Short-query forward tiles (`flash_decode.py`): the query heads of a KV group share a tile.

    Attributes:
        block_n: key columns per inner-loop step.
        num_warps: warps per program.
        num_stages: software-pipelining depth of the key loop.
        num_splits: key ranges run by programs of their own (split-KV); 0 picks it from the GPU's
            SM count and the cache length (`decode_launch.split_count`).
    """

    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    num_splits: int = field(default=0, metadata={"minimum": 0})  # 0 means "auto"

    def __post_init__(self) -> None:
        check_fields(self)

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass(frozen=True)
class AttentionShape:
    """What a kernel config must handle: the problem's sizes and feature flags."""

    batch: int
    seqlen_q: int
    seqlen_k: int
    num_heads: int
    num_heads_kv: int
    head_dim: int
    is_causal: bool = False
    has_mask: bool = False
    has_bias: bool = False
    bias_requires_grad: bool = False
    softcap: float = 0.0


MAX_HEAD_DIM = 256  # the largest head dim whose fp32 accumulator tile fits a program's registers


def shape_problem(shape: AttentionShape) -> str | None:
    """What no kernel here can run in `shape` (the head dim, the head grouping), else None: the
    rules every backend's `is_supported` starts from."""
    if shape.head_dim > MAX_HEAD_DIM or shape.head_dim % 8:
        return f"head_dim={shape.head_dim} is not a multiple of 8 in [8, {MAX_HEAD_DIM}]"
    if shape.num_heads % shape.num_heads_kv:
        return f"num_heads={shape.num_heads} is not a multiple of num_heads_kv={shape.num_heads_kv}"
    return None


def as_4d(t: torch.Tensor | None) -> torch.Tensor | None:
    """Left-pads a broadcastable mask/bias to 4-D (a view, never a copy)."""
    if t is None or t.dim() == 4:
        return t
    return t[(None,) * (4 - t.dim())]


# -- packed sequences and windows ------------------------------------------------------------------


@dataclass(frozen=True)
class Packing:
    """How a packed ("varlen") call's tokens are laid out, as far as its plans depend on it (the
    prefix sums themselves are data, passed on each run).

    The launchers take the packed operands as 4-D views of one batch row: q (1, total_q, H, D),
    k and v (1, total_k, Hkv, D), out likewise, lse (1, H, total_q), and a mask or bias as
    (1, H|Hkv|1, 1, total_k) when it is per key (`mask_per_key`, `bias_per_key`) or
    (1, H|Hkv|1, total_q, max_seqlen_k) when it is per query row (column j of row i is key j of
    row i's own sequence).
    """

    num_sequences: int
    max_seqlen_q: int
    max_seqlen_k: int
    seqused_k: bool = False  # key counts come from seqused_k, not from cu_seqlens_k
    mask_per_key: bool = False
    bias_per_key: bool = False


def window_bounds(window: tuple[int, int], is_causal: bool, seqlen_q: int, seqlen_k: int) -> tuple[bool, int, int]:
    """(whether a window applies, left, right) as the kernels take them: the causal rule already
    bounds the right side (FlashAttention sets it to 0 under causal), and an unbounded side (-1)
    becomes Lq + Lk, wider than any row's keys, so the kernels test plain integers."""
    left, right = window
    if is_causal:
        right = -1
    unbounded = seqlen_q + seqlen_k
    return (left >= 0 or right >= 0), (unbounded if left < 0 else left), (unbounded if right < 0 else right)
