// device_resources.hpp — memory, streams and facts of the device ikbo-bench
// runs on (the CPU or one CUDA device), behind one interface so the suites
// never branch on the device themselves.
//
// Buffer owns raw memory on the device: CUDA memory comes from the library's
// own allocator (ikbo::detail::device), CPU memory is 64-byte aligned.
// Buffers are filled from the host once, outside every timed region.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "ikbo/tensor.hpp"

namespace ikbo::bench {

class Buffer {
 public:
  Buffer() = default;
  // Zero bytes allocate nothing: data() is null, as an empty Workspace expects.
  Buffer(std::size_t bytes, Device device);

  void* data() const { return memory_.get(); }
  std::size_t bytes() const { return bytes_; }
  Device device() const { return device_; }

 private:
  std::shared_ptr<void> memory_;
  std::size_t bytes_ = 0;
  Device device_{};
};

// Copies `host` to the start of `destination` (stream-ordered on `stream`,
// then synchronized).
void upload(const Buffer& destination, std::span<const std::byte> host, Stream stream);

// Fills the first `count` elements of `destination` with values uniform in
// [-scale, scale), in `dtype`, drawn from `seed`.
void fill_uniform(const Buffer& destination, DType dtype, std::int64_t count, float scale,
                  std::uint64_t seed, Stream stream);

// The stream the timed ops run on: a fresh non-blocking CUDA stream, or the
// null handle on the CPU.
class DeviceStream {
 public:
  explicit DeviceStream(Device device);
  ~DeviceStream();
  DeviceStream(const DeviceStream&) = delete;
  DeviceStream& operator=(const DeviceStream&) = delete;

  Stream get() const { return stream_; }
  void synchronize() const;

 private:
  Device device_;
  Stream stream_ = nullptr;
};

// Why `bytes` of replicated tensors (or the copies `what` names) cannot be
// allocated on `device`, or nothing when they fit: on a GPU the free memory
// (less a margin for library workspaces), on the CPU a fixed 8 GiB cap.
std::optional<std::string> replication_blocker(Device device, std::size_t bytes,
                                               std::string_view what = "replicated tensors");

// The GPU's name, or the CPU model from /proc/cpuinfo and the BLAS the CPU
// backend runs on.
std::string describe_device(Device device);

// "1.36 GiB", for messages.
std::string format_bytes(std::size_t bytes);

}  // namespace ikbo::bench
