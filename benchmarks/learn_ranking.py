"""Writes `configs/ranking.json`, the journal shapes `dmattn-bench tune` ranks each key's
candidates with (`dmattn_bench.tuning.ranking`), from trial journals: by default every journal
under `results/` (the tunes of the GPUs the repository was measured on), less the shapes of the
held-out workloads (`configs/workloads/held-out.yaml`, every grid of it), on which the fast tune's
regret is measured and which the ranking must not have seen. Run it after committing a new tune's
journal, as `learn-defaults` is.

    python -m benchmarks learn-ranking [--journals J ...] [--out configs/ranking.json]"""

import argparse
from pathlib import Path

from dmattn_bench.bench.operators import operator
from dmattn_bench.space import CONFIGS_DIR, load_yaml
from dmattn_bench.tuning.ranking import RANKING_FILE, read_shapes, write_shapes
from dmattn_bench.tuning.workloads import load_workloads

HELD_OUT = CONFIGS_DIR / "workloads" / "held-out.yaml"


def committed_journals() -> list[Path]:
    """The trial journals under `results/`: the tunes of the GPUs the repository was measured on."""
    return sorted(Path("results").glob("**/*.trials.jsonl"))


def held_out_labels(path: Path = HELD_OUT) -> set[str]:
    """The workload labels (as journals name their shapes) of every grid of `path`, in each dtype."""
    return {workload.label for grid in load_yaml(path) for dtype in ("bf16", "fp16", "fp32")
            for workload in load_workloads(path, grid, [dtype])}


@operator("learn-ranking", help="Write configs/ranking.json (the tune's ranking data) from trial journals")
def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks learn-ranking", description=__doc__.splitlines()[0])
    parser.add_argument("--journals", type=Path, nargs="+", default=None, help="default: results/**/*.trials.jsonl")
    parser.add_argument("--out", type=Path, default=RANKING_FILE)
    args = parser.parse_args(argv)
    journals = args.journals or committed_journals()
    held_out = held_out_labels()
    shapes = {backend: [shape for shape in read_shapes(journals, backend) if shape.workload not in held_out]
              for backend in ("triton", "cuda")}
    write_shapes(shapes, args.out)
    print(f"{args.out}: " + ", ".join(f"{backend} {len(found)} shapes" for backend, found in shapes.items())
          + f" from {len(journals)} journals (held-out workloads left out)")
