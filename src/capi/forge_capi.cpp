// forge_capi.cpp — the C ABI: checks every argument (the message names it),
// computes the rule's step scalars, and dispatches to the CPU or CUDA backend.
// No math here. Nothing is written unless every check passes, and no C++ exception
// leaves an entry point (guarded: bad_alloc is FORGE_ERR_OUT_OF_MEMORY, anything else
// FORGE_ERR_INTERNAL).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <new>
#include <vector>

#include "backend.h"
#include "capi/buffer_checks.h"
#include "core/formats.h"
#include "core/hparams.h"
#include "core/rule_table.h"
#include "core/run_scalars.h"
#include "core/status.h"
#include "forge/forge.h"

#ifndef FORGE_VERSION_STRING
#define FORGE_VERSION_STRING "0.0.0"
#endif

namespace forge {
namespace {

constexpr forge_status kBad = FORGE_ERR_INVALID_ARGUMENT;

// The body of an entry point, with every C++ exception turned into a status.
template <class Body>
forge_status guarded(const char* entry, Body&& body) noexcept {
  try {
    return body();
  } catch (const std::bad_alloc& e) {
    return fail(FORGE_ERR_OUT_OF_MEMORY, "%s: out of host memory (%s)", entry, e.what());
  } catch (const std::exception& e) {
    return fail(FORGE_ERR_INTERNAL, "%s: internal error: %s", entry, e.what());
  } catch (...) {
    return fail(FORGE_ERR_INTERNAL, "%s: internal error: an exception of unknown type", entry);
  }
}

forge_status check_device(const forge_device& d) {
  if (d.kind == FORGE_DEVICE_CPU) {
    // NOTE: the cap, because libgomp ends the process when it cannot create the threads.
    if (d.num_threads < 0 || d.num_threads > FORGE_MAX_CPU_THREADS)
      return fail(kBad, "device.num_threads: must be in 0 .. FORGE_MAX_CPU_THREADS = %d, got %d",
                  FORGE_MAX_CPU_THREADS, d.num_threads);
    return FORGE_OK;
  }
  if (d.kind == FORGE_DEVICE_CUDA) {
#if defined(FORGE_WITH_CUDA)
    if (d.index < 0) return fail(kBad, "device.index: must be >= 0, got %d", d.index);
    return FORGE_OK;
#else
    return fail(FORGE_ERR_UNSUPPORTED, "device.kind: CUDA, but this libforge was built without CUDA");
#endif
  }
  return fail(kBad, "device.kind: unknown value %d", d.kind);
}

forge_status check_dtype(int32_t t, const char* name) {
  if (t == FORGE_DTYPE_FP32 || t == FORGE_DTYPE_BF16 || t == FORGE_DTYPE_FP16) return FORGE_OK;
  return fail(kBad, "%s: unknown dtype %d", name, t);
}

// rows × cols elements whose bytes (4 each at most) count in int64.
forge_status check_shape(int64_t rows, int64_t cols, const char* rows_name, const char* cols_name) {
  if (rows <= 0) return fail(kBad, "%s: must be > 0, got %lld", rows_name, static_cast<long long>(rows));
  if (cols <= 0) return fail(kBad, "%s: must be > 0, got %lld", cols_name, static_cast<long long>(cols));
  int64_t n;
  if (!product_within(rows, cols, kMaxElements, &n))
    return fail(kBad, "%s × %s: %lld × %lld elements, more than 2^61 (4 bytes each must count in "
                "int64)", rows_name, cols_name, static_cast<long long>(rows),
                static_cast<long long>(cols));
  return FORGE_OK;
}

// Where a shard lies in its full parameter (forge_param's row_offset, col_offset, full_cols).
// `p`'s shape and state format are checked.
forge_status check_shard(const forge_param& p) {
  const long long ro = p.row_offset, co = p.col_offset, fc = p.full_cols;
  if (ro < 0) return fail(kBad, "param.row_offset: must be >= 0, got %lld", ro);
  if (co < 0) return fail(kBad, "param.col_offset: must be >= 0, got %lld", co);
  if (fc < 0) return fail(kBad, "param.full_cols: must be >= 0 (0: not a shard), got %lld", fc);
  if (fc == 0) {
    if (ro != 0 || co != 0)
      return fail(kBad, "param.full_cols: 0 (not a shard), but param.row_offset = %lld and "
                  "param.col_offset = %lld (both must be 0 then)", ro, co);
    return FORGE_OK;
  }
  // (the message gives the terms, not their sum, which may not fit int64)
  if (co > fc - p.cols)
    return fail(kBad, "param.full_cols: %lld, but the shard's columns end past it, at "
                "param.col_offset + param.cols = %lld + %lld", fc, co,
                static_cast<long long>(p.cols));
  // Every element's index in the full parameter, (row_offset + rows) · full_cols, counts in
  // int64 like an element count.
  int64_t indices = 0;
  if (ro > kMaxElements - p.rows || !product_within(ro + p.rows, fc, kMaxElements, &indices))
    return fail(kBad, "param.row_offset: %lld: the full parameter's element indices "
                "((param.row_offset + param.rows) × param.full_cols) exceed 2^61", ro);
  if (is_block_format(p.state_format)) {
    if (co % FORGE_INT8_BLOCK != 0)
      return fail(kBad, "param.col_offset: %lld is not a multiple of %d, which block states "
                  "need (one absmax per %d columns of a row of the full parameter)", co,
                  FORGE_INT8_BLOCK, FORGE_INT8_BLOCK);
    const long long end = co + static_cast<long long>(p.cols);
    if (end % FORGE_INT8_BLOCK != 0 && end != fc)
      return fail(kBad, "param.col_offset + param.cols: the shard ends at column %lld of "
                  "param.full_cols = %lld, inside a block of %d: block states (int8, fp8, int4) "
                  "need shards of whole blocks (or one that ends the row)", end, fc,
                  FORGE_INT8_BLOCK);
  }
  return FORGE_OK;
}

// Shape, formats and shard placement only (no states).
forge_status check_param_shape(const forge_param& p) {
  if (forge_status s = check_shape(p.rows, p.cols, "param.rows", "param.cols")) return s;
  if (p.state_format < 0 || p.state_format >= FORGE_STATE_FORMAT_COUNT)
    return fail(kBad, "param.state_format: unknown value %d", p.state_format);
  return check_shard(p);
}

forge_status check_state(const forge_param& p, int i) {
  if (!p.state[i]) return fail(kBad, "param.state[%d]: NULL, but the rule keeps this state", i);
  if (is_block_format(p.state_format) && !p.state_absmax[i])
    return fail(kBad, "param.state_absmax[%d]: NULL, but block states (int8, fp8, int4) need an "
                "absmax buffer", i);
  return FORGE_OK;
}

// Everything a step reads or writes of the parameter.
forge_status check_param(const forge_param& p, const RuleScalars& k) {
  if (forge_status s = check_param_shape(p)) return s;
  if (p.weight_format < 0 || p.weight_format >= FORGE_WEIGHT_FORMAT_COUNT)
    return fail(kBad, "param.weight_format: unknown value %d", p.weight_format);
  if (!p.weight) return fail(kBad, "param.weight: NULL");
  if (p.weight_format == FORGE_WEIGHT_BF16_MASTER && !p.master)
    return fail(kBad, "param.master: NULL, but weight_format is FORGE_WEIGHT_BF16_MASTER");
  if (p.weight_format != FORGE_WEIGHT_BF16_MASTER && p.master)
    return fail(kBad, "param.master: set, but weight_format is not FORGE_WEIGHT_BF16_MASTER");
  for (int i = 0; i < k.num_states; ++i)
    if (forge_status s = check_state(p, i)) return s;
  return FORGE_OK;
}


// What a CPU step reads before it writes, checked at the call (host memory, read only; the
// CUDA backend does not read device memory at the call): a run_scalars buffer's tag, so that a
// batch refuses a later entry's before any entry runs; and the block states' absmax arrays, which
// must hold what steps store: values in [0, the largest bf16] (NaN, infinities and negative
// values refused, naming the block), so a block whose absmax was set by hand never makes its
// elements skip forever (forge.h, "Skipped elements").
forge_status check_cpu_contents(const forge_param& p, const forge_hparams& hp,
                                const RuleScalars& k) {
  if (hp.run_scalars)
    if (forge_status s = run_scalars_check(hp.run_scalars, hp, k)) return s;
  const int num_states = k.num_states;
  if (!is_block_format(p.state_format)) return FORGE_OK;
  const int64_t blocks = p.rows * ((p.cols + FORGE_INT8_BLOCK - 1) / FORGE_INT8_BLOCK);
  for (int i = 0; i < num_states; ++i) {
    const float* absmax = p.state_absmax[i];
    for (int64_t b = 0; b < blocks; ++b)
      if (!(absmax[b] >= 0.0f && absmax[b] <= kBf16Max))
        return fail(kBad, "param.state_absmax[%d][%lld]: %g is not an absmax a step stores (in "
                    "[0, %g], the largest bf16)", i, static_cast<long long>(b),
                    static_cast<double>(absmax[b]), static_cast<double>(kBf16Max));
  }
  return FORGE_OK;
}

// `k` (nullable) receives the step's scalars.
forge_status check_hparams(const forge_hparams* hp, RuleScalars* k = nullptr) {
  if (!hp) return fail(kBad, "hparams: NULL");
  if (reinterpret_cast<uintptr_t>(hp->run_scalars) % 16 != 0)
    return fail(kBad, "hparams.run_scalars: %p is not 16-byte aligned", hp->run_scalars);
  return validate_hparams(*hp, k);
}

template <typename Args>
forge_status check_step_common(const Args* a, const char* what, RuleScalars* k) {
  if (!a) return fail(kBad, "args: NULL (%s)", what);
  if (a->abi_version != FORGE_ABI_VERSION)
    return fail(kBad, "args.abi_version: %d, this library speaks %d", a->abi_version, FORGE_ABI_VERSION);
  if (forge_status s = check_device(a->device)) return s;
  return check_hparams(&a->hparams, k);
}

// An input of `tokens` rows of `extent` elements, `ld` apart: ld >= extent, and the
// (tokens − 1) · ld + extent elements it spans count their bytes in int64.
forge_status check_input_extent(int64_t tokens, int64_t ld, int64_t extent, const char* ld_name,
                                const char* extent_name, const char* input, int64_t* elements) {
  if (ld < extent)
    return fail(kBad, "%s: %lld is smaller than a row of %s (%s = %lld)", ld_name,
                static_cast<long long>(ld), input, extent_name, static_cast<long long>(extent));
  int64_t span;
  if (!product_within(tokens - 1, ld, kMaxElements - extent, &span))
    return fail(kBad, "%s × tokens: %lld × %lld elements of %s, more than 2^61 (4 bytes each "
                "must count in int64)", ld_name, static_cast<long long>(ld),
                static_cast<long long>(tokens), input);
  *elements = span + extent;
  return FORGE_OK;
}

// The step's outputs and run_scalars, after the parameter's and the inputs' buffers.
forge_status add_step_extras(BufferSet& set, const forge_step_outputs& out,
                             const forge_hparams& hp) {
  if (out.grad_sq_sum)
    if (forge_status s = set.add("outputs.grad_sq_sum", out.grad_sq_sum, 8, 8, "double", true))
      return s;
  if (out.nonfinite_count)
    if (forge_status s = set.add("outputs.nonfinite_count", out.nonfinite_count, 8, 8, "int64", true))
      return s;
  if (hp.run_scalars)
    if (forge_status s = set.add("hparams.run_scalars", hp.run_scalars, FORGE_RUN_SCALARS_BYTES,
                                 16, "run scalars", false))
      return s;
  return set.check_overlaps();
}

forge_status check_wgrad(const forge_wgrad_args* a, RuleScalars* k) {
  if (forge_status s = check_step_common(a, "forge_wgrad_step", k)) return s;
  if (forge_status s = check_param(a->param, *k)) return s;
  if (a->tokens <= 0) return fail(kBad, "tokens: must be > 0, got %lld", static_cast<long long>(a->tokens));
  if (!a->x) return fail(kBad, "x: NULL");
  if (!a->dy) return fail(kBad, "dy: NULL");
  if (forge_status s = check_dtype(a->x_dtype, "x_dtype")) return s;
  if (forge_status s = check_dtype(a->dy_dtype, "dy_dtype")) return s;
  int64_t x_elements = 0, dy_elements = 0;
  if (forge_status s = check_input_extent(a->tokens, a->ldx, a->param.cols, "ldx", "param.cols",
                                          "x", &x_elements))
    return s;
  if (forge_status s = check_input_extent(a->tokens, a->lddy, a->param.rows, "lddy",
                                          "param.rows", "dy", &dy_elements))
    return s;
  if (a->tile_rows < 0 || a->tile_rows > FORGE_MAX_TILE)
    return fail(kBad, "tile_rows: must be in 0 .. FORGE_MAX_TILE = %d (0 = default), got %d",
                FORGE_MAX_TILE, a->tile_rows);
  if (a->tile_cols < 0 || a->tile_cols > FORGE_MAX_TILE)
    return fail(kBad, "tile_cols: must be in 0 .. FORGE_MAX_TILE = %d (0 = default), got %d",
                FORGE_MAX_TILE, a->tile_cols);
  if (is_block_format(a->param.state_format) && a->tile_cols % FORGE_INT8_BLOCK != 0)
    return fail(kBad, "tile_cols: %d is not a multiple of %d, which block states (int8, fp8, "
                "int4) need", a->tile_cols, FORGE_INT8_BLOCK);
  BufferSet set;
  if (forge_status s = add_param_buffers(set, a->param, k->num_states)) return s;
  const int xb = dtype_bytes(a->x_dtype), dyb = dtype_bytes(a->dy_dtype);
  if (forge_status s = set.add("x", a->x, x_elements * xb, xb, xb == 4 ? "fp32" : "16-bit", false))
    return s;
  if (forge_status s = set.add("dy", a->dy, dy_elements * dyb, dyb, dyb == 4 ? "fp32" : "16-bit", false))
    return s;
  if (forge_status s = add_step_extras(set, a->outputs, a->hparams)) return s;
  if (a->device.kind == FORGE_DEVICE_CPU) return check_cpu_contents(a->param, a->hparams, *k);
  return FORGE_OK;
}

// `buffers` (optional) receives every buffer the call reads or writes: the parameter's, the
// gradient, the step's outputs and run scalars.
forge_status check_elementwise(const forge_elementwise_args* a, RuleScalars* k,
                               BufferSet* buffers = nullptr) {
  if (forge_status s = check_step_common(a, "forge_elementwise_step", k)) return s;
  if (forge_status s = check_param(a->param, *k)) return s;
  if (!a->grad) return fail(kBad, "grad: NULL");
  if (forge_status s = check_dtype(a->grad_dtype, "grad_dtype")) return s;
  BufferSet set;
  if (forge_status s = add_param_buffers(set, a->param, k->num_states)) return s;
  const int gb = dtype_bytes(a->grad_dtype);
  if (forge_status s = set.add("grad", a->grad, a->param.rows * a->param.cols * gb, gb,
                               gb == 4 ? "fp32" : "16-bit", false))
    return s;
  if (forge_status s = add_step_extras(set, a->outputs, a->hparams)) return s;
  if (a->device.kind == FORGE_DEVICE_CPU)
    if (forge_status s = check_cpu_contents(a->param, a->hparams, *k)) return s;
  if (buffers) *buffers = set;
  return FORGE_OK;
}

// A refusal of entry i of a batch: its message, prefixed with "args[i]: ".
forge_status fail_entry(forge_status code, int64_t i) {
  char message[1024];
  std::snprintf(message, sizeof(message), "%s", last_error());
  return fail(code, "args[%lld]: %s", static_cast<long long>(i), message);
}

// Whether `r` is one of a step's outputs (forge_step_outputs), which the entries of a batch
// may share: the same grad_sq_sum, the same nonfinite_count.
bool is_step_output(const BufferSet::Range& r) {
  return std::strncmp(r.name, "outputs.", 8) == 0;
}

// No two entries of a batch share bytes where either writes, except one output that several
// entries name as the same output (the same bytes, the same field of forge_step_outputs):
// those are one buffer, added to in turn. Within an entry overlaps were checked
// (check_elementwise), so once the shared outputs are kept once (by their first entry) and
// every entry's ranges are sorted by start, a range overlaps an earlier one of another entry
// exactly when it starts below the largest end so far among the earlier ranges it conflicts
// with (written ones for a read range, all for a written one).
forge_status check_batch_overlaps(const std::vector<BufferSet>& buffers) {
  struct Owned {
    BufferSet::Range range;
    int64_t entry;
  };
  std::vector<Owned> all;
  for (size_t e = 0; e < buffers.size(); ++e)
    for (int i = 0; i < buffers[e].count(); ++i)
      all.push_back({buffers[e].range(i), static_cast<int64_t>(e)});
  // (ties by entry, so the later of two entries with the same start is the one reported)
  std::sort(all.begin(), all.end(), [](const Owned& a, const Owned& b) {
    return a.range.begin != b.range.begin ? a.range.begin < b.range.begin : a.entry < b.entry;
  });
  // A shared output: the same range and field as the earlier entry's, which stands for both.
  // (Ranges of one start are adjacent; within an entry two outputs never share a start.)
  std::vector<Owned> kept;
  kept.reserve(all.size());
  for (const Owned& o : all) {
    bool shared = false;
    if (is_step_output(o.range))
      for (size_t j = kept.size(); j-- > 0 && kept[j].range.begin == o.range.begin;)
        if (kept[j].range.end == o.range.end && is_step_output(kept[j].range) &&
            std::strcmp(kept[j].range.name, o.range.name) == 0)
          shared = true;
    if (!shared) kept.push_back(o);
  }
  // (an end of 0, the top of memory, counts as the largest address)
  auto end_of = [](const BufferSet::Range& r) { return r.end ? r.end : UINTPTR_MAX; };
  const Owned* last_any = nullptr;      // the earlier range reaching farthest
  const Owned* last_written = nullptr;  // the same among written ranges
  for (const Owned& o : kept) {
    const Owned* other = o.range.written ? last_any : last_written;
    if (other && end_of(other->range) > o.range.begin)
      return fail(kBad, "args[%lld].%s overlaps args[%lld].%s (%s)", static_cast<long long>(o.entry),
                  o.range.name, static_cast<long long>(other->entry), other->range.name,
                  o.range.written && other->range.written ? "both are written"
                                                          : "one is written while the other is read");
    if (!last_any || end_of(o.range) > end_of(last_any->range)) last_any = &o;
    if (o.range.written && (!last_written || end_of(o.range) > end_of(last_written->range)))
      last_written = &o;
  }
  return FORGE_OK;
}

// Shared checks of the state entry points; returns the state's signedness. `buffer` is the
// caller's fp32 [rows, cols] (`buffer_written`: the call writes it, else it writes the state).
forge_status check_state_access(const forge_param* p, const forge_hparams* hp, int index,
                                const void* buffer, const char* buffer_name, bool buffer_written,
                                const forge_device& device, bool* is_signed) {
  if (!p) return fail(kBad, "param: NULL");
  if (forge_status s = check_hparams(hp)) return s;
  if (forge_status s = check_device(device)) return s;
  if (forge_status s = check_param_shape(*p)) return s;
  forge_state_layout layout{};
  if (forge_status s = state_layout(*hp, p->state_format, p->rows, p->cols, &layout)) return s;
  if (index < 0 || index >= layout.num_states)
    return fail(kBad, "index: %d, but this rule keeps %d state(s)", index, layout.num_states);
  if (forge_status s = check_state(*p, index)) return s;
  if (!buffer) return fail(kBad, "%s: NULL", buffer_name);
  BufferSet set;
  if (forge_status s = add_state_buffers(set, *p, index, !buffer_written)) return s;
  if (forge_status s = set.add(buffer_name, buffer, p->rows * p->cols * 4, 4, "fp32", buffer_written))
    return s;
  if (forge_status s = set.check_overlaps()) return s;
  *is_signed = layout.is_signed[index] != 0;
  return FORGE_OK;
}

forge_status check_enum_kind(int32_t kind) {
  if (enum_count(kind) == 0)
    return fail(kBad, "kind: unknown value %d (a forge_enum: 0 .. %d)", kind, FORGE_ENUM_COUNT - 1);
  return FORGE_OK;
}

bool equal_ignoring_case(const char* a, const char* b) {
  for (; *a && *b; ++a, ++b) {
    const char ca = (*a >= 'A' && *a <= 'Z') ? static_cast<char>(*a - 'A' + 'a') : *a;
    const char cb = (*b >= 'A' && *b <= 'Z') ? static_cast<char>(*b - 'A' + 'a') : *b;
    if (ca != cb) return false;
  }
  return *a == *b;
}

}  // namespace
}  // namespace forge

using namespace forge;

#if defined(FORGE_WITH_CUDA)
#define FORGE_DISPATCH(device, call) \
  ((device).kind == FORGE_DEVICE_CUDA ? forge::cuda::call : forge::cpu::call)
#else
#define FORGE_DISPATCH(device, call) (forge::cpu::call)
#endif

extern "C" {

int32_t forge_abi_version(void) { return FORGE_ABI_VERSION; }
const char* forge_version_string(void) { return FORGE_VERSION_STRING; }

uint32_t forge_capabilities(void) {
  uint32_t caps = FORGE_CAP_CPU;
#if defined(_OPENMP)
  caps |= FORGE_CAP_OPENMP;
#endif
#if defined(FORGE_WITH_CUDA)
  caps |= FORGE_CAP_CUDA;
#endif
  return caps;
}

const char* forge_last_error(void) { return last_error(); }

forge_status forge_hparams_default(int32_t rule, forge_hparams* out) {
  clear_error();
  return guarded("forge_hparams_default", [&]() -> forge_status {
    return default_hparams(rule, out);
  });
}

forge_status forge_state_layout_query(const forge_hparams* hparams, int32_t format,
                                      int64_t rows, int64_t cols, forge_state_layout* out) {
  clear_error();
  return guarded("forge_state_layout_query", [&]() -> forge_status {
    if (forge_status s = check_hparams(hparams)) return s;
    if (!out) return fail(kBad, "out: NULL");
    if (forge_status s = check_shape(rows, cols, "rows", "cols")) return s;
    return state_layout(*hparams, format, rows, cols, out);
  });
}

forge_status forge_enum_count(int32_t kind, int32_t* count) {
  clear_error();
  return guarded("forge_enum_count", [&]() -> forge_status {
    if (forge_status s = check_enum_kind(kind)) return s;
    if (!count) return fail(kBad, "count: NULL");
    *count = enum_count(kind);
    return FORGE_OK;
  });
}

forge_status forge_enum_name(int32_t kind, int32_t value, const char** name) {
  clear_error();
  return guarded("forge_enum_name", [&]() -> forge_status {
    if (forge_status s = check_enum_kind(kind)) return s;
    if (!name) return fail(kBad, "name: NULL");
    const char* n = enum_name(kind, value);
    if (!n)
      return fail(kBad, "value: %d is not a %s (0 .. %d)", value, enum_kind_name(kind),
                  enum_count(kind) - 1);
    *name = n;
    return FORGE_OK;
  });
}

forge_status forge_enum_value(int32_t kind, const char* name, int32_t* value) {
  clear_error();
  return guarded("forge_enum_value", [&]() -> forge_status {
    if (forge_status s = check_enum_kind(kind)) return s;
    if (!name) return fail(kBad, "name: NULL");
    if (!value) return fail(kBad, "value: NULL");
    for (int v = 0; v < enum_count(kind); ++v)
      if (equal_ignoring_case(name, enum_name(kind, v))) {
        *value = v;
        return FORGE_OK;
      }
    char known[256] = "";
    for (int v = 0; v < enum_count(kind); ++v) {
      const size_t used = std::strlen(known);
      std::snprintf(known + used, sizeof(known) - used, "%s\"%s\"", v ? ", " : "",
                    enum_name(kind, v));
    }
    return fail(kBad, "name: \"%.64s\" is no %s (known: %s)", name, enum_kind_name(kind), known);
  });
}

forge_status forge_rule_query(int32_t rule, forge_rule_info* out) {
  clear_error();
  return guarded("forge_rule_query", [&]() -> forge_status {
    const RuleInfo* info = rule_info(rule);
    if (!info) return fail(kBad, "rule: unknown value %d", rule);
    if (!out) return fail(kBad, "out: NULL");
    forge_rule_info r{};
    r.name = info->name;
    for (int f = 0; f < kFieldCount; ++f)
      if (rule_reads(*info, f)) r.fields[r.num_fields++] = field_info(f).name;
    r.max_states = info->max_states;
    for (int i = 0; i < info->max_states; ++i) {
      const StateInfo& s = info->states[i];
      r.state_names[i] = s.name;
      r.state_signed[i] = s.is_signed ? 1 : 0;
      r.state_condition[i] = s.when == StateWhen::kCentered   ? "centered"
                             : s.when == StateWhen::kMomentum ? "momentum"
                                                              : nullptr;
    }
    *out = r;
    return FORGE_OK;
  });
}

forge_status forge_struct_size(const char* name, int64_t* size) {
  clear_error();
  return guarded("forge_struct_size", [&]() -> forge_status {
    if (!name) return fail(kBad, "name: NULL");
    if (!size) return fail(kBad, "size: NULL");
    static const struct {
      const char* name;
      int64_t size;
    } kStructs[] = {
        {"forge_device", sizeof(forge_device)},
        {"forge_hparams", sizeof(forge_hparams)},
        {"forge_param", sizeof(forge_param)},
        {"forge_step_outputs", sizeof(forge_step_outputs)},
        {"forge_wgrad_args", sizeof(forge_wgrad_args)},
        {"forge_elementwise_args", sizeof(forge_elementwise_args)},
        {"forge_state_layout", sizeof(forge_state_layout)},
        {"forge_rule_info", sizeof(forge_rule_info)},
    };
    for (const auto& s : kStructs)
      if (std::strcmp(name, s.name) == 0) {
        *size = s.size;
        return FORGE_OK;
      }
    return fail(kBad, "name: \"%.64s\" is no public struct of forge.h", name);
  });
}

forge_status forge_state_init(const forge_param* param, const forge_hparams* hparams,
                              forge_device device) {
  clear_error();
  return guarded("forge_state_init", [&]() -> forge_status {
    if (!param) return fail(kBad, "param: NULL");
    if (forge_status s = check_hparams(hparams)) return s;
    if (forge_status s = check_device(device)) return s;
    if (forge_status s = check_param_shape(*param)) return s;
    forge_state_layout layout{};
    if (forge_status s = state_layout(*hparams, param->state_format, param->rows, param->cols, &layout))
      return s;
    for (int i = 0; i < layout.num_states; ++i)
      if (forge_status s = check_state(*param, i)) return s;
    BufferSet set;
    for (int i = 0; i < layout.num_states; ++i)
      if (forge_status s = add_state_buffers(set, *param, i, true)) return s;
    if (forge_status s = set.check_overlaps()) return s;
    for (int i = 0; i < layout.num_states; ++i) {
      const bool adagrad_sum = hparams->rule == FORGE_RULE_ADAGRAD && i == 0;
      const float value = adagrad_sum ? static_cast<float>(hparams->initial_accumulator_value) : 0.0f;
      if (forge_status s = FORGE_DISPATCH(device, state_fill(*param, i, layout.is_signed[i], value, device)))
        return s;
    }
    return FORGE_OK;
  });
}

forge_status forge_state_to_fp32(const forge_param* param, const forge_hparams* hparams,
                                 int32_t index, float* out, forge_device device) {
  clear_error();
  return guarded("forge_state_to_fp32", [&]() -> forge_status {
    bool is_signed = false;
    if (forge_status s = check_state_access(param, hparams, index, out, "out", true, device, &is_signed))
      return s;
    return FORGE_DISPATCH(device, state_to_fp32(*param, index, is_signed, out, device));
  });
}

forge_status forge_state_from_fp32(const forge_param* param, const forge_hparams* hparams,
                                   int32_t index, const float* in, forge_device device) {
  clear_error();
  return guarded("forge_state_from_fp32", [&]() -> forge_status {
    bool is_signed = false;
    if (forge_status s = check_state_access(param, hparams, index, in, "in", false, device, &is_signed))
      return s;
    return FORGE_DISPATCH(device, state_from_fp32(*param, index, is_signed, in, device));
  });
}

forge_status forge_run_scalars_fill(const forge_hparams* hparams, void* out, int64_t bytes) {
  clear_error();
  return guarded("forge_run_scalars_fill", [&]() -> forge_status {
    if (!hparams) return fail(kBad, "hparams: NULL");
    RuleScalars k;
    if (forge_status s = validate_hparams(*hparams, &k)) return s;
    if (!out) return fail(kBad, "out: NULL");
    if (bytes < FORGE_RUN_SCALARS_BYTES)
      return fail(kBad, "bytes: %lld, but a run_scalars buffer is FORGE_RUN_SCALARS_BYTES = %d",
                  static_cast<long long>(bytes), FORGE_RUN_SCALARS_BYTES);
    run_scalars_write(*hparams, k, out);
    return FORGE_OK;
  });
}

forge_status forge_wgrad_step(const forge_wgrad_args* args) {
  clear_error();
  return guarded("forge_wgrad_step", [&]() -> forge_status {
    RuleScalars k;
    if (forge_status s = check_wgrad(args, &k)) return s;
    return FORGE_DISPATCH(args->device, wgrad_step(*args, k));
  });
}

forge_status forge_elementwise_step(const forge_elementwise_args* args) {
  clear_error();
  return guarded("forge_elementwise_step", [&]() -> forge_status {
    RuleScalars k;
    if (forge_status s = check_elementwise(args, &k)) return s;
    return FORGE_DISPATCH(args->device, elementwise_step(*args, k));
  });
}

forge_status forge_elementwise_step_batch(const forge_elementwise_args* const* args,
                                          int64_t count) {
  clear_error();
  return guarded("forge_elementwise_step_batch", [&]() -> forge_status {
    if (count < 0) return fail(kBad, "count: must be >= 0, got %lld", static_cast<long long>(count));
    if (count == 0) return FORGE_OK;
    if (!args) return fail(kBad, "args: NULL with count %lld", static_cast<long long>(count));
    std::vector<RuleScalars> k(static_cast<size_t>(count));
    std::vector<BufferSet> buffers(static_cast<size_t>(count));
    for (int64_t i = 0; i < count; ++i)
      if (forge_status s = check_elementwise(args[i], &k[i], &buffers[i])) return fail_entry(s, i);
    if (forge_status s = check_batch_overlaps(buffers)) return s;
    for (int64_t i = 0; i < count; ++i)
      if (forge_status s = FORGE_DISPATCH(args[i]->device, elementwise_step(*args[i], k[i])))
        return fail_entry(s, i);
    return FORGE_OK;
  });
}

}  // extern "C"
