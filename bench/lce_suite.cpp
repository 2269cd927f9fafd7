// lce_suite.cpp — the LCE suite: ikbo::lce against the published
// optimization staircase at every shape:
//   broadcast       one GEMM over the replicated, concatenated input
//                   (baseline::lce_concat with w_full = [w_u | w_c] and
//                   e_full[b] = [e_u[u(b)] ; e_c[b]]), copies made beforehand;
//   broadcast+copy  the same with the replication (baseline::replicate_lce_input);
//   decomposed      baseline::lce_decomposed on the caller's w_c, w_u, e_c, e_u;
//   aligned         the same on copies with K zero-padded to a multiple of 8
//                   (baseline::pad_k, beforehand; weights padded once);
//   fused           baseline::lce_fused (Hopper GPUs only).
// The staircase stages are CUDA kernels; on the CPU they are skipped.
//
// Work, the same for every variant so TFLOP/s compares directly: FLOPs are
// the IKBO useful work 2*M*N*(B*Kc + U*Ku) (the broadcast GEMM performs
// 2*M*N*B*(Ku+Kc); the difference is the redundancy IKBO removes); minimum
// bytes read e_c, e_u, w_c and w_u once and write out once.
//
// Inputs: one buffer per tensor sized for the largest shape and filled once
// with values uniform in [-1, 1) (weights scaled by 1/sqrt(Ku + Kc)); each
// shape views a prefix, which is itself random data of the smaller shape.
// Plans, maps, workspaces, replicated and padded copies are made outside the
// timing.
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
// The "aligned" stage pads K to a multiple of this (16-byte fp16 rows).
constexpr std::int64_t kAlignedKMultiple = 8;

std::int64_t aligned_k(std::int64_t k) {
  return (k + kAlignedKMultiple - 1) / kAlignedKMultiple * kAlignedKMultiple;
}

// The weights prepared once for the whole suite: the IKBO plan over w_c, w_u,
// the baseline's plan over the concatenation of the same values, and the
// weights as a framework would hold them for the staircase stages, as given
// and with K zero-padded.
struct LceWeights {
  LcePlan ikbo;
  std::shared_ptr<const LcePlan::State> concat;
  Buffer w_c, w_u;                  // [M, Kc], [M, Ku]
  Buffer w_c_aligned, w_u_aligned;  // [M, aligned Kc], [M, aligned Ku]
};

LceWeights prepare_weights(const BenchContext& context) {
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
  const Tensor w_c_view(w_c.data(), dtype, {dims.m, dims.kc}, device);
  const Tensor w_u_view(w_u.data(), dtype, {dims.m, dims.ku}, device);
  const std::int64_t kc_aligned = aligned_k(dims.kc), ku_aligned = aligned_k(dims.ku);
  const Buffer w_c_aligned(static_cast<std::size_t>(dims.m * kc_aligned) * element, device),
      w_u_aligned(static_cast<std::size_t>(dims.m * ku_aligned) * element, device);
  baseline::pad_k(w_c_view, Tensor(w_c_aligned.data(), dtype, {dims.m, kc_aligned}, device),
                  context.stream());
  baseline::pad_k(w_u_view, Tensor(w_u_aligned.data(), dtype, {dims.m, ku_aligned}, device),
                  context.stream());
  return {LcePlan::create(w_c_view, w_u_view, context.stream()),
          baseline::prepare_concat_lce_plan(
              Tensor(w_full.data(), dtype, {dims.m, dims.ku + dims.kc}, device), context.stream()),
          w_c, w_u, w_c_aligned, w_u_aligned};
}

Work lce_work(const LceDims& dims, std::int64_t batch, std::int64_t users, DType dtype) {
  const auto m = static_cast<double>(dims.m), n = static_cast<double>(dims.n),
             ku = static_cast<double>(dims.ku), kc = static_cast<double>(dims.kc),
             b = static_cast<double>(batch), u = static_cast<double>(users);
  return {2.0 * m * n * (b * kc + u * ku),
          static_cast<double>(dtype_size(dtype)) *
              (b * kc * n + u * ku * n + m * (ku + kc) + b * m * n)};
}

// The staircase stages decomposed, aligned and fused at one shape; `workspace`
// is ikbo::lce's for this call (the fused stage runs the same call).
void run_staircase(const BenchContext& context, const LceWeights& weights, const CandidateMap& map,
                   const Tensor& e_c, const Tensor& e_u, const Tensor& out, Workspace workspace,
                   ShapeRecords& records) {
  const Device device = context.device();
  const Stream stream = context.stream();
  if (!device.is_cuda()) {
    for (const std::string_view variant : {kDecomposed, kAligned, kFused}) {
      records.skip(variant,
                   "a CUDA stage (cuBLAS GEMMs, Hopper kernel); on the CPU, ikbo itself "
                   "computes the decomposed form");
    }
    return;
  }
  const LceDims& dims = context.options.lce;
  const DType dtype = context.options.dtype;
  const std::int64_t batch = e_c.size(0), users = e_u.size(0);
  const Tensor w_c(weights.w_c.data(), dtype, {dims.m, dims.kc}, device);
  const Tensor w_u(weights.w_u.data(), dtype, {dims.m, dims.ku}, device);
  const Buffer user_out_workspace(baseline::lce_decomposed_workspace_bytes(w_c, e_c, e_u), device);
  const Workspace decomposed_workspace{user_out_workspace.data(), user_out_workspace.bytes()};
  records.measure(kDecomposed, [&] {
    baseline::lce_decomposed(w_c, w_u, e_c, e_u, map, out, stream, decomposed_workspace);
  });

  const std::int64_t kc_aligned = aligned_k(dims.kc), ku_aligned = aligned_k(dims.ku);
  const std::size_t element = dtype_size(dtype);
  const auto e_c_bytes = static_cast<std::size_t>(batch * kc_aligned * dims.n) * element;
  const auto e_u_bytes = static_cast<std::size_t>(users * ku_aligned * dims.n) * element;
  if (const auto blocker =
          replication_blocker(device, e_c_bytes + e_u_bytes, "K-padded copies of e_c and e_u")) {
    records.skip(kAligned, *blocker);
  } else {
    const Buffer e_c_buffer(e_c_bytes, device), e_u_buffer(e_u_bytes, device);
    const Tensor e_c_aligned(e_c_buffer.data(), dtype, {batch, kc_aligned, dims.n}, device);
    const Tensor e_u_aligned(e_u_buffer.data(), dtype, {users, ku_aligned, dims.n}, device);
    const Tensor w_c_aligned(weights.w_c_aligned.data(), dtype, {dims.m, kc_aligned}, device);
    const Tensor w_u_aligned(weights.w_u_aligned.data(), dtype, {dims.m, ku_aligned}, device);
    baseline::pad_k(e_c, e_c_aligned, stream);  // "K padded beforehand": not timed
    baseline::pad_k(e_u, e_u_aligned, stream);
    records.measure(kAligned, [&] {
      baseline::lce_decomposed(w_c_aligned, w_u_aligned, e_c_aligned, e_u_aligned, map, out, stream,
                               decomposed_workspace);
    });
  }

  if (const auto blocker =
          baseline::lce_fused_blocker(weights.ikbo, e_c, e_u, map, out, workspace)) {
    records.skip(kFused, *blocker);
  } else {
    records.measure(
        kFused, [&] { baseline::lce_fused(weights.ikbo, e_c, e_u, map, out, stream, workspace); });
  }
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
  for (const BatchShape& shape : options.lce_shapes) {
    max_batch = std::max(max_batch, shape.batch);
    max_users = std::max(max_users, users_for_ratio(shape.batch, shape.ratio));
  }
  std::cerr << "lce: preparing weights and inputs\n";
  const LceWeights weights = prepare_weights(context);
  const Buffer e_c(static_cast<std::size_t>(max_batch * dims.kc * dims.n * element), device);
  const Buffer e_u(static_cast<std::size_t>(max_users * dims.ku * dims.n * element), device);
  const Buffer out(static_cast<std::size_t>(max_batch * dims.m * dims.n * element), device);
  fill_uniform(e_c, dtype, max_batch * dims.kc * dims.n, 1.0f, kEmbeddingCandidateSeed, stream);
  fill_uniform(e_u, dtype, max_users * dims.ku * dims.n, 1.0f, kEmbeddingUserSeed, stream);

  std::vector<Record> results;
  for (const BatchShape& shape : options.lce_shapes) {
    const std::int64_t batch = shape.batch;
    const std::int64_t users = users_for_ratio(batch, shape.ratio);
    ShapeRecords records(context, "lce", kLceVariants,
                         {{"B", batch},
                          {"ratio", shape.ratio},
                          {"U", users},
                          {"M", dims.m},
                          {"N", dims.n},
                          {"Ku", dims.ku},
                          {"Kc", dims.kc}},
                         lce_work(dims, batch, users, dtype));
    try {
      const CandidateMap map =
          request_map(batch, users, options.sorted_map, kMapSeed, device, stream);
      const Tensor e_c_view(e_c.data(), dtype, {batch, dims.kc, dims.n}, device);
      const Tensor e_u_view(e_u.data(), dtype, {users, dims.ku, dims.n}, device);
      const Tensor out_view(out.data(), dtype, {batch, dims.m, dims.n}, device);

      const Buffer workspace(lce_workspace_bytes(weights.ikbo, e_c_view, e_u_view, map), device);
      records.measure(kIkbo, [&] {
        lce(weights.ikbo, e_c_view, e_u_view, map, out_view, stream,
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
            baseline::lce_concat_workspace_bytes(*weights.concat, e_full_view), device);
        auto replicate = [&] {
          baseline::replicate_lce_input(e_c_view, e_u_view, map, e_full_view, stream);
        };
        auto gemm = [&] {
          baseline::lce_concat(*weights.concat, e_full_view, out_view, stream,
                               {concat_workspace.data(), concat_workspace.bytes()});
        };
        replicate();  // "broadcast" times the GEMM alone, on copies made beforehand
        records.measure(kBroadcast, gemm);
        records.measure(kBroadcastCopy, [&] {
          replicate();
          gemm();
        });
      }
      run_staircase(context, weights, map, e_c_view, e_u_view, out_view,
                    {workspace.data(), workspace.bytes()}, records);
    } catch (const std::exception& error) {
      records.fail_remaining(error.what());
    }
    for (Record& record : records.finish()) results.push_back(std::move(record));
  }
  return results;
}

}  // namespace ikbo::bench
