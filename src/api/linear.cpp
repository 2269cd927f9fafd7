// linear: validation and the single backend dispatch point.
#include "api/validate.hpp"
#include "backend.hpp"

namespace ikbo {
namespace {

using detail::check_dim;
using detail::check_float_dtype;
using detail::check_tensor;
using detail::require;

// Checks the optional bias against the weight it belongs to (named `weight_name`).
void check_bias(const Tensor* bias, const Tensor& weight, std::string_view weight_name) {
  if (bias == nullptr) return;
  check_tensor(*bias, "bias", weight.dtype, weight.device, 1);
  check_dim(*bias, "bias", 0, weight.size(0), std::string("N_out of ") + std::string(weight_name));
}

LinearPlan::State prepare(const detail::LinearWeights& weights, Device device, Stream stream) {
  if (device.is_cuda()) {
    detail::device::require(device, "the weights");
    return detail::cuda::prepare_linear_plan(weights, device, stream);
  }
  return detail::cpu::prepare_linear_plan(weights);
}

// Checks x_c, x_u and the map against the plan; returns the validated args
// (without output and workspace).
detail::LinearArgs check_inputs(const LinearPlan& plan, const Tensor& x_c, const Tensor& x_u,
                                const CandidateMap& map) {
  const auto& weights = plan.state();
  check_tensor(x_c, "x_c", weights.dtype, weights.device, 2);
  check_tensor(x_u, "x_u", weights.dtype, weights.device, 2);
  check_dim(x_c, "x_c", 1, weights.kc, "Kc of w_c");
  check_dim(x_u, "x_u", 1, weights.ku, "Ku of w_u");
  detail::check_map(map, x_c, "x_c", &x_u, "x_u", weights.device, "the weights");
  detail::LinearArgs args;
  args.plan = &weights;
  args.num_candidates = x_c.size(0);
  args.num_users = x_u.size(0);
  args.x_c = x_c.data;
  args.x_u = x_u.data;
  args.map = &map.state();
  return args;
}

}  // namespace

LinearPlan LinearPlan::create(const Tensor& w_u, const Tensor& w_c, const Tensor* bias,
                              Stream stream) {
  check_float_dtype(w_u.dtype, "w_u");
  check_tensor(w_u, "w_u", w_u.dtype, w_u.device, 2);
  check_tensor(w_c, "w_c", w_u.dtype, w_u.device, 2);
  check_dim(w_c, "w_c", 0, w_u.size(0), "N_out of w_u");
  require(w_u.size(0) >= 1, "w_u dimension 0 (N_out) must be >= 1, got ", w_u.size(0));
  require(w_u.size(1) >= 1, "w_u dimension 1 (Ku) must be >= 1, got ", w_u.size(1));
  require(w_c.size(1) >= 1, "w_c dimension 1 (Kc) must be >= 1, got ", w_c.size(1));
  check_bias(bias, w_u, "w_u");
  const detail::LinearWeights weights{.dtype = w_u.dtype,
                                      .out_features = w_u.size(0),
                                      .ku = w_u.size(1),
                                      .kc = w_c.size(1),
                                      .w_u = w_u.data,
                                      .ld_w_u = w_u.size(1),
                                      .w_c = w_c.data,
                                      .ld_w_c = w_c.size(1),
                                      .bias = bias ? bias->data : nullptr};
  return LinearPlan(std::make_shared<State>(prepare(weights, w_u.device, stream)));
}

LinearPlan LinearPlan::from_concatenated(const Tensor& weight, std::int64_t num_user_features,
                                         const Tensor* bias, Stream stream) {
  check_float_dtype(weight.dtype, "weight");
  check_tensor(weight, "weight", weight.dtype, weight.device, 2);
  const std::int64_t out_features = weight.size(0), in_features = weight.size(1);
  require(out_features >= 1, "weight dimension 0 (N_out) must be >= 1, got ", out_features);
  require(in_features >= 2, "weight dimension 1 (Ku + Kc) must be >= 2, got ", in_features);
  require(num_user_features >= 1 && num_user_features < in_features,
          "num_user_features (Ku) must be in [1, ", in_features - 1,
          "] so that user and candidate features both have columns of weight [", out_features, ", ",
          in_features, "], got ", num_user_features);
  check_bias(bias, weight, "weight");
  const std::int64_t element_bytes = static_cast<std::int64_t>(dtype_size(weight.dtype));
  const detail::LinearWeights weights{
      .dtype = weight.dtype,
      .out_features = out_features,
      .ku = num_user_features,
      .kc = in_features - num_user_features,
      .w_u = weight.data,
      .ld_w_u = in_features,
      .w_c = static_cast<const char*>(weight.data) + num_user_features * element_bytes,
      .ld_w_c = in_features,
      .bias = bias ? bias->data : nullptr};
  return LinearPlan(std::make_shared<State>(prepare(weights, weight.device, stream)));
}

DType LinearPlan::dtype() const { return state_->dtype; }
Device LinearPlan::device() const { return state_->device; }
std::int64_t LinearPlan::out_features() const { return state_->out_features; }
std::int64_t LinearPlan::ku() const { return state_->ku; }
std::int64_t LinearPlan::kc() const { return state_->kc; }
bool LinearPlan::has_bias() const { return state_->bias != nullptr; }

std::size_t linear_workspace_bytes(const LinearPlan& plan, const Tensor& x_c, const Tensor& x_u,
                                   const CandidateMap& map) {
  const auto args = check_inputs(plan, x_c, x_u, map);
  return linear_workspace_bytes(plan, args.num_candidates, args.num_users);
}

std::size_t linear_workspace_bytes(const LinearPlan& plan, std::int64_t num_candidates,
                                   std::int64_t num_users) {
  detail::check_extent(num_candidates, "num_candidates (B)", 0);
  detail::check_extent(num_users, "num_users (U)", 1);
  if (!plan.device().is_cuda()) return 0;
  return detail::cuda::linear_workspace_bytes(plan.state(), num_candidates, num_users);
}

void linear(const LinearPlan& plan, const Tensor& x_c, const Tensor& x_u, const CandidateMap& map,
            const Tensor& out, Stream stream, Workspace workspace) {
  const detail::LinearArgs args =
      detail::check_linear_call(plan, x_c, x_u, map, out, stream, workspace);
  if (args.num_candidates == 0) return;
  if (plan.device().is_cuda()) {
    detail::cuda::linear(args);
  } else {
    detail::cpu::linear(args);
  }
}

namespace detail {

LinearArgs check_linear_call(const LinearPlan& plan, const Tensor& x_c, const Tensor& x_u,
                             const CandidateMap& map, const Tensor& out, Stream stream,
                             Workspace workspace) {
  auto args = check_inputs(plan, x_c, x_u, map);
  check_tensor(out, "out", plan.dtype(), plan.device(), 2);
  check_shape(out, "out", {args.num_candidates, plan.out_features()}, "[B, N_out]");
  check_no_overlap(out, "out", x_c, "x_c");
  check_no_overlap(out, "out", x_u, "x_u");
  args.out = out.data;
  args.stream = stream;
  args.workspace = workspace.data;
  args.workspace_bytes = workspace.bytes;
  if (args.num_candidates > 0 && plan.device().is_cuda()) {
    const std::size_t needed =
        cuda::linear_workspace_bytes(plan.state(), args.num_candidates, args.num_users);
    check_workspace(workspace, needed, "linear_workspace_bytes");
  }
  return args;
}

}  // namespace detail
}  // namespace ikbo
