// bench/notes/racecheck_ring_repro.cu — a synchronization-only kernel on
// ikbo's pipeline (src/cuda/sm90/pipeline.cuh), kept as the evidence of
// session 28's racecheck finding (bench/notes/lce_sm90.md). Not part of the
// build. It runs the LCE kernel's ring without its work: clusters of two,
// five 44 KB stages, each main k-step a 16 KB bulk load of the CTA's own
// plus two 14 KB halves multicast by the two CTAs, three register steps
// whose values the consumers add to 112 fp32 registers, and the last two
// stages held for the storer, which bulk-stores them and hands them back.
// No wgmma, no tensor maps, no flags; the values are not checked (the
// program exercises the synchronization only). Knobs (-D...): REPRO_HELD (2 or 0),
// REPRO_REGSTEPS (3 or 0), REPRO_MULTICAST (1 or 0: each CTA loads its
// whole stage itself), REPRO_CLUSTER (2 or 1), REPRO_NOSTORES (the storer
// only hands the stages back), REPRO_WHOLE_COUNT (the storer hands each
// stage back with one arrival of 256 per CTA, as pipeline.cuh did before
// session 28, instead of HeldStages::release's eight arrivals of 32).
//
// Build (from the repository root, after the library is built in build/):
//   nvcc -std=c++20 -O3 -lineinfo --expt-relaxed-constexpr -DIKBO_WITH_CUDA=1 \
//     --generate-code=arch=compute_90a,code=[sm_90a] -Iinclude -Isrc \
//     -DREPRO_MULTICAST=0 -DREPRO_WHOLE_COUNT=1 bench/notes/racecheck_ring_repro.cu \
//     build/libikbo.a -o ring_repro
// Run: compute-sanitizer --tool racecheck ./ring_repro [units 1000] [main k-steps 14] [launches 2]
//
// Session 28 (H200, racecheck of compute-sanitizer from CUDA 13; runs of one
// process each; every build also ran clean without the tool):
//   whole-count releases, no multicast       launch failure in 22 of 22 runs
//   the same, all remote arrivals .release.cluster      6 of 6
//   the same, own CTA's arrival local                    4 of 4
//   the same, no bulk stores                             4 of 4
//   the same, no register steps                          5 of 6
//   the same, no register steps and no bulk stores       4 of 4
//   the same, no held stages                             0 of 6
//   the same, no held stages and no register steps       0 of 6
//   the same, clusters of one                            0 of 6
//   per-warp releases (eight arrivals of 32), no multicast   0 of 4
// With the (non-tensor) multicast on, racecheck instead reports a hazard
// in every run, between the peer's multicast write and the register
// steps' reads of a held stage, whatever the scope of the arrivals; the LCE
// kernel multicasts with tensor maps and racecheck reports nothing there.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>

#include "cuda/sm90/pipeline.cuh"

using namespace ikbo::detail::cuda;

#ifndef REPRO_HELD
#define REPRO_HELD 2
#endif
#ifndef REPRO_REGSTEPS
#define REPRO_REGSTEPS 3
#endif
#ifndef REPRO_CLUSTER
#define REPRO_CLUSTER 2
#endif
#ifndef REPRO_MULTICAST
#define REPRO_MULTICAST 1
#endif
#ifndef REPRO_WHOLE_COUNT
#define REPRO_WHOLE_COUNT 0
#endif

namespace {

__device__ __forceinline__ void bulk_load_multicast(void* dst, const void* src, std::uint32_t bytes,
                                                    std::uint64_t* bar, std::uint16_t mask) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster "
      "[%0], [%1], %2, [%3], %4;\n" ::"r"(ptx::shared_address(dst)),
      "l"(src), "r"(bytes), "r"(ptx::shared_address(bar)), "h"(mask)
      : "memory");
}

struct RingKernel {
  static constexpr int kConsumerWarpgroups = 2;
  static constexpr int kStages = 5;
  static constexpr int kClusterSize = REPRO_CLUSTER;
  static constexpr int kProducerRegisters = 40;
  static constexpr int kConsumerRegisters = 232;
  static constexpr int kOwnBytes = 16384, kHalfBytes = 14336;
  static constexpr int kStageBytes = kOwnBytes + 2 * kHalfBytes;  // 44 KB
  static constexpr int kQuads = 28;
  static constexpr int kQuadsPerStep = kStageBytes / (256 * 16);  // 11
  static constexpr int kMaxRegisterSteps = REPRO_REGSTEPS;
  static constexpr int kMaxHeldStages = REPRO_HELD;

  struct Params {
    const char* source;  // source_stages stages of bytes, read round-robin
    float* out;          // per unit and CTA, REPRO_HELD stage images
    int num_units, main_steps, source_stages;
  };
  struct Accumulators {
    float values[4 * kQuads];
  };
  struct alignas(1024) Stage {
    char bytes[kStageBytes];
  };
  struct SharedStorage {
    Stage stages[kStages];
  };

  __device__ static int num_units(const Params& p) { return p.num_units; }
  __device__ static int num_k_steps(const Params& p, int) { return p.main_steps + REPRO_REGSTEPS; }
  __device__ static std::uint32_t stage_bytes(const Params&, int, int) { return kStageBytes; }
  __device__ static const char* source_stage(const Params& p, int unit, int k_step) {
    return p.source + static_cast<std::size_t>((unit * 17 + k_step) % p.source_stages) * kStageBytes;
  }
  __device__ static void load(const Params& p, int unit, int rank, int k_step, Stage& stage,
                              std::uint64_t* full) {
    const char* src = source_stage(p, unit, k_step);
    if (k_step >= p.main_steps || !REPRO_MULTICAST || REPRO_CLUSTER == 1) {
      ptx::bulk_load(stage.bytes, src, kStageBytes, full);
      return;
    }
    ptx::bulk_load(stage.bytes, src, kOwnBytes, full);
    const int offset = kOwnBytes + rank * kHalfBytes;
    bulk_load_multicast(stage.bytes + offset, src + offset, kHalfBytes, full, 3);
  }
  __device__ static int num_register_steps(const Params&, int) { return REPRO_REGSTEPS; }
  __device__ static int num_held_stages(const Params&, int) { return REPRO_HELD; }

  __device__ static void load_registers(const Params&, int, int, const Stage& stage, int step,
                                        Accumulators& acc, int consumer) {
    const int thread = static_cast<int>(threadIdx.x) % 128;
    const auto* image = reinterpret_cast<const float4*>(stage.bytes);
#pragma unroll
    for (int quad = 0; quad < kQuads; ++quad) {
      if (quad / kQuadsPerStep == step) {
        const float4 v = image[(consumer * kQuadsPerStep + quad % kQuadsPerStep) * 128 + thread];
        acc.values[4 * quad] += v.x;
        acc.values[4 * quad + 1] += v.y;
        acc.values[4 * quad + 2] += v.z;
        acc.values[4 * quad + 3] += v.w;
      }
    }
  }
  // No tensor work: the main steps only pass through the ring.
  __device__ static void compute(const Params&, int, int, const Stage&, int k_step,
                                 Accumulators& acc, int) {
    if (k_step == 0) {
#pragma unroll
      for (int i = 0; i < 4 * kQuads; ++i) acc.values[i] = 0.f;
    }
  }
  using Held = sm90::HeldStages<RingKernel>;
#if REPRO_HELD == 0
  // Without held stages the pipeline calls this one.
  __device__ static void finish(const Params&, int, int, Accumulators&, SharedStorage&, int) {}
#endif
  __device__ static void finish(const Params&, int, int, Accumulators& acc, SharedStorage&,
                                int consumer, const Held& held) {
    if constexpr (REPRO_HELD > 0) {
      const int thread = static_cast<int>(threadIdx.x) % 128;
      constexpr int kHeld = REPRO_HELD > 0 ? REPRO_HELD : 1;
      auto* image = reinterpret_cast<float4*>(&held[consumer % kHeld]);
#pragma unroll
      for (int quad = 0; quad < kQuadsPerStep; ++quad) {
        image[(consumer * kQuadsPerStep + quad) * 128 + thread] =
            make_float4(acc.values[4 * quad], acc.values[4 * quad + 1], acc.values[4 * quad + 2],
                        acc.values[4 * quad + 3]);
      }
    }
  }
  __device__ static void store_held(const Params& p, int unit, int rank, const Held& held) {
#ifndef REPRO_NOSTORES
    for (int i = 0; i < REPRO_HELD; ++i) {
      float* dst = p.out + (static_cast<std::size_t>(unit) * 2 + rank) * REPRO_HELD * kStageBytes / 4 +
                   static_cast<std::size_t>(i) * kStageBytes / 4;
      ptx::bulk_store(dst, &held[i], kStageBytes);
      ptx::bulk_commit_group();
    }
    ptx::bulk_wait_group_read<0>();
#endif
    for (int i = 0; i < REPRO_HELD; ++i) {
      if constexpr (REPRO_WHOLE_COUNT && REPRO_CLUSTER > 1) {
        for (int target = 0; target < REPRO_CLUSTER; ++target) {
          ptx::remote_mbarrier_arrive(&held.empty[held.index(i)], target,
                                      sm90::kConsumerWarps<RingKernel> * sm90::kWarpArrivals);
        }
      } else {
        held.release(i);
      }
    }
  }
};

}  // namespace

int main(int argc, char** argv) {
  const int units = argc > 1 ? std::atoi(argv[1]) : 1000;
  const int main_steps = argc > 2 ? std::atoi(argv[2]) : 14;
  const int launches = argc > 3 ? std::atoi(argv[3]) : 2;
  using K = RingKernel;
  const int source_stages = 512;
  char* source = nullptr;
  float* out = nullptr;
  cudaMalloc(&source, static_cast<std::size_t>(source_stages) * K::kStageBytes);
  cudaMemset(source, 0, static_cast<std::size_t>(source_stages) * K::kStageBytes);
  const std::size_t out_bytes = static_cast<std::size_t>(units) * 2 * (REPRO_HELD > 0 ? REPRO_HELD : 1) * K::kStageBytes;
  cudaMalloc(&out, out_bytes);
  sm90::HopperDevice device = sm90::query_device(0);
  if (!sm90::prepare_kernel(sm90::pipeline_kernel<K>, sm90::kDynamicSharedBytes<K>, device)) {
    std::printf("kernel not runnable here\n");
    return 2;
  }
  const int clusters = std::min(sm90::max_active_clusters<K>(device.multiprocessors), units);
  K::Params params{source, out, units, main_steps, source_stages};
  for (int l = 0; l < launches; ++l) {
    cudaLaunchAttribute shape{};
    const cudaLaunchConfig_t config = sm90::launch_config<K>(clusters, nullptr, shape);
    cudaError_t st = cudaLaunchKernelEx(&config, sm90::pipeline_kernel<K>, params);
    if (st == cudaSuccess) st = cudaDeviceSynchronize();
    if (st != cudaSuccess) {
      std::printf("launch %d: %s\n", l, cudaGetErrorString(st));
      return 1;
    }
  }
  std::printf("ok: %d launches of %d units on %d clusters\n", launches, units, clusters);
  return 0;
}
