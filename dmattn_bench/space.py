"""The front end's vocabulary around the kernels' configs (`dmattn_kernels.configs`, re-exported
here): dtype names, config labels and dicts, search-space grids, dispatch-table keys.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch
import yaml

from dmattn_kernels.configs import (BWD_KNOBS, FWD_KNOBS, KNOBS, MAX_HEAD_DIM, MAX_SPLITS,  # noqa: F401
                                    AttentionShape, BwdConfig, DecodeConfig, FwdConfig, Packing, as_4d)


def _configs_dir() -> Path:
    """`configs/` (search spaces, workloads, the CI space): package data `dmattn_bench/configs/`
    in a wheel install, read in place in a source checkout, as the shipped tables are."""
    packaged = Path(__file__).parent / "configs"
    return packaged if packaged.is_dir() else Path(__file__).resolve().parents[1] / "configs"


CONFIGS_DIR = _configs_dir()


def load_yaml(path: str | Path) -> Any:
    """A YAML file's document (safe_load).

    Raises:
        ValueError: the file cannot be read or is not YAML, naming the file (and the line).
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or type(exc).__name__
        raise ValueError(f"{path}: not valid YAML{where}: {problem}") from None

# The dtype spellings of the CLI, workloads and tables, and the torch dtypes they name.
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}

MAX_DECODE_QUERIES = 64  # query rows up to which a call without gradient runs the short-query forward


@dataclass(frozen=True)
class InvalidConfig:
    """A dispatch-table entry's config that fails its class's checks, kept as the file wrote it so
    that `show` lists the entry and `verify` fails on it; the runtime never runs it.

    Attributes:
        values: the fields as written, in file order.
        problem: the check's message (`FwdConfig.block_m: got 24, expected ...`).
    """

    values: tuple[tuple[str, int], ...]
    problem: str

    def to_dict(self) -> dict[str, int]:
        return dict(self.values)


def config_label(config: "FwdConfig | BwdConfig | DecodeConfig | InvalidConfig | None") -> str:
    """Compact human label: fwd "128x64 w4 s3" (a knob on appended: "128x128 w12 s2 overlap
    persistent"), bwd "32x64 dq64x32 w4 s2" (or "64x128 dq64x128 w12 s2 kv_group"), decode "n64
    w4 s3 splits auto", a table entry's invalid config "invalid: block_m=24 ..."; "-" for a
    direction not run."""
    if config is None:
        return "-"
    if isinstance(config, InvalidConfig):
        return "invalid: " + " ".join(f"{name}={value}" for name, value in config.values)
    if isinstance(config, DecodeConfig):
        splits = config.num_splits or "auto"
        return f"n{config.block_n} w{config.num_warps} s{config.num_stages} splits {splits}"
    label = f"{config.block_m}x{config.block_n}"
    if isinstance(config, BwdConfig):
        label += f" dq{config.block_m_dq}x{config.block_n_dq}"
    label += f" w{config.num_warps} s{config.num_stages}"
    for name in KNOBS[type(config)]:
        label += f" {name}" if getattr(config, name) else ""
    return label


def config_from_dict(cls: type, data: dict[str, Any]):
    """Builds a config from a mapping, naming any unknown or non-integer field. A field left out
    takes its default (a knob left out is off: `FwdConfig.to_dict`).

    Raises:
        ValueError: an unknown key or a value that is not a positive int (or 0, for a field whose
            metadata allows it: `DecodeConfig.num_splits`, the knobs of `KNOBS`).
    """
    minimum = {f.name: f.metadata.get("minimum", 1) for f in fields(cls)}
    unknown = sorted(set(data) - set(minimum))
    if unknown:
        raise ValueError(f"{cls.__name__}: unknown field(s) {unknown}; expected a subset of {sorted(minimum)}")
    for name, value in data.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum[name]:
            wanted = "a positive int" if minimum[name] == 1 else f"an int >= {minimum[name]}"
            raise ValueError(f"{cls.__name__}.{name}: expected {wanted}, got {value!r}")
    return cls(**data)


# -- search spaces ------------------------------------------------------------------------------

DIRECTIONS = ("fwd", "bwd")  # the prefill kernels' (compile-check and the CUDA backend cover these)
# Every direction with tunable configs: the prefill pair, and the short-query forward (calls
# without gradient of at most MAX_DECODE_QUERIES query rows), a table key's `direction`
TUNED_DIRECTIONS = (*DIRECTIONS, "decode")
CONFIG_CLASSES = {"fwd": FwdConfig, "bwd": BwdConfig, "decode": DecodeConfig}
# Arch families with their own search-space section, and how a compute capability maps to one.
ARCH_FAMILIES = ("sm80", "sm86_89", "sm90", "sm120")


def arch_family(major: int, minor: int) -> str:
    """The search-space section for a compute capability (e.g. (9, 0) -> "sm90")."""
    if major == 8:
        return "sm80" if minor == 0 else "sm86_89"
    if major == 9:
        return "sm90"
    if major >= 10:
        return "sm120"
    raise ValueError(f"compute capability {major}.{minor} is older than sm80 (Ampere); not supported")


def expand_grid(direction: str, axes: dict[str, list[int]], where: str) -> list[FwdConfig | BwdConfig | DecodeConfig]:
    """The Cartesian product of `axes` as configs of `direction` (field order of the dataclass).
    Every tunable is an axis; a kernel knob (`KNOBS`) may be left out, and is then off.

    Raises:
        ValueError: a missing or unknown key, or a value that is not a positive int (names `where`).
    """
    cls = CONFIG_CLASSES[direction]
    names = [f.name for f in fields(cls)]
    missing = [n for n in cls().to_dict() if n not in axes]
    if missing:
        raise ValueError(f"{where}: missing key(s) {missing}; expected {names}")
    grid: list[dict[str, int]] = [{}]
    for name in (n for n in names if n in axes):
        values = axes[name] if isinstance(axes[name], list) else [axes[name]]
        grid = [dict(point, **{name: value}) for point in grid for value in values]
    try:
        return [config_from_dict(cls, point) for point in grid]
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None


# -- table keys ---------------------------------------------------------------------------------

OPERAND_KINDS = ("none", "full", "kv_head", "per_key", "shared")


def operand_kind(dims: tuple[int, int, int, int] | None, num_heads: int, num_heads_kv: int, seqlen_q: int) -> str:
    """Names a mask/bias layout from its 4-D broadcast dims (b, h, lq, lk).

    none: absent; per_key: no query dim (a key-only padding mask, or a (B, Hkv|1, 1, Lk) bias);
    full: one slice per query head; kv_head: one per KV head (GQA); shared: one for all heads.
    """
    if dims is None:
        return "none"
    _, heads, rows, _ = dims
    if rows == 1 and seqlen_q > 1:
        return "per_key"
    if heads == num_heads:
        return "full"
    if heads == num_heads_kv:
        return "kv_head"
    return "shared"


def bias_has_rows(kind: str) -> bool:
    """Whether a bias (or mask) of this kind (`operand_kind`, "+grad" allowed) has a query-row dim: its
    kernels load (and a backward with dBias stores) a tile per block instead of a row vector, so
    their best tiles differ (the learned defaults are grouped by it)."""
    return kind.removesuffix("+grad") in ("full", "kv_head", "shared")


def is_valid_head_dim(head_dim: int) -> bool:
    """The contract's head dims (docs/CONTRACT.md §1): any D <= MAX_HEAD_DIM (256) that is a multiple of 8."""
    return head_dim % 8 == 0 and 8 <= head_dim <= MAX_HEAD_DIM


def seqlen_bucket(seqlen: int) -> int:
    """The power-of-two bucket of a sequence length (nearest in log distance, ties up)."""
    if seqlen <= 1:
        return 1
    low = 1 << (seqlen.bit_length() - 1)
    high = low << 1
    return low if seqlen / low < high / seqlen else high


def window_bucket(window_size: tuple[int, int], is_causal: bool) -> int:
    """A table key's `window`: 0 without a sliding window, else `seqlen_bucket` of the span of
    keys a row sees, left + right + 1 (right is 0 under causal: the causal rule already bounds
    that side); with one side unbounded (-1, not causal), of the bounded side's reach + 1.

    Why the span, bucketed like the lengths: a windowed call's speed is driven by the key tiles
    each query tile visits, about (span + block_m) / block_n of them whatever the sequence length,
    so a long sequence with a short window runs like many short sequences (more programs, each
    with a short loop), not like a long one; the lengths still set how many programs there are.
    Its best tiles follow the span as they follow a length (a small span wastes a large key
    tile's columns at both window edges), and powers of two keep the keys a table holds few.
    """
    left, right = window_size
    if is_causal:  # the causal rule bounds the right side at the diagonal (FlashAttention's right = 0)
        return 0 if left < 0 else seqlen_bucket(left + 1)
    if left < 0 and right < 0:
        return 0
    if left < 0 or right < 0:
        # one side bounded (not causal): the kernels still run the window's code, so the key is
        # a window's too, bucketed by the bounded side's reach, and no dense entry serves it
        return seqlen_bucket(max(left, right) + 1)
    return seqlen_bucket(left + right + 1)


# A key field with a default is written only when it differs from it (`TableKey.to_dict`), so a
# table or journal written before the field reads, and is written back, unchanged.
KEY_DEFAULTS = {"packed": False, "window": 0}


@dataclass(frozen=True)
class TableKey:
    """The categorical and bucketed key of a dispatch-table entry (DESIGN §3).

    `packed` and `window` are categories of their own (`categorical`): packed sequences and a
    sliding window run other kernel code (VARLEN, HAS_WINDOW) and other loop bounds than a dense
    call, so an entry of one never serves a call of another. A packed call's length buckets are
    those of its longest sequences (max_seqlen_q, max_seqlen_k): they set its grid.
    """

    direction: str  # fwd | bwd | decode (`TUNED_DIRECTIONS`)
    dtype: str
    head_dim: int
    causal: bool
    mask: str
    bias: str  # in the bwd direction a bias with grad gets "+grad" (dBias changes the kernel)
    gqa_ratio: int
    seqlen_q_bucket: int
    seqlen_k_bucket: int
    packed: bool = False  # packed sequences (a varlen call)
    window: int = 0  # 0: no sliding window; else `window_bucket` of its span

    def categorical(self) -> tuple:
        return (self.direction, self.dtype, self.head_dim, self.causal, self.mask, self.bias, self.gqa_ratio,
                self.packed, self.window)

    def to_dict(self) -> dict[str, Any]:
        """The key's fields, those of `KEY_DEFAULTS` only where they differ from their default."""
        return {name: value for name, value in asdict(self).items()
                if name not in KEY_DEFAULTS or value != KEY_DEFAULTS[name]}

    def label(self) -> str:
        """What sets the key apart from a dense call's, for labels: " packed", " window 1024", both, or ""."""
        return (" packed" if self.packed else "") + (f" window {self.window}" if self.window else "")


def key_problem(backend: str, key: TableKey, config: FwdConfig | BwdConfig | None = None) -> str | None:
    """Why `backend` cannot run a call of `key` (None: it can): with no `config`, whatever the
    config; with one, that config. The backends' `is_supported` judge a config on an
    `AttentionShape`, which has no packed sequences or window; the key has, so the tuner, the
    validator, table loading and `tiles.choose` ask here. A window needs the CUDA forward's overlapped
    kernel or the warp-specialized backward, and so do packed sequences, with a per-key mask and
    bias or none (judged as on sm90: the GPU's arch is the launcher's check)."""
    if backend != "cuda" or not (key.packed or key.window):
        return None
    # imported on first use: the CUDA launchers' rules, which only a CUDA packed or window key needs
    from dmattn_kernels.cuda.variants import backward_feature_reason, backward_packed_reason, forward_packed_reason

    if key.packed:
        reason = backward_packed_reason(bias_has_rows(key.mask), bias_has_rows(key.bias))
        if reason:
            return reason
    if config is None:
        return None
    if key.direction != "fwd":
        feature = "a packed call" if key.packed else "a sliding window"
        return backward_feature_reason(config, key.head_dim, "sm90", feature)
    if key.packed:
        return forward_packed_reason(config, key.head_dim, "sm90")
    if not config.overlap:
        return "a sliding window runs in the CUDA forward's overlapped warp-specialized kernel only (overlap=1)"
    return None
