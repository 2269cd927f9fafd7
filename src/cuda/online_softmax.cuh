// src/cuda/online_softmax.cuh — the running maximum of the attention
// kernels' online softmax, shared by the Hopper and the portable kernels.
#pragma once

#include <cfloat>

namespace ikbo::detail::cuda {

// A row's new running maximum (scaled, log2 domain) from its previous one
// (-inf before the first block) and the maximum of a block's valid scores.
// It never goes below the lowest finite float: while every key so far has
// scored -inf (an infinite key or query), exp2(score - maximum) must be
// exp2(-inf) = 0 and the correction exp2(previous - maximum) finite, where
// -inf - (-inf) would make both NaN. Against that floor a later finite
// score's exponential overflows, so the lazy rescaling check of the Hopper
// kernel fails and the block takes the rescaling path, whose correction is
// then exp2(-FLT_MAX - maximum) = 0 on the zero sums and O. A row whose
// every key scores -inf ends with a sum of 0, and the epilogues turn that
// into zeros, as for a user without keys. A finite maximum is never below
// the floor, so every other row is unchanged.
__device__ __forceinline__ float running_max(float previous, float block_max) {
  return fmaxf(fmaxf(previous, block_max), -FLT_MAX);
}

}  // namespace ikbo::detail::cuda
