"""Finiteness and equivalence of a kernel run against the single reference (DESIGN.md §2).

For every checked tensor X in {out, lse, dq, dk, dv, dbias}:
  1. X is finite everywhere, except lse == -inf exactly on the reference's dead rows;
  2. max|X - X_ref| <= factor * max|X_lowp - X_ref| + ATOL_FLOOR[dtype], where X_ref is the
     reference in fp64 (CPU) / fp32 (GPU) and X_lowp the same reference run in the kernel's
     dtype: the error an honest same-precision implementation makes. factor = 2 for the forward,
     3 for gradients. No percent-of-elements escape hatch.
  3. Every output buffer is filled with NaN before the kernel runs, so an element the kernel
     forgot to write fails rule 1. A packed call's out and lse rows that no sequence owns are
     then filled as `flash_dmattn_varlen_func` fills them before its forward (out 0, lse -inf:
     the launchers leave them as given), so the tensors checked are those a user gets.
A second run must reproduce every tensor bitwise (determinism), but for dQ under a config the
table marks non-deterministic (`BwdConfig.nondeterministic_dq`), whose second run is judged by
rules 1 and 2 again.

A kernel failure is data: it becomes a status and a one-line reason, never an exception.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from itertools import count, takewhile
from typing import Callable

import torch

from dmattn_bench import tiles
from dmattn_bench.dispatch.stamps import representative_window
from dmattn_bench.registry import Backend, get_backend
from dmattn_bench.space import (AttentionShape, BwdConfig, DecodeConfig, FwdConfig, TableKey,
                                bias_has_rows, config_label, is_valid_head_dim)
from dmattn_bench.tiles import DECODE_DEFAULTS, decode_config, default_configs, default_entries
from dmattn_bench.tuning import ledger
from dmattn_bench.tuning.adversarial import (MASK_SHAPE_OF_KIND, NO_WINDOW, Case, adversarial_cases, bias_kind,
                                             build_inputs, decode_cases)
# how a case runs through a kernel and the reference (tests and the tuner's trials import them here too)
from dmattn_bench.tuning.runs import reference_forward, run_decode, run_kernel, run_reference

# Floor under the bound: a few units of the dtype's rounding at O(1) magnitudes, so a lucky
# exact low-precision reference (error 0 on a tensor) does not demand an exact kernel.
ATOL_FLOOR = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}
FWD_FACTOR = 2.0  # FlashAttention's test rule for out and lse
BWD_FACTOR = 3.0  # gradients go through one more low-precision product chain
CHECKED = ("out", "lse", "dq", "dk", "dv", "dbias")
UNORDERED = ("dq",)  # what a backward config marked non-deterministic may change between runs
# The short-query forward's suites: not a backend of the registry (it serves the "auto" and
# "triton" calls without gradient, `plan.AttentionPlan.decodes`), checked on `decode_cases`
DECODE = "triton-decode"
# Failure statuses, most severe first; "ok" is success.
STATUSES = ("crash", "launch_error", "oom", "timeout", "compile_error", "nonfinite", "mismatch", "invalid", "unsupported",
            "ok")


@dataclass
class TensorCheck:
    """One tensor's verdict: worst error, its bound, their ratio (> 1 fails)."""

    name: str
    error: float
    bound: float
    ratio: float
    finite: bool
    detail: str = ""

    @property
    def passed(self) -> bool:
        return self.finite and self.error <= self.bound

    def failure(self) -> str:
        """Why it failed, one line: its non-finite elements, else its error over the bound."""
        if not self.finite:
            return f"{self.name}: {self.detail}"
        return f"{self.name}: error {self.error:.3g} > bound {self.bound:.3g} (x{self.ratio:.2f}), {self.detail}"


@dataclass
class CaseResult:
    case: str
    status: str
    reason: str = ""
    checks: dict[str, TensorCheck] = field(default_factory=dict)
    replayed: bool = False  # passed before on the same code (`ledger`), not run again

    @property
    def worst_ratio(self) -> float:
        return max((c.ratio for c in self.checks.values()), default=0.0)


@dataclass
class SuiteResult:
    """Outcome of the adversarial suite for one (backend, configs, dtype)."""

    backend: str
    fwd_config: FwdConfig | None  # None: that direction was not run
    bwd_config: BwdConfig | None
    dtype: str
    cases: list[CaseResult]

    @property
    def status(self) -> str:
        return min((c.status for c in self.cases), key=STATUSES.index, default="ok")

    def worst_ratios(self) -> dict[str, float]:
        """Worst error-to-bound ratio per tensor over all cases that ran."""
        worst: dict[str, float] = {}
        for case in self.cases:
            for name, check in case.checks.items():
                worst[name] = max(worst.get(name, 0.0), check.ratio)
        return worst

    def to_dict(self) -> dict:
        return {
            "backend": self.backend,
            "fwd_config": self.fwd_config.to_dict() if self.fwd_config is not None else None,
            "bwd_config": self.bwd_config.to_dict() if self.bwd_config is not None else None,
            "dtype": self.dtype,
            "status": self.status,
            "worst_ratios": self.worst_ratios(),
            "cases": [
                {"case": c.case, "status": c.status, "reason": c.reason,
                 "checks": {n: asdict(t) for n, t in c.checks.items()}}
                for c in self.cases
            ],
        }


def classify_failure(exc: BaseException) -> tuple[str, str]:
    """Maps a kernel exception to a trial status and a one-line reason."""
    name = type(exc).__name__
    text = str(exc).strip().splitlines()
    reason = f"{name}: {text[0] if text else ''}"[:300]
    lowered = f"{name} {exc}".lower()
    if isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in lowered:
        return "oom", reason
    if name == "OutOfResources":
        # the tile does not fit this GPU's shared memory / registers for this head dim
        return "unsupported", reason
    if name in ("CompilationError", "CudaBuildError") or "compilationerror" in lowered:
        return "compile_error", reason
    if "cuda error" in lowered or "illegal" in lowered or "launch" in lowered:
        return "launch_error", reason
    return "crash", reason


def shape_of_case(case: Case) -> AttentionShape:
    """The case's problem as `is_supported` judges configs on it (a packed case's lengths: its
    longest sequence's, its batch: its sequences)."""
    batch, seqlen_q, seqlen_k = case.batch, case.seqlen_q, case.seqlen_k
    if case.packed:
        spans = case.seqused or case.documents_k or case.documents
        batch, seqlen_q, seqlen_k = len(case.documents), max(case.documents), max(spans)
    return AttentionShape(
        batch=batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k, num_heads=case.heads,
        num_heads_kv=case.heads_kv, head_dim=case.head_dim, is_causal=case.causal,
        has_mask=case.mask != "none", has_bias=case.bias != "none",
        bias_requires_grad=case.bias != "none" and case.bias_grad, softcap=case.softcap,
    )


# A packed, windowed key: `tiles.key_problem` of it says whether a backend runs packed sequences
# and windows in any config
PACKED_PROBE = TableKey("fwd", "fp32", 64, False, "none", "none", 1, 1, 1, packed=True, window=1)


_MASK_KIND_OF_SHAPE = {shape: kind for kind, shape in MASK_SHAPE_OF_KIND.items()}


def _feature_key(case: Case, direction: str) -> TableKey:
    """A key with the case's packed sequences, window and mask and bias kinds, for
    `tiles.key_problem`: any bounded side is a window here."""
    mask = "none" if case.mask == "none" else _MASK_KIND_OF_SHAPE.get(case.mask_shape, "shared")
    return TableKey(direction, "fp32", case.head_dim, case.causal, mask, case.bias, 1, 1, 1, packed=case.packed,
                    window=int(case.window_size != NO_WINDOW))


def feature_problem(backend_name: str, case: Case, fwd_config: FwdConfig | None = None,
                    bwd_config: BwdConfig | None = None) -> str | None:
    """Why `backend_name` runs no call with the case's packed sequences or window in the
    directions it runs (those of the configs given; the forward, whatever its config, with none)
    (`tiles.key_problem`)."""
    if not case.packed and case.window_size == NO_WINDOW:
        return None
    runs = [(direction, config) for direction, config in (("fwd", fwd_config), ("bwd", bwd_config)) if config]
    for direction, config in runs or [("fwd", None)]:
        reason = tiles.key_problem(backend_name, _feature_key(case, direction), config)
        if reason:
            return reason
    return None


def _worst_element(diff: torch.Tensor) -> str:
    index = tuple(int(i) for i in torch.unravel_index(diff.argmax(), diff.shape))
    return f"worst at {index}"


def compare(name: str, x: torch.Tensor, x_ref: torch.Tensor, x_lowp: torch.Tensor, dtype: torch.dtype) -> TensorCheck:
    """Applies rules 1 and 2 to one tensor."""
    factor = FWD_FACTOR if name in ("out", "lse") else BWD_FACTOR
    x, x_ref, x_lowp = x.double(), x_ref.double(), x_lowp.double()
    finite = bool(torch.isfinite(x).all())
    detail = ""
    if name == "lse":
        dead = x_ref == float("-inf")
        if not bool((x[dead] == float("-inf")).all()):
            return TensorCheck(name, float("inf"), 0.0, float("inf"), False, "dead row without lse == -inf")
        finite = bool(torch.isfinite(x[~dead]).all())
        live = ~dead
        x, x_ref, x_lowp = x[live], x_ref[live], torch.where(torch.isfinite(x_lowp[live]), x_lowp[live], x_ref[live])
    if not finite:
        bad = (~torch.isfinite(x)).sum().item()
        return TensorCheck(name, float("inf"), 0.0, float("inf"), False, f"{bad} non-finite element(s)")
    if x.numel() == 0:
        return TensorCheck(name, 0.0, ATOL_FLOOR[dtype], 0.0, True)
    diff = (x - x_ref).abs()
    error = diff.max().item()
    lowp_error = (x_lowp - x_ref).abs().nan_to_num(0.0).max().item()
    bound = factor * lowp_error + ATOL_FLOOR[dtype]
    if error > bound:
        detail = _worst_element(diff.view(-1) if diff.dim() == 0 else diff)
    return TensorCheck(name, error, bound, error / bound, True, detail)


def check_decode_case(case: Case, dtype: torch.dtype, device: torch.device | str, config: DecodeConfig,
                      seed: int = 0) -> CaseResult:
    """`check_case` for the short-query forward: out and lse, twice (bitwise), never raises."""
    def launcher(inputs, high):
        return lambda: run_decode(inputs, case, config)

    return _run_case(case, dtype, torch.device(device), seed, launcher)


def check_case(backend: Backend, case: Case, dtype: torch.dtype, device: torch.device | str,
               fwd_config: FwdConfig | None, bwd_config: BwdConfig | None, seed: int = 0) -> CaseResult:
    """Runs one case twice through the kernel and once through each reference; never raises.

    A direction whose config is None is not run: a backward checked alone reads the reference's
    out and lse. Where this process validates with a ledger (`ledger.active`: `tune`, `verify`),
    a case that passed before on the same code answers with that verdict, and one that passes
    now is kept.
    """
    device = torch.device(device)
    shape = shape_of_case(case)
    reason = feature_problem(backend.name, case, fwd_config, bwd_config)
    if reason:
        return CaseResult(case.name, "unsupported", reason)
    for config in (fwd_config, bwd_config):
        reason = backend.is_supported(config, shape) if config is not None else None
        if reason:
            return CaseResult(case.name, "unsupported", reason)
    kept = ledger.active()
    call = (backend.name, case, dtype, seed, fwd_config, bwd_config, str(device))
    if kept is not None:
        checks = kept.replay(*call)
        if checks is not None:
            return CaseResult(case.name, "ok", "", {name: TensorCheck(**fields) for name, fields in checks.items()},
                              replayed=True)

    def launcher(inputs, high):
        forward = None if fwd_config is not None else reference_forward(high, dtype)
        return lambda: run_kernel(backend, inputs, case, fwd_config, bwd_config, forward)

    may_differ = UNORDERED if bwd_config is not None and not bwd_config.deterministic else ()
    if kept is None:
        return _run_case(case, dtype, device, seed, launcher, may_differ)
    with ledger.observing() as programs:
        result = _run_case(case, dtype, device, seed, launcher, may_differ)
    if result.status == "ok":
        kept.keep(*call, programs, {name: asdict(check) for name, check in result.checks.items()})
    return result


def _run_case(case: Case, dtype: torch.dtype, device: torch.device, seed: int, launcher,
              may_differ: tuple[str, ...] = ()) -> CaseResult:
    """Builds the case's inputs and both references, runs the kernel twice through
    `launcher(inputs, high reference)` (a callable returning its tensors by name) and judges the
    runs (`_verdict`)."""
    try:
        inputs = build_inputs(case, dtype, device, seed)
        high = run_reference(inputs, case, None)
        low = run_reference(inputs, case, dtype)
        try:
            run = launcher(inputs, high)
            first, second = run(), run()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        except Exception as exc:  # noqa: BLE001 - a failed candidate is data, not a crash
            return CaseResult(case.name, *classify_failure(exc))
        return _verdict(case, first, second, high, low, dtype, may_differ)
    except Exception as exc:  # noqa: BLE001 - only the GPU running short is data here
        # in the inputs, the reference or the comparison; other processes may hold the memory:
        # `run_plan` runs such a case again on its own. A CUDA call that fails to allocate (not
        # the caching allocator) raises torch.AcceleratorError "CUDA error: out of memory".
        status, reason = classify_failure(exc)
        if status == "oom":
            return CaseResult(case.name, status, reason)
        if _library_short_of_memory(exc) and _context_alive(device):
            return CaseResult(case.name, "oom", f"before the kernel ran: {reason}")
        raise


# A library launch that could not get its memory fails as that library's error: an H200 verify's
# pool stopped at case 1331 of 1408 when the bf16 reference's backward raised cuBLAS's
# CUBLAS_STATUS_EXECUTION_FAILED beside the other workers' references
LIBRARY_SHORT_OF_MEMORY = ("CUBLAS_STATUS_EXECUTION_FAILED", "CUBLAS_STATUS_ALLOC_FAILED")


def _library_short_of_memory(exc: BaseException) -> bool:
    return any(status in str(exc) for status in LIBRARY_SHORT_OF_MEMORY)


def _context_alive(device: torch.device) -> bool:
    """Whether this process's CUDA context still runs work: a sticky error (an earlier kernel's
    illegal access) fails every later call, and is no shortage of memory."""
    if device.type != "cuda":
        return True
    try:
        torch.cuda.synchronize(device)
    except Exception:  # noqa: BLE001 - any failure here means the context is gone
        return False
    return True


def _verdict(case: Case, first, second, high, low, dtype: torch.dtype, may_differ: tuple[str, ...] = ()) -> CaseResult:
    """Rules 1 and 2 on every tensor of the first run, then the second run's bits against it;
    the tensors of `may_differ` (a non-deterministic config's, `UNORDERED`) by rules 1 and 2
    instead."""
    checks = {name: compare(name, first[name], high[name], low[name], dtype) for name in CHECKED if name in first}
    again = [compare(name, second[name], high[name], low[name], dtype) for name in may_differ if name in second]
    failed = [c for c in (*checks.values(), *again) if not c.passed]
    if any(not c.finite for c in failed):
        bad = next(c for c in failed if not c.finite)
        return CaseResult(case.name, "nonfinite", bad.failure(), checks)
    if failed:
        bad = max(failed, key=lambda c: c.ratio)
        return CaseResult(case.name, "mismatch", bad.failure(), checks)
    for name in first:
        if name not in may_differ and not torch.equal(first[name], second[name]):
            return CaseResult(case.name, "mismatch", f"{name}: a repeat run differs bitwise (non-deterministic)", checks)
    return CaseResult(case.name, "ok", "", checks)


def config_tiles(fwd_config: FwdConfig | None, bwd_config: BwdConfig | None) -> list[tuple[int, int]]:
    """Every (rows, cols) tile the configs use (None: that direction is not run): tile-aware
    cases are built on each."""
    tiles = []
    if fwd_config is not None:
        tiles.append((fwd_config.block_m, fwd_config.block_n))
    if bwd_config is not None:
        tiles += [(bwd_config.block_m, bwd_config.block_n), (bwd_config.block_m_dq, bwd_config.block_n_dq)]
    return tiles


def config_suite(backend_name: str, suite: str, fwd_config: FwdConfig | None,
                 bwd_config: BwdConfig | None, varlen: bool = False) -> list[Case]:
    """The adversarial suite on the configs' own tiles (with `varlen`, its packed-sequence and
    window half: `varlen_cases`), each case at a head dim they run: a case whose head dim they
    cannot take at all (`is_supported`; the warp-specialized backward of 128 keys needs one from
    72 to 128) runs at the next one they take. Dispatch sends a config only the head dims of
    its own entries, which it takes. A packed case the configs cannot run (`feature_problem`: the
    CUDA forward, the CUDA backward with a mask or bias of query rows or at a head dim where it is
    not warp-specialized) is served by no entry of theirs, so the suite leaves it out."""
    backend = get_backend(backend_name)

    def takes(case: Case) -> bool:
        shape = shape_of_case(case)
        return all(config is None or backend.is_supported(config, shape) is None for config in (fwd_config, bwd_config))

    cases = []
    for case in adversarial_cases(suite, config_tiles(fwd_config, bwd_config), varlen):
        case = grouped_for(case, bwd_config)
        if not takes(case):
            moved = (replace(case, name=f"{case.name}@d{head_dim}", head_dim=head_dim)
                     for head_dim in takewhile(is_valid_head_dim, count(case.head_dim + 8, 8)))
            case = next((other for other in moved if takes(other)), case)  # none: it reports why
        if case.packed and feature_problem(backend_name, case, fwd_config, bwd_config):
            continue
        cases.append(case)
    return cases


def grouped_for(case: Case, bwd_config: BwdConfig | None) -> Case:
    """`case` as a backward with the knob `kv_group` runs it: with query heads grouped (twice its
    heads on its KV heads) where each KV head has one; dispatch sends such a config GQA calls only."""
    if bwd_config is None or not bwd_config.kv_group or case.heads != case.heads_kv:
        return case
    return replace(case, name=f"{case.name}@gqa", heads=2 * case.heads)


def up_to_head_dim(cases, head_dim: int) -> list[Case]:
    """The cases a config chosen for keys of head dims up to `head_dim` runs: none of a larger
    head dim (dispatch never sends the config one, and its tiles can need more shared memory than
    the GPU has there)."""
    return [case for case in cases if case.head_dim <= head_dim]


def validate(backend_name: str, fwd_config: FwdConfig | None, bwd_config: BwdConfig | None, dtype: torch.dtype,
             device: torch.device | str, suite: str = "quick",
             on_case: Callable[[CaseResult], None] | None = None,
             cases: list[Case] | None = None) -> SuiteResult:
    """The adversarial suite for one backend and config pair, or one direction's config.

    Args:
        backend_name: a name from `dmattn_bench.registry`.
        fwd_config, bwd_config: the tiles under test (one may be None: that direction is not run,
            and a backward alone reads the reference's forward).
        dtype: the kernel dtype (fp16/bf16 on GPU; fp32/fp16 in the interpreter).
        device: where the kernel runs.
        suite: "quick" (interpreter sized) or "full" (DESIGN §2 sizes, for GPUs).
        on_case: called after each case (progress reporting).
        cases: run these instead of the whole suite (e.g. the cases of one head-dim class).

    Returns:
        A `SuiteResult`; its `status` is "ok" only if every case passed.
    """
    if backend_name == DECODE:
        cases = decode_cases(suite, fwd_config.block_n) if cases is None else cases
        check = lambda case: check_decode_case(case, dtype, device, fwd_config)  # noqa: E731
    else:
        backend = get_backend(backend_name)
        if cases is None:
            cases = config_suite(backend_name, suite, fwd_config, bwd_config)
        check = lambda case: check_case(backend, case, dtype, device, fwd_config, bwd_config)  # noqa: E731
    results = []
    for case in cases:
        result = check(case)
        results.append(result)
        if on_case is not None:
            on_case(result)
    return SuiteResult(backend_name, fwd_config, bwd_config, str(dtype).removeprefix("torch."), results)


@dataclass(frozen=True)
class PlannedSuite:
    """One dispatchable config pair and the suite cases it answers for."""

    label: str
    backend: str
    fwd_config: FwdConfig | DecodeConfig
    bwd_config: BwdConfig | None  # None: the short-query forward (DECODE)
    cases: list[Case]


def plan_decode(device: torch.device | str, suite: str) -> list[PlannedSuite]:
    """The short-query forward's config per head-dim class (`tiles.decode_config`), each with
    the decode cases of its class: what every call without gradient of few query rows runs."""
    planned, low = [], 8
    for high, _ in DECODE_DEFAULTS:
        config = decode_config(high, device)
        cases = [case for case in decode_cases(suite, config.block_n) if low <= case.head_dim <= high]
        if cases:
            planned.append(PlannedSuite(f"{DECODE} D{low}-{high} (short-query forward)", DECODE, config, None, cases))
        low = high + 8
    return planned


VARLEN_LABEL = "packed/window"  # what a planned suite of packed-sequence and window cases says in its label


def plan_default_configs(device: torch.device | str, suite: str, backend: str = "triton",
                         dtype: str | None = None) -> list[PlannedSuite]:
    """The default configs of `backend` for `dtype`, each with the suite cases of its head-dim class
    and bias kind (with rows or not: `tiles.default_entries`): the dense cases, and, for a
    backend that runs packed sequences and windows (`tiles.key_problem`), the packed/window ones
    (the defaults serve those calls where a table has no entry)."""
    runs_varlen = tiles.key_problem(backend, PACKED_PROBE) is None
    plan = []
    for varlen in (False, True) if runs_varlen else (False,):
        for bias_rows in (False, True):
            for low, high, fwd, bwd in default_entries(device, backend, dtype, bias_rows):
                cases = [c for c in config_suite(backend, suite, fwd, bwd, varlen)
                         if low <= c.head_dim <= high and bias_has_rows(bias_kind(c)) == bias_rows]
                if cases:
                    label = f"D {low}-{high}, bias {'with' if bias_rows else 'without'} rows"
                    plan.append(PlannedSuite(f"{VARLEN_LABEL}: {label}" if varlen else label, backend, fwd, bwd,
                                             cases))
    return plan


ENTRY_CASE_SCORE_BYTES = 2 << 30  # above this, an entry case has one KV head (fp32 scores of every head)


def entry_case(key, batch: int = 1) -> Case:
    """A case with the shape and features of a dispatch-table key (lengths = the buckets): two KV
    heads, or one where the fp32 reference's (batch, heads, Lq, Lk) scores would pass
    `ENTRY_CASE_SCORE_BYTES` (an L16384 key's reference then fits one GPU)."""
    fp32_bytes = 4
    scores = batch * 2 * key.gqa_ratio * key.seqlen_q_bucket * key.seqlen_k_bucket * fp32_bytes
    heads_kv = 2 if scores <= ENTRY_CASE_SCORE_BYTES else 1
    mask_shape = MASK_SHAPE_OF_KIND.get(key.mask, "full")
    if key.mask == "shared" and key.seqlen_q_bucket == 1:
        mask_shape = "key"  # one query row: a (B, 1, 1, Lk) padding mask's kind is "shared"
    bias = key.bias.removesuffix("+grad")
    if bias == "shared":
        bias = "full"
    packed = {}
    if key.packed:  # the longest sequences of the buckets and a shorter pair (lengths that divide no tile)
        packed = dict(documents=(key.seqlen_q_bucket, key.seqlen_q_bucket // 3 + 1),
                      documents_k=(key.seqlen_k_bucket, key.seqlen_k_bucket // 3 + 1))
    return Case(
        name=f"entry {key.direction} D{key.head_dim} L{key.seqlen_q_bucket}x{key.seqlen_k_bucket} "
             f"mask={key.mask} bias={key.bias} gqa{key.gqa_ratio}{' causal' if key.causal else ''}{key.label()}",
        batch=batch, heads=heads_kv * key.gqa_ratio, heads_kv=heads_kv, seqlen_q=key.seqlen_q_bucket,
        seqlen_k=key.seqlen_k_bucket, head_dim=key.head_dim, causal=key.causal,
        mask="none" if key.mask == "none" else "random", mask_shape=mask_shape, bias=bias,
        bias_grad=key.bias.endswith("+grad") or key.direction == "fwd",
        window_size=representative_window(key), **packed,
    )


def plan_table_entries(entries, dtype_name: str, device: torch.device | str, suite: str) -> list[PlannedSuite]:
    """One suite per distinct (fwd, bwd) pair the table's `dtype_name` entries can form, and one
    per short-query forward config of its decode entries.

    Each prefill entry's config is paired with the default of the other direction (for its head
    dim); each pair runs the whole adversarial suite on its own tiles (for entries of packed or
    windowed keys, its packed/window half: `varlen_cases`; labelled so) plus one case shaped like
    each of its entries. An entry whose backend's default of the other direction cannot run its key
    (the CUDA kernels' windows and packed sequences: `tiles.key_problem`) runs its suite alone. A
    decode config runs the decode cases (`adversarial.decode_cases`) and one case shaped like each
    of its entries.
    """
    grouped: dict[tuple, list] = {}
    for entry in entries:
        if entry.key.dtype != dtype_name:
            continue
        if entry.key.direction == "decode":
            grouped.setdefault((DECODE, entry.config, None, False), []).append(entry)
            continue
        default_fwd, default_bwd = default_configs(entry.key.head_dim, device, entry.backend, dtype_name,
                                                   entry.key.bias)
        pair = (entry.config, default_bwd) if entry.key.direction == "fwd" else (default_fwd, entry.config)
        # where the other direction's default cannot run the key (the CUDA kernels' windows:
        # `tiles.key_problem`), the entry's direction alone (a backward reads the reference's forward)
        if entry.key.direction == "fwd" and tiles.key_problem(entry.backend, replace(entry.key, direction="bwd"),
                                                              default_bwd):
            pair = (entry.config, None)
        if entry.key.direction == "bwd" and tiles.key_problem(entry.backend, replace(entry.key, direction="fwd"),
                                                              default_fwd):
            pair = (None, entry.config)
        varlen = entry.key.packed or entry.key.window > 0
        grouped.setdefault((entry.backend, *pair, varlen), []).append(entry)
    plan = []
    for (backend, fwd, bwd, varlen), group in grouped.items():
        largest = max(e.key.head_dim for e in group)  # dispatch sends the pair its entries' head dims
        if backend == DECODE:
            suite_cases = decode_cases(suite, fwd.block_n)
            label = f"{DECODE} {config_label(fwd)} ({len(group)} entries)"
        else:
            suite_cases = config_suite(backend, suite, fwd, bwd, varlen)
            bwd_label = "none" if bwd is None else config_label(bwd)
            label = f"{backend} fwd {config_label(fwd)} / bwd {bwd_label} ({len(group)} entries)"
            if varlen:
                label = f"{VARLEN_LABEL}: {label}"
        cases = up_to_head_dim(suite_cases, largest) + [entry_case(e.key) for e in group]
        plan.append(PlannedSuite(label, backend, fwd, bwd, cases))
    return plan
