// cuda_backend.cu — the CUDA backend: forge::cuda::{wgrad_step, elementwise_step, state_fill,
// state_to_fp32, state_from_fp32} (declared by FORGE_DECLARE_BACKEND in src/backend.h).
//
// What lives where:
//  - sm80_wgrad.cuh: the fused dW = dYᵀX + optimizer kernels (tensor cores for bf16/fp16,
//    fp32 SIMT otherwise) and their split-K reduction.
//  - sm90_wgrad.cuh: the Hopper main loop (TMA + wgmma, sm_90a) in front of the same epilogue;
//    used on compute capability 9.0 for aligned bf16/fp16 inputs (FORGE_CUDA_WGMMA=0: never).
//  - update.cuh: the element update every kernel shares (formats + forge::apply_rule).
//  - this file: launch decisions (kernel, split-K), the split-K workspace cache, the device
//    guard, error reporting, and the small element-wise kernels.
//
// The CPU backend (src/cpu/cpu_backend.cpp) is the specification: given the same fp32
// gradient every kernel here writes the same bits (same core functions, --fmad=false).
// Every CUDA call is checked and reported as FORGE_ERR_DEVICE / FORGE_ERR_OUT_OF_MEMORY
// through forge::fail (never an abort); every launch runs on forge_device.stream.
#include <cuda.h>  // CUtensorMap and its enums; the driver itself is reached through cudart
#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <utility>

#include "backend.h"
#include "core/status.h"
#include "cuda/sm80_wgrad.cuh"
#include "cuda/sm90_wgrad.cuh"
#include "cuda/update.cuh"
#include "cuda/persistent_rule.h"

namespace forge {
namespace cuda {
namespace {

// ---- errors and devices ------------------------------------------------------------------------

forge_status device_error(cudaError_t e, const char* what) {
  (void)cudaGetLastError();  // a non-sticky error must not leak into the next call's checks
  const forge_status code =
      e == cudaErrorMemoryAllocation ? FORGE_ERR_OUT_OF_MEMORY : FORGE_ERR_DEVICE;
  return fail(code, "CUDA: %s failed: %s (%s)", what, cudaGetErrorString(e),
              cudaGetErrorName(e));
}

#define FORGE_CUDA_TRY(call)                                    \
  do {                                                          \
    const cudaError_t forge_e_ = (call);                        \
    if (forge_e_ != cudaSuccess) return device_error(forge_e_, #call); \
  } while (0)

// Makes device.index current for the scope of a call and restores the caller's device.
class DeviceGuard {
 public:
  DeviceGuard() = default;
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;
  ~DeviceGuard() {
    if (changed_) (void)cudaSetDevice(previous_);
  }
  forge_status enter(int index) {
    FORGE_CUDA_TRY(cudaGetDevice(&previous_));
    if (previous_ != index) {
      const cudaError_t e = cudaSetDevice(index);
      if (e != cudaSuccess) {
        (void)cudaGetLastError();
        return fail(FORGE_ERR_DEVICE, "CUDA: device.index %d: cudaSetDevice failed: %s", index,
                    cudaGetErrorString(e));
      }
      changed_ = true;
    }
    return FORGE_OK;
  }

 private:
  int previous_ = 0;
  bool changed_ = false;
};

// ---- the kernels -----------------------------------------------------------------------------
//
// The specialized bf16-input wgrad kernels: the epilogue's rule and formats are compile-time
// constants (update.cuh, UpdateSpec); any other configuration runs the generic kernel.
// NOTE: each entry is one more copy of the main loop + a lean epilogue (~3-4 s of ptxas per
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
// sm80 and the sm90 tables below are both built from this list.
// NOTE: forge.optim rounds weights and bf16 states the same way (stochastic_rounding, on by
// default), so the pairs it produces are (bf16 SR, bf16 SR), (bf16, bf16), (master, bf16 SR),
// ... and those are the ones listed. A configuration not listed runs the generic kernel
// (measured ~3x slower epilogue): (bf16 SR W, bf16 SR states) was missing before, and
// forge.optim.AdamW's default bf16 run took the generic path.
#define FORGE_SPEC_LIST(X)                                                                       \
  X(FORGE_RULE_ADAMW, FORGE_WEIGHT_BF16, FORGE_STATE_BF16, "adamw, bf16, bf16")                   \
  X(FORGE_RULE_ADAMW, FORGE_WEIGHT_BF16, FORGE_STATE_INT8_BLOCK64, "adamw, bf16, int8")           \
  X(FORGE_RULE_ADAMW, FORGE_WEIGHT_BF16, FORGE_STATE_FP32, "adamw, bf16, fp32")                   \
  X(FORGE_RULE_ADAMW, FORGE_WEIGHT_BF16_STOCHASTIC, FORGE_STATE_BF16_STOCHASTIC,                  \
    "adamw, bf16 sr, bf16 sr")                                                                   \
  X(FORGE_RULE_ADAMW, FORGE_WEIGHT_BF16_STOCHASTIC, FORGE_STATE_INT8_BLOCK64,                     \
    "adamw, bf16 sr, int8")                                                                      \
  X(FORGE_RULE_ADAMW, FORGE_WEIGHT_BF16_STOCHASTIC, FORGE_STATE_FP32, "adamw, bf16 sr, fp32")     \
  X(FORGE_RULE_ADAMW, FORGE_WEIGHT_BF16_MASTER, FORGE_STATE_BF16_STOCHASTIC,                      \
    "adamw, bf16 + master, bf16 sr")                                                             \
  X(FORGE_RULE_ADAMW, FORGE_WEIGHT_BF16_MASTER, FORGE_STATE_INT8_BLOCK64,                         \
    "adamw, bf16 + master, int8")                                                                \
  X(FORGE_RULE_ADAMW, FORGE_WEIGHT_BF16_MASTER, FORGE_STATE_FP32, "adamw, bf16 + master, fp32")   \
  X(FORGE_RULE_LION, FORGE_WEIGHT_BF16_STOCHASTIC, FORGE_STATE_BF16_STOCHASTIC,                   \
    "lion, bf16 sr, bf16 sr")                                                                    \
  X(FORGE_RULE_SGD, FORGE_WEIGHT_BF16, kAny, "sgd, bf16")                                         \
  X(FORGE_RULE_SGD, FORGE_WEIGHT_BF16_STOCHASTIC, kAny, "sgd, bf16 sr")

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
// (FORGE_SPEC_LIST also builds the element-wise kernels' table, further down.)

// The configurations forge.optim runs most, the ones the experimental kernels below are built
// for (each entry is one more sm_90a compile of a kernel).
#define FORGE_HOT_SPEC_LIST(X)                                                                   \
  X(FORGE_RULE_ADAMW, FORGE_WEIGHT_BF16, FORGE_STATE_BF16, "adamw, bf16, bf16")                   \
  X(FORGE_RULE_ADAMW, FORGE_WEIGHT_BF16_STOCHASTIC, FORGE_STATE_BF16_STOCHASTIC,                  \
    "adamw, bf16 sr, bf16 sr")                                                                   \
  X(FORGE_RULE_ADAMW, FORGE_WEIGHT_BF16, FORGE_STATE_INT8_BLOCK64, "adamw, bf16, int8")           \
  X(FORGE_RULE_ADAMW, FORGE_WEIGHT_BF16_STOCHASTIC, FORGE_STATE_INT8_BLOCK64,                     \
    "adamw, bf16 sr, int8")

// The persistent, warp-specialized Hopper kernels (sm90_wgrad.cuh; chosen by persistent_pays,
// or forced with FORGE_CUDA_PERSISTENT): the generic ones (below) and the hot configurations,
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
// the FORGE_CUDA_VERBOSE log).
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

// FORGE_CUDA_VERBOSE: says once per (kernel, rule, weight format, state format, split-K) which
// kernel a step runs, so a configuration that falls back to a generic kernel is visible.
void log_kernel_choice(const char* kernel, const RuleScalars& k, int weight_format,
                       int state_format, int64_t splits) {
  static const bool verbose = std::getenv("FORGE_CUDA_VERBOSE") != nullptr;
  if (!verbose) return;
  static std::mutex mutex;
  static std::set<std::string> seen;
  char line[256];
  std::snprintf(line, sizeof(line), "%s for rule %d, weight format %d, state format %d%s", kernel,
                k.rule, weight_format, state_format, splits > 1 ? ", split-K" : "");
  std::lock_guard<std::mutex> lock(mutex);
  if (seen.insert(line).second) std::fprintf(stderr, "forge cuda: step runs %s\n", line);
}

// Per-device facts and one-time kernel attributes, cached (thread-safe).
struct DeviceInfo {
  int num_sms = 0;
  bool wgmma = false;  // the sm_90a kernels can run here (device_info says when)
  bool kernels_configured = false;
};

std::mutex g_device_mutex;
std::map<int, DeviceInfo> g_devices;

forge_status device_info(int index, DeviceInfo* out) {
  std::lock_guard<std::mutex> lock(g_device_mutex);
  DeviceInfo& info = g_devices[index];
  if (!info.kernels_configured) {
    FORGE_CUDA_TRY(cudaDeviceGetAttribute(&info.num_sms, cudaDevAttrMultiProcessorCount, index));
    const bool verbose = std::getenv("FORGE_CUDA_VERBOSE") != nullptr;
    auto configure = [&](const void* fn, const char* name, size_t smem_bytes,
                         int threads = kThreads) -> forge_status {
      const int bytes = static_cast<int>(smem_bytes);
      FORGE_CUDA_TRY(cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
      // NOTE: ask for the largest shared-memory carveout, so two CTAs (68 KiB sm80, 97 KiB
      // sm90) fit per SM (the driver may otherwise pick a smaller carveout and run one).
      FORGE_CUDA_TRY(cudaFuncSetAttribute(fn, cudaFuncAttributePreferredSharedMemoryCarveout,
                                          cudaSharedmemCarveoutMaxShared));
      if (verbose) {
        int ctas = 0;
        cudaFuncAttributes attr{};
        FORGE_CUDA_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&ctas, fn, threads, smem_bytes));
        FORGE_CUDA_TRY(cudaFuncGetAttributes(&attr, fn));
        std::fprintf(stderr,
                     "forge cuda: device %d, %d SMs: %s: %d CTAs/SM of %d threads, %d registers, "
                     "%zu B local, %zu B static + %zu B dynamic shared\n",
                     index, info.num_sms, name, ctas, threads, attr.numRegs,
                     attr.localSizeBytes, attr.sharedSizeBytes, smem_bytes);
      }
      return FORGE_OK;
    };
    // Every kernel of a table, with the same dynamic shared memory and block size.
    auto configure_all = [&](const auto& table, size_t smem_bytes,
                             int threads = kThreads) -> forge_status {
      for (const auto& kernel : table)
        if (forge_status s = configure(reinterpret_cast<const void*>(kernel.fn), kernel.name,
                                       smem_bytes, threads))
          return s;
      return FORGE_OK;
    };
    for (const auto& generic : kGenericKernels)
      if (forge_status s = configure_all(generic, kWgradSmemBytes)) return s;
    if (forge_status s = configure_all(kSpecKernels, kWgradSmemBytes)) return s;
    if (forge_status s = configure_all(kSpecRunKernels, kWgradSmemBytes)) return s;
    // The Hopper kernels: only on compute capability 9.0 (sm_90a code runs nowhere else), and
    // only when the code loaded for this device is the sm_90a build of them. The stub that
    // every other pass compiles has no static shared memory; the real kernel has (its
    // mbarriers), so sharedSizeBytes tells the two apart, also in a "90;90a" build.
    int major = 0, minor = 0;
    FORGE_CUDA_TRY(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, index));
    FORGE_CUDA_TRY(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, index));
    if (major == 9 && minor == 0) {
      cudaFuncAttributes attr{};
      const cudaError_t e =
          cudaFuncGetAttributes(&attr, reinterpret_cast<const void*>(kSm90GenericKernels[0][0].fn));
      if (e != cudaSuccess) {
        (void)cudaGetLastError();  // no loadable code for it: the sm80 kernels it is
      } else {
        info.wgmma = attr.binaryVersion == 90 && attr.sharedSizeBytes > 0;
      }
      if (verbose)
        std::fprintf(stderr, "forge cuda: device %d: sm_90a wgmma kernels %s\n", index,
                     info.wgmma ? "available" : "not in this build");
    }
    if (info.wgmma) {
      // (the persistent kernels too, whether or not FORGE_CUDA_PERSISTENT is set: once per
      // device, and the tests switch it per process)
      for (const auto& generic : kSm90GenericKernels)
        if (forge_status s = configure_all(generic, kSm90SmemBytes)) return s;
      if (forge_status s = configure_all(kSm90SpecKernels, kSm90SmemBytes)) return s;
      if (forge_status s = configure_all(kSm90SpecRunKernels, kSm90SmemBytes)) return s;
      if (forge_status s = configure_all(kPersistentGenericKernels, kPersistentSmemBytes,
                                         kPersistentThreads))
        return s;
      if (forge_status s = configure_all(kPersistentSpecKernels, kPersistentSmemBytes,
                                         kPersistentThreads))
        return s;
      if (forge_status s = configure_all(kPersistentSpecRunKernels, kPersistentSmemBytes,
                                         kPersistentThreads))
        return s;
    }
    info.kernels_configured = true;
  }
  *out = info;
  return FORGE_OK;
}

// ---- the split-K workspace ------------------------------------------------------------------------
//
// One per (device, stream), created on first use and kept for the life of the process:
// kSlots = number of SMs fp32 tiles (the partials) + one arrival counter per tile. The
// host never lets tiles × splits exceed the slots, so a step needs at most SMs × 64 KiB,
// whatever the layer's size. Kernels on one stream run in order, so one workspace per
// stream is never used by two launches at once; the maps are guarded by a mutex.
// A step captured into a CUDA graph gets the workspace of its capture instead (one per
// capture sequence, also kept for the life of the process): a graph may be replayed on any
// stream, beside eager steps on the stream it was captured from.
struct Workspace {
  float* partials = nullptr;      // [slots][kBM][kBN]
  unsigned int* counters = nullptr;  // [slots], zero between launches
  int slots = 0;
};

std::mutex g_workspace_mutex;
std::map<std::pair<int, unsigned long long>, Workspace> g_workspaces;          // by stream id
std::map<std::pair<int, unsigned long long>, Workspace> g_capture_workspaces;  // by capture id

forge_status stream_key(cudaStream_t stream, unsigned long long* key) {
  // NOTE: keyed by the stream's unique id, not its handle: a destroyed stream's handle can
  // be reused by a new stream while the old one's work is still running.
  // Should the driver not give an id (a special handle), the handle itself is the key.
  unsigned long long id = 0;
  const cudaError_t e = cudaStreamGetId(stream, &id);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    id = (1ull << 63) | static_cast<unsigned long long>(reinterpret_cast<uintptr_t>(stream));
  }
  *key = id;
  return FORGE_OK;
}

// Allocates ws (slots tiles, counters zeroed in stream order). While `stream` is being
// captured, in relaxed capture mode: the allocation is not part of the graph.
forge_status allocate_workspace(cudaStream_t stream, int slots, bool capturing, Workspace* ws) {
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  if (capturing) FORGE_CUDA_TRY(cudaThreadExchangeStreamCaptureMode(&mode));
  float* partials = nullptr;
  unsigned int* counters = nullptr;
  cudaError_t e = cudaMalloc(&partials, sizeof(float) * kTileElems * static_cast<size_t>(slots));
  if (e == cudaSuccess) e = cudaMalloc(&counters, sizeof(unsigned int) * static_cast<size_t>(slots));
  if (capturing) (void)cudaThreadExchangeStreamCaptureMode(&mode);  // the caller's mode back
  if (e != cudaSuccess) {
    if (partials) (void)cudaFree(partials);
    return device_error(e, "cudaMalloc(split-K workspace)");
  }
  // (Under capture the memset is a node of the graph: it zeroes counters that are zero.)
  e = cudaMemsetAsync(counters, 0, sizeof(unsigned int) * static_cast<size_t>(slots), stream);
  if (e != cudaSuccess) {
    (void)cudaFree(partials);
    (void)cudaFree(counters);
    return device_error(e, "cudaMemsetAsync(split-K counters)");
  }
  ws->partials = partials;
  ws->counters = counters;
  ws->slots = slots;
  return FORGE_OK;
}

forge_status get_workspace(int device, cudaStream_t stream, int slots, Workspace* out) {
  // NOTE: asked first: cudaStreamGetId is not permitted on a stream being captured.
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  unsigned long long capture_id = 0;
  FORGE_CUDA_TRY(cudaStreamGetCaptureInfo(stream, &capture, &capture_id));
  const bool capturing = capture == cudaStreamCaptureStatusActive;
  unsigned long long key = capture_id;
  if (!capturing)
    if (forge_status s = stream_key(stream, &key)) return s;
  std::lock_guard<std::mutex> lock(g_workspace_mutex);
  Workspace& ws = (capturing ? g_capture_workspaces : g_workspaces)[{device, key}];
  if (ws.slots < slots) {
    // (A capture's workspace is made once at full size: nothing it recorded is ever freed.)
    if (ws.partials) (void)cudaFree(ws.partials);
    if (ws.counters) (void)cudaFree(ws.counters);
    ws = Workspace{};
    if (forge_status s = allocate_workspace(stream, slots, capturing, &ws)) return s;
  }
  *out = ws;
  return FORGE_OK;
}

// ---- parameters ------------------------------------------------------------------------------

// hparams.run_scalars (CUDA graphs), checked to be memory of this device; nullptr when unset.
forge_status run_scalars_of(const forge_hparams& hp, int device, const RuleScalars** out) {
  *out = nullptr;
  if (hp.run_scalars == nullptr) return FORGE_OK;
  cudaPointerAttributes attr{};
  const cudaError_t e = cudaPointerGetAttributes(&attr, hp.run_scalars);
  if (e != cudaSuccess) (void)cudaGetLastError();
  const bool on_device =
      e == cudaSuccess && (attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged);
  if (!on_device || attr.device != device)
    return fail(FORGE_ERR_INVALID_ARGUMENT,
                "hparams.run_scalars: %p is not memory of CUDA device %d (the step reads its "
                "scalars there when it runs)",
                hp.run_scalars, device);
  *out = static_cast<const RuleScalars*>(hp.run_scalars);
  return FORGE_OK;
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

ParamView make_param_view(const forge_param& p, int num_states) {
  ParamView v{};
  v.rows = p.rows;
  v.cols = p.cols;
  v.blocks_per_row = (p.cols + FORGE_INT8_BLOCK - 1) / FORGE_INT8_BLOCK;
  v.weight_format = p.weight_format;
  v.state_format = p.state_format;
  v.weight = p.weight;
  v.master = p.weight_format == FORGE_WEIGHT_BF16_MASTER ? p.master : nullptr;
  bool vec = p.cols % kQuad == 0 && aligned16(p.weight) && aligned16(v.master);
  for (int i = 0; i < FORGE_MAX_STATES; ++i) {
    if (i < num_states) {
      v.state[i] = p.state[i];
      v.absmax[i] = p.state_format == FORGE_STATE_INT8_BLOCK64 ? p.state_absmax[i] : nullptr;
      vec = vec && aligned16(p.state[i]);
    }
  }
  v.vec4 = vec ? 1 : 0;
  return v;
}

// Environment switches for benchmarking the epilogue's L2 prefetch: FORGE_CUDA_EPILOGUE_PREFETCH=0
// turns it off, FORGE_CUDA_PREFETCH_LEAD=tokens moves it (default kPrefetchLeadTokens before
// the main loop's end). The two-CTA Hopper kernel never prefetches for a stochastically
// rounded weight (wgrad_step).
bool epilogue_prefetch_enabled() {
  const char* v = std::getenv("FORGE_CUDA_EPILOGUE_PREFETCH");
  return !(v && v[0] == '0');
}
int prefetch_lead_tokens() {
  const char* v = std::getenv("FORGE_CUDA_PREFETCH_LEAD");
  const int lead = v ? std::atoi(v) : kPrefetchLeadTokens;
  return lead > 0 ? lead : kPrefetchLeadTokens;
}

// Benchmark knob: FORGE_CUDA_GROUP_M=n sets the tile rasterization's group height in tile-rows
// for every layer (1 walks each tile-row left to right); unset (0): group_height's choice.
int group_m_tiles() {
  const char* v = std::getenv("FORGE_CUDA_GROUP_M");
  const int n = v ? std::atoi(v) : 0;
  return n > 0 ? n : 0;
}

// The tile rasterization's group height for a layer of `tiles` tiles on `num_sms` SMs (the
// measurements behind it: kGroupM in sm80_wgrad.cuh).
int group_height(int64_t tiles, int num_sms) {
  const int64_t resident_ctas = 2 * static_cast<int64_t>(num_sms);  // two CTAs per SM
  return tiles <= kFewWaves * resident_ctas ? kGroupMFewWaves : kGroupM;
}

// Environment switch for the persistent, warp-specialized Hopper kernel (sm90_wgrad.cuh), which
// applies to the wgmma path without split-K outside CUDA graphs: FORGE_CUDA_PERSISTENT=1 runs
// it wherever it applies (the tests of it), =0 never; unset, where it pays (persistent_pays).
enum PersistentMode { kPersistentAuto, kPersistentAlways, kPersistentNever };
PersistentMode persistent_mode() {
  const char* v = std::getenv("FORGE_CUDA_PERSISTENT");
  if (v != nullptr && v[0] == '1') return kPersistentAlways;
  if (v != nullptr && v[0] == '0') return kPersistentNever;
  return kPersistentAuto;
}

// Test knob: FORGE_CUDA_PERSISTENT_CTAS=n caps the persistent grid at n CTAs, so that small
// test layers also run several tiles per CTA (0 or unset: one CTA per SM).
int64_t persistent_cta_cap() {
  const char* v = std::getenv("FORGE_CUDA_PERSISTENT_CTAS");
  const long long n = v != nullptr ? std::atoll(v) : 0;
  return n > 0 ? n : 0;
}

// Environment switch: FORGE_CUDA_WGMMA=0 keeps the sm80 kernels on Hopper too (A/B
// benchmarks, and the test suite on both paths). Default on.
bool wgmma_enabled() {
  const char* v = std::getenv("FORGE_CUDA_WGMMA");
  return !(v && v[0] == '0');
}

// Benchmark instrument: FORGE_CUDA_TRACE=<device address in hex>:<records> makes the Hopper
// kernels write one record (kTraceWords 64-bit words) per CTA into that buffer: TileTrace from
// the two-CTA kernel, PersistentTrace from the persistent one. The caller allocated it on the
// device of the steps (bench/wgrad_bench --trace sets it). Every launch overwrites it from
// record 0.
struct TraceBuffer {
  unsigned long long* records = nullptr;
  int64_t count = 0;
};
TraceBuffer trace_buffer() {
  TraceBuffer t;
  const char* v = std::getenv("FORGE_CUDA_TRACE");
  if (v == nullptr) return t;
  unsigned long long address = 0;
  long long count = 0;
  if (std::sscanf(v, "%llx:%lld", &address, &count) == 2 && address != 0 && count > 0) {
    t.records = reinterpret_cast<unsigned long long*>(static_cast<uintptr_t>(address));
    t.count = count;
  }
  return t;
}

// Benchmark knob: FORGE_CUDA_STAGGER_NS=ns replaces kStaggerNs (0 turns the stagger off).
int stagger_ns() {
  const char* v = std::getenv("FORGE_CUDA_STAGGER_NS");
  if (v == nullptr) return kStaggerNs;
  const int ns = std::atoi(v);
  return ns > 0 ? ns : 0;
}

// The switches above, read once per process (at the first step).
// NOTE: a getenv scans the whole environment; six per step cost host time on every Linear.
struct EnvSwitches {
  bool wgmma, epilogue_prefetch;
  PersistentMode persistent;
  int prefetch_lead, group_m;
  int64_t persistent_ctas;
  TraceBuffer trace;
  int stagger_ns;
};
const EnvSwitches& env_switches() {
  static const EnvSwitches switches{wgmma_enabled(),        epilogue_prefetch_enabled(),
                                    persistent_mode(),      prefetch_lead_tokens(),
                                    group_m_tiles(),        persistent_cta_cap(),
                                    trace_buffer(),         stagger_ns()};
  return switches;
}

// ---- TMA descriptors (sm90) ------------------------------------------------------------------------

// cuTensorMapEncodeTiled, from the driver through cudart (no -lcuda), looked up once.
forge_status tensor_map_encoder(PFN_cuTensorMapEncodeTiled_v12000* out) {
  static std::once_flag once;
  static PFN_cuTensorMapEncodeTiled_v12000 fn = nullptr;
  static cudaError_t error = cudaSuccess;
  static cudaDriverEntryPointQueryResult query = cudaDriverEntryPointSuccess;
  std::call_once(once, [] {
    void* p = nullptr;
    error = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000,
                                             cudaEnableDefault, &query);
    if (error != cudaSuccess) (void)cudaGetLastError();
    fn = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
  });
  if (error != cudaSuccess)
    return fail(FORGE_ERR_DEVICE, "CUDA: cudaGetDriverEntryPointByVersion(cuTensorMapEncodeTiled) "
                "failed: %s", cudaGetErrorString(error));
  if (query != cudaDriverEntryPointSuccess || fn == nullptr)
    return fail(FORGE_ERR_DEVICE, "CUDA: the driver has no cuTensorMapEncodeTiled (query result %d)",
                static_cast<int>(query));
  *out = fn;
  return FORGE_OK;
}

// The TMA descriptor of a [tokens, extent] 16-bit operand (row-major, ld elements per token):
// dims {extent, tokens}, boxes of 64 columns × kSm90BK tokens, 128B swizzle, zero fill out of
// range (T not a multiple of 64, extent not a multiple of 128).
forge_status encode_operand_map(PFN_cuTensorMapEncodeTiled_v12000 encode, CUtensorMap* map,
                                const void* base, int dtype, int64_t extent, int64_t tokens,
                                int64_t ld, const char* what) {
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(extent), static_cast<cuuint64_t>(tokens)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(ld) * 2};  // bytes, dim 1
  const cuuint32_t box[2] = {kSm90BoxCols, kSm90BK};
  const cuuint32_t element_strides[2] = {1, 1};
  const CUresult r = encode(
      map, dtype == FORGE_DTYPE_FP16 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
      2, const_cast<void*>(base), dims, strides, box, element_strides,
      CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    return fail(FORGE_ERR_DEVICE,
                "CUDA: cuTensorMapEncodeTiled(%s: %lld x %lld, ld %lld) failed: CUresult %d", what,
                static_cast<long long>(tokens), static_cast<long long>(extent),
                static_cast<long long>(ld), static_cast<int>(r));
  return FORGE_OK;
}

// ---- element-wise kernels ------------------------------------------------------------------------
//
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
// NOTE: specialized + kQ = 2 replaced one generic kernel with kQ = 1 and scalar gradient
// loads, which moved ~0.85 TB/s on the 0.5 G-parameter embedding of Llama-3.1-8B
// (8.6 ms of a 160 ms step at the end of backward: forge-bench --profile, 2026-11-29).
// `flat`: p is the flat view and the gradient bf16 with vector access (elementwise_step
// checks both); the pipelined loop runs where kElementwisePipelined.
// NOTE: 2 CTAs per SM asked for: without it ptxas gave the int8 kernels up to 144 registers
// (one CTA, 8 warps per SM); the others were at <= 128 already.
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
  if constexpr (int8_table_needed<Spec>()) {
    int8_tables_init(threadIdx.x);
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
// only holds what chose the kernel. Otherwise unused.
template <class Spec, int kQ>
__global__ void __launch_bounds__(kElementwiseThreads, 2)
    elementwise_kernel(const void* grad, int grad_dtype, bool grad_vec, bool flat,
                       const ParamView p, const RuleScalars k, const RuleScalars* run_k,
                       double* grad_sq_sum, unsigned long long* nonfinite_count) {
  if constexpr (Spec::kRunScalars) {
    elementwise_body<Spec, kQ>(grad, grad_dtype, grad_vec, flat, p, *run_k, grad_sq_sum,
                               nonfinite_count);
  } else {
    elementwise_body<Spec, kQ>(grad, grad_dtype, grad_vec, flat, p, k, grad_sq_sum,
                               nonfinite_count);
  }
}

using ElementwiseKernelFn = void (*)(const void*, int, bool, bool, ParamView, RuleScalars,
                                     const RuleScalars*, double*, unsigned long long*);
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

enum StateOp : int { kStateFill = 0, kStateToFp32 = 1, kStateFromFp32 = 2 };

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
  int8_tables_init(threadIdx.x);  // the state format is a run-time value here
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

int elementwise_blocks(const ParamView& p, int num_sms, int pairs_per_warp = 2) {
  const int64_t pairs = p.rows * p.blocks_per_row;
  const int64_t warps = (pairs + pairs_per_warp - 1) / pairs_per_warp;
  const int64_t blocks = (warps + kElementwiseThreads / 32 - 1) / (kElementwiseThreads / 32);
  // NOTE: a grid-stride loop over at most 16 CTAs per SM: enough warps in flight to cover
  // memory latency, and no tail of tiny CTAs on huge parameters.
  const int64_t cap = static_cast<int64_t>(num_sms) * 16;
  return static_cast<int>(blocks < cap ? blocks : cap);
}

forge_status run_state_kernel(const forge_param& param, int index, bool is_signed, int op,
                              float value, const float* in, float* out,
                              const forge_device& device) {
  DeviceGuard guard;
  if (forge_status s = guard.enter(device.index)) return s;
  DeviceInfo info;
  if (forge_status s = device_info(device.index, &info)) return s;
  // Only state `index` is touched: a one-state view with it in slot 0.
  forge_param one = param;
  one.state[0] = param.state[index];
  one.state_absmax[0] = param.state_absmax[index];
  const ParamView view = make_param_view(one, 1);
  const cudaStream_t stream = static_cast<cudaStream_t>(device.stream);
  state_kernel<<<elementwise_blocks(view, info.num_sms), kElementwiseThreads, 0, stream>>>(
      view, is_signed, op, value, in, out);
  FORGE_CUDA_TRY(cudaGetLastError());
  return FORGE_OK;
}

}  // namespace

// ---- the backend interface ------------------------------------------------------------------------

forge_status wgrad_step(const forge_wgrad_args& a, const RuleScalars& k) {
  DeviceGuard guard;
  if (forge_status s = guard.enter(a.device.index)) return s;
  DeviceInfo info;
  if (forge_status s = device_info(a.device.index, &info)) return s;
  const cudaStream_t stream = static_cast<cudaStream_t>(a.device.stream);
  const forge_param& param = a.param;
  const RuleScalars* run = nullptr;
  if (forge_status s = run_scalars_of(a.hparams, a.device.index, &run)) return s;

  const int64_t tiles_m = (param.rows + kBM - 1) / kBM;
  const int64_t tiles_n = (param.cols + kBN - 1) / kBN;
  const int64_t tiles = tiles_m * tiles_n;
  if (tiles > INT32_MAX)
    return fail(FORGE_ERR_UNSUPPORTED, "CUDA: param %lld x %lld has more than 2^31 tiles",
                static_cast<long long>(param.rows), static_cast<long long>(param.cols));

  // The Hopper main loop (TMA + wgmma) when this device runs it and the inputs suit TMA:
  // bf16/bf16 or fp16/fp16, 16 B aligned bases, row strides a multiple of 16 B, and
  // coordinates within TMA's signed 32-bit range. Anything else: the sm80 kernels.
  const bool bf16_inputs = a.x_dtype == FORGE_DTYPE_BF16 && a.dy_dtype == FORGE_DTYPE_BF16;
  const bool fp16_inputs = a.x_dtype == FORGE_DTYPE_FP16 && a.dy_dtype == FORGE_DTYPE_FP16;
  constexpr int64_t kTmaCoordMax = INT32_MAX - 2 * kBM;
  const EnvSwitches& env = env_switches();
  const bool use_wgmma = info.wgmma && (bf16_inputs || fp16_inputs) && env.wgmma &&
                         aligned16(a.x) && aligned16(a.dy) && a.ldx % 8 == 0 &&
                         a.lddy % 8 == 0 && param.rows <= kTmaCoordMax &&
                         param.cols <= kTmaCoordMax && a.tokens <= kTmaCoordMax;

  // Tokens per k-tile: each kernel's own pipeline stage (split-K counts in k-tiles).
  const int64_t bk = use_wgmma ? kSm90BK : kBK;
  const int64_t ktiles = (a.tokens + bk - 1) / bk;

  // Split-K: only when the tiles alone leave SMs idle, at least kMinSplitTokens tokens per
  // split so the partial round trip (2 × 64 KiB per CTA) stays small next to the split's
  // GEMM work, and never more partials than workspace slots (= SMs).
  // NOTE: the bound tiles × splits ≤ SMs is what keeps the workspace O(SMs × tile).
  constexpr int64_t kMinSplitTokens = 256;
  const int64_t min_ktiles_per_split = kMinSplitTokens / bk;
  constexpr int64_t kMaxSplits = 64;
  int64_t splits = 1;
  if (tiles < info.num_sms && ktiles >= 2 * min_ktiles_per_split) {
    splits = info.num_sms / tiles;
    splits = splits < ktiles / min_ktiles_per_split ? splits : ktiles / min_ktiles_per_split;
    splits = splits < kMaxSplits ? splits : kMaxSplits;
    if (splits < 1) splits = 1;
  }
  const int64_t per = (ktiles + splits - 1) / splits;
  splits = (ktiles + per - 1) / per;  // no empty split

  WgradParams w{};
  w.x = a.x;
  w.dy = a.dy;
  w.ldx = a.ldx;
  w.lddy = a.lddy;
  w.tokens = a.tokens;
  w.x_dtype = a.x_dtype;
  w.dy_dtype = a.dy_dtype;
  w.vec_x = a.ldx % 8 == 0 && aligned16(a.x);
  w.vec_dy = a.lddy % 8 == 0 && aligned16(a.dy);
  w.tiles_m = static_cast<int32_t>(tiles_m);
  w.tiles_n = static_cast<int32_t>(tiles_n);
  w.splits = static_cast<int32_t>(splits);
  w.ktiles_per_split = static_cast<int32_t>(per);
  w.prefetch = splits == 1 && env.epilogue_prefetch;
  w.prefetch_lead = env.prefetch_lead;
  w.group_m = env.group_m > 0 ? env.group_m : group_height(tiles, info.num_sms);
  w.want_sq = a.outputs.grad_sq_sum != nullptr;
  w.grad_sq_sum = a.outputs.grad_sq_sum;
  w.nonfinite_count = reinterpret_cast<unsigned long long*>(a.outputs.nonfinite_count);
  w.p = make_param_view(param, k.num_states);
  w.k = k;
  w.run_k = run;
  if (splits > 1) {
    Workspace ws;
    if (forge_status s = get_workspace(a.device.index, stream, info.num_sms, &ws)) return s;
    w.workspace = ws.partials;
    w.counters = ws.counters;
  }

  const dim3 grid(static_cast<unsigned>(tiles), 1, static_cast<unsigned>(splits));
  if (use_wgmma) {
    PFN_cuTensorMapEncodeTiled_v12000 encode = nullptr;
    if (forge_status s = tensor_map_encoder(&encode)) return s;
    Sm90TensorMaps maps;
    std::memset(&maps, 0, sizeof(maps));
    if (forge_status s = encode_operand_map(encode, &maps.dy, a.dy, a.dy_dtype, param.rows,
                                            a.tokens, a.lddy, "dy"))
      return s;
    if (forge_status s = encode_operand_map(encode, &maps.x, a.x, a.x_dtype, param.cols,
                                            a.tokens, a.ldx, "x"))
      return s;
    w.trace = env.trace.records;
    w.trace_ctas = env.trace.count;
    // The persistent kernel: its specialized kernel for these formats, if any (a graph's step,
    // run != nullptr, has only those), else the generic one (forced only).
    const Sm90Kernel* persistent_spec = nullptr;
    if (splits == 1 && !fp16_inputs)
      persistent_spec =
          run != nullptr
              ? find_spec_kernel(kPersistentSpecRunKernels, k, param.weight_format,
                                 param.state_format)
              : find_spec_kernel(kPersistentSpecKernels, k, param.weight_format,
                                 param.state_format);
    const bool persistent_applies = splits == 1 && (run == nullptr || persistent_spec != nullptr);
    const bool use_persistent =
        persistent_applies &&
        (env.persistent == kPersistentAlways ||
         (env.persistent == kPersistentAuto &&
          persistent_pays(a.tokens, tiles, info.num_sms, param.weight_format,
                          param.state_format, persistent_spec != nullptr)));
    if (use_persistent) {
      // One CTA per SM, each looping over tiles (tiles j·SMs + blockIdx.x).
      const Sm90Kernel& chosen = persistent_spec != nullptr
                                     ? *persistent_spec
                                     : kPersistentGenericKernels[fp16_inputs ? 1 : 0];
      const Sm90KernelFn kernel = chosen.fn;
      const char* name = chosen.name;
      log_kernel_choice(name, k, param.weight_format, param.state_format, splits);
      int64_t ctas = tiles < info.num_sms ? tiles : info.num_sms;
      if (const int64_t cap = env.persistent_ctas) ctas = ctas < cap ? ctas : cap;
      kernel<<<static_cast<unsigned>(ctas), kPersistentThreads, kPersistentSmemBytes, stream>>>(
          w, maps);
      FORGE_CUDA_TRY(cudaGetLastError());
      return FORGE_OK;
    }
    // NOTE: the stagger and the L2 prefetch of the update's operands are for nearest-rounded
    // weights only. A stochastically rounded weight's longer update already leaves the two CTAs
    // of an SM mostly out of phase: the stagger then only delays (v13), and the prefetch
    // competes with the other CTA's update for L2 and DRAM instead of filling an idle DRAM.
    // Llama totals, SR weight + SR states, prefetch on -> off: 37.2 -> 35.6 ms at T = 512,
    // 72.6 -> 69.1 at 2048, 118.2 -> 115.4 at 4096; SR weight + int8 states and bf16 nearest
    // unchanged in total (run 47, bench/NOTES.md v15).
    const bool ctas_in_phase = param.weight_format != FORGE_WEIGHT_BF16_STOCHASTIC;
    w.stagger_ns =
        splits == 1 && tiles >= kStaggerMinWaves * 2 * info.num_sms && ctas_in_phase
            ? env.stagger_ns
            : 0;
    w.stagger_first = info.num_sms;
    w.stagger_count = info.num_sms;
    if (!ctas_in_phase) w.prefetch = 0;
    const Sm90Kernel& fp16_kernel = kSm90GenericKernels[run != nullptr][1];
    const char* name = fp16_kernel.name;
    const Sm90KernelFn kernel =
        fp16_inputs ? fp16_kernel.fn
                    : pick_bf16_sm90_kernel(k, param.weight_format, param.state_format,
                                            run != nullptr, &name);
    log_kernel_choice(name, k, param.weight_format, param.state_format, splits);
    kernel<<<grid, kThreads, kSm90SmemBytes, stream>>>(w, maps);
  } else if (bf16_inputs) {
    const char* name = nullptr;
    const WgradKernelFn kernel =
        pick_bf16_kernel(k, param.weight_format, param.state_format, run != nullptr, &name);
    log_kernel_choice(name, k, param.weight_format, param.state_format, splits);
    kernel<<<grid, kThreads, kWgradSmemBytes, stream>>>(w);
  } else {
    // fp16 inputs: the mma kernel; anything else (fp32 or mixed): the SIMT one.
    const WgradKernel& kernel = kGenericKernels[run != nullptr][fp16_inputs ? 1 : 2];
    log_kernel_choice(kernel.name, k, param.weight_format, param.state_format, splits);
    kernel.fn<<<grid, kThreads, kWgradSmemBytes, stream>>>(w);
  }
  FORGE_CUDA_TRY(cudaGetLastError());
  return FORGE_OK;
}

forge_status elementwise_step(const forge_elementwise_args& a, const RuleScalars& k) {
  DeviceGuard guard;
  if (forge_status s = guard.enter(a.device.index)) return s;
  DeviceInfo info;
  if (forge_status s = device_info(a.device.index, &info)) return s;
  const RuleScalars* run = nullptr;
  if (forge_status s = run_scalars_of(a.hparams, a.device.index, &run)) return s;
  const ParamView view = make_param_view(a.param, k.num_states);
  const cudaStream_t stream = static_cast<cudaStream_t>(a.device.stream);
  const ElementwiseKernel& generic = kElementwiseGenericKernels[run != nullptr];
  const ElementwiseKernel* kernel =
      run ? find_spec_kernel(kElementwiseSpecRunKernels, k, a.param.weight_format,
                             a.param.state_format)
          : find_spec_kernel(kElementwiseSpecKernels, k, a.param.weight_format,
                             a.param.state_format);
  if (kernel == nullptr) kernel = &generic;
  log_kernel_choice(kernel->name, k, a.param.weight_format, a.param.state_format, 1);
  const bool grad_vec = view.vec4 != 0 && aligned16(a.grad);
  // The flat view (see elementwise_flat_pipelined): same offsets, one row, no division per
  // pair. The kernels that do not pipeline run their ordinary loop on it.
  const bool flat = kernel != &generic && grad_vec &&
                    a.grad_dtype == FORGE_DTYPE_BF16 && view.cols % FORGE_INT8_BLOCK == 0;
  ParamView run_view = view;
  if (flat) {
    run_view.cols = view.rows * view.cols;
    run_view.rows = 1;
    run_view.blocks_per_row = run_view.cols / FORGE_INT8_BLOCK;
  }
  kernel->fn<<<elementwise_blocks(run_view, info.num_sms, kernel->pairs_per_warp),
               kElementwiseThreads, 0, stream>>>(
      a.grad, a.grad_dtype, grad_vec, flat, run_view, k, run, a.outputs.grad_sq_sum,
      reinterpret_cast<unsigned long long*>(a.outputs.nonfinite_count));
  FORGE_CUDA_TRY(cudaGetLastError());
  return FORGE_OK;
}

forge_status state_fill(const forge_param& p, int index, bool is_signed, float value,
                        const forge_device& device) {
  return run_state_kernel(p, index, is_signed, kStateFill, value, nullptr, nullptr, device);
}

forge_status state_to_fp32(const forge_param& p, int index, bool is_signed, float* out,
                           const forge_device& device) {
  return run_state_kernel(p, index, is_signed, kStateToFp32, 0.0f, nullptr, out, device);
}

forge_status state_from_fp32(const forge_param& p, int index, bool is_signed, const float* in,
                             const forge_device& device) {
  return run_state_kernel(p, index, is_signed, kStateFromFp32, 0.0f, in, nullptr, device);
}

}  // namespace cuda
}  // namespace forge
