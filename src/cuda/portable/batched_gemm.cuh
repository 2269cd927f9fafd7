// src/cuda/portable/batched_gemm.cuh — the one cuBLAS call behind the
// portable LCE path (lce_cublas.cu) and the staircase baselines
// (lce_decomposed.cu): a strided-batched GEMM of row-major problems sharing
// one weight, with fp32 accumulation (CUBLAS_COMPUTE_32F; the handle's math
// mode, set by CublasLease, keeps fp32 free of TF32).
//
// Row-major -> cuBLAS column-major: a row-major [M, N] matrix is a
// column-major [N, M] one, so out[i] = w @ e[i] is computed as
// out[i]^T (N x M) = e[i]^T (N x K) @ w^T (K x M) with no transposes.
#pragma once

#include <cublas_v2.h>

#include <cstdint>

#include "cuda/check.cuh"
#include "cuda/dtype.cuh"

namespace ikbo::detail::cuda {

// outputs[i] = weight @ inputs[i] (or += with `accumulate`) for `batch`
// row-major problems; the weight is shared by all of them.
struct BatchedGemm {
  std::int64_t m = 0, n = 0, k = 0;
  const void* weight = nullptr;  // [m, k], rows ld_weight elements apart
  std::int64_t ld_weight = 0;
  const void* inputs = nullptr;  // [k, n] each, input_stride elements apart
  std::int64_t input_stride = 0;
  void* outputs = nullptr;  // dense [m, n] each
  cudaDataType_t output_type = CUDA_R_32F;
  std::int64_t batch = 0;
  bool accumulate = false;
};

inline void run_batched_gemm(cublasHandle_t handle, DType input_dtype, const BatchedGemm& gemm) {
  const float alpha = 1.0f, beta = gemm.accumulate ? 1.0f : 0.0f;
  const cudaDataType_t input_type = cuda_data_type(input_dtype);
  IKBO_CUBLAS_CHECK(cublasGemmStridedBatchedEx(
      handle, CUBLAS_OP_N, CUBLAS_OP_N, static_cast<int>(gemm.n), static_cast<int>(gemm.m),
      static_cast<int>(gemm.k), &alpha, gemm.inputs, input_type, static_cast<int>(gemm.n),
      gemm.input_stride, gemm.weight, input_type, static_cast<int>(gemm.ld_weight), 0, &beta,
      gemm.outputs, gemm.output_type, static_cast<int>(gemm.n), gemm.m * gemm.n,
      static_cast<int>(gemm.batch), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

}  // namespace ikbo::detail::cuda
