// suite.cpp — measuring one variant into a record, and the speedups within a shape.
#include "suite.hpp"

#include <algorithm>
#include <cstdio>
#include <exception>
#include <iostream>

namespace ikbo::bench {

std::string describe_shape(const std::vector<ShapeField>& shape) {
  std::string text;
  for (const auto& field : shape) {
    if (!text.empty()) text += ' ';
    text += field.name + '=' + std::to_string(field.value);
  }
  return text;
}

ShapeRecords::ShapeRecords(const BenchContext& context, std::string suite,
                           std::span<const std::string_view> variants,
                           std::vector<ShapeField> shape, Work work, std::optional<bool> jagged)
    : context_(context),
      suite_(std::move(suite)),
      variants_(variants),
      shape_(std::move(shape)),
      work_(work),
      jagged_(jagged) {}

Record ShapeRecords::make_record(std::string_view variant) const {
  Record record;
  record.suite = suite_;
  record.variant = variant;
  record.dtype = context_.options.dtype;
  record.shape = shape_;
  record.jagged = jagged_;
  return record;
}

void ShapeRecords::add(Record record) {
  std::cerr << suite_ << ' ' << describe_shape(shape_) << ' ' << record.variant << ": ";
  switch (record.outcome) {
    case Outcome::measured: {
      char line[96];
      std::snprintf(line, sizeof line, "%.4g ms, %.0f%% of floor", record.median_ms,
                    record.pct_of_floor);
      std::cerr << line;
      if (record.sm_mhz) {
        std::snprintf(line, sizeof line, " (%.0f MHz after %d ms idle)", *record.sm_mhz,
                      record.settled_ms.value_or(0));
        std::cerr << line;
      }
      std::cerr << '\n';
      break;
    }
    case Outcome::skipped: std::cerr << "skipped: " << record.note << '\n'; break;
    case Outcome::failed: std::cerr << "FAILED: " << record.note << '\n'; break;
  }
  records_.push_back(std::move(record));
}

bool ShapeRecords::selected(std::string_view variant) const {
  const auto& chosen = context_.options.variants;
  return chosen.empty() || std::find(chosen.begin(), chosen.end(), variant) != chosen.end();
}

void ShapeRecords::measure(std::string_view variant, const std::function<void()>& op) {
  if (!selected(variant)) return;
  Record record = make_record(variant);
  try {
    if (context_.options.profile) {
      context_.timer.profile(op);
      record.outcome = Outcome::skipped;
      record.note = "profiled (--profile: not timed)";
      add(std::move(record));
      return;
    }
    const RunSpread spread =
        context_.timer.spread_ms(op, context_.options.warmup, context_.options.reps);
    record.median_ms = spread.median_ms;
    record.min_ms = spread.min_ms;
    record.max_ms = spread.max_ms;
  } catch (const std::exception& error) {
    record.outcome = Outcome::failed;
    record.note = error.what();
    add(std::move(record));
    return;
  }
  record.tflops = work_.flops / (record.median_ms * 1e9);
  record.gbps = work_.min_bytes / (record.median_ms * 1e6);
  record.floor_ms = context_.ceilings.floor_ms(work_.flops, work_.min_bytes);
  record.pct_of_floor = 100.0 * record.floor_ms / record.median_ms;
  if (const auto clocks = context_.timer.last_clocks()) {
    record.sm_mhz = clocks->median_sm_mhz;
    record.min_sm_mhz = clocks->min_sm_mhz;
    record.clock_limits = clocks->reason_names();
    record.settled_ms = clocks->settled_ms;
  }
  add(std::move(record));
}

void ShapeRecords::skip(std::string_view variant, std::string reason) {
  if (!selected(variant)) return;
  Record record = make_record(variant);
  record.outcome = Outcome::skipped;
  record.note = std::move(reason);
  add(std::move(record));
}

void ShapeRecords::fail_remaining(std::string_view error) {
  for (std::string_view variant : variants_) {
    const bool recorded = std::any_of(records_.begin(), records_.end(), [&](const Record& record) {
      return record.variant == variant;
    });
    if (recorded || !selected(variant)) continue;
    Record record = make_record(variant);
    record.outcome = Outcome::failed;
    record.note = error;
    add(std::move(record));
  }
}

std::vector<Record> ShapeRecords::finish() {
  const auto rank = [&](const Record& record) {
    return std::find(variants_.begin(), variants_.end(), record.variant) - variants_.begin();
  };
  std::stable_sort(records_.begin(), records_.end(),
                   [&](const Record& a, const Record& b) { return rank(a) < rank(b); });
  auto median_of = [&](std::string_view variant) -> std::optional<double> {
    for (const auto& record : records_) {
      if (record.variant == variant && record.outcome == Outcome::measured) return record.median_ms;
    }
    return std::nullopt;
  };
  const auto broadcast_copy_ms = median_of(kBroadcastCopy);
  const auto broadcast_ms = median_of(kBroadcast);
  for (auto& record : records_) {
    if (record.outcome != Outcome::measured) continue;
    if (broadcast_copy_ms) record.speedup_vs_broadcast_copy = *broadcast_copy_ms / record.median_ms;
    if (broadcast_ms) record.speedup_vs_broadcast = *broadcast_ms / record.median_ms;
  }
  return std::move(records_);
}

}  // namespace ikbo::bench
