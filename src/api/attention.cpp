// attention: validation and the single backend dispatch point.
#include <cmath>

#include "api/validate.hpp"
#include "backend.hpp"

namespace ikbo {

void attention(const Tensor& q, const Tensor& k, const Tensor& v, const CandidateMap& map,
               const Tensor& out, const JaggedOffsets* kv_offsets, std::optional<float> scale,
               Stream stream) {
  using detail::check_dim;
  using detail::check_tensor;
  using detail::require;
  detail::check_float_dtype(q.dtype, "q");
  const DType dtype = q.dtype;
  const Device device = q.device;
  check_tensor(q, "q", dtype, device, 4);
  const bool jagged = kv_offsets != nullptr;
  const int kv_rank = jagged ? 3 : 4;
  check_tensor(k, "k", dtype, device, kv_rank);
  check_tensor(v, "v", dtype, device, kv_rank);
  check_tensor(out, "out", dtype, device, 4);
  if (device.is_cuda()) detail::device::require(device, "q");

  const std::int64_t num_candidates = q.size(0), n_seed = q.size(1), heads = q.size(2),
                     head_dim = q.size(3);
  require(n_seed >= 1, "q dimension 1 (n_seed) must be >= 1, got ", n_seed);
  require(heads >= 1, "q dimension 2 (H) must be >= 1, got ", heads);
  require(head_dim == 64 || head_dim == 128 || head_dim == 256,
          "q dimension 3 (head dim D) must be 64, 128 or 256, got ", head_dim);
  detail::check_map(map, q, "q", nullptr, {}, device, "q");

  const int head_axis = kv_rank - 2;
  check_dim(k, "k", head_axis, heads, "H of q");
  check_dim(k, "k", head_axis + 1, head_dim, "D of q");
  std::int64_t dense_seq_len = 0;
  if (jagged) {
    require(kv_offsets->num_users() == map.num_users(), "kv_offsets must have num_users + 1 = ",
            map.num_users() + 1, " entries, got ", kv_offsets->num_users() + 1);
    check_dim(k, "k", 0, kv_offsets->total_rows(), "kv_offsets[num_users]");
    require(kv_offsets->device() == device, "kv_offsets must be on ", device_name(device),
            " like q, got ", device_name(kv_offsets->device()));
  } else {
    check_dim(k, "k", 0, map.num_users(), "num_users of the candidate map");
    dense_seq_len = k.size(1);
  }
  if (jagged) {
    detail::check_shape(v, "v", {k.size(0), k.size(1), k.size(2)}, "the shape of k");
  } else {
    detail::check_shape(v, "v", {k.size(0), k.size(1), k.size(2), k.size(3)}, "the shape of k");
  }
  detail::check_shape(out, "out", {num_candidates, n_seed, heads, head_dim}, "the shape of q");
  detail::check_no_overlap(out, "out", q, "q");
  detail::check_no_overlap(out, "out", k, "k");
  detail::check_no_overlap(out, "out", v, "v");
  const float scale_value = scale.value_or(1.0f / std::sqrt(static_cast<float>(head_dim)));
  require(std::isfinite(scale_value), "scale must be finite, got ", scale_value);

  detail::AttentionArgs args;
  args.dtype = dtype;
  args.num_candidates = num_candidates;
  args.num_users = map.num_users();
  args.n_seed = n_seed;
  args.heads = heads;
  args.head_dim = head_dim;
  args.dense_seq_len = dense_seq_len;
  args.q = q.data;
  args.k = k.data;
  args.v = v.data;
  args.out = out.data;
  args.map = &map.state();
  args.kv_offsets = jagged ? &kv_offsets->state() : nullptr;
  args.scale = scale_value;
  args.stream = stream;
  if (num_candidates == 0) return;
  if (device.is_cuda()) {
    detail::cuda::attention(args);
  } else {
    detail::cpu::attention(args);
  }
}

}  // namespace ikbo
