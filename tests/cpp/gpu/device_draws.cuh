// device_draws.cuh — random inputs drawn on the device by the GPU format tests
// (test_gpu_int8_map.cu, test_gpu_fp8.cu, test_gpu_int4.cu): a hash of the draw's index, so
// every thread draws its own and a failure's inputs can be drawn again.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include "core/rng.h"
#include "cuda/update.cuh"

namespace fgt {

// Draw z: 32 random bits.
__device__ inline uint32_t mix(uint64_t z) { return static_cast<uint32_t>(forge::mix64(z) >> 32); }

// A block's absmax as the int8 / int4 encode tests draw it (draws first, first + 1): 2^-75 ..
// 2^70, and a quarter of the time one no step stores (zero, subnormal, infinite, NaN).
__device__ inline float block_absmax_draw(uint64_t first) {
  const uint32_t r = mix(first);
  switch (r & 15) {
    case 0: return 0.0f;
    case 1: return __uint_as_float(r >> 9);  // subnormal
    case 2: return INFINITY;
    case 3: return __uint_as_float(0x7FC00000u | (r >> 9));  // NaN
    default:  // 2^-75 .. 2^70
      return __uint_as_float(((52u + (r >> 4) % 146u) << 23) | (mix(first + 1) & 0x7FFFFFu));
  }
}

// A quad of values of a block whose absmax is `absmax`: each |v| <= absmax, at a log-uniform
// fraction of it down to 2^-149 (zeros and ±absmax included), either sign; draws first .. first
// + 3.
__device__ inline void block_quad(float absmax, uint64_t first, float (&v)[forge::cuda::kQuad]) {
  for (int e = 0; e < forge::cuda::kQuad; ++e) {
    const uint32_t z = mix(first + e);
    float f;
    switch (z & 7) {
      case 0: f = 0.0f; break;
      case 1: f = 1.0f; break;
      default: f = __uint_as_float(((z >> 3) % 127u) << 23 | (z >> 9));  // [2^-149, 1)
    }
    v[e] = __fmul_rn(absmax, f) * ((z >> 30) & 1 ? -1.0f : 1.0f);
  }
}

}  // namespace fgt
