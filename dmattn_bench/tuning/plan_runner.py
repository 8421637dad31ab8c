"""Running `verify`'s plan (`validator.PlannedSuite`s): on the CPU one case after another here, on
a GPU every case as a job of its own across worker processes (`planned_case_job`)."""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, NamedTuple

import torch

from dmattn_bench.registry import get_backend
from dmattn_bench.space import DTYPE_NAMES, DTYPES, BwdConfig
from dmattn_bench.tuning.adversarial import Case, specialization_class
from dmattn_bench.tuning.trials import run_cases_in_pool, unless_context_lost
from dmattn_bench.tuning.validator import DECODE, CaseResult, PlannedSuite, SuiteResult, shape_of_case, validate


class PlannedCaseJob(NamedTuple):
    """One case of a planned suite of `verify` (`validator.PlannedSuite`: a config pair, either
    of which may be None, or a short-query forward config) and the dtype and device it runs on."""

    dtype_name: str
    device_name: str
    backend_name: str
    fwd_config: object
    bwd_config: BwdConfig | None
    case: Case


def planned_case_job(job: tuple) -> CaseResult:
    """Worker: one case of `verify`'s plan, its checks kept (the table prints their ratios);
    `retry` after a lost CUDA context (`unless_context_lost`). A kernel's failure is the case's
    status; a bug building the case's inputs raises, as `validate` does, and stops the verify."""
    job = PlannedCaseJob(*job)
    return unless_context_lost(job.case.name, lambda: validate(
        job.backend_name, job.fwd_config, job.bwd_config, DTYPES[job.dtype_name], job.device_name,
        cases=[job.case]).cases[0])


def planned_case_kernels(job: tuple) -> list[tuple]:
    """The kernels a `planned_case_job` compiles, keyed like the tune's suite cases'
    (`specialization_class`); none named for the short-query forward (its cases compile alone)."""
    job = PlannedCaseJob(*job)
    if job.backend_name == DECODE:
        return []
    backend, shape = get_backend(job.backend_name), shape_of_case(job.case)
    return [(specialization_class(job.case, job.dtype_name), *kernel)
            for direction, config in (("fwd", job.fwd_config), ("bwd", job.bwd_config)) if config is not None
            for kernel in backend.kernels(direction, config, shape)]


def _alone_where_out_of_memory(item: PlannedSuite, result: SuiteResult, dtype: torch.dtype,
                               device: torch.device | str, on_case) -> SuiteResult:
    """`result` with each case that ran out of GPU memory beside the other workers run again in
    this process, the pool gone (a case that does not fit alone stays `oom`)."""
    if not any(case.status == "oom" for case in result.cases):
        return result
    cases = []
    for planned, outcome in zip(item.cases, result.cases):
        if outcome.status == "oom":
            torch.cuda.empty_cache()
            outcome = validate(item.backend, item.fwd_config, item.bwd_config, dtype, device, cases=[planned]).cases[0]
            if on_case is not None:
                on_case(outcome)
        cases.append(outcome)
    return replace(result, cases=cases)


def run_plan(dtype: torch.dtype, device: torch.device | str, plan: list[PlannedSuite],
             on_case: Callable[[CaseResult], None] | None = None) -> list[tuple[str, SuiteResult]]:
    """Validates every planned config pair on its cases, each with its own backend.

    On a GPU the cases run in parallel worker processes (`_run_cases_in_pool`); on the CPU they
    run here, one after the other.
    """
    if torch.device(device).type == "cuda" and sum(len(item.cases) for item in plan) > 1:
        return _run_cases_in_pool(dtype, device, plan, on_case)
    return [
        (item.label, validate(item.backend, item.fwd_config, item.bwd_config, dtype, device,
                              on_case=on_case, cases=item.cases))
        for item in plan
    ]


def _run_cases_in_pool(dtype: torch.dtype, device: torch.device | str, plan: list[PlannedSuite],
                       on_case: Callable[[CaseResult], None] | None) -> list[tuple[str, SuiteResult]]:
    """Every planned case as a job of its own across worker processes: compiling dominates and is
    single-threaded per process, and a suite run whole in one process left its last cases to that
    process alone (an H200 restamp of 9 entries: a suite of 39 cases, 106 s of a 314 s full
    verify; `trials.run_cases_in_pool`). A case out of memory beside the others runs alone here."""
    jobs = [PlannedCaseJob(DTYPE_NAMES[dtype], str(device), item.backend, item.fwd_config, item.bwd_config, case)
            for item in plan for case in item.cases]

    def report(job, result: CaseResult) -> None:
        if on_case is not None and result.status != "oom":  # reported once run alone
            on_case(result)

    outcomes = run_cases_in_pool(planned_case_job, jobs, planned_case_kernels, on_done=report,
                                 on_crash=lambda job, reason: CaseResult(job.case.name, "crash", reason))
    planned, first = [], 0
    for item in plan:
        cases = outcomes[first:first + len(item.cases)]
        first += len(item.cases)
        result = SuiteResult(item.backend, item.fwd_config, item.bwd_config, str(dtype).removeprefix("torch."), cases)
        planned.append((item.label, _alone_where_out_of_memory(item, result, dtype, device, on_case)))
    return planned
