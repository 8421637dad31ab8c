"""A ranked tune against an exhaustive one of the same grid on the same GPU (issue 57): the wall
ratio, and each key's regret, the ranked table's choice over the exhaustive table's by the
exhaustive run's own timings of both (geometric mean over the key's workloads). From the two
runs' `dmattn-bench tune --format json` outputs; the exhaustive one's journal (its `trials_file`,
or --journal) holds the timings.

    dmattn-bench tune ... --format json > ranked.json
    dmattn-bench tune ... --exhaustive --format json > exhaustive.json
    python -m benchmarks ranked-vs-exhaustive ranked.json exhaustive.json [--journal J] [--format json]

Markdown (or, with --format json, a JSON document with wall_ratio, regret_geomean and
regret_worst) on stdout."""

import argparse
import json
from pathlib import Path

from dmattn_bench.bench.operators import operator
from dmattn_bench.tuning.ranking import compare_tunes


@operator("ranked-vs-exhaustive", help="A ranked tune against an exhaustive one: wall ratio and regret per key")
def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks ranked-vs-exhaustive",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("ranked", type=Path, help="`tune --format json` output of the ranked run")
    parser.add_argument("exhaustive", type=Path, help="the same of the --exhaustive run")
    parser.add_argument("--journal", type=Path, help="the exhaustive run's journal (default: its trials_file)")
    parser.add_argument("--format", choices=("markdown", "json"), default="markdown")
    args = parser.parse_args(argv)
    ranked, exhaustive = (json.loads(path.read_text()) for path in (args.ranked, args.exhaustive))
    document = compare_tunes(ranked, exhaustive, args.journal or Path(exhaustive["trials_file"]))
    if args.format == "json":
        print(json.dumps(document, indent=1))
        return
    print(f"wall: ranked {document['ranked_wall_s']} s, exhaustive {document['exhaustive_wall_s']} s, "
          f"ratio {document['wall_ratio']}; regret over {document['keys']} keys: geomean "
          f"{document['regret_geomean']}, worst {document['regret_worst']}"
          + (f" ({document['keys_without_regret']} keys without one)" if document["keys_without_regret"] else ""))
    print()
    print("| key | ranked choice | exhaustive choice | regret |")
    print("|---|---|---|---|")
    for row in document["rows"]:
        key = row["key"]
        label = (f"{key['direction']} {key['dtype']} D{key['head_dim']} {key['mask']}/{key['bias']} "
                 f"gqa{key['gqa_ratio']} L{key['seqlen_q_bucket']}x{key['seqlen_k_bucket']}"
                 + (" causal" if key.get("causal") else ""))
        print(f"| {label} | {row['ranked']} | {row['exhaustive']} | {row['regret']} |")
