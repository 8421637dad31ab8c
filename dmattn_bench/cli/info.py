"""`dmattn-bench info`: the GPU, its limits, the backends available and the default configs."""

from __future__ import annotations

import os
import platform
import shutil
import warnings
from itertools import product
from pathlib import Path

import click
import torch
from rich.table import Table

from dmattn_bench import output
from dmattn_bench.hardware import untested_releases
from dmattn_bench.registry import BACKEND_NAMES, interpreter_enabled
from dmattn_bench.tiles import default_entries
from dmattn_bench.version import __version__


def _environment() -> dict:
    import triton

    doc = {
        "dmattn_bench": __version__, "python": platform.python_version(), "torch": torch.__version__,
        "triton": triton.__version__, "cuda_runtime": torch.version.cuda,
        "interpreter": interpreter_enabled(), "backends": _backend_status(),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        doc["gpu"] = {
            "name": props.name, "compute_capability": f"{props.major}.{props.minor}",
            "sm_count": props.multi_processor_count,
            "shared_memory_per_block_optin": getattr(props, "shared_memory_per_block_optin", None),
            "total_memory_gib": round(props.total_memory / 2**30, 1),
        }
    else:
        doc["gpu"] = None
    doc["active_table"], doc["active_table_note"] = _table_in_use("cuda" if doc["gpu"] else "cpu")
    # what a key with no table entry runs: on a GPU per dtype and bias kind (the learned defaults)
    device = "cuda" if doc["gpu"] else "cpu"
    doc["default_configs"] = [
        {"dtype": dtype, "bias": "with rows" if bias_rows else "without rows", "head_dims": f"{low}-{high}",
         "fwd": fwd.to_dict(), "bwd": bwd.to_dict()}
        for dtype, bias_rows in (product(("bf16", "fp16"), (False, True)) if doc["gpu"] else [(None, False)])
        for low, high, fwd, bwd in default_entries(device, "triton", dtype, bias_rows)
    ]
    return doc


def _table_in_use(device: str) -> tuple[str | None, str]:
    """The table a call on `device` would consult first, by the runtime's own lookup
    (`Dispatcher.active_table`), and a note: where that table comes from, or why there is none.

    A new Dispatcher stands for a fresh process (no `use_table`, no warning given yet), so the
    reasons a table is skipped are always there to report, however this process has used dispatch.
    """
    from dmattn_bench.dispatch import ENV_VAR, Dispatcher, DispatchWarning, lookup
    from dmattn_bench.hardware import device_fingerprint

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", DispatchWarning)
        path = Dispatcher().active_table(device)
    skipped = [str(w.message) for w in caught if issubclass(w.category, DispatchWarning)]
    for message in skipped:  # a foreign, invalid or (partly) stale table: as any call would warn
        output.warn(message)
    env = os.environ.get(ENV_VAR) or None
    fingerprint = device_fingerprint(device)
    shipped = Path(lookup.SHIPPED_TABLES_DIR) / f"{fingerprint.slug()}.yaml"
    if path is not None:
        counts = lookup.status_counts(lookup.load_table(path))
        skipped = [f"{n} {state}" for state, n in counts.items() if state != "current" and n]
        stale = f"; {', '.join(skipped)} entries are skipped" if skipped else ""
        return path, (f"from {ENV_VAR}" if path == env else f"shipped for {fingerprint.name}") + \
            f" ({counts['current']} current entries{stale})"
    # in the lookup's order: the variable's table, then the shipped one
    reasons = ([f"{ENV_VAR} is unset"] if env is None else []) + skipped
    if not shipped.exists():
        reasons.append(f"no table ships for {fingerprint.name} ({shipped} does not exist)")
    for candidate in (env, str(shipped) if shipped.exists() else None):
        if candidate is not None and not any(candidate in message for message in skipped):
            reasons.append(f"{candidate} has no entries a call could use")
    from dmattn_bench.cli.tune import default_table_path

    tuned_here = default_table_path(fingerprint)
    if tuned_here.is_file():
        reasons.append(f"the table tuned here is used once you export {ENV_VAR}={tuned_here.resolve()}")
    return None, "none, the default configs apply: " + "; ".join(reasons)


def _backend_status() -> dict[str, str]:
    """Each backend and whether it can run here (the cuda kernels need a GPU and nvcc)."""
    status = {name: "available" for name in BACKEND_NAMES}
    if not torch.cuda.is_available():
        status["triton"] = "interpreter (no GPU)"
        status["cuda"] = "unavailable: no CUDA GPU"
    elif shutil.which("nvcc") is None and not os.environ.get("CUDA_HOME"):
        status["cuda"] = "unavailable: nvcc not found (set CUDA_HOME or PATH)"
    return status


@click.command()
@click.option("--measure-dispatch", is_flag=True, default=False,
              help="Also measure the host time backend='auto' adds per call over a direct kernel launch (median of 2000, µs).")
@click.option("--format", "fmt", type=click.Choice(output.FORMATS), default="human", show_default=True,
              help="Result format on stdout.")
def info(measure_dispatch: bool, fmt: str) -> None:
    """Show the GPU, the software, the backends available, the active table and the defaults.

    The active table is the one an attention call on this machine would consult first (from
    DMATTN_BENCH_TABLE, else shipped for this device); when there is none, it says why.
    """
    doc = _environment()
    doc["untested_releases"] = untested_releases({"torch": doc["torch"], "triton": doc["triton"]})
    for line in doc["untested_releases"]:
        output.warn(line)
    if measure_dispatch:
        from dmattn_bench.ops import dispatch_overhead_us

        doc["dispatch_overhead_us"] = dispatch_overhead_us("cuda" if doc["gpu"] else "cpu")
    table = Table(title="dmattn-bench info", show_header=False)
    table.add_column("key")
    table.add_column("value")
    for key in ("dmattn_bench", "python", "torch", "triton", "cuda_runtime", "interpreter", "backends"):
        table.add_row(key, str(doc[key]))
    table.add_row("active_table", doc["active_table_note"] if doc["active_table"] is None
                  else f"{doc['active_table']} ({doc['active_table_note']})")
    gpu = doc["gpu"]
    table.add_row("gpu", "none (kernels run in the Triton interpreter)" if gpu is None else
                  ", ".join(f"{k}={v}" for k, v in gpu.items()))
    if "dispatch_overhead_us" in doc:
        table.add_row("dispatch overhead", f"{doc['dispatch_overhead_us']} µs per call to find its launch plan")
    for entry in doc["default_configs"]:
        scope = f" {entry['dtype']}, bias {entry['bias']}" if entry["dtype"] else ""
        table.add_row(f"default D {entry['head_dims']}{scope}", f"fwd {entry['fwd']}  bwd {entry['bwd']}")
    output.render(doc, [table], fmt)
