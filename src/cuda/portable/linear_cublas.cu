// src/cuda/portable/linear_cublas.cu — linear on cuBLAS, decomposed, for any
// sm_80+ GPU.
//
//   out[b] = x_c[b] @ w_c^T + x_u[cand_to_user[b]] @ w_u^T + bias
//
// prepare_linear_plan copies w_u [N_out, Ku] and w_c [N_out, Kc] once with
// each row's K padded to a multiple of 8 elements (16 bytes of fp16; zero
// padding), so every weight row starts 16-byte aligned; the bias is copied
// as given.
//
// linear runs, all on the caller's stream and workspace:
//   1. user partials [U, N_out] in fp32, once per user: a small kernel seeds
//      every row with the bias, then one GEMM accumulates x_u @ w_u^T onto
//      them (without a bias the GEMM just overwrites);
//   2. per chunk of candidates, the candidate GEMM into fp32 partials
//      [chunk, N_out], then one combine kernel
//      out[b] = round(candidate_partial[b] + user_partial[cand_to_user[b]]),
//      so both parts meet in fp32 and out is rounded once.
//
// Row-major -> cuBLAS column-major: out [rows, N_out] row-major is column-major
// [N_out, rows], computed as out^T = w (N_out x K) @ x^T (K x rows). The
// row-major weight [N_out, ld] reads as a column-major [ld, N_out] matrix
// used transposed, and x [rows, K] as a column-major [K, rows] one: the
// "TN" layout, with no copies.
//
// K alignment. cuBLAS's fast kernels want 16-byte aligned rows. Here K is
// the contiguous dimension of x, so x's row stride is K itself; when K is
// not a multiple of 8 (fp16) the rows of x are unaligned and cuBLAS picks
// slower kernels. LCE's remedy (lce_cublas.cu: cover the largest multiple of
// 8 of K, add the tail separately) shortens the reduction, not the row
// stride, so it does not help here; only a padded copy of x would, and that
// copy is not made.
//
// Dispatch: on a Hopper GPU (sm_90a code in the binary) linear goes to
// sm90/linear_sm90.cu whenever linear_sm90_eligible() accepts the call (f16
// or bf16, Kc and Ku multiples of 8, x_c and x_u 16-byte aligned; the rule
// is written out in linear_sm90.hpp): one Hopper launch computes the user partials, then
// runs the candidate GEMM and adds the user partial and the bias in its
// epilogue. Every other call, and every call with IKBO_DISABLE_SM90=1,
// runs the steps above (linear_decomposed, also the benchmark's
// "decomposed" variant).
//
// Workspace (each region 256-byte aligned; the API checks the caller's
// pointer is too): [user partials U*N_out fp32][candidate partials
// chunk*N_out fp32][cuBLAS scratch]. The Hopper path keeps its user
// partials in the first region and its counter at the start of the second,
// so linear_workspace_bytes serves both paths.
#include <algorithm>
#include <cstdint>

#include "backend.hpp"
#include "cuda/check.cuh"
#include "cuda/dtype.cuh"
#include "cuda/launch.cuh"
#include "cuda/runtime.cuh"
#include "cuda/sm90/linear_sm90.hpp"

namespace ikbo::detail::cuda {
namespace {

// Candidate partials are produced a chunk at a time so the workspace stays
// bounded for any B; 64 MiB holds 32K candidates at N_out = 512, so typical
// requests run as one GEMM.
constexpr std::size_t kCandidateChunkBytes = std::size_t{64} << 20;
struct WorkspaceLayout {
  std::int64_t chunk_candidates = 0;  // candidates per candidate-GEMM chunk
  std::size_t candidate_offset = 0;   // user partials start at offset 0
  std::size_t cublas_offset = 0;
  std::size_t total_bytes = 0;
};

WorkspaceLayout workspace_layout(const LinearPlan::State& plan, std::int64_t num_candidates,
                                 std::int64_t num_users) {
  const std::size_t row_bytes = static_cast<std::size_t>(plan.out_features) * sizeof(float);
  WorkspaceLayout layout;
  layout.chunk_candidates =
      std::clamp<std::int64_t>(static_cast<std::int64_t>(kCandidateChunkBytes / row_bytes), 1,
                               std::max<std::int64_t>(num_candidates, 1));
  layout.candidate_offset = align_bytes(static_cast<std::size_t>(num_users) * row_bytes);
  layout.cublas_offset = layout.candidate_offset +
                         align_bytes(static_cast<std::size_t>(layout.chunk_candidates) * row_bytes);
  layout.total_bytes = layout.cublas_offset + kCublasWorkspaceBytes;
  return layout;
}

// outputs [rows, N_out] (fp32, row-major) = x [rows, K] @ weight^T, or += with
// `accumulate`. weight is [N_out, K] with rows ld_weight elements apart.
void gemm_weight_transposed(cublasHandle_t handle, DType dtype, std::int64_t rows,
                            std::int64_t out_features, std::int64_t k, const void* x,
                            const void* weight, std::int64_t ld_weight, float* outputs,
                            bool accumulate) {
  const float alpha = 1.0f, beta = accumulate ? 1.0f : 0.0f;
  const cudaDataType_t input_type = cuda_data_type(dtype);
  IKBO_CUBLAS_CHECK(cublasGemmEx(
      handle, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(out_features), static_cast<int>(rows),
      static_cast<int>(k), &alpha, weight, input_type, static_cast<int>(ld_weight), x, input_type,
      static_cast<int>(k), &beta, outputs, CUDA_R_32F, static_cast<int>(out_features),
      CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

// user_partials[u, :] = bias for every user u < num_users.
template <typename Element>
__global__ void __launch_bounds__(kThreadsPerBlock)
    seed_with_bias_kernel(float* user_partials, const Element* bias, std::int64_t num_users,
                          std::int64_t out_features) {
  const std::int64_t row_step = static_cast<std::int64_t>(gridDim.y) * blockDim.y;
  const std::int64_t column_step = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t user = static_cast<std::int64_t>(blockIdx.y) * blockDim.y + threadIdx.y;
       user < num_users; user += row_step) {
    for (std::int64_t column = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
         column < out_features; column += column_step) {
      user_partials[user * out_features + column] = to_float(bias[column]);
    }
  }
}

template <typename Element>
void seed_with_bias(float* user_partials, const void* bias, std::int64_t num_users,
                    std::int64_t out_features, cudaStream_t stream) {
  const RowLaunch launch = row_launch(num_users, out_features);
  seed_with_bias_kernel<Element><<<launch.grid, launch.block, 0, stream>>>(
      user_partials, static_cast<const Element*>(bias), num_users, out_features);
  check_launch("seed_with_bias_kernel");
}

// For the candidates b = first_candidate + local, local < count, of one chunk:
//   out[b] = round(candidate_partials[local] + user_partials[cand_to_user[b]])
// over rows of N_out elements handled as vectors of kVector (kVector divides
// N_out, so a vector never straddles two rows). Rows walk along y, so the
// user lookup is one load per row, not per element.
template <typename Element, int kVector>
__global__ void __launch_bounds__(kThreadsPerBlock)
    combine_partials_kernel(Element* out, const float* candidate_partials,
                            const float* user_partials, const std::int32_t* cand_to_user,
                            std::int64_t first_candidate, std::int64_t count,
                            std::int64_t row_vectors) {
  using Partial = Vector<float, kVector>;
  using Output = Vector<Element, kVector>;
  const std::int64_t row_step = static_cast<std::int64_t>(gridDim.y) * blockDim.y;
  const std::int64_t vector_step = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t local = static_cast<std::int64_t>(blockIdx.y) * blockDim.y + threadIdx.y;
       local < count; local += row_step) {
    const std::int64_t candidate = first_candidate + local;
    const std::int64_t user = cand_to_user[candidate];
    const auto* candidate_row =
        reinterpret_cast<const Partial*>(candidate_partials) + local * row_vectors;
    const auto* user_row = reinterpret_cast<const Partial*>(user_partials) + user * row_vectors;
    auto* out_row = reinterpret_cast<Output*>(out) + candidate * row_vectors;
    for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
         i < row_vectors; i += vector_step) {
      const Partial candidate_part = candidate_row[i];
      const Partial user_part = user_row[i];
      Output result;
#pragma unroll
      for (int lane = 0; lane < kVector; ++lane) {
        result.lanes[lane] =
            from_float<Element>(candidate_part.lanes[lane] + user_part.lanes[lane]);
      }
      out_row[i] = result;
    }
  }
}

template <int kVector, typename Element>
void launch_combine_partials(Element* out, const float* candidate_partials,
                             const float* user_partials, const std::int32_t* cand_to_user,
                             std::int64_t out_features, std::int64_t first_candidate,
                             std::int64_t count, cudaStream_t stream) {
  const std::int64_t row_vectors = out_features / kVector;
  const RowLaunch launch = row_launch(count, row_vectors);
  combine_partials_kernel<Element, kVector><<<launch.grid, launch.block, 0, stream>>>(
      out, candidate_partials, user_partials, cand_to_user, first_candidate, count, row_vectors);
  check_launch("combine_partials_kernel");
}

template <typename Element>
void combine_partials(void* out, const float* candidate_partials, const float* user_partials,
                      const std::int32_t* cand_to_user, std::int64_t out_features,
                      std::int64_t first_candidate, std::int64_t count, cudaStream_t stream) {
  constexpr int kVector = 4;  // 16-byte fp32 loads
  auto* out_elements = static_cast<Element*>(out);
  // Partial regions are 256-byte aligned, so their rows are vector aligned
  // whenever N_out is a multiple of the vector; `out` is a caller's view and
  // may not be.
  const bool vectorizable =
      out_features % kVector == 0 &&
      reinterpret_cast<std::uintptr_t>(out) % (sizeof(Element) * kVector) == 0;
  if (vectorizable) {
    launch_combine_partials<kVector>(out_elements, candidate_partials, user_partials, cand_to_user,
                                     out_features, first_candidate, count, stream);
  } else {
    launch_combine_partials<1>(out_elements, candidate_partials, user_partials, cand_to_user,
                               out_features, first_candidate, count, stream);
  }
}

// Copies a row-major [rows, cols] matrix whose rows are `ld_src` elements
// apart into rows `ld_dst` elements apart.
void copy_rows(void* dst, std::int64_t ld_dst, const void* src, std::int64_t ld_src,
               std::int64_t rows, std::int64_t cols, std::size_t element_bytes,
               cudaStream_t stream) {
  IKBO_CUDA_CHECK(cudaMemcpy2DAsync(dst, static_cast<std::size_t>(ld_dst) * element_bytes, src,
                                    static_cast<std::size_t>(ld_src) * element_bytes,
                                    static_cast<std::size_t>(cols) * element_bytes,
                                    static_cast<std::size_t>(rows), cudaMemcpyDefault, stream));
}

}  // namespace

LinearPlan::State prepare_linear_plan(const LinearWeights& weights, Device device, Stream stream) {
  LinearPlan::State plan;
  plan.dtype = weights.dtype;
  plan.storage_dtype = weights.dtype;
  plan.device = device;
  plan.out_features = weights.out_features;
  plan.ku = weights.ku;
  plan.kc = weights.kc;
  plan.ld_u = round_up(weights.ku, kWeightKAlignment);
  plan.ld_c = round_up(weights.kc, kWeightKAlignment);
  const std::size_t element_bytes = dtype_size(weights.dtype);
  const auto out_features = static_cast<std::size_t>(weights.out_features);
  const std::size_t candidate_offset =
      align_bytes(out_features * static_cast<std::size_t>(plan.ld_u) * element_bytes);
  const std::size_t bias_offset =
      candidate_offset +
      align_bytes(out_features * static_cast<std::size_t>(plan.ld_c) * element_bytes);
  const std::size_t total_bytes =
      bias_offset + (weights.bias != nullptr ? out_features * element_bytes : 0);
  plan.storage = device::allocate(total_bytes, device);
  auto* storage = static_cast<char*>(plan.storage.get());
  plan.w_u = storage;
  plan.w_c = storage + candidate_offset;
  plan.bias = weights.bias != nullptr ? storage + bias_offset : nullptr;

  DeviceGuard guard(device.index);
  const cudaStream_t cuda_stream = to_cuda_stream(stream);
  // Zeroing everything first is simpler than zeroing only the K padding, and
  // a plan is prepared once.
  IKBO_CUDA_CHECK(cudaMemsetAsync(storage, 0, total_bytes, cuda_stream));
  copy_rows(storage, plan.ld_u, weights.w_u, weights.ld_w_u, weights.out_features, weights.ku,
            element_bytes, cuda_stream);
  copy_rows(storage + candidate_offset, plan.ld_c, weights.w_c, weights.ld_w_c,
            weights.out_features, weights.kc, element_bytes, cuda_stream);
  if (weights.bias != nullptr) {
    IKBO_CUDA_CHECK(cudaMemcpyAsync(storage + bias_offset, weights.bias,
                                    out_features * element_bytes, cudaMemcpyDefault, cuda_stream));
  }
  IKBO_CUDA_CHECK(cudaStreamSynchronize(cuda_stream));
  plan.weight_maps = linear_sm90_weight_maps(plan);
  return plan;
}

std::size_t linear_workspace_bytes(const LinearPlan::State& plan, std::int64_t num_candidates,
                                   std::int64_t num_users) {
  return workspace_layout(plan, num_candidates, num_users).total_bytes;
}

void linear_decomposed(const LinearArgs& args) {
  const LinearPlan::State& plan = *args.plan;
  if (args.num_candidates == 0) return;
  const WorkspaceLayout layout = workspace_layout(plan, args.num_candidates, args.num_users);
  DeviceGuard guard(plan.device.index);
  const cudaStream_t stream = to_cuda_stream(args.stream);
  auto* workspace = static_cast<char*>(args.workspace);
  CublasLease blas(plan.device, stream, workspace + layout.cublas_offset, kCublasWorkspaceBytes);
  auto* user_partials = reinterpret_cast<float*>(workspace);
  auto* candidate_partials = reinterpret_cast<float*>(workspace + layout.candidate_offset);
  const std::int32_t* cand_to_user = args.map->device_view.cand_to_user;

  dispatch_float_dtype(plan.dtype, [&](auto element) {
    using Element = decltype(element);
    const bool has_bias = plan.bias != nullptr;
    if (has_bias) {
      seed_with_bias<Element>(user_partials, plan.bias, args.num_users, plan.out_features, stream);
    }
    gemm_weight_transposed(blas.handle(), plan.dtype, args.num_users, plan.out_features, plan.ku,
                           args.x_u, plan.w_u, plan.ld_u, user_partials, has_bias);

    const auto* x_c = static_cast<const Element*>(args.x_c);
    for (std::int64_t first = 0; first < args.num_candidates; first += layout.chunk_candidates) {
      const std::int64_t count = std::min(layout.chunk_candidates, args.num_candidates - first);
      gemm_weight_transposed(blas.handle(), plan.dtype, count, plan.out_features, plan.kc,
                             x_c + first * plan.kc, plan.w_c, plan.ld_c, candidate_partials, false);
      combine_partials<Element>(args.out, candidate_partials, user_partials, cand_to_user,
                                plan.out_features, first, count, stream);
    }
  });
}

void linear(const LinearArgs& args) {
  if (args.num_candidates == 0) return;
  if (!linear_sm90_eligible(args)) {
    linear_decomposed(args);
    return;
  }
  const WorkspaceLayout layout = workspace_layout(*args.plan, args.num_candidates, args.num_users);
  auto* workspace = static_cast<char*>(args.workspace);
  linear_sm90(args, {reinterpret_cast<float*>(workspace),
                     reinterpret_cast<int*>(workspace + layout.candidate_offset)});
}

}  // namespace ikbo::detail::cuda
