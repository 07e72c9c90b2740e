// test_gpu_elementwise.cpp — forge_elementwise_step and the state entry points
// (forge_state_init, forge_state_to_fp32, forge_state_from_fp32) on the CUDA backend
// against the CPU backend. No summation is involved, so everything is bit for bit, on
// random data, for every rule × weight format × state format and gradient dtype.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "core/formats.h"
#include "block_copy.h"
#include "gpu_test_util.h"
#include "gpu_tolerances.h"

namespace fgt {
namespace {

// A [rows, cols] gradient of the given dtype, N(0, 1) with a NaN and two infinities.
std::vector<uint8_t> make_grad(int64_t rows, int64_t cols, forge_dtype dtype, uint64_t seed) {
  Operand g = make_operand(rows, cols, dtype, cols, 0, Fill::kNormal, seed);
  g.set(0, 3, NAN);
  g.set(rows / 2, cols - 1, INFINITY);
  g.set(rows - 1, 0, -INFINITY);
  return g.bytes;
}

using ElementwiseParam = std::tuple<int, forge_weight_format, forge_state_format>;
class ElementwiseExact : public ::testing::TestWithParam<ElementwiseParam> {};

TEST_P(ElementwiseExact, MatchesCpuBitForBit) {
  FORGE_REQUIRE_GPU();
  const auto [rule_index, wf, sf] = GetParam();
  forge_hparams hp = rule_cases()[rule_index].hp;
  // 37 × 300: 5 int8 blocks per row, the last one partial (44 columns), every quad whole
  // (vector accesses). 5 × 129 and 1 × 17: cols % 4 != 0, so no vector access anywhere and
  // a partial last quad (1 element); 1 × 17 also leaves most lanes of the warp idle.
  for (const auto& [rows, cols] :
       {std::pair<int64_t, int64_t>{37, 300}, {5, 129}, {1, 17}}) {
    SCOPED_TRACE(std::to_string(rows) + " x " + std::to_string(cols));
    HostParam cpu = make_param(rows, cols, wf, sf, hp, 900 + rule_index);
    DeviceParam gpu;
    gpu.upload(cpu);
    DeviceBuffer grad(static_cast<size_t>(rows * cols) * 4), outputs(16);
    for (forge_dtype dtype : {FORGE_DTYPE_FP32, FORGE_DTYPE_BF16, FORGE_DTYPE_FP16}) {
      const std::vector<uint8_t> g = make_grad(rows, cols, dtype, 100 + dtype);
      double want_sq = 0;
      int64_t want_nf = 0;
      forge_elementwise_args a = elementwise_args(g.data(), dtype, cpu.view(), hp, cpu_device(),
                                                  &want_sq, &want_nf);
      FORGE_OK(forge_elementwise_step(&a));

      grad.upload(g.data(), g.size());
      outputs.fill(0);
      auto* sq = static_cast<double*>(outputs.data());
      auto* nf = reinterpret_cast<int64_t*>(static_cast<uint8_t*>(outputs.data()) + 8);
      a = elementwise_args(grad.data(), dtype, gpu.view(cpu), hp, gpu_device(), sq, nf);
      FORGE_OK(forge_elementwise_step(&a));
      CUDA_OK(cudaDeviceSynchronize());
      double got_sq = 0;
      int64_t got_nf = 0;
      CUDA_OK(cudaMemcpy(&got_sq, sq, 8, cudaMemcpyDeviceToHost));
      CUDA_OK(cudaMemcpy(&got_nf, nf, 8, cudaMemcpyDeviceToHost));

      ASSERT_TRUE(same_bits(cpu, gpu.download(cpu))) << "grad " << dtype_name(dtype);
      EXPECT_EQ(want_nf, 3);
      EXPECT_EQ(want_nf, got_nf);
      EXPECT_NEAR(want_sq, got_sq, kGradSqSumRel * want_sq);
      hp.step += 1;
    }
    EXPECT_TRUE(gpu.guards_intact());
    EXPECT_TRUE(grad.guards_intact());
    EXPECT_TRUE(outputs.guards_intact());
  }
}

INSTANTIATE_TEST_SUITE_P(
    AllRulesAllFormats, ElementwiseExact,
    ::testing::Combine(::testing::Range(0, static_cast<int>(rule_cases().size())),
                       ::testing::ValuesIn(kWeightFormats), ::testing::ValuesIn(kStateFormats)),
    [](const ::testing::TestParamInfo<ElementwiseParam>& info) {
      return std::string(rule_cases()[std::get<0>(info.param)].name) + "_" +
             weight_format_name(std::get<1>(info.param)) + "_" +
             state_format_name(std::get<2>(info.param));
    });

// Big enough for the grid-stride loop to wrap (more (row, block) pairs than resident warps),
// in the configurations forge.optim runs (the specialized kernels) and one the generic
// kernel runs (fp32 states on plain bf16 weights is specialized too; SGD momentum is not).
using LargeParam = std::tuple<int, forge_weight_format, forge_state_format>;
class ElementwiseLarge : public ::testing::TestWithParam<LargeParam> {};

TEST_P(ElementwiseLarge, GridStrideMatchesCpu) {
  FORGE_REQUIRE_GPU();
  const auto [rule_index, wf, sf] = GetParam();
  forge_hparams hp = rule_cases()[rule_index].hp;
  // 3001 × 4100: rows of partial int8 blocks (the row-by-row loop). 1101 × 4160: cols % 64 == 0
  // with a bf16 gradient, so the flat view (and, for bf16 W with bf16 or int8 states, the
  // pipelined loop); 71565 (row, block) pairs: more than one grid-stride round, and a last
  // round that ends inside a warp's 4 pairs.
  for (const auto& [rows, cols] : {std::pair<int64_t, int64_t>{3001, 4100}, {1101, 4160}}) {
    SCOPED_TRACE(std::to_string(rows) + " x " + std::to_string(cols));
    HostParam cpu = make_param(rows, cols, wf, sf, hp, 5);
    DeviceParam gpu;
    gpu.upload(cpu);
    const std::vector<uint8_t> g = make_grad(rows, cols, FORGE_DTYPE_BF16, 6);
    forge_elementwise_args a =
        elementwise_args(g.data(), FORGE_DTYPE_BF16, cpu.view(), hp, cpu_device(), nullptr, nullptr);
    FORGE_OK(forge_elementwise_step(&a));
    DeviceBuffer grad(g.size());
    grad.upload(g.data(), g.size());
    a = elementwise_args(grad.data(), FORGE_DTYPE_BF16, gpu.view(cpu), hp, gpu_device(), nullptr, nullptr);
    FORGE_OK(forge_elementwise_step(&a));
    CUDA_OK(cudaDeviceSynchronize());
    EXPECT_TRUE(same_bits(cpu, gpu.download(cpu)));
    EXPECT_TRUE(gpu.guards_intact());
  }
}

// rule_cases(): 3 = AdamW, 2 = SGD with Nesterov momentum (no specialized kernel).
INSTANTIATE_TEST_SUITE_P(
    Configurations, ElementwiseLarge,
    ::testing::Values(LargeParam{3, FORGE_WEIGHT_BF16, FORGE_STATE_INT8_BLOCK64},
                      LargeParam{3, FORGE_WEIGHT_BF16_STOCHASTIC, FORGE_STATE_BF16_STOCHASTIC},
                      LargeParam{3, FORGE_WEIGHT_BF16_STOCHASTIC, FORGE_STATE_INT8_BLOCK64},
                      LargeParam{3, FORGE_WEIGHT_BF16_STOCHASTIC, FORGE_STATE_FP8_BLOCK64},
                      LargeParam{3, FORGE_WEIGHT_BF16_MASTER, FORGE_STATE_FP32},
                      LargeParam{2, FORGE_WEIGHT_BF16_STOCHASTIC, FORGE_STATE_BF16_STOCHASTIC}),
    [](const ::testing::TestParamInfo<LargeParam>& info) {
      return std::string(rule_cases()[std::get<0>(info.param)].name) + "_" +
             weight_format_name(std::get<1>(info.param)) + "_" +
             state_format_name(std::get<2>(info.param));
    });

// Freshly initialized AdamW states (m = v = +0) and a gradient whose even rows are all zero
// (an embedding's unseen tokens): the specialized kernels' branch-free path takes the exact
// zeros (FastMathWithZeros) and must still match the CPU bit for bit, over three steps (the
// zero rows stay at m = v = 0; the others leave it after the first step).
TEST(ElementwiseZeros, FreshStatesAndZeroRowsMatchCpu) {
  FORGE_REQUIRE_GPU();
  const int64_t rows = 258, cols = 4096;
  for (const auto& [wf, sf] :
       {std::pair<forge_weight_format, forge_state_format>{FORGE_WEIGHT_BF16_STOCHASTIC,
                                                           FORGE_STATE_BF16_STOCHASTIC},
        {FORGE_WEIGHT_BF16_STOCHASTIC, FORGE_STATE_INT8_BLOCK64},
        {FORGE_WEIGHT_BF16_STOCHASTIC, FORGE_STATE_FP8_BLOCK64},
        {FORGE_WEIGHT_BF16_MASTER, FORGE_STATE_FP32}}) {
    SCOPED_TRACE(std::string(weight_format_name(wf)) + " " + state_format_name(sf));
    forge_hparams hp = rule_cases()[3].hp;  // AdamW
    HostParam cpu = make_param(rows, cols, wf, sf, hp, 41);
    DeviceParam gpu;
    gpu.upload(cpu);
    forge_param cp = cpu.view(), gp = gpu.view(cpu);
    FORGE_OK(forge_state_init(&cp, &hp, cpu_device()));
    FORGE_OK(forge_state_init(&gp, &hp, gpu_device()));
    Operand g = make_operand(rows, cols, FORGE_DTYPE_BF16, cols, 0, Fill::kNormal, 42);
    for (int64_t r = 0; r < rows; r += 2)
      for (int64_t c = 0; c < cols; ++c) g.set(r, c, 0.0f);
    DeviceBuffer grad(g.bytes.size());
    grad.upload(g.bytes.data(), g.bytes.size());
    for (int i = 0; i < 3; ++i, hp.step += 1) {
      forge_elementwise_args a = elementwise_args(g.bytes.data(), FORGE_DTYPE_BF16, cp, hp,
                                                  cpu_device(), nullptr, nullptr);
      FORGE_OK(forge_elementwise_step(&a));
      a = elementwise_args(grad.data(), FORGE_DTYPE_BF16, gp, hp, gpu_device(), nullptr, nullptr);
      FORGE_OK(forge_elementwise_step(&a));
      CUDA_OK(cudaDeviceSynchronize());
      ASSERT_TRUE(same_bits(cpu, gpu.download(cpu))) << "step " << i + 1;
    }
    EXPECT_TRUE(gpu.guards_intact());
  }
}

// ---- state entry points -------------------------------------------------------------------------

using StateParam = std::tuple<forge_state_format, int>;  // format, rule (0 AdamW, 1 Adagrad)
class StateOps : public ::testing::TestWithParam<StateParam> {};

TEST_P(StateOps, InitFromToMatchCpu) {
  FORGE_REQUIRE_GPU();
  const auto [sf, which] = GetParam();
  forge_hparams hp{};
  FORGE_OK(forge_hparams_default(which == 0 ? FORGE_RULE_ADAMW : FORGE_RULE_ADAGRAD, &hp));
  hp.initial_accumulator_value = 0.3;
  for (const auto& [rows, cols] : {std::pair<int64_t, int64_t>{1, 1}, {19, 130}, {64, 4096}}) {
    HostParam cpu = make_param(rows, cols, FORGE_WEIGHT_FP32, sf, hp, 17);
    DeviceParam gpu;
    gpu.upload(cpu);
    // Poison every state on the device first: init must overwrite all of it.
    for (int i = 0; i < cpu.layout.num_states; ++i) {
      gpu.state[i].fill(0xFF);
      gpu.absmax[i].fill(0xFF);
    }
    forge_param cp = cpu.view(), gp = gpu.view(cpu);
    FORGE_OK(forge_state_init(&cp, &hp, cpu_device()));
    FORGE_OK(forge_state_init(&gp, &hp, gpu_device()));
    CUDA_OK(cudaDeviceSynchronize());
    ASSERT_TRUE(same_bits(cpu, gpu.download(cpu))) << "state_init " << rows << "x" << cols;

    const int64_t n = rows * cols;
    std::mt19937_64 rng(rows * 7 + cols);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    DeviceBuffer values(static_cast<size_t>(n) * 4), out(static_cast<size_t>(n) * 4);
    for (int i = 0; i < cpu.layout.num_states; ++i) {
      std::vector<float> v(n);
      for (auto& x : v) x = cpu.layout.is_signed[i] ? normal(rng) : std::fabs(normal(rng)) * 1e-3f;
      v[0] = 0.0f;
      if (n > 2) v[n / 2] = -0.0f;  // valid for every state (a second moment's zero too)
      FORGE_OK(forge_state_from_fp32(&cp, &hp, i, v.data(), cpu_device()));
      values.upload(v.data(), 4 * n);
      FORGE_OK(forge_state_from_fp32(&gp, &hp, i, static_cast<const float*>(values.data()), gpu_device()));
      CUDA_OK(cudaDeviceSynchronize());
      ASSERT_TRUE(same_bits(cpu, gpu.download(cpu))) << "from_fp32 state " << i;

      std::vector<float> want(n), got(n);
      FORGE_OK(forge_state_to_fp32(&cp, &hp, i, want.data(), cpu_device()));
      out.fill(0xFF);  // NaN everywhere: every element must be written
      FORGE_OK(forge_state_to_fp32(&gp, &hp, i, static_cast<float*>(out.data()), gpu_device()));
      CUDA_OK(cudaDeviceSynchronize());
      out.download(got.data(), 4 * n);
      ASSERT_EQ(0, std::memcmp(want.data(), got.data(), 4 * n)) << "to_fp32 state " << i;
    }
    EXPECT_TRUE(gpu.guards_intact());
    EXPECT_TRUE(values.guards_intact());
    EXPECT_TRUE(out.guards_intact());
  }
}

INSTANTIATE_TEST_SUITE_P(Formats, StateOps,
                         ::testing::Combine(::testing::ValuesIn(kStateFormats),
                                            ::testing::Values(0, 1)),
                         [](const ::testing::TestParamInfo<StateParam>& info) {
                           return std::string(state_format_name(std::get<0>(info.param))) +
                                  (std::get<1>(info.param) == 0 ? "_AdamW" : "_Adagrad");
                         });

// ---- skipped elements ----------------------------------------------------------------------
//
// forge.h, "Skipped elements": an element whose update is not storable is skipped and counted
// like a non-finite gradient, and an int8 block holding a skipped element keeps its absmax and
// the skipped element's code while no updated element grows it. The branch-free path of the
// specialized kernels must decline such batches and the exact path skip them, bit for bit like
// the CPU. Configurations: specialized ones (the flat, pipelined loop where cols % 64 == 0) and
// generic ones.

// One element-wise step on the CPU and on the GPU from the same gradient, given in fp32 and
// passed as bf16 (nearest: what the specialized kernels' flat loop takes); returns the two skip
// counts.
std::pair<int64_t, int64_t> elementwise_both(HostParam& cpu, DeviceParam& gpu,
                                             const forge_hparams& hp, const std::vector<float>& g) {
  std::vector<uint16_t> g16(g.size());
  for (size_t i = 0; i < g.size(); ++i) g16[i] = forge::bf16_nearest(g[i]);
  int64_t want = 0, got = 0;
  forge_elementwise_args a = elementwise_args(g16.data(), FORGE_DTYPE_BF16, cpu.view(), hp,
                                              cpu_device(), nullptr, &want);
  FORGE_OK(forge_elementwise_step(&a));
  DeviceBuffer grad(g16.size() * 2), count(8);
  grad.upload(g16.data(), g16.size() * 2);
  count.fill(0);
  a = elementwise_args(grad.data(), FORGE_DTYPE_BF16, gpu.view(cpu), hp, gpu_device(), nullptr,
                       static_cast<int64_t*>(count.data()));
  FORGE_OK(forge_elementwise_step(&a));
  CUDA_OK(cudaDeviceSynchronize());
  count.download(&got, 8);
  return {want, got};
}

// A finite gradient of 1e20 (g² overflows, so AdamW's v would be infinite; before, int8 states
// took it as the block's absmax and the block's weights became NaN at the next step), and one
// that pushes an SGD weight of 3.3e38 past the largest bf16: skipped and counted.
TEST(ElementwiseStorable, UnstorableUpdatesAreSkippedLikeTheCpu) {
  FORGE_REQUIRE_GPU();
  forge_hparams adamw = rule_cases()[3].hp, sgd{};
  FORGE_OK(forge_hparams_default(FORGE_RULE_SGD, &sgd));
  sgd.lr = 1.0;
  const int64_t rows = 6, cols = 256;
  for (forge_weight_format wf : kWeightFormats)
    for (forge_state_format sf : {FORGE_STATE_INT8_BLOCK64, FORGE_STATE_BF16_STOCHASTIC}) {
      SCOPED_TRACE(std::string(weight_format_name(wf)) + " " + state_format_name(sf));
      forge_hparams hp = adamw;
      HostParam cpu = make_param(rows, cols, wf, sf, hp, 31);
      DeviceParam gpu;
      gpu.upload(cpu);
      for (int step = 0; step < 3; ++step, hp.step += 1) {
        std::vector<float> g(rows * cols);
        std::mt19937_64 rng(step);
        std::normal_distribution<float> normal(0.0f, 1.0f);
        for (float& x : g) x = normal(rng);
        if (step < 2) g[1 * cols + 7] = 1e20f;  // then an ordinary step: no NaN may follow
        const auto [want, got] = elementwise_both(cpu, gpu, hp, g);
        ASSERT_TRUE(same_bits(cpu, gpu.download(cpu))) << "step " << step;
        EXPECT_EQ(want, step < 2 ? 1 : 0);
        EXPECT_EQ(want, got);
        for (float w : decoded(cpu, "weight", hp)) ASSERT_TRUE(std::isfinite(w));
      }
      // SGD: w = 3.3e38 (bf16: its nearest) and g = -2^125, so w - lr·g is above 0x1.FEp127.
      HostParam cpu_sgd = make_param(rows, cols, wf, FORGE_STATE_FP32, sgd, 32);
      const int64_t at = 2 * cols + 5;
      if (wf == FORGE_WEIGHT_FP32) {
        const float w = 3.3e38f;
        std::memcpy(&cpu_sgd.weight[4 * at], &w, 4);
      } else {
        const uint16_t h = forge::bf16_nearest(3.3e38f);
        std::memcpy(&cpu_sgd.weight[2 * at], &h, 2);
        if (wf == FORGE_WEIGHT_BF16_MASTER) {
          const float w = forge::bf16_to_float(h);
          std::memcpy(&cpu_sgd.master[4 * at], &w, 4);
        }
      }
      DeviceParam gpu_sgd;
      gpu_sgd.upload(cpu_sgd);
      const HostParam before = cpu_sgd;
      std::vector<float> g(rows * cols, 0.25f);
      g[at] = -std::ldexp(1.0f, 125);
      const auto [want, got] = elementwise_both(cpu_sgd, gpu_sgd, sgd, g);
      ASSERT_TRUE(same_bits(cpu_sgd, gpu_sgd.download(cpu_sgd)));
      EXPECT_EQ(want, 1);
      EXPECT_EQ(got, 1);
      EXPECT_EQ(decoded(cpu_sgd, "weight", sgd)[at], decoded(before, "weight", sgd)[at]);
      EXPECT_TRUE(gpu.guards_intact());
      EXPECT_TRUE(gpu_sgd.guards_intact());
    }
}

// The block rule (int8, fp8, int4) for a block holding a skipped element, bit for bit like the
// CPU, and as the
// rule says: elements 5 and 70 of every row get a NaN gradient every step; the others a normal
// one for 3 steps, then 0 for 8 (their moments only decay: each block keeps its absmax and the
// skipped element its code), then a large one for 3 (the absmax grows: the skipped element is
// re-encoded from its decoded value).
TEST(ElementwiseBlockSkipped, KeepsTheCodeUnlessTheAbsmaxGrowsLikeTheCpu) {
  FORGE_REQUIRE_GPU();
  // 4 × 128: the specialized kernels' flat loop; 5 × 100: their row loop and a partial block.
  for (const auto& [rows, cols] : {std::pair<int64_t, int64_t>{4, 128}, {5, 100}})
    for (forge_state_format sf :
         {FORGE_STATE_INT8_BLOCK64, FORGE_STATE_FP8_BLOCK64, FORGE_STATE_INT4_BLOCK64})
      for (forge_weight_format wf : kWeightFormats) {
        SCOPED_TRACE(std::to_string(rows) + " x " + std::to_string(cols) + " " + weight_format_name(wf) +
                     " " + state_format_name(sf));
        forge_hparams hp = rule_cases()[3].hp;  // AdamW
        HostParam cpu = make_param(rows, cols, wf, sf, hp, 33);
        DeviceParam gpu;
        gpu.upload(cpu);
        std::mt19937_64 rng(34);
        std::normal_distribution<float> normal(0.0f, 1.0f);
        int stayed = 0, grew = 0;
        for (int step = 1; step <= 14; ++step, hp.step += 1) {
          std::vector<float> g(rows * cols);
          for (float& x : g) x = step <= 3 ? normal(rng) : step <= 11 ? 0.0f : 100.0f * normal(rng);
          for (int64_t r = 0; r < rows; ++r) g[r * cols + 5] = g[r * cols + 70] = NAN;
          const HostParam before = cpu;
          const auto [want, got] = elementwise_both(cpu, gpu, hp, g);
          ASSERT_TRUE(same_bits(cpu, gpu.download(cpu))) << "step " << step;
          EXPECT_EQ(want, 2 * rows);
          EXPECT_EQ(got, want);
          SCOPED_TRACE("step " + std::to_string(step));
          expect_skipped_codes(before, cpu, {5, 70}, &stayed, &grew);
        }
        EXPECT_GT(stayed, 0);
        EXPECT_GT(grew, 0);
        EXPECT_TRUE(gpu.guards_intact());
      }
}

// A skipped element whose block's absmax grows a little at most steps (its gradient NaN
// every step, the others' growing 0.5 % a step for 300 steps): the absmax grows by powers of
// two (formats.h, block_absmax_with_skipped) and the skipped element's decoded value stays
// what it was, bit for bit like the CPU at every step (before, it grew with the absmax).
TEST(ElementwiseBlockSkipped, SkippedValueKeptWhileTheAbsmaxGrowsLikeTheCpu) {
  FORGE_REQUIRE_GPU();
  for (const auto& [rows, cols] : {std::pair<int64_t, int64_t>{4, 128}, {5, 100}})
    for (forge_state_format sf : {FORGE_STATE_INT8_BLOCK64, FORGE_STATE_FP8_BLOCK64})
      for (forge_weight_format wf : {FORGE_WEIGHT_BF16, FORGE_WEIGHT_BF16_STOCHASTIC}) {
        SCOPED_TRACE(std::to_string(rows) + " x " + std::to_string(cols) + " " + weight_format_name(wf) +
                     " " + state_format_name(sf));
        forge_hparams hp = rule_cases()[3].hp;  // AdamW
        HostParam cpu = make_param(rows, cols, wf, sf, hp, 35);
        DeviceParam gpu;
        gpu.upload(cpu);
        std::mt19937_64 rng(36);
        std::normal_distribution<float> normal(0.0f, 1.0f);
        std::vector<float> base(rows * cols);
        for (float& x : base) x = (normal(rng) > 0 ? 1.0f : -1.0f) * (1.0f + 0.1f * std::fabs(normal(rng)));
        std::vector<float> kept[2];
        int grew = 0;
        for (int step = 1; step <= 303; ++step, hp.step += 1) {
          std::vector<float> g(rows * cols);
          for (size_t i = 0; i < g.size(); ++i)
            g[i] = step <= 3 ? normal(rng) : base[i] * (1.0f + 0.005f * static_cast<float>(step - 3));
          if (step > 3)
            for (int64_t r = 0; r < rows; ++r) g[r * cols + 5] = g[r * cols + 70] = NAN;
          const HostParam before = cpu;
          const auto [want, got] = elementwise_both(cpu, gpu, hp, g);
          ASSERT_TRUE(same_bits(cpu, gpu.download(cpu))) << "step " << step;
          EXPECT_EQ(got, want);
          if (step == 3) {
            kept[0] = decoded(cpu, "state0", hp);
            kept[1] = decoded(cpu, "state1", hp);
          }
          if (step <= 3) continue;
          for (int s = 0; s < 2; ++s) {
            grew += before.absmax[s] != cpu.absmax[s];
            const std::vector<float> now = decoded(cpu, "state" + std::to_string(s), hp);
            for (int64_t r = 0; r < rows; ++r)
              for (int64_t c : {5, 70}) {
                const float absmax = cpu.absmax[s][r * ((cols + 63) / 64) + c / 64];
                if (!in_block_range(sf, s == 0, kept[s][r * cols + c], absmax)) continue;
                ASSERT_EQ(forge::float_bits(now[r * cols + c]), forge::float_bits(kept[s][r * cols + c]))
                    << "step " << step << " state " << s << " row " << r << " col " << c;
              }
          }
        }
        EXPECT_GT(grew, 0);
        EXPECT_TRUE(gpu.guards_intact());
      }
}

// An absmax no step stores, set by hand: the CPU backend refuses the step (test_bad_input.cpp,
// AbsmaxNoStepStoresIsRefused); the CUDA backend, which reads no device memory at the call,
// steps on what the block's codes decode to, and a NaN or infinite absmax makes every element
// of its block skipped and counted, the block unchanged (forge.h, "Skipped elements"), int8 and
// fp8 alike (fp8's used to reset to 0). The other blocks step as the CPU steps them.
TEST(ElementwiseBlockSkipped, NonFiniteAbsmaxSkipsItsBlockOnTheGpu) {
  FORGE_REQUIRE_GPU();
  for (forge_state_format sf :
         {FORGE_STATE_INT8_BLOCK64, FORGE_STATE_FP8_BLOCK64, FORGE_STATE_INT4_BLOCK64})
    for (float bad : {NAN, INFINITY}) {
      SCOPED_TRACE(std::string(state_format_name(sf)) + (std::isnan(bad) ? " NaN" : " inf"));
      forge_hparams hp = rule_cases()[3].hp;  // AdamW
      const int64_t rows = 4, cols = 128;
      HostParam cpu = make_param(rows, cols, FORGE_WEIGHT_BF16, sf, hp, 37);
      DeviceParam gpu;
      gpu.upload(cpu);
      std::vector<float> g(rows * cols, 0.5f);
      elementwise_both(cpu, gpu, hp, g);  // (states of every size first)
      hp.step += 1;
      HostParam poisoned = gpu.download(cpu);
      poisoned.absmax[1][3] = bad;  // row 1, block 1 of the second moment
      gpu.upload(poisoned);
      HostParam reference = poisoned;  // what the CPU gives with that block left out
      reference.absmax[1][3] = poisoned.absmax[1][2];
      std::vector<uint16_t> g16(g.size());
      for (size_t i = 0; i < g.size(); ++i) g16[i] = forge::bf16_nearest(g[i]);
      int64_t want = 0, got = 0;
      forge_elementwise_args a = elementwise_args(g16.data(), FORGE_DTYPE_BF16, reference.view(), hp,
                                                  cpu_device(), nullptr, &want);
      FORGE_OK(forge_elementwise_step(&a));
      DeviceBuffer grad(g16.size() * 2), count(8);
      grad.upload(g16.data(), g16.size() * 2);
      count.fill(0);
      a = elementwise_args(grad.data(), FORGE_DTYPE_BF16, gpu.view(poisoned), hp, gpu_device(), nullptr,
                           static_cast<int64_t*>(count.data()));
      FORGE_OK(forge_elementwise_step(&a));
      CUDA_OK(cudaDeviceSynchronize());
      count.download(&got, 8);
      EXPECT_EQ(got, 64) << "every element of the poisoned block skipped, and only those";
      HostParam after = gpu.download(poisoned);
      EXPECT_EQ(std::memcmp(&after.absmax[1][3], &bad, 4), 0);
      EXPECT_EQ(after.absmax[0][3], poisoned.absmax[0][3]);  // (the first moment's block: all skipped)
      // the block's code bytes (int4: its 32 bytes of row 1)
      const int64_t row_bytes = forge_test::state_row_bytes(sf, cols);
      const int64_t first = sf == FORGE_STATE_INT4_BLOCK64 ? 32 : 64;
      for (int s = 0; s < 2; ++s)
        for (int64_t b = first; b < row_bytes; ++b)
          EXPECT_EQ(after.state[s][row_bytes + b], poisoned.state[s][row_bytes + b])
              << "state " << s << " byte " << b;
      const auto* w_after = reinterpret_cast<const uint16_t*>(after.weight.data());
      const auto* w_before = reinterpret_cast<const uint16_t*>(poisoned.weight.data());
      for (int64_t c = 64; c < 128; ++c) EXPECT_EQ(w_after[cols + c], w_before[cols + c]) << "weight col " << c;
      // every other block as the CPU stepped it (the CPU ran with that block's absmax finite)
      after.absmax[0][3] = reference.absmax[0][3];
      after.absmax[1][3] = reference.absmax[1][3];
      for (int s = 0; s < 2; ++s)
        for (int64_t b = first; b < row_bytes; ++b)
          after.state[s][row_bytes + b] = reference.state[s][row_bytes + b];
      auto* w = reinterpret_cast<uint16_t*>(after.weight.data());
      const auto* w_ref = reinterpret_cast<const uint16_t*>(reference.weight.data());
      for (int64_t c = 64; c < 128; ++c) w[cols + c] = w_ref[cols + c];
      EXPECT_TRUE(same_bits(reference, after));
      EXPECT_TRUE(gpu.guards_intact());
    }
}

// forge_state_from_fp32 refuses what no step stores (a value that is not storable, a negative
// second moment) with the CPU backend's message, naming the smallest offending index, and
// writes nothing.
TEST(StateFromFp32, RefusesWhatNoStepStoresLikeTheCpu) {
  FORGE_REQUIRE_GPU();
  forge_hparams hp{};
  FORGE_OK(forge_hparams_default(FORGE_RULE_ADAMW, &hp));
  constexpr int64_t kNone = INT64_MIN;
  struct Bad {
    int state;
    int64_t index;  // of n elements; negative: from the end
    float value;
    int64_t second;  // where a second bad value (NaN) is (kNone: nowhere); the first is named
  };
  const Bad cases[] = {{0, 7, NAN, kNone},     {1, -1, INFINITY, kNone}, {0, 0, -INFINITY, kNone},
                       {0, 9, 3.4e38f, kNone}, {1, 3, -0.5f, kNone},     {1, -2, -1e-30f, 5},
                       {0, -200, NAN, -7}};
  for (forge_state_format sf : kStateFormats)
    for (const auto& [rows, cols] : {std::pair<int64_t, int64_t>{3, 70}, {300, 1000}}) {
      SCOPED_TRACE(std::string(state_format_name(sf)) + " " + std::to_string(rows) + " x " +
                   std::to_string(cols));
      HostParam cpu = make_param(rows, cols, FORGE_WEIGHT_FP32, sf, hp, 35);
      DeviceParam gpu;
      gpu.upload(cpu);
      const int64_t n = rows * cols;
      DeviceBuffer values(static_cast<size_t>(n) * 4);
      for (const Bad& b : cases) {
        const int64_t i = b.index < 0 ? n + b.index : b.index;
        std::vector<float> in(n, 0.25f);
        in[i] = b.value;
        int64_t first = i;
        if (b.second != kNone) {
          const int64_t j = b.second < 0 ? n + b.second : b.second;
          in[j] = NAN;
          first = std::min(i, j);
        }
        forge_param cp = cpu.view(), gp = gpu.view(cpu);
        EXPECT_EQ(forge_state_from_fp32(&cp, &hp, b.state, in.data(), cpu_device()),
                  FORGE_ERR_INVALID_ARGUMENT);
        const std::string want = forge_last_error();
        values.upload(in.data(), 4 * n);
        EXPECT_EQ(forge_state_from_fp32(&gp, &hp, b.state, static_cast<const float*>(values.data()),
                                        gpu_device()),
                  FORGE_ERR_INVALID_ARGUMENT);
        const std::string got = forge_last_error();
        EXPECT_EQ(want, got);
        EXPECT_NE(got.find("in[" + std::to_string(first) + "]"), std::string::npos) << got;
        CUDA_OK(cudaDeviceSynchronize());
        ASSERT_TRUE(same_bits(cpu, gpu.download(cpu))) << "a refused call wrote";
      }
      EXPECT_TRUE(gpu.guards_intact());
      EXPECT_TRUE(values.guards_intact());
    }
}

}  // namespace
}  // namespace fgt
