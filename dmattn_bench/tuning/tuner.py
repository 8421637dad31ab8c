"""The tuner: workloads x candidate configs -> trials -> one winner per table key.

For each workload and each of its directions (`Workload.directions`: the prefill pair, and the
short-query forward where calls of the shape without gradient run it):
  1. every candidate (the heuristic default first, then the search space) is checked for
     structural support and estimated shared memory (no GPU time); on a GPU the rest are
     compiled in parallel worker processes (Triton's on-disk cache hands the binaries on);
  2. each candidate runs in a measuring worker (one subprocess per GPU, reused; with several
     GPUs the workloads are shared out and measured concurrently): once into
     NaN-poisoned buffers, validated on the workload itself against the reference (DESIGN §2
     bound), then timed. A crash, a hang past the trial timeout or an OOM becomes that trial's
     status and the worker is restarted, so one bad config never ends the run;
  3. the fastest validated candidate of each key must also pass the adversarial suite on its
     own tiles, in its own direction (a backward reads the reference's forward, as in step 2;
     cached per direction and config); if it fails, the next fastest is tried.

With a ranking model (`ranking.RankingModel`, the default of `dmattn-bench tune`) steps 1 and 2
run in rounds: each workload and direction compiles and times its default and the first batch of
its ranked candidates, then the next batch while `ranking.Widening` says the ranking may still
hold a faster one; the candidates it never reaches end "ranked_out" (journaled, and planned anew
by a resumed run, so `--exhaustive --resume` times exactly them).

Every finished trial and suite verdict is appended to a journal (one flushed JSON line each);
`resume=True` skips what the journal already holds, and the winners are always computed from
the journal's records, so a resumed run writes the table an uninterrupted run would have
written from the same measurements. Without `resume`, the journal of a completed run is
replaced and one holding trials of any other run refused (`journal`'s rule).
"""

from __future__ import annotations

import math
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from queue import Queue
from typing import Callable

import torch

from dmattn_bench import tiles
from dmattn_bench.errors import DmattnError
from dmattn_bench.hardware import device_fingerprint, local_limits
from dmattn_bench.registry import get_backend, kernel_source_hash
from dmattn_bench.space import BwdConfig, DecodeConfig, FwdConfig, TableKey, config_from_dict, config_label
from dmattn_bench.tiles import decode_config, default_configs
from dmattn_bench.tuning.adversarial import specialization_class
from dmattn_bench.tuning.journal import (SUITES_RUN_AGAIN_ON_RESUME, Journal, measured_again_on_resume, suite_id,
                                         timed_noisily, trial_id)
from dmattn_bench.tuning.prune import precheck
from dmattn_bench.tuning.ranking import RANKED_OUT, RankedRounds, RankingModel, Widening
from dmattn_bench.tuning.timing import NOISY_SPREAD
from dmattn_bench.tuning.trials import (PROBLEM_FAILED, STAGES, CaseJob, Trial, measure_job, problem_job, ready_job,
                                        run_cases_in_pool, shape_of_workload, suite_case_job, suite_cases, suite_job,
                                        suite_verdict, warm_job)
from dmattn_bench.tuning.validator import CaseResult, shape_of_case
from dmattn_bench.tuning.workers import (PoolStats, ProcessPool, Worker, WorkerCrashed, WorkerTimedOut,
                                         leaders, parallel_map, phase_bound, worker_count)
from dmattn_bench.tuning.workloads import Workload

DEFAULT_TRIAL_TIMEOUT_S = 300.0  # also the bound on building a workload's inputs and references
DEFAULT_SUITE_TIMEOUT_S = 1800.0  # one adversarial suite: ~20-35 cases, each a new compile


@dataclass
class Winner:
    key: TableKey
    backend: str
    config: FwdConfig | BwdConfig | DecodeConfig
    evidence: dict


NOISY_SHARE = 0.1  # the share of timed trials over NOISY_SPREAD at which a tune says its winners are doubtful


def noisy_timings(spread: dict | None) -> str | None:
    """What a tune says when more than NOISY_SHARE of its timed trials spread over NOISY_SPREAD
    (`TuneResult.timing_spread`), else None."""
    if not spread or spread["noisy"] <= NOISY_SHARE * spread["timed"]:
        return None
    return (f"{spread['noisy']} of {spread['timed']} timed trials spread over {NOISY_SPREAD:.0%} (p80 - p20 over "
            f"the median; {spread['median']:.1%} at the median): something else ran on the GPU while they were "
            "timed, so the winners may not be the fastest; tune again with the GPU to itself")


@dataclass
class TuneResult:
    winners: list[Winner]
    trials: list[Trial]
    wall_s: float
    meaningful_timings: bool
    phases: dict[str, float] = field(default_factory=dict)  # wall seconds of each phase that ran
    pools: dict[str, dict] = field(default_factory=dict)  # phase -> PoolStats.to_dict() of its processes
    # a ranked search's order per (workload label, direction, backend): config labels, best predicted first
    rankings: dict[tuple[str, str, str], list[str]] = field(default_factory=dict)
    # a ranked search's own regret estimate per backend (`RankedRounds.regret_estimate`)
    search_regret: dict[str, dict] = field(default_factory=dict)

    def search_of(self, winner: Winner) -> dict:
        """How the search found `winner`'s config on its key: the candidates that ran (compiled
        or further) of those that could, and the rank the ranking gave the winner on the key's
        first workload (None in an exhaustive search)."""
        key = winner.key.to_dict()
        mine = [t for t in self.trials if t.key == key and t.backend == winner.backend and t.status != "unsupported"]
        ran = [t for t in mine if t.status not in (RANKED_OUT, "skipped")]
        order = next((self.rankings[(t.workload, t.direction, t.backend)] for t in mine
                      if (t.workload, t.direction, t.backend) in self.rankings), None)
        label = config_label(winner.config)
        return {"ran": len({config_label_of(t) for t in ran}), "candidates": len({config_label_of(t) for t in mine}),
                "predicted_rank": order.index(label) + 1 if order and label in order else None}

    def timing_spread(self) -> dict | None:
        """How steady the timings were: the timed trials' median spread (p80 - p20 over the
        median) and how many spread over NOISY_SPREAD; None without a timed trial."""
        spreads = sorted(t.spread for t in self.trials if t.median_ms is not None and t.spread is not None)
        if not spreads:
            return None
        return {"median": spreads[len(spreads) // 2], "noisy": sum(s > NOISY_SPREAD for s in spreads),
                "timed": len(spreads)}

    def counts(self) -> dict[str, int]:
        """Trials by final status."""
        counts: dict[str, int] = {}
        for trial in self.trials:
            counts[trial.status] = counts.get(trial.status, 0) + 1
        return counts

    def phase_bounds(self, cores: int, gpus: int = 1) -> dict[str, dict]:
        """Per phase, what bounded it on a host of `cores` cores and `gpus` GPUs
        (`workers.phase_bound`): the compile and winners phases run on pools (on a GPU; the
        measuring workers time what is compiled meanwhile), the measure phase is the timing
        left once the compiles are done, one trial at a time per GPU."""
        return {phase: phase_bound(seconds, self.pools.get(phase), cores, gpus) for phase, seconds in self.phases.items()}

    def funnel(self) -> dict[str, int]:
        """How many trials reached each stage (a trial that reached "timed" was also compiled...)."""
        order = STAGES
        return {stage: sum(order.index(t.stage) >= order.index(stage) for t in self.trials if t.status != "skipped")
                for stage in order[1:]} | {"pruned_before_gpu": sum(t.stage == "pruned" and t.status == "unsupported"
                                                                    for t in self.trials)}


def config_label_of(trial: Trial) -> str:
    """A trial's config as `config_label` writes it."""
    kind = {"fwd": FwdConfig, "bwd": BwdConfig}.get(trial.direction, DecodeConfig)
    return config_label(config_from_dict(kind, trial.config))


def combine_backends(results: dict[str, TuneResult]) -> TuneResult:
    """One result from the tunes of several backends over the same workloads: per key the
    winner with the lowest median time on the key's lead workload (ties go to the backend named
    first; a later backend's tune, given the earlier winners as `rivals`, names none where it
    cannot beat them), every trial, the summed wall time, and phases prefixed with their backend."""
    best: dict[TableKey, Winner] = {}
    for result in results.values():
        for winner in result.winners:
            held = best.get(winner.key)
            if held is None or winner.evidence["median_ms"] < held.evidence["median_ms"]:
                best[winner.key] = winner
    return TuneResult(
        winners=list(best.values()),
        trials=[trial for result in results.values() for trial in result.trials],
        wall_s=sum(result.wall_s for result in results.values()),
        meaningful_timings=all(result.meaningful_timings for result in results.values()),
        phases={f"{name} {phase}": seconds for name, result in results.items() for phase, seconds in result.phases.items()},
        pools={f"{name} {phase}": pool for name, result in results.items() for phase, pool in result.pools.items()},
        rankings={k: v for result in results.values() for k, v in result.rankings.items()},
        search_regret={k: v for result in results.values() for k, v in result.search_regret.items()},
    )


# -- the orchestrator ---------------------------------------------------------------------------


def candidate_list(direction: str, space: list, workload: Workload, device, backend_name: str = "triton") -> list:
    """The default config a call of this workload gets without a table (first: `is_default`), then
    the space."""
    if direction == "decode":
        default = decode_config(workload.head_dim, device)
    else:
        default = default_configs(workload.head_dim, device, backend_name, workload.dtype,
                                  workload.key(direction).bias)[0 if direction == "fwd" else 1]
    return list(dict.fromkeys([default, *space]))


def current_choice_regret(key: TableKey, ranked: list, best: list, backend_name: str, device) -> dict:
    """What a call of `key` runs today (`tiles.choose`: a table entry, else the default), and its
    regret against this tune's winner (`best`, its trial per workload): the geometric mean over
    the key's workloads of its time over the winner's. `regret` is None when this tune did not
    time that choice (another backend, a config outside the space, or one that failed)."""
    choice = tiles.choose(key, device)
    current = {"source": choice.source.split(":", 1)[0], "backend": choice.backend,
               "config": config_label(choice.config), "regret": None}
    runs = next((runs for config, runs in ranked if config == choice.config), None)
    if runs is not None and choice.backend == backend_name:
        current["regret"] = round(math.prod(t.median_ms / b.median_ms for t, b in zip(runs, best)) ** (1 / len(runs)),
                                  4)
    return current


def tuned_directions(workload: Workload, spaces: dict[str, list]) -> tuple[str, ...]:
    """The directions a tune with `spaces` runs `workload` in: its own (`Workload.directions`)
    that have a space (a backend of a `--backend all` tune may have only one)."""
    return tuple(d for d in workload.directions("decode" in spaces) if d in spaces)


def plan_trials(workloads: list[Workload], spaces: dict[str, list], device, backend_name: str = "triton") -> list:
    """Every trial a tune of `backend_name` runs, in order: (workload, direction, config, is_default)."""
    return [(w, d, c, index == 0) for w in workloads for d in tuned_directions(w, spaces)
            for index, c in enumerate(candidate_list(d, spaces[d], w, device, backend_name))]


def planned_trial_ids(workloads: list[Workload], spaces: dict[str, list], device,
                      backend_name: str = "triton") -> list[str]:
    """The journal ids of `plan_trials` (what a resumed run finds done or still to run)."""
    return [trial_id(w, d, backend_name, c) for w, d, c, _ in plan_trials(workloads, spaces, device, backend_name)]


RESTART_AFTER = ("launch_error", "crash", "timeout")  # statuses that may leave a poisoned CUDA context
# what a trial timed again records: a time, or a fault of its kernel's (a worker lost, hung or
# short of memory the second time says nothing against the first time)
TIMED_AGAIN_RECORDED = ("ok", "mismatch", "nonfinite", "launch_error")


def tune(
    workloads: list[Workload],
    spaces: dict[str, list],
    device: torch.device | str,
    backend_name: str = "triton",
    budget_s: float | None = None,
    suite: str = "quick",
    on_trial: Callable[[Trial], None] | None = None,
    on_phase: Callable[[str, int], Callable[[], None]] | None = None,
    journal_path: str | Path | None = None,
    resume: bool = False,
    trial_timeout_s: float = DEFAULT_TRIAL_TIMEOUT_S,
    suite_timeout_s: float = DEFAULT_SUITE_TIMEOUT_S,
    gpus: int = 1,
    workers: list | None = None,
    ranking: RankingModel | None = None,
    widening: Widening = Widening(),
    pool: ProcessPool | None = None,
    rivals: dict[TableKey, float] | None = None,
) -> TuneResult:
    """Tunes every workload in its directions (`Workload.directions`).

    Args:
        workloads: shapes to tune.
        spaces: {"fwd": [FwdConfig...], "bwd": [BwdConfig...]} candidate configs, and optionally
            "decode": [DecodeConfig...].
        device: where kernels run ("cpu" means the Triton interpreter).
        backend_name: the kernel family.
        budget_s: stop starting new trials after this many seconds (finished work is kept).
        suite: adversarial suite for the winners ("quick" or "full").
        on_trial: called with every trial this run finishes (progress); not with those replayed
            from the journal on resume (count them with `planned_trial_ids`).
        on_phase: progress factory for parallel phases: (description, total) -> per-job callback.
        journal_path: where trials are journaled (None: a temporary journal is not kept).
        resume: continue the journal at `journal_path`. Without it, the journal of a completed
            run is replaced and one of a run interrupted or stopped by its budget refused.
        trial_timeout_s: a candidate running longer is killed: status "timeout".
        suite_timeout_s: the same for one adversarial suite run.
        gpus: measuring workers, one per GPU (cuda:0..gpus-1); they take whole workloads from
            one queue, largest first, and measure concurrently, each on its own GPU, into the
            one journal. On the CPU this many interpreter workers share the cores.
        workers: measuring slots to use instead of `gpus` local ones (e.g. `cluster.RayWorker`
            on other hosts); the local compile phase is then skipped, each slot compiling what
            it measures, since a local compile cache would not reach them.
        ranking: rank each key's candidates with this model and time them in rounds down the
            ranking as `widening` says (`ranking.RankedRounds`); the rest end "ranked_out", and
            the journal records each key's ranking. None: time every candidate (exhaustive).
        pool: the processes that compile the candidates and run the winners' suites on a GPU
            (`process_pool`), kept by the caller for a tune of several backends. None: the tune
            starts its own.
        rivals: in a tune of several backends, per key the median ms (on the key's last
            workload) of the winner an earlier backend validated. A key where no candidate here
            is faster gets no winner here (`combine_backends` would keep the rival's, ties
            going to the backend tuned first), so its winner's suite is not run here.

    Returns:
        Winners (one per key), every trial, and the wall time.

    Raises:
        journal.JournalError: the journal is locked, or holds a run that did not complete and
            `resume` is False.
    """
    device = torch.device(device)
    backend = get_backend(backend_name)
    start = time.monotonic()
    owned_dir = None
    if journal_path is None:
        owned_dir = tempfile.TemporaryDirectory()
        journal_path = Path(owned_dir.name) / "trials.jsonl"
    identity = {"backend": backend_name, "device": device_fingerprint(device).to_dict(),
                "kernel_hash": kernel_source_hash(backend_name)}
    journal = Journal(Path(journal_path), resume, identity)
    remote = workers is not None
    if not remote:
        workers = [Worker(interpret=device.type != "cuda", gpu=gpu if device.type == "cuda" else None)
                   for gpu in range(max(1, gpus))]
    owned_pool = pool is None and device.type == "cuda" and not remote  # remote slots compile what they measure
    try:
        if owned_pool:
            pool = process_pool(workloads, device, len(workers))
        return _run(workloads, spaces, device, backend, backend_name, budget_s, suite, on_trial, on_phase,
                    journal, workers, trial_timeout_s, suite_timeout_s, start, compile_locally=not remote,
                    ranking=ranking, widening=widening, pool=pool, rivals=rivals or {})
    except BaseException:
        if owned_pool and pool is not None:
            pool.discard(kill=True)
        raise
    finally:
        if owned_pool and pool is not None:
            pool.discard()
        for worker in workers:
            worker.stop()
        journal.close()
        if owned_dir is not None:
            owned_dir.cleanup()


def process_pool(workloads: list[Workload], device: torch.device | str, gpus: int = 1) -> ProcessPool:
    """The compile and suite processes of a tune of `workloads` on `gpus` GPUs like `device`: a
    core each (`workers.worker_count`), as many as half the GPU's memory holds with the largest
    workload's tensors in each."""
    device = torch.device(device)
    gpu_bytes = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    largest = max((workload.tensor_bytes() for workload in workloads), default=0)
    return ProcessPool(worker_count(10**6, gpus, job_bytes=largest, gpu_bytes=gpu_bytes), gpus)


def _run(workloads, spaces, device, backend, backend_name, budget_s, suite, on_trial, on_phase, journal, workers,
         trial_timeout_s, suite_timeout_s, start, compile_locally: bool, ranking: RankingModel | None,
         widening: Widening, pool: ProcessPool | None, rivals: dict[TableKey, float]) -> TuneResult:
    def out_of_budget() -> bool:
        return budget_s is not None and time.monotonic() - start > budget_s

    plan = plan_trials(workloads, spaces, device, backend_name)
    trials: dict[str, Trial] = {}
    record_lock = threading.Lock()  # measuring threads share the journal, the trials and progress
    # Set when the run is interrupted (Ctrl-C): the workers are then killed under the measuring
    # threads, and what those threads see next is that kill, not their candidate's verdict; a
    # journaled "crash" would be kept by --resume
    interrupted = threading.Event()

    def finish(workload, direction, config, is_default, fields, replayed=False) -> None:
        key = workload.key(direction)
        trial = Trial(workload.label, key.to_dict(), direction, backend_name, config.to_dict(),
                      is_default=is_default, **fields)
        identifier = trial_id(workload, direction, backend_name, config)
        with record_lock:
            if interrupted.is_set():
                return
            trials[identifier] = trial
            if not replayed and trial.status != "skipped":
                journal.append({"kind": "trial", "id": identifier, **trial.to_dict()})
            if on_trial and not replayed:  # the caller counts replayed trials once, up front
                on_trial(trial)

    # -- resumed trials, and what needs no GPU time --
    limits = local_limits(device) if device.type == "cuda" else None
    todo = []
    for workload, direction, config, is_default in plan:
        record = journal.trials.get(trial_id(workload, direction, backend_name, config))
        if record is not None and not measured_again_on_resume(record, device.type == "cuda"):
            fields = {k: record[k] for k in ("status", "reason", "median_ms", "spread", "tflops", "validation", "stage")}
            finish(workload, direction, config, is_default, fields, replayed=True)
            continue
        # the shape judges the config; the key, whether the backend runs packed sequences and windows
        reason = (tiles.key_problem(backend_name, workload.key(direction), config)
                  or backend.is_supported(config, shape_of_workload(workload)))
        if reason is None and device.type == "cuda":
            pruned = precheck(direction, config, limits, workload.head_dim, workload.dtype, backend_name)
            reason = pruned.reason if pruned is not None else None
        if reason:
            finish(workload, direction, config, is_default, {"status": "unsupported", "reason": reason})
        else:
            todo.append((workload, direction, config, is_default))

    phases: dict[str, float] = {}
    pools: dict[str, PoolStats] = {"compile": PoolStats(), "winners": PoolStats()}
    fatal: list[DmattnError] = []  # a worker that cannot go on (e.g. no cluster GPU): stop, keep the journal

    def compile_and_measure(todo: list, again: bool = False) -> None:
        """Compiles (on a GPU) and measures `todo`'s trials, recording each (`finish`). `again`:
        trials this run timed once already, their kernels in the cache: none is compiled, and one
        the budget leaves keeps its first time."""
        # Each measuring worker takes the next whole workload from one queue (its inputs and
        # reference stay cached in the worker), largest first, so the last workloads to finish are
        # the small ones and no GPU idles while another works through a long tail. On a GPU the
        # pool compiles the workloads in that order, and a workload is queued as soon as its last
        # compile ends: the measuring workers time one workload while the pool compiles the next.
        shares: dict[Workload, list] = {}
        for item in sorted(todo, key=lambda item: _work(item[0]), reverse=True):  # stable: plan order within
            shares.setdefault(item[0], []).append(item)
        compiling = device.type == "cuda" and bool(todo) and compile_locally and not again
        queue: Queue = Queue()
        if not compiling:
            for share in shares.values():
                queue.put(share)
            for _ in workers:
                queue.put(None)

        def measure_share(worker) -> None:
            try:
                if compiling:  # its start-up (imports, CUDA context) beside the first compiles
                    _start_quietly(worker, str(device), trial_timeout_s)
                measure_queue(worker)
            except Exception:
                if not interrupted.is_set():
                    raise  # after an interrupt a killed worker may fail in any way: nothing to report

        def measured(worker, job, args) -> dict | None:
            """`job(*args)` in the worker: trial fields, or None for nothing to report. A lost or
            hung worker is the trial's status, and the next job gets a fresh process (and CUDA
            context); a DmattnError stops the tune (`fatal`), the trial "skipped"."""
            try:
                fields = worker.call(job, args, trial_timeout_s)
            except WorkerTimedOut as exc:
                fields = {"status": "timeout", "reason": str(exc), "stage": "compiled"}
            except (WorkerCrashed, RuntimeError) as exc:
                fields = {"status": "crash", "reason": str(exc)[:300], "stage": "compiled"}
            except DmattnError as exc:
                fatal.append(exc)
                return {"status": "skipped", "reason": exc.one_line()}
            if fields is not None and fields["status"] in RESTART_AFTER:
                worker.stop()
            return fields

        def measure_queue(worker) -> None:
            while True:
                share = queue.get()
                if share is None or interrupted.is_set():
                    return  # no more workloads; or no fresh worker to race the parent's stop
                # the workload's inputs and references first: if building them fails, its trials end
                # with that one failure instead of each failing alike (and restarting the worker); a
                # worker lost or hung meanwhile is left to the trials, each in a fresh process
                failure = None
                if not (out_of_budget() or fatal):
                    failure = measured(worker, problem_job, (share[0][0], str(device)))
                    if failure is not None and not failure["reason"].startswith(PROBLEM_FAILED):
                        failure = None
                if again and failure is not None:
                    continue  # the trials keep the times they have
                for workload, direction, config, is_default in share:
                    if interrupted.is_set():
                        return  # no fresh worker to race the parent's stop
                    if (out_of_budget() or fatal) and again:
                        continue
                    if out_of_budget() or fatal:
                        reason = "time budget exhausted" if not fatal else "tune stopped: " + fatal[0].one_line()
                        finish(workload, direction, config, is_default, {"status": "skipped", "reason": reason})
                        continue
                    fields = failure or measured(worker, measure_job, (workload, direction, config, backend_name,
                                                                       str(device)))
                    if again and fields is not None and fields["status"] not in TIMED_AGAIN_RECORDED:
                        continue  # lost, hung or short of memory this time: the first time stands
                    finish(workload, direction, config, is_default, fields)

        phase_start = time.monotonic()
        threads = [threading.Thread(target=measure_share, args=(worker,), daemon=True) for worker in workers]
        try:
            for thread in threads:
                thread.start()
            if compiling:
                compile_streaming(shares, queue, len(workers))
                phases["compile"] = phases.get("compile", 0.0) + time.monotonic() - phase_start
                phase_start = time.monotonic()
            for thread in threads:
                thread.join()
        except BaseException:
            with record_lock:  # no trial is being journaled as the flag goes up
                interrupted.set()
            for _ in threads:  # none waits on the queue for ever
                queue.put(None)
            raise
        if fatal:
            raise fatal[0]
        phases["measure"] = phases.get("measure", 0.0) + time.monotonic() - phase_start

    def compile_streaming(shares: dict, queue: Queue, measurers: int) -> None:
        """Compiles the shares' candidates in the pool (a failure here is the trial's status) and
        queues each workload's compiled ones for measuring as its last compile ends; then one
        stop per measuring worker."""
        items = [item for share in shares.values() for item in share]
        jobs = [(w, d, c, backend_name) for w, d, c, _ in items]
        index_of = {job: index for index, job in enumerate(jobs)}
        left = {workload: len(share) for workload, share in shares.items()}
        compiled: dict[Workload, list[int]] = {workload: [] for workload in shares}
        done = None

        def ended(job: tuple, outcome: tuple[str, str]) -> None:
            index = index_of[job]
            workload, direction, config, is_default = items[index]
            status, reason = outcome
            if status == "ok":
                compiled[workload].append(index)
            else:
                stage = "pruned" if status in ("compile_error", "unsupported") else "compiled"
                finish(workload, direction, config, is_default, {"status": status, "reason": reason, "stage": stage})
            left[workload] -= 1
            if not left[workload] and compiled[workload]:
                queue.put([items[i] for i in sorted(compiled[workload])])  # in plan order
            if done:
                done()

        try:
            done = on_phase("compile", len(jobs)) if on_phase else None
            parallel_map(warm_job, jobs, on_crash=lambda job, reason: ("crash", reason), on_done=ended, gpus=len(workers),
                         stats=pools["compile"], after=leaders(compile_keys(jobs, backend)), pool=pool)
        finally:
            for _ in range(measurers):
                queue.put(None)

    # -- the search: every candidate (exhaustive), or rounds down each key's ranking --
    rankings: dict[tuple[str, str, str], list[str]] = {}
    search_regret: dict[str, dict] = {}
    if ranking is None:
        compile_and_measure(todo)
    else:
        def finished(item):
            """A trial's median ms, None when it failed, ... when it has not run."""
            trial = trials.get(trial_id(item[0], item[1], backend_name, item[2]))
            if trial is None:
                return ...
            return trial.median_ms if trial.status == "ok" else None

        # what runs here: the candidates still to run and those a resumed journal measured
        rounds = RankedRounds([item for item in plan if finished(item) is ... or
                               trials[trial_id(item[0], item[1], backend_name, item[2])].status != "unsupported"],
                              ranking, widening)
        batch = rounds.first(finished)
        while batch and not out_of_budget():
            compile_and_measure(batch)
            for item in batch:
                median = finished(item)
                rounds.timed_as(item, None if median is ... else median)
            batch = rounds.next_round(finished)
        # what did not run: ranked out, or (the budget spent) skipped, which --resume measures
        ranked_out = dict(rounds.left_out()) if not out_of_budget() else {}
        for item in plan:
            if finished(item) is ...:
                finish(*item, {"status": RANKED_OUT, "reason": ranked_out[item], "stage": "pruned"}
                       if item in ranked_out else {"status": "skipped", "reason": "time budget exhausted"})
        for record in rounds.records(backend_name):
            journal.append(record)
        rankings = {(w.label, d, backend_name): [config_label(item[2]) for item in group.ranked]
                    for (w, d), group in rounds.groups.items()}
        search_regret[backend_name] = rounds.regret_estimate()
    # out of memory beside other work (the compile pool's tensors, on two H200s 1085 of 1712
    # trials): measured once more now that the compiles are done and no compile worker holds any
    crowded = [item for item in plan
               if (trial := trials.get(trial_id(item[0], item[1], backend_name, item[2]))) and trial.status == "oom"]
    if crowded and not out_of_budget():
        compile_and_measure(crowded)
    # timed beside the compile pool, whose processes load each kernel and allocate its workload on
    # the GPU: on two H200s the sweep tune's trials spread 1.1% at the median with 642 of 1512 over
    # NOISY_SPREAD (an earlier run's, timed again after its compiles, 2.5% against 14%). Every
    # timed trial of a key with such a trial is timed once more with the pool idle, its rivals too
    # (a crowded stretch can slow a whole run of repeats evenly), so no crowded moment picks it.
    def timed(item) -> Trial | None:
        trial = trials.get(trial_id(item[0], item[1], backend_name, item[2]))
        return trial if trial is not None and trial.status == "ok" else None

    crowded_keys = {(item[0], item[1]) for item in plan
                    if (trial := timed(item)) and timed_noisily(trial.to_dict(), device.type == "cuda")}
    retimed = [item for item in plan if (item[0], item[1]) in crowded_keys and timed(item)]
    if retimed and not out_of_budget():
        compile_and_measure(retimed, again=True)
    worker = workers[0]

    # -- winners, from the journal's view of every trial --
    phase_start = time.monotonic()
    winners = _choose_winners(workloads, spaces, device, backend_name, suite, trials, journal, worker,
                              suite_timeout_s, on_phase, gpus=len(workers) if compile_locally else 1,
                              stats=pools["winners"], pool=pool, rivals=rivals)
    phases["winners"] = time.monotonic() - phase_start
    ordered = [trials[trial_id(w, d, backend_name, c)] for w, d, c, _ in plan]
    return TuneResult(winners, ordered, time.monotonic() - start, device.type == "cuda",
                      {name: round(seconds, 1) for name, seconds in phases.items()},
                      {name: pool.to_dict() for name, pool in pools.items() if pool.jobs}, rankings, search_regret)


def compile_keys(jobs: list[tuple], backend) -> list[list[tuple]]:
    """Per compile job (workload, direction, config, backend name), the kernels it compiles, keyed
    so that jobs of workloads of one `adversarial.specialization_class` meet on the kernels they
    share."""
    return [[(specialization_class(w.case(), w.dtype), *kernel) for kernel in backend.kernels(d, c, shape_of_workload(w))]
            for w, d, c, _ in jobs]


def _case_identity(job: CaseJob) -> tuple:
    """What decides a case job's outcome: the code (backend, direction, config, dtype) and the
    case itself, whichever suite lists it."""
    return job.backend_name, job.direction, job.config, job.dtype_name, _cases_of(job)[job.index]


def _cases_of(job: CaseJob) -> tuple:
    """The cases of the suite a case job belongs to (`trials.suite_cases`)."""
    return suite_cases(job.backend_name, job.direction, job.config, job.suite, job.max_head_dim, job.varlen)


def _case_kernels(job: tuple) -> list[tuple]:
    """The kernels one suite case job compiles (`suite_case_job`'s job), keyed so that cases of
    one `specialization_class` (e.g. the NaN, +inf and -inf poisoned biases) meet on them."""
    job = CaseJob(*job)
    case = _cases_of(job)[job.index]
    return [(specialization_class(case, job.dtype_name), *kernel)
            for kernel in get_backend(job.backend_name).kernels(job.direction, job.config, shape_of_case(case))]


def _work(workload: Workload) -> int:
    """Relative cost of a workload's trials: its score-matrix elements (a packed one's, of its
    documents) times the head dim."""
    pairs = sum(n * n for n in workload.documents) if workload.packed else workload.seqlen_q * workload.seqlen_k
    return workload.batch * workload.heads * pairs * workload.head_dim


def _varlen(key: TableKey) -> bool:
    """Whether a key's winner runs the packed/window suite (`trials.suite_cases`)."""
    return key.packed or key.window > 0


def _start_quietly(worker, device_name: str, timeout_s: float) -> None:
    """Starts a measuring worker; a failure here is left to its first trial to report."""
    try:
        worker.call(ready_job, (device_name,), timeout_s)
    except Exception:  # noqa: BLE001 - the first trial restarts the worker and records the error
        worker.stop()


def _ranked(trials: dict[str, Trial], group: list[Workload], direction: str, spaces, device, backend_name):
    """Candidates of one table key, best first, as [(config, [trial per workload])].

    Several workloads can share a key (their lengths fall in one bucket); a config must have
    passed on all of them, and is ranked by the geometric mean of its time relative to the
    fastest on each workload (ties: plan order).
    """
    candidates = candidate_list(direction, spaces[direction], group[0], device, backend_name)
    per_config = []
    for config in candidates:
        runs = [trials[trial_id(w, direction, backend_name, config)] for w in group]
        if all(t.status == "ok" and t.median_ms is not None for t in runs):
            per_config.append((config, runs))
    if not per_config:
        return []
    fastest = [min(runs[i].median_ms for _, runs in per_config) for i in range(len(group))]

    def score(item):
        _, runs = item
        return math.prod(t.median_ms / best for t, best in zip(runs, fastest)) ** (1 / len(runs))

    return sorted(per_config, key=score)


def _choose_winners(workloads, spaces, device, backend_name, suite, trials, journal, worker, suite_timeout_s,
                    on_phase, gpus: int = 1, stats: PoolStats | None = None,
                    pool: ProcessPool | None = None, rivals: dict[TableKey, float] | None = None) -> list[Winner]:
    groups: dict[TableKey, list[Workload]] = {}
    for workload in workloads:
        for direction in tuned_directions(workload, spaces):
            groups.setdefault(workload.key(direction), []).append(workload)

    # a candidate's suite is run for the head dim of the key it is chosen for, and for a key with
    # packed sequences or a window is the packed/window suite (`suite_cases`)
    def suite_key(direction, config, dtype, head_dim, varlen) -> str:
        names = [case.name for case in suite_cases(backend_name, direction, config, suite, head_dim, varlen)]
        return suite_id(backend_name, direction, config, dtype, suite, names)

    ran_here: set[str] = set()  # suites this run ran alone: their verdict stands, out of memory or not

    def unanswered(identifier: str) -> bool:
        journaled = journal.suites.get(identifier)
        return identifier not in ran_here and (journaled is None or journaled[0] in SUITES_RUN_AGAIN_ON_RESUME)

    def verdict_of(direction, config, dtype, head_dim, varlen) -> tuple[str, str]:
        identifier = suite_key(direction, config, dtype, head_dim, varlen)
        if unanswered(identifier):
            ran_here.add(identifier)
            try:
                status, note = worker.call(suite_job, (backend_name, direction, config, dtype, suite, str(device),
                                                       head_dim, varlen), suite_timeout_s)
            except WorkerTimedOut as exc:
                status, note = "timeout", f"adversarial suite: {exc}"
            except (WorkerCrashed, RuntimeError) as exc:
                status, note = "crash", f"adversarial suite: {str(exc)[:300]}"
            if status in RESTART_AFTER:
                worker.stop()  # a case may have killed its CUDA context: the next suite gets a fresh one
            journal.append({"kind": "suite", "id": identifier, "status": status, "note": note})
        return journal.suites[identifier]

    ranked_by_key = {key: _ranked(trials, group, key.direction, spaces, device, backend_name)
                     for key, group in groups.items()}
    # A key whose rival (another backend's validated winner) no candidate here beats on the key's
    # last workload is the rival's: no suite runs for it here. (H200 default grid, both dtypes
    # and backends: the table kept 24 of the 48 configs whose suites ran, half of the suites'
    # 106 s.)
    rivals = rivals or {}
    ranked_by_key = {key: ranked for key, ranked in ranked_by_key.items()
                     if key not in rivals or any(runs[-1].median_ms < rivals[key] for _, runs in ranked)}
    # GPU: the suites of every key's best candidate, compiled and run in parallel first
    if device.type == "cuda":
        # one run per suite (keys of head dims above every case's share one)
        unjournaled = {}
        for key, ranked in ranked_by_key.items():
            if not ranked:
                continue
            identifier = suite_key(key.direction, ranked[0][0], key.dtype, key.head_dim, _varlen(key))
            if unanswered(identifier):
                unjournaled.setdefault(identifier, CaseJob(backend_name, key.direction, ranked[0][0], key.dtype, suite,
                                                           str(device), key.head_dim, 0, _varlen(key)))
        suites = list(unjournaled.values())  # each a suite's first case job
        case_jobs = [one._replace(index=index) for one in suites for index in range(len(_cases_of(one)))]
        # A case two suites share runs once: a config chosen for keys of several head dims has the
        # smaller one's cases in both suites, the same code on the same inputs (H200, default
        # workloads, bf16: 255 case jobs of 11 suites, 169 of them distinct).
        runs_for: dict[tuple, CaseJob] = {}
        for job in case_jobs:
            runs_for.setdefault(_case_identity(job), job)
        distinct = list(runs_for.values())

        def crashed(job, reason) -> CaseResult:
            return CaseResult(_cases_of(job)[job.index].name, "crash", reason)

        done = on_phase(f"adversarial suite of {len(suites)} configs", len(distinct)) if on_phase and suites else None
        outcomes = dict(zip(distinct, run_cases_in_pool(suite_case_job, distinct, _case_kernels, crashed,
                                                        on_done=lambda job, result: done() if done else None,
                                                        gpus=gpus, stats=stats, pool=pool)))
        short = False  # a suite ran out of memory: the serial path runs it with no pool process on the GPU
        for one in suites:
            status, note = suite_verdict([outcomes[runs_for[_case_identity(job)]] for job in case_jobs
                                          if job._replace(index=0) == one], suite)
            short = short or status == "oom"
            if status not in ("crash", "oom"):
                # a dead pool process is blamed on the first pending job, not always the culprit,
                # and a case out of memory may be short of what the pool's other cases held: such a
                # config is left to the serial path below, which runs its suite alone
                journal.append({"kind": "suite", "id": suite_key(one.direction, one.config, one.dtype_name,
                                                                 one.max_head_dim, one.varlen),
                                "status": status, "note": note})
        if short and pool is not None:
            pool.discard()  # each process holds a CUDA context; a later phase starts fresh ones

    winners = []
    for key, ranked in ranked_by_key.items():
        defaults = next((runs for config, runs in ranked if runs[0].is_default), None)
        for config, runs in ranked:
            status, note = verdict_of(key.direction, config, key.dtype, key.head_dim, _varlen(key))
            if status != "ok":
                for trial in runs:
                    trial.status, trial.reason = status, note
                continue
            for trial in runs:
                trial.stage = "adversarial"
            speedups = [d.median_ms / t.median_ms for d, t in zip(defaults, runs)] if defaults else []
            lead = runs[-1]  # the group's last (largest) workload speaks for the entry's timing
            evidence = {"median_ms": lead.median_ms, "spread": lead.spread, "tflops": lead.tflops,
                        "speedup_vs_default": round(math.prod(speedups) ** (1 / len(speedups)), 4) if speedups else None,
                        "validation": {n: max(t.validation.get(n, 0.0) for t in runs) for n in lead.validation},
                        "adversarial": note, "workload": lead.workload, "workloads": len(runs),
                        "current_choice": current_choice_regret(key, ranked, runs, backend_name, device)}
            winners.append(Winner(key, backend_name, config, evidence))
            break
    return winners
