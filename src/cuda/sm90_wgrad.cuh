// sm90_wgrad.cuh — the Hopper (sm_90a) main loops of the fused weight-gradient + optimizer
// kernels: TMA loads into a 128B-swizzled shared-memory ring, wgmma on the tensor cores. Two
// kernels: wgrad_wgmma_kernel (one tile per CTA, two CTAs per SM) and
// wgrad_wgmma_persistent_kernel (one CTA per SM, warp-specialized: main loop, update, producer).
//
// Same contract as wgrad_mma_kernel (sm80_wgrad.cuh): one CTA owns one kBM × kBN = 128 × 128
// tile of dW = dYᵀ·X, sums tokens [kt0·64, (kt0 + nk)·64) of it in fp32 registers, stages the
// tile in shared memory (sC, [kBM][kLdC] floats, exactly the sm80 kernel's layout) and hands it
// to the same finish_tile<Spec> (split-K reduction, optimizer update, by-products). Only the
// way the tile is summed differs; the epilogue, rules and formats are shared code.
//
// Why a second main loop: on Hopper the sm80 loop (cp.async + ldmatrix + mma.sync) leaves the
// tensor pipe mostly idle, because per k-tile every thread recomputes 64-bit cp.async
// addresses and issues ldmatrix/mma.sync one 16 × 8 tile at a time. Here one thread issues
// the copies (TMA: 4 instructions per 64 tokens, no address math, out-of-range rows and
// columns zero-filled by the copy engine) and each warpgroup issues 4 wgmma m64n128k16 per 64
// tokens, reading both operands straight from shared memory: the main loop's issue cost all
// but disappears, leaving the issue slots to the other CTA's epilogue.
//
//  - 256 threads = 2 warpgroups; warpgroup g computes rows 64g..64g+63 × all 128 columns
//    (64 fp32 accumulators per thread, like the sm80 kernel), two CTAs per SM.
//  - Both operands have T as the slow dimension, so in shared memory both are "MN-major"
//    (transposed in wgmma terms): a stage holds, per operand, two TMA boxes of 64 tokens ×
//    64 columns (128 B rows, 128B swizzle), i.e. the canonical MN-major SW128 layout:
//    swizzle atoms of 8 tokens × 64 columns (1 KiB), atoms along K at 1 KiB (the descriptor's
//    stride byte offset), the two 64-column halves of B at 8 KiB (its leading byte offset).
//  - Pipeline: kSm90Stages stages, full[s] (TMA transaction bytes) and empty[s] (one arrival
//    per warpgroup once its wgmmas that read stage s are complete) mbarriers; thread 0 is
//    also the producer. One wgmma batch stays in flight (commit / wait_group 1).
//
// Built only for sm_90a (wgmma needs the arch-specific target); every other pass gets a
// stub that traps, and the host (cuda_backend.cu) launches this kernel only on a compute
// capability 9.0 device whose loaded code is sm_90a, for bf16/bf16 or fp16/fp16 inputs with
// 16 B aligned bases and ld % 8 == 0 (the TMA stride rule).
#pragma once

#include <cuda.h>  // CUtensorMap (types only: the driver is reached through cudart)
#include <cuda_runtime.h>
#include <stdint.h>

#include "cuda/ptx.cuh"  // also defines FORGE_SM90A_DEVICE_PASS
#include "cuda/update.cuh"
#include "cuda/wgrad_epilogue.cuh"
#include "cuda/wgrad_tile.cuh"

namespace forge {
namespace cuda {

// NOTE: 64 tokens × 3 stages, not 32 × 6: the same shared memory, and the larger stages are
// faster.
constexpr int kSm90BK = 64;        // tokens per stage: 4 wgmma k-steps of 16
constexpr int kSm90Stages = 3;
constexpr int kSm90BoxCols = 64;   // columns per TMA box: 64 halves = one 128 B swizzle row
constexpr int kSm90BoxBytes = kSm90BK * kSm90BoxCols * 2;  // 8 KiB: [64 tokens][64 cols] 16-bit
constexpr int kSm90StageBytes = 4 * kSm90BoxBytes;        // dY: 2 boxes, X: 2 boxes = 32 KiB
constexpr int kSm90Align = 1024;   // the SW128 atom: TMA and the wgmma descriptors assume it
// NOTE: 3 stages × 32 KiB = 96 KiB (+ 1 KiB for the alignment) so that two CTAs fit per SM:
// one CTA's ALU-bound epilogue then runs beside the other's wgmma main loop. The ring is
// reused as sC (68 KiB) after the main loop.
constexpr size_t kSm90RingBytes = size_t(kSm90Stages) * kSm90StageBytes;
constexpr size_t kSm90SmemBytes = kMax2(kSm90RingBytes, kEpilogueBytes) + kSm90Align;
static_assert(kBM == 2 * kSm90BoxCols && kBN == 2 * kSm90BoxCols, "two boxes per operand");
static_assert(kSm90SmemBytes <= 100 * 1024, "two CTAs per SM (228 KiB, 1 KiB reserved each)");
static_assert(kThreads == 256, "two warpgroups");

// The two-CTA kernel's WgradParams::trace record (kTraceWords words per CTA): when it started,
// when its tile's gradient was in sC, when it ended (the SM's clock64, comparable between
// CTAs of one SM only), the global timer at start and end (ns, comparable across SMs), and
// its SM and blockIdx.x.
enum TileTrace { kTraceClockStart, kTraceClockMainEnd, kTraceClockEnd, kTraceNsStart,
                 kTraceNsEnd, kTraceSmBlock };

// The two operands' TMA descriptors, encoded on the host (cuTensorMapEncodeTiled) and passed
// by value as a __grid_constant__ kernel parameter.
struct Sm90TensorMaps {
  CUtensorMap dy;  // dY: [T, M] row-major, ld = lddy; dims {M, T}, box {64, 64}, SW128
  CUtensorMap x;   // X:  [T, N] row-major, ld = ldx;  dims {N, T}, box {64, 64}, SW128
};

#if defined(FORGE_SM90A_DEVICE_PASS)

// Waits until phase `parity` of the barrier has completed.
// NOTE: debug builds (no NDEBUG) and builds with FORGE_CUDA_WATCHDOG trap after 10 s of
// waiting, so a pipeline bug ends the launch with an error instead of hanging the GPU.
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
#if !defined(NDEBUG) || defined(FORGE_CUDA_WATCHDOG)
  if (mbar_try_wait(bar, parity)) return;
  const uint64_t start = global_timer_ns();
  while (!mbar_try_wait(bar, parity))
    if (global_timer_ns() - start > 10000000000ull) __trap();
#else
  while (!mbar_try_wait(bar, parity)) {
  }
#endif
}

// mbar_wait; with the benchmark's trace on (a.trace), the first thread of each 256 also adds
// the cycles it waited to `total` (shared memory: nothing held in registers).
__device__ __forceinline__ void mbar_wait_traced(const WgradParams& a, uint32_t bar,
                                                 uint32_t parity, unsigned long long& total) {
  if (a.trace == nullptr || threadIdx.x % 256 != 0) return mbar_wait(bar, parity);
  const unsigned long long t0 = clock64();
  mbar_wait(bar, parity);
  total += clock64() - t0;
}

// The benchmark instruments of WgradParams (off unless the host sets them): this CTA's trace
// record (thread 0 only, nullptr otherwise), and the stagger wait.
__device__ __forceinline__ unsigned long long* trace_record(const WgradParams& a) {
  const int64_t cta = blockIdx.x + static_cast<int64_t>(blockIdx.z) * gridDim.x;
  return a.trace != nullptr && threadIdx.x == 0 && cta < a.trace_ctas
             ? a.trace + cta * kTraceWords
             : nullptr;
}
__device__ __forceinline__ void trace_start(const WgradParams& a) {
  if (unsigned long long* rec = trace_record(a)) {
    rec[kTraceClockStart] = clock64();
    rec[kTraceNsStart] = global_timer_ns();
    rec[kTraceSmBlock] = (static_cast<unsigned long long>(sm_id()) << 32) | blockIdx.x;
  }
}
// Thread 0 of CTAs [stagger_first, stagger_first + stagger_count) waits stagger_ns before the
// CTA's first load (the others wait for it at the barrier after the ring's set-up).
__device__ __forceinline__ void stagger_wait(const WgradParams& a) {
  if (a.stagger_ns <= 0 || threadIdx.x != 0 || blockIdx.z != 0 ||
      blockIdx.x - static_cast<unsigned>(a.stagger_first) >=
          static_cast<unsigned>(a.stagger_count))
    return;
  const uint64_t start = global_timer_ns();
  while (global_timer_ns() - start < static_cast<uint64_t>(a.stagger_ns)) __nanosleep(500);
}

// Shared-memory matrix descriptor of an MN-major, 128B-swizzled operand (PTX ISA "Matrix
// Descriptor Format"): bits 0-13 start address >> 4; 16-29 leading byte offset >> 4 (for
// MN-major swizzled layouts: from one 64-element swizzle atom to the next along M or N);
// 32-45 stride byte offset >> 4 (from one 8-row group along K to the next); 49-51 base
// offset (0: every atom starts 1 KiB aligned); 62-63 layout (1 = 128B swizzle).
__device__ __forceinline__ uint64_t sw128_mn_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) |
         (static_cast<uint64_t>(lbo >> 4) << 16) | (static_cast<uint64_t>(sbo >> 4) << 32) |
         (1ull << 62);
}

// The four TMA boxes of one stage: dY columns [m0, m0 + 128) and X columns [n0, n0 + 128) of
// tokens [token, token + 64), into the stage at `dst`, completing on `bar`.
__device__ __forceinline__ void issue_stage_loads(const Sm90TensorMaps& maps, uint32_t dst,
                                                  uint32_t bar, int64_t m0, int64_t n0,
                                                  int32_t token) {
  mbar_arrive_expect_tx(bar, kSm90StageBytes);
  tma_load_2d(dst, &maps.dy, bar, static_cast<int32_t>(m0), token);
  tma_load_2d(dst + kSm90BoxBytes, &maps.dy, bar, static_cast<int32_t>(m0) + kSm90BoxCols,
              token);
  tma_load_2d(dst + 2 * kSm90BoxBytes, &maps.x, bar, static_cast<int32_t>(n0), token);
  tma_load_2d(dst + 3 * kSm90BoxBytes, &maps.x, bar, static_cast<int32_t>(n0) + kSm90BoxCols,
              token);
}

// Thread 0, before the first load: prefetch both TMA descriptors, initialize the ring's
// barriers (full: the producer's expect-tx arrival; empty: one arrival per math warpgroup) and
// make every barrier initialized so far visible to the copy engine (the async proxy).
template <int kStages>
__device__ __forceinline__ void init_ring(const Sm90TensorMaps& maps, uint32_t full0,
                                          uint32_t empty0) {
  tma_prefetch_descriptor(&maps.dy);
  tma_prefetch_descriptor(&maps.x);
#pragma unroll
  for (int s = 0; s < kStages; ++s) {
    mbar_init(full0 + 8 * s, 1);
    mbar_init(empty0 + 8 * s, 2);
  }
  fence_mbarrier_init();
  fence_proxy_async_shared();
}

// acc += this warpgroup's 64 rows × 128 columns of one stage (64 tokens: 4 wgmma k-steps).
// desc_a0 / desc_b0: the descriptors of k-step 0 of stage 0.
template <bool kFp16>
__device__ __forceinline__ void wgmma_stage(float (&acc)[64], uint64_t desc_a0,
                                            uint64_t desc_b0, int stage) {
  const uint64_t stage_off = static_cast<uint64_t>(stage * kSm90StageBytes) >> 4;
#pragma unroll
  for (int kk = 0; kk < kSm90BK / 16; ++kk) {
    const uint64_t k_off = static_cast<uint64_t>(kk * 16 * 128) >> 4;  // 16 token rows
    wgmma_m64n128k16<kFp16>(acc, desc_a0 + stage_off + k_off, desc_b0 + stage_off + k_off);
  }
}

// The warpgroup's accumulators into sC ([kBM][kLdC]). wgmma accumulator layout (m64nNk16,
// f32): warp w of the warpgroup, lane l holds rows 16w + l/4 and 16w + l/4 + 8; for each
// 8-column block j, acc[4j], acc[4j + 1] are (row l/4, columns 8j + 2(l%4) + {0, 1}) and
// acc[4j + 2], acc[4j + 3] the same columns 8 rows down. The same float2 pattern as the sm80
// fragments: no bank conflicts at kLdC.
__device__ __forceinline__ void store_accumulators(float* sC, const float (&acc)[64],
                                                   int warpgroup) {
  const int lane = threadIdx.x % 32, warp_in_group = (threadIdx.x / 32) % 4;
  const int r = warpgroup * 64 + warp_in_group * 16 + lane / 4;
#pragma unroll
  for (int j = 0; j < kBN / 8; ++j) {
    const int c = j * 8 + 2 * (lane % 4);
    *reinterpret_cast<float2*>(&sC[r * kLdC + c]) = make_float2(acc[4 * j], acc[4 * j + 1]);
    *reinterpret_cast<float2*>(&sC[(r + 8) * kLdC + c]) =
        make_float2(acc[4 * j + 2], acc[4 * j + 3]);
  }
}

#endif  // FORGE_SM90A_DEVICE_PASS

// ---- the kernel ---------------------------------------------------------------------------------

// Spec: the epilogue's compile-time configuration (update/spec.cuh); GenericSpec for any.
template <bool kFp16, class Spec = GenericSpec>
__global__ void __launch_bounds__(kThreads, 2)
    wgrad_wgmma_kernel(const WgradParams a, const __grid_constant__ Sm90TensorMaps maps) {
#if defined(FORGE_SM90A_DEVICE_PASS)
  extern __shared__ __align__(128) unsigned char smem_raw[];
  __shared__ __align__(8) uint64_t s_full[kSm90Stages];   // TMA bytes of stage s landed
  __shared__ __align__(8) uint64_t s_empty[kSm90Stages];  // both warpgroups done reading s
  // NOTE: aligned by hand: static shared memory (the barriers, the epilogue's reductions)
  // precedes the dynamic part, so its start is not necessarily 1 KiB aligned.
  const uint32_t raw_addr = smem_addr(smem_raw);
  const uint32_t ring = (raw_addr + kSm90Align - 1) & ~uint32_t(kSm90Align - 1);
  // ring: [kSm90Stages][dY box 0, dY box 1, X box 0, X box 1], each [64 tokens][64 cols] SW128
  float* const sC = reinterpret_cast<float*>(smem_raw + (ring - raw_addr));  // [kBM][kLdC] after
  const uint32_t full0 = smem_addr(&s_full[0]), empty0 = smem_addr(&s_empty[0]);

  const int warpgroup = threadIdx.x / 128;
  const CtaWork work = cta_work<kSm90BK>(a);
  const int64_t m0 = work.m0, n0 = work.n0, kt0 = work.kt0;
  const int nk = work.nk;

  // Producer (thread 0): the four boxes of k-tile kt into stage `stage`.
  auto issue_stage = [&](int stage, int64_t kt) {
    issue_stage_loads(maps, ring + stage * kSm90StageBytes, full0 + 8 * stage, m0, n0,
                      static_cast<int32_t>(kt * kSm90BK));
  };

  trace_start(a);
  stagger_wait(a);
  if (threadIdx.x == 0) {
    init_ring<kSm90Stages>(maps, full0, empty0);
#pragma unroll
    for (int s = 0; s < kSm90Stages; ++s)
      if (s < nk) issue_stage(s, kt0 + s);
  }
  // NOTE: the code tables are filled while the first stages' loads fly, off the path from
  // the last wgmma to the update; the barrier below orders them before any read.
  if constexpr (block_tables_needed<Spec>() != 0u)
    block_tables_init<block_tables_needed<Spec>()>(threadIdx.x);
  if constexpr (Spec::kRunScalars) {
    // NOTE: the run scalars' check after the first stages' loads are issued, not before: its
    // L2 read, hashes and barrier overlap their flight instead of delaying them (every CTA
    // of a graph's step pays it). It ends with the barrier the ring's initialization needs.
    // Nothing is written before it; a refused CTA lets the loads it issued land in its
    // shared memory before it returns.
    if (run_scalars_refused<Spec>(a)) {
      for (int s = 0; s < kSm90Stages && s < nk; ++s) mbar_wait(full0 + 8 * s, 0);
      return;
    }
  } else {
    __syncthreads();
  }

  float acc[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) acc[i] = 0.0f;

  // Descriptors of k-step 0 of stage 0; a k-step of 16 tokens is 2 KiB further, a stage
  // kSm90StageBytes. A: this warpgroup's 64 rows = dY box `warpgroup` (one atom along M; the
  // leading byte offset is unused). B: both X boxes, 8 KiB apart (the leading byte offset).
  const uint64_t desc_a0 =
      sw128_mn_desc(ring + warpgroup * kSm90BoxBytes, kSm90BoxBytes, 8 * 128);
  const uint64_t desc_b0 = sw128_mn_desc(ring + 2 * kSm90BoxBytes, kSm90BoxBytes, 8 * 128);
  const int prefetch_at = prefetch_ktile<kSm90BK>(a, nk);

  int stage = 0;
  uint32_t phase = 0;
#pragma unroll 1
  for (int it = 0; it < nk; ++it) {
    mbar_wait(full0 + 8 * stage, phase);  // k-tile `it` has landed in `stage`
    fence_accumulators(acc);
    wgmma_fence();
    wgmma_stage<kFp16>(acc, desc_a0, desc_b0, stage);
    wgmma_commit();
    // NOTE: keep this k-tile's batch in flight; the previous one is complete after this,
    // so its stage goes back to the producer.
    wgmma_wait<1>();
    fence_accumulators(acc);
    if (it > 0) {
      const int prev = stage == 0 ? kSm90Stages - 1 : stage - 1;
      if (threadIdx.x % 128 == 0) mbar_arrive(empty0 + 8 * prev);
      if (threadIdx.x == 0 && it - 1 + kSm90Stages < nk) {
        // Both warpgroups must be done with k-tile it - 1 before its stage is overwritten.
        mbar_wait(empty0 + 8 * prev, static_cast<uint32_t>((it - 1) / kSm90Stages) & 1u);
        issue_stage(prev, kt0 + it - 1 + kSm90Stages);
      }
      __syncwarp();
    }
    if (it == prefetch_at) prefetch_update_operands(a, m0, n0, threadIdx.x);
    if (++stage == kSm90Stages) {
      stage = 0;
      phase ^= 1u;
    }
  }
  // NOTE: the update's first loads go out while the last wgmma batch runs, and are in flight
  // during the accumulators' trip through sC and both barriers.
  FirstPass<Spec> first;
  if (a.splits == 1 && update_tile_full<Spec>(a, m0, n0))
    load_first_pass<Spec>(a, m0, n0, threadIdx.x, first);
  wgmma_wait<0>();
  fence_accumulators(acc);
  __syncthreads();  // every wgmma has read its stage: the ring becomes sC
  store_accumulators(sC, acc, warpgroup);
  __syncthreads();
  if (unsigned long long* rec = trace_record(a)) rec[kTraceClockMainEnd] = clock64();
  finish_tile<Spec>(a, sC, m0, n0, first);
  if (unsigned long long* rec = trace_record(a)) {
    rec[kTraceClockEnd] = clock64();
    rec[kTraceNsEnd] = global_timer_ns();
  }
#else
  // Not an sm_90a pass: the host never launches this kernel here (cuda_backend.cu).
  (void)a;
  (void)maps;
  __trap();
#endif
}

// ---- the persistent, warp-specialized variant ------------------------------------------------------
//
// The host runs it where it was measured faster than the kernel above (heuristics.h,
// persistent_pays: AdamW's hot formats on large layers, in measured ranges of T from 1024
// up), or everywhere it applies with FORGE_DEBUG_PERSISTENT=1 (its tests). The kernel above
// serializes each CTA's update after its main loop; its two CTAs per SM overlap only when they
// happen to be out of phase, and tiles of equal work keep them in phase. Here one CTA per SM loops over
// tiles with the roles fixed: warpgroups 0-1 run the wgmma main loop of tile j + 1 while
// warpgroups 2-3 run the update of tile j from sC, so the update always overlaps the tensor
// cores, and warpgroup 4's first thread is the TMA producer (its k-tile counter runs on across
// tiles, so the next tile's first stages load during the current tile's hand-off). The same
// wgmma stage and the same update (update_tile) as the kernel above; sC does not alias the
// ring. Only without split-K (splits == 1).
// NOTE: the producer has its own warpgroup. As thread 0 of a math warpgroup, per k-tile it
// would wait for the other warpgroup's release and compute the next item's tile with 64-bit
// divisions while its own warpgroup's next wgmma waited for it.
constexpr int kPersistentThreads = 640;  // warpgroups 0-1: main loop; 2-3: update; 4: producer
constexpr int kPersistentProducerThread = 512;
constexpr int kPersistentStages = 4;
constexpr int kPersistentUpdateBarrier = 1;  // named barrier of the update warpgroups
// NOTE: setmaxnreg. Each SM sub-partition holds one warp of each warpgroup and 16 Ki
// registers, so 640 threads launch with 96 each (512 per lane over 5 warps, in steps of 8:
// 480). The producer needs few; the math warpgroups keep 96 (64 accumulators: fewer spill);
// the update takes what the producer gives up, 128.
constexpr int kPersistentLaunchRegisters = 96;
constexpr int kPersistentProducerRegisters = 24;  // warpgroup 4
constexpr int kPersistentMathRegisters = 96;      // warpgroups 0-1
constexpr int kPersistentUpdateRegisters = 128;   // warpgroups 2-3
static_assert(kPersistentProducerRegisters + 2 * kPersistentMathRegisters +
                      2 * kPersistentUpdateRegisters <=
                  5 * kPersistentLaunchRegisters,
              "the registers given up cover the ones taken");
static_assert(kPersistentLaunchRegisters * kPersistentThreads <= 64 * 1024, "the register file");
constexpr size_t kPersistentRingBytes = size_t(kPersistentStages) * kSm90StageBytes;
constexpr size_t kPersistentSmemBytes = kPersistentRingBytes + kEpilogueBytes + kSm90Align;
static_assert(kPersistentSmemBytes <= 227 * 1024, "one CTA per SM");
static_assert(4 * 128 - 2 * 128 == kThreads, "update_tile's thread count");
// The persistent kernel's WgradParams::trace record (one per CTA; kTraceWords words): SM clock
// at start and end, and the cycles spent waiting, summed over the CTA's tiles: math thread 0
// on the ring's full barriers (loads late), the producer on its empty barriers (no stage
// free), the math warpgroups on sC to be free (the update behind), the update on sC to be
// full (the main loop behind). Read by bench/wgrad_bench --trace, which tells these records
// from the two-CTA kernel's TileTrace by kPersistentTraceFlag in the start word.
enum PersistentTrace { kPtClockStart, kPtLoadWait, kPtClockEnd, kPtSlotWait, kPtGradWait,
                       kPtTilesEmptyWait /* tiles | empty-barrier wait cycles << 16 */ };
constexpr unsigned long long kPersistentTraceFlag = 1ull << 63;  // | the start clock

template <bool kFp16, class Spec = GenericSpec>
__global__ void __launch_bounds__(kPersistentThreads, 1)
    wgrad_wgmma_persistent_kernel(const WgradParams a, const __grid_constant__ Sm90TensorMaps maps) {
#if defined(FORGE_SM90A_DEVICE_PASS)
  if (run_scalars_refused<Spec>(a)) return;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  __shared__ __align__(8) uint64_t s_full[kPersistentStages];   // TMA bytes of stage s landed
  __shared__ __align__(8) uint64_t s_empty[kPersistentStages];  // both math warpgroups done
  __shared__ __align__(8) uint64_t s_c_full;   // sC holds tile j (256 math-thread arrivals)
  __shared__ __align__(8) uint64_t s_c_empty;  // the update of tile j has read sC (256 arrivals)
  const uint32_t raw_addr = smem_addr(smem_raw);
  const uint32_t ring = (raw_addr + kSm90Align - 1) & ~uint32_t(kSm90Align - 1);
  float* const sC =  // [kBM][kLdC], after the ring
      reinterpret_cast<float*>(smem_raw + (ring - raw_addr) + kPersistentRingBytes);
  const uint32_t full0 = smem_addr(&s_full[0]), empty0 = smem_addr(&s_empty[0]);
  const uint32_t c_full = smem_addr(&s_c_full), c_empty = smem_addr(&s_c_empty);

  const int tiles = a.tiles_m * a.tiles_n;
  const int my_tiles =
      static_cast<int>(blockIdx.x) < tiles ? (tiles - 1 - blockIdx.x) / gridDim.x + 1 : 0;
  const int nk = static_cast<int>((a.tokens + kSm90BK - 1) / kSm90BK);
  auto tile_origin = [&](int j, int64_t& m0, int64_t& n0) {
    int tm, tn;
    tile_coords(a, static_cast<int>(blockIdx.x) + j * static_cast<int>(gridDim.x), tm, tn);
    m0 = static_cast<int64_t>(tm) * kBM;
    n0 = static_cast<int64_t>(tn) * kBN;
  };
  // The benchmark's trace (PersistentTrace), filled by threads 0 (math), 256 (update) and 512
  // (producer), written out by each at its end.
  __shared__ unsigned long long s_trace[kTraceWords];
  auto trace_out = [&](int word) {
    if (blockIdx.x < a.trace_ctas) a.trace[blockIdx.x * kTraceWords + word] = s_trace[word];
  };

  if (threadIdx.x == 0) {
    if (a.trace != nullptr) {
      for (int i = 0; i < kTraceWords; ++i) s_trace[i] = 0;
      s_trace[kPtClockStart] = clock64() | kPersistentTraceFlag;
    }
    mbar_init(c_full, 256);
    mbar_init(c_empty, 256);
    init_ring<kPersistentStages>(maps, full0, empty0);  // fences cover c_full / c_empty too
  }
  if constexpr (block_tables_needed<Spec>() != 0u)
    block_tables_init<block_tables_needed<Spec>()>(threadIdx.x);
  __syncthreads();  // the last CTA-wide barrier: the producer's idle threads exit below

  const int warpgroup = threadIdx.x / 128;
  if (warpgroup == 4) {
    setmaxnreg_dec<kPersistentProducerRegisters>();
    if (threadIdx.x != kPersistentProducerThread) return;
    // ---- the producer: item h = j * nk + kt (k-tile kt of tile j) into stage h % kStages ------
    int stage = 0;
    uint32_t phase = 0;  // of the empty barriers, once the ring has gone round once
    int64_t h = 0;
#pragma unroll 1
    for (int j = 0; j < my_tiles; ++j) {
      int64_t m0, n0;
      tile_origin(j, m0, n0);
#pragma unroll 1
      for (int kt = 0; kt < nk; ++kt, ++h) {
        // Both math warpgroups are done with item h - kStages in this stage.
        if (h >= kPersistentStages)
          mbar_wait_traced(a, empty0 + 8 * stage, phase, s_trace[kPtTilesEmptyWait]);
        issue_stage_loads(maps, ring + stage * kSm90StageBytes, full0 + 8 * stage, m0, n0,
                          kt * kSm90BK);
        if (++stage == kPersistentStages) {
          stage = 0;
          if (h >= kPersistentStages) phase ^= 1u;
        }
      }
    }
    if (a.trace != nullptr) {
      s_trace[kPtTilesEmptyWait] = static_cast<unsigned long long>(my_tiles) |
                                   (s_trace[kPtTilesEmptyWait] << 16);
      trace_out(kPtTilesEmptyWait);
    }
  } else if (warpgroup < 2) {
    setmaxnreg_dec<kPersistentMathRegisters>();
    // ---- main loop: warpgroup g sums rows 64g..64g+63 of each tile --------------------------
    const uint64_t desc_a0 =
        sw128_mn_desc(ring + warpgroup * kSm90BoxBytes, kSm90BoxBytes, 8 * 128);
    const uint64_t desc_b0 = sw128_mn_desc(ring + 2 * kSm90BoxBytes, kSm90BoxBytes, 8 * 128);
    int stage = 0, prev = 0;
    uint32_t phase = 0;
#pragma unroll 1
    for (int j = 0; j < my_tiles; ++j) {
      float acc[64];
#pragma unroll
      for (int i = 0; i < 64; ++i) acc[i] = 0.0f;
#pragma unroll 1
      for (int it = 0; it < nk; ++it) {
        mbar_wait_traced(a, full0 + 8 * stage, phase, s_trace[kPtLoadWait]);
        fence_accumulators(acc);
        wgmma_fence();
        wgmma_stage<kFp16>(acc, desc_a0, desc_b0, stage);
        wgmma_commit();
        // NOTE: one batch stays in flight; the previous item's is complete after this, so its
        // stage goes back to the producer (one arrival per warpgroup).
        wgmma_wait<1>();
        fence_accumulators(acc);
        if (it > 0 && threadIdx.x % 128 == 0) mbar_arrive(empty0 + 8 * prev);
        prev = stage;
        if (++stage == kPersistentStages) {
          stage = 0;
          phase ^= 1u;
        }
      }
      wgmma_wait<0>();
      fence_accumulators(acc);
      if (threadIdx.x % 128 == 0) mbar_arrive(empty0 + 8 * prev);  // the tile's last item
      // Hand the tile over: wait until the update has read the previous one out of sC.
      if (j > 0)
        mbar_wait_traced(a, c_empty, static_cast<uint32_t>(j - 1) & 1u, s_trace[kPtSlotWait]);
      store_accumulators(sC, acc, warpgroup);
      mbar_arrive(c_full);  // release: this thread's sC writes are visible to the waiter
    }
    if (a.trace != nullptr && threadIdx.x == 0) {
      trace_out(kPtClockStart);
      trace_out(kPtLoadWait);
      trace_out(kPtSlotWait);
    }
  } else {
    setmaxnreg_inc<kPersistentUpdateRegisters>();
    // ---- the update: warpgroups 2-3 ----------------------------------------------------------
    const int tid = threadIdx.x - 256;
    StepTotals totals{0.0, 0u};
    // NOTE: no L2 prefetch of the next tile's weight and states (WgradParams::prefetch is
    // ignored here): issued during the previous tile's update it is never faster.
#pragma unroll 1
    for (int j = 0; j < my_tiles; ++j) {
      int64_t m0, n0;
      tile_origin(j, m0, n0);
      mbar_wait_traced(a, c_full, static_cast<uint32_t>(j) & 1u, s_trace[kPtGradWait]);
      update_tile<Spec>(a, sC, m0, n0, totals, tid);
      mbar_arrive(c_empty);  // every read of sC by this thread is done
    }
    if (a.grad_sq_sum != nullptr || a.nonfinite_count != nullptr)
      flush_totals<kThreads, kPersistentUpdateBarrier>(totals, a.grad_sq_sum,
                                                        a.nonfinite_count, tid);
    if (a.trace != nullptr && tid == 0) {
      s_trace[kPtClockEnd] = clock64();
      trace_out(kPtClockEnd);
      trace_out(kPtGradWait);
    }
  }
#else
  (void)a;
  (void)maps;
  __trap();
#endif
}

}  // namespace cuda
}  // namespace forge
