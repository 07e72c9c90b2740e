// test_shards.cpp — a parameter updated in shards (forge_param's row_offset, col_offset,
// full_cols: tensor parallel's blocks of rows or of columns, FSDP's rows) gives the bits of the
// same parameter updated whole, for every rule × weight format × state format, fused and
// element-wise: stochastic rounding draws by each element's index in the full parameter, and
// int8 column shards hold whole blocks of 64. Each shard runs on its own contiguous buffers,
// with X's columns (a column shard) or dY's columns (a row shard) sliced by pointer and leading
// dimension, as a rank holds them. Bad offsets are refused by name, nothing written.
#include <algorithm>
#include <functional>
#include <string>
#include <tuple>
#include <vector>

#include "block_copy.h"
#include "test_util.h"

namespace forge_test {
namespace {

// A block [r0, r0 + rows) × [c0, c0 + cols) of a full parameter.
struct Block {
  int64_t r0, rows, c0, cols;
};


// The shard `b` of `full` in buffers of its own, with its offsets set; `to_full` copies it back.
// Block states: b.c0 % 64 == 0, so the shard's absmax blocks are the full parameter's.
struct Shard {
  Block b;
  HostParam p;
  Shard(const HostParam& full, const Block& blk, const forge_hparams& hp)
      : b(blk),
        p(blk.rows, blk.cols, static_cast<forge_weight_format>(full.p.weight_format),
          static_cast<forge_state_format>(full.p.state_format), hp) {
    transfer(const_cast<HostParam&>(full), true);
    p.p.row_offset = b.r0;
    p.p.col_offset = b.c0;
    p.p.full_cols = full.p.cols;
  }
  void to_full(HostParam& full) { transfer(full, false); }

 private:
  // from_full: full -> shard, else shard -> full.
  void transfer(HostParam& full, bool from_full) {
    const int64_t fc = full.p.cols;
    const int wb = full.p.weight_format == FORGE_WEIGHT_FP32 ? 4 : 2;
    auto move = [&](std::vector<uint8_t>& f, std::vector<uint8_t>& s, int64_t f_ld, int64_t s_ld,
                    int64_t r0, int64_t c0, int64_t rows, int64_t cols, int elem) {
      uint8_t* fp = f.data() + (r0 * f_ld + c0) * elem;
      if (from_full) copy_block(fp, f_ld, s.data(), s_ld, rows, cols, elem);
      else copy_block(s.data(), s_ld, fp, f_ld, rows, cols, elem);
    };
    move(full.weight, p.weight, fc, b.cols, b.r0, b.c0, b.rows, b.cols, wb);
    if (!full.master.empty()) move(full.master, p.master, fc, b.cols, b.r0, b.c0, b.rows, b.cols, 4);
    const int sf = full.p.state_format;
    for (int i = 0; i < full.num_states; ++i) {
      if (sf == FORGE_STATE_INT4_BLOCK64)  // (rows of packed bytes; b.c0 is even)
        move(full.state[i], p.state[i], state_row_bytes(sf, fc), state_row_bytes(sf, b.cols),
             b.r0, b.c0 / 2, b.rows, state_row_bytes(sf, b.cols), 1);
      else
        move(full.state[i], p.state[i], fc, b.cols, b.r0, b.c0, b.rows, b.cols,
             state_element_bytes(sf));
      if (block_states(sf)) {
        const int64_t full_blocks = (fc + 63) / 64, shard_blocks = (b.cols + 63) / 64;
        move(full.absmax[i], p.absmax[i], full_blocks, shard_blocks, b.r0, b.c0 / 64, b.rows,
             shard_blocks, 4);
      }
    }
  }
};

// Row shards and column shards of a [rows, cols] parameter: three of each, uneven; column
// shards of whole 64-column blocks for block states (the last one ends the row), anywhere
// otherwise (SR groups of 4 straddling shard borders).
std::vector<std::vector<Block>> shardings(int64_t rows, int64_t cols, int sf) {
  std::vector<Block> by_rows = {{0, 2, 0, cols}, {2, rows - 3, 0, cols}, {rows - 1, 1, 0, cols}};
  std::vector<Block> by_cols;
  if (block_states(sf)) {
    by_cols = {{0, rows, 0, 64}, {0, rows, 64, 128}, {0, rows, 192, cols - 192}};
  } else {
    by_cols = {{0, rows, 0, 37}, {0, rows, 37, 118}, {0, rows, 155, cols - 155}};
  }
  return {by_rows, by_cols};
}

using ShardParam = std::tuple<int, int, int>;  // rule case, weight format, state format
class ShardsVsFull : public ::testing::TestWithParam<ShardParam> {};

TEST_P(ShardsVsFull, FusedAndElementwiseGiveTheFullParametersBits) {
  const auto [rule_index, wf, sf] = GetParam();
  const RuleCase rc = all_rule_cases()[rule_index];
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("FORGE_TEST_SEED=" + std::to_string(seed));
  Rng rng(seed);
  const int64_t rows = 7, cols = 203, tokens = 11;  // cols: 3 whole int8 blocks and a partial one
  for (bool fused : {true, false}) {
    for (const std::vector<Block>& sharding : shardings(rows, cols, sf)) {
      const bool by_rows = sharding[0].cols == cols;
      SCOPED_TRACE(std::string(fused ? "fused" : "element-wise") + (by_rows ? ", row" : ", column") +
                   " shards");
      forge_hparams hp = rc.hp;
      hp.seed = rng.gen();
      HostParam full(rows, cols, static_cast<forge_weight_format>(wf),
                     static_cast<forge_state_format>(sf), hp);
      full.randomize(rng, hp);
      HostParam assembled(full);
      for (int64_t step : {1, 2}) {
        hp.step = step;
        const Matrix x = random_matrix(rng, tokens, cols, cols + 2, FORGE_DTYPE_BF16);
        const Matrix dy = random_matrix(rng, tokens, rows, rows + 1, FORGE_DTYPE_BF16, 0.1f);
        std::vector<float> grad(rows * cols);
        for (float& g : grad) g = rng.normal(0.1f);
        // (one thread: these calls are small, and the threads' start-up would dominate)
        if (fused) {
          forge_wgrad_args a = wgrad_args(full, hp, x, dy);
          a.device.num_threads = 1;
          ASSERT_EQ(forge_wgrad_step(&a), FORGE_OK) << forge_last_error();
        } else {
          forge_elementwise_args a = elementwise_args(full, hp, grad);
          a.device.num_threads = 1;
          ASSERT_EQ(forge_elementwise_step(&a), FORGE_OK) << forge_last_error();
        }
        for (const Block& b : sharding) {
          Shard shard(assembled, b, hp);
          if (fused) {
            // the rank's X columns [c0, c0 + cols) and dY columns [r0, r0 + rows)
            forge_wgrad_args a = wgrad_args(shard.p, hp, x, dy);
            a.x = x.bytes.data() + b.c0 * dtype_size(x.dtype);
            a.dy = dy.bytes.data() + b.r0 * dtype_size(dy.dtype);
            if (block_states(sf)) a.tile_cols = 64;  // a tile border in the shard
            a.device.num_threads = 1;
            ASSERT_EQ(forge_wgrad_step(&a), FORGE_OK) << forge_last_error();
          } else {
            std::vector<float> g(b.rows * b.cols);
            for (int64_t r = 0; r < b.rows; ++r)
              for (int64_t c = 0; c < b.cols; ++c) g[r * b.cols + c] = grad[(b.r0 + r) * cols + b.c0 + c];
            forge_elementwise_args a = elementwise_args(shard.p, hp, g);
            a.device.num_threads = 1;
            ASSERT_EQ(forge_elementwise_step(&a), FORGE_OK) << forge_last_error();
          }
          shard.to_full(assembled);
        }
        ASSERT_EQ(assembled.snapshot(), full.snapshot()) << "step " << step;
      }
    }
  }
}

std::string shard_param_name(const ::testing::TestParamInfo<ShardParam>& info) {
  const auto [r, w, s] = info.param;
  return all_rule_cases()[r].name + "_" + weight_format_name(w) + "_" + state_format_name(s);
}

INSTANTIATE_TEST_SUITE_P(
    AllRulesAllFormats, ShardsVsFull,
    ::testing::Combine(::testing::Range(0, static_cast<int>(all_rule_cases().size())),
                       ::testing::Range(0, FORGE_WEIGHT_FORMAT_COUNT),
                       ::testing::Range(0, FORGE_STATE_FORMAT_COUNT)),
    shard_param_name);

// The offsets are what the draws use: a column shard of a stochastically rounded weight that
// leaves them out (updated as a parameter of its own) rounds differently from the full one.
TEST(Shards, OffsetsChooseTheStochasticRoundingBits) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("FORGE_TEST_SEED=" + std::to_string(seed));
  Rng rng(seed);
  forge_hparams hp;
  ASSERT_EQ(forge_hparams_default(FORGE_RULE_SGD, &hp), FORGE_OK);
  hp.lr = 0.01;
  hp.seed = rng.gen();
  const int64_t rows = 4, cols = 96;
  HostParam full(rows, cols, FORGE_WEIGHT_BF16_STOCHASTIC, FORGE_STATE_FP32, hp);
  full.randomize(rng, hp);
  std::vector<float> grad(rows * cols);
  for (float& g : grad) g = rng.normal(1.0f);
  const Block b{1, 2, 32, 40};
  Shard with(full, b, hp), without(full, b, hp);
  without.p.p.row_offset = without.p.p.col_offset = without.p.p.full_cols = 0;
  std::vector<float> g(b.rows * b.cols);
  for (int64_t r = 0; r < b.rows; ++r)
    for (int64_t c = 0; c < b.cols; ++c) g[r * b.cols + c] = grad[(b.r0 + r) * cols + b.c0 + c];
  for (Shard* s : {&with, &without}) {
    forge_elementwise_args a = elementwise_args(s->p, hp, g);
    ASSERT_EQ(forge_elementwise_step(&a), FORGE_OK) << forge_last_error();
  }
  forge_elementwise_args a = elementwise_args(full, hp, grad);
  ASSERT_EQ(forge_elementwise_step(&a), FORGE_OK) << forge_last_error();
  HostParam assembled(full);
  with.to_full(assembled);
  EXPECT_EQ(assembled.snapshot(), full.snapshot());
  EXPECT_NE(with.p.weight, without.p.weight);
}

// Shard placements that are not valid: refused by every entry point that takes a parameter,
// naming the field, with nothing written.
TEST(Shards, BadOffsetsAreRefusedByName) {
  forge_hparams hp;
  ASSERT_EQ(forge_hparams_default(FORGE_RULE_ADAMW, &hp), FORGE_OK);
  struct Bad {
    const char* name;
    int state_format;
    int64_t row_offset, col_offset, full_cols;
    const char* part;
  };
  // The parameter is [9, 70].
  const Bad cases[] = {
      {"row_offset_negative", FORGE_STATE_FP32, -1, 0, 70, "param.row_offset"},
      {"col_offset_negative", FORGE_STATE_FP32, 0, -64, 200, "param.col_offset"},
      {"full_cols_negative", FORGE_STATE_FP32, 0, 0, -70, "param.full_cols"},
      {"row_offset_without_full_cols", FORGE_STATE_FP32, 3, 0, 0, "param.full_cols"},
      {"col_offset_without_full_cols", FORGE_STATE_FP32, 0, 64, 0, "param.full_cols"},
      {"full_cols_below_cols", FORGE_STATE_FP32, 0, 0, 69, "param.full_cols"},
      {"shard_past_full_cols", FORGE_STATE_BF16, 0, 64, 128, "param.full_cols"},
      {"indices_overflow", FORGE_STATE_FP32, int64_t(1) << 60, 0, 70, "param.row_offset"},
      {"row_offset_huge", FORGE_STATE_FP32, INT64_MAX, 0, 70, "param.row_offset"},
      {"int8_col_offset_inside_a_block", FORGE_STATE_INT8_BLOCK64, 0, 32, 200, "param.col_offset"},
      {"int8_shard_ends_inside_a_block", FORGE_STATE_INT8_BLOCK64, 0, 64, 256, "param.col_offset + param.cols"},
      {"fp8_col_offset_inside_a_block", FORGE_STATE_FP8_BLOCK64, 0, 32, 200, "param.col_offset"},
      {"fp8_shard_ends_inside_a_block", FORGE_STATE_FP8_BLOCK64, 0, 64, 256, "param.col_offset + param.cols"},
  };
  const forge_device cpu{};
  for (const Bad& c : cases) {
    SCOPED_TRACE(c.name);
    HostParam p(9, 70, FORGE_WEIGHT_BF16_STOCHASTIC, static_cast<forge_state_format>(c.state_format), hp);
    Rng rng(3);
    p.randomize(rng, hp);
    p.p.row_offset = c.row_offset;
    p.p.col_offset = c.col_offset;
    p.p.full_cols = c.full_cols;
    const Matrix x = random_matrix(rng, 5, 70, 70, FORGE_DTYPE_BF16);
    const Matrix dy = random_matrix(rng, 5, 9, 9, FORGE_DTYPE_BF16);
    std::vector<float> grad(9 * 70, 0.5f), values(9 * 70, 0.25f);
    double sq = 1.5;
    int64_t count = 7;
    const std::vector<uint8_t> before = p.snapshot();
    forge_wgrad_args w = wgrad_args(p, hp, x, dy);
    w.outputs = {&sq, &count};
    forge_elementwise_args e = elementwise_args(p, hp, grad);
    e.outputs = {&sq, &count};
    const std::vector<std::pair<const char*, std::function<forge_status()>>> calls = {
        {"forge_wgrad_step", [&] { return forge_wgrad_step(&w); }},
        {"forge_elementwise_step", [&] { return forge_elementwise_step(&e); }},
        {"forge_state_init", [&] { return forge_state_init(&p.p, &hp, cpu); }},
        {"forge_state_from_fp32", [&] { return forge_state_from_fp32(&p.p, &hp, 0, values.data(), cpu); }},
        {"forge_state_to_fp32", [&] { return forge_state_to_fp32(&p.p, &hp, 1, values.data(), cpu); }},
    };
    for (const auto& [entry, run] : calls) {
      EXPECT_EQ(run(), FORGE_ERR_INVALID_ARGUMENT) << entry;
      EXPECT_NE(std::string(forge_last_error()).find(c.part), std::string::npos)
          << entry << ": " << forge_last_error();
    }
    EXPECT_EQ(p.snapshot(), before);
    EXPECT_EQ(sq, 1.5);
    EXPECT_EQ(count, 7);
    for (float v : values) EXPECT_EQ(v, 0.25f);
  }
  // The valid placements next to them: a row shard, an int8 / fp8 column shard of whole blocks,
  // one that ends the row inside a block, and a shard of the whole parameter.
  const struct { int sf; int64_t ro, co, fc; } good[] = {
      {FORGE_STATE_INT8_BLOCK64, 5, 0, 70}, {FORGE_STATE_INT8_BLOCK64, 0, 128, 198},
      {FORGE_STATE_INT8_BLOCK64, 2, 64, 134}, {FORGE_STATE_FP8_BLOCK64, 0, 128, 198},
      {FORGE_STATE_FP8_BLOCK64, 2, 64, 134}, {FORGE_STATE_BF16, 1000, 3, 80}};
  for (const auto& g : good) {
    HostParam p(9, 70, FORGE_WEIGHT_BF16_STOCHASTIC, static_cast<forge_state_format>(g.sf), hp);
    Rng rng(4);
    p.randomize(rng, hp);
    p.p.row_offset = g.ro;
    p.p.col_offset = g.co;
    p.p.full_cols = g.fc;
    std::vector<float> grad(9 * 70, 0.5f);
    forge_elementwise_args e = elementwise_args(p, hp, grad);
    EXPECT_EQ(forge_elementwise_step(&e), FORGE_OK) << forge_last_error();
  }
}

}  // namespace
}  // namespace forge_test
