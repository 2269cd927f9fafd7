// src/cuda/launch.cuh — launch shapes and workspace constants shared by the
// portable CUDA kernels (row gathers, partial combines, bias seeding).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "backend.hpp"

namespace ikbo::detail::cuda {

constexpr int kThreadsPerBlock = 256;
constexpr std::int64_t kMaxGridX = 0x7fffffff;
constexpr std::int64_t kMaxGridY = 65535;

// cuBLAS scratch (split-K and similar) carved from the op's workspace; 32 MiB
// is NVIDIA's recommendation for Hopper and more than enough elsewhere.
constexpr std::size_t kCublasWorkspaceBytes = std::size_t{32} << 20;
// cuBLAS requires a 256-byte aligned workspace; every region of a workspace
// layout starts on this boundary (it also serves 16-byte vector accesses).
constexpr std::size_t kWorkspaceAlignment = 256;

inline std::size_t align_bytes(std::size_t bytes) {
  return static_cast<std::size_t>(
      round_up(static_cast<std::int64_t>(bytes), static_cast<std::int64_t>(kWorkspaceAlignment)));
}

// Launch shape for kernels over `rows` rows of `row_items` items: threads.x
// cover a row, and short rows share a block (threads.y rows at once) so no
// lane idles on a row of a few items. Kernels stride over both dimensions.
struct RowLaunch {
  dim3 grid;
  dim3 block;
};

inline RowLaunch row_launch(std::int64_t rows, std::int64_t row_items) {
  const int threads_x =
      static_cast<int>(std::min<std::int64_t>(kThreadsPerBlock, round_up(row_items, 32)));
  const dim3 block(threads_x, kThreadsPerBlock / threads_x);
  const dim3 grid(
      static_cast<unsigned>(std::min(kMaxGridX, (row_items + threads_x - 1) / threads_x)),
      static_cast<unsigned>(std::min(kMaxGridY, (rows + block.y - 1) / block.y)));
  return {grid, block};
}

}  // namespace ikbo::detail::cuda
