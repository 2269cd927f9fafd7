// fp64 references, fp16/bf16 encoding and the test data helpers (see reference.hpp).
#include "reference.hpp"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <numeric>
#include <sstream>

namespace ikbo::test {

std::uint16_t float_to_half_bits(float value) {
  const auto bits = std::bit_cast<std::uint32_t>(value);
  const auto sign = static_cast<std::uint16_t>((bits >> 16) & 0x8000u);
  const std::uint32_t magnitude = bits & 0x7FFFFFFFu;
  if (magnitude > 0x7F800000u) return sign | 0x7E00u;  // NaN
  // 65520 is halfway between the largest half (65504) and 2^16; the tie
  // rounds to the even neighbour, which is Inf.
  if (magnitude >= 0x477FF000u) return sign | 0x7C00u;
  if (magnitude < 0x38800000u) {
    // Below the smallest normal half (2^-14): a multiple of 2^-24. Scaling by
    // a power of two is exact; nearbyint rounds half to even.
    const float units = std::nearbyint(std::bit_cast<float>(magnitude) * 16777216.0f);
    return sign | static_cast<std::uint16_t>(units);
  }
  // Normal: drop 13 mantissa bits with round-to-nearest-even; a carry out of
  // the mantissa correctly bumps the exponent. 0x38000000 rebiases 127 -> 15.
  const std::uint32_t rounded = magnitude + 0xFFFu + ((magnitude >> 13) & 1u);
  return sign | static_cast<std::uint16_t>((rounded - 0x38000000u) >> 13);
}

float half_bits_to_float(std::uint16_t bits) {
  const float sign = (bits & 0x8000u) ? -1.0f : 1.0f;
  const int exponent = (bits >> 10) & 0x1F;
  const int mantissa = bits & 0x3FF;
  if (exponent == 0) return sign * std::ldexp(static_cast<float>(mantissa), -24);
  if (exponent == 31) {
    return mantissa ? std::numeric_limits<float>::quiet_NaN()
                    : sign * std::numeric_limits<float>::infinity();
  }
  return sign * std::ldexp(static_cast<float>(1024 + mantissa), exponent - 25);
}

std::uint16_t float_to_bfloat16_bits(float value) {
  const auto bits = std::bit_cast<std::uint32_t>(value);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) {
    return static_cast<std::uint16_t>(((bits >> 16) & 0x8000u) | 0x7FC0u);
  }
  const std::uint32_t rounded = bits + 0x7FFFu + ((bits >> 16) & 1u);
  return static_cast<std::uint16_t>(rounded >> 16);
}

float bfloat16_bits_to_float(std::uint16_t bits) {
  return std::bit_cast<float>(static_cast<std::uint32_t>(bits) << 16);
}

double round_to_dtype(double value, DType dtype) {
  const auto single = static_cast<float>(value);
  switch (dtype) {
    case DType::f16: return half_bits_to_float(float_to_half_bits(single));
    case DType::bf16: return bfloat16_bits_to_float(float_to_bfloat16_bits(single));
    case DType::f32: return single;
    case DType::i32: break;
  }
  ADD_FAILURE() << "round_to_dtype: not a floating dtype: " << dtype_name(dtype);
  return value;
}

std::vector<std::byte> encode(std::span<const double> values, DType dtype) {
  std::vector<std::byte> bytes(values.size() * dtype_size(dtype));
  for (std::size_t i = 0; i < values.size(); ++i) {
    const auto single = static_cast<float>(values[i]);
    std::byte* slot = bytes.data() + i * dtype_size(dtype);
    if (dtype == DType::f32) {
      std::memcpy(slot, &single, sizeof(single));
    } else {
      const std::uint16_t half =
          dtype == DType::f16 ? float_to_half_bits(single) : float_to_bfloat16_bits(single);
      std::memcpy(slot, &half, sizeof(half));
    }
  }
  return bytes;
}

std::vector<double> decode(std::span<const std::byte> bytes, DType dtype) {
  const std::size_t element = dtype_size(dtype);
  std::vector<double> values(bytes.size() / element);
  for (std::size_t i = 0; i < values.size(); ++i) {
    const std::byte* slot = bytes.data() + i * element;
    if (dtype == DType::f32) {
      float single;
      std::memcpy(&single, slot, sizeof(single));
      values[i] = single;
    } else {
      std::uint16_t half;
      std::memcpy(&half, slot, sizeof(half));
      values[i] = dtype == DType::f16 ? half_bits_to_float(half) : bfloat16_bits_to_float(half);
    }
  }
  return values;
}

std::vector<std::byte> poison_bytes(DType dtype, std::size_t count) {
  const std::vector<double> nans(count, std::numeric_limits<double>::quiet_NaN());
  return encode(nans, dtype);
}

std::int64_t element_count(std::span<const std::int64_t> shape) {
  return std::accumulate(shape.begin(), shape.end(), std::int64_t{1},
                         std::multiplies<std::int64_t>());
}

std::string shape_text(std::span<const std::int64_t> shape) {
  std::ostringstream text;
  text << '[';
  for (std::size_t i = 0; i < shape.size(); ++i) text << (i ? ", " : "") << shape[i];
  text << ']';
  return text.str();
}

const char* map_order_name(MapOrder order) {
  switch (order) {
    case MapOrder::sorted: return "sorted";
    case MapOrder::unsorted: return "unsorted";
    case MapOrder::uneven: return "uneven";
    case MapOrder::uneven_unsorted: return "uneven_unsorted";
  }
  return "unknown";
}

namespace {

std::uint64_t choose_seed() {
  if (const char* fixed = std::getenv("IKBO_TEST_SEED")) return std::strtoull(fixed, nullptr, 10);
  std::random_device entropy;
  return (static_cast<std::uint64_t>(entropy()) << 32) | entropy();
}

std::string seed_message(std::uint64_t seed) {
  return "random seed " + std::to_string(seed) +
         " (rerun with IKBO_TEST_SEED=" + std::to_string(seed) + ")";
}

}  // namespace

SeededRng::SeededRng()
    : seed_(choose_seed()), trace_(__FILE__, __LINE__, seed_message(seed_)), engine_(seed_) {}

double SeededRng::uniform(double low, double high) {
  return std::uniform_real_distribution<double>(low, high)(engine_);
}

std::int64_t SeededRng::uniform_int(std::int64_t low, std::int64_t high) {
  return std::uniform_int_distribution<std::int64_t>(low, high)(engine_);
}

HostTensor SeededRng::tensor(DType dtype, std::vector<std::int64_t> shape, double low,
                             double high) {
  HostTensor result{dtype, std::move(shape), {}};
  result.values.resize(static_cast<std::size_t>(element_count(result.shape)));
  for (double& value : result.values) value = round_to_dtype(uniform(low, high), dtype);
  return result;
}

std::vector<std::int32_t> SeededRng::candidate_map(std::int64_t num_candidates,
                                                   std::int64_t num_users, MapOrder order) {
  std::vector<std::int32_t> cand_to_user(static_cast<std::size_t>(num_candidates));
  const bool uneven = order == MapOrder::uneven || order == MapOrder::uneven_unsorted;
  if (uneven) {
    // Quadratically growing weights give a wide spread of group sizes.
    std::vector<double> weights(static_cast<std::size_t>(num_users));
    for (std::int64_t u = 0; u < num_users; ++u) {
      const bool empty = num_users > 1 && u % 3 == 1;
      weights[static_cast<std::size_t>(u)] = empty ? 0.0 : static_cast<double>((u + 1) * (u + 1));
    }
    std::discrete_distribution<std::int32_t> pick(weights.begin(), weights.end());
    for (auto& user : cand_to_user) user = pick(engine_);
    std::sort(cand_to_user.begin(), cand_to_user.end());
  } else {
    for (std::int64_t b = 0; b < num_candidates; ++b) {
      cand_to_user[static_cast<std::size_t>(b)] =
          static_cast<std::int32_t>(b * num_users / num_candidates);
    }
  }
  if (order == MapOrder::unsorted || order == MapOrder::uneven_unsorted) {
    std::shuffle(cand_to_user.begin(), cand_to_user.end(), engine_);
  }
  return cand_to_user;
}

double relative_tolerance(DType dtype) {
  switch (dtype) {
    case DType::f16: return 2e-3;
    case DType::bf16: return 1e-2;
    case DType::f32: return 1e-5;
    case DType::i32: break;
  }
  ADD_FAILURE() << "relative_tolerance: not a floating dtype: " << dtype_name(dtype);
  return 0.0;
}

double relative_frobenius_error(std::span<const double> actual, std::span<const double> expected) {
  EXPECT_EQ(actual.size(), expected.size()) << "relative_frobenius_error: size mismatch";
  double difference = 0.0, reference = 0.0;
  for (std::size_t i = 0; i < std::min(actual.size(), expected.size()); ++i) {
    difference += (actual[i] - expected[i]) * (actual[i] - expected[i]);
    reference += expected[i] * expected[i];
  }
  return reference > 0.0 ? std::sqrt(difference / reference) : std::sqrt(difference);
}

testing::AssertionResult fully_written(std::span<const double> values) {
  std::size_t unwritten = 0, first = 0;
  for (std::size_t i = 0; i < values.size(); ++i) {
    if (std::isnan(values[i]) && unwritten++ == 0) first = i;
  }
  if (unwritten == 0) return testing::AssertionSuccess();
  return testing::AssertionFailure() << unwritten << " of " << values.size()
                                     << " output elements still hold the NaN poison (first at "
                                        "flat index "
                                     << first << ")";
}

testing::AssertionResult exactly_equal(std::span<const double> actual,
                                       std::span<const double> expected) {
  if (actual.size() != expected.size()) {
    return testing::AssertionFailure()
           << "sizes differ: " << actual.size() << " vs " << expected.size();
  }
  for (std::size_t i = 0; i < actual.size(); ++i) {
    // NaN (unwritten poison) is unequal to everything, so it is reported too.
    if (!(actual[i] == expected[i])) {
      return testing::AssertionFailure() << "first difference at flat index " << i << ": "
                                         << actual[i] << " vs expected " << expected[i];
    }
  }
  return testing::AssertionSuccess();
}

testing::AssertionResult matches_reference(std::span<const double> actual,
                                           std::span<const double> expected, DType dtype) {
  if (actual.size() != expected.size()) {
    return testing::AssertionFailure()
           << "output has " << actual.size() << " elements, the reference " << expected.size();
  }
  if (auto written = fully_written(actual); !written) return written;
  const double error = relative_frobenius_error(actual, expected);
  const double tolerance = relative_tolerance(dtype);
  double squares = 0.0;
  for (const double value : expected) squares += value * value;
  const double rms =
      expected.empty() ? 0.0 : std::sqrt(squares / static_cast<double>(expected.size()));
  for (std::size_t i = 0; i < actual.size(); ++i) {
    const double bound = tolerance * (std::abs(expected[i]) + 8.0 * rms);
    if (!(std::abs(actual[i] - expected[i]) <= bound)) {
      return testing::AssertionFailure()
             << "element " << i << " is " << actual[i] << ", expected " << expected[i]
             << " within " << bound << " (" << dtype_name(dtype) << "; relative Frobenius error "
             << error << " vs tolerance " << tolerance << ")";
    }
  }
  auto result = error <= tolerance ? testing::AssertionSuccess() : testing::AssertionFailure();
  return result << "relative Frobenius error " << error << " vs tolerance " << tolerance << " ("
                << dtype_name(dtype) << ")";
}

void PrintTo(const LceCase& value, std::ostream* stream) { *stream << value.name; }

std::vector<double> reference_lce(const LceShape& shape, std::span<const double> w_c,
                                  std::span<const double> w_u, std::span<const double> e_c,
                                  std::span<const double> e_u,
                                  std::span<const std::int32_t> cand_to_user) {
  const auto [m, kc, ku, n, num_candidates, num_users] = shape;
  std::vector<double> out(static_cast<std::size_t>(num_candidates * m * n), 0.0);
  for (std::int64_t b = 0; b < num_candidates; ++b) {
    const std::int64_t user = cand_to_user[static_cast<std::size_t>(b)];
    const double* cand_rows = e_c.data() + b * kc * n;
    const double* user_rows = e_u.data() + user * ku * n;
    for (std::int64_t row = 0; row < m; ++row) {
      double* out_row = out.data() + (b * m + row) * n;
      for (std::int64_t k = 0; k < kc; ++k) {
        const double weight = w_c[static_cast<std::size_t>(row * kc + k)];
        for (std::int64_t col = 0; col < n; ++col) out_row[col] += weight * cand_rows[k * n + col];
      }
      for (std::int64_t k = 0; k < ku; ++k) {
        const double weight = w_u[static_cast<std::size_t>(row * ku + k)];
        for (std::int64_t col = 0; col < n; ++col) out_row[col] += weight * user_rows[k * n + col];
      }
    }
  }
  return out;
}

std::vector<double> reference_attention(const AttentionShape& shape, std::span<const double> q,
                                        std::span<const double> k, std::span<const double> v,
                                        std::span<const std::int32_t> cand_to_user,
                                        std::span<const std::int64_t> kv_offsets, double scale) {
  const auto [num_candidates, n_seed, heads, head_dim] = shape;
  const std::int64_t row_stride = heads * head_dim;  // one token's [H, D] block
  std::vector<double> out(static_cast<std::size_t>(num_candidates * n_seed * row_stride), 0.0);
  std::vector<double> probabilities;
  for (std::int64_t b = 0; b < num_candidates; ++b) {
    const std::size_t user = static_cast<std::size_t>(cand_to_user[static_cast<std::size_t>(b)]);
    const std::int64_t first_row = kv_offsets[user], length = kv_offsets[user + 1] - first_row;
    if (length == 0) continue;
    probabilities.resize(static_cast<std::size_t>(length));
    for (std::int64_t seed = 0; seed < n_seed; ++seed) {
      for (std::int64_t h = 0; h < heads; ++h) {
        const double* query = q.data() + (b * n_seed + seed) * row_stride + h * head_dim;
        double largest = -std::numeric_limits<double>::infinity();
        for (std::int64_t j = 0; j < length; ++j) {
          const double* key = k.data() + (first_row + j) * row_stride + h * head_dim;
          double dot = 0.0;
          for (std::int64_t d = 0; d < head_dim; ++d) dot += query[d] * key[d];
          probabilities[static_cast<std::size_t>(j)] = scale * dot;
          largest = std::max(largest, scale * dot);
        }
        // Every key scoring -inf: no key has weight, and the row gets zeros,
        // as for a user without keys.
        if (largest == -std::numeric_limits<double>::infinity()) continue;
        double total = 0.0;
        for (double& p : probabilities) total += (p = std::exp(p - largest));
        double* result = out.data() + (b * n_seed + seed) * row_stride + h * head_dim;
        for (std::int64_t j = 0; j < length; ++j) {
          const double weight = probabilities[static_cast<std::size_t>(j)] / total;
          const double* value = v.data() + (first_row + j) * row_stride + h * head_dim;
          for (std::int64_t d = 0; d < head_dim; ++d) result[d] += weight * value[d];
        }
      }
    }
  }
  return out;
}

std::vector<std::int64_t> dense_kv_offsets(std::int64_t num_users, std::int64_t seq_len) {
  std::vector<std::int64_t> offsets(static_cast<std::size_t>(num_users) + 1);
  for (std::size_t u = 0; u < offsets.size(); ++u) {
    offsets[u] = static_cast<std::int64_t>(u) * seq_len;
  }
  return offsets;
}

void PrintTo(const AttentionCase& value, std::ostream* stream) { *stream << value.name; }

double AttentionInputs::effective_scale() const {
  return scale ? *scale : 1.0 / std::sqrt(static_cast<double>(shape.head_dim));
}

std::vector<double> AttentionInputs::expected() const {
  return reference_attention(shape, q.values, k.values, v.values, cand_to_user, kv_offsets,
                             effective_scale());
}

AttentionInputs random_attention_inputs(SeededRng& rng, DType dtype, const AttentionCase& test_case) {
  AttentionInputs inputs;
  inputs.shape = {test_case.num_candidates, test_case.n_seed, test_case.heads, test_case.head_dim};
  std::vector<std::int64_t> kv_shape;
  if (test_case.jagged()) {
    inputs.kv_offsets.push_back(0);
    for (std::int64_t length : test_case.user_lengths) {
      inputs.kv_offsets.push_back(inputs.kv_offsets.back() + length);
    }
    kv_shape = {inputs.kv_offsets.back(), test_case.heads, test_case.head_dim};
  } else {
    inputs.kv_offsets = dense_kv_offsets(test_case.num_users, test_case.seq_len);
    kv_shape = {test_case.num_users, test_case.seq_len, test_case.heads, test_case.head_dim};
  }
  // Queries twice as wide as keys make the softmax less flat than uniform noise would.
  inputs.q = rng.tensor(
      dtype, {test_case.num_candidates, test_case.n_seed, test_case.heads, test_case.head_dim},
      -2.0, 2.0);
  inputs.k = rng.tensor(dtype, kv_shape);
  inputs.v = rng.tensor(dtype, kv_shape);
  inputs.cand_to_user =
      rng.candidate_map(test_case.num_candidates, test_case.num_users, test_case.order);
  inputs.scale = test_case.scale;
  return inputs;
}

void set_minus_infinity_keys(AttentionInputs& inputs, DType dtype,
                             std::span<const KeyRange> ranges) {
  for (double& value : inputs.q.values) value = round_to_dtype(std::abs(value) + 0.5, dtype);
  const std::int64_t row_elements = inputs.shape.heads * inputs.shape.head_dim;
  for (const KeyRange& range : ranges) {
    const std::int64_t first_row =
        inputs.kv_offsets[static_cast<std::size_t>(range.user)] + range.first;
    std::fill_n(inputs.k.values.begin() + first_row * row_elements, range.count * row_elements,
                -std::numeric_limits<double>::infinity());
  }
}

std::span<const double> candidate_outputs(std::span<const double> values,
                                          const AttentionInputs& inputs, std::int64_t b) {
  const auto size =
      static_cast<std::size_t>(inputs.shape.n_seed * inputs.shape.heads * inputs.shape.head_dim);
  return values.subspan(static_cast<std::size_t>(b) * size, size);
}

testing::AssertionResult matches_reference_per_candidate(std::span<const double> actual,
                                                         std::span<const double> expected,
                                                         const AttentionInputs& inputs,
                                                         DType dtype) {
  if (actual.size() != expected.size()) return matches_reference(actual, expected, dtype);
  for (std::int64_t b = 0; b < inputs.shape.num_candidates; ++b) {
    const std::span<const double> outputs = candidate_outputs(actual, inputs, b);
    const std::span<const double> reference = candidate_outputs(expected, inputs, b);
    if (std::ranges::all_of(reference, [](double value) { return value == 0.0; })) {
      for (std::size_t i = 0; i < outputs.size(); ++i) {
        if (outputs[i] != 0.0) {
          return testing::AssertionFailure() << "candidate " << b << " has out element " << i
                                             << " = " << outputs[i] << ", expected 0";
        }
      }
    } else if (auto match = matches_reference(outputs, reference, dtype); !match) {
      return match << " (candidate " << b << ")";
    }
  }
  return testing::AssertionSuccess();
}

testing::AssertionResult empty_histories_give_zeros(const AttentionInputs& inputs,
                                                    std::span<const double> actual) {
  for (std::int64_t b = 0; b < inputs.shape.num_candidates; ++b) {
    const auto user = static_cast<std::size_t>(inputs.cand_to_user[static_cast<std::size_t>(b)]);
    if (inputs.kv_offsets[user + 1] != inputs.kv_offsets[user]) continue;
    const std::span<const double> outputs = candidate_outputs(actual, inputs, b);
    for (std::size_t i = 0; i < outputs.size(); ++i) {
      if (outputs[i] != 0.0) {
        return testing::AssertionFailure()
               << "candidate " << b << " (user " << user << ", empty history) has out element " << i
               << " = " << outputs[i] << ", expected 0";
      }
    }
  }
  return testing::AssertionSuccess();
}

}  // namespace ikbo::test
