// cpu_wgrad_tile.h — the CPU backend's dW tile accumulation: for a [bm × bn] tile of W at
// (r0, c0), acc[i][j] += dY[t][r0 + i] · X[t][c0 + j] for t = t0, t0 + 1, ... in ascending
// order, each product rounded to fp32 and then added (no FMA). Every element of the tile sees
// exactly the naive sum's operations in the naive order, so the result is bit-identical to
// it on every path below.
//
// How it is fast without changing that order:
//  - tokens go in chunks; a chunk's fp32 X and dY are read in place, bf16/fp16 ones and the
//    tile's ragged edge are packed to contiguous fp32 panels first (converted once, zero
//    padding to whole micro-tiles);
//  - a register-blocked micro-kernel keeps an [MR × NR] block of accumulators in vector
//    registers while t runs over the chunk: one broadcast dY value times NR X values per row
//    and token, multiplied and then added (two instructions, never a fused one);
//  - SIMD lanes are different elements of dW, so vectorizing over columns reorders nothing;
//    between chunks the accumulators go through memory (fp32 stores and loads are exact).
// Three builds of the same template: AVX-512 and AVX2 (GCC target attributes, picked at run
// time by cpuid) and a portable one (any target GCC or Clang vectorizes vector_size types
// for, scalar code elsewhere). All three give the same bits; tests/cpp/test_cpu_fused.cpp
// checks each one this machine can run against the naive sum.
//
// Header-only so that the tests can call every path directly, not only the one dispatch picks.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "core/formats.h"
#include "forge/forge.h"

namespace forge {
namespace cpu {

// NOTE: tokens packed per chunk: the X sub-panel one micro-kernel streams ([kTokenChunk × NR]
// fp32, 32 KiB at NR = 32) stays in a 48 KiB L1 beside the dY sub-panel.
constexpr int64_t kTokenChunk = 256;
// The largest micro-tile of any path below: buffers padded by this much hold every path's
// whole micro-tiles.
constexpr int64_t kMaxMR = 8;
constexpr int64_t kMaxNR = 32;

enum class TileIsa { kPortable = 0, kAvx2 = 1, kAvx512 = 2 };

inline const char* tile_isa_name(TileIsa isa) {
  switch (isa) {
    case TileIsa::kAvx512: return "avx512";
    case TileIsa::kAvx2: return "avx2";
    default: return "portable";
  }
}

// Working memory of one thread for tiles of at most [tile_rows × tile_cols], in floats:
// acc [tile_rows + kMaxMR rows × ldacc], the dY panel [kTokenChunk × (tile_rows + kMaxMR)]
// and the X panel [kTokenChunk × ldacc]: room for the padding to whole micro-tiles.
struct TileBuffers {
  int64_t ldacc, acc_floats, dy_floats, x_floats;
  TileBuffers(int64_t tile_rows, int64_t tile_cols)
      : ldacc(tile_cols + kMaxNR),
        acc_floats((tile_rows + kMaxMR) * ldacc),
        dy_floats(kTokenChunk * (tile_rows + kMaxMR)),
        x_floats(kTokenChunk * ldacc) {}
  int64_t total() const { return acc_floats + dy_floats + x_floats; }
};

// One tile's accumulation: what the paths below take.
struct TileJob {
  const void* x;   // [T, in] row-major, ld = ldx, x_dtype
  const void* dy;  // [T, out] row-major, ld = lddy, dy_dtype
  forge_dtype x_dtype, dy_dtype;
  int64_t ldx, lddy, tokens;
  int64_t r0, c0, bm, bn;  // the tile: rows [r0, r0 + bm) of W, columns [c0, c0 + bn)
};

namespace detail {

#if defined(__GNUC__)
#define FORGE_TILE_INLINE inline __attribute__((always_inline))
#else
#define FORGE_TILE_INLINE inline
#endif

typedef float Vec4 __attribute__((vector_size(16)));
typedef float Vec8 __attribute__((vector_size(32)));
typedef float Vec16 __attribute__((vector_size(64)));

template <forge_dtype D>
FORGE_TILE_INLINE float load_as_float(const void* base, int64_t i) {
  if constexpr (D == FORGE_DTYPE_FP32) return static_cast<const float*>(base)[i];
  else if constexpr (D == FORGE_DTYPE_BF16) return bf16_to_float(static_cast<const uint16_t*>(base)[i]);
  else return fp16_to_float(static_cast<const uint16_t*>(base)[i]);
}

// panel[(g * tc + t) * width + k] = src[(t0 + t) * ld + first + g * width + k] as fp32 for
// the n valid columns (k + g * width < n), 0 for the padding up to whole groups of `width`:
// per group of `width` columns, tc rows of `width` consecutive floats.
template <forge_dtype D>
FORGE_TILE_INLINE void pack_panel(const void* src, int64_t ld, int64_t t0, int64_t tc,
                                  int64_t first, int64_t n, int64_t width, float* panel) {
  const int64_t groups = (n + width - 1) / width;
  for (int64_t t = 0; t < tc; ++t) {
    const int64_t row = (t0 + t) * ld + first;
    for (int64_t g = 0; g < groups; ++g) {
      float* out = panel + (g * tc + t) * width;
      const int64_t k0 = g * width, valid = std::min(width, n - k0);
      if constexpr (D == FORGE_DTYPE_FP32) {
        std::memcpy(out, static_cast<const float*>(src) + row + k0, sizeof(float) * valid);
      } else {
        for (int64_t k = 0; k < valid; ++k) out[k] = load_as_float<D>(src, row + k0 + k);
      }
      for (int64_t k = valid; k < width; ++k) out[k] = 0.0f;
    }
  }
}

template <int W>
FORGE_TILE_INLINE void pack_dispatch(const void* src, forge_dtype dtype, int64_t ld, int64_t t0,
                                     int64_t tc, int64_t first, int64_t n, float* panel) {
  switch (dtype) {
    case FORGE_DTYPE_FP32: pack_panel<FORGE_DTYPE_FP32>(src, ld, t0, tc, first, n, W, panel); break;
    case FORGE_DTYPE_BF16: pack_panel<FORGE_DTYPE_BF16>(src, ld, t0, tc, first, n, W, panel); break;
    default: pack_panel<FORGE_DTYPE_FP16>(src, ld, t0, tc, first, n, W, panel); break;
  }
}

// acc[i][j] (row stride ldacc) += Σ_t dy[t][i] · x[t][j] over t = 0 .. tc - 1 in order, for
// an [MR × NV·lanes] block: dy rows of MR floats ds apart, x rows of NV·lanes floats xs apart.
// NOTE: `c + d * x` with -ffp-contract=off (CMakeLists.txt, every target) is a multiply,
// rounded, then an add: the order and rounding of the naive sum, per lane.
template <typename V, int MR, int NV>
FORGE_TILE_INLINE void micro_kernel(const float* __restrict dy, int64_t ds, const float* __restrict x,
                                    int64_t xs, int64_t tc, float* __restrict acc, int64_t ldacc) {
  constexpr int kLanes = sizeof(V) / sizeof(float);
  V c[MR][NV];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) std::memcpy(&c[i][v], acc + i * ldacc + v * kLanes, sizeof(V));
  for (int64_t t = 0; t < tc; ++t, dy += ds, x += xs) {
    V xv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) std::memcpy(&xv[v], x + v * kLanes, sizeof(V));
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const float di = dy[i];
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) c[i][v] = c[i][v] + di * xv[v];
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) std::memcpy(acc + i * ldacc + v * kLanes, &c[i][v], sizeof(V));
}

// Where one group of `width` rows (dY) or columns (X) of a chunk is read from: fp32 groups
// of full width in place (rows `stride` apart), the others from the packed panel.
struct GroupSource {
  const float* data;
  int64_t stride;
};

// The groups of `n` elements from `first` of tokens [t0, t0 + tc): groups [0, direct) are
// read in place (fp32 input), the rest are packed (converted, padded) into panel.
template <int W>
struct ChunkOperand {
  const void* src;
  forge_dtype dtype;
  int64_t ld, first, n, direct;
  float* panel;

  ChunkOperand(const void* src_, forge_dtype dtype_, int64_t ld_, int64_t first_, int64_t n_,
               float* panel_)
      : src(src_), dtype(dtype_), ld(ld_), first(first_), n(n_),
        // NOTE: fp32 needs no conversion, so whole groups skip the copy (it cost a third
        // of the tile's time on the default model's shapes).
        direct(dtype_ == FORGE_DTYPE_FP32 ? n_ / W : 0),
        panel(panel_) {}

  FORGE_TILE_INLINE void pack(int64_t t0, int64_t tc) const {
    if (direct * W < n) pack_dispatch<W>(src, dtype, ld, t0, tc, first + direct * W, n - direct * W, panel);
  }
  FORGE_TILE_INLINE GroupSource group(int64_t g, int64_t t0, int64_t tc) const {
    if (g < direct) return {static_cast<const float*>(src) + t0 * ld + first + g * W, ld};
    return {panel + (g - direct) * tc * W, W};
  }
};

// The whole tile: acc (zeroed by the caller, row stride ldacc) += its dW over all tokens, in
// chunks of kTokenChunk tokens. dy_panel and x_panel: TileBuffers' sizes.
template <typename V, int MR, int NV>
FORGE_TILE_INLINE void accumulate_tile(const TileJob& job, float* acc, int64_t ldacc,
                                       float* dy_panel, float* x_panel) {
  constexpr int kNR = NV * (sizeof(V) / sizeof(float));
  static_assert(MR <= kMaxMR && kNR <= kMaxNR, "TileBuffers' padding is too small");
  const int64_t row_groups = (job.bm + MR - 1) / MR, col_groups = (job.bn + kNR - 1) / kNR;
  const ChunkOperand<MR> dy(job.dy, job.dy_dtype, job.lddy, job.r0, job.bm, dy_panel);
  const ChunkOperand<kNR> x(job.x, job.x_dtype, job.ldx, job.c0, job.bn, x_panel);
  for (int64_t t0 = 0; t0 < job.tokens; t0 += kTokenChunk) {
    const int64_t tc = std::min(kTokenChunk, job.tokens - t0);
    dy.pack(t0, tc);
    x.pack(t0, tc);
    // NOTE: columns outside, rows inside: one X group's [tc × NR] stays in L1 while every
    // row group's dY streams past it.
    for (int64_t cg = 0; cg < col_groups; ++cg) {
      const GroupSource xs = x.group(cg, t0, tc);
      for (int64_t rg = 0; rg < row_groups; ++rg) {
        const GroupSource ds = dy.group(rg, t0, tc);
        micro_kernel<V, MR, NV>(ds.data, ds.stride, xs.data, xs.stride, tc,
                                acc + rg * MR * ldacc + cg * kNR, ldacc);
      }
    }
  }
}

}  // namespace detail

// NOTE: [MR × NR] per instruction set, the fastest measured (2048 tokens, 128-row tiles):
// AVX-512 8 × 32 (16 of 32 zmm accumulate), AVX2 6 × 16 (12 of 16 ymm), SSE 4 × 8.
inline void accumulate_tile_portable(const TileJob& job, float* acc, int64_t ldacc, float* dy_panel,
                                     float* x_panel) {
  detail::accumulate_tile<detail::Vec4, 4, 2>(job, acc, ldacc, dy_panel, x_panel);
}

#if defined(__x86_64__) && defined(__GNUC__)
#define FORGE_TILE_X86 1
__attribute__((target("avx2"))) inline void accumulate_tile_avx2(const TileJob& job, float* acc,
                                                                 int64_t ldacc, float* dy_panel,
                                                                 float* x_panel) {
  detail::accumulate_tile<detail::Vec8, 6, 2>(job, acc, ldacc, dy_panel, x_panel);
}

__attribute__((target("avx512f"))) inline void accumulate_tile_avx512(const TileJob& job, float* acc,
                                                                      int64_t ldacc, float* dy_panel,
                                                                      float* x_panel) {
  detail::accumulate_tile<detail::Vec16, 8, 2>(job, acc, ldacc, dy_panel, x_panel);
}
#endif

// Whether this CPU (and its OS, which must save the wide registers) runs the path.
inline bool tile_isa_supported(TileIsa isa) {
  switch (isa) {
    case TileIsa::kPortable: return true;
#if defined(FORGE_TILE_X86)
    case TileIsa::kAvx2: return __builtin_cpu_supports("avx2");
    case TileIsa::kAvx512: return __builtin_cpu_supports("avx512f");
#endif
    default: return false;
  }
}

inline TileIsa best_tile_isa() {
  if (tile_isa_supported(TileIsa::kAvx512)) return TileIsa::kAvx512;
  if (tile_isa_supported(TileIsa::kAvx2)) return TileIsa::kAvx2;
  return TileIsa::kPortable;
}

// acc (zeroed by the caller; ldacc = TileBuffers::ldacc) += the tile's dW on path `isa`
// (one tile_isa_supported says this CPU runs).
inline void accumulate_tile(TileIsa isa, const TileJob& job, float* acc, int64_t ldacc,
                            float* dy_panel, float* x_panel) {
  switch (isa) {
#if defined(FORGE_TILE_X86)
    case TileIsa::kAvx512: accumulate_tile_avx512(job, acc, ldacc, dy_panel, x_panel); return;
    case TileIsa::kAvx2: accumulate_tile_avx2(job, acc, ldacc, dy_panel, x_panel); return;
#endif
    default: accumulate_tile_portable(job, acc, ldacc, dy_panel, x_panel); return;
  }
}

}  // namespace cpu
}  // namespace forge
