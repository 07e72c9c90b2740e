// ptx.cuh — every inline-PTX wrapper of the CUDA kernels, one line of comment each: the sm80
// main loop (cp.async, ldmatrix, mma.sync), the Hopper kernels (mbarrier, TMA, wgmma,
// setmaxnreg; sm_90a device pass only) and the update (exact-arithmetic building blocks, the
// fp8 conversions of sm_89 and later).
// The kernel headers hold no asm of their own.
#pragma once

#include <cuda.h>  // CUtensorMap (types only: the driver is reached through cudart)
#include <cuda_runtime.h>
#include <stdint.h>

// The sm_90a device pass: wgmma, setmaxnreg and the TMA/mbarrier forms used here exist only
// there; every other pass compiles the Hopper kernels as stubs (sm90_wgrad.cuh).
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 900) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define FORGE_SM90A_DEVICE_PASS 1
#endif

namespace forge {
namespace cuda {

// ---- any architecture ------------------------------------------------------------------------

// The shared-state-space address of a generic pointer into shared memory.
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 B global → shared; only the first src_bytes (0..16) are read, the rest is zero-filled.
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(src_bytes)
               : "memory");
}
// Closes the thread's current group of cp.async copies.
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
// Waits until at most kPending of the thread's cp.async groups are still in flight.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// Four transposed 8 × 8 16-bit matrices from shared memory into the warp's fragments.
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// d += a · b, one m16n8k16 tensor-core tile, fp16 or bf16 inputs, fp32 accumulators.
template <bool kFp16>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4],
                                          const uint32_t (&b)[2]) {
  if constexpr (kFp16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
}

// Brings the 128 B line holding p into L2.
__device__ __forceinline__ void prefetch_l2(const void* p) {
  asm volatile("prefetch.L2 [%0];\n" ::"l"(p));
}

// The hardware reciprocal estimate 1/b (approximate, denormals flushed).
__device__ __forceinline__ float rcp_approx_ftz(float b) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(b));
  return y;
}

// The hardware reciprocal square-root estimate 1/sqrt(x) (approximate, denormals flushed).
__device__ __forceinline__ float rsqrt_approx_ftz(float x) {
  float y;
  asm("rsqrt.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// min(a, b) that returns NaN when either is NaN (fminf would return the other operand).
__device__ __forceinline__ float min_nan(float a, float b) {
  float r;
  asm("min.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}
// max(a, b) that returns NaN when either is NaN.
__device__ __forceinline__ float max_nan(float a, float b) {
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

// Byte e (0, 1) 0xFF where the sign bit of x_e is set, else 0x00 (prmt's sign-replicating
// selectors, which __byte_perm does not take); bytes 2, 3 are byte 0 of x0.
__device__ __forceinline__ uint32_t sign_bytes2(float x0, float x1) {
  uint32_t r;
  asm("prmt.b32 %0, %1, %2, 0x00FB;"
      : "=r"(r)
      : "r"(__float_as_uint(x0)), "r"(__float_as_uint(x1)));
  return r;
}

// hi and lo rounded to bf16 (nearest even) and packed: lo in bits 0-15, hi in 16-31.
__device__ __forceinline__ uint32_t cvt_rn_bf16x2(float hi, float lo) {
  uint32_t packed;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(packed) : "f"(hi), "f"(lo));
  return packed;
}

// ---- sm_89 and later: the fp8 conversions ------------------------------------------------------
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
#define FORGE_FP8_CVT 1

// hi and lo as fp8 bytes (e4m3 when kE4m3, else e5m2), rounded to nearest even and saturated
// at the largest finite value, packed: lo in bits 0-7, hi in 8-15.
template <bool kE4m3>
__device__ __forceinline__ uint32_t cvt_rn_satfinite_fp8x2(float hi, float lo) {
  uint16_t packed;
  if constexpr (kE4m3) {
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(packed) : "f"(hi), "f"(lo));
  } else {
    asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(packed) : "f"(hi), "f"(lo));
  }
  return packed;
}

// Two fp8 bytes (bits 0-7 and 8-15 of `two`) as two f16 values (exact: every e4m3 and e5m2
// value is an f16), packed as their bytes were.
template <bool kE4m3>
__device__ __forceinline__ uint32_t cvt_f16x2_fp8x2(uint32_t two) {
  uint32_t packed;
  const uint16_t in = static_cast<uint16_t>(two);
  if constexpr (kE4m3) {
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(packed) : "h"(in));
  } else {
    asm("cvt.rn.f16x2.e5m2x2 %0, %1;" : "=r"(packed) : "h"(in));
  }
  return packed;
}

// An f16 (its bits) as fp32 (exact).
__device__ __forceinline__ float cvt_f32_f16(uint32_t h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(static_cast<uint16_t>(h)));
  return f;
}
#endif

// Named barrier kBarrier for kThreads threads (whole warps).
template <int kBarrier, int kThreads>
__device__ __forceinline__ void named_barrier_sync() {
  asm volatile("bar.sync %0, %1;\n" ::"n"(kBarrier), "n"(kThreads) : "memory");
}

#if defined(FORGE_SM90A_DEVICE_PASS)

// ---- sm_90a ----------------------------------------------------------------------------------

// Initializes the shared-memory mbarrier at `bar` for `count` arrivals per phase.
__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}

// Arrives on `bar` and adds `bytes` to the transaction bytes its phase waits for.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar),
               "r"(bytes)
               : "memory");
}

// Arrives on `bar` (release: the thread's earlier writes are visible to its waiters).
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}

// Whether phase `parity` of `bar` has completed (waits a bounded, hardware-chosen time).
__device__ __forceinline__ bool mbar_try_wait(uint32_t bar, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
      "selp.u32 %0, 1, 0, p;\n"
      "}\n"
      : "=r"(done)
      : "r"(bar), "r"(parity)
      : "memory");
  return done != 0;
}

// The global timer, in ns (comparable across SMs).
__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t));
  return t;
}

// One TMA box (64 columns × 64 tokens) at (col, token) of `map` into shared memory at `dst`;
// completes `bytes` on `bar`. Out-of-range elements are written as zeros.
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap* map, uint32_t bar,
                                            int32_t col, int32_t token) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4}], [%2];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(col), "r"(token)
      : "memory");
}

// The index of the SM this thread runs on.
__device__ __forceinline__ uint32_t sm_id() {
  uint32_t id;
  asm volatile("mov.u32 %0, %%smid;\n" : "=r"(id));
  return id;
}

// Brings a TMA descriptor (kernel parameter memory) into the descriptor cache.
__device__ __forceinline__ void tma_prefetch_descriptor(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

// Orders the warpgroup's register accesses before the wgmma that follow.
__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
// Closes the warpgroup's current batch of wgmma.
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
// Waits until at most kPending of the warpgroup's wgmma batches are still in flight.
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}

// Keeps the compiler from moving accumulator reads or writes across the asynchronous wgmma
// (it emits no instruction).
__device__ __forceinline__ void fence_accumulators(float (&d)[64]) {
#pragma unroll
  for (int i = 0; i < 64; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

#define FORGE_ACC8(i)                                                                   \
  "+f"(d[i + 0]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]),       \
      "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])
#define FORGE_WGMMA_M64N128K16(TYPE)                                                    \
  asm volatile(                                                                         \
      "{\n"                                                                             \
      ".reg .pred p;\n"                                                                 \
      "setp.ne.b32 p, %66, 0;\n"                                                        \
      "wgmma.mma_async.sync.aligned.m64n128k16.f32." TYPE "." TYPE "\n"                 \
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "         \
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}," \
      " %64, %65, p, 1, 1, 1, 1;\n"                                                     \
      "}\n"                                                                             \
      : FORGE_ACC8(0), FORGE_ACC8(8), FORGE_ACC8(16), FORGE_ACC8(24), FORGE_ACC8(32),   \
        FORGE_ACC8(40), FORGE_ACC8(48), FORGE_ACC8(56)                                  \
      : "l"(desc_a), "l"(desc_b), "n"(1))

// d[64] += A (64 × 16, MN-major in shared memory) · B (16 × 128, MN-major): both operands
// transposed (the two trailing 1s: tnspA, tnspB), scale-d = 1 (accumulate).
template <bool kFp16>
__device__ __forceinline__ void wgmma_m64n128k16(float (&d)[64], uint64_t desc_a,
                                                 uint64_t desc_b) {
  if constexpr (kFp16) {
    FORGE_WGMMA_M64N128K16("f16");
  } else {
    FORGE_WGMMA_M64N128K16("bf16");
  }
}
#undef FORGE_WGMMA_M64N128K16
#undef FORGE_ACC8

// Makes the mbarrier initializations so far visible to the rest of the cluster.
__device__ __forceinline__ void fence_mbarrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// Orders the thread's shared-memory accesses so far before later async-proxy ones (TMA).
__device__ __forceinline__ void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// Lowers this warpgroup's register budget to kRegisters per thread (warp-specialized kernels).
template <int kRegisters>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
}
// Raises this warpgroup's register budget to kRegisters per thread.
template <int kRegisters>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
}

#endif  // FORGE_SM90A_DEVICE_PASS

}  // namespace cuda
}  // namespace forge
