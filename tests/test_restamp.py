"""Each table entry carries its own validation, on the stamp of its code (`stamps.entry_stamp`).
`dmattn-bench verify --suite full --restamp` re-validates the entries that are not current, and
only those, without touching their timings; `verify --declare-stale REASON` marks, without a GPU,
the entries whose code changed since their validation, and the runtime skips them.

CPU tier: tiny fp32/fp16 entries (D16, L16) run through the Triton interpreter; two verify runs
in all (one passing, one failing), of one entry each; the other tests run no kernel.
"""

import dataclasses
import json
import warnings

import pytest
import yaml
from click.testing import CliRunner

from dmattn_bench import registry
from dmattn_bench.cli.verify import verify
from dmattn_bench.dispatch import lookup
from dmattn_bench.dispatch.lookup import DispatchWarning, clear_cache
from dmattn_bench.dispatch.stamps import entry_status, stamp_of
from dmattn_bench.dispatch.table import Entry, TableError, Timing, Validation, load_table
from dmattn_bench.errors import ValidationFailed
from dmattn_bench.hardware import CPU_FINGERPRINT, DeviceFingerprint
from dmattn_bench.space import BwdConfig, FwdConfig, TableKey
from dmattn_bench.tiles import choose
from dmattn_bench.tuning.table_writer import dump_table, new_table, restamp, table_to_dict

OLD_STAMP = "sha256:" + "0" * 32  # the code an entry was validated on before its kernels changed
OLD_DATE = "2020-01-01T00:00:00+00:00"
OLD = Timing(OLD_STAMP, OLD_DATE)  # every entry's timings: measured on the old code, kept as they are
TUNED_FWD = FwdConfig(16, 16, 1, 1)
LONGER_FWD = FwdConfig(32, 32, 1, 1)  # the entry one bucket up: the nearest current one
TUNED_BWD = BwdConfig(16, 16, 16, 16, 1, 1)
REASON = "kernel edit of 2020-01-02, its GPU away"
H200 = DeviceFingerprint("NVIDIA H200", "9.0", 132, 232448)


def key(direction="fwd", dtype="fp32", length=16) -> TableKey:
    return TableKey(direction, dtype, 16, direction == "bwd", "none", "none", 1, length, length)


CHANGED = key()  # fp32: the entry a restamp of fp32 runs
LONGER = key(length=64)
OTHER_DTYPE = key(dtype="fp16")
BACKWARD = key("bwd")


def write_table(path, device=CPU_FINGERPRINT, changed=(CHANGED, OTHER_DTYPE)) -> str:
    """A table of four entries, validated long ago, the `changed` ones on code that has changed
    since (another stamp) and the others on the code installed here (current): fp32 fwd at L16
    and L64, fp16 fwd at L16, fp32 bwd at L16."""
    entries = [Entry(CHANGED, "triton", TUNED_FWD, {"median_ms": 1.0}, OLD),
               Entry(LONGER, "triton", LONGER_FWD, {"median_ms": 3.0}, OLD),
               Entry(OTHER_DTYPE, "triton", TUNED_FWD, {"median_ms": 1.5}, OLD),
               Entry(BACKWARD, "triton", TUNED_BWD, {"median_ms": 2.0}, OLD)]
    table = new_table(entries, device, interpreter=True)
    table = dataclasses.replace(table, entries=tuple(
        dataclasses.replace(e, validated=Validation(OLD_STAMP if e.key in changed else e.validated.stamp, OLD_DATE,
                                                    "full" if e.key in changed else "quick"))
        for e in table.entries))
    dump_table(table, path)
    return str(path)


def entries_of(path) -> dict:
    return {e.key: e for e in load_table(path).entries}


@pytest.fixture(autouse=True)
def fresh_dispatcher(monkeypatch, tmp_path):
    monkeypatch.setattr(lookup, "SHIPPED_TABLES_DIR", tmp_path / "shipped")
    monkeypatch.delenv(lookup.ENV_VAR, raising=False)
    clear_cache()
    yield
    clear_cache()


def run_verify(*arguments):
    return CliRunner().invoke(verify, [*arguments, "--format", "json"])


def test_declare_stale_then_restamp(tmp_path):
    """The whole cycle: a kernel change lands while the table's GPU is away, so the entries whose
    code it changed are declared stale (and skipped at run time, the nearest current entry serving
    instead); later, on the GPU, `--restamp` runs those of one dtype alone and makes them current."""
    path = write_table(tmp_path / "t.yaml")
    before = entries_of(path)
    assert {k: entry_status(e, CPU_FINGERPRINT) for k, e in before.items()} == {
        CHANGED: "stale", LONGER: "current", OTHER_DTYPE: "stale", BACKWARD: "current"}

    declared = run_verify("--table", path, "--declare-stale", REASON)
    assert declared.exit_code == 0, declared.output
    assert json.loads(declared.stdout) == {"table": path, "newly_stale": 2, "stale": 2, "entries": 4}
    after = entries_of(path)
    assert {k: e.stale for k, e in after.items()} == {CHANGED: REASON, LONGER: None, OTHER_DTYPE: REASON,
                                                      BACKWARD: None}
    assert after == {k: dataclasses.replace(e, stale=after[k].stale) for k, e in before.items()}  # nothing else
    text = open(path, "rb").read()
    again = run_verify("--table", path, "--declare-stale", "another reason")
    assert json.loads(again.stdout)["newly_stale"] == 0 and open(path, "rb").read() == text  # already declared

    with pytest.warns(DispatchWarning) as record:
        assert choose(CHANGED, "cpu", table=path) == lookup.Choice("triton", LONGER_FWD, f"table:{path}")
        assert choose(OTHER_DTYPE, "cpu", table=path).source == "default"  # no current fp16 entry
    assert len(record) == 1 and f"declared stale ({REASON})" in str(record[0].message)

    result = run_verify("--table", path, "--dtype", "fp32", "--suite", "full", "--restamp")
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    assert document["restamp"] == {"restamped": 1, "suite": "full"}
    assert [r["fwd_config"] for r in document["entries"]] == [TUNED_FWD.to_dict()]  # the changed entry alone ran
    assert "1 of its 3 fp32 entries are stale or unvalidated" in result.stderr
    restamped = entries_of(path)
    changed = restamped[CHANGED]
    assert changed.validated.stamp == stamp_of(changed, CPU_FINGERPRINT) and changed.validated.suite == "full"
    assert changed.validated.date > OLD_DATE and changed.stale is None
    # the current entries keep their validations, the fp16 one its staleness, every entry its timings
    assert {k: restamped[k] for k in (LONGER, OTHER_DTYPE, BACKWARD)} == {k: after[k] for k in (LONGER, OTHER_DTYPE,
                                                                                                  BACKWARD)}
    assert {e.timed for e in restamped.values()} == {OLD}
    assert lookup.status_counts(load_table(path)) == {"current": 3, "stale": 1, "unvalidated": 0, "invalid": 0}
    clear_cache()
    with warnings.catch_warnings():
        warnings.simplefilter("error", DispatchWarning)
        assert choose(CHANGED, "cpu", table=path) == lookup.Choice("triton", TUNED_FWD, f"table:{path}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.yaml"]  # written in place, no temporary file left


def test_a_failing_entry_restamps_nothing(tmp_path, monkeypatch):
    path = write_table(tmp_path / "t.yaml")
    before = open(path, "rb").read()
    real = registry.get_backend("triton")

    def wrong_forward(*args, out, **kwargs):
        real.forward(*args, out=out, **kwargs)
        out.add_(1.0)

    monkeypatch.setitem(registry._loaded, "triton", dataclasses.replace(real, forward=wrong_forward))
    result = run_verify("--table", path, "--dtype", "fp32", "--suite", "full", "--restamp")
    assert isinstance(result.exception, ValidationFailed), result.output  # exit 3 through `main`
    assert "not restamped" in result.stderr
    (suite,) = json.loads(result.stdout)["entries"]
    assert suite["fwd_config"] == TUNED_FWD.to_dict() and suite["status"] != "ok"
    assert open(path, "rb").read() == before


def test_a_restamp_with_nothing_stale_runs_and_writes_nothing(tmp_path):
    path = write_table(tmp_path / "t.yaml", changed=(OTHER_DTYPE,))
    before = open(path, "rb").read()
    result = run_verify("--table", path, "--dtype", "fp32", "--suite", "full", "--restamp")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["restamp"] == {"restamped": 0, "suite": "full"}
    assert open(path, "rb").read() == before


@pytest.mark.parametrize("arguments, option, says", [
    (["--dtype", "fp32", "--restamp"], "--restamp", "--suite full"),  # the CPU default is the quick suite
    (["--dtype", "fp32", "--suite", "quick", "--restamp"], "--restamp", "--suite full"),
    (["--dtype", "fp32", "--suite", "full", "--restamp", "--no-table"], "--restamp", "pass --table"),
    (["--declare-stale", REASON, "--no-table"], "--declare-stale", "needs --table"),
    (["--declare-stale", REASON, "--restamp", "--suite", "full"], "--declare-stale", "no --restamp"),
])
def test_restamp_and_declare_stale_need_their_options(tmp_path, monkeypatch, capsys, arguments, option, says):
    from dmattn_bench.cli import main

    path = write_table(tmp_path / "t.yaml")
    before = open(path, "rb").read()
    monkeypatch.delenv("DMATTN_BENCH_DEBUG", raising=False)
    if "--no-table" in arguments:
        arguments = [a for a in arguments if a != "--no-table"]
        monkeypatch.setenv(lookup.ENV_VAR, path)  # a table named only by the environment is not rewritten
    else:
        arguments = ["--table", path, *arguments]
    with pytest.raises(SystemExit) as ended:
        main(["verify", *arguments])
    stderr = capsys.readouterr().err
    assert ended.value.code == 2, stderr
    error = [line for line in stderr.splitlines() if line.startswith("Error:")]
    assert len(error) == 1 and option in error[0] and says in error[0], stderr
    assert "Traceback" not in stderr and open(path, "rb").read() == before


def test_restamp_refuses_a_table_of_another_device(tmp_path):
    path = write_table(tmp_path / "t.yaml", device=H200)
    before = open(path, "rb").read()
    result = run_verify("--table", path, "--dtype", "fp32", "--suite", "full", "--restamp")
    assert result.exit_code == 2 and "NVIDIA H200" in result.output and "restamp it on its own device" in result.output
    assert open(path, "rb").read() == before


def test_declare_stale_needs_no_gpu_of_the_tables_device(tmp_path):
    """A table of an H200, declared stale here: its entries' stamps are taken for sm90."""
    path = write_table(tmp_path / "t.yaml", device=H200, changed=(BACKWARD,))
    result = run_verify("--table", path, "--declare-stale", REASON)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["newly_stale"] == 1
    assert {k: e.stale for k, e in entries_of(path).items()} == {CHANGED: None, LONGER: None, OTHER_DTYPE: None,
                                                                 BACKWARD: REASON}


@pytest.mark.parametrize("change", ["config", "removed"])
def test_restamp_refuses_entries_that_changed_while_they_were_verified(tmp_path, change):
    path = write_table(tmp_path / "t.yaml")
    verified = {e: stamp_of(e, CPU_FINGERPRINT) for e in load_table(path).entries if e.key == CHANGED}
    document = yaml.safe_load(open(path).read())
    (index,) = [i for i, item in enumerate(document["entries"]) if TableKey(**item["key"]) == CHANGED]
    if change == "config":
        document["entries"][index]["config"]["block_m"] = 32  # re-tuned meanwhile
    else:
        del document["entries"][index]
    open(path, "w").write(yaml.safe_dump(document))
    before = open(path, "rb").read()
    with pytest.raises(TableError, match="changed while they were verified"):
        restamp(path, verified, "full")
    assert open(path, "rb").read() == before


def test_restamp_records_each_entry_on_its_own_stamp_and_clears_its_staleness(tmp_path):
    path = write_table(tmp_path / "t.yaml")
    table = load_table(path)
    dump_table(dataclasses.replace(table, entries=tuple(dataclasses.replace(e, stale=REASON) for e in table.entries)),
               path)
    before = entries_of(path)
    written = restamp(path, {before[CHANGED]: "sha256:one", before[OTHER_DTYPE]: "sha256:two"}, "full")
    assert table_to_dict(load_table(path)) == table_to_dict(written)
    after = entries_of(path)
    assert {k: (e.validated.stamp, e.validated.suite, e.stale) for k, e in after.items()} == {
        CHANGED: ("sha256:one", "full", None), OTHER_DTYPE: ("sha256:two", "full", None),
        LONGER: (before[LONGER].validated.stamp, "quick", REASON),
        BACKWARD: (before[BACKWARD].validated.stamp, "quick", REASON)}
    assert after[CHANGED].validated.date == after[OTHER_DTYPE].validated.date > OLD_DATE
    assert after[LONGER] == before[LONGER] and after[BACKWARD] == before[BACKWARD]


def _restamp_many(path: str, key: TableKey, stamp: str) -> None:
    """A writer process: restamps its own entry of the table 20 times."""
    from dmattn_bench.dispatch.table import load_table
    from dmattn_bench.tuning.table_writer import restamp

    (entry,) = [e for e in load_table(path).entries if e.key == key]
    for _ in range(20):
        restamp(path, {entry: stamp}, "full")


def test_concurrent_restamps_of_two_entries_keep_both(tmp_path):
    """fp32 and fp16 verified at the same time (two GPUs of one host): each restamp reads, changes
    and writes the file under the directory's lock, so neither loses the other's record, and a
    reader meanwhile always sees a whole table."""
    import multiprocessing

    path = write_table(tmp_path / "t.yaml")
    context = multiprocessing.get_context("spawn")
    writers = [context.Process(target=_restamp_many, args=(path, k, f"sha256:{k.dtype}"))
               for k in (CHANGED, OTHER_DTYPE)]
    for writer in writers:
        writer.start()
    while any(writer.is_alive() for writer in writers):
        load_table(path)  # never torn
    assert [writer.exitcode for writer in writers] == [0, 0]
    stamps = {k: e.validated.stamp for k, e in entries_of(path).items() if k in (CHANGED, OTHER_DTYPE)}
    assert stamps == {CHANGED: "sha256:fp32", OTHER_DTYPE: "sha256:fp16"}
