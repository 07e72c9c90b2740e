// fuzz_capi.cpp — a seeded property test of the C ABI (ctest label "fuzz"; run instrumented by
// the sanitizer build, where any report ends the run).
//  (a) Random valid calls: a random rule, hyper-parameters, weight and state formats, shape
//      (1, 17, 63, 64, 65, 129 or anything up to 130 each way), 1..40 tokens, strides, input
//      dtypes, tiles, threads, a filled run_scalars buffer or none, and inputs that sometimes
//      hold NaN, infinities or huge values: forge_wgrad_step must give the bits of the
//      reference (dW summed on the host in the same token order, then forge_elementwise_step
//      on a copy), the same count of skipped elements and the same Σ g² (to rounding).
//  (b) Random invalid calls: a valid call with one thing corrupted (a NULL, a size, an enum,
//      a hyper-parameter, an overlap, a misalignment, a run_scalars buffer): an error, a
//      message naming what was corrupted, and every buffer the call could write unchanged
//      (the outputs poisoned beforehand).
// Seeds are deterministic: case i uses seed FORGE_FUZZ_SEED + i (default 1); the counts
// FORGE_FUZZ_VALID and FORGE_FUZZ_INVALID set the budget (the defaults below are what CI runs;
// from 4 draws per corruption on, every corruption must have been drawn). A failure prints
// its seed; FORGE_FUZZ_SEED=<seed> FORGE_FUZZ_VALID=1 replays it.
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "block_copy.h"
#include "test_util.h"
#include "tolerances.h"

namespace forge_test {
namespace {

int64_t env_int(const char* name, int64_t fallback) {
  const char* v = std::getenv(name);
  return v ? std::strtoll(v, nullptr, 10) : fallback;
}
uint64_t base_seed() { return static_cast<uint64_t>(env_int("FORGE_FUZZ_SEED", 1)); }

struct alignas(16) RunBuffer {
  unsigned char bytes[FORGE_RUN_SCALARS_BYTES];
};

// ---- random valid calls ---------------------------------------------------------------------

int pick(Rng& rng, std::initializer_list<int> values) {
  const int i = rng.integer(0, static_cast<int>(values.size()) - 1);
  return *(values.begin() + i);
}
double log_uniform(Rng& rng, double lo, double hi) {
  return std::exp(std::log(lo) + (std::log(hi) - std::log(lo)) * rng.uniform(0.0f, 1.0f));
}
int64_t dimension(Rng& rng) {
  return rng.integer(0, 2) ? pick(rng, {1, 17, 63, 64, 65, 129}) : rng.integer(1, 130);
}

forge_hparams random_hparams(Rng& rng) {
  const int rule = rng.integer(0, FORGE_RULE_COUNT - 1);
  forge_hparams hp;
  forge_hparams_default(rule, &hp);
  hp.lr = rng.integer(0, 9) ? log_uniform(rng, 1e-4, 0.5) : 0.0;
  hp.weight_decay = rng.integer(0, 2) ? log_uniform(rng, 1e-3, 0.5) : 0.0;
  hp.decoupled_weight_decay = rng.integer(0, 1);
  hp.maximize = rng.integer(0, 3) == 0;
  hp.beta1 = rng.integer(0, 5) ? rng.uniform(0.0f, 0.99f) : 0.0;
  hp.beta2 = rng.integer(0, 5) ? rng.uniform(0.5f, 0.9999f) : 0.0;
  hp.eps = log_uniform(rng, 1e-10, 1e-2);
  hp.momentum_decay = rng.integer(0, 3) ? rng.uniform(0.0f, 0.01f) : 0.0;
  hp.alpha = rng.uniform(0.0f, 0.99f);
  hp.centered = rng.integer(0, 1);
  hp.lr_decay = rng.integer(0, 1) ? rng.uniform(0.0f, 0.1f) : 0.0;
  hp.initial_accumulator_value = rng.integer(0, 1) ? rng.uniform(0.0f, 1.0f) : 0.0;
  hp.grad_scale = pick(rng, {1, 2, 3, 4}) == 1 ? 1.0 : rng.integer(0, 1) ? 0.5 : 1.0 / 1024;
  hp.seed = rng.gen();
  hp.nesterov = 0;
  hp.dampening = 0;
  hp.momentum = 0;
  if (rule == FORGE_RULE_SGD_MOMENTUM) {
    hp.momentum = rng.uniform(0.05f, 0.99f);
    hp.nesterov = rng.integer(0, 1);
    hp.dampening = hp.nesterov ? 0.0 : rng.uniform(0.0f, 1.0f);
  } else if (rule == FORGE_RULE_RMSPROP && rng.integer(0, 1)) {
    hp.momentum = rng.uniform(0.1f, 0.9f);
  } else if (rule == FORGE_RULE_MUON) {
    // [0, 1] closed; a dampening Muon does not read (SGD's nesterov would refuse it)
    hp.momentum = rng.integer(0, 5) ? rng.uniform(0.0f, 0.99f) : pick(rng, {0, 1});
    hp.nesterov = rng.integer(0, 1);
    hp.dampening = rng.integer(0, 1) ? rng.uniform(0.0f, 1.0f) : 0.0;
  }
  const int step_kind = rng.integer(0, 9);
  hp.step = step_kind < 3 ? step_kind + 1
            : step_kind < 9 ? rng.integer(1, 1000000)
                            : static_cast<int64_t>(rng.gen() >> 2) + 1;
  return hp;
}

// Inputs mostly O(1), sometimes with a NaN, an infinity or a value whose products overflow
// g² (the skip paths).
Matrix random_input(Rng& rng, int64_t tokens, int64_t cols, int64_t ld, int dtype, float sd) {
  Matrix m = random_matrix(rng, tokens, cols, ld, static_cast<forge_dtype>(dtype), sd);
  const int specials = rng.integer(0, 5) == 0 ? rng.integer(1, 3) : 0;
  for (int i = 0; i < specials; ++i) {
    const float special[] = {NAN, INFINITY, -INFINITY, 1e19f, 0.0f};
    m.set(rng.integer(0, static_cast<int>(tokens) - 1), rng.integer(0, static_cast<int>(cols) - 1),
          special[rng.integer(0, 4)]);
  }
  return m;
}

// Valid states from fp32 values: first moments signed, second moments non-negative.
void random_states(Rng& rng, HostParam& p, const forge_hparams& hp) {
  forge_state_layout layout;
  ASSERT_EQ(forge_state_layout_query(&hp, p.p.state_format, p.p.rows, p.p.cols, &layout), FORGE_OK);
  const forge_device cpu{};
  for (int i = 0; i < layout.num_states; ++i) {
    std::vector<float> v(p.size());
    for (float& x : v) x = layout.is_signed[i] ? rng.normal(0.1f) : std::fabs(rng.normal(0.01f));
    ASSERT_EQ(forge_state_from_fp32(&p.p, &hp, i, v.data(), cpu), FORGE_OK) << forge_last_error();
  }
}

struct ValidCall {
  forge_hparams hp;
  int weight_format, state_format;
  int64_t rows, cols, tokens;
  int x_dtype, dy_dtype;
  int64_t ldx, lddy;
  int tile_rows, tile_cols, threads;
  bool use_run;
  int64_t row_offset, col_offset, full_cols;  // a shard's place (forge_param), or 0, 0, 0
};

ValidCall random_call(Rng& rng) {
  ValidCall c;
  c.hp = random_hparams(rng);
  c.weight_format = rng.integer(0, FORGE_WEIGHT_FORMAT_COUNT - 1);
  c.state_format = rng.integer(0, FORGE_STATE_FORMAT_COUNT - 1);
  c.rows = dimension(rng);
  c.cols = dimension(rng);
  c.tokens = rng.integer(1, 40);
  c.x_dtype = rng.integer(0, 2);
  c.dy_dtype = rng.integer(0, 2);
  c.ldx = c.cols + (rng.integer(0, 1) ? rng.integer(0, 5) : 0);
  c.lddy = c.rows + (rng.integer(0, 1) ? rng.integer(0, 5) : 0);
  c.tile_rows = rng.integer(0, 1) ? 0 : rng.integer(1, 70);
  c.tile_cols = rng.integer(0, 1) ? 0
                : block_states(c.state_format) ? 64 * rng.integer(1, 3)
                                                             : rng.integer(1, 200);
  c.threads = rng.integer(0, 3);
  c.use_run = rng.integer(0, 3) == 0;
  // A third of the calls update a shard: rows of a taller parameter, or columns of a wider one
  // (int8 / fp8: starting on a block of 64, and ending on one or at the row's end).
  c.row_offset = c.col_offset = c.full_cols = 0;
  const int shard = rng.integer(0, 5);
  if (shard == 1) {
    c.row_offset = rng.integer(0, 1000);
    c.full_cols = c.cols;
  } else if (shard == 2) {
    c.row_offset = rng.integer(0, 3) ? 0 : rng.integer(1, 50);
    const bool blocks = block_states(c.state_format);
    c.col_offset = blocks ? 64 * rng.integer(0, 3) : rng.integer(0, 200);
    const int64_t end = c.col_offset + c.cols;
    c.full_cols = blocks && end % 64 != 0 ? end : end + (rng.integer(0, 1) ? 0 : 64 * rng.integer(1, 3));
  }
  return c;
}

TEST(FuzzCapi, ValidCallsMatchTheUnfusedReference) {
  const int64_t count = env_int("FORGE_FUZZ_VALID", 1000);
  int64_t skipped_total = 0, with_run = 0, shards = 0;
  for (int64_t i = 0; i < count; ++i) {
    const uint64_t seed = base_seed() + static_cast<uint64_t>(i);
    SCOPED_TRACE("FORGE_FUZZ_SEED=" + std::to_string(seed));
    Rng rng(seed);
    const ValidCall c = random_call(rng);
    forge_hparams hp = c.hp;
    SCOPED_TRACE(::testing::Message()
                 << "rule " << hp.rule << " step " << hp.step << " " << weight_format_name(c.weight_format)
                 << " " << state_format_name(c.state_format) << " " << c.rows << "x" << c.cols
                 << " T=" << c.tokens << " dtypes " << c.x_dtype << "/" << c.dy_dtype << " tiles "
                 << c.tile_rows << "x" << c.tile_cols << " threads " << c.threads
                 << (c.use_run ? " run_scalars" : "") << " shard at " << c.row_offset << ", "
                 << c.col_offset << " of " << c.full_cols << " columns");
    HostParam fused(c.rows, c.cols, static_cast<forge_weight_format>(c.weight_format),
                    static_cast<forge_state_format>(c.state_format), hp);
    fused.p.row_offset = c.row_offset;
    fused.p.col_offset = c.col_offset;
    fused.p.full_cols = c.full_cols;
    for (int64_t e = 0; e < fused.size(); ++e) fused.set_w(e, rng.normal(0.5f));
    random_states(rng, fused, hp);
    HostParam unfused(fused);
    const Matrix x = random_input(rng, c.tokens, c.cols, c.ldx, c.x_dtype, 1.0f);
    const Matrix dy = random_input(rng, c.tokens, c.rows, c.lddy, c.dy_dtype, 0.1f);
    RunBuffer run;
    if (c.use_run) {
      ASSERT_EQ(forge_run_scalars_fill(&hp, run.bytes, sizeof(run.bytes)), FORGE_OK) << forge_last_error();
      hp.step = 1 + static_cast<int64_t>(rng.gen() % 1000);  // the call's own: stale
      hp.lr = hp.lr * 2 + 1e-3;
      hp.seed = rng.gen();
      hp.run_scalars = run.bytes;
      ++with_run;
    }
    double sq_fused = 0, sq_ref = 0;
    int64_t n_fused = 0, n_ref = 0;
    forge_wgrad_args a = wgrad_args(fused, hp, x, dy);
    a.tile_rows = c.tile_rows;
    a.tile_cols = c.tile_cols;
    a.device.num_threads = c.threads;
    a.outputs = {&sq_fused, &n_fused};
    ASSERT_EQ(forge_wgrad_step(&a), FORGE_OK) << forge_last_error();
    const std::vector<float> dw = reference_dw(x, dy);
    forge_elementwise_args e = elementwise_args(unfused, hp, dw);
    e.device.num_threads = c.threads;
    e.outputs = {&sq_ref, &n_ref};
    ASSERT_EQ(forge_elementwise_step(&e), FORGE_OK) << forge_last_error();
    ASSERT_EQ(fused.snapshot(), unfused.snapshot()) << "fused and unfused bits differ";
    ASSERT_EQ(n_fused, n_ref);
    ASSERT_NEAR(sq_fused, sq_ref, kGradSqSumRel * sq_ref);
    skipped_total += n_fused;
    shards += c.full_cols != 0;
  }
  // The budget exercised what it is meant to.
  if (count >= 100) {
    EXPECT_GT(skipped_total, 0);
    EXPECT_GT(with_run, 0);
    EXPECT_GT(shards, 0);
  }
}

// ---- random invalid calls -------------------------------------------------------------------

// A valid fused call over host buffers, plus everything a corruption may point into.
struct Scene {
  forge_hparams hp;
  HostParam param;
  Matrix x, dy;
  std::vector<float> grad;
  std::vector<float> fp32;  // an fp32 [rows, cols] for the state entry points
  double sq = 1.25;
  int64_t count = 0x5A5A5A5A5A5A;
  RunBuffer run;
  forge_wgrad_args wgrad;
  forge_elementwise_args elementwise;

  Scene(Rng& rng, const ValidCall& c)
      : hp(c.hp),
        param(c.rows, c.cols, static_cast<forge_weight_format>(c.weight_format),
              static_cast<forge_state_format>(c.state_format), c.hp),
        x(random_matrix(rng, c.tokens, c.cols, c.ldx, static_cast<forge_dtype>(c.x_dtype))),
        dy(random_matrix(rng, c.tokens, c.rows, c.lddy, static_cast<forge_dtype>(c.dy_dtype))),
        grad(c.rows * c.cols, 0.5f),
        fp32(c.rows * c.cols, 0.25f) {
    for (int64_t e = 0; e < param.size(); ++e) param.set_w(e, rng.normal(0.5f));
    random_states(rng, param, hp);
    std::memset(run.bytes, 0, sizeof(run.bytes));
    wgrad = wgrad_args(param, hp, x, dy);
    wgrad.tile_rows = c.tile_rows;
    wgrad.tile_cols = c.tile_cols;
    wgrad.device.num_threads = c.threads;
    wgrad.outputs = {&sq, &count};
    elementwise = elementwise_args(param, hp, grad);
    elementwise.outputs = {&sq, &count};
  }
  // Everything a call may write: the parameter, the outputs, the fp32 buffer.
  std::vector<uint8_t> snapshot() const {
    std::vector<uint8_t> all = param.snapshot();
    const uint8_t* b = reinterpret_cast<const uint8_t*>(&sq);
    all.insert(all.end(), b, b + 8);
    b = reinterpret_cast<const uint8_t*>(&count);
    all.insert(all.end(), b, b + 8);
    b = reinterpret_cast<const uint8_t*>(fp32.data());
    all.insert(all.end(), b, b + 4 * fp32.size());
    return all;
  }
  int num_states() const { return param.num_states; }
  bool has_blocks() const { return block_states(param.p.state_format); }  // int8 / fp8
};

enum Entry { kWgrad, kElementwise, kStateInit, kToFp32, kFromFp32, kLayout, kFill };

struct Corruption {
  const char* what;
  Entry entry;
  // Returns false when it does not apply to this scene (then another is drawn); sets the
  // substring the message must contain.
  std::function<bool(Scene&, Rng&, std::string& expect)> apply;
};

forge_status call(Scene& s, Entry entry, int32_t index, const forge_param* param,
                  const forge_hparams* hp, const float* buffer) {
  const forge_device cpu{};
  forge_state_layout layout;
  switch (entry) {
    case kWgrad: return forge_wgrad_step(&s.wgrad);
    case kElementwise: return forge_elementwise_step(&s.elementwise);
    case kStateInit: return forge_state_init(param, hp, cpu);
    case kToFp32: return forge_state_to_fp32(param, hp, index, const_cast<float*>(buffer), cpu);
    case kFromFp32: return forge_state_from_fp32(param, hp, index, buffer, cpu);
    case kLayout: return forge_state_layout_query(hp, s.param.p.state_format, s.param.p.rows, s.param.p.cols, &layout);
    default: return forge_run_scalars_fill(hp, s.run.bytes, sizeof(s.run.bytes));
  }
}

uint8_t* bytes_of(void* p) { return static_cast<uint8_t*>(p); }

std::vector<Corruption> corruptions() {
  using S = Scene;
  auto hp_field = [](const char* name, std::function<void(forge_hparams&)> set) {
    return [name, set](S& s, Rng&, std::string& expect) {
      set(s.wgrad.hparams);
      expect = std::string("hparams.") + name;
      return true;
    };
  };
  auto reads = [](const forge_hparams& hp, const char* field) {
    forge_rule_info info;
    forge_rule_query(hp.rule, &info);
    for (int i = 0; i < info.num_fields; ++i)
      if (std::strcmp(info.fields[i], field) == 0) return true;
    return false;
  };
  std::vector<Corruption> c = {
      {"abi_version", kWgrad, [](S& s, Rng& r, std::string& e) { s.wgrad.abi_version = pick(r, {0, FORGE_ABI_VERSION - 1, FORGE_ABI_VERSION + 1, -1}); e = "args.abi_version"; return true; }},
      {"device.kind", kWgrad, [](S& s, Rng& r, std::string& e) { s.wgrad.device.kind = pick(r, {-1, 2, 1000, INT32_MIN}); e = "device.kind"; return true; }},
      {"num_threads", kWgrad, [](S& s, Rng& r, std::string& e) { s.wgrad.device.num_threads = pick(r, {-1, FORGE_MAX_CPU_THREADS + 1, INT32_MAX}); e = "device.num_threads"; return true; }},
      {"tokens", kWgrad, [](S& s, Rng& r, std::string& e) { s.wgrad.tokens = pick(r, {0, -1, INT32_MIN}); e = "tokens"; return true; }},
      {"tokens_overflow", kWgrad, [](S& s, Rng&, std::string& e) { s.wgrad.tokens = int64_t(1) << 40; s.wgrad.ldx = int64_t(1) << 40; e = "ldx"; return true; }},
      {"x_null", kWgrad, [](S& s, Rng&, std::string& e) { s.wgrad.x = nullptr; e = "x: NULL"; return true; }},
      {"dy_null", kWgrad, [](S& s, Rng&, std::string& e) { s.wgrad.dy = nullptr; e = "dy: NULL"; return true; }},
      {"x_dtype", kWgrad, [](S& s, Rng& r, std::string& e) { s.wgrad.x_dtype = pick(r, {3, -1, 77, INT32_MAX}); e = "x_dtype"; return true; }},
      {"dy_dtype", kWgrad, [](S& s, Rng& r, std::string& e) { s.wgrad.dy_dtype = pick(r, {3, -2, INT32_MIN}); e = "dy_dtype"; return true; }},
      {"ldx", kWgrad, [](S& s, Rng&, std::string& e) { s.wgrad.ldx = s.wgrad.param.cols - 1; e = "ldx"; return true; }},
      {"lddy", kWgrad, [](S& s, Rng&, std::string& e) { s.wgrad.lddy = -5; e = "lddy"; return true; }},
      {"rows", kWgrad, [](S& s, Rng& r, std::string& e) { s.wgrad.param.rows = pick(r, {0, -1}); e = "param.rows"; return true; }},
      {"cols", kWgrad, [](S& s, Rng& r, std::string& e) { s.wgrad.param.cols = pick(r, {0, -64}); e = "param.cols"; return true; }},
      {"rows_cols_overflow", kWgrad, [](S& s, Rng&, std::string& e) { s.wgrad.param.rows = int64_t(1) << 31; s.wgrad.param.cols = int64_t(1) << 31; e = "param.rows"; return true; }},
      {"weight_format", kWgrad, [](S& s, Rng& r, std::string& e) { s.wgrad.param.weight_format = pick(r, {4, -1, 99}); e = "param.weight_format"; return true; }},
      {"state_format", kWgrad, [](S& s, Rng& r, std::string& e) { s.wgrad.param.state_format = pick(r, {FORGE_STATE_FORMAT_COUNT, -1, 1 << 20}); e = "param.state_format"; return true; }},
      {"weight_null", kWgrad, [](S& s, Rng&, std::string& e) { s.wgrad.param.weight = nullptr; e = "param.weight"; return true; }},
      {"state_null", kWgrad, [](S& s, Rng& r, std::string& e) {
         if (s.num_states() == 0) return false;
         const int i = r.integer(0, s.num_states() - 1);
         s.wgrad.param.state[i] = nullptr; e = "param.state[" + std::to_string(i) + "]"; return true; }},
      {"absmax_null", kWgrad, [](S& s, Rng&, std::string& e) {
         if (s.num_states() == 0 || !s.has_blocks()) return false;
         s.wgrad.param.state_absmax[0] = nullptr; e = "param.state_absmax[0]"; return true; }},
      {"master", kWgrad, [](S& s, Rng&, std::string& e) {
         if (s.wgrad.param.weight_format == FORGE_WEIGHT_BF16_MASTER) s.wgrad.param.master = nullptr;
         else s.wgrad.param.master = reinterpret_cast<float*>(s.fp32.data());
         e = "param.master"; return true; }},
      {"tile_rows", kWgrad, [](S& s, Rng& r, std::string& e) { s.wgrad.tile_rows = pick(r, {-1, FORGE_MAX_TILE + 1, INT32_MAX}); e = "tile_rows"; return true; }},
      {"tile_cols", kWgrad, [](S& s, Rng& r, std::string& e) { s.wgrad.tile_cols = s.has_blocks() ? pick(r, {32, 96, -64}) : pick(r, {-1, FORGE_MAX_TILE + 1}); e = "tile_cols"; return true; }},
      {"hp.abi", kWgrad, hp_field("abi_version", [](forge_hparams& h) { h.abi_version = FORGE_ABI_VERSION - 1; })},
      {"hp.rule", kWgrad, hp_field("rule", [](forge_hparams& h) { h.rule = FORGE_RULE_COUNT; })},
      {"hp.step", kWgrad, hp_field("step", [](forge_hparams& h) { h.step = 0; })},
      {"hp.lr_nan", kWgrad, hp_field("lr", [](forge_hparams& h) { h.lr = NAN; })},
      {"hp.lr_negative", kWgrad, hp_field("lr", [](forge_hparams& h) { h.lr = -1e-3; })},
      {"hp.lr_huge", kWgrad, [reads](S& s, Rng&, std::string& e) {
         // (finite in double: refused for the fp32 scalars of a rule that reads lr)
         if (!reads(s.wgrad.hparams, "lr")) return false;
         s.wgrad.hparams.lr = 1e39; e = "hparams.lr"; return true; }},
      {"hp.weight_decay", kWgrad, hp_field("weight_decay", [](forge_hparams& h) { h.weight_decay = -1; })},
      {"hp.grad_scale_zero", kWgrad, hp_field("grad_scale", [](forge_hparams& h) { h.grad_scale = 0; })},
      {"hp.grad_scale_tiny", kWgrad, hp_field("grad_scale", [](forge_hparams& h) { h.grad_scale = 1e-50; })},
      {"hp.grad_scale_huge", kWgrad, hp_field("grad_scale", [](forge_hparams& h) { h.grad_scale = 1e39; })},
      {"hp.unread_nan", kWgrad, [reads](S& s, Rng&, std::string& e) {
         if (reads(s.wgrad.hparams, "lr_decay")) return false;
         s.wgrad.hparams.lr_decay = NAN; e = "hparams.lr_decay"; return true; }},
      {"hp.beta1", kWgrad, [reads](S& s, Rng&, std::string& e) {
         if (!reads(s.wgrad.hparams, "beta1")) return false;
         s.wgrad.hparams.beta1 = 1.0; e = "hparams.beta1"; return true; }},
      {"hp.beta2", kWgrad, [reads](S& s, Rng&, std::string& e) {
         if (!reads(s.wgrad.hparams, "beta2")) return false;
         s.wgrad.hparams.beta2 = NAN; e = "hparams.beta2"; return true; }},
      {"hp.eps", kWgrad, [reads](S& s, Rng& r, std::string& e) {
         if (!reads(s.wgrad.hparams, "eps")) return false;
         s.wgrad.hparams.eps = r.integer(0, 1) ? 0.0 : 1e-50; e = "hparams.eps"; return true; }},
      {"hp.alpha", kWgrad, [reads](S& s, Rng&, std::string& e) {
         if (!reads(s.wgrad.hparams, "alpha")) return false;
         s.wgrad.hparams.alpha = 1.5; e = "hparams.alpha"; return true; }},
      {"hp.momentum", kWgrad, [](S& s, Rng& rng, std::string& e) {
         const int r = s.wgrad.hparams.rule;
         if (r != FORGE_RULE_SGD && r != FORGE_RULE_SGD_MOMENTUM && r != FORGE_RULE_RMSPROP &&
             r != FORGE_RULE_MUON) return false;
         s.wgrad.hparams.momentum = r == FORGE_RULE_SGD ? 0.5
                                    : r == FORGE_RULE_MUON ? (rng.integer(0, 1) ? 1.5 : -0.25)  // [0, 1]
                                                           : 1.0;
         e = "hparams.momentum"; return true; }},
      {"hp.lr_decay", kWgrad, [reads](S& s, Rng&, std::string& e) {
         if (!reads(s.wgrad.hparams, "lr_decay")) return false;
         s.wgrad.hparams.lr_decay = -0.5; e = "hparams.lr_decay"; return true; }},
      {"overlap_states", kWgrad, [](S& s, Rng& r, std::string& e) {
         if (s.num_states() < 2) return false;
         // (8 bytes in only where state[0] is longer than that: 16 elements, 16 bytes at least)
         const bool inside = s.param.size() >= 16 && r.integer(0, 1);
         s.wgrad.param.state[1] = bytes_of(s.wgrad.param.state[0]) + (inside ? 8 : 0); e = "param.state[1]"; return true; }},
      {"overlap_weight_state", kWgrad, [](S& s, Rng&, std::string& e) {
         if (s.num_states() == 0) return false;
         // (the weight moved there may also reach the next buffer, a master say: the message
         // names the first overlap found, with the weight in it)
         s.wgrad.param.weight = s.wgrad.param.state[0]; e = "overlaps param.weight"; return true; }},
      {"overlap_absmax", kWgrad, [](S& s, Rng&, std::string& e) {
         if (s.num_states() < 2 || !s.has_blocks()) return false;
         s.wgrad.param.state_absmax[1] = s.wgrad.param.state_absmax[0]; e = "param.state_absmax[1]"; return true; }},
      {"overlap_x_written", kWgrad, [](S& s, Rng&, std::string& e) { s.wgrad.x = s.wgrad.param.weight; e = "x"; return true; }},
      {"overlap_dy_written", kWgrad, [](S& s, Rng&, std::string& e) {
         if (s.num_states() == 0) return false;
         s.wgrad.dy = s.wgrad.param.state[s.num_states() - 1]; e = "dy"; return true; }},
      {"overlap_outputs", kWgrad, [](S& s, Rng&, std::string& e) {
         s.wgrad.outputs.nonfinite_count = reinterpret_cast<int64_t*>(s.wgrad.outputs.grad_sq_sum); e = "outputs.nonfinite_count"; return true; }},
      {"overlap_output_weight", kWgrad, [](S& s, Rng&, std::string& e) {
         s.wgrad.outputs.grad_sq_sum = reinterpret_cast<double*>(s.wgrad.param.weight); e = "outputs.grad_sq_sum"; return true; }},
      {"misaligned_weight", kWgrad, [](S& s, Rng&, std::string& e) {
         s.wgrad.param.weight = bytes_of(s.wgrad.param.weight) + 1; e = "param.weight"; return true; }},
      {"misaligned_absmax", kWgrad, [](S& s, Rng&, std::string& e) {
         if (s.num_states() == 0 || !s.has_blocks()) return false;
         s.wgrad.param.state_absmax[0] = reinterpret_cast<float*>(bytes_of(s.wgrad.param.state_absmax[0]) + 2); e = "param.state_absmax[0]"; return true; }},
      {"misaligned_output", kWgrad, [](S& s, Rng&, std::string& e) {
         s.wgrad.outputs.grad_sq_sum = reinterpret_cast<double*>(s.fp32.data() + 1); e = "outputs.grad_sq_sum"; return true; }},
      {"misaligned_x", kWgrad, [](S& s, Rng&, std::string& e) { s.wgrad.x = bytes_of(const_cast<void*>(s.wgrad.x)) + 1; e = "x"; return true; }},
      {"run_misaligned", kWgrad, [](S& s, Rng&, std::string& e) { s.wgrad.hparams.run_scalars = s.run.bytes + 8; e = "hparams.run_scalars"; return true; }},
      {"run_unfilled", kWgrad, [](S& s, Rng&, std::string& e) { s.wgrad.hparams.run_scalars = s.run.bytes; e = "hparams.run_scalars"; return true; }},
      {"run_other_rule", kWgrad, [](S& s, Rng&, std::string& e) {
         forge_hparams other;
         forge_hparams_default((s.hp.rule + 1) % FORGE_RULE_COUNT, &other);
         if (forge_run_scalars_fill(&other, s.run.bytes, sizeof(s.run.bytes)) != FORGE_OK) return false;
         s.wgrad.hparams.run_scalars = s.run.bytes; e = "hparams.run_scalars"; return true; }},
      {"run_other_hparams", kWgrad, [](S& s, Rng&, std::string& e) {
         forge_hparams other = s.hp;
         other.weight_decay = other.weight_decay * 0.5 + 0.01;
         if (forge_run_scalars_fill(&other, s.run.bytes, sizeof(s.run.bytes)) != FORGE_OK) return false;
         s.wgrad.hparams.run_scalars = s.run.bytes; e = "hparams.run_scalars"; return true; }},
      {"run_corrupted", kWgrad, [](S& s, Rng& r, std::string& e) {
         if (forge_run_scalars_fill(&s.hp, s.run.bytes, sizeof(s.run.bytes)) != FORGE_OK) return false;
         s.run.bytes[r.integer(0, FORGE_RUN_SCALARS_BYTES - 1)] ^= static_cast<unsigned char>(1 << r.integer(0, 7));
         s.wgrad.hparams.run_scalars = s.run.bytes; e = "hparams.run_scalars"; return true; }},
      // shard placements (forge_param's row_offset, col_offset, full_cols)
      {"shard_row_offset", kWgrad, [](S& s, Rng& r, std::string& e) {
         s.wgrad.param.row_offset = pick(r, {-1, INT32_MIN}); s.wgrad.param.full_cols = s.wgrad.param.cols; e = "param.row_offset"; return true; }},
      {"shard_col_offset", kWgrad, [](S& s, Rng&, std::string& e) {
         s.wgrad.param.col_offset = -64; s.wgrad.param.full_cols = s.wgrad.param.cols + 128; e = "param.col_offset"; return true; }},
      {"shard_full_cols", kWgrad, [](S& s, Rng& r, std::string& e) {
         const int64_t cols = s.wgrad.param.cols;
         s.wgrad.param.full_cols = r.integer(0, 1) || cols == 1 ? -1 : cols - 1; e = "param.full_cols"; return true; }},
      {"shard_offsets_without_full_cols", kWgrad, [](S& s, Rng& r, std::string& e) {
         if (r.integer(0, 1)) s.wgrad.param.row_offset = 3; else s.wgrad.param.col_offset = 64;
         e = "param.full_cols"; return true; }},
      {"shard_past_full_cols", kWgrad, [](S& s, Rng&, std::string& e) {
         s.wgrad.param.col_offset = 64; s.wgrad.param.full_cols = s.wgrad.param.cols + 63; e = "param.full_cols"; return true; }},
      {"shard_indices_overflow", kWgrad, [](S& s, Rng&, std::string& e) {
         s.wgrad.param.row_offset = int64_t(1) << 61; s.wgrad.param.full_cols = s.wgrad.param.cols; e = "param.row_offset"; return true; }},
      {"shard_int8_col_offset", kWgrad, [](S& s, Rng& r, std::string& e) {
         if (!s.has_blocks()) return false;
         s.wgrad.param.col_offset = 64 * r.integer(0, 2) + r.integer(1, 63);
         s.wgrad.param.full_cols = s.wgrad.param.col_offset + s.wgrad.param.cols; e = "param.col_offset"; return true; }},
      {"shard_int8_end", kWgrad, [](S& s, Rng&, std::string& e) {
         if (!s.has_blocks() || s.wgrad.param.cols % 64 == 0) return false;
         s.wgrad.param.full_cols = s.wgrad.param.cols + 1; e = "param.col_offset + param.cols"; return true; }},
      {"shard_elementwise", kElementwise, [](S& s, Rng&, std::string& e) {
         s.elementwise.param.full_cols = -5; e = "param.full_cols"; return true; }},
      {"shard_state_init", kStateInit, [](S& s, Rng&, std::string& e) {
         s.param.p.row_offset = 7; e = "param.full_cols"; return true; }},
      // the element-wise step
      {"grad_null", kElementwise, [](S& s, Rng&, std::string& e) { s.elementwise.grad = nullptr; e = "grad: NULL"; return true; }},
      {"grad_dtype", kElementwise, [](S& s, Rng& r, std::string& e) { s.elementwise.grad_dtype = pick(r, {3, -1}); e = "grad_dtype"; return true; }},
      {"grad_overlaps", kElementwise, [](S& s, Rng&, std::string& e) { s.elementwise.grad = s.elementwise.param.weight; e = "grad"; return true; }},
      {"elementwise_lr", kElementwise, [](S& s, Rng&, std::string& e) { s.elementwise.hparams.lr = INFINITY; e = "hparams.lr"; return true; }},
      // the state entry points (their own corruptions are in `index` / the buffer below)
      {"state_index", kToFp32, [](S& s, Rng&, std::string& e) { (void)s; e = "index"; return true; }},
      {"state_in_nan", kFromFp32, [](S& s, Rng& r, std::string& e) {
         if (s.num_states() == 0) return false;
         const int64_t i = r.integer(0, static_cast<int>(s.fp32.size()) - 1);
         s.fp32[i] = r.integer(0, 1) ? NAN : -INFINITY; e = "in[" + std::to_string(i) + "]"; return true; }},
      {"state_out_overlaps", kToFp32, [](S& s, Rng&, std::string& e) {
         if (s.num_states() == 0) return false;
         e = "out"; return true; }},
      {"init_overlap", kStateInit, [](S& s, Rng&, std::string& e) {
         if (s.num_states() < 2) return false;
         e = "param.state[1]"; return true; }},
      {"layout_overflow", kLayout, [](S&, Rng&, std::string& e) { e = "rows"; return true; }},
      {"fill_lr", kFill, [](S& s, Rng&, std::string& e) { s.hp.lr = -1; e = "hparams.lr"; return true; }},
  };
  return c;
}

TEST(FuzzCapi, InvalidCallsAreRefusedAndChangeNothing) {
  const int64_t count = env_int("FORGE_FUZZ_INVALID", 4000);
  const std::vector<Corruption> all = corruptions();
  std::vector<int> used(all.size(), 0);
  for (int64_t i = 0; i < count; ++i) {
    const uint64_t seed = base_seed() + 0x100000 + static_cast<uint64_t>(i);
    SCOPED_TRACE("FORGE_FUZZ_SEED=" + std::to_string(seed));
    Rng rng(seed);
    ValidCall c = random_call(rng);
    c.rows = std::min<int64_t>(c.rows, 40);  // small scenes: the refusals are the point
    c.tokens = std::min<int64_t>(c.tokens, 8);
    c.ldx = c.cols;
    c.lddy = c.rows;
    Scene s(rng, c);
    // one corruption that applies to this scene
    int k;
    std::string expect;
    for (;;) {
      k = rng.integer(0, static_cast<int>(all.size()) - 1);
      if (all[k].apply(s, rng, expect)) break;
    }
    ++used[k];
    const Corruption& bad = all[k];
    SCOPED_TRACE(std::string("corruption ") + bad.what);
    forge_param param = s.param.p;
    forge_hparams hp = s.hp;
    int32_t index = 0;
    const float* buffer = s.fp32.data();
    if (std::string(bad.what) == "state_index") index = pick(rng, {-1, s.num_states(), 1000});
    if (std::string(bad.what) == "state_out_overlaps") buffer = reinterpret_cast<const float*>(param.state[0]);
    if (std::string(bad.what) == "init_overlap") param.state[1] = param.state[0];
    if (std::string(bad.what) == "state_in_nan") index = 0;
    if (std::string(bad.what) == "layout_overflow") {
      const int64_t rows = s.param.p.rows, cols = s.param.p.cols;
      s.param.p.rows = int64_t(1) << 32;
      s.param.p.cols = int64_t(1) << 30;
      forge_state_layout layout;
      std::memset(&layout, 0x5A, sizeof(layout));
      const forge_state_layout before = layout;
      EXPECT_NE(forge_state_layout_query(&hp, s.param.p.state_format, s.param.p.rows, s.param.p.cols, &layout), FORGE_OK);
      EXPECT_EQ(std::memcmp(&layout, &before, sizeof(layout)), 0);
      EXPECT_NE(std::string(forge_last_error()).find(expect), std::string::npos) << forge_last_error();
      s.param.p.rows = rows;
      s.param.p.cols = cols;
      continue;
    }
    std::vector<uint8_t> run_before(s.run.bytes, s.run.bytes + sizeof(s.run.bytes));
    const std::vector<uint8_t> before = s.snapshot();
    const forge_status status = call(s, bad.entry, index, &param, &hp, buffer);
    EXPECT_NE(status, FORGE_OK);
    const std::string message = forge_last_error();
    EXPECT_FALSE(message.empty());
    EXPECT_NE(message.find(expect), std::string::npos) << "message: " << message;
    EXPECT_EQ(s.snapshot(), before) << "a refused call wrote something";
    if (bad.entry == kFill)
      EXPECT_EQ(std::vector<uint8_t>(s.run.bytes, s.run.bytes + sizeof(s.run.bytes)), run_before);
    if (bad.entry == kElementwise) {  // the same refusal through the batch entry point
      const forge_elementwise_args* one[] = {&s.elementwise};
      EXPECT_NE(forge_elementwise_step_batch(one, 1), FORGE_OK);
      const std::string batched = forge_last_error();
      EXPECT_EQ(batched.rfind("args[0]: ", 0), 0u) << batched;
      EXPECT_NE(batched.find(expect), std::string::npos) << "message: " << batched;
      EXPECT_EQ(s.snapshot(), before) << "a refused batch wrote something";
    }
    if (::testing::Test::HasFailure()) return;
  }
  // NULL args, for each entry point that takes a struct pointer
  EXPECT_EQ(forge_wgrad_step(nullptr), FORGE_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(forge_elementwise_step(nullptr), FORGE_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(forge_elementwise_step_batch(nullptr, 1), FORGE_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(forge_run_scalars_fill(nullptr, nullptr, 0), FORGE_ERR_INVALID_ARGUMENT);
  if (count >= static_cast<int64_t>(4 * all.size()))
    for (size_t k = 0; k < all.size(); ++k) EXPECT_GT(used[k], 0) << all[k].what << " never drawn";
}

}  // namespace
}  // namespace forge_test
