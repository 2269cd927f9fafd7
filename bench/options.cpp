// options.cpp — command-line parsing and the per-device default shapes.
#include "options.hpp"

#include <charconv>
#include <iostream>

#include <algorithm>

#include "ikbo/ikbo.hpp"
#include "suite.hpp"

namespace ikbo::bench {
namespace {

constexpr std::string_view kUsage = R"(usage: ikbo-bench [lce|attention|linear|all] [options]

Times the library's IKBO ops ("ikbo") against the broadcast baselines
("broadcast": the op on pre-replicated user tensors; "broadcast+copy": the
replication copy included) and reports each against the roofline measured at
the start of the run. For LCE it also times the published staircase's stages
(CUDA only): "decomposed" (cuBLAS user GEMM at U items and candidate GEMM at
B on the given K, then a gather-add of the user result), "aligned" (the same
with K zero-padded to a multiple of 8 beforehand) and "fused" (Hopper GPUs:
the user GEMM in its own launch, then the candidate GEMM adding it in its
epilogue). Linear (N_out = 512 over Ku = 256 user and Kc = 3976 candidate
features, the example model's first MLP layer) times the broadcast
baselines (one cuBLASLt matmul, as F.linear runs it) and "decomposed" (the
library's cuBLAS path: user GEMM, candidate GEMM, combine kernel), on CUDA
only; on Hopper GPUs ikbo is one launch adding the user part in the
candidate GEMM's epilogue.

  --device cpu|cuda[:N]  default: cuda if a GPU is visible, else cpu
  --dtype f16|bf16|f32   default: f16 on a GPU, f32 on the CPU
  --B list               candidates per request (comma separated)
  --ratio list           candidates per user; U = round(B / ratio)
  --M n --N n --Ku n --Kc n     LCE dims (default 433, 256, 1178, 866)
  --S list               attention history length (jagged: the mean length)
  --H n --n-seed n --D n        attention heads, queries per candidate, head dim
                                (default 2, 64, 128)
  --jagged               jagged K/V: user lengths uniform in [S/2, 3S/2]
  --q-scale n            attention queries uniform in [-n, n) instead of [-1, 1):
                         logits of standard deviation n / 3 instead of 1 / 3
                         (the online softmax rescales more often as they grow)
  --unsorted             shuffle cand_to_user (default: grouped by user)
  --reps n --warmup n    timed and untimed runs per record
                         (default 30 and 5 on a GPU, 5 and 1 on the CPU)
  --settle-ms n          GPU: before each variant, idle 100 ms and then until the
                         driver reports no power or thermal limit on the SM
                         clock, for at most n ms (default 2000; 0: never), so
                         that no variant inherits the power state of the one
                         before it
  --json FILE            also write the records as JSON
  --variants list        time only these variants (comma separated names)
  --profile              no timing: run each variant once between
                         cudaProfilerStart/Stop, for Nsight Compute with
                         --profile-from-start off (scripts/profile-variants)
  --quick                one shape per suite and fewer reps (a smoke run)

Default shapes. GPU: LCE B in {512,1024,1536,2048,2560,3072} at ratio 70 and
ratio in {2,5,10,50,100,1000} at B = 1024; attention B = 2048, ratio 64,
S in {512,...,16384}; linear B in {512,1024,2048,3072} at ratio 70 and
B = 1024 at ratio 2. CPU (fp32): LCE B = 128 at ratio 70 and at ratio 5;
attention B = 256, ratio 64, S in {256,512}; linear B = 128 at ratio 70 and
at ratio 2. --quick: GPU LCE and linear B = 1024 at ratio 70, attention
S = 2048, 20 reps; CPU LCE and linear B = 64, attention B = 128, S = 256,
3 reps. --B and --ratio apply to LCE, attention and linear alike.
)";

struct Defaults {
  DType dtype;
  std::vector<std::int64_t> lce_batch_sweep;  // at lce_ratio
  std::int64_t lce_ratio;
  std::vector<std::int64_t> lce_ratio_sweep;  // at lce_batch
  std::int64_t lce_batch;
  std::int64_t attention_batch;
  std::int64_t attention_ratio;
  std::vector<std::int64_t> seq_lens;
  std::vector<BatchShape> linear_shapes;
  int reps;
  int warmup;
};

constexpr LceDims kReferenceLce{433, 256, 1178, 866};
constexpr AttentionDims kReferenceAttention{2, 64, 128, false, 1};
// The first MLP layer of examples/ranking_model, as python/ikbo/bench.py times it.
constexpr LinearDims kReferenceLinear{512, 256, 3976};

// GPU: the SPEC reference sweeps. CPU: the reference dims at batches that
// keep the whole default run (every suite, ceilings included) under a minute
// on 2 cores, in fp32, the CPU backend's compute dtype.
Defaults defaults_for(Device device, bool quick) {
  if (device.is_cuda()) {
    if (quick) {
      return {.dtype = DType::f16,
              .lce_batch_sweep = {1024},
              .lce_ratio = 70,
              .lce_ratio_sweep = {},
              .lce_batch = 1024,
              .attention_batch = 2048,
              .attention_ratio = 64,
              .seq_lens = {2048},
              .linear_shapes = {{1024, 70}},
              .reps = 20,
              .warmup = 2};
    }
    return {.dtype = DType::f16,
            .lce_batch_sweep = {512, 1024, 1536, 2048, 2560, 3072},
            .lce_ratio = 70,
            .lce_ratio_sweep = {2, 5, 10, 50, 100, 1000},
            .lce_batch = 1024,
            .attention_batch = 2048,
            .attention_ratio = 64,
            .seq_lens = {512, 1024, 2048, 4096, 8192, 16384},
            .linear_shapes = {{512, 70}, {1024, 70}, {2048, 70}, {3072, 70}, {1024, 2}},
            .reps = 30,
            .warmup = 5};
  }
  if (quick) {
    return {.dtype = DType::f32,
            .lce_batch_sweep = {64},
            .lce_ratio = 70,
            .lce_ratio_sweep = {},
            .lce_batch = 64,
            .attention_batch = 128,
            .attention_ratio = 64,
            .seq_lens = {256},
            .linear_shapes = {{64, 70}},
            .reps = 3,
            .warmup = 1};
  }
  return {.dtype = DType::f32,
          .lce_batch_sweep = {128},
          .lce_ratio = 70,
          .lce_ratio_sweep = {5},
          .lce_batch = 128,
          .attention_batch = 256,
          .attention_ratio = 64,
          .seq_lens = {256, 512},
          .linear_shapes = {{128, 70}, {128, 2}},
          .reps = 5,
          .warmup = 1};
}

std::int64_t parse_integer(std::string_view text, std::string_view option, std::int64_t minimum) {
  std::int64_t value = 0;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (error != std::errc() || end != text.data() + text.size()) {
    throw UsageError(std::string(option) + " expects an integer, got '" + std::string(text) + "'");
  }
  if (value < minimum) {
    throw UsageError(std::string(option) + " must be >= " + std::to_string(minimum) + ", got " +
                     std::to_string(value));
  }
  return value;
}

std::vector<std::int64_t> parse_list(std::string_view text, std::string_view option) {
  std::vector<std::int64_t> values;
  while (true) {
    const auto comma = text.find(',');
    values.push_back(parse_integer(text.substr(0, comma), option, 1));
    if (comma == std::string_view::npos) return values;
    text.remove_prefix(comma + 1);
  }
}

DType parse_dtype(std::string_view text) {
  if (text == "f16" || text == "fp16" || text == "float16") return DType::f16;
  if (text == "bf16" || text == "bfloat16") return DType::bf16;
  if (text == "f32" || text == "fp32" || text == "float32") return DType::f32;
  throw UsageError("--dtype expects f16, bf16 or f32, got '" + std::string(text) + "'");
}

Device parse_device(std::string_view text) {
  if (text == "cpu") return Device::cpu();
  if (text == "cuda" || text.starts_with("cuda:")) {
    const int ordinal =
        text == "cuda" ? 0 : static_cast<int>(parse_integer(text.substr(5), "--device cuda:N", 0));
    const int visible = cuda_device_count();
    if (ordinal >= visible) {
      throw UsageError("--device " + std::string(text) + ": " +
                       (built_with_cuda() ? std::to_string(visible) + " CUDA device(s) visible"
                                          : std::string("this build has no CUDA backend")));
    }
    return Device::cuda(ordinal);
  }
  throw UsageError("--device expects cpu or cuda[:N], got '" + std::string(text) + "'");
}

std::vector<std::string> parse_variants(std::string_view text) {
  std::vector<std::string> variants;
  while (!text.empty()) {
    const std::size_t comma = text.find(',');
    const std::string_view name = text.substr(0, comma);
    const bool known = std::find(kLceVariants.begin(), kLceVariants.end(), name) !=
                           kLceVariants.end() ||
                       std::find(kAttentionVariants.begin(), kAttentionVariants.end(), name) !=
                           kAttentionVariants.end();
    if (!known) throw UsageError("--variants: unknown variant '" + std::string(name) + "'");
    variants.emplace_back(name);
    text = comma == std::string_view::npos ? std::string_view{} : text.substr(comma + 1);
  }
  if (variants.empty()) throw UsageError("--variants expects at least one name");
  return variants;
}

// What the command line said; unset fields take the device's defaults.
struct CommandLine {
  std::optional<Device> device;
  std::optional<DType> dtype;
  std::optional<std::vector<std::int64_t>> batches, ratios, seq_lens;
  LceDims lce = kReferenceLce;
  AttentionDims attention = kReferenceAttention;
  std::optional<int> reps, warmup;
  bool quick = false;
};

}  // namespace

std::string_view dtype_label(DType dtype) {
  switch (dtype) {
    case DType::f16: return "fp16";
    case DType::bf16: return "bf16";
    case DType::f32: return "fp32";
    case DType::i32: return "int32";
  }
  return "unknown";
}

std::optional<Options> parse_options(int argc, const char* const* argv) {
  Options options;
  CommandLine given;
  bool suite_given = false;
  for (int i = 1; i < argc; ++i) {
    std::string_view argument = argv[i];
    if (!argument.starts_with("--")) {
      if (suite_given) {
        throw UsageError("more than one suite given: '" + std::string(argument) + "'");
      }
      suite_given = true;
      options.run_lce = argument == "lce" || argument == "all";
      options.run_attention = argument == "attention" || argument == "all";
      options.run_linear = argument == "linear" || argument == "all";
      if (!options.run_lce && !options.run_attention && !options.run_linear) {
        throw UsageError("unknown suite '" + std::string(argument) +
                         "' (expected lce, attention, linear or all)");
      }
      continue;
    }
    // --name value or --name=value
    std::string_view name = argument;
    std::optional<std::string_view> inline_value;
    if (const auto equals = argument.find('='); equals != std::string_view::npos) {
      name = argument.substr(0, equals);
      inline_value = argument.substr(equals + 1);
    }
    auto value = [&]() -> std::string_view {
      if (inline_value) return *inline_value;
      if (i + 1 >= argc) throw UsageError(std::string(name) + " expects a value");
      return argv[++i];
    };
    auto flag = [&] {
      if (inline_value) throw UsageError(std::string(name) + " takes no value");
    };
    if (name == "--help" || name == "-h") {
      std::cout << kUsage;
      return std::nullopt;
    } else if (name == "--device") {
      given.device = parse_device(value());
    } else if (name == "--dtype") {
      given.dtype = parse_dtype(value());
    } else if (name == "--B") {
      given.batches = parse_list(value(), name);
    } else if (name == "--ratio") {
      given.ratios = parse_list(value(), name);
    } else if (name == "--S") {
      given.seq_lens = parse_list(value(), name);
    } else if (name == "--M") {
      given.lce.m = parse_integer(value(), name, 1);
    } else if (name == "--N") {
      given.lce.n = parse_integer(value(), name, 1);
    } else if (name == "--Ku") {
      given.lce.ku = parse_integer(value(), name, 1);
    } else if (name == "--Kc") {
      given.lce.kc = parse_integer(value(), name, 1);
    } else if (name == "--H") {
      given.attention.heads = parse_integer(value(), name, 1);
    } else if (name == "--n-seed") {
      given.attention.n_seed = parse_integer(value(), name, 1);
    } else if (name == "--D") {
      given.attention.head_dim = parse_integer(value(), name, 1);
    } else if (name == "--jagged") {
      flag();
      given.attention.jagged = true;
    } else if (name == "--q-scale") {
      given.attention.q_scale = parse_integer(value(), name, 1);
    } else if (name == "--unsorted") {
      flag();
      options.sorted_map = false;
    } else if (name == "--reps") {
      given.reps = static_cast<int>(parse_integer(value(), name, 1));
    } else if (name == "--warmup") {
      given.warmup = static_cast<int>(parse_integer(value(), name, 0));
    } else if (name == "--settle-ms") {
      options.settle_ms = static_cast<int>(parse_integer(value(), name, 0));
    } else if (name == "--json") {
      options.json_path = value();
    } else if (name == "--variants") {
      options.variants = parse_variants(value());
    } else if (name == "--profile") {
      flag();
      options.profile = true;
    } else if (name == "--quick") {
      flag();
      given.quick = true;
    } else {
      throw UsageError("unknown option '" + std::string(name) + "'");
    }
  }

  options.device = given.device.value_or(cuda_device_count() > 0 ? Device::cuda(0) : Device::cpu());
  const Defaults defaults = defaults_for(options.device, given.quick);
  options.dtype = given.dtype.value_or(defaults.dtype);
  options.reps = given.reps.value_or(defaults.reps);
  options.warmup = given.warmup.value_or(defaults.warmup);
  options.lce = given.lce;
  options.attention = given.attention;
  options.linear = kReferenceLinear;

  if (given.batches || given.ratios) {
    for (std::int64_t batch : given.batches.value_or(std::vector{defaults.lce_batch})) {
      for (std::int64_t ratio : given.ratios.value_or(std::vector{defaults.lce_ratio})) {
        options.lce_shapes.push_back({batch, ratio});
      }
    }
    options.linear_shapes = options.lce_shapes;  // linear's reference B and ratio are LCE's
  } else {
    for (std::int64_t batch : defaults.lce_batch_sweep) {
      options.lce_shapes.push_back({batch, defaults.lce_ratio});
    }
    for (std::int64_t ratio : defaults.lce_ratio_sweep) {
      options.lce_shapes.push_back({defaults.lce_batch, ratio});
    }
    options.linear_shapes = defaults.linear_shapes;
  }
  for (std::int64_t batch : given.batches.value_or(std::vector{defaults.attention_batch})) {
    for (std::int64_t ratio : given.ratios.value_or(std::vector{defaults.attention_ratio})) {
      for (std::int64_t seq_len : given.seq_lens.value_or(defaults.seq_lens)) {
        options.attention_shapes.push_back({batch, ratio, seq_len});
      }
    }
  }
  return options;
}

}  // namespace ikbo::bench
