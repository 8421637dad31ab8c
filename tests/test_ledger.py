"""The adversarial-case ledger (`dmattn_bench.tuning.ledger`): a case that passed on the same code
answers from it; a kernel change runs again exactly the cases whose programs it changed, a host
change every case; failures and runs without a ledger always run. In the interpreter, on the
Triton kernels."""

from __future__ import annotations

import json

import pytest
import torch

from dmattn_bench.registry import get_backend
from dmattn_bench.space import BwdConfig, FwdConfig
from dmattn_bench.tuning import ledger
from dmattn_bench.tuning.adversarial import Case
from dmattn_bench.tuning.validator import check_case

FWD, BWD = FwdConfig(16, 16, 1, 1), BwdConfig(16, 16, 16, 16, 1, 1)
MASKED = Case("ledger_masked", seqlen_q=20, seqlen_k=24, mask="random", mask_shape="full", bias="full",
              bias_grad=True)
PLAIN = Case("ledger_plain", seqlen_q=17, seqlen_k=17, causal=True)


@pytest.fixture
def runs(tmp_path, monkeypatch):
    """Each case's kernel runs (the number of times `run_kernel` was entered), under a ledger."""
    from dmattn_bench.tuning import validator

    counted: dict[str, int] = {}
    original = validator.run_kernel

    def counting(backend, inputs, case, *args):
        counted[case.name] = counted.get(case.name, 0) + 1
        return original(backend, inputs, case, *args)

    monkeypatch.setattr(validator, "run_kernel", counting)
    with ledger.ledger_for_workers(tmp_path / "ledger" / "cases.jsonl"):
        yield counted


def _check(case, fwd=FWD, bwd=BWD):
    return check_case(get_backend("triton"), case, torch.float32, "cpu", fwd, bwd)


def test_a_passed_case_answers_from_the_ledger_with_its_checks(runs):
    first = _check(MASKED)
    assert first.status == "ok" and not first.replayed and runs == {MASKED.name: 2}  # run twice: determinism
    again = _check(MASKED)
    assert again.status == "ok" and again.replayed and runs == {MASKED.name: 2}
    assert again.checks == first.checks
    # another dtype, config or seed is another case
    assert not _check(MASKED, fwd=FwdConfig(32, 16, 2, 1)).replayed
    assert not check_case(get_backend("triton"), MASKED, torch.float32, "cpu", FWD, BWD, seed=1).replayed


def test_the_programs_a_run_launched_are_kept_with_their_digests(runs, tmp_path):
    _check(MASKED)
    (record,) = [json.loads(line) for line in (tmp_path / "ledger" / "cases.jsonl").read_text().splitlines()]
    names = {program["name"] for program in record["programs"]}
    assert any("fwd" in name for name in names) and any("bwd" in name for name in names), names
    assert all(program["module"].startswith("dmattn_kernels.triton") and len(program["digest"]) == 64
               for program in record["programs"])


def test_a_kernel_change_runs_again_only_the_cases_whose_programs_it_changed(runs, monkeypatch):
    _check(MASKED)
    _check(PLAIN)
    from dmattn_bench.dispatch import stamps

    original = stamps.program_digest

    def changed(program, arch):  # an edit to the kernels a masked call compiles (HAS_MASK on)
        digest = original(program, arch)
        return "edited" + digest if dict(program.parameters).get("HAS_MASK") else digest

    monkeypatch.setattr(stamps, "program_digest", changed)
    assert not _check(MASKED).replayed and runs[MASKED.name] == 4
    assert _check(PLAIN).replayed and runs[PLAIN.name] == 2


def test_a_host_change_runs_every_case_again(runs, monkeypatch):
    _check(PLAIN)
    monkeypatch.setattr(ledger, "_host_digest", lambda: "another host")
    assert not _check(PLAIN).replayed and runs[PLAIN.name] == 4


def test_a_failed_case_is_not_kept_and_without_a_ledger_every_case_runs(runs, tmp_path):
    from dmattn_bench.registry import Backend
    from dmattn_bench.tuning import validator

    triton = get_backend("triton")

    def zero_forward(q, k, v, mask, bias, *, out, lse, **options):  # writes a wrong result
        triton.forward(q, k, v, mask, bias, out=out, lse=lse, **options)
        out.zero_()

    broken = Backend("triton", zero_forward, triton.backward, triton.is_supported)
    assert check_case(broken, PLAIN, torch.float32, "cpu", FWD, None).status == "mismatch"
    assert check_case(broken, PLAIN, torch.float32, "cpu", FWD, None).status == "mismatch"
    assert not (tmp_path / "ledger" / "cases.jsonl").exists()
    with ledger.ledger_for_workers(None):
        assert validator.check_case(triton, PLAIN, torch.float32, "cpu", FWD, BWD).status == "ok"
        assert not validator.check_case(triton, PLAIN, torch.float32, "cpu", FWD, BWD).replayed


def test_a_torn_line_is_skipped(runs, tmp_path):
    path = tmp_path / "ledger" / "cases.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text('{"case": "a torn li\n')
    assert not _check(PLAIN).replayed
    assert _check(PLAIN).replayed


def test_verify_answers_a_second_run_from_the_ledger_and_no_ledger_runs_every_case(tmp_path, monkeypatch):
    """`verify` (one small entry, no decode suites: the command's path, not the suite's size) keeps
    what passed; run again, it answers those cases from the ledger and says so; `--no-ledger`
    runs them."""
    from click.testing import CliRunner

    from dmattn_bench.cli import verify as verify_module
    from dmattn_bench.dispatch.table import Entry
    from dmattn_bench.hardware import CPU_FINGERPRINT
    from dmattn_bench.space import TableKey
    from dmattn_bench.tuning.table_writer import dump_table, new_table

    monkeypatch.setenv(ledger.LEDGER_ENV, str(tmp_path / "cases.jsonl"))
    monkeypatch.setattr(verify_module, "_decode", lambda backend, device, suite: [])
    monkeypatch.setattr(verify_module, "plan_table_entries", _first_cases(verify_module.plan_table_entries, 2))
    key = TableKey("fwd", "fp32", 32, True, "none", "none", 1, 16, 16)
    path = tmp_path / "t.yaml"
    dump_table(new_table([Entry(key, "triton", FWD, {})], CPU_FINGERPRINT, interpreter=True), path)

    def verify(*extra):
        result = CliRunner().invoke(verify_module.verify, ["--table", str(path), "--dtype", "fp32", "--format", "json",
                                                           *extra])
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)["ledger_answered"], result.stderr

    answered, said = verify()
    assert answered == 0 and "answered from the case ledger" not in said
    answered, said = verify()
    assert answered == 2 and "2 of 2 cases answered from the case ledger" in said
    assert verify("--no-ledger")[0] == 0


def _first_cases(plan, count):
    """`plan_table_entries` with each planned suite cut to its first `count` cases."""
    import dataclasses

    return lambda *args, **kwargs: [dataclasses.replace(item, cases=item.cases[:count])
                                    for item in plan(*args, **kwargs)]


def test_a_second_tune_answers_its_winners_suites_from_the_ledger(tmp_path, monkeypatch):
    """A tune keeps what its winners' suites passed; another tune of the same workloads (a new
    table and journal) answers those cases from the ledger, and its winners' evidence says so."""
    from click.testing import CliRunner

    from dmattn_bench.cli.tune import tune_command
    from dmattn_bench.dispatch import load_table
    from dmattn_bench.tiles import default_configs
    from tests.test_tune import _tiny_inputs

    monkeypatch.setenv(ledger.LEDGER_ENV, str(tmp_path / "cases.jsonl"))
    workloads, space = _tiny_inputs(tmp_path, default_configs(32, "cpu")[0].to_dict())
    notes = []
    for name in ("first", "second"):
        out = tmp_path / f"{name}.yaml"
        result = CliRunner().invoke(tune_command, ["--workloads", workloads, "--space", space, "--out", str(out)])
        assert result.exit_code == 0, result.output
        notes.append(sorted(entry.evidence["adversarial"] for entry in load_table(out).entries))
    assert notes[0] and not any("ledger" in note for note in notes[0])
    assert all("answered from the case ledger" in note for note in notes[1]), notes[1]


def test_a_suite_case_job_of_the_gpu_phase_reports_what_the_ledger_answered(runs):
    """The tuner's parallel suite phase (one case per job, `trials.suite_case_job`) keeps and
    replays through the same ledger, and its result says which answered (its note counts them)."""
    from dmattn_bench.tuning.trials import CaseJob, suite_case_job, suite_verdict

    job = CaseJob("triton", "fwd", FWD, "fp32", "quick", "cpu", None, 0)
    first, second = suite_case_job(job), suite_case_job(job)
    assert first.status == second.status == "ok" and not first.replayed and second.replayed
    assert suite_verdict([first, second], "quick") == ("ok", "quick suite, 2 cases (1 answered from the case ledger)")
