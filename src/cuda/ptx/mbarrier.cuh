// src/cuda/ptx/mbarrier.cuh — shared-memory transaction barriers (sm_90),
// the completion mechanism of TMA loads and the handshake of the Hopper
// producer/consumer pipeline. Thin wrappers over CCCL's cuda::ptx.
//
// An mbarrier completes a phase when the expected number of threads arrived
// AND every byte announced with expect_tx has landed. Phases alternate in
// parity (0, 1, 0, ...): a waiter names the parity of the phase it waits
// for, so a ring of barriers needs one bit of state per pass, not a counter.
// Waiting on the parity of the phase *before* a fresh barrier's first one
// returns at once, which is how a producer starts on an empty ring.
#pragma once

#include <cuda/ptx>

#include <cstdint>

namespace ikbo::detail::cuda::ptx {

// By one thread, before any other thread touches the barrier.
__device__ __forceinline__ void mbarrier_init(std::uint64_t* barrier, std::uint32_t arrivals) {
  ::cuda::ptx::mbarrier_init(barrier, arrivals);
}

// Makes the initialized barriers visible to the copy engine; the other
// threads still need a __syncthreads() before using them.
__device__ __forceinline__ void fence_barrier_init() {
  ::cuda::ptx::fence_mbarrier_init(::cuda::ptx::sem_release, ::cuda::ptx::scope_cluster);
}

__device__ __forceinline__ void mbarrier_arrive(std::uint64_t* barrier) {
  static_cast<void>(::cuda::ptx::mbarrier_arrive(barrier));
}

// `count` arrivals at once (one thread standing in for several).
__device__ __forceinline__ void mbarrier_arrive(std::uint64_t* barrier, std::uint32_t count) {
  static_cast<void>(::cuda::ptx::mbarrier_arrive(barrier, count));
}

// Arrives and announces `bytes` that asynchronous copies will deliver
// before the current phase may complete.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(std::uint64_t* barrier,
                                                          std::uint32_t bytes) {
  static_cast<void>(::cuda::ptx::mbarrier_arrive_expect_tx(
      ::cuda::ptx::sem_release, ::cuda::ptx::scope_cta, ::cuda::ptx::space_shared, barrier, bytes));
}

// Returns once the phase of parity `phase` has completed; what the arrivers
// wrote before arriving (and the bytes the copies delivered) is then visible.
__device__ __forceinline__ void mbarrier_wait(std::uint64_t* barrier, std::uint32_t phase) {
  while (!::cuda::ptx::mbarrier_try_wait_parity(barrier, phase)) {
  }
}

}  // namespace ikbo::detail::cuda::ptx
