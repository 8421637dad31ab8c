"""Dispatch tables: the YAML schema and its reader (`table`) and run-time selection (`lookup`). The
writer, imported only by the tuner and the CLI, lives with the tuner (`dmattn_bench.tuning.table_writer`).

Imported by the attention call path, so nothing here imports click, rich or pytest, nor the writer.
"""

from dmattn_bench.dispatch.lookup import (
    DISPATCHER,
    ENV_VAR,
    Choice,
    Dispatcher,
    DispatchWarning,
    clear_cache,
    use_table,
)
from dmattn_bench.dispatch.table import (
    MAX_TABLE_BYTES,
    SCHEMA_VERSION,
    Entry,
    Table,
    TableError,
    Timing,
    Validation,
    load_table,
    table_from_dict,
)

__all__ = [
    "DISPATCHER", "ENV_VAR", "MAX_TABLE_BYTES", "SCHEMA_VERSION", "Choice", "DispatchWarning", "Dispatcher",
    "Entry", "Table", "TableError", "Timing", "Validation", "clear_cache", "load_table", "table_from_dict",
    "use_table",
]
