// ikbo/lce.hpp — linear compression of embeddings with in-kernel broadcast.
//
//   out[b] = w_c @ e_c[b] + w_u @ e_u[cand_to_user[b]]
//
// w_c [M, Kc], w_u [M, Ku], e_c [B, Kc, N], e_u [U, Ku, N], out [B, M, N];
// all dense row-major, one dtype (f16, bf16 or f32), one device. Products
// accumulate in fp32; the two partials are summed in fp32 and rounded once.
// Any M, N, Ku, Kc >= 1 and B >= 0; the caller never pads.
//
// Usage:
//   auto plan = ikbo::LcePlan::create(w_c, w_u);            // once per weights
//   auto map  = ikbo::CandidateMap::build(idx, B, U, dev);  // once per request
//   std::vector<std::byte> ws(ikbo::lce_workspace_bytes(plan, e_c, e_u, map)); // device memory on CUDA
//   ikbo::lce(plan, e_c, e_u, map, out, stream, {ws_ptr, ws_bytes});
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "ikbo/candidate_map.hpp"
#include "ikbo/tensor.hpp"

namespace ikbo {

// Everything that depends only on the weights, prepared once and reused by
// every request: W's K stride padded to 16 bytes (CUDA), or W converted to
// fp32 (CPU). Holds its own copy; the caller's weight buffers may be freed.
class LcePlan {
 public:
  // w_c [M, Kc] and w_u [M, Ku] of one dtype on one device. For CUDA the copy
  // is ordered on `stream` and synchronized before returning.
  static LcePlan create(const Tensor& w_c, const Tensor& w_u, Stream stream = nullptr);

  DType dtype() const;
  Device device() const;
  std::int64_t m() const;
  std::int64_t ku() const;
  std::int64_t kc() const;

  struct State;
  const State& state() const { return *state_; }

 private:
  explicit LcePlan(std::shared_ptr<const State> state) : state_(std::move(state)) {}
  std::shared_ptr<const State> state_;
};

// Bytes of workspace lce() needs for these shapes (0 on the CPU). Validates
// like lce() does.
std::size_t lce_workspace_bytes(const LcePlan& plan, const Tensor& e_c, const Tensor& e_u,
                                const CandidateMap& map);
// The same from the sizes alone (e_c [B, Kc, N], e_u [U, Ku, N]), e.g. to
// allocate a workspace before the inputs exist: n = N >= 1, B >= 0, U >= 1.
std::size_t lce_workspace_bytes(const LcePlan& plan, std::int64_t n, std::int64_t num_candidates,
                                std::int64_t num_users);

// Validates every argument (ikbo::Error, nothing written, on any mismatch),
// then computes out. On CUDA the call is asynchronous on `stream`.
void lce(const LcePlan& plan, const Tensor& e_c, const Tensor& e_u, const CandidateMap& map,
         const Tensor& out, Stream stream = nullptr, Workspace workspace = {});

}  // namespace ikbo
