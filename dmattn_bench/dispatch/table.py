"""The dispatch table: one YAML file per device mapping shape keys to a tuned backend and config.

Layout (DESIGN §3)::

    schema_version: 3
    created: '2025-01-01T00:00:00+00:00'
    device: {name, compute_capability, sm_count, shared_memory_per_block}
    software: {torch, triton, cuda, driver, dmattn_bench}
    interpreter: false
    entries:
    - key: {direction, dtype, head_dim, causal, mask, bias, gqa_ratio, seqlen_q_bucket, seqlen_k_bucket}
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
(`restamp`) without touching their timings; `verify --declare-stale` marks, without a GPU, the
entries whose code changed since their validation.

Schema 2 recorded one validation per backend and dtype, on `registry.kernel_source_hash` (the
whole sources of the backend): each entry reads it as its own, with the stamp
`source:<hash>`, current while that hash is the installed sources'. Schema 1 had one
`kernel_hashes: {backend: hash}` map, stamped at tuning; it is read as that hash for every
validation and timing, dated `created`, suite `quick` (the tuner's default).

A table is data from disk, possibly hand-edited or from another version: it is read with
`yaml.safe_load` only, size-capped before parsing, and every field is checked so that a bad file
fails with one line naming the file and the field. An entry whose config has the right fields
but values no kernel could run (`space._check_fields`: a `block_m` of 24) is kept as an
`InvalidConfig`: the table still loads, the lookup skips the entry with a warning
(`stamps.entry_status` says "invalid"), `show` lists it and `verify` fails on it.
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
from dmattn_bench.registry import BACKEND_NAMES
from dmattn_bench import space
from dmattn_bench.space import (CONFIG_CLASSES, OPERAND_KINDS, TUNED_DIRECTIONS, BwdConfig, DecodeConfig, FwdConfig,
                                InvalidConfig, TableKey)

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
        "interpreter": table.interpreter,
        "entries": [
            {"key": entry.key.to_dict(), "backend": entry.backend, "config": entry.config.to_dict(),
             "validated": None if entry.validated is None else asdict(entry.validated), "stale": entry.stale,
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
    """A table for `entries` stamped with now (UTC) and this software.

    The tuner validated every entry before choosing it, on the code installed here, so each is
    recorded as validated now with `suite` (the tuner's adversarial suite) on its stamp; an entry
    not yet `timed` is recorded as measured now on that code.
    """
    from dmattn_bench.dispatch.stamps import stamp_of

    created = _now()
    stamped = []
    for entry in entries:
        stamp = stamp_of(entry, device)
        stamped.append(replace(entry, validated=Validation(stamp, created, suite), stale=None,
                               timed=entry.timed or Timing(stamp, created)))
    return Table(
        schema_version=SCHEMA_VERSION,
        created=created,
        device=device,
        software={name: None if value is None else str(value) for name, value in software_versions().items()},
        interpreter=bool(interpreter),
        entries=tuple(stamped),
    )


def merged(kept: Table, tuned: Table) -> Table:
    """`tuned` plus the entries of `kept` whose keys it does not hold (a tune of some keys added
    to a table of others: `dmattn-bench tune --merge`).

    Each entry keeps its own validation and staleness, so a merge never records an entry as more
    validated than it was.

    Raises:
        TableError: the two tables are of different devices, or one is an interpreter table.
    """
    if kept.device != tuned.device or kept.interpreter != tuned.interpreter:
        raise TableError(f"cannot merge a table of {kept.device.name}{' (interpreter)' if kept.interpreter else ''} "
                         f"into one of {tuned.device.name}{' (interpreter)' if tuned.interpreter else ''}")
    tuned_keys = {entry.key for entry in tuned.entries}
    carried = tuple(entry for entry in kept.entries if entry.key not in tuned_keys)
    return replace(tuned, entries=tuned.entries + carried)


def restamp(path: str | os.PathLike, stamped: dict, suite: str) -> Table:
    """Records in the table at `path` that each entry of `stamped` ({entry: its stamp, taken
    before it ran}) passed `suite`, dated now, and is no longer stale.

    Read, changed and written under the directory's lock, atomically; other entries and every
    timing are left as they are. Nothing is written unless the file still holds each verified
    entry (key, backend and config) as it was verified.

    Returns:
        the table as written.

    Raises:
        TableError: the file no longer reads as a table, or a verified entry changed meanwhile.
        OSError: the directory is not writable.
    """
    path = Path(path)
    with _directory_lock(path):
        table = load_table(path)
        date = _now()
        wanted = {(e.key, e.backend, e.config): stamp for e, stamp in stamped.items()}
        held = {(e.key, e.backend, e.config) for e in table.entries}
        if not set(wanted) <= held:
            raise TableError(f"{path}: some verified entries changed while they were verified; verify the table again")
        entries = tuple(replace(e, validated=Validation(wanted[(e.key, e.backend, e.config)], date, suite), stale=None)
                        if (e.key, e.backend, e.config) in wanted else e for e in table.entries)
        table = replace(table, entries=entries)
        _write(table, path)
    return table


def declare_stale(path: str | os.PathLike, reason: str) -> tuple[Table, int]:
    """Declares stale, with `reason`, the entries of the table at `path` whose code changed since
    their validation (`stamps.entry_status`), for a change that lands while their GPU cannot
    re-validate them. Computed without a GPU; written atomically under the directory's lock.

    Returns:
        the table as written and how many entries were newly declared stale.
    """
    from dmattn_bench.dispatch.stamps import entry_status

    path = Path(path)
    with _directory_lock(path):
        table = load_table(path)
        changed = 0
        entries = []
        for entry in table.entries:
            if entry.stale is None and entry_status(entry, table.device) == "stale":
                entry, changed = replace(entry, stale=reason), changed + 1
            entries.append(entry)
        table = replace(table, entries=tuple(entries))
        if changed:
            _write(table, path)
    return table, changed
