"""Pruning: search spaces load, the estimate prunes without compiling, cross-compilation for absent
archs reports real shared memory, and a candidate that does not fit is data, not an exception.

Cross-compiles run in spawned workers (a few seconds each on 2 cores): only a handful here.
"""

from __future__ import annotations

import json
import shutil
from concurrent.futures import Future
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from dmattn_bench.cli.compile_check import compile_check
from dmattn_bench.hardware import ARCH_LIMITS
from dmattn_bench.space import ARCH_FAMILIES, CONFIG_CLASSES, AttentionShape, BwdConfig, DecodeConfig, FwdConfig
from dmattn_bench.tuning import prune
from dmattn_bench.tuning.prune import (
    Candidate,
    check_space,
    compile_candidate,
    estimate_shared_bytes,
    load_ci_space,
    load_space,
)

ROOT = Path(__file__).resolve().parents[1]
SPACE_DIR = ROOT / "configs" / "space"
SMALL_FWD = FwdConfig(block_m=64, block_n=32, num_warps=4, num_stages=2)


@pytest.mark.parametrize("direction", ["fwd", "bwd", "decode"])
@pytest.mark.parametrize("section", ARCH_FAMILIES)
def test_shipped_spaces_load(direction, section):
    configs = load_space(SPACE_DIR / f"triton-{direction}.yaml", "triton", direction, section)
    assert configs
    assert all(isinstance(c, CONFIG_CLASSES[direction]) for c in configs)
    assert len(set(configs)) == len(configs)


@pytest.mark.parametrize("direction", ["fwd", "bwd", "decode"])
def test_ci_space_loads(direction):
    assert load_ci_space(ROOT / "configs" / "ci.yaml", "triton", direction)


def test_malformed_space_names_file_and_section(tmp_path):
    path = tmp_path / "triton-fwd.yaml"
    path.write_text(yaml.safe_dump({"backend": "triton", "direction": "fwd", "arch": {
        "sm90": {"block_m": [64], "block_n": [0], "num_warps": [4], "num_stages": [2]}}}))
    with pytest.raises(ValueError, match=rf"{path}.*arch\.sm90.*block_n"):
        load_space(path, "triton", "fwd", "sm90")
    with pytest.raises(ValueError, match=rf"{path}.*sm80"):
        load_space(path, "triton", "fwd", "sm80")
    with pytest.raises(ValueError, match=rf"{path}.*direction"):
        load_space(path, "triton", "bwd", "sm90")


def test_estimate_prunes_absurd_config_without_compiling(monkeypatch):
    def no_compiling(*args, **kwargs):
        raise AssertionError("compiled a candidate the estimate should have pruned")

    monkeypatch.setattr(prune, "_compile_all", no_compiling)
    absurd = FwdConfig(block_m=256, block_n=256, num_warps=8, num_stages=8)
    [candidate] = check_space({"fwd": [absurd]}, ["sm120"], [256], "bf16")
    assert candidate.status == "unsupported" and candidate.check == "estimate"
    assert candidate.shared_bytes == estimate_shared_bytes("fwd", absurd, 256, 2)
    assert candidate.shared_bytes > ARCH_LIMITS["sm120"].shared_memory_per_block
    assert "sm120" in candidate.reason


def test_structural_prune_without_compiling(monkeypatch):
    monkeypatch.setattr(prune, "_compile_all", None)
    [candidate] = check_space({"fwd": [FwdConfig(48, 32, 4, 2)]}, ["sm90"], [64])
    assert candidate.status == "unsupported" and "block_m=48" in candidate.reason


def test_cross_compile_fits_for_sm90_and_sm80():
    seen = []
    results = check_space({"fwd": [SMALL_FWD]}, ["sm90", "sm80"], [64], "bf16", jobs=2, on_result=seen.append)
    assert [c.arch for c in results] == ["sm90", "sm80"]
    assert len(seen) == 2
    for candidate in results:
        assert candidate.status == "fits", candidate.reason
        assert 0 < candidate.shared_bytes <= ARCH_LIMITS[candidate.arch].shared_memory_per_block
        assert candidate.compile_s > 0


def test_cross_compile_backward_in_every_mode():
    """The backward's kernels compile for sm90 in every feature variant, the dK/dV kernel's group
    mode (a GQA dBias with query rows) included, and only that kernel takes the group variant."""
    group_variant = next(v for v in prune.FEATURE_VARIANTS if v["HEADS_PER_PROGRAM"] > 1)
    served = [fn.__name__ for fn in prune._kernel_functions("bwd") if prune._serves(fn, group_variant)]
    assert served == ["flash_bwd_dkdv_kernel"]
    config = BwdConfig(block_m=32, block_n=64, block_m_dq=64, block_n_dq=32, num_warps=4, num_stages=2)
    candidate = compile_candidate("bwd", config, "sm90", 64, "bf16")
    assert candidate.status == "fits", candidate.reason
    assert 0 < candidate.shared_bytes <= ARCH_LIMITS["sm90"].shared_memory_per_block


def test_the_short_query_forward_cross_compiles_paged_and_contiguous_for_sm80_and_sm120():
    """compile-check covers the decode space: the short-query forward's kernel in the variants
    it serves (paged and contiguous, with and without a mask; not the backward's group mode)."""
    decode_variants = [v for v in prune.FEATURE_VARIANTS if prune._serves(prune._kernel_functions("decode")[0], v)]
    assert {(v["PAGED"], v["HAS_MASK"]) for v in decode_variants} == {(True, True), (True, False), (False, True)}
    results = check_space({"decode": [DecodeConfig(64, 4, 2, 0)]}, ["sm80", "sm120"], [128], "bf16", jobs=2)
    for candidate in results:
        assert candidate.status == "fits", candidate.reason
        assert 0 < candidate.shared_bytes <= ARCH_LIMITS[candidate.arch].shared_memory_per_block


def test_real_shared_memory_over_limit_is_data():
    # Unmasked, the key loop is pipelined: 3 stages of k, v and an fp32 bias tile pass the
    # estimate (a lower bound) but exceed sm120's 99 KiB once compiled.
    config = FwdConfig(block_m=128, block_n=64, num_warps=8, num_stages=3)
    limit = ARCH_LIMITS["sm120"].shared_memory_per_block
    assert estimate_shared_bytes("fwd", config, 128, 2) <= limit
    candidate = compile_candidate("fwd", config, "sm120", 128, "bf16", features={"HAS_MASK": False})
    assert isinstance(candidate, Candidate)
    assert candidate.status == "unsupported" and candidate.check == "shared", candidate.reason
    assert candidate.shared_bytes > limit
    assert "limit of sm120" in candidate.reason


def test_failed_worker_is_a_compile_error():
    future = Future()
    future.set_exception(RuntimeError("long compiler message\nerror: the last line says why"))
    candidate = prune._run_guarded(future, "fwd", SMALL_FWD, "sm90", 64, "bf16")
    assert candidate.status == "compile_error"
    assert candidate.reason == "RuntimeError: error: the last line says why"


def test_cli_json_on_tiny_space(tmp_path):
    space = {"backend": "triton", "direction": "fwd", "arch": {
        "sm90": {"block_m": [64], "block_n": [32, 64], "num_warps": [4], "num_stages": [2]}}}
    (tmp_path / "triton-fwd.yaml").write_text(yaml.safe_dump(space))  # no bwd file: fwd only
    result = CliRunner().invoke(compile_check, ["--arch", "sm90", "--head-dim", "64", "--space-dir", str(tmp_path),
                                                "--format", "json", "--jobs", "2"])
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    assert len(document["candidates"]) == 2
    assert {c["status"] for c in document["candidates"]} == {"fits"}
    assert document["summary"][0]["candidates"] == 2


def test_cli_rejects_unknown_arch_and_a_dtype_the_cuda_kernels_lack(tmp_path):
    result = CliRunner().invoke(compile_check, ["--arch", "sm75"])
    assert result.exit_code == 2 and "sm75" in result.output
    result = CliRunner().invoke(compile_check, ["--arch", "sm90", "--backend", "cuda", "--dtype", "fp32"])
    assert result.exit_code == 2 and "bf16 or fp16, got fp32" in result.output


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
def test_cli_compile_checks_the_cuda_space(tmp_path, monkeypatch):
    monkeypatch.setenv("DMATTN_BENCH_CACHE", str(tmp_path / "cache"))
    (tmp_path / "cuda-fwd.yaml").write_text(
        "backend: cuda\ndirection: fwd\narch:\n  sm90:\n    block_m: [64, 128, 256]\n    block_n: [64]\n"
        "    num_warps: [4]\n    num_stages: [2]\n")
    (tmp_path / "cuda-bwd.yaml").write_text(
        "backend: cuda\ndirection: bwd\narch:\n  sm90:\n    block_m: [32]\n    block_n: [64, 128]\n"
        "    block_m_dq: [64]\n    block_n_dq: [32]\n    num_warps: [4]\n    num_stages: [2]\n")
    result = CliRunner().invoke(compile_check, ["--arch", "sm90", "--backend", "cuda", "--space-dir", str(tmp_path),
                                                "--head-dim", "64", "--format", "json"])
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    assert document["backend"] == "cuda"
    assert [(c["direction"], c["config"]["block_m"], c["config"]["block_n"], c["status"])
            for c in document["candidates"]] == [("fwd", 64, 64, "fits"), ("fwd", 128, 64, "fits"),
                                                 ("fwd", 256, 64, "unsupported"),  # 16 or 32 rows per warp
                                                 ("bwd", 32, 64, "fits"), ("bwd", 32, 128, "unsupported")]


def test_every_launch_specialization_is_compiled():
    # 16-divisible lengths and a 16-bit bias are their own specializations: the fit is judged on
    # each (a config that fit at seqlen_k 1000 ran out of shared memory at 1024 on an H200)
    class Kernel:
        __name__ = "kernel"
        arg_names = ["q_ptr", "bias_ptr", "seqlen_k", "stride_qm", "BLOCK_N"]

    with_bias = dict(prune.WORST_CASE_FEATURES, HAS_BIAS=True)
    specs = prune._specializations(with_bias, "bf16")
    assert {(s["ints_aligned"], s["bias_fp32"]) for s in specs} == {(a, f) for a in (False, True) for f in (False, True)}
    assert all(s["bias_fp32"] for s in prune._specializations(dict(with_bias, HAS_BIAS=False), "bf16"))
    seqlen_k = (Kernel.arg_names.index("seqlen_k"),)
    aligned = prune._source(Kernel, "bf16", {"BLOCK_N": 64}, ints_aligned=True, bias_fp32=False)
    unaligned = prune._source(Kernel, "bf16", {"BLOCK_N": 64}, ints_aligned=False, bias_fp32=True)
    assert aligned.attrs[seqlen_k] == [["tt.divisibility", 16]] and seqlen_k not in unaligned.attrs
    assert aligned.signature["bias_ptr"] == "*bf16" and unaligned.signature["bias_ptr"] == "*fp32"


class _FakeCompiled:
    def __init__(self, shared: int):
        self.metadata = type("Metadata", (), {"shared": shared})()
        self.asm = {}


def _fake_compile_bias_sized(compiled_block_n: list):
    """A `triton.compile` stand-in: shared memory of 1000 B per key of BLOCK_N, twice that with
    an fp32 bias (as a pipelined fp32 bias tile doubles its buffers)."""
    def fake(source, target, options):
        del target, options
        block_n = source.constants[(source.fn.arg_names.index("BLOCK_N"),)]
        fp32 = source.signature.get("bias_ptr") == "*fp32"
        compiled_block_n.append((block_n, fp32))
        return _FakeCompiled(block_n * 1000 * (2 if fp32 else 1))
    return fake


def test_an_fp32_bias_fits_a_forward_config_with_halved_key_tiles(monkeypatch):
    """The forward's fp32-bias specializations are checked at the key tiles the launcher falls
    back to (`dmattn_bench.tiles.fit_forward`); the config's own tiles for everything else."""
    import triton

    seen = []
    monkeypatch.setattr(triton, "compile", _fake_compile_bias_sized(seen))
    limit = ARCH_LIMITS["sm90"].shared_memory_per_block
    block_n = 128  # 128 000 B with a 16-bit bias, 256 000 B with an fp32 one: over the sm90 limit
    assert 2 * block_n * 1000 > limit >= block_n * 1000
    candidate = prune._compile_here("fwd", FwdConfig(64, block_n, 4, 2), "sm90", 64, "bf16", None)
    assert candidate.status == "fits", candidate.reason
    assert candidate.shared_bytes == block_n * 1000
    assert (block_n, True) in seen and (block_n // 2, True) in seen
    assert all(n == block_n for n, fp32 in seen if not fp32)


def test_the_backward_has_no_fp32_bias_fallback(monkeypatch):
    import triton

    monkeypatch.setattr(triton, "compile", _fake_compile_bias_sized([]))
    candidate = prune._compile_here("bwd", BwdConfig(32, 128, 64, 128, 4, 2), "sm90", 64, "bf16", None)
    assert candidate.status == "unsupported" and candidate.check == "shared", candidate.reason


def test_the_tiles_prune_compiles_are_those_the_plans_give_their_kernels():
    """`launch.tile_constexprs` (what prune compiles and `launch.kernel_keys` keys) against the
    plans' own launches: the same tiles per kernel; the short-query forward's rows at most the
    most it packs."""
    import torch

    from dmattn_kernels.triton.backward import BackwardPlan
    from dmattn_kernels.triton.decode_launch import DecodePlan
    from dmattn_kernels.triton.forward import ForwardPlan
    from dmattn_kernels.triton.launch import KERNELS, kernel_keys, tile_constexprs

    q, k = torch.zeros(1, 64, 4, 32), torch.zeros(1, 64, 2, 32)
    mask, bias = torch.ones(1, 4, 64, 64, dtype=torch.bool), torch.zeros(1, 4, 64, 64)
    options = dict(is_causal=True, softmax_scale=1.0, softcap=0.0)
    lse = torch.zeros(1, 4, 64)
    fwd, bwd, decode = FwdConfig(32, 64, 4, 2), BwdConfig(16, 32, 64, 16, 4, 1), DecodeConfig(32, 4, 2, 0)
    forward = ForwardPlan(q, k, k, mask, bias, config=fwd, out=q, lse=lse, **options)
    grads = dict(dq=q, dk=k, dv=k, dlse=None)
    backward = BackwardPlan(q, q, k, k, q, lse, mask, bias, config=bwd, dbias=torch.zeros(1, 4, 64, 64), **grads,
                            **options)  # dBias stored whole: the dQ from dS kernel
    dq_plain = BackwardPlan(q, q, k, k, q, lse, mask, bias, config=bwd, dbias=None, **grads, **options)
    short = DecodePlan(q[:, :2], k, k, mask[..., :2, :], None, None, None, config=decode, out=q[:, :2],
                       lse=lse[..., :2], num_sms=4, **options)
    launches = {launch.name: launch for launch in (forward.forward, *backward.launches, *dq_plain.launches,
                                                   *short._launches())}
    for direction, config in (("fwd", fwd), ("bwd", bwd), ("decode", decode)):
        for name in KERNELS[direction]:
            constexprs = launches[name].constexprs
            for tile, value in tile_constexprs(name, config).items():
                assert constexprs[tile] <= value if (name, tile) == ("flash_decode_kernel", "BLOCK_M") \
                    else constexprs[tile] == value, (name, tile)
    shape = AttentionShape(1, 64, 64, 4, 2, 32, is_causal=True, has_mask=True, has_bias=True)
    assert [key[0] for key in kernel_keys("bwd", bwd, shape)] == ["tile_activity_kernel", "flash_bwd_preprocess_kernel",
                                                                  *KERNELS["bwd"]]
