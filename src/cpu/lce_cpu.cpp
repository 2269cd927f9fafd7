// CPU backend of LCE:  out[b] = w_c @ e_c[b] + w_u @ e_u[u(b)],  through OpenBLAS sgemm.
//
// Layouts: w_c [M, Kc], w_u [M, Ku] (prepared once as fp32, K stride padded
// to kWeightKAlignment with zeros); e_c [B, Kc, N], e_u [U, Ku, N] and
// out [B, M, N] in the plan's dtype (f16, bf16 or f32), all row-major.
//
// The in-kernel broadcast, CPU style:
//  1. User partials P[u] = w_u @ e_u[u], computed once per user, kept in fp32
//     as one [M, U*N] matrix (user u owns columns u*N .. u*N + N - 1).
//  2. Candidates in blocks: the block's e_c[b] are converted side by side into
//     one fp32 [Kc, count*N] matrix, so a single M x Kc x (count*N) sgemm
//     serves the whole block however small N is.
//  3. Epilogue: out[b] = round(C[:, j*N : j*N + N] + P[u(b)]), the two fp32
//     partials summed before the single rounding to the output dtype.
// Users go through the same block GEMM as candidates (step 1 writes its
// blocks straight into P). fp32 inputs with wide rows skip the conversion copy
// and run one sgemm per item on the input in place.
// A plan with ku == 0 (the broadcast baseline's GEMM over the concatenated
// [w_u | w_c]) has no user term and no step 1.
//
// Threading: OpenBLAS threads each sgemm. The conversion and the epilogue
// between the GEMMs run on OpenMP only where OpenBLAS is the OpenMP build
// (see blas_uses_openmp), never inside a BLAS call or around one.
#include <algorithm>
#include <cstdint>
#include <limits>
#include <memory>
#include <type_traits>

#include "backend.hpp"
#include "cpu/blas.hpp"
#include "cpu/convert.hpp"

namespace ikbo::detail::cpu {
namespace {

// Budget for the larger of a block's two fp32 buffers (converted operand,
// product): wide enough for an efficient GEMM, small enough to stay in the
// outer caches between the GEMM and the epilogue.
constexpr std::int64_t kBlockBudgetBytes = std::int64_t{4} << 20;
// fp32 operands with at least this many columns are multiplied in place, one
// sgemm per item: such a GEMM is already efficient, and the copy is saved.
constexpr std::int64_t kInPlaceMinColumns = 64;

// Prepared fp32 weights [M, K] with row stride `ld`.
struct Weights {
  const float* data;
  std::int64_t ld;
  std::int64_t k;
};

// How many [K, N] items one block holds within kBlockBudgetBytes.
std::int64_t items_per_block(std::int64_t k, std::int64_t m, std::int64_t n) {
  const std::int64_t bytes_per_item = std::max(k, m) * n * std::int64_t{sizeof(float)};
  return std::max<std::int64_t>(1, kBlockBudgetBytes / bytes_per_item);
}

template <typename Storage>
constexpr bool multiplied_in_place(std::int64_t n) {
  return std::is_same_v<Storage, float> && n >= kInPlaceMinColumns;
}

// packed[row, j*N + col] = x[first + j][row, col] for j < count: the items'
// [K, N] matrices side by side as one fp32 [K, count*N] matrix.
template <typename Storage>
void pack_side_by_side(const Storage* x, std::int64_t k, std::int64_t n, std::int64_t first,
                       std::int64_t count, float* packed) {
  const std::int64_t width = count * n;
#pragma omp parallel for collapse(2) schedule(static) if (parallel_elementwise(count * k * n))
  for (std::int64_t j = 0; j < count; ++j) {
    for (std::int64_t row = 0; row < k; ++row) {
      convert_to_float(x + ((first + j) * k + row) * n, packed + row * width + j * n, n);
    }
  }
}

// product[:, j*N : j*N + N] = w @ x[first + j] for j < count; product rows
// are `ld_product` apart. `packed` holds K x count*N floats unless the
// operand is multiplied in place.
template <typename Storage>
void multiply_block(const Weights& w, std::int64_t m, const Storage* x, std::int64_t n,
                    std::int64_t first, std::int64_t count, float* packed, float* product,
                    std::int64_t ld_product) {
  if constexpr (std::is_same_v<Storage, float>) {
    if (multiplied_in_place<Storage>(n)) {
      for (std::int64_t j = 0; j < count; ++j) {
        gemm_f32(m, n, w.k, 1.0f, w.data, w.ld, x + (first + j) * w.k * n, n, Transpose::no, 0.0f,
                 product + j * n, ld_product);
      }
      return;
    }
  }
  pack_side_by_side(x, w.k, n, first, count, packed);
  gemm_f32(m, count * n, w.k, 1.0f, w.data, w.ld, packed, count * n, Transpose::no, 0.0f, product,
           ld_product);
}

// out[first + j] = round(product[:, j*N : j*N + N] + P[u(first + j)]) for
// j < count; without user partials (null) just the rounding.
template <typename Storage>
void store_block(const float* product, std::int64_t m, std::int64_t n, std::int64_t first,
                 std::int64_t count, const float* user_partials, std::int64_t num_users,
                 const std::int32_t* cand_to_user, Storage* out) {
  const std::int64_t width = count * n;
#pragma omp parallel for collapse(2) schedule(static) if (parallel_elementwise(count * m * n))
  for (std::int64_t j = 0; j < count; ++j) {
    for (std::int64_t row = 0; row < m; ++row) {
      const float* __restrict candidate_part = product + row * width + j * n;
      Storage* __restrict destination = out + ((first + j) * m + row) * n;
      if (user_partials == nullptr) {
        round_from_float(candidate_part, destination, n);
        continue;
      }
      const float* __restrict user_part =
          user_partials + row * num_users * n + std::int64_t{cand_to_user[first + j]} * n;
      for (std::int64_t col = 0; col < n; ++col) {
        destination[col] = round_to<Storage>(candidate_part[col] + user_part[col]);
      }
    }
  }
}

template <typename Storage>
void run_lce(const LceArgs& args) {
  const LcePlan::State& plan = *args.plan;
  const std::int64_t m = plan.m, n = args.n, num_candidates = args.num_candidates;
  const bool has_user_term = plan.ku > 0;
  const std::int64_t num_users = has_user_term ? args.num_users : 0;
  const Weights w_c{static_cast<const float*>(plan.w_c), plan.ld_c, plan.kc};
  const Weights w_u{static_cast<const float*>(plan.w_u), plan.ld_u, plan.ku};

  const std::int64_t candidate_block = std::min(num_candidates, items_per_block(plan.kc, m, n));
  const std::int64_t user_block = std::min(num_users, items_per_block(plan.ku, m, n));
  std::unique_ptr<float[]> packed;
  if (!multiplied_in_place<Storage>(n)) {
    packed = std::make_unique_for_overwrite<float[]>(
        static_cast<std::size_t>(std::max(plan.kc * candidate_block, plan.ku * user_block) * n));
  }

  std::unique_ptr<float[]> user_partials;
  if (has_user_term) {
    user_partials =
        std::make_unique_for_overwrite<float[]>(static_cast<std::size_t>(m * num_users * n));
    const auto* e_u = static_cast<const Storage*>(args.e_u);
    for (std::int64_t first = 0; first < num_users; first += user_block) {
      const std::int64_t count = std::min(user_block, num_users - first);
      multiply_block(w_u, m, e_u, n, first, count, packed.get(), user_partials.get() + first * n,
                     num_users * n);
    }
  }

  auto product =
      std::make_unique_for_overwrite<float[]>(static_cast<std::size_t>(m * candidate_block * n));
  const auto* e_c = static_cast<const Storage*>(args.e_c);
  auto* out = static_cast<Storage*>(args.out);
  const std::int32_t* cand_to_user = has_user_term ? args.map->cand_to_user.data() : nullptr;
  for (std::int64_t first = 0; first < num_candidates; first += candidate_block) {
    const std::int64_t count = std::min(candidate_block, num_candidates - first);
    multiply_block(w_c, m, e_c, n, first, count, packed.get(), product.get(), count * n);
    store_block(product.get(), m, n, first, count, user_partials.get(), num_users, cand_to_user,
                out);
  }
}

}  // namespace

LcePlan::State prepare_lce_plan(DType dtype, std::int64_t m, std::int64_t ku, std::int64_t kc,
                                const void* w_c, const void* w_u) {
  LcePlan::State state;
  state.dtype = dtype;
  state.storage_dtype = DType::f32;
  state.device = Device::cpu();
  state.m = m;
  state.ku = ku;
  state.kc = kc;
  state.ld_c = round_up(kc, kWeightKAlignment);
  state.ld_u = ku > 0 ? round_up(ku, kWeightKAlignment) : 0;
  // Value-initialized, so the K padding is zero.
  auto storage = std::make_shared<float[]>(static_cast<std::size_t>(m * (state.ld_c + state.ld_u)));
  float* prepared_c = storage.get();
  float* prepared_u = prepared_c + m * state.ld_c;
  visit_storage(dtype, [&]<typename Storage>(Storage) {
    for (std::int64_t row = 0; row < m; ++row) {
      convert_to_float(static_cast<const Storage*>(w_c) + row * kc, prepared_c + row * state.ld_c,
                       kc);
      if (ku > 0) {
        convert_to_float(static_cast<const Storage*>(w_u) + row * ku, prepared_u + row * state.ld_u,
                         ku);
      }
    }
  });
  state.w_c = prepared_c;
  state.w_u = ku > 0 ? prepared_u : nullptr;
  state.storage = std::move(storage);
  return state;
}

void lce(const LceArgs& args) {
  visit_storage(args.plan->dtype, [&]<typename Storage>(Storage) { run_lce<Storage>(args); });
}

std::int64_t max_blas_extent() { return std::numeric_limits<blasint>::max(); }

}  // namespace ikbo::detail::cpu
