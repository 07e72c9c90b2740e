// test_rules.cpp — every rule against an independent textbook implementation in
// double (written from torch.optim's documented algorithms and the Lion paper),
// over 12 steps with fp32 weights and states; plus defaults and state layouts, what
// forge_rule_query says of each rule, and NAdam's momentum product in closed form.
#include <algorithm>
#include <chrono>
#include <functional>
#include <limits>

#include "core/hparams.h"
#include "core/rules.h"
#include "test_util.h"
#include "tolerances.h"

namespace forge_test {
namespace {

// One element's textbook state, in double.
struct Ref {
  double w, a = 0, b = 0, c = 0, mu_product = 1;
};

double sgn(double x) { return x > 0 ? 1 : (x < 0 ? -1 : 0); }

// Textbook step t (1-based) of rule case `hp` on element r with gradient g.
void textbook_step(const forge_hparams& hp, int64_t t, double g, Ref& r) {
  const double lr = hp.lr, wd = hp.weight_decay, b1 = hp.beta1, b2 = hp.beta2, eps = hp.eps;
  g *= hp.grad_scale;
  if (hp.maximize) g = -g;
  switch (hp.rule) {
    case FORGE_RULE_SGD:
      r.w -= lr * (g + wd * r.w);
      break;
    case FORGE_RULE_SGD_MOMENTUM: {
      g += wd * r.w;
      r.a = t == 1 ? g : hp.momentum * r.a + (1 - hp.dampening) * g;
      r.w -= lr * (hp.nesterov ? g + hp.momentum * r.a : r.a);
      break;
    }
    case FORGE_RULE_ADAMW: {  // Adam when decoupled_weight_decay == 0
      if (hp.decoupled_weight_decay) r.w *= 1 - lr * wd; else g += wd * r.w;
      r.a = b1 * r.a + (1 - b1) * g;
      r.b = b2 * r.b + (1 - b2) * g * g;
      const double m_hat = r.a / (1 - std::pow(b1, t)), v_hat = r.b / (1 - std::pow(b2, t));
      r.w -= lr * m_hat / (std::sqrt(v_hat) + eps);
      break;
    }
    case FORGE_RULE_NADAM: {
      if (hp.decoupled_weight_decay) r.w *= 1 - lr * wd; else g += wd * r.w;
      auto mu_at = [&](int64_t i) { return b1 * (1 - 0.5 * std::pow(0.96, i * hp.momentum_decay)); };
      const double mu = mu_at(t), mu_next = mu_at(t + 1);
      r.mu_product *= mu;
      r.a = b1 * r.a + (1 - b1) * g;
      r.b = b2 * r.b + (1 - b2) * g * g;
      const double v_hat = r.b / (1 - std::pow(b2, t));
      const double m_hat = mu_next * r.a / (1 - r.mu_product * mu_next) + (1 - mu) * g / (1 - r.mu_product);
      r.w -= lr * m_hat / (std::sqrt(v_hat) + eps);
      break;
    }
    case FORGE_RULE_RADAM: {
      if (hp.decoupled_weight_decay) r.w *= 1 - lr * wd; else g += wd * r.w;
      r.a = b1 * r.a + (1 - b1) * g;
      r.b = b2 * r.b + (1 - b2) * g * g;
      const double m_hat = r.a / (1 - std::pow(b1, t));
      const double rho_inf = 2 / (1 - b2) - 1;
      const double rho_t = rho_inf - 2 * t * std::pow(b2, t) / (1 - std::pow(b2, t));
      if (rho_t > 5) {
        const double l = std::sqrt(1 - std::pow(b2, t)) / (std::sqrt(r.b) + eps);
        const double rect = std::sqrt((rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t));
        r.w -= lr * m_hat * l * rect;
      } else {
        r.w -= lr * m_hat;
      }
      break;
    }
    case FORGE_RULE_LION: {
      const double c = b1 * r.a + (1 - b1) * g;
      r.w = r.w * (1 - lr * wd) - lr * sgn(c);
      r.a = b2 * r.a + (1 - b2) * g;
      break;
    }
    case FORGE_RULE_RMSPROP: {
      g += wd * r.w;
      const double al = hp.alpha;
      r.a = al * r.a + (1 - al) * g * g;  // square_avg
      double denom;
      if (hp.centered) {
        r.b = al * r.b + (1 - al) * g;    // grad_avg
        denom = std::sqrt(r.a - r.b * r.b) + eps;
      } else {
        denom = std::sqrt(r.a) + eps;
      }
      if (hp.momentum > 0) {
        r.c = hp.momentum * r.c + g / denom;
        r.w -= lr * r.c;
      } else {
        r.w -= lr * g / denom;
      }
      break;
    }
    case FORGE_RULE_ADAGRAD: {
      g += wd * r.w;
      const double clr = lr / (1 + (t - 1) * hp.lr_decay);
      r.a += g * g;
      r.w -= clr * g / (std::sqrt(r.a) + eps);
      break;
    }
    case FORGE_RULE_MUON: {
      // torch.optim.Muon's momentum: B = mu B + (1 - mu) G, and the direction the caller
      // orthogonalizes, (1 - mu) G + mu B with nesterov, else B. The weight slot receives that
      // direction; lr and weight_decay apply to the weight outside the step, not here.
      const double mu = hp.momentum;
      r.a = mu * r.a + (1 - mu) * g;
      r.w = hp.nesterov ? (1 - mu) * g + mu * r.a : r.a;
      break;
    }
  }
}

class RuleVsTextbook : public ::testing::TestWithParam<int> {};

TEST_P(RuleVsTextbook, TwelveStepsFp32WithinOneMillionth) {
  const RuleCase rc = all_rule_cases()[GetParam()];
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(rc.name + " FORGE_TEST_SEED=" + std::to_string(seed));
  Rng rng(seed);
  const int64_t rows = 7, cols = 100;
  forge_hparams hp = rc.hp;
  hp.grad_scale = 0.5;
  HostParam p(rows, cols, FORGE_WEIGHT_FP32, FORGE_STATE_FP32, hp);
  p.randomize(rng, hp);
  std::vector<Ref> ref(p.size());
  for (int64_t i = 0; i < p.size(); ++i) {
    ref[i].w = p.w(i);
    if (hp.rule == FORGE_RULE_ADAGRAD) ref[i].a = hp.initial_accumulator_value;
  }
  for (int64_t t = 1; t <= 12; ++t) {
    hp.step = t;
    std::vector<float> grad(p.size());
    for (float& g : grad) g = rng.normal(1.0f);
    forge_elementwise_args a = elementwise_args(p, hp, grad);
    ASSERT_EQ(forge_elementwise_step(&a), FORGE_OK) << forge_last_error();
    for (int64_t i = 0; i < p.size(); ++i) textbook_step(hp, t, grad[i], ref[i]);
    double diff = 0, norm = 0;
    for (int64_t i = 0; i < p.size(); ++i) {
      diff += (p.w(i) - ref[i].w) * (p.w(i) - ref[i].w);
      norm += ref[i].w * ref[i].w;
    }
    ASSERT_LE(std::sqrt(diff / norm), kRuleVsDoubleRel) << "step " << t;
  }
  // The first state matches too (torch's exp_avg / momentum_buffer / square_avg / sum).
  if (p.num_states > 0) {
    const std::vector<float> s0 = p.state_fp32(0, hp);
    double diff = 0, norm = 0;
    for (int64_t i = 0; i < p.size(); ++i) {
      diff += (s0[i] - ref[i].a) * (s0[i] - ref[i].a);
      norm += ref[i].a * ref[i].a;
    }
    EXPECT_LE(std::sqrt(diff / norm), kRuleVsDoubleRel);
  }
}

INSTANTIATE_TEST_SUITE_P(AllRules, RuleVsTextbook,
                         ::testing::Range(0, static_cast<int>(all_rule_cases().size())),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return all_rule_cases()[info.param].name;
                         });

TEST(RuleDefaults, MatchTorchOptim) {
  forge_hparams hp;
  ASSERT_EQ(forge_hparams_default(FORGE_RULE_ADAMW, &hp), FORGE_OK);
  EXPECT_EQ(hp.lr, 1e-3);
  EXPECT_EQ(hp.weight_decay, 1e-2);
  EXPECT_EQ(hp.beta1, 0.9);
  EXPECT_EQ(hp.beta2, 0.999);
  EXPECT_EQ(hp.eps, 1e-8);
  EXPECT_EQ(hp.decoupled_weight_decay, 1);
  ASSERT_EQ(forge_hparams_default(FORGE_RULE_NADAM, &hp), FORGE_OK);
  EXPECT_EQ(hp.lr, 2e-3);
  EXPECT_EQ(hp.momentum_decay, 4e-3);
  ASSERT_EQ(forge_hparams_default(FORGE_RULE_ADAGRAD, &hp), FORGE_OK);
  EXPECT_EQ(hp.eps, 1e-10);
  EXPECT_EQ(hp.lr, 1e-2);
  ASSERT_EQ(forge_hparams_default(FORGE_RULE_LION, &hp), FORGE_OK);
  EXPECT_EQ(hp.lr, 1e-4);
  EXPECT_EQ(hp.beta2, 0.99);
  ASSERT_EQ(forge_hparams_default(FORGE_RULE_RMSPROP, &hp), FORGE_OK);
  EXPECT_EQ(hp.alpha, 0.99);
  EXPECT_EQ(hp.lr, 1e-2);
  ASSERT_EQ(forge_hparams_default(FORGE_RULE_MUON, &hp), FORGE_OK);
  EXPECT_EQ(hp.momentum, 0.95);
  EXPECT_EQ(hp.nesterov, 1);
}

TEST(RuleStateLayout, CountsSignsAndSizes) {
  forge_hparams hp;
  forge_state_layout l;
  forge_hparams_default(FORGE_RULE_ADAMW, &hp);
  ASSERT_EQ(forge_state_layout_query(&hp, FORGE_STATE_INT8_BLOCK64, 3, 130, &l), FORGE_OK);
  EXPECT_EQ(l.num_states, 2);
  EXPECT_EQ(l.is_signed[0], 1);
  EXPECT_EQ(l.is_signed[1], 0);
  EXPECT_STREQ(l.names[1], "exp_avg_sq");
  EXPECT_EQ(l.state_bytes[0], 3 * 130);
  EXPECT_EQ(l.absmax_count[0], 3 * 3);  // ceil(130 / 64) blocks per row
  forge_hparams_default(FORGE_RULE_RMSPROP, &hp);
  hp.centered = 1;
  hp.momentum = 0.5;
  ASSERT_EQ(forge_state_layout_query(&hp, FORGE_STATE_BF16, 2, 5, &l), FORGE_OK);
  EXPECT_EQ(l.num_states, 3);
  EXPECT_STREQ(l.names[2], "momentum_buffer");
  EXPECT_EQ(l.state_bytes[2], 20);
  forge_hparams_default(FORGE_RULE_SGD, &hp);
  ASSERT_EQ(forge_state_layout_query(&hp, FORGE_STATE_FP32, 2, 5, &l), FORGE_OK);
  EXPECT_EQ(l.num_states, 0);
  // Muon keeps its momentum buffer whatever the momentum (torch.optim.Muon's, zero at first)
  forge_hparams_default(FORGE_RULE_MUON, &hp);
  for (double momentum : {0.95, 0.0}) {
    hp.momentum = momentum;
    ASSERT_EQ(forge_state_layout_query(&hp, FORGE_STATE_INT8_BLOCK64, 3, 130, &l), FORGE_OK);
    EXPECT_EQ(l.num_states, 1);
    EXPECT_STREQ(l.names[0], "momentum_buffer");
    EXPECT_EQ(l.is_signed[0], 1);
    EXPECT_EQ(l.state_bytes[0], 3 * 130);
    EXPECT_EQ(l.absmax_count[0], 3 * 3);
  }
}

// Muon's step writes the momentum's direction into the weight slot: the weight's old value,
// lr, weight_decay and the fields of other rules (dampening, which SGD's nesterov needs zero)
// change no bit; momentum 0 gives u = m = g, momentum 1 keeps m and gives u = m, with or
// without nesterov, exactly.
TEST(MuonStep, WritesTheDirectionWhateverTheWeightAndUnreadFields) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("FORGE_TEST_SEED=" + std::to_string(seed));
  Rng rng(seed);
  forge_hparams hp;
  ASSERT_EQ(forge_hparams_default(FORGE_RULE_MUON, &hp), FORGE_OK);
  hp.step = 5;
  for (int nesterov : {1, 0}) {
    SCOPED_TRACE("nesterov " + std::to_string(nesterov));
    hp.nesterov = nesterov;
    HostParam a(3, 70, FORGE_WEIGHT_FP32, FORGE_STATE_FP32, hp);
    a.randomize(rng, hp);
    std::vector<float> m0(a.size());
    for (float& v : m0) v = rng.normal(0.1f);
    const forge_device cpu{};
    ASSERT_EQ(forge_state_from_fp32(&a.p, &hp, 0, m0.data(), cpu), FORGE_OK) << forge_last_error();
    HostParam b(a);
    for (int64_t i = 0; i < b.size(); ++i) b.set_w(i, rng.normal(3.0f));
    std::vector<float> grad(a.size());
    for (float& g : grad) g = rng.normal(1.0f);
    forge_hparams other = hp;
    other.lr = 0.5;
    other.weight_decay = 0.25;
    other.decoupled_weight_decay = 0;
    other.dampening = 0.5;
    forge_elementwise_args e = elementwise_args(a, hp, grad);
    ASSERT_EQ(forge_elementwise_step(&e), FORGE_OK) << forge_last_error();
    e = elementwise_args(b, other, grad);
    ASSERT_EQ(forge_elementwise_step(&e), FORGE_OK) << forge_last_error();
    EXPECT_EQ(a.snapshot(), b.snapshot());
    for (double momentum : {0.0, 1.0}) {
      SCOPED_TRACE("momentum " + std::to_string(momentum));
      forge_hparams edge = hp;
      edge.momentum = momentum;
      HostParam c(3, 70, FORGE_WEIGHT_FP32, FORGE_STATE_FP32, edge);
      c.randomize(rng, edge);
      ASSERT_EQ(forge_state_from_fp32(&c.p, &edge, 0, m0.data(), cpu), FORGE_OK);
      e = elementwise_args(c, edge, grad);
      ASSERT_EQ(forge_elementwise_step(&e), FORGE_OK) << forge_last_error();
      const std::vector<float> m = c.state_fp32(0, edge);
      for (int64_t i = 0; i < c.size(); ++i) {
        const float want = momentum == 0.0 ? grad[i] : m0[i];
        ASSERT_EQ(m[i], want) << i;
        ASSERT_EQ(c.w(i), want) << i;
      }
    }
  }
}

}  // namespace
}  // namespace forge_test

namespace forge_test {
namespace {

// forge_rule_query describes what forge_state_layout_query and forge_hparams_default do:
// the states of the largest configuration with their names, signs and conditions, and the
// fields whose defaults and checks belong to the rule.
TEST(RuleQuery, AgreesWithLayoutsAndDefaults) {
  int32_t count = 0;
  ASSERT_EQ(forge_enum_count(FORGE_ENUM_RULE, &count), FORGE_OK);
  ASSERT_EQ(count, FORGE_RULE_COUNT);
  for (int32_t rule = 0; rule < count; ++rule) {
    forge_rule_info info;
    ASSERT_EQ(forge_rule_query(rule, &info), FORGE_OK) << forge_last_error();
    const char* name = nullptr;
    ASSERT_EQ(forge_enum_name(FORGE_ENUM_RULE, rule, &name), FORGE_OK);
    EXPECT_STREQ(info.name, name);
    SCOPED_TRACE(info.name);
    std::vector<std::string> fields(info.fields, info.fields + info.num_fields);
    ASSERT_LE(info.num_fields, FORGE_MAX_RULE_FIELDS);
    for (const char* always : {"step", "maximize", "grad_scale", "seed"})
      EXPECT_NE(std::find(fields.begin(), fields.end(), always), fields.end()) << always;
    // lr and weight_decay: read by every rule whose step updates the weight, and by no other
    // (Muon's writes the direction the caller applies: forge.h).
    const bool updates_weight = rule != FORGE_RULE_MUON;
    for (const char* weight_only : {"lr", "weight_decay"})
      EXPECT_EQ(std::find(fields.begin(), fields.end(), weight_only) != fields.end(), updates_weight)
          << weight_only;
    // The largest configuration: every condition met.
    forge_hparams hp;
    ASSERT_EQ(forge_hparams_default(rule, &hp), FORGE_OK);
    for (int i = 0; i < info.max_states; ++i) {
      if (!info.state_condition[i]) continue;
      if (std::string(info.state_condition[i]) == "centered") hp.centered = 1;
      else if (std::string(info.state_condition[i]) == "momentum") hp.momentum = 0.5;
      else ADD_FAILURE() << "unknown condition " << info.state_condition[i];
    }
    forge_state_layout layout;
    ASSERT_EQ(forge_state_layout_query(&hp, FORGE_STATE_FP32, 1, 1, &layout), FORGE_OK)
        << forge_last_error();
    ASSERT_EQ(layout.num_states, info.max_states);
    for (int i = 0; i < info.max_states; ++i) {
      EXPECT_STREQ(layout.names[i], info.state_names[i]);
      EXPECT_EQ(layout.is_signed[i], info.state_signed[i]);
      // Each conditional state disappears when its field is zero; later ones move up.
      if (info.state_condition[i]) {
        forge_hparams without = hp;
        if (std::string(info.state_condition[i]) == "centered") without.centered = 0;
        else without.momentum = 0;
        forge_state_layout fewer;
        ASSERT_EQ(forge_state_layout_query(&without, FORGE_STATE_FP32, 1, 1, &fewer), FORGE_OK);
        EXPECT_EQ(fewer.num_states, info.max_states - 1);
        for (int j = i; j + 1 < info.max_states; ++j) EXPECT_STREQ(fewer.names[j], info.state_names[j + 1]);
      }
    }
  }
  forge_rule_info info;
  EXPECT_EQ(forge_rule_query(FORGE_RULE_COUNT, &info), FORGE_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(forge_last_error()).find("rule"), std::string::npos);
  EXPECT_EQ(forge_rule_query(FORGE_RULE_ADAMW, nullptr), FORGE_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(forge_last_error()).find("out"), std::string::npos);
}

TEST(RuleQuery, FieldsAreThoseTheRuleReads) {
  auto fields = [](int rule) {
    forge_rule_info info;
    EXPECT_EQ(forge_rule_query(rule, &info), FORGE_OK);
    return std::vector<std::string>(info.fields, info.fields + info.num_fields);
  };
  auto has = [](const std::vector<std::string>& v, const char* f) {
    return std::find(v.begin(), v.end(), f) != v.end();
  };
  const auto adamw = fields(FORGE_RULE_ADAMW);
  for (const char* f : {"beta1", "beta2", "eps", "decoupled_weight_decay"}) EXPECT_TRUE(has(adamw, f)) << f;
  for (const char* f : {"momentum", "alpha", "momentum_decay", "lr_decay"}) EXPECT_FALSE(has(adamw, f)) << f;
  for (const char* f : {"momentum_decay", "mu_product"}) EXPECT_TRUE(has(fields(FORGE_RULE_NADAM), f)) << f;
  EXPECT_FALSE(has(adamw, "mu_product"));
  const auto rms = fields(FORGE_RULE_RMSPROP);
  for (const char* f : {"alpha", "eps", "momentum", "centered"}) EXPECT_TRUE(has(rms, f)) << f;
  EXPECT_FALSE(has(rms, "beta1"));
  const auto lion = fields(FORGE_RULE_LION);
  EXPECT_TRUE(has(lion, "beta2"));
  EXPECT_FALSE(has(lion, "eps"));
  const auto adagrad = fields(FORGE_RULE_ADAGRAD);
  for (const char* f : {"lr_decay", "initial_accumulator_value", "eps"}) EXPECT_TRUE(has(adagrad, f)) << f;
  const auto sgdm = fields(FORGE_RULE_SGD_MOMENTUM);
  for (const char* f : {"momentum", "dampening", "nesterov"}) EXPECT_TRUE(has(sgdm, f)) << f;
  const auto muon = fields(FORGE_RULE_MUON);
  for (const char* f : {"momentum", "nesterov"}) EXPECT_TRUE(has(muon, f)) << f;
  for (const char* f : {"lr", "weight_decay", "dampening", "decoupled_weight_decay", "beta1", "eps", "centered"})
    EXPECT_FALSE(has(muon, f)) << f;
}

}  // namespace
}  // namespace forge_test

namespace forge_test {
namespace {

// NAdam's Π_{i<=t} mu_i in closed form against the incremental product (in long double, so
// that the reference's own rounding is far below the tolerance), for t up to 10^5.
TEST(NAdamMuProduct, ClosedFormMatchesIncrementalProduct) {
  const double cases[][2] = {{0.9, 4e-3},  {0.99, 4e-3},   {0.999, 1e-4}, {0.5, 0.5},
                             {0.9, 0.0},   {0.9999, 0.04}, {0.9, 1e-300}, {0.95, 10.0},
                             {0.0, 4e-3}};
  for (const auto& c : cases) {
    const double beta1 = c[0], decay = c[1];
    SCOPED_TRACE(::testing::Message() << "beta1 " << beta1 << " momentum_decay " << decay);
    long double reference = 1;
    double worst = 0;
    for (int64_t t = 1; t <= 100000; ++t) {
      reference *= static_cast<long double>(beta1) *
                   (1 - 0.5L * std::pow(0.96L, static_cast<long double>(t) * decay));
      const double got = forge::nadam_mu_product(beta1, decay, t);
      ASSERT_TRUE(std::isfinite(got) && got >= 0) << "t " << t;
      if (reference < 1e-300L) {  // underflowing: no relative comparison
        ASSERT_LE(got, 1e-290) << "t " << t;
        continue;
      }
      const double rel = static_cast<double>(std::fabs((got - reference) / reference));
      const double bound = kNadamMuProductEpsPerLog *
                           (std::fabs(std::log(static_cast<double>(reference))) + 1) *
                           std::numeric_limits<double>::epsilon();
      ASSERT_LE(rel, bound) << "t " << t << ": " << got << " vs " << static_cast<double>(reference);
      worst = std::max(worst, rel);
    }
    RecordProperty("worst_relative", std::to_string(worst));
  }
}

forge_hparams nadam_at(int64_t step, double beta1) {
  forge_hparams hp;
  forge_hparams_default(FORGE_RULE_NADAM, &hp);
  hp.step = step;
  hp.beta1 = beta1;
  return hp;
}

// The largest step: constant time, finite scalars, finite weights.
TEST(NAdamMuProduct, LargestStepIsPromptAndFinite) {
  const auto start = std::chrono::steady_clock::now();
  const forge_hparams hp = nadam_at(INT64_MAX, 0.9);
  alignas(16) unsigned char run[FORGE_RUN_SCALARS_BYTES];
  ASSERT_EQ(forge_run_scalars_fill(&hp, run, sizeof(run)), FORGE_OK) << forge_last_error();
  forge::RuleScalars k;
  std::memcpy(&k, run, sizeof(k));
  EXPECT_TRUE(std::isfinite(k.nadam_coef_grad) && std::isfinite(k.nadam_coef_avg) &&
              std::isfinite(k.bc2));
  HostParam p(3, 70, FORGE_WEIGHT_FP32, FORGE_STATE_FP32, hp);
  Rng rng(fresh_seed());
  p.randomize(rng, hp);
  std::vector<float> grad(p.size(), 0.25f);
  const forge_elementwise_args a = elementwise_args(p, hp, grad);
  ASSERT_EQ(forge_elementwise_step(&a), FORGE_OK) << forge_last_error();
  for (int64_t i = 0; i < p.size(); ++i) ASSERT_TRUE(std::isfinite(p.w(i))) << i;
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(),
            kPromptSeconds);
}

// A beta1 that changes every step (torch's OneCycleLR cycles it): given the running product
// in hparams.mu_product, as torch keeps it in state['mu_product'], the step follows the
// textbook, which multiplies each step's mu with that step's beta1; the closed form (-1)
// assumes the present beta1 for every step and does not. Products in [0, 1) are valid (each
// mu < beta1 < 1); other values are refused by name, the weight untouched.
TEST(NAdamMuProduct, GivenProductFollowsAChangingBeta1) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("FORGE_TEST_SEED=" + std::to_string(seed));
  Rng rng(seed);
  forge_hparams hp = nadam_at(1, 0.9);
  hp.lr = 1e-2;
  HostParam given(5, 40, FORGE_WEIGHT_FP32, FORGE_STATE_FP32, hp);
  given.randomize(rng, hp);
  HostParam computed = given;
  std::vector<Ref> ref(given.size());
  for (int64_t i = 0; i < given.size(); ++i) ref[i].w = given.w(i);
  double product = 1.0, computed_error = 0.0;
  for (int64_t t = 1; t <= 12; ++t) {
    hp.step = t;
    hp.beta1 = 0.6 + 0.08 * static_cast<double>(t % 5);
    product *= hp.beta1 * (1 - 0.5 * std::pow(0.96, static_cast<double>(t) * hp.momentum_decay));
    std::vector<float> grad(given.size());
    for (float& g : grad) g = rng.normal(1.0f);
    hp.mu_product = product;
    forge_elementwise_args a = elementwise_args(given, hp, grad);
    ASSERT_EQ(forge_elementwise_step(&a), FORGE_OK) << forge_last_error();
    hp.mu_product = -1.0;
    a = elementwise_args(computed, hp, grad);
    ASSERT_EQ(forge_elementwise_step(&a), FORGE_OK) << forge_last_error();
    for (int64_t i = 0; i < given.size(); ++i) textbook_step(hp, t, grad[i], ref[i]);
    double diff = 0, computed_diff = 0, norm = 0;
    for (int64_t i = 0; i < given.size(); ++i) {
      diff += (given.w(i) - ref[i].w) * (given.w(i) - ref[i].w);
      computed_diff += (computed.w(i) - ref[i].w) * (computed.w(i) - ref[i].w);
      norm += ref[i].w * ref[i].w;
    }
    ASSERT_LE(std::sqrt(diff / norm), kRuleVsDoubleRel) << "step " << t;
    computed_error = std::max(computed_error, std::sqrt(computed_diff / norm));
  }
  EXPECT_GT(computed_error, 100 * kRuleVsDoubleRel);  // (the test can tell the two apart)
  alignas(16) unsigned char run[FORGE_RUN_SCALARS_BYTES];
  // (the product through step t is at most its last factor, mu_t: the others are below 1)
  const double mu_t = hp.beta1 * (1 - 0.5 * std::pow(0.96, static_cast<double>(hp.step) * hp.momentum_decay));
  for (double ok : {0.0, product, mu_t, static_cast<double>(static_cast<float>(mu_t))}) {
    hp.mu_product = ok;
    EXPECT_EQ(forge_run_scalars_fill(&hp, run, sizeof(run)), FORGE_OK) << ok;
  }
  for (double bad : {-0.5, 1.0, 1.5, -2.0, static_cast<double>(INFINITY), static_cast<double>(NAN),
                     mu_t * (1 + 1e-6), 0.5 * (1 + mu_t), 1 - 1e-12}) {
    hp.mu_product = bad;
    const std::vector<uint8_t> before = given.snapshot();
    std::vector<float> grad(given.size(), 0.5f);
    const forge_elementwise_args a = elementwise_args(given, hp, grad);
    EXPECT_EQ(forge_elementwise_step(&a), FORGE_ERR_INVALID_ARGUMENT) << bad;
    EXPECT_NE(std::string(forge_last_error()).find("hparams.mu_product"), std::string::npos)
        << forge_last_error();
    EXPECT_EQ(given.snapshot(), before) << bad;
  }
}

// Two param groups (two beta1) alternating at step ~10^6: every call is a new (beta1, step)
// pair, which a memoised loop pays O(step) for.
TEST(NAdamMuProduct, AlternatingGroupsCostConstantTime) {
  const auto start = std::chrono::steady_clock::now();
  alignas(16) unsigned char run[FORGE_RUN_SCALARS_BYTES];
  for (int64_t i = 0; i < 200; ++i) {
    const forge_hparams hp = nadam_at(1000000 + i / 2, i % 2 ? 0.9 : 0.95);
    ASSERT_EQ(forge_run_scalars_fill(&hp, run, sizeof(run)), FORGE_OK) << forge_last_error();
  }
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(),
            kPromptSeconds);
}

}  // namespace
}  // namespace forge_test

namespace forge_test {
namespace {

// A product of NAdam's momentum factors just below 1 is no product any run makes (each factor
// is below beta1 < 1, and the product through step t at most mu_t), and 1 / (1 - product)
// would blow the step up: refused by name, nothing written.
TEST(NAdamMuProduct, ProductAboveThisStepsFactorIsRefused) {
  forge_hparams hp = nadam_at(3, 0.9);
  hp.lr = 1e-3;
  HostParam p(2, 70, FORGE_WEIGHT_FP32, FORGE_STATE_FP32, hp);
  Rng rng(fresh_seed());
  p.randomize(rng, hp);
  std::vector<float> grad(p.size(), 0.5f);
  hp.mu_product = 1 - 1e-9;
  const std::vector<uint8_t> before = p.snapshot();
  const forge_elementwise_args a = elementwise_args(p, hp, grad);
  EXPECT_EQ(forge_elementwise_step(&a), FORGE_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(forge_last_error()).find("hparams.mu_product"), std::string::npos)
      << forge_last_error();
  EXPECT_EQ(p.snapshot(), before);
}

}  // namespace
}  // namespace forge_test
