// Device-parametrized test harness: memory, tensors and streams on the CPU or
// on a CUDA device behind one interface, so each numeric test is written once
// and instantiated for both devices.
//
// Tests take a Device parameter from test_devices() (always both, so the CUDA
// instances appear in every run) and start with IKBO_SKIP_IF_UNAVAILABLE: on
// a machine without a GPU, or in a build without CUDA, the CUDA instances are
// reported as skipped with the reason, never passed silently. The CUDA-only
// helpers (TestStream, StreamGate, run_as_cuda_graph) compile in every build
// and throw ikbo::RuntimeError where CUDA is missing; skipped tests never
// reach them.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <ostream>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include "ikbo/ikbo.hpp"
#include "reference.hpp"

namespace ikbo {
// Readable parameter values in GoogleTest output (found by argument-dependent lookup).
void PrintTo(const Device& device, std::ostream* stream);
void PrintTo(DType dtype, std::ostream* stream);
}  // namespace ikbo

namespace ikbo::test {

// The CPU and CUDA device 0.
std::vector<Device> test_devices();
// "cpu" or "cuda": the suffix of a parametrized test's name.
std::string device_label(Device device);
// "f16", "bf16", "f32": dtype part of a parametrized test's name.
std::string dtype_label(DType dtype);
// Names the instances of a test parametrized by Device alone.
std::string device_param_name(const testing::TestParamInfo<Device>& info);
// Why tests cannot run on `device` here ("no CUDA device: ...", "ikbo built
// without CUDA"), or nullopt when they can.
std::optional<std::string> unavailable_reason(Device device);
// Why a Hopper (sm_90a) path cannot run on CUDA device 0, or nullopt.
// `available` is the path's own probe (e.g. detail::cuda::lce_sm90_available),
// null in a build without CUDA; `path` names it in the reason.
std::optional<std::string> hopper_unavailable_reason(bool (*available)(Device),
                                                     std::string_view path);

// In a test body or SetUp: skip, with the reason, when `device` is unusable.
#define IKBO_SKIP_IF_UNAVAILABLE(device)                                      \
  if (const auto ikbo_skip_reason = ::ikbo::test::unavailable_reason(device)) \
  GTEST_SKIP() << *ikbo_skip_reason

// f16, bf16, f32: the dtypes every numeric test runs in.
std::vector<DType> float_dtypes();

// Base fixture of tests parametrized by device; skips an unusable device.
class DeviceTest : public testing::TestWithParam<Device> {
 protected:
  void SetUp() override { IKBO_SKIP_IF_UNAVAILABLE(device()); }
  Device device() const { return GetParam(); }
};

using DeviceDtype = std::tuple<Device, DType>;
// Base fixture of tests parametrized by device and dtype.
class DeviceDtypeTest : public testing::TestWithParam<DeviceDtype> {
 protected:
  void SetUp() override { IKBO_SKIP_IF_UNAVAILABLE(device()); }
  Device device() const { return std::get<0>(GetParam()); }
  DType dtype() const { return std::get<1>(GetParam()); }
};
// Names the instances: "cpu_f16", "cuda_bf16", ...
std::string device_dtype_param_name(const testing::TestParamInfo<DeviceDtype>& info);

// Owned memory on the CPU or a CUDA device. Copies are synchronous.
class DeviceBuffer {
 public:
  DeviceBuffer(Device device, std::size_t bytes);
  DeviceBuffer(Device device, std::span<const std::byte> contents);
  DeviceBuffer(DeviceBuffer&& other) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer();

  void* data() const { return data_; }
  std::size_t bytes() const { return bytes_; }
  Device device() const { return device_; }
  void upload(std::span<const std::byte> contents);
  std::vector<std::byte> download() const;

 private:
  void release() noexcept;

  Device device_;
  std::size_t bytes_ = 0;
  void* data_ = nullptr;
};

// A dense tensor held in a DeviceBuffer.
class DeviceTensor {
 public:
  DeviceTensor(Device device, const HostTensor& host);
  // Every element `value` (rounded to dtype).
  static DeviceTensor filled(Device device, DType dtype, std::vector<std::int64_t> shape,
                             double value);
  // Every element a NaN: an op must overwrite all of it.
  static DeviceTensor poisoned(Device device, DType dtype, std::vector<std::int64_t> shape);
  // int32 data (maps, offsets) as a 1-D tensor.
  static DeviceTensor int32(Device device, std::span<const std::int32_t> values);

  Tensor view() const;
  const DeviceBuffer& buffer() const { return buffer_; }
  DeviceBuffer& buffer() { return buffer_; }
  std::vector<std::byte> bytes() const { return buffer_.download(); }
  std::vector<double> values() const { return decode(bytes(), dtype_); }

 private:
  DeviceTensor(DType dtype, std::vector<std::int64_t> shape, DeviceBuffer buffer);

  DType dtype_;
  std::vector<std::int64_t> shape_;
  DeviceBuffer buffer_;
};

// A non-blocking CUDA stream (it does not synchronize with the legacy
// default stream, so work the op wrongly put there is observable).
class TestStream {
 public:
  explicit TestStream(Device device);
  TestStream(const TestStream&) = delete;
  TestStream& operator=(const TestStream&) = delete;
  ~TestStream();

  Stream handle() const { return handle_; }
  void synchronize() const;

 private:
  Stream handle_ = nullptr;
};

// Holds back every later piece of work on a stream until release(): a host
// callback enqueued on the stream waits for the gate. It gives up after
// `timeout` (then timed_out() is true), so an op that wrongly synchronizes
// while the gate is closed stalls for `timeout` instead of deadlocking.
class StreamGate {
 public:
  StreamGate(const TestStream& stream, std::chrono::milliseconds timeout);
  ~StreamGate();
  void release();
  bool timed_out() const;

  struct Shared;

 private:
  std::shared_ptr<Shared> shared_;
};

// Captures what `enqueue` puts on `stream` into a CUDA graph in global
// capture mode (where a synchronizing or allocating call inside fails),
// launches the graph `launches` times in a row and waits for them.
void run_as_cuda_graph(const TestStream& stream, const std::function<void()>& enqueue,
                       int launches = 1);

// Copies `count` int32 values from memory on `device` (e.g. a
// CandidateMapDeviceView array) to the host.
std::vector<std::int32_t> read_int32(const std::int32_t* data, std::size_t count, Device device);

// Runs `call`, which must throw ikbo::Error whose message contains every
// fragment, and checks each buffer in `untouched` kept its bytes.
testing::AssertionResult throws_invalid_argument(
    const std::function<void()>& call, std::initializer_list<std::string_view> fragments,
    std::initializer_list<const DeviceBuffer*> untouched = {});

}  // namespace ikbo::test
