// Test-side numerics: fp64 references of the IKBO ops, fp16/bf16 encoding,
// seeded random data, NaN poisoning and the comparisons the tests assert.
//
// Host data is kept as doubles holding values exactly representable in the
// tensor's dtype (random data is rounded to the dtype before anything else
// sees it), so the references compute on exactly what the library reads.
// Layouts follow the public API: row-major, the last dimension contiguous.
//   lce:       w_c [M, Kc], w_u [M, Ku], e_c [B, Kc, N], e_u [U, Ku, N] -> out [B, M, N]
//   attention: q [B, n_seed, H, D], K/V rows [rows, H, D] where user u owns
//              rows kv_offsets[u] .. kv_offsets[u+1] (dense [U, S, H, D] is
//              offsets u * S) -> out [B, n_seed, H, D]
#pragma once

#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <ostream>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "ikbo/tensor.hpp"

namespace ikbo::test {

// ---- fp16 / bf16 (round to nearest even; NaN stays NaN, overflow -> Inf) ----
std::uint16_t float_to_half_bits(float value);
float half_bits_to_float(std::uint16_t bits);
std::uint16_t float_to_bfloat16_bits(float value);
float bfloat16_bits_to_float(std::uint16_t bits);

// The value the library sees after `value` is stored as `dtype` (via fp32).
double round_to_dtype(double value, DType dtype);
std::vector<std::byte> encode(std::span<const double> values, DType dtype);
std::vector<double> decode(std::span<const std::byte> bytes, DType dtype);
// `count` elements of `dtype`, every one a quiet NaN.
std::vector<std::byte> poison_bytes(DType dtype, std::size_t count);

std::int64_t element_count(std::span<const std::int64_t> shape);
std::string shape_text(std::span<const std::int64_t> shape);

// A host tensor: shape, dtype and the exact values it holds.
struct HostTensor {
  DType dtype = DType::f32;
  std::vector<std::int64_t> shape;
  std::vector<double> values;

  std::vector<std::byte> bytes() const { return encode(values, dtype); }
};

// ---- random data ----
enum class MapOrder {
  sorted,           // balanced groups, contiguous per user
  unsorted,         // balanced groups, shuffled
  uneven,           // skewed group sizes incl. users without candidates, sorted
  uneven_unsorted,  // the same, shuffled
};
const char* map_order_name(MapOrder order);

// A random engine with a fresh seed per instance (IKBO_TEST_SEED=<n> fixes
// it). While it lives, every failure message shows the seed to rerun with.
class SeededRng {
 public:
  SeededRng();

  double uniform(double low, double high);
  std::int64_t uniform_int(std::int64_t low, std::int64_t high);  // inclusive
  // Uniform in [low, high), rounded to `dtype`.
  HostTensor tensor(DType dtype, std::vector<std::int64_t> shape, double low = -1.0,
                    double high = 1.0);
  // cand_to_user[num_candidates] with values in [0, num_users). The uneven
  // orders leave every third user (u % 3 == 1) without candidates.
  std::vector<std::int32_t> candidate_map(std::int64_t num_candidates, std::int64_t num_users,
                                          MapOrder order);

 private:
  std::uint64_t seed_;
  testing::ScopedTrace trace_;
  std::mt19937_64 engine_;
};

// ---- comparisons ----
// The largest relative Frobenius error accepted against the fp64 reference:
// about one output rounding of the dtype, plus fp32 accumulation for f32.
double relative_tolerance(DType dtype);
// ||actual - expected||_F / ||expected||_F (the absolute norm when expected is 0).
double relative_frobenius_error(std::span<const double> actual, std::span<const double> expected);
// Success when no element is NaN, i.e. the op overwrote every poisoned element.
testing::AssertionResult fully_written(std::span<const double> values);

// Success when both hold the same values; otherwise reports the first difference.
testing::AssertionResult exactly_equal(std::span<const double> actual,
                                       std::span<const double> expected);
// Success when `actual` is fully written, within relative_tolerance(dtype)
// t of `expected` in the relative Frobenius norm, and every element within
// t * (|expected| + 8 * rms(expected)) of its own: the norm alone would pass
// a few wrong elements (a tile, a row) among many right ones. Rounding
// errors are at most 2^-11 |e| (f16) and 2^-8 |e| (bf16), well inside
// t |e|; the floor admits the accumulation's absolute error, which the
// norm already bounds by t * rms. The message reports the error either way.
testing::AssertionResult matches_reference(std::span<const double> actual,
                                           std::span<const double> expected, DType dtype);

// ---- fp64 references ----
struct LceShape {
  std::int64_t m = 0, kc = 0, ku = 0, n = 0, num_candidates = 0, num_users = 0;
};
// A named shape and map order: a case of the parametrized LCE tests.
struct LceCase {
  const char* name;
  LceShape shape;  // m, kc, ku, n, num_candidates, num_users
  MapOrder order;
};
void PrintTo(const LceCase& value, std::ostream* stream);  // the name, in test output
std::vector<double> reference_lce(const LceShape& shape, std::span<const double> w_c,
                                  std::span<const double> w_u, std::span<const double> e_c,
                                  std::span<const double> e_u,
                                  std::span<const std::int32_t> cand_to_user);

struct AttentionShape {
  std::int64_t num_candidates = 0, n_seed = 0, heads = 0, head_dim = 0;
};
// kv_offsets [U + 1]; a user with no rows, or a row whose every key scores
// -inf, gets zeros.
std::vector<double> reference_attention(const AttentionShape& shape, std::span<const double> q,
                                        std::span<const double> k, std::span<const double> v,
                                        std::span<const std::int32_t> cand_to_user,
                                        std::span<const std::int64_t> kv_offsets, double scale);
// Offsets of dense K/V: user u owns rows u * seq_len .. (u + 1) * seq_len.
std::vector<std::int64_t> dense_kv_offsets(std::int64_t num_users, std::int64_t seq_len);

// A named attention case of the parametrized tests.
struct AttentionCase {
  const char* name;
  std::int64_t num_candidates, num_users, n_seed, heads, head_dim;
  std::int64_t seq_len;                    // dense K/V [U, S, H, D] when user_lengths is empty
  std::vector<std::int64_t> user_lengths;  // jagged K/V: rows per user
  MapOrder order;
  std::optional<float> scale;  // nullopt: the default 1/sqrt(D)

  bool jagged() const { return !user_lengths.empty(); }
};
void PrintTo(const AttentionCase& value, std::ostream* stream);  // the name, in test output

// Random host inputs of a case, and their fp64 reference output.
struct AttentionInputs {
  AttentionShape shape;
  std::vector<std::int64_t> kv_offsets;  // [U + 1]; dense: u * S
  HostTensor q, k, v;
  std::vector<std::int32_t> cand_to_user;
  std::optional<float> scale;

  double effective_scale() const;
  std::vector<double> expected() const;
};
AttentionInputs random_attention_inputs(SeededRng& rng, DType dtype, const AttentionCase& test_case);

// Keys first .. first + count of a user's history.
struct KeyRange {
  std::int64_t user, first, count;
};
// Makes every query positive (|q| + 1/2, in dtype) and sets the keys of each
// range to -inf, so that those keys score -inf at a positive scale.
void set_minus_infinity_keys(AttentionInputs& inputs, DType dtype,
                             std::span<const KeyRange> ranges);

// The elements of candidate b in q or out.
std::span<const double> candidate_outputs(std::span<const double> values,
                                          const AttentionInputs& inputs, std::int64_t b);
// Each candidate's outputs against its part of the reference: exact zeros
// where the reference is all zeros, matches_reference elsewhere.
testing::AssertionResult matches_reference_per_candidate(std::span<const double> actual,
                                                         std::span<const double> expected,
                                                         const AttentionInputs& inputs,
                                                         DType dtype);
// Candidates whose user has no history must get exact zeros.
testing::AssertionResult empty_histories_give_zeros(const AttentionInputs& inputs,
                                                    std::span<const double> actual);

}  // namespace ikbo::test
