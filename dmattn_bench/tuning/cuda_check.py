"""Compile-check of the CUDA kernels: every candidate of `configs/space/cuda-{fwd,bwd}.yaml`,
built with nvcc for each arch (no GPU needed), judged by the same rules as the Triton candidates
(`prune`).

A candidate is built in its extreme feature variants (every feature on, with an fp32 bias, and
for the backward GQA and a dBias with query rows; every feature off), which bound its registers,
and with a mask and a bias of the input dtype, which the SM90 warp-specialized kernels stage in
shared memory (and whose dBias the backward stores by TMA). Its shared memory needs no
compiling: the kernels' dynamic shared memory is exactly `dmattn_kernels.cuda.shared_bytes`.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterable

import torch

from dmattn_bench.hardware import parse_arch, search_section
from dmattn_bench.space import DIRECTIONS, BwdConfig, FwdConfig
from dmattn_bench.tuning.prune import WARP_SIZE, Candidate, _one_line, _resource_usage, load_space, precheck, space_path

ELEMENT = "element"  # in VARIANTS: the candidate's own dtype
VARIANTS = (  # (is_causal, has_mask, bias dtype, softcap, GQA group, dBias): every feature, none, staged
    (True, True, torch.float32, 1.0, 2, (True, torch.float32)),
    (False, False, None, 0.0, 1, None),
    (True, True, ELEMENT, 0.0, 1, (True, ELEMENT)),
)
CUDA_DTYPES = ("bf16", "fp16")


def _judge(direction: str, config: FwdConfig | BwdConfig, arch: str, head_dim: int, dtype: str) -> Candidate:
    from dmattn_kernels.cuda import backward_kernel, backward_variant, build, forward_kernel, shared_bytes, variant

    limits = parse_arch(arch)
    start = time.perf_counter()
    shared = shared_bytes(config, head_dim, limits.arch)

    def verdict(status: str, reason: str = "", check: str = "", registers=None, stack=None) -> Candidate:
        return Candidate(direction, config, limits.arch, head_dim, dtype, status, reason, shared, check, registers, stack,
                         round(time.perf_counter() - start, 3))

    pruned = precheck(direction, config, limits, head_dim, dtype, "cuda")
    if pruned is not None:
        return pruned
    element = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    registers, stack = None, None
    for is_causal, has_mask, bias_dtype, softcap, group, dbias in VARIANTS:
        bias_dtype = element if bias_dtype == ELEMENT else bias_dtype
        dbias = (dbias[0], element) if dbias is not None and dbias[1] == ELEMENT else dbias
        features = dict(is_causal=is_causal, has_mask=has_mask, softcap=softcap)
        if direction == "fwd":
            flags = variant(config, head_dim, element, bias_dtype, arch=limits.arch, **features)
        else:
            flags = backward_variant(config, head_dim, element, bias_dtype, arch=limits.arch, group=group,
                                     dbias=dbias, **features)
        try:
            source = (forward_kernel(config, head_dim, limits.arch) if direction == "fwd"
                      else backward_kernel(config, head_dim, limits.arch))
            cubin = build.build(source, limits.arch, flags)
        except build.CudaBuildError as exc:
            return verdict("compile_error", _one_line(exc), "compile")
        regs, spill = _resource_usage(Path(cubin).read_bytes())
        if regs is not None:
            registers, stack = max(registers or 0, regs), max(stack or 0, spill)
    threads = config.num_warps * WARP_SIZE
    if registers is not None and registers * threads > limits.registers_per_sm:
        return verdict("unsupported", f"{registers} registers x {threads} threads > {limits.registers_per_sm} "
                                      f"per SM on {limits.arch}", "registers", registers, stack)
    return verdict("fits", registers=registers, stack=stack)


def check_cuda_space(space_dir: str | Path, archs: Iterable[str], head_dims: Iterable[int], dtype: str = "bf16",
                     jobs: int | None = None, on_result: Callable[[Candidate], None] | None = None) -> list[Candidate]:
    """Judges every CUDA candidate of both directions for each arch and head dim, in plan order.

    nvcc runs as a subprocess, so threads compile in parallel (`jobs`, default the CPU count).

    Raises:
        ValueError: a dtype the CUDA kernels do not take, an unknown arch or a malformed space.
    """
    if dtype not in CUDA_DTYPES:
        raise ValueError(f"dtype: the cuda kernels take {' or '.join(CUDA_DTYPES)}, got {dtype!r}")
    plan = [(direction, arch, config, head_dim) for direction in DIRECTIONS for arch in archs
            for config in load_space(space_path(space_dir, "cuda", direction), "cuda", direction,
                                     search_section(parse_arch(arch)))
            for head_dim in head_dims]

    def judge(item) -> Candidate:
        direction, arch, config, head_dim = item
        try:
            candidate = _judge(direction, config, arch, head_dim, dtype)
        except Exception as exc:  # noqa: BLE001 - a failed candidate is data
            candidate = Candidate(direction, config, parse_arch(arch).arch, head_dim, dtype, "compile_error",
                                  _one_line(exc), None, "compile")
        if on_result:
            on_result(candidate)
        return candidate

    with ThreadPoolExecutor(max(1, jobs or os.cpu_count() or 1)) as pool:
        return list(pool.map(judge, plan))
