"""The ranked search of `dmattn-bench tune` (issue 57): the model that ranks a key's candidates
from journal shapes, the widening rule, their replay on known times, and the tuner's rounds with
the journal they leave, which `--exhaustive --resume` completes. Interpreter timings rank nothing
real; the tests that tune check what runs and what is journaled, not which config wins."""

from __future__ import annotations

import json
import math

import pytest

from dmattn_bench.space import FwdConfig, TableKey, config_label
from dmattn_bench.tuning.ranking import (MISFIT_CAP, NEIGHBOUR_SHARE, RANKED_OUT, UNSEEN, RankedRounds,
                                         RankingModel, Shape, Widening, compare_tunes, config_items, misfit,
                                         replay, search, similarity, write_shapes)
from dmattn_bench.tuning.tuner import tune
from dmattn_bench.tuning.workloads import Workload

KEY = TableKey("fwd", "bf16", 128, True, "none", "none", 1, 4096, 4096)
A, B, C, D = FwdConfig(64, 64, 4, 2), FwdConfig(128, 64, 8, 2), FwdConfig(128, 128, 8, 2), FwdConfig(64, 32, 4, 1)


def _shape(key: TableKey, relative: dict, name: str = "w", journal: str = "j") -> Shape:
    return Shape(journal, name, key.to_dict(), {config_items(c): r for c, r in relative.items()})


def test_similarity_is_zero_across_directions_and_falls_with_each_difference():
    key = KEY.to_dict()
    assert similarity(key, key) == 1.0
    assert similarity(key, dict(key, direction="bwd")) == 0.0
    longer = dict(key, seqlen_q_bucket=16384, seqlen_k_bucket=16384)  # two octaves each
    assert similarity(key, longer) == pytest.approx(0.6 ** 4)
    assert similarity(key, dict(key, head_dim=64)) < similarity(key, dict(key, mask="full")) < 1.0
    assert similarity(key, dict(key, head_dim=96)) == 1.0  # one head-dim class


def test_the_model_ranks_by_the_nearest_shapes_and_puts_unseen_configs_last_in_space_order():
    near = _shape(KEY, {A: 1.3, B: 1.0, C: 1.1})
    far = _shape(TableKey("fwd", "bf16", 256, False, "full", "full", 1, 1024, 1024), {A: 1.0, B: 2.0, C: 1.5})
    model = RankingModel([near, far])
    assert [config for config, _ in model.rank(KEY, [A, D, B, C])] == [B, C, A, D]
    assert model.predict(KEY, D) == UNSEEN
    assert model.predict(KEY, B) < 1.01  # the far shape barely counts
    other = TableKey("bwd", "bf16", 128, True, "none", "none+grad", 1, 4096, 4096)
    assert model.predict(other, B) == UNSEEN  # no backward shape


def test_many_far_shapes_do_not_outvote_a_near_one():
    """A new journal's 32 shapes of another head-dim class made an H100 D256 backward, its own
    journal held out, miss its best by 1.5x in replay: a prediction now counts only the shapes at
    least NEIGHBOUR_SHARE as close as the closest that timed the config."""
    near = _shape(KEY, {A: 1.0, B: 1.3})
    far_key = TableKey("fwd", "bf16", 64, True, "none", "none", 1, 4096, 4096)  # head dim weight 0.05
    assert similarity(KEY.to_dict(), far_key.to_dict()) < NEIGHBOUR_SHARE
    many_far = [_shape(far_key, {A: 2.0, B: 1.0}, name=f"far{i}") for i in range(32)]
    model = RankingModel([near] + many_far)
    assert model.predict(KEY, A) == pytest.approx(1.0) and model.predict(KEY, B) == pytest.approx(1.3)
    assert [config for config, _ in model.rank(KEY, [B, A])] == [A, B]
    # with no near shape the far ones still speak
    assert [config for config, _ in RankingModel(many_far).rank(KEY, [A, B])] == [B, A]


def test_widening_stops_after_a_batch_without_gain_unless_the_model_misfits():
    widening = Widening(batch=2, tolerance=0.02, model_error=1.15)
    ranked = [A, B, C, D]
    predicted = {A: 1.0, B: 1.05, C: 1.1, D: 1.2}
    # the first batch set the pace; the second did not beat it by 2%: stop
    assert widening.next_batch(ranked, {A: 1.0, B: 1.05, C: 0.99, D: 1.3}, [C, D], predicted) == []
    # it did: go on (nothing left here)
    assert widening.next_batch(ranked, {A: 1.0, B: 1.05, C: 0.9}, [C], predicted) == [D]
    # no gain, but the measured ratios are far from the predicted ones: the ranking is not to be trusted
    assert misfit({A: 2.0, B: 1.0}, predicted) > 1.15
    assert widening.next_batch(ranked, {A: 2.0, B: 1.0}, [B], {A: 1.0, B: 1.05, C: 1.1}) == [C, D]
    assert misfit({A: 1.0}, predicted) == 1.0  # one point says nothing
    # a candidate both call out of the running (past MISFIT_CAP) agrees, however far past: the
    # H200's CUDA backward, predicted 1.7x behind and measured 10x, no longer widened to the end
    assert misfit({A: 1.0, B: 10.0}, {A: 1.0, B: 1.7}) == 1.0
    assert misfit({A: 1.0, B: 10.0}, {A: 1.0, B: 1.2}) == pytest.approx(math.sqrt(MISFIT_CAP / 1.2))
    assert widening.next_batch(ranked, {A: 1.0, B: 10.0, C: 1.1}, [B, C], {A: 1.0, B: 1.7, C: 1.05}) == []


def test_search_times_down_the_ranking_until_a_batch_brings_nothing():
    times = {A: 3.0, B: 2.0, C: 2.5, D: 1.0}
    assert search([A, B, C, D], times, Widening(batch=1)) == [A, B, C]  # C did not beat B
    assert search([D, B, C, A], times, Widening(batch=1)) == [D, B]
    assert search([A, B, C, D], {A: None, B: None, C: 1.0, D: 0.5}, Widening(batch=2)) == [A, B, C, D]


def test_replay_leaves_each_shape_out_of_its_own_ranking():
    shapes = [_shape(KEY, {A: 1.5, B: 1.0, C: 1.2, D: 2.0}, name=f"w{i}") for i in range(3)]
    rows = replay(RankingModel(shapes), Widening(batch=2), hold_out="workload")
    # the model is right: the second batch brings nothing, so the search stops after it
    assert len(rows) == 3 and all(r.regret == 1.0 and r.timed == 4 and r.candidates == 4 for r in rows)
    lone = replay(RankingModel(shapes[:1]), Widening(batch=2), hold_out="workload")
    assert lone[0].timed >= 2  # with nothing to learn from, the space's order and the rule alone


class _Workload:
    """What `RankedRounds` reads of a workload: its key per direction and a label."""

    label = "w"

    def key(self, direction):
        return KEY


def test_rounds_time_the_default_first_and_count_a_resumed_journal_s_trials_as_timed():
    w = _Workload()
    items = [(w, "fwd", A, False), (w, "fwd", B, False), (w, "fwd", C, True), (w, "fwd", D, False)]
    model = RankingModel([_shape(KEY, {A: 1.0, B: 1.1, C: 1.5, D: 3.0})])
    rounds = RankedRounds(items, model, Widening(batch=2))
    assert [item[2] for item in rounds.first(lambda item: ...)] == [C, A]  # the default, then the best predicted
    for item, ms in ((items[2], 1.5), (items[0], 1.0)):
        rounds.timed_as(item, ms)
    # A beat the default: widen to the next two (B, then D)
    times = {C: 1.5, A: 1.0}
    assert [item[2] for item in rounds.next_round(lambda item: times.get(item[2], ...))] == [B, D]
    rounds.timed_as(items[1], 1.1)
    rounds.timed_as(items[3], 3.0)
    assert rounds.next_round(lambda item: ...) == [] and rounds.left_out() == []
    assert rounds.regret_estimate() == {"groups": 0, "unknown": 0, "geomean": None, "worst": None}
    # resumed: A and C are in the journal already, so the first round runs only what follows them
    again = RankedRounds(items, model, Widening(batch=2))
    assert [item[2] for item in again.first(lambda item: {C: 1.5, A: 1.0}.get(item[2], ...))] == [B, D]
    record = again.records("triton")[0]
    assert record["kind"] == "ranking" and record["order"] == [config_label(c) for c in (C, A, B, D)]
    assert record["timed"] == 4


def test_a_ranked_tune_journals_what_it_left_out_and_exhaustive_resume_times_only_that(tmp_path):
    workload = Workload(1, 2, 2, 24, 24, 32, True, "none", "none", False, "fp32")
    default = FwdConfig(16, 16, 1, 1)
    space = {"fwd": [default, FwdConfig(32, 16, 1, 1), FwdConfig(16, 32, 1, 1), FwdConfig(32, 32, 1, 1)]}
    key = workload.key("fwd")
    # the journals say 32x16 is the best here, 32x32 the worst
    model = RankingModel([_shape(key, {space["fwd"][1]: 1.0, space["fwd"][2]: 1.2, space["fwd"][3]: 3.0, default: 1.5})])
    journal = tmp_path / "T.trials.jsonl"
    first = tune([workload], space, "cpu", journal_path=journal, ranking=model, widening=Widening(batch=1))
    statuses = {(t.config["block_m"], t.config["block_n"]): t.status for t in first.trials}
    assert set(statuses.values()) <= {"ok", RANKED_OUT}
    # the first batch (the default), then always a second (the model's pick); the rest as times say
    assert statuses[(16, 16)] == statuses[(32, 16)] == "ok"
    records = [json.loads(line) for line in journal.read_text().splitlines()]
    ranking = [r for r in records if r["kind"] == "ranking"]
    assert len(ranking) == 1 and ranking[0]["order"] == ["16x16 w1 s1", "32x16 w1 s1", "16x32 w1 s1", "32x32 w1 s1"]
    assert ranking[0]["timed"] == sum(status == "ok" for status in statuses.values())
    search = first.search_of(next(w for w in first.winners if w.key.direction == "fwd"))
    assert search["candidates"] == 4 and search["ran"] == ranking[0]["timed"]
    assert search["predicted_rank"] in (1, 2, 3, 4)
    estimate = first.search_regret["triton"]
    assert estimate["groups"] + estimate["unknown"] == (1 if any(s == RANKED_OUT for s in statuses.values()) else 0)
    left = [t for t in first.trials if t.status == RANKED_OUT]
    assert all("--exhaustive times it" in t.reason for t in left)
    seen = []
    second = tune([workload], space, "cpu", journal_path=journal, resume=True, on_trial=seen.append)
    assert all(trial.status == "ok" for trial in second.trials) and len(second.trials) == 4
    assert len(seen) == len(left)  # the resumed run measured the ranked-out ones only
    assert second.search_of(second.winners[0])["predicted_rank"] is None  # exhaustive: no ranking
    assert second.search_regret == {}


def test_a_key_another_backends_winner_holds_gets_no_winner_and_no_suite_here(tmp_path):
    """In a tune of several backends the table keeps each key's fastest validated winner, ties to
    the backend tuned first: a later backend whose candidates are none faster than that winner
    (`rivals`) runs no suite for the key and names no winner for it; a rival it beats changes
    nothing."""
    workload = Workload(1, 2, 2, 24, 24, 32, True, "none", "none", False, "fp32")
    space = {"fwd": [FwdConfig(16, 16, 1, 1), FwdConfig(32, 16, 1, 1)]}
    key = workload.key("fwd")

    def suites(journal):
        records = [json.loads(line) for line in journal.read_text().splitlines()]
        return [r for r in records if r["kind"] == "suite"]

    beaten = tune([workload], space, "cpu", journal_path=tmp_path / "a.trials.jsonl", rivals={key: 0.0})
    assert beaten.winners == [] and not suites(tmp_path / "a.trials.jsonl")
    assert all(t.status == "ok" and t.stage != "adversarial" for t in beaten.trials)
    kept = tune([workload], space, "cpu", journal_path=tmp_path / "b.trials.jsonl", rivals={key: float("inf")})
    assert [w.key for w in kept.winners] == [key] and len(suites(tmp_path / "b.trials.jsonl")) == 1


def test_the_search_s_regret_estimate_is_what_the_model_says_the_left_out_candidates_could_gain():
    w = _Workload()
    items = [(w, "fwd", A, True), (w, "fwd", B, False), (w, "fwd", C, False), (w, "fwd", D, False)]
    model = RankingModel([_shape(KEY, {A: 1.5, B: 1.0, C: 1.2, D: 1.3})])
    rounds = RankedRounds(items, model, Widening(batch=2))
    assert [item[2] for item in rounds.first(lambda item: ...)] == [A, B]
    rounds.timed_as(items[0], 1.0)  # the default came out fastest, though predicted 1.5x the best
    rounds.timed_as(items[1], 1.2)
    # stopped here (say, by the budget): C, predicted 1.2, may beat A, predicted 1.5, by 1.25x
    estimate = rounds.regret_estimate()
    assert estimate == {"groups": 1, "unknown": 0, "geomean": 1.25, "worst": 1.25}
    rounds.timed_as(items[0], 2.0)  # B fastest now: the model gives C and D no edge over it
    assert rounds.regret_estimate()["worst"] == 1.0
    blind = RankedRounds(items, RankingModel([]), Widening(batch=2))
    blind.first(lambda item: ...)
    blind.timed_as(items[0], 1.0)
    assert blind.regret_estimate() == {"groups": 0, "unknown": 1, "geomean": None, "worst": None}


def test_a_knob_no_journal_timed_is_ranked_beside_its_tiles():
    plain, knob = FwdConfig(128, 128, 12, 2), FwdConfig(128, 128, 12, 2, overlap=1)
    model = RankingModel([_shape(KEY, {plain: 1.0, A: 1.4, B: 1.8})])
    assert model.predict(KEY, knob) == model.predict(KEY, plain) == 1.0
    assert [config for config, _ in model.rank(KEY, [B, A, knob])] == [knob, A, B]
    assert model.predict(KEY, FwdConfig(256, 64, 12, 2, overlap=1)) == UNSEEN  # no twin timed either


def test_ranked_against_exhaustive_takes_both_choices_times_from_the_exhaustive_journal(tmp_path):
    key, other = KEY.to_dict(), dict(KEY.to_dict(), head_dim=64)
    journal = tmp_path / "e.trials.jsonl"
    trials = [("w1", key, A, 1.0), ("w1", key, B, 1.1), ("w2", key, A, 2.0), ("w2", key, B, 2.2),
              ("w3", other, A, 1.0)]
    journal.write_text("\n".join(json.dumps({"kind": "trial", "status": "ok", "backend": "triton", "workload": w,
                                             "key": k, "config": c.to_dict(), "median_ms": ms})
                                  for w, k, c, ms in trials) + "\n")

    def winner(k, config):
        return {"key": k, "backend": "triton", "config": config.to_dict()}

    exhaustive = {"wall_s": 200.0, "trials_file": str(journal), "winners": [winner(key, A), winner(other, A)]}
    ranked = {"wall_s": 50.0, "winners": [winner(key, B), winner(other, C)]}
    document = compare_tunes(ranked, exhaustive, journal)
    assert document["wall_ratio"] == 0.25
    assert [row["regret"] for row in document["rows"]] == [1.1, None]  # C: the exhaustive run has no time of it
    assert document["regret_geomean"] == document["regret_worst"] == 1.1 and document["keys_without_regret"] == 1


def test_the_ranking_file_holds_the_shapes_the_model_ranks_with(tmp_path):
    shapes = [_shape(KEY, {A: 1.3, B: 1.0, C: 1.1}, name="w1"), _shape(KEY, {A: 1.0, D: 2.0}, name="w2")]
    shapes[0] = Shape(shapes[0].journal, "w1", shapes[0].key, shapes[0].relative, config_items(A))
    path = tmp_path / "ranking.json"
    write_shapes({"triton": shapes}, path)
    loaded = RankingModel.load("triton", path)
    assert loaded.shapes == shapes
    assert loaded.rank(KEY, [A, B, C, D]) == RankingModel(shapes).rank(KEY, [A, B, C, D])
    assert RankingModel.load("cuda", path).shapes == [] and RankingModel.load("triton", tmp_path / "none").shapes == []


def test_the_shipped_ranking_file_loads_for_both_backends():
    assert len(RankingModel.load("triton").shapes) > 100 and len(RankingModel.load("cuda").shapes) > 10
