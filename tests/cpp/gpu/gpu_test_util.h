// gpu_test_util.h — what the GPU tests share: device buffers with guard bands, a parameter
// (weight + states) held on the host and mirrored on the device, test inputs, and one
// fused step run through the public C ABI on the CPU backend (the specification) and on
// the CUDA backend with the same inputs.
//
// Every device buffer has a 256-byte guard band of 0xFF on both sides (a poisoned border);
// tests check that no kernel wrote into it.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

#include "forge/forge.h"

namespace fgt {

// Every weight and state format, for the sweeps.
constexpr forge_weight_format kWeightFormats[] = {FORGE_WEIGHT_FP32, FORGE_WEIGHT_BF16,
                                                  FORGE_WEIGHT_BF16_STOCHASTIC,
                                                  FORGE_WEIGHT_BF16_MASTER};
constexpr forge_state_format kStateFormats[] = {FORGE_STATE_FP32, FORGE_STATE_BF16,
                                                FORGE_STATE_BF16_STOCHASTIC,
                                                FORGE_STATE_INT8_BLOCK64,
                                                FORGE_STATE_FP8_BLOCK64,
                                                FORGE_STATE_INT4_BLOCK64};

// True when a CUDA device is present. GPU tests skip themselves otherwise (the CPU-only CI
// machine builds and lists them, never runs them); scripts/gpu_check.sh fails on skips.
bool gpu_available();
#define FORGE_REQUIRE_GPU()                                                   \
  do {                                                                        \
    if (!::fgt::gpu_available()) GTEST_SKIP() << "no CUDA device on this machine"; \
  } while (0)

// Throw std::runtime_error (reported by gtest as a failure of the test) on an error.
void cuda_ok(cudaError_t e, const char* what);
void forge_ok(forge_status s, const char* what);
#define CUDA_OK(call) ::fgt::cuda_ok((call), #call)
#define FORGE_OK(call) ::fgt::forge_ok((call), #call)

forge_device cpu_device();
forge_device gpu_device(cudaStream_t stream = nullptr);

// Device memory with a poisoned (0xFF) guard band on each side.
class DeviceBuffer {
 public:
  static constexpr size_t kGuard = 256;
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t bytes) { allocate(bytes); }
  ~DeviceBuffer();
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& o) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept;

  void allocate(size_t bytes);  // contents: 0xFF everywhere
  void* data() const { return base_ ? base_ + kGuard : nullptr; }
  size_t size() const { return bytes_; }
  void upload(const void* host, size_t bytes);
  void download(void* host, size_t bytes) const;
  void fill(int byte_value);  // the data region only
  bool guards_intact() const;

 private:
  static void settle_legacy_stream();
  uint8_t* base_ = nullptr;
  size_t bytes_ = 0;
};

// A parameter's weight and states, in their storage formats, in host memory.
struct HostParam {
  int64_t rows = 0, cols = 0;
  forge_weight_format weight_format = FORGE_WEIGHT_FP32;
  forge_state_format state_format = FORGE_STATE_FP32;
  forge_state_layout layout{};
  std::vector<uint8_t> weight, master, state[FORGE_MAX_STATES];
  std::vector<float> absmax[FORGE_MAX_STATES];
  // A shard's place in its full parameter (forge_param); 0, 0, 0: not a shard.
  int64_t row_offset = 0, col_offset = 0, full_cols = 0;
  forge_param view();
};

// Random weights (N(0, 0.5²)) and states (signed: N(0, 0.1²) or N(0, 0.01²) for grad_avg;
// second moments U[1e-3, 1e-2]; Adagrad sums U[0.1, 1]) encoded by the CPU backend.
HostParam make_param(int64_t rows, int64_t cols, forge_weight_format wf, forge_state_format sf,
                     const forge_hparams& hp, uint64_t seed);

// Block [r0, r0 + rows) × [c0, c0 + cols) of `full` as a parameter of its own (its own
// contiguous buffers; int8: c0 % 64 == 0, so its absmax blocks are the full one's) with its
// shard offsets set; put_shard writes one back.
HostParam take_shard(const HostParam& full, int64_t r0, int64_t rows, int64_t c0, int64_t cols);
void put_shard(HostParam& full, const HostParam& shard);

// The same parameter in device memory.
struct DeviceParam {
  DeviceBuffer weight, master, state[FORGE_MAX_STATES], absmax[FORGE_MAX_STATES];
  void upload(const HostParam& h);  // allocates on first use
  forge_param view(const HostParam& shape) const;
  HostParam download(const HostParam& shape) const;
  ::testing::AssertionResult guards_intact() const;
};

// Bit-for-bit comparison of every buffer; the message names the first differing element.
::testing::AssertionResult same_bits(const HostParam& expected, const HostParam& actual);

// Runs `launch` with a zeroed device counter and returns what it counted (the format tests'
// mismatches).
unsigned long long run_and_count(void (*launch)(unsigned long long*));

// Decoded fp32 values of one buffer ("weight", "master", "state0".."state2").
std::vector<float> decoded(const HostParam& p, const std::string& buffer, const forge_hparams& hp);

// The block rule of int8 / fp8 / int4 states for elements skipped in a step (a non-finite
// gradient): for each row of `after` (the step's result from `before`) and each column in
// `skipped`, in every state, the element keeps its code where its block's absmax stayed, else
// gets its old code decoded and encoded again with the new absmax (formats.h). Counts the two
// cases.
void expect_skipped_codes(const HostParam& before, const HostParam& after,
                          std::initializer_list<int64_t> skipped, int* stayed, int* grew);

// Whether a skipped element's value v lies in the range of its int8 / fp8 block (absmax),
// where growing the absmax keeps it bit for bit (formats.h, block_absmax_with_skipped): int8
// at or above the smallest level, fp8 at or above the smallest normal value; 0 too.
inline bool in_block_range(forge_state_format sf, bool is_signed, float v, float absmax) {
  const double floor = sf == FORGE_STATE_FP8_BLOCK64
                           ? (is_signed ? 0x1p-6 / 448 : 0x1p-14 / 57344)
                           : std::exp2((is_signed ? -126.0 : -254.0) / 8);
  return v == 0.0f || std::fabs(v) >= floor * absmax;
}

// Comparison within the per-format bands of gpu_tolerances.h.
::testing::AssertionResult close_enough(const HostParam& expected, const HostParam& actual,
                                        const forge_hparams& hp);

// A [T, cols] input with leading dimension ld, placed `offset` elements into its buffer
// (offset 1 makes a base pointer that is not 16-byte aligned). Elements of the padding
// (columns >= cols, and the offset) hold a NaN pattern: reading them poisons dW.
enum class Fill { kInteger, kNormal };
struct Operand {
  forge_dtype dtype = FORGE_DTYPE_BF16;
  int64_t tokens = 0, cols = 0, ld = 0, offset = 0;
  std::vector<uint8_t> bytes;
  size_t elem_bytes() const { return dtype == FORGE_DTYPE_FP32 ? 4 : 2; }
  const void* data() const { return bytes.data() + offset * elem_bytes(); }
  float get(int64_t t, int64_t c) const;
  void set(int64_t t, int64_t c, float v);
};
Operand make_operand(int64_t tokens, int64_t cols, forge_dtype dtype, int64_t ld, int64_t offset,
                     Fill fill, uint64_t seed);

struct StepOutputs {
  double grad_sq_sum = 0.0;
  int64_t nonfinite = 0;
};

// The argument structs of the two steps. x and dy (device or host pointers) hold xo's and
// dyo's elements; sq and nonfinite may be nullptr.
forge_wgrad_args wgrad_args(const void* x, const void* dy, const Operand& xo, const Operand& dyo,
                            const forge_hparams& hp, const forge_param& param, forge_device device,
                            double* sq, int64_t* nonfinite);
forge_elementwise_args elementwise_args(const void* grad, forge_dtype dtype, const forge_param& p,
                                        const forge_hparams& hp, forge_device device, double* sq,
                                        int64_t* nonfinite);

// One fused step through forge_wgrad_step: W [dy.cols, x.cols].
void wgrad_cpu(const Operand& x, const Operand& dy, const forge_hparams& hp, HostParam& p,
               StepOutputs* out);
void wgrad_gpu(const Operand& x, const Operand& dy, const forge_hparams& hp,
               const HostParam& shape, DeviceParam& p, StepOutputs* out,
               cudaStream_t stream = nullptr);

// The optimizer configurations the suites sweep (rule + the switches that change its code
// path), with their hyper-parameters and the first step number to run.
struct RuleCase {
  const char* name;
  forge_hparams hp;
};
const std::vector<RuleCase>& rule_cases();

const char* weight_format_name(forge_weight_format f);
const char* state_format_name(forge_state_format f);
const char* dtype_name(forge_dtype d);

}  // namespace fgt
