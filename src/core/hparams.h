// hparams.h — checking hyper-parameters and turning them into the per-step
// fp32 scalars the element code consumes (computed in double, once per call).
#pragma once

#include <cmath>
#include <cstdint>

#include "forge/forge.h"
#include "rules.h"

namespace forge {

forge_status default_hparams(int rule, forge_hparams* out);
// Checks every field the rule uses, and the fp32 scalars made from them (finite, non-zero
// where zero is invalid); the message names the field. On success `scalars` (nullable)
// receives make_rule_scalars(hp).
forge_status validate_hparams(const forge_hparams& hp, RuleScalars* scalars = nullptr);
// Which states the rule keeps (count, signedness, torch names). hp must be valid.
forge_status state_layout(const forge_hparams& hp, int format, int64_t rows, int64_t cols,
                          forge_state_layout* out);
RuleScalars make_rule_scalars(const forge_hparams& hp);

// NAdam's mu_i = beta1 (1 − ½ · 0.96^(i ψ)), ψ = momentum_decay.
inline double nadam_mu(double beta1, double momentum_decay, double i) {
  return beta1 * (1.0 - 0.5 * std::pow(0.96, i * momentum_decay));
}

// Π_{i=1..t} mu_i in constant time: Π = beta1^t · Π_i (1 − ½ q^i), q = 0.96^ψ, and
//   ln Π_i (1 − ½ q^i) = −Σ_{k≥1} (½)^k / k · q^k (1 − q^(kt)) / (1 − q^k)
// (log1p's series, summed over i first). 1 − q^k and 1 − q^(kt) come from expm1 and a
// recurrence of positive terms, so nothing cancels; the terms fall by more than half each,
// so once one is below 2^-54 of the sum the rest add less than that. ψ = 0 (or so small that
// q rounds to 1): every factor is beta1 / 2. Inline: the tests call it.
inline double nadam_mu_product(double beta1, double momentum_decay, int64_t t) {
  struct SeriesCoefficients {  // (½)^k / k, k = 1 .. 64
    double c[64];
    constexpr SeriesCoefficients() : c() {
      double half_k = 1.0;
      for (int k = 1; k <= 64; ++k) {
        half_k *= 0.5;
        c[k - 1] = half_k / k;
      }
    }
  };
  static constexpr SeriesCoefficients kSeries{};
  const double td = static_cast<double>(t);
  const double ln_q = momentum_decay * std::log(0.96);
  const double one_minus_q = -std::expm1(ln_q);
  if (!(one_minus_q > 0.0)) return std::pow(0.5 * beta1, td);
  const double q = std::exp(ln_q), q_t = std::exp(td * ln_q), one_minus_q_t = -std::expm1(td * ln_q);
  double a = one_minus_q, b = one_minus_q_t;  // 1 − q^k, 1 − q^(kt)
  double q_k = q, q_kt = q_t, sum = 0.0;
  for (int k = 1; k <= 64; ++k) {
    const double term = kSeries.c[k - 1] * q_k * (b / a);
    sum += term;
    if (term <= sum * 0x1p-54) break;
    a += q_k * one_minus_q;    // 1 − q^(k+1) = (1 − q^k) + q^k (1 − q)
    b += q_kt * one_minus_q_t;  // 1 − q^((k+1)t) = (1 − q^(kt)) + q^(kt) (1 − q^t)
    q_k *= q;
    q_kt *= q_t;
  }
  return std::pow(beta1, td) * std::exp(-sum);
}

}  // namespace forge
