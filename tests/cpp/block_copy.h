// block_copy.h — what the shard tests (CPU and GPU) cut a parameter's buffers with: the bytes
// of one state element (and which formats keep an absmax per block), and a block copied between two row-major leading dimensions.
#pragma once

#include <cstdint>
#include <cstring>

#include "forge/forge.h"

namespace forge_test {

// int8, fp8 and int4 states: a code per element and an fp32 absmax per block of 64 columns.
inline bool block_states(int state_format) {
  return state_format == FORGE_STATE_INT8_BLOCK64 || state_format == FORGE_STATE_FP8_BLOCK64 ||
         state_format == FORGE_STATE_INT4_BLOCK64;
}

// Bytes of one state element (int4: 1, the byte two elements share; see state_row_bytes).
inline int state_element_bytes(int state_format) {
  return state_format == FORGE_STATE_FP32 ? 4 : block_states(state_format) ? 1 : 2;
}

// Bytes of a state row of `cols` elements: int4 packs two per byte.
inline int64_t state_row_bytes(int state_format, int64_t cols) {
  return state_format == FORGE_STATE_INT4_BLOCK64 ? (cols + 1) / 2
                                                  : cols * state_element_bytes(state_format);
}

// Rows × cols elements of `elem` bytes from a [*, from_ld] array to a [*, to_ld] one.
inline void copy_block(const uint8_t* from, int64_t from_ld, uint8_t* to, int64_t to_ld,
                       int64_t rows, int64_t cols, int elem) {
  for (int64_t r = 0; r < rows; ++r)
    std::memcpy(to + r * to_ld * elem, from + r * from_ld * elem, static_cast<size_t>(cols * elem));
}

}  // namespace forge_test
