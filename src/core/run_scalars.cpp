// run_scalars.cpp — filling and checking run_scalars buffers on the host (run_scalars.h).
#include "run_scalars.h"

#include <cstring>

#include "rule_table.h"
#include "status.h"

namespace forge {

uint64_t run_scalars_key(const forge_hparams& hp) {
  uint64_t h = mix64(0x4B45595F48504152ull ^ static_cast<uint64_t>(static_cast<uint32_t>(hp.abi_version)));
  h = mix64(h ^ static_cast<uint64_t>(static_cast<uint32_t>(hp.rule)));
  for (int f = 0; f < kFieldCount; ++f) {
    if (f == kFieldStep || f == kFieldLr || f == kFieldSeed || f == kFieldMuProduct) continue;
    double v = field_value(hp, f);
    if (v == 0.0) v = 0.0;  // -0 and +0 compare equal: one key
    uint64_t bits;
    std::memcpy(&bits, &v, 8);
    h = mix64(h ^ bits) + static_cast<uint64_t>(f);
  }
  return h;
}

void run_scalars_write(const forge_hparams& hp, const RuleScalars& k, void* out) {
  unsigned char* bytes = static_cast<unsigned char*>(out);
  std::memset(bytes, 0, FORGE_RUN_SCALARS_BYTES);
  std::memcpy(bytes, &k, sizeof(k));
  RunScalarsTag tag{};
  tag.magic = kRunScalarsMagic;
  tag.abi_version = FORGE_ABI_VERSION;
  tag.rule = k.rule;
  tag.num_states = k.num_states;
  tag.hparams_key = run_scalars_key(hp);
  std::memcpy(bytes + kRunScalarsTagOffset, &tag, sizeof(tag));
  tag.checksum = run_scalars_checksum(bytes);
  std::memcpy(bytes + kRunScalarsTagOffset, &tag, sizeof(tag));
}

forge_status run_scalars_check(const void* buffer, const forge_hparams& call,
                               const RuleScalars& call_k) {
  const forge_status bad = FORGE_ERR_INVALID_ARGUMENT;
  const unsigned char* bytes = static_cast<const unsigned char*>(buffer);
  RunScalarsTag tag;
  std::memcpy(&tag, bytes + kRunScalarsTagOffset, sizeof(tag));
  switch (run_scalars_tag_check(tag, run_scalars_checksum(bytes), call_k.rule, call_k.num_states,
                                run_scalars_key(call))) {
    case kRunScalarsMatch:
      return FORGE_OK;
    case kRunScalarsUnfilled:
      return fail(bad, "hparams.run_scalars: %p was not filled by forge_run_scalars_fill (no tag "
                  "in its last %d bytes)", buffer, static_cast<int>(sizeof(tag)));
    case kRunScalarsChecksum:
      return fail(bad, "hparams.run_scalars: %p does not match its checksum (changed or partly "
                  "copied since forge_run_scalars_fill wrote it)", buffer);
    case kRunScalarsAbi:
      return fail(bad, "hparams.run_scalars: filled by a libforge of ABI %d, this one speaks %d",
                  tag.abi_version, FORGE_ABI_VERSION);
    case kRunScalarsRule: {
      const char* filled = enum_name(FORGE_ENUM_RULE, tag.rule);
      return fail(bad, "hparams.run_scalars: filled for rule %s, but this step's rule is %s",
                  filled ? filled : "?", enum_name(FORGE_ENUM_RULE, call_k.rule));
    }
    case kRunScalarsNumStates:
      return fail(bad, "hparams.run_scalars: filled for %d state(s), but this step keeps %d",
                  tag.num_states, call_k.num_states);
    default:
      return fail(bad, "hparams.run_scalars: filled from hyper-parameters that differ from this "
                  "call's in more than step, lr, seed and mu_product");
  }
}

}  // namespace forge
