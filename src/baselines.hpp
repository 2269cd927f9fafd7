// Internal: the standard (broadcast) way of computing the IKBO ops, kept as
// test oracles and as the baselines ikbo-bench compares against. Each
// baseline first replicates user-side tensors to the candidate batch (the
// copy IKBO avoids), then runs the op as if every candidate had its own user.
// Tensors follow the public layouts; the device is taken from the inputs.
#pragma once

#include <memory>

#include "api/state.hpp"
#include "ikbo/ikbo.hpp"

namespace ikbo::baseline {

// The concatenated weight w = [w_u | w_c] of shape [M, Ku + Kc] prepared for
// the candidate-only GEMM (on the CPU: converted to fp32; on CUDA: padded).
std::shared_ptr<const LcePlan::State> prepare_concat_lce_plan(const Tensor& w_full,
                                                              Stream stream = nullptr);

// The copy: e_full[b] = concat_K(e_u[cand_to_user[b]], e_c[b]), e_full [B, Ku + Kc, N].
void replicate_lce_input(const Tensor& e_c, const Tensor& e_u, const CandidateMap& map,
                         const Tensor& e_full, Stream stream = nullptr);

// The GEMM: out[b] = w_full @ e_full[b].
std::size_t lce_concat_workspace_bytes(const LcePlan::State& plan, const Tensor& e_full);
void lce_concat(const LcePlan::State& plan, const Tensor& e_full, const Tensor& out,
                Stream stream = nullptr, Workspace workspace = {});

// The copy for attention: kv_full[b] = kv[cand_to_user[b]], dense [U, S, H, D] -> [B, S, H, D].
// Attention on the copies is ikbo::attention with CandidateMap::identity(B).
void replicate_kv(const Tensor& kv, const CandidateMap& map, const Tensor& kv_full,
                  Stream stream = nullptr);

}  // namespace ikbo::baseline
