"""The validator: the quick adversarial suite passes for the Triton kernels on several configs,
and deliberately broken backends are caught with the right status."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dmattn_bench.registry import Backend, get_backend
from dmattn_bench.space import BwdConfig, FwdConfig
# these bind validator's names at their import: imported here, before a test patches one
from dmattn_bench.tuning import plan_runner, trials, validator
from dmattn_bench.tuning.adversarial import Case, adversarial_cases, build_inputs
from dmattn_bench.tuning.validator import check_case, classify_failure, validate

SMALL_FWD, SMALL_BWD = FwdConfig(16, 16, 1, 1), BwdConfig(16, 16, 16, 16, 1, 1)

# (dtype, fwd, bwd): the default interpreter tiles and two non-default tile shapes.
SUITE_CONFIGS = [
    (torch.float32, SMALL_FWD, SMALL_BWD),
    (torch.float16, FwdConfig(32, 16, 2, 1), BwdConfig(16, 32, 32, 16, 2, 1)),
    (torch.float32, FwdConfig(16, 32, 1, 2), BwdConfig(32, 16, 16, 32, 1, 1)),
]


def _suite_id(params) -> str:
    dtype, fwd, bwd = params
    return f"{str(dtype)[6:]}-fwd{fwd.block_m}x{fwd.block_n}-bwd{bwd.block_m}x{bwd.block_n}"


@pytest.mark.parametrize("params", SUITE_CONFIGS, ids=_suite_id)
def test_quick_suite_passes_for_triton(params):
    dtype, fwd, bwd = params
    result = validate("triton", fwd, bwd, dtype, "cpu", suite="quick")
    failures = [f"{c.case}: {c.status} {c.reason}" for c in result.cases if c.status != "ok"]
    assert not failures, "\n".join(failures)
    assert set(result.worst_ratios()) == {"out", "lse", "dq", "dk", "dv", "dbias"}
    assert all(ratio <= 1.0 for ratio in result.worst_ratios().values())


def test_suite_builds_tile_aware_cases_per_distinct_tile():
    cases = adversarial_cases("quick", [(16, 16), (32, 16), (16, 16)])
    corner = [c for c in cases if c.mask == "corner"]
    assert sorted((c.tile_m, c.tile_n) for c in corner) == [(16, 16), (32, 16)]


def test_sliced_inputs_really_have_nan_tails():
    case = Case("s", seqlen_q=5, seqlen_k=9, mask="random", bias="full", sliced=True)
    inputs = build_inputs(case, torch.float32, "cpu")
    k_storage = torch.as_tensor(inputs.k.untyped_storage(), dtype=torch.uint8)
    assert inputs.k.untyped_storage().nbytes() > inputs.k.numel() * 4
    assert k_storage.numel() > 0
    full_bias = torch.as_strided(inputs.bias, (1, 2, 5 + 7, 9 + 7), inputs.bias.stride())
    assert torch.isnan(full_bias[..., 5:, :]).all() and torch.isnan(full_bias[..., :, 9:]).all()


def test_poisoned_bias_only_at_excluded_positions():
    case = Case("p", seqlen_q=8, seqlen_k=8, mask="random", bias="full", bias_poison="nan", causal=True)
    inputs = build_inputs(case, torch.float32, "cpu")
    causal = torch.ones(8, 8, dtype=torch.bool).tril()
    visible = inputs.mask & causal
    assert torch.isnan(inputs.bias[~visible]).all()
    assert torch.isfinite(inputs.bias[visible]).all()


# -- broken backends: each must be caught -----------------------------------------------------

REFERENCE = get_backend("reference")
CASE = Case("probe", heads=2, heads_kv=1, seqlen_q=12, seqlen_k=20, mask="dead_rows", bias="per_key", causal=True)


def _broken(forward=None, backward=None, is_supported=None) -> Backend:
    return Backend(
        "broken",
        forward or REFERENCE.forward,
        backward or REFERENCE.backward,
        is_supported or REFERENCE.is_supported,
    )


def _check(backend: Backend, case: Case = CASE, dtype=torch.float32):
    return check_case(backend, case, dtype, "cpu", SMALL_FWD, SMALL_BWD)


def test_reference_backend_passes():
    result = _check(REFERENCE)
    assert result.status == "ok", result.reason
    assert result.worst_ratio <= 1.0


def test_unwritten_output_element_is_nonfinite():
    def forward(q, k, v, mask, bias, *, out, lse, **kw):
        poisoned = out[0, 3, 1, 5].item()  # the caller poisoned it with NaN
        REFERENCE.forward(q, k, v, mask, bias, out=out, lse=lse, **kw)
        out[0, 3, 1, 5] = poisoned  # "forgets" to write one element

    result = _check(_broken(forward=forward))
    assert result.status == "nonfinite"
    assert "out" in result.reason


def test_top_left_causal_is_a_mismatch():
    def forward(q, k, v, mask, bias, *, is_causal, out, lse, **kw):
        lq, lk = q.shape[1], k.shape[1]
        top_left = torch.ones(lq, lk, dtype=torch.bool).tril()  # flash-dmattn Triton's rule
        combined = top_left if mask is None else mask & top_left
        REFERENCE.forward(q, k, v, combined, bias, is_causal=False, out=out, lse=lse, **kw)

    result = _check(_broken(forward=forward))
    assert result.status in ("mismatch", "nonfinite")


def test_error_just_above_bound_is_a_mismatch():
    def backward(*args, dq, **kw):
        REFERENCE.backward(*args, dq=dq, **kw)
        dq.add_(1e-3)  # 100x the fp32 floor; the lowp reference is ~1e-7 away

    result = _check(_broken(backward=backward))
    assert result.status == "mismatch"
    assert result.reason.startswith("dq:")
    assert result.checks["dq"].ratio > 1.0


def test_dead_row_with_finite_lse_fails():
    def forward(q, k, v, mask, bias, *, out, lse, **kw):
        REFERENCE.forward(q, k, v, mask, bias, out=out, lse=lse, **kw)
        lse.nan_to_num_(neginf=0.0)

    result = _check(_broken(forward=forward))
    assert result.status == "nonfinite"
    assert "lse" in result.reason


def test_nondeterminism_is_a_mismatch():
    calls = []

    def backward(*args, dk, **kw):
        REFERENCE.backward(*args, dk=dk, **kw)
        calls.append(1)
        dk.add_(1e-9 * len(calls))  # far inside the bound, but not bitwise reproducible

    result = _check(_broken(backward=backward))
    assert result.status == "mismatch"
    assert "bitwise" in result.reason


def _drifting(dq_gap: float = 0.0, dk_gap: float = 0.0, second_dq_off: float = 0.0):
    """A backward whose dq moves by `dq_gap` and dk by `dk_gap` each call (a sum's last bits in
    another order), and whose second run's dq is off by `second_dq_off` more."""
    calls = []

    def backward(*args, dq, dk, **kw):
        REFERENCE.backward(*args, dq=dq, dk=dk, **kw)
        calls.append(1)
        dq.add_(dq_gap * len(calls) + (second_dq_off if len(calls) == 2 else 0.0))
        dk.add_(dk_gap * len(calls))

    return _broken(backward=backward)


UNORDERED_BWD = dataclasses.replace(SMALL_BWD, nondeterministic_dq=1)


@pytest.mark.parametrize("drift, bwd_config, status", [
    (dict(dq_gap=1e-9), UNORDERED_BWD, "ok"),              # dq's bits may change between runs
    (dict(dq_gap=1e-9), SMALL_BWD, "mismatch"),            # not without the mark
    (dict(dq_gap=1e-9, dk_gap=1e-9), UNORDERED_BWD, "mismatch"),  # dk's may not
    (dict(second_dq_off=1.0), UNORDERED_BWD, "mismatch"),  # the second run's dq is judged by the bound
])
def test_a_config_marked_nondeterministic_may_change_dq_alone_between_runs(drift, bwd_config, status):
    result = check_case(_drifting(**drift), CASE, torch.float32, "cpu", SMALL_FWD, bwd_config)
    assert result.status == status, result.reason


@pytest.mark.parametrize(
    "exc, status",
    [
        (RuntimeError("CUDA error: an illegal memory access was encountered"), "launch_error"),
        (torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB"), "oom"),
        (ValueError("something unexpected"), "crash"),
    ],
)
def test_kernel_exceptions_become_statuses(exc, status):
    def forward(*args, **kw):
        raise exc

    result = _check(_broken(forward=forward))
    assert result.status == status
    assert "\n" not in result.reason and result.reason


def test_compile_errors_are_classified():
    class CompilationError(Exception):
        pass

    class OutOfResources(Exception):
        pass

    assert classify_failure(CompilationError("at 3:4: bad"))[0] == "compile_error"
    status, reason = classify_failure(OutOfResources("out of resource: shared memory, Required: 262144"))
    assert status == "unsupported" and "shared memory" in reason


def test_unsupported_config_is_reported_not_run():
    ran = []

    def forward(*args, **kw):
        ran.append(1)

    backend = _broken(forward=forward, is_supported=lambda config, shape: "block_m too large")
    result = _check(backend)
    assert result.status == "unsupported" and result.reason == "block_m too large"
    assert not ran


def test_suite_status_is_the_worst_case_status():
    small = [c for c in adversarial_cases("quick", [(16, 16)]) if c.seqlen_q <= 20]
    result = validate("reference", SMALL_FWD, SMALL_BWD, torch.float32, "cpu", cases=small)
    assert result.status == "ok"
    failing = dataclasses.replace(result, cases=result.cases + [dataclasses.replace(result.cases[0], status="mismatch")])
    assert failing.status == "mismatch"
    assert failing.to_dict()["status"] == "mismatch"


def test_one_direction_alone_is_checked_on_its_own_tensors():
    """The tuner's suites check a forward config without a backward and a backward config on
    the reference's out and lse: each checks only its own tensors, and each still catches a
    broken kernel of its direction."""
    forward_alone = check_case(REFERENCE, CASE, torch.float32, "cpu", SMALL_FWD, None)
    backward_alone = check_case(REFERENCE, CASE, torch.float32, "cpu", None, SMALL_BWD)
    assert (forward_alone.status, backward_alone.status) == ("ok", "ok")
    assert set(forward_alone.checks) == {"out", "lse"} and set(backward_alone.checks) == {"dq", "dk", "dv", "dbias"}

    def backward(dout, q, k, v, out, lse, mask, bias, *, dk, **kw):
        REFERENCE.backward(dout, q, k, v, out, lse, mask, bias, dk=dk, **kw)
        dk.mul_(1.01)

    broken = check_case(_broken(backward=backward), CASE, torch.float32, "cpu", None, SMALL_BWD)
    assert broken.status == "mismatch" and broken.reason.startswith("dk")


def test_a_reference_out_of_memory_is_an_oom_case_not_a_crash(monkeypatch):
    def out_of_memory(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(validator, "run_reference", out_of_memory)
    result = _check(REFERENCE)
    assert (result.status, result.reason.split(":")[0]) == ("oom", "OutOfMemoryError")


def test_inputs_a_cuda_call_could_not_allocate_are_an_oom_case_not_a_crash(monkeypatch):
    """Out of memory outside the caching allocator (a CUDA call failing to allocate, seen building
    a paged cache's block table beside seven other verify workers on an H100) raises a plain
    CUDA error, not OutOfMemoryError: still an `oom` case, which `run_plan` runs again alone."""
    error = getattr(torch, "AcceleratorError", RuntimeError)

    def out_of_memory(*args, **kwargs):
        raise error("CUDA error: out of memory")

    monkeypatch.setattr(validator, "build_inputs", out_of_memory)
    result = _check(REFERENCE)
    assert result.status == "oom" and "out of memory" in result.reason


def test_a_library_call_failing_in_the_reference_is_an_oom_case_not_a_crash(monkeypatch):
    """A full bf16 verify on an H200 stopped at case 1331 of 1408: the bf16 reference's backward,
    beside the pool's other workers, raised cuBLAS's launch failure. The kernel had not run: the
    case is `oom`, which `run_plan` runs again alone, and the verify goes on."""
    def launch_failed(*args, **kwargs):
        raise RuntimeError("CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasGemmStridedBatchedEx(...)`")

    monkeypatch.setattr(validator, "run_reference", launch_failed)
    result = _check(REFERENCE)
    assert result.status == "oom" and "before the kernel ran" in result.reason and "CUBLAS" in result.reason

    # the same error where the context is gone (an earlier kernel's illegal access), and any
    # other CUDA error, still raise: the pool restarts the process and blames no config for it
    monkeypatch.setattr(validator, "_context_alive", lambda device: False)
    with pytest.raises(RuntimeError, match="CUBLAS_STATUS_EXECUTION_FAILED"):
        _check(REFERENCE)

    def sticky(*args, **kwargs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(validator, "run_reference", sticky)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        _check(REFERENCE)


def test_other_failures_building_a_cases_inputs_still_raise(monkeypatch):
    def broken(*args, **kwargs):
        raise ValueError("a bug in the case builder")

    monkeypatch.setattr(validator, "build_inputs", broken)
    with pytest.raises(ValueError, match="case builder"):
        _check(REFERENCE)


def _fake_pool(monkeypatch, statuses: list[dict[str, str]]) -> list[list[str]]:
    """Replaces the worker pool: call i answers each case by `statuses[i]` (default "ok");
    returns the case names of every call."""
    calls = []

    def pool(fn, jobs, on_crash, on_done, after, **kwargs):
        assert len(after) == len(jobs)
        answers = statuses[len(calls)]
        calls.append([job.case.name for job in jobs])
        results = [validator.CaseResult(job.case.name, answers.get(job.case.name, "ok"), "") for job in jobs]
        for job, result in zip(jobs, results):
            on_done(job, result)
        return results

    monkeypatch.setattr(trials, "parallel_map", pool)
    return calls


def test_cases_out_of_memory_beside_other_workers_run_again_alone(monkeypatch):
    """`verify` runs each planned case as a job of its own in parallel processes on one GPU: a
    case whose memory did not fit beside theirs runs again afterwards in the parent; the others
    keep their result and progress counts each case once."""
    cases = [dataclasses.replace(CASE, name=name) for name in ("small", "large")]
    item = validator.PlannedSuite("pair", "reference", SMALL_FWD, SMALL_BWD, cases)
    calls = _fake_pool(monkeypatch, [{"large": "oom"}])
    alone = []
    monkeypatch.setattr(validator, "check_case", lambda backend, case, *a, **k: alone.append(case.name) or
                        validator.CaseResult(case.name, "ok", ""))
    reported = []
    (label, result), _ = plan_runner.run_plan(torch.float32, "cuda", [item, item], on_case=reported.append)
    assert calls == [["small", "large", "small", "large"]]
    assert alone == ["large", "large"]
    assert [(c.case, c.status) for c in result.cases] == [("small", "ok"), ("large", "ok")]
    assert sorted(c.case for c in reported) == ["large", "large", "small", "small"]


def test_cases_a_lost_cuda_context_left_undone_run_again_in_fresh_processes(monkeypatch):
    """A case answered `retry` (its process's CUDA context died in an earlier case) runs in a
    later round of the pool, and its suite gets that round's verdict, reported once."""
    cases = [dataclasses.replace(CASE, name=name) for name in ("first", "second", "third")]
    item = validator.PlannedSuite("pair", "reference", SMALL_FWD, SMALL_BWD, cases)
    calls = _fake_pool(monkeypatch, [{"first": "launch_error", "second": "retry"}, {}])
    reported = []
    [(label, result)] = plan_runner.run_plan(torch.float32, "cuda", [item], on_case=reported.append)
    assert calls == [["first", "second", "third"], ["second"]]
    assert [(c.case, c.status) for c in result.cases] == [("first", "launch_error"), ("second", "ok"),
                                                          ("third", "ok")]
    assert result.status == "launch_error"
    assert sorted(c.case for c in reported) == ["first", "second", "third"]


def test_a_planned_case_after_a_lost_context_answers_retry(monkeypatch):
    """In a pool process, a case after one that killed the CUDA context is not run (it would
    fail for the other's fault): it answers `retry`."""
    monkeypatch.setattr(trials, "_context_lost", False)
    lost = validator.CaseResult("first", "launch_error", "illegal memory access")
    monkeypatch.setattr(validator, "check_case", lambda backend, case, *a, **k: lost)
    job = plan_runner.PlannedCaseJob("fp32", "cpu", "reference", SMALL_FWD, SMALL_BWD, CASE)
    assert plan_runner.planned_case_job(job).status == "launch_error"
    assert plan_runner.planned_case_job(job._replace(case=dataclasses.replace(CASE, name="next"))).status == "retry"


def test_entry_cases_of_long_keys_have_one_kv_head():
    """A table entry's case is shaped like its key; at L16384 the fp32 reference's scores of
    two KV heads' worth of query heads would not fit one GPU beside the rest of the reference."""
    from dmattn_bench.space import TableKey

    def key(length, gqa):
        return TableKey("fwd", "bf16", 128, True, "kv_head", "per_key", gqa, length, length)

    long_case, short_case = validator.entry_case(key(16384, 8)), validator.entry_case(key(4096, 4))
    assert (long_case.heads_kv, long_case.heads, long_case.seqlen_k) == (1, 8, 16384)
    assert (short_case.heads_kv, short_case.heads) == (2, 8)


def test_verify_checks_each_default_on_the_cases_the_runtime_sends_it():
    """The defaults of a bias with rows answer for the suite cases whose bias the runtime names so
    (`adversarial.bias_kind`): a per-key bias of a one-row query has rows."""
    from dmattn_bench.tuning.adversarial import bias_kind

    plan = validator.plan_default_configs("cpu", "quick")
    with_rows = {c.name for item in plan if item.label.endswith("with rows") for c in item.cases}
    without = {c.name for item in plan if item.label.endswith("without rows") for c in item.cases}
    decode = next(c for c in adversarial_cases("quick", [(16, 16)]) if c.seqlen_q == 1 and c.bias == "per_key")
    assert bias_kind(decode) == "full" and decode.name in with_rows and decode.name not in without
    assert with_rows and without and not with_rows & without


def test_a_kv_group_backward_s_suite_runs_every_case_with_grouped_query_heads():
    """A backward with the knob kv_group runs GQA calls only (the CUDA rules refuse it one query
    head a KV head, and dispatch sends it only its keys' grouped calls): the suite on its tiles
    doubles the query heads of each case that has none grouped, and leaves the others as built."""
    from dmattn_bench.tuning.validator import config_suite, grouped_for

    plain = BwdConfig(64, 128, 64, 128, 12, 2)
    grouped = BwdConfig(64, 128, 64, 128, 12, 2, kv_group=1)
    cases = config_suite("cuda", "full", None, plain)
    regrouped = config_suite("cuda", "full", None, grouped)
    assert len(regrouped) == len(cases) and any(case.heads == case.heads_kv for case in cases)
    assert all(case.heads > case.heads_kv for case in regrouped)
    for case in cases:
        assert grouped_for(case, plain) is case
        moved = grouped_for(case, grouped)
        assert (moved.heads, moved.heads_kv) == ((2 * case.heads, case.heads_kv) if case.heads == case.heads_kv
                                                 else (case.heads, case.heads_kv))
