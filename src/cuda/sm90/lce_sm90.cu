// src/cuda/sm90/lce_sm90.cu — LCE on Hopper: TMA loads, wgmma with fp32
// accumulators on the warp-specialized pipeline (sm90/pipeline.cuh), and
// the gathered user partial as the candidate GEMM's starting accumulators.
//
//   out[b] = w_c @ e_c[b] + w_u @ e_u[cand_to_user[b]]
//
// One persistent launch on the caller's stream runs two kinds of work units:
//   user units       P[u] = w_u @ e_u[u] in fp32 into the workspace, one
//                    tile at a time, each tile flagged ready when stored;
//   candidate units  out[b] = round(P[cand_to_user[b]] + w_c @ e_c[b]): the
//                    producer waits for the flag of the P tile it needs and
//                    streams the tile through the stage ring after the
//                    unit's operands; the consumers add it to their
//                    accumulators once the main loop has retired, and the
//                    epilogue rounds once; no candidate partial ever goes
//                    to memory.
// User units come first in the walk, so they are the first units of their
// clusters and never wait for a candidate unit: every flag is set while the
// candidate units' main loops run, and the user GEMM costs no launch or
// pipeline drain. When every user tile fits in the first round twice over,
// each tile's k-steps are split between two neighbouring user units (each
// adds its sum into P with a bulk reduction), so that P is ready before the
// first round's candidate units finish their shorter main loops
// (user_splits). Such a tile is cleared in the launch, by the spare warp of
// the CTA that runs its first part, as that CTA starts. (A flag counter per
// P tile, zeroed by a memset before the launch, counts the clearing and
// each part's store.)
//
// Orientation. Each GEMM runs transposed, out[b]^T = e[b]^T @ w^T: wgmma's
// M side (64 rows per warpgroup) walks N, its N side walks the M rows of
// out. wgmma's N may be any multiple of 8 up to 256, so M = 433 takes two
// blocks of 224 rows (3% padding) instead of four of 128 (18%).
//
// Tile = (batch item b, 128 columns of N, 224 rows of M); per k-step of 64:
//   A = e[b][k0:k0+64, n0:n0+128], two TMA boxes {64 n, 64 k} (one per
//       consumer warpgroup) read in place through a 3-D map {N, K, batch}
//       (or both in one copy through a 4-D map when N is a multiple of
//       128: paired_map): MN-major (n contiguous), 128-byte swizzle. Rows
//       k >= K of item b arrive as zeros: a K tail never reads item b+1
//       (0 x Inf is NaN) nor past the end of the tensor.
//   B = w[m0:m0+224, k0:k0+64] from the plan's padded copy: K-major,
//       128-byte swizzle; rows m >= M arrive as zeros.
// Each consumer warpgroup accumulates 64 n x 224 m, 112 fp32 registers per
// thread.
//
// Clusters of two. Operand traffic from L2 bounds this GEMM (measured on
// H100: L2 at 74% of peak, tensor cores 45% busy, with one CTA per tile).
// The two CTAs of a cluster always need the same weight tile: each loads
// half of it (a {64 k, 112 m} box) and multicasts it into both CTAs, which
// cuts the L2 reads per tile by a third. In a user unit they take
// neighbouring N blocks of the same (u, M block); N blocks are padded to an
// even count there, and a block past N computes zeros and stores nothing.
// In a candidate unit they take the same (N block, M block) of two
// neighbouring candidates of the map's by-user order. When the two
// candidates have the same user (all pairs but those that straddle two
// users), they need the same P tile too, and each CTA copies half of every
// P step image into both (a bulk multicast). An odd B leaves the last
// unit's second CTA without a candidate: it runs the first one's tile,
// whose weight halves and P halves its partner needs, and stores nothing.
// (H100, session 29: B = 512 0.1957 against 0.1978 ms for a walk of N
// block pairs of one candidate, the reference shape 0.3757 against 0.3793.)
//
// The user partial P. A user unit stores P exactly as it sits in the
// accumulators ("fragment order": per tile, three step images of 11, 11
// and 6 register quads, each [consumer warpgroup][quad][thread][4]). A
// candidate unit's last three k-steps are "register steps" (pipeline.cuh):
// bulk copies of its P tile's step images (115 KB, one 44 KB stage each),
// which the consumers add to their accumulators, conflict-free.
// Loading P this way, during the unit's main loop and through the copy
// engine, instead of reading it in the epilogue from L2 with the tensor
// cores idle, took the reference shape from 0.411 to 0.390 ms on H100 (an
// ablation without any P read ran 0.363 ms). P comes last rather than
// first so that a candidate unit's main loop never waits for its user
// tile: at the start of a launch the user tiles are still being computed.
//
// Epilogues through held stages (pipeline.cuh): a unit keeps the stages of
// its last k-steps and stages its stores there, and the pipeline's storer
// (one producer thread) writes them out while the consumers go on with
// the next unit. A candidate unit rounds its tile and transposes it with
// stmatrix.trans into the stages of its last two P steps (per consumer
// warpgroup 224 rows of M with 64 N contiguous, 128-byte swizzled: free of
// bank conflicts), which the storer writes with one TMA store each (the M
// and N tails clipped). A user unit writes its P step images into the
// stages of its last three k-steps; the storer copies them out with bulk
// stores, waits until they are written, and sets the tile's flag. So the
// tensor cores idle only while the consumers write shared memory (H100,
// session 9: reference shape 0.3700-0.3705 vs 0.3755-0.3757 ms with the
// stores issued by the consumers from 24 KB of rotating staging buffers
// and P stored with st.global; the freed buffers make a fifth stage).
//
// Schedule: a persistent grid of co-resident clusters walks the units in
// the order (user units: u, N-block pair, M block; then candidate units:
// candidate pair of the by-user order, N block, M block): the M blocks that
// share columns of e[b] run side by side, so those columns come from DRAM
// once and from L2 after, and one user's candidates run close together, so
// its P tiles are read from L2.
#include "cuda/sm90/lce_sm90.hpp"

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <type_traits>

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

constexpr int kBlockN = 128;          // columns of out per tile
constexpr int kWarpgroupBlockN = 64;  // of which each consumer warpgroup takes one wgmma M
constexpr int kBlockM = 224;          // rows of out per tile (wgmma N)
constexpr int kBlockK = 64;           // one 128-byte swizzle row of 16-bit elements
constexpr int kWgmmaK = 16;
constexpr std::int64_t kTileElements = std::int64_t{kBlockN} * kBlockM;
constexpr int kSwizzleRowBytes = 128;
constexpr int kElementBytes = 2;

constexpr int kClusterSize = 2;          // CTAs sharing one weight tile
constexpr int kWeightRowsPerCta = kBlockM / kClusterSize;  // rows of a weight box

struct LceSm90Params {
  // {N, K, batch}, boxes {64 n, 64 k, 1}; or paired_map's (paired_boxes)
  CUtensorMap user_activations, candidate_activations;
  // {K, M}, boxes {64 k, 112 m}: each CTA of a cluster loads one half
  CUtensorMap user_weights, candidate_weights;
  CUtensorMap out;  // {N, M, B}, boxes {64 n, 224 m, 1}
  float* user_partials;  // [U][N block][M block][fragment order]
  int* user_ready;       // [U][N block][M block]: ready_count once the tile is stored
  const std::int32_t* cand_to_user;
  const std::int32_t* candidates_by_user;
  int num_candidates;
  int candidate_n_blocks;  // N blocks of the candidate units (not padded)
  int m, n;
  int user_k_steps, candidate_k_steps;
  int n_blocks, m_blocks;  // n_blocks even
  int user_splits;         // user units per tile (its k-steps split between them)
  int num_user_units;      // user tiles x user_splits
  bool paired_boxes;  // activation maps are paired_map's (N a multiple of kBlockN)
  // This launch walks units [first_unit, first_unit + num_units) of the
  // whole walk (user units, then candidate units).
  int first_unit, num_units;
};

template <typename Element>
struct LceSm90Kernel {
  static constexpr int kConsumerWarpgroups = kBlockN / kWarpgroupBlockN;
  static constexpr int kStages = 5;
  static constexpr int kClusterSize = ::ikbo::detail::cuda::kClusterSize;
  // 128 x 40 + 256 x 232 <= 64K registers of the SM.
  static constexpr int kProducerRegisters = 40;
  static constexpr int kConsumerRegisters = 232;
  static constexpr int kAccumulators = kWarpgroupBlockN * kBlockM / kWarpgroupThreads;
  static constexpr int kConsumerThreads = kConsumerWarpgroups * kWarpgroupThreads;

  using Params = LceSm90Params;
  struct Accumulators {
    float values[kAccumulators];
  };
  struct Stage {
    Element activations[kConsumerWarpgroups][kBlockK * kWarpgroupBlockN];  // [k][n] each
    Element weights[kBlockM * kBlockK];                                      // [m][k]
  };
  // The epilogues stage their stores in held ring stages (pipeline.cuh).
  struct SharedStorage {
    Stage stages[kStages];
  };
  // Both CTAs' weight halves land in each CTA's stage.
  static constexpr std::uint32_t kStageBytes = sizeof(Stage);
  static_assert(sizeof(Stage::activations[0]) % kSharedAlignment == 0 &&
                    sizeof(Stage::activations) % kSharedAlignment == 0 &&
                    sizeof(Stage) % kSharedAlignment == 0 &&
                    kWeightRowsPerCta * kBlockK * sizeof(Element) % kSharedAlignment == 0,
                "every TMA box and wgmma operand must start on a 1024-byte swizzle atom");
  static_assert(kBlockM * kWarpgroupBlockN * sizeof(Element) <= sizeof(Stage),
                "a consumer warpgroup's output tile is staged in one stage");
  static_assert(kBlockM % 16 == 0, "the output is staged in whole stmatrix.x4 row pairs");

  // A candidate unit ends with kPartialSteps steps that bring the fp32
  // user partial of its tile, in fragment order, through the ring: each
  // consumer thread adds it to its accumulators once the main loop has
  // retired, so the epilogue only rounds and stores. A step
  // carries whole register quads (kQuadBytes: one float4 per consumer
  // thread); the last one fewer.
  static constexpr int kQuads = kAccumulators / 4;
  static constexpr int kQuadBytes = kConsumerThreads * static_cast<int>(sizeof(float4));
  static constexpr int kQuadsPerPartialStep = static_cast<int>(sizeof(Stage)) / kQuadBytes;
  static constexpr int kPartialSteps = (kQuads + kQuadsPerPartialStep - 1) / kQuadsPerPartialStep;

  // Held stages (pipeline.cuh): a user unit stages P for its bulk stores in
  // the stages of its last kPartialSteps k-steps, one step image each; a
  // candidate unit its output in those of its last two P steps, one
  // consumer warpgroup's tile each. The storer thread writes them out
  // while the next unit runs.
  static constexpr int kMaxHeldStages = kPartialSteps;
  static_assert(kConsumerWarpgroups <= kPartialSteps, "a candidate unit holds P step stages");

  // Where a consumer thread keeps quad `quad` of its tile in that quad's
  // step image ([consumer warpgroup][quad of the step][thread], float4
  // units): a warp reads or writes 512 contiguous bytes per quad, free of
  // bank conflicts.
  __device__ static int image_offset(int quad, int consumer, int thread) {
    const int step = quad / kQuadsPerPartialStep;
    return (consumer * partial_step_quads(step) + quad % kQuadsPerPartialStep) *
               kWarpgroupThreads +
           thread;
  }

  struct Tile {
    bool user;  // a user unit (P tile) or a candidate unit (out tile)
    bool idle;  // a candidate unit's CTA without a candidate (odd B): stores nothing
    bool shared_partial;  // both CTAs' candidates have the same user: P is multicast
    int batch, n_block, m_block;
    int part;             // a user unit's part of its P tile's k-steps
    std::int64_t partial_tile;  // index of its P tile
  };

  __device__ static bool is_user_unit(const Params& params, int launch_unit) {
    return params.first_unit + launch_unit < params.num_user_units;
  }

  // Unit -> tile: user units first, each walking (user, N block pair, M
  // block), the CTA of rank r taking the pair's N block 2 * pair + r (a P
  // tile's user_splits parts are neighbouring units, so they run side by
  // side); then candidate units, each walking (candidate pair, N block, M
  // block), the CTA of rank r taking candidate 2 * pair + r of the map's
  // by-user order. The two CTAs of a candidate unit need the same weight
  // tile, and the same P tile when their candidates have the same user.
  // Without `with_candidates` the candidate and its user are not looked up
  // (batch and partial_tile are left unset).
  __device__ static Tile tile_at(const Params& params, int launch_unit, int rank,
                                 bool with_candidates = true) {
    Tile tile;
    tile.user = is_user_unit(params, launch_unit);
    tile.idle = false;
    tile.shared_partial = false;
    const int unit = params.first_unit + launch_unit;
    tile.part = tile.user ? unit % params.user_splits : 0;
    int user = 0;
    if (tile.user) {
      const int index = unit / params.user_splits;
      const int units_per_user = params.n_blocks / kClusterSize * params.m_blocks;
      const int within_user = index % units_per_user;
      tile.batch = index / units_per_user;
      tile.n_block = within_user / params.m_blocks * kClusterSize + rank;
      tile.m_block = within_user % params.m_blocks;
      user = tile.batch;
    } else {
      const int index = unit - params.num_user_units;
      const int units_per_pair = params.candidate_n_blocks * params.m_blocks;
      const int within_pair = index % units_per_pair;
      const int first = index / units_per_pair * kClusterSize;
      tile.n_block = within_pair / params.m_blocks;
      tile.m_block = within_pair % params.m_blocks;
      tile.idle = first + rank >= params.num_candidates;
      if (!with_candidates) return tile;
      // This CTA's candidate and its partner's (the same one without a
      // partner): their users differ only where the pair straddles two.
      static_assert(kClusterSize == 2, "candidate units pair two candidates");
      const int mine = tile.idle ? first : first + rank;
      const int other = rank == 0 ? min(first + 1, params.num_candidates - 1) : first;
      tile.batch = params.candidates_by_user[mine];
      user = params.cand_to_user[tile.batch];
      tile.shared_partial = params.cand_to_user[params.candidates_by_user[other]] == user;
    }
    tile.partial_tile =
        (static_cast<std::int64_t>(user) * params.n_blocks + tile.n_block) * params.m_blocks +
        tile.m_block;
    return tile;
  }

  // The producer decodes each unit once (the pipeline's describe hook), not
  // at every k-step: its stage release to load issue is on the main loop's
  // critical path.
  __device__ static Tile describe(const Params& params, int unit) {
    return tile_at(params, unit, static_cast<int>(ptx::cluster_rank()));
  }

  __device__ static int num_units(const Params& params) { return params.num_units; }
  // Part p of a P tile takes its k-steps [first_k_step(p), first_k_step(p + 1)).
  __device__ static int first_k_step(const Params& params, int part) {
    return part * params.user_k_steps / params.user_splits;
  }
  __device__ static int user_k_steps_of(const Params& params, int part) {
    return first_k_step(params, part + 1) - first_k_step(params, part);
  }
  __device__ static int k_steps_of(const Params& params, bool user, int part) {
    return user ? user_k_steps_of(params, part) : kPartialSteps + params.candidate_k_steps;
  }
  // The consumers' (by unit index) and the producer's (by Tile).
  __device__ static int num_k_steps(const Params& params, int unit) {
    return k_steps_of(params, is_user_unit(params, unit),
                      (params.first_unit + unit) % params.user_splits);
  }
  __device__ static int num_k_steps(const Params& params, const Tile& tile) {
    return k_steps_of(params, tile.user, tile.part);
  }
  __device__ static int partial_step_quads(int k_step) {
    return k_step + 1 < kPartialSteps ? kQuadsPerPartialStep
                                      : kQuads - (kPartialSteps - 1) * kQuadsPerPartialStep;
  }
  // The partial step that k-step `k_step` of a candidate unit is, or -1.
  __device__ static int partial_step(const Params& params, int k_step) {
    return k_step >= params.candidate_k_steps ? k_step - params.candidate_k_steps : -1;
  }
  __device__ static std::uint32_t partial_step_bytes(int step) {
    return static_cast<std::uint32_t>(partial_step_quads(step) * kQuadBytes);
  }
  __device__ static std::uint32_t stage_bytes(const Params& params, const Tile& tile,
                                              int k_step) {
    const int step = tile.user ? -1 : partial_step(params, k_step);
    return step >= 0 ? partial_step_bytes(step) : kStageBytes;
  }
  // What a P tile's flag counts once the tile is ready: its parts' stores,
  // and its clearing when it is split (spare_warp).
  __device__ static int ready_count(const Params& params) {
    return params.user_splits == 1 ? 1 : params.user_splits + 1;
  }
  // Step image `step` of the tile's P in the workspace.
  __device__ static float* partial_image(const Params& params, const Tile& tile, int step) {
    return params.user_partials + tile.partial_tile * kTileElements +
           step * kQuadsPerPartialStep * kQuadBytes / sizeof(float);
  }

  __device__ static void load(const Params& params, const Tile& tile, int rank, int k_step,
                              Stage& stage, std::uint64_t* full) {
    if (const int step = tile.user ? -1 : partial_step(params, k_step); step >= 0) {
      if (step == 0) {
        // Written by a user unit's storer with bulk copies and flagged with
        // an ordinary atomic; read here by TMA (see ptx::fence_async_global).
        ptx::wait_ready(params.user_ready + tile.partial_tile, ready_count(params));
        ptx::fence_async_global();
      }
      const float* image = partial_image(params, tile, step);
      const std::uint32_t bytes = partial_step_bytes(step);
      if (tile.shared_partial) {
        // Each CTA copies its half of the step image into both.
        const std::uint32_t half = bytes / kClusterSize;
        ptx::bulk_load_multicast(reinterpret_cast<char*>(&stage) + rank * half,
                                 image + rank * half / sizeof(float), half, full,
                                 (1u << kClusterSize) - 1);
      } else {
        ptx::bulk_load(&stage, image, bytes, full);
      }
      return;
    }
    const CUtensorMap* activations =
        tile.user ? &params.user_activations : &params.candidate_activations;
    const CUtensorMap* weights = tile.user ? &params.user_weights : &params.candidate_weights;
    const int k0 = (tile.user ? first_k_step(params, tile.part) + k_step : k_step) * kBlockK;
    if (params.paired_boxes) {
      // Both consumers' boxes in one copy (it lands as activations[0], [1]).
      ptx::tma_load(stage.activations[0], activations, 0, k0,
                    tile.n_block * kConsumerWarpgroups, tile.batch, full);
    } else {
#pragma unroll
      for (int consumer = 0; consumer < kConsumerWarpgroups; ++consumer) {
        ptx::tma_load(stage.activations[consumer], activations,
                      tile.n_block * kBlockN + consumer * kWarpgroupBlockN, k0, tile.batch, full);
      }
    }
    const int first_row = rank * kWeightRowsPerCta;
    ptx::tma_load_multicast(stage.weights + first_row * kBlockK, weights, k0,
                            tile.m_block * kBlockM + first_row, full,
                            (1u << kClusterSize) - 1);
  }

  static constexpr int kMaxRegisterSteps = kPartialSteps;
  __device__ static int num_register_steps(const Params& params, int unit) {
    return is_user_unit(params, unit) ? 0 : kPartialSteps;
  }

  __device__ static int held_stages_of(bool user) {
    return user ? kPartialSteps : kConsumerWarpgroups;
  }
  __device__ static int num_held_stages(const Params& params, int unit) {
    return held_stages_of(is_user_unit(params, unit));
  }
  __device__ static int num_held_stages(const Params&, const Tile& tile) {
    return held_stages_of(tile.user);
  }

  // A step of the user partial: this thread's quads of it added to the
  // accumulators.
  __device__ static void load_registers(const Params&, int, int, const Stage& stage, int step,
                                        Accumulators& accumulators, int consumer) {
    float* acc = accumulators.values;
    const int thread = static_cast<int>(threadIdx.x) % kWarpgroupThreads;
    const auto* image = reinterpret_cast<const float4*>(&stage);
#pragma unroll
    for (int quad = 0; quad < kQuads; ++quad) {
      if (quad / kQuadsPerPartialStep == step) {
        const float4 value = image[image_offset(quad, consumer, thread)];
        acc[4 * quad] += value.x;
        acc[4 * quad + 1] += value.y;
        acc[4 * quad + 2] += value.z;
        acc[4 * quad + 3] += value.w;
      }
    }
  }

  __device__ static void compute(const Params&, int, int, const Stage& stage, int k_step,
                                 Accumulators& accumulators, int consumer) {
    const bool first = k_step == 0;  // starts the accumulators from zero
    // A (e^T, MN-major) spans a single 64-wide group along n, so only the
    // stride offset (8 k-rows, 1024 bytes) is used; the leading offset gets
    // the same value. B (w, K-major) steps 1024 bytes per 8 rows of m.
    constexpr std::uint32_t kAtomBytes = 8 * kSwizzleRowBytes;
    const std::uint64_t a =
        ptx::wgmma_descriptor_sw128(stage.activations[consumer], kAtomBytes, kAtomBytes);
    const std::uint64_t b = ptx::wgmma_descriptor_sw128(stage.weights, 16, kAtomBytes);
    ptx::fence_operands(accumulators.values);
    ptx::wgmma_fence();
#pragma unroll
    for (int slice = 0; slice < kBlockK / kWgmmaK; ++slice) {
      ptx::wgmma_m64n224k16<Element, 1, 0>(
          accumulators.values, ptx::advance_descriptor(a, slice * kWgmmaK * kSwizzleRowBytes),
          ptx::advance_descriptor(b, slice * kWgmmaK * kElementBytes), !first || slice > 0);
    }
    ptx::wgmma_commit_group();
    ptx::fence_operands(accumulators.values);
  }

  // Split P tiles: the CTA that runs a tile's first part clears it as it
  // starts (the parts' storers add into it once it is) and counts that on
  // the tile's flag. User units come first in the walk.
  __device__ static void spare_warp(const Params& params, const sm90::UnitWalk& walk, int rank,
                                    int lane) {
    if (params.user_splits == 1) return;
    for (int unit = walk.first; unit < walk.count && is_user_unit(params, unit);
         unit += walk.step) {
      const Tile tile = tile_at(params, unit, rank);
      if (tile.part != 0) continue;
      auto* image = reinterpret_cast<float4*>(params.user_partials +
                                              tile.partial_tile * kTileElements);
      for (int i = lane; i < kTileElements / 4; i += 32) {
        image[i] = make_float4(0.f, 0.f, 0.f, 0.f);
      }
      __syncwarp();  // orders the lanes' stores before lane 0's fence
      if (lane == 0) ptx::signal_ready(params.user_ready + tile.partial_tile);
    }
  }

  using Held = sm90::HeldStages<LceSm90Kernel>;

  // The epilogue, into the held stages (the storer writes them out).
  __device__ static void finish(const Params& params, int unit, int rank,
                                Accumulators& accumulators, SharedStorage&, int consumer,
                                const Held& held) {
    float* acc = accumulators.values;
    ptx::fence_operands(accumulators.values);
    const Tile tile = tile_at(params, unit, rank, /*with_candidates=*/false);
    const int thread = static_cast<int>(threadIdx.x) % kWarpgroupThreads;

    if (tile.user) {
#pragma unroll
      for (int quad = 0; quad < kQuads; ++quad) {
        auto* image = reinterpret_cast<float4*>(&held[quad / kQuadsPerPartialStep]);
        image[image_offset(quad, consumer, thread)] =
            make_float4(acc[4 * quad], acc[4 * quad + 1], acc[4 * quad + 2], acc[4 * quad + 3]);
      }
      return;
    }

    // A CTA without a candidate (odd B) and a warpgroup's columns past N store nothing.
    if (tile.idle || tile.n_block * kBlockN + consumer * kWarpgroupBlockN >= params.n) return;
    // Round, and stage this warpgroup's 64 n x 224 m as rows of M with N
    // contiguous (128 bytes, 128-byte swizzled: the 16-byte chunk c of row
    // m at c ^ (m % 8), as the TMA store expects, and free of bank
    // conflicts). stmatrix.x4 over register quads j and j+1 stores four 8x8
    // blocks, (n rows g, g+8 of this warp) x (m columns of quads j, j+1),
    // transposed; lane l addresses row l % 8 of block l / 8.
    const int warp = thread / 32, lane = thread % 32;
    const int block = lane / 8, block_row = lane % 8;
    const int n_chunk = 2 * warp + block % 2;
    const std::uint32_t staging_address = ptx::shared_address(&held[consumer]) +
                                          block_row * kSwizzleRowBytes +
                                          ((n_chunk ^ block_row) << 4);
#pragma unroll
    for (int quad = 0; quad < kQuads; quad += 2) {
      const int m_row = 8 * (quad + block / 2);  // first staged row of this lane's block
      ptx::stmatrix_x4_trans(staging_address + m_row * kSwizzleRowBytes,
                             ptx::pack_pair<Element>(acc[4 * quad], acc[4 * quad + 1]),
                             ptx::pack_pair<Element>(acc[4 * quad + 2], acc[4 * quad + 3]),
                             ptx::pack_pair<Element>(acc[4 * quad + 4], acc[4 * quad + 5]),
                             ptx::pack_pair<Element>(acc[4 * quad + 6], acc[4 * quad + 7]));
    }
  }

  // The storer (one producer thread): what finish staged, out of the held
  // stages, each stage released once its copy has read it.
  __device__ static void store_held(const Params& params, const Tile& tile, int,
                                    const Held& held) {
    if (tile.user) {
      // P, one bulk copy per step image; flagged once it is written. A
      // split tile's two parts each add their sum to P, cleared by
      // spare_warp, as soon as they have it: two addends into zero give the
      // same bits in either order.
      int* ready = params.user_ready + tile.partial_tile;
      if (params.user_splits > 1) {
        ptx::wait_ready(ready, 1);  // cleared (spare_warp)
        ptx::fence_async_global();  // by generic stores; added to here by bulk reductions
      }
#pragma unroll
      for (int step = 0; step < kPartialSteps; ++step) {
        float* destination = partial_image(params, tile, step);
        const auto* source = reinterpret_cast<const float*>(&held[step]);
        if (params.user_splits == 1) {
          ptx::bulk_store(destination, source, partial_step_bytes(step));
        } else {
          ptx::bulk_reduce_add(destination, source, partial_step_bytes(step));
        }
        ptx::bulk_commit_group();
      }
      held.template release_as_read<kPartialSteps>();
      ptx::bulk_wait_group<0>();
      ptx::fence_async_global();  // the candidate units read P with TMA after the flag
      ptx::signal_ready(ready);
      return;
    }
    // The output: one TMA store per consumer warpgroup (rows past M and
    // columns past N clipped).
#pragma unroll
    for (int consumer = 0; consumer < kConsumerWarpgroups; ++consumer) {
      const int n0 = tile.n_block * kBlockN + consumer * kWarpgroupBlockN;
      if (!tile.idle && n0 < params.n) {
        ptx::tma_store(&params.out, n0, tile.m_block * kBlockM, tile.batch, &held[consumer]);
      }
      ptx::bulk_commit_group();
    }
    held.template release_as_read<kConsumerWarpgroups>();
  }
};

// ---- device support, probed once per device ----

using DeviceSupport = sm90::ClusterSupport;

DeviceSupport probe_device(int ordinal) {
  const sm90::HopperDevice device = sm90::query_device(ordinal);
  if (!device.sm90) return {};
  const int clusters = std::min(sm90::clusters_if_ready<LceSm90Kernel<__half>>(device),
                                sm90::clusters_if_ready<LceSm90Kernel<__nv_bfloat16>>(device));
  return {clusters > 0, clusters};
}

DeviceSupport device_support(int ordinal) {
  return sm90::probed_once<DeviceSupport, probe_device>(ordinal);
}

struct PathSwitch;  // tags this path's sm90::enabled_switch

// ---- launch ----

// User units take N blocks in cluster pairs (n_blocks, padded to whole
// clusters); candidate units take every N block of a pair of candidates.
struct TileGrid {
  std::int64_t n_blocks = 0, candidate_n_blocks = 0, m_blocks = 0;
  std::int64_t partial_tiles_per_user() const { return n_blocks * m_blocks; }
  std::int64_t units_per_user() const { return n_blocks / kClusterSize * m_blocks; }
  std::int64_t candidate_units(std::int64_t num_candidates) const {
    return (num_candidates + kClusterSize - 1) / kClusterSize * candidate_n_blocks * m_blocks;
  }
};

TileGrid tile_grid(std::int64_t m, std::int64_t n) {
  const std::int64_t n_blocks = (n + kBlockN - 1) / kBlockN;
  return {(n_blocks + kClusterSize - 1) / kClusterSize * kClusterSize, n_blocks,
          (m + kBlockM - 1) / kBlockM};
}

// Workspace: P tiles, then their ready counters.
struct WorkspaceLayout {
  std::size_t partial_bytes = 0, ready_bytes = 0;
};

WorkspaceLayout workspace_layout(const TileGrid& grid, std::int64_t num_users) {
  const auto tiles = static_cast<std::size_t>(num_users * grid.partial_tiles_per_user());
  return {tiles * static_cast<std::size_t>(kTileElements) * sizeof(float), tiles * sizeof(int)};
}

// A dense [batch, rows, N] tensor (e: rows = K; out: rows = M) in boxes of
// 64 n x box_rows rows of one batch item.
template <typename Element>
CUtensorMap batched_map(const void* base, std::int64_t n, std::int64_t rows, std::int64_t batch,
                        int box_rows) {
  ptx::TensorMapLayout layout;
  layout.rank = 3;
  layout.dims[0] = static_cast<cuuint64_t>(n);
  layout.dims[1] = static_cast<cuuint64_t>(rows);
  layout.dims[2] = static_cast<cuuint64_t>(batch);
  layout.strides_bytes[0] = static_cast<cuuint64_t>(n * kElementBytes);
  layout.strides_bytes[1] = static_cast<cuuint64_t>(rows * n * kElementBytes);
  layout.box[0] = kWarpgroupBlockN;
  layout.box[1] = static_cast<cuuint32_t>(box_rows);
  layout.box[2] = 1;
  return ptx::make_tensor_map(ptx::kTensorMapType<Element>, base, layout,
                              CU_TENSOR_MAP_SWIZZLE_128B);
}

// The same [batch, rows, N] tensor (N a multiple of kBlockN) seen as
// {64 n, rows, N / 64 column groups, batch}, the column groups 128 bytes
// apart, in boxes {64 n, 64 rows, 2 groups, 1}: a tile's two consumer
// boxes in one TMA copy, landing one after the other as batched_map's two
// boxes would. Measured on H100 (session 7, same binary): 0.3–0.7% faster
// than two copies at every bench shape, a request fewer per k-step.
template <typename Element>
CUtensorMap paired_map(const void* base, std::int64_t n, std::int64_t rows, std::int64_t batch) {
  static_assert(kBlockN == 2 * kWarpgroupBlockN, "a box pair is one tile's columns");
  ptx::TensorMapLayout layout;
  layout.rank = 4;
  layout.dims[0] = kWarpgroupBlockN;
  layout.dims[1] = static_cast<cuuint64_t>(rows);
  layout.dims[2] = static_cast<cuuint64_t>(n / kWarpgroupBlockN);
  layout.dims[3] = static_cast<cuuint64_t>(batch);
  layout.strides_bytes[0] = static_cast<cuuint64_t>(n * kElementBytes);
  layout.strides_bytes[1] = kWarpgroupBlockN * kElementBytes;
  layout.strides_bytes[2] = static_cast<cuuint64_t>(rows * n * kElementBytes);
  layout.box[0] = kWarpgroupBlockN;
  layout.box[1] = kBlockK;
  layout.box[2] = kBlockN / kWarpgroupBlockN;
  layout.box[3] = 1;
  return ptx::make_tensor_map(ptx::kTensorMapType<Element>, base, layout,
                              CU_TENSOR_MAP_SWIZZLE_128B);
}

// User units per tile (a cluster's pair of P tiles). A candidate unit needs
// its P tile only after its main loop (Kc k-steps), while a whole user unit
// takes Ku, and Ku > Kc is the common case (the reference shape: 19 against
// 14). So when every P tile starts in the first round of clusters, the
// first round's candidate units would wait for the rest of a user unit.
// Two halves of Ku each end sooner, and cost P cleared in the launch and
// added to twice. Each part must hold a user unit's kPartialSteps held
// stages. No more than two: a third addend would make P's bits depend on
// the order in which the parts add.
constexpr int kSplits = 2;

template <typename Kernel>
int user_splits(int num_user_tiles, int user_k_steps, int max_clusters) {
  const bool fits = std::int64_t{kSplits} * num_user_tiles <= max_clusters &&
                    user_k_steps >= kSplits * Kernel::kPartialSteps;
  return fits ? kSplits : 1;
}

template <typename Element>
void run_lce_sm90(const LceArgs& args, LceSm90Schedule schedule, int max_clusters,
                  cudaStream_t stream) {
  using Kernel = LceSm90Kernel<Element>;
  const LcePlan::State& plan = *args.plan;
  const TileGrid grid = tile_grid(plan.m, args.n);
  const WorkspaceLayout layout = workspace_layout(grid, args.num_users);
  const auto k_steps = [](std::int64_t k) { return static_cast<int>((k + kBlockK - 1) / kBlockK); };

  LceSm90Params params{};
  params.paired_boxes = args.n % kBlockN == 0;
  const auto activation_map = [&](const void* e, std::int64_t k, std::int64_t batch) {
    return params.paired_boxes ? paired_map<Element>(e, args.n, k, batch)
                               : batched_map<Element>(e, args.n, k, batch, kBlockK);
  };
  params.user_activations = activation_map(args.e_u, plan.ku, args.num_users);
  params.candidate_activations = activation_map(args.e_c, plan.kc, args.num_candidates);
  const WeightTensorMaps::Boxes& weights = plan.weight_maps->with_rows(kWeightRowsPerCta);
  params.user_weights = weights.user;
  params.candidate_weights = weights.candidate;
  params.out = batched_map<Element>(args.out, args.n, plan.m, args.num_candidates, kBlockM);
  auto* workspace = static_cast<char*>(args.workspace);
  params.user_partials = reinterpret_cast<float*>(workspace);
  params.user_ready = reinterpret_cast<int*>(workspace + layout.partial_bytes);
  params.cand_to_user = args.map->device_view.cand_to_user;
  params.candidates_by_user = args.map->device_view.candidates_by_user;
  params.num_candidates = static_cast<int>(args.num_candidates);
  params.m = static_cast<int>(plan.m);
  params.n = static_cast<int>(args.n);
  // At least one k-step per held stage of a user unit (k-steps past K
  // read zeros).
  params.user_k_steps = std::max(k_steps(plan.ku), Kernel::kPartialSteps);
  params.candidate_k_steps = k_steps(plan.kc);
  params.n_blocks = static_cast<int>(grid.n_blocks);
  params.candidate_n_blocks = static_cast<int>(grid.candidate_n_blocks);
  params.m_blocks = static_cast<int>(grid.m_blocks);
  const auto num_user_tiles = static_cast<int>(args.num_users * grid.units_per_user());
  params.user_splits = user_splits<Kernel>(num_user_tiles, params.user_k_steps, max_clusters);
  params.num_user_units = num_user_tiles * params.user_splits;
  const auto num_candidate_units = static_cast<int>(grid.candidate_units(args.num_candidates));

  IKBO_CUDA_CHECK(cudaMemsetAsync(params.user_ready, 0, layout.ready_bytes, stream));
  const auto launch = [&](int first_unit, int num_units) {
    if (num_units == 0) return;
    params.first_unit = first_unit;
    params.num_units = num_units;
    cudaLaunchAttribute cluster_shape{};
    const cudaLaunchConfig_t config =
        sm90::launch_config<Kernel>(std::min(num_units, max_clusters), stream, cluster_shape);
    check_cuda(cudaLaunchKernelEx(&config, sm90::pipeline_kernel<Kernel>, params),
               "cudaLaunchKernelEx(lce_sm90 pipeline_kernel)");
  };
  if (schedule == LceSm90Schedule::one_launch) {
    launch(0, params.num_user_units + num_candidate_units);
  } else {
    // The candidate launch finds every flag set by the user launch before it.
    launch(0, params.num_user_units);
    launch(params.num_user_units, num_candidate_units);
  }
}

bool aligned_16(const void* pointer) { return reinterpret_cast<std::uintptr_t>(pointer) % 16 == 0; }

}  // namespace

bool lce_sm90_available(Device device) {
  return device.is_cuda() && device_support(device.index).available;
}

bool lce_sm90_supported(const LcePlan::State& plan, std::int64_t n, std::int64_t num_candidates,
                        std::int64_t num_users) {
  constexpr std::int64_t kInt32Max = std::numeric_limits<std::int32_t>::max();
  // TMA strides stay below 2^40 bytes.
  constexpr std::int64_t kMaxStrideBytes = std::int64_t{1} << 40;
  if (plan.weight_maps == nullptr) return false;
  if (n % 8 != 0 || n > kInt32Max || plan.m > kInt32Max || plan.kc > kInt32Max ||
      plan.ku > kInt32Max) {
    return false;
  }
  if (std::max({plan.m, plan.kc, plan.ku}) * n * kElementBytes >= kMaxStrideBytes) return false;
  const TileGrid grid = tile_grid(plan.m, n);
  return num_candidates + num_users <= kInt32Max / grid.partial_tiles_per_user();
}

std::shared_ptr<const WeightTensorMaps> lce_sm90_weight_maps(const LcePlan::State& plan) {
  if (plan.ku <= 0 || !lce_sm90_available(plan.device)) return nullptr;
  std::shared_ptr<const WeightTensorMaps> maps;
  dispatch_float_dtype(plan.dtype, [&](auto element) {
    using Element = decltype(element);
    if constexpr (!std::is_same_v<Element, float>) {
      // w [M, K], rows ld elements apart, in boxes of 64 k x 112 m: each CTA
      // of a cluster loads its half of a weight tile.
      maps = encode_weight_maps<Element>(plan.w_u, plan.ku, plan.ld_u, plan.w_c, plan.kc,
                                         plan.ld_c, plan.m, {kWeightRowsPerCta});
    }
  });
  return maps;
}

std::size_t lce_sm90_workspace_bytes(const LcePlan::State& plan, std::int64_t n,
                                     std::int64_t num_users) {
  const WorkspaceLayout layout = workspace_layout(tile_grid(plan.m, n), num_users);
  return layout.partial_bytes + layout.ready_bytes;
}

bool lce_sm90_eligible(const LceArgs& args) {
  const LcePlan::State& plan = *args.plan;
  return lce_sm90_enabled() && plan.ku > 0 && aligned_16(args.e_c) && aligned_16(args.e_u) &&
         aligned_16(args.out) && args.workspace != nullptr && aligned_16(args.workspace) &&
         args.workspace_bytes >= lce_sm90_workspace_bytes(plan, args.n, args.num_users) &&
         lce_sm90_supported(plan, args.n, args.num_candidates, args.num_users);
}

void lce_sm90(const LceArgs& args, LceSm90Schedule schedule) {
  const LcePlan::State& plan = *args.plan;
  DeviceGuard guard(plan.device.index);
  const int max_clusters = device_support(plan.device.index).clusters;
  const cudaStream_t stream = to_cuda_stream(args.stream);
  dispatch_float_dtype(plan.dtype, [&](auto element) {
    using Element = decltype(element);
    if constexpr (std::is_same_v<Element, float>) {
      throw RuntimeError("lce_sm90: no Hopper kernel for float32 (lce_sm90_eligible is false)");
    } else {
      run_lce_sm90<Element>(args, schedule, max_clusters, stream);
    }
  });
}

std::optional<std::string> lce_fused_blocker(const LceArgs& args) {
  const LcePlan::State& plan = *args.plan;
  if (!lce_sm90_available(plan.device)) {
    return "the fused stage is the Hopper LCE kernel: " + device_name(plan.device) +
           " is not a compute capability 9.0 GPU, or this build carries no sm_90a code";
  }
  if (!lce_sm90_enabled()) return "the Hopper LCE path is disabled (IKBO_DISABLE_SM90)";
  if (!lce_sm90_supported(plan, args.n, args.num_candidates, args.num_users)) {
    return "the Hopper LCE kernel does not take this call (it needs f16 or bf16 and N a "
           "multiple of 8)";
  }
  if (!lce_sm90_eligible(args)) {
    return "the Hopper LCE kernel needs 16-byte aligned e_c, e_u and out and a workspace of "
           "lce_workspace_bytes";
  }
  return std::nullopt;
}

void lce_fused(const LceArgs& args) {
  if (args.num_candidates == 0) return;
  if (const auto blocker = lce_fused_blocker(args)) throw RuntimeError("lce_fused: " + *blocker);
  lce_sm90(args, LceSm90Schedule::user_launch_first);
}

bool lce_sm90_enabled() { return sm90::enabled_switch<PathSwitch>().load(); }

void set_lce_sm90_enabled(bool enabled) { sm90::enabled_switch<PathSwitch>().store(enabled); }

}  // namespace ikbo::detail::cuda
