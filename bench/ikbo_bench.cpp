// ikbo_bench.cpp — ikbo-bench: times the IKBO ops against the broadcast
// baselines on the CPU or a CUDA device and judges every result against the
// roofline measured at the start of the same run. Tables go to stdout,
// progress to stderr, and with --json FILE the records to a file
// (options.hpp lists the command line; bench/README.md explains the output).
//
// Exit status: 0 when every variant was measured or deliberately skipped,
// 1 when one failed or the run could not start, 2 for a bad command line.
#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <ctime>
#include <exception>
#include <iostream>

#include "ceilings.hpp"
#include "device_resources.hpp"
#include "options.hpp"
#include "report.hpp"
#include "suite.hpp"
#include "timing.hpp"

namespace ikbo::bench {
namespace {

std::string utc_now() {
  const std::time_t now = std::time(nullptr);
  std::tm utc{};
  gmtime_r(&now, &utc);
  char text[32];
  std::strftime(text, sizeof text, "%Y-%m-%dT%H:%M:%SZ", &utc);
  return text;
}

// IKBO_COMMIT in the environment names the commit when the binary was built
// outside the checkout it measures; otherwise the configure-time HEAD.
std::string commit_id() {
  const char* from_environment = std::getenv("IKBO_COMMIT");
  return from_environment && *from_environment ? from_environment : IKBO_GIT_COMMIT;
}

int run(const Options& options) {
  const auto start = std::chrono::steady_clock::now();
  const DeviceStream stream(options.device);
  const Timer timer(options.device, stream.get(), options.settle_ms);
  std::cerr << "measuring ceilings on " << device_name(options.device) << '\n';
  const Ceilings ceilings = measure_ceilings(timer, options.dtype);
  const RunInfo run_info{describe_device(options.device), utc_now(), commit_id(), options,
                         ceilings, timer.clock_sampling()};
  print_preamble(std::cout, run_info);

  const BenchContext context{options, timer, ceilings};
  std::vector<Record> records;
  if (options.run_lce) {
    for (Record& record : run_lce_suite(context)) records.push_back(std::move(record));
  }
  if (options.run_attention) {
    for (Record& record : run_attention_suite(context)) records.push_back(std::move(record));
  }
  if (options.run_linear) {
    for (Record& record : run_linear_suite(context)) records.push_back(std::move(record));
  }
  print_tables(std::cout, records);
  if (!options.json_path.empty()) {
    write_json(options.json_path, run_info, records);
    std::cerr << "wrote " << options.json_path << '\n';
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::cerr << "done in " << static_cast<int>(seconds + 0.5) << " s\n";
  const bool any_failed = std::any_of(records.begin(), records.end(), [](const Record& record) {
    return record.outcome == Outcome::failed;
  });
  return any_failed ? 1 : 0;
}

}  // namespace
}  // namespace ikbo::bench

int main(int argc, char** argv) {
  using namespace ikbo::bench;
  try {
    const auto options = parse_options(argc, argv);
    return options ? run(*options) : 0;
  } catch (const UsageError& error) {
    std::cerr << "ikbo-bench: " << error.what() << "\n(see ikbo-bench --help)\n";
    return 2;
  } catch (const std::exception& error) {
    std::cerr << "ikbo-bench: error: " << error.what() << '\n';
    return 1;
  }
}
