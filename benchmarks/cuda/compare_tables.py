"""Per tuned key: the winner, and the best ok trial of each backend (ms) with their ratio.

    python -m benchmarks cuda-compare-tables tune.json table.yaml.trials.jsonl
"""
import argparse
import json

from dmattn_bench.bench.operators import operator


@operator("cuda-compare-tables", help="Per tuned key, a tune's winner and each backend's best ok trial")
def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("summary", help="the tune's JSON (`tune --format json`)")
    parser.add_argument("journal", help="the tune's trial journal (TABLE.trials.jsonl)")
    args = parser.parse_args(argv)
    summary = json.load(open(args.summary))
    print("wall", summary["wall_s"], "phases", summary["phases_s"], "counts", summary["counts"])
    best = {}
    for line in open(args.journal):
        trial = json.loads(line)
        if trial.get("kind") != "trial" or trial["status"] != "ok":
            continue
        key = tuple(trial["key"][name] for name in ("direction", "mask", "bias", "gqa_ratio"))
        slot = best.setdefault(key, {})
        if trial["backend"] not in slot or trial["median_ms"] < slot[trial["backend"]]:
            slot[trial["backend"]] = trial["median_ms"]
    winners = {tuple(w["key"][n] for n in ("direction", "mask", "bias", "gqa_ratio")): w for w in summary["winners"]}
    print(f"{'direction mask bias gqa':32s} {'winner':7s} {'triton ms':>9s} {'cuda ms':>8s} {'cuda/triton':>11s}")
    for key, winner in winners.items():
        slot = best.get(key, {})
        tri, cu = slot.get("triton"), slot.get("cuda")
        ratio = f"{cu / tri:.2f}" if tri and cu else "-"
        print(f"{' '.join(map(str, key)):32s} {winner['backend']:7s} {tri or float('nan'):9.4f} "
              f"{cu or float('nan'):8.4f} {ratio:>11s}")
