"""_lib.py — the ctypes binding of libforge's C ABI (include/forge/forge.h).

Why ctypes: nothing in the C++ includes torch headers, so one libforge serves every
torch version (the bitsandbytes model). The structs below mirror forge.h field for
field; when the library is loaded, FORGE_ABI_VERSION is checked and so is the size of
every mirror (forge_struct_size). Names of rules, formats, dtypes and device kinds are
read from the library (Library.rule_code, .weight_format_code, .rules(), ...), not
mirrored here.

Where the library is found, first match wins:
  1. $FORGE_LIBRARY (a file, or a folder holding libforge.so); an error if it is not there;
  2. the installed package: forge/lib/libforge.so (what `pip install .` puts there);
  3. build trees of the source checkout: <repo>/build*/libforge.so (development).
The library is loaded on first use, so `import forge` works without it.
"""
from __future__ import annotations

import ctypes
import os
import struct
import threading
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

ABI_VERSION = 6
INT8_BLOCK = 64
MAX_STATES = 3
# Bytes of a run-scalars buffer (Hparams.run_scalars, Library.run_scalars_fill): what a
# CUDA-graph-captured step reads its step, lr, seed and mu_product dependent scalars from
# when it runs.
RUN_SCALARS_BYTES = 256

# forge_enum: the enumerations the library names (Library.enum_names, .enum_code)
ENUM_STATUS, ENUM_DTYPE, ENUM_RULE, ENUM_WEIGHT_FORMAT, ENUM_STATE_FORMAT, ENUM_DEVICE_KIND = range(6)
MAX_RULE_FIELDS = 16

# forge_status
OK, ERR_INVALID_ARGUMENT, ERR_UNSUPPORTED, ERR_DEVICE, ERR_OUT_OF_MEMORY, ERR_INTERNAL = range(6)
_STATUS_NAMES = {1: "invalid argument", 2: "unsupported", 3: "device error",
                 4: "out of memory", 5: "internal error"}

# The codes of the library's enumerations are read from it (forge_enum_value): these module
# attributes (RULE_ADAMW, STATE_INT8_BLOCK64, DTYPE_BF16, ...) are looked up by name on first
# use (module __getattr__ below), never numbered here.
_ENUM_ATTRIBUTES = {
    "DTYPE_FP32": (ENUM_DTYPE, "fp32"), "DTYPE_BF16": (ENUM_DTYPE, "bf16"),
    "DTYPE_FP16": (ENUM_DTYPE, "fp16"),
    "WEIGHT_FP32": (ENUM_WEIGHT_FORMAT, "fp32"), "WEIGHT_BF16": (ENUM_WEIGHT_FORMAT, "bf16"),
    "WEIGHT_BF16_STOCHASTIC": (ENUM_WEIGHT_FORMAT, "bf16_sr"),
    "WEIGHT_BF16_MASTER": (ENUM_WEIGHT_FORMAT, "bf16_master"),
    "STATE_FP32": (ENUM_STATE_FORMAT, "fp32"), "STATE_BF16": (ENUM_STATE_FORMAT, "bf16"),
    "STATE_BF16_STOCHASTIC": (ENUM_STATE_FORMAT, "bf16_sr"),
    "STATE_INT8_BLOCK64": (ENUM_STATE_FORMAT, "int8"),
    "STATE_FP8_BLOCK64": (ENUM_STATE_FORMAT, "fp8"),
    "STATE_INT4_BLOCK64": (ENUM_STATE_FORMAT, "int4"),
    "DEVICE_CPU": (ENUM_DEVICE_KIND, "cpu"), "DEVICE_CUDA": (ENUM_DEVICE_KIND, "cuda"),
}


def __getattr__(name: str) -> int:
    """RULE_<NAME> (the rule's name, any case), and the names of _ENUM_ATTRIBUTES: their code
    in the loaded library, cached as a module attribute."""
    if name in _ENUM_ATTRIBUTES:
        kind, library_name = _ENUM_ATTRIBUTES[name]
    elif name.startswith("RULE_"):
        kind, library_name = ENUM_RULE, name[len("RULE_"):]
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    code = get().enum_code(kind, library_name)
    globals()[name] = code
    return code


# forge_capability
CAP_CPU, CAP_OPENMP, CAP_CUDA = 1, 2, 4

_LIBRARY_NAMES = ("libforge.so", "libforge.dylib", "forge.dll")

_c_int32, _c_int64 = ctypes.c_int32, ctypes.c_int64
_c_double, _c_void_p = ctypes.c_double, ctypes.c_void_p
_c_float_p = ctypes.POINTER(ctypes.c_float)


class Device(ctypes.Structure):  # forge_device
    _fields_ = [("kind", _c_int32), ("index", _c_int32), ("stream", _c_void_p),
                ("num_threads", _c_int32)]


class Hparams(ctypes.Structure):  # forge_hparams
    _fields_ = [("abi_version", _c_int32), ("rule", _c_int32), ("step", _c_int64),
                ("lr", _c_double), ("weight_decay", _c_double),
                ("decoupled_weight_decay", _c_int32), ("maximize", _c_int32),
                ("beta1", _c_double), ("beta2", _c_double), ("eps", _c_double),
                ("momentum_decay", _c_double), ("mu_product", _c_double), ("alpha", _c_double),
                ("momentum", _c_double),
                ("dampening", _c_double), ("nesterov", _c_int32), ("centered", _c_int32),
                ("lr_decay", _c_double), ("initial_accumulator_value", _c_double),
                ("grad_scale", _c_double), ("seed", ctypes.c_uint64),
                ("run_scalars", _c_void_p)]


class Param(ctypes.Structure):  # forge_param
    _fields_ = [("rows", _c_int64), ("cols", _c_int64), ("weight_format", _c_int32),
                ("weight", _c_void_p), ("master", _c_float_p), ("state_format", _c_int32),
                ("state", _c_void_p * MAX_STATES), ("state_absmax", _c_float_p * MAX_STATES),
                # a shard: the block [rows, cols] at (row_offset, col_offset) of a full
                # [*, full_cols] parameter (0, 0, 0: not a shard)
                ("row_offset", _c_int64), ("col_offset", _c_int64), ("full_cols", _c_int64)]


class StepOutputs(ctypes.Structure):  # forge_step_outputs
    _fields_ = [("grad_sq_sum", ctypes.POINTER(_c_double)),
                ("nonfinite_count", ctypes.POINTER(_c_int64))]


class WgradArgs(ctypes.Structure):  # forge_wgrad_args
    _fields_ = [("abi_version", _c_int32), ("device", Device), ("tokens", _c_int64),
                ("x", _c_void_p), ("x_dtype", _c_int32), ("ldx", _c_int64),
                ("dy", _c_void_p), ("dy_dtype", _c_int32), ("lddy", _c_int64),
                ("param", Param), ("hparams", Hparams), ("outputs", StepOutputs),
                ("tile_rows", _c_int32), ("tile_cols", _c_int32)]


def _field_writer(struct_type, names: Sequence[str]) -> Tuple[struct.Struct, int]:
    """(packer, offset): packer.pack_into(obj, offset, *values) writes the fields `names` of a
    struct_type object (consecutive, in this order) in one call, padding as the struct lays
    them out."""
    codes = {_c_int32: "i", _c_int64: "q", ctypes.c_void_p: "Q"}
    fields = dict(struct_type._fields_)
    start = pos = getattr(struct_type, names[0]).offset
    fmt = "="  # native byte order, no implicit alignment: the offsets below place each field
    for name in names:
        field = getattr(struct_type, name)
        fmt += "x" * (field.offset - pos) + codes[fields[name]]
        pos = field.offset + field.size
    return struct.Struct(fmt), start


# forge_wgrad_args' operands, (tokens, x, x_dtype, ldx, dy, dy_dtype, lddy), set in one call.
# NOTE: once per fused Linear per step inside backward: one pack_into, not seven ctypes
# field assignments (~0.3 against ~0.6 µs in a loop, 2-core CPU dev host).
WGRAD_OPERAND_FIELDS = ("tokens", "x", "x_dtype", "ldx", "dy", "dy_dtype", "lddy")
WGRAD_OPERANDS = _field_writer(WgradArgs, WGRAD_OPERAND_FIELDS)


class ElementwiseArgs(ctypes.Structure):  # forge_elementwise_args
    _fields_ = [("abi_version", _c_int32), ("device", Device),
                ("grad", _c_void_p), ("grad_dtype", _c_int32),
                ("param", Param), ("hparams", Hparams), ("outputs", StepOutputs)]


class StateLayout(ctypes.Structure):  # forge_state_layout
    _fields_ = [("num_states", _c_int32), ("is_signed", _c_int32 * MAX_STATES),
                ("state_bytes", _c_int64 * MAX_STATES), ("absmax_count", _c_int64 * MAX_STATES),
                ("names", ctypes.c_char_p * MAX_STATES)]


class RuleInfo(ctypes.Structure):  # forge_rule_info
    _fields_ = [("name", ctypes.c_char_p), ("fields", ctypes.c_char_p * MAX_RULE_FIELDS),
                ("state_names", ctypes.c_char_p * MAX_STATES),
                ("state_condition", ctypes.c_char_p * MAX_STATES),
                ("num_fields", _c_int32), ("max_states", _c_int32),
                ("state_signed", _c_int32 * MAX_STATES)]


# Every mirror, by its forge.h name: their sizes are checked against the library's at load.
_STRUCTS = {"forge_device": Device, "forge_hparams": Hparams, "forge_param": Param,
            "forge_step_outputs": StepOutputs, "forge_wgrad_args": WgradArgs,
            "forge_elementwise_args": ElementwiseArgs, "forge_state_layout": StateLayout,
            "forge_rule_info": RuleInfo}


class ForgeError(RuntimeError):
    """A libforge call failed; the message is forge_last_error()'s. `status` is the code."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


class ForgeInvalidArgument(ForgeError, ValueError):
    """FORGE_ERR_INVALID_ARGUMENT: also a ValueError, as Python callers expect."""


class LibraryNotFound(ImportError):
    pass


def _repo_root() -> Path:
    return Path(__file__).resolve().parents[2]  # python/forge/_lib.py -> repo


def candidate_paths() -> List[Path]:
    """Where the library is looked for, in order (FORGE_LIBRARY is handled by find())."""
    out = [Path(__file__).resolve().parent / "lib" / n for n in _LIBRARY_NAMES]
    for build in sorted(_repo_root().glob("build*")):
        for sub in ("", "lib"):
            out += [build / sub / n for n in _LIBRARY_NAMES]
    return out


def find() -> Path:
    env = os.environ.get("FORGE_LIBRARY")
    if env:
        path = Path(env)
        if path.is_dir():
            for name in _LIBRARY_NAMES:
                if (path / name).is_file():
                    return path / name
        if path.is_file():
            return path
        raise LibraryNotFound(f"FORGE_LIBRARY={env!r}: no libforge there")
    for path in candidate_paths():
        if path.is_file():
            return path
    raise LibraryNotFound(
        "libforge not found: install the package (pip install .), or build it "
        "(cmake -S . -B build -G Ninja && cmake --build build) and set FORGE_LIBRARY="
        f"/path/to/libforge.so; looked in {Path(__file__).resolve().parent / 'lib'} and "
        f"{_repo_root() / 'build*'}")


class Library:
    """The loaded libforge with typed entry points; raising wrappers over the status codes."""

    def __init__(self, path: Path):
        self.path = path
        try:
            lib = ctypes.CDLL(str(path))
        except OSError as e:
            raise ImportError(f"{path}: cannot be loaded ({e})") from None
        self._lib = lib
        # The version first: an older library lacks newer entry points (a clearer error).
        try:
            abi_version = lib.forge_abi_version
        except AttributeError:
            raise ImportError(f"{path}: not a libforge (no forge_abi_version)") from None
        abi_version.argtypes, abi_version.restype = [], _c_int32
        abi = abi_version()
        if abi != ABI_VERSION:
            raise ImportError(f"{path}: libforge speaks ABI {abi}, this package {ABI_VERSION}; "
                              "rebuild the library from this checkout")
        P = ctypes.POINTER
        sigs = {
            "forge_version_string": ([], ctypes.c_char_p),
            "forge_capabilities": ([], ctypes.c_uint32),
            "forge_last_error": ([], ctypes.c_char_p),
            "forge_enum_count": ([_c_int32, P(_c_int32)], _c_int32),
            "forge_enum_name": ([_c_int32, _c_int32, P(ctypes.c_char_p)], _c_int32),
            "forge_enum_value": ([_c_int32, ctypes.c_char_p, P(_c_int32)], _c_int32),
            "forge_rule_query": ([_c_int32, P(RuleInfo)], _c_int32),
            "forge_struct_size": ([ctypes.c_char_p, P(_c_int64)], _c_int32),
            "forge_hparams_default": ([_c_int32, P(Hparams)], _c_int32),
            "forge_state_layout_query": ([P(Hparams), _c_int32, _c_int64, _c_int64,
                                          P(StateLayout)], _c_int32),
            "forge_state_init": ([P(Param), P(Hparams), Device], _c_int32),
            "forge_state_to_fp32": ([P(Param), P(Hparams), _c_int32, _c_float_p, Device], _c_int32),
            "forge_state_from_fp32": ([P(Param), P(Hparams), _c_int32, _c_float_p, Device],
                                      _c_int32),
            "forge_run_scalars_fill": ([P(Hparams), _c_void_p, _c_int64], _c_int32),
            "forge_wgrad_step": ([P(WgradArgs)], _c_int32),
            "forge_elementwise_step": ([P(ElementwiseArgs)], _c_int32),
            "forge_elementwise_step_batch": ([P(ctypes.c_void_p), ctypes.c_int64], _c_int32),
        }
        for name, (argtypes, restype) in sigs.items():
            try:
                fn = getattr(lib, name)
            except AttributeError:
                raise ImportError(f"{path}: libforge ABI {abi} without {name}; rebuild the "
                                  "library from this checkout") from None
            fn.argtypes, fn.restype = argtypes, restype
        self._check_struct_sizes()
        self.capabilities = int(lib.forge_capabilities())
        self.version = lib.forge_version_string().decode()
        self._enum_cache: Dict[int, Tuple[str, ...]] = {}

    def _check_struct_sizes(self) -> None:
        """ImportError unless every mirror has the size of the library's struct."""
        for name, mirror in _STRUCTS.items():
            size = _c_int64(-1)
            status = self._lib.forge_struct_size(name.encode(), ctypes.byref(size))
            if status != OK:
                message = (self._lib.forge_last_error() or b"").decode(errors="replace")
                raise ImportError(f"{self.path}: forge_struct_size({name}): {message}")
            if size.value != ctypes.sizeof(mirror):
                raise ImportError(
                    f"{self.path}: struct {name} is {size.value} bytes in the library but "
                    f"{ctypes.sizeof(mirror)} in forge._lib.{mirror.__name__}; the binding and "
                    "the library disagree on forge.h (rebuild the library from this checkout)")

    @property
    def has_cuda(self) -> bool:
        return bool(self.capabilities & CAP_CUDA)

    def check(self, status: int, what: str) -> None:
        if status == OK:
            return
        message = (self._lib.forge_last_error() or b"").decode(errors="replace")
        text = f"{what}: {message or _STATUS_NAMES.get(status, f'status {status}')}"
        cls = ForgeInvalidArgument if status == ERR_INVALID_ARGUMENT else ForgeError
        raise cls(text, status)

    # ---- names: what the library calls its rules, formats, dtypes and device kinds

    def enum_names(self, kind: int) -> Tuple[str, ...]:
        """The names of enumeration `kind` (ENUM_*), in value order."""
        names = self._enum_cache.get(kind)
        if names is None:
            count = _c_int32()
            self.check(self._lib.forge_enum_count(kind, ctypes.byref(count)), "forge_enum_count")
            out = []
            for value in range(count.value):
                name = ctypes.c_char_p()
                self.check(self._lib.forge_enum_name(kind, value, ctypes.byref(name)),
                           "forge_enum_name")
                out.append(name.value.decode())
            names = self._enum_cache[kind] = tuple(out)
        return names

    def enum_code(self, kind: int, name: str) -> int:
        """The value named `name` (case-insensitive) in enumeration `kind`; ValueError
        (ForgeInvalidArgument) listing the known names otherwise."""
        if not isinstance(name, str):
            raise TypeError(f"name: must be a str, got {type(name).__name__}")
        value = _c_int32()
        self.check(self._lib.forge_enum_value(kind, name.encode(), ctypes.byref(value)),
                   "forge_enum_value")
        return value.value

    def rule_code(self, name: str) -> int:
        return self.enum_code(ENUM_RULE, name)

    def rule_name(self, code: int) -> str:
        names = self.enum_names(ENUM_RULE)
        if not 0 <= code < len(names):
            raise ValueError(f"rule: unknown value {code}")
        return names[code]

    def rules(self) -> Dict[str, int]:
        """{name: code} of every rule the library has."""
        return {name: code for code, name in enumerate(self.enum_names(ENUM_RULE))}

    def weight_format_code(self, name: str) -> int:
        return self.enum_code(ENUM_WEIGHT_FORMAT, name)

    def state_format_code(self, name: str) -> int:
        return self.enum_code(ENUM_STATE_FORMAT, name)

    def dtype_code(self, name: str) -> int:
        return self.enum_code(ENUM_DTYPE, name)

    def device_kind_code(self, name: str) -> int:
        return self.enum_code(ENUM_DEVICE_KIND, name)

    def rule_info(self, rule: int) -> Dict[str, Any]:
        """What rule `rule` reads and keeps: {"name", "fields", "states"}, each state a dict
        {"name", "signed", "condition"} (condition: None, or the field that must be non-zero
        for the state to be kept), in the slot order of the rule's largest configuration."""
        info = RuleInfo()
        self.check(self._lib.forge_rule_query(rule, ctypes.byref(info)), "forge_rule_query")
        return {
            "name": info.name.decode(),
            "fields": tuple(info.fields[i].decode() for i in range(info.num_fields)),
            "states": tuple({"name": info.state_names[i].decode(),
                             "signed": bool(info.state_signed[i]),
                             "condition": (info.state_condition[i].decode()
                                           if info.state_condition[i] else None)}
                            for i in range(info.max_states)),
        }

    # ---- the C ABI's entry points

    def hparams_default(self, rule: int) -> Hparams:
        hp = Hparams()
        self.check(self._lib.forge_hparams_default(rule, ctypes.byref(hp)), "forge_hparams_default")
        return hp

    def state_layout(self, hp: Hparams, state_format: int, rows: int, cols: int) -> StateLayout:
        layout = StateLayout()
        self.check(self._lib.forge_state_layout_query(ctypes.byref(hp), state_format, rows, cols,
                                                      ctypes.byref(layout)),
                   "forge_state_layout_query")
        return layout

    def state_init(self, param: Param, hp: Hparams, device: Device) -> None:
        self.check(self._lib.forge_state_init(ctypes.byref(param), ctypes.byref(hp), device),
                   "forge_state_init")

    def state_to_fp32(self, param: Param, hp: Hparams, index: int, out_ptr: int,
                      device: Device) -> None:
        self.check(self._lib.forge_state_to_fp32(ctypes.byref(param), ctypes.byref(hp), index,
                                                 ctypes.cast(out_ptr, _c_float_p), device),
                   "forge_state_to_fp32")

    def state_from_fp32(self, param: Param, hp: Hparams, index: int, in_ptr: int,
                        device: Device) -> None:
        self.check(self._lib.forge_state_from_fp32(ctypes.byref(param), ctypes.byref(hp), index,
                                                   ctypes.cast(in_ptr, _c_float_p), device),
                   "forge_state_from_fp32")

    def run_scalars_fill(self, hp: Hparams, address: int, nbytes: int) -> None:
        """Writes the scalars a step with hp's step, lr, seed and mu_product reads into the
        host memory at `address` (`nbytes` >= RUN_SCALARS_BYTES); hp.run_scalars is ignored.
        Called once per parameter before every graph replay: passed as the per-update calls
        below."""
        status = self._lib.forge_run_scalars_fill(hp, address, nbytes)
        if status:
            self.check(status, "forge_run_scalars_fill")

    @property
    def wgrad_step_address(self) -> int:
        """forge_wgrad_step's address, for a caller in C++ (forge/_prehook.py)."""
        return ctypes.cast(self._lib.forge_wgrad_step, ctypes.c_void_p).value

    @property
    def elementwise_step_address(self) -> int:
        """forge_elementwise_step's address, for a caller in C++ (forge/_prehook.py)."""
        return ctypes.cast(self._lib.forge_elementwise_step, ctypes.c_void_p).value

    # NOTE: the two per-update calls pass the struct itself (ctypes takes its address, as
    # argtypes is a POINTER to its type: ~130 ns less than ctypes.byref) and call check()
    # only on an error.
    def wgrad_step(self, args: WgradArgs) -> None:
        status = self._lib.forge_wgrad_step(args)
        if status:
            self.check(status, "forge_wgrad_step")

    def elementwise_step(self, args: ElementwiseArgs) -> None:
        status = self._lib.forge_elementwise_step(args)
        if status:
            self.check(status, "forge_elementwise_step")

    def elementwise_step_batch(self, calls: Sequence[ElementwiseArgs]) -> None:
        """forge_elementwise_step_batch over `calls` (kept alive by the caller)."""
        table = (ctypes.c_void_p * len(calls))(*map(ctypes.addressof, calls))
        status = self._lib.forge_elementwise_step_batch(table, len(calls))
        if status:
            self.check(status, "forge_elementwise_step_batch")


_loaded: Optional[Library] = None
_load_lock = threading.Lock()


def get() -> Library:
    """The process-wide Library, loaded on first call."""
    global _loaded
    if _loaded is None:
        with _load_lock:
            if _loaded is None:
                _loaded = Library(find())
    return _loaded


def float_ptr(address: int):
    return ctypes.cast(address, _c_float_p) if address else None
