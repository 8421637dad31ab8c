"""`dmattn-bench info`: the GPU, its limits, the backends available and the default configs."""

from __future__ import annotations

import os
import platform
import shutil

import click
import torch
from rich.table import Table

from dmattn_bench import __version__, output
from dmattn_bench.registry import BACKEND_NAMES, default_entries, interpreter_enabled


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
    from dmattn_bench.dispatch import DISPATCHER

    doc["active_table"] = DISPATCHER.active_table("cuda" if doc["gpu"] else "cpu")
    doc["default_configs"] = [
        {"head_dims": f"{low}-{high}", "fwd": fwd.to_dict(), "bwd": bwd.to_dict()}
        for low, high, fwd, bwd in default_entries("cuda" if doc["gpu"] else "cpu")
    ]
    return doc


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
    """Show the GPU, the software, the backends available, the active table and the defaults."""
    doc = _environment()
    if measure_dispatch:
        from dmattn_bench.ops import dispatch_overhead_us

        doc["dispatch_overhead_us"] = dispatch_overhead_us("cuda" if doc["gpu"] else "cpu")
    table = Table(title="dmattn-bench info", show_header=False)
    table.add_column("key")
    table.add_column("value")
    for key in ("dmattn_bench", "python", "torch", "triton", "cuda_runtime", "interpreter", "backends", "active_table"):
        table.add_row(key, str(doc[key]))
    gpu = doc["gpu"]
    table.add_row("gpu", "none (kernels run in the Triton interpreter)" if gpu is None else
                  ", ".join(f"{k}={v}" for k, v in gpu.items()))
    if "dispatch_overhead_us" in doc:
        table.add_row("dispatch overhead", f"{doc['dispatch_overhead_us']} µs per call (backend='auto' vs direct launch)")
    for entry in doc["default_configs"]:
        table.add_row(f"default D {entry['head_dims']}", f"fwd {entry['fwd']}  bwd {entry['bwd']}")
    output.render(doc, [table], fmt)
