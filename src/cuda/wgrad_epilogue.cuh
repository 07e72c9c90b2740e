// wgrad_epilogue.cuh — the fused wgrad kernels' epilogue, shared by the sm80 and sm90 kernels:
// once a CTA's fp32 tile of dW is in shared memory (sC), the split-K reduction (if any), the
// optimizer update of the tile (update_tile: update.cuh's quads over the tile's rows,
// software-pipelined on interior tiles) and the by-products (finish_tile). The persistent
// Hopper kernel calls update_tile from its own update warpgroups.
//
// Split-K (the host picks `splits` when the layer has fewer tiles than SMs): CTA (tile, s)
// sums the tokens of k-tiles [s·per, (s+1)·per); each publishes its fp32 partial tile to a
// library-owned workspace of at most (SMs × tile) floats, and the last CTA of the tile to
// arrive (an atomic counter) sums the partials in split order — deterministic — and runs the
// update.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include <type_traits>

#include "core/rules.h"
#include "cuda/update.cuh"
#include "cuda/wgrad_tile.cuh"
#include "forge/forge.h"

namespace forge {
namespace cuda {

// ---- split-K ------------------------------------------------------------------------------------

// Split-K: publish this CTA's partial tile (sC, [kBM][kLdC]) to the workspace; the last CTA of
// the tile to arrive sums all partials in split order into sC and returns true, the others
// return false (and must exit). The sum is written in the plain quad layout; the update may
// read sC in the paired one (QuadBlocks), so the sum ends with a barrier.
__device__ __forceinline__ bool reduce_split_k(const WgradParams& a, float* sC, int tile,
                                               int split) {
  __shared__ int s_is_last;
  const int lane16 = threadIdx.x % 16, rsub = threadIdx.x / 16;
  float* const partials = a.workspace + static_cast<int64_t>(tile) * a.splits * kTileElems;
#pragma unroll 4
  for (int pass = 0; pass < kBM / kRowsPerPass; ++pass) {
    const int r = pass * kRowsPerPass + rsub;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int c = h * (kBN / 2) + lane16 * kQuad;
      const float4 v = *reinterpret_cast<const float4*>(&sC[r * kLdC + c]);
      // NOTE: .cg stores/loads: the partials only meet in L2 (L1 is not coherent).
      __stcg(reinterpret_cast<float4*>(&partials[static_cast<int64_t>(split) * kTileElems +
                                                 r * kBN + c]),
             v);
    }
  }
  __threadfence();  // publish the partial before the arrival below
  __syncthreads();
  if (threadIdx.x == 0)
    s_is_last = atomicAdd(&a.counters[tile], 1u) == static_cast<unsigned>(a.splits - 1);
  __syncthreads();
  if (!s_is_last) return false;
  __threadfence();  // every other split's partial is visible from here on
#pragma unroll 2
  for (int pass = 0; pass < kBM / kRowsPerPass; ++pass) {
    const int r = pass * kRowsPerPass + rsub;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int c = h * (kBN / 2) + lane16 * kQuad;
      float4* own = reinterpret_cast<float4*>(&sC[r * kLdC + c]);
      float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
      for (int s = 0; s < a.splits; ++s) {
        const float4 v = s == split ? *own
                                    : __ldcg(reinterpret_cast<const float4*>(
                                          &partials[static_cast<int64_t>(s) * kTileElems +
                                                    r * kBN + c]));
        if (s == 0) {
          sum = v;
        } else {
          sum.x = sum.x + v.x;
          sum.y = sum.y + v.y;
          sum.z = sum.z + v.z;
          sum.w = sum.w + v.w;
        }
      }
      *own = sum;
    }
  }
  if (threadIdx.x == 0) a.counters[tile] = 0;  // ready for the next launch on this stream
  __syncthreads();  // sC's sum is read by other threads of the warp in the paired layout
  return true;
}

// ---- the update of a tile -----------------------------------------------------------------------

// Tile row r in sC as this thread's kQ quads, in the layout kPaired names (QuadBlocks): their
// rows, columns, element offsets (from idx0, the thread's first quad's) and fp32 gradients.
template <int kQ, bool kPaired = false>
__device__ __forceinline__ void pass_quads(const float* sC, int r, int64_t m0, int64_t n0,
                                           int64_t idx0, int lane16, int64_t (&row)[kQ],
                                           int64_t (&col)[kQ], int64_t (&idx)[kQ],
                                           float (&g)[kQ][kQuad]) {
  using Blocks = QuadBlocks<kPaired, kQ>;
  static_assert(kBN == 2 * FORGE_INT8_BLOCK, "a tile row is two blocks");
#pragma unroll
  for (int q = 0; q < kQ; ++q) {
    const int c = Blocks::column(lane16, q);
    row[q] = m0 + r;
    col[q] = n0 + c;
    idx[q] = idx0 + (c - Blocks::column(lane16, 0));
    const float4 v = *reinterpret_cast<const float4*>(&sC[r * kLdC + c]);
    g[q][0] = v.x;
    g[q][1] = v.y;
    g[q][2] = v.z;
    g[q][3] = v.w;
  }
}

// The update of one pass of whole quads whose raw operands `cur` are at hand (the pipelined
// loop of update_tile; its quads are aligned, so update_loaded's kAligned holds): row, col,
// idx and g come from pass_quads; `k` and `p` are the step's
// scalars and the parameter's view, with the pass's SR row term moved into one of them
// (update_tile).
template <class Spec, int kQ, bool kPaired>
__device__ __forceinline__ void update_raw_pass(const RuleScalars& k, const ParamView& p,
                                                const RawQuads<Spec, kQ, kPaired>& cur,
                                                const int64_t (&row)[kQ], const int64_t (&col)[kQ],
                                                const int64_t (&idx)[kQ],
                                                const float (&g)[kQ][kQuad], int lane16,
                                                bool want_sq, StepTotals& totals) {
  int n[kQ];
  bool vec[kQ];
#pragma unroll
  for (int q = 0; q < kQ; ++q) {
    n[q] = kQuad;
    vec[q] = true;
  }
  float w[kQ][kQuad], s[FORGE_MAX_STATES][kQ][kQuad];
  cur.unpack(w, s);
  update_loaded<kQ, Spec, FastMath, true, kPaired>(k, p, row, col, idx, n, vec, lane16, want_sq,
                                                    g, w, s, totals);
}

// update_tile's fast loop: interior tiles (all of them on the Llama shapes) of specialized
// kernels, whole vector quads, no per-element range checks, and the next pass's raw operands
// loaded while the current one is updated. Only where one batch fits in 12 registers (bf16
// weight with bf16 or int8 states): with fp32 states or an fp32 master, the extra registers
// make ptxas spill next to the accumulators.
constexpr int kUpdateQuads = 2;  // quads in flight per thread: the two column halves of a row
template <class Spec>
__host__ __device__ constexpr bool update_pipelined() {
  return !Spec::kGeneric && raw_quads_words<Spec, kUpdateQuads>() <= 12;
}
// The pipelined loop's layout: block states take the paired one (QuadBlocks: a lane's two
// quads in one block), the other formats the classic one.
// NOTE: paired, a lane's pass has half the blocks (fewer shuffles, gathers, absmax loads and
// stores).
template <class Spec>
__host__ __device__ constexpr bool update_paired() {
  return is_block_format(Spec::kStateFormat) && Spec::kNumStates > 0;
}
template <class Spec>
__device__ __forceinline__ bool update_tile_full(const WgradParams& a, int64_t m0, int64_t n0) {
  return !Spec::kGeneric && m0 + kBM <= a.p.rows && n0 + kBN <= a.p.cols && a.p.vec4 != 0;
}

// The pipelined loop's first batch: the raw weight and states of the thread's two quads in
// tile row tid / 16. A kernel may load it before its main loop ends (FirstPass::loaded), so
// the update starts on operands already in registers.
struct NoRawQuads {};
template <class Spec>
struct FirstPass {
  using Raw = std::conditional_t<update_pipelined<Spec>(),
                                 RawQuads<Spec, kUpdateQuads, update_paired<Spec>()>, NoRawQuads>;
  Raw raw;
  bool loaded = false;
};
template <class Spec>
__device__ __forceinline__ void load_first_pass(const WgradParams& a, int64_t m0, int64_t n0,
                                                int tid, FirstPass<Spec>& first) {
  if constexpr (update_pipelined<Spec>()) {
    using Blocks = QuadBlocks<update_paired<Spec>(), kUpdateQuads>;
    const int lane16 = tid % 16, rsub = tid / 16;
    int64_t row[kUpdateQuads], col[kUpdateQuads], idx[kUpdateQuads];
#pragma unroll
    for (int q = 0; q < kUpdateQuads; ++q) {
      row[q] = m0 + rsub;
      col[q] = n0 + Blocks::column(lane16, q);
      idx[q] = row[q] * a.p.cols + col[q];
    }
    first.raw.load(a.p, row, col, idx);
    first.loaded = true;
  }
}

// The optimizer update of tile (m0, n0) from its fp32 gradient in sC ([kBM][kLdC]).
// Thread t owns rows t/16 + 16·j and, in each, two quads: at columns 4·(t%16) and
// 64 + 4·(t%16) (the 16 lanes of a half-warp cover each 64-column block of a row), or in the
// pipelined loop with block states at QuadBlocks<true, 2>::column (8 lanes cover a block).
// `tid` in [0, kThreads): the thread's index among the kThreads that update the tile.
// `first`: the fast loop's first batch if the caller loaded it (load_first_pass).
template <class Spec>
__device__ __forceinline__ void update_tile(const WgradParams& a, const float* sC, int64_t m0,
                                            int64_t n0, StepTotals& totals, int tid,
                                            const FirstPass<Spec>& first = FirstPass<Spec>{}) {
  constexpr int kQ = kUpdateQuads;
  const int lane16 = tid % 16, rsub = tid / 16;
  const int64_t rows = a.p.rows, cols = a.p.cols;
  const bool want_sq = a.want_sq != 0;
  // NOTE: the element offset row * cols + col of the thread's first quad, stepped by
  // kRowsPerPass rows per pass: one 64-bit add per pass, no multiply per quad.
  int64_t idx0 = (m0 + rsub) * cols + n0 + lane16 * kQuad;
  const int64_t idx_step = kRowsPerPass * cols;
  // NOTE: only specialized kernels carry the full-tile variant; the generic kernel keeps one
  // (checked) copy to hold its compile time.
  const bool full = update_tile_full<Spec>(a, m0, n0);
  // NOTE: software-pipelined: the weight and states of pass + 1 are loaded (raw) before
  // pass is updated, so each thread keeps one pass of loads in flight during its arithmetic
  // instead of waiting on memory at the top of every pass.
  if constexpr (update_pipelined<Spec>()) {
    if (full) {
      constexpr bool kPaired = update_paired<Spec>();
      using Raw = RawQuads<Spec, kQ, kPaired>;
      // the thread's first quad's offset in this loop's layout
      int64_t first_idx = (m0 + rsub) * cols + n0 + QuadBlocks<kPaired, kQ>::column(lane16, 0);
      Raw next;
      if (first.loaded) {
        next = first.raw;
      } else {
        FirstPass<Spec> own;
        load_first_pass<Spec>(a, m0, n0, tid, own);
        next = own.raw;
      }
      // NOTE: unrolled by 2 so that `cur = next` is a register renaming, not 12 moves per
      // pass. With int8 or fp8 states only beside a nearest weight: beside the SR weight (a
      // longer pass) the unrolled loop is slower.
      constexpr int kPassUnroll =
          is_block_format(Spec::kStateFormat) &&
                  Spec::kWeightFormat == FORGE_WEIGHT_BF16_STOCHASTIC
              ? 1
              : 2;
      // NOTE: with stochastic rounding, the SR indices' row term (ParamView::sr_index) is
      // stepped per pass like idx0: the update sees a view whose sr_base holds the pass's row
      // term and whose sr_row_extra is 0, so a quad's SR index is its offset plus one add, not
      // a 64-bit multiply per quad. Other specs keep a.p (no SR index at all).
      constexpr bool kStochastic = Spec::kWeightFormat == FORGE_WEIGHT_BF16_STOCHASTIC ||
                                   (Spec::kNumStates > 0 &&
                                    Spec::kStateFormat == FORGE_STATE_BF16_STOCHASTIC);
      // NOTE: likewise with block states, the absmax arrays' row term: the update and the next
      // pass's loads see views whose absmax pointers sit at their pass's row and whose
      // blocks_per_row is 0, so a block's absmax is a pointer plus the quad's (loop-invariant)
      // column term, not a 64-bit multiply-add per quad and state.
      constexpr bool kBlockStates =
          is_block_format(Spec::kStateFormat) && Spec::kNumStates > 0;
      constexpr bool kOwnView = kStochastic || kBlockStates;
      ParamView pv = a.p;
      pv.sr_row_extra = 0;
      int64_t sr_row_term = a.p.sr_base + (m0 + rsub) * a.p.sr_row_extra;
      const int64_t sr_row_step = kRowsPerPass * a.p.sr_row_extra;
      const int64_t absmax_step = kRowsPerPass * a.p.blocks_per_row;
      if constexpr (kBlockStates) {
        pv.blocks_per_row = 0;
#pragma unroll
        for (int i = 0; i < Spec::kNumStates; ++i)
          pv.absmax[i] = a.p.absmax[i] + (m0 + rsub) * a.p.blocks_per_row;
      }
#pragma unroll kPassUnroll
      for (int pass = 0; pass < kBM / kRowsPerPass; ++pass, first_idx += idx_step) {
        const int r = pass * kRowsPerPass + rsub;
        const Raw cur = next;
        int64_t row[kQ], col[kQ], idx[kQ];
        float g[kQ][kQuad];
        pass_quads<kQ, kPaired>(sC, r, m0, n0, first_idx, lane16, row, col, idx, g);
        {
          // NOTE: unconditional (the last pass reloads its own operands, a few L1/L2 hits):
          // under an `if` the compiler schedules these loads after the update below.
          const bool last = pass + 1 == kBM / kRowsPerPass;
          int64_t row_next[kQ], idx_next[kQ];
#pragma unroll
          for (int q = 0; q < kQ; ++q) {
            row_next[q] = last ? row[q] : row[q] + kRowsPerPass;
            idx_next[q] = last ? idx[q] : idx[q] + idx_step;
          }
          if constexpr (kBlockStates) {
            ParamView pv_next = pv;
            const int64_t ahead = last ? 0 : absmax_step;
#pragma unroll
            for (int i = 0; i < Spec::kNumStates; ++i) pv_next.absmax[i] = pv.absmax[i] + ahead;
            next.load(pv_next, row_next, col, idx_next);
          } else {
            next.load(a.p, row_next, col, idx_next);
          }
        }
        if constexpr (kOwnView) {
          if constexpr (kStochastic) {
            pv.sr_base = sr_row_term;
            sr_row_term += sr_row_step;
          }
          update_raw_pass<Spec, kQ, kPaired>(scalars_of<Spec>(a), pv, cur, row, col, idx, g,
                                             lane16, want_sq, totals);
          if constexpr (kBlockStates) {
#pragma unroll
            for (int i = 0; i < Spec::kNumStates; ++i) pv.absmax[i] += absmax_step;
          }
        } else {
          update_raw_pass<Spec, kQ, kPaired>(scalars_of<Spec>(a), a.p, cur, row, col, idx, g,
                                             lane16, want_sq, totals);
        }
      }
      return;
    }
  }
  if (full) {
#pragma unroll 1
    for (int pass = 0; pass < kBM / kRowsPerPass; ++pass, idx0 += idx_step) {
      const int r = pass * kRowsPerPass + rsub;
      int64_t row[kQ], col[kQ], idx[kQ];
      float g[kQ][kQuad];
      pass_quads<kQ>(sC, r, m0, n0, idx0, lane16, row, col, idx, g);
      int n[kQ];
#pragma unroll
      for (int q = 0; q < kQ; ++q) n[q] = kQuad;
      update_quads<kQ, Spec, true>(scalars_of<Spec>(a), a.p, row, col, idx, n, lane16, want_sq, g, totals);
    }
    return;
  }
#pragma unroll 1
  for (int pass = 0; pass < kBM / kRowsPerPass; ++pass, idx0 += idx_step) {
    if (m0 + pass * kRowsPerPass >= rows) break;  // uniform across the CTA
    const int r = pass * kRowsPerPass + rsub;
    int64_t row[kQ], col[kQ], idx[kQ];
    float g[kQ][kQuad];
    pass_quads<kQ>(sC, r, m0, n0, idx0, lane16, row, col, idx, g);
    int n[kQ];
#pragma unroll
    for (int q = 0; q < kQ; ++q)
      n[q] = row[q] < rows && col[q] < cols ? static_cast<int>(min64(kQuad, cols - col[q])) : 0;
    update_quads<kQ, Spec, false>(scalars_of<Spec>(a), a.p, row, col, idx, n, lane16, want_sq, g, totals);
  }
}

// ---- the epilogue -------------------------------------------------------------------------------

// After the main loop: sC holds the CTA's fp32 tile. Split-K reduction (if any), the update,
// the by-products.
// `first`: see update_tile.
template <class Spec>
__device__ __forceinline__ void finish_tile(const WgradParams& a, float* sC, int64_t m0,
                                            int64_t n0,
                                            const FirstPass<Spec>& first = FirstPass<Spec>{}) {
  if (a.splits > 1 && !reduce_split_k(a, sC, blockIdx.x, blockIdx.z)) return;
  StepTotals totals{0.0, 0u};
  update_tile<Spec>(a, sC, m0, n0, totals, threadIdx.x, first);
  if (a.grad_sq_sum != nullptr || a.nonfinite_count != nullptr)
    flush_totals<kThreads>(totals, a.grad_sq_sum, a.nonfinite_count);
}

}  // namespace cuda
}  // namespace forge
