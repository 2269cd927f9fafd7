// src/cuda/portable/attention_portable.cu — IKBO attention forward for any
// sm_80+ GPU: flash attention in which every query tile belongs to one user,
// whose K/V are looked up in the kernel and never replicated.
//
//   out[b, :, h, :] = softmax(scale * q[b,:,h,:] @ k[u,:,h,:]^T) @ v[u,:,h,:],  u = cand_to_user[b]
//
// Layouts (elements, row-major): q/out [B, n_seed, H, D]; K/V dense
// [U, S, H, D] or jagged [total, H, D] with user u owning rows
// kv_offsets[u] .. kv_offsets[u+1]. D is 64, 128 or 256.
//
// Work decomposition. The query rows of user u are the n_seed rows of each of
// its candidates, taken in candidates_by_user order: row r is seed r % n_seed
// of candidate candidates_by_user[user_offsets[u] + r / n_seed]. That block is
// cut into tiles of kBlockM rows, so unsorted maps, odd candidate counts and
// any n_seed cost at most one partial tile per user. Grid: x = tiles of the
// largest group, y = (user, head) pairs; both dimensions stride, and a CTA
// whose tile lies past its user's rows has nothing to do.
//
// Variants:
//   attention_mma_kernel   f16/bf16 with 16-byte aligned tensors. 8 warps
//                          (D = 256: 4), 16 query rows each; K/V tiles
//                          of 64 keys (D = 256: 32) double-buffered
//                          through swizzled shared memory with cp.async;
//                          QK^T and PV on tensor cores (mma.sync m16n8k16,
//                          fp32 accumulation); P rounded to the input type
//                          for PV, as in FlashAttention.
//   attention_simt_kernel  f32, and f16/bf16 views that are not 16-byte
//                          aligned: the same algorithm on CUDA cores in fp32.
// Both use an online softmax in fp32 on exp2 (scale * log2(e) folded into the
// scores), mask keys past the user's length, and write zeros for a user with
// no keys (never NaN).
//
// attention() below hands eligible calls (Hopper GPU, f16/bf16, 16-byte
// aligned) to the sm_90a kernel of sm90/attention_sm90.cu, which uses the
// same per-user query tiles; these kernels serve every other call.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "backend.hpp"
#include "cuda/check.cuh"
#include "cuda/dtype.cuh"
#include "cuda/launch.cuh"
#include "cuda/online_softmax.cuh"
#include "cuda/ptx/sm80.cuh"
#include "cuda/runtime.cuh"
#include "cuda/sm90/attention_sm90.hpp"

namespace ikbo::detail::cuda {
namespace {

constexpr unsigned kFullWarp = 0xffffffffu;
constexpr double kLog2e = 1.4426950408889634;

// What one CTA works on: a user's query rows at one head, and that user's keys.
struct UserHead {
  int head = 0;
  std::int64_t group_begin = 0;  // first entry of the user's group in candidates_by_user
  std::int64_t rows = 0;         // count * n_seed query rows
  std::int64_t kv_begin = 0;     // first K/V row of the user
  std::int64_t kv_length = 0;
};

template <typename Element>
struct AttentionProblem {
  const Element* q;
  const Element* k;
  const Element* v;
  Element* out;
  const std::int32_t* user_offsets;        // [U + 1]
  const std::int32_t* candidates_by_user;  // [B]
  const std::int32_t* kv_offsets;          // [U + 1]; null: dense K/V
  std::int64_t dense_seq_len;
  std::int64_t n_seed;
  std::int64_t num_user_heads;  // U * H
  int heads;
  float scale_log2;  // scale * log2(e)

  __device__ UserHead user_head(std::int64_t index) const {
    const std::int64_t user = index / heads;
    UserHead work;
    work.head = static_cast<int>(index % heads);
    work.group_begin = user_offsets[user];
    work.rows = (user_offsets[user + 1] - work.group_begin) * n_seed;
    if (kv_offsets != nullptr) {
      work.kv_begin = kv_offsets[user];
      work.kv_length = kv_offsets[user + 1] - work.kv_begin;
    } else {
      work.kv_begin = user * dense_seq_len;
      work.kv_length = dense_seq_len;
    }
    return work;
  }

  // Element offset of the user's query row `row` at `head` in q and out.
  template <int kHeadDim>
  __device__ std::int64_t query_offset(const UserHead& work, std::int64_t row) const {
    const std::int64_t candidate = candidates_by_user[work.group_begin + row / n_seed];
    return ((candidate * n_seed + row % n_seed) * heads + work.head) * kHeadDim;
  }

  // Element offset of the user's key `key` at `head` in k and v.
  template <int kHeadDim>
  __device__ std::int64_t kv_offset(const UserHead& work, std::int64_t key) const {
    return ((work.kv_begin + key) * heads + work.head) * kHeadDim;
  }
};

// Runs body(work, first_row) for every query tile this CTA owns. The loop
// bounds depend only on block indices, so __syncthreads inside is uniform.
template <int kBlockM, typename Element, typename Body>
__device__ __forceinline__ void for_each_query_tile(const AttentionProblem<Element>& problem,
                                                    Body&& body) {
  for (std::int64_t index = blockIdx.y; index < problem.num_user_heads; index += gridDim.y) {
    const UserHead work = problem.user_head(index);
    for (std::int64_t tile = blockIdx.x; tile * kBlockM < work.rows; tile += gridDim.x) {
      body(work, tile * kBlockM);
    }
  }
}

// ---------------------------------------------------------------------------
// Tensor-core kernel (f16 / bf16).

// D = 256 takes half the rows and keys, so that its 98 KiB of shared memory
// (and 128 accumulators of O per thread) fit every sm_80+ GPU.
template <int kHeadDim>
struct MmaConfig {
  static constexpr int kBlockM = kHeadDim == 256 ? 64 : 128;  // query rows per CTA
  static constexpr int kBlockN = kHeadDim == 256 ? 32 : 64;   // keys per K/V tile
  static constexpr int kWarps = kBlockM / 16;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kStages = 2;  // K/V tile t+1 loads while tile t computes
  static constexpr int kRowBytes = kHeadDim * 2;
  static constexpr int kChunksPerRow = kRowBytes / 16;
  static constexpr int kQTileBytes = kBlockM * kRowBytes;
  static constexpr int kKvTileBytes = kBlockN * kRowBytes;
  static constexpr int kStageBytes = 2 * kKvTileBytes;  // K tile, then V tile
  static constexpr int kQueryOffsetsAt = kQTileBytes + kStages * kStageBytes;
  static constexpr int kSharedBytes = kQueryOffsetsAt + kBlockM * 8;
};

// Byte offset of 16-byte chunk `chunk` of row `row` in a shared tile. The
// XOR with the row's low 3 bits spreads the 8 rows an ldmatrix phase reads
// at one column over all 32 banks (rows are 128, 256 or 512 bytes, so
// unswizzled they would all hit the same 4 banks).
template <int kRowBytes>
__device__ __forceinline__ std::uint32_t swizzle(int row, int chunk) {
  return static_cast<std::uint32_t>(row * kRowBytes + ((chunk ^ (row & 7)) << 4));
}

// Shared-memory byte offsets of one lane's ldmatrix.x4 reads from a swizzled
// tile. A lane only ever addresses rows with (row & 7) == (lane_row & 7), so
// the swizzle XOR depends on the chunk's low 3 bits alone; precomputing the 4
// patterns keeps the XOR out of the inner loops (and the compiler from
// hoisting one register per distinct address).
template <int kRowBytes>
struct FragmentAddresses {
  std::uint32_t row_offset;
  std::uint32_t chunk_offset[4];  // swizzled offset of chunk 2 * i + lane_chunk

  // lane_row in [0, 16), lane_chunk in {0, 1}: the lane's row and chunk
  // within a 16-row, 2-chunk (16 x 16 element) block.
  __device__ FragmentAddresses(int lane_row, int lane_chunk)
      : row_offset(static_cast<std::uint32_t>(lane_row * kRowBytes)) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      chunk_offset[i] = static_cast<std::uint32_t>(((2 * i + lane_chunk) ^ (lane_row & 7)) << 4);
    }
  }

  // The lane's address in the 16 x 16 block at rows 16 * row_block and
  // elements 16 * column_block (chunks 2 * column_block and + 1).
  __device__ std::uint32_t at(int row_block, int column_block) const {
    return row_offset + static_cast<std::uint32_t>(row_block * 16 * kRowBytes) +
           static_cast<std::uint32_t>(column_block / 4 * 128) + chunk_offset[column_block % 4];
  }
};

template <typename Element, int kHeadDim>
__global__ void __launch_bounds__(MmaConfig<kHeadDim>::kThreads, 1)
    attention_mma_kernel(const AttentionProblem<Element> problem) {
  using Config = MmaConfig<kHeadDim>;
  constexpr int kBlockM = Config::kBlockM, kBlockN = Config::kBlockN;
  constexpr int kRowBytes = Config::kRowBytes;
  constexpr int kKeySteps = kHeadDim / 16;  // k-steps of QK^T
  constexpr int kScoreTiles = kBlockN / 8;  // n-tiles of S
  constexpr int kPvSteps = kBlockN / 16;    // k-steps of PV
  constexpr int kOutTiles = kHeadDim / 8;   // n-tiles of O

  extern __shared__ __align__(128) unsigned char shared[];
  const std::uint32_t q_tile = ptx::shared_address(shared);
  const std::uint32_t kv_stages = q_tile + Config::kQTileBytes;
  auto* query_offsets = reinterpret_cast<std::int64_t*>(shared + Config::kQueryOffsetsAt);

  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int warp = static_cast<int>(threadIdx.x) / 32;
  const int warp_row = warp * 16;                          // first of the warp's 16 rows
  const int group = lane / 4, thread_in_group = lane % 4;  // mma fragment coordinates
  // ldmatrix.x4 address patterns: lanes 0-7 / 8-15 / 16-23 / 24-31 point at
  // matrices 0..3. For A-like operands (Q, and V read transposed) matrices
  // 1 and 3 are 8 rows further down and 2 and 3 one chunk to the right; for
  // K (the B operand of two n-tiles at once) the roles swap.
  const FragmentAddresses<kRowBytes> a_addresses((lane & 7) + ((lane >> 3) & 1) * 8, lane >> 4);
  const FragmentAddresses<kRowBytes> k_addresses((lane & 7) + (lane >> 4) * 8, (lane >> 3) & 1);
  // Tile copies: thread t moves chunk t % kChunksPerRow of rows
  // t / kChunksPerRow + i * kRowsPerPass, at a fixed source stride. Where
  // kRowsPerPass is a multiple of 8 every pass has the same swizzle.
  constexpr int kRowsPerPass = Config::kThreads / Config::kChunksPerRow;
  static_assert(kBlockN % kRowsPerPass == 0 && kBlockM % kRowsPerPass == 0);
  const int copy_row = static_cast<int>(threadIdx.x) / Config::kChunksPerRow;
  const int copy_chunk = static_cast<int>(threadIdx.x) % Config::kChunksPerRow;
  const std::uint32_t copy_destination = swizzle<kRowBytes>(copy_row, copy_chunk);
  const auto pass_destination = [&](int pass) {
    if constexpr (kRowsPerPass % 8 == 0) {
      return copy_destination + static_cast<std::uint32_t>(pass * kRowsPerPass * kRowBytes);
    } else {
      return swizzle<kRowBytes>(copy_row + pass * kRowsPerPass, copy_chunk);
    }
  };
  const std::int64_t kv_row_stride = static_cast<std::int64_t>(problem.heads) * kHeadDim;

  for_each_query_tile<kBlockM>(problem, [&](const UserHead& work, std::int64_t first_row) {
    if (threadIdx.x < kBlockM) {
      const std::int64_t row = first_row + threadIdx.x;
      query_offsets[threadIdx.x] =
          row < work.rows ? problem.template query_offset<kHeadDim>(work, row) : -1;
    }
    __syncthreads();

    const int num_kv_tiles = static_cast<int>((work.kv_length + kBlockN - 1) / kBlockN);
    auto load_kv_tile = [&](int kv_tile) {
      const std::int64_t first_key = static_cast<std::int64_t>(kv_tile) * kBlockN + copy_row;
      const std::uint32_t stage = kv_stages + (kv_tile % Config::kStages) * Config::kStageBytes;
      const std::int64_t first_offset =
          problem.template kv_offset<kHeadDim>(work, first_key) + copy_chunk * 8;
#pragma unroll
      for (int pass = 0; pass < kBlockN / kRowsPerPass; ++pass) {
        // Keys past the end are zero-filled: their scores are masked, but V
        // must be finite there because 0 * NaN would poison the output.
        const bool valid = first_key + pass * kRowsPerPass < work.kv_length;
        const std::int64_t offset = first_offset + pass * kRowsPerPass * kv_row_stride;
        const std::uint32_t destination = stage + pass_destination(pass);
        ptx::cp_async_16(destination, valid ? problem.k + offset : problem.k, valid);
        ptx::cp_async_16(destination + Config::kKvTileBytes, valid ? problem.v + offset : problem.v,
                         valid);
      }
    };
    if (num_kv_tiles > 0) {
#pragma unroll
      for (int pass = 0; pass < kBlockM / kRowsPerPass; ++pass) {
        const std::int64_t offset = query_offsets[copy_row + pass * kRowsPerPass];
        const bool valid = offset >= 0;
        ptx::cp_async_16(q_tile + pass_destination(pass),
                         valid ? problem.q + offset + copy_chunk * 8 : problem.q, valid);
      }
      load_kv_tile(0);
    }
    ptx::cp_async_commit();

    float out_acc[kOutTiles][4] = {};
    float row_max[2] = {-INFINITY, -INFINITY};  // rows group and group + 8, log2 domain
    float row_sum[2] = {0.0f, 0.0f};            // this thread's columns only until the end

    for (int kv_tile = 0; kv_tile < num_kv_tiles; ++kv_tile) {
      if (kv_tile + 1 < num_kv_tiles) load_kv_tile(kv_tile + 1);
      ptx::cp_async_commit();  // possibly empty: keeps the wait count uniform
      ptx::cp_async_wait<1>();
      __syncthreads();  // tile kv_tile (and Q) visible to every warp
      const std::uint32_t k_tile = kv_stages + (kv_tile % Config::kStages) * Config::kStageBytes;
      const std::uint32_t v_tile = k_tile + Config::kKvTileBytes;

      // S = Q K^T for the warp's 16 rows and the tile's kBlockN keys.
      float scores[kScoreTiles][4] = {};
#pragma unroll
      for (int step = 0; step < kKeySteps; ++step) {
        std::uint32_t q_fragment[4];
        ptx::ldmatrix_x4(q_fragment, q_tile + a_addresses.at(warp, step));
#pragma unroll
        for (int pair = 0; pair < kScoreTiles / 2; ++pair) {
          std::uint32_t key_fragments[4];
          ptx::ldmatrix_x4(key_fragments, k_tile + k_addresses.at(pair, step));
          ptx::mma_m16n8k16<Element>(scores[2 * pair], q_fragment, key_fragments[0],
                                     key_fragments[1]);
          ptx::mma_m16n8k16<Element>(scores[2 * pair + 1], q_fragment, key_fragments[2],
                                     key_fragments[3]);
        }
      }

      // Online softmax. Scale first (scale may be negative), then mask the
      // tail; the running maximum is finite (running_max), so exp2(-inf -
      // max) = 0 handles the first tile.
      const std::int64_t first_key = static_cast<std::int64_t>(kv_tile) * kBlockN;
      const bool partial_tile = first_key + kBlockN > work.kv_length;
      float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int tile = 0; tile < kScoreTiles; ++tile) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float score = scores[tile][e] * problem.scale_log2;
          if (partial_tile &&
              first_key + tile * 8 + 2 * thread_in_group + (e & 1) >= work.kv_length) {
            score = -INFINITY;
          }
          scores[tile][e] = score;
          tile_max[e >> 1] = fmaxf(tile_max[e >> 1], score);
        }
      }
      float correction[2];
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        // The four threads of a group hold the same row.
        tile_max[half] = fmaxf(tile_max[half], __shfl_xor_sync(kFullWarp, tile_max[half], 1));
        tile_max[half] = fmaxf(tile_max[half], __shfl_xor_sync(kFullWarp, tile_max[half], 2));
        const float new_max = running_max(row_max[half], tile_max[half]);
        correction[half] = ptx::exp2_approx(row_max[half] - new_max);
        row_max[half] = new_max;
        row_sum[half] *= correction[half];
      }
#pragma unroll
      for (int tile = 0; tile < kScoreTiles; ++tile) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          scores[tile][e] = ptx::exp2_approx(scores[tile][e] - row_max[e >> 1]);
          row_sum[e >> 1] += scores[tile][e];
        }
      }
#pragma unroll
      for (int tile = 0; tile < kOutTiles; ++tile) {
#pragma unroll
        for (int e = 0; e < 4; ++e) out_acc[tile][e] *= correction[e >> 1];
      }

      // O += P V. The S accumulator layout of two adjacent n-tiles is the A
      // fragment layout of one 16-key k-step, so P never leaves registers.
#pragma unroll
      for (int step = 0; step < kPvSteps; ++step) {
        const float(&low)[4] = scores[2 * step];
        const float(&high)[4] = scores[2 * step + 1];
        const std::uint32_t p_fragment[4] = {
            ptx::pack_pair<Element>(low[0], low[1]), ptx::pack_pair<Element>(low[2], low[3]),
            ptx::pack_pair<Element>(high[0], high[1]), ptx::pack_pair<Element>(high[2], high[3])};
#pragma unroll
        for (int pair = 0; pair < kOutTiles / 2; ++pair) {
          std::uint32_t value_fragments[4];
          ptx::ldmatrix_x4_trans(value_fragments, v_tile + a_addresses.at(step, pair));
          ptx::mma_m16n8k16<Element>(out_acc[2 * pair], p_fragment, value_fragments[0],
                                     value_fragments[1]);
          ptx::mma_m16n8k16<Element>(out_acc[2 * pair + 1], p_fragment, value_fragments[2],
                                     value_fragments[3]);
        }
      }
      __syncthreads();  // every warp is done with this stage before it is refilled
    }

    // Epilogue: normalize, round, stage the warp's 16 rows in its own rows of
    // the Q tile (no other warp touches them), then store 16-byte chunks.
    float inverse_sum[2];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      row_sum[half] += __shfl_xor_sync(kFullWarp, row_sum[half], 1);
      row_sum[half] += __shfl_xor_sync(kFullWarp, row_sum[half], 2);
      inverse_sum[half] = row_sum[half] > 0.0f ? 1.0f / row_sum[half] : 0.0f;  // no keys: zeros
    }
#pragma unroll
    for (int tile = 0; tile < kOutTiles; ++tile) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int row = warp_row + group + 8 * half;
        *reinterpret_cast<std::uint32_t*>(shared + swizzle<kRowBytes>(row, tile) +
                                          4 * thread_in_group) =
            ptx::pack_pair<Element>(out_acc[tile][2 * half] * inverse_sum[half],
                                    out_acc[tile][2 * half + 1] * inverse_sum[half]);
      }
    }
    __syncwarp();
#pragma unroll
    for (int pass = 0; pass < 16 * Config::kChunksPerRow / 32; ++pass) {
      const int index = pass * 32 + lane;
      const int row = warp_row + index / Config::kChunksPerRow;
      const int chunk = index % Config::kChunksPerRow;
      const std::int64_t offset = query_offsets[row];
      if (offset >= 0) {
        *reinterpret_cast<uint4*>(problem.out + offset + chunk * 8) =
            *reinterpret_cast<const uint4*>(shared + swizzle<kRowBytes>(row, chunk));
      }
    }
    __syncthreads();  // shared memory is reused by the next tile
  });
}

// ---------------------------------------------------------------------------
// CUDA-core kernel (f32, and unaligned f16/bf16).

template <int kHeadDim>
struct SimtConfig {
  static constexpr int kBlockM = 32;  // query rows per CTA: 4 warps x 8 rows
  static constexpr int kBlockN = 32;  // keys per tile: one per lane when scoring
  static constexpr int kWarps = 4;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kRowsPerWarp = kBlockM / kWarps;
  static constexpr int kDimsPerLane = kHeadDim / 32;
  // Odd stride: lane j reading K[j][d] hits bank (j + d) % 32, conflict-free.
  static constexpr int kKeyStride = kHeadDim + 1;
  static constexpr int kSharedBytes =
      kBlockM * 8 + (kBlockM * kHeadDim + kBlockN * kKeyStride + kBlockN * kHeadDim) * 4;
};

__device__ __forceinline__ float warp_max(float value) {
#pragma unroll
  for (int mask = 16; mask > 0; mask /= 2) {
    value = fmaxf(value, __shfl_xor_sync(kFullWarp, value, mask));
  }
  return value;
}

__device__ __forceinline__ float warp_sum(float value) {
#pragma unroll
  for (int mask = 16; mask > 0; mask /= 2) value += __shfl_xor_sync(kFullWarp, value, mask);
  return value;
}

template <typename Element, int kHeadDim>
__global__ void __launch_bounds__(SimtConfig<kHeadDim>::kThreads)
    attention_simt_kernel(const AttentionProblem<Element> problem) {
  using Config = SimtConfig<kHeadDim>;
  constexpr int kBlockM = Config::kBlockM, kBlockN = Config::kBlockN;
  constexpr int kRows = Config::kRowsPerWarp, kDims = Config::kDimsPerLane;
  constexpr int kKeyStride = Config::kKeyStride;

  extern __shared__ __align__(128) unsigned char shared[];
  auto* query_offsets = reinterpret_cast<std::int64_t*>(shared);
  auto* q_tile = reinterpret_cast<float*>(shared + kBlockM * 8);  // pre-scaled by scale*log2(e)
  float* k_tile = q_tile + kBlockM * kHeadDim;
  float* v_tile = k_tile + kBlockN * kKeyStride;

  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int warp_row = static_cast<int>(threadIdx.x) / 32 * kRows;

  for_each_query_tile<kBlockM>(problem, [&](const UserHead& work, std::int64_t first_row) {
    if (threadIdx.x < kBlockM) {
      const std::int64_t row = first_row + threadIdx.x;
      query_offsets[threadIdx.x] =
          row < work.rows ? problem.template query_offset<kHeadDim>(work, row) : -1;
    }
    __syncthreads();
    for (int index = threadIdx.x; index < kBlockM * kHeadDim; index += Config::kThreads) {
      const std::int64_t offset = query_offsets[index / kHeadDim];
      q_tile[index] =
          offset >= 0 ? to_float(problem.q[offset + index % kHeadDim]) * problem.scale_log2 : 0.0f;
    }

    float row_max[kRows], row_sum[kRows], out_acc[kRows][kDims];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      row_max[r] = -INFINITY;
      row_sum[r] = 0.0f;
#pragma unroll
      for (int d = 0; d < kDims; ++d) out_acc[r][d] = 0.0f;
    }

    for (std::int64_t first_key = 0; first_key < work.kv_length; first_key += kBlockN) {
      __syncthreads();  // Q is written and the previous K/V tile consumed
      for (int index = threadIdx.x; index < kBlockN * kHeadDim; index += Config::kThreads) {
        const int key_in_tile = index / kHeadDim, dim = index % kHeadDim;
        const std::int64_t key = first_key + key_in_tile;
        float key_value = 0.0f, value = 0.0f;  // past the end: finite zeros
        if (key < work.kv_length) {
          const std::int64_t offset = problem.template kv_offset<kHeadDim>(work, key) + dim;
          key_value = to_float(problem.k[offset]);
          value = to_float(problem.v[offset]);
        }
        k_tile[key_in_tile * kKeyStride + dim] = key_value;
        v_tile[key_in_tile * kHeadDim + dim] = value;
      }
      __syncthreads();

      // Lane j scores key j against the warp's rows.
      float scores[kRows] = {};
      for (int dim = 0; dim < kHeadDim; ++dim) {
        const float key_value = k_tile[lane * kKeyStride + dim];
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          scores[r] += q_tile[(warp_row + r) * kHeadDim + dim] * key_value;
        }
      }
      const bool key_valid = first_key + lane < work.kv_length;
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const float score = key_valid ? scores[r] : -INFINITY;
        const float new_max = running_max(row_max[r], warp_max(score));
        const float correction = ptx::exp2_approx(row_max[r] - new_max);
        scores[r] = ptx::exp2_approx(score - new_max);
        row_sum[r] = row_sum[r] * correction + warp_sum(scores[r]);
        row_max[r] = new_max;
#pragma unroll
        for (int d = 0; d < kDims; ++d) out_acc[r][d] *= correction;
      }

      // Lane l accumulates dims l, l + 32, ...; p of key j comes from lane j.
      for (int key = 0; key < kBlockN; ++key) {
        float values[kDims];
#pragma unroll
        for (int d = 0; d < kDims; ++d) values[d] = v_tile[key * kHeadDim + lane + 32 * d];
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          const float p = __shfl_sync(kFullWarp, scores[r], key);
#pragma unroll
          for (int d = 0; d < kDims; ++d) out_acc[r][d] += p * values[d];
        }
      }
    }

#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const std::int64_t offset = query_offsets[warp_row + r];
      if (offset < 0) continue;
      const float inverse_sum = row_sum[r] > 0.0f ? 1.0f / row_sum[r] : 0.0f;  // no keys: zeros
#pragma unroll
      for (int d = 0; d < kDims; ++d) {
        problem.out[offset + lane + 32 * d] = from_float<Element>(out_acc[r][d] * inverse_sum);
      }
    }
    __syncthreads();  // shared memory is reused by the next tile
  });
}

// ---------------------------------------------------------------------------
// Host side.

template <typename Config, typename Element>
void launch(void (*kernel)(AttentionProblem<Element>), const char* kernel_name,
            const AttentionProblem<Element>& problem, std::int64_t max_rows, cudaStream_t stream) {
  const std::int64_t tiles = (max_rows + Config::kBlockM - 1) / Config::kBlockM;
  const dim3 grid(static_cast<unsigned>(std::min(tiles, kMaxGridX)),
                  static_cast<unsigned>(std::min(problem.num_user_heads, kMaxGridY)));
  // Above 48 KiB dynamic shared memory must be opted into; the attribute is
  // per device, so it is set on every launch (cheap, and graph-capture safe).
  IKBO_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       Config::kSharedBytes));
  kernel<<<grid, Config::kThreads, Config::kSharedBytes, stream>>>(problem);
  check_launch(kernel_name);
}

template <typename Element, int kHeadDim>
void launch_for_head_dim(const AttentionProblem<Element>& problem, std::int64_t max_rows,
                         bool use_tensor_cores, cudaStream_t stream) {
  if constexpr (!std::is_same_v<Element, float>) {
    if (use_tensor_cores) {
      launch<MmaConfig<kHeadDim>>(attention_mma_kernel<Element, kHeadDim>, "attention_mma_kernel",
                                  problem, max_rows, stream);
      return;
    }
  }
  launch<SimtConfig<kHeadDim>>(attention_simt_kernel<Element, kHeadDim>, "attention_simt_kernel",
                               problem, max_rows, stream);
}

bool aligned_16(const void* pointer) { return reinterpret_cast<std::uintptr_t>(pointer) % 16 == 0; }

template <typename Element>
void run_attention(const AttentionArgs& args) {
  const CandidateMapDeviceView& map = args.map->device_view;
  AttentionProblem<Element> problem;
  problem.q = static_cast<const Element*>(args.q);
  problem.k = static_cast<const Element*>(args.k);
  problem.v = static_cast<const Element*>(args.v);
  problem.out = static_cast<Element*>(args.out);
  problem.user_offsets = map.user_offsets;
  problem.candidates_by_user = map.candidates_by_user;
  problem.kv_offsets = args.kv_offsets != nullptr ? args.kv_offsets->device_offsets : nullptr;
  problem.dense_seq_len = args.dense_seq_len;
  problem.n_seed = args.n_seed;
  problem.num_user_heads = args.num_users * args.heads;
  problem.heads = static_cast<int>(args.heads);
  problem.scale_log2 = args.scale * static_cast<float>(kLog2e);

  const std::int64_t max_rows = args.map->max_count * args.n_seed;
  if (max_rows == 0) return;
  // Rows are D elements (128, 256 or 512 bytes), so aligned bases mean every
  // cp.async and 16-byte store is aligned.
  const bool use_tensor_cores =
      aligned_16(args.q) && aligned_16(args.k) && aligned_16(args.v) && aligned_16(args.out);
  const cudaStream_t stream = to_cuda_stream(args.stream);
  with_head_dim(args, [&](auto head_dim) {
    constexpr int kHeadDim = decltype(head_dim)::value;
    launch_for_head_dim<Element, kHeadDim>(problem, max_rows, use_tensor_cores, stream);
  });
}

}  // namespace

std::size_t attention_workspace_bytes(const AttentionArgs& args) {
  return attention_sm90_eligible(args) ? attention_sm90_workspace_bytes(args) : 0;
}

void attention(const AttentionArgs& args) {
  if (attention_sm90_eligible(args)) {
    attention_sm90(args, attention_sm90_schedule());
    return;
  }
  DeviceGuard guard(args.map->device.index);
  dispatch_float_dtype(args.dtype, [&](auto element) { run_attention<decltype(element)>(args); });
}

}  // namespace ikbo::detail::cuda
