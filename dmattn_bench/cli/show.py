"""`dmattn-bench show TABLE`: what a dispatch table holds and whether it is usable here."""

from __future__ import annotations

import click
from rich.table import Table as RichTable

from dmattn_bench import output
from dmattn_bench.dispatch.lookup import kernel_hash_status, most_similar, validation_status
from dmattn_bench.dispatch.table import SCHEMA_VERSION, Table, TableError, load_table, table_to_dict
from dmattn_bench.errors import DmattnError
from dmattn_bench.space import CONFIG_CLASSES, config_label
from dmattn_bench.workloads import load_workloads

KEY_COLUMNS = ("direction", "dtype", "head_dim", "causal", "mask", "bias", "gqa_ratio",
               "seqlen_q_bucket", "seqlen_k_bucket")
KEY_HEADERS = ("dir", "dtype", "D", "causal", "mask", "bias", "gqa", "Lq", "Lk")
# Evidence shown as columns, with their formats; the rest stays in `--format json`.
EVIDENCE_COLUMNS = (("median_ms", "{:.4g}"), ("tflops", "{:.1f}"), ("speedup_vs_default", "{:.2f}x"))


def _evidence(value) -> str:
    return "-" if value is None else str(value)


def _summary(path: str, table: Table, status: dict[str, dict[str, str]]) -> RichTable:
    summary = RichTable(title=f"dispatch table {path}", show_header=False)
    summary.add_column("key")
    summary.add_column("value")
    converted = f" (read as {SCHEMA_VERSION})" if table.schema_version != SCHEMA_VERSION else ""
    summary.add_row("schema_version", f"{table.schema_version}{converted}")
    summary.add_row("created", table.created)
    summary.add_row("device", ", ".join(f"{k}={v}" for k, v in table.device.to_dict().items()))
    summary.add_row("interpreter", "yes (timings not meaningful)" if table.interpreter else "no")
    summary.add_row("software", ", ".join(f"{k}={v}" for k, v in sorted(table.software.items())))
    for backend, per_dtype in status.items():
        records = table.validated.get(backend, {})
        for dtype, state in per_dtype.items():
            record = records.get(dtype)
            seen = "never" if record is None else f"{record.kernel_hash}, {record.date}, {record.suite} suite"
            summary.add_row(f"validated {backend} {dtype}", f"{seen} ({state})")
    summary.add_row("entries", str(len(table.entries)))
    return summary


def _entries(doc: dict) -> RichTable:
    entries = RichTable(title="entries")
    for header in KEY_HEADERS + ("backend", "config") + tuple(name for name, _ in EVIDENCE_COLUMNS):
        entries.add_column(header, justify="right" if header in ("D", "gqa", "Lq", "Lk") else "left")
    for entry in doc["entries"]:  # table_to_dict has sorted them by key
        key, evidence = entry["key"], entry["evidence"]
        cells = [str(key[name]) for name in KEY_COLUMNS]
        config_class = CONFIG_CLASSES[key["direction"]]
        cells += [entry["backend"], config_label(config_class(**entry["config"]))]
        for name, fmt in EVIDENCE_COLUMNS:
            value = evidence.get(name)
            is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
            cells.append(fmt.format(value) if is_number else _evidence(value))
        entries.add_row(*cells)
    return entries


COVERAGE_KINDS = ("exact", "nearest bucket", "similar entry", "default", "default (stale table)")


def coverage(table: Table, workloads_path: str, grid: str, stale: set[str] = frozenset()) -> list[dict]:
    """How the run-time lookup would serve each (workload, direction) of a grid from `table`:
    "exact" (an entry with the same key), "nearest bucket" (same categorical key, other
    sequence-length buckets), "similar entry" (an entry of other categories one step away,
    `lookup.most_similar`), "default" (nothing that close: the default config), or
    "default (stale table)" (an entry exists but the table is stale for its backend: not
    validated on the installed kernels, so the lookup skips it). Whether the table belongs to
    this GPU is not considered: coverage is about the grid the table was tuned for."""
    usable = [entry for entry in table.entries if entry.backend not in stale]
    keys, categories = {e.key for e in usable}, {e.key.categorical() for e in usable}
    stale_categories = {e.key.categorical() for e in table.entries if e.backend in stale}
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
                served = "default (stale table)" if key.categorical() in stale_categories else "default"
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
    status = kernel_hash_status(table)
    per_dtype = validation_status(table)
    doc = {"path": table_path, "kernel_hash_status": status, "validation_status": per_dtype, **table_to_dict(table)}
    tables = [_summary(table_path, table, per_dtype), _entries(doc)]
    if coverage_path is not None:
        try:
            rows = coverage(table, coverage_path, grid, {name for name, state in status.items() if state == "stale"})
        except ValueError as exc:
            raise click.BadParameter(str(exc).splitlines()[0], param_hint="--coverage/--grid") from None
        counts = coverage_counts(rows)
        doc["coverage"] = {"workloads": coverage_path, "grid": grid, "keys": rows, "counts": counts}
        tables.append(_coverage_table(rows, counts, f"{coverage_path}:{grid}"))
    output.render(doc, tables, fmt)
