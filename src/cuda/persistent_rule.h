// persistent_rule.h — where the CUDA backend runs the persistent Hopper kernel
// (sm90_wgrad.cuh) by default instead of the two-CTA kernel: the layers, formats and token
// counts on which it measured faster. Host code without CUDA, so that the CPU suite checks the
// rule too (tests/cpp/test_persistent_rule.cpp); cuda_backend.cu applies it, and
// FORGE_CUDA_PERSISTENT=1 / =0 overrides it there.
#pragma once

#include <cstdint>

#include "forge/forge.h"

namespace forge {
namespace cuda {

// Whether the persistent kernel is the faster one for a step of `tokens` tokens on a layer of
// `tiles` tiles in these formats. `spec_kernel`: it has a specialized kernel for the step's
// rule and formats (AdamW, bf16 or bf16-SR weight, bf16, bf16-SR or int8 states; bf16 inputs).
// NOTE: measured on the H200 against the two-CTA kernel, interleaved (runs 85-86 and 89-90,
// bench/NOTES.md v20). gate_proj and down_proj of Llama-3.1-8B (27 tiles per SM), the
// persistent kernel's time against the two-CTA kernel's, by T:
//   T:                    768     1024       2048         4096        8192
//   bf16 W, bf16 states:  +1 %    -9 %       -6 to -12    -2 to 0     -2 to 0
//   bf16 W, int8 states:  +9 %    0 to +2    -4 to -11    -6 to -9    -2 to -4
//   SR W, SR states:      -2 %    -5 to -6   -3 to -10    -1 to +2    0 to +2
//   SR W, int8 states:    +25 %   +14        -5 to +6     -2 to -7    -3 to -4
// At T = 512 it is slower in every format (run 85): there its update, 8 warps per SM against up
// to 16 when both CTAs of the two-CTA kernel update, is the limit. On layers of few tiles per
// SM it loses (k_proj, v_proj: 1.9), and on 7.8 (q_proj, o_proj) it is mixed.
constexpr int64_t kPersistentMinTilesPerSm = 16;
struct PersistentWindow {
  int weight_format, state_format;
  int64_t min_tokens, max_tokens;  // [min, max]
};
constexpr int64_t kNoMaxTokens = INT64_MAX;
constexpr PersistentWindow kPersistentWindows[] = {
    {FORGE_WEIGHT_BF16, FORGE_STATE_BF16, 1024, kNoMaxTokens},
    {FORGE_WEIGHT_BF16, FORGE_STATE_INT8_BLOCK64, 2048, kNoMaxTokens},
    {FORGE_WEIGHT_BF16_STOCHASTIC, FORGE_STATE_BF16_STOCHASTIC, 1024, 4095},
    {FORGE_WEIGHT_BF16_STOCHASTIC, FORGE_STATE_INT8_BLOCK64, 4096, kNoMaxTokens},
};
constexpr bool persistent_pays(int64_t tokens, int64_t tiles, int num_sms, int weight_format,
                               int state_format, bool spec_kernel) {
  if (!spec_kernel || tiles < kPersistentMinTilesPerSm * static_cast<int64_t>(num_sms))
    return false;
  for (const PersistentWindow& w : kPersistentWindows)
    if (w.weight_format == weight_format && w.state_format == state_format)
      return tokens >= w.min_tokens && tokens <= w.max_tokens;
  return false;
}

}  // namespace cuda
}  // namespace forge
