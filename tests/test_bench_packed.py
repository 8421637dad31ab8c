"""`dmattn-bench bench` on packed documents and sliding windows (issue 56), on the CPU: the kept-pair
count against brute force, the workload files, the packed inputs, FlexAttention's document
mask_mod, the FLOP convention, the per-document reference, and the bench run and command (ours
stood in for by the reference until the varlen kernel and the window land; then the real one)."""

from __future__ import annotations

import inspect
import json

import pytest
import torch
import yaml
from click.testing import CliRunner

import dmattn_bench
from dmattn_bench.bench import packed, packed_peers
from dmattn_bench.bench.harness import build_bench_inputs, load_peer_workloads, run_bench
from dmattn_bench.bench.peers import PACKED_PEERS, Prepared, parse_peers
from dmattn_bench.cli.bench import bench
from dmattn_bench.reference import attention
from dmattn_bench.space import CONFIGS_DIR

WORKLOADS = CONFIGS_DIR / "workloads"
PACKED = {"name": "P1 packed", "heads": 4, "heads_kv": 2, "head_dim": 16, "dtype": "fp32", "documents": [9, 1, 14, 5],
          "causal": True, "bias": {"kind": "per_key", "grad": True}, "mask": {"kind": "kv_head", "drop": 0.3}}
WINDOW = {"name": "P2 window", "batch": 2, "seqlen": 20, "heads": 4, "heads_kv": 2, "head_dim": 16, "dtype": "fp32",
          "window": [5, 0], "causal": True, "bias": {"kind": "per_key", "grad": True}, "mask": "none"}


def _write(tmp_path, *entries) -> str:
    path = tmp_path / "packed.yaml"
    path.write_text(yaml.safe_dump({"workloads": list(entries)}))
    return str(path)


def _brute_visible(documents, causal, window) -> torch.Tensor:
    """(total, total) bool, one pair at a time: same document, causal rule, window."""
    doc = [d for d, n in enumerate(documents) for _ in range(n)]
    left, right = window
    total = len(doc)
    visible = torch.zeros(total, total, dtype=torch.bool)
    for i in range(total):
        for j in range(total):
            visible[i, j] = (doc[i] == doc[j] and (not causal or j <= i) and (left < 0 or j >= i - left)
                             and (right < 0 or j <= i + right))
    return visible


def _expanded_mask(mask: torch.Tensor, documents) -> torch.Tensor:
    """A per-row mask (heads, total, max_seqlen) as (heads, total, total): key j of row i's document
    at its token; keys of other documents False."""
    heads, total = mask.shape[0], mask.shape[1]
    full = torch.zeros(heads, total, total, dtype=torch.bool)
    start = 0
    for length in documents:
        rows = slice(start, start + length)
        full[:, rows, rows] = mask[:, rows, :length]
        start += length
    return full


@pytest.mark.parametrize("documents", [(6,), (5, 1, 9, 3), (1, 1, 2)])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("window", [(-1, -1), (2, 0), (3, 1), (0, 0), (-1, 2), (0, -1)])
def test_kept_pairs_equal_a_brute_force_count(documents, causal, window):
    visible = _brute_visible(documents, causal, window)
    heads = 4
    assert packed.kept_pairs(documents, causal, window, heads) == heads * int(visible.sum())
    generator = torch.Generator().manual_seed(1)
    total, longest = sum(documents), max(documents)
    for mask_heads in (1, 2, 4):  # shared, per KV head (H4 / Hkv2), per query head
        mask = torch.rand(mask_heads, total, longest, generator=generator) > 0.4
        kept = _expanded_mask(mask, documents) & visible
        per_query_head = kept.repeat_interleave(heads // mask_heads, dim=0)  # query head h reads mask h // group
        assert packed.kept_pairs(documents, causal, window, heads, mask) == int(per_query_head.sum())


def test_shipped_packed_workloads_are_issue_56s():
    workloads = {w.name: w for w in load_peer_workloads(WORKLOADS / "packed.yaml")}
    assert list(workloads) == ["packed-causal", "packed-bias-mask", "window-1024", "window-1024-bias"]
    for w in workloads.values():
        assert (w.workload.dtype, w.workload.heads, w.workload.heads_kv, w.workload.head_dim) == ("bf16", 16, 4, 128)
        assert w.workload.causal and w.directions == ("fwd", "fwd+bwd")
    for name in ("packed-causal", "packed-bias-mask"):
        layout = workloads[name].layout
        assert layout.packed and len(layout.documents) == 8 and layout.total == 16384
        assert all(700 <= n <= 4096 for n in layout.documents) and layout.window == (-1, -1)
    assert workloads["packed-causal"].layout.drop is None and workloads["packed-causal"].workload.bias == "none"
    bias_mask = workloads["packed-bias-mask"]
    features = (bias_mask.workload.bias, bias_mask.workload.bias_grad, bias_mask.workload.mask)
    assert features == ("per_key", True, "kv_head")
    assert bias_mask.layout.drop == 0.1
    for name, bias in (("window-1024", "none"), ("window-1024-bias", "per_key")):
        w = workloads[name]
        assert not w.layout.packed and w.layout.documents == (8192, 8192) and w.layout.window == (1023, 0)
        assert w.workload.bias == bias and w.workload.bias_grad == (bias != "none") and w.layout.drop is None
    cpu = load_peer_workloads(WORKLOADS / "packed-cpu.yaml")
    assert {w.workload.dtype for w in cpu} == {"fp32"} and max(w.layout.total for w in cpu) <= 128
    assert all("packed" in w.name or "window" in w.name for w in [*workloads.values(), *cpu])


@pytest.mark.parametrize("entry, change, message", [
    (PACKED, {"documents": []}, "documents: got [], expected a non-empty list of token counts >= 1"),
    (PACKED, {"documents": [4, 0]}, "documents: got [4, 0]"),
    (PACKED, {"window": [3]}, "window: got [3], expected [left, right], two ints >= -1"),
    (PACKED, {"window": [-2, 0]}, "window: got [-2, 0]"),
    (PACKED, {"mask": {"kind": "kv_head", "drop": 1.0}}, "mask.drop: got 1.0, expected the fraction in [0, 1)"),
    (PACKED, {"mask": {"kind": "per_key", "drop": 0.1}}, "mask: got"),
    (PACKED, {"bias": {"kind": "full", "grad": True}}, "bias: got"),
    (PACKED, {"batch": 2}, "expected keys"),
    (PACKED, {"head_dim": 12}, "head_dim: got 12, expected a multiple of 8"),
    (PACKED, {"heads_kv": 3}, "heads_kv=3 does not divide heads=4"),
    (WINDOW, {"seqlen": 0}, "seqlen: got 0, expected a positive integer"),
])
def test_malformed_packed_workloads_are_rejected_in_one_line_naming_file_and_field(tmp_path, entry, change, message):
    path = _write(tmp_path, dict(entry, **change))
    with pytest.raises(ValueError) as raised:
        load_peer_workloads(path)
    text = str(raised.value)
    assert text.startswith(f"{path}:workloads[0]") and message in text and "\n" not in text, text


def test_packed_inputs_match_their_documents(tmp_path):
    pw, dense = load_peer_workloads(_write(tmp_path, PACKED, WINDOW))
    inputs = build_bench_inputs(pw, "cpu")
    assert inputs.cu_seqlens.dtype == torch.int32 and inputs.cu_seqlens.tolist() == [0, 9, 10, 24, 29]
    assert inputs.bounds() == [(0, 9), (9, 10), (10, 24), (24, 29)] and inputs.batch is None
    assert inputs.q.shape == (29, 4, 16) and inputs.k.shape == inputs.v.shape == (29, 2, 16)
    assert inputs.bias.shape == (2, 29) and inputs.bias.requires_grad
    assert inputs.mask.shape == (2, 29, 14) and inputs.mask.dtype == torch.bool
    position = packed.positions(pw.layout.documents)
    assert position.tolist() == [*range(9), 0, *range(14), *range(5)]
    assert inputs.mask[:, torch.arange(29), position].all()  # the diagonal kept
    visible = _brute_visible(pw.layout.documents, True, (-1, -1))
    dropped = (visible & ~_expanded_mask(inputs.mask, pw.layout.documents)[0]).sum() / visible.sum()
    assert 0.1 < dropped < 0.4  # about 0.3 of the keys off the diagonal: drop 0.3
    assert inputs.kept_pairs == packed.kept_pairs(pw.layout.documents, True, (-1, -1), 4, inputs.mask)
    assert inputs.visible_pairs == int(visible.sum())
    window = build_bench_inputs(dense, "cpu")
    assert window.cu_seqlens.tolist() == [0, 20, 40] and window.batch == 2 and window.mask is None
    assert window.q.shape == (40, 4, 16) and window.bias.shape == (2, 40) and window.window == (5, 0)


@pytest.mark.parametrize("entry", [PACKED, dict(WINDOW, mask={"kind": "full", "drop": 0.5})], ids=["packed", "dense"])
def test_flex_document_mask_mod_equals_the_brute_force_visibility(tmp_path, entry):
    """Evaluated on broadcasting index tensors, as FlexAttention's vmap evaluates it: on a packed
    workload (b = 0 always) and on a dense batch, every head."""
    (pw,) = load_peer_workloads(_write(tmp_path, entry))
    inputs = build_bench_inputs(pw, "cpu")
    layout = pw.layout
    batch = inputs.batch or 1
    seqlen = layout.total // batch
    doc_id, doc_start = packed_peers._doc_index(inputs)
    mask_mod = packed_peers.document_mask_mod(doc_id, doc_start, seqlen, True, layout.window, inputs.mask, 4)
    visible = _brute_visible(layout.documents, True, layout.window)
    per_head = _expanded_mask(inputs.mask, layout.documents) & visible
    group = 4 // inputs.mask.shape[0]
    rows, cols = torch.arange(seqlen)[:, None], torch.arange(seqlen)[None, :]
    for b in range(batch):
        for h in range(4):
            got = mask_mod(torch.tensor(b), torch.tensor(h), rows, cols)
            tokens = slice(b * seqlen, (b + 1) * seqlen)
            assert torch.equal(got, per_head[h // group, tokens, tokens]), (b, h)


def test_flops_follow_the_dense_convention_over_the_kept_pairs(tmp_path):
    """One causal document, no mask: the FLOPs of a W3-like dense workload (`Workload.flops`);
    fwd+bwd counts both directions, as the dense rows do."""
    entry = dict(PACKED, documents=[24], bias="none", mask="none")
    (pw,) = load_peer_workloads(_write(tmp_path, entry))
    inputs = build_bench_inputs(pw, "cpu")
    dense = pw.workload
    assert inputs.kept_pairs == 4 * 24 * 25 // 2
    assert packed.flops_needed(inputs, "fwd") == dense.flops("fwd") == 4 * 16 * inputs.kept_pairs
    assert packed.flops_needed(inputs, "fwd+bwd") == dense.flops("fwd") + dense.flops("bwd")
    masked = build_bench_inputs(load_peer_workloads(_write(tmp_path, PACKED))[0], "cpu")
    assert packed.flops_needed(masked, "fwd") == 4 * 16 * masked.kept_pairs
    # the dynamic mask's drops are not work: fewer pairs than the causal documents leave
    assert masked.kept_pairs < 4 * masked.visible_pairs


def test_per_document_reference_equals_one_dense_call_with_a_block_diagonal_mask(tmp_path):
    (pw,) = load_peer_workloads(_write(tmp_path, dict(PACKED, window=[4, 0])))
    inputs = build_bench_inputs(pw, "cpu")
    visible = _brute_visible(pw.layout.documents, True, (4, 0))
    mask = (_expanded_mask(inputs.mask, pw.layout.documents) & visible).unsqueeze(0)  # (1, Hkv, T, T)
    bias = inputs.bias.detach()[None, :, None, :]  # (1, Hkv, 1, T): key j's value for every row
    dense = attention(inputs.q[None], inputs.k[None], inputs.v[None], mask, bias, False)[0]
    assert torch.allclose(packed.reference_out(inputs), dense, atol=1e-12)


def _reference_ours(inputs, table) -> Prepared:
    """Stands in for ours: the reference per document in fp32, differentiable."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (inputs.q, inputs.k, inputs.v))
    bias = None if inputs.bias is None else inputs.bias.detach().clone().requires_grad_(inputs.bias.requires_grad)
    window = {} if inputs.window == (-1, -1) else {"window_size": inputs.window}

    def forward():
        outs = []
        for start, end in inputs.bounds():
            n = end - start
            mask = None if inputs.mask is None else inputs.mask[:, start:end, :n].unsqueeze(0)
            doc_bias = None if bias is None else bias[:, start:end][None, :, None, :]
            outs.append(attention(q[start:end][None], k[start:end][None], v[start:end][None], mask, doc_bias,
                                  inputs.is_causal, compute_dtype=torch.float32, **window)[0])
        return torch.cat(outs)

    return Prepared(forward, [q, k, v] + ([bias] if bias is not None and bias.requires_grad else []),
                    note="reference", layout="thd")


def test_a_packed_bench_times_ours_and_says_why_each_peer_cannot_run(tmp_path, monkeypatch):
    monkeypatch.setitem(packed_peers.PEERS, "dmattn", _reference_ours)
    causal = dict(PACKED, name="P0 packed causal", bias="none", mask="none")
    workloads = load_peer_workloads(_write(tmp_path, causal, PACKED, WINDOW))
    peers = parse_peers(",".join([*PACKED_PEERS, "sdpa-math"]))
    rows = run_bench(workloads, peers, "cpu", repeats=3)
    assert [(r.workload, r.peer) for r in rows[::2]] == [(w.name, p) for w in workloads for p in peers]
    by = {(r.workload, r.peer, r.direction): r for r in rows}
    for w in workloads:
        inputs = build_bench_inputs(w, "cpu")
        for direction in ("fwd", "fwd+bwd"):
            ours = by[(w.name, "dmattn", direction)]
            assert ours.status == "ok", ours.error
            assert ours.tflops == pytest.approx(packed.flops_needed(inputs, direction) / (ours.median_ms * 1e-3) / 1e12,
                                                rel=1e-5)
            assert ours.wall_ms > 0 and ours.ours_over_peer_gpu == 1.0
            for peer in ("flex", "flex-rebuild"):
                assert by[(w.name, peer, direction)].error == "needs a CUDA GPU (FlexAttention has no CPU backward)"
            sdpa_math = by[(w.name, "sdpa-math", direction)]
            assert sdpa_math.status == "error" and "not wired" in sdpa_math.error
        assert 0 <= by[(w.name, "dmattn", "fwd")].error_over_bound <= 1
    per_doc = by[("P0 packed causal", "sdpa-per-doc", "fwd")]
    assert per_doc.status == "ok" and per_doc.max_abs_diff_vs_ours < 1e-5 and per_doc.ours_over_peer_wall > 0
    assert by[("P0 packed causal", "varlen-attn", "fwd")].error.startswith("needs a CUDA GPU (")
    assert by[("P1 packed", "varlen-attn", "fwd")].error == "varlen_attn takes no mask and no bias"
    assert by[("P1 packed", "sdpa-per-doc", "fwd")].error == "SDPA's flash kernel takes no mask and no bias"
    assert by[("P2 window", "sdpa-per-doc", "fwd")].error.startswith("SDPA has no sliding window")


def test_packed_only_peers_say_so_on_a_dense_workload(tmp_path):
    dense = {"name": "T3 dense causal", "batch": 1, "heads": 2, "heads_kv": 2, "seqlen": 16, "head_dim": 16,
             "causal": True, "dtype": "fp32", "bias": "none", "mask": "none"}
    rows = run_bench(load_peer_workloads(_write(tmp_path, dense)), parse_peers("varlen-attn"), "cpu", repeats=3,
                     directions=("fwd",))
    assert rows[1].status == "error" and rows[1].error == "runs only packed-document and sliding-window workloads"


def test_bench_command_defaults_to_the_packed_peers(tmp_path, monkeypatch):
    monkeypatch.setitem(packed_peers.PEERS, "dmattn", _reference_ours)
    result = CliRunner().invoke(bench, ["--workloads", str(WORKLOADS / "packed-cpu.yaml"), "--only", "packed-causal",
                                        "--repeats", "3", "--format", "json"])
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    assert [r["peer"] for r in document["rows"][::2]] == ["dmattn", *PACKED_PEERS]
    assert document["workloads"] == ["packed-causal: fp32 4 documents [40, 7, 29, 20] = 96 tokens H4 gqa2 D32 causal "
                                     "mask=none bias=none"]
    assert {r["status"] for r in document["rows"] if r["peer"] in ("dmattn", "sdpa-per-doc")} == {"ok"}


def _has_varlen() -> bool:
    return hasattr(dmattn_bench, "flash_dmattn_varlen_func")


def _has_window() -> bool:
    return "window_size" in inspect.signature(dmattn_bench.flash_dmattn_func).parameters


@pytest.mark.parametrize("names, landed", [(["packed-"], _has_varlen), (["window-"], _has_window)],
                         ids=["varlen", "window"])
def test_our_kernel_runs_the_cpu_packed_workloads_within_the_bound(names, landed):
    """Ours as the bench prepares it, once per workload of packed-cpu.yaml (the bench's timing
    loops would only repeat the call): its forward within the DESIGN §2 bound, its backward finite."""
    if not landed():
        pytest.skip("flash_dmattn_varlen_func / window_size have not landed (issue 56)")
    for pw in load_peer_workloads(WORKLOADS / "packed-cpu.yaml", names=names):
        inputs = build_bench_inputs(pw, "cpu")
        prepared = packed_peers.PEERS["dmattn"](inputs, None)
        with torch.no_grad():
            check = packed.check_against_reference(prepared.forward(), inputs)
        assert check.passed, (pw.name, check.failure())
        prepared.forward().sum().backward()
        assert all(leaf.grad is not None and torch.isfinite(leaf.grad).all() for leaf in prepared.leaves), pw.name
        assert len(prepared.leaves) == 3 + (inputs.bias is not None)
