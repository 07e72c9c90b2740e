// update.cuh — the optimizer update of a parameter's elements on the GPU: load the weight and
// states in their storage format, apply forge::apply_rule (src/core/rules.h, the very code the
// CPU backend runs), store them back. Shared by every CUDA kernel that updates a parameter:
// the fused wgrad epilogue (wgrad_epilogue.cuh), elementwise_step and the state kernels
// (elementwise.cuh). This header gathers its layers, each including the ones below it:
//
//   update/spec.cuh          UpdateSpec (the compile-time configuration), ParamView, StepTotals
//   update/quads.cuh         the element quad (4 columns of a row) and its vector loads/stores
//   update/fast_math.cuh     branch-free division and square root, bf16 pair rounding,
//                            stochastic-rounding draws
//   update/block_codecs.cuh  int8 / fp8 codes of a quad (the int8 map's tables, fp8 conversions)
//   update/block_states.cuh  the lanes of a block: maxima, layouts, skipped elements, batch stores
//   update/operands.cuh      the weight and states in their storage formats: loads, stores, raw
//   update/apply.cuh         the rule over a batch of quads; update_quads, update_loaded
//   update/per_cta.cuh       once per CTA: run scalars (CUDA graphs), the by-products' reduction
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
// columns of a row): "block states" means either.
#pragma once

#include "cuda/update/spec.cuh"
#include "cuda/update/quads.cuh"
#include "cuda/update/fast_math.cuh"
#include "cuda/update/block_codecs.cuh"
#include "cuda/update/block_states.cuh"
#include "cuda/update/operands.cuh"
#include "cuda/update/apply.cuh"
#include "cuda/update/per_cta.cuh"
