// The operand forms of sm90.cuh / wgmma.cuh against a host reference, on one warpgroup:
// S = A B^T with both in shared memory (K-major), the same with A in registers, and O = P V with
// P in registers and V MN-major (wgmma's transpose flag). lbo_swap 1 tries the descriptor with
// its two byte offsets exchanged (it must fail: the order in mn_major is the one that works).
//
//   for d in 64 128 256; do nvcc -gencode arch=compute_90a,code=sm_90a -std=c++17 -O2 -I kernels/cuda \
//     -DELEMENT=1 -DHEAD_DIM=$d -o /tmp/wgmma_check_$d benchmarks/cuda/wgmma_operand_check.cu && /tmp/wgmma_check_$d; done
//
// H200, 2026-11-22: max err 0 for all three forms at head dims 64, 128 and 256 (lbo_swap 0);
// lbo_swap 1 gave pv errors of 16.8 (D128) and 26 (D256) and an illegal address at D64.
#include <cstdio>
#include <cstdlib>
#include <cmath>
#include <vector>
#define BIAS_FP32 0
#define NUM_WARPS 4
#define STAGES 2
#define IS_CAUSAL 0
#define HAS_MASK 0
#define HAS_BIAS 0
#define HAS_SOFTCAP 0
#include "common.cuh"
#include "sm90.cuh"

constexpr int M = 64, N = 128, K = BLOCK_D;  // S = A(M x K) B(N x K)^T ; O = P(M x N) V(N x K)

// mode 0: ss S = A B^T; mode 1: rs O = P V (V MN-major) ; mode 2: rs S = A(regs) B^T
__global__ void test(const elem_t* a, const elem_t* b, const elem_t* p, float* s_out, float* o_out, int lbo_swap) {
  __shared__ __align__(1024) elem_t a_s[M * K];
  __shared__ __align__(1024) elem_t b_s[N * K];
  for (int i = threadIdx.x; i < M * K; i += 128) a_s[swizzled(i / K, i % K, M)] = a[i];
  for (int i = threadIdx.x; i < N * K; i += 128) b_s[swizzled(i / K, i % K, N)] = b[i];
  fence_async_shared();
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  // mode 0
  float s[N / 8][4];
  touch(s);
  wgmma_fence();
  for (int kk = 0; kk < K / 16; ++kk) Wgmma<N>::ss<0>(s, k_major(a_s, M, 0, kk), k_major(b_s, N, 0, kk), kk > 0);
  wgmma_commit();
  wgmma_wait<0>();
  touch(s);
  for (int n = 0; n < N / 8; ++n)
    for (int c = 0; c < 4; ++c) s_out[(warp * 16 + g + 8 * (c / 2)) * N + n * 8 + 2 * t + c % 2] = s[n][c];
  // mode 2: A from registers
  float s2[N / 8][4];
  uint32_t af[K / 16][4];
  for (int kk = 0; kk < K / 16; ++kk) {
    const elem_t* base = a + (warp * 16) * K + kk * 16;
    auto pk = [&](int r, int c) { elem2_t v; v.x = base[r * K + c]; v.y = base[r * K + c + 1]; return as_u32(v); };
    af[kk][0] = pk(g, 2 * t); af[kk][1] = pk(g + 8, 2 * t); af[kk][2] = pk(g, 2 * t + 8); af[kk][3] = pk(g + 8, 2 * t + 8);
  }
  touch(s2);
  wgmma_fence();
  for (int kk = 0; kk < K / 16; ++kk) Wgmma<N>::rs<0>(s2, af[kk], k_major(b_s, N, 0, kk), kk > 0);
  wgmma_commit();
  wgmma_wait<0>();
  touch(s2);
  for (int n = 0; n < N / 8; ++n)
    for (int c = 0; c < 4; ++c) s_out[M * N + (warp * 16 + g + 8 * (c / 2)) * N + n * 8 + 2 * t + c % 2] = s2[n][c];
  // mode 1: O = P V with V = b viewed as (N rows = k) x K cols
  float o[K / 8][4];
  touch(o);
  wgmma_fence();
  for (int kk = 0; kk < N / 16; ++kk) {
    const elem_t* base = p + (warp * 16) * N + kk * 16;
    auto pk = [&](int r, int c) { elem2_t v; v.x = base[r * N + c]; v.y = base[r * N + c + 1]; return as_u32(v); };
    uint32_t pf[4] = {pk(g, 2 * t), pk(g + 8, 2 * t), pk(g, 2 * t + 8), pk(g + 8, 2 * t + 8)};
    uint64_t desc = lbo_swap ? descriptor(b_s + kk * 16 * SWIZZLE_COLS, SWIZZLE_ATOM, N * 128) : mn_major(b_s, N, kk);
    Wgmma<K>::rs<1>(o, pf, desc, kk > 0);
  }
  wgmma_commit();
  wgmma_wait<0>();
  touch(o);
  for (int n = 0; n < K / 8; ++n)
    for (int c = 0; c < 4; ++c) o_out[(warp * 16 + g + 8 * (c / 2)) * K + n * 8 + 2 * t + c % 2] = o[n][c];
}

static float to_f(elem_t x) { return __bfloat162float(x); }

int main() {
  std::vector<elem_t> a(M * K), b(N * K), p(M * N);
  srand(1);
  auto rnd = [] { return (rand() % 17 - 8) / 8.0f; };
  for (auto& x : a) x = __float2bfloat16(rnd());
  for (auto& x : b) x = __float2bfloat16(rnd());
  for (auto& x : p) x = __float2bfloat16(rnd());
  elem_t *da, *db, *dp; float *ds, *dout;
  cudaMalloc(&da, a.size() * 2); cudaMalloc(&db, b.size() * 2); cudaMalloc(&dp, p.size() * 2);
  cudaMalloc(&ds, 2 * M * N * 4); cudaMalloc(&dout, M * K * 4);
  cudaMemcpy(da, a.data(), a.size() * 2, cudaMemcpyHostToDevice);
  cudaMemcpy(db, b.data(), b.size() * 2, cudaMemcpyHostToDevice);
  cudaMemcpy(dp, p.data(), p.size() * 2, cudaMemcpyHostToDevice);
  for (int swap = 0; swap < 2; ++swap) {
    cudaMemset(ds, 0, 2 * M * N * 4); cudaMemset(dout, 0, M * K * 4);
    test<<<1, 128>>>(da, db, dp, ds, dout, swap);
    cudaError_t e = cudaDeviceSynchronize();
    if (e) { printf("error %s\n", cudaGetErrorString(e)); return 1; }
    std::vector<float> s(2 * M * N), o(M * K);
    cudaMemcpy(s.data(), ds, s.size() * 4, cudaMemcpyDeviceToHost);
    cudaMemcpy(o.data(), dout, o.size() * 4, cudaMemcpyDeviceToHost);
    double e_ss = 0, e_rs = 0, e_pv = 0;
    for (int i = 0; i < M; ++i)
      for (int j = 0; j < N; ++j) {
        double r = 0;
        for (int k = 0; k < K; ++k) r += to_f(a[i * K + k]) * to_f(b[j * K + k]);
        e_ss = fmax(e_ss, fabs(r - s[i * N + j]));
        e_rs = fmax(e_rs, fabs(r - s[M * N + i * N + j]));
      }
    for (int i = 0; i < M; ++i)
      for (int j = 0; j < K; ++j) {
        double r = 0;
        for (int k = 0; k < N; ++k) r += to_f(p[i * N + k]) * to_f(b[k * K + j]);
        e_pv = fmax(e_pv, fabs(r - o[i * K + j]));
      }
    printf("HEAD_DIM %d lbo_swap %d: max err ss %.3g rs %.3g pv %.3g\n", HEAD_DIM, swap, e_ss, e_rs, e_pv);
  }
  return 0;
}
