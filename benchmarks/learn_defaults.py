"""Writes `configs/defaults.yaml`: the default tile configs learned from the trial journals it
is given (`dmattn_bench.defaults` says how), with their evidence. The committed file was written
from a clean checkout with

    python benchmarks/learn_defaults.py \
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

import yaml

from dmattn_bench import defaults
from dmattn_bench.registry import GPU_DEFAULTS

HEADER = """\
# Default tile configs per backend, arch family, direction, head-dim class (the head dims above
# the previous class's max_head_dim up to this one) and bias with rows (bias_rows: a full, kv_head
# or shared bias, whose tiles the kernels load), for the dtypes listed (their shapes pooled: one
# kernel, one tensor-core rate), learned from trial journals: the
# config with the lowest geometric-mean regret (its time over the best config's, per shape) on
# every shape of the group, among the configs that passed the full adversarial suite on the
# current kernels (the validated tables' entries). A group not listed keeps the heuristic
# default of dmattn_bench/registry.py. Written by `python benchmarks/learn_defaults.py` from the
# journals and tables listed below (do not edit by hand).
#
# Evidence per group: shapes (one per journal and workload), geomean_regret and worst_regret of
# the chosen config, and the heuristic default's on the same shapes (heuristic_*), in-sample.
"""


def build(journals: list[Path], validated: list[Path], arch: str) -> dict:
    """The document `configs/defaults.yaml` holds (module docstring)."""
    times = defaults.read_journal_times(journals)
    qualified = defaults.qualified_configs(validated)
    heuristics = {high: (fwd, bwd) for high, fwd, bwd in GPU_DEFAULTS}
    groups = []
    for (direction, high, bias_rows), learned in defaults.learn(times, qualified).items():
        heuristic = heuristics[high][0 if direction == "fwd" else 1]
        items = defaults.config_items(heuristic)
        shapes = times[(direction, high, bias_rows)]
        evidence = {}
        if all(items in by_config for by_config in shapes.values()):
            regrets = defaults.regrets(shapes, items)
            evidence = dict(heuristic_geomean_regret=round(defaults._geomean(regrets), 3),
                            heuristic_worst_regret=round(max(regrets), 3))
        groups.append(dict(direction=direction, dtypes=list(defaults.POOLED_DTYPES),
                           max_head_dim=high, bias_rows=bias_rows,
                           **learned.to_dict(), **evidence))
    return dict(journals=[str(path) for path in journals],
                validated_tables=[str(path) for path in validated],
                defaults={"triton": {arch: groups}})


def render(document: dict) -> str:
    return HEADER + yaml.safe_dump(document, sort_keys=False, width=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="sm90", help="arch family the journals were measured on (default: sm90)")
    parser.add_argument("--journal", type=Path, action="append", required=True,
                        help="a trial journal to learn from (repeatable), as it is to be listed in the file")
    parser.add_argument("--validated", type=Path, action="append", required=True,
                        help="a validated table whose entries qualify as defaults (repeatable)")
    parser.add_argument("--out", type=Path, default=defaults.DEFAULTS_FILE)
    args = parser.parse_args()
    args.out.write_text(render(build(args.journal, args.validated, args.arch)))
    print(args.out)


if __name__ == "__main__":
    main()
