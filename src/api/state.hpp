// Internal: the shared state behind CandidateMap, JaggedOffsets, LcePlan and LinearPlan.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "ikbo/candidate_map.hpp"
#include "ikbo/lce.hpp"
#include "ikbo/linear.hpp"

namespace ikbo::detail::cuda {
struct WeightTensorMaps;  // src/cuda/sm90/weight_maps.cuh
}  // namespace ikbo::detail::cuda

namespace ikbo {

struct CandidateMap::State {
  std::int64_t num_candidates = 0;
  std::int64_t num_users = 0;
  Device device{};
  bool sorted = true;
  std::int64_t max_count = 0;
  std::vector<std::int32_t> cand_to_user;        // [B]
  std::vector<std::int32_t> user_counts;         // [U]
  std::vector<std::int32_t> user_offsets;        // [U + 1]
  std::vector<std::int32_t> candidates_by_user;  // [B]
  std::shared_ptr<void> device_storage;          // owns the arrays of device_view (null
                                                 // when they are in the caller's storage)
  CandidateMapDeviceView device_view{};
};

struct JaggedOffsets::State {
  std::int64_t num_users = 0;
  std::int64_t total_rows = 0;
  std::int64_t max_length = 0;
  Device device{};
  std::vector<std::int32_t> offsets;  // [U + 1]
  std::shared_ptr<void> device_storage;  // as CandidateMap::State's
  const std::int32_t* device_offsets = nullptr;
};

// Prepared weights. `w_c`/`w_u` point into `storage`, in `storage_dtype`
// (f32 on the CPU backend, the plan's dtype on CUDA), rows `ld_c`/`ld_u`
// elements apart (K rounded up to a multiple of 8, zero padded).
// Ku = 0 (w_u null) is allowed internally: the candidate-only GEMM the
// broadcast baselines run over concatenated inputs.
struct LcePlan::State {
  DType dtype = DType::f16;
  DType storage_dtype = DType::f16;
  Device device{};
  std::int64_t m = 0, ku = 0, kc = 0;
  std::int64_t ld_c = 0, ld_u = 0;
  const void* w_c = nullptr;
  const void* w_u = nullptr;
  std::shared_ptr<void> storage;
  // The Hopper kernels' tensor maps of w_u and w_c (CUDA plans the Hopper
  // path can take; null otherwise).
  std::shared_ptr<const detail::cuda::WeightTensorMaps> weight_maps;
};

// Prepared linear weights in torch's [N_out, K] layout, split into the user
// and candidate column blocks. `w_u`/`w_c` point into `storage`, in
// `storage_dtype` (f32 on the CPU backend, the plan's dtype on CUDA), rows
// `ld_u`/`ld_c` elements apart (K rounded up to a multiple of 8, zero
// padded); `bias` [N_out] likewise, null without a bias.
struct LinearPlan::State {
  DType dtype = DType::f16;
  DType storage_dtype = DType::f16;
  Device device{};
  std::int64_t out_features = 0, ku = 0, kc = 0;
  std::int64_t ld_u = 0, ld_c = 0;
  const void* w_u = nullptr;
  const void* w_c = nullptr;
  const void* bias = nullptr;
  std::shared_ptr<void> storage;
  // As LcePlan::State::weight_maps.
  std::shared_ptr<const detail::cuda::WeightTensorMaps> weight_maps;
};

}  // namespace ikbo
