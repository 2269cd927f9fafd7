// attention against the fp64 reference, on every device and dtype: dense and
// jagged K/V, the broadcast baseline (replicate_kv + attention with the
// identity map), and B = 0.
// Covers n_seed in {1, 37, 64}, S in {1, 500, 777}, H in {1, 2, 3},
// D in {64, 128, 256}, unsorted and uneven maps with users without candidates,
// empty user histories (their outputs must be exact zeros), the default
// scale 1/sqrt(D) and explicit scales; histories of 1025/1026 and 8192/8193
// keys, where the CPU's tile areas are not monotone in the length; and keys
// of -inf, which get weight 0.
#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <tuple>
#include <vector>

#include "baselines.hpp"
#include "device_harness.hpp"

namespace ikbo::test {
namespace {

const std::vector<AttentionCase>& attention_cases() {
  static const std::vector<AttentionCase> cases = {
      {"dense_seed1_s1_h1_d64", 4, 2, 1, 1, 64, 1, {}, MapOrder::sorted, std::nullopt},
      // Dense K/V of no keys: every candidate gets zeros.
      {"dense_seed3_s0_h2_d64_no_keys", 5, 2, 3, 2, 64, 0, {}, MapOrder::unsorted, std::nullopt},
      {"dense_seed37_s500_h2_d128_unsorted",
       5,
       2,
       37,
       2,
       128,
       500,
       {},
       MapOrder::unsorted,
       std::nullopt},
      {"dense_seed64_s777_h3_d64_uneven_empty_users",
       7,
       4,
       64,
       3,
       64,
       777,
       {},
       MapOrder::uneven_unsorted,
       std::nullopt},
      {"dense_seed64_s500_h1_d128_one_user",
       3,
       1,
       64,
       1,
       128,
       500,
       {},
       MapOrder::sorted,
       std::nullopt},
      {"dense_seed1_s777_h2_d128_one_candidate_per_user",
       4,
       4,
       1,
       2,
       128,
       777,
       {},
       MapOrder::unsorted,
       std::nullopt},
      {"dense_seed37_s500_h1_d64_scale_0p5", 4, 2, 37, 1, 64, 500, {}, MapOrder::unsorted, 0.5f},
      {"dense_seed37_s500_h2_d256_uneven_empty_users",
       7,
       4,
       37,
       2,
       256,
       500,
       {},
       MapOrder::uneven_unsorted,
       std::nullopt},
      {"jagged_seed64_h2_d128_unsorted",
       6,
       4,
       64,
       2,
       128,
       0,
       {500, 0, 777, 1},
       MapOrder::unsorted,
       std::nullopt},
      {"jagged_seed37_h3_d64_uneven_empty_users",
       8,
       5,
       37,
       3,
       64,
       0,
       {0, 63, 777, 0, 500},
       MapOrder::uneven_unsorted,
       std::nullopt},
      {"jagged_seed1_h1_d64_sorted", 3, 2, 1, 1, 64, 0, {1, 777}, MapOrder::sorted, std::nullopt},
      {"jagged_seed64_h1_d256_unsorted",
       6,
       4,
       64,
       1,
       256,
       0,
       {500, 0, 777, 63},
       MapOrder::unsorted,
       std::nullopt},
      {"jagged_all_histories_empty",
       4,
       3,
       2,
       2,
       64,
       0,
       {0, 0, 0},
       MapOrder::unsorted,
       std::nullopt},
      {"jagged_seed64_h2_d128_scale_0p3",
       5,
       3,
       64,
       2,
       128,
       0,
       {500, 0, 64},
       MapOrder::unsorted,
       0.3f},
      // The CPU's row tiles shrink with the history (1023 rows at 1025 keys,
      // 1022 at 1026), so the shorter history has the larger score tile
      // (1023 * 1025 > 1022 * 1026 elements). Sizing the scores from the
      // longest history once overflowed them; 1024 query rows per user.
      {"jagged_seed64_h1_d64_tile_area_1025_1026",
       32,
       2,
       64,
       1,
       64,
       0,
       {1025, 1026},
       MapOrder::sorted,
       std::nullopt},
      // The same where tiles of 128 rows shrink to 127 (128 query rows per user).
      {"jagged_seed64_h1_d64_tile_area_8192_8193",
       4,
       2,
       64,
       1,
       64,
       0,
       {8192, 8193},
       MapOrder::sorted,
       std::nullopt},
  };
  return cases;
}

std::vector<std::int32_t> as_int32(const std::vector<std::int64_t>& values) {
  return std::vector<std::int32_t>(values.begin(), values.end());
}

// Runs ikbo::attention for `inputs` on `device` into a poisoned output and
// returns what it wrote.
std::vector<double> run_attention(Device device, const AttentionCase& test_case,
                                  const AttentionInputs& inputs) {
  const DeviceTensor q(device, inputs.q), k(device, inputs.k), v(device, inputs.v);
  const auto map = CandidateMap::build(inputs.cand_to_user.data(), test_case.num_candidates,
                                       test_case.num_users, device);
  std::optional<JaggedOffsets> kv_offsets;
  if (test_case.jagged()) {
    const auto offsets = as_int32(inputs.kv_offsets);
    kv_offsets = JaggedOffsets::build(offsets.data(), test_case.num_users, offsets.back(), device);
  }
  const auto out = DeviceTensor::poisoned(device, inputs.q.dtype, inputs.q.shape);
  attention(q.view(), k.view(), v.view(), map, out.view(), kv_offsets ? &*kv_offsets : nullptr,
            test_case.scale);
  return out.values();
}

using AttentionParam = std::tuple<Device, DType, AttentionCase>;

class AttentionVsReference : public testing::TestWithParam<AttentionParam> {
 protected:
  void SetUp() override { IKBO_SKIP_IF_UNAVAILABLE(device()); }
  Device device() const { return std::get<0>(GetParam()); }
  DType dtype() const { return std::get<1>(GetParam()); }
  const AttentionCase& attention_case() const { return std::get<2>(GetParam()); }
};

TEST_P(AttentionVsReference, IkboMatchesFp64Reference) {
  SeededRng rng;
  const AttentionCase& test_case = attention_case();
  const AttentionInputs inputs = random_attention_inputs(rng, dtype(), test_case);
  const std::vector<double> actual = run_attention(device(), test_case, inputs);
  EXPECT_TRUE(matches_reference(actual, inputs.expected(), dtype()));
  EXPECT_TRUE(empty_histories_give_zeros(inputs, actual));
}

// The broadcast baseline replicates dense K/V only: it runs on the dense cases.
class AttentionBaselineVsReference : public AttentionVsReference {};

TEST_P(AttentionBaselineVsReference, BroadcastBaselineMatchesFp64Reference) {
  const AttentionCase& test_case = attention_case();
  SeededRng rng;
  const AttentionInputs inputs = random_attention_inputs(rng, dtype(), test_case);
  const DeviceTensor q(device(), inputs.q), k(device(), inputs.k), v(device(), inputs.v);
  const auto map = CandidateMap::build(inputs.cand_to_user.data(), test_case.num_candidates,
                                       test_case.num_users, device());
  const std::vector<std::int64_t> full_shape = {test_case.num_candidates, test_case.seq_len,
                                                test_case.heads, test_case.head_dim};
  const auto k_full = DeviceTensor::poisoned(device(), dtype(), full_shape);
  const auto v_full = DeviceTensor::poisoned(device(), dtype(), full_shape);
  baseline::replicate_kv(k.view(), map, k_full.view());
  baseline::replicate_kv(v.view(), map, v_full.view());

  // The copies are exact: row b is the user's block.
  const std::int64_t user_block = test_case.seq_len * test_case.heads * test_case.head_dim;
  std::vector<double> expected_k_full, expected_v_full;
  for (std::int32_t user : inputs.cand_to_user) {
    const auto first = user * user_block;
    expected_k_full.insert(expected_k_full.end(), inputs.k.values.begin() + first,
                           inputs.k.values.begin() + first + user_block);
    expected_v_full.insert(expected_v_full.end(), inputs.v.values.begin() + first,
                           inputs.v.values.begin() + first + user_block);
  }
  EXPECT_TRUE(exactly_equal(k_full.values(), expected_k_full));
  EXPECT_TRUE(exactly_equal(v_full.values(), expected_v_full));

  const auto identity = CandidateMap::identity(test_case.num_candidates, device());
  const auto out = DeviceTensor::poisoned(device(), dtype(), inputs.q.shape);
  attention(q.view(), k_full.view(), v_full.view(), identity, out.view(), nullptr, test_case.scale);
  EXPECT_TRUE(matches_reference(out.values(), inputs.expected(), dtype()));
}

std::string attention_param_name(const testing::TestParamInfo<AttentionParam>& info) {
  return device_label(std::get<0>(info.param)) + "_" + dtype_label(std::get<1>(info.param)) + "_" +
         std::get<2>(info.param).name;
}

INSTANTIATE_TEST_SUITE_P(Shapes, AttentionVsReference,
                         testing::Combine(testing::ValuesIn(test_devices()),
                                          testing::ValuesIn(float_dtypes()),
                                          testing::ValuesIn(attention_cases())),
                         attention_param_name);

std::vector<AttentionCase> dense_attention_cases() {
  std::vector<AttentionCase> dense;
  for (const AttentionCase& test_case : attention_cases()) {
    if (!test_case.jagged()) dense.push_back(test_case);
  }
  return dense;
}

INSTANTIATE_TEST_SUITE_P(Shapes, AttentionBaselineVsReference,
                         testing::Combine(testing::ValuesIn(test_devices()),
                                          testing::ValuesIn(float_dtypes()),
                                          testing::ValuesIn(dense_attention_cases())),
                         attention_param_name);

class AttentionRandomShapes : public DeviceDtypeTest {};

// Fresh random shapes on every run (the seed is printed on failure).
TEST_P(AttentionRandomShapes, MatchFp64Reference) {
  SeededRng rng;
  for (int trial = 0; trial < 8; ++trial) {
    AttentionCase test_case{"random",
                            rng.uniform_int(1, 12),
                            rng.uniform_int(1, 5),
                            rng.uniform_int(1, 70),
                            rng.uniform_int(1, 4),
                            std::int64_t{64} << rng.uniform_int(0, 2),  // D = 64, 128, 256
                            0,
                            {},
                            static_cast<MapOrder>(rng.uniform_int(0, 3)),
                            std::nullopt};
    if (rng.uniform_int(0, 1)) {
      for (std::int64_t u = 0; u < test_case.num_users; ++u) {
        test_case.user_lengths.push_back(rng.uniform_int(0, 3) ? rng.uniform_int(1, 300) : 0);
      }
    } else {
      test_case.seq_len = rng.uniform_int(1, 300);
    }
    if (rng.uniform_int(0, 1)) test_case.scale = static_cast<float>(rng.uniform(0.01, 0.5));
    testing::Message description;
    description << "trial " << trial << ": B=" << test_case.num_candidates
                << " U=" << test_case.num_users << " n_seed=" << test_case.n_seed
                << " H=" << test_case.heads << " D=" << test_case.head_dim << " "
                << map_order_name(test_case.order);
    if (test_case.jagged()) {
      description << " jagged lengths " << shape_text(test_case.user_lengths);
    } else {
      description << " dense S=" << test_case.seq_len;
    }
    if (test_case.scale) description << " scale=" << *test_case.scale;
    SCOPED_TRACE(description);
    const AttentionInputs inputs = random_attention_inputs(rng, dtype(), test_case);
    const std::vector<double> actual = run_attention(device(), test_case, inputs);
    EXPECT_TRUE(matches_reference(actual, inputs.expected(), dtype()));
    EXPECT_TRUE(empty_histories_give_zeros(inputs, actual));
  }
}

INSTANTIATE_TEST_SUITE_P(Devices, AttentionRandomShapes,
                         testing::Combine(testing::ValuesIn(test_devices()),
                                          testing::ValuesIn(float_dtypes())),
                         device_dtype_param_name);

class AttentionMinusInfinityKeys : public DeviceDtypeTest {};

// A key row of -inf against positive queries scores -inf: its softmax
// weight is exp(-inf) = 0, as for a key past the user's end, and the other
// keys are unaffected (the CPU's exp2 once made it NaN: -inf - round(-inf)),
// also where every key of the first K/V blocks scores -inf (the kernels'
// running maximum was -inf there, and their first correction NaN). A user
// whose every key scores -inf gets zeros, as one without keys does.
TEST_P(AttentionMinusInfinityKeys, GetZeroWeight) {
  const std::vector<AttentionCase> cases{
      {"jagged", 7, 3, 3, 2, 64, 0, {300, 40, 7}, MapOrder::unsorted, std::nullopt},
      {"dense", 7, 3, 3, 2, 64, 300, {}, MapOrder::unsorted, std::nullopt}};
  for (const AttentionCase& test_case : cases) {
    SCOPED_TRACE(test_case.name);
    SeededRng rng;
    AttentionInputs inputs = random_attention_inputs(rng, dtype(), test_case);
    const std::int64_t last_user_keys = test_case.jagged() ? 7 : 300;
    const std::vector<KeyRange> ranges{{0, 0, 200}, {1, 0, test_case.jagged() ? 40 : 300},
                                       {2, 2, 1}, {2, last_user_keys - 1, 1}};
    set_minus_infinity_keys(inputs, dtype(), ranges);
    const std::vector<double> expected = inputs.expected();
    const std::vector<double> actual = run_attention(device(), test_case, inputs);
    EXPECT_TRUE(matches_reference_per_candidate(actual, expected, inputs, dtype()));
  }
}

INSTANTIATE_TEST_SUITE_P(Devices, AttentionMinusInfinityKeys,
                         testing::Combine(testing::ValuesIn(test_devices()),
                                          testing::ValuesIn(float_dtypes())),
                         device_dtype_param_name);

class AttentionNoCandidates : public DeviceTest {};

// B = 0 is valid for dense and jagged K/V: nothing is computed or written.
TEST_P(AttentionNoCandidates, ZeroCandidatesIsANoOp) {
  SeededRng rng;
  const std::int64_t num_users = 2, n_seed = 3, heads = 2, head_dim = 64, seq_len = 5;
  const auto map = CandidateMap::build(nullptr, 0, num_users, device());
  const Tensor q(nullptr, DType::f16, {0, n_seed, heads, head_dim}, device());
  const auto guard = DeviceTensor::poisoned(device(), DType::f16, {n_seed, heads, head_dim});
  const Tensor out(guard.buffer().data(), DType::f16, {0, n_seed, heads, head_dim}, device());
  const auto guard_before = guard.bytes();

  const DeviceTensor k(device(), rng.tensor(DType::f16, {num_users, seq_len, heads, head_dim}));
  const DeviceTensor v(device(), rng.tensor(DType::f16, {num_users, seq_len, heads, head_dim}));
  EXPECT_NO_THROW(attention(q, k.view(), v.view(), map, out));
  EXPECT_EQ(guard.bytes(), guard_before);

  const std::vector<std::int32_t> offsets = {0, 2, 5};
  const auto kv_offsets = JaggedOffsets::build(offsets.data(), num_users, 5, device());
  const DeviceTensor k_rows(device(), rng.tensor(DType::f16, {5, heads, head_dim}));
  const DeviceTensor v_rows(device(), rng.tensor(DType::f16, {5, heads, head_dim}));
  EXPECT_NO_THROW(attention(q, k_rows.view(), v_rows.view(), map, out, &kv_offsets));
  EXPECT_EQ(guard.bytes(), guard_before);
}

INSTANTIATE_TEST_SUITE_P(Devices, AttentionNoCandidates, testing::ValuesIn(test_devices()),
                         device_param_name);

}  // namespace
}  // namespace ikbo::test
