// test_gpu_fp8.cu — the CUDA backend's fp8 state conversions (src/cuda/update.cuh:
// fp8_quad_values, fp8_quad_codes, fp8_block_factor) against formats.h's reference functions,
// run on the device: every code, every one of the 2^32 fp32 bit patterns through the encoder
// (and every non-NaN one through its variant for values that are not NaN),
// and random blocks' factors and codes. Bit for bit; any difference would break CPU/GPU
// equality of fp8 states. A mismatch records its first input, so a failure names it.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdio>

#include "core/formats.h"
#include "cuda/update.cuh"
#include "device_draws.cuh"
#include "gpu_test_util.h"

namespace fgt {
namespace {

using forge::cuda::kQuad;

// [0]: mismatches, [1]: the first mismatching input's bits, [2]: what the device gave,
// [3]: what formats.h gives, [4]: a count the test may use.
struct Report {
  unsigned long long v[5];
};

__device__ void record(Report* r, uint32_t input, uint32_t got, uint32_t want) {
  if (atomicAdd(&r->v[0], 1ull) == 0) {
    r->v[1] = input;
    r->v[2] = got;
    r->v[3] = want;
  }
}

// Every code of both formats, decoded with factor 1 and with a random factor: the bits of
// fp8_value(code) · factor, NaN codes as any NaN.
__global__ void compare_decode(float factor, Report* r) {
  const uint32_t code = threadIdx.x;  // one block of 256 threads: every code
  for (int is_signed = 0; is_signed < 2; ++is_signed)
    for (int k = 0; k < 2; ++k) {
      const float f = k == 0 ? 1.0f : factor;
      float v[kQuad];
      forge::cuda::fp8_quad_values(code * 0x01010101u, is_signed != 0, f, v);
      const float want = forge::fp8_value(static_cast<uint8_t>(code), is_signed != 0) * f;
      for (int e = 0; e < kQuad; ++e) {
        const bool same = __float_as_uint(v[e]) == __float_as_uint(want) ||
                          (isnan(v[e]) && isnan(want));
        if (!same) record(r, code | (is_signed << 8), __float_as_uint(v[e]), __float_as_uint(want));
      }
    }
}

// Every float whose bits lie in [first, first + count), through fp8_quad_codes with factor 1
// (q = x exactly), against fp8_nearest: element e of each quad is x, the others its neighbours.
// kNonNan: the variant for values known not to be NaN, checked on every element that is not
// (a NaN's byte is one no caller stores).
template <bool kNonNan>
__global__ void compare_codes(uint32_t first, uint64_t count, Report* r) {
  for (uint64_t i = blockIdx.x * uint64_t(blockDim.x) + threadIdx.x; i < count;
       i += uint64_t(gridDim.x) * blockDim.x) {
    const uint32_t bits = first + static_cast<uint32_t>(i);
    float v[kQuad];
    for (int e = 0; e < kQuad; ++e) v[e] = __uint_as_float(bits ^ static_cast<uint32_t>(e));
    for (int is_signed = 0; is_signed < 2; ++is_signed) {
      const uint32_t codes = forge::cuda::fp8_quad_codes<kNonNan>(v, 1.0f, true, is_signed != 0);
      for (int e = 0; e < kQuad; ++e) {
        if (kNonNan && isnan(v[e])) continue;
        const uint32_t got = (codes >> (8 * e)) & 0xFFu;
        const uint32_t want = forge::fp8_nearest(v[e], is_signed != 0);
        if (got != want) record(r, __float_as_uint(v[e]), got | (is_signed << 8), want);
      }
    }
  }
}

// A random block: absmax over [2^-100, 2^127] and the values no step stores (0, -0, below
// 2^-100, subnormal, infinite, NaN); four values |v| <= absmax at log-uniform fractions of it
// (zeros and ±absmax included). The factors, where fp8_block_factor takes the block, must be
// the IEEE quotients, and the codes fp8_encode's; v[4] counts the blocks it took.
__global__ void compare_blocks(uint32_t count, Report* r) {
  unsigned long long took = 0;
  for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < count; i += gridDim.x * blockDim.x) {
    const uint32_t z0 = mix(8 * uint64_t(i));
    float absmax;
    switch (z0 & 15) {
      case 0: absmax = 0.0f; break;
      case 1: absmax = -0.0f; break;
      case 2: absmax = __uint_as_float(z0 >> 9); break;  // subnormal
      case 3:  // [2^-102, 2^-100)
        absmax = __uint_as_float(0x0D7FFFFFu - (z0 >> 8) % 0x01000000u);
        break;
      case 4: absmax = (z0 >> 4) & 1 ? INFINITY : __uint_as_float(0x7FC00000u | (z0 >> 9)); break;
      default:  // [2^-100, 2^128)
        absmax = __uint_as_float(((27u + (z0 >> 4) % 228u) << 23) |
                                 (mix(8 * uint64_t(i) + 1) & 0x7FFFFFu));
    }
    float v[kQuad];
    block_quad(absmax, 8 * uint64_t(i) + 2, v);
    for (int is_signed = 0; is_signed < 2; ++is_signed) {
      const float top = forge::fp8_format(is_signed != 0).top;
      bool dec_ok = true, enc_ok = true;
      const float dec = forge::cuda::fp8_block_factor<true>(absmax, top, dec_ok);
      const float enc = forge::cuda::fp8_block_factor<false>(absmax, top, enc_ok);
      if (dec_ok != enc_ok) record(r, __float_as_uint(absmax), dec_ok, enc_ok);
      if (!dec_ok) continue;
      ++took;
      const float dec_want = absmax / top;
      if (__float_as_uint(dec) != __float_as_uint(dec_want))
        record(r, __float_as_uint(absmax), __float_as_uint(dec), __float_as_uint(dec_want));
      if (absmax == 0.0f) continue;  // (no encode factor: the codes are zeros)
      const float enc_want = top / absmax;
      if (__float_as_uint(enc) != __float_as_uint(enc_want))
        record(r, __float_as_uint(absmax), __float_as_uint(enc), __float_as_uint(enc_want));
      const float amax = forge::fp8_block_absmax(absmax);
      const uint32_t codes =
          forge::cuda::fp8_quad_codes(v, enc, amax >= forge::kFp8MinAbsmax, is_signed != 0);
      for (int e = 0; e < kQuad; ++e) {
        const uint32_t want = forge::fp8_encode(v[e], amax, is_signed != 0);
        if (((codes >> (8 * e)) & 0xFFu) != want)
          record(r, __float_as_uint(v[e]), (codes >> (8 * e)) & 0xFFu, want);
      }
    }
  }
  atomicAdd(&r->v[4], took);
}

Report run(void (*launch)(Report*)) {
  Report* d = nullptr;
  CUDA_OK(cudaMalloc(&d, sizeof(Report)));
  CUDA_OK(cudaMemset(d, 0, sizeof(Report)));
  launch(d);
  CUDA_OK(cudaGetLastError());
  CUDA_OK(cudaDeviceSynchronize());
  Report h{};
  CUDA_OK(cudaMemcpy(&h, d, sizeof(h), cudaMemcpyDeviceToHost));
  CUDA_OK(cudaFree(d));
  return h;
}

std::string first_mismatch(const Report& r) {
  char text[160];
  std::snprintf(text, sizeof(text),
                "%llu mismatches; the first: input 0x%08llx, device 0x%llx, formats.h 0x%llx",
                r.v[0], r.v[1], r.v[2], r.v[3]);
  return text;
}

TEST(Fp8Device, DecodeEveryCode) {
  FORGE_REQUIRE_GPU();
  const Report r = run([](Report* d) { compare_decode<<<1, 256>>>(0x1.234568p-17f, d); });
  EXPECT_EQ(0ull, r.v[0]) << first_mismatch(r);
}

TEST(Fp8Device, EncodeEveryFloat) {
  FORGE_REQUIRE_GPU();
  // all 2^32 bit patterns: both signs, zeros, subnormals, saturation, infinities and NaNs
  const Report r =
      run([](Report* d) { compare_codes<false><<<4096, 256>>>(0u, 1ull << 32, d); });
  EXPECT_EQ(0ull, r.v[0]) << first_mismatch(r);
}

TEST(Fp8Device, EncodeEveryNonNanFloatSigned) {
  FORGE_REQUIRE_GPU();
  // the conversion without the signs put back: both signs, zeros, subnormals, saturation and
  // infinities
  const Report r = run([](Report* d) { compare_codes<true><<<4096, 256>>>(0u, 1ull << 32, d); });
  EXPECT_EQ(0ull, r.v[0]) << first_mismatch(r);
}

TEST(Fp8Device, BlockFactorsAndCodes) {
  FORGE_REQUIRE_GPU();
  constexpr uint32_t kBlocks = 1u << 24;
  const Report r = run([](Report* d) { compare_blocks<<<1024, 256>>>(kBlocks, d); });
  EXPECT_EQ(0ull, r.v[0]) << first_mismatch(r);
  // absmax cases 5..15 of 16 and +0 (case 0) take the fast path: 3/4 of the blocks, twice
  EXPECT_GT(r.v[4], 1ull * kBlocks) << "the fast path took too few blocks to test it";
}

}  // namespace
}  // namespace fgt
