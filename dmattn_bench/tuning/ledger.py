"""Adversarial cases that passed, kept across tunes and `verify` by the code that passed them.

A case's verdict is decided by the case itself (its `Case`, dtype and seed: every input), the GPU
and software that ran it, the programs its launches ran (`dmattn_kernels.target.Program`: a
kernel with the compile-time parameters its launcher passed) and the host code around them (the
launchers' grids, fills and sums, the references, the checks). The ledger keeps each passed case
under all of these, and `replay` answers a later run of the same case with the kept verdict only
while all of them are unchanged:

- the programs are recorded as the run launched them (`observing`), and at replay each one's
  digest is taken again from the sources installed now, as a table entry's stamp takes it
  (`dispatch.stamps.program_digest`: the specialised kernel source and options). So a kernel
  edit runs again exactly the cases whose programs it changed, and `verify --restamp` after it
  runs only those;
- the host code is one digest over every Python and C++ source of `dmattn_bench` and
  `dmattn_kernels` outside the kernels themselves (`sourcehash.host_code_hash`): an edit there,
  which could change what a launch passes or how a result is judged, runs every case again;
- the GPU (`hardware.DeviceFingerprint`) and the torch, Triton and CUDA versions are part of the
  case's identity.

Only passed verdicts are kept: a failure runs again every time. The ledger is a JSON-lines file,
one record a line, appended by every process that validates (a line is one write); a torn line
is skipped. `dmattn-bench tune` and `verify` use $DMATTN_BENCH_LEDGER (empty: none), else the one in
the cache directory (`$DMATTN_BENCH_CACHE/ledger/cases.jsonl`), unless given `--no-ledger`, and
set LEDGER_ENV to it for their workers; nothing else replays (the test tiers set it empty).
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path
from typing import Iterator

import torch

from dmattn_bench.tuning.case import Case

LEDGER_ENV = "DMATTN_BENCH_LEDGER"  # the ledger file the validating processes use; unset or empty: none
LEDGER_RULES = "dmattn-bench case ledger, rules 1"  # bumped when what a record covers changes


def default_path() -> Path | None:
    """The ledger `tune` and `verify` use: $DMATTN_BENCH_LEDGER (empty: none), else the one in the
    cache directory, where the CUDA cubins and native programs live too."""
    given = os.environ.get(LEDGER_ENV)
    if given is not None:
        return Path(given) if given else None
    cache = Path(os.environ.get("DMATTN_BENCH_CACHE", Path.home() / ".cache" / "dmattn_bench"))
    return cache / "ledger" / "cases.jsonl"


@contextmanager
def ledger_for_workers(path: Path | None) -> Iterator[None]:
    """Within this block, cases validated here and in the worker processes started here use the
    ledger at `path` (None: none, every case runs)."""
    previous = os.environ.get(LEDGER_ENV)
    if path is None:
        os.environ.pop(LEDGER_ENV, None)
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        os.environ[LEDGER_ENV] = str(path)
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(LEDGER_ENV, None)
        else:
            os.environ[LEDGER_ENV] = previous


def active() -> "Ledger | None":
    """The ledger this process validates with (LEDGER_ENV), or None."""
    path = os.environ.get(LEDGER_ENV)
    return Ledger(Path(path)) if path else None


@lru_cache(maxsize=1)
def _host_digest() -> str:
    from dmattn_bench.sourcehash import host_code_hash
    import dmattn_bench
    import dmattn_kernels

    return host_code_hash({"dmattn_bench": Path(dmattn_bench.__file__).parent,
                           "dmattn_kernels": Path(dmattn_kernels.__file__).parent})


@lru_cache(maxsize=8)
def _environment(device: str) -> tuple[str, str]:
    """(the GPU's identity and the software's, the arch program digests are taken for)."""
    from dmattn_bench.hardware import device_fingerprint, software_versions

    fingerprint = device_fingerprint(device)
    versions = {name: software_versions().get(name) for name in ("torch", "triton", "cuda")}
    major, _, minor = fingerprint.compute_capability.partition(".")
    arch = f"sm{major}{minor}" if torch.device(device).type == "cuda" else "interpreter"
    return json.dumps([fingerprint.to_dict(), versions], sort_keys=True), arch


def _config(config) -> dict | None:
    return None if config is None else config.to_dict()


def case_identity(backend_name: str, case: Case, dtype: torch.dtype, seed: int, fwd_config, bwd_config,
                  device: str) -> str:
    """What besides the code decides a case's verdict, as one digest: the case's every field, the
    dtype and seed (its inputs), the backend and configs, the GPU and software, the host code."""
    environment, _ = _environment(device)
    text = json.dumps([LEDGER_RULES, backend_name, asdict(case), str(dtype), seed, _config(fwd_config),
                       _config(bwd_config), environment, _host_digest()], sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()


# -- the programs a run launched --------------------------------------------------------------------


def _program_record(program) -> dict | None:
    """A launched program as a JSON record that `_program_again` rebuilds from the installed code,
    or None where its parameters have no JSON form (such a case is not kept)."""
    record = {"backend": program.backend, "name": program.name, "parameters": list(map(list, program.parameters))}
    if program.kernel is not None:
        function = getattr(program.kernel, "fn", program.kernel)
        record["module"], record["qualname"] = function.__module__, function.__qualname__
    try:
        json.dumps(record)
    except TypeError:
        return None
    return record


def _program_again(record: dict):
    """The program of a record, its kernel taken from the installed modules (None: gone)."""
    from dmattn_kernels.target import Program

    kernel = None
    if "module" in record:
        try:
            function = importlib.import_module(record["module"])
            for part in record["qualname"].split("."):
                function = getattr(function, part)
        except (ImportError, AttributeError):
            return None
        kernel = function
    return Program(record["backend"], record["name"], kernel, _tuples(record["parameters"]))


def _tuples(value):
    """JSON's lists back as the tuples they were (a program's parameters are tuples throughout)."""
    return tuple(_tuples(item) for item in value) if isinstance(value, list) else value


def _digest_of(program, arch: str) -> str:
    from dmattn_bench.dispatch.stamps import program_digest

    return program_digest(program, arch)


@contextmanager
def observing() -> Iterator[list]:
    """Within this block every kernel launch of either launcher is recorded (its `Program`) into
    the yielded list, and every launch takes the launchers' Python path, where they are seen (a
    native program's launches are not)."""
    from dmattn_kernels.runtime import launch_context

    programs: list = []
    launch_context.PROGRAM_OBSERVERS.append(programs.append)
    launch_context.LAUNCH_OBSERVERS.append(_seen)
    try:
        yield programs
    finally:
        launch_context.PROGRAM_OBSERVERS.remove(programs.append)
        launch_context.LAUNCH_OBSERVERS.remove(_seen)


def _seen(name: str) -> None:
    del name  # a launch observer only so that launches take the path where programs are observed


# -- the file ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Ledger:
    """A ledger file (module docstring)."""

    path: Path

    def replay(self, backend_name: str, case: Case, dtype: torch.dtype, seed: int, fwd_config, bwd_config,
               device: str) -> dict | None:
        """The kept checks of this case (name -> `validator.TensorCheck` fields) when it passed
        before on the same code, else None."""
        identity = case_identity(backend_name, case, dtype, seed, fwd_config, bwd_config, device)
        _, arch = _environment(device)
        for record in reversed(_read(self.path).get(identity, [])):
            programs = [_program_again(program) for program in record["programs"]]
            if all(program is not None and _digest_of(program, arch) == kept["digest"]
                   for program, kept in zip(programs, record["programs"])):
                return record["checks"]
        return None

    def keep(self, backend_name: str, case: Case, dtype: torch.dtype, seed: int, fwd_config, bwd_config,
             device: str, programs: list, checks: dict) -> bool:
        """Appends a passed case with the programs its run launched; False where one of them has
        no record form (nothing is kept)."""
        _, arch = _environment(device)
        records = []
        try:
            launched = sorted(set(programs), key=repr)
        except TypeError:  # a parameter with no hash: no record form either
            return False
        for program in launched:
            record = _program_record(program)
            if record is None:
                return False
            record["digest"] = _digest_of(program, arch)
            records.append(record)
        line = json.dumps({"case": case_identity(backend_name, case, dtype, seed, fwd_config, bwd_config, device),
                           "name": case.name, "programs": records, "checks": checks}, sort_keys=True)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # one write of the whole line on a descriptor opened to append: other processes' lines
        # land before or after it, never inside (a buffered file may split a long line)
        descriptor = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(descriptor, (line + "\n").encode("utf-8"))
        finally:
            os.close(descriptor)
        return True



# path -> (bytes read, records by case identity): a process reads what other processes appended
# since it last looked, not the whole file again for every case
_READ: dict[Path, tuple[int, dict[str, list[dict]]]] = {}


def _read(path: Path) -> dict[str, list[dict]]:
    """The ledger's records by case identity, in file order."""
    offset, records = _READ.get(path, (0, {}))
    try:
        with open(path, "rb") as ledger:
            if ledger.seek(0, os.SEEK_END) < offset:  # replaced by a shorter file: read it all
                offset, records = 0, {}
            ledger.seek(offset)
            data = ledger.read()
    except FileNotFoundError:
        return {}
    complete = data[:data.rfind(b"\n") + 1]  # a line still being written is read next time
    for line in complete.splitlines():
        try:
            record = json.loads(line)
            records.setdefault(record["case"], []).append(record)
        except (json.JSONDecodeError, KeyError, TypeError):
            continue  # a line torn by a killed writer
    _READ[path] = (offset + len(complete), records)
    return records
