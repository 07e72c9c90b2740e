// streams.cu — DRAM rate of 1R1W vs 3R3W streams, ld/st vs TMA bulk copies (H200 probe).
#include <cuda_runtime.h>
#include <cstdio>
#include <cstdint>
#include <vector>
#include <algorithm>
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e)); exit(1);} } while (0)

__device__ __forceinline__ uint4 touch(uint4 a, float s) {
  // cheap per-element work on 8 bf16: multiply by s (keeps the data "updated")
  uint32_t* u = reinterpret_cast<uint32_t*>(&a);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float lo = __uint_as_float(u[i] << 16) * s, hi = __uint_as_float(u[i] & 0xFFFF0000u) * s;
    u[i] = (__float_as_uint(lo) >> 16) | (__float_as_uint(hi) & 0xFFFF0000u);
  }
  return a;
}
__global__ void copy1(const uint4* __restrict__ a, uint4* __restrict__ b, int64_t n, float s) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    b[i] = touch(a[i], s);
}
__global__ void inplace1(uint4* a, int64_t n, float s) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    a[i] = touch(a[i], s);
}
__global__ void inplace3(uint4* w, uint4* m, uint4* v, int64_t n, float s) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    uint4 a = w[i], b = m[i], c = v[i];
    w[i] = touch(a, s); m[i] = touch(b, s); v[i] = touch(c, s);
  }
}

// AdamW-like math on 8 bf16 of w, m, v (a made-up gradient): IEEE sqrt and division, or the
// approximate reciprocal square root.
template <bool kFast>
__device__ __forceinline__ void adam8(uint4& w, uint4& m, uint4& v, int64_t i) {
  uint32_t* wu = reinterpret_cast<uint32_t*>(&w);
  uint32_t* mu = reinterpret_cast<uint32_t*>(&m);
  uint32_t* vu = reinterpret_cast<uint32_t*>(&v);
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    uint32_t wo = 0, mo = 0, vo = 0;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float g = static_cast<float>(static_cast<int>((i * 8 + 2 * k + h) & 255) - 128) * 1e-3f;
      const float mf = 0.9f * __uint_as_float((mu[k] >> (16 * h)) << 16) + 0.1f * g;
      const float vf = 0.999f * __uint_as_float((vu[k] >> (16 * h)) << 16) + 0.001f * g * g;
      float wf = __uint_as_float((wu[k] >> (16 * h)) << 16);
      const float den = kFast ? mf * rsqrtf(vf + 1e-16f) : mf / (sqrtf(vf) + 1e-8f);
      wf -= 1e-4f * (den + 0.01f * wf);
      wo |= (__float_as_uint(wf) >> 16) << (16 * h);
      mo |= (__float_as_uint(mf) >> 16) << (16 * h);
      vo |= (__float_as_uint(vf) >> 16) << (16 * h);
    }
    wu[k] = wo; mu[k] = mo; vu[k] = vo;
  }
}
template <bool kFast>
__global__ void adam3(uint4* w, uint4* m, uint4* v, int64_t n) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    uint4 a = w[i], b = m[i], c = v[i];
    adam8<kFast>(a, b, c, i);
    w[i] = a; m[i] = b; v[i] = c;
  }
}
// ---- TMA bulk (1D) version: each CTA walks chunks of kChunk bytes per tensor, 2 buffers ----
constexpr int kChunk = 8192;  // bytes per tensor per chunk
__device__ __forceinline__ uint32_t sa(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void mb_init(uint64_t* b, int c) { asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(sa(b)), "r"(c)); }
__device__ __forceinline__ void mb_expect(uint64_t* b, int bytes) { asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(sa(b)), "r"(bytes) : "memory"); }
__device__ __forceinline__ void mb_wait(uint64_t* b, uint32_t ph) {
  asm volatile("{\n.reg .pred p;\nW: mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n@!p bra W;\n}" :: "r"(sa(b)), "r"(ph) : "memory");
}
__device__ __forceinline__ void bulk_load(void* dst, const void* src, int bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               :: "r"(sa(dst)), "l"(src), "r"(bytes), "r"(sa(bar)) : "memory");
}
__device__ __forceinline__ void bulk_store(void* dst, const void* src, int bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" :: "l"(dst), "r"(sa(src)), "r"(bytes) : "memory");
}
__global__ void __launch_bounds__(256) bulk3(char* w, char* m, char* v, int64_t chunks, float s) {
  extern __shared__ __align__(128) char sm[];  // [2][3][kChunk]
  __shared__ __align__(8) uint64_t bar[2];
  if (threadIdx.x == 0) { mb_init(&bar[0], 1); mb_init(&bar[1], 1); asm volatile("fence.mbarrier_init.release.cluster;"); }
  __syncthreads();
  char* base[3] = {w, m, v};
  int64_t c0 = blockIdx.x;
  auto issue = [&](int buf, int64_t c) {
    mb_expect(&bar[buf], 3 * kChunk);
    for (int t = 0; t < 3; ++t) bulk_load(sm + (buf * 3 + t) * kChunk, base[t] + c * kChunk, kChunk, &bar[buf]);
  };
  if (threadIdx.x == 0 && c0 < chunks) issue(0, c0);
  uint32_t ph[2] = {0, 0};
  int buf = 0;
  for (int64_t c = c0; c < chunks; c += gridDim.x, buf ^= 1) {
    const int64_t cn = c + gridDim.x;
    if (threadIdx.x == 0 && cn < chunks) {
      // the other buffer's stores must have read smem before it is refilled
      asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
      issue(buf ^ 1, cn);
    }
    mb_wait(&bar[buf], ph[buf]); ph[buf] ^= 1;
    for (int t = 0; t < 3; ++t) {
      uint4* p = reinterpret_cast<uint4*>(sm + (buf * 3 + t) * kChunk);
      for (int i = threadIdx.x; i < kChunk / 16; i += blockDim.x) p[i] = touch(p[i], s);
    }
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncthreads();
    if (threadIdx.x == 0) {
      for (int t = 0; t < 3; ++t) bulk_store(base[t] + c * kChunk, sm + (buf * 3 + t) * kChunk, kChunk);
      asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

int main() {
  const int64_t elems = 14336LL * 4096;  // gate_proj
  const int64_t bytes = elems * 2;
  char *w, *m, *v, *w2, *flush;
  CK(cudaMalloc(&w, bytes)); CK(cudaMalloc(&m, bytes)); CK(cudaMalloc(&v, bytes)); CK(cudaMalloc(&w2, bytes));
  CK(cudaMalloc(&flush, 256 << 20));
  CK(cudaMemset(w, 0x3c, bytes)); CK(cudaMemset(m, 0x3c, bytes)); CK(cudaMemset(v, 0x3c, bytes));
  int sms; CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const int64_t n16 = bytes / 16;
  CK(cudaFuncSetAttribute(bulk3, cudaFuncAttributeMaxDynamicSharedMemorySize, 6 * kChunk));
  cudaEvent_t e0, e1; CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
  auto time = [&](const char* name, double moved, auto launch) {
    std::vector<float> t;
    for (int r = 0; r < 23; ++r) {
      CK(cudaMemsetAsync(flush, r, 256 << 20));
      CK(cudaEventRecord(e0)); launch(); CK(cudaEventRecord(e1)); CK(cudaEventSynchronize(e1));
      CK(cudaGetLastError());
      float ms; CK(cudaEventElapsedTime(&ms, e0, e1)); if (r >= 3) t.push_back(ms);
    }
    std::sort(t.begin(), t.end());
    printf("| %-40s | %.4f ms | %.2f TB/s |\n", name, t[t.size() / 2], moved / (t[t.size() / 2] * 1e9));
  };
  for (int per : {4, 8, 16}) {
    const int grid = sms * per;
    char nm[64];
    snprintf(nm, 64, "copy 1R1W, %d CTAs/SM x256", per / 1);
    time(nm, 2.0 * bytes, [&] { copy1<<<grid, 256>>>((uint4*)w, (uint4*)w2, n16, 1.0f); });
    snprintf(nm, 64, "in-place 1R1W, %d x256", per);
    time(nm, 2.0 * bytes, [&] { inplace1<<<grid, 256>>>((uint4*)w, n16, 1.0f); });
    snprintf(nm, 64, "in-place 3R3W, %d x256", per);
    time(nm, 6.0 * bytes, [&] { inplace3<<<grid, 256>>>((uint4*)w, (uint4*)m, (uint4*)v, n16, 1.0f); });
  }
  for (int per : {2, 4, 8, 16}) {
    char nm[64];
    snprintf(nm, 64, "AdamW 3R3W IEEE div+sqrt, %d x256", per);
    time(nm, 6.0 * bytes, [&] { adam3<false><<<sms * per, 256>>>((uint4*)w, (uint4*)m, (uint4*)v, n16); });
    snprintf(nm, 64, "AdamW 3R3W rsqrt, %d x256", per);
    time(nm, 6.0 * bytes, [&] { adam3<true><<<sms * per, 256>>>((uint4*)w, (uint4*)m, (uint4*)v, n16); });
  }
  for (int per : {2, 4, 8}) {
    char nm[64]; snprintf(nm, 64, "bulk TMA 3R3W, %d CTAs/SM, 8 KiB chunks", per);
    time(nm, 6.0 * bytes, [&] { bulk3<<<sms * per, 256, 6 * kChunk>>>(w, m, v, bytes / kChunk, 1.0f); });
  }
  printf("cudaMemcpy D2D: ");
  time("cudaMemcpy D2D", 2.0 * bytes, [&] { CK(cudaMemcpyAsync(w2, w, bytes, cudaMemcpyDeviceToDevice)); });
  return 0;
}
