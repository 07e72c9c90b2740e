// test_cpu_fused.cpp — the CPU fused step is bit-identical to the unfused way
// (materialize dW summed over tokens in the same order, then apply the rule with
// forge_elementwise_step), for every rule × weight format × state format, on odd
// shapes, strided inputs, every input dtype and several steps in a row; and
// independent of tile shape and thread count. Non-finite gradients, and updates whose
// results would not be storable, are skipped and counted. Every tile accumulation path this
// CPU runs (cpu_wgrad_tile.h: AVX-512, AVX2, portable), called directly, is the naive sum bit
// for bit.
#include <algorithm>
#include <limits>
#include <tuple>

#include "core/rng.h"
#include "cpu/cpu_wgrad_tile.h"
#include "test_util.h"
#include "tolerances.h"

namespace forge_test {
namespace {

struct Shape {
  int64_t rows, cols, tokens;
};

// (rule case, weight format, state format)
class FusedVsUnfused : public ::testing::TestWithParam<std::tuple<int, int, int>> {};

TEST_P(FusedVsUnfused, BitIdenticalOverSeveralSteps) {
  const auto [rule_index, wf, sf] = GetParam();
  const RuleCase rc = all_rule_cases()[rule_index];
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("FORGE_TEST_SEED=" + std::to_string(seed));
  Rng rng(seed);
  const Shape shapes[] = {{17, 129, 33}, {1, 1000, 5}, {129, 17, 1}, {65, 200, 70}};
  const forge_dtype dtypes[] = {FORGE_DTYPE_BF16, FORGE_DTYPE_FP16, FORGE_DTYPE_FP32};
  int shape_index = 0;
  for (const Shape& s : shapes) {
    const forge_dtype dtype = dtypes[shape_index++ % 3];
    SCOPED_TRACE(::testing::Message() << "shape " << s.rows << "x" << s.cols << " T=" << s.tokens
                                      << " dtype " << dtype);
    forge_hparams hp = rc.hp;
    hp.seed = rng.gen();
    HostParam fused(s.rows, s.cols, static_cast<forge_weight_format>(wf),
                    static_cast<forge_state_format>(sf), hp);
    fused.randomize(rng, hp);
    HostParam unfused(fused);
    for (int64_t step : {1, 2, 7}) {
      hp.step = step;
      // strided: ld larger than the row, as for views of [B, S, H] activations
      const Matrix x = random_matrix(rng, s.tokens, s.cols, s.cols + 3, dtype);
      const Matrix dy = random_matrix(rng, s.tokens, s.rows, s.rows + 5, dtype, 0.1f);
      double sq_fused = 0, sq_unfused = 0;
      int64_t bad_fused = 0, bad_unfused = 0;
      forge_wgrad_args a = wgrad_args(fused, hp, x, dy);
      a.outputs = {&sq_fused, &bad_fused};
      ASSERT_EQ(forge_wgrad_step(&a), FORGE_OK) << forge_last_error();
      const std::vector<float> dw = reference_dw(x, dy);
      forge_elementwise_args e = elementwise_args(unfused, hp, dw);
      e.outputs = {&sq_unfused, &bad_unfused};
      ASSERT_EQ(forge_elementwise_step(&e), FORGE_OK) << forge_last_error();
      ASSERT_EQ(fused.snapshot(), unfused.snapshot()) << "step " << step;
      EXPECT_EQ(bad_fused, 0);
      EXPECT_NEAR(sq_fused, sq_unfused, kGradSqSumRel * sq_unfused);
    }
  }
}

std::string combo_name(const ::testing::TestParamInfo<std::tuple<int, int, int>>& info) {
  const auto [r, w, s] = info.param;
  return all_rule_cases()[r].name + "_" + weight_format_name(w) + "_" + state_format_name(s);
}

INSTANTIATE_TEST_SUITE_P(AllRulesAllFormats, FusedVsUnfused,
                         ::testing::Combine(::testing::Range(0, static_cast<int>(all_rule_cases().size())),
                                            ::testing::Range(0, FORGE_WEIGHT_FORMAT_COUNT),
                                            ::testing::Range(0, FORGE_STATE_FORMAT_COUNT)),
                         combo_name);

// Long token reductions and wide layers, on the formats that round the most.
TEST(FusedLarge, LongReductionAndWideLayer) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("FORGE_TEST_SEED=" + std::to_string(seed));
  Rng rng(seed);
  const Shape shapes[] = {{129, 65, 4097}, {1000, 1000, 3}, {1, 17, 4097}};
  for (const RuleCase& rc : all_rule_cases()) {
    if (rc.name != "AdamW" && rc.name != "Lion" && rc.name != "RMSpropCenteredMomentum") continue;
    for (const Shape& s : shapes) {
      SCOPED_TRACE(rc.name + " " + std::to_string(s.rows) + "x" + std::to_string(s.cols) + " T=" +
                   std::to_string(s.tokens));
      forge_hparams hp = rc.hp;
      hp.seed = rng.gen();
      HostParam fused(s.rows, s.cols, FORGE_WEIGHT_BF16_STOCHASTIC, FORGE_STATE_INT8_BLOCK64, hp);
      fused.randomize(rng, hp);
      HostParam unfused(fused);
      const Matrix x = random_matrix(rng, s.tokens, s.cols, s.cols, FORGE_DTYPE_BF16);
      const Matrix dy = random_matrix(rng, s.tokens, s.rows, s.rows, FORGE_DTYPE_BF16, 0.01f);
      forge_wgrad_args a = wgrad_args(fused, hp, x, dy);
      ASSERT_EQ(forge_wgrad_step(&a), FORGE_OK) << forge_last_error();
      const std::vector<float> dw = reference_dw(x, dy);
      forge_elementwise_args e = elementwise_args(unfused, hp, dw);
      ASSERT_EQ(forge_elementwise_step(&e), FORGE_OK) << forge_last_error();
      ASSERT_EQ(fused.snapshot(), unfused.snapshot());
    }
  }
}

// Tile shape and thread count change nothing: per element the token order is
// the same, and stochastic rounding bits depend on the element, not the launch.
TEST(FusedLaunchShape, TileShapeAndThreadsGiveSameBits) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("FORGE_TEST_SEED=" + std::to_string(seed));
  Rng rng(seed);
  forge_hparams hp = all_rule_cases()[3].hp;  // AdamW
  hp.seed = rng.gen();
  const Matrix x = random_matrix(rng, 40, 300, 300, FORGE_DTYPE_BF16);
  const Matrix dy = random_matrix(rng, 40, 150, 150, FORGE_DTYPE_BF16, 0.1f);
  for (int sf : {FORGE_STATE_BF16_STOCHASTIC, FORGE_STATE_INT8_BLOCK64}) {
    HostParam first(150, 300, FORGE_WEIGHT_BF16_STOCHASTIC, static_cast<forge_state_format>(sf), hp);
    first.randomize(rng, hp);
    const HostParam initial(first);
    forge_wgrad_args a = wgrad_args(first, hp, x, dy);
    ASSERT_EQ(forge_wgrad_step(&a), FORGE_OK) << forge_last_error();
    // tile 0 × 0: the backend's own choice, which depends on the thread count
    const struct { int tr, tc, threads; } launches[] = {{64, 64, 1}, {32, 128, 2}, {7, 192, 2}, {128, 64, 3},
                                                        {0, 0, 1}, {0, 0, 2}, {0, 0, 5}};
    for (const auto& l : launches) {
      HostParam other(initial);
      forge_wgrad_args b = wgrad_args(other, hp, x, dy);
      b.tile_rows = l.tr;
      b.tile_cols = l.tc;
      b.device.num_threads = l.threads;
      ASSERT_EQ(forge_wgrad_step(&b), FORGE_OK) << forge_last_error();
      EXPECT_EQ(other.snapshot(), first.snapshot())
          << "tile " << l.tr << "x" << l.tc << " threads " << l.threads;
    }
  }
}

// Stochastic rounding's bits are rng.h's rng_bits(rng_key(seed, step), row * cols + col,
// stream): the weight takes stream 0 and state 0 stream 1, groups of 4 elements straddle rows
// (13 columns). SGD with momentum at step 1, lr = 1: buf = g and w = 1 - g, both exact in fp32
// and neither a bf16 value, so every rounding depends on its bits.
TEST(StochasticRoundingBits, StepUsesRngBitsOfEachElementAndStream) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("FORGE_TEST_SEED=" + std::to_string(seed));
  forge_hparams hp;
  ASSERT_EQ(forge_hparams_default(FORGE_RULE_SGD_MOMENTUM, &hp), FORGE_OK);
  hp.lr = 1.0;
  hp.momentum = 0.9;
  hp.step = 1;
  hp.seed = seed;
  HostParam param(7, 13, FORGE_WEIGHT_BF16_STOCHASTIC, FORGE_STATE_BF16_STOCHASTIC, hp);
  forge_device cpu{};
  ASSERT_EQ(forge_state_init(&param.p, &hp, cpu), FORGE_OK) << forge_last_error();
  std::vector<float> grad(param.size());
  for (int64_t i = 0; i < param.size(); ++i) {
    param.set_w(i, 1.0f);
    grad[i] = std::ldexp(1.0f + std::ldexp(static_cast<float>(1 + i % 61), -10), -10);
  }
  const forge_elementwise_args a = elementwise_args(param, hp, grad);
  ASSERT_EQ(forge_elementwise_step(&a), FORGE_OK) << forge_last_error();
  const uint64_t key = forge::rng_key(hp.seed, static_cast<uint64_t>(hp.step));
  int64_t up_w = 0, up_s = 0;  // rounded up in magnitude (not truncated)
  for (int64_t i = 0; i < param.size(); ++i) {
    uint16_t w_bits, s_bits;
    std::memcpy(&w_bits, param.weight.data() + 2 * i, 2);
    std::memcpy(&s_bits, param.state[0].data() + 2 * i, 2);
    const float w_exact = 1.0f - grad[i];
    const uint16_t w_want = forge::bf16_stochastic(w_exact, forge::rng_bits(key, i, 0));
    const uint16_t s_want = forge::bf16_stochastic(grad[i], forge::rng_bits(key, i, 1));
    ASSERT_EQ(w_bits, w_want) << "weight element " << i;
    ASSERT_EQ(s_bits, s_want) << "state element " << i;
    up_w += w_bits != static_cast<uint16_t>(forge::float_bits(w_exact) >> 16) ? 1 : 0;
    up_s += s_bits != static_cast<uint16_t>(forge::float_bits(grad[i]) >> 16) ? 1 : 0;
  }
  // Not a constant rounding direction: both directions occur in each stream.
  EXPECT_GT(up_w, 0);
  EXPECT_LT(up_w, param.size());
  EXPECT_GT(up_s, 0);
  EXPECT_LT(up_s, param.size());
}

// NaN / Inf in the gradient: those elements' weights and states stay untouched
// and are counted; Σ g² covers the finite ones only.
TEST(FusedNonFinite, SkippedAndCounted) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("FORGE_TEST_SEED=" + std::to_string(seed));
  Rng rng(seed);
  for (int sf : {FORGE_STATE_FP32, FORGE_STATE_BF16}) {
    forge_hparams hp = all_rule_cases()[3].hp;  // AdamW
    const int64_t rows = 20, cols = 70, tokens = 9;
    HostParam p(rows, cols, FORGE_WEIGHT_FP32, static_cast<forge_state_format>(sf), hp);
    p.randomize(rng, hp);
    // Non-zero states, so "untouched" is a real check.
    hp.step = 1;
    Matrix x = random_matrix(rng, tokens, cols, cols, FORGE_DTYPE_FP32);
    Matrix dy = random_matrix(rng, tokens, rows, rows, FORGE_DTYPE_FP32, 0.1f);
    forge_wgrad_args warm = wgrad_args(p, hp, x, dy);
    ASSERT_EQ(forge_wgrad_step(&warm), FORGE_OK);
    const HostParam before(p);
    hp.step = 2;
    x.set(3, 5, NAN);
    x.set(4, 60, INFINITY);
    const std::vector<float> dw = reference_dw(x, dy);
    double sq = 0, expected_sq = 0;
    int64_t bad = 0, expected_bad = 0;
    for (float g : dw) {
      if (std::isfinite(g)) expected_sq += double(g) * g; else ++expected_bad;
    }
    forge_wgrad_args a = wgrad_args(p, hp, x, dy);
    a.outputs = {&sq, &bad};
    ASSERT_EQ(forge_wgrad_step(&a), FORGE_OK);
    EXPECT_EQ(bad, expected_bad);
    EXPECT_EQ(expected_bad, 2 * rows);
    EXPECT_NEAR(sq, expected_sq, kGradSqSumRel * expected_sq);
    const std::vector<float> s_before = before.state_fp32(0, hp), s_after = p.state_fp32(0, hp);
    for (int64_t i = 0; i < p.size(); ++i) {
      const bool skipped = !std::isfinite(dw[i]);
      EXPECT_FALSE(std::isnan(p.w(i)));
      if (skipped) {
        EXPECT_EQ(p.w(i), before.w(i)) << "element " << i;
        EXPECT_EQ(s_after[i], s_before[i]) << "element " << i;
      } else {
        EXPECT_NE(p.w(i), before.w(i)) << "element " << i;
      }
    }
  }
}


// ---------------------------------------------------------------------------- tile paths

const forge_dtype kDtypes[] = {FORGE_DTYPE_FP32, FORGE_DTYPE_BF16, FORGE_DTYPE_FP16};

const char* dtype_name(forge_dtype t) {
  return t == FORGE_DTYPE_FP32 ? "fp32" : t == FORGE_DTYPE_BF16 ? "bf16" : "fp16";
}

// Equal bits, or both NaN: which NaN a NaN operand propagates is the hardware's choice per
// instruction (and a NaN gradient element is skipped whatever its payload).
bool same_float(float a, float b) {
  return (std::isnan(a) && std::isnan(b)) || forge::float_bits(a) == forge::float_bits(b);
}

// The paths this machine runs, portable always among them.
std::vector<forge::cpu::TileIsa> runnable_paths() {
  std::vector<forge::cpu::TileIsa> paths;
  for (auto isa : {forge::cpu::TileIsa::kPortable, forge::cpu::TileIsa::kAvx2, forge::cpu::TileIsa::kAvx512})
    if (forge::cpu::tile_isa_supported(isa)) paths.push_back(isa);
    else std::printf("[ note     ] tile path %s: not run, this CPU lacks it\n", forge::cpu::tile_isa_name(isa));
  return paths;
}

struct TileCase {
  int64_t bm, bn, tokens, r0, c0;  // the tile [bm × bn] at (r0, c0) of a larger W
};

// Accumulates the tile on every runnable path from a non-zero start (a tile's second chunk
// starts from its first's sums) and compares each element with the naive sum, token by token.
void expect_paths_match_naive(const TileCase& c, const Matrix& x, const Matrix& dy) {
  using namespace forge::cpu;
  const float kStart = 0.375f;  // exact; added first, as the carried sum of earlier tokens
  std::vector<float> want(c.bm * c.bn);
  for (int64_t i = 0; i < c.bm; ++i)
    for (int64_t j = 0; j < c.bn; ++j) {
      float acc = kStart;
      for (int64_t t = 0; t < c.tokens; ++t) {
        const float prod = dy.get(t, c.r0 + i) * x.get(t, c.c0 + j);
        acc = acc + prod;
      }
      want[i * c.bn + j] = acc;
    }
  const TileBuffers sizes(c.bm, c.bn);
  const TileJob job{x.bytes.data(), dy.bytes.data(), x.dtype, dy.dtype, x.ld, dy.ld, c.tokens,
                    c.r0, c.c0, c.bm, c.bn};
  for (TileIsa isa : runnable_paths()) {
    std::vector<float> buffer(sizes.total(), kStart);
    accumulate_tile(isa, job, buffer.data(), sizes.ldacc, buffer.data() + sizes.acc_floats,
                    buffer.data() + sizes.acc_floats + sizes.dy_floats);
    int64_t wrong = 0;
    for (int64_t i = 0; i < c.bm; ++i)
      for (int64_t j = 0; j < c.bn; ++j) {
        const float got = buffer[i * sizes.ldacc + j], expected = want[i * c.bn + j];
        if (!same_float(got, expected) && wrong++ < 3)
          ADD_FAILURE() << tile_isa_name(isa) << ": element (" << i << ", " << j << ") is "
                        << got << ", the naive sum " << expected;
      }
    EXPECT_EQ(wrong, 0) << tile_isa_name(isa) << ": elements that differ from the naive sum";
  }
}

// Odd tile shapes (every path's micro-tile has a ragged edge somewhere), tiles inside a larger
// strided matrix, token counts around the chunk size, every X and dY dtype pair.
TEST(TilePaths, EveryPathIsTheNaiveSum) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("FORGE_TEST_SEED=" + std::to_string(seed));
  Rng rng(seed);
  const int64_t chunk = forge::cpu::kTokenChunk;
  const TileCase cases[] = {{1, 1, 1, 0, 0},        {17, 129, 33, 3, 5},   {129, 17, 70, 0, 0},
                            {129, 129, 2, 1, 2},    {8, 32, chunk, 8, 32}, {9, 33, chunk + 1, 0, 1},
                            {6, 16, chunk - 1, 6, 0}, {1, 4097, 3, 0, 7},  {4097, 1, 2, 5, 0},
                            {40, 64, 4097, 0, 0}};
  for (const TileCase& c : cases)
    for (forge_dtype xt : kDtypes)
      for (forge_dtype dyt : kDtypes) {
        SCOPED_TRACE(::testing::Message() << "tile " << c.bm << "x" << c.bn << " at (" << c.r0 << ", "
                                          << c.c0 << ") T=" << c.tokens << " x " << dtype_name(xt)
                                          << " dy " << dtype_name(dyt));
        const int64_t in = c.c0 + c.bn + 2, out = c.r0 + c.bm + 1;
        const Matrix x = random_matrix(rng, c.tokens, in, in + 3, xt);
        const Matrix dy = random_matrix(rng, c.tokens, out, out + 5, dyt, 0.1f);
        expect_paths_match_naive(c, x, dy);
        if (c.tokens > 300) break;  // the long reduction: one dtype pair per X dtype
      }
}

// Every token count from 1 to 70 on a tile with ragged edges on every path.
TEST(TilePaths, EveryTokenCountUpTo70) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("FORGE_TEST_SEED=" + std::to_string(seed));
  Rng rng(seed);
  for (int64_t tokens = 1; tokens <= 70; ++tokens) {
    const forge_dtype xt = kDtypes[tokens % 3], dyt = kDtypes[(tokens / 3) % 3];
    SCOPED_TRACE(::testing::Message() << "T=" << tokens << " x " << dtype_name(xt) << " dy "
                                      << dtype_name(dyt));
    const Matrix x = random_matrix(rng, tokens, 40, 41, xt);
    const Matrix dy = random_matrix(rng, tokens, 20, 20, dyt, 0.1f);
    expect_paths_match_naive({13, 35, tokens, 2, 4}, x, dy);
  }
}

// Zeros of both signs, infinities, NaN, fp32 subnormals, and products that overflow or
// underflow fp32: the vector paths round, propagate and signal exactly as the scalar sum.
TEST(TilePaths, SpecialValues) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("FORGE_TEST_SEED=" + std::to_string(seed));
  Rng rng(seed);
  const float specials[] = {0.0f, -0.0f, INFINITY, -INFINITY, NAN, 1e-40f, -3e-39f, 1e30f,
                            -2e25f, 1e-25f, 65504.0f, 6e-8f};
  for (forge_dtype xt : kDtypes)
    for (forge_dtype dyt : kDtypes) {
      SCOPED_TRACE(::testing::Message() << "x " << dtype_name(xt) << " dy " << dtype_name(dyt));
      const int64_t tokens = 37, in = 70, out = 19;
      Matrix x = random_matrix(rng, tokens, in, in, xt);
      Matrix dy = random_matrix(rng, tokens, out, out, dyt);
      // a few of each: most sums stay finite, so their bits are compared, not only NaN-ness
      for (float v : specials) {
        x.set(rng.integer(0, tokens - 1), rng.integer(0, in - 1), v);
        dy.set(rng.integer(0, tokens - 1), rng.integer(0, out - 1), v);
      }
      expect_paths_match_naive({out, in, tokens, 0, 0}, x, dy);
    }
}

// Through the C ABI (the path this machine dispatches to, with the backend's own tile
// shape): odd shapes, strided inputs, every X and dY dtype pair, against the unfused step.
TEST(FusedOddShapes, EveryDtypePairBitExact) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("FORGE_TEST_SEED=" + std::to_string(seed));
  Rng rng(seed);
  forge_hparams hp = all_rule_cases()[3].hp;  // AdamW: fp32 weight and states show every bit of g
  hp.step = 1;
  const Shape shapes[] = {{1, 4097, 3}, {4097, 1, 2}, {17, 129, 70}, {129, 17, 33}, {128, 128, 1}, {33, 200, 9}};
  for (const Shape& s : shapes)
    for (forge_dtype xt : kDtypes)
      for (forge_dtype dyt : kDtypes) {
        SCOPED_TRACE(::testing::Message() << "shape " << s.rows << "x" << s.cols << " T=" << s.tokens
                                          << " x " << dtype_name(xt) << " dy " << dtype_name(dyt));
        hp.seed = rng.gen();
        HostParam fused(s.rows, s.cols, FORGE_WEIGHT_FP32, FORGE_STATE_FP32, hp);
        fused.randomize(rng, hp);
        HostParam unfused(fused);
        const Matrix x = random_matrix(rng, s.tokens, s.cols, s.cols + 3, xt);
        const Matrix dy = random_matrix(rng, s.tokens, s.rows, s.rows + 5, dyt, 0.1f);
        forge_wgrad_args a = wgrad_args(fused, hp, x, dy);
        ASSERT_EQ(forge_wgrad_step(&a), FORGE_OK) << forge_last_error();
        const std::vector<float> dw = reference_dw(x, dy);
        forge_elementwise_args e = elementwise_args(unfused, hp, dw);
        ASSERT_EQ(forge_elementwise_step(&e), FORGE_OK) << forge_last_error();
        ASSERT_EQ(fused.snapshot(), unfused.snapshot());
      }
}

}  // namespace
}  // namespace forge_test

namespace forge_test {
namespace {

// The weight and states of one parameter as fp32, for "untouched" / "finite" checks.
struct Values {
  std::vector<float> w, master;
  std::vector<std::vector<float>> s;
};
Values values_of(const HostParam& p, const forge_hparams& hp) {
  Values v;
  for (int64_t i = 0; i < p.size(); ++i) v.w.push_back(p.w(i));
  if (!p.master.empty()) {
    v.master.resize(p.size());
    std::memcpy(v.master.data(), p.master.data(), 4 * p.size());
  }
  for (int i = 0; i < p.num_states; ++i) v.s.push_back(p.state_fp32(i, hp));
  return v;
}

// A finite gradient whose update overflows (g² = 1e40 > fp32's max, so AdamW's v would be
// infinite) is skipped like a non-finite one: its weight, master and states untouched, counted,
// not in Σ g². Before, int8 states took v = inf as the block's absmax and every weight of the
// block became NaN at the next step. Every weight and state format, fused and element-wise.
TEST(FusedNonFinite, OverflowingUpdateIsSkippedAndCounted) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("FORGE_TEST_SEED=" + std::to_string(seed));
  Rng rng(seed);
  const int64_t rows = 3, cols = 100, tokens = 4;
  for (int wf : {FORGE_WEIGHT_FP32, FORGE_WEIGHT_BF16, FORGE_WEIGHT_BF16_MASTER})
    for (int sf = 0; sf < FORGE_STATE_FORMAT_COUNT; ++sf)
      for (bool fused : {true, false}) {
        SCOPED_TRACE(std::string(weight_format_name(wf)) + " " + state_format_name(sf) +
                     (fused ? " fused" : " element-wise"));
        forge_hparams hp = all_rule_cases()[3].hp;  // AdamW
        HostParam p(rows, cols, static_cast<forge_weight_format>(wf),
                    static_cast<forge_state_format>(sf), hp);
        p.randomize(rng, hp);
        for (int64_t step = 1; step <= 4; ++step) {
          hp.step = step;
          // dW = dYᵀX: x[0, 7] = 1e10 and dy[0, 1] = 1e10 make dW[1, 7] = 1e20 (plus O(1)),
          // on the first two steps; the later steps are ordinary.
          Matrix x = random_matrix(rng, tokens, cols, cols, FORGE_DTYPE_FP32, 0.1f);
          Matrix dy = random_matrix(rng, tokens, rows, rows, FORGE_DTYPE_FP32, 0.1f);
          const bool overflow = step <= 2;
          if (overflow) {
            x.set(0, 7, 1e10f);
            dy.set(0, 1, 1e10f);
          }
          const std::vector<float> dw = reference_dw(x, dy);
          const Values before = values_of(p, hp);
          double sq = 0;
          int64_t count = 0;
          if (fused) {
            forge_wgrad_args a = wgrad_args(p, hp, x, dy);
            a.outputs = {&sq, &count};
            ASSERT_EQ(forge_wgrad_step(&a), FORGE_OK) << forge_last_error();
          } else {
            forge_elementwise_args a = elementwise_args(p, hp, dw);
            a.outputs = {&sq, &count};
            ASSERT_EQ(forge_elementwise_step(&a), FORGE_OK) << forge_last_error();
          }
          const Values after = values_of(p, hp);
          const int64_t j = 1 * cols + 7;
          if (overflow) {
            ASSERT_GT(std::fabs(dw[j]), 1e19f);
            EXPECT_EQ(count, 1) << "step " << step;
            EXPECT_LT(sq, 1e30) << "the skipped element's g² was summed";
            EXPECT_EQ(after.w[j], before.w[j]);
            if (!after.master.empty()) EXPECT_EQ(after.master[j], before.master[j]);
            for (int i = 0; i < p.num_states; ++i) {
              // Block states: a block with a skipped element keeps its absmax unless the others
              // grow it; the skipped element's value then stays or is re-encoded (one rounding).
              if (sf == FORGE_STATE_INT8_BLOCK64)
                EXPECT_NEAR(after.s[i][j], before.s[i][j], kInt8MapRel * std::fabs(before.s[i][j]) + 1e-30)
                    << "state " << i;
              else if (sf == FORGE_STATE_FP8_BLOCK64)  // (AdamW: exp_avg e4m3, exp_avg_sq e5m2)
                EXPECT_NEAR(after.s[i][j], before.s[i][j],
                            (i == 0 ? kFp8E4m3Rel : kFp8E5m2Rel) * std::fabs(before.s[i][j]) + 1e-30)
                    << "state " << i;
              else if (sf == FORGE_STATE_INT4_BLOCK64)  // (within a step of block 0 of row 1)
                EXPECT_NEAR(after.s[i][j], before.s[i][j],
                            (i == 0 ? kInt4SignedAbsmaxStep : kInt4UnsignedAbsmaxStep) *
                                reinterpret_cast<const float*>(p.absmax[i].data())[1 * 2 + 0])
                    << "state " << i;
              else
                EXPECT_EQ(after.s[i][j], before.s[i][j]) << "state " << i;
            }
          } else {
            EXPECT_EQ(count, 0) << "step " << step;
          }
          for (int64_t i = 0; i < p.size(); ++i) {
            ASSERT_TRUE(std::isfinite(after.w[i])) << "weight " << i << " step " << step;
            for (int s = 0; s < p.num_states; ++s)
              ASSERT_TRUE(std::isfinite(after.s[s][i])) << "state " << s << " element " << i;
          }
        }
      }
}

// The bound that makes a result storable is the largest finite bf16 (0x1.FEp127), for every
// format: bf16 rounding of anything above it can overflow. SGD, lr = 1, w = 0: w' = -g.
TEST(FusedNonFinite, ResultsAboveTheLargestBf16AreSkipped) {
  forge_hparams hp;
  ASSERT_EQ(forge_hparams_default(FORGE_RULE_SGD, &hp), FORGE_OK);
  hp.lr = 1.0;
  const float largest = 0x1.FEp127f, above = std::nextafter(largest, INFINITY);
  for (int wf : {FORGE_WEIGHT_FP32, FORGE_WEIGHT_BF16, FORGE_WEIGHT_BF16_STOCHASTIC}) {
    SCOPED_TRACE(weight_format_name(wf));
    HostParam p(1, 4, static_cast<forge_weight_format>(wf), FORGE_STATE_FP32, hp);
    const std::vector<float> grad = {-largest, -above, largest, -std::numeric_limits<float>::max()};
    int64_t count = 0;
    forge_elementwise_args a = elementwise_args(p, hp, grad);
    a.outputs.nonfinite_count = &count;
    ASSERT_EQ(forge_elementwise_step(&a), FORGE_OK) << forge_last_error();
    EXPECT_EQ(count, 2);
    EXPECT_EQ(p.w(0), largest);
    EXPECT_EQ(p.w(1), 0.0f);
    EXPECT_EQ(p.w(2), -largest);
    EXPECT_EQ(p.w(3), 0.0f);
  }
}

}  // namespace
}  // namespace forge_test
