// buffer_checks.h — the byte ranges a call reads and writes: their sizes (no int64
// overflow, no wrap of the address space), their alignment, and their overlaps (two
// buffers may share bytes only when neither is written). Pure pointer arithmetic, so the
// same checks hold for host and device memory.
#pragma once

#include <cstdint>

#include "forge/forge.h"

namespace forge {

// Most elements of one parameter, input or state: its largest form (fp32, 4 bytes each)
// must count its bytes in int64.
constexpr int64_t kMaxElements = INT64_MAX / 4;

// a · b for a, b >= 0, false when it exceeds `limit`.
inline bool product_within(int64_t a, int64_t b, int64_t limit, int64_t* out) {
  if (b != 0 && a > limit / b) return false;
  *out = a * b;
  return true;
}

int dtype_bytes(int32_t dtype);               // 4 or 2
int weight_bytes(int32_t weight_format);      // 4 or 2
int state_element_bytes(int32_t state_format);  // 4, 2 or 1 (int4: its buffer's alignment)
// Bytes of one state buffer of a [rows, cols] parameter (int4: two codes per byte, each row
// ceil(cols / 2) bytes); the shape must be checked (rows · cols <= kMaxElements).
int64_t state_buffer_bytes(int32_t state_format, int64_t rows, int64_t cols);

// int8, fp8 and int4 states: a code per element and an fp32 absmax per block of
// FORGE_INT8_BLOCK columns of a row.
inline bool is_block_format(int32_t state_format) {
  return state_format == FORGE_STATE_INT8_BLOCK64 || state_format == FORGE_STATE_FP8_BLOCK64 ||
         state_format == FORGE_STATE_INT4_BLOCK64;
}

class BufferSet {
 public:
  // Registers `bytes` (> 0) at `p`; `name` must outlive the set (a literal). Refuses
  // (naming it) a pointer that
  // is not `align`-byte aligned or a range that wraps the address space. `what` says what
  // the alignment is for ("fp32", "bf16", ...).
  forge_status add(const char* name, const void* p, int64_t bytes, int align, const char* what,
                   bool written);
  // Refuses the first overlap of two registered buffers of which one is written, naming both.
  forge_status check_overlaps() const;

  struct Range {
    const char* name;
    uintptr_t begin, end;  // [begin, end); an end of 0 is the top of memory
    bool written;
  };
  int count() const { return count_; }
  const Range& range(int i) const { return ranges_[i]; }

 private:
  static constexpr int kMax = 16;
  Range ranges_[kMax];
  int count_ = 0;
};

// The parameter's buffers a step touches: the weight, the master (FORGE_WEIGHT_BF16_MASTER),
// states 0 .. num_states - 1 and, for block states, their absmax arrays; all written. The shape
// must be checked (rows · cols <= kMaxElements).
forge_status add_param_buffers(BufferSet& set, const forge_param& p, int num_states);
// State `index` of the parameter and its absmax (block states), read or written.
forge_status add_state_buffers(BufferSet& set, const forge_param& p, int index, bool written);

}  // namespace forge
