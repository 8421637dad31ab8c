"""`dmattn-bench bench`: the dispatch-selected kernel against its peers on the peer workloads, and
the renderings of its report (rich table, markdown, PNG), from a run or a saved JSON report."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import shlex
import signal
import sys
from pathlib import Path

import click
import torch
from rich.table import Table

from dmattn_bench import output
from dmattn_bench.bench.harness import (COPY_BYTES, DIRECTIONS, BenchInterrupted, Row, copy_rate, eager_loop,
                                        failed_rows_of_ours, load_peer_workloads, run_bench, standing,
                                        timed_directions)
from dmattn_bench.bench.peers import (DECODE_PEERS, DEFAULT_PEERS, OURS, PACKED_PEERS, PEER_GROUPS, PEERS,
                                      STRUCTURED_ONLY, parse_peers)
from dmattn_bench.cli.checks import reject_bf16_without_gpu
from dmattn_bench.errors import DmattnError
from dmattn_bench.hardware import device_peaks, software_versions
from dmattn_bench.space import CONFIGS_DIR

DEFAULT_WORKLOADS = CONFIGS_DIR / "workloads" / "peers.yaml"
CPU_WORKLOADS = DEFAULT_WORKLOADS.with_name("peers-cpu.yaml")  # the same workloads at interpreter size

# -- rendering a report ---------------------------------------------------------------------------

COLUMNS = ("workload", "direction", "peer", "status", "gpu ms", "spread", "host ms", "wall ms", "TFLOP/s",
           "floor ms", "of floor", "K/V BW", "ours/peer gpu", "ours/peer wall", "max|diff|", "err/bound", "setup ms")


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _percent(fraction: float | None, spec: str = ".0f") -> str:
    return "-" if fraction is None else format(100 * fraction, spec) + "%"


def row_cells(row: Row) -> list[str]:
    """One cell per `COLUMNS` entry."""
    status = row.status if row.status == "ok" else f"error: {row.error}"
    return [row.workload, row.direction, row.peer, status, _fmt(row.median_ms, ".3f"), _percent(row.spread, ".1f"),
            _fmt(row.host_ms, ".3f"), _fmt(row.wall_ms, ".3f"), _fmt(row.tflops, ".1f"), _fmt(row.floor_ms, ".3f"),
            _percent(row.floor_fraction), _percent(row.kv_bandwidth_fraction), _fmt(row.ours_over_peer_gpu, ".2f"),
            _fmt(row.ours_over_peer_wall, ".2f"), _fmt(row.max_abs_diff_vs_ours, ".2e"),
            _fmt(row.error_over_bound, ".3f"), _fmt(row.setup_ms, ".0f")]


def _table(document: dict) -> Table:
    table = Table(title=f"bench on {document['device']}")
    for column in COLUMNS:
        table.add_column(column, justify="left" if column in ("workload", "direction", "peer", "status") else "right")
    for data in document["rows"]:
        style = "bold" if data["peer"] == OURS else None
        table.add_row(*row_cells(Row.from_dict(data)), style=style)
    table.caption = ("gpu ms: GPU time, host hidden; host ms: enqueue one call; wall ms: per call of an eager loop; "
                     "ours/peer < 1: ours is faster; of floor: max(compute, memory) floor / gpu ms; K/V BW: a decode "
                     "step's K/V bytes / gpu ms / a device copy's rate; err/bound: our forward against the reference")
    return table


def _copy_text(document: dict) -> str:
    rate = document.get("copy_bytes_per_s")
    measured = ("not measured in this run" if rate is None else
                f"{rate / 1e12:.2f} TB/s, read and write counted, for a {COPY_BYTES >> 30} GiB device-to-device copy "
                "in the same run")
    return ("K/V BW (decode steps, forward only, no gradient): the K/V bytes a step must read (each sequence's "
            f"filled keys; every key with no length given) over its gpu ms, as a fraction of the copy rate ({measured}). ")


def _standing_lines(by_peer: dict) -> list[str]:
    """The report's `standing` as lines: per peer and direction the geometric means and the
    workloads where ours is slower."""
    lines = ["", "Against each peer (geometric mean of ours/peer over the workloads both ran; < 1: ours is faster):", ""]
    for peer, directions in sorted(by_peer.items()):
        for direction, figures in directions.items():
            wall = figures["geomean_wall"]
            slower = ", ".join(f"{name} ({ratio:.2f}x)" for name, ratio in figures["losing"]) or "none"
            lines.append(f"- {peer} {direction}: {figures['geomean_gpu']:.2f}x gpu"
                         + (f", {wall:.2f}x wall" if wall is not None else "")
                         + f" over {figures['workloads']} workloads; ours slower on: {slower}")
    return lines if len(lines) > 3 else []


def with_standing(document: dict) -> dict:
    """The report with its `standing` (`harness.standing` of its rows), as JSON and YAML give it
    (the markdown report computes the same lines from the rows)."""
    return {**document, "standing": standing([Row.from_dict(data) for data in document["rows"]])}


def markdown(document: dict) -> str:
    """The report as a markdown document (header, one table, per-peer notes)."""
    lines = [f"# dmattn-bench bench on {document['device']}", "",
             f"Command: `{document['command']}`", ""]
    if document.get("timings_meaningful") is False:
        lines += ["**Timings are not meaningful**: the Triton interpreter ran our kernel on the CPU.", ""]
    if document.get("interrupted"):
        lines += [f"**Interrupted**: {document['interrupted']}; the rows below are those that finished.", ""]
    loop = document.get("eager_loop")
    wall = ("not measured in this report" if loop is None else
            f"{loop['calls']} back-to-back calls, no spin, no flush, one sync at the end; median of {loop['loops']} "
            + ("loop" if loop["loops"] == 1 else "loops"))
    lines += [f"Software: {', '.join(f'{k} {v}' for k, v in document['software'].items())}. "
              f"gpu ms = median of {document['repeats']} repeats of GPU time, L2 flushed before each and the host's "
              "launch work hidden behind a GPU spin (what a CUDA-graph user sees); spread = (p80 - p20) / median; "
              "host ms = the host's own time to enqueue one call (median, no sync; '-' in reports from before it "
              f"was measured); wall ms = eager wall time per call ({wall}). "
              "TFLOP/s over the causal pairs (packed and window workloads: the pairs their documents, window "
              "and mask keep; fwd 2 GEMMs, bwd 5) in gpu ms. Floor = max(FLOPs / tensor peak, "
              "needed bytes / HBM bandwidth) with "
              f"{document['peaks'] or 'no known peaks for this device'}. " + _copy_text(document) +
              "ours/peer gpu and ours/peer wall: our gpu ms and wall ms over the peer's; < 1: ours is faster. "
              "err/bound: our forward's worst |out - reference| over its DESIGN §2 bound, checked before it is "
              "timed (over 1, or not finite, fails the row; '-' in reports from before the check).", ""]
    lines.append("| " + " | ".join(c.replace("|", "\\|") for c in COLUMNS) + " |")  # max|diff| is one cell
    lines.append("|" + "---|" * len(COLUMNS))
    for data in document["rows"]:
        lines.append("| " + " | ".join(c.replace("|", "/") for c in row_cells(Row.from_dict(data))) + " |")
    lines += _standing_lines(standing([Row.from_dict(data) for data in document["rows"]]))
    lines += ["", "Workloads:", ""] + [f"- {text}" for text in document["workloads"]]
    notes = {(r["peer"], r["note"]) for r in document["rows"] if r["note"]}
    lines += ["", "Peer notes:", ""] + [f"- {peer}: {note}" for peer, note in sorted(notes)]
    return "\n".join(lines) + "\n"


# The plot's panel rows: what each bar is, and its axis label
PLOT_TIMES = (("median_ms", "gpu ms (log)"), ("wall_ms", "eager wall ms per call (log)"))
PLOT_INCHES_PER_BAR = 0.15  # a panel widens past 7 inches with its bars (a decode report has about 160)
PLOT_UPRIGHT_LABELS = 6  # more workloads than this get their names turned on end


def plot(document: dict, path: str | Path) -> None:
    """Bar charts (log scale) of the GPU medians and, below, the eager wall times per call: one
    panel per direction the report has, one group per workload measured in it; a failed row is
    marked "failed" where its bar would be. A report from before the wall time has the GPU panels
    only.

    Raises:
        ModuleNotFoundError: matplotlib is missing (the `plot` extra).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = document["rows"]
    peers = list(dict.fromkeys(r["peer"] for r in rows))
    directions = [d for d in DIRECTIONS if any(r["direction"] == d for r in rows)] or list(DIRECTIONS[:1])
    workloads = {d: list(dict.fromkeys(r["workload"] for r in rows if r["direction"] == d)) for d in directions}
    times = [(key, label) for key, label in PLOT_TIMES if any(r.get(key) is not None for r in rows)] or PLOT_TIMES[:1]
    panel_width = max(7.0, PLOT_INCHES_PER_BAR * len(peers) * max(len(names) for names in workloads.values()))
    figure, axes = plt.subplots(len(times), len(directions), figsize=(panel_width * len(directions), 4.5 * len(times)),
                                squeeze=False)
    width = 0.8 / max(1, len(peers))
    for panels, (key, label) in zip(axes, times):
        for axis, direction in zip(panels, directions):
            names = workloads[direction]
            for index, peer in enumerate(peers):
                positions = [i + index * width for i in range(len(names))]
                values = []
                for position, workload in zip(positions, names):
                    match = [r for r in rows if (r["workload"], r["peer"], r["direction"]) == (workload, peer, direction)]
                    ok = bool(match) and match[0]["status"] == "ok"
                    value = match[0].get(key) if ok else None
                    values.append(float("nan") if value is None else value)
                    if match and not ok:
                        axis.annotate("failed", (position, 0.02), xycoords=("data", "axes fraction"),
                                      rotation=90, ha="center", fontsize="x-small")
                axis.bar(positions, values, width, label=peer)
            axis.set_xticks([i + width * (len(peers) - 1) / 2 for i in range(len(names))], names,
                            rotation=90 if len(names) > PLOT_UPRIGHT_LABELS else 0, fontsize="small")
            axis.set_yscale("log")
            axis.set_ylabel(label)
            axis.set_title(f"{direction} on {document['device']}")
    axes[0][0].legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


class BenchStopped(DmattnError):
    """The bench was interrupted; its report of the rows that finished was printed."""

    exit_code = 130


@contextlib.contextmanager
def _sigterm_as_interrupt():
    """SIGTERM (a `timeout`, a job scheduler) stops the bench as Ctrl-C does, so its finished rows are
    reported; the previous handler is restored after."""
    def interrupt(signum, frame):
        raise KeyboardInterrupt
    try:
        previous = signal.signal(signal.SIGTERM, interrupt)
    except ValueError:  # not the main thread: leave SIGTERM alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


# -- saved reports ---------------------------------------------------------------------------------


def _saved_report(path: str) -> dict:
    """A `bench --format json` report read back; BadParameter naming the file when it is none."""
    try:
        document = json.loads(Path(path).read_text())
        if not (isinstance(document, dict) and {"device", "rows"} <= set(document)
                and isinstance(document["rows"], list)):
            raise ValueError("no `device` and `rows` list")
        for data in document["rows"]:
            Row.from_dict(data)
    except ValueError as exc:  # json.JSONDecodeError is one
        raise click.BadParameter(f"{path}: not a `bench --format json` report ({exc})",
                                 param_hint="--from-json") from None
    return document


def merged_reports(documents: list[dict], paths: tuple[str, ...]) -> dict:
    """Reports of one device as one: the first's settings, every report's commands, workloads and
    rows in order. A long bench split into runs (`--only`) keeps each run's rows when a later one
    fails; reports of different devices, software or timing settings do not mix."""
    first = documents[0]
    for document, path in zip(documents[1:], paths[1:]):
        for field in ("device", "software", "repeats", "eager_loop", "timings_meaningful"):
            if document.get(field) != first.get(field):
                raise click.BadParameter(f"{path}: its {field} {document.get(field)!r} differs from {paths[0]}'s "
                                         f"{first.get(field)!r}", param_hint="--from-json")
    if len(documents) == 1:
        return first
    return {**first, "command": "; ".join(str(d.get("command")) for d in documents),
            "workloads": [w for d in documents for w in d.get("workloads", [])],
            "rows": [row for d in documents for row in d["rows"]]}


# -- the command ----------------------------------------------------------------------------------

MEASURING_OPTIONS = ("table_path", "workloads_path", "only", "directions", "peer_names", "dtype", "repeats")


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
    if importlib.util.find_spec("matplotlib") is None:
        raise DmattnError("--plot needs matplotlib", "pip install 'dmattn-bench[plot]'")


@click.command("bench")
@click.option("--table", "table_path", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Dispatch table for our kernel. Default: the usual lookup (DMATTN_BENCH_TABLE, shipped table, defaults).")
@click.option("--workloads", "workloads_path", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Peer workloads YAML. Default: configs/workloads/peers.yaml on a GPU, "
                   "configs/workloads/peers-cpu.yaml (interpreter-sized) without one. Decode steps: "
                   "configs/workloads/peers-decode.yaml (peers-decode-cpu.yaml in the interpreter). Packed "
                   "documents and sliding windows: configs/workloads/packed.yaml (packed-cpu.yaml).")
@click.option("--only", multiple=True, help="Run only workloads whose name starts with this (repeatable), e.g. --only W3.")
@click.option("--direction", "directions", multiple=True, type=click.Choice(DIRECTIONS),
              help="Time only this direction (repeatable). Default: fwd and fwd+bwd (decode steps: fwd).")
@click.option("--peers", "peer_names", default=None,
              help=f"Comma-separated peers besides ours, from: {', '.join([*PEERS, *STRUCTURED_ONLY])}; groups: "
                   + ", ".join(f"{group} = {'+'.join(members)}" for group, members in PEER_GROUPS.items())
                   + f". Default: {','.join(DEFAULT_PEERS)}; on decode workloads alone {','.join(DECODE_PEERS)}; "
                   f"on packed and window workloads alone {','.join(PACKED_PEERS)}.")
@click.option("--dtype", type=click.Choice(["bf16", "fp16", "fp32"]), default=None,
              help="Override every workload's dtype (fp32/fp16 in the CPU interpreter).")
@click.option("--repeats", type=click.IntRange(3, 1000), default=20, show_default=True, help="Timed repeats per row.")
@click.option("--format", "fmt", type=click.Choice([*output.FORMATS, "markdown"]), default="human", show_default=True,
              help="Result format on stdout.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None,
              help="Also write a PNG bar chart here (needs the `plot` extra: matplotlib).")
@click.option("--from-json", "from_json", type=click.Path(exists=True, dir_okay=False), multiple=True,
              help="Render a saved `--format json` report instead of measuring (e.g. to plot it elsewhere); "
                   "repeated, the reports of one device as one (runs split by --only).")
def bench(table_path, workloads_path, only, directions, peer_names, dtype, repeats, fmt, plot_path, from_json) -> None:
    """Time our kernel and its peers on the peer workloads: forward and forward+backward of the
    prefill ones, the forward of the decode steps."""
    _check_plot_available(plot_path)
    failed: list[Row] = []  # of our own rows; a rendered report measured nothing, so none
    if from_json:
        _check_nothing_to_measure_given()
        document = merged_reports([_saved_report(path) for path in from_json], from_json)
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
            workloads = load_peer_workloads(workloads_path, dtype, list(only))
            decoding = [w.decode is not None for w in workloads]
            default = (DECODE_PEERS if all(decoding) else PACKED_PEERS if all(w.layout is not None for w in workloads)
                       else DEFAULT_PEERS)
            peers = parse_peers(peer_names if peer_names is not None else ",".join(default))
        except ValueError as exc:
            raise click.BadParameter(str(exc)) from None
        reject_bf16_without_gpu({w.workload.dtype for w in workloads}, has_gpu, param_hint="--workloads")
        directions = tuple(directions) or DIRECTIONS
        untimed = [w.name for w in workloads if not timed_directions(w, directions)]
        if untimed:
            raise click.BadParameter(f"decode steps time the forward alone ({', '.join(untimed)}): add --direction "
                                     "fwd, or leave them out with --only", param_hint="--direction")
        # off a GPU no time is meaningful, and a copy of the host's memory would rank nothing
        rate = copy_rate(device) if has_gpu and any(decoding) else None
        if rate is not None:
            output.info(f"device copy: {rate / 1e12:.2f} TB/s")
        interrupted = None
        try:
            with _sigterm_as_interrupt():
                rows = run_bench(workloads, peers, device, table=table_path, repeats=repeats, copy_bytes_per_s=rate,
                                 directions=directions)
        except BenchInterrupted as stop:  # the rows that finished are reported, not lost
            rows, interrupted = stop.rows, str(stop)
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
            "copy_bytes_per_s": rate,
            "timings_meaningful": has_gpu,  # the interpreter's times rank nothing
            "workloads": [w.describe() for w in workloads],
            "rows": [row.to_dict() for row in rows],
        }
        if interrupted:
            document["interrupted"] = interrupted
    document = with_standing(document)
    if fmt == "markdown":
        output.write_text(markdown(document))
    else:
        output.render(document, [_table(document)], fmt)
    if plot_path is not None:
        plot(document, plot_path)
        output.info(f"plot written to {plot_path}")
    if document.get("interrupted") and not from_json:
        raise BenchStopped(f"bench {document['interrupted']}", "the report above holds those rows; "
                           "`--only` runs the rest, `--from-json A --from-json B` renders the runs as one")
    if failed:
        # the report is printed, failed rows and all: exit 1 says the run failed at its one job
        raise DmattnError(f"our kernel (peer dmattn) failed on {len(failed)} row(s): "
                          + ", ".join(f"{r.workload} {r.direction}" for r in failed),
                          "each row's error is in the report's status")
