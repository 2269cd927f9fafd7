// CandidateMap and JaggedOffsets: validation once per request, derived
// per-user arrays, and their device copies.
#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "api/state.hpp"
#include "api/validate.hpp"
#include "backend.hpp"

namespace ikbo {
namespace {

// Uploads `arrays` back to back into one device buffer, the caller's
// `storage` (checked by check_storage) or else an allocation of its own;
// returns what owns the buffer (nothing for the caller's) and writes each
// array's device address to `addresses`.
std::shared_ptr<void> upload(std::initializer_list<const std::vector<std::int32_t>*> arrays,
                             std::initializer_list<const std::int32_t**> addresses,
                             Device device, Stream stream, Workspace storage) {
  std::size_t total = 0;
  for (const auto* array : arrays) total += array->size();
  std::vector<std::int32_t> packed;
  packed.reserve(total);
  for (const auto* array : arrays) packed.insert(packed.end(), array->begin(), array->end());
  std::shared_ptr<void> owner;
  void* buffer = storage.data;
  if (buffer == nullptr) {
    owner = detail::device::allocate(total * sizeof(std::int32_t), device);
    buffer = owner.get();
  }
  detail::device::copy_to_device(buffer, packed.data(), total * sizeof(std::int32_t), device,
                                 stream);
  auto* cursor = static_cast<const std::int32_t*>(buffer);
  auto array = arrays.begin();
  for (const std::int32_t** address : addresses) {
    *address = cursor;
    cursor += (*array++)->size();
  }
  return owner;
}

// Checks a build's `storage`: none for a CPU map (`owner` names the object);
// for a CUDA map none (the map allocates) or `needed` bytes of device memory
// of `device`, 256-byte aligned; `query` names the size query.
void check_storage(const Workspace& storage, Device device, std::size_t needed,
                   std::string_view owner, std::string_view query) {
  const bool given = storage.data != nullptr || storage.bytes != 0;
  if (!device.is_cuda()) {
    detail::require(!given, "storage must be empty for a ", owner, " on ", device_name(device),
                    ", which has no device arrays, got ", storage.bytes, " bytes at address ",
                    storage.data);
    return;
  }
  if (!given) return;
  detail::check_workspace(storage, needed, query, "storage");
  detail::device::require_memory_on(storage.data, device, "storage");
}

// `prefix` names the object in the message ("kv_offsets: ").
void check_num_users(std::int64_t num_users, std::string_view prefix = {}) {
  detail::require(num_users >= 1 && num_users <= detail::kMaxExtent, prefix,
                  "num_users must be in [1, ", detail::kMaxExtent, "], got ", num_users);
}

// Checks a 1-D int32 index tensor on `device`.
void check_index(const Tensor& tensor, std::string_view name, Device device) {
  detail::require(tensor.dtype == DType::i32, name, " must have dtype int32, got ",
                  dtype_name(tensor.dtype));
  detail::require(tensor.rank == 1, name, " must have 1 dimension, got ", tensor.rank,
                  " (shape ", tensor.shape_string(), ")");
  detail::check_tensor(tensor, name, DType::i32, device, 1);
}

// The values of a checked index tensor, on the host.
std::vector<std::int32_t> read_int32(const Tensor& tensor, std::string_view name, Stream stream) {
  std::vector<std::int32_t> values(static_cast<std::size_t>(tensor.size(0)));
  if (values.empty()) return values;
  if (tensor.device.is_cuda()) {
    detail::device::require(tensor.device, name.data());
    detail::device::copy_to_host(values.data(), tensor.data, values.size() * sizeof(std::int32_t),
                                 tensor.device, stream);
  } else {
    std::memcpy(values.data(), tensor.data, values.size() * sizeof(std::int32_t));
  }
  return values;
}

}  // namespace

CandidateMap CandidateMap::build(const std::int32_t* cand_to_user, std::int64_t num_candidates,
                                 std::int64_t num_users, Device device, Stream stream,
                                 Workspace storage) {
  using detail::require;
  const std::size_t needed = device_bytes(num_candidates, num_users);  // checks both
  require(num_candidates == 0 || cand_to_user != nullptr,
          "cand_to_user is a null pointer but num_candidates = ", num_candidates);
  detail::check_aligned(cand_to_user, alignof(std::int32_t), "cand_to_user");
  detail::check_cpu_index(device, "the CandidateMap");
  if (device.is_cuda()) detail::device::require(device, "CandidateMap device");
  check_storage(storage, device, needed, "CandidateMap", "CandidateMap::device_bytes");

  auto state = std::make_shared<State>();
  state->num_candidates = num_candidates;
  state->num_users = num_users;
  state->device = device;
  state->cand_to_user.assign(cand_to_user, cand_to_user + num_candidates);
  state->user_counts.assign(static_cast<std::size_t>(num_users), 0);
  for (std::int64_t b = 0; b < num_candidates; ++b) {
    std::int32_t user = cand_to_user[b];
    require(user >= 0 && user < num_users, "cand_to_user[", b, "] = ", user,
            " is out of range [0, ", num_users, ")");
    if (b > 0 && user < cand_to_user[b - 1]) state->sorted = false;
    ++state->user_counts[static_cast<std::size_t>(user)];
  }
  state->user_offsets.assign(static_cast<std::size_t>(num_users) + 1, 0);
  for (std::int64_t u = 0; u < num_users; ++u) {
    auto count = state->user_counts[static_cast<std::size_t>(u)];
    state->user_offsets[static_cast<std::size_t>(u) + 1] =
        state->user_offsets[static_cast<std::size_t>(u)] + count;
    state->max_count = std::max<std::int64_t>(state->max_count, count);
  }
  // Stable counting sort: candidates of user u, in their original order.
  state->candidates_by_user.resize(static_cast<std::size_t>(num_candidates));
  std::vector<std::int32_t> next(state->user_offsets.begin(), state->user_offsets.end() - 1);
  for (std::int64_t b = 0; b < num_candidates; ++b) {
    state->candidates_by_user[static_cast<std::size_t>(
        next[static_cast<std::size_t>(cand_to_user[b])]++)] = static_cast<std::int32_t>(b);
  }
  if (device.is_cuda()) {
    state->device_storage =
        upload({&state->cand_to_user, &state->user_offsets, &state->candidates_by_user},
               {&state->device_view.cand_to_user, &state->device_view.user_offsets,
                &state->device_view.candidates_by_user},
               device, stream, storage);
  }
  return CandidateMap(std::move(state));
}

CandidateMap CandidateMap::build(const Tensor& cand_to_user, std::int64_t num_users,
                                 Stream stream, Workspace storage) {
  return build(cand_to_user, {}, num_users, stream, storage);
}

CandidateMap CandidateMap::build(const Tensor& cand_to_user, std::span<const Tensor> levels,
                                 std::int64_t num_users, Stream stream, Workspace storage) {
  using detail::require;
  const Device device = cand_to_user.device;
  check_index(cand_to_user, "cand_to_user", device);
  const auto level_name = [](std::size_t position) {
    return "levels[" + std::to_string(position) + "]";
  };
  for (std::size_t i = 0; i < levels.size(); ++i) {
    const Tensor& level = levels[i];
    require(level.device == device, level_name(i), " must be on ", device_name(device),
            " like cand_to_user, got ", device_name(level.device));
    check_index(level, level_name(i), device);
  }
  auto values = read_int32(cand_to_user, "cand_to_user", stream);
  if (!levels.empty() && !values.empty()) {  // no candidates: no level is read
    check_num_users(num_users);  // before it bounds the last level
    for (std::size_t i = 0; i < levels.size(); ++i) {
      require(levels[i].size(0) > 0, level_name(i),
              " has no entries, but the candidates reach the users through it");
    }
    // Each candidate's group, level by level; each level is checked whole.
    for (std::size_t i = 0; i < levels.size(); ++i) {
      const std::string name = level_name(i);
      const auto groups = read_int32(levels[i], name, stream);
      if (i == 0) {  // the later levels' inputs are in range by the checks below
        for (std::size_t b = 0; b < values.size(); ++b) {
          require(values[b] >= 0 && static_cast<std::size_t>(values[b]) < groups.size(),
                  "cand_to_user[", b, "] = ", values[b], " is out of range [0, ", groups.size(),
                  ")");
        }
      }
      const std::int64_t next = i + 1 < levels.size() ? levels[i + 1].size(0) : num_users;
      for (std::size_t g = 0; g < groups.size(); ++g) {
        require(groups[g] >= 0 && groups[g] < next, name, "[", g, "] = ", groups[g],
                " is out of range [0, ", next, ")");
      }
      for (auto& value : values) value = groups[static_cast<std::size_t>(value)];
    }
  }
  return build(values.data(), static_cast<std::int64_t>(values.size()), num_users, device,
               stream, storage);
}

CandidateMap CandidateMap::compose(const CandidateMap& to_group,
                                   const CandidateMap& group_to_user, Stream stream,
                                   Workspace storage) {
  detail::require(to_group.num_users() == group_to_user.num_candidates(),
                  "group_to_user must map the ", to_group.num_users(),
                  " groups of to_group (its num_candidates), got num_candidates = ",
                  group_to_user.num_candidates());
  detail::require(to_group.device() == group_to_user.device(),
                  "to_group and group_to_user must be on one device, got ",
                  device_name(to_group.device()), " and ", device_name(group_to_user.device()));
  const auto groups = to_group.cand_to_user();
  const auto users = group_to_user.cand_to_user();
  std::vector<std::int32_t> values(groups.size());
  for (std::size_t b = 0; b < values.size(); ++b) {
    values[b] = users[static_cast<std::size_t>(groups[b])];
  }
  return build(values.data(), to_group.num_candidates(), group_to_user.num_users(),
               to_group.device(), stream, storage);
}

CandidateMap CandidateMap::identity(std::int64_t num_candidates, Device device, Stream stream,
                                    Workspace storage) {
  detail::require(num_candidates >= 1 && num_candidates <= detail::kMaxExtent,
                  "num_candidates must be in [1, ", detail::kMaxExtent, "], got ",
                  num_candidates);
  std::vector<std::int32_t> values(static_cast<std::size_t>(num_candidates));
  for (std::size_t b = 0; b < values.size(); ++b) values[b] = static_cast<std::int32_t>(b);
  return build(values.data(), num_candidates, num_candidates, device, stream, storage);
}

std::size_t CandidateMap::device_bytes(std::int64_t num_candidates, std::int64_t num_users) {
  detail::require(num_candidates >= 0 && num_candidates <= detail::kMaxExtent,
                  "num_candidates must be in [0, ", detail::kMaxExtent, "], got ",
                  num_candidates);
  check_num_users(num_users);
  // cand_to_user [B], user_offsets [U + 1], candidates_by_user [B]
  return static_cast<std::size_t>(2 * num_candidates + num_users + 1) * sizeof(std::int32_t);
}

std::int64_t CandidateMap::num_candidates() const { return state_->num_candidates; }
std::int64_t CandidateMap::num_users() const { return state_->num_users; }
Device CandidateMap::device() const { return state_->device; }
bool CandidateMap::is_sorted() const { return state_->sorted; }
std::int64_t CandidateMap::max_count() const { return state_->max_count; }
std::span<const std::int32_t> CandidateMap::cand_to_user() const { return state_->cand_to_user; }
std::span<const std::int32_t> CandidateMap::user_counts() const { return state_->user_counts; }
std::span<const std::int32_t> CandidateMap::user_offsets() const { return state_->user_offsets; }
std::span<const std::int32_t> CandidateMap::candidates_by_user() const {
  return state_->candidates_by_user;
}
const CandidateMapDeviceView& CandidateMap::device_view() const {
  detail::require(state_->device.is_cuda(), "this CandidateMap was built for ",
                  device_name(state_->device), " and has no CUDA copy");
  return state_->device_view;
}

JaggedOffsets JaggedOffsets::build(const std::int32_t* offsets, std::int64_t num_users,
                                   std::int64_t total_rows, Device device, Stream stream,
                                   Workspace storage) {
  using detail::require;
  const std::size_t needed = device_bytes(num_users);  // checks num_users
  require(total_rows >= 0 && total_rows <= detail::kMaxExtent,
          "kv_offsets: total_rows must be in [0, ", detail::kMaxExtent, "], got ", total_rows);
  require(offsets != nullptr, "kv_offsets is a null pointer");
  detail::check_aligned(offsets, alignof(std::int32_t), "kv_offsets");
  detail::check_cpu_index(device, "the JaggedOffsets");
  if (device.is_cuda()) detail::device::require(device, "JaggedOffsets device");
  check_storage(storage, device, needed, "JaggedOffsets", "JaggedOffsets::device_bytes");
  require(offsets[0] == 0, "kv_offsets[0] must be 0, got ", offsets[0]);
  auto state = std::make_shared<State>();
  for (std::int64_t u = 0; u < num_users; ++u) {
    require(offsets[u + 1] >= offsets[u], "kv_offsets must be non-decreasing, but kv_offsets[",
            u + 1, "] = ", offsets[u + 1], " < kv_offsets[", u, "] = ", offsets[u]);
    state->max_length = std::max<std::int64_t>(state->max_length, offsets[u + 1] - offsets[u]);
  }
  require(offsets[num_users] == total_rows, "kv_offsets[", num_users,
          "] must equal the number of K/V rows ", total_rows, ", got ", offsets[num_users]);
  state->num_users = num_users;
  state->total_rows = total_rows;
  state->device = device;
  state->offsets.assign(offsets, offsets + num_users + 1);
  if (device.is_cuda()) {
    state->device_storage =
        upload({&state->offsets}, {&state->device_offsets}, device, stream, storage);
  }
  return JaggedOffsets(std::move(state));
}

JaggedOffsets JaggedOffsets::build(const Tensor& offsets, std::int64_t total_rows, Stream stream,
                                   Workspace storage) {
  auto values = read_int32(offsets, "kv_offsets", stream);
  detail::require(values.size() >= 2, "kv_offsets must have num_users + 1 >= 2 entries, got ",
                  values.size());
  return build(values.data(), static_cast<std::int64_t>(values.size()) - 1, total_rows,
               offsets.device, stream, storage);
}

std::size_t JaggedOffsets::device_bytes(std::int64_t num_users) {
  check_num_users(num_users, "kv_offsets: ");
  return static_cast<std::size_t>(num_users + 1) * sizeof(std::int32_t);
}

std::int64_t JaggedOffsets::num_users() const { return state_->num_users; }
std::int64_t JaggedOffsets::total_rows() const { return state_->total_rows; }
std::int64_t JaggedOffsets::max_length() const { return state_->max_length; }
Device JaggedOffsets::device() const { return state_->device; }
std::span<const std::int32_t> JaggedOffsets::host() const { return state_->offsets; }
const std::int32_t* JaggedOffsets::device_data() const {
  detail::require(state_->device.is_cuda(), "these JaggedOffsets were built for ",
                  device_name(state_->device), " and have no CUDA copy");
  return state_->device_offsets;
}

}  // namespace ikbo
