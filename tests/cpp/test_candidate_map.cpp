// CandidateMap and JaggedOffsets: the derived per-user arrays of hand-checked
// and random maps (on the host and in the device copy), and the validation
// errors of building them.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "device_harness.hpp"

namespace ikbo::test {
namespace {

using Ints = std::vector<std::int32_t>;

template <typename T>
Ints to_vector(std::span<const T> values) {
  return Ints(values.begin(), values.end());
}

// A map and what building it must derive.
struct KnownMap {
  const char* name;
  Ints cand_to_user;
  std::int64_t num_users;
  Ints user_counts;
  Ints user_offsets;
  Ints candidates_by_user;
  bool sorted;
  std::int64_t max_count;
};

const std::vector<KnownMap>& known_maps() {
  static const std::vector<KnownMap> maps = {
      {"sorted", {0, 0, 1, 1, 1, 2}, 3, {2, 3, 1}, {0, 2, 5, 6}, {0, 1, 2, 3, 4, 5}, true, 3},
      {"unsorted", {2, 0, 1, 0, 2, 2}, 3, {2, 1, 3}, {0, 2, 3, 6}, {1, 3, 2, 0, 4, 5}, false, 3},
      {"uneven_with_empty_users",
       {3, 3, 0, 3, 3},
       5,
       {1, 0, 0, 4, 0},
       {0, 1, 1, 1, 5, 5},
       {2, 0, 1, 3, 4},
       false,
       4},
      {"sorted_with_empty_first_and_last_users",
       {1, 1, 2},
       4,
       {0, 2, 1, 0},
       {0, 0, 2, 3, 3},
       {0, 1, 2},
       true,
       2},
      {"no_candidates", {}, 4, {0, 0, 0, 0}, {0, 0, 0, 0, 0}, {}, true, 0},
      {"one_user", {0, 0, 0, 0, 0, 0, 0}, 1, {7}, {0, 7}, {0, 1, 2, 3, 4, 5, 6}, true, 7},
      {"one_candidate_per_user_permuted",
       {3, 1, 0, 2},
       4,
       {1, 1, 1, 1},
       {0, 1, 2, 3, 4},
       {2, 1, 3, 0},
       false,
       1},
  };
  return maps;
}

void expect_derived_arrays(const CandidateMap& map, const KnownMap& expected) {
  SCOPED_TRACE(expected.name);
  EXPECT_EQ(map.num_candidates(), static_cast<std::int64_t>(expected.cand_to_user.size()));
  EXPECT_EQ(map.num_users(), expected.num_users);
  EXPECT_EQ(to_vector(map.cand_to_user()), expected.cand_to_user);
  EXPECT_EQ(to_vector(map.user_counts()), expected.user_counts);
  EXPECT_EQ(to_vector(map.user_offsets()), expected.user_offsets);
  EXPECT_EQ(to_vector(map.candidates_by_user()), expected.candidates_by_user);
  EXPECT_EQ(map.is_sorted(), expected.sorted);
  EXPECT_EQ(map.max_count(), expected.max_count);
}

// The device copy must hold the same arrays as the host side.
void expect_device_copy_matches(const CandidateMap& map) {
  if (!map.device().is_cuda()) {
    EXPECT_TRUE(throws_invalid_argument([&] { map.device_view(); }, {"no CUDA copy"}));
    return;
  }
  const CandidateMapDeviceView& view = map.device_view();
  const auto b = static_cast<std::size_t>(map.num_candidates());
  const auto u = static_cast<std::size_t>(map.num_users());
  EXPECT_EQ(read_int32(view.cand_to_user, b, map.device()), to_vector(map.cand_to_user()));
  EXPECT_EQ(read_int32(view.user_offsets, u + 1, map.device()), to_vector(map.user_offsets()));
  EXPECT_EQ(read_int32(view.candidates_by_user, b, map.device()),
            to_vector(map.candidates_by_user()));
}

class CandidateMapOnDevice : public DeviceTest {};

TEST_P(CandidateMapOnDevice, DerivesGroupsOfKnownMapsFromHostArray) {
  for (const KnownMap& known : known_maps()) {
    auto map = CandidateMap::build(known.cand_to_user.data(),
                                   static_cast<std::int64_t>(known.cand_to_user.size()),
                                   known.num_users, device());
    EXPECT_EQ(map.device(), device());
    expect_derived_arrays(map, known);
    expect_device_copy_matches(map);
  }
}

TEST_P(CandidateMapOnDevice, DerivesGroupsOfKnownMapsFromTensor) {
  for (const KnownMap& known : known_maps()) {
    const auto cand_to_user = DeviceTensor::int32(device(), known.cand_to_user);
    auto map = CandidateMap::build(cand_to_user.view(), known.num_users);
    EXPECT_EQ(map.device(), device());
    expect_derived_arrays(map, known);
    expect_device_copy_matches(map);
  }
}

TEST_P(CandidateMapOnDevice, IdentityGivesEveryCandidateItsOwnUser) {
  auto map = CandidateMap::identity(6, device());
  expect_derived_arrays(map, {"identity",
                              {0, 1, 2, 3, 4, 5},
                              6,
                              {1, 1, 1, 1, 1, 1},
                              {0, 1, 2, 3, 4, 5, 6},
                              {0, 1, 2, 3, 4, 5},
                              true,
                              1});
  expect_device_copy_matches(map);
}

// Multi-level: candidates -> groups (group 4 has none) -> users (user 3 has
// no group), both unsorted; composed from the levels' maps and built from
// the level tensors.
TEST_P(CandidateMapOnDevice, TwoLevelsMapEachCandidateToItsGroupsUser) {
  const Ints to_group = {3, 1, 3, 0, 2}, group_to_user = {2, 0, 2, 1, 0};
  const KnownMap expected = {
      "two_levels", {1, 0, 1, 2, 2}, 4, {1, 2, 2, 0}, {0, 1, 3, 5, 5}, {1, 0, 2, 3, 4}, false, 2};
  auto candidates = CandidateMap::build(to_group.data(), 5, 5, device());
  auto groups = CandidateMap::build(group_to_user.data(), 5, 4, device());
  const auto cand_to_group = DeviceTensor::int32(device(), to_group);
  const auto group_tensor = DeviceTensor::int32(device(), group_to_user);
  const std::vector<Tensor> levels = {group_tensor.view()};
  for (const auto& map : {CandidateMap::compose(candidates, groups),
                          CandidateMap::build(cand_to_group.view(), levels, 4)}) {
    EXPECT_EQ(map.device(), device());
    expect_derived_arrays(map, expected);
    expect_device_copy_matches(map);
  }
  // No candidates: a map of none to the same users.
  auto none = CandidateMap::compose(CandidateMap::build(nullptr, 0, 5, device()), groups);
  expect_derived_arrays(
      none, {"composed_empty", {}, 4, {0, 0, 0, 0}, {0, 0, 0, 0, 0}, {}, true, 0});
}

// Three random levels: the composition is cand_to_user's chain of lookups,
// and associative; built from the level tensors, the same map.
TEST_P(CandidateMapOnDevice, ComposeFollowsEveryLevelOfRandomMaps) {
  SeededRng rng;
  const std::int64_t items = 500, vendors = 61, users = 7, requests = 3;
  const Ints item_vendor = rng.candidate_map(items, vendors, MapOrder::uneven_unsorted);
  const Ints vendor_user = rng.candidate_map(vendors, users, MapOrder::uneven_unsorted);
  const Ints user_request = rng.candidate_map(users, requests, MapOrder::uneven_unsorted);
  auto first = CandidateMap::build(item_vendor.data(), items, vendors, device());
  auto second = CandidateMap::build(vendor_user.data(), vendors, users, device());
  auto third = CandidateMap::build(user_request.data(), users, requests, device());
  auto to_users = CandidateMap::compose(first, second);
  Ints expected(items);
  for (std::int64_t b = 0; b < items; ++b) expected[b] = vendor_user[item_vendor[b]];
  EXPECT_EQ(to_vector(to_users.cand_to_user()), expected);
  EXPECT_EQ(to_users.num_users(), users);
  expect_device_copy_matches(to_users);
  const auto left = CandidateMap::compose(to_users, third);
  const auto right = CandidateMap::compose(first, CandidateMap::compose(second, third));
  for (std::int64_t b = 0; b < items; ++b) expected[b] = user_request[expected[b]];
  EXPECT_EQ(to_vector(left.cand_to_user()), expected);
  EXPECT_EQ(to_vector(right.cand_to_user()), expected);
  EXPECT_EQ(to_vector(left.candidates_by_user()), to_vector(right.candidates_by_user()));
  const auto items_tensor = DeviceTensor::int32(device(), item_vendor);
  const auto vendors_tensor = DeviceTensor::int32(device(), vendor_user);
  const auto users_tensor = DeviceTensor::int32(device(), user_request);
  const std::vector<Tensor> levels = {vendors_tensor.view(), users_tensor.view()};
  const auto built = CandidateMap::build(items_tensor.view(), levels, requests);
  EXPECT_EQ(to_vector(built.cand_to_user()), expected);
  EXPECT_EQ(to_vector(built.user_offsets()), to_vector(left.user_offsets()));
  EXPECT_EQ(to_vector(built.candidates_by_user()), to_vector(left.candidates_by_user()));
  EXPECT_EQ(built.is_sorted(), left.is_sorted());
  EXPECT_EQ(built.max_count(), left.max_count());
  expect_device_copy_matches(built);
  // No levels: the one-level build.
  EXPECT_EQ(to_vector(CandidateMap::build(items_tensor.view(), {}, vendors).cand_to_user()),
            item_vendor);
}

TEST_P(CandidateMapOnDevice, ComposeRejectsLevelsThatDoNotMeet) {
  const Ints to_group = {0, 4, 1}, group_to_user = {0, 1, 1, 0};
  auto candidates = CandidateMap::build(to_group.data(), 3, 5, device());
  auto groups = CandidateMap::build(group_to_user.data(), 4, 2, device());
  EXPECT_TRUE(throws_invalid_argument(
      [&] { CandidateMap::compose(candidates, groups); },
      {"group_to_user must map the 5 groups of to_group (its num_candidates), got "
       "num_candidates = 4"}));
  if (device().is_cuda()) {
    const Ints five_groups = {0, 1, 1, 0, 1};
    auto on_host = CandidateMap::build(five_groups.data(), 5, 2);
    EXPECT_TRUE(throws_invalid_argument(
        [&] { CandidateMap::compose(candidates, on_host); },
        {"to_group and group_to_user must be on one device, got cuda:", " and cpu"}));
  }
}

TEST_P(CandidateMapOnDevice, BuildFromLevelsNamesTheLevelThatIsWrong) {
  const auto cand_to_group = DeviceTensor::int32(device(), Ints{0, 2, 1});
  const auto three_groups = DeviceTensor::int32(device(), Ints{1, 0, 1});
  const auto check = [&](std::vector<Tensor> levels, std::int64_t num_users,
                         std::initializer_list<std::string_view> expected) {
    return throws_invalid_argument(
        [&] { CandidateMap::build(cand_to_group.view(), levels, num_users); }, expected);
  };
  // Every entry of a level is checked, including groups no candidate reaches.
  const auto four_groups = DeviceTensor::int32(device(), Ints{0, 1, 1, 5});
  EXPECT_TRUE(check({four_groups.view()}, 2, {"levels[0][3] = 5 is out of range [0, 2)"}));
  const auto two_groups = DeviceTensor::int32(device(), Ints{0, 1});
  EXPECT_TRUE(check({two_groups.view()}, 2, {"cand_to_user[1] = 2 is out of range [0, 2)"}));
  EXPECT_TRUE(check({three_groups.view(), two_groups.view()}, 1,
                    {"levels[1][1] = 1 is out of range [0, 1)"}));
  const auto no_groups = DeviceTensor::int32(device(), Ints{});
  EXPECT_TRUE(check({no_groups.view()}, 2,
                    {"levels[0] has no entries, but the candidates reach the users through it"}));
  EXPECT_TRUE(check({three_groups.view()}, 0, {"num_users must be in [1, ", "got 0"}));
  Tensor as_float = three_groups.view();
  as_float.dtype = DType::f32;
  EXPECT_TRUE(check({three_groups.view(), as_float}, 2,
                    {"levels[1] must have dtype int32, got float32"}));
  Tensor as_matrix(three_groups.view().data, DType::i32, {1, 3}, device());
  EXPECT_TRUE(check({as_matrix}, 2, {"levels[0] must have 1 dimension"}));
  if (device().is_cuda()) {
    const Ints on_host = {1, 0, 1};
    const Tensor host_level(const_cast<std::int32_t*>(on_host.data()), DType::i32, {3},
                            Device::cpu());
    EXPECT_TRUE(
        check({host_level}, 2, {"levels[0] must be on cuda:", "like cand_to_user, got cpu"}));
  }
  // A request without candidates reads no level, though each is checked as a tensor.
  const auto none = DeviceTensor::int32(device(), Ints{});
  auto empty = CandidateMap::build(none.view(), std::vector<Tensor>{no_groups.view()}, 3);
  EXPECT_EQ(empty.num_candidates(), 0);
  EXPECT_EQ(empty.num_users(), 3);
  EXPECT_TRUE(throws_invalid_argument(
      [&] { CandidateMap::build(none.view(), std::vector<Tensor>{as_matrix}, 3); },
      {"levels[0] must have 1 dimension"}));
}

// Checks every derived array of a large random map against its definition.
TEST_P(CandidateMapOnDevice, RandomUnevenUnsortedMapSatisfiesInvariants) {
  SeededRng rng;
  const std::int64_t num_candidates = 1000, num_users = 37;
  const Ints cand_to_user = rng.candidate_map(num_candidates, num_users, MapOrder::uneven_unsorted);
  auto map = CandidateMap::build(cand_to_user.data(), num_candidates, num_users, device());

  Ints counts(num_users, 0);
  for (std::int32_t user : cand_to_user) ++counts[static_cast<std::size_t>(user)];
  EXPECT_EQ(to_vector(map.user_counts()), counts);
  EXPECT_EQ(map.max_count(), *std::max_element(counts.begin(), counts.end()));
  EXPECT_EQ(map.is_sorted(), std::is_sorted(cand_to_user.begin(), cand_to_user.end()));
  for (std::int64_t u = 1; u < num_users; u += 3) {
    EXPECT_EQ(counts[static_cast<std::size_t>(u)], 0)
        << "the uneven map leaves user " << u << " without candidates";
  }

  const auto offsets = map.user_offsets();
  const auto by_user = map.candidates_by_user();
  ASSERT_EQ(offsets.size(), static_cast<std::size_t>(num_users) + 1);
  EXPECT_EQ(offsets.front(), 0);
  EXPECT_EQ(offsets.back(), num_candidates);
  for (std::int64_t u = 0; u < num_users; ++u) {
    const auto begin = offsets[static_cast<std::size_t>(u)];
    const auto end = offsets[static_cast<std::size_t>(u) + 1];
    EXPECT_EQ(end - begin, counts[static_cast<std::size_t>(u)]) << "user " << u;
    for (auto slot = begin; slot < end; ++slot) {
      const auto candidate = by_user[static_cast<std::size_t>(slot)];
      EXPECT_EQ(cand_to_user[static_cast<std::size_t>(candidate)], u) << "slot " << slot;
      if (slot > begin) {
        EXPECT_LT(by_user[static_cast<std::size_t>(slot) - 1], candidate)
            << "the grouping must be stable (slot " << slot << ")";
      }
    }
  }
  expect_device_copy_matches(map);
}

TEST_P(CandidateMapOnDevice, JaggedOffsetsKeepsValidOffsets) {
  const Ints offsets = {0, 3, 3, 10};
  for (bool from_tensor : {false, true}) {
    SCOPED_TRACE(from_tensor ? "built from a tensor" : "built from a host array");
    const auto offsets_tensor = DeviceTensor::int32(device(), offsets);
    auto jagged = from_tensor ? JaggedOffsets::build(offsets_tensor.view(), 10)
                              : JaggedOffsets::build(offsets.data(), 3, 10, device());
    EXPECT_EQ(jagged.num_users(), 3);
    EXPECT_EQ(jagged.total_rows(), 10);
    EXPECT_EQ(jagged.max_length(), 7);
    EXPECT_EQ(jagged.device(), device());
    EXPECT_EQ(to_vector(jagged.host()), offsets);
    if (device().is_cuda()) {
      EXPECT_EQ(read_int32(jagged.device_data(), offsets.size(), device()), offsets);
    } else {
      EXPECT_TRUE(throws_invalid_argument([&] { jagged.device_data(); }, {"no CUDA copy"}));
    }
  }
}

TEST_P(CandidateMapOnDevice, OutOfRangeEntryErrorNamesTheFirstBadPosition) {
  Ints cand_to_user(32, 3);
  cand_to_user[17] = 40;
  cand_to_user[20] = -1;
  EXPECT_TRUE(
      throws_invalid_argument([&] { CandidateMap::build(cand_to_user.data(), 32, 15, device()); },
                              {"cand_to_user[17] = 40 is out of range [0, 15)"}));
  const auto as_tensor = DeviceTensor::int32(device(), cand_to_user);
  EXPECT_TRUE(throws_invalid_argument([&] { CandidateMap::build(as_tensor.view(), 15); },
                                      {"cand_to_user[17] = 40 is out of range [0, 15)"}));
}

TEST_P(CandidateMapOnDevice, NegativeEntryErrorNamesTheFirstBadPosition) {
  Ints cand_to_user(32, 0);
  cand_to_user[3] = -2;
  cand_to_user[9] = 15;
  EXPECT_TRUE(
      throws_invalid_argument([&] { CandidateMap::build(cand_to_user.data(), 32, 15, device()); },
                              {"cand_to_user[3] = -2 is out of range [0, 15)"}));
}

TEST_P(CandidateMapOnDevice, EntryEqualToNumUsersIsOutOfRange) {
  const Ints cand_to_user = {0, 1, 2, 3};
  EXPECT_TRUE(
      throws_invalid_argument([&] { CandidateMap::build(cand_to_user.data(), 4, 3, device()); },
                              {"cand_to_user[3] = 3 is out of range [0, 3)"}));
}

TEST_P(CandidateMapOnDevice, RejectsBadSizesAndPointers) {
  const Ints cand_to_user = {0, 0};
  EXPECT_TRUE(throws_invalid_argument(
      [&] { CandidateMap::build(cand_to_user.data(), 2, 0, device()); }, {"num_users", "got 0"}));
  EXPECT_TRUE(
      throws_invalid_argument([&] { CandidateMap::build(cand_to_user.data(), -1, 1, device()); },
                              {"num_candidates", "got -1"}));
  EXPECT_TRUE(throws_invalid_argument([&] { CandidateMap::build(nullptr, 2, 1, device()); },
                                      {"cand_to_user is a null pointer"}));
  // Misaligned int32 entries are refused before they are read.
  const Ints padded = {0, 0, 0};
  const auto* misaligned = reinterpret_cast<const std::int32_t*>(
      reinterpret_cast<const char*>(padded.data()) + 1);
  EXPECT_TRUE(throws_invalid_argument([&] { CandidateMap::build(misaligned, 2, 1, device()); },
                                      {"cand_to_user must be aligned to its element size, 4"}));
  EXPECT_TRUE(throws_invalid_argument([&] { JaggedOffsets::build(misaligned, 1, 0, device()); },
                                      {"kv_offsets must be aligned to its element size, 4"}));
}

TEST_P(CandidateMapOnDevice, RejectsMapTensorOfWrongDtypeOrRank) {
  const Ints cand_to_user = {0, 0, 0, 0};
  const auto as_tensor = DeviceTensor::int32(device(), cand_to_user);
  Tensor as_float = as_tensor.view();
  as_float.dtype = DType::f32;
  EXPECT_TRUE(throws_invalid_argument([&] { CandidateMap::build(as_float, 1); },
                                      {"cand_to_user must have dtype int32, got float32"}));
  Tensor as_matrix(as_tensor.view().data, DType::i32, {2, 2}, device());
  EXPECT_TRUE(throws_invalid_argument([&] { CandidateMap::build(as_matrix, 1); },
                                      {"cand_to_user must have 1 dimension"}));
}

TEST_P(CandidateMapOnDevice, JaggedOffsetsMustStartAtZero) {
  const Ints offsets = {2, 3, 10};
  EXPECT_TRUE(
      throws_invalid_argument([&] { JaggedOffsets::build(offsets.data(), 2, 10, device()); },
                              {"kv_offsets[0] must be 0, got 2"}));
}

TEST_P(CandidateMapOnDevice, JaggedOffsetsMustNotDecrease) {
  const Ints offsets = {0, 5, 4, 10};
  EXPECT_TRUE(throws_invalid_argument(
      [&] { JaggedOffsets::build(offsets.data(), 3, 10, device()); },
      {"kv_offsets must be non-decreasing, but kv_offsets[2] = 4 < kv_offsets[1] = 5"}));
}

TEST_P(CandidateMapOnDevice, JaggedOffsetsMustEndAtTotalRows) {
  const Ints offsets = {0, 3, 9};
  EXPECT_TRUE(
      throws_invalid_argument([&] { JaggedOffsets::build(offsets.data(), 2, 10, device()); },
                              {"kv_offsets[2] must equal the number of K/V rows 10, got 9"}));
  const auto as_tensor = DeviceTensor::int32(device(), offsets);
  EXPECT_TRUE(throws_invalid_argument([&] { JaggedOffsets::build(as_tensor.view(), 10); },
                                      {"kv_offsets[2] must equal the number of K/V rows 10"}));
}

TEST_P(CandidateMapOnDevice, JaggedOffsetsRejectsTooFewEntriesAndNull) {
  const Ints single = {0};
  const auto as_tensor = DeviceTensor::int32(device(), single);
  EXPECT_TRUE(throws_invalid_argument([&] { JaggedOffsets::build(as_tensor.view(), 0); },
                                      {"kv_offsets must have num_users + 1 >= 2 entries, got 1"}));
  EXPECT_TRUE(throws_invalid_argument([&] { JaggedOffsets::build(nullptr, 2, 0, device()); },
                                      {"kv_offsets is a null pointer"}));
}

TEST(CandidateMapStorage, DeviceBytesCountTheDeviceArrays) {
  // cand_to_user and candidates_by_user [B], user_offsets [U + 1]; offsets [U + 1].
  EXPECT_EQ(CandidateMap::device_bytes(6, 3), (6 + 6 + 4) * sizeof(std::int32_t));
  EXPECT_EQ(CandidateMap::device_bytes(0, 1), 2 * sizeof(std::int32_t));
  EXPECT_EQ(JaggedOffsets::device_bytes(3), 4 * sizeof(std::int32_t));
  EXPECT_TRUE(throws_invalid_argument([] { CandidateMap::device_bytes(-1, 3); },
                                      {"num_candidates must be in [0, ", "got -1"}));
  EXPECT_TRUE(throws_invalid_argument([] { CandidateMap::device_bytes(6, 0); },
                                      {"num_users must be in [1, ", "got 0"}));
  EXPECT_TRUE(throws_invalid_argument([] { JaggedOffsets::device_bytes(0); },
                                      {"kv_offsets: num_users must be in [1, ", "got 0"}));
}

// Every build writes its device arrays into the caller's storage when given
// one; a CPU map refuses storage.
TEST_P(CandidateMapOnDevice, EveryBuildWritesTheCallersStorage) {
  const KnownMap& known = known_maps()[1];  // unsorted
  const auto b = static_cast<std::int64_t>(known.cand_to_user.size());
  // Two levels that compose to the known map (group 3 has no candidate).
  const Ints to_group = {4, 1, 2, 0, 4, 4}, group_to_user = {0, 0, 1, 1, 2};
  const auto cand_to_user = DeviceTensor::int32(device(), known.cand_to_user);
  const auto cand_to_group = DeviceTensor::int32(device(), to_group);
  const auto groups = DeviceTensor::int32(device(), group_to_user);
  const std::vector<Tensor> levels = {groups.view()};
  const auto candidates = CandidateMap::build(to_group.data(), b, 5, device());
  const auto users = CandidateMap::build(group_to_user.data(), 5, known.num_users, device());
  DeviceBuffer storage(device(), CandidateMap::device_bytes(b, known.num_users));
  const Workspace given{storage.data(), storage.bytes()};
  const std::vector<std::pair<const char*, std::function<CandidateMap()>>> builds = {
      {"host array",
       [&] {
         return CandidateMap::build(known.cand_to_user.data(), b, known.num_users, device(),
                                    nullptr, given);
       }},
      {"tensor", [&] { return CandidateMap::build(cand_to_user.view(), 3, nullptr, given); }},
      {"levels",
       [&] { return CandidateMap::build(cand_to_group.view(), levels, 3, nullptr, given); }},
      {"compose", [&] { return CandidateMap::compose(candidates, users, nullptr, given); }},
  };
  for (const auto& [name, build] : builds) {
    SCOPED_TRACE(name);
    if (!device().is_cuda()) {
      EXPECT_TRUE(throws_invalid_argument(
          build, {"storage must be empty for a CandidateMap on cpu, which has no device arrays, "
                  "got ",
                  " bytes"}));
      continue;
    }
    const CandidateMap map = build();
    EXPECT_EQ(static_cast<const void*>(map.device_view().cand_to_user), storage.data());
    expect_derived_arrays(map, known);
    expect_device_copy_matches(map);
  }
  const Ints offsets = {0, 3, 3, 10};
  const auto offsets_tensor = DeviceTensor::int32(device(), offsets);
  DeviceBuffer offsets_storage(device(), JaggedOffsets::device_bytes(3));
  const Workspace offsets_given{offsets_storage.data(), offsets_storage.bytes()};
  for (bool from_tensor : {false, true}) {
    SCOPED_TRACE(from_tensor ? "offsets from a tensor" : "offsets from a host array");
    const auto build = [&] {
      return from_tensor
                 ? JaggedOffsets::build(offsets_tensor.view(), 10, nullptr, offsets_given)
                 : JaggedOffsets::build(offsets.data(), 3, 10, device(), nullptr, offsets_given);
    };
    if (!device().is_cuda()) {
      EXPECT_TRUE(throws_invalid_argument(
          build, {"storage must be empty for a JaggedOffsets on cpu, which has no device arrays"}));
      continue;
    }
    const JaggedOffsets jagged = build();
    EXPECT_EQ(static_cast<const void*>(jagged.device_data()), offsets_storage.data());
    EXPECT_EQ(read_int32(jagged.device_data(), offsets.size(), device()), offsets);
  }
  if (device().is_cuda()) {
    DeviceBuffer identity_storage(device(), CandidateMap::device_bytes(4, 4));
    const auto identity = CandidateMap::identity(
        4, device(), nullptr, {identity_storage.data(), identity_storage.bytes()});
    EXPECT_EQ(static_cast<const void*>(identity.device_view().cand_to_user),
              identity_storage.data());
    expect_device_copy_matches(identity);
  }
}

// Storage a CUDA map cannot use is refused by name, before anything is
// written to it.
TEST_P(CandidateMapOnDevice, RejectsStorageItCannotUse) {
  if (!device().is_cuda()) {
    GTEST_SKIP() << "a CPU map takes no storage (refused in EveryBuildWritesTheCallersStorage)";
  }
  const Ints cand_to_user = {0, 2, 1, 1};
  const std::size_t needed = CandidateMap::device_bytes(4, 3);
  const std::vector<std::byte> poison(needed + 256, std::byte{0xAB});
  DeviceBuffer storage(device(), poison);
  const auto build = [&](Workspace given) {
    return [&, given] { CandidateMap::build(cand_to_user.data(), 4, 3, device(), nullptr, given); };
  };
  EXPECT_TRUE(throws_invalid_argument(
      build({storage.data(), needed - 4}),
      {"storage must hold " + std::to_string(needed) +
       " bytes (see CandidateMap::device_bytes), got " + std::to_string(needed - 4) + " bytes"},
      {&storage}));
  EXPECT_TRUE(throws_invalid_argument(build({nullptr, needed}),
                                      {"storage must hold ", "bytes at a null pointer"}));
  EXPECT_TRUE(throws_invalid_argument(build({static_cast<std::byte*>(storage.data()) + 4, needed}),
                                      {"storage must be 256-byte aligned"}, {&storage}));
  std::vector<std::byte> host(needed + 256);
  const auto offset = (256 - reinterpret_cast<std::uintptr_t>(host.data()) % 256) % 256;
  EXPECT_TRUE(throws_invalid_argument(build({host.data() + offset, needed}),
                                      {"storage must be memory of cuda:", "got host memory"}));
  // A map with a bad entry writes nothing to good storage.
  const Ints bad = {0, 3, 1, 1};
  EXPECT_TRUE(throws_invalid_argument(
      [&] { CandidateMap::build(bad.data(), 4, 3, device(), nullptr, {storage.data(), needed}); },
      {"cand_to_user[1] = 3 is out of range [0, 3)"}, {&storage}));
  const Ints offsets = {0, 5, 4};
  EXPECT_TRUE(throws_invalid_argument(
      [&] {
        JaggedOffsets::build(offsets.data(), 2, 4, device(), nullptr,
                             {storage.data(), JaggedOffsets::device_bytes(2) - 1});
      },
      {"storage must hold 12 bytes (see JaggedOffsets::device_bytes), got 11 bytes"},
      {&storage}));
}

INSTANTIATE_TEST_SUITE_P(Devices, CandidateMapOnDevice, testing::ValuesIn(test_devices()),
                         device_param_name);

}  // namespace
}  // namespace ikbo::test
