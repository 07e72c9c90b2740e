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
