"""Tuning end to end on the CPU (interpreter): workloads, keys, the tune/show/verify commands and
run-time dispatch of the table they write."""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path

import click
import pytest
import torch
import yaml
from click.testing import CliRunner

from dmattn_bench import dispatch, flash_dmattn_func, plan, tiles
from dmattn_bench.cli.show import show
from dmattn_bench.cli.tune import parse_duration, tune_command
from dmattn_bench.cli.verify import verify
from dmattn_bench.dispatch import DispatchWarning, Entry, TableError, Validation, load_table
from dmattn_bench.hardware import CPU_FINGERPRINT
from dmattn_bench.registry import kernel_source_hash
from dmattn_bench.space import (CONFIGS_DIR, DecodeConfig, FwdConfig, TableKey, as_4d, config_from_dict,
                                config_label, seqlen_bucket)
from dmattn_bench.tiles import default_configs
from dmattn_bench.tuning.adversarial import build_inputs, paged_cache
from dmattn_bench.tuning.table_writer import dump_table, merged, new_table
from dmattn_bench.tuning.workloads import Workload, load_workloads

CPU_FWD, CPU_BWD = default_configs(32, "cpu")


@pytest.fixture(autouse=True)
def fresh_dispatcher():
    dispatch.use_table(None)
    dispatch.clear_cache()
    yield
    dispatch.use_table(None)
    dispatch.clear_cache()


def _write(path, document) -> str:
    path.write_text(yaml.safe_dump(document))
    return str(path)


def _tiny_inputs(tmp_path, fwd_alternative: dict):
    """A one-workload file and a space whose only non-default fwd config is `fwd_alternative`."""
    workloads = _write(tmp_path / "w.yaml", {"default": {
        "tokens": 20, "heads": 2, "head_dim": [32], "seqlen": [20], "causal": [True], "gqa_ratio": [1],
        "variants": [{"mask": "kv_head", "bias": "per_key", "bias_grad": True}], "dtype": ["fp32"]}})
    space = _write(tmp_path / "ci.yaml", {"space": {"triton": {
        "fwd": {k: [v] for k, v in fwd_alternative.items()},
        "bwd": {k: [v] for k, v in CPU_BWD.to_dict().items()}}}})
    return workloads, space


def test_parse_duration():
    assert parse_duration("90s") == 90 and parse_duration("20m") == 1200 and parse_duration("1.5h") == 5400
    assert parse_duration("7") == 7 and parse_duration(None) is None
    with pytest.raises(click.BadParameter):
        parse_duration("soon")


def test_workload_keys_match_the_runtime_keys():
    """The tuner's key for a workload equals the key the runtime derives from its tensors."""
    for workload in load_workloads("configs/ci.yaml"):
        inputs = build_inputs(workload.case(), torch.float32, "cpu")
        bias = inputs.bias.requires_grad_(workload.bias_grad) if inputs.bias is not None else None
        mask4, bias4 = as_4d(inputs.mask), as_4d(bias)
        fwd_key, bwd_key = plan.table_keys(tuple(inputs.q.shape), inputs.k.shape[1], inputs.k.shape[2],
                                           inputs.q.dtype, None if mask4 is None else tuple(mask4.shape),
                                           None if bias4 is None else tuple(bias4.shape), workload.causal,
                                           bias is not None and bias.requires_grad)
        assert fwd_key == workload.key("fwd")
        assert bwd_key == workload.key("bwd")


def test_bad_workloads_file_names_the_key(tmp_path):
    path = _write(tmp_path / "w.yaml", {"default": {"tokens": 8, "heads": 2, "head_dim": [32]}})
    with pytest.raises(ValueError, match="missing keys"):
        load_workloads(path)


def test_a_sampled_grid_is_the_union_of_its_products(tmp_path):
    """A grid given as a list of products runs each product's shapes once (a shape two products
    share is not tuned twice); a bad product is named by its index."""
    product = {"tokens": 64, "heads": 2, "head_dim": [32], "seqlen": [16, 32], "causal": [True], "gqa_ratio": [1],
               "variants": [{"mask": "none", "bias": "none"}], "dtype": ["fp32"]}
    other = dict(product, seqlen=[32], head_dim=[32, 64])
    path = _write(tmp_path / "w.yaml", {"sampled": [product, other], "nested": [[product], [[other]]],
                                        "broken": [product, dict(product, tokens=0)]})
    labels = [w.label for w in load_workloads(path, "sampled")]
    assert labels == ["fp32 B4 H2 L16x16 D32 causal mask=none bias=none", "fp32 B2 H2 L32x32 D32 causal mask=none bias=none",
                      "fp32 B2 H2 L32x32 D64 causal mask=none bias=none"]
    assert [w.label for w in load_workloads(path, "nested")] == labels
    with pytest.raises(ValueError, match=r"broken\[1\]\.tokens"):
        load_workloads(path, "broken")
    wide = load_workloads(CONFIGS_DIR / "workloads" / "default.yaml", "wide")
    assert {w.head_dim for w in wide} == {64, 96, 128, 192, 256} and {w.seqlen_q for w in wide} >= {1024, 16384}
    assert {w.heads // w.heads_kv for w in wide} == {1, 2, 4, 8} and {w.causal for w in wide} == {False, True}
    assert {w.mask for w in wide} == {"none", "full", "kv_head", "per_key"}
    default = load_workloads(CONFIGS_DIR / "workloads" / "default.yaml")
    assert load_workloads(CONFIGS_DIR / "workloads" / "default.yaml", "shipped") == default + wide


def test_tune_writes_a_table_that_show_verify_and_dispatch_accept(tmp_path):
    alternative = dict(CPU_FWD.to_dict(), block_m=32)
    workloads, space = _tiny_inputs(tmp_path, alternative)
    out = tmp_path / "T.yaml"
    runner = CliRunner()
    result = runner.invoke(tune_command, ["--workloads", workloads, "--space", space, "--out", str(out),
                                          "--format", "json"])
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    # fwd: the default and the alternative; bwd: the space holds only the default (deduplicated)
    assert document["entries"] == 2 and document["counts"] == {"ok": 3}
    # the ranked search (the default) over two candidates times both: nothing to estimate
    assert document["search"] == "ranked" and document["search_regret_estimate"] == {
        "triton": {"groups": 0, "unknown": 0, "geomean": None, "worst": None}}
    assert {(w["key"]["direction"], w["search"]["ran"], w["search"]["candidates"]) for w in document["winners"]} == {
        ("fwd", 2, 2), ("bwd", 1, 1)}
    table = load_table(out)  # passes the schema
    assert {e.key.direction for e in table.entries} == {"fwd", "bwd"}
    assert table.interpreter is True
    records = [json.loads(line) for line in (tmp_path / "T.yaml.trials.jsonl").read_text().splitlines()]
    trials = [r for r in records if r["kind"] == "trial"]
    assert len(trials) == 3 and all(r["status"] == "ok" for r in trials)
    # winners' adversarial verdicts too, and each key's ranking (the ranked search's order)
    assert {r["kind"] for r in records} == {"run", "trial", "ranking", "suite", "finished"}
    assert records[0] == {"kind": "run", "backend": "triton", "device": CPU_FINGERPRINT.to_dict(),
                          "kernel_hash": kernel_source_hash("triton")}  # who measured, for --resume
    assert records[-1] == {"kind": "finished", "table": str(out.resolve()), "entries": 2, "unmeasured": 0}
    # what calls ran before this tune (no table on this machine: the defaults), against the winners
    fwd_time = {config_label(FwdConfig(**r["config"])): r["median_ms"] for r in trials if r["direction"] == "fwd"}
    fwd_winner = next(w for w in document["winners"] if w["key"]["direction"] == "fwd")
    fwd_current = fwd_winner["evidence"]["current_choice"]
    assert fwd_current["source"] == "default" and fwd_current["config"] == config_label(CPU_FWD)
    assert fwd_current["regret"] == round(fwd_time[config_label(CPU_FWD)] /
                                          fwd_time[config_label(FwdConfig(**fwd_winner["config"]))], 4)
    bwd_current = next(w for w in document["winners"] if w["key"]["direction"] == "bwd")["evidence"]["current_choice"]
    assert bwd_current["regret"] == 1.0  # the only bwd candidate is the default
    assert document["current_choice_regret"]["keys"] == 2 and document["current_choice_regret"]["not_timed"] == 0

    shown = runner.invoke(show, [str(out)])
    assert shown.exit_code == 0 and "entries" in shown.stdout

    verified = runner.invoke(verify, ["--table", str(out), "--dtype", "fp32", "--format", "json"])
    assert verified.exit_code == 0, verified.output
    assert json.loads(verified.stdout)["source"] == str(out)

    # the runtime picks the tuned fwd config for this shape, and stays correct
    fwd_entry = next(e for e in table.entries if e.key.direction == "fwd")
    inputs = build_inputs(load_workloads(workloads)[0].case(), torch.float32, "cpu")
    _, fwd_config = plan.select("fwd", inputs.q, inputs.k, as_4d(inputs.mask), as_4d(inputs.bias),
                                True, "auto", str(out), None, False)
    assert fwd_config == fwd_entry.config


def test_the_table_records_the_suite_its_winners_passed(tmp_path, monkeypatch):
    """A tune's table says which adversarial suite its winners passed (`--suite`). Here the tuner
    is told the requested level but runs the quick suite: the full one takes hours in the
    interpreter."""
    from dmattn_bench.cli import tune as tune_cli

    real_tune = tune_cli.tune
    asked = []
    monkeypatch.setattr(tune_cli, "tune", lambda *args, suite, **kwargs: asked.append(suite)
                        or real_tune(*args, suite="quick", **kwargs))
    workloads, space = _tiny_inputs(tmp_path, dict(CPU_FWD.to_dict(), block_m=32))
    out = tmp_path / "T.yaml"
    result = CliRunner().invoke(tune_command, ["--workloads", workloads, "--space", space, "--out", str(out),
                                               "--suite", "full", "--format", "json"])
    assert result.exit_code == 0, result.output
    assert asked == ["full"]
    from dmattn_bench.dispatch.stamps import stamp_of

    table = load_table(out)
    assert table.entries
    for entry in table.entries:  # each validated, on the stamp of its own code
        assert entry.validated.suite == "full" and entry.stale is None
        assert entry.validated.stamp == stamp_of(entry, table.device)


def _records(journal) -> list[dict]:
    return [json.loads(line) for line in journal.read_text().splitlines()]


def test_the_same_tune_again_starts_over_after_a_completed_run_and_resumes_only_when_asked(tmp_path):
    """The README's command run twice: the second run replaces the completed run's journal and
    table instead of refusing. A journal of an interrupted run is refused without --resume, and
    --resume says how many trials it skips and measures (and counts) only the rest. Each tune
    ends by saying how to use the table and verify it."""
    from dmattn_bench.errors import DmattnError

    workloads, space = _tiny_inputs(tmp_path, dict(CPU_FWD.to_dict(), block_m=32))
    out = tmp_path / "T.yaml"
    journal = tmp_path / "T.yaml.trials.jsonl"
    args = ["--workloads", workloads, "--space", space, "--out", str(out), "--format", "json"]
    runner = CliRunner()

    first = runner.invoke(tune_command, args)
    assert first.exit_code == 0, first.output
    results_end = first.stderr.index("wrote ")
    assert first.stderr.index(f"export DMATTN_BENCH_TABLE={out.resolve()}") > results_end
    assert f'dmattn_bench.use_table("{out.resolve()}")' in first.stderr
    assert f"dmattn-bench verify --table {out.resolve()} --dtype fp32" in first.stderr
    assert first.stderr.count("tune [") == 3

    again = runner.invoke(tune_command, args + ["--exhaustive"])  # every candidate, as the ranked run here
    assert again.exit_code == 0, again.output
    assert json.loads(again.stdout)["search"] == "exhaustive"
    assert json.loads(again.stdout)["search_regret_estimate"] is None
    assert "completed run: starting over" in again.stderr
    kinds = [r["kind"] for r in _records(journal)]
    # measured again into an emptied journal: not refused, not appended to, not replayed
    assert kinds.count("trial") == 3 and kinds.count("finished") == 1 and kinds[-1] == "finished"
    assert json.loads(again.stdout)["replayed_trials"] == 0 and again.stderr.count("tune [") == 3
    assert len(load_table(out).entries) == 2

    # an interrupted run: two trials journaled, no final record
    trials = [line for line in journal.read_text().splitlines() if json.loads(line)["kind"] == "trial"]
    journal.write_text("\n".join(trials[:2]) + "\n")
    refused = runner.invoke(tune_command, args)
    assert isinstance(refused.exception, DmattnError), refused.output
    assert "2 trials of an interrupted run; pass --resume" in str(refused.exception)
    assert journal.read_text() == "\n".join(trials[:2]) + "\n"  # untouched

    resumed = runner.invoke(tune_command, [*args, "--resume"])
    assert resumed.exit_code == 0, resumed.output
    assert f"resuming {journal}: skipping 2 journaled trials, 1 of 3 to run" in resumed.stderr
    assert resumed.stderr.count("tune [") == 1 and "tune [1/1]" in resumed.stderr  # only what it measures
    assert json.loads(resumed.stdout)["replayed_trials"] == 2
    assert [r["kind"] for r in _records(journal)].count("trial") == 3


def test_resume_measures_again_a_trial_journaled_out_of_memory(tmp_path):
    """A GPU tune's trials ran out of memory while the compile pool held other workloads' tensors
    (H200 sweep grid, 2026-11-30: 1085 of 1712 measured trials); that verdict is the GPU's state
    then, not the config's, so --resume measures such a trial again and counts it as to run."""
    workloads, space = _tiny_inputs(tmp_path, dict(CPU_FWD.to_dict(), block_m=32))
    out = tmp_path / "T.yaml"
    journal = tmp_path / "T.yaml.trials.jsonl"
    args = ["--workloads", workloads, "--space", space, "--out", str(out), "--format", "json"]
    runner = CliRunner()
    assert runner.invoke(tune_command, args).exit_code == 0
    records = [r for r in _records(journal) if r["kind"] == "trial"]
    records[0].update(status="oom", median_ms=None, reason="OutOfMemoryError: CUDA out of memory.")
    journal.write_text("".join(json.dumps(r) + "\n" for r in records))  # interrupted: no final record

    resumed = runner.invoke(tune_command, [*args, "--resume"])
    assert resumed.exit_code == 0, resumed.output
    assert f"skipping {len(records) - 1} journaled trials, 1 of {len(records)} to run" in resumed.stderr
    assert "tune [1/1]" in resumed.stderr
    again = [r for r in _records(journal) if r["kind"] == "trial" and r["id"] == records[0]["id"]]
    assert [r["status"] for r in again] == ["oom", "ok"]


def test_a_key_with_a_trial_timed_noisily_is_timed_once_more_in_the_same_run(tmp_path, monkeypatch):
    """On two H200s the sweep tune's trials, timed beside the compile pool, still spread over 5% in
    642 of 1512. Every timed trial of a key holding such a trial is timed once more after the
    others, its rivals too and without compiling anything; the second times are the ones the
    winners see, and a second run that fails for the worker's sake leaves the first time. (On a
    GPU only: the interpreter's host clock always spreads, so the test stands in for the GPU.)"""
    from dmattn_bench.tuning import tuner

    workloads, space = _tiny_inputs(tmp_path, dict(CPU_FWD.to_dict(), block_m=32))
    out = tmp_path / "T.yaml"
    journal = tmp_path / "T.yaml.trials.jsonl"
    judged = []

    def first_forward_crowded(record, on_gpu):
        judged.append(record["config"]["block_m"])
        return record["direction"] == "fwd" and record["config"]["block_m"] == 32 and judged.count(32) == 1

    def tune(args=()):
        judged.clear()
        result = CliRunner().invoke(tune_command, ["--workloads", workloads, "--space", space, "--out", str(out),
                                                   "--format", "json", *args])
        assert result.exit_code == 0, result.output
        return [r for r in _records(journal) if r["kind"] == "trial"], json.loads(result.stdout)

    monkeypatch.setattr(tuner, "timed_noisily", first_forward_crowded)
    trials, report = tune()
    forward = [r for r in trials if r["direction"] == "fwd"]
    assert len({r["id"] for r in forward}) == 2  # the default and block_m 32: both timed twice
    assert sorted(r["config"]["block_m"] for r in forward) == sorted(2 * [r["config"]["block_m"] for r in forward[:2]])
    assert all(r["status"] == "ok" and r["median_ms"] for r in forward)
    assert [r["direction"] for r in trials].count("bwd") == len({r["id"] for r in trials if r["direction"] == "bwd"})
    assert report["counts"] == {"ok": len({r["id"] for r in trials})}

    monkeypatch.setattr(tuner, "TIMED_AGAIN_RECORDED", ())  # every second run failing, as a lost worker's
    trials, report = tune()
    assert len(trials) == len({r["id"] for r in trials}) and report["counts"] == {"ok": len(trials)}


def test_a_tune_without_out_writes_into_the_tuned_folder_and_draws_no_speed_from_the_interpreter(
        tmp_path, monkeypatch):
    """Issue 54: the main command wrote cpu-interpreter.yaml and its journal into the checkout's
    root, which .gitignore did not cover, and printed a geometric-mean speed-up beside "timings
    not meaningful"."""
    workloads, space = _tiny_inputs(tmp_path, CPU_FWD.to_dict())
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(tune_command, ["--workloads", workloads, "--space", space, "--format", "json"])
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in (tmp_path / "tuned").iterdir()) == [
        "cpu-interpreter.yaml", "cpu-interpreter.yaml.trials.jsonl"]
    assert not list(tmp_path.glob("cpu-interpreter.yaml*"))
    assert "speed-up" not in result.stderr and "timings are not meaningful" in result.stderr
    assert json.loads(result.stdout)["geomean_speedup_vs_default"] is None
    gitignore = (Path(__file__).resolve().parents[1] / ".gitignore").read_text().split()
    assert "/tuned/" in gitignore


def test_resume_without_a_journal_is_a_usage_error(tmp_path):
    workloads, space = _tiny_inputs(tmp_path, CPU_FWD.to_dict())
    out = tmp_path / "T.yaml"
    args = ["--workloads", workloads, "--space", space, "--out", str(out), "--resume"]
    missing = CliRunner().invoke(tune_command, args)
    assert missing.exit_code == 2 and f"nothing to resume: the journal {out}.trials.jsonl does not exist" in \
        " ".join(missing.output.split())
    (tmp_path / "T.yaml.trials.jsonl").touch()
    empty = CliRunner().invoke(tune_command, args)
    assert empty.exit_code == 2 and "trials.jsonl is empty" in " ".join(empty.output.split())
    assert not out.exists()


def test_a_budget_stopped_tune_records_what_it_left_unmeasured(tmp_path):
    """The final record of a run its --budget cut short counts the trials it skipped, which is
    what keeps a fresh run from replacing it (tests/test_reliability.py checks the journal side)."""
    workloads, space = _tiny_inputs(tmp_path, CPU_FWD.to_dict())
    out = tmp_path / "T.yaml"
    result = CliRunner().invoke(tune_command, ["--workloads", workloads, "--space", space, "--out", str(out),
                                               "--budget", "0"])
    assert "no candidate passed" in str(result.exception), result.output
    final = _records(tmp_path / "T.yaml.trials.jsonl")[-1]
    assert final == {"kind": "finished", "table": str(out.resolve()), "entries": 0, "unmeasured": 2}


def test_a_workload_whose_reference_does_not_fit_ends_its_trials_with_one_failure(tmp_path, monkeypatch):
    """When a workload's inputs and references cannot be built (an L16384 H16 reference needs
    more than an H100's memory), its trials end with that failure, none measured: built once, and
    once more after the other trials (out of memory beside the compile pool, it may fit alone)."""
    from dmattn_bench.tuning import trials, tuner
    from dmattn_bench.space import BwdConfig
    from dmattn_bench.tuning.workloads import Workload

    class InProcessWorker:
        def __init__(self):
            self.jobs = []

        def call(self, fn, args, timeout):
            self.jobs.append(fn.__name__)
            return fn(*args)

        def stop(self):
            pass

    def out_of_memory(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 16.00 GiB")

    monkeypatch.setattr(trials, "_Problem", out_of_memory)
    worker = InProcessWorker()
    workload = Workload(batch=1, heads=2, heads_kv=2, seqlen_q=40, seqlen_k=40, head_dim=32, causal=False,
                        mask="none", bias="none", bias_grad=False, dtype="fp32")
    spaces = {"fwd": [FwdConfig(16, 16, 4, 1)], "bwd": [BwdConfig(16, 16, 16, 16, 4, 1)]}
    result = tuner.tune([workload], spaces, "cpu", journal_path=tmp_path / "trials.jsonl", workers=[worker])
    assert len(result.trials) >= 2 and {t.status for t in result.trials} == {"oom"}
    assert all(t.reason.startswith("the workload's inputs and reference: OutOfMemoryError") for t in result.trials)
    assert worker.jobs == ["problem_job", "problem_job"] and result.winners == []


def test_info_shows_the_table_a_call_would_use_or_why_none(tmp_path, monkeypatch):
    """`info`'s active table is the one the runtime's lookup consults on this machine, with where
    it comes from; with none, the reasons (no variable, no shipped table, a skipped table) and,
    after a tune in this folder, how to select its table."""
    from pathlib import Path

    from dmattn_bench.cli.info import info
    from dmattn_bench.dispatch import lookup
    from dmattn_bench.dispatch.table import Entry
    from dmattn_bench.tuning.table_writer import dump_table, new_table

    shipped_dir = tmp_path / "shipped"
    shipped_dir.mkdir()
    monkeypatch.setattr(lookup, "SHIPPED_TABLES_DIR", shipped_dir)
    monkeypatch.delenv("DMATTN_BENCH_TABLE", raising=False)
    monkeypatch.chdir(tmp_path)

    def shown() -> tuple[str | None, str, str]:
        result = CliRunner().invoke(info, ["--format", "json"])
        assert result.exit_code == 0, result.output
        document = json.loads(result.stdout)
        return document["active_table"], document["active_table_note"], result.stderr

    active, note, _ = shown()
    assert active is None
    assert "DMATTN_BENCH_TABLE is unset" in note and "no table ships for cpu-interpreter" in note

    key = load_workloads(_tiny_inputs(tmp_path, CPU_FWD.to_dict())[0])[0].key("fwd")
    (tmp_path / "tuned").mkdir()
    tuned = tmp_path / "tuned" / "cpu-interpreter.yaml"  # where `tune` writes on this machine by default
    dump_table(new_table([Entry(key, "triton", CPU_FWD, {"median_ms": 1.0})], CPU_FINGERPRINT, interpreter=True),
               tuned)
    active, note, _ = shown()
    assert active is None and f"export DMATTN_BENCH_TABLE={tuned.resolve()}" in note

    monkeypatch.setenv("DMATTN_BENCH_TABLE", str(tuned))
    active, note, _ = shown()
    assert (active, note) == (str(tuned), "from DMATTN_BENCH_TABLE (1 current entries)")
    assert tiles.choose(key, "cpu").source == f"table:{tuned}"  # what a call uses

    foreign = Path(__file__).resolve().parents[1] / "results/tables/nvidia-h100-80gb-hbm3-sm90.yaml"
    monkeypatch.setenv("DMATTN_BENCH_TABLE", str(foreign))
    active, note, stderr = shown()
    assert active is None and f"{foreign} ignored: tuned on NVIDIA H100" in note
    assert "tuned on NVIDIA H100" in stderr and "DMATTN_BENCH_TABLE is unset" not in note

    shipped = shipped_dir / "cpu-interpreter.yaml"  # the runtime falls back to it past the foreign one
    shipped.write_bytes(tuned.read_bytes())
    active, note, _ = shown()
    assert (active, note) == (str(shipped), "shipped for cpu-interpreter (1 current entries)")
    dispatch.clear_cache()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DispatchWarning)  # the foreign table's, checked above
        assert tiles.choose(key, "cpu").source == f"table:{shipped}"


def test_several_workloads_files_make_one_table(tmp_path):
    """`--workloads A --workloads B`: the union in one run and one table; a shape in both is tuned once."""
    workloads, space = _tiny_inputs(tmp_path, CPU_FWD.to_dict())
    other = _write(tmp_path / "w2.yaml", {"default": {
        "tokens": 20, "heads": 2, "head_dim": [32], "seqlen": [20, 40], "causal": [True], "gqa_ratio": [1],
        "variants": [{"mask": "none", "bias": "none"}], "dtype": ["fp32"]}})
    out = tmp_path / "T.yaml"
    result = CliRunner().invoke(tune_command, ["--workloads", workloads, "--workloads", other, "--workloads", workloads,
                                               "--space", space, "--out", str(out), "--format", "json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["counts"] == {"ok": 6}  # 3 distinct workloads x (1 fwd + 1 bwd)
    keys = {(e.key.mask, e.key.seqlen_q_bucket) for e in load_table(out).entries}
    # (a kv-head mask without GQA is keyed as a full one)
    assert keys == {("full", seqlen_bucket(20)), ("none", seqlen_bucket(20)), ("none", seqlen_bucket(40))}


def test_broken_table_warns_once_and_falls_back(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("schema_version: 1\nentries: [\n")
    q = torch.randn(1, 20, 2, 32)
    k = torch.randn(1, 20, 2, 32)
    v = torch.randn(1, 20, 2, 32)
    expected = flash_dmattn_func(q, k, v, is_causal=True, backend="reference")
    dispatch.use_table(path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = flash_dmattn_func(q, k, v, is_causal=True)
        second = flash_dmattn_func(q, k, v, is_causal=True)
    dispatch_warnings = [w for w in caught if issubclass(w.category, DispatchWarning)]
    assert len(dispatch_warnings) == 1 and "broken.yaml" in str(dispatch_warnings[0].message)
    assert torch.allclose(first, expected, atol=1e-5) and torch.equal(first, second)


def test_explicit_config_overrides_the_table(tmp_path):
    q = torch.randn(1, 20, 2, 32)
    chosen = FwdConfig(32, 16, 1, 1)
    _, fwd_config = plan.select("fwd", q, q, None, None, False, "auto", None, chosen, False)
    _, bwd_config = plan.select("bwd", q, q, None, None, False, "auto", None, None, False)
    assert fwd_config == chosen and bwd_config == CPU_BWD
    assert seqlen_bucket(20) == 16


def test_suite_verdict_from_cases_matches_the_whole_suite():
    """The GPU tune spreads a suite's cases over processes: a case job returns what that case of
    the whole suite returns, and the verdict is the first failure in case order. A suite checks
    one direction's config: a backward one on the tensors of the backward alone."""
    from dmattn_bench.tuning.trials import suite_case_job, suite_cases, suite_verdict
    from dmattn_bench.tuning.validator import CaseResult, validate

    _, bwd = default_configs(32, "cpu")
    cases = suite_cases("triton", "bwd", bwd, "quick")
    whole = validate("triton", None, bwd, torch.float32, "cpu", cases=cases[:2])
    parts = [suite_case_job(("triton", "bwd", bwd, "fp32", "quick", "cpu", None, index)) for index in range(2)]
    assert [(r.case, r.status) for r in parts] == [(r.case, r.status) for r in whole.cases] == [(c.name, "ok") for c in cases[:2]]
    assert set(whole.worst_ratios()) >= {"dq", "dk", "dv"} and not {"out", "lse"} & set(whole.worst_ratios())
    assert suite_verdict(parts, "quick") == ("ok", "quick suite, 2 cases")
    failed = [parts[0], CaseResult("b", "mismatch", "dq: error"), CaseResult("c", "nonfinite", "dk: 1 non-finite")]
    assert suite_verdict(failed, "quick") == ("mismatch", "adversarial b: dq: error")


def test_a_suite_runs_each_case_at_a_head_dim_its_config_takes():
    """The warp-specialized CUDA backward of 128 keys takes head dims 72 to 128 (its two consumers
    split tiles of 128 columns): the suite's cases at others run at the next it takes, the rest as
    they are; a config that takes every head dim (the warp-specialized forward too, on tiles of
    the next multiple of 64) runs the suite unchanged."""
    from dmattn_bench.space import BwdConfig
    from dmattn_bench.tuning.adversarial import adversarial_cases
    from dmattn_bench.tuning.validator import config_suite, config_tiles

    ws, plain, ws_forward = BwdConfig(64, 128, 64, 128, 12, 2), FwdConfig(64, 64, 4, 2), FwdConfig(128, 128, 12, 2)
    whole = adversarial_cases("quick", config_tiles(None, ws))
    moved = config_suite("cuda", "quick", None, ws)
    assert [case.name.split("@d")[0] for case in moved] == [case.name for case in whole]

    def takes(head_dim: int) -> bool:  # tiles of 128 columns: a 64-column block for each consumer
        return 64 < head_dim <= 128

    for before, after in zip(whole, moved):
        if takes(before.head_dim):
            assert after == before
        elif before.head_dim < 128:  # the next multiple of 8 it takes
            assert takes(after.head_dim) and not any(takes(d) for d in range(before.head_dim, after.head_dim, 8))
    assert any(case.head_dim != before.head_dim for case, before in zip(moved, whole))
    for config in (plain, ws_forward):
        assert config_suite("cuda", "quick", config, None) == adversarial_cases("quick", config_tiles(config, None))


def test_a_case_that_loses_the_cuda_context_is_not_blamed_on_the_next(monkeypatch):
    """After a case that kills its process's CUDA context, that process answers `retry` for its
    later jobs (the tune reruns them in fresh processes); a failure outside the kernel (inputs,
    references) is a status too, never an exception out of the job."""
    from dmattn_bench.tuning import trials
    from dmattn_bench.tuning.validator import CaseResult

    fwd, bwd = default_configs(32, "cpu")
    ran = []

    def illegal_access(backend, case, *args):
        ran.append(case.name)
        return CaseResult(case.name, "launch_error", "CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(trials, "_context_lost", False)
    monkeypatch.setattr(trials, "check_case", illegal_access)
    first, second = (trials.suite_case_job(("triton", "fwd", fwd, "fp32", "quick", "cpu", None, i)) for i in (0, 1))
    assert (first.status, second.status) == ("launch_error", "retry") and len(ran) == 1

    def inputs_fail(*args):
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(trials, "_context_lost", False)
    monkeypatch.setattr(trials, "check_case", inputs_fail)
    third = trials.suite_case_job(("triton", "bwd", bwd, "fp32", "quick", "cpu", None, 2))
    assert third.status not in ("ok", "retry") and "out of memory" in third.reason


def test_jobs_sharing_a_kernel_wait_for_the_first_that_compiles_it():
    """Compile and suite jobs that need a kernel another job compiles wait for that job (and
    load the kernel from Triton's cache) instead of compiling it at the same time."""
    from dmattn_bench.tuning.workers import leaders

    assert leaders([["a", "x"], ["b", "x"], ["a", "y"], ["c"], ["b", "y"]]) == [(), (0,), (0,), (), (1, 2)]


def test_workloads_of_one_specialization_class_share_their_compiles():
    """Workloads that differ only in batch, or in lengths that Triton specializes alike (both
    multiples of 16), compile each kernel once; a length that is not a multiple of 16, another
    head dim or another mask kind compiles its own."""
    from dataclasses import replace

    from dmattn_bench.registry import get_backend
    from dmattn_bench.space import BwdConfig
    from dmattn_bench.tuning.tuner import compile_keys
    from dmattn_bench.tuning.workers import leaders
    from dmattn_bench.tuning.workloads import Workload

    base = Workload(batch=8, heads=16, heads_kv=4, seqlen_q=2048, seqlen_k=2048, head_dim=128, causal=True,
                    mask="kv_head", bias="per_key", bias_grad=True, dtype="bf16")
    workloads = [base, replace(base, batch=2, seqlen_q=8192, seqlen_k=8192),
                 replace(base, seqlen_q=1000, seqlen_k=1000), replace(base, head_dim=64),
                 replace(base, mask="full")]
    config = BwdConfig(64, 64, 64, 64, 4, 2)
    keys = compile_keys([(w, "bwd", config, "triton") for w in workloads], get_backend("triton"))
    assert keys[0] == keys[1]
    assert leaders(keys) == [(), (0,), (), (), ()]


def test_a_winner_s_suite_leaves_out_the_head_dims_above_its_key_s_as_verify_does():
    """The tuner runs a candidate's suite for the key it would win: no case of a larger head dim
    (dispatch never sends it one; the tiles can need more shared memory than the GPU has), the
    cases `verify --suite` runs for such an entry. A key below every case's head dim runs them all."""
    from dmattn_bench.tuning.trials import suite_cases
    from dmattn_bench.tuning.tuner import _case_kernels
    from dmattn_bench.tuning.validator import plan_table_entries

    config = FwdConfig(64, 64, 4, 2)
    every = suite_cases("triton", "fwd", config, "full")
    capped = suite_cases("triton", "fwd", config, "full", 128)
    assert {c.head_dim for c in every} >= {40, 72, 96, 192} and max(c.head_dim for c in capped) == 128
    assert capped == tuple(c for c in every if c.head_dim <= 128)
    assert suite_cases("triton", "fwd", config, "full", 8) == every
    entry = Entry(TableKey("fwd", "bf16", 128, True, "full", "full", 1, 4096, 4096), "triton", config, {})
    (planned,) = plan_table_entries([entry], "bf16", "cpu", "full")  # verify's: the pair's tiles, the same cap
    assert max(c.head_dim for c in planned.cases) == 128
    # a GPU-phase case job names the key's head dim: its index counts the capped cases
    last = ("triton", "fwd", config, "bf16", "full", "cuda", 128, len(capped) - 1)
    assert _case_kernels(last) == _case_kernels((*last[:6], None, every.index(capped[-1])))


def test_suite_cases_that_differ_only_in_their_values_share_their_compiles():
    """Cases whose inputs differ only in values (poisons, scales) wait for one compile of their
    kernels; another length class, a fp32 bias or a view into a larger buffer compiles its own."""
    from dmattn_bench.space import FwdConfig
    from dmattn_bench.tuning.trials import suite_cases
    from dmattn_bench.tuning.tuner import _case_kernels
    from dmattn_bench.tuning.workers import leaders

    config = FwdConfig(64, 64, 4, 2)
    names = [case.name for case in suite_cases("triton", "fwd", config, "quick")]
    jobs = [("triton", "fwd", config, "bf16", "quick", "cuda", None, index) for index in range(len(names))]
    after = dict(zip(names, leaders([_case_kernels(job) for job in jobs])))
    leader = names.index("bias_posinf_at_masked")
    for same in ("bias_neginf_at_masked", "bias_neginf_at_allowed", "large_logits", "large_bias"):
        assert after[same] == (leader,)
    for alone in ("bias_posinf_at_masked", "sliced_nan_tails", "fp32_bias", "lengths_multiple_of_16"):
        assert after[alone] == ()


def test_the_sm90_backward_candidates_share_their_kernels():
    """The Triton backend names the kernels a launch compiles by the config fields each reads:
    the 16 sm90 backward candidates need 8 dK/dV kernels and 4 of each dQ kernel."""
    from dataclasses import replace
    from pathlib import Path

    from dmattn_bench.tuning.prune import load_space
    from dmattn_bench.registry import get_backend
    from dmattn_bench.space import AttentionShape

    triton = get_backend("triton")
    shape = AttentionShape(batch=1, seqlen_q=64, seqlen_k=64, num_heads=4, num_heads_kv=1, head_dim=64,
                           is_causal=True, has_mask=True, has_bias=True, bias_requires_grad=True)
    space = load_space(Path(__file__).parents[1] / "configs/space/triton-bwd.yaml", "triton", "bwd", "sm90")
    kernels = {kernel for config in space for kernel in triton.kernels("bwd", config, shape)}
    assert len(space) == 32
    assert sorted((name, sum(k[0] == name for k in kernels)) for name in {k[0] for k in kernels}) == [
        ("flash_bwd_dkdv_kernel", 8), ("flash_bwd_dq_from_ds_kernel", 8), ("flash_bwd_dq_kernel", 8),
        ("flash_bwd_preprocess_kernel", 1), ("tile_activity_kernel", 1)]
    assert triton.kernels("fwd", FwdConfig(64, 32, 4, 2), replace(shape, has_mask=False)) == (
        ("flash_fwd_kernel", 64, 32, 4, 2),)


def test_the_cuda_backend_without_a_gpu_is_a_clear_error():
    from dmattn_bench.errors import NoGpuError

    for command, arguments in ((tune_command, ["--backend", "cuda"]), (verify, ["--backend", "cuda", "--dtype", "fp32"])):
        result = CliRunner().invoke(command, arguments)
        assert isinstance(result.exception, NoGpuError), result.output
        assert "the cuda backend needs a CUDA GPU" in str(result.exception)


def test_tuning_several_backends_keeps_the_faster_winner_per_key():
    from dmattn_bench.space import BwdConfig, TableKey
    from dmattn_bench.tuning.tuner import TuneResult, Winner, combine_backends

    def key(direction):
        return TableKey(direction=direction, dtype="bf16", head_dim=128, causal=True, mask="none", bias="none",
                        gqa_ratio=1, seqlen_q_bucket=4096, seqlen_k_bucket=4096)

    def result(backend, fwd_ms, bwd_ms, wall):
        return TuneResult([Winner(key("fwd"), backend, FwdConfig(), {"median_ms": fwd_ms}),
                           Winner(key("bwd"), backend, BwdConfig(), {"median_ms": bwd_ms})], [], wall, True,
                          phases={"compile": 1.0})

    combined = combine_backends({"triton": result("triton", 0.35, 1.3, 10.0), "cuda": result("cuda", 0.66, 1.2, 5.0)})
    assert {(w.key.direction, w.backend) for w in combined.winners} == {("fwd", "triton"), ("bwd", "cuda")}
    assert combined.wall_s == 15.0 and set(combined.phases) == {"triton compile", "cuda compile"}
    # a tie stays with the backend named first
    tied = combine_backends({"triton": result("triton", 1.0, 1.0, 1.0), "cuda": result("cuda", 1.0, 1.0, 1.0)})
    assert {w.backend for w in tied.winners} == {"triton"}


def test_a_tune_of_several_backends_gives_each_the_space_files_that_name_it(tmp_path):
    """With --backend all a space file goes to the backend it names, which then tunes only the
    directions its files give; a backend no file names takes its default files."""
    from dmattn_bench.cli.tune import _spaces
    from dmattn_bench.tuning.tuner import tuned_directions

    files = (str(CONFIGS_DIR / "space" / "cuda-fwd-ws.yaml"),)
    cuda = _spaces(files, "cuda", on_gpu=False, several=True)
    triton = _spaces(files, "triton", on_gpu=False, several=True)
    assert set(cuda) == {"fwd"} and {(c.block_m, c.num_warps) for c in cuda["fwd"]} >= {(128, 12), (192, 16)}
    assert {"fwd", "bwd"} <= set(triton)  # configs/ci.yaml without a GPU
    workload = load_workloads(str(CONFIGS_DIR / "ci.yaml"), "default")[0]
    assert tuned_directions(workload, cuda) == ("fwd",) and tuned_directions(workload, triton)[:2] == ("fwd", "bwd")
    with pytest.raises(click.BadParameter, match=r"no search space given for \['bwd'\]"):
        _spaces(files, "cuda", on_gpu=False)  # one backend tunes the prefill pair
    misnamed = tmp_path / "space.yaml"
    misnamed.write_text((CONFIGS_DIR / "space" / "cuda-fwd-ws.yaml").read_text().replace("backend: cuda", "backend: cdua"))
    with pytest.raises(ValueError, match="names no backend of triton, cuda"):
        _spaces((*files, str(misnamed)), "triton", on_gpu=False, several=True)


def _bad_inputs(tmp_path) -> dict[str, str]:
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    grid = {"tokens": 20, "heads": 2, "head_dim": [32], "seqlen": [20], "causal": [True], "gqa_ratio": [1],
            "variants": [{"mask": "none", "bias": "none"}], "dtype": ["fp32"]}
    (tmp_path / "malformed.yaml").write_text("default: {tokens: [1, 2\n")
    return {
        "malformed": str(tmp_path / "malformed.yaml"),
        "list": _write(tmp_path / "list.yaml", [1, 2]),
        "zero_seqlen": _write(tmp_path / "zero.yaml", {"default": dict(grid, seqlen=[0])}),
        "head_dim_512": _write(tmp_path / "hd.yaml", {"default": dict(grid, head_dim=[512])}),
        "bf16": _write(tmp_path / "bf16.yaml", {"default": dict(grid, dtype=["bf16"])}),
        "peers": str(repo / "configs/workloads/peers-cpu.yaml"),
        "table": str(repo / "results/tables/nvidia-h100-80gb-hbm3-sm90.yaml"),
        "no_folder": str(tmp_path / "nowhere" / "t.yaml"),
        "report": str(repo / "results/bench/h100.json"),
    }


BAD_INPUTS = [  # (arguments, exit code, what the one-line error says)
    (["tune", "--workloads", "{malformed}"], 2, "not valid YAML at line"),
    (["tune", "--space", "{list}"], 2, "expected a mapping"),
    (["tune", "--workloads", "{peers}"], 2, "the bench's format"),
    (["tune", "--workloads", "{zero_seqlen}"], 2, "seqlen: got 0, expected a positive integer"),
    (["tune", "--resume"], 2, "nothing to resume: the journal tuned/cpu-interpreter.yaml.trials.jsonl does not exist"),
    (["tune", "--workloads", "{table}"], 2, "the dispatch table's format"),
    (["bench", "--workloads", "{table}"], 2, "the dispatch table's format"),
    (["tune", "--workloads", "{head_dim_512}"], 2, "head_dim: got 512, expected a multiple of 8"),
    (["tune", "--workloads", "{bf16}"], 2, "bf16 workloads need a CUDA GPU"),
    (["tune", "--out", "{no_folder}"], 2, "its folder does not exist"),
    (["tune", "--trial-timeout", "nan"], 2, "expected a positive number of seconds"),
    (["tune", "--suite-timeout", "-5"], 2, "expected a positive number of seconds"),
    (["show", "{table}", "--coverage", "{malformed}"], 2, "not valid YAML at line"),
    (["show", "{table}", "--coverage", "{peers}"], 2, "the bench's format"),
    (["bench", "--from-json", "{malformed}"], 2, "not a `bench --format json` report"),
    (["bench", "--workloads", "{malformed}"], 2, "not valid YAML at line"),
    (["bench", "--from-json", "{report}", "--only", "W1"], 2, "measures nothing: drop --only"),
    (["show", "{no_folder}"], 2, "does not exist"),
    (["show", "{table}", "--grid", "full"], 2, "pass --coverage too"),
    (["verify", "--table", "{no_folder}"], 2, "does not exist"),
]


@pytest.mark.parametrize("arguments,exit_code,says", BAD_INPUTS, ids=[" ".join(a[:3]) for a, _, _ in BAD_INPUTS])
def test_bad_input_is_a_one_line_error(tmp_path, capsys, monkeypatch, arguments, exit_code, says):
    """Malformed or nonsensical files and values end in one line that names what is wrong, with
    the exit code of its kind (1 error, 2 usage), never a traceback."""
    from dmattn_bench.cli import main

    monkeypatch.delenv("DMATTN_BENCH_DEBUG", raising=False)
    monkeypatch.chdir(tmp_path)
    paths = _bad_inputs(tmp_path)
    with pytest.raises(SystemExit) as ended:
        main([argument.format(**paths) for argument in arguments])
    stderr = capsys.readouterr().err
    assert ended.value.code == exit_code, stderr
    assert says in " ".join(stderr.split()) and "Traceback" not in stderr, stderr


def test_verify_says_when_a_table_is_stale(tmp_path):
    """A table tuned on other kernel sources is skipped at run time: verify still checks its
    configs, and says so."""
    from dmattn_bench.dispatch.table import Entry
    from dmattn_bench.tuning.table_writer import new_table, dump_table
    from dmattn_bench.hardware import CPU_FINGERPRINT

    key = load_workloads(_tiny_inputs(tmp_path, CPU_FWD.to_dict())[0])[0].key("fwd")
    table = new_table([Entry(key, "triton", CPU_FWD, {"median_ms": 1.0})], CPU_FINGERPRINT, interpreter=True)
    path = tmp_path / "stale.yaml"
    dump_table(table, path)
    document = yaml.safe_load(path.read_text())
    document["entries"][0]["validated"]["stamp"] = "sha256:" + "0" * 32  # validated on other code
    path.write_text(yaml.safe_dump(document))
    result = CliRunner().invoke(verify, ["--table", str(path), "--dtype", "fp32", "--format", "json"])
    assert result.exit_code == 0, result.output
    assert "stale" in result.stderr and "the runtime skips" in result.stderr


# -- the short-query forward (decode) in the tuner, the table and the runtime ------------------


def _decode_grid(**overrides) -> dict:
    grid = {"tokens": 48, "heads": 2, "head_dim": [32], "seqlen": [48], "seqlen_q": [1], "causal": [False],
            "gqa_ratio": [2], "variants": [{"mask": "none", "bias": "none"}], "dtype": ["fp32"]}
    return dict(grid, **overrides)


def test_a_grid_with_query_lengths_makes_kv_cache_shapes_tuned_in_the_decode_direction(tmp_path):
    path = _write(tmp_path / "w.yaml", {"default": _decode_grid(seqlen_q=[1, 4]),
                                        "bad": _decode_grid(seqlen_q=[0])})
    shapes = load_workloads(path)
    assert [(w.batch, w.seqlen_q, w.seqlen_k) for w in shapes] == [(1, 1, 48), (1, 4, 48)]
    assert {w.directions() for w in shapes} == {("decode",)}  # a serving step needs no gradient
    assert shapes[0].directions(with_decode=False) == ()
    prefill = load_workloads("configs/ci.yaml")  # Lq = Lk <= 64: all three, the decode one without gradient
    assert {w.directions() for w in prefill} == {("fwd", "bwd", "decode")}
    long = load_workloads(_write(tmp_path / "l.yaml", {"default": _decode_grid(seqlen=[96], seqlen_q=[96])}))
    assert long[0].directions() == ("fwd", "bwd")
    assert shapes[0].key("decode") == dataclasses.replace(shapes[0].key("fwd"), direction="decode")
    with pytest.raises(ValueError, match="seqlen_q: got 0, expected a positive integer"):
        load_workloads(path, "bad")


def test_a_decode_config_reads_num_splits_zero_as_auto_and_rejects_negatives(tmp_path):
    assert config_from_dict(DecodeConfig, {"block_n": 32, "num_splits": 0}) == DecodeConfig(32, 4, 2, 0)
    with pytest.raises(ValueError, match=r"DecodeConfig.num_splits: expected an int >= 0, got -1"):
        config_from_dict(DecodeConfig, {"num_splits": -1})
    with pytest.raises(ValueError, match=r"FwdConfig.block_m: expected a positive int, got 0"):
        config_from_dict(FwdConfig, {"block_m": 0})
    decode_key = load_workloads(_write(tmp_path / "w.yaml", {"default": _decode_grid()}))[0].key("decode")
    table = new_table([Entry(decode_key, "triton", DecodeConfig(32, 1, 1, 0), {"median_ms": 1.0})], CPU_FINGERPRINT,
                      interpreter=True)
    dump_table(table, tmp_path / "t.yaml")
    assert load_table(tmp_path / "t.yaml").entries == table.entries
    text = (tmp_path / "t.yaml").read_text().replace("num_splits: 0", "num_splits: -1")
    (tmp_path / "bad.yaml").write_text(text)
    with pytest.raises(TableError, match=r"config.num_splits: expected an int >= 0, got -1"):
        load_table(tmp_path / "bad.yaml")
    (tmp_path / "cuda.yaml").write_text((tmp_path / "t.yaml").read_text().replace("backend: triton", "backend: cuda"))
    with pytest.raises(TableError, match=r"backend: got 'cuda' for a decode entry, expected 'triton'"):
        load_table(tmp_path / "cuda.yaml")


def test_a_merge_keeps_the_other_keys_and_each_entrys_own_validation():
    """A merged table holds the tuned entries as the tune validated them and the kept entries of
    other keys as they were: a kept stale entry stays stale, waiting for a restamp."""
    grid = load_workloads("configs/ci.yaml")[0]
    fwd, bwd, decode = (grid.key(d) for d in ("fwd", "bwd", "decode"))

    def table(entries, suite):
        return new_table([Entry(k, "triton", c, {"median_ms": 1.0}) for k, c in entries], CPU_FINGERPRINT, True,
                         suite=suite)

    kept = table([(fwd, CPU_FWD), (bwd, CPU_BWD)], "full")
    tuned = table([(decode, DecodeConfig(32, 1, 1, 0)), (bwd, dataclasses.replace(CPU_BWD, block_n=32))], "quick")
    result = merged(kept, tuned)
    assert {(e.key.direction, e.config, e.validated.suite) for e in result.entries} == {
        ("decode", DecodeConfig(32, 1, 1, 0), "quick"), ("bwd", dataclasses.replace(CPU_BWD, block_n=32), "quick"),
        ("fwd", CPU_FWD, "full")}
    (kept_fwd,) = [e for e in kept.entries if e.key == fwd]
    assert [e for e in result.entries if e.key == fwd] == [kept_fwd]
    old = Validation("sha256:" + "0" * 32, "2026-11-20T00:00:00+00:00", "full")
    stale = dataclasses.replace(kept, entries=tuple(dataclasses.replace(e, validated=old, stale="kernel edit")
                                                    if e.key == fwd else e for e in kept.entries))
    (carried,) = [e for e in merged(stale, tuned).entries if e.key == fwd]
    assert (carried.validated, carried.stale) == (old, "kernel edit")  # waits for a restamp
    assert merged(kept, dataclasses.replace(tuned, entries=())).entries == kept.entries
    foreign = dataclasses.replace(kept, interpreter=False)
    with pytest.raises(TableError, match="cannot merge"):
        merged(foreign, tuned)


def test_tuned_decode_keys_merged_into_a_table_are_verified_and_dispatched(tmp_path, monkeypatch):
    """`tune --merge` adds the decode winners to an existing table; `verify` runs their configs on
    the decode cases and on cases shaped like their keys; a call without gradient of such a shape
    runs the short-query forward with the tuned config."""
    prefill_key = load_workloads("configs/ci.yaml")[0].key("fwd")
    prior = tmp_path / "prior.yaml"
    dump_table(new_table([Entry(prefill_key, "triton", CPU_FWD, {"median_ms": 1.0})], CPU_FINGERPRINT, True), prior)
    workloads = _write(tmp_path / "w.yaml", {"default": _decode_grid()})
    alternative = DecodeConfig(32, 1, 1, 0)
    space = _write(tmp_path / "space.yaml", {"space": {"triton": {
        "fwd": {k: [v] for k, v in CPU_FWD.to_dict().items()}, "bwd": {k: [v] for k, v in CPU_BWD.to_dict().items()},
        "decode": {k: [v] for k, v in alternative.to_dict().items()}}}})
    out = tmp_path / "T.yaml"
    runner = CliRunner()
    result = runner.invoke(tune_command, ["--workloads", workloads, "--space", space, "--out", str(out),
                                          "--merge", str(prior), "--format", "json"])
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    assert document["counts"] == {"ok": 2} and document["entries"] == 1  # the default and the alternative
    (winner,) = document["winners"]
    assert winner["key"]["direction"] == "decode" and winner["key"]["seqlen_q_bucket"] == 1
    table = load_table(out)
    assert {e.key.direction for e in table.entries} == {"fwd", "decode"}  # the prior entry is kept
    decode_entry = next(e for e in table.entries if e.key.direction == "decode")

    verified = runner.invoke(verify, ["--table", str(out), "--dtype", "fp32", "--format", "json"])
    assert verified.exit_code == 0, verified.output
    labels = [suite["configs"] for suite in json.loads(verified.stdout)["entries"]]
    assert f"triton-decode {config_label(decode_entry.config)} (1 entries)" in labels

    built = _decode_configs_built(monkeypatch)
    dispatch.use_table(out)
    assert tiles.choose(decode_entry.key, "cpu").source == f"table:{out}"
    inputs = build_inputs(load_workloads(workloads)[0].case(), torch.float32, "cpu")
    with torch.no_grad():
        flash_dmattn_func(inputs.q, inputs.k, inputs.v)
    assert built == [decode_entry.config]


def _decode_configs_built(monkeypatch) -> list:
    """The configs of the short-query forward plans built from now on, in order."""
    from dmattn_kernels.triton import decode_launch

    built = []
    original = decode_launch.DecodePlan.__init__
    monkeypatch.setattr(decode_launch.DecodePlan, "__init__",
                        lambda self, *a, **k: original(self, *a, **k) or built.append(k["config"]))
    return built


@pytest.mark.parametrize("variant", ["none", "padding mask", "cache_seqlens", "paged"])
def test_a_call_without_gradient_runs_the_decode_entry_of_its_workloads_key(tmp_path, monkeypatch, variant):
    """The runtime derives a decode call's key as the tuner derives its workload's (a padding mask
    at one query row is `shared`; `cache_seqlens` and a paged cache keep the cache's logical
    length) and runs that entry's config, one no default has."""
    mask = "per_key" if variant == "padding mask" else "none"
    workload = load_workloads(_write(tmp_path / "w.yaml", {"default": _decode_grid(
        variants=[{"mask": mask, "bias": "none"}])}))[0]
    tuned = DecodeConfig(32, 1, 1, 2)
    table = tmp_path / "t.yaml"
    dump_table(new_table([Entry(workload.key("decode"), "triton", tuned, {"median_ms": 1.0})], CPU_FINGERPRINT, True),
               table)
    built = _decode_configs_built(monkeypatch)
    dispatch.use_table(table)
    inputs = build_inputs(workload.case(), torch.float32, "cpu")
    k, v, options = inputs.k, inputs.v, {}
    if variant == "padding mask":
        options["attn_mask"] = inputs.mask
    if variant in ("cache_seqlens", "paged"):
        options["cache_seqlens"] = torch.full((workload.batch,), workload.seqlen_k - 5, dtype=torch.int32)
    if variant == "paged":
        k, v, options["block_table"] = paged_cache(k, v, 16, torch.Generator().manual_seed(0), options["cache_seqlens"])
    with torch.no_grad():
        out = flash_dmattn_func(inputs.q, k, v, **options)
    assert built == [tuned] and torch.isfinite(out).all()


def test_tune_stale_retunes_exactly_the_stale_entries(tmp_path):
    """`tune --stale --merge T` tunes again only T's entries that are not current, on a workload of
    each one's key, and leaves the others as they were (validation dates included)."""
    from dmattn_bench.tuning.workloads import workload_of_key

    stale_key = TableKey("fwd", "fp32", 32, True, "kv_head", "per_key", 2, 16, 16)
    kept_key = dataclasses.replace(stale_key, head_dim=64)
    assert workload_of_key(stale_key, small=True).key("fwd") == stale_key
    entries = [Entry(key, "triton", CPU_FWD, {"median_ms": 1.0}) for key in (stale_key, kept_key)]
    table = new_table(entries, CPU_FINGERPRINT, interpreter=True)
    old = Validation("sha256:" + "0" * 32, "2020-01-01T00:00:00+00:00", "quick")  # validated on other code
    table = dataclasses.replace(table, entries=(dataclasses.replace(table.entries[0], validated=old),
                                                table.entries[1]))
    path = tmp_path / "T.yaml"
    dump_table(table, path)
    space = _write(tmp_path / "ci.yaml", {"space": {"triton": {
        "fwd": {k: [v] for k, v in CPU_FWD.to_dict().items()},
        "bwd": {k: [v] for k, v in CPU_BWD.to_dict().items()}}}})
    result = CliRunner().invoke(tune_command, ["--stale", "--merge", str(path), "--space", space])
    assert result.exit_code == 0, result.output
    written = {entry.key: entry for entry in load_table(path).entries}
    assert set(written) == {stale_key, kept_key}  # the stale key's bwd was tuned too, but not written
    assert written[stale_key].validated.date != old.date and written[stale_key].stale is None
    assert written[kept_key].validated == table.entries[1].validated
    before = path.read_text()
    again = CliRunner().invoke(tune_command, ["--stale", "--merge", str(path), "--space", space])
    assert again.exit_code == 0 and "no stale or unvalidated entries" in again.output and path.read_text() == before
    usage = CliRunner().invoke(tune_command, ["--stale"])
    assert usage.exit_code == 2 and "--merge TABLE" in usage.output


def test_a_case_two_suites_share_is_one_case_job():
    """A config chosen for keys of head dims 64 and 128 lists the smaller suite's cases in both
    suites: as case jobs they are one (same code, same inputs), and only its own dtype, config
    and direction tell two jobs of a case apart."""
    from dmattn_bench.tuning.trials import CaseJob, suite_cases
    from dmattn_bench.tuning.tuner import _case_identity

    config = FwdConfig(64, 64, 4, 2)
    jobs = [CaseJob("triton", "fwd", config, "bf16", "quick", "cpu", head_dim, index)
            for head_dim in (64, 128) for index in range(len(suite_cases("triton", "fwd", config, "quick", head_dim)))]
    small = len(suite_cases("triton", "fwd", config, "quick", 64))
    distinct = {_case_identity(job) for job in jobs}
    assert 0 < small < len(jobs) - small and len(distinct) == len(jobs) - small
    other = [job._replace(dtype_name="fp16") for job in jobs] + [job._replace(config=FwdConfig(64, 64, 4, 3)) for job in jobs]
    assert len(distinct | {_case_identity(job) for job in other}) == 3 * len(distinct)


def test_a_compile_worker_s_problem_has_the_measured_layouts_and_writes_nothing():
    """The sweep tune's timings spread 14% at the median (p80 - p20 over the median) where
    earlier tunes' spread 0.3%: its compile workers drew whole B4 H16 L4096 masks and biases on
    the GPU beside the timed kernels. A compile worker's problem (`trials.warm_job`) has the
    measuring worker's shapes, strides, dtypes and storage offsets, and building it dispatches
    no operation that writes values: allocations and views only."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from dmattn_bench.tuning.trials import _Problem

    class Dispatched(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops: set[str] = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.add(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    names = ("q", "k", "v", "mask", "bias", "dout", "out", "lse", "dq", "dk", "dv", "dbias", "ref_out", "ref_lse")

    def tensors(problem):
        o = problem.operands
        found = dict(q=o.q, k=o.k, v=o.v, mask=problem.mask, bias=problem.bias, dout=o.dout, out=problem.out,
                     lse=problem.lse, dq=problem.dq, dk=problem.dk, dv=problem.dv, dbias=problem.dbias,
                     ref_out=problem.ref_out, ref_lse=problem.ref_lse)
        return {n: None if t is None else (t.shape, t.stride(), t.dtype, t.storage_offset()) for n, t in found.items()}

    kinds = [("none", "none", False), ("full", "full", True), ("kv_head", "kv_head", False),
             ("per_key", "per_key", True), ("none", "per_key", False), ("kv_head", "full", True)]
    allocations_and_views = {"empty", "empty_strided", "empty_like", "transpose", "view", "as_strided", "unsqueeze",
                             "expand", "alias", "slice", "select", "_reshape_alias", "reshape", "detach", "squeeze"}
    for mask, bias, bias_grad in kinds:
        for causal, heads_kv in ((True, 2), (False, 4)):
            workload = Workload(2, 4, heads_kv, 40, 48, 32, causal, mask, bias, bias_grad, "fp16")
            recorder = Dispatched()
            with recorder:
                unwritten = _Problem(workload, torch.device("cpu"), compile_only=True)
            written = _Problem(workload, torch.device("cpu"))
            assert tensors(unwritten) == tensors(written), workload.label
            assert recorder.ops <= allocations_and_views, (workload.label, recorder.ops - allocations_and_views)


def test_a_tune_says_when_its_timings_spread_more_than_a_kernel_does():
    """The sweep tune's timings spread 14% at the median, half of them over 10%, and nothing said
    so: its winners came from noise. A tune whose timed trials spread over 5% in more than a
    tenth of them says so; steady timings (earlier H200 tunes: 0.2-0.4%) say nothing."""
    from dmattn_bench.tuning.trials import Trial
    from dmattn_bench.tuning.tuner import TuneResult, noisy_timings

    def result(spreads):
        trials = [Trial("w", {}, "fwd", "triton", {}, "ok", median_ms=1.0, spread=s) for s in spreads]
        trials.append(Trial("w", {}, "fwd", "triton", {}, "unsupported"))  # untimed: not counted
        return TuneResult([], trials, 1.0, True)

    steady = result([0.003, 0.004, 0.002, 0.08, 0.005, 0.004, 0.003, 0.006, 0.002, 0.004, 0.003])
    assert steady.timing_spread() == {"median": 0.004, "noisy": 1, "timed": 11}
    assert noisy_timings(steady.timing_spread()) is None
    crowded = result([0.14, 0.4, 0.003, 0.55, 0.02, 0.87, 0.004])
    assert crowded.timing_spread() == {"median": 0.14, "noisy": 4, "timed": 7}
    said = noisy_timings(crowded.timing_spread())
    assert said.startswith("4 of 7 timed trials spread over 5%") and "14.0% at the median" in said
    assert noisy_timings(None) is None
