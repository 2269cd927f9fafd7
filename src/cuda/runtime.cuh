// src/cuda/runtime.cuh — device plumbing shared by the CUDA backend:
//   DeviceGuard   makes an ordinal current for a scope and restores the
//                 caller's device afterwards (ops never leak a device switch);
//   CublasLease   exclusive use of the per-device cuBLAS handle for one op,
//                 bound to the op's stream and to caller-owned workspace.
// Implemented in src/cuda/runtime.cu.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <mutex>

#include "ikbo/tensor.hpp"

namespace ikbo::detail::cuda {

inline cudaStream_t to_cuda_stream(Stream stream) { return static_cast<cudaStream_t>(stream); }

class DeviceGuard {
 public:
  explicit DeviceGuard(int device);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
  int current_ = 0;
};

// cuBLAS handles are created once per device, lazily, and live for the whole
// process. A lease locks the device's handle (a handle must not be used by
// two threads at once), sets the stream and hands cuBLAS `workspace` as its
// scratch. Passing the op's workspace, rather than a buffer owned by the
// handle, keeps concurrent ops on different streams from sharing scratch and
// means no call allocates, so ops can be captured in CUDA graphs. The first
// lease on a device creates its handle: make it outside graph capture.
// The device must be current (DeviceGuard) for the lease's lifetime.
class CublasLease {
 public:
  // `workspace` must be 256-byte aligned; `workspace_bytes` may be 0.
  CublasLease(Device device, cudaStream_t stream, void* workspace, std::size_t workspace_bytes);
  cublasHandle_t handle() const { return handle_; }

 private:
  std::unique_lock<std::mutex> lock_;
  cublasHandle_t handle_ = nullptr;
};

}  // namespace ikbo::detail::cuda
