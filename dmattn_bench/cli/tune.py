"""`dmattn-bench tune`: sweep the search space over the workloads and write a dispatch table."""

from __future__ import annotations

import contextlib
import json
import math
import re
import shlex
from pathlib import Path

import click
import torch
from rich.table import Table

from dmattn_bench import output
from dmattn_bench.cli.checks import reject_bf16_without_gpu
from dmattn_bench.dispatch import ENV_VAR, Entry, TableError, load_table
from dmattn_bench.dispatch.stamps import entry_status
from dmattn_bench.errors import DmattnError, NoGpuError
from dmattn_bench.hardware import device_fingerprint, local_limits, search_section
from dmattn_bench.space import CONFIGS_DIR, TUNED_DIRECTIONS, config_label
from dmattn_bench.tuning import ledger
from dmattn_bench.tuning.journal import JournalError, JournalState, mark_finished, read_state
from dmattn_bench.tuning.ranking import RankingModel
from dmattn_bench.tuning.prune import load_ci_space, load_space, read_yaml_mapping
from dmattn_bench.tuning.table_writer import dump_table, merged, new_table
from dmattn_bench.tuning.tuner import (DEFAULT_SUITE_TIMEOUT_S, DEFAULT_TRIAL_TIMEOUT_S, TuneResult, combine_backends,
                                       noisy_timings, planned_trial_ids, process_pool, tune)
from dmattn_bench.tuning.workers import usable_cores
from dmattn_bench.tuning.workloads import load_workloads, workload_of_key

CI_FILE = CONFIGS_DIR / "ci.yaml"
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|sec|m|min|h)?\s*$")
_UNIT_SECONDS = {None: 1, "s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600}


def parse_duration(text: str | None) -> float | None:
    """"90s", "20m", "1.5h" or plain seconds -> seconds."""
    if text is None:
        return None
    match = _DURATION.match(text)
    if not match:
        raise click.BadParameter(f"got {text!r}, expected a duration like 90s, 20m or 1.5h", param_hint="--budget")
    return float(match.group(1)) * _UNIT_SECONDS[match.group(2)]


def parse_gpus(text: str, available: int | None = None) -> int:
    """"all" or a positive count, checked against the GPUs present (this machine's, or the
    cluster's when `available` is given)."""
    available = torch.cuda.device_count() if available is None else available
    if text == "all":
        return max(1, available)
    if not text.isdigit() or int(text) < 1:
        raise click.BadParameter(f"got {text!r}, expected a positive number or 'all'", param_hint="--gpus")
    if available and int(text) > available:
        raise click.BadParameter(f"got {text}, but there are {available} GPU(s)", param_hint="--gpus")
    return int(text)


BACKENDS = ("triton", "cuda")  # what --backend all tunes, in order


def _named_backends(path: str) -> set:
    """The backends a space file holds configs of: its `backend`, or a CI-style file's `space` keys."""
    document = read_yaml_mapping(path)
    return set(document["space"] or {}) if "space" in document else {document.get("backend")}


def _spaces(space_files: tuple[str, ...], backend: str, on_gpu: bool, several: bool = False) -> dict[str, list]:
    """Candidate configs per direction from space files (per-direction files with arch sections,
    or a CI-style file holding `space.<backend>.<direction>`). The prefill pair is required; the
    short-query forward's ("decode") is tuned where a space for it is given (by default the
    backend's `configs/space/<backend>-decode.yaml`, where it has one).

    In a tune of `several` backends each takes the files that name it, or its defaults where none
    does; given files may tune it in one direction only (the tune checks that the backends
    together cover the prefill pair)."""
    if several:
        named = {path: _named_backends(path) for path in space_files}
        for path, backends in named.items():
            if not backends & set(BACKENDS):
                raise ValueError(f"{path}: names no backend of {', '.join(BACKENDS)} (its `backend` key)")
        space_files = tuple(path for path, backends in named.items() if backend in backends)
    if not on_gpu and not space_files:
        space_files = (str(CI_FILE),)
    default_files = (CONFIGS_DIR / "space" / f"{backend}-{d}.yaml" for d in TUNED_DIRECTIONS)
    files = space_files or tuple(str(path) for path in default_files if path.exists())
    section = search_section(local_limits()) if on_gpu else "sm90"
    spaces: dict[str, list] = {}
    for path in files:
        document = read_yaml_mapping(path)
        if "space" in document:
            given = (document["space"] or {}).get(backend) or {}
            directions = ("fwd", "bwd") + (("decode",) if "decode" in given else ())
            spaces.update({d: load_ci_space(path, backend, d) for d in directions})
        else:
            direction = document.get("direction")
            spaces[direction] = load_space(path, backend, direction, section)
    if "decode" in spaces and backend != "triton":
        raise click.BadParameter(f"a decode space is the Triton backend's (the short-query forward), not {backend}'s",
                                 param_hint="--space")
    missing = {"fwd", "bwd"} - set(spaces)
    if missing and not several:  # several: `tune_command` checks what the backends cover together
        raise click.BadParameter(f"no search space given for {sorted(missing)}", param_hint="--space")
    return spaces


def _winners_table(result: TuneResult) -> Table:
    title = "tuned entries" + ("" if result.meaningful_timings else " (interpreter: timings not meaningful)")
    table = Table(title=title)
    numbers = ("ms", "TFLOP/s", "vs default", "ran", "rank", "regret of today's choice")
    for column in ("dir", "dtype", "D", "causal", "mask", "bias", "gqa", "packed/window", "Lq~", "Lk~", "backend",
                   "config", *numbers):
        table.add_column(column, justify="right" if column in numbers else "left")
    for winner in result.winners:
        k, e = winner.key, winner.evidence
        search = result.search_of(winner)
        table.add_row(k.direction, k.dtype, str(k.head_dim), str(k.causal), k.mask, k.bias, str(k.gqa_ratio),
                      k.label().strip() or "-", str(k.seqlen_q_bucket), str(k.seqlen_k_bucket), winner.backend,
                      config_label(winner.config),
                      f"{e['median_ms']:.4f}", f"{e['tflops']:.1f}", f"{e['speedup_vs_default'] or 0:.2f}x",
                      f"{search['ran']}/{search['candidates']}", str(search["predicted_rank"] or "-"),
                      _current_label(e.get("current_choice")))
    table.caption = ("ran: the key's candidates compiled and timed of those that could run (the ranked search "
                     "leaves the rest ranked_out); rank: the winner's place in the key's ranking (- exhaustive); "
                     "regret of today's choice: what a call of the key ran before this tune (a table entry or the "
                     "default), its time over the winner's; packed/window: a packed-sequence key, a sliding "
                     "window's span bucket (Lq~ and Lk~ of a packed key: its longest sequences')")
    return table


def _current_label(current: dict | None) -> str:
    if not current:
        return "-"
    regret = "not timed" if current["regret"] is None else f"{current['regret']:.2f}x"
    return f"{regret} ({current['source']} {current['config']})"


def current_choice_regret(result: TuneResult) -> dict:
    """Geometric-mean and worst regret of the choices calls made before this tune, over the keys
    whose choice the tune timed (`tuner.current_choice_regret`), and how many it did not."""
    regrets = [w.evidence["current_choice"]["regret"] for w in result.winners if w.evidence.get("current_choice")]
    timed = [r for r in regrets if r is not None]
    return {"keys": len(timed), "not_timed": len(regrets) - len(timed),
            "geomean": round(math.prod(timed) ** (1 / len(timed)), 4) if timed else None,
            "worst": max(timed) if timed else None}


def _counts_table(result: TuneResult) -> Table:
    phases = ", ".join(f"{name} {seconds:.0f} s" for name, seconds in result.phases.items())
    table = Table(title=f"trials (wall {result.wall_s:.0f} s{': ' + phases if phases else ''})")
    table.add_column("final status / stage reached")
    table.add_column("trials", justify="right")
    for status, count in sorted(result.counts().items()):
        table.add_row(f"status {status}", str(count))
    for stage, count in result.funnel().items():
        table.add_row(f"reached {stage}", str(count))
    return table


BOUND_NOTES = {"serial": "one process in turn", "waiting": "jobs off their cores", "hand-over": "processes idle between jobs",
               "cores": "the cores"}


def _phases_table(result: TuneResult, cores: int, gpus: int) -> Table:
    """Each phase's wall and what bounded it (`TuneResult.phase_bounds`)."""
    table = Table(title=f"phases (host of {cores} cores)")
    for column in ("phase", "wall s", "processes", "on core", "fed", "bound by"):
        table.add_column(column, justify="left" if column in ("phase", "bound by") else "right")
    for phase, bound in result.phase_bounds(cores, gpus).items():
        note = BOUND_NOTES[bound["bound"]] + (f" ({bound['processes']} of {cores}: more would run)"
                                              if bound["more_cores"] else "")
        table.add_row(phase, f"{result.phases[phase]:.1f}", str(bound["processes"]),
                      "-" if bound["on_core"] is None else f"{bound['on_core']:.0%}",
                      "-" if bound["fed"] is None else f"{bound['fed']:.0%}", note)
    return table


def geometric_mean_speedup(result: TuneResult) -> float | None:
    speedups = [w.evidence["speedup_vs_default"] for w in result.winners if w.evidence.get("speedup_vs_default")]
    if not speedups:
        return None
    product = 1.0
    for value in speedups:
        product *= value
    return product ** (1 / len(speedups))


def _positive_seconds(ctx, param, value: float) -> float:
    if not (value > 0 and math.isfinite(value)):
        raise click.BadParameter(f"got {value}, expected a positive number of seconds")
    return value


def _announce_phase(name: str, count: int):
    output.info(f"{name}: {count} jobs in parallel worker processes")
    return lambda: None


def _check_journal(trials_path: Path, resume: bool, on_gpu: bool) -> JournalState | None:
    """The journal this run starts from; --resume with none is a usage error (exit 2)."""
    state = read_state(trials_path, on_gpu)
    if resume and state is None:
        found = "is empty" if trials_path.exists() else "does not exist"
        raise click.BadParameter(f"nothing to resume: the journal {trials_path} {found}; run without --resume "
                                 "to start a tune", param_hint="--resume")
    return state


def _announce_journal(state: JournalState | None, resume: bool, trials_path: Path, out: Path,
                      planned: list[str]) -> int:
    """Says (stderr) what this run does with an existing journal; returns how many of the planned
    trials it replays from it instead of measuring."""
    if state is None:
        return 0
    if not resume:
        if state.refusal is None and state.trial_ids:
            output.info(f"{trials_path} is the journal of a completed run: starting over, replacing it and {out} "
                        "(--resume would reuse its trials instead)")
        return 0  # otherwise nothing to replace, or the tuner refuses it, naming --resume
    done = len(state.trial_ids.intersection(planned))
    other = len(state.trial_ids.difference(planned))
    output.info(f"resuming {trials_path}{' (a completed run)' if state.completed else ''}: skipping {done} journaled "
                f"trials, {len(planned) - done} of {len(planned)} to run"
                + (f" ({other} journaled trials of other workloads or configs are not used)" if other else ""))
    return done


def _how_to_use(out: Path, dtypes: list[str]) -> None:
    """The last lines of a tune (stderr): how to make calls use the table, and to verify it first."""
    path = str(out.resolve())
    output.info(f"use it: export {ENV_VAR}={shlex.quote(path)}   (in code: dmattn_bench.use_table({json.dumps(path)}))")
    output.info("before shipping it: " + "; ".join(f"dmattn-bench verify --table {shlex.quote(path)} --dtype {dtype}"
                                                    for dtype in dtypes))


TUNED_DIR = "tuned"  # where a tune writes without --out (the repository's .gitignore covers it)


def default_table_path(fingerprint) -> Path:
    """The table a tune without --out writes (its journal beside it): ./tuned/<device>.yaml."""
    return Path(TUNED_DIR) / f"{fingerprint.slug()}.yaml"


def _stale_workloads(table_path: str, dtypes, on_gpu: bool) -> tuple[list, set]:
    """The workloads of the table's entries that are not current (`stamps.entry_status`), in the
    given dtypes (all where none), and those entries' keys (interpreter-sized without a GPU).

    Raises:
        DmattnError: the table cannot be read.
    """
    try:
        table = load_table(table_path)
    except TableError as exc:
        raise DmattnError(f"--merge {table_path}: {exc}", "merge a valid table of this GPU") from None
    keys = [e.key for e in table.entries
            if entry_status(e, table.device) != "current" and (not dtypes or e.key.dtype in dtypes)]
    if not keys:
        return [], set()
    workloads, described = [], set()
    for key in keys:
        workload = workload_of_key(key, small=not on_gpu)
        if workload is None:
            output.warn(f"{table_path}: no workload describes the stale key {key}; it stays stale")
            continue
        workloads.append(workload)
        described.add(key)
    output.info(f"{table_path}: tuning its {len(described)} stale or unvalidated entries again")
    return list(dict.fromkeys(workloads)), described


@click.command("tune")
@click.option("--space", "space_files", multiple=True, type=click.Path(exists=True, dir_okay=False),
              help="Search-space YAML (repeat for fwd and bwd). Default: configs/space/<backend>-{fwd,bwd}.yaml "
                   "on a GPU, configs/ci.yaml without one. With --backend all each file goes to the backend it "
                   "names, which then tunes only the directions its files give (with --merge, one direction "
                   "may be left to the merged table); a backend no file names takes its defaults.")
@click.option("--workloads", "workloads_files", multiple=True, type=click.Path(exists=True, dir_okay=False),
              help="Workloads YAML; repeat to tune the union of several into one table (e.g. default.yaml and "
                   "peers-tune.yaml). Default: configs/workloads/default.yaml on a GPU, configs/ci.yaml without one.")
@click.option("--grid", default="default", show_default=True, help="Grid of the workloads file to run.")
@click.option("--backend", type=click.Choice(["triton", "cuda", "all"]), default="triton", show_default=True,
              help="Kernel backend(s) to tune. all: each in turn, and per key the table keeps the faster "
                   "(the cuda kernels need a GPU).")
@click.option("--dtype", "dtypes", multiple=True, type=click.Choice(["bf16", "fp16", "fp32"]),
              help="Kernel dtype(s); repeat for several. Default: the workloads file's.")
@click.option("--out", "out_path", type=click.Path(dir_okay=False), default=None,
              help=f"Table to write. Default: ./{TUNED_DIR}/<device>.yaml (e.g. {TUNED_DIR}/nvidia-h200-sm90.yaml; "
                   "the folder is created).")
@click.option("--merge", "merge_path", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Write --out as this tune's entries plus those of this table (of the same GPU) whose keys it did "
                   "not tune, e.g. decode keys tuned into a shipped table; each entry keeps its own validation.")
@click.option("--stale", "stale_only", is_flag=True, default=False,
              help="Tune again only the --merge table's entries that are stale or unvalidated (their code changed "
                   "since their validation: `dmattn-bench show` counts them), each on a workload of its key "
                   "(16 heads, about 8192 key tokens; one sequence without a GPU), and write them into it. "
                   "Default --out: the --merge table.")
@click.option("--resume", is_flag=True, default=False,
              help="Continue the trial journal (<out>.trials.jsonl), skipping the trials it holds but those "
                   "ranked out, out of memory or timed with a spread over 5% (measured again). Without it, "
                   "a completed run's journal is replaced (the run starts over), and that of a run interrupted "
                   "or stopped by --budget is refused.")
@click.option("--budget", default=None,
              help="Stop starting new trials after this long (e.g. 20m); finished work is kept. Workloads are "
                   "measured largest first.")
@click.option("--trial-timeout", type=float, default=DEFAULT_TRIAL_TIMEOUT_S, show_default=True, callback=_positive_seconds,
              help="Seconds one candidate may run before it is killed (status timeout).")
@click.option("--suite-timeout", type=float, default=DEFAULT_SUITE_TIMEOUT_S, show_default=True, callback=_positive_seconds,
              help="Seconds one adversarial-suite run may take before it is killed (the isolated runs "
                   "after a winner fails or crashes; the GPU's first, parallel pass has no limit).")
@click.option("--gpus", default="1", show_default=True,
              help="GPUs to measure on at once: a number or 'all' (one worker per GPU, workloads shared out, "
                   "one journal and one table). Without a GPU: that many interpreter workers.")
@click.option("--ray", "ray_address", default=None, metavar="ADDRESS",
              help="Measure on the GPUs of a Ray cluster ('auto', 'ray://host:10001', or 'local' to start one "
                   "here): --gpus actors of one GPU each; journal and table stay here (extra `cluster`).")
@click.option("--suite", type=click.Choice(["quick", "full"]), default="quick", show_default=True,
              help="Adversarial suite every winner must pass on its own tiles.")
@click.option("--exhaustive", is_flag=True, default=False,
              help="Time every candidate of every key. Default: rank each key's candidates by the committed "
                   "trial journals' times on similar keys and time them in batches down the ranking until a "
                   "batch brings no gain (the rest are journaled ranked_out; --exhaustive --resume times them).")
@click.option("--no-ledger", is_flag=True, default=False,
              help="Run every adversarial case. Default: a case that passed before on this GPU on the same code (its programs' sources, the host code, the software) answers from the case ledger in the cache directory (dmattn_bench.tuning.ledger).")
@click.option("--format", "fmt", type=click.Choice(output.FORMATS), default="human", show_default=True,
              help="Result format on stdout.")
def tune_command(space_files, workloads_files, grid, backend, dtypes, out_path, merge_path, stale_only, resume, budget,
                 trial_timeout, suite_timeout, gpus, ray_address, suite, exhaustive, no_ledger, fmt) -> None:
    """Tune the kernels on this machine's GPU and write a dispatch table.

    Every trial is journaled in <out>.trials.jsonl. Running the same command again after a run
    that completed starts over (journal and table are replaced); after a run that was interrupted
    or stopped by its --budget, it stops and asks for --resume (continue, measuring only what the
    journal lacks) or for the journal to be deleted.
    """
    budget_s = parse_duration(budget)
    if stale_only and (merge_path is None or workloads_files):
        raise click.BadParameter("re-tunes the stale entries of a table: pass --merge TABLE and no --workloads",
                                 param_hint="--stale")
    on_gpu = torch.cuda.is_available()
    reject_bf16_without_gpu(dtypes, on_gpu)
    backends = BACKENDS if backend == "all" else (backend,)
    if "cuda" in backends and not on_gpu:
        if backend == "cuda":
            raise NoGpuError("the cuda backend needs a CUDA GPU (its kernels run only there)",
                             "tune --backend triton here, or run on a GPU machine")
        output.info("no CUDA GPU: --backend all tunes the triton kernels only")
        backends = ("triton",)
    workers = None
    if ray_address is None:
        gpu_count = parse_gpus(gpus)
    else:
        from dmattn_bench.tuning import cluster

        cluster_gpus = cluster.connect(ray_address, on_gpu)
        gpu_count = parse_gpus(gpus, cluster_gpus if on_gpu else 0)
        workers = cluster.ray_workers(gpu_count, interpret=not on_gpu)
        output.info(f"Ray cluster {ray_address!r}: {gpu_count} measuring actor(s)"
                    + (f" of one GPU each ({cluster_gpus} GPUs in the cluster)" if on_gpu else " (interpreter)"))
    device = "cuda" if on_gpu else "cpu"
    if not on_gpu:
        given = "the given files" if workloads_files or space_files else "configs/ci.yaml"
        output.info(f"no CUDA GPU: tuning through the Triton interpreter on {given}; "
                    "the pipeline runs end to end but timings are not meaningful")
    workloads_files = workloads_files or (str(CONFIGS_DIR / "workloads" / "default.yaml" if on_gpu else CI_FILE),)
    try:
        # the union, in file order; a shape listed twice is tuned once
        if stale_only:
            workloads, stale_keys = _stale_workloads(merge_path, dtypes, on_gpu)
            out_path = out_path or merge_path
            if not workloads:
                output.info(f"{merge_path}: no stale or unvalidated entries to tune (`dmattn-bench show` lists them)")
                return
        else:
            workloads = list(dict.fromkeys(w for path in workloads_files
                                           for w in load_workloads(path, grid, list(dtypes) or None)))
        spaces = {name: _spaces(space_files, name, on_gpu, several=backend == "all") for name in backends}
    except ValueError as exc:  # a file given for an option that is not what it should be: usage, as in `bench`
        raise click.BadParameter(str(exc).splitlines()[0], param_hint="--workloads/--space") from None
    uncovered = {"fwd", "bwd"} - {direction for space in spaces.values() for direction in space}
    if uncovered and merge_path is None:  # a merged table keeps its entries of the other direction
        raise click.BadParameter(f"no backend has a search space for {sorted(uncovered)} (or pass --merge)",
                                 param_hint="--space")
    reject_bf16_without_gpu({w.dtype for w in workloads}, on_gpu, param_hint="--workloads")
    fingerprint = device_fingerprint(device)
    out = Path(out_path) if out_path else default_table_path(fingerprint)
    if out_path is None:
        out.parent.mkdir(exist_ok=True)
    if not out.resolve().parent.is_dir():
        raise click.BadParameter(f"{out}: its folder does not exist", param_hint="--out")
    trials_path = out.with_name(out.name + ".trials.jsonl")
    kept = None
    if merge_path is not None:
        try:  # before any GPU time: a table that cannot be merged fails now
            kept = load_table(merge_path)
            merged(kept, new_table((), fingerprint, interpreter=not on_gpu))
        except TableError as exc:
            raise DmattnError(f"--merge {merge_path}: {exc}", "merge a valid table of this GPU") from None
    journal = _check_journal(trials_path, resume, on_gpu)
    for name in backends:
        counts = " + ".join(f"{len(configs)} {direction}" for direction, configs in spaces[name].items())
        output.info(f"{name}: {len(workloads)} workloads x ({counts}) candidates")
    output.info(f"table -> {out}, trials -> {trials_path}")
    planned = [identifier for name in backends
               for identifier in planned_trial_ids(workloads, spaces[name], device, name)]
    replayed = _announce_journal(journal, resume, trials_path, out, planned)
    results = {}
    # one set of compile and suite processes for every backend (each costs seconds to start)
    pool = process_pool(workloads, device, gpu_count) if on_gpu and workers is None else None
    try:
        with (ledger.ledger_for_workers(None if no_ledger else ledger.default_path()),
              pool or contextlib.nullcontext(),
              output.progress("tune", total=len(planned) - replayed) as advance):
            rivals = {}  # per key, the fastest winner a backend before validated (its lead median ms)
            for index, name in enumerate(backends):
                # one journal: trial ids name their backend, so a later backend continues it
                ranking = None if exhaustive else RankingModel.load(name)
                results[name] = tune(workloads, spaces[name], device, name, budget_s=budget_s, suite=suite,
                                     on_trial=lambda trial: advance(f"{trial.backend} {trial.direction} {trial.status}"),
                                     on_phase=_announce_phase, journal_path=trials_path, resume=resume or index > 0,
                                     trial_timeout_s=trial_timeout, suite_timeout_s=suite_timeout, gpus=gpu_count,
                                     workers=workers, ranking=ranking, pool=pool, rivals=dict(rivals))
                for winner in results[name].winners:
                    rivals[winner.key] = min(rivals.get(winner.key, math.inf), winner.evidence["median_ms"])
    except JournalError as exc:
        raise DmattnError(str(exc)) from None
    result = results[backends[0]] if len(backends) == 1 else combine_backends(results)
    entries = [Entry(w.key, w.backend, w.config, w.evidence) for w in result.winners
               if not stale_only or w.key in stale_keys]  # a stale key's workload tunes its other direction too
    table = new_table(entries, fingerprint, interpreter=not on_gpu, suite=suite)
    if kept is not None:
        table = merged(kept, table)
    dump_table(table, out)
    try:
        # after the table is written: a run stopped before this point stays resumable, and one
        # its budget cut short stays so too (the record counts what it left unmeasured)
        mark_finished(trials_path, out, len(entries), unmeasured=result.counts().get("skipped", 0))
    except JournalError as exc:
        raise DmattnError(str(exc)) from None
    # interpreter timings rank candidates for the pipeline's sake only: no speed figure is drawn from them
    speedup = geometric_mean_speedup(result) if result.meaningful_timings else None
    regret = current_choice_regret(result)
    cores = usable_cores()
    document = {"table": str(out), "trials_file": str(trials_path), "wall_s": round(result.wall_s, 1),
                "phases_s": result.phases, "phase_pools": result.pools,
                "phase_bounds": result.phase_bounds(cores, gpu_count), "gpus": gpu_count,
                "replayed_trials": replayed, "counts": result.counts(), "funnel": result.funnel(),
                "entries": len(entries), "geomean_speedup_vs_default": speedup,
                "current_choice_regret": regret,
                "timings_meaningful": result.meaningful_timings,
                "search": "exhaustive" if exhaustive else "ranked",
                "search_regret_estimate": result.search_regret or None,
                "timing_spread": result.timing_spread() if result.meaningful_timings else None,
                "winners": [dict(key=w.key.to_dict(), backend=w.backend, config=w.config.to_dict(), evidence=w.evidence,
                                 search=result.search_of(w))
                            for w in result.winners]}
    output.render(document, [_winners_table(result), _counts_table(result), _phases_table(result, cores, gpu_count)], fmt)
    merged_note = f", {len(table.entries)} with those of {merge_path}" if kept is not None else ""
    output.info(f"wrote {out} ({len(entries)} entries{merged_note})" + (
        "" if not result.meaningful_timings else "; geometric-mean speed-up over the defaults: "
        + (f"{speedup:.3f}x" if speedup else "n/a")))
    for name, estimate in result.search_regret.items():
        if estimate["groups"] or estimate["unknown"]:
            output.info(f"{name}: the ranking left candidates out on {estimate['groups'] + estimate['unknown']} "
                        "workload directions; the model puts what that may cost at "
                        + (f"{estimate['geomean']:.3f}x in geometric mean, {estimate['worst']:.3f}x at worst"
                           if estimate["groups"] else "nothing it can say")
                        + (f" ({estimate['unknown']} without a prediction)" if estimate["unknown"] else "")
                        + "; --exhaustive --resume times the rest")
    noise = noisy_timings(document["timing_spread"])
    if noise:
        output.warn(noise)
    if regret["geomean"] is not None and result.meaningful_timings:
        output.info(f"before this tune, calls of these keys ran {regret['geomean']:.3f}x the tuned time in geometric "
                    f"mean ({regret['worst']:.3f}x at worst, {regret['keys']} keys"
                    + (f"; {regret['not_timed']} keys' choices were not timed" if regret["not_timed"] else "") + ")")
    if not entries:
        raise DmattnError(f"no candidate passed on any workload: {out} has no entries",
                          f"read the trial statuses above (kept in {trials_path})")
    _how_to_use(out, sorted({entry.key.dtype for entry in entries}))
