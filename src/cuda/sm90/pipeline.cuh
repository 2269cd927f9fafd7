// src/cuda/sm90/pipeline.cuh — the warp-specialized producer/consumer
// pipeline the Hopper kernels run on.
//
// A CTA is one producer warpgroup and kConsumerWarpgroups consumer
// warpgroups of 128 threads. One producer thread streams the operands of
// each k-step of a work unit into a ring of kStages shared-memory stages
// with TMA; the consumer warpgroups turn each stage into tensor-core work
// and hand it back. Two mbarriers per stage carry the handshake:
//   full[s]   one arrival (the producer's expect_tx) plus the stage's TMA
//             bytes: stage s holds the operands of its k-step;
//   empty[s]  one arrival per consumer warp of every CTA in the cluster,
//             made once the wgmmas that read stage s have retired: stage s
//             may be overwritten.
// Both sides walk the ring in the same order, each with its own
// PipelineState (stage, phase parity); the barriers are all they share.
//
// Clusters (kClusterSize > 1, launched with that cluster size along x): the
// CTAs of a cluster take one work unit together, each its own rank's share,
// and a producer may multicast an operand they share into all of their
// rings. Then a stage of one CTA is written by every producer of the
// cluster, so its release is signalled to all of them (empty[s] counts the
// consumer warps of the whole cluster), and a producer stays until the
// last remote arrival on its barriers has landed before its CTA exits.
//
// The grid is persistent: cluster c takes units c, c + clusters, ... The
// producer runs ahead across unit boundaries, so the next unit's first
// loads overlap the current unit's epilogue. Registers go where the work
// is: setmaxnreg shrinks the producer warpgroup to kProducerRegisters and
// grows the consumers to kConsumerRegisters.
//
// A kernel plugs in a traits struct Kernel with
//   Params, Accumulators (one consumer thread's registers), SharedStorage
//     (holding `Stage stages[kStages]` and whatever the epilogue stages);
//   kStages, kClusterSize, kConsumerWarpgroups, kProducerRegisters,
//     kConsumerRegisters, kMaxRegisterSteps;
//   num_units(params), num_k_steps(params, unit);
//   stage_bytes(params, unit, k_step)  the TMA bytes landing in one stage of
//     one CTA for that k-step, multicasts from the other CTAs included;
//   load(params, unit, rank, k_step, stage, full)  one producer thread:
//     issue the TMA copies of a k-step, completing on barrier `full`;
//   num_register_steps(params, unit)  how many of the unit's first k-steps
//     are register steps, at most kMaxRegisterSteps (0 for a plain GEMM);
//   load_registers(params, unit, rank, stage, k_step, accumulators,
//     consumer)  one consumer warpgroup, a register step: read the stage
//     into registers with ordinary loads (e.g. to start the accumulators
//     from a partial result instead of zero); the stage is released after;
//   compute(params, unit, rank, stage, k_step, accumulators, consumer)
//     one consumer warpgroup, every other k-step: issue its wgmmas and
//     commit them as one group;
//   finish(params, unit, rank, accumulators, shared, consumer)  one
//     consumer warpgroup, every wgmma of the unit retired: the epilogue;
//   drain(shared, consumer)  one consumer warpgroup after its last unit
//     (e.g. wait until its TMA stores have read their shared source).
// and launches run_pipeline<Kernel> with kPipelineThreads<Kernel> threads
// per CTA, one CTA per SM.
#pragma once

#include <cstdint>

#include "cuda/ptx/cluster.cuh"
#include "cuda/ptx/mbarrier.cuh"
#include "cuda/ptx/warpgroup.cuh"
#include "cuda/ptx/wgmma.cuh"

namespace ikbo::detail::cuda::sm90 {

inline constexpr int kWarpgroupThreads = 128;
inline constexpr int kWarpsPerWarpgroup = 4;

template <class Kernel>
inline constexpr int kPipelineThreads = kWarpgroupThreads * (1 + Kernel::kConsumerWarpgroups);

template <int kStages>
struct PipelineBarriers {
  std::uint64_t full[kStages];
  std::uint64_t empty[kStages];
};

// A position in the ring: the stage, and the parity of the ring's current
// pass (the phase a waiter expects to complete next).
template <int kStages>
struct PipelineState {
  int stage = 0;
  std::uint32_t phase = 0;

  __device__ __forceinline__ void advance() {
    if (++stage == kStages) {
      stage = 0;
      phase ^= 1;
    }
  }
};

// The body of a pipelined kernel; every thread of the CTA calls it once.
// `barriers` lives in static shared memory, `shared` in dynamic shared
// memory aligned to 1024 bytes (the 128-byte swizzle atom).
template <class Kernel>
__device__ __forceinline__ void run_pipeline(const typename Kernel::Params& params,
                                             typename Kernel::SharedStorage& shared,
                                             PipelineBarriers<Kernel::kStages>& barriers) {
  constexpr int kStages = Kernel::kStages;
  constexpr int kClusterSize = Kernel::kClusterSize;
  const int warpgroup = static_cast<int>(threadIdx.x) / kWarpgroupThreads;
  if (threadIdx.x == 0) {
    for (int stage = 0; stage < kStages; ++stage) {
      ptx::mbarrier_init(&barriers.full[stage], 1);
      ptx::mbarrier_init(&barriers.empty[stage],
                         kClusterSize * Kernel::kConsumerWarpgroups * kWarpsPerWarpgroup);
    }
    ptx::fence_barrier_init();
  }
  // Remote arrivals and multicasts may target this CTA's barriers as soon as
  // the other CTAs of the cluster start: all of them must be initialized.
  if constexpr (kClusterSize > 1) {
    ptx::cluster_sync();
  } else {
    __syncthreads();
  }

  const int num_units = Kernel::num_units(params);
  const int rank = kClusterSize > 1 ? static_cast<int>(ptx::cluster_rank()) : 0;
  const int first_unit = static_cast<int>(blockIdx.x) / kClusterSize;
  const int unit_step = static_cast<int>(gridDim.x) / kClusterSize;

  if (warpgroup == 0) {
    ptx::setmaxnreg_decrease<Kernel::kProducerRegisters>();
    if (threadIdx.x != 0) return;
    // Parity of the previous pass: a fresh ring's stages count as released.
    const auto wait_released = [&](const PipelineState<kStages>& state) {
      ptx::mbarrier_wait(&barriers.empty[state.stage], state.phase ^ 1);
    };
    PipelineState<kStages> state;
    for (int unit = first_unit; unit < num_units; unit += unit_step) {
      const int k_steps = Kernel::num_k_steps(params, unit);
      for (int k_step = 0; k_step < k_steps; ++k_step) {
        wait_released(state);
        ptx::mbarrier_arrive_expect_tx(&barriers.full[state.stage],
                                       Kernel::stage_bytes(params, unit, k_step));
        Kernel::load(params, unit, rank, k_step, shared.stages[state.stage],
                     &barriers.full[state.stage]);
        state.advance();
      }
    }
    if constexpr (kClusterSize > 1) {
      // The other CTAs' consumers still arrive on this CTA's empty barriers:
      // keep the CTA alive until every stage has been released once more.
      for (int stage = 0; stage < kStages; ++stage) {
        wait_released(state);
        state.advance();
      }
    }
    return;
  }

  ptx::setmaxnreg_increase<Kernel::kConsumerRegisters>();
  const int consumer = warpgroup - 1;
  const bool warp_leader = threadIdx.x % 32 == 0;
  const auto release = [&](int stage) {
    if (!warp_leader) return;
    if constexpr (kClusterSize > 1) {
#pragma unroll
      for (int target = 0; target < kClusterSize; ++target) {
        ptx::remote_mbarrier_arrive(&barriers.empty[stage], target);
      }
    } else {
      ptx::mbarrier_arrive(&barriers.empty[stage]);
    }
  };
  PipelineState<kStages> state;
  typename Kernel::Accumulators accumulators{};
  for (int unit = first_unit; unit < num_units; unit += unit_step) {
    const int k_steps = Kernel::num_k_steps(params, unit);
    // Register steps come first, while no wgmma is in flight: ptxas
    // serializes every wgmma of a kernel in which ordinary instructions may
    // write accumulators under a running wgmma.
    const int register_steps = Kernel::num_register_steps(params, unit);
#pragma unroll
    for (int k_step = 0; k_step < Kernel::kMaxRegisterSteps; ++k_step) {
      if (k_step >= register_steps) break;
      ptx::mbarrier_wait(&barriers.full[state.stage], state.phase);
      Kernel::load_registers(params, unit, rank, shared.stages[state.stage], k_step, accumulators,
                             consumer);
      // The arrive's release semantics order the loads before it.
      release(state.stage);
      state.advance();
    }
    int previous_stage = -1;
    for (int k_step = register_steps; k_step < k_steps; ++k_step) {
      ptx::mbarrier_wait(&barriers.full[state.stage], state.phase);
      Kernel::compute(params, unit, rank, shared.stages[state.stage], k_step, accumulators,
                      consumer);
      // One group stays in flight: the k-step just issued. The one before
      // has retired, so its stage goes back to the producers.
      ptx::wgmma_wait<1>();
      if (previous_stage >= 0) release(previous_stage);
      previous_stage = state.stage;
      state.advance();
    }
    ptx::wgmma_wait<0>();
    release(previous_stage);
    Kernel::finish(params, unit, rank, accumulators, shared, consumer);
  }
  Kernel::drain(shared, consumer);
}

}  // namespace ikbo::detail::cuda::sm90
