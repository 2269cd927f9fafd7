// Internal: argument checks shared by every op. Each check throws
// ikbo::Error whose message names the argument, what was expected and what
// was given. Ops run all checks before touching any output.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <sstream>
#include <string>
#include <string_view>

#include "backend.hpp"
#include "ikbo/candidate_map.hpp"
#include "ikbo/error.hpp"
#include "ikbo/tensor.hpp"

namespace ikbo::detail {

template <typename... Parts>
[[noreturn]] void fail(const Parts&... parts) {
  std::ostringstream message;
  (message << ... << parts);
  throw Error(message.str());
}

template <typename... Parts>
void require(bool condition, const Parts&... parts) {
  if (!condition) fail(parts...);
}

// Largest element count any tensor may have: offsets inside the kernels are
// int64 byte offsets, so counts stay below 2^62 / sizeof(element).
inline constexpr std::int64_t kMaxElements = std::int64_t{1} << 58;
// Largest extent of one dimension (kernels index rows and columns in int32).
inline constexpr std::int64_t kMaxExtent = (std::int64_t{1} << 31) - 1;

// Checks data non-null (unless the tensor is empty) and aligned to the
// element size, dtype, device, rank, non-negative extents and an element
// count the kernels can index.
void check_tensor(const Tensor& tensor, std::string_view name, DType dtype, Device device,
                  int rank);
// Checks that `data` is aligned to `alignment` bytes (its element size: the
// kernels read it through typed pointers; a misaligned load is undefined on
// the CPU and faults on a GPU).
void check_aligned(const void* data, std::size_t alignment, std::string_view name);
// Checks that a CPU device has index 0 (the CPU is one device); `name` is
// what is on it.
void check_cpu_index(Device device, std::string_view name);
// The CPU backend: checks that a product of extents that becomes one BLAS
// extent or leading dimension fits the BLAS index type; `what` names it.
void check_blas_extent(std::int64_t value, std::string_view what);
// Checks that dimension `dim` of `tensor` equals `expected`; `meaning` says
// where the expected value comes from, e.g. "M of w_c".
void check_dim(const Tensor& tensor, std::string_view name, int dim, std::int64_t expected,
               std::string_view meaning);
// Checks a whole shape at once (message shows both shapes).
void check_shape(const Tensor& tensor, std::string_view name,
                 std::initializer_list<std::int64_t> expected, std::string_view meaning);
// Checks that `dtype` is one of the floating-point dtypes ops compute in.
void check_float_dtype(DType dtype, std::string_view name);
// Checks that a size given without a tensor (e.g. to a workspace query)
// lies in [minimum, kMaxExtent]; `name` says what it counts.
void check_extent(std::int64_t value, std::string_view name, std::int64_t minimum);
// Checks that a caller's workspace holds `needed` bytes at an address aligned
// for every backend's use (cuBLAS wants 256 bytes); `query` names the
// function that tells the size, `name` the argument.
void check_workspace(const Workspace& workspace, std::size_t needed, std::string_view query,
                     std::string_view name = "workspace");
// Checks that dimension 0 of `candidates` is the map's num_candidates and
// (when given) of `users` its num_users, and that the map lives on `device`,
// the device of `device_owner` (e.g. "the weights").
void check_map(const CandidateMap& map, const Tensor& candidates, std::string_view candidates_name,
               const Tensor* users, std::string_view users_name, Device device,
               std::string_view device_owner);
// Checks that two buffers do not overlap (outputs must not alias inputs).
void check_no_overlap(const Tensor& out, std::string_view out_name, const Tensor& in,
                      std::string_view in_name);

// Every check of ikbo::lce (workspace included, for a call with candidates);
// returns the call's backend arguments. Defined in src/api/lce.cpp; the
// staircase baselines reuse it.
LceArgs check_lce_call(const LcePlan& plan, const Tensor& e_c, const Tensor& e_u,
                       const CandidateMap& map, const Tensor& out, Stream stream,
                       Workspace workspace);

// Every check of ikbo::linear (workspace included, for a call with
// candidates); returns the call's backend arguments. Defined in
// src/api/linear.cpp; the "decomposed" baseline reuses it.
LinearArgs check_linear_call(const LinearPlan& plan, const Tensor& x_c, const Tensor& x_u,
                             const CandidateMap& map, const Tensor& out, Stream stream,
                             Workspace workspace);

}  // namespace ikbo::detail
