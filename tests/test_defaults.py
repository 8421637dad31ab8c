"""Defaults learned from the trial journals: the rule, the committed data, and where they apply."""

from pathlib import Path

import yaml

from dmattn_bench import tiles
from dmattn_bench.dispatch import load_table
from dmattn_bench.space import BwdConfig, FwdConfig
from dmattn_bench.tiles import GPU_DEFAULTS, INTERPRETER_DEFAULT, default_entries_for
from dmattn_bench.tuning import learn_defaults

ROOT = Path(__file__).parents[1]


def _items(config):
    return tuple(sorted(config.to_dict().items()))


def test_the_lowest_geomean_regret_among_qualified_configs_on_every_shape_wins():
    fast, steady, unqualified, partial = (FwdConfig(64, 64, 4, s) for s in (1, 2, 3, 4))
    times = {("fwd", 128, False): {
        ("j", "a"): {_items(fast): 1.0, _items(steady): 1.1, _items(unqualified): 0.5, _items(partial): 0.9},
        ("j", "b"): {_items(fast): 2.0, _items(steady): 1.2, _items(unqualified): 1.0},
    }}
    qualified = {("fwd", _items(c)) for c in (fast, steady, partial)}
    (learned,) = learn_defaults.learn(times, qualified).values()
    # fast: regrets 2.0 and 2.0 (geomean 2.0); steady: 2.2 and 1.2 (geomean 1.62); `unqualified` is
    # faster but never passed the suite; `partial` was not timed on every shape
    assert learned.config == steady
    assert (learned.shapes, learned.geomean_regret, learned.worst_regret) == (2, 1.625, 2.2)


def test_every_learned_default_is_an_entry_of_a_validated_table_it_names():
    """A learned config is an entry of a validated shipped table that `configs/defaults.yaml`
    names (tests/test_shipped_tables.py checks those are validated on the current kernel
    sources), in its own direction. The journals it names are the learner's input alone: no test
    reads them (`python -m benchmarks learn-defaults --journal ...` writes the file again)."""
    document = yaml.safe_load(tiles.DEFAULTS_FILE.read_text())
    assert document["journals"] and all(name.startswith("results/") for name in document["journals"])
    tables = [ROOT / name for name in document["validated_tables"]]
    assert tables and all(path.parent == ROOT / "results" / "tables" for path in tables)
    validated = {(entry.key.direction, _items(entry.config)) for path in tables for entry in load_table(path).entries}
    learned = tiles.learned_defaults()
    assert learned
    for (backend, arch, direction, dtype, high, bias_rows), config in learned.items():
        assert (direction, _items(config)) in validated, (backend, arch, direction, dtype, high, bias_rows)


def test_learned_defaults_apply_to_their_arch_and_dtype_only():
    learned = tiles.learned_defaults()
    heuristic = {high: (fwd, bwd) for high, fwd, bwd in GPU_DEFAULTS}
    for bias_rows in (False, True):
        for low, high, fwd, bwd in default_entries_for("sm90", "triton", "bf16", bias_rows=bias_rows):
            assert fwd == learned.get(("triton", "sm90", "fwd", "bf16", high, bias_rows), heuristic[high][0])
            assert bwd == learned.get(("triton", "sm90", "bwd", "bf16", high, bias_rows), heuristic[high][1])
    assert default_entries_for("sm90", "triton", "bf16")[1][2:] != heuristic[128]  # D128 learned
    assert default_entries_for("sm90", "triton", "bf16")[2][2:] != heuristic[256]  # D192/D256 learned
    for arch, dtype in (("sm80", "bf16"), ("sm120", "fp16"), ("sm90", None)):
        assert [entry[2:] for entry in default_entries_for(arch, "triton", dtype)] == list(heuristic.values())
    assert default_entries_for(None, "triton", "fp32", gpu=False) == ((8, 256, *INTERPRETER_DEFAULT[1:]),)
    assert all(isinstance(c, (FwdConfig, BwdConfig)) for c in learned.values())


def test_a_bias_with_rows_has_defaults_of_its_own():
    """Its kernels load (and a backward with dBias stores) a tile of bias per block, not a row:
    the journals' bias-with-rows shapes prefer other tiles, so they form groups of their own."""
    from dmattn_bench.space import bias_has_rows

    assert [bias_has_rows(k) for k in ("none", "per_key", "per_key+grad", "kv_head", "full+grad", "shared")] == \
        [False, False, False, True, True, True]
    learned = tiles.learned_defaults()
    differing = sorted(key[:5] for key, config in learned.items() if key[5] and config != learned.get((*key[:5], False)))
    assert differing, "a split that never changes a config would be noise"
    backend, arch, direction, dtype, high = differing[0]
    with_rows = next(e for e in default_entries_for(arch, backend, dtype, bias_rows=True) if e[1] == high)
    assert with_rows[2 if direction == "fwd" else 3] == learned[(*differing[0], True)]


def test_every_caller_that_knows_the_key_asks_for_the_default_of_its_bias(monkeypatch):
    """The tuner's default candidate, the default choice, a forced backend's plan and the verify
    pairing of a table entry all ask `default_configs` with the key's bias kind."""
    from dmattn_bench import plan
    from dmattn_bench.dispatch.table import Entry
    from dmattn_bench.tuning import tuner, validator
    from dmattn_bench.tuning.workloads import Workload

    asked = []

    def spy(head_dim, device, backend="triton", dtype=None, bias="none"):
        asked.append(bias)
        return FwdConfig(64, 64, 4, 2), BwdConfig(64, 64, 64, 64, 4, 2)

    for module in (tuner, tiles, validator):
        monkeypatch.setattr(module, "default_configs", spy)
    workload = Workload(1, 8, 2, 256, 256, 64, False, "kv_head", "kv_head", True, "bf16")
    key = workload.key("bwd")
    assert key.bias == "kv_head+grad"
    tuner.candidate_list("bwd", [], workload, "cpu")
    tiles.default_choice(key, "cpu")
    plan._choose(key, "cpu", "triton", None, None, None)
    validator.plan_table_entries([Entry(key, "triton", BwdConfig(32, 64, 64, 64, 4, 2), {})], "bf16", "cpu", "quick")
    assert asked == [key.bias] * 4
