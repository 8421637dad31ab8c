"""The import arrows (STYLE.md, "Shape of the house"): the kernel package is a leaf that imports
torch, triton and itself, never the front end."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

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


def test_the_kernel_package_loads_with_the_front_end_absent():
    """Every launcher and the runtime import in a process where `dmattn_bench` cannot be imported."""
    script = ("import sys; sys.modules['dmattn_bench'] = None\n"
              "import dmattn_kernels.configs, dmattn_kernels.runtime.native, dmattn_kernels.runtime.plan_cache\n"
              "import dmattn_kernels.triton.launch, dmattn_kernels.triton.decode_launch, dmattn_kernels.cuda.launch\n"
              "print('ok')")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, TRITON_INTERPRET="1"))
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


RUNTIME_FORBIDDEN = ("dmattn_bench.tuner", "dmattn_bench.trials", "dmattn_bench.workers", "dmattn_bench.journal",
                     "dmattn_bench.prune", "dmattn_bench.validator", "dmattn_bench.adversarial", "dmattn_bench.bench",
                     "dmattn_bench.peers", "dmattn_bench.timing", "dmattn_bench.cluster", "dmattn_bench.defaults",
                     "dmattn_bench.cli", "dmattn_bench.dispatch.writer", "click", "rich")


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
    through a script of benchmarks/ (the learned defaults are written by
    `benchmarks/learn_defaults.py` from the journals it is given)."""
    root = KERNELS.parent
    reader = re.compile(r"results/[\w./-]*\.jsonl|[\"']benchmarks[\"']")
    readers = [str(path.relative_to(root)) for folder in ("dmattn_bench", "kernels", "tests")
               for path in sorted((root / folder).rglob("*.py")) if reader.search(path.read_text())]
    assert not readers
