// test_run_scalars.cpp — forge_hparams.run_scalars and forge_run_scalars_fill on the CPU
// backend: a step whose scalars come from a filled buffer gives the bits of the eager step
// those scalars were filled for, whatever step, lr and seed the call itself carries (what a
// CUDA graph's replay relies on; the GPU suite checks the same on the device and under
// capture). Bad buffers get an error naming them, and nothing is written: misaligned ones,
// and any whose tag says they are not what forge_run_scalars_fill wrote for this call.
#include <gtest/gtest.h>

#include <cstddef>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "core/rules.h"
#include "core/run_scalars.h"
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
  forge_rule_info info;
  ASSERT_EQ(forge_rule_query(hp.rule, &info), FORGE_OK);
  bool reads_lr = false;
  for (int i = 0; i < info.num_fields; ++i) reads_lr |= std::string(info.fields[i]) == "lr";
  EXPECT_EQ(reads_lr, hp.rule != FORGE_RULE_MUON);
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
      // The call's own scalars would have given other bits: the buffer is what was used. (A
      // rule that reads no lr, Muon, takes nothing from step and lr but the seed's draws:
      // there only a stochastic format tells the two apart.)
      if (reads_lr || wf == FORGE_WEIGHT_BF16_STOCHASTIC || sf == FORGE_STATE_BF16_STOCHASTIC)
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

namespace forge_test {
namespace {

// A run_scalars buffer carries what it was filled for; a step refuses (naming
// hparams.run_scalars, writing nothing) any buffer that is not what forge_run_scalars_fill
// wrote for this call's rule and hyper-parameters (step, lr and seed aside).
struct TagCase {
  std::string name;
  std::function<void(forge_hparams& fill, forge_hparams& call, unsigned char* buffer)> setup;
  std::string message_part;
};

TEST(RunScalarsTag, MismatchedBuffersAreRefusedAndNothingWritten) {
  const std::vector<TagCase> cases = {
      {"unfilled_zeros", [](forge_hparams&, forge_hparams&, unsigned char* b) {
         std::memset(b, 0, FORGE_RUN_SCALARS_BYTES); }, "not filled"},
      {"another_rule", [](forge_hparams& fill, forge_hparams&, unsigned char*) {
         forge_hparams_default(FORGE_RULE_SGD, &fill); }, "rule SGD"},
      {"rmsprop_centered_for_plain", [](forge_hparams& fill, forge_hparams& call, unsigned char*) {
         forge_hparams_default(FORGE_RULE_RMSPROP, &fill);
         call = fill;
         fill.centered = 1;
         fill.momentum = 0.9; }, "state"},
      {"other_beta2", [](forge_hparams& fill, forge_hparams&, unsigned char*) { fill.beta2 = 0.95; },
       "differ from this call's"},
      {"other_weight_decay", [](forge_hparams& fill, forge_hparams&, unsigned char*) {
         fill.weight_decay = 0.5; }, "differ from this call's"},
      {"other_grad_scale", [](forge_hparams& fill, forge_hparams&, unsigned char*) {
         fill.grad_scale = 0.5; }, "differ from this call's"},
      {"maximize", [](forge_hparams& fill, forge_hparams&, unsigned char*) { fill.maximize = 1; },
       "differ from this call's"},
      {"one_scalar_changed", [](forge_hparams&, forge_hparams&, unsigned char* b) {
         b[offsetof(forge::RuleScalars, neg_step_size)] ^= 1; }, "checksum"},
      {"tail_not_copied", [](forge_hparams&, forge_hparams&, unsigned char* b) {
         std::memset(b + 128, 0, FORGE_RUN_SCALARS_BYTES - 128); }, "not filled"},
  };
  Rng rng(fresh_seed());
  for (const TagCase& c : cases) {
    SCOPED_TRACE(c.name);
    forge_hparams fill = all_rule_cases()[3].hp;  // AdamW
    fill.step = 5;
    forge_hparams call = fill;
    RunBuffer run;
    std::memset(run.bytes, 0x5A, sizeof(run.bytes));
    c.setup(fill, call, run.bytes);  // may change fill / call, or the buffer after the fill
    if (c.name != "unfilled_zeros") {
      ASSERT_EQ(forge_run_scalars_fill(&fill, run.bytes, sizeof(run.bytes)), FORGE_OK)
          << forge_last_error();
      c.setup(fill, call, run.bytes);
    }
    call.run_scalars = run.bytes;
    HostParam p(20, 70, FORGE_WEIGHT_FP32, FORGE_STATE_FP32, call);
    p.randomize(rng, call);
    const std::vector<uint8_t> before = p.snapshot();
    const Matrix x = random_matrix(rng, 3, 70, 70, FORGE_DTYPE_FP32);
    const Matrix dy = random_matrix(rng, 3, 20, 20, FORGE_DTYPE_FP32);
    std::vector<float> grad(20 * 70, 0.5f);
    forge_wgrad_args a = wgrad_args(p, call, x, dy);
    EXPECT_EQ(forge_wgrad_step(&a), FORGE_ERR_INVALID_ARGUMENT);
    EXPECT_NE(std::string(forge_last_error()).find("hparams.run_scalars"), std::string::npos)
        << forge_last_error();
    EXPECT_NE(std::string(forge_last_error()).find(c.message_part), std::string::npos)
        << forge_last_error();
    forge_elementwise_args e = elementwise_args(p, call, grad);
    EXPECT_EQ(forge_elementwise_step(&e), FORGE_ERR_INVALID_ARGUMENT);
    EXPECT_NE(std::string(forge_last_error()).find("hparams.run_scalars"), std::string::npos)
        << forge_last_error();
    EXPECT_EQ(p.snapshot(), before);
  }
}

// The layout the CUDA kernels rely on: the RuleScalars at offset 0, the tag in the last 32
// bytes; -0 and +0 in a field are the same hyper-parameters.
TEST(RunScalarsTag, LayoutAndSignedZeros) {
  forge_hparams hp = all_rule_cases()[3].hp;  // AdamW
  hp.weight_decay = 0.0;
  RunBuffer run;
  ASSERT_EQ(forge_run_scalars_fill(&hp, run.bytes, sizeof(run.bytes)), FORGE_OK);
  forge::RuleScalars k;
  std::memcpy(&k, run.bytes, sizeof(k));
  EXPECT_EQ(k.rule, FORGE_RULE_ADAMW);
  EXPECT_EQ(k.num_states, 2);
  forge::RunScalarsTag tag;
  std::memcpy(&tag, run.bytes + forge::kRunScalarsTagOffset, sizeof(tag));
  EXPECT_EQ(tag.magic, forge::kRunScalarsMagic);
  EXPECT_EQ(tag.checksum, forge::run_scalars_checksum(run.bytes));
  forge_hparams call = hp;
  call.weight_decay = -0.0;
  call.run_scalars = run.bytes;
  Rng rng(fresh_seed());
  HostParam p(4, 64, FORGE_WEIGHT_FP32, FORGE_STATE_FP32, call);
  p.randomize(rng, call);
  std::vector<float> grad(4 * 64, 0.5f);
  forge_elementwise_args e = elementwise_args(p, call, grad);
  EXPECT_EQ(forge_elementwise_step(&e), FORGE_OK) << forge_last_error();
}

}  // namespace
}  // namespace forge_test
