// rule_table.cpp — the table itself: one entry per forge_rule, one name per value of every
// ABI enumeration. Adding a rule is one entry here plus its step math (make_rule_scalars,
// apply_rule).
#include "rule_table.h"

#include <cmath>
#include <cstring>

namespace forge {
namespace {

constexpr double kInf = HUGE_VAL;

#define FORGE_FIELD(member, kind) {#member, FieldInfo::kind, offsetof(forge_hparams, member)}
const FieldInfo kFields[kFieldCount] = {
    FORGE_FIELD(step, kInt64),
    FORGE_FIELD(lr, kDouble),
    FORGE_FIELD(weight_decay, kDouble),
    FORGE_FIELD(decoupled_weight_decay, kInt32),
    FORGE_FIELD(maximize, kInt32),
    FORGE_FIELD(beta1, kDouble),
    FORGE_FIELD(beta2, kDouble),
    FORGE_FIELD(eps, kDouble),
    FORGE_FIELD(momentum_decay, kDouble),
    FORGE_FIELD(mu_product, kDouble),
    FORGE_FIELD(alpha, kDouble),
    FORGE_FIELD(momentum, kDouble),
    FORGE_FIELD(dampening, kDouble),
    FORGE_FIELD(nesterov, kInt32),
    FORGE_FIELD(centered, kInt32),
    FORGE_FIELD(lr_decay, kDouble),
    FORGE_FIELD(initial_accumulator_value, kDouble),
    FORGE_FIELD(grad_scale, kDouble),
    FORGE_FIELD(seed, kUint64),
};
#undef FORGE_FIELD

constexpr uint32_t bit(int f) { return 1u << f; }
// What every rule reads.
constexpr uint32_t kCommon = bit(kFieldStep) | bit(kFieldLr) | bit(kFieldWeightDecay) |
                             bit(kFieldMaximize) | bit(kFieldGradScale) | bit(kFieldSeed);
constexpr uint32_t kAdam = kCommon | bit(kFieldDecoupledWeightDecay) | bit(kFieldBeta1) |
                           bit(kFieldBeta2) | bit(kFieldEps);

constexpr FieldRange kUnit(int field) { return {field, 0.0, 1.0, false, true, nullptr}; }
constexpr FieldRange kEpsRange{kFieldEps, 0.0, kInf, true, false, nullptr};
constexpr FieldRange kNone{-1, 0, 0, false, false, nullptr};
constexpr StateInfo kNoState{nullptr, false, StateWhen::kAlways};

const RuleInfo kRules[FORGE_RULE_COUNT] = {
    // FORGE_RULE_SGD
    {"SGD",
     kCommon,
     {{kFieldLr, 1e-3}, {-1, 0}, {-1, 0}, {-1, 0}},
     {{kFieldMomentum, 0.0, 0.0, false, false, "(use FORGE_RULE_SGD_MOMENTUM)"}, kNone, kNone,
      kNone},
     {kNoState, kNoState, kNoState},
     0},
    // FORGE_RULE_SGD_MOMENTUM
    {"SGD_MOMENTUM",
     kCommon | bit(kFieldMomentum) | bit(kFieldDampening) | bit(kFieldNesterov),
     {{kFieldLr, 1e-3}, {kFieldMomentum, 0.9}, {-1, 0}, {-1, 0}},
     {{kFieldMomentum, 0.0, 1.0, true, true, nullptr},
      {kFieldDampening, 0.0, 1.0, false, false, nullptr}, kNone, kNone},
     {{"momentum_buffer", true, StateWhen::kAlways}, kNoState, kNoState},
     1},
    // FORGE_RULE_ADAMW
    {"AdamW",
     kAdam,
     {{kFieldLr, 1e-3}, {kFieldWeightDecay, 1e-2}, {kFieldDecoupledWeightDecay, 1}, {-1, 0}},
     {kUnit(kFieldBeta1), kUnit(kFieldBeta2), kEpsRange, kNone},
     {{"exp_avg", true, StateWhen::kAlways}, {"exp_avg_sq", false, StateWhen::kAlways}, kNoState},
     2},
    // FORGE_RULE_NADAM
    {"NAdam",
     kAdam | bit(kFieldMomentumDecay) | bit(kFieldMuProduct),
     {{kFieldLr, 2e-3}, {-1, 0}, {-1, 0}, {-1, 0}},
     {kUnit(kFieldBeta1), kUnit(kFieldBeta2), kEpsRange,
      {kFieldMomentumDecay, 0.0, kInf, false, false, nullptr}},
     {{"exp_avg", true, StateWhen::kAlways}, {"exp_avg_sq", false, StateWhen::kAlways}, kNoState},
     2},
    // FORGE_RULE_RADAM
    {"RAdam",
     kAdam,
     {{kFieldLr, 1e-3}, {-1, 0}, {-1, 0}, {-1, 0}},
     {kUnit(kFieldBeta1), kUnit(kFieldBeta2), kEpsRange, kNone},
     {{"exp_avg", true, StateWhen::kAlways}, {"exp_avg_sq", false, StateWhen::kAlways}, kNoState},
     2},
    // FORGE_RULE_LION
    {"Lion",
     kCommon | bit(kFieldBeta1) | bit(kFieldBeta2),
     {{kFieldLr, 1e-4}, {kFieldBeta2, 0.99}, {-1, 0}, {-1, 0}},
     {kUnit(kFieldBeta1), kUnit(kFieldBeta2), kNone, kNone},
     {{"exp_avg", true, StateWhen::kAlways}, kNoState, kNoState},
     1},
    // FORGE_RULE_RMSPROP
    {"RMSprop",
     kCommon | bit(kFieldAlpha) | bit(kFieldEps) | bit(kFieldMomentum) | bit(kFieldCentered),
     {{kFieldLr, 1e-2}, {-1, 0}, {-1, 0}, {-1, 0}},
     {kUnit(kFieldAlpha), kUnit(kFieldMomentum), kEpsRange, kNone},
     {{"square_avg", false, StateWhen::kAlways},
      {"grad_avg", true, StateWhen::kCentered},
      {"momentum_buffer", true, StateWhen::kMomentum}},
     3},
    // FORGE_RULE_ADAGRAD
    {"Adagrad",
     kCommon | bit(kFieldLrDecay) | bit(kFieldEps) | bit(kFieldInitialAccumulatorValue),
     {{kFieldLr, 1e-2}, {kFieldEps, 1e-10}, {-1, 0}, {-1, 0}},
     {{kFieldLrDecay, 0.0, kInf, false, false, nullptr},
      {kFieldInitialAccumulatorValue, 0.0, kInf, false, false, nullptr}, kEpsRange, kNone},
     {{"sum", false, StateWhen::kAlways}, kNoState, kNoState},
     1},
    // FORGE_RULE_MUON (torch.optim.Muon's defaults; lr and weight_decay: the caller's)
    {"Muon",
     bit(kFieldStep) | bit(kFieldMaximize) | bit(kFieldGradScale) | bit(kFieldSeed) |
         bit(kFieldMomentum) | bit(kFieldNesterov),
     {{kFieldMomentum, 0.95}, {kFieldNesterov, 1}, {-1, 0}, {-1, 0}},
     {{kFieldMomentum, 0.0, 1.0, false, false, nullptr}, kNone, kNone, kNone},
     {{"momentum_buffer", true, StateWhen::kAlways}, kNoState, kNoState},
     1},
};

// The names of forge_enum's enumerations, value by value.
const char* const kStatusNames[] = {"ok",     "invalid_argument", "unsupported",
                                    "device", "out_of_memory",    "internal"};
const char* const kDtypeNames[] = {"fp32", "bf16", "fp16"};
const char* const kRuleNames[] = {"SGD",  "SGD_MOMENTUM", "AdamW",   "NAdam", "RAdam",
                                  "Lion", "RMSprop",      "Adagrad", "Muon"};
const char* const kWeightFormatNames[] = {"fp32", "bf16", "bf16_sr", "bf16_master"};
const char* const kStateFormatNames[] = {"fp32", "bf16", "bf16_sr", "int8", "fp8", "int4"};
const char* const kDeviceKindNames[] = {"cpu", "cuda"};

struct EnumTable {
  const char* kind_name;
  const char* const* names;
  int count;
};
#define FORGE_ENUM_TABLE(kind_name, names) {kind_name, names, sizeof(names) / sizeof(names[0])}
const EnumTable kEnums[FORGE_ENUM_COUNT] = {
    FORGE_ENUM_TABLE("status", kStatusNames),
    FORGE_ENUM_TABLE("dtype", kDtypeNames),
    FORGE_ENUM_TABLE("rule", kRuleNames),
    FORGE_ENUM_TABLE("weight format", kWeightFormatNames),
    FORGE_ENUM_TABLE("state format", kStateFormatNames),
    FORGE_ENUM_TABLE("device kind", kDeviceKindNames),
};
#undef FORGE_ENUM_TABLE

static_assert(sizeof(kStatusNames) / sizeof(kStatusNames[0]) == FORGE_ERR_INTERNAL + 1, "");
static_assert(sizeof(kRuleNames) / sizeof(kRuleNames[0]) == FORGE_RULE_COUNT, "");
static_assert(sizeof(kWeightFormatNames) / sizeof(kWeightFormatNames[0]) ==
                  FORGE_WEIGHT_FORMAT_COUNT, "");
static_assert(sizeof(kStateFormatNames) / sizeof(kStateFormatNames[0]) ==
                  FORGE_STATE_FORMAT_COUNT, "");
static_assert(sizeof(kDeviceKindNames) / sizeof(kDeviceKindNames[0]) == FORGE_DEVICE_CUDA + 1,
              "");
static_assert(sizeof(kDtypeNames) / sizeof(kDtypeNames[0]) == FORGE_DTYPE_FP16 + 1, "");

}  // namespace

const FieldInfo& field_info(int field) { return kFields[field]; }

double field_value(const forge_hparams& hp, int field) {
  const FieldInfo& f = kFields[field];
  const char* p = reinterpret_cast<const char*>(&hp) + f.offset;
  switch (f.kind) {
    case FieldInfo::kDouble: { double v; std::memcpy(&v, p, sizeof(v)); return v; }
    case FieldInfo::kInt32: { int32_t v; std::memcpy(&v, p, sizeof(v)); return v; }
    case FieldInfo::kInt64: { int64_t v; std::memcpy(&v, p, sizeof(v)); return static_cast<double>(v); }
    default: { uint64_t v; std::memcpy(&v, p, sizeof(v)); return static_cast<double>(v); }
  }
}

void set_field(forge_hparams& hp, int field, double value) {
  const FieldInfo& f = kFields[field];
  char* p = reinterpret_cast<char*>(&hp) + f.offset;
  switch (f.kind) {
    case FieldInfo::kDouble: std::memcpy(p, &value, sizeof(value)); break;
    case FieldInfo::kInt32: { const int32_t v = static_cast<int32_t>(value); std::memcpy(p, &v, sizeof(v)); break; }
    case FieldInfo::kInt64: { const int64_t v = static_cast<int64_t>(value); std::memcpy(p, &v, sizeof(v)); break; }
    default: { const uint64_t v = static_cast<uint64_t>(value); std::memcpy(p, &v, sizeof(v)); break; }
  }
}

const RuleInfo* rule_info(int rule) {
  return rule >= 0 && rule < FORGE_RULE_COUNT ? &kRules[rule] : nullptr;
}

bool state_kept(const StateInfo& s, const forge_hparams& hp) {
  switch (s.when) {
    case StateWhen::kCentered: return hp.centered != 0;
    case StateWhen::kMomentum: return hp.momentum > 0;
    default: return true;
  }
}

int enum_count(int kind) { return kind >= 0 && kind < FORGE_ENUM_COUNT ? kEnums[kind].count : 0; }

const char* enum_name(int kind, int value) {
  if (value < 0 || value >= enum_count(kind)) return nullptr;
  return kEnums[kind].names[value];
}

const char* enum_kind_name(int kind) {
  return kind >= 0 && kind < FORGE_ENUM_COUNT ? kEnums[kind].kind_name : "?";
}

}  // namespace forge
