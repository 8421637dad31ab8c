"""Benchmark operators: named entry points registered with the bench harness, as tritonbench
registers its operators. An operator is a function `main(argv: list[str]) -> int | None` (an
exit status; None is 0) that parses its own arguments, registered under a name with a one-line help:

    @operator("host-probe", help="Warm host µs per eager call, ours and SDPA")
    def main(argv: list[str]) -> None:
        args = parser.parse_args(argv)
        ...

A runner imports the modules that register operators, then looks one up by name (`get`) or lists
them (`operators`). This module knows no operator module itself; it is imported by such modules
and their runner only, never on a call's path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

Main = Callable[[list[str]], "int | None"]


@dataclass(frozen=True)
class Operator:
    """A registered benchmark: its name, one-line help, entry point and the module defining it."""

    name: str
    help: str
    main: Main
    module: str


_OPERATORS: dict[str, Operator] = {}


def operator(name: str, *, help: str) -> Callable[[Main], Main]:
    """Registers the decorated `main(argv)` as operator `name`; returns it unchanged.

    Raises:
        ValueError: `help` is empty or not one line, or another module already registered `name`.
    """
    if not help.strip() or "\n" in help:
        raise ValueError(f"operator {name!r}: help must be one non-empty line")

    def register(main: Main) -> Main:
        known = _OPERATORS.get(name)
        if known is not None and known.module != main.__module__:
            raise ValueError(f"operator {name!r} is registered by {known.module} and {main.__module__}")
        _OPERATORS[name] = Operator(name, help, main, main.__module__)
        return main

    return register


def get(name: str) -> Operator:
    """The operator registered as `name`.

    Raises:
        KeyError: no operator has that name; the message lists those that do.
    """
    try:
        return _OPERATORS[name]
    except KeyError:
        raise KeyError(f"no benchmark operator {name!r}; known: {', '.join(sorted(_OPERATORS))}") from None


def operators() -> list[Operator]:
    """Every registered operator, by name."""
    return [_OPERATORS[name] for name in sorted(_OPERATORS)]
