"""W3 dense causal forward: prototype variants against our kernel and cuDNN, same run."""
import sys, torch, triton, triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor
from dmattn_bench.space import FwdConfig
from dmattn_bench.timing import time_kernel
from dmattn_kernels.triton import launch

LOG2E = tl.constexpr(1.4426950408889634)

@triton.jit
def _kv(desc, ptr, b, n, hk, stride_n, offs_n, offs_d, BLOCK_N: tl.constexpr, D: tl.constexpr, TMA: tl.constexpr):
    if TMA:
        return desc.load([b, n, hk * D]).reshape(BLOCK_N, D)
    else:
        return tl.load(ptr + (n + offs_n)[:, None] * stride_n + offs_d[None, :])

@triton.jit
def _step(q, m_i, l_i, acc, kd, vd, k_base, v_base, b, n, hk, stride_kn, stride_vn, offs_m, offs_n, offs_d, c,
          BLOCK_N: tl.constexpr, D: tl.constexpr, DIAG: tl.constexpr, FOLD: tl.constexpr, TMA: tl.constexpr):
    k = _kv(kd, k_base, b, n, hk, stride_kn, offs_n, offs_d, BLOCK_N, D, TMA)
    qk = tl.dot(q, tl.trans(k))
    if DIAG:
        qk = tl.where(offs_m[:, None] >= (n + offs_n)[None, :], qk, float("-inf"))
    if FOLD:
        m_new = tl.maximum(m_i, tl.max(qk, 1) * c)
        p = tl.exp2(qk * c - m_new[:, None])
    else:
        s = qk * c
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = _kv(vd, v_base, b, n, hk, stride_vn, offs_n, offs_d, BLOCK_N, D, TMA)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc

@triton.jit
def proto_kernel(q_ptr, k_ptr, v_ptr, o_ptr, kd, vd, stride_qm, stride_kn, stride_vn, H, L, c,
                 D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FOLD: tl.constexpr, TMA: tl.constexpr):
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    q_base = q_ptr + b.to(tl.int64) * L * stride_qm + h * D
    k_base = k_ptr + b.to(tl.int64) * L * stride_kn + h * D
    v_base = v_ptr + b.to(tl.int64) * L * stride_vn + h * D
    q = tl.load(q_base + offs_m[:, None] * stride_qm + offs_d[None, :])
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    lo_diag = (pid_m * BLOCK_M) // BLOCK_N * BLOCK_N
    for n in range(0, lo_diag, BLOCK_N):
        m_i, l_i, acc = _step(q, m_i, l_i, acc, kd, vd, k_base, v_base, b, n, h, stride_kn, stride_vn, offs_m, offs_n, offs_d, c,
                              BLOCK_N, D, False, FOLD, TMA)
    for n in range(lo_diag, (pid_m + 1) * BLOCK_M, BLOCK_N):
        m_i, l_i, acc = _step(q, m_i, l_i, acc, kd, vd, k_base, v_base, b, n, h, stride_kn, stride_vn, offs_m, offs_n, offs_d, c,
                              BLOCK_N, D, True, FOLD, TMA)
    out = acc / l_i[:, None]
    tl.store(o_ptr + b.to(tl.int64) * L * stride_qm + h * D + offs_m[:, None] * stride_qm + offs_d[None, :], out.to(o_ptr.dtype.element_ty))


@triton.jit
def _soft(qk, m_i, l_i, acc, v, offs_m, n, offs_n, c, DIAG: tl.constexpr):
    if DIAG:
        qk = tl.where(offs_m[:, None] >= (n + offs_n)[None, :], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1) * c)
    p = tl.exp2(qk * c - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc

@triton.jit
def pipe_kernel(q_ptr, k_ptr, v_ptr, o_ptr, kd, vd, stride_qm, stride_kn, stride_vn, H, L, c,
                D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FOLD: tl.constexpr, TMA: tl.constexpr):
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    q_base = q_ptr + b.to(tl.int64) * L * stride_qm + h * D
    k_base = k_ptr + b.to(tl.int64) * L * stride_kn + h * D
    v_base = v_ptr + b.to(tl.int64) * L * stride_vn + h * D
    q = tl.load(q_base + offs_m[:, None] * stride_qm + offs_d[None, :])
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    lo_diag = (pid_m * BLOCK_M) // BLOCK_N * BLOCK_N
    if lo_diag > 0:
        k = _kv(kd, k_base, b, 0, h, stride_kn, offs_n, offs_d, BLOCK_N, D, TMA)
        qk = tl.dot(q, tl.trans(k))
        for n in range(0, lo_diag - BLOCK_N, BLOCK_N):
            k = _kv(kd, k_base, b, n + BLOCK_N, h, stride_kn, offs_n, offs_d, BLOCK_N, D, TMA)
            qk_next = tl.dot(q, tl.trans(k))
            v = _kv(vd, v_base, b, n, h, stride_vn, offs_n, offs_d, BLOCK_N, D, TMA)
            m_i, l_i, acc = _soft(qk, m_i, l_i, acc, v, offs_m, n, offs_n, c, False)
            qk = qk_next
        v = _kv(vd, v_base, b, lo_diag - BLOCK_N, h, stride_vn, offs_n, offs_d, BLOCK_N, D, TMA)
        m_i, l_i, acc = _soft(qk, m_i, l_i, acc, v, offs_m, lo_diag - BLOCK_N, offs_n, c, False)
    for n in range(lo_diag, (pid_m + 1) * BLOCK_M, BLOCK_N):
        m_i, l_i, acc = _step(q, m_i, l_i, acc, kd, vd, k_base, v_base, b, n, h, stride_kn, stride_vn, offs_m, offs_n, offs_d, c,
                              BLOCK_N, D, True, FOLD, TMA)
    out = acc / l_i[:, None]
    tl.store(o_ptr + b.to(tl.int64) * L * stride_qm + h * D + offs_m[:, None] * stride_qm + offs_d[None, :], out.to(o_ptr.dtype.element_ty))

B, H, L, D = 2, 16, 4096, 128
torch.manual_seed(0)
q, k, v = (torch.randn(B, L, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
scale = D ** -0.5
ref = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True).transpose(1, 2)
flops = 4 * B * H * D * (L * (L + 1) / 2)
rows = []
def rec(name, fn, check=None):
    try:
        fn(); torch.cuda.synchronize()
        err = (check() - ref).abs().max().item() if check else float("nan")
        t = time_kernel(fn, "cuda", repeats=30).median_ms
        rows.append(f"{name:34s} {t:7.4f} ms {flops / t / 1e9:6.1f} TF/s err {err:.2e}")
    except Exception as e:
        rows.append(f"{name:34s} ERR {str(e).splitlines()[0][:100]}")
    print(rows[-1], flush=True)

from torch.nn.attention import sdpa_kernel, SDPBackend
qt, kt_, vt = (x.transpose(1, 2) for x in (q, k, v))
def cudnn():
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        return torch.nn.functional.scaled_dot_product_attention(qt, kt_, vt, is_causal=True)
rec("cudnn", cudnn)
out = torch.empty_like(q); lse = torch.empty((B, H, L), device="cuda", dtype=torch.float32)
k3, v3 = k.view(B, L, H * D), v.view(B, L, H * D)
o2 = torch.empty_like(q)
def ours(s):
    bm, bn, w, st = map(int, s.split(","))
    c = FwdConfig(bm, bn, w, st)
    return lambda: launch.attention_forward(q, k, v, None, None, is_causal=True, softmax_scale=scale, softcap=0.0, config=c, out=out, lse=lse)
def proto(kern, s):
    bm, bn, w, st = map(int, s.split(","))
    kd = TensorDescriptor.from_tensor(k3, [1, bn, D]); vd = TensorDescriptor.from_tensor(v3, [1, bn, D])
    return lambda: kern[(L // bm, B * H)](q, k, v, o2, kd, vd, q.stride(1), k.stride(1), v.stride(1), H, L, scale * 1.4426950408889634,
                                          D=D, BLOCK_M=bm, BLOCK_N=bn, FOLD=1, TMA=1, num_warps=w, num_stages=st)
for rnd in range(2):
    rec(f"r{rnd} cudnn", cudnn)
    for s in ["64,64,4,3", "64,32,4,3", "64,32,4,2", "64,64,4,2"]:
        rec(f"r{rnd} ours {s}", ours(s), lambda: out)
        rec(f"r{rnd} proto {s}", proto(proto_kernel, s), lambda: o2)
        rec(f"r{rnd} pipe {s}", proto(pipe_kernel, s), lambda: o2)
    for s in ["128,64,8,3", "128,128,8,3", "128,64,8,2"]:
        rec(f"r{rnd} pipe {s}", proto(pipe_kernel, s), lambda: o2)
print("== summary"); print("\n".join(rows))
