// test_heuristics.cpp — the CUDA backend's kernel-choice policy (src/cuda/heuristics.h),
// pinned on the CPU: the default choice of the persistent Hopper kernel (persistent_pays) on
// the shapes and cards it was measured on (the H200, the H100), and the whole plan (path,
// split-K, tile order, prefetch, stagger, persistent grid) for Llama-3.1-8B's layers on a
// 132-SM H200, for split-K layers, for the inputs that fall back from the Hopper kernels, for
// odd shapes and under the debug overrides. The expected values are what the backend launches today: a change here is a
// change of the kernels' launches, to be measured first.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>

#include "cuda/heuristics.h"

namespace forge_test {
namespace {

using forge::cuda::DebugSwitches;
using forge::cuda::PersistentOverride;
using forge::cuda::PrefetchOverride;
using forge::cuda::persistent_pays;
using forge::cuda::plan_wgrad;
using forge::cuda::WgradFacts;
using forge::cuda::WgradPath;
using forge::cuda::WgradPlan;

constexpr int kSms = 132;
constexpr int kH200Gbps = 4916;  // an H200-class card: 6144-bit bus at 3201 MHz
constexpr int kH100Gbps = 3352;  // the H100 SXM as it reports itself: 5120 bits at 2619 MHz
constexpr int64_t kMlpTiles = 112 * 32;  // 14336 × 4096 in 128 × 128 tiles: 27 per SM
constexpr int64_t kQprojTiles = 32 * 32;  // 4096 × 4096: 7.8 per SM

// ---- persistent_pays ------------------------------------------------------------------------

TEST(DramBandwidth, FromTheMemoryClockAndBusTheDevicesReport) {
  EXPECT_EQ(forge::cuda::dram_gbps_of(2619000, 5120), kH100Gbps);
  EXPECT_EQ(forge::cuda::dram_gbps_of(3201000, 6144), kH200Gbps);
  EXPECT_EQ(forge::cuda::dram_gbps_of(0, 5120), 0);
  EXPECT_EQ(forge::cuda::dram_gbps_of(2619000, 0), 0);
}

bool mlp(int64_t tokens, int weight, int state) {
  return persistent_pays(tokens, kMlpTiles, kSms, kH200Gbps, weight, state, true);
}

TEST(PersistentRule, BF16WeightAndStatesFromT1024) {
  EXPECT_FALSE(mlp(512, FORGE_WEIGHT_BF16, FORGE_STATE_BF16));
  EXPECT_FALSE(mlp(1023, FORGE_WEIGHT_BF16, FORGE_STATE_BF16));
  EXPECT_TRUE(mlp(1024, FORGE_WEIGHT_BF16, FORGE_STATE_BF16));
  EXPECT_TRUE(mlp(8192, FORGE_WEIGHT_BF16, FORGE_STATE_BF16));
}

TEST(PersistentRule, Int8StatesFromT2048OrT4096ByWeight) {
  EXPECT_FALSE(mlp(1024, FORGE_WEIGHT_BF16, FORGE_STATE_INT8_BLOCK64));
  EXPECT_TRUE(mlp(2048, FORGE_WEIGHT_BF16, FORGE_STATE_INT8_BLOCK64));
  EXPECT_FALSE(mlp(2048, FORGE_WEIGHT_BF16_STOCHASTIC, FORGE_STATE_INT8_BLOCK64));
  EXPECT_TRUE(mlp(4096, FORGE_WEIGHT_BF16_STOCHASTIC, FORGE_STATE_INT8_BLOCK64));
  EXPECT_TRUE(mlp(8192, FORGE_WEIGHT_BF16_STOCHASTIC, FORGE_STATE_INT8_BLOCK64));
}

TEST(PersistentRule, StochasticWeightAndStatesFromT1024BelowT4096) {
  EXPECT_FALSE(mlp(768, FORGE_WEIGHT_BF16_STOCHASTIC, FORGE_STATE_BF16_STOCHASTIC));
  EXPECT_TRUE(mlp(1024, FORGE_WEIGHT_BF16_STOCHASTIC, FORGE_STATE_BF16_STOCHASTIC));
  EXPECT_TRUE(mlp(4095, FORGE_WEIGHT_BF16_STOCHASTIC, FORGE_STATE_BF16_STOCHASTIC));
  EXPECT_FALSE(mlp(4096, FORGE_WEIGHT_BF16_STOCHASTIC, FORGE_STATE_BF16_STOCHASTIC));
}

TEST(PersistentRule, OnlyLayersOfAtLeast16TilesPerSm) {
  auto bf16 = [](int64_t tiles) {
    return persistent_pays(2048, tiles, kSms, kH200Gbps, FORGE_WEIGHT_BF16, FORGE_STATE_BF16,
                           true);
  };
  EXPECT_FALSE(bf16(kQprojTiles));
  EXPECT_FALSE(bf16(16 * kSms - 1));
  EXPECT_TRUE(bf16(16 * kSms));
}

TEST(PersistentRule, NeverWithoutASpecializedKernelOrOutsideItsFormats) {
  EXPECT_FALSE(
      persistent_pays(2048, kMlpTiles, kSms, kH200Gbps, FORGE_WEIGHT_BF16, FORGE_STATE_BF16,
                      false));
  EXPECT_FALSE(mlp(2048, FORGE_WEIGHT_BF16_MASTER, FORGE_STATE_FP32));
  EXPECT_FALSE(mlp(2048, FORGE_WEIGHT_FP32, FORGE_STATE_FP32));
  EXPECT_FALSE(mlp(2048, FORGE_WEIGHT_BF16, FORGE_STATE_BF16_STOCHASTIC));
}

TEST(PersistentRule, Fp8StatesTakeInt8sWindowsOnTheH200) {
  EXPECT_FALSE(mlp(1024, FORGE_WEIGHT_BF16, FORGE_STATE_FP8_BLOCK64));
  EXPECT_TRUE(mlp(2048, FORGE_WEIGHT_BF16, FORGE_STATE_FP8_BLOCK64));
  EXPECT_FALSE(mlp(2048, FORGE_WEIGHT_BF16_STOCHASTIC, FORGE_STATE_FP8_BLOCK64));
  EXPECT_TRUE(mlp(4096, FORGE_WEIGHT_BF16_STOCHASTIC, FORGE_STATE_FP8_BLOCK64));
}

// The H100's windows (DRAM below 4 TB/s): wider, and on q_proj-sized layers too.
bool h100(int64_t tokens, int64_t tiles, int weight, int state) {
  return persistent_pays(tokens, tiles, kSms, kH100Gbps, weight, state, true);
}

TEST(PersistentRule, OnTheH100MlpLayersFromT1024ExceptSrWeightBeside1ByteStates) {
  const int weights[] = {FORGE_WEIGHT_BF16, FORGE_WEIGHT_BF16_STOCHASTIC};
  const int states[] = {FORGE_STATE_BF16, FORGE_STATE_BF16_STOCHASTIC, FORGE_STATE_INT8_BLOCK64,
                        FORGE_STATE_FP8_BLOCK64};
  for (int w : weights)
    for (int s : states) {
      // (a nearest weight beside SR states and the reverse have no specialized kernel)
      if ((w == FORGE_WEIGHT_BF16 && s == FORGE_STATE_BF16_STOCHASTIC) ||
          (w == FORGE_WEIGHT_BF16_STOCHASTIC && s == FORGE_STATE_BF16))
        continue;
      SCOPED_TRACE(std::to_string(w) + "/" + std::to_string(s));
      EXPECT_FALSE(h100(512, kMlpTiles, w, s));
      EXPECT_TRUE(h100(8192, kMlpTiles, w, s));
      const bool sr_beside_1_byte =
          w == FORGE_WEIGHT_BF16_STOCHASTIC && s != FORGE_STATE_BF16_STOCHASTIC;
      EXPECT_EQ(h100(1024, kMlpTiles, w, s), !sr_beside_1_byte);
    }
  EXPECT_TRUE(h100(1536, kMlpTiles, FORGE_WEIGHT_BF16_STOCHASTIC, FORGE_STATE_INT8_BLOCK64));
  EXPECT_FALSE(h100(1536, kMlpTiles, FORGE_WEIGHT_BF16_STOCHASTIC, FORGE_STATE_FP8_BLOCK64));
  EXPECT_TRUE(h100(2048, kMlpTiles, FORGE_WEIGHT_BF16_STOCHASTIC, FORGE_STATE_FP8_BLOCK64));
  // the SR weight and states past the H200's window
  EXPECT_TRUE(h100(4096, kMlpTiles, FORGE_WEIGHT_BF16_STOCHASTIC, FORGE_STATE_BF16_STOCHASTIC));
}

TEST(PersistentRule, OnTheH100QprojSizedLayersInTheirWindows) {
  EXPECT_TRUE(h100(1024, kQprojTiles, FORGE_WEIGHT_BF16, FORGE_STATE_BF16));
  EXPECT_TRUE(h100(1024, kQprojTiles, FORGE_WEIGHT_BF16, FORGE_STATE_INT8_BLOCK64));
  EXPECT_TRUE(h100(1536, kQprojTiles, FORGE_WEIGHT_BF16_STOCHASTIC, FORGE_STATE_BF16_STOCHASTIC));
  EXPECT_FALSE(h100(2048, kQprojTiles, FORGE_WEIGHT_BF16_STOCHASTIC, FORGE_STATE_BF16_STOCHASTIC));
  EXPECT_FALSE(h100(1536, kQprojTiles, FORGE_WEIGHT_BF16_STOCHASTIC, FORGE_STATE_INT8_BLOCK64));
  EXPECT_TRUE(h100(2048, kQprojTiles, FORGE_WEIGHT_BF16_STOCHASTIC, FORGE_STATE_INT8_BLOCK64));
  EXPECT_FALSE(h100(1024, kQprojTiles, FORGE_WEIGHT_BF16, FORGE_STATE_FP8_BLOCK64));
  EXPECT_TRUE(h100(1536, kQprojTiles, FORGE_WEIGHT_BF16, FORGE_STATE_FP8_BLOCK64));
  EXPECT_FALSE(h100(3072, kQprojTiles, FORGE_WEIGHT_BF16_STOCHASTIC, FORGE_STATE_FP8_BLOCK64));
  EXPECT_TRUE(h100(4096, kQprojTiles, FORGE_WEIGHT_BF16_STOCHASTIC, FORGE_STATE_FP8_BLOCK64));
  // k_proj-sized layers (1.9 tiles per SM) never
  EXPECT_FALSE(h100(4096, 256, FORGE_WEIGHT_BF16, FORGE_STATE_INT8_BLOCK64));
  EXPECT_FALSE(h100(4096, 7 * kSms - 1, FORGE_WEIGHT_BF16, FORGE_STATE_INT8_BLOCK64));
}

TEST(PersistentRule, ACardWithoutABandwidthTakesTheH200sWindows) {
  for (int64_t tokens : {512, 1024, 2048, 4096, 8192})
    for (int64_t tiles : {kQprojTiles, kMlpTiles})
      EXPECT_EQ(persistent_pays(tokens, tiles, kSms, 0, FORGE_WEIGHT_BF16_STOCHASTIC,
                                FORGE_STATE_BF16_STOCHASTIC, true),
                persistent_pays(tokens, tiles, kSms, kH200Gbps, FORGE_WEIGHT_BF16_STOCHASTIC,
                                FORGE_STATE_BF16_STOCHASTIC, true));
  EXPECT_FALSE(persistent_pays(4096, kMlpTiles, kSms, 0, FORGE_WEIGHT_BF16_STOCHASTIC,
                               FORGE_STATE_BF16_STOCHASTIC, true));
}

// ---- the plan -------------------------------------------------------------------------------

// A bf16 step on an H200 (132 SMs, sm_90a kernels loaded): W [rows, cols], contiguous
// operands (ldx = cols, lddy = rows), 16 B aligned, AdamW in one of its hot formats (so a
// specialized persistent kernel exists), eager (no run scalars).
WgradFacts h200(int64_t rows, int64_t cols, int64_t tokens, int weight = FORGE_WEIGHT_BF16,
                int state = FORGE_STATE_BF16) {
  WgradFacts f;
  f.num_sms = kSms;
  f.dram_gbps = kH200Gbps;
  f.wgmma = true;
  f.x_dtype = f.dy_dtype = FORGE_DTYPE_BF16;
  f.x_aligned16 = f.dy_aligned16 = true;
  f.ldx = cols;
  f.lddy = rows;
  f.rows = rows;
  f.cols = cols;
  f.tokens = tokens;
  f.weight_format = weight;
  f.state_format = state;
  f.persistent_spec_kernel = true;
  f.run_scalars = false;
  return f;
}

WgradPlan plan(const WgradFacts& f, const DebugSwitches& d = DebugSwitches{}) {
  return plan_wgrad(f, d);
}

// P: sm90 persistent, 2: sm90 two-CTA, M: sm80 mma, S: SIMT.
char path_code(WgradPath path) {
  switch (path) {
    case WgradPath::kSm90Persistent: return 'P';
    case WgradPath::kSm90TwoCta: return '2';
    case WgradPath::kSm80Mma: return 'M';
    case WgradPath::kSimt: return 'S';
  }
  return '?';
}

// ---- Llama-3.1-8B on the H200 ----

struct LlamaLayer {
  const char* name;
  int64_t rows, cols;
  int64_t tiles;
  int group_m;     // kGroupMFewWaves (2) up to 4 waves of 2 × 132 CTAs, else kGroupM (8)
  int stagger_ns;  // the two-CTA kernel with a nearest-rounded weight: 3 waves or more
};
constexpr LlamaLayer kLlama[] = {
    {"q_proj/o_proj 4096x4096", 4096, 4096, 1024, 2, 4000},
    {"k_proj/v_proj 1024x4096", 1024, 4096, 256, 2, 0},
    {"gate_proj/up_proj 14336x4096", 14336, 4096, 3584, 8, 4000},
    {"down_proj 4096x14336", 4096, 14336, 3584, 8, 4000},
    {"lm_head 128256x4096", 128256, 4096, 32064, 8, 4000},
};
constexpr int64_t kLlamaTokens[] = {32, 512, 1024, 2048, 4096};

// Checks every field of the plans of the Llama layers in one format against `paths`: one
// string per layer (kLlama's order), one path code per T of kLlamaTokens.
void expect_llama(int weight, int state, const std::string (&paths)[5]) {
  const bool sr_weight = weight == FORGE_WEIGHT_BF16_STOCHASTIC;
  for (int l = 0; l < 5; ++l) {
    const LlamaLayer& layer = kLlama[l];
    for (int t = 0; t < 5; ++t) {
      const int64_t tokens = kLlamaTokens[t];
      SCOPED_TRACE(std::string(layer.name) + ", T = " + std::to_string(tokens));
      const WgradPlan p = plan(h200(layer.rows, layer.cols, tokens, weight, state));
      const char expected = paths[l][t];
      EXPECT_EQ(path_code(p.path), expected);
      EXPECT_EQ(p.tiles_m, (layer.rows + 127) / 128);
      EXPECT_EQ(p.tiles_n, (layer.cols + 127) / 128);
      EXPECT_EQ(p.tiles, layer.tiles);
      EXPECT_EQ(p.splits, 1);
      EXPECT_EQ(p.ktiles_per_split, (tokens + 63) / 64);
      EXPECT_EQ(p.group_m, layer.group_m);
      EXPECT_EQ(p.prefetch_lead, 192);
      if (expected == 'P') {
        EXPECT_TRUE(p.persistent_spec);
        EXPECT_EQ(p.persistent_ctas, kSms);
        EXPECT_TRUE(p.prefetch);  // (the persistent kernel ignores it)
        EXPECT_EQ(p.stagger_ns, 0);
        EXPECT_EQ(p.stagger_first, 0);
        EXPECT_EQ(p.stagger_count, 0);
      } else {
        EXPECT_EQ(p.persistent_ctas, 0);
        EXPECT_EQ(p.prefetch, !sr_weight);
        EXPECT_EQ(p.stagger_ns, sr_weight ? 0 : layer.stagger_ns);
        EXPECT_EQ(p.stagger_first, kSms);
        EXPECT_EQ(p.stagger_count, kSms);
      }
    }
  }
}

// T:                                         32   512  1024 2048 4096
TEST(WgradPlanLlama, Bf16WeightBf16States) {
  expect_llama(FORGE_WEIGHT_BF16, FORGE_STATE_BF16, {"22222",   // q_proj, o_proj
                                                     "22222",   // k_proj, v_proj
                                                     "22PPP",   // gate_proj, up_proj
                                                     "22PPP",   // down_proj
                                                     "22PPP"}); // lm_head
}

TEST(WgradPlanLlama, StochasticWeightAndStates) {
  expect_llama(FORGE_WEIGHT_BF16_STOCHASTIC, FORGE_STATE_BF16_STOCHASTIC,
               {"22222", "22222", "22PP2", "22PP2", "22PP2"});
}

TEST(WgradPlanLlama, Bf16WeightInt8States) {
  expect_llama(FORGE_WEIGHT_BF16, FORGE_STATE_INT8_BLOCK64,
               {"22222", "22222", "222PP", "222PP", "222PP"});
}

TEST(WgradPlanLlama, StochasticWeightInt8States) {
  expect_llama(FORGE_WEIGHT_BF16_STOCHASTIC, FORGE_STATE_INT8_BLOCK64,
               {"22222", "22222", "2222P", "2222P", "2222P"});
}

TEST(WgradPlanLlama, NoSpecializedPersistentKernelKeepsTheTwoCtaKernel) {
  // fp32 states (AdamW, bf16 weight): a specialized two-CTA kernel, no persistent one.
  WgradFacts f = h200(14336, 4096, 2048, FORGE_WEIGHT_BF16, FORGE_STATE_FP32);
  f.persistent_spec_kernel = false;
  const WgradPlan p = plan(f);
  EXPECT_EQ(p.path, WgradPath::kSm90TwoCta);
  EXPECT_EQ(p.stagger_ns, 4000);
  EXPECT_TRUE(p.prefetch);
}

TEST(WgradPlanLlama, GraphStepsUseThePersistentKernelOnlyWhenSpecialized) {
  WgradFacts f = h200(14336, 4096, 2048);
  f.run_scalars = true;
  EXPECT_EQ(plan(f).path, WgradPath::kSm90Persistent);
  f.persistent_spec_kernel = false;
  EXPECT_EQ(plan(f).path, WgradPath::kSm90TwoCta);
  // Forced: still not (a graph's step has only the specialized persistent kernels).
  DebugSwitches d;
  d.persistent = PersistentOverride::kAlways;
  EXPECT_EQ(plan(f, d).path, WgradPath::kSm90TwoCta);
}

TEST(WgradPlanLlama, Fp16InputsTakeTheTwoCtaKernel) {
  for (int64_t tokens : kLlamaTokens) {
    WgradFacts f = h200(14336, 4096, tokens);
    f.x_dtype = f.dy_dtype = FORGE_DTYPE_FP16;
    const WgradPlan p = plan(f);
    EXPECT_EQ(p.path, WgradPath::kSm90TwoCta) << tokens;
    EXPECT_EQ(p.stagger_ns, 4000) << tokens;
  }
}

// ---- split-K: layers of fewer tiles than SMs ----

TEST(WgradPlanSplitK, FewTilesSplitTheTokens) {
  // 64 tiles: 2 splits of 32 k-tiles (64 tokens each).
  WgradPlan p = plan(h200(1024, 1024, 4096));
  EXPECT_EQ(p.path, WgradPath::kSm90TwoCta);
  EXPECT_EQ(p.tiles, 64);
  EXPECT_EQ(p.splits, 2);
  EXPECT_EQ(p.ktiles_per_split, 32);
  EXPECT_FALSE(p.prefetch);
  EXPECT_EQ(p.stagger_ns, 0);
  EXPECT_EQ(p.group_m, 2);
  // 4 tiles: 132 / 4 = 33 splits allowed by the SMs, 16 by the 256-token minimum.
  p = plan(h200(256, 256, 4096));
  EXPECT_EQ(p.tiles, 4);
  EXPECT_EQ(p.splits, 16);
  EXPECT_EQ(p.ktiles_per_split, 4);
}

TEST(WgradPlanSplitK, Sm80CountsItsOwnKtiles) {
  WgradFacts f = h200(256, 256, 4096);
  f.wgmma = false;
  const WgradPlan p = plan(f);
  EXPECT_EQ(p.path, WgradPath::kSm80Mma);
  EXPECT_EQ(p.splits, 16);
  EXPECT_EQ(p.ktiles_per_split, 8);  // 32-token k-tiles
  EXPECT_FALSE(p.prefetch);
}

TEST(WgradPlanSplitK, AtLeast256TokensPerSplit) {
  WgradPlan p = plan(h200(256, 256, 300));  // 5 k-tiles: fewer than 2 splits' worth
  EXPECT_EQ(p.splits, 1);
  EXPECT_EQ(p.ktiles_per_split, 5);
  EXPECT_TRUE(p.prefetch);
  p = plan(h200(256, 256, 512));  // 8 k-tiles: 2 splits of 4
  EXPECT_EQ(p.splits, 2);
  EXPECT_EQ(p.ktiles_per_split, 4);
}

TEST(WgradPlanSplitK, NoEmptySplitAndAtMost64) {
  // 8 tiles, 70 k-tiles: 16 splits asked, 5 k-tiles each, so 14 splits are enough.
  WgradPlan p = plan(h200(1024, 128, 70 * 64));
  EXPECT_EQ(p.tiles, 8);
  EXPECT_EQ(p.splits, 14);
  EXPECT_EQ(p.ktiles_per_split, 5);
  // One tile, 1563 k-tiles: 132 splits asked, capped at 64, 25 k-tiles each: 63 splits.
  p = plan(h200(128, 128, 100000));
  EXPECT_EQ(p.tiles, 1);
  EXPECT_EQ(p.splits, 63);
  EXPECT_EQ(p.ktiles_per_split, 25);
}

TEST(WgradPlanSplitK, NeverPersistent) {
  DebugSwitches d;
  d.persistent = PersistentOverride::kAlways;
  const WgradPlan p = plan(h200(1024, 1024, 4096), d);
  EXPECT_EQ(p.path, WgradPath::kSm90TwoCta);
  EXPECT_EQ(p.splits, 2);
}

// ---- inputs the Hopper kernels do not take ----

TEST(WgradPlanFallback, UnalignedOrStridedInputsRunTheSm80Kernel) {
  WgradFacts f = h200(4096, 4096, 2048);
  f.x_aligned16 = false;
  EXPECT_EQ(plan(f).path, WgradPath::kSm80Mma);
  EXPECT_EQ(plan(f).ktiles_per_split, 64);  // 32-token k-tiles
  EXPECT_EQ(plan(f).stagger_ns, 0);
  EXPECT_EQ(plan(f).stagger_count, 0);
  f = h200(4096, 4096, 2048);
  f.dy_aligned16 = false;
  EXPECT_EQ(plan(f).path, WgradPath::kSm80Mma);
  f = h200(4096, 4096, 2048);
  f.ldx = 4100;  // not a multiple of 8 elements (16 B)
  EXPECT_EQ(plan(f).path, WgradPath::kSm80Mma);
  f.ldx = 4104;
  EXPECT_EQ(plan(f).path, WgradPath::kSm90TwoCta);
  f.lddy = 4097;
  EXPECT_EQ(plan(f).path, WgradPath::kSm80Mma);
}

TEST(WgradPlanFallback, Fp32AndMixedInputsRunTheSimtKernel) {
  WgradFacts f = h200(4096, 4096, 2048);
  f.x_dtype = f.dy_dtype = FORGE_DTYPE_FP32;
  WgradPlan p = plan(f);
  EXPECT_EQ(p.path, WgradPath::kSimt);
  EXPECT_EQ(p.ktiles_per_split, 64);
  EXPECT_TRUE(p.prefetch);
  EXPECT_EQ(p.group_m, 2);
  f.x_dtype = FORGE_DTYPE_BF16;
  f.dy_dtype = FORGE_DTYPE_FP16;
  EXPECT_EQ(plan(f).path, WgradPath::kSimt);
  f.x_dtype = FORGE_DTYPE_FP16;
  EXPECT_EQ(plan(f).path, WgradPath::kSm90TwoCta);
}

TEST(WgradPlanFallback, WithoutTheSm90aKernelsTheSm80Kernel) {
  // An A100: 108 SMs, no wgmma.
  WgradFacts f = h200(1024, 4096, 4096);
  f.num_sms = 108;
  f.wgmma = false;
  const WgradPlan p = plan(f);
  EXPECT_EQ(p.path, WgradPath::kSm80Mma);
  EXPECT_EQ(p.splits, 1);
  EXPECT_EQ(p.ktiles_per_split, 128);
  EXPECT_EQ(p.group_m, 2);
  EXPECT_TRUE(p.prefetch);
  // (and fp16 inputs the same kernel, fp32 the SIMT one)
  f.x_dtype = f.dy_dtype = FORGE_DTYPE_FP16;
  EXPECT_EQ(plan(f).path, WgradPath::kSm80Mma);
  f.x_dtype = f.dy_dtype = FORGE_DTYPE_FP32;
  EXPECT_EQ(plan(f).path, WgradPath::kSimt);
}

TEST(WgradPlanFallback, BeyondTmaCoordinatesTheSm80Kernel) {
  const int64_t max = forge::cuda::kTmaCoordMax;
  WgradFacts f = h200(max, 128, 64);
  f.lddy = (max + 7) / 8 * 8;
  EXPECT_EQ(plan(f).path, WgradPath::kSm90TwoCta);
  f.rows = max + 1;
  EXPECT_EQ(plan(f).path, WgradPath::kSm80Mma);
  f = h200(128, 128, max + 1);
  EXPECT_EQ(plan(f).path, WgradPath::kSm80Mma);
}

// ---- odd shapes ----

TEST(WgradPlanOddShapes, TightRowsOfOddLengthRunTheSm80Kernel) {
  // rows = cols = T = n, ld = n: ld % 8 != 0, so never TMA.
  struct Case {
    int64_t n, tiles, ktiles;
    int group_m;
  };
  for (const Case c : {Case{1, 1, 1, 2}, Case{17, 1, 1, 2}, Case{129, 4, 5, 2},
                       Case{4097, 33 * 33, 129, 8}}) {
    SCOPED_TRACE(c.n);
    const WgradPlan p = plan(h200(c.n, c.n, c.n));
    EXPECT_EQ(p.path, WgradPath::kSm80Mma);
    EXPECT_EQ(p.tiles, c.tiles);
    EXPECT_EQ(p.splits, 1);
    EXPECT_EQ(p.ktiles_per_split, c.ktiles);
    EXPECT_EQ(p.group_m, c.group_m);
    EXPECT_TRUE(p.prefetch);
  }
}

TEST(WgradPlanOddShapes, PaddedRowsRunTheHopperKernel) {
  // The same shapes with ld rounded up to a multiple of 8.
  struct Case {
    int64_t n, tiles, ktiles;
    int group_m, stagger_ns;
  };
  for (const Case c : {Case{1, 1, 1, 2, 0}, Case{17, 1, 1, 2, 0}, Case{129, 4, 3, 2, 0},
                       Case{4097, 33 * 33, 65, 8, 4000}}) {
    SCOPED_TRACE(c.n);
    WgradFacts f = h200(c.n, c.n, c.n);
    f.ldx = f.lddy = (c.n + 7) / 8 * 8;
    const WgradPlan p = plan(f);
    EXPECT_EQ(p.path, WgradPath::kSm90TwoCta);
    EXPECT_EQ(p.tiles, c.tiles);
    EXPECT_EQ(p.splits, 1);
    EXPECT_EQ(p.ktiles_per_split, c.ktiles);
    EXPECT_EQ(p.group_m, c.group_m);
    EXPECT_EQ(p.stagger_ns, c.stagger_ns);
  }
}

TEST(WgradPlanOddShapes, GroupHeightAndStaggerThresholds) {
  // 33 × 32 = 1056 tiles = 4 waves of 2 × 132 CTAs exactly: still the few-waves group height.
  WgradFacts f = h200(4096, 4097, 4096);
  f.ldx = 4104;
  WgradPlan p = plan(f);
  EXPECT_EQ(p.tiles, 1056);
  EXPECT_EQ(p.group_m, 2);
  EXPECT_EQ(p.stagger_ns, 4000);
  // 1057 tiles and more: kGroupM.
  EXPECT_EQ(forge::cuda::group_height(1057, kSms), 8);
  // The stagger from 3 waves (792 tiles) on: 6 × 132 = 792.
  p = plan(h200(128 * 6, 128 * 132, 512));
  EXPECT_EQ(p.tiles, 792);
  EXPECT_EQ(p.stagger_ns, 4000);
  p = plan(h200(128 * 1, 128 * 791, 512));
  EXPECT_EQ(p.tiles, 791);
  EXPECT_EQ(p.stagger_ns, 0);
}

// ---- debug overrides ----

TEST(WgradPlanDebug, WgmmaOffKeepsTheSm80Kernel) {
  DebugSwitches d;
  d.wgmma = false;
  const WgradPlan p = plan(h200(14336, 4096, 2048), d);
  EXPECT_EQ(p.path, WgradPath::kSm80Mma);
  EXPECT_EQ(p.ktiles_per_split, 64);
}

TEST(WgradPlanDebug, PersistentForcedOrNever) {
  DebugSwitches d;
  d.persistent = PersistentOverride::kAlways;
  WgradPlan p = plan(h200(1024, 4096, 512), d);  // k_proj: 256 tiles
  EXPECT_EQ(p.path, WgradPath::kSm90Persistent);
  EXPECT_TRUE(p.persistent_spec);
  EXPECT_EQ(p.persistent_ctas, kSms);
  d.persistent_ctas = 3;
  EXPECT_EQ(plan(h200(1024, 4096, 512), d).persistent_ctas, 3);
  // Fewer tiles than SMs (and too few tokens to split): one CTA per tile.
  d.persistent_ctas = 0;
  p = plan(h200(256, 512, 64), d);
  EXPECT_EQ(p.tiles, 8);
  EXPECT_EQ(p.persistent_ctas, 8);
  // Forced without a specialized kernel: the generic one; fp16 inputs too.
  WgradFacts f = h200(1024, 4096, 512, FORGE_WEIGHT_FP32, FORGE_STATE_FP32);
  f.persistent_spec_kernel = false;
  p = plan(f, d);
  EXPECT_EQ(p.path, WgradPath::kSm90Persistent);
  EXPECT_FALSE(p.persistent_spec);
  f = h200(1024, 4096, 512);
  f.x_dtype = f.dy_dtype = FORGE_DTYPE_FP16;
  p = plan(f, d);
  EXPECT_EQ(p.path, WgradPath::kSm90Persistent);
  EXPECT_FALSE(p.persistent_spec);
  d.persistent = PersistentOverride::kNever;
  EXPECT_EQ(plan(h200(14336, 4096, 2048), d).path, WgradPath::kSm90TwoCta);
}

TEST(WgradPlanDebug, GroupStaggerAndPrefetchKnobs) {
  DebugSwitches d;
  d.group_m = 1;
  d.stagger_ns = 0;
  d.prefetch_lead = 512;
  WgradPlan p = plan(h200(4096, 4096, 512), d);
  EXPECT_EQ(p.group_m, 1);
  EXPECT_EQ(p.stagger_ns, 0);
  EXPECT_EQ(p.prefetch_lead, 512);
  EXPECT_TRUE(p.prefetch);
  d.stagger_ns = 1000;
  d.epilogue_prefetch = PrefetchOverride::kOff;
  p = plan(h200(4096, 4096, 512), d);
  EXPECT_EQ(p.stagger_ns, 1000);
  EXPECT_FALSE(p.prefetch);
}

TEST(WgradPlanDebug, PrefetchOffOnTheH100UnlessForcedOn) {
  WgradFacts f = h200(4096, 4096, 512);
  f.dram_gbps = kH100Gbps;
  EXPECT_FALSE(plan(f).prefetch);
  DebugSwitches d;
  d.epilogue_prefetch = PrefetchOverride::kOn;
  EXPECT_TRUE(plan(f, d).prefetch);
  // still never beside a stochastically rounded weight
  f.weight_format = FORGE_WEIGHT_BF16_STOCHASTIC;
  f.state_format = FORGE_STATE_BF16_STOCHASTIC;
  EXPECT_FALSE(plan(f, d).prefetch);
  // a card that reports no bandwidth takes the H200's rule
  f = h200(4096, 4096, 512);
  f.dram_gbps = 0;
  EXPECT_TRUE(plan(f).prefetch);
}

TEST(ElementwiseBlocks, OneCtaPerEightWarpsUpTo16PerSm) {
  using forge::cuda::elementwise_blocks;
  // 256 threads = 8 warps of 2 (row, 64-column block) pairs each: 16 pairs per CTA.
  EXPECT_EQ(elementwise_blocks(1, kSms, 2, 256), 1);
  EXPECT_EQ(elementwise_blocks(16, kSms, 2, 256), 1);
  EXPECT_EQ(elementwise_blocks(17, kSms, 2, 256), 2);
  EXPECT_EQ(elementwise_blocks(32, kSms, 4, 256), 1);
  // The 128256 × 4096 embedding: capped at 16 CTAs per SM.
  EXPECT_EQ(elementwise_blocks(128256LL * 64, kSms, 4, 256), 16 * kSms);
}

}  // namespace
}  // namespace forge_test
