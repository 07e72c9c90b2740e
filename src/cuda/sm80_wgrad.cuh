// sm80_wgrad.cuh — the main loops of the fused weight-gradient + optimizer kernels for sm_80
// and newer (the Hopper ones are sm90_wgrad.cuh).
//
// For W [out, in] = [M, N], one CTA owns one 128 × 128 tile of dW = dYᵀ·X (reduction over
// the T tokens, K = T), accumulates it in fp32 registers, stages it in shared memory, and
// runs the optimizer update (wgrad_epilogue.cuh, finish_tile) on it there: only the new
// weight and states go back to memory, the gradient never does.
//
//  - wgrad_mma_kernel<kFp16>: bf16 or fp16 inputs on the tensor cores, mma.sync m16n8k16.
//    Both operands have T as the slow dimension ([T, out] and [T, in] row-major), so A =
//    dYᵀ and B = X are both "k-major" in memory and ldmatrix.trans turns their 8 × 8 blocks
//    into the k-pairs the mma fragments want. cp.async feeds a 4-stage shared-memory ring.
//  - wgrad_simt_kernel: any other dtype combination (fp32, or mixed), converted to fp32
//    on load, plain fp32 multiply + add in token order: correct, not fast. With the
//    library's --fmad=false it performs exactly the CPU backend's arithmetic, so without
//    split-K it is bit-identical to the CPU even on random fp32 inputs.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include "core/formats.h"
#include "cuda/ptx.cuh"
#include "cuda/update.cuh"
#include "cuda/wgrad_epilogue.cuh"
#include "cuda/wgrad_tile.cuh"
#include "forge/forge.h"

namespace forge {
namespace cuda {

constexpr int kBK = 32;     // tokens per pipeline stage
constexpr int kStages = 4;  // cp.async ring depth
// 8 warps as 2 × 4: 64 × 32 warp tiles, 64 fp32 accumulators per thread.
constexpr int kWarpM = 64, kWarpN = 32;
constexpr int kMmaM = kWarpM / 16, kMmaN = kWarpN / 8;  // 4 × 4 mma tiles per warp
// NOTE: shared rows are padded by 8 halves (16 B): ldmatrix.trans reads 8 rows of 16 B at
// one column offset, and with a 272 B row stride those land in 8 different 16 B bank
// groups (a 256 B stride would put all 8 in the same one: 8-way conflicts).
constexpr int kLdS = kBM + 8;             // halves per shared row, both operands
constexpr int kStageHalves = kBK * kLdS;  // one operand, one stage
constexpr int kLdF = kBM + 4;             // fp32 shared rows of the SIMT kernel

constexpr size_t kPipeBytes = size_t(kStages) * 2 * kStageHalves * sizeof(uint16_t);
constexpr size_t kSimtBytes = size_t(2) * 2 * kBK * kLdF * sizeof(float);
constexpr size_t kWgradSmemBytes = kMax2(kMax2(kPipeBytes, kEpilogueBytes), kSimtBytes);
static_assert(kWgradSmemBytes == 69632, "68 KiB: two CTAs per SM on A100 and H100");
static_assert((kBK * kBM / 8) % kThreads == 0, "16 B chunks divide evenly among threads");

// ---- the tensor-core kernel ---------------------------------------------------------------------

// Loads tokens [k0, k0 + 32) × columns [c0, c0 + 128) of a [T, extent] half-precision
// operand (row-major, ld) into a shared stage [kBK][kLdS]; out-of-range elements are 0.
__device__ __forceinline__ void load_operand_stage(uint16_t* stage, const uint16_t* src,
                                                   int64_t ld, int64_t tokens, int64_t extent,
                                                   int64_t c0, int64_t k0, bool vec) {
  constexpr int kChunksPerRow = kBM / 8;  // 16 B chunks
#pragma unroll
  for (int i = 0; i < kBK * kChunksPerRow / kThreads; ++i) {
    const int chunk = threadIdx.x + i * kThreads;
    const int r = chunk / kChunksPerRow, c = (chunk % kChunksPerRow) * 8;
    const int64_t t = k0 + r, col = c0 + c;
    uint16_t* dst = stage + r * kLdS + c;
    if (vec) {
      int valid = 0;
      if (t < tokens && col < extent) valid = static_cast<int>(min64(8, extent - col));
      const uint16_t* from = valid > 0 ? src + t * ld + col : src;
      cp_async_16(smem_addr(dst), from, valid * 2);
    } else {
      // NOTE: unaligned leading dimension or base pointer: element loads, synchronous.
      uint16_t v[8];
#pragma unroll
      for (int e = 0; e < 8; ++e)
        v[e] = (t < tokens && col + e < extent) ? src[t * ld + col + e] : uint16_t(0);
      uint4 packed;
      packed.x = v[0] | (uint32_t(v[1]) << 16);
      packed.y = v[2] | (uint32_t(v[3]) << 16);
      packed.z = v[4] | (uint32_t(v[5]) << 16);
      packed.w = v[6] | (uint32_t(v[7]) << 16);
      *reinterpret_cast<uint4*>(dst) = packed;
    }
  }
}

// Spec: the epilogue's compile-time configuration (update/spec.cuh); GenericSpec for any.
template <bool kFp16, class Spec = GenericSpec>
__global__ void __launch_bounds__(kThreads, 2) wgrad_mma_kernel(const WgradParams a) {
  if (run_scalars_refused<Spec>(a)) return;
  extern __shared__ __align__(128) unsigned char smem[];
  uint16_t* const sA = reinterpret_cast<uint16_t*>(smem);  // [kStages][kBK][kLdS] dY, m fastest
  uint16_t* const sB = sA + kStages * kStageHalves;        // [kStages][kBK][kLdS] X, n fastest
  float* const sC = reinterpret_cast<float*>(smem);        // [kBM][kLdC] after the main loop

  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int warp_m = warp % 2, warp_n = warp / 2;
  const CtaWork work = cta_work<kBK>(a);
  const int64_t m0 = work.m0, n0 = work.n0, kt0 = work.kt0;
  const int nk = work.nk;
  const uint16_t* const dy = static_cast<const uint16_t*>(a.dy);  // [T, M], ld = lddy
  const uint16_t* const x = static_cast<const uint16_t*>(a.x);    // [T, N], ld = ldx

  // NOTE: addresses recomputed per k-tile (load_operand_stage's 64-bit t * ld + col), not
  // per-thread cursors: their live registers next to the 64 accumulators make ptxas spill.
  const uint32_t sA_addr = smem_addr(sA), sB_addr = smem_addr(sB);
  auto load_stage = [&](int stage, int64_t kt) {
    load_operand_stage(sA + stage * kStageHalves, dy, a.lddy, a.tokens, a.p.rows, m0, kt * kBK,
                       a.vec_dy != 0);
    load_operand_stage(sB + stage * kStageHalves, x, a.ldx, a.tokens, a.p.cols, n0, kt * kBK,
                       a.vec_x != 0);
  };

  float acc[kMmaM][kMmaN][4];
#pragma unroll
  for (int i = 0; i < kMmaM; ++i)
#pragma unroll
    for (int j = 0; j < kMmaN; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.0f;

  // ldmatrix.x4.trans lane roles: lanes 8j..8j+7 address the 8 rows of 8 × 8 matrix j.
  // A (dYᵀ, 16 × 16 per mma): matrices (m 0-7, k 0-7), (m 8-15, k 0-7), (m 0-7, k 8-15),
  // (m 8-15, k 8-15) → fragment registers a0..a3. B (X, 16 × 16 = two n8 mma tiles):
  // matrices (k 0-7, n 0-7), (k 8-15, n 0-7), (k 0-7, n 8-15), (k 8-15, n 8-15).
  const int a_row = (lane / 16) * 8 + lane % 8, a_col = ((lane / 8) % 2) * 8;
  const int b_row = ((lane / 8) % 2) * 8 + lane % 8, b_col = (lane / 16) * 8;

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < nk) load_stage(s, kt0 + s);
    cp_async_commit();
  }
  // NOTE: the code tables are filled while the first stages' copies fly, off the path from
  // the last mma to the update; the next barrier orders them before any read.
  if constexpr (block_tables_needed<Spec>() != 0u)
    block_tables_init<block_tables_needed<Spec>()>(threadIdx.x);
  const int prefetch_at = prefetch_ktile<kBK>(a, nk);

#pragma unroll 1
  for (int it = 0; it < nk; ++it) {
    cp_async_wait<kStages - 2>();  // stage `it` has landed (this thread's copies) ...
    __syncthreads();               // ... everyone's, and stage it - 1 is free again
    if (it + kStages - 1 < nk) load_stage((it + kStages - 1) % kStages, kt0 + it + kStages - 1);
    cp_async_commit();
    if (it == prefetch_at) prefetch_update_operands(a, m0, n0, threadIdx.x);

    const uint32_t a_base = sA_addr + (it % kStages) * kStageHalves * sizeof(uint16_t);
    const uint32_t b_base = sB_addr + (it % kStages) * kStageHalves * sizeof(uint16_t);
#pragma unroll
    for (int kk = 0; kk < kBK; kk += 16) {
      uint32_t af[kMmaM][4], bf[kMmaN][2];
#pragma unroll
      for (int i = 0; i < kMmaM; ++i)
        ldmatrix_x4_trans(af[i], a_base + 2 * ((kk + a_row) * kLdS + warp_m * kWarpM + i * 16 +
                                               a_col));
#pragma unroll
      for (int j = 0; j < kMmaN / 2; ++j) {
        uint32_t t[4];
        ldmatrix_x4_trans(t, b_base + 2 * ((kk + b_row) * kLdS + warp_n * kWarpN + j * 16 +
                                           b_col));
        bf[2 * j][0] = t[0];
        bf[2 * j][1] = t[1];
        bf[2 * j + 1][0] = t[2];
        bf[2 * j + 1][1] = t[3];
      }
#pragma unroll
      for (int i = 0; i < kMmaM; ++i)
#pragma unroll
        for (int j = 0; j < kMmaN; ++j) mma_16816<kFp16>(acc[i][j], af[i], bf[j]);
    }
  }
  cp_async_wait<0>();
  __syncthreads();  // the ring is drained; its memory becomes sC

  // Accumulator fragment (16 × 8): c0, c1 at (row g, cols 2t, 2t + 1), c2, c3 at row g + 8.
  const int g = lane / 4, t = lane % 4;
#pragma unroll
  for (int i = 0; i < kMmaM; ++i)
#pragma unroll
    for (int j = 0; j < kMmaN; ++j) {
      const int r = warp_m * kWarpM + i * 16 + g, c = warp_n * kWarpN + j * 8 + 2 * t;
      *reinterpret_cast<float2*>(&sC[r * kLdC + c]) = make_float2(acc[i][j][0], acc[i][j][1]);
      *reinterpret_cast<float2*>(&sC[(r + 8) * kLdC + c]) =
          make_float2(acc[i][j][2], acc[i][j][3]);
    }
  __syncthreads();
  finish_tile<Spec>(a, sC, m0, n0);
}

// ---- the fp32 / mixed-dtype kernel --------------------------------------------------------------

__device__ __forceinline__ float load_input(const void* base, int dtype, int64_t i) {
  switch (dtype) {
    case FORGE_DTYPE_FP32: return static_cast<const float*>(base)[i];
    case FORGE_DTYPE_BF16: return bf16_to_float(static_cast<const uint16_t*>(base)[i]);
    default: return fp16_to_float(static_cast<const uint16_t*>(base)[i]);
  }
}

// Tokens [k0, k0 + 32) × columns [c0, c0 + 128) of a [T, extent] operand into a shared
// fp32 stage [kBK][kLdF]; a warp reads 32 consecutive elements of one token row.
__device__ __forceinline__ void load_operand_stage_f32(float* stage, const void* src, int dtype,
                                                       int64_t ld, int64_t tokens,
                                                       int64_t extent, int64_t c0, int64_t k0) {
#pragma unroll 4
  for (int i = 0; i < kBK * kBM / kThreads; ++i) {
    const int e = threadIdx.x + i * kThreads;
    const int r = e / kBM, c = e % kBM;
    const int64_t t = k0 + r, col = c0 + c;
    stage[r * kLdF + c] = (t < tokens && col < extent) ? load_input(src, dtype, t * ld + col) : 0.0f;
  }
}

// Spec: GenericSpec, or GenericRunSpec (the step's scalars from a.run_k).
template <class Spec = GenericSpec>
__global__ void __launch_bounds__(kThreads, 2) wgrad_simt_kernel(const WgradParams a) {
  if (run_scalars_refused<Spec>(a)) return;
  extern __shared__ __align__(128) unsigned char smem[];
  float* const sA = reinterpret_cast<float*>(smem);  // [2][kBK][kLdF] dY, m fastest
  float* const sB = sA + 2 * kBK * kLdF;             // [2][kBK][kLdF] X, n fastest
  float* const sC = reinterpret_cast<float*>(smem);  // [kBM][kLdC] after the main loop

  const CtaWork work = cta_work<kBK>(a);
  const int64_t m0 = work.m0, n0 = work.n0, kt0 = work.kt0;
  const int nk = work.nk;

  auto load_stage = [&](int stage, int64_t kt) {
    load_operand_stage_f32(sA + stage * kBK * kLdF, a.dy, a.dy_dtype, a.lddy, a.tokens,
                           a.p.rows, m0, kt * kBK);
    load_operand_stage_f32(sB + stage * kBK * kLdF, a.x, a.x_dtype, a.ldx, a.tokens, a.p.cols,
                           n0, kt * kBK);
  };

  // Thread (ty, tx) owns rows 64·i + 4·ty + {0..3} and columns 64·h + 4·tx + {0..3}, i, h < 2.
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  float acc[8][8];
#pragma unroll
  for (int i = 0; i < 8; ++i)
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[i][j] = 0.0f;

  load_stage(0, kt0);
  __syncthreads();
#pragma unroll 1
  for (int it = 0; it < nk; ++it) {
    if (it + 1 < nk) load_stage((it + 1) % 2, kt0 + it + 1);  // stage read at it - 1: free
    const float* As = sA + (it % 2) * kBK * kLdF;
    const float* Bs = sB + (it % 2) * kBK * kLdF;
#pragma unroll 4
    for (int kk = 0; kk < kBK; ++kk) {
      float av[8], bv[8];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float4 va = *reinterpret_cast<const float4*>(&As[kk * kLdF + 64 * h + 4 * ty]);
        av[4 * h] = va.x;
        av[4 * h + 1] = va.y;
        av[4 * h + 2] = va.z;
        av[4 * h + 3] = va.w;
        const float4 vb = *reinterpret_cast<const float4*>(&Bs[kk * kLdF + 64 * h + 4 * tx]);
        bv[4 * h] = vb.x;
        bv[4 * h + 1] = vb.y;
        bv[4 * h + 2] = vb.z;
        bv[4 * h + 3] = vb.w;
      }
      // NOTE: a rounded product, then a rounded sum (--fmad=false): the CPU's arithmetic.
#pragma unroll
      for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[i][j] = acc[i][j] + av[i] * bv[j];
    }
    __syncthreads();
  }

#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int r = 64 * (i / 4) + 4 * ty + i % 4;
#pragma unroll
    for (int h = 0; h < 2; ++h)
      *reinterpret_cast<float4*>(&sC[r * kLdC + 64 * h + 4 * tx]) =
          make_float4(acc[i][4 * h], acc[i][4 * h + 1], acc[i][4 * h + 2], acc[i][4 * h + 3]);
  }
  block_tables_init(threadIdx.x);
  __syncthreads();
  finish_tile<Spec>(a, sC, m0, n0);
}

}  // namespace cuda
}  // namespace forge
