// apply.cuh — the rule application: forge::apply_rule (src/core/rules.h, the CPU backend's
// own code) over a batch of quads, with the skipping of elements that are not finite or not
// storable, and the whole update of a batch: loads, the rule, stores (update_quads, or
// update_loaded for operands already loaded). Specialized Specs first try the branch-free
// FastMath path and redo a batch it declines with the exact one, which gives the CPU's bits.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include "core/formats.h"
#include "core/rules.h"
#include "cuda/update/fast_math.cuh"
#include "cuda/update/operands.cuh"
#include "cuda/update/quads.cuh"
#include "cuda/update/spec.cuh"
#include "forge/forge.h"

namespace forge {
namespace cuda {

// ---- the rule over a batch of quads -------------------------------------------------------------
//
// Applies apply_rule() to every in-range element of kQ quads. Elements whose gradient is
// not finite are skipped (bit e of keep[q] set) and counted.
template <int kQ>
__device__ __forceinline__ void apply_quads(const RuleScalars& r, bool want_sq, const int (&n)[kQ],
                                            const float (&g)[kQ][kQuad],
                                            float (&w)[kQ][kQuad],
                                            float (&s)[FORGE_MAX_STATES][kQ][kQuad],
                                            unsigned (&keep)[kQ], StepTotals& totals) {
#pragma unroll
  for (int q = 0; q < kQ; ++q) {
    keep[q] = 0;
#pragma unroll
    for (int e = 0; e < kQuad; ++e) {
      if (e < n[q]) {
        float st[FORGE_MAX_STATES] = {s[0][q][e], s[1][q][e], s[2][q][e]};
        float w_new = w[q][e], g_used;
        if (apply_rule(r, g[q][e], w_new, st, g_used)) {
          w[q][e] = w_new;
#pragma unroll
          for (int i = 0; i < FORGE_MAX_STATES; ++i) s[i][q][e] = st[i];
          // NOTE: only when asked: the fp64 convert + multiply + add cost epilogue time.
          if (want_sq)
            totals.grad_sq_sum += static_cast<double>(g_used) * static_cast<double>(g_used);
        } else {
          keep[q] |= 1u << e;
          ++totals.nonfinite;
        }
      }
    }
  }
}

// The same update as apply_quads, branch-free through FastMath, into w_new / s_new. Returns
// false when that is not the reference result for some in-range element: a non-finite
// gradient, an operand outside FastMath's domain, or a result that is not storable (the weight
// or a state: NaN, infinite or above the largest bf16, formats.h; the fast path's state
// conversions take no NaN). The caller then runs apply_quads on the same inputs, which skips
// the element that is not storable exactly as the CPU does. `r` must have its rule as a
// compile-time constant.
template <int kQ, int kNumStates, class Math = FastMath>
__device__ __forceinline__ bool apply_quads_fast(const RuleScalars& r, const int (&n)[kQ],
                                                 const float (&g)[kQ][kQuad],
                                                 const float (&w)[kQ][kQuad],
                                                 const float (&s)[FORGE_MAX_STATES][kQ][kQuad],
                                                 float (&w_new)[kQ][kQuad],
                                                 float (&s_new)[FORGE_MAX_STATES][kQ][kQuad]) {
  Math math;
  // NOTE: one running sum of every result's magnitude instead of a storable() test per value:
  // it is at most the largest bf16 only if every term is (rounding is monotone, and each
  // partial sum of magnitudes is at least each of its terms), and NaN or an overflow to
  // infinity fails the comparison. A false alarm on large storable values only costs the
  // exact path. The magnitudes are free: |x| is an operand modifier of the add.
  float sum = 0.0f;
#pragma unroll
  for (int q = 0; q < kQ; ++q)
#pragma unroll
    for (int e = 0; e < kQuad; ++e) {
      float st[FORGE_MAX_STATES] = {s[0][q][e], s[1][q][e], s[2][q][e]};
      float wv = w[q][e], g_used;
      const Math before = math;
      apply_rule(r, g[q][e], wv, st, g_used, math);
      float out = fabsf(wv);
      // AdamW: adamw_direction declines unless its m and v, the new states, lie in its domain
      // (|m| < 2^62, v < 2^123: storable).
      if (r.rule != FORGE_RULE_ADAMW) {
#pragma unroll
        for (int i = 0; i < kNumStates; ++i) out = out + fabsf(st[i]);
      }
      if (e < n[q]) {
        sum = sum + out;
      } else {
        math = before;  // out of range: computed on zeros, never stored
      }
      w_new[q][e] = wv;
#pragma unroll
      for (int i = 0; i < FORGE_MAX_STATES; ++i) s_new[i][q][e] = st[i];
    }
  math.require(sum <= kBf16Max);
  return math.all_ok();
}

// NOTE: apply_rule() switches on k.rule and, for RMSprop, indexes the state array with the
// run-time slots k.slot_grad_avg / k.slot_momentum. Called as is, that dynamic index sends
// the per-element state array to local memory for every rule. Here each branch hands it a
// copy of k whose rule (and RMSprop slots) are compile-time constants, so the switch folds
// away, the states stay in registers, and the rule is dispatched once per batch instead of
// once per element. The arithmetic is apply_rule's own, unchanged.
#define FORGE_RULE_BRANCH(R, CENTERED, SLOT_GA, SLOT_MOM)   \
  {                                                         \
    RuleScalars r = k;                                      \
    r.rule = R;                                             \
    if ((R) == FORGE_RULE_RMSPROP) {                        \
      r.centered = CENTERED;                                \
      r.slot_grad_avg = SLOT_GA;                            \
      r.slot_momentum = SLOT_MOM;                           \
    }                                                       \
    apply_quads<kQ>(r, want_sq, n, g, w, s, keep, totals);  \
    return;                                                 \
  }

template <int kQ, class Spec>
__device__ __forceinline__ void apply_quads_resolved(const RuleScalars& k, bool want_sq,
                                                     const int (&n)[kQ],
                                                     const float (&g)[kQ][kQuad],
                                                     float (&w)[kQ][kQuad],
                                                     float (&s)[FORGE_MAX_STATES][kQ][kQuad],
                                                     unsigned (&keep)[kQ], StepTotals& totals) {
  if constexpr (!Spec::kGeneric) {
    // The host checked spec_matches(): rule == Spec::kRule, maximize == 0, wd_coupled == 0.
    // As constants they fold apply_rule's switch and its two run-time branches.
    RuleScalars r = k;
    r.rule = Spec::kRule;
    r.maximize = 0;
    r.wd_coupled = 0.0f;
    apply_quads<kQ>(r, want_sq, n, g, w, s, keep, totals);
    return;
  }
  switch (k.rule) {
    case FORGE_RULE_SGD: FORGE_RULE_BRANCH(FORGE_RULE_SGD, 0, -1, -1)
    case FORGE_RULE_SGD_MOMENTUM: FORGE_RULE_BRANCH(FORGE_RULE_SGD_MOMENTUM, 0, -1, -1)
    case FORGE_RULE_ADAMW: FORGE_RULE_BRANCH(FORGE_RULE_ADAMW, 0, -1, -1)
    case FORGE_RULE_NADAM: FORGE_RULE_BRANCH(FORGE_RULE_NADAM, 0, -1, -1)
    case FORGE_RULE_RADAM: FORGE_RULE_BRANCH(FORGE_RULE_RADAM, 0, -1, -1)
    case FORGE_RULE_LION: FORGE_RULE_BRANCH(FORGE_RULE_LION, 0, -1, -1)
    case FORGE_RULE_ADAGRAD: FORGE_RULE_BRANCH(FORGE_RULE_ADAGRAD, 0, -1, -1)
    case FORGE_RULE_MUON: FORGE_RULE_BRANCH(FORGE_RULE_MUON, 0, -1, -1)
    case FORGE_RULE_RMSPROP:
      // Slots as make_rule_scalars() assigns them: square_avg 0, then grad_avg (centered),
      // then momentum_buffer (momentum > 0).
      if (k.centered) {
        if (k.slot_momentum >= 0) FORGE_RULE_BRANCH(FORGE_RULE_RMSPROP, 1, 1, 2)
        FORGE_RULE_BRANCH(FORGE_RULE_RMSPROP, 1, 1, -1)
      }
      if (k.slot_momentum >= 0) FORGE_RULE_BRANCH(FORGE_RULE_RMSPROP, 0, -1, 1)
      FORGE_RULE_BRANCH(FORGE_RULE_RMSPROP, 0, -1, -1)
    default:
      // Unreachable (the C API validates the rule). Not apply_quads(k, ...): its run-time
      // RMSprop slots would put the state array of every branch in local memory.
#pragma unroll
      for (int q = 0; q < kQ; ++q) keep[q] = (1u << kQuad) - 1u;
  }
}
#undef FORGE_RULE_BRANCH

// ---- the update of a batch of loaded quads ------------------------------------------------------
//
// The rule and the stores for kQ quads whose weight w and states s are already loaded (fp32);
// update_quads' other arguments. Specialized kernels first try the branch-free FastMath path
// and fall back to the exact one for the whole batch when it declines.
// kAligned: every quad's idx % 4 == 0, in range or not (stochastic rounding then hashes once
// per stream and quad even where vec is a run-time value: QuadDraws).
// kPaired: the quads lie in their blocks as QuadBlocks<true, kQ> says (block states only;
// update_tile's pipelined passes); otherwise in the classic layout.
template <int kQ, class Spec, class Math = FastMath, bool kAligned = false, bool kPaired = false>
__device__ __forceinline__ void update_loaded(const RuleScalars& k, const ParamView& p,
                                              const int64_t (&row)[kQ], const int64_t (&col)[kQ],
                                              const int64_t (&idx)[kQ], const int (&n)[kQ],
                                              const bool (&vec)[kQ], int lane16, bool want_sq,
                                              const float (&g)[kQ][kQuad], float (&w)[kQ][kQuad],
                                              float (&s)[FORGE_MAX_STATES][kQ][kQuad],
                                              StepTotals& totals) {
  static_assert(!kPaired || (!Spec::kGeneric && is_block_format(Spec::kStateFormat)),
                "the paired layout is for specialized block states");
  unsigned keep[kQ];  // bit e of keep[q]: element e of quad q was skipped
  if constexpr (!Spec::kGeneric) {
    RuleScalars r = k;
    r.rule = Spec::kRule;
    r.maximize = 0;
    r.wd_coupled = 0.0f;
    float w_new[kQ][kQuad], s_new[FORGE_MAX_STATES][kQ][kQuad];
    const bool fast = apply_quads_fast<kQ, Spec::kNumStates, Math>(r, n, g, w, s, w_new, s_new);
    if (fast && want_sq) {
      // NOTE: a separate uniform branch, not per-element predication: the fp64 work is
      // skipped entirely when nobody asked for it. Same additions, same order as
      // apply_quads.
#pragma unroll
      for (int q = 0; q < kQ; ++q)
#pragma unroll
        for (int e = 0; e < kQuad; ++e)
          if (e < n[q]) {
            const double gd = static_cast<double>(g[q][e] * r.grad_scale);
            totals.grad_sq_sum += gd * gd;
          }
    }
    // NOTE: block states: one store path for both outcomes, so the encoder's code is there
    // once (a second copy doubles the hot loop).
    // Other formats: a dedicated store path with no skip masks and hardware bf16 rounding.
    // NOTE: the exact path works on copies of the inputs in w_new / s_new, so the fast path
    // stores its results where they are (not moved into w / s every pass).
    if constexpr (is_block_format(Spec::kStateFormat)) {
      if (fast) {
#pragma unroll
        for (int q = 0; q < kQ; ++q) keep[q] = 0;
      } else {
#pragma unroll
        for (int q = 0; q < kQ; ++q)
#pragma unroll
          for (int e = 0; e < kQuad; ++e) {
            w_new[q][e] = w[q][e];
#pragma unroll
            for (int i = 0; i < FORGE_MAX_STATES; ++i) s_new[i][q][e] = s[i][q][e];
          }
        apply_quads_resolved<kQ, Spec>(k, want_sq, n, g, w_new, s_new, keep, totals);
      }
      store_quads<kQ, Spec, false, kAligned, kPaired>(k, p, row, col, idx, n, vec, keep, lane16,
                                                      w_new, s_new);
      return;
    } else {
      if (fast) {
        const unsigned none[kQ] = {};
        store_quads<kQ, Spec, true, kAligned>(k, p, row, col, idx, n, vec, none, lane16, w_new,
                                              s_new);
        return;
      }
    }
  }
  apply_quads_resolved<kQ, Spec>(k, want_sq, n, g, w, s, keep, totals);
  store_quads<kQ, Spec, false, kAligned>(k, p, row, col, idx, n, vec, keep, lane16, w, s);
}

// ---- the update of a batch of quads -------------------------------------------------------------
//
// Quad q: row row[q], columns [col[q], col[q] + n[q]) with n[q] in 0..4 (0: nothing of this
// lane is in range, but the lane still takes part in the int8 shuffles); col[q] % 4 == 0 and
// (col[q] % 64) / 4 == lane16, the lane's index in its half-warp; idx[q] = row[q] * p.cols +
// col[q] (the caller computes it, usually by stepping a per-thread offset). g[q][e] is the
// fp32 gradient of column col[q] + e. Every lane of the warp must call this with the same
// k, p.
//
// Spec: the compile-time configuration (GenericSpec: everything from k and p at run time).
// kFull: every quad is whole (n[q] == 4) and p.vec4 != 0, so every access is one vector and
// the per-element range checks disappear (interior tiles). Math: the specialized path's
// branch-free arithmetic (FastMath, or FastMathWithZeros).
//
// NOTE: kQ > 1 batches the quads phase by phase (all loads, then the rule, then all stores)
// so kQ quads' worth of loads are in flight at once: the fused epilogue is latency-bound
// otherwise (one quad is only ~24 B of loads per thread). The compiler cannot reorder the
// loads of one quad past the stores of another by itself (same arrays, run-time indices).
template <int kQ, class Spec = GenericSpec, bool kFull = false, class Math = FastMath>
__device__ __forceinline__ void update_quads(const RuleScalars& k, const ParamView& p,
                                             const int64_t (&row)[kQ], const int64_t (&col)[kQ],
                                             const int64_t (&idx)[kQ], const int (&n_in)[kQ],
                                             int lane16, bool want_sq,
                                             const float (&g)[kQ][kQuad], StepTotals& totals) {
  constexpr int kSF = Spec::kStateFormat;
  const int weight_format = Spec::kGeneric ? p.weight_format : Spec::kWeightFormat;
  const int num_states = Spec::kGeneric ? k.num_states : Spec::kNumStates;
  int n[kQ];
  bool vec[kQ];
  float w[kQ][kQuad];
  float s[FORGE_MAX_STATES][kQ][kQuad];
#pragma unroll
  for (int q = 0; q < kQ; ++q) {
    n[q] = kFull ? kQuad : n_in[q];
    vec[q] = kFull || (n[q] == kQuad && p.vec4 != 0);
    switch (weight_format) {
      case FORGE_WEIGHT_FP32:
        load_quad_f32(static_cast<const float*>(p.weight), idx[q], n[q], vec[q], w[q]);
        break;
      case FORGE_WEIGHT_BF16_MASTER:
        load_quad_f32(p.master, idx[q], n[q], vec[q], w[q]);
        break;
      default:
        load_quad_bf16(static_cast<const uint16_t*>(p.weight), idx[q], n[q], vec[q], w[q]);
    }
  }
#pragma unroll
  for (int i = 0; i < FORGE_MAX_STATES; ++i) {
    const bool is_signed =
        Spec::kGeneric ? k.state_signed[i] != 0 : spec_state_signed(Spec::kRule, i);
#pragma unroll
    for (int q = 0; q < kQ; ++q) {
      if (i < num_states) {
        load_state_quad<kSF>(p, i, is_signed, row[q], col[q], idx[q], n[q], vec[q], s[i][q]);
      } else {
#pragma unroll
        for (int e = 0; e < kQuad; ++e) s[i][q][e] = 0.0f;
      }
    }
  }

  update_loaded<kQ, Spec, Math>(k, p, row, col, idx, n, vec, lane16, want_sq, g, w, s, totals);
}

}  // namespace cuda
}  // namespace forge
