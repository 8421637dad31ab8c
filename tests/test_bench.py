"""`dmattn-bench bench` on the CPU (interpreter): workload files (prefill and decode), the
dynamic-mask rule, the decode caches, the floor and bandwidth arithmetic, the reference check,
failed peers kept as rows, the ratios, the report formats and the exit codes."""

from __future__ import annotations

import dataclasses
import json
import math
import re

import pytest
import torch
import yaml
from click.testing import CliRunner

from dmattn_bench.bench import peers
from dmattn_bench.bench.harness import (
    Row,
    build_bench_inputs,
    bytes_needed,
    fill_ratios,
    floor_ms,
    kv_bandwidth_fraction,
    kv_bytes,
    load_peer_workloads,
    run_bench,
    standing,
)
from dmattn_bench.bench.peers import parse_peers, unavailable_reason
from dmattn_bench.cli.bench import COLUMNS, DEFAULT_WORKLOADS, bench, markdown, row_cells
from dmattn_bench.hardware import DevicePeaks

TINY = {
    "name": "T1 full bias", "batch": 1, "heads": 2, "heads_kv": 2, "seqlen": 40, "head_dim": 32,
    "causal": True, "dtype": "fp32", "bias": {"kind": "full", "grad": True},
    "mask": {"kind": "full", "keep": {"top_fraction": 0.5}},
}
TINY_GQA = dict(TINY, name="T2 gqa", heads=4, heads_kv=2, bias={"kind": "per_key", "grad": True},
                mask={"kind": "kv_head", "keep": {"top_k": 8}})


# a decode cache of 48 keys, 36 of them filled (3 pages of 16 hold data, the last is tail)
TINY_DECODE = {
    "name": "T3 decode", "batch": 2, "heads": 4, "heads_kv": 2, "seqlen_q": 1, "seqlen_k": 48, "head_dim": 16,
    "dtype": "fp32", "filled": 0.75, "lengths": ["none", "mask", "cache_seqlens", "paged"], "page": 16,
}
DECODE_VARIANTS = ["none", "mask", "cache_seqlens", "paged"]


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


def test_shipped_decode_workloads_span_the_issue_grid():
    """B 1-64, Lk 2k-32k, GQA 4 and 8, each shape with no length, a padding mask, cache_seqlens and
    a paged cache, 7/8 of the cache filled, and a preallocated cache filled to 1/8; forward only.
    The CPU file has the same variants at interpreter size in fp32."""
    workloads = load_peer_workloads(DEFAULT_WORKLOADS.with_name("peers-decode.yaml"))
    shapes = {(w.workload.batch, w.workload.seqlen_k, w.workload.heads // w.workload.heads_kv) for w in workloads}
    assert {b for b, _, _ in shapes} >= {1, 8, 32, 64} and {lk for _, lk, _ in shapes} >= {2048, 32768}
    assert {gqa for _, _, gqa in shapes} == {4, 8}
    variants, filled = {}, {}
    for w in workloads:
        entry = w.name.rsplit(" ", 1)[0]
        variants.setdefault(entry, set()).add(w.decode.lengths)
        filled[entry] = min(filled.get(entry, 1.0), w.keys_read / w.workload.seqlen_k)
    assert set(filled.values()) == {0.875, 0.125}
    assert all(found == set(DECODE_VARIANTS) - ({"none"} if filled[entry] == 0.125 else set())
               for entry, found in variants.items())
    assert all(w.directions == ("fwd",) and w.workload.seqlen_q == 1 and w.workload.dtype == "bf16" for w in workloads)
    d3 = {w.decode.lengths: w for w in workloads if w.name.startswith("D3 ")}
    assert sorted(d3) == sorted(DECODE_VARIANTS)
    assert (d3["none"].keys_read, d3["mask"].keys_read, d3["paged"].decode.page) == (4096, 3584, 256)
    assert (d3["mask"].workload.mask, d3["cache_seqlens"].workload.mask) == ("per_key", "none")
    cpu = load_peer_workloads(DEFAULT_WORKLOADS.with_name("peers-decode-cpu.yaml"))
    assert {w.decode.lengths for w in cpu} == set(DECODE_VARIANTS) and {w.workload.dtype for w in cpu} == {"fp32"}
    assert max(w.workload.seqlen_k * w.workload.batch for w in cpu) <= 256


@pytest.mark.parametrize("change, message", [
    ({"seqlen_q": 65}, "seqlen_q: got 65, expected at most 64"),
    ({"seqlen_k": 0}, "seqlen_k: got 0, expected a positive integer"),
    ({"head_dim": 12}, "head_dim: got 12, expected a multiple of 8"),
    ({"filled": 1.5}, "filled: got 1.5, expected the fraction in (0, 1]"),
    ({"filled": "most"}, "filled: got 'most'"),
    ({"lengths": ["none", "ragged"]}, "lengths: got ['none', 'ragged'], expected a list of distinct variants"),
    ({"lengths": ["mask", "mask"]}, "lengths: got ['mask', 'mask']"),
    ({"lengths": []}, "lengths: got []"),
    ({"page": 24}, "page: got 24, expected a multiple of 16 that divides seqlen_k=48"),
    ({"page": 32}, "page: got 32, expected a multiple of 16 that divides seqlen_k=48"),
    ({"lengths": ["none", "mask"]}, "page: given without the paged variant"),
    ({"dtype": "bf8"}, "dtype: got 'bf8'"),
    ({"heads_kv": 3}, "heads_kv=3 does not divide heads=4"),
])
def test_malformed_decode_workloads_are_rejected_in_one_line_naming_file_and_field(tmp_path, change, message):
    path = _write(tmp_path, dict(TINY_DECODE, **change))
    with pytest.raises(ValueError) as raised:
        load_peer_workloads(path)
    text = str(raised.value)
    assert text.startswith(f"{path}:workloads[0]") and message in text and "\n" not in text, text


def test_a_decode_entry_without_its_page_or_with_a_prefill_key_names_what_is_expected(tmp_path):
    no_page = {key: value for key, value in TINY_DECODE.items() if key != "page"}
    with pytest.raises(ValueError, match=r"workloads\[0\]\.page: the paged variant needs the keys per page"):
        load_peer_workloads(_write(tmp_path, no_page))
    with pytest.raises(ValueError, match=r"expected keys .* \(prefill\) or .*'seqlen_q'.* \(decode\), got"):
        load_peer_workloads(_write(tmp_path, dict(TINY_DECODE, causal=True)))


def test_decode_inputs_give_ours_the_lengths_its_variant_names_and_the_peers_a_padding_mask(tmp_path):
    by_variant = {pw.decode.lengths: pw for pw in load_peer_workloads(_write(tmp_path, TINY_DECODE))}
    filled = 36
    for variant, pw in by_variant.items():
        inputs = build_bench_inputs(pw, "cpu")
        ours = inputs.decode
        assert torch.isfinite(inputs.k).all() and torch.isfinite(inputs.v).all()  # the peers' copy is clean
        if variant == "none":
            assert inputs.mask is None and ours.mask is None and ours.cache_seqlens is None
            continue
        assert inputs.mask.shape == (2, 1, 1, 48)
        assert inputs.mask[..., :filled].all() and not inputs.mask[..., filled:].any()
        if variant == "mask":
            assert ours.mask is inputs.mask and ours.cache_seqlens is None and ours.k is inputs.k
            continue
        assert ours.mask is None and ours.cache_seqlens.tolist() == [filled, filled]
        if variant == "paged":
            assert ours.k.shape[1:] == (16, 2, 16) and ours.block_table.shape == (2, 3)
            blocks = ours.block_table.flatten().tolist()
            assert len(set(blocks)) == 6 and all(0 <= block < ours.k.shape[0] for block in blocks)
            k_cache, v_cache = (pool[ours.block_table.long()].flatten(1, 2) for pool in (ours.k, ours.v))
        else:
            k_cache, v_cache = ours.k, ours.v
        assert torch.equal(k_cache[:, :filled], inputs.k[:, :filled])
        assert torch.equal(v_cache[:, :filled], inputs.v[:, :filled])
        assert k_cache[:, filled:].isnan().all() and v_cache[:, filled:].isnan().all()  # a tail never to be read


def test_kv_bandwidth_fraction_is_the_kv_bytes_over_gpu_time_over_the_copy_rate(tmp_path):
    by_variant = {pw.decode.lengths: pw for pw in load_peer_workloads(_write(tmp_path, dict(TINY_DECODE,
                                                                                             dtype="fp16")))}
    # K and V of B2 Hkv2 D16 in fp16 (2 bytes): all 48 keys with no length, the 36 filled ones otherwise
    assert kv_bytes(by_variant["none"]) == 2 * 2 * 48 * 2 * 16 * 2 == 12288
    assert kv_bytes(by_variant["mask"]) == kv_bytes(by_variant["paged"]) == 2 * 2 * 36 * 2 * 16 * 2 == 9216
    # 9216 bytes in 0.5 ms is 18.432 MB/s: 18.432% of a 1e8 B/s copy
    assert kv_bandwidth_fraction(by_variant["mask"], 0.5, 1e8) == pytest.approx(0.18432)
    assert kv_bandwidth_fraction(by_variant["none"], 2.0, 1e7) == pytest.approx(12288 / 2e-3 / 1e7)
    assert kv_bandwidth_fraction(by_variant["mask"], 0.5, None) is None  # no copy measured (the CPU)
    prefill = load_peer_workloads(_write(tmp_path, TINY))[0]
    assert kv_bandwidth_fraction(prefill, 0.5, 1e8) is None  # a prefill row is bound by compute
    # the floor's bytes read the filled keys too, and the mask variant its (B, 1, 1, Lk) mask
    q_out_lse = 2 * (2 * 1 * 4 * 16 * 2) + 2 * 4 * 1 * 4
    assert bytes_needed(by_variant["none"], "fwd") == q_out_lse + 12288
    assert bytes_needed(by_variant["mask"], "fwd") == q_out_lse + 9216 + 2 * 48


def test_a_decode_bench_checks_every_variant_of_ours_against_the_reference(tmp_path):
    workloads = load_peer_workloads(_write(tmp_path, TINY_DECODE))
    rows = run_bench(workloads, ["dmattn", "sdpa-math"], "cpu", repeats=3, copy_bytes_per_s=1e9)
    assert [(r.workload, r.peer, r.direction) for r in rows] == [
        (f"T3 decode {variant}", peer, "fwd") for variant in DECODE_VARIANTS for peer in ("dmattn", "sdpa-math")]
    ours = {r.workload.split()[-1]: r for r in rows if r.peer == "dmattn"}
    assert all(r.status == "ok" for r in rows), [r.error for r in rows]
    assert all(0 <= r.error_over_bound <= 1 for r in ours.values()), {v: r.error_over_bound for v, r in ours.items()}
    assert all(r.note.startswith("triton short-query fwd ") for r in ours.values())
    for pw in workloads:
        row = ours[pw.decode.lengths]
        assert row.kv_bandwidth_fraction == pytest.approx(kv_bytes(pw) / (row.median_ms * 1e-3) / 1e9)
    # SDPA with the padding as a float mask computes what ours does, from the clean cache
    assert all(r.max_abs_diff_vs_ours < 1e-5 for r in rows if r.peer == "sdpa-math")


def test_the_reference_check_fails_ours_when_it_reads_keys_past_the_lengths(tmp_path, monkeypatch):
    """Ours told nothing (no mask, no cache_seqlens) reads the whole cache: its clean tail
    changes the answer, its NaN tail makes it non-finite. Either fails the row, untimed."""
    def told_nothing(inputs, table):
        blind = dataclasses.replace(inputs.decode, mask=None, cache_seqlens=None, block_table=None)
        if inputs.decode.block_table is not None:  # the pool's pages in table order: the NaN-tailed cache
            pool = inputs.decode.block_table.long()
            blind = dataclasses.replace(blind, k=inputs.decode.k[pool].flatten(1, 2),
                                        v=inputs.decode.v[pool].flatten(1, 2))
        return peers._ours(dataclasses.replace(inputs, decode=blind), table)

    monkeypatch.setitem(peers.PEERS, "dmattn", told_nothing)
    rows = run_bench(load_peer_workloads(_write(tmp_path, TINY_DECODE)), ["dmattn"], "cpu", repeats=3)
    by_variant = {r.workload.split()[-1]: r for r in rows}
    assert by_variant["none"].status == "ok"  # nothing to be told: the same call
    mask = by_variant["mask"]
    assert mask.status == "error" and mask.error.startswith("against the reference, out: error ")
    assert mask.error_over_bound > 1 and mask.median_ms is None
    for variant in ("cache_seqlens", "paged"):
        row = by_variant[variant]
        assert row.status == "error", variant
        assert re.fullmatch(r"against the reference, out: \d+ non-finite element\(s\)", row.error), row.error
        assert row.error_over_bound is None and row.median_ms is None


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
    pw = load_peer_workloads(DEFAULT_WORKLOADS, names=["W3"])[0]
    w = pw.workload
    qkvo = 4 * 2 * 4096 * 16 * 128 * 2  # q, k, v, out in bf16
    lse = 2 * 16 * 4096 * 4
    assert bytes_needed(pw, "fwd") == qkvo + lse
    compute_bound = DevicePeaks(tensor_flops=1e12, hbm_bytes_per_s=1e15)
    memory_bound = DevicePeaks(tensor_flops=1e18, hbm_bytes_per_s=1e9)
    assert floor_ms(pw, "fwd", compute_bound) == pytest.approx(1e3 * w.flops("fwd") / 1e12)
    assert floor_ms(pw, "fwd", memory_bound) == pytest.approx(1e3 * (qkvo + lse) / 1e9)
    assert floor_ms(pw, "fwd", None) is None
    # W1: the mask (1 byte) and the bias (bf16) are needed over the causal part only; the
    # backward reads them again and writes dBias over the same part
    w1 = load_peer_workloads(DEFAULT_WORKLOADS, names=["W1"])[0]
    causal = w1.workload.visible_pairs() / 4096**2
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


def test_decode_bench_command_defaults_to_the_decode_peers_and_renders_forward_rows(tmp_path):
    entry = {key: value for key, value in TINY_DECODE.items() if key != "page"}
    path = _write(tmp_path, dict(entry, lengths=["none", "cache_seqlens"]))
    result = CliRunner().invoke(bench, ["--workloads", path, "--repeats", "3", "--format", "json"])
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    rows = document["rows"]
    assert [r["peer"] for r in rows[:4]] == ["dmattn", *peers.DECODE_PEERS]
    assert {r["direction"] for r in rows} == {"fwd"} and len(rows) == 2 * 4
    assert document["copy_bytes_per_s"] is None  # no copy rate off a GPU: the column stays empty
    assert all(r["kv_bandwidth_fraction"] is None for r in rows)
    # SDPA flash reads every key: the same function as ours only where nothing is padded
    flash = {r["workload"]: r for r in rows if r["peer"] == "sdpa-flash-dense"}
    assert flash["T3 decode none"]["max_abs_diff_vs_ours"] < 1e-5 and "enable_gqa" in flash["T3 decode none"]["note"]
    assert flash["T3 decode cache_seqlens"]["max_abs_diff_vs_ours"] is None
    report = tmp_path / "report.json"
    report.write_text(result.stdout)
    rendered = CliRunner().invoke(bench, ["--from-json", str(report), "--format", "markdown"])
    assert rendered.exit_code == 0, rendered.output
    assert "| T3 decode cache_seqlens | fwd | dmattn | ok |" in rendered.stdout and "fwd+bwd" not in rendered.stdout
    assert "36 of 48 keys filled, told by cache_seqlens" in rendered.stdout
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


def test_bench_times_only_the_directions_asked_for(tmp_path):
    """--direction fwd skips the forward+backward rows (a forward experiment's device time); a
    decode step asked for fwd+bwd alone has nothing to time: a one-line usage error."""
    result = CliRunner().invoke(bench, ["--workloads", _write(tmp_path, TINY), "--peers", "sdpa-math",
                                        "--direction", "fwd", "--repeats", "3", "--format", "json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)["rows"]
    assert [(r["peer"], r["direction"], r["status"]) for r in rows] == [("dmattn", "fwd", "ok"),
                                                                         ("sdpa-math", "fwd", "ok")]
    assert rows[1]["ours_over_peer_gpu"] is not None
    decode = CliRunner().invoke(bench, ["--workloads", _write(tmp_path, TINY_DECODE), "--direction", "fwd+bwd"])
    assert decode.exit_code == 2
    assert "decode steps time the forward alone (T3 decode" in decode.output and "Traceback" not in decode.output


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
            Row("W", "flex", "fwd+bwd", "ok", median_ms=0.5, max_abs_diff_vs_ours=1e-3, setup_ms=20.0),
            Row("D", "dmattn", "fwd", "ok", median_ms=0.02, kv_bandwidth_fraction=0.853, error_over_bound=0.0412)]
    lines = markdown(_document(rows)).splitlines()
    header = lines.index(next(line for line in lines if line.startswith("| workload")))
    table = lines[header:header + 2 + len(rows)]
    assert [cell.strip().replace("\\|", "|") for cell in _cells(table[0])] == list(COLUMNS)
    assert {"gpu ms", "host ms", "wall ms", "ours/peer gpu", "ours/peer wall"} <= set(COLUMNS)
    assert all(len(_cells(line)) == len(COLUMNS) for line in table), table
    assert "| W | fwd | dmattn | ok | 0.500 | 1.0% | 0.300 | 0.800 |" in table[2]
    assert "20 back-to-back calls" in "\n".join(lines[:header])
    decode = [cell.strip() for cell in _cells(table[-1])]
    assert (decode[COLUMNS.index("K/V BW")], decode[COLUMNS.index("err/bound")]) == ("85%", "0.041")


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


def _saved_report(tmp_path, name: str, workload: str, device: str = "NVIDIA H200") -> str:
    """A `--format json` report of one workload's ours and flex forward rows, as a run writes it."""
    rows = [Row(workload, "dmattn", "fwd", "ok", median_ms=0.5, wall_ms=0.6),
            Row(workload, "flex", "fwd", "ok", median_ms=0.6, wall_ms=0.7)]
    fill_ratios(rows)
    document = {"command": f"dmattn-bench bench --only {workload}", "device": device, "software": "torch 2.11",
                "peaks": None, "repeats": 20, "eager_loop": {"calls": 20, "loops": 15}, "copy_bytes_per_s": None,
                "timings_meaningful": True, "workloads": [f"{workload}: bf16"],
                "rows": [row.to_dict() for row in rows]}
    path = tmp_path / name
    path.write_text(json.dumps(document))
    return str(path)


def test_bench_renders_the_reports_of_split_runs_as_one(tmp_path):
    first, second = _saved_report(tmp_path, "a.json", "packed-causal"), _saved_report(tmp_path, "b.json", "window")
    rendered = CliRunner().invoke(bench, ["--from-json", first, "--from-json", second, "--format", "json"])
    assert rendered.exit_code == 0, rendered.output
    document = json.loads(rendered.stdout)
    assert [(r["workload"], r["peer"]) for r in document["rows"]] == [
        ("packed-causal", "dmattn"), ("packed-causal", "flex"), ("window", "dmattn"), ("window", "flex")]
    assert document["workloads"] == ["packed-causal: bf16", "window: bf16"]
    assert document["command"] == "dmattn-bench bench --only packed-causal; dmattn-bench bench --only window"
    assert all(r["ours_over_peer_gpu"] == pytest.approx(0.5 / 0.6) for r in document["rows"] if r["peer"] == "flex")
    other = _saved_report(tmp_path, "c.json", "window", device="NVIDIA H100 80GB HBM3")
    mixed = CliRunner().invoke(bench, ["--from-json", first, "--from-json", other])
    assert mixed.exit_code == 2
    assert "c.json: its device 'NVIDIA H100 80GB HBM3' differs from" in mixed.output


def test_an_interrupted_bench_reports_the_rows_that_finished(tmp_path, monkeypatch):
    """Ctrl-C or SIGTERM (a `timeout`) while a peer runs: the report holds ours' rows, says it was
    interrupted, and the command exits 130 with how to run the rest."""
    from dmattn_bench.bench import harness
    from dmattn_bench.cli.bench import BenchStopped

    measure = harness._measure_peer

    def stopped_at_the_second_peer(pw, peer, *args, **kwargs):
        if peer != "dmattn":
            raise KeyboardInterrupt
        return measure(pw, peer, *args, **kwargs)

    monkeypatch.setattr(harness, "_measure_peer", stopped_at_the_second_peer)
    path = _write(tmp_path, TINY)
    result = CliRunner().invoke(bench, ["--workloads", path, "--peers", "sdpa-efficient", "--repeats", "3",
                                        "--format", "json"])
    assert isinstance(result.exception, BenchStopped) and result.exception.exit_code == 130
    assert "--only" in result.exception.one_line()
    document = json.loads(result.stdout)
    assert document["interrupted"] == "interrupted after 2 of 4 rows"
    assert [(r["peer"], r["direction"], r["status"]) for r in document["rows"]] == [
        ("dmattn", "fwd", "ok"), ("dmattn", "fwd+bwd", "ok")]
    report = tmp_path / "partial.json"
    report.write_text(result.stdout)
    rendered = CliRunner().invoke(bench, ["--from-json", str(report), "--format", "markdown"])
    assert rendered.exit_code == 0, rendered.output  # rendering a partial report is no interruption
    assert "**Interrupted**: interrupted after 2 of 4 rows" in rendered.stdout


def test_sigterm_stops_the_bench_as_ctrl_c_does():
    import os
    import signal

    from dmattn_bench.cli.bench import _sigterm_as_interrupt

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt):
        with _sigterm_as_interrupt():
            os.kill(os.getpid(), signal.SIGTERM)
    assert signal.getsignal(signal.SIGTERM) is before


# -- the shape sweep (issue 58) ----------------------------------------------------------------------


def test_a_grid_entry_is_the_product_of_its_lists_named_by_what_sets_each_apart(tmp_path):
    grid = {"name": "g", "tokens": 8192, "heads": 8, "head_dim": [64, 96], "causal": [True, False], "gqa": [1, 4],
            "seqlen": [1024, 16384], "dtype": ["bf16"],
            "variants": [{"mask": "none", "bias": "none"},
                         {"mask": {"kind": "kv_head", "keep": {"top_k": 512}}, "bias": {"kind": "per_key", "grad": True}}]}
    path = tmp_path / "grid.yaml"
    path.write_text(yaml.safe_dump({"workloads": [{"grid": grid}]}))
    workloads = load_peer_workloads(path)
    assert len(workloads) == 2 * 2 * 2 * 2 * 2 == len({w.name for w in workloads})
    first = workloads[0].workload
    assert workloads[0].name == "g D64 causal gqa1 L1024 none/none bf16"
    assert (first.batch, first.heads, first.heads_kv, first.seqlen_q, first.head_dim) == (8, 8, 8, 1024, 64)
    last = workloads[-1]
    assert last.name == "g D96 full gqa4 L16384 kv_head top_k=512/per_key+grad bf16"
    assert (last.workload.batch, last.workload.heads_kv, last.workload.causal) == (1, 2, False)  # at least one sequence
    assert (last.workload.mask, last.workload.bias, last.workload.bias_grad, last.keep) == (
        "kv_head", "per_key", True, ("top_k", 512))
    # --dtype runs the grid in another dtype: the names say so
    assert {w.name.split()[-1] for w in load_peer_workloads(path, dtype="fp16")} == {"fp16"}
    # two workloads of one name would pair their rows with each other's: refused
    path.write_text(yaml.safe_dump({"workloads": [{"grid": grid}, {"grid": grid}]}))
    with pytest.raises(ValueError, match="two workloads are named 'g D64 causal gqa1 L1024 none/none bf16'"):
        load_peer_workloads(path)


@pytest.mark.parametrize("change, message", [
    ({"gqa": [3]}, r"grid\.gqa: 3 does not divide heads=8"),
    ({"seqlen": []}, r"grid\.seqlen: expected a non-empty list"),
    ({"width": 3}, r"grid: expected keys .* got .*width"),
    ({"variants": [{"mask": "none"}]}, r"grid\.variants: each is \{mask, bias\}"),
    ({"variants": [{"mask": {"kind": "full", "keep": {"top_k": 4}}, "bias": "none"}]}, r"needs a bias"),
    ({"variants": [{"mask": {"kind": "per_key", "keep": {"top_k": 4}}, "bias": {"kind": "full", "grad": True}}]},
     r"a per_key mask ranks the keys by a per_key bias, got bias full"),
    ({"variants": [{"mask": {"keep": {"top_k": 4}}, "bias": {"kind": "full", "grad": True}}]}, r"mask: got"),
])
def test_a_bad_grid_is_a_one_line_error_naming_the_key(tmp_path, change, message):
    grid = dict({"name": "g", "tokens": 8192, "heads": 8, "head_dim": [64], "causal": [True], "gqa": [1],
                 "seqlen": [1024], "dtype": ["bf16"], "variants": [{"mask": "none", "bias": "none"}]}, **change)
    path = tmp_path / "grid.yaml"
    path.write_text(yaml.safe_dump({"workloads": [{"grid": grid}]}))
    with pytest.raises(ValueError, match=message) as raised:
        load_peer_workloads(path)
    assert "\n" not in str(raised.value)


def test_the_sweep_covers_the_issue_s_head_dims_causality_kinds_gqa_lengths_and_dtypes():
    workloads = [w.workload for w in load_peer_workloads("configs/workloads/sweep.yaml")]
    assert {w.head_dim for w in workloads} == {64, 80, 96, 128, 192, 256}
    assert {w.causal for w in workloads} == {True, False}
    assert {w.heads // w.heads_kv for w in workloads} >= {1, 4, 8}
    assert {w.seqlen_q for w in workloads} >= {1024, 4096, 16384}
    assert {w.dtype for w in workloads} == {"bf16", "fp16"}
    assert {(w.mask, w.bias) for w in workloads} >= {("none", "none"), ("full", "full"), ("kv_head", "per_key"),
                                                      ("kv_head", "kv_head"), ("per_key", "per_key"),
                                                      ("none", "per_key"), ("none", "full")}
    assert {w.bias_grad for w in workloads if w.bias != "none"} == {True, False}


def test_the_standing_against_each_peer_is_the_geomean_and_the_workloads_ours_loses():
    rows = [Row(name, peer, "fwd", "ok", median_ms=ms, wall_ms=ms * 2)
            for name, ours, flex in (("A", 1.0, 2.0), ("B", 1.0, 0.5), ("C", 3.0, 2.0))
            for peer, ms in (("dmattn", ours), ("flex", flex))]
    rows.append(Row("D", "flex", "fwd", "error", error="no valid triton configs"))
    fill_ratios(rows)
    figures = standing(rows)["flex"]["fwd"]
    assert figures["workloads"] == 3 and figures["geomean_gpu"] == pytest.approx((0.5 * 2.0 * 1.5) ** (1 / 3), abs=1e-4)
    assert figures["geomean_wall"] == figures["geomean_gpu"]
    assert figures["losing"] == [["B", 2.0], ["C", 1.5]]  # worst first
    assert "dmattn" not in standing(rows)
    text = markdown(_document(rows))
    assert "- flex fwd: 1.14x gpu, 1.14x wall over 3 workloads; ours slower on: B (2.00x), C (1.50x)" in text


def test_a_per_key_mask_is_one_row_keeping_the_highest_bias_keys_of_all(tmp_path):
    """(B, 1, 1, Lk), ranked by the first KV head's per-key bias over every key (no causal
    prefix: one row serves every query), and under causal the first key kept (no row is dead)."""
    path = tmp_path / "w.yaml"
    path.write_text(yaml.safe_dump({"workloads": [{
        "name": "pk", "batch": 2, "heads": 4, "heads_kv": 2, "seqlen": 64, "head_dim": 32, "causal": True,
        "dtype": "fp32", "bias": {"kind": "per_key", "grad": True}, "mask": {"kind": "per_key", "keep": {"top_k": 24}}}]}))
    (workload,) = load_peer_workloads(path)
    inputs = build_bench_inputs(workload, "cpu")
    assert inputs.mask.shape == (2, 1, 1, 64) and inputs.mask[..., 0].all()  # causal: row 0's one key stays
    for b in range(2):
        row, bias = inputs.mask[b, 0, 0, 1:], inputs.bias.detach()[b, 0, 0, 1:]
        assert 23 <= int(row.sum()) <= 24 and bias[row].min() > bias[~row].max()
