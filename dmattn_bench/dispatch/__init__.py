"""Dispatch tables: the YAML schema (`table`) and run-time selection (`lookup`).

Imported by the attention call path, so nothing here imports click, rich or pytest.
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
    declare_stale,
    dump_table,
    load_table,
    merged,
    new_table,
    restamp,
    table_from_dict,
    table_to_dict,
)

__all__ = [
    "DISPATCHER", "ENV_VAR", "MAX_TABLE_BYTES", "SCHEMA_VERSION", "Choice", "DispatchWarning", "Dispatcher",
    "Entry", "Table", "TableError", "Timing", "Validation", "choose", "clear_cache", "declare_stale", "dump_table", "load_table",
    "merged", "nearest", "new_table", "restamp", "table_from_dict", "table_to_dict", "use_table",
]
