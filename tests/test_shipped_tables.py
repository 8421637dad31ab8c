"""The shipped tables (`results/tables/`) hold only current or declared-stale entries, and the
stamps that decide it follow the code each entry runs (`dispatch.stamps`), checked without a GPU.

A kernel change lands with the entries it stales re-validated on their GPU
(`dmattn-bench verify --table results/tables/<slug>.yaml --suite full --dtype <dtype> --restamp`),
or, where that GPU is not at hand, declared stale
(`dmattn-bench verify --table results/tables/<slug>.yaml --declare-stale "<why>"`): the runtime
then skips them until they are re-validated.

The edit tests copy the kernel package, edit the copy, and compute every shipped entry's status
against it in a fresh interpreter (the copy shadows the installed `dmattn_kernels`).
"""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dmattn_bench.dispatch.stamps import entry_status
from dmattn_bench.dispatch.table import load_table
from dmattn_bench.space import bias_has_rows

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = sorted((ROOT / "results" / "tables").glob("*.yaml"))
# every shipped entry's status, one JSON document: {table name: [status per entry]}
STATUS_SCRIPT = """
import json, sys
from dmattn_bench.dispatch.stamps import entry_status
from dmattn_bench.dispatch.table import load_table
print(json.dumps({p: [entry_status(e, t.device) for e in t.entries]
                  for p in sys.argv[1:] for t in [load_table(p)]}))
"""


def test_there_are_shipped_tables():
    assert SHIPPED


@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
def test_every_shipped_entry_is_current_or_declared_stale(path):
    table = load_table(path)
    problems = []
    for entry in table.entries:
        if entry.stale is not None:
            continue
        state = entry_status(entry, table.device)
        if state != "current":
            problems.append(f"{entry.backend} {entry.key}: {state}")
        elif entry.validated.suite != "full":
            problems.append(f"{entry.backend} {entry.key}: validated with the {entry.validated.suite} suite only")
    fix = (f"on {table.device.name}: dmattn-bench verify --table results/tables/{path.name} --suite full --dtype DTYPE "
           f"--restamp; without it: dmattn-bench verify --table results/tables/{path.name} --declare-stale REASON")
    assert not problems, f"{path.name}: {len(problems)} entries: " + "; ".join(problems[:5]) + f" ({fix})"


# -- edits on a copy of the kernels ------------------------------------------------------------------


def _statuses(kernels: Path) -> dict[str, list[str]]:
    """Every shipped entry's status against the kernel package at `kernels`."""
    environment = dict(os.environ, PYTHONPATH=str(kernels.parent))
    done = subprocess.run([sys.executable, "-c", STATUS_SCRIPT, *map(str, SHIPPED)], capture_output=True, text=True,
                          env=environment, cwd=kernels.parent, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


def _edited(tmp_path: Path, edits: dict[str, list[tuple[str, str]]]) -> Path:
    """A copy of the kernel package (as `dmattn_kernels`) with each file's (old, new) replacements
    made; each `old` must occur."""
    copy = tmp_path / "dmattn_kernels"
    shutil.copytree(ROOT / "kernels", copy, ignore=shutil.ignore_patterns("__pycache__"))
    for name, replacements in edits.items():
        path = copy / name
        text = path.read_text()
        for old, new in replacements:
            assert old in text, f"{name}: {old!r} not found (the test's anchor moved)"
            text = text.replace(old, new)
        path.write_text(text)
    return copy


def _stale(statuses: dict[str, list[str]]) -> dict[str, set[int]]:
    """The entries an edit stales: those not current, but for the ones the shipped file already
    declares stale (stale whatever the edit)."""
    declared = {path.name: {i for i, e in enumerate(load_table(path).entries) if e.stale is not None} for path in SHIPPED}
    return {Path(path).name: {i for i, state in enumerate(states) if state != "current"} - declared[Path(path).name]
            for path, states in statuses.items()}


def _move_first_function_to_the_end(text: str, name: str) -> str:
    """`text` with the top-level function `name` (and its decorators) moved to the file's end."""
    match = re.search(rf"\n((?:@[^\n]*\n)*def {name}\(.*?)(?=\n(?:@|def |class |[A-Z_]+ =)|\Z)", text, re.S)
    assert match, name
    return text[:match.start()] + text[match.end():] + "\n\n" + match.group(1).rstrip() + "\n"


def test_edits_that_change_no_compiled_code_stale_no_entry(tmp_path):
    """A comment, moved code, a renamed host helper and a knob that stays off stale no entry of
    either shipped table."""
    fwd_ws = (ROOT / "kernels/cuda/flash_fwd_ws.cu").read_text()
    anchor = fwd_ws.index("\n", fwd_ws.index("#include \"fwd_steps.cuh\""))
    edits = {
        # a comment in a jit kernel and in a CUDA kernel
        "triton/flash_fwd.py": [("    # -- online softmax", "    # a comment that changes nothing\n    # -- online softmax")]
        if "    # -- online softmax" in (ROOT / "kernels/triton/flash_fwd.py").read_text() else [],
        "cuda/flash_fwd_ws.cu": [(fwd_ws[anchor:anchor + 1], "\n// a comment that changes nothing\n"
                                  "#if NEW_KNOB  // a knob the launcher leaves off\n"
                                  "__device__ int new_knob_helper() { return 1; }\n#endif\n")],
        # renamed host helpers
        "cuda/forward.py": [("_meta_tensors", "_data_less_tensors")],
        "triton/launching.py": [("_interpreted", "_in_the_interpreter")],
    }
    copy = _edited(tmp_path, edits)
    # moved code: a jit helper moved to the end of its file
    bwd = copy / "triton" / "flash_bwd.py"
    bwd.write_text(_move_first_function_to_the_end(bwd.read_text(), "_store_dbias_t"))
    # a Triton knob that stays off: a new constexpr parameter, default off, and its branch
    fwd = copy / "triton" / "flash_fwd.py"
    text = fwd.read_text()
    last = "    HAS_WINDOW: tl.constexpr,\n):\n"
    signature = text.index(last, text.index("def flash_fwd_kernel("))
    body = text.index('"""', text.index('"""', signature) + 3) + 4  # after the kernel's docstring
    text = (text[:signature] + "    HAS_WINDOW: tl.constexpr,\n    NEW_KNOB: tl.constexpr = False,\n):\n"
            + text[signature + len(last):body] + "    if NEW_KNOB:\n        tl.static_print('a knob left off')\n"
            + text[body:])
    fwd.write_text(text)
    stale = _stale(_statuses(copy))
    assert stale == {path.name: set() for path in SHIPPED}


def test_a_kernel_edit_stales_exactly_the_entries_whose_code_changed(tmp_path):
    """An edit inside the dK/dV kernel's dBias-rows branch stales the Triton backward entries
    with a learnable bias that has rows, and no other; one in the warp-specialized backward
    stales the CUDA backward entries that run it, and no other."""
    from dmattn_kernels.cuda import backward_warp_specialized

    copy = _edited(tmp_path, {
        "triton/flash_bwd.py": [("            zeros_t = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)",
                                 "            zeros_t = tl.full([BLOCK_N, BLOCK_M], 0.0, dtype=tl.float32)")],
        "cuda/flash_bwd_ws.cu": [("#include \"bwd_steps.cuh\"", "#include \"bwd_steps.cuh\"\n"
                                  "__device__ int an_edit_of_the_warp_specialized_backward() { return 2; }")],
    })
    stale = _stale(_statuses(copy))
    for path in SHIPPED:
        table = load_table(path)
        # an entry its table already declares stale is stale whatever the edit (`_stale`)
        expected = {i for i, e in enumerate(table.entries) if e.key.direction == "bwd" and e.stale is None and (
            (e.backend == "triton" and e.key.bias.endswith("+grad") and bias_has_rows(e.key.bias))
            or (e.backend == "cuda" and backward_warp_specialized(e.config, e.key.head_dim, "sm90")))}
        assert expected, f"{path.name}: the edits touch no entry of this table; pick other edits"
        assert stale[path.name] == expected, (
            f"{path.name}: stale {sorted(stale[path.name] - expected)} beyond, missing {sorted(expected - stale[path.name])}")


def _counts(path: Path) -> dict:
    """A table's entry count, per direction, and per (direction, backend)."""
    entries = load_table(path).entries
    counts = {"all": len(entries)}
    for entry in entries:
        for name in (entry.key.direction, (entry.key.direction, entry.backend)):
            counts[name] = counts.get(name, 0) + 1
    return counts


def test_the_readme_s_table_figures_are_the_files():
    """Issue 54: the README said "41 of 58" CUDA forward keys where the H100 table held 45 of 62.
    Its figures of the shipped tables are checked against the files here."""
    readme = " ".join((ROOT / "README.md").read_text().split())
    tables = {"nvidia-h100-80gb-hbm3-sm90.yaml": "H100", "nvidia-h200-sm90.yaml": "H200"}
    for name, gpu in tables.items():
        counts = _counts(ROOT / "results" / "tables" / name)
        said = re.search(rf"`(?:results/tables/)?{re.escape(name)}`: (\d+) entries: (\d+) forward \((\d+) CUDA, (\d+) "
                         rf"Triton\), (\d+) backward \((\d+) CUDA, (\d+) Triton\) and (\d+) decode", readme)
        assert said, f"README: no entry counts of {name}"
        assert tuple(map(int, said.groups())) == (
            counts["all"], counts["fwd"], counts[("fwd", "cuda")], counts[("fwd", "triton")], counts["bwd"],
            counts[("bwd", "cuda")], counts[("bwd", "triton")], counts["decode"]), f"{gpu}: {said.group(0)}"
    said = re.search(r"the H100 table holds CUDA entries for (\d+) of its (\d+) forward keys, the H200's for (\d+) "
                     r"of (\d+)", readme)
    h100, h200 = (_counts(ROOT / "results" / "tables" / name) for name in tables)
    assert said and tuple(map(int, said.groups())) == (
        h100[("fwd", "cuda")], h100["fwd"], h200[("fwd", "cuda")], h200["fwd"]), said
