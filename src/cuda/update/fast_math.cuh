// fast_math.cuh — the update's arithmetic and rounding fast paths, bit for bit the reference:
// FastMath (IEEE division and square root without nvcc's slow-path branch, on domains where
// they provably equal IEEE), the bf16 pair conversions of values known not to be NaN, and
// QuadDraws (a quad's stochastic-rounding bits, rng.h's, hashed once per group and stream).
// tests/cpp/gpu/test_gpu_fast_math.cu checks them against IEEE and rng.h on the device.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include "core/rng.h"
#include "cuda/ptx.cuh"

namespace forge {
namespace cuda {

// ---- branch-free fast paths that return the reference bits --------------------------------------
//
// NOTE: nvcc compiles an IEEE division or square root to a fast path plus a range check that
// branches to an out-of-line slow path. Each of those branches ends a basic block, so the
// ~8 independent elements a thread updates could not be interleaved: the epilogue would run
// one element's dependent chain at a time.
// FastMath runs the same fast-path instructions without the branch, over a domain where they
// provably give the IEEE result, and records whether every operand was in that domain; the
// caller redoes the whole batch with IeeeMath when one was not (rare: see the domains).
// tests/cpp/gpu/test_gpu_fast_math.cu compares both against IEEE on the device.

// |x| in [2^-62, 2^62): normal, far from overflow and underflow (NaN fails both compares).
__device__ __forceinline__ bool fast_div_operand(float x) {
  const float a = fabsf(x);
  return a >= 0x1p-62f && a < 0x1p62f;
}

// kTakesZero: +0 is added to the domain (FastMathWithZeros, below), where an exact zero is
// common: an all-zero gradient row leaves AdamW's m and v at exactly +0 (an embedding's
// unseen tokens: most of its rows on every step), and without it 0 / x and sqrt(0) send the
// whole batch down the exact path. Each addition is an identity on FastMath's own domain (see
// each), so both give IEEE's results on their domains. The element-wise kernels take zeros;
// the fused epilogues keep FastMath (zeros are rare there, and each instruction counts).
template <bool kTakesZero>
struct FastMathT {
  static constexpr bool kDeferFiniteCheck = true;
  bool ok = true;
  __device__ __forceinline__ void require(bool c) { ok = ok & c; }
  // Whether a is a dividend div_unchecked takes: fast_div_operand, or +0 with zeros.
  static __device__ __forceinline__ bool dividend_ok(float a) {
    return kTakesZero ? fast_div_operand(a) | (__float_as_uint(a) == 0u) : fast_div_operand(a);
  }
  // The instruction sequence nvcc emits for div.rn.f32 before its FCHK branch (reciprocal
  // estimate, one Newton step, quotient, residual, correction). Exactly a / b when
  // dividend_ok(a) and fast_div_operand(b), where FCHK takes this path; the caller checks.
  // With zeros, a == +0 too: q = +0 · y is a zero with b's sign (y = 1/b's estimate has it),
  // r = -b·q + a = -0 + +0 = +0, and y·r + q keeps q: +0 / b exactly. -0 is still declined
  // (the last fma would return +0 where IEEE gives a zero of the other sign).
  // NOTE: with zeros q is a product, not fma(a, y, 0): on FastMath's domain the product is a
  // nonzero normal (|a|, |y| >= 2^-62), where the two round the same; at a == +0 only the
  // product keeps b's sign.
  static __device__ __forceinline__ float div_unchecked(float a, float b) {
    float y = rcp_approx_ftz(b);
    const float e = __fmaf_rn(-b, y, 1.0f);
    y = __fmaf_rn(y, e, y);
    const float q = kTakesZero ? __fmul_rn(a, y) : __fmaf_rn(a, y, 0.0f);
    const float r = __fmaf_rn(-b, q, a);
    return __fmaf_rn(y, r, q);
  }
  // The sequence nvcc emits for sqrt.rn.f32 on its fast path: exactly sqrt(x) under nvcc's
  // own condition for it, x a positive normal float >= 2^-101 (bits in [0x0D000000,
  // 0x7F7FFFFF]); the caller checks. With zeros, x == +0 too: the estimate is taken of
  // max(x, 2^-101) (= x on the domain above), so it is finite; then s = +0, r = +0 and the
  // result is +0 = sqrt(+0).
  static __device__ __forceinline__ float sqrt_unchecked(float x) {
    const float y = rsqrt_approx_ftz(kTakesZero ? fmaxf(x, 0x1p-101f) : x);
    const float s = __fmul_rn(x, y);
    const float h = __fmul_rn(y, 0.5f);
    const float r = __fmaf_rn(-s, s, x);
    return __fmaf_rn(r, h, s);
  }
  __device__ __forceinline__ float div(float a, float b) {
    require(dividend_ok(a) & fast_div_operand(b));
    return div_unchecked(a, b);
  }
  __device__ __forceinline__ float sqrt(float x) {
    const uint32_t u = __float_as_uint(x);
    require((u + 0xF3000000u <= 0x727FFFFFu) | (kTakesZero && u == 0u));
    return sqrt_unchecked(x);
  }
  // AdamW's step direction m / (sqrt(v) / bc2_sqrt + eps) (IeeeMath::adamw_direction), with
  // fewer checks than div(m, div(sqrt(v), bc2_sqrt) + eps) would make, each implied:
  //  - v in [2^-101, 2^123) (or +0 with zeros; bits [0x0D000000, 0x7CFFFFFF]): sqrt's own
  //    domain, narrowed at the top so that s = sqrt(v) in [2^-50.5, 2^61.5) (or +0) is a
  //    dividend div_unchecked takes: s needs no check of its own;
  //  - bc2_sqrt a positive divisor, in [2^-62, 2^62) (the same value for every element: the
  //    compiler shares the check);
  //  - eps >= 2^-62 (uniform too), so d = s / bc2_sqrt + eps >= eps (s / bc2_sqrt >= +0 and
  //    rounding is monotone) needs only its upper bound checked. (A negative bc2_sqrt, never
  //    passed, would let d cancel to below 2^-62: the device test found one such case.)
  //  - m a dividend.
  // A non-finite v (NaN or infinity: bits above 0x7F7FFFFF) is outside, so AdamW's v, and
  // with it g (v = β2·v + (1 − β2)·g² is not finite when g is not), need no finite test
  // (rules.h's apply_rule), and apply_quads_fast takes both new states as finite.
  //
  // Without zeros (the fused epilogues) the per-element checks become running ranges, checked
  // once per batch by all_ok(): the bits of v (unsigned min and max), |m| (NaN-propagating
  // min and max: a NaN fails the check), and d's bound folded into v's upper one:
  //  - v <= V = RN((2^61 · bc2_sqrt)²) and eps <= 2^60 give d < 2^62: s <= 2^61·bc2_sqrt·
  //    (1 + 2^-23), s / bc2_sqrt rounds to at most 2^61·(1 + 2^-22), and adding eps <= 2^60
  //    stays below 1.5·2^61 + ulp, under 2^62. (V overflows to infinity for bc2_sqrt > 4;
  //    the 2^123 bound then governs.)
  // So the domain is v in [2^-101, min(2^123, V)] (bits), |m| in [2^-62, 2^62), bc2_sqrt in
  // [2^-62, 2^62), eps in [2^-62, 2^60]: inside d's old bound, so every accepted element gets
  // the IEEE result. tests/cpp/gpu/test_gpu_fast_math.cu restates that domain.
  // NOTE: running ranges: per element two integer and two float min/max instead of ~7
  // compares and predicate merges, for the epilogues nearest to issue-bound (SR, int8).
  uint32_t v_lo = 0xFFFFFFFFu, v_hi = 0u;  // bits of v, without zeros
  float m_lo = INFINITY, m_hi = 0.0f;     // |m|, NaN-propagating, without zeros
  uint32_t v_top = 0x7CFFFFFFu;           // v's upper bound (bits), set from bc2_sqrt
  __device__ __forceinline__ float adamw_direction(float m, float v, float bc2_sqrt,
                                                   float eps) {
    const uint32_t u = __float_as_uint(v);
    require((bc2_sqrt >= 0x1p-62f) & (bc2_sqrt < 0x1p62f) & (eps >= 0x1p-62f));
    if constexpr (kTakesZero) {
      require((u + 0xF3000000u <= 0x6FFFFFFFu) | (u == 0u));
      const float d = div_unchecked(sqrt_unchecked(v), bc2_sqrt) + eps;
      require((d < 0x1p62f) & dividend_ok(m));
      return div_unchecked(m, d);
    } else {
      require(eps <= 0x1p60f);
      const float t = __fmul_rn(0x1p61f, bc2_sqrt);
      v_top = min(v_top, __float_as_uint(__fmul_rn(t, t)));
      v_lo = min(v_lo, u);
      v_hi = max(v_hi, u);
      m_lo = min_nan(m_lo, fabsf(m));
      m_hi = max_nan(m_hi, fabsf(m));
      const float d = div_unchecked(sqrt_unchecked(v), bc2_sqrt) + eps;
      return div_unchecked(m, d);
    }
  }
  // Every check so far passed (the running ranges included).
  __device__ __forceinline__ bool all_ok() const {
    if constexpr (kTakesZero) {
      return ok;
    } else {
      // The empty ranges' initial values pass (no adamw_direction call: nothing to check).
      return ok & (v_lo >= 0x0D000000u) & (v_hi <= v_top) & (m_lo >= 0x1p-62f) &
             (m_hi < 0x1p62f);
    }
  }
};
using FastMath = FastMathT<false>;
using FastMathWithZeros = FastMathT<true>;

// ---- bf16 pairs of values known not to be NaN ---------------------------------------------------

// == bf16_nearest(lo) | bf16_nearest(hi) << 16 for non-NaN lo, hi: cvt.rn.bf16x2.f32 rounds
// to nearest even exactly as formats.h does (overflow to infinity included), in one
// instruction for two elements instead of ~12 per element. NaN inputs would come back as the
// canonical NaN where formats.h keeps sign and payload: callers store no NaN it converts
// (the fast epilogue path's values were checked finite; a step's weights: store_quads).
__device__ __forceinline__ uint32_t bf16x2_nearest_nonnan(float lo, float hi) {
  return cvt_rn_bf16x2(hi, lo);
}

// formats.h's bf16_stochastic of two values known not to be NaN, as one bf16x2 word (lo in the
// low half): the same bits without its infinity/NaN test (an infinity plus at most 0xFFFF
// stays that infinity; NaN is the only input whose sum could carry out of the exponent).
// NOTE: one byte permute picks the upper halves of both sums, where the compiler built the
// word from two separate results with a mask and a shifted add (one more instruction a pair).
__device__ __forceinline__ uint32_t bf16x2_stochastic_nonnan(float lo, float hi,
                                                              uint32_t random16_lo,
                                                              uint32_t random16_hi) {
  return __byte_perm(__float_as_uint(lo) + (random16_lo & 0xFFFFu),
                     __float_as_uint(hi) + (random16_hi & 0xFFFFu), 0x7632);
}

// ---- stochastic rounding ------------------------------------------------------------------------

// The stochastic-rounding bits of a quad: bits(e, stream) == rng_bits(key, idx + e, stream),
// idx the quad's first element's index (ParamView::sr_index: its index in the full parameter
// when the parameter is a shard of one).
// `aligned`: idx % 4 == 0, so the quad is one rng.h group (every vector quad: ParamView::vec4
// needs cols % 4 == 0, quads start at col % 4 == 0, and a shard whose indices would break that
// gets no vector access: make_param_view): one rng_group_hash per stream, made here (a stream
// the step never reads is dead code). An unaligned quad straddles two groups: bits() hashes
// per element and stream.
struct QuadDraws {
  uint64_t key;
  int64_t idx;
  bool aligned;
  uint64_t group[kRngStreams];
  // `needed`: whether the step rounds anything stochastically (a constant for a specialized
  // Spec; without it, no hash at all).
  __device__ __forceinline__ QuadDraws(uint64_t key_, int64_t idx_, bool aligned_, bool needed)
      : QuadDraws(key_, idx_, aligned_, needed, counter(key_, idx_)) {}
  // The hash input of stream 0 of the group holding element idx_: key + (group · 4) ·
  // kRngIndexMul; stream s adds s · kRngIndexMul (rng.h allows the stepping). For two aligned
  // quads, counter(key, b) = counter(key, a) + (b - a) · kRngIndexMul.
  __device__ __forceinline__ static uint64_t counter(uint64_t key_, int64_t idx_) {
    return key_ + (static_cast<uint64_t>(idx_) >> 2) * (kRngStreams * kRngIndexMul);
  }
  // With the counter already made (`z` = counter(key_, idx_)).
  __device__ __forceinline__ QuadDraws(uint64_t key_, int64_t idx_, bool aligned_, bool needed,
                                       uint64_t z)
      : key(key_), idx(idx_), aligned(aligned_) {
    if (!needed) return;  // group[] unset: bits() is never called
    // NOTE: made here, not where bits() is called: computed at the stores, the hashes are
    // scheduled early and spill.
#pragma unroll
    for (int stream = 0; stream < kRngStreams; ++stream, z += kRngIndexMul) group[stream] = sr_mix(z);
  }
  __device__ __forceinline__ uint32_t bits(int e, int stream) const {
    if (aligned) return static_cast<uint32_t>(group[stream] >> (16 * e)) & 0xFFFFu;
    return rng_bits(key, static_cast<uint64_t>(idx + e), stream);
  }
};

}  // namespace cuda
}  // namespace forge
