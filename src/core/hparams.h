// hparams.h — checking hyper-parameters and turning them into the per-step
// fp32 scalars the element code consumes (computed in double, once per call).
#pragma once

#include "forge/forge.h"
#include "rules.h"

namespace forge {

forge_status default_hparams(int rule, forge_hparams* out);
// Checks every field the rule uses; the message names the field.
forge_status validate_hparams(const forge_hparams& hp);
// Which states the rule keeps (count, signedness, torch names). hp must be valid.
forge_status state_layout(const forge_hparams& hp, int format, int64_t rows, int64_t cols,
                          forge_state_layout* out);
RuleScalars make_rule_scalars(const forge_hparams& hp);

}  // namespace forge
