// test_persistent_rule.cpp — the CUDA backend's default choice of the persistent Hopper kernel
// (src/cuda/persistent_rule.h), on the shapes it was measured on: Llama-3.1-8B's MLP layers
// (3584 tiles) and q_proj (1024 tiles) on a 132-SM H200. The rule is host code, so the CPU
// suite holds it to what README.md and bench/NOTES.md v20 say it does.
#include <gtest/gtest.h>

#include "cuda/persistent_rule.h"

namespace forge_test {
namespace {

using forge::cuda::persistent_pays;

constexpr int kSms = 132;
constexpr int64_t kMlpTiles = 112 * 32;  // 14336 × 4096 in 128 × 128 tiles: 27 per SM
constexpr int64_t kQprojTiles = 32 * 32;  // 4096 × 4096: 7.8 per SM

bool mlp(int64_t tokens, int weight, int state) {
  return persistent_pays(tokens, kMlpTiles, kSms, weight, state, true);
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
    return persistent_pays(2048, tiles, kSms, FORGE_WEIGHT_BF16, FORGE_STATE_BF16, true);
  };
  EXPECT_FALSE(bf16(kQprojTiles));
  EXPECT_FALSE(bf16(16 * kSms - 1));
  EXPECT_TRUE(bf16(16 * kSms));
}

TEST(PersistentRule, NeverWithoutASpecializedKernelOrOutsideItsFormats) {
  EXPECT_FALSE(
      persistent_pays(2048, kMlpTiles, kSms, FORGE_WEIGHT_BF16, FORGE_STATE_BF16, false));
  EXPECT_FALSE(mlp(2048, FORGE_WEIGHT_BF16_MASTER, FORGE_STATE_FP32));
  EXPECT_FALSE(mlp(2048, FORGE_WEIGHT_FP32, FORGE_STATE_FP32));
  EXPECT_FALSE(mlp(2048, FORGE_WEIGHT_BF16, FORGE_STATE_BF16_STOCHASTIC));
}

}  // namespace
}  // namespace forge_test
