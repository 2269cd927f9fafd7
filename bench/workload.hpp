// workload.hpp — synthetic request layouts for ikbo-bench.
//
// A request has B candidates and U = round(B / ratio) users (at least 1, at
// most B). Candidates are spread over users as evenly as possible (group
// sizes floor or ceil of B / U, interleaved). When B / U is a whole number,
// every fourth user hands one candidate to the next, so odd and even group
// sizes both occur (B = 2048, ratio 64: 63, 65, 64, 64, 63, ...) and kernels
// are timed on partial tiles too. The mapping is grouped by user (sorted, the
// SPEC reference) or shuffled. Jagged histories draw each user's length
// uniformly from [S/2, 3S/2].
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "ikbo/candidate_map.hpp"

namespace ikbo::bench {

std::int64_t users_for_ratio(std::int64_t num_candidates, std::int64_t ratio);

// Candidates per user, [U], summing to num_candidates.
std::vector<std::int32_t> candidate_counts(std::int64_t num_candidates, std::int64_t num_users);

// cand_to_user [B] for these group sizes: user 0's candidates first, then
// user 1's, ...; or that order shuffled when `sorted` is false.
std::vector<std::int32_t> make_cand_to_user(std::span<const std::int32_t> user_counts, bool sorted,
                                            std::uint64_t seed);

// The CandidateMap of a request of these sizes (candidate_counts, then
// make_cand_to_user), built on `device`.
CandidateMap request_map(std::int64_t num_candidates, std::int64_t num_users, bool sorted,
                         std::uint64_t seed, Device device, Stream stream);

// History offsets [U + 1] with lengths uniform in [S/2, 3S/2].
std::vector<std::int32_t> jagged_history_offsets(std::int64_t num_users, std::int64_t mean_length,
                                                 std::uint64_t seed);

}  // namespace ikbo::bench
