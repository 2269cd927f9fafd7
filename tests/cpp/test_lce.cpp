// lce against the fp64 reference, on every device and dtype: the IKBO op,
// the broadcast baseline (replicate_lce_input + lce_concat), plan reuse
// across requests, plan ownership of the weights, and B = 0.
// Shapes include the reference widths (M=433, Kc=866, Ku=1178) at small B and
// N, N=1, B=1, U=1, U=B, K tails that are not multiples of 8, and maps that
// are unsorted, uneven or leave users without candidates.
#include <tuple>
#include <vector>

#include "baselines.hpp"
#include "device_harness.hpp"

namespace ikbo::test {
namespace {

const std::vector<LceCase>& lce_cases() {
  static const std::vector<LceCase> cases = {
      {"reference_widths", {433, 866, 1178, 5, 6, 3}, MapOrder::unsorted},
      {"n_is_1", {33, 40, 24, 1, 9, 3}, MapOrder::sorted},
      {"one_candidate", {17, 19, 13, 7, 1, 1}, MapOrder::sorted},
      {"one_user", {20, 24, 16, 9, 7, 1}, MapOrder::sorted},
      {"one_candidate_per_user", {31, 15, 9, 12, 5, 5}, MapOrder::unsorted},
      {"uneven_sorted_empty_users", {24, 33, 47, 17, 20, 7}, MapOrder::uneven},
      {"uneven_unsorted_empty_users", {45, 64, 8, 64, 23, 9}, MapOrder::uneven_unsorted},
      {"odd_k_tails", {7, 3, 5, 3, 4, 2}, MapOrder::unsorted},
      {"wide_n", {16, 8, 8, 130, 3, 2}, MapOrder::sorted},
  };
  return cases;
}

// Host inputs of one request with their exact values.
struct LceInputs {
  LceShape shape;
  HostTensor w_c, w_u, e_c, e_u;
  std::vector<std::int32_t> cand_to_user;

  std::vector<double> expected() const {
    return reference_lce(shape, w_c.values, w_u.values, e_c.values, e_u.values, cand_to_user);
  }
};

LceInputs random_lce_inputs(SeededRng& rng, DType dtype, const LceShape& shape, MapOrder order) {
  const auto [m, kc, ku, n, num_candidates, num_users] = shape;
  return {shape,
          rng.tensor(dtype, {m, kc}),
          rng.tensor(dtype, {m, ku}),
          rng.tensor(dtype, {num_candidates, kc, n}),
          rng.tensor(dtype, {num_users, ku, n}),
          rng.candidate_map(num_candidates, num_users, order)};
}

// Runs ikbo::lce for `inputs` on the plan's device into a poisoned output
// and returns what it wrote.
std::vector<double> run_lce(const LcePlan& plan, const LceInputs& inputs) {
  const Device device = plan.device();
  const DeviceTensor e_c(device, inputs.e_c), e_u(device, inputs.e_u);
  const auto map = CandidateMap::build(inputs.cand_to_user.data(), inputs.shape.num_candidates,
                                       inputs.shape.num_users, device);
  const auto out = DeviceTensor::poisoned(
      device, plan.dtype(), {inputs.shape.num_candidates, inputs.shape.m, inputs.shape.n});
  const DeviceBuffer workspace(device, lce_workspace_bytes(plan, e_c.view(), e_u.view(), map));
  lce(plan, e_c.view(), e_u.view(), map, out.view(), nullptr,
      {workspace.data(), workspace.bytes()});
  return out.values();
}

using LceParam = std::tuple<Device, DType, LceCase>;

class LceVsReference : public testing::TestWithParam<LceParam> {
 protected:
  void SetUp() override { IKBO_SKIP_IF_UNAVAILABLE(device()); }
  Device device() const { return std::get<0>(GetParam()); }
  DType dtype() const { return std::get<1>(GetParam()); }
  const LceCase& lce_case() const { return std::get<2>(GetParam()); }
};

TEST_P(LceVsReference, IkboMatchesFp64Reference) {
  SeededRng rng;
  const LceInputs inputs = random_lce_inputs(rng, dtype(), lce_case().shape, lce_case().order);
  const DeviceTensor w_c(device(), inputs.w_c), w_u(device(), inputs.w_u);
  const auto plan = LcePlan::create(w_c.view(), w_u.view());
  EXPECT_EQ(plan.dtype(), dtype());
  EXPECT_EQ(plan.device(), device());
  EXPECT_EQ(plan.m(), inputs.shape.m);
  EXPECT_EQ(plan.kc(), inputs.shape.kc);
  EXPECT_EQ(plan.ku(), inputs.shape.ku);
  EXPECT_TRUE(matches_reference(run_lce(plan, inputs), inputs.expected(), dtype()));
}

TEST_P(LceVsReference, BroadcastBaselineMatchesFp64Reference) {
  SeededRng rng;
  const LceInputs inputs = random_lce_inputs(rng, dtype(), lce_case().shape, lce_case().order);
  const auto [m, kc, ku, n, num_candidates, num_users] = inputs.shape;

  HostTensor w_full{dtype(), {m, ku + kc}, {}};
  for (std::int64_t row = 0; row < m; ++row) {
    const auto user_row = inputs.w_u.values.begin() + row * ku;
    const auto cand_row = inputs.w_c.values.begin() + row * kc;
    w_full.values.insert(w_full.values.end(), user_row, user_row + ku);
    w_full.values.insert(w_full.values.end(), cand_row, cand_row + kc);
  }
  const auto plan = baseline::prepare_concat_lce_plan(DeviceTensor(device(), w_full).view());

  const DeviceTensor e_c(device(), inputs.e_c), e_u(device(), inputs.e_u);
  const auto map =
      CandidateMap::build(inputs.cand_to_user.data(), num_candidates, num_users, device());
  const auto e_full = DeviceTensor::poisoned(device(), dtype(), {num_candidates, ku + kc, n});
  baseline::replicate_lce_input(e_c.view(), e_u.view(), map, e_full.view());

  // The replicated input is a pure copy: exact, element by element.
  std::vector<double> expected_e_full;
  for (std::int64_t b = 0; b < num_candidates; ++b) {
    const auto user_rows = inputs.e_u.values.begin() + inputs.cand_to_user[b] * ku * n;
    const auto cand_rows = inputs.e_c.values.begin() + b * kc * n;
    expected_e_full.insert(expected_e_full.end(), user_rows, user_rows + ku * n);
    expected_e_full.insert(expected_e_full.end(), cand_rows, cand_rows + kc * n);
  }
  EXPECT_TRUE(exactly_equal(e_full.values(), expected_e_full));

  const auto out = DeviceTensor::poisoned(device(), dtype(), {num_candidates, m, n});
  const DeviceBuffer workspace(device(),
                               baseline::lce_concat_workspace_bytes(*plan, e_full.view()));
  baseline::lce_concat(*plan, e_full.view(), out.view(), nullptr,
                       {workspace.data(), workspace.bytes()});
  EXPECT_TRUE(matches_reference(out.values(), inputs.expected(), dtype()));
}

std::string lce_param_name(const testing::TestParamInfo<LceParam>& info) {
  return device_label(std::get<0>(info.param)) + "_" + dtype_label(std::get<1>(info.param)) + "_" +
         std::get<2>(info.param).name;
}

INSTANTIATE_TEST_SUITE_P(Shapes, LceVsReference,
                         testing::Combine(testing::ValuesIn(test_devices()),
                                          testing::ValuesIn(float_dtypes()),
                                          testing::ValuesIn(lce_cases())),
                         lce_param_name);

class LceRequests : public DeviceDtypeTest {};

// One plan serves many requests, each with its own map and batch sizes.
TEST_P(LceRequests, PlanIsReusedAcrossRequestsWithDifferentMaps) {
  SeededRng rng;
  const std::int64_t m = 37, kc = 29, ku = 51;
  const HostTensor w_c = rng.tensor(dtype(), {m, kc}), w_u = rng.tensor(dtype(), {m, ku});
  const auto plan =
      LcePlan::create(DeviceTensor(device(), w_c).view(), DeviceTensor(device(), w_u).view());
  struct Request {
    std::int64_t n, num_candidates, num_users;
    MapOrder order;
  };
  for (const Request& request :
       {Request{11, 9, 3, MapOrder::unsorted}, Request{6, 14, 5, MapOrder::uneven_unsorted},
        Request{11, 9, 3, MapOrder::sorted}}) {
    SCOPED_TRACE(testing::Message()
                 << "request B=" << request.num_candidates << " U=" << request.num_users
                 << " N=" << request.n << " " << map_order_name(request.order));
    const LceShape shape{m, kc, ku, request.n, request.num_candidates, request.num_users};
    LceInputs inputs{shape,
                     w_c,
                     w_u,
                     rng.tensor(dtype(), {request.num_candidates, kc, request.n}),
                     rng.tensor(dtype(), {request.num_users, ku, request.n}),
                     rng.candidate_map(request.num_candidates, request.num_users, request.order)};
    EXPECT_TRUE(matches_reference(run_lce(plan, inputs), inputs.expected(), dtype()));
  }
}

// Fresh random shapes on every run (the seed is printed on failure), B = 0 included.
TEST_P(LceRequests, RandomShapesMatchFp64Reference) {
  SeededRng rng;
  for (int trial = 0; trial < 12; ++trial) {
    // Braced initialization evaluates left to right, so a seed reproduces the shapes.
    const LceShape shape{rng.uniform_int(1, 70), rng.uniform_int(1, 90), rng.uniform_int(1, 90),
                         rng.uniform_int(1, 40), rng.uniform_int(0, 24), rng.uniform_int(1, 8)};
    const auto order = static_cast<MapOrder>(rng.uniform_int(0, 3));
    SCOPED_TRACE(testing::Message()
                 << "trial " << trial << ": M=" << shape.m << " Kc=" << shape.kc
                 << " Ku=" << shape.ku << " N=" << shape.n << " B=" << shape.num_candidates
                 << " U=" << shape.num_users << " " << map_order_name(order));
    const LceInputs inputs = random_lce_inputs(rng, dtype(), shape, order);
    const auto plan = LcePlan::create(DeviceTensor(device(), inputs.w_c).view(),
                                      DeviceTensor(device(), inputs.w_u).view());
    EXPECT_TRUE(matches_reference(run_lce(plan, inputs), inputs.expected(), dtype()));
  }
}

// The plan keeps its own copy: overwriting the caller's weights afterwards
// must not change results.
TEST_P(LceRequests, PlanOwnsACopyOfTheWeights) {
  SeededRng rng;
  const LceInputs inputs =
      random_lce_inputs(rng, dtype(), {19, 21, 10, 8, 6, 2}, MapOrder::unsorted);
  DeviceTensor w_c(device(), inputs.w_c), w_u(device(), inputs.w_u);
  const auto plan = LcePlan::create(w_c.view(), w_u.view());
  w_c.buffer().upload(poison_bytes(dtype(), inputs.w_c.values.size()));
  w_u.buffer().upload(poison_bytes(dtype(), inputs.w_u.values.size()));
  EXPECT_TRUE(matches_reference(run_lce(plan, inputs), inputs.expected(), dtype()));
}

// B = 0 is valid: nothing is computed and nothing written.
TEST_P(LceRequests, ZeroCandidatesIsANoOp) {
  SeededRng rng;
  const std::int64_t m = 12, kc = 10, ku = 6, n = 4, num_users = 3;
  const auto plan = LcePlan::create(DeviceTensor(device(), rng.tensor(dtype(), {m, kc})).view(),
                                    DeviceTensor(device(), rng.tensor(dtype(), {m, ku})).view());
  const auto map = CandidateMap::build(nullptr, 0, num_users, device());
  const DeviceTensor e_u(device(), rng.tensor(dtype(), {num_users, ku, n}));
  const Tensor e_c(nullptr, dtype(), {0, kc, n}, device());
  // The output view is empty but points at a poisoned guard region that must stay as it is.
  const auto guard = DeviceTensor::poisoned(device(), dtype(), {m, n});
  const Tensor out(guard.buffer().data(), dtype(), {0, m, n}, device());
  const auto guard_before = guard.bytes();
  const DeviceBuffer workspace(device(), lce_workspace_bytes(plan, e_c, e_u.view(), map));
  const Workspace scratch{workspace.data(), workspace.bytes()};
  EXPECT_NO_THROW(lce(plan, e_c, e_u.view(), map, out, nullptr, scratch));
  EXPECT_EQ(guard.bytes(), guard_before);
}

INSTANTIATE_TEST_SUITE_P(Devices, LceRequests,
                         testing::Combine(testing::ValuesIn(test_devices()),
                                          testing::ValuesIn(float_dtypes())),
                         device_dtype_param_name);

}  // namespace
}  // namespace ikbo::test
