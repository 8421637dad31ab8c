"""Ranking a key's candidates before compiling any (issue 57), and the rule that says how far down
the ranking a tune times.

The model is nearest neighbours over the committed trial journals, distilled into
`configs/ranking.json` by `python -m benchmarks learn-ranking` (the code reads no journal under
`results/`). Each timed shape there (a
journal's workload in one direction) gives every config it timed a relative time: its median over
the fastest config's on that shape (1.0: the best). A candidate's predicted relative time for a
key is the weighted geometric mean of its relative times on the journal shapes of the key's
backend and direction, each shape weighted by how close its key is (`similarity`: head dim, mask
and bias kinds, causality, GQA, dtype, length buckets, packed and window; a shape two octaves of
length away still counts, a different head-dim class barely), among the shapes at least
NEIGHBOUR_SHARE as close as the closest one that timed it. A candidate no neighbour timed is
ranked after every one that was, in the order the space lists them, unless it is a seen config
with a kernel knob on (`RankingModel.predict_items`). The default config a call of
the key runs today is always timed (the tuner puts it first), so a ranking can never do worse than
no tune.

The widening rule (`Widening`): time the first batch of the ranking (the default and the model's
first picks) and the next, and go on while each batch beats the best time before it by more than
`tolerance`. A batch without gain says that the model's order has become right near the top: the
candidates below it are predicted slower than every one timed, and the last `batch` of them
already failed to improve. (Stopping after the first batch when its best was the model's pick
missed the best by 1.5x on H100 D256 backward shapes: two picks can agree with each other and
both be wrong.) Either way the search goes on while the measured times of the timed candidates
stray from the predicted ones (`misfit` over `model_error`; how far beyond MISFIT_CAP a slow
candidate lies is not counted): there the model does not know the key. `--exhaustive` times every
candidate; `benchmarks/ranked_replay.py` replays the rule on the committed journals.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from dmattn_bench.space import BWD_KNOBS, CONFIGS_DIR, FWD_KNOBS, TableKey
from dmattn_bench.tuning.journal import RANKED_OUT, timed_trials

# Weight factors of `similarity`: a mismatch multiplies the weight by its factor. Head dim decides
# the register and shared-memory budget of a tile, so a neighbour of another head-dim class says
# little; the mask and bias kinds change the loads per tile; the rest move the balance less.
MISMATCH_WEIGHT = {"head_dim": 0.05, "mask": 0.3, "bias": 0.3, "causal": 0.4, "packed": 0.2, "window": 0.3,
                   "gqa_ratio": 0.7, "dtype": 0.8}
OCTAVE_WEIGHT = 0.6  # per octave between the length buckets (query and key each)
# A prediction counts the shapes at least this share as close as the closest that timed the config:
# many far shapes (another head dim's 32 of a new journal) no longer outvote a few near ones.
# Replayed on the committed journals (batch 3), Triton's worst regret with its own journal held
# out fell from 1.518 (an H100 D256 backward) to 1.043 and with its workload held out from 1.084
# to 1.043, CUDA's from 1.014 to 1.008; 0.2 did as well, 0.3 missed a CUDA shape by 1.24x.
NEIGHBOUR_SHARE = 0.1
UNSEEN = math.inf  # predicted relative time of a config no neighbour timed


RANKING_FILE = CONFIGS_DIR / "ranking.json"  # the shapes a tune ranks with (`write_shapes`, `load`)


def write_shapes(shapes_by_backend: dict[str, list["Shape"]], path: Path) -> None:
    """The journal shapes of each backend as `RankingModel.load` reads them: each config listed
    once, each shape's relative times by config index (written by `python -m benchmarks
    learn-ranking` from the committed journals, as the learned defaults are)."""
    document = {}
    for backend, shapes in shapes_by_backend.items():
        configs = sorted({items for shape in shapes for items in shape.relative})
        index = {items: i for i, items in enumerate(configs)}
        document[backend] = {
            "configs": [dict(items) for items in configs],
            "shapes": [{"journal": shape.journal, "workload": shape.workload, "key": shape.key,
                        "default": index.get(shape.default),
                        "relative": [[index[items], round(value, 4)] for items, value in shape.relative.items()]}
                       for shape in shapes]}
    path.write_text(json.dumps(document, sort_keys=True, separators=(",", ":")) + "\n")


def config_items(config) -> tuple:
    """A config as hashable (field, value) items, as the journals store it (`to_dict`)."""
    return tuple(sorted(config.to_dict().items()))


@dataclass(frozen=True)
class Shape:
    """One journal shape: its key (as the journal stores it) and each config's relative time."""

    journal: str
    workload: str
    key: dict
    relative: dict[tuple, float]  # config items -> median over the shape's best
    default: tuple | None = None  # the config items the tune timed first (the key's default then)


def read_shapes(journals: list[Path], backend: str) -> list[Shape]:
    """The timed shapes of `backend` in `journals` (`ok` trials with a median), one per journal,
    workload and direction."""
    times: dict[tuple[int, str, str, str], dict[tuple, float]] = {}  # (journal, its name, workload, direction)
    keys: dict[tuple[int, str, str, str], dict] = {}
    defaults: dict[tuple[int, str, str, str], tuple] = {}
    for index, journal in enumerate(journals):  # two journals of one file name stay apart
        for name, trial, items in timed_trials([journal], backend):
            where = (index, name, trial["workload"], trial["direction"])
            keys[where] = trial["key"]
            times.setdefault(where, {})[items] = trial["median_ms"]
            if trial.get("is_default"):
                defaults[where] = items
    return [Shape(where[1], where[2], keys[where], {config: ms / min(by_config.values()) for config, ms in by_config.items()},
                  defaults.get(where))
            for where, by_config in times.items()]


def _head_dim_class(head_dim: int) -> int:
    return 64 if head_dim <= 64 else 128 if head_dim <= 128 else 256


def similarity(key: dict, other: dict) -> float:
    """How much a shape of key `other` says about `key` (both as `TableKey.to_dict` writes them), in
    (0, 1]; 0 for another direction, whose kernels differ."""
    if key["direction"] != other["direction"]:
        return 0.0
    weight = 1.0
    for field, factor in MISMATCH_WEIGHT.items():
        mine, theirs = key.get(field, 0), other.get(field, 0)
        if field == "head_dim":
            mine, theirs = _head_dim_class(mine), _head_dim_class(theirs)
        elif field == "bias":
            mine, theirs = str(mine).removesuffix("+grad"), str(theirs).removesuffix("+grad")
        if mine != theirs:
            weight *= factor
    for bucket in ("seqlen_q_bucket", "seqlen_k_bucket"):
        octaves = abs(math.log2(max(key.get(bucket, 1), 1)) - math.log2(max(other.get(bucket, 1), 1)))
        weight *= OCTAVE_WEIGHT ** octaves
    return weight


class RankingModel:
    """Predicted relative times of configs for a key, from journal shapes (module docstring)."""

    def __init__(self, shapes: list[Shape]):
        self.shapes = shapes

    @classmethod
    def from_journals(cls, journals: list[Path], backend: str) -> "RankingModel":
        return cls(read_shapes(journals, backend))

    @classmethod
    def load(cls, backend: str, path: Path = RANKING_FILE) -> "RankingModel":
        """The model of `backend`'s shapes in `path` (`write_shapes`); none when it has none."""
        if not path.exists():
            return cls([])
        part = json.loads(path.read_text()).get(backend, {"configs": [], "shapes": []})
        configs = [tuple(sorted(config.items())) for config in part["configs"]]
        return cls([Shape(s["journal"], s["workload"], s["key"], {configs[i]: value for i, value in s["relative"]},
                          None if s["default"] is None else configs[s["default"]]) for s in part["shapes"]])

    def without(self, journal: str | None = None, workload: str | None = None) -> "RankingModel":
        """The model with a journal's shapes, or a workload's in every journal, left out (held out)."""
        return RankingModel([s for s in self.shapes if s.journal != journal and s.workload != workload])

    def predict(self, key: TableKey | dict, config) -> float:
        """`config`'s predicted relative time on `key`; `UNSEEN` when no neighbour timed it."""
        return self.predict_items(key.to_dict() if isinstance(key, TableKey) else key, config_items(config))

    def predict_items(self, key: dict, items: tuple) -> float:
        """`predict` of a config given as its items, for a key given as its dict. A config with a
        kernel knob on that no shape timed takes its knobs-off twin's prediction: a knob new to
        the journals is tried beside its tiles, not after every seen config (replayed, the H200
        knob journal held out: worst regret 1.16x ranked last, 1.006x so)."""
        predicted = self._weighted(key, items)
        if predicted == UNSEEN:
            plain = tuple((name, value) for name, value in items if name not in FWD_KNOBS + BWD_KNOBS)
            if plain != items:
                return self._weighted(key, plain)
        return predicted

    def _weighted(self, key: dict, items: tuple) -> float:
        """The weighted geometric mean of `items`' relative times on the shapes that timed it, of
        those at least NEIGHBOUR_SHARE as close as the closest."""
        neighbours = [(similarity(key, shape.key), shape.relative[items]) for shape in self.shapes
                      if items in shape.relative]
        closest = max((weight for weight, _ in neighbours), default=0.0)
        kept = [(weight, relative) for weight, relative in neighbours if weight >= closest * NEIGHBOUR_SHARE]
        total = sum(weight for weight, _ in kept)
        return math.exp(sum(weight * math.log(relative) for weight, relative in kept) / total) if total > 0 else UNSEEN

    def rank(self, key: TableKey | dict, candidates: list) -> list[tuple[object, float]]:
        """`candidates` with their predictions, the most promising first (a stable sort: ties and
        unseen configs keep the space's order)."""
        predicted = [(config, self.predict(key, config)) for config in candidates]
        return sorted(predicted, key=lambda pair: pair[1])


@dataclass(frozen=True)
class Widening:
    """How far down a ranking a tune times (module docstring): `batch` candidates at a time, until
    a batch fails to beat the best time so far by more than `tolerance`."""

    batch: int = 3
    tolerance: float = 0.02
    model_error: float = 1.15

    def first(self, ranked: list) -> list:
        return ranked[:self.batch]

    def next_batch(self, ranked: list, timed: dict, last: list, predicted: dict | None = None) -> list:
        """The next candidates of `ranked` to time, or [] to stop. `timed`: {candidate: median ms or
        None (failed)} of everything timed so far; `last`: the batch timed just now; `predicted`:
        {candidate: predicted relative time}."""
        if len(timed) >= len(ranked):
            return []
        predicted = predicted or {}
        before = [ms for c, ms in timed.items() if c not in last and ms is not None]
        now = {c: timed[c] for c in last if timed.get(c) is not None}
        # the first batch has nothing to be compared with: it always gets a second
        gain = not before or (bool(now) and min(now.values()) < min(before) / (1 + self.tolerance))
        if not gain and misfit(timed, predicted) <= self.model_error:
            return []
        return [c for c in ranked if c not in timed][:self.batch]


# A candidate this much slower than the best is out of the running, whatever its exact time: the
# model's error on how much slower does not count against it (`misfit`). Replayed on the H200's
# exhaustive default tune (both dtypes and backends) with the committed model, CUDA timed 372 of
# 1240 candidates in up to 14 rounds uncapped and 207 in up to 5 capped, the same choices: the
# model put the warp-specialized backward 1.0-1.7x ahead of the rest where it is 6-10x. At 1.3,
# a shape held out of the model missed its best by 3x.
MISFIT_CAP = 1.5


def misfit(timed: dict, predicted: dict) -> float:
    """How far the measured times of the timed candidates are from the model's predictions, as the
    geometric mean of max(ratio, 1 / ratio) of measured over predicted, each relative to its own
    best and cut at MISFIT_CAP (1.0: the model got every ratio right, or both agree a candidate is
    out of the running). 1.0 with fewer than two candidates the model has an opinion on."""
    pairs = [(ms, predicted[c]) for c, ms in timed.items()
             if ms is not None and math.isfinite(predicted.get(c, UNSEEN))]
    if len(pairs) < 2:
        return 1.0
    best_ms, best_predicted = min(ms for ms, _ in pairs), min(p for _, p in pairs)
    logs = [abs(math.log(min(ms / best_ms, MISFIT_CAP) / min(p / best_predicted, MISFIT_CAP))) for ms, p in pairs]
    return math.exp(sum(logs) / len(logs))


def search(ranked: list, times: dict, widening: Widening, predicted: dict | None = None) -> list:
    """The candidates a ranked search times when candidate c takes `times[c]` ms (None: failed):
    what the tuner does, replayed on known times (`replay`)."""
    timed: dict = {}
    batch = widening.first(ranked)
    while batch:
        for candidate in batch:
            timed[candidate] = times.get(candidate)
        batch = widening.next_batch(ranked, timed, batch, predicted)
    return list(timed)


@dataclass(frozen=True)
class ReplayRow:
    """One held-out shape of `replay`: how many candidates the search timed of those the journal
    timed, and the regret of its choice (its time over the journal's best)."""

    journal: str
    workload: str
    direction: str
    timed: int
    candidates: int
    regret: float


def replay(model: RankingModel, widening: Widening, hold_out: str = "workload") -> list[ReplayRow]:
    """The ranked search replayed on every shape of `model`, each ranked by the model without it:
    `hold_out` "workload" leaves out that workload in every journal (a shape no journal has),
    "journal" only its own journal (a GPU whose table is new, the other GPUs' journals known).
    The shape's default (what its tune timed first) leads the ranking, as the tuner times it first."""
    rows = []
    for shape in model.shapes:
        held = model.without(workload=shape.workload) if hold_out == "workload" else model.without(journal=shape.journal)
        candidates = list(shape.relative)
        predicted = {items: held.predict_items(shape.key, items) for items in candidates}
        ranked = sorted(candidates, key=predicted.__getitem__)
        if shape.default in shape.relative:
            ranked = [shape.default] + [c for c in ranked if c != shape.default]
        chosen = search(ranked, shape.relative, widening, predicted)
        best = min(shape.relative[c] for c in chosen)
        rows.append(ReplayRow(shape.journal, shape.workload, shape.key["direction"], len(chosen), len(candidates),
                              best))
    return rows


# -- the tuner's rounds -------------------------------------------------------------------------


@dataclass
class _Group:
    """One (workload, direction) of a ranked tune: its candidates, most promising first."""

    ranked: list  # tuner items (workload, direction, config, is_default)
    predicted: dict  # config -> predicted relative time
    timed: dict  # config -> median ms, None when it failed
    last: list  # configs of the batch in flight


class RankedRounds:
    """The tuner's rounds of a ranked search: each (workload, direction) times its default and the
    first batch of its ranking, then widens by `Widening` until it stops. `items` are the tuner's
    (workload, direction, config, is_default) candidates that run on this GPU; `finished(item)`
    returns a finished trial's median ms, None when it failed, or `...` when it has not run (a
    resumed journal's trials count as timed)."""

    def __init__(self, items: list, model: RankingModel, widening: Widening):
        self.widening = widening
        self.groups: dict[tuple, _Group] = {}
        for item in items:
            self.groups.setdefault((item[0], item[1]), _Group([], {}, {}, [])).ranked.append(item)
        for (workload, direction), group in self.groups.items():
            key = workload.key(direction)
            group.predicted = {item[2]: model.predict(key, item[2]) for item in group.ranked}
            # the default first (a call of the key runs it today), then by prediction; stable
            group.ranked.sort(key=lambda item: (not item[3], group.predicted[item[2]]))

    def first(self, finished) -> list:
        """The first round's items to run."""
        batch = []
        for group in self.groups.values():
            group.last = [item[2] for item in self.widening.first(group.ranked)]
            batch += self._unfinished(group, finished)
        return batch

    def next_round(self, finished) -> list:
        """The next round's items to run ([] when every group has stopped)."""
        batch = []
        for group in self.groups.values():
            if not group.last:
                continue
            configs = [item[2] for item in group.ranked]
            group.last = self.widening.next_batch(configs, group.timed, group.last, group.predicted)
            batch += self._unfinished(group, finished)
        return batch

    def _unfinished(self, group: _Group, finished) -> list:
        """Records the batch's finished trials as timed; returns the items still to run. A batch
        wholly finished already (a resumed journal's) is followed by the next at once."""
        while True:
            todo = []
            for item in group.ranked:
                if item[2] in group.last:
                    result = finished(item)
                    if result is ...:
                        todo.append(item)
                    else:
                        group.timed[item[2]] = result
            if todo or not group.last:
                for item in todo:
                    group.timed[item[2]] = None  # until measured (`timed_as`)
                return todo
            configs = [item[2] for item in group.ranked]
            group.last = self.widening.next_batch(configs, group.timed, group.last, group.predicted)

    def timed_as(self, item, median_ms: float | None) -> None:
        """Records a measured item's median (None: it failed)."""
        self.groups[(item[0], item[1])].timed[item[2]] = median_ms

    def left_out(self) -> list[tuple[tuple, str]]:
        """(item, reason) of every candidate the search did not time."""
        out = []
        for group in self.groups.values():
            for rank, item in enumerate(group.ranked):
                if item[2] not in group.timed:
                    predicted = group.predicted[item[2]]
                    guess = f"predicted {predicted:.2f}x the best" if math.isfinite(predicted) else "no neighbour timed it"
                    out.append((item, f"ranked {rank + 1} of {len(group.ranked)} ({guess}); --exhaustive times it"))
        return out

    def regret_estimate(self) -> dict:
        """The search's own estimate of what leaving candidates out cost: per (workload, direction),
        the fastest timed candidate's predicted relative time over the lowest predicted among those
        left out (at least 1; the model's word that one of them is faster, in its units), as a
        geometric mean and a worst over the groups that left any out and whose fastest the model
        has a prediction for; `unknown` counts the others that left some out."""
        estimates, unknown = [], 0
        for group in self.groups.values():
            left = [group.predicted[item[2]] for item in group.ranked if item[2] not in group.timed]
            timed = {c: ms for c, ms in group.timed.items() if ms is not None}
            if not left:
                continue
            best = min(timed, key=timed.get) if timed else None
            if best is None or not math.isfinite(group.predicted[best]) or not math.isfinite(min(left)):
                unknown += 1
                continue
            estimates.append(max(1.0, group.predicted[best] / min(left)))
        return {"groups": len(estimates), "unknown": unknown,
                "geomean": round(math.exp(sum(map(math.log, estimates)) / len(estimates)), 4) if estimates else None,
                "worst": round(max(estimates), 4) if estimates else None}

    def records(self, backend_name: str) -> list[dict]:
        """Journal records of each group's ranking: its order, predictions and how many it timed."""
        from dmattn_bench.space import config_label

        return [{"kind": "ranking", "id": f"{workload.label}|{direction}|{backend_name}",
                 "order": [config_label(item[2]) for item in group.ranked],
                 "predicted": [round(group.predicted[item[2]], 4) if math.isfinite(group.predicted[item[2]]) else None
                               for item in group.ranked],
                 "timed": sum(item[2] in group.timed for item in group.ranked)}
                for (workload, direction), group in self.groups.items()]

    def winner_rank(self, item_config, workload, direction) -> int | None:
        """The 1-based rank the model gave a winner."""
        group = self.groups.get((workload, direction))
        if group is None:
            return None
        return next((rank + 1 for rank, item in enumerate(group.ranked) if item[2] == item_config), None)


# -- a ranked tune against an exhaustive one -----------------------------------------------------


def _ok_times(journal: Path) -> dict[tuple, dict[str, float]]:
    """{(backend, key as JSON, config as JSON): {workload: median ms}} of a journal's ok trials."""
    times: dict[tuple, dict[str, float]] = {}
    for _, trial, _ in timed_trials([journal], backend=None):
        where = (trial["backend"], json.dumps(trial["key"], sort_keys=True), json.dumps(trial["config"], sort_keys=True))
        times.setdefault(where, {})[trial["workload"]] = trial["median_ms"]
    return times


def compare_tunes(ranked: dict, exhaustive: dict, journal: Path) -> dict:
    """A ranked tune against an exhaustive one of the same grid, from their `tune --format json`
    documents: the wall ratio, and per key the ranked choice's time over the exhaustive choice's
    by the exhaustive journal's timings (geometric mean over the key's workloads; None where that
    journal did not time the ranked choice on them all)."""
    times = _ok_times(journal)
    chosen = {json.dumps(w["key"], sort_keys=True): w for w in exhaustive["winners"]}
    rows = []
    for winner in ranked["winners"]:
        key = json.dumps(winner["key"], sort_keys=True)
        best = chosen.get(key)
        regret = None
        if best is not None:
            ours = times.get((winner["backend"], key, json.dumps(winner["config"], sort_keys=True)), {})
            theirs = times.get((best["backend"], key, json.dumps(best["config"], sort_keys=True)), {})
            if theirs and set(theirs) <= set(ours):
                regret = math.exp(sum(math.log(ours[w] / theirs[w]) for w in theirs) / len(theirs))
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
