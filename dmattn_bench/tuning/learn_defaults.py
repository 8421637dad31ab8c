"""Learning default tile configs from trial journals: the config with the lowest
selection regret across the tuned shapes, per arch family, direction, head-dim class and whether
the bias has rows (`space.bias_has_rows`). The 16-bit dtypes share a group: the kernels are the
same and Hopper's tensor cores run bf16 and fp16 at one rate, so a dtype tuned on fewer shapes
(the peer journals are bf16 only) learns from the other's.

A shape's regret for a config is its median time over the fastest config's on that shape (1.0:
the config was the best). Within a group (arch family, direction, head-dim class, bias with rows
or not) only configs timed on every shape of the group compete, and only configs that passed the
full adversarial suite on the current kernels qualify (the entries of a validated shipped table);
the winner has the lowest geometric-mean regret, ties going to the lower worst regret.

`configs/defaults.yaml` holds the result with its evidence (shapes, geometric-mean and worst
regret, the heuristic default's figures on the same shapes, the journals); `build` makes it and
`python -m benchmarks learn-defaults` writes it, offline, from the journals it is given. The
runtime reads it in `dmattn_bench.tiles`; a group the journals do not cover keeps the heuristic
default there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import yaml

from dmattn_bench.dispatch.table import load_table
from dmattn_bench.space import BwdConfig, FwdConfig, bias_has_rows
from dmattn_bench.tuning.journal import timed_trials
from dmattn_bench.tiles import GPU_DEFAULTS

POOLED_DTYPES = ("bf16", "fp16")  # the journals' kernel dtypes; each group's default serves both
HEAD_DIM_CLASSES = (64, 128, 256)  # a class holds the head dims above the previous bound up to its own
_CONFIG_CLASSES = {"fwd": FwdConfig, "bwd": BwdConfig}


def head_dim_class(head_dim: int) -> int:
    """The largest head dim of the class `head_dim` falls in."""
    return next(high for high in HEAD_DIM_CLASSES if head_dim <= high)


@dataclass(frozen=True)
class Learned:
    """One group's default and its evidence."""

    config: FwdConfig | BwdConfig
    shapes: int
    geomean_regret: float
    worst_regret: float

    def to_dict(self) -> dict:
        return dict(config=self.config.to_dict(), shapes=self.shapes, geomean_regret=self.geomean_regret,
                    worst_regret=self.worst_regret)


def _geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def config_items(config: FwdConfig | BwdConfig) -> tuple:
    """A config as the hashable (field, value) items the journals' times are keyed by."""
    return tuple(sorted(config.to_dict().items()))


def group_of(key: dict) -> tuple:
    """The group a journal key's shape informs: (direction, head-dim class, bias has rows)."""
    return key["direction"], head_dim_class(key["head_dim"]), bias_has_rows(key["bias"])


def qualified_configs(tables) -> set[tuple]:
    """(direction, config items) of every Triton entry of these validated tables: the configs a
    learned default may be."""
    return {(entry.key.direction, config_items(entry.config))
            for path in tables for entry in load_table(path).entries if entry.backend == "triton"}


def regrets(times: dict[tuple, dict[tuple, float]], config: tuple) -> list[float]:
    """Per shape of `times` ({shape: {config items: median ms}}), `config`'s time over the best."""
    return [by_config[config] / min(by_config.values()) for by_config in times.values()]


def read_journal_times(journals: list[Path], backend: str = "triton") -> dict[tuple, dict[tuple, dict[tuple, float]]]:
    """{(direction, head-dim class, bias has rows): {shape: {config items: median ms}}} of
    `timed_trials` of the `POOLED_DTYPES`; a shape is (journal, workload) so two GPUs' runs of a
    workload stay apart (a workload names its dtype)."""
    groups: dict[tuple, dict[tuple, dict[tuple, float]]] = {}
    for name, trial, config in timed_trials(journals, backend):
        key = trial["key"]
        if key["dtype"] not in POOLED_DTYPES or key["direction"] not in _CONFIG_CLASSES:
            continue  # the short-query forward has its own defaults (`tiles.DECODE_DEFAULTS`)
        if key.get("packed") or key.get("window"):
            continue  # learned on dense calls' shapes: packed and windowed ones tune their own entries
        groups.setdefault(group_of(key), {}).setdefault((name, trial["workload"]), {})[config] = trial["median_ms"]
    return groups


def learn(times: dict[tuple, dict[tuple, dict[tuple, float]]], qualified: set[tuple]) -> dict[tuple, Learned]:
    """The lowest-regret qualified config of each group (module docstring); `qualified` holds
    (direction, config items) pairs; a group is keyed (direction, head-dim class, bias has rows)."""
    learned = {}
    for group, shapes in sorted(times.items()):
        direction = group[0]
        common = set.intersection(*(set(by_config) for by_config in shapes.values()))
        ranked = sorted((_geomean(regrets(shapes, c)), max(regrets(shapes, c)), c)
                        for c in common if (direction, c) in qualified)
        if ranked:
            geomean, worst, items = ranked[0]
            learned[group] = Learned(_CONFIG_CLASSES[direction](**dict(items)), len(shapes), round(geomean, 3),
                                     round(worst, 3))
    return learned


HEADER = """\
# Default tile configs per backend, arch family, direction, head-dim class (the head dims above
# the previous class's max_head_dim up to this one) and bias with rows (bias_rows: a full, kv_head
# or shared bias, whose tiles the kernels load), for the dtypes listed (their shapes pooled: one
# kernel, one tensor-core rate), learned from trial journals: the
# config with the lowest geometric-mean regret (its time over the best config's, per shape) on
# every shape of the group, among the configs that passed the full adversarial suite on the
# current kernels (the validated tables' entries). A group not listed keeps the heuristic
# default of dmattn_bench/tiles.py. Written by `python -m benchmarks learn-defaults` from the
# journals and tables listed below (do not edit by hand).
#
# Evidence per group: shapes (one per journal and workload), geomean_regret and worst_regret of
# the chosen config, and the heuristic default's on the same shapes (heuristic_*), in-sample.
"""


def build(journals: list[Path], validated: list[Path], arch: str) -> dict:
    """The document `configs/defaults.yaml` holds (module docstring)."""
    times = read_journal_times(journals)
    qualified = qualified_configs(validated)
    heuristics = {high: (fwd, bwd) for high, fwd, bwd in GPU_DEFAULTS}
    groups = []
    for (direction, high, bias_rows), learned in learn(times, qualified).items():
        heuristic = heuristics[high][0 if direction == "fwd" else 1]
        items = config_items(heuristic)
        shapes = times[(direction, high, bias_rows)]
        evidence = {}
        if all(items in by_config for by_config in shapes.values()):
            heuristic_regrets = regrets(shapes, items)
            evidence = dict(heuristic_geomean_regret=round(_geomean(heuristic_regrets), 3),
                            heuristic_worst_regret=round(max(heuristic_regrets), 3))
        groups.append(dict(direction=direction, dtypes=list(POOLED_DTYPES),
                           max_head_dim=high, bias_rows=bias_rows,
                           **learned.to_dict(), **evidence))
    return dict(journals=[str(path) for path in journals],
                validated_tables=[str(path) for path in validated],
                defaults={"triton": {arch: groups}})


def render(document: dict) -> str:
    """`document` as the text of `configs/defaults.yaml`, under its header."""
    return HEADER + yaml.safe_dump(document, sort_keys=False, width=120)
