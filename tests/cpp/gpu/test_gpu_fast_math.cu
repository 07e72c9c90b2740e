// test_gpu_fast_math.cu — the fused epilogue's branch-free fast paths (src/cuda/update.cuh:
// FastMath::div, FastMath::sqrt, bf16x2_nearest_nonnan) against the reference they replace,
// on the device, bit for bit:
//  - sqrt: every float. Inside FastMath's domain the result must equal IEEE sqrt (__fsqrt_rn);
//    outside it FastMath must decline (ok = false).
//  - div: 2^30 random (a, b) pairs with exponents drawn across the whole domain and beyond,
//    every b mantissa against fixed a, and special values. Inside the domain the result must
//    equal IEEE division (__fdiv_rn); outside it FastMath must decline.
//  - bf16x2_nearest_nonnan: every non-NaN float in both halves against formats.h's
//    bf16_nearest.
//  - adamw_direction: m / (sqrt(v) / bc2_sqrt + eps) on 2^28 random quadruples and special
//    values, against the same IEEE operations (each a single rounding) on the combined domain
//    restated below; outside it FastMath must decline (all_ok() false). NaN and infinite v
//    are outside: the AdamW fast path relies on that to skip its gradient's finite test
//    (rules.h).
// FastMathWithZeros (the element-wise kernels') passes the same tests with +0 added to its
// domain (sqrt(+0), +0 / b). Any difference would break the CPU/GPU bit equality of a step.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <random>
#include <type_traits>

#include "core/formats.h"
#include "core/rng.h"
#include "cuda/update.cuh"
#include "gpu_test_util.h"

namespace fgt {
namespace {

using forge::cuda::FastMath;
using forge::cuda::FastMathWithZeros;

// Whether Math also takes +0 (FastMathWithZeros: +0 / b and sqrt(+0)).
template <class Math>
constexpr bool kTakesZero = std::is_same<Math, FastMathWithZeros>::value;

struct Counts {
  unsigned long long wrong;     // in the domain, a result other than the reference
  unsigned long long declined;  // in the domain, but FastMath said no
  unsigned long long accepted;  // outside the domain, but FastMath said yes
  unsigned long long checked;   // in-domain cases compared

  // One case of a FastMath operation: `in_domain` by the restated domain, `ok` what FastMath
  // said, `same` whether its result has the reference's bits.
  __device__ void record(bool in_domain, bool ok, bool same) {
    if (in_domain) {
      ++checked;
      if (!ok) ++declined;
      else if (!same) ++wrong;
    } else if (ok) {
      ++accepted;
    }
  }
};

__device__ void add_counts(Counts* out, unsigned long long wrong, unsigned long long declined,
                           unsigned long long accepted, unsigned long long checked) {
  if (wrong) atomicAdd(&out->wrong, wrong);
  if (declined) atomicAdd(&out->declined, declined);
  if (accepted) atomicAdd(&out->accepted, accepted);
  if (checked) atomicAdd(&out->checked, checked);
}
__device__ void add_counts(Counts* out, const Counts& c) {
  add_counts(out, c.wrong, c.declined, c.accepted, c.checked);
}

// The domains, restated independently of update.cuh. `zero`: +0 is in (FastMathWithZeros's
// sqrt and dividend; -0 never is).
__device__ bool sqrt_domain(float x, bool zero = false) {  // positive normal >= 2^-101, finite
  return (x >= 0x1p-101f && x <= 3.40282347e38f) || (zero && __float_as_uint(x) == 0u);
}
__device__ bool div_domain(float x, bool zero = false) {
  const float a = fabsf(x);
  return (a >= 0x1p-62f && a < 0x1p62f) || (zero && __float_as_uint(x) == 0u);
}

// Calls check(bits) for every 32-bit pattern, spread over the grid.
template <class Check>
__device__ void for_every_bit_pattern(Check check) {
  for (uint64_t i = blockIdx.x * uint64_t(blockDim.x) + threadIdx.x; i < (1ull << 32);
       i += uint64_t(gridDim.x) * blockDim.x)
    check(static_cast<uint32_t>(i));
}

template <class Math>
__global__ void check_sqrt_all(Counts* out) {
  Counts c{};
  for_every_bit_pattern([&](uint32_t bits) {
    const float x = __uint_as_float(bits);
    Math m;
    const float got = m.sqrt(x);
    c.record(sqrt_domain(x, kTakesZero<Math>), m.ok,
             __float_as_uint(got) == __float_as_uint(__fsqrt_rn(x)));
  });
  add_counts(out, c);
}

__device__ uint32_t hash32(uint64_t z) { return static_cast<uint32_t>(forge::mix64(z) >> 32); }

// A float with a random sign and mantissa and a biased exponent drawn from [lo, hi].
__device__ float random_float(uint64_t z, int lo, int hi) {
  const uint32_t r = hash32(z), e = hash32(z ^ 0x5bd1e995ull);
  const uint32_t exp = static_cast<uint32_t>(lo) + e % static_cast<uint32_t>(hi - lo + 1);
  return __uint_as_float((r & 0x807FFFFFu) | (exp << 23));
}

template <class Math>
__device__ void check_div_case(float a, float b, Counts& c) {
  Math m;
  const float got = m.div(a, b);
  c.record(div_domain(a, kTakesZero<Math>) && div_domain(b), m.ok,
           __float_as_uint(got) == __float_as_uint(__fdiv_rn(a, b)));
}

// Random pairs: most with exponents inside the domain (every combination of extremes is
// reached), some from anywhere (zeros, subnormals, infinities, NaN: must be declined).
template <class Math>
__global__ void check_div_random(uint64_t count, uint64_t seed, Counts* out) {
  Counts c{};
  for (uint64_t i = blockIdx.x * uint64_t(blockDim.x) + threadIdx.x; i < count;
       i += uint64_t(gridDim.x) * blockDim.x) {
    const uint64_t z = seed + 4 * i;
    float a, b;
    if ((i & 7) == 7) {
      a = __uint_as_float(hash32(z));
      b = __uint_as_float(hash32(z + 1));
    } else {
      a = random_float(z, 60, 193);  // the domain is [65, 188]: a few out on each side
      b = random_float(z + 1, 60, 193);
    }
    check_div_case<Math>(a, b, c);
  }
  add_counts(out, c);
}

// Every mantissa of b (both signs, a spread of exponents) against pseudo-random a: the
// reciprocal estimate is exercised at every input it can see. With zeros: +0 / every b too.
template <class Math>
__global__ void check_div_mantissas(uint64_t seed, Counts* out) {
  Counts c{};
  for (uint64_t i = blockIdx.x * uint64_t(blockDim.x) + threadIdx.x; i < (1ull << 23);
       i += uint64_t(gridDim.x) * blockDim.x) {
    const int exps[] = {65, 100, 127, 150, 188};
    for (int e : exps) {
      const float b = __uint_as_float((static_cast<uint32_t>(e) << 23) | static_cast<uint32_t>(i));
      for (int j = 0; j < 4; ++j) {
        const float a = random_float(seed + 8 * i + j, 65, 188);
        check_div_case<Math>(a, b, c);
        check_div_case<Math>(-a, b, c);
      }
      if (kTakesZero<Math>) check_div_case<Math>(0.0f, b, c);
    }
  }
  add_counts(out, c);
}

template <class Math>
__global__ void check_div_special(Counts* out) {
  Counts c{};
  const float v[] = {0.0f, -0.0f, 1.0f, -1.0f, 0x1p-62f, -0x1p-62f, 0x1.fffffep61f, 0x1p62f,
                     0x1.fffffep-63f, 1e-45f, 1e-40f, 3.4e38f, INFINITY, -INFINITY, NAN,
                     1e-8f, 3.0f, 7.0f, 0.1f};
  const int n = sizeof(v) / sizeof(v[0]);
  for (int i = threadIdx.x; i < n * n; i += blockDim.x)
    check_div_case<Math>(v[i / n], v[i % n], c);
  add_counts(out, c);
}

// adamw_direction's domain, restated. With zeros (per-element checks): v in [2^-101, 2^123)
// or +0, bc2_sqrt in [2^-62, 2^62) (positive), eps >= 2^-62, the denominator
// sqrt(v) / bc2_sqrt + eps below 2^62, m a dividend. Without zeros (running ranges, checked by
// all_ok()): v in [2^-101, 2^123) and at most RN((2^61 · bc2_sqrt)²), bc2_sqrt as above, eps in
// [2^-62, 2^60], |m| in [2^-62, 2^62) (so no NaN): update.cuh shows that this bounds the
// denominator below 2^62 by itself.
// `want`: the IEEE result (only meaningful inside).
__device__ bool adamw_domain(float m, float v, float c, float eps, bool zero, float& want) {
  const bool v_ok = (v >= 0x1p-101f && v < 0x1p123f) || (zero && __float_as_uint(v) == 0u);
  if (!v_ok || !(c >= 0x1p-62f && c < 0x1p62f) || !(eps >= 0x1p-62f) || !div_domain(m, zero))
    return false;
  const float d = __fadd_rn(__fdiv_rn(__fsqrt_rn(v), c), eps);
  want = __fdiv_rn(m, d);
  if (zero) return d < 0x1p62f;
  const float t = __fmul_rn(0x1p61f, c);
  return eps <= 0x1p60f && v <= __fmul_rn(t, t);
}

template <class Math>
__device__ void check_adamw_case(float m, float v, float c, float eps, Counts& counts) {
  Math math;
  const float got = math.adamw_direction(m, v, c, eps);
  float want = 0.0f;
  const bool in_domain = adamw_domain(m, v, c, eps, kTakesZero<Math>, want);
  counts.record(in_domain, math.all_ok(), __float_as_uint(got) == __float_as_uint(want));
}

// Random quadruples: exponents across each operand's domain and a few beyond (v's up to the
// infinities and NaN), one in 8 of each operand raw bits; with zeros, one in 16 m and v +0.
template <class Math>
__global__ void check_adamw_random(uint64_t count, uint64_t seed, Counts* out) {
  Counts counts{};
  for (uint64_t i = blockIdx.x * uint64_t(blockDim.x) + threadIdx.x; i < count;
       i += uint64_t(gridDim.x) * blockDim.x) {
    const uint64_t z = seed + 8 * i;
    const uint32_t pick = hash32(z + 7);
    float m = (pick & 7) == 0 ? __uint_as_float(hash32(z)) : random_float(z, 60, 193);
    float v = (pick & 56) == 0 ? __uint_as_float(hash32(z + 1))
                               : fabsf(random_float(z + 1, 20, 255)) * ((pick & 64) ? -1.0f : 1.0f);
    const float c = (pick & 448) == 0 ? __uint_as_float(hash32(z + 2))
                                      : fabsf(random_float(z + 2, 60, 130));
    const float eps = (pick & 3584) == 0 ? __uint_as_float(hash32(z + 3))
                                         : fabsf(random_float(z + 3, 55, 140));
    if (kTakesZero<Math> && ((pick >> 12) & 15) == 0) m = 0.0f;
    if (kTakesZero<Math> && ((pick >> 16) & 15) == 0) v = 0.0f;
    check_adamw_case<Math>(m, v, c, eps, counts);
  }
  add_counts(out, counts);
}

template <class Math>
__global__ void check_adamw_special(Counts* out) {
  Counts counts{};
  const float ms[] = {0.0f, -0.0f, 1.0f, -3e-5f, 0x1p-62f, 0x1.fffffep61f, 0x1p62f, INFINITY, NAN};
  const float vs[] = {0.0f, -0.0f, 0x1p-101f, 0x1.fffffep-102f, 1e-10f, 0x1.fffffep122f,
                      0x1p123f, 3.4e38f, INFINITY, -1.0f, NAN};
  const float cs[] = {1.0f, 0.0316f, 0x1p-62f, 0x1.fffffep61f, 0x1p62f, 0.0f, -0.5f};
  const float es[] = {1e-8f, 0x1p-62f, 0x1.fffffep-63f, 0.0f, 1e30f, INFINITY, NAN};
  const int nm = 9, nv = 11, nc = 7, ne = 7;
  for (int i = threadIdx.x; i < nm * nv * nc * ne; i += blockDim.x)
    check_adamw_case<Math>(ms[i % nm], vs[(i / nm) % nv], cs[(i / (nm * nv)) % nc],
                           es[i / (nm * nv * nc)], counts);
  add_counts(out, counts);
}

__global__ void check_bf16x2_all(Counts* out) {
  unsigned long long wrong = 0, checked = 0;
  for_every_bit_pattern([&](uint32_t bits) {
    const float lo = __uint_as_float(bits);
    if (lo != lo) return;
    // the high half sees every value too, paired with a different low one
    const float hi = __uint_as_float(bits ^ 0x80000001u);
    if (hi != hi) return;
    const uint32_t got = forge::cuda::bf16x2_nearest_nonnan(lo, hi);
    const uint32_t want = static_cast<uint32_t>(forge::bf16_nearest(lo)) |
                          (static_cast<uint32_t>(forge::bf16_nearest(hi)) << 16);
    ++checked;
    if (got != want) ++wrong;
  });
  add_counts(out, wrong, 0, 0, checked);
}

// Every non-NaN float in the low half, its negation in the high half (so the infinities too),
// each pair with random 32-bit draws (the functions take their low 16 bits) and with the
// extremes 0 and 0xFFFF.
__global__ void check_sr_nonnan_all(Counts* out) {
  unsigned long long wrong = 0, checked = 0;
  for_every_bit_pattern([&](uint32_t bits) {
    const float lo = __uint_as_float(bits);
    if (lo != lo) return;
    const float hi = -lo;
    const uint32_t draws[3][2] = {{hash32(bits), hash32(~static_cast<uint64_t>(bits))},
                                  {0u, 0xFFFFu},
                                  {0xFFFFu, 0u}};
    for (const auto& r : draws) {
      ++checked;
      const uint32_t want = static_cast<uint32_t>(forge::bf16_stochastic(lo, r[0])) |
                            (static_cast<uint32_t>(forge::bf16_stochastic(hi, r[1])) << 16);
      if (forge::cuda::bf16x2_stochastic_nonnan(lo, hi, r[0], r[1]) != want) ++wrong;
    }
  });
  add_counts(out, wrong, 0, 0, checked);
}

template <class Launch>
Counts run_counts(Launch launch) {
  Counts* d = nullptr;
  CUDA_OK(cudaMalloc(&d, sizeof(Counts)));
  CUDA_OK(cudaMemset(d, 0, sizeof(Counts)));
  launch(d);
  CUDA_OK(cudaGetLastError());
  Counts h{};
  CUDA_OK(cudaMemcpy(&h, d, sizeof(Counts), cudaMemcpyDeviceToHost));
  CUDA_OK(cudaFree(d));
  return h;
}

template <class Math>
void expect_sqrt_ieee_on_every_float_of_its_domain() {
  const Counts c = run_counts([](Counts* d) { check_sqrt_all<Math><<<1024, 256>>>(d); });
  // [2^-101, FLT_MAX]: exponents 26..254, every mantissa (and +0 with zeros)
  EXPECT_EQ(c.checked, ((254ull - 26 + 1) << 23) + (kTakesZero<Math> ? 1 : 0));
  EXPECT_EQ(c.wrong, 0u);
  EXPECT_EQ(c.declined, 0u);
  EXPECT_EQ(c.accepted, 0u);
}

template <class Math>
void expect_div_ieee_in_its_domain() {
  const uint64_t seed = (uint64_t(std::random_device{}()) << 32) | std::random_device{}();
  const Counts r = run_counts([&](Counts* d) { check_div_random<Math><<<1024, 256>>>(1ull << 30, seed, d); });
  EXPECT_GT(r.checked, 1ull << 28) << "seed " << seed;
  EXPECT_EQ(r.wrong, 0u) << "seed " << seed;
  EXPECT_EQ(r.declined, 0u) << "seed " << seed;
  EXPECT_EQ(r.accepted, 0u) << "seed " << seed;
  const Counts m = run_counts([&](Counts* d) { check_div_mantissas<Math><<<1024, 256>>>(seed, d); });
  EXPECT_EQ(m.checked, (1ull << 23) * 5 * (kTakesZero<Math> ? 9 : 8));
  EXPECT_EQ(m.wrong, 0u) << "seed " << seed;
  EXPECT_EQ(m.declined, 0u);
  const Counts s = run_counts([](Counts* d) { check_div_special<Math><<<1, 256>>>(d); });
  EXPECT_GT(s.checked, 0u);
  EXPECT_EQ(s.wrong, 0u);
  EXPECT_EQ(s.declined, 0u);
  EXPECT_EQ(s.accepted, 0u);
}

template <class Math>
void expect_adamw_direction_ieee_in_its_domain() {
  const uint64_t seed = (uint64_t(std::random_device{}()) << 32) | std::random_device{}();
  const Counts r = run_counts([&](Counts* d) { check_adamw_random<Math><<<1024, 256>>>(1ull << 28, seed, d); });
  EXPECT_GT(r.checked, 1ull << 25) << "seed " << seed;
  EXPECT_LT(r.checked, (1ull << 28) - (1ull << 24)) << "outside cases (to be declined) too";
  EXPECT_EQ(r.wrong, 0u) << "seed " << seed;
  EXPECT_EQ(r.declined, 0u) << "seed " << seed;
  EXPECT_EQ(r.accepted, 0u) << "seed " << seed;
  const Counts s = run_counts([](Counts* d) { check_adamw_special<Math><<<1, 256>>>(d); });
  EXPECT_GT(s.checked, 0u);
  EXPECT_EQ(s.wrong, 0u);
  EXPECT_EQ(s.declined, 0u);
  EXPECT_EQ(s.accepted, 0u);
}

TEST(FastMath, SqrtEqualsIeeeOnEveryFloatOfItsDomain) {
  FORGE_REQUIRE_GPU();
  expect_sqrt_ieee_on_every_float_of_its_domain<FastMath>();
}

TEST(FastMath, DivEqualsIeeeInItsDomain) {
  FORGE_REQUIRE_GPU();
  expect_div_ieee_in_its_domain<FastMath>();
}

// The element-wise kernels' variant: the same, and +0 (sqrt(+0), +0 / b) besides.
TEST(FastMathWithZeros, SqrtEqualsIeeeOnEveryFloatOfItsDomain) {
  FORGE_REQUIRE_GPU();
  expect_sqrt_ieee_on_every_float_of_its_domain<FastMathWithZeros>();
}

TEST(FastMathWithZeros, DivEqualsIeeeInItsDomain) {
  FORGE_REQUIRE_GPU();
  expect_div_ieee_in_its_domain<FastMathWithZeros>();
}

TEST(FastMath, AdamwDirectionEqualsIeeeInItsDomain) {
  FORGE_REQUIRE_GPU();
  expect_adamw_direction_ieee_in_its_domain<FastMath>();
}

TEST(FastMathWithZeros, AdamwDirectionEqualsIeeeInItsDomain) {
  FORGE_REQUIRE_GPU();
  expect_adamw_direction_ieee_in_its_domain<FastMathWithZeros>();
}

TEST(FastMath, Bf16x2EqualsFormatsOnEveryNonNanFloat) {
  FORGE_REQUIRE_GPU();
  const Counts c = run_counts([](Counts* d) { check_bf16x2_all<<<1024, 256>>>(d); });
  EXPECT_EQ(c.wrong, 0u);
  // 2^32 patterns minus the NaNs of either half (2 · (2^24 - 2) each, overlapping)
  EXPECT_GT(c.checked, (1ull << 32) - (1ull << 26));
}

TEST(FastMath, StochasticPairNonNanEqualsFormatsOnEveryNonNanFloat) {
  FORGE_REQUIRE_GPU();
  const Counts c = run_counts([](Counts* d) { check_sr_nonnan_all<<<1024, 256>>>(d); });
  EXPECT_EQ(c.wrong, 0u);
  EXPECT_EQ(c.checked, 3 * ((1ull << 32) - 2 * ((1ull << 23) - 1)));  // every non-NaN float, 3 draws
}

}  // namespace
}  // namespace fgt
