"""The release of dmattn-bench (pyproject.toml's version), read where tables and reports record it."""

__version__ = "0.1.0"
