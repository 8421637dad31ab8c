"""The `dmattn-bench` command line: one command per module; this file wires them and maps
errors to exit codes (0 ok, 1 error, 2 usage, 3 validation failures)."""

from __future__ import annotations

import os
import sys
import warnings

import click

from dmattn_bench.errors import DmattnError
from dmattn_bench.version import __version__


def _prepare_interpreter() -> None:
    """Without a GPU, run the Triton kernels on the CPU: must precede any kernel import."""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="dmattn-bench")
def cli() -> None:
    """Autotune, validate and dispatch flash dynamic-mask attention kernels."""


def _register() -> None:
    from dmattn_bench.cli.bench import bench
    from dmattn_bench.cli.compile_check import compile_check
    from dmattn_bench.cli.info import info
    from dmattn_bench.cli.show import show
    from dmattn_bench.cli.tune import tune_command
    from dmattn_bench.cli.verify import verify

    for command in (tune_command, verify, bench, show, info, compile_check):
        cli.add_command(command)


def _one_line_warnings() -> None:
    """Warnings (a stale or foreign table, ...) as `warning: <message>` lines on stderr, not
    Python's `<file>:<line>: <Category>: <message>` and the source line."""
    from dmattn_bench import output

    warnings.showwarning = lambda message, *_, **__: output.warn(str(message))


def main(argv: list[str] | None = None) -> None:
    """Console entry point: one-line errors and warnings unless DMATTN_BENCH_DEBUG=1."""
    _prepare_interpreter()
    _register()
    if os.environ.get("DMATTN_BENCH_DEBUG") != "1":
        _one_line_warnings()
    try:
        cli.main(args=argv, prog_name="dmattn-bench", standalone_mode=False)
    except click.exceptions.Exit as done:
        sys.exit(done.exit_code)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except click.Abort:  # click's form of Ctrl-C (KeyboardInterrupt) in a command
        click.echo("interrupted", err=True)
        sys.exit(130)
    except DmattnError as exc:
        if os.environ.get("DMATTN_BENCH_DEBUG") == "1":
            raise
        from dmattn_bench import output

        output.error(exc.one_line())
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        click.echo("interrupted", err=True)
        sys.exit(130)
