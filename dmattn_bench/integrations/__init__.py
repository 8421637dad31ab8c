"""Adapters that plug `dmattn_bench.flash_dmattn_func` into other libraries."""
