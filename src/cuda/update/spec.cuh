// spec.cuh — what an update is compiled for and what it works on: UpdateSpec (the rule and
// formats as compile-time constants, or GenericSpec: everything at run time), ParamView (the
// parameter as the kernels see it) and StepTotals (a thread's by-products). The bottom layer
// of the update's device code (update.cuh lists the layers); host code uses it too
// (spec_matches picks a kernel, make_param_view fills a ParamView).
//
// Why specialize: for the hot configurations (AdamW, Lion, SGD on bf16 weights with bf16 /
// int8 / fp8 / fp32 states; Muon's momentum beside its bf16 direction) every run-time switch of the generic path folds away. Both paths
// call the same forge::apply_rule and formats.h functions: only the dispatch differs, never
// an fp32 operation.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include "core/formats.h"
#include "core/rules.h"
#include "forge/forge.h"

namespace forge {
namespace cuda {

// int8, fp8 and int4 states: a code per element (a byte; int4: half of one, two to a byte), an
// fp32 absmax per 64-column block of a row.
__host__ __device__ constexpr bool is_block_format(int state_format) {
  return state_format == FORGE_STATE_INT8_BLOCK64 || state_format == FORGE_STATE_FP8_BLOCK64 ||
         state_format == FORGE_STATE_INT4_BLOCK64;
}

// ---- compile-time specialization ----------------------------------------------------------------

constexpr int kAny = -1;  // "read it from the run-time RuleScalars / ParamView"

// States a rule keeps and whether state i is signed (int8 map): hparams.cpp's state_layout()
// for the rules that have an UpdateSpec. The host (spec_matches) checks them against the
// RuleScalars before it picks a specialized kernel, so a disagreement falls back to the
// generic path instead of computing something else.
__host__ __device__ constexpr int spec_num_states(int rule) {
  return rule == FORGE_RULE_ADAMW                                 ? 2
         : rule == FORGE_RULE_LION || rule == FORGE_RULE_MUON ? 1
                                                                  : 0;
}
__host__ __device__ constexpr bool spec_state_signed(int rule, int i) {
  return (rule == FORGE_RULE_ADAMW || rule == FORGE_RULE_LION || rule == FORGE_RULE_MUON) &&
         i == 0;
}

// kRule / kWeightFormat / kStateFormat: forge_rule / forge_weight_format /
// forge_state_format values, or kAny. A specialized spec (kRule != kAny) also assumes
// maximize == 0 and wd_coupled == 0 (AdamW with decoupled decay, Lion, SGD without decay):
// apply_rule's two branches on them then fold away. spec_matches() checks all of it.
// kRunScalars: the kernel reads the step's RuleScalars from device memory when it runs
// (forge_hparams.run_scalars: a CUDA graph replays with new ones), not from its launch
// parameters. A separate instantiation, so the usual kernels keep their scalars as
// constant-bank operands.
template <int kRuleT, int kWeightFormatT, int kStateFormatT, bool kRunScalarsT = false>
struct UpdateSpec {
  static constexpr int kRule = kRuleT;
  static constexpr int kWeightFormat = kWeightFormatT;
  static constexpr int kStateFormat = kStateFormatT;
  static constexpr bool kGeneric = kRuleT == kAny;
  static_assert(kGeneric == (kWeightFormatT == kAny), "specialize everything or nothing");
  static constexpr int kNumStates = kGeneric ? FORGE_MAX_STATES : spec_num_states(kRuleT);
  static constexpr bool kRunScalars = kRunScalarsT;
};
using GenericSpec = UpdateSpec<kAny, kAny, kAny>;
using GenericRunSpec = UpdateSpec<kAny, kAny, kAny, true>;

// Whether Spec computes exactly what the generic path would for this (k, p).
template <class Spec>
__host__ __device__ inline bool spec_matches(const RuleScalars& k, int weight_format,
                                             int state_format) {
  if (Spec::kGeneric) return true;
  if (k.rule != Spec::kRule || weight_format != Spec::kWeightFormat) return false;
  if (k.maximize != 0 || k.wd_coupled != 0.0f) return false;
  if (k.num_states != Spec::kNumStates) return false;
  if (Spec::kNumStates > 0 && state_format != Spec::kStateFormat) return false;
  for (int i = 0; i < Spec::kNumStates; ++i)
    if ((k.state_signed[i] != 0) != spec_state_signed(Spec::kRule, i)) return false;
  return true;
}

// ---- the parameter and the by-products ----------------------------------------------------------

// Everything a kernel needs to know about the parameter being updated. Built on the
// host from forge_param; `vec4` says 4-element vector accesses are legal (cols % 4 == 0
// and every buffer 16-byte aligned).
struct ParamView {
  int64_t rows, cols;      // [rows, cols] row-major, contiguous
  int64_t blocks_per_row;  // ceil(cols / 64): row stride of the int8 / fp8 absmax arrays
  int32_t weight_format, state_format;
  int32_t vec4;
  void* weight;            // [rows, cols] fp32 or bf16
  float* master;           // [rows, cols] fp32 (FORGE_WEIGHT_BF16_MASTER only)
  void* state[FORGE_MAX_STATES];     // [rows, cols] fp32 / bf16 / uint8 codes; int4:
                                     // [rows, int4_row_bytes(cols)] bytes
  float* absmax[FORGE_MAX_STATES];   // [rows, blocks_per_row] (int8, fp8 and int4 only)
  // Stochastic rounding's element index (rng.h) of element (row, col), at offset
  // idx = row * cols + col: idx + sr_base + row * sr_row_extra. A shard's
  // (row_offset + row) * full_cols + col_offset + col (forge_param); 0 and 0 otherwise.
  int64_t sr_base, sr_row_extra;

  __host__ __device__ __forceinline__ int64_t sr_index(int64_t row, int64_t idx) const {
    return idx + sr_base + row * sr_row_extra;
  }
  // int4 states: the byte holding element (row, col) (formats.h's packed rows).
  __host__ __device__ __forceinline__ int64_t int4_byte(int64_t row, int64_t col) const {
    return row * int4_row_bytes(cols) + col / 2;
  }
};

// Per-thread by-products of a step, reduced once per CTA at the end of a kernel.
struct StepTotals {
  double grad_sq_sum;
  unsigned int nonfinite;
};

}  // namespace cuda
}  // namespace forge
