"""`dmattn-bench compile-check`: cross-compile the search space for archs that need not be present."""

from __future__ import annotations

from collections import Counter

import click
from rich.table import Table

from dmattn_bench import output
from dmattn_bench.errors import DmattnError
from dmattn_bench.hardware import ARCH_LIMITS, parse_arch, search_section
from dmattn_bench.space import CONFIGS_DIR, TUNED_DIRECTIONS
from dmattn_bench.tuning.prune import DTYPE_BYTES, STATUSES, Candidate, check_space, load_space, plan_space, space_path

TOP_REASONS = 3
# What each deciding check means, for the summary's reasons column.
CHECK_LABELS = {
    "structure": "not supported by the kernel",
    "threads": "too many threads per block",
    "estimate": "estimated shared memory over the limit",
    "shared": "shared memory over the limit",
    "registers": "registers over the limit",
    "compile": "compile error",
}


def _int_list(ctx, param, value: str) -> list[int]:
    del ctx
    try:
        items = [int(item) for item in value.split(",") if item.strip()]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {value!r}", param=param) from None
    if not items or any(item <= 0 for item in items):
        raise click.BadParameter(f"expected positive integers, got {value!r}", param=param)
    return items


def _arch_list(ctx, param, value: str) -> list[str]:
    del ctx
    try:
        archs = [parse_arch(item).arch for item in value.split(",") if item.strip()]
    except ValueError as exc:
        raise click.BadParameter(str(exc), param=param) from None
    if not archs:
        raise click.BadParameter(f"expected one or more of {', '.join(ARCH_LIMITS)}", param=param)
    return list(dict.fromkeys(archs))


def _summary(candidates: list[Candidate], archs: list[str]) -> list[dict]:
    rows = []
    for arch in archs:
        for direction in TUNED_DIRECTIONS:
            group = [c for c in candidates if c.arch == arch and c.direction == direction]
            if not group:
                continue
            counts = Counter(c.status for c in group)
            reasons = Counter(c.check for c in group if c.status != "fits")
            fits = [c.shared_bytes for c in group if c.status == "fits" and c.shared_bytes is not None]
            examples = {c.check: c.reason for c in group if c.status != "fits"}
            rows.append({
                "arch": arch, "direction": direction, "candidates": len(group),
                **{status: counts.get(status, 0) for status in STATUSES},
                "max_shared_bytes_fit": max(fits) if fits else None,
                "top_reasons": [{"check": check, "label": CHECK_LABELS.get(check, check), "count": count,
                                 "example": examples[check]} for check, count in reasons.most_common(TOP_REASONS)],
            })
    return rows


def _table(backend: str, rows: list[dict], dtype: str, head_dims: list[int]) -> Table:
    table = Table(title=f"compile-check: {backend}, {dtype}, head dims {','.join(map(str, head_dims))}")
    for column in ("arch", "direction", "candidates", *STATUSES, "max shared (fits)", "top reasons"):
        table.add_column(column, justify="left" if column in ("arch", "direction", "top reasons") else "right")
    for row in rows:
        shared = row["max_shared_bytes_fit"]
        table.add_row(
            row["arch"], row["direction"], str(row["candidates"]), *(str(row[s]) for s in STATUSES),
            "-" if shared is None else f"{shared / 1024:.0f} KiB",
            "; ".join(f"{r['label']} x{r['count']} (e.g. {r['example']})" for r in row["top_reasons"]) or "-",
        )
    table.caption = "unsupported and compile_error candidates are pruned from tuning; they are data, not failures"
    return table


@click.command("compile-check")
@click.option("--arch", "archs", required=True, callback=_arch_list,
              help=f"Comma-separated target archs, e.g. sm80,sm90,sm120 (known: {', '.join(ARCH_LIMITS)}).")
@click.option("--backend", type=click.Choice(["triton", "cuda", "all"]), default="triton", show_default=True,
              help="Kernel backend whose search space is checked.")
@click.option("--head-dim", "head_dims", default="64,128", show_default=True, callback=_int_list,
              help="Comma-separated head dims to compile for.")
@click.option("--dtype", type=click.Choice(sorted(DTYPE_BYTES)), default="bf16", show_default=True,
              help="Element type of q, k, v.")
@click.option("--space-dir", type=click.Path(exists=True, file_okay=False), default=str(CONFIGS_DIR / "space"),
              show_default="the project's configs/space", help="Folder of <backend>-<direction>.yaml search spaces.")
@click.option("--jobs", type=click.IntRange(min=1), default=None,
              help="Parallel compile processes. Default: the number of CPUs.")
@click.option("--format", "fmt", type=click.Choice(output.FORMATS), default="human", show_default=True,
              help="Result format on stdout.")
def compile_check(archs: list[str], backend: str, head_dims: list[int], dtype: str, space_dir: str,
                  jobs: int | None, fmt: str) -> None:
    """Cross-compile the search space for each arch (no GPU needed) and summarise what fits."""
    documents, tables = [], []
    for name in ("triton", "cuda") if backend == "all" else (backend,):
        check = _check_cuda if name == "cuda" else _check_triton
        candidates = check(archs, head_dims, dtype, space_dir, jobs)
        rows = _summary(candidates, archs)
        documents.append({"backend": name, "dtype": dtype, "head_dims": head_dims, "archs": archs,
                          "summary": rows, "candidates": [c.to_dict() for c in candidates]})
        tables.append(_table(name, rows, dtype, head_dims))
    output.render(documents[0] if len(documents) == 1 else {"backends": documents}, tables, fmt)


def _check_triton(archs: list[str], head_dims: list[int], dtype: str, space_dir: str, jobs: int | None):
    paths = [space_path(space_dir, "triton", direction) for direction in TUNED_DIRECTIONS]
    for path in paths:
        if not path.exists():
            output.warn(f"no search space {path}: its direction is skipped")
    paths = [path for path in paths if path.exists()]
    if not paths:
        raise click.BadParameter(f"no triton-fwd.yaml, triton-bwd.yaml or triton-decode.yaml in {space_dir}",
                                 param_hint="--space-dir")
    try:
        # Loading every section up front reports a malformed space before any compiling.
        total = len(plan_space(paths, archs, head_dims))
    except ValueError as exc:
        raise DmattnError(str(exc), "fix the search-space file") from None
    with output.progress("compile-check triton", total=total) as advance:
        return check_space(paths, archs, head_dims, dtype, jobs=jobs,
                           on_result=lambda c: advance(f"{c.arch} {c.direction} {c.status}"))


def _check_cuda(archs: list[str], head_dims: list[int], dtype: str, space_dir: str, jobs: int | None):
    from dmattn_bench.tuning.cuda_check import CUDA_DTYPES, check_cuda_space
    from dmattn_kernels.cuda.build import CudaBuildError, nvcc

    if dtype not in CUDA_DTYPES:
        raise click.BadParameter(f"the cuda kernels take {' or '.join(CUDA_DTYPES)}, got {dtype}",
                                 param_hint="--dtype")
    try:
        nvcc()  # one clear error, not a compile_error per candidate
    except CudaBuildError as exc:
        raise DmattnError(str(exc), "install the CUDA toolkit") from None
    paths = {direction: space_path(space_dir, "cuda", direction) for direction in ("fwd", "bwd")}
    for path in paths.values():
        if not path.exists():
            raise click.BadParameter(f"no {path.name} in {space_dir}", param_hint="--space-dir")
    try:
        total = sum(len(load_space(path, "cuda", direction, search_section(parse_arch(arch))))
                    for direction, path in paths.items() for arch in archs)
    except ValueError as exc:
        raise DmattnError(str(exc), "fix the search-space file") from None
    with output.progress("compile-check cuda", total=total * len(head_dims)) as advance:
        return check_cuda_space(space_dir, archs, head_dims, dtype, jobs=jobs,
                                on_result=lambda c: advance(f"{c.arch} {c.direction} {c.status}"))
