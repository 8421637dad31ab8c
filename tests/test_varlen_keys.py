"""Packed-sequence and sliding-window table keys (issue 56): the two key fields, their buckets,
their tables, lookups that never cross them, stamps that cover their code, and the workloads
that describe them. CPU only; nothing here runs a kernel."""

import dataclasses

import pytest
import torch
import yaml

from dmattn_bench import tiles
from dmattn_bench.dispatch import stamps
from dmattn_bench.dispatch.lookup import similarity_distance, table_entry, by_category
from dmattn_bench.dispatch.table import Entry, TableError, load_table, table_from_dict
from dmattn_bench.hardware import CPU_FINGERPRINT
from dmattn_bench.space import BwdConfig, FwdConfig, Packing, TableKey, seqlen_bucket, window_bucket
from dmattn_bench.tuning.table_writer import table_to_dict
from dmattn_bench.tuning.workloads import Workload, load_workloads, workload_of_key
from tests.test_dispatch import fresh_dispatcher, write  # noqa: F401  (fresh_dispatcher: an autouse fixture)

DENSE = TableKey("fwd", "fp32", 32, True, "none", "none", 1, 64, 64)
PACKED = dataclasses.replace(DENSE, packed=True)
WINDOWED = dataclasses.replace(DENSE, window=16)
TUNED = FwdConfig(32, 16, 1, 1)  # not the interpreter's default (16x16): a table hit shows


# -- window_bucket ----------------------------------------------------------------------------------

@pytest.mark.parametrize("window, causal, expected", [
    ((-1, -1), False, 0), ((-1, -1), True, 0),
    ((1023, 0), True, 1024),          # 1024 keys up to the diagonal
    ((1023, 500), True, 1024),        # under causal the right side is 0
    ((512, 512), False, 1024),        # 1025 keys: bucket 1024
    ((0, 0), False, 1),               # the diagonal alone
    # one side unbounded, not causal: the kernels run the window's code, so the key has one
    ((5, -1), False, seqlen_bucket(6)), ((-1, 5), False, seqlen_bucket(6)),
    ((-1, 0), True, 0),
    ((5, -1), True, seqlen_bucket(6)),  # causal bounds the right side: the left one counts
    ((100, 27), False, 128),
])
def test_window_bucket(window, causal, expected):
    assert window_bucket(window, causal) == expected


# -- the key and its table -------------------------------------------------------------------------

def test_key_dict_leaves_default_fields_out():
    """A dense key writes the nine fields it always had, so tables and journals of dense keys read
    and write as before; packed and window are written where set."""
    assert set(DENSE.to_dict()) == {"direction", "dtype", "head_dim", "causal", "mask", "bias", "gqa_ratio",
                                    "seqlen_q_bucket", "seqlen_k_bucket"}
    both = dataclasses.replace(DENSE, packed=True, window=1024)
    assert both.to_dict() == dict(DENSE.to_dict(), packed=True, window=1024)
    assert TableKey(**both.to_dict()) == both and TableKey(**DENSE.to_dict()) == DENSE
    assert both.label() == " packed window 1024" and DENSE.label() == ""


def test_categorical_separates_packed_and_windowed_keys():
    keys = [DENSE, PACKED, WINDOWED, dataclasses.replace(WINDOWED, window=32),
            dataclasses.replace(PACKED, window=16)]
    assert len({k.categorical() for k in keys}) == len(keys)


def test_table_round_trip_with_and_without_the_new_fields(tmp_path):
    entries = [Entry(DENSE, "triton", TUNED, {}), Entry(PACKED, "triton", TUNED, {}),
               Entry(dataclasses.replace(WINDOWED, direction="bwd"), "triton", BwdConfig(16, 16, 16, 16, 1, 1), {})]
    path = write(tmp_path / "t.yaml", entries)
    document = yaml.safe_load(open(path))
    written = {tuple(sorted(item["key"])) for item in document["entries"]}
    assert ("bias", "causal", "direction", "dtype", "gqa_ratio", "head_dim", "mask", "seqlen_k_bucket",
            "seqlen_q_bucket") in written  # the dense key: no packed, no window
    loaded = load_table(path)
    assert {e.key for e in loaded.entries} == {e.key for e in entries}
    assert table_to_dict(table_from_dict(document, "t")) == document


def test_a_table_written_before_the_fields_reads_unchanged():
    """A schema-3 file of dense keys (no packed, no window) is what it was: every key dense."""
    document = {
        "schema_version": 3, "created": "2026-01-01T00:00:00+00:00",
        "device": CPU_FINGERPRINT.to_dict(), "software": {"torch": "2.13.0"}, "interpreter": True,
        "entries": [{"key": DENSE.to_dict(), "backend": "triton", "config": TUNED.to_dict(), "validated": None,
                     "stale": None, "timed": {"kernel_hash": "sha256:0", "date": "2026-01-01"}, "evidence": {}}],
    }
    table = table_from_dict(document, "old.yaml")
    assert table.schema_version == 3 and table.entries[0].key == DENSE
    assert not table.entries[0].key.packed and table.entries[0].key.window == 0


@pytest.mark.parametrize("change, where, message", [
    ({"window": 24}, "key.window", "power of two"),
    ({"window": -1}, "key.window", "int >= 0"),
    ({"packed": "yes"}, "key.packed", "true or false"),
    ({"packed": True, "direction": "decode"}, "key.packed", "decode"),
])
def test_bad_new_key_fields_are_named(change, where, message):
    document = {
        "schema_version": 3, "created": "2026-01-01T00:00:00+00:00",
        "device": CPU_FINGERPRINT.to_dict(), "software": {}, "interpreter": True,
        "entries": [{"key": dict(DENSE.to_dict(), **change), "backend": "triton",
                     "config": TUNED.to_dict() if change.get("direction") != "decode" else
                     {"block_n": 16, "num_warps": 1, "num_stages": 1, "num_splits": 0},
                     "validated": None, "stale": None, "timed": {"kernel_hash": "sha256:0", "date": "2026-01-01"},
                     "evidence": {}}],
    }
    with pytest.raises(TableError, match=rf"entries\[0\]\.{where}.*{message}"):
        table_from_dict(document, "t.yaml")


OVERLAPPED = FwdConfig(128, 128, 12, 2, overlap=1)  # the CUDA forward that runs a window
WS_BACKWARD = BwdConfig(64, 128, 64, 128, 12, 2)  # the CUDA backward that runs one (warp-specialized)


def _cuda_entry_document(key, config) -> dict:
    return {
        "schema_version": 3, "created": "2026-01-01T00:00:00+00:00",
        "device": CPU_FINGERPRINT.to_dict(), "software": {}, "interpreter": True,
        "entries": [{"key": key.to_dict(), "backend": "cuda", "config": config.to_dict(), "validated": None,
                     "stale": None, "timed": {"kernel_hash": "sha256:0", "date": "2026-01-01"}, "evidence": {}}],
    }


PACKED_BACKWARD = dataclasses.replace(PACKED, direction="bwd", head_dim=128)
PACKED_FORWARD = dataclasses.replace(PACKED, head_dim=128)  # a head dim the warp-specialized kernels take


@pytest.mark.parametrize("key, config, message", [
    (PACKED_FORWARD, TUNED, "a packed call runs in the CUDA forward's overlapped"),
    (dataclasses.replace(PACKED_FORWARD, mask="kv_head"), OVERLAPPED, "per-key mask and bias only"),
    (WINDOWED, TUNED, "overlapped warp-specialized kernel only"),
    (dataclasses.replace(WINDOWED, direction="bwd"), BwdConfig(64, 64, 64, 64, 4, 2),
     "CUDA backward's warp-specialized kernel only"),
    (PACKED_BACKWARD, BwdConfig(64, 64, 64, 64, 4, 2), "a packed call runs in the CUDA backward's warp-specialized"),
    (dataclasses.replace(PACKED_BACKWARD, mask="kv_head"), WS_BACKWARD, "per-key mask and bias only"),
    (dataclasses.replace(PACKED_BACKWARD, bias="full+grad"), WS_BACKWARD, "per-key mask and bias only"),
], ids=["packed-mma-sync", "packed-row-mask", "window-mma-sync", "window-bwd-not-warp-specialized",
        "packed-bwd-not-warp-specialized", "packed-bwd-row-mask", "packed-bwd-row-bias"])
def test_a_cuda_entry_of_a_key_its_config_cannot_run_is_refused(key, config, message):
    with pytest.raises(TableError, match=rf"entries\[0\]\.backend.*'cuda'.*{message}"):
        table_from_dict(_cuda_entry_document(key, config), "t.yaml")


@pytest.mark.parametrize("config", [OVERLAPPED, dataclasses.replace(OVERLAPPED, persistent=1)],
                         ids=["overlapped", "persistent"])
def test_a_cuda_forward_entry_of_a_windowed_key_with_the_overlapped_kernel_loads(config):
    table = table_from_dict(_cuda_entry_document(WINDOWED, config), "t.yaml")
    assert [(entry.backend, entry.config) for entry in table.entries] == [("cuda", config)]


@pytest.mark.parametrize("config", [OVERLAPPED, dataclasses.replace(OVERLAPPED, persistent=1)],
                         ids=["overlapped", "persistent"])
@pytest.mark.parametrize("key", [PACKED_FORWARD, dataclasses.replace(PACKED_FORWARD, mask="per_key", bias="per_key",
                                                                     window=16)], ids=["packed", "packed-window-per-key"])
def test_a_cuda_forward_entry_of_a_packed_key_with_the_overlapped_kernel_loads(key, config):
    table = table_from_dict(_cuda_entry_document(key, config), "t.yaml")
    assert [(entry.backend, entry.config) for entry in table.entries] == [("cuda", config)]


@pytest.mark.parametrize("key", [dataclasses.replace(WINDOWED, direction="bwd", head_dim=128), PACKED_BACKWARD,
                                 dataclasses.replace(PACKED_BACKWARD, mask="per_key", bias="per_key+grad", window=16)],
                         ids=["window", "packed", "packed-window-per-key"])
def test_a_cuda_backward_entry_of_a_packed_or_windowed_key_with_the_warp_specialized_kernel_loads(key):
    table = table_from_dict(_cuda_entry_document(key, WS_BACKWARD), "t.yaml")
    assert [(entry.backend, entry.config) for entry in table.entries] == [("cuda", WS_BACKWARD)]


# -- lookup -------------------------------------------------------------------------------------------

def test_similarity_is_none_across_packed_and_window():
    assert similarity_distance(DENSE, PACKED) is None and similarity_distance(PACKED, DENSE) is None
    assert similarity_distance(DENSE, WINDOWED) is None and similarity_distance(WINDOWED, DENSE) is None
    assert similarity_distance(PACKED, dataclasses.replace(PACKED, window=16)) is None
    # windows of other spans compare as lengths do: 0.25 per octave
    assert similarity_distance(WINDOWED, dataclasses.replace(WINDOWED, window=64)) == pytest.approx(0.5)


@pytest.mark.parametrize("wanted, held", [
    (PACKED, DENSE), (DENSE, PACKED), (WINDOWED, DENSE), (DENSE, WINDOWED),
    (PACKED, WINDOWED), (WINDOWED, PACKED), (dataclasses.replace(PACKED, window=16), PACKED),
])
def test_lookup_never_crosses_packed_or_window(wanted, held, tmp_path):
    """Neither the nearest-bucket rule nor the most-similar one gives a key an entry across the
    packed and window categories, at any length; the default runs instead."""
    entries = [Entry(dataclasses.replace(held, seqlen_q_bucket=n, seqlen_k_bucket=n), "triton", TUNED, {})
               for n in (32, 64, 128)]
    assert table_entry(wanted, by_category(entries)) is None
    path = write(tmp_path / "t.yaml", entries)
    choice = tiles.choose(wanted, "cpu", table=path)
    assert choice.source == "default" and choice.config != TUNED


def test_lookup_finds_a_packed_and_a_windowed_entry(tmp_path):
    """Within its category a packed or windowed key takes the nearest bucket; a window of a
    nearby span stands in for another (the most-similar rule)."""
    entries = [Entry(dataclasses.replace(PACKED, seqlen_q_bucket=128, seqlen_k_bucket=128), "triton", TUNED, {}),
               Entry(WINDOWED, "triton", FwdConfig(16, 32, 1, 1), {})]
    path = write(tmp_path / "t.yaml", entries)
    assert tiles.choose(PACKED, "cpu", table=path).config == TUNED
    assert tiles.choose(WINDOWED, "cpu", table=path).config == FwdConfig(16, 32, 1, 1)
    assert tiles.choose(dataclasses.replace(WINDOWED, window=32), "cpu", table=path).config == FwdConfig(16, 32, 1, 1)
    assert tiles.choose(DENSE, "cpu", table=path).source == "default"


def test_cuda_runs_packed_and_windowed_keys_in_the_warp_specialized_kernels_only():
    """The default is Triton's; forcing the CUDA backend on a packed or windowed key judges the
    config it would run: the forward of either takes the overlapped kernel (one item per CTA or
    persistent), the backward the warp-specialized one."""
    backward = dataclasses.replace(WINDOWED, direction="bwd")
    for key in (PACKED, WINDOWED):
        assert tiles.choose(key, "cpu").backend == "triton"
        assert tiles.key_problem("triton", key) is None and tiles.key_problem("triton", key, TUNED) is None
    assert tiles.key_problem("cuda", DENSE) is None and tiles.key_problem("cuda", DENSE, TUNED) is None
    assert "a packed call runs in the CUDA forward's overlapped" in tiles.key_problem(
        "cuda", PACKED, dataclasses.replace(OVERLAPPED, overlap=0))
    assert tiles.key_problem("cuda", PACKED, OVERLAPPED) is None  # D32 on the tiles of 64
    assert tiles.key_problem("cuda", PACKED_FORWARD, OVERLAPPED) is None
    assert tiles.key_problem("cuda", PACKED_FORWARD, dataclasses.replace(OVERLAPPED, persistent=1)) is None
    assert tiles.key_problem("cuda", backward) is None
    assert "CUDA backward's warp-specialized kernel only" in tiles.key_problem("cuda", backward, BwdConfig(
        64, 64, 64, 64, 4, 2))
    assert tiles.key_problem("cuda", dataclasses.replace(backward, head_dim=128), WS_BACKWARD) is None
    assert tiles.key_problem("cuda", WINDOWED) is None and tiles.key_problem("cuda", WINDOWED, OVERLAPPED) is None
    assert tiles.key_problem("cuda", WINDOWED, dataclasses.replace(OVERLAPPED, persistent=1)) is None
    assert "overlapped warp-specialized kernel only" in tiles.key_problem("cuda", WINDOWED, TUNED)
    for key, explicit in ((PACKED, None), (PACKED, TUNED)):
        with pytest.raises(ValueError, match="backend: got 'cuda', but a packed call runs in the CUDA forward's"):
            tiles.choose(key, "cpu", backend="cuda", explicit=explicit)
    assert tiles.choose(PACKED_FORWARD, "cpu", backend="cuda", explicit=OVERLAPPED).config == OVERLAPPED
    # forced on a windowed key, the config it would run is judged: the defaults are not the
    # warp-specialized kernels, explicit ones are taken
    with pytest.raises(ValueError, match="backend: got 'cuda', but a sliding window runs in the CUDA forward's"):
        tiles.choose(WINDOWED, "cpu", backend="cuda")
    assert tiles.choose(WINDOWED, "cpu", backend="cuda", explicit=OVERLAPPED).config == OVERLAPPED
    with pytest.raises(ValueError, match="backend: got 'cuda', but a sliding window runs in the CUDA backward's"):
        tiles.choose(backward, "cpu", backend="cuda")
    backward128 = dataclasses.replace(backward, head_dim=128)
    assert tiles.choose(backward128, "cpu", backend="cuda", explicit=WS_BACKWARD).config == WS_BACKWARD


# -- stamps -------------------------------------------------------------------------------------------

def test_dense_calls_keep_their_labels():
    """A dense key's representative calls are labelled as before the fields existed: their stamps
    do not move."""
    for call in stamps.representative_calls(dataclasses.replace(DENSE, bias="per_key")):
        assert "window" not in call.label() and "packed" not in call.label()
    assert stamps.Call(64, True, False).label() == "Lk64 softcap=1 bias_fp32=0 dlse=0 seqlens=0 page=0"


@pytest.mark.parametrize("direction", ["fwd", "bwd"])
def test_packed_and_windowed_entries_stamp_their_own_code(direction):
    """A packed key's calls plan the VARLEN kernels (with and without seqused_k), a windowed one's
    the HAS_WINDOW ones, so their stamps cover that code and differ from the dense key's."""
    dense = dataclasses.replace(DENSE, direction=direction, mask="kv_head", bias="per_key")
    config = TUNED if direction == "fwd" else BwdConfig(16, 16, 16, 16, 1, 1)
    flags = {}
    for name, key in (("packed", dataclasses.replace(dense, packed=True)),
                      ("window", dataclasses.replace(dense, window=16)), ("dense", dense)):
        calls = list(stamps.entry_programs("triton", key, config, "sm90", 132))
        assert all(programs for _, programs in calls), name  # every call planned, none refused
        flags[name] = {(dict(p.parameters)["VARLEN"], dict(p.parameters)["HAS_WINDOW"],
                        dict(p.parameters)["HAS_SEQUSED"])
                       for _, programs in calls for p in programs if "VARLEN" in dict(p.parameters)}
    assert (True, False, True) in flags["packed"] and (True, False, False) in flags["packed"]
    assert {window for _, window, _ in flags["window"]} == {True}
    assert {(varlen, window) for varlen, window, _ in flags["dense"]} == {(False, False)}
    stamped = {stamps.entry_stamp("triton", dataclasses.replace(dense, **change), config, "sm90", 132)
               for change in ({}, {"packed": True}, {"window": 16}, {"window": 32}, {"packed": True, "window": 16})}
    assert len(stamped) == 5  # each its own (windows of 16 and 32: the same code, other calls)


def test_representative_window_falls_in_the_key_bucket():
    for window in (1, 2, 16, 1024):
        for causal in (False, True):
            key = dataclasses.replace(DENSE, causal=causal, window=window)
            assert window_bucket(stamps.representative_window(key), causal) == window
    assert stamps.representative_window(DENSE) == (-1, -1)


# -- workloads ------------------------------------------------------------------------------------------

def test_varlen_workload_keys_match_the_runtime_keys():
    """The tuner's key of a packed or windowed workload is the key the runtime derives from the
    call's 4-D views, its packing and its window (`plan.table_keys`)."""
    from dmattn_bench import plan
    from dmattn_bench.tuning.adversarial import build_inputs
    from dmattn_bench.tuning.runs import launch_operands

    for workload in load_workloads("configs/workloads/varlen-cpu.yaml"):
        inputs = build_inputs(workload.case(), torch.float32, "cpu")
        operands = launch_operands(inputs, workload.case())
        packing = operands.options.get("packing")
        seqlen_k = packing.max_seqlen_k if packing is not None else operands.k.shape[1]
        keys = plan.table_keys(tuple(operands.q.shape), seqlen_k, operands.k.shape[2], torch.float32,
                               None if operands.mask is None else tuple(operands.mask.shape),
                               None if operands.bias is None else tuple(operands.bias.shape), workload.causal,
                               workload.bias_grad, workload.window, packing)
        assert keys == (workload.key("fwd"), workload.key("bwd")), workload.label
        assert workload.key("fwd").packed == workload.packed and workload.key("fwd").window == (
            window_bucket(workload.window, workload.causal))


def test_the_varlen_workload_files_describe_packed_and_windowed_keys():
    gpu = load_workloads("configs/workloads/varlen.yaml")
    packed = [w for w in gpu if w.packed]
    assert {w.documents for w in packed} == {(4096, 700, 2900, 1500, 3100, 1024, 1964, 1100)}
    assert sum(packed[0].documents) == 16384 and {w.head_dim for w in gpu} == {64, 128}
    assert {(w.mask, w.bias, w.bias_grad) for w in packed} == {("none", "none", False), ("kv_head", "per_key", True)}
    windowed = [w for w in gpu if not w.packed]
    assert {(w.batch, w.seqlen_q, w.window, w.causal) for w in windowed} == {(2, 8192, (1023, 0), True)}
    assert {w.bias for w in windowed} == {"none", "per_key"}
    assert all(w.dtype == "bf16" and w.heads == 16 and w.heads_kv == 4 for w in gpu)
    assert {w.key("fwd").window for w in windowed} == {1024} and all(w.key("bwd").packed for w in packed)
    cpu = load_workloads("configs/workloads/varlen-cpu.yaml")
    assert {w.dtype for w in cpu} == {"fp32"} and {w.head_dim for w in cpu} == {32}
    assert any(w.packed for w in cpu) and any(w.window != (-1, -1) for w in cpu)
    assert all(w.directions() == ("fwd", "bwd") for w in cpu)  # no decode keys


def test_visible_pairs_count_documents_and_windows():
    dense = Workload(1, 2, 2, 10, 10, 32, True, "none", "none", False, "fp32")
    assert dense.visible_pairs() == 55
    assert dataclasses.replace(dense, window=(2, 0)).visible_pairs() == 1 + 2 + 3 * 8
    packed = dataclasses.replace(dense, documents=(4, 6), seqlen_q=6, seqlen_k=6)
    assert packed.visible_pairs() == 10 + 21


@pytest.mark.parametrize("grid, message", [
    ({"documents": [4, 5]}, r"documents: got 4, expected a list of document lengths"),
    ({"documents": [[4, 0]]}, r"documents: got 0, expected a positive integer"),
    ({"documents": [[4, 5]], "seqlen": [8]}, r"unknown keys \['seqlen'\].*packed grid"),
    ({"window": [5]}, r"window: got 5, expected \[left, right\]"),
    ({"window": [[5, -2]]}, r"window: got \[5, -2\]"),
])
def test_bad_varlen_grids_are_named(tmp_path, grid, message):
    base = {"heads": 2, "head_dim": [32], "causal": [True], "gqa_ratio": [1],
            "variants": [{"mask": "none", "bias": "none"}], "dtype": ["fp32"]}
    if "documents" not in grid:
        base.update(tokens=16, seqlen=[16])
    path = tmp_path / "w.yaml"
    path.write_text(yaml.safe_dump({"default": dict(base, **grid)}))
    with pytest.raises(ValueError, match=message):
        load_workloads(path)


@pytest.mark.parametrize("key", [
    dataclasses.replace(PACKED, mask="kv_head", bias="per_key", gqa_ratio=2),
    dataclasses.replace(PACKED, direction="bwd", bias="per_key+grad", window=16),
    dataclasses.replace(WINDOWED, bias="per_key"),
    dataclasses.replace(WINDOWED, causal=False, direction="bwd"),
])
def test_a_stale_packed_or_windowed_key_has_a_workload(key):
    for small in (True, False):
        workload = workload_of_key(key, small=small)
        assert workload is not None and workload.key(key.direction) == key


def test_a_packed_key_of_unequal_buckets_has_no_workload():
    assert workload_of_key(dataclasses.replace(PACKED, seqlen_k_bucket=128)) is None


def test_packing_is_reexported():
    assert Packing(2, 8, 8).seqused_k is False
