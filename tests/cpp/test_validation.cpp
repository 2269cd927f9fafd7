// Argument validation of lce, LcePlan::create, lce_workspace_bytes and
// attention, on every device: each invalid argument must raise ikbo::Error
// whose message names the argument (key substrings of the messages built in
// src/api/*.cpp), and must leave the pre-filled output bitwise untouched.
// Invalid maps and offsets are rejected when they are built; those errors
// are tested in test_candidate_map.cpp.
#include <cmath>
#include <limits>
#include <optional>
#include <vector>

#include "device_harness.hpp"

namespace ikbo::test {
namespace {

constexpr std::int64_t kHugeExtent = std::int64_t{1} << 40;   // above the int32 extent limit
constexpr std::int64_t kLargeExtent = std::int64_t{1} << 30;  // fine alone, overflows in products

Device other_device(Device device) { return device.is_cuda() ? Device::cpu() : Device::cuda(0); }

// ---------------------------------------------------------------- lce ----

// A valid lce call; each test breaks one argument of it.
struct LceOperands {
  static constexpr std::int64_t m = 8, kc = 12, ku = 6, n = 5, num_candidates = 6, num_users = 3;
  static constexpr DType dtype = DType::f16;

  explicit LceOperands(Device device)
      : w_c(DeviceTensor::filled(device, dtype, {m, kc}, 0.25)),
        w_u(DeviceTensor::filled(device, dtype, {m, ku}, 0.5)),
        e_c(DeviceTensor::filled(device, dtype, {num_candidates, kc, n}, 1.0)),
        e_u(DeviceTensor::filled(device, dtype, {num_users, ku, n}, 2.0)),
        out(DeviceTensor::filled(device, dtype, {num_candidates, m, n}, -7.0)),
        plan(LcePlan::create(w_c.view(), w_u.view())),
        map(make_map(device, num_candidates, num_users)),
        workspace(device, lce_workspace_bytes(plan, e_c.view(), e_u.view(), map)) {}

  static CandidateMap make_map(Device device, std::int64_t candidates, std::int64_t users) {
    std::vector<std::int32_t> cand_to_user(static_cast<std::size_t>(candidates));
    for (std::size_t b = 0; b < cand_to_user.size(); ++b) {
      cand_to_user[b] = static_cast<std::int32_t>(b % static_cast<std::size_t>(users));
    }
    return CandidateMap::build(cand_to_user.data(), candidates, users, device);
  }

  DeviceTensor w_c, w_u, e_c, e_u, out;
  LcePlan plan;
  CandidateMap map;
  DeviceBuffer workspace;
};

// The arguments of one lce call, starting from the valid ones.
struct LceCall {
  explicit LceCall(const LceOperands& operands)
      : plan(&operands.plan),
        e_c(operands.e_c.view()),
        e_u(operands.e_u.view()),
        out(operands.out.view()),
        map(&operands.map),
        workspace{operands.workspace.data(), operands.workspace.bytes()},
        out_buffer(&operands.out.buffer()) {}

  void operator()() const { lce(*plan, e_c, e_u, *map, out, nullptr, workspace); }
  testing::AssertionResult rejected_with(std::initializer_list<std::string_view> fragments) const {
    return throws_invalid_argument([this] { (*this)(); }, fragments, {out_buffer});
  }

  const LcePlan* plan;
  Tensor e_c, e_u, out;
  const CandidateMap* map;
  Workspace workspace;
  const DeviceBuffer* out_buffer;
};

class LceValidation : public DeviceTest {
 protected:
  void SetUp() override {
    DeviceTest::SetUp();
    if (!IsSkipped()) operands_.emplace(device());
  }
  const LceOperands& operands() const { return *operands_; }
  LceCall call() const { return LceCall(*operands_); }

 private:
  std::optional<LceOperands> operands_;
};

TEST_P(LceValidation, ValidCallSucceedsAndWritesTheOutput) {
  const LceCall valid = call();
  ASSERT_NO_THROW(valid());
  // Every output element: 12 * 0.25 * 1 + 6 * 0.5 * 2 = 9, exact in fp16.
  for (double value : operands().out.values()) ASSERT_EQ(value, 9.0);
}

TEST_P(LceValidation, MapLengthMustMatchBatchOfEc) {
  const auto longer_map =
      LceOperands::make_map(device(), LceOperands::num_candidates + 1, LceOperands::num_users);
  LceCall bad = call();
  bad.map = &longer_map;
  EXPECT_TRUE(bad.rejected_with(
      {"e_c dimension 0 must be 7 (num_candidates of the candidate map), got 6"}));
}

TEST_P(LceValidation, MapUsersMustMatchBatchOfEu) {
  const auto more_users =
      LceOperands::make_map(device(), LceOperands::num_candidates, LceOperands::num_users + 1);
  LceCall bad = call();
  bad.map = &more_users;
  EXPECT_TRUE(
      bad.rejected_with({"e_u dimension 0 must be 4 (num_users of the candidate map), got 3"}));
}

TEST_P(LceValidation, EveryTensorMustHaveThePlanDtype) {
  LceCall bad_e_c = call();
  bad_e_c.e_c.dtype = DType::bf16;
  EXPECT_TRUE(bad_e_c.rejected_with({"e_c must have dtype float16, got bfloat16"}));
  LceCall bad_e_u = call();
  bad_e_u.e_u.dtype = DType::f32;
  EXPECT_TRUE(bad_e_u.rejected_with({"e_u must have dtype float16, got float32"}));
  LceCall bad_out = call();
  bad_out.out.dtype = DType::f32;
  EXPECT_TRUE(bad_out.rejected_with({"out must have dtype float16, got float32"}));
}

TEST_P(LceValidation, PlanRejectsUnsupportedOrMixedWeightDtypes) {
  Tensor w_c = operands().w_c.view(), w_u = operands().w_u.view();
  Tensor int_w_c = w_c;
  int_w_c.dtype = DType::i32;
  EXPECT_TRUE(
      throws_invalid_argument([&] { LcePlan::create(int_w_c, w_u); },
                              {"w_c must have dtype float16, bfloat16 or float32, got int32"}));
  Tensor bf16_w_u = w_u;
  bf16_w_u.dtype = DType::bf16;
  EXPECT_TRUE(throws_invalid_argument([&] { LcePlan::create(w_c, bf16_w_u); },
                                      {"w_u must have dtype float16, got bfloat16"}));
}

TEST_P(LceValidation, PlanRejectsBadWeightShapes) {
  const Tensor w_c = operands().w_c.view(), w_u = operands().w_u.view();
  Tensor fewer_rows = w_u;
  fewer_rows.shape[0] -= 1;
  EXPECT_TRUE(throws_invalid_argument([&] { LcePlan::create(w_c, fewer_rows); },
                                      {"w_u dimension 0 must be 8 (M of w_c), got 7"}));
  Tensor no_k = w_c;
  no_k.shape[1] = 0;
  EXPECT_TRUE(throws_invalid_argument([&] { LcePlan::create(no_k, w_u); },
                                      {"w_c dimension 1 (Kc) must be >= 1, got 0"}));
  // M = 0 in w_c is w_c's error, not w_u's (whose M is right).
  Tensor no_m = w_c;
  no_m.shape[0] = 0;
  EXPECT_TRUE(throws_invalid_argument([&] { LcePlan::create(no_m, w_u); },
                                      {"w_c dimension 0 (M) must be >= 1, got 0"}));
  Tensor vector_w_u(w_u.data, w_u.dtype, {LceOperands::m * LceOperands::ku}, w_u.device);
  EXPECT_TRUE(throws_invalid_argument([&] { LcePlan::create(w_c, vector_w_u); },
                                      {"w_u must have 2 dimensions, got 1"}));
  Tensor null_w_c = w_c;
  null_w_c.data = nullptr;
  EXPECT_TRUE(
      throws_invalid_argument([&] { LcePlan::create(null_w_c, w_u); }, {"w_c is a null pointer"}));
}

TEST_P(LceValidation, KOfEcMustMatchKcOfPlan) {
  LceCall bad = call();
  bad.e_c.shape[1] -= 1;
  EXPECT_TRUE(bad.rejected_with({"e_c dimension 1 must be 12 (Kc of w_c), got 11"}));
}

TEST_P(LceValidation, KOfEuMustMatchKuOfPlan) {
  LceCall bad = call();
  bad.e_u.shape[1] -= 1;
  EXPECT_TRUE(bad.rejected_with({"e_u dimension 1 must be 6 (Ku of w_u), got 5"}));
}

TEST_P(LceValidation, NOfEuMustMatchNOfEc) {
  LceCall bad = call();
  bad.e_u.shape[2] -= 1;
  EXPECT_TRUE(bad.rejected_with({"e_u dimension 2 must be 5 (N of e_c), got 4"}));
}

TEST_P(LceValidation, NMustBePositive) {
  LceCall bad = call();
  bad.e_c.shape[2] = 0;
  bad.e_u.shape[2] = 0;
  EXPECT_TRUE(bad.rejected_with({"e_c dimension 2 (N) must be >= 1, got 0"}));
  // With e_u's N right, e_c is still the argument named.
  LceCall bad_e_c = call();
  bad_e_c.e_c.shape[2] = 0;
  EXPECT_TRUE(bad_e_c.rejected_with({"e_c dimension 2 (N) must be >= 1, got 0"}));
}

TEST_P(LceValidation, OutMustHaveShapeBMN) {
  LceCall wrong_m = call();
  wrong_m.out.shape[1] -= 1;
  EXPECT_TRUE(wrong_m.rejected_with({"out must have shape [6, 8, 5] ([B, M, N]), got [6, 7, 5]"}));
  LceCall wrong_rank = call();
  wrong_rank.out =
      Tensor(wrong_rank.out.data, wrong_rank.out.dtype, {6, 40}, wrong_rank.out.device);
  EXPECT_TRUE(wrong_rank.rejected_with({"out must have 3 dimensions, got 2"}));
}

TEST_P(LceValidation, NullDataPointersAreRejected) {
  LceCall null_e_c = call();
  null_e_c.e_c.data = nullptr;
  EXPECT_TRUE(null_e_c.rejected_with({"e_c is a null pointer"}));
  LceCall null_e_u = call();
  null_e_u.e_u.data = nullptr;
  EXPECT_TRUE(null_e_u.rejected_with({"e_u is a null pointer"}));
  LceCall null_out = call();
  null_out.out.data = nullptr;
  EXPECT_TRUE(null_out.rejected_with({"out is a null pointer"}));
}

// A pointer one byte off its element size (a misaligned numpy array, say):
// the kernels read through typed pointers, undefined on the CPU and a fault
// on a GPU, so the call is refused before anything is read.
TEST_P(LceValidation, MisalignedDataPointersAreRejected) {
  const auto shifted = [](Tensor& tensor) {
    tensor.data = static_cast<char*>(tensor.data) + 1;
  };
  LceCall bad_e_c = call();
  shifted(bad_e_c.e_c);
  EXPECT_TRUE(bad_e_c.rejected_with({"e_c must be aligned to its element size, 2 bytes"}));
  LceCall bad_out = call();
  shifted(bad_out.out);
  EXPECT_TRUE(bad_out.rejected_with({"out must be aligned to its element size, 2 bytes"}));
  Tensor w_c = operands().w_c.view();
  shifted(w_c);
  EXPECT_TRUE(throws_invalid_argument([&] { LcePlan::create(w_c, operands().w_u.view()); },
                                      {"w_c must be aligned to its element size"}));
}

TEST_P(LceValidation, ShapesBeyondTheIndexableRangeAreRejected) {
  LceCall huge_extent = call();
  huge_extent.e_u =
      Tensor(huge_extent.e_u.data, LceOperands::dtype, {kHugeExtent, kHugeExtent, 1}, device());
  EXPECT_TRUE(huge_extent.rejected_with(
      {"e_u dimension 0 = 1099511627776 exceeds the largest supported extent"}));
  LceCall overflowing_count = call();
  overflowing_count.e_c = Tensor(overflowing_count.e_c.data, LceOperands::dtype,
                                 {kLargeExtent, LceOperands::kc, kLargeExtent}, device());
  EXPECT_TRUE(overflowing_count.rejected_with(
      {"e_c shape [1073741824, 12, 1073741824] has more elements than"}));
}

// Tensor's fields are public, so a rank can be set past the shape array.
TEST_P(LceValidation, RankBeyondTheShapeArrayIsRejected) {
  LceCall bad = call();
  bad.e_u.rank = kMaxRank + 2;
  EXPECT_TRUE(bad.rejected_with({"e_u must have 3 dimensions, got 6 (shape [rank 6])"}));
  Tensor w_c = operands().w_c.view();
  w_c.rank = -1;
  EXPECT_TRUE(throws_invalid_argument(
      [&] { LcePlan::create(w_c, operands().w_u.view()); },
      {"w_c must have 2 dimensions, got -1 (shape [rank -1])"}, {}));
}

// The CPU keeps the user partials as one [M, U * N] matrix for 32-bit BLAS.
TEST_P(LceValidation, UserPartialsBeyondTheBlasIndexRangeAreRejectedOnTheCpu) {
  if (device().is_cuda()) GTEST_SKIP() << "the BLAS index range is the CPU backend's limit";
  constexpr std::int64_t n = (std::int64_t{1} << 31) - 1;  // U * N = 3 * (2^31 - 1)
  LceCall wide = call();
  wide.e_c = Tensor(wide.e_c.data, LceOperands::dtype, {LceOperands::num_candidates,
                                                        LceOperands::kc, n}, device());
  wide.e_u = Tensor(wide.e_u.data, LceOperands::dtype, {LceOperands::num_users,
                                                        LceOperands::ku, n}, device());
  wide.out = Tensor(wide.out.data, LceOperands::dtype, {LceOperands::num_candidates,
                                                        LceOperands::m, n}, device());
  EXPECT_TRUE(wide.rejected_with(
      {"U * N of e_u = 6442450941 exceeds what the CPU backend's BLAS indexes"}));
}

TEST_P(LceValidation, OutMustNotAliasAnInput) {
  LceCall aliased = call();
  aliased.out.data = aliased.e_c.data;
  aliased.out.shape = {LceOperands::num_candidates, LceOperands::m, LceOperands::n};
  EXPECT_TRUE(throws_invalid_argument([&] { aliased(); }, {"out overlaps e_c"},
                                      {&operands().e_c.buffer(), &operands().out.buffer()}));
}

TEST_P(LceValidation, TensorsMustBeOnThePlanDevice) {
  const std::string plan_device = device_name(device());
  const std::string elsewhere = device_name(other_device(device()));
  LceCall bad_e_c = call();
  bad_e_c.e_c.device = other_device(device());
  EXPECT_TRUE(bad_e_c.rejected_with({"e_c must be on " + plan_device + ", got " + elsewhere}));
  LceCall bad_out = call();
  bad_out.out.device = other_device(device());
  EXPECT_TRUE(bad_out.rejected_with({"out must be on " + plan_device + ", got " + elsewhere}));
}

// The CPU is one device: another CPU index is refused, and named as it is.
TEST_P(LceValidation, CpuIndexOtherThanZeroIsRejected) {
  LceCall bad = call();
  bad.e_c.device = Device{DeviceType::cpu, 1};
  EXPECT_TRUE(bad.rejected_with({"e_c is on cpu:1, but the CPU is one device, index 0"}));
  std::vector<std::int32_t> cand_to_user{0, 1};
  EXPECT_TRUE(throws_invalid_argument(
      [&] { CandidateMap::build(cand_to_user.data(), 2, 2, Device{DeviceType::cpu, 2}); },
      {"the CandidateMap is on cpu:2"}, {}));
}

TEST_P(LceValidation, MapMustBeOnThePlanDevice) {
  IKBO_SKIP_IF_UNAVAILABLE(other_device(device()));
  const auto elsewhere = LceOperands::make_map(other_device(device()), LceOperands::num_candidates,
                                               LceOperands::num_users);
  LceCall bad = call();
  bad.map = &elsewhere;
  EXPECT_TRUE(bad.rejected_with({"the candidate map must be on " + device_name(device()) +
                                 " like the weights, got " + device_name(other_device(device()))}));
}

TEST_P(LceValidation, WorkspaceBytesValidatesLikeLce) {
  Tensor bad_e_c = operands().e_c.view();
  bad_e_c.shape[1] += 1;
  EXPECT_TRUE(throws_invalid_argument(
      [&] { lce_workspace_bytes(operands().plan, bad_e_c, operands().e_u.view(), operands().map); },
      {"e_c dimension 1 must be 12 (Kc of w_c)"}));
  if (!device().is_cuda()) {
    EXPECT_EQ(lce_workspace_bytes(operands().plan, operands().e_c.view(), operands().e_u.view(),
                                  operands().map),
              0u)
        << "the CPU backend needs no workspace";
  }
}

TEST_P(LceValidation, WorkspaceBytesFromSizesMatchesAndChecksThem) {
  using O = LceOperands;
  EXPECT_EQ(lce_workspace_bytes(operands().plan, O::n, O::num_candidates, O::num_users),
            lce_workspace_bytes(operands().plan, operands().e_c.view(), operands().e_u.view(),
                                operands().map));
  EXPECT_TRUE(throws_invalid_argument(
      [&] { lce_workspace_bytes(operands().plan, 0, O::num_candidates, O::num_users); },
      {"n (N, dimension 2 of e_c) must be in [1, 2147483647], got 0"}));
  EXPECT_TRUE(throws_invalid_argument(
      [&] { lce_workspace_bytes(operands().plan, O::n, -1, O::num_users); },
      {"num_candidates (B) must be in [0, 2147483647], got -1"}));
  EXPECT_TRUE(throws_invalid_argument(
      [&] { lce_workspace_bytes(operands().plan, O::n, O::num_candidates, 0); },
      {"num_users (U) must be in [1, 2147483647], got 0"}));
  EXPECT_TRUE(throws_invalid_argument(
      [&] { lce_workspace_bytes(operands().plan, O::n, std::int64_t{1} << 31, O::num_users); },
      {"num_candidates (B) must be in [0, 2147483647], got 2147483648"}));
}

TEST_P(LceValidation, WorkspaceMustHoldWhatTheBackendNeeds) {
  if (!device().is_cuda()) {
    LceCall no_workspace = call();
    no_workspace.workspace = {};
    EXPECT_NO_THROW(no_workspace()) << "the CPU backend takes no workspace";
    return;
  }
  const std::size_t needed = operands().workspace.bytes();
  if (needed == 0) GTEST_SKIP() << "this backend needs no workspace for these shapes";
  LceCall too_small = call();
  too_small.workspace.bytes = needed - 1;
  EXPECT_TRUE(too_small.rejected_with({"workspace must hold " + std::to_string(needed)}));
  LceCall null_workspace = call();
  null_workspace.workspace.data = nullptr;
  EXPECT_TRUE(null_workspace.rejected_with({"workspace", "null pointer"}));
}

INSTANTIATE_TEST_SUITE_P(Devices, LceValidation, testing::ValuesIn(test_devices()),
                         device_param_name);

// ---------------------------------------------------------- attention ----

// A valid attention call (dense and jagged K/V); each test breaks one argument.
struct AttentionOperands {
  static constexpr std::int64_t num_candidates = 4, num_users = 2, n_seed = 3, heads = 2,
                                head_dim = 64, seq_len = 7, kv_rows = 7;
  static constexpr DType dtype = DType::f16;

  explicit AttentionOperands(Device device)
      : q(DeviceTensor::filled(device, dtype, {num_candidates, n_seed, heads, head_dim}, 0.5)),
        k(DeviceTensor::filled(device, dtype, {num_users, seq_len, heads, head_dim}, 0.25)),
        v(DeviceTensor::filled(device, dtype, {num_users, seq_len, heads, head_dim}, 3.0)),
        k_rows(DeviceTensor::filled(device, dtype, {kv_rows, heads, head_dim}, 0.25)),
        v_rows(DeviceTensor::filled(device, dtype, {kv_rows, heads, head_dim}, 3.0)),
        out(DeviceTensor::filled(device, dtype, {num_candidates, n_seed, heads, head_dim}, -7.0)),
        map(LceOperands::make_map(device, num_candidates, num_users)),
        kv_offsets(make_offsets(device, {0, 3, 7}, kv_rows)) {}

  static JaggedOffsets make_offsets(Device device, std::vector<std::int32_t> offsets,
                                    std::int64_t total) {
    return JaggedOffsets::build(offsets.data(), static_cast<std::int64_t>(offsets.size()) - 1,
                                total, device);
  }

  DeviceTensor q, k, v, k_rows, v_rows, out;
  CandidateMap map;
  JaggedOffsets kv_offsets;
};

struct AttentionCall {
  AttentionCall(const AttentionOperands& operands, bool jagged)
      : q(operands.q.view()),
        k(jagged ? operands.k_rows.view() : operands.k.view()),
        v(jagged ? operands.v_rows.view() : operands.v.view()),
        out(operands.out.view()),
        map(&operands.map),
        kv_offsets(jagged ? &operands.kv_offsets : nullptr),
        out_buffer(&operands.out.buffer()) {}

  void operator()() const { attention(q, k, v, *map, out, kv_offsets, scale); }
  testing::AssertionResult rejected_with(std::initializer_list<std::string_view> fragments) const {
    return throws_invalid_argument([this] { (*this)(); }, fragments, {out_buffer});
  }

  Tensor q, k, v, out;
  const CandidateMap* map;
  const JaggedOffsets* kv_offsets;
  std::optional<float> scale;
  const DeviceBuffer* out_buffer;
};

class AttentionValidation : public DeviceTest {
 protected:
  void SetUp() override {
    DeviceTest::SetUp();
    if (!IsSkipped()) operands_.emplace(device());
  }
  const AttentionOperands& operands() const { return *operands_; }
  AttentionCall dense() const { return AttentionCall(*operands_, false); }
  AttentionCall jagged() const { return AttentionCall(*operands_, true); }
  void restore_out(std::span<const std::byte> bytes) { operands_->out.buffer().upload(bytes); }

 private:
  std::optional<AttentionOperands> operands_;
};

TEST_P(AttentionValidation, ValidCallsSucceedAndWriteTheOutput) {
  // Constant V: every output element is 3 whatever the softmax weights.
  // Each call starts from out's -7s, so it must write every element itself.
  const std::vector<std::byte> unwritten = operands().out.bytes();
  for (const AttentionCall& valid : {dense(), jagged()}) {
    restore_out(unwritten);
    ASSERT_NO_THROW(valid());
    for (double value : operands().out.values()) ASSERT_EQ(value, 3.0);
  }
}

TEST_P(AttentionValidation, MapLengthMustMatchBatchOfQ) {
  const auto longer_map = LceOperands::make_map(device(), AttentionOperands::num_candidates + 1,
                                                AttentionOperands::num_users);
  AttentionCall bad = dense();
  bad.map = &longer_map;
  EXPECT_TRUE(
      bad.rejected_with({"q dimension 0 must be 5 (num_candidates of the candidate map), got 4"}));
}

TEST_P(AttentionValidation, MapUsersMustMatchDenseKv) {
  const auto more_users = LceOperands::make_map(device(), AttentionOperands::num_candidates,
                                                AttentionOperands::num_users + 1);
  AttentionCall bad = dense();
  bad.map = &more_users;
  EXPECT_TRUE(
      bad.rejected_with({"k dimension 0 must be 3 (num_users of the candidate map), got 2"}));
}

TEST_P(AttentionValidation, EveryTensorMustHaveTheDtypeOfQ) {
  for (bool jagged_kv : {false, true}) {
    SCOPED_TRACE(jagged_kv ? "jagged K/V" : "dense K/V");
    AttentionCall int_q = jagged_kv ? jagged() : dense();
    int_q.q.dtype = DType::i32;
    EXPECT_TRUE(int_q.rejected_with({"q must have dtype float16, bfloat16 or float32, got int32"}));
    AttentionCall bad_k = jagged_kv ? jagged() : dense();
    bad_k.k.dtype = DType::f32;
    EXPECT_TRUE(bad_k.rejected_with({"k must have dtype float16, got float32"}));
    AttentionCall bad_v = jagged_kv ? jagged() : dense();
    bad_v.v.dtype = DType::bf16;
    EXPECT_TRUE(bad_v.rejected_with({"v must have dtype float16, got bfloat16"}));
    AttentionCall bad_out = jagged_kv ? jagged() : dense();
    bad_out.out.dtype = DType::f32;
    EXPECT_TRUE(bad_out.rejected_with({"out must have dtype float16, got float32"}));
  }
}

TEST_P(AttentionValidation, HeadDimMustBe64Or128Or256) {
  constexpr std::int64_t unsupported = 96;
  const std::int64_t b = AttentionOperands::num_candidates, s = AttentionOperands::seq_len;
  const std::int64_t h = AttentionOperands::heads, n = AttentionOperands::n_seed;
  const auto dtype = AttentionOperands::dtype;
  const auto q = DeviceTensor::filled(device(), dtype, {b, n, h, unsupported}, 0.5);
  const auto k =
      DeviceTensor::filled(device(), dtype, {AttentionOperands::num_users, s, h, unsupported}, 0.5);
  const auto v =
      DeviceTensor::filled(device(), dtype, {AttentionOperands::num_users, s, h, unsupported}, 0.5);
  const auto out = DeviceTensor::filled(device(), dtype, {b, n, h, unsupported}, -7.0);
  AttentionCall bad = dense();
  bad.q = q.view();
  bad.k = k.view();
  bad.v = v.view();
  bad.out = out.view();
  bad.out_buffer = &out.buffer();
  EXPECT_TRUE(bad.rejected_with({"q dimension 3 (head dim D) must be 64, 128 or 256, got 96"}));
}

TEST_P(AttentionValidation, NSeedMustBePositive) {
  AttentionCall bad = dense();
  bad.q.shape[1] = 0;
  bad.out.shape[1] = 0;
  EXPECT_TRUE(bad.rejected_with({"q dimension 1 (n_seed) must be >= 1, got 0"}));
}

TEST_P(AttentionValidation, KvMustMatchHeadsAndHeadDimOfQ) {
  AttentionCall wrong_heads = dense();
  wrong_heads.k.shape[2] -= 1;
  EXPECT_TRUE(wrong_heads.rejected_with({"k dimension 2 must be 2 (H of q), got 1"}));
  AttentionCall wrong_head_dim = jagged();
  wrong_head_dim.k.shape[2] = 128;
  EXPECT_TRUE(wrong_head_dim.rejected_with({"k dimension 2 must be 64 (D of q), got 128"}));
  AttentionCall v_differs = dense();
  v_differs.v.shape[1] -= 1;
  EXPECT_TRUE(
      v_differs.rejected_with({"v must have shape [2, 7, 2, 64] (the shape of k), got "
                               "[2, 6, 2, 64]"}));
}

TEST_P(AttentionValidation, KvRankMustMatchDenseOrJagged) {
  AttentionCall jagged_k_without_offsets = dense();
  jagged_k_without_offsets.k = operands().k_rows.view();
  EXPECT_TRUE(jagged_k_without_offsets.rejected_with({"k must have 4 dimensions, got 3"}));
  AttentionCall dense_k_with_offsets = jagged();
  dense_k_with_offsets.k = operands().k.view();
  EXPECT_TRUE(dense_k_with_offsets.rejected_with({"k must have 3 dimensions, got 4"}));
}

TEST_P(AttentionValidation, OutMustHaveTheShapeOfQ) {
  AttentionCall bad = jagged();
  bad.out.shape[1] -= 1;
  EXPECT_TRUE(
      bad.rejected_with({"out must have shape [4, 3, 2, 64] (the shape of q), got "
                         "[4, 2, 2, 64]"}));
}

TEST_P(AttentionValidation, OffsetsMustHaveOneEntryPerUserPlusOne) {
  const auto three_users = AttentionOperands::make_offsets(device(), {0, 3, 5, 7}, 7);
  AttentionCall bad = jagged();
  bad.kv_offsets = &three_users;
  EXPECT_TRUE(bad.rejected_with({"kv_offsets must have num_users + 1 = 3 entries, got 4"}));
}

TEST_P(AttentionValidation, OffsetsTotalMustMatchKvRows) {
  const auto fewer_rows = AttentionOperands::make_offsets(device(), {0, 3, 6}, 6);
  AttentionCall bad = jagged();
  bad.kv_offsets = &fewer_rows;
  EXPECT_TRUE(bad.rejected_with({"k dimension 0 must be 6 (kv_offsets[num_users]), got 7"}));
}

TEST_P(AttentionValidation, NullDataPointersAreRejected) {
  for (bool jagged_kv : {false, true}) {
    SCOPED_TRACE(jagged_kv ? "jagged K/V" : "dense K/V");
    AttentionCall null_q = jagged_kv ? jagged() : dense();
    null_q.q.data = nullptr;
    EXPECT_TRUE(null_q.rejected_with({"q is a null pointer"}));
    AttentionCall null_k = jagged_kv ? jagged() : dense();
    null_k.k.data = nullptr;
    EXPECT_TRUE(null_k.rejected_with({"k is a null pointer"}));
    AttentionCall null_v = jagged_kv ? jagged() : dense();
    null_v.v.data = nullptr;
    EXPECT_TRUE(null_v.rejected_with({"v is a null pointer"}));
    AttentionCall null_out = jagged_kv ? jagged() : dense();
    null_out.out.data = nullptr;
    EXPECT_TRUE(null_out.rejected_with({"out is a null pointer"}));
  }
}

TEST_P(AttentionValidation, ShapesBeyondTheIndexableRangeAreRejected) {
  const auto dtype = AttentionOperands::dtype;
  AttentionCall huge_extent = dense();
  huge_extent.k = Tensor(huge_extent.k.data, dtype, {kHugeExtent, kHugeExtent, 1, 64}, device());
  EXPECT_TRUE(huge_extent.rejected_with(
      {"k dimension 0 = 1099511627776 exceeds the largest supported extent"}));
  AttentionCall overflowing_count = dense();
  overflowing_count.q =
      Tensor(overflowing_count.q.data, dtype, {kLargeExtent, kLargeExtent, 2, 64}, device());
  EXPECT_TRUE(overflowing_count.rejected_with(
      {"q shape [1073741824, 1073741824, 2, 64] has more elements than"}));
}

// fp32 K and V are multiplied in place on the CPU, a head's rows H * D apart.
TEST_P(AttentionValidation, HeadRowsBeyondTheBlasIndexRangeAreRejectedOnTheCpu) {
  if (device().is_cuda()) GTEST_SKIP() << "the BLAS index range is the CPU backend's limit";
  constexpr std::int64_t heads = std::int64_t{1} << 23, head_dim = 256;  // H * D = 2^31
  AttentionCall wide = dense();
  const auto view = [&](const Tensor& tensor, std::int64_t rows, std::int64_t inner) {
    return Tensor(tensor.data, DType::f32, {tensor.size(0), rows, inner, head_dim}, device());
  };
  wide.q = view(wide.q, AttentionOperands::n_seed, heads);
  wide.k = view(wide.k, AttentionOperands::seq_len, heads);
  wide.v = view(wide.v, AttentionOperands::seq_len, heads);
  wide.out = view(wide.out, AttentionOperands::n_seed, heads);
  EXPECT_TRUE(wide.rejected_with(
      {"H * D of q = 2147483648 exceeds what the CPU backend's BLAS indexes"}));
}

TEST_P(AttentionValidation, ScaleMustBeFinite) {
  for (float scale :
       {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
        -std::numeric_limits<float>::infinity()}) {
    AttentionCall bad = jagged();
    bad.scale = scale;
    EXPECT_TRUE(bad.rejected_with({"scale must be finite"})) << "scale " << scale;
  }
}

TEST_P(AttentionValidation, OutMustNotAliasAnInput) {
  AttentionCall aliased = dense();
  aliased.out.data = aliased.q.data;
  EXPECT_TRUE(throws_invalid_argument([&] { aliased(); }, {"out overlaps q"},
                                      {&operands().q.buffer(), &operands().out.buffer()}));
}

TEST_P(AttentionValidation, TensorsMustBeOnTheDeviceOfQ) {
  const std::string own = device_name(device());
  const std::string elsewhere = device_name(other_device(device()));
  AttentionCall bad_k = dense();
  bad_k.k.device = other_device(device());
  EXPECT_TRUE(bad_k.rejected_with({"k must be on " + own + ", got " + elsewhere}));
  AttentionCall bad_out = jagged();
  bad_out.out.device = other_device(device());
  EXPECT_TRUE(bad_out.rejected_with({"out must be on " + own + ", got " + elsewhere}));
}

TEST_P(AttentionValidation, MapAndOffsetsMustBeOnTheDeviceOfQ) {
  IKBO_SKIP_IF_UNAVAILABLE(other_device(device()));
  const std::string own = device_name(device());
  const std::string elsewhere = device_name(other_device(device()));
  const auto map_elsewhere = LceOperands::make_map(
      other_device(device()), AttentionOperands::num_candidates, AttentionOperands::num_users);
  AttentionCall bad_map = dense();
  bad_map.map = &map_elsewhere;
  EXPECT_TRUE(
      bad_map.rejected_with({"the candidate map must be on " + own + " like q, got " + elsewhere}));
  const auto offsets_elsewhere =
      AttentionOperands::make_offsets(other_device(device()), {0, 3, 7}, 7);
  AttentionCall bad_offsets = jagged();
  bad_offsets.kv_offsets = &offsets_elsewhere;
  EXPECT_TRUE(
      bad_offsets.rejected_with({"kv_offsets must be on " + own + " like q, got " + elsewhere}));
}

INSTANTIATE_TEST_SUITE_P(Devices, AttentionValidation, testing::ValuesIn(test_devices()),
                         device_param_name);

}  // namespace
}  // namespace ikbo::test
