"""The launchers' reuse paths: the forward's tile activity in the backward, and the forward's
smaller key tiles when an fp32 bias does not fit a config tuned on a 16-bit one."""

import pytest
import torch

from dmattn_bench import tiles
from dmattn_bench.space import BwdConfig, FwdConfig
from dmattn_kernels.triton import launch, layouts, schedule


def _inputs(seed: int, dtype=torch.float32):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 48, 4, 32, generator=generator).to(dtype)
    k = torch.randn(1, 48, 2, 32, generator=generator).to(dtype)
    v = torch.randn(1, 48, 2, 32, generator=generator).to(dtype)
    mask = torch.rand(1, 2, 48, 48, generator=generator) < 0.3
    mask[..., 16:32, :] = False  # whole tiles with nothing visible: the schedule must skip them
    bias = torch.randn(1, 4, 48, 48, generator=generator).to(dtype)
    return q, k, v, mask, bias


def test_backward_with_the_forwards_activity_is_bitwise_the_same():
    q, k, v, mask, bias = _inputs(0)
    options = dict(is_causal=True, softmax_scale=32 ** -0.5, softcap=0.0)
    out, lse = torch.empty_like(q), torch.empty(1, 4, 48)
    activity = torch.full(layouts.activity_shape(mask.shape, 48, 48), 7, dtype=torch.int8)  # poisoned first
    launch.attention_forward(q, k, v, mask, bias, config=FwdConfig(16, 16, 4, 1), out=out, lse=lse,
                             activity=activity, **options)
    assert torch.equal(activity, schedule.tile_activity(mask, 48, 48, True))
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(1))
    grads = []
    for reuse in (None, activity):
        dq, dk, dv, dbias = (torch.full_like(t, float("nan")) for t in (q, k, v, bias))
        launch.attention_backward(dout, q, k, v, out, lse, mask, bias, config=BwdConfig(16, 16, 16, 16, 4, 1),
                                  dq=dq, dk=dk, dv=dv, dbias=dbias, activity=reuse, **options)
        grads.append((dq, dk, dv, dbias))
    for without, with_reuse in zip(*grads):
        assert torch.isfinite(without).all()
        assert torch.equal(without, with_reuse)


@pytest.mark.parametrize("bias_dtype, expected", [(torch.float32, 32), (torch.float16, 128)])
def test_fp32_bias_forward_halves_key_tiles_until_it_fits(bias_dtype, expected):
    """Where configs are fitted (`tiles.fit_forward`): a 16-bit call with an fp32 bias whose
    forward plan needs more shared memory than the GPU has runs with its key tiles halved until
    it fits, on the plan that fits (none built twice); a 16-bit bias runs the config as tuned."""
    built = []

    class Plan:  # stands in for the launcher's plan: 1 KiB of shared memory per key of the tile
        def __init__(self, config):
            self.config = config
            built.append(config.block_n)

        def shared_bytes(self):
            return self.config.block_n * 1024

    chosen, plan = tiles.fit_forward("triton", FwdConfig(16, 128, 4, 2), Plan, q_dtype=torch.float16,
                                     bias_dtype=bias_dtype, limit=32 * 1024)
    assert chosen == FwdConfig(16, expected, 4, 2) and plan.config == chosen
    assert built == ([128, 64, 32] if bias_dtype == torch.float32 else [128])
    _, interpreted = tiles.fit_forward("triton", FwdConfig(16, 128, 4, 2), Plan, q_dtype=torch.float16,
                                       bias_dtype=torch.float32, limit=None)
    assert interpreted.config.block_n == 128  # no limit to fit (the interpreter)
