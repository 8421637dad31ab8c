"""`dmattn-bench bench`: the dispatch-selected kernel against its peers on the peer workloads."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import click
import torch
from rich.table import Table

from dmattn_bench import output
from dmattn_bench.bench import (COLUMNS, Row, eager_loop, failed_rows_of_ours, load_peer_workloads, markdown, plot,
                                row_cells, run_bench)
from dmattn_bench.cli.checks import reject_bf16_without_gpu
from dmattn_bench.errors import DmattnError
from dmattn_bench.hardware import device_peaks, software_versions
from dmattn_bench.peers import DEFAULT_PEERS, PEER_GROUPS, PEERS, parse_peers
from dmattn_bench.space import CONFIGS_DIR

DEFAULT_WORKLOADS = CONFIGS_DIR / "workloads" / "peers.yaml"
CPU_WORKLOADS = DEFAULT_WORKLOADS.with_name("peers-cpu.yaml")  # the same workloads at interpreter size


def _table(document: dict) -> Table:
    table = Table(title=f"bench on {document['device']}")
    for column in COLUMNS:
        table.add_column(column, justify="left" if column in ("workload", "direction", "peer", "status") else "right")
    for data in document["rows"]:
        style = "bold" if data["peer"] == "dmattn" else None
        table.add_row(*row_cells(Row.from_dict(data)), style=style)
    table.caption = ("gpu ms: GPU time, host hidden; host ms: enqueue one call; wall ms: per call of an eager loop; "
                     "ours/peer < 1: ours is faster; of floor: max(compute, memory) floor / gpu ms")
    return table


MEASURING_OPTIONS = ("table_path", "workloads_path", "only", "peer_names", "dtype", "repeats")


def _check_nothing_to_measure_given() -> None:
    """--from-json renders a saved report: an option that shapes a measurement would be ignored."""
    context = click.get_current_context()
    given = [param.opts[0] for param in context.command.params if param.name in MEASURING_OPTIONS
             and context.get_parameter_source(param.name) is not click.core.ParameterSource.DEFAULT]
    if given:
        raise click.BadParameter(f"renders a saved report and measures nothing: drop {', '.join(given)}",
                                 param_hint="--from-json")


def _check_plot_available(plot_path: str | None) -> None:
    if plot_path is None:
        return
    if not Path(plot_path).resolve().parent.is_dir():
        raise click.BadParameter(f"{plot_path}: its folder does not exist", param_hint="--plot")
    try:
        import matplotlib  # noqa: F401
    except ModuleNotFoundError:
        raise DmattnError("--plot needs matplotlib", "pip install 'dmattn-bench[plot]'") from None


@click.command("bench")
@click.option("--table", "table_path", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Dispatch table for our kernel. Default: the usual lookup (DMATTN_BENCH_TABLE, shipped table, defaults).")
@click.option("--workloads", "workloads_path", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Peer workloads YAML. Default: configs/workloads/peers.yaml on a GPU, "
                   "configs/workloads/peers-cpu.yaml (interpreter-sized) without one.")
@click.option("--only", multiple=True, help="Run only workloads whose name starts with this (repeatable), e.g. --only W3.")
@click.option("--peers", "peer_names", default=",".join(DEFAULT_PEERS), show_default=True,
              help=f"Comma-separated peers besides ours, from: {', '.join(PEERS)}; groups: "
                   + ", ".join(f"{group} = {'+'.join(members)}" for group, members in PEER_GROUPS.items()) + ".")
@click.option("--dtype", type=click.Choice(["bf16", "fp16", "fp32"]), default=None,
              help="Override every workload's dtype (fp32/fp16 in the CPU interpreter).")
@click.option("--repeats", type=click.IntRange(3, 1000), default=20, show_default=True, help="Timed repeats per row.")
@click.option("--format", "fmt", type=click.Choice([*output.FORMATS, "markdown"]), default="human", show_default=True,
              help="Result format on stdout.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None,
              help="Also write a PNG bar chart here (needs the `plot` extra: matplotlib).")
@click.option("--from-json", "from_json", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Render a saved `--format json` report instead of measuring (e.g. to plot it elsewhere).")
def bench(table_path, workloads_path, only, peer_names, dtype, repeats, fmt, plot_path, from_json) -> None:
    """Time our kernel and its peers (forward, forward+backward) on the peer workloads."""
    _check_plot_available(plot_path)
    failed: list[Row] = []  # of our own rows; a rendered report measured nothing, so none
    if from_json is not None:
        _check_nothing_to_measure_given()
        try:
            document = json.loads(Path(from_json).read_text())
            if not (isinstance(document, dict) and {"device", "rows"} <= set(document)
                    and isinstance(document["rows"], list)):
                raise ValueError("no `device` and `rows` list")
            for data in document["rows"]:
                Row.from_dict(data)
        except ValueError as exc:  # json.JSONDecodeError is one
            raise click.BadParameter(f"{from_json}: not a `bench --format json` report ({exc})",
                                     param_hint="--from-json") from None
    else:
        has_gpu = torch.cuda.is_available()
        device = "cuda" if has_gpu else "cpu"
        reject_bf16_without_gpu([dtype] if dtype else [], has_gpu)
        if not has_gpu:
            output.info("no CUDA GPU: our kernel runs in the Triton interpreter (TRITON_INTERPRET=1) on "
                        + ("interpreter-sized W1-W3 (configs/workloads/peers-cpu.yaml)" if workloads_path is None
                           else workloads_path) + "; timings are not meaningful")
        workloads_path = workloads_path or str(DEFAULT_WORKLOADS if has_gpu else CPU_WORKLOADS)
        try:
            peers = parse_peers(peer_names)
            workloads = load_peer_workloads(workloads_path, dtype, list(only))
        except ValueError as exc:
            raise click.BadParameter(str(exc)) from None
        reject_bf16_without_gpu({w.workload.dtype for w in workloads}, has_gpu, param_hint="--workloads")
        rows = run_bench(workloads, peers, device, table=table_path, repeats=repeats)
        failed = failed_rows_of_ours(rows)
        calls, loops = eager_loop(device)
        peaks = device_peaks(device)
        document = {
            "command": "dmattn-bench " + shlex.join(sys.argv[1:]) if sys.argv[1:2] == ["bench"] else "dmattn-bench bench",
            "device": torch.cuda.get_device_name() if has_gpu else "cpu (interpreter)",
            "software": software_versions(),
            "peaks": None if peaks is None else str(peaks),
            "repeats": repeats,
            "eager_loop": {"calls": calls, "loops": loops},
            "timings_meaningful": has_gpu,  # the interpreter's times rank nothing
            "workloads": [w.describe() for w in workloads],
            "rows": [row.to_dict() for row in rows],
        }
    if fmt == "markdown":
        output.write_text(markdown(document))
    else:
        output.render(document, [_table(document)], fmt)
    if plot_path is not None:
        plot(document, plot_path)
        output.info(f"plot written to {plot_path}")
    if failed:
        # the report is printed, failed rows and all: exit 1 says the run failed at its one job
        raise DmattnError(f"our kernel (peer dmattn) failed on {len(failed)} row(s): "
                          + ", ".join(f"{r.workload} {r.direction}" for r in failed),
                          "each row's error is in the report's status")
