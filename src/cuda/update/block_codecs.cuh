// block_codecs.cuh — int8, fp8 and int4 block states' codes, per quad and bit for bit
// formats.h's: the int8 dynamic map from two shared-memory tables (its level search and
// decoding), the ratios |x| / absmax of an int8 or int4 encode, the fp8 conversions (on sm_89
// and later the hardware's), and int4's packed codes. Given a block's absmax or factor, each
// function is one thread's work; the warp-cooperative part (block maxima, layouts, the batch's
// stores) is block_states.cuh. tests/cpp/gpu/test_gpu_int8_map.cu, test_gpu_fp8.cu and
// test_gpu_int4.cu check every code against formats.h on the device.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include "core/formats.h"
#include "cuda/ptx.cuh"
#include "cuda/update/fast_math.cuh"
#include "cuda/update/quads.cuh"
#include "forge/forge.h"

namespace forge {
namespace cuda {

// ---- the int8 dynamic map, fast and bit-identical -----------------------------------------------
//
// formats.h's int8_level_value() scales with ldexpf and int8_nearest_level() binary-searches
// 8 levels deep; formats.h's direct forms (what the CPU runs) take ~15 and ~60 integer /
// select instructions, which leave the int8 epilogue ALU-bound on the GPU. The device forms
// read two tables in shared memory:
//  - the nearest level: formats.h's int8_nearest_level_sixteenths (int8_nearest_level_unit
//    for a block's ratios, which are at most 1), whose 16-word table gives the count of tie
//    thresholds below each sixteenth of the mantissa range and the one inside it (one read
//    and one subtraction: the level search is ~10 instructions);
//  - decoding: every code's value (int8_code_table).
// NOTE: the sixteen words sit in sixteen banks: any pattern of lookups by a warp is one
// wavefront.
// test_gpu_int8_map.cu checks every code and every float in [0, 2] against formats.h's
// reference on the device; test_formats.cpp checks the same forms on the CPU.

// The CTA's sixteenths table (formats.h, int8_sixteenth_word).
__device__ __forceinline__ uint32_t* int8_sixteenths_table() {
  __shared__ uint32_t table[16];
  return table;
}

// Every code's decoded value, formats.h's int8_decode without the absmax: [0, 256) the
// signed codes, [256, 512) the unsigned ones.
// NOTE: a decode is one shared-memory read instead of ~11 instructions (the level from the
// fraction, its scale, level 0, the sign). A warp's random codes cost a few wavefronts
// per read; the shared-memory pipe has room for them next to the ALU-bound encode.
__device__ __forceinline__ float* int8_code_table() {
  __shared__ float table[512];
  return table;
}

// Both int4 maps' values by code (formats.h, int4_map): [0, 16) the signed codes, [16, 32) the
// unsigned ones.
__device__ __forceinline__ float* int4_code_table() {
  __shared__ float table[2 * kInt4Codes];
  return table;
}

// The int4 encodes' buckets, one table per map: a ratio r = |q| >= 0 by its exponent and top 4
// mantissa bits (r's bits >> 19), from 2^-10 (below it lies no midpoint: the smallest are
// 0.00275 signed, 0.0019 unsigned) to 2 (bucket 176: 2 and above, infinity and NaN). Each
// bucket holds at most one of a map's midpoints (its positive ones, for the signed map): they
// are at least 9 % apart, a bucket at most 6.25 % wide (test_formats.cpp checks it). Entry b
// of the signed table is {the four codes the bucket can give, by selector (bit 0: q is
// negative, bit 1: r passes the midpoint inside the bucket), one per byte; the bits of that
// midpoint or ~0u}; of the unsigned table, {the midpoints below the bucket; the same bits}.
constexpr int kInt4Buckets = 177;
constexpr int kInt4FirstBucket = (127 - 10) << 4;  // 2^-10's bits >> 19
__device__ __forceinline__ uint2* int4_bucket_table(bool is_signed) {
  __shared__ uint2 table[2 * kInt4Buckets];
  return table + (is_signed ? 0 : kInt4Buckets);
}
// NOTE: the midpoint loop unrolled, each midpoint a constant: every CTA of an int4 kernel
// fills the entries before its update, and a run-time index would read each midpoint through
// the map's switch, a branch tree (docs/performance.md, "int4 states").
template <bool kSigned>
__device__ __forceinline__ uint2 int4_bucket_entry(int b) {
  const uint32_t lo = static_cast<uint32_t>(kInt4FirstBucket + b) << 19;
  const uint32_t hi = b + 1 < kInt4Buckets ? lo + (1u << 19) : 0xFFFFFFFFu;
  uint32_t below = 0u, mid = 0xFFFFFFFFu;  // the midpoints below the bucket; the one inside it
#pragma unroll
  for (int k = kSigned ? kInt4Codes / 2 : 1; k < kInt4Codes; ++k) {  // (signed: positive)
    const uint32_t m =
        __float_as_uint(kSigned ? int4_signed_midpoint(k) : int4_unsigned_midpoint(k));
    if (m < lo) {
      below += 1u;
    } else if (m < hi) {
      mid = m;
    }
  }
  if (!kSigned) return make_uint2(below, mid);
  // With c midpoints counted, a q >= 0 takes code c, a q < 0 code (16 - min(c, 7)) & 15
  // (int4_code_fast).
  auto negative = [](uint32_t c) { return (16u - min(c, 7u)) & 15u; };
  const uint32_t codes = below | negative(below) << 8 | (below + 1u) << 16 |
                         negative(below + 1u) << 24;
  return make_uint2(codes, mid);
}

// The tables a kernel fills (block_tables_init), as bits: int8's two, int4's maps and buckets.
constexpr unsigned kInt8Tables = 1u, kInt4Tables = 2u, kAllTables = kInt8Tables | kInt4Tables;

// Fills the tables named by kTables: the CTA's threads (tid: the thread's index in it,
// blockDim.x of them) write; a __syncthreads must follow before the first int8 or int4 access.
// Every kernel that may touch int8 or int4 states calls it before its first __syncthreads
// (block_tables_needed<Spec>).
// NOTE: only the tables the kernel's format reads; the wgrad kernels fill them while their
// first operand loads are in flight, so the fill is off the path from main loop to update.
template <unsigned kTables = kAllTables>
__device__ __forceinline__ void block_tables_init(int tid) {
  if constexpr ((kTables & kInt4Tables) != 0) {
    for (int i = tid; i < 2 * kInt4Codes; i += blockDim.x)
      int4_code_table()[i] = int4_map(static_cast<uint8_t>(i % kInt4Codes), i < kInt4Codes);
    for (int b = tid; b < kInt4Buckets; b += blockDim.x) {
      int4_bucket_table(true)[b] = int4_bucket_entry<true>(b);
      int4_bucket_table(false)[b] = int4_bucket_entry<false>(b);
    }
  }
  if constexpr ((kTables & kInt8Tables) != 0) {
    for (int i = tid; i < 16; i += blockDim.x) int8_sixteenths_table()[i] = int8_sixteenth_word(i);
    for (int i = tid; i < 512; i += blockDim.x) {
      const int code = i & 255;
      float v;
      if (i < 256) {
        const float mag = int8_level_value_direct(code & 0x7F, kInt8SignedTop);
        v = (code & 0x80) ? -mag : mag;
      } else {
        v = int8_level_value_direct(code, kInt8UnsignedTop);
      }
      int8_code_table()[i] = v;
    }
  }
}

// == int8_nearest_level_direct(a, top).
__device__ __forceinline__ int int8_nearest_level_fast(float a, int top) {
  return int8_nearest_level_sixteenths(a, top, int8_sixteenths_table());
}

// == int8_nearest_level_direct(a, top) for a <= 1 (formats.h, int8_nearest_level_unit).
__device__ __forceinline__ int int8_nearest_level_unit_fast(float a, int top) {
  return int8_nearest_level_unit(a, top, int8_sixteenths_table());
}

// The tables a kernel instantiated for Spec reads (block_tables_init's kTables; 0: none):
// int8's for int8 states, int4's for int4 states, all for a generic kernel.
template <class Spec>
constexpr unsigned block_tables_needed() {
  return Spec::kGeneric                                      ? kAllTables
         : Spec::kStateFormat == FORGE_STATE_INT8_BLOCK64 ? kInt8Tables
         : Spec::kStateFormat == FORGE_STATE_INT4_BLOCK64 ? kInt4Tables
                                                          : 0u;
}

// == formats.h int8_decode / int8_encode, bit for bit (the code table holds
// int8_level_value_direct's values, which equal int8_level_value's: test_formats.cpp).
__device__ __forceinline__ float int8_decode_fast(uint8_t code, bool is_signed) {
  return int8_code_table()[(is_signed ? 0 : 256) + code];
}

// The int8 codes of a quad (byte e: int8_encode(x[e], absmax, is_signed)) given the ratios
// a = |x| / absmax already computed (int8_quad_ratios, or int8_quad_ratios_ieee where it
// declines the block: 0 where the absmax is not positive) for an absmax >= |x|, so a <= 1:
// every element whose code a step stores. Another a (a NaN, or above 1 for an element out of
// range) gives some byte there, and may change the bytes above it, never those below.
// NOTE: the signs per quad, not per element: three byte permutes give every element's sign
// as a byte mask, and two logic operations and an add apply them to the four levels at once
// (~1.5 instructions per element against ~5 with a compare and selects per element).
__device__ __forceinline__ uint32_t int8_quad_codes(const float (&x)[kQuad],
                                                    const float (&ratio)[kQuad], bool is_signed) {
  const int top = is_signed ? kInt8SignedTop : kInt8UnsignedTop;
  uint32_t levels = 0u;  // byte e: element e's level, in [0, top]
#pragma unroll
  for (int e = 0; e < kQuad; ++e)
    levels |= static_cast<uint32_t>(int8_nearest_level_unit_fast(ratio[e], top)) << (8 * e);
  // byte e: 0xFF where x[e] is negative (or -0), else 0
  const uint32_t negative = __byte_perm(sign_bytes2(x[0], x[1]), sign_bytes2(x[2], x[3]), 0x5410u);
  if (is_signed) {
    // A nonzero level takes the sign bit (0x80 | level); level 0 stays code 0, -0 too. Bit 7
    // of a byte of levels + 0x7F7F7F7F is set exactly where that byte is nonzero (each is at
    // most 0x7F: no byte carries into the next).
    return levels | ((levels + 0x7F7F7F7Fu) & negative & 0x80808080u);
  }
  return levels & ~negative;  // x <= 0 encodes as 0 (x = +0 has level 0)
}

// One element's int8_encode in a block whose absmax is at least |x| (or not positive).
__device__ __forceinline__ uint8_t int8_encode_fast(float x, float absmax, bool is_signed) {
  const float v[kQuad] = {x, x, x, x};
  const float a = absmax > 0.0f ? fabsf(x) / absmax : 0.0f;
  const float ratio[kQuad] = {a, a, a, a};
  return static_cast<uint8_t>(int8_quad_codes(v, ratio, is_signed));
}

// ---- the ratios |x| / absmax of an int8 or int4 encode -----------------------------------------
//
// ratio[e] = |v[e]| / absmax for the 4 values of a quad in a block whose absmax (>= every
// |v[e]|) is `absmax`, branch-free, with one check per block instead of FastMath's per
// element. Both int8 store paths take it (store_state_quad, store_block_states). Returns
// false when absmax is outside [2^-62, 2^62) (zero, tiny, huge, infinite, NaN); the caller
// then divides the IEEE way instead. FastMath's division is exact for a dividend and a
// divisor in [2^-62, 2^62); here a block with absmax < 2^-22 has both scaled
// by 2^64 (exact: nothing overflows, and a subnormal scales exactly too), so the divisor b'
// lies in [2^-22, 2^62). Then, with n' = |v| · scale:
//  - where |v| / absmax >= 2^-40, n' >= 2^-40 · b' >= 2^-62: inside the domain, so the ratio
//    is the IEEE quotient;
//  - where |v| / absmax < 2^-40 (a zero, a subnormal, anything tiny), the sequence's result
//    stays below 3 · 2^-40 (q <= n'·y·(1 + 2^-22), |r| <= 2n', y·|r| < 2^-39), and so does
//    the IEEE quotient: both are under half of level 1 (2^-16.75 or 2^-32.75), so both
//    encode to level 0, code 0. The ratio may differ from IEEE's there; the code does not.
// NOTE: one check per block: per element one multiply and the division's three fmas, not
// FastMath's per-element checks and a zero test.
__device__ __forceinline__ bool int8_quad_ratios(float absmax, const float (&v)[kQuad],
                                                 float (&ratio)[kQuad]) {
  const float scale = absmax < 0x1p-22f ? 0x1p64f : 1.0f;
  const float divisor = absmax * scale;
#pragma unroll
  for (int e = 0; e < kQuad; ++e)
    ratio[e] = FastMath::div_unchecked(fabsf(v[e]) * scale, divisor);
  return fast_div_operand(absmax);
}

// The ratios where int8_quad_ratios declines the block: the IEEE quotients |v[e]| / absmax,
// and 0 where the absmax is not positive (zero or NaN; int8_encode gives such a block's
// elements code 0, and so does int8_quad_codes for a = 0).
__device__ __forceinline__ void int8_quad_ratios_ieee(float absmax, const float (&v)[kQuad],
                                                      float (&ratio)[kQuad]) {
#pragma unroll
  for (int e = 0; e < kQuad; ++e) ratio[e] = absmax > 0.0f ? fabsf(v[e]) / absmax : 0.0f;
}

// ---- fp8 block states, bit for bit --------------------------------------------------------------
//
// formats.h's fp8 encoding: element = fp8 value · (absmax / top), stored as
// fp8_nearest(x · (top / absmax)). On sm_89 and later the conversions are the hardware's:
// cvt.rn.satfinite.{e4m3x2,e5m2x2}.f32 is fp8_nearest by definition (nearest even, saturating;
// it is given |q| and the sign is put back, so -0 and negative values that round to zero give
// 0x80 as formats.h's do, and a NaN 0x7F), and cvt.rn.f16x2.{e4m3x2,e5m2x2} decodes exactly
// (every fp8 value is an f16). Other passes (sm_80) call formats.h's functions. A decoded NaN
// code, which no step stores, comes back as a NaN with another payload; an element holding
// one is skipped. test_gpu_fp8.cu checks every code and ranges of floats.

// A block's decode factor absmax / top (kDecode) or encode factor top / absmax, the IEEE
// quotient, branch-free: FastMath's division is exact for a dividend and a divisor in
// [2^-62, 2^62), and absmax is scaled there by a power of two, so the quotient is the scaled
// IEEE one, and scaling it back is exact as long as it stays normal and finite: for absmax in
// [kFp8MinAbsmax, FLT_MAX] both quotients lie in [2^-120, 2^116] (top: 448 or 57344). A
// decode also takes absmax = +0 (the sequence gives +0). `ok` is cleared for any other absmax
// (a value no step stores: below kFp8MinAbsmax, -0, infinite, NaN); the caller then divides the
// IEEE way. An encode with absmax = +0 stores zeros (fp8_quad_codes) whatever the factor.
template <bool kDecode>
__device__ __forceinline__ float fp8_block_factor(float absmax, float top, bool& ok) {
  // scale (a power of two, exact) brings absmax into [2^-62, 2^62); unscale = 1 / scale
  const bool tiny = absmax < 0x1p-22f, huge = absmax >= 0x1p62f;
  const float scale = tiny ? 0x1p64f : huge ? 0x1p-66f : 1.0f;
  const float unscale = tiny ? 0x1p-64f : huge ? 0x1p66f : 1.0f;
  const float scaled = absmax * scale;
  ok = ok & (((absmax >= kFp8MinAbsmax) & (absmax <= 0x1.fffffep127f)) |
             (__float_as_uint(absmax) == 0u));
  if constexpr (kDecode) {
    return FastMath::div_unchecked(scaled, top) * unscale;
  } else {
    return FastMath::div_unchecked(top, scaled) * scale;
  }
}

// formats.h's fp8_decode of a quad's packed codes (byte e: element e) given the block's decode
// factor absmax / top.
__device__ __forceinline__ void fp8_quad_values(uint32_t codes, bool is_signed, float factor,
                                                float (&v)[kQuad]) {
#if defined(FORGE_FP8_CVT)
  const uint32_t lo = is_signed ? cvt_f16x2_fp8x2<true>(codes) : cvt_f16x2_fp8x2<false>(codes);
  const uint32_t hi =
      is_signed ? cvt_f16x2_fp8x2<true>(codes >> 16) : cvt_f16x2_fp8x2<false>(codes >> 16);
  v[0] = cvt_f32_f16(lo & 0xFFFFu) * factor;
  v[1] = cvt_f32_f16(lo >> 16) * factor;
  v[2] = cvt_f32_f16(hi & 0xFFFFu) * factor;
  v[3] = cvt_f32_f16(hi >> 16) * factor;
#else
#pragma unroll
  for (int e = 0; e < kQuad; ++e)
    v[e] = fp8_value(static_cast<uint8_t>(codes >> (8 * e)), is_signed) * factor;
#endif
}

// formats.h's fp8_encode of a quad given its block's encode factor top / absmax, packed (byte
// e: element e); `nonzero` = absmax >= kFp8MinAbsmax (otherwise every code is 0).
// kNonNan: the caller knows no v[e] whose code it stores is NaN (a warp where no element was
// skipped), so the signed conversion alone is the code: it rounds the magnitude and keeps the
// sign, -0 and negative values that round to zero included (test_gpu_fp8.cu checks every
// non-NaN float). Otherwise the conversion is given |q| and the sign is put back, so that a NaN
// of either sign gives 0x7F as formats.h's does.
// NOTE: one conversion instruction per two elements; with NaNs possible, the four signs are
// put back with three byte permutes and two logic operations.
template <bool kNonNan = false>
__device__ __forceinline__ uint32_t fp8_quad_codes(const float (&v)[kQuad], float factor,
                                                   bool nonzero, bool is_signed) {
  float q[kQuad];
#pragma unroll
  for (int e = 0; e < kQuad; ++e) q[e] = v[e] * factor;
#if defined(FORGE_FP8_CVT)
  if constexpr (kNonNan) {
    const uint32_t lo = is_signed ? cvt_rn_satfinite_fp8x2<true>(q[1], q[0])
                                  : cvt_rn_satfinite_fp8x2<false>(q[1], q[0]);
    const uint32_t hi = is_signed ? cvt_rn_satfinite_fp8x2<true>(q[3], q[2])
                                  : cvt_rn_satfinite_fp8x2<false>(q[3], q[2]);
    return nonzero ? lo | (hi << 16) : 0u;
  }
  const uint32_t lo = is_signed ? cvt_rn_satfinite_fp8x2<true>(fabsf(q[1]), fabsf(q[0]))
                                : cvt_rn_satfinite_fp8x2<false>(fabsf(q[1]), fabsf(q[0]));
  const uint32_t hi = is_signed ? cvt_rn_satfinite_fp8x2<true>(fabsf(q[3]), fabsf(q[2]))
                                : cvt_rn_satfinite_fp8x2<false>(fabsf(q[3]), fabsf(q[2]));
  const uint32_t mags = lo | (hi << 16);
  // byte e of `signs`: the top byte of q[e]'s bits, whose bit 7 is its sign
  const uint32_t signs01 = __byte_perm(__float_as_uint(q[0]), __float_as_uint(q[1]), 0x0073u);
  const uint32_t signs23 = __byte_perm(__float_as_uint(q[2]), __float_as_uint(q[3]), 0x0073u);
  const uint32_t signs = __byte_perm(signs01, signs23, 0x5410u);
  // A NaN converts to magnitude 0x7F (the only byte above both formats' largest finite one)
  // and stays 0x7F whatever its sign, as formats.h's: bit 7 of a byte of mags + 0x01010101 is
  // set exactly there (no byte carries into the next: each is at most 0x7F).
  const uint32_t nan_bytes = (mags + 0x01010101u) & 0x80808080u;
  const uint32_t codes = mags | (signs & 0x80808080u & ~nan_bytes);
#else
  uint32_t codes = 0;
#pragma unroll
  for (int e = 0; e < kQuad; ++e)
    codes |= static_cast<uint32_t>(fp8_nearest(q[e], is_signed)) << (8 * e);
#endif
  return nonzero ? codes : 0u;
}

// ---- int4 block states, bit for bit -------------------------------------------------------------
//
// formats.h's int4 encoding: code = the nearest map value of q = x / absmax, ties up (the code
// of the largest value whose midpoint with the one below q reaches). The device takes |q| from
// int8's ratios |x| / absmax (int8_quad_ratios: the IEEE quotient wherever it is 2^-40 or more,
// and below that something under 3 · 2^-40) and q's sign from x: IEEE division is symmetric in
// the sign, and every q of magnitude below 2^-38 has code 0 in both maps (the smallest signed
// midpoints are ±0.00275, the smallest unsigned one 0.0019), so the codes are the CPU's. Codes
// pack as formats.h says: 4 bits per element, element e of a quad in bits 4e..4e+3 (the quad's
// two bytes, little end first).

// map(code) · absmax: formats.h's int4_decode (the low 4 bits of `code`).
__device__ __forceinline__ float int4_decode_fast(uint32_t code, bool is_signed, float absmax) {
  return int4_code_table()[(is_signed ? 0u : 16u) + (code & 15u)] * absmax;
}

// formats.h's int4_nearest_code(q, is_signed) for q = x / absmax, given x and ratio = |q| (or
// a NaN where q is one). kAccepted: the caller knows that every element whose code it stores has
// a finite x and a ratio in [0, 1] (a warp where no element was skipped: each is a result
// apply_rule accepted, and the block's absmax is their largest magnitude); any other element
// gets some code there and changes no nibble but its own and those above it.
// NOTE: by the bucket tables (one shared-memory read and ~10 instructions, against 15 compares
// and adds). Signed: with the 8 positive midpoints m_j, a q >= 0 takes code #{m_j <= r} (index
// 7 + that count); a q < 0 (or -0) index #{k : q >= m_k} = #{j < 15 : r <= m_j} (the negative
// midpoints are the positive ones negated, bit for bit: the map's halves mirror), so code
// (16 - min(#{m_j < r}, 7)) & 15. Both counts are the bucket's base count plus whether r's bits
// pass the midpoint inside it, reached (>=) or passed (>): the entry holds the four codes, and a
// byte permute picks one. A NaN counts as negative and passes all 8 (code 9, as the reference).
// Unsigned: code #{m_k <= q}, the bucket's base count plus whether r's bits reach the midpoint
// inside it; a negative q (or -0: its code is 0 either way) or a NaN takes code 0.
template <bool kAccepted = false>
__device__ __forceinline__ uint32_t int4_code_fast(float x, float ratio, bool is_signed) {
  const uint32_t r = __float_as_uint(ratio);
  const uint32_t sign = __float_as_uint(x) >> 31;
  // A ratio's bucket from its bits >> 19 (accepted, a ratio is at most 1: no upper clamp).
  auto bucket = [](int top_bits) {
    const int b = max(top_bits - kInt4FirstBucket, 0);
    return kAccepted ? b : min(b, kInt4Buckets - 1);
  };
  if (is_signed) {
    const uint32_t negative = kAccepted ? sign : sign | (r > 0x7F800000u ? 1u : 0u);
    const uint2 e = int4_bucket_table(true)[bucket(static_cast<int>(r >> 19))];
    const uint32_t passed = r + 1u - negative > e.y ? 2u : 0u;  // (>= where q >= 0)
    return __byte_perm(e.x, 0u, passed | negative | 0x4440u);  // (bytes 1..3: zero)
  }
  if constexpr (kAccepted) {
    // NOTE: x's sign on the ratio's bits, one LOP3 instead of a mask: a negative q (or -0) is
    // then a negative int, whose bucket is 0 (no midpoint below it or inside it): code 0.
    const uint32_t rs = r | (__float_as_uint(x) & 0x80000000u);
    const uint2 e = int4_bucket_table(false)[bucket(static_cast<int>(rs) >> 19)];
    return e.x + (rs >= e.y ? 1u : 0u);
  }
  const uint2 e = int4_bucket_table(false)[bucket(static_cast<int>(r >> 19))];
  return sign != 0u || r > 0x7F800000u ? 0u : e.x + (r >= e.y ? 1u : 0u);
}

// A quad's int4 codes (bits 4e..4e+3: element e's) given the ratios |x| / absmax
// (int8_quad_ratios, or int8_quad_ratios_ieee where it declines the block); kAccepted as
// int4_code_fast's.
template <bool kAccepted = false>
__device__ __forceinline__ uint32_t int4_quad_codes(const float (&x)[kQuad],
                                                    const float (&ratio)[kQuad], bool is_signed) {
  uint32_t codes = 0u;
#pragma unroll
  for (int e = 0; e < kQuad; ++e)
    codes |= int4_code_fast<kAccepted>(x[e], ratio[e], is_signed) << (4 * e);
  return codes;
}

}  // namespace cuda
}  // namespace forge
