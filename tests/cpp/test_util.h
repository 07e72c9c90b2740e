// test_util.h — building parameters, inputs and argument structs for the C++
// tests through the public C ABI only, plus random inputs from a fresh seed
// (printed on failure, so a failing draw can be replayed with FORGE_TEST_SEED).
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "core/formats.h"
#include "forge/forge.h"

namespace forge_test {

inline uint64_t fresh_seed() {
  if (const char* s = std::getenv("FORGE_TEST_SEED")) return std::strtoull(s, nullptr, 10);
  return std::random_device{}() * 0x100000001ull ^ std::random_device{}();
}

struct Rng {
  std::mt19937_64 gen;
  explicit Rng(uint64_t seed) : gen(seed) {}
  float normal(float sd = 1.0f) { return std::normal_distribution<float>(0.0f, sd)(gen); }
  float uniform(float lo, float hi) { return std::uniform_real_distribution<float>(lo, hi)(gen); }
  int integer(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(gen); }
};

inline size_t dtype_size(forge_dtype t) { return t == FORGE_DTYPE_FP32 ? 4 : 2; }

// A [rows, cols] matrix stored in `dtype` with leading dimension ld, from fp32 values.
struct Matrix {
  int64_t rows = 0, cols = 0, ld = 0;
  forge_dtype dtype = FORGE_DTYPE_FP32;
  std::vector<uint8_t> bytes;
  void set(int64_t r, int64_t c, float v) {
    uint8_t* p = bytes.data() + (r * ld + c) * dtype_size(dtype);
    if (dtype == FORGE_DTYPE_FP32) { std::memcpy(p, &v, 4); return; }
    uint16_t h = dtype == FORGE_DTYPE_BF16 ? forge::bf16_nearest(v) : to_fp16(v);
    std::memcpy(p, &h, 2);
  }
  float get(int64_t r, int64_t c) const {
    const uint8_t* p = bytes.data() + (r * ld + c) * dtype_size(dtype);
    if (dtype == FORGE_DTYPE_FP32) { float v; std::memcpy(&v, p, 4); return v; }
    uint16_t h; std::memcpy(&h, p, 2);
    return dtype == FORGE_DTYPE_BF16 ? forge::bf16_to_float(h) : forge::fp16_to_float(h);
  }
  static uint16_t to_fp16(float v) { return static_cast<uint16_t>(float_to_half_bits(v)); }
  static uint32_t float_to_half_bits(float v) {
    _Float16 h = static_cast<_Float16>(v);
    uint16_t b; std::memcpy(&b, &h, 2);
    return b;
  }
};

inline Matrix random_matrix(Rng& rng, int64_t rows, int64_t cols, int64_t ld, forge_dtype dtype,
                            float sd = 1.0f) {
  Matrix m{rows, cols, ld, dtype, std::vector<uint8_t>((rows - 1) * ld * dtype_size(dtype) + cols * dtype_size(dtype), 0xAB)};
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) m.set(r, c, rng.normal(sd));
  return m;
}

// A parameter (weight, master, states, absmax) in host memory, owning its buffers.
struct HostParam {
  forge_param p{};
  std::vector<uint8_t> weight, master;
  std::vector<uint8_t> state[FORGE_MAX_STATES];
  std::vector<uint8_t> absmax[FORGE_MAX_STATES];
  int num_states = 0;

  HostParam(int64_t rows, int64_t cols, forge_weight_format wf, forge_state_format sf,
            const forge_hparams& hp) {
    p.rows = rows;
    p.cols = cols;
    p.weight_format = wf;
    p.state_format = sf;
    forge_state_layout layout{};
    EXPECT_EQ(forge_state_layout_query(&hp, sf, rows, cols, &layout), FORGE_OK) << forge_last_error();
    num_states = layout.num_states;
    weight.assign(rows * cols * (wf == FORGE_WEIGHT_FP32 ? 4 : 2), 0);
    if (wf == FORGE_WEIGHT_BF16_MASTER) master.assign(rows * cols * 4, 0);
    for (int i = 0; i < num_states; ++i) {
      state[i].assign(layout.state_bytes[i], 0);
      absmax[i].assign(layout.absmax_count[i] * 4, 0);
    }
    relink();
  }
  HostParam(const HostParam& o) : p(o.p), weight(o.weight), master(o.master), num_states(o.num_states) {
    for (int i = 0; i < FORGE_MAX_STATES; ++i) { state[i] = o.state[i]; absmax[i] = o.absmax[i]; }
    relink();
  }
  HostParam& operator=(const HostParam&) = delete;

  void relink() {
    p.weight = weight.data();
    p.master = master.empty() ? nullptr : reinterpret_cast<float*>(master.data());
    for (int i = 0; i < FORGE_MAX_STATES; ++i) {
      p.state[i] = i < num_states ? state[i].data() : nullptr;
      p.state_absmax[i] = absmax[i].empty() ? nullptr : reinterpret_cast<float*>(absmax[i].data());
    }
  }
  int64_t size() const { return p.rows * p.cols; }
  float w(int64_t i) const {
    if (p.weight_format == FORGE_WEIGHT_FP32) { float v; std::memcpy(&v, weight.data() + 4 * i, 4); return v; }
    uint16_t h; std::memcpy(&h, weight.data() + 2 * i, 2);
    return forge::bf16_to_float(h);
  }
  void set_w(int64_t i, float v) {
    if (p.weight_format == FORGE_WEIGHT_FP32) { std::memcpy(weight.data() + 4 * i, &v, 4); return; }
    const uint16_t h = forge::bf16_nearest(v);
    std::memcpy(weight.data() + 2 * i, &h, 2);
    if (!master.empty()) { const float m = forge::bf16_to_float(h); std::memcpy(master.data() + 4 * i, &m, 4); }
  }
  // Random weights and (via the ABI) initial states.
  void randomize(Rng& rng, const forge_hparams& hp) {
    for (int64_t i = 0; i < size(); ++i) set_w(i, rng.normal(0.5f));
    forge_device cpu{};
    EXPECT_EQ(forge_state_init(&p, &hp, cpu), FORGE_OK) << forge_last_error();
  }
  std::vector<float> state_fp32(int i, const forge_hparams& hp) const {
    std::vector<float> out(size());
    forge_device cpu{};
    EXPECT_EQ(forge_state_to_fp32(&p, &hp, i, out.data(), cpu), FORGE_OK) << forge_last_error();
    return out;
  }
  // All bytes, for "bit-identical" and "nothing written" checks.
  std::vector<uint8_t> snapshot() const {
    std::vector<uint8_t> all(weight);
    all.insert(all.end(), master.begin(), master.end());
    for (int i = 0; i < FORGE_MAX_STATES; ++i) {
      all.insert(all.end(), state[i].begin(), state[i].end());
      all.insert(all.end(), absmax[i].begin(), absmax[i].end());
    }
    return all;
  }
};

inline forge_wgrad_args wgrad_args(const HostParam& hp_param, const forge_hparams& hp, const Matrix& x,
                                   const Matrix& dy) {
  forge_wgrad_args a{};
  a.abi_version = FORGE_ABI_VERSION;
  a.device.kind = FORGE_DEVICE_CPU;
  a.tokens = x.rows;
  a.x = x.bytes.data(); a.x_dtype = x.dtype; a.ldx = x.ld;
  a.dy = dy.bytes.data(); a.dy_dtype = dy.dtype; a.lddy = dy.ld;
  a.param = hp_param.p;
  a.hparams = hp;
  return a;
}

inline forge_elementwise_args elementwise_args(const HostParam& hp_param, const forge_hparams& hp,
                                               const std::vector<float>& grad) {
  forge_elementwise_args a{};
  a.abi_version = FORGE_ABI_VERSION;
  a.device.kind = FORGE_DEVICE_CPU;
  a.grad = grad.data();
  a.grad_dtype = FORGE_DTYPE_FP32;
  a.param = hp_param.p;
  a.hparams = hp;
  return a;
}

// dW = dYᵀX, each element summed over tokens in ascending order, one product
// rounded at a time (the order the fused step uses).
inline std::vector<float> reference_dw(const Matrix& x, const Matrix& dy) {
  const int64_t rows = dy.cols, cols = x.cols;
  std::vector<float> dw(rows * cols);
  for (int64_t o = 0; o < rows; ++o)
    for (int64_t i = 0; i < cols; ++i) {
      float acc = 0.0f;
      for (int64_t t = 0; t < x.rows; ++t) {
        const float prod = dy.get(t, o) * x.get(t, i);
        acc = acc + prod;
      }
      dw[o * cols + i] = acc;
    }
  return dw;
}

// Every rule configuration the tests sweep (name, hparams).
struct RuleCase {
  std::string name;
  forge_hparams hp;
};

inline std::vector<RuleCase> all_rule_cases() {
  std::vector<RuleCase> cases;
  // eps = 1e-3 (not the 1e-8 default) so that eps visibly shapes every update,
  // and a wrong eps term cannot hide under rounding.
  auto base = [](forge_rule r) {
    forge_hparams hp;
    forge_hparams_default(r, &hp);
    hp.eps = 1e-3;
    return hp;
  };
  forge_hparams hp;
  hp = base(FORGE_RULE_SGD); hp.lr = 0.05; hp.weight_decay = 0.01; cases.push_back({"SGD", hp});
  hp = base(FORGE_RULE_SGD_MOMENTUM); hp.lr = 0.05; hp.dampening = 0.1; cases.push_back({"SGDMomentum", hp});
  hp = base(FORGE_RULE_SGD_MOMENTUM); hp.lr = 0.05; hp.nesterov = 1; hp.weight_decay = 0.01; cases.push_back({"SGDNesterov", hp});
  hp = base(FORGE_RULE_ADAMW); hp.lr = 0.01; hp.weight_decay = 0.1; cases.push_back({"AdamW", hp});
  hp = base(FORGE_RULE_ADAMW); hp.lr = 0.01; hp.weight_decay = 0.1; hp.decoupled_weight_decay = 0; hp.maximize = 1; cases.push_back({"AdamCoupledMaximize", hp});
  hp = base(FORGE_RULE_NADAM); hp.lr = 0.01; hp.weight_decay = 0.1; cases.push_back({"NAdam", hp});
  hp = base(FORGE_RULE_NADAM); hp.lr = 0.01; hp.weight_decay = 0.1; hp.decoupled_weight_decay = 1; cases.push_back({"NAdamDecoupled", hp});
  hp = base(FORGE_RULE_RADAM); hp.lr = 0.01; hp.weight_decay = 0.1; cases.push_back({"RAdam", hp});
  hp = base(FORGE_RULE_RADAM); hp.lr = 0.01; hp.beta2 = 0.9; hp.decoupled_weight_decay = 1; hp.weight_decay = 0.1; cases.push_back({"RAdamRectified", hp});
  hp = base(FORGE_RULE_LION); hp.lr = 0.01; hp.weight_decay = 0.1; cases.push_back({"Lion", hp});
  hp = base(FORGE_RULE_RMSPROP); hp.lr = 0.01; hp.weight_decay = 0.01; cases.push_back({"RMSprop", hp});
  hp = base(FORGE_RULE_RMSPROP); hp.lr = 0.01; hp.centered = 1; hp.momentum = 0.9; cases.push_back({"RMSpropCenteredMomentum", hp});
  hp = base(FORGE_RULE_ADAGRAD); hp.lr = 0.05; hp.lr_decay = 0.01; hp.initial_accumulator_value = 0.1; hp.weight_decay = 0.01; cases.push_back({"Adagrad", hp});
  // Muon: lr and weight_decay set (Muon reads neither: a step that used them would show);
  // momentum >= 0.5 and < 0.5 take the two branches of each lerp (torch's weight rule).
  hp = base(FORGE_RULE_MUON); hp.lr = 0.02; hp.weight_decay = 0.1; cases.push_back({"MuonNesterov", hp});
  hp = base(FORGE_RULE_MUON); hp.lr = 0.02; hp.weight_decay = 0.1; hp.momentum = 0.9; hp.nesterov = 0; hp.maximize = 1; cases.push_back({"MuonPlainMaximize", hp});
  hp = base(FORGE_RULE_MUON); hp.lr = 0.02; hp.momentum = 0.3; cases.push_back({"MuonLowMomentumNesterov", hp});
  return cases;
}

inline const char* weight_format_name(int f) {
  static const char* k[] = {"WFp32", "WBf16", "WBf16SR", "WBf16Master"};
  return k[f];
}
inline const char* state_format_name(int f) {
  static const char* k[] = {"SFp32", "SBf16", "SBf16SR", "SInt8", "SFp8", "SInt4"};
  return k[f];
}

}  // namespace forge_test
