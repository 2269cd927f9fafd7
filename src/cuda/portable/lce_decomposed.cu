// src/cuda/portable/lce_decomposed.cu — the "decomposed" and "aligned"
// stages of the published LCE staircase, kept as benchmark baselines; the
// library's own path is lce_cublas.cu / sm90/lce_sm90.cu.
//
//   user_out[u] = round(w_u @ e_u[u])      one strided-batched cuBLAS GEMM over U
//   out[b]      = round(w_c @ e_c[b])      one strided-batched cuBLAS GEMM over B
//   out[b]      = round(out[b] + user_out[cand_to_user[b]])   gather_add_kernel
//
// As PyTorch would run it: fp32 accumulation, outputs in the inputs' dtype,
// so each partial is rounded and their sum rounded again (the published
// kernels' two roundings; the library rounds once). The GEMMs run on the
// caller's K and weight rows as given: at K = 866 or 1178 (fp16) the rows
// are not 16-byte aligned and cuBLAS falls back to slow kernels, which is
// what this stage shows. The "aligned" stage is the same call on copies with
// K zero-padded to a multiple of 8, made beforehand by the caller.
//
// gather_add_kernel: one row of M * N elements per candidate, read and
// written as 16-byte vectors when the row size and both pointers allow;
// blockIdx.y walks candidates, so the user lookup is one load per row.
//
// Workspace (256-byte aligned by the API): [user_out U*M*N][cuBLAS scratch].
#include <algorithm>
#include <cstdint>

#include "backend.hpp"
#include "cuda/check.cuh"
#include "cuda/dtype.cuh"
#include "cuda/launch.cuh"
#include "cuda/portable/batched_gemm.cuh"
#include "cuda/runtime.cuh"

namespace ikbo::detail::cuda {
namespace {

template <typename Element, int kVector>
__global__ void __launch_bounds__(kThreadsPerBlock)
    gather_add_kernel(Element* out, const Element* user_out, const std::int32_t* cand_to_user,
                      std::int64_t num_candidates, std::int64_t row_vectors) {
  using Row = Vector<Element, kVector>;
  const std::int64_t candidate_step = static_cast<std::int64_t>(gridDim.y) * blockDim.y;
  const std::int64_t vector_step = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t candidate = static_cast<std::int64_t>(blockIdx.y) * blockDim.y + threadIdx.y;
       candidate < num_candidates; candidate += candidate_step) {
    auto* out_row = reinterpret_cast<Row*>(out) + candidate * row_vectors;
    const auto* user_row =
        reinterpret_cast<const Row*>(user_out) + cand_to_user[candidate] * row_vectors;
    for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
         i < row_vectors; i += vector_step) {
      Row sum = out_row[i];
      const Row user_part = user_row[i];
#pragma unroll
      for (int lane = 0; lane < kVector; ++lane) {
        sum.lanes[lane] =
            from_float<Element>(to_float(sum.lanes[lane]) + to_float(user_part.lanes[lane]));
      }
      out_row[i] = sum;
    }
  }
}

template <typename Element, int kVector>
void launch_gather_add(void* out, const void* user_out, const std::int32_t* cand_to_user,
                       std::int64_t num_candidates, std::int64_t row_elements,
                       cudaStream_t stream) {
  const std::int64_t row_vectors = row_elements / kVector;
  const RowLaunch launch = row_launch(num_candidates, row_vectors);
  gather_add_kernel<Element, kVector><<<launch.grid, launch.block, 0, stream>>>(
      static_cast<Element*>(out), static_cast<const Element*>(user_out), cand_to_user,
      num_candidates, row_vectors);
  check_launch("gather_add_kernel");
}

// out[b] = round(out[b] + user_out[cand_to_user[b]]), rows of `row_elements`.
void gather_add(DType dtype, void* out, const void* user_out, const std::int32_t* cand_to_user,
                std::int64_t num_candidates, std::int64_t row_elements, cudaStream_t stream) {
  dispatch_float_dtype(dtype, [&](auto element) {
    using Element = decltype(element);
    constexpr int kVector = 16 / sizeof(Element);
    const std::size_t vector_bytes = sizeof(Element) * kVector;
    const bool vectorizable = row_elements % kVector == 0 &&
                              reinterpret_cast<std::uintptr_t>(out) % vector_bytes == 0 &&
                              reinterpret_cast<std::uintptr_t>(user_out) % vector_bytes == 0;
    if (vectorizable) {
      launch_gather_add<Element, kVector>(out, user_out, cand_to_user, num_candidates, row_elements,
                                          stream);
    } else {
      launch_gather_add<Element, 1>(out, user_out, cand_to_user, num_candidates, row_elements,
                                    stream);
    }
  });
}

std::size_t user_out_bytes(DType dtype, std::int64_t m, std::int64_t n, std::int64_t num_users) {
  return align_bytes(static_cast<std::size_t>(num_users * m * n) * dtype_size(dtype));
}

}  // namespace

std::size_t lce_decomposed_workspace_bytes(DType dtype, std::int64_t m, std::int64_t n,
                                           std::int64_t num_users) {
  return user_out_bytes(dtype, m, n, num_users) + kCublasWorkspaceBytes;
}

void lce_decomposed(const LceDecomposedArgs& args) {
  if (args.num_candidates == 0) return;
  DeviceGuard guard(args.device.index);
  const cudaStream_t stream = to_cuda_stream(args.stream);
  const std::size_t user_bytes = user_out_bytes(args.dtype, args.m, args.n, args.num_users);
  auto* workspace = static_cast<char*>(args.workspace);
  const std::size_t cublas_bytes =
      std::min(args.workspace_bytes - user_bytes, kCublasWorkspaceBytes);
  CublasLease blas(args.device, stream, cublas_bytes > 0 ? workspace + user_bytes : nullptr,
                   cublas_bytes);
  // output[i] = round(weight @ inputs[i]): weight [M, K] with rows K apart,
  // inputs [batch, K, N], outputs [batch, M, N], all in the dtype.
  const auto gemm = [&](const void* weight, std::int64_t k, const void* inputs, void* outputs,
                        std::int64_t batch) {
    run_batched_gemm(blas.handle(), args.dtype,
                     {.m = args.m,
                      .n = args.n,
                      .k = k,
                      .weight = weight,
                      .ld_weight = k,
                      .inputs = inputs,
                      .input_stride = k * args.n,
                      .outputs = outputs,
                      .output_type = cuda_data_type(args.dtype),
                      .batch = batch});
  };
  gemm(args.w_u, args.ku, args.e_u, workspace, args.num_users);
  gemm(args.w_c, args.kc, args.e_c, args.out, args.num_candidates);
  gather_add(args.dtype, args.out, workspace, args.cand_to_user, args.num_candidates,
             args.m * args.n, stream);
}

}  // namespace ikbo::detail::cuda
