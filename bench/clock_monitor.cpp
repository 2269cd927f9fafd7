// clock_monitor.cpp — NVML through dlopen: nvmlInit_v2, the device by its
// PCI bus id (CUDA's ordinal and NVML's index need not agree), then
// nvmlDeviceGetClockInfo(SM) and the clock event reasons, sampled on a
// thread. The few declarations needed are NVML's stable C ABI.
#include "clock_monitor.hpp"

#include <dlfcn.h>

#include <algorithm>
#include <chrono>

#ifdef IKBO_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace ikbo::bench {
namespace {

using NvmlDevice = struct NvmlDeviceOpaque*;
using NvmlReturn = int;  // nvmlReturn_t; 0 is NVML_SUCCESS
constexpr int kNvmlClockSm = 1;

struct ReasonName {
  std::uint64_t bit;
  const char* name;
};
// nvmlClocksEventReasons (formerly nvmlClocksThrottleReasons) bits that
// limit the clock (0x1, GPU idle, is not listed).
constexpr ReasonName kReasonNames[] = {
    {0x2, "applications clocks"}, {0x4, "power cap"},    {0x8, "hw slowdown"},
    {0x10, "sync boost"},         {0x20, "sw thermal"},  {0x40, "hw thermal"},
    {0x80, "power brake"},        {0x100, "display clocks"},
};
// Of those, the ones that follow from what the GPU ran before (power cap,
// hw slowdown, sw and hw thermal, power brake), which idling clears.
constexpr std::uint64_t kTransientLimits = 0x4 | 0x8 | 0x20 | 0x40 | 0x80;

}  // namespace

struct ClockMonitor::Nvml {
  void* library = nullptr;
  NvmlDevice device = nullptr;
  NvmlReturn (*shutdown)() = nullptr;
  NvmlReturn (*clock_info)(NvmlDevice, int, unsigned*) = nullptr;
  NvmlReturn (*event_reasons)(NvmlDevice, unsigned long long*) = nullptr;

  ~Nvml() {
    if (shutdown != nullptr) shutdown();
    if (library != nullptr) dlclose(library);
  }
};

std::vector<std::string> ClockSummary::reason_names() const {
  std::vector<std::string> names;
  for (const ReasonName& reason : kReasonNames) {
    if ((reasons & reason.bit) != 0) names.emplace_back(reason.name);
  }
  return names;
}

ClockMonitor::ClockMonitor(int ordinal) {
#ifdef IKBO_WITH_CUDA
  char bus_id[32] = {};
  if (cudaDeviceGetPCIBusId(bus_id, sizeof bus_id, ordinal) != cudaSuccess) {
    unavailable_reason_ = "cudaDeviceGetPCIBusId failed";
    return;
  }
  auto nvml = std::make_unique<Nvml>();
  nvml->library = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
  if (nvml->library == nullptr) {
    unavailable_reason_ = "libnvidia-ml.so.1 not found";
    return;
  }
  const auto symbol = [&](const char* name) { return dlsym(nvml->library, name); };
  const auto init = reinterpret_cast<NvmlReturn (*)()>(symbol("nvmlInit_v2"));
  const auto by_bus_id = reinterpret_cast<NvmlReturn (*)(const char*, NvmlDevice*)>(
      symbol("nvmlDeviceGetHandleByPciBusId_v2"));
  nvml->clock_info = reinterpret_cast<NvmlReturn (*)(NvmlDevice, int, unsigned*)>(
      symbol("nvmlDeviceGetClockInfo"));
  void* reasons = symbol("nvmlDeviceGetCurrentClocksEventReasons");
  if (reasons == nullptr) reasons = symbol("nvmlDeviceGetCurrentClocksThrottleReasons");
  nvml->event_reasons = reinterpret_cast<NvmlReturn (*)(NvmlDevice, unsigned long long*)>(reasons);
  if (init == nullptr || by_bus_id == nullptr || nvml->clock_info == nullptr ||
      nvml->event_reasons == nullptr) {
    unavailable_reason_ = "libnvidia-ml.so.1 lacks the functions used";
    return;
  }
  if (init() != 0) {
    unavailable_reason_ = "nvmlInit_v2 failed";
    return;
  }
  nvml->shutdown = reinterpret_cast<NvmlReturn (*)()>(symbol("nvmlShutdown"));
  if (by_bus_id(bus_id, &nvml->device) != 0) {
    unavailable_reason_ = std::string("NVML does not know the device at ") + bus_id;
    return;
  }
  nvml_ = std::move(nvml);
#else
  (void)ordinal;
  unavailable_reason_ = "built without CUDA";
#endif
}

ClockMonitor::~ClockMonitor() {
  if (sampling_.load()) stop();
}

void ClockMonitor::sample() {
  unsigned mhz = 0;
  unsigned long long reasons = 0;
  if (nvml_->clock_info(nvml_->device, kNvmlClockSm, &mhz) == 0) sm_mhz_.push_back(mhz);
  if (nvml_->event_reasons(nvml_->device, &reasons) == 0) reasons_ |= reasons;
}

void ClockMonitor::start() {
  if (!available()) return;
  if (sampling_.load()) stop();
  sm_mhz_.clear();
  reasons_ = 0;
  sampling_.store(true);
  sampler_ = std::thread([this] {
    while (sampling_.load()) {
      sample();
      std::this_thread::sleep_for(std::chrono::milliseconds(kSamplePeriodMs));
    }
  });
}

int ClockMonitor::settle(int max_ms) {
  if (!available()) return 0;
  const auto start = std::chrono::steady_clock::now();
  std::this_thread::sleep_for(std::chrono::milliseconds(std::min(kMinIdleMs, max_ms)));
  for (;;) {
    const auto waited = std::chrono::duration_cast<std::chrono::milliseconds>(
        std::chrono::steady_clock::now() - start);
    unsigned long long reasons = 0;
    const bool limited = nvml_->event_reasons(nvml_->device, &reasons) == 0 &&
                         (reasons & kTransientLimits) != 0;
    if (!limited || waited.count() >= max_ms) return static_cast<int>(waited.count());
    std::this_thread::sleep_for(std::chrono::milliseconds(kSettlePeriodMs));
  }
}

ClockSummary ClockMonitor::stop() {
  ClockSummary summary;
  if (!sampling_.load()) return summary;
  sampling_.store(false);
  sampler_.join();
  sample();
  if (sm_mhz_.empty()) return summary;
  std::sort(sm_mhz_.begin(), sm_mhz_.end());
  summary.samples = static_cast<int>(sm_mhz_.size());
  summary.median_sm_mhz = sm_mhz_[sm_mhz_.size() / 2];
  summary.min_sm_mhz = sm_mhz_.front();
  summary.reasons = reasons_;
  return summary;
}

}  // namespace ikbo::bench
