// linear_suite.cpp — the linear suite: ikbo::linear, the first MLP layer of
// examples/ranking_model (N_out = 512 over Ku = 256 user and Kc = 3976
// candidate features), against
//   broadcast       F.linear's GEMM on the replicated, concatenated input:
//                   baseline::linear_concat (one cuBLASLt matmul with the
//                   bias epilogue; on the CPU one sgemm onto the bias rows)
//                   over x_full[b] = [x_u[u(b)] | x_c[b]], made beforehand;
//   broadcast+copy  the same with the replication (baseline::replicate_linear_input);
//   decomposed      baseline::linear_decomposed: ikbo::linear's cuBLAS path
//                   (user GEMM with the bias at U rows, candidate GEMM at B
//                   rows into fp32 partials, combine kernel) on any GPU; on
//                   a Hopper GPU ikbo runs the kernel that adds the user part
//                   in the GEMM epilogue instead. On the CPU it is skipped:
//                   the CPU backend's ikbo computes that decomposed form.
//
// Work, the same for every variant (python/ikbo/bench.py's linear suite):
// FLOPs = 2*N_out*(B*Kc + U*Ku); minimum bytes read x_c, x_u, the weight and
// the bias once and write out once.
//
// Inputs: buffers sized for the largest shape, filled once with values
// uniform in [-1, 1) (weight and bias scaled by 1/sqrt(Ku + Kc)); each shape
// views a prefix. The plan, maps, workspaces and copies are made outside the
// timing.
#include <algorithm>
#include <cmath>
#include <exception>
#include <iostream>
#include <vector>

#include "baselines.hpp"
#include "device_resources.hpp"
#include "random.hpp"
#include "suite.hpp"
#include "workload.hpp"

namespace ikbo::bench {
namespace {

constexpr std::uint64_t kWeightSeed = 31;
constexpr std::uint64_t kBiasSeed = 32;
constexpr std::uint64_t kCandidateSeed = 33;
constexpr std::uint64_t kUserSeed = 34;
constexpr std::uint64_t kMapSeed = 35;

Work linear_work(const LinearDims& dims, std::int64_t batch, std::int64_t users, DType dtype) {
  const auto n = static_cast<double>(dims.out_features), ku = static_cast<double>(dims.ku),
             kc = static_cast<double>(dims.kc), b = static_cast<double>(batch),
             u = static_cast<double>(users);
  return {2.0 * n * (b * kc + u * ku),
          static_cast<double>(dtype_size(dtype)) * (b * kc + u * ku + n * (ku + kc) + n + b * n)};
}

}  // namespace

std::vector<Record> run_linear_suite(const BenchContext& context) {
  const Options& options = context.options;
  const LinearDims& dims = options.linear;
  const DType dtype = options.dtype;
  const Device device = context.device();
  const Stream stream = context.stream();
  const auto element = static_cast<std::int64_t>(dtype_size(dtype));
  const std::int64_t in_features = dims.ku + dims.kc;

  std::int64_t max_batch = 0, max_users = 0;
  for (const BatchShape& shape : options.linear_shapes) {
    max_batch = std::max(max_batch, shape.batch);
    max_users = std::max(max_users, users_for_ratio(shape.batch, shape.ratio));
  }
  std::cerr << "linear: preparing weights and inputs\n";
  const float scale = 1.0f / std::sqrt(static_cast<float>(in_features));
  const Buffer weight(static_cast<std::size_t>(dims.out_features * in_features * element), device);
  const Buffer bias(static_cast<std::size_t>(dims.out_features * element), device);
  fill_uniform(weight, dtype, dims.out_features * in_features, scale, kWeightSeed, stream);
  fill_uniform(bias, dtype, dims.out_features, scale, kBiasSeed, stream);
  const Tensor weight_view(weight.data(), dtype, {dims.out_features, in_features}, device);
  const Tensor bias_view(bias.data(), dtype, {dims.out_features}, device);
  const LinearPlan plan = LinearPlan::from_concatenated(weight_view, dims.ku, &bias_view, stream);

  const Buffer x_c(static_cast<std::size_t>(max_batch * dims.kc * element), device);
  const Buffer x_u(static_cast<std::size_t>(max_users * dims.ku * element), device);
  const Buffer out(static_cast<std::size_t>(max_batch * dims.out_features * element), device);
  fill_uniform(x_c, dtype, max_batch * dims.kc, 1.0f, kCandidateSeed, stream);
  fill_uniform(x_u, dtype, max_users * dims.ku, 1.0f, kUserSeed, stream);

  std::vector<Record> results;
  for (const BatchShape& shape : options.linear_shapes) {
    const std::int64_t batch = shape.batch;
    const std::int64_t users = users_for_ratio(batch, shape.ratio);
    ShapeRecords records(context, "linear", kLinearVariants,
                         {{"B", batch},
                          {"ratio", shape.ratio},
                          {"U", users},
                          {"N_out", dims.out_features},
                          {"Ku", dims.ku},
                          {"Kc", dims.kc}},
                         linear_work(dims, batch, users, dtype));
    try {
      const CandidateMap map =
          request_map(batch, users, options.sorted_map, kMapSeed, device, stream);
      const Tensor x_c_view(x_c.data(), dtype, {batch, dims.kc}, device);
      const Tensor x_u_view(x_u.data(), dtype, {users, dims.ku}, device);
      const Tensor out_view(out.data(), dtype, {batch, dims.out_features}, device);
      const Buffer workspace(linear_workspace_bytes(plan, x_c_view, x_u_view, map), device);
      const Workspace ikbo_workspace{workspace.data(), workspace.bytes()};
      records.measure(
          kIkbo, [&] { linear(plan, x_c_view, x_u_view, map, out_view, stream, ikbo_workspace); });

      const auto full_bytes = static_cast<std::size_t>(batch * in_features * element);
      if (const auto blocker = replication_blocker(device, full_bytes)) {
        records.skip(kBroadcast, *blocker);
        records.skip(kBroadcastCopy, *blocker);
      } else {
        const Buffer x_full(full_bytes, device);
        const Tensor x_full_view(x_full.data(), dtype, {batch, in_features}, device);
        const Buffer concat_workspace(baseline::linear_concat_workspace_bytes(weight_view),
                                      device);
        const Workspace gemm_workspace{concat_workspace.data(), concat_workspace.bytes()};
        auto replicate = [&] {
          baseline::replicate_linear_input(x_c_view, x_u_view, map, x_full_view, stream);
        };
        auto gemm = [&] {
          baseline::linear_concat(weight_view, &bias_view, x_full_view, out_view, stream,
                                  gemm_workspace);
        };
        replicate();  // "broadcast" times the GEMM alone, on a copy made beforehand
        records.measure(kBroadcast, gemm);
        records.measure(kBroadcastCopy, [&] {
          replicate();
          gemm();
        });
      }
      if (!device.is_cuda()) {
        records.skip(kDecomposed,
                     "a cuBLAS baseline; on the CPU, ikbo itself computes the decomposed form");
      } else {
        records.measure(kDecomposed, [&] {
          baseline::linear_decomposed(plan, x_c_view, x_u_view, map, out_view, stream,
                                      ikbo_workspace);
        });
      }
    } catch (const std::exception& error) {
      records.fail_remaining(error.what());
    }
    for (Record& record : records.finish()) results.push_back(std::move(record));
  }
  return results;
}

}  // namespace ikbo::bench
