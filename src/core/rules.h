// rules.h — the eight update rules, element by element: the single source of truth
// for every backend.
//
// Semantics are torch.optim's, operation for operation (Lion: the paper's sign
// update with decoupled decay). All step-dependent scalars (bias corrections,
// NAdam's mu products, RAdam's rectification, Adagrad's decayed lr) are computed
// once per call on the host, in double, by make_rule_scalars() (hparams.cpp);
// the element code below only multiplies, adds, divides and takes square roots
// in fp32, so it gives the same bits on the CPU and the GPU (built without FMA
// contraction).
#pragma once

#include "forge/forge.h"
#include "formats.h"
#include "rng.h"

namespace forge {

struct RuleScalars {
  int32_t rule;          // forge_rule
  int32_t num_states;
  int32_t maximize, nesterov, centered, rect_on;
  int32_t state_signed[FORGE_MAX_STATES];  // int8 map per state
  // RMSprop state slots (-1 = unused)
  int32_t slot_grad_avg, slot_momentum;
  float grad_scale;
  float wd_coupled;      // g += wd_coupled * w   (0 when decoupled or no decay)
  float decay;           // w *= decay            (1 - lr * wd when decoupled, else 1)
  float neg_lr;          // -lr (SGD, SGD-momentum, RMSprop, Lion); -clr for Adagrad
  float lr;              // RAdam
  float beta1, one_minus_beta1, beta2, one_minus_beta2, eps;
  float neg_step_size;   // AdamW: -lr / bc1
  float bc2_sqrt;        // AdamW: sqrt(1 - beta2^t); RAdam: the same
  float bc2;             // NAdam: 1 - beta2^t
  float bc1;             // RAdam: 1 - beta1^t
  float nadam_coef_grad, nadam_coef_avg;  // NAdam: -lr (1 - mu) / (1 - Πmu), -lr mu' / (1 - Πmu')
  float rect;            // RAdam
  float alpha, one_minus_alpha;           // RMSprop
  float momentum;        // RMSprop, SGD-momentum (nesterov term); Muon: the nesterov lerp weight
  float buf_keep, buf_take;  // SGD-momentum: buf = buf * buf_keep + g * buf_take;
                             // Muon: buf_take = 1 - momentum, the momentum's lerp weight
  float take_rest, momentum_rest;  // Muon: 1 - buf_take and 1 - momentum, rounded in fp32
  uint64_t sr_key;       // rng_key(seed, step): stochastic rounding's draws this step
};

// The two operations of the rules that are not a single instruction everywhere, correctly
// rounded (IEEE 754): the rules call them through a Math policy so a backend can supply a
// faster implementation that returns the same bits. IeeeMath is the definition; the CUDA
// epilogue's FastMath (src/cuda/update.cuh) computes the same results branch-free where it
// can prove them equal and otherwise reports that the element must be recomputed with
// IeeeMath.
struct IeeeMath {
  // false: apply_rule returns at once on a non-finite gradient. true: it only reports it
  // through require() and computes on (a batch-wise caller then redoes the batch).
  static constexpr bool kDeferFiniteCheck = false;
  FORGE_HD float div(float a, float b) { return a / b; }
  FORGE_HD float sqrt(float x) { return sqrtf(x); }
  // AdamW's step direction, each operation rounded: m / (sqrt(v) / bc2_sqrt + eps). One
  // call so that a faster Math can drop the checks the operands' relations make redundant.
  FORGE_HD float adamw_direction(float m, float v, float bc2_sqrt, float eps) {
    return m / (sqrtf(v) / bc2_sqrt + eps);
  }
  FORGE_HD void require(bool) {}
};

// torch.lerp(a, b, w) with a scalar weight, as ATen computes it in fp32: from a when |w| < 0.5,
// else from b (w_rest = 1 - w, rounded in fp32 as torch rounds it).
FORGE_HD float torch_lerp(float a, float b, float w, float w_rest) {
  return (w < 0.5f && w > -0.5f) ? a + w * (b - a) : b - (b - a) * w_rest;
}

// Whether an element's new weight and states may be stored (formats.h, storable). A deferring
// Math computes on regardless: its batch-wise caller checks every result itself
// (update.cuh, apply_quads_fast) and redoes the batch with IeeeMath, which returns here.
template <class Math>
FORGE_HD bool results_storable(bool ok) {
  if constexpr (Math::kDeferFiniteCheck) {
    return true;
  } else {
    return ok;
  }
}

// Applies one step to one element. `g` is the raw gradient element (dW), `w`
// the fp32 weight, `s` the fp32 states. Returns false, touching nothing, when the
// gradient (after grad_scale) is not finite, or when the new weight or a new state would not
// be storable (NaN, infinite, or above the largest bf16: a finite gradient whose g² or
// update overflows): the element is then skipped exactly like a non-finite gradient.
// `g_out` receives the scaled gradient (for the sum of squares).
template <class Math>
FORGE_HD bool apply_rule(const RuleScalars& k, float g, float& w, float* s, float& g_out,
                         Math& math) {
  g = g * k.grad_scale;
  g_out = g;
  if constexpr (Math::kDeferFiniteCheck) {
    // NOTE: not for AdamW: a deferring Math's adamw_direction declines a non-finite v, and
    // v = β2·v + (1 − β2)·g² is not finite when g (after maximize and coupled decay) is not,
    // nor is that g when the scaled one is not.
    if (k.rule != FORGE_RULE_ADAMW) math.require(is_finite(g));
  } else {
    if (!is_finite(g)) return false;
  }
  if (k.maximize) g = -g;
  if (k.wd_coupled != 0.0f) g = g + k.wd_coupled * w;  // torch: grad.add(param, alpha=wd)
  float wn = w * k.decay;                             // torch: param.mul_(1 - lr * wd)
  // Each case computes the new values, checks them (one comparison each), then stores them.
  switch (k.rule) {
    case FORGE_RULE_SGD:
      wn = wn + k.neg_lr * g;
      if (!results_storable<Math>(storable(wn))) return false;
      break;
    case FORGE_RULE_SGD_MOMENTUM: {
      const float buf = s[0] * k.buf_keep + g * k.buf_take;
      const float d = k.nesterov ? g + k.momentum * buf : buf;
      wn = wn + k.neg_lr * d;
      if (!results_storable<Math>(storable(wn) & storable(buf))) return false;
      s[0] = buf;
      break;
    }
    case FORGE_RULE_ADAMW: {
      const float m = s[0] + k.one_minus_beta1 * (g - s[0]);  // torch: lerp_(grad, 1 - beta1)
      const float v = s[1] * k.beta2 + k.one_minus_beta2 * (g * g);
      // NOTE: update.cuh's fast path takes m and v as proven finite by adamw_direction's
      // checks: keep them its operands.
      wn = wn + k.neg_step_size * math.adamw_direction(m, v, k.bc2_sqrt, k.eps);
      if (!results_storable<Math>(storable(wn) & storable(m) & storable(v))) return false;
      s[0] = m;
      s[1] = v;
      break;
    }
    case FORGE_RULE_NADAM: {
      const float m = s[0] + k.one_minus_beta1 * (g - s[0]);
      const float v = s[1] * k.beta2 + k.one_minus_beta2 * (g * g);
      const float denom = math.sqrt(math.div(v, k.bc2)) + k.eps;
      wn = wn + k.nadam_coef_grad * math.div(g, denom);
      wn = wn + k.nadam_coef_avg * math.div(m, denom);
      if (!results_storable<Math>(storable(wn) & storable(m) & storable(v))) return false;
      s[0] = m;
      s[1] = v;
      break;
    }
    case FORGE_RULE_RADAM: {
      const float m = s[0] + k.one_minus_beta1 * (g - s[0]);
      const float v = s[1] * k.beta2 + k.one_minus_beta2 * (g * g);
      const float m_hat = math.div(m, k.bc1);
      if (k.rect_on) {
        const float adaptive_lr = math.div(k.bc2_sqrt, math.sqrt(v) + k.eps);
        wn = wn - m_hat * k.lr * adaptive_lr * k.rect;
      } else {
        wn = wn - m_hat * k.lr;
      }
      if (!results_storable<Math>(storable(wn) & storable(m) & storable(v))) return false;
      s[0] = m;
      s[1] = v;
      break;
    }
    case FORGE_RULE_LION: {
      const float c = s[0] * k.beta1 + g * k.one_minus_beta1;
      const float sign = c > 0.0f ? 1.0f : (c < 0.0f ? -1.0f : 0.0f);
      wn = wn + k.neg_lr * sign;
      const float m = s[0] * k.beta2 + g * k.one_minus_beta2;
      if (!results_storable<Math>(storable(wn) & storable(m))) return false;
      s[0] = m;
      break;
    }
    case FORGE_RULE_RMSPROP: {
      const float sq = s[0] * k.alpha + k.one_minus_alpha * (g * g);
      bool ok = storable(sq);
      float avg, ga = 0.0f, buf = 0.0f;
      if (k.centered) {
        ga = s[k.slot_grad_avg] + k.one_minus_alpha * (g - s[k.slot_grad_avg]);
        avg = math.sqrt(sq + -1.0f * (ga * ga));  // torch: square_avg.addcmul(ga, ga, value=-1)
        ok = ok & storable(ga);
      } else {
        avg = math.sqrt(sq);
      }
      avg = avg + k.eps;
      if (k.slot_momentum >= 0) {
        buf = s[k.slot_momentum] * k.momentum + math.div(g, avg);
        wn = wn + k.neg_lr * buf;
        ok = ok & storable(buf);
      } else {
        wn = wn + k.neg_lr * math.div(g, avg);
      }
      if (!results_storable<Math>(ok & storable(wn))) return false;
      s[0] = sq;
      if (k.centered) s[k.slot_grad_avg] = ga;
      if (k.slot_momentum >= 0) s[k.slot_momentum] = buf;
      break;
    }
    case FORGE_RULE_MUON: {
      // torch.optim.Muon: buf.lerp_(grad, 1 - momentum); u = grad.lerp(buf, momentum) with
      // nesterov, else buf. The weight slot receives u (make_rule_scalars: decay 1, no
      // coupled decay, so its old value reaches nothing).
      const float buf = torch_lerp(s[0], g, k.buf_take, k.take_rest);
      wn = k.nesterov ? torch_lerp(g, buf, k.momentum, k.momentum_rest) : buf;
      if (!results_storable<Math>(storable(wn) & storable(buf))) return false;
      s[0] = buf;
      break;
    }
    case FORGE_RULE_ADAGRAD: {
      const float sum = s[0] + g * g;
      const float std = math.sqrt(sum) + k.eps;
      wn = wn + k.neg_lr * math.div(g, std);
      if (!results_storable<Math>(storable(wn) & storable(sum))) return false;
      s[0] = sum;
      break;
    }
    default:
      break;
  }
  w = wn;
  return true;
}

FORGE_HD bool apply_rule(const RuleScalars& k, float g, float& w, float* s, float& g_out) {
  IeeeMath math;
  return apply_rule(k, g, w, s, g_out, math);
}

}  // namespace forge
