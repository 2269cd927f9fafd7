// device_numerics.cu — the GPU-side fill and comparison of device_numerics.hpp:
// a SplitMix64 hash of (seed, index) per element for the fill, and a
// grid-stride max reduction (warp shuffles, then one atomicMax per block on
// the bits of a non-negative float, which order like the floats) for the
// comparison.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "cuda/dtype.cuh"
#include "device_numerics.hpp"
#include "ikbo/error.hpp"

namespace ikbo::test {
namespace {

using detail::cuda::dispatch_float_dtype;
using detail::cuda::from_float;
using detail::cuda::to_float;

constexpr int kThreads = 256;
constexpr int kMaxBlocks = 4096;

void check(cudaError_t status, const char* call) {
  if (status != cudaSuccess) {
    throw RuntimeError(std::string(call) + " failed: " + cudaGetErrorName(status) + ": " +
                       cudaGetErrorString(status));
  }
}
#define IKBO_NUMERICS_CHECK(call) check((call), #call)

int blocks_for(std::int64_t count) {
  return static_cast<int>(std::min<std::int64_t>(kMaxBlocks, (count + kThreads - 1) / kThreads));
}

__device__ std::uint64_t mix(std::uint64_t value) {
  value = (value ^ (value >> 30)) * 0xbf58476d1ce4e5b9ull;
  value = (value ^ (value >> 27)) * 0x94d049bb133111ebull;
  return value ^ (value >> 31);
}

template <typename Element>
__global__ void fill_uniform_kernel(Element* values, float* values_f32, std::int64_t count,
                                    float scale, std::uint64_t seed) {
  const std::int64_t step = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += step) {
    const std::uint64_t bits = mix(seed * 0x9e3779b97f4a7c15ull + static_cast<std::uint64_t>(i));
    // 24 random bits: uniform in [-1, 1) on a grid a float holds exactly.
    const float unit = static_cast<float>(bits >> 40) * 0x1p-23f - 1.0f;
    const Element value = from_float<Element>(unit * scale);
    values[i] = value;
    if (values_f32 != nullptr) values_f32[i] = to_float(value);
  }
}

template <typename Element>
__global__ void max_abs_difference_kernel(const Element* actual, const float* expected,
                                          std::int64_t count, unsigned* result_bits) {
  const std::int64_t step = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  float largest = 0.0f;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += step) {
    const float difference = fabsf(to_float(actual[i]) - expected[i]);
    largest = isnan(difference) ? INFINITY : fmaxf(largest, difference);
    if (isinf(largest)) break;
  }
  for (int offset = 16; offset > 0; offset /= 2) {
    largest = fmaxf(largest, __shfl_xor_sync(0xffffffffu, largest, offset));
  }
  __shared__ float warp_largest[kThreads / 32];
  if (threadIdx.x % 32 == 0) warp_largest[threadIdx.x / 32] = largest;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int warp = 1; warp < kThreads / 32; ++warp) largest = fmaxf(largest, warp_largest[warp]);
    atomicMax(result_bits, __float_as_uint(largest));
  }
}

}  // namespace

void fill_uniform_on_device(void* values, DType dtype, float* values_f32, std::int64_t count,
                            float scale, std::uint64_t seed) {
  if (count == 0) return;
  dispatch_float_dtype(dtype, [&](auto element) {
    using Element = decltype(element);
    fill_uniform_kernel<Element><<<blocks_for(count), kThreads>>>(static_cast<Element*>(values),
                                                                  values_f32, count, scale, seed);
  });
  IKBO_NUMERICS_CHECK(cudaGetLastError());
  IKBO_NUMERICS_CHECK(cudaDeviceSynchronize());
}

double max_abs_difference_on_device(const void* actual, DType dtype, const float* expected,
                                    std::int64_t count) {
  unsigned* result_bits = nullptr;
  IKBO_NUMERICS_CHECK(cudaMalloc(&result_bits, sizeof(unsigned)));
  unsigned bits = 0;
  try {
    IKBO_NUMERICS_CHECK(cudaMemset(result_bits, 0, sizeof(unsigned)));
    if (count > 0) {
      dispatch_float_dtype(dtype, [&](auto element) {
        using Element = decltype(element);
        max_abs_difference_kernel<Element><<<blocks_for(count), kThreads>>>(
            static_cast<const Element*>(actual), expected, count, result_bits);
      });
      IKBO_NUMERICS_CHECK(cudaGetLastError());
    }
    IKBO_NUMERICS_CHECK(cudaMemcpy(&bits, result_bits, sizeof bits, cudaMemcpyDeviceToHost));
  } catch (...) {
    cudaFree(result_bits);
    throw;
  }
  IKBO_NUMERICS_CHECK(cudaFree(result_bits));
  float largest = 0.0f;
  static_assert(sizeof largest == sizeof bits);
  std::memcpy(&largest, &bits, sizeof bits);
  return largest;
}

}  // namespace ikbo::test
