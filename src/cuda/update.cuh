// update.cuh — the optimizer update of one parameter element group on the GPU: load the
// weight and states in their storage format, apply forge::apply_rule (src/core/rules.h,
// the very code the CPU backend runs), store them back. Shared by every CUDA kernel that
// updates a parameter: the fused wgrad epilogue, elementwise_step and the state kernels.
//
// Why a "quad": a thread owns 4 consecutive columns of one row, and the 16 lanes of a
// half-warp together own one int8 block of 64 columns (FORGE_INT8_BLOCK), so the block's
// absmax is a 4-step shuffle reduction and every global access is a 4-element vector
// (16 B fp32, 8 B bf16, 4 B int8) with 16 lanes covering one contiguous row segment. The fused
// kernels' pipelined passes over block states pair a lane's two quads in one block instead,
// 8 lanes per block (QuadBlocks, "a pass's blocks").
//
// Bit-exactness with the CPU (cpu_backend.cpp, update_segment/store_state): same fp32
// operations in the same order (the library is built with --fmad=false), the same format
// functions (formats.h), the same stochastic-rounding bits rng_bits(key, index, ·) with the
// element's index in the full parameter (ParamView::sr_index; row * cols + col unless the
// parameter is a shard), and the same skipping (forge.h, "Skipped elements"): an element whose
// gradient is not finite or whose new weight, master or a state would not be storable keeps
// its weight, master and fp32/bf16 states and is counted; an int8 or fp8 block holding one
// keeps its absmax while the updated elements' magnitudes fit, else grows it by a power of two
// (formats.h, block_absmax_with_skipped), and the skipped element keeps its code byte while that
// absmax is unchanged, or is re-encoded from its decoded value when it grew, keeping its value
// (kept_block_absmax). A step never stores a NaN it computed (an element whose results
// hold one is skipped), so no NaN payload can differ between the CPU and the GPU.
// int8 and fp8 states share the block layout (a code byte per element, an fp32 absmax per 64
// columns of a row): "block states" below means either.
//
// Compile-time specialization (UpdateSpec): the hot configurations (AdamW, Lion, SGD on bf16
// weights with bf16 / int8 / fp8 / fp32 states) get their rule, weight format, state format, state
// count and int8 signedness as template constants, so every run-time switch of the generic
// path folds away; GenericSpec (all kAny) is the run-time path every other configuration
// takes. Both call the same forge::apply_rule and formats.h functions: only the dispatch
// differs, never an fp32 operation.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include "core/formats.h"
#include "core/rng.h"
#include "core/rules.h"
#include "core/run_scalars.h"
#include "cuda/ptx.cuh"
#include "forge/forge.h"

namespace forge {
namespace cuda {

constexpr int kQuad = 4;                               // columns per thread
constexpr int kGroupLanes = FORGE_INT8_BLOCK / kQuad;  // lanes per int8 block: 16
static_assert(kGroupLanes == 16, "a half-warp owns one int8 block");

__host__ __device__ __forceinline__ int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

// int8 and fp8 states: a code byte per element, an fp32 absmax per 64-column block of a row.
__host__ __device__ constexpr bool is_block_format(int state_format) {
  return state_format == FORGE_STATE_INT8_BLOCK64 || state_format == FORGE_STATE_FP8_BLOCK64;
}

// ---- compile-time specialization ------------------------------------------------------------

constexpr int kAny = -1;  // "read it from the run-time RuleScalars / ParamView"

// States a rule keeps and whether state i is signed (int8 map): hparams.cpp's state_layout()
// for the rules that have an UpdateSpec. The host (spec_matches) checks them against the
// RuleScalars before it picks a specialized kernel, so a disagreement falls back to the
// generic path instead of computing something else.
__host__ __device__ constexpr int spec_num_states(int rule) {
  return rule == FORGE_RULE_ADAMW ? 2 : rule == FORGE_RULE_LION ? 1 : 0;
}
__host__ __device__ constexpr bool spec_state_signed(int rule, int i) {
  return (rule == FORGE_RULE_ADAMW || rule == FORGE_RULE_LION) && i == 0;
}

// kRule / kWeightFormat / kStateFormat: forge_rule / forge_weight_format /
// forge_state_format values, or kAny. A specialized spec (kRule != kAny) also assumes
// maximize == 0 and wd_coupled == 0 (AdamW with decoupled decay, Lion, SGD without decay):
// apply_rule's two branches on them then fold away. spec_matches() checks all of it.
// kRunScalars: the kernel reads the step's RuleScalars from device memory when it runs
// (forge_hparams.run_scalars: a CUDA graph replays with new ones), not from its launch
// parameters. A separate instantiation, so the usual kernels keep their scalars as
// constant-bank operands.
template <int kRuleT, int kWeightFormatT, int kStateFormatT, bool kRunScalarsT = false>
struct UpdateSpec {
  static constexpr int kRule = kRuleT;
  static constexpr int kWeightFormat = kWeightFormatT;
  static constexpr int kStateFormat = kStateFormatT;
  static constexpr bool kGeneric = kRuleT == kAny;
  static_assert(kGeneric == (kWeightFormatT == kAny), "specialize everything or nothing");
  static constexpr int kNumStates = kGeneric ? FORGE_MAX_STATES : spec_num_states(kRuleT);
  static constexpr bool kRunScalars = kRunScalarsT;
};
using GenericSpec = UpdateSpec<kAny, kAny, kAny>;
using GenericRunSpec = UpdateSpec<kAny, kAny, kAny, true>;

// Whether Spec computes exactly what the generic path would for this (k, p).
template <class Spec>
__host__ __device__ inline bool spec_matches(const RuleScalars& k, int weight_format,
                                             int state_format) {
  if (Spec::kGeneric) return true;
  if (k.rule != Spec::kRule || weight_format != Spec::kWeightFormat) return false;
  if (k.maximize != 0 || k.wd_coupled != 0.0f) return false;
  if (k.num_states != Spec::kNumStates) return false;
  if (Spec::kNumStates > 0 && state_format != Spec::kStateFormat) return false;
  for (int i = 0; i < Spec::kNumStates; ++i)
    if ((k.state_signed[i] != 0) != spec_state_signed(Spec::kRule, i)) return false;
  return true;
}

// The stochastic-rounding bits of a quad: bits(e, stream) == rng_bits(key, idx + e, stream),
// idx the quad's first element's index (ParamView::sr_index: its index in the full parameter
// when the parameter is a shard of one).
// `aligned`: idx % 4 == 0, so the quad is one rng.h group (every vector quad: ParamView::vec4
// needs cols % 4 == 0, quads start at col % 4 == 0, and a shard whose indices would break that
// gets no vector access: make_param_view): one rng_group_hash per stream, made here (a stream
// the step never reads is dead code). An unaligned quad straddles two groups: bits() hashes
// per element and stream.
struct QuadDraws {
  uint64_t key;
  int64_t idx;
  bool aligned;
  uint64_t group[kRngStreams];
  // `needed`: whether the step rounds anything stochastically (a constant for a specialized
  // Spec; without it, no hash at all).
  __device__ __forceinline__ QuadDraws(uint64_t key_, int64_t idx_, bool aligned_, bool needed)
      : QuadDraws(key_, idx_, aligned_, needed, counter(key_, idx_)) {}
  // The hash input of stream 0 of the group holding element idx_: key + (group · 4) ·
  // kRngIndexMul; stream s adds s · kRngIndexMul (rng.h allows the stepping). For two aligned
  // quads, counter(key, b) = counter(key, a) + (b - a) · kRngIndexMul.
  __device__ __forceinline__ static uint64_t counter(uint64_t key_, int64_t idx_) {
    return key_ + (static_cast<uint64_t>(idx_) >> 2) * (kRngStreams * kRngIndexMul);
  }
  // With the counter already made (`z` = counter(key_, idx_)).
  __device__ __forceinline__ QuadDraws(uint64_t key_, int64_t idx_, bool aligned_, bool needed,
                                       uint64_t z)
      : key(key_), idx(idx_), aligned(aligned_) {
    if (!needed) return;  // group[] unset: bits() is never called
    // NOTE: made here, not where bits() is called: computed at the stores, the hashes were
    // scheduled early and spilled (element-wise AdamW SR kernel: 60 B per thread).
#pragma unroll
    for (int stream = 0; stream < kRngStreams; ++stream, z += kRngIndexMul) group[stream] = sr_mix(z);
  }
  __device__ __forceinline__ uint32_t bits(int e, int stream) const {
    if (aligned) return static_cast<uint32_t>(group[stream] >> (16 * e)) & 0xFFFFu;
    return rng_bits(key, static_cast<uint64_t>(idx + e), stream);
  }
};

// Everything a kernel needs to know about the parameter being updated. Built on the
// host from forge_param; `vec4` says 4-element vector accesses are legal (cols % 4 == 0
// and every buffer 16-byte aligned).
struct ParamView {
  int64_t rows, cols;      // [rows, cols] row-major, contiguous
  int64_t blocks_per_row;  // ceil(cols / 64): row stride of the int8 / fp8 absmax arrays
  int32_t weight_format, state_format;
  int32_t vec4;
  void* weight;            // [rows, cols] fp32 or bf16
  float* master;           // [rows, cols] fp32 (FORGE_WEIGHT_BF16_MASTER only)
  void* state[FORGE_MAX_STATES];     // [rows, cols] fp32 / bf16 / uint8 codes
  float* absmax[FORGE_MAX_STATES];   // [rows, blocks_per_row] (int8 and fp8 only)
  // Stochastic rounding's element index (rng.h) of element (row, col), at offset
  // idx = row * cols + col: idx + sr_base + row * sr_row_extra. A shard's
  // (row_offset + row) * full_cols + col_offset + col (forge_param); 0 and 0 otherwise.
  int64_t sr_base, sr_row_extra;

  __host__ __device__ __forceinline__ int64_t sr_index(int64_t row, int64_t idx) const {
    return idx + sr_base + row * sr_row_extra;
  }
};

// Per-thread by-products of a step, reduced once per CTA at the end of a kernel.
struct StepTotals {
  double grad_sq_sum;
  unsigned int nonfinite;
};

// ---- quad loads and stores ---------------------------------------------------------------
// `idx` = row * cols + col of the quad's first element; `n` (0..4) elements are in range;
// `vec` = n == 4 and ParamView::vec4, so one aligned vector access is legal.

__device__ __forceinline__ void load_quad_f32(const float* base, int64_t idx, int n, bool vec,
                                              float (&v)[kQuad]) {
  if (vec) {
    const float4 q = *reinterpret_cast<const float4*>(base + idx);
    v[0] = q.x; v[1] = q.y; v[2] = q.z; v[3] = q.w;
  } else {
#pragma unroll
    for (int e = 0; e < kQuad; ++e) v[e] = e < n ? base[idx + e] : 0.0f;
  }
}

// A quad of 16-bit floats (bf16 or fp16: `to_float` converts one).
template <class ToFloat>
__device__ __forceinline__ void load_quad_16(const uint16_t* base, int64_t idx, int n, bool vec,
                                             float (&v)[kQuad], ToFloat to_float) {
  if (vec) {
    const uint2 q = *reinterpret_cast<const uint2*>(base + idx);
    v[0] = to_float(static_cast<uint16_t>(q.x & 0xFFFFu));
    v[1] = to_float(static_cast<uint16_t>(q.x >> 16));
    v[2] = to_float(static_cast<uint16_t>(q.y & 0xFFFFu));
    v[3] = to_float(static_cast<uint16_t>(q.y >> 16));
  } else {
#pragma unroll
    for (int e = 0; e < kQuad; ++e) v[e] = e < n ? to_float(base[idx + e]) : 0.0f;
  }
}

__device__ __forceinline__ void load_quad_bf16(const uint16_t* base, int64_t idx, int n, bool vec,
                                               float (&v)[kQuad]) {
  load_quad_16(base, idx, n, vec, v, [](uint16_t h) { return bf16_to_float(h); });
}

__device__ __forceinline__ void load_quad_codes(const uint8_t* base, int64_t idx, int n, bool vec,
                                                uint8_t (&c)[kQuad]) {
  if (vec) {
    const uint32_t q = *reinterpret_cast<const uint32_t*>(base + idx);
#pragma unroll
    for (int e = 0; e < kQuad; ++e) c[e] = static_cast<uint8_t>(q >> (8 * e));
  } else {
#pragma unroll
    for (int e = 0; e < kQuad; ++e) c[e] = e < n ? base[idx + e] : 0;
  }
}

// Stores element e unless bit e of `keep` is set (a skipped element).
__device__ __forceinline__ void store_quad_f32(float* base, int64_t idx, int n, bool vec,
                                               unsigned keep, const float (&v)[kQuad]) {
  if (vec && keep == 0) {
    *reinterpret_cast<float4*>(base + idx) = make_float4(v[0], v[1], v[2], v[3]);
  } else {
#pragma unroll
    for (int e = 0; e < kQuad; ++e)
      if (e < n && !((keep >> e) & 1u)) base[idx + e] = v[e];
  }
}

__device__ __forceinline__ void store_quad_u16(uint16_t* base, int64_t idx, int n, bool vec,
                                               unsigned keep, const uint16_t (&h)[kQuad]) {
  if (vec && keep == 0) {
    uint2 q;
    q.x = static_cast<uint32_t>(h[0]) | (static_cast<uint32_t>(h[1]) << 16);
    q.y = static_cast<uint32_t>(h[2]) | (static_cast<uint32_t>(h[3]) << 16);
    *reinterpret_cast<uint2*>(base + idx) = q;
  } else {
#pragma unroll
    for (int e = 0; e < kQuad; ++e)
      if (e < n && !((keep >> e) & 1u)) base[idx + e] = h[e];
  }
}

// Stores element e's code (byte e of `codes`) unless bit e of `keep` is set (a block's skipped
// element whose code stays: kept_block_absmax).
__device__ __forceinline__ void store_quad_codes(uint8_t* base, int64_t idx, int n, bool vec,
                                                 unsigned keep, uint32_t codes) {
  if (vec && keep == 0) {
    *reinterpret_cast<uint32_t*>(base + idx) = codes;
  } else {
#pragma unroll
    for (int e = 0; e < kQuad; ++e)
      if (e < n && !((keep >> e) & 1u)) base[idx + e] = static_cast<uint8_t>(codes >> (8 * e));
  }
}

// Max over the kLanes lanes (16: a half-warp; 8: a quarter) that share a block. Every lane of
// the warp must call it.
// NOTE: fmaxf drops NaN operands, exactly like the CPU's std::max(absmax, |x|) fold that
// starts at 0, so the block absmax is the max of the non-NaN magnitudes on both sides.
template <int kLanes = kGroupLanes>
__device__ __forceinline__ float group_max(float v) {
#pragma unroll
  for (int offset = kLanes / 2; offset > 0; offset >>= 1)
    v = fmaxf(v, __shfl_xor_sync(0xFFFFFFFFu, v, offset));
  return v;
}

// Whether `v` holds in any of the kLanes lanes that share a block. Every lane of the warp must
// call it (the kernels' blocks are 1-D and whole warps, so the lane's bits above kLanes - 1 in
// threadIdx.x name its group).
template <int kLanes = kGroupLanes>
__device__ __forceinline__ bool group_any(bool v) {
  const unsigned ballot = __ballot_sync(0xFFFFFFFFu, v);
  return ((ballot >> (threadIdx.x & (32u - kLanes))) & ((1u << kLanes) - 1u)) != 0u;
}

// A block's new absmax when it may hold skipped elements (forge.h, "Skipped elements";
// cpu_backend.cpp, store_state): `v` this lane's kN quads of the block's new values (n[j] in
// range; a skipped element's is its decoded old value), bit e of `keep[j]` set where element e
// of quad j was skipped; kLanes lanes share the block. A block without a skipped element takes
// the largest magnitude of its values, as store_block_states' usual path does. A block holding
// one takes formats.h's block_absmax_with_skipped(its old absmax, the updated elements'
// largest magnitude, -inf when none), the CPU's function (the old absmax while that fits, a
// NaN one kept; else the old one times the smallest power of two that holds it), and
// `code_keep[j]` receives the elements whose code bytes stay: the skipped ones while that
// absmax is the old one bit for bit, none when it changed (they are then re-encoded from their
// decoded values, which keeps their values). `old_absmax`: the block's absmax slot, read by
// the lane that writes it (`first`, the block's first column's) before it does. Every lane of
// the warp must call it.
// NOTE: only warps with a skipped element come here (a vote per batch): the growth by a power
// of two (two frexpf, an ldexpf, a compare and a multiply per block and lane) adds nothing to
// the fast path's instructions.
template <int kLanes, int kN>
__device__ __forceinline__ float kept_block_absmax(const float* old_absmax, const int (&n)[kN],
                                                   const unsigned (&keep)[kN], bool first,
                                                   bool fp8, const float (&v)[kN][kQuad],
                                                   unsigned (&code_keep)[kN]) {
  unsigned any_keep = 0u;
#pragma unroll
  for (int j = 0; j < kN; ++j) any_keep |= keep[j];
  const bool kept = group_any<kLanes>(any_keep != 0u);
  float old = 0.0f;
  if (kept && first) old = *old_absmax;
  float m = kept ? -INFINITY : 0.0f;  // updated magnitudes are never NaN: fmaxf is exact here
#pragma unroll
  for (int j = 0; j < kN; ++j)
#pragma unroll
    for (int e = 0; e < kQuad; ++e)
      if (e < n[j] && !((keep[j] >> e) & 1u)) m = fmaxf(m, fabsf(v[j][e]));
  m = group_max<kLanes>(m);
  old = __shfl_sync(0xFFFFFFFFu, old, static_cast<int>(threadIdx.x & (32u - kLanes)));
  const float amax = kept ? block_absmax_with_skipped(old, m, fp8) : fp8 ? fp8_block_absmax(m) : m;
#pragma unroll
  for (int j = 0; j < kN; ++j)
    code_keep[j] = kept && float_bits(amax) == float_bits(old) ? keep[j] : 0u;
  return amax;
}
// One quad per lane, a half-warp per block (store_state_quad's layout).
__device__ __forceinline__ float kept_block_absmax(const float* old_absmax, int n, unsigned keep,
                                                   int lane16, bool fp8, const float (&v)[kQuad],
                                                   unsigned& code_keep) {
  const int n1[1] = {n};
  const unsigned keep1[1] = {keep};
  float v1[1][kQuad];
#pragma unroll
  for (int e = 0; e < kQuad; ++e) v1[0][e] = v[e];
  unsigned code_keep1[1];
  const float amax =
      kept_block_absmax<kGroupLanes, 1>(old_absmax, n1, keep1, lane16 == 0, fp8, v1, code_keep1);
  code_keep = code_keep1[0];
  return amax;
}

// ---- the int8 dynamic map, fast and bit-identical ------------------------------------------
//
// formats.h's int8_level_value() scales with ldexpf and int8_nearest_level() binary-searches
// 8 levels deep: ~300 dependent instructions per encoded element. formats.h's direct forms
// (what the CPU runs) take ~15 and ~60 integer / select instructions, and on the GPU those
// made the int8 epilogue ALU-bound (ncu: ALU pipe 72 %, 337 instructions per
// element against 90 with bf16 states). The device forms read two tables in shared memory:
//  - the nearest level: formats.h's int8_nearest_level_sixteenths (int8_nearest_level_unit
//    for a block's ratios, which are at most 1), whose 16-word table gives the count of tie
//    thresholds below each sixteenth of the mantissa range and the one inside it (one read
//    and one subtraction: the level search is ~10 instructions);
//  - decoding: every code's value (int8_code_table).
// NOTE: the sixteen words sit in sixteen banks: any pattern of lookups by a warp is one
// wavefront.
// tests/cpp/gpu/test_gpu_int8_map.cu checks every code and every float in [0, 2] against
// formats.h's reference on the device; test_formats.cpp checks the same forms on the CPU.

// The CTA's sixteenths table (formats.h, int8_sixteenth_word).
__device__ __forceinline__ uint32_t* int8_sixteenths_table() {
  __shared__ uint32_t table[16];
  return table;
}

// Every code's decoded value, formats.h's int8_decode without the absmax: [0, 256) the
// signed codes, [256, 512) the unsigned ones.
// NOTE: a decode is one shared-memory read instead of ~11 instructions (the level from the
// fraction, its scale, level 0, the sign). A warp's random codes cost a few wavefronts
// per read; the shared-memory pipe has room for them next to the ALU-bound encode.
__device__ __forceinline__ float* int8_code_table() {
  __shared__ float table[512];
  return table;
}

// Fills both tables: the CTA's threads (tid: the thread's index in it, blockDim.x of them)
// write; a __syncthreads must follow before the first int8 access. Every kernel that may
// touch int8 states calls it before its first __syncthreads (int8_table_needed<Spec>).
__device__ __forceinline__ void int8_tables_init(int tid) {
  if (tid < 16) int8_sixteenths_table()[tid] = int8_sixteenth_word(tid);
  for (int i = tid; i < 512; i += blockDim.x) {
    const int code = i & 255;
    float v;
    if (i < 256) {
      const float mag = int8_level_value_direct(code & 0x7F, kInt8SignedTop);
      v = (code & 0x80) ? -mag : mag;
    } else {
      v = int8_level_value_direct(code, kInt8UnsignedTop);
    }
    int8_code_table()[i] = v;
  }
}

// == int8_nearest_level_direct(a, top).
__device__ __forceinline__ int int8_nearest_level_fast(float a, int top) {
  return int8_nearest_level_sixteenths(a, top, int8_sixteenths_table());
}

// == int8_nearest_level_direct(a, top) for a <= 1 (formats.h, int8_nearest_level_unit).
__device__ __forceinline__ int int8_nearest_level_unit_fast(float a, int top) {
  return int8_nearest_level_unit(a, top, int8_sixteenths_table());
}

// Whether a kernel instantiated for Spec can touch int8 states (and needs the table).
template <class Spec>
constexpr bool int8_table_needed() {
  return Spec::kGeneric || Spec::kStateFormat == FORGE_STATE_INT8_BLOCK64;
}

// == formats.h int8_decode / int8_encode, bit for bit (the code table holds
// int8_level_value_direct's values, which equal int8_level_value's: test_formats.cpp).
__device__ __forceinline__ float int8_decode_fast(uint8_t code, bool is_signed) {
  return int8_code_table()[(is_signed ? 0 : 256) + code];
}

// The int8 codes of a quad (byte e: int8_encode(x[e], absmax, is_signed)) given the ratios
// a = |x| / absmax already computed (int8_quad_ratios, or int8_quad_ratios_ieee where it
// declines the block: 0 where the absmax is not positive) for an absmax >= |x|, so a <= 1:
// every element whose code a step stores. Another a (a NaN, or above 1 for an element out of
// range) gives some byte there, and may change the bytes above it, never those below.
// NOTE: the signs per quad, not per element: three byte permutes give every element's sign
// as a byte mask, and two logic operations and an add apply them to the four levels at once
// (~1.5 instructions per element against ~5 with a compare and selects per element).
__device__ __forceinline__ uint32_t int8_quad_codes(const float (&x)[kQuad],
                                                    const float (&ratio)[kQuad], bool is_signed) {
  const int top = is_signed ? kInt8SignedTop : kInt8UnsignedTop;
  uint32_t levels = 0u;  // byte e: element e's level, in [0, top]
#pragma unroll
  for (int e = 0; e < kQuad; ++e)
    levels |= static_cast<uint32_t>(int8_nearest_level_unit_fast(ratio[e], top)) << (8 * e);
  // byte e: 0xFF where x[e] is negative (or -0), else 0
  const uint32_t negative = __byte_perm(sign_bytes2(x[0], x[1]), sign_bytes2(x[2], x[3]), 0x5410u);
  if (is_signed) {
    // A nonzero level takes the sign bit (0x80 | level); level 0 stays code 0, -0 too. Bit 7
    // of a byte of levels + 0x7F7F7F7F is set exactly where that byte is nonzero (each is at
    // most 0x7F: no byte carries into the next).
    return levels | ((levels + 0x7F7F7F7Fu) & negative & 0x80808080u);
  }
  return levels & ~negative;  // x <= 0 encodes as 0 (x = +0 has level 0)
}

// One element's int8_encode in a block whose absmax is at least |x| (or not positive).
__device__ __forceinline__ uint8_t int8_encode_fast(float x, float absmax, bool is_signed) {
  const float v[kQuad] = {x, x, x, x};
  const float a = absmax > 0.0f ? fabsf(x) / absmax : 0.0f;
  const float ratio[kQuad] = {a, a, a, a};
  return static_cast<uint8_t>(int8_quad_codes(v, ratio, is_signed));
}

// ---- branch-free fast paths that return the reference bits ---------------------------------
//
// NOTE: nvcc compiles an IEEE division or square root to a fast path plus a range check that
// branches to an out-of-line slow path. Each of those branches ends a basic block, so the
// ~8 independent elements a thread updates cannot be interleaved: the epilogue ran one
// element's dependent chain at a time (ncu's top stall: "fixed-latency dependency").
// FastMath runs the same fast-path instructions without the branch, over a domain where they
// provably give the IEEE result, and records whether every operand was in that domain; the
// caller redoes the whole batch with IeeeMath when one was not (rare: see the domains).
// tests/cpp/gpu/test_gpu_fast_math.cu compares both against IEEE on the device.

// |x| in [2^-62, 2^62): normal, far from overflow and underflow (NaN fails both compares).
__device__ __forceinline__ bool fast_div_operand(float x) {
  const float a = fabsf(x);
  return a >= 0x1p-62f && a < 0x1p62f;
}

// kTakesZero: +0 is added to the domain (FastMathWithZeros, below), where an exact zero is
// common: an all-zero gradient row leaves AdamW's m and v at exactly +0 (an embedding's
// unseen tokens: most of its rows on every step), and without it 0 / x and sqrt(0) send the
// whole batch down the exact path. Each addition is an identity on FastMath's own domain (see
// each), so both give IEEE's results on their domains. The element-wise kernels take zeros;
// the fused epilogues keep FastMath (zeros are rare there, and each instruction counts).
template <bool kTakesZero>
struct FastMathT {
  static constexpr bool kDeferFiniteCheck = true;
  bool ok = true;
  __device__ __forceinline__ void require(bool c) { ok = ok & c; }
  // Whether a is a dividend div_unchecked takes: fast_div_operand, or +0 with zeros.
  static __device__ __forceinline__ bool dividend_ok(float a) {
    return kTakesZero ? fast_div_operand(a) | (__float_as_uint(a) == 0u) : fast_div_operand(a);
  }
  // The instruction sequence nvcc emits for div.rn.f32 before its FCHK branch (reciprocal
  // estimate, one Newton step, quotient, residual, correction). Exactly a / b when
  // dividend_ok(a) and fast_div_operand(b), where FCHK takes this path; the caller checks.
  // With zeros, a == +0 too: q = +0 · y is a zero with b's sign (y = 1/b's estimate has it),
  // r = -b·q + a = -0 + +0 = +0, and y·r + q keeps q: +0 / b exactly. -0 is still declined
  // (the last fma would return +0 where IEEE gives a zero of the other sign).
  // NOTE: with zeros q is a product, not fma(a, y, 0): on FastMath's domain the product is a
  // nonzero normal (|a|, |y| >= 2^-62), where the two round the same; at a == +0 only the
  // product keeps b's sign.
  static __device__ __forceinline__ float div_unchecked(float a, float b) {
    float y = rcp_approx_ftz(b);
    const float e = __fmaf_rn(-b, y, 1.0f);
    y = __fmaf_rn(y, e, y);
    const float q = kTakesZero ? __fmul_rn(a, y) : __fmaf_rn(a, y, 0.0f);
    const float r = __fmaf_rn(-b, q, a);
    return __fmaf_rn(y, r, q);
  }
  // The sequence nvcc emits for sqrt.rn.f32 on its fast path: exactly sqrt(x) under nvcc's
  // own condition for it, x a positive normal float >= 2^-101 (bits in [0x0D000000,
  // 0x7F7FFFFF]); the caller checks. With zeros, x == +0 too: the estimate is taken of
  // max(x, 2^-101) (= x on the domain above), so it is finite; then s = +0, r = +0 and the
  // result is +0 = sqrt(+0).
  static __device__ __forceinline__ float sqrt_unchecked(float x) {
    const float y = rsqrt_approx_ftz(kTakesZero ? fmaxf(x, 0x1p-101f) : x);
    const float s = __fmul_rn(x, y);
    const float h = __fmul_rn(y, 0.5f);
    const float r = __fmaf_rn(-s, s, x);
    return __fmaf_rn(r, h, s);
  }
  __device__ __forceinline__ float div(float a, float b) {
    require(dividend_ok(a) & fast_div_operand(b));
    return div_unchecked(a, b);
  }
  __device__ __forceinline__ float sqrt(float x) {
    const uint32_t u = __float_as_uint(x);
    require((u + 0xF3000000u <= 0x727FFFFFu) | (kTakesZero && u == 0u));
    return sqrt_unchecked(x);
  }
  // AdamW's step direction m / (sqrt(v) / bc2_sqrt + eps) (IeeeMath::adamw_direction), with
  // fewer checks than div(m, div(sqrt(v), bc2_sqrt) + eps) would make, each implied:
  //  - v in [2^-101, 2^123) (or +0 with zeros; bits [0x0D000000, 0x7CFFFFFF]): sqrt's own
  //    domain, narrowed at the top so that s = sqrt(v) in [2^-50.5, 2^61.5) (or +0) is a
  //    dividend div_unchecked takes: s needs no check of its own;
  //  - bc2_sqrt a positive divisor, in [2^-62, 2^62) (the same value for every element: the
  //    compiler shares the check);
  //  - eps >= 2^-62 (uniform too), so d = s / bc2_sqrt + eps >= eps (s / bc2_sqrt >= +0 and
  //    rounding is monotone) needs only its upper bound checked. (A negative bc2_sqrt, never
  //    passed, would let d cancel to below 2^-62: the device test found one such case.)
  //  - m a dividend.
  // A non-finite v (NaN or infinity: bits above 0x7F7FFFFF) is outside, so AdamW's v, and
  // with it g (v = β2·v + (1 − β2)·g² is not finite when g is not), need no finite test
  // (rules.h's apply_rule), and apply_quads_fast takes both new states as finite.
  //
  // Without zeros (the fused epilogues) the per-element checks become running ranges, checked
  // once per batch by all_ok(): the bits of v (unsigned min and max), |m| (NaN-propagating
  // min and max: a NaN fails the check), and d's bound folded into v's upper one:
  //  - v <= V = RN((2^61 · bc2_sqrt)²) and eps <= 2^60 give d < 2^62: s <= 2^61·bc2_sqrt·
  //    (1 + 2^-23), s / bc2_sqrt rounds to at most 2^61·(1 + 2^-22), and adding eps <= 2^60
  //    stays below 1.5·2^61 + ulp, under 2^62. (V overflows to infinity for bc2_sqrt > 4;
  //    the 2^123 bound then governs.)
  // So the domain is v in [2^-101, min(2^123, V)] (bits), |m| in [2^-62, 2^62), bc2_sqrt in
  // [2^-62, 2^62), eps in [2^-62, 2^60]: inside d's old bound, so every accepted element gets
  // the IEEE result. tests/cpp/gpu/test_gpu_fast_math.cu restates that domain.
  // NOTE: per element two integer and two float min/max instead of ~7 compares and predicate
  // merges (the AdamW bf16 epilogue: 44.2 -> 42.3 instructions per element; its time did not
  // move, but the SR and int8 variants are nearer to issue-bound).
  uint32_t v_lo = 0xFFFFFFFFu, v_hi = 0u;  // bits of v, without zeros
  float m_lo = INFINITY, m_hi = 0.0f;     // |m|, NaN-propagating, without zeros
  uint32_t v_top = 0x7CFFFFFFu;           // v's upper bound (bits), set from bc2_sqrt
  __device__ __forceinline__ float adamw_direction(float m, float v, float bc2_sqrt,
                                                   float eps) {
    const uint32_t u = __float_as_uint(v);
    require((bc2_sqrt >= 0x1p-62f) & (bc2_sqrt < 0x1p62f) & (eps >= 0x1p-62f));
    if constexpr (kTakesZero) {
      require((u + 0xF3000000u <= 0x6FFFFFFFu) | (u == 0u));
      const float d = div_unchecked(sqrt_unchecked(v), bc2_sqrt) + eps;
      require((d < 0x1p62f) & dividend_ok(m));
      return div_unchecked(m, d);
    } else {
      require(eps <= 0x1p60f);
      const float t = __fmul_rn(0x1p61f, bc2_sqrt);
      v_top = min(v_top, __float_as_uint(__fmul_rn(t, t)));
      v_lo = min(v_lo, u);
      v_hi = max(v_hi, u);
      m_lo = min_nan(m_lo, fabsf(m));
      m_hi = max_nan(m_hi, fabsf(m));
      const float d = div_unchecked(sqrt_unchecked(v), bc2_sqrt) + eps;
      return div_unchecked(m, d);
    }
  }
  // Every check so far passed (the running ranges included).
  __device__ __forceinline__ bool all_ok() const {
    if constexpr (kTakesZero) {
      return ok;
    } else {
      // The empty ranges' initial values pass (no adamw_direction call: nothing to check).
      return ok & (v_lo >= 0x0D000000u) & (v_hi <= v_top) & (m_lo >= 0x1p-62f) &
             (m_hi < 0x1p62f);
    }
  }
};
using FastMath = FastMathT<false>;
using FastMathWithZeros = FastMathT<true>;

// == bf16_nearest(lo) | bf16_nearest(hi) << 16 for non-NaN lo, hi: cvt.rn.bf16x2.f32 rounds
// to nearest even exactly as formats.h does (overflow to infinity included), in one
// instruction for two elements instead of ~12 per element. NaN inputs would come back as the
// canonical NaN where formats.h keeps sign and payload: callers store no NaN it converts
// (the fast epilogue path's values were checked finite; a step's weights: store_quads).
__device__ __forceinline__ uint32_t bf16x2_nearest_nonnan(float lo, float hi) {
  return cvt_rn_bf16x2(hi, lo);
}

// formats.h's bf16_stochastic of two values known not to be NaN, as one bf16x2 word (lo in the
// low half): the same bits without its infinity/NaN test (an infinity plus at most 0xFFFF
// stays that infinity; NaN is the only input whose sum could carry out of the exponent).
// NOTE: one byte permute picks the upper halves of both sums, where the compiler built the
// word from two separate results with a mask and a shifted add (one more instruction a pair).
__device__ __forceinline__ uint32_t bf16x2_stochastic_nonnan(float lo, float hi,
                                                              uint32_t random16_lo,
                                                              uint32_t random16_hi) {
  return __byte_perm(__float_as_uint(lo) + (random16_lo & 0xFFFFu),
                     __float_as_uint(hi) + (random16_hi & 0xFFFFu), 0x7632);
}

// ---- the ratios |x| / absmax of an int8 encode ------------------------------------------------
//
// ratio[e] = |v[e]| / absmax for the 4 values of a quad in a block whose absmax (>= every
// |v[e]|) is `absmax`, branch-free, with one check per block instead of FastMath's per
// element. Both int8 store paths take it (store_state_quad, store_int8_states). Returns false
// when absmax is outside [2^-62, 2^62) (zero, tiny, huge, infinite, NaN); the caller then
// divides the IEEE way instead. FastMath's division is exact for a
// dividend and a divisor in [2^-62, 2^62); here a block with absmax < 2^-22 has both scaled
// by 2^64 (exact: nothing overflows, and a subnormal scales exactly too), so the divisor b'
// lies in [2^-22, 2^62). Then, with n' = |v| · scale:
//  - where |v| / absmax >= 2^-40, n' >= 2^-40 · b' >= 2^-62: inside the domain, so the ratio
//    is the IEEE quotient;
//  - where |v| / absmax < 2^-40 (a zero, a subnormal, anything tiny), the sequence's result
//    stays below 3 · 2^-40 (q <= n'·y·(1 + 2^-22), |r| <= 2n', y·|r| < 2^-39), and so does
//    the IEEE quotient: both are under half of level 1 (2^-16.75 or 2^-32.75), so both
//    encode to level 0, code 0. The ratio may differ from IEEE's there; the code does not.
// NOTE: per element that is one multiply and the division's three fmas, against ~11
// instructions with FastMath's per-element checks (and a zero test).
// tests/cpp/gpu/test_gpu_int8_map.cu checks the codes against formats.h's int8_encode.
__device__ __forceinline__ bool int8_quad_ratios(float absmax, const float (&v)[kQuad],
                                                 float (&ratio)[kQuad]) {
  const float scale = absmax < 0x1p-22f ? 0x1p64f : 1.0f;
  const float divisor = absmax * scale;
#pragma unroll
  for (int e = 0; e < kQuad; ++e)
    ratio[e] = FastMath::div_unchecked(fabsf(v[e]) * scale, divisor);
  return fast_div_operand(absmax);
}

// The ratios where int8_quad_ratios declines the block: the IEEE quotients |v[e]| / absmax,
// and 0 where the absmax is not positive (zero or NaN; int8_encode gives such a block's
// elements code 0, and so does int8_quad_codes for a = 0).
__device__ __forceinline__ void int8_quad_ratios_ieee(float absmax, const float (&v)[kQuad],
                                                      float (&ratio)[kQuad]) {
#pragma unroll
  for (int e = 0; e < kQuad; ++e) ratio[e] = absmax > 0.0f ? fabsf(v[e]) / absmax : 0.0f;
}

// ---- fp8 block states, bit for bit --------------------------------------------------------------
//
// formats.h's fp8 encoding: element = fp8 value · (absmax / top), stored as
// fp8_nearest(x · (top / absmax)). On sm_89 and later the conversions are the hardware's:
// cvt.rn.satfinite.{e4m3x2,e5m2x2}.f32 is fp8_nearest by definition (nearest even, saturating;
// it is given |q| and the sign is put back, so -0 and negative values that round to zero give
// 0x80 as formats.h's do, and a NaN 0x7F), and cvt.rn.f16x2.{e4m3x2,e5m2x2} decodes exactly
// (every fp8 value is an f16). Other passes (sm_80) call formats.h's functions. A decoded NaN code, which no
// step stores, comes back as a NaN with another payload; an element holding one is skipped.
// tests/cpp/gpu/test_gpu_fp8.cu checks every code and ranges of floats against formats.h on
// the device.

// A block's decode factor absmax / top (kDecode) or encode factor top / absmax, the IEEE
// quotient, branch-free: FastMath's division is exact for a dividend and a divisor in
// [2^-62, 2^62), and absmax is scaled there by a power of two, so the quotient is the scaled
// IEEE one, and scaling it back is exact as long as it stays normal and finite: for absmax in
// [kFp8MinAbsmax, FLT_MAX] both quotients lie in [2^-120, 2^116] (top: 448 or 57344). A
// decode also takes absmax = +0 (the sequence gives +0). `ok` is cleared for any other absmax
// (a value no step stores: below kFp8MinAbsmax, -0, infinite, NaN); the caller then divides the
// IEEE way. An encode with absmax = +0 stores zeros (fp8_quad_codes) whatever the factor.
template <bool kDecode>
__device__ __forceinline__ float fp8_block_factor(float absmax, float top, bool& ok) {
  // scale (a power of two, exact) brings absmax into [2^-62, 2^62); unscale = 1 / scale
  const bool tiny = absmax < 0x1p-22f, huge = absmax >= 0x1p62f;
  const float scale = tiny ? 0x1p64f : huge ? 0x1p-66f : 1.0f;
  const float unscale = tiny ? 0x1p-64f : huge ? 0x1p66f : 1.0f;
  const float scaled = absmax * scale;
  ok = ok & (((absmax >= kFp8MinAbsmax) & (absmax <= 0x1.fffffep127f)) |
             (__float_as_uint(absmax) == 0u));
  if constexpr (kDecode) {
    return FastMath::div_unchecked(scaled, top) * unscale;
  } else {
    return FastMath::div_unchecked(top, scaled) * scale;
  }
}

// ---- a pass's blocks, one per lane ----
//
// Where a batch's kQ quads per lane sit in their blocks (int8 / fp8 states):
//  - the classic layout (kPaired = false): the 16 lanes of a half-warp cover a block with one
//    quad each, so each of a lane's quads is in a block of its own (quad q at column 64·q +
//    4·lane16 of a 128-column tile row; the element-wise kernels alike);
//  - paired (update_tile's pipelined passes): 8 lanes cover a block with both their quads
//    (quad q at column 64·(lane16 / 8) + 32·q + 4·(lane16 % 8)), so a lane's quads share one
//    block per state and a block's reductions span 8 lanes instead of 16.
// Either way a lane's pass touches kBlocks = states × kPerState blocks (block b = state
// b / kPerState, the lane's quads' block b % kPerState), and each block's absmax and factors
// are the same in all kLanes lanes that share it. Those lanes are split into kBlocks runs of
// kLanes / kBlocks, run b computing block b's, and every lane takes the others by shuffle.
// Every lane of the warp must call these (the kernels' blocks are whole warps, so the bits of
// threadIdx.x above kLanes - 1 name the lanes' group, as group_any assumes).
// NOTE: one factor is ~19 instructions (the scaling selects, the domain test, the division
// sequence); 16 lanes computing the same 2 × 4 factors per pass spent ~19 of fp8's ~100
// instructions per element there. One per lane and a shuffle per block cost ~7. Paired, a
// lane's pass has half the blocks: 3 shuffle steps of the maxima instead of 5, and half the
// gathers, absmax loads and stores.
template <bool kPaired, int kQ>
struct QuadBlocks {
  static_assert(!kPaired || kQ * kQuad * 8 == FORGE_INT8_BLOCK, "paired: 8 lanes × kQ quads");
  static constexpr int kLanes = kPaired ? 8 : kGroupLanes;  // lanes sharing a block
  static constexpr int kPerState = kPaired ? 1 : kQ;        // a lane's blocks per state
  // The lane's block (of kPerState) that holds its quad q.
  static __host__ __device__ constexpr int of(int q) { return kPaired ? 0 : q; }
  // Whether this lane holds its blocks' first column (it reads and writes their absmax).
  static __device__ __forceinline__ bool first() { return threadIdx.x % kLanes == 0; }
  // The tile column of the lane's quad q in a 128-column row (update_tile's passes).
  static __host__ __device__ constexpr int column(int lane16, int q) {
    return kPaired ? FORGE_INT8_BLOCK * (lane16 / 8) + 32 * q + kQuad * (lane16 % 8)
                   : FORGE_INT8_BLOCK * q + kQuad * lane16;
  }
};

template <int kNumStates, int kPerState, int kLanes>
__device__ __forceinline__ int lane_block() {
  constexpr int kBlocks = kNumStates * kPerState;
  static_assert(kBlocks >= 1 && kBlocks <= kLanes && (kBlocks & (kBlocks - 1)) == 0,
                "a power of two of blocks, at most one per lane");
  return static_cast<int>(threadIdx.x % kLanes) / (kLanes / kBlocks);
}

// The largest of each block's values over the kLanes lanes, scattered: m[b] is this lane's
// partial maximum of block b; the result is block lane_block()'s maximum. A butterfly whose
// first steps exchange half of the remaining blocks (the lane keeps the half its bit selects)
// and whose last steps reduce the one left: for 4 blocks over 16 lanes, 5 shuffles and 5 max
// instead of 16 of each (group_max per block).
// NOTE: fmaxf drops NaN operands and is exact on magnitudes, so the order of the maxima does
// not change the result (group_max's note).
template <int kBlocks, int kLanes>
__device__ __forceinline__ float group_max_scatter(float (&m)[kBlocks]) {
  static_assert(kBlocks >= 1 && kBlocks <= kLanes && (kBlocks & (kBlocks - 1)) == 0,
                "a power of two of blocks");
  int count = kBlocks;
#pragma unroll
  for (int offset = kLanes / 2; offset > 0; offset >>= 1) {
    const int half = count > 1 ? count / 2 : 1;
    const bool upper = (threadIdx.x & offset) != 0;
#pragma unroll
    for (int k = 0; k < half; ++k) {
      if (count > 1) {
        const float send = upper ? m[k] : m[k + half];
        const float keep = upper ? m[k + half] : m[k];
        m[k] = fmaxf(keep, __shfl_xor_sync(0xFFFFFFFFu, send, offset));
      } else {
        m[k] = fmaxf(m[k], __shfl_xor_sync(0xFFFFFFFFu, m[k], offset));
      }
    }
    count = half;
  }
  return m[0];
}

// The lane's block's decode (kDecode: absmax / top) or encode (top / absmax) factor, given that
// block's absmax and state; the IEEE quotient (fp8_block_factor, with the division for every
// lane of the warp when any lane's absmax is outside its domain).
template <bool kDecode, int kRule, int kNumStates>
__device__ __forceinline__ float fp8_lane_factor(float absmax, int state) {
  float top = fp8_format(spec_state_signed(kRule, 0)).top;
#pragma unroll
  for (int i = 1; i < kNumStates; ++i)
    if (state == i) top = fp8_format(spec_state_signed(kRule, i)).top;
  bool ok = true;
  float factor = fp8_block_factor<kDecode>(absmax, top, ok);
  if (!__all_sync(0xFFFFFFFFu, ok)) factor = kDecode ? absmax / top : top / absmax;
  return factor;
}

// Every block's value of the pass from the lanes that hold it (lane_block).
template <int kNumStates, int kPerState, int kLanes>
__device__ __forceinline__ void gather_blocks(float own, float (&all)[kNumStates][kPerState]) {
  constexpr int kRun = kLanes / (kNumStates * kPerState);  // lanes per block
  const int group = static_cast<int>(threadIdx.x & (32u - kLanes));
#pragma unroll
  for (int i = 0; i < kNumStates; ++i)
#pragma unroll
    for (int b = 0; b < kPerState; ++b)
      all[i][b] = __shfl_sync(0xFFFFFFFFu, own, group | ((i * kPerState + b) * kRun));
}

// formats.h's fp8_decode of a quad's packed codes (byte e: element e) given the block's decode
// factor absmax / top.
__device__ __forceinline__ void fp8_quad_values(uint32_t codes, bool is_signed, float factor,
                                                float (&v)[kQuad]) {
#if defined(FORGE_FP8_CVT)
  const uint32_t lo = is_signed ? cvt_f16x2_fp8x2<true>(codes) : cvt_f16x2_fp8x2<false>(codes);
  const uint32_t hi =
      is_signed ? cvt_f16x2_fp8x2<true>(codes >> 16) : cvt_f16x2_fp8x2<false>(codes >> 16);
  v[0] = cvt_f32_f16(lo & 0xFFFFu) * factor;
  v[1] = cvt_f32_f16(lo >> 16) * factor;
  v[2] = cvt_f32_f16(hi & 0xFFFFu) * factor;
  v[3] = cvt_f32_f16(hi >> 16) * factor;
#else
#pragma unroll
  for (int e = 0; e < kQuad; ++e)
    v[e] = fp8_value(static_cast<uint8_t>(codes >> (8 * e)), is_signed) * factor;
#endif
}

// formats.h's fp8_encode of a quad given its block's encode factor top / absmax, packed (byte
// e: element e); `nonzero` = absmax >= kFp8MinAbsmax (otherwise every code is 0).
// kNonNan: the caller knows no v[e] whose code it stores is NaN (a warp where no element was
// skipped), so the signed conversion alone is the code: it rounds the magnitude and keeps the
// sign, -0 and negative values that round to zero included (test_gpu_fp8.cu checks every
// non-NaN float). Otherwise the conversion is given |q| and the sign is put back, so that a NaN
// of either sign gives 0x7F as formats.h's does.
// NOTE: one conversion instruction per two elements; with NaNs possible, the four signs put
// back with three byte permutes and two logic operations (~10 instructions per quad).
template <bool kNonNan = false>
__device__ __forceinline__ uint32_t fp8_quad_codes(const float (&v)[kQuad], float factor,
                                                   bool nonzero, bool is_signed) {
  float q[kQuad];
#pragma unroll
  for (int e = 0; e < kQuad; ++e) q[e] = v[e] * factor;
#if defined(FORGE_FP8_CVT)
  if constexpr (kNonNan) {
    const uint32_t lo = is_signed ? cvt_rn_satfinite_fp8x2<true>(q[1], q[0])
                                  : cvt_rn_satfinite_fp8x2<false>(q[1], q[0]);
    const uint32_t hi = is_signed ? cvt_rn_satfinite_fp8x2<true>(q[3], q[2])
                                  : cvt_rn_satfinite_fp8x2<false>(q[3], q[2]);
    return nonzero ? lo | (hi << 16) : 0u;
  }
  const uint32_t lo = is_signed ? cvt_rn_satfinite_fp8x2<true>(fabsf(q[1]), fabsf(q[0]))
                                : cvt_rn_satfinite_fp8x2<false>(fabsf(q[1]), fabsf(q[0]));
  const uint32_t hi = is_signed ? cvt_rn_satfinite_fp8x2<true>(fabsf(q[3]), fabsf(q[2]))
                                : cvt_rn_satfinite_fp8x2<false>(fabsf(q[3]), fabsf(q[2]));
  const uint32_t mags = lo | (hi << 16);
  // byte e of `signs`: the top byte of q[e]'s bits, whose bit 7 is its sign
  const uint32_t signs01 = __byte_perm(__float_as_uint(q[0]), __float_as_uint(q[1]), 0x0073u);
  const uint32_t signs23 = __byte_perm(__float_as_uint(q[2]), __float_as_uint(q[3]), 0x0073u);
  const uint32_t signs = __byte_perm(signs01, signs23, 0x5410u);
  // A NaN converts to magnitude 0x7F (the only byte above both formats' largest finite one)
  // and stays 0x7F whatever its sign, as formats.h's: bit 7 of a byte of mags + 0x01010101 is
  // set exactly there (no byte carries into the next: each is at most 0x7F).
  const uint32_t nan_bytes = (mags + 0x01010101u) & 0x80808080u;
  const uint32_t codes = mags | (signs & 0x80808080u & ~nan_bytes);
#else
  uint32_t codes = 0;
#pragma unroll
  for (int e = 0; e < kQuad; ++e)
    codes |= static_cast<uint32_t>(fp8_nearest(q[e], is_signed)) << (8 * e);
#endif
  return nonzero ? codes : 0u;
}

// ---- state i of a quad, in fp32 ----------------------------------------------------------

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
    default: {  // int8 / fp8: the block's absmax, then every code of the block
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

// ---- the rule over a batch of quads -------------------------------------------------------
//
// Applies apply_rule() to every in-range element of kQ quads. Elements whose gradient is
// not finite are skipped (bit e of keep[q] set) and counted.
template <int kQ>
__device__ __forceinline__ void apply_quads(const RuleScalars& r, bool want_sq, const int (&n)[kQ],
                                            const float (&g)[kQ][kQuad],
                                            float (&w)[kQ][kQuad],
                                            float (&s)[FORGE_MAX_STATES][kQ][kQuad],
                                            unsigned (&keep)[kQ], StepTotals& totals) {
#pragma unroll
  for (int q = 0; q < kQ; ++q) {
    keep[q] = 0;
#pragma unroll
    for (int e = 0; e < kQuad; ++e) {
      if (e < n[q]) {
        float st[FORGE_MAX_STATES] = {s[0][q][e], s[1][q][e], s[2][q][e]};
        float w_new = w[q][e], g_used;
        if (apply_rule(r, g[q][e], w_new, st, g_used)) {
          w[q][e] = w_new;
#pragma unroll
          for (int i = 0; i < FORGE_MAX_STATES; ++i) s[i][q][e] = st[i];
          // NOTE: only when asked: the fp64 convert + multiply + add is ~5% of the epilogue.
          if (want_sq)
            totals.grad_sq_sum += static_cast<double>(g_used) * static_cast<double>(g_used);
        } else {
          keep[q] |= 1u << e;
          ++totals.nonfinite;
        }
      }
    }
  }
}

// The same update as apply_quads, branch-free through FastMath, into w_new / s_new. Returns
// false when that is not the reference result for some in-range element: a non-finite
// gradient, an operand outside FastMath's domain, or a result that is not storable (the weight
// or a state: NaN, infinite or above the largest bf16, formats.h; the fast path's state
// conversions take no NaN). The caller then runs apply_quads on the same inputs, which skips
// the element that is not storable exactly as the CPU does. `r` must have its rule as a
// compile-time constant.
template <int kQ, int kNumStates, class Math = FastMath>
__device__ __forceinline__ bool apply_quads_fast(const RuleScalars& r, const int (&n)[kQ],
                                                 const float (&g)[kQ][kQuad],
                                                 const float (&w)[kQ][kQuad],
                                                 const float (&s)[FORGE_MAX_STATES][kQ][kQuad],
                                                 float (&w_new)[kQ][kQuad],
                                                 float (&s_new)[FORGE_MAX_STATES][kQ][kQuad]) {
  Math math;
  // NOTE: one running sum of every result's magnitude instead of a storable() test per value:
  // it is at most the largest bf16 only if every term is (rounding is monotone, and each
  // partial sum of magnitudes is at least each of its terms), and NaN or an overflow to
  // infinity fails the comparison. A false alarm on large storable values only costs the
  // exact path. The magnitudes are free: |x| is an operand modifier of the add.
  float sum = 0.0f;
#pragma unroll
  for (int q = 0; q < kQ; ++q)
#pragma unroll
    for (int e = 0; e < kQuad; ++e) {
      float st[FORGE_MAX_STATES] = {s[0][q][e], s[1][q][e], s[2][q][e]};
      float wv = w[q][e], g_used;
      const Math before = math;
      apply_rule(r, g[q][e], wv, st, g_used, math);
      float out = fabsf(wv);
      // AdamW: adamw_direction declines unless its m and v, the new states, lie in its domain
      // (|m| < 2^62, v < 2^123: storable).
      if (r.rule != FORGE_RULE_ADAMW) {
#pragma unroll
        for (int i = 0; i < kNumStates; ++i) out = out + fabsf(st[i]);
      }
      if (e < n[q]) {
        sum = sum + out;
      } else {
        math = before;  // out of range: computed on zeros, never stored
      }
      w_new[q][e] = wv;
#pragma unroll
      for (int i = 0; i < FORGE_MAX_STATES; ++i) s_new[i][q][e] = st[i];
    }
  math.require(sum <= kBf16Max);
  return math.all_ok();
}

// NOTE: apply_rule() switches on k.rule and, for RMSprop, indexes the state array with the
// run-time slots k.slot_grad_avg / k.slot_momentum. Called as is, that dynamic index sends
// the per-element state array to local memory for every rule. Here each branch hands it a
// copy of k whose rule (and RMSprop slots) are compile-time constants, so the switch folds
// away, the states stay in registers, and the rule is dispatched once per batch instead of
// once per element. The arithmetic is apply_rule's own, unchanged.
#define FORGE_RULE_BRANCH(R, CENTERED, SLOT_GA, SLOT_MOM)   \
  {                                                         \
    RuleScalars r = k;                                      \
    r.rule = R;                                             \
    if ((R) == FORGE_RULE_RMSPROP) {                        \
      r.centered = CENTERED;                                \
      r.slot_grad_avg = SLOT_GA;                            \
      r.slot_momentum = SLOT_MOM;                           \
    }                                                       \
    apply_quads<kQ>(r, want_sq, n, g, w, s, keep, totals);  \
    return;                                                 \
  }

template <int kQ, class Spec>
__device__ __forceinline__ void apply_quads_resolved(const RuleScalars& k, bool want_sq,
                                                     const int (&n)[kQ],
                                                     const float (&g)[kQ][kQuad],
                                                     float (&w)[kQ][kQuad],
                                                     float (&s)[FORGE_MAX_STATES][kQ][kQuad],
                                                     unsigned (&keep)[kQ], StepTotals& totals) {
  if constexpr (!Spec::kGeneric) {
    // The host checked spec_matches(): rule == Spec::kRule, maximize == 0, wd_coupled == 0.
    // As constants they fold apply_rule's switch and its two run-time branches.
    RuleScalars r = k;
    r.rule = Spec::kRule;
    r.maximize = 0;
    r.wd_coupled = 0.0f;
    apply_quads<kQ>(r, want_sq, n, g, w, s, keep, totals);
    return;
  }
  switch (k.rule) {
    case FORGE_RULE_SGD: FORGE_RULE_BRANCH(FORGE_RULE_SGD, 0, -1, -1)
    case FORGE_RULE_SGD_MOMENTUM: FORGE_RULE_BRANCH(FORGE_RULE_SGD_MOMENTUM, 0, -1, -1)
    case FORGE_RULE_ADAMW: FORGE_RULE_BRANCH(FORGE_RULE_ADAMW, 0, -1, -1)
    case FORGE_RULE_NADAM: FORGE_RULE_BRANCH(FORGE_RULE_NADAM, 0, -1, -1)
    case FORGE_RULE_RADAM: FORGE_RULE_BRANCH(FORGE_RULE_RADAM, 0, -1, -1)
    case FORGE_RULE_LION: FORGE_RULE_BRANCH(FORGE_RULE_LION, 0, -1, -1)
    case FORGE_RULE_ADAGRAD: FORGE_RULE_BRANCH(FORGE_RULE_ADAGRAD, 0, -1, -1)
    case FORGE_RULE_RMSPROP:
      // Slots as make_rule_scalars() assigns them: square_avg 0, then grad_avg (centered),
      // then momentum_buffer (momentum > 0).
      if (k.centered) {
        if (k.slot_momentum >= 0) FORGE_RULE_BRANCH(FORGE_RULE_RMSPROP, 1, 1, 2)
        FORGE_RULE_BRANCH(FORGE_RULE_RMSPROP, 1, 1, -1)
      }
      if (k.slot_momentum >= 0) FORGE_RULE_BRANCH(FORGE_RULE_RMSPROP, 0, -1, 1)
      FORGE_RULE_BRANCH(FORGE_RULE_RMSPROP, 0, -1, -1)
    default:
      // Unreachable (the C API validates the rule). Not apply_quads(k, ...): its run-time
      // RMSprop slots would put the state array of every branch in local memory.
#pragma unroll
      for (int q = 0; q < kQ; ++q) keep[q] = (1u << kQuad) - 1u;
  }
}
#undef FORGE_RULE_BRANCH

// ---- block states of a batch of quads, in one straight run ---------------------------------
//
// store_state_quad's int8 / fp8 case (kSF) for every state and quad of a batch at once
// (specialized Specs, where the state count and signedness are compile-time): every block's
// absmax, then int8's ratios |x| / absmax (int8_quad_ratios) or fp8's encode factors
// (fp8_block_factor), with one IEEE fallback for the whole batch, every code, and the stores.
// The same codes and absmax as store_state_quad.
// NOTE: one quad and state at a time, each encode was a branch region of its own (the n > 0
// store, the ratio fallback), so its dependent chain (4 shuffles, the reciprocal, the
// division, the level search, ~300 cycles) ran alone; in one region the 2·kQ chains
// interleave.
// keep[q]: the skipped elements of quad q; a block holding one takes kept_block_absmax's
// absmax and code mask.
// NOTE: one warp-uniform branch for "a skipped element in the warp's blocks" around the absmax
// alone: without one, the warp's blocks run exactly the usual instructions but for the vote
// and the masked stores' test; the encoder after it is shared by both outcomes.
// kPaired: the batch's layout (QuadBlocks).
template <int kQ, int kNumStates, int kRule, int kSF, bool kPaired = false>
__device__ __forceinline__ void store_block_states(const ParamView& p, const int64_t (&row)[kQ],
                                                   const int64_t (&col)[kQ],
                                                   const int64_t (&idx)[kQ], const int (&n)[kQ],
                                                   const bool (&vec)[kQ],
                                                   const unsigned (&keep)[kQ],
                                                   const float (&s)[FORGE_MAX_STATES][kQ][kQuad]) {
  static_assert(is_block_format(kSF), "int8 or fp8 states");
  constexpr bool kFp8 = kSF == FORGE_STATE_FP8_BLOCK64;
  using Blocks = QuadBlocks<kPaired, kQ>;
  constexpr int kPerState = Blocks::kPerState, kLanes = Blocks::kLanes;
  float amax[kNumStates][kPerState];  // the lane's blocks' absmax
  unsigned code_keep[kNumStates][kQ];
  unsigned any_keep = 0u;
#pragma unroll
  for (int q = 0; q < kQ; ++q) any_keep |= keep[q];
  const bool kept = __any_sync(0xFFFFFFFFu, any_keep != 0u);  // uniform over the warp
  const int block = lane_block<kNumStates, kPerState, kLanes>();
  float own;  // the absmax of the lane's block
  if (kept) {
#pragma unroll
    for (int i = 0; i < kNumStates; ++i) {
      if constexpr (kPaired) {
        amax[i][0] = kept_block_absmax<kLanes, kQ>(
            &p.absmax[i][row[0] * p.blocks_per_row + col[0] / FORGE_INT8_BLOCK], n, keep,
            Blocks::first(), kFp8, s[i], code_keep[i]);
      } else {
#pragma unroll
        for (int q = 0; q < kQ; ++q)
          amax[i][q] = kept_block_absmax(
              &p.absmax[i][row[q] * p.blocks_per_row + col[q] / FORGE_INT8_BLOCK], n[q],
              keep[q], static_cast<int>(threadIdx.x % kGroupLanes), kFp8, s[i][q],
              code_keep[i][q]);
      }
    }
    own = amax[0][0];
#pragma unroll
    for (int i = 0; i < kNumStates; ++i)
#pragma unroll
      for (int b = 0; b < kPerState; ++b)
        if (block == i * kPerState + b) own = amax[i][b];
  } else {
    float m[kNumStates * kPerState];  // block i·kPerState + b: this lane's largest magnitude
#pragma unroll
    for (int i = 0; i < kNumStates; ++i) {
#pragma unroll
      for (int b = 0; b < kPerState; ++b) m[i * kPerState + b] = 0.0f;
#pragma unroll
      for (int q = 0; q < kQ; ++q) {
        float& v = m[i * kPerState + Blocks::of(q)];
#pragma unroll
        for (int e = 0; e < kQuad; ++e)
          if (e < n[q]) v = fmaxf(v, fabsf(s[i][q][e]));
        code_keep[i][q] = 0u;
      }
    }
    own = group_max_scatter<kNumStates * kPerState, kLanes>(m);
    if constexpr (kFp8) own = fp8_block_absmax(own);
    gather_blocks<kNumStates, kPerState, kLanes>(own, amax);
  }
  uint32_t codes[kNumStates][kQ];  // byte e: element e's code
  if constexpr (kFp8) {
    // the absmax is the same in every lane of the block: one encode factor per lane
    float factor[kNumStates][kPerState];
    gather_blocks<kNumStates, kPerState, kLanes>(
        fp8_lane_factor<false, kRule, kNumStates>(own, block / kPerState), factor);
    // NOTE: where no element of the warp was skipped, no value whose code is stored is NaN
    // (every one is a result apply_rule accepted), so the codes skip the signs' permutes.
    if (kept) {
#pragma unroll
      for (int i = 0; i < kNumStates; ++i)
#pragma unroll
        for (int q = 0; q < kQ; ++q) {
          const int b = Blocks::of(q);
          codes[i][q] = fp8_quad_codes(s[i][q], factor[i][b], amax[i][b] >= kFp8MinAbsmax,
                                       spec_state_signed(kRule, i));
        }
    } else {
#pragma unroll
      for (int i = 0; i < kNumStates; ++i)
#pragma unroll
        for (int q = 0; q < kQ; ++q) {
          const int b = Blocks::of(q);
          codes[i][q] = fp8_quad_codes<true>(s[i][q], factor[i][b], amax[i][b] >= kFp8MinAbsmax,
                                             spec_state_signed(kRule, i));
        }
    }
  } else {
    float ratio[kNumStates][kQ][kQuad];
    bool fast = true;
#pragma unroll
    for (int i = 0; i < kNumStates; ++i)
#pragma unroll
      for (int q = 0; q < kQ; ++q)
        fast = fast & int8_quad_ratios(amax[i][Blocks::of(q)], s[i][q], ratio[i][q]);
    if (!fast) {
#pragma unroll
      for (int i = 0; i < kNumStates; ++i)
#pragma unroll
        for (int q = 0; q < kQ; ++q)
          int8_quad_ratios_ieee(amax[i][Blocks::of(q)], s[i][q], ratio[i][q]);
    }
#pragma unroll
    for (int i = 0; i < kNumStates; ++i)
#pragma unroll
      for (int q = 0; q < kQ; ++q)
        codes[i][q] = int8_quad_codes(s[i][q], ratio[i][q], spec_state_signed(kRule, i));
  }
  // NOTE: the stores in two copies, the masked ones only for a warp with a skipped element:
  // with one copy every quad's store was a branch of its own (vector or masked bytes), ~6
  // instructions of control flow per quad and state on the fast path.
  if (kept) {
#pragma unroll
    for (int i = 0; i < kNumStates; ++i)
#pragma unroll
      for (int q = 0; q < kQ; ++q)
        if (n[q] > 0)
          store_quad_codes(static_cast<uint8_t*>(p.state[i]), idx[q], n[q], vec[q],
                           code_keep[i][q], codes[i][q]);
  } else {
#pragma unroll
    for (int i = 0; i < kNumStates; ++i)
#pragma unroll
      for (int q = 0; q < kQ; ++q)
        if (n[q] > 0)
          store_quad_codes(static_cast<uint8_t*>(p.state[i]), idx[q], n[q], vec[q], 0u,
                           codes[i][q]);
  }
  // the first lane of the block holds its first column (in quad 0 when paired), so it is in
  // range whenever any column of the block is
#pragma unroll
  for (int i = 0; i < kNumStates; ++i)
#pragma unroll
    for (int b = 0; b < kPerState; ++b)
      if (n[b] > 0 && Blocks::first())
        p.absmax[i][row[b] * p.blocks_per_row + col[b] / FORGE_INT8_BLOCK] = amax[i][b];
}

// ---- stores of a batch of quads ---------------------------------------------------------------

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
// element's value, which may be, is converted but never stored. One conversion path for both
// outcomes of the block states' batch saves the merge of two (~30 instructions per pass).
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
    // and multiply per quad (sass_fastpath.py).
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

// ---- raw operands of whole quads, for software pipelining ---------------------------------
//
// The weight and states of kQ whole, vector-aligned quads as loaded (bf16 bits, int8 codes and
// absmax, fp32 words), not yet converted: a tile loop loads the next batch into one of these
// before it updates the current one, so those loads are in flight during the update, and
// converts them (unpack) only when it gets to them. Specialized Specs only (formats known at
// compile time).
template <class Spec, int kQ, bool kPaired = false>
struct RawQuads {
  static_assert(!Spec::kGeneric, "raw loads need the formats at compile time");
  using Blocks = QuadBlocks<kPaired, kQ>;
  static constexpr int kPerState = Blocks::kPerState;
  static constexpr int kWF = Spec::kWeightFormat, kSF = Spec::kStateFormat;
  static constexpr int kNS = Spec::kNumStates > 0 ? Spec::kNumStates : 1;
  static constexpr bool kWeight32 = kWF == FORGE_WEIGHT_FP32 || kWF == FORGE_WEIGHT_BF16_MASTER;
  static constexpr int kStateWords =
      kSF == FORGE_STATE_FP32 ? 4 : is_block_format(kSF) ? 1 : 2;
  // Absmax words: int8 decodes with each of the lane's blocks' absmax; fp8 needs only one
  // (the decode factors are spread over the block's lanes: lane_block).
  static constexpr bool kFp8 = kSF == FORGE_STATE_FP8_BLOCK64;
  static constexpr int kAbsmaxWords =
      kSF == FORGE_STATE_INT8_BLOCK64 ? kPerState * Spec::kNumStates
                                      : kFp8 && Spec::kNumStates > 0 ? 1 : 0;
  // Registers one batch holds while in flight.
  static constexpr int kWords =
      kQ * ((kWeight32 ? 4 : 2) + Spec::kNumStates * kStateWords) + kAbsmaxWords;
  uint32_t w[kQ][kWeight32 ? 4 : 2];  // fp32 words or bf16 pairs
  uint32_t s[kNS][kQ][kStateWords];   // fp32 words, bf16 pairs or 4 int8 / fp8 codes
  float absmax[kNS][kPerState];       // int8 only: the lane's blocks
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
        // NOTE: a stochastically rounded weight next to int8 states is read cache-streaming
        // (evict first). Llama totals of that step, 63.0 -> 61.1 / 102.6 -> 101.3 / 150.1 ->
        // 147.6 ms at T = 512 / 2048 / 4096. Not with a nearest weight (int8 states: 55.6 ->
        // 56.7 at T = 512; bf16 states: 30.4 -> 30.9).
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

// ---- the update of a batch of loaded quads -----------------------------------------------------
//
// The rule and the stores for kQ quads whose weight w and states s are already loaded (fp32);
// update_quads' other arguments. Specialized kernels first try the branch-free FastMath path
// and fall back to the exact one for the whole batch when it declines.
// kAligned: every quad's idx % 4 == 0, in range or not (stochastic rounding then hashes once
// per stream and quad even where vec is a run-time value: QuadDraws).
// kPaired: the quads lie in their blocks as QuadBlocks<true, kQ> says (block states only;
// update_tile's pipelined passes); otherwise in the classic layout.
template <int kQ, class Spec, class Math = FastMath, bool kAligned = false, bool kPaired = false>
__device__ __forceinline__ void update_loaded(const RuleScalars& k, const ParamView& p,
                                              const int64_t (&row)[kQ], const int64_t (&col)[kQ],
                                              const int64_t (&idx)[kQ], const int (&n)[kQ],
                                              const bool (&vec)[kQ], int lane16, bool want_sq,
                                              const float (&g)[kQ][kQuad], float (&w)[kQ][kQuad],
                                              float (&s)[FORGE_MAX_STATES][kQ][kQuad],
                                              StepTotals& totals) {
  static_assert(!kPaired || (!Spec::kGeneric && is_block_format(Spec::kStateFormat)),
                "the paired layout is for specialized block states");
  unsigned keep[kQ];  // bit e of keep[q]: element e of quad q was skipped
  if constexpr (!Spec::kGeneric) {
    RuleScalars r = k;
    r.rule = Spec::kRule;
    r.maximize = 0;
    r.wd_coupled = 0.0f;
    float w_new[kQ][kQuad], s_new[FORGE_MAX_STATES][kQ][kQuad];
    const bool fast = apply_quads_fast<kQ, Spec::kNumStates, Math>(r, n, g, w, s, w_new, s_new);
    if (fast && want_sq) {
      // NOTE: a separate uniform branch, not per-element predication: the fp64 work is
      // skipped entirely when nobody asked for it. Same additions, same order as
      // apply_quads.
#pragma unroll
      for (int q = 0; q < kQ; ++q)
#pragma unroll
        for (int e = 0; e < kQuad; ++e)
          if (e < n[q]) {
            const double gd = static_cast<double>(g[q][e] * r.grad_scale);
            totals.grad_sq_sum += gd * gd;
          }
    }
    // NOTE: block states: one store path for both outcomes, so the encoder's code is there
    // once (a duplicated copy doubled the hot loop; the measurement that found it 2.9x slower
    // had NaN weights, so that cause was not isolated).
    // Other formats: a dedicated store path with no skip masks and hardware bf16 rounding.
    // NOTE: the exact path works on copies of the inputs in w_new / s_new, so the fast path
    // stores its results where they are (copying them into w / s cost ~10 moves per pass).
    if constexpr (is_block_format(Spec::kStateFormat)) {
      if (fast) {
#pragma unroll
        for (int q = 0; q < kQ; ++q) keep[q] = 0;
      } else {
#pragma unroll
        for (int q = 0; q < kQ; ++q)
#pragma unroll
          for (int e = 0; e < kQuad; ++e) {
            w_new[q][e] = w[q][e];
#pragma unroll
            for (int i = 0; i < FORGE_MAX_STATES; ++i) s_new[i][q][e] = s[i][q][e];
          }
        apply_quads_resolved<kQ, Spec>(k, want_sq, n, g, w_new, s_new, keep, totals);
      }
      store_quads<kQ, Spec, false, kAligned, kPaired>(k, p, row, col, idx, n, vec, keep, lane16,
                                                      w_new, s_new);
      return;
    } else {
      if (fast) {
        const unsigned none[kQ] = {};
        store_quads<kQ, Spec, true, kAligned>(k, p, row, col, idx, n, vec, none, lane16, w_new,
                                              s_new);
        return;
      }
    }
  }
  apply_quads_resolved<kQ, Spec>(k, want_sq, n, g, w, s, keep, totals);
  store_quads<kQ, Spec, false, kAligned>(k, p, row, col, idx, n, vec, keep, lane16, w, s);
}

// ---- the update of a batch of quads ----------------------------------------------------------
//
// Quad q: row row[q], columns [col[q], col[q] + n[q]) with n[q] in 0..4 (0: nothing of this
// lane is in range, but the lane still takes part in the int8 shuffles); col[q] % 4 == 0 and
// (col[q] % 64) / 4 == lane16, the lane's index in its half-warp; idx[q] = row[q] * p.cols +
// col[q] (the caller computes it, usually by stepping a per-thread offset). g[q][e] is the
// fp32 gradient of column col[q] + e. Every lane of the warp must call this with the same
// k, p.
//
// Spec: the compile-time configuration (GenericSpec: everything from k and p at run time).
// kFull: every quad is whole (n[q] == 4) and p.vec4 != 0, so every access is one vector and
// the per-element range checks disappear (interior tiles). Math: the specialized path's
// branch-free arithmetic (FastMath, or FastMathWithZeros).
//
// NOTE: kQ > 1 batches the quads phase by phase (all loads, then the rule, then all stores)
// so kQ quads' worth of loads are in flight at once: the fused epilogue is latency-bound
// otherwise (one quad is only ~24 B of loads per thread). The compiler cannot reorder the
// loads of one quad past the stores of another by itself (same arrays, run-time indices).
template <int kQ, class Spec = GenericSpec, bool kFull = false, class Math = FastMath>
__device__ __forceinline__ void update_quads(const RuleScalars& k, const ParamView& p,
                                             const int64_t (&row)[kQ], const int64_t (&col)[kQ],
                                             const int64_t (&idx)[kQ], const int (&n_in)[kQ],
                                             int lane16, bool want_sq,
                                             const float (&g)[kQ][kQuad], StepTotals& totals) {
  constexpr int kSF = Spec::kStateFormat;
  const int weight_format = Spec::kGeneric ? p.weight_format : Spec::kWeightFormat;
  const int num_states = Spec::kGeneric ? k.num_states : Spec::kNumStates;
  int n[kQ];
  bool vec[kQ];
  float w[kQ][kQuad];
  float s[FORGE_MAX_STATES][kQ][kQuad];
#pragma unroll
  for (int q = 0; q < kQ; ++q) {
    n[q] = kFull ? kQuad : n_in[q];
    vec[q] = kFull || (n[q] == kQuad && p.vec4 != 0);
    switch (weight_format) {
      case FORGE_WEIGHT_FP32:
        load_quad_f32(static_cast<const float*>(p.weight), idx[q], n[q], vec[q], w[q]);
        break;
      case FORGE_WEIGHT_BF16_MASTER:
        load_quad_f32(p.master, idx[q], n[q], vec[q], w[q]);
        break;
      default:
        load_quad_bf16(static_cast<const uint16_t*>(p.weight), idx[q], n[q], vec[q], w[q]);
    }
  }
#pragma unroll
  for (int i = 0; i < FORGE_MAX_STATES; ++i) {
    const bool is_signed =
        Spec::kGeneric ? k.state_signed[i] != 0 : spec_state_signed(Spec::kRule, i);
#pragma unroll
    for (int q = 0; q < kQ; ++q) {
      if (i < num_states) {
        load_state_quad<kSF>(p, i, is_signed, row[q], col[q], idx[q], n[q], vec[q], s[i][q]);
      } else {
#pragma unroll
        for (int e = 0; e < kQuad; ++e) s[i][q][e] = 0.0f;
      }
    }
  }

  update_loaded<kQ, Spec, Math>(k, p, row, col, idx, n, vec, lane16, want_sq, g, w, s, totals);
}

// ---- run scalars (CUDA graphs) ----------------------------------------------------------------
//
// The CTA's copy of the step's RuleScalars (shared memory), filled by run_scalars_refused from
// the words it checked.
// NOTE: a kRunScalars kernel reads its scalars here, not through run_k: the compiler cannot
// tell run_k from the weight and state arrays the update stores to, so it reloaded every
// scalar from global memory in every pass (16 loads per 2 passes of AdamW SR/SR; Llama at
// T = 512, bf16 W + states: 32.0 ms against 29.5 with launch scalars, 30.6 with the copy,
// wgrad_bench --run-scalars).
static_assert(sizeof(RuleScalars) % 8 == 0, "RuleScalars is whole 8-byte words");
constexpr int kRuleScalarsWords = static_cast<int>(sizeof(RuleScalars) / 8);
static_assert(kRuleScalarsWords <= kRunScalarsWords, "the checked words cover the scalars");
__device__ __forceinline__ RuleScalars& run_scalars_copy() {
  __shared__ RuleScalars copy;
  return copy;
}

// A kRunScalars kernel reads the step's RuleScalars from hparams.run_scalars when it runs, so it
// checks that buffer's tag there (run_scalars.h: filled, unchanged since, for this rule, state
// count and hyper-parameters), at every replay of a captured graph, before it writes anything.
// On a mismatch the launch writes nothing: every CTA returns, and the first one adds
// `elements` (rows · cols: every element, skipped) to *nonfinite_count where the step has one
// (forge.h, forge_hparams.run_scalars). `rule`, `num_states`: the launch's own RuleScalars';
// `key`: run_scalars_key() of the call's hyper-parameters.
// Returns whether the CTA must return. Every thread of the CTA must call it, before the kernel
// writes anything or reads the scalars (it ends with a __syncthreads); warp 0 reads the
// buffer, one 8-byte word per lane, and leaves the scalars it checked in run_scalars_copy(),
// where the kernel then reads them.
// NOTE: per CTA, one read of the buffer (L2) and one hash per lane, then a shuffle reduction:
// the checksum's terms are independent (run_scalars_checksum), not a chain of 31 hashes.
__device__ __forceinline__ bool run_scalars_refused(const RuleScalars* run_k, int32_t rule,
                                                    int32_t num_states, uint64_t key,
                                                    int64_t elements,
                                                    unsigned long long* nonfinite_count) {
  __shared__ int s_refused;
  if (threadIdx.x < 32) {
    const int lane = static_cast<int>(threadIdx.x);
    const unsigned char* bytes = reinterpret_cast<const unsigned char*>(run_k);
    uint64_t term = 0;
    if (lane < kRunScalarsWords) {
      const uint64_t word = reinterpret_cast<const uint64_t*>(bytes)[lane];
      term = run_scalars_word_hash(word, lane);
      if (lane < kRuleScalarsWords) reinterpret_cast<uint64_t*>(&run_scalars_copy())[lane] = word;
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1)
      term += __shfl_xor_sync(0xFFFFFFFFu, term, offset);
    if (lane == 0) {
      RunScalarsTag tag;
      memcpy(&tag, bytes + kRunScalarsTagOffset, sizeof(tag));
      const bool refused = run_scalars_tag_check(tag, run_scalars_checksum_of_sum(term), rule,
                                                 num_states, key) != kRunScalarsMatch;
      s_refused = refused ? 1 : 0;
      if (refused && nonfinite_count != nullptr && blockIdx.x == 0 && blockIdx.y == 0 &&
          blockIdx.z == 0)
        atomicAdd(nonfinite_count, static_cast<unsigned long long>(elements));
    }
  }
  __syncthreads();
  return s_refused != 0;
}

// ---- the by-products, once per CTA -------------------------------------------------------
// Warp shuffles, then one shared-memory slot per warp, then one atomic per CTA and
// output. Every one of the kThreads threads must call this: with kBarrier == 0 they are the
// whole CTA (__syncthreads, tid = threadIdx.x); otherwise they are the warps that share named
// barrier kBarrier, tid their index among them.
template <int kThreads, int kBarrier = 0>
__device__ __forceinline__ void flush_totals(StepTotals t, double* grad_sq_sum,
                                             unsigned long long* nonfinite_count,
                                             int tid = -1) {
  constexpr int kWarps = kThreads / 32;
  __shared__ double s_sq[kWarps];
  __shared__ unsigned int s_nf[kWarps];
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    t.grad_sq_sum += __shfl_xor_sync(0xFFFFFFFFu, t.grad_sq_sum, offset);
    t.nonfinite += __shfl_xor_sync(0xFFFFFFFFu, t.nonfinite, offset);
  }
  if (kBarrier == 0) tid = threadIdx.x;
  const int warp = tid / 32, lane = tid % 32;
  if (lane == 0) {
    s_sq[warp] = t.grad_sq_sum;
    s_nf[warp] = t.nonfinite;
  }
  if constexpr (kBarrier == 0) {
    __syncthreads();
  } else {
    named_barrier_sync<kBarrier, kThreads>();
  }
  if (tid == 0) {
    double sq = 0.0;
    unsigned long long nf = 0;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      sq += s_sq[w];
      nf += s_nf[w];
    }
    if (grad_sq_sum != nullptr && sq != 0.0) atomicAdd(grad_sq_sum, sq);
    if (nonfinite_count != nullptr && nf != 0) atomicAdd(nonfinite_count, nf);
  }
}

}  // namespace cuda
}  // namespace forge
