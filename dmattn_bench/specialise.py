"""The code one compiled kernel is made of, as text: the input of a dispatch-table entry's stamp.

A kernel's compiled code is decided by its source as specialised for the compile-time parameters
its launcher passes, plus the compiler and target. The texts here are that specialised source, so
a stamp over them changes exactly when an edit changes what the compiler is given for that
variant, and never with the compiler's version (a cubin or a Triton IR dump would: the device runs
Triton 3.6 and nvcc 13.0, CI Triton 3.9):

- **Triton** (`triton_text`): the jit function's AST with every constexpr bound to its value,
  module-level constants put in, constant expressions folded and the branches of `if` statements
  on constants dropped (Triton's front end drops them too), then, recursively, every jit helper
  the live code calls, specialised for the constant arguments of that call. Printed as
  `sourcehash.canonical` text: comments, docstrings, formatting and line numbers are not in it.
  Triton's own jit functions (`tl.max`) are not followed: they are the compiler's.
- **CUDA** (`cuda_text`): the translation unit preprocessed for the variant's -D list: its
  `#include "..."` headers inlined once each (`#pragma once`), `#if`/`#ifdef`/`#elif` branches
  not taken dropped, comments and whitespace normalised (`sourcehash.normalise_c`). Macros are
  not expanded: a `#define` stays as a line, and the -D values the remaining text names are
  added. `#include <...>` lines of the toolkit's headers stay as lines (their contents belong to
  the toolkit, whose version the table records).

What it does not see: `if constexpr` and plain `if` on template parameters or -D values inside
CUDA code are not resolved (an edit in such a branch changes every variant of that translation
unit), and a Triton branch whose condition is not a constant (a pointer's dtype) stays whole.
Both err towards staleness, never away from it.
"""

from __future__ import annotations

import ast
import inspect
import operator
import re
import textwrap
from functools import lru_cache
from pathlib import Path
from typing import Any

from dmattn_bench.sourcehash import _keeps_space, _strip_docstrings, canonical, normalise_c

# -- Triton ----------------------------------------------------------------------------------------

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
           ast.Div: operator.truediv, ast.Mod: operator.mod, ast.Pow: operator.pow, ast.LShift: operator.lshift,
           ast.RShift: operator.rshift, ast.BitAnd: operator.and_, ast.BitOr: operator.or_,
           ast.BitXor: operator.xor}
_UNARY = {ast.Not: operator.not_, ast.USub: operator.neg, ast.UAdd: operator.pos, ast.Invert: operator.invert}
_COMPARE = {ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
            ast.Gt: operator.gt, ast.GtE: operator.ge, ast.Is: operator.is_, ast.IsNot: operator.is_not}
_PLAIN = (bool, int, float, str, type(None))
# Triton's own jit functions (`tl.max`, `tl.cdiv`, ...) belong to the compiler, whose version the
# table records: their sources differ between Triton releases, so they are not followed.
LIBRARY_PREFIX = "triton."


def plain_value(value: Any) -> Any:
    """A constexpr's value as a plain constant (Triton's `constexpr` wrapper unwrapped), or None
    when it is not one (a dtype object, a function)."""
    if type(value).__name__ == "constexpr":
        value = getattr(value, "value", value)
    return value if isinstance(value, _PLAIN) else None


def _is_plain(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, _PLAIN)


def _jit_function(value: Any):
    """The Python function of a Triton jit function (JITFunction, or the interpreter's wrapper), else None."""
    fn = getattr(value, "fn", None)
    return fn if inspect.isfunction(fn) and hasattr(value, "arg_names") else None


def _is_constexpr(annotation: ast.AST | None) -> bool:
    name = annotation.attr if isinstance(annotation, ast.Attribute) else getattr(annotation, "id", None)
    return name == "constexpr"


class _Specialiser(ast.NodeTransformer):
    """Binds names to constants, folds, drops dead branches and collects the jit helpers called."""

    def __init__(self, fn, bindings: dict[str, Any], helpers: dict[tuple, str]):
        self.globals = fn.__globals__
        self.bindings = dict(bindings)
        self.helpers = helpers
        self.assigned: dict[str, int] = {}

    # -- names and constants --
    def _global(self, node: ast.AST):
        """The object a Name or dotted Attribute reads from the module's globals, or None."""
        if isinstance(node, ast.Name):
            return self.globals.get(node.id) if node.id not in self.assigned else None
        if isinstance(node, ast.Attribute):
            owner = self._global(node.value)
            return getattr(owner, node.attr, None) if inspect.ismodule(owner) else None
        return None

    def visit_Name(self, node: ast.Name):
        if isinstance(node.ctx, ast.Load):
            if node.id in self.bindings:
                return ast.Constant(self.bindings[node.id])
            value = plain_value(self._global(node))
            if value is not None:
                return ast.Constant(value)
        return node

    def visit_Attribute(self, node: ast.Attribute):
        value = plain_value(self._global(node)) if isinstance(node.ctx, ast.Load) else None
        if value is not None:
            return ast.Constant(value)
        return self.generic_visit(node)

    # -- folding --
    def visit_BinOp(self, node: ast.BinOp):
        node = self.generic_visit(node)
        if _is_plain(node.left) and _is_plain(node.right) and type(node.op) in _BINARY:
            return _folded(node, lambda: _BINARY[type(node.op)](node.left.value, node.right.value))
        return node

    def visit_UnaryOp(self, node: ast.UnaryOp):
        node = self.generic_visit(node)
        if _is_plain(node.operand):
            return _folded(node, lambda: _UNARY[type(node.op)](node.operand.value))
        return node

    def visit_BoolOp(self, node: ast.BoolOp):
        node = self.generic_visit(node)
        if all(_is_plain(value) for value in node.values):
            values = [value.value for value in node.values]
            return ast.Constant(all(values) if isinstance(node.op, ast.And) else any(values))
        return node

    def visit_Compare(self, node: ast.Compare):
        node = self.generic_visit(node)
        operands = [node.left, *node.comparators]
        if all(_is_plain(item) for item in operands) and all(type(op) in _COMPARE for op in node.ops):
            return _folded(node, lambda: all(_COMPARE[type(op)](a.value, b.value)
                                             for op, a, b in zip(node.ops, operands, operands[1:])))
        return node

    def visit_IfExp(self, node: ast.IfExp):
        node.test = self.visit(node.test)
        if _is_plain(node.test):
            return self.visit(node.body if node.test.value else node.orelse)
        return self.generic_visit(node)

    # -- statements --
    def visit_If(self, node: ast.If):
        node.test = self.visit(node.test)
        if _is_plain(node.test):
            return self._block(node.body if node.test.value else node.orelse) or None
        node.body = self._block(node.body) or [ast.Pass()]
        node.orelse = self._block(node.orelse)
        return node

    def _block(self, statements: list[ast.stmt]) -> list[ast.stmt]:
        kept: list[ast.stmt] = []
        for statement in statements:
            result = self.visit(statement)
            if result is None:
                continue
            if isinstance(result, list):  # a live branch spliced in (bound within as it was visited)
                kept.extend(result)
            else:
                kept.append(result)
                self._bind_once_assigned(result)
        return kept

    def _bind_once_assigned(self, statement: ast.stmt) -> None:
        """A name assigned once in the function from a constant is that constant from here on
        (`ROWS: tl.constexpr = BLOCK_M // 2`, then `if ROWS > 32:`)."""
        if isinstance(statement, ast.AnnAssign) and statement.value is not None:
            target, value = statement.target, statement.value
        elif isinstance(statement, ast.Assign) and len(statement.targets) == 1:
            target, value = statement.targets[0], statement.value
        else:
            return
        if isinstance(target, ast.Name) and self.assigned.get(target.id) == 1 and _is_plain(value):
            self.bindings[target.id] = value.value

    def visit_Call(self, node: ast.Call):
        node = self.generic_visit(node)
        fn = _jit_function(self._global(node.func))
        if fn is not None and not fn.__module__.startswith(LIBRARY_PREFIX):
            self.helpers.update(_helper_texts(fn, node))
        return node


def _folded(node: ast.AST, compute) -> ast.AST:
    try:
        value = compute()
    except Exception:  # noqa: BLE001 (a division by zero in dead code, say: left as written)
        return node
    return ast.Constant(value) if isinstance(value, _PLAIN) else node


def _assignment_counts(function: ast.FunctionDef) -> dict[str, int]:
    counts: dict[str, int] = {}
    for node in ast.walk(function):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            counts[node.id] = counts.get(node.id, 0) + 1
    for arg in function.args.args + function.args.kwonlyargs:
        counts[arg.arg] = counts.get(arg.arg, 0) + 2  # a parameter is never a once-assigned local
    return counts


def _parsed(fn) -> ast.FunctionDef:
    """`fn`'s definition, docstrings and decorators removed: a new tree each call (parsing the
    cached source is several times faster than deep-copying a tree)."""
    tree = ast.parse(_source(fn))
    function = _strip_docstrings(tree).body[0]
    function.decorator_list = []
    return function


@lru_cache(maxsize=None)
def _definition(fn) -> ast.FunctionDef:
    """`_parsed(fn)` to read, never to change (the parameters and their defaults)."""
    return _parsed(fn)


@lru_cache(maxsize=None)
def _source(fn) -> str:
    return textwrap.dedent(inspect.getsource(fn))


def _specialised(fn, bindings: dict[str, Any]) -> tuple[str, dict[tuple, str]]:
    """`fn`'s specialised canonical text and those of the helpers it calls (by (module, name, bindings))."""
    function = _parsed(fn)
    helpers: dict[tuple, str] = {}
    specialiser = _Specialiser(fn, bindings, helpers)
    specialiser.assigned = _assignment_counts(function)
    function.body = specialiser._block(function.body) or [ast.Pass()]
    _drop_bound_parameters(function.args, bindings)
    return canonical(function), helpers


def _drop_bound_parameters(arguments: ast.arguments, bindings: dict[str, Any]) -> None:
    """Removes the parameters bound to constants (their values are in the body now), so a new
    constexpr knob left at its default adds nothing to the text."""
    params = arguments.args
    defaults = dict(zip([p.arg for p in params[len(params) - len(arguments.defaults):]], arguments.defaults))
    arguments.args = [p for p in params if p.arg not in bindings]
    arguments.defaults = [defaults[p.arg] for p in arguments.args if p.arg in defaults]


def _constexpr_bindings(fn, call: ast.Call | None, given: dict[str, Any]) -> dict[str, Any]:
    """The constexpr parameters of `fn` bound to constants: `given` (a launch's constexprs), the
    constant arguments of `call` (a helper's call site), else the parameter's default."""
    function = _definition(fn)
    params = function.args.args
    defaults = dict(zip([p.arg for p in params[len(params) - len(function.args.defaults):]], function.args.defaults))
    passed: dict[str, ast.AST] = {}
    if call is not None:
        passed.update(zip([p.arg for p in params], call.args))
        passed.update({keyword.arg: keyword.value for keyword in call.keywords if keyword.arg})
    bindings = {}
    for param in params:
        if not _is_constexpr(param.annotation):
            continue
        if param.arg in given:
            bindings[param.arg] = given[param.arg]
        elif param.arg in passed:
            if _is_plain(passed[param.arg]):
                bindings[param.arg] = passed[param.arg].value
        elif param.arg in defaults and _is_plain(defaults[param.arg]):
            bindings[param.arg] = defaults[param.arg].value
    return bindings


def _helper_texts(fn, call: ast.Call) -> dict[tuple, str]:
    bindings = _constexpr_bindings(fn, call, {})
    text, helpers = _cached_text(fn, tuple(sorted(bindings.items())))
    return {(fn.__module__, fn.__qualname__, tuple(sorted(bindings.items()))): text, **helpers}


@lru_cache(maxsize=4096)
def _cached_text(fn, bindings: tuple) -> tuple[str, dict[tuple, str]]:
    return _specialised(fn, dict(bindings))


def triton_text(kernel, constexprs: dict[str, Any]) -> str:
    """The specialised source of Triton jit function `kernel` for `constexprs` (its launch's),
    with every jit helper it calls: the kernel's text first, then the helpers' in a fixed order."""
    fn = _jit_function(kernel)
    if fn is None:
        raise TypeError(f"kernel: expected a Triton jit function, got {type(kernel).__name__}")
    values = {name: plain_value(value) if plain_value(value) is not None else str(value)
              for name, value in constexprs.items()}
    bindings = _constexpr_bindings(fn, None, values)
    text, helpers = _cached_text(fn, tuple(sorted(bindings.items())))
    parts = [f"{fn.__module__}.{fn.__qualname__}", text]
    for (module, name, helper_bindings), helper in sorted(helpers.items(), key=lambda item: repr(item[0])):
        parts += [f"{module}.{name} {helper_bindings!r}", helper]
    return "\n".join(parts)


# -- CUDA ------------------------------------------------------------------------------------------

_DIRECTIVE = re.compile(r"#\s*(\w+)\s*(.*)")
_DEFINED = re.compile(r"\bdefined\s*(?:\(\s*(\w+)\s*\)|(\w+))")
_IDENTIFIER = re.compile(r"\b[A-Za-z_]\w*\b")
_INTEGER = re.compile(r"\b(0[xX][0-9a-fA-F]+|\d+)[uUlL]*\b")
_FUNCTION_MACRO = re.compile(r"(\w+)\(")


class PreprocessError(ValueError):
    """A CUDA source uses a preprocessor feature the stamp does not model (the message says which)."""


def _parse_defines(flags) -> dict[str, str]:
    defines = {}
    for flag in flags:
        if not flag.startswith("-D"):
            continue
        name, _, value = flag[2:].partition("=")
        defines[name] = value or "1"
    return defines


def _condition(expression: str, macros: dict[str, str | None], where: str) -> bool:
    """The value of an `#if` expression: `defined`, object-like macros (expanded repeatedly),
    undefined names as 0, C's integer operators."""
    text = _DEFINED.sub(lambda m: "1" if (m.group(1) or m.group(2)) in macros else "0", expression)
    for _ in range(16):  # macros naming macros
        expanded = _IDENTIFIER.sub(lambda m: macros.get(m.group(), "0") or "0", text)
        if expanded == text:
            break
        text = expanded
    if "?" in text or _FUNCTION_MACRO.search(text):
        raise PreprocessError(f"{where}: `#if {expression}` uses a form the stamp does not evaluate")
    python = _INTEGER.sub(lambda m: str(int(m.group(1), 0)), text)
    python = (python.replace("&&", " and ").replace("||", " or ").replace("!=", " __ne__ ")
              .replace("!", " not ").replace(" __ne__ ", "!=").replace("/", "//"))
    try:
        return bool(eval(python, {"__builtins__": {}}, {}))  # noqa: S307 (digits and operators only)
    except Exception as exc:  # noqa: BLE001
        raise PreprocessError(f"{where}: cannot evaluate `#if {expression}` ({exc})") from None


def _normalised_lines(path: Path) -> list[str]:
    """`normalise_c` of a file's text, as lines; read again only when the file changes."""
    stat = path.stat()
    return _normalised_file(path.resolve(), stat.st_mtime_ns, stat.st_size)


@lru_cache(maxsize=64)
def _normalised_file(path: Path, mtime_ns: int, size: int) -> list[str]:
    del mtime_ns, size  # the cache key: a changed file is read again
    return normalise_c(path.read_text(encoding="utf-8")).splitlines()


def _append_code(out: list[str], line: str) -> None:
    """Appends a run of code, joined to a run it directly follows (a dropped directive split
    them) with a space only where `normalise_c` would keep one."""
    if out and not out[-1].startswith("#"):
        out[-1] += (" " if _keeps_space(out[-1][-1], line[0]) else "") + line
    else:
        out.append(line)


def _preprocess(path: Path, macros: dict[str, str | None], once: set[Path], out: list[str], depth: int = 0) -> None:
    if depth > 32:
        raise PreprocessError(f"{path.name}: includes nest deeper than 32")
    # each frame: (this branch is taken, some branch of this #if was taken, the enclosing one is taken)
    stack: list[list[bool]] = []
    active = True
    for line in _normalised_lines(path):
        directive = _DIRECTIVE.match(line) if line.startswith("#") else None
        if directive is None:
            if active:
                _append_code(out, line)
            continue
        name, rest = directive.group(1), directive.group(2).strip()
        where = f"{path.name}: #{name} {rest}"
        if name in ("if", "ifdef", "ifndef"):
            if name == "if":
                taken = active and _condition(rest, macros, where)
            else:
                taken = active and ((rest in macros) == (name == "ifdef"))
            stack.append([taken, taken, active])
        elif name in ("elif", "else"):
            if not stack:
                raise PreprocessError(f"{where}: without #if")
            frame = stack[-1]
            taken = frame[2] and not frame[1] and (name == "else" or _condition(rest, macros, where))
            frame[0], frame[1] = taken, frame[1] or taken
        elif name == "endif":
            if not stack:
                raise PreprocessError(f"{where}: without #if")
            stack.pop()
        elif not active:
            pass
        elif name == "include" and rest.startswith('"'):
            header = path.parent / rest.strip('"')
            if header.resolve() not in once:
                _preprocess(header, macros, once, out, depth + 1)
        elif name == "pragma" and rest == "once":
            once.add(path.resolve())
        else:
            if name == "define":
                match = re.match(r"(\w+)(\(.*?\))?\s*(.*)", rest)
                macros[match.group(1)] = None if match.group(2) else match.group(3)
            elif name == "undef":
                macros.pop(rest, None)
            out.append(line)
        active = all(frame[0] for frame in stack)
    if stack:
        raise PreprocessError(f"{path.name}: #if without #endif")


def cuda_text(source: Path, flags) -> str:
    """The translation unit `source` preprocessed for the -D list `flags` (module docstring), and
    the -D values its remaining text names."""
    defines = _parse_defines(flags)
    macros: dict[str, str | None] = dict(defines)
    lines: list[str] = []
    _preprocess(Path(source), macros, set(), lines)
    text = "\n".join(lines) + "\n"
    names = set(_IDENTIFIER.findall(text))
    named = [f"-D{name}={value}" for name, value in sorted(defines.items()) if name in names]
    return "\n".join([Path(source).name, *named, text])
