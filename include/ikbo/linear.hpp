// ikbo/linear.hpp — a linear layer over [user features | candidate features]
// with in-kernel broadcast (a Type I, decomposable op).
//
//   out[b] = x_c[b] @ w_c^T + x_u[cand_to_user[b]] @ w_u^T + bias
//
// the same as torch.nn.functional.linear(concat([x_u[cand_to_user], x_c], -1),
// weight, bias) with weight = [w_u | w_c] of shape [N_out, Ku + Kc] (torch's
// out_features x in_features layout), without the replicated user rows.
// x_c [B, Kc], x_u [U, Ku], w_u [N_out, Ku], w_c [N_out, Kc], bias [N_out]
// (optional), out [B, N_out]; all dense row-major, one dtype (f16, bf16 or
// f32), one device. The user part, bias included, is computed once per user
// in fp32 and added to the candidate part in fp32; out is rounded once.
// Any N_out, Ku, Kc >= 1 and B >= 0; maps may be unsorted and leave users
// without candidates.
//
// Usage:
//   auto plan = ikbo::LinearPlan::from_concatenated(weight, ku, &bias);  // once per weights
//   auto map  = ikbo::CandidateMap::build(idx, B, U, dev);               // once per request
//   std::size_t bytes = ikbo::linear_workspace_bytes(plan, x_c, x_u, map); // device memory on CUDA
//   ikbo::linear(plan, x_c, x_u, map, out, stream, {ws_ptr, bytes});
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "ikbo/candidate_map.hpp"
#include "ikbo/tensor.hpp"

namespace ikbo {

// The weights and bias, prepared once and reused by every request: rows
// padded to a 16-byte multiple (CUDA) or converted to fp32 (CPU). Holds its
// own copy; the caller's buffers may be freed. For CUDA the copy is ordered
// on `stream` and synchronized before returning.
class LinearPlan {
 public:
  // w_u [N_out, Ku] and w_c [N_out, Kc] (the column blocks of torch's weight,
  // in that order), bias [N_out] or null; one dtype, one device.
  static LinearPlan create(const Tensor& w_u, const Tensor& w_c, const Tensor* bias = nullptr,
                           Stream stream = nullptr);
  // torch's weight [N_out, Ku + Kc] itself: its first `num_user_features`
  // (Ku) columns multiply the user features, the rest the candidate features.
  static LinearPlan from_concatenated(const Tensor& weight, std::int64_t num_user_features,
                                      const Tensor* bias = nullptr, Stream stream = nullptr);

  DType dtype() const;
  Device device() const;
  std::int64_t out_features() const;  // N_out
  std::int64_t ku() const;
  std::int64_t kc() const;
  bool has_bias() const;

  struct State;
  const State& state() const { return *state_; }

 private:
  explicit LinearPlan(std::shared_ptr<const State> state) : state_(std::move(state)) {}
  std::shared_ptr<const State> state_;
};

// Bytes of workspace linear() needs for these shapes (0 on the CPU).
// Validates like linear() does.
std::size_t linear_workspace_bytes(const LinearPlan& plan, const Tensor& x_c, const Tensor& x_u,
                                   const CandidateMap& map);
// The same from the sizes alone (x_c [B, Kc], x_u [U, Ku]), e.g. to allocate
// a workspace before the inputs exist: B >= 0, U >= 1.
std::size_t linear_workspace_bytes(const LinearPlan& plan, std::int64_t num_candidates,
                                   std::int64_t num_users);

// Validates every argument (ikbo::Error, nothing written, on any mismatch),
// then computes out. On CUDA the call is asynchronous on `stream`, allocates
// nothing and never synchronizes (except the device's first call on the
// cuBLAS path, which creates its cuBLAS handle; see Workspace).
void linear(const LinearPlan& plan, const Tensor& x_c, const Tensor& x_u, const CandidateMap& map,
            const Tensor& out, Stream stream = nullptr, Workspace workspace = {});

}  // namespace ikbo
