// fuzz_abi.cpp — a coverage-guided fuzz target (libFuzzer) over every C ABI entry point.
//
// Each input is read as a sequence of choices (ByteReader): which entry point, the shapes,
// formats, enums, hyper-parameters (torch's defaults, values at their edges, or raw bits),
// shard placements, tiles, threads, a run_scalars buffer (filled, filled for other
// hyper-parameters, garbage, misaligned), the contents of every buffer (weights, gradients,
// states, absmax: ordinary values, NaN, infinities, the largest bf16, subnormals, raw bits),
// and where each buffer lies in one arena: apart, overlapping another, misaligned, or NULL.
// Batches have 1 to 4 entries, whose buffers may overlap across entries. Sizes are either
// small, with buffers that hold them, or past what the ABI accepts (the call must refuse
// them before reading), so any read or write out of bounds is the library's.
//
// The contract checked on every call (any violation aborts: libFuzzer keeps the input):
//  - a refusal (status != FORGE_OK) wrote nothing (the whole arena, outputs included, is
//    unchanged), says why (forge_last_error() non-empty) and is no FORGE_ERR_INTERNAL;
//  - an accepted call wrote only the buffers it may write, and left there what a step
//    stores: every changed weight, master or fp32 / bf16 state storable (not NaN, at most
//    the largest bf16), every changed absmax in [0, the largest bf16], no changed fp8 code
//    NaN or infinite unless it was, nonfinite_count grown by at most the elements updated,
//    grad_sq_sum finite and not smaller;
//  - an accepted forge_wgrad_step equals, bit for bit, forge_elementwise_step on dW summed
//    in token order (the CPU backend's contract); an accepted batch equals its entries run
//    one by one;
//  - no undefined behaviour, no out-of-bounds access (the sanitizers: ASan, UBSan with
//    float-cast-overflow), no crash, no hang.
// Build and run: scripts/fuzz.sh (clang, libFuzzer). The same function replays the seed
// corpus and the regression inputs in every sanitizer build (replay_main.cpp, ctest label
// "fuzz").
#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <string>
#include <vector>

#include <strings.h>

#include "core/formats.h"
#include "forge/forge.h"

namespace {

// ---- reading choices from the input ---------------------------------------------------------

// The input as a stream of choices; past its end every choice reads as zero bytes (the
// defaults), so any input is a complete call.
class ByteReader {
 public:
  ByteReader(const uint8_t* data, size_t size) : p_(data), end_(data + size) {}
  uint8_t byte() { return p_ < end_ ? *p_++ : 0; }
  uint64_t bits(int bytes) {
    uint64_t v = 0;
    for (int i = 0; i < bytes; ++i) v |= static_cast<uint64_t>(byte()) << (8 * i);
    return v;
  }
  // In [lo, hi] (hi - lo < 2^32).
  int64_t range(int64_t lo, int64_t hi) {
    const uint64_t span = static_cast<uint64_t>(hi - lo) + 1;
    const int bytes = span <= 0x100 ? 1 : span <= 0x10000 ? 2 : 4;
    return lo + static_cast<int64_t>(bits(bytes) % span);
  }
  bool chance(int one_in) { return range(0, one_in - 1) == 0; }
  template <class T, size_t N>
  T pick(const T (&values)[N]) { return values[range(0, N - 1)]; }
  template <class T>
  T pick_of(std::initializer_list<T> values) {
    return *(values.begin() + range(0, static_cast<int64_t>(values.size()) - 1));
  }
  double raw_double() {
    const uint64_t b = bits(8);
    double d;
    std::memcpy(&d, &b, 8);
    return d;
  }
  bool done() const { return p_ >= end_; }

 private:
  const uint8_t* p_;
  const uint8_t* end_;
};

// splitmix64: the bulk contents of buffers, from a seed the input chooses.
struct Mix {
  uint64_t s;
  uint64_t next() {
    uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  float unit() { return static_cast<float>(next() >> 40) * 0x1p-24f; }  // [0, 1)
};

[[noreturn]] __attribute__((format(printf, 1, 2))) void violated(const char* fmt, ...) {
  std::fprintf(stderr, "\nfuzz_abi: CONTRACT VIOLATED: ");
  va_list args;
  va_start(args, fmt);
  std::vfprintf(stderr, fmt, args);
  va_end(args);
  std::fprintf(stderr, "\n  forge_last_error(): \"%s\"\n", forge_last_error());
  std::abort();
}

// ---- the arena: every buffer of a call, at chosen places --------------------------------------

// One allocation holding every buffer of a call, so that a buffer can be placed on another
// (overlap) or one byte off (misaligned) and still lie in memory the process owns: "nothing
// written" is then "the arena's bytes are unchanged".
struct Arena {
  std::vector<uint64_t> words;
  explicit Arena(size_t bytes) : words((bytes + 7) / 8 + 1, 0) {}
  uint8_t* base() { return reinterpret_cast<uint8_t*>(words.data()); }
  size_t size() const { return words.size() * 8; }
  std::vector<uint8_t> bytes() const {
    const uint8_t* b = reinterpret_cast<const uint8_t*>(words.data());
    return std::vector<uint8_t>(b, b + size());
  }
};

struct Buffer {
  const char* what = "";
  size_t offset = 0;  // in the arena
  size_t bytes = 0;
  bool null = false;
};

// Where a call's buffers go: each gets `bytes` at a 64-byte boundary, 64 bytes or more after the
// one before; then the input may move one onto another, next to another, off its alignment, or
// null it.
class Layout {
 public:
  size_t add(const char* what, size_t bytes) {
    Buffer b;
    b.what = what;
    b.bytes = bytes;
    b.offset = next_;
    next_ = (next_ + bytes + 64 + 63) / 64 * 64;
    buffers_.push_back(b);
    return buffers_.size() - 1;
  }
  // Bytes the arena needs: every buffer, and room to move the largest anywhere inside.
  size_t arena_bytes() const {
    size_t largest = 0;
    for (const Buffer& b : buffers_) largest = b.bytes > largest ? b.bytes : largest;
    return next_ + largest + 128;
  }
  // The input's corruptions of the placement: a few of overlap, misalignment or NULL.
  void corrupt(ByteReader& in, size_t arena_size) {
    if (buffers_.empty()) return;
    const int count = in.chance(3) ? static_cast<int>(in.range(1, 2)) : 0;
    for (int i = 0; i < count; ++i) {
      Buffer& b = buffers_[in.range(0, buffers_.size() - 1)];
      switch (in.range(0, 3)) {
        case 0: {  // onto another buffer, some bytes in
          const Buffer& other = buffers_[in.range(0, buffers_.size() - 1)];
          size_t at = other.offset + static_cast<size_t>(in.range(0, 64)) * 4;
          if (at + b.bytes > arena_size) at = arena_size - b.bytes;
          b.offset = at / 4 * 4;
          break;
        }
        case 1:  // off its alignment (1 to 3 bytes, 4 for an 8-byte output)
          b.offset += static_cast<size_t>(in.range(1, 4));
          if (b.offset + b.bytes > arena_size) b.offset -= 8;
          break;
        case 2:
          b.null = true;
          break;
        default: {  // just past another buffer's end, or just before its start
          const Buffer& other = buffers_[in.range(0, buffers_.size() - 1)];
          size_t at = in.chance(2) ? other.offset + other.bytes : other.offset;
          at = at >= b.bytes / 2 ? at - b.bytes / 2 : 0;
          if (at + b.bytes > arena_size) at = arena_size - b.bytes;
          b.offset = at;
          break;
        }
      }
    }
  }
  void* pointer(size_t i, Arena& arena) const {
    return buffers_[i].null ? nullptr : arena.base() + buffers_[i].offset;
  }
  const Buffer& operator[](size_t i) const { return buffers_[i]; }
  size_t count() const { return buffers_.size(); }

 private:
  std::vector<Buffer> buffers_;
  size_t next_ = 64;
};

// ---- values ------------------------------------------------------------------------------------

constexpr float kBf16Max = forge::kBf16Max;

// A value of the kind the input chooses: ordinary (uniform in (-1, 1)), small (|x| < 5e-4), a
// special (0, -0, NaN, infinities, the largest bf16, past it, a subnormal, 1e19, 1e20), or raw
// bits.
float value(Mix& mix, int kind) {
  switch (kind) {
    case 0: return (mix.unit() - 0.5f) * 2.0f;
    case 1: return (mix.unit() - 0.5f) * 1e-3f;
    case 2: {
      static const float special[] = {0.0f, -0.0f, NAN, -NAN, INFINITY, -INFINITY, kBf16Max,
                                      -kBf16Max, 3.4e38f, 1e-40f, 1e19f, 1e20f, 1.0f};
      return special[mix.next() % (sizeof(special) / sizeof(special[0]))];
    }
    default: {
      const uint32_t u = static_cast<uint32_t>(mix.next());
      return forge::bits_float(u);
    }
  }
}

// Fills `bytes` at p with elements of `elem` bytes (4: fp32, 2: bf16 / fp16 bits, 1: codes),
// mostly of the first value kind, some of the others.
void fill(uint8_t* p, size_t bytes, int elem, Mix& mix, int kind, int special_one_in) {
  const size_t n = bytes / static_cast<size_t>(elem);
  for (size_t i = 0; i < n; ++i) {
    const int k = special_one_in && mix.next() % special_one_in == 0 ? static_cast<int>(mix.next() % 4) : kind;
    const float v = value(mix, k);
    if (elem == 4) {
      std::memcpy(p + 4 * i, &v, 4);
    } else if (elem == 2) {
      const uint16_t h = forge::bf16_nearest(v);
      std::memcpy(p + 2 * i, &h, 2);
    } else {
      p[i] = static_cast<uint8_t>(mix.next());
    }
  }
}

// ---- hyper-parameters ------------------------------------------------------------------------

double edge_double(ByteReader& in, double current) {
  static const double edges[] = {0.0, -0.0, 1.0, -1.0, 0.5, 0.9, 0.999, 1.0 - 1e-17, 1e-8,
                                 1e-50, 1e-320, 1e38, 1e39, 1e300, 3.4e38, 0x1.FEp127,
                                 static_cast<double>(NAN), static_cast<double>(INFINITY),
                                 -static_cast<double>(INFINITY), 0.9999999, 1.5, 4e-3};
  switch (in.range(0, 5)) {
    case 0: return in.pick(edges);
    case 1: return in.raw_double();
    case 2: return current * (1.0 + (static_cast<double>(in.range(0, 255)) - 128.0) / 256.0);
    default: return current;
  }
}

// A rule's hyper-parameters: its defaults, then fields moved to their edges.
forge_hparams make_hparams(ByteReader& in) {
  forge_hparams hp{};
  // One byte, read as the checked-in corpus and regressions were recorded (the rule byte % 8,
  // the 8 rules before FORGE_RULE_MUON), except its top values, which pick the rules added
  // since: those inputs still decode to the calls they were kept for.
  static_assert(FORGE_RULE_COUNT - FORGE_RULE_MUON <= 8, "more new rules than top byte values");
  const int rule_byte = in.byte();
  int32_t rule = rule_byte < 248 ? rule_byte % FORGE_RULE_MUON
                                 : FORGE_RULE_MUON + (rule_byte - 248) % (FORGE_RULE_COUNT - FORGE_RULE_MUON);
  if (in.chance(40)) rule = static_cast<int32_t>(in.bits(4));  // any value
  if (forge_hparams_default(rule, &hp) != FORGE_OK) {
    forge_hparams_default(FORGE_RULE_ADAMW, &hp);
    hp.rule = rule;
  }
  if (in.chance(50)) hp.abi_version = static_cast<int32_t>(in.bits(4));
  hp.lr = in.chance(2) ? 1e-3 * static_cast<double>(in.range(0, 300)) : hp.lr;
  hp.weight_decay = in.chance(2) ? 0.01 * static_cast<double>(in.range(0, 50)) : hp.weight_decay;
  hp.decoupled_weight_decay = static_cast<int32_t>(in.range(0, 1));
  hp.maximize = in.chance(4) ? 1 : 0;
  if (hp.rule == FORGE_RULE_SGD_MOMENTUM || hp.rule == FORGE_RULE_RMSPROP) {
    hp.momentum = in.chance(2) ? 0.1 * static_cast<double>(in.range(1, 9)) : hp.momentum;
    hp.nesterov = hp.rule == FORGE_RULE_SGD_MOMENTUM && in.chance(3);
    hp.dampening = hp.nesterov ? 0.0 : 0.1 * static_cast<double>(in.range(0, 10));
    hp.centered = static_cast<int32_t>(in.range(0, 1));
  }
  if (hp.rule == FORGE_RULE_MUON) {  // momentum in [0, 1]; a dampening it does not read
    hp.momentum = in.chance(2) ? 0.1 * static_cast<double>(in.range(0, 10)) : hp.momentum;
    hp.nesterov = static_cast<int32_t>(in.range(0, 1));
    hp.dampening = in.chance(2) ? 0.0 : 0.1 * static_cast<double>(in.range(1, 10));
  }
  const int64_t steps[] = {1, 2, 3, 10, 1000, 1000000, INT64_MAX, INT64_MAX - 1, 0, -1, INT64_MIN,
                           static_cast<int64_t>(1) << 62};
  hp.step = in.chance(3) ? in.pick(steps) : in.range(1, 5000);
  hp.seed = in.bits(in.chance(2) ? 1 : 8);
  hp.grad_scale = in.chance(4) ? in.pick_of<double>({0.5, 1.0 / 1024, 2.0, 65536.0}) : 1.0;
  if (hp.rule == FORGE_RULE_NADAM && in.chance(2)) {
    const double mu = hp.beta1 * (1 - 0.5 * std::pow(0.96, static_cast<double>(hp.step) * hp.momentum_decay));
    hp.mu_product = in.chance(2) ? mu * static_cast<double>(in.range(0, 1000)) / 1000.0 : mu;
  }
  if (hp.rule == FORGE_RULE_ADAGRAD && in.chance(2))
    hp.initial_accumulator_value = in.chance(2) ? 0.1 * static_cast<double>(in.range(0, 10)) : 3.39e38;
  // Fields at their edges (any field of forge_hparams, read by the rule or not).
  const int edits = in.chance(2) ? static_cast<int>(in.range(1, 3)) : 0;
  for (int i = 0; i < edits; ++i) {
    double* fields[] = {&hp.lr, &hp.weight_decay, &hp.beta1, &hp.beta2, &hp.eps,
                        &hp.momentum_decay, &hp.mu_product, &hp.alpha, &hp.momentum,
                        &hp.dampening, &hp.lr_decay, &hp.initial_accumulator_value,
                        &hp.grad_scale};
    double* f = fields[in.range(0, sizeof(fields) / sizeof(fields[0]) - 1)];
    *f = edge_double(in, *f);
  }
  if (in.chance(30)) hp.nesterov = static_cast<int32_t>(in.bits(4));
  if (in.chance(30)) hp.centered = static_cast<int32_t>(in.bits(4));
  return hp;
}

// ---- parameters --------------------------------------------------------------------------------

int num_states(const forge_hparams& hp) {
  forge_state_layout layout{};
  if (forge_state_layout_query(&hp, FORGE_STATE_FP32, 1, 1, &layout) != FORGE_OK) return 3;
  return layout.num_states;
}

bool block_format(int32_t f) {
  return f == FORGE_STATE_INT8_BLOCK64 || f == FORGE_STATE_FP8_BLOCK64 ||
         f == FORGE_STATE_INT4_BLOCK64;
}
int weight_elem(int32_t f) { return f == FORGE_WEIGHT_FP32 ? 4 : 2; }
int state_elem(int32_t f) { return f == FORGE_STATE_FP32 ? 4 : block_format(f) ? 1 : 2; }
// Bytes of a [rows, cols] state buffer (int4: two codes per byte, rows of ceil(cols / 2)).
int64_t state_bytes(int32_t f, int64_t rows, int64_t cols) {
  return f == FORGE_STATE_INT4_BLOCK64 ? rows * ((cols + 1) / 2) : rows * cols * state_elem(f);
}
bool valid_weight_format(int32_t f) { return f >= 0 && f < FORGE_WEIGHT_FORMAT_COUNT; }
bool valid_state_format(int32_t f) { return f >= 0 && f < FORGE_STATE_FORMAT_COUNT; }

// Shape: small (buffers hold it) or one the ABI must refuse (then its buffers are small).
struct Shape {
  int64_t rows, cols;
  bool small;
};
Shape make_shape(ByteReader& in, int64_t max_rows, int64_t max_cols) {
  if (in.chance(25)) {
    const int64_t bad[][2] = {{0, 5}, {5, 0}, {-1, 64}, {3, -64}, {int64_t(1) << 31, int64_t(1) << 31},
                              {INT64_MAX, 2}, {int64_t(1) << 40, int64_t(1) << 40},
                              {INT64_MIN, INT64_MIN}, {(int64_t(1) << 61) / 7, 8}};
    const auto& b = bad[in.range(0, sizeof(bad) / sizeof(bad[0]) - 1)];
    return {b[0], b[1], false};
  }
  const int64_t cols_pick[] = {1, 3, 17, 63, 64, 65, 100, 128, 129};
  const int64_t rows = in.chance(2) ? in.range(1, 4) : in.range(1, max_rows);
  const int64_t cols = in.chance(2) ? in.pick(cols_pick) : in.range(1, max_cols);
  return {rows, cols, true};
}

// One parameter's buffers in a Layout (registered, not yet placed in an arena).
struct ParamPlan {
  Shape shape;
  int32_t weight_format, state_format;
  int states;                      // the rule's state count (0..3)
  size_t weight, master = SIZE_MAX, state[FORGE_MAX_STATES], absmax[FORGE_MAX_STATES];
  bool master_unwanted = false;    // a master pointer set where the format has none
  int64_t row_offset = 0, col_offset = 0, full_cols = 0;
  int weight_kind, state_kind;     // the contents' value kinds
  int64_t elements() const { return shape.small ? shape.rows * shape.cols : 1; }
  int64_t blocks() const { return shape.small ? shape.rows * ((shape.cols + 63) / 64) : 1; }
};

ParamPlan plan_param(ByteReader& in, Layout& layout, const forge_hparams& hp, int64_t max_rows,
                     int64_t max_cols) {
  ParamPlan p{};
  p.shape = make_shape(in, max_rows, max_cols);
  p.weight_format = static_cast<int32_t>(in.range(0, FORGE_WEIGHT_FORMAT_COUNT - 1));
  if (in.chance(40)) p.weight_format = static_cast<int32_t>(in.bits(4));
  p.state_format = static_cast<int32_t>(in.range(0, FORGE_STATE_FORMAT_COUNT - 1));
  if (in.chance(40)) p.state_format = static_cast<int32_t>(in.bits(4));
  p.states = num_states(hp);
  const int64_t n = p.elements();
  const int we = valid_weight_format(p.weight_format) ? weight_elem(p.weight_format) : 4;
  const int64_t state_buffer = valid_state_format(p.state_format) && p.shape.small
                                   ? state_bytes(p.state_format, p.shape.rows, p.shape.cols)
                                   : n * 4;
  p.weight = layout.add("param.weight", static_cast<size_t>(n * we));
  p.master_unwanted = p.weight_format != FORGE_WEIGHT_BF16_MASTER && in.chance(40);
  if (p.weight_format == FORGE_WEIGHT_BF16_MASTER || p.master_unwanted)
    p.master = layout.add("param.master", static_cast<size_t>(n * 4));
  const int slots = in.chance(30) ? FORGE_MAX_STATES : p.states;  // (extra ones are unused)
  for (int i = 0; i < FORGE_MAX_STATES; ++i) {
    p.state[i] = p.absmax[i] = SIZE_MAX;
    if (i >= slots) continue;
    p.state[i] = layout.add("param.state[i]", static_cast<size_t>(state_buffer));
    if (block_format(p.state_format) || in.chance(40))
      p.absmax[i] = layout.add("param.state_absmax[i]", static_cast<size_t>(p.blocks() * 4));
  }
  switch (in.range(0, 5)) {  // a shard's place, or none
    case 1:
      p.row_offset = in.range(0, 1000);
      p.full_cols = p.shape.cols;
      break;
    case 2:
      p.col_offset = 64 * in.range(0, 3) + (in.chance(4) ? in.range(1, 63) : 0);
      p.full_cols = p.col_offset + p.shape.cols + (in.chance(2) ? 0 : 64 * in.range(0, 2) + in.range(0, 1));
      break;
    case 3: {
      const int64_t edges[] = {-1, 0, 1, INT64_MAX, INT64_MAX - 5, INT64_MIN, int64_t(1) << 61,
                               (int64_t(1) << 61) - 1, 64, 128};
      p.row_offset = in.pick(edges);
      p.col_offset = in.pick(edges);
      p.full_cols = in.pick(edges);
      break;
    }
    default:
      break;
  }
  p.weight_kind = in.chance(4) ? static_cast<int>(in.range(0, 3)) : 0;
  p.state_kind = in.chance(4) ? static_cast<int>(in.range(0, 3)) : static_cast<int>(in.range(0, 1));
  return p;
}

forge_param param_struct(const ParamPlan& p, const Layout& layout, Arena& arena) {
  forge_param fp{};
  fp.rows = p.shape.rows;
  fp.cols = p.shape.cols;
  fp.weight_format = p.weight_format;
  fp.state_format = p.state_format;
  fp.weight = layout.pointer(p.weight, arena);
  if (p.master != SIZE_MAX) fp.master = static_cast<float*>(layout.pointer(p.master, arena));
  for (int i = 0; i < FORGE_MAX_STATES; ++i) {
    if (p.state[i] != SIZE_MAX) fp.state[i] = layout.pointer(p.state[i], arena);
    if (p.absmax[i] != SIZE_MAX) fp.state_absmax[i] = static_cast<float*>(layout.pointer(p.absmax[i], arena));
  }
  fp.row_offset = p.row_offset;
  fp.col_offset = p.col_offset;
  fp.full_cols = p.full_cols;
  return fp;
}

// The contents of a parameter's buffers: weights and fp32 / bf16 states of the chosen kinds,
// codes any byte, absmax the largest magnitude a block could hold (sometimes anything).
void fill_param(const ParamPlan& p, const Layout& layout, Arena& arena, Mix& mix, ByteReader& in) {
  const Buffer& w = layout[p.weight];
  fill(arena.base() + w.offset, w.bytes, valid_weight_format(p.weight_format) ? weight_elem(p.weight_format) : 4,
       mix, p.weight_kind, 50);
  if (p.master != SIZE_MAX) fill(arena.base() + layout[p.master].offset, layout[p.master].bytes, 4, mix, p.weight_kind, 50);
  const int special = in.chance(3) ? 20 : 0;
  for (int i = 0; i < FORGE_MAX_STATES; ++i) {
    if (p.state[i] != SIZE_MAX) {
      const Buffer& s = layout[p.state[i]];
      fill(arena.base() + s.offset, s.bytes, valid_state_format(p.state_format) ? state_elem(p.state_format) : 4,
           mix, p.state_kind, special);
    }
    if (p.absmax[i] != SIZE_MAX) {
      const Buffer& a = layout[p.absmax[i]];
      const int kind = in.chance(4) ? static_cast<int>(in.range(0, 3)) : 0;
      for (size_t b = 0; b + 4 <= a.bytes; b += 4) {
        float v = std::fabs(value(mix, kind)) * (kind == 0 ? 4.0f : 1.0f);
        if (kind != 0 && mix.next() % 4 == 0) v = -v;
        std::memcpy(arena.base() + a.offset + b, &v, 4);
      }
    }
  }
}

// ---- the contract after a call -------------------------------------------------------------------

struct Region {
  size_t offset, bytes;
};

// Whether byte b of the arena lies in one of `regions`.
bool in_regions(size_t b, const std::vector<Region>& regions) {
  for (const Region& r : regions)
    if (b >= r.offset && b < r.offset + r.bytes) return true;
  return false;
}

void expect_unchanged_outside(const std::vector<uint8_t>& before, const std::vector<uint8_t>& after,
                              const std::vector<Region>& writable, const char* entry) {
  for (size_t b = 0; b < before.size(); ++b)
    if (before[b] != after[b] && !in_regions(b, writable))
      violated("%s: accepted, and wrote byte %zu of the arena, outside every buffer it may write", entry, b);
}

void expect_refusal_clean(forge_status s, const std::vector<uint8_t>& before, const Arena& arena,
                          const char* entry) {
  if (s == FORGE_ERR_INTERNAL) violated("%s: FORGE_ERR_INTERNAL (a bug by its own account)", entry);
  if (s < 0 || s > FORGE_ERR_INTERNAL) violated("%s: unknown status %d", entry, static_cast<int>(s));
  const char* message = forge_last_error();
  if (!message || !*message) violated("%s: refused (status %d) without a message", entry, static_cast<int>(s));
  if (std::strlen(message) >= 1024) violated("%s: message longer than the buffer", entry);
  if (arena.bytes() != before) {
    const std::vector<uint8_t> after = arena.bytes();
    size_t b = 0;
    while (before[b] == after[b]) ++b;
    violated("%s: refused (\"%s\"), yet byte %zu of the arena changed", entry, message, b);
  }
}

float load_float(const uint8_t* p) {
  float v;
  std::memcpy(&v, p, 4);
  return v;
}

// What an accepted step left in a parameter: each changed value one a step stores.
void expect_stored_values(const forge_param& fp, const forge_hparams& hp, const std::vector<uint8_t>& before,
                          Arena& arena, int states, const char* entry) {
  forge_state_layout layout{};
  if (forge_state_layout_query(&hp, fp.state_format, fp.rows, fp.cols, &layout) != FORGE_OK)
    violated("%s: accepted, but its layout is refused: \"%s\"", entry, forge_last_error());
  const int64_t n = fp.rows * fp.cols;
  const uint8_t* base = arena.base();
  auto offset_of = [&](const void* p) { return static_cast<size_t>(static_cast<const uint8_t*>(p) - base); };
  auto check_floats = [&](const void* p, int64_t count, int elem, const char* what) {
    if (!p) return;  // (a buffer the call does not use: a state_from_fp32 of another state)
    const size_t o = offset_of(p);
    for (int64_t i = 0; i < count; ++i) {
      const size_t at = o + static_cast<size_t>(i * elem);
      if (std::memcmp(&before[at], base + at, static_cast<size_t>(elem)) == 0) continue;
      float v;
      if (elem == 4) {
        v = load_float(base + at);
      } else {
        uint16_t h;
        std::memcpy(&h, base + at, 2);
        v = forge::bf16_to_float(h);
      }
      if (!forge::storable(v)) violated("%s: stored %g in %s[%lld]: not storable", entry, static_cast<double>(v), what, static_cast<long long>(i));
    }
  };
  check_floats(fp.weight, n, weight_elem(fp.weight_format), "param.weight");
  if (fp.weight_format == FORGE_WEIGHT_BF16_MASTER) check_floats(fp.master, n, 4, "param.master");
  for (int i = 0; i < states; ++i) {
    if (!block_format(fp.state_format)) {
      check_floats(fp.state[i], n, state_elem(fp.state_format), "param.state[i]");
      continue;
    }
    if (!fp.state[i] || !fp.state_absmax[i]) continue;
    const int64_t blocks = fp.rows * ((fp.cols + 63) / 64);
    const size_t ao = offset_of(fp.state_absmax[i]);
    for (int64_t b = 0; b < blocks; ++b) {
      const size_t at = ao + static_cast<size_t>(4 * b);
      if (std::memcmp(&before[at], base + at, 4) == 0) continue;
      const float a = load_float(base + at);
      if (!(a >= 0.0f && a <= kBf16Max)) violated("%s: stored absmax %g in param.state_absmax[%d][%lld]", entry, static_cast<double>(a), i, static_cast<long long>(b));
    }
    if (fp.state_format == FORGE_STATE_FP8_BLOCK64) {  // (a NaN code re-encoded stays a NaN)
      const bool is_signed = layout.is_signed[i] != 0;
      const size_t so = offset_of(fp.state[i]);
      for (int64_t e = 0; e < n; ++e) {
        const uint8_t old = before[so + static_cast<size_t>(e)], now = base[so + static_cast<size_t>(e)];
        if (old != now && !std::isfinite(forge::fp8_value(now, is_signed)) &&
            std::isfinite(forge::fp8_value(old, is_signed)))
          violated("%s: stored fp8 code 0x%02x (not finite) in param.state[%d][%lld]", entry, now, i,
                   static_cast<long long>(e));
      }
    }
  }
}

// dW = dYᵀX summed over tokens in ascending order, each product rounded (the CPU backend's
// order: forge.h, forge_wgrad_step).
float input_at(const uint8_t* base, int32_t dtype, int64_t i) {
  if (dtype == FORGE_DTYPE_FP32) return load_float(base + 4 * i);
  uint16_t h;
  std::memcpy(&h, base + 2 * i, 2);
  return dtype == FORGE_DTYPE_BF16 ? forge::bf16_to_float(h) : forge::fp16_to_float(h);
}

// ---- the entry points ------------------------------------------------------------------------------

struct Outputs {
  size_t sq = SIZE_MAX, count = SIZE_MAX;
};

void plan_outputs(ByteReader& in, Layout& layout, Outputs& o) {
  if (!in.chance(4)) o.sq = layout.add("outputs.grad_sq_sum", 8);
  if (!in.chance(4)) o.count = layout.add("outputs.nonfinite_count", 8);
}

forge_step_outputs output_struct(const Outputs& o, const Layout& layout, Arena& arena) {
  forge_step_outputs out{};
  if (o.sq != SIZE_MAX) out.grad_sq_sum = static_cast<double*>(layout.pointer(o.sq, arena));
  if (o.count != SIZE_MAX) out.nonfinite_count = static_cast<int64_t*>(layout.pointer(o.count, arena));
  return out;
}

void fill_outputs(const Outputs& o, const Layout& layout, Arena& arena, ByteReader& in) {
  if (o.sq != SIZE_MAX) {
    const double v = in.chance(8) ? 1e300 : 0.25 * static_cast<double>(in.range(0, 8));
    std::memcpy(arena.base() + layout[o.sq].offset, &v, 8);
  }
  if (o.count != SIZE_MAX) {
    const int64_t v = in.range(0, 100);
    std::memcpy(arena.base() + layout[o.count].offset, &v, 8);
  }
}

// The regions an accepted step may write: the parameter's buffers and the outputs.
void step_regions(const forge_param& fp, int states, const forge_step_outputs& out, Arena& arena,
                  std::vector<Region>& regions) {
  const uint8_t* base = arena.base();
  auto add = [&](const void* p, int64_t bytes) {
    if (p) regions.push_back({static_cast<size_t>(static_cast<const uint8_t*>(p) - base), static_cast<size_t>(bytes)});
  };
  const int64_t n = fp.rows * fp.cols;
  add(fp.weight, n * weight_elem(fp.weight_format));
  if (fp.weight_format == FORGE_WEIGHT_BF16_MASTER) add(fp.master, n * 4);
  for (int i = 0; i < states; ++i) {
    add(fp.state[i], state_bytes(fp.state_format, fp.rows, fp.cols));
    if (block_format(fp.state_format)) add(fp.state_absmax[i], fp.rows * ((fp.cols + 63) / 64) * 4);
  }
  add(out.grad_sq_sum, 8);
  add(out.nonfinite_count, 8);
}

void expect_outputs(const forge_step_outputs& out, const std::vector<uint8_t>& before, Arena& arena,
                    int64_t elements, const char* entry) {
  const uint8_t* base = arena.base();
  if (out.grad_sq_sum) {
    const size_t o = static_cast<size_t>(reinterpret_cast<const uint8_t*>(out.grad_sq_sum) - base);
    double was, now;
    std::memcpy(&was, &before[o], 8);
    std::memcpy(&now, base + o, 8);
    if (!(now >= was) || !std::isfinite(now)) violated("%s: grad_sq_sum went from %g to %g", entry, was, now);
  }
  if (out.nonfinite_count) {
    const size_t o = static_cast<size_t>(reinterpret_cast<const uint8_t*>(out.nonfinite_count) - base);
    int64_t was, now;
    std::memcpy(&was, &before[o], 8);
    std::memcpy(&now, base + o, 8);
    if (now < was || now - was > elements) violated("%s: nonfinite_count went from %lld to %lld (%lld elements)", entry, static_cast<long long>(was), static_cast<long long>(now), static_cast<long long>(elements));
  }
}

struct alignas(16) RunBuffer {
  unsigned char bytes[FORGE_RUN_SCALARS_BYTES];
};

// A run_scalars buffer in the arena (or none): filled for these hyper-parameters, for others,
// left as garbage, or corrupted after the fill.
size_t plan_run_scalars(ByteReader& in, Layout& layout) {
  if (!in.chance(5)) return SIZE_MAX;
  return layout.add("hparams.run_scalars", FORGE_RUN_SCALARS_BYTES);
}

void fill_run_scalars(ByteReader& in, size_t run, const Layout& layout, Arena& arena, forge_hparams& hp) {
  if (run == SIZE_MAX) return;
  void* p = layout.pointer(run, arena);
  hp.run_scalars = p;
  if (!p || reinterpret_cast<uintptr_t>(p) % 16 != 0) return;  // (the call must refuse it)
  alignas(16) unsigned char filled[FORGE_RUN_SCALARS_BYTES];
  forge_hparams source = hp;
  source.run_scalars = nullptr;
  switch (in.range(0, 4)) {
    case 0: case 1:  // for these, with another step, lr, seed (what a replay changes)
      source.step = in.range(1, 100000);
      source.lr = 1e-4 * static_cast<double>(in.range(0, 100));
      source.seed = in.bits(8);
      break;
    case 2:
      source.weight_decay = source.weight_decay * 0.5 + 0.01;
      break;
    case 3:
      std::memset(filled, static_cast<int>(in.byte()), sizeof(filled));
      std::memcpy(p, filled, sizeof(filled));
      return;
    default:
      break;
  }
  if (forge_run_scalars_fill(&source, filled, sizeof(filled)) != FORGE_OK) return;
  if (in.chance(6)) filled[in.range(0, FORGE_RUN_SCALARS_BYTES - 1)] ^= static_cast<unsigned char>(1u << in.range(0, 7));
  std::memcpy(p, filled, sizeof(filled));
}

forge_device make_device(ByteReader& in) {
  forge_device d{};
  d.kind = FORGE_DEVICE_CPU;
  d.num_threads = static_cast<int32_t>(in.range(0, 2));
  if (in.chance(40)) d.kind = in.chance(2) ? FORGE_DEVICE_CUDA : static_cast<int32_t>(in.bits(4));
  if (in.chance(40)) d.num_threads = in.pick_of<int32_t>({-1, FORGE_MAX_CPU_THREADS + 1, INT32_MAX, INT32_MIN});
  return d;
}

// The step's parameter copied into fresh buffers of its own (for a reference call).
struct Copy {
  std::vector<uint64_t> words;
  forge_param fp;
  uint8_t* base() { return reinterpret_cast<uint8_t*>(words.data()); }
};

Copy copy_param(const forge_param& fp, int states, const std::vector<uint8_t>& before, const uint8_t* arena_base) {
  const int64_t n = fp.rows * fp.cols, blocks = fp.rows * ((fp.cols + 63) / 64);
  const size_t wb = static_cast<size_t>(n * weight_elem(fp.weight_format)), mb = static_cast<size_t>(n * 4),
               sb = static_cast<size_t>(state_bytes(fp.state_format, fp.rows, fp.cols)),
               ab = static_cast<size_t>(blocks * 4);
  auto round = [](size_t b) { return (b + 63) / 64 * 64; };
  Copy c;
  c.words.assign((round(wb) + round(mb) + FORGE_MAX_STATES * (round(sb) + round(ab))) / 8 + 8, 0);
  c.fp = fp;
  size_t at = 0;
  auto take = [&](const void* src, size_t bytes) -> void* {
    uint8_t* dst = c.base() + at;
    std::memcpy(dst, &before[static_cast<size_t>(static_cast<const uint8_t*>(src) - arena_base)], bytes);
    at += round(bytes);
    return dst;
  };
  c.fp.weight = take(fp.weight, wb);
  c.fp.master = fp.weight_format == FORGE_WEIGHT_BF16_MASTER ? static_cast<float*>(take(fp.master, mb)) : nullptr;
  for (int i = 0; i < FORGE_MAX_STATES; ++i) {
    c.fp.state[i] = i < states ? take(fp.state[i], sb) : nullptr;
    c.fp.state_absmax[i] = i < states && block_format(fp.state_format) ? static_cast<float*>(take(fp.state_absmax[i], ab)) : nullptr;
  }
  return c;
}

bool same_param(const forge_param& a, const forge_param& b, int states) {
  const int64_t n = a.rows * a.cols, blocks = a.rows * ((a.cols + 63) / 64);
  auto same = [](const void* x, const void* y, int64_t bytes) { return std::memcmp(x, y, static_cast<size_t>(bytes)) == 0; };
  if (!same(a.weight, b.weight, n * weight_elem(a.weight_format))) return false;
  if (a.weight_format == FORGE_WEIGHT_BF16_MASTER && !same(a.master, b.master, n * 4)) return false;
  for (int i = 0; i < states; ++i) {
    if (!same(a.state[i], b.state[i], state_bytes(a.state_format, a.rows, a.cols))) return false;
    if (block_format(a.state_format) && !same(a.state_absmax[i], b.state_absmax[i], blocks * 4)) return false;
  }
  return true;
}

// forge_wgrad_step, or forge_elementwise_step.
void fuzz_step(ByteReader& in, bool fused) {
  const char* entry = fused ? "forge_wgrad_step" : "forge_elementwise_step";
  forge_hparams hp = make_hparams(in);
  Layout layout;
  ParamPlan p = plan_param(in, layout, hp, 40, 140);
  const int64_t tokens_pick[] = {1, 2, 5, 17, 40};
  int64_t tokens = in.chance(3) ? in.pick(tokens_pick) : in.range(1, 24);
  int32_t x_dtype = static_cast<int32_t>(in.range(0, 2)), dy_dtype = static_cast<int32_t>(in.range(0, 2)),
          grad_dtype = static_cast<int32_t>(in.range(0, 2));
  if (in.chance(40)) x_dtype = static_cast<int32_t>(in.bits(4));
  if (in.chance(40)) grad_dtype = static_cast<int32_t>(in.bits(4));
  const int64_t cols = p.shape.small ? p.shape.cols : 1, rows = p.shape.small ? p.shape.rows : 1;
  int64_t ldx = cols + (in.chance(2) ? in.range(0, 5) : 0), lddy = rows + (in.chance(2) ? in.range(0, 5) : 0);
  bool inputs_small = true;
  if (in.chance(25)) {  // strides and token counts the ABI must refuse (or that fit what is there)
    const int64_t t[][3] = {{0, 0, 0}, {-1, 0, 0}, {int64_t(1) << 40, int64_t(1) << 40, 0}, {5, -5, 0},
                            {int64_t(1) << 33, 0, int64_t(1) << 31}, {3, 0, -1}};
    const auto& c = t[in.range(0, sizeof(t) / sizeof(t[0]) - 1)];
    tokens = c[0] ? c[0] : tokens;
    if (c[1]) ldx = c[1] < 0 ? cols - 1 : c[1];
    if (c[2]) lddy = c[2] < 0 ? rows - 1 : c[2];
    inputs_small = tokens > 0 && tokens <= 40 && ldx >= cols && lddy >= rows && ldx < 1000 && lddy < 1000;
  }
  const int xe = x_dtype == FORGE_DTYPE_FP32 ? 4 : 2, dye = dy_dtype == FORGE_DTYPE_FP32 ? 4 : 2,
            ge = grad_dtype == FORGE_DTYPE_FP32 ? 4 : 2;
  size_t x = SIZE_MAX, dy = SIZE_MAX, grad = SIZE_MAX;
  if (fused) {
    const int64_t tk = inputs_small ? tokens : 1;
    x = layout.add("x", static_cast<size_t>(((tk - 1) * (inputs_small ? ldx : 1) + cols) * xe));
    dy = layout.add("dy", static_cast<size_t>(((tk - 1) * (inputs_small ? lddy : 1) + rows) * dye));
  } else {
    grad = layout.add("grad", static_cast<size_t>(p.elements() * ge));
  }
  Outputs o;
  plan_outputs(in, layout, o);
  const size_t run = plan_run_scalars(in, layout);
  Arena arena(layout.arena_bytes());
  layout.corrupt(in, arena.size());
  Mix mix{in.bits(8)};
  fill_param(p, layout, arena, mix, in);
  const int input_kind = in.chance(5) ? static_cast<int>(in.range(0, 3)) : 0;
  if (fused) {
    fill(arena.base() + layout[x].offset, layout[x].bytes, xe, mix, input_kind, 30);
    fill(arena.base() + layout[dy].offset, layout[dy].bytes, dye, mix, input_kind, 30);
  } else {
    fill(arena.base() + layout[grad].offset, layout[grad].bytes, ge, mix, input_kind, 30);
  }
  fill_outputs(o, layout, arena, in);
  fill_run_scalars(in, run, layout, arena, hp);
  const forge_device device = make_device(in);
  forge_param fp = param_struct(p, layout, arena);
  const forge_step_outputs out = output_struct(o, layout, arena);
  int32_t tile_rows = 0, tile_cols = 0;
  if (fused && in.chance(2)) {
    tile_rows = static_cast<int32_t>(in.range(0, 70));
    tile_cols = block_format(p.state_format) ? static_cast<int32_t>(64 * in.range(0, 3)) : static_cast<int32_t>(in.range(0, 200));
    if (in.chance(20)) tile_cols = in.pick_of<int32_t>({-1, 32, 96, FORGE_MAX_TILE + 1, INT32_MAX});
    if (in.chance(20)) tile_rows = in.pick_of<int32_t>({-1, FORGE_MAX_TILE + 1, INT32_MIN});
  }
  const int32_t abi = in.chance(50) ? static_cast<int32_t>(in.bits(4)) : FORGE_ABI_VERSION;

  forge_wgrad_args w{};
  forge_elementwise_args e{};
  if (fused) {
    w.abi_version = abi;
    w.device = device;
    w.tokens = tokens;
    w.x = layout.pointer(x, arena);
    w.x_dtype = x_dtype;
    w.ldx = ldx;
    w.dy = layout.pointer(dy, arena);
    w.dy_dtype = dy_dtype;
    w.lddy = lddy;
    w.param = fp;
    w.hparams = hp;
    w.outputs = out;
    w.tile_rows = tile_rows;
    w.tile_cols = tile_cols;
  } else {
    e.abi_version = abi;
    e.device = device;
    e.grad = layout.pointer(grad, arena);
    e.grad_dtype = grad_dtype;
    e.param = fp;
    e.hparams = hp;
    e.outputs = out;
  }
  const std::vector<uint8_t> before = arena.bytes();
  const forge_status s = fused ? forge_wgrad_step(&w) : forge_elementwise_step(&e);
  if (s != FORGE_OK) {
    expect_refusal_clean(s, before, arena, entry);
    return;
  }
  if (*forge_last_error()) violated("%s: accepted, but the last error is \"%s\"", entry, forge_last_error());
  if (!p.shape.small || (fused && !inputs_small))
    violated("%s: accepted a shape or stride past what the ABI takes", entry);
  const int states = num_states(hp);
  std::vector<Region> writable;
  step_regions(fp, states, out, arena, writable);
  const std::vector<uint8_t> after = arena.bytes();
  expect_unchanged_outside(before, after, writable, entry);
  expect_stored_values(fp, hp, before, arena, states, entry);
  expect_outputs(out, before, arena, fp.rows * fp.cols, entry);
  if (!fused) return;

  // The fused step against the element-wise step on dW summed in token order.
  const int64_t n = fp.rows * fp.cols;
  std::vector<float> dw(static_cast<size_t>(n));
  const uint8_t* xp = before.data() + (static_cast<const uint8_t*>(w.x) - arena.base());
  const uint8_t* dyp = before.data() + (static_cast<const uint8_t*>(w.dy) - arena.base());
  for (int64_t r = 0; r < fp.rows; ++r)
    for (int64_t c = 0; c < fp.cols; ++c) {
      float acc = 0.0f;
      for (int64_t t = 0; t < tokens; ++t) {
        const float prod = input_at(dyp, dy_dtype, t * lddy + r) * input_at(xp, x_dtype, t * ldx + c);
        acc = acc + prod;
      }
      dw[static_cast<size_t>(r * fp.cols + c)] = acc;
    }
  Copy ref = copy_param(fp, states, before, arena.base());
  double sq = 0.0;
  int64_t count = 0;
  forge_elementwise_args re{};
  re.abi_version = FORGE_ABI_VERSION;
  re.device = device;
  re.grad = dw.data();
  re.grad_dtype = FORGE_DTYPE_FP32;
  re.param = ref.fp;
  re.hparams = hp;
  // (run_scalars: the same bytes, read from the arena's copy before the call)
  alignas(16) RunBuffer run_copy;
  if (hp.run_scalars) {
    std::memcpy(run_copy.bytes, before.data() + (static_cast<const uint8_t*>(hp.run_scalars) - arena.base()), sizeof(run_copy.bytes));
    re.hparams.run_scalars = run_copy.bytes;
  }
  re.outputs = {&sq, &count};
  const forge_status rs = forge_elementwise_step(&re);
  if (rs != FORGE_OK) violated("forge_wgrad_step: accepted, but the element-wise step on its dW refused: \"%s\"", forge_last_error());
  if (!same_param(fp, ref.fp, states))
    violated("forge_wgrad_step: differs from forge_elementwise_step on dW summed in token order");
  if (out.nonfinite_count) {
    int64_t was, now;
    std::memcpy(&was, &before[static_cast<size_t>(reinterpret_cast<uint8_t*>(out.nonfinite_count) - arena.base())], 8);
    std::memcpy(&now, out.nonfinite_count, 8);
    if (now - was != count) violated("forge_wgrad_step: skipped %lld, the element-wise step %lld", static_cast<long long>(now - was), static_cast<long long>(count));
  }
}

// forge_elementwise_step_batch over 1 to 4 entries, which may share outputs or buffers.
void fuzz_batch(ByteReader& in) {
  const int count = static_cast<int>(in.range(1, 4));
  struct Entry {
    forge_hparams hp;
    ParamPlan p;
    size_t grad;
    int32_t grad_dtype;
    Outputs o;
    size_t run;
    int32_t abi;
    forge_device device;
  };
  Layout layout;
  std::vector<Entry> entries(static_cast<size_t>(count));
  Outputs shared;
  plan_outputs(in, layout, shared);
  const bool share_outputs = !in.chance(4);
  for (Entry& en : entries) {
    en.hp = make_hparams(in);
    en.p = plan_param(in, layout, en.hp, 12, 140);
    en.grad_dtype = static_cast<int32_t>(in.range(0, 2));
    en.grad = layout.add("grad", static_cast<size_t>(en.p.elements() * (en.grad_dtype == FORGE_DTYPE_FP32 ? 4 : 2)));
    if (share_outputs) en.o = shared; else plan_outputs(in, layout, en.o);
    en.run = plan_run_scalars(in, layout);
    en.abi = in.chance(60) ? static_cast<int32_t>(in.bits(4)) : FORGE_ABI_VERSION;
    en.device = make_device(in);
  }
  Arena arena(layout.arena_bytes());
  layout.corrupt(in, arena.size());
  Mix mix{in.bits(8)};
  std::vector<forge_elementwise_args> args(static_cast<size_t>(count));
  fill_outputs(shared, layout, arena, in);
  for (size_t i = 0; i < entries.size(); ++i) {
    Entry& en = entries[i];
    fill_param(en.p, layout, arena, mix, in);
    fill(arena.base() + layout[en.grad].offset, layout[en.grad].bytes, en.grad_dtype == FORGE_DTYPE_FP32 ? 4 : 2, mix, in.chance(5) ? 2 : 0, 30);
    if (!share_outputs) fill_outputs(en.o, layout, arena, in);
    fill_run_scalars(in, en.run, layout, arena, en.hp);
    forge_elementwise_args& a = args[i];
    a.abi_version = en.abi;
    a.device = en.device;
    a.grad = layout.pointer(en.grad, arena);
    a.grad_dtype = en.grad_dtype;
    a.param = param_struct(en.p, layout, arena);
    a.hparams = en.hp;
    a.outputs = output_struct(en.o, layout, arena);
  }
  std::vector<const forge_elementwise_args*> pointers;
  for (const forge_elementwise_args& a : args) pointers.push_back(&a);
  if (in.chance(40)) pointers[in.range(0, count - 1)] = nullptr;
  const int64_t passed = in.chance(40) ? in.pick_of<int64_t>({-1, 0, INT64_MIN}) : count;
  const std::vector<uint8_t> before = arena.bytes();
  const forge_status s = forge_elementwise_step_batch(pointers.data(), passed);
  const char* entry = "forge_elementwise_step_batch";
  if (s != FORGE_OK) {
    expect_refusal_clean(s, before, arena, entry);
    return;
  }
  if (passed <= 0) {
    if (arena.bytes() != before) violated("%s: count %lld wrote something", entry, static_cast<long long>(passed));
    return;
  }
  std::vector<Region> writable;
  for (size_t i = 0; i < entries.size(); ++i) {
    if (!entries[i].p.shape.small) violated("%s: accepted a shape past what the ABI takes", entry);
    step_regions(args[i].param, num_states(args[i].hparams), args[i].outputs, arena, writable);
  }
  expect_unchanged_outside(before, arena.bytes(), writable, entry);
  int64_t elements = 0;  // (an output several entries share counts all of theirs)
  for (const forge_elementwise_args& a : args) elements += a.param.rows * a.param.cols;
  for (size_t i = 0; i < entries.size(); ++i) {
    expect_stored_values(args[i].param, args[i].hparams, before, arena, num_states(args[i].hparams), entry);
    expect_outputs(args[i].outputs, before, arena, elements, entry);
  }

  // The same entries one by one, each on a copy of its parameter as it was, in order, their
  // outputs shared as the batch's were.
  double sq_shared = 0.0, sq_own[4] = {};
  int64_t count_shared = 0, count_own[4] = {};
  std::vector<Copy> copies;
  copies.reserve(entries.size());
  for (size_t i = 0; i < entries.size(); ++i) {
    const int states = num_states(args[i].hparams);
    copies.push_back(copy_param(args[i].param, states, before, arena.base()));
    forge_elementwise_args one = args[i];
    one.param = copies.back().fp;
    std::vector<uint8_t> grad_copy(layout[entries[i].grad].bytes + 8);
    std::memcpy(grad_copy.data(), before.data() + (static_cast<const uint8_t*>(one.grad) - arena.base()), layout[entries[i].grad].bytes);
    one.grad = grad_copy.data();
    alignas(16) RunBuffer run_copy;
    if (one.hparams.run_scalars) {
      std::memcpy(run_copy.bytes, before.data() + (static_cast<const uint8_t*>(one.hparams.run_scalars) - arena.base()), sizeof(run_copy.bytes));
      one.hparams.run_scalars = run_copy.bytes;
    }
    one.outputs = {share_outputs ? &sq_shared : &sq_own[i], share_outputs ? &count_shared : &count_own[i]};
    if (forge_elementwise_step(&one) != FORGE_OK)
      violated("%s: accepted, but entry %zu alone was refused: \"%s\"", entry, i, forge_last_error());
    if (!same_param(args[i].param, copies.back().fp, states))
      violated("%s: entry %zu differs from the same step alone", entry, i);
  }
}

// forge_state_init, forge_state_to_fp32, forge_state_from_fp32.
void fuzz_state(ByteReader& in, int which) {
  static const char* const names[] = {"forge_state_init", "forge_state_to_fp32", "forge_state_from_fp32"};
  const char* entry = names[which];
  forge_hparams hp = make_hparams(in);
  Layout layout;
  ParamPlan p = plan_param(in, layout, hp, 12, 140);
  const size_t buffer = which == 0 ? SIZE_MAX : layout.add(which == 1 ? "out" : "in", static_cast<size_t>(p.elements() * 4));
  Arena arena(layout.arena_bytes());
  layout.corrupt(in, arena.size());
  Mix mix{in.bits(8)};
  fill_param(p, layout, arena, mix, in);
  if (buffer != SIZE_MAX) fill(arena.base() + layout[buffer].offset, layout[buffer].bytes, 4, mix, in.chance(3) ? static_cast<int>(in.range(0, 3)) : 0, in.chance(4) ? 40 : 0);
  const forge_device device = make_device(in);
  const forge_param fp = param_struct(p, layout, arena);
  const int states = num_states(hp);
  int32_t index = states > 0 ? static_cast<int32_t>(in.range(0, states - 1)) : 0;
  if (in.chance(20)) index = in.pick_of<int32_t>({-1, 3, 1000, INT32_MIN});
  const bool null_param = in.chance(60), null_hp = in.chance(60);
  const std::vector<uint8_t> before = arena.bytes();
  forge_status s;
  float* buf = buffer == SIZE_MAX ? nullptr : static_cast<float*>(layout.pointer(buffer, arena));
  if (which == 0) s = forge_state_init(null_param ? nullptr : &fp, null_hp ? nullptr : &hp, device);
  else if (which == 1) s = forge_state_to_fp32(null_param ? nullptr : &fp, null_hp ? nullptr : &hp, index, buf, device);
  else s = forge_state_from_fp32(null_param ? nullptr : &fp, null_hp ? nullptr : &hp, index, buf, device);
  if (s != FORGE_OK) {
    expect_refusal_clean(s, before, arena, entry);
    return;
  }
  if (!p.shape.small) violated("%s: accepted a shape past what the ABI takes", entry);
  std::vector<Region> writable;
  const uint8_t* base = arena.base();
  auto add = [&](const void* ptr, int64_t bytes) {
    writable.push_back({static_cast<size_t>(static_cast<const uint8_t*>(ptr) - base), static_cast<size_t>(bytes)});
  };
  const int64_t n = fp.rows * fp.cols, blocks = fp.rows * ((fp.cols + 63) / 64);
  for (int i = 0; i < states; ++i) {
    if (which == 0 || (which == 2 && i == index)) {
      add(fp.state[i], state_bytes(fp.state_format, fp.rows, fp.cols));
      if (block_format(fp.state_format)) add(fp.state_absmax[i], blocks * 4);
    }
  }
  if (which == 1) add(buf, n * 4);
  expect_unchanged_outside(before, arena.bytes(), writable, entry);
  if (which != 1) {  // the states written hold what a step stores (nothing else is written)
    forge_param written = fp;
    written.weight = written.master = nullptr;
    for (int i = 0; i < FORGE_MAX_STATES; ++i)
      if (which == 2 && i != index) written.state[i] = written.state_absmax[i] = nullptr;
    expect_stored_values(written, hp, before, arena, states, entry);
  }
}

// The introspection entry points and forge_run_scalars_fill.
void fuzz_queries(ByteReader& in) {
  char text[40];
  const size_t len = static_cast<size_t>(in.range(0, sizeof(text) - 1));
  for (size_t i = 0; i < len; ++i) text[i] = static_cast<char>(in.byte());
  text[len] = '\0';
  const int32_t kind = in.chance(4) ? static_cast<int32_t>(in.bits(4)) : static_cast<int32_t>(in.range(0, FORGE_ENUM_COUNT));
  const int32_t v = in.chance(4) ? static_cast<int32_t>(in.bits(4)) : static_cast<int32_t>(in.range(-1, 9));
  int32_t out_int = 0x5A5A;
  const char* name = nullptr;
  int64_t size = 0;
  switch (in.range(0, 7)) {
    case 0: {
      const forge_status s = forge_enum_count(kind, in.chance(10) ? nullptr : &out_int);
      if (s == FORGE_OK && (out_int <= 0 || out_int > 16)) violated("forge_enum_count: %d", out_int);
      break;
    }
    case 1: {
      const forge_status s = forge_enum_name(kind, v, in.chance(10) ? nullptr : &name);
      if (s == FORGE_OK && (!name || !*name)) violated("forge_enum_name: no name");
      if (s == FORGE_OK) {  // and back
        int32_t back = -7;
        if (forge_enum_value(kind, name, &back) != FORGE_OK || back != v) violated("forge_enum_value(forge_enum_name) is not the value");
      }
      break;
    }
    case 2: {
      const forge_status s = forge_enum_value(kind, in.chance(10) ? nullptr : text, &out_int);
      if (s == FORGE_OK) {
        const char* back = nullptr;
        if (forge_enum_name(kind, out_int, &back) != FORGE_OK || strcasecmp(back, text) != 0) violated("forge_enum_name(forge_enum_value) is not the name");
      } else if (out_int != 0x5A5A) {
        violated("forge_enum_value: refused, and wrote its output");
      }
      break;
    }
    case 3: {
      forge_rule_info info;
      std::memset(&info, 0x5A, sizeof(info));
      const forge_status s = forge_rule_query(v, in.chance(10) ? nullptr : &info);
      if (s == FORGE_OK && (info.num_fields < 0 || info.num_fields > FORGE_MAX_RULE_FIELDS || info.max_states < 0 ||
                            info.max_states > FORGE_MAX_STATES))
        violated("forge_rule_query: counts out of range");
      break;
    }
    case 4: {
      const forge_status s = forge_struct_size(in.chance(10) ? nullptr : text, &size);
      if (s == FORGE_OK && size <= 0) violated("forge_struct_size: %lld", static_cast<long long>(size));
      break;
    }
    case 5: {
      forge_hparams hp;
      std::memset(&hp, 0x5A, sizeof(hp));
      const forge_hparams untouched = hp;
      const forge_status s = forge_hparams_default(v, in.chance(10) ? nullptr : &hp);
      if (s != FORGE_OK && std::memcmp(&hp, &untouched, sizeof(hp)) != 0) violated("forge_hparams_default: refused, and wrote its output");
      break;
    }
    case 6: {
      forge_hparams hp = make_hparams(in);
      forge_state_layout layout;
      std::memset(&layout, 0x5A, sizeof(layout));
      const forge_state_layout untouched = layout;
      const Shape shape = make_shape(in, 1 << 20, 1 << 20);
      const int32_t format = in.chance(5) ? static_cast<int32_t>(in.bits(4)) : static_cast<int32_t>(in.range(0, FORGE_STATE_FORMAT_COUNT - 1));
      const forge_status s = forge_state_layout_query(in.chance(20) ? nullptr : &hp, format, shape.rows, shape.cols,
                                                      in.chance(20) ? nullptr : &layout);
      if (s != FORGE_OK && std::memcmp(&layout, &untouched, sizeof(layout)) != 0) violated("forge_state_layout_query: refused, and wrote its output");
      if (s == FORGE_OK)
        for (int i = 0; i < layout.num_states; ++i)
          if (layout.state_bytes[i] <= 0 || layout.absmax_count[i] < 0) violated("forge_state_layout_query: sizes out of range");
      break;
    }
    default: {
      forge_hparams hp = make_hparams(in);
      RunBuffer run;
      std::memset(run.bytes, 0x5A, sizeof(run.bytes));
      const RunBuffer untouched = run;
      const int64_t bytes = in.chance(5) ? in.pick_of<int64_t>({0, -1, 255, INT64_MIN}) : FORGE_RUN_SCALARS_BYTES;
      const forge_status s = forge_run_scalars_fill(in.chance(20) ? nullptr : &hp, in.chance(20) ? nullptr : run.bytes, bytes);
      if (s != FORGE_OK && std::memcmp(&run, &untouched, sizeof(run)) != 0) violated("forge_run_scalars_fill: refused, and wrote its output");
      if (s == FORGE_OK && forge_run_scalars_fill(&hp, run.bytes, bytes) != FORGE_OK) violated("forge_run_scalars_fill: not deterministic in its acceptance");
      break;
    }
  }
  if (std::strlen(forge_last_error()) >= 1024) violated("message longer than the buffer");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  ByteReader in(data, size);
  switch (in.range(0, 9)) {
    case 0: case 1: case 2: fuzz_step(in, true); break;
    case 3: case 4: fuzz_step(in, false); break;
    case 5: case 6: fuzz_batch(in); break;
    case 7: fuzz_state(in, static_cast<int>(in.range(0, 2))); break;
    default: fuzz_queries(in); break;
  }
  return 0;
}
