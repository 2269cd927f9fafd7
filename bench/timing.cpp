// timing.cpp — run times on the CPU (steady_clock) or a CUDA device
// (events, L2 flushed before every run).
#include "timing.hpp"

#include <algorithm>
#include <chrono>
#include <string>
#include <vector>

#include "ikbo/error.hpp"

#ifdef IKBO_WITH_CUDA
#include <cuda_profiler_api.h>

#include "cuda_check.hpp"
#include "gpu_wait.hpp"
#endif

namespace ikbo::bench {
namespace {

#ifdef IKBO_WITH_CUDA
class CudaEvent {
 public:
  CudaEvent() { IKBO_BENCH_CHECK(cudaEventCreate(&event_)); }
  ~CudaEvent() { cudaEventDestroy(event_); }  // must not throw
  CudaEvent(const CudaEvent&) = delete;
  CudaEvent& operator=(const CudaEvent&) = delete;
  cudaEvent_t get() const { return event_; }

 private:
  cudaEvent_t event_ = nullptr;
};

// The GPU's head start before a series (gpu_wait.hpp): enough for the host
// to queue the warm-up and every timed run even at ten times its usual
// ~20 us per run.
constexpr long long kHeadStartNs = 10'000'000;

std::size_t l2_flush_bytes(Device device) {
  int l2_bytes = 0;
  IKBO_BENCH_CHECK(cudaDeviceGetAttribute(&l2_bytes, cudaDevAttrL2CacheSize, device.index));
  return 2 * static_cast<std::size_t>(l2_bytes);
}
#endif

}  // namespace

Timer::Timer(Device device, Stream stream, int settle_ms)
    : settle_ms_(settle_ms), device_(device), stream_(stream) {
  if (!device.is_cuda()) return;
#ifdef IKBO_WITH_CUDA
  l2_flush_ = Buffer(l2_flush_bytes(device), device);
  clocks_ = std::make_unique<ClockMonitor>(device.index);
#else
  throw Error("a CUDA device was requested, but ikbo-bench was built without CUDA");
#endif
}

std::vector<double> Timer::run_ms(const std::function<void()>& op, int warmup, int reps) const {
  if (reps < 1) throw Error("Timer: reps must be >= 1");
#ifdef IKBO_WITH_CUDA
  if (device_.is_cuda()) return run_ms_cuda(op, warmup, reps);
#endif
  return run_ms_cpu(op, warmup, reps);
}

std::string Timer::clock_sampling() const {
#ifdef IKBO_WITH_CUDA
  if (clocks_) {
    if (!clocks_->available()) return "SM clock not sampled: " + clocks_->unavailable_reason();
    std::string sampling = "SM clock and its limits (NVML) sampled every " +
                           std::to_string(ClockMonitor::kSamplePeriodMs) +
                           " ms during the timed runs";
    if (settle_ms_ > 0) {
      sampling += "; before each variant, idle " + std::to_string(ClockMonitor::kMinIdleMs) +
                  " ms and then until no power or thermal limit (at most " +
                  std::to_string(settle_ms_) + " ms)";
    }
    return sampling;
  }
#endif
  return "";
}

RunSpread Timer::spread_ms(const std::function<void()>& op, int warmup, int reps) const {
  std::vector<double> samples = run_ms(op, warmup, reps);
  std::sort(samples.begin(), samples.end());
  const std::size_t middle = samples.size() / 2;
  return {samples.size() % 2 ? samples[middle] : 0.5 * (samples[middle - 1] + samples[middle]),
          samples.front(), samples.back()};
}

void Timer::profile([[maybe_unused]] const std::function<void()>& op) const {
#ifdef IKBO_WITH_CUDA
  if (device_.is_cuda()) {
    const auto stream = static_cast<cudaStream_t>(stream_);
    op();
    IKBO_BENCH_CHECK(cudaStreamSynchronize(stream));
    IKBO_BENCH_CHECK(cudaProfilerStart());
    op();
    IKBO_BENCH_CHECK(cudaStreamSynchronize(stream));
    IKBO_BENCH_CHECK(cudaProfilerStop());
    return;
  }
#endif
  throw Error("--profile needs a CUDA device");
}

std::vector<double> Timer::run_ms_cpu(const std::function<void()>& op, int warmup, int reps) const {
  for (int i = 0; i < warmup; ++i) op();
  std::vector<double> samples;
  samples.reserve(static_cast<std::size_t>(reps));
  for (int i = 0; i < reps; ++i) {
    const auto start = std::chrono::steady_clock::now();
    op();
    const auto stop = std::chrono::steady_clock::now();
    samples.push_back(std::chrono::duration<double, std::milli>(stop - start).count());
  }
  return samples;
}

#ifdef IKBO_WITH_CUDA
std::vector<double> Timer::run_ms_cuda(const std::function<void()>& op, int warmup,
                                       int reps) const {
  const auto stream = static_cast<cudaStream_t>(stream_);
  int settled_ms = 0;
  if (settle_ms_ > 0) {
    IKBO_BENCH_CHECK(cudaStreamSynchronize(stream));
    settled_ms = clocks_->settle(settle_ms_);
  }
  // The warm-up and the timed runs queued behind a wait on the GPU, one
  // event pair per run, read after the last: the host enqueues every run
  // before the GPU reaches it, so none of the host's time sits between two
  // events. (The wait precedes the warm-up, which leaves the GPU as busy
  // before the first timed run as between two of them.)
  enqueue_gpu_wait(stream, kHeadStartNs);
  for (int i = 0; i < warmup; ++i) op();
  const CudaEvent warmed_up;
  IKBO_BENCH_CHECK(cudaEventRecord(warmed_up.get(), stream));
  std::vector<CudaEvent> starts(static_cast<std::size_t>(reps));
  std::vector<CudaEvent> stops(static_cast<std::size_t>(reps));
  for (std::size_t i = 0; i < starts.size(); ++i) {
    IKBO_BENCH_CHECK(
        cudaMemsetAsync(l2_flush_.data(), static_cast<int>(i & 0xff), l2_flush_.bytes(), stream));
    IKBO_BENCH_CHECK(cudaEventRecord(starts[i].get(), stream));
    op();
    IKBO_BENCH_CHECK(cudaEventRecord(stops[i].get(), stream));
  }
  // The clock is sampled while the timed runs run.
  IKBO_BENCH_CHECK(cudaEventSynchronize(warmed_up.get()));
  clocks_->start();
  const cudaError_t synchronized = cudaEventSynchronize(stops.back().get());
  ClockSummary clocks = clocks_->stop();
  clocks.settled_ms = settled_ms;
  last_clocks_.reset();
  if (clocks.samples > 0) last_clocks_ = clocks;
  IKBO_BENCH_CHECK(synchronized);
  IKBO_BENCH_CHECK(cudaGetLastError());
  std::vector<double> samples;
  samples.reserve(starts.size());
  for (std::size_t i = 0; i < starts.size(); ++i) {
    float elapsed_ms = 0;
    IKBO_BENCH_CHECK(cudaEventElapsedTime(&elapsed_ms, starts[i].get(), stops[i].get()));
    samples.push_back(elapsed_ms);
  }
  return samples;
}
#endif

}  // namespace ikbo::bench
