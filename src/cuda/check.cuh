// src/cuda/check.cuh — return-code checks for CUDA runtime and cuBLAS calls.
//
// Every failing call becomes an ikbo::RuntimeError naming the call and the
// platform's error string, e.g.
//   "cudaMalloc(&pointer, bytes) failed: out of memory (cudaErrorMemoryAllocation)".
// Kernel launches are checked with check_launch(), which reads the launch
// error right after the launch so it is attributed to the right kernel.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <string>

#include "ikbo/error.hpp"

namespace ikbo::detail::cuda {

inline void check_cuda(cudaError_t status, const char* call) {
  if (status == cudaSuccess) return;
  throw RuntimeError(std::string(call) + " failed: " + cudaGetErrorString(status) + " (" +
                     cudaGetErrorName(status) + ")");
}

inline void check_cublas(cublasStatus_t status, const char* call) {
  if (status == CUBLAS_STATUS_SUCCESS) return;
  throw RuntimeError(std::string(call) + " failed: " + cublasGetStatusString(status) + " (" +
                     cublasGetStatusName(status) + ")");
}

// Call right after a <<<...>>> launch: configuration errors (too much shared
// memory, a zero-sized grid) surface here, not at a later unrelated call.
inline void check_launch(const char* kernel_name) {
  cudaError_t status = cudaGetLastError();
  if (status == cudaSuccess) return;
  throw RuntimeError(std::string("launch of ") + kernel_name + " failed: " +
                     cudaGetErrorString(status) + " (" + cudaGetErrorName(status) + ")");
}

}  // namespace ikbo::detail::cuda

#define IKBO_CUDA_CHECK(call) ::ikbo::detail::cuda::check_cuda((call), #call)
#define IKBO_CUBLAS_CHECK(call) ::ikbo::detail::cuda::check_cublas((call), #call)
