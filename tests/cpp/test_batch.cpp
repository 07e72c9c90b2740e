// test_batch.cpp — forge_elementwise_step_batch: the same bits as one forge_elementwise_step
// per entry, in order; a bad entry (or two entries sharing written bytes) is refused by name
// before anything is written.
#include <memory>

#include "test_util.h"

namespace forge_test {
namespace {

struct Entry {
  std::unique_ptr<HostParam> param;
  std::vector<float> grad;
  forge_hparams hp;
};

// Parameters of odd shapes and every weight / state format, with random weights, states and
// gradients (the gradient of a 1-element parameter and of a 4097-wide row included).
std::vector<Entry> random_entries(Rng& rng) {
  struct Shape {
    int64_t rows, cols;
    forge_weight_format wf;
    forge_state_format sf;
  };
  const Shape shapes[] = {
      {1, 1, FORGE_WEIGHT_FP32, FORGE_STATE_FP32},
      {1, 17, FORGE_WEIGHT_BF16, FORGE_STATE_BF16},
      {3, 129, FORGE_WEIGHT_BF16_STOCHASTIC, FORGE_STATE_BF16_STOCHASTIC},
      {2, 4097, FORGE_WEIGHT_BF16, FORGE_STATE_INT8_BLOCK64},
      {5, 64, FORGE_WEIGHT_BF16_MASTER, FORGE_STATE_FP32},
  };
  std::vector<Entry> entries;
  int index = 0;
  for (const Shape& s : shapes) {
    Entry e;
    forge_hparams_default(index % 2 ? FORGE_RULE_ADAMW : FORGE_RULE_LION, &e.hp);
    e.hp.step = 3 + index;
    e.hp.seed = 11 * index + 1;
    e.param = std::make_unique<HostParam>(s.rows, s.cols, s.wf, s.sf, e.hp);
    e.param->randomize(rng, e.hp);
    e.grad.resize(s.rows * s.cols);
    for (float& g : e.grad) g = rng.normal(0.1f);
    entries.push_back(std::move(e));
    ++index;
  }
  return entries;
}

std::vector<forge_elementwise_args> args_of(const std::vector<Entry>& entries, double* sq,
                                            int64_t* count) {
  std::vector<forge_elementwise_args> args;
  for (const Entry& e : entries) {
    args.push_back(elementwise_args(*e.param, e.hp, e.grad));
    args.back().outputs = {sq, count};  // shared by every entry, as forge.optim passes them
  }
  return args;
}

std::vector<const forge_elementwise_args*> pointers(const std::vector<forge_elementwise_args>& a) {
  std::vector<const forge_elementwise_args*> p;
  for (const forge_elementwise_args& x : a) p.push_back(&x);
  return p;
}

// Random entries, their args (sharing one pair of statistics outputs) and their bytes before.
struct Batch {
  std::vector<Entry> entries;
  double sq;
  int64_t nf;
  std::vector<forge_elementwise_args> args;
  std::vector<std::vector<uint8_t>> before;
  Batch(Rng& rng, double sq0, int64_t nf0) : entries(random_entries(rng)), sq(sq0), nf(nf0) {
    args = args_of(entries, &sq, &nf);
    for (const Entry& e : entries) before.push_back(e.param->snapshot());
  }
  forge_elementwise_args fresh(size_t i) { return args_of(entries, &sq, &nf)[i]; }
  void expect_unchanged(double sq0, int64_t nf0) const {
    for (size_t i = 0; i < entries.size(); ++i) EXPECT_EQ(entries[i].param->snapshot(), before[i]);
    EXPECT_EQ(sq, sq0);
    EXPECT_EQ(nf, nf0);
  }
};

TEST(ElementwiseBatch, MatchesOneCallPerEntryBitForBit) {
  Rng rng(fresh_seed());
  std::vector<Entry> batched = random_entries(rng);
  std::vector<Entry> single;
  for (const Entry& e : batched)
    single.push_back({std::make_unique<HostParam>(*e.param), e.grad, e.hp});
  single[1].grad[3] = batched[1].grad[3] = NAN;  // a skipped element counts in both
  double sq_batch = 0.0, sq_single = 0.0;
  int64_t nf_batch = 0, nf_single = 0;
  const std::vector<forge_elementwise_args> b = args_of(batched, &sq_batch, &nf_batch);
  const std::vector<const forge_elementwise_args*> bp = pointers(b);
  ASSERT_EQ(forge_elementwise_step_batch(bp.data(), static_cast<int64_t>(bp.size())), FORGE_OK)
      << forge_last_error();
  for (const forge_elementwise_args& a : args_of(single, &sq_single, &nf_single))
    ASSERT_EQ(forge_elementwise_step(&a), FORGE_OK) << forge_last_error();
  for (size_t i = 0; i < batched.size(); ++i) {
    SCOPED_TRACE(i);
    EXPECT_EQ(batched[i].param->snapshot(), single[i].param->snapshot());
  }
  EXPECT_EQ(sq_batch, sq_single);
  EXPECT_GT(sq_batch, 0.0);
  EXPECT_EQ(nf_batch, 1);
  EXPECT_EQ(nf_single, 1);
}

TEST(ElementwiseBatch, ABadEntryIsNamedAndNothingIsWritten) {
  Rng rng(fresh_seed());
  Batch b(rng, 2.5, 4);
  std::vector<forge_elementwise_args>& args = b.args;
  std::vector<const forge_elementwise_args*> p = pointers(args);
  const int64_t n = static_cast<int64_t>(p.size());

  // the last entry bad: the earlier ones must not have run
  args[4].hparams.lr = -1.0;
  EXPECT_EQ(forge_elementwise_step_batch(p.data(), n), FORGE_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(std::string(forge_last_error()).rfind("args[4]: ", 0), 0u) << forge_last_error();
  EXPECT_NE(std::string(forge_last_error()).find("lr"), std::string::npos) << forge_last_error();
  b.expect_unchanged(2.5, 4);
  args[4] = b.fresh(4);

  args[2].grad = nullptr;
  EXPECT_EQ(forge_elementwise_step_batch(p.data(), n), FORGE_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(std::string(forge_last_error()), "args[2]: grad: NULL");
  b.expect_unchanged(2.5, 4);
  args[2] = b.fresh(2);

  p[1] = nullptr;
  EXPECT_EQ(forge_elementwise_step_batch(p.data(), n), FORGE_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(std::string(forge_last_error()).rfind("args[1]: args: NULL", 0), 0u) << forge_last_error();
  b.expect_unchanged(2.5, 4);
  p = pointers(args);

  EXPECT_EQ(forge_elementwise_step_batch(p.data(), -1), FORGE_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(forge_last_error()).find("count"), std::string::npos);
  EXPECT_EQ(forge_elementwise_step_batch(nullptr, 2), FORGE_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(forge_last_error()).find("args: NULL"), std::string::npos);
  EXPECT_EQ(forge_elementwise_step_batch(nullptr, 0), FORGE_OK);
  EXPECT_EQ(forge_elementwise_step_batch(p.data(), 0), FORGE_OK);
  b.expect_unchanged(2.5, 4);
}

TEST(ElementwiseBatch, EntriesThatShareWrittenBytesAreRefused) {
  Rng rng(fresh_seed());
  Batch b(rng, 0.0, 0);
  std::vector<forge_elementwise_args>& args = b.args;
  const std::vector<Entry>& entries = b.entries;
  std::vector<const forge_elementwise_args*> p = pointers(args);
  const int64_t n = static_cast<int64_t>(p.size());
  auto expect_refused = [&](const char* first, const char* second) {
    EXPECT_EQ(forge_elementwise_step_batch(p.data(), n), FORGE_ERR_INVALID_ARGUMENT);
    const std::string message = forge_last_error();
    EXPECT_NE(message.find(first), std::string::npos) << message;
    EXPECT_NE(message.find(second), std::string::npos) << message;
    b.expect_unchanged(0.0, 0);
  };

  // the same parameter twice (entry 1's shape and formats, so each entry alone is valid)
  args.push_back(args[1]);
  p = pointers(args);
  EXPECT_EQ(forge_elementwise_step_batch(p.data(), n + 1), FORGE_ERR_INVALID_ARGUMENT);
  const std::string twice = forge_last_error();  // (the first shared buffer in address order)
  EXPECT_EQ(twice.rfind("args[5].param.", 0), 0u) << twice;
  EXPECT_NE(twice.find("overlaps args[1].param."), std::string::npos) << twice;
  EXPECT_NE(twice.find("both are written"), std::string::npos) << twice;
  b.expect_unchanged(0.0, 0);
  args.pop_back();
  p = pointers(args);

  // one entry reads (its gradient) what another writes (its fp32 master weight)
  args[0].grad = entries[4].param->p.master;
  expect_refused("args[0].grad", "args[4].param.master");
  args[0] = b.fresh(0);

  // one entry's state inside another's
  args[3].param.state_absmax[1] = reinterpret_cast<float*>(entries[2].param->state[0].data());
  expect_refused("param.state_absmax[1]", "param.state[0]");
}

}  // namespace
}  // namespace forge_test

namespace forge_test {
namespace {

// The step outputs and run scalars of a batch: entries may share their outputs (the same
// grad_sq_sum, the same nonfinite_count: forge.optim passes one pair to all) and read the
// same run_scalars, but an entry's output may not lie in another entry's parameter or
// gradient, nor one kind of output on another kind, nor a run_scalars buffer on anything an
// entry writes. Each refused by name, nothing written.
TEST(ElementwiseBatch, OutputsAndRunScalarsMayNotAliasAnotherEntry) {
  Rng rng(fresh_seed());
  Batch b(rng, 0.0, 0);
  std::vector<forge_elementwise_args>& args = b.args;
  std::vector<Entry>& entries = b.entries;
  std::vector<const forge_elementwise_args*> p = pointers(args);
  const int64_t n = static_cast<int64_t>(p.size());
  auto expect_refused = [&](const char* first, const char* second) {
    EXPECT_EQ(forge_elementwise_step_batch(p.data(), n), FORGE_ERR_INVALID_ARGUMENT);
    const std::string message = forge_last_error();
    EXPECT_NE(message.find(first), std::string::npos) << message;
    EXPECT_NE(message.find(second), std::string::npos) << message;
    b.expect_unchanged(0.0, 0);
    for (size_t i = 0; i < args.size(); ++i) args[i] = b.fresh(i);
  };

  // entry 0's grad_sq_sum inside entry 1's weight (bf16 [1, 17]: 8 aligned bytes at its start)
  args[0].outputs.grad_sq_sum = reinterpret_cast<double*>(entries[1].param->weight.data());
  ASSERT_EQ(reinterpret_cast<uintptr_t>(args[0].outputs.grad_sq_sum) % 8, 0u);
  expect_refused("args[0].outputs.grad_sq_sum", "args[1].param.weight");

  // entry 3's nonfinite_count on entry 4's master (fp32)
  args[3].outputs.nonfinite_count = reinterpret_cast<int64_t*>(entries[4].param->master.data());
  expect_refused("args[3].outputs.nonfinite_count", "args[4].param.master");

  // entry 2's grad_sq_sum on entry 0's gradient, which entry 0 reads
  std::vector<double> scratch(8, 0.0);
  args[2].outputs.grad_sq_sum = reinterpret_cast<double*>(entries[0].grad.data());
  if (reinterpret_cast<uintptr_t>(args[2].outputs.grad_sq_sum) % 8 == 0)
    expect_refused("args[2].outputs.grad_sq_sum", "args[0].grad");
  else
    args[2] = b.fresh(2);

  // one entry's grad_sq_sum on another's nonfinite_count: two kinds of output on one place
  int64_t shared = 0;
  args[1].outputs.nonfinite_count = &shared;
  args[3].outputs.grad_sq_sum = reinterpret_cast<double*>(&shared);
  expect_refused("outputs.grad_sq_sum", "outputs.nonfinite_count");

  // a run_scalars buffer (read) inside an entry's state (written)
  forge_hparams filled = args[0].hparams;
  alignas(16) unsigned char run[FORGE_RUN_SCALARS_BYTES];
  ASSERT_EQ(forge_run_scalars_fill(&filled, run, sizeof(run)), FORGE_OK) << forge_last_error();
  std::vector<uint8_t>& state = entries[3].param->state[0];  // int8 codes, 2 × 4097 bytes
  uint8_t* inside = state.data() + (16 - reinterpret_cast<uintptr_t>(state.data()) % 16);
  std::memcpy(inside, run, sizeof(run));
  const std::vector<uint8_t> with_run = state;
  entries[3].param->state[0] = with_run;  // (what "before" holds for it)
  b.before[3] = entries[3].param->snapshot();
  for (size_t i = 0; i < args.size(); ++i) args[i] = b.fresh(i);
  args[0].hparams.run_scalars = entries[3].param->state[0].data() + (inside - state.data());
  expect_refused("args[0].hparams.run_scalars", "args[3].param.state[0]");

  // shared outputs and a shared run_scalars buffer are fine
  alignas(16) unsigned char run0[FORGE_RUN_SCALARS_BYTES];
  ASSERT_EQ(forge_run_scalars_fill(&args[0].hparams, run0, sizeof(run0)), FORGE_OK);
  args[0].hparams.run_scalars = run0;
  EXPECT_EQ(forge_elementwise_step_batch(p.data(), n), FORGE_OK) << forge_last_error();
  EXPECT_GT(b.sq, 0.0);
}

}  // namespace
}  // namespace forge_test

namespace forge_test {
namespace {

// A later entry's run_scalars buffer that does not match (unfilled, or filled for other
// hyper-parameters) is refused before any entry runs: the CPU backend checked it only when
// that entry's turn came, after the entries before it had written their steps.
TEST(ElementwiseBatch, ALaterEntrysRunScalarsAreCheckedBeforeAnyRuns) {
  Rng rng(fresh_seed());
  Batch b(rng, 1.0, 2);
  std::vector<const forge_elementwise_args*> p = pointers(b.args);
  alignas(16) unsigned char unfilled[FORGE_RUN_SCALARS_BYTES] = {};
  alignas(16) unsigned char other[FORGE_RUN_SCALARS_BYTES];
  forge_hparams changed = b.args[3].hparams;
  changed.weight_decay += 0.25;
  ASSERT_EQ(forge_run_scalars_fill(&changed, other, sizeof(other)), FORGE_OK) << forge_last_error();
  for (const unsigned char* run : {static_cast<const unsigned char*>(unfilled), static_cast<const unsigned char*>(other)}) {
    b.args[3].hparams.run_scalars = run;
    EXPECT_EQ(forge_elementwise_step_batch(p.data(), static_cast<int64_t>(p.size())), FORGE_ERR_INVALID_ARGUMENT);
    const std::string message = forge_last_error();
    EXPECT_EQ(message.rfind("args[3]: hparams.run_scalars", 0), 0u) << message;
    b.expect_unchanged(1.0, 2);
  }
}

}  // namespace
}  // namespace forge_test
