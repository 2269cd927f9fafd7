// clock_monitor.hpp — what the GPU's clock did while ikbo-bench timed a
// variant: the SM clock and the reasons the driver gave for holding it
// below its maximum (the power cap above all: a long sweep of heavy GEMMs
// draws the board's power limit, and the kernels timed after them run at
// lower clocks than the ceilings measured at the start). Read through NVML,
// which is loaded at run time: a machine without the driver (CI) has none,
// and the records then carry no clock fields.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace ikbo::bench {

struct ClockSummary {
  int samples = 0;
  double median_sm_mhz = 0;
  double min_sm_mhz = 0;
  // NVML's clock event reasons seen in any sample.
  std::uint64_t reasons = 0;
  // Milliseconds idled before the runs (ClockMonitor::settle).
  int settled_ms = 0;

  // The reasons that limit the clock, by name ("power cap", "hw thermal",
  // ...; GPU idle is not one); empty when none.
  std::vector<std::string> reason_names() const;
};

class ClockMonitor {
 public:
  // NVML for CUDA device `ordinal`; unavailable (with the reason) when the
  // library, the driver or the device cannot be reached.
  explicit ClockMonitor(int ordinal);
  ~ClockMonitor();
  ClockMonitor(const ClockMonitor&) = delete;
  ClockMonitor& operator=(const ClockMonitor&) = delete;

  bool available() const { return nvml_ != nullptr; }
  const std::string& unavailable_reason() const { return unavailable_reason_; }

  // Samples the SM clock and the event reasons every kSamplePeriodMs on a
  // thread from start() until stop() (and once more at stop(), after the
  // thread has joined: the samples are never touched by two threads at
  // once); a start() while sampling starts over.
  static constexpr int kSamplePeriodMs = 2;
  void start();
  ClockSummary stop();

  // Idles kMinIdleMs and then until the driver reports no power or thermal
  // limit on the clock (checked every kSettlePeriodMs), for at most max_ms;
  // returns the milliseconds waited. The GPU must have no work queued.
  // Returns at once when NVML is unavailable. The flag alone is not enough:
  // on H100 it is often clear right after a burst at the power limit while
  // the next burst still starts throttled (attention at S = 4096 read 629
  // instead of 705 TFLOP/s with no idle; 50 ms restored it every time,
  // bench/notes/attention_sm90.md, session 22).
  static constexpr int kMinIdleMs = 100;
  static constexpr int kSettlePeriodMs = 10;
  int settle(int max_ms);

 private:
  struct Nvml;
  void sample();

  std::unique_ptr<Nvml> nvml_;
  std::string unavailable_reason_;
  std::thread sampler_;
  std::atomic<bool> sampling_{false};
  std::vector<unsigned> sm_mhz_;
  std::uint64_t reasons_ = 0;
};

}  // namespace ikbo::bench
