/* forge.h — the only public header of libforge: a plain C ABI.
 *
 * FORGE folds the optimizer into the weight-gradient GEMM of a linear layer:
 * each tile of dW = dYᵀ·X is accumulated in fp32 and the element-wise update
 * is applied to it at once, so the [out, in] gradient never exists in memory.
 *
 * Conventions
 *  - Every entry point returns forge_status; on anything but FORGE_OK,
 *    forge_last_error() gives a message (thread-local) naming the argument,
 *    and no output byte has been written.
 *  - Tensors are row-major. A parameter is [rows, cols] and contiguous; a
 *    1-D parameter (bias, norm weight) is [1, n].
 *  - Pointers live on the device named in forge_device (host memory for
 *    FORGE_DEVICE_CPU, device memory for FORGE_DEVICE_CUDA), outputs included.
 *  - Sizes: every buffer's byte count must fit in int64_t (so rows · cols ≤ 2^61 for a
 *    parameter), and no buffer may wrap the address space.
 *  - A buffer a call writes shares no byte with any other buffer of the call (read-only
 *    inputs may share bytes with each other), and every pointer is aligned to its
 *    element: fp32 data and absmax 4 bytes, bf16 / fp16 2, the step outputs 8.
 *  - Every struct passed in starts with abi_version = FORGE_ABI_VERSION.
 *  - Enumerated values travel as int32_t (struct fields and parameters alike), so an
 *    out-of-range value is refused by name instead of being loaded as an enum. Bindings
 *    look names up (forge_enum_name / forge_enum_value, forge_rule_query) and check their
 *    struct mirrors against forge_struct_size instead of copying numbers from here.
 */
#ifndef FORGE_FORGE_H_
#define FORGE_FORGE_H_

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32)
#define FORGE_API __declspec(dllexport)
#else
#define FORGE_API __attribute__((visibility("default")))
#endif

#define FORGE_ABI_VERSION 6
/* Elements of a row that share one absmax (int8, fp8 and int4 states). */
#define FORGE_INT8_BLOCK 64
/* Most optimizer states any rule keeps per parameter element. */
#define FORGE_MAX_STATES 3
/* Most CPU threads a call may ask for (forge_device.num_threads). */
#define FORGE_MAX_CPU_THREADS 1024
/* Largest CPU tile side (forge_wgrad_args.tile_rows, tile_cols). */
#define FORGE_MAX_TILE 4096

typedef enum {
  FORGE_OK = 0,
  FORGE_ERR_INVALID_ARGUMENT = 1, /* bad pointer, size, enum or hyper-parameter */
  FORGE_ERR_UNSUPPORTED = 2,      /* valid request this build cannot run (e.g. no CUDA) */
  FORGE_ERR_DEVICE = 3,           /* a CUDA call failed; the message has its error string */
  FORGE_ERR_OUT_OF_MEMORY = 4,    /* a host or device allocation failed; nothing was written */
  FORGE_ERR_INTERNAL = 5          /* a bug: the message says what went wrong */
} forge_status;

typedef enum { FORGE_DTYPE_FP32 = 0, FORGE_DTYPE_BF16 = 1, FORGE_DTYPE_FP16 = 2 } forge_dtype;

typedef enum {
  FORGE_RULE_SGD = 0,          /* lr, weight_decay (coupled), maximize */
  FORGE_RULE_SGD_MOMENTUM = 1, /* + momentum > 0, dampening, nesterov */
  FORGE_RULE_ADAMW = 2,        /* lr, beta1, beta2, eps, weight_decay (decoupled unless
                                  decoupled_weight_decay == 0, which is torch.optim.Adam) */
  FORGE_RULE_NADAM = 3,        /* + momentum_decay, decoupled_weight_decay */
  FORGE_RULE_RADAM = 4,        /* + decoupled_weight_decay */
  FORGE_RULE_LION = 5,         /* lr, beta1, beta2, weight_decay (decoupled) */
  FORGE_RULE_RMSPROP = 6,      /* lr, alpha, eps, weight_decay (coupled), momentum, centered */
  FORGE_RULE_ADAGRAD = 7,      /* lr, lr_decay, eps, weight_decay (coupled),
                                  initial_accumulator_value (used by forge_state_init) */
  FORGE_RULE_MUON = 8          /* momentum, nesterov (torch.optim.Muon's momentum_buffer).
                                  Its element step is the momentum's alone: the weight
                                  buffer receives the direction u the caller orthogonalizes
                                  (Newton-Schulz, a whole-matrix operation) and applies to
                                  the weight itself; u = lerp(g, m, momentum) with nesterov,
                                  else m, where m = lerp(m, g, 1 - momentum). The weight's
                                  old value is not read; lr and weight_decay are not used. */
} forge_rule;
#define FORGE_RULE_COUNT 9

typedef enum {
  FORGE_WEIGHT_FP32 = 0,
  FORGE_WEIGHT_BF16 = 1,             /* bf16, round to nearest even */
  FORGE_WEIGHT_BF16_STOCHASTIC = 2,  /* bf16, stochastic rounding */
  FORGE_WEIGHT_BF16_MASTER = 3       /* fp32 master is the truth; bf16 copy = nearest(master) */
} forge_weight_format;
#define FORGE_WEIGHT_FORMAT_COUNT 4

typedef enum {
  FORGE_STATE_FP32 = 0,
  FORGE_STATE_BF16 = 1,             /* round to nearest even */
  FORGE_STATE_BF16_STOCHASTIC = 2,
  FORGE_STATE_INT8_BLOCK64 = 3,     /* dynamic map code per element + fp32 absmax per 64
                                       consecutive elements of a row */
  FORGE_STATE_FP8_BLOCK64 = 4,      /* fp8 per element (signed states e4m3, unsigned e5m2),
                                       scaled by an fp32 absmax per 64 consecutive elements of
                                       a row */
  FORGE_STATE_INT4_BLOCK64 = 5      /* a 4-bit map code per element, two to a byte, + fp32
                                       absmax per 64 consecutive elements of a row */
} forge_state_format;
#define FORGE_STATE_FORMAT_COUNT 6

typedef enum { FORGE_DEVICE_CPU = 0, FORGE_DEVICE_CUDA = 1 } forge_device_kind;

typedef enum {
  FORGE_CAP_CPU = 1u << 0,
  FORGE_CAP_OPENMP = 1u << 1,
  FORGE_CAP_CUDA = 1u << 2 /* the CUDA backend is compiled in (a GPU may still be absent) */
} forge_capability;

typedef struct {
  int32_t kind;        /* a forge_device_kind value */
  int32_t index;       /* CUDA device ordinal; 0 for the CPU */
  void* stream;        /* cudaStream_t for CUDA (NULL = default stream); unused on CPU */
  int32_t num_threads; /* CPU: OpenMP threads, 0 = OpenMP's default, at most
                          FORGE_MAX_CPU_THREADS */
} forge_device;

/* Hyper-parameters of one step. Names and meaning are torch.optim's. Fields a
 * rule does not use are ignored (but must not be NaN); forge_rule_query lists those it
 * reads. The step computes in fp32 with scalars made from these in double: a value whose
 * scalars are not finite in fp32 (lr = 1e39, grad_scale = 1e39), or zero where zero is
 * invalid (eps or grad_scale below fp32's smallest subnormal), is refused by name. */
typedef struct {
  int32_t abi_version;
  int32_t rule;              /* a forge_rule value */
  int64_t step;              /* 1-based number of this step (torch's state['step'] after += 1) */
  double lr;
  double weight_decay;
  int32_t decoupled_weight_decay; /* AdamW (default 1), NAdam, RAdam (default 0) */
  int32_t maximize;
  double beta1, beta2, eps;  /* Adam family, Lion (beta1, beta2) */
  double momentum_decay;     /* NAdam */
  double mu_product;         /* NAdam: μ_1 ⋯ μ_step, the product of its momentum factors through
                                this step (torch's state['mu_product'] after this step's
                                factor), in [0, 1) and at most that factor μ_step (times
                                1 + 2^-23: its fp32 rounding); -1 (forge_hparams_default's):
                                computed, for a beta1 and momentum_decay constant since step 1 */
  double alpha;              /* RMSprop */
  double momentum;           /* SGD_MOMENTUM, RMSprop, MUON */
  double dampening;          /* SGD_MOMENTUM */
  int32_t nesterov;          /* SGD_MOMENTUM, MUON */
  int32_t centered;          /* RMSprop */
  double lr_decay;           /* Adagrad */
  double initial_accumulator_value; /* Adagrad: >= 0, storable as fp32 (at most the largest
                                       bf16, as every stored state) */
  double grad_scale;         /* the gradient is multiplied by this before anything (1 = none) */
  uint64_t seed;             /* stochastic rounding: bits = hash(seed, step, stream, the
                                element's index; forge_param says which index) */
  /* CUDA graphs. NULL: the step uses step, lr, seed and mu_product above, as they are at
   * the call. Otherwise FORGE_RUN_SCALARS_BYTES of memory on the step's device, 16-byte
   * aligned, holding what forge_run_scalars_fill() wrote from hyper-parameters that differ
   * from these in step, lr, seed and mu_product only. The step reads its step-dependent
   * scalars from there when it runs, so a captured launch replays with whatever was copied
   * there before the replay. The other fields are still checked here, and choose the kernel.
   * The buffer carries a tag (its last 32 bytes: a fill marker, the ABI version, the rule,
   * the state count, a hash of every field but step, lr, seed and mu_product, and a checksum
   * of the rest). The CPU backend checks it at every call and refuses, naming hparams.run_scalars,
   * a buffer that is unfilled, filled for another rule, state count or other
   * hyper-parameters, or changed since the fill. The CUDA backend refuses at the call a
   * buffer that is not memory of the step's device, and checks the tag (the same checks) on
   * the device each time the step runs, a captured graph's replays included, where nothing
   * can be returned: a step whose buffer does not match writes nothing (weight, master,
   * states, grad_sq_sum) and adds rows · cols, every element skipped, to
   * *outputs.nonfinite_count where that is set. A graph that must notice sets
   * nonfinite_count and reads it after the replay. */
  const void* run_scalars;
} forge_hparams;

/* Bytes of a run_scalars buffer (forge_hparams.run_scalars, forge_run_scalars_fill). */
#define FORGE_RUN_SCALARS_BYTES 256

/* One parameter: its weight and optimizer states. */
typedef struct {
  int64_t rows, cols;                 /* [rows, cols]; a linear layer's W is [out, in] */
  int32_t weight_format;              /* a forge_weight_format value */
  void* weight;                       /* [rows, cols] fp32 or bf16 per weight_format */
  float* master;                      /* [rows, cols] fp32, FORGE_WEIGHT_BF16_MASTER only */
  int32_t state_format;               /* a forge_state_format value */
  void* state[FORGE_MAX_STATES];      /* [rows, cols] each; float / bf16 / uint8 codes; int4:
                                         [rows, ceil(cols / 2)] bytes, column 2j in byte j's
                                         low 4 bits, 2j + 1 in its high 4 bits */
  float* state_absmax[FORGE_MAX_STATES]; /* [rows, ceil(cols / 64)] each, int8 / fp8 / int4 */
  /* Shards (tensor parallel: a block of rows or of columns; FSDP: rows): this param is the
   * block [rows, cols] at (row_offset, col_offset) of a full [*, full_cols] parameter. Its
   * element (r, c) then draws the stochastic-rounding bits of its index in the full parameter,
   * (row_offset + r) · full_cols + col_offset + c, so a step gives the same bits however the
   * parameter is sharded. 0, 0, 0: not a shard (the index is r · cols + c). Checked: offsets
   * >= 0; full_cols 0 only with both offsets 0, else full_cols >= col_offset + cols and every
   * index below 2^61; int8, fp8 and int4 states need shards of whole blocks of 64 columns
   * (col_offset % 64 == 0, and col_offset + cols a multiple of 64 or full_cols). The buffers
   * are the shard's own: [rows, cols] contiguous (int4: [rows, ceil(cols / 2)] bytes), absmax
   * [rows, ceil(cols / 64)]. On CUDA a
   * stochastically rounded shard whose col_offset or full_cols is not a multiple of 4 takes a
   * slower path (no vector accesses); the bits are the same. */
  int64_t row_offset, col_offset, full_cols;
} forge_param;

/* Optional by-products of a step. Each non-NULL pointer is ADDED to (the
 * caller zeroes it once per optimizer step), on the step's device. */
typedef struct {
  double* grad_sq_sum;      /* Σ g² over the elements updated (g after grad_scale) */
  int64_t* nonfinite_count; /* number of elements skipped (see "Skipped elements" below) */
} forge_step_outputs;

/* Skipped elements. An element whose gradient (after grad_scale) is NaN/Inf, or whose
 * update would make its new weight, master or a state not storable (NaN, infinite, or of
 * magnitude above the largest bf16, 0x1.FEp127, from which bf16 rounding can overflow: a
 * finite gradient of 1e20 whose g² overflows, an lr·update beyond fp32), is skipped: its
 * weight, master and states stay as they were, it is counted in nonfinite_count and left
 * out of grad_sq_sum. Every format, every backend, fused or element-wise.
 * int8, fp8 and int4 states share an absmax per block of 64: a block without skipped elements
 * takes the largest magnitude of its new values as absmax (fp8: 0 below 2^-100). A block
 * holding one keeps its absmax while the new magnitudes of its updated elements fit under it,
 * and its skipped elements keep their code bytes; otherwise the absmax grows to the old one
 * times the smallest power of two that holds them (at most the largest bf16), and the skipped
 * elements are re-encoded from their decoded values against it. A skipped element's value so
 * stays bit for bit what it was while it lies in its block's range (int8: at or above the
 * smallest level, 2^-15.75 of the absmax for a signed state, 2^-31.75 unsigned; fp8: at or
 * above the smallest normal value, 2^-6 / 448 of the absmax for e4m3, 2^-14 / 57344 for e5m2),
 * and within one step of the block's smallest grid below that. int4's maps are not powers of
 * two apart: there a re-encoded skipped element takes the nearest code of the grown block.
 * An absmax no step stores (NaN, infinite, negative, above the largest bf16) is refused by a
 * CPU step, naming the block, before anything is written. The CUDA backend does not read
 * device memory at the call: there such a block steps on what its codes decode to (a NaN or
 * infinite absmax: every element of the block skipped and counted, the block unchanged). */

/* The fused step of a linear layer: for each tile of W, dW = Σ_t dY[t]ᵀ X[t] in
 * fp32, then the rule is applied in place. X: [tokens, cols] (ld = ldx),
 * dY: [tokens, rows] (ld = lddy), W: [rows, cols]. Nothing of size rows × cols
 * is allocated. Elements are skipped and counted as "Skipped elements" says. */
typedef struct {
  int32_t abi_version;
  forge_device device;
  int64_t tokens;
  const void* x;  int32_t x_dtype;  int64_t ldx;   /* [tokens, cols]; x_dtype a forge_dtype */
  const void* dy; int32_t dy_dtype; int64_t lddy;  /* [tokens, rows]; dy_dtype a forge_dtype */
  forge_param param;
  forge_hparams hparams;
  forge_step_outputs outputs;
  int32_t tile_rows, tile_cols; /* CPU tile shape, 0 = 128, at most FORGE_MAX_TILE each;
                                   block states need tile_cols % 64 == 0 */
} forge_wgrad_args;

/* The same rules on a gradient that already exists ([rows, cols], contiguous). */
typedef struct {
  int32_t abi_version;
  forge_device device;
  const void* grad; int32_t grad_dtype;  /* [rows, cols]; grad_dtype a forge_dtype */
  forge_param param;
  forge_hparams hparams;
  forge_step_outputs outputs;
} forge_elementwise_args;

/* What a rule keeps for a parameter, in the given state format. */
typedef struct {
  int32_t num_states;                      /* 0..3; state[0..num_states) are used */
  int32_t is_signed[FORGE_MAX_STATES];     /* 1: first-moment-like (signed int8 / int4 map, e4m3
                                              fp8) */
  int64_t state_bytes[FORGE_MAX_STATES];   /* bytes of each state buffer */
  int64_t absmax_count[FORGE_MAX_STATES];  /* floats of each absmax buffer (block states, else 0) */
  const char* names[FORGE_MAX_STATES];     /* torch.optim's state keys: "exp_avg", ... */
} forge_state_layout;

/* ---- introspection: what a binding reads instead of mirroring this header --------------- */

/* The enumerations of this header. Each has the values 0 .. count - 1, and each value a
 * stable name: */
typedef enum {
  FORGE_ENUM_STATUS = 0,        /* "ok", "invalid_argument", "unsupported", "device",
                                   "out_of_memory", "internal" */
  FORGE_ENUM_DTYPE = 1,         /* "fp32", "bf16", "fp16" */
  FORGE_ENUM_RULE = 2,          /* "SGD", "SGD_MOMENTUM", "AdamW", "NAdam", "RAdam", "Lion",
                                   "RMSprop", "Adagrad", "Muon" */
  FORGE_ENUM_WEIGHT_FORMAT = 3, /* "fp32", "bf16", "bf16_sr", "bf16_master" */
  FORGE_ENUM_STATE_FORMAT = 4,  /* "fp32", "bf16", "bf16_sr", "int8", "fp8" */
  FORGE_ENUM_DEVICE_KIND = 5    /* "cpu", "cuda" */
} forge_enum;
#define FORGE_ENUM_COUNT 6

/* Most forge_hparams fields one rule reads (forge_rule_info.fields). */
#define FORGE_MAX_RULE_FIELDS 16

/* What a rule reads and keeps (forge_rule_query). Strings are static. */
typedef struct {
  const char* name;                               /* its name in FORGE_ENUM_RULE */
  const char* fields[FORGE_MAX_RULE_FIELDS];      /* the forge_hparams fields it reads ("step",
                                                     "lr", "beta1", ...); NULL after the last */
  const char* state_names[FORGE_MAX_STATES];      /* torch.optim's state keys, in the slot order
                                                     of its largest configuration */
  const char* state_condition[FORGE_MAX_STATES];  /* NULL: the state is always kept; else the
                                                     forge_hparams field that must be non-zero
                                                     for it ("centered", "momentum"). A state
                                                     not kept takes no slot: later ones move up */
  int32_t num_fields;
  int32_t max_states;                             /* states of its largest configuration */
  int32_t state_signed[FORGE_MAX_STATES];         /* 1: signed (first moment): int8 map, e4m3 */
} forge_rule_info;

FORGE_API int32_t forge_abi_version(void);
FORGE_API const char* forge_version_string(void);
FORGE_API uint32_t forge_capabilities(void);
/* Message of the last failed call on this thread ("" if none). */
FORGE_API const char* forge_last_error(void);

/* `rule`: a forge_rule value. */
FORGE_API forge_status forge_hparams_default(int32_t rule, forge_hparams* out);
/* `format`: a forge_state_format value. */
FORGE_API forge_status forge_state_layout_query(const forge_hparams* hparams, int32_t format,
                                                int64_t rows, int64_t cols,
                                                forge_state_layout* out);
/* Number of values of enumeration `kind` (a forge_enum value). */
FORGE_API forge_status forge_enum_count(int32_t kind, int32_t* count);
/* The name of `value` in enumeration `kind`. */
FORGE_API forge_status forge_enum_name(int32_t kind, int32_t value, const char** name);
/* The value named `name` (ASCII case-insensitive) in enumeration `kind`; an unknown name is
 * refused with a message listing the known ones. */
FORGE_API forge_status forge_enum_value(int32_t kind, const char* name, int32_t* value);
/* What rule `rule` (a forge_rule value) reads and keeps. */
FORGE_API forge_status forge_rule_query(int32_t rule, forge_rule_info* out);
/* sizeof the public struct named `name` ("forge_hparams", "forge_param", ...: every typedef
 * struct of this header), so a binding can check its mirrors when it loads the library. */
FORGE_API forge_status forge_struct_size(const char* name, int64_t* size);

/* Fills every state the rule uses with its initial value (0, or Adagrad's
 * initial_accumulator_value). */
FORGE_API forge_status forge_state_init(const forge_param* param, const forge_hparams* hparams,
                                        forge_device device);
/* Converts state `index` of `param` to / from fp32 [rows, cols] (for
 * checkpoints and inspection); hparams says which rule owns the states (int8
 * first moments use the signed map, fp8 ones e4m3). from_fp32 rounds to nearest (bf16) or
 * quantizes per block (int8, fp8) exactly as a step stores it, and refuses, naming the first
 * offending index of `in` and writing nothing, what no step stores: a value that is not
 * storable (see "Skipped elements"), or a negative value for an unsigned (second-moment)
 * state. */
FORGE_API forge_status forge_state_to_fp32(const forge_param* param, const forge_hparams* hparams,
                                           int32_t index, float* out, forge_device device);
FORGE_API forge_status forge_state_from_fp32(const forge_param* param,
                                             const forge_hparams* hparams, int32_t index,
                                             const float* in, forge_device device);

/* Writes into `out` (host memory, `bytes` >= FORGE_RUN_SCALARS_BYTES) the scalars a step
 * with these hyper-parameters uses, and their tag: what a run_scalars buffer must hold, once
 * copied byte for byte to the step's device (hparams->run_scalars itself is ignored). */
FORGE_API forge_status forge_run_scalars_fill(const forge_hparams* hparams, void* out,
                                              int64_t bytes);

FORGE_API forge_status forge_wgrad_step(const forge_wgrad_args* args);
FORGE_API forge_status forge_elementwise_step(const forge_elementwise_args* args);
/* Many element-wise steps in one call: args[0 .. count), each what forge_elementwise_step takes.
 * Every entry is checked, and no entry's buffers (its parameter's, its gradient, its outputs
 * and run_scalars) may share bytes with another entry's where either writes, before any runs:
 * a refusal names the entry ("args[i]: ...") or both entries, and writes nothing. Entries may
 * name the same output (one grad_sq_sum, one nonfinite_count for all: each adds to it in turn)
 * and read the same run_scalars buffer. The entries then run in order, each on its own
 * device and stream, as that many forge_elementwise_step calls would; a device failure stops
 * the batch at the entry it names. count = 0 does nothing. */
FORGE_API forge_status forge_elementwise_step_batch(const forge_elementwise_args* const* args,
                                                    int64_t count);

#ifdef __cplusplus
}
#endif
#endif /* FORGE_FORGE_H_ */
