// wgrad_bench.cu — the fused weight-gradient + optimizer step against the unfused way, on
// the linear layers of Llama-3.1-8B (out × in = 4096×4096, 1024×4096, 14336×4096,
// 4096×14336) at T ∈ {512, 2048, 4096} tokens, bf16 inputs and bf16 W:
//  (a) forge_wgrad_step, AdamW, with bf16 states, int8 states, fp8 states, and fp32 master +
//      fp32 states (int4 states beside a stochastically rounded weight, below);
//  (b) cuBLAS dW = dYᵀX alone (bf16 in; fp32 out, and bf16 out);
//  (c) cuBLAS (bf16 out) + a separate vectorized AdamW pass over bf16 W, m, v — the
//      unfused step (what torch does with bf16 grads and a fused AdamW).
// Also: (a) with stochastic rounding of the bf16 weight and states (forge.optim.AdamW's
// default), and (a-bf16) at T = 32 (the GEMM all but gone: what the epilogue alone costs),
// to say where the time goes. FORGE_DEBUG_WGMMA=0 times the portable sm80 kernels on Hopper.
// Last, forge_elementwise_step (AdamW, bf16 SR, int8 and fp8 states) on the embedding's shape
// [128256, 4096] against the unfused AdamW pass of (c).
//
// --profile launches a few kernels for Nsight Compute instead (see main()); --host-cost times
// the host side of one call; --run-scalars runs every AdamW step with its scalars in device
// memory (forge_hparams.run_scalars: the kernels a CUDA graph's step runs).
// --soak SECONDS runs gate_proj's variants back to back instead, each for that long, with the
// card's SM clock, power and energy per call (nvidia-smi samples): whether a variant is held by
// the power cap.
//
// Timing: CUDA events around each call, the L2 flushed (a 256 MiB memset) before each,
// median of --iters (default 30) after 5 warm-ups, the variants of one (layer, T) interleaved
// call by call (Timer::medians_ms); random non-zero inputs. Writes a markdown table and JSON
// to --out (default $OUT or ./out). A correctness check rides along: the fused step's dW
// (SGD, lr = 1, W = 0, fp32) against cuBLAS's fp32 dW, per shape.
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <functional>
#include <initializer_list>
#include <map>
#include <string>
#include <vector>

#include "forge/forge.h"

namespace {

#define CHECK_CUDA(call)                                                                 \
  do {                                                                                   \
    cudaError_t e_ = (call);                                                             \
    if (e_ != cudaSuccess) {                                                             \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call,                \
                   cudaGetErrorString(e_));                                              \
      std::exit(1);                                                                      \
    }                                                                                    \
  } while (0)
#define CHECK_CUBLAS(call)                                                               \
  do {                                                                                   \
    cublasStatus_t s_ = (call);                                                          \
    if (s_ != CUBLAS_STATUS_SUCCESS) {                                                   \
      std::fprintf(stderr, "%s:%d: %s: cuBLAS status %d\n", __FILE__, __LINE__, #call,  \
                   static_cast<int>(s_));                                                \
      std::exit(1);                                                                      \
    }                                                                                    \
  } while (0)
#define CHECK_FORGE(call)                                                                \
  do {                                                                                   \
    forge_status s_ = (call);                                                            \
    if (s_ != FORGE_OK) {                                                                \
      std::fprintf(stderr, "%s:%d: %s: %d %s\n", __FILE__, __LINE__, #call,             \
                   static_cast<int>(s_), forge_last_error());                            \
      std::exit(1);                                                                      \
    }                                                                                    \
  } while (0)

constexpr int kWarmup = 5;

// ---- device helpers -------------------------------------------------------------------------

__device__ __forceinline__ uint32_t hash32(uint64_t x) {
  x ^= x >> 33;
  x *= 0xFF51AFD7ED558CCDull;
  x ^= x >> 33;
  x *= 0xC4CEB9FE1A85EC53ull;
  x ^= x >> 33;
  return static_cast<uint32_t>(x);
}

__device__ __forceinline__ uint16_t to_bf16(float f) {
  uint32_t u = __float_as_uint(f);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
__device__ __forceinline__ float from_bf16(uint16_t h) { return __uint_as_float(uint32_t(h) << 16); }

// Uniform in ±scale (or in (0, scale] when `positive`: second moments), never 0 (non-zero
// inputs: zeros run faster and hide bugs).
__global__ void fill_bf16(uint16_t* p, int64_t n, uint64_t seed, float scale, bool positive = false) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const float u = (hash32(seed * 0x9E3779B97F4A7C15ull + i) + 0.5f) * (1.0f / 4294967296.0f);
    p[i] = positive ? to_bf16(scale * (u + 0.01f))
                    : to_bf16(scale * (2.0f * u - 1.0f) + (u < 0.5f ? -1e-3f : 1e-3f) * scale);
  }
}

// Counts the non-finite bf16 values of p: a benchmark whose weights went NaN times the
// library's exact fallback path, not the step users run.
__global__ void count_nonfinite_bf16(const uint16_t* p, int64_t n, unsigned long long* count) {
  unsigned long long c = 0;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    c += (p[i] & 0x7F80u) == 0x7F80u;
  if (c) atomicAdd(count, c);
}
// --host-cost's baseline: the host cost of one kernel launch.
__global__ void noop_kernel() {}

__global__ void fill_f32(float* p, int64_t n, uint64_t seed, float scale, bool positive) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const float u = (hash32(seed * 0x9E3779B97F4A7C15ull + i) + 0.5f) * (1.0f / 4294967296.0f);
    p[i] = positive ? scale * (u + 0.01f) : scale * (2.0f * u - 1.0f);
  }
}

struct AdamWScalars {
  float one_minus_beta1, beta2, one_minus_beta2, eps, bc2_sqrt, neg_step_size, decay;
};
// The unfused pass's hyper-parameters where it is timed: β = (0.9, 0.999), eps 1e-8, lr 1e-3,
// weight decay 1e-2, bias corrections of step 1.
AdamWScalars timed_adamw_scalars() {
  return {0.1f, 0.999f, 0.001f, 1e-8f, std::sqrt(1.0f - 0.999f), -1e-3f / 0.1f,
          1.0f - 1e-3f * 1e-2f};
}

// The unfused optimizer pass: bf16 grad, W, m, v; 8 elements (16 B of each) per thread.
__global__ void __launch_bounds__(256) adamw_bf16(const uint4* __restrict__ grad, uint4* __restrict__ w,
                                                  uint4* __restrict__ m, uint4* __restrict__ v,
                                                  int64_t n8, AdamWScalars s) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n8; i += int64_t(gridDim.x) * blockDim.x) {
    const uint4 g4 = grad[i], w4 = w[i], m4 = m[i], v4 = v[i];
    const uint16_t* gh = reinterpret_cast<const uint16_t*>(&g4);
    const uint16_t* wh = reinterpret_cast<const uint16_t*>(&w4);
    const uint16_t* mh = reinterpret_cast<const uint16_t*>(&m4);
    const uint16_t* vh = reinterpret_cast<const uint16_t*>(&v4);
    uint4 wo, mo, vo;
    uint16_t* woh = reinterpret_cast<uint16_t*>(&wo);
    uint16_t* moh = reinterpret_cast<uint16_t*>(&mo);
    uint16_t* voh = reinterpret_cast<uint16_t*>(&vo);
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const float g = from_bf16(gh[e]);
      float mm = from_bf16(mh[e]), vv = from_bf16(vh[e]), ww = from_bf16(wh[e]);
      mm = mm + s.one_minus_beta1 * (g - mm);
      vv = vv * s.beta2 + s.one_minus_beta2 * (g * g);
      const float denom = sqrtf(vv) / s.bc2_sqrt + s.eps;
      ww = ww * s.decay + s.neg_step_size * (mm / denom);
      woh[e] = to_bf16(ww);
      moh[e] = to_bf16(mm);
      voh[e] = to_bf16(vv);
    }
    w[i] = wo;
    m[i] = mo;
    v[i] = vo;
  }
}

// err2 += Σ (a + b)², ref2 += Σ b² (a = fused W = -dW, b = cuBLAS dW).
__global__ void sum_sq_error(const float* a, const float* b, int64_t n, double* out) {
  double err = 0, ref = 0;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const double d = double(a[i]) + double(b[i]);
    err += d * d;
    ref += double(b[i]) * double(b[i]);
  }
  for (int o = 16; o > 0; o >>= 1) {
    err += __shfl_xor_sync(0xFFFFFFFFu, err, o);
    ref += __shfl_xor_sync(0xFFFFFFFFu, ref, o);
  }
  if (threadIdx.x % 32 == 0) {
    atomicAdd(out, err);
    atomicAdd(out + 1, ref);
  }
}

// ---- host ------------------------------------------------------------------------------------

struct DevMem {
  void* p = nullptr;
  explicit DevMem(size_t bytes) { CHECK_CUDA(cudaMalloc(&p, bytes < 16 ? 16 : bytes)); }
  ~DevMem() { cudaFree(p); }
  DevMem(const DevMem&) = delete;
  DevMem& operator=(const DevMem&) = delete;
  template <typename T>
  T* as() const { return static_cast<T*>(p); }
};

int g_sms = 0;
int grid_for(int64_t n) { return static_cast<int>(std::min<int64_t>((n + 255) / 256, int64_t(g_sms) * 8)); }

struct Timer {
  DevMem flush{size_t(256) << 20};
  cudaEvent_t start, stop;
  Timer() {
    CHECK_CUDA(cudaEventCreate(&start));
    CHECK_CUDA(cudaEventCreate(&stop));
  }
  ~Timer() {
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
  }
  // Median milliseconds of each fns[j]() over `iters` rounds, interleaved: round i calls every
  // fn once, starting from fns[i % n], each call after an L2 flush.
  // NOTE: interleaved, not one fn's `iters` calls then the next's. Under the card's power cap
  // the SM clock moves by hundreds of MHz within a run, so variants timed
  // one after another ran at different clocks: down_proj's fused step at T = 512 moved 20%
  // between runs while the unfused step timed after it did not. Interleaved, every variant of
  // a (layer, T) sees the same clocks and the speedup column compares like with like.
  std::vector<double> medians_ms(int iters, const std::vector<std::function<void()>>& fns) {
    const size_t n = fns.size();
    for (const auto& fn : fns)
      for (int i = 0; i < kWarmup; ++i) fn();
    std::vector<std::vector<double>> ms(n);
    for (int i = 0; i < iters; ++i) {
      for (size_t k = 0; k < n; ++k) {
        const size_t j = (i + k) % n;
        CHECK_CUDA(cudaMemsetAsync(flush.p, i & 0xFF, size_t(256) << 20));
        CHECK_CUDA(cudaEventRecord(start));
        fns[j]();
        CHECK_CUDA(cudaEventRecord(stop));
        CHECK_CUDA(cudaEventSynchronize(stop));
        float t = 0;
        CHECK_CUDA(cudaEventElapsedTime(&t, start, stop));
        ms[j].push_back(t);
      }
    }
    CHECK_CUDA(cudaGetLastError());
    std::vector<double> medians(n);
    for (size_t j = 0; j < n; ++j) {
      std::sort(ms[j].begin(), ms[j].end());
      medians[j] = ms[j][ms[j].size() / 2];
    }
    return medians;
  }
  double median_ms(int iters, std::function<void()> fn) { return medians_ms(iters, {std::move(fn)})[0]; }
};

struct Shape {
  const char* name;
  int64_t out, in;
  int per_layer;  // occurrences per decoder layer
};
constexpr Shape kShapes[] = {{"q_proj/o_proj", 4096, 4096, 2},
                             {"k_proj/v_proj", 1024, 4096, 2},
                             {"gate_proj/up_proj", 14336, 4096, 2},
                             {"down_proj", 4096, 14336, 1}};
// The token counts benchmarked (--tokens replaces them).
std::vector<int64_t> g_tokens = {512, 2048, 4096};
constexpr int kLayers = 32;

enum Variant { kFusedBf16, kFusedInt8, kFusedMaster, kCublasF32, kCublasBf16, kUnfused, kFusedSr, kFusedInt8Sr,
               kFusedFp8, kFusedFp8Sr, kFusedInt4Sr, kVariants };
const char* kVariantNames[] = {"fused_adamw_bf16_states", "fused_adamw_int8_states", "fused_adamw_fp32_master",
                               "cublas_dw_fp32_out", "cublas_dw_bf16_out", "unfused_cublas_plus_adamw_bf16",
                               "fused_adamw_bf16_sr_weight_bf16_sr_states",
                               "fused_adamw_bf16_sr_weight_int8_states", "fused_adamw_fp8_states",
                               "fused_adamw_bf16_sr_weight_fp8_states",
                               "fused_adamw_bf16_sr_weight_int4_states"};

// Minimum bytes each variant moves per parameter element, and its input bytes.
double param_bytes(int v) {
  switch (v) {
    case kFusedBf16: case kFusedSr: return 12;       // W, m, v bf16: read + write
    case kFusedInt8: case kFusedInt8Sr: case kFusedFp8: case kFusedFp8Sr:
      return 4 + 4 + 2 * 2 * 4.0 / 64;  // W bf16 r+w, 2 codes r+w, 2 absmax r+w
    case kFusedInt4Sr: return 4 + 2 + 2 * 2 * 4.0 / 64;  // W bf16 r+w, 2 half-byte codes r+w, absmax
    case kFusedMaster: return 2 + 8 + 16;                    // W bf16 write, master r+w, m, v fp32 r+w
    case kCublasF32: return 4;
    case kCublasBf16: return 2;
    default: return 2 + 2 + 12;                              // dW write + read, AdamW bf16
  }
}

struct Result {
  const Shape* shape;
  int64_t tokens;
  double ms[kVariants];
  double epilogue_ms;      // fused AdamW bf16 states at T = 32
  double epilogue_sgd_ms;  // fused SGD (no states) at T = 32: the epilogue's floor
  double dw_rel_error;
};

// A layer's inputs for `tokens` tokens: X [T, in] in ±1, dY [T, out] in ±1e-2 (seeds 1, 2).
void fill_inputs(const DevMem& x, const DevMem& dy, int64_t tokens, const Shape& s) {
  fill_bf16<<<grid_for(tokens * s.in), 256>>>(x.as<uint16_t>(), tokens * s.in, 1, 1.0f);
  fill_bf16<<<grid_for(tokens * s.out), 256>>>(dy.as<uint16_t>(), tokens * s.out, 2, 1e-2f);
}

// AdamW's n bf16 weights and states: W in ±0.02, m in ±1e-3, v in (0, 1e-6] (seeds 3, 4, 5).
void fill_adamw_bf16(const DevMem& w, const DevMem& m, const DevMem& v, int64_t n) {
  fill_bf16<<<grid_for(n), 256>>>(w.as<uint16_t>(), n, 3, 0.02f);
  fill_bf16<<<grid_for(n), 256>>>(m.as<uint16_t>(), n, 4, 1e-3f);
  fill_bf16<<<grid_for(n), 256>>>(v.as<uint16_t>(), n, 5, 1e-6f, true);
}

// The non-finite values of the bf16 buffers `bufs` (n elements each).
unsigned long long nonfinite_bf16(std::initializer_list<const void*> bufs, int64_t n) {
  DevMem count(8);
  CHECK_CUDA(cudaMemset(count.p, 0, 8));
  for (const void* buf : bufs)
    count_nonfinite_bf16<<<grid_for(n), 256>>>(static_cast<const uint16_t*>(buf), n,
                                               count.as<unsigned long long>());
  unsigned long long h = 0;
  CHECK_CUDA(cudaMemcpy(&h, count.p, 8, cudaMemcpyDeviceToHost));
  return h;
}

forge_device cuda_device() {
  forge_device d{};
  d.kind = FORGE_DEVICE_CUDA;
  d.index = 0;
  d.stream = nullptr;  // the legacy default stream, where the events and cuBLAS run too
  return d;
}

forge_wgrad_args fused_args(const void* x, const void* dy, int64_t tokens, const Shape& s,
                            const forge_param& p, const forge_hparams& hp) {
  forge_wgrad_args a{};
  a.abi_version = FORGE_ABI_VERSION;
  a.device = cuda_device();
  a.tokens = tokens;
  a.x = x;
  a.x_dtype = FORGE_DTYPE_BF16;
  a.ldx = s.in;
  a.dy = dy;
  a.dy_dtype = FORGE_DTYPE_BF16;
  a.lddy = s.out;
  a.param = p;
  a.hparams = hp;
  return a;
}

// An AdamW parameter [rows, cols]: weight w and states m (state 0), v (state 1).
forge_param adamw_param(int64_t rows, int64_t cols, forge_weight_format wf, void* w,
                        forge_state_format sf, void* m, void* v) {
  forge_param p{};
  p.rows = rows;
  p.cols = cols;
  p.weight_format = wf;
  p.weight = w;
  p.state_format = sf;
  p.state[0] = m;
  p.state[1] = v;
  return p;
}

// p's weight with block AdamW states instead (int8, fp8 or int4: sf): codes m8, v8 and their absmax
// am8, av8, set from random fp32 values (m in ±1e-3, v in (0, 1e-6]) through the library's
// encoder; seeds `seed`, `seed + 1`.
forge_param with_block_adamw_states(forge_param p, forge_state_format sf, const DevMem& m8,
                                    const DevMem& v8, const DevMem& am8, const DevMem& av8,
                                    uint64_t seed, const forge_hparams& hp) {
  const int64_t n = p.rows * p.cols;
  p.state_format = sf;
  p.state[0] = m8.p;
  p.state[1] = v8.p;
  p.state_absmax[0] = am8.as<float>();
  p.state_absmax[1] = av8.as<float>();
  DevMem tmp(n * 4);
  fill_f32<<<grid_for(n), 256>>>(tmp.as<float>(), n, seed, 1e-3f, false);
  CHECK_FORGE(forge_state_from_fp32(&p, &hp, 0, tmp.as<float>(), cuda_device()));
  fill_f32<<<grid_for(n), 256>>>(tmp.as<float>(), n, seed + 1, 1e-6f, true);
  CHECK_FORGE(forge_state_from_fp32(&p, &hp, 1, tmp.as<float>(), cuda_device()));
  CHECK_CUDA(cudaDeviceSynchronize());
  return p;
}

// forge_elementwise_step's arguments for a bf16 gradient.
forge_elementwise_args elementwise_args(const void* grad, const forge_param& p,
                                        const forge_hparams& hp) {
  forge_elementwise_args a{};
  a.abi_version = FORGE_ABI_VERSION;
  a.device = cuda_device();
  a.grad = grad;
  a.grad_dtype = FORGE_DTYPE_BF16;
  a.param = p;
  a.hparams = hp;
  return a;
}

void run_cublas(cublasHandle_t h, const void* x, const void* dy, void* dw, cudaDataType out_type,
                int64_t tokens, const Shape& s) {
  const float alpha = 1.0f, beta = 0.0f;
  // Column-major view: dWᶜ (in × out) = Xᶜ (in × T) · (dYᶜ (out × T))ᵀ = row-major dW [out, in].
  CHECK_CUBLAS(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_T, static_cast<int>(s.in), static_cast<int>(s.out),
                            static_cast<int>(tokens), &alpha, x, CUDA_R_16BF, static_cast<int>(s.in), dy,
                            CUDA_R_16BF, static_cast<int>(s.out), &beta, dw, out_type, static_cast<int>(s.in),
                            CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

// Writes `text` to `path` (a report next to the printed one), its folder made first; says so on
// stderr when it cannot.
void write_text(const std::string& path, const std::string& text) {
  std::error_code ec;
  std::filesystem::create_directories(std::filesystem::path(path).parent_path(), ec);
  if (FILE* f = std::fopen(path.c_str(), "w")) {
    std::fputs(text.c_str(), f);
    std::fclose(f);
  } else {
    std::fprintf(stderr, "wgrad_bench: cannot write %s\n", path.c_str());
  }
}

std::string fmt(const char* f, double v) {
  char b[64];
  std::snprintf(b, sizeof(b), f, v);
  return b;
}

// ---- --trace: where each CTA's time goes ---------------------------------------------------
//
// With FORGE_DEBUG_TRACE set (see src/cuda/heuristics.h), the Hopper kernel writes per CTA: SM clock
// at start, when sC holds the gradient (main loop done), at end; global ns at start and end;
// SM id and blockIdx.x. The summary below, per launch:
//  - main / update: mean cycles of a CTA's main loop (start to sC ready, including the stagger
//    wait) and of its update (sC ready to end), in µs at the SMs' measured clock;
//  - the share of SM-time (from the SM's first CTA start to its last CTA end) with each mix
//    of resident CTAs: "M+U" = one CTA in its main loop while another updates (the overlap the
//    two-CTA design relies on), "M+M" / "U+U" = both in the same phase, "M" / "U" = a single
//    CTA, "-" = none (between CTAs: retire, launch, and the first instructions before the
//    start stamp).
constexpr int kTraceMaxCtas = 1 << 16;

struct TraceSummary {
  int ctas = 0;
  double span_us = 0, main_us = 0, update_us = 0, mhz = 0;
  double share[6] = {};  // -, M, U, M+M, M+U, U+U
};

TraceSummary summarize_trace(const std::vector<unsigned long long>& rec, int ctas) {
  TraceSummary t;
  t.ctas = ctas;
  std::map<int, std::vector<int>> by_sm;
  unsigned long long ns0 = ~0ull, ns1 = 0;
  double cycles = 0, ns = 0, main_sum = 0, update_sum = 0;
  for (int i = 0; i < ctas; ++i) {
    const unsigned long long* r = &rec[size_t(i) * 6];
    by_sm[int(r[5] >> 32)].push_back(i);
    ns0 = std::min(ns0, r[3]);
    ns1 = std::max(ns1, r[4]);
    cycles += double(r[2] - r[0]);
    ns += double(r[4] - r[3]);
    main_sum += double(r[1] - r[0]);
    update_sum += double(r[2] - r[1]);
  }
  const double ghz = ns > 0 ? cycles / ns : 1.0;  // cycles per ns
  t.mhz = ghz * 1e3;
  t.span_us = double(ns1 - ns0) / 1e3;
  t.main_us = main_sum / ctas / ghz / 1e3;
  t.update_us = update_sum / ctas / ghz / 1e3;
  double total = 0;
  for (auto& [sm, ids] : by_sm) {
    // Events on this SM's clock: +1 main at start, main -> update at sC ready, -1 at end.
    std::vector<std::pair<unsigned long long, int>> ev;  // (clock, kind): 0 start, 1 sC, 2 end
    unsigned long long c0 = ~0ull, c1 = 0;
    for (int i : ids) {
      const unsigned long long* r = &rec[size_t(i) * 6];
      ev.push_back({r[0], 0});
      ev.push_back({r[1], 1});
      ev.push_back({r[2], 2});
      c0 = std::min(c0, r[0]);
      c1 = std::max(c1, r[2]);
    }
    std::sort(ev.begin(), ev.end());
    int in_main = 0, in_update = 0;
    unsigned long long prev = c0;
    for (const auto& [c, kind] : ev) {
      const double dt = double(c - prev);
      int slot = 0;
      if (in_main + in_update == 0) slot = 0;
      else if (in_main == 1 && in_update == 0) slot = 1;
      else if (in_main == 0 && in_update == 1) slot = 2;
      else if (in_main >= 2 && in_update == 0) slot = 3;
      else if (in_main >= 1 && in_update >= 1) slot = 4;
      else slot = 5;
      t.share[slot] += dt;
      prev = c;
      if (kind == 0) ++in_main;
      else if (kind == 1) { --in_main; ++in_update; }
      else --in_update;
    }
    total += double(c1 - c0);
  }
  for (double& x : t.share) x = total > 0 ? x / total : 0;
  return t;
}

// The persistent kernel's records (one CTA per SM looping over tiles; the layout is
// sm90_wgrad.cuh's PersistentTrace, marked by kPersistentTraceFlag in the start word, whether
// the library chose that kernel or FORGE_DEBUG_PERSISTENT=1 forced it): per tile, the mean CTA
// span in kilocycles, and the shares of the span that math thread 0 waited on loads (full
// barriers), that the producer waited for free stages (empty barriers), that the main loop
// waited for sC to be free (the update behind), and that the update waited for sC to be full
// (the main loop behind).
constexpr unsigned long long kPersistentTraceFlag = 1ull << 63;  // as in sm90_wgrad.cuh
struct PersistentSummary {
  int ctas = 0;
  double tiles = 0, kcycles_per_tile = 0, load = 0, empty = 0, slot = 0, grad = 0;
};
PersistentSummary summarize_persistent(const std::vector<unsigned long long>& rec, int records) {
  PersistentSummary t;
  double span = 0, tiles = 0, load = 0, empty = 0, slot = 0, grad = 0;
  for (int i = 0; i < records; ++i) {
    const unsigned long long* r = &rec[size_t(i) * 6];
    if (r[2] == 0) continue;  // past the grid
    ++t.ctas;
    span += double(r[2] - (r[0] & ~kPersistentTraceFlag));
    tiles += double(r[5] & 0xFFFF);
    load += double(r[1]);
    empty += double(r[5] >> 16);
    slot += double(r[3]);
    grad += double(r[4]);
  }
  if (t.ctas == 0 || span <= 0) return t;
  t.tiles = tiles / t.ctas;
  t.kcycles_per_tile = span / tiles / 1e3;
  t.load = load / span;
  t.empty = empty / span;
  t.slot = slot / span;
  t.grad = grad / span;
  return t;
}

// ---- --soak: each variant's SM clock, power and energy per call -------------------------------
//
// Under the card's power cap the SM clock follows the power drawn, so two kernels that each run
// at full speed alone can take the sum of their times together even when their resources would
// overlap. --soak SECONDS runs each variant of one layer back to back (no L2 flush) for that long
// while nvidia-smi samples the SM clock, the power drawn and the clock-event reasons every 50 ms
// ($OUT/soak-clocks.csv); per variant it reports ms per call, the mean SM clock and power over
// the window (its first second left out: nvidia-smi's power is a 1 s average), the energy per
// call (power × ms) and the share of samples with the software power cap active (reason bit 0x4).

// The local time in nvidia-smi's timestamp format ("2026/12/08 01:23:45.678"): sample and
// window times compare as strings.
std::string smi_time_now() {
  const auto now = std::chrono::system_clock::now();
  const std::time_t secs = std::chrono::system_clock::to_time_t(now);
  const int ms = static_cast<int>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                      now.time_since_epoch()).count() % 1000);
  char stamp[32], out[40];
  std::strftime(stamp, sizeof(stamp), "%Y/%m/%d %H:%M:%S", std::localtime(&secs));
  std::snprintf(out, sizeof(out), "%s.%03d", stamp, ms);
  return out;
}

struct ClockSample {
  std::string time;
  double mhz = 0, watts = 0;
  unsigned long long reasons = 0;
};

// nvidia-smi in the background writing `path`; stop() ends it and reads the samples back.
class ClockSampler {
 public:
  explicit ClockSampler(std::string path) : path_(std::move(path)) {
    if (std::system("command -v nvidia-smi >/dev/null 2>&1") != 0) return;
    std::string fields = "timestamp,clocks.sm,power.draw";
    for (const char* extra : {"clocks_event_reasons.active", "clocks_throttle_reasons.active"}) {
      const std::string probe = "nvidia-smi --query-gpu=" + fields + "," + extra +
                                " --format=csv >/dev/null 2>&1";
      if (std::system(probe.c_str()) == 0) {
        fields += std::string(",") + extra;
        break;
      }
    }
    const std::string cmd = "nvidia-smi --query-gpu=" + fields +
                            " --format=csv,noheader,nounits -lms 50 -f '" + path_ +
                            "' & echo $! > '" + path_ + ".pid'";
    running_ = std::system(cmd.c_str()) == 0;
  }
  std::vector<ClockSample> stop() {
    std::vector<ClockSample> samples;
    if (!running_) return samples;
    running_ = false;
    const std::string kill = "kill $(cat '" + path_ + ".pid') 2>/dev/null; rm -f '" + path_ + ".pid'";
    (void)std::system(kill.c_str());
    FILE* f = std::fopen(path_.c_str(), "r");
    if (f == nullptr) return samples;
    char line[256];
    while (std::fgets(line, sizeof(line), f)) {
      // "2026/12/08 01:23:45.678, 1755, 612.34, 0x0000000000000004"
      char time[40] = {}, reasons[40] = {};
      double mhz = 0, watts = 0;
      if (std::sscanf(line, "%39[^,], %lf, %lf, %39s", time, &mhz, &watts, reasons) < 3) continue;
      ClockSample s;
      s.time = time;
      s.mhz = mhz;
      s.watts = watts;
      s.reasons = std::strtoull(reasons, nullptr, 16);
      samples.push_back(s);
    }
    std::fclose(f);
    return samples;
  }
  ~ClockSampler() { (void)stop(); }

 private:
  std::string path_;
  bool running_ = false;
};

struct SoakWindow {
  std::string variant;  // a name for results.csv (snake_case)
  int64_t tokens = 0;
  std::string from, to;  // nvidia-smi times; from: one second after the variant started
  double ms_per_call = 0;
  int64_t calls = 0;
};

// Runs `fn` back to back for `seconds`; returns its window (timed with events, per call).
SoakWindow soak_variant(const std::string& variant, int64_t tokens, double seconds,
                        const std::function<void()>& fn) {
  for (int i = 0; i < kWarmup; ++i) fn();
  CHECK_CUDA(cudaDeviceSynchronize());
  SoakWindow w;
  w.variant = variant;
  w.tokens = tokens;
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  const auto t0 = std::chrono::steady_clock::now();
  std::string begun = smi_time_now();
  CHECK_CUDA(cudaEventRecord(start));
  // NOTE: batches of calls between host checks, so the queue never runs dry.
  while (std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() < seconds) {
    for (int i = 0; i < 8; ++i) fn();
    w.calls += 8;
    CHECK_CUDA(cudaEventRecord(stop));
    CHECK_CUDA(cudaEventSynchronize(stop));
    if (w.from.empty() &&
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() >= 1.0)
      w.from = smi_time_now();
  }
  float ms = 0;
  CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
  w.to = smi_time_now();
  if (w.from.empty()) w.from = begun;
  w.ms_per_call = ms / static_cast<double>(w.calls);
  CHECK_CUDA(cudaGetLastError());
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return w;
}
}  // namespace

int main(int argc, char** argv) {
  std::string out_dir = std::getenv("OUT") ? std::getenv("OUT") : "out";
  int iters = 30;
  bool quick = false;
  // --profile: for Nsight Compute, launch only (4096×4096; the order is listed there); no
  // timing.
  bool profile = false;
  // --trace: time a few (layer, T) cases of the fused step and trace each CTA's phases
  // (summarize_trace); the raw records go to $OUT/trace-*.csv. Runs with different
  // FORGE_DEBUG_STAGGER_NS, or builds with an experiment's compile definitions, are A/B tests
  // (scripts/gpu_check.sh trace).
  bool trace = false;
  // --host-cost: the host's time per forge_wgrad_step call (argument checks, dispatch, tensor
  // maps, launch), against one empty kernel launch and one cuBLAS GEMM; no GPU timing.
  bool host_cost = false;
  // --reverse-shapes: time the layers in the reverse order (down_proj first). down_proj's fused
  // step at T = 512 has measured 0.253-0.310 ms between processes in the usual order, where it
  // runs right after gate_proj's T = 4096 cases, against 0.247 with --quick:
  // this order says whether its place in the run is the cause.
  bool reverse_shapes = false;
  // --run-scalars: every AdamW step (fused and element-wise) reads its scalars from a device
  // buffer (forge_hparams.run_scalars, filled once: the hyper-parameters differ in step only),
  // as the steps of a captured CUDA graph do: the kRunScalars kernels.
  bool run_scalars = false;
  // --soak SECONDS: each variant of gate_proj back to back for that long at each --tokens T,
  // with the SM clock, power and energy per call (the --soak note above main).
  double soak_seconds = 0;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--out") && i + 1 < argc) out_dir = argv[++i];
    else if (!std::strcmp(argv[i], "--iters") && i + 1 < argc) iters = std::max(20, std::atoi(argv[++i]));
    else if (!std::strcmp(argv[i], "--quick")) quick = true;
    else if (!std::strcmp(argv[i], "--tokens") && i + 1 < argc) {
      // --tokens 1024,8192: benchmark these token counts instead of 512, 2048, 4096.
      g_tokens.clear();
      for (const char* c = argv[++i]; *c;) {
        char* end = nullptr;
        const long long t = std::strtoll(c, &end, 10);
        if (end == c || t < 1) {
          std::fprintf(stderr, "--tokens: expected positive integers separated by commas\n");
          return 2;
        }
        g_tokens.push_back(t);
        c = *end == ',' ? end + 1 : end;
      }
    }
    else if (!std::strcmp(argv[i], "--profile")) profile = true;
    else if (!std::strcmp(argv[i], "--trace")) trace = true;
    else if (!std::strcmp(argv[i], "--host-cost")) host_cost = true;
    else if (!std::strcmp(argv[i], "--reverse-shapes")) reverse_shapes = true;
    else if (!std::strcmp(argv[i], "--run-scalars")) run_scalars = true;
    else if (!std::strcmp(argv[i], "--soak") && i + 1 < argc) {
      soak_seconds = std::atof(argv[++i]);
      if (!(soak_seconds >= 2)) {
        std::fprintf(stderr, "--soak: expected seconds >= 2 (the first second is left out)\n");
        return 2;
      }
    }
    else {
      std::fprintf(stderr, "unknown argument %s (--out DIR, --iters N, --quick, --tokens LIST, --profile, --trace, "
                   "--host-cost, --reverse-shapes, --run-scalars, --soak SECONDS)\n", argv[i]);
      return 2;
    }
  }
  std::string command;
  for (int i = 0; i < argc; ++i) command += (i ? " " : "") + std::string(argv[i]);

  CHECK_CUDA(cudaSetDevice(0));
  DevMem trace_records(trace ? size_t(kTraceMaxCtas) * 6 * 8 : 16);
  if (trace) {
    // Before the first call into the library: it reads its FORGE_DEBUG_* switches once.
    char value[64];
    std::snprintf(value, sizeof(value), "%llx:%d",
                  static_cast<unsigned long long>(reinterpret_cast<uintptr_t>(trace_records.p)),
                  kTraceMaxCtas);
    setenv("FORGE_DEBUG_TRACE", value, 1);
  }
  cudaDeviceProp prop{};
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  g_sms = prop.multiProcessorCount;
  cublasHandle_t handle;
  CHECK_CUBLAS(cublasCreate(&handle));
  Timer timer;

  forge_hparams adamw{};
  CHECK_FORGE(forge_hparams_default(FORGE_RULE_ADAMW, &adamw));
  forge_hparams sgd{};
  CHECK_FORGE(forge_hparams_default(FORGE_RULE_SGD, &sgd));
  sgd.lr = 1.0;
  sgd.weight_decay = 0.0;
  DevMem run_buffer(FORGE_RUN_SCALARS_BYTES);
  if (run_scalars) {
    unsigned char filled[FORGE_RUN_SCALARS_BYTES];
    CHECK_FORGE(forge_run_scalars_fill(&adamw, filled, sizeof(filled)));
    CHECK_CUDA(cudaMemcpy(run_buffer.p, filled, sizeof(filled), cudaMemcpyHostToDevice));
    adamw.run_scalars = run_buffer.p;
  }

  std::vector<Result> results;
  if (host_cost) {
    // Batches of kBatch calls timed on the host clock (enqueue only: the GPU is synchronized
    // between batches, outside the timing), median over kBatches batches, per call.
    constexpr int kBatch = 50, kBatches = 41;
    auto per_call_us = [&](auto&& call) {
      std::vector<double> us;
      for (int b = 0; b < kBatches + 2; ++b) {
        CHECK_CUDA(cudaDeviceSynchronize());
        const auto t0 = std::chrono::steady_clock::now();
        for (int i = 0; i < kBatch; ++i) call();
        const auto t1 = std::chrono::steady_clock::now();
        const double batch_us = std::chrono::duration<double, std::micro>(t1 - t0).count();
        if (b >= 2) us.push_back(batch_us / kBatch);
      }
      CHECK_CUDA(cudaDeviceSynchronize());
      std::nth_element(us.begin(), us.begin() + us.size() / 2, us.end());
      return us[us.size() / 2];
    };
    std::string md = "# wgrad_bench --host-cost: host µs per call (median of " +
                     std::to_string(kBatches) + " batches of " + std::to_string(kBatch) +
                     ", enqueue only)\n\n| call | layer | T | µs |\n| --- | --- | --- | --- |\n";
    char line[256];
    std::snprintf(line, sizeof(line), "| empty kernel launch | - | - | %.2f |\n",
                  per_call_us([] { noop_kernel<<<1, 1>>>(); }));
    md += line;
    const Shape tiny{"128×128", 128, 128, 0};
    for (const Shape* sp : {&tiny, &kShapes[0]}) {
      const Shape& s = *sp;
      const int64_t n = s.out * s.in, t = 512;
      DevMem x(size_t(t) * s.in * 2), dy(size_t(t) * s.out * 2), w(n * 2), m(n * 2), v(n * 2),
          g(n * 2);
      fill_inputs(x, dy, t, s);
      fill_adamw_bf16(w, m, v, n);
      const forge_param psr = adamw_param(s.out, s.in, FORGE_WEIGHT_BF16_STOCHASTIC, w.p,
                                          FORGE_STATE_BF16_STOCHASTIC, m.p, v.p);
      forge_hparams hp = adamw;
      const double us = per_call_us([&] {
        forge_wgrad_args a = fused_args(x.p, dy.p, t, s, psr, hp);
        hp.step = hp.step % 1000 + 1;
        CHECK_FORGE(forge_wgrad_step(&a));
      });
      std::snprintf(line, sizeof(line),
                    "| forge_wgrad_step (SR W + SR states) | %s | %lld | %.2f |\n", s.name,
                    static_cast<long long>(t), us);
      md += line;
      const double gemm_us =
          per_call_us([&] { run_cublas(handle, x.p, dy.p, g.p, CUDA_R_16BF, t, s); });
      std::snprintf(line, sizeof(line), "| cublasGemmEx (dW, bf16 out) | %s | %lld | %.2f |\n",
                    s.name, static_cast<long long>(t), gemm_us);
      md += line;
    }
    std::fputs(md.c_str(), stdout);
    write_text(out_dir + "/host-cost.md", md);
    cublasDestroy(handle);
    return 0;
  }
  if (trace) {
    struct Case {
      Shape shape;
      int64_t tokens;
    };
    const Shape lm_head{"lm_head", 128256, 4096, 0};
    const Case cases[] = {{kShapes[0], 32},   {kShapes[0], 512},  {kShapes[0], 1024},
                          {kShapes[0], 2048}, {kShapes[0], 4096}, {kShapes[1], 512},
                          {kShapes[1], 2048}, {kShapes[2], 512},  {kShapes[2], 2048},
                          {kShapes[2], 4096}, {kShapes[3], 512},  {kShapes[3], 2048},
                          {lm_head, 512},     {lm_head, 2048}};
    const char* stagger = std::getenv("FORGE_DEBUG_STAGGER_NS");
    std::string md = "# wgrad_bench --trace (FORGE_DEBUG_STAGGER_NS=" +
                     std::string(stagger ? stagger : "unset: the library's default") + ")\n\n" +
                     "| layer | T | states | ms (median) | CTAs | span µs | main µs | update µs | "
                     "SM MHz | - | M | U | M+M | M+U | U+U |\n" +
                     "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n";
    for (const Case& c : cases) {
      const Shape& s = c.shape;
      const int64_t n = s.out * s.in, t = c.tokens;
      DevMem x(size_t(t) * s.in * 2), dy(size_t(t) * s.out * 2), w(n * 2), m(n * 2), v(n * 2);
      fill_inputs(x, dy, t, s);
      fill_adamw_bf16(w, m, v, n);
      const forge_param p16 =
          adamw_param(s.out, s.in, FORGE_WEIGHT_BF16, w.p, FORGE_STATE_BF16, m.p, v.p);
      const forge_param psr = adamw_param(s.out, s.in, FORGE_WEIGHT_BF16_STOCHASTIC, w.p,
                                          FORGE_STATE_BF16_STOCHASTIC, m.p, v.p);
      forge_hparams hp = adamw;
      for (const forge_param* q : {&p16, &psr}) {
        auto step = [&] {
          forge_wgrad_args a = fused_args(x.p, dy.p, t, s, *q, hp);
          hp.step = hp.step % 1000 + 1;
          CHECK_FORGE(forge_wgrad_step(&a));
        };
        const double ms = timer.median_ms(iters, step);
        const int64_t tiles = ((s.out + 127) / 128) * ((s.in + 127) / 128);
        CHECK_CUDA(cudaMemset(trace_records.p, 0, size_t(kTraceMaxCtas) * 6 * 8));
        CHECK_CUDA(cudaMemset(timer.flush.p, 0, size_t(256) << 20));
        step();
        CHECK_CUDA(cudaDeviceSynchronize());
        const int ctas = static_cast<int>(std::min<int64_t>(tiles, kTraceMaxCtas));
        std::vector<unsigned long long> rec(size_t(ctas) * 6);
        CHECK_CUDA(cudaMemcpy(rec.data(), trace_records.p, rec.size() * 8, cudaMemcpyDeviceToHost));
        const char* states = q == &p16 ? "bf16" : "bf16 SR";
        if (rec[2] == 0) {  // no records: not the Hopper kernel (or split-K's partial CTAs)
          std::printf("%s T=%lld %s: %.3f ms, no trace records\n", s.name,
                      static_cast<long long>(t), states, ms);
          continue;
        }
        char line[512];
        if (rec[0] & kPersistentTraceFlag) {
          const PersistentSummary ps = summarize_persistent(rec, ctas);
          std::snprintf(line, sizeof(line),
                        "| %s %lldx%lld | %lld | %s | %.4f | persistent: %d CTAs, %.1f tiles each "
                        "| %.2f kcycles/tile | load wait %.2f | empty wait %.2f | sC-free wait %.2f "
                        "| sC-full wait %.2f |\n",
                        s.name, static_cast<long long>(s.out), static_cast<long long>(s.in),
                        static_cast<long long>(t), states, ms, ps.ctas, ps.tiles,
                        ps.kcycles_per_tile, ps.load, ps.empty, ps.slot, ps.grad);
          md += line;
          std::printf("%s", line);
          std::fflush(stdout);
          continue;
        }
        const TraceSummary ts = summarize_trace(rec, ctas);
        std::snprintf(line, sizeof(line),
                      "| %s %lldx%lld | %lld | %s | %.4f | %d | %.1f | %.2f | %.2f | %.0f | %.2f | "
                      "%.2f | %.2f | %.2f | %.2f | %.2f |\n",
                      s.name, static_cast<long long>(s.out), static_cast<long long>(s.in),
                      static_cast<long long>(t), states, ms, ts.ctas, ts.span_us, ts.main_us,
                      ts.update_us, ts.mhz, ts.share[0], ts.share[1], ts.share[2], ts.share[3],
                      ts.share[4], ts.share[5]);
        md += line;
        std::printf("%s", line);
        std::fflush(stdout);
        if (q == &p16 && (std::strcmp(s.name, "q_proj/o_proj") == 0)) {
          const std::string path = out_dir + "/trace-4096x4096-T" + std::to_string(t) + ".csv";
          if (FILE* f = std::fopen(path.c_str(), "w")) {
            std::fputs("clock_start,clock_main_end,clock_end,ns_start,ns_end,sm,block\n", f);
            for (int i = 0; i < ctas; ++i) {
              const unsigned long long* r = &rec[size_t(i) * 6];
              std::fprintf(f, "%llu,%llu,%llu,%llu,%llu,%llu,%llu\n", r[0], r[1], r[2], r[3],
                           r[4], r[5] >> 32, r[5] & 0xFFFFFFFFull);
            }
            std::fclose(f);
          }
        }
      }
    }
    write_text(out_dir + "/trace.md", md);
    cublasDestroy(handle);
    return 0;
  }
  if (profile) {
    const Shape& s = kShapes[0];
    const int64_t n = s.out * s.in, t_max = 4096;
    DevMem x(size_t(t_max) * s.in * 2), dy(size_t(t_max) * s.out * 2), w(n * 2), m(n * 2), v(n * 2), g(n * 2),
        m8(n), v8(n), am8(n / 64 * 4), av8(n / 64 * 4);
    fill_inputs(x, dy, t_max, s);
    fill_adamw_bf16(w, m, v, n);
    fill_bf16<<<grid_for(n), 256>>>(g.as<uint16_t>(), n, 6, 1e-2f);
    // forge.optim.AdamW's two defaults: bf16 SR weight with bf16 SR states, and with int8.
    const forge_param p = adamw_param(s.out, s.in, FORGE_WEIGHT_BF16_STOCHASTIC, w.p,
                                      FORGE_STATE_BF16_STOCHASTIC, m.p, v.p);
    const forge_param p8 =
        with_block_adamw_states(p, FORGE_STATE_INT8_BLOCK64, m8, v8, am8, av8, 9, adamw);
    // Launch order (what gpu_check.sh profile's ncu counts): the fused step at T = 32 (the
    // update alone) with bf16 SR states, then int8; the same at T = 512; the element-wise
    // step with bf16 SR states, then int8; the unfused AdamW pass; bf16 nearest (below).
    for (int64_t tokens : {int64_t(32), int64_t(512)}) {
      for (const forge_param* q : {&p, &p8}) {
        forge_wgrad_args a = fused_args(x.p, dy.p, tokens, s, *q, adamw);
        CHECK_FORGE(forge_wgrad_step(&a));
      }
    }
    for (const forge_param* q : {&p, &p8}) {
      const forge_elementwise_args a = elementwise_args(g.p, *q, adamw);
      CHECK_FORGE(forge_elementwise_step(&a));
    }
    AdamWScalars as{0.1f, 0.999f, 0.001f, 1e-8f, std::sqrt(0.001f), -1e-2f, 1.0f - 1e-5f};
    adamw_bf16<<<grid_for(n / 8), 256>>>(g.as<uint4>(), w.as<uint4>(), m.as<uint4>(), v.as<uint4>(), n / 8, as);
    // Then nearest-rounded bf16 W and states at T = 32 and 512, the configuration the
    // speedup column times (8th and 9th launches).
    const forge_param p16 = adamw_param(s.out, s.in, FORGE_WEIGHT_BF16, w.p, FORGE_STATE_BF16,
                                        m.p, v.p);
    for (int64_t tokens : {int64_t(32), int64_t(512)}) {
      forge_wgrad_args a = fused_args(x.p, dy.p, tokens, s, p16, adamw);
      CHECK_FORGE(forge_wgrad_step(&a));
    }
    // Then fp8 states: a nearest bf16 weight at T = 32 and 512, the SR weight at 512 (10th to
    // 12th launches).
    DevMem mf8(n), vf8(n), amf8(n / 64 * 4), avf8(n / 64 * 4);
    const forge_param pf8 =
        with_block_adamw_states(p16, FORGE_STATE_FP8_BLOCK64, mf8, vf8, amf8, avf8, 9, adamw);
    forge_param pf8sr = pf8;
    pf8sr.weight_format = FORGE_WEIGHT_BF16_STOCHASTIC;
    for (const auto& [q, tokens] : {std::pair<const forge_param*, int64_t>{&pf8, 32}, {&pf8, 512},
                                    {&pf8sr, 512}}) {
      forge_wgrad_args a = fused_args(x.p, dy.p, tokens, s, *q, adamw);
      CHECK_FORGE(forge_wgrad_step(&a));
    }
    // Then int4 states beside the SR weight at T = 512 (13th launch), int8's 4th.
    DevMem mi4(n / 2), vi4(n / 2), ami4(n / 64 * 4), avi4(n / 64 * 4);
    const forge_param pi4 =
        with_block_adamw_states(p, FORGE_STATE_INT4_BLOCK64, mi4, vi4, ami4, avi4, 9, adamw);
    {
      forge_wgrad_args a = fused_args(x.p, dy.p, 512, s, pi4, adamw);
      CHECK_FORGE(forge_wgrad_step(&a));
    }
    CHECK_CUDA(cudaDeviceSynchronize());
    std::printf("profile launches done\n");
    return 0;
  }
  if (soak_seconds > 0) {
    // gate_proj (14336 × 4096, the layer with most of the GEMM time) at each --tokens T.
    const Shape& s = kShapes[2];
    const int64_t n = s.out * s.in;
    const int64_t t_max = *std::max_element(g_tokens.begin(), g_tokens.end());
    DevMem x(size_t(t_max) * s.in * 2), dy(size_t(t_max) * s.out * 2), w(n * 2), m16(n * 2),
        v16(n * 2), m8(n), v8(n), am8((n / 64 + s.out) * 4), av8((n / 64 + s.out) * 4),
        dw(n * 4), grad16(n * 2);
    fill_inputs(x, dy, t_max, s);
    fill_adamw_bf16(w, m16, v16, n);
    fill_bf16<<<grid_for(n), 256>>>(grad16.as<uint16_t>(), n, 6, 1e-2f);
    const forge_param p16 =
        adamw_param(s.out, s.in, FORGE_WEIGHT_BF16, w.p, FORGE_STATE_BF16, m16.p, v16.p);
    forge_param psr = p16;
    psr.weight_format = FORGE_WEIGHT_BF16_STOCHASTIC;
    psr.state_format = FORGE_STATE_BF16_STOCHASTIC;
    forge_param p8sr =
        with_block_adamw_states(p16, FORGE_STATE_INT8_BLOCK64, m8, v8, am8, av8, 9, adamw);
    p8sr.weight_format = FORGE_WEIGHT_BF16_STOCHASTIC;
    forge_param psgd = p16;  // SGD without momentum: W read and written, nothing else
    psgd.state_format = FORGE_STATE_FP32;
    psgd.state[0] = psgd.state[1] = nullptr;
    forge_hparams sgd_step{};
    CHECK_FORGE(forge_hparams_default(FORGE_RULE_SGD, &sgd_step));
    sgd_step.lr = 1e-6;
    forge_hparams hp = adamw;
    auto fused = [&](const forge_param& p, int64_t tokens) {
      forge_wgrad_args a = fused_args(x.p, dy.p, tokens, s, p, hp);
      hp.step = hp.step % 1000 + 1;
      CHECK_FORGE(forge_wgrad_step(&a));
    };
    const AdamWScalars as = timed_adamw_scalars();
    auto adamw_pass = [&] {
      adamw_bf16<<<grid_for(n / 8), 256>>>(grad16.as<uint4>(), w.as<uint4>(), m16.as<uint4>(),
                                           v16.as<uint4>(), n / 8, as);
    };

    ClockSampler sampler(out_dir + "/soak-clocks.csv");
    std::vector<SoakWindow> windows;
    for (int64_t t : g_tokens) {
      windows.push_back(soak_variant("cublas_dw_fp32_out", t, soak_seconds, [&] {
        run_cublas(handle, x.p, dy.p, dw.p, CUDA_R_32F, t, s);
      }));
      windows.push_back(soak_variant("unfused_cublas_plus_adamw_bf16", t, soak_seconds, [&] {
        run_cublas(handle, x.p, dy.p, grad16.p, CUDA_R_16BF, t, s);
        adamw_pass();
      }));
      windows.push_back(soak_variant("fused_sgd_bf16_no_states", t, soak_seconds, [&] {
        forge_wgrad_args a = fused_args(x.p, dy.p, t, s, psgd, sgd_step);
        CHECK_FORGE(forge_wgrad_step(&a));
      }));
      windows.push_back(soak_variant(kVariantNames[kFusedBf16], t, soak_seconds,
                                     [&] { fused(p16, t); }));
      windows.push_back(soak_variant(kVariantNames[kFusedSr], t, soak_seconds,
                                     [&] { fused(psr, t); }));
      windows.push_back(soak_variant(kVariantNames[kFusedInt8Sr], t, soak_seconds,
                                     [&] { fused(p8sr, t); }));
    }
    // The update alone (the fused step at T = 32) and the unfused AdamW pass alone.
    windows.push_back(soak_variant(kVariantNames[kFusedBf16], 32, soak_seconds,
                                   [&] { fused(p16, 32); }));
    windows.push_back(soak_variant("adamw_bf16_pass", 0, soak_seconds, adamw_pass));
    const std::vector<ClockSample> samples = sampler.stop();
    // As in the timed rows: a NaN weight or state would have timed the exact fallback path.
    if (const unsigned long long h = nonfinite_bf16({w.p, m16.p, v16.p}, n)) {
      std::fprintf(stderr, "--soak: %llu non-finite weight/state values after the soak: results "
                   "invalid\n", h);
      return 1;
    }

    // The FORGE_DEBUG_* switches set, in front of the command (results.csv keeps such runs
    // apart: they are experiments, never the current figure).
    std::string recorded = command;
    for (const char* knob : {"FORGE_DEBUG_PERSISTENT", "FORGE_DEBUG_WGMMA"})
      if (const char* v = std::getenv(knob)) recorded = std::string(knob) + "=" + v + " " + recorded;
    char date[32];
    const std::time_t now = std::time(nullptr);
    std::strftime(date, sizeof(date), "%Y-%m-%d %H:%M UTC", std::gmtime(&now));
    std::string md = "# wgrad_bench --soak " + fmt("%.0f", soak_seconds) + ": " + prop.name +
                     ", " + s.name + " " + std::to_string(s.out) + "×" + std::to_string(s.in) +
                     "\n\n- command: `" + recorded + "`\n" +
                     "- each variant back to back (no L2 flush) for the soak time; clock and "
                     "power: means of nvidia-smi's 50 ms samples after the variant's first "
                     "second; energy per call = mean power × ms per call; power cap: share of "
                     "those samples with the SW power cap reason (0x4) active; T = 32: the "
                     "update alone; T = 0: the AdamW pass alone (no GEMM)\n\n" +
                     "| variant | T | calls | ms per call | SM MHz | W | mJ per call | power cap | "
                     "samples |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- |\n";
    std::string json = "{\n  \"benchmark\": \"wgrad_soak\",\n  \"date\": \"" + std::string(date) +
                       "\",\n  \"gpu\": \"" + prop.name + "\",\n  \"command\": \"" + recorded +
                       "\",\n  \"layer\": \"" + s.name + "\",\n  \"seconds\": " +
                       fmt("%.1f", soak_seconds) + ",\n  \"results\": [";
    for (size_t k = 0; k < windows.size(); ++k) {
      const SoakWindow& win = windows[k];
      double mhz = 0, watts = 0, capped = 0;
      int count = 0;
      for (const ClockSample& c : samples)
        if (c.time >= win.from && c.time <= win.to) {
          mhz += c.mhz;
          watts += c.watts;
          capped += (c.reasons & 0x4ull) != 0;
          ++count;
        }
      if (count > 0) {
        mhz /= count;
        watts /= count;
        capped /= count;
      }
      const std::string dash = "-";
      md += "| " + win.variant + " | " + std::to_string(win.tokens) + " | " +
            std::to_string(win.calls) + " | " + fmt("%.4f", win.ms_per_call) + " | " +
            (count ? fmt("%.0f", mhz) : dash) + " | " + (count ? fmt("%.0f", watts) : dash) +
            " | " + (count ? fmt("%.1f", watts * win.ms_per_call) : dash) + " | " +
            (count ? fmt("%.2f", capped) : dash) + " | " + std::to_string(count) + " |\n";
      json += std::string(k ? "," : "") + "\n    {\"variant\": \"" + win.variant +
              "\", \"T\": " + std::to_string(win.tokens) + ", \"calls\": " +
              std::to_string(win.calls) + ", \"ms\": " + fmt("%.5f", win.ms_per_call);
      if (count > 0)
        json += ", \"sm_mhz\": " + fmt("%.1f", mhz) + ", \"watts\": " + fmt("%.1f", watts) +
                ", \"mj_per_call\": " + fmt("%.3f", watts * win.ms_per_call) +
                ", \"power_cap_share\": " + fmt("%.3f", capped);
      json += "}";
    }
    json += "\n  ]\n}\n";
    write_text(out_dir + "/soak.json", json);
    std::fputs(md.c_str(), stdout);
    write_text(out_dir + "/soak.md", md);
    cublasDestroy(handle);
    return 0;
  }
  std::vector<const Shape*> shape_order;
  for (const Shape& s : kShapes) shape_order.push_back(&s);
  if (reverse_shapes) std::reverse(shape_order.begin(), shape_order.end());
  for (const Shape* shape : shape_order) {
    const Shape& s = *shape;
    // On stdout, the local time each layer starts, in nvidia-smi's timestamp format: gpu_check's
    // ab mode logs the card's clocks and power in that time (clocks.csv).
    {
      const auto now = std::chrono::system_clock::now();
      const std::time_t secs = std::chrono::system_clock::to_time_t(now);
      const int ms = static_cast<int>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                          now.time_since_epoch()).count() % 1000);
      char stamp[32];
      std::strftime(stamp, sizeof(stamp), "%Y/%m/%d %H:%M:%S", std::localtime(&secs));
      std::printf("%s.%03d start %s\n", stamp, ms, s.name);
      std::fflush(stdout);
    }
    const int64_t n = s.out * s.in;
    const int64_t t_max = quick ? 512 : *std::max_element(g_tokens.begin(), g_tokens.end());
    DevMem x(size_t(t_max) * s.in * 2), dy(size_t(t_max) * s.out * 2);
    fill_inputs(x, dy, t_max, s);
    // Parameters in each format (bf16 W shared by the bf16-state and int8 variants).
    DevMem w(n * 2), m16(n * 2), v16(n * 2), m8(n), v8(n), am8((n / 64 + s.out) * 4), av8((n / 64 + s.out) * 4),
        mf8(n), vf8(n), amf8((n / 64 + s.out) * 4), avf8((n / 64 + s.out) * 4),
        mi4(n / 2), vi4(n / 2), ami4((n / 64 + s.out) * 4), avi4((n / 64 + s.out) * 4),
        w2(n * 2), master(n * 4), m32(n * 4), v32(n * 4), dw(n * 4), grad16(n * 2), zero(n * 4);
    fill_adamw_bf16(w, m16, v16, n);
    fill_bf16<<<grid_for(n), 256>>>(w2.as<uint16_t>(), n, 3, 0.02f);  // (the master variant's W)
    fill_f32<<<grid_for(n), 256>>>(master.as<float>(), n, 6, 0.02f, false);
    fill_f32<<<grid_for(n), 256>>>(m32.as<float>(), n, 7, 1e-3f, false);
    fill_f32<<<grid_for(n), 256>>>(v32.as<float>(), n, 8, 1e-6f, true);
    CHECK_CUDA(cudaGetLastError());

    const forge_param p16 =
        adamw_param(s.out, s.in, FORGE_WEIGHT_BF16, w.p, FORGE_STATE_BF16, m16.p, v16.p);
    // the bf16 states' value ranges
    const forge_param p8 =
        with_block_adamw_states(p16, FORGE_STATE_INT8_BLOCK64, m8, v8, am8, av8, 9, adamw);
    const forge_param pf8 =
        with_block_adamw_states(p16, FORGE_STATE_FP8_BLOCK64, mf8, vf8, amf8, avf8, 9, adamw);
    forge_param pm = p16, pz{};
    pz.rows = s.out;
    pz.cols = s.in;
    pm.weight = w2.p;
    pm.weight_format = FORGE_WEIGHT_BF16_MASTER;
    pm.master = master.as<float>();
    pm.state_format = FORGE_STATE_FP32;
    pm.state[0] = m32.p;
    pm.state[1] = v32.p;
    // forge.optim.AdamW's default: stochastic rounding of the bf16 weight and bf16 states.
    forge_param psr = p16;
    psr.weight_format = FORGE_WEIGHT_BF16_STOCHASTIC;
    psr.state_format = FORGE_STATE_BF16_STOCHASTIC;
    // ... and with int8 states (forge-bench's forge-int8 mode).
    forge_param p8sr = p8;
    p8sr.weight_format = FORGE_WEIGHT_BF16_STOCHASTIC;
    // ... and with fp8 states.
    forge_param pf8sr = pf8;
    pf8sr.weight_format = FORGE_WEIGHT_BF16_STOCHASTIC;
    // ... and with int4 states (forge-bench's forge-int4 mode).
    forge_param pi4sr =
        with_block_adamw_states(p16, FORGE_STATE_INT4_BLOCK64, mi4, vi4, ami4, avi4, 9, adamw);
    pi4sr.weight_format = FORGE_WEIGHT_BF16_STOCHASTIC;
    pz.weight_format = FORGE_WEIGHT_FP32;
    pz.weight = zero.p;
    pz.state_format = FORGE_STATE_FP32;

    const AdamWScalars as = timed_adamw_scalars();

    // Correctness rider: fused dW (SGD lr 1 from W = 0) against cuBLAS fp32 dW, T = 512.
    double rel_error = 0;
    {
      const int64_t tt = 512;
      CHECK_CUDA(cudaMemset(zero.p, 0, n * 4));
      forge_wgrad_args a = fused_args(x.p, dy.p, tt, s, pz, sgd);
      CHECK_FORGE(forge_wgrad_step(&a));
      run_cublas(handle, x.p, dy.p, dw.p, CUDA_R_32F, tt, s);
      DevMem sums(16);
      CHECK_CUDA(cudaMemset(sums.p, 0, 16));
      sum_sq_error<<<grid_for(n), 256>>>(zero.as<float>(), dw.as<float>(), n, sums.as<double>());
      double h[2];
      CHECK_CUDA(cudaMemcpy(h, sums.p, 16, cudaMemcpyDeviceToHost));
      rel_error = std::sqrt(h[0] / h[1]);
    }

    // Epilogue alone: the fused bf16-state step with 32 tokens.
    forge_hparams hp = adamw;
    auto fused = [&](const forge_param& p, int64_t tokens) {
      forge_wgrad_args a = fused_args(x.p, dy.p, tokens, s, p, hp);
      hp.step = hp.step % 1000 + 1;
      CHECK_FORGE(forge_wgrad_step(&a));
    };
    forge_param psgd = p16;
    psgd.state_format = FORGE_STATE_FP32;
    psgd.state[0] = psgd.state[1] = nullptr;
    forge_hparams sgd_step{};
    CHECK_FORGE(forge_hparams_default(FORGE_RULE_SGD, &sgd_step));
    const std::vector<double> epilogue = timer.medians_ms(iters, {
        [&] { fused(p16, 32); },
        [&] {
          forge_wgrad_args a = fused_args(x.p, dy.p, 32, s, psgd, sgd_step);
          CHECK_FORGE(forge_wgrad_step(&a));
        }});
    const double epilogue_ms = epilogue[0], epilogue_sgd_ms = epilogue[1];

    for (int64_t tokens : g_tokens) {
      if (tokens > t_max) continue;
      Result r{&s, tokens, {}, epilogue_ms, epilogue_sgd_ms, rel_error};
      std::vector<std::function<void()>> variants(kVariants);  // indexed by Variant
      variants[kFusedBf16] = [&] { fused(p16, tokens); };
      variants[kFusedInt8] = [&] { fused(p8, tokens); };
      variants[kFusedMaster] = [&] { fused(pm, tokens); };
      variants[kFusedSr] = [&] { fused(psr, tokens); };
      variants[kFusedInt8Sr] = [&] { fused(p8sr, tokens); };
      variants[kFusedFp8] = [&] { fused(pf8, tokens); };
      variants[kFusedFp8Sr] = [&] { fused(pf8sr, tokens); };
      variants[kFusedInt4Sr] = [&] { fused(pi4sr, tokens); };
      variants[kCublasF32] = [&] { run_cublas(handle, x.p, dy.p, dw.p, CUDA_R_32F, tokens, s); };
      variants[kCublasBf16] = [&] { run_cublas(handle, x.p, dy.p, grad16.p, CUDA_R_16BF, tokens, s); };
      variants[kUnfused] = [&] {
        run_cublas(handle, x.p, dy.p, grad16.p, CUDA_R_16BF, tokens, s);
        adamw_bf16<<<grid_for(n / 8), 256>>>(grad16.as<uint4>(), w.as<uint4>(), m16.as<uint4>(), v16.as<uint4>(), n / 8, as);
      };
      const std::vector<double> ms = timer.medians_ms(iters, variants);
      std::copy(ms.begin(), ms.end(), r.ms);
      results.push_back(r);
      std::printf("%-18s T=%-5lld fused bf16 %.3f ms | int8 %.3f | fp8 %.3f | master %.3f | bf16 sr %.3f | sr int8 %.3f | sr fp8 %.3f | sr int4 %.3f | cuBLAS f32 %.3f bf16 %.3f | unfused %.3f | speedup %.2fx\n",
                  s.name, static_cast<long long>(tokens), r.ms[kFusedBf16], r.ms[kFusedInt8], r.ms[kFusedFp8],
                  r.ms[kFusedMaster], r.ms[kFusedSr], r.ms[kFusedInt8Sr], r.ms[kFusedFp8Sr], r.ms[kFusedInt4Sr],
                  r.ms[kCublasF32],
                  r.ms[kCublasBf16], r.ms[kUnfused],
                  r.ms[kUnfused] / r.ms[kFusedBf16]);
      std::fflush(stdout);
    }
    // The timed steps must have run on sane values: a NaN weight or state would make every
    // later step take the library's exact fallback path instead of the fast one.
    {
      const unsigned long long h = nonfinite_bf16({w.p, w2.p, m16.p, v16.p}, n);
      if (h != 0) {
        std::fprintf(stderr, "%s: %llu non-finite weight/state values after timing: results invalid\n", s.name, h);
        return 1;
      }
    }
  }

  // ---- report ----
  char date[32];
  const std::time_t now = std::time(nullptr);
  std::strftime(date, sizeof(date), "%Y-%m-%d %H:%M UTC", std::gmtime(&now));
  std::string md;
  md += "# FORGE fused wgrad + AdamW vs cuBLAS + unfused AdamW\n\n";
  md += std::string("- date: ") + date + "\n- GPU: " + prop.name + " (" + std::to_string(g_sms) + " SMs)\n";
  md += "- command: `" + command + "`\n";
  md += "- median of " + std::to_string(iters) + " after " + std::to_string(kWarmup) +
        " warm-ups, L2 flushed before each call, the variants of a row interleaved call by call; bf16 inputs, bf16 W, AdamW\n";
  md += "- TFLOP/s = 2·out·in·T / t; GB/s = (T·(out + in)·2 B + bytes per parameter × out·in) / t\n";
  md += "- epilogue-only = the fused step at T = 32 (GEMM negligible): AdamW bf16 states / SGD, no states\n";
  if (run_scalars) md += "- --run-scalars: every AdamW step read its scalars from device memory (a CUDA graph's kernels)\n";
  md += "\n";
  md += "| layer (out×in) | T | fused bf16 ms (TF/s, GB/s) | fused int8 ms | fused fp8 ms | fused fp32+master ms | cuBLAS fp32-out ms (TF/s) | cuBLAS bf16-out ms | unfused (c) ms | speedup (c)/(a-bf16) | fused bf16 SR W + SR states ms (forge.optim default) | fused bf16 SR W + int8 states ms (the same, int8) | fused bf16 SR W + fp8 states ms | fused bf16 SR W + int4 states ms | epilogue-only ms AdamW / SGD | dW check |\n";
  md += "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n";
  std::string json = "{\n  \"date\": \"" + std::string(date) + "\",\n  \"gpu\": \"" + prop.name +
                     "\",\n  \"sms\": " + std::to_string(g_sms) + ",\n  \"command\": \"" + command +
                     "\",\n  \"iters\": " + std::to_string(iters) + ",\n  \"results\": [\n";
  bool first = true;
  for (const Result& r : results) {
    const double n = double(r.shape->out) * r.shape->in;
    const double flops = 2.0 * n * r.tokens;
    const double in_bytes = double(r.tokens) * (r.shape->out + r.shape->in) * 2;
    auto tf = [&](double ms) { return flops / (ms * 1e-3) / 1e12; };
    auto gbs = [&](int v) { return (in_bytes + param_bytes(v) * n) / (r.ms[v] * 1e-3) / 1e9; };
    md += "| " + std::string(r.shape->name) + " " + std::to_string(r.shape->out) + "×" + std::to_string(r.shape->in) +
          " | " + std::to_string(r.tokens) + " | " + fmt("%.3f", r.ms[kFusedBf16]) + " (" + fmt("%.0f", tf(r.ms[kFusedBf16])) +
          ", " + fmt("%.0f", gbs(kFusedBf16)) + ") | " + fmt("%.3f", r.ms[kFusedInt8]) + " | " +
          fmt("%.3f", r.ms[kFusedFp8]) + " | " + fmt("%.3f", r.ms[kFusedMaster]) +
          " | " + fmt("%.3f", r.ms[kCublasF32]) + " (" + fmt("%.0f", tf(r.ms[kCublasF32])) + ") | " +
          fmt("%.3f", r.ms[kCublasBf16]) + " | " + fmt("%.3f", r.ms[kUnfused]) + " | **" +
          fmt("%.2f", r.ms[kUnfused] / r.ms[kFusedBf16]) + "×** | " + fmt("%.3f", r.ms[kFusedSr]) + " | " +
          fmt("%.3f", r.ms[kFusedInt8Sr]) + " | " + fmt("%.3f", r.ms[kFusedFp8Sr]) + " | " +
          fmt("%.3f", r.ms[kFusedInt4Sr]) + " | " + fmt("%.3f", r.epilogue_ms) + " / " + fmt("%.3f", r.epilogue_sgd_ms) + " | " +
          fmt("%.1e", r.dw_rel_error) + " |\n";
    for (int v = 0; v < kVariants; ++v) {
      json += std::string(first ? "" : ",\n") + "    {\"layer\": \"" + r.shape->name + "\", \"out\": " +
              std::to_string(r.shape->out) + ", \"in\": " + std::to_string(r.shape->in) + ", \"T\": " +
              std::to_string(r.tokens) + ", \"variant\": \"" + kVariantNames[v] + "\", \"ms\": " + fmt("%.5f", r.ms[v]) +
              ", \"tflops\": " + fmt("%.2f", tf(r.ms[v])) + ", \"gbps\": " + fmt("%.1f", gbs(v)) + "}";
      first = false;
    }
    json += ",\n    {\"layer\": \"" + std::string(r.shape->name) + "\", \"T\": " + std::to_string(r.tokens) +
            ", \"variant\": \"epilogue_only_T32\", \"ms\": " + fmt("%.5f", r.epilogue_ms) +
            "}, {\"layer\": \"" + r.shape->name + "\", \"T\": " + std::to_string(r.tokens) +
            ", \"variant\": \"epilogue_only_sgd_T32\", \"ms\": " + fmt("%.5f", r.epilogue_sgd_ms) +
            "}, {\"layer\": \"" + r.shape->name + "\", \"T\": " + std::to_string(r.tokens) +
            ", \"variant\": \"dw_rel_error_vs_cublas\", \"value\": " + fmt("%.3e", r.dw_rel_error) + "}";
  }
  json += "\n  ],\n  \"model_totals_ms\": {";

  // Whole-model estimate: the 224 linear layers of Llama-3.1-8B (32 decoder layers).
  md += "\n## Llama-3.1-8B, all 224 linear layers (sum of the per-layer medians × occurrences)\n\n";
  md += "| T | fused bf16 ms | fused int8 ms | fused fp8 ms | fused fp32+master ms | cuBLAS fp32-out ms | unfused (c) ms | speedup (c)/(a-bf16) | fused bf16 SR W + SR states ms | fused bf16 SR W + int8 states ms | fused bf16 SR W + fp8 states ms | fused bf16 SR W + int4 states ms |\n";
  md += "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n";
  bool first_t = true;
  for (int64_t tokens : g_tokens) {
    double tot[kVariants] = {};
    int found = 0;
    for (const Result& r : results)
      if (r.tokens == tokens) {
        ++found;
        for (int v = 0; v < kVariants; ++v) tot[v] += r.ms[v] * r.shape->per_layer * kLayers;
      }
    if (found != 4) continue;
    md += "| " + std::to_string(tokens) + " | " + fmt("%.1f", tot[kFusedBf16]) + " | " + fmt("%.1f", tot[kFusedInt8]) +
          " | " + fmt("%.1f", tot[kFusedFp8]) + " | " + fmt("%.1f", tot[kFusedMaster]) + " | " + fmt("%.1f", tot[kCublasF32]) + " | " +
          fmt("%.1f", tot[kUnfused]) + " | " + fmt("%.2f", tot[kUnfused] / tot[kFusedBf16]) + "× | " +
          fmt("%.1f", tot[kFusedSr]) + " | " + fmt("%.1f", tot[kFusedInt8Sr]) + " | " +
          fmt("%.1f", tot[kFusedFp8Sr]) + " | " + fmt("%.1f", tot[kFusedInt4Sr]) + " |\n";
    json += std::string(first_t ? "" : ",") + "\n    \"" + std::to_string(tokens) + "\": {\"fused_bf16\": " +
            fmt("%.3f", tot[kFusedBf16]) + ", \"fused_int8\": " + fmt("%.3f", tot[kFusedInt8]) +
            ", \"fused_master\": " + fmt("%.3f", tot[kFusedMaster]) + ", \"cublas_fp32_out\": " +
            fmt("%.3f", tot[kCublasF32]) + ", \"unfused\": " + fmt("%.3f", tot[kUnfused]) +
            ", \"fused_sr\": " + fmt("%.3f", tot[kFusedSr]) + ", \"fused_sr_int8\": " +
            fmt("%.3f", tot[kFusedInt8Sr]) + ", \"fused_fp8\": " + fmt("%.3f", tot[kFusedFp8]) +
            ", \"fused_sr_fp8\": " + fmt("%.3f", tot[kFusedFp8Sr]) +
            ", \"fused_sr_int4\": " + fmt("%.3f", tot[kFusedInt4Sr]) + "}";
    first_t = false;
  }
  json += "\n  }";

  // ---- the element-wise step: forge_elementwise_step (parameters outside the Linear layers,
  // and any materialized gradient) on Llama-3.1-8B's embedding [128256, 4096], bf16 gradient,
  // against the same unfused AdamW pass (c) runs.
  {
    const int64_t rows = 128256, cols = 4096, n = rows * cols;
    DevMem g(n * 2), w(n * 2), m16(n * 2), v16(n * 2), m8(n), v8(n), am8(n / 64 * 4), av8(n / 64 * 4),
        mf8(n), vf8(n), amf8(n / 64 * 4), avf8(n / 64 * 4);
    fill_bf16<<<grid_for(n), 256>>>(g.as<uint16_t>(), n, 11, 1e-2f);
    fill_bf16<<<grid_for(n), 256>>>(w.as<uint16_t>(), n, 12, 0.02f);
    fill_bf16<<<grid_for(n), 256>>>(m16.as<uint16_t>(), n, 13, 1e-3f);
    fill_bf16<<<grid_for(n), 256>>>(v16.as<uint16_t>(), n, 14, 1e-6f, true);
    const forge_param psr = adamw_param(rows, cols, FORGE_WEIGHT_BF16_STOCHASTIC, w.p,
                                        FORGE_STATE_BF16_STOCHASTIC, m16.p, v16.p);
    const forge_param p8 =
        with_block_adamw_states(psr, FORGE_STATE_INT8_BLOCK64, m8, v8, am8, av8, 15, adamw);
    const forge_param pf8 =
        with_block_adamw_states(psr, FORGE_STATE_FP8_BLOCK64, mf8, vf8, amf8, avf8, 15, adamw);
    forge_hparams hp = adamw;
    auto step = [&](const forge_param& p) {
      const forge_elementwise_args a = elementwise_args(g.p, p, hp);
      hp.step = hp.step % 1000 + 1;
      CHECK_FORGE(forge_elementwise_step(&a));
    };
    const AdamWScalars as = timed_adamw_scalars();
    const std::vector<double> ms = timer.medians_ms(iters, {
        [&] { step(psr); },
        [&] { step(p8); },
        [&] { step(pf8); },
        [&] {
          adamw_bf16<<<grid_for(n / 8), 256>>>(g.as<uint4>(), w.as<uint4>(), m16.as<uint4>(), v16.as<uint4>(), n / 8, as);
        }});
    const double sr_ms = ms[0], int8_ms = ms[1], fp8_ms = ms[2], ref_ms = ms[3];
    // Bytes per element: the bf16 gradient read, then W + states read and written.
    const double sr_bytes = 2 + 12, int8_bytes = 2 + 4 + 4 + 2 * 2 * 4.0 / 64, ref_bytes = 2 + 12;
    auto gbs = [&](double bytes, double ms) { return bytes * double(n) / (ms * 1e-3) / 1e9; };
    md += "\n## Element-wise step (forge_elementwise_step), AdamW on [128256, 4096] (Llama-3.1-8B's embedding), bf16 gradient\n\n";
    md += "| variant | ms | GB/s |\n| --- | --- | --- |\n";
    md += "| bf16 SR W + bf16 SR states (forge.optim default) | " + fmt("%.3f", sr_ms) + " | " + fmt("%.0f", gbs(sr_bytes, sr_ms)) + " |\n";
    md += "| bf16 SR W + int8 states | " + fmt("%.3f", int8_ms) + " | " + fmt("%.0f", gbs(int8_bytes, int8_ms)) + " |\n";
    md += "| bf16 SR W + fp8 states | " + fmt("%.3f", fp8_ms) + " | " + fmt("%.0f", gbs(int8_bytes, fp8_ms)) + " |\n";
    md += "| unfused AdamW pass of (c), bf16 W, m, v | " + fmt("%.3f", ref_ms) + " | " + fmt("%.0f", gbs(ref_bytes, ref_ms)) + " |\n";
    json += ",\n  \"elementwise_embedding_ms\": {\"bf16_sr\": " + fmt("%.4f", sr_ms) + ", \"int8\": " +
            fmt("%.4f", int8_ms) + ", \"fp8\": " + fmt("%.4f", fp8_ms) + ", \"unfused_adamw_pass\": " + fmt("%.4f", ref_ms) + "}";
    std::printf("element-wise step [128256, 4096]: bf16 SR %.3f ms (%.0f GB/s) | int8 %.3f ms (%.0f GB/s) | fp8 %.3f ms (%.0f GB/s) | unfused AdamW pass %.3f ms (%.0f GB/s)\n",
                sr_ms, gbs(sr_bytes, sr_ms), int8_ms, gbs(int8_bytes, int8_ms), fp8_ms, gbs(int8_bytes, fp8_ms),
                ref_ms, gbs(ref_bytes, ref_ms));
  }
  json += "\n}\n";

  std::printf("\n%s", md.c_str());
  write_text(out_dir + "/bench.md", md);
  write_text(out_dir + "/bench.json", json);
  cublasDestroy(handle);
  return 0;
}
