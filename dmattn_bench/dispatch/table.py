"""The dispatch table: one YAML file per device mapping shape keys to a tuned backend and config.

Layout (DESIGN §3)::

    schema_version: 3
    created: '2025-01-01T00:00:00+00:00'
    device: {name, compute_capability, sm_count, shared_memory_per_block}
    software: {torch, triton, cuda, driver, dmattn_bench}
    interpreter: false
    entries:
    - key: {direction, dtype, head_dim, causal, mask, bias, gqa_ratio, seqlen_q_bucket, seqlen_k_bucket}
             # and, only where set: packed: true (packed sequences), window: 1024 (a sliding window's span bucket)
      backend: triton
      config: {block_m, block_n, num_warps, num_stages}
      validated: {stamp: 'sha256:...', date: '2025-01-02T00:00:00+00:00', suite: full}  # the last validation it passed
      stale: null               # or why its GPU could not re-validate it after a change of its code
      timed: {kernel_hash: 'sha256:...', date: '2025-01-01T00:00:00+00:00'}  # when its evidence was measured
      evidence: {median_ms, tflops, speedup_vs_default, ...}

An entry's `stamp` is the fingerprint of the code it runs (`stamps.entry_stamp`), taken before
the validation it records ran. An entry is current while that stamp equals the installed code's
and it is not declared `stale` (`stamps.entry_status`); the lookup uses current entries only.
The tuner validates what it writes (its adversarial suite, usually `quick`);
`dmattn-bench verify --suite full --restamp` re-validates the entries that are not current
(`writer.restamp`) without touching their timings; `verify --declare-stale` marks, without a GPU, the
entries whose code changed since their validation.

A key's `packed` and `window` (`space.TableKey`) are written only where set, so a table of dense
keys is the schema-3 file it was before they existed and reads unchanged; a reader that predates
them rejects a table holding such keys by naming the field, never misreads one as dense. No
schema bump: nothing a schema-3 reader accepts changes meaning.

Schema 2 recorded one validation per backend and dtype, on `registry.kernel_source_hash` (the
whole sources of the backend): each entry reads it as its own, with the stamp
`source:<hash>`, current while that hash is the installed sources'. Schema 1 had one
`kernel_hashes: {backend: hash}` map, stamped at tuning; it is read as that hash for every
validation and timing, dated `created`, suite `quick` (the tuner's default).

This module reads tables (the runtime's part); `writer` writes them (the tuner's and the CLI's).

A table is data from disk, possibly hand-edited or from another version: it is read with
`yaml.safe_load` only, size-capped before parsing, and every field is checked so that a bad file
fails with one line naming the file and the field. An entry whose config has the right fields
but values no kernel could run (`space._check_fields`: a `block_m` of 24) is kept as an
`InvalidConfig`: the table still loads, the lookup skips the entry with a warning
(`stamps.entry_status` says "invalid"), `show` lists it and `verify` fails on it.
"""

from __future__ import annotations

import datetime as _dt
import os
from dataclasses import dataclass, fields, replace
from typing import Any

import yaml

from dmattn_bench.hardware import DeviceFingerprint
from dmattn_bench.registry import BACKEND_NAMES
from dmattn_bench import space
from dmattn_bench.space import (CONFIG_CLASSES, OPERAND_KINDS, TUNED_DIRECTIONS, BwdConfig, DecodeConfig, FwdConfig,
                                InvalidConfig, TableKey, key_problem)

SCHEMA_VERSION = 3
READABLE_SCHEMAS = (1, 2, 3)  # 1 and 2: per-backend validations, converted on load (module docstring)
LEGACY_PREFIX = "source:"  # the stamp of a validation read from schema 1 or 2: a backend's source hash
SUITES = ("quick", "full")  # the adversarial suites a validation can name (`adversarial.SUITES`)
# Real tables hold hundreds of entries (~100 KiB); the cap keeps a wrong or hostile file from
# costing the YAML parser (pure Python per node) minutes and gigabytes.
MAX_TABLE_BYTES = 16 * 1024 * 1024
DTYPES = tuple(space.DTYPES)  # the spellings of `dmattn-bench verify --dtype`
GRAD_SUFFIX = "+grad"  # a bwd bias with grad: dBias changes the kernel, so it is its own key

TOP_KEYS = ("schema_version", "created", "device", "software", "interpreter", "entries")
TOP_KEYS_V2 = ("schema_version", "created", "device", "software", "validated", "interpreter", "entries")
TOP_KEYS_V1 = ("schema_version", "created", "device", "software", "kernel_hashes", "interpreter", "entries")
DEVICE_KEYS = tuple(f.name for f in fields(DeviceFingerprint))
KEY_KEYS = tuple(f.name for f in fields(TableKey))
ENTRY_KEYS = ("key", "backend", "config", "validated", "stale", "timed", "evidence")
ENTRY_KEYS_V2 = ("key", "backend", "config", "timed", "evidence")
ENTRY_KEYS_V1 = ("key", "backend", "config", "evidence")


class TableError(ValueError):
    """A table that cannot be used; the message is one line: `FILE: FIELD: what is wrong`."""


@dataclass(frozen=True)
class Timing:
    """The kernel sources (`registry.kernel_source_hash`) and the date an entry's evidence was measured on."""

    kernel_hash: str
    date: str


@dataclass(frozen=True)
class Validation:
    """A validation an entry passed: on which code (its stamp, `stamps.entry_stamp`, or a
    schema-2 `source:<hash>`), when, and with which adversarial suite (`quick` or `full`)."""

    stamp: str
    date: str
    suite: str


@dataclass(frozen=True)
class Entry:
    """One tuned choice: for shapes matching `key`, run `backend` with `config`.

    Attributes:
        key: the categorical key and the sequence-length buckets it was tuned at.
        backend: a name of `registry.BACKEND_NAMES`.
        config: FwdConfig, BwdConfig or DecodeConfig, as `key.direction` says (an InvalidConfig
            where the file's values fail its checks).
        evidence: measurements behind the choice (median_ms, tflops, speedup_vs_default, ...).
        timed: the kernel sources and date of those measurements (None until `new_table` stamps it).
        validated: the last validation it passed (None: never validated).
        stale: why it is declared stale (its code changed and its GPU could not re-validate it), else None.
    """

    key: TableKey
    backend: str
    config: FwdConfig | BwdConfig | DecodeConfig | InvalidConfig
    evidence: dict
    timed: Timing | None = None
    validated: Validation | None = None
    stale: str | None = None

    def __hash__(self) -> int:
        # `evidence` is a dict, so the generated hash would raise: an entry hashes as what it runs
        # (equal entries run the same), which lets `restamp` take {entry: stamp}
        return hash((self.key, self.backend, self.config))


@dataclass(frozen=True)
class Table:
    """A parsed dispatch table (see the module docstring for the file layout).

    `schema_version` is the file's; an older one was converted on load and is written back as
    `SCHEMA_VERSION`.
    """

    schema_version: int
    created: str
    device: DeviceFingerprint
    software: dict
    interpreter: bool
    entries: tuple[Entry, ...]


# -- validation ---------------------------------------------------------------------------------

class _Bad(Exception):
    """A field error before the file name is known: (field path, message)."""

    def __init__(self, where: str, message: str):
        super().__init__(where, message)
        self.where, self.message = where, message


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _mapping(value: Any, where: str, required: tuple[str, ...] | None) -> dict:
    """`value` as a dict; with `required`, exactly those keys."""
    if not isinstance(value, dict):
        raise _Bad(where, f"expected a mapping, got {type(value).__name__} {_show(value)}")
    if required is not None:
        unknown = sorted(str(k) for k in value if k not in required)
        if unknown:
            raise _Bad(where, f"unknown key(s) {unknown}; expected {list(required)}")
        missing = [k for k in required if k not in value]
        if missing:
            raise _Bad(where, f"missing key(s) {missing}")
    return value


def _int(value: Any, where: str, minimum: int = 1) -> int:
    # bool is an int subclass; `causal: true` in an int slot is a mistake, not 1.
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        kind = "a positive int" if minimum == 1 else f"an int >= {minimum}"
        raise _Bad(where, f"expected {kind}, got {_show(value)}")
    return value


def _bucket(value: Any, where: str) -> int:
    value = _int(value, where)
    if value & (value - 1):
        raise _Bad(where, f"expected a power of two (sequence lengths are bucketed by seqlen_bucket), got {value}")
    return value


def _str(value: Any, where: str, choices: tuple[str, ...] | None = None) -> str:
    if not isinstance(value, str) or not value:
        raise _Bad(where, f"expected a non-empty string, got {_show(value)}")
    if choices is not None and value not in choices:
        raise _Bad(where, f"expected one of {list(choices)}, got {value!r}")
    return value


def _bool(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise _Bad(where, f"expected true or false, got {_show(value)}")
    return value


def _plain(value: Any, where: str) -> Any:
    """Checks that evidence is plain YAML data (so dump/load round-trips it unchanged)."""
    # Subclasses (TorchVersion, numpy.float64) become their base type: safe_dump refuses them.
    if value is None or isinstance(value, bool):
        return value
    for base in (int, float, str):
        if isinstance(value, base):
            return base(value)
    if isinstance(value, list):
        return [_plain(item, f"{where}[{i}]") for i, item in enumerate(value)]
    if isinstance(value, dict):
        for name in value:
            if not isinstance(name, str):
                raise _Bad(where, f"expected string keys, got {_show(name)}")
        return {name: _plain(item, f"{where}.{name}") for name, item in value.items()}
    raise _Bad(where, f"expected a number, string, list or mapping, got {type(value).__name__}")


def _device(doc: Any) -> DeviceFingerprint:
    doc = _mapping(doc, "device", DEVICE_KEYS)
    capability = doc["compute_capability"]
    if isinstance(capability, float):  # a hand-written `9.0` parses as a float
        capability = str(capability)
    capability = _str(capability, "device.compute_capability")
    major, _, minor = capability.partition(".")
    if not (major.isdigit() and minor.isdigit()):
        raise _Bad("device.compute_capability", f"expected 'MAJOR.MINOR' like '9.0', got {capability!r}")
    return DeviceFingerprint(
        name=_str(doc["name"], "device.name"),
        compute_capability=capability,
        sm_count=_int(doc["sm_count"], "device.sm_count", minimum=0),  # 0 on the CPU interpreter
        shared_memory_per_block=_int(doc["shared_memory_per_block"], "device.shared_memory_per_block", minimum=0),
    )


def _window(value: Any, where: str) -> int:
    value = _int(value, where, minimum=0)
    if value & (value - 1):
        raise _Bad(where, f"expected 0 (no window) or a power of two (spans are bucketed by seqlen_bucket), "
                          f"got {value}")
    return value


def _key(doc: Any, where: str) -> TableKey:
    # a field of `space.KEY_DEFAULTS` left out takes its default (a dense call's)
    doc = _mapping({**space.KEY_DEFAULTS, **_mapping(doc, where, None)}, where, KEY_KEYS)
    direction = _str(doc["direction"], f"{where}.direction", TUNED_DIRECTIONS)
    bias = _str(doc["bias"], f"{where}.bias")
    base = bias.removesuffix(GRAD_SUFFIX)
    if base not in OPERAND_KINDS:
        raise _Bad(f"{where}.bias",
                   f"expected one of {list(OPERAND_KINDS)}, optionally with {GRAD_SUFFIX!r}, got {bias!r}")
    if bias != base and (direction != "bwd" or base == "none"):
        raise _Bad(f"{where}.bias",
                   f"{GRAD_SUFFIX!r} only applies to a present bias in the bwd direction, got {bias!r}")
    packed = _bool(doc["packed"], f"{where}.packed")
    if packed and direction == "decode":
        raise _Bad(f"{where}.packed", "got true for a decode entry, expected false (packed sequences run the "
                                      "prefill kernels, never the short-query forward)")
    return TableKey(
        direction=direction,
        dtype=_str(doc["dtype"], f"{where}.dtype", DTYPES),
        head_dim=_int(doc["head_dim"], f"{where}.head_dim"),
        causal=_bool(doc["causal"], f"{where}.causal"),
        mask=_str(doc["mask"], f"{where}.mask", OPERAND_KINDS),
        bias=bias,
        gqa_ratio=_int(doc["gqa_ratio"], f"{where}.gqa_ratio"),
        seqlen_q_bucket=_bucket(doc["seqlen_q_bucket"], f"{where}.seqlen_q_bucket"),
        seqlen_k_bucket=_bucket(doc["seqlen_k_bucket"], f"{where}.seqlen_k_bucket"),
        packed=packed,
        window=_window(doc["window"], f"{where}.window"),
    )


def _date(value: Any, where: str) -> str:
    if isinstance(value, (_dt.date, _dt.datetime)):  # an unquoted timestamp parses as a datetime
        value = value.isoformat()
    return _str(value, where)


def _timing(doc: Any, where: str) -> Timing:
    doc = _mapping(doc, where, tuple(f.name for f in fields(Timing)))
    return Timing(kernel_hash=_str(doc["kernel_hash"], f"{where}.kernel_hash"),
                  date=_date(doc["date"], f"{where}.date"))


def _legacy_validated(doc: Any) -> dict[str, dict[str, Validation]]:
    """Schema 2's per-backend, per-dtype validations, each on the stamp `source:<hash>`."""
    validated = {}
    for backend, per_dtype in _mapping(doc, "validated", None).items():
        _str(backend, "validated", BACKEND_NAMES)
        validated[backend] = {}
        for dtype, record in _mapping(per_dtype, f"validated.{backend}", None).items():
            where = f"validated.{backend}.{dtype}"
            _str(dtype, f"validated.{backend}", DTYPES)
            record = _mapping(record, where, ("kernel_hash", "date", "suite"))
            validated[backend][dtype] = Validation(
                stamp=LEGACY_PREFIX + _str(record["kernel_hash"], f"{where}.kernel_hash"),
                date=_date(record["date"], f"{where}.date"),
                suite=_str(record["suite"], f"{where}.suite", SUITES),
            )
    return validated


def _validation(doc: Any, where: str) -> Validation | None:
    if doc is None:
        return None
    record = _mapping(doc, where, tuple(f.name for f in fields(Validation)))
    return Validation(stamp=_str(record["stamp"], f"{where}.stamp"), date=_date(record["date"], f"{where}.date"),
                      suite=_str(record["suite"], f"{where}.suite", SUITES))


def _entry(doc: Any, where: str, version: int, v1_stamp: dict[str, Timing] | None) -> Entry:
    """An entry; a schema-1 entry has no `timed` and gets its backend's `v1_stamp`; the
    validation of a schema-1 or -2 entry is filled in by `_table`."""
    doc = _mapping(doc, where, {1: ENTRY_KEYS_V1, 2: ENTRY_KEYS_V2}.get(version, ENTRY_KEYS))
    key = _key(doc["key"], f"{where}.key")
    cls = CONFIG_CLASSES[key.direction]
    # Every tunable is written out (a table must not depend on this version's dataclass
    # defaults), but for a kernel knob left off, which `to_dict` omits: its off state is the
    # code the knob was added to (DESIGN §3).
    tunables = {f.name: f for f in fields(cls)}
    config = _mapping(doc["config"], f"{where}.config", None)
    unknown = sorted(str(name) for name in config if name not in tunables)
    missing = [name for name in cls().to_dict() if name not in config]
    if unknown or missing:
        raise _Bad(f"{where}.config", f"unknown key(s) {unknown}; expected {list(tunables)}" if unknown
                   else f"missing key(s) {missing}")
    values = {name: _int(value, f"{where}.config.{name}", tunables[name].metadata.get("minimum", 1))
              for name, value in config.items()}
    try:
        checked = cls(**values)
    except ValueError as exc:  # kept, so that `show` lists it and `verify` fails on it; never run
        checked = InvalidConfig(tuple(values.items()), str(exc))
    backend = _str(doc["backend"], f"{where}.backend", BACKEND_NAMES)
    if key.direction == "decode" and backend != "triton":
        raise _Bad(f"{where}.backend", f"got {backend!r} for a decode entry, expected 'triton' (the short-query "
                                       f"forward is a Triton kernel)")
    if key.packed or key.window:
        reason = key_problem(backend, key, None if isinstance(checked, InvalidConfig) else checked)
        if reason:
            raise _Bad(f"{where}.backend", f"got {backend!r} for a{key.label()} {key.direction} entry, but {reason}")
    return Entry(
        key=key,
        backend=backend,
        config=checked,
        evidence=_plain(_mapping(doc["evidence"], f"{where}.evidence", None), f"{where}.evidence"),
        timed=_timing(doc["timed"], f"{where}.timed") if v1_stamp is None else v1_stamp[backend],
        validated=_validation(doc["validated"], f"{where}.validated") if version >= 3 else None,
        stale=None if version < 3 or doc["stale"] is None else _str(doc["stale"], f"{where}.stale"),
    )


def _table(doc: Any) -> Table:
    if not isinstance(doc, dict):
        raise _Bad("(top level)", f"expected a mapping, got {type(doc).__name__} {_show(doc)}")
    # The version is checked before anything else: a newer layout says so instead of failing on a field.
    version = doc.get("schema_version", SCHEMA_VERSION)
    if not isinstance(version, int) or isinstance(version, bool) or version not in READABLE_SCHEMAS:
        raise _Bad("schema_version", f"unknown schema version {_show(version)} "
                                     f"(this dmattn-bench reads {' and '.join(map(str, READABLE_SCHEMAS))})")
    doc = _mapping(doc, "(top level)", {1: TOP_KEYS_V1, 2: TOP_KEYS_V2}.get(version, TOP_KEYS))
    created = _date(doc["created"], "created")
    software = {}
    for name, value in _mapping(doc["software"], "software", None).items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value = str(value)  # a hand-written `cuda: 12.4` parses as a number
        if not isinstance(name, str) or not (value is None or isinstance(value, str)):
            raise _Bad(f"software.{name}", f"expected a version string or null, got {_show(value)}")
        software[name] = None if value is None else str(value)  # torch's TorchVersion is a str subclass
    if version == 1:
        hashes = _mapping(doc["kernel_hashes"], "kernel_hashes", None)
        for name, value in hashes.items():
            _str(name, "kernel_hashes", BACKEND_NAMES)
            _str(value, f"kernel_hashes.{name}")
        # a backend schema 1 recorded no hash for matches no kernel sources: its entries are stale
        v1_stamp = {name: Timing(hashes.get(name, "unknown"), created) for name in BACKEND_NAMES}
        legacy = {name: {dtype: Validation(LEGACY_PREFIX + value, created, "quick") for dtype in DTYPES}
                  for name, value in hashes.items()}
    else:
        legacy = _legacy_validated(doc["validated"]) if version == 2 else {}
        v1_stamp = None
    if not isinstance(doc["entries"], list):
        raise _Bad("entries", f"expected a list, got {type(doc['entries']).__name__} {_show(doc['entries'])}")
    entries = tuple(_entry(item, f"entries[{i}]", version, v1_stamp) for i, item in enumerate(doc["entries"]))
    if version < 3:
        entries = tuple(replace(entry, validated=legacy.get(entry.backend, {}).get(entry.key.dtype))
                        for entry in entries)
    seen: dict[TableKey, int] = {}
    for i, entry in enumerate(entries):
        if entry.key in seen:
            raise _Bad(f"entries[{i}].key", f"duplicate of entries[{seen[entry.key]}].key (one choice per key)")
        seen[entry.key] = i
    return Table(
        schema_version=version,
        created=created,
        device=_device(doc["device"]),
        software=software,
        interpreter=_bool(doc["interpreter"], "interpreter"),
        entries=entries,
    )


def table_from_dict(doc: Any, source: str) -> Table:
    """Validates a parsed YAML document and builds the Table.

    Args:
        doc: what `yaml.safe_load` returned.
        source: the file name, used in error messages.

    Raises:
        TableError: `"{source}: {field path}: {problem}"` for the first bad field.
    """
    try:
        return _table(doc)
    except _Bad as bad:
        raise TableError(f"{source}: {bad.where}: {bad.message}") from None


def load_table(path: str | os.PathLike) -> Table:
    """Reads and validates a table file.

    Raises:
        TableError: missing, too large, not UTF-8, not safe YAML, or a bad field (one line).
    """
    source = str(path)
    try:
        size = os.stat(path).st_size
        if size > MAX_TABLE_BYTES:
            raise TableError(f"{source}: file is {size} bytes, over the {MAX_TABLE_BYTES}-byte limit for a table")
        with open(path, "rb") as handle:
            data = handle.read(MAX_TABLE_BYTES + 1)  # the file may have grown since stat
    except OSError as exc:
        raise TableError(f"{source}: cannot read: {exc.strerror or exc}") from None
    if len(data) > MAX_TABLE_BYTES:
        raise TableError(f"{source}: file is over the {MAX_TABLE_BYTES}-byte limit for a table")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise TableError(f"{source}: not UTF-8 text (byte {exc.start})") from None
    try:
        # safe_load only: a python/object tag in a table must fail, never construct or run anything.
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise TableError(f"{source}: not a valid YAML table ({where}{' '.join(str(problem).split())})") from None
    if doc is None:
        raise TableError(f"{source}: empty file (expected a dispatch table)")
    return table_from_dict(doc, source)
