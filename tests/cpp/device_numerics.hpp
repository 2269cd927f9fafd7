// GPU-side test numerics for problems too large for host references (the
// published LCE grid at B = 1024): inputs generated on the device and
// outputs compared on the device, so nothing of B x M x N size crosses to
// the host. Implemented in device_numerics.cu, built with CUDA only; tests
// call these after skipping where CUDA is missing.
#pragma once

#include <cstdint>

#include "ikbo/tensor.hpp"

namespace ikbo::test {

// values[i] = a uniform value in [-scale, scale) drawn from (seed, i) by a
// hash, rounded to `dtype`; when `values_f32` is not null it receives the
// same rounded values in fp32 (an exact conversion). Device pointers on the
// current CUDA device; synchronous.
void fill_uniform_on_device(void* values, DType dtype, float* values_f32, std::int64_t count,
                            float scale, std::uint64_t seed);

// max_i |actual[i] - expected[i]| over `count` elements, `actual` in `dtype`
// and `expected` in fp32 (device pointers); a NaN difference counts as
// infinity. Synchronous.
double max_abs_difference_on_device(const void* actual, DType dtype, const float* expected,
                                    std::int64_t count);

}  // namespace ikbo::test
