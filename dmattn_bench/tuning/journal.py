"""The tune journal: every finished trial and suite verdict, one flushed JSON line each.

It is what makes a tune safe to interrupt: `tune --resume` replays it instead of measuring again,
and the winners are always computed from its records. When a run has written its table, a last
`finished` record names that table and counts the trials its time budget left unmeasured, so the
rule for a journal that already exists is:

- a run that completed (a `finished` record with nothing left unmeasured, and nothing after it):
  a fresh run (no resume) replaces the journal, as it replaces that table; `resume` replays it;
- any other journal holding trials (a run interrupted, or stopped by its budget before the end):
  only `resume` may use it, so running the same command again never throws measured trials away.

Each run first records who measures: the backend, the GPU's fingerprint and the backend's kernel
hash (`run` records). A run that would resume trials measured on another GPU or other kernel
sources is refused: their timings and verdicts are not this installation's.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from dmattn_bench.space import config_label
from dmattn_bench.tuning.timing import NOISY_SPREAD
from dmattn_bench.tuning.workloads import Workload

FINISHED = "finished"  # record kind: the run completed and wrote `table`
RUN = "run"  # record kind: the backend, device and kernel hash the trials after it are measured with
RANKED_OUT = "ranked_out"  # a trial's status: the ranked search did not time it (`--exhaustive` does)


def measured_again_on_resume(record: dict, on_gpu: bool) -> bool:
    """Whether a resumed run plans a journaled trial anew instead of replaying it: one ranked
    out was never timed; one out of memory failed for what else held the GPU then (the compile
    pool's tensors beside the measuring worker's references), not for its own config; and one
    timed on a GPU with a spread over NOISY_SPREAD timed what else ran there (the interpreter's
    host clock always spreads: no speed is drawn from it)."""
    return record.get("status") in (RANKED_OUT, "oom") or timed_noisily(record, on_gpu)


def timed_noisily(record: dict, on_gpu: bool) -> bool:
    """Whether a trial's time (a journal record's fields) is more what else ran on the GPU than
    its kernel: timed on a GPU with a spread over NOISY_SPREAD."""
    return on_gpu and record.get("median_ms") is not None and (record.get("spread") or 0.0) > NOISY_SPREAD


# Journaled suite verdicts that a resumed run runs again, for the same reason: on two H200s 22 of
# a tune's 69 suites ran out of memory among the pool's other cases, and 12 of its 60 keys took a
# slower candidate for it
SUITES_RUN_AGAIN_ON_RESUME = ("oom",)


class JournalError(ValueError):
    """The journal cannot be used (locked by another tuner, or an interrupted run's without resume)."""


def trial_id(workload: Workload, direction: str, backend_name: str, config) -> str:
    return f"{workload.label}|{direction}|{backend_name}|{config_label(config)}"


def suite_id(backend_name: str, direction: str, config, dtype: str, suite: str, case_names: list[str]) -> str:
    """A suite verdict's journal id: the config, dtype and suite, and a digest of the cases run
    (`trials.suite_cases`), so a verdict on other cases (another version's suite) is not replayed."""
    digest = hashlib.sha256("\n".join(case_names).encode()).hexdigest()[:12]
    return f"{backend_name}|{direction} {config_label(config)}|{dtype}|{suite}|{digest}"


@dataclass
class _Contents:
    """What a journal's text holds."""

    trials: dict[str, dict]
    suites: dict[str, tuple[str, str]]
    finished: dict | None  # the last record but `run` ones, when it is a `finished` one
    dropped_lines: int
    runs: list[dict]


def _parse(text: str) -> _Contents:
    contents = _Contents({}, {}, None, 0, [])
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            contents.dropped_lines += 1
            contents.finished = None  # a torn line after the marker: a later run was cut short
            continue
        kind = record.get("kind")
        if kind == "trial":
            contents.trials[record["id"]] = record
        elif kind == "suite":
            contents.suites[record["id"]] = (record["status"], record["note"])
        elif kind == RUN:
            contents.runs.append(record)
            continue  # a resumed run that stops before measuring leaves a completed journal completed
        contents.finished = record if kind == FINISHED else None
    return contents


def _foreign(path: Path, runs: list[dict], identity: dict) -> str | None:
    """Why a run of `identity` may not resume the trials of `runs` (None: it may)."""
    for run in runs:
        if run.get("backend") != identity["backend"]:
            continue
        if run.get("device") != identity["device"]:
            measured = (run.get("device") or {}).get("name", "another device")
            return (f"{path} holds {identity['backend']} trials measured on {measured}, this is "
                    f"{identity['device']['name']}: resume it there, or delete it to start over")
        if run.get("kernel_hash") != identity["kernel_hash"]:
            return (f"{path} holds {identity['backend']} trials measured on kernel sources "
                    f"{run.get('kernel_hash')}, these are {identity['kernel_hash']}: delete it to tune them anew")
    return None


def _refusal(path: Path, contents: _Contents) -> str | None:
    """Why a run without resume may not replace this journal (None: it may)."""
    if not contents.trials:
        return None  # nothing measured to lose
    if contents.finished is None:
        return (f"{path} holds {len(contents.trials)} trials of an interrupted run; pass --resume to continue it "
                f"or delete it to start over")
    left = contents.finished.get("unmeasured", 0)
    if left:
        return (f"{path} holds {len(contents.trials)} trials of a run its --budget stopped with {left} trials "
                f"unmeasured; pass --resume to continue it or delete it to start over")
    return None


@dataclass(frozen=True)
class JournalState:
    """A journal as found on disk, read without taking its lock (to tell the user what a run will do).

    Attributes:
        trial_ids: the trials it holds that a resumed run replays (not `measured_again_on_resume`).
        completed: its run wrote its table with nothing left unmeasured.
        refusal: why a run without resume may not replace it (its run was interrupted or stopped
            by its budget), or None when a fresh run starts over.
    """

    trial_ids: frozenset[str]
    completed: bool
    refusal: str | None


def read_state(path: str | Path, on_gpu: bool = False) -> JournalState | None:
    """The journal at `path`, or None when there is none (missing or empty: nothing to resume);
    `on_gpu`: the resumed run times on a GPU (`measured_again_on_resume`)."""
    path = Path(path)
    if not path.exists() or path.stat().st_size == 0:
        return None
    contents = _parse(path.read_text(encoding="utf-8"))
    completed = contents.finished is not None and not contents.finished.get("unmeasured", 0)
    replayed = frozenset(identifier for identifier, record in contents.trials.items()
                         if not measured_again_on_resume(record, on_gpu))
    return JournalState(replayed, completed, _refusal(path, contents))


class Journal:
    """Append-only record of finished trials and suite verdicts: one flushed JSON line each.

    Held under an exclusive lock for the whole run, so two tuners never interleave in one file.
    A line cut short by a kill is ignored on resume (that trial simply runs again). Opened
    without `resume`, a completed run's journal is emptied (the run starts over) and any other
    one holding trials refused (module docstring).
    """

    def __init__(self, path: Path, resume: bool, identity: dict | None = None):
        """`identity`, when given: {"backend", "device" (a fingerprint dict), "kernel_hash"} of
        this run, checked against the trials it would resume and recorded."""
        self.path = Path(path)
        self._file = open(self.path, "a+", encoding="utf-8")
        try:
            fcntl.flock(self._file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._file.close()
            raise JournalError(f"{self.path} is locked by another running tune") from None
        self._file.seek(0)
        text = self._file.read()
        contents = _parse(text)
        if text and not resume:
            refusal = _refusal(self.path, contents)
            if refusal is not None:
                self._file.close()
                raise JournalError(refusal)
            self._file.truncate(0)  # "a+" writes at the end, which is now the start
            text, contents = "", _parse("")
        foreign = _foreign(self.path, contents.runs, identity) if identity is not None else None
        if foreign is not None:
            self._file.close()
            raise JournalError(foreign)
        if text and not text.endswith("\n"):
            self._file.write("\n")  # a kill mid-line: the next record starts on a line of its own
        self.trials = contents.trials
        self.suites = contents.suites
        self.dropped_lines = contents.dropped_lines
        if identity is not None:
            self.append({"kind": RUN, **identity})

    def append(self, record: dict) -> None:
        self._file.write(json.dumps(record, sort_keys=True) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())
        if record["kind"] == "trial":
            self.trials[record["id"]] = record
        elif record["kind"] == "suite":
            self.suites[record["id"]] = (record["status"], record["note"])

    def close(self) -> None:
        self._file.close()


def timed_trials(journals: list[Path], backend: str | None = "triton"):
    """(journal name, trial record, config items) of every `ok` trial with a positive median in
    `journals`, of `backend` (None: of every backend): what the learned defaults, the ranking
    and the comparison of two tunes read."""
    for journal in journals:
        for line in Path(journal).read_text().splitlines():
            trial = json.loads(line)
            median = trial.get("median_ms")
            if (trial.get("kind") == "trial" and trial.get("status") == "ok"
                    and (backend is None or trial.get("backend") == backend)
                    and isinstance(median, (int, float)) and median > 0):
                yield Path(journal).name, trial, tuple(sorted(trial["config"].items()))


def mark_finished(path: str | Path, table: str | Path, entries: int, unmeasured: int) -> None:
    """Records that the run journaled at `path` wrote `table` (with `entries` entries), leaving
    `unmeasured` planned trials unmeasured for lack of time (`--budget`; 0: the run completed).

    Raises:
        JournalError: another tune holds the journal.
    """
    journal = Journal(Path(path), resume=True)
    try:
        journal.append({"kind": FINISHED, "table": str(Path(table).resolve()), "entries": entries,
                        "unmeasured": unmeasured})
    finally:
        journal.close()
