// src/cuda/sm90/linear_sm90.cu — linear on Hopper: the candidate GEMM on TMA
// loads and wgmma with fp32 accumulators (sm90/pipeline.cuh), the user part
// added in its epilogue.
//
//   out[b] = round(x_c[b] @ w_c^T + (P[cand_to_user[b]] + bias))
//
// P = x_u @ w_u^T [U, N_out] in fp32 is computed once per user before the
// launch (a cuBLAS GEMM of U rows, portable/linear_cublas.cu); the epilogue
// adds the row of P its candidate maps to and the bias to the fp32
// accumulators and rounds once. No candidate partial goes to memory.
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
// group j, two adjacent features of two rows; it loads P[user] (and the
// bias) for all of them first (independent read-only loads), then adds,
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
#include <string_view>
#include <type_traits>
#include <utility>

#include "cuda/check.cuh"
#include "cuda/dtype.cuh"
#include "cuda/ptx/sm80.cuh"
#include "cuda/ptx/tma.cuh"
#include "cuda/ptx/warpgroup.cuh"
#include "cuda/ptx/wgmma.cuh"
#include "cuda/runtime.cuh"
#include "cuda/sm90/device_support.cuh"
#include "cuda/sm90/pipeline.cuh"

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
  CUtensorMap candidates;  // x_c {Kc, B}, boxes {64 k, 64 rows}
  CUtensorMap weights;     // w_c {Kc, N_out}, rows ld_c apart, boxes {64 k, kFeatures rows}
  const float* user_partials;  // P [U, N_out], fp32
  const void* bias;            // [N_out] in the element type, or null
  const std::int32_t* cand_to_user;
  void* out;  // [B, N_out]
  int num_candidates, out_features;
  int feature_pairs, num_units;  // units = candidate blocks x feature block pairs
  int k_steps;
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
    Element candidates[kConsumerWarpgroups][kWarpgroupRows * kBlockK];  // [row][k] each
    Element weights[kFeatures * kBlockK];                                // [n][k]
  };
  static constexpr int kStages = kRingBytes / static_cast<int>(sizeof(Stage));
  struct SharedStorage {
    Stage stages[kStages];
  };
  static_assert(kSharedRows * kBlockK * kElementBytes % kSharedAlignment == 0 &&
                    sizeof(Stage::candidates[0]) % kSharedAlignment == 0 &&
                    sizeof(Stage::candidates) % kSharedAlignment == 0 &&
                    sizeof(Stage) % kSharedAlignment == 0,
                "every TMA box and wgmma operand must start on a 1024-byte swizzle atom");

  __device__ static int num_units(const Params& params) { return params.num_units; }
  __device__ static int num_k_steps(const Params& params, int) { return params.k_steps; }
  // Out-of-bounds parts of a box are zero-filled and still counted.
  __device__ static std::uint32_t stage_bytes(const Params&, int, int) { return sizeof(Stage); }

  __device__ static int first_row(const Params& params, int unit) {
    return unit / params.feature_pairs * kRows;
  }
  // The CTA of rank r takes feature block 2 * pair + r.
  __device__ static int first_feature(const Params& params, int unit, int rank) {
    return (unit % params.feature_pairs * kClusterSize + rank) * kFeatures;
  }

  __device__ static void load(const Params& params, int unit, int rank, int k_step, Stage& stage,
                              std::uint64_t* full) {
    const int k0 = k_step * kBlockK;
    const int row0 = first_row(params, unit) + rank * kSharedRows;
#pragma unroll
    for (int consumer = 0; consumer < kConsumerWarpgroups; ++consumer) {
      ptx::tma_load_multicast(stage.candidates[consumer] + rank * kSharedRows * kBlockK,
                              &params.candidates, k0, row0 + consumer * kWarpgroupRows, full,
                              (1u << kClusterSize) - 1);
    }
    ptx::tma_load(stage.weights, &params.weights, k0, first_feature(params, unit, rank), full);
  }

  __device__ static void compute(const Params&, int, int, const Stage& stage, int k_step,
                                 Accumulators& accumulators, int consumer) {
    // Both operands K-major: rows of 128 bytes, 8-row swizzle atoms 1024
    // bytes apart (the stride offset; the leading offset is unused).
    constexpr std::uint32_t kAtomBytes = 8 * kSwizzleRowBytes;
    const std::uint64_t a =
        ptx::wgmma_descriptor_sw128(stage.candidates[consumer], 16, kAtomBytes);
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
    if (first >= params.out_features) return;  // the padding block of an odd count
    const float* acc = accumulators.values;
    const int thread = static_cast<int>(threadIdx.x) % kWarpgroupThreads;
    const int warp = thread / 32, lane = thread % 32;
    const int row0 = first_row(params, unit) + consumer * kWarpgroupRows + 16 * warp + lane / 4;
    const int feature0 = first + 2 * (lane % 4);
    const int n = params.out_features;
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
      const float* __restrict__ partial =
          params.user_partials +
          static_cast<std::int64_t>(__ldg(params.cand_to_user + row)) * n;
      Element* out_row = out + static_cast<std::int64_t>(row) * n;
      if (params.paired_stores) {
        // N_out even: feature < N_out implies feature + 1 < N_out.
        float2 addend[kColumnGroups];
#pragma unroll
        for (int j = 0; j < kColumnGroups; ++j) {
          const int feature = feature0 + 8 * j;
          addend[j] = feature < n ? __ldg(reinterpret_cast<const float2*>(partial + feature))
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
                __ldg(partial + feature) + (e == 0 ? bias_pair[j].x : bias_pair[j].y);
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

struct DeviceSupport {
  bool available = false;
  int clusters = 0;  // clusters of every tile's kernel that fit on the GPU at once
};

DeviceSupport probe_device(int ordinal) {
  const sm90::HopperDevice device = sm90::query_device(ordinal);
  if (!device.sm90) return {};
  int clusters = std::numeric_limits<int>::max();
  for (int index = 0; index < static_cast<int>(kTiles.size()); ++index) {
    with_tile(index, [&](auto rows, auto features) {
      clusters = std::min({clusters,
                           sm90::clusters_if_ready<KernelFor<__half, rows, features>>(device),
                           sm90::clusters_if_ready<KernelFor<__nv_bfloat16, rows, features>>(device)});
    });
  }
  return {clusters > 0, clusters};
}

DeviceSupport device_support(int ordinal) {
  return sm90::probed_once<DeviceSupport, probe_device>(ordinal);
}

std::atomic<bool>& enabled_switch() {
  static std::atomic<bool> enabled{sm90::sm90_enabled_by_environment()};
  return enabled;
}

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

std::int64_t num_units(std::int64_t num_candidates, std::int64_t out_features,
                       const LinearSm90Tile& tile) {
  return ceil_div(num_candidates, tile.rows) * ceil_div(out_features, 2 * tile.features);
}

// The tile that minimizes (rounds of clusters over the GPU) x (operand bytes
// one CTA streams per k-step, proportional to rows + features); ties go to
// the smaller tile.
int tile_index(std::int64_t num_candidates, std::int64_t out_features, int clusters) {
  if (const int forced = forced_tile().load(); forced >= 0) return forced;
  int best = 0;
  std::int64_t best_cost = std::numeric_limits<std::int64_t>::max();
  for (int index = 0; index < static_cast<int>(kTiles.size()); ++index) {
    const LinearSm90Tile tile = kTiles[static_cast<std::size_t>(index)];
    const std::int64_t cost = ceil_div(num_units(num_candidates, out_features, tile), clusters) *
                              (tile.rows + tile.features);
    if (cost < best_cost) {
      best = index;
      best_cost = cost;
    }
  }
  return best;
}

template <typename Element>
constexpr CUtensorMapDataType kTensorMapType =
    std::is_same_v<Element, __half> ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16
                                    : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;

// A row-major [rows, k] matrix, rows `ld` elements apart, in boxes of 64 k x
// box_rows rows.
template <typename Element>
CUtensorMap k_major_map(const void* base, std::int64_t k, std::int64_t ld, std::int64_t rows,
                        int box_rows) {
  ptx::TensorMapLayout layout;
  layout.rank = 2;
  layout.dims[0] = static_cast<cuuint64_t>(k);
  layout.dims[1] = static_cast<cuuint64_t>(rows);
  layout.strides_bytes[0] = static_cast<cuuint64_t>(ld * kElementBytes);
  layout.box[0] = kBlockK;
  layout.box[1] = static_cast<cuuint32_t>(box_rows);
  return ptx::make_tensor_map(kTensorMapType<Element>, base, layout, CU_TENSOR_MAP_SWIZZLE_128B);
}

template <typename Element, int kRows, int kFeatures>
void run_linear_sm90(const LinearArgs& args, const float* user_partials, int max_clusters,
                     cudaStream_t stream) {
  using Kernel = KernelFor<Element, kRows, kFeatures>;
  const LinearPlan::State& plan = *args.plan;
  LinearSm90Params params{};
  params.candidates = k_major_map<Element>(args.x_c, plan.kc, plan.kc, args.num_candidates,
                                           Kernel::kSharedRows);
  params.weights = k_major_map<Element>(plan.w_c, plan.kc, plan.ld_c, plan.out_features, kFeatures);
  params.user_partials = user_partials;
  params.bias = plan.bias;
  params.cand_to_user = args.map->device_view.cand_to_user;
  params.out = args.out;
  params.num_candidates = static_cast<int>(args.num_candidates);
  params.out_features = static_cast<int>(plan.out_features);
  params.feature_pairs = static_cast<int>(ceil_div(plan.out_features, 2 * kFeatures));
  params.num_units = static_cast<int>(
      num_units(args.num_candidates, plan.out_features, {kRows, kFeatures}));
  params.k_steps = static_cast<int>(ceil_div(plan.kc, kBlockK));
  params.paired_stores = plan.out_features % 2 == 0 &&
                         reinterpret_cast<std::uintptr_t>(args.out) % (2 * kElementBytes) == 0;

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
  if (plan.dtype != DType::f16 && plan.dtype != DType::bf16) return false;
  if (plan.kc % 8 != 0 || plan.kc > kInt32Max || plan.out_features > kInt32Max) return false;
  // Unit indices (candidate blocks x feature block pairs) stay within int32.
  if (num_units(num_candidates, plan.out_features, kTiles.front()) > kInt32Max) {
    return false;
  }
  return linear_sm90_available(plan.device);
}

bool linear_sm90_eligible(const LinearArgs& args) {
  return linear_sm90_enabled() && aligned_16(args.x_c) && args.workspace != nullptr &&
         linear_sm90_supported(*args.plan, args.num_candidates);
}

std::span<const LinearSm90Tile> linear_sm90_tiles() { return kTiles; }

LinearSm90Tile linear_sm90_tile(const LinearPlan::State& plan, std::int64_t num_candidates) {
  const int clusters = std::max(device_support(plan.device.index).clusters, 1);
  return kTiles[static_cast<std::size_t>(tile_index(num_candidates, plan.out_features, clusters))];
}

void set_linear_sm90_forced_tile(int index) {
  forced_tile().store(index >= 0 && index < static_cast<int>(kTiles.size()) ? index : -1);
}

void linear_sm90(const LinearArgs& args, const float* user_partials) {
  const LinearPlan::State& plan = *args.plan;
  DeviceGuard guard(plan.device.index);
  const int clusters = device_support(plan.device.index).clusters;
  const cudaStream_t stream = to_cuda_stream(args.stream);
  const int index = tile_index(args.num_candidates, plan.out_features, clusters);
  dispatch_float_dtype(plan.dtype, [&](auto element) {
    using Element = decltype(element);
    if constexpr (std::is_same_v<Element, float>) {
      throw RuntimeError("linear_sm90: no Hopper kernel for float32 (linear_sm90_eligible is false)");
    } else {
      with_tile(index, [&](auto rows, auto features) {
        run_linear_sm90<Element, rows, features>(args, user_partials, clusters, stream);
      });
    }
  });
}

bool linear_sm90_enabled() { return enabled_switch().load(); }

void set_linear_sm90_enabled(bool enabled) { enabled_switch().store(enabled); }

}  // namespace ikbo::detail::cuda
