// The Hopper linear path (src/cuda/sm90/linear_sm90.cu) on CUDA device 0,
// in f16 and bf16, against the fp64 reference: B = 433 with Kc = 872 (a
// partial last k-step), Kc = Ku = 8 (one partial k-step), the model's
// Kc = 3976, N_out not a multiple of the tile and odd (single-element
// stores), U = 1, U = B, users without candidates, unsorted maps, with and
// without bias, more tiles than the grid has clusters; each with the tile
// the shapes pick and forced to every tile the kernel is built for (64 or
// 128 candidates x 64 or 128 outputs); outputs poisoned before every run,
// repeated runs bitwise identical. Also: an Inf in the next candidate's
// row never reaches out; Kc = 866, Kc = 1 and Ku = 17 (rows not 16-byte
// multiples) and an x_c at an 8-byte offset fall back to cuBLAS with
// correct results; the "decomposed" baseline runs the cuBLAS path; a
// rejected call writes nothing; the workspace size does not depend on the
// path; the Hopper path captures into a CUDA graph. Stream ordering of
// linear is tested in test_linear.cpp (LinearOnCuda). Every test skips,
// with the reason, unless device 0 is an sm_90 GPU and the build carries
// sm_90a code.
#include <algorithm>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <tuple>
#include <vector>

#include "baselines.hpp"
#include "device_harness.hpp"

#ifdef IKBO_WITH_CUDA
#include "cuda/sm90/linear_sm90.hpp"
#endif

namespace ikbo::test {
namespace {

constexpr Device kCuda = Device::cuda(0);

std::optional<std::string> sm90_unavailable_reason() {
#ifdef IKBO_WITH_CUDA
  return hopper_unavailable_reason(detail::cuda::linear_sm90_available, "linear");
#else
  return hopper_unavailable_reason(nullptr, "linear");
#endif
}

// Whether linear() takes the Hopper path for these shapes (when enabled and
// x_c is aligned).
bool sm90_takes(const LinearPlan& plan, std::int64_t num_candidates) {
#ifdef IKBO_WITH_CUDA
  return detail::cuda::linear_sm90_supported(plan.state(), num_candidates);
#else
  static_cast<void>(plan);
  static_cast<void>(num_candidates);
  return false;
#endif
}

// The tiles the kernel is built for, as "rows x features".
std::vector<std::string> sm90_tiles() {
  std::vector<std::string> names;
#ifdef IKBO_WITH_CUDA
  for (const auto& tile : detail::cuda::linear_sm90_tiles()) {
    names.push_back(std::to_string(tile.rows) + " x " + std::to_string(tile.features));
  }
#endif
  return names;
}

// Sets the path switch and the forced tile (-1: chosen from the shapes) for
// a scope, and restores the previous ones after it.
class Sm90Settings {
 public:
  Sm90Settings(bool enabled, int forced_tile) {
#ifdef IKBO_WITH_CUDA
    previous_enabled_ = detail::cuda::linear_sm90_enabled();
    previous_forced_tile_ = detail::cuda::linear_sm90_forced_tile();
#endif
    set(enabled, forced_tile);
  }
  ~Sm90Settings() { set(previous_enabled_, previous_forced_tile_); }
  Sm90Settings(const Sm90Settings&) = delete;
  Sm90Settings& operator=(const Sm90Settings&) = delete;

 private:
  static void set(bool enabled, int forced_tile) {
#ifdef IKBO_WITH_CUDA
    detail::cuda::set_linear_sm90_enabled(enabled);
    detail::cuda::set_linear_sm90_forced_tile(forced_tile);
#else
    static_cast<void>(enabled);
    static_cast<void>(forced_tile);
#endif
  }

  bool previous_enabled_ = true;
  int previous_forced_tile_ = -1;
};

struct Shape {
  std::int64_t out_features = 0, ku = 0, kc = 0, num_candidates = 0, num_users = 0;
};

// One request on the GPU, with the exact host values of its inputs.
struct LinearProblem {
  Shape shape;
  HostTensor w_u, w_c, bias, x_c, x_u;  // bias: no values without a bias
  std::vector<std::int32_t> cand_to_user;
  std::optional<DeviceTensor> x_c_device, x_u_device;
  std::optional<LinearPlan> plan;
  std::optional<CandidateMap> map;

  bool has_bias() const { return !bias.values.empty(); }

  void upload() {
    const DeviceTensor w_u_device(kCuda, w_u), w_c_device(kCuda, w_c);
    if (has_bias()) {
      const DeviceTensor bias_device(kCuda, bias);
      const Tensor bias_view = bias_device.view();
      plan.emplace(LinearPlan::create(w_u_device.view(), w_c_device.view(), &bias_view));
    } else {
      plan.emplace(LinearPlan::create(w_u_device.view(), w_c_device.view()));
    }
    x_c_device.emplace(kCuda, x_c);
    x_u_device.emplace(kCuda, x_u);
    map.emplace(CandidateMap::build(cand_to_user.data(), shape.num_candidates, shape.num_users,
                                    kCuda));
  }

  // The fp64 reference: an LCE with N = 1, plus the bias.
  std::vector<double> expected() const {
    const LceShape lce{shape.out_features, shape.kc, shape.ku, 1, shape.num_candidates,
                       shape.num_users};
    std::vector<double> out =
        reference_lce(lce, w_c.values, w_u.values, x_c.values, x_u.values, cand_to_user);
    if (has_bias()) {
      for (std::size_t i = 0; i < out.size(); ++i) out[i] += bias.values[i % bias.values.size()];
    }
    return out;
  }

  // call(x_c, out, workspace), a call with linear's arguments, into a
  // poisoned output with a workspace of linear_workspace_bytes; out's bytes.
  template <typename Call>
  std::vector<std::byte> run_call(const Tensor& x_c_view, Call&& call) const {
    const auto out = DeviceTensor::poisoned(kCuda, plan->dtype(),
                                            {shape.num_candidates, shape.out_features});
    const DeviceBuffer workspace(
        kCuda, linear_workspace_bytes(*plan, x_c_view, x_u_device->view(), *map));
    call(x_c_view, out.view(), Workspace{workspace.data(), workspace.bytes()});
    return out.bytes();
  }

  // linear on the default stream; out's bytes.
  std::vector<std::byte> run(const Tensor& x_c_view) const {
    return run_call(x_c_view, [&](const Tensor& x_c, const Tensor& out, Workspace workspace) {
      linear(*plan, x_c, x_u_device->view(), *map, out, nullptr, workspace);
    });
  }
  std::vector<std::byte> run() const { return run(x_c_device->view()); }
};

// The tile linear() runs this problem with, as "rows x features".
std::string sm90_tile(const LinearProblem& problem) {
#ifdef IKBO_WITH_CUDA
  const auto tile = detail::cuda::linear_sm90_tile(problem.plan->state(),
                                                   problem.shape.num_candidates,
                                                   problem.shape.num_users);
  return std::to_string(tile.rows) + " x " + std::to_string(tile.features);
#else
  static_cast<void>(problem);
  return "none";
#endif
}

LinearProblem random_problem(SeededRng& rng, DType dtype, const Shape& shape, MapOrder order,
                             bool bias) {
  LinearProblem problem;
  problem.shape = shape;
  // Sequenced statements, so a seed reproduces the data.
  problem.w_u = rng.tensor(dtype, {shape.out_features, shape.ku});
  problem.w_c = rng.tensor(dtype, {shape.out_features, shape.kc});
  problem.bias = bias ? rng.tensor(dtype, {shape.out_features})
                      : HostTensor{dtype, {shape.out_features}, {}};
  problem.x_c = rng.tensor(dtype, {shape.num_candidates, shape.kc});
  problem.x_u = rng.tensor(dtype, {shape.num_users, shape.ku});
  problem.cand_to_user = rng.candidate_map(shape.num_candidates, shape.num_users, order);
  problem.upload();
  return problem;
}

class LinearSm90Test : public testing::Test {
 protected:
  void SetUp() override {
    if (const auto reason = sm90_unavailable_reason()) GTEST_SKIP() << *reason;
  }
};

struct Sm90Case {
  const char* name;
  Shape shape;  // out_features, ku, kc, num_candidates, num_users
  MapOrder order;
  bool bias;
};

void PrintTo(const Sm90Case& value, std::ostream* stream) { *stream << value.name; }

const std::vector<Sm90Case>& sm90_cases() {
  static const std::vector<Sm90Case> cases = {
      {"b433_kc872_empty_users", {200, 40, 872, 433, 7}, MapOrder::uneven_unsorted, true},
      {"user_per_candidate_no_bias", {130, 24, 256, 300, 300}, MapOrder::unsorted, false},
      {"one_user", {64, 8, 512, 129, 1}, MapOrder::sorted, true},
      {"one_candidate", {64, 8, 512, 1, 1}, MapOrder::sorted, true},
      {"one_output_feature", {1, 16, 256, 70, 9}, MapOrder::unsorted, true},
      {"odd_n_out", {77, 16, 576, 70, 9}, MapOrder::uneven, true},
      {"kc8", {256, 8, 8, 200, 13}, MapOrder::uneven_unsorted, true},
      {"model_widths", {512, 256, 3976, 256, 4}, MapOrder::unsorted, true},
      // More tiles than SMs at every tile size: the persistent grid wraps.
      {"many_units", {512, 32, 256, 3000, 40}, MapOrder::uneven_unsorted, true},
  };
  return cases;
}

using Sm90Param = std::tuple<DType, Sm90Case>;

class LinearSm90VsReference : public testing::TestWithParam<Sm90Param> {
 protected:
  void SetUp() override {
    if (const auto reason = sm90_unavailable_reason()) GTEST_SKIP() << *reason;
  }
  DType dtype() const { return std::get<0>(GetParam()); }
  const Sm90Case& sm90_case() const { return std::get<1>(GetParam()); }
};

TEST_P(LinearSm90VsReference, EveryTileMatchesFp64ReferenceAndRepeatsBitwise) {
  SeededRng rng;
  const Sm90Case& test_case = sm90_case();
  const LinearProblem problem =
      random_problem(rng, dtype(), test_case.shape, test_case.order, test_case.bias);
  ASSERT_TRUE(sm90_takes(*problem.plan, test_case.shape.num_candidates));
  const std::vector<double> expected = problem.expected();
  const std::vector<std::string> tiles = sm90_tiles();
  ASSERT_EQ(tiles.size(), 4u);
  for (int forced = -1; forced < static_cast<int>(tiles.size()); ++forced) {
    const Sm90Settings settings(true, forced);
    SCOPED_TRACE(testing::Message()
                 << "tile " << (forced < 0 ? "chosen from the shapes: " : "") << sm90_tile(problem));
    const std::vector<std::byte> first = problem.run();
    EXPECT_TRUE(matches_reference(decode(first, dtype()), expected, dtype()));
    EXPECT_TRUE(problem.run() == first) << "two runs on identical inputs differ";
  }
}

std::string sm90_param_name(const testing::TestParamInfo<Sm90Param>& info) {
  return dtype_label(std::get<0>(info.param)) + "_" + std::get<1>(info.param).name;
}

INSTANTIATE_TEST_SUITE_P(Shapes, LinearSm90VsReference,
                         testing::Combine(testing::Values(DType::f16, DType::bf16),
                                          testing::ValuesIn(sm90_cases())),
                         sm90_param_name);

// Kc = 872 leaves a partial last k-step of 40 columns. Candidate 2 is all
// +Inf: the K tail of candidate 1 ends right before it, and the last
// candidate's at the end of x_c. Columns past Kc must read as zeros, so
// every other candidate's output stays finite and exact.
TEST_F(LinearSm90Test, InfInTheNextCandidateNeverReachesOut) {
  SeededRng rng;
  const DType dtype = DType::f16;
  const Shape shape{128, 16, 872, 4, 2};
  LinearProblem problem = random_problem(rng, dtype, shape, MapOrder::unsorted, true);
  const std::int64_t poisoned = 2;
  std::fill_n(problem.x_c.values.begin() + poisoned * shape.kc, shape.kc,
              std::numeric_limits<double>::infinity());
  problem.upload();
  ASSERT_TRUE(sm90_takes(*problem.plan, shape.num_candidates));
  for (const int forced : {0, 3}) {
    const Sm90Settings settings(true, forced);
    SCOPED_TRACE(testing::Message() << "tile " << sm90_tiles()[forced]);
    const std::vector<double> out = decode(problem.run(), dtype);
    const std::vector<double> expected = problem.expected();
    const auto row = static_cast<std::size_t>(shape.out_features);
    for (std::int64_t b = 0; b < shape.num_candidates; ++b) {
      if (b == poisoned) continue;
      SCOPED_TRACE(testing::Message() << "candidate " << b);
      const auto offset = static_cast<std::size_t>(b) * row;
      EXPECT_TRUE(matches_reference(std::span(out).subspan(offset, row),
                                    std::span(expected).subspan(offset, row), dtype));
    }
  }
}

// Kc = 866, Kc = 1 and Ku = 17 make rows of x_c or x_u no multiple of 16
// bytes (TMA cannot read them in place): linear falls back to cuBLAS, with
// correct results.
TEST_F(LinearSm90Test, ShapesItDoesNotTakeFallBackToCublas) {
  SeededRng rng;
  for (const Shape& shape :
       {Shape{512, 256, 866, 433, 7}, Shape{96, 16, 1, 50, 5}, Shape{130, 17, 256, 300, 30}}) {
    SCOPED_TRACE(testing::Message() << "Ku = " << shape.ku << ", Kc = " << shape.kc);
    const LinearProblem problem = random_problem(rng, DType::bf16, shape, MapOrder::unsorted, true);
    EXPECT_FALSE(sm90_takes(*problem.plan, shape.num_candidates));
    EXPECT_TRUE(matches_reference(decode(problem.run(), DType::bf16), problem.expected(),
                                  DType::bf16));
  }
}

// An x_c view 8 bytes into its buffer is not 16-byte aligned, as TMA needs:
// that call falls back to cuBLAS, with correct results.
TEST_F(LinearSm90Test, MisalignedCandidatesFallBackToCublas) {
  SeededRng rng;
  const DType dtype = DType::f16;
  const Shape shape{128, 32, 256, 100, 5};
  const LinearProblem problem = random_problem(rng, dtype, shape, MapOrder::unsorted, true);
  ASSERT_TRUE(sm90_takes(*problem.plan, shape.num_candidates));
  const std::size_t offset_elements = 4;  // 8 bytes
  std::vector<std::byte> shifted(offset_elements * dtype_size(dtype), std::byte{0});
  const auto values = problem.x_c.bytes();
  shifted.insert(shifted.end(), values.begin(), values.end());
  const DeviceBuffer buffer(kCuda, shifted);
  const Tensor x_c(static_cast<char*>(buffer.data()) + offset_elements * dtype_size(dtype), dtype,
                   {shape.num_candidates, shape.kc}, kCuda);
  EXPECT_TRUE(matches_reference(decode(problem.run(x_c), dtype), problem.expected(), dtype));
}

// Validation runs before anything is launched: a call the API rejects
// leaves out as it was, on a shape the Hopper path takes.
TEST_F(LinearSm90Test, RejectedCallWritesNothing) {
  SeededRng rng;
  const DType dtype = DType::f16;
  const Shape shape{256, 64, 512, 300, 6};
  const LinearProblem problem = random_problem(rng, dtype, shape, MapOrder::unsorted, true);
  ASSERT_TRUE(sm90_takes(*problem.plan, shape.num_candidates));
  const auto out = DeviceTensor::poisoned(kCuda, dtype, {shape.num_candidates, shape.out_features});
  const Tensor x_c = problem.x_c_device->view(), x_u = problem.x_u_device->view();
  const DeviceBuffer workspace(kCuda, linear_workspace_bytes(*problem.plan, x_c, x_u, *problem.map));
  Tensor wrong_x_u = x_u;
  wrong_x_u.shape[1] -= 1;
  EXPECT_TRUE(throws_invalid_argument(
      [&] {
        linear(*problem.plan, x_c, wrong_x_u, *problem.map, out.view(), nullptr,
               {workspace.data(), workspace.bytes()});
      },
      {"x_u dimension 1 must be 64"}, {&out.buffer()}));
  EXPECT_TRUE(throws_invalid_argument(
      [&] {
        linear(*problem.plan, x_c, x_u, *problem.map, out.view(), nullptr,
               {workspace.data(), workspace.bytes() - 1});
      },
      {"workspace must hold"}, {&out.buffer()}));
}

// baseline::linear_decomposed (the benchmark's "decomposed" variant) runs
// the cuBLAS path on a shape the Hopper path takes: the same bytes as
// linear() with the Hopper path switched off, and within the reference's
// tolerance.
TEST_F(LinearSm90Test, DecomposedBaselineRunsTheCublasPath) {
  SeededRng rng;
  const DType dtype = DType::f16;
  const Shape shape{512, 256, 3976, 300, 5};
  const LinearProblem problem = random_problem(rng, dtype, shape, MapOrder::unsorted, true);
  ASSERT_TRUE(sm90_takes(*problem.plan, shape.num_candidates));
  std::vector<std::byte> cublas;
  {
    const Sm90Settings off(false, -1);
    cublas = problem.run();
  }
  const std::vector<std::byte> decomposed = problem.run_call(
      problem.x_c_device->view(), [&](const Tensor& x_c, const Tensor& out, Workspace workspace) {
        baseline::linear_decomposed(*problem.plan, x_c, problem.x_u_device->view(),
                                    *problem.map, out, nullptr, workspace);
      });
  EXPECT_TRUE(decomposed == cublas) << "linear_decomposed differs from linear's cuBLAS path";
  EXPECT_TRUE(matches_reference(decode(cublas, dtype), problem.expected(), dtype));
}

TEST_F(LinearSm90Test, WorkspaceSizeDoesNotDependOnThePath) {
  SeededRng rng;
  const LinearProblem problem =
      random_problem(rng, DType::f16, {512, 256, 3976, 1024, 15}, MapOrder::sorted, true);
  const auto bytes = [&] {
    const std::size_t from_sizes =
        linear_workspace_bytes(*problem.plan, problem.shape.num_candidates,
                               problem.shape.num_users);
    const std::size_t from_inputs = linear_workspace_bytes(
        *problem.plan, problem.x_c_device->view(), problem.x_u_device->view(), *problem.map);
    EXPECT_EQ(from_sizes, from_inputs);
    return from_inputs;
  };
  std::size_t enabled_bytes = 0, disabled_bytes = 0;
  {
    const Sm90Settings on(true, -1);
    enabled_bytes = bytes();
  }
  {
    const Sm90Settings off(false, -1);
    disabled_bytes = bytes();
  }
  EXPECT_EQ(enabled_bytes, disabled_bytes);
}

// The Hopper path (a memset of its counter, then the kernel) on a created
// stream inside a CUDA graph capture: it allocates and synchronizes
// nothing, and the replay matches the eager run bitwise.
TEST_F(LinearSm90Test, CapturesIntoACudaGraph) {
  SeededRng rng;
  const DType dtype = DType::bf16;
  const Shape shape{512, 256, 3976, 300, 5};
  const LinearProblem problem = random_problem(rng, dtype, shape, MapOrder::unsorted, true);
  ASSERT_TRUE(sm90_takes(*problem.plan, shape.num_candidates));
  const std::vector<std::byte> eager = problem.run();
  const TestStream stream(kCuda);
  const std::vector<std::byte> replayed = problem.run_call(
      problem.x_c_device->view(), [&](const Tensor& x_c, const Tensor& out, Workspace workspace) {
        run_as_cuda_graph(stream, [&] {
          linear(*problem.plan, x_c, problem.x_u_device->view(), *problem.map, out,
                 stream.handle(), workspace);
        });
      });
  EXPECT_TRUE(replayed == eager) << "the graph replay differs from the eager run";
}

}  // namespace
}  // namespace ikbo::test
