"""Dispatch tables: schema round-trip, refusal of malformed files, run-time lookup and fallbacks."""

import dataclasses
import json
import warnings

import pytest
import yaml
from click.testing import CliRunner

from dmattn_bench.cli.show import show
from dmattn_bench.dispatch import lookup
from dmattn_bench.dispatch.lookup import DispatchWarning, clear_cache, use_table
from dmattn_bench.dispatch.stamps import entry_status, stamp_of
from dmattn_bench.dispatch.table import (LEGACY_PREFIX, MAX_TABLE_BYTES, SCHEMA_VERSION, Entry, TableError, Timing,
                                         Validation, load_table, table_from_dict)
from dmattn_bench.hardware import CPU_FINGERPRINT, DeviceFingerprint, device_fingerprint
from dmattn_bench.registry import kernel_source_hash
from dmattn_bench.space import BwdConfig, FwdConfig, TableKey
from dmattn_bench.tiles import choose
from dmattn_bench.tiles import default_configs
from dmattn_bench.tuning.table_writer import dump_table, new_table, table_to_dict

H200 = DeviceFingerprint("NVIDIA H200", "9.0", 132, 232448)
TUNED_FWD = FwdConfig(32, 32, 2, 1)  # differs from the CPU default, so a table hit is visible


def key(direction="fwd", q=1024, k=1024, head_dim=64, dtype="fp32", bias="none") -> TableKey:
    return TableKey(direction, dtype, head_dim, False, "none", bias, 1, q, k)


def entry(k: TableKey, config=None, backend="triton", **evidence) -> Entry:
    config = config or (TUNED_FWD if k.direction == "fwd" else BwdConfig(16, 32, 32, 16, 2, 1))
    return Entry(k, backend, config, dict(evidence))


def write(path, entries, device=CPU_FINGERPRINT):
    dump_table(new_table(entries, device, interpreter=True), path)
    return str(path)


@pytest.fixture(autouse=True)
def fresh_dispatcher(monkeypatch, tmp_path):
    """No shipped table, no env var, no explicit table, empty caches around every test."""
    monkeypatch.setattr(lookup, "SHIPPED_TABLES_DIR", tmp_path / "shipped")
    monkeypatch.delenv(lookup.ENV_VAR, raising=False)
    use_table(None)
    clear_cache()
    yield
    use_table(None)
    clear_cache()


def default_fwd():
    return default_configs(64, "cpu")[0]


# -- schema ---------------------------------------------------------------------------------------

def test_round_trip(tmp_path):
    entries = [entry(key(q=4096, k=8192), median_ms=1.25, tflops=312.5, speedup_vs_default=1.4,
                     error_ratio={"out": 0.1, "dq": 0.2}),
               entry(key("bwd", bias="full+grad")), entry(key(head_dim=128), backend="reference")]
    table = new_table(entries, H200, interpreter=False)
    # each entry is validated, on its own code, by the tuner's default suite, and measured on that code
    for e in table.entries:
        assert e.validated == Validation(stamp_of(e, H200), table.created, "quick") and e.stale is None
        assert e.timed == Timing(e.validated.stamp, table.created)
    assert len({e.validated.stamp for e in table.entries}) == len(entries)  # three entries of other code each
    # a declared-stale entry and a never validated one keep what they say
    fwd, bwd, other = table.entries  # in the order given
    table = dataclasses.replace(table, entries=(fwd, dataclasses.replace(bwd, stale="kernel edit, its GPU away"),
                                                dataclasses.replace(other, validated=None)))
    path = tmp_path / "t.yaml"
    dump_table(table, path)
    loaded = load_table(path)
    assert loaded.schema_version == SCHEMA_VERSION == 3
    assert table_to_dict(loaded) == table_to_dict(table)
    assert {e.key: e for e in loaded.entries} == {e.key: e for e in table.entries}
    assert {e.key: (e.stale, e.validated is None) for e in loaded.entries} == {
        fwd.key: (None, False), bwd.key: ("kernel edit, its GPU away", False), other.key: (None, True)}
    text = path.read_text()
    assert text.startswith("# dmattn-bench dispatch table")
    dump_table(loaded, path)  # sorted, stable output: a second dump is byte-identical
    assert path.read_text() == text
    assert [p.name for p in tmp_path.iterdir()] == ["t.yaml"]  # no temp file left behind


def good_doc():
    return table_to_dict(new_table([entry(key())], CPU_FINGERPRINT, interpreter=True))


def as_schema_2(doc: dict, kernel_hashes: dict | None = None) -> dict:
    """`doc` (schema 3) rewritten in place as schema 2 wrote it: one validation per backend and
    dtype on the backend's kernel sources (`kernel_hashes`, default those installed here)."""
    hashes = kernel_hashes or {}
    validated = {}
    for item in doc["entries"]:
        record = item.pop("validated")
        del item["stale"]
        backend = item["backend"]
        validated.setdefault(backend, {})[item["key"]["dtype"]] = {
            "kernel_hash": hashes.get(backend) or kernel_source_hash(backend), "date": record["date"],
            "suite": record["suite"]}
    doc.update(schema_version=2, validated=validated)
    return doc


@pytest.mark.parametrize("edit, field, problem", [
    (lambda d: d["entries"][0]["config"].__setitem__("block_m", "x"), "entries[0].config.block_m",
     "expected a positive int, got 'x'"),
    (lambda d: d["entries"][0]["key"].__setitem__("head_dim", -1), "entries[0].key.head_dim", "got -1"),
    (lambda d: d["entries"][0]["key"].__setitem__("causal", "yes"), "entries[0].key.causal", "true or false"),
    (lambda d: d["entries"][0]["key"].__setitem__("direction", "sideways"), "entries[0].key.direction", "sideways"),
    (lambda d: d["entries"][0]["key"].__setitem__("bias", "full+grad"), "entries[0].key.bias", "bwd"),
    (lambda d: d["entries"][0]["key"].__setitem__("mask", "diagonal"), "entries[0].key.mask", "diagonal"),
    (lambda d: d["entries"][0]["key"].__setitem__("seqlen_q_bucket", 1000), "entries[0].key.seqlen_q_bucket",
     "power of two"),
    (lambda d: d["entries"][0].__setitem__("backend", "cutlass"), "entries[0].backend", "cutlass"),
    (lambda d: d["entries"][0]["config"].pop("num_stages"), "entries[0].config", "missing"),
    (lambda d: d["entries"][0]["config"].__setitem__("block_k", 16), "entries[0].config", "unknown"),
    (lambda d: d["entries"].append(d["entries"][0]), "entries[1].key", "duplicate"),
    (lambda d: d["device"].__setitem__("sm_count", 1.5), "device.sm_count", "1.5"),
    (lambda d: d.__setitem__("interpreter", "no"), "interpreter", "true or false"),
    (lambda d: d.__setitem__("extra", 1), "(top level)", "unknown"),
    (lambda d: d.__setitem__("schema_version", 4), "schema_version", "unknown schema version 4"),
    (lambda d: d["entries"][0].pop("timed"), "entries[0]", "missing key(s) ['timed']"),
    (lambda d: d["entries"][0]["timed"].__setitem__("kernel_hash", ""), "entries[0].timed.kernel_hash", "non-empty"),
    (lambda d: d["entries"][0]["validated"].__setitem__("suite", "medium"), "entries[0].validated.suite", "medium"),
    (lambda d: d["entries"][0]["validated"].__setitem__("stamp", ""), "entries[0].validated.stamp", "non-empty"),
    (lambda d: d["entries"][0]["validated"].pop("date"), "entries[0].validated", "missing key(s) ['date']"),
    (lambda d: d["entries"][0]["validated"].__setitem__("kernel_hash", "x"), "entries[0].validated", "unknown"),
    (lambda d: d["entries"][0].__setitem__("validated", "yes"), "entries[0].validated", "expected a mapping"),
    (lambda d: d["entries"][0].__setitem__("stale", ""), "entries[0].stale", "non-empty"),
    (lambda d: d["entries"][0].__setitem__("stale", True), "entries[0].stale", "got True"),
    (lambda d: d["entries"][0].pop("stale"), "entries[0]", "missing key(s) ['stale']"),
    # schema 2's and 1's top-level records are not schema 3's
    (lambda d: d.__setitem__("validated", {}), "(top level)", "unknown"),
    (lambda d: d.__setitem__("kernel_hashes", {}), "(top level)", "unknown"),
    # a schema-2 document: its per-backend validations are checked as they were
    (lambda d: as_schema_2(d)["validated"]["triton"]["fp32"].__setitem__("suite", "medium"),
     "validated.triton.fp32.suite", "medium"),
    (lambda d: as_schema_2(d)["validated"]["triton"].__setitem__("fp8", {}), "validated.triton", "fp8"),
    (lambda d: as_schema_2(d)["validated"].__setitem__("cutlass", {}), "validated", "cutlass"),
    (lambda d: as_schema_2(d)["entries"][0].__setitem__("stale", None), "entries[0]", "unknown"),
])
def test_bad_field_is_named(tmp_path, edit, field, problem):
    doc = good_doc()
    edit(doc)
    path = tmp_path / "T.yaml"
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(TableError) as info:
        load_table(path)
    message = str(info.value)
    assert message.startswith(f"{path}: {field}: ") and problem in message
    assert "\n" not in message
    with pytest.raises(TableError, match=field.replace("[", r"\[").replace("]", r"\]")):
        table_from_dict(doc, "T.yaml")


@pytest.mark.parametrize("cut", [0.3, 0.5, 0.9])
def test_truncated_file(tmp_path, cut):
    path = write(tmp_path / "T.yaml", [entry(key(q=2 ** i)) for i in range(6, 12)])
    data = open(path, "rb").read()
    open(path, "wb").write(data[: int(len(data) * cut)])
    with pytest.raises(TableError) as info:
        load_table(path)
    assert str(info.value).startswith(f"{path}: ") and "\n" not in str(info.value)


@pytest.mark.parametrize("text", ["", "[1, 2", "just a string", "\x00\x01garbage: [", "- 1\n- 2\n"])
def test_garbage(tmp_path, text):
    path = tmp_path / "T.yaml"
    path.write_text(text)
    with pytest.raises(TableError, match=f"^{path}: "):
        load_table(path)


def test_python_tag_is_not_executed(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "T.yaml"
    path.write_text(f"schema_version: !!python/object/apply:os.system ['touch {marker}']\n")
    with pytest.raises(TableError, match="python/object/apply"):
        load_table(path)
    assert not marker.exists()


def test_oversized_file_is_refused_before_parsing(tmp_path, monkeypatch):
    path = tmp_path / "T.yaml"
    with open(path, "wb") as handle:
        handle.truncate(17 * 1024 * 1024)
    assert path.stat().st_size > MAX_TABLE_BYTES

    def no_parse(*args, **kwargs):
        raise AssertionError("parsed an oversized table")

    monkeypatch.setattr(yaml, "safe_load", no_parse)
    with pytest.raises(TableError, match="limit"):
        load_table(path)


def test_missing_file(tmp_path):
    with pytest.raises(TableError, match="cannot read"):
        load_table(tmp_path / "nope.yaml")


# -- lookup ---------------------------------------------------------------------------------------

def test_exact_key(tmp_path):
    path = write(tmp_path / "t.yaml", [entry(key()), entry(key("bwd"), BwdConfig(16, 16, 16, 16, 2, 2))])
    choice = choose(key(), "cpu", table=path)
    assert (choice.backend, choice.config, choice.source) == ("triton", TUNED_FWD, f"table:{path}")
    assert choose(key("bwd"), "cpu", table=path).config == BwdConfig(16, 16, 16, 16, 2, 2)


@pytest.mark.parametrize("q, expected", [(2048, 1024), (4096, 8192), (1024, 1024), (64, 1024), (65536, 8192)])
def test_nearest_bucket(tmp_path, q, expected):
    configs = {1024: FwdConfig(16, 16, 1, 1), 8192: FwdConfig(32, 32, 1, 1)}
    path = write(tmp_path / "t.yaml", [entry(key(q=b, k=b), c) for b, c in configs.items()])
    assert choose(key(q=q, k=q), "cpu", table=path).config == configs[expected]


def test_tie_goes_to_larger_bucket(tmp_path):
    configs = {1024: FwdConfig(16, 16, 1, 1), 4096: FwdConfig(32, 32, 1, 1)}
    path = write(tmp_path / "t.yaml", [entry(key(q=b, k=2048), c) for b, c in configs.items()])
    assert choose(key(q=2048, k=2048), "cpu", table=path).config == configs[4096]


def test_a_key_without_entries_of_its_categories_takes_the_most_similar_within_reach(tmp_path):
    """An entry one step away in the causal flag or the GQA ratio stands in for a key of no
    entry's categories; a mask kind, a head dim or more steps away do not (the default)."""
    from dataclasses import replace

    causal, gqa2_longer = FwdConfig(16, 16, 1, 1), FwdConfig(32, 32, 1, 1)
    base = key(q=1024, k=1024)
    path = write(tmp_path / "t.yaml", [
        entry(replace(base, causal=True), causal),
        entry(replace(base, gqa_ratio=2, seqlen_q_bucket=2048, seqlen_k_bucket=2048), gqa2_longer)])
    assert choose(base, "cpu", table=path).config == causal  # 0.5 (causal) before 1.0 (GQA and lengths)
    assert choose(replace(base, gqa_ratio=2, causal=True), "cpu", table=path).config == causal  # GQA: 0.5
    assert choose(replace(base, causal=True, seqlen_q_bucket=2048, seqlen_k_bucket=2048),
                  "cpu", table=path).config == causal  # its own categories, at other lengths
    for far in (replace(base, gqa_ratio=4), replace(base, mask="full"), replace(base, head_dim=128)):
        assert choose(far, "cpu", table=path).source == "default"


def test_a_similar_entry_of_another_head_dim_or_gqa_mode_does_not_stand_in(tmp_path):
    """A head dim 12% away is within distance 0.34 but its config may not fit (D72 tiles take a
    128-lane head block, D64's 64); MHA and GQA run other backward kernels."""
    from dataclasses import replace

    base = key(q=1024, k=1024)
    path = write(tmp_path / "t.yaml", [entry(replace(base, causal=True)),
                                       entry(replace(base, head_dim=72, causal=True, gqa_ratio=2))])
    for other in (replace(base, head_dim=72), replace(base, gqa_ratio=2, causal=True, head_dim=64),
                  replace(base, causal=True, head_dim=72, gqa_ratio=1)):
        assert choose(other, "cpu", table=path).source == "default"


def test_categorical_miss_is_default_without_warning(tmp_path):
    path = write(tmp_path / "t.yaml", [entry(key())])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        choice = choose(key(head_dim=32), "cpu", table=path)
    assert (choice.backend, choice.config, choice.source) == ("triton", default_fwd(), "default")


def assert_default_with_one_warning(path, match):
    with pytest.warns(DispatchWarning) as record:
        first = choose(key(), "cpu", table=path)
        clear_cache()  # the second call reloads the table: the warning must still not repeat
        second = choose(key(q=2048), "cpu", table=path)
    assert first.source == second.source == "default" and first.config == default_fwd()
    assert len(record) == 1 and match in str(record[0].message)


def test_foreign_table(tmp_path):
    assert_default_with_one_warning(write(tmp_path / "t.yaml", [entry(key())], device=H200), "H200")


OLD_HASH = "sha256:" + "0" * 32


def _not_current(doc: dict, index: int, how: str) -> dict:
    """`doc` with its entry `index` not current, `how`: validated on other code, declared stale,
    or never validated."""
    item = doc["entries"][index]
    if how == "other code":
        item["validated"]["stamp"] = OLD_HASH
    elif how == "declared":
        item["stale"] = "kernel edit X, its GPU away"
    else:
        item["validated"] = None
    return doc


@pytest.mark.parametrize("how, says", [("other code", "validated on other code than is installed here"),
                                       ("declared", "declared stale (kernel edit X, its GPU away)"),
                                       ("never", "never validated")])
def test_an_entry_that_is_not_current_is_skipped_with_one_warning(tmp_path, how, says):
    doc = _not_current(table_to_dict(new_table([entry(key())], CPU_FINGERPRINT, interpreter=True)), 0, how)
    path = _copy(tmp_path / "t.yaml", doc)
    assert entry_status(load_table(path).entries[0], CPU_FINGERPRINT) == ("unvalidated" if how == "never" else "stale")
    assert_default_with_one_warning(path, says)


@pytest.mark.parametrize("how", ["other code", "declared", "never"])
def test_a_skipped_entry_gives_way_to_the_nearest_current_one(tmp_path, how):
    """The lookup asks its entries nearest first and takes the first current one: a stale entry
    at the key's own buckets gives way to one a bucket further, then to the default."""
    near, far = FwdConfig(16, 16, 1, 1), FwdConfig(64, 64, 1, 1)
    doc = table_to_dict(new_table([entry(key(q=1024, k=1024), near), entry(key(q=4096, k=4096), far)],
                                  CPU_FINGERPRINT, interpreter=True))
    index = next(i for i, item in enumerate(doc["entries"]) if item["key"]["seqlen_q_bucket"] == 1024)
    path = _copy(tmp_path / "t.yaml", _not_current(doc, index, how))
    with pytest.warns(DispatchWarning) as record:
        assert choose(key(q=1024, k=1024), "cpu", table=path) == lookup.Choice("triton", far, f"table:{path}")
        assert choose(key(q=512, k=512), "cpu", table=path).config == far
    assert len(record) == 1 and "D64 (triton) skipped" in str(record[0].message)
    _copy(tmp_path / "t.yaml", _not_current(doc, 1 - index, how))  # both entries now
    clear_cache()
    with warnings.catch_warnings():
        warnings.simplefilter("error", DispatchWarning)  # this table's warning was given
        assert choose(key(q=1024, k=1024), "cpu", table=path).source == "default"


def test_a_stale_entry_spares_its_neighbours(tmp_path):
    """A stale entry is skipped alone: entries of other backends, dtypes and head dims of the
    same table still serve their keys."""
    fp16, reference = FwdConfig(64, 32, 2, 1), FwdConfig(16, 32, 1, 1)
    doc = table_to_dict(new_table([entry(key()), entry(key(dtype="fp16"), fp16),
                                   entry(key(head_dim=32), reference, backend="reference")],
                                  CPU_FINGERPRINT, interpreter=True))
    index = next(i for i, item in enumerate(doc["entries"])
                 if item["key"]["dtype"] == "fp32" and item["backend"] == "triton")
    path = _copy(tmp_path / "t.yaml", _not_current(doc, index, "other code"))
    assert lookup.status_counts(load_table(path)) == {"current": 2, "stale": 1, "unvalidated": 0, "invalid": 0}
    with pytest.warns(DispatchWarning, match="fwd fp32 D64 \\(triton\\) skipped"):
        assert choose(key(), "cpu", table=path).source == "default"
    with warnings.catch_warnings():
        warnings.simplefilter("error", DispatchWarning)
        assert choose(key(dtype="fp16"), "cpu", table=path) == lookup.Choice("triton", fp16, f"table:{path}")
        assert choose(key(head_dim=32), "cpu", table=path) == lookup.Choice("reference", reference, f"table:{path}")


def test_status_counts_count_each_entry_by_its_own_status(tmp_path):
    entries = [entry(key(q=2 ** i)) for i in range(6, 12)]
    doc = table_to_dict(new_table(entries, CPU_FINGERPRINT, interpreter=True))
    _not_current(doc, 0, "other code")
    _not_current(doc, 1, "declared")
    _not_current(doc, 2, "never")
    _not_current(_not_current(doc, 3, "declared"), 3, "other code")
    table = table_from_dict(doc, "t.yaml")
    assert lookup.status_counts(table) == {"current": 2, "stale": 3, "unvalidated": 1, "invalid": 0}
    assert [entry_status(e, table.device) for e in table.entries] == [
        "stale", "stale", "unvalidated", "stale", "current", "current"]


def test_timings_keep_their_own_hash(tmp_path):
    """Entries measured on older kernels serve calls once they were validated on these."""
    doc = table_to_dict(new_table([entry(key())], CPU_FINGERPRINT, interpreter=True))
    doc["entries"][0]["timed"] = {"kernel_hash": OLD_HASH, "date": "2020-01-01T00:00:00+00:00"}
    path = _copy(tmp_path / "t.yaml", doc)
    assert choose(key(), "cpu", table=path).config == TUNED_FWD
    assert load_table(path).entries[0].timed.kernel_hash == OLD_HASH


def test_schema_2_is_read_as_each_entry_validated_on_its_backends_sources(tmp_path):
    """Schema 2 recorded one validation per backend and dtype on the backend's whole sources:
    each entry reads it as its own, stamped `source:<hash>`, current while that hash is the
    installed sources'. A dtype it recorded nothing for is unvalidated. Written back as schema 3,
    the entries keep those validations (until a restamp replaces them)."""
    entries = [entry(key()), entry(key(dtype="fp16")), entry(key(dtype="bf16")),
               entry(key(head_dim=32), backend="reference")]
    doc = as_schema_2(table_to_dict(new_table(entries, CPU_FINGERPRINT, interpreter=True)), {"reference": OLD_HASH})
    doc["validated"]["triton"]["fp16"]["kernel_hash"] = OLD_HASH
    del doc["validated"]["triton"]["bf16"]
    table = table_from_dict(doc, "v2.yaml")
    assert table.schema_version == 2
    by_key = {(e.backend, e.key.dtype): e for e in table.entries}
    fp32 = doc["validated"]["triton"]["fp32"]
    assert by_key["triton", "fp32"].validated == Validation(LEGACY_PREFIX + kernel_source_hash("triton"),
                                                             fp32["date"], fp32["suite"])
    assert by_key["triton", "fp16"].validated.stamp == LEGACY_PREFIX + OLD_HASH
    assert by_key["triton", "bf16"].validated is None
    assert all(e.stale is None for e in table.entries)
    status = {name: entry_status(e, CPU_FINGERPRINT) for name, e in by_key.items()}
    assert status == {("triton", "fp32"): "current", ("triton", "fp16"): "stale", ("triton", "bf16"): "unvalidated",
                      ("reference", "fp32"): "stale"}
    path = _copy(tmp_path / "v2.yaml", doc)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DispatchWarning)
        assert choose(key(), "cpu", table=path) == lookup.Choice("triton", TUNED_FWD, f"table:{path}")
    with pytest.warns(DispatchWarning, match="fp16 D64"):
        assert choose(key(dtype="fp16"), "cpu", table=path).source == "default"
    dump_table(table, tmp_path / "v3.yaml")
    assert yaml.safe_load((tmp_path / "v3.yaml").read_text())["schema_version"] == 3
    rewritten = load_table(tmp_path / "v3.yaml")
    assert table_to_dict(rewritten) == table_to_dict(table)
    assert [entry_status(e, CPU_FINGERPRINT) for e in rewritten.entries] == [
        entry_status(e, CPU_FINGERPRINT) for e in table.entries]


def test_schema_1_is_read_as_one_hash_for_everything(tmp_path):
    """Schema 1 had one `kernel_hashes` map: every validation and timing is read as that hash,
    dated `created`, validated on the tuner's (quick) suite; it is written back as schema 3."""
    entries = [entry(key()), entry(key(dtype="fp16")), entry(key(head_dim=32), backend="reference")]
    doc = table_to_dict(new_table(entries, CPU_FINGERPRINT, interpreter=True))
    for item in doc["entries"]:
        del item["timed"], item["validated"], item["stale"]
    doc.update(schema_version=1, kernel_hashes={"triton": OLD_HASH, "reference": kernel_source_hash("reference")})
    table = table_from_dict(doc, "v1.yaml")
    for e in table.entries:
        recorded = OLD_HASH if e.backend == "triton" else kernel_source_hash("reference")
        assert e.validated == Validation(LEGACY_PREFIX + recorded, doc["created"], "quick")
        assert e.timed == Timing(recorded, doc["created"]) and e.stale is None
    assert {(e.backend, e.key.dtype): entry_status(e, CPU_FINGERPRINT) for e in table.entries} == {
        ("triton", "fp32"): "stale", ("triton", "fp16"): "stale", ("reference", "fp32"): "current"}
    doc["kernel_hashes"]["triton"] = kernel_source_hash("triton")
    assert lookup.status_counts(table_from_dict(doc, "v1.yaml")) == {"current": 3, "stale": 0, "unvalidated": 0, "invalid": 0}
    del doc["kernel_hashes"]["reference"]  # a backend it recorded no hash for: never validated
    assert lookup.status_counts(table_from_dict(doc, "v1.yaml")) == {"current": 2, "stale": 0, "unvalidated": 1, "invalid": 0}
    dump_table(table, tmp_path / "v3.yaml")
    assert yaml.safe_load((tmp_path / "v3.yaml").read_text())["schema_version"] == 3
    assert table_to_dict(load_table(tmp_path / "v3.yaml")) == table_to_dict(table)


def test_shipped_tables_load():
    from pathlib import Path

    shipped = sorted((Path(__file__).resolve().parents[1] / "results" / "tables").glob("*.yaml"))
    assert shipped
    for path in shipped:
        assert load_table(path).entries


@pytest.mark.parametrize("content", ["schema_version: 1\nentries: [", None])
def test_invalid_or_missing_file(tmp_path, content):
    path = tmp_path / "t.yaml"
    if content is not None:
        path.write_text(content)
    assert_default_with_one_warning(str(path), str(path))


def test_env_var_and_precedence(tmp_path, monkeypatch):
    env_config, explicit_config, arg_config = FwdConfig(16, 16, 1, 1), FwdConfig(32, 32, 1, 1), FwdConfig(64, 64, 1, 1)
    env = write(tmp_path / "env.yaml", [entry(key(), env_config)])
    explicit = write(tmp_path / "explicit.yaml", [entry(key(), explicit_config)])
    argument = write(tmp_path / "arg.yaml", [entry(key(), arg_config)])
    assert choose(key(), "cpu").source == "default"
    monkeypatch.setenv(lookup.ENV_VAR, env)
    assert choose(key(), "cpu").config == env_config
    use_table(explicit)
    assert choose(key(), "cpu").config == explicit_config
    assert choose(key(), "cpu", table=argument).config == arg_config
    use_table(None)
    assert choose(key(), "cpu").source == f"table:{env}"


def test_unusable_explicit_falls_back_to_env(tmp_path, monkeypatch):
    env = write(tmp_path / "env.yaml", [entry(key())])
    monkeypatch.setenv(lookup.ENV_VAR, env)
    use_table(write(tmp_path / "foreign.yaml", [entry(key())], device=H200))
    with pytest.warns(DispatchWarning, match="foreign.yaml"):
        assert choose(key(), "cpu").source == f"table:{env}"


def test_shipped_table(tmp_path):
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    path = write(shipped / f"{device_fingerprint('cpu').slug()}.yaml", [entry(key())])
    assert choose(key(), "cpu").source == f"table:{path}"


def test_rewritten_table_is_reread_after_clear_cache(tmp_path):
    path = write(tmp_path / "t.yaml", [entry(key())])
    assert choose(key(), "cpu", table=path).config == TUNED_FWD
    write(tmp_path / "t.yaml", [entry(key(), FwdConfig(64, 64, 1, 1))])
    assert choose(key(), "cpu", table=path).config == TUNED_FWD  # memoised until cleared
    clear_cache()
    assert choose(key(), "cpu", table=path).config == FwdConfig(64, 64, 1, 1)


# -- show -----------------------------------------------------------------------------------------

def test_show_human_and_json(tmp_path):
    doc = table_to_dict(new_table([entry(key(), median_ms=0.5, tflops=123.4, speedup_vs_default=1.25),
                                   entry(key(q=4096)), entry(key(q=8192))], CPU_FINGERPRINT, interpreter=True))
    path = _copy(tmp_path / "t.yaml", _not_current(_not_current(doc, 1, "declared"), 2, "never"))
    human = CliRunner().invoke(show, [path])
    assert human.exit_code == 0, human.output
    assert "cpu-interpreter" in human.output and "1.25x" in human.output
    assert "3: 1 current, 1 stale, 1 unvalidated" in human.output
    result = CliRunner().invoke(show, [path, "--format", "json"])
    shown = json.loads(result.output)
    assert shown["status_counts"] == {"current": 1, "stale": 1, "unvalidated": 1, "invalid": 0}
    assert [e["status"] for e in shown["entries"]] == ["current", "stale", "unvalidated"]
    assert [e["stale"] for e in shown["entries"]] == [None, "kernel edit X, its GPU away", None]
    assert shown["entries"][0]["evidence"]["tflops"] == 123.4


def test_show_coverage_says_how_each_workload_key_is_served(tmp_path):
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    # the shipped table's entries, as if tuned on these kernel sources: the shipped file itself
    # goes stale with every kernel change until it is re-tuned on its GPU
    shipped = _validated_on(yaml.safe_load((repo / "results/tables/nvidia-h100-80gb-hbm3-sm90.yaml").read_text()), None)
    workloads = str(repo / "configs/workloads/default.yaml")
    result = CliRunner().invoke(show, [_copy(tmp_path / "all.yaml", shipped), "--coverage", workloads, "--format", "json"])
    assert result.exit_code == 0, result.output
    counts = json.loads(result.output)["coverage"]["counts"]
    assert counts == {"exact": 16, "nearest bucket": 0, "similar entry": 0, "default": 0, "default (stale entries)": 0}
    # drop the L4096 entries of one categorical key: its L1000 entry now serves them by nearest bucket;
    # drop every entry of another: those keys fall back to the defaults
    from dmattn_bench.tuning.workloads import load_workloads

    grid = {tuple(sorted(w.key(d).to_dict().items())) for w in load_workloads(workloads) for d in ("fwd", "bwd")}
    in_grid = [e for e in shipped["entries"] if tuple(sorted(e["key"].items())) in grid]
    first, second = in_grid[0]["key"], in_grid[2]["key"]  # two kinds (sorted by key)
    def same_kind(a, b):
        return all(a[f] == b[f] for f in a if not f.startswith("seqlen"))
    kept = [e for e in shipped["entries"]
            if not (same_kind(e["key"], first) and e["key"]["seqlen_q_bucket"] == 4096)
            and not same_kind(e["key"], second)]
    assert len(kept) < len(shipped["entries"])
    result = CliRunner().invoke(show, [_copy(tmp_path / "some.yaml", dict(shipped, entries=kept)),
                                       "--coverage", workloads, "--format", "json"])
    counts = json.loads(result.output)["coverage"]["counts"]
    assert counts["exact"] == sum(tuple(sorted(e["key"].items())) in grid for e in kept)
    assert counts["nearest bucket"] >= 1 and counts["default"] >= 1
    assert sum(counts.values()) == 16
    # the entries of one kind stale, the rest current: only that kind's keys lose their entries
    stale_kind = dict(shipped, entries=[dict(e, validated=dict(e["validated"], stamp=OLD_HASH))
                                        if same_kind(e["key"], second) else e for e in shipped["entries"]])
    result = CliRunner().invoke(show, [_copy(tmp_path / "kind.yaml", stale_kind), "--coverage", workloads,
                                       "--format", "json"])
    shown = json.loads(result.output)
    of_kind = sum(same_kind(dict(k), second) for k in grid)
    assert shown["status_counts"]["stale"] == sum(same_kind(e["key"], second) for e in shipped["entries"]) > 0
    counts = shown["coverage"]["counts"]
    assert counts["exact"] == 16 - of_kind and counts["default (stale entries)"] >= 1
    assert counts["default (stale entries)"] + counts["similar entry"] == of_kind
    full = CliRunner().invoke(show, [_copy(tmp_path / "all2.yaml", shipped), "--coverage", workloads, "--grid", "full",
                                     "--format", "json"])
    counts = json.loads(full.output)["coverage"]["counts"]
    # the full grid has bf16 and fp16: a shipped entry serves each workload of its key exactly
    # (two workloads may share a key); its non-causal GQA keys of the shipped kinds take the causal entries
    full_grid = [tuple(sorted(w.key(d).to_dict().items())) for w in load_workloads(workloads, "full")
                 for d in w.directions()]
    entry_keys = {tuple(sorted(e["key"].items())) for e in shipped["entries"]}
    assert counts["exact"] == sum(key in entry_keys for key in full_grid) > 16
    assert counts["nearest bucket"] > 0 and counts["default"] > counts["exact"]
    assert counts["similar entry"] > 0
    # a table whose every entry's code changed serves nothing: the lookup skips them all
    stale = _validated_on(shipped, OLD_HASH)
    result = CliRunner().invoke(show, [_copy(tmp_path / "stale.yaml", stale), "--coverage", workloads, "--format", "json"])
    assert json.loads(result.output)["coverage"]["counts"] == {
        "exact": 0, "nearest bucket": 0, "similar entry": 0, "default": 0, "default (stale entries)": 16}


def _validated_on(document: dict, kernel_hash: str | None) -> dict:
    """`document` (a table of any readable schema) as a table whose every entry was validated on
    `kernel_hash` (None: on the kernel sources installed here, so current). The validations are
    schema 2's (`source:<hash>`): their status costs a hash of the sources, where computing each
    of a shipped table's entries' stamps takes seconds."""
    doc = table_to_dict(table_from_dict(document, "table"))
    for item in doc["entries"]:
        source_hash = kernel_hash or kernel_source_hash(item["backend"])
        item.update(validated={"stamp": LEGACY_PREFIX + source_hash, "date": doc["created"], "suite": "full"},
                    stale=None)
    return doc


def _copy(path, document) -> str:
    path.write_text(yaml.safe_dump(document))
    return str(path)


def test_show_truncated_table_is_one_line_exit_1(tmp_path, capsys):
    from dmattn_bench import cli

    cli.cli.add_command(show)  # until cli/__init__.py registers it
    path = write(tmp_path / "t.yaml", [entry(key(q=2 ** i)) for i in range(6, 12)])
    data = open(path, "rb").read()
    open(path, "wb").write(data[: len(data) // 2])
    with pytest.raises(SystemExit) as done:
        cli.main(["show", path])
    assert done.value.code == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and path in lines[0] and lines[0].startswith("error:")


def test_a_wheel_install_carries_the_shipped_tables(installed_wheel, tmp_path):
    """Installed from a wheel (no source checkout), the runtime still finds every shipped table:
    they are package data, and `SHIPPED_TABLES_DIR` points at them."""
    import subprocess
    import sys

    site, root = installed_wheel
    probe = ("from dmattn_bench.dispatch import lookup; from dmattn_bench.space import CONFIGS_DIR; "
             "print(lookup.SHIPPED_TABLES_DIR); print(*sorted(p.name for p in lookup.SHIPPED_TABLES_DIR.glob('*.yaml'))); "
             "print(CONFIGS_DIR); print(*sorted(str(p.relative_to(CONFIGS_DIR)) for p in CONFIGS_DIR.rglob('*.yaml')))")
    printed = subprocess.run([sys.executable, "-I", "-c", f"import sys; sys.path.insert(0, {str(site)!r}); {probe}"],
                             check=True, capture_output=True, text=True, cwd=tmp_path).stdout.splitlines()
    assert printed[0] == str(site / "dmattn_bench" / "tables")
    assert printed[1].split() == sorted(p.name for p in (root / "results" / "tables").glob("*.yaml"))
    # the search spaces and workloads travel too: a wheel install can tune and bench
    assert printed[2] == str(site / "dmattn_bench" / "configs")
    assert printed[3].split() == sorted(str(p.relative_to(root / "configs")) for p in (root / "configs").rglob("*.yaml"))


# -- an entry whose config no kernel can run (issue 54) -------------------------------------------

def _with_bad_tile(tmp_path) -> str:
    """A tuned table with its first entry's block_m hand-edited to 24 (no kernel runs that), and a
    second, good entry."""
    doc = table_to_dict(new_table([entry(key()), entry(key(dtype="fp16"), FwdConfig(64, 32, 2, 1))],
                                  CPU_FINGERPRINT, interpreter=True))
    bad = next(item for item in doc["entries"] if item["key"]["dtype"] == "fp32")
    bad["config"]["block_m"] = 24
    return _copy(tmp_path / "t.yaml", doc)


def test_an_entry_with_a_bad_tile_is_skipped_with_one_warning_and_its_neighbours_serve(tmp_path):
    """On 0f8f85e a block_m of 24 loaded, was chosen, and every call of its key died in Triton."""
    path = _with_bad_tile(tmp_path)
    table = load_table(path)
    assert [entry_status(e, table.device) for e in table.entries] == ["current", "invalid"]  # fp16 sorts first
    assert lookup.status_counts(table) == {"current": 1, "stale": 0, "unvalidated": 0, "invalid": 1}
    with pytest.warns(DispatchWarning, match=r"fwd fp32 D64 \(triton\) skipped, its config cannot run "
                                             r"\(FwdConfig.block_m: got 24, expected a multiple of 16"):
        assert choose(key(), "cpu", table=path).source == "default"
    with warnings.catch_warnings():
        warnings.simplefilter("error", DispatchWarning)  # warned once per table
        assert choose(key(q=2048), "cpu", table=path).source == "default"
        assert choose(key(dtype="fp16"), "cpu", table=path).config == FwdConfig(64, 32, 2, 1)
    assert load_table(path).entries == table.entries  # read the same each time; written back as read
    dump_table(table, tmp_path / "again.yaml")
    assert yaml.safe_load(open(tmp_path / "again.yaml"))["entries"][1]["config"]["block_m"] == 24


def test_show_marks_an_entry_with_a_bad_tile(tmp_path):
    path = _with_bad_tile(tmp_path)
    human = CliRunner().invoke(show, [path])
    assert human.exit_code == 0, human.output
    assert "1 invalid" in human.output and "invalid: block_m=24" in human.output
    shown = json.loads(CliRunner().invoke(show, [path, "--format", "json"]).output)
    assert shown["status_counts"]["invalid"] == 1
    bad = next(e for e in shown["entries"] if e["status"] == "invalid")
    assert bad["problem"].startswith("FwdConfig.block_m: got 24") and bad["config"]["block_m"] == 24


def test_verify_fails_on_an_entry_with_a_bad_tile(tmp_path, capsys):
    from dmattn_bench.cli import main

    doc = yaml.safe_load(open(_with_bad_tile(tmp_path)))
    doc["entries"] = [item for item in doc["entries"] if item["key"]["dtype"] == "fp32"]  # the bad one alone
    with pytest.raises(SystemExit) as done:
        main(["verify", "--table", _copy(tmp_path / "bad.yaml", doc), "--dtype", "fp32", "--format", "json"])
    assert done.value.code == 3
    report = json.loads(capsys.readouterr().out)
    (suite,) = report["entries"]
    assert suite["status"] == "invalid" and suite["cases"][0]["reason"].startswith("FwdConfig.block_m: got 24")
