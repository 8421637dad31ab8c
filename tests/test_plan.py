"""Launch plans: what a call costs once its plan exists (launches, allocations, other ops), that a
plan is built once per signature and reused by the backward, and the public entry's rules for
inputs it used to accept silently."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from dmattn_bench import dispatch, flash_dmattn_func, plan, tiles
from dmattn_bench.registry import interpreter_enabled
import dmattn_kernels.runtime.launch_context as launch_context
import dmattn_kernels.triton.launch as launch
import dmattn_kernels.triton.launching as launching

pytestmark = pytest.mark.skipif(not interpreter_enabled(), reason="the CPU tier runs the kernels in the interpreter")

_ALLOCATIONS = {"aten.empty.memory_format", "aten.empty_strided.default", "aten.new_empty.default",
                "aten.zeros.default", "aten.zeros_like.default", "aten.empty_like.default", "aten.full.default"}
_VIEWS = {"aten.view.default", "aten.view.dtype", "aten.unsqueeze.default", "aten.detach.default",
          "aten.expand.default", "aten.unflatten.int", "aten._unsafe_view.default", "aten.as_strided.default",
          "aten.t.default", "aten.transpose.int", "aten.alias.default", "aten.slice.Tensor"}


class _Ops(TorchDispatchMode):
    """The aten ops a call issues, views left out (they launch and allocate nothing)."""

    def __init__(self):
        super().__init__()
        self.allocations, self.other = [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if name in _ALLOCATIONS:
            self.allocations.append(name)
        elif name not in _VIEWS:
            self.other.append(name)
        return func(*args, **(kwargs or {}))


@pytest.fixture
def counted(monkeypatch):
    """Runs a callable and returns (Triton kernels launched, allocations, other aten ops). The
    interpreter's own tensor traffic inside a kernel launch is not the call's, so it is hidden."""
    launched = []
    monkeypatch.setattr(launch_context, "LAUNCH_OBSERVERS", [launched.append])
    jit = launching.Launch._jit

    def quiet_jit(self, tensors):
        with _disable_current_modes():
            jit(self, tensors)

    monkeypatch.setattr(launching.Launch, "_jit", quiet_jit)

    def run(fn):
        launched.clear()
        with _Ops() as ops:
            fn()
        return list(launched), len(ops.allocations), ops.other

    return run


def _inputs(seed, heads=4, heads_kv=2, seqlen=40, mask=None, bias=None, grad=False):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(2, seqlen, heads, 32, generator=generator)
    k, v = (torch.randn(2, seqlen, heads_kv, 32, generator=generator) for _ in range(2))
    masks = {None: None, "kv_head": torch.rand(2, heads_kv, seqlen, seqlen, generator=generator) < 0.5,
             "per_key": torch.rand(2, 1, 1, seqlen, generator=generator) < 0.8}
    biases = {None: None, "per_key": torch.randn(heads_kv, 1, seqlen, generator=generator),
              "full": torch.randn(2, heads, seqlen, seqlen, generator=generator)}
    tensors = [q, k, v, masks[mask], biases[bias]]
    if grad:
        for t in (q, k, v, tensors[4]):
            if t is not None:
                t.requires_grad_()
    return tensors


FWD, LISTS, ACTIVITY = "flash_fwd_kernel", "block_list_kernel", "tile_activity_kernel"
PREPROCESS, DKDV, DQ, REDUCE = "flash_bwd_preprocess_kernel", "flash_bwd_dkdv_kernel", "flash_bwd_dq_kernel", "grad_reduce_kernel"

# (name, inputs, forward launches, forward allocations, backward launches, backward allocations,
# backward's other ops): what a call costs once its plan exists. A change that adds a launch, an
# allocation or a host-side op to a call fails here.
CASES = [
    ("dense", dict(heads=4, heads_kv=4), [FWD], 2, [PREPROCESS, DKDV, DQ], 4, []),
    # with a mask the preprocess launch also builds both kernels' block lists
    ("mask", dict(heads=4, heads_kv=4, mask="per_key"), [ACTIVITY, LISTS, FWD], 4, [PREPROCESS, DKDV, DQ], 4, []),
    ("mask+bias", dict(heads=4, heads_kv=4, mask="per_key", bias="per_key"), [ACTIVITY, LISTS, FWD], 4,
     [PREPROCESS, DKDV, DQ], 4, []),
    ("gqa+mask+bias", dict(mask="kv_head", bias="per_key"), [ACTIVITY, LISTS, FWD], 4,
     [PREPROCESS, DKDV, DQ, REDUCE], 4, []),
    # a learnable per-key bias: its fp32 partials (one row per query block and query head) are
    # summed into (Hkv, 1, Lk) in the same launch as the GQA shares, nothing on the host
    ("gqa+mask+bias-grad", dict(mask="kv_head", bias="per_key"), [ACTIVITY, LISTS, FWD], 4,
     [PREPROCESS, DKDV, DQ, REDUCE], 5, []),
    ("full-bias-grad", dict(heads=4, heads_kv=4, mask="kv_head", bias="full"), [ACTIVITY, LISTS, FWD], 4,
     [PREPROCESS, DKDV, "flash_bwd_dq_from_ds_kernel"], 5, []),
]


@pytest.mark.parametrize("name, shape, fwd_launches, fwd_allocations, bwd_launches, bwd_allocations, bwd_other",
                         CASES, ids=[case[0] for case in CASES])
def test_launches_and_allocations_per_call(counted, name, shape, fwd_launches, fwd_allocations, bwd_launches,
                                           bwd_allocations, bwd_other):
    q, k, v, mask, bias = _inputs(1, **shape, grad=True)
    if bias is not None and not name.endswith("-grad"):
        bias.requires_grad_(False)
    leaves = [t for t in (q, k, v, bias) if t is not None and t.requires_grad]
    flash_dmattn_func(q, k, v, mask, bias, is_causal=True)  # builds the plan and compiles

    # the forward of a training step (a call without gradient of Lq <= 64 decodes: below)
    launches, allocations, other = counted(lambda: flash_dmattn_func(q, k, v, mask, bias, is_causal=True))
    assert (launches, allocations, other) == (fwd_launches, fwd_allocations, [])

    grad_out = torch.randn(q.shape)
    out = flash_dmattn_func(q, k, v, mask, bias, is_causal=True)
    torch.autograd.grad(out, leaves, grad_out)  # the backward's first run builds its launches
    out = flash_dmattn_func(q, k, v, mask, bias, is_causal=True)
    launches, allocations, other = counted(lambda: torch.autograd.grad(out, leaves, grad_out))
    assert (launches, allocations, other) == (bwd_launches, bwd_allocations, bwd_other)


@pytest.mark.parametrize("seqlen_q", [80, 1], ids=["prefill", "decode"])
def test_an_lse_the_caller_keeps_is_a_tensor_of_its_own(counted, seqlen_q):
    """Asked for lse (`return_lse`), a call without gradient returns it as a tensor of its own,
    not as a view of the run's scratch buffer (the mask's schedule, decode's split partials),
    which a kept view would keep alive; one allocation more than a call that drops it."""
    q, k, v, mask, bias = _inputs(3, seqlen=80, mask="kv_head", bias="per_key")
    q, mask = q[:, :seqlen_q].contiguous(), mask[:, :, :seqlen_q]
    for return_lse in (True, False):
        flash_dmattn_func(q, k, v, mask, bias, return_lse=return_lse)  # builds the plan and compiles
    _, kept, _ = counted(lambda: flash_dmattn_func(q, k, v, mask, bias, return_lse=True))
    _, dropped, _ = counted(lambda: flash_dmattn_func(q, k, v, mask, bias))
    assert kept == dropped + 1
    out, lse = flash_dmattn_func(q, k, v, mask, bias, return_lse=True)
    assert lse._base is None and lse.untyped_storage().nbytes() == lse.numel() * lse.element_size()
    reference_out, reference_lse = flash_dmattn_func(q, k, v, mask, bias, return_lse=True, backend="reference")
    torch.testing.assert_close(lse, reference_lse, rtol=1e-4, atol=1e-4)


def test_inference_forward_keeps_its_schedule_in_one_buffer(counted):
    """Without a gradient (and more query rows than a decode takes) lse, the mask's activity and
    the block lists share one allocation beside out."""
    q, k, v, mask, bias = _inputs(2, seqlen=80, mask="kv_head", bias="per_key")
    flash_dmattn_func(q, k, v, mask, bias)  # builds the plan and compiles
    launches, allocations, other = counted(lambda: flash_dmattn_func(q, k, v, mask, bias))
    assert (launches, allocations, other) == ([ACTIVITY, LISTS, FWD], 2, [])


DECODE, COMBINE = "flash_decode_kernel", "decode_combine_kernel"


# (name, B, Hkv, mask, bias, cache lengths, launches, allocations) of a decode step, Lq = 1, H = 4,
# Lk = 40 in the interpreter (4 SMs): one split where B * Hkv programs fill SPLIT_WAVES per SM
# (MASKED_SPLIT_WAVES under a padding mask, as the per-key one here), else split-KV into fp32 partials and a combine; lse and the partials share one allocation
DECODE_CASES = [
    ("one-split", 8, 4, None, None, None, [DECODE], 2),
    ("one-split-mask-bias-seqlens", 8, 4, "per_key", "per_key", [40, 7] * 4, [DECODE], 2),
    ("split-kv", 2, 2, None, None, None, [DECODE, COMBINE], 2),
    ("split-kv-mask-bias-seqlens", 2, 2, "kv_head", "per_key", [3, 40], [DECODE, COMBINE], 2),
]


@pytest.mark.parametrize("name, batch, heads_kv, mask, bias, seqlens, launches, allocations", DECODE_CASES,
                         ids=[case[0] for case in DECODE_CASES])
def test_decode_launches_and_allocations(counted, name, batch, heads_kv, mask, bias, seqlens, launches, allocations):
    generator = torch.Generator().manual_seed(11)
    q = torch.randn(batch, 1, 4, 32, generator=generator)
    k, v = (torch.randn(batch, 40, heads_kv, 32, generator=generator) for _ in range(2))
    mask = {None: None, "per_key": torch.rand(batch, 1, 1, 40, generator=generator) < 0.8,
            "kv_head": torch.rand(batch, heads_kv, 1, 40, generator=generator) < 0.8}[mask]
    bias = None if bias is None else torch.randn(batch, heads_kv, 1, 40, generator=generator)
    seqlens = None if seqlens is None else torch.tensor(seqlens, dtype=torch.int32)

    def call():
        return flash_dmattn_func(q, k, v, mask, bias, cache_seqlens=seqlens)

    first = call()  # builds the plan and compiles
    assert counted(call)[:2] == (launches, allocations)
    assert torch.equal(call(), first)


def test_a_plan_is_built_once_per_signature_and_the_backward_chooses_nothing(monkeypatch):
    built, chosen = [], []
    original_init, original_choose = plan.AttentionPlan.__init__, tiles.choose
    monkeypatch.setattr(plan.AttentionPlan, "__init__", lambda self, *a, **k: built.append(1) or original_init(self, *a, **k))
    monkeypatch.setattr(plan.tiles, "choose", lambda *a, **k: chosen.append(a[0].direction) or original_choose(*a, **k))
    plan.clear()
    q, k, v, mask, bias = _inputs(2, mask="kv_head", bias="per_key", grad=True)
    for _ in range(3):
        flash_dmattn_func(q, k, v, mask, bias, is_causal=True).sum().backward()
    assert built == [1] and chosen == ["fwd", "bwd"]
    flash_dmattn_func(q, k, v, mask, bias, is_causal=False).sum().backward()  # another signature
    assert built == [1, 1] and chosen == ["fwd", "bwd", "fwd", "bwd"]
    with torch.no_grad():  # inference of 17 query rows: the short-query forward's config, no backward's
        flash_dmattn_func(q[:, :17], k, v, mask[..., :17, :], bias, is_causal=True)
    assert chosen[4:] == ["fwd", "decode"]


def test_use_table_makes_calls_choose_again(monkeypatch, tmp_path):
    chosen = []
    original = tiles.choose
    monkeypatch.setattr(plan.tiles, "choose", lambda *a, **k: chosen.append(1) or original(*a, **k))
    q, k, v, _, _ = _inputs(3)
    with torch.no_grad():
        flash_dmattn_func(q, k, v)
        per_plan = len(chosen)
        flash_dmattn_func(q, k, v)
        assert per_plan >= 1 and len(chosen) == per_plan  # the plan's choices are kept
        dispatch.use_table(None)
        flash_dmattn_func(q, k, v)
    assert len(chosen) == 2 * per_plan


def test_plans_match_the_compiled_op_path_bitwise():
    """Eager calls run the plan directly; the custom op (the path torch.compile traces) runs the
    same plan: identical results."""
    from dmattn_bench import ops
    from dmattn_bench.space import as_4d

    q, k, v, mask, bias = _inputs(4, mask="kv_head", bias="full")
    for inference in (True, False):  # the short-query forward (Lq 40) and the prefill one
        with torch.set_grad_enabled(not inference):
            q.requires_grad_(not inference)
            eager, eager_lse = flash_dmattn_func(q, k, v, mask, bias, is_causal=True, return_lse=True)
            op_out, op_lse, _ = ops.attention_fwd(q, k, v, as_4d(mask), as_4d(bias), True, 32 ** -0.5, 0.0, "auto",
                                                  None, None, None, None, None, inference)
        assert torch.equal(eager, op_out) and torch.equal(eager_lse, op_lse)


def test_a_backward_that_must_be_deterministic_runs_a_nondeterministic_config_in_its_order(monkeypatch):
    """A backward choice marked nondeterministic_dq (DESIGN.md §1) runs as chosen unless the call
    passes deterministic=True or `torch.use_deterministic_algorithms(True)` is on, when its
    ordered config runs; the plan answers the torch switch at each backward, not once."""
    from types import SimpleNamespace

    from dmattn_bench.registry import get_backend
    from dmattn_bench.space import BwdConfig

    unordered = BwdConfig(64, 128, 64, 128, 12, 2, nondeterministic_dq=1)
    reference, ran = get_backend("reference"), []

    def backward(*args, config, **kwargs):  # the reference's gradients, the config noted
        ran.append(config)
        reference.backward(*args, config=None, **kwargs)

    chooser = SimpleNamespace(name="recorder", backward_plan=None, backward=backward)
    choose = plan.AttentionPlan._choose
    monkeypatch.setattr(plan.AttentionPlan, "_choose", lambda self, direction, explicit: (
        (chooser, unordered) if direction == "bwd" else choose(self, direction, explicit)))
    plan.clear()
    q, k, v, _, _ = _inputs(7, grad=True)

    def step(**options):
        flash_dmattn_func(q, k, v, is_causal=True, **options).sum().backward()

    step()
    step(deterministic=True)
    torch.use_deterministic_algorithms(True)
    try:
        step()
    finally:
        torch.use_deterministic_algorithms(False)
    step()
    assert ran == [unordered, unordered.ordered(), unordered.ordered(), unordered]
    with pytest.raises(TypeError, match="deterministic: got str 'yes', expected True or False"):
        flash_dmattn_func(q, k, v, deterministic="yes")


# -- what the public entry rejects, and the zero-length results it defines ---------------------------


@pytest.mark.parametrize("is_causal", ["no", 1, None])
def test_a_non_bool_is_causal_is_rejected(is_causal):
    q, k, v, _, _ = _inputs(5)
    with pytest.raises(TypeError, match="is_causal: got .* expected True or False"):
        flash_dmattn_func(q, k, v, is_causal=is_causal)


def test_an_integer_mask_must_hold_zeros_and_ones():
    q, k, v, mask, _ = _inputs(6, mask="kv_head")
    as_int = mask.to(torch.int32)
    reference = flash_dmattn_func(q, k, v, mask)
    assert torch.equal(flash_dmattn_func(q, k, v, as_int), reference)
    as_int[1, 0, 3, 5] = 2
    with pytest.raises(ValueError, match="attn_mask: got an integer mask holding 2, expected 0/1"):
        flash_dmattn_func(q, k, v, as_int)  # the same signature: the check runs on every call


@pytest.mark.parametrize("dims", [dict(batch=0), dict(seqlen_q=0), dict(seqlen_k=0), dict(heads=0)])
def test_zero_length_dims_give_the_defined_result(dims, counted):
    """No query row: empty outputs. No key: every row dead (out 0, lse -inf). Nothing launches,
    and every gradient is zero."""
    batch, seqlen_q, seqlen_k = dims.get("batch", 2), dims.get("seqlen_q", 5), dims.get("seqlen_k", 7)
    heads = dims.get("heads", 4)
    q = torch.randn(batch, seqlen_q, heads, 32, requires_grad=True)
    k, v = (torch.randn(batch, seqlen_k, 2 if heads else 1, 32, requires_grad=True) for _ in range(2))
    mask = torch.ones(batch, 1, seqlen_q, seqlen_k, dtype=torch.bool)
    bias = torch.randn(1, 1, 1, seqlen_k, requires_grad=True)
    outputs = []
    launches, _, _ = counted(lambda: outputs.extend(
        flash_dmattn_func(q, k, v, mask, bias, is_causal=True, return_lse=True)))
    out, lse = outputs
    assert launches == []
    assert out.shape == q.shape and lse.shape == (batch, heads, seqlen_q)
    assert (out == 0).all() and (lse == float("-inf")).all()
    (out.sum() + 0 * lse.clamp(min=0).sum()).backward()
    for t in (q, k, v, bias):
        assert t.grad.shape == t.shape and (t.grad == 0).all()


# -- what a plan's signature must tell apart ---------------------------------------------------------


def test_a_cached_plan_does_not_let_a_non_bool_option_through():
    """1 == True and 0.0 == False: a signature that held only the values would reuse a plan
    built for the bool and skip the check."""
    q, k, v, _, _ = _inputs(7)
    with torch.no_grad():
        flash_dmattn_func(q, k, v, is_causal=True, softcap=0.0, softmax_scale=1.0)
    for bad in (dict(is_causal=1), dict(is_causal=True, softcap=False), dict(is_causal=True, softmax_scale=True)):
        with pytest.raises(TypeError, match=next(iter(bad.keys() - {"is_causal"}), "is_causal")):
            flash_dmattn_func(q, k, v, **bad)


def test_the_launchers_plans_tell_mask_alignments_apart():
    """The activity pass reads an 8-byte-aligned mask as int64 words: a mask 4 bytes past a 16-byte
    boundary must not reuse the plan of one 8 bytes past it."""
    launch.clear_plans()
    built = []
    original = launch.ForwardPlan
    q, k, v, _, _ = _inputs(8, heads=2, heads_kv=2, seqlen=32)
    storage = torch.ones(16 + 2 * 2 * 32 * 32, dtype=torch.bool)
    options = dict(is_causal=False, softmax_scale=0.25, softcap=0.0, config=launch.FwdConfig(16, 16, 1, 1))
    try:
        launch.ForwardPlan = lambda *a, **kw: built.append(original(*a, **kw)) or built[-1]
        for offset in (8, 4):
            mask = storage[offset:offset + 2 * 2 * 32 * 32].view(2, 2, 32, 32)
            out, lse = torch.empty_like(q), torch.empty(2, 2, 32)
            launch.attention_forward(q, k, v, mask, None, out=out, lse=lse, **options)
    finally:
        launch.ForwardPlan = original
        launch.clear_plans()
    assert [p.activity.launch.constexprs["WORDS"] for p in built] == [True, False]


def test_meta_tensors_get_shapes_without_a_launch():
    q = torch.empty(2, 24, 4, 32, device="meta")
    k = torch.empty(2, 40, 2, 32, device="meta")
    out, lse = flash_dmattn_func(q, k, k, is_causal=True, return_lse=True)
    assert out.is_meta and out.shape == q.shape and lse.shape == (2, 4, 24)


def test_plans_are_remembered_safely_from_several_threads():
    import threading

    cache = plan.PlanCache(2)
    errors = []

    def remember(index):
        try:
            for step in range(200):
                cache.put((index, step), object())
                cache.get_or_build((index, -step), object)
        except Exception as exc:  # noqa: BLE001 - collected for the assertion
            errors.append(exc)

    threads = [threading.Thread(target=remember, args=(index,)) for index in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert len(cache._plans) == 2  # the oldest were dropped


def test_the_op_path_marks_every_tile_active_where_its_forward_left_no_summary():
    """A backward may trust the forward op's activity buffer; after a forward without one (another
    backend), the buffer says every tile is active: slower, never wrong."""
    from dmattn_bench import ops
    from dmattn_bench.space import as_4d

    q, k, v, mask, _ = _inputs(9, mask="kv_head")
    _, _, activity = ops.attention_fwd(q, k, v, as_4d(mask), None, False, 32 ** -0.5, 0.0, "reference", None, None,
                                       None)
    assert activity.numel() > 0 and (activity == 1).all()
