// test_bad_input.cpp — every invalid argument gets an error code and a message
// naming the argument, and no output byte changes (weights, master, states,
// absmax, the step outputs).
#include <cctype>
#include <functional>

#include "bad_input_cases.h"
#include "test_util.h"

namespace forge_test {
namespace {

forge_hparams adamw() {
  forge_hparams hp;
  forge_hparams_default(FORGE_RULE_ADAMW, &hp);
  return hp;
}

TEST(BadInput, WgradStepRejectsAndWritesNothing) {
  Rng rng(fresh_seed());
  const forge_hparams hp = adamw();
  for (const BadCase& bc : wgrad_cases()) {
    SCOPED_TRACE(bc.name);
    HostParam p(9, 70, FORGE_WEIGHT_BF16, FORGE_STATE_INT8_BLOCK64, hp);
    p.randomize(rng, hp);
    const Matrix x = random_matrix(rng, 5, 70, 70, FORGE_DTYPE_BF16);
    const Matrix dy = random_matrix(rng, 5, 9, 9, FORGE_DTYPE_BF16);
    double sq = 1.5;
    int64_t count = 7;
    forge_wgrad_args a = wgrad_args(p, hp, x, dy);
    a.outputs = {&sq, &count};
    bc.mutate(a);
    const std::vector<uint8_t> before = p.snapshot();
    EXPECT_EQ(forge_wgrad_step(&a), bc.code);
    EXPECT_NE(std::string(forge_last_error()).find(bc.message_part), std::string::npos)
        << "message: " << forge_last_error();
    EXPECT_EQ(p.snapshot(), before);
    EXPECT_EQ(sq, 1.5);
    EXPECT_EQ(count, 7);
  }
  EXPECT_EQ(forge_wgrad_step(nullptr), FORGE_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(forge_last_error()).find("args: NULL"), std::string::npos);
}

// Every buffer of a step carved out of one arena at chosen byte offsets, so that a case can
// make two of them overlap (or misalign one) while every pointer stays inside the arena:
// "nothing written" is then "the arena is unchanged".
struct Arena {
  static constexpr int64_t kRows = 9, kCols = 70, kTokens = 5;
  std::vector<uint64_t> words = std::vector<uint64_t>(4096);
  uint8_t* at(size_t offset) { return reinterpret_cast<uint8_t*>(words.data()) + offset; }
  Arena() {
    Rng rng(7);
    // bf16 and fp32 values in [0.5, 2), int8 codes anything: finite whatever is read as what
    for (size_t i = 0; i < words.size(); ++i)
      words[i] = 0x3F003F003F003F00ull | (rng.gen() & 0x007F007F007F007Full);
  }
  std::vector<uint8_t> bytes() const {
    const uint8_t* b = reinterpret_cast<const uint8_t*>(words.data());
    return std::vector<uint8_t>(b, b + words.size() * 8);
  }
};

// Byte offsets of each buffer: AdamW, bf16 weight (+ fp32 master when set), int8 states.
// Sizes: weight 1260 B (bf16) or 2520 B (fp32), master 2520 B, states 630 B, absmax 72 B,
// x 700 B (bf16) or 1400 B (fp32), dy 90 B or 180 B, grad 1260 B.
struct Offsets {
  size_t weight = 0, master = SIZE_MAX, state0 = 6144, state1 = 7168, absmax0 = 8192,
         absmax1 = 8448, x = 9216, dy = 11264, grad = 12288, sq = 16384, count = 16392;
};

forge_wgrad_args arena_wgrad(Arena& arena, const Offsets& o, int weight_format = FORGE_WEIGHT_BF16,
                             int dtype = FORGE_DTYPE_BF16) {
  forge_wgrad_args a{};
  a.abi_version = FORGE_ABI_VERSION;
  a.device.kind = FORGE_DEVICE_CPU;
  a.tokens = Arena::kTokens;
  a.x = arena.at(o.x); a.x_dtype = dtype; a.ldx = Arena::kCols;
  a.dy = arena.at(o.dy); a.dy_dtype = dtype; a.lddy = Arena::kRows;
  a.param.rows = Arena::kRows;
  a.param.cols = Arena::kCols;
  a.param.weight_format = weight_format;
  a.param.weight = arena.at(o.weight);
  if (o.master != SIZE_MAX) a.param.master = reinterpret_cast<float*>(arena.at(o.master));
  a.param.state_format = FORGE_STATE_INT8_BLOCK64;
  a.param.state[0] = arena.at(o.state0);
  a.param.state[1] = arena.at(o.state1);
  a.param.state_absmax[0] = reinterpret_cast<float*>(arena.at(o.absmax0));
  a.param.state_absmax[1] = reinterpret_cast<float*>(arena.at(o.absmax1));
  forge_hparams_default(FORGE_RULE_ADAMW, &a.hparams);
  a.outputs.grad_sq_sum = reinterpret_cast<double*>(arena.at(o.sq));
  a.outputs.nonfinite_count = reinterpret_cast<int64_t*>(arena.at(o.count));
  return a;
}

struct AliasCase {
  std::string name;
  std::function<void(Offsets&)> move;
  std::string first, second;  // both must be named
  int weight_format = FORGE_WEIGHT_BF16;
  int dtype = FORGE_DTYPE_BF16;
};

TEST(BadInput, OverlappingBuffersAreRefusedNamingBoth) {
  const std::vector<AliasCase> cases = {
      {"state_equals_state", [](Offsets& o) { o.state1 = o.state0; }, "param.state[1]", "param.state[0]"},
      {"state_ranges_overlap", [](Offsets& o) { o.state1 = o.state0 + 600; }, "param.state[1]", "param.state[0]"},
      {"weight_overlaps_state", [](Offsets& o) { o.weight = o.state0 - 1000; }, "param.weight", "param.state[0]"},
      {"master_overlaps_weight", [](Offsets& o) { o.master = o.weight + 1000; }, "param.master", "param.weight", FORGE_WEIGHT_BF16_MASTER},
      {"absmax_equals_absmax", [](Offsets& o) { o.absmax1 = o.absmax0; }, "param.state_absmax[1]", "param.state_absmax[0]"},
      {"absmax_overlaps_state", [](Offsets& o) { o.absmax0 = o.state1 + 600; }, "param.state_absmax[0]", "param.state[1]"},
      {"x_overlaps_weight", [](Offsets& o) { o.x = o.weight + 64; }, "x", "param.weight"},
      {"dy_overlaps_state", [](Offsets& o) { o.dy = o.state0 + 8; }, "dy", "param.state[0]"},
      {"x_overlaps_absmax", [](Offsets& o) { o.x = o.absmax1 - 100; }, "x", "param.state_absmax[1]"},
      {"output_inside_weight", [](Offsets& o) { o.sq = o.weight + 256; }, "outputs.grad_sq_sum", "param.weight"},
      {"outputs_overlap", [](Offsets& o) { o.count = o.sq; }, "outputs.nonfinite_count", "outputs.grad_sq_sum"},
      {"output_overlaps_dy", [](Offsets& o) { o.count = o.dy + 40; }, "outputs.nonfinite_count", "dy"},
  };
  for (const AliasCase& c : cases) {
    SCOPED_TRACE(c.name);
    Arena arena;
    Offsets o;
    c.move(o);
    forge_wgrad_args a = arena_wgrad(arena, o, c.weight_format, c.dtype);
    const std::vector<uint8_t> before = arena.bytes();
    EXPECT_EQ(forge_wgrad_step(&a), FORGE_ERR_INVALID_ARGUMENT);
    const std::string message = forge_last_error();
    EXPECT_NE(message.find(c.first), std::string::npos) << message;
    EXPECT_NE(message.find(c.second), std::string::npos) << message;
    EXPECT_EQ(arena.bytes(), before);
  }
  // x and dy may share memory: both are only read
  Arena arena;
  Offsets o;
  o.dy = o.x + 2;
  forge_wgrad_args a = arena_wgrad(arena, o);
  EXPECT_EQ(forge_wgrad_step(&a), FORGE_OK) << forge_last_error();
}

TEST(BadInput, MisalignedBuffersAreRefusedByName) {
  const std::vector<AliasCase> cases = {
      {"fp32_weight", [](Offsets& o) { o.weight += 2; }, "param.weight", "4-byte", FORGE_WEIGHT_FP32},
      {"bf16_weight", [](Offsets& o) { o.weight += 1; }, "param.weight", "2-byte"},
      {"master", [](Offsets& o) { o.master = 3000 + 2; }, "param.master", "4-byte", FORGE_WEIGHT_BF16_MASTER},
      {"absmax", [](Offsets& o) { o.absmax1 += 2; }, "param.state_absmax[1]", "4-byte"},
      {"grad_sq_sum", [](Offsets& o) { o.sq += 4; o.count += 8; }, "outputs.grad_sq_sum", "8-byte"},
      {"nonfinite_count", [](Offsets& o) { o.count += 4; }, "outputs.nonfinite_count", "8-byte"},
      {"fp32_x", [](Offsets& o) { o.x += 2; }, "x", "4-byte", FORGE_WEIGHT_BF16, FORGE_DTYPE_FP32},
      {"bf16_dy", [](Offsets& o) { o.dy += 1; }, "dy", "2-byte"},
  };
  for (const AliasCase& c : cases) {
    SCOPED_TRACE(c.name);
    Arena arena;
    Offsets o;
    c.move(o);
    forge_wgrad_args a = arena_wgrad(arena, o, c.weight_format, c.dtype);
    const std::vector<uint8_t> before = arena.bytes();
    EXPECT_EQ(forge_wgrad_step(&a), FORGE_ERR_INVALID_ARGUMENT);
    const std::string message = forge_last_error();
    EXPECT_NE(message.find(c.first), std::string::npos) << message;
    EXPECT_NE(message.find(c.second), std::string::npos) << message;
    EXPECT_EQ(arena.bytes(), before);
  }
}

// The same checks on the element-wise step and the state entry points.
TEST(BadInput, OverlapsOutsideTheFusedStep) {
  Arena arena;
  Offsets o;
  const forge_wgrad_args w = arena_wgrad(arena, o);
  forge_elementwise_args e{};
  e.abi_version = FORGE_ABI_VERSION;
  e.device = w.device;
  e.param = w.param;
  e.hparams = w.hparams;
  e.grad = arena.at(o.state0 + 700);
  e.grad_dtype = FORGE_DTYPE_BF16;
  const std::vector<uint8_t> before = arena.bytes();
  EXPECT_EQ(forge_elementwise_step(&e), FORGE_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(forge_last_error()).find("grad"), std::string::npos) << forge_last_error();
  EXPECT_NE(std::string(forge_last_error()).find("param.state[1]"), std::string::npos) << forge_last_error();
  e.grad = arena.at(o.grad + 1);
  EXPECT_EQ(forge_elementwise_step(&e), FORGE_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(forge_last_error()).find("grad: "), std::string::npos) << forge_last_error();
  const forge_device cpu{};
  forge_param p = w.param;
  p.state[1] = p.state[0];
  EXPECT_EQ(forge_state_init(&p, &w.hparams, cpu), FORGE_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(forge_last_error()).find("param.state[1]"), std::string::npos) << forge_last_error();
  // from_fp32 reads `in` while it writes state 0 and its absmax
  const float* in = reinterpret_cast<const float*>(arena.at(o.state0 - 1024));
  EXPECT_EQ(forge_state_from_fp32(&w.param, &w.hparams, 0, in, cpu), FORGE_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(forge_last_error()).find("in"), std::string::npos) << forge_last_error();
  EXPECT_NE(std::string(forge_last_error()).find("param.state[0]"), std::string::npos) << forge_last_error();
  // to_fp32 writes `out` while it reads state 1 and its absmax
  float* out = reinterpret_cast<float*>(arena.at(o.absmax1 - 600));
  EXPECT_EQ(forge_state_to_fp32(&w.param, &w.hparams, 1, out, cpu), FORGE_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(forge_last_error()).find("param.state_absmax[1]"), std::string::npos) << forge_last_error();
  EXPECT_EQ(forge_state_to_fp32(&w.param, &w.hparams, 1, reinterpret_cast<float*>(arena.at(o.grad + 2)), cpu),
            FORGE_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(forge_last_error()).find("out: "), std::string::npos) << forge_last_error();
  EXPECT_EQ(arena.bytes(), before);
}

TEST(BadInput, ElementwiseStepRejectsAndWritesNothing) {
  Rng rng(fresh_seed());
  const forge_hparams hp = adamw();
  HostParam p(3, 10, FORGE_WEIGHT_FP32, FORGE_STATE_FP32, hp);
  p.randomize(rng, hp);
  std::vector<float> grad(30, 1.0f);
  const std::vector<uint8_t> before = p.snapshot();
  forge_elementwise_args a = elementwise_args(p, hp, grad);
  a.grad = nullptr;
  EXPECT_EQ(forge_elementwise_step(&a), FORGE_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(forge_last_error()).find("grad: NULL"), std::string::npos);
  a = elementwise_args(p, hp, grad);
  a.grad_dtype = static_cast<forge_dtype>(5);
  EXPECT_EQ(forge_elementwise_step(&a), FORGE_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(forge_last_error()).find("grad_dtype"), std::string::npos);
  a = elementwise_args(p, hp, grad);
  a.param.master = reinterpret_cast<float*>(grad.data());
  EXPECT_EQ(forge_elementwise_step(&a), FORGE_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(forge_last_error()).find("param.master"), std::string::npos);
  EXPECT_EQ(p.snapshot(), before);
  // a valid call clears the message
  a = elementwise_args(p, hp, grad);
  EXPECT_EQ(forge_elementwise_step(&a), FORGE_OK);
  EXPECT_STREQ(forge_last_error(), "");
}

TEST(BadInput, StateEntryPoints) {
  const forge_hparams hp = adamw();
  HostParam p(2, 70, FORGE_WEIGHT_FP32, FORGE_STATE_INT8_BLOCK64, hp);
  forge_device cpu{};
  std::vector<float> buf(140, 3.0f);
  EXPECT_EQ(forge_state_to_fp32(&p.p, &hp, 2, buf.data(), cpu), FORGE_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(forge_last_error()).find("index"), std::string::npos);
  EXPECT_EQ(forge_state_to_fp32(&p.p, &hp, 0, nullptr, cpu), FORGE_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(forge_last_error()).find("out: NULL"), std::string::npos);
  EXPECT_EQ(forge_state_from_fp32(nullptr, &hp, 0, buf.data(), cpu), FORGE_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(forge_last_error()).find("param: NULL"), std::string::npos);
  forge_param no_absmax = p.p;
  no_absmax.state_absmax[1] = nullptr;
  const std::vector<uint8_t> before = p.snapshot();
  EXPECT_EQ(forge_state_init(&no_absmax, &hp, cpu), FORGE_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(forge_last_error()).find("param.state_absmax[1]"), std::string::npos);
  EXPECT_EQ(p.snapshot(), before);
  for (float v : buf) EXPECT_EQ(v, 3.0f);
  forge_state_layout l;
  EXPECT_EQ(forge_state_layout_query(&hp, static_cast<forge_state_format>(11), 2, 2, &l), FORGE_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(forge_last_error()).find("state_format"), std::string::npos);
  // a state of 2^64 bytes (2^62 fp32 elements): refused, not reported as 0 bytes
  std::memset(&l, 0x5A, sizeof(l));
  const forge_state_layout untouched = l;
  EXPECT_EQ(forge_state_layout_query(&hp, FORGE_STATE_FP32, int64_t(1) << 31, int64_t(1) << 31, &l),
            FORGE_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(forge_last_error()).find("rows"), std::string::npos) << forge_last_error();
  EXPECT_EQ(std::memcmp(&l, &untouched, sizeof(l)), 0);
  EXPECT_EQ(forge_state_layout_query(&hp, FORGE_STATE_INT8_BLOCK64, INT64_MAX, 2, &l), FORGE_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(forge_state_layout_query(&hp, FORGE_STATE_FP32, (int64_t(1) << 61) / 7, 8, &l), FORGE_ERR_INVALID_ARGUMENT);
  // the largest parameters are fine: 2^60 elements, 2^62 bytes of fp32 state
  ASSERT_EQ(forge_state_layout_query(&hp, FORGE_STATE_FP32, int64_t(1) << 30, int64_t(1) << 30, &l), FORGE_OK);
  EXPECT_EQ(l.state_bytes[0], int64_t(1) << 62);
  EXPECT_EQ(forge_hparams_default(static_cast<forge_rule>(42), nullptr), FORGE_ERR_INVALID_ARGUMENT);
  // an initial accumulator that overflows fp32 would fill Adagrad's sum with infinities
  forge_hparams adagrad;
  ASSERT_EQ(forge_hparams_default(FORGE_RULE_ADAGRAD, &adagrad), FORGE_OK);
  HostParam sum(2, 70, FORGE_WEIGHT_FP32, FORGE_STATE_FP32, adagrad);
  adagrad.initial_accumulator_value = 1e39;
  const std::vector<uint8_t> sum_before = sum.snapshot();
  EXPECT_EQ(forge_state_init(&sum.p, &adagrad, cpu), FORGE_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(forge_last_error()).find("hparams.initial_accumulator_value"), std::string::npos)
      << forge_last_error();
  EXPECT_EQ(sum.snapshot(), sum_before);
}

TEST(Abi, VersionAndCapabilities) {
  EXPECT_EQ(forge_abi_version(), FORGE_ABI_VERSION);
  EXPECT_TRUE(forge_capabilities() & FORGE_CAP_CPU);
  EXPECT_STRNE(forge_version_string(), "");
}

// Every enumeration's names round-trip through forge_enum_name / forge_enum_value, the
// names are those forge.h documents, and bad kinds, values and names are refused by name.
TEST(Abi, EnumNamesRoundTrip) {
  const std::vector<std::vector<std::string>> documented = {
      {"ok", "invalid_argument", "unsupported", "device", "out_of_memory", "internal"},
      {"fp32", "bf16", "fp16"},
      {"SGD", "SGD_MOMENTUM", "AdamW", "NAdam", "RAdam", "Lion", "RMSprop", "Adagrad", "Muon"},
      {"fp32", "bf16", "bf16_sr", "bf16_master"},
      {"fp32", "bf16", "bf16_sr", "int8", "fp8", "int4"},
      {"cpu", "cuda"}};
  ASSERT_EQ(documented.size(), static_cast<size_t>(FORGE_ENUM_COUNT));
  for (int32_t kind = 0; kind < FORGE_ENUM_COUNT; ++kind) {
    int32_t count = -1;
    ASSERT_EQ(forge_enum_count(kind, &count), FORGE_OK);
    ASSERT_EQ(count, static_cast<int32_t>(documented[kind].size())) << "kind " << kind;
    for (int32_t v = 0; v < count; ++v) {
      const char* name = nullptr;
      ASSERT_EQ(forge_enum_name(kind, v, &name), FORGE_OK);
      EXPECT_EQ(documented[kind][v], name);
      int32_t back = -1;
      ASSERT_EQ(forge_enum_value(kind, name, &back), FORGE_OK);
      EXPECT_EQ(back, v);
      std::string upper(name);
      for (char& c : upper) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
      ASSERT_EQ(forge_enum_value(kind, upper.c_str(), &back), FORGE_OK) << upper;
      EXPECT_EQ(back, v);
    }
    const char* name = "unchanged";
    EXPECT_EQ(forge_enum_name(kind, count, &name), FORGE_ERR_INVALID_ARGUMENT);
    EXPECT_NE(std::string(forge_last_error()).find("value"), std::string::npos);
    EXPECT_STREQ(name, "unchanged");
  }
  EXPECT_EQ(FORGE_RULE_ADAMW, [] { int32_t v = -1; forge_enum_value(FORGE_ENUM_RULE, "adamw", &v); return v; }());
  EXPECT_EQ(FORGE_STATE_INT8_BLOCK64, [] { int32_t v = -1; forge_enum_value(FORGE_ENUM_STATE_FORMAT, "int8", &v); return v; }());
  EXPECT_EQ(FORGE_WEIGHT_BF16_STOCHASTIC, [] { int32_t v = -1; forge_enum_value(FORGE_ENUM_WEIGHT_FORMAT, "bf16_sr", &v); return v; }());
  int32_t v = 77;
  EXPECT_EQ(forge_enum_value(FORGE_ENUM_STATE_FORMAT, "fp4", &v), FORGE_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(forge_last_error()).find("\"int8\""), std::string::npos) << forge_last_error();
  EXPECT_EQ(v, 77);
  EXPECT_EQ(forge_enum_value(FORGE_ENUM_RULE, nullptr, &v), FORGE_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(forge_last_error()).find("name"), std::string::npos);
  int32_t count = 5;
  EXPECT_EQ(forge_enum_count(FORGE_ENUM_COUNT, &count), FORGE_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(forge_last_error()).find("kind"), std::string::npos);
  EXPECT_EQ(forge_enum_count(-1, &count), FORGE_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(count, 5);
}

TEST(Abi, StructSizes) {
  const std::pair<const char*, size_t> structs[] = {
      {"forge_device", sizeof(forge_device)},
      {"forge_hparams", sizeof(forge_hparams)},
      {"forge_param", sizeof(forge_param)},
      {"forge_step_outputs", sizeof(forge_step_outputs)},
      {"forge_wgrad_args", sizeof(forge_wgrad_args)},
      {"forge_elementwise_args", sizeof(forge_elementwise_args)},
      {"forge_state_layout", sizeof(forge_state_layout)},
      {"forge_rule_info", sizeof(forge_rule_info)}};
  for (const auto& [name, size] : structs) {
    int64_t got = -1;
    ASSERT_EQ(forge_struct_size(name, &got), FORGE_OK) << name;
    EXPECT_EQ(got, static_cast<int64_t>(size)) << name;
  }
  int64_t got = -1;
  EXPECT_EQ(forge_struct_size("forge_nothing", &got), FORGE_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(forge_last_error()).find("forge_nothing"), std::string::npos);
  EXPECT_EQ(got, -1);
  EXPECT_EQ(forge_struct_size(nullptr, &got), FORGE_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(forge_struct_size("forge_param", nullptr), FORGE_ERR_INVALID_ARGUMENT);
}

// Enumerated fields are plain int32_t: any value can be passed and is refused by name (an
// enum-typed field would make these loads undefined behaviour, which UBSan reports).
TEST(Abi, OutOfRangeEnumValuesAreRefused) {
  forge_hparams hp;
  ASSERT_EQ(forge_hparams_default(FORGE_RULE_ADAMW, &hp), FORGE_OK);
  forge_state_layout l;
  for (int32_t bad : {-1, FORGE_RULE_COUNT, INT32_MAX, INT32_MIN}) {
    forge_hparams h = hp;
    h.rule = bad;
    EXPECT_EQ(forge_state_layout_query(&h, FORGE_STATE_FP32, 1, 1, &l), FORGE_ERR_INVALID_ARGUMENT);
    EXPECT_NE(std::string(forge_last_error()).find("hparams.rule"), std::string::npos);
    EXPECT_EQ(forge_state_layout_query(&hp, bad, 1, 1, &l), FORGE_ERR_INVALID_ARGUMENT);
    EXPECT_NE(std::string(forge_last_error()).find("state_format"), std::string::npos);
    EXPECT_EQ(forge_hparams_default(bad, &h), FORGE_ERR_INVALID_ARGUMENT);
    EXPECT_NE(std::string(forge_last_error()).find("rule"), std::string::npos);
  }
}

}  // namespace
}  // namespace forge_test

namespace forge_test {
namespace {

// A shard placement refused near the top of int64: the message gives the offending numbers as
// they are (no sum that wraps: signed overflow is undefined behaviour, which the sanitizer build
// stops at), naming the field, and nothing is written. Both step entry points.
TEST(BadInput, ShardPlacementNearInt64MaxIsRefusedWithoutOverflow) {
  Rng rng(fresh_seed());
  const forge_hparams hp = adamw();
  HostParam p(9, 70, FORGE_WEIGHT_FP32, FORGE_STATE_FP32, hp);
  p.randomize(rng, hp);
  p.p.col_offset = INT64_MAX - 5;
  p.p.full_cols = INT64_MAX;
  std::vector<float> grad(p.size(), 0.5f);
  const Matrix x = random_matrix(rng, 5, 70, 70, FORGE_DTYPE_FP32);
  const Matrix dy = random_matrix(rng, 5, 9, 9, FORGE_DTYPE_FP32);
  const std::vector<uint8_t> before = p.snapshot();
  for (int entry = 0; entry < 2; ++entry) {
    SCOPED_TRACE(entry ? "forge_wgrad_step" : "forge_elementwise_step");
    const forge_elementwise_args e = elementwise_args(p, hp, grad);
    const forge_wgrad_args w = wgrad_args(p, hp, x, dy);
    EXPECT_EQ(entry ? forge_wgrad_step(&w) : forge_elementwise_step(&e), FORGE_ERR_INVALID_ARGUMENT);
    const std::string message = forge_last_error();
    EXPECT_NE(message.find("param.full_cols"), std::string::npos) << message;
    EXPECT_NE(message.find("9223372036854775802"), std::string::npos) << message;  // col_offset
    EXPECT_EQ(message.find("-9223372036854775"), std::string::npos) << "a sum wrapped: " << message;
    EXPECT_EQ(p.snapshot(), before);
  }
}

}  // namespace
}  // namespace forge_test

namespace forge_test {
namespace {

// An int8 / fp8 block's absmax that no step stores (NaN, infinite, negative, above the largest
// bf16), put there through the ABI: a CPU step refuses it, naming the array and the block,
// and writes nothing (a NaN absmax made an int8 block skip every element forever, and an fp8
// one reset to 0). The fused, element-wise and batched steps alike.
TEST(BadInput, AbsmaxNoStepStoresIsRefused) {
  Rng rng(fresh_seed());
  const forge_hparams hp = adamw();
  for (forge_state_format sf : {FORGE_STATE_INT8_BLOCK64, FORGE_STATE_FP8_BLOCK64})
    for (float bad : {NAN, -NAN, INFINITY, -INFINITY, -1.0f, -1e-30f, 3.4e38f}) {
      SCOPED_TRACE(::testing::Message() << state_format_name(sf) << " absmax " << bad);
      HostParam p(3, 130, FORGE_WEIGHT_BF16, sf, hp);
      p.randomize(rng, hp);
      std::vector<float> grad(p.size());
      for (float& g : grad) g = rng.normal(1.0f);
      {  // states with values: every absmax a real one
        const forge_elementwise_args a = elementwise_args(p, hp, grad);
        ASSERT_EQ(forge_elementwise_step(&a), FORGE_OK) << forge_last_error();
      }
      std::memcpy(p.absmax[1].data() + 4 * 7, &bad, 4);  // row 2, block 1 of 3
      const Matrix x = random_matrix(rng, 4, 130, 130, FORGE_DTYPE_FP32);
      const Matrix dy = random_matrix(rng, 4, 3, 3, FORGE_DTYPE_FP32);
      double sq = 0.5;
      int64_t count = 3;
      const std::vector<uint8_t> before = p.snapshot();
      for (int entry = 0; entry < 3; ++entry) {
        forge_elementwise_args e = elementwise_args(p, hp, grad);
        e.outputs = {&sq, &count};
        forge_wgrad_args w = wgrad_args(p, hp, x, dy);
        w.outputs = {&sq, &count};
        const forge_elementwise_args* batch[] = {&e};
        const forge_status status = entry == 0   ? forge_elementwise_step(&e)
                                    : entry == 1 ? forge_wgrad_step(&w)
                                                 : forge_elementwise_step_batch(batch, 1);
        EXPECT_EQ(status, FORGE_ERR_INVALID_ARGUMENT) << "entry point " << entry;
        const std::string message = forge_last_error();
        EXPECT_NE(message.find("param.state_absmax[1][7]"), std::string::npos) << message;
        EXPECT_EQ(p.snapshot(), before);
        EXPECT_EQ(sq, 0.5);
        EXPECT_EQ(count, 3);
      }
    }
  // -0 and 0 are absmax values a step stores (an all-zero block)
  HostParam p(1, 64, FORGE_WEIGHT_FP32, FORGE_STATE_FP8_BLOCK64, hp);
  const float minus_zero = -0.0f;
  std::memcpy(p.absmax[0].data(), &minus_zero, 4);
  std::vector<float> grad(64, 0.25f);
  const forge_elementwise_args a = elementwise_args(p, hp, grad);
  EXPECT_EQ(forge_elementwise_step(&a), FORGE_OK) << forge_last_error();
}

}  // namespace
}  // namespace forge_test
