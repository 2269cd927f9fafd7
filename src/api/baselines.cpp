// Broadcast baselines: replicate user-side tensors, then compute per candidate.
#include "baselines.hpp"

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
