// src/cuda/sm90/device_support.cuh — host-side checks shared by the Hopper
// (sm_90a) paths: whether a device and this binary can run a pipeline
// kernel, probed once per device, and the IKBO_DISABLE_SM90 switch.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstddef>
#include <cstdlib>
#include <mutex>
#include <optional>
#include <string_view>
#include <vector>

#include "backend.hpp"
#include "cuda/check.cuh"
#include "cuda/runtime.cuh"

namespace ikbo::detail::cuda::sm90 {

// What the Hopper kernels need to know about a device.
struct HopperDevice {
  bool sm90 = false;  // compute capability 9.0, the only one sm_90a code runs on
  int multiprocessors = 0;
  std::size_t shared_optin = 0;  // dynamic + static shared memory a block may opt in to
};

inline HopperDevice query_device(int ordinal) {
  int major = 0, minor = 0, multiprocessors = 0, shared_optin = 0;
  IKBO_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, ordinal));
  IKBO_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, ordinal));
  IKBO_CUDA_CHECK(
      cudaDeviceGetAttribute(&multiprocessors, cudaDevAttrMultiProcessorCount, ordinal));
  IKBO_CUDA_CHECK(
      cudaDeviceGetAttribute(&shared_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, ordinal));
  return {major == 9 && minor == 0, multiprocessors, static_cast<std::size_t>(shared_optin)};
}

// Whether this binary carries `kernel` for the current device with its body
// (sm90::pipeline_kernel has static shared memory only in
// its sm_90a body) and its shared memory fits; if so, raises its dynamic
// shared memory limit to `dynamic_bytes`.
template <typename Kernel>
bool prepare_kernel(Kernel* kernel, std::size_t dynamic_bytes, const HopperDevice& device) {
  cudaFuncAttributes attributes{};
  const cudaError_t status = cudaFuncGetAttributes(&attributes, kernel);
  if (status == cudaErrorInvalidDeviceFunction || status == cudaErrorNoKernelImageForDevice) {
    static_cast<void>(cudaGetLastError());  // not sticky; keep it from later launch checks
    return false;
  }
  IKBO_CUDA_CHECK(status);
  if (attributes.sharedSizeBytes == 0 ||
      device.shared_optin < dynamic_bytes + attributes.sharedSizeBytes) {
    return false;
  }
  IKBO_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(dynamic_bytes)));
  return true;
}

// probe(ordinal), run once per device (the current device set to it) and
// remembered; a default Support for an ordinal that is not a device.
template <typename Support, Support (*probe)(int)>
Support probed_once(int ordinal) {
  static std::mutex mutex;
  static std::vector<std::optional<Support>> probed(static_cast<std::size_t>(device::device_count()));
  if (ordinal < 0 || static_cast<std::size_t>(ordinal) >= probed.size()) return {};
  const std::lock_guard<std::mutex> lock(mutex);
  auto& entry = probed[static_cast<std::size_t>(ordinal)];
  if (!entry) {
    const DeviceGuard guard(ordinal);
    entry = probe(ordinal);
  }
  return *entry;
}

// The Hopper paths are enabled unless the environment has IKBO_DISABLE_SM90
// set to anything but "" or "0".
inline bool sm90_enabled_by_environment() {
  const char* value = std::getenv("IKBO_DISABLE_SM90");
  return value == nullptr || std::string_view(value).empty() || std::string_view(value) == "0";
}

// The on/off switch of one Hopper path (Path: a type of that path's own, so
// that each path has its switch), set from the environment at its first
// use; tests turn it to compare with the portable path.
template <class Path>
std::atomic<bool>& enabled_switch() {
  static std::atomic<bool> enabled{sm90_enabled_by_environment()};
  return enabled;
}

}  // namespace ikbo::detail::cuda::sm90
