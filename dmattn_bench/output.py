"""The only printer: results to stdout (rich table or one JSON document), everything else to stderr."""

from __future__ import annotations

import json
import sys
from contextlib import contextmanager
from typing import Any, Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

FORMATS = ("human", "json")

PIPE_WIDTH = 200  # rich assumes 80 columns when stdout is not a terminal: too narrow for tables
stdout = Console(soft_wrap=True, width=None if sys.stdout.isatty() else PIPE_WIDTH)
stderr = Console(stderr=True, soft_wrap=True)


def info(message: str) -> None:
    """A progress or context line (stderr)."""
    stderr.print(message, highlight=False)


def warn(message: str) -> None:
    stderr.print(f"[yellow]warning:[/yellow] {message}", highlight=False)


def error(message: str) -> None:
    stderr.print(f"[red]error:[/red] {message}", highlight=False)


@contextmanager
def progress(description: str, total: int) -> Iterator[Any]:
    """A progress bar with ETA on stderr; yields a function that advances it by one.

    When stderr is not a terminal (CI logs, redirects) a bar cannot redraw, so each step is one
    plain line instead.
    """
    if not stderr.is_terminal:
        done = 0

        def log_step(last: str = "") -> None:
            nonlocal done
            done += 1
            info(f"{description} [{done}/{total}] {last}")

        yield log_step
        return
    bar = Progress(
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
        TextColumn("{task.fields[last]}"),
        console=stderr,
        transient=False,
    )
    with bar:
        task = bar.add_task(description, total=total, last="")

        def advance(last: str = "") -> None:
            bar.update(task, advance=1, last=last)

        yield advance


def write_text(text: str) -> None:
    """A result that is already text (e.g. a markdown report), as is."""
    sys.stdout.write(text)


def render(document: dict, tables: list[Table], fmt: str) -> None:
    """Prints the result once: `tables` for humans, `document` as JSON."""
    if fmt == "json":
        sys.stdout.write(json.dumps(document, indent=2, default=str) + "\n")
        return
    for table in tables:
        stdout.print(table)
