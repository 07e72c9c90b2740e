// test_gpu_wgrad.cpp — forge_wgrad_step on the CUDA backend against the CPU backend (the
// specification), through the public C ABI: every rule × weight format × state format bit
// for bit, odd shapes, strided / unaligned / mixed-dtype inputs, several steps in a row,
// non-finite gradients, poisoned weights and states, split-K, random inputs within the bands of gpu_tolerances.h, and
// guard bands around every buffer (nothing written outside a tensor).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "core/formats.h"
#include "gpu_test_util.h"
#include "gpu_tolerances.h"

namespace fgt {
namespace {

struct Shape {
  int64_t rows, cols, tokens;
};

// A weight format and a state format.
struct FormatPair {
  forge_weight_format wf;
  forge_state_format sf;
};

std::string shape_string(const Shape& s) {
  return std::to_string(s.rows) + "x" + std::to_string(s.cols) + " T=" + std::to_string(s.tokens);
}

int num_sms() {
  int n = 0;
  CUDA_OK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, 0));
  return n;
}

// Runs `steps` fused steps on the CPU and the GPU from the same parameter, integer-valued
// contiguous (or as given) inputs, and checks bit equality after every step.
void expect_bit_exact_run(const Shape& s, forge_hparams hp, forge_weight_format wf,
                          forge_state_format sf, int steps, forge_dtype x_dtype,
                          forge_dtype dy_dtype, int64_t ldx_extra, int64_t lddy_extra,
                          int64_t x_offset, int64_t dy_offset, uint64_t seed) {
  HostParam cpu = make_param(s.rows, s.cols, wf, sf, hp, seed);
  DeviceParam gpu;
  gpu.upload(cpu);
  for (int step = 0; step < steps; ++step) {
    const Operand x = make_operand(s.tokens, s.cols, x_dtype, s.cols + ldx_extra, x_offset,
                                   Fill::kInteger, seed * 31 + 2 * step);
    const Operand dy = make_operand(s.tokens, s.rows, dy_dtype, s.rows + lddy_extra, dy_offset,
                                    Fill::kInteger, seed * 31 + 2 * step + 1);
    StepOutputs want, got;
    wgrad_cpu(x, dy, hp, cpu, &want);
    wgrad_gpu(x, dy, hp, cpu, gpu, &got);
    ASSERT_TRUE(same_bits(cpu, gpu.download(cpu))) << shape_string(s) << ", step " << hp.step;
    EXPECT_EQ(want.nonfinite, got.nonfinite) << shape_string(s);
    // Exact too: squares of multiples of 2^-6 below 2^11 sum exactly in double.
    EXPECT_EQ(want.grad_sq_sum, got.grad_sq_sum) << shape_string(s);
    hp.step += 1;
  }
  EXPECT_TRUE(gpu.guards_intact()) << shape_string(s);
}

// ---- every rule × weight format × state format, bit for bit ------------------------------

using ExactParam = std::tuple<int, forge_weight_format, forge_state_format>;
class WgradExact : public ::testing::TestWithParam<ExactParam> {};

TEST_P(WgradExact, MatchesCpuBitForBit) {
  FORGE_REQUIRE_GPU();
  const auto [rule_index, wf, sf] = GetParam();
  const RuleCase& rc = rule_cases()[rule_index];
  // One tile-straddling shape (2 × 2 tiles, a partial int8 block, T not a multiple of 32)
  // and one that goes through split-K (2 tiles, 35 k-tiles -> 4 splits).
  for (const Shape& s : {Shape{129, 200, 67}, Shape{96, 160, 1100}})
    expect_bit_exact_run(s, rc.hp, wf, sf, 3, FORGE_DTYPE_BF16, FORGE_DTYPE_BF16, 0, 0, 0, 0,
                         1000 + rule_index);
}

INSTANTIATE_TEST_SUITE_P(
    AllRulesAllFormats, WgradExact,
    ::testing::Combine(::testing::Range(0, static_cast<int>(rule_cases().size())),
                       ::testing::ValuesIn(kWeightFormats), ::testing::ValuesIn(kStateFormats)),
    [](const ::testing::TestParamInfo<ExactParam>& info) {
      return std::string(rule_cases()[std::get<0>(info.param)].name) + "_" +
             weight_format_name(std::get<1>(info.param)) + "_" +
             state_format_name(std::get<2>(info.param));
    });

// ---- odd shapes ---------------------------------------------------------------------------

using ShapeParam = std::tuple<int64_t, int64_t, int64_t>;
class WgradOddShapes : public ::testing::TestWithParam<ShapeParam> {};

TEST_P(WgradOddShapes, MatchesCpuBitForBit) {
  FORGE_REQUIRE_GPU();
  const auto [rows, cols, tokens] = GetParam();
  const Shape s{rows, cols, tokens};
  forge_hparams adamw{};
  FORGE_OK(forge_hparams_default(FORGE_RULE_ADAMW, &adamw));
  adamw.seed = 99;
  // The most intricate storage (stochastic bf16 W, int8 or fp8 states) and the plainest.
  expect_bit_exact_run(s, adamw, FORGE_WEIGHT_BF16_STOCHASTIC, FORGE_STATE_INT8_BLOCK64, 2,
                       FORGE_DTYPE_BF16, FORGE_DTYPE_BF16, 0, 0, 0, 0, 7);
  expect_bit_exact_run(s, adamw, FORGE_WEIGHT_BF16_STOCHASTIC, FORGE_STATE_FP8_BLOCK64, 2,
                       FORGE_DTYPE_BF16, FORGE_DTYPE_BF16, 0, 0, 0, 0, 9);
  expect_bit_exact_run(s, adamw, FORGE_WEIGHT_FP32, FORGE_STATE_FP32, 2, FORGE_DTYPE_BF16,
                       FORGE_DTYPE_BF16, 0, 0, 0, 0, 8);
}

INSTANTIATE_TEST_SUITE_P(
    OutInT, WgradOddShapes,
    ::testing::Combine(::testing::Values<int64_t>(1, 17, 129, 1000),
                       ::testing::Values<int64_t>(1, 17, 129, 1000),
                       ::testing::Values<int64_t>(1, 17, 4097)),
    [](const ::testing::TestParamInfo<ShapeParam>& info) {
      return "out" + std::to_string(std::get<0>(info.param)) + "_in" +
             std::to_string(std::get<1>(info.param)) + "_T" + std::to_string(std::get<2>(info.param));
    });

// ---- input layouts and dtypes -------------------------------------------------------------

struct InputCase {
  const char* name;
  forge_dtype x_dtype, dy_dtype;
  int64_t ldx_extra, lddy_extra, x_offset, dy_offset;
};

constexpr InputCase kInputCases[] = {
    {"bf16", FORGE_DTYPE_BF16, FORGE_DTYPE_BF16, 0, 0, 0, 0},
    {"fp16", FORGE_DTYPE_FP16, FORGE_DTYPE_FP16, 0, 0, 0, 0},
    {"fp32", FORGE_DTYPE_FP32, FORGE_DTYPE_FP32, 0, 0, 0, 0},
    {"bf16x_fp32dy", FORGE_DTYPE_BF16, FORGE_DTYPE_FP32, 0, 0, 0, 0},
    {"fp16x_bf16dy", FORGE_DTYPE_FP16, FORGE_DTYPE_BF16, 0, 0, 0, 0},
    {"bf16_strided_aligned", FORGE_DTYPE_BF16, FORGE_DTYPE_BF16, 8, 16, 0, 0},
    {"bf16_strided_unaligned", FORGE_DTYPE_BF16, FORGE_DTYPE_BF16, 3, 5, 0, 0},
    {"bf16_base_misaligned", FORGE_DTYPE_BF16, FORGE_DTYPE_BF16, 8, 8, 1, 4},
    {"fp16_strided_misaligned", FORGE_DTYPE_FP16, FORGE_DTYPE_FP16, 1, 7, 3, 0},
    {"fp32_strided", FORGE_DTYPE_FP32, FORGE_DTYPE_FP32, 5, 2, 1, 0},
};

class WgradInputs : public ::testing::TestWithParam<InputCase> {};

TEST_P(WgradInputs, MatchesCpuBitForBit) {
  FORGE_REQUIRE_GPU();
  const InputCase& c = GetParam();
  forge_hparams adamw{}, sgd{};
  FORGE_OK(forge_hparams_default(FORGE_RULE_ADAMW, &adamw));
  FORGE_OK(forge_hparams_default(FORGE_RULE_SGD_MOMENTUM, &sgd));
  adamw.seed = 5;
  for (const Shape& s : {Shape{130, 257, 300}, Shape{40, 72, 2000}}) {
    expect_bit_exact_run(s, adamw, FORGE_WEIGHT_BF16_MASTER, FORGE_STATE_INT8_BLOCK64, 2,
                         c.x_dtype, c.dy_dtype, c.ldx_extra, c.lddy_extra, c.x_offset,
                         c.dy_offset, 11);
    expect_bit_exact_run(s, sgd, FORGE_WEIGHT_FP32, FORGE_STATE_BF16, 2, c.x_dtype, c.dy_dtype,
                         c.ldx_extra, c.lddy_extra, c.x_offset, c.dy_offset, 12);
  }
}

INSTANTIATE_TEST_SUITE_P(Layouts, WgradInputs, ::testing::ValuesIn(kInputCases),
                         [](const ::testing::TestParamInfo<InputCase>& info) {
                           return std::string(info.param.name);
                         });

// ---- non-finite gradient elements ---------------------------------------------------------

using FormatParam = std::tuple<forge_weight_format, forge_state_format>;
class WgradNonFinite : public ::testing::TestWithParam<FormatParam> {};

TEST_P(WgradNonFinite, SkippedAndCountedLikeTheCpu) {
  FORGE_REQUIRE_GPU();
  const auto [wf, sf] = GetParam();
  forge_hparams hp{};
  FORGE_OK(forge_hparams_default(FORGE_RULE_ADAMW, &hp));
  for (const Shape& s : {Shape{129, 200, 67}, Shape{96, 160, 1100}}) {
    HostParam cpu = make_param(s.rows, s.cols, wf, sf, hp, 77);
    DeviceParam gpu;
    gpu.upload(cpu);
    for (int step = 0; step < 2; ++step) {
      Operand x = make_operand(s.tokens, s.cols, FORGE_DTYPE_BF16, s.cols, 0, Fill::kInteger, 40 + step);
      Operand dy = make_operand(s.tokens, s.rows, FORGE_DTYPE_BF16, s.rows, 0, Fill::kInteger, 50 + step);
      // Row 5 of dW NaN; column 9 ±Inf or NaN (Inf · 0); column 20 Inf - Inf = NaN.
      dy.set(3, 5, NAN);
      x.set(7, 9, INFINITY);
      x.set(10, 20, -INFINITY);
      x.set(11, 20, INFINITY);
      StepOutputs want, got;
      wgrad_cpu(x, dy, hp, cpu, &want);
      wgrad_gpu(x, dy, hp, cpu, gpu, &got);
      const HostParam after = gpu.download(cpu);
      ASSERT_TRUE(same_bits(cpu, after)) << shape_string(s);
      EXPECT_GE(want.nonfinite, s.rows + s.cols);
      EXPECT_EQ(want.nonfinite, got.nonfinite) << shape_string(s);
      EXPECT_EQ(want.grad_sq_sum, got.grad_sq_sum) << shape_string(s);
      for (float w : decoded(after, "weight", hp)) ASSERT_TRUE(std::isfinite(w));
      hp.step += 1;
    }
    EXPECT_TRUE(gpu.guards_intact());
  }
}

INSTANTIATE_TEST_SUITE_P(Formats, WgradNonFinite,
                         ::testing::Combine(::testing::ValuesIn(kWeightFormats),
                                            ::testing::ValuesIn(kStateFormats)),
                         [](const ::testing::TestParamInfo<FormatParam>& info) {
                           return std::string(weight_format_name(std::get<0>(info.param))) + "_" +
                                  state_format_name(std::get<1>(info.param));
                         });

// ---- non-finite and out-of-range weights and states -----------------------------------------
//
// The AdamW fast path takes its new m and v as finite because its divisions and square root
// decline anything else (update.cuh: adamw_direction); weights and states that arrive
// non-finite, negative or huge must send the batch down the exact path and end bit for bit
// like the CPU's. Full interior tiles (the pipelined fast loop) on bf16 / fp32 states.

// Writes `value` into element (row, col) of `buffer` ("weight" or "state0"/"state1") in the
// parameter's storage format (bf16 formats: the value's top 16 bits).
void poison(HostParam& p, const std::string& buffer, int64_t row, int64_t col, float value) {
  const int64_t i = row * p.cols + col;
  uint32_t bits;
  std::memcpy(&bits, &value, 4);
  const uint16_t half = static_cast<uint16_t>(bits >> 16);
  const bool weight = buffer == "weight";
  const bool wide = weight ? p.weight_format == FORGE_WEIGHT_FP32 : p.state_format == FORGE_STATE_FP32;
  std::vector<uint8_t>& bytes = weight ? p.weight : p.state[buffer == "state0" ? 0 : 1];
  if (wide) std::memcpy(&bytes[4 * i], &value, 4);
  else std::memcpy(&bytes[2 * i], &half, 2);
  if (weight && p.weight_format == FORGE_WEIGHT_BF16_MASTER) std::memcpy(&p.master[4 * i], &value, 4);
}

class WgradPoisonedState : public ::testing::TestWithParam<FormatParam> {};

// Poisoned elements whose update is not storable (an infinite m, a NaN or negative v, a NaN or
// infinite weight: five) are skipped and counted, on the CPU and the GPU alike: their bits stay
// (no NaN is computed into a buffer), every other element is updated. The huge but storable m, v
// and weight, and v = 0, are updated.
TEST_P(WgradPoisonedState, SkippedLikeTheCpu) {
  FORGE_REQUIRE_GPU();
  const auto [wf, sf] = GetParam();
  forge_hparams hp{};
  FORGE_OK(forge_hparams_default(FORGE_RULE_ADAMW, &hp));
  const Shape s{256, 256, 64};
  HostParam cpu = make_param(s.rows, s.cols, wf, sf, hp, 91);
  poison(cpu, "state0", 2, 3, INFINITY);   // m
  poison(cpu, "state0", 10, 15, 3e38f);    // m: above the fast division's 2^62, lr·m/√v storable
  poison(cpu, "state1", 4, 7, NAN);        // v
  poison(cpu, "state1", 6, 11, -1.0f);     // v < 0: sqrt of a negative
  poison(cpu, "state1", 12, 17, 3e38f);    // v above the fast square root's 2^123, storable
  poison(cpu, "state1", 140, 200, 0.0f);   // v = 0, m small: sqrt(0) on the exact path
  poison(cpu, "weight", 8, 13, NAN);
  poison(cpu, "weight", 9, 14, -INFINITY);
  poison(cpu, "weight", 130, 131, 3.3e38f);  // w near the top, the update keeps it storable
  DeviceParam gpu;
  gpu.upload(cpu);
  for (int step = 0; step < 2; ++step) {
    const HostParam before = cpu;
    const Operand x = make_operand(s.tokens, s.cols, FORGE_DTYPE_BF16, s.cols, 0, Fill::kInteger, 60 + step);
    const Operand dy = make_operand(s.tokens, s.rows, FORGE_DTYPE_BF16, s.rows, 0, Fill::kInteger, 70 + step);
    StepOutputs want, got;
    wgrad_cpu(x, dy, hp, cpu, &want);
    wgrad_gpu(x, dy, hp, cpu, gpu, &got);
    ASSERT_TRUE(same_bits(cpu, gpu.download(cpu))) << "step " << step;
    EXPECT_EQ(want.nonfinite, 5) << "the poisoned updates that cannot be stored are skipped";
    EXPECT_EQ(want.nonfinite, got.nonfinite);
    EXPECT_EQ(want.grad_sq_sum, got.grad_sq_sum);
    const std::vector<float> w0 = decoded(before, "weight", hp), w1 = decoded(cpu, "weight", hp);
    for (const auto& [r, c] : {std::pair<int64_t, int64_t>{2, 3}, {4, 7}, {6, 11}, {8, 13}, {9, 14}})
      EXPECT_EQ(0, std::memcmp(&w0[r * s.cols + c], &w1[r * s.cols + c], 4)) << r << ", " << c;
    EXPECT_NE(w0[10 * s.cols + 15], w1[10 * s.cols + 15]) << "the huge m's update is storable";
    hp.step += 1;
  }
  EXPECT_TRUE(gpu.guards_intact());
}

INSTANTIATE_TEST_SUITE_P(Formats, WgradPoisonedState,
                         ::testing::Combine(::testing::Values(FORGE_WEIGHT_FP32, FORGE_WEIGHT_BF16,
                                                              FORGE_WEIGHT_BF16_STOCHASTIC,
                                                              FORGE_WEIGHT_BF16_MASTER),
                                            ::testing::Values(FORGE_STATE_FP32, FORGE_STATE_BF16,
                                                              FORGE_STATE_BF16_STOCHASTIC)),
                         [](const ::testing::TestParamInfo<FormatParam>& info) {
                           return std::string(weight_format_name(std::get<0>(info.param))) + "_" +
                                  state_format_name(std::get<1>(info.param));
                         });

// ---- results that are not storable, and int8 blocks holding a skipped element -----------------
//
// forge.h, "Skipped elements". dW elements are made huge exactly: a row of dY and a column of X
// zero but at token 0, where their product is a power of two, so every sum stays exact.

// Makes dW[row][col] = a · b exactly (a, b powers of two), and the rest of that row and column
// b · x[0][·] and a · dy[0][·].
void plant(Operand& x, Operand& dy, int64_t row, int64_t col, float a, float b) {
  for (int64_t t = 0; t < x.tokens; ++t) {
    x.set(t, col, t == 0 ? a : 0.0f);
    dy.set(t, row, t == 0 ? b : 0.0f);
  }
}

// A finite gradient of 2^66 (g² overflows: AdamW's v would be infinite; before, int8 states took
// it as the block's absmax and the block's weights became NaN at the next step): skipped and
// counted, then an ordinary step.
TEST(WgradStorable, HugeFiniteGradientIsSkippedLikeTheCpu) {
  FORGE_REQUIRE_GPU();
  forge_hparams hp{};
  FORGE_OK(forge_hparams_default(FORGE_RULE_ADAMW, &hp));
  constexpr FormatPair kFormats[] = {{FORGE_WEIGHT_BF16, FORGE_STATE_INT8_BLOCK64},
                                     {FORGE_WEIGHT_BF16_STOCHASTIC, FORGE_STATE_INT8_BLOCK64},
                                     {FORGE_WEIGHT_BF16_MASTER, FORGE_STATE_INT8_BLOCK64},
                                     {FORGE_WEIGHT_FP32, FORGE_STATE_INT8_BLOCK64},
                                     {FORGE_WEIGHT_BF16_STOCHASTIC, FORGE_STATE_FP8_BLOCK64},
                                     {FORGE_WEIGHT_BF16, FORGE_STATE_BF16}};
  for (const Shape& s : {Shape{129, 200, 67}, Shape{256, 256, 64}})
    for (const FormatPair& f : kFormats) {
      SCOPED_TRACE(shape_string(s) + " " + weight_format_name(f.wf) + " " + state_format_name(f.sf));
      HostParam cpu = make_param(s.rows, s.cols, f.wf, f.sf, hp, 92);
      DeviceParam gpu;
      gpu.upload(cpu);
      forge_hparams h = hp;
      for (int step = 0; step < 3; ++step, h.step += 1) {
        Operand x = make_operand(s.tokens, s.cols, FORGE_DTYPE_BF16, s.cols, 0, Fill::kInteger, 80 + step);
        Operand dy = make_operand(s.tokens, s.rows, FORGE_DTYPE_BF16, s.rows, 0, Fill::kInteger, 90 + step);
        if (step < 2) plant(x, dy, 1, 7, std::ldexp(1.0f, 33), std::ldexp(1.0f, 33));
        StepOutputs want, got;
        wgrad_cpu(x, dy, h, cpu, &want);
        wgrad_gpu(x, dy, h, cpu, gpu, &got);
        ASSERT_TRUE(same_bits(cpu, gpu.download(cpu))) << "step " << step;
        EXPECT_EQ(want.nonfinite, step < 2 ? 1 : 0);
        EXPECT_EQ(want.nonfinite, got.nonfinite);
        EXPECT_NEAR(want.grad_sq_sum, got.grad_sq_sum, kGradSqSumRel * want.grad_sq_sum);
        for (float w : decoded(cpu, "weight", h)) ASSERT_TRUE(std::isfinite(w));
        for (int i = 0; i < cpu.layout.num_states; ++i)
          for (float v : decoded(cpu, "state" + std::to_string(i), h)) ASSERT_TRUE(std::isfinite(v));
      }
      EXPECT_TRUE(gpu.guards_intact());
    }
}

// An SGD weight of 3.3e38 (bf16: 0x1.FEp127's neighbour 0x1.F0p127) and a gradient of -2^125:
// w - lr·g is above the largest bf16, so the element is skipped on every weight format (the
// specialized kernels' branch-free path declines the batch by its sum of magnitudes).
TEST(WgradStorable, WeightPushedAboveTheLargestBf16IsSkippedLikeTheCpu) {
  FORGE_REQUIRE_GPU();
  forge_hparams hp{};
  FORGE_OK(forge_hparams_default(FORGE_RULE_SGD, &hp));
  hp.lr = 1.0;
  for (const Shape& s : {Shape{129, 200, 67}, Shape{256, 256, 64}})
    for (forge_weight_format wf : kWeightFormats) {
      SCOPED_TRACE(shape_string(s) + " " + weight_format_name(wf));
      HostParam cpu = make_param(s.rows, s.cols, wf, FORGE_STATE_FP32, hp, 93);
      poison(cpu, "weight", 3, 5, 3.3e38f);
      DeviceParam gpu;
      gpu.upload(cpu);
      const HostParam before = cpu;
      Operand x = make_operand(s.tokens, s.cols, FORGE_DTYPE_BF16, s.cols, 0, Fill::kInteger, 81);
      Operand dy = make_operand(s.tokens, s.rows, FORGE_DTYPE_BF16, s.rows, 0, Fill::kInteger, 82);
      plant(x, dy, 3, 5, std::ldexp(1.0f, 63), -std::ldexp(1.0f, 62));
      StepOutputs want, got;
      wgrad_cpu(x, dy, hp, cpu, &want);
      wgrad_gpu(x, dy, hp, cpu, gpu, &got);
      ASSERT_TRUE(same_bits(cpu, gpu.download(cpu)));
      EXPECT_EQ(want.nonfinite, 1);
      EXPECT_EQ(got.nonfinite, 1);
      EXPECT_NEAR(want.grad_sq_sum, got.grad_sq_sum, kGradSqSumRel * want.grad_sq_sum);
      EXPECT_EQ(decoded(cpu, "weight", hp)[3 * s.cols + 5], decoded(before, "weight", hp)[3 * s.cols + 5]);
      EXPECT_TRUE(gpu.guards_intact());
    }
}

// The block-state rule (int8, fp8, int4) for a block holding a skipped element, bit for bit like
// the CPU: columns 5 and
// 70 of dW are NaN every step (X's columns hold a NaN); the rest of dW is ordinary for 3 steps,
// then 0 for 8 (the moments only decay: every block keeps its absmax, the skipped elements their
// codes), then large for 3 (the absmax grows: the skipped elements are re-encoded from their
// decoded values). A layer of whole tiles (the pipelined loop) and one with edges.
TEST(WgradBlockSkipped, KeepsTheCodeUnlessTheAbsmaxGrowsLikeTheCpu) {
  FORGE_REQUIRE_GPU();
  forge_hparams hp{};
  FORGE_OK(forge_hparams_default(FORGE_RULE_ADAMW, &hp));
  for (const Shape& s : {Shape{128, 256, 64}, Shape{100, 200, 40}})
    for (forge_state_format sf :
         {FORGE_STATE_INT8_BLOCK64, FORGE_STATE_FP8_BLOCK64, FORGE_STATE_INT4_BLOCK64})
      for (forge_weight_format wf : kWeightFormats) {
        SCOPED_TRACE(shape_string(s) + " " + weight_format_name(wf) + " " + state_format_name(sf));
        HostParam cpu = make_param(s.rows, s.cols, wf, sf, hp, 94);
        DeviceParam gpu;
        gpu.upload(cpu);
        forge_hparams h = hp;
        int stayed = 0, grew = 0;
        for (int step = 1; step <= 14; ++step, h.step += 1) {
          Operand x = make_operand(s.tokens, s.cols, FORGE_DTYPE_BF16, s.cols, 0, Fill::kInteger, 100 + step);
          Operand dy = make_operand(s.tokens, s.rows, FORGE_DTYPE_BF16, s.rows, 0, Fill::kInteger, 200 + step);
          for (int64_t t = 0; t < s.tokens; ++t)
            for (int64_t c = 0; c < s.cols; ++c) {
              if (step > 3 && step <= 11) x.set(t, c, 0.0f);
              if (step > 11) x.set(t, c, 32.0f * x.get(t, c));  // exact: integers up to 16
            }
          x.set(0, 5, NAN);
          x.set(0, 70, NAN);
          const HostParam before = cpu;
          StepOutputs want, got;
          wgrad_cpu(x, dy, h, cpu, &want);
          wgrad_gpu(x, dy, h, cpu, gpu, &got);
          ASSERT_TRUE(same_bits(cpu, gpu.download(cpu))) << "step " << step;
          EXPECT_EQ(want.nonfinite, 2 * s.rows);
          EXPECT_EQ(want.nonfinite, got.nonfinite);
          SCOPED_TRACE("step " + std::to_string(step));
          expect_skipped_codes(before, cpu, {5, 70}, &stayed, &grew);
        }
        EXPECT_GT(stayed, 0);
        EXPECT_GT(grew, 0);
        EXPECT_TRUE(gpu.guards_intact());
      }
}

// The fused kernels' block rule when the absmax grows a little at most steps: columns 5 and 70
// of dW are NaN every step after the third, the rest of X grows by 1 % a step for 150 steps
// (dW with it). The absmax grows by powers of two (formats.h, block_absmax_with_skipped), the
// skipped elements' decoded values stay what they were, bit for bit like the CPU at every
// step. A layer of whole tiles (the pipelined loop, paired layout) and one with edges.
TEST(WgradBlockSkipped, SkippedValueKeptWhileTheAbsmaxGrowsLikeTheCpu) {
  FORGE_REQUIRE_GPU();
  forge_hparams hp{};
  FORGE_OK(forge_hparams_default(FORGE_RULE_ADAMW, &hp));
  for (const Shape& s : {Shape{128, 256, 64}, Shape{100, 200, 40}})
    for (forge_state_format sf : {FORGE_STATE_INT8_BLOCK64, FORGE_STATE_FP8_BLOCK64})
      for (forge_weight_format wf : {FORGE_WEIGHT_BF16, FORGE_WEIGHT_BF16_STOCHASTIC}) {
        SCOPED_TRACE(shape_string(s) + " " + weight_format_name(wf) + " " + state_format_name(sf));
        HostParam cpu = make_param(s.rows, s.cols, wf, sf, hp, 95);
        DeviceParam gpu;
        gpu.upload(cpu);
        forge_hparams h = hp;
        const Operand x0 = make_operand(s.tokens, s.cols, FORGE_DTYPE_FP32, s.cols, 0, Fill::kNormal, 300);
        const Operand dy = make_operand(s.tokens, s.rows, FORGE_DTYPE_FP32, s.rows, 0, Fill::kNormal, 301);
        std::vector<float> kept[2];
        int grew = 0;
        for (int step = 1; step <= 153; ++step, h.step += 1) {
          Operand x = x0;
          if (step > 3) {
            for (int64_t t = 0; t < s.tokens; ++t)
              for (int64_t c = 0; c < s.cols; ++c)
                x.set(t, c, x0.get(t, c) * (1.0f + 0.01f * static_cast<float>(step - 3)));
            x.set(0, 5, NAN);
            x.set(0, 70, NAN);
          }
          const HostParam before = cpu;
          StepOutputs want, got;
          wgrad_cpu(x, dy, h, cpu, &want);
          wgrad_gpu(x, dy, h, cpu, gpu, &got);
          ASSERT_TRUE(same_bits(cpu, gpu.download(cpu))) << "step " << step;
          EXPECT_EQ(want.nonfinite, got.nonfinite);
          if (step == 3) {
            kept[0] = decoded(cpu, "state0", h);
            kept[1] = decoded(cpu, "state1", h);
          }
          if (step <= 3) continue;
          EXPECT_EQ(want.nonfinite, 2 * s.rows);
          for (int st = 0; st < 2; ++st) {
            grew += before.absmax[st] != cpu.absmax[st];
            const std::vector<float> now = decoded(cpu, "state" + std::to_string(st), h);
            for (int64_t r = 0; r < s.rows; ++r)
              for (int64_t c : {5, 70}) {
                const float absmax = cpu.absmax[st][r * ((s.cols + 63) / 64) + c / 64];
                if (!in_block_range(sf, st == 0, kept[st][r * s.cols + c], absmax)) continue;
                ASSERT_EQ(forge::float_bits(now[r * s.cols + c]), forge::float_bits(kept[st][r * s.cols + c]))
                    << "step " << step << " state " << st << " row " << r << " col " << c;
              }
          }
        }
        EXPECT_GT(grew, 0);
        EXPECT_TRUE(gpu.guards_intact());
      }
}

// ---- split-K ----------------------------------------------------------------------------------

TEST(WgradSplitK, SmallLayerLongSequenceMatchesCpu) {
  FORGE_REQUIRE_GPU();
  forge_hparams hp{};
  FORGE_OK(forge_hparams_default(FORGE_RULE_ADAMW, &hp));
  // 1 tile and 256 k-tiles (32 splits); 6 tiles and 94 k-tiles (11 splits); 1 tile of a
  // 1-row layer.
  for (const Shape& s : {Shape{64, 64, 8192}, Shape{200, 300, 3000}, Shape{1, 100, 5000}}) {
    expect_bit_exact_run(s, hp, FORGE_WEIGHT_BF16, FORGE_STATE_INT8_BLOCK64, 2, FORGE_DTYPE_BF16,
                         FORGE_DTYPE_BF16, 0, 0, 0, 0, 21);
    expect_bit_exact_run(s, hp, FORGE_WEIGHT_FP32, FORGE_STATE_FP32, 2, FORGE_DTYPE_FP32,
                         FORGE_DTYPE_FP32, 0, 0, 0, 0, 22);
  }
}

TEST(WgradSplitK, DeterministicOnRandomInputs) {
  FORGE_REQUIRE_GPU();
  forge_hparams hp{};
  FORGE_OK(forge_hparams_default(FORGE_RULE_ADAMW, &hp));
  for (const Shape& s : {Shape{64, 64, 8192}, Shape{200, 300, 3000}}) {
    const HostParam start = make_param(s.rows, s.cols, FORGE_WEIGHT_FP32, FORGE_STATE_FP32, hp, 3);
    const Operand x = make_operand(s.tokens, s.cols, FORGE_DTYPE_BF16, s.cols, 0, Fill::kNormal, 1);
    const Operand dy = make_operand(s.tokens, s.rows, FORGE_DTYPE_BF16, s.rows, 0, Fill::kNormal, 2);
    DeviceParam a, b;
    a.upload(start);
    b.upload(start);
    wgrad_gpu(x, dy, hp, start, a, nullptr);
    wgrad_gpu(x, dy, hp, start, b, nullptr);
    EXPECT_TRUE(same_bits(a.download(start), b.download(start))) << shape_string(s);
  }
}

// ---- random inputs ------------------------------------------------------------------------------

// dW itself, read back through SGD with lr = 1 from W = 0 in fp32 (w_new = 0 - 1 · g, exact),
// against a float64 reference.
using DwParam = std::tuple<forge_dtype, int>;
class WgradDw : public ::testing::TestWithParam<DwParam> {};

TEST_P(WgradDw, MatchesFloat64Reference) {
  FORGE_REQUIRE_GPU();
  const auto [dtype, shape_index] = GetParam();
  const Shape shapes[] = {{256, 384, 4097}, {64, 96, 4097}, {300, 130, 33}};
  const Shape s = shapes[shape_index];
  forge_hparams hp{};
  FORGE_OK(forge_hparams_default(FORGE_RULE_SGD, &hp));
  hp.lr = 1.0;
  hp.weight_decay = 0.0;
  HostParam zero = make_param(s.rows, s.cols, FORGE_WEIGHT_FP32, FORGE_STATE_FP32, hp, 1);
  std::fill(zero.weight.begin(), zero.weight.end(), 0);
  const Operand x = make_operand(s.tokens, s.cols, dtype, s.cols, 0, Fill::kNormal, 31);
  const Operand dy = make_operand(s.tokens, s.rows, dtype, s.rows, 0, Fill::kNormal, 32);
  DeviceParam gpu;
  gpu.upload(zero);
  wgrad_gpu(x, dy, hp, zero, gpu, nullptr);
  const std::vector<float> w = decoded(gpu.download(zero), "weight", hp);
  std::vector<double> ref(s.rows * s.cols, 0.0);
  std::vector<double> xr(s.cols);
  for (int64_t t = 0; t < s.tokens; ++t) {
    for (int64_t c = 0; c < s.cols; ++c) xr[c] = x.get(t, c);
    for (int64_t r = 0; r < s.rows; ++r) {
      const double d = dy.get(t, r);
      double* row = ref.data() + r * s.cols;
      for (int64_t c = 0; c < s.cols; ++c) row[c] += d * xr[c];
    }
  }
  double err2 = 0, ref2 = 0, max_err = 0, max_ref = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double e = -static_cast<double>(w[i]) - ref[i];
    err2 += e * e;
    ref2 += ref[i] * ref[i];
    max_err = std::max(max_err, std::fabs(e));
    max_ref = std::max(max_ref, std::fabs(ref[i]));
  }
  EXPECT_LE(std::sqrt(err2 / ref2), kDwRelFrobenius) << shape_string(s);
  EXPECT_LE(max_err, kDwMaxAbsRelToMax * max_ref) << shape_string(s);
}

INSTANTIATE_TEST_SUITE_P(
    Inputs, WgradDw,
    ::testing::Combine(::testing::Values(FORGE_DTYPE_BF16, FORGE_DTYPE_FP16, FORGE_DTYPE_FP32),
                       ::testing::Values(0, 1, 2)),
    [](const ::testing::TestParamInfo<DwParam>& info) {
      return std::string(dtype_name(std::get<0>(info.param))) + "_shape" +
             std::to_string(std::get<1>(info.param));
    });

// ---- several waves of CTAs --------------------------------------------------------------------

// Layers of more than two tiles per SM: several waves of two-CTA launches, and from three full
// waves the stagger of the nearest-rounded weights (heuristics.h). One shape of ~2.9 tiles
// per SM with four k-tiles per tile (refills of the ring inside a tile), one of ~6.8 with one
// k-tile. The formats of the specialized kernels, with and without the L2 prefetch and the
// stagger. Row lengths: one with no vector access (5 mod 8), one with 4-element vectors and
// partial tiles, and one of whole tiles only, like the Llama layers (every tile on the
// pipelined update loop, its first pass loaded during the main loop). All three are layers of
// at most four waves (groups of 2 tile-rows); ManyWavesMatchesCpuBitForBit has a larger one.
TEST(WgradManyTiles, MatchesCpuBitForBit) {
  FORGE_REQUIRE_GPU();
  const int64_t sms = num_sms();
  const Shape shapes[] = {
      {16 * 128 - 3, ((27 * sms / 10 + 15) / 16) * 128 + 5, 200},
      {32 * 128 + 5, ((13 * sms / 2 + 31) / 32) * 128 - 68, 40},
      {16 * 128, ((27 * sms / 10 + 15) / 16) * 128, 64}};
  constexpr FormatPair kFormats[] = {{FORGE_WEIGHT_BF16, FORGE_STATE_BF16},
                                     {FORGE_WEIGHT_BF16_STOCHASTIC, FORGE_STATE_BF16_STOCHASTIC},
                                     {FORGE_WEIGHT_BF16_STOCHASTIC, FORGE_STATE_INT8_BLOCK64},
                                     {FORGE_WEIGHT_BF16, FORGE_STATE_INT8_BLOCK64},
                                     {FORGE_WEIGHT_BF16_STOCHASTIC, FORGE_STATE_FP8_BLOCK64},
                                     {FORGE_WEIGHT_BF16, FORGE_STATE_FP8_BLOCK64},
                                     {FORGE_WEIGHT_BF16_MASTER, FORGE_STATE_FP32}};
  forge_hparams adamw{};
  FORGE_OK(forge_hparams_default(FORGE_RULE_ADAMW, &adamw));
  adamw.seed = 5;
  uint64_t seed = 40;
  for (const Shape& s : shapes) {
    const int64_t tiles = ((s.rows + 127) / 128) * ((s.cols + 127) / 128);
    ASSERT_GT(tiles, 2 * sms) << shape_string(s);
    for (const FormatPair& f : kFormats)
      expect_bit_exact_run(s, adamw, f.wf, f.sf, 2, FORGE_DTYPE_BF16, FORGE_DTYPE_BF16, 0, 0, 0,
                           0, seed++);
  }
}

// A layer of more than four waves (37 × 31 tiles, > 8 per SM), where the host picks the large
// layers' tile order: groups of 8 tile-rows, the last one partial (kGroupM in heuristics.h).
// One step, two formats: the CPU reference of this layer is the slow part.
TEST(WgradManyTiles, ManyWavesMatchesCpuBitForBit) {
  FORGE_REQUIRE_GPU();
  const int64_t sms = num_sms();
  const Shape s{37 * 128 - 3, (8 * sms / 37 + 2) * 128 + 5, 16};
  ASSERT_GT(((s.rows + 127) / 128) * ((s.cols + 127) / 128), 8 * sms) << shape_string(s);
  forge_hparams adamw{};
  FORGE_OK(forge_hparams_default(FORGE_RULE_ADAMW, &adamw));
  adamw.seed = 6;
  expect_bit_exact_run(s, adamw, FORGE_WEIGHT_BF16, FORGE_STATE_BF16, 1, FORGE_DTYPE_BF16,
                       FORGE_DTYPE_BF16, 0, 0, 0, 0, 50);
  expect_bit_exact_run(s, adamw, FORGE_WEIGHT_BF16_STOCHASTIC, FORGE_STATE_INT8_BLOCK64, 1,
                       FORGE_DTYPE_BF16, FORGE_DTYPE_BF16, 0, 0, 0, 0, 51);
}

// fp32 inputs without split-K: the SIMT kernel adds the rounded products in token order,
// like the CPU, so the step is bit-identical even on random inputs.
TEST(WgradFp32, BitExactOnRandomInputsWithoutSplitK) {
  FORGE_REQUIRE_GPU();
  // At least as many tiles as SMs: no split-K.
  int64_t side = 128;
  while ((side / 128) * (side / 128) < num_sms()) side += 128;
  const Shape s{side + 3, side - 5, 200};
  forge_hparams hp{};
  FORGE_OK(forge_hparams_default(FORGE_RULE_ADAMW, &hp));
  HostParam cpu = make_param(s.rows, s.cols, FORGE_WEIGHT_BF16_STOCHASTIC, FORGE_STATE_INT8_BLOCK64, hp, 4);
  DeviceParam gpu;
  gpu.upload(cpu);
  for (int step = 0; step < 2; ++step) {
    const Operand x = make_operand(s.tokens, s.cols, FORGE_DTYPE_FP32, s.cols, 0, Fill::kNormal, 60 + step);
    const Operand dy = make_operand(s.tokens, s.rows, FORGE_DTYPE_FP32, s.rows, 0, Fill::kNormal, 70 + step);
    wgrad_cpu(x, dy, hp, cpu, nullptr);
    wgrad_gpu(x, dy, hp, cpu, gpu, nullptr);
    ASSERT_TRUE(same_bits(cpu, gpu.download(cpu))) << shape_string(s);
    hp.step += 1;
  }
}

// Every rule on random bf16 inputs: within the per-format bands of gpu_tolerances.h.
constexpr FormatPair kRandomFormats[] = {{FORGE_WEIGHT_BF16, FORGE_STATE_BF16},
                                         {FORGE_WEIGHT_BF16_MASTER, FORGE_STATE_FP32},
                                         {FORGE_WEIGHT_FP32, FORGE_STATE_INT8_BLOCK64},
                                         {FORGE_WEIGHT_BF16_STOCHASTIC, FORGE_STATE_BF16_STOCHASTIC}};

using RandomParam = std::tuple<int, int>;
class WgradRandom : public ::testing::TestWithParam<RandomParam> {};

TEST_P(WgradRandom, WithinTolerance) {
  FORGE_REQUIRE_GPU();
  const auto [rule_index, format_index] = GetParam();
  const RuleCase& rc = rule_cases()[rule_index];
  const FormatPair f = kRandomFormats[format_index];
  for (const Shape& s : {Shape{129, 200, 4097}, Shape{96, 160, 2000}}) {
    forge_hparams hp = rc.hp;
    HostParam cpu = make_param(s.rows, s.cols, f.wf, f.sf, hp, 500 + rule_index);
    DeviceParam gpu;
    gpu.upload(cpu);
    for (int step = 0; step < 3; ++step) {
      const Operand x = make_operand(s.tokens, s.cols, FORGE_DTYPE_BF16, s.cols, 0, Fill::kNormal, 80 + step);
      const Operand dy = make_operand(s.tokens, s.rows, FORGE_DTYPE_BF16, s.rows, 0, Fill::kNormal, 90 + step);
      StepOutputs want, got;
      wgrad_cpu(x, dy, hp, cpu, &want);
      wgrad_gpu(x, dy, hp, cpu, gpu, &got);
      const HostParam after = gpu.download(cpu);
      ASSERT_TRUE(close_enough(cpu, after, hp)) << shape_string(s) << ", step " << hp.step;
      EXPECT_NEAR(want.grad_sq_sum, got.grad_sq_sum, 10 * kDwRelFrobenius * want.grad_sq_sum);
      EXPECT_EQ(want.nonfinite, got.nonfinite);
      // Both sides continue from the CPU's state, so the bands do not compound.
      gpu.upload(cpu);
      hp.step += 1;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    RulesFormats, WgradRandom,
    ::testing::Combine(::testing::Range(0, static_cast<int>(rule_cases().size())),
                       ::testing::Range(0, 4)),
    [](const ::testing::TestParamInfo<RandomParam>& info) {
      const FormatPair f = kRandomFormats[std::get<1>(info.param)];
      return std::string(rule_cases()[std::get<0>(info.param)].name) + "_" +
             weight_format_name(f.wf) + "_" + state_format_name(f.sf);
    });

}  // namespace
}  // namespace fgt
