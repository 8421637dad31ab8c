"""dmattn_bench.space: configs, their labels and dicts, and search-space grids (the forward's
kernel knobs: what a table, journal or space written before them reads as)."""

from __future__ import annotations

import pytest

from dmattn_bench.space import BwdConfig, DecodeConfig, FwdConfig, config_from_dict, config_label, expand_grid


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


def test_a_knob_is_off_or_on():
    """`config_from_dict` takes a knob's 0 or 1; anything else names the field."""
    tiles = {"block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 2}
    assert config_from_dict(FwdConfig, {**tiles, "persistent": 1}).persistent == 1
    with pytest.raises(ValueError, match=r"FwdConfig.persistent: got 2, expected 0 \(off\) or 1 \(on\)"):
        config_from_dict(FwdConfig, {**tiles, "persistent": 2})
    with pytest.raises(ValueError, match=r"FwdConfig.overlap: expected an int >= 0, got -1"):
        config_from_dict(FwdConfig, {**tiles, "overlap": -1})
    with pytest.raises(ValueError, match=r"FwdConfig.overlap: expected an int >= 0, got True"):
        config_from_dict(FwdConfig, {**tiles, "overlap": True})
    with pytest.raises(ValueError, match=r"FwdConfig.block_m: expected a positive int, got 0"):
        config_from_dict(FwdConfig, {**tiles, "block_m": 0})


@pytest.mark.parametrize("build, message", [
    (lambda: FwdConfig(block_m=17, block_n=16, num_warps=1, num_stages=1),
     r"FwdConfig.block_m: got 17, expected a multiple of 16 in \[16, 256\]"),
    (lambda: FwdConfig(block_m=0), r"FwdConfig.block_m: got 0, expected a multiple of 16"),
    (lambda: FwdConfig(block_n=8), r"FwdConfig.block_n: got 8, expected a multiple of 16"),
    (lambda: FwdConfig(block_n=512), r"FwdConfig.block_n: got 512, expected a multiple of 16 in \[16, 256\]"),
    (lambda: FwdConfig(num_warps=0), r"FwdConfig.num_warps: got 0, expected 1 to 16 warps"),
    (lambda: FwdConfig(num_stages=9), r"FwdConfig.num_stages: got 9, expected 1 to 8 stages"),
    (lambda: FwdConfig(num_stages=2.0), r"FwdConfig.num_stages: got 2.0, expected an int"),
    (lambda: FwdConfig(overlap=True), r"FwdConfig.overlap: got True, expected an int"),
    (lambda: BwdConfig(block_n=24), r"BwdConfig.block_n: got 24, expected a multiple of 16"),
    (lambda: BwdConfig(block_m_dq=-16), r"BwdConfig.block_m_dq: got -16, expected a multiple of 16"),
    (lambda: DecodeConfig(block_n=40), r"DecodeConfig.block_n: got 40, expected a multiple of 16"),
    (lambda: DecodeConfig(num_splits=65), r"DecodeConfig.num_splits: got 65, expected 0 \(auto\) to 64"),
])
def test_a_config_no_kernel_can_run_is_refused_where_it_is_built(build, message):
    """Issue 54: block_m=17 reached Triton's arange, 0 a ZeroDivisionError, block_n=8 an
    AssertionError, 11 frames deep; the config now names its field when it is built."""
    with pytest.raises(ValueError, match=message):
        build()


def test_every_config_the_kernels_take_is_buildable():
    """The rule is the union of the backends' tiles: the warp-specialized forward's 192 rows on
    16 warps, the backward's 12 warps, a Triton 16-row tile, a decode split count of 64."""
    assert FwdConfig(192, 128, 16, 2, overlap=1, persistent=1).block_m == 192
    assert BwdConfig(64, 128, 64, 64, 12, 2).num_warps == 12
    assert FwdConfig(16, 16, 1, 1).block_m == 16
    assert DecodeConfig(256, 16, 8, 64).num_splits == 64


def test_a_label_names_the_knobs_that_are_on():
    assert config_label(FwdConfig(128, 128, 12, 2)) == "128x128 w12 s2"
    assert config_label(FwdConfig(128, 128, 12, 2, overlap=1)) == "128x128 w12 s2 overlap"
    assert config_label(FwdConfig(128, 128, 12, 2, overlap=1, persistent=1)) == "128x128 w12 s2 overlap persistent"
    assert FwdConfig(128, 128, 12, 2).knobs_on() == ()
    assert FwdConfig(128, 128, 12, 2, overlap=1, tma_store=1).knobs_on() == ("overlap", "tma_store")


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


def test_the_backward_s_kv_group_knob_is_written_labelled_and_crossed_as_the_forward_s_knobs():
    """BwdConfig.kv_group: left out of a record while off (tables and journals of before read the
    same), labelled when on, 0 or 1, and an optional axis of a backward space."""
    tiles = BwdConfig(64, 128, 64, 128, 12, 2)
    assert "kv_group" not in tiles.to_dict() and BwdConfig(64, 128, 64, 128, 12, 2, kv_group=0) == tiles
    grouped = BwdConfig(64, 128, 64, 128, 12, 2, kv_group=1)
    assert grouped.to_dict() == {**tiles.to_dict(), "kv_group": 1}
    assert config_from_dict(BwdConfig, grouped.to_dict()) == grouped
    assert config_label(tiles) == "64x128 dq64x128 w12 s2"
    assert config_label(grouped) == "64x128 dq64x128 w12 s2 kv_group"
    with pytest.raises(ValueError, match=r"BwdConfig.kv_group: got 2, expected 0 \(off\) or 1 \(on\)"):
        BwdConfig(kv_group=2)
    axes = {name: [value] for name, value in tiles.to_dict().items()}
    assert expand_grid("bwd", axes, "space") == [tiles]
    assert expand_grid("bwd", {**axes, "kv_group": [0, 1]}, "space") == [tiles, grouped]
