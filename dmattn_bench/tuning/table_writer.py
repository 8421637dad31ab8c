"""Writing dispatch tables: the document of a table, atomic locked writes, a new table stamped
with its validation, merging, restamping and declaring entries stale. The tuner and the CLI use
it; the runtime only reads tables (`table`).
"""

from __future__ import annotations

import datetime as _dt
import fcntl
import os
import tempfile
from contextlib import contextmanager
from dataclasses import asdict, replace
from pathlib import Path

import yaml

from dmattn_bench.dispatch.table import (SCHEMA_VERSION, Entry, Table, TableError, Timing, Validation, load_table,
                                         table_from_dict)
from dmattn_bench.hardware import DeviceFingerprint, software_versions


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
