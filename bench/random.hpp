// random.hpp — deterministic random inputs for ikbo-bench.
//
// Rng is SplitMix64: fast, and seeded per tensor (and per chunk of a tensor,
// so filling runs on all threads), so every run on every device times the
// same values.
// random_values() draws uniform values in [-scale, scale) and stores them in
// the benchmark's dtype (f16 and bf16 rounded to nearest even), ready to be
// copied to the device.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "ikbo/tensor.hpp"

namespace ikbo::bench {

class Rng {
 public:
  explicit Rng(std::uint64_t seed) : state_(seed) {}

  std::uint64_t next() {
    std::uint64_t mixed = (state_ += 0x9e3779b97f4a7c15ull);
    mixed = (mixed ^ (mixed >> 30)) * 0xbf58476d1ce4e5b9ull;
    mixed = (mixed ^ (mixed >> 27)) * 0x94d049bb133111ebull;
    return mixed ^ (mixed >> 31);
  }
  // Uniform in [-1, 1), 24 random bits (a float's full mantissa).
  float symmetric_unit() { return static_cast<float>(next() >> 40) * 0x1p-23f - 1.0f; }
  // Uniform integer in [0, bound): the high half of a 64x64-bit product, free
  // of the modulo bias.
  std::uint64_t below(std::uint64_t bound) {
    return static_cast<std::uint64_t>((static_cast<unsigned __int128>(next()) * bound) >> 64);
  }

 private:
  std::uint64_t state_;
};

// `count` values uniform in [-scale, scale), encoded in `dtype` (f16, bf16 or f32).
std::vector<std::byte> random_values(DType dtype, std::int64_t count, float scale,
                                     std::uint64_t seed);

// What a record says of its inputs: random_values' draw (the Python bench's
// record says the same of its own).
inline constexpr const char* kInputs =
    "uniform in [-1, 1) (weights and bias scaled, queries by --q-scale), 24 random bits, "
    "rounded once to the dtype";

}  // namespace ikbo::bench
