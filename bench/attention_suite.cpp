// attention_suite.cpp — the attention suite: ikbo::attention, which reads
// each user's K/V once, against the broadcast baseline: K/V replicated to
// [B, S, H, D] (baseline::replicate_kv) and the same kernel run with
// CandidateMap::identity(B), timed without and with the two copies.
//
// Work, the same for every variant: FLOPs = 4*H*n_seed*D * (sum over
// candidates of their user's history length), i.e. 4*B*H*n_seed*D*S for
// dense K/V; minimum bytes read q and each user's K and V once and write out
// once. Jagged K/V (--jagged): per-user lengths uniform in [S/2, 3S/2]; the
// broadcast variants are skipped there, the baseline replicates dense K/V only.
//
// Inputs: q, k, v buffers sized for the largest shape, filled once with
// values uniform in [-1, 1); each shape views a prefix. Maps, offsets and
// replicated copies are made outside the timing.
#include <algorithm>
#include <exception>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

#include "baselines.hpp"
#include "device_resources.hpp"
#include "suite.hpp"
#include "workload.hpp"

namespace ikbo::bench {
namespace {

constexpr std::uint64_t kQuerySeed = 21;
constexpr std::uint64_t kKeySeed = 22;
constexpr std::uint64_t kValueSeed = 23;
constexpr std::uint64_t kMapSeed = 24;
constexpr std::uint64_t kHistorySeed = 25;

// One shape's request: users, the mapping and the K/V rows per user.
struct RequestLayout {
  AttentionShape shape;
  std::int64_t users = 0;
  std::vector<std::int32_t> cand_to_user;
  std::vector<std::int32_t> history_offsets;  // [U + 1]; empty for dense K/V
  std::int64_t kv_rows = 0;                   // U * S dense, offsets[U] jagged
  std::int64_t attended_keys = 0;             // sum over candidates of their user's length
};

RequestLayout make_layout(const AttentionShape& shape, const Options& options) {
  RequestLayout layout;
  layout.shape = shape;
  layout.users = users_for_ratio(shape.batch, shape.ratio);
  const auto counts = candidate_counts(shape.batch, layout.users);
  layout.cand_to_user = make_cand_to_user(counts, options.sorted_map, kMapSeed);
  if (!options.attention.jagged) {
    layout.kv_rows = layout.users * shape.seq_len;
    layout.attended_keys = shape.batch * shape.seq_len;
    return layout;
  }
  layout.history_offsets = jagged_history_offsets(layout.users, shape.seq_len, kHistorySeed);
  layout.kv_rows = layout.history_offsets.back();
  for (std::size_t user = 0; user < counts.size(); ++user) {
    layout.attended_keys += std::int64_t{counts[user]} *
                            (layout.history_offsets[user + 1] - layout.history_offsets[user]);
  }
  return layout;
}

Work attention_work(const AttentionDims& dims, const RequestLayout& layout, DType dtype) {
  const double row = static_cast<double>(dims.heads * dims.head_dim);
  const double query_rows = static_cast<double>(layout.shape.batch * dims.n_seed);
  return {4.0 * static_cast<double>(dims.n_seed) * row * static_cast<double>(layout.attended_keys),
          static_cast<double>(dtype_size(dtype)) * row *
              (2.0 * query_rows + 2.0 * static_cast<double>(layout.kv_rows))};
}

}  // namespace

std::vector<Record> run_attention_suite(const BenchContext& context) {
  const Options& options = context.options;
  const AttentionDims& dims = options.attention;
  const DType dtype = options.dtype;
  const Device device = context.device();
  const Stream stream = context.stream();
  const std::int64_t element = static_cast<std::int64_t>(dtype_size(dtype));
  const std::int64_t row = dims.heads * dims.head_dim;

  std::vector<RequestLayout> layouts;
  std::int64_t max_query_rows = 0, max_kv_rows = 0;
  for (const AttentionShape& shape : options.attention_shapes) {
    layouts.push_back(make_layout(shape, options));
    max_query_rows = std::max(max_query_rows, shape.batch * dims.n_seed);
    max_kv_rows = std::max(max_kv_rows, layouts.back().kv_rows);
  }
  std::cerr << "attention: preparing inputs\n";
  const Buffer q(static_cast<std::size_t>(max_query_rows * row * element), device);
  const Buffer out(static_cast<std::size_t>(max_query_rows * row * element), device);
  const Buffer k(static_cast<std::size_t>(max_kv_rows * row * element), device);
  const Buffer v(static_cast<std::size_t>(max_kv_rows * row * element), device);
  fill_uniform(q, dtype, max_query_rows * row, static_cast<float>(dims.q_scale), kQuerySeed,
               stream);
  fill_uniform(k, dtype, max_kv_rows * row, 1.0f, kKeySeed, stream);
  fill_uniform(v, dtype, max_kv_rows * row, 1.0f, kValueSeed, stream);

  std::vector<Record> results;
  for (const RequestLayout& layout : layouts) {
    const std::int64_t batch = layout.shape.batch, seq_len = layout.shape.seq_len;
    std::vector<ShapeField> fields{
        {"B", batch},      {"ratio", layout.shape.ratio}, {"U", layout.users}, {"S", seq_len},
        {"H", dims.heads}, {"n_seed", dims.n_seed},       {"D", dims.head_dim}};
    if (dims.jagged) fields.push_back({"kv_rows", layout.kv_rows});
    if (dims.q_scale != 1) fields.push_back({"q_scale", dims.q_scale});
    ShapeRecords records(context, "attention", kAttentionVariants, std::move(fields),
                         attention_work(dims, layout, dtype), dims.jagged);
    try {
      const CandidateMap map =
          CandidateMap::build(layout.cand_to_user.data(), batch, layout.users, device, stream);
      std::optional<JaggedOffsets> offsets;
      if (dims.jagged) {
        offsets = JaggedOffsets::build(layout.history_offsets.data(), layout.users, layout.kv_rows,
                                       device, stream);
      }
      const Tensor q_view(q.data(), dtype, {batch, dims.n_seed, dims.heads, dims.head_dim}, device);
      const Tensor out_view(out.data(), dtype, {batch, dims.n_seed, dims.heads, dims.head_dim},
                            device);
      const Tensor k_view =
          dims.jagged
              ? Tensor(k.data(), dtype, {layout.kv_rows, dims.heads, dims.head_dim}, device)
              : Tensor(k.data(), dtype, {layout.users, seq_len, dims.heads, dims.head_dim}, device);
      Tensor v_view = k_view;
      v_view.data = v.data();
      // The workspace a call of few query tiles splits its keys with (none otherwise).
      const Buffer workspace(attention_workspace_bytes(q_view, k_view, v_view, map,
                                                       offsets ? &*offsets : nullptr),
                             device);
      records.measure(kIkbo, [&] {
        attention(q_view, k_view, v_view, map, out_view, offsets ? &*offsets : nullptr,
                  std::nullopt, stream, {workspace.data(), workspace.bytes()});
      });

      const auto full_bytes = static_cast<std::size_t>(2 * batch * seq_len * row * element);
      std::optional<std::string> blocker;
      if (dims.jagged) {
        blocker = "baseline::replicate_kv replicates dense K/V only";
      } else {
        blocker = replication_blocker(device, full_bytes);
      }
      if (blocker) {
        records.skip(kBroadcast, *blocker);
        records.skip(kBroadcastCopy, *blocker);
      } else {
        const Buffer k_full(full_bytes / 2, device), v_full(full_bytes / 2, device);
        const Tensor k_full_view(k_full.data(), dtype, {batch, seq_len, dims.heads, dims.head_dim},
                                 device);
        Tensor v_full_view = k_full_view;
        v_full_view.data = v_full.data();
        const CandidateMap identity = CandidateMap::identity(batch, device, stream);
        auto replicate = [&] {
          baseline::replicate_kv(k_view, map, k_full_view, stream);
          baseline::replicate_kv(v_view, map, v_full_view, stream);
        };
        auto attend = [&] {
          attention(q_view, k_full_view, v_full_view, identity, out_view, nullptr, std::nullopt,
                    stream);
        };
        replicate();  // "broadcast" times the kernel alone, on copies made beforehand
        records.measure(kBroadcast, attend);
        records.measure(kBroadcastCopy, [&] {
          replicate();
          attend();
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
