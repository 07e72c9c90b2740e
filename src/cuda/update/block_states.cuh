// block_states.cuh — the warp-cooperative side of int8 / fp8 / int4 block states: the lanes that
// share a block (group_max, group_any), where a batch's quads sit in their blocks (QuadBlocks:
// the classic and the paired layout), each block's maximum and factor computed once and
// shuffled to its lanes, the absmax of a block holding a skipped element
// (kept_block_absmax), and a batch's block states encoded and stored in one straight region
// (store_block_states). Every function here must be called by every lane of the warp.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include "core/formats.h"
#include "cuda/update/block_codecs.cuh"
#include "cuda/update/quads.cuh"
#include "cuda/update/spec.cuh"
#include "forge/forge.h"

namespace forge {
namespace cuda {

// ---- the lanes of a block -----------------------------------------------------------------------

// Max over the kLanes lanes (16: a half-warp; 8: a quarter) that share a block. Every lane of
// the warp must call it.
// NOTE: fmaxf drops NaN operands, exactly like the CPU's std::max(absmax, |x|) fold that
// starts at 0, so the block absmax is the max of the non-NaN magnitudes on both sides.
template <int kLanes = kGroupLanes>
__device__ __forceinline__ float group_max(float v) {
#pragma unroll
  for (int offset = kLanes / 2; offset > 0; offset >>= 1)
    v = fmaxf(v, __shfl_xor_sync(0xFFFFFFFFu, v, offset));
  return v;
}

// Whether `v` holds in any of the kLanes lanes that share a block. Every lane of the warp must
// call it (the kernels' blocks are 1-D and whole warps, so the lane's bits above kLanes - 1 in
// threadIdx.x name its group).
template <int kLanes = kGroupLanes>
__device__ __forceinline__ bool group_any(bool v) {
  const unsigned ballot = __ballot_sync(0xFFFFFFFFu, v);
  return ((ballot >> (threadIdx.x & (32u - kLanes))) & ((1u << kLanes) - 1u)) != 0u;
}

// ---- a pass's blocks, one per lane --------------------------------------------------------------
//
// Where a batch's kQ quads per lane sit in their blocks (int8 / fp8 states):
//  - the classic layout (kPaired = false): the 16 lanes of a half-warp cover a block with one
//    quad each, so each of a lane's quads is in a block of its own (quad q at column 64·q +
//    4·lane16 of a 128-column tile row; the element-wise kernels alike);
//  - paired (update_tile's pipelined passes): 8 lanes cover a block with both their quads
//    (quad q at column 64·(lane16 / 8) + 32·q + 4·(lane16 % 8)), so a lane's quads share one
//    block per state and a block's reductions span 8 lanes instead of 16.
// Either way a lane's pass touches kBlocks = states × kPerState blocks (block b = state
// b / kPerState, the lane's quads' block b % kPerState), and each block's absmax and factors
// are the same in all kLanes lanes that share it. Those lanes are split into kBlocks runs of
// kLanes / kBlocks, run b computing block b's, and every lane takes the others by shuffle.
// Every lane of the warp must call these (the kernels' blocks are whole warps, so the bits of
// threadIdx.x above kLanes - 1 name the lanes' group, as group_any assumes).
// NOTE: each block's factor is computed by one run of lanes and shuffled to the others: a
// factor is ~19 instructions (the scaling selects, the domain test, the division sequence),
// which every lane computing every factor of its pass would repeat. Paired, a lane's pass
// has half the blocks: 3 shuffle steps of the maxima instead of 5, and half the gathers,
// absmax loads and stores.
template <bool kPaired, int kQ>
struct QuadBlocks {
  static_assert(!kPaired || kQ * kQuad * 8 == FORGE_INT8_BLOCK, "paired: 8 lanes × kQ quads");
  static constexpr int kLanes = kPaired ? 8 : kGroupLanes;  // lanes sharing a block
  static constexpr int kPerState = kPaired ? 1 : kQ;        // a lane's blocks per state
  // The lane's block (of kPerState) that holds its quad q.
  static __host__ __device__ constexpr int of(int q) { return kPaired ? 0 : q; }
  // Whether this lane holds its blocks' first column (it reads and writes their absmax).
  static __device__ __forceinline__ bool first() { return threadIdx.x % kLanes == 0; }
  // The tile column of the lane's quad q in a 128-column row (update_tile's passes).
  static __host__ __device__ constexpr int column(int lane16, int q) {
    return kPaired ? FORGE_INT8_BLOCK * (lane16 / 8) + 32 * q + kQuad * (lane16 % 8)
                   : FORGE_INT8_BLOCK * q + kQuad * lane16;
  }
};

template <int kNumStates, int kPerState, int kLanes>
__device__ __forceinline__ int lane_block() {
  constexpr int kBlocks = kNumStates * kPerState;
  static_assert(kBlocks >= 1 && kBlocks <= kLanes && (kBlocks & (kBlocks - 1)) == 0,
                "a power of two of blocks, at most one per lane");
  return static_cast<int>(threadIdx.x % kLanes) / (kLanes / kBlocks);
}

// The largest of each block's values over the kLanes lanes, scattered: m[b] is this lane's
// partial maximum of block b; the result is block lane_block()'s maximum. A butterfly whose
// first steps exchange half of the remaining blocks (the lane keeps the half its bit selects)
// and whose last steps reduce the one left: for 4 blocks over 16 lanes, 5 shuffles and 5 max
// instead of 16 of each (group_max per block).
// NOTE: fmaxf drops NaN operands and is exact on magnitudes, so the order of the maxima does
// not change the result (group_max's note).
template <int kBlocks, int kLanes>
__device__ __forceinline__ float group_max_scatter(float (&m)[kBlocks]) {
  static_assert(kBlocks >= 1 && kBlocks <= kLanes && (kBlocks & (kBlocks - 1)) == 0,
                "a power of two of blocks");
  int count = kBlocks;
#pragma unroll
  for (int offset = kLanes / 2; offset > 0; offset >>= 1) {
    const int half = count > 1 ? count / 2 : 1;
    const bool upper = (threadIdx.x & offset) != 0;
#pragma unroll
    for (int k = 0; k < half; ++k) {
      if (count > 1) {
        const float send = upper ? m[k] : m[k + half];
        const float keep = upper ? m[k + half] : m[k];
        m[k] = fmaxf(keep, __shfl_xor_sync(0xFFFFFFFFu, send, offset));
      } else {
        m[k] = fmaxf(m[k], __shfl_xor_sync(0xFFFFFFFFu, m[k], offset));
      }
    }
    count = half;
  }
  return m[0];
}

// The lane's block's decode (kDecode: absmax / top) or encode (top / absmax) factor, given that
// block's absmax and state; the IEEE quotient (fp8_block_factor, with the division for every
// lane of the warp when any lane's absmax is outside its domain).
template <bool kDecode, int kRule, int kNumStates>
__device__ __forceinline__ float fp8_lane_factor(float absmax, int state) {
  float top = fp8_format(spec_state_signed(kRule, 0)).top;
#pragma unroll
  for (int i = 1; i < kNumStates; ++i)
    if (state == i) top = fp8_format(spec_state_signed(kRule, i)).top;
  bool ok = true;
  float factor = fp8_block_factor<kDecode>(absmax, top, ok);
  if (!__all_sync(0xFFFFFFFFu, ok)) factor = kDecode ? absmax / top : top / absmax;
  return factor;
}

// Every block's value of the pass from the lanes that hold it (lane_block).
template <int kNumStates, int kPerState, int kLanes>
__device__ __forceinline__ void gather_blocks(float own, float (&all)[kNumStates][kPerState]) {
  constexpr int kRun = kLanes / (kNumStates * kPerState);  // lanes per block
  const int group = static_cast<int>(threadIdx.x & (32u - kLanes));
#pragma unroll
  for (int i = 0; i < kNumStates; ++i)
#pragma unroll
    for (int b = 0; b < kPerState; ++b)
      all[i][b] = __shfl_sync(0xFFFFFFFFu, own, group | ((i * kPerState + b) * kRun));
}

// ---- blocks holding a skipped element -----------------------------------------------------------

// A block's new absmax when it may hold skipped elements (forge.h, "Skipped elements";
// cpu_backend.cpp, store_state): `v` this lane's kN quads of the block's new values (n[j] in
// range; a skipped element's is its decoded old value), bit e of `keep[j]` set where element e
// of quad j was skipped; kLanes lanes share the block. A block without a skipped element takes
// the largest magnitude of its values, as store_block_states' usual path does. A block holding
// one takes formats.h's block_absmax_with_skipped(its old absmax, the updated elements'
// largest magnitude, -inf when none), the CPU's function (the old absmax while that fits, a
// NaN one kept; else the old one times the smallest power of two that holds it), and
// `code_keep[j]` receives the elements whose code bytes stay: the skipped ones while that
// absmax is the old one bit for bit, none when it changed (they are then re-encoded from their
// decoded values, which keeps their values). `old_absmax`: the block's absmax slot, read by
// the lane that writes it (`first`, the block's first column's) before it does. Every lane of
// the warp must call it.
// NOTE: only warps with a skipped element come here (a vote per batch): the growth by a power
// of two (two frexpf, an ldexpf, a compare and a multiply per block and lane) adds nothing to
// the fast path's instructions.
template <int kLanes, int kN>
__device__ __forceinline__ float kept_block_absmax(const float* old_absmax, const int (&n)[kN],
                                                   const unsigned (&keep)[kN], bool first,
                                                   bool fp8, const float (&v)[kN][kQuad],
                                                   unsigned (&code_keep)[kN]) {
  unsigned any_keep = 0u;
#pragma unroll
  for (int j = 0; j < kN; ++j) any_keep |= keep[j];
  const bool kept = group_any<kLanes>(any_keep != 0u);
  float old = 0.0f;
  if (kept && first) old = *old_absmax;
  float m = kept ? -INFINITY : 0.0f;  // updated magnitudes are never NaN: fmaxf is exact here
#pragma unroll
  for (int j = 0; j < kN; ++j)
#pragma unroll
    for (int e = 0; e < kQuad; ++e)
      if (e < n[j] && !((keep[j] >> e) & 1u)) m = fmaxf(m, fabsf(v[j][e]));
  m = group_max<kLanes>(m);
  old = __shfl_sync(0xFFFFFFFFu, old, static_cast<int>(threadIdx.x & (32u - kLanes)));
  const float amax = kept ? block_absmax_with_skipped(old, m, fp8) : fp8 ? fp8_block_absmax(m) : m;
#pragma unroll
  for (int j = 0; j < kN; ++j)
    code_keep[j] = kept && float_bits(amax) == float_bits(old) ? keep[j] : 0u;
  return amax;
}
// One quad per lane, a half-warp per block (store_state_quad's layout).
__device__ __forceinline__ float kept_block_absmax(const float* old_absmax, int n, unsigned keep,
                                                   int lane16, bool fp8, const float (&v)[kQuad],
                                                   unsigned& code_keep) {
  const int n1[1] = {n};
  const unsigned keep1[1] = {keep};
  float v1[1][kQuad];
#pragma unroll
  for (int e = 0; e < kQuad; ++e) v1[0][e] = v[e];
  unsigned code_keep1[1];
  const float amax =
      kept_block_absmax<kGroupLanes, 1>(old_absmax, n1, keep1, lane16 == 0, fp8, v1, code_keep1);
  code_keep = code_keep1[0];
  return amax;
}

// ---- block states of a batch of quads, in one straight run --------------------------------------
//
// store_state_quad's int8 / fp8 case (kSF) for every state and quad of a batch at once
// (specialized Specs, where the state count and signedness are compile-time): every block's
// absmax, then int8's ratios |x| / absmax (int8_quad_ratios) or fp8's encode factors
// (fp8_block_factor), with one IEEE fallback for the whole batch, every code, and the stores.
// The same codes and absmax as store_state_quad.
// NOTE: one region for the batch: one quad and state at a time, each encode is a branch
// region of its own (the n > 0 store, the ratio fallback), so its dependent chain (4 shuffles,
// the reciprocal, the division, the level search) runs alone; in one region the 2·kQ chains
// interleave.
// keep[q]: the skipped elements of quad q; a block holding one takes kept_block_absmax's
// absmax and code mask.
// NOTE: one warp-uniform branch for "a skipped element in the warp's blocks" around the absmax
// alone: without one, the warp's blocks run exactly the usual instructions but for the vote
// and the masked stores' test; the encoder after it is shared by both outcomes.
// kPaired: the batch's layout (QuadBlocks).
template <int kQ, int kNumStates, int kRule, int kSF, bool kPaired = false>
__device__ __forceinline__ void store_block_states(const ParamView& p, const int64_t (&row)[kQ],
                                                   const int64_t (&col)[kQ],
                                                   const int64_t (&idx)[kQ], const int (&n)[kQ],
                                                   const bool (&vec)[kQ],
                                                   const unsigned (&keep)[kQ],
                                                   const float (&s)[FORGE_MAX_STATES][kQ][kQuad]) {
  static_assert(is_block_format(kSF), "int8, fp8 or int4 states");
  constexpr bool kFp8 = kSF == FORGE_STATE_FP8_BLOCK64;
  constexpr bool kInt4 = kSF == FORGE_STATE_INT4_BLOCK64;
  using Blocks = QuadBlocks<kPaired, kQ>;
  constexpr int kPerState = Blocks::kPerState, kLanes = Blocks::kLanes;
  float amax[kNumStates][kPerState];  // the lane's blocks' absmax
  unsigned code_keep[kNumStates][kQ];
  unsigned any_keep = 0u;
#pragma unroll
  for (int q = 0; q < kQ; ++q) any_keep |= keep[q];
  const bool kept = __any_sync(0xFFFFFFFFu, any_keep != 0u);  // uniform over the warp
  const int block = lane_block<kNumStates, kPerState, kLanes>();
  float own;  // the absmax of the lane's block
  if (kept) {
#pragma unroll
    for (int i = 0; i < kNumStates; ++i) {
      if constexpr (kPaired) {
        amax[i][0] = kept_block_absmax<kLanes, kQ>(
            &p.absmax[i][row[0] * p.blocks_per_row + col[0] / FORGE_INT8_BLOCK], n, keep,
            Blocks::first(), kFp8, s[i], code_keep[i]);
      } else {
#pragma unroll
        for (int q = 0; q < kQ; ++q)
          amax[i][q] = kept_block_absmax(
              &p.absmax[i][row[q] * p.blocks_per_row + col[q] / FORGE_INT8_BLOCK], n[q],
              keep[q], static_cast<int>(threadIdx.x % kGroupLanes), kFp8, s[i][q],
              code_keep[i][q]);
      }
    }
    own = amax[0][0];
#pragma unroll
    for (int i = 0; i < kNumStates; ++i)
#pragma unroll
      for (int b = 0; b < kPerState; ++b)
        if (block == i * kPerState + b) own = amax[i][b];
  } else {
    float m[kNumStates * kPerState];  // block i·kPerState + b: this lane's largest magnitude
#pragma unroll
    for (int i = 0; i < kNumStates; ++i) {
#pragma unroll
      for (int b = 0; b < kPerState; ++b) m[i * kPerState + b] = 0.0f;
#pragma unroll
      for (int q = 0; q < kQ; ++q) {
        float& v = m[i * kPerState + Blocks::of(q)];
#pragma unroll
        for (int e = 0; e < kQuad; ++e)
          if (e < n[q]) v = fmaxf(v, fabsf(s[i][q][e]));
        code_keep[i][q] = 0u;
      }
    }
    own = group_max_scatter<kNumStates * kPerState, kLanes>(m);
    if constexpr (kFp8) own = fp8_block_absmax(own);
    gather_blocks<kNumStates, kPerState, kLanes>(own, amax);
  }
  uint32_t codes[kNumStates][kQ];  // byte e (int4: bits 4e..4e+3): element e's code
  if constexpr (kFp8) {
    // the absmax is the same in every lane of the block: one encode factor per lane
    float factor[kNumStates][kPerState];
    gather_blocks<kNumStates, kPerState, kLanes>(
        fp8_lane_factor<false, kRule, kNumStates>(own, block / kPerState), factor);
    // NOTE: where no element of the warp was skipped, no value whose code is stored is NaN
    // (every one is a result apply_rule accepted), so the codes skip the signs' permutes.
    if (kept) {
#pragma unroll
      for (int i = 0; i < kNumStates; ++i)
#pragma unroll
        for (int q = 0; q < kQ; ++q) {
          const int b = Blocks::of(q);
          codes[i][q] = fp8_quad_codes(s[i][q], factor[i][b], amax[i][b] >= kFp8MinAbsmax,
                                       spec_state_signed(kRule, i));
        }
    } else {
#pragma unroll
      for (int i = 0; i < kNumStates; ++i)
#pragma unroll
        for (int q = 0; q < kQ; ++q) {
          const int b = Blocks::of(q);
          codes[i][q] = fp8_quad_codes<true>(s[i][q], factor[i][b], amax[i][b] >= kFp8MinAbsmax,
                                             spec_state_signed(kRule, i));
        }
    }
  } else {
    float ratio[kNumStates][kQ][kQuad];
    bool fast = true;
#pragma unroll
    for (int i = 0; i < kNumStates; ++i)
#pragma unroll
      for (int q = 0; q < kQ; ++q)
        fast = fast & int8_quad_ratios(amax[i][Blocks::of(q)], s[i][q], ratio[i][q]);
    if (!fast) {
#pragma unroll
      for (int i = 0; i < kNumStates; ++i)
#pragma unroll
        for (int q = 0; q < kQ; ++q)
          int8_quad_ratios_ieee(amax[i][Blocks::of(q)], s[i][q], ratio[i][q]);
    }
    // NOTE: int4's codes in two copies: where no element of the warp was skipped, every value
    // whose code is stored is a result apply_rule accepted, and the encode skips the checks for
    // NaN and out-of-range values.
    if (kInt4 && kept) {
#pragma unroll
      for (int i = 0; i < kNumStates; ++i)
#pragma unroll
        for (int q = 0; q < kQ; ++q)
          codes[i][q] = int4_quad_codes(s[i][q], ratio[i][q], spec_state_signed(kRule, i));
    } else {
#pragma unroll
      for (int i = 0; i < kNumStates; ++i)
#pragma unroll
        for (int q = 0; q < kQ; ++q)
          codes[i][q] =
              kInt4 ? int4_quad_codes<true>(s[i][q], ratio[i][q], spec_state_signed(kRule, i))
                    : int8_quad_codes(s[i][q], ratio[i][q], spec_state_signed(kRule, i));
    }
  }
  // (int4: a quad's two bytes, at its packed offset)
  auto store_codes = [&](int i, int q, unsigned keep_codes) {
    if constexpr (kInt4) {
      store_quad_int4(static_cast<uint8_t*>(p.state[i]), p.int4_byte(row[q], col[q]), n[q],
                      vec[q], keep_codes, codes[i][q]);
    } else {
      store_quad_codes(static_cast<uint8_t*>(p.state[i]), idx[q], n[q], vec[q], keep_codes,
                       codes[i][q]);
    }
  };
  // NOTE: the stores in two copies, the masked ones only for a warp with a skipped element:
  // with one copy every quad's store is a branch of its own (vector or masked bytes), control
  // flow per quad and state on the fast path.
  if (kept) {
#pragma unroll
    for (int i = 0; i < kNumStates; ++i)
#pragma unroll
      for (int q = 0; q < kQ; ++q)
        if (n[q] > 0) store_codes(i, q, code_keep[i][q]);
  } else {
#pragma unroll
    for (int i = 0; i < kNumStates; ++i)
#pragma unroll
      for (int q = 0; q < kQ; ++q)
        if (n[q] > 0) store_codes(i, q, 0u);
  }
  // the first lane of the block holds its first column (in quad 0 when paired), so it is in
  // range whenever any column of the block is
#pragma unroll
  for (int i = 0; i < kNumStates; ++i)
#pragma unroll
    for (int b = 0; b < kPerState; ++b)
      if (n[b] > 0 && Blocks::first())
        p.absmax[i][row[b] * p.blocks_per_row + col[b] / FORGE_INT8_BLOCK] = amax[i][b];
}

}  // namespace cuda
}  // namespace forge
