// test_formats.cpp — storage formats: bf16 nearest and stochastic rounding, fp16
// input decoding, the int8 dynamic map, the fp8 encodings (e4m3, e5m2) and the int4 maps against
// a brute-force nearest value, the int8, fp8 and int4 block-64 round trips (int4's packed rows),
// AdamW runs with int8, fp8 and int4 states that track the fp32-state run on least squares, how
// a block holding a skipped element keeps its absmax and codes, and what forge_state_from_fp32
// refuses.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "core/formats.h"
#include "core/rng.h"
#include "test_util.h"
#include "tolerances.h"

namespace forge_test {
namespace {

using namespace forge;

TEST(Bf16, NearestEvenAndSpecials) {
  EXPECT_EQ(bf16_nearest(1.0f), 0x3F80);
  EXPECT_EQ(bf16_nearest(bits_float(0x3F808000u)), 0x3F80);  // tie → even (down)
  EXPECT_EQ(bf16_nearest(bits_float(0x3F818000u)), 0x3F82);  // tie → even (up)
  EXPECT_EQ(bf16_nearest(bits_float(0x3F808001u)), 0x3F81);  // above the tie → up
  EXPECT_EQ(bf16_nearest(-2.0f), 0xC000);
  EXPECT_EQ(bf16_nearest(INFINITY), 0x7F80);
  EXPECT_TRUE(std::isnan(bf16_to_float(bf16_nearest(NAN))));
  EXPECT_TRUE(std::isnan(bf16_to_float(bf16_nearest(bits_float(0x7F800001u)))));  // NaN with low payload only
}

TEST(Fp16, EveryBitPatternDecodesExactly) {
  for (uint32_t b = 0; b < 65536; ++b) {
    _Float16 h;
    const uint16_t bits = static_cast<uint16_t>(b);
    std::memcpy(&h, &bits, 2);
    const float expected = static_cast<float>(h), got = fp16_to_float(bits);
    if (std::isnan(expected)) {
      EXPECT_TRUE(std::isnan(got)) << b;
    } else {
      EXPECT_EQ(float_bits(got), float_bits(expected)) << b;
    }
  }
}

TEST(StochasticRounding, UnbiasedMeanWithinBoundOnEveryStream) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("FORGE_TEST_SEED=" + std::to_string(seed));
  Rng rng(seed);
  const int kDraws = 200000;
  for (int trial = 0; trial < 8; ++trial) {
    const float x = rng.normal(3.0f);
    const float lo = bf16_to_float(static_cast<uint16_t>(float_bits(x) >> 16));
    const float hi = bf16_to_float(static_cast<uint16_t>((float_bits(x) >> 16) + 1));
    const double ulp = std::fabs(double(hi) - double(lo));
    const uint64_t key = rng_key(rng.gen(), 1 + trial);
    for (int stream = 0; stream < kRngStreams; ++stream) {
      double sum = 0;
      for (int i = 0; i < kDraws; ++i) {
        const uint32_t bits = rng_stream_bits(rng_draw(key, i), stream);
        const float r = bf16_to_float(bf16_stochastic(x, bits));
        ASSERT_TRUE(r == lo || r == hi) << "x=" << x << " r=" << r;
        sum += r;
      }
      const double mean = sum / kDraws;
      EXPECT_NEAR(mean, x, kSrMeanSigmas * ulp / (2.0 * std::sqrt(double(kDraws))))
          << "x=" << x << " stream " << stream;
    }
  }
}

// The streams of one draw round the weight and the states of the same element: their bits
// must be uncorrelated with each other (and with the next element's).
TEST(StochasticRounding, StreamsOfOneDrawAreUncorrelated) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("FORGE_TEST_SEED=" + std::to_string(seed));
  Rng rng(seed);
  const int kDraws = 200000;
  const uint64_t key = rng_key(rng.gen(), 7);
  auto unit = [](uint32_t bits) { return (bits + 0.5) / 65536.0 - 0.5; };  // uniform, mean 0
  for (int a = 0; a < kRngStreams; ++a)
    for (int b = 0; b < kRngStreams; ++b) {
      double sum_ab = 0, sum_aa = 0, sum_bb = 0;
      for (int i = 0; i < kDraws; ++i) {
        const double x = unit(rng_stream_bits(rng_draw(key, i), a));
        // stream b of the same element, or (a == b) stream a of the next element
        const double y = unit(rng_stream_bits(rng_draw(key, i + (a == b ? 1 : 0)), b));
        sum_ab += x * y;
        sum_aa += x * x;
        sum_bb += y * y;
      }
      const double r = sum_ab / std::sqrt(sum_aa * sum_bb);
      // |r| of independent uniforms has standard deviation 1 / sqrt(N); kSrMeanSigmas of them.
      EXPECT_LT(std::fabs(r), kSrMeanSigmas / std::sqrt(double(kDraws)))
          << "streams " << a << ", " << b;
    }
}

TEST(StochasticRounding, ExactValuesStayExact) {
  for (float x : {1.0f, -0.5f, 0.0f, 3.140625f})
    for (uint32_t r : {0u, 1u, 0x7FFFu, 0xFFFFu}) EXPECT_EQ(bf16_to_float(bf16_stochastic(x, r)), x);
}

TEST(Int8Map, LevelsAreMonotonicAndSelfConsistent) {
  for (bool is_signed : {true, false}) {
    const int top = is_signed ? kInt8SignedTop : kInt8UnsignedTop;
    for (int level = 1; level <= top; ++level) {
      EXPECT_LT(int8_level_value(level - 1, top), int8_level_value(level, top));
      EXPECT_EQ(int8_nearest_level(int8_level_value(level, top), top), level);
    }
    EXPECT_EQ(int8_level_value(top, top), 1.0f);
  }
  EXPECT_EQ(int8_decode(int8_encode(-1.0f, 1.0f, true), true), -1.0f);
  EXPECT_EQ(int8_encode(0.0f, 1.0f, true), 0);
  EXPECT_EQ(int8_encode(5.0f, 0.0f, false), 0);  // all-zero block
}

// The direct forms the backends run (formats.h: int8_level_value_direct,
// int8_nearest_level_direct, and the CUDA backend's int8_nearest_level_sixteenths and, for
// a <= 1, int8_nearest_level_unit) against
// the definition. Every level value; every float of the
// octaves where the maps have their top, their bottom, and one in between (each octave holds
// the same 8 fractions scaled by a power of two, and the bottom is where the clamp to level 0
// and the level-0 tie happen); ±256 floats around every level value and every midpoint of two
// levels (where the results change); fresh random floats over [0, 2]; and special values.
// The GPU suite (test_gpu_int8_map.cu) covers every float in [0, 2] on the device.
TEST(Int8Map, DirectFormsEqualTheDefinition) {
  const int tops[2] = {kInt8SignedTop, kInt8UnsignedTop};
  uint32_t sixteenths[16];
  for (int s = 0; s < 16; ++s) sixteenths[s] = int8_sixteenth_word(s);
  int64_t checked = 0;
  auto expect_same = [&](float a, int top) {
    ++checked;
    const int want = int8_nearest_level(a, top), got = int8_nearest_level_direct(a, top);
    const int got16 = int8_nearest_level_sixteenths(a, top, sixteenths);
    // the unit form's domain is a <= 1: elsewhere it stands in for the definition
    const bool unit_domain = a <= 1.0f;
    const int got_unit = unit_domain ? int8_nearest_level_unit(a, top, sixteenths) : want;
    if (want != got || want != got16 || want != got_unit) {
      ADD_FAILURE() << "a = " << a << " (bits 0x" << std::hex << float_bits(a) << std::dec
                    << "), top " << top << ": definition " << want << ", direct " << got
                    << ", sixteenths " << got16 << ", unit " << got_unit;
      return false;
    }
    return true;
  };
  for (int top : tops)
    for (int level = 0; level <= top; ++level)
      ASSERT_EQ(float_bits(int8_level_value(level, top)),
                float_bits(int8_level_value_direct(level, top)))
          << "level " << level << ", top " << top;
  // whole octaves [2^e, 2^(e+1)): top of both maps, bottom of the signed map (2^-15.75), of
  // the unsigned map (2^-31.75), one in between
  for (int e : {-1, -16, -17, -32, -33, -9}) {
    const uint32_t first = static_cast<uint32_t>(127 + e) << 23;
    for (uint32_t u = first; u < first + (1u << 23); ++u)
      for (int top : tops)
        if (!expect_same(bits_float(u), top)) return;
  }
  for (int top : tops)
    for (int level = 0; level <= top; ++level) {
      const float v = int8_level_value(level, top);
      const float mid = level < top ? 0.5f * (v + int8_level_value(level + 1, top)) : v;
      for (float center : {v, mid})
        for (int k = -256; k <= 256; ++k) {
          const int64_t u = static_cast<int64_t>(float_bits(center)) + k;
          if (u >= 0 && !expect_same(bits_float(static_cast<uint32_t>(u)), top)) return;
        }
    }
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("FORGE_TEST_SEED=" + std::to_string(seed));
  Rng rng(seed);
  for (int i = 0; i < 2000000; ++i) {
    const float a = bits_float(static_cast<uint32_t>(rng.gen() % 0x40000001u));  // [0, 2]
    if (!expect_same(a, tops[i & 1])) return;
  }
  for (float a : {0.0f, -0.0f, -1.0f, 1.0f, 2.0f, 1e-45f, 1e-38f, 3.4e38f, INFINITY, -INFINITY,
                  NAN})
    for (int top : tops)
      if (!expect_same(a, top)) return;
  EXPECT_GT(checked, int64_t(6) * 2 * (1 << 23));
}

// int8_sixteenth_word keeps one threshold per sixteenth of [1, 2): the table form is only
// right if no sixteenth holds two (DirectFormsEqualTheDefinition would then fail too, in
// the octaves it walks).
TEST(Int8Map, EachSixteenthHoldsAtMostOneThreshold) {
  int per_sixteenth[16] = {};
  for (int j = 0; j < 8; ++j) {
    const uint32_t t =
        ((int8_octave_fraction_bits(j) + int8_octave_fraction_bits(j + 1)) >> 1) + 1u;
    ASSERT_LT(t, 1u << 23) << "threshold " << j;
    if (t & ((1u << 19) - 1u)) ++per_sixteenth[t >> 19];  // one on a boundary is counted below
  }
  for (int s = 0; s < 16; ++s) EXPECT_LE(per_sixteenth[s], 1) << "sixteenth " << s;
}

// ---- fp8 ----------------------------------------------------------------------------------

// The OCP 8-bit floating-point values (what sm_89+'s cvt instructions produce): e4m3 (bias 7,
// no infinities, S.1111.111 NaN) for signed states, e5m2 (bias 15, IEEE-like) for unsigned.
TEST(Fp8Format, StandardValues) {
  struct Known { bool is_signed; uint8_t code; float value; };
  for (const Known& k : {Known{true, 0x00, 0.0f}, Known{true, 0x01, 0x1p-9f}, Known{true, 0x07, 7 * 0x1p-9f},
                         Known{true, 0x08, 0x1p-6f}, Known{true, 0x38, 1.0f}, Known{true, 0x39, 1.125f},
                         Known{true, 0x7E, 448.0f}, Known{true, 0xB8, -1.0f}, Known{true, 0xFE, -448.0f},
                         Known{false, 0x00, 0.0f}, Known{false, 0x01, 0x1p-16f}, Known{false, 0x04, 0x1p-14f},
                         Known{false, 0x3C, 1.0f}, Known{false, 0x3D, 1.25f}, Known{false, 0x7B, 57344.0f}}) {
    SCOPED_TRACE(::testing::Message() << (k.is_signed ? "e4m3 " : "e5m2 ") << int(k.code));
    EXPECT_EQ(float_bits(fp8_value(k.code, k.is_signed)), float_bits(k.value));
  }
  EXPECT_TRUE(std::isnan(fp8_value(0x7F, true)));
  EXPECT_TRUE(std::isnan(fp8_value(0xFF, true)));
  EXPECT_EQ(fp8_value(0x7C, false), INFINITY);
  EXPECT_TRUE(std::isnan(fp8_value(0x7D, false)));
  EXPECT_EQ(float_bits(fp8_value(0x80, true)), float_bits(-0.0f));
}

// fp8_nearest against the definition: the finite code whose value is nearest, ties to the one
// with an even mantissa, magnitudes above the largest finite value saturating to it, the sign
// kept (so -0 and negative values that round to zero give 0x80).
TEST(Fp8Format, NearestIsTheClosestValueTiesToEvenSaturating) {
  for (bool is_signed : {true, false}) {
    SCOPED_TRACE(is_signed ? "e4m3" : "e5m2");
    const uint32_t max_code = fp8_format(is_signed).max_code;
    std::vector<float> values;  // the non-negative finite values, by code
    for (uint32_t c = 0; c <= max_code; ++c) values.push_back(fp8_value(static_cast<uint8_t>(c), is_signed));
    for (size_t c = 1; c < values.size(); ++c) ASSERT_LT(values[c - 1], values[c]) << c;
    auto reference = [&](float q) -> uint8_t {
      const uint8_t sign = std::signbit(q) ? 0x80 : 0x00;
      const double a = std::fabs(static_cast<double>(q));
      if (a >= values.back()) return static_cast<uint8_t>(sign | max_code);
      const size_t hi = std::upper_bound(values.begin(), values.end(), static_cast<float>(a)) - values.begin();
      const size_t lo = hi - 1;  // values[lo] <= a < values[hi]
      const double below = a - values[lo], above = values[hi] - a;
      const size_t pick = below < above ? lo : above < below ? hi : (lo % 2 == 0 ? lo : hi);
      return static_cast<uint8_t>(sign | pick);
    };
    int64_t checked = 0;
    auto expect_same = [&](float q) {
      ++checked;
      const uint8_t got = fp8_nearest(q, is_signed), want = reference(q);
      if (got != want) {
        ADD_FAILURE() << "q = " << q << " (bits " << std::hex << float_bits(q) << "): got " << int(got)
                      << ", want " << int(want);
        return false;
      }
      return true;
    };
    // around every value and every midpoint, both signs, and far beyond the largest
    for (size_t c = 0; c < values.size(); ++c) {
      const float v = values[c];
      const float mid = c + 1 < values.size() ? 0.5f * (v + values[c + 1]) : 2.0f * v;
      for (float center : {v, mid})
        for (int k = -300; k <= 300; ++k) {
          const int64_t u = static_cast<int64_t>(float_bits(center)) + k;
          if (u < 0) continue;
          const float q = bits_float(static_cast<uint32_t>(u));
          if (!expect_same(q) || !expect_same(-q)) return;
        }
    }
    const uint64_t seed = fresh_seed();
    SCOPED_TRACE("FORGE_TEST_SEED=" + std::to_string(seed));
    Rng rng(seed);
    for (int i = 0; i < 1000000; ++i) {  // every finite magnitude up to 2^20, fp32 subnormals too
      const float q = bits_float(static_cast<uint32_t>(rng.gen() % 0x49800000u));
      if (!expect_same(i & 1 ? -q : q)) return;
    }
    for (float q : {0.0f, -0.0f, 1e-45f, -1e-45f, 1e-38f, 3.4e38f, -3.4e38f, INFINITY, -INFINITY})
      if (!expect_same(q)) return;
    EXPECT_GT(checked, int64_t(1000000));
    // a NaN, whatever its sign and payload, gives 0x7F (a NaN in both formats)
    for (uint32_t nan : {0x7FC00000u, 0xFFC00000u, 0x7F800001u, 0xFFFFFFFFu})
      EXPECT_EQ(fp8_nearest(bits_float(nan), is_signed), 0x7F) << std::hex << nan;
  }
}

TEST(Fp8Format, EveryFiniteCodeRoundTrips) {
  for (bool is_signed : {true, false})
    for (int c = 0; c < 256; ++c) {
      const float v = fp8_value(static_cast<uint8_t>(c), is_signed);
      if (!std::isfinite(v)) continue;
      EXPECT_EQ(fp8_nearest(v, is_signed), c) << (is_signed ? "e4m3 " : "e5m2 ") << c;
    }
}

// The block's factor maps its absmax to the largest finite value (never beyond: nothing
// saturates but the absmax itself, by fp32 rounding), and back to the absmax within fp32
// rounding; a block below kFp8MinAbsmax is all zero.
TEST(Fp8Format, BlockFactorMapsTheAbsmaxToTheLargestValue) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("FORGE_TEST_SEED=" + std::to_string(seed));
  Rng rng(seed);
  for (bool is_signed : {true, false}) {
    const Fp8Format f = fp8_format(is_signed);
    for (int i = 0; i < 100000; ++i) {
      // any finite absmax from kFp8MinAbsmax on
      const float absmax = bits_float(float_bits(kFp8MinAbsmax) +
                                      static_cast<uint32_t>(rng.gen() % (0x7F7FFFFFu - float_bits(kFp8MinAbsmax))));
      const uint8_t code = fp8_encode(absmax, absmax, is_signed);
      ASSERT_EQ(code, f.max_code) << absmax;
      ASSERT_EQ(fp8_encode(-absmax, absmax, is_signed), 0x80 | f.max_code) << absmax;
      ASSERT_NEAR(fp8_decode(code, absmax, is_signed), absmax, absmax * kFp8FactorRoundings) << absmax;
    }
    EXPECT_EQ(fp8_block_absmax(0x1p-101f), 0.0f);
    EXPECT_EQ(fp8_block_absmax(kFp8MinAbsmax), kFp8MinAbsmax);
    for (float absmax : {0.0f, 0x1p-101f}) {
      EXPECT_EQ(fp8_encode(0x1p-102f, absmax, is_signed), 0);
      EXPECT_EQ(fp8_decode(0, absmax, is_signed), 0.0f);
    }
  }
}

// first moments m spanning 6 decades, as moments do, and second moments v = m², through
// forge_state_from_fp32 and back (forge_state_to_fp32) in `sf` (int8 or fp8): [5, 200], 4
// blocks a row, the last one partial.
struct BlockRoundTrip {
  static constexpr int64_t kRows = 5, kCols = 200;
  std::vector<float> m, v, m2, v2, absmax_m, absmax_v;
};

BlockRoundTrip block_round_trip(forge_state_format sf, Rng& rng) {
  forge_hparams hp;
  forge_hparams_default(FORGE_RULE_ADAMW, &hp);
  const int64_t n = BlockRoundTrip::kRows * BlockRoundTrip::kCols;
  HostParam p(BlockRoundTrip::kRows, BlockRoundTrip::kCols, FORGE_WEIGHT_FP32, sf, hp);
  BlockRoundTrip r;
  r.m.resize(n);
  r.v.resize(n);
  for (int64_t i = 0; i < n; ++i) {
    r.m[i] = rng.normal(1.0f) * std::pow(10.0f, rng.uniform(-6.0f, 0.0f));
    r.v[i] = r.m[i] * r.m[i];
  }
  forge_device cpu{};
  EXPECT_EQ(forge_state_from_fp32(&p.p, &hp, 0, r.m.data(), cpu), FORGE_OK) << forge_last_error();
  EXPECT_EQ(forge_state_from_fp32(&p.p, &hp, 1, r.v.data(), cpu), FORGE_OK) << forge_last_error();
  r.m2 = p.state_fp32(0, hp);
  r.v2 = p.state_fp32(1, hp);
  const float* am = reinterpret_cast<const float*>(p.absmax[0].data());
  const float* av = reinterpret_cast<const float*>(p.absmax[1].data());
  r.absmax_m.assign(am, am + BlockRoundTrip::kRows * 4);
  r.absmax_v.assign(av, av + BlockRoundTrip::kRows * 4);
  return r;
}

// Each fp8 value comes back within the format's rounding (relative), or within half the
// block's smallest step (absolute), and is zero exactly below that.
TEST(Fp8States, BlockRoundTripErrorBound) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("FORGE_TEST_SEED=" + std::to_string(seed));
  Rng rng(seed);
  const BlockRoundTrip r = block_round_trip(FORGE_STATE_FP8_BLOCK64, rng);
  int64_t zero_m = 0;
  for (int64_t row = 0; row < r.kRows; ++row)
    for (int64_t c = 0; c < r.kCols; ++c) {
      const int64_t i = row * r.kCols + c, b = row * 4 + c / 64;
      // half the smallest subnormal of the block: 2^-10 (e4m3) and 2^-17 (e5m2), × absmax / top
      const double floor_m = 0x1p-10 * r.absmax_m[b] / 448.0 * (1 + kFp8FactorRoundings);
      const double floor_v = 0x1p-17 * r.absmax_v[b] / 57344.0 * (1 + kFp8FactorRoundings);
      EXPECT_LE(std::fabs(r.m2[i] - r.m[i]), std::max(kFp8E4m3Rel * std::fabs(r.m[i]), floor_m)) << i;
      EXPECT_LE(std::fabs(r.v2[i] - r.v[i]), std::max(kFp8E5m2Rel * r.v[i], floor_v)) << i;
      EXPECT_GE(r.v2[i], 0.0f);
      EXPECT_TRUE(r.m2[i] == 0 || (r.m2[i] > 0) == (r.m[i] > 0)) << "sign flipped at " << i;
      // zero exactly where the value is within half the smallest step (up to the roundings)
      if (r.m2[i] == 0) EXPECT_LE(std::fabs(r.m[i]), floor_m) << i;
      if (std::fabs(r.m[i]) < floor_m * (1 - 2 * kFp8FactorRoundings)) EXPECT_EQ(r.m2[i], 0.0f) << i;
      zero_m += r.m2[i] == 0;
    }
  EXPECT_GT(zero_m, 0) << "the values span 6 decades: some are below e4m3's 2^-17.8 of a block";
  float largest = 0;
  for (int c = 0; c < 64; ++c) largest = std::max(largest, std::fabs(r.m[c]));
  EXPECT_EQ(r.absmax_m[0], largest);  // the absmax is the block's largest magnitude, unrounded
}

TEST(Int8Map, BlockRoundTripErrorBound) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("FORGE_TEST_SEED=" + std::to_string(seed));
  Rng rng(seed);
  const BlockRoundTrip r = block_round_trip(FORGE_STATE_INT8_BLOCK64, rng);
  for (int64_t row = 0; row < r.kRows; ++row)
    for (int64_t c = 0; c < r.kCols; ++c) {
      const int64_t i = row * r.kCols + c, b = row * 4 + c / 64;
      const double floor_m = int8_level_value(1, kInt8SignedTop) * r.absmax_m[b];
      const double floor_v = int8_level_value(1, kInt8UnsignedTop) * r.absmax_v[b];
      EXPECT_LE(std::fabs(r.m2[i] - r.m[i]), std::max(kInt8MapRel * std::fabs(r.m[i]), floor_m)) << i;
      EXPECT_LE(std::fabs(r.v2[i] - r.v[i]), std::max(kInt8MapRel * r.v[i], floor_v)) << i;
      EXPECT_GE(r.v2[i], 0.0f);
      EXPECT_TRUE(r.m2[i] == 0 || (r.m2[i] > 0) == (r.m[i] > 0)) << "sign flipped at " << i;
    }
  // Each block's absmax is its largest magnitude, so that element is exact.
  float largest = 0;
  for (int c = 0; c < 64; ++c) largest = std::max(largest, std::fabs(r.m[c]));
  EXPECT_EQ(r.absmax_m[0], largest);
}

// Least squares: W [out, in] fits Y* = X W*ᵀ; loss = ½/T ‖X Wᵀ − Y*‖²,
// dY = (X Wᵀ − Y*) / T, and the fused step consumes dW = dYᵀX.
double lsq_run_step(HostParam& p, const forge_hparams& hp, const Matrix& x, const std::vector<float>& w_star,
                    int64_t out, int64_t in) {
  const int64_t T = x.rows;
  Matrix dy{T, out, out, FORGE_DTYPE_FP32, std::vector<uint8_t>(T * out * 4)};
  double loss = 0;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t o = 0; o < out; ++o) {
      double y = 0, y_star = 0;
      for (int64_t i = 0; i < in; ++i) {
        y += double(p.w(o * in + i)) * x.get(t, i);
        y_star += double(w_star[o * in + i]) * x.get(t, i);
      }
      loss += 0.5 * (y - y_star) * (y - y_star) / T;
      dy.set(t, o, static_cast<float>((y - y_star) / T));
    }
  forge_wgrad_args a = wgrad_args(p, hp, x, dy);
  EXPECT_EQ(forge_wgrad_step(&a), FORGE_OK) << forge_last_error();
  return loss;
}

// AdamW with `sf` (int8, fp8 or int4) states against fp32 states from the same start: the
// low-precision run's progress within `share` of the fp32 run's at every checkpoint, and its
// loss cut by `min_reduction` (tolerances.h says why each format's pair is what it is).
void expect_adamw_tracks_fp32(forge_state_format sf, double share = kLsqProgressShare,
                              double min_reduction = kLsqMinReduction) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("FORGE_TEST_SEED=" + std::to_string(seed));
  Rng rng(seed);
  const int64_t out = 8, in = 128, T = 256;
  forge_hparams hp;
  forge_hparams_default(FORGE_RULE_ADAMW, &hp);
  hp.lr = 1e-2;
  hp.weight_decay = 0;
  const Matrix x = random_matrix(rng, T, in, in, FORGE_DTYPE_FP32);
  std::vector<float> w_star(out * in);
  for (float& w : w_star) w = rng.normal(0.3f);
  HostParam fp32(out, in, FORGE_WEIGHT_FP32, FORGE_STATE_FP32, hp);
  fp32.randomize(rng, hp);
  HostParam int8(out, in, FORGE_WEIGHT_FP32, sf, hp);  // (int8 or fp8)
  for (int64_t i = 0; i < fp32.size(); ++i) int8.set_w(i, fp32.w(i));
  forge_device cpu{};
  ASSERT_EQ(forge_state_init(&int8.p, &hp, cpu), FORGE_OK);
  double first = 0, loss32 = 0, loss8 = 0;
  for (int64_t step = 1; step <= 300; ++step) {
    hp.step = step;
    loss32 = lsq_run_step(fp32, hp, x, w_star, out, in);
    loss8 = lsq_run_step(int8, hp, x, w_star, out, in);
    if (step == 1) first = loss32;
    if (step % 25 == 0) {
      const double progress32 = std::log(first / loss32), progress8 = std::log(first / loss8);
      EXPECT_GE(progress8, share * progress32) << "step " << step;
      EXPECT_LE(progress8, progress32 / share) << "step " << step;
    }
  }
  EXPECT_LE(loss32, first / kLsqMinReduction);
  EXPECT_LE(loss8, first / min_reduction);
}

TEST(Int8States, AdamWTracksFp32OnLeastSquares) { expect_adamw_tracks_fp32(FORGE_STATE_INT8_BLOCK64); }
TEST(Fp8States, AdamWTracksFp32OnLeastSquares) { expect_adamw_tracks_fp32(FORGE_STATE_FP8_BLOCK64); }
TEST(Int4States, AdamWTracksFp32OnLeastSquares) {
  expect_adamw_tracks_fp32(FORGE_STATE_INT4_BLOCK64, kLsqInt4ProgressShare, kLsqInt4MinReduction);
}

// ---- int4 ---------------------------------------------------------------------------------

// The maps as formats.h documents them: signed, code 0 is 0, codes 1..8 the positive values
// ascending to 1, 9..15 the negative ones ascending from -0.8875 (the 4-bit dynamic-exponent
// values); unsigned, the zero-free dynamic-exponent values ascending, code c the c-th. The
// code <-> ascending-index bijection round-trips.
TEST(Int4Map, ValuesAndCodes) {
  const float positive[] = {0.0055f, 0.0325f, 0.0775f, 0.2125f, 0.4375f, 0.6625f, 0.8875f, 1.0f};
  // decade 10^-3: 1 value, 10^-2: 2, 10^-1: 4, 1: 8 (midpoints of equal bins of [0.1, 1]), 1
  const float unsigned_values[] = {0.00055f, 0.00325f, 0.00775f, 0.02125f, 0.04375f, 0.06625f,
                                   0.08875f, 0.15625f, 0.26875f, 0.38125f, 0.49375f, 0.60625f,
                                   0.71875f, 0.83125f, 0.94375f, 1.0f};
  EXPECT_EQ(int4_map(0, true), 0.0f);
  for (int c = 1; c <= 8; ++c) EXPECT_EQ(int4_map(static_cast<uint8_t>(c), true), positive[c - 1]);
  for (int c = 9; c <= 15; ++c)
    EXPECT_EQ(int4_map(static_cast<uint8_t>(c), true), -positive[6 - (c - 9)]) << c;
  for (int k = 1; k < kInt4Codes; ++k) {
    EXPECT_LT(int4_signed_ascending(k - 1), int4_signed_ascending(k)) << k;
    EXPECT_LT(int4_unsigned_ascending(k - 1), int4_unsigned_ascending(k)) << k;
  }
  for (int c = 0; c < kInt4Codes; ++c) {
    EXPECT_EQ(int4_signed_code(int4_signed_index(static_cast<uint8_t>(c))), c);
    EXPECT_EQ(int4_map(static_cast<uint8_t>(c), false), unsigned_values[c]);
    // a code's own value (times an absmax) encodes back to the code
    for (float absmax : {1.0f, 3.7e-20f, 0.3f, 2.5e30f})
      for (bool is_signed : {true, false}) {
        const uint8_t code = static_cast<uint8_t>(c);
        EXPECT_EQ(int4_encode(int4_decode(code, absmax, is_signed), absmax, is_signed), code)
            << c << " " << absmax << " " << is_signed;
      }
  }
}

// The CUDA encode's buckets (update/block_codecs.cuh, int4_bucket_table): a ratio's bits >> 19
// (its exponent and top 4 mantissa bits) name its bucket, from 2^-10 up to 2, and each bucket
// holds at most one midpoint of a map (the signed map's positive ones), so a bucket's base
// count and one compare give the code.
TEST(Int4Map, EachEncodeBucketHoldsOneMidpointAtMost) {
  for (bool is_signed : {true, false}) {
    std::vector<uint32_t> buckets;
    for (int k = is_signed ? kInt4Codes / 2 : 1; k < kInt4Codes; ++k) {
      const float m = is_signed ? int4_signed_midpoint(k) : int4_unsigned_midpoint(k);
      EXPECT_GE(m, 0x1p-10f) << k;
      EXPECT_LT(m, 2.0f) << k;
      uint32_t bits;
      std::memcpy(&bits, &m, sizeof bits);
      buckets.push_back(bits >> 19);
    }
    for (size_t i = 1; i < buckets.size(); ++i)
      EXPECT_LT(buckets[i - 1], buckets[i]) << is_signed << " " << i;
  }
}

// int4_nearest_code against a brute-force nearest value (distances in double, ties to the
// larger value): a fine grid of [-1, 1], and ±4 floats around every midpoint of neighbouring
// values. The code compares q with the fp32 half-sum of the two values, one rounding from
// their real midpoint: within one float of it either neighbour is allowed. A negative q is
// below the unsigned map: its lowest code. An absmax of 0 gives code 0 (the value 0 signed).
TEST(Int4Map, NearestIsTheClosestValueTiesUp) {
  auto brute = [](float q, bool is_signed, bool* near_midpoint) {
    int best = 0;
    *near_midpoint = false;
    for (int c = 1; c < kInt4Codes; ++c) {
      const double vb = int4_map(static_cast<uint8_t>(best), is_signed);
      const double vc = int4_map(static_cast<uint8_t>(c), is_signed);
      const double db = std::fabs(vb - q), dc = std::fabs(vc - q);
      if (std::fabs(db - dc) <= 2.0 * (std::nextafter(std::fabs(q), 2.0f) - std::fabs(q)))
        *near_midpoint = true;
      if (dc < db || (dc == db && vc > vb)) best = c;
    }
    return best;
  };
  std::vector<float> qs;
  for (int i = -200000; i <= 200000; ++i) qs.push_back(i / 200000.0f);
  for (bool is_signed : {true, false})
    for (int k = 1; k < kInt4Codes; ++k) {
      const float lo = is_signed ? int4_signed_ascending(k - 1) : int4_unsigned_ascending(k - 1);
      const float hi = is_signed ? int4_signed_ascending(k) : int4_unsigned_ascending(k);
      float q = 0.5f * (lo + hi);
      for (int j = 0; j < 4; ++j) q = std::nextafter(q, -2.0f);
      for (int j = 0; j < 9; ++j, q = std::nextafter(q, 2.0f)) qs.push_back(q);
    }
  for (bool is_signed : {true, false})
    for (float q : qs) {
      if (!is_signed && q < 0) {
        EXPECT_EQ(int4_nearest_code(q, false), 0) << q;
        continue;
      }
      bool near_midpoint = false;
      const int expected = brute(q, is_signed, &near_midpoint);
      const int code = int4_nearest_code(q, is_signed);
      if (code == expected) continue;
      ASSERT_TRUE(near_midpoint) << q << " " << is_signed << ": " << code << " vs " << expected;
      const float got = int4_map(static_cast<uint8_t>(code), is_signed);
      const float want = int4_map(static_cast<uint8_t>(expected), is_signed);
      ASSERT_LE(std::fabs(std::fabs(got - q) - std::fabs(want - q)), 1e-6f) << q;
    }
  EXPECT_EQ(int4_encode(0.5f, 0.0f, true), 0);
  EXPECT_EQ(int4_decode(9, 0.0f, true), -0.0f);  // (an absmax of 0: zeros whatever the codes)
}

// Codes pack two to a byte, column 2j low and 2j + 1 high; writing one leaves the other.
TEST(Int4Map, PackedCodes) {
  uint8_t row[3] = {0, 0, 0};
  for (int c = 0; c < 5; ++c)
    row[c >> 1] = int4_with_code(row[c >> 1], c, static_cast<uint8_t>(10 + c));
  EXPECT_EQ(row[0], 0xBA);
  EXPECT_EQ(row[1], 0xDC);
  EXPECT_EQ(row[2], 0x0E);
  for (int c = 0; c < 5; ++c) EXPECT_EQ(int4_code_at(row, c), 10 + c);
  row[1] = int4_with_code(row[1], 3, 1);
  EXPECT_EQ(row[1], 0x1C);
  EXPECT_EQ(int4_row_bytes(129), 65);
  // a store: as int4_with_code, but the last element of a row of odd length writes its padding
  // nibble 0 (whatever the byte held), and only that one
  EXPECT_EQ(int4_store_code(0xF7, 4, 5, 0xE), 0x0E);
  EXPECT_EQ(int4_store_code(0xF7, 4, 6, 0xE), 0xFE);
  EXPECT_EQ(int4_store_code(0xF7, 5, 6, 0xE), 0xE7);
  EXPECT_EQ(int4_store_code(0xF7, 2, 5, 0xE), 0xFE);
}

// Moments spanning 6 decades through forge_state_from_fp32 and back: each value within half
// the map's widest gap of its block's absmax, never a flipped sign, never a zero second moment
// in a block that has one above zero (none below the unsigned map's smallest value, which a
// value below it reads as); the absmax is the block's largest magnitude, which comes back
// exactly.
TEST(Int4States, BlockRoundTripErrorBound) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("FORGE_TEST_SEED=" + std::to_string(seed));
  Rng rng(seed);
  const BlockRoundTrip r = block_round_trip(FORGE_STATE_INT4_BLOCK64, rng);
  for (int64_t row = 0; row < r.kRows; ++row)
    for (int64_t c = 0; c < r.kCols; ++c) {
      const int64_t i = row * r.kCols + c, b = row * 4 + c / 64;
      EXPECT_LE(std::fabs(r.m2[i] - r.m[i]), kInt4SignedAbsmaxStep * r.absmax_m[b]) << i;
      EXPECT_LE(std::fabs(r.v2[i] - r.v[i]), kInt4UnsignedAbsmaxStep * r.absmax_v[b]) << i;
      EXPECT_GE(r.v2[i], int4_unsigned_ascending(0) * r.absmax_v[b]) << i;
      EXPECT_TRUE(r.m2[i] == 0 || (r.m2[i] > 0) == (r.m[i] > 0)) << "sign flipped at " << i;
    }
  for (int64_t b = 0; b < r.kRows * 4; ++b) {
    const int64_t row = b / 4, c0 = (b % 4) * 64, c1 = std::min<int64_t>(c0 + 64, r.kCols);
    float largest = 0;
    for (int64_t c = c0; c < c1; ++c)
      largest = std::max(largest, std::fabs(r.m[row * r.kCols + c]));
    EXPECT_EQ(r.absmax_m[b], largest);
    for (int64_t c = c0; c < c1; ++c)
      if (std::fabs(r.m[row * r.kCols + c]) == largest && r.m[row * r.kCols + c] > 0)
        EXPECT_EQ(r.m2[row * r.kCols + c], largest);
  }
}

// Rows of an odd number of columns keep their own bytes (ceil(cols / 2) each): writing one row
// through forge_state_from_fp32 reads back the same in every other row, and the partial
// block's last element (the low half of the row's last byte) round-trips.
TEST(Int4States, OddColumnsKeepRowsApart) {
  forge_hparams hp;
  forge_hparams_default(FORGE_RULE_SGD_MOMENTUM, &hp);
  hp.momentum = 0.9;
  const int64_t rows = 3, cols = 129;
  HostParam p(rows, cols, FORGE_WEIGHT_FP32, FORGE_STATE_INT4_BLOCK64, hp);
  ASSERT_EQ(p.state[0].size(), static_cast<size_t>(rows * 65));
  std::vector<float> in(rows * cols);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c)
      in[r * cols + c] = int4_map(static_cast<uint8_t>((r * 7 + c) % 16), true) * (r + 1);
  forge_device cpu{};
  ASSERT_EQ(forge_state_from_fp32(&p.p, &hp, 0, in.data(), cpu), FORGE_OK) << forge_last_error();
  const std::vector<float> out = p.state_fp32(0, hp);
  for (int64_t i = 0; i < rows * cols; ++i) {
    // every block holds the value 1 · (r + 1), so its absmax is r + 1 and each value is a
    // map value times it, which comes back exactly; the last block holds 1 column, with
    // absmax |its value|
    const int64_t c = i % cols;
    if (c < 128) EXPECT_EQ(out[i], in[i]) << i;
    else EXPECT_NEAR(out[i], in[i], kInt4SignedAbsmaxStep * std::fabs(in[i])) << i;
  }
}

}  // namespace
}  // namespace forge_test

namespace forge_test {
namespace {

using namespace forge;

float absmax_at(const HostParam& p, int state, int64_t block) {
  float a;
  std::memcpy(&a, p.absmax[state].data() + 4 * block, 4);
  return a;
}

// A block's element as its value (code, absmax) and back, for int8 or fp8 states.
float block_decode(forge_state_format sf, uint8_t code, float absmax, bool is_signed) {
  return sf == FORGE_STATE_FP8_BLOCK64 ? fp8_decode(code, absmax, is_signed)
                                       : int8_decode(code, is_signed) * absmax;
}
uint8_t block_encode(forge_state_format sf, float x, float absmax, bool is_signed) {
  return sf == FORGE_STATE_FP8_BLOCK64 ? fp8_encode(x, absmax, is_signed)
                                       : int8_encode(x, absmax, is_signed);
}

// In an int8 or fp8 block holding a skipped element, the absmax stays while the updated
// elements' new magnitudes fit under it, and the skipped element keeps its code byte; when
// they do not, the absmax grows to the old one times the smallest power of two that holds
// them (formats.h, block_absmax_with_skipped), and the skipped element is re-encoded from its
// decoded value. Element 5 of the first block and element 70 of the second (partial) block
// get a NaN gradient every step; the others' gradients are 0 for ten steps (their moments only
// decay: the absmax stays) and then large (it grows). Before, a skipped element was
// re-encoded against each step's new absmax, and drifted.
void expect_skipped_element_keeps_its_code(forge_state_format sf) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("FORGE_TEST_SEED=" + std::to_string(seed));
  Rng rng(seed);
  forge_hparams hp;
  forge_hparams_default(FORGE_RULE_ADAMW, &hp);
  const int64_t cols = 100;  // a whole block and a partial one
  HostParam p(1, cols, FORGE_WEIGHT_FP32, sf, hp);
  p.randomize(rng, hp);
  std::vector<float> grad(cols);
  for (int64_t step = 1; step <= 3; ++step) {  // moments of every size
    hp.step = step;
    for (float& g : grad) g = rng.normal(1.0f);
    const forge_elementwise_args a = elementwise_args(p, hp, grad);
    ASSERT_EQ(forge_elementwise_step(&a), FORGE_OK) << forge_last_error();
  }
  const int64_t skipped[2] = {5, 70};
  int grew = 0, stayed = 0;
  for (int64_t step = 4; step <= 16; ++step) {
    hp.step = step;
    const bool large = step > 13;
    for (int64_t c = 0; c < cols; ++c) grad[c] = large ? 100.0f * rng.normal(1.0f) : 0.0f;
    for (int64_t c : skipped) grad[c] = NAN;
    const HostParam before(p);
    int64_t count = 0;
    forge_elementwise_args a = elementwise_args(p, hp, grad);
    a.outputs.nonfinite_count = &count;
    ASSERT_EQ(forge_elementwise_step(&a), FORGE_OK) << forge_last_error();
    EXPECT_EQ(count, 2);
    for (int s = 0; s < 2; ++s)
      for (int64_t block = 0; block < 2; ++block) {
        SCOPED_TRACE(::testing::Message() << "step " << step << " state " << s << " block " << block);
        const float old_max = absmax_at(before, s, block), new_max = absmax_at(p, s, block);
        const int64_t e = skipped[block];
        const uint8_t old_code = before.state[s][e], new_code = p.state[s][e];
        const bool is_signed = s == 0;
        EXPECT_GE(new_max, old_max);
        if (float_bits(new_max) == float_bits(old_max)) {
          ++stayed;
          EXPECT_EQ(new_code, old_code);
        } else {
          ++grew;
          EXPECT_EQ(new_code, block_encode(sf, block_decode(sf, old_code, old_max, is_signed), new_max,
                                           is_signed));
        }
        // The updated elements' magnitudes never exceed the absmax; when it grew, it is the
        // old one times 2^k (k >= 1) and the largest of them is above half of it (each
        // decoded within its format's rounding).
        float largest = 0;
        for (int64_t c = block * 64; c < std::min<int64_t>(cols, block * 64 + 64); ++c)
          if (c != e) largest = std::max(largest, std::fabs(block_decode(sf, p.state[s][c], new_max, is_signed)));
        const double rel = sf == FORGE_STATE_INT8_BLOCK64 ? kInt8MapRel
                           : is_signed                    ? kFp8E4m3Rel
                                                          : kFp8E5m2Rel;
        EXPECT_LE(largest, new_max * (1 + rel));
        if (new_max != old_max) {
          int k = 0;
          EXPECT_EQ(std::frexp(new_max, &k), std::frexp(old_max, &k)) << "not old · 2^k";
          EXPECT_GE(new_max, 2 * old_max);
          EXPECT_GT(largest, 0.5 * new_max * (1 - rel));
        }
      }
  }
  EXPECT_GT(stayed, 0);
  EXPECT_GT(grew, 0);
}

TEST(Int8States, SkippedElementKeepsItsCodeUnlessTheAbsmaxGrows) {
  expect_skipped_element_keeps_its_code(FORGE_STATE_INT8_BLOCK64);
}
TEST(Fp8States, SkippedElementKeepsItsCodeUnlessTheAbsmaxGrows) {
  expect_skipped_element_keeps_its_code(FORGE_STATE_FP8_BLOCK64);
}

// forge_state_from_fp32 stores nothing it would never compute: a value that is not finite
// (or above the largest bf16), or a negative second moment, is refused naming its index.
TEST(Int8States, StateFromFp32RefusesWhatNoStepStores) {
  forge_hparams hp;
  forge_hparams_default(FORGE_RULE_ADAMW, &hp);
  const forge_device cpu{};
  for (int sf = 0; sf < FORGE_STATE_FORMAT_COUNT; ++sf) {
    SCOPED_TRACE(state_format_name(sf));
    HostParam p(3, 70, FORGE_WEIGHT_FP32, static_cast<forge_state_format>(sf), hp);
    std::vector<float> good(p.size());
    for (int64_t i = 0; i < p.size(); ++i) good[i] = 0.01f * static_cast<float>(i % 13) - 0.05f;
    ASSERT_EQ(forge_state_from_fp32(&p.p, &hp, 0, good.data(), cpu), FORGE_OK) << forge_last_error();
    const std::vector<uint8_t> before = p.snapshot();
    struct Bad { int state; int64_t index; float value; const char* part; };
    for (const Bad& b : {Bad{0, 7, NAN, "in[7]"}, Bad{1, 200, INFINITY, "in[200]"},
                         Bad{0, 0, -INFINITY, "in[0]"}, Bad{0, 9, 3.4e38f, "in[9]"},
                         Bad{1, 3, -0.5f, "negative"}}) {
      std::vector<float> in(p.size(), 0.25f);
      in[b.index] = b.value;
      EXPECT_EQ(forge_state_from_fp32(&p.p, &hp, b.state, in.data(), cpu), FORGE_ERR_INVALID_ARGUMENT);
      EXPECT_NE(std::string(forge_last_error()).find(b.part), std::string::npos) << forge_last_error();
      EXPECT_EQ(p.snapshot(), before);
    }
    // a negative first moment is fine, and so is -0 for a second moment
    std::vector<float> in(p.size(), -0.0f);
    in[4] = -0.25f;
    EXPECT_EQ(forge_state_from_fp32(&p.p, &hp, 0, in.data(), cpu), FORGE_OK) << forge_last_error();
    in[4] = 0.0f;
    EXPECT_EQ(forge_state_from_fp32(&p.p, &hp, 1, in.data(), cpu), FORGE_OK) << forge_last_error();
  }
}

}  // namespace
}  // namespace forge_test

namespace forge_test {
namespace {

using namespace forge;

// An element skipped step after step while its block's absmax grows a little every step (its
// gradient NaN throughout, the others' growing by 0.2 % a step): each growth re-encoded it
// against the new absmax, nearest rounding gave it the same code every time, and its value
// grew with the absmax (exp_avg_sq ×12.9 with int8 states, ×29 with fp8, after 980 steps). A
// skipped element's value stays what it was, bit for bit, while it lies in its block's range
// (int8: at or above the smallest level, 2^-15.75 (signed) / 2^-31.75 of the absmax; fp8:
// at or above the smallest normal value, 2^-6 / 448 (e4m3) and 2^-14 / 57344 (e5m2) of it).
void expect_skipped_value_kept_while_the_absmax_grows(forge_state_format sf) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("FORGE_TEST_SEED=" + std::to_string(seed));
  Rng rng(seed);
  forge_hparams hp;
  forge_hparams_default(FORGE_RULE_ADAMW, &hp);
  hp.lr = 1e-3;
  const int64_t cols = 100;  // a whole block and a partial one
  HostParam p(2, cols, FORGE_WEIGHT_FP32, sf, hp);
  p.randomize(rng, hp);
  std::vector<float> sign(p.size()), grad(p.size());
  for (float& s : sign) s = rng.integer(0, 1) ? 1.0f : -1.0f;
  for (int64_t step = 1; step <= 3; ++step) {  // moments of every size
    hp.step = step;
    for (int64_t i = 0; i < p.size(); ++i) grad[i] = sign[i] * (0.5f + std::fabs(rng.normal(1.0f)));
    const forge_elementwise_args a = elementwise_args(p, hp, grad);
    ASSERT_EQ(forge_elementwise_step(&a), FORGE_OK) << forge_last_error();
  }
  const int64_t skipped[] = {5, 70, cols + 40, cols + 99};  // in each row's two blocks
  std::vector<float> kept[2] = {p.state_fp32(0, hp), p.state_fp32(1, hp)};
  std::vector<float> base(p.size());
  for (int64_t i = 0; i < p.size(); ++i) base[i] = sign[i] * (1.0f + 0.1f * std::fabs(rng.normal(1.0f)));
  int grew = 0;
  for (int64_t step = 4; step <= 983; ++step) {
    hp.step = step;
    const float growth = 1.0f + 0.002f * static_cast<float>(step - 3);
    for (int64_t i = 0; i < p.size(); ++i) grad[i] = base[i] * growth;
    for (int64_t i : skipped) grad[i] = NAN;
    const HostParam before(p);
    int64_t count = 0;
    forge_elementwise_args a = elementwise_args(p, hp, grad);
    a.outputs.nonfinite_count = &count;
    a.device.num_threads = 1;  // (2 rows: a thread each cost more than the step on a busy host)
    ASSERT_EQ(forge_elementwise_step(&a), FORGE_OK) << forge_last_error();
    ASSERT_EQ(count, 4);
    for (int s = 0; s < 2; ++s) {
      const std::vector<float> now = p.state_fp32(s, hp);
      for (int64_t i : skipped) {
        const int64_t block = (i / cols) * 2 + (i % cols) / 64;
        grew += absmax_at(before, s, block) != absmax_at(p, s, block);
        // (in range: checked below, so the exact comparison always applies)
        ASSERT_EQ(float_bits(now[i]), float_bits(kept[s][i]))
            << "state " << s << " element " << i << " at step " << step << ": " << now[i]
            << ", was " << kept[s][i] << " (absmax " << absmax_at(p, s, block) << ")";
      }
    }
  }
  // (4 blocks × 2 states; the first moments grow 3-fold, the second 9-fold: 1 to 4 doublings)
  EXPECT_GE(grew, 4 * 2) << "the absmax of the skipped elements' blocks grew";
  // Every skipped value stayed in its block's range, where the claim is exact.
  const bool fp8 = sf == FORGE_STATE_FP8_BLOCK64;
  for (int s = 0; s < 2; ++s)
    for (int64_t i : skipped) {
      const int64_t block = (i / cols) * 2 + (i % cols) / 64;
      const double floor = s == 0 ? (fp8 ? 0x1p-6 / 448 : std::exp2(-126.0 / 8))
                                  : (fp8 ? 0x1p-14 / 57344 : std::exp2(-254.0 / 8));
      EXPECT_GE(std::fabs(kept[s][i]), floor * absmax_at(p, s, block)) << "state " << s << " element " << i;
    }
}

TEST(Int8States, SkippedValueIsKeptWhileTheAbsmaxGrows) {
  expect_skipped_value_kept_while_the_absmax_grows(FORGE_STATE_INT8_BLOCK64);
}
TEST(Fp8States, SkippedValueIsKeptWhileTheAbsmaxGrows) {
  expect_skipped_value_kept_while_the_absmax_grows(FORGE_STATE_FP8_BLOCK64);
}

}  // namespace
}  // namespace forge_test

namespace forge_test {
namespace {

using namespace forge;

// block_absmax_with_skipped's cases, and its claim for every code: a skipped element decoded
// against the old absmax and re-encoded against the grown one decodes to the same bits while
// it stays in the block's range (int8: level >= 1 after the shift down by 8k levels; fp8: a
// normal value after the scaling by 2^-k), and below that to within one step of the block's
// smallest grid.
TEST(BlockAbsmax, GrowsByPowersOfTwoAndKeepsSkippedValues) {
  const float nan = NAN;
  EXPECT_EQ(block_absmax_with_skipped(2.0f, 1.5f, false), 2.0f);    // fits: stays
  EXPECT_EQ(block_absmax_with_skipped(2.0f, 2.0f, true), 2.0f);
  EXPECT_EQ(block_absmax_with_skipped(2.0f, -INFINITY, false), 2.0f);  // nothing updated
  EXPECT_TRUE(std::isnan(block_absmax_with_skipped(nan, 5.0f, false)));  // (a NaN one stays)
  EXPECT_EQ(block_absmax_with_skipped(1.5f, 1.6f, false), 3.0f);    // the smallest 2^k
  EXPECT_EQ(block_absmax_with_skipped(1.5f, 3.0f, false), 3.0f);
  EXPECT_EQ(block_absmax_with_skipped(1.5f, 3.1f, false), 6.0f);
  EXPECT_EQ(block_absmax_with_skipped(1.5f, 1000.0f, false), 1536.0f);
  EXPECT_EQ(block_absmax_with_skipped(0x1.8p-140f, 1.0f, false), 0x1.8p0f);  // subnormal old
  EXPECT_EQ(block_absmax_with_skipped(0.0f, 0.75f, false), 0.75f);  // all-zero block
  EXPECT_EQ(block_absmax_with_skipped(0.0f, 0x1p-120f, true), 0.0f);  // fp8's flush
  EXPECT_EQ(block_absmax_with_skipped(0x1.8p126f, 0x1.FEp127f, false), kBf16Max);  // capped
  EXPECT_EQ(block_absmax_with_skipped(3e38f, 3.2e38f, true), kBf16Max);

  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("FORGE_TEST_SEED=" + std::to_string(seed));
  Rng rng(seed);
  int64_t exact = 0, below = 0;
  for (int trial = 0; trial < 200; ++trial) {
    const float old = std::ldexp(rng.uniform(1.0f, 2.0f), rng.integer(-60, 60));
    const int k = rng.integer(1, 40);
    const float grown = block_absmax_with_skipped(old, std::ldexp(old, k) * 0.9f, false);
    ASSERT_EQ(grown, std::ldexp(old, k));
    for (int fp8 = 0; fp8 < 2; ++fp8)
      for (int is_signed = 0; is_signed < 2; ++is_signed)
        for (int code = 0; code < 256; ++code) {
          const uint8_t c = static_cast<uint8_t>(code);
          float v, again;
          bool in_range;
          if (fp8) {
            if (std::isnan(fp8_value(c, is_signed)) || std::isinf(fp8_value(c, is_signed))) continue;
            v = fp8_decode(c, old, is_signed);
            again = fp8_decode(fp8_encode(v, grown, is_signed), grown, is_signed);
            const Fp8Format f = fp8_format(is_signed);
            in_range = std::fabs(fp8_value(c, is_signed)) * std::ldexp(1.0f, -k) >= std::ldexp(1.0f, 1 - f.bias);
          } else {
            v = int8_decode(c, is_signed) * old;
            again = int8_decode(int8_encode(v, grown, is_signed), is_signed) * grown;
            in_range = (c & (is_signed ? 0x7F : 0xFF)) - 8 * k >= 1;
          }
          SCOPED_TRACE(::testing::Message() << (fp8 ? "fp8" : "int8") << (is_signed ? " signed" : " unsigned")
                                            << " code " << code << " k " << k << " old " << old);
          if (v == 0.0f) {  // (int8's code 0x80, -0, comes back as 0: equal, not the same bits)
            ASSERT_EQ(again, 0.0f);
          } else if (in_range) {
            ASSERT_EQ(float_bits(again), float_bits(v));
            ++exact;
          } else {  // within one step of the new block's smallest grid
            const double step = fp8 ? std::ldexp(1.0, 1 - fp8_format(is_signed).bias - fp8_format(is_signed).man) *
                                          grown / fp8_format(is_signed).top
                                    : int8_level_value(1, is_signed ? kInt8SignedTop : kInt8UnsignedTop) * grown;
            ASSERT_LE(std::fabs(double(again) - double(v)), step * (1 + kFp8FactorRoundings));
            ++below;
          }
        }
  }
  EXPECT_GT(exact, 0);
  EXPECT_GT(below, 0);
}

}  // namespace
}  // namespace forge_test
