"""One tuning trial, as the measuring and compiling worker processes run it.

A trial is one candidate config on one workload and direction (fwd, bwd, or decode: the
short-query forward, whose suites are `validator.DECODE`'s). `measure_job` validates it on the
workload's own tensors, written into NaN-poisoned outputs and compared with the reference (DESIGN
§2 bound), then times it; `warm_job` only compiles it; `suite_case_job` runs one case of a
config's adversarial suite. Every job is a module-level function (workers receive them pickled by
name), and a failure inside one is data: a status and a reason, never an exception.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from functools import lru_cache
from typing import Callable, NamedTuple

import torch

from dmattn_bench import plan
from dmattn_bench.registry import get_backend
from dmattn_bench.space import DTYPES, BwdConfig, DecodeConfig, FwdConfig
from dmattn_bench.tuning.adversarial import (Case, Inputs, build_inputs, decode_cases, unwritten_allowed,
                                             unwritten_inputs)
from dmattn_bench.tuning.runs import (fill_unowned, kernel_layout, launch_operands, poisoned_outputs,
                                      reference_forward, run_reference, user_layout)
from dmattn_bench.tuning.timing import Timing, time_kernel
from dmattn_bench.tuning.validator import (DECODE, CaseResult, check_case, check_decode_case, classify_failure,
                                           compare, config_suite, shape_of_case, up_to_head_dim, validate)
from dmattn_bench.tuning.workers import PoolStats, ProcessPool, leaders, parallel_map
from dmattn_bench.tuning.workloads import Workload

WARMUP = 2
REPEATS = 15  # medians of 15 L2-flushed runs: spread under 2% on H200 in the first tunes
# Interpreter timings rank nothing real (DESIGN §4): measure once, to exercise the pipeline.
INTERPRETER_REPEATS = 1
STAGES = ("pruned", "compiled", "validated", "timed", "adversarial")


@dataclass
class Trial:
    """One candidate on one workload and direction: what happened and what it measured."""

    workload: str
    key: dict
    direction: str
    backend: str
    config: dict
    # ok | unsupported | compile_error | launch_error | oom | timeout | nonfinite | mismatch | crash | skipped
    # | ranked_out (the ranked search did not run it: `ranking.RANKED_OUT`)
    status: str
    reason: str = ""
    median_ms: float | None = None
    spread: float | None = None
    tflops: float | None = None
    validation: dict = field(default_factory=dict)  # tensor -> error / bound on this workload
    is_default: bool = False
    # furthest stage reached: pruned | compiled | validated | timed | adversarial (passed the suite)
    stage: str = "pruned"

    def to_dict(self) -> dict:
        return asdict(self)


def _alone(direction: str, config) -> tuple[FwdConfig | DecodeConfig | None, BwdConfig | None]:
    """(fwd, bwd) configs that run `config` in its direction and nothing in the other (the
    short-query forward's config takes the forward's place, as in `validator.validate`)."""
    return (None, config) if direction == "bwd" else (config, None)


def _suite_backend(backend_name: str, direction: str) -> str:
    """The name `validator.validate` runs a direction's suite under."""
    return DECODE if direction == "decode" else backend_name


class _Problem:
    """A workload's tensors, outputs and references, shared by all its candidates. A packed or
    windowed workload's launches take its packing, window and sequences (`runs.launch_operands`);
    its outputs are checked in the reference's layouts (`runs.user_layout`)."""

    def __init__(self, workload: Workload, device: torch.device, compile_only: bool = False):
        """compile_only (a compile worker's problem, `warm_job`): no reference, and every tensor
        allocated and left unwritten, the inputs where the case allows it
        (`adversarial.unwritten_allowed`)."""
        self.workload = workload
        self.case = workload.case()
        self.dtype = DTYPES[workload.dtype]
        self.inputs: Inputs = (unwritten_inputs(self.case, self.dtype, device)
                               if compile_only and unwritten_allowed(self.case)
                               else build_inputs(self.case, self.dtype, device, seed=0))
        self.operands = launch_operands(self.inputs, self.case)
        q, k, v, bias = self.operands.q, self.operands.k, self.operands.v, self.operands.bias
        self.mask, self.bias = self.operands.mask, bias
        self.options = self.operands.options

        def poisoned(like: torch.Tensor) -> torch.Tensor:
            grad = torch.empty(like.shape, dtype=like.dtype, device=device)
            return grad if compile_only else grad.fill_(float("nan"))

        self.out, self.lse = poisoned_outputs(self.operands, self.inputs, written=not compile_only)
        self.dq, self.dk, self.dv = poisoned(q), poisoned(k), poisoned(v)
        self.dbias = poisoned(self.bias) if self.bias is not None and workload.bias_grad else None
        self.high = self.low = None
        if compile_only:
            self.ref_out, self.ref_lse = torch.empty_like(q), torch.empty_like(self.lse)
        else:
            self.high = run_reference(self.inputs, self.case, None)
            self.low = run_reference(self.inputs, self.case, self.dtype)
            # the backward is tuned on the reference's forward, independent of any fwd candidate
            self.ref_out, self.ref_lse = kernel_layout(reference_forward(self.high, self.dtype), self.inputs)

    def launcher(self, backend, direction: str, config) -> Callable[[], None]:
        o, runs = self.operands, self.operands.runs
        if direction == "decode":
            from dmattn_kernels.triton.decode_launch import DecodePlan

            launch = DecodePlan(o.q, o.k, o.v, self.mask, self.bias, None, None, **self.options, config=config,
                                out=self.out, lse=self.lse, num_sms=plan.sm_count(o.q.device))
            return lambda: launch(o.q, o.k, o.v, self.mask, self.bias, None, None, self.out, self.lse)
        if direction == "fwd":
            return lambda: backend.forward(o.q, o.k, o.v, self.mask, self.bias, config=config,
                                           out=self.out, lse=self.lse, **self.options, **runs)
        return lambda: backend.backward(o.dout, o.q, o.k, o.v, self.ref_out, self.ref_lse, self.mask, self.bias,
                                        config=config, dq=self.dq, dk=self.dk, dv=self.dv, dbias=self.dbias,
                                        **self.options, **runs)

    def poison(self) -> None:
        for t in (self.out, self.lse, self.dq, self.dk, self.dv, self.dbias):
            if t is not None:
                t.fill_(float("nan"))
        fill_unowned(self.out, self.lse, self.inputs)

    def checks(self, direction: str) -> dict:
        if direction != "bwd":
            names = ("out", "lse")
        else:
            names = ("dq", "dk", "dv") + (("dbias",) if self.dbias is not None else ())
        got = user_layout({"out": self.out, "lse": self.lse, "dq": self.dq, "dk": self.dk, "dv": self.dv,
                           **({"dbias": self.dbias} if self.dbias is not None else {})}, self.inputs)
        return {n: compare(n, got[n], self.high[n], self.low[n], self.dtype) for n in names}


# -- jobs: these run in worker processes ---------------------------------------------------

_problems: dict = {}  # the worker's current workload (one at a time: tensors can be large)


def _problem_for(workload: Workload, device: torch.device) -> _Problem:
    problem = _problems.get(workload)
    if problem is None:
        _problems.clear()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        problem = _problems[workload] = _Problem(workload, device)
        if device.type == "cuda":
            # the float32 values the inputs were drawn from and the reference's intermediates go
            # back to the GPU: a worker then holds its problem's tensors between jobs, not the
            # peak of building them, which the other workers on this GPU need for theirs
            torch.cuda.empty_cache()
    return problem


def warm_job(job: tuple) -> tuple[str, str]:
    """Compile worker: compile one candidate without launching it; returns (status, reason).

    The workload's tensors are allocated for each job, left unwritten (a compile reads no value,
    and drawing them is GPU work that time-slices with the measuring worker's timed kernels:
    the sweep tune's timings spread 14% at the median, p80 - p20 over the median, against 0.3%
    in earlier tunes), and dropped after it: a compile worker between jobs holds no GPU memory,
    so that the trials the tuner measures again after the compiles (`tuner._run`: those out of
    memory) have the GPU to themselves."""
    workload, direction, config, backend_name = job
    try:
        problem = _Problem(workload, torch.device("cuda"), compile_only=True)
        backend = get_backend(backend_name)
        with backend.compile_only():
            problem.launcher(backend, direction, config)()
        return "ok", ""
    except Exception as exc:  # noqa: BLE001 - a failed candidate is data
        return classify_failure(exc)
    finally:
        problem = None
        torch.cuda.empty_cache()


PROBLEM_FAILED = "the workload's inputs and reference: "  # how `problem_job`'s failures start


def problem_job(workload: Workload, device_name: str) -> dict | None:
    """Measuring worker, before a workload's trials: builds its inputs and references, which its
    trials then share. Returns None, or the trial fields of every trial of the workload when they
    cannot be built (the reference of a long sequence can need more memory than the GPU has)."""
    device = torch.device(device_name)
    try:
        _problem_for(workload, device)
    except Exception as exc:  # noqa: BLE001 - a workload that does not fit is data
        _problems.clear()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        status, reason = classify_failure(exc)
        # the stage the trials reached before: compiled on a GPU (the compile phase), nothing in
        # the interpreter, which compiles as it runs
        stage = "compiled" if device.type == "cuda" else "pruned"
        return {"status": status, "reason": PROBLEM_FAILED + reason, "stage": stage}
    return None


def measure_job(workload: Workload, direction: str, config, backend_name: str, device_name: str) -> dict:
    """Measuring worker: validate one candidate on its workload and time it; returns trial fields."""
    device = torch.device(device_name)
    problem = _problem_for(workload, device)
    trial = Trial(workload.label, {}, direction, backend_name, config.to_dict(), "ok")
    _measure(trial, problem, get_backend(backend_name), direction, config, device, workload)
    return {name: getattr(trial, name) for name in ("status", "reason", "median_ms", "spread", "tflops",
                                                     "validation", "stage")}


def suite_verdict(results: list[CaseResult], suite: str) -> tuple[str, str]:
    """A config's suite verdict from its case results, in case order: the first failure."""
    bad = next((c for c in results if c.status != "ok"), None)
    if bad is None:
        answered = sum(c.replayed for c in results)
        from_ledger = f" ({answered} answered from the case ledger)" if answered else ""
        return "ok", f"{suite} suite, {len(results)} cases{from_ledger}"
    return bad.status, f"adversarial {bad.case}: {bad.reason}"


def _release_problem() -> None:
    """Gives back the GPU memory this process's last workload held (its tensors and references,
    and the allocator's cache of them), for a suite's cases, which other processes on the GPU
    need room for too."""
    _problems.clear()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def suite_job(backend_name: str, direction: str, config, dtype_name: str, suite: str, device_name: str,
              max_head_dim: int | None = None, varlen: bool = False) -> tuple[str, str]:
    """Worker: the adversarial suite for one direction's config (`suite_cases`); returns (status, note)."""
    _release_problem()  # a measuring worker's last workload: a long one's references are many GB
    result = validate(_suite_backend(backend_name, direction), *_alone(direction, config), DTYPES[dtype_name],
                      device_name, suite=suite,
                      cases=list(suite_cases(backend_name, direction, config, suite, max_head_dim, varlen)))
    return suite_verdict(result.cases, suite)


@lru_cache(maxsize=256)
def suite_cases(backend_name: str, direction: str, config, suite: str,
                max_head_dim: int | None = None, varlen: bool = False) -> tuple[Case, ...]:
    """The cases of a direction's config's suite for a key of head dim `max_head_dim`, in order
    (built once per process: each case job of the GPU phase picks one by index): those `verify`
    runs for such an entry (`validator.up_to_head_dim`), or every case where that leaves none
    (a key below every case's head dim; verify adds cases shaped as its entries) or none is given.
    `varlen`: the packed-sequence and window suite, for a key with `packed` or `window`."""
    if direction == "decode":
        cases = decode_cases(suite, config.block_n)
    else:
        cases = config_suite(backend_name, suite, *_alone(direction, config), varlen)
    capped = up_to_head_dim(cases, max_head_dim) if max_head_dim is not None else []
    return tuple(capped or cases)


class CaseJob(NamedTuple):
    """One case of a direction's config's suite (`suite_case_job`): the suite (`suite_cases`'s
    arguments) and the case's index in it. A plain tuple of the first eight fields is one too
    (the dense suite)."""

    backend_name: str
    direction: str
    config: object
    dtype_name: str
    suite: str
    device_name: str
    max_head_dim: int | None
    index: int
    varlen: bool = False  # the packed-sequence and window suite


_context_lost = False  # this process's CUDA context died in a case (illegal access): it runs no more


def unless_context_lost(name: str, check: Callable[[], CaseResult]) -> CaseResult:
    """`check()` in a pool process. After a case that kills the CUDA context (`launch_error`,
    e.g. an illegal memory access) every later case of this process answers `retry`, so no other
    config is blamed for it; the parent reruns those in fresh processes."""
    global _context_lost
    if _context_lost:
        return CaseResult(name, "retry", "an earlier case in this process lost the CUDA context")
    result = check()
    _context_lost = result.status == "launch_error"
    return result


def run_cases_in_pool(job_fn: Callable[[tuple], CaseResult], jobs: list[tuple],
                      kernels_of: Callable[[tuple], list[tuple]], on_crash: Callable[[tuple, str], CaseResult],
                      on_done: Callable[[tuple, CaseResult], None] | None = None, gpus: int = 1,
                      stats: PoolStats | None = None, pool: ProcessPool | None = None) -> list[CaseResult]:
    """`[job_fn(job) for job in jobs]` across worker processes for case jobs guarded by
    `unless_context_lost`, results in job order. A job needing a kernel an earlier job compiles
    (`kernels_of`) waits for it (`workers.leaders`); the jobs answered `retry` run again in fresh
    processes (a kept `pool` is discarded after a round in which a context died) until none is
    left. `on_done` sees each job's final result once."""
    results: list[CaseResult | None] = [None] * len(jobs)
    pending = list(range(len(jobs)))
    while pending:
        batch = [jobs[index] for index in pending]
        answers = parallel_map(job_fn, batch, on_crash=on_crash,
                               on_done=(lambda job, result: on_done(job, result)
                                        if on_done is not None and result.status != "retry" else None),
                               gpus=gpus, stats=stats, after=leaders([kernels_of(job) for job in batch]), pool=pool)
        for index, answer in zip(pending, answers):
            results[index] = answer
        pending = [index for index, answer in zip(pending, answers) if answer.status == "retry"]
        if pool is not None and any(answer.status in ("retry", "launch_error") for answer in answers):
            pool.discard()  # a process whose CUDA context died runs nothing more: fresh ones for what follows
    return results  # type: ignore[return-value]


def suite_case_job(job: tuple) -> CaseResult:
    """Worker: one case of a config's adversarial suite (the GPU phase spreads a suite's cases
    over all processes: whole suites, ~50 s each on an H200, left the last ones alone). Never
    raises; `retry` after a lost CUDA context (`unless_context_lost`)."""
    if _problems:  # a kept pool process's last compile workload: its memory is the cases' now
        _release_problem()
    job = CaseJob(*job)
    case = suite_cases(job.backend_name, job.direction, job.config, job.suite, job.max_head_dim, job.varlen)[job.index]

    def check() -> CaseResult:
        try:
            if job.direction == "decode":
                return check_decode_case(case, DTYPES[job.dtype_name], job.device_name, job.config)
            return check_case(get_backend(job.backend_name), case, DTYPES[job.dtype_name], job.device_name,
                              *_alone(job.direction, job.config))
        except Exception as exc:  # noqa: BLE001 - inputs or references failed: data, not a crash
            return CaseResult(case.name, *classify_failure(exc))

    result = unless_context_lost(case.name, check)
    if job.device_name.startswith("cuda") and not _context_lost:  # a lost context's free would raise
        # what the case allocated goes back to the GPU, not to this process's cache: the other
        # processes' cases need it (a long case's inputs and references are GBs). A case out of
        # memory all the same is not held against its config: `_choose_winners` runs that suite
        # again alone.
        torch.cuda.empty_cache()
    return CaseResult(result.case, result.status, result.reason, replayed=result.replayed)  # the checks stay here


def shape_of_workload(workload: Workload):
    return shape_of_case(workload.case())


def _measure(trial: Trial, problem: _Problem, backend, direction: str, config, device, workload: Workload) -> None:
    """Validate on the workload (poisoned outputs) and time one candidate, in place."""
    launch = problem.launcher(backend, direction, config)
    try:
        problem.poison()
        launch()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        trial.stage = "compiled"
        checks = problem.checks(direction)
        trial.validation = {n: round(c.ratio, 4) for n, c in checks.items()}
        failed = [c for c in checks.values() if not c.passed]
        if failed:
            bad = max(failed, key=lambda c: c.ratio)
            trial.status = "nonfinite" if not bad.finite else "mismatch"
            trial.reason = f"{bad.name}: {bad.detail or f'error/bound {bad.ratio:.2f}'}"
            return
        trial.stage = "validated"
        if device.type == "cuda":
            timing = time_kernel(launch, device, warmup=WARMUP, repeats=REPEATS)
        else:
            timing = time_kernel(launch, device, warmup=0, repeats=INTERPRETER_REPEATS)
        _record_timing(trial, timing, workload, direction)
    except Exception as exc:  # noqa: BLE001 - a failed candidate is data
        trial.status, trial.reason = classify_failure(exc)


def _record_timing(trial: Trial, timing: Timing, workload: Workload, direction: str) -> None:
    trial.stage = "timed"
    trial.median_ms = round(timing.median_ms, 5)
    trial.spread = round(timing.spread, 4)
    trial.tflops = round(workload.flops(direction) / (timing.median_ms * 1e-3) / 1e12, 3)


def ready_job(device_name: str) -> None:
    """Measuring worker, before its first trial: imports and the CUDA context, paid up front."""
    torch.zeros(1, device=device_name)
