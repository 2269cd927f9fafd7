// report.cpp — the preamble, the per-suite tables and the JSON file.
#include "report.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>

#include "ikbo/error.hpp"
#include "json.hpp"
#include "random.hpp"

namespace ikbo::bench {
namespace {

// Columns aligned on their widest cell: the first (the variant) left, the
// rest right. A row may end in free text that takes no part in the widths.
class TextTable {
 public:
  void add_row(std::vector<std::string> cells, std::string trailing = {}) {
    rows_.push_back({std::move(cells), std::move(trailing)});
  }
  void add_blank() { rows_.push_back({}); }

  void print(std::ostream& out) const {
    std::vector<std::size_t> widths;
    for (const Row& row : rows_) {
      widths.resize(std::max(widths.size(), row.cells.size()));
      for (std::size_t i = 0; i < row.cells.size(); ++i) {
        widths[i] = std::max(widths[i], row.cells[i].size());
      }
    }
    for (const Row& row : rows_) {
      std::string line;
      for (std::size_t i = 0; i < row.cells.size(); ++i) {
        const std::string padding(widths[i] - row.cells[i].size(), ' ');
        if (i) line += "  ";
        line += i == 0 ? row.cells[i] + padding : padding + row.cells[i];
      }
      if (!row.trailing.empty()) line += "  " + row.trailing;
      out << line << '\n';
    }
  }

 private:
  struct Row {
    std::vector<std::string> cells;
    std::string trailing;
  };
  std::vector<Row> rows_;
};

// Four significant digits, never an exponent: 0.4821, 12.35, 760.2, 3021.
std::string significant(double value) {
  if (!(value > 0) || !std::isfinite(value)) return "0";
  const int integer_digits = static_cast<int>(std::floor(std::log10(value))) + 1;
  const int decimals = std::clamp(4 - integer_digits, 0, 6);
  char text[48];
  std::snprintf(text, sizeof text, "%.*f", decimals, value);
  return text;
}

std::string format(const char* pattern, double value) {
  char text[48];
  std::snprintf(text, sizeof text, pattern, value);
  return text;
}

std::string speedup(const std::optional<double>& value) {
  return value ? format("%.2fx", *value) : std::string("-");
}

const char* suite_title(const std::string& suite) {
  if (suite == "lce") {
    return "lce: out[b] = w_c @ e_c[b] + w_u @ e_u[u(b)];  FLOPs = 2*M*N*(B*Kc + U*Ku) for every "
           "variant";
  }
  if (suite == "linear") {
    return "linear: out[b] = x_c[b] @ w_c^T + x_u[u(b)] @ w_u^T + bias;  FLOPs = "
           "2*N_out*(B*Kc + U*Ku) for every variant";
  }
  return "attention: out[b] = softmax(q[b] k[u(b)]^T / sqrt(D)) v[u(b)];  FLOPs = "
         "4*H*n_seed*D * sum over candidates of their user's length (4*B*H*n_seed*D*S dense)";
}

// The median SM clock, and what held it down: "1980", "1815 power cap".
std::string clock_cell(const Record& record) {
  if (!record.sm_mhz) return "-";
  std::string cell = format("%.0f", *record.sm_mhz);
  for (std::size_t i = 0; i < record.clock_limits.size(); ++i) {
    cell += (i == 0 ? " " : "+") + record.clock_limits[i];
  }
  return cell;
}

void print_suite(std::ostream& out, const std::vector<const Record*>& records) {
  TextTable table;
  std::vector<std::string> header{"variant"};
  for (const auto& field : records.front()->shape) header.push_back(field.name);
  for (const char* column :
       {"median_ms", "TFLOP/s", "GB/s", "floor_ms", "%floor", "vs bcast+copy", "vs bcast"}) {
    header.emplace_back(column);
  }
  const bool clocks = std::any_of(records.begin(), records.end(),
                                  [](const Record* record) { return record->sm_mhz.has_value(); });
  if (clocks) header.emplace_back("SM MHz");
  table.add_row(std::move(header));
  const std::vector<ShapeField>* previous_shape = nullptr;
  for (const Record* record : records) {
    if (previous_shape && *previous_shape != record->shape) table.add_blank();
    previous_shape = &record->shape;

    std::vector<std::string> cells{record->variant};
    for (const auto& field : record->shape) cells.push_back(std::to_string(field.value));
    if (record->outcome != Outcome::measured) {
      table.add_row(
          std::move(cells),
          (record->outcome == Outcome::skipped ? "skipped: " : "FAILED: ") + record->note);
      continue;
    }
    for (std::string cell :
         {significant(record->median_ms), significant(record->tflops), significant(record->gbps),
          significant(record->floor_ms), format("%.1f%%", record->pct_of_floor),
          speedup(record->speedup_vs_broadcast_copy), speedup(record->speedup_vs_broadcast)}) {
      cells.push_back(std::move(cell));
    }
    if (clocks) cells.push_back(clock_cell(*record));
    table.add_row(std::move(cells));
  }
  out << '\n' << suite_title(records.front()->suite) << '\n';
  table.print(out);
}

JsonObject record_json(const Record& record) {
  JsonObject json;
  json.add("suite", record.suite)
      .add("variant", record.variant)
      .add("dtype", dtype_label(record.dtype));
  for (const auto& field : record.shape) json.add(field.name, field.value);
  if (record.jagged) json.add("jagged", *record.jagged);
  if (record.outcome != Outcome::measured) {
    json.add("outcome", record.outcome == Outcome::skipped ? "skipped" : "failed")
        .add("reason", record.note);
    return json;
  }
  json.add("median_ms", record.median_ms)
      .add("min_ms", record.min_ms)
      .add("max_ms", record.max_ms)
      .add("tflops", record.tflops)
      .add("gbps", record.gbps)
      .add("floor_ms", record.floor_ms)
      .add("pct_of_floor", record.pct_of_floor)
      .add("speedup_vs_broadcast_copy", record.speedup_vs_broadcast_copy)
      .add("speedup_vs_broadcast", record.speedup_vs_broadcast);
  if (record.sm_mhz) {
    std::string limits = "[";
    for (const std::string& limit : record.clock_limits) {
      limits += (limits.size() > 1 ? ", " : "") + json_quote(limit);
    }
    json.add("sm_mhz", record.sm_mhz)
        .add("min_sm_mhz", record.min_sm_mhz)
        .add_json("clock_limits", limits + "]")
        .add("settled_ms", record.settled_ms);
  }
  return json;
}

std::string timing_method(const Options& options) {
  return options.device.is_cuda() ? "CUDA events, L2 flushed before every run" : "steady_clock";
}

}  // namespace

void print_preamble(std::ostream& out, const RunInfo& run) {
  const Options& options = run.options;
  out << "ikbo-bench  commit " << run.commit << "  " << run.date << '\n'
      << "device      " << device_name(options.device) << "  " << run.device_name << '\n'
      << "settings    " << dtype_label(options.dtype) << ", median of " << options.reps
      << " runs after " << options.warmup << " warm-up, " << timing_method(options)
      << ", cand_to_user " << (options.sorted_map ? "sorted" : "shuffled") << '\n'
      << "ceilings    matmul " << significant(run.ceilings.matmul_tflops) << " TFLOP/s ("
      << run.ceilings.matmul_method << ")\n"
      << "            bandwidth " << significant(run.ceilings.bandwidth_gbps) << " GB/s ("
      << run.ceilings.bandwidth_method << ")\n"
      << "roofline    floor = max(FLOPs / matmul, min bytes / bandwidth); min bytes = every "
         "input read once + output written once;\n"
      << "            %floor = 100 * floor / median; speedups = the baseline's median / this "
         "median\n";
  if (!run.clock_sampling.empty()) out << "clocks      " << run.clock_sampling << '\n';
}

void print_tables(std::ostream& out, const std::vector<Record>& records) {
  std::vector<std::string> suites;
  for (const Record& record : records) {
    if (std::find(suites.begin(), suites.end(), record.suite) == suites.end()) {
      suites.push_back(record.suite);
    }
  }
  for (const std::string& suite : suites) {
    std::vector<const Record*> selected;
    for (const Record& record : records) {
      if (record.suite == suite) selected.push_back(&record);
    }
    print_suite(out, selected);
  }
}

void write_json(const std::string& path, const RunInfo& run, const std::vector<Record>& records) {
  const Options& options = run.options;
  JsonObject settings;
  settings.add("reps", options.reps)
      .add("warmup", options.warmup)
      .add("timing", timing_method(options))
      .add("cand_to_user", options.sorted_map ? "sorted" : "shuffled")
      .add("inputs", kInputs);
  if (!run.clock_sampling.empty()) settings.add("clocks", run.clock_sampling);
  JsonObject ceilings;
  ceilings.add("matmul_tflops", run.ceilings.matmul_tflops)
      .add("matmul_method", run.ceilings.matmul_method)
      .add("bandwidth_gbps", run.ceilings.bandwidth_gbps)
      .add("bandwidth_method", run.ceilings.bandwidth_method);
  // One record per line: diffs of committed results stay readable.
  auto records_array = [&](bool measured) {
    std::string text = "[";
    bool first = true;
    for (const Record& record : records) {
      if ((record.outcome == Outcome::measured) != measured) continue;
      text += first ? "\n    " : ",\n    ";
      text += record_json(record).str();
      first = false;
    }
    return text + (first ? "]" : "\n  ]");
  };

  std::ofstream file(path);
  if (!file) throw RuntimeError("cannot open '" + path + "' for writing");
  file << "{\n"
       << "  \"device\": " << json_quote(run.device_name) << ",\n"
       << "  \"date\": " << json_quote(run.date) << ",\n"
       << "  \"commit\": " << json_quote(run.commit) << ",\n"
       << "  \"backend\": " << json_quote(device_name(options.device)) << ",\n"
       << "  \"settings\": " << settings.str() << ",\n"
       << "  \"ceilings\": " << ceilings.str() << ",\n"
       << "  \"records\": " << records_array(true) << ",\n"
       << "  \"not_measured\": " << records_array(false) << "\n"
       << "}\n";
  file.close();
  if (!file) throw RuntimeError("writing '" + path + "' failed");
}

}  // namespace ikbo::bench
