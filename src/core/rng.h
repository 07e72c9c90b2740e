// rng.h — counter-based random bits for stochastic rounding.
//
// bits = f(seed, step, stream, element index): no state, no thread ids, so every
// backend and every launch shape draws the same bits for the same element.
// Stream 0 is the weight, stream 1 + i is optimizer state i.
#pragma once

#include "formats.h"

namespace forge {

// A 64-bit finalizer (xor-shift / multiply rounds): every input bit flips each
// output bit with probability ~1/2.
FORGE_HD uint64_t mix64(uint64_t z) {
  z ^= z >> 30;
  z *= 0xBF58476D1CE4E5B9ull;
  z ^= z >> 27;
  z *= 0x94D049BB133111EBull;
  z ^= z >> 31;
  return z;
}

// Per (seed, step, stream) key; computed once per call on the host.
FORGE_HD uint64_t rng_key(uint64_t seed, uint64_t step, uint32_t stream) {
  return mix64(mix64(mix64(seed ^ 0x5F0E5EED5EEDull) + step) + stream);
}

// 32 random bits for element `index` (row * cols + col of the parameter).
FORGE_HD uint32_t rng_bits(uint64_t key, uint64_t index) {
  return static_cast<uint32_t>(mix64(key + index * 0x9E3779B97F4A7C15ull) >> 32);
}

}  // namespace forge
