"""`dmattn-bench verify`: the adversarial suite for every config the dispatch can choose."""

from __future__ import annotations

import click
import torch
from rich.table import Table

from dmattn_bench import output
from dmattn_bench.cli.checks import reject_bf16_without_gpu
from dmattn_bench.dispatch import TableError, load_table
from dmattn_bench.dispatch.lookup import ENV_VAR
from dmattn_bench.dispatch.stamps import entry_status, stamp_of
from dmattn_bench.errors import NoGpuError, ValidationFailed
from dmattn_bench.errors import DmattnError
from dmattn_bench.hardware import device_fingerprint
from dmattn_bench.space import DTYPES, InvalidConfig, config_label
from dmattn_bench.tuning import ledger
from dmattn_bench.tuning.plan_runner import run_plan
from dmattn_bench.tuning.table_writer import declare_stale
from dmattn_bench.tuning.table_writer import restamp as restamp_table
from dmattn_bench.tuning.validator import (CHECKED, CaseResult, SuiteResult, plan_decode, plan_default_configs,
                                           plan_table_entries)



def _summary_table(results: list[tuple[str, SuiteResult]], dtype: str, device: str) -> Table:
    table = Table(title=f"verify: {dtype} on {device}")
    for column in ("configs", "backend", "fwd config", "bwd config", "cases ok", "status", *CHECKED):
        table.add_column(column, justify="right" if column in CHECKED else "left")
    for label, result in results:
        ok = sum(c.status == "ok" for c in result.cases)
        worst = result.worst_ratios()
        status = result.status
        style = "green" if status == "ok" else "red"
        table.add_row(
            label, result.backend,
            config_label(result.fwd_config), config_label(result.bwd_config),
            f"{ok}/{len(result.cases)}", f"[{style}]{status}[/{style}]",
            *(f"{worst[name]:.3f}" if name in worst else "-" for name in CHECKED),
        )
    table.caption = ("tensor columns: worst error / bound over all cases (must be <= 1); "
                     "packed/window: the packed-sequence and sliding-window suite, for entries of such keys")
    return table


def _failure_table(results: list[tuple[str, SuiteResult]]) -> Table | None:
    rows = [(label, c) for label, r in results for c in r.cases if c.status != "ok"]
    if not rows:
        return None
    table = Table(title="failures")
    for column in ("configs", "case", "status", "reason"):
        table.add_column(column)
    for label, case in rows:
        table.add_row(label, case.case, case.status, case.reason)
    return table


def _plan(table_path: str | None, dtype: str, device: str, suite: str, backend: str | None, only_stale: bool = False):
    """The table's entries of `dtype` and `backend` (or that backend's defaults when no table is
    given or set); with `only_stale`, those that are not current (`stamps.entry_status`).

    Returns:
        (source, plan, table, verified): the table (None for the defaults) and its entries the
        plan verifies.
    """
    import os

    table_path = table_path or os.environ.get(ENV_VAR)
    if table_path is None:
        backend = backend or "triton"
        output.info(f"no table given (--table or DMATTN_BENCH_TABLE): verifying the {backend} default configs")
        plan = plan_default_configs(device, suite, backend, dtype) + _decode(backend, device, suite)
        return "defaults", plan, None, [], []
    try:
        table = load_table(table_path)
    except TableError as exc:
        fix = ("fix the field or re-create the table with `dmattn-bench tune`" if os.path.exists(table_path)
               else f"check the path (from --table or {ENV_VAR})")
        raise DmattnError(str(exc), fix) from None
    entries = [e for e in table.entries if (backend is None or e.backend == backend) and e.key.dtype == dtype]
    not_current = [e for e in entries if entry_status(e, table.device) != "current"]
    if only_stale:
        output.info(f"{table_path}: {len(not_current)} of its {len(entries)} {dtype} entries are stale or "
                    f"unvalidated: verifying those")
        entries = not_current
        if not entries:
            return str(table_path), [], table, [], []
    elif not_current:
        output.warn(f"{table_path}: {len(not_current)} of its {dtype} entries are stale or unvalidated (the runtime "
                    f"skips them); verifying them with the rest (`--suite full --restamp` re-validates those alone)")
    rejected = [_rejected(entry) for entry in entries if isinstance(entry.config, InvalidConfig)]
    entries = [entry for entry in entries if not isinstance(entry.config, InvalidConfig)]
    plan = plan_table_entries(entries, dtype, device, suite)
    if plan and not only_stale:
        plan += _decode(backend, device, suite)
    if not plan and not rejected:
        which = f"{dtype} {backend}" if backend else dtype
        raise DmattnError(f"{table_path}: no {which} entries to verify",
                          f"pass a --dtype and --backend the table has "
                          f"({sorted({(e.key.dtype, e.backend) for e in table.entries})})")
    return str(table_path), plan, table, entries, rejected


def _rejected(entry) -> tuple[str, SuiteResult]:
    """A (label, result) row failing an entry whose config no kernel can run (`InvalidConfig`)."""
    key = entry.key
    label = (f"{entry.backend} {key.direction} entry D{key.head_dim} Lq{key.seqlen_q_bucket} "
             f"Lk{key.seqlen_k_bucket}{key.label()}")
    configs = (entry.config, None) if key.direction != "bwd" else (None, entry.config)
    failed = CaseResult("config", "invalid", entry.config.problem)
    return label, SuiteResult(entry.backend, *configs, key.dtype, [failed])


def _decode(backend: str | None, device: str, suite: str) -> list:
    """The short-query forward's default configs' suites (what its calls run where the table has no
    decode entry near their key); none when verifying another backend."""
    return plan_decode(device, suite) if backend in (None, "triton") else []


def _check_restamp(table_path: str | None, suite: str) -> None:
    if table_path is None:
        raise click.BadParameter("rewrites the table file it verifies: pass --table", param_hint="--restamp")
    if suite != "full":
        raise click.BadParameter("records a validation only on the full suite: pass --suite full",
                                 param_hint="--restamp")


def _restamp(table_path: str, stamped: dict, suite: str) -> dict:
    """Records the pass of each verified entry on its stamp; returns what was recorded."""
    try:
        restamp_table(table_path, stamped, suite)
    except TableError as exc:
        raise DmattnError(str(exc), "nothing was recorded") from None
    except OSError as exc:
        raise DmattnError(f"{table_path}: cannot rewrite: {exc.strerror or exc}", "nothing was recorded") from None
    output.info(f"restamped {table_path}: {len(stamped)} entries validated on their code ({suite} suite)")
    return {"restamped": len(stamped), "suite": suite}


def _declare_stale(table_path: str, reason: str, fmt: str) -> None:
    """`--declare-stale`: marks the entries whose code changed, without running anything."""
    try:
        table, changed = declare_stale(table_path, reason)
    except TableError as exc:
        raise DmattnError(str(exc), "nothing was recorded") from None
    except OSError as exc:
        raise DmattnError(f"{table_path}: cannot rewrite: {exc.strerror or exc}", "nothing was recorded") from None
    declared = sum(e.stale is not None for e in table.entries)
    output.info(f"{table_path}: {changed} entries newly declared stale, {declared} of {len(table.entries)} in all")
    output.render({"table": table_path, "newly_stale": changed, "stale": declared, "entries": len(table.entries)},
                  [], fmt)


@click.command()
@click.option("--table", "table_path", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Dispatch table whose entries to verify. Default: $DMATTN_BENCH_TABLE, else the default configs.")
@click.option("--dtype", type=click.Choice(sorted(DTYPES)), default=None,
              help="Kernel dtype. Default: bf16 on a GPU, fp32 in the CPU interpreter.")
@click.option("--backend", type=click.Choice(["triton", "cuda", "reference"]), default=None,
              help="Kernel backend to verify: a table's entries of that backend, or its default configs. "
                   "Default: every entry of the table, else the triton defaults.")
@click.option("--suite", type=click.Choice(["quick", "full"]), default=None,
              help="Adversarial suite. Default: full on a GPU, quick (interpreter sized) on the CPU.")
@click.option("--restamp", is_flag=True, default=False,
              help="Verify only the --table file's entries of this dtype (and --backend) that are stale or "
                   "unvalidated, and when all pass record each as validated on the code installed here. Needs "
                   "--suite full and this table's device.")
@click.option("--declare-stale", "stale_reason", default=None, metavar="REASON",
              help="Run nothing: declare stale, with REASON, the --table file's entries whose code changed since "
                   "their validation (for a change that lands while their GPU is not at hand). No GPU needed.")
@click.option("--no-ledger", is_flag=True, default=False,
              help="Run every adversarial case. Default: a case that passed before on this GPU on the same code (its programs' sources, the host code, the software) answers from the case ledger in the cache directory (dmattn_bench.tuning.ledger).")
@click.option("--format", "fmt", type=click.Choice(output.FORMATS), default="human", show_default=True,
              help="Result format on stdout.")
def verify(table_path: str | None, dtype: str | None, backend: str | None, suite: str | None, restamp: bool,
           stale_reason: str | None, no_ledger: bool, fmt: str) -> None:
    """Validate every entry of a table (or the default configs) with the adversarial suite.

    With --restamp, only the entries that are stale or unvalidated run, and when they all pass
    each is recorded as validated on the code it runs here (its stamp). Exits 3 when any case
    fails (and restamps nothing).
    """
    if stale_reason is not None:
        if table_path is None or restamp:
            raise click.BadParameter("needs --table and no --restamp", param_hint="--declare-stale")
        _declare_stale(table_path, stale_reason, fmt)
        return
    has_gpu = torch.cuda.is_available()
    dtype = dtype or ("bf16" if has_gpu else "fp32")
    reject_bf16_without_gpu([dtype], has_gpu)
    if has_gpu and dtype == "fp32":
        raise click.BadParameter("fp32 runs only in the CPU interpreter; use bf16 or fp16 on a GPU",
                                 param_hint="--dtype")
    if backend == "cuda" and not has_gpu:
        raise NoGpuError("the cuda backend needs a CUDA GPU (its kernels run only there)",
                         "verify the triton backend here, or run on a GPU machine")
    device = "cuda" if has_gpu else "cpu"
    suite = suite or ("full" if has_gpu else "quick")
    if restamp:
        _check_restamp(table_path, suite)
    if not has_gpu:
        output.info("no CUDA GPU: running the Triton kernels through the interpreter "
                    f"(TRITON_INTERPRET=1) on the {suite} suite")
    source, plan, table, verified, rejected = _plan(table_path, dtype, device, suite, backend, only_stale=restamp)
    if restamp and not plan and not rejected:
        output.render({"dtype": dtype, "source": source, "restamp": {"restamped": 0, "suite": suite}}, [], fmt)
        return
    if restamp:
        local = device_fingerprint(device)
        if table.device != local:
            raise click.BadParameter(
                f"{table_path} is a table of {table.device.name} (sm{table.device.compute_capability}, "
                f"{table.device.sm_count} SMs), this is {local.name}: restamp it on its own device",
                param_hint="--restamp")
    # taken before the kernels run: the code that was verified, even if a file changes meanwhile
    stamped = {entry: stamp_of(entry, table.device) for entry in verified} if restamp else {}
    with (ledger.ledger_for_workers(None if no_ledger else ledger.default_path()),
          output.progress(f"verify {dtype}", total=sum(len(item.cases) for item in plan)) as advance):
        results = rejected + run_plan(DTYPES[dtype], device, plan, on_case=lambda r: advance(f"{r.case}: {r.status}"))
    answered = sum(case.replayed for _, result in results for case in result.cases)
    if answered:
        output.info(f"{answered} of {sum(len(result.cases) for _, result in results)} cases answered from the case "
                    "ledger: passed before on this GPU on the same code (--no-ledger runs them)")
    device_name = torch.cuda.get_device_name() if has_gpu else "cpu (interpreter)"
    tables = [_summary_table(results, dtype, device_name)]
    failures = _failure_table(results)
    if failures is not None:
        tables.append(failures)
    document = {"dtype": dtype, "device": device_name, "suite": suite, "source": source, "ledger_answered": answered,
                "entries": [dict(configs=label, **r.to_dict()) for label, r in results]}
    # strict: a default config that cannot run a case would fail that shape at run time
    failed = [label for label, r in results if r.status != "ok"]
    if restamp and not failed:
        document["restamp"] = _restamp(table_path, stamped, suite)
    elif restamp:
        output.warn(f"{table_path}: not restamped: some entries failed")
    output.render(document, tables, fmt)
    if failed:
        raise ValidationFailed(f"validation failed for {', '.join(failed)}")
