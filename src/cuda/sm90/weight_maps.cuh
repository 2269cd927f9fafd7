// src/cuda/sm90/weight_maps.cuh — the tensor maps through which the Hopper
// kernels read a plan's weights, encoded once when the plan is prepared
// (everything that depends only on the weights lives in the plan, not in
// each call). The plan owns them through
// LcePlan::State / LinearPlan::State::weight_maps; a plan without them
// (another device, dtype or shape) never takes a Hopper path.
#pragma once

#include <cuda.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "cuda/ptx/tma.cuh"
#include "ikbo/error.hpp"

namespace ikbo::detail::cuda {

// The user and candidate weights, K-major ([rows, K], rows `ld` elements
// apart), in 64-k boxes of each row count a kernel loads.
struct WeightTensorMaps {
  struct Boxes {
    int rows;
    CUtensorMap user, candidate;
  };
  std::vector<Boxes> boxes;

  const Boxes& with_rows(int rows) const {
    for (const Boxes& entry : boxes) {
      if (entry.rows == rows) return entry;
    }
    throw RuntimeError("the plan has no weight tensor map with boxes of " + std::to_string(rows) +
                       " rows (internal error)");
  }
};

template <typename Element>
std::shared_ptr<const WeightTensorMaps> encode_weight_maps(
    const void* w_u, std::int64_t ku, std::int64_t ld_u, const void* w_c, std::int64_t kc,
    std::int64_t ld_c, std::int64_t rows, const std::vector<int>& box_rows) {
  auto maps = std::make_shared<WeightTensorMaps>();
  for (const int box : box_rows) {
    maps->boxes.push_back({box, ptx::k_major_map<Element>(w_u, ku, ld_u, rows, box),
                           ptx::k_major_map<Element>(w_c, kc, ld_c, rows, box)});
  }
  return maps;
}

}  // namespace ikbo::detail::cuda
