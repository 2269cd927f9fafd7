// record.hpp — one benchmark result: one variant of one op at one shape,
// with its roofline figures. Flat, as the JSON record format of DESIGN.md
// ("Benchmark record format") stores it.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "ikbo/tensor.hpp"

namespace ikbo::bench {

struct ShapeField {
  std::string name;  // "B", "ratio", "U", then the suite's dims ("M", "S", ...)
  std::int64_t value = 0;
  friend bool operator==(const ShapeField&, const ShapeField&) = default;
};

enum class Outcome { measured, skipped, failed };

struct Record {
  std::string suite;    // "lce" | "attention" | "linear"
  // "ikbo" | "broadcast" | "broadcast+copy"; lce also "decomposed" | "aligned" | "fused"
  std::string variant;
  DType dtype = DType::f16;
  std::vector<ShapeField> shape;
  std::optional<bool> jagged;  // attention only

  Outcome outcome = Outcome::measured;
  std::string note;  // skipped: why; failed: the error

  // Measured records only. TFLOP/s and GB/s use the same useful work and
  // minimum traffic for every variant of a shape, so they compare directly.
  double median_ms = 0;
  // The fastest and slowest timed runs: a wide spread (a series that fell
  // into two modes, or was disturbed) makes the median worth less.
  double min_ms = 0, max_ms = 0;
  double tflops = 0;
  double gbps = 0;
  double floor_ms = 0;
  double pct_of_floor = 0;  // 100 * floor_ms / median_ms: 100 means at the roofline
  std::optional<double> speedup_vs_broadcast_copy;  // t(broadcast+copy) / t(this)
  std::optional<double> speedup_vs_broadcast;       // t(broadcast) / t(this)
  // GPU: the SM clock during the timed runs (median and lowest sample),
  // what held it below its maximum, and how long the timer idled before the
  // runs for the power and thermal limits to clear (clock_monitor.hpp);
  // empty elsewhere.
  std::optional<double> sm_mhz, min_sm_mhz;
  std::vector<std::string> clock_limits;
  std::optional<int> settled_ms;
};

}  // namespace ikbo::bench
