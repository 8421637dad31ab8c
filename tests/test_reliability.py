"""Tuning that survives: faulty candidates become statuses, a killed tune resumes without lost or
repeated trials, journals and tables are never shared or torn (CPU, through the interpreter)."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from dmattn_bench.dispatch import load_table
from dmattn_bench.tiles import default_configs
from dmattn_bench.tuning import workers
from dmattn_bench.tuning.journal import Journal, JournalError, mark_finished, read_state
from dmattn_bench.tuning.timing import NOISY_SPREAD
from dmattn_bench.tuning.workers import (CONTEXT_BYTES, POOL_GPU_MEMORY_SHARE, PROCESSES_PER_GPU_UNSIZED, PoolStats,
                                         ProcessPool, Worker, parallel_map, phase_bound, worker_count)
from dmattn_bench.tuning.workloads import Workload

REPO = Path(__file__).resolve().parents[1]
CPU_FWD, CPU_BWD = default_configs(32, "cpu")


def _files(tmp_path: Path, fwd_block_ms: list[int], seqlens: list[int]) -> tuple[str, str]:
    workloads = tmp_path / "w.yaml"
    workloads.write_text(yaml.safe_dump({"default": {
        "tokens": 20, "heads": 2, "head_dim": [32], "seqlen": seqlens, "causal": [True], "gqa_ratio": [1],
        "variants": [{"mask": "none", "bias": "none"}], "dtype": ["fp32"]}}))
    space = tmp_path / "space.yaml"
    fwd = dict(CPU_FWD.to_dict(), block_m=fwd_block_ms)
    space.write_text(yaml.safe_dump({"space": {"triton": {
        "fwd": {k: v if isinstance(v, list) else [v] for k, v in fwd.items()},
        "bwd": {k: [v] for k, v in CPU_BWD.to_dict().items()}}}}))
    return str(workloads), str(space)


def _tune(args: list[str], env_extra: dict | None = None, **kwargs) -> subprocess.Popen:
    env = dict(os.environ, TRITON_INTERPRET="1", **(env_extra or {}))
    return subprocess.Popen([sys.executable, "-m", "dmattn_bench", "tune", *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)


def _records(journal: Path) -> list[dict]:
    return [json.loads(line) for line in journal.read_text().splitlines() if line.strip()]


def test_faulty_candidates_become_statuses_and_the_rest_is_timed(tmp_path):
    workloads, space = _files(tmp_path, [16, 32, 64, 128, 256], [20])
    out = tmp_path / "T.yaml"
    process = _tune(["--workloads", workloads, "--space", space, "--out", str(out), "--trial-timeout", "20",
                     "--format", "json"],
                    {"DMATTN_BENCH_PLUGINS": "tests.fault_injection",
                     "DMATTN_FAULTS": "32x16=abort,64x16=hang,128x16=nan,256x16=raise"})
    stdout, stderr = process.communicate(timeout=600)
    assert process.returncode == 0, stderr[-2000:]
    trials = {(r["direction"], r["config"]["block_m"]): r for r in _records(Path(f"{out}.trials.jsonl"))
              if r["kind"] == "trial"}
    assert trials[("fwd", 32)]["status"] == "crash" and "exit code" in trials[("fwd", 32)]["reason"]
    assert trials[("fwd", 64)]["status"] == "timeout"
    assert trials[("fwd", 128)]["status"] == "nonfinite"
    assert trials[("fwd", 256)]["status"] == "crash" and "injected failure" in trials[("fwd", 256)]["reason"]
    healthy = trials[("fwd", 16)]
    assert healthy["status"] == "ok" and healthy["median_ms"] is not None  # still timed after the faults
    assert trials[("bwd", CPU_BWD.block_m)]["status"] == "ok"
    table = load_table(out)
    assert {(e.key.direction, e.config.block_m) for e in table.entries} == {("fwd", 16), ("bwd", CPU_BWD.block_m)}
    assert json.loads(stdout)["counts"] == {"ok": 2, "crash": 2, "timeout": 1, "nonfinite": 1}


def test_a_trial_out_of_memory_is_measured_once_more_after_the_others(tmp_path):
    """On two H200s a tune's measuring worker ran out of memory beside the compile pool's tensors
    (1085 of 1712 trials), and the winners came from what was left. A trial out of memory is
    measured again once the others are done; its first verdict stays in the journal before it."""
    workloads, space = _files(tmp_path, [16, 32], [20])
    out = tmp_path / "T.yaml"
    state = tmp_path / "faults"
    state.mkdir()
    process = _tune(["--workloads", workloads, "--space", space, "--out", str(out), "--format", "json"],
                    {"DMATTN_BENCH_PLUGINS": "tests.fault_injection", "DMATTN_FAULTS": "32x16=oom",
                     "DMATTN_FAULTS_STATE": str(state)})
    stdout, stderr = process.communicate(timeout=600)
    assert process.returncode == 0, stderr[-2000:]
    crowded = [r for r in _records(Path(f"{out}.trials.jsonl"))
               if r["kind"] == "trial" and r["direction"] == "fwd" and r["config"]["block_m"] == 32]
    assert [r["status"] for r in crowded] == ["oom", "ok"] and "out of memory" in crowded[0]["reason"]
    assert json.loads(stdout)["counts"] == {"ok": 3}


def test_a_suite_journaled_out_of_memory_runs_again_on_resume(tmp_path):
    """On two H200s 22 of a tune's 69 suites ran out of memory among the pool's other cases, and
    their keys took slower candidates. A resumed tune runs such a suite again instead of replaying
    the verdict, and its winner stands."""
    workloads, space = _files(tmp_path, [16, 32], [20])
    out = tmp_path / "T.yaml"
    journal = Path(f"{out}.trials.jsonl")
    args = ["--workloads", workloads, "--space", space, "--out", str(out), "--format", "json"]
    first = _tune(args)
    _, stderr = first.communicate(timeout=600)
    assert first.returncode == 0, stderr[-2000:]
    chosen = {e.key.direction: e.config for e in load_table(out).entries}
    fwd_suite = next(r for r in _records(journal) if r["kind"] == "suite" and "|fwd " in r["id"])
    with journal.open("a") as handle:  # as a crowded GPU's suite run would have left it
        handle.write(json.dumps({**fwd_suite, "status": "oom", "note": "adversarial a: OutOfMemoryError"}) + "\n")

    resumed = _tune([*args, "--resume"])
    _, stderr = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, stderr[-2000:]
    verdicts = [r["status"] for r in _records(journal) if r["kind"] == "suite" and r["id"] == fwd_suite["id"]]
    assert verdicts == ["ok", "oom", "ok"]
    assert {e.key.direction: e.config for e in load_table(out).entries} == chosen


def test_kill_and_resume_loses_and_repeats_nothing(tmp_path):
    workloads, space = _files(tmp_path, [16, 32], [20, 24, 40])
    out = tmp_path / "T.yaml"
    journal = Path(f"{out}.trials.jsonl")
    args = ["--workloads", workloads, "--space", space, "--out", str(out)]
    first = _tune(args, start_new_session=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:  # kill -9 mid-run, once some trials are journaled
        if journal.exists() and sum(r["kind"] == "trial" for r in _records(journal)) >= 3:
            break
        time.sleep(0.5)
    os.killpg(first.pid, signal.SIGKILL)
    first.wait(timeout=60)
    done_before = {r["id"] for r in _records(journal) if r["kind"] == "trial"}
    assert 3 <= len(done_before) < 9 and not out.exists()

    refused = _tune(args)  # without --resume the journal of an interrupted run is never overwritten
    _, stderr = refused.communicate(timeout=120)
    assert refused.returncode == 1 and "interrupted run; pass --resume" in stderr

    resumed = _tune([*args, "--resume"])
    _, stderr = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, stderr[-2000:]
    ids = [r["id"] for r in _records(journal) if r["kind"] == "trial"]
    assert len(ids) == len(set(ids)) == 9  # 3 workloads x (2 fwd + 1 bwd): none lost, none repeated
    assert done_before <= set(ids)

    # the table equals what the same measurements give when nothing is left to measure (but for
    # the date each entry is stamped with as the table is written)
    table = load_table(out)
    again = _tune([*args, "--resume", "--out", str(out)])
    _, stderr = again.communicate(timeout=300)
    assert again.returncode == 0, stderr[-2000:]
    assert "skipping 9 journaled trials, 0 of 9 to run" in stderr
    def undated(entry):  # each run stamps its own dates; the choices and their code must agree
        return replace(entry, timed=None, validated=replace(entry.validated, date=None))

    assert [undated(e) for e in load_table(out).entries] == [undated(e) for e in table.entries]
    assert [r["id"] for r in _records(journal) if r["kind"] == "trial"] == ids  # nothing re-measured


def test_ctrl_c_journals_no_trial_it_interrupted(tmp_path):
    """Ctrl-C signals the whole process group: workers ignore it and the parent stops them, so
    the trial in flight is not journaled as a crash (which --resume would keep), and the run
    ends with exit code 130 and no traceback."""
    workloads, space = _files(tmp_path, [16, 32], [20, 24, 40])
    out = tmp_path / "T.yaml"
    journal = Path(f"{out}.trials.jsonl")
    run = _tune(["--workloads", workloads, "--space", space, "--out", str(out)], start_new_session=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:  # interrupt mid-run, once some trials are journaled
        if journal.exists() and sum(r["kind"] == "trial" for r in _records(journal)) >= 3:
            break
        time.sleep(0.5)
    os.killpg(run.pid, signal.SIGINT)
    _, stderr = run.communicate(timeout=120)
    assert run.returncode == 130 and "interrupted" in stderr and "Traceback" not in stderr, stderr[-2000:]
    trials = [r for r in _records(journal) if r["kind"] == "trial"]
    assert len(trials) >= 3 and all(r["status"] == "ok" for r in trials), [r["reason"] for r in trials]


def test_journal_is_exclusive_and_ignores_a_torn_last_line(tmp_path):
    path = tmp_path / "j.jsonl"
    path.write_text('{"kind": "trial", "id": "a", "status": "ok"}\n{"kind": "trial", "id": "b", "sta')
    journal = Journal(path, resume=True)
    try:
        assert set(journal.trials) == {"a"} and journal.dropped_lines == 1
        with pytest.raises(JournalError, match="locked"):
            Journal(path, resume=True)
        journal.append({"kind": "suite", "id": "s", "status": "ok", "note": "n"})
    finally:
        journal.close()
    lines = path.read_text().splitlines()
    assert json.loads(lines[-1])["id"] == "s"  # the new record is on a line of its own
    with pytest.raises(JournalError, match="--resume"):
        Journal(path, resume=False)


def test_trials_of_another_gpu_or_other_kernels_are_not_resumed(tmp_path):
    """A run records who measures (backend, GPU, kernel hash); resuming trials another GPU or
    other kernel sources measured is refused, those of another backend or of no record are not."""
    h100 = {"name": "NVIDIA H100 80GB HBM3", "compute_capability": "9.0", "sm_count": 132,
            "shared_memory_per_block": 232448}
    here = {"backend": "triton", "device": h100, "kernel_hash": "sha256:" + "1" * 32}
    path = tmp_path / "j.jsonl"
    path.write_text(json.dumps({"kind": "trial", "id": "a", "status": "ok"}) + "\n")
    Journal(path, resume=True, identity=here).close()  # no record yet: resumable, and now recorded
    assert _records(path)[-1] == {"kind": "run", **here}
    Journal(path, resume=True, identity=here).close()
    Journal(path, resume=True, identity=dict(here, backend="cuda", kernel_hash="sha256:" + "2" * 32)).close()
    h200 = dict(h100, name="NVIDIA H200")
    with pytest.raises(JournalError, match="measured on NVIDIA H100 80GB HBM3, this is NVIDIA H200: resume it there"):
        Journal(path, resume=True, identity=dict(here, device=h200))
    with pytest.raises(JournalError, match="kernel sources sha256:1+, these are sha256:3+: delete it"):
        Journal(path, resume=True, identity=dict(here, kernel_hash="sha256:" + "3" * 32))
    mark_finished(path, tmp_path / "T.yaml", entries=1, unmeasured=0)
    Journal(path, resume=False, identity=dict(here, device=h200)).close()  # a fresh run replaces it
    assert _records(path) == [{"kind": "run", **dict(here, device=h200)}]


def test_a_resumed_gpu_tune_times_again_what_a_crowded_gpu_timed(tmp_path):
    """The sweep tune's trials spread 14% at the median, half of them over 10% (its compile
    workers drew inputs on the GPU beside the timed kernels): their times rank nothing. A resumed
    run on a GPU times again a journaled trial whose spread is over NOISY_SPREAD, as it does one
    ranked out or out of memory; the interpreter's host-clock spreads never count."""
    path = tmp_path / "j.jsonl"
    records = {"steady": dict(status="ok", median_ms=1.0, spread=0.004),
               "crowded": dict(status="ok", median_ms=1.3, spread=0.41),
               "failed": dict(status="mismatch", median_ms=None, spread=None),
               "ranked": dict(status="ranked_out", median_ms=None, spread=None),
               "short": dict(status="oom", median_ms=None, spread=None)}
    path.write_text("".join(json.dumps({"kind": "trial", "id": name, **fields}) + "\n"
                            for name, fields in records.items()))
    assert read_state(path, on_gpu=True).trial_ids == {"steady", "failed"}
    assert read_state(path, on_gpu=False).trial_ids == {"steady", "crowded", "failed"}
    assert NOISY_SPREAD < 0.41 and NOISY_SPREAD > 0.004


def test_a_fresh_run_replaces_only_the_journal_of_a_completed_run(tmp_path):
    """Without resume, the journal of a run that completed is emptied (the run starts over); one of
    a run interrupted (no final record, or a record or torn line after it) or stopped by its budget
    is refused, so nothing measured is lost; resume keeps any of them."""
    path = tmp_path / "j.jsonl"
    trial = json.dumps({"kind": "trial", "id": "a", "status": "ok"}) + "\n"
    assert read_state(path) is None
    path.write_text(trial)
    assert (read_state(path).trial_ids, read_state(path).completed) == ({"a"}, False)
    with pytest.raises(JournalError, match="1 trials of an interrupted run; pass --resume"):
        Journal(path, resume=False)

    mark_finished(path, tmp_path / "T.yaml", entries=1, unmeasured=0)
    finished = path.read_text().splitlines()[-1] + "\n"
    assert json.loads(finished) == {"kind": "finished", "table": str(tmp_path / "T.yaml"), "entries": 1,
                                    "unmeasured": 0}
    assert read_state(path).completed and read_state(path).refusal is None
    journal = Journal(path, resume=False)
    try:
        assert journal.trials == {} and path.read_text() == ""
        journal.append({"kind": "trial", "id": "b", "status": "ok"})
    finally:
        journal.close()
    assert [r["id"] for r in _records(path)] == ["b"]

    for after in (trial, '{"kind": "tri'):  # a later run began and was cut short
        path.write_text(trial + finished + after)
        assert not read_state(path).completed
        with pytest.raises(JournalError, match="interrupted run"):
            Journal(path, resume=False)
    budget = json.dumps(dict(json.loads(finished), unmeasured=2)) + "\n"
    path.write_text(trial + budget)
    assert not read_state(path).completed
    with pytest.raises(JournalError, match="--budget stopped with 2 trials unmeasured; pass --resume"):
        Journal(path, resume=False)
    journal = Journal(path, resume=True)
    try:
        assert set(journal.trials) == {"a"}
    finally:
        journal.close()
    assert path.read_text() == trial + budget


def _dump_many(path: str, block_m: int) -> None:
    """A writer process: dumps its own one-entry table 30 times."""
    from dmattn_bench.dispatch import Entry
    from dmattn_bench.tuning.table_writer import dump_table, new_table
    from dmattn_bench.hardware import CPU_FINGERPRINT
    from dmattn_bench.space import FwdConfig, TableKey

    key = TableKey("fwd", "fp32", 64, False, "none", "none", 1, 1024, 1024)
    table = new_table([Entry(key, "triton", FwdConfig(block_m=block_m), {})], CPU_FINGERPRINT, interpreter=True)
    for _ in range(30):
        dump_table(table, path)


def test_concurrent_table_writers_never_tear_the_file(tmp_path):
    path = tmp_path / "shared.yaml"
    context = multiprocessing.get_context("spawn")
    writers = [context.Process(target=_dump_many, args=(str(path), block_m)) for block_m in (16, 32, 64)]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join(timeout=120)
        assert writer.exitcode == 0
    assert load_table(path).entries[0].config.block_m in (16, 32, 64)  # whole and valid: one writer's table
    assert not list(tmp_path.glob(".shared.yaml.*.tmp"))  # no temp file left behind


def test_two_workers_share_the_workloads_and_write_one_table(tmp_path):
    """`--gpus 2` (two interpreter workers here): disjoint shares, one journal, one table."""
    workloads, space = _files(tmp_path, [16, 32], [20, 40])
    out = tmp_path / "T.yaml"
    process = _tune(["--workloads", workloads, "--space", space, "--out", str(out), "--gpus", "2",
                     "--format", "json"])
    stdout, stderr = process.communicate(timeout=600)
    assert process.returncode == 0, stderr[-2000:]
    ids = [r["id"] for r in _records(Path(f"{out}.trials.jsonl")) if r["kind"] == "trial"]
    assert len(ids) == len(set(ids)) == 6  # 2 workloads x (2 fwd + 1 bwd), each measured once
    document = json.loads(stdout)
    assert document["counts"] == {"ok": 6}
    assert document["gpus"] == 2 and set(document["phases_s"]) == {"measure", "winners"}  # no compile phase on CPU
    assert set(document["phase_bounds"]) == set(document["phases_s"])
    assert document["phase_bounds"]["measure"]["bound"] == "serial"
    assert {e.key.direction for e in load_table(out).entries} == {"fwd", "bwd"}


def _visible_gpu(rendezvous) -> str:
    """Reports this process's GPU once another process has taken a job too (so both do)."""
    if rendezvous is not None:
        Path(rendezvous, str(os.getpid())).touch()
        deadline = time.monotonic() + 120
        while len(list(Path(rendezvous).iterdir())) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
    return os.environ.get("CUDA_VISIBLE_DEVICES", "")


def test_a_measuring_worker_is_pinned_in_the_child_only(monkeypatch):
    """A worker for GPU 1 sees the parent's second GPU; the parent's environment never changes
    (a temporary change leaked into compile processes spawned meanwhile: 2x H200, 2026-11-21)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    worker = Worker(interpret=True, gpu=1)
    try:
        assert worker.call(_visible_gpu, (None,), 60) == "5"
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "3,5"
    finally:
        worker.stop()


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs two pool processes")
@pytest.mark.parametrize("parent_visible, expected", [(None, {"0", "1"}), ("3,5", {"3", "5"})])
def test_parallel_map_gives_each_process_one_of_the_gpus(monkeypatch, tmp_path, parent_visible, expected):
    """Compile and suite processes spread over the tuning GPUs: each sees one of them, in the
    numbering of the parent's CUDA_VISIBLE_DEVICES."""
    if parent_visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", parent_visible)
    with ProcessPool(2, gpus=2) as pool:
        seen = parallel_map(_visible_gpu, [str(tmp_path)] * 2, on_crash=lambda item, reason: reason, gpus=2, pool=pool)
    assert set(seen) == expected


def test_a_pool_takes_a_core_each_less_one_per_gpu_and_what_the_gpu_memory_holds(monkeypatch):
    """The H200's host (16 cores, one GPU) ran 8 pool processes, bound by their cores (the
    ranked-tune report before 1ab4f16, in git): the pool now takes every core but the one left
    to the GPU's timing process, fewer where the jobs are fewer, and no more than half the
    GPU's memory holds with a CUDA context and a job's tensors each."""
    monkeypatch.setattr(workers, "usable_cores", lambda: 16)
    h200 = 141 * 2**30
    assert worker_count(1000, gpu_bytes=h200) == 15
    assert worker_count(1000, gpus=2, gpu_bytes=h200) == 14
    assert worker_count(3, gpu_bytes=h200) == 3
    assert worker_count(1000) == PROCESSES_PER_GPU_UNSIZED  # no memory given: the old cap
    assert worker_count(1000, job_bytes=2**30, gpu_bytes=h200) == 15
    big = 16 * 2**30  # a workload's inputs, outputs and gradients
    per_gpu = int(h200 * POOL_GPU_MEMORY_SHARE) // (CONTEXT_BYTES + big)
    assert per_gpu == 4
    assert worker_count(1000, job_bytes=big, gpu_bytes=h200) == per_gpu
    assert worker_count(1000, gpus=2, job_bytes=big, gpu_bytes=h200) == 2 * per_gpu
    assert worker_count(1000, job_bytes=200 * 2**30, gpu_bytes=h200) == 1
    monkeypatch.setattr(workers, "usable_cores", lambda: 1)
    assert worker_count(1000, gpu_bytes=h200) == 1


def test_a_compile_job_holds_its_workloads_inputs_outputs_and_gradients():
    """What the pool's size counts per process: B2 L100 H4 Hkv2 D64 bf16 with a kv-head mask and
    a learnable per-key bias is Q, dO, O, dQ (4 x 2*100*4*64 x 2 bytes), K, V, dK, dV
    (4 x 2*100*2*64 x 2), the mask (2*2*100*100 bytes), the bias with its gradient
    (2 x 2*2*100 x 2) and the float32 values the mask, the larger, is drawn from (2*2*100*100 x 4);
    packed documents count their tokens, not a batch of the longest."""
    workload = Workload(batch=2, heads=4, heads_kv=2, seqlen_q=100, seqlen_k=100, head_dim=64, causal=True,
                        mask="kv_head", bias="per_key", bias_grad=True, dtype="bf16")
    assert workload.tensor_bytes() == 4 * 51200 * 2 + 4 * 25600 * 2 + 40000 + 2 * 400 * 2 + 4 * 40000
    packed = replace(workload, batch=1, documents=(100, 30), mask="none", bias="none")
    assert packed.tensor_bytes() == 4 * 130 * 4 * 64 * 2 + 4 * 130 * 2 * 64 * 2


def _pid(_item) -> int:
    return os.getpid()


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs two pool processes")
def test_a_kept_pool_runs_later_calls_in_the_processes_it_started():
    """A ranked tune's widening rounds and its suites run in one set of processes: a second
    call starts none (its jobs report no start-up), and a pool left is closed."""
    with ProcessPool(2) as pool:
        first, second = PoolStats(), PoolStats()
        pids = parallel_map(_pid, range(6), on_crash=lambda item, reason: reason, pool=pool, stats=first)
        again = parallel_map(_pid, range(6), on_crash=lambda item, reason: reason, pool=pool, stats=second)
        assert set(again) <= set(pids) and len(set(pids)) <= 2
        assert first.startups and not second.startups and second.jobs == 6
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def _stamp(job) -> tuple[float, float, bool]:
    """Marks its start in `folder`; waits (up to a minute) for job `waits_for` to start too.
    Returns (start, end, whether that other job was seen running meanwhile)."""
    folder, name, waits_for = job
    Path(folder, name).touch()
    start = time.time()
    deadline = time.monotonic() + 60
    while waits_for and not Path(folder, waits_for).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return start, time.time(), not waits_for or Path(folder, waits_for).exists()


def test_parallel_map_starts_a_job_only_after_the_jobs_it_waits_for(tmp_path):
    """The tuner makes jobs that share a kernel wait for the job compiling it: a waiting job
    starts after that job ends, the others run meanwhile, results come back in item order, and
    the pool statistics count every job."""
    jobs = [(str(tmp_path), "a", "d"), (str(tmp_path), "b", None), (str(tmp_path), "c", None),
            (str(tmp_path), "d", None)]
    stats = PoolStats()
    with ProcessPool(2) as pool:  # two at once, whatever the cores
        a, b, c, d = parallel_map(_stamp, jobs, on_crash=lambda job, reason: reason, after=[(), (), (0,), ()],
                                  stats=stats, pool=pool)
    assert a[2], "job d did not run while job a was running"
    assert c[0] >= a[1] and d[0] < a[1]
    assert stats.jobs == 4 and stats.processes == 2 and len(stats.startups) <= stats.processes
    assert stats.busy_s >= a[1] - a[0]
    with pytest.raises(ValueError, match="earlier items"):
        parallel_map(_stamp, jobs[:2], on_crash=lambda job, reason: reason, after=[(1,), ()])


def test_a_kept_pool_whose_process_died_while_idle_blames_no_job_of_the_next_call():
    """A kept pool's process killed between calls (the OOM killer, a driver fault) breaks the
    executor: the next call starts fresh processes instead of journaling its first job a crash."""
    with ProcessPool(1) as pool:
        (pid,) = parallel_map(_pid, [0], on_crash=lambda item, reason: reason, pool=pool)
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while not getattr(pool._executor, "_broken", False) and time.monotonic() < deadline:
            time.sleep(0.05)  # the executor notices the death in its own thread
        again = parallel_map(_pid, [0, 1], on_crash=lambda item, reason: f"crash: {reason}", pool=pool)
    assert all(isinstance(result, int) and result != pid for result in again)


def test_a_phase_is_bound_by_its_cores_by_its_hand_over_or_by_waiting():
    """An H200 ranked tune (results/tune's report before 1ab4f16, in git): the suites' 8 processes
    on 16 cores were busy 85% of the phase on their cores, so the cores bounded it and 8 more
    would run; its compile pool was fed 48% (rounds, start-up); a pool whose jobs sat off their
    cores waited; the measure phase and an unused pool ran in one process in turn."""
    suites = phase_bound(75.6, {"processes": 8, "jobs": 255, "busy_s": 517.1, "cpu_s": 516.0}, 16)
    assert suites == {"processes": 8, "cores": 16, "on_core": 1.0, "fed": 0.85, "bound": "cores", "more_cores": True}
    compile_pool = phase_bound(53.2, {"processes": 8, "jobs": 99, "busy_s": 202.8, "cpu_s": 198.5}, 16)
    assert (compile_pool["bound"], compile_pool["fed"]) == ("hand-over", 0.48)
    assert not phase_bound(10.0, {"processes": 16, "jobs": 64, "busy_s": 155.0, "cpu_s": 150.0}, 16)["more_cores"]
    # a core is left to each GPU's timing process
    assert not phase_bound(10.0, {"processes": 15, "jobs": 64, "busy_s": 145.0, "cpu_s": 140.0}, 16)["more_cores"]
    assert phase_bound(10.0, {"processes": 13, "jobs": 64, "busy_s": 125.0, "cpu_s": 120.0}, 16, gpus=2)["more_cores"]
    assert phase_bound(10.0, {"processes": 4, "jobs": 8, "busy_s": 40.0, "cpu_s": 8.0}, 16)["bound"] == "waiting"
    for pool in (None, {"processes": 0, "jobs": 0, "busy_s": 0.0, "cpu_s": 0.0}):
        assert phase_bound(15.2, pool, 16)["bound"] == "serial"
