// test_alloc_failure.cpp — no C++ exception leaves the C ABI: an allocation that fails inside
// a call is FORGE_ERR_OUT_OF_MEMORY, any other exception FORGE_ERR_INTERNAL, and nothing is
// written either way; and the calls that need no memory allocate none.
// Its own executable: it replaces the global operator new / delete to make allocations fail
// on demand, which the main suite leaves to the sanitizers.
#include <atomic>
#include <cstdlib>
#include <new>
#include <exception>

#include "test_util.h"

namespace {

enum class Inject { kNone, kBadAlloc, kOther };
std::atomic<Inject> g_inject{Inject::kNone};
std::atomic<int> g_refused{0};

// An exception that allocates nothing (a std::runtime_error's message would call operator new).
struct InjectedFailure : std::exception {
  const char* what() const noexcept override { return "injected failure"; }
};

}  // namespace

void* operator new(std::size_t n) {
  switch (g_inject.load()) {
    case Inject::kBadAlloc: ++g_refused; throw std::bad_alloc();
    // NOTE: breaks operator new's contract (only bad_alloc) on purpose: a stand-in for any
    // other exception a call could meet.
    case Inject::kOther: ++g_refused; throw InjectedFailure();
    default: break;
  }
  if (void* p = std::malloc(n ? n : 1)) return p;
  throw std::bad_alloc();
}
void* operator new[](std::size_t n) { return operator new(n); }
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }

namespace forge_test {
namespace {

// Arms the injection for the lifetime of the scope.
struct Injecting {
  explicit Injecting(Inject what) {
    g_refused = 0;
    g_inject = what;
  }
  ~Injecting() { g_inject = Inject::kNone; }
};

struct Step {
  forge_hparams hp;
  Rng rng{fresh_seed()};
  HostParam param;
  Matrix x, dy;
  std::vector<float> grad;
  double sq = 1.5;
  int64_t count = 7;
  Step()
      : hp([] { forge_hparams h; forge_hparams_default(FORGE_RULE_ADAMW, &h); return h; }()),
        param(40, 130, FORGE_WEIGHT_BF16, FORGE_STATE_INT8_BLOCK64, hp),
        x(random_matrix(rng, 6, 130, 130, FORGE_DTYPE_BF16)),
        dy(random_matrix(rng, 6, 40, 40, FORGE_DTYPE_BF16)),
        grad(40 * 130, 0.5f) {
    param.randomize(rng, hp);
  }
  forge_wgrad_args wgrad(int threads) {
    forge_wgrad_args a = wgrad_args(param, hp, x, dy);
    a.outputs = {&sq, &count};
    a.device.num_threads = threads;
    a.tile_rows = 16;
    a.tile_cols = 64;
    return a;
  }
};

TEST(AllocationFailure, WgradStepReportsOutOfMemoryAndWritesNothing) {
  for (int threads : {1, 3}) {
    SCOPED_TRACE(::testing::Message() << threads << " threads");
    Step s;
    const forge_wgrad_args a = s.wgrad(threads);
    const std::vector<uint8_t> before = s.param.snapshot();
    forge_status status;
    {
      Injecting fail(Inject::kBadAlloc);
      status = forge_wgrad_step(&a);
    }
    EXPECT_GT(g_refused.load(), 0) << "the step allocated nothing: the test tests nothing";
    EXPECT_EQ(status, FORGE_ERR_OUT_OF_MEMORY);
    EXPECT_NE(std::string(forge_last_error()).find("forge_wgrad_step: out of host memory"),
              std::string::npos) << forge_last_error();
    EXPECT_EQ(s.param.snapshot(), before);
    EXPECT_EQ(s.sq, 1.5);
    EXPECT_EQ(s.count, 7);
    EXPECT_EQ(forge_wgrad_step(&a), FORGE_OK) << forge_last_error();  // memory again: it runs
    EXPECT_NE(s.param.snapshot(), before);
  }
}

TEST(AllocationFailure, AnyOtherExceptionIsAnInternalError) {
  Step s;
  const forge_wgrad_args a = s.wgrad(2);
  const std::vector<uint8_t> before = s.param.snapshot();
  forge_status status;
  {
    Injecting fail(Inject::kOther);
    status = forge_wgrad_step(&a);
  }
  EXPECT_EQ(status, FORGE_ERR_INTERNAL);
  EXPECT_NE(std::string(forge_last_error()).find("injected failure"), std::string::npos)
      << forge_last_error();
  EXPECT_EQ(s.param.snapshot(), before);
}

// Everything but the fused step runs without allocating (so it cannot fail for memory).
TEST(AllocationFailure, OtherEntryPointsAllocateNothing) {
  Step s;
  const forge_device cpu{};
  forge_elementwise_args e = elementwise_args(s.param, s.hp, s.grad);
  e.device.num_threads = 3;
  std::vector<float> state(s.param.size());
  alignas(16) unsigned char run[FORGE_RUN_SCALARS_BYTES];
  forge_state_layout layout;
  forge_rule_info info;
  int32_t code;
  int64_t size;
  Injecting fail(Inject::kBadAlloc);
  EXPECT_EQ(forge_elementwise_step(&e), FORGE_OK) << forge_last_error();
  EXPECT_EQ(forge_state_to_fp32(&s.param.p, &s.hp, 1, state.data(), cpu), FORGE_OK);
  EXPECT_EQ(forge_state_from_fp32(&s.param.p, &s.hp, 1, state.data(), cpu), FORGE_OK);
  EXPECT_EQ(forge_state_init(&s.param.p, &s.hp, cpu), FORGE_OK);
  EXPECT_EQ(forge_run_scalars_fill(&s.hp, run, sizeof(run)), FORGE_OK);
  EXPECT_EQ(forge_state_layout_query(&s.hp, FORGE_STATE_INT8_BLOCK64, 3, 3, &layout), FORGE_OK);
  EXPECT_EQ(forge_rule_query(FORGE_RULE_NADAM, &info), FORGE_OK);
  EXPECT_EQ(forge_enum_value(FORGE_ENUM_RULE, "lion", &code), FORGE_OK);
  EXPECT_EQ(forge_struct_size("forge_param", &size), FORGE_OK);
  EXPECT_EQ(g_refused.load(), 0);
}

}  // namespace
}  // namespace forge_test
