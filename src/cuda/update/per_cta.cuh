// per_cta.cuh — what a kernel does once per CTA around its updates: the step's scalars read
// from device memory and checked (run_scalars_refused, CUDA graphs: a replay brings new
// ones), and the by-products reduced (flush_totals: grad_sq_sum and nonfinite_count, one
// atomic per CTA and output).
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include "core/rules.h"
#include "core/run_scalars.h"
#include "cuda/ptx.cuh"
#include "cuda/update/spec.cuh"

namespace forge {
namespace cuda {

// ---- run scalars (CUDA graphs) ------------------------------------------------------------------
//
// The CTA's copy of the step's RuleScalars (shared memory), filled by run_scalars_refused from
// the words it checked.
// NOTE: a kRunScalars kernel reads its scalars here, not through run_k: the compiler cannot
// tell run_k from the weight and state arrays the update stores to, so it would reload every
// scalar from global memory in every pass.
static_assert(sizeof(RuleScalars) % 8 == 0, "RuleScalars is whole 8-byte words");
constexpr int kRuleScalarsWords = static_cast<int>(sizeof(RuleScalars) / 8);
static_assert(kRuleScalarsWords <= kRunScalarsWords, "the checked words cover the scalars");
__device__ __forceinline__ RuleScalars& run_scalars_copy() {
  __shared__ RuleScalars copy;
  return copy;
}

// A kRunScalars kernel reads the step's RuleScalars from hparams.run_scalars when it runs, so it
// checks that buffer's tag there (run_scalars.h: filled, unchanged since, for this rule, state
// count and hyper-parameters), at every replay of a captured graph, before it writes anything.
// On a mismatch the launch writes nothing: every CTA returns, and the first one adds
// `elements` (rows · cols: every element, skipped) to *nonfinite_count where the step has one
// (forge.h, forge_hparams.run_scalars). `rule`, `num_states`: the launch's own RuleScalars';
// `key`: run_scalars_key() of the call's hyper-parameters.
// Returns whether the CTA must return. Every thread of the CTA must call it, before the kernel
// writes anything or reads the scalars (it ends with a __syncthreads); warp 0 reads the
// buffer, one 8-byte word per lane, and leaves the scalars it checked in run_scalars_copy(),
// where the kernel then reads them.
// NOTE: per CTA, one read of the buffer (L2) and one hash per lane, then a shuffle reduction:
// the checksum's terms are independent (run_scalars_checksum), not a chain of 31 hashes.
__device__ __forceinline__ bool run_scalars_refused(const RuleScalars* run_k, int32_t rule,
                                                    int32_t num_states, uint64_t key,
                                                    int64_t elements,
                                                    unsigned long long* nonfinite_count) {
  __shared__ int s_refused;
  if (threadIdx.x < 32) {
    const int lane = static_cast<int>(threadIdx.x);
    const unsigned char* bytes = reinterpret_cast<const unsigned char*>(run_k);
    uint64_t term = 0;
    if (lane < kRunScalarsWords) {
      const uint64_t word = reinterpret_cast<const uint64_t*>(bytes)[lane];
      term = run_scalars_word_hash(word, lane);
      if (lane < kRuleScalarsWords) reinterpret_cast<uint64_t*>(&run_scalars_copy())[lane] = word;
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1)
      term += __shfl_xor_sync(0xFFFFFFFFu, term, offset);
    if (lane == 0) {
      RunScalarsTag tag;
      memcpy(&tag, bytes + kRunScalarsTagOffset, sizeof(tag));
      const bool refused = run_scalars_tag_check(tag, run_scalars_checksum_of_sum(term), rule,
                                                 num_states, key) != kRunScalarsMatch;
      s_refused = refused ? 1 : 0;
      if (refused && nonfinite_count != nullptr && blockIdx.x == 0 && blockIdx.y == 0 &&
          blockIdx.z == 0)
        atomicAdd(nonfinite_count, static_cast<unsigned long long>(elements));
    }
  }
  __syncthreads();
  return s_refused != 0;
}

// ---- the by-products, once per CTA --------------------------------------------------------------
// Warp shuffles, then one shared-memory slot per warp, then one atomic per CTA and
// output. Every one of the kThreads threads must call this: with kBarrier == 0 they are the
// whole CTA (__syncthreads, tid = threadIdx.x); otherwise they are the warps that share named
// barrier kBarrier, tid their index among them.
template <int kThreads, int kBarrier = 0>
__device__ __forceinline__ void flush_totals(StepTotals t, double* grad_sq_sum,
                                             unsigned long long* nonfinite_count,
                                             int tid = -1) {
  constexpr int kWarps = kThreads / 32;
  __shared__ double s_sq[kWarps];
  __shared__ unsigned int s_nf[kWarps];
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    t.grad_sq_sum += __shfl_xor_sync(0xFFFFFFFFu, t.grad_sq_sum, offset);
    t.nonfinite += __shfl_xor_sync(0xFFFFFFFFu, t.nonfinite, offset);
  }
  if (kBarrier == 0) tid = threadIdx.x;
  const int warp = tid / 32, lane = tid % 32;
  if (lane == 0) {
    s_sq[warp] = t.grad_sq_sum;
    s_nf[warp] = t.nonfinite;
  }
  if constexpr (kBarrier == 0) {
    __syncthreads();
  } else {
    named_barrier_sync<kBarrier, kThreads>();
  }
  if (tid == 0) {
    double sq = 0.0;
    unsigned long long nf = 0;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      sq += s_sq[w];
      nf += s_nf[w];
    }
    if (grad_sq_sum != nullptr && sq != 0.0) atomicAdd(grad_sq_sum, sq);
    if (nonfinite_count != nullptr && nf != 0) atomicAdd(nonfinite_count, nf);
  }
}

}  // namespace cuda
}  // namespace forge
