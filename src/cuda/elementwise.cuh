// elementwise.cuh — the device code of elementwise_step and of the state kernels
// (state_fill, state_to_fp32, state_from_fp32): the optimizer update of a parameter whose
// gradient is already in memory (an embedding, a layer the fused kernels do not cover), and
// the states' fill / decode / encode. The same update.cuh code as the fused epilogue, so the
// bits match the CPU backend's. Included by cuda_backend.cu only (its kernel tables and
// launchers), hence the unnamed namespace.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include "core/formats.h"
#include "core/rules.h"
#include "cuda/update.cuh"
#include "forge/forge.h"

namespace forge {
namespace cuda {
namespace {

// One half-warp per (row, 64-column block): lane l of the half owns columns 4l..4l+3 of the
// block, as in the wgrad epilogue. The loop bound is uniform per warp, so both halves run
// every iteration (the int8 absmax shuffles need the whole warp).
constexpr int kElementwiseThreads = 256;

struct BlockCursor {
  int64_t row, col;
  int n;  // elements of this lane in range (0..4)
};

__device__ __forceinline__ BlockCursor block_cursor(const ParamView& p, int64_t pair, int64_t pairs,
                                                    int lane16) {
  BlockCursor c{0, 0, 0};
  if (pair < pairs) {
    c.row = pair / p.blocks_per_row;
    c.col = (pair % p.blocks_per_row) * FORGE_INT8_BLOCK + lane16 * kQuad;
    c.n = c.col < p.cols ? static_cast<int>(min64(kQuad, p.cols - c.col)) : 0;
  }
  return c;
}

// The gradient quad at idx in fp32 (load_input's conversions). `vec`: the quad is whole and
// one aligned vector load is legal (cols % 4 == 0, gradient 16-byte aligned).
__device__ __forceinline__ void load_grad_quad(const void* grad, int dtype, int64_t idx, int n,
                                               bool vec, float (&g)[kQuad]) {
  switch (dtype) {
    case FORGE_DTYPE_FP32:
      load_quad_f32(static_cast<const float*>(grad), idx, n, vec, g);
      break;
    case FORGE_DTYPE_BF16:
      load_quad_bf16(static_cast<const uint16_t*>(grad), idx, n, vec, g);
      break;
    default:  // FORGE_DTYPE_FP16
      load_quad_16(static_cast<const uint16_t*>(grad), idx, n, vec, g,
                   [](uint16_t h) { return fp16_to_float(h); });
  }
}

// The element-wise loop, software-pipelined, on a flat view: `p` is the parameter seen as one
// row (rows = 1, cols = rows · cols, which keeps every element offset, int8 block index and
// stochastic-rounding index, as the original's cols % 64 == 0), the gradient is bf16 and
// every access is a whole vector. The raw weight, states and gradient of the warp's next
// iteration are loaded before the current one is updated, as update_tile does in the fused
// kernels: one batch of loads stays in flight during the arithmetic.
// Pairs past the end (the warp's last iteration) load the last pair again and store nothing
// (n = 0); their lanes still take part in the int8 shuffles.
template <class Spec, int kQ>
__device__ __forceinline__ void elementwise_flat_pipelined(const uint16_t* grad, const ParamView& p,
                                                           const RuleScalars& k, bool want_sq,
                                                           StepTotals& totals) {
  const int lane = threadIdx.x % 32, lane16 = lane % 16;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * blockDim.x / 32;
  const int64_t pairs = p.blocks_per_row;  // rows == 1
  constexpr int kPairsPerWarp = 2 * kQ;
  const int64_t stride = warps * kPairsPerWarp;
  const int64_t no_row[kQ] = {};  // row 0 of the flat view
  // Element offsets (= columns of the flat view) of the lane's kQ quads at `base`.
  auto offsets = [&](int64_t base, int64_t (&idx)[kQ], int (&n)[kQ]) {
#pragma unroll
    for (int q = 0; q < kQ; ++q) {
      const int64_t pair = base + 2 * q + lane / 16;
      const bool in = pair < pairs;
      idx[q] = (in ? pair : pairs - 1) * FORGE_INT8_BLOCK + lane16 * kQuad;
      n[q] = in ? kQuad : 0;
    }
  };
  int64_t base = warp * kPairsPerWarp;
  if (base >= pairs) return;
  RawQuads<Spec, kQ> next;
  uint2 g_next[kQ];
  {
    int64_t idx[kQ];
    int n[kQ];
    offsets(base, idx, n);
    next.load(p, no_row, idx, idx);
#pragma unroll
    for (int q = 0; q < kQ; ++q) g_next[q] = *reinterpret_cast<const uint2*>(grad + idx[q]);
  }
#pragma unroll 1
  for (; base < pairs; base += stride) {
    const RawQuads<Spec, kQ> cur = next;
    uint2 g_cur[kQ];
#pragma unroll
    for (int q = 0; q < kQ; ++q) g_cur[q] = g_next[q];
    int64_t idx[kQ];
    int n[kQ];
    offsets(base, idx, n);
    {
      // NOTE: unconditional (the last iteration reloads its own operands) so the compiler
      // keeps these loads ahead of the update, as in update_tile.
      int64_t idx_next[kQ];
      int n_next[kQ];
      offsets(base + stride < pairs ? base + stride : base, idx_next, n_next);
      next.load(p, no_row, idx_next, idx_next);
#pragma unroll
      for (int q = 0; q < kQ; ++q) g_next[q] = *reinterpret_cast<const uint2*>(grad + idx_next[q]);
    }
    float w[kQ][kQuad], st[FORGE_MAX_STATES][kQ][kQuad], g[kQ][kQuad];
    bool vec[kQ];
    cur.unpack(w, st);
#pragma unroll
    for (int q = 0; q < kQ; ++q) {
      g[q][0] = bf16_to_float(static_cast<uint16_t>(g_cur[q].x & 0xFFFFu));
      g[q][1] = bf16_to_float(static_cast<uint16_t>(g_cur[q].x >> 16));
      g[q][2] = bf16_to_float(static_cast<uint16_t>(g_cur[q].y & 0xFFFFu));
      g[q][3] = bf16_to_float(static_cast<uint16_t>(g_cur[q].y >> 16));
      vec[q] = n[q] == kQuad;
    }
    // idx: multiples of 4 (64-column pairs), out-of-range lanes included
    update_loaded<kQ, Spec, FastMathWithZeros, true>(k, p, no_row, idx, idx, n, vec, lane16,
                                                     want_sq, g, w, st, totals);
  }
}

// Whether elementwise_flat_pipelined runs for Spec: one batch of raw operands in at most 12
// registers (bf16 weight with bf16 or int8 states), the fused kernels' criterion.
template <class Spec, int kQ>
constexpr bool kElementwisePipelined = !Spec::kGeneric && raw_quads_words<Spec, kQ>() <= 12;

// elementwise_step: each warp takes 2·kQ (row, 64-column block) pairs per iteration, its
// half-warps alternating, so a lane updates kQ quads at once (update_quads batches their
// loads). Spec as in the wgrad kernels: the configurations forge.optim runs get their rule
// and formats as constants and the branch-free path (with zeros: most rows of an embedding's
// m and v are exactly 0); GenericSpec covers the rest.
// NOTE: specialized kernels with kQ = 2, not one generic kernel with kQ = 1 and scalar
// gradient loads, which stays far from DRAM bandwidth on a large embedding.
// `flat`: p is the flat view and the gradient bf16 with vector access (elementwise_step
// checks both); the pipelined loop runs where kElementwisePipelined.
// NOTE: 2 CTAs per SM asked for (__launch_bounds__): without it ptxas gives the int8 kernels
// more than 128 registers, one CTA and 8 warps per SM.
template <class Spec, int kQ>
__device__ __forceinline__ void elementwise_body(const void* grad, int grad_dtype, bool grad_vec,
                                                 bool flat, const ParamView& p,
                                                 const RuleScalars& k, double* grad_sq_sum,
                                                 unsigned long long* nonfinite_count) {
  const int lane = threadIdx.x % 32, lane16 = lane % 16;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * blockDim.x / 32;
  const int64_t pairs = p.rows * p.blocks_per_row;
  constexpr int kPairsPerWarp = 2 * kQ;
  const bool want_sq = grad_sq_sum != nullptr;
  StepTotals totals{0.0, 0u};
  if constexpr (block_tables_needed<Spec>() != 0u) {
    block_tables_init<block_tables_needed<Spec>()>(threadIdx.x);
    __syncthreads();
  }
  if constexpr (kElementwisePipelined<Spec, kQ>) {
    if (flat) {
      elementwise_flat_pipelined<Spec, kQ>(static_cast<const uint16_t*>(grad), p, k, want_sq,
                                           totals);
      if (grad_sq_sum != nullptr || nonfinite_count != nullptr)
        flush_totals<kElementwiseThreads>(totals, grad_sq_sum, nonfinite_count);
      return;
    }
  }
  for (int64_t base = warp * kPairsPerWarp; base < pairs; base += warps * kPairsPerWarp) {
    int64_t row[kQ], col[kQ], idx[kQ];  // grad: [rows, cols], contiguous
    int n[kQ];
    float g[kQ][kQuad];
#pragma unroll
    for (int q = 0; q < kQ; ++q) {
      const BlockCursor c = block_cursor(p, base + 2 * q + lane / 16, pairs, lane16);
      row[q] = c.row;
      col[q] = c.col;
      idx[q] = c.row * p.cols + c.col;
      n[q] = c.n;
      load_grad_quad(grad, grad_dtype, idx[q], n[q], grad_vec && n[q] == kQuad, g[q]);
    }
    update_quads<kQ, Spec, false, FastMathWithZeros>(k, p, row, col, idx, n, lane16, want_sq, g,
                                                      totals);
  }
  if (grad_sq_sum != nullptr || nonfinite_count != nullptr)
    flush_totals<kElementwiseThreads>(totals, grad_sq_sum, nonfinite_count);
}

// run_k: the step's scalars in device memory, for a kRunScalars Spec (CUDA graphs); k then
// only holds what chose the kernel, and run_key is run_scalars_key() of the call's
// hyper-parameters: the launch writes nothing unless run_k's tag matches them
// (run_scalars_refused), and reads the scalars from the CTA's copy of what it checked.
// Otherwise unused.
template <class Spec, int kQ>
__global__ void __launch_bounds__(kElementwiseThreads, 2)
    elementwise_kernel(const void* grad, int grad_dtype, bool grad_vec, bool flat,
                       const ParamView p, const RuleScalars k, const RuleScalars* run_k,
                       uint64_t run_key, double* grad_sq_sum,
                       unsigned long long* nonfinite_count) {
  if constexpr (Spec::kRunScalars) {
    if (run_scalars_refused(run_k, k.rule, k.num_states, run_key, p.rows * p.cols,
                            nonfinite_count))
      return;
    elementwise_body<Spec, kQ>(grad, grad_dtype, grad_vec, flat, p, run_scalars_copy(),
                               grad_sq_sum, nonfinite_count);
  } else {
    elementwise_body<Spec, kQ>(grad, grad_dtype, grad_vec, flat, p, k, grad_sq_sum,
                               nonfinite_count);
  }
}

enum StateOp : int { kStateFill = 0, kStateToFp32 = 1, kStateFromFp32 = 2 };

// state_from_fp32's check before it writes: the smallest index i < n of `in` holding a value no
// step stores in a state (not storable, formats.h, or negative for an unsigned state: the CPU
// backend's refusals), atomicMin-ed into *first, which the host presets to ~0.
__global__ void __launch_bounds__(kElementwiseThreads)
    state_value_check_kernel(const float* in, int64_t n, bool is_signed,
                             unsigned long long* first) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  unsigned long long mine = ~0ull;
  // a thread's indices ascend: its first offending one is its smallest
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const float x = in[i];
    if (!storable(x) || (!is_signed && x < 0.0f)) {
      mine = static_cast<unsigned long long>(i);
      break;
    }
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1)
    mine = min(mine, __shfl_xor_sync(0xFFFFFFFFu, mine, offset));
  if (threadIdx.x % 32 == 0 && mine != ~0ull) atomicMin(first, mine);
}

// The state in slot 0 of p filled with a value, decoded to fp32 (`out`, [rows, cols]), or
// encoded from fp32 (`in`): the CPU's load_state/store_state with no stochastic rounding.
// NOTE: the host moves the wanted state into slot 0 so that every state access here uses a
// compile-time slot (a run-time index into the launch parameters would copy them to local
// memory).
__global__ void __launch_bounds__(kElementwiseThreads)
    state_kernel(const ParamView p, bool is_signed, int op, float value, const float* in,
                 float* out) {
  const int lane = threadIdx.x % 32, lane16 = lane % 16;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * blockDim.x / 32;
  const int64_t pairs = p.rows * p.blocks_per_row;
  block_tables_init(threadIdx.x);  // the state format is a run-time value here
  __syncthreads();
  for (int64_t base = warp * 2; base < pairs; base += warps * 2) {
    const BlockCursor c = block_cursor(p, base + lane / 16, pairs, lane16);
    const int64_t idx = c.row * p.cols + c.col;
    float v[kQuad];
    if (op == kStateToFp32) {
      load_state_quad(p, 0, is_signed, c.row, c.col, idx, c.n, false, v);
#pragma unroll
      for (int e = 0; e < kQuad; ++e)
        if (e < c.n) out[idx + e] = v[e];
    } else {
#pragma unroll
      for (int e = 0; e < kQuad; ++e)
        v[e] = op == kStateFill ? value : (e < c.n ? in[idx + e] : 0.0f);
      const QuadDraws no_draw(0, 0, true, false);  // nearest rounding: never asks for bits
      store_state_quad(p, 0, is_signed, c.row, c.col, idx, c.n, false, 0u, lane16, false, no_draw,
                       v);
    }
  }
}

}  // namespace
}  // namespace cuda
}  // namespace forge
