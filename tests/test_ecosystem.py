"""Fitting the ecosystem: torch.compile with no graph break, CUDA-graph capture (GPU), and the
README's usage examples, which run here exactly as written: every python block of the README is
an example named by its first line (`# example: <name>`), and every example runs in a test."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from dmattn_bench import dispatch, flash_dmattn_func, tiles
from dmattn_bench.hardware import CPU_FINGERPRINT
from dmattn_bench.space import FwdConfig, TableKey
from dmattn_bench.tuning import table_writer as writer

README = Path(__file__).resolve().parents[1] / "README.md"
PYTHON_BLOCK = re.compile(r"```python\n(.*?)```", re.S)
EXAMPLE_NAME = re.compile(r"# example: (\S+)\n")


def readme_blocks() -> list[str]:
    """Every python code block of the README, in order."""
    return PYTHON_BLOCK.findall(README.read_text())


def example_name(block: str) -> str | None:
    """The name a block's first line gives it (`# example: <name>`), None without one."""
    match = EXAMPLE_NAME.match(block)
    return match.group(1) if match else None


def readme_example(name: str) -> str:
    """The README code block that starts with `# example: <name>`."""
    matches = [b for b in readme_blocks() if example_name(b) == name]
    assert len(matches) == 1, f"README has {len(matches)} '# example: {name}' blocks"
    return matches[0]


# Examples that need a fixture of their own, each with the test that runs it; every other example
# runs as it stands in `test_readme_example_runs`, so a new block is tested once it has a name.
SPECIAL_EXAMPLES = {"tune": "test_readme_tune_example_selects_the_table"}
GENERIC_EXAMPLES = sorted({name for name in map(example_name, readme_blocks())
                           if name is not None and name not in SPECIAL_EXAMPLES})
# What an example imports that the CPU tier may lack: its test is skipped without it.
EXAMPLE_NEEDS = {"transformers": "transformers"}


def _inputs(requires_grad: bool = True, device: str = "cpu", dtype=torch.float32):
    torch.manual_seed(0)
    q = torch.randn(1, 20, 4, 32, device=device, dtype=dtype, requires_grad=requires_grad)
    k = torch.randn(1, 20, 2, 32, device=device, dtype=dtype, requires_grad=requires_grad)
    v = torch.randn(1, 20, 2, 32, device=device, dtype=dtype, requires_grad=requires_grad)
    mask = torch.rand(1, 2, 20, 20, device=device) > 0.3
    bias = torch.randn(1, 2, 1, 20, device=device, dtype=dtype, requires_grad=requires_grad)
    return q, k, v, mask, bias


def _attention(q, k, v, mask, bias):
    return flash_dmattn_func(q, k, v, mask, bias, is_causal=True)


def test_fullgraph_compile_has_no_graph_break_and_matches_eager():
    inputs = _inputs()
    explanation = torch._dynamo.explain(_attention)(*inputs)
    assert explanation.graph_count == 1 and explanation.graph_break_count == 0, explanation.break_reasons
    compiled = torch.compile(_attention, fullgraph=True, backend="aot_eager")
    out, expected = compiled(*inputs), _attention(*inputs)
    assert torch.equal(out, expected)
    wrt = (inputs[0], inputs[1], inputs[2], inputs[4])
    for got, want in zip(torch.autograd.grad(out.sum(), wrt), torch.autograd.grad(expected.sum(), wrt)):
        assert torch.equal(got, want)


def test_custom_op_passes_torch_opcheck():
    q, k, v, mask, bias = (t.detach() for t in _inputs())
    args = (q, k, v, mask, bias, True, 32 ** -0.5, 0.0, "auto", None, None, None)
    torch.library.opcheck(torch.ops.dmattn_bench.attention_fwd.default, args,
                          test_utils=("test_schema", "test_faketensor"))


def test_every_readme_python_block_is_a_named_example_with_a_test():
    """A named block runs in `test_readme_example_runs` unless a test of its own runs it
    (`SPECIAL_EXAMPLES`), so an unnamed block is the one way an example escapes CI."""
    blocks = readme_blocks()
    names = [example_name(block) for block in blocks]
    unnamed = [block.splitlines()[0] if block else "(empty)" for block, name in zip(blocks, names) if name is None]
    assert not unnamed, f"README python blocks without a '# example: <name>' first line, starting: {unnamed}"
    duplicates = sorted({name for name in names if names.count(name) > 1})
    assert not duplicates, f"README example names used twice: {duplicates}"
    missing = sorted(set(SPECIAL_EXAMPLES) - set(names))
    assert not missing, f"tests for README examples the README no longer has: {missing}"
    assert all(callable(globals().get(test)) for test in SPECIAL_EXAMPLES.values())


@pytest.mark.parametrize("name", GENERIC_EXAMPLES)
def test_readme_example_runs(name):
    if name in EXAMPLE_NEEDS:
        pytest.importorskip(EXAMPLE_NEEDS[name])
    exec(compile(readme_example(name), f"README.md:{name}", "exec"), {})


def test_readme_tune_example_selects_the_table(tmp_path, monkeypatch):
    key = TableKey("fwd", "fp32", 32, True, "none", "none", 2, 16, 16)
    chosen = FwdConfig(32, 16, 1, 1)
    writer.dump_table(writer.new_table([dispatch.Entry(key, "triton", chosen, {})], CPU_FINGERPRINT, True),
                        tmp_path / "my-gpu.yaml")
    monkeypatch.chdir(tmp_path)
    try:
        exec(compile(readme_example("tune"), "README.md:tune", "exec"), {})
        assert tiles.choose(key, "cpu").config == chosen
    finally:
        dispatch.use_table(None)


@pytest.mark.gpu
def test_cuda_graph_replay_of_the_forward_equals_eager():
    """The forward captured in a CUDA graph (serving) replays bitwise equal to eager."""
    q, k, v, mask, bias = (t.detach() for t in _inputs(device="cuda", dtype=torch.bfloat16))

    def step():
        return _attention(q, k, v, mask, bias)

    eager = step()  # also warms up: kernels compiled, configs chosen before capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    q.copy_(torch.randn_like(q))  # new inputs in the static buffers: the replay must follow them
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, step())
    assert not torch.equal(captured, eager)


@pytest.mark.gpu
def test_cuda_graph_replay_of_a_training_step_equals_eager():
    """Forward and backward captured together (training) replay bitwise equal to eager.

    PyTorch's whole-network recipe: the leaves are first used on a side stream (warm-up), so
    their autograd nodes never hold the legacy default stream; a warm-up on the default stream
    makes the captured backward fail with "operation would make the legacy stream depend on a
    capturing blocking stream" (pytorch/pytorch#164302), whatever the op.
    """
    static = [t.detach().requires_grad_(t.requires_grad)
              for t in _inputs(device="cuda", dtype=torch.bfloat16)]
    q, k, v, mask, bias = static
    grad_out = torch.randn(q.shape, device="cuda", dtype=q.dtype)
    leaves = (q, k, v, bias)

    def train_step():
        for leaf in leaves:
            leaf.grad = None
        _attention(q, k, v, mask, bias).backward(grad_out)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            train_step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        train_step()
    captured_grads = [leaf.grad for leaf in leaves]  # live in the graph's pool; replay refills them

    with torch.no_grad():
        for leaf in leaves:
            leaf.copy_(torch.randn_like(leaf))
        grad_out.copy_(torch.randn_like(grad_out))
    graph.replay()
    torch.cuda.synchronize()
    fresh = [t.detach().clone().requires_grad_(t.requires_grad) for t in static]
    _attention(*fresh).backward(grad_out)
    for name, captured, leaf in zip(("dq", "dk", "dv", "dbias"), captured_grads, (fresh[0], fresh[1], fresh[2], fresh[4])):
        assert torch.equal(captured, leaf.grad), name


def test_the_readme_points_to_the_contract_in_the_repository():
    """Issue 54: the README named `../shared/DESIGN.md`, a file in neither the clone nor the wheel."""
    text = README.read_text()
    assert "../shared" not in text and "docs/CONTRACT.md" in text
    contract = README.parent / "docs" / "CONTRACT.md"
    assert "DMATTN_BENCH_CHECK_PAGES" in contract.read_text()
