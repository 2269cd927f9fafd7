// Broadcast baselines (replicate user-side tensors, then compute per
// candidate) and the stages of the LCE staircase.
#include "baselines.hpp"

#include <cstring>

#include "api/validate.hpp"
#include "backend.hpp"

namespace ikbo::baseline {
namespace {

void gather(detail::GatherRowsArgs args, Device device) {
  args.device = device;
  if (device.is_cuda()) {
    detail::cuda::gather_rows(args);
  } else {
    detail::cpu::gather_rows(args);
  }
}

const std::int32_t* map_index(const CandidateMap& map, Device device) {
  return device.is_cuda() ? map.device_view().cand_to_user : map.cand_to_user().data();
}

void require_cuda(const Tensor& tensor, const char* op) {
  detail::require(tensor.device.is_cuda(), op, " runs on CUDA only (a cuBLAS or Hopper-kernel ",
                  "baseline), got tensors on ", device_name(tensor.device));
}

// Checks the operands of lce_decomposed (all but out and the workspace);
// returns the backend arguments they give.
detail::LceDecomposedArgs check_decomposed_inputs(const Tensor& w_c, const Tensor& w_u,
                                                  const Tensor& e_c, const Tensor& e_u,
                                                  const CandidateMap* map) {
  require_cuda(w_c, "lce_decomposed");
  detail::check_float_dtype(w_c.dtype, "w_c");
  detail::check_tensor(w_c, "w_c", w_c.dtype, w_c.device, 2);
  detail::check_tensor(e_c, "e_c", w_c.dtype, w_c.device, 3);
  detail::check_tensor(e_u, "e_u", w_c.dtype, w_c.device, 3);
  detail::check_dim(e_c, "e_c", 1, w_c.size(1), "Kc of w_c");
  detail::check_dim(e_u, "e_u", 2, e_c.size(2), "N of e_c");
  detail::LceDecomposedArgs args;
  args.dtype = w_c.dtype;
  args.device = w_c.device;
  args.m = w_c.size(0);
  args.n = e_c.size(2);
  args.kc = w_c.size(1);
  args.num_candidates = e_c.size(0);
  args.num_users = e_u.size(0);
  if (map == nullptr) return args;  // the workspace query needs no more
  detail::check_tensor(w_u, "w_u", w_c.dtype, w_c.device, 2);
  detail::check_dim(w_u, "w_u", 0, args.m, "M of w_c");
  detail::check_dim(e_u, "e_u", 1, w_u.size(1), "Ku of w_u");
  detail::check_map(*map, e_c, "e_c", &e_u, "e_u", w_c.device, "w_c");
  args.ku = w_u.size(1);
  detail::require(args.m >= 1 && args.kc >= 1 && args.ku >= 1 && args.n >= 1,
                  "lce_decomposed needs M, Kc, Ku and N >= 1, got ", args.m, ", ", args.kc, ", ",
                  args.ku, ", ", args.n);
  args.w_c = w_c.data;
  args.w_u = w_u.data;
  args.e_c = e_c.data;
  args.e_u = e_u.data;
  args.cand_to_user = map->device_view().cand_to_user;
  return args;
}

}  // namespace

std::shared_ptr<const LcePlan::State> prepare_concat_lce_plan(const Tensor& w_full,
                                                              Stream stream) {
  detail::check_tensor(w_full, "w_full", w_full.dtype, w_full.device, 2);
  const std::int64_t m = w_full.size(0), k = w_full.size(1);
  if (w_full.device.is_cuda()) {
    return std::make_shared<LcePlan::State>(detail::cuda::prepare_lce_plan(
        w_full.dtype, w_full.device, m, 0, k, w_full.data, nullptr, stream));
  }
  return std::make_shared<LcePlan::State>(
      detail::cpu::prepare_lce_plan(w_full.dtype, m, 0, k, w_full.data, nullptr));
}

void replicate_lce_input(const Tensor& e_c, const Tensor& e_u, const CandidateMap& map,
                         const Tensor& e_full, Stream stream) {
  const std::int64_t b = e_c.size(0), kc = e_c.size(1), ku = e_u.size(1), n = e_c.size(2);
  detail::check_shape(e_full, "e_full", {b, ku + kc, n}, "[B, Ku + Kc, N]");
  const auto element = static_cast<std::int64_t>(dtype_size(e_c.dtype));
  const std::int64_t row_full = (ku + kc) * n * element;
  auto* dst = static_cast<char*>(e_full.data);
  gather({dst, row_full, e_u.data, ku * n * element, ku * n * element, map_index(map, e_c.device),
          b, {}, stream},
         e_c.device);
  gather({dst + ku * n * element, row_full, e_c.data, kc * n * element, kc * n * element, nullptr,
          b, {}, stream},
         e_c.device);
}

std::size_t lce_concat_workspace_bytes(const LcePlan::State& plan, const Tensor& e_full) {
  if (!plan.device.is_cuda()) return 0;
  return detail::cuda::lce_workspace_bytes(plan, e_full.size(2), e_full.size(0), 0);
}

void lce_concat(const LcePlan::State& plan, const Tensor& e_full, const Tensor& out,
                Stream stream, Workspace workspace) {
  detail::check_dim(e_full, "e_full", 1, plan.kc, "K of w_full");
  detail::check_shape(out, "out", {e_full.size(0), plan.m, e_full.size(2)}, "[B, M, N]");
  detail::LceArgs args;
  args.plan = &plan;
  args.n = e_full.size(2);
  args.num_candidates = e_full.size(0);
  args.e_c = e_full.data;
  args.out = out.data;
  args.stream = stream;
  args.workspace = workspace.data;
  args.workspace_bytes = workspace.bytes;
  if (plan.device.is_cuda()) {
    detail::cuda::lce(args);
  } else {
    detail::cpu::lce(args);
  }
}

std::size_t lce_decomposed_workspace_bytes(const Tensor& w_c, const Tensor& e_c,
                                           const Tensor& e_u) {
  const auto args = check_decomposed_inputs(w_c, Tensor(), e_c, e_u, nullptr);
  return detail::cuda::lce_decomposed_workspace_bytes(args.dtype, args.m, args.n, args.num_users);
}

void lce_decomposed(const Tensor& w_c, const Tensor& w_u, const Tensor& e_c, const Tensor& e_u,
                    const CandidateMap& map, const Tensor& out, Stream stream,
                    Workspace workspace) {
  auto args = check_decomposed_inputs(w_c, w_u, e_c, e_u, &map);
  detail::check_tensor(out, "out", args.dtype, args.device, 3);
  detail::check_shape(out, "out", {args.num_candidates, args.m, args.n}, "[B, M, N]");
  detail::check_no_overlap(out, "out", e_c, "e_c");
  detail::check_no_overlap(out, "out", e_u, "e_u");
  detail::check_workspace(
      workspace,
      detail::cuda::lce_decomposed_workspace_bytes(args.dtype, args.m, args.n, args.num_users),
      "lce_decomposed_workspace_bytes");
  args.out = out.data;
  args.stream = stream;
  args.workspace = workspace.data;
  args.workspace_bytes = workspace.bytes;
  detail::cuda::lce_decomposed(args);
}

void pad_k(const Tensor& src, const Tensor& dst, Stream stream) {
  detail::require(src.rank == 2 || src.rank == 3, "src must be [rows, K] or [batch, K, N], got ",
                  src.shape_string());
  detail::check_tensor(src, "src", src.dtype, src.device, src.rank);
  detail::check_tensor(dst, "dst", src.dtype, src.device, src.rank);
  for (int dim = 0; dim < src.rank; ++dim) {
    if (dim != 1) detail::check_dim(dst, "dst", dim, src.size(dim), "the same dimension of src");
  }
  detail::require(dst.size(1) >= src.size(1), "dst dimension 1 (K) must be >= src's ", src.size(1),
                  ", got ", dst.size(1));
  detail::check_no_overlap(dst, "dst", src, "src");
  const std::int64_t rows = src.size(0);
  // Nothing to write; an empty dst (and src) may have null data.
  if (rows == 0 || dst.numel() == 0) return;
  const auto element = static_cast<std::int64_t>(dtype_size(src.dtype));
  const std::int64_t src_row = src.numel() / rows * element;
  const std::int64_t dst_row = dst.numel() / rows * element;
  const auto dst_bytes = static_cast<std::size_t>(rows * dst_row);
  if (src.device.is_cuda()) {
    detail::device::zero(dst.data, dst_bytes, dst.device, stream);
  } else {
    std::memset(dst.data, 0, dst_bytes);
  }
  gather({dst.data, dst_row, src.data, src_row, src_row, nullptr, rows, {}, stream}, src.device);
}

std::optional<std::string> lce_fused_blocker(const LcePlan& plan, const Tensor& e_c,
                                             const Tensor& e_u, const CandidateMap& map,
                                             const Tensor& out, Workspace workspace) {
  const detail::LceArgs args = detail::check_lce_call(plan, e_c, e_u, map, out, nullptr, workspace);
  if (!plan.device().is_cuda()) {
    return "the fused stage is a Hopper kernel; on the CPU, ikbo::lce computes the decomposed "
           "form";
  }
  return detail::cuda::lce_fused_blocker(args);
}

void lce_fused(const LcePlan& plan, const Tensor& e_c, const Tensor& e_u, const CandidateMap& map,
               const Tensor& out, Stream stream, Workspace workspace) {
  require_cuda(e_c, "lce_fused");
  detail::cuda::lce_fused(detail::check_lce_call(plan, e_c, e_u, map, out, stream, workspace));
}

void replicate_linear_input(const Tensor& x_c, const Tensor& x_u, const CandidateMap& map,
                            const Tensor& x_full, Stream stream) {
  const std::int64_t b = x_c.size(0), kc = x_c.size(1), ku = x_u.size(1);
  detail::check_tensor(x_c, "x_c", x_c.dtype, x_c.device, 2);
  detail::check_tensor(x_u, "x_u", x_c.dtype, x_c.device, 2);
  detail::check_tensor(x_full, "x_full", x_c.dtype, x_c.device, 2);
  detail::check_shape(x_full, "x_full", {b, ku + kc}, "[B, Ku + Kc]");
  detail::check_map(map, x_c, "x_c", &x_u, "x_u", x_c.device, "x_c");
  const auto element = static_cast<std::int64_t>(dtype_size(x_c.dtype));
  const std::int64_t row_full = (ku + kc) * element;
  auto* dst = static_cast<char*>(x_full.data);
  gather({dst, row_full, x_u.data, ku * element, ku * element, map_index(map, x_c.device), b, {},
          stream},
         x_c.device);
  gather({dst + ku * element, row_full, x_c.data, kc * element, kc * element, nullptr, b, {},
          stream},
         x_c.device);
}

std::size_t linear_concat_workspace_bytes(const Tensor& weight) {
  detail::check_cpu_index(weight.device, "weight");
  return weight.device.is_cuda() ? detail::cuda::linear_concat_workspace_bytes() : 0;
}

void linear_concat(const Tensor& weight, const Tensor* bias, const Tensor& x_full,
                   const Tensor& out, Stream stream, Workspace workspace) {
  detail::check_float_dtype(weight.dtype, "weight");
  detail::check_tensor(weight, "weight", weight.dtype, weight.device, 2);
  detail::require(weight.size(0) >= 1 && weight.size(1) >= 1,
                  "weight must have N_out >= 1 and K >= 1, got shape ", weight.shape_string());
  detail::check_tensor(x_full, "x_full", weight.dtype, weight.device, 2);
  detail::check_tensor(out, "out", weight.dtype, weight.device, 2);
  detail::check_dim(x_full, "x_full", 1, weight.size(1), "Ku + Kc of weight");
  detail::check_shape(out, "out", {x_full.size(0), weight.size(0)}, "[B, N_out]");
  detail::check_no_overlap(out, "out", x_full, "x_full");
  if (bias != nullptr) {
    detail::check_tensor(*bias, "bias", weight.dtype, weight.device, 1);
    detail::check_dim(*bias, "bias", 0, weight.size(0), "N_out of weight");
  }
  detail::check_workspace(workspace, linear_concat_workspace_bytes(weight),
                          "linear_concat_workspace_bytes");
  const detail::LinearConcatArgs args{.dtype = weight.dtype,
                                      .device = weight.device,
                                      .out_features = weight.size(0),
                                      .k = weight.size(1),
                                      .num_candidates = x_full.size(0),
                                      .weight = weight.data,
                                      .ld_weight = weight.size(1),
                                      .bias = bias != nullptr ? bias->data : nullptr,
                                      .x_full = x_full.data,
                                      .out = out.data,
                                      .stream = stream,
                                      .workspace = workspace.data,
                                      .workspace_bytes = workspace.bytes};
  if (weight.device.is_cuda()) {
    detail::cuda::linear_concat(args);
  } else {
    detail::cpu::linear_concat(args);
  }
}

void linear_decomposed(const LinearPlan& plan, const Tensor& x_c, const Tensor& x_u,
                       const CandidateMap& map, const Tensor& out, Stream stream,
                       Workspace workspace) {
  require_cuda(x_c, "linear_decomposed");
  detail::cuda::linear_decomposed(
      detail::check_linear_call(plan, x_c, x_u, map, out, stream, workspace));
}

void replicate_kv(const Tensor& kv, const CandidateMap& map, const Tensor& kv_full,
                  Stream stream) {
  const std::int64_t b = map.num_candidates();
  detail::check_shape(kv_full, "kv_full", {b, kv.size(1), kv.size(2), kv.size(3)},
                      "[B, S, H, D]");
  const std::int64_t row = kv.size(1) * kv.size(2) * kv.size(3) *
                           static_cast<std::int64_t>(dtype_size(kv.dtype));
  gather({kv_full.data, row, kv.data, row, row, map_index(map, kv.device), b, {}, stream}, kv.device);
}

}  // namespace ikbo::baseline
