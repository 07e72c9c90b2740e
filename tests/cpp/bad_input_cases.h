// bad_input_cases.h — the invalid forge_wgrad_step calls of the bad-input suite, each one
// corruption of a valid call, with the status and the part of the message it must give. The
// valid call is an AdamW step of a [9, 70] parameter (bf16 weight, int8 states) on 5 tokens of
// bf16 X (ld 70) and dY (ld 9), both outputs set. test_bad_input.cpp runs them on the CPU
// device, tests/cpp/gpu/test_gpu_errors.cpp on a CUDA device (cpu_only cases left out).
#pragma once

#include <cmath>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "forge/forge.h"

namespace forge_test {

struct BadCase {
  std::string name;
  std::function<void(forge_wgrad_args&)> mutate;
  forge_status code;
  std::string message_part;
  bool cpu_only = false;  // about the CPU device (its thread count): not a CUDA step's
};

inline std::vector<BadCase> wgrad_cases() {
  const forge_status bad = FORGE_ERR_INVALID_ARGUMENT;
  std::vector<BadCase> c = {
      {"abi", [](forge_wgrad_args& a) { a.abi_version = 99; }, bad, "args.abi_version"},
      {"x_null", [](forge_wgrad_args& a) { a.x = nullptr; }, bad, "x: NULL"},
      {"dy_null", [](forge_wgrad_args& a) { a.dy = nullptr; }, bad, "dy: NULL"},
      {"weight_null", [](forge_wgrad_args& a) { a.param.weight = nullptr; }, bad, "param.weight"},
      {"state_null", [](forge_wgrad_args& a) { a.param.state[1] = nullptr; }, bad, "param.state[1]"},
      {"absmax_null", [](forge_wgrad_args& a) { a.param.state_absmax[0] = nullptr; }, bad, "param.state_absmax[0]"},
      {"rows_zero", [](forge_wgrad_args& a) { a.param.rows = 0; }, bad, "param.rows"},
      {"cols_negative", [](forge_wgrad_args& a) { a.param.cols = -3; }, bad, "param.cols"},
      {"tokens_zero", [](forge_wgrad_args& a) { a.tokens = 0; }, bad, "tokens"},
      {"ldx_short", [](forge_wgrad_args& a) { a.ldx = a.param.cols - 1; }, bad, "ldx"},
      {"lddy_short", [](forge_wgrad_args& a) { a.lddy = a.param.rows - 1; }, bad, "lddy"},
      {"x_dtype", [](forge_wgrad_args& a) { a.x_dtype = static_cast<forge_dtype>(9); }, bad, "x_dtype"},
      {"dy_dtype", [](forge_wgrad_args& a) { a.dy_dtype = static_cast<forge_dtype>(-1); }, bad, "dy_dtype"},
      {"rule", [](forge_wgrad_args& a) { a.hparams.rule = static_cast<forge_rule>(FORGE_RULE_COUNT); }, bad, "hparams.rule"},
      {"weight_format", [](forge_wgrad_args& a) { a.param.weight_format = static_cast<forge_weight_format>(4); }, bad, "param.weight_format"},
      {"state_format", [](forge_wgrad_args& a) { a.param.state_format = static_cast<forge_state_format>(FORGE_STATE_FORMAT_COUNT); }, bad, "param.state_format"},
      {"master_missing", [](forge_wgrad_args& a) { a.param.weight_format = FORGE_WEIGHT_BF16_MASTER; }, bad, "param.master"},
      {"hparams_abi", [](forge_wgrad_args& a) { a.hparams.abi_version = 0; }, bad, "hparams.abi_version"},
      {"lr_negative", [](forge_wgrad_args& a) { a.hparams.lr = -1e-3; }, bad, "hparams.lr"},
      {"lr_nan", [](forge_wgrad_args& a) { a.hparams.lr = NAN; }, bad, "hparams.lr"},
      {"beta1_one", [](forge_wgrad_args& a) { a.hparams.beta1 = 1.0; }, bad, "hparams.beta1"},
      {"beta2_negative", [](forge_wgrad_args& a) { a.hparams.beta2 = -0.1; }, bad, "hparams.beta2"},
      {"eps_zero", [](forge_wgrad_args& a) { a.hparams.eps = 0; }, bad, "hparams.eps"},
      {"weight_decay_negative", [](forge_wgrad_args& a) { a.hparams.weight_decay = -0.1; }, bad, "hparams.weight_decay"},
      {"step_zero", [](forge_wgrad_args& a) { a.hparams.step = 0; }, bad, "hparams.step"},
      {"grad_scale_zero", [](forge_wgrad_args& a) { a.hparams.grad_scale = 0; }, bad, "hparams.grad_scale"},
      {"sgd_momentum", [](forge_wgrad_args& a) { a.hparams.rule = FORGE_RULE_SGD; a.hparams.momentum = 0.9; }, bad, "hparams.momentum"},
      {"sgdm_zero_momentum", [](forge_wgrad_args& a) { a.hparams.rule = FORGE_RULE_SGD_MOMENTUM; a.hparams.momentum = 0; }, bad, "hparams.momentum"},
      {"nesterov_dampening", [](forge_wgrad_args& a) { a.hparams.rule = FORGE_RULE_SGD_MOMENTUM; a.hparams.momentum = 0.9; a.hparams.nesterov = 1; a.hparams.dampening = 0.5; }, bad, "hparams.nesterov"},
      {"rmsprop_alpha", [](forge_wgrad_args& a) { a.hparams.rule = FORGE_RULE_RMSPROP; a.hparams.alpha = 1.0; }, bad, "hparams.alpha"},
      {"adagrad_lr_decay", [](forge_wgrad_args& a) { a.hparams.rule = FORGE_RULE_ADAGRAD; a.hparams.lr_decay = -1; }, bad, "hparams.lr_decay"},
      {"muon_momentum_above_one", [](forge_wgrad_args& a) { a.hparams.rule = FORGE_RULE_MUON; a.hparams.momentum = 1.5; }, bad, "hparams.momentum"},
      {"muon_momentum_negative", [](forge_wgrad_args& a) { a.hparams.rule = FORGE_RULE_MUON; a.hparams.momentum = -0.05; }, bad, "hparams.momentum"},
      {"muon_momentum_nan", [](forge_wgrad_args& a) { a.hparams.rule = FORGE_RULE_MUON; a.hparams.momentum = NAN; }, bad, "hparams.momentum"},
      {"nadam_momentum_decay", [](forge_wgrad_args& a) { a.hparams.rule = FORGE_RULE_NADAM; a.hparams.momentum_decay = NAN; }, bad, "hparams.momentum_decay"},
      {"nadam_mu_product", [](forge_wgrad_args& a) { a.hparams.rule = FORGE_RULE_NADAM; a.hparams.mu_product = 1.0; }, bad, "hparams.mu_product"},
      // accepted in double, but the fp32 scalars the step computes with would not be finite
      // (or would be zero where a zero is invalid)
      {"lr_overflows_fp32", [](forge_wgrad_args& a) { a.hparams.lr = 1e39; }, bad, "hparams.lr"},
      {"sgd_lr_overflows_fp32", [](forge_wgrad_args& a) { a.hparams.rule = FORGE_RULE_SGD; a.hparams.lr = 1e39; }, bad, "hparams.lr"},
      {"lr_over_bias_correction_overflows", [](forge_wgrad_args& a) { a.hparams.lr = 1e38; a.hparams.beta1 = 0.99; }, bad, "hparams.lr"},
      {"eps_zero_in_fp32", [](forge_wgrad_args& a) { a.hparams.eps = 1e-50; }, bad, "hparams.eps"},
      {"grad_scale_zero_in_fp32", [](forge_wgrad_args& a) { a.hparams.grad_scale = 1e-50; }, bad, "hparams.grad_scale"},
      {"grad_scale_overflows_fp32", [](forge_wgrad_args& a) { a.hparams.grad_scale = 1e39; }, bad, "hparams.grad_scale"},
      {"decay_overflows_fp32", [](forge_wgrad_args& a) { a.hparams.lr = 1e30; a.hparams.weight_decay = 1e30; }, bad, "hparams.weight_decay"},
      {"coupled_decay_overflows_fp32", [](forge_wgrad_args& a) { a.hparams.rule = FORGE_RULE_RMSPROP; a.hparams.weight_decay = 1e39; }, bad, "hparams.weight_decay"},
      {"nadam_lr_overflows_fp32", [](forge_wgrad_args& a) { a.hparams.rule = FORGE_RULE_NADAM; a.hparams.lr = 1e39; }, bad, "hparams.lr"},
      {"adagrad_accumulator_overflows_fp32", [](forge_wgrad_args& a) { a.hparams.rule = FORGE_RULE_ADAGRAD; a.hparams.initial_accumulator_value = 1e39; }, bad, "hparams.initial_accumulator_value"},
      // storable in fp32 but not in bf16: a bf16 state would hold an infinity
      {"adagrad_accumulator_above_bf16", [](forge_wgrad_args& a) { a.hparams.rule = FORGE_RULE_ADAGRAD; a.hparams.initial_accumulator_value = 3.39e38; }, bad, "hparams.initial_accumulator_value"},
      {"nadam_mu_product_above_its_factor", [](forge_wgrad_args& a) { a.hparams.rule = FORGE_RULE_NADAM; a.hparams.mu_product = 0.9999999; }, bad, "hparams.mu_product"},
      {"unread_field_nan", [](forge_wgrad_args& a) { a.hparams.alpha = NAN; }, bad, "hparams.alpha"},
      {"int8_tile_cols", [](forge_wgrad_args& a) { a.tile_cols = 96; }, bad, "tile_cols"},
      {"tile_negative", [](forge_wgrad_args& a) { a.tile_rows = -1; }, bad, "tile_rows"},
      {"num_threads_above_cap", [](forge_wgrad_args& a) { a.device.num_threads = FORGE_MAX_CPU_THREADS + 1; }, bad, "device.num_threads", true},
      {"num_threads_int32_max", [](forge_wgrad_args& a) { a.device.num_threads = INT32_MAX; }, bad, "device.num_threads", true},
      {"tile_rows_above_cap", [](forge_wgrad_args& a) { a.tile_rows = FORGE_MAX_TILE + 1; }, bad, "tile_rows"},
      {"tile_cols_huge", [](forge_wgrad_args& a) { a.tile_cols = 1 << 30; }, bad, "tile_cols"},
      // sizes whose element or byte counts overflow int64
      {"rows_times_cols_overflows", [](forge_wgrad_args& a) { a.param.rows = int64_t(1) << 40; a.param.cols = int64_t(1) << 40; a.lddy = a.param.rows; a.ldx = a.param.cols; }, bad, "param.rows"},
      {"state_bytes_overflow", [](forge_wgrad_args& a) { a.param.rows = int64_t(1) << 31; a.param.cols = int64_t(1) << 31; a.lddy = a.param.rows; a.ldx = a.param.cols; }, bad, "param.rows"},
      {"ldx_times_tokens_overflows", [](forge_wgrad_args& a) { a.tokens = int64_t(1) << 40; a.ldx = int64_t(1) << 40; }, bad, "ldx"},
      {"lddy_times_tokens_overflows", [](forge_wgrad_args& a) { a.tokens = int64_t(1) << 33; a.lddy = int64_t(1) << 31; }, bad, "lddy"},
      {"x_wraps_the_address_space", [](forge_wgrad_args& a) { a.x = reinterpret_cast<const void*>(~uintptr_t(0) - 63); }, bad, "x"},
      {"device_kind", [](forge_wgrad_args& a) { a.device.kind = static_cast<forge_device_kind>(7); }, bad, "device.kind"},
      {"num_threads", [](forge_wgrad_args& a) { a.device.num_threads = -2; }, bad, "device.num_threads", true},
      // shard placements (forge_param's row_offset, col_offset, full_cols)
      {"shard_row_offset_negative", [](forge_wgrad_args& a) { a.param.row_offset = -1; a.param.full_cols = 70; }, bad, "param.row_offset"},
      {"shard_col_offset_negative", [](forge_wgrad_args& a) { a.param.col_offset = -64; a.param.full_cols = 200; }, bad, "param.col_offset"},
      {"shard_full_cols_negative", [](forge_wgrad_args& a) { a.param.full_cols = -70; }, bad, "param.full_cols"},
      {"shard_offsets_without_full_cols", [](forge_wgrad_args& a) { a.param.col_offset = 64; }, bad, "param.full_cols"},
      {"shard_full_cols_short", [](forge_wgrad_args& a) { a.param.full_cols = 69; }, bad, "param.full_cols"},
      {"shard_past_full_cols", [](forge_wgrad_args& a) { a.param.col_offset = 64; a.param.full_cols = 128; }, bad, "param.full_cols"},
      {"shard_indices_overflow", [](forge_wgrad_args& a) { a.param.row_offset = int64_t(1) << 60; a.param.full_cols = 70; }, bad, "param.row_offset"},
      {"shard_int8_col_offset", [](forge_wgrad_args& a) { a.param.col_offset = 32; a.param.full_cols = 200; }, bad, "param.col_offset"},
      {"shard_int8_end_inside_block", [](forge_wgrad_args& a) { a.param.col_offset = 64; a.param.full_cols = 256; }, bad, "param.col_offset + param.cols"},
      {"shard_near_int64_max", [](forge_wgrad_args& a) { a.param.col_offset = INT64_MAX - 5; a.param.full_cols = INT64_MAX; }, bad, "param.full_cols"},
  };
  if (forge_capabilities() & FORGE_CAP_CUDA) {
    c.push_back({"cuda_index", [](forge_wgrad_args& a) { a.device.kind = FORGE_DEVICE_CUDA; a.device.index = -1; }, bad, "device.index"});
  } else {
    c.push_back({"cuda_missing", [](forge_wgrad_args& a) { a.device.kind = FORGE_DEVICE_CUDA; }, FORGE_ERR_UNSUPPORTED, "device.kind"});
  }
  return c;
}

}  // namespace forge_test
