// hparams.cpp — hyper-parameter defaults (torch.optim's), their validation, and
// the step-dependent scalars of every rule, computed in double on the host.
#include "hparams.h"

#include <cmath>

#include "status.h"

namespace forge {
namespace {

const char* rule_name(int rule) {
  static const char* kNames[FORGE_RULE_COUNT] = {"SGD",   "SGD_MOMENTUM", "AdamW",   "NAdam",
                                                 "RAdam", "Lion",         "RMSprop", "Adagrad"};
  return (rule >= 0 && rule < FORGE_RULE_COUNT) ? kNames[rule] : "?";
}

bool uses_betas(int rule) {
  return rule == FORGE_RULE_ADAMW || rule == FORGE_RULE_NADAM || rule == FORGE_RULE_RADAM ||
         rule == FORGE_RULE_LION;
}
bool uses_eps(int rule) {
  return rule == FORGE_RULE_ADAMW || rule == FORGE_RULE_NADAM || rule == FORGE_RULE_RADAM ||
         rule == FORGE_RULE_RMSPROP || rule == FORGE_RULE_ADAGRAD;
}

// NAdam's Π_{i<=t} mu_i depends on every step before t. Memoised per thread so a
// training loop (t, t+1, ...) pays O(1) per call; any other order recomputes.
double nadam_mu(double beta1, double momentum_decay, int64_t i) {
  return beta1 * (1.0 - 0.5 * std::pow(0.96, static_cast<double>(i) * momentum_decay));
}
double nadam_mu_product(double beta1, double momentum_decay, int64_t t) {
  thread_local double cached_beta1 = -1, cached_decay = -1, cached_product = 1;
  thread_local int64_t cached_t = 0;
  if (cached_beta1 != beta1 || cached_decay != momentum_decay || cached_t > t) {
    cached_beta1 = beta1;
    cached_decay = momentum_decay;
    cached_t = 0;
    cached_product = 1;
  }
  for (int64_t i = cached_t + 1; i <= t; ++i) cached_product *= nadam_mu(beta1, momentum_decay, i);
  cached_t = t;
  return cached_product;
}

}  // namespace

forge_status default_hparams(forge_rule rule, forge_hparams* out) {
  if (!out) return fail(FORGE_ERR_INVALID_ARGUMENT, "out is NULL");
  if (rule < 0 || rule >= FORGE_RULE_COUNT)
    return fail(FORGE_ERR_INVALID_ARGUMENT, "rule: unknown value %d", static_cast<int>(rule));
  forge_hparams hp{};
  hp.abi_version = FORGE_ABI_VERSION;
  hp.rule = rule;
  hp.step = 1;
  hp.grad_scale = 1.0;
  hp.beta1 = 0.9;
  hp.beta2 = 0.999;
  hp.eps = 1e-8;
  hp.momentum_decay = 4e-3;
  hp.alpha = 0.99;
  switch (rule) {
    case FORGE_RULE_SGD: hp.lr = 1e-3; break;
    case FORGE_RULE_SGD_MOMENTUM: hp.lr = 1e-3; hp.momentum = 0.9; break;
    case FORGE_RULE_ADAMW: hp.lr = 1e-3; hp.weight_decay = 1e-2; hp.decoupled_weight_decay = 1; break;
    case FORGE_RULE_NADAM: hp.lr = 2e-3; break;
    case FORGE_RULE_RADAM: hp.lr = 1e-3; break;
    case FORGE_RULE_LION: hp.lr = 1e-4; hp.beta2 = 0.99; break;
    case FORGE_RULE_RMSPROP: hp.lr = 1e-2; break;
    case FORGE_RULE_ADAGRAD: hp.lr = 1e-2; hp.eps = 1e-10; break;
  }
  *out = hp;
  return FORGE_OK;
}

forge_status validate_hparams(const forge_hparams& hp) {
  const forge_status bad = FORGE_ERR_INVALID_ARGUMENT;
  if (hp.abi_version != FORGE_ABI_VERSION)
    return fail(bad, "hparams.abi_version: %d, this library speaks %d", hp.abi_version,
                FORGE_ABI_VERSION);
  const int r = hp.rule;
  if (r < 0 || r >= FORGE_RULE_COUNT) return fail(bad, "hparams.rule: unknown value %d", r);
  const char* name = rule_name(r);
  auto finite = [](double x) { return std::isfinite(x); };
  if (hp.step < 1) return fail(bad, "hparams.step: must be >= 1 (1-based), got %lld",
                               static_cast<long long>(hp.step));
  if (!finite(hp.lr) || hp.lr < 0) return fail(bad, "hparams.lr: must be finite and >= 0, got %g", hp.lr);
  if (!finite(hp.weight_decay) || hp.weight_decay < 0)
    return fail(bad, "hparams.weight_decay: must be finite and >= 0, got %g", hp.weight_decay);
  if (!finite(hp.grad_scale) || hp.grad_scale == 0)
    return fail(bad, "hparams.grad_scale: must be finite and non-zero, got %g", hp.grad_scale);
  if (uses_betas(r)) {
    if (!(hp.beta1 >= 0 && hp.beta1 < 1))
      return fail(bad, "hparams.beta1: must be in [0, 1) for %s, got %g", name, hp.beta1);
    if (!(hp.beta2 >= 0 && hp.beta2 < 1))
      return fail(bad, "hparams.beta2: must be in [0, 1) for %s, got %g", name, hp.beta2);
  }
  if (uses_eps(r) && !(finite(hp.eps) && hp.eps > 0))
    return fail(bad, "hparams.eps: must be finite and > 0 for %s, got %g", name, hp.eps);
  if (r == FORGE_RULE_NADAM && !(finite(hp.momentum_decay) && hp.momentum_decay >= 0))
    return fail(bad, "hparams.momentum_decay: must be finite and >= 0, got %g", hp.momentum_decay);
  if (r == FORGE_RULE_RMSPROP) {
    if (!(hp.alpha >= 0 && hp.alpha < 1))
      return fail(bad, "hparams.alpha: must be in [0, 1) for RMSprop, got %g", hp.alpha);
    if (!(hp.momentum >= 0 && hp.momentum < 1))
      return fail(bad, "hparams.momentum: must be in [0, 1) for RMSprop, got %g", hp.momentum);
  }
  if (r == FORGE_RULE_SGD && hp.momentum != 0)
    return fail(bad, "hparams.momentum: must be 0 for SGD (use FORGE_RULE_SGD_MOMENTUM), got %g",
                hp.momentum);
  if (r == FORGE_RULE_SGD_MOMENTUM) {
    if (!(hp.momentum > 0 && hp.momentum < 1))
      return fail(bad, "hparams.momentum: must be in (0, 1) for SGD_MOMENTUM, got %g", hp.momentum);
    if (!(hp.dampening >= 0 && hp.dampening <= 1))
      return fail(bad, "hparams.dampening: must be in [0, 1], got %g", hp.dampening);
    if (hp.nesterov && hp.dampening != 0)
      return fail(bad, "hparams.nesterov: needs dampening == 0 (as torch.optim.SGD), got %g",
                  hp.dampening);
  }
  if (r == FORGE_RULE_ADAGRAD) {
    if (!(finite(hp.lr_decay) && hp.lr_decay >= 0))
      return fail(bad, "hparams.lr_decay: must be finite and >= 0, got %g", hp.lr_decay);
    if (!(finite(hp.initial_accumulator_value) && hp.initial_accumulator_value >= 0))
      return fail(bad, "hparams.initial_accumulator_value: must be finite and >= 0, got %g",
                  hp.initial_accumulator_value);
  }
  return FORGE_OK;
}

forge_status state_layout(const forge_hparams& hp, forge_state_format format, int64_t rows,
                          int64_t cols, forge_state_layout* out) {
  forge_state_layout layout{};
  auto add = [&](const char* state_name, bool is_signed) {
    layout.names[layout.num_states] = state_name;
    layout.is_signed[layout.num_states] = is_signed ? 1 : 0;
    ++layout.num_states;
  };
  switch (hp.rule) {
    case FORGE_RULE_SGD: break;
    case FORGE_RULE_SGD_MOMENTUM: add("momentum_buffer", true); break;
    case FORGE_RULE_ADAMW:
    case FORGE_RULE_NADAM:
    case FORGE_RULE_RADAM: add("exp_avg", true); add("exp_avg_sq", false); break;
    case FORGE_RULE_LION: add("exp_avg", true); break;
    case FORGE_RULE_RMSPROP:
      add("square_avg", false);
      if (hp.centered) add("grad_avg", true);
      if (hp.momentum > 0) add("momentum_buffer", true);
      break;
    case FORGE_RULE_ADAGRAD: add("sum", false); break;
    default: return fail(FORGE_ERR_INVALID_ARGUMENT, "hparams.rule: unknown value %d", hp.rule);
  }
  const int64_t n = rows * cols;
  const int64_t blocks = rows * ((cols + FORGE_INT8_BLOCK - 1) / FORGE_INT8_BLOCK);
  for (int i = 0; i < layout.num_states; ++i) {
    switch (format) {
      case FORGE_STATE_FP32: layout.state_bytes[i] = 4 * n; break;
      case FORGE_STATE_BF16:
      case FORGE_STATE_BF16_STOCHASTIC: layout.state_bytes[i] = 2 * n; break;
      case FORGE_STATE_INT8_BLOCK64:
        layout.state_bytes[i] = n;
        layout.absmax_count[i] = blocks;
        break;
      default:
        return fail(FORGE_ERR_INVALID_ARGUMENT, "state_format: unknown value %d",
                    static_cast<int>(format));
    }
  }
  *out = layout;
  return FORGE_OK;
}

RuleScalars make_rule_scalars(const forge_hparams& hp) {
  RuleScalars k{};
  const int r = hp.rule;
  const double t = static_cast<double>(hp.step);
  forge_state_layout layout{};
  state_layout(hp, FORGE_STATE_FP32, 1, 1, &layout);
  k.rule = r;
  k.num_states = layout.num_states;
  for (int i = 0; i < FORGE_MAX_STATES; ++i) k.state_signed[i] = layout.is_signed[i];
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
  k.slot_grad_avg = -1;
  k.slot_momentum = -1;
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
      const double mu = nadam_mu(hp.beta1, hp.momentum_decay, hp.step);
      const double mu_next = nadam_mu(hp.beta1, hp.momentum_decay, hp.step + 1);
      const double mu_product = nadam_mu_product(hp.beta1, hp.momentum_decay, hp.step);
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
      int slot = 1;
      if (hp.centered) k.slot_grad_avg = slot++;
      if (hp.momentum > 0) k.slot_momentum = slot++;
      break;
    }
    case FORGE_RULE_ADAGRAD:
      k.neg_lr = static_cast<float>(-(hp.lr / (1.0 + (t - 1.0) * hp.lr_decay)));
      break;
    default:
      break;
  }
  k.sr_key = rng_key(hp.seed, static_cast<uint64_t>(hp.step));
  return k;
}

}  // namespace forge
