// CPU backend of linear:  out[b] = x_c[b] @ w_c^T + x_u[u(b)] @ w_u^T + bias,  via OpenBLAS sgemm.
//
// Layouts: w_u [N_out, Ku], w_c [N_out, Kc] (torch's out x in layout,
// prepared once as fp32 with the K stride padded to kWeightKAlignment with
// zeros), bias [N_out] fp32 or none; x_c [B, Kc], x_u [U, Ku] and
// out [B, N_out] in the plan's dtype (f16, bf16 or f32), all row-major.
//
// The in-kernel broadcast, CPU style:
//  1. User partials P[U, N_out] = x_u @ w_u^T + bias in fp32, computed once
//     per user: P's rows start as the bias and the sgemm accumulates onto it.
//  2. Candidates in blocks of rows: one sgemm [count, Kc] x [Kc, N_out]
//     per block into an fp32 product, then the epilogue
//     out[b] = round(product[b] + P[u(b)]), the two fp32 partials summed
//     before the single rounding to the output dtype.
// f16/bf16 rows are converted to fp32 a block at a time (the blocks bound
// the scratch and keep the product cache resident for the epilogue); f32
// rows go to sgemm in place.
//
// Threading: OpenBLAS threads each sgemm. The conversion and the epilogue
// run on OpenMP only where OpenBLAS is the OpenMP build (see
// blas_uses_openmp), never inside a BLAS call or around one.
#include <algorithm>
#include <cstdint>
#include <memory>
#include <type_traits>

#include "backend.hpp"
#include "cpu/blas.hpp"
#include "cpu/convert.hpp"

namespace ikbo::detail::cpu {
namespace {

// Budget for the larger of a block's two fp32 buffers (converted rows,
// product): wide enough for an efficient GEMM, small enough to stay in the
// outer caches between the GEMM and the epilogue.
constexpr std::int64_t kBlockBudgetBytes = std::int64_t{4} << 20;

// How many rows of K inputs and N_out outputs one block holds within kBlockBudgetBytes.
std::int64_t rows_per_block(std::int64_t k, std::int64_t out_features) {
  const std::int64_t bytes_per_row = std::max(k, out_features) * std::int64_t{sizeof(float)};
  return std::max<std::int64_t>(1, kBlockBudgetBytes / bytes_per_row);
}

// Rows [first, first + count) of the row-major [rows, K] matrix x as fp32
// rows K apart: x itself for fp32, else converted into `converted`.
template <typename Storage>
const float* rows_as_float(const Storage* x, std::int64_t k, std::int64_t first, std::int64_t count,
                           float* converted) {
  if constexpr (std::is_same_v<Storage, float>) {
    return x + first * k;
  } else {
#pragma omp parallel for schedule(static) if (parallel_elementwise(count * k))
    for (std::int64_t row = 0; row < count; ++row) {
      convert_to_float(x + (first + row) * k, converted + row * k, k);
    }
    return converted;
  }
}

template <typename Storage>
void run_linear(const LinearArgs& args) {
  const LinearPlan::State& plan = *args.plan;
  const std::int64_t out_features = plan.out_features, ku = plan.ku, kc = plan.kc;
  const std::int64_t num_users = args.num_users, num_candidates = args.num_candidates;
  const auto* w_u = static_cast<const float*>(plan.w_u);
  const auto* w_c = static_cast<const float*>(plan.w_c);
  const auto* bias = static_cast<const float*>(plan.bias);

  const std::int64_t user_block = std::min(num_users, rows_per_block(ku, out_features));
  const std::int64_t candidate_block = std::min(num_candidates, rows_per_block(kc, out_features));
  std::unique_ptr<float[]> converted;
  if constexpr (!std::is_same_v<Storage, float>) {
    converted = std::make_unique_for_overwrite<float[]>(
        static_cast<std::size_t>(std::max(ku * user_block, kc * candidate_block)));
  }

  auto user_partials =
      std::make_unique_for_overwrite<float[]>(static_cast<std::size_t>(num_users * out_features));
  if (bias != nullptr) {
#pragma omp parallel for schedule(static) if (parallel_elementwise(num_users * out_features))
    for (std::int64_t user = 0; user < num_users; ++user) {
      std::copy_n(bias, out_features, user_partials.get() + user * out_features);
    }
  }
  const auto* x_u = static_cast<const Storage*>(args.x_u);
  for (std::int64_t first = 0; first < num_users; first += user_block) {
    const std::int64_t count = std::min(user_block, num_users - first);
    gemm_f32(count, out_features, ku, 1.0f, rows_as_float(x_u, ku, first, count, converted.get()),
             ku, w_u, plan.ld_u, Transpose::yes, bias != nullptr ? 1.0f : 0.0f,
             user_partials.get() + first * out_features, out_features);
  }

  auto product = std::make_unique_for_overwrite<float[]>(
      static_cast<std::size_t>(candidate_block * out_features));
  const auto* x_c = static_cast<const Storage*>(args.x_c);
  auto* out = static_cast<Storage*>(args.out);
  const std::int32_t* cand_to_user = args.map->cand_to_user.data();
  for (std::int64_t first = 0; first < num_candidates; first += candidate_block) {
    const std::int64_t count = std::min(candidate_block, num_candidates - first);
    gemm_f32(count, out_features, kc, 1.0f, rows_as_float(x_c, kc, first, count, converted.get()),
             kc, w_c, plan.ld_c, Transpose::yes, 0.0f, product.get(), out_features);
#pragma omp parallel for schedule(static) if (parallel_elementwise(count * out_features))
    for (std::int64_t row = 0; row < count; ++row) {
      const float* __restrict candidate_part = product.get() + row * out_features;
      const float* __restrict user_part =
          user_partials.get() + std::int64_t{cand_to_user[first + row]} * out_features;
      Storage* __restrict destination = out + (first + row) * out_features;
      for (std::int64_t column = 0; column < out_features; ++column) {
        destination[column] = round_to<Storage>(candidate_part[column] + user_part[column]);
      }
    }
  }
}

}  // namespace

LinearPlan::State prepare_linear_plan(const LinearWeights& weights) {
  LinearPlan::State state;
  state.dtype = weights.dtype;
  state.storage_dtype = DType::f32;
  state.device = Device::cpu();
  state.out_features = weights.out_features;
  state.ku = weights.ku;
  state.kc = weights.kc;
  state.ld_u = round_up(weights.ku, kWeightKAlignment);
  state.ld_c = round_up(weights.kc, kWeightKAlignment);
  const std::int64_t out_features = weights.out_features;
  const std::int64_t bias_elements = weights.bias != nullptr ? out_features : 0;
  // Value-initialized, so the K padding is zero.
  auto storage = std::make_shared<float[]>(
      static_cast<std::size_t>(out_features * (state.ld_u + state.ld_c) + bias_elements));
  float* prepared_u = storage.get();
  float* prepared_c = prepared_u + out_features * state.ld_u;
  float* prepared_bias = prepared_c + out_features * state.ld_c;
  visit_storage(weights.dtype, [&]<typename Storage>(Storage) {
    const auto* w_u = static_cast<const Storage*>(weights.w_u);
    const auto* w_c = static_cast<const Storage*>(weights.w_c);
    for (std::int64_t row = 0; row < out_features; ++row) {
      convert_to_float(w_u + row * weights.ld_w_u, prepared_u + row * state.ld_u, weights.ku);
      convert_to_float(w_c + row * weights.ld_w_c, prepared_c + row * state.ld_c, weights.kc);
    }
    if (weights.bias != nullptr) {
      convert_to_float(static_cast<const Storage*>(weights.bias), prepared_bias, out_features);
    }
  });
  state.w_u = prepared_u;
  state.w_c = prepared_c;
  state.bias = weights.bias != nullptr ? prepared_bias : nullptr;
  state.storage = std::move(storage);
  return state;
}

void linear(const LinearArgs& args) {
  visit_storage(args.plan->dtype, [&]<typename Storage>(Storage) { run_linear<Storage>(args); });
}

namespace {

// The broadcast baseline's GEMM as torch's F.linear runs it on the CPU (one
// GEMM onto the bias): out = x_full @ weight^T + bias in fp32, in blocks of
// rows as above, rounded once. f16/bf16 weights are converted per call.
template <typename Storage>
void run_linear_concat(const LinearConcatArgs& args) {
  const std::int64_t out_features = args.out_features, k = args.k, rows = args.num_candidates;
  const auto* weight = static_cast<const Storage*>(args.weight);
  const auto* bias = static_cast<const Storage*>(args.bias);
  std::unique_ptr<float[]> weight_f32, bias_f32;
  const float* weight_rows = nullptr;
  const float* bias_row = nullptr;
  std::int64_t ld_weight = args.ld_weight;
  if constexpr (std::is_same_v<Storage, float>) {
    weight_rows = weight;
    bias_row = bias;
  } else {
    weight_f32 = std::make_unique_for_overwrite<float[]>(static_cast<std::size_t>(out_features * k));
    for (std::int64_t row = 0; row < out_features; ++row) {
      convert_to_float(weight + row * args.ld_weight, weight_f32.get() + row * k, k);
    }
    weight_rows = weight_f32.get();
    ld_weight = k;
    if (bias != nullptr) {
      bias_f32 = std::make_unique_for_overwrite<float[]>(static_cast<std::size_t>(out_features));
      convert_to_float(bias, bias_f32.get(), out_features);
      bias_row = bias_f32.get();
    }
  }

  const std::int64_t block = std::min(rows, rows_per_block(k, out_features));
  std::unique_ptr<float[]> converted, product_f32;
  if constexpr (!std::is_same_v<Storage, float>) {
    converted = std::make_unique_for_overwrite<float[]>(static_cast<std::size_t>(block * k));
    product_f32 =
        std::make_unique_for_overwrite<float[]>(static_cast<std::size_t>(block * out_features));
  }
  const auto* x_full = static_cast<const Storage*>(args.x_full);
  auto* out = static_cast<Storage*>(args.out);
  for (std::int64_t first = 0; first < rows; first += block) {
    const std::int64_t count = std::min(block, rows - first);
    float* product = nullptr;
    if constexpr (std::is_same_v<Storage, float>) {
      product = out + first * out_features;  // fp32 output: the GEMM writes it in place
    } else {
      product = product_f32.get();
    }
    if (bias_row != nullptr) {
#pragma omp parallel for schedule(static) if (parallel_elementwise(count * out_features))
      for (std::int64_t row = 0; row < count; ++row) {
        std::copy_n(bias_row, out_features, product + row * out_features);
      }
    }
    gemm_f32(count, out_features, k, 1.0f, rows_as_float(x_full, k, first, count, converted.get()),
             k, weight_rows, ld_weight, Transpose::yes, bias_row != nullptr ? 1.0f : 0.0f,
             product, out_features);
    if constexpr (!std::is_same_v<Storage, float>) {
#pragma omp parallel for schedule(static) if (parallel_elementwise(count * out_features))
      for (std::int64_t row = 0; row < count; ++row) {
        round_from_float(product + row * out_features, out + (first + row) * out_features,
                         out_features);
      }
    }
  }
}

}  // namespace

void linear_concat(const LinearConcatArgs& args) {
  visit_storage(args.dtype, [&]<typename Storage>(Storage) { run_linear_concat<Storage>(args); });
}

}  // namespace ikbo::detail::cpu
