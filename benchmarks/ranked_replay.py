"""The ranked search of `dmattn-bench tune` replayed on the committed trial journals (issue 57): for
every timed shape of a journal (a workload in one direction), rank its candidates with the model
learned from the other shapes (`ranking.replay`), run the widening rule on the shape's measured
times, and report how many candidates it timed and the regret of its choice (its time over the
journal's best). Held out: the shape's workload in every journal (a shape no GPU has tuned), or
only the shape's own journal (a GPU tuning anew, the other GPUs' journals known). No GPU: the
journals' times stand in for the measurements.

    python -m benchmarks ranked-replay [--batch 2 3 4] [--journals J ...]

One markdown table on stdout."""

import argparse
import math
from pathlib import Path

from benchmarks.learn_ranking import committed_journals
from dmattn_bench.bench.operators import operator
from dmattn_bench.tuning.ranking import RankingModel, Widening, replay


def _geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


@operator("ranked-replay", help="The tune's ranked search replayed on the committed journals: candidates timed, regret")
def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks ranked-replay", description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[Widening().batch], help="widening batch sizes")
    parser.add_argument("--journals", type=Path, nargs="+", default=None, help="default: the committed journals")
    args = parser.parse_args(argv)
    journals = args.journals or committed_journals()
    print("| backend | held out | batch | shapes | candidates timed | regret geomean | regret worst | worst shape |")
    print("|---|---|---|---|---|---|---|---|")
    for backend in ("triton", "cuda"):
        model = RankingModel.from_journals(journals, backend)
        if not model.shapes:
            continue
        for hold_out in ("workload", "journal"):
            for batch in args.batch:
                rows = replay(model, Widening(batch=batch), hold_out)
                timed = sum(r.timed for r in rows) / sum(r.candidates for r in rows)
                worst = max(rows, key=lambda r: r.regret)
                print(f"| {backend} | {hold_out} | {batch} | {len(rows)} | {timed:.3f} | "
                      f"{_geomean([r.regret for r in rows]):.4f} | {worst.regret:.3f} | "
                      f"{worst.journal}: {worst.workload} {worst.direction} |")
