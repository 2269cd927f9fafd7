// Internal: the standard (broadcast) way of computing the IKBO ops, kept as
// test oracles and as the baselines ikbo-bench compares against. Each
// broadcast baseline first replicates user-side tensors to the candidate
// batch (the copy IKBO avoids), then runs the op as if every candidate had
// its own user. For LCE, the stages of the published optimization staircase
// between broadcast and IKBO are baselines too (decomposed, aligned, fused).
// Tensors follow the public layouts; the device is taken from the inputs.
#pragma once

#include <cstddef>
#include <memory>
#include <optional>
#include <string>

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

// ---- The LCE staircase ----
// "decomposed" (published stage 1): user_out[u] = w_u @ e_u[u] and
// out[b] = w_c @ e_c[b] as two cuBLAS GEMMs (fp32 accumulation, each result
// rounded to the dtype), then the gather-add out[b] += user_out[cand_to_user[b]]
// (rounded again), on the caller's weights w_c [M, Kc], w_u [M, Ku] and
// inputs exactly as given. "aligned" (stage 2) is the same call on copies
// whose K was zero-padded to a multiple of 8 beforehand (pad_k). CUDA only:
// on the CPU, ikbo::lce itself computes the decomposed form.
std::size_t lce_decomposed_workspace_bytes(const Tensor& w_c, const Tensor& e_c, const Tensor& e_u);
void lce_decomposed(const Tensor& w_c, const Tensor& w_u, const Tensor& e_c, const Tensor& e_u,
                    const CandidateMap& map, const Tensor& out, Stream stream = nullptr,
                    Workspace workspace = {});

// dst = src with dimension 1 (K) zero-padded to dst's extent:
// [rows, K] -> [rows, K'] or [batch, K, N] -> [batch, K', N]. Stream-ordered.
void pad_k(const Tensor& src, const Tensor& dst, Stream stream = nullptr);

// "fused" (stage 3): ikbo::lce's call (same arguments, same workspace) on the
// Hopper kernel with the user GEMM in a launch of its own, then the
// candidate GEMM adding the user partial in its epilogue. lce_fused_blocker
// says why this call cannot run here (not a Hopper GPU, shapes the kernel
// does not take, ...), or nullopt; lce_fused throws with that reason.
std::optional<std::string> lce_fused_blocker(const LcePlan& plan, const Tensor& e_c,
                                             const Tensor& e_u, const CandidateMap& map,
                                             const Tensor& out, Workspace workspace);
void lce_fused(const LcePlan& plan, const Tensor& e_c, const Tensor& e_u, const CandidateMap& map,
               const Tensor& out, Stream stream = nullptr, Workspace workspace = {});

// ---- linear ----
// The copy: x_full[b] = [x_u[cand_to_user[b]] | x_c[b]], x_full [B, Ku + Kc].
void replicate_linear_input(const Tensor& x_c, const Tensor& x_u, const CandidateMap& map,
                            const Tensor& x_full, Stream stream = nullptr);

// The GEMM over the copy: out [B, N_out] = x_full @ weight^T + bias, with
// torch's weight [N_out, Ku + Kc] and bias [N_out] (or null) as given, what
// F.linear runs: on a GPU one cuBLASLt matmul with a bias epilogue, on the
// CPU one sgemm onto the bias rows (fp32 accumulation, one rounding).
std::size_t linear_concat_workspace_bytes(const Tensor& weight);
void linear_concat(const Tensor& weight, const Tensor* bias, const Tensor& x_full,
                   const Tensor& out, Stream stream = nullptr, Workspace workspace = {});

// "decomposed": ikbo::linear's call (same arguments, same workspace) on the
// three-step cuBLAS path whatever the GPU: the user GEMM with the bias at U
// rows, the candidate GEMM at B rows into fp32 partials, and a kernel adding
// the gathered user partial (one rounding). CUDA only.
void linear_decomposed(const LinearPlan& plan, const Tensor& x_c, const Tensor& x_u,
                       const CandidateMap& map, const Tensor& out, Stream stream = nullptr,
                       Workspace workspace = {});

// The copy for attention: kv_full[b] = kv[cand_to_user[b]], dense [U, S, H, D] -> [B, S, H, D].
// Attention on the copies is ikbo::attention with CandidateMap::identity(B).
void replicate_kv(const Tensor& kv, const CandidateMap& map, const Tensor& kv_full,
                  Stream stream = nullptr);

}  // namespace ikbo::baseline
