// The Hopper pipeline itself (src/cuda/sm90/pipeline.cuh) on CUDA device 0,
// with a kernel that does no tensor work: clusters of two CTAs whose
// consumers release every stage to both, three register steps per unit
// summed into the consumers' registers, and the last two stages held for
// the storer, which copies the sums out with bulk stores and hands the
// stages back. The sums are checked exactly against the host. device-check
// runs it under racecheck too: with the storer's hand-back as one remote
// arrival counting all eight consumer warps, racecheck ended every launch
// of the program this test grew from (bench/notes/racecheck_ring_repro.cu
// of 545e3f7, without multicast) with "unspecified launch failure"
// (bench/notes/lce_sm90.md, session 28), so the test guards the per-warp
// arrivals. The kernel's spare warp (producer warp 2) counts, with every
// lane, each unit of its CTA's walk: each unit must be counted once per
// CTA of its cluster by a whole warp. Skips, with the
// reason, unless device 0 is an sm_90 GPU and the build carries sm_90a code.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "cuda/sm90/pipeline.cuh"
#include "device_harness.hpp"

namespace ikbo::test {
namespace {

namespace sm90 = detail::cuda::sm90;
namespace ptx = detail::cuda::ptx;

constexpr int kThreadsPerConsumer = sm90::kWarpgroupThreads;

// A unit: main_steps k-steps that only pass through the ring, then three
// register steps. Every k-step brings one 44 KB stage image of the source.
struct RingKernel {
  static constexpr int kConsumerWarpgroups = 2;
  static constexpr int kStages = 5;
  static constexpr int kClusterSize = 2;
  static constexpr int kProducerRegisters = 40;
  static constexpr int kConsumerRegisters = 232;
  static constexpr int kStageBytes = 44 * 1024;
  // A consumer thread's registers: kQuads float4 quads, of which register
  // step s brings quads [11 s, 11 s + 11) (the last step 6).
  static constexpr int kQuads = 28;
  static constexpr int kQuadsPerStep = kStageBytes / (kConsumerWarpgroups * kThreadsPerConsumer * 16);
  static constexpr int kMaxRegisterSteps = 3;
  static constexpr int kMaxHeldStages = 2;
  // What finish stages per consumer warpgroup: kQuadsPerStep quads a thread.
  static constexpr int kOutBytes = kQuadsPerStep * kThreadsPerConsumer * 16;

  struct Params {
    const char* source;  // source_stages stage images
    char* out;           // per unit, CTA rank and consumer warpgroup: kOutBytes
    std::int32_t* visits;  // per unit and CTA rank: the spare warp's lanes that saw it
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
  using Held = sm90::HeldStages<RingKernel>;

  // The source image k-step `k_step` of unit `unit` brings (host and device).
  __host__ __device__ static int source_stage(int unit, int k_step, int source_stages) {
    return (unit * 17 + k_step) % source_stages;
  }
  // Where consumer `consumer`, thread `thread` finds quad `quad` of its
  // register step in the step's image (float4 units).
  __host__ __device__ static int image_quad(int quad, int consumer, int thread) {
    return (consumer * kQuadsPerStep + quad % kQuadsPerStep) * kThreadsPerConsumer + thread;
  }

  // Where unit `unit`'s output of CTA `rank`, consumer `consumer` lies in
  // `out`, in kOutBytes (host and device).
  __host__ __device__ static std::size_t out_slot(int unit, int rank, int consumer) {
    return (static_cast<std::size_t>(unit) * kClusterSize + rank) * kConsumerWarpgroups + consumer;
  }

  __device__ static int num_units(const Params& p) { return p.num_units; }
  __device__ static void spare_warp(const Params& p, const sm90::UnitWalk& walk, int rank, int) {
    for (int unit = walk.first; unit < walk.count; unit += walk.step) {
      atomicAdd(p.visits + unit * kClusterSize + rank, 1);
    }
  }
  __device__ static int num_k_steps(const Params& p, int) { return p.main_steps + kMaxRegisterSteps; }
  __device__ static std::uint32_t stage_bytes(const Params&, int, int) { return kStageBytes; }
  __device__ static void load(const Params& p, int unit, int, int k_step, Stage& stage,
                              std::uint64_t* full) {
    ptx::bulk_load(stage.bytes,
                   p.source + static_cast<std::size_t>(source_stage(unit, k_step, p.source_stages)) *
                                  kStageBytes,
                   kStageBytes, full);
  }
  // No tensor work: the main k-steps start the sums and pass the stages on.
  __device__ static void compute(const Params&, int, int, const Stage&, int k_step,
                                 Accumulators& acc, int) {
    if (k_step != 0) return;
#pragma unroll
    for (int i = 0; i < 4 * kQuads; ++i) acc.values[i] = 0.f;
  }
  __device__ static int num_register_steps(const Params&, int) { return kMaxRegisterSteps; }
  __device__ static void load_registers(const Params&, int, int, const Stage& stage, int step,
                                        Accumulators& acc, int consumer) {
    const int thread = static_cast<int>(threadIdx.x) % kThreadsPerConsumer;
    const auto* image = reinterpret_cast<const float4*>(stage.bytes);
#pragma unroll
    for (int quad = 0; quad < kQuads; ++quad) {
      if (quad / kQuadsPerStep != step) continue;
      const float4 value = image[image_quad(quad, consumer, thread)];
      acc.values[4 * quad] += value.x;
      acc.values[4 * quad + 1] += value.y;
      acc.values[4 * quad + 2] += value.z;
      acc.values[4 * quad + 3] += value.w;
    }
  }
  __device__ static int num_held_stages(const Params&, int) { return kMaxHeldStages; }
  // Quad q of a thread's output: the sum of its quads q, q + 11, q + 22.
  __device__ static void finish(const Params&, int, int, Accumulators& acc, SharedStorage&,
                                int consumer, const Held& held) {
    const int thread = static_cast<int>(threadIdx.x) % kThreadsPerConsumer;
    auto* staged = reinterpret_cast<float4*>(&held[consumer]);
#pragma unroll
    for (int quad = 0; quad < kQuadsPerStep; ++quad) {
      float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
      for (int part = quad; part < kQuads; part += kQuadsPerStep) {
        sum.x += acc.values[4 * part];
        sum.y += acc.values[4 * part + 1];
        sum.z += acc.values[4 * part + 2];
        sum.w += acc.values[4 * part + 3];
      }
      staged[quad * kThreadsPerConsumer + thread] = sum;
    }
  }
  __device__ static void store_held(const Params& p, int unit, int rank, const Held& held) {
    for (int consumer = 0; consumer < kConsumerWarpgroups; ++consumer) {
      ptx::bulk_store(p.out + out_slot(unit, rank, consumer) * kOutBytes, &held[consumer],
                      kOutBytes);
      ptx::bulk_commit_group();
    }
    held.template release_as_read<kConsumerWarpgroups>();
  }
};

bool ring_kernel_available(Device device) {
  const sm90::HopperDevice hopper = sm90::query_device(device.index);
  return hopper.sm90 && sm90::clusters_if_ready<RingKernel>(hopper) > 0;
}

// The host's value of quad `quad` of thread `thread` of consumer `consumer`
// for `unit`, component `component`.
float expected_output(const std::vector<float>& source, int unit, int main_steps,
                      int source_stages, int consumer, int thread, int quad, int component) {
  constexpr int kFloatsPerStage = RingKernel::kStageBytes / 4;
  float sum = 0.f;
  for (int part = quad; part < RingKernel::kQuads; part += RingKernel::kQuadsPerStep) {
    const int step = part / RingKernel::kQuadsPerStep;
    const int stage = RingKernel::source_stage(unit, main_steps + step, source_stages);
    sum += source[static_cast<std::size_t>(stage) * kFloatsPerStage +
                  4 * RingKernel::image_quad(part, consumer, thread) + component];
  }
  return sum;
}

TEST(PipelineSm90Test, RegisterStepsAndHeldStagesCarryEverySumAcrossClusters) {
  if (const auto reason = hopper_unavailable_reason(ring_kernel_available, "pipeline")) {
    GTEST_SKIP() << *reason;
  }
  constexpr Device kCuda = Device::cuda(0);
  // Enough units for several per cluster; small integers, so every sum is exact.
  constexpr int kUnits = 300, kMainSteps = 4, kSourceStages = 23;
  std::vector<float> source(static_cast<std::size_t>(kSourceStages) * RingKernel::kStageBytes / 4);
  for (std::size_t i = 0; i < source.size(); ++i) source[i] = static_cast<float>((i * 7) % 97);
  DeviceBuffer source_device(kCuda, std::as_bytes(std::span(source)));
  const std::size_t out_bytes = RingKernel::out_slot(kUnits, 0, 0) * RingKernel::kOutBytes;
  DeviceBuffer out_device(kCuda, out_bytes);
  const std::size_t num_visits = std::size_t{kUnits} * RingKernel::kClusterSize;
  DeviceBuffer visits_device(kCuda, num_visits * sizeof(std::int32_t));

  const sm90::HopperDevice hopper = sm90::query_device(kCuda.index);
  const int clusters =
      std::min(sm90::max_active_clusters<RingKernel>(hopper.multiprocessors), kUnits);
  ASSERT_GT(clusters, 0);
  const RingKernel::Params params{static_cast<const char*>(source_device.data()),
                                  static_cast<char*>(out_device.data()),
                                  static_cast<std::int32_t*>(visits_device.data()), kUnits,
                                  kMainSteps,
                                  kSourceStages};
  std::vector<std::byte> first_run;
  for (int run = 0; run < 2; ++run) {
    // Poisoned before each run: every byte must be written again.
    out_device.upload(std::vector<std::byte>(out_bytes, std::byte{0xff}));
    visits_device.upload(std::vector<std::byte>(visits_device.bytes(), std::byte{0}));
    cudaLaunchAttribute cluster_shape{};
    const cudaLaunchConfig_t config =
        sm90::launch_config<RingKernel>(clusters, nullptr, cluster_shape);
    ASSERT_EQ(cudaLaunchKernelEx(&config, sm90::pipeline_kernel<RingKernel>, params), cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const std::vector<std::int32_t> visits = read_int32(
        static_cast<const std::int32_t*>(visits_device.data()), num_visits, kCuda);
    EXPECT_TRUE(std::all_of(visits.begin(), visits.end(), [](int lanes) { return lanes == 32; }))
        << "a unit not seen exactly once per CTA by the whole spare warp";
    std::vector<std::byte> out = out_device.download();
    if (run == 0) {
      first_run = out;
    } else {
      EXPECT_EQ(out, first_run) << "two runs differ";
    }
  }

  std::vector<float> out(out_bytes / sizeof(float));
  std::memcpy(out.data(), first_run.data(), out_bytes);
  int mismatches = 0;
  for (int unit = 0; unit < kUnits; ++unit) {
    for (int rank = 0; rank < RingKernel::kClusterSize; ++rank) {
      for (int consumer = 0; consumer < RingKernel::kConsumerWarpgroups; ++consumer) {
        const std::size_t slot = RingKernel::out_slot(unit, rank, consumer);
        for (int quad = 0; quad < RingKernel::kQuadsPerStep; ++quad) {
          for (int thread = 0; thread < kThreadsPerConsumer; ++thread) {
            for (int component = 0; component < 4; ++component) {
              const float expected = expected_output(source, unit, kMainSteps, kSourceStages,
                                                     consumer, thread, quad, component);
              const float got =
                  out[slot * RingKernel::kOutBytes / 4 +
                      4 * (static_cast<std::size_t>(quad) * kThreadsPerConsumer + thread) +
                      component];
              if (got != expected && ++mismatches <= 5) {
                ADD_FAILURE() << "unit " << unit << " rank " << rank << " consumer " << consumer
                              << " quad " << quad << " thread " << thread << " component "
                              << component << ": " << got << ", expected " << expected;
              }
            }
          }
        }
      }
    }
  }
  EXPECT_EQ(mismatches, 0);
}

}  // namespace
}  // namespace ikbo::test
