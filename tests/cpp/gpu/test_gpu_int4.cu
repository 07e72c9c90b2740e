// test_gpu_int4.cu — the CUDA backend's int4 codec (src/cuda/update/block_codecs.cuh:
// int4_decode_fast, int4_code_fast, int4_quad_codes (both forms) over int8_quad_ratios /
// int8_quad_ratios_ieee; src/cuda/update/quads.cuh: load_quad_int4, store_quad_int4) against
// formats.h's reference functions, run on the device: every code, every float bit pattern
// (all 2^32, both maps), 2^24 random blocks of four values against their absmax, and the packed
// stores with every mask of kept elements and every count of elements in range. Bit for bit;
// any difference would break CPU/GPU equality of int4 states.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include "core/formats.h"
#include "cuda/update.cuh"
#include "device_draws.cuh"
#include "gpu_test_util.h"

namespace fgt {
namespace {

using forge::cuda::kQuad;

// Every code of both maps, against a few absmax values (0, 1, a subnormal, a large one).
__global__ void compare_decode(unsigned long long* mismatches) {
  forge::cuda::block_tables_init(threadIdx.x);  // the device forms read the signed map's table
  __syncthreads();
  const uint32_t code = threadIdx.x;  // one block of 16 threads: every code
  const float absmaxes[4] = {0.0f, 1.0f, 0x1p-140f, 0x1.8p100f};
  for (int is_signed = 0; is_signed < 2; ++is_signed)
    for (float absmax : absmaxes) {
      const float want = forge::int4_decode(static_cast<uint8_t>(code), absmax, is_signed != 0);
      // (bits above the low four are not the code's: the decode ignores them)
      const float got = forge::cuda::int4_decode_fast(code | 0xF0u, is_signed != 0, absmax);
      if (__float_as_uint(want) != __float_as_uint(got)) atomicAdd(mismatches, 1ull);
    }
}

// Every float q whose bits lie in [first, first + count), as x = q against ratio |q|: NaNs,
// infinities, negatives and values above 1 included (the reference's answer for each is
// defined); the accepted form (int4_code_fast<true>) on every q in [-1, 1], its domain.
__global__ void compare_nearest(uint64_t first, uint64_t count, unsigned long long* mismatches) {
  forge::cuda::block_tables_init(threadIdx.x);  // the encodes read their bucket tables
  __syncthreads();
  unsigned long long bad = 0;
  for (uint64_t i = blockIdx.x * uint64_t(blockDim.x) + threadIdx.x; i < count;
       i += uint64_t(gridDim.x) * blockDim.x) {
    const float q = __uint_as_float(static_cast<uint32_t>(first + i));
    for (int is_signed = 0; is_signed < 2; ++is_signed) {
      const uint32_t want = forge::int4_nearest_code(q, is_signed != 0);
      if (want != forge::cuda::int4_code_fast(q, fabsf(q), is_signed != 0)) ++bad;
      if (fabsf(q) <= 1.0f &&
          want != forge::cuda::int4_code_fast<true>(q, fabsf(q), is_signed != 0))
        ++bad;
    }
  }
  if (bad) atomicAdd(mismatches, bad);
}

// The encode of a block's quad as the kernels do it (int8_quad_ratios, the IEEE ratios where it
// declines, int4_quad_codes) against int4_encode: absmax over 2^-75..2^70 and zero, subnormal,
// infinite, NaN (block_absmax_draw, as test_gpu_int8_map.cu), four values |v| <= absmax; the
// accepted form (int4_quad_codes<true>) too where the absmax is finite, its domain.
__global__ void compare_quad_codes(uint32_t count, unsigned long long* mismatches) {
  forge::cuda::block_tables_init(threadIdx.x);  // the encodes read their bucket tables
  __syncthreads();
  unsigned long long bad = 0;
  for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < count; i += gridDim.x * blockDim.x) {
    const float absmax = block_absmax_draw(6 * uint64_t(i));
    float v[kQuad], ratio[kQuad];
    block_quad(isfinite(absmax) ? absmax : 1.0f, 6 * uint64_t(i) + 2, v);
    if (!forge::cuda::int8_quad_ratios(absmax, v, ratio))
      forge::cuda::int8_quad_ratios_ieee(absmax, v, ratio);
    for (int is_signed = 0; is_signed < 2; ++is_signed) {
      const uint32_t codes = forge::cuda::int4_quad_codes(v, ratio, is_signed != 0);
      const uint32_t accepted =
          isfinite(absmax) ? forge::cuda::int4_quad_codes<true>(v, ratio, is_signed != 0) : codes;
      for (int e = 0; e < kQuad; ++e) {
        const uint32_t want = forge::int4_encode(v[e], absmax, is_signed != 0);
        if (want != ((codes >> (4 * e)) & 15u) || want != ((accepted >> (4 * e)) & 15u)) ++bad;
      }
    }
  }
  if (bad) atomicAdd(mismatches, bad);
}

// store_quad_int4 / load_quad_int4 on a two-byte quad for every n (0..4: n < 4 ends a row of n
// elements), every keep mask and vec where legal, against formats.h's int4_store_code /
// int4_code_at applied element by element (an odd row's padding nibble written 0 with its last
// element).
// One thread per (n, keep, vec) case, each on its own two bytes that start as `start`.
__global__ void compare_packed(uint8_t* bytes, unsigned long long* mismatches) {
  const int c = threadIdx.x;  // 5 × 16 × 2 cases
  const int n = c / 32, keep = (c / 2) % 16;
  const bool vec = (c % 2) != 0 && n == kQuad;
  uint8_t* mine = bytes + 2 * c;
  const uint8_t start[2] = {0xA5, 0x3C};
  mine[0] = start[0];
  mine[1] = start[1];
  const uint32_t codes = 0x9E17u;  // element e: (codes >> 4e) & 15
  forge::cuda::store_quad_int4(mine, 0, n, vec, static_cast<unsigned>(keep), codes);
  uint8_t want[2] = {start[0], start[1]};
  for (int e = 0; e < n; ++e)
    if (!((keep >> e) & 1))
      want[e / 2] =
          forge::int4_store_code(want[e / 2], e, n, static_cast<uint8_t>((codes >> (4 * e)) & 15u));
  bool bad = mine[0] != want[0] || mine[1] != want[1];
  const uint32_t loaded = forge::cuda::load_quad_int4(mine, 0, n, vec);
  for (int e = 0; e < n; ++e)
    bad = bad || ((loaded >> (4 * e)) & 15u) != forge::int4_code_at(want, e);
  if (bad) atomicAdd(mismatches, 1ull);
}

TEST(Int4CodecFast, DecodeEveryCode) {
  FORGE_REQUIRE_GPU();
  EXPECT_EQ(0ull, run_and_count([](unsigned long long* m) { compare_decode<<<1, 16>>>(m); }));
}

TEST(Int4CodecFast, NearestCodeEveryFloat) {
  FORGE_REQUIRE_GPU();
  EXPECT_EQ(0ull, run_and_count([](unsigned long long* m) {
              compare_nearest<<<4096, 256>>>(0ull, 1ull << 32, m);
            }));
}

TEST(Int4CodecFast, QuadCodesEncodeLikeTheReference) {
  FORGE_REQUIRE_GPU();
  EXPECT_EQ(0ull, run_and_count([](unsigned long long* m) {
              compare_quad_codes<<<1024, 256>>>(1u << 24, m);
            }));
}

TEST(Int4CodecFast, PackedStoresKeepTheOtherNibbles) {
  FORGE_REQUIRE_GPU();
  DeviceBuffer bytes(2 * 160);
  unsigned long long* d = nullptr;
  CUDA_OK(cudaMalloc(&d, sizeof(unsigned long long)));
  CUDA_OK(cudaMemset(d, 0, sizeof(unsigned long long)));
  compare_packed<<<1, 160>>>(static_cast<uint8_t*>(bytes.data()), d);
  CUDA_OK(cudaGetLastError());
  unsigned long long h = 1;
  CUDA_OK(cudaMemcpy(&h, d, sizeof(h), cudaMemcpyDeviceToHost));
  CUDA_OK(cudaFree(d));
  EXPECT_EQ(0ull, h);
  EXPECT_TRUE(bytes.guards_intact());
}

}  // namespace
}  // namespace fgt
