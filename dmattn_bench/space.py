"""Kernel launch configurations: the tunables of each direction, one spelling everywhere.

A field name here is also the YAML key in `configs/` and the column of the dispatch table
(`block_m`, `block_n`, `num_warps`, `num_stages`, ...). Configs are frozen so they can key
caches and tables.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any


@dataclass(frozen=True)
class FwdConfig:
    """Forward kernel tiles.

    Attributes:
        block_m: query rows per program.
        block_n: key columns per inner-loop step.
        num_warps: warps per program.
        num_stages: software-pipelining depth of the key loop.
    """

    block_m: int = 64
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass(frozen=True)
class BwdConfig:
    """Backward kernel tiles: one program per key block for dK/dV(/dBias), one per query block for dQ.

    Attributes:
        block_m: query rows per inner step of the dK/dV kernel.
        block_n: key columns owned by one dK/dV program.
        block_m_dq: query rows owned by one dQ program.
        block_n_dq: key columns per inner step of the dQ kernel.
        num_warps: warps per program (both kernels).
        num_stages: software-pipelining depth (both kernels).
    """

    block_m: int = 32
    block_n: int = 64
    block_m_dq: int = 64
    block_n_dq: int = 32
    num_warps: int = 4
    num_stages: int = 1

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


def config_from_dict(cls: type, data: dict[str, Any]):
    """Builds a config from a mapping, naming any unknown or non-integer field.

    Raises:
        ValueError: an unknown key or a value that is not a positive int.
    """
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"{cls.__name__}: unknown field(s) {unknown}; expected a subset of {sorted(known)}")
    for name, value in data.items():
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{cls.__name__}.{name}: expected a positive int, got {value!r}")
    return cls(**data)


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
