// attention: validation and the single backend dispatch point.
#include <cmath>

#include "api/validate.hpp"
#include "backend.hpp"

namespace ikbo {

namespace {

// Every check of attention() but those of out and scale; the call's backend
// arguments without out, scale, stream and workspace.
detail::AttentionArgs check_inputs(const Tensor& q, const Tensor& k, const Tensor& v,
                                   const CandidateMap& map, const JaggedOffsets* kv_offsets) {
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
  if (device.is_cuda()) detail::device::require(device, "q");

  const std::int64_t num_candidates = q.size(0), n_seed = q.size(1), heads = q.size(2),
                     head_dim = q.size(3);
  require(n_seed >= 1, "q dimension 1 (n_seed) must be >= 1, got ", n_seed);
  require(heads >= 1, "q dimension 2 (H) must be >= 1, got ", heads);
  require(head_dim == 64 || head_dim == 128 || head_dim == 256,
          "q dimension 3 (head dim D) must be 64, 128 or 256, got ", head_dim);
  if (!device.is_cuda() && dtype == DType::f32) {
    // The CPU multiplies fp32 K and V in place, where a head's rows are H * D apart.
    detail::check_blas_extent(heads * head_dim, "H * D of q");
  }
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
  args.map = &map.state();
  args.kv_offsets = jagged ? &kv_offsets->state() : nullptr;
  return args;
}

std::size_t workspace_bytes(const detail::AttentionArgs& args, Device device) {
  return args.num_candidates > 0 && device.is_cuda() ? detail::cuda::attention_workspace_bytes(args)
                                                     : 0;
}

}  // namespace

std::size_t attention_workspace_bytes(const Tensor& q, const Tensor& k, const Tensor& v,
                                      const CandidateMap& map, const JaggedOffsets* kv_offsets) {
  return workspace_bytes(check_inputs(q, k, v, map, kv_offsets), q.device);
}

void attention(const Tensor& q, const Tensor& k, const Tensor& v, const CandidateMap& map,
               const Tensor& out, const JaggedOffsets* kv_offsets, std::optional<float> scale,
               Stream stream, Workspace workspace) {
  detail::AttentionArgs args = check_inputs(q, k, v, map, kv_offsets);
  detail::check_tensor(out, "out", q.dtype, q.device, 4);
  detail::check_shape(out, "out", {args.num_candidates, args.n_seed, args.heads, args.head_dim},
                      "the shape of q");
  detail::check_no_overlap(out, "out", q, "q");
  detail::check_no_overlap(out, "out", k, "k");
  detail::check_no_overlap(out, "out", v, "v");
  const float scale_value =
      scale.value_or(1.0f / std::sqrt(static_cast<float>(args.head_dim)));
  detail::require(std::isfinite(scale_value), "scale must be finite, got ", scale_value);
  if (workspace.data != nullptr || workspace.bytes != 0) {
    const std::size_t needed = workspace_bytes(args, q.device);
    detail::check_workspace(workspace, needed, "attention_workspace_bytes");
    // Only a workspace the call needs is passed on (none, when it needs none).
    if (needed > 0) args.workspace = workspace.data;
  }
  args.out = out.data;
  args.scale = scale_value;
  args.stream = stream;
  if (args.num_candidates == 0) return;
  if (q.device.is_cuda()) {
    detail::cuda::attention(args);
  } else {
    detail::cpu::attention(args);
  }
}

}  // namespace ikbo
