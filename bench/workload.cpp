// workload.cpp — user counts, candidate maps and history lengths of the
// benchmark's synthetic requests.
#include "workload.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <utility>

#include "ikbo/error.hpp"
#include "random.hpp"

namespace ikbo::bench {

std::int64_t users_for_ratio(std::int64_t num_candidates, std::int64_t ratio) {
  const auto users = std::llround(static_cast<double>(num_candidates) / static_cast<double>(ratio));
  return std::clamp<std::int64_t>(users, 1, num_candidates);
}

std::vector<std::int32_t> candidate_counts(std::int64_t num_candidates, std::int64_t num_users) {
  std::vector<std::int32_t> counts(static_cast<std::size_t>(num_users));
  // Group u ends at floor((u + 1) * B / U): the larger groups spread out
  // instead of bunching at the front.
  for (std::int64_t user = 0; user < num_users; ++user) {
    counts[static_cast<std::size_t>(user)] = static_cast<std::int32_t>(
        (user + 1) * num_candidates / num_users - user * num_candidates / num_users);
  }
  const std::int64_t base = num_candidates / num_users;
  if (num_candidates % num_users == 0 && base >= 2) {
    for (std::size_t user = 0; user + 1 < counts.size(); user += 4) {
      --counts[user];
      ++counts[user + 1];
    }
  }
  return counts;
}

std::vector<std::int32_t> make_cand_to_user(std::span<const std::int32_t> user_counts, bool sorted,
                                            std::uint64_t seed) {
  std::vector<std::int32_t> cand_to_user;
  for (std::size_t user = 0; user < user_counts.size(); ++user) {
    cand_to_user.insert(cand_to_user.end(), static_cast<std::size_t>(user_counts[user]),
                        static_cast<std::int32_t>(user));
  }
  if (!sorted) {
    // Fisher-Yates with the bench's own Rng, so every platform gets the same order.
    Rng rng(seed);
    for (std::size_t i = cand_to_user.size(); i > 1; --i) {
      std::swap(cand_to_user[i - 1], cand_to_user[rng.below(i)]);
    }
  }
  return cand_to_user;
}

CandidateMap request_map(std::int64_t num_candidates, std::int64_t num_users, bool sorted,
                         std::uint64_t seed, Device device, Stream stream) {
  const auto cand_to_user =
      make_cand_to_user(candidate_counts(num_candidates, num_users), sorted, seed);
  return CandidateMap::build(cand_to_user.data(), num_candidates, num_users, device, stream);
}

std::vector<std::int32_t> jagged_history_offsets(std::int64_t num_users, std::int64_t mean_length,
                                                 std::uint64_t seed) {
  Rng rng(seed);
  const std::int64_t shortest = mean_length / 2;
  const std::int64_t span = mean_length + 1;  // lengths shortest .. shortest + mean_length
  std::vector<std::int32_t> offsets(static_cast<std::size_t>(num_users) + 1, 0);
  std::int64_t total = 0;
  for (std::size_t user = 0; user < static_cast<std::size_t>(num_users); ++user) {
    total += shortest + static_cast<std::int64_t>(rng.below(static_cast<std::uint64_t>(span)));
    if (total > std::numeric_limits<std::int32_t>::max()) {
      throw Error("jagged histories of " + std::to_string(num_users) + " users at mean length " +
                  std::to_string(mean_length) + " exceed the int32 offsets");
    }
    offsets[user + 1] = static_cast<std::int32_t>(total);
  }
  return offsets;
}

}  // namespace ikbo::bench
