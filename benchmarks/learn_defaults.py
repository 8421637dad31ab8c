"""Writes `configs/defaults.yaml`: the default tile configs learned from the trial journals it
is given (`dmattn_bench.tuning.learn_defaults` says how), with their evidence. The committed file was written
from a clean checkout with

    python -m benchmarks learn-defaults \
        --journal results/tune/h100-default-workloads.trials.jsonl \
        --journal results/tune/h200-default-workloads.trials.jsonl \
        --journal results/bench/h100-peers-table.yaml.trials.jsonl \
        --journal results/bench/h200-peers-table.yaml.trials.jsonl \
        --journal results/tune/h100-shipped-grid.trials.jsonl \
        --validated results/tables/nvidia-h100-80gb-hbm3-sm90.yaml

(the sm90 journals of the H100 and H200 tunes of the default and peer workloads; the configs of
the validated H100 table qualify). The file lists what it was learned from.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from dmattn_bench.bench.operators import operator
from dmattn_bench.tiles import DEFAULTS_FILE
from dmattn_bench.tuning.learn_defaults import build, render


@operator("learn-defaults", help="Writes configs/defaults.yaml, default configs learned from trial journals (offline)")
def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="sm90", help="arch family the journals were measured on (default: sm90)")
    parser.add_argument("--journal", type=Path, action="append", required=True,
                        help="a trial journal to learn from (repeatable), as it is to be listed in the file")
    parser.add_argument("--validated", type=Path, action="append", required=True,
                        help="a validated table whose entries qualify as defaults (repeatable)")
    parser.add_argument("--out", type=Path, default=DEFAULTS_FILE)
    args = parser.parse_args(argv)
    args.out.write_text(render(build(args.journal, args.validated, args.arch)))
    print(args.out)
