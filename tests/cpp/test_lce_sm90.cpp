// The Hopper LCE path (src/cuda/sm90/lce_sm90.cu) on CUDA device 0: against
// the fp64 reference on the published grid's widths (M in {128, 433},
// N = 256, Ku in {1024, 1025, 1184}, Kc in {1023, 1024, 872}, the reference
// 433/866/1178) at small B, with unsorted maps, users without candidates,
// U = 1, U = B, B = 1, K in {1, 17}, N in {8, 24, 256, 264}, enough work units to make every
// cluster of the persistent grid take several, and user tiles split between
// two units (few users, long Ku); its max abs error against
// that of the cuBLAS path (the same call with the Hopper path switched off);
// bitwise-identical repeated runs; an Inf in the next candidate's or user's
// rows never reaching out; candidate pairs that share a user, straddle two
// or stand alone; and the fallback for shapes it does not take.
// Stream ordering and CUDA-graph capture of lce are tested in
// test_cuda_stream.cpp, whose lce shape takes this path on Hopper GPUs.
// Every test skips, with the reason, unless device 0 is an sm_90 GPU and the
// build carries sm_90a code.
#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <tuple>
#include <vector>

#include "device_harness.hpp"

#ifdef IKBO_WITH_CUDA
#include "cuda/sm90/lce_sm90.hpp"
#endif

namespace ikbo::test {
namespace {

constexpr Device kCuda = Device::cuda(0);

std::optional<std::string> sm90_unavailable_reason() {
#ifdef IKBO_WITH_CUDA
  return hopper_unavailable_reason(detail::cuda::lce_sm90_available, "LCE");
#else
  return hopper_unavailable_reason(nullptr, "LCE");
#endif
}

// Whether lce() takes the Hopper path for these shapes (when enabled).
bool sm90_takes(const LcePlan& plan, const LceShape& shape) {
#ifdef IKBO_WITH_CUDA
  return detail::cuda::lce_sm90_supported(plan.state(), shape.n, shape.num_candidates,
                                          shape.num_users);
#else
  static_cast<void>(plan);
  static_cast<void>(shape);
  return false;
#endif
}

// Turns the Hopper path on or off for a scope (off: lce runs on cuBLAS).
class Sm90Path {
 public:
  explicit Sm90Path(bool enabled) : previous_(get()) { set(enabled); }
  ~Sm90Path() { set(previous_); }
  Sm90Path(const Sm90Path&) = delete;
  Sm90Path& operator=(const Sm90Path&) = delete;

 private:
#ifdef IKBO_WITH_CUDA
  static bool get() { return detail::cuda::lce_sm90_enabled(); }
  static void set(bool enabled) { detail::cuda::set_lce_sm90_enabled(enabled); }
#else
  static bool get() { return false; }
  static void set(bool) {}
#endif
  bool previous_;
};

// One request's inputs on the GPU, with their exact host values.
struct LceProblem {
  LceShape shape;
  HostTensor w_c, w_u, e_c, e_u;
  std::vector<std::int32_t> cand_to_user;
  DeviceTensor e_c_device, e_u_device;
  LcePlan plan;
  CandidateMap map;

  LceProblem(LceShape shape_, HostTensor w_c_, HostTensor w_u_, HostTensor e_c_, HostTensor e_u_,
             std::vector<std::int32_t> cand_to_user_)
      : shape(shape_),
        w_c(std::move(w_c_)),
        w_u(std::move(w_u_)),
        e_c(std::move(e_c_)),
        e_u(std::move(e_u_)),
        cand_to_user(std::move(cand_to_user_)),
        e_c_device(kCuda, e_c),
        e_u_device(kCuda, e_u),
        plan(LcePlan::create(DeviceTensor(kCuda, w_c).view(), DeviceTensor(kCuda, w_u).view())),
        map(CandidateMap::build(cand_to_user.data(), shape.num_candidates, shape.num_users,
                                kCuda)) {}

  std::vector<double> expected() const {
    return reference_lce(shape, w_c.values, w_u.values, e_c.values, e_u.values, cand_to_user);
  }

  // lce into a poisoned output, with a workspace sized by lce_workspace_bytes
  // and poisoned too (all bits set: NaN partials, flags of -1), as a caller's
  // workspace may hold anything.
  std::vector<double> run() const {
    const auto out =
        DeviceTensor::poisoned(kCuda, plan.dtype(), {shape.num_candidates, shape.m, shape.n});
    DeviceBuffer workspace(kCuda,
                           lce_workspace_bytes(plan, e_c_device.view(), e_u_device.view(), map));
    workspace.upload(std::vector<std::byte>(workspace.bytes(), std::byte{0xff}));
    lce(plan, e_c_device.view(), e_u_device.view(), map, out.view(), nullptr,
        {workspace.data(), workspace.bytes()});
    return out.values();
  }
};

LceProblem random_problem(SeededRng& rng, DType dtype, const LceShape& shape, MapOrder order) {
  const auto [m, kc, ku, n, num_candidates, num_users] = shape;
  auto w_c = rng.tensor(dtype, {m, kc});
  auto w_u = rng.tensor(dtype, {m, ku});
  auto e_c = rng.tensor(dtype, {num_candidates, kc, n});
  auto e_u = rng.tensor(dtype, {num_users, ku, n});
  auto cand_to_user = rng.candidate_map(num_candidates, num_users, order);
  return LceProblem(shape, std::move(w_c), std::move(w_u), std::move(e_c), std::move(e_u),
                    std::move(cand_to_user));
}

double max_abs_error(std::span<const double> actual, std::span<const double> expected) {
  double largest = 0.0;
  for (std::size_t i = 0; i < std::min(actual.size(), expected.size()); ++i) {
    largest = std::max(largest, std::abs(actual[i] - expected[i]));
  }
  return largest;
}

class LceSm90Test : public testing::Test {
 protected:
  void SetUp() override {
    if (const auto reason = sm90_unavailable_reason()) GTEST_SKIP() << *reason;
  }
};

// 300 work units, 140 of them user units: every cluster of the persistent
// grid takes several, the stage ring wraps across units, and candidate
// units wait for user units of later rounds.
const LceShape kManyUnits{433, 136, 72, 256, 80, 70};
// 420 work units over few users: each user tile's k-steps are split between
// two user units (each adds its sum, with a bulk reduction, into the P tile
// cleared in the launch), and every cluster takes several candidate units
// after them.
const LceShape kSplitUserTiles{433, 136, 1178, 256, 200, 5};

const std::vector<LceCase>& sm90_cases() {
  static const std::vector<LceCase> cases = {
      {"reference_widths", {433, 866, 1178, 256, 8, 3}, MapOrder::unsorted},
      {"m128_k1024", {128, 1024, 1024, 256, 9, 4}, MapOrder::unsorted},
      {"k1023_k1025_empty_users", {433, 1023, 1025, 256, 10, 5}, MapOrder::uneven_unsorted},
      {"k872_k1184_user_per_candidate", {433, 872, 1184, 256, 6, 6}, MapOrder::unsorted},
      {"one_user_n264", {128, 872, 1184, 264, 5, 1}, MapOrder::sorted},
      {"n8", {433, 1024, 1025, 8, 7, 3}, MapOrder::unsorted},
      {"n24_empty_users", {128, 1023, 1024, 24, 9, 4}, MapOrder::uneven},
      {"n264", {433, 1023, 1184, 264, 4, 2}, MapOrder::unsorted},
      // One candidate; K = 1 and 17: one k-step, nearly all of it the
      // TMA's zero fill.
      {"one_candidate", {433, 866, 1178, 256, 1, 1}, MapOrder::sorted},
      {"k1_k17", {128, 1, 17, 256, 7, 3}, MapOrder::uneven_unsorted},
      {"many_units", kManyUnits, MapOrder::uneven_unsorted},
      {"split_user_tiles", kSplitUserTiles, MapOrder::uneven_unsorted},
      // N = 384: three N blocks, an odd count (user units pad it to a
      // pair); N = 192: a second block whose second warpgroup has no columns.
      {"n384", {433, 866, 1178, 384, 9, 4}, MapOrder::unsorted},
      {"n384_many_units", {433, 136, 72, 384, 80, 70}, MapOrder::uneven_unsorted},
      {"n192_split_user_tiles", {433, 136, 1178, 192, 200, 5}, MapOrder::uneven_unsorted},
  };
  return cases;
}

using Sm90Param = std::tuple<DType, LceCase>;

class LceSm90VsReference : public testing::TestWithParam<Sm90Param> {
 protected:
  void SetUp() override {
    if (const auto reason = sm90_unavailable_reason()) GTEST_SKIP() << *reason;
  }
  DType dtype() const { return std::get<0>(GetParam()); }
  const LceCase& sm90_case() const { return std::get<1>(GetParam()); }
};

TEST_P(LceSm90VsReference, MatchesFp64ReferenceAndCublasErrorAndRepeatsBitwise) {
  SeededRng rng;
  const LceProblem problem = random_problem(rng, dtype(), sm90_case().shape, sm90_case().order);
  ASSERT_TRUE(sm90_takes(problem.plan, problem.shape));
  const std::vector<double> expected = problem.expected();

  std::vector<double> hopper, hopper_again, cublas;
  {
    const Sm90Path on(true);
    hopper = problem.run();
    hopper_again = problem.run();
  }
  {
    const Sm90Path off(false);
    cublas = problem.run();
  }
  EXPECT_TRUE(matches_reference(hopper, expected, dtype()));
  EXPECT_TRUE(matches_reference(cublas, expected, dtype())) << "the cuBLAS path, the bar below";
  EXPECT_TRUE(exactly_equal(hopper_again, hopper)) << "two runs on identical inputs differ";
  // Both paths accumulate in fp32 and round once; they differ only in the
  // fp32 summation order, far below an output ulp, hence the 5% margin.
  const double hopper_error = max_abs_error(hopper, expected);
  const double cublas_error = max_abs_error(cublas, expected);
  EXPECT_LE(hopper_error, 1.05 * cublas_error)
      << "max abs error: Hopper path " << hopper_error << ", cuBLAS path " << cublas_error;
}

std::string sm90_param_name(const testing::TestParamInfo<Sm90Param>& info) {
  return dtype_label(std::get<0>(info.param)) + "_" + std::get<1>(info.param).name;
}

INSTANTIATE_TEST_SUITE_P(Grid, LceSm90VsReference,
                         testing::Combine(testing::Values(DType::f16, DType::bf16),
                                          testing::ValuesIn(sm90_cases())),
                         sm90_param_name);

// Kc = 872 and Ku = 1025 leave partial last k-steps of 64 rows. Candidate 2
// and user 1 are all +Inf: the K tails of candidate 1 and user 0 end right
// before them (the last candidate's tail at the end of e_c). Out-of-range
// rows must read as zeros, so every other candidate's output stays exact.
TEST_F(LceSm90Test, InfInTheNextCandidateOrUserNeverReachesOut) {
  SeededRng rng;
  const DType dtype = DType::f16;
  const LceShape shape{433, 872, 1025, 256, 4, 3};
  const std::int64_t poisoned_candidate = 2, poisoned_user = 1;
  HostTensor e_c = rng.tensor(dtype, {shape.num_candidates, shape.kc, shape.n});
  HostTensor e_u = rng.tensor(dtype, {shape.num_users, shape.ku, shape.n});
  const double inf = std::numeric_limits<double>::infinity();
  const std::int64_t candidate_size = shape.kc * shape.n, user_size = shape.ku * shape.n;
  std::fill_n(e_c.values.begin() + poisoned_candidate * candidate_size, candidate_size, inf);
  std::fill_n(e_u.values.begin() + poisoned_user * user_size, user_size, inf);
  const LceProblem problem(shape, rng.tensor(dtype, {shape.m, shape.kc}),
                           rng.tensor(dtype, {shape.m, shape.ku}), std::move(e_c), std::move(e_u),
                           {0, 2, 1, 0});
  ASSERT_TRUE(sm90_takes(problem.plan, shape));
  const Sm90Path on(true);
  const std::vector<double> out = problem.run();
  const std::vector<double> expected = problem.expected();
  const std::size_t output_size = static_cast<std::size_t>(shape.m * shape.n);
  for (std::int64_t b = 0; b < shape.num_candidates; ++b) {
    if (b == poisoned_candidate) continue;
    SCOPED_TRACE(testing::Message() << "candidate " << b);
    const auto offset = static_cast<std::size_t>(b) * output_size;
    EXPECT_TRUE(matches_reference(std::span(out).subspan(offset, output_size),
                                  std::span(expected).subspan(offset, output_size), dtype));
  }
}

// The two CTAs of a candidate unit take neighbouring candidates of the
// map's by-user order (users 0, 2, 3 with 2, 3 and 2 candidates, users 1
// and 4 with none: by user, candidates 1 4 | 0 2 5 | 3 6). The pairs: two
// candidates of one user, sharing the P tile (1 4, 0 2); two that straddle
// users 2 and 3 (5 3); and candidate 6 alone (odd B), whose partner CTA
// runs its tile again and must store nothing.
TEST_F(LceSm90Test, CandidatePairsSharingStraddlingOrAloneMatchReferenceAndRepeatBitwise) {
  SeededRng rng;
  const DType dtype = DType::bf16;
  const LceShape shape{433, 872, 1025, 256, 7, 5};
  const LceProblem problem(shape, rng.tensor(dtype, {shape.m, shape.kc}),
                           rng.tensor(dtype, {shape.m, shape.ku}),
                           rng.tensor(dtype, {shape.num_candidates, shape.kc, shape.n}),
                           rng.tensor(dtype, {shape.num_users, shape.ku, shape.n}),
                           {2, 0, 2, 3, 0, 2, 3});
  ASSERT_TRUE(sm90_takes(problem.plan, shape));
  const Sm90Path on(true);
  const std::vector<double> out = problem.run();
  EXPECT_TRUE(matches_reference(out, problem.expected(), dtype));
  EXPECT_TRUE(exactly_equal(problem.run(), out)) << "two runs on identical inputs differ";
}

// The walks of many units with ikbo's kernel alone (no cuBLAS comparison):
// the tests device-check runs under racecheck and synccheck, which report
// hazards in cuBLAS's own kernels.
void expect_walk_matches_and_repeats(const LceShape& shape) {
  SeededRng rng;
  const LceProblem problem = random_problem(rng, DType::bf16, shape, MapOrder::uneven_unsorted);
  ASSERT_TRUE(sm90_takes(problem.plan, problem.shape));
  const Sm90Path on(true);
  const std::vector<double> out = problem.run();
  EXPECT_TRUE(matches_reference(out, problem.expected(), DType::bf16));
  EXPECT_TRUE(exactly_equal(problem.run(), out)) << "two runs on identical inputs differ";
}

TEST_F(LceSm90Test, LongWalkMatchesReferenceAndRepeatsBitwise) {
  expect_walk_matches_and_repeats(kManyUnits);
}

TEST_F(LceSm90Test, SplitUserTilesMatchReferenceAndRepeatBitwise) {
  expect_walk_matches_and_repeats(kSplitUserTiles);
}

// N = 12 is not a multiple of 8 (TMA row strides are 16-byte multiples):
// lce falls back to cuBLAS.
TEST_F(LceSm90Test, ShapesItDoesNotTakeFallBackToCublas) {
  SeededRng rng;
  const LceProblem problem = random_problem(rng, DType::bf16, {64, 40, 24, 12, 5, 2},
                                            MapOrder::unsorted);
  EXPECT_FALSE(sm90_takes(problem.plan, problem.shape));
  const Sm90Path on(true);
  EXPECT_TRUE(matches_reference(problem.run(), problem.expected(), DType::bf16));
}

TEST_F(LceSm90Test, WorkspaceSizeDoesNotDependOnTheSwitch) {
  SeededRng rng;
  const LceProblem problem = random_problem(rng, DType::f16, {433, 866, 1178, 256, 16, 15},
                                            MapOrder::sorted);
  const auto bytes = [&] {
    const std::size_t from_sizes = lce_workspace_bytes(
        problem.plan, problem.shape.n, problem.shape.num_candidates, problem.shape.num_users);
    const std::size_t from_inputs = lce_workspace_bytes(
        problem.plan, problem.e_c_device.view(), problem.e_u_device.view(), problem.map);
    EXPECT_EQ(from_sizes, from_inputs);
    return from_inputs;
  };
  std::size_t enabled_bytes = 0, disabled_bytes = 0;
  {
    const Sm90Path on(true);
    enabled_bytes = bytes();
  }
  {
    const Sm90Path off(false);
    disabled_bytes = bytes();
  }
  EXPECT_EQ(enabled_bytes, disabled_bytes);
}

}  // namespace
}  // namespace ikbo::test
