// update_pattern.cu — how fast an AdamW update can stream bf16 W, m and v when it walks the
// parameter tile by tile, as the fused step's epilogue does, against a flat streaming pass.
//
// Why: at T = 512 the fused step is bound by its update, which moves 12 B per parameter at
// ~3.0 TB/s (bench/NOTES.md v15) while the element-wise pass over the same bytes reaches
// 3.5-3.8. This program has no GEMM and no FORGE code: the gradient is made up in registers,
// and only the access pattern varies: the tile's shape (rows × columns per CTA), the vector
// width, the threads per CTA, the CTAs per SM (capped with unused dynamic shared memory, as the
// fused kernel's ring caps it at 2) and the order of the tiles. If the fused kernel's pattern
// (128 × 128, 4 columns per thread, 256 threads, 2 CTAs per SM) is slow here too, the pattern
// is the limit and a different tile shape or occupancy is the lever; if it is fast here, the
// limit is in the fused kernel itself. Measured (runs 51-53, bench/NOTES.md v16): with the L2
// prefetch the fused kernel issues, its pattern streams 14336 × 4096 at 3.40 TB/s, 95 % of the
// best flat pass, so the limit is in the fused kernel.
//
//     update_pattern [--reps N]    (prints a markdown table; run by hand on a GPU machine)
//     update_pattern --orders      (only the fused kernel's pattern, L2 prefetch included, on
//                                   gate_proj's 14336 × 4096, down_proj's 4096 × 14336 and
//                                   q_proj's 4096 × 4096, for group heights 1 to 128: why
//                                   down_proj's update is slower)
//     update_pattern --threads     (the fused kernel's 2 CTAs per SM with 512 threads held to
//                                   64 registers, one or two vectors per thread, against its
//                                   256: run 100, bench/NOTES.md v21)
//
// Timing: CUDA events around each launch, the L2 flushed (a 256 MiB memset) before each, the
// median of N (default 30) after 3 warm-ups. Bytes counted: 12 per parameter (W, m, v read and
// written once).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#define CHECK_CUDA(call)                                                              \
  do {                                                                                \
    cudaError_t e_ = (call);                                                          \
    if (e_ != cudaSuccess) {                                                          \
      std::fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); \
      std::exit(1);                                                                   \
    }                                                                                 \
  } while (0)

namespace {

__device__ __forceinline__ float bf16_to_f32(uint16_t h) {
  return __uint_as_float(static_cast<uint32_t>(h) << 16);
}
// Round to nearest even (finite inputs only: the values here stay small).
__device__ __forceinline__ uint16_t f32_to_bf16(float f) {
  const uint32_t u = __float_as_uint(f);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// kVec bf16 values as kVec / 2 packed words, loaded and stored as one vector access (8 B for
// 4, 16 B for 8).
template <int kVec>
struct Pack {
  uint32_t u[kVec / 2];
  __device__ __forceinline__ float get(int e) const {
    return bf16_to_f32(static_cast<uint16_t>(u[e / 2] >> (16 * (e % 2))));
  }
};

struct Adam {
  float b1, b2, lr, eps, wd;
};

// AdamW on kVec elements starting at element idx, with a made-up gradient.
template <int kVec>
__device__ __forceinline__ void adam_vec(const Adam& k, int64_t idx, Pack<kVec>& w, Pack<kVec>& m,
                                         Pack<kVec>& v) {
#pragma unroll
  for (int e = 0; e < kVec; e += 2) {
    uint32_t wo = 0, mo = 0, vo = 0;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float g = static_cast<float>(static_cast<int>((idx + e + h) & 255) - 128) * 1e-3f;
      const float mf = k.b1 * m.get(e + h) + (1.0f - k.b1) * g;
      const float vf = k.b2 * v.get(e + h) + (1.0f - k.b2) * g * g;
      float wf = w.get(e + h);
      wf -= k.lr * (mf / (sqrtf(vf) + k.eps) + k.wd * wf);
      wo |= static_cast<uint32_t>(f32_to_bf16(wf)) << (16 * h);
      mo |= static_cast<uint32_t>(f32_to_bf16(mf)) << (16 * h);
      vo |= static_cast<uint32_t>(f32_to_bf16(vf)) << (16 * h);
    }
    w.u[e / 2] = wo;
    m.u[e / 2] = mo;
    v.u[e / 2] = vo;
  }
}

template <int kVec>
__device__ __forceinline__ void load1(const uint16_t* base, int64_t idx, Pack<kVec>& out) {
  if constexpr (kVec == 4) {
    const uint2 x = *reinterpret_cast<const uint2*>(base + idx);
    out.u[0] = x.x;
    out.u[1] = x.y;
  } else {
    const uint4 x = *reinterpret_cast<const uint4*>(base + idx);
    out.u[0] = x.x;
    out.u[1] = x.y;
    out.u[2] = x.z;
    out.u[3] = x.w;
  }
}
template <int kVec>
__device__ __forceinline__ void store1(uint16_t* base, int64_t idx, const Pack<kVec>& in) {
  if constexpr (kVec == 4) {
    *reinterpret_cast<uint2*>(base + idx) = make_uint2(in.u[0], in.u[1]);
  } else {
    *reinterpret_cast<uint4*>(base + idx) = make_uint4(in.u[0], in.u[1], in.u[2], in.u[3]);
  }
}
template <int kVec>
__device__ __forceinline__ void load3(const uint16_t* w, const uint16_t* m, const uint16_t* v,
                                      int64_t idx, Pack<kVec> (&out)[3]) {
  load1<kVec>(w, idx, out[0]);
  load1<kVec>(m, idx, out[1]);
  load1<kVec>(v, idx, out[2]);
}
template <int kVec>
__device__ __forceinline__ void store3(uint16_t* w, uint16_t* m, uint16_t* v, int64_t idx,
                                       const Pack<kVec> (&in)[3]) {
  store1<kVec>(w, idx, in[0]);
  store1<kVec>(m, idx, in[1]);
  store1<kVec>(v, idx, in[2]);
}

// One CTA per kRows × kCols tile, in the fused kernel's order (tile_coords: groups of
// `group_m` tile rows, walked down the group first). Each pass, a thread owns kQ vectors of
// kVec columns of one row, kCols / kQ columns apart (the fused epilogue: kQ = 2, kVec = 4, so
// 16 lanes cover a row and a half-warp one 64-column int8 block); the next pass's W, m, v are
// loaded before this pass is updated (the epilogue's software pipeline).
template <int kRows, int kCols, int kVec, int kQ, int kThreads, bool kPrefetch = false,
          bool kAdjacent = false, int kMinBlocks = 1>
__global__ void __launch_bounds__(kThreads, kMinBlocks) tiled_update(uint16_t* w, uint16_t* m, uint16_t* v,
                                                         int64_t cols, int tiles_m, int tiles_n,
                                                         int group_m, Adam k) {
  constexpr int kLanesPerRow = kCols / (kVec * kQ);
  constexpr int kRowsPerPass = kThreads / kLanesPerRow;
  static_assert(kThreads % kLanesPerRow == 0 && kRows % kRowsPerPass == 0, "tile shape");
  const int tile = blockIdx.x;
  const int group_tiles = group_m * tiles_n;
  const int group = tile / group_tiles, first_m = group * group_m;
  const int gm = min(tiles_m - first_m, group_m), in_group = tile - group * group_tiles;
  const int64_t m0 = static_cast<int64_t>(first_m + in_group % gm) * kRows;
  const int64_t n0 = static_cast<int64_t>(in_group / gm) * kCols;
  const int lane = threadIdx.x % kLanesPerRow, r0 = threadIdx.x / kLanesPerRow;
  // kAdjacent: the thread's kQ vectors are consecutive (kQ · kVec columns in a row).
  constexpr int kQStride = kAdjacent ? kVec : kCols / kQ;
  int64_t idx = (m0 + r0) * cols + n0 + lane * kVec * (kAdjacent ? kQ : 1);
  const int64_t step = kRowsPerPass * cols;
  if constexpr (kPrefetch) {
    // Every 128-byte line of the tile's W, m, v requested into L2 up front (the fused kernel's
    // prefetch_update_operands does this during its main loop): bytes in flight without
    // registers.
    constexpr int kLinesPerRow = kCols * 2 / 128;
    for (int i = threadIdx.x; i < kRows * kLinesPerRow * 3; i += kThreads) {
      const int t = i / (kRows * kLinesPerRow), rem = i % (kRows * kLinesPerRow);
      const int64_t e = (m0 + rem / kLinesPerRow) * cols + n0 + (rem % kLinesPerRow) * 64;
      const uint16_t* base = t == 0 ? w : t == 1 ? m : v;
      asm volatile("prefetch.global.L2 [%0];" ::"l"(base + e));
    }
  }
  Pack<kVec> next[kQ][3];
#pragma unroll
  for (int q = 0; q < kQ; ++q) load3<kVec>(w, m, v, idx + q * kQStride, next[q]);
#pragma unroll 2
  for (int pass = 0; pass < kRows / kRowsPerPass; ++pass, idx += step) {
    Pack<kVec> cur[kQ][3];
#pragma unroll
    for (int q = 0; q < kQ; ++q) {
      cur[q][0] = next[q][0];
      cur[q][1] = next[q][1];
      cur[q][2] = next[q][2];
    }
    if (pass + 1 < kRows / kRowsPerPass) {
#pragma unroll
      for (int q = 0; q < kQ; ++q) load3<kVec>(w, m, v, idx + step + q * kQStride, next[q]);
    }
#pragma unroll
    for (int q = 0; q < kQ; ++q) {
      const int64_t i = idx + q * kQStride;
      adam_vec<kVec>(k, i, cur[q][0], cur[q][1], cur[q][2]);
      store3<kVec>(w, m, v, i, cur[q]);
    }
  }
}

// The flat pass: a grid-stride loop over the whole parameter, kVec elements per thread.
template <int kVec>
__global__ void __launch_bounds__(256) stream_update(uint16_t* w, uint16_t* m, uint16_t* v,
                                                     int64_t n, Adam k) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x * kVec;
  for (int64_t idx = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * kVec;
       idx < n; idx += stride) {
    Pack<kVec> p[3];
    load3<kVec>(w, m, v, idx, p);
    adam_vec<kVec>(k, idx, p[0], p[1], p[2]);
    store3<kVec>(w, m, v, idx, p);
  }
}

struct Timer {
  void* flush = nullptr;
  cudaEvent_t start{}, stop{};
  Timer() {
    CHECK_CUDA(cudaMalloc(&flush, size_t(256) << 20));
    CHECK_CUDA(cudaEventCreate(&start));
    CHECK_CUDA(cudaEventCreate(&stop));
  }
  ~Timer() {
    cudaFree(flush);
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
  }
  template <class F>
  float median_ms(F&& launch, int reps) {
    std::vector<float> t;
    for (int i = 0; i < reps + 3; ++i) {
      CHECK_CUDA(cudaMemsetAsync(flush, i & 0xFF, size_t(256) << 20));
      CHECK_CUDA(cudaEventRecord(start));
      launch();
      CHECK_CUDA(cudaEventRecord(stop));
      CHECK_CUDA(cudaEventSynchronize(stop));
      CHECK_CUDA(cudaGetLastError());
      float ms = 0;
      CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
      if (i >= 3) t.push_back(ms);
    }
    std::nth_element(t.begin(), t.begin() + t.size() / 2, t.end());
    return t[t.size() / 2];
  }
};

struct Layer {
  const char* name;
  int64_t rows, cols;
};

// Dynamic shared memory that leaves room for at most `ctas` CTAs per SM (0: no cap).
size_t cap_smem(int ctas, const cudaDeviceProp& prop) {
  if (ctas <= 0) return 0;
  return prop.sharedMemPerMultiprocessor / ctas - 1024 - 1;  // 1 KiB reserved per CTA
}

template <int kRows, int kCols, int kVec, int kQ, int kThreads, bool kPrefetch = false,
          bool kAdjacent = false, int kMinBlocks = 1>
void run_tiled(Timer& timer, const cudaDeviceProp& prop, const Layer& L, uint16_t* w, uint16_t* m,
               uint16_t* v, int ctas_per_sm, int group_m, int reps) {
  auto kernel = tiled_update<kRows, kCols, kVec, kQ, kThreads, kPrefetch, kAdjacent, kMinBlocks>;
  const size_t smem = cap_smem(ctas_per_sm, prop);
  CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  static_cast<int>(smem)));
  int resident = 0;
  CHECK_CUDA(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&resident, kernel, kThreads, smem));
  const int tiles_m = static_cast<int>(L.rows / kRows), tiles_n = static_cast<int>(L.cols / kCols);
  const Adam k{0.9f, 0.999f, 1e-4f, 1e-8f, 0.01f};
  const float ms = timer.median_ms(
      [&] {
        kernel<<<tiles_m * tiles_n, kThreads, smem>>>(w, m, v, L.cols, tiles_m, tiles_n, group_m,
                                                      k);
      },
      reps);
  const double bytes = 12.0 * static_cast<double>(L.rows * L.cols);
  std::printf("| %s | tiled %d×%d%s%s | %d × %d | %d | %d (%d resident) | %d | %.1f | %.2f |\n",
              L.name, kRows, kCols, kAdjacent ? ", vectors adjacent" : "",
              kPrefetch ? ", L2 prefetch first" : "", kQ, kVec, kThreads, ctas_per_sm, resident,
              group_m, ms * 1e3, bytes / (ms * 1e-3) / 1e12);
  std::fflush(stdout);
}

template <int kVec>
void run_stream(Timer& timer, const cudaDeviceProp& prop, const Layer& L, uint16_t* w,
                uint16_t* m, uint16_t* v, int blocks_per_sm, int reps) {
  const Adam k{0.9f, 0.999f, 1e-4f, 1e-8f, 0.01f};
  const int grid = prop.multiProcessorCount * blocks_per_sm;
  const float ms = timer.median_ms(
      [&] { stream_update<kVec><<<grid, 256>>>(w, m, v, L.rows * L.cols, k); }, reps);
  const double bytes = 12.0 * static_cast<double>(L.rows * L.cols);
  std::printf("| %s | flat, grid %d×SMs | 1 × %d | 256 | - | - | %.1f | %.2f |\n", L.name,
              blocks_per_sm, kVec, ms * 1e3, bytes / (ms * 1e-3) / 1e12);
  std::fflush(stdout);
}

}  // namespace

// A layer's bf16 W (0x3C3C: ~0.0115), m and v (zeros) in device memory, freed on scope exit.
struct LayerBuffers {
  uint16_t *w = nullptr, *m = nullptr, *v = nullptr;
  explicit LayerBuffers(const Layer& L) {
    const size_t bytes = 2 * static_cast<size_t>(L.rows * L.cols);
    CHECK_CUDA(cudaMalloc(&w, bytes));
    CHECK_CUDA(cudaMalloc(&m, bytes));
    CHECK_CUDA(cudaMalloc(&v, bytes));
    CHECK_CUDA(cudaMemset(w, 0x3C, bytes));
    CHECK_CUDA(cudaMemset(m, 0, bytes));
    CHECK_CUDA(cudaMemset(v, 0, bytes));
  }
  ~LayerBuffers() {
    cudaFree(w);
    cudaFree(m);
    cudaFree(v);
  }
  LayerBuffers(const LayerBuffers&) = delete;
  LayerBuffers& operator=(const LayerBuffers&) = delete;
};

int main(int argc, char** argv) {
  int reps = 30;
  bool orders = false, threads = false;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--reps") && i + 1 < argc) {
      reps = std::atoi(argv[++i]);
    } else if (!std::strcmp(argv[i], "--orders")) {
      orders = true;
    } else if (!std::strcmp(argv[i], "--threads")) {
      threads = true;
    } else {
      std::fprintf(stderr, "usage: %s [--reps N] [--orders | --threads]\n", argv[0]);
      return 2;
    }
  }
  if (reps < 1) {
    std::fprintf(stderr, "--reps must be >= 1\n");
    return 2;
  }
  cudaDeviceProp prop{};
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  Timer timer;
  std::printf("# update_pattern on %s (%d SMs): AdamW on bf16 W, m, v, 12 B per parameter, "
              "L2 flushed, median of %d\n\n",
              prop.name, prop.multiProcessorCount, reps);
  std::printf("| layer | pattern | vectors × cols per thread | threads | CTAs per SM (cap) | "
              "group_m | µs | TB/s |\n| --- | --- | --- | --- | --- | --- | --- | --- |\n");
  if (orders) {
    // The Llama MLP shapes at T = 512: the fused step takes 0.244 ms on gate_proj and 0.271 on
    // down_proj, the same 58.7 M parameters (run 56); their update alone 0.208 against 0.223.
    // And q_proj's 4096 × 4096 (1.23× at T = 512 in run 64, the MLP layers 1.24-1.32×).
    const Layer mlp[] = {{"14336×4096", 14336, 4096}, {"4096×14336", 4096, 14336},
                         {"4096×4096", 4096, 4096}};
    for (const Layer& L : mlp) {
      const LayerBuffers b(L);
      run_stream<8>(timer, prop, L, b.w, b.m, b.v, 8, reps);
      for (int group_m : {1, 2, 4, 8, 16, 32, 64, 128})
        run_tiled<128, 128, 4, 2, 256, true>(timer, prop, L, b.w, b.m, b.v, 2, group_m, reps);
    }
    return 0;
  }
  if (threads) {
    // The fused kernel's CTA shape (2 per SM) with 512 threads instead of 256, held to 64
    // registers so that two still fit: does doubling the update's warps per SM lift it the
    // way more CTAs do (v21)?
    const Layer mlp[] = {{"14336×4096", 14336, 4096}, {"4096×4096", 4096, 4096}};
    for (const Layer& L : mlp) {
      const LayerBuffers b(L);
      run_stream<8>(timer, prop, L, b.w, b.m, b.v, 4, reps);
      run_tiled<128, 128, 4, 2, 256, true>(timer, prop, L, b.w, b.m, b.v, 2, 8, reps);  // fused
      run_tiled<128, 128, 4, 2, 256>(timer, prop, L, b.w, b.m, b.v, 2, 8, reps);
      run_tiled<128, 128, 4, 2, 512, true, false, 2>(timer, prop, L, b.w, b.m, b.v, 2, 8, reps);
      run_tiled<128, 128, 4, 2, 512, false, false, 2>(timer, prop, L, b.w, b.m, b.v, 2, 8, reps);
      run_tiled<128, 128, 4, 1, 512, true, false, 2>(timer, prop, L, b.w, b.m, b.v, 2, 8, reps);
      run_tiled<128, 128, 4, 1, 512, false, false, 2>(timer, prop, L, b.w, b.m, b.v, 2, 8, reps);
      run_tiled<128, 128, 8, 1, 512, true, false, 2>(timer, prop, L, b.w, b.m, b.v, 2, 8, reps);
      run_tiled<128, 128, 8, 1, 512, false, false, 2>(timer, prop, L, b.w, b.m, b.v, 2, 8, reps);
      run_tiled<128, 128, 4, 2, 256, true>(timer, prop, L, b.w, b.m, b.v, 4, 8, reps);
      run_tiled<128, 128, 4, 2, 256>(timer, prop, L, b.w, b.m, b.v, 4, 8, reps);
    }
    return 0;
  }
  const Layer layers[] = {{"4096×4096", 4096, 4096}, {"14336×4096", 14336, 4096}};
  for (const Layer& L : layers) {
    const LayerBuffers b(L);
    uint16_t *const w = b.w, *const m = b.m, *const v = b.v;
    run_stream<4>(timer, prop, L, w, m, v, 8, reps);
    run_stream<8>(timer, prop, L, w, m, v, 8, reps);
    // The fused kernel's update: 128 × 128 tiles, two quads per thread, 256 threads, 2 CTAs
    // per SM, groups of 16 tile rows. Then one thing changed at a time.
    run_tiled<128, 128, 4, 2, 256>(timer, prop, L, w, m, v, 2, 16, reps);
    run_tiled<128, 128, 4, 2, 256>(timer, prop, L, w, m, v, 2, 1, reps);    // row-major order
    run_tiled<128, 128, 4, 1, 256>(timer, prop, L, w, m, v, 2, 16, reps);   // one quad, 32 lanes
    run_tiled<128, 128, 8, 1, 256>(timer, prop, L, w, m, v, 2, 16, reps);   // 16 B vectors
    run_tiled<128, 128, 4, 2, 256>(timer, prop, L, w, m, v, 4, 16, reps);   // 4 CTAs per SM
    run_tiled<128, 128, 4, 2, 256>(timer, prop, L, w, m, v, 0, 16, reps);   // no cap
    run_tiled<128, 128, 4, 2, 512>(timer, prop, L, w, m, v, 2, 16, reps);   // 512 threads
    run_tiled<128, 128, 4, 4, 256>(timer, prop, L, w, m, v, 2, 16, reps);   // 4 quads
    run_tiled<128, 128, 4, 2, 256, true>(timer, prop, L, w, m, v, 2, 16, reps);  // L2 prefetch
    run_tiled<128, 128, 4, 2, 256, true>(timer, prop, L, w, m, v, 4, 16, reps);
    // The thread's two quads next to each other (8 columns), as 8-byte and as 16-byte accesses.
    run_tiled<128, 128, 4, 2, 256, false, true>(timer, prop, L, w, m, v, 2, 16, reps);
    run_tiled<128, 128, 4, 2, 256, true, true>(timer, prop, L, w, m, v, 2, 16, reps);
    run_tiled<128, 128, 8, 1, 256, true>(timer, prop, L, w, m, v, 2, 16, reps);
    // Other tile shapes of the same 16384 elements.
    run_tiled<64, 256, 4, 2, 256>(timer, prop, L, w, m, v, 2, 16, reps);
    run_tiled<32, 512, 4, 2, 256>(timer, prop, L, w, m, v, 2, 16, reps);
    run_tiled<64, 256, 8, 1, 256>(timer, prop, L, w, m, v, 2, 16, reps);
  }
  return 0;
}
