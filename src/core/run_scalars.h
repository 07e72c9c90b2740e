// run_scalars.h — what a run_scalars buffer (forge_hparams.run_scalars, forge_run_scalars_fill)
// holds: the step's RuleScalars at offset 0, where the CUDA kernels read them, and at the
// buffer's end a tag saying what they were filled for. A step checks the tag before it uses
// the scalars: an unfilled buffer, one filled for another rule or other hyper-parameters, or
// a corrupted or partial copy is refused instead of read. The checksum is host and device
// code, so a kernel can check a buffer the host never sees (a CUDA graph's replay).
#pragma once

#include <stdint.h>
#include <string.h>

#include "forge/forge.h"
#include "rng.h"
#include "rules.h"

namespace forge {

struct RunScalarsTag {
  uint32_t magic;        // kRunScalarsMagic
  int32_t abi_version;   // FORGE_ABI_VERSION of the library that filled it
  int32_t rule;          // == RuleScalars::rule
  int32_t num_states;    // == RuleScalars::num_states
  uint64_t hparams_key;  // run_scalars_key() of the hyper-parameters it was filled from
  uint64_t checksum;     // run_scalars_checksum() of the buffer
};

constexpr int kRunScalarsTagOffset = FORGE_RUN_SCALARS_BYTES - static_cast<int>(sizeof(RunScalarsTag));
constexpr uint32_t kRunScalarsMagic = 0x33535246u;  // "FRS3" in memory order
static_assert(sizeof(RunScalarsTag) == 32, "the tag is 4 words");
static_assert(sizeof(RuleScalars) <= kRunScalarsTagOffset, "the scalars end before the tag");
static_assert(kRunScalarsTagOffset % 16 == 0, "the tag is 16-byte aligned like the buffer");

// A hash of the buffer's bytes before the checksum: the scalars, the zero bytes after them
// and the tag's first three words. `buffer` is FORGE_RUN_SCALARS_BYTES, 8-byte aligned.
FORGE_HD uint64_t run_scalars_checksum(const void* buffer) {
  constexpr int kWords = (kRunScalarsTagOffset + 24) / 8;
  const unsigned char* bytes = static_cast<const unsigned char*>(buffer);
  uint64_t h = 0x52554E5343414C53ull;  // "RUNSCALS"
  for (int i = 0; i < kWords; ++i) {
    uint64_t word;
    memcpy(&word, bytes + 8 * i, 8);
    h = mix64(h ^ word) + static_cast<uint64_t>(i);
  }
  return h;
}

#if !defined(__CUDA_ARCH__)
// A hash of every forge_hparams field but step, lr, seed and run_scalars: the fields a
// buffer's scalars may differ in from the call that reads them (-0 and +0 hash alike).
uint64_t run_scalars_key(const forge_hparams& hp);
// Writes the buffer: `k` at offset 0, zeros, the tag. `out` holds FORGE_RUN_SCALARS_BYTES.
void run_scalars_write(const forge_hparams& hp, const RuleScalars& k, void* out);
// Checks `buffer` (host memory) against the call's hyper-parameters and scalars; the message
// names hparams.run_scalars and what does not match.
forge_status run_scalars_check(const void* buffer, const forge_hparams& call,
                               const RuleScalars& call_k);
#endif

}  // namespace forge
