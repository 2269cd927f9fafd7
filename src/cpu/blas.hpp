// CPU backend: the one fp32 GEMM every CPU op runs, through OpenBLAS.
//
//   C[m, n] = alpha * A[m, k] @ op(B) + beta * C,   op(B) = B [k, n] or B^T with B [n, k]
//
// Row-major with explicit leading dimensions, so strided views (one head of
// a [rows, H, D] tensor, one user's columns of a wider matrix) need no copy.
// OpenBLAS threads the call itself; callers never invoke it from inside an
// OpenMP parallel region.
//
// Thread pools: the elementwise work between GEMMs (conversion, softmax,
// epilogues) runs on OpenMP only when OpenBLAS runs on OpenMP too, so that one
// pool serves both. With OpenBLAS's own pthreads (Debian's default build),
// libgomp's team keeps spinning after every region (its default wait policy)
// and takes the cores the next sgemm needs: on 2 cores that made LCE twice as
// slow (and the broadcast baseline's GEMMs 2.5x) as leaving the elementwise
// work on the calling thread.
#pragma once

#include <cblas.h>

#include <cstdint>
#include <initializer_list>
#include <limits>
#include <string>

#include "ikbo/error.hpp"

namespace ikbo::detail::cpu {

// True when OpenBLAS is the OpenMP build (OpenMP regions beside BLAS calls share its threads).
inline bool blas_uses_openmp() {
  static const bool uses_openmp = openblas_get_parallel() == 2;
  return uses_openmp;
}

// The BLAS the backend runs on, for benchmark records: OpenBLAS's build
// configuration, its thread count and threading model.
inline std::string blas_description() {
  const int parallel = openblas_get_parallel();
  const char* model = parallel == 2 ? "OpenMP" : parallel == 1 ? "pthreads" : "sequential";
  return std::string(openblas_get_config()) + ", " +
         std::to_string(openblas_get_num_threads()) + " threads (" + model + ")";
}

// Elementwise loops smaller than this stay on one thread: waking the team
// costs more than it saves.
inline constexpr std::int64_t kParallelMinElements = std::int64_t{1} << 15;

// Whether an elementwise loop of `elements` items between BLAS calls runs on OpenMP.
inline bool parallel_elementwise(std::int64_t elements) {
  return blas_uses_openmp() && elements >= kParallelMinElements;
}

enum class Transpose : bool { no, yes };

inline void gemm_f32(std::int64_t m, std::int64_t n, std::int64_t k, float alpha, const float* a,
                     std::int64_t lda, const float* b, std::int64_t ldb, Transpose transpose_b,
                     float beta, float* c, std::int64_t ldc) {
  // OpenBLAS indexes with 32-bit blasint. The API caps every extent below
  // 2^31, but a leading dimension is a product of extents.
  for (std::int64_t extent : {m, n, k, lda, ldb, ldc}) {
    if (extent > std::numeric_limits<blasint>::max()) {
      throw RuntimeError("cblas_sgemm: dimension " + std::to_string(extent) +
                         " exceeds the 32-bit index range of this OpenBLAS build");
    }
  }
  cblas_sgemm(CblasRowMajor, CblasNoTrans,
              transpose_b == Transpose::yes ? CblasTrans : CblasNoTrans, static_cast<blasint>(m),
              static_cast<blasint>(n), static_cast<blasint>(k), alpha, a, static_cast<blasint>(lda),
              b, static_cast<blasint>(ldb), beta, c, static_cast<blasint>(ldc));
}

}  // namespace ikbo::detail::cpu
