"""Runs a benchmark operator from the repository root:

    python -m benchmarks                  # lists the operators with their one-line help
    python -m benchmarks NAME --help      # an operator's arguments
    python -m benchmarks NAME [ARGS...]   # runs it; its exit status is the command's

Every module of this package registers one operator (`dmattn_bench.bench.operators`), named
after its path with dashes: `benchmarks/host_probe.py` is `host-probe`,
`benchmarks/cuda/ws_probe.py` is `cuda-ws-probe`. A run imports its operator's module alone (as
tritonbench loads an operator by name); the list imports every module and checks each registers
its one operator. Importing a module does no work beyond registering.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys

import benchmarks
from dmattn_bench.bench import operators

USAGE = "usage: python -m benchmarks [list | NAME [ARGS...]]   (NAME --help: its arguments)"


def modules() -> dict[str, str]:
    """{operator name: module} of every module of the package, named by the rule above."""
    prefix = f"{benchmarks.__name__}."
    return {info.name.removeprefix(prefix).replace(".", "-").replace("_", "-"): info.name
            for info in pkgutil.walk_packages(benchmarks.__path__, prefix)
            if not info.ispkg and info.name.rpartition(".")[2] != "__main__"}


def load(known: dict[str, str]) -> list[str]:
    """Imports every module of `known`; why one does not register exactly its operator, for each."""
    problems = []
    for module in sorted(known.values()):
        try:
            importlib.import_module(module)
        except Exception as exc:  # a module that cannot load is reported, the others still listed
            problems.append(f"{module}: {type(exc).__name__}: {exc}")
    for name, module in sorted(known.items()):
        registered = [op.name for op in operators.operators() if op.module == module]
        if registered != [name] and not any(problem.startswith(f"{module}:") for problem in problems):
            problems.append(f"{module} registers {registered}, expected [{name!r}]")
    return problems


def main(argv: list[str]) -> int:
    known = modules()
    if not argv or argv[0] in ("list", "-h", "--help"):
        if not argv or argv[0] != "list":
            print(USAGE, file=sys.stderr)
        problems = load(known)
        listed = operators.operators()
        width = max((len(op.name) for op in listed), default=0)
        for op in listed:
            print(f"{op.name:<{width}}  {op.help}")
        for problem in problems:
            print(f"error: {problem}", file=sys.stderr)
        return 1 if problems else 0
    name, args = argv[0], argv[1:]
    if name not in known:
        print(f"error: no benchmark operator {name!r}; `python -m benchmarks` lists them", file=sys.stderr)
        return 2
    importlib.import_module(known[name])
    op = operators.get(name)
    sys.argv = [f"python -m benchmarks {name}", *args]  # argparse's usage line names the command
    return op.main(args) or 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
