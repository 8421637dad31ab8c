"""The dispatch table: one YAML file per device mapping shape keys to a tuned backend and config.

Layout (DESIGN §3)::

    schema_version: 2
    created: '2025-01-01T00:00:00+00:00'
    device: {name, compute_capability, sm_count, shared_memory_per_block}
    software: {torch, triton, cuda, driver, dmattn_bench}
    validated:                  # per backend and dtype: the last validation its entries passed
      triton:
        bf16: {kernel_hash: 'sha256:...', date: '2025-01-02T00:00:00+00:00', suite: full}
    interpreter: false
    entries:
    - key: {direction, dtype, head_dim, causal, mask, bias, gqa_ratio, seqlen_q_bucket, seqlen_k_bucket}
      backend: triton
      config: {block_m, block_n, num_warps, num_stages}
      timed: {kernel_hash: 'sha256:...', date: '2025-01-01T00:00:00+00:00'}  # when its evidence was measured
      evidence: {median_ms, tflops, speedup_vs_default, ...}

`kernel_hash` is `registry.kernel_source_hash` of the entry's backend. A table is current for a
backend when every dtype of that backend's entries was validated on the installed kernels' hash:
the tuner validates what it writes (its adversarial suite, usually `quick`), and
`dmattn-bench verify --suite full --restamp` re-validates a table on new kernel sources
(`restamp`) without touching its timings, which keep the hash and date they were measured on.

Schema 1 had one `kernel_hashes: {backend: hash}` map, stamped at tuning; it is read as that
hash for every validation and timing, dated `created`, suite `quick` (the tuner's default).

A table is data from disk, possibly hand-edited or from another version: it is read with
`yaml.safe_load` only, size-capped before parsing, and every field is checked so that a bad file
fails with one line naming the file and the field.
"""

from __future__ import annotations

import datetime as _dt
import fcntl
import os
import tempfile
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

import yaml

from dmattn_bench.hardware import DeviceFingerprint, software_versions
from dmattn_bench.registry import BACKEND_NAMES, kernel_source_hash
from dmattn_bench import space
from dmattn_bench.space import (CONFIG_CLASSES, OPERAND_KINDS, TUNED_DIRECTIONS, BwdConfig, DecodeConfig, FwdConfig,
                                TableKey)

SCHEMA_VERSION = 2
READABLE_SCHEMAS = (1, 2)  # 1: one `kernel_hashes` map, converted on load (module docstring)
SUITES = ("quick", "full")  # the adversarial suites a validation can name (`adversarial.SUITES`)
# Real tables hold hundreds of entries (~100 KiB); the cap keeps a wrong or hostile file from
# costing the YAML parser (pure Python per node) minutes and gigabytes.
MAX_TABLE_BYTES = 16 * 1024 * 1024
DTYPES = tuple(space.DTYPES)  # the spellings of `dmattn-bench verify --dtype`
GRAD_SUFFIX = "+grad"  # a bwd bias with grad: dBias changes the kernel, so it is its own key

TOP_KEYS = ("schema_version", "created", "device", "software", "validated", "interpreter", "entries")
TOP_KEYS_V1 = ("schema_version", "created", "device", "software", "kernel_hashes", "interpreter", "entries")
DEVICE_KEYS = tuple(f.name for f in fields(DeviceFingerprint))
KEY_KEYS = tuple(f.name for f in fields(TableKey))
ENTRY_KEYS = ("key", "backend", "config", "timed", "evidence")
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
    """A validation a backend's entries of one dtype passed: on which kernel sources, when, and
    with which adversarial suite (`quick` or `full`)."""

    kernel_hash: str
    date: str
    suite: str


@dataclass(frozen=True)
class Entry:
    """One tuned choice: for shapes matching `key`, run `backend` with `config`.

    Attributes:
        key: the categorical key and the sequence-length buckets it was tuned at.
        backend: a name of `registry.BACKEND_NAMES`.
        config: FwdConfig, BwdConfig or DecodeConfig, as `key.direction` says.
        evidence: measurements behind the choice (median_ms, tflops, speedup_vs_default, ...).
        timed: the kernel sources and date of those measurements (None until `new_table` stamps it).
    """

    key: TableKey
    backend: str
    config: FwdConfig | BwdConfig | DecodeConfig
    evidence: dict
    timed: Timing | None = None


@dataclass(frozen=True)
class Table:
    """A parsed dispatch table (see the module docstring for the file layout).

    `schema_version` is the file's; an older one was converted on load and is written back as
    `SCHEMA_VERSION`. `validated[backend][dtype]` is the last validation that backend's entries
    of that dtype passed.
    """

    schema_version: int
    created: str
    device: DeviceFingerprint
    software: dict
    validated: dict[str, dict[str, Validation]]
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


def _key(doc: Any, where: str) -> TableKey:
    doc = _mapping(doc, where, KEY_KEYS)
    direction = _str(doc["direction"], f"{where}.direction", TUNED_DIRECTIONS)
    bias = _str(doc["bias"], f"{where}.bias")
    base = bias.removesuffix(GRAD_SUFFIX)
    if base not in OPERAND_KINDS:
        raise _Bad(f"{where}.bias",
                   f"expected one of {list(OPERAND_KINDS)}, optionally with {GRAD_SUFFIX!r}, got {bias!r}")
    if bias != base and (direction != "bwd" or base == "none"):
        raise _Bad(f"{where}.bias",
                   f"{GRAD_SUFFIX!r} only applies to a present bias in the bwd direction, got {bias!r}")
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
    )


def _date(value: Any, where: str) -> str:
    if isinstance(value, (_dt.date, _dt.datetime)):  # an unquoted timestamp parses as a datetime
        value = value.isoformat()
    return _str(value, where)


def _timing(doc: Any, where: str) -> Timing:
    doc = _mapping(doc, where, tuple(f.name for f in fields(Timing)))
    return Timing(kernel_hash=_str(doc["kernel_hash"], f"{where}.kernel_hash"),
                  date=_date(doc["date"], f"{where}.date"))


def _validated(doc: Any) -> dict[str, dict[str, Validation]]:
    validated = {}
    for backend, per_dtype in _mapping(doc, "validated", None).items():
        _str(backend, "validated", BACKEND_NAMES)
        validated[backend] = {}
        for dtype, record in _mapping(per_dtype, f"validated.{backend}", None).items():
            where = f"validated.{backend}.{dtype}"
            _str(dtype, f"validated.{backend}", DTYPES)
            record = _mapping(record, where, tuple(f.name for f in fields(Validation)))
            validated[backend][dtype] = Validation(
                kernel_hash=_str(record["kernel_hash"], f"{where}.kernel_hash"),
                date=_date(record["date"], f"{where}.date"),
                suite=_str(record["suite"], f"{where}.suite", SUITES),
            )
    return validated


def _entry(doc: Any, where: str, v1_stamp: dict[str, Timing] | None) -> Entry:
    """An entry; a schema-1 entry has no `timed` and gets its backend's `v1_stamp`."""
    doc = _mapping(doc, where, ENTRY_KEYS if v1_stamp is None else ENTRY_KEYS_V1)
    key = _key(doc["key"], f"{where}.key")
    cls = CONFIG_CLASSES[key.direction]
    # Every tunable is written out: a table must not depend on this version's dataclass defaults.
    tunables = {f.name: f for f in fields(cls)}
    config = _mapping(doc["config"], f"{where}.config", tuple(tunables))
    values = {name: _int(value, f"{where}.config.{name}", tunables[name].metadata.get("minimum", 1))
              for name, value in config.items()}
    backend = _str(doc["backend"], f"{where}.backend", BACKEND_NAMES)
    if key.direction == "decode" and backend != "triton":
        raise _Bad(f"{where}.backend", f"got {backend!r} for a decode entry, expected 'triton' (the short-query "
                                       f"forward is a Triton kernel)")
    return Entry(
        key=key,
        backend=backend,
        config=cls(**values),
        evidence=_plain(_mapping(doc["evidence"], f"{where}.evidence", None), f"{where}.evidence"),
        timed=_timing(doc["timed"], f"{where}.timed") if v1_stamp is None else v1_stamp[backend],
    )


def _table(doc: Any) -> Table:
    if not isinstance(doc, dict):
        raise _Bad("(top level)", f"expected a mapping, got {type(doc).__name__} {_show(doc)}")
    # The version is checked before anything else: a newer layout says so instead of failing on a field.
    version = doc.get("schema_version", SCHEMA_VERSION)
    if not isinstance(version, int) or isinstance(version, bool) or version not in READABLE_SCHEMAS:
        raise _Bad("schema_version", f"unknown schema version {_show(version)} "
                                     f"(this dmattn-bench reads {' and '.join(map(str, READABLE_SCHEMAS))})")
    doc = _mapping(doc, "(top level)", TOP_KEYS if version == SCHEMA_VERSION else TOP_KEYS_V1)
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
    else:
        validated, v1_stamp = _validated(doc["validated"]), None
    if not isinstance(doc["entries"], list):
        raise _Bad("entries", f"expected a list, got {type(doc['entries']).__name__} {_show(doc['entries'])}")
    entries = tuple(_entry(item, f"entries[{i}]", v1_stamp) for i, item in enumerate(doc["entries"]))
    seen: dict[TableKey, int] = {}
    for i, entry in enumerate(entries):
        if entry.key in seen:
            raise _Bad(f"entries[{i}].key", f"duplicate of entries[{seen[entry.key]}].key (one choice per key)")
        seen[entry.key] = i
    if version == 1:
        validated = {}
        for entry in entries:
            if entry.backend in hashes:
                validated.setdefault(entry.backend, {})[entry.key.dtype] = Validation(
                    hashes[entry.backend], created, "quick")
    return Table(
        schema_version=version,
        created=created,
        device=_device(doc["device"]),
        software=software,
        validated=validated,
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


# -- writing ------------------------------------------------------------------------------------

def _sort_key(entry: Entry) -> tuple:
    key = entry.key
    return key.categorical() + (key.seqlen_q_bucket, key.seqlen_k_bucket)


def table_to_dict(table: Table) -> dict:
    """The YAML document of a table in this version's schema (plain types, fixed key order,
    entries sorted by key)."""
    return {
        "schema_version": SCHEMA_VERSION,
        "created": table.created,
        "device": table.device.to_dict(),
        "software": dict(sorted(table.software.items())),
        "validated": {backend: {dtype: asdict(record) for dtype, record in sorted(per_dtype.items())}
                      for backend, per_dtype in sorted(table.validated.items())},
        "interpreter": table.interpreter,
        "entries": [
            {"key": entry.key.to_dict(), "backend": entry.backend, "config": entry.config.to_dict(),
             "timed": None if entry.timed is None else asdict(entry.timed),
             "evidence": dict(sorted(entry.evidence.items()))}
            for entry in sorted(table.entries, key=_sort_key)
        ],
    }


@contextmanager
def _directory_lock(path: Path):
    """Writers of tables in one directory take turns (the rename alone is already atomic for
    readers; the lock keeps two writers from racing, and a read-modify-write from losing another
    writer's change) and leave no lock file behind."""
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        fcntl.flock(directory, fcntl.LOCK_EX)
        yield
    finally:
        os.close(directory)  # releases the lock


def _write(table: Table, path: Path) -> None:
    """Writes `table` to `path` through a temporary file and a rename; the caller holds the lock."""
    # Validate first: never write a file this version could not read back. Dumping the validated
    # copy also turns str/float subclasses (TorchVersion, numpy.float64) into plain YAML types.
    doc = table_to_dict(table_from_dict(table_to_dict(table), str(path)))
    header = (f"# dmattn-bench dispatch table (schema {SCHEMA_VERSION}) for {table.device.name} "
              f"sm{table.device.compute_capability.replace('.', '')}; see `dmattn-bench show {path.name}`\n")
    text = header + yaml.safe_dump(doc, sort_keys=False, default_flow_style=False, width=120)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; a table is meant to be shared and committed
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def dump_table(table: Table, path: str | os.PathLike) -> None:
    """Writes `table` to `path` atomically (a reader sees the old file or the new one, never half).

    Raises:
        TableError: the table does not validate (nothing is written).
        OSError: the directory is not writable.
    """
    path = Path(path)
    with _directory_lock(path):
        _write(table, path)


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


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def new_table(entries, device: DeviceFingerprint, interpreter: bool, suite: str = "quick") -> Table:
    """A table for `entries` stamped with now (UTC), this software and the current kernel hashes.

    The tuner validated every entry before choosing it, so each backend and dtype of the entries
    is recorded as validated now on the current kernels with `suite` (the tuner's adversarial
    suite); an entry not yet `timed` is stamped as measured now on them.
    """
    created, entries = _now(), tuple(entries)
    hashes = {backend: kernel_source_hash(backend) for backend in sorted({e.backend for e in entries})}
    entries = tuple(entry if entry.timed is not None else replace(entry, timed=Timing(hashes[entry.backend], created))
                    for entry in entries)
    validated: dict[str, dict[str, Validation]] = {}
    for entry in entries:
        validated.setdefault(entry.backend, {})[entry.key.dtype] = Validation(hashes[entry.backend], created, suite)
    return Table(
        schema_version=SCHEMA_VERSION,
        created=created,
        device=device,
        software={name: None if value is None else str(value) for name, value in software_versions().items()},
        validated=validated,
        interpreter=bool(interpreter),
        entries=entries,
    )


def merged(kept: Table, tuned: Table) -> Table:
    """`tuned` plus the entries of `kept` whose keys it does not hold (a tune of some keys added
    to a table of others: `dmattn-bench tune --merge`).

    A backend and dtype with entries from both keeps the weaker validation of the two: `kept`'s
    when it was on other kernel sources (its entries, and the new ones with them, then wait for
    `verify --restamp`), else the `quick` one, else the older; so a merge never records entries
    as more validated than they were.

    Raises:
        TableError: the two tables are of different devices, or one is an interpreter table.
    """
    if kept.device != tuned.device or kept.interpreter != tuned.interpreter:
        raise TableError(f"cannot merge a table of {kept.device.name}{' (interpreter)' if kept.interpreter else ''} "
                         f"into one of {tuned.device.name}{' (interpreter)' if tuned.interpreter else ''}")
    tuned_keys = {entry.key for entry in tuned.entries}
    carried = tuple(entry for entry in kept.entries if entry.key not in tuned_keys)
    validated = {backend: dict(per_dtype) for backend, per_dtype in tuned.validated.items()}
    for backend, dtype in {(entry.backend, entry.key.dtype) for entry in carried}:
        old = kept.validated.get(backend, {}).get(dtype)
        per_dtype = validated.setdefault(backend, {})
        new = per_dtype.get(dtype)
        if old is None:  # an unvalidated entry leaves its backend and dtype unvalidated
            per_dtype.pop(dtype, None)
        elif new is None or new.kernel_hash != old.kernel_hash:
            per_dtype[dtype] = old
        else:
            per_dtype[dtype] = min(old, new, key=lambda v: (v.suite == "full", v.date))
    return replace(tuned, entries=tuned.entries + carried, validated=validated)


def _choices(entries, backend: str, dtype: str) -> set[tuple]:
    return {(e.key, e.config) for e in entries if e.backend == backend and e.key.dtype == dtype}


def restamp(path: str | os.PathLike, verified, dtype: str, suite: str, kernel_hashes: dict[str, str]) -> Table:
    """Records in the table at `path` that its `dtype` entries of each backend in `verified` passed
    `suite` on the kernel sources of `kernel_hashes` (taken before they ran), dated now.

    Read, changed and written under the directory's lock, atomically; entries and their timings
    are left as they are. Nothing is written unless the file still holds, for each such backend,
    exactly the `dtype` entries (keys and configs) that were verified.

    Returns:
        the table as written.

    Raises:
        TableError: the file no longer reads as a table, or its verified entries changed meanwhile.
        OSError: the directory is not writable.
    """
    path = Path(path)
    verified = tuple(verified)
    with _directory_lock(path):
        table = load_table(path)
        validated = {backend: dict(per_dtype) for backend, per_dtype in table.validated.items()}
        date = _now()
        for backend in sorted({e.backend for e in verified}):
            if _choices(table.entries, backend, dtype) != _choices(verified, backend, dtype):
                raise TableError(f"{path}: its {backend} {dtype} entries changed while they were verified; "
                                 f"verify the table again")
            validated.setdefault(backend, {})[dtype] = Validation(kernel_hashes[backend], date, suite)
        table = replace(table, validated=validated)
        _write(table, path)
    return table
