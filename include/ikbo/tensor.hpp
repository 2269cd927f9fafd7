// ikbo/tensor.hpp — the non-owning tensor view every op takes.
//
// A Tensor is a raw pointer plus dtype, device and shape. Data is dense and
// row-major (the last dimension contiguous), at an address aligned to the
// element size (ops refuse others); bindings that accept strided tensors
// must check contiguity before building a view. Views never own
// memory and never allocate.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>

namespace ikbo {

enum class DType : std::uint8_t { f16, bf16, f32, i32 };

enum class DeviceType : std::uint8_t { cpu, cuda };

struct Device {
  DeviceType type = DeviceType::cpu;
  int index = 0;  // CUDA ordinal; 0 for the CPU

  static constexpr Device cpu() { return {DeviceType::cpu, 0}; }
  static constexpr Device cuda(int ordinal = 0) { return {DeviceType::cuda, ordinal}; }
  bool is_cuda() const { return type == DeviceType::cuda; }
  friend bool operator==(const Device&, const Device&) = default;
};

// CUDA stream as an opaque handle (a cudaStream_t); nullptr is the legacy default stream.
using Stream = void*;

std::size_t dtype_size(DType dtype);
const char* dtype_name(DType dtype);
std::string device_name(Device device);

// Caller-owned scratch memory on the op's device, 256-byte aligned (as
// cudaMalloc and framework allocators return it). Ops never allocate device
// memory or synchronize, except that the first call on a device that reaches
// cuBLAS creates that device's cuBLAS handle, which allocates: a call can be
// captured in a CUDA graph after one warm-up call on its device. One
// workspace must not be used by two ops running concurrently.
struct Workspace {
  void* data = nullptr;
  std::size_t bytes = 0;
};

inline constexpr int kMaxRank = 4;

struct Tensor {
  void* data = nullptr;
  DType dtype = DType::f32;
  Device device{};
  int rank = 0;
  std::array<std::int64_t, kMaxRank> shape{};

  Tensor() = default;
  // Throws ikbo::Error if the rank is above kMaxRank.
  Tensor(void* data, DType dtype, std::initializer_list<std::int64_t> shape,
         Device device = Device::cpu());

  std::int64_t size(int dim) const { return shape[static_cast<std::size_t>(dim)]; }
  // Product of the shape; the op's validation rejects shapes whose product overflows.
  std::int64_t numel() const;
  std::string shape_string() const;  // "[2, 3, 4]"
};

}  // namespace ikbo
