// gpu_test_util.cpp — helpers of the GPU suite (see gpu_test_util.h).
#include "gpu_test_util.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <sstream>
#include <stdexcept>

#include "block_copy.h"
#include "core/formats.h"
#include "gpu_tolerances.h"

namespace fgt {

using forge_test::block_states;
using forge_test::state_element_bytes;
using forge_test::state_row_bytes;

bool gpu_available() {
  static const bool available = [] {
    int n = 0;
    const cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) (void)cudaGetLastError();
    return e == cudaSuccess && n > 0;
  }();
  return available;
}

void cuda_ok(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

void forge_ok(forge_status s, const char* what) {
  if (s != FORGE_OK)
    throw std::runtime_error(std::string(what) + " returned " + std::to_string(s) + ": " +
                             forge_last_error());
}

forge_device cpu_device() {
  forge_device d{};
  d.kind = FORGE_DEVICE_CPU;
  return d;
}

forge_device gpu_device(cudaStream_t stream) {
  forge_device d{};
  d.kind = FORGE_DEVICE_CUDA;
  d.index = 0;
  d.stream = stream;
  return d;
}

// ---- DeviceBuffer --------------------------------------------------------------------------

DeviceBuffer::~DeviceBuffer() {
  if (base_) (void)cudaFree(base_);
}

DeviceBuffer::DeviceBuffer(DeviceBuffer&& o) noexcept : base_(o.base_), bytes_(o.bytes_) {
  o.base_ = nullptr;
  o.bytes_ = 0;
}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& o) noexcept {
  if (this != &o) {
    if (base_) (void)cudaFree(base_);
    base_ = o.base_;
    bytes_ = o.bytes_;
    o.base_ = nullptr;
    o.bytes_ = 0;
  }
  return *this;
}

void DeviceBuffer::allocate(size_t bytes) {
  if (base_) (void)cudaFree(base_);
  base_ = nullptr;
  bytes_ = bytes;
  void* p = nullptr;
  CUDA_OK(cudaMalloc(&p, bytes + 2 * kGuard));
  base_ = static_cast<uint8_t*>(p);
  CUDA_OK(cudaMemset(base_, 0xFF, bytes + 2 * kGuard));
  settle_legacy_stream();
}

// cudaMemset is asynchronous, and a cudaMemcpy from pageable memory may return before its
// DMA lands; both run on the legacy default stream, which a non-blocking stream does not wait
// for. So every write here is complete when it returns: a test may then step on any stream
// (on a busy GPU a replay on a non-blocking stream otherwise ran before the weights landed).
void DeviceBuffer::settle_legacy_stream() { CUDA_OK(cudaStreamSynchronize(cudaStreamLegacy)); }

void DeviceBuffer::upload(const void* host, size_t bytes) {
  if (bytes > bytes_) throw std::runtime_error("DeviceBuffer::upload: too many bytes");
  if (bytes) CUDA_OK(cudaMemcpy(data(), host, bytes, cudaMemcpyHostToDevice));
  settle_legacy_stream();
}

void DeviceBuffer::download(void* host, size_t bytes) const {
  if (bytes > bytes_) throw std::runtime_error("DeviceBuffer::download: too many bytes");
  if (bytes) CUDA_OK(cudaMemcpy(host, data(), bytes, cudaMemcpyDeviceToHost));
}

void DeviceBuffer::fill(int byte_value) {
  if (bytes_) CUDA_OK(cudaMemset(data(), byte_value, bytes_));
  settle_legacy_stream();
}

bool DeviceBuffer::guards_intact() const {
  if (!base_) return true;
  std::vector<uint8_t> front(kGuard), back(kGuard);
  CUDA_OK(cudaMemcpy(front.data(), base_, kGuard, cudaMemcpyDeviceToHost));
  CUDA_OK(cudaMemcpy(back.data(), base_ + kGuard + bytes_, kGuard, cudaMemcpyDeviceToHost));
  for (size_t i = 0; i < kGuard; ++i)
    if (front[i] != 0xFF || back[i] != 0xFF) return false;
  return true;
}

// ---- parameters ------------------------------------------------------------------------------

forge_param HostParam::view() {
  forge_param p{};
  p.rows = rows;
  p.cols = cols;
  p.weight_format = weight_format;
  p.weight = weight.data();
  p.master = weight_format == FORGE_WEIGHT_BF16_MASTER ? reinterpret_cast<float*>(master.data())
                                                       : nullptr;
  p.state_format = state_format;
  for (int i = 0; i < layout.num_states; ++i) {
    p.state[i] = state[i].data();
    p.state_absmax[i] = block_states(state_format) ? absmax[i].data() : nullptr;
  }
  p.row_offset = row_offset;
  p.col_offset = col_offset;
  p.full_cols = full_cols;
  return p;
}

namespace {

using forge_test::copy_block;

// Moves the shard's block between `full` and `shard` (to_shard: full -> shard).
void move_shard(HostParam& full, HostParam& shard, bool to_shard) {
  const int64_t r0 = shard.row_offset, c0 = shard.col_offset, rows = shard.rows, cols = shard.cols;
  auto move = [&](std::vector<uint8_t>& f, std::vector<uint8_t>& s, int64_t f_ld, int64_t s_ld,
                  int64_t col0, int64_t ncols, int elem) {
    uint8_t* at = f.data() + (r0 * f_ld + col0) * elem;
    if (to_shard) copy_block(at, f_ld, s.data(), s_ld, rows, ncols, elem);
    else copy_block(s.data(), s_ld, at, f_ld, rows, ncols, elem);
  };
  move(full.weight, shard.weight, full.cols, cols, c0, cols,
       full.weight_format == FORGE_WEIGHT_FP32 ? 4 : 2);
  if (full.weight_format == FORGE_WEIGHT_BF16_MASTER)
    move(full.master, shard.master, full.cols, cols, c0, cols, 4);
  for (int i = 0; i < full.layout.num_states; ++i) {
    if (full.state_format == FORGE_STATE_INT4_BLOCK64) {  // packed rows (c0 % 64 == 0: whole bytes)
      const int64_t full_row = state_row_bytes(full.state_format, full.cols),
                    shard_row = state_row_bytes(full.state_format, cols);
      move(full.state[i], shard.state[i], full_row, shard_row, c0 / 2, shard_row, 1);
    } else {
      move(full.state[i], shard.state[i], full.cols, cols, c0, cols,
           state_element_bytes(full.state_format));
    }
    if (block_states(full.state_format)) {
      const int64_t full_blocks = (full.cols + 63) / 64, blocks = (cols + 63) / 64;
      auto* f = reinterpret_cast<uint8_t*>(full.absmax[i].data());
      auto* s = reinterpret_cast<uint8_t*>(shard.absmax[i].data());
      uint8_t* at = f + (r0 * full_blocks + c0 / 64) * 4;
      if (to_shard) copy_block(at, full_blocks, s, blocks, rows, blocks, 4);
      else copy_block(s, blocks, at, full_blocks, rows, blocks, 4);
    }
  }
}

}  // namespace

HostParam take_shard(const HostParam& full, int64_t r0, int64_t rows, int64_t c0, int64_t cols) {
  HostParam h;
  h.rows = rows;
  h.cols = cols;
  h.weight_format = full.weight_format;
  h.state_format = full.state_format;
  h.layout = full.layout;
  h.weight.resize(static_cast<size_t>(rows * cols) * (full.weight_format == FORGE_WEIGHT_FP32 ? 4 : 2));
  if (full.weight_format == FORGE_WEIGHT_BF16_MASTER) h.master.resize(static_cast<size_t>(rows * cols) * 4);
  for (int i = 0; i < full.layout.num_states; ++i) {
    h.layout.state_bytes[i] = rows * state_row_bytes(full.state_format, cols);
    h.state[i].resize(static_cast<size_t>(h.layout.state_bytes[i]));
    if (block_states(full.state_format)) {
      h.layout.absmax_count[i] = rows * ((cols + 63) / 64);
      h.absmax[i].resize(static_cast<size_t>(h.layout.absmax_count[i]));
    }
  }
  h.row_offset = r0;
  h.col_offset = c0;
  h.full_cols = full.cols;
  move_shard(const_cast<HostParam&>(full), h, true);
  return h;
}

void put_shard(HostParam& full, const HostParam& shard) {
  move_shard(full, const_cast<HostParam&>(shard), false);
}

HostParam make_param(int64_t rows, int64_t cols, forge_weight_format wf, forge_state_format sf,
                     const forge_hparams& hp, uint64_t seed) {
  HostParam h;
  h.rows = rows;
  h.cols = cols;
  h.weight_format = wf;
  h.state_format = sf;
  FORGE_OK(forge_state_layout_query(&hp, sf, rows, cols, &h.layout));
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> uniform(0.0f, 1.0f);
  const int64_t n = rows * cols;
  std::vector<float> w(n);
  for (auto& v : w) v = 0.5f * normal(rng);
  if (wf == FORGE_WEIGHT_FP32) {
    h.weight.resize(4 * n);
    std::memcpy(h.weight.data(), w.data(), 4 * n);
  } else {
    h.weight.resize(2 * n);
    auto* wb = reinterpret_cast<uint16_t*>(h.weight.data());
    for (int64_t i = 0; i < n; ++i) wb[i] = forge::bf16_nearest(w[i]);
    if (wf == FORGE_WEIGHT_BF16_MASTER) {
      h.master.resize(4 * n);
      std::memcpy(h.master.data(), w.data(), 4 * n);
    }
  }
  for (int i = 0; i < h.layout.num_states; ++i) {
    h.state[i].assign(h.layout.state_bytes[i], 0);
    h.absmax[i].assign(h.layout.absmax_count[i], 0.0f);
  }
  forge_param view = h.view();
  for (int i = 0; i < h.layout.num_states; ++i) {
    const std::string name = h.layout.names[i];
    std::vector<float> values(n);
    for (auto& v : values) {
      if (name == "exp_avg_sq" || name == "square_avg") {
        v = 1e-3f + 9e-3f * uniform(rng);
      } else if (name == "sum") {
        v = 0.1f + 0.9f * uniform(rng);
      } else if (name == "grad_avg") {
        v = 0.01f * normal(rng);
      } else {
        v = 0.1f * normal(rng);
      }
    }
    FORGE_OK(forge_state_from_fp32(&view, &hp, i, values.data(), cpu_device()));
  }
  return h;
}

void DeviceParam::upload(const HostParam& h) {
  auto put = [](DeviceBuffer& d, const void* src, size_t bytes) {
    if (d.size() != bytes || d.data() == nullptr) d.allocate(bytes);
    d.upload(src, bytes);
  };
  put(weight, h.weight.data(), h.weight.size());
  if (h.weight_format == FORGE_WEIGHT_BF16_MASTER) put(master, h.master.data(), h.master.size());
  for (int i = 0; i < h.layout.num_states; ++i) {
    put(state[i], h.state[i].data(), h.state[i].size());
    if (block_states(h.state_format))
      put(absmax[i], h.absmax[i].data(), h.absmax[i].size() * sizeof(float));
  }
}

forge_param DeviceParam::view(const HostParam& shape) const {
  forge_param p{};
  p.rows = shape.rows;
  p.cols = shape.cols;
  p.weight_format = shape.weight_format;
  p.weight = weight.data();
  p.master = shape.weight_format == FORGE_WEIGHT_BF16_MASTER ? static_cast<float*>(master.data())
                                                             : nullptr;
  p.state_format = shape.state_format;
  for (int i = 0; i < shape.layout.num_states; ++i) {
    p.state[i] = state[i].data();
    p.state_absmax[i] =
        block_states(shape.state_format) ? static_cast<float*>(absmax[i].data())
                                                       : nullptr;
  }
  p.row_offset = shape.row_offset;
  p.col_offset = shape.col_offset;
  p.full_cols = shape.full_cols;
  return p;
}

HostParam DeviceParam::download(const HostParam& shape) const {
  HostParam h = shape;
  weight.download(h.weight.data(), h.weight.size());
  if (shape.weight_format == FORGE_WEIGHT_BF16_MASTER) master.download(h.master.data(), h.master.size());
  for (int i = 0; i < shape.layout.num_states; ++i) {
    state[i].download(h.state[i].data(), h.state[i].size());
    if (block_states(shape.state_format))
      absmax[i].download(h.absmax[i].data(), h.absmax[i].size() * sizeof(float));
  }
  return h;
}

::testing::AssertionResult DeviceParam::guards_intact() const {
  if (!weight.guards_intact()) return ::testing::AssertionFailure() << "weight guard band written";
  if (!master.guards_intact()) return ::testing::AssertionFailure() << "master guard band written";
  for (int i = 0; i < FORGE_MAX_STATES; ++i) {
    if (!state[i].guards_intact())
      return ::testing::AssertionFailure() << "state" << i << " guard band written";
    if (!absmax[i].guards_intact())
      return ::testing::AssertionFailure() << "absmax" << i << " guard band written";
  }
  return ::testing::AssertionSuccess();
}

namespace {

int state_elem_bytes(forge_state_format f) {
  return state_element_bytes(f);
}

// First differing element of two equally sized byte vectors, elements of `elem` bytes.
bool first_difference(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b, int elem,
                      int64_t* index) {
  if (a.size() != b.size()) {
    *index = -1;
    return true;
  }
  if (std::memcmp(a.data(), b.data(), a.size()) == 0) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i] != b[i]) {
      *index = static_cast<int64_t>(i / elem);
      return true;
    }
  return false;
}

std::string element_hex(const std::vector<uint8_t>& v, int64_t index, int elem) {
  std::ostringstream os;
  os << "0x" << std::hex;
  for (int b = elem - 1; b >= 0; --b) {
    const size_t i = static_cast<size_t>(index * elem + b);
    os.width(2);
    os.fill('0');
    os << (i < v.size() ? static_cast<int>(v[i]) : 0);
  }
  return os.str();
}

std::vector<uint8_t> float_bytes(const std::vector<float>& v) {
  std::vector<uint8_t> b(v.size() * 4);
  if (!v.empty()) std::memcpy(b.data(), v.data(), b.size());
  return b;
}

}  // namespace

::testing::AssertionResult same_bits(const HostParam& expected, const HostParam& actual) {
  struct Buffer {
    std::string name;
    const std::vector<uint8_t>* e;
    const std::vector<uint8_t>* a;
    int elem;
  };
  std::vector<Buffer> buffers;
  buffers.push_back({"weight", &expected.weight, &actual.weight,
                     expected.weight_format == FORGE_WEIGHT_FP32 ? 4 : 2});
  if (expected.weight_format == FORGE_WEIGHT_BF16_MASTER)
    buffers.push_back({"master", &expected.master, &actual.master, 4});
  std::vector<std::vector<uint8_t>> absmax_bytes;
  absmax_bytes.reserve(2 * FORGE_MAX_STATES);
  for (int i = 0; i < expected.layout.num_states; ++i) {
    buffers.push_back({"state" + std::to_string(i), &expected.state[i], &actual.state[i],
                       state_elem_bytes(expected.state_format)});
    if (block_states(expected.state_format)) {
      absmax_bytes.push_back(float_bytes(expected.absmax[i]));
      absmax_bytes.push_back(float_bytes(actual.absmax[i]));
    }
  }
  for (size_t j = 0; j + 1 < absmax_bytes.size(); j += 2)
    buffers.push_back({"absmax" + std::to_string(j / 2), &absmax_bytes[j], &absmax_bytes[j + 1], 4});
  for (const Buffer& b : buffers) {
    int64_t index = 0;
    if (first_difference(*b.e, *b.a, b.elem, &index)) {
      if (index < 0) return ::testing::AssertionFailure() << b.name << ": sizes differ";
      // (int4 states: elements are bytes, two codes each)
      const int64_t cols = b.name.rfind("absmax", 0) == 0
                               ? (expected.cols + FORGE_INT8_BLOCK - 1) / FORGE_INT8_BLOCK
                           : b.name.rfind("state", 0) == 0
                               ? state_row_bytes(expected.state_format, expected.cols) / b.elem
                               : expected.cols;
      int64_t count = 0;
      for (size_t i = 0; i < b.e->size(); i += b.elem)
        if (std::memcmp(b.e->data() + i, b.a->data() + i, b.elem) != 0) ++count;
      return ::testing::AssertionFailure()
             << b.name << " differs at element " << index << " (row " << index / cols << ", col "
             << index % cols << "): expected " << element_hex(*b.e, index, b.elem) << ", got "
             << element_hex(*b.a, index, b.elem) << "; " << count << " of "
             << b.e->size() / b.elem << " elements differ";
    }
  }
  return ::testing::AssertionSuccess();
}

namespace {

// The code an element of an int8 / fp8 / int4 block (sf) gets when its block's absmax changes
// from old_absmax to new_absmax: its old code decoded, then encoded again.
uint8_t reencoded(forge_state_format sf, uint8_t old_code, float old_absmax, float new_absmax,
                  bool is_signed) {
  if (sf == FORGE_STATE_INT4_BLOCK64)
    return forge::int4_encode(forge::int4_decode(old_code, old_absmax, is_signed), new_absmax,
                              is_signed);
  if (sf == FORGE_STATE_FP8_BLOCK64)
    return forge::fp8_encode(forge::fp8_decode(old_code, old_absmax, is_signed), new_absmax, is_signed);
  return forge::int8_encode(forge::int8_decode(old_code, is_signed) * old_absmax, new_absmax, is_signed);
}

}  // namespace

void expect_skipped_codes(const HostParam& before, const HostParam& after,
                          std::initializer_list<int64_t> skipped, int* stayed, int* grew) {
  const int64_t cols = after.cols, blocks_per_row = (cols + 63) / 64;
  for (int s = 0; s < after.layout.num_states; ++s)
    for (int64_t r = 0; r < after.rows; ++r)
      for (int64_t c : skipped) {
        const int64_t b = r * blocks_per_row + c / 64;
        uint8_t old_code, code;
        if (after.state_format == FORGE_STATE_INT4_BLOCK64) {
          const int64_t row_bytes = state_row_bytes(after.state_format, cols);
          old_code = forge::int4_code_at(before.state[s].data() + r * row_bytes, c);
          code = forge::int4_code_at(after.state[s].data() + r * row_bytes, c);
        } else {
          old_code = before.state[s][r * cols + c];
          code = after.state[s][r * cols + c];
        }
        if (std::memcmp(&before.absmax[s][b], &after.absmax[s][b], 4) == 0) {
          ++*stayed;
          EXPECT_EQ(code, old_code) << "state " << s << ", row " << r << ", col " << c;
        } else {
          ++*grew;
          EXPECT_EQ(code, reencoded(after.state_format, old_code, before.absmax[s][b], after.absmax[s][b],
                                    after.layout.is_signed[s] != 0))
              << "state " << s << ", row " << r << ", col " << c;
        }
      }
}

unsigned long long run_and_count(void (*launch)(unsigned long long*)) {
  unsigned long long* d = nullptr;
  CUDA_OK(cudaMalloc(&d, sizeof(unsigned long long)));
  CUDA_OK(cudaMemset(d, 0, sizeof(unsigned long long)));
  launch(d);
  CUDA_OK(cudaGetLastError());
  CUDA_OK(cudaDeviceSynchronize());
  unsigned long long h = 0;
  CUDA_OK(cudaMemcpy(&h, d, sizeof(h), cudaMemcpyDeviceToHost));
  CUDA_OK(cudaFree(d));
  return h;
}

std::vector<float> decoded(const HostParam& p, const std::string& buffer, const forge_hparams& hp) {
  const int64_t n = p.rows * p.cols;
  std::vector<float> out(n);
  if (buffer == "weight") {
    if (p.weight_format == FORGE_WEIGHT_FP32) {
      std::memcpy(out.data(), p.weight.data(), 4 * n);
    } else {
      const auto* wb = reinterpret_cast<const uint16_t*>(p.weight.data());
      for (int64_t i = 0; i < n; ++i) out[i] = forge::bf16_to_float(wb[i]);
    }
  } else if (buffer == "master") {
    std::memcpy(out.data(), p.master.data(), 4 * n);
  } else {
    const int i = buffer.back() - '0';
    HostParam copy = p;
    forge_param view = copy.view();
    FORGE_OK(forge_state_to_fp32(&view, &hp, i, out.data(), cpu_device()));
  }
  return out;
}

::testing::AssertionResult close_enough(const HostParam& expected, const HostParam& actual,
                                        const forge_hparams& hp) {
  // name, kind: 0 fp32, 1 bf16, 2 int8 / fp8, 3 int4
  std::vector<std::pair<std::string, int>> buffers;
  buffers.push_back({"weight", expected.weight_format == FORGE_WEIGHT_FP32 ? 0 : 1});
  if (expected.weight_format == FORGE_WEIGHT_BF16_MASTER) buffers.push_back({"master", 0});
  for (int i = 0; i < expected.layout.num_states; ++i) {
    const int kind = expected.state_format == FORGE_STATE_FP32           ? 0
                     : expected.state_format == FORGE_STATE_INT4_BLOCK64 ? 3
                     : block_states(expected.state_format)                ? 2
                                                                         : 1;
    buffers.push_back({"state" + std::to_string(i), kind});
  }
  for (const auto& [name, kind] : buffers) {
    const std::vector<float> e = decoded(expected, name, hp), a = decoded(actual, name, hp);
    double max_ref = 0.0;
    for (float v : e)
      if (std::isfinite(v)) max_ref = std::max(max_ref, std::fabs(static_cast<double>(v)));
    const double rel = kind == 0   ? kFp32Rel
                       : kind == 1 ? kBf16Rel
                       : kind == 2 ? kInt8Rel
                                   : kInt4Rel;
    const double abs = (kind == 0   ? kFp32AbsOfMax
                        : kind == 1 ? kBf16AbsOfMax
                        : kind == 2 ? kInt8AbsOfMax
                                    : kInt4AbsOfMax) *
                       max_ref;
    int64_t outliers = 0, first = -1;
    for (size_t i = 0; i < e.size(); ++i) {
      if (!std::isfinite(e[i]) || !std::isfinite(a[i])) {
        if (std::isfinite(e[i]) != std::isfinite(a[i]))
          return ::testing::AssertionFailure()
                 << name << "[" << i << "]: expected " << e[i] << ", got " << a[i];
        continue;
      }
      const double d = std::fabs(static_cast<double>(e[i]) - a[i]);
      if (d > rel * std::fabs(static_cast<double>(e[i])) + abs) {
        if (first < 0) first = static_cast<int64_t>(i);
        ++outliers;
      }
    }
    const int64_t allowed = static_cast<int64_t>(kMaxOutlierFraction * static_cast<double>(e.size()));
    if (outliers > allowed)
      return ::testing::AssertionFailure()
             << name << ": " << outliers << " of " << e.size() << " elements outside the band (allowed "
             << allowed << "); first at " << first << ": expected " << e[first] << ", got "
             << a[first];
  }
  return ::testing::AssertionSuccess();
}

// ---- inputs ------------------------------------------------------------------------------------

namespace {

uint16_t float_to_fp16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const int32_t biased = static_cast<int32_t>((x >> 23) & 0xFFu);
  uint32_t man = x & 0x7FFFFFu;
  if (biased == 0xFF) return static_cast<uint16_t>(sign | 0x7C00u | (man ? 0x200u : 0u));
  const int32_t exp = biased - 127 + 15;
  if (exp >= 31) return static_cast<uint16_t>(sign | 0x7C00u);
  if (exp <= 0) {
    if (exp < -10) return static_cast<uint16_t>(sign);
    man |= 0x800000u;
    const int shift = 14 - exp;
    uint32_t h = man >> shift;
    const uint32_t rem = man & ((1u << shift) - 1u), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (h & 1u))) ++h;
    return static_cast<uint16_t>(sign | h);
  }
  uint32_t h = (static_cast<uint32_t>(exp) << 10) | (man >> 13);
  const uint32_t rem = man & 0x1FFFu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;
  return static_cast<uint16_t>(sign | h);
}

}  // namespace

float Operand::get(int64_t t, int64_t c) const {
  const int64_t i = offset + t * ld + c;
  if (dtype == FORGE_DTYPE_FP32) {
    float v;
    std::memcpy(&v, bytes.data() + 4 * i, 4);
    return v;
  }
  uint16_t h;
  std::memcpy(&h, bytes.data() + 2 * i, 2);
  return dtype == FORGE_DTYPE_BF16 ? forge::bf16_to_float(h) : forge::fp16_to_float(h);
}

void Operand::set(int64_t t, int64_t c, float v) {
  const int64_t i = offset + t * ld + c;
  if (dtype == FORGE_DTYPE_FP32) {
    std::memcpy(bytes.data() + 4 * i, &v, 4);
    return;
  }
  const uint16_t h = dtype == FORGE_DTYPE_BF16 ? forge::bf16_nearest(v) : float_to_fp16(v);
  std::memcpy(bytes.data() + 2 * i, &h, 2);
}

Operand make_operand(int64_t tokens, int64_t cols, forge_dtype dtype, int64_t ld, int64_t offset,
                     Fill fill, uint64_t seed) {
  Operand o;
  o.dtype = dtype;
  o.tokens = tokens;
  o.cols = cols;
  o.ld = ld;
  o.offset = offset;
  const int64_t elems = offset + (tokens - 1) * ld + cols;
  o.bytes.resize(static_cast<size_t>(elems) * o.elem_bytes());
  // The NaN pattern everywhere first: padding and offset keep it.
  for (int64_t i = 0; i < elems; ++i) {
    if (dtype == FORGE_DTYPE_FP32) {
      const uint32_t nan = 0x7FC00000u;
      std::memcpy(o.bytes.data() + 4 * i, &nan, 4);
    } else {
      const uint16_t nan = dtype == FORGE_DTYPE_BF16 ? 0x7FC0u : 0x7E00u;
      std::memcpy(o.bytes.data() + 2 * i, &nan, 2);
    }
  }
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> small(-4, 4);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t c = 0; c < cols; ++c)
      o.set(t, c, fill == Fill::kInteger ? static_cast<float>(small(rng)) / 8.0f : normal(rng));
  return o;
}

// ---- one step ------------------------------------------------------------------------------------

forge_wgrad_args wgrad_args(const void* x, const void* dy, const Operand& xo, const Operand& dyo,
                            const forge_hparams& hp, const forge_param& param, forge_device device,
                            double* sq, int64_t* nonfinite) {
  forge_wgrad_args a{};
  a.abi_version = FORGE_ABI_VERSION;
  a.device = device;
  a.tokens = xo.tokens;
  a.x = x;
  a.x_dtype = xo.dtype;
  a.ldx = xo.ld;
  a.dy = dy;
  a.dy_dtype = dyo.dtype;
  a.lddy = dyo.ld;
  a.param = param;
  a.hparams = hp;
  a.outputs.grad_sq_sum = sq;
  a.outputs.nonfinite_count = nonfinite;
  return a;
}

forge_elementwise_args elementwise_args(const void* grad, forge_dtype dtype, const forge_param& p,
                                        const forge_hparams& hp, forge_device device, double* sq,
                                        int64_t* nonfinite) {
  forge_elementwise_args a{};
  a.abi_version = FORGE_ABI_VERSION;
  a.device = device;
  a.grad = grad;
  a.grad_dtype = dtype;
  a.param = p;
  a.hparams = hp;
  a.outputs.grad_sq_sum = sq;
  a.outputs.nonfinite_count = nonfinite;
  return a;
}

void wgrad_cpu(const Operand& x, const Operand& dy, const forge_hparams& hp, HostParam& p,
               StepOutputs* out) {
  StepOutputs o;
  const forge_wgrad_args a =
      wgrad_args(x.data(), dy.data(), x, dy, hp, p.view(), cpu_device(), &o.grad_sq_sum, &o.nonfinite);
  FORGE_OK(forge_wgrad_step(&a));
  if (out) *out = o;
}

void wgrad_gpu(const Operand& x, const Operand& dy, const forge_hparams& hp,
               const HostParam& shape, DeviceParam& p, StepOutputs* out, cudaStream_t stream) {
  DeviceBuffer dx(x.bytes.size()), ddy(dy.bytes.size()), outputs(16);
  dx.upload(x.bytes.data(), x.bytes.size());
  ddy.upload(dy.bytes.data(), dy.bytes.size());
  outputs.fill(0);
  auto* sq = static_cast<double*>(outputs.data());
  auto* nonfinite = reinterpret_cast<int64_t*>(static_cast<uint8_t*>(outputs.data()) + 8);
  const forge_wgrad_args a = wgrad_args(static_cast<const uint8_t*>(dx.data()) + x.offset * x.elem_bytes(),
                                        static_cast<const uint8_t*>(ddy.data()) + dy.offset * dy.elem_bytes(),
                                        x, dy, hp, p.view(shape), gpu_device(stream), sq, nonfinite);
  FORGE_OK(forge_wgrad_step(&a));
  CUDA_OK(cudaStreamSynchronize(stream));
  CUDA_OK(cudaGetLastError());
  StepOutputs o;
  CUDA_OK(cudaMemcpy(&o.grad_sq_sum, sq, 8, cudaMemcpyDeviceToHost));
  CUDA_OK(cudaMemcpy(&o.nonfinite, nonfinite, 8, cudaMemcpyDeviceToHost));
  if (!dx.guards_intact() || !ddy.guards_intact() || !outputs.guards_intact())
    throw std::runtime_error("wgrad_gpu: a guard band of the inputs or outputs was written");
  if (out) *out = o;
}

// ---- the rule sweep --------------------------------------------------------------------------------

const std::vector<RuleCase>& rule_cases() {
  static const std::vector<RuleCase> cases = [] {
    std::vector<RuleCase> v;
    auto add = [&](const char* name, forge_rule rule, auto tweak) {
      forge_hparams hp{};
      forge_hparams_default(rule, &hp);
      hp.seed = 0x5EEDF00Dull;
      tweak(hp);
      v.push_back({name, hp});
    };
    add("SGD", FORGE_RULE_SGD, [](forge_hparams& h) { h.weight_decay = 0.01; });
    add("SGDMomentumDampening", FORGE_RULE_SGD_MOMENTUM, [](forge_hparams& h) {
      h.momentum = 0.9;
      h.dampening = 0.1;
      h.weight_decay = 0.01;
    });
    add("SGDNesterov", FORGE_RULE_SGD_MOMENTUM, [](forge_hparams& h) {
      h.momentum = 0.9;
      h.nesterov = 1;
      h.step = 3;
    });
    add("AdamW", FORGE_RULE_ADAMW, [](forge_hparams&) {});
    add("AdamWScaledMaximize", FORGE_RULE_ADAMW, [](forge_hparams& h) {
      h.grad_scale = 0.5;
      h.maximize = 1;
      h.step = 10;
    });
    add("AdamCoupledDecay", FORGE_RULE_ADAMW, [](forge_hparams& h) {
      h.decoupled_weight_decay = 0;
      h.weight_decay = 0.01;
    });
    add("NAdam", FORGE_RULE_NADAM, [](forge_hparams& h) {
      h.weight_decay = 0.01;
      h.decoupled_weight_decay = 1;
    });
    add("RAdamRectifying", FORGE_RULE_RADAM, [](forge_hparams& h) {
      h.weight_decay = 0.01;
      h.step = 5;  // steps 5, 6 unrectified, 7 rectified (rho_t crosses 5)
    });
    add("Lion", FORGE_RULE_LION, [](forge_hparams& h) { h.weight_decay = 0.1; });
    add("RMSprop", FORGE_RULE_RMSPROP, [](forge_hparams& h) { h.weight_decay = 0.01; });
    add("RMSpropCentered", FORGE_RULE_RMSPROP, [](forge_hparams& h) { h.centered = 1; });
    add("RMSpropMomentum", FORGE_RULE_RMSPROP, [](forge_hparams& h) { h.momentum = 0.9; });
    add("RMSpropCenteredMomentum", FORGE_RULE_RMSPROP, [](forge_hparams& h) {
      h.centered = 1;
      h.momentum = 0.5;
    });
    add("Adagrad", FORGE_RULE_ADAGRAD, [](forge_hparams& h) {
      h.lr_decay = 0.01;
      h.initial_accumulator_value = 0.1;
      h.weight_decay = 0.01;
      h.step = 2;
    });
    // Muon: the weight slot receives the direction; lr and weight_decay set, and not read.
    add("MuonNesterov", FORGE_RULE_MUON, [](forge_hparams& h) {
      h.lr = 0.02;
      h.weight_decay = 0.1;
      h.step = 4;
    });
    add("MuonPlain", FORGE_RULE_MUON, [](forge_hparams& h) {
      h.nesterov = 0;
      h.momentum = 0.9;
      h.maximize = 1;
      h.grad_scale = 0.5;
    });
    add("MuonLowMomentum", FORGE_RULE_MUON, [](forge_hparams& h) {
      h.momentum = 0.3;  // below 0.5: the other branch of each lerp
      h.dampening = 0.5;  // (not read: SGD's nesterov would refuse it)
    });
    return v;
  }();
  return cases;
}

const char* weight_format_name(forge_weight_format f) {
  switch (f) {
    case FORGE_WEIGHT_FP32: return "Wfp32";
    case FORGE_WEIGHT_BF16: return "Wbf16";
    case FORGE_WEIGHT_BF16_STOCHASTIC: return "Wbf16sr";
    default: return "Wbf16master";
  }
}

const char* state_format_name(forge_state_format f) {
  switch (f) {
    case FORGE_STATE_FP32: return "Sfp32";
    case FORGE_STATE_BF16: return "Sbf16";
    case FORGE_STATE_BF16_STOCHASTIC: return "Sbf16sr";
    case FORGE_STATE_FP8_BLOCK64: return "Sfp8";
    case FORGE_STATE_INT4_BLOCK64: return "Sint4";
    default: return "Sint8";
  }
}

const char* dtype_name(forge_dtype d) {
  switch (d) {
    case FORGE_DTYPE_FP32: return "fp32";
    case FORGE_DTYPE_BF16: return "bf16";
    default: return "fp16";
  }
}

}  // namespace fgt
