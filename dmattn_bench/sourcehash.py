"""The hash of what decides a kernel backend's results and speed, read from its source files.

A dispatch table records, per backend and dtype, the hash of the kernel sources its entries were
last validated on (`dispatch.table`); the run-time lookup skips entries whose hash differs from
the installed kernels'. So the hash covers what a kernel computes and the launch parameters it
receives, and nothing a reader edits without changing either:

- Triton: every `@triton.jit` function of the package's files, docstring removed, plus the
  module-level UPPER_CASE constant assignments of those files (the tile sizes, warps and cells
  the launchers pass the kernels). Comments are not in the AST; launcher functions, helpers and
  imports are left out.
- CUDA: the `.cu` and `.cuh` files with comments removed and whitespace normalised
  (`normalise_c`), plus the UPPER_CASE constants of the package's `.py` files (the nvcc options
  and launch limits of `build.py` and the launcher modules).
- A single Python module (the reference backend): all of it, docstrings removed.

Python sources are hashed as a canonical dump of their AST (`canonical`), not as `ast.dump`
text: `ast.dump` prints differently across the Python versions we support (3.12 added the
`type_params` field to every function; 3.13 omits empty fields by default), and `ast.unparse`
text is not promised stable either (its f-string output changed in 3.12). `canonical` prints
each node's fields in order, skipping the ones that are None or empty, so an optional field a
newer Python adds does not change the text, and writes constants with `ascii()` (`repr()` of a
non-ASCII string depends on the Unicode tables of the version). The same digest came out on
CPython 3.10, 3.11, 3.12 and 3.13 for this repository's kernels.

Only the standard library is used and nothing is imported from the kernels, so the hash is safe
to take before the choice of the Triton interpreter is made.
"""

from __future__ import annotations

import ast
import hashlib
import re
from pathlib import Path

# Bumped when what is hashed changes, so a table validated under other rules reads as stale
# instead of matching by accident.
HASH_RULES = b"dmattn-bench kernel hash, rules 2\n"
DIGEST_HEX_CHARS = 32  # 128 bits: plenty to tell kernel revisions apart, short enough to read
CONSTANT_NAME = re.compile(r"_*[A-Z][A-Z0-9_]*")  # LOG2E, CELL, _CU_DEVICE_ATTRIBUTE_...
JIT_DECORATOR = "jit"  # @triton.jit, @triton.jit(...), @jit


def canonical(node) -> str:
    """A version-stable text of an AST: node names and their non-empty fields, no positions."""
    if isinstance(node, ast.AST):
        fields = []
        for name in node._fields:
            value = getattr(node, name, None)
            if value is None or (isinstance(value, list) and not value):
                continue
            fields.append(f"{name}={canonical(value)}")
        return f"{type(node).__name__}({', '.join(fields)})"
    if isinstance(node, list):
        return f"[{', '.join(canonical(item) for item in node)}]"
    return ascii(node)


def _without_docstring(body: list) -> list:
    first = body[0] if body else None
    is_docstring = (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                    and isinstance(first.value.value, str))
    return body[1:] if is_docstring else body


def _strip_docstrings(tree: ast.AST) -> ast.AST:
    """`tree` with the docstring of the module and of every function and class removed (in place)."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            node.body = _without_docstring(node.body)
    return tree


def _is_jit(function: ast.FunctionDef) -> bool:
    for decorator in function.decorator_list:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", None)
        if name == JIT_DECORATOR:
            return True
    return False


def _is_constant(statement: ast.stmt) -> bool:
    """A module-level assignment of UPPER_CASE names only (`A = 1`, `A, B = 1, 2`, `A: int = 1`)."""
    if isinstance(statement, ast.AnnAssign):
        targets = [statement.target] if statement.value is not None else []
    elif isinstance(statement, ast.Assign):
        targets = statement.targets
    else:
        return False
    names = []
    for target in targets:
        names += target.elts if isinstance(target, ast.Tuple) else [target]
    return bool(names) and all(isinstance(n, ast.Name) and CONSTANT_NAME.fullmatch(n.id) for n in names)


def python_parts(path: Path, jit: bool) -> list[str]:
    """The canonical texts of a file's UPPER_CASE constants and, with `jit`, its jit functions.

    Sorted, so reordering definitions within a file changes nothing.
    """
    tree = _strip_docstrings(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)))
    parts = [canonical(s) for s in tree.body if _is_constant(s)]
    if jit:
        parts += [canonical(f) for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and _is_jit(f)]
    return sorted(parts)


# One C/C++ lexeme per match, in this order: a comment, a string or character literal (raw
# strings included, so nothing inside one is taken for a comment), a word or number, a newline,
# other whitespace, one punctuation character.
_C_LEXEME = re.compile(r"""
    (?P<comment> //[^\n]* | /\*.*?(?:\*/|\Z) )
  | (?P<literal> (?:u8|[uUL])?R"(?P<delim>[^()\\\s"]{0,16})\(.*?\)(?P=delim)"
               | (?:u8|[uUL])?"(?:\\.|[^"\\\n])*"
               | (?:u8|[uUL])?'(?:\\.|[^'\\\n])*' )
  | (?P<word> [A-Za-z_][A-Za-z0-9_]* | [0-9](?:[A-Za-z0-9_.]|'(?=[A-Za-z0-9_])|(?<=[eEpP])[+-])* )
  | (?P<newline> \n )
  | (?P<space> [ \t\r\f\v]+ )
  | (?P<punct> . )
""", re.S | re.X)
_WORD_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_")
_OPERATOR_CHARS = frozenset("+-*/%&|^<>=!:.#")


def _keeps_space(before: str, after: str) -> bool:
    """Whether the whitespace between two lexemes can matter: it separates two words (`int x`)
    or two operator characters that would otherwise read as one (`a - -b`, `> >`)."""
    return ((before in _WORD_CHARS and after in _WORD_CHARS)
            or (before in _OPERATOR_CHARS and after in _OPERATOR_CHARS))


def normalise_c(text: str) -> str:
    """C/C++ source without comments and with whitespace normalised; literals are kept verbatim.

    Outside preprocessor directives, line breaks and indentation are whitespace like any other,
    and a single space survives only where dropping it could join two tokens; a directive keeps
    its own line and its spaces (collapsed to one: `#define F (x)` is not `#define F(x)`).
    """
    text = text.replace("\r\n", "\n").replace("\\\n", "")  # line splices come before comments in C
    out: list[str] = []
    space = False  # whitespace (or a comment) since the last lexeme
    line_start = True  # only whitespace since the last line break
    directive = False
    for match in _C_LEXEME.finditer(text):
        kind, lexeme = match.lastgroup, match.group()
        if kind in ("comment", "space"):
            space = True
            continue
        if kind == "newline":
            if directive:
                out.append("\n")
                directive = False
            else:
                space = True
            line_start = True
            continue
        if line_start and lexeme == "#":
            if out and out[-1] != "\n":
                out.append("\n")
            directive = True
        elif space and out and out[-1] != "\n" and (directive or _keeps_space(out[-1][-1], lexeme[0])):
            out.append(" ")
        out.append(lexeme)
        space = line_start = False
    return "".join(out).strip() + "\n"


def _digest(parts: list[tuple[str, str]]) -> str:
    digest = hashlib.sha256(HASH_RULES)
    for name, text in parts:
        for piece in (name, text):
            data = piece.encode("utf-8")
            digest.update(len(data).to_bytes(8, "little"))  # length-prefixed: no two splits collide
            digest.update(data)
    return "sha256:" + digest.hexdigest()[:DIGEST_HEX_CHARS]


def triton_package_hash(directory: Path) -> str:
    """The hash of a Triton kernel package: jit functions and constants of its `*.py` files."""
    files = sorted(Path(directory).glob("*.py"))
    return _digest([(path.name, text) for path in files for text in python_parts(path, jit=True)])


def cuda_package_hash(directory: Path) -> str:
    """The hash of a CUDA kernel package: its normalised `.cu`/`.cuh` files and the constants of its `.py` files."""
    directory = Path(directory)
    sources = sorted([*directory.glob("*.cu"), *directory.glob("*.cuh")])
    parts = [(path.name, normalise_c(path.read_text(encoding="utf-8"))) for path in sources]
    parts += [(path.name, text) for path in sorted(directory.glob("*.py")) for text in python_parts(path, jit=False)]
    return _digest(parts)


def host_code_hash(packages: dict[str, Path]) -> str:
    """The hash of the host code of `packages` (name -> directory; the adversarial-case ledger's):
    every `.py` file but its jit functions (a kernel's code is digested per program), docstrings
    removed, and every `.cpp` file normalised, each under its package name and path."""
    parts = []
    for name, directory in sorted(packages.items()):
        directory = Path(directory)
        for path in sorted(directory.rglob("*.py")):
            tree = _strip_docstrings(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)))
            tree.body = [s for s in tree.body if not (isinstance(s, ast.FunctionDef) and _is_jit(s))]
            parts.append((f"{name}/{path.relative_to(directory).as_posix()}", canonical(tree)))
        parts += [(f"{name}/{path.relative_to(directory).as_posix()}", normalise_c(path.read_text(encoding="utf-8")))
                  for path in sorted(directory.rglob("*.cpp"))]
    return _digest(parts)


def python_module_hash(path: Path) -> str:
    """The hash of a single-module backend: the whole module, docstrings removed."""
    path = Path(path)
    tree = _strip_docstrings(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)))
    return _digest([(path.name, canonical(tree))])
