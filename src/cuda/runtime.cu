// src/cuda/runtime.cu — device services of the CUDA backend: device
// discovery, allocation, synchronous host<->device copies, the device guard
// and the per-device cuBLAS handles (see runtime.cuh).
#include <memory>
#include <string_view>
#include <vector>

#include "api/validate.hpp"
#include "backend.hpp"
#include "cuda/check.cuh"
#include "cuda/runtime.cuh"

namespace ikbo::detail {

namespace cuda {

DeviceGuard::DeviceGuard(int device) : current_(device) {
  IKBO_CUDA_CHECK(cudaGetDevice(&previous_));
  if (previous_ != current_) IKBO_CUDA_CHECK(cudaSetDevice(current_));
}

DeviceGuard::~DeviceGuard() {
  // A destructor cannot throw; restoring a device that was current a moment
  // ago only fails when the CUDA context is already being torn down.
  if (previous_ != current_ && cudaSetDevice(previous_) != cudaSuccess) cudaGetLastError();
}

namespace {

struct CublasSlot {
  std::mutex mutex;
  cublasHandle_t handle = nullptr;
};

// One slot per device. Deliberately never destroyed: cublasDestroy during
// static destruction can run after the CUDA runtime has unloaded.
std::vector<CublasSlot>& cublas_slots() {
  static auto* slots =
      new std::vector<CublasSlot>(static_cast<std::size_t>(device::device_count()));
  return *slots;
}

}  // namespace

CublasLease::CublasLease(Device device, cudaStream_t stream, void* workspace,
                         std::size_t workspace_bytes) {
  CublasSlot& slot = cublas_slots().at(static_cast<std::size_t>(device.index));
  lock_ = std::unique_lock<std::mutex>(slot.mutex);
  if (slot.handle == nullptr) {
    cublasHandle_t handle = nullptr;
    IKBO_CUBLAS_CHECK(cublasCreate(&handle));
    // fp32 compute without TF32, and split-K partial sums reduced in fp32
    // even when the output is f16/bf16: the library rounds exactly once.
    cublasStatus_t status = cublasSetMathMode(
        handle, static_cast<cublasMath_t>(CUBLAS_DEFAULT_MATH |
                                          CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION));
    if (status != CUBLAS_STATUS_SUCCESS) {
      // Already failing: report the first error, not the cleanup's.
      static_cast<void>(cublasDestroy(handle));
      IKBO_CUBLAS_CHECK(status);
    }
    slot.handle = handle;
  }
  handle_ = slot.handle;
  IKBO_CUBLAS_CHECK(cublasSetStream(handle_, stream));
  // cublasSetStream resets the handle to cuBLAS's internal workspace pool;
  // setting ours afterwards (even with 0 bytes) keeps cuBLAS off that pool.
  IKBO_CUBLAS_CHECK(cublasSetWorkspace(handle_, workspace, workspace_bytes));
}

}  // namespace cuda

namespace device {

bool built_with_cuda() { return true; }

int device_count() {
  // The set of visible devices is fixed when the runtime initializes, so it is
  // queried once. Without a driver or GPU the query fails quietly: clear the
  // error so no later launch check reports it.
  static const int count = [] {
    int devices = 0;
    if (cudaGetDeviceCount(&devices) != cudaSuccess) {
      cudaGetLastError();
      return 0;
    }
    return devices;
  }();
  return count;
}

void require(Device device, const char* what) {
  if (!device.is_cuda()) return;
  const int count = device_count();
  if (device.index >= 0 && device.index < count) return;
  if (count == 0) fail(what, " is on ", device_name(device), ", but no CUDA device is present");
  fail(what, " is on ", device_name(device), ", but only ", count, " CUDA device",
       count == 1 ? " is" : "s are", " present");
}

std::shared_ptr<void> allocate(std::size_t bytes, Device device) {
  if (bytes == 0) return nullptr;
  const int ordinal = device.index;
  cuda::DeviceGuard guard(ordinal);
  void* pointer = nullptr;
  IKBO_CUDA_CHECK(cudaMalloc(&pointer, bytes));
  return std::shared_ptr<void>(pointer, [ordinal](void* allocation) {
    // Deleters cannot throw. These calls fail only while the CUDA context is
    // being torn down (process exit); clear the error so that no unrelated
    // later check reports it.
    auto ignore = [](cudaError_t status) {
      if (status != cudaSuccess) cudaGetLastError();
    };
    int previous = ordinal;
    ignore(cudaGetDevice(&previous));
    if (previous != ordinal) ignore(cudaSetDevice(ordinal));
    ignore(cudaFree(allocation));
    if (previous != ordinal) ignore(cudaSetDevice(previous));
  });
}

void require_memory_on(const void* pointer, Device device, std::string_view what) {
  cudaPointerAttributes attributes{};
  const cudaError_t status = cudaPointerGetAttributes(&attributes, pointer);
  if (status != cudaSuccess) {
    cudaGetLastError();  // reported here, not by a later check
    fail(what, " at address ", pointer, " could not be inspected: ", cudaGetErrorString(status));
  }
  switch (attributes.type) {
    case cudaMemoryTypeManaged: return;
    case cudaMemoryTypeDevice:
      if (attributes.device == device.index) return;
      fail(what, " must be memory of ", device_name(device), ", got memory of ",
           device_name(Device::cuda(attributes.device)));
    case cudaMemoryTypeHost:
      fail(what, " must be memory of ", device_name(device), ", got pinned host memory");
    default:
      fail(what, " must be memory of ", device_name(device), ", got host memory");
  }
}

void copy_to_device(void* dst, const void* src, std::size_t bytes, Device device, Stream stream) {
  cuda::DeviceGuard guard(device.index);
  cudaStream_t cuda_stream = cuda::to_cuda_stream(stream);
  IKBO_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, cuda_stream));
  IKBO_CUDA_CHECK(cudaStreamSynchronize(cuda_stream));
}

void copy_to_host(void* dst, const void* src, std::size_t bytes, Device device, Stream stream) {
  cuda::DeviceGuard guard(device.index);
  cudaStream_t cuda_stream = cuda::to_cuda_stream(stream);
  IKBO_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, cuda_stream));
  IKBO_CUDA_CHECK(cudaStreamSynchronize(cuda_stream));
}

void zero(void* dst, std::size_t bytes, Device device, Stream stream) {
  cuda::DeviceGuard guard(device.index);
  IKBO_CUDA_CHECK(cudaMemsetAsync(dst, 0, bytes, cuda::to_cuda_stream(stream)));
}

}  // namespace device
}  // namespace ikbo::detail
