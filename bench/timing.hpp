// timing.hpp — the one way ikbo-bench times an op.
//
// GPU: CUDA events around each run on the bench's stream; before every run
// (outside the events) a memset over a buffer twice the L2 size evicts the
// previous run's data, so every run starts from HBM as in a real request.
// CPU: std::chrono::steady_clock around each (synchronous) run; nothing is
// flushed, the inputs are far larger than the caches anyway.
// Both: `warmup` untimed runs first, then `reps` timed runs. Records report
// the median run, with the fastest and slowest beside it (how far the runs
// spread); ceilings the fastest (the best the platform reached).
// GPU: before the warm-up, the timer idles until the driver reports no
// power or thermal limit on the clock (at most settle_ms; clock_monitor.hpp),
// so that each variant starts from the same state rather than from what the
// one before it left; then the warm-up and the timed runs are queued behind
// a 10 ms wait on the GPU (gpu_wait.hpp), so that none of the host's time
// is timed; the SM clock is sampled during the timed runs.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "clock_monitor.hpp"
#include "device_resources.hpp"
#include "ikbo/tensor.hpp"

namespace ikbo::bench {

// The median, fastest and slowest of a series of timed runs (records report
// the median, ceilings the fastest).
struct RunSpread {
  double median_ms = 0, min_ms = 0, max_ms = 0;
};

class Timer {
 public:
  Timer(Device device, Stream stream, int settle_ms);

  // Milliseconds of each timed run, in run order.
  std::vector<double> run_ms(const std::function<void()>& op, int warmup, int reps) const;
  RunSpread spread_ms(const std::function<void()>& op, int warmup, int reps) const;
  // Runs `op` once, then once more between cudaProfilerStart and
  // cudaProfilerStop (CUDA devices only).
  void profile(const std::function<void()>& op) const;

  Device device() const { return device_; }
  Stream stream() const { return stream_; }
  // The SM clock during the last run_ms (CUDA, NVML reachable), else empty.
  std::optional<ClockSummary> last_clocks() const { return last_clocks_; }
  // How the clock is sampled, or why it is not.
  std::string clock_sampling() const;

 private:
  std::vector<double> run_ms_cpu(const std::function<void()>& op, int warmup, int reps) const;
#ifdef IKBO_WITH_CUDA
  std::vector<double> run_ms_cuda(const std::function<void()>& op, int warmup, int reps) const;
  Buffer l2_flush_;
  std::unique_ptr<ClockMonitor> clocks_;
#endif
  int settle_ms_;
  mutable std::optional<ClockSummary> last_clocks_;

  Device device_;
  Stream stream_;
};

}  // namespace ikbo::bench
