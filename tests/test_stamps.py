"""Entry stamps: the specialised kernel texts they hash (`specialise`) and what changes a stamp
(`stamps`). Nothing here runs a kernel: the texts come from the sources, the stamps from plans
built on data-less tensors."""

import itertools
import os
import re
import subprocess
import sys

import pytest
import triton
import triton.language as tl

from dmattn_bench import specialise
from dmattn_bench.dispatch import stamps
from dmattn_bench.dispatch.table import LEGACY_PREFIX, Entry, Validation
from dmattn_bench.hardware import CPU_FINGERPRINT, DeviceFingerprint
from dmattn_bench.registry import kernel_source_hash
from dmattn_bench.space import FwdConfig, TableKey

# Markers: each branch of the kernels below adds its own constant, so a text shows which it kept.
# They are module constants as Triton kernels use them (`tl.constexpr` globals): the text puts them in.
FLAG_ON = tl.constexpr(101)
FLAG_OFF = tl.constexpr(102)
WIDE = tl.constexpr(201)
NARROW = tl.constexpr(202)
KNOB_ON = tl.constexpr(301)
EDITED = tl.constexpr(103)


@triton.jit
def _scale(x, FACTOR: tl.constexpr):
    if FACTOR > 1:
        x = x * FACTOR
    return x


@triton.jit
def _kernel(x_ptr, FLAG: tl.constexpr, BLOCK: tl.constexpr):
    x = tl.load(x_ptr)
    if FLAG:
        x = x + FLAG_ON
    else:
        x = x - FLAG_OFF
    if BLOCK * 2 > 64:
        x = _scale(x, 4) + WIDE
    else:
        x = _scale(x, 1) + NARROW
    tl.store(x_ptr, x)


@triton.jit
def _kernel_commented(x_ptr, FLAG: tl.constexpr,
                      BLOCK: tl.constexpr):
    """`_kernel` with a docstring, comments and other formatting."""
    x = tl.load(x_ptr)  # -- load --

    # -- the flag's branch --
    if FLAG:
        x = (x + FLAG_ON)
    else:
        x = x - FLAG_OFF  # the other one
    if BLOCK * 2 > 64:  # wide tiles
        x = _scale(x, 4) + WIDE
    else:
        x = _scale(x, 1) + NARROW

    tl.store(x_ptr, x)  # epilogue


@triton.jit
def _kernel_with_knob(x_ptr, FLAG: tl.constexpr, BLOCK: tl.constexpr, KNOB: tl.constexpr = False):
    x = tl.load(x_ptr)
    if FLAG:
        x = x + FLAG_ON
    else:
        x = x - FLAG_OFF
    if KNOB:
        x = x * KNOB_ON
    if BLOCK * 2 > 64:
        x = _scale(x, 4) + WIDE
    else:
        x = _scale(x, 1) + NARROW
    tl.store(x_ptr, x)


@triton.jit
def _kernel_edited(x_ptr, FLAG: tl.constexpr, BLOCK: tl.constexpr):
    x = tl.load(x_ptr)
    if FLAG:
        x = x + EDITED
    else:
        x = x - FLAG_OFF
    if BLOCK * 2 > 64:
        x = _scale(x, 4) + WIDE
    else:
        x = _scale(x, 1) + NARROW
    tl.store(x_ptr, x)


VARIANTS = [dict(FLAG=flag, BLOCK=block) for flag, block in itertools.product((False, True), (16, 64))]


def has(text: str, marker) -> bool:
    return f"Constant(value={marker.value!r})" in text


def anonymous(text: str, name: str) -> str:
    """`text` with the kernel's own name taken out (two kernels of one module must have two names)."""
    return re.sub(rf"\b{name}\b", "KERNEL", text)


def same_text(a, b, constexprs: dict) -> bool:
    return (anonymous(specialise.triton_text(a, constexprs), a.fn.__name__)
            == anonymous(specialise.triton_text(b, constexprs), b.fn.__name__))


# -- Triton ----------------------------------------------------------------------------------------

def test_a_constexpr_flag_keeps_only_its_live_branch():
    on = specialise.triton_text(_kernel, dict(FLAG=True, BLOCK=16))
    off = specialise.triton_text(_kernel, dict(FLAG=False, BLOCK=16))
    assert has(on, FLAG_ON) and not has(on, FLAG_OFF)
    assert has(off, FLAG_OFF) and not has(off, FLAG_ON)
    for text in (on, off):  # bound parameters leave the signature; their names leave the body
        assert "'FLAG'" not in text and "'BLOCK'" not in text and "'x_ptr'" in text


@pytest.mark.parametrize("block, wide", [(16, False), (32, False), (33, True), (64, True)])
def test_a_constant_condition_is_folded(block, wide):
    text = specialise.triton_text(_kernel, dict(FLAG=True, BLOCK=block))
    assert has(text, WIDE) == wide and has(text, NARROW) == (not wide)
    assert "Compare(" not in text  # `BLOCK * 2 > 64` and the helper's `FACTOR > 1` are gone


def test_a_called_helper_is_specialised_per_its_constant_arguments():
    wide = specialise.triton_text(_kernel, dict(FLAG=True, BLOCK=64))
    narrow = specialise.triton_text(_kernel, dict(FLAG=True, BLOCK=16))
    # each text carries the helper as called from its live branch only
    assert "_scale (('FACTOR', 4),)" in wide and "('FACTOR', 1)" not in wide
    assert "_scale (('FACTOR', 1),)" in narrow and "('FACTOR', 4)" not in narrow
    # specialised: with FACTOR 1 the helper's multiply is dead code, with 4 it is folded in
    assert "Mult()" not in narrow
    helper = wide.split("_scale (('FACTOR', 4),)\n", 1)[1]
    assert "Mult()" in helper and "Constant(value=4)" in helper and "'FACTOR'" not in helper


@pytest.mark.parametrize("constexprs", VARIANTS)
def test_comments_docstrings_and_formatting_do_not_change_the_text(constexprs):
    assert same_text(_kernel, _kernel_commented, constexprs)


@pytest.mark.parametrize("constexprs", VARIANTS)
def test_a_new_constexpr_knob_left_at_its_default_changes_nothing(constexprs):
    assert same_text(_kernel, _kernel_with_knob, constexprs)  # not passed: its default
    assert same_text(_kernel, _kernel_with_knob, dict(constexprs, KNOB=False))  # passed as off
    assert not same_text(_kernel, _kernel_with_knob, dict(constexprs, KNOB=True))
    assert has(specialise.triton_text(_kernel_with_knob, dict(constexprs, KNOB=True)), KNOB_ON)


@pytest.mark.parametrize("constexprs", VARIANTS)
def test_an_edit_in_a_branch_changes_only_the_variants_that_run_it(constexprs):
    assert same_text(_kernel, _kernel_edited, constexprs) == (not constexprs["FLAG"])


def test_a_function_that_is_not_jit_is_refused():
    with pytest.raises(TypeError, match="expected a Triton jit function"):
        specialise.triton_text(_kernel.fn, dict(FLAG=True, BLOCK=16))


# -- CUDA ------------------------------------------------------------------------------------------

HEADER = """\
#pragma once
// included twice by main.cu: inlined once
__device__ float from_header(float x) { return x; }
"""

SOURCE = """\
// a translation unit of three variants
#include "h.cuh"
#include "h.cuh"
#include <cuda_fp16.h>

#ifndef TILE
#define TILE 64
#endif

#if FAST && TILE >= 64
__device__ float body(float x) { return fast_path(from_header(x), TILE); }
#elif defined(FAST) && FAST
__device__ float body(float x) { return narrow_path(x, TILE); }
#else
__device__ float body(float x) { return slow_path(x, WIDTH); }
#endif
"""

# SOURCE with other comments, blank lines and spacing: the same code
SOURCE_REFORMATTED = """\
/* a translation unit,
   reformatted */
#include "h.cuh"
#include "h.cuh"   // twice
#include <cuda_fp16.h>
#ifndef TILE
#define TILE 64  // the default tile
#endif


#if FAST && TILE >= 64
__device__ float body(float x) {
    return fast_path(from_header(x), TILE);  // the fast one
}
#elif defined(FAST) && FAST
__device__ float body(float x)   { return narrow_path( x, TILE ); }
#else
__device__ float
body(float x) { return slow_path(x, WIDTH); }
#endif
"""


@pytest.fixture
def unit(tmp_path):
    (tmp_path / "h.cuh").write_text(HEADER)
    path = tmp_path / "main.cu"
    path.write_text(SOURCE)
    return path


@pytest.mark.parametrize("flags, path", [
    ([], "slow_path"),
    (["-DFAST=0"], "slow_path"),
    (["-DFAST=1"], "fast_path"),
    (["-DFAST"], "fast_path"),  # a bare -D is 1
    (["-DFAST=1", "-DTILE=32"], "narrow_path"),
    (["-DFAST=1", "-DTILE=128"], "fast_path"),
])
def test_the_branches_of_if_follow_the_defines(unit, flags, path):
    text = specialise.cuda_text(unit, flags)
    taken = {name for name in ("fast_path", "narrow_path", "slow_path") if name in text}
    assert taken == {path}
    assert not any(line.startswith(("#if", "#elif", "#else", "#endif")) for line in text.splitlines())


def test_ifndef_gives_a_default_that_a_define_overrides(unit):
    default = specialise.cuda_text(unit, ["-DFAST=1"])
    assert "#define TILE 64" in default.splitlines()
    given = specialise.cuda_text(unit, ["-DFAST=1", "-DTILE=128"])
    assert "#define TILE 64" not in given and "-DTILE=128" in given.splitlines()


def test_a_pragma_once_header_is_inlined_once(unit):
    text = specialise.cuda_text(unit, ["-DFAST=1"])
    assert text.count("from_header(float x)") == 1
    assert '#include "h.cuh"' not in text and "#pragma once" not in text
    assert "#include <cuda_fp16.h>" in text.splitlines()  # the toolkit's headers stay as lines


@pytest.mark.parametrize("flags", [[], ["-DFAST=1"], ["-DFAST=1", "-DTILE=32"], ["-DWIDTH=8"]])
def test_comments_and_whitespace_do_not_change_the_text(unit, flags):
    before = specialise.cuda_text(unit, flags)
    unit.write_text(SOURCE_REFORMATTED)
    (unit.parent / "h.cuh").write_text(HEADER.replace("// included twice by main.cu: inlined once",
                                                      "/* a header */\n\n"))
    assert specialise.cuda_text(unit, flags) == before


@pytest.mark.parametrize("flags, same_as", [
    (["-DFAST=1", "-DUNUSED=7"], ["-DFAST=1"]),  # named nowhere
    (["-DFAST=2"], ["-DFAST=1"]),  # named only by the #if it decided
    (["-DFAST=1", "-DWIDTH=8"], ["-DFAST=1"]),  # named only in a branch not taken
    (["-DUNUSED=1", "-DWIDTH=8"], ["-DWIDTH=8"]),
])
def test_a_define_the_remaining_text_does_not_name_changes_nothing(unit, flags, same_as):
    assert specialise.cuda_text(unit, flags) == specialise.cuda_text(unit, same_as)


@pytest.mark.parametrize("flags, other", [
    (["-DWIDTH=8"], ["-DWIDTH=16"]),  # WIDTH is named in the slow path
    (["-DWIDTH=8"], []),
    (["-DFAST=1", "-DTILE=128"], ["-DFAST=1", "-DTILE=256"]),  # TILE is named in the fast path
])
def test_a_define_the_remaining_text_names_changes_it(unit, flags, other):
    text = specialise.cuda_text(unit, flags)
    assert text != specialise.cuda_text(unit, other)
    assert flags[-1] in text.splitlines()


@pytest.mark.parametrize("condition", ["FAST ? 1 : 0", "TILE > 32 ? FAST : 0", "MAX(FAST, 1)"])
def test_an_if_the_stamp_cannot_evaluate_is_an_error(tmp_path, condition):
    path = tmp_path / "bad.cu"
    path.write_text(f"#if {condition}\nint a;\n#endif\n")
    with pytest.raises(specialise.PreprocessError, match="does not evaluate"):
        specialise.cuda_text(path, ["-DFAST=1", "-DTILE=64"])


@pytest.mark.parametrize("text, says", [("#if 1\nint a;\n", "without #endif"), ("int a;\n#endif\n", "without #if")])
def test_unbalanced_conditionals_are_an_error(tmp_path, text, says):
    path = tmp_path / "bad.cu"
    path.write_text(text)
    with pytest.raises(specialise.PreprocessError, match=says):
        specialise.cuda_text(path, [])


# -- entry stamps -----------------------------------------------------------------------------------

KEY = TableKey("fwd", "bf16", 64, True, "full", "full", 1, 1024, 1024)
CONFIG = FwdConfig(64, 64, 4, 2)
SMS = 132
STAMP_PATTERN = r"sha256:[0-9a-f]{32}"


def _clear_caches():
    stamps.entry_stamp.cache_clear()
    stamps.program_digest.cache_clear()
    specialise._cached_text.cache_clear()
    specialise._source.cache_clear()


def test_an_entry_stamp_is_deterministic_within_and_across_processes():
    stamp = stamps.entry_stamp("triton", KEY, CONFIG, "sm90", SMS)
    assert re.fullmatch(STAMP_PATTERN, stamp)
    _clear_caches()
    assert stamps.entry_stamp("triton", KEY, CONFIG, "sm90", SMS) == stamp
    probe = ("from dmattn_bench.dispatch.stamps import entry_stamp\n"
             "from dmattn_bench.space import FwdConfig, TableKey\n"
             f"print(entry_stamp('triton', {KEY!r}, {CONFIG!r}, 'sm90', {SMS}))")
    # another process takes the same stamp: one with its own string hashes (set and dict orders),
    # and with Triton's jit functions instead of the interpreter's (as on a GPU)
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    env["PYTHONHASHSEED"] = "1" if os.environ.get("PYTHONHASHSEED") != "1" else "2"
    printed = subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, text=True, env=env)
    assert printed.stdout.strip() == stamp


def test_the_tma_path_of_sm90_has_its_own_stamp():
    def uses_tma(arch):
        return {dict(program.parameters)["USE_TMA"] for _, programs in stamps.entry_programs("triton", KEY, CONFIG,
                                                                                             arch, SMS)
                for program in programs if program.name == "flash_fwd_kernel"}

    assert uses_tma("sm90") == {True} and uses_tma("sm80") == {False}
    assert stamps.entry_stamp("triton", KEY, CONFIG, "sm90", SMS) != stamps.entry_stamp("triton", KEY, CONFIG,
                                                                                         "sm80", SMS)


@pytest.mark.parametrize("other", [FwdConfig(64, 32, 4, 2), FwdConfig(128, 64, 4, 2), FwdConfig(64, 64, 8, 2),
                                   FwdConfig(64, 64, 4, 3)])
def test_another_config_has_another_stamp(other):
    assert stamps.entry_stamp("triton", KEY, other, "sm90", SMS) != stamps.entry_stamp("triton", KEY, CONFIG,
                                                                                       "sm90", SMS)


def test_representative_calls_cover_softcap_bias_dtypes_and_an_odd_length():
    calls = stamps.representative_calls(KEY)
    assert {(c.seqlen_k, c.softcap, c.bias_fp32) for c in calls} == set(itertools.product(
        (1024, 1025), (False, True), (False, True)))
    no_bias = stamps.representative_calls(TableKey("fwd", "bf16", 64, True, "none", "none", 1, 1024, 1024))
    assert {c.bias_fp32 for c in no_bias} == {False} and {c.softcap for c in no_bias} == {False, True}
    backward = stamps.representative_calls(TableKey("bwd", "bf16", 64, True, "none", "full+grad", 1, 1024, 1024))
    assert {c.lse_grad for c in backward} == {False, True} and {c.bias_fp32 for c in backward} == {False, True}
    assert len(calls) == len(set(calls))


TINY = TableKey("fwd", "fp32", 16, False, "none", "none", 1, 16, 16)
TINY_CONFIG = FwdConfig(16, 16, 1, 1)
DATE = "2025-01-01T00:00:00+00:00"


@pytest.mark.parametrize("validated, stale, status", [
    ("stamp", None, "current"),
    ("sha256:" + "0" * 32, None, "stale"),  # validated on other code
    (None, None, "unvalidated"),
    ("stamp", "declared: its GPU was away", "stale"),  # declared stale wins over a matching stamp
    (LEGACY_PREFIX + "installed", None, "current"),  # a schema-2 validation on these sources
    (LEGACY_PREFIX + "sha256:" + "0" * 32, None, "stale"),
])
def test_entry_status(validated, stale, status):
    entry = Entry(TINY, "triton", TINY_CONFIG, {})
    if validated == "stamp":
        validated = stamps.stamp_of(entry, CPU_FINGERPRINT)
    elif validated == LEGACY_PREFIX + "installed":
        validated = LEGACY_PREFIX + kernel_source_hash("triton")
    entry = Entry(TINY, "triton", TINY_CONFIG, {}, None,
                  None if validated is None else Validation(validated, DATE, "full"), stale)
    assert stamps.entry_status(entry, CPU_FINGERPRINT) == status


def test_a_stamp_is_of_its_tables_device():
    """An entry validated on the interpreter is not current in a table of an H100: its code there
    is another (sm90's), so its stamp is another."""
    entry = Entry(TINY, "triton", TINY_CONFIG, {})
    h100 = DeviceFingerprint("NVIDIA H100 80GB HBM3", "9.0", 132, 232448)
    validated = Entry(TINY, "triton", TINY_CONFIG, {}, None,
                      Validation(stamps.stamp_of(entry, CPU_FINGERPRINT), DATE, "full"))
    assert stamps.entry_status(validated, CPU_FINGERPRINT) == "current"
    assert stamps.entry_status(validated, h100) == "stale"
    assert stamps.arch_of_table("9.0") == "sm90" and stamps.arch_of_table("12.0") == "sm120"
