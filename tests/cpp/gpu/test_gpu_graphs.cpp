// test_gpu_graphs.cpp — the step's scalars read from device memory (forge_hparams.run_scalars)
// and steps captured into a CUDA graph. A step that takes its scalars from a buffer filled
// for step s must give the CPU backend's bits for step s, whatever step, lr and seed the call
// itself carried; a captured graph replayed with the buffer refilled between replays must
// give the bits of the same eager steps. Integer inputs, as test_gpu_wgrad.cpp's exact
// suite, so every sum is exact and the comparison is bit for bit.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <string>
#include <tuple>
#include <vector>

#include "gpu_test_util.h"

namespace fgt {
namespace {

// The call's own step, lr and seed: valid, and all different from the filled ones.
forge_hparams stale(const forge_hparams& hp, const void* run) {
  forge_hparams call = hp;
  call.step = 1;
  call.lr = hp.lr * 3;
  call.seed = hp.seed + 1;
  call.run_scalars = run;
  return call;
}

void fill_run_scalars(const forge_hparams& hp, DeviceBuffer& run, cudaStream_t stream) {
  std::vector<unsigned char> host(FORGE_RUN_SCALARS_BYTES);
  FORGE_OK(forge_run_scalars_fill(&hp, host.data(), FORGE_RUN_SCALARS_BYTES));
  CUDA_OK(cudaMemcpyAsync(run.data(), host.data(), host.size(), cudaMemcpyHostToDevice, stream));
  CUDA_OK(cudaStreamSynchronize(stream));
}

// Captures one forge_wgrad_step and one forge_elementwise_step on `stream` (both must accept)
// into *graph, instantiated into *exec.
void capture_steps(const forge_wgrad_args& w, const forge_elementwise_args& e,
                   cudaStream_t stream, cudaGraph_t* graph, cudaGraphExec_t* exec) {
  CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  const forge_status ws = forge_wgrad_step(&w);
  const forge_status es = forge_elementwise_step(&e);
  CUDA_OK(cudaStreamEndCapture(stream, graph));
  FORGE_OK(ws);
  FORGE_OK(es);
  CUDA_OK(cudaGraphInstantiate(exec, *graph, 0));
}

struct Shape {
  int64_t rows, cols, tokens;
};

// ---- every rule, the formats of the specialized kernels, bit for bit --------------------

using RunParam = std::tuple<int, forge_weight_format, forge_state_format>;
class WgradRunScalars : public ::testing::TestWithParam<RunParam> {};

TEST_P(WgradRunScalars, MatchesCpuBitForBit) {
  FORGE_REQUIRE_GPU();
  const auto [rule_index, wf, sf] = GetParam();
  forge_hparams hp = rule_cases()[rule_index].hp;
  DeviceBuffer run(FORGE_RUN_SCALARS_BYTES);
  // One tile-straddling shape (dY's rows not a multiple of 8: no TMA), the same with TMA
  // alignment (the Hopper kernels, the persistent one when forced), one through split-K (2
  // tiles, 35 k-tiles).
  for (const Shape& s : {Shape{129, 200, 67}, Shape{136, 200, 67}, Shape{96, 160, 1100}}) {
    SCOPED_TRACE(std::to_string(s.rows) + " x " + std::to_string(s.cols) + ", T " +
                 std::to_string(s.tokens));
    HostParam cpu = make_param(s.rows, s.cols, wf, sf, hp, 300 + rule_index);
    DeviceParam gpu;
    gpu.upload(cpu);
    for (int step = 0; step < 3; ++step, hp.step += 1) {
      const Operand x = make_operand(s.tokens, s.cols, FORGE_DTYPE_BF16, s.cols, 0,
                                     Fill::kInteger, 50 + 2 * step);
      const Operand dy = make_operand(s.tokens, s.rows, FORGE_DTYPE_BF16, s.rows, 0,
                                      Fill::kInteger, 51 + 2 * step);
      wgrad_cpu(x, dy, hp, cpu, nullptr);
      fill_run_scalars(hp, run, nullptr);
      wgrad_gpu(x, dy, stale(hp, run.data()), cpu, gpu, nullptr);
      ASSERT_TRUE(same_bits(cpu, gpu.download(cpu))) << "step " << hp.step;
    }
    EXPECT_TRUE(gpu.guards_intact());
  }
  EXPECT_TRUE(run.guards_intact());
}

// The specialized kernels' configurations (kernel_tables.cuh's FORGE_SPEC_LIST) for AdamW,
// Lion and SGD, and fp32 everything for every rule (the generic kernels).
std::vector<RunParam> run_params() {
  std::vector<RunParam> v;
  for (int i = 0; i < static_cast<int>(rule_cases().size()); ++i)
    v.emplace_back(i, FORGE_WEIGHT_FP32, FORGE_STATE_FP32);
  for (int i = 0; i < static_cast<int>(rule_cases().size()); ++i) {
    const int32_t rule = rule_cases()[i].hp.rule;  // a forge_rule value
    if (rule != FORGE_RULE_ADAMW && rule != FORGE_RULE_LION && rule != FORGE_RULE_SGD) continue;
    for (forge_weight_format wf :
         {FORGE_WEIGHT_BF16, FORGE_WEIGHT_BF16_STOCHASTIC, FORGE_WEIGHT_BF16_MASTER})
      for (forge_state_format sf :
           {FORGE_STATE_BF16, FORGE_STATE_BF16_STOCHASTIC, FORGE_STATE_INT8_BLOCK64,
            FORGE_STATE_FP8_BLOCK64, FORGE_STATE_INT4_BLOCK64})
        v.emplace_back(i, wf, sf);
  }
  return v;
}

INSTANTIATE_TEST_SUITE_P(
    Rules, WgradRunScalars, ::testing::ValuesIn(run_params()),
    [](const ::testing::TestParamInfo<RunParam>& info) {
      return std::string(rule_cases()[std::get<0>(info.param)].name) + "_" +
             weight_format_name(std::get<1>(info.param)) + "_" +
             state_format_name(std::get<2>(info.param));
    });

// ---- the element-wise step ---------------------------------------------------------------

TEST(ElementwiseRunScalars, MatchesCpuBitForBit) {
  FORGE_REQUIRE_GPU();
  DeviceBuffer run(FORGE_RUN_SCALARS_BYTES);
  for (int i = 0; i < static_cast<int>(rule_cases().size()); ++i) {
    forge_hparams hp = rule_cases()[i].hp;
    // 37 × 320: the flat, pipelined loop of the specialized kernels; 5 × 129: the other.
    for (const auto& [rows, cols] : {std::pair<int64_t, int64_t>{37, 320}, {5, 129}})
      for (forge_state_format sf :
           {FORGE_STATE_BF16_STOCHASTIC, FORGE_STATE_INT8_BLOCK64, FORGE_STATE_FP8_BLOCK64,
            FORGE_STATE_INT4_BLOCK64}) {
        SCOPED_TRACE(std::string(rule_cases()[i].name) + ", " + std::to_string(rows) + " x " +
                     std::to_string(cols) + ", " + state_format_name(sf));
        HostParam cpu = make_param(rows, cols, FORGE_WEIGHT_BF16_STOCHASTIC, sf, hp, 40 + i);
        DeviceParam gpu;
        gpu.upload(cpu);
        const Operand g = make_operand(rows, cols, FORGE_DTYPE_BF16, cols, 0, Fill::kNormal, 7);
        DeviceBuffer grad(g.bytes.size());
        grad.upload(g.bytes.data(), g.bytes.size());
        forge_elementwise_args a = elementwise_args(g.data(), FORGE_DTYPE_BF16, cpu.view(), hp,
                                                    cpu_device(), nullptr, nullptr);
        FORGE_OK(forge_elementwise_step(&a));
        fill_run_scalars(hp, run, nullptr);
        a = elementwise_args(grad.data(), FORGE_DTYPE_BF16, gpu.view(cpu), stale(hp, run.data()),
                             gpu_device(), nullptr, nullptr);
        FORGE_OK(forge_elementwise_step(&a));
        CUDA_OK(cudaDeviceSynchronize());
        ASSERT_TRUE(same_bits(cpu, gpu.download(cpu)));
        EXPECT_TRUE(gpu.guards_intact());
      }
  }
}

// ---- captured into a CUDA graph ----------------------------------------------------------

// A fused step and an element-wise step captured once, on a stream that never ran a step
// (the split-K shape's workspace is then made for the capture), and replayed for steps 1..4
// with the buffers refilled before each replay: the bits of the eager steps on the CPU.
TEST(CudaGraph, ReplaysWithRefilledScalarsMatchEagerSteps) {
  FORGE_REQUIRE_GPU();
  forge_hparams hp{};
  FORGE_OK(forge_hparams_default(FORGE_RULE_ADAMW, &hp));
  hp.lr = 0.01;
  hp.weight_decay = 0.1;
  hp.seed = 1234;
  for (const Shape& s : {Shape{256, 384, 96}, Shape{96, 160, 1100}})
    for (forge_state_format sf :
         {FORGE_STATE_BF16_STOCHASTIC, FORGE_STATE_INT8_BLOCK64, FORGE_STATE_FP8_BLOCK64,
          FORGE_STATE_INT4_BLOCK64}) {
      SCOPED_TRACE(std::to_string(s.rows) + " x " + std::to_string(s.cols) + ", " +
                   state_format_name(sf));
      cudaStream_t stream = nullptr;
      CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
      hp.step = 1;
      forge_hparams hp_e = hp;
      hp_e.seed = hp.seed + 1;
      HostParam cpu = make_param(s.rows, s.cols, FORGE_WEIGHT_BF16_STOCHASTIC, sf, hp, 77);
      HostParam cpu_e = make_param(3, 200, FORGE_WEIGHT_BF16_STOCHASTIC, sf, hp, 78);
      DeviceParam gpu, gpu_e;
      gpu.upload(cpu);
      gpu_e.upload(cpu_e);
      const Operand x = make_operand(s.tokens, s.cols, FORGE_DTYPE_BF16, s.cols, 0,
                                     Fill::kInteger, 5);
      const Operand dy = make_operand(s.tokens, s.rows, FORGE_DTYPE_BF16, s.rows, 0,
                                      Fill::kInteger, 6);
      const Operand g = make_operand(3, 200, FORGE_DTYPE_BF16, 200, 0, Fill::kNormal, 8);
      DeviceBuffer dx(x.bytes.size()), ddy(dy.bytes.size()), dg(g.bytes.size());
      dx.upload(x.bytes.data(), x.bytes.size());
      ddy.upload(dy.bytes.data(), dy.bytes.size());
      dg.upload(g.bytes.data(), g.bytes.size());
      DeviceBuffer run(FORGE_RUN_SCALARS_BYTES), run_e(FORGE_RUN_SCALARS_BYTES);

      forge_wgrad_args w = wgrad_args(dx.data(), ddy.data(), x, dy, stale(hp, run.data()),
                                      gpu.view(cpu), gpu_device(stream), nullptr, nullptr);
      forge_elementwise_args e =
          elementwise_args(dg.data(), FORGE_DTYPE_BF16, gpu_e.view(cpu_e),
                           stale(hp_e, run_e.data()), gpu_device(stream), nullptr, nullptr);
      // Captured once, with a step, lr and seed of the call that are never the right ones.
      cudaGraph_t graph = nullptr;
      cudaGraphExec_t exec = nullptr;
      capture_steps(w, e, stream, &graph, &exec);
      for (int64_t step = 1; step <= 4; ++step) {
        hp.step = hp_e.step = step;
        fill_run_scalars(hp, run, stream);
        fill_run_scalars(hp_e, run_e, stream);
        CUDA_OK(cudaGraphLaunch(exec, stream));
        CUDA_OK(cudaStreamSynchronize(stream));
        wgrad_cpu(x, dy, hp, cpu, nullptr);
        forge_elementwise_args ce = elementwise_args(g.data(), FORGE_DTYPE_BF16, cpu_e.view(),
                                                     hp_e, cpu_device(), nullptr, nullptr);
        FORGE_OK(forge_elementwise_step(&ce));
        ASSERT_TRUE(same_bits(cpu, gpu.download(cpu))) << "replay of step " << step;
        ASSERT_TRUE(same_bits(cpu_e, gpu_e.download(cpu_e))) << "replay of step " << step;
      }
      CUDA_OK(cudaGraphExecDestroy(exec));
      CUDA_OK(cudaGraphDestroy(graph));
      CUDA_OK(cudaStreamDestroy(stream));
      EXPECT_TRUE(gpu.guards_intact());
      EXPECT_TRUE(gpu_e.guards_intact());
    }
}

// A run_scalars buffer that does not match the captured steps (unfilled, filled for another
// rule, for other hyper-parameters, or changed since its fill) is refused by the kernels when
// the graph replays: they write nothing (weights, states, grad_sq_sum) and add rows · cols to
// nonfinite_count (forge.h, forge_hparams.run_scalars). A replay with a good buffer then goes on
// from the untouched parameter like the eager steps. The specialized kernels (with the Hopper
// ones where the shape suits TMA; scripts/gpu_check.sh also runs this with the persistent
// kernel forced), split-K, and the generic kernels.
TEST(CudaGraph, MismatchedRunScalarsWriteNothingAndAreCounted) {
  FORGE_REQUIRE_GPU();
  struct Config {
    Shape s;
    forge_weight_format wf;
    forge_state_format sf;
  };
  const Config configs[] = {
      {{256, 384, 96}, FORGE_WEIGHT_BF16_STOCHASTIC, FORGE_STATE_BF16_STOCHASTIC},
      {{256, 384, 96}, FORGE_WEIGHT_BF16, FORGE_STATE_INT8_BLOCK64},
      {{96, 160, 1100}, FORGE_WEIGHT_BF16_STOCHASTIC, FORGE_STATE_INT8_BLOCK64},
      {{256, 384, 96}, FORGE_WEIGHT_BF16_STOCHASTIC, FORGE_STATE_FP8_BLOCK64},
      {{129, 200, 67}, FORGE_WEIGHT_FP32, FORGE_STATE_FP32}};
  forge_hparams hp{};
  FORGE_OK(forge_hparams_default(FORGE_RULE_ADAMW, &hp));
  hp.lr = 0.01;
  hp.weight_decay = 0.1;
  hp.seed = 4321;
  enum Variant { kGood, kUnfilled, kOtherRule, kOtherHparams, kChanged };
  const Variant variants[] = {kGood, kUnfilled, kOtherRule, kGood, kOtherHparams, kChanged, kGood};
  // The bytes of a run_scalars buffer for the steps' hyper-parameters `h`, as `v` makes them.
  auto buffer_bytes = [](Variant v, const forge_hparams& h) {
    std::vector<unsigned char> b(FORGE_RUN_SCALARS_BYTES, 0);
    forge_hparams fill = h;
    if (v == kOtherRule) {
      FORGE_OK(forge_hparams_default(FORGE_RULE_NADAM, &fill));  // two states, like AdamW
      fill.step = h.step;
    }
    if (v == kOtherHparams) fill.beta2 = 0.95;
    if (v != kUnfilled) FORGE_OK(forge_run_scalars_fill(&fill, b.data(), FORGE_RUN_SCALARS_BYTES));
    if (v == kChanged) b[8] ^= 1;  // a byte of the scalars
    return b;
  };
  for (const Config& c : configs) {
    const Shape& s = c.s;
    SCOPED_TRACE(std::to_string(s.rows) + " x " + std::to_string(s.cols) + ", T " +
                 std::to_string(s.tokens) + ", " + weight_format_name(c.wf) + " " +
                 state_format_name(c.sf));
    cudaStream_t stream = nullptr;
    CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    forge_hparams h = hp, h_e = hp;
    h.step = h_e.step = 1;
    h_e.seed = hp.seed + 1;
    HostParam cpu = make_param(s.rows, s.cols, c.wf, c.sf, hp, 81);
    HostParam cpu_e = make_param(37, 320, c.wf, c.sf, hp, 82);
    DeviceParam gpu, gpu_e;
    gpu.upload(cpu);
    gpu_e.upload(cpu_e);
    const Operand x = make_operand(s.tokens, s.cols, FORGE_DTYPE_BF16, s.cols, 0, Fill::kInteger, 83);
    const Operand dy = make_operand(s.tokens, s.rows, FORGE_DTYPE_BF16, s.rows, 0, Fill::kInteger, 84);
    const Operand g = make_operand(37, 320, FORGE_DTYPE_BF16, 320, 0, Fill::kNormal, 85);
    DeviceBuffer dx(x.bytes.size()), ddy(dy.bytes.size()), dg(g.bytes.size());
    dx.upload(x.bytes.data(), x.bytes.size());
    ddy.upload(dy.bytes.data(), dy.bytes.size());
    dg.upload(g.bytes.data(), g.bytes.size());
    DeviceBuffer run(FORGE_RUN_SCALARS_BYTES), run_e(FORGE_RUN_SCALARS_BYTES), outputs(32);
    auto* out = static_cast<unsigned char*>(outputs.data());
    double* sq_w = reinterpret_cast<double*>(out);
    int64_t* nf_w = reinterpret_cast<int64_t*>(out + 8);
    double* sq_e = reinterpret_cast<double*>(out + 16);
    int64_t* nf_e = reinterpret_cast<int64_t*>(out + 24);
    forge_wgrad_args w = wgrad_args(dx.data(), ddy.data(), x, dy, stale(h, run.data()),
                                    gpu.view(cpu), gpu_device(stream), sq_w, nf_w);
    forge_elementwise_args e = elementwise_args(dg.data(), FORGE_DTYPE_BF16, gpu_e.view(cpu_e),
                                                stale(h_e, run_e.data()), gpu_device(stream),
                                                sq_e, nf_e);
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    capture_steps(w, e, stream, &graph, &exec);
    for (Variant v : variants) {
      SCOPED_TRACE("variant " + std::to_string(v) + ", step " + std::to_string(h.step));
      const std::vector<unsigned char> b = buffer_bytes(v, h), b_e = buffer_bytes(v, h_e);
      CUDA_OK(cudaMemcpyAsync(run.data(), b.data(), b.size(), cudaMemcpyHostToDevice, stream));
      CUDA_OK(cudaMemcpyAsync(run_e.data(), b_e.data(), b_e.size(), cudaMemcpyHostToDevice, stream));
      CUDA_OK(cudaMemsetAsync(outputs.data(), 0, 32, stream));
      CUDA_OK(cudaGraphLaunch(exec, stream));
      CUDA_OK(cudaStreamSynchronize(stream));
      double got_sq_w = -1, got_sq_e = -1;
      int64_t got_nf_w = -1, got_nf_e = -1;
      CUDA_OK(cudaMemcpy(&got_sq_w, sq_w, 8, cudaMemcpyDeviceToHost));
      CUDA_OK(cudaMemcpy(&got_nf_w, nf_w, 8, cudaMemcpyDeviceToHost));
      CUDA_OK(cudaMemcpy(&got_sq_e, sq_e, 8, cudaMemcpyDeviceToHost));
      CUDA_OK(cudaMemcpy(&got_nf_e, nf_e, 8, cudaMemcpyDeviceToHost));
      if (v == kGood) {
        StepOutputs want;
        wgrad_cpu(x, dy, h, cpu, &want);
        forge_elementwise_args ce = elementwise_args(g.data(), FORGE_DTYPE_BF16, cpu_e.view(), h_e,
                                                     cpu_device(), nullptr, nullptr);
        FORGE_OK(forge_elementwise_step(&ce));
        EXPECT_EQ(got_nf_w, want.nonfinite);
        EXPECT_EQ(got_nf_e, 0);
        EXPECT_GT(got_sq_w, 0.0);
        h.step += 1;
        h_e.step += 1;
      } else {
        EXPECT_EQ(got_nf_w, s.rows * s.cols) << "a refused replay counts every element skipped";
        EXPECT_EQ(got_nf_e, 37 * 320);
        EXPECT_EQ(got_sq_w, 0.0);
        EXPECT_EQ(got_sq_e, 0.0);
      }
      // refused: the parameters as the last good step left them
      ASSERT_TRUE(same_bits(cpu, gpu.download(cpu)));
      ASSERT_TRUE(same_bits(cpu_e, gpu_e.download(cpu_e)));
    }
    CUDA_OK(cudaGraphExecDestroy(exec));
    CUDA_OK(cudaGraphDestroy(graph));
    CUDA_OK(cudaStreamDestroy(stream));
    EXPECT_TRUE(gpu.guards_intact());
    EXPECT_TRUE(gpu_e.guards_intact());
    EXPECT_TRUE(run.guards_intact());
    EXPECT_TRUE(outputs.guards_intact());
  }
}

// A run_scalars buffer in host memory on a CUDA step: refused, naming the field.
TEST(RunScalarsErrors, HostMemoryOnACudaStepIsRefused) {
  FORGE_REQUIRE_GPU();
  forge_hparams hp{};
  FORGE_OK(forge_hparams_default(FORGE_RULE_ADAMW, &hp));
  alignas(16) static unsigned char host_run[FORGE_RUN_SCALARS_BYTES];
  FORGE_OK(forge_run_scalars_fill(&hp, host_run, sizeof(host_run)));
  HostParam cpu = make_param(4, 64, FORGE_WEIGHT_BF16, FORGE_STATE_BF16, hp, 3);
  DeviceParam gpu;
  gpu.upload(cpu);
  const Operand g = make_operand(4, 64, FORGE_DTYPE_BF16, 64, 0, Fill::kNormal, 4);
  DeviceBuffer grad(g.bytes.size());
  grad.upload(g.bytes.data(), g.bytes.size());
  forge_hparams call = hp;
  call.run_scalars = host_run;
  forge_elementwise_args a = elementwise_args(grad.data(), FORGE_DTYPE_BF16, gpu.view(cpu), call,
                                              gpu_device(), nullptr, nullptr);
  EXPECT_EQ(forge_elementwise_step(&a), FORGE_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(forge_last_error()).find("hparams.run_scalars"), std::string::npos)
      << forge_last_error();
  CUDA_OK(cudaDeviceSynchronize());
  EXPECT_TRUE(same_bits(cpu, gpu.download(cpu)));
}

}  // namespace
}  // namespace fgt
