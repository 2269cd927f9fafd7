// random.cpp — host-side random inputs, converted to the storage dtype.
#include "random.hpp"

#include <algorithm>
#include <cstring>

#include "cpu/convert.hpp"
#include "ikbo/error.hpp"

namespace ikbo::bench {
namespace {

using detail::cpu::BFloat16;
using detail::cpu::Half;
using detail::cpu::round_to;

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
    case DType::f16: draw<Half>(destination, count, scale, rng, round_to<Half>); return;
    case DType::bf16: draw<BFloat16>(destination, count, scale, rng, round_to<BFloat16>); return;
    case DType::f32: draw<float>(destination, count, scale, rng, round_to<float>); return;
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
