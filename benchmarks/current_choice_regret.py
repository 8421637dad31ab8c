"""Regret of the runtime's choice today, offline, on the keys of a tune's trial journal.

For each (workload, direction) of the journal, the config a call gets today on the table's GPU
(`tiles.choose` with that table: an entry of the key's categories at the nearest lengths, else
the most similar entry within reach, else the learned or heuristic default of the GPU's arch) is
looked up among the journal's timed candidates; its regret is its median over the fastest
candidate's. Keys are split by how the choice was made: an entry tuned for these exact buckets
(in the table), an entry of the same categories at other lengths, a similar entry of other
categories, or the default; all but the first are held out.

    python -m benchmarks current-choice-regret results/tune/h100-shipped-grid.trials.jsonl \
        --table results/tables/nvidia-h100-80gb-hbm3-sm90.yaml > results/regret/h100-shipped-grid.md

The fastest candidate passed validation on its workload; whether it also passes the adversarial
suite is the tune's next step, so the regrets are upper bounds on those against the tune's winner.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from dmattn_bench import tiles
from dmattn_bench.bench.operators import operator
from dmattn_bench.dispatch import load_table
from dmattn_bench.dispatch.lookup import Choice, Dispatcher
from dmattn_bench.space import TableKey, config_label
from dmattn_bench.tuning.journal import timed_trials
from dmattn_bench.tuning.learn_defaults import config_items

SOURCES = ("exact entry", "entry at other lengths", "similar entry", "default")


class OfflineDispatcher(Dispatcher):
    """The runtime's table lookup for a GPU this machine does not have: the table's device stands
    in for the local one."""

    def __init__(self, table_path: Path):
        super().__init__()
        self.device = load_table(table_path).device

    def _fingerprint(self, device):
        return self.device


def read_shapes(journal: Path) -> dict[tuple, tuple[TableKey, dict[tuple, float]]]:
    """{(workload, direction): (key, {config items: median ms})} of the journal's timed trials."""
    shapes: dict[tuple, tuple[TableKey, dict]] = {}
    for _, trial, config in timed_trials([journal]):
        key = TableKey(**trial["key"])
        shapes.setdefault((trial["workload"], key.direction), (key, {}))[1][config] = trial["median_ms"]
    return shapes


def source_of(choice: Choice, key: TableKey, table_keys: set[TableKey]) -> str:
    if choice.source == "default":
        return "default"
    if key in table_keys:
        return "exact entry"
    same_categories = any(other.categorical() == key.categorical() for other in table_keys)
    return "entry at other lengths" if same_categories else "similar entry"


def geomean(values: list[float]) -> float:
    return math.exp(sum(map(math.log, values)) / len(values))


@operator("current-choice-regret", help="Regret of the runtime's choice today on a tune journal's keys (offline)")
def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("journal", type=Path)
    parser.add_argument("--table", type=Path, required=True, help="the table a call would use")
    parser.add_argument("--arch", default="sm90", help="arch family of the table's GPU (default: sm90)")
    args = parser.parse_args(argv)

    dispatcher = OfflineDispatcher(args.table)
    table_keys = {entry.key for entry in load_table(args.table).entries}
    rows = []  # (source, regret or None, workload, direction, choice label, best label)
    for (workload, direction), (key, times) in sorted(read_shapes(args.journal).items()):
        # what `tiles.choose` does, with the table's GPU's arch family for the defaults
        choice = (dispatcher.table_choice(key, "cuda", table=args.table, env=None)
                  or tiles.default_choice(key, "cuda", arch=args.arch))
        best = min(times, key=times.get)
        chosen = times.get(config_items(choice.config))
        regret = chosen / times[best] if chosen is not None else None
        rows.append((source_of(choice, key, table_keys), regret, workload, direction, config_label(choice.config),
                     config_label(type(choice.config)(**dict(best)))))

    print(f"# Regret of today's choice on {args.journal.name} ({dispatcher.device.name})\n")
    print(f"Command: `python -m benchmarks current-choice-regret {args.journal} --table {args.table}`. "
          "Regret: the chosen config's median over the fastest validated candidate's on the same workload "
          "(module docstring).\n")
    print("| how the choice is made | keys | geomean regret | worst regret | not timed |\n|---|---|---|---|---|")
    held_out = []
    for source in SOURCES:
        regrets = [row[1] for row in rows if row[0] == source and row[1] is not None]
        untimed = sum(row[0] == source and row[1] is None for row in rows)
        if source != "exact entry":
            held_out += regrets
        if regrets or untimed:
            print(f"| {source} | {len(regrets) + untimed} | {geomean(regrets):.3f} | {max(regrets):.3f} | {untimed} |"
                  if regrets else f"| {source} | {untimed} | - | - | {untimed} |")
    if held_out:
        print(f"| held out (no entry for these buckets) | {len(held_out)} | {geomean(held_out):.3f} | "
              f"{max(held_out):.3f} | |")
    print("\n| workload | direction | how | today's choice | regret | fastest |\n|---|---|---|---|---|---|")
    for source, regret, workload, direction, chosen, best in sorted(rows, key=lambda row: (SOURCES.index(row[0]),
                                                                                          -(row[1] or math.inf))):
        print(f"| {workload} | {direction} | {source} | {chosen} | "
              f"{f'{regret:.3f}' if regret is not None else 'not timed'} | {best} |")
