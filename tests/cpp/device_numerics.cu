// device_numerics.cu — the GPU-side fill, comparison and attention reference
// of device_numerics.hpp: a SplitMix64 hash of (seed, index) per element for
// the fill; a grid-stride max reduction (warp shuffles, then one atomicMax
// per block on the bits of a non-negative float, which order like the
// floats) for the comparison; and for the attention reference two
// pointer-array batched SGEMMs per head around a block-per-row softmax.
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "cuda/dtype.cuh"
#include "device_numerics.hpp"
#include "ikbo/error.hpp"

namespace ikbo::test {
namespace {

using detail::cuda::dispatch_float_dtype;
using detail::cuda::from_float;
using detail::cuda::to_float;

constexpr int kThreads = 256;
constexpr int kMaxBlocks = 4096;

void check(cudaError_t status, const char* call) {
  if (status != cudaSuccess) {
    throw RuntimeError(std::string(call) + " failed: " + cudaGetErrorName(status) + ": " +
                       cudaGetErrorString(status));
  }
}
void check(cublasStatus_t status, const char* call) {
  if (status != CUBLAS_STATUS_SUCCESS) {
    throw RuntimeError(std::string(call) + " failed: " + cublasGetStatusName(status) + ": " +
                       cublasGetStatusString(status));
  }
}
#define IKBO_NUMERICS_CHECK(call) check((call), #call)

int blocks_for(std::int64_t count) {
  return static_cast<int>(std::min<std::int64_t>(kMaxBlocks, (count + kThreads - 1) / kThreads));
}

__device__ std::uint64_t mix(std::uint64_t value) {
  value = (value ^ (value >> 30)) * 0xbf58476d1ce4e5b9ull;
  value = (value ^ (value >> 27)) * 0x94d049bb133111ebull;
  return value ^ (value >> 31);
}

template <typename Element>
__global__ void fill_uniform_kernel(Element* values, float* values_f32, std::int64_t count,
                                    float scale, std::uint64_t seed) {
  const std::int64_t step = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += step) {
    const std::uint64_t bits = mix(seed * 0x9e3779b97f4a7c15ull + static_cast<std::uint64_t>(i));
    // 24 random bits: uniform in [-1, 1) on a grid a float holds exactly.
    const float unit = static_cast<float>(bits >> 40) * 0x1p-23f - 1.0f;
    const Element value = from_float<Element>(unit * scale);
    values[i] = value;
    if (values_f32 != nullptr) values_f32[i] = to_float(value);
  }
}

template <typename Element>
__global__ void max_abs_difference_kernel(const Element* actual, const float* expected,
                                          std::int64_t count, unsigned* result_bits) {
  const std::int64_t step = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  float largest = 0.0f;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += step) {
    const float difference = fabsf(to_float(actual[i]) - expected[i]);
    largest = isnan(difference) ? INFINITY : fmaxf(largest, difference);
    if (isinf(largest)) break;
  }
  for (int offset = 16; offset > 0; offset /= 2) {
    largest = fmaxf(largest, __shfl_xor_sync(0xffffffffu, largest, offset));
  }
  __shared__ float warp_largest[kThreads / 32];
  if (threadIdx.x % 32 == 0) warp_largest[threadIdx.x / 32] = largest;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int warp = 1; warp < kThreads / 32; ++warp) largest = fmaxf(largest, warp_largest[warp]);
    atomicMax(result_bits, __float_as_uint(largest));
  }
}

// Reduces `value` over the block with `op`; every thread gets the result.
// `partials` holds one value per warp; the leading barrier lets a call reuse
// it right after the previous call's readers.
template <typename Op>
__device__ float block_reduce(float value, Op op, float* partials) {
  for (int offset = 16; offset > 0; offset /= 2) {
    value = op(value, __shfl_xor_sync(0xffffffffu, value, offset));
  }
  __syncthreads();
  if (threadIdx.x % 32 == 0) partials[threadIdx.x / 32] = value;
  __syncthreads();
  float result = partials[0];
  for (int warp = 1; warp < kThreads / 32; ++warp) result = op(result, partials[warp]);
  return result;
}

// In place: row r of `scores` (row stride `row_stride`), the raw scores of
// query row r (candidate r / n_seed) against its user's lengths[r / n_seed]
// keys, becomes softmax(scale * row). Plain two-pass fp32 with expf: the
// max is subtracted for range only, and each exponential is rounded once.
// One block per row: the branch on an empty history is block-uniform, so
// every thread reaches the barriers.
__global__ void softmax_rows_kernel(float* scores, std::int64_t row_stride, std::int64_t rows,
                                    const std::int32_t* lengths, std::int64_t n_seed, float scale) {
  __shared__ float partials[kThreads / 32];
  for (std::int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const int length = lengths[row / n_seed];
    if (length == 0) continue;
    float* values = scores + row * row_stride;
    float largest = -INFINITY;
    for (int key = threadIdx.x; key < length; key += blockDim.x) {
      largest = fmaxf(largest, scale * values[key]);
    }
    largest = block_reduce(
        largest, [](float a, float b) { return fmaxf(a, b); }, partials);
    float sum = 0.0f;
    for (int key = threadIdx.x; key < length; key += blockDim.x) {
      const float exponential = expf(scale * values[key] - largest);
      values[key] = exponential;
      sum += exponential;
    }
    sum = block_reduce(
        sum, [](float a, float b) { return a + b; }, partials);
    for (int key = threadIdx.x; key < length; key += blockDim.x) values[key] /= sum;
  }
}

int to_int(std::int64_t value, const char* what) {
  if (value < 0 || value > std::numeric_limits<int>::max()) {
    throw RuntimeError(std::string("DeviceAttentionReference: ") + what + " " +
                       std::to_string(value) + " does not fit cuBLAS's int");
  }
  return static_cast<int>(value);
}

}  // namespace

void fill_uniform_on_device(void* values, DType dtype, float* values_f32, std::int64_t count,
                            float scale, std::uint64_t seed) {
  if (count == 0) return;
  dispatch_float_dtype(dtype, [&](auto element) {
    using Element = decltype(element);
    fill_uniform_kernel<Element><<<blocks_for(count), kThreads>>>(static_cast<Element*>(values),
                                                                  values_f32, count, scale, seed);
  });
  IKBO_NUMERICS_CHECK(cudaGetLastError());
  IKBO_NUMERICS_CHECK(cudaDeviceSynchronize());
}

double max_abs_difference_on_device(const void* actual, DType dtype, const float* expected,
                                    std::int64_t count) {
  unsigned* result_bits = nullptr;
  IKBO_NUMERICS_CHECK(cudaMalloc(&result_bits, sizeof(unsigned)));
  unsigned bits = 0;
  try {
    IKBO_NUMERICS_CHECK(cudaMemset(result_bits, 0, sizeof(unsigned)));
    if (count > 0) {
      dispatch_float_dtype(dtype, [&](auto element) {
        using Element = decltype(element);
        max_abs_difference_kernel<Element><<<blocks_for(count), kThreads>>>(
            static_cast<const Element*>(actual), expected, count, result_bits);
      });
      IKBO_NUMERICS_CHECK(cudaGetLastError());
    }
    IKBO_NUMERICS_CHECK(cudaMemcpy(&bits, result_bits, sizeof bits, cudaMemcpyDeviceToHost));
  } catch (...) {
    cudaFree(result_bits);
    throw;
  }
  IKBO_NUMERICS_CHECK(cudaFree(result_bits));
  float largest = 0.0f;
  static_assert(sizeof largest == sizeof bits);
  std::memcpy(&largest, &bits, sizeof bits);
  return largest;
}

void poison_on_device(void* values, std::size_t bytes) {
  IKBO_NUMERICS_CHECK(cudaMemset(values, 0xff, bytes));
  IKBO_NUMERICS_CHECK(cudaDeviceSynchronize());
}

void synchronize_device(const char* after) {
  const cudaError_t status = cudaDeviceSynchronize();
  if (status != cudaSuccess) {
    throw RuntimeError(std::string("after ") + after + ": " + cudaGetErrorName(status) + ": " +
                       cudaGetErrorString(status));
  }
}

// Device scratch of the reference, grown on demand and never shrunk.
struct DeviceAttentionReference::Resources {
  cublasHandle_t handle = nullptr;
  void* scores = nullptr;  // fp32 [B * n_seed, longest history] of one head
  std::size_t scores_bytes = 0;
  void* pointers = nullptr;  // the batched GEMMs' operand and result arrays
  std::size_t pointers_bytes = 0;
  void* lengths = nullptr;  // int32 [B]: the history length of each candidate's user
  std::size_t lengths_bytes = 0;

  ~Resources() {
    // Teardown of test scratch: nothing useful to do with a failure here.
    if (handle != nullptr) static_cast<void>(cublasDestroy(handle));
    for (void* buffer : {scores, pointers, lengths}) {
      if (buffer != nullptr) static_cast<void>(cudaFree(buffer));
    }
  }

  static void reserve(void*& buffer, std::size_t& capacity, std::size_t bytes) {
    if (bytes <= capacity) return;
    if (buffer != nullptr) IKBO_NUMERICS_CHECK(cudaFree(buffer));
    buffer = nullptr;
    capacity = 0;
    IKBO_NUMERICS_CHECK(cudaMalloc(&buffer, bytes));
    capacity = bytes;
  }
};

DeviceAttentionReference::DeviceAttentionReference() : resources_(std::make_unique<Resources>()) {
  IKBO_NUMERICS_CHECK(cublasCreate(&resources_->handle));
  // Pedantic: no TF32, no reduced-precision split-K reductions; the SGEMMs
  // are plain fp32 FMA chains, whatever NVIDIA_TF32_OVERRIDE says.
  IKBO_NUMERICS_CHECK(cublasSetMathMode(resources_->handle, CUBLAS_PEDANTIC_MATH));
}

DeviceAttentionReference::~DeviceAttentionReference() = default;

void DeviceAttentionReference::run(const float* q, const float* k, const float* v, float* out,
                                   std::span<const std::int32_t> cand_to_user,
                                   std::span<const std::int64_t> kv_offsets, std::int64_t n_seed,
                                   std::int64_t heads, std::int64_t head_dim, float scale) {
  const auto num_candidates = static_cast<std::int64_t>(cand_to_user.size());
  const std::int64_t num_users = static_cast<std::int64_t>(kv_offsets.size()) - 1;
  const std::int64_t row_size = heads * head_dim;  // elements between two tokens' rows
  const std::int64_t query_rows = num_candidates * n_seed;
  IKBO_NUMERICS_CHECK(cudaMemset(out, 0, static_cast<std::size_t>(query_rows * row_size) * 4));

  // Candidates grouped by their user's history length: one batched GEMM per
  // group and head (dense K/V is a single group). Empty histories keep the
  // zeros just written.
  std::vector<std::int32_t> lengths(static_cast<std::size_t>(num_candidates));
  std::map<std::int64_t, std::vector<std::int64_t>> groups;
  std::int64_t longest = 0, with_keys = 0;
  for (std::int64_t b = 0; b < num_candidates; ++b) {
    const std::int32_t user = cand_to_user[static_cast<std::size_t>(b)];
    if (user < 0 || user >= num_users) {
      throw RuntimeError("DeviceAttentionReference: cand_to_user[" + std::to_string(b) +
                         "] = " + std::to_string(user) + " is not a user");
    }
    const std::int64_t length =
        kv_offsets[static_cast<std::size_t>(user) + 1] - kv_offsets[static_cast<std::size_t>(user)];
    lengths[static_cast<std::size_t>(b)] = to_int(length, "history length");
    if (length == 0) continue;
    groups[length].push_back(b);
    longest = std::max(longest, length);
    ++with_keys;
  }
  if (with_keys == 0) {
    IKBO_NUMERICS_CHECK(cudaDeviceSynchronize());
    return;
  }

  // Per (head, candidate with keys), in group order: the operands of
  // scores = K_u Q_b^T and out_b = V_u^T P_b^T as cuBLAS sees them
  // (column-major), each array section [heads * with_keys] long.
  const std::int64_t entries = heads * with_keys;
  std::vector<const float*> operands(static_cast<std::size_t>(4 * entries));
  std::vector<float*> results(static_cast<std::size_t>(2 * entries));
  const auto section = [&](auto& array, int index) {
    return array.data() + static_cast<std::size_t>(index * entries);
  };
  Resources::reserve(resources_->scores, resources_->scores_bytes,
                     static_cast<std::size_t>(query_rows * longest) * 4);
  auto* const scores = static_cast<float*>(resources_->scores);
  for (std::int64_t head = 0; head < heads; ++head) {
    std::int64_t entry = head * with_keys;
    for (const auto& [length, candidates] : groups) {
      for (const std::int64_t b : candidates) {
        const std::int64_t user = cand_to_user[static_cast<std::size_t>(b)];
        const std::int64_t kv_begin = kv_offsets[static_cast<std::size_t>(user)];
        const std::int64_t head_offset = head * head_dim;
        const float* q_b = q + b * n_seed * row_size + head_offset;
        const float* k_u = k + kv_begin * row_size + head_offset;
        const float* v_u = v + kv_begin * row_size + head_offset;
        float* scores_b = scores + b * n_seed * longest;
        const auto at = static_cast<std::size_t>(entry);
        section(operands, 0)[at] = k_u;
        section(operands, 1)[at] = q_b;
        section(results, 0)[at] = scores_b;
        section(operands, 2)[at] = v_u;
        section(operands, 3)[at] = scores_b;
        section(results, 1)[at] = out + b * n_seed * row_size + head_offset;
        ++entry;
      }
    }
  }
  const std::size_t operand_bytes = operands.size() * sizeof(const float*);
  const std::size_t result_bytes = results.size() * sizeof(float*);
  Resources::reserve(resources_->pointers, resources_->pointers_bytes,
                     operand_bytes + result_bytes);
  Resources::reserve(resources_->lengths, resources_->lengths_bytes,
                     lengths.size() * sizeof(std::int32_t));
  auto* device_operands = static_cast<const float**>(resources_->pointers);
  auto* device_results =
      reinterpret_cast<float**>(static_cast<char*>(resources_->pointers) + operand_bytes);
  IKBO_NUMERICS_CHECK(
      cudaMemcpy(device_operands, operands.data(), operand_bytes, cudaMemcpyHostToDevice));
  IKBO_NUMERICS_CHECK(
      cudaMemcpy(device_results, results.data(), result_bytes, cudaMemcpyHostToDevice));
  IKBO_NUMERICS_CHECK(cudaMemcpy(resources_->lengths, lengths.data(),
                                 lengths.size() * sizeof(std::int32_t), cudaMemcpyHostToDevice));

  cublasHandle_t handle = resources_->handle;
  IKBO_NUMERICS_CHECK(cublasSetStream(handle, nullptr));
  const float one = 1.0f, zero = 0.0f;
  const int seeds = to_int(n_seed, "n_seed");
  const int dim = to_int(head_dim, "head_dim");
  const int token_stride = to_int(row_size, "H * D");
  const int score_stride = to_int(longest, "longest history");
  const auto device_section = [&](auto* array, int index, std::int64_t entry) {
    return array + index * entries + entry;
  };
  for (std::int64_t head = 0; head < heads; ++head) {
    std::int64_t entry = head * with_keys;
    // Column-major, K_u is D x L with leading dimension H * D and Q_b is
    // D x n_seed likewise; (K_u^T Q_b) is L x n_seed with leading dimension
    // `longest`, i.e. the row-major [n_seed, longest] scores of candidate b.
    for (const auto& [length, candidates] : groups) {
      const int batch = to_int(static_cast<std::int64_t>(candidates.size()), "group size");
      IKBO_NUMERICS_CHECK(
          cublasSgemmBatched(handle, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(length), seeds, dim,
                             &one, device_section(device_operands, 0, entry), token_stride,
                             device_section(device_operands, 1, entry), token_stride, &zero,
                             device_section(device_results, 0, entry), score_stride, batch));
      entry += batch;
    }
    const int blocks = static_cast<int>(std::min<std::int64_t>(query_rows, 1 << 16));
    softmax_rows_kernel<<<blocks, kThreads>>>(scores, longest, query_rows,
                                              static_cast<const std::int32_t*>(resources_->lengths),
                                              n_seed, scale);
    IKBO_NUMERICS_CHECK(cudaGetLastError());
    // V_u^T (D x L, leading dimension H * D) times P_b^T (L x n_seed,
    // leading dimension `longest`) is out_b^T: D x n_seed with leading
    // dimension H * D, i.e. head `head` of candidate b's rows of out.
    entry = head * with_keys;
    for (const auto& [length, candidates] : groups) {
      const int batch = static_cast<int>(candidates.size());
      IKBO_NUMERICS_CHECK(
          cublasSgemmBatched(handle, CUBLAS_OP_N, CUBLAS_OP_N, dim, seeds, static_cast<int>(length),
                             &one, device_section(device_operands, 2, entry), token_stride,
                             device_section(device_operands, 3, entry), score_stride, &zero,
                             device_section(device_results, 1, entry), token_stride, batch));
      entry += batch;
    }
  }
  IKBO_NUMERICS_CHECK(cudaDeviceSynchronize());
}

}  // namespace ikbo::test
