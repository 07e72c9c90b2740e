// test_gpu_memory.cpp — the fused step never allocates anything gradient-sized.
//
// Two measurements on a large layer (8192 × 8192, T = 2048; its gradient would be 256 MiB
// in fp32, 128 MiB in bf16):
//  1. What a step keeps: free device memory before and after the step differs by at most
//     the split-K workspace bound (SMs × 128 × 128 × 4 B + counters) plus page rounding.
//  2. What a step needs at its peak: the rest of the device memory is taken (cudaMalloc)
//     until only that bound plus 32 MiB is free, and the step must still succeed — a
//     gradient-sized allocation inside it would fail. This also catches an allocate-and-
//     free inside the step, which a before/after difference cannot see.
// Runs alone (RUN_SERIAL): it fills the device.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

#include "gpu_test_util.h"
#include "gpu_tolerances.h"

namespace fgt {
namespace {

constexpr int64_t kRows = 8192, kCols = 8192, kTokens = 2048;

struct Layer {
  HostParam shape;
  DeviceParam param;
  DeviceBuffer x, dy;
};

// A bf16 layer with AdamW bf16 states; inputs are bytes 0x3C3C (bf16 0.0115) everywhere.
void make_layer(Layer* l, int64_t rows, int64_t cols, int64_t tokens, const forge_hparams& hp) {
  l->shape = HostParam{};
  l->shape.rows = rows;
  l->shape.cols = cols;
  l->shape.weight_format = FORGE_WEIGHT_BF16;
  l->shape.state_format = FORGE_STATE_BF16;
  FORGE_OK(forge_state_layout_query(&hp, FORGE_STATE_BF16, rows, cols, &l->shape.layout));
  l->param.weight.allocate(static_cast<size_t>(rows * cols) * 2);
  l->param.weight.fill(0x3C);
  for (int i = 0; i < l->shape.layout.num_states; ++i) {
    l->param.state[i].allocate(static_cast<size_t>(l->shape.layout.state_bytes[i]));
    l->param.state[i].fill(0);
  }
  l->x.allocate(static_cast<size_t>(tokens * cols) * 2);
  l->dy.allocate(static_cast<size_t>(tokens * rows) * 2);
  l->x.fill(0x3C);
  l->dy.fill(0x3C);
}

forge_status step(Layer& l, int64_t tokens, const forge_hparams& hp, cudaStream_t stream) {
  forge_wgrad_args a{};
  a.abi_version = FORGE_ABI_VERSION;
  a.device = gpu_device(stream);
  a.tokens = tokens;
  a.x = l.x.data();
  a.x_dtype = FORGE_DTYPE_BF16;
  a.ldx = l.shape.cols;
  a.dy = l.dy.data();
  a.dy_dtype = FORGE_DTYPE_BF16;
  a.lddy = l.shape.rows;
  a.param = l.param.view(l.shape);
  a.hparams = hp;
  return forge_wgrad_step(&a);
}

size_t free_bytes() {
  size_t free = 0, total = 0;
  CUDA_OK(cudaMemGetInfo(&free, &total));
  return free;
}

TEST(GpuMemory, StepAllocatesNothingGradientSized) {
  FORGE_REQUIRE_GPU();
  forge_hparams hp{};
  FORGE_OK(forge_hparams_default(FORGE_RULE_ADAMW, &hp));
  int sms = 0;
  CUDA_OK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const size_t workspace_bound = static_cast<size_t>(sms) * (128 * 128 * 4 + 4);
  const size_t bound = workspace_bound + kAllocationSlackBytes;
  const size_t gradient_bytes = static_cast<size_t>(kRows * kCols) * 2;  // even in bf16

  Layer big, small;
  make_layer(&big, kRows, kCols, kTokens, hp);
  make_layer(&small, 64, 64, 8192, hp);  // 1 tile, 256 k-tiles: split-K
  cudaStream_t s1 = nullptr, s2 = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
  CUDA_OK(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
  // Warm-up on the default stream: loads the kernels, creates that stream's workspace.
  ASSERT_EQ(FORGE_OK, step(small, 8192, hp, nullptr)) << forge_last_error();
  ASSERT_EQ(FORGE_OK, step(big, kTokens, hp, nullptr)) << forge_last_error();
  CUDA_OK(cudaDeviceSynchronize());

  // 1. Kept: the large step keeps nothing, a first split-K step on a new stream keeps at
  //    most its workspace.
  size_t before = free_bytes();
  ASSERT_EQ(FORGE_OK, step(big, kTokens, hp, s1)) << forge_last_error();
  CUDA_OK(cudaStreamSynchronize(s1));
  size_t after = free_bytes();
  EXPECT_LE(before - std::min(before, after), kAllocationSlackBytes) << "large step kept memory";
  before = free_bytes();
  ASSERT_EQ(FORGE_OK, step(small, 8192, hp, s1)) << forge_last_error();
  CUDA_OK(cudaStreamSynchronize(s1));
  after = free_bytes();
  EXPECT_LE(before - std::min(before, after), bound) << "split-K workspace above its bound";

  // 2. Peak: leave only bound + 32 MiB free (far below one gradient), then step.
  const size_t headroom = bound + (size_t(32) << 20);
  ASSERT_LT(headroom, gradient_bytes);
  std::vector<void*> hog;
  for (size_t chunk : {size_t(1) << 30, size_t(64) << 20, size_t(2) << 20}) {
    while (free_bytes() > headroom + chunk) {
      void* p = nullptr;
      if (cudaMalloc(&p, chunk) != cudaSuccess) {
        (void)cudaGetLastError();
        break;
      }
      hog.push_back(p);
    }
  }
  const size_t left = free_bytes();
  const forge_status big_status = step(big, kTokens, hp, s2);
  const cudaError_t big_sync = cudaStreamSynchronize(s2);
  // A split-K step on a stream without a workspace yet: it must fit its bound.
  const forge_status small_status = step(small, 8192, hp, s2);
  const cudaError_t small_sync = cudaStreamSynchronize(s2);
  for (void* p : hog) (void)cudaFree(p);
  (void)cudaGetLastError();
  EXPECT_LT(left, gradient_bytes) << "could not fill the device: the test proves nothing";
  EXPECT_EQ(FORGE_OK, big_status) << forge_last_error();
  EXPECT_EQ(cudaSuccess, big_sync);
  EXPECT_EQ(FORGE_OK, small_status) << forge_last_error();
  EXPECT_EQ(cudaSuccess, small_sync);
  RecordProperty("free_bytes_during_step", static_cast<int64_t>(left));
  RecordProperty("workspace_bound_bytes", static_cast<int64_t>(workspace_bound));
  CUDA_OK(cudaStreamDestroy(s1));
  CUDA_OK(cudaStreamDestroy(s2));
}

}  // namespace
}  // namespace fgt
