// Device memory, streams and the error assertion of the test harness (see
// device_harness.hpp). The CUDA runtime is called directly here, and only
// here, when the library was built with CUDA.
#include "device_harness.hpp"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <limits>
#include <thread>
#include <utility>

#ifdef IKBO_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace ikbo {
void PrintTo(const Device& device, std::ostream* stream) { *stream << device_name(device); }
void PrintTo(DType dtype, std::ostream* stream) { *stream << dtype_name(dtype); }
}  // namespace ikbo

namespace ikbo::test {
namespace {

#ifdef IKBO_WITH_CUDA
void check_cuda(cudaError_t status, const char* call) {
  if (status != cudaSuccess) {
    throw RuntimeError(std::string(call) + " failed: " + cudaGetErrorName(status) + ": " +
                       cudaGetErrorString(status));
  }
}
#define IKBO_TEST_CUDA_CHECK(call) check_cuda((call), #call)

cudaStream_t as_cuda(Stream stream) { return static_cast<cudaStream_t>(stream); }
#else
[[noreturn]] void no_cuda(const char* what) {
  throw RuntimeError(std::string(what) + " needs CUDA, but ikbo was built without CUDA");
}
#endif

}  // namespace

std::vector<Device> test_devices() { return {Device::cpu(), Device::cuda(0)}; }

std::string device_label(Device device) { return device.is_cuda() ? "cuda" : "cpu"; }

std::string dtype_label(DType dtype) {
  switch (dtype) {
    case DType::f16: return "f16";
    case DType::bf16: return "bf16";
    case DType::f32: return "f32";
    case DType::i32: return "i32";
  }
  return "unknown";
}

std::string device_param_name(const testing::TestParamInfo<Device>& info) {
  return device_label(info.param);
}

std::vector<DType> float_dtypes() { return {DType::f16, DType::bf16, DType::f32}; }

std::string device_dtype_param_name(const testing::TestParamInfo<DeviceDtype>& info) {
  return device_label(std::get<0>(info.param)) + "_" + dtype_label(std::get<1>(info.param));
}

std::optional<std::string> unavailable_reason(Device device) {
  if (!device.is_cuda()) return std::nullopt;
  if (!built_with_cuda()) return "ikbo built without CUDA";
  const int library_count = cuda_device_count();
  if (device.index < library_count) return std::nullopt;
#ifdef IKBO_WITH_CUDA
  int runtime_count = 0;
  const cudaError_t status = cudaGetDeviceCount(&runtime_count);
  if (status != cudaSuccess) {
    return std::string("no CUDA device: cudaGetDeviceCount failed: ") + cudaGetErrorName(status) +
           ": " + cudaGetErrorString(status);
  }
  return "no CUDA device: ikbo::cuda_device_count() = " + std::to_string(library_count) +
         " (the CUDA runtime reports " + std::to_string(runtime_count) + "), need device " +
         std::to_string(device.index);
#else
  return "ikbo built without CUDA";
#endif
}

std::optional<std::string> hopper_unavailable_reason(bool (*available)(Device),
                                                     std::string_view path) {
  const Device device = Device::cuda(0);
  if (auto reason = unavailable_reason(device)) return reason;
  if (available == nullptr || !available(device)) {
    return "CUDA device 0 is not a compute capability 9.0 GPU, this build carries no sm_90a "
           "code, or a Hopper kernel does not fit the device's shared memory: the Hopper " +
           std::string(path) + " path cannot run here";
  }
  return std::nullopt;
}

DeviceBuffer::DeviceBuffer(Device device, std::size_t bytes) : device_(device), bytes_(bytes) {
  if (bytes == 0) return;
  if (!device.is_cuda()) {
    data_ = ::operator new(bytes);
    return;
  }
#ifdef IKBO_WITH_CUDA
  IKBO_TEST_CUDA_CHECK(cudaSetDevice(device.index));
  IKBO_TEST_CUDA_CHECK(cudaMalloc(&data_, bytes));
#else
  no_cuda("DeviceBuffer");
#endif
}

DeviceBuffer::DeviceBuffer(Device device, std::span<const std::byte> contents)
    : DeviceBuffer(device, contents.size()) {
  upload(contents);
}

DeviceBuffer::DeviceBuffer(DeviceBuffer&& other) noexcept
    : device_(other.device_),
      bytes_(std::exchange(other.bytes_, 0)),
      data_(std::exchange(other.data_, nullptr)) {}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  if (this != &other) {
    release();
    device_ = other.device_;
    bytes_ = std::exchange(other.bytes_, 0);
    data_ = std::exchange(other.data_, nullptr);
  }
  return *this;
}

DeviceBuffer::~DeviceBuffer() { release(); }

void DeviceBuffer::release() noexcept {
  if (data_ == nullptr) return;
  if (device_.is_cuda()) {
#ifdef IKBO_WITH_CUDA
    // A destructor cannot throw; a failing cudaFree also fails the next
    // checked CUDA call, which does report.
    cudaFree(data_);
#endif
  } else {
    ::operator delete(data_);
  }
  data_ = nullptr;
}

void DeviceBuffer::upload(std::span<const std::byte> contents) {
  EXPECT_EQ(contents.size(), bytes_) << "DeviceBuffer::upload: size mismatch";
  const std::size_t count = std::min(contents.size(), bytes_);
  if (count == 0) return;
  if (!device_.is_cuda()) {
    std::memcpy(data_, contents.data(), count);
    return;
  }
#ifdef IKBO_WITH_CUDA
  IKBO_TEST_CUDA_CHECK(cudaMemcpy(data_, contents.data(), count, cudaMemcpyHostToDevice));
#else
  no_cuda("DeviceBuffer::upload");
#endif
}

std::vector<std::byte> DeviceBuffer::download() const {
  std::vector<std::byte> contents(bytes_);
  if (bytes_ == 0) return contents;
  if (!device_.is_cuda()) {
    std::memcpy(contents.data(), data_, bytes_);
    return contents;
  }
#ifdef IKBO_WITH_CUDA
  IKBO_TEST_CUDA_CHECK(cudaMemcpy(contents.data(), data_, bytes_, cudaMemcpyDeviceToHost));
#else
  no_cuda("DeviceBuffer::download");
#endif
  return contents;
}

DeviceTensor::DeviceTensor(DType dtype, std::vector<std::int64_t> shape, DeviceBuffer buffer)
    : dtype_(dtype), shape_(std::move(shape)), buffer_(std::move(buffer)) {}

DeviceTensor::DeviceTensor(Device device, const HostTensor& host)
    : DeviceTensor(host.dtype, host.shape, DeviceBuffer(device, host.bytes())) {}

DeviceTensor DeviceTensor::filled(Device device, DType dtype, std::vector<std::int64_t> shape,
                                  double value) {
  const std::vector<double> values(static_cast<std::size_t>(element_count(shape)), value);
  return DeviceTensor(dtype, std::move(shape), DeviceBuffer(device, encode(values, dtype)));
}

DeviceTensor DeviceTensor::poisoned(Device device, DType dtype, std::vector<std::int64_t> shape) {
  return filled(device, dtype, std::move(shape), std::numeric_limits<double>::quiet_NaN());
}

DeviceTensor DeviceTensor::int32(Device device, std::span<const std::int32_t> values) {
  return DeviceTensor(DType::i32, {static_cast<std::int64_t>(values.size())},
                      DeviceBuffer(device, std::as_bytes(values)));
}

Tensor DeviceTensor::view() const {
  Tensor tensor;
  tensor.data = buffer_.data();
  tensor.dtype = dtype_;
  tensor.device = buffer_.device();
  tensor.rank = static_cast<int>(shape_.size());
  std::copy(shape_.begin(), shape_.end(), tensor.shape.begin());
  return tensor;
}

TestStream::TestStream(Device device) {
#ifdef IKBO_WITH_CUDA
  IKBO_TEST_CUDA_CHECK(cudaSetDevice(device.index));
  cudaStream_t stream = nullptr;
  IKBO_TEST_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  handle_ = stream;
#else
  (void)device;
  no_cuda("TestStream");
#endif
}

TestStream::~TestStream() {
#ifdef IKBO_WITH_CUDA
  if (handle_) cudaStreamDestroy(as_cuda(handle_));
#endif
}

void TestStream::synchronize() const {
#ifdef IKBO_WITH_CUDA
  IKBO_TEST_CUDA_CHECK(cudaStreamSynchronize(as_cuda(handle_)));
#else
  no_cuda("TestStream::synchronize");
#endif
}

struct StreamGate::Shared {
  std::atomic<bool> open{false};
  std::atomic<bool> timed_out{false};
  std::chrono::milliseconds timeout{};
};

namespace {
#ifdef IKBO_WITH_CUDA
// Runs on a CUDA runtime thread; must not call CUDA. Owns one reference to
// the shared state, so the gate object may be destroyed before it runs.
void CUDART_CB wait_at_gate(void* user_data) {
  std::unique_ptr<std::shared_ptr<StreamGate::Shared>> shared(
      static_cast<std::shared_ptr<StreamGate::Shared>*>(user_data));
  const auto deadline = std::chrono::steady_clock::now() + (*shared)->timeout;
  while (!(*shared)->open.load()) {
    if (std::chrono::steady_clock::now() > deadline) {
      (*shared)->timed_out = true;
      return;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}
#endif
}  // namespace

StreamGate::StreamGate(const TestStream& stream, std::chrono::milliseconds timeout)
    : shared_(std::make_shared<Shared>()) {
  shared_->timeout = timeout;
#ifdef IKBO_WITH_CUDA
  auto callback_reference = std::make_unique<std::shared_ptr<Shared>>(shared_);
  IKBO_TEST_CUDA_CHECK(
      cudaLaunchHostFunc(as_cuda(stream.handle()), wait_at_gate, callback_reference.get()));
  callback_reference.release();  // now owned by wait_at_gate
#else
  (void)stream;
  no_cuda("StreamGate");
#endif
}

StreamGate::~StreamGate() { release(); }

void StreamGate::release() { shared_->open = true; }

bool StreamGate::timed_out() const { return shared_->timed_out; }

void run_as_cuda_graph(const TestStream& stream, const std::function<void()>& enqueue,
                       int launches) {
#ifdef IKBO_WITH_CUDA
  const cudaStream_t cuda_stream = as_cuda(stream.handle());
  IKBO_TEST_CUDA_CHECK(cudaStreamBeginCapture(cuda_stream, cudaStreamCaptureModeGlobal));
  cudaGraph_t graph = nullptr;
  try {
    enqueue();
  } catch (...) {
    // Leave the stream usable for the next test before reporting.
    if (cudaStreamEndCapture(cuda_stream, &graph) == cudaSuccess && graph) {
      cudaGraphDestroy(graph);
    }
    throw;
  }
  IKBO_TEST_CUDA_CHECK(cudaStreamEndCapture(cuda_stream, &graph));
  std::unique_ptr<CUgraph_st, decltype(&cudaGraphDestroy)> graph_owner(graph, cudaGraphDestroy);
  cudaGraphExec_t executable = nullptr;
  IKBO_TEST_CUDA_CHECK(cudaGraphInstantiate(&executable, graph, 0));
  std::unique_ptr<CUgraphExec_st, decltype(&cudaGraphExecDestroy)> executable_owner(
      executable, cudaGraphExecDestroy);
  for (int launch = 0; launch < launches; ++launch) {
    IKBO_TEST_CUDA_CHECK(cudaGraphLaunch(executable, cuda_stream));
  }
  IKBO_TEST_CUDA_CHECK(cudaStreamSynchronize(cuda_stream));
#else
  (void)stream;
  (void)enqueue;
  (void)launches;
  no_cuda("run_as_cuda_graph");
#endif
}

std::vector<std::int32_t> read_int32(const std::int32_t* data, std::size_t count, Device device) {
  std::vector<std::int32_t> values(count);
  const std::size_t bytes = count * sizeof(std::int32_t);
  if (count == 0) return values;
  if (!device.is_cuda()) {
    std::memcpy(values.data(), data, bytes);
    return values;
  }
#ifdef IKBO_WITH_CUDA
  IKBO_TEST_CUDA_CHECK(cudaMemcpy(values.data(), data, bytes, cudaMemcpyDeviceToHost));
#else
  no_cuda("read_int32");
#endif
  return values;
}

testing::AssertionResult throws_invalid_argument(
    const std::function<void()>& call, std::initializer_list<std::string_view> fragments,
    std::initializer_list<const DeviceBuffer*> untouched) {
  std::vector<std::vector<std::byte>> before;
  for (const DeviceBuffer* buffer : untouched) before.push_back(buffer->download());
  std::string message;
  try {
    call();
    return testing::AssertionFailure() << "no exception; expected ikbo::Error";
  } catch (const Error& error) {
    message = error.what();
  } catch (const std::exception& other) {
    return testing::AssertionFailure()
           << "expected ikbo::Error, got another exception: " << other.what();
  }
  for (std::string_view fragment : fragments) {
    if (message.find(fragment) == std::string::npos) {
      return testing::AssertionFailure()
             << "ikbo::Error message \"" << message << "\" does not contain \"" << fragment << "\"";
    }
  }
  std::size_t index = 0;
  for (const DeviceBuffer* buffer : untouched) {
    if (buffer->download() != before[index++]) {
      return testing::AssertionFailure()
             << "ikbo::Error (\"" << message << "\") was thrown, but output buffer #" << index
             << " was modified";
    }
  }
  return testing::AssertionSuccess() << "ikbo::Error: " << message;
}

}  // namespace ikbo::test
