// src/cuda/ptx/cluster.cuh — thread block clusters (sm_90): a CTA's place in
// its cluster, the cluster-wide barrier, and arrivals on an mbarrier in
// another CTA's shared memory (distributed shared memory).
//
// The CTAs of a cluster run at the same time on neighbouring SMs and can
// address each other's shared memory: a TMA multicast writes one tile into
// the same offset of several CTAs, and the consumers of every receiving CTA
// must then tell the issuing producer when that offset is free again,
// which is what remote_mbarrier_arrive is for.
#pragma once

#include <cuda/ptx>

#include <cstdint>

#include "cuda/ptx/sm80.cuh"

namespace ikbo::detail::cuda::ptx {

__device__ __forceinline__ std::uint32_t cluster_rank() {
  return ::cuda::ptx::get_sreg_cluster_ctarank();
}

// Waits until every thread of every CTA in the cluster arrived. Release /
// acquire: shared-memory state set up before it (initialized mbarriers) is
// visible cluster-wide after it.
__device__ __forceinline__ void cluster_sync() {
  ::cuda::ptx::barrier_cluster_arrive(::cuda::ptx::sem_release);
  ::cuda::ptx::barrier_cluster_wait(::cuda::ptx::sem_acquire);
}

// Arrives on the mbarrier at the same shared-memory offset as `barrier` in
// the CTA of rank `rank` (this CTA's own rank included). The default
// .release.cta semantics suffice for handing back a stage whose readers were
// wgmmas already retired by wgmma.wait_group, and avoid the GPU-wide memory
// barrier a .release.cluster arrive compiles to (a cluster-scope fence per
// release, even one per batch of stages forwarded by a single thread, made
// the LCE kernel 1.2-1.8x slower; bench/notes/lce_sm90.md, session 27).
// `count` arrivals at once (e.g. a warp's leader for its 32 lanes). The
// kernels keep it at a warp's 32: a count of 256 made compute-sanitizer's
// racecheck fail launches (HeldStages in sm90/pipeline.cuh).
__device__ __forceinline__ void remote_mbarrier_arrive(std::uint64_t* barrier, std::uint32_t rank,
                                                       std::uint32_t count = 1) {
  std::uint32_t remote_address;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n"
               : "=r"(remote_address)
               : "r"(shared_address(barrier)), "r"(rank));
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0], %1;\n" ::"r"(remote_address),
               "r"(count)
               : "memory");
}

}  // namespace ikbo::detail::cuda::ptx
