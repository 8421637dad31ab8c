"""The entries of a dispatch table whose config sets a kernel knob, each also as an fp16 key, as a
table of their own: what `dmattn-bench verify --table OUT --dtype bf16|fp16` re-validates after a
knob's tune (the tune's keys are bf16; the knob's code runs in fp16 too).

    python -m benchmarks knob-entries TABLE KNOB OUT
"""

from __future__ import annotations

import argparse
import sys

import yaml

from dmattn_bench.bench.operators import operator


@operator("knob-entries", help="A table of the entries whose config sets a knob, each also as an fp16 key")
def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("table", help="the dispatch table (YAML)")
    parser.add_argument("knob", help="a kernel knob of FwdConfig or BwdConfig, e.g. tma_store")
    parser.add_argument("out", help="where the entries' table is written")
    args = parser.parse_args(argv)
    with open(args.table) as source:
        table = yaml.safe_load(source)
    entries = [entry for entry in table["entries"] if entry["config"].get(args.knob)]
    table["entries"] = entries + [{**entry, "key": {**entry["key"], "dtype": "fp16"}} for entry in entries]
    with open(args.out, "w") as target:
        yaml.safe_dump(table, target, sort_keys=False)
    print(f"{len(entries)} {args.knob} entries", file=sys.stderr)
    return 0
