// src/cuda/sm90/linear_sm90.cu — linear on Hopper: the candidate GEMM on TMA
// loads and wgmma with fp32 accumulators (sm90/pipeline.cuh), the user part
// added in its epilogue.
//
//   out[b] = round(x_c[b] @ w_c^T + (P[cand_to_user[b]] + bias))
//
// One persistent launch on the caller's stream runs two kinds of work units:
//   user units       P = x_u @ w_u^T [U, N_out] in fp32 into the workspace,
//                    once per user, a tile at a time (the same GEMM with
//                    x_u and w_u as operands), each stored tile counted on
//                    one ready counter;
//   candidate units  out[b] = round(x_c[b] @ w_c^T + (P[u(b)] + bias)): the
//                    main loop, then the epilogue waits until every user
//                    tile is counted, adds the row of P its candidate maps
//                    to and the bias to the fp32 accumulators and rounds
//                    once. No candidate partial goes to memory.
// User units come first in the walk and are short (Ku / 64 k-steps), so
// every P tile is stored long before a candidate unit's 63-step main loop
// ends, and a unit only ever waits for units earlier in the walk, which
// their clusters take before any later one: no deadlock at any grid size.
// (The counter is zeroed by a memset before the launch.) Computing P in the
// launch instead of a cuBLAS GEMM before it saves that GEMM's ~4.7 us of
// mostly fixed latency (H100, U = 15, Ku = 256, N_out = 512).
//
// Tile = kRows candidates x kFeatures outputs (linear_sm90_tiles()), one
// consumer warpgroup per 64 candidates; per k-step of 64:
//   A = x_c[b0:b0+64, k0:k0+64] per consumer warpgroup, read in place
//       through a 2-D map {Kc, B}: K-major, 128-byte swizzle. Columns
//       k >= Kc and rows b >= B arrive as zeros, so a K tail never reads
//       the next candidate's row (0 x Inf is NaN) and nothing past the end
//       of x_c is read.
//   B = w_c[n0:n0+kFeatures, k0:k0+64] from the plan's padded copy:
//       K-major, 128-byte swizzle; rows n >= N_out arrive as zeros.
// Each consumer warpgroup runs m64n{kFeatures}k16 over its 64 candidates.
// User units run the same tiles on x_u [U, Ku] and w_u.
//
// Clusters of two. The two CTAs of a cluster take neighbouring feature
// blocks of the same candidate block, so they need the same rows of x_c:
// each loads half of them (boxes {64 k, 32 rows}) and multicasts them into
// both CTAs. Units (tiles) walk (candidate block, feature block pair) with
// the pairs innermost, so the clusters that share a block of x_c run side
// by side and its rows come from DRAM once. Feature blocks are padded to an
// even count; a block past N_out computes zeros and stores nothing.
//
// Why these tiles. The GEMMs are small and long (the model's layer:
// B = 512..3072 x N_out = 512 over Kc = 3976, 63 k-steps) and bound by the
// operand bytes crossing from L2 to the SMs (H100, ncu at B = 1024: 64 x 64
// tiles without multicast moved 138 MB from L2 in 30.9 us, cuBLAS's 64 x 64
// kernel with 2-CTA clusters 91 MB in 18.4 us, both at ~62% of L2 peak).
// So all SMs stream, the ring takes as many stages as fit in shared
// memory, a cluster shares its x_c rows, and the host picks the tile by the
// shapes (linear_sm90_tile).
//
// Epilogue: straight from registers. Each thread holds, per 8-wide column
// group j, two adjacent features of two rows; it loads P[user] (from L2:
// P was written in this launch) and the bias for all of them first
// (independent loads), then adds,
// rounds and stores pairs (4 bytes) where N_out is even and out 4-byte
// aligned, single elements otherwise. out is small next to the operands
// (N_out / Kc of x_c's bytes here), so staging it for TMA stores would buy
// little.
#include "cuda/sm90/linear_sm90.hpp"

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <type_traits>
#include <vector>

#include "cuda/check.cuh"
#include "cuda/dtype.cuh"
#include "cuda/ptx/flags.cuh"
#include "cuda/ptx/sm80.cuh"
#include "cuda/ptx/tma.cuh"
#include "cuda/ptx/warpgroup.cuh"
#include "cuda/ptx/wgmma.cuh"
#include "cuda/runtime.cuh"
#include "cuda/sm90/device_support.cuh"
#include "cuda/sm90/pipeline.cuh"
#include "cuda/sm90/weight_maps.cuh"

namespace ikbo::detail::cuda {
namespace {

using sm90::kSharedAlignment;
using sm90::kWarpgroupThreads;

constexpr int kWarpgroupRows = 64;  // candidates per consumer warpgroup (wgmma M)
constexpr int kBlockK = 64;         // one 128-byte swizzle row of 16-bit elements
constexpr int kWgmmaK = 16;
constexpr int kSwizzleRowBytes = 128;
constexpr int kElementBytes = 2;
// Shared memory for the ring: as many stages as fit below the 227 KB a CTA
// may opt in to, with room for the alignment slack and the barriers.
constexpr int kRingBytes = 220 * 1024;

constexpr std::array<LinearSm90Tile, 4> kTiles{
    {{64, 64}, {64, 128}, {128, 64}, {128, 128}}};

struct LinearSm90Params {
  // Rows {K, rows} in boxes {64 k, 32 rows} (each CTA of a cluster loads
  // half of a consumer's 64 rows): x_c [B, Kc] and x_u [U, Ku].
  CUtensorMap candidates, users;
  // {K, N_out}, rows ld apart, boxes {64 k, kFeatures rows}: w_c, w_u.
  CUtensorMap candidate_weights, user_weights;
  float* user_partials;  // P [U, N_out], fp32
  int* users_done;       // consumer warpgroups that stored their part of a P tile
  const void* bias;      // [N_out] in the element type, or null
  const std::int32_t* cand_to_user;
  void* out;  // [B, N_out]
  int num_candidates, num_users, out_features;
  int feature_pairs;
  // Units: user units (user blocks x feature block pairs), then candidate
  // units (candidate blocks x feature block pairs).
  int num_user_units, num_units;
  int user_k_steps, candidate_k_steps;
  bool paired_stores;  // N_out even and out 4-byte aligned: two features per store
};

template <typename Element, int kRows, int kFeatures>
struct LinearSm90Kernel {
  static constexpr int kConsumerWarpgroups = kRows / kWarpgroupRows;
  static constexpr int kClusterSize = 2;
  static constexpr int kSharedRows = kWarpgroupRows / kClusterSize;  // rows of A each CTA loads
  // 128 x 40 + 256 x 232 <= 64K registers of the SM.
  static constexpr int kProducerRegisters = 40;
  static constexpr int kConsumerRegisters = 232;
  static constexpr int kMaxRegisterSteps = 0;
  static constexpr int kAccumulators = kWarpgroupRows * kFeatures / kWarpgroupThreads;
  static constexpr int kColumnGroups = kFeatures / 8;  // 8-wide groups of the wgmma fragment

  using Params = LinearSm90Params;
  struct Accumulators {
    float values[kAccumulators];
  };
  struct Stage {
    Element rows[kConsumerWarpgroups][kWarpgroupRows * kBlockK];  // x_c or x_u, [row][k] each
    Element weights[kFeatures * kBlockK];                                // [n][k]
  };
  static constexpr int kStages = kRingBytes / static_cast<int>(sizeof(Stage));
  struct SharedStorage {
    Stage stages[kStages];
  };
  static_assert(kSharedRows * kBlockK * kElementBytes % kSharedAlignment == 0 &&
                    sizeof(Stage::rows[0]) % kSharedAlignment == 0 &&
                    sizeof(Stage::rows) % kSharedAlignment == 0 &&
                    sizeof(Stage) % kSharedAlignment == 0,
                "every TMA box and wgmma operand must start on a 1024-byte swizzle atom");

  __device__ static int num_units(const Params& params) { return params.num_units; }
  __device__ static bool is_user_unit(const Params& params, int unit) {
    return unit < params.num_user_units;
  }
  __device__ static int num_k_steps(const Params& params, int unit) {
    return is_user_unit(params, unit) ? params.user_k_steps : params.candidate_k_steps;
  }
  // The unit's index among the units of its kind.
  __device__ static int tile_of(const Params& params, int unit) {
    return is_user_unit(params, unit) ? unit : unit - params.num_user_units;
  }
  // What the producer loads for a unit, decoded once per unit (the
  // pipeline's describe hook) rather than at every k-step: its stage
  // release to load issue is on the main loop's critical path.
  struct Loads {
    bool user;
    int row0;      // this CTA's first shared row of the tile
    int feature0;  // this CTA's first feature
  };
  __device__ static Loads describe(const Params& params, int unit) {
    const int rank = static_cast<int>(ptx::cluster_rank());
    return {is_user_unit(params, unit), first_row(params, unit) + rank * kSharedRows,
            first_feature(params, unit, rank)};
  }
  __device__ static int num_k_steps(const Params& params, const Loads& loads) {
    return loads.user ? params.user_k_steps : params.candidate_k_steps;
  }
  // Out-of-bounds parts of a box are zero-filled and still counted.
  __device__ static std::uint32_t stage_bytes(const Params&, const Loads&, int) {
    return sizeof(Stage);
  }

  // First row (of x_c or x_u) of the unit's tile.
  __device__ static int first_row(const Params& params, int unit) {
    return tile_of(params, unit) / params.feature_pairs * kRows;
  }
  // The CTA of rank r takes feature block 2 * pair + r.
  __device__ static int first_feature(const Params& params, int unit, int rank) {
    return (tile_of(params, unit) % params.feature_pairs * kClusterSize + rank) * kFeatures;
  }

  __device__ static void load(const Params& params, const Loads& loads, int rank, int k_step,
                              Stage& stage, std::uint64_t* full) {
    const CUtensorMap* row_map = loads.user ? &params.users : &params.candidates;
    const CUtensorMap* weight_map = loads.user ? &params.user_weights : &params.candidate_weights;
    const int k0 = k_step * kBlockK;
#pragma unroll
    for (int consumer = 0; consumer < kConsumerWarpgroups; ++consumer) {
      ptx::tma_load_multicast(stage.rows[consumer] + rank * kSharedRows * kBlockK, row_map, k0,
                              loads.row0 + consumer * kWarpgroupRows, full,
                              (1u << kClusterSize) - 1);
    }
    ptx::tma_load(stage.weights, weight_map, k0, loads.feature0, full);
  }

  __device__ static void compute(const Params&, int, int, const Stage& stage, int k_step,
                                 Accumulators& accumulators, int consumer) {
    // Both operands K-major: rows of 128 bytes, 8-row swizzle atoms 1024
    // bytes apart (the stride offset; the leading offset is unused).
    constexpr std::uint32_t kAtomBytes = 8 * kSwizzleRowBytes;
    const std::uint64_t a = ptx::wgmma_descriptor_sw128(stage.rows[consumer], 16, kAtomBytes);
    const std::uint64_t b = ptx::wgmma_descriptor_sw128(stage.weights, 16, kAtomBytes);
    ptx::fence_operands(accumulators.values);
    ptx::wgmma_fence();
#pragma unroll
    for (int slice = 0; slice < kBlockK / kWgmmaK; ++slice) {
      const std::uint32_t offset = slice * kWgmmaK * kElementBytes;
      ptx::wgmma_ss<Element, 0, 0, kFeatures>(accumulators.values,
                                               ptx::advance_descriptor(a, offset),
                                               ptx::advance_descriptor(b, offset),
                                               k_step > 0 || slice > 0);
    }
    ptx::wgmma_commit_group();
    ptx::fence_operands(accumulators.values);
  }

  // Fragment of m64nN: thread (warp w, lane l) holds rows 16w + l/4 and
  // 16w + l/4 + 8, and in column group j the features 8j + 2(l%4) and the
  // next one: acc[4j], acc[4j+1] for the first row, acc[4j+2], acc[4j+3]
  // for the second.
  __device__ static void finish(const Params& params, int unit, int rank,
                                Accumulators& accumulators, SharedStorage&, int consumer) {
    ptx::fence_operands(accumulators.values);
    const int first = first_feature(params, unit, rank);
    // The padding block of an odd count of feature blocks stores nothing
    // (but a user unit's still counts as done).
    const bool padding = first >= params.out_features;
    const float* acc = accumulators.values;
    const int thread = static_cast<int>(threadIdx.x) % kWarpgroupThreads;
    const int warp = thread / 32, lane = thread % 32;
    const int row0 = first_row(params, unit) + consumer * kWarpgroupRows + 16 * warp + lane / 4;
    const int feature0 = first + 2 * (lane % 4);
    const int n = params.out_features;
    const std::uint32_t barrier_id = 1 + consumer;

    if (is_user_unit(params, unit)) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int row = row0 + 8 * half;
        if (padding || row >= params.num_users) continue;
        float* partial_row = params.user_partials + static_cast<std::int64_t>(row) * n;
#pragma unroll
        for (int j = 0; j < kColumnGroups; ++j) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int feature = feature0 + 8 * j + e;
            if (feature < n) partial_row[feature] = acc[4 * j + 2 * half + e];
          }
        }
      }
      ptx::named_barrier_sync<kWarpgroupThreads>(barrier_id);
      if (thread == 0) ptx::signal_ready(params.users_done);
      return;
    }
    if (padding) return;
    // Every P tile stored (user units come first in the walk, so this
    // returns at once but at the very start of a launch).
    if (thread == 0) {
      ptx::wait_ready(params.users_done,
                      params.num_user_units * kClusterSize * kConsumerWarpgroups);
    }
    ptx::named_barrier_sync<kWarpgroupThreads>(barrier_id);
    const auto* bias = static_cast<const Element*>(params.bias);
    auto* out = static_cast<Element*>(params.out);

    // The bias of this thread's features, shared by both rows.
    float2 bias_pair[kColumnGroups];
#pragma unroll
    for (int j = 0; j < kColumnGroups; ++j) {
      const int feature = feature0 + 8 * j;
      bias_pair[j] = make_float2(
          bias != nullptr && feature < n ? to_float(bias[feature]) : 0.0f,
          bias != nullptr && feature + 1 < n ? to_float(bias[feature + 1]) : 0.0f);
    }
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = row0 + 8 * half;
      if (row >= params.num_candidates) continue;
      // P was written in this launch: loads that bypass L1 (flags.cuh).
      const float* partial =
          params.user_partials +
          static_cast<std::int64_t>(__ldg(params.cand_to_user + row)) * n;
      Element* out_row = out + static_cast<std::int64_t>(row) * n;
      if (params.paired_stores) {
        // N_out even: feature < N_out implies feature + 1 < N_out.
        float2 addend[kColumnGroups];
#pragma unroll
        for (int j = 0; j < kColumnGroups; ++j) {
          const int feature = feature0 + 8 * j;
          addend[j] = feature < n ? __ldcg(reinterpret_cast<const float2*>(partial + feature))
                                  : make_float2(0.0f, 0.0f);
        }
#pragma unroll
        for (int j = 0; j < kColumnGroups; ++j) {
          const int feature = feature0 + 8 * j;
          if (feature >= n) continue;
          const float low = acc[4 * j + 2 * half] + (addend[j].x + bias_pair[j].x);
          const float high = acc[4 * j + 2 * half + 1] + (addend[j].y + bias_pair[j].y);
          *reinterpret_cast<std::uint32_t*>(out_row + feature) =
              ptx::pack_pair<Element>(low, high);
        }
      } else {
#pragma unroll
        for (int j = 0; j < kColumnGroups; ++j) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int feature = feature0 + 8 * j + e;
            if (feature >= n) continue;
            const float user_part =
                __ldcg(partial + feature) + (e == 0 ? bias_pair[j].x : bias_pair[j].y);
            out_row[feature] = from_float<Element>(acc[4 * j + 2 * half + e] + user_part);
          }
        }
      }
    }
  }
};

template <typename Element, int kRows, int kFeatures>
using KernelFor = LinearSm90Kernel<Element, kRows, kFeatures>;

// Calls fn(std::integral_constant<int, rows>, std::integral_constant<int,
// features>) for tile kTiles[index].
template <typename Fn>
void with_tile(int index, Fn&& fn) {
  switch (index) {
    case 0: return fn(std::integral_constant<int, 64>{}, std::integral_constant<int, 64>{});
    case 1: return fn(std::integral_constant<int, 64>{}, std::integral_constant<int, 128>{});
    case 2: return fn(std::integral_constant<int, 128>{}, std::integral_constant<int, 64>{});
    default: return fn(std::integral_constant<int, 128>{}, std::integral_constant<int, 128>{});
  }
}

// ---- device support, probed once per device ----

using DeviceSupport = sm90::ClusterSupport;

DeviceSupport probe_device(int ordinal) {
  const sm90::HopperDevice device = sm90::query_device(ordinal);
  if (!device.sm90) return {};
  int clusters = std::numeric_limits<int>::max();
  for (int index = 0; index < static_cast<int>(kTiles.size()); ++index) {
    with_tile(index, [&](auto rows, auto features) {
      using Half = KernelFor<__half, rows, features>;
      using Bfloat16 = KernelFor<__nv_bfloat16, rows, features>;
      clusters = std::min({clusters, sm90::clusters_if_ready<Half>(device),
                           sm90::clusters_if_ready<Bfloat16>(device)});
    });
  }
  return {clusters > 0, clusters};
}

DeviceSupport device_support(int ordinal) {
  return sm90::probed_once<DeviceSupport, probe_device>(ordinal);
}

struct PathSwitch;  // tags this path's sm90::enabled_switch

int forced_tile_from_environment() {
  const char* value = std::getenv("IKBO_LINEAR_SM90_TILE");
  if (value == nullptr || *value == '\0') return -1;
  const int index = std::atoi(value);
  return index >= 0 && index < static_cast<int>(kTiles.size()) ? index : -1;
}

std::atomic<int>& forced_tile() {
  static std::atomic<int> index{forced_tile_from_environment()};
  return index;
}

std::int64_t ceil_div(std::int64_t a, std::int64_t b) { return (a + b - 1) / b; }

// Tiles of `rows` rows (candidates or users) and all features, in units of
// a cluster (two feature blocks).
std::int64_t num_units(std::int64_t rows, std::int64_t out_features, const LinearSm90Tile& tile) {
  return ceil_div(rows, tile.rows) * ceil_div(out_features, 2 * tile.features);
}

// Predicted main-loop time of a tile on these shapes (seconds, without the
// fixed costs every tile shares). The k-steps are bound either by the bytes
// one CTA takes in (its whole tile: rows + features rows of 128 bytes) at
// ~90 GB/s per SM, or by the bytes all running CTAs read from L2 (half the
// rows, multicast, + features) at ~5.2 TB/s, whichever is slower; fitted to
// H100 measurements of the four tiles at B = 512..3072, N_out = 512,
// Kc = 3976 (bench/notes/linear_sm90.md). The cluster with the most k-steps
// (the static walk: cluster c takes units c, c + clusters, ...) sets the
// time.
double predicted_seconds(const LinearSm90Tile& tile, std::int64_t num_candidates,
                         std::int64_t num_users, std::int64_t out_features, std::int64_t kc,
                         std::int64_t ku, int clusters) {
  constexpr double kCtaBytesPerSecond = 90e9, kL2BytesPerSecond = 5.2e12;
  const std::int64_t user_units = num_units(num_users, out_features, tile);
  const std::int64_t units = user_units + num_units(num_candidates, out_features, tile);
  const std::int64_t user_steps = ceil_div(ku, kBlockK), candidate_steps = ceil_div(kc, kBlockK);
  std::int64_t max_steps = 0;
  for (std::int64_t cluster = 0; cluster < std::min<std::int64_t>(clusters, units); ++cluster) {
    // Units cluster, cluster + clusters, ...: how many are user units.
    const std::int64_t taken = ceil_div(units - cluster, clusters);
    const std::int64_t users_taken =
        cluster < user_units ? ceil_div(user_units - cluster, clusters) : 0;
    max_steps = std::max(max_steps,
                         users_taken * user_steps + (taken - users_taken) * candidate_steps);
  }
  const double row_bytes = kBlockK * kElementBytes;
  const double cta_bytes = (tile.rows + tile.features) * row_bytes;
  const double running_ctas = 2.0 * static_cast<double>(std::min<std::int64_t>(units, clusters));
  const double l2_bytes = running_ctas * (tile.rows / 2 + tile.features) * row_bytes;
  return static_cast<double>(max_steps) *
         std::max(cta_bytes / kCtaBytesPerSecond, l2_bytes / kL2BytesPerSecond);
}

// The tile predicted fastest; ties go to the smaller tile.
int tile_index(const LinearPlan::State& plan, std::int64_t num_candidates,
               std::int64_t num_users, int clusters) {
  if (const int forced = forced_tile().load(); forced >= 0) return forced;
  int best = 0;
  double best_seconds = std::numeric_limits<double>::max();
  for (int index = 0; index < static_cast<int>(kTiles.size()); ++index) {
    const double seconds =
        predicted_seconds(kTiles[static_cast<std::size_t>(index)], num_candidates, num_users,
                          plan.out_features, plan.kc, plan.ku, clusters);
    if (seconds < best_seconds) {
      best = index;
      best_seconds = seconds;
    }
  }
  return best;
}

template <typename Element, int kRows, int kFeatures>
void run_linear_sm90(const LinearArgs& args, const LinearSm90Workspace& workspace,
                     int max_clusters, cudaStream_t stream) {
  using Kernel = KernelFor<Element, kRows, kFeatures>;
  const LinearPlan::State& plan = *args.plan;
  const LinearSm90Tile tile{kRows, kFeatures};
  LinearSm90Params params{};
  params.candidates = ptx::k_major_map<Element>(args.x_c, plan.kc, plan.kc,
                                                args.num_candidates, Kernel::kSharedRows);
  params.users =
      ptx::k_major_map<Element>(args.x_u, plan.ku, plan.ku, args.num_users, Kernel::kSharedRows);
  const WeightTensorMaps::Boxes& weights = plan.weight_maps->with_rows(kFeatures);
  params.candidate_weights = weights.candidate;
  params.user_weights = weights.user;
  params.user_partials = workspace.user_partials;
  params.users_done = workspace.users_done;
  params.bias = plan.bias;
  params.cand_to_user = args.map->device_view.cand_to_user;
  params.out = args.out;
  params.num_candidates = static_cast<int>(args.num_candidates);
  params.num_users = static_cast<int>(args.num_users);
  params.out_features = static_cast<int>(plan.out_features);
  params.feature_pairs = static_cast<int>(ceil_div(plan.out_features, 2 * kFeatures));
  params.num_user_units = static_cast<int>(num_units(args.num_users, plan.out_features, tile));
  params.num_units = params.num_user_units + static_cast<int>(num_units(
                                                 args.num_candidates, plan.out_features, tile));
  params.user_k_steps = static_cast<int>(ceil_div(plan.ku, kBlockK));
  params.candidate_k_steps = static_cast<int>(ceil_div(plan.kc, kBlockK));
  params.paired_stores = plan.out_features % 2 == 0 &&
                         reinterpret_cast<std::uintptr_t>(args.out) % (2 * kElementBytes) == 0;

  IKBO_CUDA_CHECK(cudaMemsetAsync(params.users_done, 0, sizeof(int), stream));
  cudaLaunchAttribute cluster_shape{};
  const cudaLaunchConfig_t config =
      sm90::launch_config<Kernel>(std::min(params.num_units, max_clusters), stream, cluster_shape);
  check_cuda(cudaLaunchKernelEx(&config, sm90::pipeline_kernel<Kernel>, params),
             "cudaLaunchKernelEx(linear_sm90 pipeline_kernel)");
}

bool aligned_16(const void* pointer) { return reinterpret_cast<std::uintptr_t>(pointer) % 16 == 0; }

}  // namespace

bool linear_sm90_available(Device device) {
  return device.is_cuda() && device_support(device.index).available;
}

bool linear_sm90_supported(const LinearPlan::State& plan, std::int64_t num_candidates) {
  constexpr std::int64_t kInt32Max = std::numeric_limits<std::int32_t>::max();
  if (plan.weight_maps == nullptr) return false;
  if (plan.kc % 8 != 0 || plan.ku % 8 != 0 || plan.kc > kInt32Max || plan.ku > kInt32Max ||
      plan.out_features > kInt32Max) {
    return false;
  }
  // Unit indices stay within int32 (users: at most one per candidate).
  return 2 * num_units(num_candidates, plan.out_features, kTiles.front()) <= kInt32Max;
}

std::shared_ptr<const WeightTensorMaps> linear_sm90_weight_maps(const LinearPlan::State& plan) {
  if (!linear_sm90_available(plan.device)) return nullptr;
  std::shared_ptr<const WeightTensorMaps> maps;
  dispatch_float_dtype(plan.dtype, [&](auto element) {
    using Element = decltype(element);
    if constexpr (!std::is_same_v<Element, float>) {
      // w [N_out, K], rows ld elements apart, in boxes of 64 k x kFeatures
      // rows, for every tile width.
      std::vector<int> widths;
      for (const LinearSm90Tile& tile : kTiles) {
        if (std::find(widths.begin(), widths.end(), tile.features) == widths.end()) {
          widths.push_back(tile.features);
        }
      }
      maps = encode_weight_maps<Element>(plan.w_u, plan.ku, plan.ld_u, plan.w_c, plan.kc,
                                         plan.ld_c, plan.out_features, widths);
    }
  });
  return maps;
}

bool linear_sm90_eligible(const LinearArgs& args) {
  return linear_sm90_enabled() && aligned_16(args.x_c) && aligned_16(args.x_u) &&
         args.workspace != nullptr &&
         linear_sm90_supported(*args.plan, args.num_candidates);
}

std::span<const LinearSm90Tile> linear_sm90_tiles() { return kTiles; }

LinearSm90Tile linear_sm90_tile(const LinearPlan::State& plan, std::int64_t num_candidates,
                                std::int64_t num_users) {
  const int clusters = std::max(device_support(plan.device.index).clusters, 1);
  return kTiles[static_cast<std::size_t>(tile_index(plan, num_candidates, num_users, clusters))];
}

void set_linear_sm90_forced_tile(int index) {
  forced_tile().store(index >= 0 && index < static_cast<int>(kTiles.size()) ? index : -1);
}

int linear_sm90_forced_tile() { return forced_tile().load(); }

void linear_sm90(const LinearArgs& args, const LinearSm90Workspace& workspace) {
  const LinearPlan::State& plan = *args.plan;
  DeviceGuard guard(plan.device.index);
  const int clusters = device_support(plan.device.index).clusters;
  const cudaStream_t stream = to_cuda_stream(args.stream);
  const int index = tile_index(plan, args.num_candidates, args.num_users, clusters);
  dispatch_float_dtype(plan.dtype, [&](auto element) {
    using Element = decltype(element);
    if constexpr (std::is_same_v<Element, float>) {
      throw RuntimeError(
          "linear_sm90: no Hopper kernel for float32 (linear_sm90_eligible is false)");
    } else {
      with_tile(index, [&](auto rows, auto features) {
        run_linear_sm90<Element, rows, features>(args, workspace, clusters, stream);
      });
    }
  });
}

bool linear_sm90_enabled() { return sm90::enabled_switch<PathSwitch>().load(); }

void set_linear_sm90_enabled(bool enabled) { sm90::enabled_switch<PathSwitch>().store(enabled); }

}  // namespace ikbo::detail::cuda
