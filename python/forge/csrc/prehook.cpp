// prehook.cpp — a fused Linear weight's AccumulateGrad pre-hook in C++ (forge/_prehook.py
// builds it against the torch in use).
//
// The Python routing (forge/optim/routing.py) runs a fused weight's update when autograd
// reaches W's AccumulateGrad node, i.e. once every use of W in this backward is done. Entering
// Python there costs the host more than the update itself on small models, so where this
// extension is built the node's pre-hook is this one: the Linear's backward (Python) prepares
// the update (the kept forge_wgrad_args, its operands held here) and arms the record; the hook,
// seeing its record armed and W's stand-in gradient arrive alone, calls forge_wgrad_step
// through the library's function pointer, leaves the ConsumedGrad in W.grad and drops the
// gradient. Anything else (not armed, another gradient, a refusal) goes to the Python pre-hook
// of the routing, with the GIL, which stays the reference; so does the post-hook's fallback,
// only where no pre-hook ran.
#include <torch/extension.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <cstdint>
#include <memory>
#include <utility>

namespace {

using variable_list = torch::autograd::variable_list;
using WgradStepFn = int (*)(const void*);  // forge_wgrad_step(const forge_wgrad_args*)

// One fused weight's prepared update, shared by its hook and its slot (Python).
struct Record {
  at::Tensor weight;
  at::Tensor stand_in;  // W's stand-in gradient: the hook knows it by identity
  at::Tensor consumed;  // what W.grad becomes once the update ran
  at::Tensor x, dy;     // the armed call's operands, released once it ran
  const void* args = nullptr;  // the kept forge_wgrad_args
  WgradStepFn wgrad_step = nullptr;
  bool armed = false;
  bool pre_ran = false;  // the pre-hook ran since the last post-hook
  bool enabled = true;   // false: gradients pass through (the optimizer was detached)
  py::object keep;       // the ctypes object at `args`, alive while the record is
  py::object fallback;   // the Python pre-hook: (grads tuple) -> None or a tuple
  py::object post_fallback;  // the Python post-hook, () -> None: where no pre-hook ran
  py::object on_error;   // (status) -> raises the library's error

  ~Record() {
    // (the node that owns the hook may go on autograd's thread, without the GIL)
    py::gil_scoped_acquire gil;
    keep = py::object();
    fallback = py::object();
    post_fallback = py::object();
    on_error = py::object();
  }

  void arm(at::Tensor x_, at::Tensor dy_) {
    x = std::move(x_);
    dy = std::move(dy_);
    armed = true;
  }

  // The armed operands back (Python takes the call over), or None.
  py::object disarm() {
    if (!armed) return py::none();
    armed = false;
    py::tuple pair = py::make_tuple(std::move(x), std::move(dy));
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

struct FusedWeightPreHook : torch::autograd::FunctionPreHook {
  explicit FusedWeightPreHook(std::shared_ptr<Record> record) : record_(std::move(record)) {}

  variable_list operator()(const variable_list& grads) override {
    Record& r = *record_;
    if (!r.enabled) return grads;
    r.pre_ran = true;
    if (r.armed && grads.size() == 1 && grads[0].defined() &&
        grads[0].unsafeGetTensorImpl() == r.stand_in.unsafeGetTensorImpl()) {
      r.armed = false;
      const int status = r.wgrad_step(r.args);
      r.x = at::Tensor();  // (X and dY were read in stream order: free to go)
      r.dy = at::Tensor();
      if (status != 0) {
        py::gil_scoped_acquire gil;
        r.on_error(status);  // raises: the step count is restored there
        throw std::runtime_error("forge: forge_wgrad_step failed");
      }
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

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<Record, std::shared_ptr<Record>>(m, "Record")
      .def(py::init([](at::Tensor weight, std::uintptr_t wgrad_step, py::object fallback,
                       py::object post_fallback, py::object on_error) {
        auto r = std::make_shared<Record>();
        r->weight = std::move(weight);
        r->wgrad_step = reinterpret_cast<WgradStepFn>(wgrad_step);
        r->fallback = std::move(fallback);
        r->post_fallback = std::move(post_fallback);
        r->on_error = std::move(on_error);
        return r;
      }))
      .def("set_call",
           [](Record& r, py::object args, std::uintptr_t address, at::Tensor stand_in,
              at::Tensor consumed) {
             r.keep = std::move(args);
             r.args = reinterpret_cast<const void*>(address);
             r.stand_in = std::move(stand_in);
             r.consumed = std::move(consumed);
           })
      .def("arm", &Record::arm)
      .def("disarm", &Record::disarm)
      .def_readonly("armed", &Record::armed)
      .def_readwrite("enabled", &Record::enabled);
  m.def("install", &install);
}
