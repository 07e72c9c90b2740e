// block_copy.h — what the shard tests (CPU and GPU) cut a parameter's buffers with: the bytes
// of one state element (and which formats keep an absmax per block), and a block copied between two row-major leading dimensions.
#pragma once

#include <cstdint>
#include <cstring>

#include "forge/forge.h"

namespace forge_test {

// int8 and fp8 states: a byte per element and an fp32 absmax per block of 64 columns.
inline bool block_states(int state_format) {
  return state_format == FORGE_STATE_INT8_BLOCK64 || state_format == FORGE_STATE_FP8_BLOCK64;
}

inline int state_element_bytes(int state_format) {
  return state_format == FORGE_STATE_FP32 ? 4 : block_states(state_format) ? 1 : 2;
}

// Rows × cols elements of `elem` bytes from a [*, from_ld] array to a [*, to_ld] one.
inline void copy_block(const uint8_t* from, int64_t from_ld, uint8_t* to, int64_t to_ld,
                       int64_t rows, int64_t cols, int elem) {
  for (int64_t r = 0; r < rows; ++r)
    std::memcpy(to + r * to_ld * elem, from + r * from_ld * elem, static_cast<size_t>(cols * elem));
}

}  // namespace forge_test
