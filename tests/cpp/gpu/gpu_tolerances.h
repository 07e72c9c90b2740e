// gpu_tolerances.h — every tolerance of the GPU suite, in one place, with the reason for
// its size. Anything not listed here is compared bit for bit.
//
// Bit-exact comparisons (no tolerance): the GPU runs the CPU's element code
// (src/core/rules.h, formats.h, rng.h, built with --fmad=false on both sides), so given
// the same fp32 dW the weights and states must match bit for bit. The dW bits agree when
//  - the inputs are small integers scaled by a power of two (k / 8, |k| <= 4): every
//    product is a multiple of 2^-6 below 0.25 and every partial sum over T <= 8192 tokens
//    stays below 2^11, i.e. within 17 significant bits, exact in fp32 in any order —
//    tensor-core order and split-K included;
//  - or the gradient is given (elementwise_step, state conversions): no summation at all;
//  - or the inputs are fp32 and split-K is off: the SIMT kernel adds the rounded products
//    in token order, like the CPU.
#pragma once

namespace fgt {

// dW read back through SGD(lr = 1, W = 0, fp32) against a float64 reference, N(0, 1)
// inputs rounded to bf16 (so every product is exact in fp32): what remains is the
// rounding of fp32 partial sums. Round-to-nearest gives ~2^-24 · sqrt(T / 2) ≈ 2.7e-6
// relative at T = 4097; tensor-core accumulation aligns the 16 products of one mma to the
// largest and truncates (not round-to-nearest), a bias of up to ~2^-24 per mma step that
// adds linearly: T / 16 = 256 steps · 6e-8 ≈ 1.5e-5. 1e-4 leaves ~6x margin and is still
// 100x below what one lost token (1 / sqrt(T) ≈ 1.6e-2) would cost.
constexpr double kDwRelFrobenius = 1e-4;
// Largest single-element error, relative to max |dW|: same reasoning, per element.
constexpr double kDwMaxAbsRelToMax = 1e-4;

// Rules on random (non-integer) inputs, GPU vs CPU: dW differs by the summation order
// (above, ~1e-5 relative), and the rule carries that into the outputs. Per stored format,
// on values decoded to fp32:
//  - fp32 weights / master / fp32 states: the rules are smooth in g, so the relative
//    change stays ~1e-5: 1e-4 relative. Near zero the error is absolute: the dW error is
//    ~2e-7 · rms(dW) (measured), and RMSprop's g / (sqrt(v) + eps) multiplies it by up to
//    1 / sqrt(v_min) ≈ 30 for the small initial v of these tests, while its largest output
//    is ~10: ~2e-5 of the tensor's max (measured 2.0e-5 on 0.15% of the elements, H200,
//    2026-11-29). 1e-4 of the max keeps a 5x margin.
constexpr double kFp32Rel = 1e-4;
constexpr double kFp32AbsOfMax = 1e-4;
//  - bf16 (nearest or stochastic, same random bits on both sides): a value within fp32
//    noise of a rounding boundary may round to the neighbouring bf16, one ulp = 2^-7
//    relative at most (2^-8 of the larger neighbour, 2^-7 of the smaller).
constexpr double kBf16Rel = 1.0 / 128.0;
constexpr double kBf16AbsOfMax = 1e-5;
//  - int8 block-64: the block absmax moves by ~1e-5 relative and a code sitting at a level
//    boundary may pick the neighbouring level: levels are 2^(1/8) apart, 9.05% relative.
constexpr double kInt8Rel = 0.1;
constexpr double kInt8AbsOfMax = 1e-4;
//  - int4 block-64: the same absmax motion (~1e-5 relative) moves a decoded value as much while
//    its code stays, so 1e-3 relative covers it with 100x margin. A code within that noise of a
//    midpoint may pick its neighbour, 0.0027 to 0.225 of the absmax away: no band short of the
//    map's spacing holds that, so such an element is an outlier (kMaxOutlierFraction), as rare
//    as a value that close to one of 15 midpoints (~1e-4 per element).
constexpr double kInt4Rel = 1e-3;
constexpr double kInt4AbsOfMax = 1e-4;
// Elements allowed outside the band above: a gradient element within summation noise of
// 0 can change sign between the two orders, and sign-driven updates (Lion; Adam's first
// step, lr · g / (|g| + eps)) then differ by up to 2 lr. With |dW| ~ N(0, T) the chance
// per element is ~1e-5; 1e-3 of the elements tolerates that and still catches any
// systematic error (a wrong row, column, block or format touches >= 1/64 of a tile).
constexpr double kMaxOutlierFraction = 1e-3;

// grad_sq_sum compared with a different summation order (double, per-warp partials vs
// per-thread OpenMP sums): double rounding over < 2^24 terms, ~1e-16 · sqrt(n).
constexpr double kGradSqSumRel = 1e-12;

// The memory test: device memory a step may keep or need beyond the caller's buffers is
// the split-K workspace, (number of SMs) × 128 × 128 × 4 B + one counter per SM. On top,
// cudaMalloc rounds each allocation up to 2 MiB pages: 2 allocations -> 4 MiB.
constexpr size_t kAllocationSlackBytes = size_t(4) << 20;

}  // namespace fgt
