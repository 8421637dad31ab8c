"""`dmattn-bench tune` on packed-sequence and sliding-window workloads (issue 56), end to end in
the interpreter: configs/workloads/varlen-cpu.yaml gives a table with packed and window entries,
each validated on its own workload and the packed/window suite, which dispatch then serves."""

import json

import pytest
import yaml
from click.testing import CliRunner

from dmattn_bench import dispatch, tiles
from dmattn_bench.cli.tune import tune_command
from dmattn_bench.dispatch import load_table
from dmattn_bench.dispatch.stamps import entry_status
from dmattn_bench.space import CONFIGS_DIR
from dmattn_bench.tiles import default_configs
from dmattn_bench.tuning.workloads import load_workloads

CPU_FWD, CPU_BWD = default_configs(32, "cpu")
VARLEN_CPU = CONFIGS_DIR / "workloads" / "varlen-cpu.yaml"


@pytest.fixture(autouse=True)
def fresh_dispatcher():
    dispatch.use_table(None)
    dispatch.clear_cache()
    yield
    dispatch.use_table(None)
    dispatch.clear_cache()


def test_tune_on_varlen_cpu_writes_packed_and_window_entries(tmp_path):
    """One candidate per direction (the interpreter's default, so the run stays short); every
    workload key gets its entry, the packed ones `packed`, the dense window one `window`, each
    validated by the packed/window suite, current, and chosen by dispatch for its key only."""
    space = tmp_path / "space.yaml"
    space.write_text(yaml.safe_dump({"space": {"triton": {
        "fwd": {name: [value] for name, value in CPU_FWD.to_dict().items()},
        "bwd": {name: [value] for name, value in CPU_BWD.to_dict().items()}}}}))
    out = tmp_path / "T.yaml"
    result = CliRunner().invoke(tune_command, ["--workloads", str(VARLEN_CPU), "--space", str(space), "--out", str(out),
                                               "--format", "json"])
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    workloads = load_workloads(VARLEN_CPU)
    keys = {w.key(direction) for w in workloads for direction in ("fwd", "bwd")}
    assert document["counts"] == {"ok": len(keys)} and document["entries"] == len(keys)
    table = load_table(out)
    assert {e.key for e in table.entries} == keys
    assert any(e.key.packed for e in table.entries) and any(e.key.window and not e.key.packed for e in table.entries)
    for entry in table.entries:
        assert entry.backend == "triton" and entry_status(entry, table.device) == "current"
        assert entry.evidence["adversarial"].startswith("quick suite")
    written = yaml.safe_load(out.read_text())["entries"]
    assert all(("packed" in item["key"]) != ("window" in item["key"]) for item in written)
    # the journal's suite verdicts are the packed/window suite's
    journal = [json.loads(line) for line in open(str(out) + ".trials.jsonl")]
    assert [r for r in journal if r["kind"] == "suite"] and all(
        r["status"] == "ok" for r in journal if r["kind"] == "suite")
    # dispatch: each key gets its entry; the same shape dense gets the default
    for entry in table.entries:
        choice = tiles.choose(entry.key, "cpu", table=str(out))
        assert choice.source.startswith("table:") and choice.config == entry.config
        dense = entry.key.__class__(**{**entry.key.to_dict(), "packed": False, "window": 0})
        assert tiles.choose(dense, "cpu", table=str(out)).source == "default"
