// linear against the fp64 reference, on every device and dtype: both ways to
// build a plan (split w_u / w_c, or torch's concatenated weight), with and
// without bias, plan reuse across requests, plan ownership of the weights,
// B = 0; the broadcast baseline (replicate_linear_input and linear_concat);
// argument validation leaving `out` untouched; and, on CUDA,
// stream ordering without synchronization and CUDA graph capture.
// Shapes include N_out = 1, Ku = Kc = 1, B = 1, U = 1, U = B, K and N_out
// that are not multiples of 8, rows long enough to split the CPU backend's
// work into blocks, and maps that are unsorted, uneven or leave users
// without candidates.
#include <chrono>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "baselines.hpp"
#include "device_harness.hpp"

namespace ikbo::test {
namespace {

struct LinearShape {
  std::int64_t out_features = 0, ku = 0, kc = 0, num_candidates = 0, num_users = 0;
};

struct LinearCase {
  const char* name;
  LinearShape shape;  // out_features, ku, kc, num_candidates, num_users
  MapOrder order;
  bool bias;
};

void PrintTo(const LinearCase& value, std::ostream* stream) { *stream << value.name; }

const std::vector<LinearCase>& linear_cases() {
  static const std::vector<LinearCase> cases = {
      {"reference_k_widths", {256, 1178, 866, 37, 5}, MapOrder::unsorted, true},
      {"n_out_is_1", {1, 9, 13, 7, 3}, MapOrder::sorted, true},
      {"k_of_one", {7, 1, 1, 4, 2}, MapOrder::unsorted, true},
      {"one_candidate", {17, 19, 13, 1, 1}, MapOrder::sorted, false},
      {"one_user", {20, 24, 16, 7, 1}, MapOrder::sorted, true},
      {"one_candidate_per_user", {31, 15, 9, 5, 5}, MapOrder::unsorted, false},
      {"uneven_sorted_empty_users", {24, 33, 47, 20, 7}, MapOrder::uneven, true},
      {"uneven_unsorted_empty_users", {45, 64, 8, 23, 9}, MapOrder::uneven_unsorted, false},
      {"aligned_widths", {128, 64, 32, 50, 6}, MapOrder::uneven_unsorted, true},
      // Long rows: the CPU backend runs 3 candidate blocks and 2 user blocks.
      {"several_cpu_blocks", {5, 4099, 4100, 520, 260}, MapOrder::uneven_unsorted, true},
  };
  return cases;
}

// Host inputs of one request with their exact values; `bias` is empty without a bias.
struct LinearInputs {
  LinearShape shape;
  HostTensor w_u, w_c, bias, x_c, x_u;
  std::vector<std::int32_t> cand_to_user;

  bool has_bias() const { return !bias.values.empty(); }

  // The expected out: an LCE with N = 1 (x_c [B, Kc] is e_c [B, Kc, 1]), plus the bias.
  std::vector<double> expected() const {
    const LceShape lce_shape{shape.out_features,   shape.kc,       shape.ku, 1,
                             shape.num_candidates, shape.num_users};
    std::vector<double> out =
        reference_lce(lce_shape, w_c.values, w_u.values, x_c.values, x_u.values, cand_to_user);
    if (has_bias()) {
      for (std::size_t i = 0; i < out.size(); ++i) out[i] += bias.values[i % bias.values.size()];
    }
    return out;
  }

  // torch's weight [N_out, Ku + Kc] = [w_u | w_c].
  HostTensor concatenated_weight() const {
    HostTensor weight{w_u.dtype, {shape.out_features, shape.ku + shape.kc}, {}};
    for (std::int64_t row = 0; row < shape.out_features; ++row) {
      const auto user_row = w_u.values.begin() + row * shape.ku;
      const auto candidate_row = w_c.values.begin() + row * shape.kc;
      weight.values.insert(weight.values.end(), user_row, user_row + shape.ku);
      weight.values.insert(weight.values.end(), candidate_row, candidate_row + shape.kc);
    }
    return weight;
  }
};

LinearInputs random_linear_inputs(SeededRng& rng, DType dtype, const LinearShape& shape,
                                  MapOrder order, bool bias) {
  const auto [out_features, ku, kc, num_candidates, num_users] = shape;
  LinearInputs inputs;
  inputs.shape = shape;
  // Sequenced statements, so a seed reproduces the data.
  inputs.w_u = rng.tensor(dtype, {out_features, ku});
  inputs.w_c = rng.tensor(dtype, {out_features, kc});
  inputs.bias = bias ? rng.tensor(dtype, {out_features}) : HostTensor{dtype, {out_features}, {}};
  inputs.x_c = rng.tensor(dtype, {num_candidates, kc});
  inputs.x_u = rng.tensor(dtype, {num_users, ku});
  inputs.cand_to_user = rng.candidate_map(num_candidates, num_users, order);
  return inputs;
}

LinearPlan split_plan(Device device, const LinearInputs& inputs) {
  const DeviceTensor w_u(device, inputs.w_u), w_c(device, inputs.w_c);
  if (!inputs.has_bias()) return LinearPlan::create(w_u.view(), w_c.view());
  const DeviceTensor bias(device, inputs.bias);
  const Tensor bias_view = bias.view();
  return LinearPlan::create(w_u.view(), w_c.view(), &bias_view);
}

LinearPlan concatenated_plan(Device device, const LinearInputs& inputs) {
  const DeviceTensor weight(device, inputs.concatenated_weight());
  if (!inputs.has_bias()) return LinearPlan::from_concatenated(weight.view(), inputs.shape.ku);
  const DeviceTensor bias(device, inputs.bias);
  const Tensor bias_view = bias.view();
  return LinearPlan::from_concatenated(weight.view(), inputs.shape.ku, &bias_view);
}

// Runs ikbo::linear for `inputs` on the plan's device into a poisoned `out` and
// returns what it wrote, as values (bytes when `bytes_out` is given too).
std::vector<double> run_linear(const LinearPlan& plan, const LinearInputs& inputs,
                               std::vector<std::byte>* bytes_out = nullptr) {
  const Device device = plan.device();
  const DeviceTensor x_c(device, inputs.x_c), x_u(device, inputs.x_u);
  const auto map = CandidateMap::build(inputs.cand_to_user.data(), inputs.shape.num_candidates,
                                       inputs.shape.num_users, device);
  const auto out = DeviceTensor::poisoned(device, plan.dtype(),
                                          {inputs.shape.num_candidates, inputs.shape.out_features});
  const DeviceBuffer workspace(device, linear_workspace_bytes(plan, x_c.view(), x_u.view(), map));
  linear(plan, x_c.view(), x_u.view(), map, out.view(), nullptr,
         {workspace.data(), workspace.bytes()});
  if (bytes_out != nullptr) *bytes_out = out.bytes();
  return out.values();
}

using LinearParam = std::tuple<Device, DType, LinearCase>;

class LinearVsReference : public testing::TestWithParam<LinearParam> {
 protected:
  void SetUp() override { IKBO_SKIP_IF_UNAVAILABLE(device()); }
  Device device() const { return std::get<0>(GetParam()); }
  DType dtype() const { return std::get<1>(GetParam()); }
  const LinearCase& linear_case() const { return std::get<2>(GetParam()); }
  LinearInputs inputs(SeededRng& rng) const {
    return random_linear_inputs(rng, dtype(), linear_case().shape, linear_case().order,
                                linear_case().bias);
  }
};

TEST_P(LinearVsReference, SplitWeightsMatchFp64Reference) {
  SeededRng rng;
  const LinearInputs inputs = this->inputs(rng);
  const auto plan = split_plan(device(), inputs);
  EXPECT_EQ(plan.dtype(), dtype());
  EXPECT_EQ(plan.device(), device());
  EXPECT_EQ(plan.out_features(), inputs.shape.out_features);
  EXPECT_EQ(plan.ku(), inputs.shape.ku);
  EXPECT_EQ(plan.kc(), inputs.shape.kc);
  EXPECT_EQ(plan.has_bias(), inputs.has_bias());
  EXPECT_TRUE(matches_reference(run_linear(plan, inputs), inputs.expected(), dtype()));
}

// The concatenated weight prepares the same plan as its two column blocks:
// the results are bitwise identical.
TEST_P(LinearVsReference, ConcatenatedWeightMatchesSplitWeights) {
  SeededRng rng;
  const LinearInputs inputs = this->inputs(rng);
  const auto plan = concatenated_plan(device(), inputs);
  EXPECT_EQ(plan.ku(), inputs.shape.ku);
  EXPECT_EQ(plan.kc(), inputs.shape.kc);
  std::vector<std::byte> from_split, from_concatenated;
  run_linear(split_plan(device(), inputs), inputs, &from_split);
  EXPECT_TRUE(
      matches_reference(run_linear(plan, inputs, &from_concatenated), inputs.expected(), dtype()));
  EXPECT_TRUE(from_split == from_concatenated);
}

TEST_P(LinearVsReference, BroadcastBaselineMatchesFp64Reference) {
  SeededRng rng;
  const LinearInputs inputs = this->inputs(rng);
  const auto [out_features, ku, kc, num_candidates, num_users] = inputs.shape;
  const DeviceTensor x_c(device(), inputs.x_c), x_u(device(), inputs.x_u);
  const auto map =
      CandidateMap::build(inputs.cand_to_user.data(), num_candidates, num_users, device());
  const auto x_full = DeviceTensor::poisoned(device(), dtype(), {num_candidates, ku + kc});
  baseline::replicate_linear_input(x_c.view(), x_u.view(), map, x_full.view());

  // The replicated input is a pure copy: exact, element by element.
  std::vector<double> expected_x_full;
  for (std::int64_t b = 0; b < num_candidates; ++b) {
    const auto user_row = inputs.x_u.values.begin() + inputs.cand_to_user[b] * ku;
    const auto candidate_row = inputs.x_c.values.begin() + b * kc;
    expected_x_full.insert(expected_x_full.end(), user_row, user_row + ku);
    expected_x_full.insert(expected_x_full.end(), candidate_row, candidate_row + kc);
  }
  EXPECT_TRUE(exactly_equal(x_full.values(), expected_x_full));

  const DeviceTensor weight(device(), inputs.concatenated_weight());
  const auto out = DeviceTensor::poisoned(device(), dtype(), {num_candidates, out_features});
  const DeviceBuffer workspace(device(), baseline::linear_concat_workspace_bytes(weight.view()));
  auto concat = [&](const Tensor* bias) {
    baseline::linear_concat(weight.view(), bias, x_full.view(), out.view(), nullptr,
                            {workspace.data(), workspace.bytes()});
  };
  if (inputs.has_bias()) {
    const DeviceTensor bias(device(), inputs.bias);
    const Tensor bias_view = bias.view();
    concat(&bias_view);
  } else {
    concat(nullptr);
  }
  EXPECT_TRUE(matches_reference(out.values(), inputs.expected(), dtype()));
}

std::string linear_param_name(const testing::TestParamInfo<LinearParam>& info) {
  return device_label(std::get<0>(info.param)) + "_" + dtype_label(std::get<1>(info.param)) + "_" +
         std::get<2>(info.param).name;
}

INSTANTIATE_TEST_SUITE_P(Shapes, LinearVsReference,
                         testing::Combine(testing::ValuesIn(test_devices()),
                                          testing::ValuesIn(float_dtypes()),
                                          testing::ValuesIn(linear_cases())),
                         linear_param_name);

class LinearRequests : public DeviceDtypeTest {};

// One plan serves many requests, each with its own map and batch sizes.
TEST_P(LinearRequests, PlanIsReusedAcrossRequestsWithDifferentMaps) {
  SeededRng rng;
  const LinearInputs first =
      random_linear_inputs(rng, dtype(), {37, 51, 29, 9, 3}, MapOrder::unsorted, true);
  const auto plan = split_plan(device(), first);
  EXPECT_TRUE(matches_reference(run_linear(plan, first), first.expected(), dtype()));
  struct Request {
    std::int64_t num_candidates, num_users;
    MapOrder order;
  };
  for (const Request& request :
       {Request{14, 5, MapOrder::uneven_unsorted}, Request{9, 3, MapOrder::sorted}}) {
    SCOPED_TRACE(testing::Message() << "request B=" << request.num_candidates << " U="
                                    << request.num_users << " " << map_order_name(request.order));
    LinearInputs inputs = first;
    inputs.shape.num_candidates = request.num_candidates;
    inputs.shape.num_users = request.num_users;
    inputs.x_c = rng.tensor(dtype(), {request.num_candidates, first.shape.kc});
    inputs.x_u = rng.tensor(dtype(), {request.num_users, first.shape.ku});
    inputs.cand_to_user =
        rng.candidate_map(request.num_candidates, request.num_users, request.order);
    EXPECT_TRUE(matches_reference(run_linear(plan, inputs), inputs.expected(), dtype()));
  }
}

// Fresh random shapes on every run (the seed is printed on failure), B = 0 included.
TEST_P(LinearRequests, RandomShapesMatchFp64Reference) {
  SeededRng rng;
  for (int trial = 0; trial < 12; ++trial) {
    // Braced initialization evaluates left to right, so a seed reproduces the shapes.
    const LinearShape shape{rng.uniform_int(1, 90), rng.uniform_int(1, 90), rng.uniform_int(1, 90),
                            rng.uniform_int(0, 40), rng.uniform_int(1, 8)};
    const auto order = static_cast<MapOrder>(rng.uniform_int(0, 3));
    const bool bias = rng.uniform_int(0, 1) == 1;
    SCOPED_TRACE(testing::Message()
                 << "trial " << trial << ": N_out=" << shape.out_features << " Ku=" << shape.ku
                 << " Kc=" << shape.kc << " B=" << shape.num_candidates << " U=" << shape.num_users
                 << " " << map_order_name(order) << (bias ? " bias" : " no bias"));
    const LinearInputs inputs = random_linear_inputs(rng, dtype(), shape, order, bias);
    EXPECT_TRUE(matches_reference(run_linear(split_plan(device(), inputs), inputs),
                                  inputs.expected(), dtype()));
  }
}

// The plan keeps its own copy: overwriting the caller's weights and bias
// afterwards must not change results.
TEST_P(LinearRequests, PlanOwnsACopyOfTheWeightsAndBias) {
  SeededRng rng;
  const LinearInputs inputs =
      random_linear_inputs(rng, dtype(), {19, 10, 21, 6, 2}, MapOrder::unsorted, true);
  DeviceTensor w_u(device(), inputs.w_u), w_c(device(), inputs.w_c), bias(device(), inputs.bias);
  const Tensor bias_view = bias.view();
  const auto plan = LinearPlan::create(w_u.view(), w_c.view(), &bias_view);
  w_u.buffer().upload(poison_bytes(dtype(), inputs.w_u.values.size()));
  w_c.buffer().upload(poison_bytes(dtype(), inputs.w_c.values.size()));
  bias.buffer().upload(poison_bytes(dtype(), inputs.bias.values.size()));
  EXPECT_TRUE(matches_reference(run_linear(plan, inputs), inputs.expected(), dtype()));
}

// B = 0 is valid: nothing is computed and nothing written.
TEST_P(LinearRequests, ZeroCandidatesIsANoOp) {
  SeededRng rng;
  const LinearInputs inputs =
      random_linear_inputs(rng, dtype(), {12, 6, 10, 0, 3}, MapOrder::sorted, true);
  const auto plan = split_plan(device(), inputs);
  const auto map = CandidateMap::build(nullptr, 0, inputs.shape.num_users, device());
  const DeviceTensor x_u(device(), inputs.x_u);
  const Tensor x_c(nullptr, dtype(), {0, inputs.shape.kc}, device());
  // The out view is empty but points at a poisoned guard region that must stay as it is.
  const auto guard = DeviceTensor::poisoned(device(), dtype(), {inputs.shape.out_features});
  const Tensor out(guard.buffer().data(), dtype(), {0, inputs.shape.out_features}, device());
  const auto guard_before = guard.bytes();
  const DeviceBuffer workspace(device(), linear_workspace_bytes(plan, x_c, x_u.view(), map));
  EXPECT_NO_THROW(
      linear(plan, x_c, x_u.view(), map, out, nullptr, {workspace.data(), workspace.bytes()}));
  EXPECT_EQ(guard.bytes(), guard_before);
}

INSTANTIATE_TEST_SUITE_P(Devices, LinearRequests,
                         testing::Combine(testing::ValuesIn(test_devices()),
                                          testing::ValuesIn(float_dtypes())),
                         device_dtype_param_name);

// ---------------------------------------------------------- validation ----

Device other_device(Device device) { return device.is_cuda() ? Device::cpu() : Device::cuda(0); }

CandidateMap round_robin_map(Device device, std::int64_t candidates, std::int64_t users) {
  std::vector<std::int32_t> cand_to_user(static_cast<std::size_t>(candidates));
  for (std::size_t b = 0; b < cand_to_user.size(); ++b) {
    cand_to_user[b] = static_cast<std::int32_t>(b % static_cast<std::size_t>(users));
  }
  return CandidateMap::build(cand_to_user.data(), candidates, users, device);
}

// A valid linear call; each test breaks one argument of it.
struct LinearOperands {
  static constexpr std::int64_t out_features = 8, ku = 6, kc = 12, num_candidates = 6,
                                num_users = 3;
  static constexpr DType dtype = DType::f16;

  explicit LinearOperands(Device device)
      : w_u(DeviceTensor::filled(device, dtype, {out_features, ku}, 0.5)),
        w_c(DeviceTensor::filled(device, dtype, {out_features, kc}, 0.25)),
        weight(DeviceTensor::filled(device, dtype, {out_features, ku + kc}, 0.5)),
        bias(DeviceTensor::filled(device, dtype, {out_features}, 0.75)),
        x_c(DeviceTensor::filled(device, dtype, {num_candidates, kc}, 1.0)),
        x_u(DeviceTensor::filled(device, dtype, {num_users, ku}, 2.0)),
        out(DeviceTensor::filled(device, dtype, {num_candidates, out_features}, -7.0)),
        plan(make_plan(w_u.view(), w_c.view(), bias.view())),
        map(round_robin_map(device, num_candidates, num_users)),
        workspace(device, linear_workspace_bytes(plan, x_c.view(), x_u.view(), map)) {}

  static LinearPlan make_plan(const Tensor& w_u, const Tensor& w_c, const Tensor& bias) {
    return LinearPlan::create(w_u, w_c, &bias);
  }

  DeviceTensor w_u, w_c, weight, bias, x_c, x_u, out;
  LinearPlan plan;
  CandidateMap map;
  DeviceBuffer workspace;
};

// The arguments of one linear call, starting from the valid ones.
struct LinearCall {
  explicit LinearCall(const LinearOperands& operands)
      : plan(&operands.plan),
        x_c(operands.x_c.view()),
        x_u(operands.x_u.view()),
        out(operands.out.view()),
        map(&operands.map),
        workspace{operands.workspace.data(), operands.workspace.bytes()},
        out_buffer(&operands.out.buffer()) {}

  void operator()() const { linear(*plan, x_c, x_u, *map, out, nullptr, workspace); }
  testing::AssertionResult rejected_with(std::initializer_list<std::string_view> fragments) const {
    return throws_invalid_argument([this] { (*this)(); }, fragments, {out_buffer});
  }

  const LinearPlan* plan;
  Tensor x_c, x_u, out;
  const CandidateMap* map;
  Workspace workspace;
  const DeviceBuffer* out_buffer;
};

class LinearValidation : public DeviceTest {
 protected:
  void SetUp() override {
    DeviceTest::SetUp();
    if (!IsSkipped()) operands_.emplace(device());
  }
  const LinearOperands& operands() const { return *operands_; }
  LinearCall call() const { return LinearCall(*operands_); }

 private:
  std::optional<LinearOperands> operands_;
};

TEST_P(LinearValidation, ValidCallSucceedsAndWritesOut) {
  const LinearCall valid = call();
  ASSERT_NO_THROW(valid());
  // Every element: 12 * 0.25 * 1 + 6 * 0.5 * 2 + 0.75 = 9.75, exact in fp16.
  for (double value : operands().out.values()) ASSERT_EQ(value, 9.75);
}

TEST_P(LinearValidation, MapMustMatchTheBatches) {
  const auto longer_map =
      round_robin_map(device(), LinearOperands::num_candidates + 1, LinearOperands::num_users);
  LinearCall more_candidates = call();
  more_candidates.map = &longer_map;
  EXPECT_TRUE(more_candidates.rejected_with(
      {"x_c dimension 0 must be 7 (num_candidates of the candidate map), got 6"}));
  const auto more_users =
      round_robin_map(device(), LinearOperands::num_candidates, LinearOperands::num_users + 1);
  LinearCall bad_users = call();
  bad_users.map = &more_users;
  EXPECT_TRUE(bad_users.rejected_with(
      {"x_u dimension 0 must be 4 (num_users of the candidate map), got 3"}));
}

TEST_P(LinearValidation, EveryTensorMustHaveThePlanDtype) {
  LinearCall bad_x_c = call();
  bad_x_c.x_c.dtype = DType::bf16;
  EXPECT_TRUE(bad_x_c.rejected_with({"x_c must have dtype float16, got bfloat16"}));
  LinearCall bad_x_u = call();
  bad_x_u.x_u.dtype = DType::f32;
  EXPECT_TRUE(bad_x_u.rejected_with({"x_u must have dtype float16, got float32"}));
  LinearCall bad_out = call();
  bad_out.out.dtype = DType::f32;
  EXPECT_TRUE(bad_out.rejected_with({"out must have dtype float16, got float32"}));
}

TEST_P(LinearValidation, FeatureCountsMustMatchThePlan) {
  LinearCall bad_x_c = call();
  bad_x_c.x_c.shape[1] -= 1;
  EXPECT_TRUE(bad_x_c.rejected_with({"x_c dimension 1 must be 12 (Kc of w_c), got 11"}));
  LinearCall bad_x_u = call();
  bad_x_u.x_u.shape[1] += 1;
  EXPECT_TRUE(bad_x_u.rejected_with({"x_u dimension 1 must be 6 (Ku of w_u), got 7"}));
}

TEST_P(LinearValidation, OutMustHaveShapeBNout) {
  LinearCall wrong_width = call();
  wrong_width.out.shape[1] -= 1;
  EXPECT_TRUE(wrong_width.rejected_with({"out must have shape [6, 8] ([B, N_out]), got [6, 7]"}));
  LinearCall wrong_rank = call();
  wrong_rank.out = Tensor(wrong_rank.out.data, LinearOperands::dtype, {6, 8, 1}, device());
  EXPECT_TRUE(wrong_rank.rejected_with({"out must have 2 dimensions, got 3"}));
}

TEST_P(LinearValidation, NullDataPointersAreRejected) {
  LinearCall null_x_c = call();
  null_x_c.x_c.data = nullptr;
  EXPECT_TRUE(null_x_c.rejected_with({"x_c is a null pointer"}));
  LinearCall null_x_u = call();
  null_x_u.x_u.data = nullptr;
  EXPECT_TRUE(null_x_u.rejected_with({"x_u is a null pointer"}));
  LinearCall null_out = call();
  null_out.out.data = nullptr;
  EXPECT_TRUE(null_out.rejected_with({"out is a null pointer"}));
}

TEST_P(LinearValidation, OutMustNotAliasAnInput) {
  LinearCall aliased = call();
  aliased.out.data = aliased.x_c.data;
  EXPECT_TRUE(throws_invalid_argument([&] { aliased(); }, {"out overlaps x_c"},
                                      {&operands().x_c.buffer(), &operands().out.buffer()}));
}

TEST_P(LinearValidation, TensorsMustBeOnThePlanDevice) {
  const std::string plan_device = device_name(device());
  const std::string elsewhere = device_name(other_device(device()));
  LinearCall bad_x_u = call();
  bad_x_u.x_u.device = other_device(device());
  EXPECT_TRUE(bad_x_u.rejected_with({"x_u must be on " + plan_device + ", got " + elsewhere}));
  LinearCall bad_out = call();
  bad_out.out.device = other_device(device());
  EXPECT_TRUE(bad_out.rejected_with({"out must be on " + plan_device + ", got " + elsewhere}));
}

TEST_P(LinearValidation, MapMustBeOnThePlanDevice) {
  IKBO_SKIP_IF_UNAVAILABLE(other_device(device()));
  const auto elsewhere = round_robin_map(other_device(device()), LinearOperands::num_candidates,
                                         LinearOperands::num_users);
  LinearCall bad = call();
  bad.map = &elsewhere;
  EXPECT_TRUE(bad.rejected_with({"the candidate map must be on " + device_name(device()) +
                                 " like the weights, got " + device_name(other_device(device()))}));
}

TEST_P(LinearValidation, WorkspaceBytesFromSizesMatchesAndChecksThem) {
  using O = LinearOperands;
  EXPECT_EQ(linear_workspace_bytes(operands().plan, O::num_candidates, O::num_users),
            linear_workspace_bytes(operands().plan, operands().x_c.view(), operands().x_u.view(),
                                   operands().map));
  EXPECT_TRUE(throws_invalid_argument(
      [&] { linear_workspace_bytes(operands().plan, -1, O::num_users); },
      {"num_candidates (B) must be in [0, 2147483647], got -1"}));
  EXPECT_TRUE(throws_invalid_argument(
      [&] { linear_workspace_bytes(operands().plan, O::num_candidates, 0); },
      {"num_users (U) must be in [1, 2147483647], got 0"}));
}

TEST_P(LinearValidation, WorkspaceIsCheckedOnCudaAndUnusedOnTheCpu) {
  Tensor bad_x_c = operands().x_c.view();
  bad_x_c.shape[1] += 1;
  EXPECT_TRUE(throws_invalid_argument(
      [&] {
        linear_workspace_bytes(operands().plan, bad_x_c, operands().x_u.view(), operands().map);
      },
      {"x_c dimension 1 must be 12 (Kc of w_c)"}));
  if (!device().is_cuda()) {
    EXPECT_EQ(operands().workspace.bytes(), 0u) << "the CPU backend needs no workspace";
    LinearCall no_workspace = call();
    no_workspace.workspace = {};
    EXPECT_NO_THROW(no_workspace());
    return;
  }
  const std::size_t needed = operands().workspace.bytes();
  LinearCall too_small = call();
  too_small.workspace.bytes = needed - 1;
  EXPECT_TRUE(too_small.rejected_with({"workspace must hold " + std::to_string(needed)}));
  LinearCall null_workspace = call();
  null_workspace.workspace.data = nullptr;
  EXPECT_TRUE(null_workspace.rejected_with({"workspace", "null pointer"}));
  LinearCall misaligned = call();
  // The size still claims `needed` bytes, so only the alignment can be wrong;
  // validation rejects the call before anything is written.
  misaligned.workspace.data = static_cast<char*>(misaligned.workspace.data) + 16;
  EXPECT_TRUE(misaligned.rejected_with({"workspace must be 256-byte aligned"}));
}

TEST_P(LinearValidation, PlanRejectsBadWeights) {
  const Tensor w_u = operands().w_u.view(), w_c = operands().w_c.view();
  Tensor int_w_u = w_u;
  int_w_u.dtype = DType::i32;
  EXPECT_TRUE(
      throws_invalid_argument([&] { LinearPlan::create(int_w_u, w_c); },
                              {"w_u must have dtype float16, bfloat16 or float32, got int32"}));
  Tensor bf16_w_c = w_c;
  bf16_w_c.dtype = DType::bf16;
  EXPECT_TRUE(throws_invalid_argument([&] { LinearPlan::create(w_u, bf16_w_c); },
                                      {"w_c must have dtype float16, got bfloat16"}));
  Tensor fewer_rows = w_c;
  fewer_rows.shape[0] -= 1;
  EXPECT_TRUE(throws_invalid_argument([&] { LinearPlan::create(w_u, fewer_rows); },
                                      {"w_c dimension 0 must be 8 (N_out of w_u), got 7"}));
  Tensor no_k = w_c;
  no_k.shape[1] = 0;
  EXPECT_TRUE(throws_invalid_argument([&] { LinearPlan::create(w_u, no_k); },
                                      {"w_c dimension 1 (Kc) must be >= 1, got 0"}));
  Tensor null_w_u = w_u;
  null_w_u.data = nullptr;
  EXPECT_TRUE(throws_invalid_argument([&] { LinearPlan::create(null_w_u, w_c); },
                                      {"w_u is a null pointer"}));
}

TEST_P(LinearValidation, PlanRejectsBadBias) {
  const Tensor w_u = operands().w_u.view(), w_c = operands().w_c.view();
  Tensor short_bias = operands().bias.view();
  short_bias.shape[0] -= 1;
  EXPECT_TRUE(throws_invalid_argument([&] { LinearPlan::create(w_u, w_c, &short_bias); },
                                      {"bias dimension 0 must be 8 (N_out of w_u), got 7"}));
  Tensor f32_bias = operands().bias.view();
  f32_bias.dtype = DType::f32;
  EXPECT_TRUE(throws_invalid_argument([&] { LinearPlan::create(w_u, w_c, &f32_bias); },
                                      {"bias must have dtype float16, got float32"}));
  const Tensor matrix_bias(operands().bias.view().data, LinearOperands::dtype, {2, 4}, device());
  EXPECT_TRUE(throws_invalid_argument([&] { LinearPlan::create(w_u, w_c, &matrix_bias); },
                                      {"bias must have 1 dimensions, got 2"}));
  const Tensor weight = operands().weight.view();
  EXPECT_TRUE(throws_invalid_argument(
      [&] { LinearPlan::from_concatenated(weight, LinearOperands::ku, &short_bias); },
      {"bias dimension 0 must be 8 (N_out of weight), got 7"}));
}

TEST_P(LinearValidation, ConcatenatedWeightNeedsBothFeatureBlocks) {
  const Tensor weight = operands().weight.view();
  for (std::int64_t num_user_features : {std::int64_t{0}, std::int64_t{18}, std::int64_t{-1}}) {
    EXPECT_TRUE(throws_invalid_argument(
        [&] { LinearPlan::from_concatenated(weight, num_user_features); },
        {"num_user_features (Ku) must be in [1, 17]", "got " + std::to_string(num_user_features)}));
  }
  Tensor one_column = weight;
  one_column.shape[1] = 1;
  EXPECT_TRUE(throws_invalid_argument([&] { LinearPlan::from_concatenated(one_column, 1); },
                                      {"weight dimension 1 (Ku + Kc) must be >= 2, got 1"}));
  Tensor int_weight = weight;
  int_weight.dtype = DType::i32;
  EXPECT_TRUE(
      throws_invalid_argument([&] { LinearPlan::from_concatenated(int_weight, 6); },
                              {"weight must have dtype float16, bfloat16 or float32, got int32"}));
}

// The broadcast baseline's GEMM (a benchmark baseline, on both devices)
// checks its operands as the ops do, leaving out untouched.
TEST_P(LinearValidation, BroadcastBaselineGemmChecksItsOperands) {
  const auto& ops = operands();
  const std::int64_t in_features = LinearOperands::ku + LinearOperands::kc;
  const auto x_full = DeviceTensor::filled(device(), LinearOperands::dtype,
                                           {LinearOperands::num_candidates, in_features}, 1.0);
  const Tensor weight = ops.weight.view(), bias = ops.bias.view();
  const DeviceBuffer workspace(device(), baseline::linear_concat_workspace_bytes(weight));
  const Workspace scratch{workspace.data(), workspace.bytes()};
  auto rejected = [&](const Tensor& x, const Tensor& out, const Tensor* bias_or_null,
                      std::initializer_list<std::string_view> fragments) {
    return throws_invalid_argument(
        [&] { baseline::linear_concat(weight, bias_or_null, x, out, nullptr, scratch); },
        fragments, {&ops.out.buffer()});
  };
  Tensor narrow = x_full.view();
  narrow.shape[1] -= 1;
  EXPECT_TRUE(rejected(narrow, ops.out.view(), &bias,
                       {"x_full dimension 1 must be 18 (Ku + Kc of weight), got 17"}));
  Tensor short_out = ops.out.view();
  short_out.shape[0] -= 1;
  EXPECT_TRUE(rejected(x_full.view(), short_out, &bias,
                       {"out must have shape [6, 8] ([B, N_out]), got [5, 8]"}));
  Tensor short_bias = bias;
  short_bias.shape[0] -= 1;
  EXPECT_TRUE(rejected(x_full.view(), ops.out.view(), &short_bias,
                       {"bias dimension 0 must be 8 (N_out of weight), got 7"}));
  Tensor float_out = ops.out.view();
  float_out.dtype = DType::f32;
  EXPECT_TRUE(rejected(x_full.view(), float_out, &bias, {"out must have dtype float16"}));
  Tensor no_columns = weight;
  no_columns.shape[1] = 0;
  EXPECT_TRUE(throws_invalid_argument(
      [&] { baseline::linear_concat(no_columns, nullptr, x_full.view(), ops.out.view()); },
      {"weight must have N_out >= 1 and K >= 1, got shape [8, 0]"}, {&ops.out.buffer()}));
  // Valid: every element 18 * 0.5 * 1 + 0.75 = 9.75, exact in fp16.
  baseline::linear_concat(weight, &bias, x_full.view(), ops.out.view(), nullptr, scratch);
  for (double value : ops.out.values()) ASSERT_EQ(value, 9.75);
}

INSTANTIATE_TEST_SUITE_P(Devices, LinearValidation, testing::ValuesIn(test_devices()),
                         device_param_name);

// ------------------------------------------------------ CUDA execution ----

// A linear call with its inputs on the GPU, run into caller-given outputs.
class LinearOnCuda : public testing::TestWithParam<DType> {
 protected:
  static constexpr Device kCuda = Device::cuda(0);

  void SetUp() override {
    IKBO_SKIP_IF_UNAVAILABLE(kCuda);
    SeededRng rng;
    inputs_ = random_linear_inputs(rng, GetParam(), {433, 118, 866, 300, 7},
                                   MapOrder::uneven_unsorted, true);
    plan_.emplace(split_plan(kCuda, *inputs_));
    x_c_.emplace(kCuda, inputs_->x_c);
    x_u_.emplace(kCuda, inputs_->x_u);
    map_.emplace(CandidateMap::build(inputs_->cand_to_user.data(), inputs_->shape.num_candidates,
                                     inputs_->shape.num_users, kCuda));
    workspace_.emplace(kCuda, linear_workspace_bytes(*plan_, x_c_->view(), x_u_->view(), *map_));
  }

  DeviceTensor poisoned_out() const {
    return DeviceTensor::poisoned(kCuda, GetParam(),
                                  {inputs_->shape.num_candidates, inputs_->shape.out_features});
  }
  void enqueue(Stream stream, const DeviceTensor& out) const {
    linear(*plan_, x_c_->view(), x_u_->view(), *map_, out.view(), stream,
           {workspace_->data(), workspace_->bytes()});
  }
  // The result on the legacy default stream, checked against the reference.
  std::vector<std::byte> eager_result() const {
    const auto out = poisoned_out();
    enqueue(nullptr, out);
    EXPECT_TRUE(matches_reference(out.values(), inputs_->expected(), GetParam()));
    return out.bytes();
  }

 private:
  std::optional<LinearInputs> inputs_;
  std::optional<LinearPlan> plan_;
  std::optional<DeviceTensor> x_c_, x_u_;
  std::optional<CandidateMap> map_;
  std::optional<DeviceBuffer> workspace_;
};

// A gate holds the stream back while linear is called: if any of its work
// went to another stream, out is written before the gate opens; if the call
// synchronized, it returns only after the gate gave up.
TEST_P(LinearOnCuda, RunsOnTheGivenStreamWithoutSynchronizing) {
  const auto expected = eager_result();
  EXPECT_TRUE(eager_result() == expected) << "two runs on identical inputs differ";
  const TestStream stream(kCuda);
  const auto out = poisoned_out();
  const auto poisoned = out.bytes();
  {
    StreamGate gate(stream, std::chrono::seconds(10));
    enqueue(stream.handle(), out);
    EXPECT_FALSE(gate.timed_out())
        << "the call returned only after the blocked stream gave up: it synchronized";
    EXPECT_TRUE(out.bytes() == poisoned)
        << "out was written while its stream was still blocked: work ran on another stream";
    gate.release();
  }
  stream.synchronize();
  EXPECT_TRUE(out.bytes() == expected) << "the result on a created stream differs";
}

TEST_P(LinearOnCuda, CapturesIntoACudaGraph) {
  const auto expected = eager_result();
  const TestStream stream(kCuda);
  const auto out = poisoned_out();
  run_as_cuda_graph(stream, [&] { enqueue(stream.handle(), out); });
  EXPECT_TRUE(out.bytes() == expected) << "the graph replay differs from the eager run";
}

INSTANTIATE_TEST_SUITE_P(Dtypes, LinearOnCuda, testing::ValuesIn(float_dtypes()),
                         [](const testing::TestParamInfo<DType>& info) {
                           return dtype_label(info.param);
                         });

}  // namespace
}  // namespace ikbo::test
