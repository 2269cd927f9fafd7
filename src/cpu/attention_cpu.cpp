// CPU backend of IKBO attention:
//   out[b, :, h, :] = softmax(scale * q[b,:,h,:] @ k[u,:,h,:]^T) @ v[u,:,h,:],  u = cand_to_user[b]
//
// Layouts: q, out [B, n_seed, H, D]; K/V dense [U, S, H, D] or jagged
// [total, H, D] where user u owns rows offsets[u] .. offsets[u+1]. Dtypes
// f16, bf16, f32; softmax and accumulation in fp32.
//
// K/V are read once per user, not once per candidate. For each (user, head):
//  - the user's K and V head slices [L, D] are converted to fp32 once (fp32
//    inputs are used in place through the BLAS leading dimension H*D);
//  - all query rows of the user's candidates (count_u * n_seed rows, found
//    through candidates_by_user, so unsorted maps work) form one long query
//    block, processed in row tiles:
//      scores = scale * log2(e) * Q K^T       (sgemm)
//      P      = exp2(scores - row max)        (fp32, with the row sums)
//      O      = P V                           (sgemm)
//      out    = round(O / row sum)            (scattered to out[b, seed, h, :])
//    The tile height shrinks for long histories so the score tile stays
//    within kScoreBudgetBytes.
// A user with no keys gets zeros; a user without candidates is skipped. A key
// scoring -inf gets weight 0, and a row whose every key scores -inf gets
// zeros, as a user without keys does (the GPU kernels agree).
//
// Threading: OpenBLAS threads each sgemm. The gathers, the softmax and the
// scatter between them run on OpenMP only where OpenBLAS is the OpenMP build
// (see blas_uses_openmp). Parallelizing over (user, head, tile) with
// single-threaded BLAS instead would need openblas_set_num_threads(1), a
// process-wide setting a library must not change under its caller.
#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <numbers>
#include <type_traits>
#include <utility>

#include "backend.hpp"
#include "cpu/blas.hpp"
#include "cpu/convert.hpp"

namespace ikbo::detail::cpu {
namespace {

// Score tile budget: 1024 query rows up to 1024 keys, fewer rows beyond
// (64 at S = 16384). Taller tiles make the two GEMMs of a tile more efficient.
constexpr std::int64_t kScoreBudgetBytes = std::int64_t{4} << 20;
constexpr std::int64_t kMaxTileRows = 1024;
// Below this height the two GEMMs of a tile lose too much efficiency.
constexpr std::int64_t kMinTileRows = 16;

std::int64_t tile_rows_for(std::int64_t seq_len) {
  const std::int64_t fitting =
      kScoreBudgetBytes / (std::max<std::int64_t>(seq_len, 1) * std::int64_t{sizeof(float)});
  return std::clamp(fitting, kMinTileRows, kMaxTileRows);
}

// 2^x for x <= 0 in fp32, branch-free so the softmax loop vectorizes without
// libm. x = n + f with n = round(x), |f| <= 1/2; 2^f by its degree-6 Taylor
// polynomial (relative error below 3e-7), 2^n through the exponent bits.
// x < -126.5 gives 0 (such a weight is below fp32 resolution next to the row
// maximum's weight of 1). The float select below vectorizes only because
// the CPU backend is built with -fno-trapping-math (CMakeLists.txt): under
// GCC's default it stays a branch and the loop runs scalar (the CPU
// attention bench 15-22% slower, bench/results/2026-11-29-cpu-s46.md).
inline float exp2_nonpositive(float x) {
  // A score of -inf (a key of -inf against a positive query) must get weight
  // 0, but -inf - round(-inf) is NaN. Raising x to -127, where the result is
  // 0 already, keeps every step finite; written as a max (maxps) so that a
  // NaN x stays NaN.
  constexpr float kZeroBelow = -127.0f;
  x = kZeroBelow > x ? kZeroBelow : x;
  // Adding and removing 1.5 * 2^23 rounds to an integer (|x| < 2^22; larger
  // magnitudes are integers already).
  constexpr float kRoundingShift = 12582912.0f;
  const float whole = (x + kRoundingShift) - kRoundingShift;
  const float fraction = x - whole;
  constexpr float ln2 = std::numbers::ln2_v<float>;
  constexpr float c1 = ln2, c2 = c1 * ln2 / 2, c3 = c2 * ln2 / 3, c4 = c3 * ln2 / 4,
                  c5 = c4 * ln2 / 5, c6 = c5 * ln2 / 6;
  float poly = c6;  // Horner
  poly = poly * fraction + c5;
  poly = poly * fraction + c4;
  poly = poly * fraction + c3;
  poly = poly * fraction + c2;
  poly = poly * fraction + c1;
  poly = poly * fraction + 1.0f;
  const std::int32_t biased_exponent = static_cast<std::int32_t>(whole) + 127;
  const std::uint32_t power_bits =
      biased_exponent > 0 ? static_cast<std::uint32_t>(biased_exponent) << 23 : 0u;
  return poly * std::bit_cast<float>(power_bits);
}

// One head's [L, D] slice of K or V as an fp32 matrix with row stride `ld`.
struct HeadMatrix {
  const float* data;
  std::int64_t ld;
};

// Head `head` of rows [first_row, first_row + rows) of a [*, H, D] tensor:
// in place for fp32, else converted into `buffer` ([rows, D]).
template <typename Storage>
HeadMatrix head_slice(const Storage* tensor, std::int64_t first_row, std::int64_t rows,
                      std::int64_t heads, std::int64_t head, std::int64_t head_dim, float* buffer) {
  const Storage* first = tensor + (first_row * heads + head) * head_dim;
  if constexpr (std::is_same_v<Storage, float>) {
    return {first, heads * head_dim};
  } else {
#pragma omp parallel for schedule(static) if (parallel_elementwise(rows * head_dim))
    for (std::int64_t row = 0; row < rows; ++row) {
      convert_to_float(first + row * heads * head_dim, buffer + row * head_dim, head_dim);
    }
    return {buffer, head_dim};
  }
}

// Rows of one user's query block: row r is seed r % n_seed of the user's
// (r / n_seed)-th candidate.
struct QueryBlock {
  const std::int32_t* candidates;  // the user's candidates (from candidates_by_user)
  std::int64_t n_seed, heads, head_dim;

  // Element offset of (row, head) in q / out [B, n_seed, H, D].
  std::int64_t offset(std::int64_t row, std::int64_t head) const {
    const std::int64_t candidate = candidates[row / n_seed];
    return ((candidate * n_seed + row % n_seed) * heads + head) * head_dim;
  }
};

// scores[r, :] <- exp2(scores[r, :] - max_r); row_sums[r] <- their sum. max_r
// is at least the lowest finite float, so a row of -inf scores gets weights
// 0 (not exp2(-inf - (-inf)) = NaN) and the sum 0.
void softmax_rows_unnormalized(float* scores, std::int64_t rows, std::int64_t seq_len,
                               float* row_sums) {
#pragma omp parallel for schedule(static) if (parallel_elementwise(rows * seq_len))
  for (std::int64_t row = 0; row < rows; ++row) {
    float* __restrict row_scores = scores + row * seq_len;
    float row_max = std::numeric_limits<float>::lowest();
#pragma omp simd reduction(max : row_max)
    for (std::int64_t key = 0; key < seq_len; ++key) {
      row_max = row_scores[key] > row_max ? row_scores[key] : row_max;
    }
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (std::int64_t key = 0; key < seq_len; ++key) {
      const float weight = exp2_nonpositive(row_scores[key] - row_max);
      row_scores[key] = weight;
      sum += weight;
    }
    row_sums[row] = sum;
  }
}

template <typename Storage>
void run_attention(const AttentionArgs& args) {
  const std::int64_t n_seed = args.n_seed, heads = args.heads, head_dim = args.head_dim;
  const CandidateMap::State& map = *args.map;
  const auto* q = static_cast<const Storage*>(args.q);
  const auto* k = static_cast<const Storage*>(args.k);
  const auto* v = static_cast<const Storage*>(args.v);
  auto* out = static_cast<Storage*>(args.out);

  auto key_rows = [&](std::int64_t user) -> std::pair<std::int64_t, std::int64_t> {
    if (args.kv_offsets == nullptr) return {user * args.dense_seq_len, args.dense_seq_len};
    const auto& offsets = args.kv_offsets->offsets;
    return {offsets[user], offsets[user + 1] - offsets[user]};
  };
  const std::int64_t max_seq_len =
      args.kv_offsets == nullptr ? args.dense_seq_len : args.kv_offsets->max_length;

  // No tile is taller than the largest user's query block. The score tile is
  // sized by the largest one a user actually gets, not from the longest
  // history: tile_rows_for rounds down, so rows * L is not monotone in L
  // (1023 rows * 1025 keys > 1022 rows * 1026 keys).
  const std::int64_t max_rows = std::min(kMaxTileRows, map.max_count * n_seed);
  std::int64_t max_score_elements = 0;
  for (std::int64_t user = 0; user < args.num_users; ++user) {
    const std::int64_t total_rows = (map.user_offsets[user + 1] - map.user_offsets[user]) * n_seed;
    const std::int64_t seq_len = key_rows(user).second;
    max_score_elements =
        std::max(max_score_elements, std::min(tile_rows_for(seq_len), total_rows) * seq_len);
  }
  auto scores =
      std::make_unique_for_overwrite<float[]>(static_cast<std::size_t>(max_score_elements));
  auto query_tile =
      std::make_unique_for_overwrite<float[]>(static_cast<std::size_t>(max_rows * head_dim));
  auto output_tile =
      std::make_unique_for_overwrite<float[]>(static_cast<std::size_t>(max_rows * head_dim));
  auto row_sums = std::make_unique_for_overwrite<float[]>(static_cast<std::size_t>(max_rows));
  std::unique_ptr<float[]> key_buffer, value_buffer;
  if constexpr (!std::is_same_v<Storage, float>) {
    key_buffer =
        std::make_unique_for_overwrite<float[]>(static_cast<std::size_t>(max_seq_len * head_dim));
    value_buffer =
        std::make_unique_for_overwrite<float[]>(static_cast<std::size_t>(max_seq_len * head_dim));
  }
  // exp2 of log2(e)-scaled scores is exp of the scores.
  const float score_scale = args.scale * std::numbers::log2e_v<float>;

  for (std::int64_t user = 0; user < args.num_users; ++user) {
    const std::int64_t group_begin = map.user_offsets[user];
    const std::int64_t num_user_candidates = map.user_offsets[user + 1] - group_begin;
    if (num_user_candidates == 0) continue;
    const QueryBlock block{map.candidates_by_user.data() + group_begin, n_seed, heads, head_dim};
    const auto [first_key, seq_len] = key_rows(user);
    if (seq_len == 0) {
      const std::int64_t candidate_elements = n_seed * heads * head_dim;
      for (std::int64_t i = 0; i < num_user_candidates; ++i) {
        std::memset(out + block.candidates[i] * candidate_elements, 0,
                    static_cast<std::size_t>(candidate_elements) * sizeof(Storage));
      }
      continue;
    }
    const std::int64_t total_rows = num_user_candidates * n_seed;
    const std::int64_t tile_rows = tile_rows_for(seq_len);
    for (std::int64_t head = 0; head < heads; ++head) {
      const HeadMatrix keys =
          head_slice(k, first_key, seq_len, heads, head, head_dim, key_buffer.get());
      const HeadMatrix values =
          head_slice(v, first_key, seq_len, heads, head, head_dim, value_buffer.get());
      for (std::int64_t tile_begin = 0; tile_begin < total_rows; tile_begin += tile_rows) {
        const std::int64_t rows = std::min(tile_rows, total_rows - tile_begin);
#pragma omp parallel for schedule(static) if (parallel_elementwise(rows * head_dim))
        for (std::int64_t row = 0; row < rows; ++row) {
          convert_to_float(q + block.offset(tile_begin + row, head),
                           query_tile.get() + row * head_dim, head_dim);
        }
        gemm_f32(rows, seq_len, head_dim, score_scale, query_tile.get(), head_dim, keys.data,
                 keys.ld, Transpose::yes, 0.0f, scores.get(), seq_len);
        softmax_rows_unnormalized(scores.get(), rows, seq_len, row_sums.get());
        gemm_f32(rows, head_dim, seq_len, 1.0f, scores.get(), seq_len, values.data, values.ld,
                 Transpose::no, 0.0f, output_tile.get(), head_dim);
#pragma omp parallel for schedule(static) if (parallel_elementwise(rows * head_dim))
        for (std::int64_t row = 0; row < rows; ++row) {
          const float inverse_sum = row_sums[row] > 0.0f ? 1.0f / row_sums[row] : 0.0f;
          const float* __restrict result = output_tile.get() + row * head_dim;
          Storage* __restrict destination = out + block.offset(tile_begin + row, head);
          for (std::int64_t d = 0; d < head_dim; ++d) {
            destination[d] = round_to<Storage>(result[d] * inverse_sum);
          }
        }
      }
    }
  }
}

}  // namespace

void attention(const AttentionArgs& args) {
  visit_storage(args.dtype, [&]<typename Storage>(Storage) { run_attention<Storage>(args); });
}

}  // namespace ikbo::detail::cpu
