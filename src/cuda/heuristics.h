// heuristics.h — the CUDA backend's kernel-choice policy: which wgrad kernel a step runs and
// how it is launched (split-K, tile order, L2 prefetch, stagger, persistent grid), as pure
// functions of plain facts about the device and the step. Host-only C++17 without CUDA
// headers, so the CPU suite tests the policy (tests/cpp/test_heuristics.cpp); cuda_backend.cu
// gathers the facts, reads the debug switches once, and executes the plan.
// The measurements behind its constants and windows: docs/performance.md, "Kernel selection".
#pragma once

#include <cstdint>

#include "forge/forge.h"

namespace forge {
namespace cuda {

// ---- the kernels' geometry, as the policy sees it --------------------------------------------
// (cuda_backend.cu checks these against the kernel headers' own constants.)

constexpr int64_t kTileRows = 128;            // kBM: one CTA's tile of dW, rows (out)
constexpr int64_t kTileCols = 128;            // kBN: columns (in)
constexpr int64_t kSm80TokensPerKtile = 32;   // kBK: the sm80 kernels' pipeline stage
constexpr int64_t kSm90TokensPerKtile = 64;   // kSm90BK: the Hopper kernels' stage
// The largest extent (rows, cols, tokens) the TMA path takes: its coordinates are signed
// 32-bit, kept two tiles clear of the limit.
constexpr int64_t kTmaCoordMax = INT32_MAX - 2 * kTileRows;

// ---- policy constants -----------------------------------------------------------------------

// Split-K: at least this many tokens per split, so the partial round trip (2 × 64 KiB per
// CTA) stays small next to the split's GEMM work; and at most kMaxSplits splits.
constexpr int64_t kMinSplitTokens = 256;
constexpr int64_t kMaxSplits = 64;

// NOTE: tile rasterization, tile-rows per group (WgradParams::group_m): kGroupM, or
// kGroupMFewWaves for a layer whose tiles fill at most kFewWaves waves of the two resident
// CTAs per SM. Measured, not derived.
constexpr int kGroupM = 8;
constexpr int kGroupMFewWaves = 2;
constexpr int kFewWaves = 4;

// NOTE: the L2 prefetch of the tile's weight and states is issued this many tokens before the
// main loop ends, so the epilogue's loads hit L2 instead of waiting on HBM.
constexpr int kPrefetchLeadTokens = 192;

// NOTE: the stagger of the two-CTA Hopper kernel. Both CTAs of an SM start together and have
// equal work, so they stay in phase: both in the main loop (tensor cores shared, memory
// idle), then both updating (tensor cores idle). Delaying the first wave's second CTA per SM
// (blockIdx.x in [SMs, 2·SMs)) by kStaggerNs puts the two out of phase for the rest of the
// launch. The delay is paid once per SM, so only grids of at least kStaggerMinWaves full
// waves get it, and not with a stochastically rounded weight, whose longer update already
// leaves the two CTAs mostly out of phase.
constexpr int kStaggerNs = 4000;
constexpr int kStaggerMinWaves = 3;

// ---- debug switches -------------------------------------------------------------------------
//
// Every environment switch of the CUDA backend is a debug or benchmark knob: none is needed
// in production, and each default is the tuned behaviour. cuda_backend.cu reads them once per
// process, at the backend's first call (debug_switches()); a default-constructed
// DebugSwitches is "none set".
//
//   FORGE_DEBUG_WGMMA=0              keep the sm80 kernels on Hopper too (A/B benchmarks, the
//                                    test suite on both paths). Default: on.
//   FORGE_DEBUG_PERSISTENT=1|0       1: the persistent Hopper kernel wherever it applies (its
//                                    tests); 0: never. Default (unset): where persistent_pays.
//   FORGE_DEBUG_PERSISTENT_CTAS=n    cap the persistent grid at n CTAs, so that small test
//                                    layers also run several tiles per CTA. Default: 0, one
//                                    CTA per SM.
//   FORGE_DEBUG_GROUP_M=n            tile-rows per rasterization group for every layer (1:
//                                    plain row-major order). Default: 0, group_height's choice.
//   FORGE_DEBUG_STAGGER_NS=ns        the two-CTA Hopper kernel's stagger (0: off). Default:
//                                    kStaggerNs.
//   FORGE_DEBUG_EPILOGUE_PREFETCH=0|1 0: no L2 prefetch of the update's operands; 1: the
//                                    prefetch on every card (with a nearest-rounded weight,
//                                    no split-K). Default (unset): prefetch_pays.
//   FORGE_DEBUG_PREFETCH_LEAD=tokens issue that prefetch this many tokens before the main
//                                    loop's end. Default: kPrefetchLeadTokens.
//   FORGE_DEBUG_TRACE=addr:records   (hex device address, count) the Hopper kernels write
//                                    one record of kTraceWords 64-bit words per CTA there
//                                    (TileTrace or PersistentTrace, sm90_wgrad.cuh),
//                                    overwritten by every launch; the caller allocates it on
//                                    the steps' device (wgrad_bench --trace). Default: off.
//   FORGE_DEBUG_LOG (set, not "0")   log to stderr which kernel each configuration runs (once
//                                    per kernel and formats), and each kernel's occupancy,
//                                    registers and shared memory per device. Default: off.
enum class PersistentOverride { kAuto, kAlways, kNever };
enum class PrefetchOverride { kAuto, kOn, kOff };

struct DebugSwitches {
  bool wgmma = true;
  PersistentOverride persistent = PersistentOverride::kAuto;
  int64_t persistent_ctas = 0;  // 0: no cap
  int group_m = 0;              // 0: group_height
  int stagger_ns = kStaggerNs;
  PrefetchOverride epilogue_prefetch = PrefetchOverride::kAuto;
  int prefetch_lead = kPrefetchLeadTokens;
  unsigned long long trace_address = 0;  // 0: no trace
  int64_t trace_records = 0;
  bool log = false;
};

// ---- the policy -----------------------------------------------------------------------------

// Peak DRAM bandwidth in GB/s from what the device reports: the memory clock in kHz
// (cudaDevAttrMemoryClockRate), two transfers per clock, over a bus of `bus_bits`
// (cudaDevAttrGlobalMemoryBusWidth). 0 where either is unknown.
constexpr int dram_gbps_of(int memory_khz, int bus_bits) {
  return memory_khz > 0 && bus_bits > 0
             ? static_cast<int>(2 * static_cast<int64_t>(memory_khz) * (bus_bits / 8) / 1000000)
             : 0;
}

// Whether a card's DRAM is of the H100's class (below 4 TB/s; unknown is not): the policies
// measured on both cards differ there (persistent_pays, prefetch_pays).
constexpr int kH100ClassMaxGbps = 4000;
constexpr bool h100_class_dram(int dram_gbps) {
  return dram_gbps > 0 && dram_gbps < kH100ClassMaxGbps;
}

// Whether the two-CTA kernels' L2 prefetch of the update's operands pays on this card.
// NOTE: not on the H100's DRAM class: there the prefetch competes with the other CTA's
// update for the smaller DRAM bandwidth.
constexpr bool prefetch_pays(int dram_gbps) { return !h100_class_dram(dram_gbps); }

// Whether the persistent kernel is the faster one for a step of `tokens` tokens on a layer of
// `tiles` tiles in these formats, on a card of `dram_gbps` GB/s of DRAM bandwidth (0:
// unknown). `spec_kernel`: it has a specialized kernel for the step's rule and formats
// (AdamW, bf16 or bf16-SR weight, bf16, bf16-SR, int8 or fp8 states, or bf16-SR weight and
// int4 states; bf16 inputs). int4 has no window until it is measured.
// NOTE: the windows are where the persistent kernel measured faster than the two-CTA kernel,
// per card. The two cards measured have the same SMs and clocks and differ in DRAM bandwidth,
// which moves the balance between a tile's update and its GEMM, and the windows with it; a
// card takes the windows of the measured card nearest in DRAM bandwidth. Outside them it
// loses: at T = 512 (its 8 update warps per SM are the limit) and on layers of few tiles per
// SM.
struct PersistentWindow {
  bool h100;  // the H100's window (h100_class_dram), else the H200's
  int weight_format, state_format;
  int64_t min_tiles_per_sm;
  int64_t min_tokens, max_tokens;  // [min, max]
};
constexpr int64_t kNoMaxTokens = INT64_MAX;
constexpr bool kH200 = false, kH100 = true;
constexpr PersistentWindow kPersistentWindows[] = {
    {kH200, FORGE_WEIGHT_BF16, FORGE_STATE_BF16, 16, 1024, kNoMaxTokens},
    {kH200, FORGE_WEIGHT_BF16, FORGE_STATE_INT8_BLOCK64, 16, 2048, kNoMaxTokens},
    {kH200, FORGE_WEIGHT_BF16_STOCHASTIC, FORGE_STATE_BF16_STOCHASTIC, 16, 1024, 4095},
    {kH200, FORGE_WEIGHT_BF16_STOCHASTIC, FORGE_STATE_INT8_BLOCK64, 16, 4096, kNoMaxTokens},
    {kH200, FORGE_WEIGHT_BF16, FORGE_STATE_FP8_BLOCK64, 16, 2048, kNoMaxTokens},
    {kH200, FORGE_WEIGHT_BF16_STOCHASTIC, FORGE_STATE_FP8_BLOCK64, 16, 4096, kNoMaxTokens},
    {kH100, FORGE_WEIGHT_BF16, FORGE_STATE_BF16, 7, 1024, kNoMaxTokens},
    {kH100, FORGE_WEIGHT_BF16_STOCHASTIC, FORGE_STATE_BF16_STOCHASTIC, 16, 1024, kNoMaxTokens},
    {kH100, FORGE_WEIGHT_BF16_STOCHASTIC, FORGE_STATE_BF16_STOCHASTIC, 7, 1024, 1536},
    {kH100, FORGE_WEIGHT_BF16, FORGE_STATE_INT8_BLOCK64, 7, 1024, kNoMaxTokens},
    {kH100, FORGE_WEIGHT_BF16_STOCHASTIC, FORGE_STATE_INT8_BLOCK64, 16, 1536, kNoMaxTokens},
    {kH100, FORGE_WEIGHT_BF16_STOCHASTIC, FORGE_STATE_INT8_BLOCK64, 7, 2048, kNoMaxTokens},
    {kH100, FORGE_WEIGHT_BF16, FORGE_STATE_FP8_BLOCK64, 16, 1024, kNoMaxTokens},
    {kH100, FORGE_WEIGHT_BF16, FORGE_STATE_FP8_BLOCK64, 7, 1536, kNoMaxTokens},
    {kH100, FORGE_WEIGHT_BF16_STOCHASTIC, FORGE_STATE_FP8_BLOCK64, 16, 2048, kNoMaxTokens},
    {kH100, FORGE_WEIGHT_BF16_STOCHASTIC, FORGE_STATE_FP8_BLOCK64, 7, 4096, kNoMaxTokens},
};
constexpr bool persistent_pays(int64_t tokens, int64_t tiles, int num_sms, int dram_gbps,
                               int weight_format, int state_format, bool spec_kernel) {
  if (!spec_kernel) return false;
  const bool h100 = h100_class_dram(dram_gbps);
  for (const PersistentWindow& w : kPersistentWindows)
    if (w.h100 == h100 && w.weight_format == weight_format && w.state_format == state_format &&
        tiles >= w.min_tiles_per_sm * static_cast<int64_t>(num_sms) && tokens >= w.min_tokens &&
        tokens <= w.max_tokens)
      return true;
  return false;
}

// The tile rasterization's group height for a layer of `tiles` tiles on `num_sms` SMs.
constexpr int group_height(int64_t tiles, int num_sms) {
  const int64_t resident_ctas = 2 * static_cast<int64_t>(num_sms);  // two CTAs per SM
  return tiles <= kFewWaves * resident_ctas ? kGroupMFewWaves : kGroupM;
}

// What the launcher knows about a step when it chooses its kernel.
struct WgradFacts {
  int num_sms = 0;
  int dram_gbps = 0;   // peak DRAM bandwidth, GB/s (0: unknown)
  bool wgmma = false;  // the sm_90a kernels run on this device
  int x_dtype = FORGE_DTYPE_BF16, dy_dtype = FORGE_DTYPE_BF16;
  bool x_aligned16 = true, dy_aligned16 = true;  // base addresses
  int64_t ldx = 0, lddy = 0;                      // elements
  int64_t rows = 0, cols = 0, tokens = 0;         // W: [rows, cols]; X: [tokens, cols]
  int weight_format = FORGE_WEIGHT_BF16, state_format = FORGE_STATE_BF16;
  // A specialized persistent kernel exists for the step's rule, formats and scalars mode
  // (bf16 inputs; cuda_backend.cu's kPersistentSpec[Run]Kernels).
  bool persistent_spec_kernel = false;
  bool run_scalars = false;  // the step reads its scalars from device memory (CUDA graphs)
};

enum class WgradPath {
  kSm90Persistent,  // wgrad_wgmma_persistent_kernel: one CTA per SM looping over tiles
  kSm90TwoCta,      // wgrad_wgmma_kernel: one CTA per (tile, split), two per SM
  kSm80Mma,         // wgrad_mma_kernel: bf16 or fp16 inputs, mma.sync
  kSimt,            // wgrad_simt_kernel: fp32 or mixed inputs
};

// How a step runs. The grid: path kSm90Persistent, persistent_ctas CTAs; otherwise
// (tiles, 1, splits).
struct WgradPlan {
  WgradPath path = WgradPath::kSimt;
  bool persistent_spec = false;  // kSm90Persistent: the specialized kernel (else the generic)
  int64_t tiles_m = 0, tiles_n = 0, tiles = 0;
  int64_t splits = 1, ktiles_per_split = 0;
  int group_m = 0;
  bool prefetch = false;  // L2 prefetch of the update's operands
  int prefetch_lead = 0;  // ... this many tokens before the main loop's end
  int stagger_ns = 0;     // kSm90TwoCta: CTAs [stagger_first, + stagger_count) wait this long
  int stagger_first = 0, stagger_count = 0;
  int64_t persistent_ctas = 0;
};

constexpr bool is_sm90(WgradPath path) {
  return path == WgradPath::kSm90Persistent || path == WgradPath::kSm90TwoCta;
}

// The plan of a wgrad step. The caller rejects plans of more than INT32_MAX tiles.
constexpr WgradPlan plan_wgrad(const WgradFacts& f, const DebugSwitches& d) {
  WgradPlan plan;
  plan.tiles_m = (f.rows + kTileRows - 1) / kTileRows;
  plan.tiles_n = (f.cols + kTileCols - 1) / kTileCols;
  plan.tiles = plan.tiles_m * plan.tiles_n;
  const int64_t tiles = plan.tiles;

  // The Hopper main loop (TMA + wgmma) when this device runs it and the inputs suit TMA:
  // bf16/bf16 or fp16/fp16, 16 B aligned bases, row strides a multiple of 16 B, and
  // coordinates within TMA's signed 32-bit range. Anything else: the sm80 kernels.
  const bool bf16_inputs = f.x_dtype == FORGE_DTYPE_BF16 && f.dy_dtype == FORGE_DTYPE_BF16;
  const bool fp16_inputs = f.x_dtype == FORGE_DTYPE_FP16 && f.dy_dtype == FORGE_DTYPE_FP16;
  const bool use_wgmma = f.wgmma && (bf16_inputs || fp16_inputs) && d.wgmma && f.x_aligned16 &&
                         f.dy_aligned16 && f.ldx % 8 == 0 && f.lddy % 8 == 0 &&
                         f.rows <= kTmaCoordMax && f.cols <= kTmaCoordMax &&
                         f.tokens <= kTmaCoordMax;

  // Tokens per k-tile: each kernel's own pipeline stage (split-K counts in k-tiles).
  const int64_t bk = use_wgmma ? kSm90TokensPerKtile : kSm80TokensPerKtile;
  const int64_t ktiles = (f.tokens + bk - 1) / bk;

  // Split-K: only when the tiles alone leave SMs idle, at least kMinSplitTokens tokens per
  // split, and never more partials than workspace slots (= SMs).
  // NOTE: the bound tiles × splits ≤ SMs is what keeps the workspace O(SMs × tile).
  const int64_t min_ktiles_per_split = kMinSplitTokens / bk;
  int64_t splits = 1;
  if (tiles < f.num_sms && ktiles >= 2 * min_ktiles_per_split) {
    splits = f.num_sms / tiles;
    splits = splits < ktiles / min_ktiles_per_split ? splits : ktiles / min_ktiles_per_split;
    splits = splits < kMaxSplits ? splits : kMaxSplits;
    if (splits < 1) splits = 1;
  }
  const int64_t per = (ktiles + splits - 1) / splits;
  splits = (ktiles + per - 1) / per;  // no empty split
  plan.splits = splits;
  plan.ktiles_per_split = per;

  plan.prefetch = splits == 1 && (d.epilogue_prefetch == PrefetchOverride::kOn ||
                                   (d.epilogue_prefetch == PrefetchOverride::kAuto &&
                                    prefetch_pays(f.dram_gbps)));
  plan.prefetch_lead = d.prefetch_lead;
  plan.group_m = d.group_m > 0 ? d.group_m : group_height(tiles, f.num_sms);

  if (!use_wgmma) {
    plan.path = bf16_inputs || fp16_inputs ? WgradPath::kSm80Mma : WgradPath::kSimt;
    return plan;
  }

  // The persistent kernel: its specialized kernel for these formats, if any (a graph's step
  // has only those), else the generic one (forced only).
  const bool persistent_spec = splits == 1 && !fp16_inputs && f.persistent_spec_kernel;
  const bool persistent_applies = splits == 1 && (!f.run_scalars || persistent_spec);
  const bool use_persistent =
      persistent_applies &&
      (d.persistent == PersistentOverride::kAlways ||
       (d.persistent == PersistentOverride::kAuto &&
        persistent_pays(f.tokens, tiles, f.num_sms, f.dram_gbps, f.weight_format,
                        f.state_format, persistent_spec)));
  if (use_persistent) {
    plan.path = WgradPath::kSm90Persistent;
    plan.persistent_spec = persistent_spec;
    int64_t ctas = tiles < f.num_sms ? tiles : f.num_sms;
    if (const int64_t cap = d.persistent_ctas) ctas = ctas < cap ? ctas : cap;
    plan.persistent_ctas = ctas;
    return plan;
  }

  // NOTE: the stagger and the L2 prefetch of the update's operands are for nearest-rounded
  // weights only. A stochastically rounded weight's longer update already leaves the two CTAs
  // of an SM mostly out of phase: the stagger then only delays, and the prefetch competes
  // with the other CTA's update for L2 and DRAM instead of filling an idle DRAM.
  plan.path = WgradPath::kSm90TwoCta;
  const bool ctas_in_phase = f.weight_format != FORGE_WEIGHT_BF16_STOCHASTIC;
  plan.stagger_ns = splits == 1 && tiles >= kStaggerMinWaves * 2 * f.num_sms && ctas_in_phase
                        ? d.stagger_ns
                        : 0;
  plan.stagger_first = f.num_sms;
  plan.stagger_count = f.num_sms;
  if (!ctas_in_phase) plan.prefetch = false;
  return plan;
}

// Elementwise / state kernels: the grid for `pairs` (row, 64-column block) pairs, each warp
// taking pairs_per_warp of them per iteration, `threads` threads per CTA.
// NOTE: a grid-stride loop over at most 16 CTAs per SM: enough warps in flight to cover
// memory latency, and no tail of tiny CTAs on huge parameters.
constexpr int elementwise_blocks(int64_t pairs, int num_sms, int pairs_per_warp, int threads) {
  const int64_t warps = (pairs + pairs_per_warp - 1) / pairs_per_warp;
  const int64_t blocks = (warps + threads / 32 - 1) / (threads / 32);
  const int64_t cap = static_cast<int64_t>(num_sms) * 16;
  return static_cast<int>(blocks < cap ? blocks : cap);
}

}  // namespace cuda
}  // namespace forge
