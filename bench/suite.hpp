// suite.hpp — what the LCE, attention and linear suites share: the run
// context, the variants timed at every shape, and how a shape's records are
// made.
//
// Variants, in table order:
//   ikbo            the library's default path (ikbo::lce / ikbo::attention /
//                   ikbo::linear)
//   broadcast       the standard way, on user tensors replicated beforehand
//   broadcast+copy  the same with the replication copy inside the timed region
// and for LCE the published staircase's stages between those and ikbo:
//   decomposed      user GEMM at U items + candidate GEMM at B (cuBLAS, the
//                   caller's K) + gather-add of the small user result
//   aligned         the same on copies with K zero-padded to a multiple of 8
//   fused           the Hopper kernel with the user GEMM in a launch of its
//                   own and the user add in the candidate GEMM's epilogue
#pragma once

#include <array>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "ceilings.hpp"
#include "options.hpp"
#include "record.hpp"
#include "timing.hpp"

namespace ikbo::bench {

inline constexpr std::string_view kIkbo = "ikbo";
inline constexpr std::string_view kBroadcast = "broadcast";
inline constexpr std::string_view kBroadcastCopy = "broadcast+copy";
inline constexpr std::string_view kDecomposed = "decomposed";
inline constexpr std::string_view kAligned = "aligned";
inline constexpr std::string_view kFused = "fused";

// Each suite's variants, in table order.
inline constexpr std::array<std::string_view, 6> kLceVariants{
    kIkbo, kBroadcast, kBroadcastCopy, kDecomposed, kAligned, kFused};
inline constexpr std::array<std::string_view, 3> kAttentionVariants{kIkbo, kBroadcast,
                                                                    kBroadcastCopy};
inline constexpr std::array<std::string_view, 4> kLinearVariants{kIkbo, kBroadcast, kBroadcastCopy,
                                                                  kDecomposed};

struct BenchContext {
  const Options& options;
  const Timer& timer;
  const Ceilings& ceilings;
  Device device() const { return timer.device(); }
  Stream stream() const { return timer.stream(); }
};

// The useful work of one shape, the same for every variant: FLOPs of the
// IKBO computation and the bytes it must move at least (every input read
// once, the output written once).
struct Work {
  double flops = 0;
  double min_bytes = 0;
};

// Collects the records of one shape: times each variant, or notes why it was
// skipped or how it failed, then adds the speedups between variants.
class ShapeRecords {
 public:
  // `variants`: the suite's variants in table order (kLceVariants, ...).
  ShapeRecords(const BenchContext& context, std::string suite,
               std::span<const std::string_view> variants, std::vector<ShapeField> shape, Work work,
               std::optional<bool> jagged = std::nullopt);

  // Times `op` (warm-up and reps from the options). An exception from the op
  // becomes a failed record; the run goes on.
  void measure(std::string_view variant, const std::function<void()>& op);
  void skip(std::string_view variant, std::string reason);
  // Records every variant not yet recorded as failed with `error` (for a
  // failure in a shape's setup, outside any timed op).
  void fail_remaining(std::string_view error);

  // The records in variant order, with speedups filled in.
  std::vector<Record> finish();

 private:
  bool selected(std::string_view variant) const;  // by --variants
  Record make_record(std::string_view variant) const;
  void add(Record record);

  const BenchContext& context_;
  std::string suite_;
  std::span<const std::string_view> variants_;
  std::vector<ShapeField> shape_;
  Work work_;
  std::optional<bool> jagged_;
  std::vector<Record> records_;
};

std::vector<Record> run_lce_suite(const BenchContext& context);
std::vector<Record> run_attention_suite(const BenchContext& context);
std::vector<Record> run_linear_suite(const BenchContext& context);

// "B=1024 ratio=70 U=15", for progress lines and messages.
std::string describe_shape(const std::vector<ShapeField>& shape);

}  // namespace ikbo::bench
