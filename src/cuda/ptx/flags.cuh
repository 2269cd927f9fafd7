// src/cuda/ptx/flags.cuh — GPU-scope counters by which one CTA tells others
// of the same grid that data it wrote to global memory is ready.
//
// Producer side: every writing thread stores, the writers meet at a
// barrier, then one of them calls signal_ready(): its fence is cumulative
// over the stores the barrier ordered before it. Consumer side: one thread
// spins in wait_ready() (acquire), then a barrier passes the ordering on to
// the threads that read. Readers must bypass L1 (ld.global.cg), which is not
// coherent across SMs.
#pragma once

#include <cstdint>

namespace ikbo::detail::cuda::ptx {

__device__ __forceinline__ void signal_ready(int* counter) {
  __threadfence();
  atomicAdd(counter, 1);
}

// Returns once *counter >= target.
__device__ __forceinline__ void wait_ready(const int* counter, int target) {
  int value;
  do {
    asm volatile("ld.acquire.gpu.global.s32 %0, [%1];\n" : "=r"(value) : "l"(counter) : "memory");
  } while (value < target);
}

}  // namespace ikbo::detail::cuda::ptx
