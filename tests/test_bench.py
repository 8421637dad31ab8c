"""`dmattn-bench bench` on the CPU (interpreter): workload files, the dynamic-mask rule, the floor
arithmetic, failed peers kept as rows, the ratios, the report formats and the exit codes."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
import yaml
from click.testing import CliRunner

from dmattn_bench import peers
from dmattn_bench.bench import (
    COLUMNS,
    Row,
    build_bench_inputs,
    bytes_needed,
    fill_ratios,
    floor_ms,
    load_peer_workloads,
    markdown,
    row_cells,
    run_bench,
)
from dmattn_bench.cli.bench import DEFAULT_WORKLOADS, bench
from dmattn_bench.hardware import DevicePeaks
from dmattn_bench.peers import parse_peers, unavailable_reason

TINY = {
    "name": "T1 full bias", "batch": 1, "heads": 2, "heads_kv": 2, "seqlen": 40, "head_dim": 32,
    "causal": True, "dtype": "fp32", "bias": {"kind": "full", "grad": True},
    "mask": {"kind": "full", "keep": {"top_fraction": 0.5}},
}
TINY_GQA = dict(TINY, name="T2 gqa", heads=4, heads_kv=2, bias={"kind": "per_key", "grad": True},
                mask={"kind": "kv_head", "keep": {"top_k": 8}})


def _write(tmp_path, *entries) -> str:
    path = tmp_path / "peers.yaml"
    path.write_text(yaml.safe_dump({"workloads": list(entries)}))
    return str(path)


def test_shipped_peer_workloads_are_w1_to_w3():
    workloads = load_peer_workloads(DEFAULT_WORKLOADS)
    assert [w.name for w in workloads] == ["W1 full bias", "W2 Doge GQA", "W3 dense causal"]
    w1, w2, w3 = (w.workload for w in workloads)
    assert (w1.mask, w1.bias, w1.bias_grad, w1.heads_kv) == ("full", "full", True, 16)
    assert (w2.mask, w2.bias, w2.heads // w2.heads_kv) == ("kv_head", "per_key", 4)
    assert (w3.mask, w3.bias, w3.causal) == ("none", "none", True)
    assert workloads[1].keep == ("top_k", 2048)


@pytest.mark.parametrize("change, message", [
    ({"bias": {"kind": "diagonal"}}, "bias"),
    ({"mask": {"kind": "full", "keep": {"random": 0.5}}}, "mask.keep"),
    ({"bias": "none"}, "needs a bias"),
    ({"heads_kv": 3}, "does not divide"),
    ({"dtype": "int8"}, "dtype"),
    ({"extra": 1}, "expected keys"),
])
def test_malformed_peer_workloads_are_rejected_by_name(tmp_path, change, message):
    with pytest.raises(ValueError, match=message):
        load_peer_workloads(_write(tmp_path, dict(TINY, **change)))


def test_keep_rules_select_the_highest_bias_keys_of_each_causal_prefix(tmp_path):
    for entry, count_of_prefix in ((TINY, lambda n: math.ceil(0.5 * n)), (TINY_GQA, lambda n: min(8, n))):
        pw = load_peer_workloads(_write(tmp_path, entry))[0]
        inputs = build_bench_inputs(pw, "cpu")
        lq = pw.workload.seqlen_q
        for b, h in ((0, 0), (0, inputs.mask.shape[1] - 1)):
            bias_h = h * inputs.bias.shape[1] // inputs.mask.shape[1]
            for i in range(lq):
                row = inputs.mask[b, h, i]
                assert int(row.sum()) == count_of_prefix(i + 1), (entry["name"], i)
                assert not row[i + 1:].any()  # never past the causal diagonal
                values = inputs.bias.detach()[b, bias_h].expand(lq, -1)[i, : i + 1]
                kept, dropped = values[row[: i + 1]], values[~row[: i + 1]]
                if dropped.numel():
                    assert kept.min() >= dropped.max()


def test_floor_is_the_larger_of_compute_and_memory():
    w = load_peer_workloads(DEFAULT_WORKLOADS, names=["W3"])[0].workload
    qkvo = 4 * 2 * 4096 * 16 * 128 * 2  # q, k, v, out in bf16
    lse = 2 * 16 * 4096 * 4
    assert bytes_needed(w, "fwd") == qkvo + lse
    compute_bound = DevicePeaks(tensor_flops=1e12, hbm_bytes_per_s=1e15)
    memory_bound = DevicePeaks(tensor_flops=1e18, hbm_bytes_per_s=1e9)
    assert floor_ms(w, "fwd", compute_bound) == pytest.approx(1e3 * w.flops("fwd") / 1e12)
    assert floor_ms(w, "fwd", memory_bound) == pytest.approx(1e3 * (qkvo + lse) / 1e9)
    assert floor_ms(w, "fwd", None) is None
    # W1: the mask (1 byte) and the bias (bf16) are needed over the causal part only; the
    # backward reads them again and writes dBias over the same part
    w1 = load_peer_workloads(DEFAULT_WORKLOADS, names=["W1"])[0].workload
    causal = w1.visible_pairs() / 4096**2
    operands = 2 * 16 * 4096**2 * (1 + 2) * causal
    assert bytes_needed(w1, "fwd") == pytest.approx(qkvo + lse + operands)
    backward = 2 * qkvo + lse + operands + 2 * 16 * 4096**2 * 2 * causal  # reads q k v out dout, writes dq dk dv dbias
    assert bytes_needed(w1, "fwd+bwd") == pytest.approx(qkvo + lse + operands + backward)


def test_unknown_peer_is_a_usage_error_and_ours_always_runs_first():
    assert parse_peers("flex,dmattn,sdpa-efficient") == ["dmattn", "flex", "sdpa-efficient"]
    assert parse_peers("sdpa,sdpa-efficient") == ["dmattn", "sdpa-efficient", "sdpa-flash-dense", "sdpa-cudnn-dense"]
    with pytest.raises(ValueError, match="unknown"):
        parse_peers("flex,xformers")


def test_a_peer_computing_the_same_function_agrees_with_ours(tmp_path):
    """SDPA (math backend) with the float mask built from our mask and bias: full mask and bias,
    and a kv-head mask with a per-key bias under GQA (K/V repeated), both causal."""
    workloads = load_peer_workloads(_write(tmp_path, TINY, TINY_GQA))
    rows = run_bench(workloads, ["dmattn", "sdpa-math"], "cpu", repeats=3)
    peer = [r for r in rows if r.peer == "sdpa-math"]
    assert all(r.status == "ok" and r.ours_over_peer_gpu > 0 and r.ours_over_peer_wall > 0 for r in peer), \
        [r.error for r in peer]
    forward = [r for r in peer if r.direction == "fwd"]
    assert len(forward) == 2 and all(r.max_abs_diff_vs_ours < 1e-5 for r in forward)
    # each direction's backend is named: a table tuned over both may pick two
    assert all(r.note.startswith("triton fwd ") and ", triton bwd " in r.note for r in rows if r.peer == "dmattn")


def test_bench_keeps_failed_peers_as_rows_and_fills_ratios(tmp_path):
    workloads = load_peer_workloads(_write(tmp_path, TINY, TINY_GQA))
    # on the CPU SDPA's fused kernels have no backend: a peer that fails on every row
    rows = run_bench(workloads, ["dmattn", "sdpa-cudnn-dense"], "cpu", repeats=3)
    assert len(rows) == 2 * 2 * 2
    ours = [r for r in rows if r.peer == "dmattn"]
    assert all(r.status == "ok" and r.median_ms > 0 and r.wall_ms > 0 for r in ours)
    assert all(r.ours_over_peer_gpu == 1.0 and r.ours_over_peer_wall == 1.0 for r in ours)
    failed = [r for r in rows if r.peer == "sdpa-cudnn-dense"]
    # said before torch is asked (it would say "turning off both the math kernel and the fused kernels")
    assert all(r.status == "error" and r.error == "needs a CUDA GPU (cuDNN attention is CUDA-only)"
               and r.median_ms is None for r in failed)
    assert all(r.floor_ms is None for r in rows)  # no datasheet peaks for a CPU


def test_bench_command_json_then_markdown_and_plot(tmp_path):
    path = _write(tmp_path, TINY)
    result = CliRunner().invoke(bench, ["--workloads", path, "--peers", "sdpa-efficient", "--repeats", "3",
                                        "--format", "json"])
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    assert {r["peer"] for r in document["rows"]} == {"dmattn", "sdpa-efficient"}
    assert document["eager_loop"] == {"calls": 2, "loops": 1}
    ours = [r for r in document["rows"] if r["peer"] == "dmattn"]
    assert all(r["wall_ms"] > 0 and r["ours_over_peer_gpu"] == r["ours_over_peer_wall"] == 1.0 for r in ours)
    assert document["workloads"] == ["T1 full bias: fp32 B1 H2 L40x40 D32 causal mask=full bias=full+grad keep top_fraction=0.5"]
    report = tmp_path / "report.json"
    report.write_text(result.stdout)
    rendered = CliRunner().invoke(bench, ["--from-json", str(report), "--format", "markdown"])
    assert rendered.exit_code == 0, rendered.output
    assert "| T1 full bias | fwd | dmattn | ok |" in rendered.stdout
    assert markdown(document) == rendered.stdout
    pytest.importorskip("matplotlib")
    png = tmp_path / "plot.png"
    plotted = CliRunner().invoke(bench, ["--from-json", str(report), "--plot", str(png)])
    assert plotted.exit_code == 0, plotted.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_without_a_gpu_runs_w1_to_w3_at_interpreter_size():
    result = CliRunner().invoke(bench, ["--only", "W2", "--peers", "sdpa-math", "--repeats", "3", "--format", "json"])
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    assert document["workloads"] == ["W2 Doge GQA: fp32 B1 H4 gqa4 L64x64 D32 causal mask=kv_head bias=per_key+grad keep top_k=32"]
    assert {(r["peer"], r["status"]) for r in document["rows"]} == {("dmattn", "ok"), ("sdpa-math", "ok")}


def test_bench_command_rejects_an_unknown_peer(tmp_path):
    result = CliRunner().invoke(bench, ["--workloads", _write(tmp_path, TINY), "--peers", "xformers"])
    assert result.exit_code == 2
    assert "unknown" in result.output


def test_row_serialisation_round_trips():
    row = Row("W", "flex", "fwd", "ok", median_ms=1.234567891, wall_ms=2.5, ours_over_peer_gpu=0.5,
              ours_over_peer_wall=0.25)
    assert Row.from_dict(row.to_dict()) == Row("W", "flex", "fwd", "ok", median_ms=1.23457, wall_ms=2.5,
                                               ours_over_peer_gpu=0.5, ours_over_peer_wall=0.25)
    with pytest.raises(ValueError, match="unknown keys"):
        Row.from_dict(dict(row.to_dict(), gpu_seconds=1.0))
    with pytest.raises(ValueError, match="lacks"):
        Row.from_dict({"workload": "W", "peer": "flex"})


def _document(rows: list[Row], **extra) -> dict:
    return dict({"device": "NVIDIA H100", "command": "dmattn-bench bench", "software": {"torch": "2.11"},
                 "repeats": 20, "eager_loop": {"calls": 20, "loops": 5}, "peaks": None, "workloads": ["W"],
                 "rows": [row.to_dict() for row in rows]}, **extra)


def _cells(line: str) -> list[str]:
    """A markdown table line's cells; an escaped `\\|` is inside a cell."""
    return re.split(r"(?<!\\)\|", line.strip())[1:-1]


def test_ratios_are_ours_over_the_peer_on_gpu_time_and_on_wall_time():
    rows = [Row("W", "dmattn", "fwd", "ok", median_ms=0.5, wall_ms=0.8),
            Row("W", "sdpa", "fwd", "ok", median_ms=1.0, wall_ms=0.4),
            Row("W", "flex", "fwd", "ok", median_ms=0.25),  # no wall time (e.g. an old report's row)
            Row("W", "cudnn", "fwd", "error", error="needs a CUDA GPU"),
            Row("W", "sdpa", "fwd+bwd", "ok", median_ms=2.0, wall_ms=2.0)]  # ours failed: no ratio
    fill_ratios(rows)
    ours, sdpa, flex, cudnn, no_ours = rows
    assert (ours.ours_over_peer_gpu, ours.ours_over_peer_wall) == (1.0, 1.0)
    assert (sdpa.ours_over_peer_gpu, sdpa.ours_over_peer_wall) == (0.5, 2.0)
    assert (flex.ours_over_peer_gpu, flex.ours_over_peer_wall) == (2.0, None)
    assert (cudnn.ours_over_peer_gpu, cudnn.ours_over_peer_wall) == (None, None)
    assert (no_ours.ours_over_peer_gpu, no_ours.ours_over_peer_wall) == (None, None)
    gpu, wall = COLUMNS.index("ours/peer gpu"), COLUMNS.index("ours/peer wall")
    assert (row_cells(sdpa)[gpu], row_cells(sdpa)[wall]) == ("0.50", "2.00")


def test_markdown_rows_have_as_many_cells_as_the_header():
    rows = [Row("W", "dmattn", "fwd", "ok", median_ms=0.5, spread=0.01, host_ms=0.3, wall_ms=0.8, tflops=100.0,
                floor_ms=0.25, floor_fraction=0.5, ours_over_peer_gpu=1.0, ours_over_peer_wall=1.0),
            Row("W", "flex", "fwd", "error", error="a | b"),  # a pipe in an error must not split its cell
            Row("W", "flex", "fwd+bwd", "ok", median_ms=0.5, max_abs_diff_vs_ours=1e-3, setup_ms=20.0)]
    lines = markdown(_document(rows)).splitlines()
    header = lines.index(next(line for line in lines if line.startswith("| workload")))
    table = lines[header:header + 2 + len(rows)]
    assert [cell.strip().replace("\\|", "|") for cell in _cells(table[0])] == list(COLUMNS)
    assert {"gpu ms", "host ms", "wall ms", "ours/peer gpu", "ours/peer wall"} <= set(COLUMNS)
    assert all(len(_cells(line)) == len(COLUMNS) for line in table), table
    assert "| W | fwd | dmattn | ok | 0.500 | 1.0% | 0.300 | 0.800 |" in table[2]
    assert "20 back-to-back calls" in "\n".join(lines[:header])


def test_reports_from_before_the_host_and_wall_times_render_them_as_unknown(tmp_path):
    """An old report's one `ours_over_peer` was the GPU-time ratio; host and wall times are '-'."""
    document = {"device": "NVIDIA H100", "command": "dmattn-bench bench", "software": {"torch": "2.11"},
                "repeats": 20, "peaks": None, "workloads": ["W"], "rows": [
                    {"workload": "W", "peer": "dmattn", "direction": "fwd", "status": "ok", "median_ms": 0.5,
                     "spread": 0.01, "ours_over_peer": 1.0, "note": ""}]}
    text = markdown(document)
    assert "| W | fwd | dmattn | ok | 0.500 | 1.0% | - | - |" in text
    assert "| 1.00 | - |" in text and "not measured in this report" in text
    row = Row("W", "flex", "fwd", "ok", median_ms=0.5, host_ms=0.0512)
    assert "0.051" in row_cells(row)
    report = tmp_path / "old.json"
    report.write_text(json.dumps(document))
    rendered = CliRunner().invoke(bench, ["--from-json", str(report), "--format", "markdown"])
    assert rendered.exit_code == 0 and rendered.stdout == text, rendered.output


def test_a_report_with_a_row_no_version_wrote_is_a_usage_error(tmp_path, capsys, monkeypatch):
    from dmattn_bench.cli import main

    monkeypatch.delenv("DMATTN_BENCH_DEBUG", raising=False)
    report = tmp_path / "future.json"
    report.write_text(json.dumps(_document([Row("W", "dmattn", "fwd", "ok")])).replace('"note"', '"notes"'))
    with pytest.raises(SystemExit) as ended:
        main(["bench", "--from-json", str(report)])
    stderr = capsys.readouterr().err
    assert ended.value.code == 2 and "unknown keys ['notes']" in " ".join(stderr.split()), stderr


def test_a_peer_that_needs_a_gpu_says_so():
    for peer in ("flex", "flex-small-bwd", "sdpa-efficient", "sdpa-cudnn-dense", "flash-dmattn", "ours-cuda"):
        assert unavailable_reason(peer, "cpu").startswith("needs a CUDA GPU ("), peer
        assert unavailable_reason(peer, "cuda") is None
    # these run on the CPU: ours in the interpreter, SDPA's math and flash kernels natively
    assert all(unavailable_reason(peer, "cpu") is None for peer in ("dmattn", "ours-triton", "sdpa-math",
                                                                    "sdpa-flash-dense"))


def test_bench_exits_1_when_our_kernel_fails_and_still_prints_the_report(tmp_path, capsys, monkeypatch):
    from dmattn_bench.cli import main

    def broken(inputs, table):
        raise RuntimeError("injected failure")

    monkeypatch.delenv("DMATTN_BENCH_DEBUG", raising=False)
    monkeypatch.setitem(peers.PEERS, "dmattn", broken)
    with pytest.raises(SystemExit) as ended:
        main(["bench", "--workloads", _write(tmp_path, TINY), "--peers", "sdpa-math", "--repeats", "3",
              "--format", "json"])
    captured = capsys.readouterr()
    assert ended.value.code == 1, captured.err
    rows = json.loads(captured.out)["rows"]
    assert {(r["peer"], r["status"]) for r in rows} == {("dmattn", "error"), ("sdpa-math", "ok")}
    errors = [line for line in captured.err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "T1 full bias fwd, T1 full bias fwd+bwd" in errors[0], captured.err
    assert "Traceback" not in captured.err


@pytest.mark.skipif(torch.cuda.is_available(), reason="bf16 runs on a GPU")
@pytest.mark.parametrize("command", [["tune", "--dtype", "bf16"], ["verify", "--dtype", "bf16"],
                                     ["bench", "--dtype", "bf16"]], ids=lambda command: command[0])
def test_bf16_without_a_gpu_is_the_same_usage_error_in_every_command(tmp_path, capsys, monkeypatch, command):
    from dmattn_bench.cli import main

    monkeypatch.delenv("DMATTN_BENCH_DEBUG", raising=False)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as ended:
        main(command)
    captured = capsys.readouterr()
    assert ended.value.code == 2, captured.err
    assert captured.out == ""
    errors = [line for line in captured.err.splitlines() if line.startswith("Error:")]
    assert errors == ["Error: Invalid value for --dtype: bf16 needs a CUDA GPU; the Triton interpreter on this "
                      "machine runs fp32 and fp16"], captured.err
