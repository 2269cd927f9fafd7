// src/cuda/ptx/warpgroup.cuh — warpgroup-level helpers of the Hopper
// kernels: register reallocation between warpgroups (setmaxnreg, sm_90a),
// named barriers over a subset of a CTA's warps, and stmatrix (sm_90), the
// shared-memory store of mma fragments.
//
// setmaxnreg moves registers between the warpgroups of a CTA: a producer
// that only issues copies gives most of its registers back, consumers that
// hold large accumulators take them. It applies only under a register cap
// known at launch (__launch_bounds__(threads, 1)), must be executed by all
// warps of a warpgroup, and the counts must be multiples of 8 in [24, 256].
//
// stmatrix.m8n8.x4 stores four 8x8 b16 matrices: lane l holds the b32 pair
// {row l/4, cols 2(l%4), 2(l%4)+1} of each (register i = matrix i), and
// lanes 8i..8i+7 give the addresses of the eight 16-byte rows of matrix i.
// With .trans each matrix is stored transposed: that pair lands in stored
// rows 2(l%4) and 2(l%4)+1, column l/4.
#pragma once

#include <cstdint>

namespace ikbo::detail::cuda::ptx {

template <int kRegisters>
__device__ __forceinline__ void setmaxnreg_increase() {
  static_assert(kRegisters % 8 == 0 && kRegisters >= 24 && kRegisters <= 256);
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
}

template <int kRegisters>
__device__ __forceinline__ void setmaxnreg_decrease() {
  static_assert(kRegisters % 8 == 0 && kRegisters >= 24 && kRegisters <= 256);
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
}

// Waits until `kThreads` threads (whole warps) arrived at barrier `id`
// (1..15; 0 is __syncthreads'). Orders shared-memory accesses among them.
template <int kThreads>
__device__ __forceinline__ void named_barrier_sync(std::uint32_t id) {
  static_assert(kThreads % 32 == 0);
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "n"(kThreads) : "memory");
}

// Arrives at barrier `id` without waiting: the `kThreads` of a
// named_barrier_sync on `id` count these arrivals too. One warpgroup can
// thereby let another pass (the ping-pong schedule of two consumer
// warpgroups: each waits on its own barrier and arrives on the other's).
template <int kThreads>
__device__ __forceinline__ void named_barrier_arrive(std::uint32_t id) {
  static_assert(kThreads % 32 == 0);
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "n"(kThreads) : "memory");
}

// Stores four 8x8 b16 matrices; lanes 8i..8i+7 address the rows of matrix i.
__device__ __forceinline__ void stmatrix_x4(std::uint32_t shared_row_address, std::uint32_t matrix0,
                                            std::uint32_t matrix1, std::uint32_t matrix2,
                                            std::uint32_t matrix3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(
                   shared_row_address),
               "r"(matrix0), "r"(matrix1), "r"(matrix2), "r"(matrix3)
               : "memory");
}

__device__ __forceinline__ void stmatrix_x4_trans(std::uint32_t shared_row_address,
                                                  std::uint32_t matrix0, std::uint32_t matrix1,
                                                  std::uint32_t matrix2, std::uint32_t matrix3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(
                   shared_row_address),
               "r"(matrix0), "r"(matrix1), "r"(matrix2), "r"(matrix3)
               : "memory");
}

}  // namespace ikbo::detail::cuda::ptx
