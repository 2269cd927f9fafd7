// ikbo/attention.hpp — target attention from candidate queries onto their
// user's history, with K/V read once per user (no broadcast copy).
//
//   out[b, :, h, :] = softmax(scale * q[b,:,h,:] @ k[u,:,h,:]^T) @ v[u,:,h,:],  u = cand_to_user[b]
//
// q, out [B, n_seed, H, D]. K/V either dense [U, S, H, D] (every user has S
// keys) or jagged [total, H, D] with offsets [U + 1] (user u owns rows
// offsets[u] .. offsets[u+1]). Non-causal; scale defaults to 1/sqrt(D).
// A user with an empty history (jagged length 0) gets an output of zeros, as
// does a query row whose every key scores -inf (infinite inputs); a key
// scoring -inf gets weight 0.
// Dtypes f16, bf16 or f32 (all of q, k, v, out alike); D in {64, 128, 256};
// any n_seed >= 1, H >= 1. Softmax and accumulation in fp32.
#pragma once

#include <cstdint>
#include <optional>

#include "ikbo/candidate_map.hpp"
#include "ikbo/tensor.hpp"

namespace ikbo {

// Validates every argument (ikbo::Error, nothing written, on any mismatch),
// then computes out. `kv_offsets` null means dense K/V. On CUDA the call is
// asynchronous on `stream`, allocates nothing and never synchronizes.
//
// `workspace` is optional. A call with fewer query tiles (128 query rows of
// one user and head) than the GPU can keep busy uses it on Hopper GPUs to
// split each tile's keys into ranges run side by side, whose partial
// results it combines in a second launch (bitwise repeatable; not bitwise
// equal to the unsplit result). Without a workspace such a call runs
// unsplit, on fewer SMs. A workspace given must hold
// attention_workspace_bytes() bytes.
void attention(const Tensor& q, const Tensor& k, const Tensor& v, const CandidateMap& map,
               const Tensor& out, const JaggedOffsets* kv_offsets = nullptr,
               std::optional<float> scale = std::nullopt, Stream stream = nullptr,
               Workspace workspace = {});

// Bytes of workspace attention() can use for these inputs: 0 on the CPU,
// on GPUs without the Hopper path and for calls with enough query tiles.
// Validates the arguments as attention() does (without out and scale).
std::size_t attention_workspace_bytes(const Tensor& q, const Tensor& k, const Tensor& v,
                                      const CandidateMap& map,
                                      const JaggedOffsets* kv_offsets = nullptr);

}  // namespace ikbo
