// device_resources.cpp — Buffer, DeviceStream and device facts for the CPU
// and (when built with CUDA) one CUDA device.
#include "device_resources.hpp"

#include <cstdio>
#include <cstring>
#include <fstream>
#include <new>

#include "backend.hpp"
#include "cpu/blas.hpp"
#include "ikbo/error.hpp"
#include "random.hpp"

#ifdef IKBO_WITH_CUDA
#include "cuda_check.hpp"
#endif

namespace ikbo::bench {
namespace {

constexpr std::size_t kCpuAlignment = 64;  // a cache line, and AVX-512 friendly
constexpr std::size_t kCpuReplicationLimit = std::size_t{8} << 30;
// Left free on a GPU for the ops' own workspaces (cuBLAS, plans) and fragmentation.
constexpr std::size_t kGpuMemoryMargin = std::size_t{1} << 30;

[[noreturn]] void no_cuda_build() {
  throw Error("a CUDA device was requested, but ikbo-bench was built without CUDA");
}

}  // namespace

Buffer::Buffer(std::size_t bytes, Device device) : bytes_(bytes), device_(device) {
  if (bytes == 0) return;
  if (device.is_cuda()) {
    memory_ = detail::device::allocate(bytes, device);
  } else {
    memory_ = std::shared_ptr<void>(
        ::operator new(bytes, std::align_val_t{kCpuAlignment}),
        [](void* memory) { ::operator delete(memory, std::align_val_t{kCpuAlignment}); });
  }
}

void upload(const Buffer& destination, std::span<const std::byte> host, Stream stream) {
  if (host.size() > destination.bytes()) {
    throw Error("upload of " + format_bytes(host.size()) + " into a buffer of " +
                format_bytes(destination.bytes()));
  }
  if (host.empty()) return;
  if (destination.device().is_cuda()) {
    detail::device::copy_to_device(destination.data(), host.data(), host.size(),
                                   destination.device(), stream);
  } else {
    std::memcpy(destination.data(), host.data(), host.size());
  }
}

void fill_uniform(const Buffer& destination, DType dtype, std::int64_t count, float scale,
                  std::uint64_t seed, Stream stream) {
  upload(destination, random_values(dtype, count, scale, seed), stream);
}

DeviceStream::DeviceStream(Device device) : device_(device) {
  if (!device.is_cuda()) return;
#ifdef IKBO_WITH_CUDA
  IKBO_BENCH_CHECK(cudaSetDevice(device.index));
  cudaStream_t stream = nullptr;
  // Non-blocking: nothing else in the process may serialize with the timed work.
  IKBO_BENCH_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  stream_ = stream;
#else
  no_cuda_build();
#endif
}

DeviceStream::~DeviceStream() {
#ifdef IKBO_WITH_CUDA
  // A destructor must not throw; a failure here has no one left to tell.
  if (stream_) cudaStreamDestroy(static_cast<cudaStream_t>(stream_));
#endif
}

void DeviceStream::synchronize() const {
#ifdef IKBO_WITH_CUDA
  if (stream_) IKBO_BENCH_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(stream_)));
#endif
}

std::optional<std::string> replication_blocker(Device device, std::size_t bytes,
                                               std::string_view what) {
  if (!device.is_cuda()) {
    if (bytes <= kCpuReplicationLimit) return std::nullopt;
    return std::string(what) + " need " + format_bytes(bytes) + ", over the CPU limit of " +
           format_bytes(kCpuReplicationLimit);
  }
#ifdef IKBO_WITH_CUDA
  std::size_t free_bytes = 0, total_bytes = 0;
  IKBO_BENCH_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  if (bytes + kGpuMemoryMargin <= free_bytes) return std::nullopt;
  return std::string(what) + " need " + format_bytes(bytes) + ", " + format_bytes(free_bytes) +
         " of GPU memory free (" + format_bytes(kGpuMemoryMargin) + " kept as margin)";
#else
  no_cuda_build();
#endif
}

std::string describe_device(Device device) {
  if (device.is_cuda()) {
#ifdef IKBO_WITH_CUDA
    cudaDeviceProp properties{};
    IKBO_BENCH_CHECK(cudaGetDeviceProperties(&properties, device.index));
    return properties.name;
#else
    no_cuda_build();
#endif
  }
  std::string model = "unknown CPU";
  std::ifstream cpuinfo("/proc/cpuinfo");
  const std::string key = "model name";
  for (std::string line; std::getline(cpuinfo, line);) {
    if (line.compare(0, key.size(), key) != 0) continue;
    const auto colon = line.find(':');
    if (colon == std::string::npos) break;
    const auto start = line.find_first_not_of(" \t", colon + 1);
    if (start != std::string::npos) model = line.substr(start);
    break;
  }
  return model + "; " + detail::cpu::blas_description();
}

std::string format_bytes(std::size_t bytes) {
  char text[32];
  const double value = static_cast<double>(bytes);
  if (bytes >= (std::size_t{1} << 30)) {
    std::snprintf(text, sizeof text, "%.2f GiB", value / (1 << 30));
  } else {
    std::snprintf(text, sizeof text, "%.1f MiB", value / (1 << 20));
  }
  return text;
}

}  // namespace ikbo::bench
