"""The tuner: workloads x candidate configs -> trials -> one winner per table key.

For each workload and direction:
  1. every candidate (the heuristic default first, then the search space) is checked for
     structural support; on a GPU all candidates are compiled in parallel worker processes first
     (each runs the kernel once on the workload; Triton's on-disk cache hands the binaries to
     the timing process);
  2. each candidate runs once into NaN-poisoned buffers and is validated on the workload itself
     against the reference (DESIGN §2 bound), then timed briefly; the best quarter is re-timed
     with more repeats (successive halving: slow candidates cost little);
  3. the fastest validated candidate must also pass the adversarial suite on its own tiles
     (cached per config); if it fails, the next fastest is tried.
Every candidate becomes a `Trial` with a status and reason; a failing kernel never stops the run.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

from dmattn_bench.adversarial import Inputs, build_inputs
from dmattn_bench.hardware import local_limits
from dmattn_bench.prune import precheck
from dmattn_bench.registry import default_configs, get_backend
from dmattn_bench.space import BwdConfig, FwdConfig, TableKey
from dmattn_bench.timing import Timing, time_kernel
from dmattn_bench.validator import classify_failure, compare, run_reference, shape_of_case, validate
from dmattn_bench.workers import parallel_map
from dmattn_bench.workloads import Workload

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
SCREEN_REPEATS = 5  # first pass: enough to rank, cheap for the slow majority
FINAL_REPEATS = 25  # second pass for the contenders
# Interpreter timings rank nothing real (DESIGN §4): measure once, to exercise the pipeline.
INTERPRETER_REPEATS = 1
FINALISTS_FRACTION = 0.25
MIN_FINALISTS = 3


@dataclass
class Trial:
    """One candidate on one workload and direction: what happened and what it measured."""

    workload: str
    key: dict
    direction: str
    backend: str
    config: dict
    status: str  # ok | unsupported | compile_error | launch_error | oom | timeout | nonfinite | mismatch | crash | skipped
    reason: str = ""
    median_ms: float | None = None
    spread: float | None = None
    tflops: float | None = None
    validation: dict = field(default_factory=dict)  # tensor -> error / bound on this workload
    is_default: bool = False

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Winner:
    key: TableKey
    backend: str
    config: FwdConfig | BwdConfig
    evidence: dict


@dataclass
class TuneResult:
    winners: list[Winner]
    trials: list[Trial]
    wall_s: float
    meaningful_timings: bool

    def counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for trial in self.trials:
            counts[trial.status] = counts.get(trial.status, 0) + 1
        return counts


def _pair(direction: str, config, head_dim: int, device) -> tuple[FwdConfig, BwdConfig]:
    """A (fwd, bwd) pair with `config` in its direction and the default in the other."""
    default_fwd, default_bwd = default_configs(head_dim, device)
    return (config, default_bwd) if direction == "fwd" else (default_fwd, config)


class _Problem:
    """A workload's tensors, outputs and references, shared by all its candidates."""

    def __init__(self, workload: Workload, device: torch.device, with_reference: bool = True):
        self.workload = workload
        self.case = workload.case()
        self.dtype = DTYPES[workload.dtype]
        self.inputs: Inputs = build_inputs(self.case, self.dtype, device, seed=0)
        q, k, v = self.inputs.q, self.inputs.k, self.inputs.v
        self.mask = _as_4d(self.inputs.mask)
        self.bias = _as_4d(self.inputs.bias)
        self.options = dict(is_causal=workload.causal, softmax_scale=workload.head_dim ** -0.5, softcap=0.0)
        nan = float("nan")
        self.out = torch.full(q.shape, nan, dtype=q.dtype, device=device)
        self.lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), nan, dtype=torch.float32, device=device)
        self.dq = torch.full(q.shape, nan, dtype=q.dtype, device=device)
        self.dk = torch.full(k.shape, nan, dtype=k.dtype, device=device)
        self.dv = torch.full(v.shape, nan, dtype=v.dtype, device=device)
        self.dbias = None
        if self.bias is not None and workload.bias_grad:
            self.dbias = torch.full(self.bias.shape, nan, dtype=self.bias.dtype, device=device)
        self.high = self.low = None
        if with_reference:
            self.high = run_reference(self.inputs, self.case, None)
            self.low = run_reference(self.inputs, self.case, self.dtype)
            # the backward is tuned on the reference's forward, independent of any fwd candidate
            self.ref_out = self.high["out"].to(self.dtype)
            self.ref_lse = self.high["lse"].float()
        else:
            self.ref_out, self.ref_lse = torch.zeros_like(q), torch.zeros_like(self.lse)

    def launcher(self, backend, direction: str, config) -> Callable[[], None]:
        i = self.inputs
        if direction == "fwd":
            return lambda: backend.forward(i.q, i.k, i.v, self.mask, self.bias, config=config,
                                           out=self.out, lse=self.lse, **self.options)
        return lambda: backend.backward(i.dout, i.q, i.k, i.v, self.ref_out, self.ref_lse, self.mask, self.bias,
                                        config=config, dq=self.dq, dk=self.dk, dv=self.dv, dbias=self.dbias,
                                        **self.options)

    def poison(self) -> None:
        for t in (self.out, self.lse, self.dq, self.dk, self.dv, self.dbias):
            if t is not None:
                t.fill_(float("nan"))

    def checks(self, direction: str) -> dict:
        names = ("out", "lse") if direction == "fwd" else ("dq", "dk", "dv") + (("dbias",) if self.dbias is not None else ())
        got = {"out": self.out, "lse": self.lse, "dq": self.dq, "dk": self.dk, "dv": self.dv, "dbias": self.dbias}
        if "dbias" in names:
            got["dbias"] = self.dbias.view(self.inputs.bias.shape)
        return {n: compare(n, got[n], self.high[n], self.low[n], self.dtype) for n in names}


def _as_4d(t):
    return t if t is None or t.dim() == 4 else t[(None,) * (4 - t.dim())]


# -- parallel work (GPU only) ------------------------------------------------------------------

_worker_problems: dict = {}


def _warm_one(job: tuple) -> tuple[str, str]:
    """Worker: compile (and run once) one candidate; returns (status, reason)."""
    workload, direction, config, backend_name = job
    try:
        problem = _worker_problems.get(workload)
        if problem is None:
            _worker_problems.clear()  # one workload's tensors at a time per worker
            problem = _worker_problems[workload] = _Problem(workload, torch.device("cuda"), with_reference=False)
        problem.launcher(get_backend(backend_name), direction, config)()
        torch.cuda.synchronize()
        return "ok", ""
    except Exception as exc:  # noqa: BLE001 - a failed candidate is data
        return classify_failure(exc)


def _suite_one(job: tuple) -> tuple[str, str]:
    """Worker: the adversarial suite for one (direction, config) paired with the defaults."""
    backend_name, direction, config, head_dim, dtype_name, suite = job
    fwd, bwd = _pair(direction, config, head_dim, "cuda")
    result = validate(backend_name, fwd, bwd, DTYPES[dtype_name], "cuda", suite=suite)
    return _suite_verdict(result, suite)


def _suite_verdict(result, suite: str) -> tuple[str, str]:
    bad = next((c for c in result.cases if c.status != "ok"), None)
    if bad is None:
        return "ok", f"{suite} suite, {len(result.cases)} cases"
    return bad.status, f"adversarial {bad.case}: {bad.reason}"


# -- the loop -----------------------------------------------------------------------------------


def candidate_list(direction: str, space: list, workload: Workload, device) -> list:
    default = default_configs(workload.head_dim, device)[0 if direction == "fwd" else 1]
    return list(dict.fromkeys([default, *space]))


def tune(
    workloads: list[Workload],
    spaces: dict[str, list],
    device: torch.device | str,
    backend_name: str = "triton",
    budget_s: float | None = None,
    suite: str = "quick",
    on_trial: Callable[[Trial], None] | None = None,
    on_phase: Callable[[str, int], Callable[[], None]] | None = None,
) -> TuneResult:
    """Tunes every workload in both directions.

    Args:
        workloads: shapes to tune.
        spaces: {"fwd": [FwdConfig...], "bwd": [BwdConfig...]} candidate configs.
        device: where kernels run ("cpu" means the Triton interpreter).
        backend_name: the kernel family.
        budget_s: stop starting new trials after this many seconds (finished work is kept).
        suite: adversarial suite for the winners ("quick" or "full").
        on_trial: called with every finished trial (progress).
        on_phase: optional factory for progress of the parallel compile phase: called with a
            description and a total, returns a per-job callback.

    Returns:
        Winners (one per key), every trial, and the wall time.
    """
    device = torch.device(device)
    backend = get_backend(backend_name)
    start = time.monotonic()
    trials: list[Trial] = []

    def out_of_budget() -> bool:
        return budget_s is not None and time.monotonic() - start > budget_s

    plan = [(w, d, candidate_list(d, spaces[d], w, device)) for w in workloads for d in ("fwd", "bwd")]
    compiled: dict[tuple, tuple[str, str]] = {}
    if device.type == "cuda":
        # pruned before any GPU time: structure, threads per block, estimated shared memory
        limits = local_limits(device)
        for w, d, cands in plan:
            for c in cands:
                pruned = precheck(d, c, limits, w.head_dim, w.dtype)
                if pruned is not None:
                    compiled[(w, d, c, backend_name)] = ("unsupported", pruned.reason)
        jobs = [(w, d, c, backend_name) for w, d, cands in plan for c in cands
                if (w, d, c, backend_name) not in compiled and backend.is_supported(c, _shape(w)) is None]
        done = on_phase("compile", len(jobs)) if on_phase else None
        outcomes = parallel_map(_warm_one, jobs, on_crash=lambda job, reason: ("crash", reason),
                                on_done=(lambda job, result: done()) if done else None)
        compiled.update(zip(jobs, outcomes))

    ranked: list[tuple[Workload, str, TableKey, list]] = []
    for workload in workloads:
        problem = _Problem(workload, device)
        for direction in ("fwd", "bwd"):
            candidates = candidate_list(direction, spaces[direction], workload, device)
            key = workload.key(direction)
            timed: list[tuple[Trial, object]] = []
            for index, config in enumerate(candidates):
                trial = Trial(workload.label, key.to_dict(), direction, backend_name, config.to_dict(),
                              "ok", is_default=index == 0)
                reason = backend.is_supported(config, _shape(workload))
                warm = compiled.get((workload, direction, config, backend_name))
                if out_of_budget():
                    trial.status, trial.reason = "skipped", "time budget exhausted"
                elif reason:
                    trial.status, trial.reason = "unsupported", reason
                elif warm is not None and warm[0] != "ok":
                    trial.status, trial.reason = warm
                else:
                    _measure(trial, problem, backend, direction, config, device, workload)
                    if trial.status == "ok":
                        timed.append((trial, config))
                trials.append(trial)
                if on_trial:
                    on_trial(trial)
            _retime_finalists(timed, problem, backend, direction, device, workload)
            ranked.append((workload, direction, key, sorted(timed, key=lambda tc: tc[0].median_ms)))
        del problem
        if device.type == "cuda":
            torch.cuda.empty_cache()

    # -- the adversarial suite for each key's fastest candidate (in parallel on a GPU) --
    suite_cache: dict[tuple, tuple[str, str]] = {}
    if device.type == "cuda":
        jobs = list(dict.fromkeys(
            (backend_name, d, timed[0][1], w.head_dim, w.dtype, suite) for w, d, _, timed in ranked if timed))
        done = on_phase("adversarial suite", len(jobs)) if on_phase else None
        verdicts = parallel_map(_suite_one, jobs, on_crash=lambda job, reason: ("crash", reason),
                                on_done=(lambda job, result: done()) if done else None)
        suite_cache = {_suite_key(job[1], job[2], job[3], job[4], device): v for job, v in zip(jobs, verdicts)}
    winners = []
    for workload, direction, key, timed in ranked:
        winner = _choose(timed, key, backend_name, direction, device, workload, suite, suite_cache)
        if winner is not None:
            winners.append(winner)
    return TuneResult(winners, trials, time.monotonic() - start, device.type == "cuda")


def _shape(workload: Workload):
    return shape_of_case(workload.case())


def _measure(trial: Trial, problem: _Problem, backend, direction: str, config, device, workload: Workload) -> None:
    """Validate on the workload (poisoned outputs) and screen-time one candidate, in place."""
    launch = problem.launcher(backend, direction, config)
    try:
        problem.poison()
        launch()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        checks = problem.checks(direction)
        trial.validation = {n: round(c.ratio, 4) for n, c in checks.items()}
        failed = [c for c in checks.values() if not c.passed]
        if failed:
            bad = max(failed, key=lambda c: c.ratio)
            trial.status = "nonfinite" if not bad.finite else "mismatch"
            trial.reason = f"{bad.name}: {bad.detail or f'error/bound {bad.ratio:.2f}'}"
            return
        repeats = SCREEN_REPEATS if device.type == "cuda" else INTERPRETER_REPEATS
        warmup = 1 if device.type == "cuda" else 0
        _record_timing(trial, time_kernel(launch, device, warmup=warmup, repeats=repeats), workload, direction)
    except Exception as exc:  # noqa: BLE001 - a failed candidate is data
        trial.status, trial.reason = classify_failure(exc)


def _record_timing(trial: Trial, timing: Timing, workload: Workload, direction: str) -> None:
    trial.median_ms = round(timing.median_ms, 5)
    trial.spread = round(timing.spread, 4)
    trial.tflops = round(workload.flops(direction) / (timing.median_ms * 1e-3) / 1e12, 3)


def _retime_finalists(timed, problem, backend, direction, device, workload) -> None:
    """Re-times the fastest quarter (and the default, the speed-up's denominator) with more repeats."""
    if not timed or device.type != "cuda":
        return
    ranked = sorted(timed, key=lambda tc: tc[0].median_ms)
    count = max(MIN_FINALISTS, int(len(ranked) * FINALISTS_FRACTION))
    finalists = ranked[:count] + [tc for tc in ranked[count:] if tc[0].is_default]
    for trial, config in finalists:
        try:
            timing = time_kernel(problem.launcher(backend, direction, config), device, warmup=2, repeats=FINAL_REPEATS)
            _record_timing(trial, timing, workload, direction)
        except Exception as exc:  # noqa: BLE001
            trial.status, trial.reason = classify_failure(exc)


def _suite_key(direction: str, config, head_dim: int, dtype: str, device) -> tuple:
    """Suites are shared by every key whose candidate pairs to the same (fwd, bwd) configs."""
    return (_pair(direction, config, head_dim, device), dtype)


def _choose(timed, key: TableKey, backend_name: str, direction: str, device, workload: Workload, suite: str,
            suite_cache: dict) -> Winner | None:
    """The fastest timed candidate that also passes the adversarial suite on its tiles."""
    ok = sorted((tc for tc in timed if tc[0].status == "ok"), key=lambda tc: tc[0].median_ms)
    default = next((t for t, _ in timed if t.is_default and t.status == "ok"), None)
    for trial, config in ok:
        cache_key = _suite_key(direction, config, workload.head_dim, workload.dtype, device)
        if cache_key not in suite_cache:
            fwd, bwd = _pair(direction, config, workload.head_dim, device)
            result = validate(backend_name, fwd, bwd, DTYPES[workload.dtype], device, suite=suite)
            suite_cache[cache_key] = _suite_verdict(result, suite)
        status, note = suite_cache[cache_key]
        if status != "ok":
            trial.status, trial.reason = status, note
            continue
        speedup = round(default.median_ms / trial.median_ms, 4) if default else None
        evidence = {"median_ms": trial.median_ms, "spread": trial.spread, "tflops": trial.tflops,
                    "speedup_vs_default": speedup, "validation": trial.validation, "adversarial": note,
                    "workload": workload.label}
        return Winner(key, backend_name, config, evidence)
    return None
