// buffer_checks.cpp — see buffer_checks.h.
#include "buffer_checks.h"


#include "core/formats.h"
#include "core/status.h"

namespace forge {

int dtype_bytes(int32_t dtype) { return dtype == FORGE_DTYPE_FP32 ? 4 : 2; }
int weight_bytes(int32_t weight_format) { return weight_format == FORGE_WEIGHT_FP32 ? 4 : 2; }
int state_element_bytes(int32_t state_format) {
  return state_format == FORGE_STATE_FP32 ? 4 : is_block_format(state_format) ? 1 : 2;
}

int64_t state_buffer_bytes(int32_t state_format, int64_t rows, int64_t cols) {
  if (state_format == FORGE_STATE_INT4_BLOCK64) return rows * int4_row_bytes(cols);
  return rows * cols * state_element_bytes(state_format);
}

forge_status BufferSet::add(const char* name, const void* p, int64_t bytes, int align,
                            const char* what, bool written) {
  const uintptr_t begin = reinterpret_cast<uintptr_t>(p);
  if (begin % static_cast<uintptr_t>(align) != 0)
    return fail(FORGE_ERR_INVALID_ARGUMENT, "%s: %p is not %d-byte aligned (%s)", name, p, align,
                what);
  if (static_cast<uint64_t>(bytes) - 1 > UINTPTR_MAX - begin)
    return fail(FORGE_ERR_INVALID_ARGUMENT, "%s: %p + %lld bytes wraps the address space", name,
                p, static_cast<long long>(bytes));
  if (count_ == kMax)
    return fail(FORGE_ERR_INTERNAL, "BufferSet: more than %d buffers (at %s)", kMax, name);
  Range& r = ranges_[count_++];
  r.name = name;
  r.begin = begin;
  r.end = begin + static_cast<uintptr_t>(bytes - 1) + 1;  // 0 when the range ends at the top
  r.written = written;
  return FORGE_OK;
}

forge_status BufferSet::check_overlaps() const {
  for (int j = 1; j < count_; ++j)
    for (int i = 0; i < j; ++i) {
      const Range &a = ranges_[j], &b = ranges_[i];
      if (!a.written && !b.written) continue;
      // [a.begin, a.end) and [b.begin, b.end) meet; an end of 0 is the top of memory
      const bool a_before_b = a.end != 0 && a.end <= b.begin;
      const bool b_before_a = b.end != 0 && b.end <= a.begin;
      if (a_before_b || b_before_a) continue;
      return fail(FORGE_ERR_INVALID_ARGUMENT,
                  "%s: overlaps %s (bytes %#llx..%#llx and %#llx..%#llx; %s)", a.name, b.name,
                  static_cast<unsigned long long>(a.begin), static_cast<unsigned long long>(a.end),
                  static_cast<unsigned long long>(b.begin), static_cast<unsigned long long>(b.end),
                  a.written && b.written ? "both are written" : "one is written while the other is read");
    }
  return FORGE_OK;
}

namespace {

const char* state_format_name(int32_t f) {
  return f == FORGE_STATE_FP32           ? "fp32 state"
         : f == FORGE_STATE_INT8_BLOCK64 ? "int8 codes"
         : f == FORGE_STATE_FP8_BLOCK64  ? "fp8 codes"
         : f == FORGE_STATE_INT4_BLOCK64 ? "int4 codes"
                                         : "bf16 state";
}

}  // namespace

forge_status add_state_buffers(BufferSet& set, const forge_param& p, int index, bool written) {
  // NOTE: literal names, no formatting: these checks run at every step call.
  static const char* const kStateNames[FORGE_MAX_STATES] = {"param.state[0]", "param.state[1]",
                                                            "param.state[2]"};
  static const char* const kAbsmaxNames[FORGE_MAX_STATES] = {
      "param.state_absmax[0]", "param.state_absmax[1]", "param.state_absmax[2]"};
  if (forge_status s = set.add(kStateNames[index], p.state[index],
                               state_buffer_bytes(p.state_format, p.rows, p.cols),
                               state_element_bytes(p.state_format),
                               state_format_name(p.state_format), written))
    return s;
  if (!is_block_format(p.state_format)) return FORGE_OK;
  const int64_t blocks = p.rows * ((p.cols + FORGE_INT8_BLOCK - 1) / FORGE_INT8_BLOCK);
  return set.add(kAbsmaxNames[index], p.state_absmax[index], blocks * 4, 4, "fp32 absmax",
                 written);
}

forge_status add_param_buffers(BufferSet& set, const forge_param& p, int num_states) {
  const int64_t n = p.rows * p.cols;
  const int w = weight_bytes(p.weight_format);
  if (forge_status s = set.add("param.weight", p.weight, n * w, w, w == 4 ? "fp32" : "bf16", true))
    return s;
  if (p.weight_format == FORGE_WEIGHT_BF16_MASTER)
    if (forge_status s = set.add("param.master", p.master, n * 4, 4, "fp32", true)) return s;
  for (int i = 0; i < num_states; ++i)
    if (forge_status s = add_state_buffers(set, p, i, true)) return s;
  return FORGE_OK;
}

}  // namespace forge
