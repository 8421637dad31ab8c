"""The benchmark operators (STYLE.md: the bench harness registers them, as tritonbench does): every
module of the benchmark folder registers one operator named after its path, with one line of
help, and `python -m benchmarks NAME --help` runs for each without a GPU (no module does work
when imported). Run as a user runs them, from the repository root in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNNER = "benchmarks"  # run as `python -m benchmarks`, from the repository root
FOLDER = ROOT / RUNNER
HELP_JOBS = 4  # --help runs at once: each imports torch (about 1.5 s of CPU)


def _runner(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", RUNNER, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))


def _expected_names() -> list[str]:
    """The operator name of each module: its path under the folder, dashes for dots and underscores."""
    return sorted("-".join(path.relative_to(FOLDER).with_suffix("").parts).replace("_", "-")
                  for path in FOLDER.rglob("*.py") if path.stem not in ("__init__", "__main__"))


def test_every_benchmark_module_registers_one_operator_with_help():
    done = _runner("list")
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.split(None, 1) for line in done.stdout.splitlines()]
    names = [row[0] for row in rows]
    assert len(names) == len(set(names))
    assert names == _expected_names()
    assert all(len(row) == 2 and row[1].strip() for row in rows), [row for row in rows if len(row) < 2]


def test_each_operator_prints_its_help_without_a_gpu():
    with ThreadPoolExecutor(HELP_JOBS) as pool:
        runs = dict(zip(_expected_names(), pool.map(lambda name: _runner(name, "--help"), _expected_names())))
    failed = {name: run.stderr[-1500:] for name, run in runs.items() if run.returncode != 0}
    assert not failed, failed
    assert all(run.stdout.startswith(f"usage: python -m benchmarks {name}") for name, run in runs.items())


def test_an_unknown_name_is_a_one_line_error():
    done = _runner("no-such-operator")
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "no benchmark operator 'no-such-operator'" in done.stderr
