// sm80_wgrad.cuh — the fused weight-gradient + optimizer kernels (sm_80 and newer).
//
// For W [out, in] = [M, N], one CTA owns one 128 × 128 tile of dW = dYᵀ·X (reduction over
// the T tokens, K = T), accumulates it in fp32 registers, stages it in shared memory, and
// runs the optimizer update (update.cuh → forge::apply_rule) on it there: only the new
// weight and states go back to memory, the gradient never does.
//
//  - wgrad_mma_kernel<kFp16>: bf16 or fp16 inputs on the tensor cores, mma.sync m16n8k16.
//    Both operands have T as the slow dimension ([T, out] and [T, in] row-major), so A =
//    dYᵀ and B = X are both "k-major" in memory and ldmatrix.trans turns their 8 × 8 blocks
//    into the k-pairs the mma fragments want. cp.async feeds a 4-stage shared-memory ring.
//  - wgrad_simt_kernel: any other dtype combination (fp32, or mixed), converted to fp32
//    on load, plain fp32 multiply + add in token order: correct, not fast. With the
//    library's --fmad=false it performs exactly the CPU backend's arithmetic, so without
//    split-K it is bit-identical to the CPU even on random fp32 inputs.
//
// Split-K (host picks `splits` when the layer has fewer tiles than SMs): CTA (tile, s)
// sums the tokens of k-tiles [s·per, (s+1)·per); each publishes its fp32 partial tile to
// a library-owned workspace of at most (SMs × tile) floats, and the last CTA of the tile
// to arrive (an atomic counter) sums the partials in split order — deterministic — and
// runs the update.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include <type_traits>

#include "core/formats.h"
#include "core/rules.h"
#include "cuda/ptx.cuh"
#include "cuda/update.cuh"
#include "forge/forge.h"

namespace forge {
namespace cuda {

constexpr int kBM = 128;        // tile rows (out)
constexpr int kBN = 128;        // tile columns (in)
constexpr int kBK = 32;         // tokens per pipeline stage
// NOTE: 8 warps (2 × 4, 64 × 32 warp tiles, 64 fp32 accumulators per thread) rather than
// 4 warps of 64 × 64: the epilogue (IEEE div/sqrt, format conversions, ~100 instructions
// per element) is latency-bound, and at <= 128 registers two CTAs give it 16 warps per SM
// instead of 8. Measured with 4 warps: the epilogue alone took 0.55 ms on 4096 × 4096.
constexpr int kThreads = 256;
constexpr int kStages = 4;      // cp.async ring depth
constexpr int kWarpM = 64, kWarpN = 32;
constexpr int kMmaM = kWarpM / 16, kMmaN = kWarpN / 8;  // 4 × 4 mma tiles per warp
// NOTE: shared rows are padded by 8 halves (16 B): ldmatrix.trans reads 8 rows of 16 B at
// one column offset, and with a 272 B row stride those land in 8 different 16 B bank
// groups (a 256 B stride would put all 8 in the same one: 8-way conflicts).
constexpr int kLdS = kBM + 8;             // halves per shared row, both operands
constexpr int kStageHalves = kBK * kLdS;  // one operand, one stage
// NOTE: the fp32 tile staged for the epilogue is padded by 8 floats per row: the mma
// accumulator layout (rows g and g + 8, float2 at column 2·t) then writes without bank
// conflicts, and the epilogue's float4 reads of 16 consecutive lanes stay conflict-free.
constexpr int kLdC = kBN + 8;
constexpr int kLdF = kBM + 4;             // fp32 shared rows of the SIMT kernel
constexpr int kTileElems = kBM * kBN;
constexpr int kRowsPerPass = kThreads / (kBN / kQuad / 2);  // 16: a thread owns 2 quads of a row

constexpr size_t kPipeBytes = size_t(kStages) * 2 * kStageHalves * sizeof(uint16_t);
constexpr size_t kEpilogueBytes = size_t(kBM) * kLdC * sizeof(float);
constexpr size_t kSimtBytes = size_t(2) * 2 * kBK * kLdF * sizeof(float);
constexpr size_t kMax2(size_t a, size_t b) { return a > b ? a : b; }
constexpr size_t kWgradSmemBytes = kMax2(kMax2(kPipeBytes, kEpilogueBytes), kSimtBytes);
static_assert(kWgradSmemBytes == 69632, "68 KiB: two CTAs per SM on A100 and H100");
static_assert(kThreads >= kBM, "the L2 prefetch gives each of the first kBM threads a row");
static_assert(kBN % FORGE_INT8_BLOCK == 0, "tiles hold whole int8 blocks");
static_assert((kBK * kBM / 8) % kThreads == 0, "16 B chunks divide evenly among threads");

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
// launch, and the CTA must return having written nothing (update.cuh, run_scalars_refused).
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

// One CTA's record in WgradParams::trace: when it started, when its tile's gradient was in
// sC, when it ended (the SM's clock64, comparable between CTAs of one SM only), the global
// timer at start and end (ns, comparable across SMs), and its SM and blockIdx.x.
constexpr int kTraceWords = 6;
enum TileTrace { kTraceClockStart, kTraceClockMainEnd, kTraceClockEnd, kTraceNsStart,
                 kTraceNsEnd, kTraceSmBlock };

// The k-tile of a CTA's main loop (nk k-tiles of kTokens) at which the prefetch is issued;
// -1: none.
template <int kTokens>
__device__ __forceinline__ int prefetch_ktile(const WgradParams& a, int nk) {
  if (!a.prefetch) return -1;
  return max(nk - (a.prefetch_lead + kTokens - 1) / kTokens, 0);
}

// ---- tile bookkeeping ------------------------------------------------------------------------

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

// Prefetches into L2 what the epilogue of tile (m0, n0) will read: the weight (or master)
// and the states. One tile row per thread.
// NOTE: one prefetch per 128-byte line the row touches, each address inside the row. The
// earlier form (every 128 bytes from the start, then the last byte) asked for the last line
// twice on aligned rows: ncu counted those as 19% excess sectors at T = 512.
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
  const int state_bytes = p.state_format == FORGE_STATE_FP32 ? 4
                          : is_block_format(p.state_format)  ? 1
                                                             : 2;
#pragma unroll
  for (int i = 0; i < FORGE_MAX_STATES; ++i)
    if (i < a.k.num_states) prefetch_row_l2(p.state[i], state_bytes, idx, count);
}

// ---- the epilogue, shared by both kernels ---------------------------------------------------

// Split-K: publish this CTA's partial tile (sC, [kBM][kLdC]) to the workspace; the last CTA of
// the tile to arrive sums all partials in split order into sC and returns true, the others
// return false (and must exit). Each thread touches only its own elements of sC.
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
  return true;
}

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
// made ptxas spill 20-100 B next to the accumulators.
constexpr int kUpdateQuads = 2;  // quads in flight per thread: the two column halves of a row
template <class Spec>
__host__ __device__ constexpr bool update_pipelined() {
  return !Spec::kGeneric && raw_quads_words<Spec, kUpdateQuads>() <= 12;
}
// The pipelined loop's layout: block states take the paired one (QuadBlocks: a lane's two
// quads in one block), the other formats the classic one.
// NOTE: paired, a lane's pass has half the blocks (fewer shuffles, gathers, absmax loads and
// stores): fp8 68.3 -> 65.1 instructions per element, int8 116.8 -> 110.8 (sass_fastpath.py);
// Llama at T = 512 fp8 38.0 -> 36.8 ms, SR W + int8 57.9 -> 54.5 (gpu_check.sh ab, one call).
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
      // pass (bf16 states: ~3 fewer instructions per element in the SASS). With int8 or fp8
      // states only beside a nearest weight: unrolled, int8's pass takes 91.1 against 94.2
      // instructions per element and Llama at T = 512 46.5 against 48.2 ms, fp8's 61.8
      // against 65.1 and 35.8 against 36.7 ms, but beside the SR weight (a longer pass) both
      // lose: 48.6 against 48.0 ms, 38.4 against 38.2 (gpu_check.sh ab, one call each).
      constexpr int kPassUnroll =
          is_block_format(Spec::kStateFormat) &&
                  Spec::kWeightFormat == FORGE_WEIGHT_BF16_STOCHASTIC
              ? 1
              : 2;
      // NOTE: with stochastic rounding, the SR indices' row term (ParamView::sr_index) is
      // stepped per pass like idx0: the update sees a view whose sr_base holds the pass's row
      // term and whose sr_row_extra is 0, so a quad's SR index is its offset plus one add, not
      // a 64-bit multiply per quad (AdamW, SR weight and states: 65.3 instructions per element
      // before shards, 67.0 with the multiply, 66.3 so; folding the term into the key instead
      // gave 66.2: sass_fastpath.py). Other specs keep a.p (no SR index at all).
      constexpr bool kStochastic = Spec::kWeightFormat == FORGE_WEIGHT_BF16_STOCHASTIC ||
                                   (Spec::kNumStates > 0 &&
                                    Spec::kStateFormat == FORGE_STATE_BF16_STOCHASTIC);
      // NOTE: likewise with block states, the absmax arrays' row term: the update and the next
      // pass's loads see views whose absmax pointers sit at their pass's row and whose
      // blocks_per_row is 0, so a block's absmax is a pointer plus the quad's (loop-invariant)
      // column term, not a 64-bit multiply-add per quad and state (~7 instructions per pass
      // of 8 elements: sass_fastpath.py).
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
          // under an `if` the compiler scheduled these loads after the update below.
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

// ---- the tensor-core kernel ---------------------------------------------------------------------

// Loads tokens [k0, k0 + 32) × columns [c0, c0 + 128) of a [T, extent] half-precision
// operand (row-major, ld) into a shared stage [kBK][kLdS]; out-of-range elements are 0.
__device__ __forceinline__ void load_operand_stage(uint16_t* stage, const uint16_t* src,
                                                   int64_t ld, int64_t tokens, int64_t extent,
                                                   int64_t c0, int64_t k0, bool vec) {
  constexpr int kChunksPerRow = kBM / 8;  // 16 B chunks
#pragma unroll
  for (int i = 0; i < kBK * kChunksPerRow / kThreads; ++i) {
    const int chunk = threadIdx.x + i * kThreads;
    const int r = chunk / kChunksPerRow, c = (chunk % kChunksPerRow) * 8;
    const int64_t t = k0 + r, col = c0 + c;
    uint16_t* dst = stage + r * kLdS + c;
    if (vec) {
      int valid = 0;
      if (t < tokens && col < extent) valid = static_cast<int>(min64(8, extent - col));
      const uint16_t* from = valid > 0 ? src + t * ld + col : src;
      cp_async_16(smem_addr(dst), from, valid * 2);
    } else {
      // NOTE: unaligned leading dimension or base pointer: element loads, synchronous.
      uint16_t v[8];
#pragma unroll
      for (int e = 0; e < 8; ++e)
        v[e] = (t < tokens && col + e < extent) ? src[t * ld + col + e] : uint16_t(0);
      uint4 packed;
      packed.x = v[0] | (uint32_t(v[1]) << 16);
      packed.y = v[2] | (uint32_t(v[3]) << 16);
      packed.z = v[4] | (uint32_t(v[5]) << 16);
      packed.w = v[6] | (uint32_t(v[7]) << 16);
      *reinterpret_cast<uint4*>(dst) = packed;
    }
  }
}

// Spec: the epilogue's compile-time configuration (update.cuh); GenericSpec for any.
template <bool kFp16, class Spec = GenericSpec>
__global__ void __launch_bounds__(kThreads, 2) wgrad_mma_kernel(const WgradParams a) {
  if (run_scalars_refused<Spec>(a)) return;
  extern __shared__ __align__(128) unsigned char smem[];
  uint16_t* const sA = reinterpret_cast<uint16_t*>(smem);  // [kStages][kBK][kLdS] dY, m fastest
  uint16_t* const sB = sA + kStages * kStageHalves;        // [kStages][kBK][kLdS] X, n fastest
  float* const sC = reinterpret_cast<float*>(smem);        // [kBM][kLdC] after the main loop

  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int warp_m = warp % 2, warp_n = warp / 2;
  const CtaWork work = cta_work<kBK>(a);
  const int64_t m0 = work.m0, n0 = work.n0, kt0 = work.kt0;
  const int nk = work.nk;
  const uint16_t* const dy = static_cast<const uint16_t*>(a.dy);  // [T, M], ld = lddy
  const uint16_t* const x = static_cast<const uint16_t*>(a.x);    // [T, N], ld = ldx

  // NOTE: tried and reverted: per-thread cp.async cursors stepped per
  // k-tile instead of load_operand_stage's 64-bit t * ld + col; the extra live registers
  // next to the 64 accumulators made ptxas spill 40-48 B on sm_90a.
  const uint32_t sA_addr = smem_addr(sA), sB_addr = smem_addr(sB);
  auto load_stage = [&](int stage, int64_t kt) {
    load_operand_stage(sA + stage * kStageHalves, dy, a.lddy, a.tokens, a.p.rows, m0, kt * kBK,
                       a.vec_dy != 0);
    load_operand_stage(sB + stage * kStageHalves, x, a.ldx, a.tokens, a.p.cols, n0, kt * kBK,
                       a.vec_x != 0);
  };

  float acc[kMmaM][kMmaN][4];
#pragma unroll
  for (int i = 0; i < kMmaM; ++i)
#pragma unroll
    for (int j = 0; j < kMmaN; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.0f;

  // ldmatrix.x4.trans lane roles: lanes 8j..8j+7 address the 8 rows of 8 × 8 matrix j.
  // A (dYᵀ, 16 × 16 per mma): matrices (m 0-7, k 0-7), (m 8-15, k 0-7), (m 0-7, k 8-15),
  // (m 8-15, k 8-15) → fragment registers a0..a3. B (X, 16 × 16 = two n8 mma tiles):
  // matrices (k 0-7, n 0-7), (k 8-15, n 0-7), (k 0-7, n 8-15), (k 8-15, n 8-15).
  const int a_row = (lane / 16) * 8 + lane % 8, a_col = ((lane / 8) % 2) * 8;
  const int b_row = ((lane / 8) % 2) * 8 + lane % 8, b_col = (lane / 16) * 8;

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < nk) load_stage(s, kt0 + s);
    cp_async_commit();
  }
  const int prefetch_at = prefetch_ktile<kBK>(a, nk);

#pragma unroll 1
  for (int it = 0; it < nk; ++it) {
    cp_async_wait<kStages - 2>();  // stage `it` has landed (this thread's copies) ...
    __syncthreads();               // ... everyone's, and stage it - 1 is free again
    if (it + kStages - 1 < nk) load_stage((it + kStages - 1) % kStages, kt0 + it + kStages - 1);
    cp_async_commit();
    if (it == prefetch_at) prefetch_update_operands(a, m0, n0, threadIdx.x);

    const uint32_t a_base = sA_addr + (it % kStages) * kStageHalves * sizeof(uint16_t);
    const uint32_t b_base = sB_addr + (it % kStages) * kStageHalves * sizeof(uint16_t);
#pragma unroll
    for (int kk = 0; kk < kBK; kk += 16) {
      uint32_t af[kMmaM][4], bf[kMmaN][2];
#pragma unroll
      for (int i = 0; i < kMmaM; ++i)
        ldmatrix_x4_trans(af[i], a_base + 2 * ((kk + a_row) * kLdS + warp_m * kWarpM + i * 16 +
                                               a_col));
#pragma unroll
      for (int j = 0; j < kMmaN / 2; ++j) {
        uint32_t t[4];
        ldmatrix_x4_trans(t, b_base + 2 * ((kk + b_row) * kLdS + warp_n * kWarpN + j * 16 +
                                           b_col));
        bf[2 * j][0] = t[0];
        bf[2 * j][1] = t[1];
        bf[2 * j + 1][0] = t[2];
        bf[2 * j + 1][1] = t[3];
      }
#pragma unroll
      for (int i = 0; i < kMmaM; ++i)
#pragma unroll
        for (int j = 0; j < kMmaN; ++j) mma_16816<kFp16>(acc[i][j], af[i], bf[j]);
    }
  }
  cp_async_wait<0>();
  __syncthreads();  // the ring is drained; its memory becomes sC

  // Accumulator fragment (16 × 8): c0, c1 at (row g, cols 2t, 2t + 1), c2, c3 at row g + 8.
  const int g = lane / 4, t = lane % 4;
#pragma unroll
  for (int i = 0; i < kMmaM; ++i)
#pragma unroll
    for (int j = 0; j < kMmaN; ++j) {
      const int r = warp_m * kWarpM + i * 16 + g, c = warp_n * kWarpN + j * 8 + 2 * t;
      *reinterpret_cast<float2*>(&sC[r * kLdC + c]) = make_float2(acc[i][j][0], acc[i][j][1]);
      *reinterpret_cast<float2*>(&sC[(r + 8) * kLdC + c]) =
          make_float2(acc[i][j][2], acc[i][j][3]);
    }
  if constexpr (int8_table_needed<Spec>()) int8_tables_init(threadIdx.x);
  __syncthreads();
  finish_tile<Spec>(a, sC, m0, n0);
}

// ---- the fp32 / mixed-dtype kernel --------------------------------------------------------------

__device__ __forceinline__ float load_input(const void* base, int dtype, int64_t i) {
  switch (dtype) {
    case FORGE_DTYPE_FP32: return static_cast<const float*>(base)[i];
    case FORGE_DTYPE_BF16: return bf16_to_float(static_cast<const uint16_t*>(base)[i]);
    default: return fp16_to_float(static_cast<const uint16_t*>(base)[i]);
  }
}

// Tokens [k0, k0 + 32) × columns [c0, c0 + 128) of a [T, extent] operand into a shared
// fp32 stage [kBK][kLdF]; a warp reads 32 consecutive elements of one token row.
__device__ __forceinline__ void load_operand_stage_f32(float* stage, const void* src, int dtype,
                                                       int64_t ld, int64_t tokens,
                                                       int64_t extent, int64_t c0, int64_t k0) {
#pragma unroll 4
  for (int i = 0; i < kBK * kBM / kThreads; ++i) {
    const int e = threadIdx.x + i * kThreads;
    const int r = e / kBM, c = e % kBM;
    const int64_t t = k0 + r, col = c0 + c;
    stage[r * kLdF + c] = (t < tokens && col < extent) ? load_input(src, dtype, t * ld + col) : 0.0f;
  }
}

// Spec: GenericSpec, or GenericRunSpec (the step's scalars from a.run_k).
template <class Spec = GenericSpec>
__global__ void __launch_bounds__(kThreads, 2) wgrad_simt_kernel(const WgradParams a) {
  if (run_scalars_refused<Spec>(a)) return;
  extern __shared__ __align__(128) unsigned char smem[];
  float* const sA = reinterpret_cast<float*>(smem);  // [2][kBK][kLdF] dY, m fastest
  float* const sB = sA + 2 * kBK * kLdF;             // [2][kBK][kLdF] X, n fastest
  float* const sC = reinterpret_cast<float*>(smem);  // [kBM][kLdC] after the main loop

  const CtaWork work = cta_work<kBK>(a);
  const int64_t m0 = work.m0, n0 = work.n0, kt0 = work.kt0;
  const int nk = work.nk;

  auto load_stage = [&](int stage, int64_t kt) {
    load_operand_stage_f32(sA + stage * kBK * kLdF, a.dy, a.dy_dtype, a.lddy, a.tokens,
                           a.p.rows, m0, kt * kBK);
    load_operand_stage_f32(sB + stage * kBK * kLdF, a.x, a.x_dtype, a.ldx, a.tokens, a.p.cols,
                           n0, kt * kBK);
  };

  // Thread (ty, tx) owns rows 64·i + 4·ty + {0..3} and columns 64·h + 4·tx + {0..3}, i, h < 2.
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  float acc[8][8];
#pragma unroll
  for (int i = 0; i < 8; ++i)
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[i][j] = 0.0f;

  load_stage(0, kt0);
  __syncthreads();
#pragma unroll 1
  for (int it = 0; it < nk; ++it) {
    if (it + 1 < nk) load_stage((it + 1) % 2, kt0 + it + 1);  // stage read at it - 1: free
    const float* As = sA + (it % 2) * kBK * kLdF;
    const float* Bs = sB + (it % 2) * kBK * kLdF;
#pragma unroll 4
    for (int kk = 0; kk < kBK; ++kk) {
      float av[8], bv[8];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float4 va = *reinterpret_cast<const float4*>(&As[kk * kLdF + 64 * h + 4 * ty]);
        av[4 * h] = va.x;
        av[4 * h + 1] = va.y;
        av[4 * h + 2] = va.z;
        av[4 * h + 3] = va.w;
        const float4 vb = *reinterpret_cast<const float4*>(&Bs[kk * kLdF + 64 * h + 4 * tx]);
        bv[4 * h] = vb.x;
        bv[4 * h + 1] = vb.y;
        bv[4 * h + 2] = vb.z;
        bv[4 * h + 3] = vb.w;
      }
      // NOTE: a rounded product, then a rounded sum (--fmad=false): the CPU's arithmetic.
#pragma unroll
      for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[i][j] = acc[i][j] + av[i] * bv[j];
    }
    __syncthreads();
  }

#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int r = 64 * (i / 4) + 4 * ty + i % 4;
#pragma unroll
    for (int h = 0; h < 2; ++h)
      *reinterpret_cast<float4*>(&sC[r * kLdC + 64 * h + 4 * tx]) =
          make_float4(acc[i][4 * h], acc[i][4 * h + 1], acc[i][4 * h + 2], acc[i][4 * h + 3]);
  }
  int8_tables_init(threadIdx.x);
  __syncthreads();
  finish_tile<Spec>(a, sC, m0, n0);
}

}  // namespace cuda
}  // namespace forge
