// random.cpp — host-side random inputs, converted to the storage dtype.
#include "random.hpp"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>

#include "ikbo/error.hpp"

namespace ikbo::bench {
namespace {

// IEEE binary16, round to nearest even, overflow to infinity.
std::uint16_t to_half_bits(float value) {
  const auto bits = std::bit_cast<std::uint32_t>(value);
  const auto sign = static_cast<std::uint16_t>((bits >> 16) & 0x8000u);
  const std::uint32_t magnitude = bits & 0x7fffffffu;
  if (magnitude > 0x7f800000u) return sign | 0x7e00u;   // NaN stays NaN
  if (magnitude >= 0x477ff000u) return sign | 0x7c00u;  // rounds past 65504: infinity
  if (magnitude < 0x38800000u) {
    // Below the smallest normal half (2^-14): a multiple of 2^-24. The scaling
    // is exact, so nearbyint's round-to-even is the only rounding.
    const float units = std::bit_cast<float>(magnitude) * 0x1p24f;
    return sign | static_cast<std::uint16_t>(std::nearbyint(units));
  }
  // Rebias the exponent (127 -> 15) and drop 13 mantissa bits; adding half an
  // ulp minus one plus the kept lsb rounds ties to even, and a carry out of
  // the mantissa correctly bumps the exponent.
  const std::uint32_t rounded = magnitude + 0xfffu + ((magnitude >> 13) & 1u);
  return sign | static_cast<std::uint16_t>((rounded - (112u << 23)) >> 13);
}

// bfloat16 is the top half of a float: round the dropped half to nearest even.
std::uint16_t to_bfloat16_bits(float value) {
  const auto bits = std::bit_cast<std::uint32_t>(value);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((bits >> 16) | 0x40u);
  return static_cast<std::uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

template <typename Element, typename Encode>
void draw(std::byte* destination, std::int64_t count, float scale, Rng& rng, Encode encode) {
  for (std::int64_t i = 0; i < count; ++i) {
    const Element encoded = encode(scale * rng.symmetric_unit());
    std::memcpy(destination + i * static_cast<std::int64_t>(sizeof(Element)), &encoded,
                sizeof(Element));
  }
}

void draw_chunk(std::byte* destination, DType dtype, std::int64_t count, float scale, Rng& rng) {
  switch (dtype) {
    case DType::f16: draw<std::uint16_t>(destination, count, scale, rng, to_half_bits); return;
    case DType::bf16: draw<std::uint16_t>(destination, count, scale, rng, to_bfloat16_bits); return;
    case DType::f32:
      draw<float>(destination, count, scale, rng, [](float value) { return value; });
      return;
    case DType::i32: return;  // rejected by random_values before any drawing
  }
}

}  // namespace

std::vector<std::byte> random_values(DType dtype, std::int64_t count, float scale,
                                     std::uint64_t seed) {
  if (dtype == DType::i32) throw Error("random_values: int32 is not a benchmark input dtype");
  const auto element = static_cast<std::int64_t>(dtype_size(dtype));
  std::vector<std::byte> values(static_cast<std::size_t>(count * element));
  // One generator per chunk, seeded from (seed, chunk): the values do not
  // depend on the thread count, and gigabytes of inputs fill in parallel.
  constexpr std::int64_t kChunk = std::int64_t{1} << 20;
  const std::int64_t chunks = (count + kChunk - 1) / kChunk;
#pragma omp parallel for schedule(static)
  for (std::int64_t chunk = 0; chunk < chunks; ++chunk) {
    Rng rng(Rng(seed ^ (static_cast<std::uint64_t>(chunk) * 0xd1b54a32d192ed03ull)).next());
    const std::int64_t begin = chunk * kChunk;
    draw_chunk(values.data() + begin * element, dtype, std::min(kChunk, count - begin), scale, rng);
  }
  return values;
}

}  // namespace ikbo::bench
