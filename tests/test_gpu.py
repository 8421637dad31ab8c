"""GPU tier: the full adversarial suite (DESIGN §2 sizes, both seed cases) in bf16 and fp16 on
three tile configurations per direction of each kernel backend (triton, cuda), and the autograd
wrapper at a realistic size through each.

Run on a CUDA machine with `DMATTN_TEST_GPU=1 python -m pytest -m gpu --junitxml=gpu.xml` (add
`-n 8` with pytest-xdist to compile the configs in parallel); the junit report carries each
config's worst error-to-bound ratio per tensor. Skipped without CUDA.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from dmattn_bench import flash_dmattn_func
from dmattn_bench.registry import get_backend
from dmattn_bench.space import BwdConfig, FwdConfig
from dmattn_bench.tiles import default_configs
from dmattn_bench.tuning.adversarial import Case, adversarial_cases, build_inputs
from dmattn_bench.tuning.validator import (check_case, compare, config_suite, config_tiles, grouped_for, run_kernel,
                                          run_reference, shape_of_case, validate)

pytestmark = pytest.mark.gpu

# Three tile shapes per direction and backend. Triton: square 64-tiles, tall 128x32 forward with
# 8 warps and wide-key backward, and small 32-tiles that fit every head dim up to 256. CUDA (a
# warp owns 16 rows): the largest 8-warp forward and 64-tiles, the 1-stage defaults that fit
# 99 KiB, and 2-warp 32-row tiles with 3-stage rings.
GPU_CONFIGS = {
    "fwd64x64-bwd32x64": ("triton", FwdConfig(64, 64, 4, 2), BwdConfig(32, 64, 64, 32, 4, 1)),
    "fwd128x32-bwd64x32": ("triton", FwdConfig(128, 32, 8, 2), BwdConfig(64, 32, 32, 64, 8, 1)),
    "fwd32x32-bwd16x32": ("triton", FwdConfig(32, 32, 4, 1), BwdConfig(16, 32, 32, 16, 4, 1)),
    # two m16 tiles per warp in the forward (block_m = 32 x num_warps), one in the others
    "cuda-fwd128x64w4-bwd64x64": ("cuda", FwdConfig(128, 64, 4, 2), BwdConfig(64, 64, 64, 64, 4, 2)),
    "cuda-fwd64x32-bwd16x64": ("cuda", FwdConfig(64, 32, 4, 1), BwdConfig(16, 64, 64, 16, 4, 1)),
    "cuda-fwd32x32-bwd32x32": ("cuda", FwdConfig(32, 32, 2, 3), BwdConfig(32, 32, 32, 16, 2, 3)),
}
SEED_CASES = {"seed_long_window_bf16", "seed_short_causal"}
LARGE_HEAD_DIM = 128  # above this a tile may not fit shared memory: "unsupported" is allowed


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("config", list(GPU_CONFIGS), ids=list(GPU_CONFIGS))
def test_full_suite(dtype, config, record_property):
    backend, fwd, bwd = GPU_CONFIGS[config]
    result = validate(backend, fwd, bwd, dtype, "cuda", suite="full")
    # lands in the junit report (`--junitxml`): the evidence for the resolution note
    record_property("worst_ratios", {k: round(v, 4) for k, v in result.worst_ratios().items()})
    record_property("cases_ok", sum(c.status == "ok" for c in result.cases))
    failures = [f"{c.case}: {c.status} {c.reason}" for c in result.cases
                if c.status not in ("ok", "unsupported")]
    assert not failures, "\n".join(failures)
    cases = {c.name: c for c in adversarial_cases("full", config_tiles(fwd, bwd))}
    unsupported = [c for c in result.cases if c.status == "unsupported"]
    assert all(cases[c.case].head_dim > LARGE_HEAD_DIM for c in unsupported), \
        [f"{c.case}: {c.reason}" for c in unsupported]
    passed = {c.case for c in result.cases if c.status == "ok"}
    assert SEED_CASES <= passed
    assert all(ratio <= 1.0 for ratio in result.worst_ratios().values())


# CUDA configs whose kernels run wgmma on SM90 (`dmattn_kernels.cuda.uses_wgmma`) where the head dim pads to a
# multiple of 64; most suite cases use head dim 32, which runs mma.sync.
WGMMA_PAIRS = {
    "fwd128x128w8-bwd64x128": (FwdConfig(128, 128, 8, 2), BwdConfig(64, 128, 128, 64, 8, 2)),
    "fwd64x64w4-bwd32x64": (FwdConfig(64, 64, 4, 2), BwdConfig(32, 64, 64, 32, 4, 2)),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("pair", list(WGMMA_PAIRS), ids=list(WGMMA_PAIRS))
def test_full_suite_at_the_head_dims_wgmma_runs(dtype, pair, record_property):
    """Every case of the full suite again at head dims 64, 120 (padded to 128) and 128, where the
    SM90 kernels run wgmma."""
    from dmattn_kernels.cuda import arch_of, uses_wgmma

    fwd, bwd = WGMMA_PAIRS[pair]
    if not uses_wgmma(fwd, 128, arch_of(torch.device("cuda"))):
        pytest.skip("wgmma runs on SM90 only")
    assert uses_wgmma(bwd, 64, "sm90")
    backend = get_backend("cuda")
    cases = [replace(case, name=f"{case.name}@d{head_dim}", head_dim=head_dim)
             for case in adversarial_cases("full", config_tiles(fwd, bwd)) for head_dim in (64, 120, 128)
             if case.head_dim < head_dim]
    _assert_all_ok(cases, [check_case(backend, case, dtype, "cuda", fwd, bwd) for case in cases], record_property)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_the_wgmma_forward_at_the_widest_head_dims(dtype, record_property):
    """The forward alone (the backward keeps mma.sync above 128) at head dims 184, 192 and 256."""
    from dmattn_kernels.cuda import arch_of, uses_wgmma

    fwd = FwdConfig(128, 64, 8, 2)
    if not uses_wgmma(fwd, 256, arch_of(torch.device("cuda"))):
        pytest.skip("wgmma runs on SM90 only")
    cases = [replace(case, name=f"{case.name}@d{head_dim}", head_dim=head_dim)
             for case in adversarial_cases("full", config_tiles(fwd, None)) for head_dim in (184, 192, 256)
             if case.head_dim < head_dim]
    _assert_all_ok(cases, [check_case(get_backend("cuda"), case, dtype, "cuda", fwd, None) for case in cases],
                   record_property)


# The warp-specialized forward's configs (flash_fwd_ws.cu): 128-key tiles (a mask tile is one
# 128-byte swizzled line per row, one slot of staged tiles beside 2-stage K and V rings), 64-key
# tiles (64-byte mask lines, two slots), and three consumer warpgroups; with its kernel knobs on
# (FwdConfig.overlap: the overlapped consumers taking turns with two of them, the scale in the
# exp; persistent: a CTA per SM over a schedule of work items; tma_store: out stored by TMA).
WS_CONFIGS = {"fwd128x128w12s2": FwdConfig(128, 128, 12, 2), "fwd128x64w12s3": FwdConfig(128, 64, 12, 3),
              "fwd192x64w16s2": FwdConfig(192, 64, 16, 2),
              "fwd128x128w12s2-overlap": FwdConfig(128, 128, 12, 2, overlap=1),
              "fwd128x64w12s3-overlap-persistent": FwdConfig(128, 64, 12, 3, overlap=1, persistent=1),
              "fwd192x64w16s2-overlap-persistent": FwdConfig(192, 64, 16, 2, overlap=1, persistent=1),
              "fwd128x128w12s2-overlap-persistent-tma_store": FwdConfig(128, 128, 12, 2, overlap=1, persistent=1,
                                                                        tma_store=1)}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("config", list(WS_CONFIGS), ids=list(WS_CONFIGS))
def test_the_warp_specialized_forward_passes_the_full_suite(dtype, config, record_property):
    """The forward alone, every case of the full suite at its own head dim where the config takes
    it and at 64, 80, 96, 120, 128 and 136 (those not a multiple of 64 on the tiles of the next, TMA
    filling the columns past the head dim with zeros: at the suite's D32 and D40 one box is wider
    than the whole row, and `sliced_nan_tails` checks that no column past it is read), and again at
    128 with every key length rounded up to a multiple of 16: there a mask's rows and a 16-bit
    bias's rows start on 16-byte boundaries, so TMA stages them (tiles of rows, or one row of keys
    for a padding mask or per-key bias); at the suite's own odd lengths they are read from global
    memory."""
    from dmattn_kernels.cuda import arch_of, warp_specialized

    fwd = WS_CONFIGS[config]
    if not warp_specialized(fwd, 128, arch_of(torch.device("cuda"))):
        pytest.skip("the warp-specialized forward runs on SM90 only")
    from dmattn_kernels.cuda.shared_memory import SM90_SHARED_BYTES, WS_STATIC_BYTES, forward_shared_bytes

    def fits(head_dim):  # 2-stage rings of 128 keys outgrow a block at D192's tiles
        return forward_shared_bytes(fwd, head_dim, "sm90") + WS_STATIC_BYTES <= SM90_SHARED_BYTES

    suite = adversarial_cases("full", config_tiles(fwd, None))
    takes = get_backend("cuda").is_supported
    cases = [case for case in suite if takes(fwd, shape_of_case(case)) is None and fits(case.head_dim)]
    cases += [replace(case, name=f"{case.name}@d{head_dim}", head_dim=head_dim)
              for case in suite for head_dim in (64, 80, 96, 120, 128, 136) if case.head_dim < head_dim and fits(head_dim)]
    cases += [replace(case, name=f"{case.name}@d128,lk{-(-case.seqlen_k // 16) * 16}", head_dim=128,
                      seqlen_k=-(-case.seqlen_k // 16) * 16)
              for case in suite if case.head_dim <= 128 and case.seqlen_k % 16]
    _assert_all_ok(cases, [check_case(get_backend("cuda"), case, dtype, "cuda", fwd, None) for case in cases],
                   record_property)


# The overlapped forward (FWD_OVERLAP) is the CUDA kernel that runs a window (HAS_WINDOW): 128-
# and 64-key tiles, two and three consumers, one item per CTA and persistent.
WINDOW_CONFIGS = {"fwd128x128w12s2-overlap": FwdConfig(128, 128, 12, 2, overlap=1),
                  "fwd128x64w12s3-overlap": FwdConfig(128, 64, 12, 3, overlap=1),
                  "fwd192x64w16s2-overlap": FwdConfig(192, 64, 16, 2, overlap=1),
                  "fwd128x128w12s2-overlap-persistent": FwdConfig(128, 128, 12, 2, overlap=1, persistent=1),
                  "fwd128x64w12s3-overlap-tma_store": FwdConfig(128, 64, 12, 3, overlap=1, tma_store=1)}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("config", list(WINDOW_CONFIGS), ids=list(WINDOW_CONFIGS))
def test_the_warp_specialized_forward_runs_the_full_suite_s_windows(dtype, config, record_property):
    """The forward alone on the window cases of the full suite's packed/window half, on the
    config's own tiles (edges at tile corners, both sides bounded, Lq != Lk, NaN bias outside the
    window, the long-sequence window case), at the head dims 64 and 128 besides each case's own."""
    from dmattn_kernels.cuda import arch_of, warp_specialized

    fwd = WINDOW_CONFIGS[config]
    if not warp_specialized(fwd, 128, arch_of(torch.device("cuda"))):
        pytest.skip("the warp-specialized forward runs on SM90 only")
    suite = [case for case in config_suite("cuda", "full", fwd, None, varlen=True) if not case.packed]
    cases = suite + [replace(case, name=f"{case.name}@d{head_dim}", head_dim=head_dim)
                     for case in suite for head_dim in (64, 128) if case.head_dim != head_dim]
    results = [check_case(get_backend("cuda"), case, dtype, "cuda", fwd, None) for case in cases]
    _assert_all_ok(cases, results, record_property, minimum=12)


# a packed call refuses tma_store (its boxes of out would write the next sequence's rows)
PACKED_CONFIGS = [name for name, config in WINDOW_CONFIGS.items() if not config.tma_store]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("config", PACKED_CONFIGS, ids=PACKED_CONFIGS)
def test_the_overlapped_forward_runs_the_full_suite_s_packed_sequences(dtype, config, record_property):
    """The forward alone (PACKED) on the packed cases of the full suite's packed/window half that
    it runs (a per-key mask and bias or none), and on every packed case with its mask and bias left
    out: NaN in the K, V and rows no sequence owns, zero- and one-token sequences, seqused_k, Lq !=
    Lk per sequence, windows over packed sequences, long documents; at head dim 128 where the
    config's tiles of the case's own do not fit shared memory."""
    from dmattn_kernels.cuda import arch_of, warp_specialized
    from dmattn_kernels.cuda.shared_memory import forward_shared_bytes

    fwd = WINDOW_CONFIGS[config]
    if not warp_specialized(fwd, 128, arch_of(torch.device("cuda"))):
        pytest.skip("the warp-specialized forward runs on SM90 only")
    limit = torch.cuda.get_device_properties(0).shared_memory_per_block_optin
    suite, cases = _packed_cases(fwd, None, lambda head_dim: warp_specialized(fwd, head_dim, "sm90")
                                 and forward_shared_bytes(fwd, head_dim, "sm90") <= limit)
    results = [check_case(get_backend("cuda"), case, dtype, "cuda", fwd, None) for case in cases]
    assert len(suite) >= 3
    _assert_all_ok(cases, results, record_property, minimum=15)


# The warp-specialized backward (flash_bwd_ws.cu) is the CUDA backward that runs a window: two
# consumers (128 keys a block) and one (64), each also with a KV group a CTA (kv_group: the suite's
# cases with one query head a KV head run with two, `validator.grouped_for`), and two consumers
# adding dQ in no set order (nondeterministic_dq; the validator judges its repeat run's dQ by the
# bound instead of bitwise), with and without a KV group.
WINDOW_BACKWARD_CONFIGS = {"bwd64x128w12s2": BwdConfig(64, 128, 64, 128, 12, 2),
                           "bwd64x64w8s2": BwdConfig(64, 64, 64, 64, 8, 2),
                           "bwd64x128w12s2-kv-group": BwdConfig(64, 128, 64, 128, 12, 2, kv_group=1),
                           "bwd64x64w8s2-kv-group": BwdConfig(64, 64, 64, 64, 8, 2, kv_group=1),
                           "bwd64x128w12s2-nondeterministic-dq": BwdConfig(64, 128, 64, 128, 12, 2,
                                                                          nondeterministic_dq=1),
                           "bwd64x128w12s2-kv-group-nondeterministic-dq": BwdConfig(64, 128, 64, 128, 12, 2, kv_group=1,
                                                                                   nondeterministic_dq=1)}
KV_GROUP_CONFIGS = {name: config for name, config in WINDOW_BACKWARD_CONFIGS.items() if config.kv_group}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("config", ["bwd64x128w12s2", "bwd64x64w8s2", "bwd64x128w12s2-nondeterministic-dq"])
def test_the_warp_specialized_backward_passes_the_full_suite(dtype, config, record_property):
    """The backward alone (the reference's out and lse), every case of the full suite at its own
    head dim where the config takes it (the suite's D32, D40, D72 and D96 among them) and at each
    of 64, 80, 96 and 128 it takes: head dims that are not a multiple of 64 run on the tiles of the
    next, TMA filling the columns past the head dim with zeros, which must add nothing to dQ, dK,
    dV or dBias (at D32 and D40 one box is wider than the whole row)."""
    from dmattn_kernels.cuda import arch_of, backward_warp_specialized

    bwd = WINDOW_BACKWARD_CONFIGS[config]
    if not backward_warp_specialized(bwd, 128, arch_of(torch.device("cuda"))):
        pytest.skip("the warp-specialized backward runs on SM90 only")
    suite = adversarial_cases("full", config_tiles(None, bwd))
    cases = [case for case in suite if backward_warp_specialized(bwd, case.head_dim, "sm90")]
    cases += [replace(case, name=f"{case.name}@d{head_dim}", head_dim=head_dim)
              for case in suite for head_dim in (64, 80, 96, 128)
              if case.head_dim < head_dim and backward_warp_specialized(bwd, head_dim, "sm90")]
    _assert_all_ok(cases, [check_case(get_backend("cuda"), case, dtype, "cuda", None, bwd) for case in cases],
                   record_property)


TRANSPOSED_BACKWARD_CONFIGS = {"bwd64x96w12s1": BwdConfig(64, 96, 64, 96, 12, 1),
                               "bwd64x64w12s2": BwdConfig(64, 64, 64, 64, 12, 2),
                               "bwd64x96w12s1-nondeterministic-dq": BwdConfig(64, 96, 64, 96, 12, 1,
                                                                             nondeterministic_dq=1)}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("config", list(TRANSPOSED_BACKWARD_CONFIGS), ids=list(TRANSPOSED_BACKWARD_CONFIGS))
def test_the_transposed_backward_passes_the_full_suite(dtype, config, record_property):
    """The warp-specialized backward's transposed layout (DKV_TRANSPOSED, head dims 136-192) alone,
    every case of the full suite moved to D192 and to D160 (on D192's tiles, TMA filling the
    columns past 160 with zeros): masks and biases of every layout read from global memory, dBias
    of query rows and per key (summed across a consumer's warps), softcap, GQA's fp32 shares,
    dead rows, Lq != Lk, and keys past the last block's end."""
    from dmattn_kernels.cuda import arch_of, backward_warp_specialized

    bwd = TRANSPOSED_BACKWARD_CONFIGS[config]
    if not backward_warp_specialized(bwd, 192, arch_of(torch.device("cuda"))):
        pytest.skip("the warp-specialized backward runs on SM90 only")
    cases = [replace(case, name=f"{case.name}@d{head_dim}", head_dim=head_dim)
             for case in config_suite("cuda", "full", None, bwd) for head_dim in (160, 192)]
    _assert_all_ok(cases, [check_case(get_backend("cuda"), case, dtype, "cuda", None, bwd) for case in cases],
                   record_property)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("config", list(KV_GROUP_CONFIGS), ids=list(KV_GROUP_CONFIGS))
def test_the_kv_group_backward_passes_the_full_suite(dtype, config, record_property):
    """The backward alone with a KV group a CTA (BWD_KV_GROUP) on the dense full suite, every case
    with grouped query heads: masks and biases of every layout read from global memory, dBias
    per key summed per query head and of query rows, softcap, dead rows, Lq != Lk."""
    from dmattn_kernels.cuda import arch_of, backward_warp_specialized

    bwd = KV_GROUP_CONFIGS[config]
    if not backward_warp_specialized(bwd, 128, arch_of(torch.device("cuda"))):
        pytest.skip("the warp-specialized backward runs on SM90 only")
    # a head dim the kernel cannot take (192: over 128) at 128
    cases = [case if backward_warp_specialized(bwd, case.head_dim, "sm90") else replace(case, head_dim=128)
             for case in config_suite("cuda", "full", None, bwd)]
    assert all(case.heads > case.heads_kv for case in cases)
    results = [check_case(get_backend("cuda"), case, dtype, "cuda", None, bwd) for case in cases]
    _assert_all_ok(cases, results, record_property, minimum=30)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("config", list(WINDOW_BACKWARD_CONFIGS), ids=list(WINDOW_BACKWARD_CONFIGS))
def test_the_warp_specialized_backward_runs_the_full_suite_s_windows(dtype, config, record_property):
    """The backward alone (the reference's out and lse) on the window cases of the full suite's
    packed/window half, on the config's own tiles, at the head dims 64, 96 (on the tiles of 128)
    and 128 besides each case's own where the config takes them: dQ summed over the blocks a
    window leaves each query tile, dBias zero outside the window (NaN bias there), both sides
    bounded, Lq != Lk."""
    from dmattn_kernels.cuda import arch_of, backward_warp_specialized

    bwd = WINDOW_BACKWARD_CONFIGS[config]
    if not backward_warp_specialized(bwd, 128, arch_of(torch.device("cuda"))):
        pytest.skip("the warp-specialized backward runs on SM90 only")
    suite = [case for case in config_suite("cuda", "full", None, bwd, varlen=True) if not case.packed]
    cases = suite + [replace(case, name=f"{case.name}@d{head_dim}", head_dim=head_dim)
                     for case in suite for head_dim in (64, 96, 128)
                     if case.head_dim != head_dim and backward_warp_specialized(bwd, head_dim, "sm90")]
    results = [check_case(get_backend("cuda"), case, dtype, "cuda", None, bwd) for case in cases]
    _assert_all_ok(cases, results, record_property, minimum=12)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("config", list(WINDOW_BACKWARD_CONFIGS), ids=list(WINDOW_BACKWARD_CONFIGS))
def test_the_warp_specialized_backward_runs_the_full_suite_s_packed_sequences(dtype, config, record_property):
    """The backward alone on the packed cases of the full suite's packed/window half that it runs
    (a per-key mask and bias or none), and on every packed case with its mask and bias left out:
    NaN in the K, V and rows no sequence owns, zero- and one-token sequences, seqused_k, Lq != Lk
    per sequence, windows over packed sequences, long documents."""
    from dmattn_kernels.cuda import arch_of, backward_warp_specialized

    bwd = WINDOW_BACKWARD_CONFIGS[config]
    if not backward_warp_specialized(bwd, 128, arch_of(torch.device("cuda"))):
        pytest.skip("the warp-specialized backward runs on SM90 only")
    suite, cases = _packed_cases(None, bwd, lambda head_dim: backward_warp_specialized(bwd, head_dim, "sm90"))
    results = [check_case(get_backend("cuda"), case, dtype, "cuda", None, bwd) for case in cases]
    assert len(suite) >= 3
    _assert_all_ok(cases, results, record_property, minimum=15)


def _packed_cases(fwd, bwd, takes) -> tuple[list, list]:
    """(the full suite's packed cases a CUDA config runs, those plus every packed case with its mask
    and bias left out), each case whose head dim the config does not take (`takes`) at 128."""
    from dmattn_bench.tuning.varlen_cases import VARLEN_SUITES

    suite = [case for case in config_suite("cuda", "full", fwd, bwd, varlen=True) if case.packed]
    bare = [grouped_for(replace(case, name=f"{case.name}-no-operands", mask="none", bias="none", bias_poison=None,
                                dead_documents=()), bwd) for case in VARLEN_SUITES["full"]() if case.packed]
    return suite, [case if takes(case.head_dim) else replace(case, head_dim=128) for case in suite + bare]


def _assert_all_ok(cases, results, record_property, minimum: int = 51):
    """Every case ok, at least `minimum` of them, each tensor's worst error within its bound."""
    worst = {}
    for result in results:
        for name, check in result.checks.items():
            worst[name] = max(worst.get(name, 0.0), check.ratio)
    record_property("worst_ratios", {k: round(v, 4) for k, v in worst.items()})
    failures = [f"{case.name}: {result.status} {result.reason}" for case, result in zip(cases, results)
                if result.status != "ok"]
    assert not failures, "\n".join(failures)
    assert len(results) >= minimum and all(ratio <= 1.0 for ratio in worst.values())


@pytest.mark.parametrize("backend", ["auto", "cuda"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_wrapper_doge_gqa_shape(dtype, backend):
    """flash_dmattn_func end to end (autograd) on a Doge-style GQA problem."""
    case = Case("doge", batch=2, heads=16, heads_kv=4, seqlen_q=1024, seqlen_k=1024, head_dim=128,
                causal=True, mask="random", mask_shape="kv_head", bias="per_key")
    inputs = build_inputs(case, dtype, "cuda", seed=3)
    q, k, v = (t.detach().requires_grad_() for t in (inputs.q, inputs.k, inputs.v))
    bias = inputs.bias.detach().requires_grad_()
    out, lse = flash_dmattn_func(q, k, v, inputs.mask, bias, is_causal=True, return_lse=True, backend=backend)
    dq, dk, dv, dbias = torch.autograd.grad(out, (q, k, v, bias), inputs.dout)
    got = {"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv, "dbias": dbias}
    high = run_reference(inputs, case, None)
    low = run_reference(inputs, case, dtype)
    for name, tensor in got.items():
        check = compare(name, tensor, high[name], low[name], dtype)
        assert check.passed, f"{name}: error {check.error:.3g} bound {check.bound:.3g} {check.detail}"


@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_long_rows_with_a_large_row_max(backend):
    """512 key tiles of 64 under a bias near -1e4: an online-softmax rescale that is not exactly
    1 while the row max holds compounds over the tiles (a CUDA forward once drifted 4.8% in out
    here: `python -m benchmarks cuda-long-row-check`)."""
    case = Case("long_rows_large_max", heads=2, heads_kv=2, seqlen_q=128, seqlen_k=32768, head_dim=128,
                bias="full", bias_grad=False)
    inputs = build_inputs(case, torch.bfloat16, "cuda", seed=5)
    inputs.bias = (inputs.bias.float() - 1e4).to(inputs.bias.dtype)
    fwd, _ = default_configs(case.head_dim, "cuda", backend)
    got = run_kernel(get_backend(backend), inputs, case, fwd, None)
    high = run_reference(inputs, case, None)
    low = run_reference(inputs, case, torch.bfloat16)
    for name in ("out", "lse"):
        check = compare(name, got[name], high[name], low[name], torch.bfloat16)
        assert check.passed, f"{name}: error {check.error:.3g} bound {check.bound:.3g} {check.detail}"
    # The §2 bound follows the bf16 reference, which a bias near -1e4 makes coarse, so the drift
    # passes it; against the float64 reference the drifting kernel was off by 4.1e-2 (out,
    # relative) and 8.6e-2 (lse), a correct one by 3.2e-3 (bf16 rounding of out) and 8e-4.
    out_error = (got["out"].double() - high["out"].double()).abs().max() / high["out"].double().abs().max()
    lse_error = (got["lse"].double() - high["lse"].double()).abs().max()
    assert out_error < 1e-2 and lse_error < 1e-2, (out_error.item(), lse_error.item())


@pytest.mark.parametrize("mask_shape, bias, heads_kv", [(None, None, 8), ("kv_head", "per_key", 2), ("full", "full", 8),
                                                     ("full", "kv_head", 2)],
                         ids=["dense", "gqa-kvmask-perkeybias", "fullmask-fullbias", "gqa-fullmask-kvbias-groupmode"])
def test_later_calls_through_the_compiled_launchers_repeat_the_first_bitwise(monkeypatch, mask_shape, bias, heads_kv):
    """A plan's first run goes through Triton's JIT with tensors; later runs go through one native
    call, or call the compiled launchers and hand the kernels their scratch buffers (delta, block
    lists, GQA shares, dBias partials) by address. Every output of three later calls equals the
    first call's bitwise, and the later backward runs took the path they should."""
    from dmattn_bench import plan
    from dmattn_kernels.runtime import native
    from dmattn_kernels.triton import launching

    plan.clear()  # the first call below builds the plan and runs it through the JIT
    by_address = []
    pointers = launching.Workspace.pointers
    monkeypatch.setattr(launching.Workspace, "pointers",
                        lambda self, buffer: by_address.append(1) or pointers(self, buffer))
    case = Case("repeat", batch=2, heads=8, heads_kv=heads_kv, seqlen_q=300, seqlen_k=300, head_dim=64, causal=True,
                mask="random" if mask_shape else "none", mask_shape=mask_shape or "kv_head", bias=bias or "none")
    inputs = build_inputs(case, torch.bfloat16, "cuda", seed=5)
    leaves = [t.detach().requires_grad_() for t in (inputs.q, inputs.k, inputs.v)]
    bias_leaf = None if inputs.bias is None else inputs.bias.detach().requires_grad_()
    runs = []
    for _ in range(4):
        out, lse = flash_dmattn_func(*leaves, inputs.mask, bias_leaf, is_causal=True, return_lse=True)
        grads = torch.autograd.grad(out, leaves + ([bias_leaf] if bias_leaf is not None else []), inputs.dout)
        runs.append((out, lse, *grads))
    # the first backward compiles the kernels and builds the native program of the later ones
    # (with the path on, except for a group-mode union of the mask's activity), which allocate
    # and launch in C++; without it they run from Python by address
    (backward,) = [launch for built in plan.PLANS._plans.values() for launch in built._bwd_launches.values()]
    goes_native = native.loaded() is not None and not backward.group_union
    assert (backward.native is not None) == goes_native
    assert len(by_address) == (0 if goes_native else 3)
    assert not any(t.isnan().any() for t in runs[0])  # a row the mask empties has lse -inf
    for later in runs[1:]:
        assert all(torch.equal(first, again) for first, again in zip(runs[0], later))


def test_key_views_the_copy_engine_cannot_take_fall_back_to_pointer_loads():
    """On sm90 the forward loads K/V through TMA descriptors, which need 16-byte strides; a view
    whose head stride is 132 bf16 (264 B) takes pointer loads and gives the same result as its
    contiguous copy, which takes descriptors."""
    from dmattn_kernels.triton import forward, launch

    if torch.cuda.get_device_capability()[0] not in forward.TMA_ARCH_MAJORS:
        pytest.skip("no GPU of an arch that loads K/V by TMA")
    generator = torch.Generator(device="cuda").manual_seed(11)
    q = torch.randn(2, 200, 4, 128, device="cuda", dtype=torch.bfloat16, generator=generator)
    wide = torch.randn(2, 200, 2, 2, 132, device="cuda", dtype=torch.bfloat16, generator=generator)
    k, v = wide[:, :, 0, :, :128], wide[:, :, 1, :, :128]
    assert not forward.kv_by_tma(k, v)
    assert forward.kv_by_tma(k.contiguous(), v.contiguous())
    assert not forward.kv_by_tma(k[:, :1].contiguous(), v[:, :1].contiguous())  # Lk = 1 (`kv_by_tma` says why)
    results = []
    for keys, values in ((k, v), (k.contiguous(), v.contiguous())):
        out = torch.empty_like(q)
        lse = torch.empty(2, 4, 200, device="cuda", dtype=torch.float32)
        launch.attention_forward(q, keys, values, None, None, is_causal=True, softmax_scale=128 ** -0.5, softcap=0.0,
                                 config=FwdConfig(64, 64, 4, 3), out=out, lse=lse)
        results.append((out, lse))
    assert torch.isfinite(results[0][0]).all()
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


@pytest.mark.parametrize("bias_dtype", [torch.bfloat16, torch.float32], ids=["bf16-bias", "fp32-bias"])
def test_a_forward_plans_shared_bytes_are_those_of_the_kernel_it_runs(bias_dtype):
    """`ForwardPlan.shared_bytes` compiles the forward on stand-ins of the call's tensors (their
    dtypes and 16-byte alignment): the kernel the plan's run compiles, a 2-D mask off the 16-byte
    grid and a 3-D bias given as they are."""
    from dmattn_kernels.triton.forward import ForwardPlan

    generator = torch.Generator(device="cuda").manual_seed(13)
    q, k, v = (torch.randn(2, 200, 4, 128, device="cuda", dtype=torch.bfloat16, generator=generator)
               for _ in range(3))
    mask = (torch.rand(200, 201, device="cuda", generator=generator) > 0.3)[:, 1:]
    bias = torch.randn(4, 1, 200, device="cuda", generator=generator).to(bias_dtype)
    out, lse = torch.empty_like(q), torch.empty(2, 4, 200, device="cuda")
    options = dict(is_causal=True, softmax_scale=128 ** -0.5, softcap=0.0, config=FwdConfig(64, 64, 4, 2))
    plan = ForwardPlan(q, k, v, mask, bias, out=out, lse=lse, **options)
    shared = plan.shared_bytes()
    plan(q, k, v, mask, bias, out, lse)
    compiled = getattr(plan.forward.launcher, "compiled", None)  # what the run's JIT returned
    if compiled is None:
        pytest.skip("this Triton's launcher is not one `handles.direct_launch` knows")
    assert shared == compiled.metadata.shared > 0


def test_timing_measures_gpu_time_not_the_hosts():
    """A call whose host work (2 ms of sleep before one small kernel) dwarfs its GPU work is timed
    at its GPU time: the spin ahead of each repeat lets the host enqueue it in time (`timing.py`).
    The eager wall time per call, which has no spin, includes the host's 2 ms."""
    import time

    from dmattn_bench.tuning.timing import eager_wall_ms, time_kernel

    x = torch.ones(1 << 20, device="cuda")

    def slow_host_call():
        time.sleep(0.002)
        x.mul_(1.0)

    timing = time_kernel(slow_host_call, "cuda", repeats=10)
    assert timing.host_ms >= 2.0
    assert timing.median_ms < 1.0, timing
    assert eager_wall_ms(slow_host_call, "cuda", calls=5, loops=3) >= 2.0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_decode_steps_in_a_cuda_graph_with_changing_lengths(dtype):
    """A serving step: one query row per sequence over a NaN-tailed KV cache, `cache_seqlens`
    changed between replays of one captured graph; each replay is checked against the reference
    (DESIGN §2), splits and all (H32 Hkv8 D128, Lk 4096: several splits per sequence)."""
    from dmattn_bench.reference import attention

    batch, heads, heads_kv, seqlen_k, head_dim = 4, 32, 8, 4096, 128
    g = torch.Generator(device="cuda").manual_seed(5)
    q = torch.randn(batch, 1, heads, head_dim, device="cuda", dtype=dtype, generator=g)
    k, v = (torch.randn(batch, seqlen_k, heads_kv, head_dim, device="cuda", dtype=dtype, generator=g)
            for _ in range(2))
    bias = torch.randn(batch, heads_kv, 1, seqlen_k, device="cuda", dtype=dtype, generator=g)
    lengths = torch.full((batch,), seqlen_k, dtype=torch.int32, device="cuda")
    with torch.no_grad():
        flash_dmattn_func(q, k, v, None, bias, cache_seqlens=lengths)  # builds the plan and compiles
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = flash_dmattn_func(q, k, v, None, bias, cache_seqlens=lengths)
    for values in ([4096, 1, 2000, 0], [17, 4095, 64, 3000]):
        lengths.copy_(torch.tensor(values, dtype=torch.int32))
        k_cache, v_cache = k.clone(), v.clone()
        for b, length in enumerate(values):
            k[b, length:], v[b, length:] = float("nan"), float("nan")  # past the length: never read
        graph.replay()
        high = attention(q, k_cache, v_cache, None, bias, cache_seqlens=lengths)
        low = attention(q, k_cache, v_cache, None, bias, cache_seqlens=lengths, compute_dtype=dtype)
        check = compare("out", out, high, low, dtype)
        assert check.passed, f"lengths {values}: {check}"
        k.copy_(k_cache), v.copy_(v_cache)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_paged_decode_with_pages_outside_the_cache_excludes_them(dtype):
    """Issue 54 on the GPU: table entries of -1, the pool's size and 2^31 - 1 (the pool a view
    between two NaN blocks) exclude their keys; every call, through the JIT, the Python launch and
    the native entry, is finite, equal to the reference by DESIGN §2 and to the first bitwise
    (B4 H32 Hkv8 D128, pages of 64 keys, 4096 keys a sequence, cache lengths)."""
    from dmattn_bench.tuning.adversarial import paged_cache
    from dmattn_bench.reference import attention

    batch, heads, heads_kv, seqlen_k, head_dim = 4, 32, 8, 4096, 128
    g = torch.Generator(device="cuda").manual_seed(6)
    q = torch.randn(batch, 1, heads, head_dim, device="cuda", dtype=dtype, generator=g)
    k, v = (torch.randn(batch, seqlen_k, heads_kv, head_dim, device="cuda", dtype=dtype, generator=g)
            for _ in range(2))
    bias = torch.randn(batch, heads_kv, 1, seqlen_k, device="cuda", dtype=dtype, generator=g)
    lengths = torch.tensor([4096, 3000, 65, 1], dtype=torch.int32, device="cuda")
    k_pool, v_pool, table = paged_cache(k, v, 64, g, lengths, out_of_range=True)
    used = torch.arange(table.shape[1], device="cuda") * 64 < lengths.unsqueeze(1)
    assert (used & ((table < 0) | (table >= k_pool.shape[0]))).sum() >= 30  # entries a kept key reads, naming no block
    with torch.no_grad():
        runs = [flash_dmattn_func(q, k_pool, v_pool, None, bias, cache_seqlens=lengths, block_table=table,
                                  return_lse=True) for _ in range(4)]
    high = attention(q, k_pool, v_pool, None, bias, cache_seqlens=lengths, block_table=table, return_lse=True)
    low = attention(q, k_pool, v_pool, None, bias, cache_seqlens=lengths, block_table=table, return_lse=True,
                    compute_dtype=dtype)
    out, lse = runs[0]
    assert torch.isfinite(out).all() and torch.isfinite(lse[:3]).all()
    for name, got, ref, ref_low in (("out", out, high[0], low[0]), ("lse", lse, high[1], low[1])):
        check = compare(name, got, ref, ref_low, dtype)
        assert check.passed, f"{name}: {check}"
    for later in runs[1:]:
        assert torch.equal(later[0], out) and torch.equal(later[1], lse)


def _counted_entry(entry, served: list):
    """`dmattn_bench.entry.ENTRY` that appends to `served` whether it ran each call."""
    def counted(*arguments):
        result = entry(*arguments)
        served.append(result is not None)
        return result

    return counted


def _counted_native_runs(monkeypatch) -> tuple[list, list]:
    """A fresh plan cache, and lists that fill as calls run: one item per `native.Program` run
    from Python, and per eager-entry call whether the entry served it."""
    from dmattn_bench import entry, plan
    from dmattn_kernels.runtime import native

    if native.module() is None:
        pytest.fail("the native launch path did not build")
    plan.clear()
    native_runs, served = [], []
    run = native.Program.__call__
    monkeypatch.setattr(native.Program, "__call__", lambda self, *args: native_runs.append(1) or run(self, *args))
    monkeypatch.setattr(entry, "ENTRY", _counted_entry(entry.ENTRY, served))
    return native_runs, served


def test_the_eager_entry_serves_a_repeated_call_until_its_plan_would_change(monkeypatch):
    """The eager entry runs a call without gradient whose arguments ran before, with the bits of
    the Python path; it declines what that path checks or plans anew: an integer mask (its values
    are checked every call), a gradient, explicit configs, watched launches, another dispatch
    state (a table chosen in the process or named by the environment)."""
    from dmattn_bench import dispatch, entry, plan
    from dmattn_kernels.runtime import launch_context, native

    if native.module() is None:
        pytest.fail("the native launch path did not build")
    plan.clear()
    served = []
    monkeypatch.setattr(entry, "ENTRY", _counted_entry(entry.ENTRY, served))
    g = torch.Generator(device="cuda").manual_seed(5)
    q, k, v = (torch.randn(2, 200, 4, 64, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    mask = torch.rand(2, 1, 200, 200, device="cuda", generator=g) > 0.4
    bias = torch.randn(2, 4, 1, 200, device="cuda", dtype=torch.bfloat16, generator=g)

    def call(**options):
        return flash_dmattn_func(q, k, v, options.pop("mask", mask), bias, is_causal=True, return_lse=True, **options)

    with monkeypatch.context() as watched:  # the Python path, launches watched: the reference bits
        watched.setattr(launch_context, "LAUNCH_OBSERVERS", [lambda name: None])
        expected = call()
    served.clear()
    results = [call() for _ in range(3)]  # Python (learns), then the entry
    assert served == [False, True, True]
    assert all(torch.equal(a, b) for result in results for a, b in zip(result, expected))

    def served_calls(run) -> list[bool]:
        served.clear()
        run()
        return list(served)

    leaf = v.detach().requires_grad_()
    with monkeypatch.context() as watched:
        watched.setattr(launch_context, "LAUNCH_OBSERVERS", [lambda name: None])
        watched_calls = served_calls(call)
    declined = {
        "integer mask": served_calls(lambda: [call(mask=mask.to(torch.uint8)) for _ in range(2)]),
        "explicit config": served_calls(lambda: [call(fwd_config=FwdConfig(64, 32, 4, 2)) for _ in range(2)]),
        "gradient": served_calls(lambda: flash_dmattn_func(q, k, leaf, mask, bias, is_causal=True)),
        "watched": watched_calls,
    }
    assert declined == {"integer mask": [False, False], "explicit config": [False, False], "gradient": [False],
                        "watched": [False]}

    # a new dispatch generation; the environment naming a table (empty here: the same choice)
    for change in (lambda: dispatch.DISPATCHER.use_table(None), lambda: monkeypatch.setenv(dispatch.ENV_VAR, "")):
        change()
        results = []
        # planned again (its first run compiles through the JIT, the second builds its program), then served
        assert served_calls(lambda: results.extend([call(), call(), call()])) == [False, False, True]
        assert all(torch.equal(a, b) for result in results for a, b in zip(result, expected))


def test_one_program_run_from_two_threads_gives_each_run_its_own_inputs_result():
    """A native program's run of several kernels is one graph launch whose nodes' parameters it
    replaces first, under the program's lock (`native_launch.cpp`, `run_as_graph`): two threads
    running one signature on different inputs each get their own inputs' result."""
    from concurrent.futures import ThreadPoolExecutor

    from dmattn_bench import plan
    from dmattn_kernels.runtime import native

    if native.module() is None:
        pytest.fail("the native launch path did not build")
    plan.clear()
    g = torch.Generator(device="cuda").manual_seed(7)
    calls = []
    for _ in range(2):
        q, k, v = (torch.randn(2, 256, 4, 64, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
        mask = torch.rand(2, 1, 256, 256, device="cuda", generator=g) > 0.5
        calls.append((q, k, v, mask))
    expected = [[flash_dmattn_func(*inputs, is_causal=True) for _ in range(3)][-1] for inputs in calls]

    def run(index: int) -> list[torch.Tensor]:
        return [flash_dmattn_func(*calls[index], is_causal=True) for _ in range(50)]

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(run, [0, 1, 0, 1]))
    torch.cuda.synchronize()
    assert all(torch.equal(out, expected[index % 2]) for index, outs in enumerate(results) for out in outs)


def test_a_graph_run_that_repeats_the_last_addresses_and_one_that_does_not_both_get_their_inputs_result():
    """A run of several kernels replaces only the graph nodes whose parameters changed since the
    last run (`run_as_graph`): a decode loop whose outputs are dropped gets its freed buffers back,
    so every node repeats; a call on another cache changes the split kernel's node alone. Either
    way each call gets its own inputs' result."""
    from dmattn_bench import plan
    from dmattn_kernels.runtime import native

    if native.module() is None:
        pytest.fail("the native launch path did not build")
    plan.clear()
    g = torch.Generator(device="cuda").manual_seed(11)
    q = torch.randn(2, 1, 32, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    caches = [tuple(torch.randn(2, 4096, 8, 128, device="cuda", dtype=torch.bfloat16, generator=g)
                    for _ in range(2)) for _ in range(2)]
    lengths = torch.tensor([4096, 1500], dtype=torch.int32, device="cuda")
    expected = [[flash_dmattn_func(q, k, v, cache_seqlens=lengths) for _ in range(3)][-1].clone() for k, v in caches]
    order = [0, 0, 0, 1, 1, 0, 1, 0, 0]
    matches = [torch.equal(flash_dmattn_func(q, *caches[index], cache_seqlens=lengths), expected[index])
               for index in order]
    assert matches == [True] * len(order)


NATIVE_CALLS = ["dense-tma", "mask-bias", "mask-bias-grad", "mask-bias-grad-cuda-fwd", "decode-one-split",
                "decode-splits-mask", "decode-seqlens", "decode-paged"]


def _pin_backends(monkeypatch, fwd: str, bwd: str) -> None:
    """Later plans run each direction on the named backend with its default config, whatever the
    shipped table chooses (a table that moves a key to another backend changes what a test runs)."""
    from dmattn_bench import plan

    choose = plan._choose

    def pinned(key, device, backend, table, explicit, env):
        named = {"fwd": fwd, "bwd": bwd}.get(key.direction, backend)
        return choose(key, device, named, table, explicit, env)

    monkeypatch.setattr(plan, "_choose", pinned)


@pytest.mark.parametrize("call", NATIVE_CALLS)
def test_the_native_launch_path_repeats_the_python_launches_bitwise(monkeypatch, call):
    """Once a plan's kernels are compiled, its later eager calls (forward, decode, backward) run
    as one native call each (`kernels/runtime/native.py`): the same kernels on the same inputs give
    the same bits, and so do copies at new addresses (new K/V addresses: TMA descriptors encoded
    again). After the CUDA forward, which leaves no tile activity, the Triton backward's program
    runs the activity pass itself."""
    from dmattn_bench.tuning.adversarial import paged_cache

    native_runs, served = _counted_native_runs(monkeypatch)
    if call.startswith("mask-bias-grad"):
        _pin_backends(monkeypatch, "cuda" if call.endswith("cuda-fwd") else "triton", "triton")
    g = torch.Generator(device="cuda").manual_seed(3)
    decode = call.startswith("decode")
    batch, seqlen_q, seqlen_k = (4, 1, 3000) if decode else (2, 300, 300)
    heads, heads_kv, head_dim = (32, 8, 128) if decode else (8, 2, 64)
    q = torch.randn(batch, seqlen_q, heads, head_dim, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(batch, seqlen_k, heads_kv, head_dim, device="cuda", dtype=torch.bfloat16, generator=g)
            for _ in range(2))
    mask = bias = lengths = table = None
    if call.startswith("mask-bias"):
        mask = torch.rand(batch, heads_kv, seqlen_q, seqlen_k, device="cuda", generator=g) > 0.3
        bias = torch.randn(batch, heads_kv, 1, seqlen_k, device="cuda", dtype=torch.bfloat16, generator=g)
    if call == "decode-splits-mask":
        mask = (torch.arange(seqlen_k, device="cuda") < seqlen_k - 100).expand(batch, 1, 1, seqlen_k)
    if call in ("decode-seqlens", "decode-paged"):
        lengths = torch.tensor([3000, 1, 1700, 0], dtype=torch.int32, device="cuda")
    if call == "decode-paged":
        k, v, table = paged_cache(k, v, 64, torch.Generator(device="cuda").manual_seed(4), lengths)
    if call == "decode-one-split":
        k, v = k[:, :64].contiguous(), v[:, :64].contiguous()  # the clones below keep the layout
    grad = call.startswith("mask-bias-grad")

    def step(q, k, v, bias):
        leaves = [t.detach().requires_grad_(grad) for t in (q, k, v)]
        bias_leaf = None if bias is None else bias.detach().requires_grad_(grad)
        with torch.set_grad_enabled(grad):
            out, lse = flash_dmattn_func(*leaves, mask, bias_leaf, is_causal=not decode, return_lse=True,
                                         cache_seqlens=lengths, block_table=table)
        if not grad:
            return out, lse
        return out, lse, *torch.autograd.grad(out, leaves + [bias_leaf], torch.ones_like(out))

    first = step(q, k, v, bias)
    later = [step(q, k, v, bias), step(q, k, v, bias),
             step(q.clone(), k.clone(), v.clone(), None if bias is None else bias.clone())]
    # a forward plan runs through the JIT, then from Python, building its program; decode's and
    # the backward's first runs build theirs. A call without gradient whose program exists runs
    # through the eager entry (one C++ call from `flash_dmattn_func`), the others from Python.
    assert (len(native_runs), served.count(True)) == ((0, 3) if decode else (5, 0) if grad else (0, 2))
    if grad:  # the pinned forward ran
        from dmattn_bench import plan

        assert {built.fwd_backend.name for built in plan.PLANS._plans.values()} == {
            "cuda" if call.endswith("cuda-fwd") else "triton"}
    assert not any(t.isnan().any() for t in first)
    for again in later:
        assert all(torch.equal(a, b) for a, b in zip(first, again))


# CUDA forwards through their native program (`dmattn_kernels.cuda.ForwardPlan`): the
# warp-specialized forward with staged tiles of mask and bias rows or of one row of keys (its
# tensor maps filled per call) and with no operand on the backend's default tiles (through the
# eager entry), and flash_fwd.cu with a mask and a bias read from global memory.
CUDA_NATIVE_CALLS = {"ws-mask-bias": (FwdConfig(128, 128, 12, 2), 128, "rows"), "ws-default": (None, 128, None),
                     "ws-keys": (FwdConfig(128, 128, 12, 2), 128, "keys"),
                     "ws-persistent-mask-bias": (FwdConfig(128, 128, 12, 2, overlap=1, persistent=1), 128, "rows"),
                     "ws-tma-store": (FwdConfig(128, 128, 12, 2, overlap=1, tma_store=1), 128, None),
                     "ws-persistent-tma-store-keys": (FwdConfig(128, 128, 12, 2, overlap=1, persistent=1, tma_store=1),
                                                      128, "keys"),
                     "flash-fwd-mask-bias": (FwdConfig(64, 64, 4, 2), 64, "rows")}


@pytest.mark.parametrize("call", list(CUDA_NATIVE_CALLS))
def test_the_cuda_forward_s_native_program_repeats_its_python_launch_bitwise(monkeypatch, call):
    """A CUDA forward plan launches from Python twice (the first run builds its cubin, the second
    its program), then runs as one native call: through the plan with explicit tiles, through the
    eager entry without. The same bits on the same inputs and on copies at new addresses (the
    warp-specialized forward's tensor maps encoded again), on masks and biases of rows or of keys."""
    from dmattn_kernels.cuda import arch_of, warp_specialized

    config, head_dim, operands = CUDA_NATIVE_CALLS[call]
    if call.startswith("ws") and not warp_specialized(FwdConfig(128, 128, 12, 2), head_dim,
                                                      arch_of(torch.device("cuda"))):
        pytest.skip("the warp-specialized forward runs on SM90 only")
    native_runs, served = _counted_native_runs(monkeypatch)
    g = torch.Generator(device="cuda").manual_seed(7)
    q, k, v = (torch.randn(2, 512, 4, head_dim, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    mask = bias = None
    if operands == "rows":
        mask = torch.rand(2, 4, 512, 512, device="cuda", generator=g) > 0.3
        bias = torch.randn(2, 4, 512, 512, device="cuda", dtype=torch.bfloat16, generator=g)
    elif operands == "keys":  # a padding mask and a 3-D per-key bias: one row of keys per tile
        mask = torch.rand(2, 1, 1, 512, device="cuda", generator=g) > 0.3
        bias = torch.randn(4, 1, 512, device="cuda", dtype=torch.bfloat16, generator=g)

    def step(*tensors):
        return flash_dmattn_func(*tensors, is_causal=True, return_lse=True, backend="cuda", fwd_config=config)

    first = step(q, k, v, mask, bias)
    later = [step(q, k, v, mask, bias) for _ in range(3)]
    later += [step(*(None if t is None else t.clone() for t in (q, k, v, mask, bias)))]
    assert (len(native_runs), served.count(True)) == ((0, 3) if config is None else (3, 0))
    assert not any(t.isnan().any() for t in first)
    for again in later:
        assert all(torch.equal(a, b) for a, b in zip(first, again))


def _masked_causal_call(seed: int, batch: int, seqlen: int, heads: int, head_dim: int):
    """Seeded bf16 q, k, v and dout, a full bias and a full mask keeping about 70% of positions,
    and the options of a causal call."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v, dout = (torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=torch.bfloat16, generator=g)
                     for _ in range(4))
    bias = torch.randn(batch, heads, seqlen, seqlen, device="cuda", dtype=torch.bfloat16, generator=g)
    mask = torch.rand(batch, heads, seqlen, seqlen, device="cuda", generator=g) > 0.3
    return q, k, v, dout, bias, mask, dict(is_causal=True, softmax_scale=head_dim ** -0.5, softcap=0.0)


def test_the_warp_specialized_backward_as_the_first_cuda_work_of_a_thread():
    """Autograd runs the backward on its own thread, where torch may not have made a CUDA context
    current: the warp-specialized backward (tensor maps, then launches; dBias stored by TMA, so
    no zeroing launch before) must still run there, and give the main thread's result."""
    import threading

    cuda = get_backend("cuda")
    batch, seqlen, heads, head_dim = 1, 256, 2, 128
    q, k, v, dout, bias, mask, options = _masked_causal_call(3, batch, seqlen, heads, head_dim)
    out, lse = torch.empty_like(q), torch.empty(batch, heads, seqlen, device="cuda")
    cuda.forward(q, k, v, mask, bias, config=FwdConfig(128, 128, 12, 2), out=out, lse=lse, **options)

    def backward() -> dict[str, torch.Tensor]:
        grads = dict(dq=torch.empty_like(q), dk=torch.empty_like(k), dv=torch.empty_like(v),
                     dbias=torch.full_like(bias, float("nan")))
        cuda.backward(dout, q, k, v, out, lse, mask, bias, config=BwdConfig(64, 128, 64, 128, 12, 2), **grads,
                      **options)
        torch.cuda.synchronize()
        return grads

    expected, on_thread = backward(), {}
    thread = threading.Thread(target=lambda: on_thread.update(backward()))
    thread.start()
    thread.join()
    assert on_thread and all(torch.equal(on_thread[name], expected[name]) for name in expected)
    assert torch.isfinite(expected["dbias"]).all()


@pytest.mark.parametrize("how", ["argument", "torch-switch"])
def test_a_call_that_must_be_deterministic_runs_a_nondeterministic_dq_config_in_its_order(how):
    """With `deterministic=True`, or under `torch.use_deterministic_algorithms(True)`, a backward
    config marked nondeterministic_dq gives the ordered config's gradients bitwise, run after run;
    without either, its own: dK and dV bitwise the ordered config's, dQ within an fp32 sum's
    reordering of it (causal D128, 16 key blocks a query tile at most)."""
    from dmattn_kernels.cuda import arch_of

    ordered = BwdConfig(64, 128, 64, 128, 12, 2)
    if arch_of(torch.device("cuda")) != "sm90":
        pytest.skip("the warp-specialized backward runs on SM90 only")
    generator = torch.Generator(device="cuda").manual_seed(7)
    q, k, v, dout = (torch.randn(2, 2048, 4, 128, device="cuda", dtype=torch.bfloat16, generator=generator)
                     for _ in range(4))

    def grads(config: BwdConfig, deterministic: bool = False) -> list[torch.Tensor]:
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        flash_dmattn_func(*leaves, is_causal=True, backend="cuda", bwd_config=config,
                          deterministic=deterministic).backward(dout)
        return [leaf.grad for leaf in leaves]

    expected = grads(ordered)
    unordered = replace(ordered, nondeterministic_dq=1)
    if how == "argument":
        runs = [grads(unordered, deterministic=True) for _ in range(3)]
    else:
        torch.use_deterministic_algorithms(True)
        try:
            runs = [grads(unordered) for _ in range(3)]
        finally:
            torch.use_deterministic_algorithms(False)
    assert all(torch.equal(got, want) for run in runs for got, want in zip(run, expected))
    dq, dk, dv = grads(unordered)
    assert torch.equal(dk, expected[1]) and torch.equal(dv, expected[2])
    assert torch.isfinite(dq).all() and (dq.float() - expected[0].float()).abs().max() <= 2 ** -6 * dq.abs().max()


def test_the_warp_specialized_kernels_write_every_slice_in_any_section_order(monkeypatch):
    """Sections of the launch order (common.cuh: section_order) move CTAs, not arithmetic: with
    6 head slices in sections of 4 (the last short), the forward and backward write every output,
    bitwise as in one section of all 6."""
    from dmattn_kernels.cuda import forward

    cuda = get_backend("cuda")
    batch, seqlen, heads, head_dim = 3, 384, 2, 128
    q, k, v, dout, bias, mask, options = _masked_causal_call(5, batch, seqlen, heads, head_dim)
    kv_bytes, reread_bytes = 2 * seqlen * head_dim * 2, seqlen * head_dim * (2 * 2 + 4)  # launch's per slice

    def run(budget: int) -> dict[str, torch.Tensor]:
        monkeypatch.setattr(forward, "L2_SECTION_BYTES", budget)
        forward._signature_launch.cache_clear()
        nan = dict(fill_value=float("nan"))
        out, lse = torch.full_like(q, **nan), torch.full((batch, heads, seqlen), device="cuda", **nan)
        cuda.forward(q, k, v, mask, bias, config=FwdConfig(128, 128, 12, 2), out=out, lse=lse, **options)
        grads = dict(dq=torch.full_like(q, **nan), dk=torch.full_like(k, **nan), dv=torch.full_like(v, **nan),
                     dbias=torch.full_like(bias, **nan))
        cuda.backward(dout, q, k, v, out, lse, mask, bias, config=BwdConfig(64, 128, 64, 128, 12, 2), **grads,
                      **options)
        torch.cuda.synchronize()
        return dict(out=out, lse=lse, **grads)

    assert forward.section_slices(batch * heads, kv_bytes) == 6  # L2_SECTION_BYTES: one section
    one_section = run(forward.L2_SECTION_BYTES)
    # forward in sections of 4 and 2, backward of 2; then the backward in sections of 4 and 2
    for budget in (4 * kv_bytes, 4 * reread_bytes):
        in_sections = run(budget)
        assert all(torch.equal(in_sections[name], one_section[name]) for name in one_section)
    assert all(torch.isfinite(t).all() for name, t in one_section.items() if name != "lse")
    assert not torch.isnan(one_section["lse"]).any()
