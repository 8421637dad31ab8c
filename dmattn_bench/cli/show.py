"""`dmattn-bench show TABLE`: what a dispatch table holds and whether it is usable here."""

from __future__ import annotations

import click
from rich.table import Table as RichTable

from dmattn_bench import output
from dmattn_bench.dispatch.lookup import most_similar
from dmattn_bench.dispatch.stamps import STATUSES, entry_status
from dmattn_bench.dispatch.table import SCHEMA_VERSION, Table, TableError, load_table
from dmattn_bench.errors import DmattnError
from dmattn_bench.space import KEY_DEFAULTS, InvalidConfig, TableKey, config_label
from dmattn_bench.tuning.table_writer import table_to_dict
from dmattn_bench.tuning.workloads import load_workloads

KEY_COLUMNS = ("direction", "dtype", "head_dim", "causal", "mask", "bias", "gqa_ratio",
               "seqlen_q_bucket", "seqlen_k_bucket", "packed", "window")
KEY_HEADERS = ("dir", "dtype", "D", "causal", "mask", "bias", "gqa", "Lq", "Lk", "packed", "window")
# Evidence shown as columns, with their formats; the rest stays in `--format json`.
EVIDENCE_COLUMNS = (("median_ms", "{:.4g}"), ("tflops", "{:.1f}"), ("speedup_vs_default", "{:.2f}x"))


def _evidence(value) -> str:
    return "-" if value is None else str(value)


def _summary(path: str, table: Table, counts: dict[str, int]) -> RichTable:
    summary = RichTable(title=f"dispatch table {path}", show_header=False)
    summary.add_column("key")
    summary.add_column("value")
    converted = f" (read as {SCHEMA_VERSION})" if table.schema_version != SCHEMA_VERSION else ""
    summary.add_row("schema_version", f"{table.schema_version}{converted}")
    summary.add_row("created", table.created)
    summary.add_row("device", ", ".join(f"{k}={v}" for k, v in table.device.to_dict().items()))
    summary.add_row("interpreter", "yes (timings not meaningful)" if table.interpreter else "no")
    summary.add_row("software", ", ".join(f"{k}={v}" for k, v in sorted(table.software.items())))
    summary.add_row("entries", f"{len(table.entries)}: " + ", ".join(f"{n} {state}" for state, n in counts.items()))
    declared = sum(entry.stale is not None for entry in table.entries)
    summary.add_row("declared stale", f"{declared} (the runtime skips every entry that is not current)")
    return summary


def _entries(doc: dict) -> RichTable:
    entries = RichTable(title="entries")
    for header in KEY_HEADERS + ("backend", "config", "status") + tuple(name for name, _ in EVIDENCE_COLUMNS):
        entries.add_column(header, justify="right" if header in ("D", "gqa", "Lq", "Lk", "window") else "left")
    for entry in doc["entries"]:  # table_to_dict has sorted them by key
        key, evidence = entry["key"], entry["evidence"]
        cells = [str(key.get(name, KEY_DEFAULTS.get(name))) for name in KEY_COLUMNS]
        status = entry["status"] + (f" ({entry['problem']})" if "problem" in entry else "")
        cells += [entry["backend"], entry["config_label"], status]
        for name, fmt in EVIDENCE_COLUMNS:
            value = evidence.get(name)
            is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
            cells.append(fmt.format(value) if is_number else _evidence(value))
        entries.add_row(*cells)
    return entries


COVERAGE_KINDS = ("exact", "nearest bucket", "similar entry", "default", "default (stale entries)")


def coverage(table: Table, workloads_path: str, grid: str, stale: set = frozenset()) -> list[dict]:
    """How the run-time lookup would serve each (workload, direction) of a grid from `table`:
    "exact" (an entry with the same key), "nearest bucket" (same categorical key, other
    sequence-length buckets), "similar entry" (an entry of other categories one step away,
    `lookup.most_similar`), "default" (nothing that close: the default config), or
    "default (stale entries)" (entries of its category exist but are `stale`, ids of entries
    that are not current, so the lookup skips them). Whether the table belongs to this GPU is not considered: coverage is about the
    grid the table was tuned for."""
    usable = [entry for entry in table.entries if id(entry) not in stale]
    keys, categories = {e.key for e in usable}, {e.key.categorical() for e in usable}
    stale_categories = {e.key.categorical() for e in table.entries if id(e) in stale}
    rows = []
    for workload in load_workloads(workloads_path, grid):
        for direction in workload.directions():
            key = workload.key(direction)
            if key in keys:
                served = "exact"
            elif key.categorical() in categories:
                served = "nearest bucket"
            elif most_similar(key, usable) is not None:
                served = "similar entry"
            else:
                served = "default (stale entries)" if key.categorical() in stale_categories else "default"
            rows.append({"workload": workload.label, "direction": direction, "served_by": served})
    return rows


def coverage_counts(rows: list[dict]) -> dict[str, int]:
    return {kind: sum(r["served_by"] == kind for r in rows) for kind in COVERAGE_KINDS}


def _coverage_table(rows: list[dict], counts: dict[str, int], source: str) -> RichTable:
    table = RichTable(title=f"coverage of {source}")
    for column in ("workload", "direction", "served by"):
        table.add_column(column)
    for row in rows:
        table.add_row(row["workload"], row["direction"], row["served_by"])
    table.caption = f"{len(rows)} keys: " + ", ".join(f"{counts[kind]} {kind}" for kind in COVERAGE_KINDS)
    return table


@click.command()
@click.argument("table_path", metavar="TABLE", type=click.Path(exists=True, dir_okay=False))
@click.option("--coverage", "coverage_path", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Also report how the table serves each key of this workloads YAML (e.g. configs/workloads/default.yaml).")
@click.option("--grid", default="default", show_default=True, help="Grid of the --coverage file.")
@click.option("--format", "fmt", type=click.Choice(output.FORMATS), default="human", show_default=True,
              help="Result format on stdout.")
def show(table_path: str, coverage_path: str | None, grid: str, fmt: str) -> None:
    """Summarise the dispatch table TABLE: device, software, validations and entries."""
    grid_given = click.get_current_context().get_parameter_source("grid") is not click.core.ParameterSource.DEFAULT
    if grid_given and coverage_path is None:
        raise click.BadParameter("names a grid of the --coverage file: pass --coverage too", param_hint="--grid")
    try:
        table = load_table(table_path)
    except TableError as exc:
        raise DmattnError(str(exc), fix="fix the field or re-create the table with `dmattn-bench tune`") from None
    status = {id(entry): entry_status(entry, table.device) for entry in table.entries}
    counts = {state: sum(s == state for s in status.values()) for state in STATUSES}
    doc = {"path": table_path, "status_counts": counts, **table_to_dict(table)}
    by_key = {entry.key: entry for entry in table.entries}
    for item in doc["entries"]:
        entry = by_key[TableKey(**item["key"])]
        item["status"], item["config_label"] = status[id(entry)], config_label(entry.config)
        if isinstance(entry.config, InvalidConfig):
            item["problem"] = entry.config.problem
    tables = [_summary(table_path, table, counts), _entries(doc)]
    if coverage_path is not None:
        try:
            rows = coverage(table, coverage_path, grid, {id(e) for e in table.entries if status[id(e)] != "current"})
        except ValueError as exc:
            raise click.BadParameter(str(exc).splitlines()[0], param_hint="--coverage/--grid") from None
        counts = coverage_counts(rows)
        doc["coverage"] = {"workloads": coverage_path, "grid": grid, "keys": rows, "counts": counts}
        tables.append(_coverage_table(rows, counts, f"{coverage_path}:{grid}"))
    output.render(doc, tables, fmt)
