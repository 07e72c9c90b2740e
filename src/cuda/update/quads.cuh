// quads.cuh — the element quad and its vector loads and stores. A thread owns 4 consecutive
// columns of one row, and the 16 lanes of a half-warp together own one 64-column block of
// int8 / fp8 states (FORGE_INT8_BLOCK), so every global access is a 4-element vector (16 B
// fp32, 8 B bf16, 4 B codes) with 16 lanes covering one contiguous row segment, and a block's
// absmax is a 4-step shuffle reduction (block_states.cuh). The fused kernels' pipelined passes
// over block states pair a lane's two quads in one block instead, 8 lanes per block
// (QuadBlocks).
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include "core/formats.h"
#include "forge/forge.h"

namespace forge {
namespace cuda {

constexpr int kQuad = 4;                               // columns per thread
constexpr int kGroupLanes = FORGE_INT8_BLOCK / kQuad;  // lanes per int8 block: 16
static_assert(kGroupLanes == 16, "a half-warp owns one int8 block");

__host__ __device__ __forceinline__ int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

// ---- quad loads and stores ----------------------------------------------------------------------
// `idx` = row * cols + col of the quad's first element; `n` (0..4) elements are in range;
// `vec` = n == 4 and ParamView::vec4, so one aligned vector access is legal.

__device__ __forceinline__ void load_quad_f32(const float* base, int64_t idx, int n, bool vec,
                                              float (&v)[kQuad]) {
  if (vec) {
    const float4 q = *reinterpret_cast<const float4*>(base + idx);
    v[0] = q.x; v[1] = q.y; v[2] = q.z; v[3] = q.w;
  } else {
#pragma unroll
    for (int e = 0; e < kQuad; ++e) v[e] = e < n ? base[idx + e] : 0.0f;
  }
}

// A quad of 16-bit floats (bf16 or fp16: `to_float` converts one).
template <class ToFloat>
__device__ __forceinline__ void load_quad_16(const uint16_t* base, int64_t idx, int n, bool vec,
                                             float (&v)[kQuad], ToFloat to_float) {
  if (vec) {
    const uint2 q = *reinterpret_cast<const uint2*>(base + idx);
    v[0] = to_float(static_cast<uint16_t>(q.x & 0xFFFFu));
    v[1] = to_float(static_cast<uint16_t>(q.x >> 16));
    v[2] = to_float(static_cast<uint16_t>(q.y & 0xFFFFu));
    v[3] = to_float(static_cast<uint16_t>(q.y >> 16));
  } else {
#pragma unroll
    for (int e = 0; e < kQuad; ++e) v[e] = e < n ? to_float(base[idx + e]) : 0.0f;
  }
}

__device__ __forceinline__ void load_quad_bf16(const uint16_t* base, int64_t idx, int n, bool vec,
                                               float (&v)[kQuad]) {
  load_quad_16(base, idx, n, vec, v, [](uint16_t h) { return bf16_to_float(h); });
}

__device__ __forceinline__ void load_quad_codes(const uint8_t* base, int64_t idx, int n, bool vec,
                                                uint8_t (&c)[kQuad]) {
  if (vec) {
    const uint32_t q = *reinterpret_cast<const uint32_t*>(base + idx);
#pragma unroll
    for (int e = 0; e < kQuad; ++e) c[e] = static_cast<uint8_t>(q >> (8 * e));
  } else {
#pragma unroll
    for (int e = 0; e < kQuad; ++e) c[e] = e < n ? base[idx + e] : 0;
  }
}

// Stores element e unless bit e of `keep` is set (a skipped element).
__device__ __forceinline__ void store_quad_f32(float* base, int64_t idx, int n, bool vec,
                                               unsigned keep, const float (&v)[kQuad]) {
  if (vec && keep == 0) {
    *reinterpret_cast<float4*>(base + idx) = make_float4(v[0], v[1], v[2], v[3]);
  } else {
#pragma unroll
    for (int e = 0; e < kQuad; ++e)
      if (e < n && !((keep >> e) & 1u)) base[idx + e] = v[e];
  }
}

__device__ __forceinline__ void store_quad_u16(uint16_t* base, int64_t idx, int n, bool vec,
                                               unsigned keep, const uint16_t (&h)[kQuad]) {
  if (vec && keep == 0) {
    uint2 q;
    q.x = static_cast<uint32_t>(h[0]) | (static_cast<uint32_t>(h[1]) << 16);
    q.y = static_cast<uint32_t>(h[2]) | (static_cast<uint32_t>(h[3]) << 16);
    *reinterpret_cast<uint2*>(base + idx) = q;
  } else {
#pragma unroll
    for (int e = 0; e < kQuad; ++e)
      if (e < n && !((keep >> e) & 1u)) base[idx + e] = h[e];
  }
}

// Stores element e's code (byte e of `codes`) unless bit e of `keep` is set (a block's skipped
// element whose code stays: kept_block_absmax).
__device__ __forceinline__ void store_quad_codes(uint8_t* base, int64_t idx, int n, bool vec,
                                                 unsigned keep, uint32_t codes) {
  if (vec && keep == 0) {
    *reinterpret_cast<uint32_t*>(base + idx) = codes;
  } else {
#pragma unroll
    for (int e = 0; e < kQuad; ++e)
      if (e < n && !((keep >> e) & 1u)) base[idx + e] = static_cast<uint8_t>(codes >> (8 * e));
  }
}

// ---- int4 codes: a quad is two bytes ----------------------------------------------------------
// `byte` = row * int4_row_bytes(cols) + col / 2 of the quad's first element (formats.h): with
// col % 4 == 0 a quad owns its two bytes, so no other thread writes them. Codes are packed 4 bits
// per element, element e in bits 4e..4e+3. `vec`: n == 4 and ParamView::vec4 (cols % 4 == 0, so
// byte is even: one aligned 16-bit access).

__device__ __forceinline__ uint32_t load_quad_int4(const uint8_t* base, int64_t byte, int n,
                                                   bool vec) {
  if (vec) return *reinterpret_cast<const uint16_t*>(base + byte);
  uint32_t codes = n > 0 ? base[byte] : 0u;
  if (n > 2) codes |= static_cast<uint32_t>(base[byte + 1]) << 8;
  return codes;
}

// Stores element e's code (bits 4e..4e+3 of `codes`) unless bit e of `keep` is set (a block's
// skipped element whose code stays), as formats.h's int4_store_code: a kept element's nibble
// stays, and an odd n (a quad ends its row only where n < 4) puts the row's padding nibble after
// element n - 1, written 0 with it.
__device__ __forceinline__ void store_quad_int4(uint8_t* base, int64_t byte, int n, bool vec,
                                                unsigned keep, uint32_t codes) {
  if (vec && keep == 0) {
    *reinterpret_cast<uint16_t*>(base + byte) = static_cast<uint16_t>(codes);
    return;
  }
#pragma unroll
  for (int b = 0; b < 2; ++b) {
    uint32_t mask = 0u, value = 0u;  // the nibbles of byte b this store writes; with codes
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int e = 2 * b + h;
      if (e < n && !((keep >> e) & 1u)) {
        mask |= 15u << (4 * h);
        value |= 15u << (4 * h);
      }
      if (h == 1 && e == n && (mask & 15u)) mask |= 0xF0u;  // the padding: 0
    }
    if (mask == 0u) continue;
    const uint32_t mine = (codes >> (8 * b)) & value;
    base[byte + b] = static_cast<uint8_t>(
        mask == 0xFFu ? mine : (static_cast<uint32_t>(base[byte + b]) & ~mask) | mine);
  }
}

}  // namespace cuda
}  // namespace forge
