// src/cuda/portable/linear_concat.cu — the broadcast baseline's GEMM for
// linear, on any sm_80+ GPU:
//
//   out [B, N_out] = x_full [B, K] @ weight^T + bias
//
// over inputs whose user features were replicated to every candidate
// beforehand (x_full[b] = [x_u[u(b)] | x_c[b]]). One cuBLASLt matmul with
// the bias in its epilogue and the output in the input dtype: the call
// PyTorch's F.linear makes for a 2-D input with a bias, so the benchmark
// times what a model written the broadcast way runs.
//
// Row-major -> column-major as in linear_cublas.cu: out^T = weight (N_out x
// K, read as a column-major [ld, N_out] matrix used transposed) @ x_full^T
// (a column-major [K, B] matrix); the bias runs along out^T's rows.
#include <cublasLt.h>

#include <cstdint>
#include <mutex>
#include <vector>

#include "backend.hpp"
#include "cuda/check.cuh"
#include "cuda/dtype.cuh"
#include "cuda/launch.cuh"
#include "cuda/runtime.cuh"

namespace ikbo::detail::cuda {
namespace {

// One cuBLASLt handle per device, made at first use and never destroyed
// (as the cuBLAS handles of runtime.cu, for the same reason). cuBLASLt
// handles are thread safe, so no lock is held while they are used.
cublasLtHandle_t lt_handle(int ordinal) {
  static std::mutex mutex;
  static auto* handles =
      new std::vector<cublasLtHandle_t>(static_cast<std::size_t>(device::device_count()), nullptr);
  const std::lock_guard<std::mutex> lock(mutex);
  cublasLtHandle_t& handle = handles->at(static_cast<std::size_t>(ordinal));
  if (handle == nullptr) IKBO_CUBLAS_CHECK(cublasLtCreate(&handle));
  return handle;
}

// Owns the descriptors of one matmul.
struct LtDescriptors {
  cublasLtMatmulDesc_t operation = nullptr;
  cublasLtMatrixLayout_t weight = nullptr, x_full = nullptr, out = nullptr;
  cublasLtMatmulPreference_t preference = nullptr;
  LtDescriptors() = default;
  LtDescriptors(const LtDescriptors&) = delete;
  LtDescriptors& operator=(const LtDescriptors&) = delete;
  ~LtDescriptors() {
    // Destroying descriptors fails only on invalid ones; nothing to report.
    if (preference != nullptr) static_cast<void>(cublasLtMatmulPreferenceDestroy(preference));
    if (out != nullptr) static_cast<void>(cublasLtMatrixLayoutDestroy(out));
    if (x_full != nullptr) static_cast<void>(cublasLtMatrixLayoutDestroy(x_full));
    if (weight != nullptr) static_cast<void>(cublasLtMatrixLayoutDestroy(weight));
    if (operation != nullptr) static_cast<void>(cublasLtMatmulDescDestroy(operation));
  }
};

template <typename Value>
void set_attribute(cublasLtMatmulDesc_t operation, cublasLtMatmulDescAttributes_t attribute,
                   const Value& value) {
  IKBO_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(operation, attribute, &value, sizeof(value)));
}

}  // namespace

std::size_t linear_concat_workspace_bytes() { return kCublasWorkspaceBytes; }

void linear_concat(const LinearConcatArgs& args) {
  if (args.num_candidates == 0) return;
  DeviceGuard guard(args.device.index);
  const cublasLtHandle_t handle = lt_handle(args.device.index);
  const cudaDataType_t type = cuda_data_type(args.dtype);
  const auto out_features = static_cast<std::uint64_t>(args.out_features);
  const auto k = static_cast<std::uint64_t>(args.k);
  const auto batch = static_cast<std::uint64_t>(args.num_candidates);

  LtDescriptors descriptors;
  IKBO_CUBLAS_CHECK(
      cublasLtMatmulDescCreate(&descriptors.operation, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  set_attribute(descriptors.operation, CUBLASLT_MATMUL_DESC_TRANSA, CUBLAS_OP_T);
  set_attribute(descriptors.operation, CUBLASLT_MATMUL_DESC_TRANSB, CUBLAS_OP_N);
  if (args.bias != nullptr) {
    set_attribute(descriptors.operation, CUBLASLT_MATMUL_DESC_EPILOGUE, CUBLASLT_EPILOGUE_BIAS);
    set_attribute(descriptors.operation, CUBLASLT_MATMUL_DESC_BIAS_POINTER, args.bias);
  }
  IKBO_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&descriptors.weight, type, k, out_features,
                                               static_cast<std::int64_t>(args.ld_weight)));
  IKBO_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&descriptors.x_full, type, k, batch,
                                               static_cast<std::int64_t>(args.k)));
  IKBO_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&descriptors.out, type, out_features, batch,
                                               static_cast<std::int64_t>(args.out_features)));
  IKBO_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&descriptors.preference));
  const std::uint64_t workspace_bytes = args.workspace_bytes;
  IKBO_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
      descriptors.preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace_bytes,
      sizeof(workspace_bytes)));

  cublasLtMatmulHeuristicResult_t heuristic{};
  int found = 0;
  IKBO_CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(
      handle, descriptors.operation, descriptors.weight, descriptors.x_full, descriptors.out,
      descriptors.out, descriptors.preference, 1, &heuristic, &found));
  if (found == 0) throw RuntimeError("linear_concat: cuBLASLt offers no algorithm for this GEMM");
  const float alpha = 1.0f, beta = 0.0f;
  IKBO_CUBLAS_CHECK(cublasLtMatmul(handle, descriptors.operation, &alpha, args.weight,
                                   descriptors.weight, args.x_full, descriptors.x_full, &beta,
                                   args.out, descriptors.out, args.out, descriptors.out,
                                   &heuristic.algo, args.workspace, args.workspace_bytes,
                                   to_cuda_stream(args.stream)));
}

}  // namespace ikbo::detail::cuda
