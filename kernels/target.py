"""Planning for a GPU that may not be here: the programs a launch plan would run.

Within `planning_for(arch)` the launchers build their plans as for a GPU of that arch (the
arch queries below answer it instead of the device) and record, for every kernel a plan would
launch, a `Program`: the kernel and the compile-time parameters the launcher fixed for it (a
Triton kernel's constexprs and options, a CUDA source's -D list). Nothing is compiled or
launched. A dispatch-table entry's stamp is a fingerprint of these programs, so it follows
exactly what the launchers pass, wherever that is decided.

Plans are built on data-less tensors (`device="meta"`): a launcher that needs an address reads 0,
which is aligned.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

_STATE = threading.local()


@dataclass(frozen=True)
class Program:
    """One kernel a plan launches, as its launcher parameterised it.

    Attributes:
        backend: "triton" or "cuda".
        name: the kernel's name (Triton) or its source's key in `cuda.build.SOURCES`.
        kernel: the Triton JIT function; None for CUDA.
        parameters: sorted (name, value) pairs: a Triton kernel's constexprs and launch options
            (num_warps, num_stages), a CUDA variant's -D flags as ("-D", flag) pairs.
    """

    backend: str
    name: str
    kernel: Any
    parameters: tuple[tuple[str, Any], ...]


@dataclass
class _Planning:
    arch: str  # "sm90"
    programs: list[Program]


@contextmanager
def planning_for(arch: str) -> Iterator[list[Program]]:
    """Within this block, plans are built for `arch` ("sm80", "sm90", "sm120") and record the
    programs they would launch into the yielded list instead of building or launching any."""
    previous = getattr(_STATE, "planning", None)
    _STATE.planning = _Planning(arch, [])
    try:
        yield _STATE.planning.programs
    finally:
        _STATE.planning = previous


def planned_arch() -> str | None:
    """The arch being planned for (`planning_for`), else None."""
    planning = getattr(_STATE, "planning", None)
    return None if planning is None else planning.arch


def planned_major() -> int | None:
    """The compute-capability major of the arch being planned for, else None."""
    arch = planned_arch()
    return None if arch is None else int(arch[2:-1])


def record(program: Program) -> None:
    """Records `program` for the plan being built within `planning_for` (the caller checks
    `planned_arch()` first, and then builds and launches nothing)."""
    _STATE.planning.programs.append(program)
