"""`dmattn-bench bench`: our dispatch-selected kernel against its peers, same run, same GPU.

For each workload of `configs/workloads/peers.yaml` and each peer (`dmattn_bench.peers`), the
forward and the forward+backward are timed with `timing.time_kernel` (warm-up, L2 flushed,
median and spread) and `timing.eager_wall_ms`. Reported per row:

- ms (median, p20-p80 spread) of GPU time, and beside it the host's own time to enqueue one call
  and the eager wall time per call (back-to-back calls, one sync): a CUDA-graph user sees the
  first, an eager loop the last;
- TFLOP/s over the work actually needed: the matmuls of the
  (query, key) pairs the causal rule leaves (2 GEMMs forward, 5 backward; FlashAttention's count);
- the floor: max(FLOPs / tensor-core peak, bytes that must move / HBM bandwidth) for this GPU
  (`hardware.device_peaks`), and the fraction of it reached;
- ours / peer on GPU time and on eager wall time (below 1: we are faster);
- for peers computing the same function, max |out - ours| as a check that they do.

A peer that fails (not installed, out of resources, unsupported, needs a GPU) is a row with its
error; `failed_rows_of_ours` tells the command whether our own kernel failed.
"""

from __future__ import annotations

import gc
import math
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path

import torch

from dmattn_bench import hardware, output
from dmattn_bench.peers import OURS, PEERS, BenchInputs, Prepared, unavailable_reason
from dmattn_bench.space import DTYPES, load_yaml
from dmattn_bench.timing import eager_wall_ms, time_kernel
from dmattn_bench.workloads import Workload

DIRECTIONS = ("fwd", "fwd+bwd")
_MASK_KINDS = ("full", "kv_head")
_BIAS_KINDS = ("full", "kv_head", "per_key")
_WORKLOAD_KEYS = {"name", "batch", "heads", "heads_kv", "seqlen", "head_dim", "causal", "dtype", "bias", "mask"}
# The eager loop behind `wall ms`, (calls per loop, loops). In the interpreter a call takes up to
# a second and its times rank nothing: one loop of 2 calls fills the column end to end, where
# 5 x 20 would make a CPU bench run about five times longer.
EAGER_LOOP_GPU = (20, 5)
EAGER_LOOP_CPU = (2, 1)


def eager_loop(device: torch.device | str) -> tuple[int, int]:
    """(calls per loop, loops) of the eager wall time on `device`."""
    return EAGER_LOOP_GPU if torch.device(device).type == "cuda" else EAGER_LOOP_CPU


@dataclass(frozen=True)
class PeerWorkload:
    """One bench problem: the shape and features, plus how its dynamic mask is chosen."""

    name: str
    workload: Workload
    keep: tuple[str, float] | None  # ("top_fraction", f) or ("top_k", n); None without a mask

    def describe(self) -> str:
        keep = "" if self.keep is None else f" keep {self.keep[0]}={self.keep[1]:g}"
        return f"{self.name}: {self.workload.label}{keep}"


def _parse(entry: dict, where: str, dtype_override: str | None) -> PeerWorkload:
    if not isinstance(entry, dict) or set(entry) != _WORKLOAD_KEYS:
        keys = sorted(entry) if isinstance(entry, dict) else type(entry).__name__
        raise ValueError(f"{where}: expected keys {sorted(_WORKLOAD_KEYS)}, got {keys}")
    bias, mask = entry["bias"], entry["mask"]
    bias_kind = "none" if bias == "none" else bias.get("kind")
    mask_kind = "none" if mask == "none" else mask.get("kind")
    if bias_kind not in ("none", *_BIAS_KINDS):
        raise ValueError(f"{where}.bias: got {bias!r}, expected none or {{kind: {'|'.join(_BIAS_KINDS)}, grad: bool}}")
    if mask_kind not in ("none", *_MASK_KINDS):
        raise ValueError(f"{where}.mask: got {mask!r}, expected none or {{kind: {'|'.join(_MASK_KINDS)}, keep: ...}}")
    keep = None
    if mask_kind != "none":
        rule = mask.get("keep")
        if not (isinstance(rule, dict) and len(rule) == 1 and next(iter(rule)) in ("top_fraction", "top_k")):
            raise ValueError(f"{where}.mask.keep: got {rule!r}, expected {{top_fraction: f}} or {{top_k: n}}")
        if bias_kind == "none":
            raise ValueError(f"{where}.mask: the keep rule ranks keys by bias, so the workload needs a bias")
        keep = next(iter(rule.items()))
    dtype = dtype_override or entry["dtype"]
    if dtype not in DTYPES:
        raise ValueError(f"{where}.dtype: got {dtype!r}, expected one of {tuple(DTYPES)}")
    heads, heads_kv = int(entry["heads"]), int(entry["heads_kv"])
    if heads % heads_kv:
        raise ValueError(f"{where}: heads_kv={heads_kv} does not divide heads={heads}")
    workload = Workload(
        batch=int(entry["batch"]), heads=heads, heads_kv=heads_kv, seqlen_q=int(entry["seqlen"]),
        seqlen_k=int(entry["seqlen"]), head_dim=int(entry["head_dim"]), causal=bool(entry["causal"]),
        mask=mask_kind, bias=bias_kind, bias_grad=bias_kind != "none" and bool(bias.get("grad", False)),
        dtype=dtype,
    )
    return PeerWorkload(str(entry["name"]), workload, keep)


def load_peer_workloads(path: str | Path, dtype: str | None = None, names: list[str] | None = None) -> list[PeerWorkload]:
    """The `workloads:` list of a peers YAML, optionally only those whose name starts with one of `names`.

    Raises:
        ValueError: a malformed entry (naming the file, the entry and the key) or no match.
    """
    path = Path(path)
    document = load_yaml(path)
    if not isinstance(document, dict) or not isinstance(document.get("workloads"), list):
        raise ValueError(f"{path}: expected a mapping with a `workloads:` list")
    workloads = [_parse(entry, f"{path}:workloads[{i}]", dtype) for i, entry in enumerate(document["workloads"])]
    if names:
        workloads = [w for w in workloads if any(w.name.startswith(n) for n in names)]
        if not workloads:
            raise ValueError(f"--only: no workload of {path} starts with {names}")
    return workloads


# -- inputs -----------------------------------------------------------------------------------


def _keep_top_of_causal_prefix(bias_rows: torch.Tensor, keep: tuple[str, float], causal: bool) -> torch.Tensor:
    """For each row i of a (Lq, Lk) bias slice, True at the keys its keep rule selects among the
    visible ones (the causal prefix j <= i + Lk - Lq when causal), ranked by bias."""
    seqlen_q, seqlen_k = bias_rows.shape
    rows = torch.arange(seqlen_q, device=bias_rows.device)
    visible_count = (rows + seqlen_k - seqlen_q + 1).clamp(0, seqlen_k) if causal else torch.full_like(rows, seqlen_k)
    rule, amount = keep
    count = (visible_count * amount).ceil().long() if rule == "top_fraction" else visible_count.clamp(max=int(amount))
    scores = bias_rows.float()
    if causal:
        cols = torch.arange(seqlen_k, device=bias_rows.device)
        scores = scores.masked_fill(cols[None, :] > rows[:, None] + (seqlen_k - seqlen_q), float("-inf"))
    order = scores.argsort(dim=-1, descending=True, stable=True)
    rank = torch.empty_like(order)
    rank.scatter_(-1, order, torch.arange(seqlen_k, device=order.device).expand_as(order))
    return rank < count[:, None]


def build_bench_inputs(pw: PeerWorkload, device: torch.device | str, seed: int = 0) -> BenchInputs:
    """Seeded inputs for a bench workload; the mask is built slice by slice from the bias."""
    w = pw.workload
    dtype = DTYPES[w.dtype]
    generator = torch.Generator(device=device).manual_seed(seed)

    def randn(shape, dt=dtype):
        return torch.randn(shape, generator=generator, device=device, dtype=torch.float32).to(dt)

    q = randn((w.batch, w.seqlen_q, w.heads, w.head_dim))
    k = randn((w.batch, w.seqlen_k, w.heads_kv, w.head_dim))
    v = randn((w.batch, w.seqlen_k, w.heads_kv, w.head_dim))
    bias = None
    if w.bias != "none":
        bias = randn(w.operand_dims("bias")).requires_grad_(w.bias_grad)
    mask = None
    if w.mask != "none":
        mask_dims = w.operand_dims("mask")
        mask = torch.empty(mask_dims, dtype=torch.bool, device=device)
        for b in range(mask_dims[0]):
            for h in range(mask_dims[1]):
                # the mask of head h ranks the keys by its own bias row (its group's for GQA)
                bias_h = h * bias.shape[1] // mask_dims[1]
                rows = bias.detach()[b, bias_h].expand(w.seqlen_q, w.seqlen_k)
                mask[b, h] = _keep_top_of_causal_prefix(rows, pw.keep, w.causal)
    return BenchInputs(q, k, v, mask, bias, w.causal)


# -- what the floor is --------------------------------------------------------------------------


def _operand_bytes(w: Workload, which: str, itemsize: int) -> float:
    """Bytes of the mask or bias a kernel must read: the causal part when it spans (Lq, Lk)."""
    dims = w.operand_dims(which)
    if dims is None:
        return 0.0
    spans_rows = dims[2] > 1
    fraction = w.visible_pairs() / (w.seqlen_q * w.seqlen_k) if spans_rows else 1.0
    return math.prod(dims) * itemsize * fraction


def bytes_needed(w: Workload, direction: str) -> float:
    """Bytes that must cross HBM: q, k, v, out (+lse), mask and bias over the causal part;
    the backward also reads dout and them again and writes dq, dk, dv and dbias."""
    item = DTYPES[w.dtype].itemsize
    qo = w.batch * w.seqlen_q * w.heads * w.head_dim * item
    kv = w.batch * w.seqlen_k * w.heads_kv * w.head_dim * item
    lse = w.batch * w.heads * w.seqlen_q * 4
    bias_bytes = _operand_bytes(w, "bias", item)
    operands = _operand_bytes(w, "mask", 1) + bias_bytes
    forward = qo + 2 * kv + qo + lse + operands
    if direction == "fwd":
        return forward
    backward = 3 * qo + 2 * kv + lse + operands + qo + 2 * kv + (bias_bytes if w.bias_grad else 0.0)
    return forward + backward


def flops_needed(w: Workload, direction: str) -> float:
    return w.flops("fwd") + (w.flops("bwd") if direction == "fwd+bwd" else 0.0)


def floor_ms(w: Workload, direction: str, peaks: hardware.DevicePeaks | None) -> float | None:
    if peaks is None:
        return None
    return 1e3 * max(flops_needed(w, direction) / peaks.tensor_flops, bytes_needed(w, direction) / peaks.hbm_bytes_per_s)


# -- running ------------------------------------------------------------------------------------


@dataclass
class Row:
    """One (workload, peer, direction) measurement, or its error."""

    workload: str
    peer: str
    direction: str
    status: str  # ok | error
    error: str = ""
    median_ms: float | None = None
    p20_ms: float | None = None
    p80_ms: float | None = None
    spread: float | None = None
    host_ms: float | None = None  # host time of one call, which the timing hides (`timing.py`)
    wall_ms: float | None = None  # eager wall time per call (`timing.eager_wall_ms`)
    tflops: float | None = None
    floor_ms: float | None = None
    floor_fraction: float | None = None
    ours_over_peer_gpu: float | None = None  # our median_ms over this row's
    ours_over_peer_wall: float | None = None  # our wall_ms over this row's
    max_abs_diff_vs_ours: float | None = None
    setup_ms: float | None = None
    note: str = ""

    def to_dict(self) -> dict:
        # six significant digits: milliseconds and fp32 differences of 1e-7 alike survive
        return {key: (float(f"{value:.6g}") if isinstance(value, float) else value) for key, value in asdict(self).items()}

    @classmethod
    def from_dict(cls, data) -> Row:
        """A row of a saved report, also of one from before the eager wall time, whose single
        `ours_over_peer` was the GPU-time ratio.

        Raises:
            ValueError: not a mapping, a key no row has, or a required key missing.
        """
        if not isinstance(data, dict):
            raise ValueError(f"a row is {type(data).__name__}, expected a mapping")
        data = dict(data)
        if "ours_over_peer" in data:
            data["ours_over_peer_gpu"] = data.pop("ours_over_peer")
        known = {field.name: field for field in fields(cls)}
        unknown = sorted(set(data) - set(known))
        missing = sorted(name for name, field in known.items()
                         if field.default is MISSING and field.default_factory is MISSING and name not in data)
        if unknown or missing:
            raise ValueError(f"a row has unknown keys {unknown} or lacks {missing}")
        return cls(**data)


class _Unavailable(Exception):
    """A peer that cannot run on this device; its reason is already one line."""


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300]}"


def _fwd_bwd(prepared: Prepared, grad_out: torch.Tensor):
    def run():
        for leaf in prepared.leaves:
            leaf.grad = None
        prepared.forward().backward(grad_out)

    return run


def _as_blhd(out: torch.Tensor, layout: str) -> torch.Tensor:
    return out.transpose(1, 2) if layout == "bhld" else out


def _measure_peer(pw: PeerWorkload, peer: str, inputs: BenchInputs, table: str | None, device,
                  repeats: int, peaks, ours_out: torch.Tensor | None, advance) -> tuple[list[Row], torch.Tensor | None]:
    w = pw.workload
    rows: list[Row] = []
    out = None
    try:
        reason = unavailable_reason(peer, device)
        if reason is not None:
            raise _Unavailable(reason)
        prepared = PEERS[peer](inputs, table)
    except Exception as exc:  # a peer that cannot even be set up is data
        error = str(exc) if isinstance(exc, _Unavailable) else _one_line(exc)
        for direction in DIRECTIONS:
            rows.append(Row(pw.name, peer, direction, "error", error=error))
            advance(f"{pw.name} {peer} {direction}: error")
        return rows, None
    calls, loops = eager_loop(device)  # time_kernel's warm-up serves the eager loop too
    with prepared.context():  # the peer's own set-up for every call (SDPA's kernel choice)
        for direction in DIRECTIONS:
            row = Row(pw.name, peer, direction, "ok", setup_ms=prepared.setup_ms, note=prepared.note)
            try:
                if direction == "fwd":
                    with torch.no_grad():
                        out = _as_blhd(prepared.forward(), prepared.layout).detach()
                        timing = time_kernel(lambda: prepared.forward(), device, repeats=repeats)
                        wall_ms = eager_wall_ms(lambda: prepared.forward(), device, calls, loops, warmup=0)
                        if ours_out is not None and prepared.semantic:
                            row.max_abs_diff_vs_ours = (out.float() - ours_out.float()).abs().max().item()
                else:
                    grad_out = torch.ones_like(prepared.forward().detach()) / math.sqrt(w.head_dim)
                    timing = time_kernel(_fwd_bwd(prepared, grad_out), device, repeats=repeats)
                    wall_ms = eager_wall_ms(_fwd_bwd(prepared, grad_out), device, calls, loops, warmup=0)
            except Exception as exc:  # a failing peer is a row, whatever failed
                row.status, row.error = "error", _one_line(exc)
            else:
                row.median_ms, row.p20_ms, row.p80_ms, row.spread, row.host_ms = (
                    timing.median_ms, timing.p20_ms, timing.p80_ms, timing.spread, timing.host_ms)
                row.wall_ms = wall_ms
                row.tflops = flops_needed(w, direction) / (timing.median_ms * 1e-3) / 1e12
                row.floor_ms = floor_ms(w, direction, peaks)
                if row.floor_ms is not None:
                    row.floor_fraction = row.floor_ms / timing.median_ms
            rows.append(row)
            advance(f"{pw.name} {peer} {direction}: {row.status}")
    del prepared
    return rows, out


def run_bench(workloads: list[PeerWorkload], peers: list[str], device, table: str | None = None,
              repeats: int = 20) -> list[Row]:
    """Every (workload, peer, direction); ours first in each workload so ratios can be filled.
    The eager wall time runs `eager_loop(device)` calls."""
    device = torch.device(device)
    peaks = hardware.device_peaks(device)
    rows: list[Row] = []
    with output.progress("bench", total=len(workloads) * len(peers) * len(DIRECTIONS)) as advance:
        for pw in workloads:
            output.info(f"workload {pw.describe()}")
            inputs = build_bench_inputs(pw, device)
            ours_out = None
            for peer in peers:
                peer_rows, out = _measure_peer(pw, peer, inputs, table, device, repeats, peaks, ours_out, advance)
                if peer == OURS:
                    ours_out = out
                rows.extend(peer_rows)
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            del inputs, ours_out
    fill_ratios(rows)
    return rows


def fill_ratios(rows: list[Row]) -> None:
    """Each row's ours/peer on GPU time (median_ms) and on eager wall time (wall_ms), where both
    our row of its workload and direction and its own have the time."""
    ours = {(r.workload, r.direction): r for r in rows if r.peer == OURS and r.status == "ok"}
    for row in rows:
        mine = ours.get((row.workload, row.direction))
        if mine is None:
            continue
        if mine.median_ms is not None and row.median_ms:
            row.ours_over_peer_gpu = mine.median_ms / row.median_ms
        if mine.wall_ms is not None and row.wall_ms:
            row.ours_over_peer_wall = mine.wall_ms / row.wall_ms


def failed_rows_of_ours(rows: list[Row]) -> list[Row]:
    """Our own rows (peer `dmattn`) that ended in an error: the run failed at its one job."""
    return [row for row in rows if row.peer == OURS and row.status != "ok"]


# -- reports ------------------------------------------------------------------------------------


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


COLUMNS = ("workload", "direction", "peer", "status", "gpu ms", "spread", "host ms", "wall ms", "TFLOP/s",
           "floor ms", "of floor", "ours/peer gpu", "ours/peer wall", "max|diff|", "setup ms")


def row_cells(row: Row) -> list[str]:
    """One cell per `COLUMNS` entry."""
    status = row.status if row.status == "ok" else f"error: {row.error}"
    return [row.workload, row.direction, row.peer, status, _fmt(row.median_ms, ".3f"),
            _fmt(None if row.spread is None else 100 * row.spread, ".1f") + ("%" if row.spread is not None else ""),
            _fmt(row.host_ms, ".3f"), _fmt(row.wall_ms, ".3f"), _fmt(row.tflops, ".1f"), _fmt(row.floor_ms, ".3f"),
            _fmt(None if row.floor_fraction is None else 100 * row.floor_fraction, ".0f") + ("%" if row.floor_fraction else ""),
            _fmt(row.ours_over_peer_gpu, ".2f"), _fmt(row.ours_over_peer_wall, ".2f"),
            _fmt(row.max_abs_diff_vs_ours, ".2e"), _fmt(row.setup_ms, ".0f")]


def markdown(document: dict) -> str:
    """The report as a markdown document (header, one table, per-peer notes)."""
    lines = [f"# dmattn-bench bench on {document['device']}", "",
             f"Command: `{document['command']}`", ""]
    if document.get("timings_meaningful") is False:
        lines += ["**Timings are not meaningful**: the Triton interpreter ran our kernel on the CPU.", ""]
    loop = document.get("eager_loop")
    wall = ("not measured in this report" if loop is None else
            f"{loop['calls']} back-to-back calls, no spin, no flush, one sync at the end; median of {loop['loops']} "
            + ("loop" if loop["loops"] == 1 else "loops"))
    lines += [f"Software: {', '.join(f'{k} {v}' for k, v in document['software'].items())}. "
              f"gpu ms = median of {document['repeats']} repeats of GPU time, L2 flushed before each and the host's "
              "launch work hidden behind a GPU spin (what a CUDA-graph user sees); spread = (p80 - p20) / median; "
              "host ms = the host's own time to enqueue one call (median, no sync; '-' in reports from before it "
              f"was measured); wall ms = eager wall time per call ({wall}). "
              "TFLOP/s over the causal pairs (fwd 2 GEMMs, bwd 5) in gpu ms. Floor = max(FLOPs / tensor peak, "
              "needed bytes / HBM bandwidth) with "
              f"{document['peaks'] or 'no known peaks for this device'}. ours/peer gpu and ours/peer wall: our "
              "gpu ms and wall ms over the peer's; < 1: ours is faster.", ""]
    lines.append("| " + " | ".join(c.replace("|", "\\|") for c in COLUMNS) + " |")  # max|diff| is one cell
    lines.append("|" + "---|" * len(COLUMNS))
    for data in document["rows"]:
        lines.append("| " + " | ".join(c.replace("|", "/") for c in row_cells(Row.from_dict(data))) + " |")
    lines += ["", "Workloads:", ""] + [f"- {text}" for text in document["workloads"]]
    notes = {(r["peer"], r["note"]) for r in document["rows"] if r["note"]}
    lines += ["", "Peer notes:", ""] + [f"- {peer}: {note}" for peer, note in sorted(notes)]
    return "\n".join(lines) + "\n"


# The plot's panel rows: what each bar is, and its axis label
PLOT_TIMES = (("median_ms", "gpu ms (log)"), ("wall_ms", "eager wall ms per call (log)"))


def plot(document: dict, path: str | Path) -> None:
    """Bar charts (log scale) of the GPU medians and, below, the eager wall times per call: one
    panel per direction, one group per workload; a failed row is marked "failed" where its bar
    would be. A report from before the wall time has the GPU panels only.

    Raises:
        ModuleNotFoundError: matplotlib is missing (the `plot` extra).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = document["rows"]
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    peers = list(dict.fromkeys(r["peer"] for r in rows))
    times = [(key, label) for key, label in PLOT_TIMES if any(r.get(key) is not None for r in rows)] or PLOT_TIMES[:1]
    figure, axes = plt.subplots(len(times), len(DIRECTIONS), figsize=(7 * len(DIRECTIONS), 4.5 * len(times)),
                                squeeze=False)
    width = 0.8 / max(1, len(peers))
    for panels, (key, label) in zip(axes, times):
        for axis, direction in zip(panels, DIRECTIONS):
            for index, peer in enumerate(peers):
                positions = [i + index * width for i in range(len(workloads))]
                values = []
                for position, workload in zip(positions, workloads):
                    match = [r for r in rows if (r["workload"], r["peer"], r["direction"]) == (workload, peer, direction)]
                    ok = bool(match) and match[0]["status"] == "ok"
                    value = match[0].get(key) if ok else None
                    values.append(float("nan") if value is None else value)
                    if match and not ok:
                        axis.annotate("failed", (position, 0.02), xycoords=("data", "axes fraction"),
                                      rotation=90, ha="center", fontsize="x-small")
                axis.bar(positions, values, width, label=peer)
            axis.set_xticks([i + width * (len(peers) - 1) / 2 for i in range(len(workloads))], workloads)
            axis.set_yscale("log")
            axis.set_ylabel(label)
            axis.set_title(f"{direction} on {document['device']}")
    axes[0][0].legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
