"""The kernel hash changes with what decides a kernel's results and speed, and with nothing else.

Each test edits a copy of a kernel package in tmp_path, located through the AST of the files as
they are (not fixed line numbers), so the tests keep working while the kernels change.
"""

import ast
import importlib.util
import shutil
from pathlib import Path

import pytest

from dmattn_bench import registry, sourcehash
from dmattn_bench.sourcehash import canonical, cuda_package_hash, normalise_c, triton_package_hash


def _package_dir(name: str) -> Path:
    return Path(importlib.util.find_spec(registry.KERNEL_PACKAGES[name]).origin).parent


@pytest.fixture
def triton_copy(tmp_path) -> Path:
    target = tmp_path / "triton"
    shutil.copytree(_package_dir("triton"), target, ignore=shutil.ignore_patterns("__pycache__"))
    return target


@pytest.fixture
def cuda_copy(tmp_path) -> Path:
    target = tmp_path / "cuda"
    shutil.copytree(_package_dir("cuda"), target, ignore=shutil.ignore_patterns("__pycache__"))
    return target


def _functions(path: Path, jit: bool) -> list[ast.FunctionDef]:
    tree = ast.parse(path.read_text())
    return [node for node in tree.body if isinstance(node, ast.FunctionDef) and sourcehash._is_jit(node) == jit]


def _insert_line(path: Path, before_line: int, text: str) -> None:
    """Inserts `text` as a line before 1-based line `before_line`."""
    lines = path.read_text().splitlines(keepends=True)
    lines.insert(before_line - 1, text + "\n")
    path.write_text("".join(lines))


def _first_statement(function: ast.FunctionDef) -> ast.stmt:
    """The first statement after the docstring (the docstring itself when it is the only one)."""
    body = function.body
    return body[1] if len(body) > 1 and ast.get_docstring(function) is not None else body[0]


def _indent(path: Path, line: int) -> str:
    text = path.read_text().splitlines()[line - 1]
    return text[: len(text) - len(text.lstrip())]


def _jit_file(directory: Path) -> Path:
    return next(p for p in sorted(directory.glob("*.py")) if _functions(p, jit=True))


def test_the_registry_hashes_the_installed_packages():
    assert registry.kernel_source_hash("triton") == triton_package_hash(_package_dir("triton"))
    assert registry.kernel_source_hash("cuda") == cuda_package_hash(_package_dir("cuda"))
    assert registry.kernel_source_hash("reference").startswith("sha256:")
    assert len({registry.kernel_source_hash(name) for name in ("triton", "cuda", "reference")}) == 3


# -- Triton -----------------------------------------------------------------------------------------

def _edit_docstrings_and_comments(path: Path) -> None:
    """Comments in every jit function's body and a new or rewritten docstring, bottom up so that
    the line numbers still to be used stay valid."""
    for function in reversed(_functions(path, jit=True)):
        has_docstring = ast.get_docstring(function) is not None
        indent = _indent(path, function.body[0].lineno)
        if len(function.body) > 1 or not has_docstring:
            _insert_line(path, _first_statement(function).lineno, f"{indent}# -- an edited phase comment --")
        if has_docstring:
            doc = function.body[0]
            lines = path.read_text().splitlines(keepends=True)
            lines[doc.lineno - 1: doc.end_lineno] = [f'{indent}"""A rewritten docstring."""\n']
            path.write_text("".join(lines))
        else:
            _insert_line(path, function.body[0].lineno, f'{indent}"""A new docstring."""')


def _edit_host_code(path: Path) -> None:
    """A statement in every launcher or helper, an import, and a rewritten module docstring."""
    for function in reversed(_functions(path, jit=False)):
        statement = _first_statement(function)
        _insert_line(path, statement.lineno, f"{_indent(path, statement.lineno)}_host_refactor = 1")
    tree = ast.parse(path.read_text())
    imports = [s for s in tree.body if isinstance(s, (ast.Import, ast.ImportFrom))]
    if imports:
        _insert_line(path, imports[-1].end_lineno + 1, "import os  # host code: not a kernel")
    if ast.get_docstring(tree) is not None:
        doc = tree.body[0]
        lines = path.read_text().splitlines(keepends=True)
        lines[doc.lineno - 1: doc.end_lineno] = ['"""An edited module docstring."""\n']
        path.write_text("".join(lines))


def test_triton_docstrings_comments_and_host_code_do_not_count(triton_copy):
    before = triton_package_hash(triton_copy)
    for path in sorted(triton_copy.glob("*.py")):
        _edit_docstrings_and_comments(path)
        _edit_host_code(path)
        ast.parse(path.read_text())  # the edits left valid Python
    assert triton_package_hash(triton_copy) == before


def test_triton_jit_body_edit_counts(triton_copy):
    before = triton_package_hash(triton_copy)
    path = _jit_file(triton_copy)
    statement = _first_statement(_functions(path, jit=True)[0])
    _insert_line(path, statement.lineno, f"{_indent(path, statement.lineno)}unused_probe = 1")
    assert triton_package_hash(triton_copy) != before


def test_triton_jit_signature_edit_counts(triton_copy):
    before = triton_package_hash(triton_copy)
    path = _jit_file(triton_copy)
    function = _functions(path, jit=True)[0]
    lines = path.read_text().splitlines(keepends=True)
    line = lines[function.lineno - 1]
    lines[function.lineno - 1] = line.replace(f"def {function.name}(", f"def {function.name}(probe_arg, ", 1)
    path.write_text("".join(lines))
    assert triton_package_hash(triton_copy) != before


@pytest.mark.parametrize("where", ["kernel file", "launcher"])
def test_triton_constant_change_counts(triton_copy, where):
    """An UPPER_CASE module constant is a launch parameter: its value counts, wherever it is."""
    files = sorted(triton_copy.glob("*.py"))
    path = next(p for p in files if (p.name == "launch.py") == (where == "launcher")
                and any(sourcehash._is_constant(s) and isinstance(getattr(s, "value", None), ast.Constant)
                        and isinstance(s.value.value, int) for s in ast.parse(p.read_text()).body))
    before = triton_package_hash(triton_copy)
    statement = next(s for s in ast.parse(path.read_text()).body if sourcehash._is_constant(s)
                     and isinstance(getattr(s, "value", None), ast.Constant) and isinstance(s.value.value, int))
    lines = path.read_text().splitlines(keepends=True)
    line = lines[statement.value.lineno - 1]
    start, end = statement.value.col_offset, statement.value.end_col_offset
    lines[statement.value.lineno - 1] = line[:start] + str(statement.value.value * 2 + 1) + line[end:]
    path.write_text("".join(lines))
    assert triton_package_hash(triton_copy) != before


def test_triton_lowercase_module_state_does_not_count(triton_copy):
    before = triton_package_hash(triton_copy)
    (triton_copy / "launch.py").write_text((triton_copy / "launch.py").read_text() + "\n_cache_probe = {}\n")
    assert triton_package_hash(triton_copy) == before
    (triton_copy / "launch.py").write_text((triton_copy / "launch.py").read_text() + "\nNEW_TILE = 64\n")
    assert triton_package_hash(triton_copy) != before


def test_canonical_text_is_pinned():
    """`canonical` must print the same text on every supported Python (3.10-3.13 checked by hand;
    `ast.dump` differs there); a Python that prints otherwise fails here, not in a stale table."""
    tree = ast.parse("@triton.jit\ndef f(x, N: tl.constexpr = 4):\n    return x * 1.5 + N\n")
    assert canonical(tree.body[0]) == (
        "FunctionDef(name='f', args=arguments(args=[arg(arg='x'), arg(arg='N', annotation=Attribute("
        "value=Name(id='tl', ctx=Load()), attr='constexpr', ctx=Load()))], defaults=[Constant(value=4)]), "
        "body=[Return(value=BinOp(left=BinOp(left=Name(id='x', ctx=Load()), op=Mult(), right=Constant(value=1.5)), "
        "op=Add(), right=Name(id='N', ctx=Load())))], decorator_list=[Attribute(value=Name(id='triton', ctx=Load()), "
        "attr='jit', ctx=Load())])")
    assert canonical(ast.parse("S = 'µs'").body[0]).endswith("value=Constant(value='\\xb5s'))")


# -- CUDA -------------------------------------------------------------------------------------------

def test_cuda_comments_whitespace_and_host_code_do_not_count(cuda_copy):
    before = cuda_package_hash(cuda_copy)
    for path in sorted([*cuda_copy.glob("*.cu"), *cuda_copy.glob("*.cuh")]):
        lines = path.read_text().splitlines()
        edited = ["// an edited header comment /* with a 'quote' and a \"quote\"", "/* a block", "   comment */"]
        for line in lines:
            stripped = line.strip()
            # re-indented (tabs and more spaces), and a trailing comment after each statement
            edited.append("\t  " + line if stripped and not stripped.startswith("#") else line)
            if stripped.endswith(";") and not stripped.endswith("\\"):
                edited[-1] += "   // why this line"
        path.write_text("\n".join(edited) + "\n\n\n")
    for path in sorted(cuda_copy.glob("*.py")):
        _edit_host_code(path)
    assert cuda_package_hash(cuda_copy) == before


def test_cuda_code_edit_counts(cuda_copy):
    before = cuda_package_hash(cuda_copy)
    path = sorted(cuda_copy.glob("*.cuh"))[0]
    path.write_text(path.read_text() + "\nstatic constexpr int kProbe = 1;\n")
    assert cuda_package_hash(cuda_copy) != before


def test_cuda_build_constant_counts(cuda_copy):
    before = cuda_package_hash(cuda_copy)
    path = cuda_copy / "build.py"
    path.write_text(path.read_text() + "\nNVCC_PROBE_OPTIONS = ('-O2',)\n")
    assert cuda_package_hash(cuda_copy) != before


@pytest.mark.parametrize("a, b", [
    ('int x = 1; // c\n', 'int  x=1;\n'),
    ('f(a, /* c */ b);', 'f(a,b);'),
    ('if (x)\n{\n    y();\n}\n', 'if (x) { y(); }'),
    ('#define A 1 /* c */\n#define B 2\n', '#define A 1\n\n#define B 2'),
    ('#define F(x) \\\n    (x)\n', '#define F(x) (x)\n'),
    ('Tile<A<B> > t;', 'Tile<A<B> >  t;'),
])
def test_normalise_c_ignores_comments_and_layout(a, b):
    assert normalise_c(a) == normalise_c(b)


@pytest.mark.parametrize("a, b", [
    ('s = "// not a comment";', 's = "";'),
    ('s = "a  b";', 's = "a b";'),
    ("c = '/'; d = '*'; e = 1;", "c = '/'; d = '*';"),
    ('#define F (x)\n', '#define F(x)\n'),  # object-like vs function-like macro
    ('y = a - -b;', 'y = a--b;'),
    ('#define A 1\nint x;', '#define A 1 int x;'),
    ('int x;', 'int y;'),
])
def test_normalise_c_keeps_what_matters(a, b):
    assert normalise_c(a) != normalise_c(b)
