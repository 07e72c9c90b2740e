// rng.h — counter-based random bits for stochastic rounding.
//
// bits = f(seed, step, element index, stream): no state, no thread ids, so every backend and
// every launch shape draws the same bits for the same element.
#pragma once

#include "formats.h"
#include "forge/forge.h"

namespace forge {

// A 64-bit finalizer: xor-shift, multiply, xor-shift, multiply, xor-shift (splitmix64's
// multipliers), its three shifts the parameters.
template <int kShift1, int kShift2, int kShift3>
FORGE_HD uint64_t xorshift_multiply_mix(uint64_t z) {
  z ^= z >> kShift1;
  z *= 0xBF58476D1CE4E5B9ull;
  z ^= z >> kShift2;
  z *= 0x94D049BB133111EBull;
  z ^= z >> kShift3;
  return z;
}

// splitmix64's finalizer: every input bit flips each output bit with probability ~1/2.
FORGE_HD uint64_t mix64(uint64_t z) { return xorshift_multiply_mix<30, 27, 31>(z); }

// Stochastic rounding's finalizer: mix64's rounds with every shift 32. A 64-bit shift by 32
// is a move, so each xor-shift is one 32-bit xor on the GPU: ~11 SASS instructions against
// mix64's ~20 (two 64-bit multiplies each way). Its outputs over the counters rng_group_hash
// feeds it pass dieharder's battery (design §2; tests/cpp/test_formats.cpp checks the fields).
// NOTE: one round (one multiply) fails the battery (diehard_rank_6x8, oqso, dna).
FORGE_HD uint64_t sr_mix(uint64_t z) { return xorshift_multiply_mix<32, 32, 32>(z); }

// Per (seed, step) key; computed once per call on the host.
FORGE_HD uint64_t rng_key(uint64_t seed, uint64_t step) {
  return mix64(mix64(seed ^ 0x5F0E5EED5EEDull) + step);
}

// Stochastic rounding's bits. Every element takes 16 bits per stream and step (stream 0 is
// the weight, stream 1 + i optimizer state i). One 64-bit hash (sr_mix) serves one stream of
// an aligned group of 4 consecutive elements (index / 4 = group, index % 4 = its 16-bit field).
// NOTE: per group and stream, not per element: a stream a step does not use costs nothing
// (AdamW with stochastic weight and states hashes 3 times per 4 elements, a stochastic weight
// alone once), where one 64-bit hash per element carried all four streams. Every field still
// comes from its own hash input.
// A backend may compute key + x · kRngIndexMul once and step it by kRngIndexMul for the next
// stream or group (unsigned arithmetic wraps: the same hashes).
constexpr int kRngStreams = 4;
static_assert(1 + FORGE_MAX_STATES <= kRngStreams, "a stream for the weight and each state");
constexpr uint64_t kRngIndexMul = 0x9E3779B97F4A7C15ull;
FORGE_HD uint64_t rng_group_hash(uint64_t key, uint64_t group, int stream) {
  return sr_mix(key + (group * kRngStreams + static_cast<uint64_t>(stream)) * kRngIndexMul);
}

// The 16 bits of element `index` in `stream`: row * cols + col of the parameter, or of the full
// parameter when it is a shard of one (forge_param's row_offset, col_offset, full_cols).
FORGE_HD uint32_t rng_bits(uint64_t key, uint64_t index, int stream) {
  return static_cast<uint32_t>(rng_group_hash(key, index >> 2, stream) >> (16 * (index & 3))) &
         0xFFFFu;
}

// All 4 streams' bits of one element, packed 16 per stream (the form the CPU backend's
// segment_draws builds, one hash per group of 4 and stream used; tests call this).
FORGE_HD uint64_t rng_draw(uint64_t key, uint64_t index) {
  uint64_t draw = 0;
  for (int stream = 0; stream < kRngStreams; ++stream)
    draw |= static_cast<uint64_t>(rng_bits(key, index, stream)) << (16 * stream);
  return draw;
}
FORGE_HD uint32_t rng_stream_bits(uint64_t draw, int stream) {
  return static_cast<uint32_t>(draw >> (16 * stream)) & 0xFFFFu;
}

}  // namespace forge
