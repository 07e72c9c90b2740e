// rng.h — counter-based random bits for stochastic rounding.
//
// bits = f(seed, step, element index): no state, no thread ids, so every backend and every
// launch shape draws the same bits for the same element. One 64-bit draw per element and
// step holds 16 bits for each stream (the weight and up to 3 optimizer states).
#pragma once

#include "formats.h"
#include "forge/forge.h"

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

// Per (seed, step) key; computed once per call on the host.
FORGE_HD uint64_t rng_key(uint64_t seed, uint64_t step) {
  return mix64(mix64(seed ^ 0x5F0E5EED5EEDull) + step);
}

// One 64-bit draw per element and step (`index` = row * cols + col of the parameter):
// every stochastic rounding of that element in that step takes its 16 bits from it.
// NOTE: one hash per element, not one per stored tensor: a hash is ~20 SASS instructions in
// the CUDA epilogue's hot loop, and three of them cost about as many as the whole AdamW update.
// A backend may compute key + index * kRngIndexMul once per group of consecutive elements and
// step it by kRngIndexMul per element (unsigned arithmetic wraps: the same draws).
constexpr uint64_t kRngIndexMul = 0x9E3779B97F4A7C15ull;
FORGE_HD uint64_t rng_draw(uint64_t key, uint64_t index) {
  return mix64(key + index * kRngIndexMul);
}

// Stream 0 is the weight, stream 1 + i is optimizer state i: each takes its own 16 bits.
constexpr int kRngStreams = 4;
static_assert(1 + FORGE_MAX_STATES <= kRngStreams, "a draw has 16 bits for each stream");
FORGE_HD uint32_t rng_stream_bits(uint64_t draw, int stream) {
  return static_cast<uint32_t>(draw >> (16 * stream)) & 0xFFFFu;
}

}  // namespace forge
