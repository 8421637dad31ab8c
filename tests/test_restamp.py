"""`dmattn-bench verify --suite full --restamp`: a table re-validated on the installed kernel
sources becomes current again, one dtype at a time, without touching its timings.

CPU tier: tiny fp32/fp16 entries (D16, L16) run through the Triton interpreter.
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
from dmattn_bench.dispatch.lookup import DispatchWarning, choose, clear_cache, kernel_hash_status, validation_status
from dmattn_bench.dispatch.table import (
    Entry,
    TableError,
    Timing,
    Validation,
    dump_table,
    load_table,
    new_table,
    restamp,
    table_to_dict,
)
from dmattn_bench.errors import ValidationFailed
from dmattn_bench.hardware import CPU_FINGERPRINT, DeviceFingerprint
from dmattn_bench.registry import kernel_source_hash
from dmattn_bench.space import BwdConfig, FwdConfig, TableKey

OLD_HASH = "sha256:" + "0" * 32  # the kernel sources the table was tuned and validated on
OLD_DATE = "2020-01-01T00:00:00+00:00"
TUNED_FWD = FwdConfig(16, 16, 1, 1)
TUNED_BWD = BwdConfig(16, 16, 16, 16, 1, 1)


def key(direction="fwd", dtype="fp32") -> TableKey:
    return TableKey(direction, dtype, 16, direction == "bwd", "none", "none", 1, 16, 16)


def stale_table(path, dtypes=("fp32", "fp16"), device=CPU_FINGERPRINT) -> str:
    """A table of fwd (and one fp32 bwd) entries, tuned, timed and validated on OLD_HASH."""
    old = Timing(OLD_HASH, OLD_DATE)
    entries = [Entry(key("fwd", d), "triton", TUNED_FWD, {"median_ms": 1.0}, old) for d in dtypes]
    entries.append(Entry(key("bwd", dtypes[0]), "triton", TUNED_BWD, {"median_ms": 2.0}, old))
    table = new_table(entries, device, interpreter=True)
    validated = {"triton": {d: Validation(OLD_HASH, OLD_DATE, "full") for d in dtypes}}
    table = dataclasses.replace(table, validated=validated)
    dump_table(table, path)
    return str(path)


@pytest.fixture(autouse=True)
def fresh_dispatcher(monkeypatch, tmp_path):
    monkeypatch.setattr(lookup, "SHIPPED_TABLES_DIR", tmp_path / "shipped")
    monkeypatch.delenv(lookup.ENV_VAR, raising=False)
    clear_cache()
    yield
    clear_cache()


def run_verify(*arguments):
    return CliRunner().invoke(verify, [*arguments, "--format", "json"])


def test_restamp_marks_the_table_current_once_every_dtype_passed(tmp_path):
    path = stale_table(tmp_path / "t.yaml")
    assert kernel_hash_status(load_table(path)) == {"triton": "stale"}
    with pytest.warns(DispatchWarning, match="triton entries ignored"):
        assert choose(key(), "cpu", table=path).source == "default"

    result = run_verify("--table", path, "--dtype", "fp32", "--suite", "full", "--restamp")
    assert result.exit_code == 0, result.output
    assert "stay stale until its fp16 entries pass too" in result.stderr
    table = load_table(path)
    fp32 = table.validated["triton"]["fp32"]
    assert (fp32.kernel_hash, fp32.suite) == (kernel_source_hash("triton"), "full") and fp32.date > OLD_DATE
    assert table.validated["triton"]["fp16"] == Validation(OLD_HASH, OLD_DATE, "full")
    assert validation_status(table) == {"triton": {"fp16": "stale", "fp32": "current"}}
    assert json.loads(result.stdout)["restamp"]["kernel_hash_status"] == {"triton": "stale"}

    result = run_verify("--table", path, "--dtype", "fp16", "--suite", "full", "--restamp")
    assert result.exit_code == 0, result.output
    assert "its triton entries are current" in result.stderr
    table = load_table(path)
    assert kernel_hash_status(table) == {"triton": "current"}
    # the timings keep the sources and date they were measured on
    assert {entry.timed for entry in table.entries} == {Timing(OLD_HASH, OLD_DATE)}
    clear_cache()
    with warnings.catch_warnings():
        warnings.simplefilter("error", DispatchWarning)
        assert choose(key(), "cpu", table=path) == lookup.Choice("triton", TUNED_FWD, f"table:{path}")
    assert list(tmp_path.iterdir()) == [tmp_path / "t.yaml"]  # written in place, no temporary file left


def test_a_failing_entry_restamps_nothing(tmp_path, monkeypatch):
    path = stale_table(tmp_path / "t.yaml", dtypes=("fp32",))
    before = open(path, "rb").read()
    real = registry.get_backend("triton")

    def wrong_forward(*args, out, **kwargs):
        real.forward(*args, out=out, **kwargs)
        out.add_(1.0)

    monkeypatch.setitem(registry._loaded, "triton", dataclasses.replace(real, forward=wrong_forward))
    result = run_verify("--table", path, "--dtype", "fp32", "--suite", "full", "--restamp")
    assert isinstance(result.exception, ValidationFailed), result.output  # exit 3 through `main`
    assert "not restamped" in result.stderr
    assert open(path, "rb").read() == before


@pytest.mark.parametrize("arguments, says", [
    (["--dtype", "fp32", "--restamp"], "--suite full"),  # the CPU default is the quick suite
    (["--dtype", "fp32", "--suite", "quick", "--restamp"], "--suite full"),
    (["--dtype", "fp32", "--suite", "full", "--restamp", "--no-table"], "pass --table"),
])
def test_restamp_needs_the_full_suite_and_a_table_file(tmp_path, monkeypatch, capsys, arguments, says):
    from dmattn_bench.cli import main

    path = stale_table(tmp_path / "t.yaml")
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
    assert len(error) == 1 and "--restamp" in error[0] and says in error[0], stderr
    assert "Traceback" not in stderr and open(path, "rb").read() == before


def test_restamp_refuses_a_table_of_another_device(tmp_path):
    h200 = DeviceFingerprint("NVIDIA H200", "9.0", 132, 232448)
    path = stale_table(tmp_path / "t.yaml", device=h200)
    before = open(path, "rb").read()
    result = run_verify("--table", path, "--dtype", "fp32", "--suite", "full", "--restamp")
    assert result.exit_code == 2 and "NVIDIA H200" in result.output and "restamp it on its own device" in result.output
    assert open(path, "rb").read() == before


def test_restamp_refuses_entries_that_changed_while_they_were_verified(tmp_path):
    path = stale_table(tmp_path / "t.yaml")
    verified = [e for e in load_table(path).entries if e.key.dtype == "fp32"]
    document = yaml.safe_load(open(path).read())
    document["entries"][0]["config"]["block_m"] = 32  # re-tuned meanwhile
    open(path, "w").write(yaml.safe_dump(document))
    before = open(path, "rb").read()
    with pytest.raises(TableError, match="changed while they were verified"):
        restamp(path, verified, "fp32", "full", {"triton": kernel_source_hash("triton")})
    assert open(path, "rb").read() == before


def test_restamp_keeps_other_backends_and_dtypes(tmp_path):
    path = stale_table(tmp_path / "t.yaml")
    table = load_table(path)
    other = Entry(dataclasses.replace(key("fwd", "fp16"), head_dim=32), "reference", TUNED_FWD, {},
                  Timing(OLD_HASH, OLD_DATE))
    entries = [*table.entries, other]
    validated = dict(table.validated, reference={"fp16": Validation(OLD_HASH, OLD_DATE, "quick")})
    dump_table(dataclasses.replace(table, entries=tuple(entries), validated=validated), path)
    verified = [e for e in entries if e.key.dtype == "fp32"]
    written = restamp(path, verified, "fp32", "full", {"triton": "sha256:new"})
    assert written.validated["reference"] == {"fp16": Validation(OLD_HASH, OLD_DATE, "quick")}
    assert written.validated["triton"]["fp16"] == Validation(OLD_HASH, OLD_DATE, "full")
    assert written.validated["triton"]["fp32"].kernel_hash == "sha256:new"
    assert table_to_dict(load_table(path)) == table_to_dict(written)


def _restamp_many(path: str, dtype: str, kernel_hash: str) -> None:
    """A writer process: restamps its own dtype of the table 20 times."""
    from dmattn_bench.dispatch.table import load_table, restamp

    verified = [e for e in load_table(path).entries if e.key.dtype == dtype]
    for _ in range(20):
        restamp(path, verified, dtype, "full", {"triton": kernel_hash})


def test_concurrent_restamps_of_two_dtypes_keep_both(tmp_path):
    """bf16 and fp16 verified at the same time (two GPUs of one host): each restamp reads, changes
    and writes the file under the directory's lock, so neither loses the other's record, and a
    reader meanwhile always sees a whole table."""
    import multiprocessing

    path = stale_table(tmp_path / "t.yaml")
    context = multiprocessing.get_context("spawn")
    writers = [context.Process(target=_restamp_many, args=(path, dtype, f"sha256:{dtype}"))
               for dtype in ("fp32", "fp16")]
    for writer in writers:
        writer.start()
    while any(writer.is_alive() for writer in writers):
        load_table(path)  # never torn
    assert [writer.exitcode for writer in writers] == [0, 0]
    validated = load_table(path).validated["triton"]
    assert {dtype: record.kernel_hash for dtype, record in validated.items()} == {"fp16": "sha256:fp16",
                                                                                  "fp32": "sha256:fp32"}
