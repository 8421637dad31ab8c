"""Run-time lookup of a dispatch table's entry for a shape key (DESIGN §3); `dmattn_bench.tiles`
falls back to the defaults where this finds none.

A table is chosen by, in order: a `table=` argument to `table_choice` or `use_table(path)`; the
`DMATTN_BENCH_TABLE` environment variable; the table shipped in `results/tables/` for this device.
A table that cannot be used (unreadable, invalid, tuned on another device) never breaks a call:
it is skipped with one `DispatchWarning` per (file, reason) per process, and the next source is
tried. Within a table, only current entries are used (`stamps.entry_status`: validated on the
code installed here and not declared stale); a stale or unvalidated one is passed over for the
nearest current one, with one warning per table. An entry's status is computed when the lookup
first reaches it (its stamp costs tens of milliseconds), so a call pays for the entries near its
key only.

Within the chosen table: the entries of the key's categories (direction, dtype, head dim, causal,
mask, bias, GQA ratio, packed, window span), at the nearest sequence-length buckets (log2
distance); without any, the entry most similar to the key (`similarity_distance`) within
`SIMILAR_WITHIN`, among those of the same head dim, mask and bias kinds and GQA-or-not, whose
configs run for the key as for their own: one step in the causal flag or the GQA ratio, or two
octaves of window span. A packed call and a dense one, or a windowed call and one without a
window, never stand in for each other (`similarity_distance` is None across them): they run
other kernel code and other loop bounds. A key with nothing that close gets no entry
(the default, silently). Each rule's regret on held-out keys is printed by
`python -m benchmarks selection-regret` (each tuned key of the committed sm90 journals held out
in turn, the other keys of its journal standing in for a table).

Answers are memoised per (table selection, device, key) until `clear_cache()` or `use_table()`,
so a repeated lookup costs a dict lookup (a few µs). Edit a table in a running process? Call
`clear_cache()`: parsed tables are re-read only if their (mtime_ns, size) changed.
"""

from __future__ import annotations

import math
import os
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dmattn_bench.dispatch.stamps import STATUSES, entry_status
from dmattn_bench.dispatch.table import Entry, Table, TableError, load_table
from dmattn_bench.hardware import DeviceFingerprint, device_fingerprint
from dmattn_bench.space import BwdConfig, DecodeConfig, FwdConfig, TableKey

ENV_VAR = "DMATTN_BENCH_TABLE"
READ_ENV = object()  # sentinel: table_choice() reads the environment itself


def _shipped_tables_dir() -> Path:
    """Tables committed from real GPUs (`results/tables/`, named `<DeviceFingerprint.slug()>.yaml`):
    package data `dmattn_bench/tables/` when installed from a wheel, read in place in a source
    checkout (editable install)."""
    package = Path(__file__).resolve().parents[1]  # dmattn_bench/
    packaged = package / "tables"
    return packaged if packaged.is_dir() else package.parent / "results" / "tables"


SHIPPED_TABLES_DIR = _shipped_tables_dir()  # read at call time, so tests can point it elsewhere


class DispatchWarning(UserWarning):
    """A dispatch table or entry was skipped (unreadable, invalid, foreign or stale); a fallback was used."""


@dataclass(frozen=True)
class Choice:
    """What to run for a key.

    Attributes:
        backend: a name of `registry.BACKEND_NAMES`.
        config: FwdConfig, BwdConfig or DecodeConfig, matching the key's direction.
        source: "table:<path>", "default" or "explicit".
    """

    backend: str
    config: FwdConfig | BwdConfig | DecodeConfig
    source: str


@dataclass(frozen=True)
class _Usable:
    """A parsed table reduced to what lookup needs: its entries grouped by categorical key, and
    each entry's status (`stamps.entry_status`) once it was needed."""

    table: Table
    by_category: dict[tuple, tuple[Entry, ...]]
    status: dict[int, str]  # by id() of the entry (entries hold dicts: not hashable)

    def is_current(self, entry: Entry) -> bool:
        state = self.status.get(id(entry))
        if state is None:
            state = self.status[id(entry)] = entry_status(entry, self.table.device)
        return state == "current"


# Weights of `similarity_distance` per key field: per octave of head dim, GQA ratio and length
# bucket, per differing kind or flag. Head dim decides the tiles' register and shared-memory use.
# A window's span counts as a length bucket does (both set the key tiles a query tile visits).
SIMILARITY_WEIGHTS = dict(head_dim=2.0, gqa_ratio=0.5, mask=1.0, bias=1.0, causal=0.5, seqlen=0.25, window=0.25)
# How similar an entry of other categories must be to stand in for a key (`most_similar`): 0.5
# lets the causal flag or one octave of GQA ratio differ at the same length buckets. Chosen on
# the held-out journal keys of `python -m benchmarks selection-regret`, where 0 (categories only) and
# 1.0 each gave a worse worst-case regret.
SIMILAR_WITHIN = 0.5


def similarity_distance(a: TableKey, b: TableKey) -> float | None:
    """Distance between two keys by `SIMILARITY_WEIGHTS`; None across directions or dtypes, between
    a packed and a dense key, and between a key with a window and one without (module docstring)."""
    if a.direction != b.direction or a.dtype != b.dtype or a.packed != b.packed or (a.window > 0) != (b.window > 0):
        return None
    octaves = lambda x, y: abs(math.log2(x / y))  # noqa: E731
    weights = SIMILARITY_WEIGHTS
    return (weights["head_dim"] * octaves(a.head_dim, b.head_dim)
            + weights["gqa_ratio"] * octaves(a.gqa_ratio, b.gqa_ratio)
            + weights["mask"] * (a.mask != b.mask) + weights["bias"] * (a.bias != b.bias)
            + weights["causal"] * (a.causal != b.causal)
            + weights["seqlen"] * (octaves(a.seqlen_q_bucket, b.seqlen_q_bucket)
                                   + octaves(a.seqlen_k_bucket, b.seqlen_k_bucket))
            + (weights["window"] * octaves(a.window, b.window) if a.window else 0.0))


def _runs_alike(key: TableKey, other: TableKey) -> bool:
    """Whether a config that runs for `other` runs for `key`: the same head dim (the tiles' shared
    memory and registers grow with its power-of-two block), mask and bias kinds (their loads and
    a dBias), and GQA on both or neither (under GQA the backward sums dK/dV shares, or for a
    bias with rows and fewer heads runs one program per kv head)."""
    return (key.head_dim == other.head_dim and key.mask == other.mask and key.bias == other.bias
            and (key.gqa_ratio > 1) == (other.gqa_ratio > 1))


def most_similar(key: TableKey, entries) -> Entry | None:
    """Among the entries whose configs run for `key` as for their own (`_runs_alike`), the one
    nearest by `similarity_distance` if within `SIMILAR_WITHIN` (ties: larger buckets, as in
    `nearest`), else None."""
    scored = [(distance, -e.key.seqlen_q_bucket, -e.key.seqlen_k_bucket, index, e) for index, e in enumerate(entries)
              if _runs_alike(key, e.key) and (distance := similarity_distance(key, e.key)) is not None
              and distance <= SIMILAR_WITHIN]
    return min(scored)[-1] if scored else None


def by_category(entries) -> dict[tuple, tuple[Entry, ...]]:
    """`entries` grouped by `TableKey.categorical`, each group in the entries' order."""
    groups: dict[tuple, list[Entry]] = {}
    for entry in entries:
        groups.setdefault(entry.key.categorical(), []).append(entry)
    return {category: tuple(group) for category, group in groups.items()}


def table_entry(key: TableKey, by_category: dict[tuple, tuple[Entry, ...]], is_current=None) -> Entry | None:
    """The entry a table (its entries grouped by `TableKey.categorical`) offers `key`: one of its
    categories at the nearest lengths, else the most similar one within reach, else None; only
    entries `is_current` accepts (all where None), asked nearest first."""
    def first_current(pick, entries):
        entries = list(entries)
        while entries:
            entry = pick(key, entries)
            if entry is None or is_current is None or is_current(entry):
                return entry
            entries.remove(entry)
        return None

    matches = by_category.get(key.categorical())
    entry = first_current(nearest, matches) if matches else None
    if entry is not None:
        return entry
    return first_current(most_similar, [entry for group in by_category.values() for entry in group])


def _log_distance(key: TableKey, entry: Entry) -> float:
    return (abs(math.log2(key.seqlen_q_bucket) - math.log2(entry.key.seqlen_q_bucket))
            + abs(math.log2(key.seqlen_k_bucket) - math.log2(entry.key.seqlen_k_bucket)))


def nearest(key: TableKey, entries: tuple[Entry, ...]) -> Entry:
    """The entry whose buckets are closest to `key`'s in log2 distance; ties go to larger buckets.

    Larger wins a tie because a config tuned for longer sequences keeps more programs busy on a
    shorter one than the reverse loses (an assumption, not yet measured).
    """
    return min(entries, key=lambda e: (_log_distance(key, e), -e.key.seqlen_q_bucket, -e.key.seqlen_k_bucket))


def status_counts(table: Table) -> dict[str, int]:
    """How many of the table's entries are current, stale (declared or by their stamp),
    unvalidated and invalid (`stamps.entry_status`; computes every entry's stamp)."""
    counts = {state: 0 for state in STATUSES}
    for entry in table.entries:
        counts[entry_status(entry, table.device)] += 1
    return counts


class Dispatcher:
    """Finds a table's entry per key; holds the caches and the warned set."""

    def __init__(self) -> None:
        self._explicit: str | None = None
        self._choices: dict[tuple, Choice | None] = {}
        self._tables: dict[str, tuple[tuple[int, int], _Usable | str]] = {}
        self._fingerprints: dict[Any, DeviceFingerprint] = {}
        self._warned: set[tuple[str, str]] = set()
        self._lock = threading.Lock()  # slow path only: loads, warnings
        self.generation = 0  # bumped whenever a choice made before may change (`dmattn_bench.plan` keys on it)

    # -- public -----------------------------------------------------------------------------

    def use_table(self, path: str | os.PathLike | None) -> None:
        """Selects `path` ahead of the environment and shipped tables; None clears the selection.

        The file is read at the next `table_choice`; calling this again with the same path re-reads it.
        """
        self._explicit = os.fspath(path) if path is not None else None
        self._choices.clear()
        self.generation += 1

    def clear_cache(self) -> None:
        """Forgets memoised choices, parsed tables and fingerprints (not the warnings already given)."""
        self._choices.clear()
        self._tables.clear()
        self._fingerprints.clear()
        self.generation += 1

    def table_choice(self, key: TableKey, device: torch.device | str | None = None, *,
                     table: str | os.PathLike | None = None, env: str | None | object = READ_ENV) -> Choice | None:
        """The table entry's backend and config to run `key` with on `device`, None where no
        table has a current entry near it (`dmattn_bench.tiles.choose` then takes the default).

        Args:
            key: the shape key (buckets from `space.seqlen_bucket`).
            device: where the call runs (None: the current CUDA device, else the CPU interpreter).
            table: a table file that takes precedence over every other source for this call.
            env: the value of DMATTN_BENCH_TABLE when the caller already read it.

        Never raises because of a table.
        """
        requested = os.fspath(table) if table is not None else self._explicit
        if env is READ_ENV:
            env = os.environ.get(ENV_VAR)
        memo = (requested, env or None, device, key)
        if memo not in self._choices:
            self._choices[memo] = self._table_choice(key, device, requested, memo[1])
        return self._choices[memo]

    def active_table(self, device: torch.device | str | None = None) -> str | None:
        """The table a call would consult first on `device` (None: the defaults only)."""
        local = self._fingerprint(device)
        for path, must_exist in self._sources(local, self._explicit, os.environ.get(ENV_VAR) or None):
            if (must_exist or os.path.exists(path)) and self._usable(path, local) is not None:
                return path
        return None

    # -- slow path ----------------------------------------------------------------------------

    @staticmethod
    def _sources(local: DeviceFingerprint, requested: str | None, env: str | None) -> list[tuple[str, bool]]:
        """Candidate tables in precedence order, each with whether it must exist."""
        shipped = SHIPPED_TABLES_DIR / f"{local.slug()}.yaml"
        ordered = [(requested, True), (env, True), (os.fspath(shipped), False)]
        unique: dict[str, bool] = {}
        for path, must_exist in ordered:
            if path is not None and path not in unique:
                unique[path] = must_exist
        return list(unique.items())

    def _fingerprint(self, device) -> DeviceFingerprint:
        fingerprint = self._fingerprints.get(device)
        if fingerprint is None:
            fingerprint = self._fingerprints[device] = device_fingerprint(device)
        return fingerprint

    def _table_choice(self, key: TableKey, device, requested: str | None, env: str | None) -> Choice | None:
        local = self._fingerprint(device)
        for path, must_exist in self._sources(local, requested, env):
            if not must_exist and not os.path.exists(path):
                continue  # most devices have no shipped table: nothing to warn about
            usable = self._usable(path, local)
            if usable is None:
                continue
            entry = table_entry(key, usable.by_category, lambda e: self._is_current(path, usable, e))
            if entry is None:
                return None  # the chosen table has nothing current near this key: the default
            return Choice(entry.backend, entry.config, f"table:{path}")
        return None

    def _usable(self, path: str, local: DeviceFingerprint) -> _Usable | None:
        """The table at `path` if it can be used here, else None after warning once."""
        loaded = self._load(path)
        if isinstance(loaded, str):
            self._warn(path, "invalid", f"dispatch table ignored: {loaded}")
            return None
        device = loaded.table.device
        if device != local:
            self._warn(path, "foreign", f"dispatch table {path} ignored: tuned on {device.name} "
                       f"(sm{device.compute_capability}, {device.sm_count} SMs), this is {local.name} "
                       f"(sm{local.compute_capability}, {local.sm_count} SMs); re-tune with `dmattn-bench tune`")
            return None
        if not loaded.by_category:
            return None  # no entries: as if there were no table here
        return loaded

    def _is_current(self, path: str, usable: _Usable, entry: Entry) -> bool:
        """Whether `entry` may be used; warns once per table when one may not."""
        if usable.is_current(entry):
            return True
        state = usable.status[id(entry)]
        if state == "invalid":
            why = f"its config cannot run ({entry.config.problem})"
        elif entry.stale:
            why = f"declared stale ({entry.stale})"
        else:
            why = "never validated" if state == "unvalidated" else "validated on other code than is installed here"
        self._warn(path, "invalid" if state == "invalid" else "stale",
                   f"dispatch table {path}: entry {entry.key.direction} {entry.key.dtype} D{entry.key.head_dim}"
                   f"{entry.key.label()} "
                   f"({entry.backend}) skipped, {why}; the nearest current entry or the default runs instead "
                   f"(`dmattn-bench show {path}` counts them; on its GPU, "
                   f"`dmattn-bench verify --table {path} --suite full --restamp` re-validates them)")
        return False

    def _load(self, path: str) -> _Usable | str:
        """Parses `path` (cached by mtime and size); a string is the reason it cannot be used."""
        try:
            stat = os.stat(path)
        except OSError as exc:
            return f"{path}: cannot read: {exc.strerror or exc}"
        signature = (stat.st_mtime_ns, stat.st_size)
        cache_key = os.path.abspath(path)
        cached = self._tables.get(cache_key)
        if cached is not None and cached[0] == signature:
            return cached[1]
        try:
            table = load_table(path)
        except TableError as exc:
            result: _Usable | str = str(exc)
        except Exception as exc:  # noqa: BLE001 - a table must never break an attention call
            result = f"{path}: {type(exc).__name__}: {exc}"
        else:
            result = _Usable(table, by_category(table.entries), {})
        self._tables[cache_key] = (signature, result)
        return result

    def _warn(self, path: str, reason: str, message: str) -> None:
        with self._lock:
            if (path, reason) in self._warned:
                return
            self._warned.add((path, reason))
        # stacklevel 5: _warn, _usable (or _is_current), _table_choice, Dispatcher.table_choice, then its caller.
        warnings.warn(message, DispatchWarning, stacklevel=5)


DISPATCHER = Dispatcher()


def table_choice(key: TableKey, device: torch.device | str | None = None, *,
                 table: str | os.PathLike | None = None, env: str | None | object = READ_ENV) -> Choice | None:
    """`DISPATCHER.table_choice`: the table entry's backend and config for `key` on `device`."""
    return DISPATCHER.table_choice(key, device, table=table, env=env)


def use_table(path: str | os.PathLike | None) -> None:
    """Selects the table every later call uses first (None: back to env var / shipped / default)."""
    DISPATCHER.use_table(path)


def clear_cache() -> None:
    """Forgets memoised choices and parsed tables (e.g. after rewriting a table in this process)."""
    DISPATCHER.clear_cache()
