// cpu_backend.cpp — the CPU backend: the executable specification every other
// backend is checked against.
//
// wgrad_step: W is cut into [tile_rows × tile_cols] tiles (OpenMP over tiles).
// A tile's dW is accumulated in an fp32 buffer of the tile's size, token by
// token in ascending order (acc += dy * x, each product rounded, no FMA), so it
// is bit-identical to a naive dW = dYᵀX summed in the same order; how that runs
// at SIMD speed without changing the order is cpu_wgrad_tile.h. The rule is
// then applied row segment by row segment (≤ 64 elements, one int8 block).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>

#if defined(_OPENMP)
#include <omp.h>
#endif

#include "backend.h"
#include "cpu/cpu_wgrad_tile.h"
#include "core/formats.h"
#include "core/rules.h"
#include "core/run_scalars.h"
#include "core/status.h"

namespace forge {
namespace cpu {
namespace {

constexpr int kDefaultTile = 128;
constexpr int kSegment = FORGE_INT8_BLOCK;  // elements updated together (one int8 block)

float load_input(const void* base, int32_t dtype, int64_t i) {
  switch (dtype) {
    case FORGE_DTYPE_FP32: return static_cast<const float*>(base)[i];
    case FORGE_DTYPE_BF16: return bf16_to_float(static_cast<const uint16_t*>(base)[i]);
    default: return fp16_to_float(static_cast<const uint16_t*>(base)[i]);
  }
}

int64_t absmax_index(const forge_param& p, int64_t row, int64_t col0) {
  const int64_t blocks_per_row = (p.cols + FORGE_INT8_BLOCK - 1) / FORGE_INT8_BLOCK;
  return row * blocks_per_row + col0 / FORGE_INT8_BLOCK;
}

// Reads n fp32 values of state `i` starting at (row, col0). For block states (int8, fp8, int4),
// [col0, col0 + n) is one whole block.
void load_state(const forge_param& p, int i, bool is_signed, int64_t row, int64_t col0, int n,
                float* out) {
  const int64_t base = row * p.cols + col0;
  switch (p.state_format) {
    case FORGE_STATE_FP32:
      std::memcpy(out, static_cast<const float*>(p.state[i]) + base, sizeof(float) * n);
      break;
    case FORGE_STATE_BF16:
    case FORGE_STATE_BF16_STOCHASTIC: {
      const uint16_t* s = static_cast<const uint16_t*>(p.state[i]) + base;
      for (int e = 0; e < n; ++e) out[e] = bf16_to_float(s[e]);
      break;
    }
    case FORGE_STATE_INT8_BLOCK64: {
      const uint8_t* s = static_cast<const uint8_t*>(p.state[i]) + base;
      const float absmax = p.state_absmax[i][absmax_index(p, row, col0)];
      for (int e = 0; e < n; ++e) out[e] = int8_decode(s[e], is_signed) * absmax;
      break;
    }
    case FORGE_STATE_FP8_BLOCK64: {
      const uint8_t* s = static_cast<const uint8_t*>(p.state[i]) + base;
      const float absmax = p.state_absmax[i][absmax_index(p, row, col0)];
      for (int e = 0; e < n; ++e) out[e] = fp8_decode(s[e], absmax, is_signed);
      break;
    }
    case FORGE_STATE_INT4_BLOCK64: {
      const uint8_t* s = static_cast<const uint8_t*>(p.state[i]) + row * int4_row_bytes(p.cols);
      const float absmax = p.state_absmax[i][absmax_index(p, row, col0)];
      for (int e = 0; e < n; ++e)
        out[e] = int4_decode(int4_code_at(s, col0 + e), absmax, is_signed);
      break;
    }
  }
}

// Writes n fp32 values to state `i`. Elements with keep[e] set (skipped by the step) are
// left as they are. For block states (int8, fp8, int4), where a block shares one scale: a
// block with no skipped element takes the largest magnitude of its values as its absmax (fp8:
// 0 below kFp8MinAbsmax, formats.h); one holding a skipped element takes
// block_absmax_with_skipped(its old absmax, the updated elements' largest magnitude)
// (formats.h: the old one while that fits, else the old one times a power of two), and its
// skipped elements keep their codes while the absmax stays, or are re-encoded from their
// decoded values (in[e], loaded against the old absmax) when it grew, which keeps their
// values (int4: the nearest code). `draw` (nullable: n draws packed as rng_draw packs them)
// selects stochastic rounding for FORGE_STATE_BF16_STOCHASTIC, with stream 1 + i's bits.
void store_state(const forge_param& p, int i, bool is_signed, int64_t row, int64_t col0, int n,
                 const float* in, const bool* keep, const uint64_t* draw) {
  const int64_t base = row * p.cols + col0;
  switch (p.state_format) {
    case FORGE_STATE_FP32: {
      float* s = static_cast<float*>(p.state[i]) + base;
      for (int e = 0; e < n; ++e)
        if (!keep || !keep[e]) s[e] = in[e];
      break;
    }
    case FORGE_STATE_BF16:
    case FORGE_STATE_BF16_STOCHASTIC: {
      uint16_t* s = static_cast<uint16_t*>(p.state[i]) + base;
      const bool stochastic = draw && p.state_format == FORGE_STATE_BF16_STOCHASTIC;
      for (int e = 0; e < n; ++e) {
        if (keep && keep[e]) continue;
        s[e] = stochastic ? bf16_stochastic(in[e], rng_stream_bits(draw[e], 1 + i))
                          : bf16_nearest(in[e]);
      }
      break;
    }
    case FORGE_STATE_INT8_BLOCK64:
    case FORGE_STATE_FP8_BLOCK64:
    case FORGE_STATE_INT4_BLOCK64: {
      float& block_absmax = p.state_absmax[i][absmax_index(p, row, col0)];
      bool any_kept = false;
      for (int e = 0; e < n; ++e) any_kept = any_kept || (keep && keep[e]);
      const float old_absmax = block_absmax;
      // (the updated magnitudes are never NaN; -inf: none was updated, as the CUDA epilogue
      // starts a block holding a skipped element)
      float updated_max = any_kept ? -INFINITY : 0.0f;
      for (int e = 0; e < n; ++e)
        if (!(keep && keep[e])) updated_max = std::max(updated_max, std::fabs(in[e]));
      const bool fp8 = p.state_format == FORGE_STATE_FP8_BLOCK64;
      const float absmax = any_kept ? block_absmax_with_skipped(old_absmax, updated_max, fp8)
                           : fp8    ? fp8_block_absmax(updated_max)
                                    : updated_max;
      const bool grew = float_bits(absmax) != float_bits(old_absmax);
      block_absmax = absmax;
      if (p.state_format == FORGE_STATE_INT4_BLOCK64) {
        uint8_t* s = static_cast<uint8_t*>(p.state[i]) + row * int4_row_bytes(p.cols);
        for (int e = 0; e < n; ++e)
          if (!(keep && keep[e]) || grew) {
            const int64_t col = col0 + e;
            s[col >> 1] =
                int4_store_code(s[col >> 1], col, p.cols, int4_encode(in[e], absmax, is_signed));
          }
        break;
      }
      uint8_t* s = static_cast<uint8_t*>(p.state[i]) + base;
      for (int e = 0; e < n; ++e)
        if (!(keep && keep[e]) || grew)
          s[e] = fp8 ? fp8_encode(in[e], absmax, is_signed) : int8_encode(in[e], absmax, is_signed);
      break;
    }
  }
}

// rng_draw(key, base + e) for e < n (base: the segment's first sr_index), but only the
// streams in `streams` (bit s: stream s; the others' fields stay 0): one rng_group_hash per
// group of 4 elements and stream.
void segment_draws(uint64_t key, int64_t base, int n, unsigned streams, uint64_t* draw) {
  for (int e = 0; e < n; ++e) draw[e] = 0;
  for (int stream = 0; stream < kRngStreams; ++stream) {
    if (!((streams >> stream) & 1u)) continue;
    uint64_t group = ~0ull, hash = 0;
    for (int e = 0; e < n; ++e) {
      const uint64_t index = static_cast<uint64_t>(base + e);
      if ((index >> 2) != group) {
        group = index >> 2;
        hash = rng_group_hash(key, group, stream);
      }
      draw[e] |= ((hash >> (16 * (index & 3))) & 0xFFFFu) << (16 * stream);
    }
  }
}

// Element (row, col)'s index for stochastic rounding: its index in the full parameter when
// `p` is a shard of one (forge_param's row_offset, col_offset, full_cols), so the bits do not
// depend on how the parameter is sharded; else row * cols + col.
int64_t sr_index(const forge_param& p, int64_t row, int64_t col) {
  if (p.full_cols == 0) return row * p.cols + col;
  return (p.row_offset + row) * p.full_cols + p.col_offset + col;
}

struct StepTotals {
  double grad_sq_sum = 0;
  int64_t nonfinite = 0;
};

// Applies the rule to the n ≤ 64 elements (row, col0 .. col0 + n) given their
// fp32 gradient g[0..n). For int8 states the segment is one whole block.
void update_segment(const RuleScalars& k, const forge_param& p, int64_t row, int64_t col0,
                    int n, const float* g, StepTotals& totals) {
  const int64_t base = row * p.cols + col0;
  float w[kSegment];
  float s[FORGE_MAX_STATES][kSegment];
  bool skipped[kSegment];
  switch (p.weight_format) {
    case FORGE_WEIGHT_FP32:
      std::memcpy(w, static_cast<const float*>(p.weight) + base, sizeof(float) * n);
      break;
    case FORGE_WEIGHT_BF16_MASTER:
      std::memcpy(w, p.master + base, sizeof(float) * n);
      break;
    default: {
      const uint16_t* wb = static_cast<const uint16_t*>(p.weight) + base;
      for (int e = 0; e < n; ++e) w[e] = bf16_to_float(wb[e]);
    }
  }
  for (int i = 0; i < k.num_states; ++i) load_state(p, i, k.state_signed[i], row, col0, n, s[i]);

  for (int e = 0; e < n; ++e) {
    float st[FORGE_MAX_STATES] = {};
    for (int i = 0; i < k.num_states; ++i) st[i] = s[i][e];
    float w_new = w[e], g_used;
    skipped[e] = !apply_rule(k, g[e], w_new, st, g_used);
    if (skipped[e]) {
      ++totals.nonfinite;
      continue;
    }
    totals.grad_sq_sum += static_cast<double>(g_used) * static_cast<double>(g_used);
    w[e] = w_new;
    for (int i = 0; i < k.num_states; ++i) s[i][e] = st[i];
  }

  uint64_t draw[kSegment];  // stochastic rounding's bits, packed per element as rng_draw's
  unsigned streams = p.weight_format == FORGE_WEIGHT_BF16_STOCHASTIC ? 1u : 0u;
  if (p.state_format == FORGE_STATE_BF16_STOCHASTIC)
    for (int i = 0; i < k.num_states; ++i) streams |= 2u << i;
  if (streams != 0) segment_draws(k.sr_key, sr_index(p, row, col0), n, streams, draw);
  for (int i = 0; i < k.num_states; ++i)
    store_state(p, i, k.state_signed[i], row, col0, n, s[i], skipped, draw);
  switch (p.weight_format) {
    case FORGE_WEIGHT_FP32: {
      float* wf = static_cast<float*>(p.weight) + base;
      for (int e = 0; e < n; ++e)
        if (!skipped[e]) wf[e] = w[e];
      break;
    }
    case FORGE_WEIGHT_BF16:
    case FORGE_WEIGHT_BF16_MASTER: {
      uint16_t* wb = static_cast<uint16_t*>(p.weight) + base;
      for (int e = 0; e < n; ++e) {
        if (skipped[e]) continue;
        wb[e] = bf16_nearest(w[e]);
        if (p.weight_format == FORGE_WEIGHT_BF16_MASTER) p.master[base + e] = w[e];
      }
      break;
    }
    case FORGE_WEIGHT_BF16_STOCHASTIC: {
      uint16_t* wb = static_cast<uint16_t*>(p.weight) + base;
      for (int e = 0; e < n; ++e)
        if (!skipped[e]) wb[e] = bf16_stochastic(w[e], rng_stream_bits(draw[e], 0));
      break;
    }
  }
}

// Updates row `row`, columns [c0, c1), from the fp32 gradient g[0 .. c1 - c0),
// in segments aligned to multiples of 64 columns (so int8 blocks are whole).
void update_row(const RuleScalars& k, const forge_param& p, int64_t row, int64_t c0, int64_t c1,
                const float* g, StepTotals& totals) {
  for (int64_t c = c0; c < c1;) {
    const int64_t end = std::min(c1, (c / kSegment + 1) * kSegment);
    update_segment(k, p, row, c, static_cast<int>(end - c), g + (c - c0), totals);
    c = end;
  }
}

// Threads for `work` independent items: the device's count (OpenMP's default for 0), never
// more than the items.
int thread_count(const forge_device& d, int64_t work) {
#if defined(_OPENMP)
  const int64_t want = d.num_threads > 0 ? d.num_threads : omp_get_max_threads();
  return static_cast<int>(std::max<int64_t>(1, std::min(want, work)));
#else
  (void)d;
  (void)work;
  return 1;
#endif
}

int thread_index() {
#if defined(_OPENMP)
  return omp_get_thread_num();
#else
  return 0;
#endif
}

void add_outputs(const forge_step_outputs& out, const StepTotals& totals) {
  if (out.grad_sq_sum) *out.grad_sq_sum += totals.grad_sq_sum;
  if (out.nonfinite_count) *out.nonfinite_count += totals.nonfinite;
}

// The scalars a step uses: hparams.run_scalars' (host memory here: what
// forge_run_scalars_fill wrote), once its tag matches this call, when set; else those the C
// API made from the call's hparams.
forge_status step_scalars(const forge_hparams& hp, const RuleScalars& call_k,
                          const RuleScalars** k) {
  *k = &call_k;
  if (!hp.run_scalars) return FORGE_OK;
  if (forge_status s = run_scalars_check(hp.run_scalars, hp, call_k)) return s;
  *k = static_cast<const RuleScalars*>(hp.run_scalars);
  return FORGE_OK;
}

// The tile height when the caller leaves it to the backend (tile_rows = 0): at most
// kDefaultTile rows, in a number of row tiles that is a multiple of the thread count and
// gives every thread at least two tiles (tiles of at least kMinDefaultTileRows rows), of
// equal heights rounded up to 8 rows. A small layer (the default forge-train model's are
// 128 × 128 and 352 × 128) then keeps every thread busy to the end. The tile shape changes no
// bit of the result: per element the token order is fixed.
int64_t default_tile_rows(int64_t rows, int64_t tiles_c, int threads) {
  constexpr int64_t kMinDefaultTileRows = 32;
  const int64_t t = std::max(1, threads);
  int64_t n = (rows + kDefaultTile - 1) / kDefaultTile;
  n = (n + t - 1) / t * t;
  while (n * tiles_c < 2 * t && rows / (2 * n) >= kMinDefaultTileRows) n *= 2;
  const int64_t tile_rows = ((rows + n - 1) / n + 7) / 8 * 8;
  return std::max<int64_t>(tile_rows, std::min<int64_t>(rows, kMinDefaultTileRows));
}

// The instruction set of the tile accumulation: the widest this CPU runs, found once.
TileIsa tile_isa() {
  static const TileIsa isa = best_tile_isa();
  return isa;
}

}  // namespace

forge_status wgrad_step(const forge_wgrad_args& a, const RuleScalars& call_k) {
  const RuleScalars* run_k;
  if (forge_status s = step_scalars(a.hparams, call_k, &run_k)) return s;
  const RuleScalars& k = *run_k;
  const forge_param& p = a.param;
  const int max_threads = thread_count(a.device, INT64_MAX);
  const int64_t tile_cols = a.tile_cols > 0 ? a.tile_cols : kDefaultTile;
  const int64_t tiles_c = (p.cols + tile_cols - 1) / tile_cols;
  const int64_t tile_rows = a.tile_rows > 0 ? a.tile_rows : default_tile_rows(p.rows, tiles_c, max_threads);
  const int64_t tiles_r = (p.rows + tile_rows - 1) / tile_rows;
  const int64_t num_tiles = tiles_r * tiles_c;
  const TileIsa isa = tile_isa();
  const TileBuffers sizes(std::min(tile_rows, p.rows), std::min(tile_cols, p.cols));
  StepTotals totals;
  double sq_sum = 0;
  int64_t nonfinite = 0;
  const int threads = thread_count(a.device, num_tiles);
  // NOTE: one fp32 accumulator tile and one dY and X panel of kTokenChunk tokens per thread,
  // reused across its tiles: the only memory this step allocates (threads × tile, never
  // rows × cols). Allocated before any thread starts (no exception can leave a parallel
  // region) and left uninitialised: zeroing it cost a fifth of a small layer's step.
  std::unique_ptr<float[]> scratch(new float[threads * sizes.total()]);

#pragma omp parallel num_threads(threads) reduction(+ : sq_sum, nonfinite)
  {
    float* const acc = scratch.get() + thread_index() * sizes.total();
    float* const dy_panel = acc + sizes.acc_floats;
    float* const x_panel = dy_panel + sizes.dy_floats;
    StepTotals mine;
#pragma omp for schedule(dynamic)
    for (int64_t tile = 0; tile < num_tiles; ++tile) {
      const int64_t r0 = (tile / tiles_c) * tile_rows, c0 = (tile % tiles_c) * tile_cols;
      const int64_t bm = std::min(tile_rows, p.rows - r0), bn = std::min(tile_cols, p.cols - c0);
      std::fill(acc, acc + sizes.acc_floats, 0.0f);
      // (the dtypes were checked by the C API: the casts are to values of the enum)
      const TileJob job{a.x, a.dy, static_cast<forge_dtype>(a.x_dtype),
                        static_cast<forge_dtype>(a.dy_dtype), a.ldx, a.lddy, a.tokens, r0, c0, bm, bn};
      accumulate_tile(isa, job, acc, sizes.ldacc, dy_panel, x_panel);  // [bm × bn] of dW
      for (int64_t i = 0; i < bm; ++i)
        update_row(k, p, r0 + i, c0, c0 + bn, acc + i * sizes.ldacc, mine);
    }
    sq_sum += mine.grad_sq_sum;
    nonfinite += mine.nonfinite;
  }
  totals.grad_sq_sum = sq_sum;
  totals.nonfinite = nonfinite;
  add_outputs(a.outputs, totals);
  return FORGE_OK;
}

forge_status elementwise_step(const forge_elementwise_args& a, const RuleScalars& call_k) {
  const RuleScalars* run_k;
  if (forge_status s = step_scalars(a.hparams, call_k, &run_k)) return s;
  const RuleScalars& k = *run_k;
  const forge_param& p = a.param;
  double sq_sum = 0;
  int64_t nonfinite = 0;
#pragma omp parallel num_threads(thread_count(a.device, p.rows)) reduction(+ : sq_sum, nonfinite)
  {
    StepTotals mine;
#pragma omp for schedule(static)
    for (int64_t row = 0; row < p.rows; ++row) {
      for (int64_t c0 = 0; c0 < p.cols; c0 += kSegment) {
        const int n = static_cast<int>(std::min<int64_t>(kSegment, p.cols - c0));
        float g[kSegment];
        for (int e = 0; e < n; ++e) g[e] = load_input(a.grad, a.grad_dtype, row * p.cols + c0 + e);
        update_segment(k, p, row, c0, n, g, mine);
      }
    }
    sq_sum += mine.grad_sq_sum;
    nonfinite += mine.nonfinite;
  }
  StepTotals totals;
  totals.grad_sq_sum = sq_sum;
  totals.nonfinite = nonfinite;
  add_outputs(a.outputs, totals);
  return FORGE_OK;
}

forge_status state_fill(const forge_param& p, int index, bool is_signed, float value,
                        const forge_device&) {
  float segment[kSegment];
  std::fill(segment, segment + kSegment, value);
  for (int64_t r = 0; r < p.rows; ++r)
    for (int64_t c = 0; c < p.cols; c += kSegment)
      store_state(p, index, is_signed, r, c, static_cast<int>(std::min<int64_t>(kSegment, p.cols - c)),
                  segment, nullptr, nullptr);
  return FORGE_OK;
}

forge_status state_to_fp32(const forge_param& p, int index, bool is_signed, float* out,
                           const forge_device&) {
  for (int64_t r = 0; r < p.rows; ++r)
    for (int64_t c = 0; c < p.cols; c += kSegment)
      load_state(p, index, is_signed, r, c, static_cast<int>(std::min<int64_t>(kSegment, p.cols - c)),
                 out + r * p.cols + c);
  return FORGE_OK;
}

forge_status state_from_fp32(const forge_param& p, int index, bool is_signed, const float* in,
                             const forge_device&) {
  // Nothing a step would never store: checked whole before anything is written.
  const int64_t n = p.rows * p.cols;
  for (int64_t i = 0; i < n; ++i)
    if (!storable(in[i]) || (!is_signed && in[i] < 0.0f))
      return refuse_state_value(i, in[i], index);
  for (int64_t r = 0; r < p.rows; ++r)
    for (int64_t c = 0; c < p.cols; c += kSegment)
      store_state(p, index, is_signed, r, c, static_cast<int>(std::min<int64_t>(kSegment, p.cols - c)),
                  in + r * p.cols + c, nullptr, nullptr);
  return FORGE_OK;
}

}  // namespace cpu

forge_status refuse_state_value(int64_t i, float value, int index) {
  if (!storable(value))
    return fail(FORGE_ERR_INVALID_ARGUMENT, "in[%lld]: %g is not a storable state value (finite, "
                "magnitude at most the largest bf16, %g)", static_cast<long long>(i),
                static_cast<double>(value), static_cast<double>(kBf16Max));
  return fail(FORGE_ERR_INVALID_ARGUMENT, "in[%lld]: %g is negative, but state %d is a second "
              "moment (unsigned)", static_cast<long long>(i), static_cast<double>(value), index);
}

}  // namespace forge
