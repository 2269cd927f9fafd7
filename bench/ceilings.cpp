// ceilings.cpp — matmul and bandwidth ceilings of the CPU (OpenBLAS, memcpy)
// and of a CUDA device (cuBLAS, cudaMemcpy).
#include "ceilings.hpp"

#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <cstring>
#include <string>

#include "device_resources.hpp"
#include "ikbo/error.hpp"
#include "options.hpp"

#ifdef IKBO_WITH_CUDA
#include "cuda_check.hpp"
#endif

namespace ikbo::bench {
namespace {

constexpr std::int64_t kGpuGemmSize = 8192;
constexpr std::size_t kGpuCopyBytes = std::size_t{1} << 30;
constexpr std::int64_t kCpuGemmSize = 2048;
constexpr std::size_t kCpuCopyBytes = std::size_t{256} << 20;
constexpr std::uint64_t kLeftOperandSeed = 101;
constexpr std::uint64_t kRightOperandSeed = 102;

double gemm_tflops(std::int64_t size, double ms) {
  return 2.0 * static_cast<double>(size) * static_cast<double>(size) * static_cast<double>(size) /
         (ms * 1e9);
}

// Read plus write.
double copy_gbps(std::size_t bytes, double ms) {
  return 2.0 * static_cast<double>(bytes) / (ms * 1e6);
}

Ceilings measure_cpu(const Timer& timer) {
  Ceilings ceilings;
  const std::int64_t size = kCpuGemmSize;
  const std::size_t matrix_bytes = static_cast<std::size_t>(size * size) * sizeof(float);
  Buffer a(matrix_bytes, timer.device()), b(matrix_bytes, timer.device()),
      c(matrix_bytes, timer.device());
  fill_uniform(a, DType::f32, size * size, 1.0f, kLeftOperandSeed, nullptr);
  fill_uniform(b, DType::f32, size * size, 1.0f, kRightOperandSeed, nullptr);
  const int n = static_cast<int>(size);
  const double gemm_ms = timer.spread_ms(
      [&] {
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, n, n, 1.0f,
                    static_cast<const float*>(a.data()), n, static_cast<const float*>(b.data()), n,
                    0.0f, static_cast<float*>(c.data()), n);
      },
      1, 5).min_ms;
  ceilings.matmul_tflops = gemm_tflops(size, gemm_ms);
  ceilings.matmul_method = "OpenBLAS sgemm " + std::to_string(size) + "^3";

  // One contiguous slice per thread: a single thread cannot saturate the
  // memory system, and the CPU backend runs on all of them.
  const int threads = omp_get_max_threads();
  Buffer source(kCpuCopyBytes, timer.device()), destination(kCpuCopyBytes, timer.device());
  // Fault the source pages in: untouched pages all map the one shared zero
  // page, and copying from it would measure the cache instead of memory.
  std::memset(source.data(), 1, kCpuCopyBytes);
  const std::size_t slice =
      (kCpuCopyBytes + static_cast<std::size_t>(threads) - 1) / static_cast<std::size_t>(threads);
  const double copy_ms = timer.spread_ms(
      [&] {
#pragma omp parallel for schedule(static, 1)
        for (int thread = 0; thread < threads; ++thread) {
          const std::size_t begin =
              std::min(kCpuCopyBytes, slice * static_cast<std::size_t>(thread));
          const std::size_t end = std::min(kCpuCopyBytes, begin + slice);
          std::memcpy(static_cast<char*>(destination.data()) + begin,
                      static_cast<const char*>(source.data()) + begin, end - begin);
        }
      },
      1, 10).min_ms;
  ceilings.bandwidth_gbps = copy_gbps(kCpuCopyBytes, copy_ms);
  ceilings.bandwidth_method = "memcpy " + format_bytes(kCpuCopyBytes) + " over " +
                              std::to_string(threads) + " threads, read + write";
  return ceilings;
}

#ifdef IKBO_WITH_CUDA
class CublasHandle {
 public:
  CublasHandle() { IKBO_BENCH_CHECK(cublasCreate(&handle_)); }
  ~CublasHandle() { cublasDestroy(handle_); }  // must not throw
  CublasHandle(const CublasHandle&) = delete;
  CublasHandle& operator=(const CublasHandle&) = delete;
  cublasHandle_t get() const { return handle_; }

 private:
  cublasHandle_t handle_ = nullptr;
};

cudaDataType_t cuda_data_type(DType dtype) {
  switch (dtype) {
    case DType::f16: return CUDA_R_16F;
    case DType::bf16: return CUDA_R_16BF;
    case DType::f32: return CUDA_R_32F;
    case DType::i32: break;
  }
  throw Error("no matmul ceiling for int32");
}

Ceilings measure_cuda(const Timer& timer, DType dtype) {
  Ceilings ceilings;
  const auto stream = static_cast<cudaStream_t>(timer.stream());
  const std::int64_t size = kGpuGemmSize;
  const std::size_t matrix_bytes = static_cast<std::size_t>(size * size) * dtype_size(dtype);
  Buffer a(matrix_bytes, timer.device()), b(matrix_bytes, timer.device()),
      c(matrix_bytes, timer.device());
  // Random operands: tensor cores draw less power (and clock higher) on zeros.
  fill_uniform(a, dtype, size * size, 1.0f, kLeftOperandSeed, timer.stream());
  fill_uniform(b, dtype, size * size, 1.0f, kRightOperandSeed, timer.stream());
  CublasHandle cublas;
  IKBO_BENCH_CHECK(cublasSetStream(cublas.get(), stream));
  const cudaDataType_t type = cuda_data_type(dtype);
  const float alpha = 1.0f, beta = 0.0f;
  const int n = static_cast<int>(size);
  const double gemm_ms = timer.spread_ms(
      [&] {
        // CUBLAS_COMPUTE_32F: fp32 accumulation like the library, and no TF32 for fp32.
        IKBO_BENCH_CHECK(cublasGemmEx(cublas.get(), CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &alpha,
                                      a.data(), type, n, b.data(), type, n, &beta, c.data(), type,
                                      n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
      },
      5, 20).min_ms;
  ceilings.matmul_tflops = gemm_tflops(size, gemm_ms);
  ceilings.matmul_method = "cuBLAS " + std::string(dtype_label(dtype)) + " GEMM " +
                           std::to_string(size) + "^3, fp32 accumulation";

  Buffer source(kGpuCopyBytes, timer.device()), destination(kGpuCopyBytes, timer.device());
  const double copy_ms = timer.spread_ms(
      [&] {
        IKBO_BENCH_CHECK(cudaMemcpyAsync(destination.data(), source.data(), kGpuCopyBytes,
                                         cudaMemcpyDeviceToDevice, stream));
      },
      3, 20).min_ms;
  ceilings.bandwidth_gbps = copy_gbps(kGpuCopyBytes, copy_ms);
  ceilings.bandwidth_method =
      "cudaMemcpy device to device " + format_bytes(kGpuCopyBytes) + ", read + write";
  return ceilings;
}
#endif

}  // namespace

double Ceilings::floor_ms(double flops, double min_bytes) const {
  return std::max(flops / (matmul_tflops * 1e9), min_bytes / (bandwidth_gbps * 1e6));
}

// On the CPU the dtype does not matter: the backend computes in fp32.
Ceilings measure_ceilings(const Timer& timer, [[maybe_unused]] DType dtype) {
#ifdef IKBO_WITH_CUDA
  if (timer.device().is_cuda()) return measure_cuda(timer, dtype);
#endif
  return measure_cpu(timer);
}

}  // namespace ikbo::bench
