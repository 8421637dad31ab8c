"""Dispatch tables: the YAML schema and its reader (`table`), run-time selection (`lookup`) and,
imported only by the tuner and the CLI, the writer (`writer`).

Imported by the attention call path, so nothing here imports click, rich or pytest, nor the writer.
"""

from dmattn_bench.dispatch.lookup import (
    DISPATCHER,
    ENV_VAR,
    Choice,
    Dispatcher,
    DispatchWarning,
    choose,
    clear_cache,
    nearest,
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
    "Entry", "Table", "TableError", "Timing", "Validation", "choose", "clear_cache", "load_table", "nearest",
    "table_from_dict", "use_table",
]
