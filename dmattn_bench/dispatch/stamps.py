"""A dispatch-table entry's stamp: a fingerprint of the code that entry runs (DESIGN §3).

An entry runs the kernels its backend's launchers plan for its key and config on its device's
arch. `entry_programs` builds those plans on data-less tensors for the calls an entry serves
(`representative_calls`) inside `dmattn_kernels.target.planning_for`, which records each kernel
with the compile-time parameters its launcher passed (constexprs and options, -D lists). The
stamp hashes the specialised source of each (`specialise`: dead constexpr and `#if` branches
removed), the compile options and the arch. So:

- an edit that changes no compiled code (a comment, moved or renamed host code, a knob left
  off) changes no stamp;
- an edit to a kernel, a helper it calls, a header it includes, or a launcher line that changes
  what a launch passes, changes the stamps of exactly the entries whose programs it touches
  (down to a constexpr branch in Triton, to a translation unit and its `#if` branches in CUDA);
- the stamp is computed without a GPU and independently of the installed Triton and nvcc.

Not stamped: host logic such as grids, split counts and section sizes, which the CPU and GPU
test tiers cover. An entry's status (`entry_status`): "stale" when its table declares it so
(its GPU could not re-validate it after a change) or its recorded stamp differs from the code
installed here, "unvalidated" when it records no validation, else "current". Only current entries
are used.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import lru_cache
from typing import Iterator

import torch

from dmattn_bench import specialise
from dmattn_bench.dispatch.table import LEGACY_PREFIX
from dmattn_bench.sourcehash import DIGEST_HEX_CHARS
from dmattn_bench.space import DTYPES, BwdConfig, DecodeConfig, FwdConfig, InvalidConfig, TableKey

STAMP_RULES = b"dmattn-bench entry stamp, rules 1\n"  # bumped when what a stamp covers changes

HEADS_KV = 2  # KV heads of a representative call (a group of query heads each, by the key's GQA ratio)
SOFTCAP = 30.0  # a representative softcap (any positive value compiles the same code)
PAGE_SIZES = (16, 256)  # paged caches a decode entry serves: vLLM's 16-key pages, FlashAttention's 256


NO_WINDOW = (-1, -1)
PACKED_SEQUENCES = 2  # sequences of a representative packed call (its programs do not depend on it)


@dataclass(frozen=True)
class Call:
    """One kind of call an entry serves: what, besides the key, decides which programs it launches."""

    seqlen_k: int
    softcap: bool
    bias_fp32: bool
    lse_grad: bool = False  # bwd: a gradient reaching lse
    cache_lengths: bool = False  # decode: per-sequence cache_seqlens
    page: int = 0  # decode: a paged cache of pages this long (0: none)
    window: tuple[int, int] = NO_WINDOW  # a windowed key's (left, right) (`representative_window`)
    packed: bool = False  # packed sequences (`configs.Packing`), seqlen_k the longest's keys
    seqused: bool = False  # packed: key counts from seqused_k

    def label(self) -> str:
        # a dense call's label is the one it had before windows and packing (its stamp unchanged)
        label = (f"Lk{self.seqlen_k} softcap={int(self.softcap)} bias_fp32={int(self.bias_fp32)} "
                 f"dlse={int(self.lse_grad)} seqlens={int(self.cache_lengths)} page={self.page}")
        if self.window != NO_WINDOW:
            label += f" window={self.window[0]},{self.window[1]}"
        if self.packed:
            label += f" packed seqused={int(self.seqused)}"
        return label


def representative_window(key: TableKey) -> tuple[int, int]:
    """A window of exactly `key.window` keys (its span, `space.window_bucket`): (window - 1, 0)
    under causal, about half on each side of the diagonal otherwise; no window for a key
    without one."""
    if not key.window:
        return NO_WINDOW
    left = key.window - 1 if key.causal else key.window // 2
    return left, key.window - 1 - left


def representative_calls(key: TableKey) -> list[Call]:
    """The calls an entry of `key` serves, as far as they change its programs: with and without
    softcap; a bias in the input's dtype and in fp32; a key length of the bucket and one past it
    (an odd length: alignment-dependent paths); for the backward, with and without an lse
    gradient; for the short-query forward, with and without cache lengths, unpaged and paged. A
    windowed key's calls have its `representative_window`; a packed key's are packed, with key
    counts from the prefix sums and from seqused_k."""
    has_bias = key.bias != "none"
    lengths = (key.seqlen_k_bucket,) if key.seqlen_k_bucket == 1 else (key.seqlen_k_bucket, key.seqlen_k_bucket + 1)
    window = representative_window(key)
    packings = (dict(packed=True, seqused=False), dict(packed=True, seqused=True)) if key.packed else ({},)
    calls = []
    for seqlen_k in lengths:
        for softcap in (False, True):
            for bias_fp32 in ((False, True) if has_bias else (False,)):
                for packing in packings:
                    if key.direction == "bwd":
                        calls += [Call(seqlen_k, softcap, bias_fp32, lse_grad, window=window, **packing)
                                  for lse_grad in (False, True)]
                    elif key.direction == "decode":
                        calls += [Call(seqlen_k, softcap, bias_fp32, cache_lengths=cached, page=page, window=window)
                                  for cached in (False, True) for page in (0, *PAGE_SIZES)]
                    else:
                        calls.append(Call(seqlen_k, softcap, bias_fp32, window=window, **packing))
    return calls


def _operand_shape(kind: str, key: TableKey, heads: int, seqlen_k: int,
                   rows: int | None = None) -> tuple[int, int, int, int] | None:
    """The (B, H|Hkv|1, Lq|1, Lk) shape of a mask or bias of `kind` (`space.operand_kind`);
    `rows`: its query rows where they are not the key's bucket (a packed call's total_q)."""
    kind = kind.removesuffix("+grad")
    rows = key.seqlen_q_bucket if rows is None else rows
    return {"none": None, "full": (1, heads, rows, seqlen_k), "kv_head": (1, HEADS_KV, rows, seqlen_k),
            "per_key": (1, HEADS_KV, 1, seqlen_k), "shared": (1, 1, rows, seqlen_k)}[kind]


def _packed_tensors(key: TableKey, call: Call, heads: int, dtype: torch.dtype):
    """A packed call's data-less operands in the launchers' 4-D views (`configs.Packing`): q
    (1, total_q, H, D), k and v (1, total_k, Hkv, D), a per-key mask or bias (1, Hkv, 1, total_k),
    a per-row one (1, H|Hkv|1, total_q, max_seqlen_k); then its packing and sequences."""
    from dmattn_kernels.configs import Packing

    total_q, total_k = PACKED_SEQUENCES * key.seqlen_q_bucket, PACKED_SEQUENCES * call.seqlen_k
    q = _meta((1, total_q, heads, key.head_dim), dtype)
    k, v = (_meta((1, total_k, HEADS_KV, key.head_dim), dtype) for _ in range(2))

    def operand(kind: str, operand_dtype):
        per_key = kind.removesuffix("+grad") == "per_key"
        shape = _operand_shape(kind, key, heads, total_k if per_key else call.seqlen_k, rows=total_q)
        return _meta(shape, operand_dtype), per_key

    mask, mask_per_key = operand(key.mask, torch.bool)
    bias, bias_per_key = operand(key.bias, torch.float32 if call.bias_fp32 else dtype)
    packing = Packing(PACKED_SEQUENCES, key.seqlen_q_bucket, call.seqlen_k, seqused_k=call.seqused,
                      mask_per_key=mask_per_key, bias_per_key=bias_per_key)
    sequences = (_meta((PACKED_SEQUENCES + 1,), torch.int32), _meta((PACKED_SEQUENCES + 1,), torch.int32),
                 _meta((PACKED_SEQUENCES,), torch.int32) if call.seqused else None)
    return q, k, v, mask, bias, packing, sequences


def _meta(shape, dtype) -> torch.Tensor | None:
    return None if shape is None else torch.empty(shape, dtype=dtype, device="meta")


def _plan(backend, key: TableKey, config, call: Call, num_sms: int, programs: list) -> None:
    """Builds (and, for a backend that plans per call, runs in compile-only mode) the plan of one
    call of `key` on data-less tensors; within `planning_for` it records its `programs`."""
    from dmattn_kernels.runtime.launch_context import compile_only

    dtype = DTYPES[key.dtype]
    heads, seqlen_q, dim = HEADS_KV * key.gqa_ratio, key.seqlen_q_bucket, key.head_dim
    options = dict(is_causal=key.causal, softmax_scale=dim ** -0.5, softcap=SOFTCAP if call.softcap else 0.0)
    if call.window != NO_WINDOW:  # passed only when set, as the runtime does
        options["window"] = call.window
    runs = {}  # what a packed call's runs take besides the launchers' options
    if call.packed:
        q, k, v, mask, bias, packing, sequences = _packed_tensors(key, call, heads, dtype)
        options["packing"], runs["sequences"] = packing, sequences
    else:
        q = _meta((1, seqlen_q, heads, dim), dtype)
        k, v = (_meta((1, call.seqlen_k, HEADS_KV, dim), dtype) for _ in range(2))
        mask = _meta(_operand_shape(key.mask, key, heads, call.seqlen_k), torch.bool)
        bias = _meta(_operand_shape(key.bias, key, heads, call.seqlen_k), torch.float32 if call.bias_fp32 else dtype)
    out, lse = _meta(q.shape, dtype), _meta((1, heads, q.shape[1]), torch.float32)
    with compile_only():
        if key.direction == "decode":
            from dmattn_kernels.triton.decode_launch import DecodePlan

            seqlens = _meta((1,), torch.int32) if call.cache_lengths else None
            block_table = None
            if call.page:
                pages = -(-call.seqlen_k // call.page)
                k, v = (_meta((pages, call.page, HEADS_KV, dim), dtype) for _ in range(2))
                block_table = _meta((1, pages), torch.int32)
            DecodePlan(q, k, v, mask, bias, seqlens, block_table, **options, config=config, out=out, lse=lse,
                       num_sms=num_sms)
        elif key.direction == "fwd":
            if backend.forward_plan is not None:
                backend.forward_plan(q, k, v, mask, bias, config=config, out=out, lse=lse, **options)
            # a backend whose plan builds none of its kernels (CUDA's plans each call): the call
            # planned, not launched, in compile-only mode. Asked of its own kernels, not of any:
            # a helper kernel of the other backend that a plan builds must not stand in for them
            if not any(program.backend == backend.name for program in programs):
                backend.forward(q, k, v, mask, bias, config=config, out=out, lse=lse, **options, **runs)
        else:
            dbias = _meta(bias.shape, bias.dtype) if key.bias.endswith("+grad") else None
            grads = dict(dq=_meta(q.shape, dtype), dk=_meta(k.shape, dtype), dv=_meta(v.shape, dtype), dbias=dbias,
                         dlse=_meta(lse.shape, torch.float32) if call.lse_grad else None)
            if backend.backward_plan is not None:
                backend.backward_plan(out, q, k, v, out, lse, mask, bias, config=config, **grads, **options)
            else:
                backend.backward(out, q, k, v, out, lse, mask, bias, config=config, **grads, **options, **runs)


def arch_of_table(compute_capability: str) -> str:
    """The arch a table's device compiles for ("9.0" -> "sm90")."""
    major, _, minor = compute_capability.partition(".")
    return f"sm{int(major)}{int(minor or 0)}"


def entry_programs(backend_name: str, key: TableKey, config, arch: str,
                   num_sms: int) -> Iterator[tuple[Call, list | None]]:
    """Per representative call of `key`: the programs (`dmattn_kernels.target.Program`) its plan
    records on `arch`, or None where the launcher rejects the call (it cannot run it)."""
    from dmattn_bench.registry import get_backend
    from dmattn_kernels.target import planning_for

    backend = get_backend(backend_name)
    for call in representative_calls(key):
        with planning_for(arch) as programs:
            try:
                _plan(backend, key, config, call, num_sms, programs)
            except (ValueError, TypeError, NotImplementedError):  # the launcher's "cannot run this"
                yield call, None
                continue
        yield call, list(programs)


@lru_cache(maxsize=4096)
def program_digest(program, arch: str) -> str:
    """The digest of one program's code on `arch`: its specialised source, options and target."""
    if program.backend == "triton":
        values = dict(program.parameters)
        kernel = program.kernel
        arg_names = set(getattr(kernel, "arg_names", ()))
        constexprs = {name: value for name, value in values.items() if name in arg_names}
        options = sorted((name, repr(value)) for name, value in values.items() if name not in arg_names)
        text = specialise.triton_text(kernel, constexprs) + f"\noptions {options}"
    else:
        from dmattn_kernels.cuda import build

        flags = [flag for _, flag in program.parameters]
        text = (specialise.cuda_text(build.SOURCES[program.name], flags)
                + f"\nnvcc {' '.join(build.NVCC_OPTIONS)} -arch={build.ARCH_FLAGS.get(arch, arch)}")
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


@lru_cache(maxsize=4096)
def entry_stamp(backend_name: str, key: TableKey, config: FwdConfig | BwdConfig | DecodeConfig, arch: str,
                num_sms: int) -> str:
    """The stamp of an entry (`backend_name`, `key`, `config`) on a device of `arch` with
    `num_sms` SMs: a digest over its representative calls' programs (module docstring)."""
    digest = hashlib.sha256(STAMP_RULES)
    digest.update(f"{backend_name} {arch} {key.dtype}\n".encode())
    for call, programs in entry_programs(backend_name, key, config, arch, num_sms):
        if programs is None:
            digest.update(f"{call.label()}: not supported\n".encode())
            continue
        digests = sorted(f"{p.backend}:{p.name}:{program_digest(p, arch)}" for p in set(programs))
        digest.update(f"{call.label()}: {' '.join(digests)}\n".encode())
    return "sha256:" + digest.hexdigest()[:DIGEST_HEX_CHARS]


def stamp_of(entry, device) -> str:
    """`entry_stamp` of a table entry on its table's device (`hardware.DeviceFingerprint`)."""
    return entry_stamp(entry.backend, entry.key, entry.config, arch_of_table(device.compute_capability),
                       device.sm_count)


STATUSES = ("current", "stale", "unvalidated", "invalid")  # what `entry_status` says, in report order


def entry_status(entry, device) -> str:
    """"current", "stale", "unvalidated" (module docstring) or "invalid" (a config no kernel can
    run: `space.InvalidConfig`) for an entry of a table of `device`."""
    if isinstance(entry.config, InvalidConfig):
        return "invalid"
    if entry.stale is not None:
        return "stale"
    if entry.validated is None:
        return "unvalidated"
    recorded = entry.validated.stamp
    try:
        if recorded.startswith(LEGACY_PREFIX):
            from dmattn_bench.registry import kernel_source_hash

            return "current" if recorded[len(LEGACY_PREFIX):] == kernel_source_hash(entry.backend) else "stale"
        return "current" if recorded == stamp_of(entry, device) else "stale"
    except (ValueError, OSError, SyntaxError, specialise.PreprocessError):  # sources unreadable: not this code
        return "stale"
