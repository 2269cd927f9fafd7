// ikbo/candidate_map.hpp — the request-level candidate -> user map.
//
// Built once per request from cand_to_user[B] (int32, values in [0, U)) and
// handed to every IKBO op of that request. Building validates every entry
// once and derives what the kernels need: per-user counts, the offsets of
// each user's group in candidate order sorted by user (a stable counting
// sort, so an already sorted mapping gives the identity order), whether the
// mapping is sorted, and the largest group. For a CUDA device, one device
// buffer holds cand_to_user, user_offsets and candidates_by_user.
//
// B = 0, U = 1, U = B and users without candidates are all valid.
// A CandidateMap is cheap to copy (shared, immutable state).
//
// Device storage: by default a CUDA map allocates its device buffer with
// cudaMalloc and the last copy of the map frees it with cudaFree (both
// synchronize the whole device). Every build also takes `storage`,
// caller-owned device memory to hold it instead: from a framework's caching
// allocator, say, which makes a build per request cheaper and keeps the
// release stream-ordered. It must be on the map's device, 256-byte aligned
// and at least device_bytes() bytes; the map writes it once, while
// building, and the caller keeps it allocated and unwritten until the last
// copy of the map is destroyed and the work that reads the map is done. A
// map on the CPU takes no storage.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>

#include "ikbo/tensor.hpp"

namespace ikbo {

// Device-side arrays of a CandidateMap; every pointer is device memory.
struct CandidateMapDeviceView {
  const std::int32_t* cand_to_user = nullptr;        // [B]
  const std::int32_t* user_offsets = nullptr;        // [U + 1], group u is [offsets[u], offsets[u+1])
  const std::int32_t* candidates_by_user = nullptr;  // [B], candidate ids grouped by user
};

class CandidateMap {
 public:
  // From a host array. With a CUDA `device`, the derived arrays are copied
  // there (stream-ordered on `stream`, then synchronized: the map is built
  // once per request, outside any captured graph).
  static CandidateMap build(const std::int32_t* cand_to_user, std::int64_t num_candidates,
                            std::int64_t num_users, Device device = Device::cpu(),
                            Stream stream = nullptr, Workspace storage = {});
  // From a 1-D int32 tensor on the CPU or a CUDA device; the device copy (if
  // any) lives on the tensor's device. A device tensor is read back once.
  static CandidateMap build(const Tensor& cand_to_user, std::int64_t num_users,
                            Stream stream = nullptr, Workspace storage = {});
  // Multi-level, from the index tensors of a request: cand_to_user maps the
  // candidates to the groups of levels[0] (its entries), levels[i] maps those
  // groups to the groups of levels[i + 1], and the last level to num_users
  // users. The same map as composing each level's map (below), built with
  // one read of each tensor and one device copy, of the result; every entry
  // of every level is checked, and an error names the level ("levels[1][4]
  // = 9 is out of range [0, 7)"). All on cand_to_user's device. A request
  // without candidates reads no level.
  static CandidateMap build(const Tensor& cand_to_user, std::span<const Tensor> levels,
                            std::int64_t num_users, Stream stream = nullptr,
                            Workspace storage = {});
  // Multi-level broadcast (user -> group -> candidate, say user -> vendor
  // -> item): the map of each candidate to its group's user,
  // cand_to_user[b] = group_to_user.cand_to_user()[to_group.cand_to_user()[b]].
  // `to_group` maps B candidates to G groups, `group_to_user` those G groups
  // (as its candidates) to U users; both on one device, where the result
  // lives. Ops then read user tensors once per user for the candidates
  // directly, with no copy per group.
  static CandidateMap compose(const CandidateMap& to_group, const CandidateMap& group_to_user,
                              Stream stream = nullptr, Workspace storage = {});
  // Every candidate its own user: cand_to_user[b] = b (num_candidates >= 1,
  // as every map has at least one user).
  static CandidateMap identity(std::int64_t num_candidates, Device device = Device::cpu(),
                               Stream stream = nullptr, Workspace storage = {});
  // Bytes of device storage a CUDA map of num_candidates candidates and
  // num_users users holds (the three arrays of CandidateMapDeviceView).
  static std::size_t device_bytes(std::int64_t num_candidates, std::int64_t num_users);

  std::int64_t num_candidates() const;
  std::int64_t num_users() const;
  Device device() const;
  bool is_sorted() const;         // cand_to_user non-decreasing
  std::int64_t max_count() const;  // largest group (0 when B = 0)

  std::span<const std::int32_t> cand_to_user() const;        // host, [B]
  std::span<const std::int32_t> user_counts() const;         // host, [U]
  std::span<const std::int32_t> user_offsets() const;        // host, [U + 1]
  std::span<const std::int32_t> candidates_by_user() const;  // host, [B]
  // Throws ikbo::Error when the map has no CUDA copy.
  const CandidateMapDeviceView& device_view() const;

  struct State;
  const State& state() const { return *state_; }

 private:
  explicit CandidateMap(std::shared_ptr<const State> state) : state_(std::move(state)) {}
  std::shared_ptr<const State> state_;
};

// Offsets [U + 1] of a jagged per-user sequence (e.g. K/V histories of
// variable length): user u owns rows [offsets[u], offsets[u+1]). Validated
// once (starts at 0, non-decreasing, ends at `total_rows`), with a device copy
// for CUDA devices, in its own allocation or the caller's `storage`, like
// CandidateMap.
class JaggedOffsets {
 public:
  static JaggedOffsets build(const std::int32_t* offsets, std::int64_t num_users,
                             std::int64_t total_rows, Device device = Device::cpu(),
                             Stream stream = nullptr, Workspace storage = {});
  // From a 1-D int32 tensor of U + 1 entries on the CPU or a CUDA device.
  static JaggedOffsets build(const Tensor& offsets, std::int64_t total_rows,
                             Stream stream = nullptr, Workspace storage = {});
  // Bytes of device storage the CUDA offsets of num_users users hold.
  static std::size_t device_bytes(std::int64_t num_users);

  std::int64_t num_users() const;
  std::int64_t total_rows() const;
  std::int64_t max_length() const;
  Device device() const;
  std::span<const std::int32_t> host() const;  // [U + 1]
  const std::int32_t* device_data() const;     // throws ikbo::Error without a CUDA copy

  struct State;
  const State& state() const { return *state_; }

 private:
  explicit JaggedOffsets(std::shared_ptr<const State> state) : state_(std::move(state)) {}
  std::shared_ptr<const State> state_;
};

}  // namespace ikbo
