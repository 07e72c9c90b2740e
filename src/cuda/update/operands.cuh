// operands.cuh — the update's operands in their storage formats: a quad of a state loaded to
// fp32 and stored back (load_state_quad, store_state_quad: rounding, encoding), a batch's
// results stored (store_quads: the weight, its master and the states, with their
// stochastic-rounding draws), and a batch's raw words loaded ahead of its update (RawQuads:
// software pipelining). Every conversion is formats.h's, bit for bit.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include "core/formats.h"
#include "core/rng.h"
#include "core/rules.h"
#include "cuda/update/block_codecs.cuh"
#include "cuda/update/block_states.cuh"
#include "cuda/update/fast_math.cuh"
#include "cuda/update/quads.cuh"
#include "cuda/update/spec.cuh"
#include "forge/forge.h"

namespace forge {
namespace cuda {

// ---- state i of a quad, in fp32 -----------------------------------------------------------------

// kStateFormat: the state format as a compile-time constant, or kAny (p.state_format).
template <int kStateFormat = kAny>
__device__ __forceinline__ void load_state_quad(const ParamView& p, int i, bool is_signed,
                                                int64_t row, int64_t col, int64_t idx, int n,
                                                bool vec, float (&v)[kQuad]) {
  switch (kStateFormat != kAny ? kStateFormat : p.state_format) {
    case FORGE_STATE_FP32:
      load_quad_f32(static_cast<const float*>(p.state[i]), idx, n, vec, v);
      break;
    case FORGE_STATE_BF16:
    case FORGE_STATE_BF16_STOCHASTIC:
      load_quad_bf16(static_cast<const uint16_t*>(p.state[i]), idx, n, vec, v);
      break;
    case FORGE_STATE_FP8_BLOCK64: {
      uint8_t c[kQuad];
      load_quad_codes(static_cast<const uint8_t*>(p.state[i]), idx, n, vec, c);
      const float absmax =
          n > 0 ? p.absmax[i][row * p.blocks_per_row + col / FORGE_INT8_BLOCK] : 0.0f;
      uint32_t codes = 0;
#pragma unroll
      for (int e = 0; e < kQuad; ++e) codes |= static_cast<uint32_t>(c[e]) << (8 * e);
      fp8_quad_values(codes, is_signed, absmax / fp8_format(is_signed).top, v);
      break;
    }
    case FORGE_STATE_INT4_BLOCK64: {
      const uint32_t codes =
          load_quad_int4(static_cast<const uint8_t*>(p.state[i]), p.int4_byte(row, col), n, vec);
      const float absmax =
          n > 0 ? p.absmax[i][row * p.blocks_per_row + col / FORGE_INT8_BLOCK] : 0.0f;
#pragma unroll
      for (int e = 0; e < kQuad; ++e) v[e] = int4_decode_fast(codes >> (4 * e), is_signed, absmax);
      break;
    }
    default: {  // FORGE_STATE_INT8_BLOCK64
      uint8_t c[kQuad];
      load_quad_codes(static_cast<const uint8_t*>(p.state[i]), idx, n, vec, c);
      const float absmax =
          n > 0 ? p.absmax[i][row * p.blocks_per_row + col / FORGE_INT8_BLOCK] : 0.0f;
#pragma unroll
      for (int e = 0; e < kQuad; ++e) v[e] = int8_decode_fast(c[e], is_signed) * absmax;
    }
  }
}

// Stores state i of a quad. `stochastic` selects stochastic rounding with stream 1 + i of
// `draw` (QuadDraws) for FORGE_STATE_BF16_STOCHASTIC (a step passes true and its draws;
// state conversions pass false = nearest, as the CPU does). For block states every lane of the
// warp must call this (absmax shuffle).
// kNonNan: every value is known not to be NaN (the fast epilogue path), so bf16 nearest
// rounding may use the hardware conversion and stochastic rounding skips its NaN test.
template <int kStateFormat = kAny, bool kNonNan = false>
__device__ __forceinline__ void store_state_quad(const ParamView& p, int i, bool is_signed,
                                                 int64_t row, int64_t col, int64_t idx, int n,
                                                 bool vec, unsigned keep, int lane16,
                                                 bool stochastic, const QuadDraws& draw,
                                                 const float (&v)[kQuad]) {
  const int format = kStateFormat != kAny ? kStateFormat : p.state_format;
  switch (format) {
    case FORGE_STATE_FP32:
      store_quad_f32(static_cast<float*>(p.state[i]), idx, n, vec, keep, v);
      break;
    case FORGE_STATE_BF16:
    case FORGE_STATE_BF16_STOCHASTIC: {
      uint16_t h[kQuad];
      if (stochastic && format == FORGE_STATE_BF16_STOCHASTIC && kNonNan) {
#pragma unroll
        for (int e = 0; e < kQuad; e += 2) {
          const uint32_t pair = bf16x2_stochastic_nonnan(v[e], v[e + 1], draw.bits(e, 1 + i),
                                                         draw.bits(e + 1, 1 + i));
          h[e] = static_cast<uint16_t>(pair & 0xFFFFu);
          h[e + 1] = static_cast<uint16_t>(pair >> 16);
        }
      } else if (stochastic && format == FORGE_STATE_BF16_STOCHASTIC) {
#pragma unroll
        for (int e = 0; e < kQuad; ++e) h[e] = bf16_stochastic(v[e], draw.bits(e, 1 + i));
      } else if (kNonNan) {
#pragma unroll
        for (int e = 0; e < kQuad; e += 2) {
          const uint32_t pair = bf16x2_nearest_nonnan(v[e], v[e + 1]);
          h[e] = static_cast<uint16_t>(pair & 0xFFFFu);
          h[e + 1] = static_cast<uint16_t>(pair >> 16);
        }
      } else {
#pragma unroll
        for (int e = 0; e < kQuad; ++e) h[e] = bf16_nearest(v[e]);
      }
      store_quad_u16(static_cast<uint16_t*>(p.state[i]), idx, n, vec, keep, h);
      break;
    }
    default: {  // int8 / fp8 / int4: the block's absmax, then every code of the block
      const bool fp8 = format == FORGE_STATE_FP8_BLOCK64;
      float* const absmax_slot = &p.absmax[i][row * p.blocks_per_row + col / FORGE_INT8_BLOCK];
      float amax = 0.0f;
      unsigned code_keep = 0u;
      if (__any_sync(0xFFFFFFFFu, keep != 0u)) {  // uniform: a skipped element in the warp
        amax = kept_block_absmax(absmax_slot, n, keep, lane16, fp8, v, code_keep);
      } else {
#pragma unroll
        for (int e = 0; e < kQuad; ++e)
          if (e < n) amax = fmaxf(amax, fabsf(v[e]));
        amax = group_max(amax);
        if (fp8) amax = fp8_block_absmax(amax);
      }
      if (n > 0) {
        uint32_t codes;
        if (format == FORGE_STATE_INT4_BLOCK64) {
          float ratio[kQuad];
          if (!int8_quad_ratios(amax, v, ratio)) int8_quad_ratios_ieee(amax, v, ratio);
          store_quad_int4(static_cast<uint8_t*>(p.state[i]), p.int4_byte(row, col), n, vec,
                          code_keep, int4_quad_codes(v, ratio, is_signed));
          if (lane16 == 0) *absmax_slot = amax;
          break;
        }
        if (fp8) {
          const float factor = fp8_format(is_signed).top / amax;
          codes = fp8_quad_codes(v, factor, amax >= kFp8MinAbsmax, is_signed);
        } else {
          float ratio[kQuad];
          if (!int8_quad_ratios(amax, v, ratio)) int8_quad_ratios_ieee(amax, v, ratio);
          codes = int8_quad_codes(v, ratio, is_signed);
        }
        store_quad_codes(static_cast<uint8_t*>(p.state[i]), idx, n, vec, code_keep, codes);
        // lane 0 of the group holds the block's first column, so it is in range whenever
        // any column of the block is
        if (lane16 == 0) *absmax_slot = amax;
      }
    }
  }
}

// ---- stores of a batch of quads -----------------------------------------------------------------

// The weight stores of kQ quads: w the fp32 values (fp32 weight, master), h their bf16 bits.
template <int kQ>
__device__ __forceinline__ void store_weight_quads(const ParamView& p, int weight_format,
                                                   const int64_t (&idx)[kQ], const int (&n)[kQ],
                                                   const bool (&vec)[kQ],
                                                   const unsigned (&keep)[kQ],
                                                   const float (&w)[kQ][kQuad],
                                                   const uint16_t (&h)[kQ][kQuad]) {
#pragma unroll
  for (int q = 0; q < kQ; ++q) {
    if (weight_format == FORGE_WEIGHT_FP32) {
      store_quad_f32(static_cast<float*>(p.weight), idx[q], n[q], vec[q], keep[q], w[q]);
    } else {
      store_quad_u16(static_cast<uint16_t*>(p.weight), idx[q], n[q], vec[q], keep[q], h[q]);
      if (weight_format == FORGE_WEIGHT_BF16_MASTER)
        store_quad_f32(p.master, idx[q], n[q], vec[q], keep[q], w[q]);
    }
  }
}

// Stores the updated weight and states of kQ quads (update_quads' arguments; keep[q]: the
// skipped elements). kNonNan: the states were checked finite (the FastMath path).
// kAligned, kPaired: as update_loaded's.
// NOTE: the weight always takes the NaN-free conversions (bf16x2_nearest_nonnan,
// bf16x2_stochastic_nonnan): every weight this stores is one apply_rule accepted, which is
// storable, so not NaN (forge.h, "Skipped elements"); a skipped element's or an out-of-range
// element's value, which may be, is converted but never stored. So the block states' batch,
// which has one store path for both outcomes, has one conversion path too, not a merge of two.
template <int kQ, class Spec, bool kNonNan, bool kAligned = false, bool kPaired = false>
__device__ __forceinline__ void store_quads(const RuleScalars& k, const ParamView& p,
                                            const int64_t (&row)[kQ], const int64_t (&col)[kQ],
                                            const int64_t (&idx)[kQ], const int (&n)[kQ],
                                            const bool (&vec)[kQ], const unsigned (&keep)[kQ],
                                            int lane16, const float (&w)[kQ][kQuad],
                                            const float (&s)[FORGE_MAX_STATES][kQ][kQuad]) {
  constexpr int kSF = Spec::kStateFormat;
  const int weight_format = Spec::kGeneric ? p.weight_format : Spec::kWeightFormat;
  const int num_states = Spec::kGeneric ? k.num_states : Spec::kNumStates;
  const int state_format = Spec::kGeneric ? p.state_format : kSF;
  // Folds to a constant for a specialized Spec.
  const bool stochastic = weight_format == FORGE_WEIGHT_BF16_STOCHASTIC ||
                          (num_states > 0 && state_format == FORGE_STATE_BF16_STOCHASTIC);
  if constexpr (is_block_format(kSF) && Spec::kNumStates > 0)
    store_block_states<kQ, Spec::kNumStates, Spec::kRule, kSF, kPaired>(p, row, col, idx, n,
                                                                         vec, keep, s);
  uint16_t h[kQ][kQuad];  // the bf16 weights' bits (bf16 and master formats)
#pragma unroll
  for (int q = 0; q < kQ; ++q) {
    // NOTE: aligned quads step quad 0's counter by their offset from it (a constant in the
    // pipelined passes, whose quads lie a fixed number of columns apart), not a 64-bit shift
    // and multiply per quad.
    const int64_t sr_idx = p.sr_index(row[q], idx[q]);
    const uint64_t z =
        kAligned ? QuadDraws::counter(k.sr_key, p.sr_index(row[0], idx[0])) +
                       static_cast<uint64_t>(sr_idx - p.sr_index(row[0], idx[0])) * kRngIndexMul
                 : QuadDraws::counter(k.sr_key, sr_idx);
    const QuadDraws draw(k.sr_key, sr_idx, kAligned || vec[q], stochastic, z);
#pragma unroll
    for (int i = 0; i < FORGE_MAX_STATES; ++i) {
      const bool is_signed =
          Spec::kGeneric ? k.state_signed[i] != 0 : spec_state_signed(Spec::kRule, i);
      if (i < num_states && !is_block_format(kSF))  // block states: stored above
        store_state_quad<kSF, kNonNan>(p, i, is_signed, row[q], col[q], idx[q], n[q], vec[q],
                                       keep[q], lane16, true, draw, s[i][q]);
    }
    switch (weight_format) {
      case FORGE_WEIGHT_FP32:
        break;
      case FORGE_WEIGHT_BF16:
      case FORGE_WEIGHT_BF16_MASTER:
#pragma unroll
        for (int e = 0; e < kQuad; e += 2) {
          const uint32_t pair = bf16x2_nearest_nonnan(w[q][e], w[q][e + 1]);
          h[q][e] = static_cast<uint16_t>(pair & 0xFFFFu);
          h[q][e + 1] = static_cast<uint16_t>(pair >> 16);
        }
        break;
      default:  // FORGE_WEIGHT_BF16_STOCHASTIC
#pragma unroll
        for (int e = 0; e < kQuad; e += 2) {
          const uint32_t pair = bf16x2_stochastic_nonnan(w[q][e], w[q][e + 1], draw.bits(e, 0),
                                                         draw.bits(e + 1, 0));
          h[q][e] = static_cast<uint16_t>(pair & 0xFFFFu);
          h[q][e + 1] = static_cast<uint16_t>(pair >> 16);
        }
    }
  }
  // NOTE: the weight stores in two copies, the masked one only where a quad has a skipped
  // element (block states' fast path: one store path for both outcomes, so keep is a run-time
  // zero there): one branch per batch instead of one per quad and array.
  unsigned any_keep = 0u;
#pragma unroll
  for (int q = 0; q < kQ; ++q) any_keep |= keep[q];
  if (any_keep == 0u) {
    const unsigned none[kQ] = {};
    store_weight_quads<kQ>(p, weight_format, idx, n, vec, none, w, h);
  } else {
    store_weight_quads<kQ>(p, weight_format, idx, n, vec, keep, w, h);
  }
}

// ---- raw operands of whole quads, for software pipelining ---------------------------------------
//
// The weight and states of kQ whole, vector-aligned quads as loaded (bf16 bits, int8 / fp8 /
// int4 codes and absmax, fp32 words), not yet converted: a tile loop loads the next batch into
// one of these before it updates the current one, so those loads are in flight during the
// update, and converts them (unpack) only when it gets to them. Specialized Specs only
// (formats known at compile time).
template <class Spec, int kQ, bool kPaired = false>
struct RawQuads {
  static_assert(!Spec::kGeneric, "raw loads need the formats at compile time");
  using Blocks = QuadBlocks<kPaired, kQ>;
  static constexpr int kPerState = Blocks::kPerState;
  static constexpr int kWF = Spec::kWeightFormat, kSF = Spec::kStateFormat;
  static constexpr int kNS = Spec::kNumStates > 0 ? Spec::kNumStates : 1;
  static constexpr bool kWeight32 = kWF == FORGE_WEIGHT_FP32 || kWF == FORGE_WEIGHT_BF16_MASTER;
  static constexpr bool kInt4 = kSF == FORGE_STATE_INT4_BLOCK64;
  static constexpr int kStateWords = kSF == FORGE_STATE_FP32 ? 4 : is_block_format(kSF) ? 1 : 2;
  // Absmax words: int8 and int4 decode with each of the lane's blocks' absmax; fp8 needs only
  // one (the decode factors are spread over the block's lanes: lane_block).
  static constexpr bool kFp8 = kSF == FORGE_STATE_FP8_BLOCK64;
  static constexpr int kAbsmaxWords =
      kSF == FORGE_STATE_INT8_BLOCK64 || kInt4 ? kPerState * Spec::kNumStates
                                               : kFp8 && Spec::kNumStates > 0 ? 1 : 0;
  // Registers one batch holds while in flight.
  static constexpr int kWords =
      kQ * ((kWeight32 ? 4 : 2) + Spec::kNumStates * kStateWords) + kAbsmaxWords;
  uint32_t w[kQ][kWeight32 ? 4 : 2];  // fp32 words or bf16 pairs
  uint32_t s[kNS][kQ][kStateWords];   // fp32 words, bf16 pairs, 4 int8 / fp8 or int4 codes
  float absmax[kNS][kPerState];       // int8 and int4 only: the lane's blocks
  float block_absmax;                 // fp8 only: the absmax of the lane's block (lane_block)

  __device__ __forceinline__ void load(const ParamView& p, const int64_t (&row)[kQ],
                                       const int64_t (&col)[kQ], const int64_t (&idx)[kQ]) {
#pragma unroll
    for (int q = 0; q < kQ; ++q) {
      if constexpr (kWeight32) {
        const float* base =
            kWF == FORGE_WEIGHT_FP32 ? static_cast<const float*>(p.weight) : p.master;
        const uint4 v = *reinterpret_cast<const uint4*>(base + idx[q]);
        w[q][0] = v.x; w[q][1] = v.y; w[q][2] = v.z; w[q][3] = v.w;
      } else if constexpr (is_block_format(kSF) && kWF == FORGE_WEIGHT_BF16_STOCHASTIC) {
        // NOTE: a stochastically rounded weight next to block states is read cache-streaming
        // (evict first): faster there; beside a nearest weight it is slower.
        const uint16_t* base = static_cast<const uint16_t*>(p.weight);
        const uint2 v = __ldcs(reinterpret_cast<const uint2*>(base + idx[q]));
        w[q][0] = v.x; w[q][1] = v.y;
      } else {
        const uint16_t* base = static_cast<const uint16_t*>(p.weight);
        const uint2 v = *reinterpret_cast<const uint2*>(base + idx[q]);
        w[q][0] = v.x; w[q][1] = v.y;
      }
#pragma unroll
      for (int i = 0; i < Spec::kNumStates; ++i) {
        if constexpr (kSF == FORGE_STATE_FP32) {
          const float* base = static_cast<const float*>(p.state[i]);
          const uint4 v = *reinterpret_cast<const uint4*>(base + idx[q]);
          s[i][q][0] = v.x; s[i][q][1] = v.y; s[i][q][2] = v.z; s[i][q][3] = v.w;
        } else if constexpr (kInt4) {
          const uint8_t* base = static_cast<const uint8_t*>(p.state[i]);
          s[i][q][0] = *reinterpret_cast<const uint16_t*>(base + p.int4_byte(row[q], col[q]));
          if (q < kPerState)
            absmax[i][q] = p.absmax[i][row[q] * p.blocks_per_row + col[q] / FORGE_INT8_BLOCK];
        } else if constexpr (is_block_format(kSF)) {
          const uint8_t* base = static_cast<const uint8_t*>(p.state[i]);
          s[i][q][0] = *reinterpret_cast<const uint32_t*>(base + idx[q]);
          if constexpr (!kFp8) {
            if (q < kPerState)
              absmax[i][q] = p.absmax[i][row[q] * p.blocks_per_row + col[q] / FORGE_INT8_BLOCK];
          }
        } else {
          const uint16_t* base = static_cast<const uint16_t*>(p.state[i]);
          const uint2 v = *reinterpret_cast<const uint2*>(base + idx[q]);
          s[i][q][0] = v.x; s[i][q][1] = v.y;
        }
      }
    }
    if constexpr (kFp8 && Spec::kNumStates > 0) {
      const int block = lane_block<Spec::kNumStates, kPerState, Blocks::kLanes>();
      const int state = block / kPerState, quad = block % kPerState;  // quad q holds block q
      const float* base = p.absmax[0];
      int64_t r = row[0], c = col[0];
#pragma unroll
      for (int i = 1; i < Spec::kNumStates; ++i)
        if (state == i) base = p.absmax[i];
#pragma unroll
      for (int q = 1; q < kPerState; ++q)
        if (quad == q) {
          r = row[q];
          c = col[q];
        }
      block_absmax = base[r * p.blocks_per_row + c / FORGE_INT8_BLOCK];
    }
  }

  // The same fp32 values load_quad_* / load_state_quad produce.
  __device__ __forceinline__ void unpack(float (&wf)[kQ][kQuad],
                                         float (&sf)[FORGE_MAX_STATES][kQ][kQuad]) const {
    // fp8: every block's decode factor first, one per lane (lane_block), then shuffled
    float factor[kNS][kPerState] = {};
    if constexpr (kFp8 && Spec::kNumStates > 0) {
      const int block = lane_block<Spec::kNumStates, kPerState, Blocks::kLanes>();
      gather_blocks<kNS, kPerState, Blocks::kLanes>(
          fp8_lane_factor<true, Spec::kRule, Spec::kNumStates>(block_absmax, block / kPerState),
          factor);
    }
#pragma unroll
    for (int q = 0; q < kQ; ++q) {
#pragma unroll
      for (int e = 0; e < kQuad; ++e) {
        if constexpr (kWeight32) {
          wf[q][e] = __uint_as_float(w[q][e]);
        } else {
          wf[q][e] = bf16_to_float(static_cast<uint16_t>(w[q][e / 2] >> (16 * (e % 2))));
        }
      }
#pragma unroll
      for (int i = 0; i < FORGE_MAX_STATES; ++i) {
        if constexpr (kSF == FORGE_STATE_FP8_BLOCK64) {
          if (i < Spec::kNumStates) {
            fp8_quad_values(s[i][q][0], spec_state_signed(Spec::kRule, i),
                            factor[i][Blocks::of(q)], sf[i][q]);
            continue;
          }
        }
#pragma unroll
        for (int e = 0; e < kQuad; ++e) {
          if (i >= Spec::kNumStates) {
            sf[i][q][e] = 0.0f;
          } else if constexpr (kSF == FORGE_STATE_FP32) {
            sf[i][q][e] = __uint_as_float(s[i][q][e]);
          } else if constexpr (kSF == FORGE_STATE_INT8_BLOCK64) {
            const uint8_t code = static_cast<uint8_t>(s[i][q][0] >> (8 * e));
            const bool is_signed = spec_state_signed(Spec::kRule, i);
            sf[i][q][e] = int8_decode_fast(code, is_signed) * absmax[i][Blocks::of(q)];
          } else if constexpr (kInt4) {
            sf[i][q][e] = int4_decode_fast(s[i][q][0] >> (4 * e), spec_state_signed(Spec::kRule, i),
                                           absmax[i][Blocks::of(q)]);
          } else {
            sf[i][q][e] = bf16_to_float(static_cast<uint16_t>(s[i][q][e / 2] >> (16 * (e % 2))));
          }
        }
      }
    }
  }
};

// Registers a RawQuads batch occupies (a huge number for the generic Spec, which has none).
template <class Spec, int kQ>
__host__ __device__ constexpr int raw_quads_words() {
  if constexpr (Spec::kGeneric) {
    return 1 << 30;
  } else {
    return RawQuads<Spec, kQ>::kWords;
  }
}

}  // namespace cuda
}  // namespace forge
