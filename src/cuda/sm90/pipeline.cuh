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
//   empty[s]  32 arrivals per consumer warp of every CTA in the cluster
//             (and the fixer's, see stage fix-ups below): stage s may be
//             overwritten. A warp whose wgmmas read the stage arrives once
//             they have retired, its leader for all 32 lanes; a warp that
//             read or wrote it with ordinary instructions (register steps,
//             the fixer) arrives lane by lane on its own CTA's barrier, so
//             that each lane's release orders its own accesses before the
//             next copy (compute-sanitizer's racecheck follows those edges,
//             not a warp barrier before a leader's arrival), and through
//             its leader on the others'.
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
//     kConsumerRegisters, kMaxRegisterSteps (the last only with the
//     pipeline's own consumer loop, as the register-step hooks below);
//   num_units(params), num_k_steps(params, unit);
//   stage_bytes(params, unit, k_step)  the TMA bytes landing in one stage of
//     one CTA for that k-step, multicasts from the other CTAs included;
//   load(params, unit, rank, k_step, stage, full)  one producer thread:
//     issue the TMA copies of a k-step, completing on barrier `full`;
//   num_register_steps(params, unit)  how many of the unit's last k-steps
//     are register steps, at most kMaxRegisterSteps (neither hook is
//     needed when kMaxRegisterSteps is 0: a plain GEMM);
//   load_registers(params, unit, rank, stage, step, accumulators,
//     consumer)  one consumer warpgroup, register step `step` (0, 1, ...),
//     after every wgmma of the unit retired: read the stage into registers
//     with ordinary loads (e.g. to add a partial result to the
//     accumulators); the stage is released after;
//   compute(params, unit, rank, stage, k_step, accumulators, consumer)
//     one consumer warpgroup, every other k-step (they come first): issue
//     its wgmmas and commit them as one group;
//   finish(params, unit, rank, accumulators, shared, consumer)  one
//     consumer warpgroup, every wgmma of the unit retired: the epilogue;
//   drain(shared, consumer)  optional: one consumer warpgroup after its
//     last unit (e.g. wait until its TMA stores have read their shared
//     source).
// and launches run_pipeline<Kernel> with kPipelineThreads<Kernel> threads
// per CTA, one CTA per SM.
//
// Optional extensions (a kernel that declares none of them runs
// exactly the loop above):
//
//   describe(params, unit) -> UnitInfo  decodes a unit once per role and
//     unit; the producer's hooks (num_k_steps, stage_bytes, load) and those
//     below then take the UnitInfo instead of the unit index. The
//     pipeline's own consumer loop still passes the index to its hooks
//     (num_k_steps included), so a kernel that describes its units for the
//     producer keeps those on the index. Without it the UnitInfo is the
//     index. A kernel may take the shared storage too,
//     describe(params, shared, unit), and fill what it reads there in
//       prepare_walk(params, shared, thread)  the producer warpgroup's 128
//         threads, once, before any of its roles starts its walk (e.g. a
//         per-launch table of the walk's order).
//
//   Per-unit operands: kUnitStages > 0 adds a second ring of kUnitStages
//     slots (laid out in SharedStorage by the kernel) for operands that
//     are loaded once per unit and read by every k-step (attention's query
//     tile), with its own barriers:
//       unit_full[s]   one arrival per loader thread: slot s is loaded;
//       unit_empty[s]  one arrival per consumer thread: slot s is free.
//     Warps 1 .. kUnitLoaderWarps of the producer warpgroup fill it: for
//     each unit, each loader thread first calls prepare_unit(params, info,
//     loader_thread) -> p (what needs no slot, e.g. the addresses to gather
//     from: its latency then passes while the slot is still in use), waits
//     for a free slot, calls load_unit(params, info, rank, p, shared, slot,
//     loader_thread) (which returns once its writes are complete and
//     fenced for the async proxy, e.g. cp.async.wait_all +
//     fence.proxy.async), and arrives.
//     Single-CTA kernels only (kClusterSize == 1).
//
//   Kernel-owned consumer loop: kOwnsConsumerLoop = true replaces the
//     compute/finish loop by one call per consumer warpgroup,
//       consume(params, rank, walk, slots, steps, shared, consumer)
//     in which the kernel walks its units itself (walk: UnitWalk, units
//     first, first + step, ... below count) and may look ahead across
//     them (attention issues the next unit's first product before this
//     unit's epilogue):
//       slots (UnitSlots): acquire() waits for the next per-unit slot in
//         order and returns its index; release() frees the oldest acquired
//         one (every consumer thread calls both, once per unit, in unit
//         order; two may be held at once);
//       steps (ConsumerSteps): random access to the k-steps, relative to
//         the current unit's first: wait(k) waits for k-step k and returns
//         its stage (k may run past the unit into the next one's);
//         release(stage) hands a stage back (once per k-step, by every
//         consumer warpgroup, after the wgmmas reading it retired, in any
//         order); advance(num_k_steps) moves to the next unit. The
//         producer still fills the ring in k-step order, so a kernel may
//         hold at most kStages k-steps at once.
//     drain(shared, consumer) runs after it, as before.
//
//   Stage fix-ups (with a kernel-owned consumer loop and per-unit
//     operands): kFixUpWarp = true makes producer warp kUnitLoaderWarps + 1,
//     the fixer, one more reader of every k-step: it waits for each stage
//     in ring order and, where fix_up_step(params, info, k_step) says so,
//     calls
//       fix_up(params, info, k_step, stage, lane)  the whole warp: amend
//         the landed stage with ordinary stores (e.g. clear rows that must
//         not reach the product);
//     then fences the stage for the async proxy, arrives on fixed[s] and
//     releases the stage like a consumer warp (empty[s] counts it too, so
//     the ring never laps the fixer and its parity waits stay exact). A
//     consumer reads an amended stage only after steps.wait_fixed(stage),
//     at the k-steps where fix_up_step holds.
//       fixed[s]   one arrival per fixer lane: stage s is amended.
//     The next amendment of stage s needs its next load, which needs the
//     consumers' release, so fixed[s] never completes a phase ahead of them.
//
//   Held stages (the pipeline's own consumer loop, no per-unit operands):
//     kMaxHeldStages > 0 and num_held_stages(params, unit) (by index and
//     by UnitInfo, as num_k_steps) -> h <= kMaxHeldStages: the unit's last
//     h k-steps (register steps included) keep their stages once the
//     consumers are done with them, as the epilogue's staging, so that its
//     stores drain while the next unit's main loop runs. Both consumer
//     warpgroups first meet at named barrier kHeldStagesBarrier (neither
//     reads those stages any more); finish then takes a HeldStages
//     (held[i], i < h, in k-step order) and writes what is to be stored
//     into them. After that one thread of producer warp 1, the storer,
//     calls
//       store_held(params, info, rank, held)  copy the stages out with bulk
//         or TMA stores issued by this thread, and hand each back with
//         held.release(i) once no store reads it any more
//         (bulk_wait_group_read; held.release_as_read<n>() does both for
//         one bulk group per stage); it may also wait for the stores to
//         complete and then tell other CTAs (a ready flag).
//     The storer waits for its stores to complete before it exits. Two
//     barriers carry the hand-over, one phase per unit with held stages:
//       held_full   one arrival per consumer thread: finish has written them;
//       held_empty  the storer's arrival: it has taken them over.
//
//   A spare warp (kernels with held stages, whose producer warps 2 and 3
//     have no role): spare_warp(params, walk, rank, lane), when declared,
//     runs once on the whole of producer warp 2 as the CTA starts, beside
//     the loader and the storer, for work of the CTA's walk that no stage
//     waits on (LCE: clearing the workspace tiles that the storers' bulk
//     reductions add into, before those storers need them).
#pragma once

#include <cstddef>
#include <cstdint>

#include "cuda/ptx/cluster.cuh"
#include "cuda/ptx/mbarrier.cuh"
#include "cuda/ptx/sm80.cuh"
#include "cuda/ptx/tma.cuh"
#include "cuda/ptx/warpgroup.cuh"
#include "cuda/ptx/wgmma.cuh"
#include "cuda/sm90/device_support.cuh"

// For targets without wgmma pipeline_kernel (below) is a trap, so the
// device passes of a file that defines a pipeline kernel never reference its
// tile constants: no "declared but never referenced" warnings there.
#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#pragma nv_diag_suppress 177
#endif

namespace ikbo::detail::cuda::sm90 {

inline constexpr int kWarpgroupThreads = 128;
inline constexpr int kWarpsPerWarpgroup = 4;

template <class Kernel>
inline constexpr int kPipelineThreads = kWarpgroupThreads * (1 + Kernel::kConsumerWarpgroups);

// The warps that arrive on a stage's empty barrier, per CTA.
template <class Kernel>
inline constexpr int kConsumerWarps = Kernel::kConsumerWarpgroups * kWarpsPerWarpgroup;

// What one warp's release of a stage counts on its empty barrier.
inline constexpr std::uint32_t kWarpArrivals = 32;

// Shared-memory tiles start on the 128-byte swizzle's 1024-byte atoms; the
// dynamic shared memory is over-allocated by one atom to align the storage.
inline constexpr int kSharedAlignment = 1024;

template <class Kernel>
inline constexpr std::size_t kDynamicSharedBytes =
    sizeof(typename Kernel::SharedStorage) + kSharedAlignment;

// The shared memory a block may opt in to on sm_90 (227 KiB). A kernel
// above it would not fail: the host would find it unlaunchable at run time
// and take the portable path (device_support.cuh), so pipeline_kernel
// checks it when it is compiled.
inline constexpr std::size_t kMaxSharedBytesPerBlock = 232448;

// The static shared memory of pipeline_kernel: its barriers, which ptxas
// rounds up to 16 bytes (136 bytes of LCE barriers take 144, the
// attention kernels' 168 take 176).
template <class Barriers>
inline constexpr std::size_t kStaticSharedBytes = (sizeof(Barriers) + 15) / 16 * 16;

template <int kStages, int kUnitStages = 0>
struct PipelineBarriers {
  std::uint64_t full[kStages];
  std::uint64_t empty[kStages];
  std::uint64_t fixed[kStages];
  std::uint64_t held_full, held_empty;
  std::uint64_t unit_full[kUnitStages];
  std::uint64_t unit_empty[kUnitStages];
};

template <int kStages>
struct PipelineBarriers<kStages, 0> {
  std::uint64_t full[kStages];
  std::uint64_t empty[kStages];
  std::uint64_t fixed[kStages];
  std::uint64_t held_full, held_empty;
};

// The optional parts of a Kernel (see the header comment), with defaults.
#define IKBO_PIPELINE_OPTION(function, member, default_value) \
  template <class Kernel>                                     \
  constexpr auto function() {                                 \
    if constexpr (requires { Kernel::member; }) {             \
      return Kernel::member;                                  \
    } else {                                                  \
      return default_value;                                   \
    }                                                         \
  }
IKBO_PIPELINE_OPTION(unit_stages, kUnitStages, 0)
IKBO_PIPELINE_OPTION(max_held_stages, kMaxHeldStages, 0)
IKBO_PIPELINE_OPTION(owns_consumer_loop, kOwnsConsumerLoop, false)
IKBO_PIPELINE_OPTION(has_fix_up_warp, kFixUpWarp, false)
#undef IKBO_PIPELINE_OPTION

// The named barrier at which the consumer warpgroups meet before an
// epilogue writes into held stages (kernels number theirs below it).
inline constexpr int kHeldStagesBarrier = 15;

template <class Kernel>
using KernelBarriers = PipelineBarriers<Kernel::kStages, unit_stages<Kernel>()>;

// The named barrier at which the producer warpgroup meets after
// prepare_walk.
inline constexpr int kPrepareWalkBarrier = 14;

template <class Kernel>
__device__ __forceinline__ auto describe_unit(const typename Kernel::Params& params,
                                              const typename Kernel::SharedStorage& shared,
                                              int unit) {
  if constexpr (requires { Kernel::describe(params, shared, unit); }) {
    return Kernel::describe(params, shared, unit);
  } else if constexpr (requires { Kernel::describe(params, unit); }) {
    return Kernel::describe(params, unit);
  } else {
    return unit;
  }
}

template <class Kernel>
__device__ __forceinline__ void drain_consumer(typename Kernel::SharedStorage& shared,
                                               int consumer) {
  if constexpr (requires { Kernel::drain(shared, consumer); }) Kernel::drain(shared, consumer);
}

// Hands stage `stage` back to the producers: the warp's leader arrives for
// it on the empty barrier of every CTA of the cluster. The warp's wgmmas
// that read the stage must have retired.
template <int kClusterSize>
__device__ __forceinline__ void release_stage(std::uint64_t* empty, int stage) {
  if (threadIdx.x % 32 != 0) return;
  if constexpr (kClusterSize > 1) {
#pragma unroll
    for (int target = 0; target < kClusterSize; ++target) {
      ptx::remote_mbarrier_arrive(&empty[stage], target, kWarpArrivals);
    }
  } else {
    ptx::mbarrier_arrive(&empty[stage], kWarpArrivals);
  }
}

// The same for a stage this warp read or wrote with ordinary instructions,
// which the caller has fenced for the async proxy (the next write into the
// stage is a copy): each lane arrives for itself on this CTA's barrier; the
// leader arrives for the warp on the other CTAs' once every lane's
// accesses are behind it (__syncwarp).
template <int kClusterSize>
__device__ __forceinline__ void release_stage_per_lane(std::uint64_t* empty, int stage) {
  ptx::mbarrier_arrive(&empty[stage]);
  if constexpr (kClusterSize > 1) {
    __syncwarp();
    if (threadIdx.x % 32 != 0) return;
    const std::uint32_t own = ptx::cluster_rank();
#pragma unroll
    for (int target = 0; target < kClusterSize; ++target) {
      if (target != own) ptx::remote_mbarrier_arrive(&empty[stage], target, kWarpArrivals);
    }
  }
}

// The stages a unit's epilogue holds (see the header comment): held[i] is
// the stage of the unit's i-th held k-step. release(i), by one thread,
// hands stage i back for all consumer warps of this CTA: one arrival of a
// warp's count per consumer warp, on every CTA's barrier, as the warps'
// own releases arrive. (A single arrival of the whole count is the same to
// the barrier, but compute-sanitizer's racecheck ended launches with
// "unspecified launch failure" and no hazard when a remote arrival counted
// 256: a synchronization-only kernel on this pipeline in every run, the
// LCE kernel in 6 of 30; with arrivals of 32, in none of 4 and 30.
// bench/notes/lce_sm90.md, session 28.)
template <class Kernel>
struct HeldStages {
  using Stage = typename Kernel::Stage;
  Stage* stages;
  std::uint64_t* empty;
  int first;  // stage of held[0]

  __device__ __forceinline__ int index(int i) const { return (first + i) % Kernel::kStages; }
  __device__ __forceinline__ Stage& operator[](int i) const { return stages[index(i)]; }
  __device__ __forceinline__ void release(int i) const {
#pragma unroll
    for (int warp = 0; warp < kConsumerWarps<Kernel>; ++warp) {
      if constexpr (Kernel::kClusterSize > 1) {
#pragma unroll
        for (int target = 0; target < Kernel::kClusterSize; ++target) {
          ptx::remote_mbarrier_arrive(&empty[index(i)], target, kWarpArrivals);
        }
      } else {
        ptx::mbarrier_arrive(&empty[index(i)], kWarpArrivals);
      }
    }
  }
  // Hands back held[kFirst], ..., held[kCount - 1], each as soon as the
  // storer's bulk copies out of it have read it, for a storer that
  // committed one bulk group per stage, in held order, and none after.
  template <int kCount, int kFirst = 0>
  __device__ __forceinline__ void release_as_read() const {
    if constexpr (kFirst < kCount) {
      ptx::bulk_wait_group_read<kCount - 1 - kFirst>();
      release(kFirst);
      release_as_read<kCount, kFirst + 1>();
    }
  }
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

// A consumer's random access to the k-steps of its current unit (kernels
// that own their consumer loop; the fixer's too). `first` is the ring
// position of the unit's k-step 0.
template <int kStages, int kClusterSize>
struct ConsumerSteps {
  std::uint64_t* full;
  std::uint64_t* empty;
  std::uint64_t* fixed;
  PipelineState<kStages> first;
  std::uint32_t fixed_phases = 0;  // bit s: the phase of fixed[s] awaited next
  static_assert(kStages <= 32, "fixed_phases holds one bit per stage");

  // Waits until k-step `k_step` of the unit has landed; returns its stage.
  __device__ __forceinline__ int wait(int k_step) const {
    const int position = first.stage + k_step;
    const int stage = position % kStages;
    const std::uint32_t phase = first.phase ^ static_cast<std::uint32_t>((position / kStages) & 1);
    ptx::mbarrier_wait(&full[stage], phase);
    return stage;
  }

  __device__ __forceinline__ void release(int stage) const {
    release_stage<kClusterSize>(empty, stage);
  }

  // The same for a stage this warp also read with ordinary instructions
  // (ldmatrix): every lane's reads are ordered before the leader's arrival.
  __device__ __forceinline__ void release_read(int stage) const {
    __syncwarp();
    release_stage<kClusterSize>(empty, stage);
  }

  // Waits until the fixer has amended `stage` (see stage fix-ups).
  __device__ __forceinline__ void wait_fixed(int stage) {
    ptx::mbarrier_wait(&fixed[stage], (fixed_phases >> stage) & 1u);
    fixed_phases ^= 1u << stage;
  }

  // Moves past a unit of `k_steps` k-steps.
  __device__ __forceinline__ void advance(int k_steps) {
    const int position = first.stage + k_steps;
    first.stage = position % kStages;
    first.phase ^= static_cast<std::uint32_t>((position / kStages) & 1);
  }
};

// The units of one CTA, for kernels that own their consumer loop.
struct UnitWalk {
  int first, step, count;
};

// A kernel's spare warp (see the header comment).
inline constexpr int kSpareWarp = 2;
template <class Kernel>
constexpr bool has_spare_warp() {
  return requires(const typename Kernel::Params& params) {
    Kernel::spare_warp(params, UnitWalk{}, 0, 0);
  };
}

// A consumer's view of the per-unit slots (see the header comment).
template <int kSlots>
struct UnitSlots {
  std::uint64_t* full;
  std::uint64_t* empty;
  PipelineState<kSlots> acquired, released;

  __device__ __forceinline__ int acquire() {
    ptx::mbarrier_wait(&full[acquired.stage], acquired.phase);
    const int slot = acquired.stage;
    acquired.advance();
    return slot;
  }

  __device__ __forceinline__ void release() {
    ptx::mbarrier_arrive(&empty[released.stage]);
    released.advance();
  }
};

// The body of a pipelined kernel; every thread of the CTA calls it once.
// `barriers` lives in static shared memory, `shared` in dynamic shared
// memory aligned to 1024 bytes (the 128-byte swizzle atom).
template <class Kernel>
__device__ __forceinline__ void run_pipeline(const typename Kernel::Params& params,
                                             typename Kernel::SharedStorage& shared,
                                             KernelBarriers<Kernel>& barriers) {
  constexpr int kStages = Kernel::kStages;
  constexpr int kClusterSize = Kernel::kClusterSize;
  constexpr int kUnitStages = unit_stages<Kernel>();
  constexpr int kMaxHeldStages = max_held_stages<Kernel>();
  static_assert(kUnitStages == 0 || kClusterSize == 1,
                "per-unit operands are implemented for single-CTA kernels only");
  static_assert(kMaxHeldStages == 0 || (kUnitStages == 0 && !owns_consumer_loop<Kernel>()),
                "held stages take the pipeline's own consumer loop and producer warp 1");
  static_assert(kMaxHeldStages < kStages, "a held unit must leave a stage to the next one");
  // setmaxnreg only moves registers within the CTA's launch allocation (one
  // CTA per SM: the register file split evenly, in steps of 8 per thread);
  // an increase past it waits forever.
  constexpr int kThreads = kPipelineThreads<Kernel>;
  static_assert(kWarpgroupThreads * (Kernel::kProducerRegisters +
                                     Kernel::kConsumerWarpgroups * Kernel::kConsumerRegisters) <=
                    kThreads * (65536 / kThreads / 8 * 8),
                "the register split exceeds the launch allocation");
  const int warpgroup = static_cast<int>(threadIdx.x) / kWarpgroupThreads;
  if (threadIdx.x == 0) {
    for (int stage = 0; stage < kStages; ++stage) {
      ptx::mbarrier_init(&barriers.full[stage], 1);
      constexpr int kFixers = has_fix_up_warp<Kernel>() ? 1 : 0;
      ptx::mbarrier_init(&barriers.empty[stage],
                         (kClusterSize * kConsumerWarps<Kernel> + kFixers) * kWarpArrivals);
      if constexpr (has_fix_up_warp<Kernel>()) {
        ptx::mbarrier_init(&barriers.fixed[stage], kWarpArrivals);
      }
    }
    if constexpr (kMaxHeldStages > 0) {
      ptx::mbarrier_init(&barriers.held_full, Kernel::kConsumerWarpgroups * kWarpgroupThreads);
      ptx::mbarrier_init(&barriers.held_empty, 1);
    }
    if constexpr (kUnitStages > 0) {
      for (int slot = 0; slot < kUnitStages; ++slot) {
        ptx::mbarrier_init(&barriers.unit_full[slot], Kernel::kUnitLoaderWarps * 32);
        ptx::mbarrier_init(&barriers.unit_empty[slot],
                           Kernel::kConsumerWarpgroups * kWarpgroupThreads);
      }
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

  // Read after setmaxnreg in each role: nothing stays live across it.
  int num_units = 0, rank = 0, first_unit = 0, unit_step = 0;
  const auto read_walk = [&] {
    num_units = Kernel::num_units(params);
    rank = kClusterSize > 1 ? static_cast<int>(ptx::cluster_rank()) : 0;
    first_unit = static_cast<int>(blockIdx.x) / kClusterSize;
    unit_step = static_cast<int>(gridDim.x) / kClusterSize;
  };

  if (warpgroup == 0) {
    ptx::setmaxnreg_decrease<Kernel::kProducerRegisters>();
    if constexpr (requires { Kernel::prepare_walk(params, shared, 0); }) {
      Kernel::prepare_walk(params, shared, static_cast<int>(threadIdx.x));
      ptx::named_barrier_sync<kWarpgroupThreads>(kPrepareWalkBarrier);
    }
    read_walk();
    const int warp = static_cast<int>(threadIdx.x) / 32;
    if constexpr (has_fix_up_warp<Kernel>()) {
      static_assert(owns_consumer_loop<Kernel>() && kUnitStages > 0 && kClusterSize == 1 &&
                        Kernel::kUnitLoaderWarps + 1 < kWarpsPerWarpgroup,
                    "the fixer is the producer warp after the loaders of per-unit operands");
      if (warp == Kernel::kUnitLoaderWarps + 1) {
        const int lane = static_cast<int>(threadIdx.x) % 32;
        PipelineState<kStages> state;
        for (int unit = first_unit; unit < num_units; unit += unit_step) {
          const auto info = describe_unit<Kernel>(params, shared, unit);
          const int k_steps = Kernel::num_k_steps(params, info);
          for (int k_step = 0; k_step < k_steps; ++k_step) {
            ptx::mbarrier_wait(&barriers.full[state.stage], state.phase);
            if (Kernel::fix_up_step(params, info, k_step)) {
              Kernel::fix_up(params, info, k_step, shared.stages[state.stage], lane);
              ptx::fence_async_shared();  // the consumers' wgmmas read it, a copy rewrites it
              ptx::mbarrier_arrive(&barriers.fixed[state.stage]);
              release_stage_per_lane<kClusterSize>(barriers.empty, state.stage);
            } else {
              release_stage<kClusterSize>(barriers.empty, state.stage);
            }
            state.advance();
          }
        }
        return;
      }
    }
    if constexpr (kUnitStages > 0) {
      if (warp >= 1 && warp <= Kernel::kUnitLoaderWarps) {
        PipelineState<kUnitStages> slot;
        for (int unit = first_unit; unit < num_units; unit += unit_step) {
          const auto info = describe_unit<Kernel>(params, shared, unit);
          const int loader = static_cast<int>(threadIdx.x) - 32;
          const auto prepared = Kernel::prepare_unit(params, info, loader);
          ptx::mbarrier_wait(&barriers.unit_empty[slot.stage], slot.phase ^ 1);
          Kernel::load_unit(params, info, rank, prepared, shared, slot.stage, loader);
          ptx::mbarrier_arrive(&barriers.unit_full[slot.stage]);
          slot.advance();
        }
        return;
      }
    }
    if constexpr (has_spare_warp<Kernel>()) {
      static_assert(kMaxHeldStages > 0 && kUnitStages == 0,
                    "the spare warp is producer warp 2 of a kernel with held stages");
      if (warp == kSpareWarp) {
        Kernel::spare_warp(params, UnitWalk{first_unit, unit_step, num_units}, rank,
                           static_cast<int>(threadIdx.x) % 32);
        return;
      }
    }
    if constexpr (kMaxHeldStages > 0) {
      if (threadIdx.x == 32) {
        // The storer: follows the loader's walk a unit at a time, keeping
        // only the stage that comes next in the ring.
        int next_stage = 0;
        std::uint32_t phase = 0;
        for (int unit = first_unit; unit < num_units; unit += unit_step) {
          const auto info = describe_unit<Kernel>(params, shared, unit);
          next_stage = (next_stage + Kernel::num_k_steps(params, info)) % kStages;
          const int held = Kernel::num_held_stages(params, info);
          if (held == 0) continue;
          ptx::mbarrier_wait(&barriers.held_full, phase);
          ptx::mbarrier_arrive(&barriers.held_empty);
          phase ^= 1;
          const int first_held = (next_stage + kStages - held) % kStages;
          Kernel::store_held(params, info, rank,
                             HeldStages<Kernel>{shared.stages, barriers.empty, first_held});
        }
        ptx::bulk_wait_group<0>();
        return;
      }
    }
    if (threadIdx.x != 0) return;
    // Parity of the previous pass: a fresh ring's stages count as released.
    const auto wait_released = [&](const PipelineState<kStages>& state) {
      ptx::mbarrier_wait(&barriers.empty[state.stage], state.phase ^ 1);
    };
    PipelineState<kStages> state;
    for (int unit = first_unit; unit < num_units; unit += unit_step) {
      const auto info = describe_unit<Kernel>(params, shared, unit);
      const int k_steps = Kernel::num_k_steps(params, info);
      for (int k_step = 0; k_step < k_steps; ++k_step) {
        wait_released(state);
        ptx::mbarrier_arrive_expect_tx(&barriers.full[state.stage],
                                       Kernel::stage_bytes(params, info, k_step));
        Kernel::load(params, info, rank, k_step, shared.stages[state.stage],
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
  read_walk();
  const int consumer = warpgroup - 1;
  if constexpr (owns_consumer_loop<Kernel>()) {
    static_assert(kUnitStages > 0, "a kernel-owned consumer loop takes per-unit operands");
    ConsumerSteps<kStages, kClusterSize> steps{barriers.full, barriers.empty, barriers.fixed, {}};
    UnitSlots<kUnitStages> slots{barriers.unit_full, barriers.unit_empty, {}, {}};
    const UnitWalk walk{first_unit, unit_step, num_units};
    Kernel::consume(params, rank, walk, slots, steps, shared, consumer);
    drain_consumer<Kernel>(shared, consumer);
  } else {
    const auto release = [&](int stage) { release_stage<kClusterSize>(barriers.empty, stage); };
    PipelineState<kStages> state;
    std::uint32_t held_phase = 0;
    typename Kernel::Accumulators accumulators{};
    for (int unit = first_unit; unit < num_units; unit += unit_step) {
      const int k_steps = Kernel::num_k_steps(params, unit);
      int register_steps = 0;
      if constexpr (Kernel::kMaxRegisterSteps > 0) {
        register_steps = Kernel::num_register_steps(params, unit);
      }
      int held = 0;
      if constexpr (kMaxHeldStages > 0) held = Kernel::num_held_stages(params, unit);
      // k-steps below this one hand their stage back; the rest are held.
      const int released_steps = k_steps - held;
      const int main_steps = k_steps - register_steps;
      int previous_stage = -1;
      for (int k_step = 0; k_step < main_steps; ++k_step) {
        ptx::mbarrier_wait(&barriers.full[state.stage], state.phase);
        Kernel::compute(params, unit, rank, shared.stages[state.stage], k_step, accumulators,
                        consumer);
        // One group stays in flight: the k-step just issued. The one before
        // has retired, so its stage goes back to the producers.
        ptx::wgmma_wait<1>();
        if (previous_stage >= 0 && k_step - 1 < released_steps) release(previous_stage);
        previous_stage = state.stage;
        state.advance();
      }
      ptx::wgmma_wait<0>();
      if (previous_stage >= 0 && main_steps - 1 < released_steps) release(previous_stage);
      // Register steps come last, once no wgmma is in flight: ptxas
      // serializes every wgmma of a kernel in which ordinary instructions
      // may write accumulators under a running wgmma.
      if constexpr (Kernel::kMaxRegisterSteps > 0) {
#pragma unroll
        for (int step = 0; step < Kernel::kMaxRegisterSteps; ++step) {
          if (step >= register_steps) break;
          ptx::mbarrier_wait(&barriers.full[state.stage], state.phase);
          Kernel::load_registers(params, unit, rank, shared.stages[state.stage], step,
                                 accumulators, consumer);
          if (main_steps + step < released_steps) {
            ptx::fence_async_shared();  // the next write into the stage is a copy
            release_stage_per_lane<kClusterSize>(barriers.empty, state.stage);
          }
          state.advance();
        }
      }
      if constexpr (kMaxHeldStages > 0) {
        const HeldStages<Kernel> held_stages{shared.stages, barriers.empty,
                                             (state.stage + kStages - held) % kStages};
        if (held > 0) ptx::named_barrier_sync<kConsumerWarps<Kernel> * 32>(kHeldStagesBarrier);
        Kernel::finish(params, unit, rank, accumulators, shared, consumer, held_stages);
        if (held > 0) {
          // The storer's copies read what finish wrote (async proxy); each
          // thread's arrival orders its own writes before them.
          ptx::fence_async_shared();
          ptx::mbarrier_wait(&barriers.held_empty, held_phase ^ 1);
          ptx::mbarrier_arrive(&barriers.held_full);
          held_phase ^= 1;
        }
      } else {
        Kernel::finish(params, unit, rank, accumulators, shared, consumer);
      }
    }
    drain_consumer<Kernel>(shared, consumer);
  }
}

// The __global__ kernel of a Kernel on the pipeline, launched with
// kPipelineThreads<Kernel> threads and kDynamicSharedBytes<Kernel> of
// dynamic shared memory, one CTA per SM: the barriers in static shared
// memory, the SharedStorage aligned in the dynamic shared memory. Compiled
// for a target without wgmma it is a trap (the ops' *_available() keep the
// host from launching it there); its static shared memory then exists only
// in sm_90a code, which is how the host tells that the binary carries it
// (device_support.cuh).
template <class Kernel>
__global__ void __launch_bounds__(kPipelineThreads<Kernel>, 1)
    pipeline_kernel(const __grid_constant__ typename Kernel::Params params) {
  static_assert(kDynamicSharedBytes<Kernel> + kStaticSharedBytes<KernelBarriers<Kernel>> <=
                    kMaxSharedBytesPerBlock,
                "the kernel's shared memory exceeds what an sm_90 block may have");
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  __shared__ KernelBarriers<Kernel> barriers;
  extern __shared__ unsigned char dynamic_shared[];
  const std::uint32_t misalignment = ptx::shared_address(dynamic_shared) % kSharedAlignment;
  auto& shared = *reinterpret_cast<typename Kernel::SharedStorage*>(
      dynamic_shared + (misalignment == 0 ? 0 : kSharedAlignment - misalignment));
  run_pipeline<Kernel>(params, shared, barriers);
#elif defined(__CUDA_ARCH__)
  __trap();
#endif
}

// ---- host: launching a pipeline kernel ----

// What a path of clustered pipeline kernels knows of a device: whether all
// its kernels run there, and how many clusters of each fit on it at once
// (the least over its kernels).
struct ClusterSupport {
  bool available = false;
  int clusters = 0;
};

// The launch of `clusters` clusters of Kernel (kClusterSize CTAs along x,
// kPipelineThreads threads and kDynamicSharedBytes each) on `stream`;
// `cluster_shape` is the attribute the config points to.
template <class Kernel>
cudaLaunchConfig_t launch_config(int clusters, cudaStream_t stream,
                                 cudaLaunchAttribute& cluster_shape) {
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(static_cast<unsigned>(clusters * Kernel::kClusterSize));
  config.blockDim = dim3(kPipelineThreads<Kernel>);
  config.dynamicSmemBytes = kDynamicSharedBytes<Kernel>;
  config.stream = stream;
  cluster_shape.id = cudaLaunchAttributeClusterDimension;
  cluster_shape.val.clusterDim.x = Kernel::kClusterSize;
  cluster_shape.val.clusterDim.y = 1;
  cluster_shape.val.clusterDim.z = 1;
  config.attrs = &cluster_shape;
  config.numAttrs = 1;
  return config;
}

// How many of the kernel's clusters fit on the device at once (its dynamic
// shared memory limit raised first: prepare_kernel).
template <class Kernel>
int max_active_clusters(int multiprocessors) {
  cudaLaunchAttribute cluster_shape{};
  const cudaLaunchConfig_t config =
      launch_config<Kernel>(multiprocessors / Kernel::kClusterSize, nullptr, cluster_shape);
  int clusters = 0;
  IKBO_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&clusters, pipeline_kernel<Kernel>, &config));
  return clusters;
}

// The clusters of Kernel that fit on the device at once, 0 if this binary
// or the device cannot run it.
template <class Kernel>
int clusters_if_ready(const HopperDevice& device) {
  if (!prepare_kernel(pipeline_kernel<Kernel>, kDynamicSharedBytes<Kernel>, device)) {
    return 0;
  }
  return max_active_clusters<Kernel>(device.multiprocessors);
}

}  // namespace ikbo::detail::cuda::sm90
