"""The shape of the house (STYLE.md): the import arrows (the kernel package a leaf that imports
torch, triton and itself, never the front end; no circle among the modules; a call loads no
tuning, bench or CLI code) and the mask's walk from the public call down to the launch."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import torch

KERNELS = Path(__file__).resolve().parents[1] / "kernels"


def _imported_modules(path: Path) -> set[str]:
    """Every module a file imports, at any depth (function-level imports included)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_no_kernel_module_imports_the_front_end():
    offenders = {str(path.relative_to(KERNELS)): sorted(n for n in _imported_modules(path)
                                                        if n.split(".")[0] == "dmattn_bench")
                 for path in sorted(KERNELS.rglob("*.py"))}
    assert not {path: names for path, names in offenders.items() if names}


def _project_modules() -> dict[str, Path]:
    """Every module of `dmattn_bench` and of the kernel package (`dmattn_kernels`), by dotted name."""
    modules = {}
    for package, folder in (("dmattn_bench", KERNELS.parent / "dmattn_bench"), ("dmattn_kernels", KERNELS)):
        for path in folder.rglob("*.py"):
            parts = (package, *path.relative_to(folder).with_suffix("").parts)
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _import_graph() -> dict[str, set[str]]:
    """Which project module imports which (at any depth, names imported from a package resolved to
    their modules), the kernel package counted as one node, "kernels"."""
    modules = _project_modules()

    def node(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return None if not name else "kernels" if name.startswith("dmattn_kernels") else name

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        for statement in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(statement, ast.Import):
                targets.update(alias.name for alias in statement.names)
            elif isinstance(statement, ast.ImportFrom) and statement.module and statement.level == 0:
                # `from package import module` depends on that module; `from module import name`, on the module
                targets.update(f"{statement.module}.{alias.name}" if f"{statement.module}.{alias.name}" in modules
                               else statement.module for alias in statement.names)
        graph.setdefault(node(name), set()).update(target for target in map(node, targets)
                                                   if target not in (None, node(name)))
    return graph


def test_no_circle_among_the_modules():
    """Following imports (function-level ones too) from any module never leads back to it."""
    graph = _import_graph()
    circles = []
    for start in graph:
        seen, frontier = set(), [(start, (start,))]
        while frontier:
            name, path = frontier.pop()
            for target in graph.get(name, ()):
                if target == start:
                    circles.append(" -> ".join((*path, start)))
                elif target not in seen:
                    seen.add(target)
                    frontier.append((target, (*path, target)))
    assert not circles, "\n".join(sorted(circles, key=len)[:10])


def test_the_kernel_package_loads_with_the_front_end_absent():
    """Every launcher and the runtime import in a process where `dmattn_bench` cannot be imported."""
    script = ("import sys; sys.modules['dmattn_bench'] = None\n"
              "import dmattn_kernels.configs, dmattn_kernels.runtime.native, dmattn_kernels.runtime.plan_cache\n"
              "import dmattn_kernels.triton.launching, dmattn_kernels.triton.schedule\n"
              "import dmattn_kernels.triton.forward, dmattn_kernels.triton.backward\n"
              "import dmattn_kernels.triton.launch, dmattn_kernels.triton.decode_launch\n"
              "import dmattn_kernels.cuda, dmattn_kernels.cuda.backward, dmattn_kernels.cuda.driver\n"
              "import dmattn_kernels.cuda.forward, dmattn_kernels.cuda.params, dmattn_kernels.cuda.rules\n"
              "import dmattn_kernels.cuda.shared_memory, dmattn_kernels.cuda.variants\n"
              "print('ok')")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, TRITON_INTERPRET="1"))
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


# the offline rooms (a prefix covers a package and its modules), the benchmark operators and the
# CLI's libraries
RUNTIME_FORBIDDEN = ("dmattn_bench.tuning", "dmattn_bench.bench", "dmattn_bench.cli", "benchmarks", "click", "rich")


def test_a_call_loads_no_tuning_bench_cli_or_table_writing_module():
    """`import dmattn_bench` and its calls (a training step with mask and bias, a decode step over
    a paged cache) run on the runtime's modules alone."""
    script = """
import sys, torch
import dmattn_bench
q = torch.randn(1, 20, 4, 16, requires_grad=True)
k, v = (torch.randn(1, 20, 2, 16, requires_grad=True) for _ in range(2))
mask = torch.rand(1, 2, 20, 20) > 0.3
bias = torch.zeros(1, 2, 1, 20, requires_grad=True)
dmattn_bench.flash_dmattn_func(q, k, v, mask, bias, is_causal=True).sum().backward()
with torch.no_grad():
    pool = torch.randn(4, 16, 2, 16)
    dmattn_bench.flash_dmattn_func(q[:, :1], pool, pool, block_table=torch.tensor([[1, 3]], dtype=torch.int32))
print(" ".join(sorted(sys.modules)))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, TRITON_INTERPRET="1"))
    assert done.returncode == 0, done.stderr[-2000:]
    loaded = done.stdout.split()
    assert "dmattn_bench.plan" in loaded
    assert not [name for name in loaded if name.startswith(RUNTIME_FORBIDDEN)]


def test_no_source_or_test_reads_a_journal_under_results():
    """results/ holds evidence; the code and its tests depend on none of its journals, directly or
    through a benchmark operator's module, which none imports (the learned defaults are written by
    `python -m benchmarks learn-defaults` from the journals it is given)."""
    root = KERNELS.parent
    reader = re.compile(r"results/[\w./-]*\.jsonl|^\s*(?:from|import)\s+benchmarks\b", re.MULTILINE)
    readers = [str(path.relative_to(root)) for folder in ("dmattn_bench", "kernels", "tests")
               for path in sorted((root / folder).rglob("*.py")) if reader.search(path.read_text())]
    assert not readers


MASK_WALK_MAX_STOPS = 8


def _mask_walk(call) -> list[tuple[str, str]]:
    """(file, function) of each call of a project function that receives the mask, or a view of
    it, while `call` runs (its default argument), in order; comprehensions left out."""
    root = KERNELS.parent
    mask = call.__defaults__[0]
    walk = []

    def is_mask(value) -> bool:
        return (isinstance(value, torch.Tensor) and value.dtype in (torch.bool, torch.uint8) and value.numel() > 0
                and value.data_ptr() == mask.data_ptr())

    def carries(frame) -> bool:  # an argument or local, or one of a tuple's (a launch's `*tensors`)
        return any(is_mask(value) or (isinstance(value, tuple) and any(map(is_mask, value)))
                   for value in frame.f_locals.values())

    def profile(frame, event, _):
        path = Path(frame.f_code.co_filename).resolve()
        if (event == "call" and not frame.f_code.co_name.startswith("<") and path.is_relative_to(root)
                and path.parts[len(root.parts)] in ("dmattn_bench", "kernels") and carries(frame)):
            walk.append((str(path.relative_to(root)), frame.f_code.co_name))

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return walk


def test_the_mask_walks_down_to_the_launch_through_few_files_and_never_back(monkeypatch):
    """A training call's mask, on its signature's first call (the plan built, then run), goes
    from `flash_dmattn_func` to the kernel launches through at most MASK_WALK_MAX_STOPS files,
    each entered once: a reader follows it top to bottom, never back into a file it left. (The
    kernels do not run: the walk ends where a launch hands the mask to Triton.)"""
    from dmattn_bench import flash_dmattn_func, plan
    from dmattn_kernels.triton import launching

    monkeypatch.setattr(launching.Launch, "_jit", lambda self, tensors: None)
    q, k, v = (torch.randn(1, 32, 2, 16, requires_grad=True) for _ in range(3))
    bias = torch.zeros(1, 2, 32, 32, requires_grad=True)
    plan.clear()

    def call(mask=torch.rand(1, 2, 32, 32) > 0.3):
        flash_dmattn_func(q, k, v, mask, bias, is_causal=True)

    walk = _mask_walk(call)
    files = [path for index, (path, _) in enumerate(walk) if index == 0 or walk[index - 1][0] != path]
    assert files[0] == "dmattn_bench/api.py" and walk[-1] == ("kernels/triton/launching.py", "run"), walk
    assert len(files) <= MASK_WALK_MAX_STOPS and len(set(files)) == len(files), "\n".join(map(str, walk))
