// Internal: the interface between the validating API layer (src/api) and the
// backends (src/cpu, src/cuda). Backends receive validated arguments only:
// shapes agree, pointers are non-null where data is needed, dtypes are
// supported, devices match. Each op has exactly one dispatch point, in
// src/api/<op>.cpp, choosing the backend by device.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>

#include "api/state.hpp"
#include "ikbo/attention.hpp"
#include "ikbo/candidate_map.hpp"
#include "ikbo/error.hpp"
#include "ikbo/lce.hpp"
#include "ikbo/linear.hpp"
#include "ikbo/tensor.hpp"

namespace ikbo::detail {

inline std::int64_t round_up(std::int64_t value, std::int64_t multiple) {
  return (value + multiple - 1) / multiple * multiple;
}

// K strides of prepared weights are padded to this many elements (16 bytes
// of fp16, the TMA / vector-load alignment).
inline constexpr std::int64_t kWeightKAlignment = 8;

struct LceArgs {
  const LcePlan::State* plan = nullptr;  // plan->ku may be 0: no user term
  std::int64_t n = 0, num_candidates = 0, num_users = 0;
  const void* e_c = nullptr;  // [B, Kc, N], plan->dtype
  const void* e_u = nullptr;  // [U, Ku, N], unused when plan->ku == 0
  void* out = nullptr;        // [B, M, N]
  const CandidateMap::State* map = nullptr;  // unused when plan->ku == 0
  Stream stream = nullptr;
  void* workspace = nullptr;
  std::size_t workspace_bytes = 0;
};

// The caller's linear weights before preparation: row-major blocks whose rows
// are `ld_*` elements apart (wider than K when both blocks are column ranges
// of one concatenated [N_out, Ku + Kc] weight).
struct LinearWeights {
  DType dtype = DType::f16;
  std::int64_t out_features = 0, ku = 0, kc = 0;
  const void* w_u = nullptr;  // [N_out, Ku]
  std::int64_t ld_w_u = 0;
  const void* w_c = nullptr;  // [N_out, Kc]
  std::int64_t ld_w_c = 0;
  const void* bias = nullptr;  // [N_out], null: no bias
};

struct LinearArgs {
  const LinearPlan::State* plan = nullptr;
  std::int64_t num_candidates = 0, num_users = 0;
  const void* x_c = nullptr;  // [B, Kc], plan->dtype
  const void* x_u = nullptr;  // [U, Ku]
  void* out = nullptr;        // [B, N_out]
  const CandidateMap::State* map = nullptr;
  Stream stream = nullptr;
  void* workspace = nullptr;
  std::size_t workspace_bytes = 0;
};

struct AttentionArgs {
  DType dtype = DType::f16;
  std::int64_t num_candidates = 0, num_users = 0, n_seed = 0, heads = 0, head_dim = 0;
  std::int64_t dense_seq_len = 0;  // S of dense K/V; unused when jagged
  const void* q = nullptr;         // [B, n_seed, H, D]
  const void* k = nullptr;         // dense [U, S, H, D] or jagged [total, H, D]
  const void* v = nullptr;
  void* out = nullptr;             // [B, n_seed, H, D]
  const CandidateMap::State* map = nullptr;
  const JaggedOffsets::State* kv_offsets = nullptr;  // null: dense
  float scale = 1.0f;
  Stream stream = nullptr;
  // Optional (null: none): lets the Hopper path split the keys of a call
  // with few query tiles (cuda::attention_workspace_bytes).
  void* workspace = nullptr;
};

// Calls fn(std::integral_constant<int, D>{}) with the head dim D of `args`
// (64, 128 or 256, the ones the API accepts), for kernels templated on D.
template <typename Fn>
void with_head_dim(const AttentionArgs& args, Fn&& fn) {
  switch (args.head_dim) {
    case 64:
      return fn(std::integral_constant<int, 64>{});
    case 128:
      return fn(std::integral_constant<int, 128>{});
    case 256:
      return fn(std::integral_constant<int, 256>{});
  }
  throw RuntimeError("attention: no kernel for head dim " + std::to_string(args.head_dim));
}

// dst row r <- src row index[r] (index null: row r), `rows` rows of
// `row_bytes` bytes; row strides in bytes. The broadcast baselines build their
// replicated inputs with it. For CUDA, `index` is a device pointer.
struct GatherRowsArgs {
  void* dst = nullptr;
  std::int64_t dst_stride = 0;
  const void* src = nullptr;
  std::int64_t src_stride = 0;
  std::int64_t row_bytes = 0;
  const std::int32_t* index = nullptr;
  std::int64_t rows = 0;
  Device device{};
  Stream stream = nullptr;
};

namespace cpu {
// Converts the weights to fp32 with padded K stride.
LcePlan::State prepare_lce_plan(DType dtype, std::int64_t m, std::int64_t ku, std::int64_t kc,
                                const void* w_c, const void* w_u);
void lce(const LceArgs& args);
// Converts the weights and bias to fp32 with padded K stride.
LinearPlan::State prepare_linear_plan(const LinearWeights& weights);
void linear(const LinearArgs& args);
void attention(const AttentionArgs& args);
void gather_rows(const GatherRowsArgs& args);
// The largest extent or leading dimension the BLAS takes (its blasint).
std::int64_t max_blas_extent();
}  // namespace cpu

// The published LCE staircase's "decomposed" stage, a benchmark baseline:
//   user_out[u] = round(w_u @ e_u[u])        cuBLAS, fp32 accumulation, U items
//   out[b]      = round(w_c @ e_c[b])        cuBLAS, fp32 accumulation, B items
//   out[b]      = round(out[b] + user_out[cand_to_user[b]])   the gather-add
// on the weights and inputs exactly as given (weight rows K elements apart),
// two roundings as in the published kernels. Run on K-padded copies it is
// the "aligned" stage. CUDA only.
struct LceDecomposedArgs {
  DType dtype = DType::f16;
  Device device{};
  std::int64_t m = 0, n = 0, ku = 0, kc = 0, num_candidates = 0, num_users = 0;
  const void* w_c = nullptr;                   // [M, Kc]
  const void* w_u = nullptr;                   // [M, Ku]
  const void* e_c = nullptr;                   // [B, Kc, N]
  const void* e_u = nullptr;                   // [U, Ku, N]
  const std::int32_t* cand_to_user = nullptr;  // [B], device memory
  void* out = nullptr;                         // [B, M, N]
  Stream stream = nullptr;
  void* workspace = nullptr;  // 256-byte aligned
  std::size_t workspace_bytes = 0;
};

// The linear broadcast baseline's GEMM: out [B, N_out] = x_full [B, K] @
// weight^T (+ bias), as PyTorch's F.linear runs it: on a GPU one cuBLASLt
// matmul with a bias epilogue, on the CPU one sgemm onto the bias rows.
// weight [N_out, K] rows `ld_weight` elements apart.
struct LinearConcatArgs {
  DType dtype = DType::f16;
  Device device{};
  std::int64_t out_features = 0, k = 0, num_candidates = 0;
  const void* weight = nullptr;
  std::int64_t ld_weight = 0;
  const void* bias = nullptr;    // [N_out] or null
  const void* x_full = nullptr;  // [B, K]
  void* out = nullptr;           // [B, N_out]
  Stream stream = nullptr;
  void* workspace = nullptr;  // 256-byte aligned, linear_concat_workspace_bytes()
  std::size_t workspace_bytes = 0;
};

namespace cpu {
void linear_concat(const LinearConcatArgs& args);
}  // namespace cpu

namespace cuda {
// Copies the weights to `device` with padded K stride (zero padding).
LcePlan::State prepare_lce_plan(DType dtype, Device device, std::int64_t m, std::int64_t ku,
                                std::int64_t kc, const void* w_c, const void* w_u, Stream stream);
std::size_t lce_workspace_bytes(const LcePlan::State& plan, std::int64_t n,
                                std::int64_t num_candidates, std::int64_t num_users);
void lce(const LceArgs& args);
// Workspace of lce_decomposed: user_out [U, M, N] and cuBLAS scratch.
std::size_t lce_decomposed_workspace_bytes(DType dtype, std::int64_t m, std::int64_t n,
                                           std::int64_t num_users);
void lce_decomposed(const LceDecomposedArgs& args);
// The published staircase's "fused" stage, a benchmark baseline: the Hopper
// kernel (sm90/lce_sm90.cu) with the user GEMM in a launch of its own and
// the candidate GEMM adding the user partial in its epilogue. Why it cannot
// run these (lce-validated) args, or nullopt when it can.
std::optional<std::string> lce_fused_blocker(const LceArgs& args);
void lce_fused(const LceArgs& args);  // lce_fused_blocker must be nullopt
// Copies the weights and bias to `device` with padded K stride (zero padding).
LinearPlan::State prepare_linear_plan(const LinearWeights& weights, Device device, Stream stream);
std::size_t linear_workspace_bytes(const LinearPlan::State& plan, std::int64_t num_candidates,
                                   std::int64_t num_users);
// The Hopper kernel where it takes the call (sm90/linear_sm90.hpp), else
// linear_decomposed.
void linear(const LinearArgs& args);
// The cuBLAS path on any GPU: user GEMM with the bias, candidate GEMM into
// fp32 partials, combine kernel (also the benchmark's "decomposed" variant).
void linear_decomposed(const LinearArgs& args);
std::size_t linear_concat_workspace_bytes();  // cuBLASLt scratch
void linear_concat(const LinearConcatArgs& args);
// Bytes of workspace attention() can use for `args` (0: none).
std::size_t attention_workspace_bytes(const AttentionArgs& args);
void attention(const AttentionArgs& args);
void gather_rows(const GatherRowsArgs& args);
}  // namespace cuda

// Device memory services, implemented by src/cuda/runtime.cu when CUDA is
// built and by src/api/no_cuda.cpp otherwise (where they throw ikbo::Error).
namespace device {
bool built_with_cuda();
int device_count();  // 0 without CUDA or without a GPU
// Ensures `device` exists; throws ikbo::Error naming `what` otherwise.
void require(Device device, const char* what);
std::shared_ptr<void> allocate(std::size_t bytes, Device device);
// Throws ikbo::Error naming `what` unless `pointer` is device memory of
// `device` (or managed memory).
void require_memory_on(const void* pointer, Device device, std::string_view what);
// Synchronous (stream-ordered on `stream`, then the stream is synchronized).
void copy_to_device(void* dst, const void* src, std::size_t bytes, Device device, Stream stream);
void copy_to_host(void* dst, const void* src, std::size_t bytes, Device device, Stream stream);
// Zeroes `bytes` bytes at `dst`, stream-ordered on `stream` (not synchronized).
void zero(void* dst, std::size_t bytes, Device device, Stream stream);
}  // namespace device

}  // namespace ikbo::detail
