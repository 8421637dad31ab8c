"""The launchers' reuse paths: the forward's tile activity in the backward, and the forward's
fallback to smaller key tiles when an fp32 bias does not fit a config tuned on a 16-bit one."""

import pytest
import torch
from triton.runtime.errors import OutOfResources

from dmattn_bench.space import BwdConfig, FwdConfig
from dmattn_kernels.triton import launch


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
    activity = torch.full(launch.activity_shape(mask.shape, 48, 48), 7, dtype=torch.int8)  # poisoned first
    launch.attention_forward(q, k, v, mask, bias, config=FwdConfig(16, 16, 4, 1), out=out, lse=lse,
                             activity=activity, **options)
    assert torch.equal(activity, launch.tile_activity(mask, 48, 48, True))
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


class _SharedMemoryLimit:
    """Stands in for `flash_fwd_kernel`: raises OutOfResources as a GPU launch does when the
    key tile is over `max_block_n`, else records the launch."""

    def __init__(self, max_block_n: int):
        self.max_block_n = max_block_n
        self.launched: list[int] = []
        self.attempts = 0

    def __getitem__(self, grid):
        def run(*args, BLOCK_N, **kwargs):
            self.attempts += 1
            if BLOCK_N > self.max_block_n:
                raise OutOfResources(BLOCK_N * 1024, self.max_block_n * 1024, "shared memory")
            self.launched.append(BLOCK_N)
        return run


@pytest.mark.parametrize("bias_dtype, expected", [(torch.float32, [32, 32]), (torch.float16, None)])
def test_fp32_bias_forward_halves_key_tiles_until_it_fits(monkeypatch, bias_dtype, expected):
    q, k, v, mask, bias = _inputs(2, torch.float16)
    fake = _SharedMemoryLimit(max_block_n=32)
    monkeypatch.setattr(launch, "flash_fwd_kernel", fake)
    monkeypatch.setattr(launch, "_FITTED_FWD", {})
    call = lambda: launch.attention_forward(  # noqa: E731
        q, k, v, mask, bias.to(bias_dtype), is_causal=True, softmax_scale=1.0, softcap=0.0,
        config=FwdConfig(16, 128, 4, 2), out=torch.empty_like(q), lse=torch.empty(1, 4, 48))
    if expected is None:  # a 16-bit bias runs the config as tuned, or fails as it would
        with pytest.raises(OutOfResources):
            call()
        return
    call()
    call()
    assert fake.launched == expected
    assert fake.attempts == 4  # 128 and 64 fail once; the second call starts at the learned 32
