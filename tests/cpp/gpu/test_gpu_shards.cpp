// test_gpu_shards.cpp — shards (forge_param's row_offset, col_offset, full_cols) on the CUDA
// backend: a parameter updated in row shards or in column shards, each with its offsets and the
// columns of X (column shards) or dY (row shards) it owns, gives the bits of the same parameter
// updated whole, fused and element-wise; and each shard's step matches the CPU backend's with
// the same offsets. Integer-valued inputs, so every dW sum is exact in any order and the
// comparisons are bit for bit. Column shards that start on a group of 4 (vector quads, one SR
// hash per group) and shards that do not (the element-wise quads the CUDA backend falls back
// to for them).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "block_copy.h"
#include "gpu_test_util.h"

namespace fgt {
namespace {

struct Block {
  int64_t r0, rows, c0, cols;
};

// Row shards and column shards of a [rows, cols] parameter, three each, uneven. int8 / fp8 / int4:
// column shards of whole 64-column blocks (the last ends the row); `aligned`: columns start on multiples
// of 8 (vector quads, and 16-byte aligned X for TMA), else anywhere.
std::vector<std::vector<Block>> shardings(int64_t rows, int64_t cols, forge_state_format sf,
                                          bool aligned) {
  std::vector<std::vector<Block>> v;
  v.push_back({{0, 72, 0, cols}, {72, rows - 80, 0, cols}, {rows - 8, 8, 0, cols}});
  if (forge_test::block_states(sf)) {
    v.push_back({{0, rows, 0, 128}, {0, rows, 128, 192}, {0, rows, 320, cols - 320}});
  } else if (aligned) {
    v.push_back({{0, rows, 0, 136}, {0, rows, 136, 176}, {0, rows, 312, cols - 312}});
  } else {
    v.push_back({{0, rows, 0, 130}, {0, rows, 130, 181}, {0, rows, 311, cols - 311}});
  }
  return v;
}

// Columns [first, first + n) of an operand: a view into the same bytes (ld unchanged).
Operand columns(const Operand& o, int64_t first, int64_t n) {
  Operand v = o;
  v.cols = n;
  v.offset = o.offset + first;
  return v;
}

struct ShardCase {
  const char* name;
  int rule_index;  // rule_cases()
  forge_weight_format wf;
  forge_state_format sf;
  bool aligned;
};

// The specialized kernels' configurations (stochastic ones first), a nearest one, and generic
// ones; shards on groups of 4 and off them.
const ShardCase kCases[] = {
    {"AdamW_Wbf16sr_Sbf16sr", 3, FORGE_WEIGHT_BF16_STOCHASTIC, FORGE_STATE_BF16_STOCHASTIC, true},
    {"AdamW_Wbf16sr_Sbf16sr_unaligned", 3, FORGE_WEIGHT_BF16_STOCHASTIC, FORGE_STATE_BF16_STOCHASTIC, false},
    {"AdamW_Wbf16sr_Sint8", 3, FORGE_WEIGHT_BF16_STOCHASTIC, FORGE_STATE_INT8_BLOCK64, true},
    {"AdamW_Wbf16sr_Sfp8", 3, FORGE_WEIGHT_BF16_STOCHASTIC, FORGE_STATE_FP8_BLOCK64, true},
    {"AdamW_Wbf16master_Sbf16sr", 3, FORGE_WEIGHT_BF16_MASTER, FORGE_STATE_BF16_STOCHASTIC, true},
    {"AdamW_Wbf16_Sbf16", 3, FORGE_WEIGHT_BF16, FORGE_STATE_BF16, true},
    {"Lion_Wbf16sr_Sbf16sr_unaligned", 8, FORGE_WEIGHT_BF16_STOCHASTIC, FORGE_STATE_BF16_STOCHASTIC, false},
    {"SGD_Wbf16sr", 0, FORGE_WEIGHT_BF16_STOCHASTIC, FORGE_STATE_FP32, true},
    {"RMSpropCenteredMomentum_Wfp32_Sbf16sr", 12, FORGE_WEIGHT_FP32, FORGE_STATE_BF16_STOCHASTIC, true},
    {"NAdam_Wbf16sr_Sint8", 6, FORGE_WEIGHT_BF16_STOCHASTIC, FORGE_STATE_INT8_BLOCK64, true},
    {"NAdam_Wbf16sr_Sfp8", 6, FORGE_WEIGHT_BF16_STOCHASTIC, FORGE_STATE_FP8_BLOCK64, true},
    {"AdamW_Wbf16sr_Sint4", 3, FORGE_WEIGHT_BF16_STOCHASTIC, FORGE_STATE_INT4_BLOCK64, true},
    {"RMSpropCenteredMomentum_Wfp32_Sint4", 12, FORGE_WEIGHT_FP32, FORGE_STATE_INT4_BLOCK64, true},
    {"Adagrad_Wbf16sr_Sbf16sr_unaligned", 13, FORGE_WEIGHT_BF16_STOCHASTIC, FORGE_STATE_BF16_STOCHASTIC, false},
    {"MuonNesterov_Wbf16sr_Sint8", 14, FORGE_WEIGHT_BF16_STOCHASTIC, FORGE_STATE_INT8_BLOCK64, true},
    {"MuonPlain_Wfp32_Sbf16sr_unaligned", 15, FORGE_WEIGHT_FP32, FORGE_STATE_BF16_STOCHASTIC, false},
};

class WgradShards : public ::testing::TestWithParam<ShardCase> {};

// Fused: the full parameter's step on the GPU, then each shard's on the GPU (with the X or dY
// columns it owns) and on the CPU: all three the same bits, for two steps.
TEST_P(WgradShards, ShardsGiveTheFullParametersBitsAndMatchTheCpu) {
  FORGE_REQUIRE_GPU();
  const ShardCase& c = GetParam();
  ASSERT_EQ(rule_cases()[c.rule_index].name, std::string(c.name).substr(0, std::string(c.name).find('_')));
  const int64_t rows = 200, cols = 384, tokens = 64;
  for (const std::vector<Block>& sharding : shardings(rows, cols, c.sf, c.aligned)) {
    const bool by_rows = sharding[0].cols == cols;
    SCOPED_TRACE(by_rows ? "row shards" : "column shards");
    forge_hparams hp = rule_cases()[c.rule_index].hp;
    hp.seed = 0xC0FFEE;
    const HostParam start = make_param(rows, cols, c.wf, c.sf, hp, 61);
    DeviceParam full;
    full.upload(start);
    HostParam assembled = start;  // the shards' GPU results, put together
    for (int step = 0; step < 2; ++step, hp.step += 1) {
      const Operand x = make_operand(tokens, cols, FORGE_DTYPE_BF16, cols, 0, Fill::kInteger, 62 + step);
      const Operand dy = make_operand(tokens, rows, FORGE_DTYPE_BF16, rows, 0, Fill::kInteger, 64 + step);
      wgrad_gpu(x, dy, hp, start, full, nullptr);
      for (const Block& b : sharding) {
        SCOPED_TRACE("shard at " + std::to_string(b.r0) + ", " + std::to_string(b.c0));
        HostParam cpu = take_shard(assembled, b.r0, b.rows, b.c0, b.cols);
        DeviceParam gpu;
        gpu.upload(cpu);
        const Operand xs = columns(x, b.c0, b.cols), dys = columns(dy, b.r0, b.rows);
        StepOutputs want, got;
        wgrad_cpu(xs, dys, hp, cpu, &want);
        wgrad_gpu(xs, dys, hp, cpu, gpu, &got);
        const HostParam after = gpu.download(cpu);
        ASSERT_TRUE(same_bits(cpu, after)) << "GPU shard vs CPU shard, step " << step;
        EXPECT_EQ(want.nonfinite, got.nonfinite);
        EXPECT_TRUE(gpu.guards_intact());
        put_shard(assembled, after);
      }
      ASSERT_TRUE(same_bits(full.download(start), assembled)) << "shards vs full, step " << step;
    }
    EXPECT_TRUE(full.guards_intact());
  }
}

INSTANTIATE_TEST_SUITE_P(Configurations, WgradShards, ::testing::ValuesIn(kCases),
                         [](const ::testing::TestParamInfo<ShardCase>& info) {
                           return std::string(info.param.name);
                         });

class ElementwiseShards : public ::testing::TestWithParam<ShardCase> {};

// Element-wise: the same, with each shard's block of one bf16 gradient (the specialized
// kernels' flat loop runs on row shards of whole rows, the row loop on column shards).
TEST_P(ElementwiseShards, ShardsGiveTheFullParametersBitsAndMatchTheCpu) {
  FORGE_REQUIRE_GPU();
  const ShardCase& c = GetParam();
  const int64_t rows = 200, cols = 384;
  for (const std::vector<Block>& sharding : shardings(rows, cols, c.sf, c.aligned)) {
    SCOPED_TRACE(sharding[0].cols == cols ? "row shards" : "column shards");
    forge_hparams hp = rule_cases()[c.rule_index].hp;
    hp.seed = 0xBEEF;
    const HostParam start = make_param(rows, cols, c.wf, c.sf, hp, 71);
    DeviceParam full;
    full.upload(start);
    HostParam assembled = start;
    for (int step = 0; step < 2; ++step, hp.step += 1) {
      const Operand g = make_operand(rows, cols, FORGE_DTYPE_BF16, cols, 0, Fill::kNormal, 72 + step);
      DeviceBuffer grad(g.bytes.size());
      grad.upload(g.bytes.data(), g.bytes.size());
      forge_elementwise_args a = elementwise_args(grad.data(), FORGE_DTYPE_BF16, full.view(start), hp,
                                                  gpu_device(), nullptr, nullptr);
      FORGE_OK(forge_elementwise_step(&a));
      for (const Block& b : sharding) {
        SCOPED_TRACE("shard at " + std::to_string(b.r0) + ", " + std::to_string(b.c0));
        HostParam cpu = take_shard(assembled, b.r0, b.rows, b.c0, b.cols);
        DeviceParam gpu;
        gpu.upload(cpu);
        std::vector<uint16_t> gs(b.rows * b.cols);
        for (int64_t r = 0; r < b.rows; ++r)
          std::memcpy(&gs[r * b.cols], g.bytes.data() + 2 * ((b.r0 + r) * cols + b.c0), 2 * b.cols);
        DeviceBuffer shard_grad(gs.size() * 2);
        shard_grad.upload(gs.data(), gs.size() * 2);
        a = elementwise_args(gs.data(), FORGE_DTYPE_BF16, cpu.view(), hp, cpu_device(), nullptr, nullptr);
        FORGE_OK(forge_elementwise_step(&a));
        a = elementwise_args(shard_grad.data(), FORGE_DTYPE_BF16, gpu.view(cpu), hp, gpu_device(),
                             nullptr, nullptr);
        FORGE_OK(forge_elementwise_step(&a));
        CUDA_OK(cudaDeviceSynchronize());
        const HostParam after = gpu.download(cpu);
        ASSERT_TRUE(same_bits(cpu, after)) << "GPU shard vs CPU shard, step " << step;
        EXPECT_TRUE(gpu.guards_intact());
        put_shard(assembled, after);
      }
      CUDA_OK(cudaDeviceSynchronize());
      ASSERT_TRUE(same_bits(full.download(start), assembled)) << "shards vs full, step " << step;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Configurations, ElementwiseShards, ::testing::ValuesIn(kCases),
                         [](const ::testing::TestParamInfo<ShardCase>& info) {
                           return std::string(info.param.name);
                         });

}  // namespace
}  // namespace fgt
