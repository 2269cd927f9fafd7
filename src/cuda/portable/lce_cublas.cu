// src/cuda/portable/lce_cublas.cu — LCE on cuBLAS, the published stages 1–2
// (decomposition + K alignment) for any sm_80+ GPU.
//
//   out[b] = w_c @ e_c[b] + w_u @ e_u[cand_to_user[b]]
//
// prepare_lce_plan copies the weights once with each row's K padded to a
// multiple of 8 elements (16 bytes of fp16; zero padding is exact), so every
// weight row starts 16-byte aligned.
//
// lce runs, all on the caller's stream and workspace:
//   1. the user GEMM once per user (strided-batched over U) into fp32
//      partials [U, M, N];
//   2. per chunk of candidates, the candidate GEMM (strided-batched, fp32
//      partials [chunk, M, N]), then one combine kernel
//      out[b] = round(candidate_partial[b] + user_partial[cand_to_user[b]]),
//      so both partials meet in fp32 and the result is rounded once.
// With plan.ku == 0 (the broadcast baseline's concatenated GEMM) cuBLAS
// writes `out` directly in its dtype, over the full K.
//
// Dispatch: on a Hopper GPU (compute capability 9.0, sm_90a code in the
// binary) lce goes to the TMA + wgmma path of sm90/lce_sm90.cu whenever
// lce_sm90_eligible() accepts the call (f16/bf16, a user term, N a multiple
// of 8, 16-byte aligned tensors); everything else, and every call with
// IKBO_DISABLE_SM90=1, runs here. lce_workspace_bytes covers both paths.
//
// K split. cuBLAS's fast kernels need the reduction length itself to be a
// multiple of 8, not just aligned weight rows: on an H200 the candidate GEMM
// of the reference shape takes 0.98 ms at K = 866 and 0.30 ms at K = 872. The
// inputs are the caller's and cannot be padded without a copy, and running
// the GEMM over the padded K would read the next candidate's rows (0 * Inf is
// NaN; past the end for the last one). So each GEMM covers the largest
// multiple of 8 of K, and the at most 7 remaining rows are added in fp32: for
// the user part by a second, tiny cuBLAS call accumulating into the fp32
// partials, for the candidate part inside the combine kernel, which reads
// those few rows of e_c and columns of w_c (both cache resident).
//
// The GEMMs are strided-batched cuBLAS calls (batched_gemm.cuh).
//
// Workspace (each region 256-byte aligned, plus slack to align the caller's
// pointer): [user partials U*M*N fp32][candidate partials chunk*M*N fp32]
// [cuBLAS scratch].
#include <algorithm>
#include <cstdint>

#include "backend.hpp"
#include "cuda/check.cuh"
#include "cuda/dtype.cuh"
#include "cuda/launch.cuh"
#include "cuda/portable/batched_gemm.cuh"
#include "cuda/runtime.cuh"
#include "cuda/sm90/lce_sm90.hpp"

namespace ikbo::detail::cuda {
namespace {

// Candidate partials are produced a chunk at a time so the workspace stays
// bounded for any B. Each chunk costs a GEMM launch with its own partial last
// wave, and small chunks measured slower (H200, reference shape, all of B in
// chunks of 75 candidates: 23% slower than in chunks of 302), so the bound is
// generous: 64 MiB is 151 candidates at M = 433, N = 256, ~9 waves of tiles.
constexpr std::size_t kCandidateChunkBytes = std::size_t{64} << 20;
// cuBLAS's fast kernels want the GEMM's K to be a multiple of this.
constexpr std::int64_t kGemmKMultiple = 8;
struct WorkspaceLayout {
  std::int64_t chunk_candidates = 0;  // candidates per candidate-GEMM chunk
  std::size_t user_offset = 0;        // offsets from the aligned workspace start
  std::size_t candidate_offset = 0;
  std::size_t cublas_offset = 0;
  std::size_t total_bytes = 0;  // what the caller must provide
};

WorkspaceLayout workspace_layout(const LcePlan::State& plan, std::int64_t n,
                                 std::int64_t num_candidates, std::int64_t num_users) {
  WorkspaceLayout layout;
  if (plan.ku > 0) {
    const auto partial_bytes = static_cast<std::size_t>(plan.m * n) * sizeof(float);
    layout.chunk_candidates =
        std::clamp<std::int64_t>(static_cast<std::int64_t>(kCandidateChunkBytes / partial_bytes), 1,
                                 std::max<std::int64_t>(num_candidates, 1));
    layout.candidate_offset = align_bytes(static_cast<std::size_t>(num_users) * partial_bytes);
    layout.cublas_offset =
        layout.candidate_offset +
        align_bytes(static_cast<std::size_t>(layout.chunk_candidates) * partial_bytes);
  }
  layout.total_bytes = layout.cublas_offset + kCublasWorkspaceBytes + kWorkspaceAlignment;
  return layout;
}

// K = main + tail, main a multiple of kGemmKMultiple. Below that multiple
// nothing is split (tiny K, where the split would only add work).
struct KSplit {
  std::int64_t main = 0;
  std::int64_t tail = 0;
};

KSplit split_k(std::int64_t k) {
  const std::int64_t tail = k % kGemmKMultiple;
  return k > tail ? KSplit{k - tail, tail} : KSplit{k, 0};
}

const void* advance(const void* pointer, std::int64_t elements, DType dtype) {
  return static_cast<const char*>(pointer) +
         elements * static_cast<std::int64_t>(dtype_size(dtype));
}

// The K rows of the candidate GEMM left to the combine kernel (count < 8).
template <typename Element>
struct CandidateTail {
  // w_c + main: tail column t of weight row m at [m * ld_weights + t].
  const Element* weights = nullptr;
  std::int64_t ld_weights = 0;
  // e_c + main * N: tail row t of candidate b at [b * input_stride + t * N].
  const Element* inputs = nullptr;
  std::int64_t input_stride = 0;
  int count = 0;
};

// For the i < count candidates b = first + i of one chunk:
//   out[b] = round(candidate_partials[i] + tail(b) + user_partials[cand_to_user[b]])
// over rows of M * N elements handled as vectors of kVector (kVector divides
// N, so a vector never straddles two output rows). blockIdx.y walks
// candidates, so the user lookup is one load per row, not per element.
template <typename Element, int kVector>
__global__ void __launch_bounds__(kThreadsPerBlock)
    combine_partials_kernel(Element* out, const float* candidate_partials,
                            const float* user_partials, const std::int32_t* cand_to_user,
                            const CandidateTail<Element> tail, std::int64_t n,
                            std::int64_t first_candidate, std::int64_t count,
                            std::int64_t row_vectors) {
  using Partial = Vector<float, kVector>;
  using Output = Vector<Element, kVector>;
  const std::int64_t vector_step = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t local = blockIdx.y; local < count; local += gridDim.y) {
    const std::int64_t candidate = first_candidate + local;
    const std::int64_t user = cand_to_user[candidate];
    const auto* candidate_row =
        reinterpret_cast<const Partial*>(candidate_partials) + local * row_vectors;
    const auto* user_row = reinterpret_cast<const Partial*>(user_partials) + user * row_vectors;
    auto* out_row = reinterpret_cast<Output*>(out) + candidate * row_vectors;
    const Element* tail_inputs = tail.inputs + candidate * tail.input_stride;
    for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
         i < row_vectors; i += vector_step) {
      const Partial candidate_part = candidate_row[i];
      const Partial user_part = user_row[i];
      float sum[kVector];
#pragma unroll
      for (int lane = 0; lane < kVector; ++lane) sum[lane] = candidate_part.lanes[lane];
      if (tail.count > 0) {
        const std::int64_t row = i * kVector / n, column = i * kVector - row * n;
        for (int t = 0; t < tail.count; ++t) {
          const float weight = to_float(tail.weights[row * tail.ld_weights + t]);
          const Element* input = tail_inputs + t * n + column;
#pragma unroll
          for (int lane = 0; lane < kVector; ++lane) sum[lane] += weight * to_float(input[lane]);
        }
      }
      Output result;
#pragma unroll
      for (int lane = 0; lane < kVector; ++lane) {
        result.lanes[lane] = from_float<Element>(sum[lane] + user_part.lanes[lane]);
      }
      out_row[i] = result;
    }
  }
}

template <int kVector, typename Element>
void launch_combine_partials(Element* out, const float* candidate_partials,
                             const float* user_partials, const std::int32_t* cand_to_user,
                             const CandidateTail<Element>& tail, std::int64_t m, std::int64_t n,
                             std::int64_t first_candidate, std::int64_t count,
                             cudaStream_t stream) {
  const std::int64_t row_vectors = m * n / kVector;
  const dim3 grid(static_cast<unsigned>(
                      std::min(kMaxGridX, (row_vectors + kThreadsPerBlock - 1) / kThreadsPerBlock)),
                  static_cast<unsigned>(std::min(kMaxGridY, count)));
  combine_partials_kernel<Element, kVector>
      <<<grid, kThreadsPerBlock, 0, stream>>>(out, candidate_partials, user_partials, cand_to_user,
                                              tail, n, first_candidate, count, row_vectors);
  check_launch("combine_partials_kernel");
}

template <typename Element>
void combine_partials(void* out, const float* candidate_partials, const float* user_partials,
                      const std::int32_t* cand_to_user, const CandidateTail<Element>& tail,
                      std::int64_t m, std::int64_t n, std::int64_t first_candidate,
                      std::int64_t count, cudaStream_t stream) {
  constexpr int kVector = 4;  // 16-byte fp32 loads
  auto* out_elements = static_cast<Element*>(out);
  // Partial regions are 256-byte aligned, so their rows are vector aligned
  // whenever N is a multiple of the vector; `out` is a caller's view and may
  // not be.
  const bool vectorizable =
      n % kVector == 0 && reinterpret_cast<std::uintptr_t>(out) % (sizeof(Element) * kVector) == 0;
  if (vectorizable) {
    launch_combine_partials<kVector>(out_elements, candidate_partials, user_partials, cand_to_user,
                                     tail, m, n, first_candidate, count, stream);
  } else {
    launch_combine_partials<1>(out_elements, candidate_partials, user_partials, cand_to_user, tail,
                               m, n, first_candidate, count, stream);
  }
}

// Copies a row-major [rows, cols] matrix into rows `ld` elements apart.
void copy_padded_rows(void* dst, std::int64_t ld, const void* src, std::int64_t rows,
                      std::int64_t cols, std::size_t element_bytes, cudaStream_t stream) {
  IKBO_CUDA_CHECK(cudaMemcpy2DAsync(dst, static_cast<std::size_t>(ld) * element_bytes, src,
                                    static_cast<std::size_t>(cols) * element_bytes,
                                    static_cast<std::size_t>(cols) * element_bytes,
                                    static_cast<std::size_t>(rows), cudaMemcpyDefault, stream));
}

}  // namespace

LcePlan::State prepare_lce_plan(DType dtype, Device device, std::int64_t m, std::int64_t ku,
                                std::int64_t kc, const void* w_c, const void* w_u, Stream stream) {
  LcePlan::State plan;
  plan.dtype = dtype;
  plan.storage_dtype = dtype;
  plan.device = device;
  plan.m = m;
  plan.ku = ku;
  plan.kc = kc;
  plan.ld_c = round_up(kc, kWeightKAlignment);
  plan.ld_u = ku > 0 ? round_up(ku, kWeightKAlignment) : 0;
  const std::size_t element_bytes = dtype_size(dtype);
  const std::size_t user_offset =
      align_bytes(static_cast<std::size_t>(m * plan.ld_c) * element_bytes);
  const std::size_t total_bytes =
      user_offset + static_cast<std::size_t>(m * plan.ld_u) * element_bytes;
  plan.storage = device::allocate(total_bytes, device);
  auto* storage = static_cast<char*>(plan.storage.get());
  plan.w_c = storage;
  plan.w_u = ku > 0 ? storage + user_offset : nullptr;

  DeviceGuard guard(device.index);
  const cudaStream_t cuda_stream = to_cuda_stream(stream);
  // Zeroing everything first is simpler than zeroing only the K padding, and
  // a plan is prepared once.
  IKBO_CUDA_CHECK(cudaMemsetAsync(storage, 0, total_bytes, cuda_stream));
  copy_padded_rows(storage, plan.ld_c, w_c, m, kc, element_bytes, cuda_stream);
  if (ku > 0) {
    copy_padded_rows(storage + user_offset, plan.ld_u, w_u, m, ku, element_bytes, cuda_stream);
  }
  IKBO_CUDA_CHECK(cudaStreamSynchronize(cuda_stream));
  plan.weight_maps = lce_sm90_weight_maps(plan);
  return plan;
}

std::size_t lce_workspace_bytes(const LcePlan::State& plan, std::int64_t n,
                                std::int64_t num_candidates, std::int64_t num_users) {
  const std::size_t cublas_bytes = workspace_layout(plan, n, num_candidates, num_users).total_bytes;
  if (!lce_sm90_supported(plan, n, num_candidates, num_users)) return cublas_bytes;
  return std::max(cublas_bytes, lce_sm90_workspace_bytes(plan, n, num_users));
}

void lce(const LceArgs& args) {
  const LcePlan::State& plan = *args.plan;
  if (args.num_candidates == 0) return;
  if (lce_sm90_eligible(args)) {
    lce_sm90(args);
    return;
  }
  const WorkspaceLayout layout =
      workspace_layout(plan, args.n, args.num_candidates, args.num_users);
  DeviceGuard guard(plan.device.index);
  const cudaStream_t stream = to_cuda_stream(args.stream);

  // Align the caller's pointer; whatever lies past the fixed regions (up to
  // kCublasWorkspaceBytes) becomes cuBLAS scratch. A caller that skipped
  // lce_workspace_bytes (the internal baselines may) still gets correct
  // results, with cuBLAS restricted to scratch-free algorithms.
  const auto start = reinterpret_cast<std::uintptr_t>(args.workspace);
  const std::uintptr_t aligned_start =
      (start + kWorkspaceAlignment - 1) / kWorkspaceAlignment * kWorkspaceAlignment;
  const std::uintptr_t end = start + args.workspace_bytes;
  char* workspace = reinterpret_cast<char*>(aligned_start);
  const std::uintptr_t cublas_start = aligned_start + layout.cublas_offset;
  const std::size_t cublas_bytes =
      start != 0 && end > cublas_start
          ? std::min<std::size_t>(end - cublas_start, kCublasWorkspaceBytes)
          : 0;
  CublasLease blas(plan.device, stream,
                   cublas_bytes > 0 ? workspace + layout.cublas_offset : nullptr, cublas_bytes);

  if (plan.ku == 0) {
    run_batched_gemm(blas.handle(), plan.dtype,
                     {.m = plan.m,
                      .n = args.n,
                      .k = plan.kc,
                      .weight = plan.w_c,
                      .ld_weight = plan.ld_c,
                      .inputs = args.e_c,
                      .input_stride = plan.kc * args.n,
                      .outputs = args.out,
                      .output_type = cuda_data_type(plan.dtype),
                      .batch = args.num_candidates});
    return;
  }

  auto* user_partials = reinterpret_cast<float*>(workspace + layout.user_offset);
  auto* candidate_partials = reinterpret_cast<float*>(workspace + layout.candidate_offset);
  const KSplit user_k = split_k(plan.ku);
  BatchedGemm user_gemm{.m = plan.m,
                        .n = args.n,
                        .k = user_k.main,
                        .weight = plan.w_u,
                        .ld_weight = plan.ld_u,
                        .inputs = args.e_u,
                        .input_stride = plan.ku * args.n,
                        .outputs = user_partials,
                        .output_type = CUDA_R_32F,
                        .batch = args.num_users};
  run_batched_gemm(blas.handle(), plan.dtype, user_gemm);
  if (user_k.tail > 0) {
    user_gemm.k = user_k.tail;
    user_gemm.weight = advance(plan.w_u, user_k.main, plan.dtype);
    user_gemm.inputs = advance(args.e_u, user_k.main * args.n, plan.dtype);
    user_gemm.accumulate = true;
    run_batched_gemm(blas.handle(), plan.dtype, user_gemm);
  }

  const KSplit candidate_k = split_k(plan.kc);
  const std::int64_t input_stride = plan.kc * args.n;
  for (std::int64_t first = 0; first < args.num_candidates; first += layout.chunk_candidates) {
    const std::int64_t count = std::min(layout.chunk_candidates, args.num_candidates - first);
    run_batched_gemm(blas.handle(), plan.dtype,
                     {.m = plan.m,
                      .n = args.n,
                      .k = candidate_k.main,
                      .weight = plan.w_c,
                      .ld_weight = plan.ld_c,
                      .inputs = advance(args.e_c, first * input_stride, plan.dtype),
                      .input_stride = input_stride,
                      .outputs = candidate_partials,
                      .output_type = CUDA_R_32F,
                      .batch = count});
    dispatch_float_dtype(plan.dtype, [&](auto element) {
      using Element = decltype(element);
      const CandidateTail<Element> tail{
          .weights = static_cast<const Element*>(advance(plan.w_c, candidate_k.main, plan.dtype)),
          .ld_weights = plan.ld_c,
          .inputs =
              static_cast<const Element*>(advance(args.e_c, candidate_k.main * args.n, plan.dtype)),
          .input_stride = input_stride,
          .count = static_cast<int>(candidate_k.tail)};
      combine_partials<Element>(args.out, candidate_partials, user_partials,
                                args.map->device_view.cand_to_user, tail, plan.m, args.n, first,
                                count, stream);
    });
  }
}

}  // namespace ikbo::detail::cuda
