// report.hpp — what ikbo-bench prints and saves: a preamble with the device
// and the measured ceilings, one aligned table per suite on stdout (a line
// per record, a blank line between shapes), and the JSON of DESIGN.md's
// benchmark record format:
//   {"device", "date", "commit", "backend", "settings", "ceilings",
//    "records": [flat measured records], "not_measured": [skipped or failed]}
#pragma once

#include <ostream>
#include <string>
#include <vector>

#include "ceilings.hpp"
#include "options.hpp"
#include "record.hpp"

namespace ikbo::bench {

struct RunInfo {
  std::string device_name;  // GPU name or CPU model
  std::string date;         // UTC, ISO 8601
  std::string commit;
  const Options& options;
  const Ceilings& ceilings;
  std::string clock_sampling;  // GPU: how the SM clock is sampled, or why not
};

void print_preamble(std::ostream& out, const RunInfo& run);
void print_tables(std::ostream& out, const std::vector<Record>& records);
// Throws ikbo::RuntimeError when the file cannot be written.
void write_json(const std::string& path, const RunInfo& run, const std::vector<Record>& records);

}  // namespace ikbo::bench
