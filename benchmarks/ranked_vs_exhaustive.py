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
import math
from pathlib import Path

from dmattn_bench.bench.operators import operator


def _times(journal: Path) -> dict[tuple, dict[str, float]]:
    """{(backend, key as JSON, config as JSON): {workload: median ms}} of the journal's ok trials."""
    times: dict[tuple, dict[str, float]] = {}
    for line in journal.read_text().splitlines():
        trial = json.loads(line)
        if trial.get("kind") == "trial" and trial.get("status") == "ok" and trial.get("median_ms"):
            where = (trial["backend"], json.dumps(trial["key"], sort_keys=True), json.dumps(trial["config"],
                                                                                            sort_keys=True))
            times.setdefault(where, {})[trial["workload"]] = trial["median_ms"]
    return times


def compare(ranked: dict, exhaustive: dict, journal: Path) -> dict:
    """The comparison document (module docstring). A key the ranked run chose a config for that the
    exhaustive run did not time on all the key's workloads is listed with regret None."""
    times = _times(journal)
    chosen = {json.dumps(w["key"], sort_keys=True): w for w in exhaustive["winners"]}
    rows = []
    for winner in ranked["winners"]:
        key = json.dumps(winner["key"], sort_keys=True)
        best = chosen.get(key)
        regret = None
        if best is not None:
            ours = times.get((winner["backend"], key, json.dumps(winner["config"], sort_keys=True)), {})
            theirs = times.get((best["backend"], key, json.dumps(best["config"], sort_keys=True)), {})
            shared = sorted(set(ours) & set(theirs))
            if shared and set(theirs) <= set(ours):
                regret = math.exp(sum(math.log(ours[w] / theirs[w]) for w in shared) / len(shared))
        rows.append({"key": winner["key"], "ranked": [winner["backend"], winner["config"]],
                     "exhaustive": None if best is None else [best["backend"], best["config"]],
                     "regret": None if regret is None else round(regret, 4)})
    known = [r["regret"] for r in rows if r["regret"] is not None]
    return {"wall_ratio": round(ranked["wall_s"] / exhaustive["wall_s"], 4),
            "ranked_wall_s": ranked["wall_s"], "exhaustive_wall_s": exhaustive["wall_s"],
            "ranked_phases_s": ranked.get("phases_s"), "exhaustive_phases_s": exhaustive.get("phases_s"),
            "regret_geomean": round(math.exp(sum(map(math.log, known)) / len(known)), 4) if known else None,
            "regret_worst": max(known) if known else None,
            "keys": len(rows), "keys_without_regret": len(rows) - len(known),
            "search_regret_estimate": ranked.get("search_regret_estimate"), "rows": rows}


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
    document = compare(ranked, exhaustive, args.journal or Path(exhaustive["trials_file"]))
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
