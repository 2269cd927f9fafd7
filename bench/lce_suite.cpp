// lce_suite.cpp — the LCE suite: ikbo::lce against the broadcast baseline,
// one GEMM over the replicated, concatenated input (baseline::lce_concat with
// w_full = [w_u | w_c] and e_full[b] = [e_u[u(b)] ; e_c[b]]), timed without
// and with the replication copy (baseline::replicate_lce_input).
//
// Work, the same for every variant so TFLOP/s compares directly: FLOPs are
// the IKBO useful work 2*M*N*(B*Kc + U*Ku) (the broadcast GEMM performs
// 2*M*N*B*(Ku+Kc); the difference is the redundancy IKBO removes); minimum
// bytes read e_c, e_u, w_c and w_u once and write out once.
//
// Inputs: one buffer per tensor sized for the largest shape and filled once
// with values uniform in [-1, 1) (weights scaled by 1/sqrt(Ku + Kc)); each
// shape views a prefix, which is itself random data of the smaller shape.
// Plans, maps, workspaces and replicated copies are made outside the timing.
#include <algorithm>
#include <cmath>
#include <exception>
#include <iostream>
#include <memory>
#include <vector>

#include "baselines.hpp"
#include "device_resources.hpp"
#include "random.hpp"
#include "suite.hpp"
#include "workload.hpp"

namespace ikbo::bench {
namespace {

constexpr std::uint64_t kWeightCandidateSeed = 11;
constexpr std::uint64_t kWeightUserSeed = 12;
constexpr std::uint64_t kEmbeddingCandidateSeed = 13;
constexpr std::uint64_t kEmbeddingUserSeed = 14;
constexpr std::uint64_t kMapSeed = 15;

// The weights prepared once for the whole suite: the IKBO plan over w_c, w_u
// and the baseline's plan over the concatenation of the same values.
struct LcePlans {
  LcePlan ikbo;
  std::shared_ptr<const LcePlan::State> concat;
};

LcePlans prepare_plans(const BenchContext& context) {
  const LceDims& dims = context.options.lce;
  const DType dtype = context.options.dtype;
  const Device device = context.device();
  const std::size_t element = dtype_size(dtype);
  const float scale = 1.0f / std::sqrt(static_cast<float>(dims.ku + dims.kc));
  const auto w_c_host = random_values(dtype, dims.m * dims.kc, scale, kWeightCandidateSeed);
  const auto w_u_host = random_values(dtype, dims.m * dims.ku, scale, kWeightUserSeed);
  const std::size_t row_c = static_cast<std::size_t>(dims.kc) * element;
  const std::size_t row_u = static_cast<std::size_t>(dims.ku) * element;
  std::vector<std::byte> w_full_host;
  w_full_host.reserve(w_c_host.size() + w_u_host.size());
  for (std::size_t row = 0; row < static_cast<std::size_t>(dims.m); ++row) {
    w_full_host.insert(w_full_host.end(), w_u_host.begin() + row * row_u,
                       w_u_host.begin() + (row + 1) * row_u);
    w_full_host.insert(w_full_host.end(), w_c_host.begin() + row * row_c,
                       w_c_host.begin() + (row + 1) * row_c);
  }
  const Buffer w_c(w_c_host.size(), device), w_u(w_u_host.size(), device),
      w_full(w_full_host.size(), device);
  upload(w_c, w_c_host, context.stream());
  upload(w_u, w_u_host, context.stream());
  upload(w_full, w_full_host, context.stream());
  return {LcePlan::create(Tensor(w_c.data(), dtype, {dims.m, dims.kc}, device),
                          Tensor(w_u.data(), dtype, {dims.m, dims.ku}, device), context.stream()),
          baseline::prepare_concat_lce_plan(
              Tensor(w_full.data(), dtype, {dims.m, dims.ku + dims.kc}, device), context.stream())};
}

Work lce_work(const LceDims& dims, std::int64_t batch, std::int64_t users, DType dtype) {
  const auto m = static_cast<double>(dims.m), n = static_cast<double>(dims.n),
             ku = static_cast<double>(dims.ku), kc = static_cast<double>(dims.kc),
             b = static_cast<double>(batch), u = static_cast<double>(users);
  return {2.0 * m * n * (b * kc + u * ku),
          static_cast<double>(dtype_size(dtype)) *
              (b * kc * n + u * ku * n + m * (ku + kc) + b * m * n)};
}

}  // namespace

std::vector<Record> run_lce_suite(const BenchContext& context) {
  const Options& options = context.options;
  const LceDims& dims = options.lce;
  const DType dtype = options.dtype;
  const Device device = context.device();
  const Stream stream = context.stream();
  const auto element = static_cast<std::int64_t>(dtype_size(dtype));

  std::int64_t max_batch = 0, max_users = 0;
  for (const LceShape& shape : options.lce_shapes) {
    max_batch = std::max(max_batch, shape.batch);
    max_users = std::max(max_users, users_for_ratio(shape.batch, shape.ratio));
  }
  std::cerr << "lce: preparing weights and inputs\n";
  const LcePlans plans = prepare_plans(context);
  const Buffer e_c(static_cast<std::size_t>(max_batch * dims.kc * dims.n * element), device);
  const Buffer e_u(static_cast<std::size_t>(max_users * dims.ku * dims.n * element), device);
  const Buffer out(static_cast<std::size_t>(max_batch * dims.m * dims.n * element), device);
  fill_uniform(e_c, dtype, max_batch * dims.kc * dims.n, 1.0f, kEmbeddingCandidateSeed, stream);
  fill_uniform(e_u, dtype, max_users * dims.ku * dims.n, 1.0f, kEmbeddingUserSeed, stream);

  std::vector<Record> results;
  for (const LceShape& shape : options.lce_shapes) {
    const std::int64_t batch = shape.batch;
    const std::int64_t users = users_for_ratio(batch, shape.ratio);
    ShapeRecords records(context, "lce",
                         {{"B", batch},
                          {"ratio", shape.ratio},
                          {"U", users},
                          {"M", dims.m},
                          {"N", dims.n},
                          {"Ku", dims.ku},
                          {"Kc", dims.kc}},
                         lce_work(dims, batch, users, dtype));
    try {
      const auto cand_to_user =
          make_cand_to_user(candidate_counts(batch, users), options.sorted_map, kMapSeed);
      const CandidateMap map =
          CandidateMap::build(cand_to_user.data(), batch, users, device, stream);
      const Tensor e_c_view(e_c.data(), dtype, {batch, dims.kc, dims.n}, device);
      const Tensor e_u_view(e_u.data(), dtype, {users, dims.ku, dims.n}, device);
      const Tensor out_view(out.data(), dtype, {batch, dims.m, dims.n}, device);

      const Buffer workspace(lce_workspace_bytes(plans.ikbo, e_c_view, e_u_view, map), device);
      records.measure(kIkbo, [&] {
        lce(plans.ikbo, e_c_view, e_u_view, map, out_view, stream,
            {workspace.data(), workspace.bytes()});
      });

      const auto full_bytes =
          static_cast<std::size_t>(batch * (dims.ku + dims.kc) * dims.n * element);
      if (const auto blocker = replication_blocker(device, full_bytes)) {
        records.skip(kBroadcast, *blocker);
        records.skip(kBroadcastCopy, *blocker);
      } else {
        const Buffer e_full(full_bytes, device);
        const Tensor e_full_view(e_full.data(), dtype, {batch, dims.ku + dims.kc, dims.n}, device);
        const Buffer concat_workspace(
            baseline::lce_concat_workspace_bytes(*plans.concat, e_full_view), device);
        auto replicate = [&] {
          baseline::replicate_lce_input(e_c_view, e_u_view, map, e_full_view, stream);
        };
        auto gemm = [&] {
          baseline::lce_concat(*plans.concat, e_full_view, out_view, stream,
                               {concat_workspace.data(), concat_workspace.bytes()});
        };
        replicate();  // "broadcast" times the GEMM alone, on copies made beforehand
        records.measure(kBroadcast, gemm);
        records.measure(kBroadcastCopy, [&] {
          replicate();
          gemm();
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
