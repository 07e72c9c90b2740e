// test_gpu_errors.cpp — the CUDA backend's failure paths return codes and messages (never
// abort), leave outputs untouched, and leave the library usable; and its stream handling:
// a non-default stream, and two host threads stepping on two streams at once (each with
// its own split-K workspace), both correct.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "bad_input_cases.h"
#include "gpu_test_util.h"

namespace fgt {
namespace {

forge_wgrad_args step_args(const DeviceBuffer& x, const DeviceBuffer& dy, int64_t tokens,
                           int64_t rows, int64_t cols, const forge_param& p,
                           const forge_hparams& hp, forge_device device) {
  forge_wgrad_args a{};
  a.abi_version = FORGE_ABI_VERSION;
  a.device = device;
  a.tokens = tokens;
  a.x = x.data();
  a.x_dtype = FORGE_DTYPE_BF16;
  a.ldx = cols;
  a.dy = dy.data();
  a.dy_dtype = FORGE_DTYPE_BF16;
  a.lddy = rows;
  a.param = p;
  a.hparams = hp;
  return a;
}

forge_hparams adamw() {
  forge_hparams hp{};
  EXPECT_EQ(FORGE_OK, forge_hparams_default(FORGE_RULE_ADAMW, &hp));
  return hp;
}

// What the single-call tests below step: a [32, 64] bf16 AdamW parameter with `sf` states
// (make_param's values, `seed`) uploaded to the GPU, and bf16 X and dY of 16 tokens.
struct SmallStep {
  static constexpr int64_t rows = 32, cols = 64, tokens = 16;
  forge_hparams hp = adamw();
  HostParam host;
  DeviceParam gpu;
  DeviceBuffer x{tokens * cols * 2}, dy{tokens * rows * 2};
  SmallStep(forge_state_format sf, uint64_t seed)
      : host(make_param(rows, cols, FORGE_WEIGHT_BF16, sf, hp, seed)) {
    gpu.upload(host);
    x.fill(0x3F);
    dy.fill(0x3F);
  }
  forge_wgrad_args args(forge_device device) const {
    return step_args(x, dy, tokens, rows, cols, gpu.view(host), hp, device);
  }
};

TEST(GpuErrors, BadDeviceIndexIsAnErrorNotAnAbort) {
  FORGE_REQUIRE_GPU();
  SmallStep s(FORGE_STATE_BF16, 1);
  const forge_hparams& hp = s.hp;
  const HostParam& host = s.host;
  const DeviceParam& gpu = s.gpu;
  int count = 0;
  CUDA_OK(cudaGetDeviceCount(&count));

  forge_device bad = gpu_device();
  bad.index = count + 7;
  forge_wgrad_args a = s.args(bad);
  EXPECT_EQ(FORGE_ERR_DEVICE, forge_wgrad_step(&a));
  EXPECT_NE(std::string(forge_last_error()).find("cudaSetDevice"), std::string::npos)
      << forge_last_error();
  forge_param p = gpu.view(host);
  EXPECT_EQ(FORGE_ERR_DEVICE, forge_state_init(&p, &hp, bad));

  // Nothing was written, and the next call on a good device works.
  EXPECT_TRUE(same_bits(host, gpu.download(host)));
  a.device = gpu_device();
  EXPECT_EQ(FORGE_OK, forge_wgrad_step(&a)) << forge_last_error();
  CUDA_OK(cudaDeviceSynchronize());
  EXPECT_EQ(cudaSuccess, cudaGetLastError());
  int current = -1;
  CUDA_OK(cudaGetDevice(&current));
  EXPECT_EQ(0, current);
}

TEST(GpuErrors, InvalidArgumentsOnACudaDeviceWriteNothing) {
  FORGE_REQUIRE_GPU();
  SmallStep s(FORGE_STATE_INT8_BLOCK64, 2);
  forge_wgrad_args a = s.args(gpu_device());
  a.x = nullptr;
  EXPECT_EQ(FORGE_ERR_INVALID_ARGUMENT, forge_wgrad_step(&a));
  a = s.args(gpu_device());
  a.ldx = s.cols - 1;
  EXPECT_EQ(FORGE_ERR_INVALID_ARGUMENT, forge_wgrad_step(&a));
  a = s.args(gpu_device());
  a.param.state_absmax[1] = nullptr;
  EXPECT_EQ(FORGE_ERR_INVALID_ARGUMENT, forge_wgrad_step(&a));
  a = s.args(gpu_device());
  a.device.index = -1;
  EXPECT_EQ(FORGE_ERR_INVALID_ARGUMENT, forge_wgrad_step(&a));
  CUDA_OK(cudaDeviceSynchronize());
  EXPECT_TRUE(same_bits(s.host, s.gpu.download(s.host)));
  EXPECT_TRUE(s.gpu.guards_intact());
}

// The CPU suite's invalid fused calls (tests/cpp/bad_input_cases.h) on a CUDA device: the same
// status and message, and nothing written: the parameter, the outputs (set beforehand to values
// a step would never leave there) and every guard band unchanged.
TEST(GpuErrors, BadInputCasesOnACudaDeviceWriteNothing) {
  FORGE_REQUIRE_GPU();
  forge_hparams hp{};
  FORGE_OK(forge_hparams_default(FORGE_RULE_ADAMW, &hp));
  const int64_t rows = 9, cols = 70, tokens = 5;
  HostParam host = make_param(rows, cols, FORGE_WEIGHT_BF16, FORGE_STATE_INT8_BLOCK64, hp, 5);
  DeviceParam gpu;
  gpu.upload(host);
  const Operand xo = make_operand(tokens, cols, FORGE_DTYPE_BF16, cols, 0, Fill::kInteger, 6);
  const Operand dyo = make_operand(tokens, rows, FORGE_DTYPE_BF16, rows, 0, Fill::kInteger, 7);
  DeviceBuffer x(xo.bytes.size()), dy(dyo.bytes.size()), outputs(16);
  x.upload(xo.bytes.data(), xo.bytes.size());
  dy.upload(dyo.bytes.data(), dyo.bytes.size());
  const double poison_sq = 1.5;
  const int64_t poison_count = 7;
  int ran = 0;
  for (const forge_test::BadCase& bc : forge_test::wgrad_cases()) {
    if (bc.cpu_only) continue;
    SCOPED_TRACE(bc.name);
    outputs.upload(&poison_sq, 8);
    CUDA_OK(cudaMemcpy(static_cast<uint8_t*>(outputs.data()) + 8, &poison_count, 8,
                       cudaMemcpyHostToDevice));
    auto* sq = static_cast<double*>(outputs.data());
    auto* count = reinterpret_cast<int64_t*>(static_cast<uint8_t*>(outputs.data()) + 8);
    forge_wgrad_args a = wgrad_args(x.data(), dy.data(), xo, dyo, hp, gpu.view(host),
                                    gpu_device(), sq, count);
    bc.mutate(a);
    EXPECT_EQ(forge_wgrad_step(&a), bc.code);
    EXPECT_NE(std::string(forge_last_error()).find(bc.message_part), std::string::npos)
        << "message: " << forge_last_error();
    CUDA_OK(cudaDeviceSynchronize());
    ASSERT_TRUE(same_bits(host, gpu.download(host)));
    double got_sq = 0;
    int64_t got_count = 0;
    CUDA_OK(cudaMemcpy(&got_sq, sq, 8, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(&got_count, count, 8, cudaMemcpyDeviceToHost));
    EXPECT_EQ(got_sq, poison_sq);
    EXPECT_EQ(got_count, poison_count);
    ++ran;
  }
  EXPECT_GT(ran, 50);
  EXPECT_TRUE(gpu.guards_intact());
  EXPECT_TRUE(x.guards_intact());
  EXPECT_TRUE(dy.guards_intact());
  EXPECT_TRUE(outputs.guards_intact());
  // The library is still usable: the valid call runs.
  forge_wgrad_args a = wgrad_args(x.data(), dy.data(), xo, dyo, hp, gpu.view(host), gpu_device(),
                                  nullptr, nullptr);
  EXPECT_EQ(forge_wgrad_step(&a), FORGE_OK) << forge_last_error();
  CUDA_OK(cudaDeviceSynchronize());
}

// The element-wise step's and the state entry points' own invalid arguments on a CUDA device.
TEST(GpuErrors, ElementwiseAndStateBadInputOnACudaDeviceWriteNothing) {
  FORGE_REQUIRE_GPU();
  forge_hparams hp{};
  FORGE_OK(forge_hparams_default(FORGE_RULE_ADAMW, &hp));
  const int64_t rows = 3, cols = 70;
  HostParam host = make_param(rows, cols, FORGE_WEIGHT_FP32, FORGE_STATE_INT8_BLOCK64, hp, 8);
  DeviceParam gpu;
  gpu.upload(host);
  DeviceBuffer grad(rows * cols * 4), buffer(rows * cols * 4);
  grad.fill(0);
  buffer.fill(0x3E);  // 0.18...: a valid state value everywhere
  forge_elementwise_args a = elementwise_args(grad.data(), FORGE_DTYPE_FP32, gpu.view(host), hp,
                                              gpu_device(), nullptr, nullptr);
  a.grad = nullptr;
  EXPECT_EQ(forge_elementwise_step(&a), FORGE_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(forge_last_error()).find("grad: NULL"), std::string::npos);
  a.grad = grad.data();
  a.grad_dtype = 5;
  EXPECT_EQ(forge_elementwise_step(&a), FORGE_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(forge_last_error()).find("grad_dtype"), std::string::npos);
  a.grad_dtype = FORGE_DTYPE_FP32;
  a.grad = gpu.view(host).weight;  // written by the step
  EXPECT_EQ(forge_elementwise_step(&a), FORGE_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(forge_last_error()).find("grad"), std::string::npos);
  a.grad = grad.data();
  a.param.col_offset = 32;
  a.param.full_cols = 200;
  EXPECT_EQ(forge_elementwise_step(&a), FORGE_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(forge_last_error()).find("param.col_offset"), std::string::npos);
  forge_param p = gpu.view(host);
  EXPECT_EQ(forge_state_to_fp32(&p, &hp, 2, static_cast<float*>(buffer.data()), gpu_device()),
            FORGE_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(forge_last_error()).find("index"), std::string::npos);
  EXPECT_EQ(forge_state_from_fp32(&p, &hp, 0, nullptr, gpu_device()), FORGE_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(forge_last_error()).find("in: NULL"), std::string::npos);
  forge_param q = p;
  q.state_absmax[1] = nullptr;
  EXPECT_EQ(forge_state_init(&q, &hp, gpu_device()), FORGE_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(forge_last_error()).find("param.state_absmax[1]"), std::string::npos);
  CUDA_OK(cudaDeviceSynchronize());
  EXPECT_TRUE(same_bits(host, gpu.download(host)));
  EXPECT_TRUE(gpu.guards_intact());
  EXPECT_TRUE(buffer.guards_intact());
}

// Two host threads, two streams, split-K shapes (one workspace per stream), at once.
TEST(GpuStreams, ConcurrentStreamsMatchCpu) {
  FORGE_REQUIRE_GPU();
  forge_hparams hp{};
  FORGE_OK(forge_hparams_default(FORGE_RULE_ADAMW, &hp));
  constexpr int kThreads = 2;
  const int64_t rows = 64, cols = 192, tokens = 6000;
  std::vector<HostParam> cpu;
  std::vector<DeviceParam> gpu(kThreads);
  std::vector<Operand> xs, dys;
  for (int t = 0; t < kThreads; ++t) {
    cpu.push_back(make_param(rows, cols, FORGE_WEIGHT_BF16_MASTER, FORGE_STATE_INT8_BLOCK64, hp, 40 + t));
    gpu[t].upload(cpu[t]);
    xs.push_back(make_operand(tokens, cols, FORGE_DTYPE_BF16, cols, 0, Fill::kInteger, 60 + t));
    dys.push_back(make_operand(tokens, rows, FORGE_DTYPE_BF16, rows, 0, Fill::kInteger, 70 + t));
  }
  std::vector<std::string> errors(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      try {
        cudaStream_t stream = nullptr;
        CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
        forge_hparams h = hp;
        for (int step = 0; step < 4; ++step) {
          wgrad_gpu(xs[t], dys[t], h, cpu[t], gpu[t], nullptr, stream);
          h.step += 1;
        }
        CUDA_OK(cudaStreamDestroy(stream));
      } catch (const std::exception& e) {
        errors[t] = e.what();
      }
    });
  }
  for (auto& th : threads) th.join();
  for (int t = 0; t < kThreads; ++t) {
    ASSERT_TRUE(errors[t].empty()) << errors[t];
    forge_hparams h = hp;
    for (int step = 0; step < 4; ++step) {
      wgrad_cpu(xs[t], dys[t], h, cpu[t], nullptr);
      h.step += 1;
    }
    EXPECT_TRUE(same_bits(cpu[t], gpu[t].download(cpu[t]))) << "thread " << t;
  }
}

}  // namespace
}  // namespace fgt
