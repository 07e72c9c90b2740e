// test_run_scalars.cpp — forge_hparams.run_scalars and forge_run_scalars_fill on the CPU
// backend: a step whose scalars come from a filled buffer gives the bits of the eager step
// those scalars were filled for, whatever step, lr and seed the call itself carries (what a
// CUDA graph's replay relies on; the GPU suite checks the same on the device and under
// capture). Bad buffers get an error naming them, and nothing is written.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "test_util.h"

namespace forge_test {
namespace {

// FORGE_RUN_SCALARS_BYTES, 16-byte aligned.
struct alignas(16) RunBuffer {
  unsigned char bytes[FORGE_RUN_SCALARS_BYTES];
};

// The call's own step, lr and seed: valid, and all different from the filled ones.
forge_hparams stale(const forge_hparams& hp, const void* run) {
  forge_hparams call = hp;
  call.step = 1;
  call.lr = hp.lr * 3;
  call.seed = hp.seed + 1;
  call.run_scalars = run;
  return call;
}

class RunScalarsCpu : public ::testing::TestWithParam<int> {};

TEST_P(RunScalarsCpu, FilledScalarsGiveTheEagerStepsBits) {
  const RuleCase rc = all_rule_cases()[GetParam()];
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(rc.name + ", FORGE_TEST_SEED=" + std::to_string(seed));
  Rng rng(seed);
  forge_hparams hp = rc.hp;
  hp.step = 7;
  hp.seed = rng.gen();
  RunBuffer run;
  ASSERT_EQ(forge_run_scalars_fill(&hp, run.bytes, sizeof(run.bytes)), FORGE_OK) << forge_last_error();
  const Matrix x = random_matrix(rng, 23, 130, 131, FORGE_DTYPE_BF16);
  const Matrix dy = random_matrix(rng, 23, 70, 70, FORGE_DTYPE_BF16, 0.1f);
  std::vector<float> grad(70 * 130);
  for (float& g : grad) g = rng.normal(0.1f);
  for (int wf : {FORGE_WEIGHT_FP32, FORGE_WEIGHT_BF16_STOCHASTIC})
    for (int sf : {FORGE_STATE_FP32, FORGE_STATE_BF16_STOCHASTIC, FORGE_STATE_INT8_BLOCK64}) {
      SCOPED_TRACE(std::string(weight_format_name(wf)) + " " + state_format_name(sf));
      HostParam eager(70, 130, static_cast<forge_weight_format>(wf),
                      static_cast<forge_state_format>(sf), hp);
      eager.randomize(rng, hp);
      HostParam filled(eager), stale_only(eager);
      const forge_hparams call = stale(hp, run.bytes);
      forge_hparams call_eager = call;
      call_eager.run_scalars = nullptr;

      forge_wgrad_args a = wgrad_args(eager, hp, x, dy);
      ASSERT_EQ(forge_wgrad_step(&a), FORGE_OK) << forge_last_error();
      a = wgrad_args(filled, call, x, dy);
      ASSERT_EQ(forge_wgrad_step(&a), FORGE_OK) << forge_last_error();
      a = wgrad_args(stale_only, call_eager, x, dy);
      ASSERT_EQ(forge_wgrad_step(&a), FORGE_OK) << forge_last_error();
      EXPECT_EQ(filled.snapshot(), eager.snapshot()) << "wgrad";
      // The call's own scalars would have given other bits: the buffer is what was used.
      EXPECT_NE(stale_only.snapshot(), eager.snapshot()) << "wgrad";

      forge_elementwise_args e = elementwise_args(eager, hp, grad);
      ASSERT_EQ(forge_elementwise_step(&e), FORGE_OK) << forge_last_error();
      e = elementwise_args(filled, call, grad);
      ASSERT_EQ(forge_elementwise_step(&e), FORGE_OK) << forge_last_error();
      EXPECT_EQ(filled.snapshot(), eager.snapshot()) << "elementwise";
    }
}

INSTANTIATE_TEST_SUITE_P(AllRules, RunScalarsCpu,
                         ::testing::Range(0, static_cast<int>(all_rule_cases().size())),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return all_rule_cases()[info.param].name;
                         });

TEST(RunScalarsErrors, FillChecksItsArguments) {
  forge_hparams hp = all_rule_cases()[3].hp;  // AdamW
  RunBuffer run;
  std::memset(run.bytes, 0x5A, sizeof(run.bytes));
  EXPECT_EQ(forge_run_scalars_fill(&hp, run.bytes, FORGE_RUN_SCALARS_BYTES - 1),
            FORGE_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(forge_last_error()).find("bytes"), std::string::npos) << forge_last_error();
  EXPECT_EQ(forge_run_scalars_fill(&hp, nullptr, FORGE_RUN_SCALARS_BYTES), FORGE_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(forge_last_error()).find("out"), std::string::npos) << forge_last_error();
  EXPECT_EQ(forge_run_scalars_fill(nullptr, run.bytes, FORGE_RUN_SCALARS_BYTES),
            FORGE_ERR_INVALID_ARGUMENT);
  hp.beta2 = 1.5;
  EXPECT_EQ(forge_run_scalars_fill(&hp, run.bytes, FORGE_RUN_SCALARS_BYTES),
            FORGE_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(forge_last_error()).find("beta2"), std::string::npos) << forge_last_error();
  for (unsigned char b : run.bytes) ASSERT_EQ(b, 0x5A) << "a failed fill wrote its buffer";
}

TEST(RunScalarsErrors, MisalignedBufferIsRefusedAndNothingWritten) {
  forge_hparams hp = all_rule_cases()[3].hp;  // AdamW
  Rng rng(fresh_seed());
  RunBuffer run[2];
  ASSERT_EQ(forge_run_scalars_fill(&hp, run[0].bytes, FORGE_RUN_SCALARS_BYTES), FORGE_OK);
  const Matrix x = random_matrix(rng, 5, 40, 40, FORGE_DTYPE_FP32);
  const Matrix dy = random_matrix(rng, 5, 30, 30, FORGE_DTYPE_FP32);
  HostParam p(30, 40, FORGE_WEIGHT_FP32, FORGE_STATE_FP32, hp);
  p.randomize(rng, hp);
  const std::vector<uint8_t> before = p.snapshot();
  forge_hparams call = hp;
  call.run_scalars = run[0].bytes + 8;
  forge_wgrad_args a = wgrad_args(p, call, x, dy);
  EXPECT_EQ(forge_wgrad_step(&a), FORGE_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(forge_last_error()).find("hparams.run_scalars"), std::string::npos)
      << forge_last_error();
  std::vector<float> grad(30 * 40, 0.5f);
  forge_elementwise_args e = elementwise_args(p, call, grad);
  EXPECT_EQ(forge_elementwise_step(&e), FORGE_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(p.snapshot(), before);
}

}  // namespace
}  // namespace forge_test
