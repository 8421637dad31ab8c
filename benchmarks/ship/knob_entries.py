"""The entries of a dispatch table whose config sets a kernel knob, each also as an fp16 key, as a
table of their own: what `dmattn-bench verify --table OUT --dtype bf16|fp16` re-validates after a
knob's tune (the tune's keys are bf16; the knob's code runs in fp16 too).

    python3 benchmarks/ship/knob_entries.py TABLE KNOB OUT
"""

import sys

import yaml


def main(table_path: str, knob: str, out_path: str) -> None:
    table = yaml.safe_load(open(table_path))
    entries = [entry for entry in table["entries"] if entry["config"].get(knob)]
    table["entries"] = entries + [{**entry, "key": {**entry["key"], "dtype": "fp16"}} for entry in entries]
    print(f"{len(entries)} {knob} entries", file=sys.stderr)
    yaml.safe_dump(table, open(out_path, "w"), sort_keys=False)


if __name__ == "__main__":
    main(*sys.argv[1:])
