// rule_table.h — every rule's facts in one table (its name, torch.optim's defaults, the
// forge_hparams fields it reads and their valid ranges, the states it keeps), and the names
// of the ABI's other enumerations. Defaults, validation, state layouts and the C ABI's
// introspection are read from here; a rule's step math stays in make_rule_scalars
// (hparams.cpp) and apply_rule (rules.h). Host only.
#pragma once

#include <cstddef>
#include <cstdint>

#include "forge/forge.h"

namespace forge {

// The forge_hparams fields a rule may read (abi_version, rule and run_scalars aside).
enum HparamField : int {
  kFieldStep,
  kFieldLr,
  kFieldWeightDecay,
  kFieldDecoupledWeightDecay,
  kFieldMaximize,
  kFieldBeta1,
  kFieldBeta2,
  kFieldEps,
  kFieldMomentumDecay,
  kFieldMuProduct,
  kFieldAlpha,
  kFieldMomentum,
  kFieldDampening,
  kFieldNesterov,
  kFieldCentered,
  kFieldLrDecay,
  kFieldInitialAccumulatorValue,
  kFieldGradScale,
  kFieldSeed,
  kFieldCount
};
static_assert(kFieldCount <= 32, "a rule's fields are a 32-bit mask");

struct FieldInfo {
  const char* name;  // the forge_hparams member
  enum Kind { kDouble, kInt32, kInt64, kUint64 } kind;
  size_t offset;
};
const FieldInfo& field_info(int field);
// The field's value as a double (integers converted; seed and step may round).
double field_value(const forge_hparams& hp, int field);
void set_field(forge_hparams& hp, int field, double value);

// Where a double field is valid: lo .. hi, each end open or closed, never NaN; an infinite
// end means "finite". `hint` (nullable) is added to the message.
struct FieldRange {
  int field;
  double lo, hi;
  bool lo_open, hi_open;
  const char* hint;
};

// When a rule keeps a state.
enum class StateWhen : uint8_t {
  kAlways,
  kCentered,  // hparams.centered != 0
  kMomentum,  // hparams.momentum > 0
};

struct StateInfo {
  const char* name;  // torch.optim's state key
  bool is_signed;    // first-moment-like: the signed int8 map
  StateWhen when;
};

constexpr int kMaxRuleRanges = 4;
constexpr int kMaxRuleDefaults = 4;

struct RuleInfo {
  const char* name;
  uint32_t fields;  // bit f: reads HparamField f
  // torch.optim's defaults where they differ from every rule's base (forge_hparams_default)
  struct { int field; double value; } defaults[kMaxRuleDefaults];
  // Ranges of the fields only this rule constrains (lr, weight_decay, grad_scale and step are
  // every rule's, checked by validate_hparams itself).
  FieldRange ranges[kMaxRuleRanges];
  StateInfo states[FORGE_MAX_STATES];  // its largest configuration, in slot order
  int max_states;
};

// nullptr when `rule` is not a forge_rule value.
const RuleInfo* rule_info(int rule);
inline bool rule_reads(const RuleInfo& r, int field) { return (r.fields >> field) & 1u; }
// Whether the rule keeps state `s` (of its RuleInfo::states) with these hyper-parameters.
bool state_kept(const StateInfo& s, const forge_hparams& hp);

// The names of the ABI's enumerations (forge_enum), FORGE_ENUM_RULE's included.
int enum_count(int kind);                   // 0 when `kind` is not a forge_enum value
const char* enum_name(int kind, int value);  // nullptr when out of range
const char* enum_kind_name(int kind);        // "rule", "state format", ...

}  // namespace forge
