// hparams.cpp — hyper-parameter defaults (torch.optim's), their validation, and
// the step-dependent scalars of every rule, computed in double on the host.
#include "hparams.h"

#include <cmath>

#include "formats.h"
#include "rule_table.h"
#include "status.h"

namespace forge {
namespace {

constexpr forge_status kBad = FORGE_ERR_INVALID_ARGUMENT;

bool in_range(double x, const FieldRange& r) {
  if (!std::isfinite(x)) return false;
  if (r.lo_open ? !(x > r.lo) : !(x >= r.lo)) return false;
  if (r.hi_open ? !(x < r.hi) : !(x <= r.hi)) return false;
  return true;
}

forge_status range_error(const FieldRange& r, double x, const char* rule) {
  const char* field = field_info(r.field).name;
  const char* hint = r.hint ? r.hint : "";
  const char* space = r.hint ? " " : "";
  if (std::isinf(r.hi))
    return fail(kBad, "hparams.%s: must be finite and %s %g for %s%s%s, got %g", field,
                r.lo_open ? ">" : ">=", r.lo, rule, space, hint, x);
  if (r.lo == r.hi)
    return fail(kBad, "hparams.%s: must be %g for %s%s%s, got %g", field, r.lo, rule, space,
                hint, x);
  return fail(kBad, "hparams.%s: must be in %c%g, %g%c for %s%s%s, got %g", field,
              r.lo_open ? '(' : '[', r.lo, r.hi, r.hi_open ? ')' : ']', rule, space, hint, x);
}

}  // namespace

forge_status default_hparams(int rule, forge_hparams* out) {
  if (!out) return fail(kBad, "out: NULL");
  const RuleInfo* info = rule_info(rule);
  if (!info) return fail(kBad, "rule: unknown value %d", rule);
  forge_hparams hp{};
  hp.abi_version = FORGE_ABI_VERSION;
  hp.rule = rule;
  // every rule's base: torch.optim's values of the fields several rules share
  hp.step = 1;
  hp.grad_scale = 1.0;
  hp.beta1 = 0.9;
  hp.beta2 = 0.999;
  hp.eps = 1e-8;
  hp.momentum_decay = 4e-3;
  hp.mu_product = -1.0;  // (computed: the product for a constant beta1)
  hp.alpha = 0.99;
  for (const auto& d : info->defaults)
    if (d.field >= 0) set_field(hp, d.field, d.value);
  *out = hp;
  return FORGE_OK;
}

namespace {

// Each fp32 scalar of RuleScalars, the field it comes from (named when the scalar is not
// finite, or zero where `nonzero`), and the rules that compute with it (0: every rule
// reading the field).
struct ScalarSource {
  float RuleScalars::*member;
  const char* what;
  int field;
  bool nonzero;
  uint32_t rules;
};
constexpr uint32_t rule_bit(int r) { return 1u << r; }
const ScalarSource kScalarSources[] = {
    {&RuleScalars::grad_scale, "grad_scale", kFieldGradScale, true, 0},
    {&RuleScalars::neg_lr, "-lr", kFieldLr, false, 0},
    {&RuleScalars::lr, "lr", kFieldLr, false, 0},
    {&RuleScalars::decay, "1 - lr * weight_decay", kFieldWeightDecay, false, 0},
    {&RuleScalars::wd_coupled, "weight_decay", kFieldWeightDecay, false, 0},
    {&RuleScalars::neg_step_size, "-lr / (1 - beta1^step)", kFieldLr, false, 0},
    {&RuleScalars::nadam_coef_grad, "-lr (1 - mu) / (1 - prod mu)", kFieldLr, false, 0},
    {&RuleScalars::nadam_coef_avg, "-lr mu' / (1 - prod mu')", kFieldLr, false, 0},
    {&RuleScalars::eps, "eps", kFieldEps, true, 0},
    {&RuleScalars::beta1, "beta1", kFieldBeta1, false, 0},
    {&RuleScalars::one_minus_beta1, "1 - beta1", kFieldBeta1, false, 0},
    {&RuleScalars::beta2, "beta2", kFieldBeta2, false, 0},
    {&RuleScalars::one_minus_beta2, "1 - beta2", kFieldBeta2, false, 0},
    {&RuleScalars::bc1, "1 - beta1^step", kFieldBeta1, true, rule_bit(FORGE_RULE_RADAM)},
    {&RuleScalars::bc2, "1 - beta2^step", kFieldBeta2, true, rule_bit(FORGE_RULE_NADAM)},
    {&RuleScalars::bc2_sqrt, "sqrt(1 - beta2^step)", kFieldBeta2, true,
     rule_bit(FORGE_RULE_ADAMW) | rule_bit(FORGE_RULE_RADAM)},
    {&RuleScalars::rect, "the rectification", kFieldBeta2, false, 0},
    {&RuleScalars::alpha, "alpha", kFieldAlpha, false, 0},
    {&RuleScalars::one_minus_alpha, "1 - alpha", kFieldAlpha, false, 0},
    {&RuleScalars::momentum, "momentum", kFieldMomentum, false, 0},
    {&RuleScalars::buf_keep, "momentum", kFieldMomentum, false, 0},
    {&RuleScalars::buf_take, "1 - dampening", kFieldDampening, false, 0},
};

// The fp32 scalars the element code computes with: finite, and non-zero where a zero is
// invalid (eps, grad_scale, divisors). Fields valid in double can break this (lr = 1e39,
// eps = 1e-50).
forge_status check_scalars(const forge_hparams& hp, const RuleInfo& info, const RuleScalars& k) {
  for (const ScalarSource& src : kScalarSources) {
    if (!rule_reads(info, src.field)) continue;
    if (src.rules != 0 && !(src.rules & rule_bit(hp.rule))) continue;
    const float x = k.*src.member;
    const bool finite = std::isfinite(x), zero = src.nonzero && x == 0.0f;
    if (finite && !zero) continue;
    return fail(kBad, "hparams.%s: %g makes the step's fp32 scalar %s %s (%g)",
                field_info(src.field).name, field_value(hp, src.field), src.what,
                finite ? "zero" : "not finite", static_cast<double>(x));
  }
  // (every state a step stores is storable: in bf16 a larger value would be an infinity, and
  // every element skipped from then on)
  if (rule_reads(info, kFieldInitialAccumulatorValue) &&
      !storable(static_cast<float>(hp.initial_accumulator_value)))
    return fail(kBad, "hparams.initial_accumulator_value: %g is not a storable state value in "
                "fp32 (finite, at most the largest bf16, %g)", hp.initial_accumulator_value,
                static_cast<double>(kBf16Max));
  return FORGE_OK;
}

}  // namespace

forge_status validate_hparams(const forge_hparams& hp, RuleScalars* scalars) {
  if (hp.abi_version != FORGE_ABI_VERSION)
    return fail(kBad, "hparams.abi_version: %d, this library speaks %d", hp.abi_version,
                FORGE_ABI_VERSION);
  const RuleInfo* info = rule_info(hp.rule);
  if (!info) return fail(kBad, "hparams.rule: unknown value %d", hp.rule);
  auto finite = [](double x) { return std::isfinite(x); };
  if (hp.step < 1) return fail(kBad, "hparams.step: must be >= 1 (1-based), got %lld",
                               static_cast<long long>(hp.step));
  if (!finite(hp.lr) || hp.lr < 0) return fail(kBad, "hparams.lr: must be finite and >= 0, got %g", hp.lr);
  if (!finite(hp.weight_decay) || hp.weight_decay < 0)
    return fail(kBad, "hparams.weight_decay: must be finite and >= 0, got %g", hp.weight_decay);
  if (!finite(hp.grad_scale) || hp.grad_scale == 0)
    return fail(kBad, "hparams.grad_scale: must be finite and non-zero, got %g", hp.grad_scale);
  for (const FieldRange& r : info->ranges) {
    if (r.field < 0) continue;
    const double x = field_value(hp, r.field);
    if (!in_range(x, r)) return range_error(r, x, info->name);
  }
  if (rule_reads(*info, kFieldMuProduct) && hp.mu_product != -1.0 &&
      !(hp.mu_product >= 0.0 && hp.mu_product < 1.0))
    return fail(kBad, "hparams.mu_product: must be in [0, 1) (the product of NAdam's momentum "
                "factors through this step) or -1 (computed), got %g", hp.mu_product);
  // The product through this step is at most its last factor μ_step (the others are below 1);
  // kept as torch keeps it, in fp32, it is at most μ_step rounded to fp32. Above, 1 / (1 −
  // product) would scale the step without bound.
  if (rule_reads(*info, kFieldMuProduct) && hp.mu_product > 0.0) {
    const double mu = nadam_mu(hp.beta1, hp.momentum_decay, static_cast<double>(hp.step));
    if (hp.mu_product > mu * (1.0 + 0x1p-23))
      return fail(kBad, "hparams.mu_product: %.17g is above this step's momentum factor "
                  "mu_step = %.17g (beta1, momentum_decay, step), which bounds the product "
                  "mu_1 ... mu_step", hp.mu_product, mu);
  }
  if (rule_reads(*info, kFieldDampening) && hp.nesterov && hp.dampening != 0)
    return fail(kBad, "hparams.nesterov: needs dampening == 0 (as torch.optim.SGD), got %g",
                hp.dampening);
  // Fields the rule does not read are ignored, but a NaN there is refused all the same.
  for (int f = 0; f < kFieldCount; ++f)
    if (field_info(f).kind == FieldInfo::kDouble && std::isnan(field_value(hp, f)))
      return fail(kBad, "hparams.%s: NaN (%s does not read it, but it must not be NaN)",
                  field_info(f).name, info->name);
  const RuleScalars k = make_rule_scalars(hp);
  if (forge_status s = check_scalars(hp, *info, k)) return s;
  if (scalars) *scalars = k;
  return FORGE_OK;
}

forge_status state_layout(const forge_hparams& hp, int format, int64_t rows, int64_t cols,
                          forge_state_layout* out) {
  const RuleInfo* info = rule_info(hp.rule);
  if (!info) return fail(kBad, "hparams.rule: unknown value %d", hp.rule);
  forge_state_layout layout{};
  for (int i = 0; i < info->max_states; ++i) {
    const StateInfo& s = info->states[i];
    if (!state_kept(s, hp)) continue;
    layout.names[layout.num_states] = s.name;
    layout.is_signed[layout.num_states] = s.is_signed ? 1 : 0;
    ++layout.num_states;
  }
  const int64_t n = rows * cols;
  const int64_t blocks = rows * ((cols + FORGE_INT8_BLOCK - 1) / FORGE_INT8_BLOCK);
  for (int i = 0; i < layout.num_states; ++i) {
    switch (format) {
      case FORGE_STATE_FP32: layout.state_bytes[i] = 4 * n; break;
      case FORGE_STATE_BF16:
      case FORGE_STATE_BF16_STOCHASTIC: layout.state_bytes[i] = 2 * n; break;
      case FORGE_STATE_INT8_BLOCK64:
      case FORGE_STATE_FP8_BLOCK64:
        layout.state_bytes[i] = n;
        layout.absmax_count[i] = blocks;
        break;
      case FORGE_STATE_INT4_BLOCK64:
        layout.state_bytes[i] = rows * int4_row_bytes(cols);  // two codes per byte
        layout.absmax_count[i] = blocks;
        break;
      default:
        return fail(kBad, "state_format: unknown value %d", format);
    }
  }
  *out = layout;
  return FORGE_OK;
}

RuleScalars make_rule_scalars(const forge_hparams& hp) {
  RuleScalars k{};
  const int r = hp.rule;
  const double t = static_cast<double>(hp.step);
  k.rule = r;
  k.slot_grad_avg = -1;
  k.slot_momentum = -1;
  const RuleInfo& info = *rule_info(r);
  for (int i = 0; i < info.max_states; ++i) {
    const StateInfo& s = info.states[i];
    if (!state_kept(s, hp)) continue;
    if (s.when == StateWhen::kCentered) k.slot_grad_avg = k.num_states;
    if (s.when == StateWhen::kMomentum) k.slot_momentum = k.num_states;
    k.state_signed[k.num_states++] = s.is_signed ? 1 : 0;
  }
  k.maximize = hp.maximize ? 1 : 0;
  k.grad_scale = static_cast<float>(hp.grad_scale);
  const bool decoupled = r == FORGE_RULE_LION ||
                         ((r == FORGE_RULE_ADAMW || r == FORGE_RULE_NADAM || r == FORGE_RULE_RADAM) &&
                          hp.decoupled_weight_decay);
  k.decay = decoupled ? static_cast<float>(1.0 - hp.lr * hp.weight_decay) : 1.0f;
  k.wd_coupled = decoupled ? 0.0f : static_cast<float>(hp.weight_decay);
  k.neg_lr = static_cast<float>(-hp.lr);
  k.lr = static_cast<float>(hp.lr);
  k.beta1 = static_cast<float>(hp.beta1);
  k.beta2 = static_cast<float>(hp.beta2);
  k.one_minus_beta1 = static_cast<float>(1.0 - hp.beta1);
  k.one_minus_beta2 = static_cast<float>(1.0 - hp.beta2);
  k.eps = static_cast<float>(hp.eps);
  const double bc1 = 1.0 - std::pow(hp.beta1, t);
  const double bc2 = 1.0 - std::pow(hp.beta2, t);
  switch (r) {
    case FORGE_RULE_SGD_MOMENTUM:
      // torch: the first step sets buf = grad; later ones buf = momentum buf + (1 - dampening) g
      k.buf_keep = hp.step == 1 ? 0.0f : static_cast<float>(hp.momentum);
      k.buf_take = hp.step == 1 ? 1.0f : static_cast<float>(1.0 - hp.dampening);
      k.momentum = static_cast<float>(hp.momentum);
      k.nesterov = hp.nesterov ? 1 : 0;
      break;
    case FORGE_RULE_ADAMW:
      k.neg_step_size = static_cast<float>(-(hp.lr / bc1));
      k.bc2_sqrt = static_cast<float>(std::sqrt(bc2));
      break;
    case FORGE_RULE_NADAM: {
      const double mu = nadam_mu(hp.beta1, hp.momentum_decay, t);
      const double mu_next = nadam_mu(hp.beta1, hp.momentum_decay, t + 1.0);
      const double mu_product = hp.mu_product >= 0.0
                                    ? hp.mu_product
                                    : nadam_mu_product(hp.beta1, hp.momentum_decay, hp.step);
      k.bc2 = static_cast<float>(bc2);
      k.nadam_coef_grad = static_cast<float>(-hp.lr * (1.0 - mu) / (1.0 - mu_product));
      k.nadam_coef_avg = static_cast<float>(-hp.lr * mu_next / (1.0 - mu_product * mu_next));
      break;
    }
    case FORGE_RULE_RADAM: {
      const double rho_inf = 2.0 / (1.0 - hp.beta2) - 1.0;
      const double rho_t = rho_inf - 2.0 * t * std::pow(hp.beta2, t) / bc2;
      k.bc1 = static_cast<float>(bc1);
      k.bc2_sqrt = static_cast<float>(std::sqrt(bc2));
      k.rect_on = rho_t > 5.0 ? 1 : 0;
      if (k.rect_on)
        k.rect = static_cast<float>(std::sqrt((rho_t - 4) * (rho_t - 2) * rho_inf /
                                              ((rho_inf - 4) * (rho_inf - 2) * rho_t)));
      break;
    }
    case FORGE_RULE_RMSPROP: {
      k.alpha = static_cast<float>(hp.alpha);
      k.one_minus_alpha = static_cast<float>(1.0 - hp.alpha);
      k.momentum = static_cast<float>(hp.momentum);
      k.centered = hp.centered ? 1 : 0;
      break;
    }
    case FORGE_RULE_ADAGRAD:
      k.neg_lr = static_cast<float>(-(hp.lr / (1.0 + (t - 1.0) * hp.lr_decay)));
      break;
    case FORGE_RULE_MUON:
      // The weight slot holds the direction, not a weight: nothing decays or couples it.
      k.decay = 1.0f;
      k.wd_coupled = 0.0f;
      k.buf_take = static_cast<float>(1.0 - hp.momentum);  // torch: 1 - momentum in double
      k.take_rest = 1.0f - k.buf_take;
      k.momentum = static_cast<float>(hp.momentum);
      k.momentum_rest = 1.0f - k.momentum;
      k.nesterov = hp.nesterov ? 1 : 0;
      break;
    default:
      break;
  }
  k.sr_key = rng_key(hp.seed, static_cast<uint64_t>(hp.step));
  return k;
}

}  // namespace forge
