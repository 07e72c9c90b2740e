// cuda_backend.cu — the CUDA backend: forge::cuda::{wgrad_step, elementwise_step, state_fill,
// state_to_fp32, state_from_fp32} (declared by FORGE_DECLARE_BACKEND in src/backend.h).
//
// This file only launches: it gathers a step's facts, asks heuristics.h for the plan (kernel,
// split-K, launch shape) and executes it. Around that: the device guard and error reporting,
// the per-device kernel set-up, the split-K workspace cache, the TMA descriptors and the one
// reader of the debug switches. Elsewhere:
//  - heuristics.h: the kernel-choice policy (host-only, tested by the CPU suite).
//  - kernel_tables.cuh: every kernel, in the tables the launchers pick from.
//  - sm80_wgrad.cuh / sm90_wgrad.cuh: the fused dW = dYᵀX + optimizer kernels' main loops
//    (mma.sync and SIMT; TMA + wgmma, two-CTA and persistent); wgrad_tile.cuh and
//    wgrad_epilogue.cuh: what they share (launch parameters, tile order, split-K, the update
//    of a tile).
//  - elementwise.cuh: the element-wise step and state kernels.
//  - update.cuh (its layers in update/): the element update every kernel shares; ptx.cuh:
//    the inline-PTX wrappers.
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
#include "core/run_scalars.h"
#include "core/status.h"
#include "cuda/heuristics.h"
#include "cuda/kernel_tables.cuh"
#include "cuda/update.cuh"

namespace forge {
namespace cuda {
namespace {

// heuristics.h's picture of the kernels must be theirs.
static_assert(kTileRows == kBM && kTileCols == kBN, "heuristics.h: tile shape");
static_assert(kSm80TokensPerKtile == kBK && kSm90TokensPerKtile == kSm90BK,
              "heuristics.h: tokens per k-tile");

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

// ---- debug switches ----------------------------------------------------------------------------

// The FORGE_DEBUG_* environment switches (documented on DebugSwitches, heuristics.h), read
// once per process, at the backend's first call.
// NOTE: a getenv scans the whole environment; one per switch per step costs host time on
// every Linear.
DebugSwitches read_debug_switches() {
  DebugSwitches d;
  if (const char* v = std::getenv("FORGE_DEBUG_WGMMA")) d.wgmma = v[0] != '0';
  if (const char* v = std::getenv("FORGE_DEBUG_PERSISTENT")) {
    if (v[0] == '1') d.persistent = PersistentOverride::kAlways;
    if (v[0] == '0') d.persistent = PersistentOverride::kNever;
  }
  if (const char* v = std::getenv("FORGE_DEBUG_PERSISTENT_CTAS")) {
    const long long n = std::atoll(v);
    d.persistent_ctas = n > 0 ? n : 0;
  }
  if (const char* v = std::getenv("FORGE_DEBUG_GROUP_M")) {
    const int n = std::atoi(v);
    d.group_m = n > 0 ? n : 0;
  }
  if (const char* v = std::getenv("FORGE_DEBUG_STAGGER_NS")) {
    const int ns = std::atoi(v);
    d.stagger_ns = ns > 0 ? ns : 0;
  }
  if (const char* v = std::getenv("FORGE_DEBUG_EPILOGUE_PREFETCH")) {
    if (v[0] == '1') d.epilogue_prefetch = PrefetchOverride::kOn;
    if (v[0] == '0') d.epilogue_prefetch = PrefetchOverride::kOff;
  }
  if (const char* v = std::getenv("FORGE_DEBUG_PREFETCH_LEAD")) {
    const int lead = std::atoi(v);
    d.prefetch_lead = lead > 0 ? lead : kPrefetchLeadTokens;
  }
  if (const char* v = std::getenv("FORGE_DEBUG_TRACE")) {
    unsigned long long address = 0;
    long long count = 0;
    if (std::sscanf(v, "%llx:%lld", &address, &count) == 2 && address != 0 && count > 0) {
      d.trace_address = address;
      d.trace_records = count;
    }
  }
  if (const char* v = std::getenv("FORGE_DEBUG_LOG")) d.log = v[0] != '\0' && v[0] != '0';
  return d;
}
const DebugSwitches& debug_switches() {
  static const DebugSwitches switches = read_debug_switches();
  return switches;
}

// FORGE_DEBUG_LOG: says once per (kernel, rule, weight format, state format, split-K) which
// kernel a step runs, so a configuration that falls back to a generic kernel is visible.
void log_kernel_choice(const char* kernel, const RuleScalars& k, int weight_format,
                       int state_format, int64_t splits) {
  if (!debug_switches().log) return;
  static std::mutex mutex;
  static std::set<std::string> seen;
  char line[256];
  std::snprintf(line, sizeof(line), "%s for rule %d, weight format %d, state format %d%s", kernel,
                k.rule, weight_format, state_format, splits > 1 ? ", split-K" : "");
  std::lock_guard<std::mutex> lock(mutex);
  if (seen.insert(line).second) std::fprintf(stderr, "forge cuda: step runs %s\n", line);
}

// ---- devices -----------------------------------------------------------------------------------

// Per-device facts and one-time kernel attributes, cached (thread-safe).
struct DeviceInfo {
  int num_sms = 0;
  int dram_gbps = 0;  // peak DRAM bandwidth (heuristics.h's persistent windows)
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
    // Peak DRAM bandwidth (0 where the device does not report its memory clock and bus).
    int memory_khz = 0, bus_bits = 0;
    if (cudaDeviceGetAttribute(&memory_khz, cudaDevAttrMemoryClockRate, index) != cudaSuccess ||
        cudaDeviceGetAttribute(&bus_bits, cudaDevAttrGlobalMemoryBusWidth, index) != cudaSuccess) {
      cudaGetLastError();  // a failed query's error is not the next call's
      memory_khz = bus_bits = 0;
    }
    info.dram_gbps = dram_gbps_of(memory_khz, bus_bits);
    const bool verbose = debug_switches().log;
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
                     "forge cuda: device %d, %d SMs, %d GB/s: %s: %d CTAs/SM of %d threads, "
                     "%d registers, %zu B local, %zu B static + %zu B dynamic shared\n",
                     index, info.num_sms, info.dram_gbps, name, ctas, threads, attr.numRegs,
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
      // (the persistent kernels too, whether or not FORGE_DEBUG_PERSISTENT is set: once per
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
      v.absmax[i] = is_block_format(p.state_format) ? p.state_absmax[i] : nullptr;
      vec = vec && aligned16(p.state[i]);
    }
  }
  // A shard's stochastic-rounding indices (forge_param): (row_offset + row) * full_cols +
  // col_offset + col = idx + sr_base + row * sr_row_extra.
  if (p.full_cols != 0) {
    v.sr_base = p.row_offset * p.full_cols + p.col_offset;
    v.sr_row_extra = p.full_cols - p.cols;
  }
  // A vector quad must be one group of 4 SR indices (QuadDraws hashes once per stream for it).
  // A shard whose rows do not start on a group (col_offset or full_cols not a multiple of 4)
  // takes the element-wise quads instead: correct, not fast.
  const bool stochastic = p.weight_format == FORGE_WEIGHT_BF16_STOCHASTIC ||
                          (num_states > 0 && p.state_format == FORGE_STATE_BF16_STOCHASTIC);
  if (stochastic && (v.sr_base % 4 != 0 || v.sr_row_extra % 4 != 0)) vec = false;
  v.vec4 = vec ? 1 : 0;
  return v;
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

// ---- element-wise and state kernels ------------------------------------------------------------

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
  const int blocks =
      elementwise_blocks(view.rows * view.blocks_per_row, info.num_sms, 2, kElementwiseThreads);
  state_kernel<<<blocks, kElementwiseThreads, 0, stream>>>(view, is_signed, op, value, in, out);
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

  const bool bf16_inputs = a.x_dtype == FORGE_DTYPE_BF16 && a.dy_dtype == FORGE_DTYPE_BF16;
  const bool fp16_inputs = a.x_dtype == FORGE_DTYPE_FP16 && a.dy_dtype == FORGE_DTYPE_FP16;
  // (Looked up only where the plan can use it: the wgmma path with bf16 inputs.)
  const Sm90Kernel* persistent_spec =
      info.wgmma && bf16_inputs
          ? find_persistent_spec_kernel(k, param.weight_format, param.state_format,
                                        run != nullptr)
          : nullptr;
  WgradFacts facts;
  facts.num_sms = info.num_sms;
  facts.dram_gbps = info.dram_gbps;
  facts.wgmma = info.wgmma;
  facts.x_dtype = a.x_dtype;
  facts.dy_dtype = a.dy_dtype;
  facts.x_aligned16 = aligned16(a.x);
  facts.dy_aligned16 = aligned16(a.dy);
  facts.ldx = a.ldx;
  facts.lddy = a.lddy;
  facts.rows = param.rows;
  facts.cols = param.cols;
  facts.tokens = a.tokens;
  facts.weight_format = param.weight_format;
  facts.state_format = param.state_format;
  facts.persistent_spec_kernel = persistent_spec != nullptr;
  facts.run_scalars = run != nullptr;
  const DebugSwitches& debug = debug_switches();
  const WgradPlan plan = plan_wgrad(facts, debug);
  if (plan.tiles > INT32_MAX)
    return fail(FORGE_ERR_UNSUPPORTED, "CUDA: param %lld x %lld has more than 2^31 tiles",
                static_cast<long long>(param.rows), static_cast<long long>(param.cols));

  WgradParams w{};
  w.x = a.x;
  w.dy = a.dy;
  w.ldx = a.ldx;
  w.lddy = a.lddy;
  w.tokens = a.tokens;
  w.x_dtype = a.x_dtype;
  w.dy_dtype = a.dy_dtype;
  w.vec_x = a.ldx % 8 == 0 && facts.x_aligned16;
  w.vec_dy = a.lddy % 8 == 0 && facts.dy_aligned16;
  w.tiles_m = static_cast<int32_t>(plan.tiles_m);
  w.tiles_n = static_cast<int32_t>(plan.tiles_n);
  w.splits = static_cast<int32_t>(plan.splits);
  w.ktiles_per_split = static_cast<int32_t>(plan.ktiles_per_split);
  w.prefetch = plan.prefetch;
  w.prefetch_lead = plan.prefetch_lead;
  w.group_m = plan.group_m;
  w.want_sq = a.outputs.grad_sq_sum != nullptr;
  w.grad_sq_sum = a.outputs.grad_sq_sum;
  w.nonfinite_count = reinterpret_cast<unsigned long long*>(a.outputs.nonfinite_count);
  w.p = make_param_view(param, k.num_states);
  w.k = k;
  w.run_k = run;
  if (run) w.run_key = run_scalars_key(a.hparams);
  w.stagger_ns = plan.stagger_ns;
  w.stagger_first = plan.stagger_first;
  w.stagger_count = plan.stagger_count;
  if (plan.splits > 1) {
    Workspace ws;
    if (forge_status s = get_workspace(a.device.index, stream, info.num_sms, &ws)) return s;
    w.workspace = ws.partials;
    w.counters = ws.counters;
  }

  const dim3 grid(static_cast<unsigned>(plan.tiles), 1, static_cast<unsigned>(plan.splits));
  if (is_sm90(plan.path)) {
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
    w.trace = reinterpret_cast<unsigned long long*>(static_cast<uintptr_t>(debug.trace_address));
    w.trace_ctas = debug.trace_records;
    if (plan.path == WgradPath::kSm90Persistent) {
      // One CTA per SM (or fewer), each looping over tiles (tiles j·CTAs + blockIdx.x).
      const Sm90Kernel& chosen = plan.persistent_spec
                                     ? *persistent_spec
                                     : kPersistentGenericKernels[fp16_inputs ? 1 : 0];
      log_kernel_choice(chosen.name, k, param.weight_format, param.state_format, plan.splits);
      chosen.fn<<<static_cast<unsigned>(plan.persistent_ctas), kPersistentThreads,
                  kPersistentSmemBytes, stream>>>(w, maps);
    } else {
      const Sm90Kernel& fp16_kernel = kSm90GenericKernels[run != nullptr][1];
      const char* name = fp16_kernel.name;
      const Sm90KernelFn kernel =
          fp16_inputs ? fp16_kernel.fn
                      : pick_bf16_sm90_kernel(k, param.weight_format, param.state_format,
                                              run != nullptr, &name);
      log_kernel_choice(name, k, param.weight_format, param.state_format, plan.splits);
      kernel<<<grid, kThreads, kSm90SmemBytes, stream>>>(w, maps);
    }
  } else if (bf16_inputs) {
    const char* name = nullptr;
    const WgradKernelFn kernel =
        pick_bf16_kernel(k, param.weight_format, param.state_format, run != nullptr, &name);
    log_kernel_choice(name, k, param.weight_format, param.state_format, plan.splits);
    kernel<<<grid, kThreads, kWgradSmemBytes, stream>>>(w);
  } else {
    // fp16 inputs: the mma kernel; anything else (fp32 or mixed): the SIMT one.
    const WgradKernel& kernel = kGenericKernels[run != nullptr][fp16_inputs ? 1 : 2];
    log_kernel_choice(kernel.name, k, param.weight_format, param.state_format, plan.splits);
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
  // pair. The kernels that do not pipeline run their ordinary loop on it. Not for a shard whose
  // SR index is not linear in the offset (rows that are not whole rows of the full parameter).
  const bool flat = kernel != &generic && grad_vec &&
                    a.grad_dtype == FORGE_DTYPE_BF16 && view.cols % FORGE_INT8_BLOCK == 0 &&
                    (view.sr_row_extra == 0 || view.rows == 1);
  ParamView run_view = view;
  if (flat) {
    run_view.cols = view.rows * view.cols;
    run_view.rows = 1;
    run_view.blocks_per_row = run_view.cols / FORGE_INT8_BLOCK;
  }
  const int blocks = elementwise_blocks(run_view.rows * run_view.blocks_per_row, info.num_sms,
                                       kernel->pairs_per_warp, kElementwiseThreads);
  const uint64_t run_key = run ? run_scalars_key(a.hparams) : 0;
  kernel->fn<<<blocks, kElementwiseThreads, 0, stream>>>(
      a.grad, a.grad_dtype, grad_vec, flat, run_view, k, run, run_key, a.outputs.grad_sq_sum,
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
  // Nothing a step would never store (the CPU backend's refusals, with its messages): the
  // smallest offending index of `in` is found and copied back before anything is written.
  DeviceGuard guard;
  if (forge_status s = guard.enter(device.index)) return s;
  DeviceInfo info;
  if (forge_status s = device_info(device.index, &info)) return s;
  const cudaStream_t stream = static_cast<cudaStream_t>(device.stream);
  const int64_t n = p.rows * p.cols;
  unsigned long long* first = nullptr;
  FORGE_CUDA_TRY(cudaMallocAsync(reinterpret_cast<void**>(&first), sizeof(*first), stream));
  unsigned long long found = ~0ull;
  float value = 0.0f;
  cudaError_t e = cudaMemsetAsync(first, 0xFF, sizeof(*first), stream);
  const char* what = "cudaMemsetAsync(state_from_fp32's check)";
  if (e == cudaSuccess) {
    // (one element per lane and iteration: 32 per warp)
    const int blocks = elementwise_blocks(n, info.num_sms, 32, kElementwiseThreads);
    state_value_check_kernel<<<blocks, kElementwiseThreads, 0, stream>>>(in, n, is_signed, first);
    e = cudaGetLastError();
    what = "state_value_check_kernel";
  }
  if (e == cudaSuccess) {
    e = cudaMemcpyAsync(&found, first, sizeof(found), cudaMemcpyDeviceToHost, stream);
    what = "cudaMemcpyAsync(state_from_fp32's check)";
  }
  if (e == cudaSuccess) {
    e = cudaStreamSynchronize(stream);
    what = "cudaStreamSynchronize(state_from_fp32's check)";
  }
  if (e == cudaSuccess && found != ~0ull) {
    e = cudaMemcpyAsync(&value, in + found, sizeof(value), cudaMemcpyDeviceToHost, stream);
    if (e == cudaSuccess) e = cudaStreamSynchronize(stream);
    what = "cudaMemcpyAsync(state_from_fp32's offending value)";
  }
  const cudaError_t freed = cudaFreeAsync(first, stream);
  if (e != cudaSuccess) return device_error(e, what);
  FORGE_CUDA_TRY(freed);
  if (found != ~0ull)
    return refuse_state_value(static_cast<int64_t>(found), value, index);
  return run_state_kernel(p, index, is_signed, kStateFromFp32, 0.0f, in, nullptr, device);
}

}  // namespace cuda
}  // namespace forge
