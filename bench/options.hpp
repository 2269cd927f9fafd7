// options.hpp — ikbo-bench's command line, and the default shapes per device.
//
//   ikbo-bench [lce|attention|linear|all] [--device cpu|cuda[:N]] [--dtype f16|bf16|f32]
//              [--B list] [--ratio list] [--M n] [--N n] [--Ku n] [--Kc n]
//              [--S list] [--H n] [--n-seed n] [--D n] [--jagged] [--q-scale n]
//              [--unsorted] [--reps n] [--warmup n] [--settle-ms n] [--json FILE]
//              [--variants list] [--profile] [--quick]
//
// Lists are comma separated. Explicit --B, --ratio and --S lists are crossed
// with each other. Attention takes the reference B and ratio where those
// lists are not given, and its S sweep where --S is not. The LCE and linear
// suites take the reference value for the one of --B and --ratio not given
// when the other is; with neither (--S alone included), the LCE suite runs
// both SPEC sweeps (B at ratio 70, then ratio at the sweep's B), and the
// linear suite (N_out = 512, Ku = 256, Kc = 3976: the example model's first
// MLP layer) B in {512, 1024, 2048, 3072} at ratio 70 and B = 1024 at
// ratio 2. SPEC is the project's specification (../shared/SPEC.md beside the
// checkout, not in this repository). Defaults depend on the device
// (GPU: the SPEC reference shapes in fp16; CPU: a scaled-down fp32 set that
// finishes in under a minute on 2 cores); --quick keeps one shape per suite
// and fewer reps, a smoke run. Options given explicitly always win.
#pragma once

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "ikbo/tensor.hpp"

namespace ikbo::bench {

// One request of the LCE or linear suite.
struct BatchShape {
  std::int64_t batch = 0;
  std::int64_t ratio = 0;
};

struct AttentionShape {
  std::int64_t batch = 0;
  std::int64_t ratio = 0;
  std::int64_t seq_len = 0;  // jagged: the mean history length
};

struct LceDims {
  std::int64_t m = 0, n = 0, ku = 0, kc = 0;
};

struct LinearDims {
  std::int64_t out_features = 0, ku = 0, kc = 0;
};

struct AttentionDims {
  std::int64_t heads = 0, n_seed = 0, head_dim = 0;
  bool jagged = false;  // per-user lengths drawn around S instead of S for all
  // Queries uniform in [-q_scale, q_scale) (keys and values in [-1, 1)):
  // at the default softmax scale the logits' standard deviation is q_scale / 3.
  std::int64_t q_scale = 1;
};

struct Options {
  bool run_lce = true;
  bool run_attention = true;
  bool run_linear = true;
  Device device{};
  DType dtype = DType::f16;
  LceDims lce;
  std::vector<BatchShape> lce_shapes;
  AttentionDims attention;
  std::vector<AttentionShape> attention_shapes;
  LinearDims linear;
  std::vector<BatchShape> linear_shapes;
  bool sorted_map = true;  // candidates grouped by user, as in the SPEC reference
  int reps = 0;
  int warmup = 0;
  // GPU: the longest idle before a variant's runs, waiting for the clock's
  // power and thermal limits to clear (0: none).
  int settle_ms = 2000;
  std::string json_path;  // empty: no JSON
  std::vector<std::string> variants;  // empty: every variant of each suite
  // No timing: each selected variant runs once to warm up, then once between
  // cudaProfilerStart/Stop, for `ncu --profile-from-start off`.
  bool profile = false;
};

class UsageError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Throws UsageError for a malformed command line; nullopt when --help was printed.
std::optional<Options> parse_options(int argc, const char* const* argv);

// "fp16", "bf16", "fp32": the dtype as records and tables name it.
std::string_view dtype_label(DType dtype);

}  // namespace ikbo::bench
