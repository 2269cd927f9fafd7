// ikbo/ikbo.hpp — umbrella header of the ikbo library.
#pragma once

#include "ikbo/attention.hpp"
#include "ikbo/candidate_map.hpp"
#include "ikbo/error.hpp"
#include "ikbo/lce.hpp"
#include "ikbo/linear.hpp"
#include "ikbo/tensor.hpp"

namespace ikbo {

// True when the library was compiled with its CUDA backend.
bool built_with_cuda();
// Number of usable CUDA devices (0 without CUDA support or without a GPU).
int cuda_device_count();

}  // namespace ikbo
