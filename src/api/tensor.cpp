// Tensor views, dtype names, and the shared argument checks.
#include <limits>

#include "api/validate.hpp"
#include "backend.hpp"
#include "ikbo/ikbo.hpp"

namespace ikbo {

std::size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::f16:
    case DType::bf16: return 2;
    case DType::f32:
    case DType::i32: return 4;
  }
  return 0;
}

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::f16: return "float16";
    case DType::bf16: return "bfloat16";
    case DType::f32: return "float32";
    case DType::i32: return "int32";
  }
  return "unknown";
}

std::string device_name(Device device) {
  if (device.is_cuda()) return "cuda:" + std::to_string(device.index);
  // The CPU is device index 0; another index is named so that an error about it reads true.
  return device.index == 0 ? std::string("cpu") : "cpu:" + std::to_string(device.index);
}

Tensor::Tensor(void* data_, DType dtype_, std::initializer_list<std::int64_t> shape_,
               Device device_)
    : data(data_), dtype(dtype_), device(device_), rank(static_cast<int>(shape_.size())) {
  detail::require(shape_.size() <= static_cast<std::size_t>(kMaxRank), "tensor rank ",
                  shape_.size(), " exceeds the supported maximum of ", kMaxRank);
  std::size_t i = 0;
  for (std::int64_t extent : shape_) shape[i++] = extent;
}

std::int64_t Tensor::numel() const {
  // The fields are public: a rank set by hand may lie outside the shape array.
  if (rank < 0 || rank > kMaxRank) return -1;
  std::int64_t count = 1;
  for (int i = 0; i < rank; ++i) {
    std::int64_t extent = shape[static_cast<std::size_t>(i)];
    if (extent == 0) return 0;
    if (extent < 0 || count > std::numeric_limits<std::int64_t>::max() / extent) {
      return -1;  // overflow or negative: reported by check_tensor
    }
    count *= extent;
  }
  return count;
}

std::string Tensor::shape_string() const {
  if (rank < 0 || rank > kMaxRank) return "[rank " + std::to_string(rank) + "]";
  std::string text = "[";
  for (int i = 0; i < rank; ++i) {
    if (i) text += ", ";
    text += std::to_string(shape[static_cast<std::size_t>(i)]);
  }
  return text + "]";
}

bool built_with_cuda() { return detail::device::built_with_cuda(); }
int cuda_device_count() { return detail::device::device_count(); }

namespace detail {

void check_tensor(const Tensor& tensor, std::string_view name, DType dtype, Device device,
                  int rank) {
  require(tensor.rank == rank, name, " must have ", rank, " dimensions, got ", tensor.rank,
          " (shape ", tensor.shape_string(), ")");
  for (int i = 0; i < rank; ++i) {
    std::int64_t extent = tensor.size(i);
    require(extent >= 0, name, " has a negative extent in dimension ", i, " (shape ",
            tensor.shape_string(), ")");
    require(extent <= kMaxExtent, name, " dimension ", i, " = ", extent,
            " exceeds the largest supported extent ", kMaxExtent);
  }
  std::int64_t count = tensor.numel();
  require(count >= 0 && count <= kMaxElements, name, " shape ", tensor.shape_string(),
          " has more elements than the kernels' 64-bit byte offsets can address (limit ",
          kMaxElements, ")");
  require(tensor.dtype == dtype, name, " must have dtype ", dtype_name(dtype), ", got ",
          dtype_name(tensor.dtype));
  check_cpu_index(tensor.device, name);
  require(tensor.device == device, name, " must be on ", device_name(device), ", got ",
          device_name(tensor.device));
  require(count == 0 || tensor.data != nullptr, name, " is a null pointer but has shape ",
          tensor.shape_string());
  check_aligned(tensor.data, dtype_size(dtype), name);
}

void check_aligned(const void* data, std::size_t alignment, std::string_view name) {
  require(reinterpret_cast<std::uintptr_t>(data) % alignment == 0, name,
          " must be aligned to its element size, ", alignment, " bytes, got address ", data);
}

void check_cpu_index(Device device, std::string_view name) {
  require(device.is_cuda() || device.index == 0, name, " is on ", device_name(device),
          ", but the CPU is one device, index 0");
}

void check_blas_extent(std::int64_t value, std::string_view what) {
  const std::int64_t limit = cpu::max_blas_extent();
  require(value <= limit, what, " = ", value,
          " exceeds what the CPU backend's BLAS indexes (", limit, ")");
}

void check_dim(const Tensor& tensor, std::string_view name, int dim, std::int64_t expected,
               std::string_view meaning) {
  require(tensor.size(dim) == expected, name, " dimension ", dim, " must be ", expected, " (",
          meaning, "), got ", tensor.size(dim), " (shape ", tensor.shape_string(), ")");
}

void check_shape(const Tensor& tensor, std::string_view name,
                 std::initializer_list<std::int64_t> expected, std::string_view meaning) {
  Tensor wanted(nullptr, tensor.dtype, expected, tensor.device);
  bool same = wanted.rank == tensor.rank;
  for (int i = 0; same && i < tensor.rank; ++i) same = wanted.size(i) == tensor.size(i);
  require(same, name, " must have shape ", wanted.shape_string(), " (", meaning, "), got ",
          tensor.shape_string());
}

void check_float_dtype(DType dtype, std::string_view name) {
  require(dtype == DType::f16 || dtype == DType::bf16 || dtype == DType::f32, name,
          " must have dtype float16, bfloat16 or float32, got ", dtype_name(dtype));
}

void check_extent(std::int64_t value, std::string_view name, std::int64_t minimum) {
  require(value >= minimum && value <= kMaxExtent, name, " must be in [", minimum, ", ",
          kMaxExtent, "], got ", value);
}

void check_workspace(const Workspace& workspace, std::size_t needed, std::string_view query,
                     std::string_view name) {
  constexpr std::uintptr_t kWorkspaceAlignment = 256;
  require(workspace.bytes >= needed && (needed == 0 || workspace.data != nullptr), name,
          " must hold ", needed, " bytes (see ", query, "), got ", workspace.bytes,
          workspace.data ? " bytes" : " bytes at a null pointer");
  require(reinterpret_cast<std::uintptr_t>(workspace.data) % kWorkspaceAlignment == 0, name,
          " must be ", kWorkspaceAlignment, "-byte aligned, got address ", workspace.data);
}

void check_map(const CandidateMap& map, const Tensor& candidates, std::string_view candidates_name,
               const Tensor* users, std::string_view users_name, Device device,
               std::string_view device_owner) {
  check_dim(candidates, candidates_name, 0, map.num_candidates(),
            "num_candidates of the candidate map");
  if (users != nullptr) {
    check_dim(*users, users_name, 0, map.num_users(), "num_users of the candidate map");
  }
  require(map.device() == device, "the candidate map must be on ", device_name(device), " like ",
          device_owner, ", got ", device_name(map.device()));
}

void check_no_overlap(const Tensor& out, std::string_view out_name, const Tensor& in,
                      std::string_view in_name) {
  if (out.numel() == 0 || in.numel() == 0 || out.device != in.device) return;
  auto begin_out = reinterpret_cast<std::uintptr_t>(out.data);
  auto end_out = begin_out + static_cast<std::uintptr_t>(out.numel()) * dtype_size(out.dtype);
  auto begin_in = reinterpret_cast<std::uintptr_t>(in.data);
  auto end_in = begin_in + static_cast<std::uintptr_t>(in.numel()) * dtype_size(in.dtype);
  require(end_out <= begin_in || end_in <= begin_out, out_name, " overlaps ", in_name,
          ": outputs must not alias inputs");
}

}  // namespace detail
}  // namespace ikbo
