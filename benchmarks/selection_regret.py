"""Selection regret on held-out shapes, offline, from the committed sm90 trial journals.

Each journal key (one GPU's tune of one workload and direction, every candidate timed) is held
out in turn, with its shape's keys on the other GPUs and in the other dtype; a choice for it is
made without them, and its regret is the chosen config's time on that key over the fastest
candidate's (1.0: the best). Choices compared:
- heuristic: `tiles.GPU_DEFAULTS` for the key's head-dim class;
- learned: `dmattn_bench.tuning.learn_defaults.learn` on the other shapes' keys of the group (direction,
  head-dim class, bias with rows or not; both 16-bit dtypes), among the configs of the validated
  tables (what `configs/defaults.yaml` is, re-learned without the held-out shape);
- nearest entry: the winner of the most similar other key of the same GPU's journal (what a
  table holding every other key would offer), by the distance `similarity_distance`;
- runtime: what `dispatch.lookup` picks from such a table (an entry of the key's categories at
  the nearest lengths, else the most similar within `lookup.SIMILAR_WITHIN`), else the learned
  default as above.

    python -m benchmarks selection-regret

The timings are the journals' (their kernels and GPUs); a config a key did not time counts as
missing, not as a regret.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import yaml

from dmattn_bench.bench.operators import operator
from dmattn_bench.dispatch import lookup
from dmattn_bench.dispatch.table import Entry
from dmattn_bench.space import CONFIG_CLASSES, TableKey
from dmattn_bench.tiles import DEFAULTS_FILE, GPU_DEFAULTS
from dmattn_bench.tuning import learn_defaults
from dmattn_bench.tuning.journal import timed_trials


def similarity_distance(a: dict, b: dict) -> float | None:
    """`lookup.similarity_distance` of two journal keys (dicts)."""
    return lookup.similarity_distance(TableKey(**a), TableKey(**b))


def read_keys(journals: list[Path]) -> dict[tuple, tuple[dict, dict[tuple, float]]]:
    """{(journal, workload, direction): (table key, {config items: median ms})}."""
    keys: dict[tuple, tuple[dict, dict]] = {}
    for name, trial, config in timed_trials(journals):
        keys.setdefault((name, trial["workload"], trial["key"]["direction"]), (trial["key"], {}))[1][config] = \
            trial["median_ms"]
    return keys


def table_of(keys, held: tuple) -> list[Entry]:
    """The other keys of the held-out key's journal as table entries, each with its fastest
    config (what a table tuned on them would hold)."""
    return [Entry(TableKey(**k), "triton", CONFIG_CLASSES[k["direction"]](**dict(min(t, key=t.get))), {})
            for other, (k, t) in keys.items() if other != held and other[0] == held[0]]


def runtime_choice(key: TableKey, entries: list[Entry], default):
    """What `lookup.table_entry` picks for `key` from a table of `entries`, else `default`."""
    entry = lookup.table_entry(key, lookup.by_category(entries))
    return entry.config if entry is not None else default


def _shape(workload: str) -> str:
    """A workload's label without its leading dtype."""
    return workload.split(" ", 1)[1]


def held_out_regrets(keys, qualified) -> list[dict]:
    rows = []
    for held, (key, times) in keys.items():
        best = min(times.values())
        group = learn_defaults.group_of(key)
        # the shape is held out on every GPU and in every dtype: another GPU's run of it, or its run
        # in the other dtype (the learned defaults pool bf16 and fp16), would leak its answer
        others = {(name, workload): t for (name, workload, direction), (k, t) in keys.items()
                  if _shape(workload) != _shape(held[1])
                  and learn_defaults.group_of(k) == group}
        learned = learn_defaults.learn({group: others}, qualified).get(group) if others else None
        heuristic = next(fwd if key["direction"] == "fwd" else bwd for h, fwd, bwd in GPU_DEFAULTS if h == group[1])
        near = [(similarity_distance(key, k), min(t, key=t.get)) for other, (k, t) in keys.items()
                if other != held and other[0] == held[0] and similarity_distance(key, k) is not None]
        distance, nearest = min(near) if near else (None, None)
        regret = lambda items: times[items] / best if items in times else None  # noqa: E731
        runtime = runtime_choice(TableKey(**key), table_of(keys, held), learned.config if learned else heuristic)
        rows.append(dict(key=held, heuristic=regret(learn_defaults.config_items(heuristic)),
                         learned=regret(learn_defaults.config_items(learned.config)) if learned else None,
                         nearest=regret(nearest) if nearest else None, distance=distance,
                         runtime=regret(learn_defaults.config_items(runtime))))
    return rows


def _summary(values: list[float | None]) -> str:
    known = [v for v in values if v is not None]
    geomean = math.exp(sum(math.log(v) for v in known) / len(known))
    return f"{geomean:.3f} | {max(known):.3f} | {len(values) - len(known)}"


@operator("selection-regret", help="Selection regret on held-out shapes from the committed sm90 journals (offline)")
def main(argv: list[str]) -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    # the journals and tables the committed defaults were learned from, as that file lists them
    root = Path(__file__).resolve().parents[1]
    learned_from = yaml.safe_load(DEFAULTS_FILE.read_text())
    journals = [root / name for name in learned_from["journals"]]
    tables = [root / name for name in learned_from["validated_tables"]]
    qualified = learn_defaults.qualified_configs(tables)
    rows = held_out_regrets(read_keys(journals), qualified)
    print("# Selection regret on held-out shapes (sm90, offline from the committed journals)\n")
    print(f"Command: `python -m benchmarks selection-regret`. Journals: "
          f"{', '.join(f'`{p.relative_to(root)}`' for p in journals)} (H100 and H200, the kernels of their "
          f"tunes); qualified configs: the entries of {', '.join(f'`{p.relative_to(root)}`' for p in tables)}. "
          f"{len(rows)} keys, each held out in turn (`benchmarks/selection_regret.py` says how each choice is "
          f"made). Regret: the chosen config's time over the fastest candidate's on the held-out key.\n")
    print("| choice | geomean regret | worst regret | keys that did not time the choice |")
    print("|---|---|---|---|")
    for name, label in (("heuristic", "heuristic default (tiles.GPU_DEFAULTS)"),
                        ("learned", "learned default, re-learned without the shape (configs/defaults.yaml)"),
                        ("nearest", "nearest other key's winner, same GPU (similarity_distance)"),
                        ("runtime", "the runtime's lookup (dispatch.lookup), a table of the journal's other keys, "
                                    "else the learned default")):
        print(f"| {label} | {_summary([r[name] for r in rows])} |")
    print("\n| held-out key | heuristic | learned | nearest (distance) | runtime |")
    print("|---|---|---|---|---|")
    fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    for row in sorted(rows, key=lambda r: r["key"]):
        journal, workload, direction = row["key"]
        print(f"| {journal.split('.')[0]} {workload} {direction} | {fmt(row['heuristic'])} | {fmt(row['learned'])} "
              f"| {fmt(row['nearest'])} ({fmt(row['distance'])}) | {fmt(row['runtime'])} |")
