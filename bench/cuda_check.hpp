// cuda_check.hpp — status checks for the CUDA runtime and cuBLAS calls the
// bench makes itself (events, L2 flush, ceilings). A failed call throws
// ikbo::RuntimeError naming the call and the library's error string.
// Include only when IKBO_WITH_CUDA is defined.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <string>

#include "ikbo/error.hpp"

namespace ikbo::bench {

inline void check_status(cudaError_t status, const char* call) {
  if (status != cudaSuccess) {
    throw RuntimeError(std::string(call) + " failed: " + cudaGetErrorString(status));
  }
}

inline void check_status(cublasStatus_t status, const char* call) {
  if (status != CUBLAS_STATUS_SUCCESS) {
    throw RuntimeError(std::string(call) + " failed: " + cublasGetStatusString(status));
  }
}

}  // namespace ikbo::bench

// A macro only to spell the failing call in the message.
#define IKBO_BENCH_CHECK(call) ::ikbo::bench::check_status((call), #call)
