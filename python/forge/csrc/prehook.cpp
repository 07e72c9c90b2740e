// prehook.cpp — a fused Linear's backward and its weight's AccumulateGrad pre-hook in C++
// (forge/_prehook.py builds it against the torch in use).
//
// The Python routing (forge/optim/routing.py) runs a fused weight's update when autograd
// reaches W's AccumulateGrad node, i.e. once every use of W in this backward is done. Entering
// Python there, and in the Linear's own backward, costs the host more than the update itself
// on small models, so where this extension is built:
//   - the Linear's forward (eager, with or without autocast; forge/_linear.py) makes a
//     FusedLinearBackward node: its backward computes dX and db as the Python Function does
//     and, where the weight's record is ready for this step (Python wrote the call's kept
//     forge_wgrad_args at the step's first update and readied the record), writes the
//     operands into those args, arms the record and returns W's stand-in gradient;
//   - the node's pre-hook, seeing its record armed and the stand-in arrive alone, calls
//     forge_wgrad_step through the library's function pointer, leaves the ConsumedGrad in
//     W.grad and drops the gradient; Python commits the call's step count when it next meets
//     the weight (Record::settle).
//   - in a compiled backward (forge/_ops.py), the hand-off operator's kernel arms the record
//     as the Linear's backward does, where it is ready, and returns the stand-in; a hand-off
//     that may not keep X and dY forms dW (W's dtype, as the Python hand-off forms it) and
//     arms the record's element-wise call with it (Python readied that call too, for a
//     weight whose hand-off formed dW before), which the pre-hook makes the same way.
// Anything else (not ready, armed already, another gradient, a refusal) goes to the Python
// routing, with the GIL, which stays the reference; so does the post-hook's fallback, only
// where no pre-hook ran.
#include <torch/extension.h>
#include <torch/library.h>
#include <torch/csrc/autograd/edge.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/variable.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <climits>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

namespace {

using torch::autograd::variable_list;
// forge_wgrad_step(const forge_wgrad_args*) or forge_elementwise_step(const ..._args*)
using StepFn = int (*)(const void*);

// forge_wgrad_args' operand fields (tokens, x, x_dtype, ldx, dy, dy_dtype, lddy): byte
// offset and size of each, from forge/_lib.py's struct (set_operand_layout).
enum Operand { kTokens, kX, kXDtype, kLdx, kDy, kDyDtype, kLddy, kOperands };
struct Field {
  size_t offset = 0, size = 0;
};
Field operand_fields[kOperands];
bool operand_layout_set = false;
// forge_elementwise_args' gradient fields (grad, grad_dtype), from forge/_lib.py's struct
// (set_grad_layout).
enum GradField { kGrad, kGradDtype, kGradFields };
Field grad_fields[kGradFields];
bool grad_layout_set = false;
int dtype_code_fp32 = -1, dtype_code_bf16 = -1, dtype_code_fp16 = -1;  // set_dtype_codes

int dtype_code(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return dtype_code_fp32;
    case at::kBFloat16: return dtype_code_bf16;
    case at::kHalf: return dtype_code_fp16;
    default: return -1;
  }
}

void write_at(void* args, const Field& f, int64_t value) {
  char* at = static_cast<char*>(args) + f.offset;
  if (f.size == 4) {
    const int32_t v = static_cast<int32_t>(value);
    std::memcpy(at, &v, 4);
  } else {
    std::memcpy(at, &value, 8);
  }
}

int64_t read_at(const void* args, const Field& f) {
  const char* at = static_cast<const char*>(args) + f.offset;
  if (f.size == 4) {
    int32_t v;
    std::memcpy(&v, at, 4);
    return v;
  }
  int64_t v;
  std::memcpy(&v, at, 8);
  return v;
}

void write_field(void* args, Operand which, int64_t value) {
  write_at(args, operand_fields[which], value);
}

// The (offset, size) of `count` fields, as forge/_prehook.py reads them from forge/_lib.py.
void set_fields(const std::vector<std::pair<size_t, size_t>>& given, Field* fields, int count) {
  TORCH_CHECK(given.size() == static_cast<size_t>(count), "forge: ", count, " fields expected");
  for (int i = 0; i < count; ++i) {
    TORCH_CHECK(given[i].second == 4 || given[i].second == 8, "forge: field size ",
                given[i].second);
    fields[i] = {given[i].first, given[i].second};
  }
}

// One optimizer's readiness epoch: a record is ready while its epoch is the clock's. Python
// advances the clock at each step's check (then readies the records it checked) and wherever
// the ready calls lapse (step(), a capture, a mode switch, loaded states).
struct Clock {
  int64_t epoch = 0;
  int64_t advance() { return ++epoch; }
};

enum class State { kIdle, kArmed, kCalled };

// One fused weight's prepared update, shared by its node hooks, its Linear's backward nodes
// and its slot (Python).
struct Record {
  at::Tensor weight;
  at::Tensor stand_in;  // W's stand-in gradient: the hook knows it by identity
  at::Tensor consumed;  // what W.grad becomes once the update ran
  at::Tensor x, dy;     // the armed call's operands, released once it ran
  int64_t ldx = 0, lddy = 0;
  at::Tensor dw;        // the armed element-wise call's gradient (dense), released once it ran
  bool dense = false;   // what is armed: the element-wise call on dw (else the fused one)
  void* args = nullptr;  // the kept forge_wgrad_args
  StepFn wgrad_step = nullptr;
  void* dense_args = nullptr;  // the kept forge_elementwise_args (a weight that formed dW)
  StepFn elementwise_step = nullptr;
  int64_t dense_epoch = -1;  // the clock's epoch when Python readied dense_args; -1: not
  std::shared_ptr<Clock> clock;
  int64_t ready_epoch = -1;    // the clock's epoch when Python readied the args; -1: not
  c10::StreamId stream_id = 0;  // the CUDA stream current then (the args hold its handle)
  State state = State::kIdle;
  bool armed_in_graph = false;  // armed by a compiled backward's hand-off (hand_off)
  bool pre_ran = false;  // the pre-hook ran since the last post-hook
  bool enabled = true;   // false: gradients pass through (the optimizer was detached)
  py::object keep;       // the ctypes object at `args`, alive while the record is
  py::object keep_dense;  // the ctypes object at `dense_args`
  py::object fallback;   // the Python pre-hook: (grads tuple) -> None or a tuple
  py::object post_fallback;    // the Python post-hook, () -> None: where no pre-hook ran
  py::object on_error;         // (status, call's name) -> raises the library's error
  py::object linear_fallback;  // the Python Linear backward: (x, dy, weight) -> dW or None

  ~Record() {
    if (!Py_IsInitialized()) {
      // The interpreter is gone: a node still queued when the process exits (torch 2.4 keeps
      // a failed backward's nodes in the thread's ready queue until its thread-local
      // destructors run). Taking the GIL would wait forever; the objects go with the process.
      for (py::object* o :
           {&keep, &keep_dense, &fallback, &post_fallback, &on_error, &linear_fallback})
        o->release();
      return;
    }
    // (the node that owns the hook may go on autograd's thread, without the GIL)
    py::gil_scoped_acquire gil;
    keep = py::object();
    keep_dense = py::object();
    fallback = py::object();
    post_fallback = py::object();
    on_error = py::object();
    linear_fallback = py::object();
  }

  // Python's readiness for this step: the kept args hold everything but the operands.
  void ready() {
    ready_epoch = clock->epoch;
    if (weight.is_cuda())
      stream_id = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(weight.device()).id();
  }

  // Arms the update with X [T, cols] (row stride ldx) and dY [T, rows] whose operands
  // are written (Python's arming, or try_arm). The readiness is used up: one call per step.
  void arm(at::Tensor x_, int64_t ldx_, at::Tensor dy_, int64_t lddy_) {
    x = std::move(x_);
    dy = std::move(dy_);
    ldx = ldx_;
    lddy = lddy_;
    dense = false;
    state = State::kArmed;
    armed_in_graph = false;
    ready_epoch = -1;
  }

  // Whether an update of this step may be armed with these operands now: the args ready for
  // this step, on this stream, the operands' rows as the args read them (contiguous, a dtype
  // the library reads, X [T, cols] and dY [T, rows]).
  bool may_arm(const at::Tensor& x_, const at::Tensor& dy_) const {
    if (!enabled || state != State::kIdle || ready_epoch < 0 || ready_epoch != clock->epoch ||
        x_.dim() < 1 || dy_.dim() < 1)
      return false;
    const int64_t cols = weight.size(1), rows = weight.size(0);
    if (x_.size(-1) != cols || dy_.size(-1) != rows || !x_.is_contiguous() || !dy_.is_contiguous())
      return false;
    if (dtype_code(x_.scalar_type()) < 0 || dtype_code(dy_.scalar_type()) < 0) return false;
    const int64_t tokens = x_.numel() / cols;
    if (tokens <= 0 || dy_.numel() != tokens * rows) return false;
    return !dy_.is_cuda() ||
           (dy_.device() == weight.device() &&
            c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(dy_.device()).id() ==
                stream_id);
  }

  // The C++ Linear backward's arming: where the args are ready for this step, on this stream,
  // and the operands fit them as they are (contiguous rows, a dtype the library reads), writes
  // them and arms. False: nothing changed (the Python Linear backward takes it).
  bool try_arm(const at::Tensor& x_, const at::Tensor& dy_) {
    if (!operand_layout_set || !may_arm(x_, dy_)) return false;
    const int64_t cols = weight.size(1), rows = weight.size(0);
    write_field(args, kTokens, x_.numel() / cols);
    write_field(args, kX, reinterpret_cast<int64_t>(x_.data_ptr()));
    write_field(args, kXDtype, dtype_code(x_.scalar_type()));
    write_field(args, kLdx, cols);
    write_field(args, kDy, reinterpret_cast<int64_t>(dy_.data_ptr()));
    write_field(args, kDyDtype, dtype_code(dy_.scalar_type()));
    write_field(args, kLddy, rows);
    arm(x_, cols, dy_, rows);
    return true;
  }

  // Arms the element-wise call with dW [rows, cols] (contiguous, in W's dtype) where Python
  // readied it for this step (a weight whose hand-off formed dW before: forge/_ops.py), as
  // arm arms the fused one; the caller checked the stream. False: nothing changed.
  bool arm_dense(at::Tensor formed) {
    if (!enabled || state != State::kIdle || ready_epoch < 0 || ready_epoch != clock->epoch ||
        !grad_layout_set || dense_args == nullptr || dense_epoch != clock->epoch ||
        formed.scalar_type() != weight.scalar_type() || !formed.is_contiguous() ||
        formed.numel() != weight.numel() || dtype_code(formed.scalar_type()) < 0)
      return false;
    write_at(dense_args, grad_fields[kGrad], reinterpret_cast<int64_t>(formed.data_ptr()));
    write_at(dense_args, grad_fields[kGradDtype], dtype_code(formed.scalar_type()));
    dw = std::move(formed);
    dense = true;
    state = State::kArmed;
    armed_in_graph = false;
    ready_epoch = -1;
    dense_epoch = -1;
    return true;
  }

  // A compiled backward's hand-off that may not keep X and dY: where the element-wise call is
  // ready and X, dY and W share a dtype, dW = dYᵀ·X formed in it as the Python hand-off forms
  // it (forge/optim/deferred.py, product: the same product, so the same bits) and armed.
  // False: nothing changed (the Python hand-off takes it).
  bool try_form(const at::Tensor& x_, const at::Tensor& dy_) {
    if (!grad_layout_set || dense_args == nullptr || dense_epoch != clock->epoch ||
        x_.scalar_type() != weight.scalar_type() || dy_.scalar_type() != weight.scalar_type() ||
        !may_arm(x_, dy_))
      return false;
    const int64_t cols = weight.size(1), rows = weight.size(0);
    return arm_dense(dy_.reshape({-1, rows}).t().matmul(x_.reshape({-1, cols})));  // [rows, cols]
  }

  // For Python, once it meets the weight again: None (nothing armed), True (the hook made the
  // fused call: Python commits its step count), "elementwise" (it made the element-wise
  // call on a formed dW: likewise), (x, ldx, dy, lddy) of an armed fused call never made, or
  // (dw,) of an armed element-wise call never made (Python takes either over). The record is
  // idle afterwards.
  py::object settle() {
    const State was = state;
    state = State::kIdle;
    armed_in_graph = false;
    if (was == State::kIdle) return py::none();
    if (was == State::kCalled) return dense ? py::object(py::str("elementwise")) : py::bool_(true);
    if (dense) {
      py::tuple formed = py::make_tuple(std::move(dw));
      dw = at::Tensor();
      return formed;
    }
    py::tuple pair = py::make_tuple(std::move(x), ldx, std::move(dy), lddy);
    x = at::Tensor();
    dy = at::Tensor();
    return pair;
  }
};

variable_list call_python(const Record& r, const variable_list& grads) {
  py::gil_scoped_acquire gil;
  py::tuple args(grads.size());
  for (size_t i = 0; i < grads.size(); ++i)
    args[i] = grads[i].defined() ? py::cast(grads[i]) : py::none();
  py::object result = r.fallback(args);
  if (result.is_none()) return grads;
  variable_list out;
  for (py::handle item : result)
    out.push_back(item.is_none() ? at::Tensor() : item.cast<at::Tensor>());
  return out;
}

// Compiled autograd (torch._dynamo.compiled_autograd) asks every node and hook for its
// compiled_args before anything runs, and would trace the backward into a graph; a fused
// weight's update runs at its node, outside what it can trace, so the nodes and hooks here
// refuse it (nothing has been updated then) and say what to do instead. Declared const and
// not: the bases' methods are const in newer torch, not in torch 2.4; the one matching the
// base overrides it, the other is an unused overload.
[[noreturn]] void refuse_compiled_autograd() {
  throw std::runtime_error(
      "forge: compiled autograd (torch._dynamo.compiled_autograd, or "
      "torch._dynamo.config.compiled_autograd) cannot trace a fused Linear's backward: FORGE "
      "updates the weight at its gradient node, outside any graph it compiles. Nothing was "
      "updated. torch.compile(model) compiles forward and backward with forge.optim; run "
      "backward without compiled autograd.");
}
#define FORGE_REFUSES_COMPILED_AUTOGRAD                                                  \
  void compiled_args(torch::dynamo::autograd::CompiledNodeArgs&) const {                 \
    refuse_compiled_autograd();                                                          \
  }                                                                                      \
  void compiled_args(torch::dynamo::autograd::CompiledNodeArgs&) { refuse_compiled_autograd(); }

struct FusedWeightPreHook : torch::autograd::FunctionPreHook {
  explicit FusedWeightPreHook(std::shared_ptr<Record> record) : record_(std::move(record)) {}
  FORGE_REFUSES_COMPILED_AUTOGRAD

  variable_list operator()(const variable_list& grads) override {
    Record& r = *record_;
    if (!r.enabled) return grads;
    r.pre_ran = true;
    if (r.state == State::kArmed && grads.size() == 1 && grads[0].defined() &&
        grads[0].unsafeGetTensorImpl() == r.stand_in.unsafeGetTensorImpl()) {
      const int status = r.dense ? r.elementwise_step(r.dense_args) : r.wgrad_step(r.args);
      r.x = at::Tensor();  // (X and dY, or dW, were read in stream order: free to go)
      r.dy = at::Tensor();
      r.dw = at::Tensor();
      if (status != 0) {
        r.state = State::kIdle;
        const char* call = r.dense ? "forge_elementwise_step" : "forge_wgrad_step";
        py::gil_scoped_acquire gil;
        r.on_error(status, call);  // raises
        throw std::runtime_error(std::string("forge: ") + call + " failed");
      }
      r.state = State::kCalled;
      r.weight.mutable_grad() = r.consumed;
      return {at::Tensor()};
    }
    return call_python(r, grads);
  }

 private:
  std::shared_ptr<Record> record_;
};

// The node's post-hook: the Python one (the routing's fallback for a node whose pre-hooks were
// skipped: torch 2.4's non-reentrant checkpoint), called only where no pre-hook ran.
struct FusedWeightPostHook : torch::autograd::FunctionPostHook {
  explicit FusedWeightPostHook(std::shared_ptr<Record> record) : record_(std::move(record)) {}
  FORGE_REFUSES_COMPILED_AUTOGRAD

  variable_list operator()(const variable_list& outputs, const variable_list& /*inputs*/) override {
    Record& r = *record_;
    if (!r.enabled) return outputs;
    if (r.pre_ran) {
      r.pre_ran = false;
      return outputs;
    }
    py::gil_scoped_acquire gil;
    r.post_fallback();
    return outputs;
  }

 private:
  std::shared_ptr<Record> record_;
};

// Hooks weight's AccumulateGrad node (the one torch holds for it now) with record's hooks.
void install(const std::shared_ptr<Record>& record) {
  auto node = torch::autograd::impl::grad_accumulator(record->weight);
  TORCH_CHECK(node, "forge: the weight has no gradient accumulator (requires_grad=False?)");
  node->add_pre_hook(std::make_unique<FusedWeightPreHook>(record));
  node->add_post_hook(std::make_unique<FusedWeightPostHook>(record));
}

// What holds an autograd node: std::shared_ptr (torch 2.4) or c10::intrusive_ptr (later).
using NodePtr = decltype(torch::autograd::Edge::function);

template <typename T>
NodePtr make_node() {
  if constexpr (std::is_same_v<NodePtr, std::shared_ptr<torch::autograd::Node>>) {
    return std::shared_ptr<T>(new T());
  } else {
    return c10::make_intrusive<T>();
  }
}

// What the running backward does with a weight's gradient. A fused Linear's backward hands
// W's update over only where it is accumulated; torch.autograd.grad naming W returns it
// instead (materialized, as torch computes it), and a backward that does not reach W
// (autograd.grad of an input, backward(inputs=...) without W) drops it, so nothing of it may
// wait for a later backward. (A weight that is not a leaf is never fused: "accumulated" then
// means its gradient flows on into the graph.)
enum GradUse : int { kGradDropped = 0, kGradAccumulated = 1, kGradReturned = 2 };

int weight_grad_use(const at::Tensor& weight) {
  const auto* exec_info = torch::autograd::get_current_graph_task_exec_info();
  if (exec_info == nullptr || exec_info->empty()) return kGradAccumulated;  // backward()
  const torch::autograd::Edge edge = torch::autograd::impl::gradient_edge(weight);
  const auto it = edge.is_valid() ? exec_info->find(edge.function.get()) : exec_info->end();
  if (it == exec_info->end()) return kGradDropped;
  if (it->second.captures_) {
    for (const auto& capture : *it->second.captures_)
      if (capture.input_idx_ == static_cast<int>(edge.input_nr)) return kGradReturned;
  }
  return it->second.needed_ ? kGradAccumulated : kGradDropped;
}

// y = x·Wᵀ + b's backward: dX = dY·W (the weight as the forward saw it), db = Σ dY, and W's
// update armed in its record (or handed to the Python Linear backward). The same operations
// as forge/_linear.py's FusedLinearFunction.backward, so the same bits. With `conv1d`,
// transformers' Conv1D (y = x·W + b, W: [in, out]) as FusedConv1DFunction.backward makes it:
// dX = dY·Wᵀ in 2-d products, and the update's operand pair is (dY, X).
struct FusedLinearBackward : torch::autograd::Node {
  torch::autograd::SavedVariable input, weight;
  std::shared_ptr<Record> record;
  std::optional<at::ScalarType> bias_dtype;     // none: no bias
  std::optional<at::ScalarType> compute_dtype;  // autocast's at forward; none: W's own
  bool conv1d = false;

  std::string name() const override {
    return conv1d ? "FusedConv1DBackward" : "FusedLinearBackward";
  }
  FORGE_REFUSES_COMPILED_AUTOGRAD

  void release_variables() override {
    input.reset_data();
    weight.reset_data();
  }

  variable_list apply(variable_list&& grads) override {
    // (a Python Function's backward gets zeros for an undefined gradient: the same here)
    at::Tensor dy = grads[0].defined() ? grads[0] : input_metadata(0).zeros_like();
    at::Tensor x = input.unpack();
    at::Tensor w = weight.unpack();
    variable_list out(3);
    const at::Tensor dy2 = dy.dim() == 2 ? dy : dy.reshape({-1, dy.size(-1)});  // [T, out]
    if (should_compute_output(0)) {
      const at::Tensor wc = compute_dtype ? w.to(*compute_dtype) : w;
      out[0] = conv1d ? dy2.mm(wc.t()).view(x.sizes()) : dy.matmul(wc);  // [..., in]
    }
    if (bias_dtype && should_compute_output(2)) {
      at::Tensor db = dy2.sum(0);  // [out]
      out[2] = db.scalar_type() == *bias_dtype ? db : db.to(*bias_dtype);
    }
    if (should_compute_output(1)) {
      Record& r = *record;
      // (the update's operands: dW = b_opᵀ·a_op, W [rows, cols], a_op [..., cols])
      const at::Tensor& a_op = conv1d ? dy : x;
      const at::Tensor& b_op = conv1d ? x : dy;
      const int use = weight_grad_use(r.weight);
      // (a backward with create_graph=True: the Python path makes dW with its graph)
      if (use == kGradAccumulated && !at::GradMode::is_enabled() && r.try_arm(a_op, b_op)) {
        out[1] = r.stand_in;
      } else if (use != kGradDropped) {
        py::gil_scoped_acquire gil;
        py::object dw = r.linear_fallback(a_op, b_op, w);
        if (!dw.is_none()) out[1] = dw.cast<at::Tensor>();
      }
    }
    return out;
  }
};

// The FusedLinearBackward node (conv1d: Conv1D's) over x, weight, bias, holding x and weight;
// null where none of them requires grad.
// NOTE: made before the product, as torch's own Linear saves its inputs before it computes:
// a non-reentrant checkpoint's recomputation stops at the save that completes what backward
// needs, so the last Linear of a recomputed block stops there instead of running its GEMM for
// an output nobody reads (at long sequences one MLP-sized GEMM per layer and step).
NodePtr fused_backward_node(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                            std::shared_ptr<Record> record,
                            std::optional<at::ScalarType> compute_dtype, bool conv1d) {
  if (!torch::autograd::compute_requires_grad(x, weight, bias)) return nullptr;
  NodePtr node = make_node<FusedLinearBackward>();
  auto& n = static_cast<FusedLinearBackward&>(*node);
  n.set_next_edges(torch::autograd::collect_next_edges(x, weight, bias));
  n.input = torch::autograd::SavedVariable(x, false);
  n.weight = torch::autograd::SavedVariable(weight, false);
  n.record = std::move(record);
  n.compute_dtype = compute_dtype;
  n.conv1d = conv1d;
  if (bias.defined()) n.bias_dtype = bias.scalar_type();
  return node;
}

// y with node's history (none where node is null).
at::Tensor with_history(at::Tensor y, const NodePtr& node) {
  // NOTE: a product reshaped to a 3-d input's rows is a view of the 2-d one; the node's output
  // must not be a view (autograd would rebuild a view's grad_fn from its base after an
  // in-place op), and the base is this call's own buffer.
  if (y.is_view()) y = at::_unsafe_view(y, y.sizes());
  if (node) torch::autograd::set_history(y, node);
  return y;
}

// F.linear(x, weight, bias) with a FusedLinearBackward node (forge/_linear.py's fast path);
// with compute_dtype (autocast's, x already cast by the caller) W and b are cast to it, as
// FusedLinearFunction.forward casts them.
at::Tensor fused_linear(const at::Tensor& x, const at::Tensor& weight,
                        const std::optional<at::Tensor>& bias_, std::shared_ptr<Record> record,
                        std::optional<at::ScalarType> compute_dtype) {
  const at::Tensor bias = bias_.has_value() ? *bias_ : at::Tensor();
  const NodePtr node = fused_backward_node(x, weight, bias, std::move(record), compute_dtype,
                                           false);
  at::Tensor y;
  {
    at::AutoGradMode no_grad(false);
    if (compute_dtype) {
      y = at::linear(x, weight.to(*compute_dtype),
                     bias.defined() ? std::optional<at::Tensor>(bias.to(*compute_dtype))
                                    : std::optional<at::Tensor>());
    } else {
      y = at::linear(x, weight, bias_);
    }
  }
  return with_history(std::move(y), node);
}

// transformers' Conv1D forward, y = x·W + b with W: [in, out], as FusedConv1DFunction.forward
// computes it (torch.addmm over x's rows, as Conv1D's own forward), with its backward node.
at::Tensor fused_conv1d(const at::Tensor& x, const at::Tensor& weight,
                        const std::optional<at::Tensor>& bias_, std::shared_ptr<Record> record,
                        std::optional<at::ScalarType> compute_dtype) {
  const at::Tensor bias = bias_.has_value() ? *bias_ : at::Tensor();
  const NodePtr node = fused_backward_node(x, weight, bias, std::move(record), compute_dtype,
                                           true);
  at::Tensor y;
  {
    at::AutoGradMode no_grad(false);
    const at::Tensor w = compute_dtype ? weight.to(*compute_dtype) : weight;  // [in, out]
    const at::Tensor x2 = x.reshape({-1, x.size(-1)});                        // [T, in]
    at::Tensor y2 = bias.defined()
                        ? at::addmm(compute_dtype ? bias.to(*compute_dtype) : bias, x2, w)
                        : x2.mm(w);  // [T, out]
    std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end() - 1);
    shape.push_back(w.size(1));
    y = y2.view(shape);  // [..., out]
  }
  return with_history(std::move(y), node);
}

// A compiled backward's hand-off (forge::wgrad_hand_off(x, dy, weight, key, keep), forge/_ops.py):
// the record registered under the slot's key is armed as FusedLinearBackward arms it, and W's
// stand-in returned; anything else goes to the operator's Python kernel (Slot.hand_off_in_graph:
// its checks and refusals, the step's first hand-off, which checks the step and readies the
// records, a second use of W). Records are held weakly: a slot's new record replaces its old.
std::mutex hand_off_mutex;
std::unordered_map<int64_t, std::weak_ptr<Record>> hand_off_records;  // slot key -> record
size_t hand_off_records_pruned_at = 0;  // the map's size after its last pruning
py::object* hand_off_python = nullptr;  // the Python kernel (never freed: the operator is not)

void register_hand_off_record(int64_t key, const std::shared_ptr<Record>& record) {
  std::lock_guard<std::mutex> lock(hand_off_mutex);
  hand_off_records[key] = record;
  if (hand_off_records.size() > 2 * hand_off_records_pruned_at + 64) {  // (gone slots' keys)
    for (auto it = hand_off_records.begin(); it != hand_off_records.end();)
      it = it->second.expired() ? hand_off_records.erase(it) : std::next(it);
    hand_off_records_pruned_at = hand_off_records.size();
  }
}

at::Tensor hand_off(const at::Tensor& x, const at::Tensor& dy, const at::Tensor& weight,
                    int64_t key, bool keep) {
  std::shared_ptr<Record> record;
  {
    std::lock_guard<std::mutex> lock(hand_off_mutex);
    auto it = hand_off_records.find(key);
    if (it != hand_off_records.end()) record = it->second.lock();
  }
  // (a backward with create_graph=True: the Python path refuses or makes dW with its graph)
  if (record && !at::GradMode::is_enabled() &&
      weight_grad_use(record->weight) == kGradAccumulated &&
      (keep ? record->try_arm(x, dy) : record->try_form(x, dy))) {
    record->armed_in_graph = true;
    return record->stand_in;
  }
  py::gil_scoped_acquire gil;
  return (*hand_off_python)(x, dy, weight, key, keep).cast<at::Tensor>();
}

// The C++ kernel of forge::wgrad_hand_off for every device (CompositeExplicitAutograd, where
// forge/_ops.py would register its Python one), with `python_kernel` behind it. Once per
// process: the operator was defined by forge/_ops.py.
void register_hand_off(py::object python_kernel) {
  TORCH_CHECK(hand_off_python == nullptr, "forge: the hand-off's kernel is registered already");
  hand_off_python = new py::object(std::move(python_kernel));
  static auto* library = new torch::Library(torch::Library::IMPL, "forge",
                                            c10::DispatchKey::CompositeExplicitAutograd,
                                            __FILE__, __LINE__);
  library->impl("wgrad_hand_off", TORCH_FN(hand_off));
}


// ---- the step's check, repeated --------------------------------------------------------------
//
// Python checks a step before its first update (forge/optim/updater.py, check_step): per
// fused weight, what its updates will read, then the step's call written into its kept args
// and its record readied. Once a check passed, forge/optim/recheck.py registers here each
// weight it readied (StepRecheck::add). At a later step, where nothing Python decides per
// group, per device or per optimizer changed, StepRecheck::run verifies per weight what
// Python's loop verifies (the same state dict, its tensors' data where they were, a step count
// Python accepts, the weight's dtype, device, layout and data, no tensor hook, a live record)
// and only then writes every call as Python's kept_args would (forge/optim/calls.py: the
// device, forge_param and hyper-parameter structs, step, seed, gradient scale, statistics
// outputs) and readies the records. A difference anywhere returns False with nothing written,
// and Python checks the step itself. After the backward, StepRecheck::settle commits each call
// the pre-hook made, as Python's settle_armed commits it (forge/optim/backward.py), and leaves
// Python whatever else a record holds.

// The struct fields forge_wgrad_args and forge_elementwise_args share (device, param, hparams,
// outputs), and forge_hparams' per-call scalars (step, seed, grad_scale): set_call_layout.
enum CallField { kCallDevice, kCallParam, kCallHparams, kCallOutputs, kCallFields };
Field wgrad_call_fields[kCallFields], elementwise_call_fields[kCallFields];
enum HparamsField { kHpStep, kHpSeed, kHpGradScale, kHparamsFields };
Field hparams_fields[kHparamsFields];
bool call_layout_set = false;

// A ctypes struct Python made: the object (the held lists name it) and its address.
struct Source {
  py::object object;
  const void* address = nullptr;
};

Source as_source(py::handle pair) {
  py::tuple t = py::reinterpret_borrow<py::tuple>(pair);
  return {py::reinterpret_borrow<py::object>(t[0]),
          reinterpret_cast<const void*>(t[1].cast<std::uintptr_t>())};
}

class StepRecheck {
 public:
  // One weight the last check readied, as that check saw it. held: calls.kept_args' list of
  // what the args' struct fields hold (dense_held: the element-wise call's, or None).
  // slot: the weight's Slot (forge/optim/slot.py), whose fields settle sets.
  void add(std::shared_ptr<Record> record, py::object slot, py::object param, py::object state,
           py::list held, py::object dense_held, py::object param_struct,
           std::uintptr_t param_address, size_t group, size_t device, uint64_t seed,
           bool counts) {
    TORCH_CHECK(call_layout_set, "forge: set_call_layout first");
    TORCH_CHECK(PyDict_Check(state.ptr()), "forge: a state dict expected");
    Entry e;
    e.weight_data = record->weight.data_ptr();
    e.dtype = record->weight.scalar_type();
    e.device = record->weight.device();
    PyObject *key, *value;
    Py_ssize_t pos = 0;
    while (PyDict_Next(state.ptr(), &pos, &key, &value))
      if (THPVariable_Check(value)) e.state_data.push_back(THPVariable_Unpack(value).data_ptr());
    e.record = std::move(record);
    e.slot = std::move(slot);
    e.param = std::move(param);
    e.state = std::move(state);
    e.held = std::move(held);
    e.dense_held = std::move(dense_held);
    e.param_struct = {std::move(param_struct), reinterpret_cast<const void*>(param_address)};
    e.group = group;
    e.device_index = device;
    e.seed = seed;
    e.counts = counts;
    entries_.push_back(std::move(e));
  }

  void clear() { entries_.clear(); }
  size_t size() const { return entries_.size(); }

  // hparams[g], devices[d], outputs[d]: (struct, address) of group g's forge_hparams, of
  // device d's forge_device and statistics outputs for this step (None where no weight on
  // it counts); no_outputs: the null outputs of a weight that does not count.
  bool run(py::handle state_map, py::list hparams, py::list devices, py::list outputs,
           py::tuple no_outputs, double grad_scale) {
    if (!PyDict_Check(state_map.ptr())) return false;
    steps_.resize(entries_.size());
    for (size_t i = 0; i < entries_.size(); ++i) {
      const std::optional<int64_t> step = verify(entries_[i], state_map.ptr());
      if (!step || entries_[i].group >= hparams.size() ||
          entries_[i].device_index >= devices.size() ||
          (entries_[i].counts && outputs[entries_[i].device_index].is_none()))
        return false;
      steps_[i] = *step;
    }
    std::vector<Source> group_sources, device_sources, output_sources;
    for (py::handle h : hparams) group_sources.push_back(as_source(h));
    for (py::handle h : devices) device_sources.push_back(as_source(h));
    for (py::handle h : outputs) output_sources.push_back(h.is_none() ? Source{} : as_source(h));
    const Source none = as_source(no_outputs);
    for (size_t i = 0; i < entries_.size(); ++i) {
      Entry& e = entries_[i];
      Record& r = *e.record;
      const Source& out = e.counts ? output_sources[e.device_index] : none;
      write_call(r.args, wgrad_call_fields, e, device_sources[e.device_index],
                 group_sources[e.group], out, steps_[i], grad_scale, e.held);
      if (!e.dense_held.is_none() && r.dense_args != nullptr) {
        write_call(r.dense_args, elementwise_call_fields, e, device_sources[e.device_index],
                   group_sources[e.group], out, steps_[i], grad_scale,
                   py::reinterpret_borrow<py::list>(e.dense_held));
        r.dense_epoch = r.clock->epoch;
      }
      r.ready();
    }
    return true;
  }

  // Once Python meets the weights after a backward (forge/optim/backward.py, settle_all):
  // each registered weight whose pre-hook made its call is committed as settle_armed commits
  // it (its state's step becomes the one the call made, which its kept args hold; the slot's
  // updated_at becomes step_id and its use counts and marker are cleared) and its record goes
  // idle. Returns the slots Python settles itself: those whose record holds anything else (a
  // call armed and never made), or whose state dict is no longer the optimizer's.
  py::list settle(py::handle state_map, py::object step_id) {
    py::list left;
    const bool is_map = PyDict_Check(state_map.ptr());
    for (Entry& e : entries_) {
      Record& r = *e.record;
      if (r.state == State::kIdle) continue;
      if (r.state != State::kCalled || !is_map ||
          PyDict_GetItem(state_map.ptr(), e.param.ptr()) != e.state.ptr()) {
        left.append(e.slot);
        continue;
      }
      const void* args = r.dense ? r.dense_args : r.args;
      const Field& hparams = (r.dense ? elementwise_call_fields : wgrad_call_fields)[kCallHparams];
      const int64_t made = read_at(static_cast<const char*>(args) + hparams.offset,
                                   hparams_fields[kHpStep]);
      py::int_ count(made);
      if (PyDict_SetItem(e.state.ptr(), names_.step.ptr(), count.ptr()) != 0)
        throw py::error_already_set();
      PyObject* slot = e.slot.ptr();
      if (PyObject_SetAttr(slot, names_.updated_at.ptr(), step_id.ptr()) != 0 ||
          PyObject_SetAttr(slot, names_.marker.ptr(), Py_None) != 0 ||
          PyObject_SetAttr(slot, names_.uses.ptr(), names_.zero.ptr()) != 0 ||
          PyObject_SetAttr(slot, names_.in_graph_uses.ptr(), names_.zero.ptr()) != 0)
        throw py::error_already_set();
      r.state = State::kIdle;
      r.armed_in_graph = false;
    }
    return left;
  }

 private:
  // The names settle writes, made once.
  struct Names {
    py::str step{"step"}, updated_at{"updated_at"}, marker{"marker"}, uses{"uses"},
        in_graph_uses{"in_graph_uses"};
    py::int_ zero{0};
  };

  struct Entry {
    std::shared_ptr<Record> record;
    py::object slot;   // its Slot
    py::object param;  // the Parameter: its key in the optimizer's state
    py::object state;  // its state dict
    std::vector<const void*> state_data;  // the data of its tensors, in the dict's order
    const void* weight_data = nullptr;
    at::ScalarType dtype = at::kFloat;
    c10::Device device{c10::kCPU};
    py::list held;
    py::object dense_held;
    Source param_struct;  // its forge_param (slot.struct)
    size_t group = 0, device_index = 0;
    uint64_t seed = 0;
    bool counts = false;
  };

  // e's step count where nothing of e changed since it was registered; none otherwise.
  static std::optional<int64_t> verify(const Entry& e, PyObject* state_map) {
    const Record& r = *e.record;
    if (!r.enabled || !r.args || PyDict_GetItem(state_map, e.param.ptr()) != e.state.ptr())
      return std::nullopt;
    const at::Tensor& w = r.weight;
    if (w.scalar_type() != e.dtype || w.device() != e.device || !w.is_contiguous() ||
        w.data_ptr() != e.weight_data)
      return std::nullopt;
    PyObject* hooks = PyObject_GetAttrString(e.param.ptr(), "_backward_hooks");
    if (hooks == nullptr) {
      PyErr_Clear();
      return std::nullopt;
    }
    const int hooked = PyObject_IsTrue(hooks);
    Py_DECREF(hooks);
    if (hooked != 0) {
      if (hooked < 0) PyErr_Clear();
      return std::nullopt;
    }
    PyObject* step = PyDict_GetItemString(e.state.ptr(), "step");
    if (step == nullptr || !PyLong_CheckExact(step)) return std::nullopt;
    int overflow = 0;
    const long long count = PyLong_AsLongLongAndOverflow(step, &overflow);
    if (overflow != 0 || count < 0 || count == LLONG_MAX) return std::nullopt;
    PyObject *key, *value;
    Py_ssize_t pos = 0;
    size_t n = 0;
    while (PyDict_Next(e.state.ptr(), &pos, &key, &value)) {
      if (!THPVariable_Check(value)) continue;
      if (n == e.state_data.size() || THPVariable_Unpack(value).data_ptr() != e.state_data[n])
        return std::nullopt;
      ++n;
    }
    if (n != e.state_data.size()) return std::nullopt;
    return static_cast<int64_t>(count);
  }

  // One kept call written as calls.kept_args writes it for step count + 1, and its held list
  // naming what its struct fields now hold.
  static void write_call(void* args, const Field* fields, const Entry& e, const Source& device,
                         const Source& group, const Source& outputs, int64_t step,
                         double grad_scale, py::list held) {
    char* base = static_cast<char*>(args);
    std::memcpy(base + fields[kCallDevice].offset, device.address, fields[kCallDevice].size);
    std::memcpy(base + fields[kCallParam].offset, e.param_struct.address,
                fields[kCallParam].size);
    char* hp = base + fields[kCallHparams].offset;
    std::memcpy(hp, group.address, fields[kCallHparams].size);
    write_at(hp, hparams_fields[kHpStep], step + 1);
    write_at(hp, hparams_fields[kHpSeed], static_cast<int64_t>(e.seed));
    std::memcpy(hp + hparams_fields[kHpGradScale].offset, &grad_scale, sizeof(double));
    std::memcpy(base + fields[kCallOutputs].offset, outputs.address, fields[kCallOutputs].size);
    held[0] = device.object;
    held[1] = e.param_struct.object;
    held[2] = group.object;
    held[3] = outputs.object;
    held[4] = py::bool_(false);
  }

  std::vector<Entry> entries_;
  std::vector<int64_t> steps_;
  Names names_;
};

// The fields StepRecheck writes: (offset, size) of device, param, hparams and outputs in each
// args struct, and of step, seed and grad_scale in forge_hparams (forge/_prehook.py).
void set_call_layout(const std::vector<std::pair<size_t, size_t>>& wgrad,
                     const std::vector<std::pair<size_t, size_t>>& elementwise,
                     const std::vector<std::pair<size_t, size_t>>& hparams) {
  TORCH_CHECK(wgrad.size() == kCallFields && elementwise.size() == kCallFields,
              "forge: ", kCallFields, " call fields expected");
  for (int i = 0; i < kCallFields; ++i) {
    wgrad_call_fields[i] = {wgrad[i].first, wgrad[i].second};
    elementwise_call_fields[i] = {elementwise[i].first, elementwise[i].second};
    TORCH_CHECK(wgrad[i].second == elementwise[i].second, "forge: call field ", i, " sizes");
  }
  set_fields(hparams, hparams_fields, kHparamsFields);
  TORCH_CHECK(hparams_fields[kHpGradScale].size == sizeof(double), "forge: grad_scale size");
  call_layout_set = true;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<Clock, std::shared_ptr<Clock>>(m, "Clock")
      .def(py::init<>())
      .def("advance", &Clock::advance)
      .def_readonly("epoch", &Clock::epoch);
  py::class_<Record, std::shared_ptr<Record>>(m, "Record")
      .def(py::init([](at::Tensor weight, std::shared_ptr<Clock> clock, std::uintptr_t wgrad_step,
                       py::object fallback, py::object post_fallback, py::object on_error,
                       py::object linear_fallback) {
        auto r = std::make_shared<Record>();
        r->weight = std::move(weight);
        r->clock = std::move(clock);
        r->wgrad_step = reinterpret_cast<StepFn>(wgrad_step);
        r->fallback = std::move(fallback);
        r->post_fallback = std::move(post_fallback);
        r->on_error = std::move(on_error);
        r->linear_fallback = std::move(linear_fallback);
        return r;
      }))
      .def("set_call",
           [](Record& r, py::object args, std::uintptr_t address, at::Tensor stand_in,
              at::Tensor consumed) {
             r.keep = std::move(args);
             r.args = reinterpret_cast<void*>(address);
             r.stand_in = std::move(stand_in);
             r.consumed = std::move(consumed);
           })
      .def("set_dense_call",
           [](Record& r, py::object args, std::uintptr_t address, std::uintptr_t step) {
             r.keep_dense = std::move(args);
             r.dense_args = reinterpret_cast<void*>(address);
             r.elementwise_step = reinterpret_cast<StepFn>(step);
             r.dense_epoch = r.clock->epoch;
           })
      .def("ready", &Record::ready)
      .def("arm", &Record::arm)
      .def("arm_dense", &Record::arm_dense)
      .def("settle", &Record::settle)
      .def_property_readonly("armed", [](const Record& r) { return r.state == State::kArmed; })
      .def_property_readonly("called", [](const Record& r) { return r.state == State::kCalled; })
      .def_property_readonly("busy", [](const Record& r) { return r.state != State::kIdle; })
      .def_property_readonly("armed_in_graph", [](const Record& r) { return r.armed_in_graph; })
      .def_property_readonly("is_ready",
                             [](const Record& r) { return r.ready_epoch == r.clock->epoch; })
      .def_readwrite("enabled", &Record::enabled);
  py::class_<StepRecheck, std::shared_ptr<StepRecheck>>(m, "StepRecheck")
      .def(py::init<>())
      .def("add", &StepRecheck::add)
      .def("clear", &StepRecheck::clear)
      .def("__len__", &StepRecheck::size)
      .def("run", &StepRecheck::run)
      .def("settle", &StepRecheck::settle);
  m.def("set_call_layout", &set_call_layout);
  m.def("install", &install);
  m.def("register_hand_off", &register_hand_off);
  m.def("register_hand_off_record", &register_hand_off_record);
  m.def("weight_grad_use", &weight_grad_use);
  m.def("fused_linear", &fused_linear, py::arg("x"), py::arg("weight"), py::arg("bias"),
        py::arg("record"), py::arg("compute_dtype") = py::none());
  m.def("fused_conv1d", &fused_conv1d, py::arg("x"), py::arg("weight"), py::arg("bias"),
        py::arg("record"), py::arg("compute_dtype") = py::none());
  m.def("set_operand_layout", [](const std::vector<std::pair<size_t, size_t>>& fields) {
    set_fields(fields, operand_fields, kOperands);
    operand_layout_set = true;
  });
  m.def("set_grad_layout", [](const std::vector<std::pair<size_t, size_t>>& fields) {
    set_fields(fields, grad_fields, kGradFields);
    grad_layout_set = true;
  });
  m.def("set_dtype_codes", [](int fp32, int bf16, int fp16) {
    dtype_code_fp32 = fp32;
    dtype_code_bf16 = bf16;
    dtype_code_fp16 = fp16;
  });
}
