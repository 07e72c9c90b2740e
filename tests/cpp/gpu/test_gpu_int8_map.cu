// test_gpu_int8_map.cu — the CUDA backend's fast int8 dynamic map (src/cuda/update.cuh:
// int8_nearest_level_fast, int8_nearest_level_unit_fast, int8_decode_fast, int8_encode_fast,
// int8_quad_ratios / int8_quad_ratios_ieee with int8_quad_codes) against formats.h's
// reference functions, run on the device: every code, every float in [0, 2] (all 2^30 + 2^23
// bit patterns; the unit form every one up to 1 and negatives), special values, and 2^24 random
// (x, absmax) pairs and blocks.
// Bit for bit; any difference would break CPU/GPU equality of int8 states. The device forms
// read tables in shared memory (block_tables_init): each kernel here fills them first, as
// the library's kernels do.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include "core/formats.h"
#include "cuda/update.cuh"
#include "device_draws.cuh"
#include "gpu_test_util.h"

namespace fgt {
namespace {

__global__ void compare_decode(unsigned long long* mismatches) {
  forge::cuda::block_tables_init(threadIdx.x);  // the device forms read it
  __syncthreads();
  const int code = threadIdx.x;  // one block of 256 threads: every code
  for (int is_signed = 0; is_signed < 2; ++is_signed) {
    const float want = forge::int8_decode(static_cast<uint8_t>(code), is_signed != 0);
    const float got = forge::cuda::int8_decode_fast(static_cast<uint8_t>(code), is_signed != 0);
    if (__float_as_uint(want) != __float_as_uint(got)) atomicAdd(mismatches, 1ull);
  }
}

// Every float whose bits lie in [first, first + count).
__global__ void compare_nearest(uint32_t first, uint32_t count, unsigned long long* mismatches) {
  forge::cuda::block_tables_init(threadIdx.x);  // the device forms read it
  __syncthreads();
  unsigned long long bad = 0;
  for (uint64_t i = blockIdx.x * uint64_t(blockDim.x) + threadIdx.x; i < count;
       i += uint64_t(gridDim.x) * blockDim.x) {
    const float a = __uint_as_float(first + static_cast<uint32_t>(i));
    const int tops[2] = {forge::kInt8SignedTop, forge::kInt8UnsignedTop};
    for (int top : tops) {
      const int want = forge::int8_nearest_level(a, top);
      if (want != forge::cuda::int8_nearest_level_fast(a, top)) ++bad;
      // the unit form's domain: a <= 1 (a block's ratios)
      if (a <= 1.0f && want != forge::cuda::int8_nearest_level_unit_fast(a, top)) ++bad;
    }
  }
  if (bad) atomicAdd(mismatches, bad);
}

// Random finite x (any finite bit pattern: subnormals and zeros included; a step stores no
// code of another) against an absmax that is |x| scaled up a little (infinity where that
// overflows), or another random bit pattern where it is at least |x| or not positive (zero,
// negative, NaN): the blocks a step encodes.
__global__ void compare_encode(uint32_t count, unsigned long long* mismatches) {
  forge::cuda::block_tables_init(threadIdx.x);  // the device forms read it
  __syncthreads();
  unsigned long long bad = 0;
  for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < count; i += gridDim.x * blockDim.x) {
    const float x = __uint_as_float(mix(2 * uint64_t(i)));
    const uint32_t r = mix(2 * uint64_t(i) + 1);
    const float absmax = (r & 3) ? fabsf(x) * (1.0f + static_cast<float>(r >> 24) / 64.0f)
                                 : __uint_as_float(r);
    if (!isfinite(x) || (absmax > 0.0f && absmax < fabsf(x))) continue;
    for (int is_signed = 0; is_signed < 2; ++is_signed)
      if (forge::int8_encode(x, absmax, is_signed != 0) !=
          forge::cuda::int8_encode_fast(x, absmax, is_signed != 0))
        ++bad;
  }
  if (bad) atomicAdd(mismatches, bad);
}

// int8_quad_ratios (the fused epilogue's division for int8 encodes) and, where it declines
// the block, int8_quad_ratios_ieee: a random absmax over 2^-75..2^70 (and zero, subnormal,
// infinite, NaN), four values |v| <= absmax at log-uniform fractions of it down to 2^-149
// (zeros, subnormals and v = ±absmax included; of 1 for an infinite or NaN absmax). Every code
// int8_quad_codes makes from the ratios must equal int8_encode's. fast[0] counts the blocks
// the fast path took, so the test can tell that both paths were exercised.
__global__ void compare_quad_ratios(uint32_t count, unsigned long long* mismatches,
                                    unsigned long long* fast) {
  forge::cuda::block_tables_init(threadIdx.x);  // the device forms read it
  __syncthreads();
  unsigned long long bad = 0, took = 0;
  for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < count; i += gridDim.x * blockDim.x) {
    const float absmax = block_absmax_draw(6 * uint64_t(i));
    float v[forge::cuda::kQuad], ratio[forge::cuda::kQuad];
    // an infinite or NaN absmax (which no step stores) over finite values, as a stored block's
    block_quad(isfinite(absmax) ? absmax : 1.0f, 6 * uint64_t(i) + 2, v);
    if (forge::cuda::int8_quad_ratios(absmax, v, ratio)) {
      ++took;
    } else {
      forge::cuda::int8_quad_ratios_ieee(absmax, v, ratio);
    }
    for (int is_signed = 0; is_signed < 2; ++is_signed) {
      const uint32_t codes = forge::cuda::int8_quad_codes(v, ratio, is_signed != 0);
      for (int e = 0; e < forge::cuda::kQuad; ++e)
        if (forge::int8_encode(v[e], absmax, is_signed != 0) != ((codes >> (8 * e)) & 0xFFu)) ++bad;
    }
  }
  if (bad) atomicAdd(mismatches, bad);
  atomicAdd(fast, took);
}

TEST(Int8MapFast, DecodeEveryCode) {
  FORGE_REQUIRE_GPU();
  EXPECT_EQ(0ull, run_and_count([](unsigned long long* m) { compare_decode<<<1, 256>>>(m); }));
}

TEST(Int8MapFast, NearestLevelEveryFloatInZeroToTwo) {
  FORGE_REQUIRE_GPU();
  // [+0, 2.0]: all 0x40000000 + 1 patterns, plus negatives near 0, NaNs and infinities.
  EXPECT_EQ(0ull, run_and_count([](unsigned long long* m) {
              compare_nearest<<<1024, 256>>>(0u, 0x40000001u, m);
              compare_nearest<<<64, 256>>>(0x80000000u, 1u << 16, m);
              compare_nearest<<<64, 256>>>(0x7F800000u, 1u << 16, m);
              compare_nearest<<<64, 256>>>(0xFF800000u, 1u << 16, m);
            }));
}

TEST(Int8MapFast, EncodeRandomPairs) {
  FORGE_REQUIRE_GPU();
  EXPECT_EQ(0ull, run_and_count([](unsigned long long* m) { compare_encode<<<1024, 256>>>(1u << 24, m); }));
}

TEST(Int8MapFast, QuadRatiosEncodeLikeTheReference) {
  FORGE_REQUIRE_GPU();
  constexpr uint32_t kBlocks = 1u << 24;
  unsigned long long* d = nullptr;  // [mismatches, blocks the fast path took]
  CUDA_OK(cudaMalloc(&d, 2 * sizeof(unsigned long long)));
  CUDA_OK(cudaMemset(d, 0, 2 * sizeof(unsigned long long)));
  compare_quad_ratios<<<1024, 256>>>(kBlocks, d, d + 1);
  CUDA_OK(cudaGetLastError());
  unsigned long long h[2] = {};
  CUDA_OK(cudaMemcpy(h, d, sizeof(h), cudaMemcpyDeviceToHost));
  CUDA_OK(cudaFree(d));
  EXPECT_EQ(0ull, h[0]);
  // absmax cases 4..15 of 16, of which the exponents in [2^-62, 2^62) are 124 of 146; the
  // other blocks (cases 0..3 and the other exponents) take the IEEE ratios
  EXPECT_GT(h[1], kBlocks / 2) << "the fast path took too few blocks to test it";
  EXPECT_LT(h[1], kBlocks - kBlocks / 8) << "the IEEE ratios took too few blocks to test them";
}

}  // namespace
}  // namespace fgt
