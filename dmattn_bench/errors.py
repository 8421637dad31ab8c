"""User-facing errors: each maps to an exit code and says in one line what to do."""

from __future__ import annotations

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_VALIDATION = 3


class DmattnError(Exception):
    """An error shown to the user as one line (tracebacks only with DMATTN_BENCH_DEBUG=1)."""

    exit_code = EXIT_ERROR

    def __init__(self, message: str, fix: str | None = None):
        super().__init__(message)
        self.fix = fix

    def one_line(self) -> str:
        text = str(self).replace("\n", " ")
        return f"{text} ({self.fix})" if self.fix else text


class NoGpuError(DmattnError):
    """The requested work needs a CUDA GPU and none is present."""


class ValidationFailed(DmattnError):
    """Validation ran and found failures (results were still printed)."""

    exit_code = EXIT_VALIDATION
