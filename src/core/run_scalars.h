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

// The 8-byte words the checksum covers: the scalars, the zero bytes after them and the tag's
// first three words (everything before the checksum).
constexpr int kRunScalarsWords = (kRunScalarsTagOffset + 24) / 8;
static_assert(kRunScalarsWords <= 32, "one word per lane of a warp");

// Word i's term of the checksum.
FORGE_HD uint64_t run_scalars_word_hash(uint64_t word, int i) {
  return mix64(word + static_cast<uint64_t>(i + 1) * 0x9E3779B97F4A7C15ull);
}
// The checksum of the sum (wrapping) of the words' terms.
FORGE_HD uint64_t run_scalars_checksum_of_sum(uint64_t sum) {
  return mix64(sum ^ 0x52554E5343414C53ull);  // "RUNSCALS"
}
// A hash of the buffer's bytes before the checksum. `buffer` is FORGE_RUN_SCALARS_BYTES,
// 8-byte aligned.
// NOTE: a sum of independent per-word terms, not a chain: a warp computes it in one hash and a
// 5-step shuffle reduction (update.cuh, run_scalars_refused) where a chain took 31 dependent
// hashes at the start of every CTA of a graph's step. Each term depends on its word and its
// position: a changed, moved or missing word changes the checksum (but for a 2^-64 chance).
FORGE_HD uint64_t run_scalars_checksum(const void* buffer) {
  const unsigned char* bytes = static_cast<const unsigned char*>(buffer);
  uint64_t sum = 0;
  for (int i = 0; i < kRunScalarsWords; ++i) {
    uint64_t word;
    memcpy(&word, bytes + 8 * i, 8);
    sum += run_scalars_word_hash(word, i);
  }
  return run_scalars_checksum_of_sum(sum);
}

// What a buffer's tag says against a step that would read it: kMatch, or the first check that
// fails, in this order. `rule` and `num_states` are the step's (its RuleScalars'), `key` its
// run_scalars_key(). Host and device code: run_scalars_check (the CPU backend, at the call) and
// the CUDA kernels (when they run, at every replay of a captured graph) make the same checks.
enum RunScalarsTagCheck : int {
  kRunScalarsMatch = 0,
  kRunScalarsUnfilled,     // no magic: never filled
  kRunScalarsChecksum,     // changed or partly copied since the fill
  kRunScalarsAbi,          // filled by a libforge of another ABI
  kRunScalarsRule,         // filled for another rule
  kRunScalarsNumStates,    // ... another state count
  kRunScalarsHparams,      // ... hyper-parameters that differ in more than step, lr, seed and
                           // mu_product
};
// `checksum`: run_scalars_checksum(buffer), however computed.
FORGE_HD RunScalarsTagCheck run_scalars_tag_check(const RunScalarsTag& tag, uint64_t checksum,
                                                  int32_t rule, int32_t num_states,
                                                  uint64_t key) {
  if (tag.magic != kRunScalarsMagic) return kRunScalarsUnfilled;
  if (tag.checksum != checksum) return kRunScalarsChecksum;
  if (tag.abi_version != FORGE_ABI_VERSION) return kRunScalarsAbi;
  if (tag.rule != rule) return kRunScalarsRule;
  if (tag.num_states != num_states) return kRunScalarsNumStates;
  if (tag.hparams_key != key) return kRunScalarsHparams;
  return kRunScalarsMatch;
}

// Host code (run_scalars.cpp); declared for every compilation pass, the CUDA backend's host
// code included.
// A hash of every forge_hparams field but step, lr, seed, mu_product and run_scalars: the
// fields a buffer's scalars may differ in from the call that reads them (-0 and +0 hash
// alike).
uint64_t run_scalars_key(const forge_hparams& hp);
// Writes the buffer: `k` at offset 0, zeros, the tag. `out` holds FORGE_RUN_SCALARS_BYTES.
void run_scalars_write(const forge_hparams& hp, const RuleScalars& k, void* out);
// Checks `buffer` (host memory) against the call's hyper-parameters and scalars; the message
// names hparams.run_scalars and what does not match.
forge_status run_scalars_check(const void* buffer, const forge_hparams& call,
                               const RuleScalars& call_k);

}  // namespace forge
