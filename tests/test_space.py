"""dmattn_bench.space: configs, their labels and dicts, and search-space grids (the forward's
kernel knobs: what a table, journal or space written before them reads as)."""

from __future__ import annotations

import pytest

from dmattn_bench.space import FwdConfig, config_from_dict, config_label, expand_grid


def test_a_knob_left_off_is_not_written_and_reads_back_off():
    """`to_dict` is a config's table, journal and trial record: a knob at 0 is left out, so every
    record of a config without knobs is what it was before they were added."""
    tiles = FwdConfig(128, 128, 12, 2)
    assert tiles.to_dict() == {"block_m": 128, "block_n": 128, "num_warps": 12, "num_stages": 2}
    assert FwdConfig(128, 128, 12, 2, overlap=0, persistent=0) == tiles
    for config in (tiles, FwdConfig(128, 128, 12, 2, overlap=1), FwdConfig(128, 128, 12, 2, overlap=1, persistent=1)):
        assert config_from_dict(FwdConfig, config.to_dict()) == config
    assert FwdConfig(128, 128, 12, 2, overlap=1).to_dict() == {**tiles.to_dict(), "overlap": 1}
    assert FwdConfig(128, 128, 12, 2, 1, 1).to_dict() == {**tiles.to_dict(), "overlap": 1, "persistent": 1}
    assert config_from_dict(FwdConfig, {**tiles.to_dict(), "overlap": 0}) == tiles  # a 0 written out reads the same


def test_a_knob_is_an_int_from_0_and_its_value_is_the_backend_s_to_judge():
    """`config_from_dict` takes a knob's 0; a value other than 0 or 1 is a config that
    `is_supported` rules out with its reason (not a malformed record)."""
    tiles = {"block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 2}
    assert config_from_dict(FwdConfig, {**tiles, "persistent": 2}).persistent == 2
    with pytest.raises(ValueError, match=r"FwdConfig.overlap: expected an int >= 0, got -1"):
        config_from_dict(FwdConfig, {**tiles, "overlap": -1})
    with pytest.raises(ValueError, match=r"FwdConfig.overlap: expected an int >= 0, got True"):
        config_from_dict(FwdConfig, {**tiles, "overlap": True})
    with pytest.raises(ValueError, match=r"FwdConfig.block_m: expected a positive int, got 0"):
        config_from_dict(FwdConfig, {**tiles, "block_m": 0})


def test_a_label_names_the_knobs_that_are_on():
    assert config_label(FwdConfig(128, 128, 12, 2)) == "128x128 w12 s2"
    assert config_label(FwdConfig(128, 128, 12, 2, overlap=1)) == "128x128 w12 s2 overlap"
    assert config_label(FwdConfig(128, 128, 12, 2, overlap=1, persistent=1)) == "128x128 w12 s2 overlap persistent"
    assert config_label(FwdConfig(128, 128, 12, 2, overlap=2)) == "128x128 w12 s2 overlap=2"


def test_a_space_may_leave_the_knobs_out_but_not_a_tile():
    tiles = {"block_m": [64, 128], "block_n": [64], "num_warps": [4], "num_stages": [2]}
    assert expand_grid("fwd", tiles, "space") == [FwdConfig(64, 64, 4, 2), FwdConfig(128, 64, 4, 2)]
    crossed = expand_grid("fwd", {**tiles, "overlap": [0, 1], "persistent": [0, 1]}, "space")
    assert len(crossed) == 8 and {(c.overlap, c.persistent) for c in crossed} == {(0, 0), (0, 1), (1, 0), (1, 1)}
    assert crossed[:4] == [FwdConfig(64, 64, 4, 2, o, p) for o in (0, 1) for p in (0, 1)]  # the dataclass's order
    with pytest.raises(ValueError, match=r"space: missing key\(s\) \['num_stages'\]"):
        expand_grid("fwd", {name: values for name, values in tiles.items() if name != "num_stages"}, "space")
    with pytest.raises(ValueError, match=r"space: FwdConfig.persistent: expected an int >= 0, got -1"):
        expand_grid("fwd", {**tiles, "persistent": [-1]}, "space")
