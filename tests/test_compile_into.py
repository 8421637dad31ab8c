"""`kernels/compile_into.py`: a compiler's product reaches its target whole or not at all, and a
failure says why in one line."""

import sys

import pytest

from dmattn_kernels.compile_into import CompileFailed, compile_into


def _compiler(script: str, target) -> list[str]:
    """A stand-in compiler: `script` run with the output path as sys.argv[1]."""
    return [sys.executable, "-c", script, str(target)]


def test_the_product_is_renamed_into_place_and_nothing_else_stays(tmp_path):
    target = tmp_path / "module.so"
    assert compile_into(target, _compiler("import sys; open(sys.argv[1], 'w').write('built')", target), 30) == target
    assert target.read_text() == "built"
    assert [path.name for path in tmp_path.iterdir()] == ["module.so"]


def test_a_failed_compiler_leaves_no_target_and_names_its_first_error(tmp_path):
    target = tmp_path / "module.so"
    script = ("import sys; open(sys.argv[1], 'w').write('half');"
              "print('note: before', file=sys.stderr); print('x.cu(3): error: boom', file=sys.stderr); sys.exit(2)")
    with pytest.raises(CompileFailed, match=r"^x\.cu\(3\): error: boom$"):
        compile_into(target, _compiler(script, target), 30)
    assert list(tmp_path.iterdir()) == []


def test_a_compiler_past_its_time_is_stopped_and_leaves_no_target(tmp_path):
    target = tmp_path / "module.so"
    script = "import sys, time; open(sys.argv[1], 'w').write('half'); time.sleep(30)"
    with pytest.raises(CompileFailed, match=r"^timed out after 0\.5 s$"):
        compile_into(target, _compiler(script, target), 0.5)
    assert list(tmp_path.iterdir()) == []
