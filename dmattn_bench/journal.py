"""The tune journal: every finished trial and suite verdict, one flushed JSON line each.

It is what makes a tune safe to interrupt: `tune --resume` replays it instead of measuring again,
and the winners are always computed from its records.
"""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path

from dmattn_bench.space import config_label
from dmattn_bench.workloads import Workload


class JournalError(ValueError):
    """The journal cannot be used (locked by another tuner, or exists without resume)."""


def trial_id(workload: Workload, direction: str, backend_name: str, config) -> str:
    return f"{workload.label}|{direction}|{backend_name}|{config_label(config)}"


def suite_id(backend_name: str, direction: str, config, dtype: str, suite: str) -> str:
    return f"{backend_name}|{direction} {config_label(config)}|{dtype}|{suite}"


class Journal:
    """Append-only record of finished trials and suite verdicts: one flushed JSON line each.

    Held under an exclusive lock for the whole run, so two tuners never interleave in one file.
    A line cut short by a kill is ignored on resume (that trial simply runs again).
    """

    def __init__(self, path: Path, resume: bool):
        self.path = Path(path)
        self.trials: dict[str, dict] = {}
        self.suites: dict[str, tuple[str, str]] = {}
        self.dropped_lines = 0
        if self.path.exists() and self.path.stat().st_size > 0 and not resume:
            raise JournalError(f"{self.path} holds trials of an earlier run; pass --resume to continue it "
                               f"or delete it to start over")
        self._file = open(self.path, "a+", encoding="utf-8")
        try:
            fcntl.flock(self._file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._file.close()
            raise JournalError(f"{self.path} is locked by another running tune") from None
        self._file.seek(0)
        text = self._file.read()
        if text and not text.endswith("\n"):
            self._file.write("\n")  # a kill mid-line: the next record starts on a line of its own
        for line in text.splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                self.dropped_lines += 1
                continue
            if record.get("kind") == "trial":
                self.trials[record["id"]] = record
            elif record.get("kind") == "suite":
                self.suites[record["id"]] = (record["status"], record["note"])

    def append(self, record: dict) -> None:
        self._file.write(json.dumps(record, sort_keys=True) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())
        if record["kind"] == "trial":
            self.trials[record["id"]] = record
        else:
            self.suites[record["id"]] = (record["status"], record["note"])

    def close(self) -> None:
        self._file.close()
