// wgrad_tile.cuh — what every fused wgrad kernel (sm80_wgrad.cuh, sm90_wgrad.cuh) shares
// outside its main loop and epilogue: the tile (one CTA's 128 × 128 tile of dW = dYᵀ·X, staged
// in shared memory as fp32 for the update), the launch parameters (WgradParams), which tile
// and tokens a CTA sums (grouped rasterization, split-K ranges), and the L2 prefetch of its
// update's operands, issued from the main loop.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include "core/formats.h"
#include "core/rules.h"
#include "cuda/ptx.cuh"
#include "cuda/update.cuh"
#include "forge/forge.h"

namespace forge {
namespace cuda {

// ---- the tile -----------------------------------------------------------------------------------

constexpr int kBM = 128;  // tile rows (out)
constexpr int kBN = 128;  // tile columns (in)
// NOTE: 8 warps, and at <= 128 registers two CTAs per SM: the epilogue (IEEE div/sqrt, format
// conversions) is latency-bound, and two CTAs give it 16 warps per SM instead of 8.
constexpr int kThreads = 256;
// NOTE: the fp32 tile staged for the epilogue is padded by 8 floats per row: the mma and wgmma
// accumulator layouts (rows g and g + 8, float2 at column 2·t) then write without bank
// conflicts, and the epilogue's float4 reads of 16 consecutive lanes stay conflict-free.
constexpr int kLdC = kBN + 8;
constexpr int kTileElems = kBM * kBN;
constexpr int kRowsPerPass = kThreads / (kBN / kQuad / 2);  // 16: a thread owns 2 quads of a row
constexpr size_t kEpilogueBytes = size_t(kBM) * kLdC * sizeof(float);  // sC
constexpr size_t kMax2(size_t a, size_t b) { return a > b ? a : b; }
static_assert(kThreads >= kBM, "the L2 prefetch gives each of the first kBM threads a row");
static_assert(kBN % FORGE_INT8_BLOCK == 0, "tiles hold whole int8 blocks");

// ---- the launch parameters ----------------------------------------------------------------------

// Everything a wgrad kernel reads, by value in the launch parameters.
struct WgradParams {
  const void* x;             // [T, N] row-major, ld = ldx
  const void* dy;            // [T, M] row-major, ld = lddy
  int64_t ldx, lddy, tokens;
  int32_t x_dtype, dy_dtype;
  int32_t vec_x, vec_dy;     // 16 B cp.async legal (ld % 8 == 0, base 16 B aligned)
  int32_t tiles_m, tiles_n;
  int32_t splits, ktiles_per_split;
  int32_t prefetch;          // L2 prefetch of the epilogue's operands
  int32_t prefetch_lead;     // ... issued this many tokens before the main loop ends
  int32_t group_m;           // tile rasterization: tile-rows per group (heuristics.h)
  int32_t want_sq;           // grad_sq_sum != nullptr
  float* workspace;          // [tiles · splits][kBM][kBN] fp32 partials (splits > 1)
  unsigned int* counters;    // [tiles] arrivals per tile, 0 between launches
  double* grad_sq_sum;
  unsigned long long* nonfinite_count;
  ParamView p;               // W: [M, N]
  RuleScalars k;
  // The Hopper kernels only: the benchmark's trace (FORGE_DEBUG_TRACE, heuristics.h; off:
  // nullptr) and, wgrad_wgmma_kernel only, the stagger (kStaggerNs, heuristics.h; off:
  // stagger_ns == 0).
  unsigned long long* trace;  // [trace_ctas][kTraceWords]: TileTrace, or PersistentTrace
  int64_t trace_ctas;
  int32_t stagger_ns;         // CTAs [stagger_first, stagger_first + stagger_count) wait this
  int32_t stagger_first, stagger_count;  // long before their main loop
  // kRunScalars kernels only (CUDA graphs): the step's scalars, read when the kernel runs;
  // k above then only holds what chose the kernel (rule, formats, number of states), and
  // run_key is run_scalars_key() of the call's hyper-parameters (run_scalars_refused).
  const RuleScalars* run_k;
  uint64_t run_key;
};

// The RuleScalars the update of a Spec uses: the launch's own, or the CTA's copy of a.run_k's
// (kRunScalars; run_scalars_refused made it).
template <class Spec>
__device__ __forceinline__ const RuleScalars& scalars_of(const WgradParams& a) {
  if constexpr (Spec::kRunScalars) {
    return run_scalars_copy();
  } else {
    return a.k;
  }
}

// A kRunScalars kernel's first statement: whether its run_scalars buffer does not match the
// launch, and the CTA must return having written nothing (update/per_cta.cuh,
// run_scalars_refused).
// Always false for the other kernels (no code). Every thread of the CTA must call it.
template <class Spec>
__device__ __forceinline__ bool run_scalars_refused(const WgradParams& a) {
  if constexpr (Spec::kRunScalars) {
    return run_scalars_refused(a.run_k, a.k.rule, a.k.num_states, a.run_key, a.p.rows * a.p.cols,
                               a.nonfinite_count);
  } else {
    return false;
  }
}

// 64-bit words per CTA record in WgradParams::trace (TileTrace, PersistentTrace:
// sm90_wgrad.cuh).
constexpr int kTraceWords = 6;

// ---- tile bookkeeping ---------------------------------------------------------------------------

// NOTE: grouped rasterization: consecutive CTAs walk down a.group_m tile-rows before moving
// right, so a wave of CTAs shares a few dY and X column panels in L2 instead of streaming
// all of X once per tile-row (the 4096 × 14336 layer's X is 117 MB at T = 4096).
__device__ __forceinline__ void tile_coords(const WgradParams& a, int tile, int& tm, int& tn) {
  const int group_tiles = a.group_m * a.tiles_n;
  const int group = tile / group_tiles;
  const int first_m = group * a.group_m;
  const int group_m = min(a.tiles_m - first_m, a.group_m);
  const int in_group = tile - group * group_tiles;
  tm = first_m + in_group % group_m;
  tn = in_group / group_m;
}

// This CTA's work in a one-tile-per-CTA launch: the origin (m0, n0) of tile blockIdx.x and
// its split's (blockIdx.z) k-tiles [kt0, kt0 + nk) of kTokens tokens each.
struct CtaWork {
  int64_t m0, n0, kt0;
  int nk;
};
template <int kTokens>
__device__ __forceinline__ CtaWork cta_work(const WgradParams& a) {
  int tm, tn;
  tile_coords(a, blockIdx.x, tm, tn);
  const int64_t ktiles = (a.tokens + kTokens - 1) / kTokens;
  const int64_t kt0 = static_cast<int64_t>(blockIdx.z) * a.ktiles_per_split;
  return CtaWork{static_cast<int64_t>(tm) * kBM, static_cast<int64_t>(tn) * kBN, kt0,
                 static_cast<int>(min64(a.ktiles_per_split, ktiles - kt0))};
}

// ---- L2 prefetch of the update's operands -------------------------------------------------------

// The k-tile of a CTA's main loop (nk k-tiles of kTokens) at which the prefetch is issued;
// -1: none.
template <int kTokens>
__device__ __forceinline__ int prefetch_ktile(const WgradParams& a, int nk) {
  if (!a.prefetch) return -1;
  return max(nk - (a.prefetch_lead + kTokens - 1) / kTokens, 0);
}

// Prefetches into L2 what the epilogue of tile (m0, n0) will read: the weight (or master)
// and the states. One tile row per thread.
// NOTE: one prefetch per 128-byte line the row touches, each address inside the row (every
// 128 bytes from the start and then the last byte asks for the last line twice on aligned
// rows).
__device__ __forceinline__ void prefetch_row_l2(const void* base, int elem_bytes, int64_t idx,
                                                int64_t count) {
  const char* start = static_cast<const char*>(base) + idx * elem_bytes;
  const int64_t bytes = count * elem_bytes;
  if (bytes <= 0) return;
  const uintptr_t first = reinterpret_cast<uintptr_t>(start) & ~uintptr_t(127);
  const uintptr_t last = (reinterpret_cast<uintptr_t>(start) + bytes - 1) & ~uintptr_t(127);
  prefetch_l2(start);
  for (uintptr_t line = first + 128; line <= last; line += 128)
    prefetch_l2(reinterpret_cast<const void*>(line));
}

// `tid`: the calling thread's index among the threads that share the work (threadIdx.x, or
// its index inside the update warpgroups of the persistent kernel).
__device__ __forceinline__ void prefetch_update_operands(const WgradParams& a, int64_t m0,
                                                         int64_t n0, int tid) {
  const ParamView& p = a.p;
  const int64_t row = m0 + tid;
  if (tid >= kBM || row >= p.rows) return;
  const int64_t count = min64(kBN, p.cols - n0);
  const int64_t idx = row * p.cols + n0;
  switch (p.weight_format) {
    case FORGE_WEIGHT_FP32: prefetch_row_l2(p.weight, 4, idx, count); break;
    case FORGE_WEIGHT_BF16_MASTER: prefetch_row_l2(p.master, 4, idx, count); break;
    default: prefetch_row_l2(p.weight, 2, idx, count);
  }
  const bool int4 = p.state_format == FORGE_STATE_INT4_BLOCK64;  // two codes per byte
  const int state_bytes = p.state_format == FORGE_STATE_FP32 ? 4
                          : is_block_format(p.state_format)  ? 1
                                                             : 2;
#pragma unroll
  for (int i = 0; i < FORGE_MAX_STATES; ++i) {
    if (i >= a.k.num_states) continue;
    if (int4) {
      prefetch_row_l2(p.state[i], 1, p.int4_byte(row, n0), (count + 1) / 2);
    } else {
      prefetch_row_l2(p.state[i], state_bytes, idx, count);
    }
  }
}

}  // namespace cuda
}  // namespace forge
