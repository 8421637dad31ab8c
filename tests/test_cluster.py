"""Tuning on a Ray cluster (`tune --ray`), tested on a local Ray instance with interpreter actors:
the same journal and table as one host, and a candidate that kills its actor is a `crash` trial
while the rest is measured. (Multi-host GPU clusters were not available to test.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dmattn_bench.dispatch import load_table
from tests.test_reliability import REPO, _files, _records, _tune

pytest.importorskip("ray")


def test_ray_actors_measure_every_trial_once_and_failures_are_trials(tmp_path):
    workloads, space = _files(tmp_path, [16, 32, 64], [20, 40])
    out = tmp_path / "T.yaml"
    process = _tune(["--workloads", workloads, "--space", space, "--out", str(out), "--ray", "local", "--gpus", "2",
                     "--format", "json"],
                    {"DMATTN_BENCH_PLUGINS": "tests.fault_injection", "DMATTN_FAULTS": "32x16=abort,64x16=raise",
                     "PYTHONPATH": str(REPO)})
    stdout, stderr = process.communicate(timeout=900)
    assert process.returncode == 0, stderr[-3000:]
    document = json.loads(stdout)  # Ray's "worker died" messages went to stderr, not into the JSON
    trials = [r for r in _records(Path(f"{out}.trials.jsonl")) if r["kind"] == "trial"]
    ids = [r["id"] for r in trials]
    assert len(ids) == len(set(ids)) == 8  # 2 workloads x (3 fwd + 1 bwd), each measured once
    crashed = {r["config"]["block_m"]: r for r in trials if r["status"] == "crash"}
    assert set(crashed) == {32, 64}
    assert "actor died" in crashed[32]["reason"]  # the actor aborted: replaced for the next trial
    assert "injected failure" in crashed[64]["reason"]  # the job raised: the actor lived on
    assert document["counts"] == {"ok": 4, "crash": 4}
    table = load_table(out)
    assert {e.key.direction for e in table.entries} == {"fwd", "bwd"}
    assert all(e.config.block_m == 16 for e in table.entries if e.key.direction == "fwd")
