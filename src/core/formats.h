// formats.h — how weights, states and GEMM inputs are stored, and the exact
// conversions between those formats and the fp32 the rules compute in.
//
// Every function here is __host__ __device__ and uses only IEEE-exact
// operations (bit manipulation, ldexpf, rintf, +, *, /, comparisons; nvcc's default
// -prec-div=true makes / the IEEE division), so the CPU and CUDA backends produce the
// same bits for the same inputs.
#pragma once

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__CUDACC__)
#define FORGE_HD __host__ __device__ __forceinline__
#else
#define FORGE_HD inline
#endif

namespace forge {

FORGE_HD uint32_t float_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t u;
  memcpy(&u, &x, 4);
  return u;
#endif
}

FORGE_HD float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float x;
  memcpy(&x, &u, 4);
  return x;
#endif
}

FORGE_HD bool is_finite(float x) { return (float_bits(x) & 0x7F800000u) != 0x7F800000u; }

// The largest finite bf16, 0x1.FEp127 (about 3.39e38).
constexpr float kBf16Max = 0x1.FEp127f;

// Whether a computed weight, master or state value may be stored: not NaN and at most the
// largest bf16 in magnitude, so it stays finite in every storage format (bf16 rounding of
// anything larger can overflow; an int8 block's absmax is one of these values).
// NOTE: one bound for every format keeps the check one comparison, free of the format.
FORGE_HD bool storable(float x) { return fabsf(x) <= kBf16Max; }

// ---- bf16 (stored as uint16_t bits) -------------------------------------------------

FORGE_HD float bf16_to_float(uint16_t h) { return bits_float(static_cast<uint32_t>(h) << 16); }

// Round to nearest, ties to even. NaN stays a (quiet) NaN.
FORGE_HD uint16_t bf16_nearest(float x) {
  uint32_t u = float_bits(x);
  if ((u & 0x7F800000u) == 0x7F800000u) {
    return static_cast<uint16_t>((u >> 16) | ((u & 0xFFFFu) ? 0x40u : 0u));
  }
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// Stochastic rounding: rounds the magnitude up with probability equal to the
// dropped fraction, so E[bf16_to_float(result)] == x for every finite x.
// `random16` supplies the 16 random bits.
FORGE_HD uint16_t bf16_stochastic(float x, uint32_t random16) {
  uint32_t u = float_bits(x);
  if ((u & 0x7F800000u) == 0x7F800000u) return bf16_nearest(x);
  u += random16 & 0xFFFFu;
  return static_cast<uint16_t>(u >> 16);
}

// ---- fp16 (input only; stored as uint16_t bits) ----------------------------------------

FORGE_HD float fp16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  const uint32_t man = h & 0x3FFu;
  if (exp == 0x1Fu) return bits_float(sign | 0x7F800000u | (man << 13));  // inf / NaN
  if (exp != 0) return bits_float(sign | ((exp + 112u) << 23) | (man << 13));
  // zero or subnormal: man * 2^-24, exact in fp32
  const float mag = ldexpf(static_cast<float>(man), -24);
  return sign ? -mag : mag;
}

// ---- int8 block-64 states: a non-linear ("dynamic") map ---------------------------------
//
// A state block of 64 consecutive elements of a row stores one fp32 absmax and
// one byte per element; value = absmax * map(code). The map is logarithmic:
// levels 2^(-d/8) for d = 0, 1, 2, ... (relative spacing 9%, so the rounding
// error is at most 4.4% of the value), plus an exact 0.
//  - signed (first moments):   code = sign << 7 | L, L in 0..127,
//                              value = L ? 2^((L - 127) / 8) : 0   (down to 1.8e-5 of absmax)
//  - unsigned (second moments): code = L in 0..255,
//                              value = L ? 2^((L - 255) / 8) : 0   (down to 2.9e-10 of absmax)
// NOTE: a linear absmax/127 map rounds second moments smaller than absmax/254 to
// zero, and m / (sqrt(0) + eps) then explodes; the log map keeps 32 octaves.

constexpr int kInt8SignedTop = 127;
constexpr int kInt8UnsignedTop = 255;

// 2^(-i/8), i = 0..7, correctly rounded to fp32.
FORGE_HD float int8_level_fraction(int i) {
  switch (i) {
    case 0: return 1.0f;
    case 1: return 0.917004049f;
    case 2: return 0.840896428f;
    case 3: return 0.771105409f;
    case 4: return 0.707106769f;
    case 5: return 0.648419797f;
    case 6: return 0.594603539f;
    default: return 0.545253873f;
  }
}

// Magnitude of level L (0..top): 0 for L == 0, else 2^((L - top) / 8).
FORGE_HD float int8_level_value(int level, int top) {
  if (level == 0) return 0.0f;
  const int d = top - level;
  return ldexpf(int8_level_fraction(d & 7), -(d >> 3));
}

// Nearest level to a in [0, 1] (ties go to the smaller level).
FORGE_HD int int8_nearest_level(float a, int top) {
  int lo = 0, hi = top;  // invariant: level_value(lo) <= a, and a < level_value(hi + 1)
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (int8_level_value(mid, top) <= a) lo = mid; else hi = mid - 1;
  }
  if (lo < top) {
    const float below = int8_level_value(lo, top), above = int8_level_value(lo + 1, top);
    if (above - a < a - below) return lo + 1;
  }
  return lo;
}

// ---- the same map, computed directly (what the CPU backend runs) -------------------------
//
// int8_level_value / int8_nearest_level above are the definition: a switch + ldexpf, and an
// 8-step binary search of ~300 dependent instructions. The two functions below return the
// same values by direct computation, branch-free but for the range checks, with IEEE-exact
// operations only (selects, exponent bits, exact comparisons, the reference's own
// subtractions). tests/cpp/test_formats.cpp compares them with the reference on every float
// in [0, 1] and every level. The CUDA backend runs a table-driven form of the same
// computation (int8_nearest_level_sixteenths below, src/cuda/update.cuh), which
// tests/cpp/gpu/test_gpu_int8_map.cu compares with the reference on the device.

// == int8_level_value(level, top) for 0 <= level <= top <= 255.
FORGE_HD float int8_level_value_direct(int level, int top) {
  const int d = top - level;
  const int i = d & 7;
  // NOTE: selects, not a switch: on the GPU a switch on a per-lane value diverges.
  const float f01 = (i & 1) ? int8_level_fraction(1) : int8_level_fraction(0);
  const float f23 = (i & 1) ? int8_level_fraction(3) : int8_level_fraction(2);
  const float f45 = (i & 1) ? int8_level_fraction(5) : int8_level_fraction(4);
  const float f67 = (i & 1) ? int8_level_fraction(7) : int8_level_fraction(6);
  const float f = (i & 4) ? ((i & 2) ? f67 : f45) : ((i & 2) ? f23 : f01);
  // 2^-(d >> 3) from its exponent bits (d >> 3 <= 31: a normal float), so f * scale is exact
  // and equals ldexpf(f, -(d >> 3)).
  const float scale = bits_float(static_cast<uint32_t>(127 - (d >> 3)) << 23);
  return level == 0 ? 0.0f : f * scale;
}

// == int8_nearest_level(a, top). For a in [2^E, 2^(E+1)) (E <= -1) the levels in that
// octave are 2^E (d = -8E) and f_i · 2^(E+1) for i = 7..1 (d = -8E - (8 - i)); with the
// mantissa m = a · 2^-E in [1, 2), a >= f_i · 2^(E+1) exactly when m >= 2 f_i (both sides
// scaled by the same power of two), so the largest level <= a has d = -8E - j, where j counts
// the thresholds 2 f_7 < ... < 2 f_1 that m reaches. Then the reference's tie rule, with the
// reference's own float operations.
FORGE_HD int int8_nearest_level_direct(float a, int top) {
  if (!(a > 0.0f)) return 0;      // 0, negatives (never), NaN: the binary search ends at 0
  if (a >= 1.0f) return top;      // level_value(top) == 1 <= a
  const uint32_t u = float_bits(a);
  const int e = static_cast<int>(u >> 23) - 127;  // subnormals: -127, far below any level
  const float m = bits_float((u & 0x7FFFFFu) | 0x3F800000u);
  int j = 0;
  for (int i = 1; i < 8; ++i) j += m >= 2.0f * int8_level_fraction(i) ? 1 : 0;
  const int d = -8 * e - j;
  int lo = top - d;
  if (lo < 0) lo = 0;             // below level 1: only level 0 (value 0) is <= a
  if (lo < top) {
    const float below = int8_level_value_direct(lo, top);
    const float above = int8_level_value_direct(lo + 1, top);
    if (above - a < a - below) return lo + 1;
  }
  return lo;
}

// ---- the nearest level from a 16-word table (what the CUDA backend runs) -----------------
//
// For a in [level_value(1), 1), a = m · 2^E with m in [1, 2), the reference's level is
// top + 8E + j + up: j counts the octave fractions kOct[1..7] (kOct[k] = 2 f_(8-k),
// kOct[0] = 1, kOct[8] = 2) that m reaches, and up is its tie rule, above - a < a - below.
// Both differences are exact there (Sterbenz: a and either level lie within a factor 2^(1/8)),
// so up holds exactly when 2a > above + below, i.e. when m's 23 fraction bits exceed the
// midpoint of kOct[j] and kOct[j + 1] in fraction units: frac >= t_j = ((f_j + f_(j+1)) >> 1)
// + 1 (f_k: kOct[k]'s fraction bits, f_8 = 2^23). So j + up is the number of thresholds t_0
// < ... < t_7 that frac reaches. Each sixteenth of [1, 2) (frac >> 19) holds at most one of
// them (1.045, 1.140, 1.243, 1.356, 1.478, 1.612, 1.758, 1.917), so the count is the number
// below the sixteenth plus one comparison: one table read instead of a search.
// Word s of the table: bits 0-23 the threshold inside sixteenth s (0x800000, above every
// fraction, when there is none), bits 24-31 minus the offset c_s = (the count below it) -
// (s >> 1), mod 256. Then frac - word, as a signed word, is frac - inside + 2^24 c_s
// (|c_s| <= 8), whose top byte (>> 24, arithmetic) is c_s - 1 where frac is below the
// threshold and c_s where it reaches it: the count plus the comparison in one subtraction.
// With (bits(a) >> 20) = 8 (E + 127) + (s >> 1), the count is (bits(a) >> 20) - 8 (E + 127)
// + c_s + up. Below level 1 the reference's level is 0 or 1 (its tie rule against level 0 =
// 0: 1 exactly when a > level_value(1) / 2), at or above 1 it is top.

// Fraction bits of kOct[k], k = 0..8, in units of 2^-23 of [1, 2) (kOct[8] = 2: 2^23).
FORGE_HD uint32_t int8_octave_fraction_bits(int k) {
  if (k <= 0) return 0u;
  if (k >= 8) return 1u << 23;
  return float_bits(2.0f * int8_level_fraction(8 - k)) & 0x7FFFFFu;
}

// Word s (0..15) of the sixteenths table. The host builds it; so does every CTA that reads
// it (update.cuh, block_tables_init).
FORGE_HD uint32_t int8_sixteenth_word(int s) {
  const uint32_t start = static_cast<uint32_t>(s) << 19, end = start + (1u << 19);
  int below = 0;
  uint32_t inside = 0x800000u;
  for (int j = 0; j < 8; ++j) {
    const uint32_t t =
        ((int8_octave_fraction_bits(j) + int8_octave_fraction_bits(j + 1)) >> 1) + 1u;
    if (t <= start) ++below;
    else if (t < end) inside = t;  // at most one per sixteenth (test_formats.cpp checks)
  }
  const int offset = below - (s >> 1);
  return inside | (static_cast<uint32_t>(-offset) << 24);
}

// The table's level for a's bits: the reference's level for a in [level_value(1), 1], and
// below level 1 the nearest of the levels continued downwards (<= 1 there: the count only
// grows with a, and is 1 at level_value(1)). The bits shift as a signed word, so a negative
// a (-0 included) gives a negative level; a NaN or a > 1 gives some value.
FORGE_HD int int8_sixteenths_level(float a, int top, const uint32_t* table) {
  const uint32_t u = float_bits(a);
  const uint32_t frac = u & 0x7FFFFFu;
  const int32_t count = static_cast<int32_t>(frac - table[frac >> 19]) >> 24;  // c_s - 1 + up
  return (static_cast<int32_t>(u) >> 20) + count + (top - 8 * 127 + 1);
}

// == int8_nearest_level_direct(a, top); `table` holds int8_sixteenth_word(0..15).
// NOTE: branch-free (selects); the level is computed from a's bits for every a and kept only
// where a lies in [level_value(1), 1), so a NaN or an out-of-range a only reads some word of
// the table.
FORGE_HD int int8_nearest_level_sixteenths(float a, int top, const uint32_t* table) {
  const int level = int8_sixteenths_level(a, top, table);
  const float level1 = int8_level_value_direct(1, top);
  const int low = a > 0.5f * level1 ? 1 : 0;  // 0.5 · level1 is exact: a normal power-of-2 scale
  return a >= 1.0f ? top : (a >= level1 ? level : low);
}

// == int8_nearest_level_direct(a, top) for a <= 1 (a block's ratio |x| / absmax, the absmax
// at least |x|; negative values and -0 included), in fewer operations: at a = 1 the table's
// level is top (frac = 0 is below the first sixteenth's threshold, and no word counts one
// below it), and under level 1 it is at most 1 and at most 0 below the tie with level 1, so
// the reference's bottom (1 exactly when a > level_value(1) / 2, else 0) is the larger of the
// two. A NaN or a > 1 gives some value: callers store no code of one.
FORGE_HD int int8_nearest_level_unit(float a, int top, const uint32_t* table) {
  const int level = int8_sixteenths_level(a, top, table);
  const int low = a > 0.5f * int8_level_value_direct(1, top) ? 1 : 0;
  return level > low ? level : low;
}

FORGE_HD float int8_decode(uint8_t code, bool is_signed) {
  if (is_signed) {
    const float mag = int8_level_value(code & 0x7F, kInt8SignedTop);
    return (code & 0x80) ? -mag : mag;
  }
  return int8_level_value(code, kInt8UnsignedTop);
}

// x is the value, absmax the block's absmax (>= |x|). Unsigned states are never
// negative; a negative input there (impossible for a second moment) encodes as 0.
FORGE_HD uint8_t int8_encode(float x, float absmax, bool is_signed) {
  if (!(absmax > 0.0f)) return 0;
  const float a = fabsf(x) / absmax;
  if (is_signed) {
    const int level = int8_nearest_level(a, kInt8SignedTop);
    return static_cast<uint8_t>(level == 0 ? 0 : ((x < 0.0f ? 0x80 : 0) | level));
  }
  if (x <= 0.0f) return 0;
  return static_cast<uint8_t>(int8_nearest_level(a, kInt8UnsignedTop));
}

// ---- fp8 block-64 states: e4m3 (signed states) and e5m2 (unsigned) -----------------------
//
// A block of 64 consecutive elements of a row stores one fp32 absmax (its largest magnitude,
// as int8 blocks do) and one fp8 byte per element; element = fp8 value · (absmax / top), top
// the format's largest finite value, so the absmax itself is stored as top and the block's
// values follow its absmax as it grows or decays (a moment whose block moves together keeps
// its codes, as int8's).
//  - signed states (first moments): e4m3 (1-4-3, bias 7, no infinities, 0x7F NaN), top 448:
//    relative error ≤ 2^-4, values down to 2^-9 / 448 of the absmax (about 2^-17.8);
//  - unsigned states (second moments): e5m2 (1-5-2, bias 15), top 57344: relative error
//    ≤ 2^-3, values down to 2^-16 / 57344 (about 2^-31.8) of the absmax.
// Encoding is x · (top / absmax) (fp32), rounded to nearest, ties to even, saturating at top:
// what sm_89+'s cvt.rn.satfinite.{e4m3x2,e5m2x2}.f32 computes. The two block factors are one
// IEEE division each, so the CPU and CUDA backends store the same bits.
// A block whose largest magnitude is below kFp8MinAbsmax (7.9e-31) stores zeros (absmax 0), so
// top / absmax stays finite: flushed as values below a block's smallest step are (AdamW's √v
// is then below 1e-15, against eps).

constexpr float kFp8MinAbsmax = 0x1p-100f;

struct Fp8Format {
  int man;            // mantissa bits
  int bias;           // exponent bias
  uint32_t max_code;  // magnitude bits of the largest finite value
  float top;          // the largest finite value
};

// e4m3 for signed states, e5m2 for unsigned (built here, not read from a host constant, so
// device code can call it).
FORGE_HD Fp8Format fp8_format(bool is_signed) {
  return is_signed ? Fp8Format{3, 7, 0x7Eu, 448.0f} : Fp8Format{2, 15, 0x7Bu, 57344.0f};
}

// q to fp8 bits: round to nearest, ties to even, saturating at the largest finite value
// (infinities too); the sign is kept (-0 and negative values that round to zero give 0x80).
// A NaN gives 0x7F (a NaN in both formats, whatever q's sign and payload): no step stores one,
// but a skipped element decoded from a NaN code is re-encoded when its block's absmax grows
// (store_state), and the CUDA backend's conversion of a NaN it computed gives this byte too.
FORGE_HD uint8_t fp8_nearest(float q, bool is_signed) {
  const Fp8Format f = fp8_format(is_signed);
  const uint32_t sign = (float_bits(q) >> 24) & 0x80u;
  const float a = fabsf(q);
  if (!(a <= 0x1.fffffep127f)) return static_cast<uint8_t>(a == INFINITY ? sign | f.max_code : 0x7Fu);
  const int emin = 1 - f.bias;  // the smallest normal exponent; below it the grid is uniform
  int e = static_cast<int>((float_bits(a) >> 23) & 0xFFu) - 127;  // (fp32 subnormals: -127)
  if (e < emin) e = emin;
  // The grid's step in a's binade is 2^(e - man): a scaled by a power of two (exact), then
  // rounded to an integer number of steps, ties to even.
  const float steps = rintf(ldexpf(a, f.man - e));  // in [0, 2^(man + 1)]
  // (2^(man + 1) steps is the next binade's first value: the sum carries into the exponent
  // field; in the subnormal binade the exponent field is 0 and the steps are the mantissa)
  const int64_t code = (static_cast<int64_t>(e + f.bias) << f.man) +
                       static_cast<int64_t>(steps) - (int64_t(1) << f.man);
  const uint32_t mag = code > static_cast<int64_t>(f.max_code) ? f.max_code
                                                               : static_cast<uint32_t>(code);
  return static_cast<uint8_t>(sign | mag);
}

// The value of fp8 bits, unscaled (NaN / infinity for those codes, which no step stores).
FORGE_HD float fp8_value(uint8_t code, bool is_signed) {
  const Fp8Format f = fp8_format(is_signed);
  const uint32_t mag = code & 0x7Fu;
  const uint32_t field = mag >> f.man, mant = mag & ((1u << f.man) - 1u);
  float v;
  if (is_signed && mag == 0x7Fu) {
    v = bits_float(0x7FC00000u);
  } else if (!is_signed && field == 31u) {
    v = mant ? bits_float(0x7FC00000u) : bits_float(0x7F800000u);
  } else if (field == 0) {
    v = ldexpf(static_cast<float>(mant), 1 - f.bias - f.man);
  } else {
    v = ldexpf(static_cast<float>((1u << f.man) + mant), static_cast<int>(field) - f.bias - f.man);
  }
  return (code & 0x80u) ? -v : v;
}

// The absmax a block stores for its largest magnitude (0 below kFp8MinAbsmax).
FORGE_HD float fp8_block_absmax(float largest) { return largest >= kFp8MinAbsmax ? largest : 0.0f; }

// x (|x| <= absmax, absmax as fp8_block_absmax gives it) as the fp8 bits of its block.
FORGE_HD uint8_t fp8_encode(float x, float absmax, bool is_signed) {
  if (!(absmax >= kFp8MinAbsmax)) return 0;
  return fp8_nearest(x * (fp8_format(is_signed).top / absmax), is_signed);
}

FORGE_HD float fp8_decode(uint8_t code, float absmax, bool is_signed) {
  return fp8_value(code, is_signed) * (absmax / fp8_format(is_signed).top);
}

// ---- int4 block-64 states: two 16-value maps, two codes per byte ------------------------
//
// A block of 64 consecutive elements of a row shares one fp32 absmax, as int8 and fp8 blocks
// do (the largest magnitude of its values); each element keeps a 4-bit code, two to a byte:
// a row of `cols` elements is ceil(cols / 2) bytes, column 2j in byte j's low 4 bits and
// 2j + 1 in its high 4 bits (a block starts at an even column, so it owns its 32 bytes; a row
// of odd length ends in a padding nibble, stored 0: int4_store_code).
// value = map(code) · absmax: one fp32 product, as int8's decode.
//  - signed states (first moments): the 4-bit dynamic-exponent map (Dettmers' dynamic tree
//    quantization at 4 bits; the first-moment map of Li et al., "Memory Efficient Optimizers
//    with 4-bit States", 2023): a sign, a decade 10^-2, 10^-1 or 1 holding 1, 2 or 4 values at
//    the midpoints of equal bins of [0.1, 1], plus 0 and +1. Magnitudes 0.0055; 0.0325, 0.0775;
//    0.2125, 0.4375, 0.6625, 0.8875; the largest negative value is -0.8875.
//    Codes: 0 is 0 (so zeroed bytes are zero states), 1..8 the positive values ascending up to
//    1, 9..15 the negative ones ascending from -0.8875 to -0.0055.
//  - unsigned states (second moments): the 4-bit unsigned dynamic-exponent map without zero
//    (the same paper's "DE-0", the dynamic-exponent map with its zero point excluded): decades
//    10^-2, 10^-1 and 1 holding 2, 4 and 8 values at the midpoints of equal bins of [0.1, 1],
//    plus 1, and in place of a zero the decade 10^-3's one value: 0.00055; 0.00325, 0.00775;
//    0.02125 .. 0.08875; 0.15625 .. 0.94375; 1. Code c is the c-th value ascending. A map with
//    a zero sends a block's small second moments to 0, whose 1 / (√v + eps) then blows their
//    updates up. Why not linear, (c + 1) / 16, the paper's map for its rank-1 normalization:
//    within a block of 64 a second moment spans a decade or more (the within-block standard
//    deviation of log10 v is ~0.5 on the ~100M model, bench/state_maps.py), and a linear map
//    reads every one below 1/32 of the absmax as 1/16, shrinking those updates (by 18 % summed
//    over a weight there; this map: 3 % larger, docs/design.md §2).
// Encoding: q = x / absmax (one IEEE division), then the nearest map value, ties up: the code of
// the largest value whose midpoint with the one below it q reaches (q >= midpoint). The
// midpoints are the fp32 half-sums of the fp32 map values, so both backends store the same
// codes. A block whose absmax is 0 decodes to zeros whatever its codes.
// NOTE: 64-element blocks (the paper uses 128): a block is int8's and fp8's, so shards, tiles
// and the absmax layout are theirs; 4 B of absmax per 64 elements is 0.5625 B per element.

constexpr int kInt4Codes = 16;

// The signed map's 16 values in ascending order (index 0: -0.8875 .. 7: 0 .. 15: 1).
FORGE_HD float int4_signed_ascending(int index) {
  switch (index) {
    case 0: return -0.8875f;
    case 1: return -0.6625f;
    case 2: return -0.4375f;
    case 3: return -0.2125f;
    case 4: return -0.0775f;
    case 5: return -0.0325f;
    case 6: return -0.0055f;
    case 7: return 0.0f;
    case 8: return 0.0055f;
    case 9: return 0.0325f;
    case 10: return 0.0775f;
    case 11: return 0.2125f;
    case 12: return 0.4375f;
    case 13: return 0.6625f;
    case 14: return 0.8875f;
    default: return 1.0f;
  }
}

// The unsigned map's 16 values in ascending order, which is code order.
FORGE_HD float int4_unsigned_ascending(int index) {
  switch (index) {
    case 0: return 0.00055f;
    case 1: return 0.00325f;
    case 2: return 0.00775f;
    case 3: return 0.02125f;
    case 4: return 0.04375f;
    case 5: return 0.06625f;
    case 6: return 0.08875f;
    case 7: return 0.15625f;
    case 8: return 0.26875f;
    case 9: return 0.38125f;
    case 10: return 0.49375f;
    case 11: return 0.60625f;
    case 12: return 0.71875f;
    case 13: return 0.83125f;
    case 14: return 0.94375f;
    default: return 1.0f;
  }
}

// A signed code's position in the ascending order, and back (code 0 is the value 0).
FORGE_HD int int4_signed_index(uint8_t code) { return (code + 7) & 15; }
FORGE_HD uint8_t int4_signed_code(int index) { return static_cast<uint8_t>((index + 9) & 15); }

// map(code): the value a code stands for, before the absmax.
FORGE_HD float int4_map(uint8_t code, bool is_signed) {
  return is_signed ? int4_signed_ascending(int4_signed_index(code & 15))
                   : int4_unsigned_ascending(code & 15);
}

// The midpoint of a map's ascending values k - 1 and k (k in [1, 16)), in fp32: the
// thresholds of the encoding, the same bits on every backend.
FORGE_HD float int4_signed_midpoint(int k) {
  return 0.5f * (int4_signed_ascending(k - 1) + int4_signed_ascending(k));
}
FORGE_HD float int4_unsigned_midpoint(int k) {
  return 0.5f * (int4_unsigned_ascending(k - 1) + int4_unsigned_ascending(k));
}

// The code of q = x / absmax (q in [-1, 1] signed, [0, 1] unsigned): nearest, ties up. A q below
// the map (a negative unsigned value, impossible for a second moment) takes the lowest code; a
// NaN q counts no threshold (signed: code 9, -0.8875; unsigned: code 0).
FORGE_HD uint8_t int4_nearest_code(float q, bool is_signed) {
  int index = 0;
  if (is_signed) {
    for (int k = 1; k < kInt4Codes; ++k) index += q >= int4_signed_midpoint(k) ? 1 : 0;
    return int4_signed_code(index);
  }
  for (int k = 1; k < kInt4Codes; ++k) index += q >= int4_unsigned_midpoint(k) ? 1 : 0;
  return static_cast<uint8_t>(index);
}

FORGE_HD float int4_decode(uint8_t code, float absmax, bool is_signed) {
  return int4_map(code, is_signed) * absmax;
}

// x (|x| <= absmax, the block's absmax) as its 4-bit code; an absmax of 0 gives code 0.
FORGE_HD uint8_t int4_encode(float x, float absmax, bool is_signed) {
  if (!(absmax > 0.0f)) return 0;
  return int4_nearest_code(x / absmax, is_signed);
}

// Element `col`'s code in a row of packed codes, and the byte with it replaced.
FORGE_HD uint8_t int4_code_at(const uint8_t* row, int64_t col) {
  return static_cast<uint8_t>((row[col >> 1] >> (4 * (col & 1))) & 15);
}
FORGE_HD uint8_t int4_with_code(uint8_t byte, int64_t col, uint8_t code) {
  const int shift = 4 * static_cast<int>(col & 1);
  return static_cast<uint8_t>((byte & ~(15 << shift)) | ((code & 15) << shift));
}

// What a store writes to the byte holding element `col` of a row of `cols` codes: `byte` with
// that code replaced. A row of odd length ends in a padding nibble, which a store of the last
// element writes 0, so a state's bytes are a function of its values whatever its buffer held
// (a fresh allocation's garbage included).
FORGE_HD uint8_t int4_store_code(uint8_t byte, int64_t col, int64_t cols, uint8_t code) {
  return col + 1 == cols && (col & 1) == 0 ? static_cast<uint8_t>(code & 15)
                                            : int4_with_code(byte, col, code);
}

// Bytes of a row of `cols` int4 codes.
FORGE_HD int64_t int4_row_bytes(int64_t cols) { return (cols + 1) / 2; }

// ---- a block holding a skipped element (int8, fp8 and int4) -------------------------------
//
// The absmax of an int8, fp8 or int4 block some of whose elements a step skipped (forge.h,
// "Skipped elements"): `old_absmax` is the block's absmax before the step, `updated_max` the
// largest magnitude of its updated elements' new values (0 or -inf when none was updated). While
// updated_max fits (a NaN old absmax included), the absmax stays, and the skipped elements keep
// their code bytes. Otherwise it grows by a power of two, to old_absmax · 2^k with the
// smallest k >= 1 that reaches updated_max (at most the largest bf16, the bound of every
// stored value), and each skipped element is re-encoded from its decoded value against it:
// int8 levels are 2^(1/8) apart, so a value decoded against the old absmax is a level of the
// new one, 8k levels down (the decode's one fp32 rounding is far from a tie); an fp8 value
// scaled by 2^-k is a value of the format while it stays normal. Either way the skipped value
// comes back bit for bit (the new decode is the same product, its factor scaled by 2^k), while
// it stays at or above the block's smallest level (int8: 2^-15.75 of the absmax when signed,
// 2^-31.75 unsigned) or smallest normal (fp8: 2^-6 / 448, 2^-14 / 57344 of it); below that, it
// is within one step of the block's smallest grid. Growing to updated_max itself instead, the
// skipped element's code came back the same at every small growth, and its value grew as much
// as the absmax did. An old absmax of 0 (an all-zero block, whose
// elements decode to 0 whatever their codes) takes updated_max; fp8 then flushes the result
// as fp8_block_absmax does. int4's maps are no power-of-two scalings of themselves: there a
// re-encoded skipped element takes the nearest code of the grown block. Exact operations only
// (frexpf, ldexpf, comparisons), so the CPU and the CUDA epilogue compute the same bits.
FORGE_HD float block_absmax_with_skipped(float old_absmax, float updated_max, bool fp8) {
  if (!(old_absmax < updated_max)) return old_absmax;  // it fits (or a NaN absmax): kept
  float absmax = updated_max;
  if (old_absmax > 0.0f) {
    int e_old, e_new;
    frexpf(old_absmax, &e_old);
    frexpf(updated_max, &e_new);
    absmax = ldexpf(old_absmax, e_new - e_old);  // old's mantissa at updated_max's binade
    if (absmax < updated_max) absmax = absmax * 2.0f;
    if (!(absmax <= kBf16Max)) absmax = kBf16Max;  // (an infinity included)
  }
  return fp8 ? fp8_block_absmax(absmax) : absmax;
}

}  // namespace forge
