// CPU backend: fp16 / bf16 <-> fp32 conversion and the dtype switch.
//
// Bit-exact integer implementations (round to nearest even, subnormals, Inf
// and NaN handled), written without branches so GCC vectorizes the array
// loops with whatever vector ISA the build targets. They do not depend on
// `_Float16` / `__bf16`, whose GCC 12 support on x86-64 is partial, nor on
// F16C, which the portable build does not assume.
//
// Storage types: `Half` (IEEE binary16), `BFloat16` and `float`. Kernels are
// written once as templates over the storage type; `visit_storage` is the
// single place that maps a runtime DType to one of them.
#pragma once

#include <algorithm>
#include <bit>
#include <cstdint>
#include <string>
#include <type_traits>

#include "ikbo/error.hpp"
#include "ikbo/tensor.hpp"

namespace ikbo::detail::cpu {

struct Half {
  std::uint16_t bits;
};
struct BFloat16 {
  std::uint16_t bits;
};

inline float to_float(float value) { return value; }

inline float to_float(Half value) {
  const std::uint32_t sign = static_cast<std::uint32_t>(value.bits & 0x8000u) << 16;
  // Exponent and mantissa moved to float positions: read as a float, that is
  // the half value times 2^-112 (exponent bias 15 instead of 127), subnormals
  // included, so one exact multiplication rebiases every finite value.
  const std::uint32_t magnitude = static_cast<std::uint32_t>(value.bits & 0x7fffu) << 13;
  const std::uint32_t rebiased =
      std::bit_cast<std::uint32_t>(std::bit_cast<float>(magnitude) * 0x1p112f);
  // Half exponent 31 (Inf, NaN) becomes float exponent 255, mantissa kept.
  const std::uint32_t bits = magnitude >= 0x0f800000u ? (rebiased | 0x7f800000u) : rebiased;
  return std::bit_cast<float>(bits | sign);
}

inline float to_float(BFloat16 value) {
  return std::bit_cast<float>(static_cast<std::uint32_t>(value.bits) << 16);
}

template <typename Storage>
Storage round_to(float value);

template <>
inline float round_to<float>(float value) {
  return value;
}

template <>
inline Half round_to<Half>(float value) {
  const std::uint32_t bits = std::bit_cast<std::uint32_t>(value);
  const std::uint32_t sign = (bits >> 16) & 0x8000u;
  const std::uint32_t magnitude = bits & 0x7fffffffu;
  // Binade 2^e of the value, at least 2^-14 (below it the half spacing stays 2^-24).
  const std::uint32_t exponent_field = std::max(magnitude & 0x7f800000u, 113u << 23);
  // Adding 2^(e+13) leaves exactly the half's 11 significant bits in the sum's
  // mantissa, and the float addition itself rounds to nearest even. The sum's
  // mantissa is the half's significand (implicit bit included, 2048 after a
  // carry into the next binade), so adding the half exponent field minus one
  // yields the half bits for normals, subnormals and carries alike.
  const float rounding_offset = std::bit_cast<float>(exponent_field + (13u << 23));
  const std::uint32_t sum =
      std::bit_cast<std::uint32_t>(std::bit_cast<float>(magnitude) + rounding_offset);
  const std::uint32_t finite = ((exponent_field >> 13) - (113u << 10)) + (sum & 0x007fffffu);
  // From 2^16 on (and for Inf) the result is Inf; NaN stays NaN (quiet bit
  // set, payload truncated). [65520, 65536) reaches Inf through the carry above.
  const std::uint32_t special =
      magnitude > 0x7f800000u ? (0x7e00u | ((magnitude >> 13) & 0x03ffu)) : 0x7c00u;
  // A mask, not a select: GCC turns a select into a branch around the float
  // addition, which -ftrapping-math then keeps from being vectorized.
  const std::uint32_t finite_mask = 0u - static_cast<std::uint32_t>(magnitude < 0x47800000u);
  return Half{
      static_cast<std::uint16_t>(((finite & finite_mask) | (special & ~finite_mask)) | sign)};
}

template <>
inline BFloat16 round_to<BFloat16>(float value) {
  const std::uint32_t bits = std::bit_cast<std::uint32_t>(value);
  const bool is_nan = (bits & 0x7fffffffu) > 0x7f800000u;
  // Round to nearest even on the 16 dropped bits; overflow carries into Inf,
  // which is the correctly rounded result.
  const std::uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  const std::uint32_t quiet_nan = (bits >> 16) | 0x0040u;
  return BFloat16{static_cast<std::uint16_t>(is_nan ? quiet_nan : rounded)};
}

// dst[i] = float(src[i]).
template <typename Storage>
inline void convert_to_float(const Storage* __restrict src, float* __restrict dst,
                             std::int64_t count) {
  for (std::int64_t i = 0; i < count; ++i) dst[i] = to_float(src[i]);
}

// dst[i] = round(src[i]).
template <typename Storage>
inline void round_from_float(const float* __restrict src, Storage* __restrict dst,
                             std::int64_t count) {
  for (std::int64_t i = 0; i < count; ++i) dst[i] = round_to<Storage>(src[i]);
}

// Calls fn(Storage{}) with the storage type of `dtype` (f16, bf16 or f32).
template <typename Fn>
decltype(auto) visit_storage(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::f16:
      return fn(Half{});
    case DType::bf16:
      return fn(BFloat16{});
    case DType::f32:
      return fn(float{});
    case DType::i32:
      break;
  }
  throw RuntimeError(std::string("cpu backend: no floating-point storage for dtype ") +
                     dtype_name(dtype));
}

}  // namespace ikbo::detail::cpu
