// lce: validation and the single backend dispatch point.
#include "api/validate.hpp"
#include "backend.hpp"

namespace ikbo {
namespace {

using detail::check_dim;
using detail::check_float_dtype;
using detail::check_tensor;
using detail::require;

// Checks e_c, e_u and the map against the plan; returns the validated args
// (without output and workspace).
detail::LceArgs check_inputs(const LcePlan& plan, const Tensor& e_c, const Tensor& e_u,
                             const CandidateMap& map) {
  const auto& weights = plan.state();
  check_tensor(e_c, "e_c", weights.dtype, weights.device, 3);
  check_tensor(e_u, "e_u", weights.dtype, weights.device, 3);
  check_dim(e_c, "e_c", 1, weights.kc, "Kc of w_c");
  check_dim(e_u, "e_u", 1, weights.ku, "Ku of w_u");
  // e_c's N first: with N = 0 there, e_u is not the argument to blame.
  require(e_c.size(2) >= 1, "e_c dimension 2 (N) must be >= 1, got ", e_c.size(2));
  check_dim(e_u, "e_u", 2, e_c.size(2), "N of e_c");
  detail::check_map(map, e_c, "e_c", &e_u, "e_u", weights.device, "the weights");
  if (!weights.device.is_cuda()) {
    // The CPU keeps the user partials as one [M, U * N] matrix.
    detail::check_blas_extent(e_u.size(0) * e_u.size(2), "U * N of e_u");
  }
  detail::LceArgs args;
  args.plan = &weights;
  args.n = e_c.size(2);
  args.num_candidates = e_c.size(0);
  args.num_users = e_u.size(0);
  args.e_c = e_c.data;
  args.e_u = e_u.data;
  args.map = &map.state();
  return args;
}

}  // namespace

LcePlan LcePlan::create(const Tensor& w_c, const Tensor& w_u, Stream stream) {
  check_float_dtype(w_c.dtype, "w_c");
  check_tensor(w_c, "w_c", w_c.dtype, w_c.device, 2);
  check_tensor(w_u, "w_u", w_c.dtype, w_c.device, 2);
  // w_c's M first: with M = 0 there, w_u is not the argument to blame.
  require(w_c.size(0) >= 1, "w_c dimension 0 (M) must be >= 1, got ", w_c.size(0));
  check_dim(w_u, "w_u", 0, w_c.size(0), "M of w_c");
  require(w_c.size(1) >= 1, "w_c dimension 1 (Kc) must be >= 1, got ", w_c.size(1));
  require(w_u.size(1) >= 1, "w_u dimension 1 (Ku) must be >= 1, got ", w_u.size(1));
  const std::int64_t m = w_c.size(0), kc = w_c.size(1), ku = w_u.size(1);
  if (w_c.device.is_cuda()) {
    detail::device::require(w_c.device, "w_c");
    return LcePlan(std::make_shared<State>(detail::cuda::prepare_lce_plan(
        w_c.dtype, w_c.device, m, ku, kc, w_c.data, w_u.data, stream)));
  }
  return LcePlan(std::make_shared<State>(
      detail::cpu::prepare_lce_plan(w_c.dtype, m, ku, kc, w_c.data, w_u.data)));
}

DType LcePlan::dtype() const { return state_->dtype; }
Device LcePlan::device() const { return state_->device; }
std::int64_t LcePlan::m() const { return state_->m; }
std::int64_t LcePlan::ku() const { return state_->ku; }
std::int64_t LcePlan::kc() const { return state_->kc; }

std::size_t lce_workspace_bytes(const LcePlan& plan, const Tensor& e_c, const Tensor& e_u,
                                const CandidateMap& map) {
  const auto args = check_inputs(plan, e_c, e_u, map);
  return lce_workspace_bytes(plan, args.n, args.num_candidates, args.num_users);
}

std::size_t lce_workspace_bytes(const LcePlan& plan, std::int64_t n, std::int64_t num_candidates,
                                std::int64_t num_users) {
  detail::check_extent(n, "n (N, dimension 2 of e_c)", 1);
  detail::check_extent(num_candidates, "num_candidates (B)", 0);
  detail::check_extent(num_users, "num_users (U)", 1);
  if (!plan.device().is_cuda()) return 0;
  return detail::cuda::lce_workspace_bytes(plan.state(), n, num_candidates, num_users);
}

void lce(const LcePlan& plan, const Tensor& e_c, const Tensor& e_u, const CandidateMap& map,
         const Tensor& out, Stream stream, Workspace workspace) {
  const detail::LceArgs args = detail::check_lce_call(plan, e_c, e_u, map, out, stream, workspace);
  if (args.num_candidates == 0) return;
  if (plan.device().is_cuda()) {
    detail::cuda::lce(args);
  } else {
    detail::cpu::lce(args);
  }
}

namespace detail {

LceArgs check_lce_call(const LcePlan& plan, const Tensor& e_c, const Tensor& e_u,
                       const CandidateMap& map, const Tensor& out, Stream stream,
                       Workspace workspace) {
  auto args = check_inputs(plan, e_c, e_u, map);
  check_tensor(out, "out", plan.dtype(), plan.device(), 3);
  check_shape(out, "out", {args.num_candidates, plan.m(), args.n}, "[B, M, N]");
  check_no_overlap(out, "out", e_c, "e_c");
  check_no_overlap(out, "out", e_u, "e_u");
  args.out = out.data;
  args.stream = stream;
  args.workspace = workspace.data;
  args.workspace_bytes = workspace.bytes;
  if (args.num_candidates > 0 && plan.device().is_cuda()) {
    const std::size_t needed =
        cuda::lce_workspace_bytes(plan.state(), args.n, args.num_candidates, args.num_users);
    check_workspace(workspace, needed, "lce_workspace_bytes");
  }
  return args;
}

}  // namespace detail
}  // namespace ikbo
