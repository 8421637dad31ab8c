"""Pruning a search space before any GPU time: structural checks, a shared-memory estimate, and
cross-compilation of each surviving candidate for its target arch (DESIGN §3).

Cross-compilation (`triton.compile` with a `GPUTarget`) needs no GPU and reports the kernel's
real shared-memory use; `cuobjdump --dump-resource-usage` on the cubin reports its registers and
stack (spill) bytes. A candidate that does not fit or does not compile is data (a status and a
reason), never an exception.

Compiles run in worker processes started with `spawn` whose environment has `TRITON_INTERPRET`
removed before the kernels are imported: under the interpreter `@triton.jit` yields an
`InterpretedFunction`, which cannot be compiled.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict, dataclass
from multiprocessing import get_context
from pathlib import Path

from dmattn_bench.hardware import ArchLimits, parse_arch, search_section
from dmattn_bench.space import (
    ARCH_FAMILIES,
    CONFIG_CLASSES,
    TUNED_DIRECTIONS,
    AttentionShape,
    BwdConfig,
    DecodeConfig,
    FwdConfig,
    expand_grid,
    load_yaml,
)
from dmattn_bench.tiles import MIN_KEY_TILE  # the fit rule stops halving a key tile there
from dmattn_bench.tuning.workers import abandon_pool
from dmattn_kernels.compile_process import compile_for_real

Config = FwdConfig | BwdConfig | DecodeConfig

STATUSES = ("fits", "unsupported", "compile_error")
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
# The feature variants a config must serve, compiled for each candidate (the fit is the max over
# them). Causal + bias (+ dBias with query rows) carry the most tiles; softcap adds none; GROUP
# alone only changes head arithmetic. Both mask settings are compiled: with a mask the loops walk
# a block list and carry the next mask tile, without one they do neither, so shared memory and
# registers differ between the two. The dK/dV kernel's group mode (a GQA dBias with
# query rows) holds one more fp32 tile, so it is a variant of its own; a variant is compiled only
# for the kernels that take every flag it changes (`_serves`). A per-key bias (BIAS_PER_KEY) reads a
# key vector where a full bias reads a tile, so the full bias is the worst case. The short-query
# forward reads a mask and bias row per query row unless every row of a program shares one
# (MASK_SHARED, BIAS_SHARED), and its key tiles through a block table when the cache is paged: it
# is compiled paged and contiguous, and with a padding mask's span scan and span pass (MASK_SPANS,
# the chunks of a 32k cache), which hold other registers than a tile of mask rows. A sliding window
# (HAS_WINDOW) adds a loop over its leading edge tiles; packed sequences (VARLEN) read their mask
# tile by tile without a block list (LISTED off) and their K/V by pointer.
WORST_CASE_FEATURES = dict(
    IS_CAUSAL=True, HAS_MASK=True, HAS_BIAS=True, HAS_SOFTCAP=False,
    HAS_DBIAS=True, DBIAS_ROWS=True, GROUP=1, HEADS_PER_PROGRAM=1, BIAS_PER_KEY=False,
    HAS_SEQLENS=True, MASK_SHARED=False, BIAS_SHARED=False, PAGED=True, PAGE_SIZE=256,
    MASK_SPANS=False, SPAN_CHUNKS=1, LISTED=True, VARLEN=False, HAS_SEQUSED=False, HAS_WINDOW=True,
)
FEATURE_VARIANTS = (
    WORST_CASE_FEATURES,
    dict(WORST_CASE_FEATURES, HAS_MASK=False),
    dict(WORST_CASE_FEATURES, GROUP=4, HEADS_PER_PROGRAM=4),
    dict(WORST_CASE_FEATURES, GROUP=4, HEADS_PER_PROGRAM=4, HAS_MASK=False),
    dict(WORST_CASE_FEATURES, LISTED=False, VARLEN=True, HAS_SEQUSED=True),
    dict(WORST_CASE_FEATURES, PAGED=False, PAGE_SIZE=0),
    dict(WORST_CASE_FEATURES, MASK_SHARED=True, MASK_SPANS=True, SPAN_CHUNKS=16),
)
# Strides that are 1 in a contiguous launch: Triton specializes an int argument equal to 1 into a
# constexpr, which enables vectorized loads (and so changes shared-memory use).
UNIT_STRIDES = ("stride_qd", "stride_kd", "stride_vd", "stride_od", "stride_dod", "stride_dkd",
                "stride_dvd", "stride_dqd", "stride_mn", "stride_bn", "stride_dbn", "stride_dsn", "stride_lm")
# Ints a launch may or may not pass as multiples of 16 (everything else is: pointers, row/head/batch
# strides). Triton specializes on it, and it changes what gets pipelined: a 16-divisible seqlen_k
# lets the bias tile load become an async copy with a buffer per stage (Triton 3.6, sm90, bf16 bias,
# fwd 64x128 w8 s3 D128: 221240 B with seqlen_k 1000, 254008 B with 1024, over the 232448 B limit).
UNALIGNED_INTS = ("num_heads", "seqlen_q", "seqlen_k", "mask_head_div", "bias_head_div")
FP32_POINTERS = ("lse_ptr", "delta_ptr", "dbias_ptr", "ds_ptr")
BIAS_POINTERS = ("bias_ptr",)  # the input dtype or fp32 (DESIGN §1)
# What a launch varies beyond the feature flags, compiled for every variant (the fit is the max):
# lengths 16-divisible or not, times the bias in the input dtype or in fp32. Neither axis is
# monotone in shared memory: fp32 bias is larger per tile, but 16-bit bias tiles get pipelined.
SPECIALIZATIONS = tuple(dict(ints_aligned=aligned, bias_fp32=fp32) for aligned in (False, True) for fp32 in (False, True))
U8_POINTERS = ("mask_ptr",)  # bool masks are launched as a uint8 view
# block lists, cache lengths, a paged cache's table, mask spans, packed sequences' prefix sums and key counts
I32_POINTERS = ("blocks_ptr", "seqlens_ptr", "block_table_ptr", "spans_ptr", "cu_seqlens_q_ptr", "cu_seqlens_k_ptr",
                "seqused_k_ptr")
KV_DESCRIPTORS = ("k_desc", "v_desc")  # the forward's K/V: TMA descriptors where `forward.kv_by_tma`, else pointers
FP32_SCALARS = ("softmax_scale", "softcap")
WARP_SIZE = 32
ERROR_REASON_CHARS = 200
CUOBJDUMP_TIMEOUT_S = 60


@dataclass
class Candidate:
    """One (direction, config, arch, head_dim, dtype) and the verdict on it.

    Attributes:
        status: "fits", "unsupported" (structural, estimated or real limits) or "compile_error".
        reason: why it does not fit ("" when it fits), one line.
        shared_bytes: real shared memory (max over the direction's kernels) when compiled, else
            the estimate when pruned by it, else None.
        check: which check decided: "structure", "threads", "estimate", "shared", "registers",
            "compile" or "" for a fit.
        registers: registers per thread (max over kernels) from the cubin, when readable.
        stack_bytes: per-thread stack (register spills) from the cubin, when readable.
        compile_s: wall seconds spent compiling (None when not compiled).
    """

    direction: str
    config: Config
    arch: str
    head_dim: int
    dtype: str
    status: str
    reason: str
    shared_bytes: int | None
    check: str = ""
    registers: int | None = None
    stack_bytes: int | None = None
    compile_s: float | None = None

    def to_dict(self) -> dict:
        data = asdict(self)
        data["config"] = self.config.to_dict()
        return data


# -- search spaces ------------------------------------------------------------------------------

def read_yaml_mapping(path: str | Path) -> dict:
    data = load_yaml(path)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping at the top level")
    return data


def load_space(path: str | Path, backend: str, direction: str, section: str) -> list[Config]:
    """The configs of one arch section of a `configs/space/<backend>-<direction>.yaml` file.

    Raises:
        ValueError: the file's backend/direction differ from the ones asked for, the section is
            missing, or an axis is malformed (always naming the file and the section).
    """
    data = read_yaml_mapping(path)
    for key, want in (("backend", backend), ("direction", direction)):
        if data.get(key) != want:
            raise ValueError(f"{path}: {key} is {data.get(key)!r}, expected {want!r}")
    sections = data.get("arch")
    if not isinstance(sections, dict):
        raise ValueError(f"{path}: missing the 'arch' mapping of sections {list(ARCH_FAMILIES)}")
    if section not in sections:
        raise ValueError(f"{path}: no section {section!r} under 'arch' (has {sorted(sections)})")
    axes = sections[section]
    if not isinstance(axes, dict):
        raise ValueError(f"{path}: arch.{section} must map parameter names to lists of values")
    return expand_grid(direction, axes, f"{path}: arch.{section}")


def load_ci_space(path: str | Path, backend: str, direction: str) -> list[Config]:
    """The configs of `space.<backend>.<direction>` in `configs/ci.yaml`.

    Raises:
        ValueError: a missing or malformed entry (naming the file and the key).
    """
    data = read_yaml_mapping(path)
    axes = (data.get("space") or {}).get(backend, {}).get(direction)
    where = f"{path}: space.{backend}.{direction}"
    if not isinstance(axes, dict):
        raise ValueError(f"{where}: missing, or not a mapping of parameter names to lists of values")
    return expand_grid(direction, axes, where)


def space_path(space_dir: str | Path, backend: str, direction: str) -> Path:
    """Where the search space of a backend and direction lives (`<dir>/<backend>-<direction>.yaml`)."""
    return Path(space_dir) / f"{backend}-{direction}.yaml"


# -- cheap checks -------------------------------------------------------------------------------

def estimate_shared_bytes(direction: str, config: Config, head_dim: int, dtype_bytes: int) -> int:
    """A lower bound of shared memory, to prune before compiling: nothing it rejects could fit.

    Each tunable kernel keeps its outer tile in shared memory once and, pipelined (the unmasked
    variant of FEATURE_VARIANTS), at least one inner-loop tile per stage. With
    D = head_block(head_dim), b = dtype_bytes and S = num_stages:
        fwd:  (BLOCK_M + BLOCK_N * S) * D * b                     q once, k per stage
        bwd:  max((BLOCK_N + BLOCK_M * S) * D * b,                dK/dV: k once, q per stage
                  (BLOCK_M_DQ + BLOCK_N_DQ * S) * D * b)          dQ:    q once, k per stage
        decode: BLOCK_N * S * D * b                               k per stage (the query tile's
                                                                  rows follow the shape)
    v, dO, the bias tile and layout-conversion scratch come on top, so the real use is higher.
    Measured (Triton 3.9, bf16, D 64/128, sm80/sm90/sm120, the 336 candidates of
    configs/space, 2026-11): real / estimate is 1.33-3.75 fwd, 1.58-3.63 bwd. It bounds the
    default variants only: a masked-only compile is not pipelined and may use less.
    """
    width = _head_block(head_dim)
    stages = config.num_stages
    if direction == "fwd":
        return (config.block_m + config.block_n * stages) * width * dtype_bytes
    if direction == "bwd":
        dkdv = (config.block_n + config.block_m * stages) * width * dtype_bytes
        dq = (config.block_m_dq + config.block_n_dq * stages) * width * dtype_bytes
        return max(dkdv, dq)
    if direction == "decode":
        return config.block_n * stages * width * dtype_bytes
    raise ValueError(f"direction: got {direction!r}, expected one of {TUNED_DIRECTIONS}")


def _head_block(head_dim: int) -> int:
    """Mirror of `layouts.head_block` (importing it would import the kernels: any module of
    `dmattn_kernels.triton` loads the package, which loads them)."""
    return max(16, 1 << (max(head_dim, 1) - 1).bit_length())


def _worst_shape(head_dim: int) -> AttentionShape:
    """Every feature on, query heads grouped (a knob of GQA calls, `BwdConfig.kv_group`, is judged
    too; each workload's own shape rules it out where it has no groups)."""
    return AttentionShape(1, 128, 128, 2, 1, head_dim, is_causal=True, has_mask=True, has_bias=True,
                          bias_requires_grad=True)


def precheck(direction: str, config: Config, limits: ArchLimits, head_dim: int, dtype: str,
             backend: str = "triton") -> Candidate | None:
    """The candidate as "unsupported" when a check without compiling rules it out, else None.

    A CUDA kernel's shared memory is known exactly before compiling (`dmattn_kernels.cuda.shared_bytes`); a
    Triton kernel's is estimated here and read from the compiled kernel later.
    """
    from dmattn_bench.registry import get_backend

    def unsupported(check: str, reason: str, shared: int | None = None) -> Candidate:
        return Candidate(direction, config, limits.arch, head_dim, dtype, "unsupported", reason, shared, check)

    reason = get_backend(backend).is_supported(config, _worst_shape(head_dim))
    if reason:
        return unsupported("structure", reason)
    threads = config.num_warps * WARP_SIZE
    if threads > limits.max_threads_per_block:
        return unsupported("threads", f"{threads} threads > {limits.max_threads_per_block} per block on {limits.arch}")
    if backend == "cuda":
        from dmattn_kernels.cuda import arch_reason, shared_bytes

        reason = arch_reason(config, head_dim, limits.arch)
        if reason:
            return unsupported("structure", reason)
        shared = shared_bytes(config, head_dim, limits.arch)
        if shared > limits.shared_memory_per_block:
            return unsupported("shared", f"shared memory {shared} B > {limits.shared_memory_per_block} B limit of "
                                         f"{limits.arch}", shared)
        return None
    estimate = estimate_shared_bytes(direction, config, head_dim, DTYPE_BYTES[dtype])
    if estimate > limits.shared_memory_per_block:
        return unsupported("estimate", f"estimated shared memory {estimate} B > "
                                       f"{limits.shared_memory_per_block} B limit of {limits.arch}", estimate)
    return None


# -- cross-compilation --------------------------------------------------------------------------

def _kernel_functions(direction: str) -> list:
    """The kernels of `direction` that have tunables (`dmattn_kernels.triton.launch.KERNELS`)."""
    from dmattn_kernels.triton import flash_bwd, flash_decode, flash_fwd
    from dmattn_kernels.triton.launch import KERNELS

    module = {"fwd": flash_fwd, "bwd": flash_bwd, "decode": flash_decode}[direction]
    return [getattr(module, name) for name in KERNELS[direction]]


def _kernels_compilable() -> bool:
    """Whether the kernels imported in this process are JIT functions (not interpreted)."""
    from triton.runtime.jit import JITFunction

    return isinstance(_kernel_functions("fwd")[0], JITFunction)


def _source(fn, dtype: str, constexprs: dict, ints_aligned: bool = False, bias_fp32: bool = True):
    """An ASTSource specialized as a contiguous launch would be (unit strides, 16-aligned pointers
    and strides); `ints_aligned` marks UNALIGNED_INTS 16-divisible too, `bias_fp32` picks the
    bias dtype (else the input dtype)."""
    from triton.compiler import ASTSource

    signature, values, attrs = {}, {}, {}
    for index, name in enumerate(fn.arg_names):
        if name in constexprs or name in UNIT_STRIDES:
            signature[name] = "constexpr"
            values[name] = constexprs.get(name, 1)
            continue
        if name in KV_DESCRIPTORS and constexprs.get("USE_TMA"):
            # the (B, Lk, Hkv, D) descriptor of one (BLOCK_N, BLOCK_D) tile (`forward.ForwardPlan`'s descriptors)
            signature[name] = f"tensordesc<{dtype}[1, {constexprs['BLOCK_N']}, 1, {constexprs['BLOCK_D']}]>"
            continue
        if name.endswith("_ptr") or name in KV_DESCRIPTORS:
            signature[name] = ("*u8" if name in U8_POINTERS else "*i32" if name in I32_POINTERS
                               else "*fp32" if name in FP32_POINTERS or (bias_fp32 and name in BIAS_POINTERS)
                               else f"*{dtype}")
        elif name in FP32_SCALARS:
            signature[name] = "fp32"
            continue
        else:
            signature[name] = "i32"
            if name in UNALIGNED_INTS and not ints_aligned:
                continue
        attrs[(index,)] = [["tt.divisibility", 16]]
    return ASTSource(fn=fn, signature=signature, constexprs=values, attrs=attrs)


_RESOURCE = re.compile(r"REG:(\d+)\s+STACK:(\d+)")


def _resource_usage(cubin: bytes | None) -> tuple[int | None, int | None]:
    """(registers, stack bytes) per thread from `cuobjdump --dump-resource-usage`, the largest
    over the cubin's kernels, or (None, None)."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not cubin or not tool.exists():
        return None, None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as handle:
        handle.write(cubin)
        handle.flush()
        try:
            done = subprocess.run([str(tool), "--dump-resource-usage", handle.name], capture_output=True,
                                  text=True, timeout=CUOBJDUMP_TIMEOUT_S, check=False)
        except (OSError, subprocess.TimeoutExpired):
            return None, None
    found = [(int(registers), int(stack)) for registers, stack in _RESOURCE.findall(done.stdout)]
    if not found:
        return None, None
    return max(registers for registers, _ in found), max(stack for _, stack in found)


def _one_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = f"{type(exc).__name__}: {lines[-1] if lines else ''}".rstrip(": ")
    return text[:ERROR_REASON_CHARS]


def _variants(features: Mapping[str, object] | Sequence[Mapping[str, object]] | None) -> list[dict]:
    """Feature variants to compile: FEATURE_VARIANTS, or each given mapping over WORST_CASE_FEATURES."""
    if features is None:
        return [dict(v) for v in FEATURE_VARIANTS]
    if isinstance(features, Mapping):
        features = [features]
    return [dict(WORST_CASE_FEATURES, **variant) for variant in features]


def _specializations(flags: Mapping[str, object], dtype: str) -> list[dict]:
    """SPECIALIZATIONS that differ for this variant: the bias dtype only matters with a bias."""
    distinct_bias = flags["HAS_BIAS"] and dtype != "fp32"
    return [spec for spec in SPECIALIZATIONS if distinct_bias or spec["bias_fp32"]]


def _serves(fn, flags: Mapping[str, object]) -> bool:
    """Whether a feature variant applies to kernel `fn`: it takes every flag the variant changes."""
    return all(name in fn.arg_names for name, value in flags.items() if WORST_CASE_FEATURES.get(name) != value)


def _compile_jobs(direction: str, config: Config, major: int, head_dim: int, dtype: str,
                  features: Mapping[str, object] | Sequence[Mapping[str, object]] | None):
    """Every compile a candidate's fit is the max over, as (kernel, constexprs, specialization, label):
    feature variants x the kernels they serve x K/V by pointer or descriptor x SPECIALIZATIONS.

    Where the forward may load K/V by TMA it still takes pointer loads on views the copy engine
    cannot read (`forward.kv_by_tma`): both variants must fit, and they differ (Triton 3.6, sm90,
    fwd 64x128 w8 s3 D128, fp32 bias: 286720 B with pointers, 286776 B with descriptors).
    """
    from dmattn_kernels.triton.forward import TMA_ARCH_MAJORS
    from dmattn_kernels.triton.launch import tile_constexprs

    tma_variants = (False, True) if major in TMA_ARCH_MAJORS else (False,)
    for flags in _variants(features):
        for fn in filter(lambda fn: _serves(fn, flags), _kernel_functions(direction)):
            # packed sequences load K/V by pointer (`forward.kv_by_tma`)
            uses_tma = "USE_TMA" in fn.arg_names
            for use_tma in ((False,) if uses_tma and flags["VARLEN"] else tma_variants if uses_tma else (None,)):
                constexprs = {name: value for name, value in flags.items() if name in fn.arg_names}
                constexprs.update(HEAD_DIM=head_dim, BLOCK_D=_head_block(head_dim), **tile_constexprs(fn.__name__, config))
                if use_tma is not None:
                    constexprs["USE_TMA"] = use_tma
                for spec in _specializations(flags, dtype):
                    labels = [fn.__name__, f"HAS_MASK={flags['HAS_MASK']}"]
                    labels += [f"HEADS_PER_PROGRAM={flags['HEADS_PER_PROGRAM']}"] if flags["HEADS_PER_PROGRAM"] > 1 else []
                    labels += ["USE_TMA=True"] if use_tma else []
                    labels += ["lengths 16-divisible"] if spec["ints_aligned"] else []
                    labels += [f"{dtype} bias"] if flags["HAS_BIAS"] and not spec["bias_fp32"] else []
                    yield fn, constexprs, spec, " ".join(labels)


def _compile_here(direction: str, config: Config, arch: str, head_dim: int, dtype: str,
                  features: Mapping[str, object] | Sequence[Mapping[str, object]] | None) -> Candidate:
    """Cross-compiles in this process (its kernels must be JIT functions, not interpreted)."""
    import triton
    from triton.backends.compiler import GPUTarget

    limits = parse_arch(arch)
    major, minor = limits.compute_capability
    target = GPUTarget("cuda", major * 10 + minor, WARP_SIZE)
    shared, registers, stack, heaviest, kernels_compiled = 0, None, None, "", 0
    start = time.perf_counter()

    def verdict(status: str, reason: str = "", check: str = "") -> Candidate:
        return Candidate(direction, config, limits.arch, head_dim, dtype, status, reason,
                         shared if status != "compile_error" else None, check, registers, stack,
                         round(time.perf_counter() - start, 3))

    for fn, constexprs, spec, where in _compile_jobs(direction, config, major, head_dim, dtype, features):
        # the forward runs an fp32 bias under 16-bit inputs with key tiles halved until they fit
        # (`dmattn_bench.tiles.fit_forward`); everything else runs the config's own tiles
        fallback = direction == "fwd" and spec["bias_fp32"] and dtype != "fp32" and constexprs.get("HAS_BIAS", False)
        while True:
            try:
                compiled = triton.compile(_source(fn, dtype, constexprs, **spec), target=target,
                                          options=dict(num_warps=config.num_warps, num_stages=config.num_stages))
            except Exception as exc:  # noqa: BLE001 - a failed candidate is data
                return verdict("compile_error", f"{where}: {_one_line(exc)}", "compile")
            if not fallback or compiled.metadata.shared <= limits.shared_memory_per_block or constexprs["BLOCK_N"] <= MIN_KEY_TILE:
                break
            constexprs = dict(constexprs, BLOCK_N=constexprs["BLOCK_N"] // 2)
            where = f"{where} at BLOCK_N={constexprs['BLOCK_N']}"
        kernels_compiled += 1
        if int(compiled.metadata.shared) > shared:
            shared, heaviest = int(compiled.metadata.shared), where
        regs, spill = _resource_usage(compiled.asm.get("cubin"))
        if regs is not None:
            registers = max(registers or 0, regs)
            stack = max(stack or 0, spill)

    if not kernels_compiled:
        return verdict("compile_error", "no kernel of this direction takes the requested feature flags", "compile")
    if shared > limits.shared_memory_per_block:
        return verdict("unsupported", f"shared memory {shared} B > {limits.shared_memory_per_block} B "
                                      f"limit of {limits.arch} ({heaviest})", "shared")
    threads = config.num_warps * WARP_SIZE
    if registers is not None and registers * threads > limits.registers_per_sm:
        return verdict("unsupported", f"{registers} registers x {threads} threads > "
                                      f"{limits.registers_per_sm} per SM on {limits.arch}", "registers")
    return verdict("fits")


def _worker_compile(direction, config, arch, head_dim, dtype, features) -> Candidate:
    if not _kernels_compilable():
        raise RuntimeError("the kernels were imported under TRITON_INTERPRET=1 in the compile worker")
    return _compile_here(direction, config, arch, head_dim, dtype, features)


def _pool(workers: int) -> ProcessPoolExecutor:
    return ProcessPoolExecutor(max_workers=workers, mp_context=get_context("spawn"), initializer=compile_for_real)


def compile_candidate(direction: str, config: Config, arch: str, head_dim: int, dtype: str,
                      features: Mapping[str, object] | Sequence[Mapping[str, object]] | None = None) -> Candidate:
    """Cross-compiles every tunable kernel of `direction` for `arch` and judges the fit.

    Args:
        features: constexpr flags: one mapping or a list of them (variants), each over
            WORST_CASE_FEATURES; default FEATURE_VARIANTS (with and without a mask, and the dK/dV
            group mode with and without one).

    Returns:
        The candidate with the max shared memory, registers and stack over kernels and variants.
        In a process whose kernels run in the interpreter, the compile happens in one spawned
        worker.
    """
    if direction not in TUNED_DIRECTIONS:
        raise ValueError(f"direction: got {direction!r}, expected one of {TUNED_DIRECTIONS}")
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype: got {dtype!r}, expected one of {sorted(DTYPE_BYTES)}")
    if _kernels_compilable():
        return _compile_here(direction, config, arch, head_dim, dtype, features)
    return _compile_all([(0, (direction, config, arch, head_dim, dtype, features))], 1, None)[0][1]


def _run_guarded(future: Future, direction, config, arch, head_dim, dtype) -> Candidate:
    """The future's candidate; a dead or failing worker becomes a compile_error."""
    try:
        return future.result()
    except BrokenProcessPool:
        raise
    except Exception as exc:  # noqa: BLE001 - a failed candidate is data
        return Candidate(direction, config, parse_arch(arch).arch, head_dim, dtype, "compile_error",
                         _one_line(exc), None, "compile")


# -- a whole space ------------------------------------------------------------------------------

Spaces = Sequence[str | Path] | Mapping[str, Sequence[Config]]


def _configs_for(spaces: Spaces, section: str) -> list[tuple[str, Config]]:
    """(direction, config) pairs: from Triton space files (their `section`) or a {direction: configs} map."""
    if isinstance(spaces, Mapping):
        pairs = []
        for direction, configs in spaces.items():
            if direction not in CONFIG_CLASSES:
                raise ValueError(f"direction: got {direction!r}, expected one of {TUNED_DIRECTIONS}")
            cls = CONFIG_CLASSES[direction]
            for config in configs:
                if not isinstance(config, cls):
                    raise ValueError(f"{direction}: expected {cls.__name__}, got {type(config).__name__}")
                pairs.append((direction, config))
        return pairs
    pairs = []
    for path in spaces:
        data = read_yaml_mapping(path)
        direction = data.get("direction")
        if direction not in TUNED_DIRECTIONS:
            raise ValueError(f"{path}: direction is {direction!r}, expected one of {TUNED_DIRECTIONS}")
        pairs += [(direction, c) for c in load_space(path, "triton", direction, section)]
    return pairs


def plan_space(spaces: Spaces, archs: Iterable[str], head_dims: Iterable[int]) -> list[tuple[str, str, Config, int]]:
    """Every (arch, direction, config, head_dim) to judge, in order: arch, space, config, head dim.

    Each file in `spaces` contributes its section for each arch (`hardware.search_section`); a
    mapping {direction: configs} gives the same configs to every arch.

    Raises:
        ValueError: an unknown arch or a malformed space (naming the file and the section).
    """
    head_dims = list(head_dims)
    items = []
    for arch in archs:
        limits = parse_arch(arch)
        for direction, config in _configs_for(spaces, search_section(limits)):
            items += [(limits.arch, direction, config, head_dim) for head_dim in head_dims]
    return items


def check_space(
    spaces: Spaces,
    archs: Iterable[str],
    head_dims: Iterable[int],
    dtype: str = "bf16",
    jobs: int | None = None,
    on_result: Callable[[Candidate], None] | None = None,
    features: Mapping[str, object] | Sequence[Mapping[str, object]] | None = None,
    estimate: bool = True,
) -> list[Candidate]:
    """Judges every candidate of `plan_space(spaces, archs, head_dims)` for the Triton kernels.

    Structural checks and the shared-memory estimate prune first (no compiling); the rest are
    cross-compiled in parallel spawned workers (`min(cpu_count, jobs)`). `estimate=False`, or
    any `features` (see `compile_candidate`), compiles what the estimate would prune.

    Returns:
        The candidates in plan order, whatever the order they finished in; `on_result` is called
        as each one is decided.
    """
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype: got {dtype!r}, expected one of {sorted(DTYPE_BYTES)}")
    results: list[Candidate | None] = []
    todo: list[tuple[int, tuple]] = []
    for arch, direction, config, head_dim in plan_space(spaces, archs, head_dims):
        pruned = precheck(direction, config, parse_arch(arch), head_dim, dtype)
        # the estimate bounds the default variants; other features are judged by compiling
        use_estimate = estimate and features is None
        if pruned is not None and (use_estimate or pruned.check != "estimate"):
            results.append(pruned)
            if on_result:
                on_result(pruned)
            continue
        results.append(None)
        todo.append((len(results) - 1, (direction, config, arch, head_dim, dtype, features)))
    if todo:
        for index, candidate in _compile_all(todo, jobs, on_result):
            results[index] = candidate
    return results  # type: ignore[return-value]


def _compile_all(todo: list[tuple[int, tuple]], jobs: int | None, on_result) -> list[tuple[int, Candidate]]:
    """Compiles in a spawn pool; a candidate whose worker died is retried alone once."""
    workers = max(1, min(os.cpu_count() or 1, jobs or os.cpu_count() or 1, len(todo)))
    done: list[tuple[int, Candidate]] = []
    crashed: list[tuple[int, tuple]] = []
    with _pool(workers) as pool:
        futures = {pool.submit(_worker_compile, *args): (index, args) for index, args in todo}
        try:
            for future in as_completed(futures):
                index, args = futures[future]
                try:
                    candidate = _run_guarded(future, *args[:5])
                except BrokenProcessPool:
                    crashed.append((index, args))
                    continue
                done.append((index, candidate))
                if on_result:
                    on_result(candidate)
        except KeyboardInterrupt:
            abandon_pool(pool)
            raise
    for index, args in crashed:
        with _pool(1) as pool:
            try:
                candidate = _run_guarded(pool.submit(_worker_compile, *args), *args[:5])
            except BrokenProcessPool as exc:
                direction, config, arch, head_dim, dtype, _ = args
                candidate = Candidate(direction, config, arch, head_dim, dtype, "compile_error",
                                      f"compiler process died: {_one_line(exc)}", None, "compile")
        done.append((index, candidate))
        if on_result:
            on_result(candidate)
    return done
