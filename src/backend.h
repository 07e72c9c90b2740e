// backend.h — what every backend implements. The C API (src/capi) checks all
// arguments and computes RuleScalars before calling in, so a backend may assume
// valid input and only reports its own failures (device errors, memory).
#pragma once

#include "core/rules.h"
#include "forge/forge.h"

#define FORGE_DECLARE_BACKEND                                                                  \
  forge_status wgrad_step(const forge_wgrad_args& args, const RuleScalars& k);                 \
  forge_status elementwise_step(const forge_elementwise_args& args, const RuleScalars& k);     \
  /* Sets state `index` of every element to `value`. */                                       \
  forge_status state_fill(const forge_param& p, int index, bool is_signed, float value,        \
                          const forge_device& device);                                         \
  forge_status state_to_fp32(const forge_param& p, int index, bool is_signed, float* out,      \
                             const forge_device& device);                                      \
  forge_status state_from_fp32(const forge_param& p, int index, bool is_signed,                \
                               const float* in, const forge_device& device);

namespace forge {
// A state_from_fp32 refusal: in[i] = `value` is not a value state `index` may hold (not
// storable; otherwise negative, and the state unsigned). Every backend's message.
forge_status refuse_state_value(int64_t i, float value, int index);

namespace cpu {
FORGE_DECLARE_BACKEND
}  // namespace cpu
#if defined(FORGE_WITH_CUDA)
namespace cuda {
FORGE_DECLARE_BACKEND
}  // namespace cuda
#endif
}  // namespace forge
