// CPU backend of the row gather behind the broadcast baselines:
//   dst row r <- src row index[r]   (index null: src row r)
// Rows of `row_bytes` bytes, `dst_stride` / `src_stride` bytes apart. One
// memcpy per row; large copies are split over OpenMP threads by rows where
// OpenBLAS shares the OpenMP pool (the baselines run sgemm right after the
// copy; see blas_uses_openmp in blas.hpp).
#include <cstring>

#include "backend.hpp"
#include "cpu/blas.hpp"

namespace ikbo::detail::cpu {
namespace {
// Below this many bytes one thread copies faster than a woken team.
constexpr std::int64_t kParallelMinBytes = std::int64_t{1} << 20;
}  // namespace

void gather_rows(const GatherRowsArgs& args) {
  // Empty tensors may have null data: memcpy of it is undefined even for 0 bytes.
  if (args.rows == 0 || args.row_bytes == 0) return;
  auto* dst = static_cast<char*>(args.dst);
  const auto* src = static_cast<const char*>(args.src);
  const std::int32_t* index = args.index;
  const bool parallel = blas_uses_openmp() && args.rows * args.row_bytes >= kParallelMinBytes;
#pragma omp parallel for schedule(static) if (parallel)
  for (std::int64_t row = 0; row < args.rows; ++row) {
    const std::int64_t source_row = index != nullptr ? std::int64_t{index[row]} : row;
    std::memcpy(dst + row * args.dst_stride, src + source_row * args.src_stride,
                static_cast<std::size_t>(args.row_bytes));
  }
}

}  // namespace ikbo::detail::cpu
