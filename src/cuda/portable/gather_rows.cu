// src/cuda/portable/gather_rows.cu — the row-gather copy behind the
// broadcast baselines: dst row r <- src row index[r] (row r without index).
//
// Rows are opaque bytes with byte strides. The copy moves the widest word
// (16, 8, 4, 2 or 1 bytes) that divides both base addresses, both strides and
// the row size, so typical tensors move as 16-byte vectors while any
// byte-aligned layout still works. Threads of a block cover a run of words of
// one or several rows; both grid dimensions stride, so any row count and row
// size fit the grid limits.
#include <algorithm>
#include <cstdint>

#include "backend.hpp"
#include "cuda/check.cuh"
#include "cuda/launch.cuh"
#include "cuda/runtime.cuh"

namespace ikbo::detail::cuda {
namespace {

template <typename Word>
__global__ void __launch_bounds__(kThreadsPerBlock)
    gather_rows_kernel(char* dst, std::int64_t dst_stride, const char* src, std::int64_t src_stride,
                       const std::int32_t* index, std::int64_t rows, std::int64_t row_words) {
  const std::int64_t row_step = static_cast<std::int64_t>(gridDim.y) * blockDim.y;
  const std::int64_t word_step = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t row = static_cast<std::int64_t>(blockIdx.y) * blockDim.y + threadIdx.y;
       row < rows; row += row_step) {
    const std::int64_t src_row = index != nullptr ? index[row] : row;
    const auto* src_words = reinterpret_cast<const Word*>(src + src_row * src_stride);
    auto* dst_words = reinterpret_cast<Word*>(dst + row * dst_stride);
    for (std::int64_t word = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
         word < row_words; word += word_step) {
      dst_words[word] = src_words[word];
    }
  }
}

template <typename Word>
void launch_gather(const GatherRowsArgs& args, cudaStream_t stream) {
  const std::int64_t row_words = args.row_bytes / static_cast<std::int64_t>(sizeof(Word));
  const RowLaunch launch = row_launch(args.rows, row_words);
  gather_rows_kernel<Word><<<launch.grid, launch.block, 0, stream>>>(
      static_cast<char*>(args.dst), args.dst_stride, static_cast<const char*>(args.src),
      args.src_stride, args.index, args.rows, row_words);
  check_launch("gather_rows_kernel");
}

}  // namespace

void gather_rows(const GatherRowsArgs& args) {
  if (args.rows == 0 || args.row_bytes == 0) return;
  DeviceGuard guard(args.device.index);
  const cudaStream_t stream = to_cuda_stream(args.stream);
  const auto alignment_bits =
      reinterpret_cast<std::uintptr_t>(args.dst) | reinterpret_cast<std::uintptr_t>(args.src) |
      static_cast<std::uintptr_t>(args.dst_stride) | static_cast<std::uintptr_t>(args.src_stride) |
      static_cast<std::uintptr_t>(args.row_bytes);
  if (alignment_bits % 16 == 0) {
    launch_gather<uint4>(args, stream);
  } else if (alignment_bits % 8 == 0) {
    launch_gather<uint2>(args, stream);
  } else if (alignment_bits % 4 == 0) {
    launch_gather<std::uint32_t>(args, stream);
  } else if (alignment_bits % 2 == 0) {
    launch_gather<std::uint16_t>(args, stream);
  } else {
    launch_gather<std::uint8_t>(args, stream);
  }
}

}  // namespace ikbo::detail::cuda
