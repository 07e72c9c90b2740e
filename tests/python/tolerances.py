"""tolerances.py — every tolerance of the Python tests, in one place, with its reason.

Weight differences are measured per parameter tensor as max|a − b| / max|b| ("normwise
relative"). Element-wise relative error is not a usable metric for these rules: an
element whose gradient is cancellation noise (|g| ≪ max|g|, or g ≈ −wd·w with coupled
decay) is normalised by Adam/RMSprop/Adagrad into an O(lr) step whose size depends on the
last bits of g, so a 1-ulp change of g moves that one element by a large *relative*
amount while the tensor as a whole moves by ~1e-7. A tensor whose values all pass near zero
(a one-element bias changing sign) is measured against the largest max|b| it has had
(reference.TrajectoryNormwise, in the random-loop test): its rounding is an ulp of those values.
"""

# The contract, fp32 model + fp32 states, against torch.optim given dW summed over tokens
# in the same order as FORGE's CPU backend (tests/python/reference.py): what remains is
# torch's own kernels (FMA in add/addcdiv/lerp) against libforge's unfused fp32 element
# code: about 1e-7 per step, 1e-6 after 8 steps.
CONTRACT_RTOL = 1e-5

# NAdam's checkpoint crossing between torch.optim and forge (test_state.py): six fp32 steps of
# an 8 × 8 two-layer model after the load, against torch.optim.NAdam run throughout; the
# same sources of difference as the contract's, over fewer, smaller steps.
NADAM_CROSSING_RTOL = 1e-6

# Some rules/hyper-parameters amplify 1-ulp differences by their nature (centered RMSprop
# with coupled weight decay measured 4e-5 after 8 steps when torch.optim itself is fed
# gradients perturbed by one ulp). Each contract run therefore also measures torch.optim's
# own divergence under a 1-ulp gradient perturbation and allows this factor times it.
ULP_SENSITIVITY_FACTOR = 2.0

# The loop comparisons against stock torch (reference.stock_loop_error) measure that
# divergence under one-ulp noise on the gradients and on the stepped weights, whose direction
# is a random draw. Near a zero gradient AdamW's direction m / (√v + eps) turns on that ulp, so
# the divergence depends on the draw: on a 4-step convolution loop it ranged 2.6e-6 to 1.4e-5
# over 8 draws (forge 6.7e-6, within them). The bound takes the largest of this many draws.
ULP_PROBES = 3

# Against stock torch.optim + nn.Linear (its GEMM sums tokens in its own blocked order, and
# on CUDA FORGE's kernel has a third order): the run measures how far torch moves when only
# its summation order changes (stock vs token-ordered dW) and allows this factor times it.
# Summation-order noise is not deterministic in size across orders, hence the margin.
SUM_ORDER_FACTOR = 10.0

# Global grad norm (Σ g² in fp64 by the update kernels) vs clip_grad_norm_'s fp32 total
# norm from a plain run: different summation orders in fp32, ~1e-7 measured.
GRAD_NORM_RTOL = 1e-5

# One stored optimizer state decoded back to fp32 (state_fp32) against the fp32 state of a
# run that saw the same gradient: only the store errs. bf16 with stochastic rounding: less
# than 1 ulp = 2^-7 relative; int8 block-64 log map: ≤ 4.4 % of the value (≤ 4.5 % of max);
# fp8: half a step of e4m3 (first moments, 2^-4) or e5m2 (second moments, 2^-3), the block's
# fp32 factors adding at most 5 · 2^-24 relative (1e-6 covers them). int4 (16 values, absolute
# steps of the block's absmax, so at most these of the tensor's max): half the widest gap of
# the signed map (0.225 / 2) for first moments, of the unsigned one (0.1125 / 2) for second
# moments (no zero: a value below 0.00055 reads as it, far closer); 1e-6 for fp32's roundings.
STATE_STORE_RTOL = {"fp32": 0.0, "bf16": 2 ** -7, "int8": 0.045,
                    "fp8": {"exp_avg": 2 ** -4 + 1e-6, "exp_avg_sq": 2 ** -3 + 1e-6},
                    "int4": {"exp_avg": 0.1125 + 1e-6, "exp_avg_sq": 0.05625 + 1e-6}}

# Low precision is measured on the update, per tensor: ‖Δw − Δw_ref‖₂ / ‖Δw_ref‖₂ with
# Δw = w_final − w_start and w_ref from fp32 torch.optim.AdamW (lr 1e-2, LOWP_STEPS steps,
# the same bf16-representable start). A normwise weight metric would be ruled by single
# elements whose Adam step flips sign under bf16 gradient noise.
LOWP_STEPS = 10
# fp32 model, low-precision states: only the state stores differ. bf16 rounds m and v to
# 2^-9 relative (measured 0.003); the int8 block-64 log map errs by ≤ 4.4 % per element
# and store (measured 0.03); fp8 by ≤ 6.25 % on m (e4m3) and ≤ 12.5 % on v (e5m2, 6.25 % on
# √v), about twice int8's error on the update, so twice its bound (measured 0.044).
STATE_FORMAT_UPDATE_RTOL = {"bf16": 0.01, "int8": 0.08, "fp8": 0.15}
# bf16 model with fp32 master weights: the master follows the fp32 run up to the bf16
# forward/backward's gradient noise (measured 0.09 for every state format).
BF16_MASTER_UPDATE_RTOL = {"fp32": 0.2, "bf16": 0.2, "int8": 0.2, "fp8": 0.2}
# bf16 weights without master (stochastic rounding): no further from the fp32 run than
# torch.optim.AdamW on the same bf16 model (nearest rounding) is, times this margin
# (measured 0.22 against torch's 0.36: SR keeps small updates that nearest drops).
BF16_VS_TORCH_BF16_FACTOR = 1.5

# fp32 model under torch.autocast(bfloat16): forge vs torch.optim.AdamW under the same
# autocast (update metric above). X and dY are bf16 for both; torch rounds its dW GEMM
# output to bf16 (2^-8 relative) before the fp32 update, FORGE keeps the fp32 sum
# (measured 0.005; both are 0.033 from the fp32 run).
AUTOCAST_UPDATE_RTOL = 0.02

# Hugging Face Llama: loss of forge.optim.AdamW vs torch.optim.AdamW(fused=True) at each
# step, relative. fp32: summation order only (loss is well conditioned); bf16 with fp32
# master weights and bf16 states: bf16 activations and state rounding.
HF_LOSS_RTOL = {"float32": 1e-4, "bfloat16": 3e-2}

# forge.lean in fp32: an RMSNorm's input gets two gradient contributions inside the norm
# (through x² and through x·rstd) and one from the residual stream. Autograd adds them in
# one order through the whole graph, lean's recompute sums the norm's two first; in fp32
# (no cast in between) the sums round differently. Normwise over a gradient tensor, up to
# 5.4e-7 measured (tiny Llama / Qwen3 / forge.models). In bf16 the fp32 copy groups them the
# same way and the gradients are identical.
LEAN_FP32_GRAD_RTOL = 1e-5

# forge.lean.cross_entropy against F.cross_entropy on fp32 logits: the same formula, summed
# in chunks of rows and differentiated by hand ((softmax − onehot) / count instead of
# log_softmax's backward): fp32 rounding. Measured 0 on the loss and 3.4e-7 normwise on the
# gradient (random logits, std 3, vocab 1000).
LEAN_CE_RTOL = 1e-6

# The grad norm of a CUDA-graph replay against the same eager step: Σ g² is added into one
# fp64 value by atomics, whose order may differ between two runs of the same kernels; fp64
# sums of ~1e5 fp32 squares differ by far less than this.
GRAPH_GRAD_NORM_RTOL = 1e-6

# The training loop around the step (test_loop.py): forge in deferred mode against torch.optim
# doing the same clip_grad_norm_ / GradScaler / accumulation, with dW summed in forge's order
# over the concatenated micro-batches. What remains: the clip coefficient (forge's norm is
# summed in fp64 without forming dW, torch's in fp32 over dW) and, for torch, the unscale and
# the clip as two roundings where forge's kernel applies one combined scale: about one ulp per
# gradient element per step. The bound is this, or ULP_SENSITIVITY_FACTOR times torch's own
# divergence under one-ulp noise on the gradients and the stepped weights
# (reference.PerturbedByOneUlp), whichever is larger.
LOOP_RTOL = 1e-6

# forge-train under torchrun (tensor parallel, FSDP2) against one process, 4 steps of the
# built-in model: the parallel run's reductions (row-parallel matmuls, the reduce-scatter)
# sum in another order, and the loss and global grad norm follow by rounding (measured
# ~1e-7 relative for both); the margin covers the growth of that difference over the steps.
PARALLEL_RUN_RTOL = 1e-5

# forge.loss.head_cross_entropy against F.cross_entropy(F.linear(hidden, W)) in fp32: the same
# formula in other summation orders: the log-sum-exp taken block by block online, and dX
# summed over the vocabulary as a sum of per-block products (one GEMM over all of it in the
# unfused path). fp32 rounding of sums over hundreds of terms: measured up to 1.1e-6 normwise
# on dX (vocabulary 301 in blocks of 64), 3e-7 on the loss and dW.
HEAD_CE_RTOL = 5e-6

# The deferred mode's ‖dW‖² of bf16 factors on CUDA (Gram products or dW row blocks, every
# product of bf16 values exact in fp32, accumulated in fp32) against the fp64 sum of dYᵀX: fp32
# accumulation over up to a few thousand terms per entry, ~1e-7 relative expected; ten times
# that.
FACTORED_NORM_RTOL = 1e-6

# The same norm where torch.mm takes bf16 factors to the tensor cores with fp32 results: the
# products stay exact, but the tensor cores add in fp32 truncating rather than rounding to
# nearest (Fasi et al., "Numerical behavior of NVIDIA tensor cores", 2021): at most 2^-23
# relative per addition, once per group of at least two products, so up to K · 2^-24 for an
# entry of K terms, all leaning one way on the Gram matrices' diagonals (sums of squares).
# The tests' largest K is 700: 4.2e-5. A formula that drops or doubles a block moves the
# norm by a factor, far beyond it.
FACTORED_NORM_TENSOR_CORE_RTOL = 4.2e-5

# A value computed in fp64 and returned in fp32 (a FactoredGrad's norm, in the gradient's dtype):
# one rounding to fp32, half an ulp, 2^-24 relative.
FP32_ROUNDING_RTOL = 2.0 ** -24

# A load_state_dict that must not depend on the step count (NAdam's 'mu_product' made for a
# state without one, at step 3·10^6; a two-layer model): constant work takes milliseconds even
# on a busy 2-core machine, a Python loop over the steps took about a second.
PROMPT_LOAD_SECONDS = 0.25

# The default optimizer's peak memory against mode="immediate"'s on the same model and loop
# (test_memory.py; forge-bench --suite memory on a GPU): the first step is deferred, so it
# holds each fused weight's X and dY, or its gradient in W's dtype, where immediate mode holds
# the states it will make; the states are made weight by weight as those are freed. What
# remains is one weight's store beside its states during its update, and the caching
# allocator's rounding on a GPU: the margin the promise allows (5 %).
MEMORY_VS_IMMEDIATE = 1.05

# forge.optim.Muon against torch.optim.Muon + torch.optim.AdamW (fp32 model and momentum, 100
# steps): Newton-Schulz runs in bf16 on a direction rounded to bf16, so a one-ulp difference in
# the fp32 momentum (FORGE's GEMM sums tokens in another order; torch's lerp uses FMA) flips a
# bf16 rounding, and the orthogonalized update (every element a sum over the whole matrix)
# carries it everywhere. The run therefore measures torch against itself with only the batch's
# row order changed (the same loss, another summation order), eight such runs
# (test_muon.py, REORDERINGS), and allows this factor times the largest of their distances:
# one such distance alone is a single draw of a chaotic process, and FORGE's is another draw.
# Eight, because the draws fall in two clusters, whether an early rounding flipped or not: on
# the CPU with torch 2.15, nesterov off, 13 of 16 reordered runs lay at 0.037-0.074 and 3 at
# 0.127-0.153, so three runs often saw only the lower cluster while FORGE's draw (0.157) fell
# in the upper one. Against the largest of eight on the CPU: 0.30-1.03 (auto, immediate and
# deferred, nesterov on and off); on CUDA, against the largest of three: 0.23-0.74.
MUON_SUM_ORDER_FACTOR = 2.0
