"""The packed-sequence and sliding-window half of the adversarial suite (issue 56): its cases and
inputs, their run through the Triton kernels in the interpreter on a small config's own tiles,
and broken backends that it catches. CPU tier: fp32, tiny shapes, no timing."""

import dataclasses
import json
import math

import pytest
import torch
from click.testing import CliRunner

from dmattn_bench.registry import Backend, get_backend
from dmattn_bench.space import BwdConfig, FwdConfig, TableKey
from dmattn_bench.tuning import varlen_cases
from dmattn_bench.tuning.adversarial import Case, adversarial_cases, build_inputs
from dmattn_bench.tuning.validator import (VARLEN_LABEL, check_case, config_suite, entry_case, plan_table_entries,
                                           validate)

FWD, BWD = FwdConfig(16, 16, 1, 1), BwdConfig(16, 16, 16, 16, 1, 1)
CASES = {case.name: case for case in adversarial_cases("quick", [(16, 16)], varlen=True)}


# -- the cases and their inputs -----------------------------------------------------------------------

def test_window_cases_are_built_on_each_tile_of_the_config():
    """A window rule gives, per distinct tile of the configs, a window whose edges fall on that
    tile's multiples (dense and packed); other cases appear once."""
    cases = config_suite("triton", "quick", FwdConfig(32, 16, 1, 1), BwdConfig(16, 64, 16, 16, 1, 1), varlen=True)
    names = [case.name for case in cases]
    assert len(names) == len(set(names))
    by_name = {case.name: case for case in cases}
    assert by_name["window_causal_key_tile@32x16"].window_size == (16, -1)
    assert by_name["window_causal_key_tile@16x64"].window_size == (64, -1)
    assert by_name["window_both_sides@32x16"].window_size == (15, 32)
    assert by_name["window_right_side_only@16x16"].window_size == (-1, 16)
    assert by_name["packed_window_both_sides@16x64"].window_size == (15, 64)
    assert "packed_zero_one_token" in by_name and not any(n.startswith("packed_zero_one_token@") for n in names)
    dense = {case.name for case in config_suite("triton", "quick", FWD, BWD)}
    assert not dense & {case.name for case in cases}  # the dense suite stays as it was


def test_the_suite_covers_the_packed_features_of_design_section_2():
    packed = [case for case in CASES.values() if case.packed]
    assert any(0 in case.documents and 1 in case.documents for case in packed)  # zero- and one-token sequences
    assert any(case.seqused for case in packed) and any(case.unowned for case in packed)
    assert any(case.dead_documents for case in packed)
    assert {case.mask_shape for case in packed if case.mask != "none"} >= {"key", "kv_head", "full"}
    assert {case.bias for case in packed} >= {"per_key", "full", "kv_head"}
    assert any(case.window_rule for case in packed) and any(case.window_rule and not case.packed
                                                            for case in CASES.values())
    for case in packed:  # lengths that divide no tile
        assert any(n % 16 for n in case.documents if n)


def test_packed_inputs_hold_nan_wherever_no_row_may_read():
    """Keys of sequences without query rows, keys past seqused_k, rows and keys no sequence owns,
    the memory around each operand: NaN (True for a mask); the rows the sequences own: finite."""
    case = CASES["packed_nan_neighbours_per_row"]
    inputs = build_inputs(case, torch.float32, "cpu")
    layout = varlen_cases.packed_layout(case)
    cu_q, cu_k = layout.cu_seqlens_q, layout.cu_seqlens_k
    assert inputs.owned_rows == (cu_q[0], cu_q[-1]) == (3, 3 + sum(case.documents))
    assert inputs.max_seqlens == (37, 37)
    assert torch.isnan(inputs.k[cu_k[1]:cu_k[2]]).all() and torch.isnan(inputs.v[cu_k[3]:cu_k[4]]).all()
    assert torch.isfinite(inputs.k[cu_k[0]:cu_k[1]]).all() and torch.isfinite(inputs.k[cu_k[2]:cu_k[3]]).all()
    assert torch.isnan(inputs.q[:3]).all() and torch.isnan(inputs.q[cu_q[-1]:]).all()
    assert torch.isfinite(inputs.q[3:cu_q[-1]]).all()
    # the memory around: past total and before the first row
    for t in (inputs.q, inputs.k, inputs.v):
        base = t.untyped_storage()
        whole = torch.empty(0, dtype=t.dtype).set_(base)
        assert torch.isnan(whole[:t.storage_offset()]).all() and t.storage_offset() > 0
    # a per-row bias: NaN past each sequence's keys; a per-row mask: True there
    s = 0
    rows = slice(cu_q[s], cu_q[s + 1])
    assert torch.isnan(inputs.bias[:, rows, case.documents_k[s]:]).all()
    assert inputs.mask[:, rows, case.documents_k[s]:].all()
    assert inputs.bias.shape == (case.heads, layout.total_q, 37) and inputs.mask.shape == (case.heads_kv,
                                                                                         layout.total_q, 37)
    used = CASES["packed_seqused_per_key"]
    inputs = build_inputs(used, torch.float32, "cpu")
    cu_k = varlen_cases.packed_layout(used).cu_seqlens_k
    assert torch.isnan(inputs.k[cu_k[0] + 33:cu_k[1]]).all() and torch.isnan(inputs.bias[:, cu_k[0] + 33:cu_k[1]]).all()
    assert inputs.sequences[2].tolist() == [33, 41, 0, 9]


def test_an_entry_case_of_a_packed_or_windowed_key_is_one():
    key = TableKey("bwd", "bf16", 128, True, "kv_head", "per_key+grad", 4, 4096, 4096, packed=True, window=1024)
    case = entry_case(key)
    assert case.packed and case.documents == (4096, 1366) and case.window_size == (1023, 0)
    assert "packed window 1024" in case.name


def test_verify_plans_the_varlen_suite_for_packed_and_windowed_entries():
    from dmattn_bench.dispatch.table import Entry

    dense = TableKey("fwd", "fp32", 32, True, "none", "none", 1, 64, 64)
    entries = [Entry(dense, "triton", FWD, {}), Entry(dataclasses.replace(dense, packed=True), "triton", FWD, {}),
               Entry(dataclasses.replace(dense, window=16), "triton", FWD, {})]
    planned = plan_table_entries(entries, "fp32", "cpu", "quick")
    labels = sorted(item.label for item in planned)
    assert len(planned) == 2 and labels[0].startswith(VARLEN_LABEL + ": triton fwd 16x16")
    assert "(2 entries)" in labels[0] and not labels[1].startswith(VARLEN_LABEL)
    varlen = next(item for item in planned if item.label.startswith(VARLEN_LABEL))
    names = {case.name for case in varlen.cases}
    assert "packed_zero_one_token" in names and "sliced_nan_tails" not in names
    assert sum(case.packed for case in varlen.cases if case.name.startswith("entry")) == 1


# -- runs -------------------------------------------------------------------------------------------------

def test_the_varlen_suite_passes_on_a_small_triton_config():
    """Every packed and window case, forward and backward through the Triton kernels (the
    interpreter), within the §2 bound, twice bitwise."""
    result = validate("triton", FWD, BWD, torch.float32, "cpu", cases=config_suite("triton", "quick", FWD, BWD,
                                                                                   varlen=True))
    bad = [(c.case, c.status, c.reason) for c in result.cases if c.status != "ok"]
    assert not bad
    assert {"out", "lse", "dq", "dk", "dv", "dbias"} <= set(result.worst_ratios())


@pytest.mark.parametrize("name", ["packed_seqused_per_key", "window_both_sides@16x16", "packed_dead_document"])
def test_the_reference_backend_runs_packed_and_windowed_calls(name):
    """The reference behind the launchers' interface (`registry`) takes window, packing and
    sequences, and writes only the rows its sequences own, as the Triton launchers do."""
    result = check_case(get_backend("reference"), CASES[name], torch.float32, "cpu", FWD, BWD)
    assert result.status == "ok", result.reason


def _broken(name: str, forward=None, backward=None) -> Backend:
    """The Triton backend with its launchers wrapped."""
    real = get_backend("triton")
    return Backend(name, forward or real.forward, backward or real.backward, real.is_supported)


def _reads_the_previous_sequence(q, k, v, mask, bias, *, sequences=(None, None, None), **options):
    """A forward whose sequences start one key early: each reads its neighbour's last key."""
    cu_seqlens_q, cu_seqlens_k, seqused_k = sequences
    shifted = cu_seqlens_k.clone()
    shifted[1:-1] -= 1
    get_backend("triton").forward(q, k, v, mask, bias, sequences=(cu_seqlens_q, shifted.clamp(min=0), seqused_k),
                                  **options)


def _ignores_seqused(q, k, v, mask, bias, *, packing=None, sequences=(None, None, None), **options):
    """A forward that reads every key of each span, past its seqused_k count."""
    packing = dataclasses.replace(packing, seqused_k=False, max_seqlen_k=k.shape[1])
    get_backend("triton").forward(q, k, v, mask, bias, packing=packing, sequences=(*sequences[:2], None), **options)


def _ignores_window(q, k, v, mask, bias, *, window=(-1, -1), **options):
    get_backend("triton").forward(q, k, v, mask, bias, **options)


def _skips_rows_of_keyless_sequences(q, k, v, mask, bias, *, out, lse, **options):
    """A forward that writes nothing for rows without a key (leaves the poison there)."""
    before_out, before_lse = out.clone(), lse.clone()
    get_backend("triton").forward(q, k, v, mask, bias, out=out, lse=lse, **options)
    dead = lse == -math.inf
    lse[dead] = before_lse[dead]
    out.copy_(torch.where(dead.transpose(1, 2).unsqueeze(-1), before_out, out))


@pytest.mark.parametrize("forward, name, statuses", [
    (_reads_the_previous_sequence, "packed_nan_neighbours_per_row", {"nonfinite", "mismatch"}),
    (_reads_the_previous_sequence, "packed_zero_one_token", {"nonfinite", "mismatch"}),
    (_ignores_seqused, "packed_seqused_per_key", {"nonfinite"}),
    (_ignores_window, "window_causal_key_tile@16x16", {"mismatch"}),
    (_ignores_window, "packed_window_both_sides@16x16", {"nonfinite", "mismatch"}),
    (_skips_rows_of_keyless_sequences, "packed_zero_one_token", {"nonfinite"}),
    (_skips_rows_of_keyless_sequences, "packed_dead_document", {"nonfinite"}),
])
def test_a_broken_backend_fails_the_varlen_cases(forward, name, statuses):
    result = check_case(_broken("triton", forward), CASES[name], torch.float32, "cpu", FWD, None)
    assert result.status in statuses, (result.status, result.reason)


def test_a_backend_that_reads_a_neighbour_fails_the_suite():
    """The whole suite's verdict, as the tuner and verify take it, fails on such a backend."""
    from dmattn_bench.tuning.validator import SuiteResult

    backend = _broken("triton", _reads_the_previous_sequence)
    cases = [case for case in config_suite("triton", "quick", FWD, None, varlen=True) if case.packed][:3]
    results = [check_case(backend, case, torch.float32, "cpu", FWD, None) for case in cases]
    assert SuiteResult("triton", FWD, None, "float32", results).status != "ok"


def test_the_cuda_backend_reports_the_varlen_cases_its_kernels_cannot_run_unsupported():
    """Without running anything: a packed case with a forward that is not the overlapped
    warp-specialized kernel, or with a backward that is not the warp-specialized one, or a mask or
    bias of query rows; a window case with a forward that is not the overlapped
    warp-specialized kernel, or a backward that is not the warp-specialized one."""
    cuda = Backend("cuda", None, None, lambda config, shape: None)
    packed = CASES["packed_zero_one_token"]  # a per-key bias
    for fwd, bwd, case, message in ((FWD, BWD, packed, "a packed call runs in the CUDA forward's overlapped"),
                                    (None, BWD, packed, "a packed call runs in the CUDA backward's warp-specialized"),
                                    (None, BWD, CASES["packed_nan_neighbours_per_row"], "per-key mask and bias only")):
        result = check_case(cuda, case, torch.float32, "cpu", fwd, bwd)
        assert result.status == "unsupported" and message in result.reason
    for fwd, bwd, message in ((FWD, None, "overlapped warp-specialized kernel only"),
                              (None, BWD, "CUDA backward's warp-specialized kernel only")):
        result = check_case(cuda, CASES["window_both_sides@16x16"], torch.float32, "cpu", fwd, bwd)
        assert result.status == "unsupported" and message in result.reason


def test_verify_labels_packed_and_windowed_rows(tmp_path, monkeypatch):
    """`verify --table` runs a packed/window entry's config on the packed/window cases and its
    report says so (one small case here, and no decode suites: the command's path, not the suite's size)."""
    from dmattn_bench.cli import verify as verify_module
    from dmattn_bench.dispatch.table import Entry
    from dmattn_bench.hardware import CPU_FINGERPRINT
    from dmattn_bench.tuning.table_writer import dump_table, new_table

    small = Case("packed_small", heads=2, heads_kv=1, causal=True, bias="per_key", documents=(9, 0, 17),
                 documents_k=(9, 5, 17))
    monkeypatch.setitem(varlen_cases.VARLEN_SUITES, "quick", lambda: [small])
    monkeypatch.setattr(verify_module, "_decode", lambda backend, device, suite: [])
    key = TableKey("fwd", "fp32", 32, True, "none", "per_key", 2, 16, 16, packed=True)
    path = tmp_path / "t.yaml"
    dump_table(new_table([Entry(key, "triton", FWD, {})], CPU_FINGERPRINT, interpreter=True), path)
    result = CliRunner().invoke(verify_module.verify, ["--table", str(path), "--dtype", "fp32", "--format", "json"])
    assert result.exit_code == 0, result.output
    (row,) = json.loads(result.stdout)["entries"]
    assert row["configs"].startswith(VARLEN_LABEL) and row["status"] == "ok"
    assert [case["case"] for case in row["cases"]] == ["packed_small", entry_case(key).name]



def test_a_packed_tuning_workload_times_contiguous_rows_and_the_suite_poisons_past_the_head_dim():
    """The tuner times a packed workload on K/V rows laid out as a user's (contiguous: strides a
    multiple of 16 elements, as Triton specialises them); the suite's cases keep NaN past the
    head dim, where no lane may read."""
    from dmattn_bench.tuning.workloads import Workload

    workload = Workload(1, 4, 2, 40, 40, 32, True, "none", "none", False, "fp32", documents=(40, 17))
    timed = build_inputs(workload.case(), torch.float32, "cpu")
    assert timed.k.stride() == (2 * 32, 32, 1) and timed.v.stride() == (2 * 32, 32, 1)
    suite = {c.name: c for c in varlen_cases.VARLEN_SUITES["quick"]()}
    case = suite["packed_nan_neighbours_per_row"]
    assert case.sliced
    inputs = build_inputs(case, torch.float32, "cpu")
    extra = varlen_cases.NAN_PAST_HEAD_DIM
    assert inputs.k.stride(1) == case.head_dim + extra
    whole = torch.empty(0, dtype=inputs.k.dtype).set_(inputs.k.untyped_storage())
    past = whole[inputs.k.storage_offset():].view(-1, case.head_dim + extra)[:, case.head_dim:]
    assert torch.isnan(past).all()
