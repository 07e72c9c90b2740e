// kernel_tables.cuh — every kernel the CUDA backend launches, in tables: the specialized
// configurations (one X-macro list, FORGE_SPEC_LIST, builds the sm80, sm90 and element-wise
// tables; FORGE_HOT_SPEC_LIST the persistent ones) and the generic kernels, with the lookups
// the launchers use. Each instantiation here is one more kernel compiled (ptxas time), so the
// lists hold only the configurations worth it. Included by cuda_backend.cu only (it also sets
// every table's kernel attributes per device), hence the unnamed namespace.
#pragma once

#include <cstddef>

#include "core/rules.h"
#include "cuda/elementwise.cuh"
#include "cuda/sm80_wgrad.cuh"
#include "cuda/sm90_wgrad.cuh"
#include "cuda/update.cuh"
#include "forge/forge.h"

namespace forge {
namespace cuda {
namespace {

// The specialized bf16-input wgrad kernels: the epilogue's rule and formats are compile-time
// constants (update/spec.cuh, UpdateSpec); any other configuration runs the generic kernel.
// NOTE: each entry is one more copy of the main loop + a lean epilogue (seconds of ptxas per
// architecture): only the configurations worth it are listed.
using WgradKernelFn = void (*)(WgradParams);
using SpecMatchFn = bool (*)(const RuleScalars&, int, int);
struct WgradKernel {
  WgradKernelFn fn;
  SpecMatchFn matches;  // nullptr: the generic kernels
  const char* name;
};

// The Hopper kernels take the operands' TMA descriptors as a second parameter.
using Sm90KernelFn = void (*)(WgradParams, Sm90TensorMaps);
struct Sm90Kernel {
  Sm90KernelFn fn;
  SpecMatchFn matches;  // nullptr: the generic kernels
  const char* name;
};

// The specialized configurations, one X(rule, weight format, state format, name) each: the
// sm80, sm90 and element-wise tables are all built from this list.
// NOTE: forge.optim rounds weights and bf16 states the same way (stochastic_rounding, on by
// default), so the pairs it produces are (bf16 SR, bf16 SR), (bf16, bf16), (master, bf16 SR),
// ... and those are the ones listed. A configuration not listed runs the generic kernel
// (a slower epilogue), so every pair forge.optim produces by default must be here. Muon's
// "weight" is the bf16 direction it writes (nearest, as torch's conversion rounds), beside
// its momentum in bf16 SR (the default) or int8.
#define FORGE_SPEC_LIST(X)                                                                       \
  X(FORGE_RULE_ADAMW, FORGE_WEIGHT_BF16, FORGE_STATE_BF16, "adamw, bf16, bf16")                   \
  X(FORGE_RULE_ADAMW, FORGE_WEIGHT_BF16, FORGE_STATE_INT8_BLOCK64, "adamw, bf16, int8")           \
  X(FORGE_RULE_ADAMW, FORGE_WEIGHT_BF16, FORGE_STATE_FP8_BLOCK64, "adamw, bf16, fp8")             \
  X(FORGE_RULE_ADAMW, FORGE_WEIGHT_BF16, FORGE_STATE_FP32, "adamw, bf16, fp32")                   \
  X(FORGE_RULE_ADAMW, FORGE_WEIGHT_BF16_STOCHASTIC, FORGE_STATE_BF16_STOCHASTIC,                  \
    "adamw, bf16 sr, bf16 sr")                                                                   \
  X(FORGE_RULE_ADAMW, FORGE_WEIGHT_BF16_STOCHASTIC, FORGE_STATE_INT8_BLOCK64,                     \
    "adamw, bf16 sr, int8")                                                                      \
  X(FORGE_RULE_ADAMW, FORGE_WEIGHT_BF16_STOCHASTIC, FORGE_STATE_FP8_BLOCK64,                      \
    "adamw, bf16 sr, fp8")                                                                       \
  X(FORGE_RULE_ADAMW, FORGE_WEIGHT_BF16_STOCHASTIC, FORGE_STATE_FP32, "adamw, bf16 sr, fp32")     \
  X(FORGE_RULE_ADAMW, FORGE_WEIGHT_BF16_STOCHASTIC, FORGE_STATE_INT4_BLOCK64,                     \
    "adamw, bf16 sr, int4")                                                                      \
  X(FORGE_RULE_ADAMW, FORGE_WEIGHT_BF16_MASTER, FORGE_STATE_BF16_STOCHASTIC,                      \
    "adamw, bf16 + master, bf16 sr")                                                             \
  X(FORGE_RULE_ADAMW, FORGE_WEIGHT_BF16_MASTER, FORGE_STATE_INT8_BLOCK64,                         \
    "adamw, bf16 + master, int8")                                                                \
  X(FORGE_RULE_ADAMW, FORGE_WEIGHT_BF16_MASTER, FORGE_STATE_FP8_BLOCK64,                          \
    "adamw, bf16 + master, fp8")                                                                 \
  X(FORGE_RULE_ADAMW, FORGE_WEIGHT_BF16_MASTER, FORGE_STATE_FP32, "adamw, bf16 + master, fp32")   \
  X(FORGE_RULE_LION, FORGE_WEIGHT_BF16_STOCHASTIC, FORGE_STATE_BF16_STOCHASTIC,                   \
    "lion, bf16 sr, bf16 sr")                                                                    \
  X(FORGE_RULE_SGD, FORGE_WEIGHT_BF16, kAny, "sgd, bf16")                                         \
  X(FORGE_RULE_SGD, FORGE_WEIGHT_BF16_STOCHASTIC, kAny, "sgd, bf16 sr")                           \
  X(FORGE_RULE_MUON, FORGE_WEIGHT_BF16, FORGE_STATE_BF16_STOCHASTIC, "muon, bf16, bf16 sr")       \
  X(FORGE_RULE_MUON, FORGE_WEIGHT_BF16, FORGE_STATE_INT8_BLOCK64, "muon, bf16, int8")

#define FORGE_SM80_SPEC_KERNEL(RULE, WEIGHT, STATE, NAME)                      \
  WgradKernel{wgrad_mma_kernel<false, UpdateSpec<RULE, WEIGHT, STATE>>,        \
              spec_matches<UpdateSpec<RULE, WEIGHT, STATE>>, "wgrad_mma<bf16, " NAME ">"},
#define FORGE_SM90_SPEC_KERNEL(RULE, WEIGHT, STATE, NAME)                      \
  Sm90Kernel{wgrad_wgmma_kernel<false, UpdateSpec<RULE, WEIGHT, STATE>>,       \
             spec_matches<UpdateSpec<RULE, WEIGHT, STATE>>, "wgrad_wgmma<bf16, " NAME ">"},

const WgradKernel kSpecKernels[] = {FORGE_SPEC_LIST(FORGE_SM80_SPEC_KERNEL)};
// NOTE: each entry is one more sm_90a copy of the main loop + epilogue (ptxas time); the
// other passes compile a stub.
const Sm90Kernel kSm90SpecKernels[] = {FORGE_SPEC_LIST(FORGE_SM90_SPEC_KERNEL)};
#undef FORGE_SM80_SPEC_KERNEL
#undef FORGE_SM90_SPEC_KERNEL

// The same kernels reading the step's scalars from device memory (forge_hparams.run_scalars,
// CUDA graphs): UpdateSpec's kRunScalars.
#define FORGE_SM80_RUN_KERNEL(RULE, WEIGHT, STATE, NAME)                           \
  WgradKernel{wgrad_mma_kernel<false, UpdateSpec<RULE, WEIGHT, STATE, true>>,      \
              spec_matches<UpdateSpec<RULE, WEIGHT, STATE, true>>,                 \
              "wgrad_mma<bf16, " NAME ", run scalars>"},
#define FORGE_SM90_RUN_KERNEL(RULE, WEIGHT, STATE, NAME)                           \
  Sm90Kernel{wgrad_wgmma_kernel<false, UpdateSpec<RULE, WEIGHT, STATE, true>>,     \
             spec_matches<UpdateSpec<RULE, WEIGHT, STATE, true>>,                  \
             "wgrad_wgmma<bf16, " NAME ", run scalars>"},
const WgradKernel kSpecRunKernels[] = {FORGE_SPEC_LIST(FORGE_SM80_RUN_KERNEL)};
const Sm90Kernel kSm90SpecRunKernels[] = {FORGE_SPEC_LIST(FORGE_SM90_RUN_KERNEL)};
#undef FORGE_SM80_RUN_KERNEL
#undef FORGE_SM90_RUN_KERNEL

// The configurations forge.optim runs most, the ones the persistent kernels below are built
// for (each entry is one more sm_90a compile of a kernel).
#define FORGE_HOT_SPEC_LIST(X)                                                                   \
  X(FORGE_RULE_ADAMW, FORGE_WEIGHT_BF16, FORGE_STATE_BF16, "adamw, bf16, bf16")                   \
  X(FORGE_RULE_ADAMW, FORGE_WEIGHT_BF16_STOCHASTIC, FORGE_STATE_BF16_STOCHASTIC,                  \
    "adamw, bf16 sr, bf16 sr")                                                                   \
  X(FORGE_RULE_ADAMW, FORGE_WEIGHT_BF16, FORGE_STATE_INT8_BLOCK64, "adamw, bf16, int8")           \
  X(FORGE_RULE_ADAMW, FORGE_WEIGHT_BF16_STOCHASTIC, FORGE_STATE_INT8_BLOCK64,                     \
    "adamw, bf16 sr, int8")                                                                      \
  X(FORGE_RULE_ADAMW, FORGE_WEIGHT_BF16, FORGE_STATE_FP8_BLOCK64, "adamw, bf16, fp8")             \
  X(FORGE_RULE_ADAMW, FORGE_WEIGHT_BF16_STOCHASTIC, FORGE_STATE_FP8_BLOCK64,                      \
    "adamw, bf16 sr, fp8")                                                                       \
  X(FORGE_RULE_ADAMW, FORGE_WEIGHT_BF16_STOCHASTIC, FORGE_STATE_INT4_BLOCK64,                     \
    "adamw, bf16 sr, int4")

// The persistent, warp-specialized Hopper kernels (sm90_wgrad.cuh; chosen by persistent_pays,
// or forced with FORGE_DEBUG_PERSISTENT): the generic ones (below) and the hot configurations,
// those also reading the step's scalars from device memory (a CUDA graph's step).
#define FORGE_PERSISTENT_SPEC_KERNEL(RULE, WEIGHT, STATE, NAME)                             \
  Sm90Kernel{wgrad_wgmma_persistent_kernel<false, UpdateSpec<RULE, WEIGHT, STATE>>,         \
             spec_matches<UpdateSpec<RULE, WEIGHT, STATE>>, "wgrad_wgmma_persistent<bf16, " NAME ">"},
#define FORGE_PERSISTENT_RUN_KERNEL(RULE, WEIGHT, STATE, NAME)                                 \
  Sm90Kernel{wgrad_wgmma_persistent_kernel<false, UpdateSpec<RULE, WEIGHT, STATE, true>>,      \
             spec_matches<UpdateSpec<RULE, WEIGHT, STATE, true>>,                              \
             "wgrad_wgmma_persistent<bf16, " NAME ", run scalars>"},
const Sm90Kernel kPersistentSpecKernels[] = {FORGE_HOT_SPEC_LIST(FORGE_PERSISTENT_SPEC_KERNEL)};
const Sm90Kernel kPersistentSpecRunKernels[] = {FORGE_HOT_SPEC_LIST(FORGE_PERSISTENT_RUN_KERNEL)};
#undef FORGE_PERSISTENT_SPEC_KERNEL
#undef FORGE_PERSISTENT_RUN_KERNEL
#undef FORGE_HOT_SPEC_LIST

const Sm90Kernel kPersistentGenericKernels[] = {
    {wgrad_wgmma_persistent_kernel<false>, nullptr, "wgrad_wgmma_persistent<bf16>"},
    {wgrad_wgmma_persistent_kernel<true>, nullptr, "wgrad_wgmma_persistent<fp16>"},
};

// [run scalars]: the generic kernels, then the same reading the step's scalars from device
// memory. Entries: bf16 inputs, fp16 inputs, fp32 (sm80 only).
const WgradKernel kGenericKernels[2][3] = {
    {{wgrad_mma_kernel<false>, nullptr, "wgrad_mma<bf16>"},
     {wgrad_mma_kernel<true>, nullptr, "wgrad_mma<fp16>"},
     {wgrad_simt_kernel<>, nullptr, "wgrad_simt"}},
    {{wgrad_mma_kernel<false, GenericRunSpec>, nullptr, "wgrad_mma<bf16, run scalars>"},
     {wgrad_mma_kernel<true, GenericRunSpec>, nullptr, "wgrad_mma<fp16, run scalars>"},
     {wgrad_simt_kernel<GenericRunSpec>, nullptr, "wgrad_simt<run scalars>"}},
};

const Sm90Kernel kSm90GenericKernels[2][2] = {
    {{wgrad_wgmma_kernel<false>, nullptr, "wgrad_wgmma<bf16>"},
     {wgrad_wgmma_kernel<true>, nullptr, "wgrad_wgmma<fp16>"}},
    {{wgrad_wgmma_kernel<false, GenericRunSpec>, nullptr, "wgrad_wgmma<bf16, run scalars>"},
     {wgrad_wgmma_kernel<true, GenericRunSpec>, nullptr, "wgrad_wgmma<fp16, run scalars>"}},
};

// ---- element-wise kernels ------------------------------------------------------------------

using ElementwiseKernelFn = void (*)(const void*, int, bool, bool, ParamView, RuleScalars,
                                     const RuleScalars*, uint64_t, double*, unsigned long long*);
struct ElementwiseKernel {
  ElementwiseKernelFn fn;
  SpecMatchFn matches;
  int pairs_per_warp;  // 2 · kQ: sizes the grid
  const char* name;
};

// NOTE: kQ = 2 for the specialized kernels (two quads' loads in flight per lane); the generic
// one keeps kQ = 1 (its run-time state arrays would double in registers).
#define FORGE_ELEMENTWISE_SPEC_KERNEL(RULE, WEIGHT, STATE, NAME)                        \
  ElementwiseKernel{elementwise_kernel<UpdateSpec<RULE, WEIGHT, STATE>, 2>,             \
                    spec_matches<UpdateSpec<RULE, WEIGHT, STATE>>, 4, "elementwise<" NAME ">"},
const ElementwiseKernel kElementwiseSpecKernels[] = {
    FORGE_SPEC_LIST(FORGE_ELEMENTWISE_SPEC_KERNEL)};
#undef FORGE_ELEMENTWISE_SPEC_KERNEL
#define FORGE_ELEMENTWISE_RUN_KERNEL(RULE, WEIGHT, STATE, NAME)                             \
  ElementwiseKernel{elementwise_kernel<UpdateSpec<RULE, WEIGHT, STATE, true>, 2>,           \
                    spec_matches<UpdateSpec<RULE, WEIGHT, STATE, true>>, 4,                 \
                    "elementwise<" NAME ", run scalars>"},
const ElementwiseKernel kElementwiseSpecRunKernels[] = {
    FORGE_SPEC_LIST(FORGE_ELEMENTWISE_RUN_KERNEL)};
#undef FORGE_ELEMENTWISE_RUN_KERNEL
#undef FORGE_SPEC_LIST
// [run scalars], as kGenericKernels.
const ElementwiseKernel kElementwiseGenericKernels[2] = {
    {elementwise_kernel<GenericSpec, 1>, nullptr, 2, "elementwise"},
    {elementwise_kernel<GenericRunSpec, 1>, nullptr, 2, "elementwise<run scalars>"}};

// ---- lookups ------------------------------------------------------------------------------

// The entry of `table` whose Spec matches (k, weight format, state format), or nullptr.
template <class Kernel, size_t kN>
const Kernel* find_spec_kernel(const Kernel (&table)[kN], const RuleScalars& k,
                               int weight_format, int state_format) {
  for (const Kernel& kernel : table)
    if (kernel.matches(k, weight_format, state_format)) return &kernel;
  return nullptr;
}

// The bf16-input kernel for (k, weight format, state format): a specialized one if listed.
// `run`: one that reads the step's scalars from device memory. `name` receives its name (for
// the FORGE_DEBUG_LOG log).
WgradKernelFn pick_bf16_kernel(const RuleScalars& k, int weight_format, int state_format,
                               bool run, const char** name) {
  const WgradKernel* kernel = run ? find_spec_kernel(kSpecRunKernels, k, weight_format, state_format)
                                  : find_spec_kernel(kSpecKernels, k, weight_format, state_format);
  if (kernel == nullptr) kernel = &kGenericKernels[run][0];
  *name = kernel->name;
  return kernel->fn;
}

Sm90KernelFn pick_bf16_sm90_kernel(const RuleScalars& k, int weight_format, int state_format,
                                   bool run, const char** name) {
  const Sm90Kernel* kernel =
      run ? find_spec_kernel(kSm90SpecRunKernels, k, weight_format, state_format)
          : find_spec_kernel(kSm90SpecKernels, k, weight_format, state_format);
  if (kernel == nullptr) kernel = &kSm90GenericKernels[run][0];
  *name = kernel->name;
  return kernel->fn;
}

// The specialized persistent kernel for (k, weight format, state format) with bf16 inputs, or
// nullptr (then only the generic one, which a step runs only when forced). `run`: as above.
const Sm90Kernel* find_persistent_spec_kernel(const RuleScalars& k, int weight_format,
                                              int state_format, bool run) {
  return run ? find_spec_kernel(kPersistentSpecRunKernels, k, weight_format, state_format)
             : find_spec_kernel(kPersistentSpecKernels, k, weight_format, state_format);
}

}  // namespace
}  // namespace cuda
}  // namespace forge
