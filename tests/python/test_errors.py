"""test_errors.py — bad input is refused with a ValueError/TypeError naming the problem,
and the model is left untouched (no patched forward, no hook: plain autograd still works).
Errors of libforge itself surface as Python exceptions carrying forge_last_error()."""
import copy
import ctypes
import ctypes.util
import pickle
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import forge
import forge.optim
from conftest import requires_cuda
from tiny_models import TinyTransformer, lm_loss


def assert_untouched(model):
    assert not any("forward" in m.__dict__ for m in model.modules()), "a forward was patched"
    lm_loss(model, 0).backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad), \
        "plain autograd must still fill every .grad (no forge hook left behind)"


BAD = [
    ("AdamW", dict(lr=-1e-3), ValueError, "learning rate"),
    ("AdamW", dict(lr=float("nan")), ValueError, "learning rate"),
    ("AdamW", dict(betas=(1.0, 0.999)), ValueError, "beta parameter at index 0"),
    ("AdamW", dict(betas=(0.9, -0.1)), ValueError, "beta parameter at index 1"),
    ("AdamW", dict(betas=(0.9,)), ValueError, "betas"),
    ("AdamW", dict(eps=0.0), ValueError, "epsilon"),
    ("AdamW", dict(weight_decay=-0.1), ValueError, "weight_decay"),
    ("AdamW", dict(amsgrad=True), ValueError, "amsgrad"),
    ("AdamW", dict(differentiable=True), ValueError, "differentiable"),
    ("AdamW", dict(state_format="fp4"), ValueError, "state_format"),
    ("AdamW", dict(stochastic_rounding="yes"), TypeError, "stochastic_rounding"),
    ("AdamW", dict(seed=-1), ValueError, "seed"),
    ("AdamW", dict(lr="fast"), TypeError, "lr"),
    ("AdamW", dict(no_such_option=1), TypeError, "no_such_option"),
    ("NAdam", dict(momentum_decay=-1.0), ValueError, "momentum_decay"),
    ("Lion", dict(betas=(0.9, 1.5)), ValueError, "beta parameter at index 1"),
    ("RMSprop", dict(alpha=1.0), ValueError, "alpha"),
    ("RMSprop", dict(momentum=-0.5), ValueError, "momentum"),
    ("Adagrad", dict(lr_decay=-1.0), ValueError, "lr_decay"),
    ("Adagrad", dict(initial_accumulator_value=-1.0), ValueError, "initial_accumulator_value"),
    ("SGD", dict(nesterov=True), ValueError, "Nesterov"),
    ("SGD", dict(momentum=0.9, dampening=0.5, nesterov=True), ValueError, "Nesterov"),
    ("SGD", dict(momentum=1.5), ValueError, "momentum"),
]


@pytest.mark.parametrize("name,kwargs,error,match", BAD,
                         ids=[f"{n}-{next(iter(k))}-{i}" for i, (n, k, _, _) in enumerate(BAD)])
def test_bad_hyper_parameter(name, kwargs, error, match):
    model = TinyTransformer()
    with pytest.raises(error, match=match):
        getattr(forge.optim, name)(model, **kwargs)
    assert_untouched(model)


def test_not_a_module():
    """Parameters, or torch.optim's param groups, where the model goes: refused, saying
    where the groups go."""
    model = TinyTransformer()
    with pytest.raises(TypeError, match="nn.Module"):
        forge.optim.AdamW(model.parameters())
    with pytest.raises(TypeError, match=r"nn.Module to train, got list .*params="):
        forge.optim.AdamW([{"params": list(model.parameters()), "weight_decay": 0.0}])
    assert_untouched(model)


def test_model_without_parameters():
    with pytest.raises(ValueError, match="no trainable parameters"):
        forge.optim.AdamW(nn.ReLU())
    frozen = TinyTransformer().requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        forge.optim.SGD(frozen)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float64])
def test_unsupported_dtype(dtype):
    model = TinyTransformer()
    model.head.to(dtype)
    with pytest.raises(TypeError, match=r"head\.weight.*" + str(dtype).replace(".", r"\.")):
        forge.optim.AdamW(model)
    model.head.float()
    assert_untouched(model)


def test_unsupported_device():
    model = nn.Linear(4, 4, device="meta")
    with pytest.raises(ValueError, match="device meta"):
        forge.optim.AdamW(model)


def test_group_with_foreign_parameter():
    model = TinyTransformer()
    stranger = nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match="not a parameter of the model"):
        forge.optim.AdamW(model, params=[{"params": list(model.parameters()) + [stranger]}])
    assert_untouched(model)


def test_bad_group_value():
    model = TinyTransformer()
    groups = forge.optim.param_groups_no_decay(model, 0.1)
    groups[1]["lr"] = -1.0
    with pytest.raises(ValueError, match="learning rate"):
        forge.optim.AdamW(model, params=groups)
    assert_untouched(model)


def test_sparse_embedding():
    model = TinyTransformer()
    model.embed.sparse = True
    with pytest.raises(ValueError, match=r"embed\.weight.*sparse"):
        forge.optim.AdamW(model)
    model.embed.sparse = False
    assert_untouched(model)


def test_non_contiguous_parameter():
    model = nn.Linear(4, 6)
    model.weight = nn.Parameter(torch.randn(4, 6).t())
    with pytest.raises(ValueError, match="contiguous"):
        forge.optim.SGD(model)


def test_second_optimizer_on_the_same_model():
    model = TinyTransformer()
    opt = forge.optim.AdamW(model)
    with pytest.raises(ValueError, match="another forge optimizer"):
        forge.optim.SGD(model)
    opt.detach()
    forge.optim.SGD(model)


def test_copying_or_pickling_the_optimizer_is_refused_by_name():
    """torch.optim.Optimizer pickles defaults, state and param_groups only: a copy of a forge
    optimizer would miss its slots and fail at its first step. Refused, pointing to
    state_dict; the optimizer trains on."""
    model = TinyTransformer()
    opt = forge.optim.AdamW(model)
    lm_loss(model, 0).backward()
    opt.step()
    opt.zero_grad()
    for copy_it in (copy.deepcopy, copy.copy, pickle.dumps):
        with pytest.raises(TypeError, match=r"forge.optim.AdamW cannot be copied or pickled"
                                            r".*opt.state_dict\(\)"):
            copy_it(opt)
    lm_loss(model, 1).backward()
    opt.step()


@pytest.mark.parametrize("mode", ["immediate", "deferred"])
def test_library_errors_surface_with_their_message(mode):
    """A value the Python checks let through (set on a group after construction) is
    refused by libforge: ForgeError (a ValueError here) with its text, inside backward
    (immediate) or at opt.step() (deferred), before any weight changed."""
    model = TinyTransformer()
    opt = forge.optim.AdamW(model, mode=mode)
    opt.param_groups[0]["betas"] = (0.9, 1.0)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"hparams\.beta2: must be in \[0, 1\)") as info:
        lm_loss(model, 0).backward()
        opt.step()
    assert isinstance(info.value, forge.ForgeError)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    lib = forge.library()
    hp = lib.hparams_default(forge._lib.RULE_ADAMW)
    hp.step = 0
    with pytest.raises(forge.ForgeError, match=r"hparams\.step: must be >= 1"):
        lib.state_layout(hp, forge._lib.STATE_FP32, 1, 1)


def test_library_not_found(monkeypatch, tmp_path):
    monkeypatch.setenv("FORGE_LIBRARY", str(tmp_path / "missing.so"))
    with pytest.raises(ImportError, match="FORGE_LIBRARY"):
        forge._lib.find()


def test_wrong_library_is_refused_by_name(tmp_path):
    """A shared library that is not libforge (here the C library) is refused with the path
    and the reason, not a raw AttributeError; a file that is no library at all likewise."""
    libc = ctypes.util.find_library("c")
    assert libc, "the C library is needed to stand in for a foreign shared library"
    with pytest.raises(ImportError, match=r": not a libforge \(no forge_abi_version\)"):
        forge._lib.Library(Path(libc))
    junk = tmp_path / "libforge.so"
    junk.write_bytes(b"not an ELF file")
    with pytest.raises(ImportError, match=r"libforge\.so: cannot be loaded"):
        forge._lib.Library(junk)


def test_struct_mirror_of_the_wrong_size_is_refused_at_load(monkeypatch):
    """Every ctypes mirror is checked against forge_struct_size when the library loads: a
    mirror missing a field names the struct and both sizes."""
    lib = forge.library()
    short = type("Hparams", (ctypes.Structure,),
                 {"_fields_": [f for f in forge._lib.Hparams._fields_ if f[0] != "seed"]})
    monkeypatch.setitem(forge._lib._STRUCTS, "forge_hparams", short)
    size = ctypes.sizeof(forge._lib.Hparams)
    with pytest.raises(ImportError, match=rf"struct forge_hparams is {size} bytes in the library "
                                          rf"but {ctypes.sizeof(short)} in forge\._lib\.Hparams"):
        forge._lib.Library(lib.path)
    monkeypatch.undo()
    forge._lib.Library(lib.path)  # the real mirrors pass


def test_names_come_from_the_library():
    """Rules, formats, dtypes and device kinds are looked up by name in the library; the
    legacy constants agree with it, and an unknown name lists the known ones."""
    lib = forge.library()
    assert lib.rule_code("AdamW") == lib.rule_code("adamw") == forge._lib.RULE_ADAMW
    assert lib.rules()["RMSprop"] == forge._lib.RULE_RMSPROP
    assert lib.rule_name(forge._lib.RULE_LION) == "Lion"
    assert lib.weight_format_code("bf16_sr") == forge._lib.WEIGHT_BF16_STOCHASTIC
    assert lib.weight_format_code("bf16_master") == forge._lib.WEIGHT_BF16_MASTER
    assert lib.state_format_code("int8") == forge._lib.STATE_INT8_BLOCK64
    assert lib.state_format_code("fp8") == forge._lib.STATE_FP8_BLOCK64
    assert lib.state_format_code("int4") == forge._lib.STATE_INT4_BLOCK64
    assert lib.dtype_code("fp16") == forge._lib.DTYPE_FP16
    assert lib.device_kind_code("cuda") == forge._lib.DEVICE_CUDA
    with pytest.raises(ValueError, match=r'"fp4" is no state format \(known: "fp32", "bf16", '
                                         r'"bf16_sr", "int8", "fp8", "int4"\)'):
        lib.state_format_code("fp4")
    info = lib.rule_info(lib.rule_code("RMSprop"))
    assert [s["name"] for s in info["states"]] == ["square_avg", "grad_avg", "momentum_buffer"]
    assert [s["condition"] for s in info["states"]] == [None, "centered", "momentum"]
    assert "alpha" in info["fields"] and "beta1" not in info["fields"]
    with pytest.raises(ValueError, match="rule"):
        lib.rule_info(99)


@requires_cuda
def test_cuda_parameters_without_cuda_backend(monkeypatch):
    lib = forge.library()
    monkeypatch.setattr(lib, "capabilities", lib.capabilities & ~forge._lib.CAP_CUDA)
    model = TinyTransformer().cuda()
    with pytest.raises(ValueError, match="without the CUDA backend"):
        forge.optim.AdamW(model)


def test_changing_layout_after_states_exist():
    model = TinyTransformer()
    opt = forge.optim.SGD(model, lr=0.1, momentum=0.9)
    lm_loss(model, 0).backward()
    opt.step()
    opt.zero_grad()
    opt.param_groups[0]["momentum"] = 0.0
    with pytest.raises(RuntimeError, match="changed the update rule"):
        lm_loss(model, 1).backward()


def test_model_moved_after_the_optimizer_is_refused_by_name():
    """A model cast after its optimizer was built (here to float64, which FORGE does not
    store) is refused at its next update with the parameter's name, after a step that made
    and cached the per-weight objects (stand-in dW, forge_param)."""
    model = TinyTransformer()
    opt = forge.optim.AdamW(model)
    lm_loss(model, 0).backward()
    opt.step()
    opt.zero_grad()
    model.double()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    # (at the step's first update: in backward for a fused weight, in step() for a small one)
    with pytest.raises(RuntimeError, match="changed dtype, device or layout after the optimizer"):
        lm_loss(model, 1).backward()
        opt.step()
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n
