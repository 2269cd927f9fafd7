// The Hopper attention path (src/cuda/sm90/attention_sm90.cu) on CUDA device 0,
// against the fp64 reference and the portable kernel (the same call with the
// Hopper path switched off): n_seed in {1, 37, 64, 100}, D in {64, 128},
// H in {1, 2, 6}, dense S in {1, 127, 130, 500, 2048} and jagged lengths
// including 0, 1, 127, 129 and 2048; balanced, uneven (users without
// candidates) and unsorted maps with odd counts; positive, negative and zero
// scales (the zero scale with a masked tail block); f16 and bf16; enough
// units that every CTA of the persistent grid takes several and both rings
// wrap. Each case checks: the fp64 reference within the dtype's tolerance
// and, for f16, a max abs error <= 2e-3; an error not above the portable
// kernel's (+ a rounding margin); exact zeros for users without history;
// bitwise-identical repeated runs and bitwise-identical results of the four
// schedules (ping-pong, cooperative, each with and without the look-ahead
// epilogue); outputs poisoned (NaN) before every run. A second
// test puts +Inf into one user's K and V and checks that the
// neighbouring users' outputs stay exact. Every test skips, with the reason,
// unless device 0 is an sm_90 GPU and the build carries sm_90a code.
#include <algorithm>
#include <cmath>
#include <iostream>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <tuple>
#include <vector>

#include "device_harness.hpp"

#ifdef IKBO_WITH_CUDA
#include "cuda/sm90/attention_sm90.hpp"
#endif

namespace ikbo::test {
namespace {

constexpr Device kCuda = Device::cuda(0);

std::optional<std::string> sm90_unavailable_reason() {
  if (auto reason = unavailable_reason(kCuda)) return reason;
#ifdef IKBO_WITH_CUDA
  if (!detail::cuda::attention_sm90_available(kCuda)) {
    return "CUDA device 0 is not a compute capability 9.0 GPU, or this build carries no sm_90a "
           "code: the Hopper attention path cannot run here";
  }
  return std::nullopt;
#else
  return "ikbo built without CUDA";
#endif
}

enum class Path { portable, ping_pong, cooperative, ping_pong_lookahead, cooperative_lookahead };

// Selects the attention path for a scope.
class PathScope {
 public:
  explicit PathScope(Path path) {
#ifdef IKBO_WITH_CUDA
    previous_enabled_ = detail::cuda::attention_sm90_enabled();
    previous_schedule_ = detail::cuda::attention_sm90_schedule();
    using detail::cuda::AttentionSm90Schedule;
    detail::cuda::set_attention_sm90_enabled(path != Path::portable);
    switch (path) {
      case Path::portable:
      case Path::ping_pong:
        detail::cuda::set_attention_sm90_schedule(AttentionSm90Schedule::ping_pong);
        break;
      case Path::cooperative:
        detail::cuda::set_attention_sm90_schedule(AttentionSm90Schedule::cooperative);
        break;
      case Path::ping_pong_lookahead:
        detail::cuda::set_attention_sm90_schedule(AttentionSm90Schedule::ping_pong_lookahead);
        break;
      case Path::cooperative_lookahead:
        detail::cuda::set_attention_sm90_schedule(AttentionSm90Schedule::cooperative_lookahead);
        break;
    }
#else
    static_cast<void>(path);
#endif
  }
  ~PathScope() {
#ifdef IKBO_WITH_CUDA
    detail::cuda::set_attention_sm90_enabled(previous_enabled_);
    detail::cuda::set_attention_sm90_schedule(previous_schedule_);
#endif
  }
  PathScope(const PathScope&) = delete;
  PathScope& operator=(const PathScope&) = delete;

 private:
#ifdef IKBO_WITH_CUDA
  bool previous_enabled_ = true;
  detail::cuda::AttentionSm90Schedule previous_schedule_{};
#endif
};

struct Sm90AttentionCase {
  const char* name;
  std::int64_t num_candidates, num_users, n_seed, heads, head_dim;
  std::int64_t seq_len;                    // dense K/V when user_lengths is empty
  std::vector<std::int64_t> user_lengths;  // jagged K/V
  MapOrder order;
  std::optional<float> scale;

  bool jagged() const { return !user_lengths.empty(); }
};

void PrintTo(const Sm90AttentionCase& value, std::ostream* stream) { *stream << value.name; }

const std::vector<Sm90AttentionCase>& sm90_cases() {
  static const std::vector<Sm90AttentionCase> cases = {
      {"seed1_d64_h1_s1", 5, 3, 1, 1, 64, 1, {}, MapOrder::unsorted, std::nullopt},
      {"seed37_d128_h2_s127_uneven", 9, 4, 37, 2, 128, 127, {}, MapOrder::uneven_unsorted,
       std::nullopt},
      {"seed64_d64_h2_s500", 7, 3, 64, 2, 64, 500, {}, MapOrder::unsorted, std::nullopt},
      {"seed100_d128_h1_s2048", 6, 2, 100, 1, 128, 2048, {}, MapOrder::unsorted, std::nullopt},
      {"seed64_d128_h2_s500_odd_counts_sorted", 7, 2, 64, 2, 128, 500, {}, MapOrder::sorted,
       std::nullopt},
      {"seed37_d64_h1_s127_negative_scale", 6, 2, 37, 1, 64, 127, {}, MapOrder::unsorted, -0.2f},
      {"seed1_d128_h2_s127_zero_scale", 4, 2, 1, 2, 128, 127, {}, MapOrder::unsorted, 0.0f},
      {"jagged_seed37_d64_h2", 11, 5, 37, 2, 64, 0, {300, 0, 127, 1, 640},
       MapOrder::uneven_unsorted, std::nullopt},
      {"jagged_seed64_d128_h1", 9, 4, 64, 1, 128, 0, {2048, 0, 129, 500}, MapOrder::unsorted,
       std::nullopt},
      {"jagged_seed100_d128_h2_scale_0p05", 5, 3, 100, 2, 128, 0, {256, 1, 0},
       MapOrder::unsorted, 0.05f},
      // 360 units (200 candidates x 37 seeds over 3 users, 6 heads): every
      // CTA of the persistent grid takes several, both rings wrap, and two
      // K/V blocks per unit end in a masked tail.
      {"many_units_seed37_d64_h6_s130", 200, 3, 37, 6, 64, 130, {}, MapOrder::unsorted,
       std::nullopt},
  };
  return cases;
}

struct Inputs {
  AttentionShape shape;
  std::vector<std::int64_t> kv_offsets;
  HostTensor q, k, v;
  std::vector<std::int32_t> cand_to_user;
  std::optional<float> scale;

  double effective_scale() const {
    return scale ? *scale : 1.0 / std::sqrt(static_cast<double>(shape.head_dim));
  }
  std::vector<double> expected() const {
    return reference_attention(shape, q.values, k.values, v.values, cand_to_user, kv_offsets,
                               effective_scale());
  }
};

Inputs random_inputs(SeededRng& rng, DType dtype, const Sm90AttentionCase& test_case) {
  Inputs inputs;
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

// The inputs on device 0, and attention() into a poisoned output.
class DeviceProblem {
 public:
  DeviceProblem(const Inputs& inputs, std::int64_t num_users, bool jagged)
      : inputs_(inputs),
        q_(kCuda, inputs.q),
        k_(kCuda, inputs.k),
        v_(kCuda, inputs.v),
        map_(CandidateMap::build(inputs.cand_to_user.data(), inputs.shape.num_candidates,
                                 num_users, kCuda)) {
    if (jagged) {
      const std::vector<std::int32_t> offsets(inputs.kv_offsets.begin(), inputs.kv_offsets.end());
      kv_offsets_ = JaggedOffsets::build(offsets.data(), num_users, offsets.back(), kCuda);
    }
  }

  std::vector<double> run(Path path) const {
    const PathScope scope(path);
    const auto out = DeviceTensor::poisoned(kCuda, inputs_.q.dtype, inputs_.q.shape);
    attention(q_.view(), k_.view(), v_.view(), map_, out.view(),
              kv_offsets_ ? &*kv_offsets_ : nullptr, inputs_.scale);
    return out.values();
  }

 private:
  const Inputs& inputs_;
  DeviceTensor q_, k_, v_;
  CandidateMap map_;
  std::optional<JaggedOffsets> kv_offsets_;
};

double max_abs_error(std::span<const double> actual, std::span<const double> expected) {
  double largest = 0.0;
  for (std::size_t i = 0; i < std::min(actual.size(), expected.size()); ++i) {
    largest = std::max(largest, std::abs(actual[i] - expected[i]));
  }
  return largest;
}

// The element range of candidate b in q/out.
std::span<const double> candidate_part(const std::vector<double>& values, const Inputs& inputs,
                                       std::int64_t b) {
  const auto size =
      static_cast<std::size_t>(inputs.shape.n_seed * inputs.shape.heads * inputs.shape.head_dim);
  return std::span(values).subspan(static_cast<std::size_t>(b) * size, size);
}

testing::AssertionResult empty_histories_give_zeros(const Inputs& inputs,
                                                    const std::vector<double>& actual) {
  for (std::int64_t b = 0; b < inputs.shape.num_candidates; ++b) {
    const auto user = static_cast<std::size_t>(inputs.cand_to_user[static_cast<std::size_t>(b)]);
    if (inputs.kv_offsets[user + 1] != inputs.kv_offsets[user]) continue;
    for (double value : candidate_part(actual, inputs, b)) {
      if (value != 0.0) {
        return testing::AssertionFailure() << "candidate " << b << " (user " << user
                                           << ", empty history) has a nonzero output " << value;
      }
    }
  }
  return testing::AssertionSuccess();
}

using Sm90Param = std::tuple<DType, Sm90AttentionCase>;

class AttentionSm90VsReference : public testing::TestWithParam<Sm90Param> {
 protected:
  void SetUp() override {
    if (const auto reason = sm90_unavailable_reason()) GTEST_SKIP() << *reason;
  }
  DType dtype() const { return std::get<0>(GetParam()); }
  const Sm90AttentionCase& attention_case() const { return std::get<1>(GetParam()); }
};

TEST_P(AttentionSm90VsReference, MatchesReferenceAndPortablePathAndRepeatsBitwise) {
  SeededRng rng;
  const Sm90AttentionCase& test_case = attention_case();
  const Inputs inputs = random_inputs(rng, dtype(), test_case);
  const DeviceProblem problem(inputs, test_case.num_users, test_case.jagged());
  const std::vector<double> hopper = problem.run(Path::ping_pong);
  const std::vector<double> hopper_again = problem.run(Path::ping_pong);
  const std::vector<double> cooperative = problem.run(Path::cooperative);
  const std::vector<double> ping_pong_lookahead = problem.run(Path::ping_pong_lookahead);
  const std::vector<double> cooperative_lookahead = problem.run(Path::cooperative_lookahead);
  const std::vector<double> portable = problem.run(Path::portable);
  const std::vector<double> expected = inputs.expected();

  EXPECT_TRUE(matches_reference(hopper, expected, dtype()));
  EXPECT_TRUE(empty_histories_give_zeros(inputs, hopper));
  EXPECT_TRUE(exactly_equal(hopper_again, hopper)) << "two runs on identical inputs differ";
  EXPECT_TRUE(exactly_equal(cooperative, hopper)) << "cooperative differs from ping-pong";
  EXPECT_TRUE(exactly_equal(ping_pong_lookahead, hopper))
      << "ping_pong_lookahead differs from ping-pong";
  EXPECT_TRUE(exactly_equal(cooperative_lookahead, hopper))
      << "cooperative_lookahead differs from ping-pong";
  EXPECT_TRUE(matches_reference(portable, expected, dtype()));
  const double hopper_error = max_abs_error(hopper, expected);
  const double portable_error = max_abs_error(portable, expected);
  // Both round P to the input type and the output once; they differ in
  // fp32 summation order and in exp2 arguments by an ulp or so.
  const double margin = dtype() == DType::f16 ? 2e-4 : 2e-3;
  EXPECT_LE(hopper_error, 1.25 * portable_error + margin)
      << "max abs error: Hopper path " << hopper_error << ", portable path " << portable_error;
  if (dtype() == DType::f16) {
    EXPECT_LE(hopper_error, 2e-3);
  }
  std::cout << "[ sm90     ] " << test_case.name << " " << dtype_name(dtype())
            << ": max abs error Hopper " << hopper_error << ", portable " << portable_error << "\n";
}

std::string sm90_param_name(const testing::TestParamInfo<Sm90Param>& info) {
  return dtype_label(std::get<0>(info.param)) + "_" + std::get<1>(info.param).name;
}

INSTANTIATE_TEST_SUITE_P(Grid, AttentionSm90VsReference,
                         testing::Combine(testing::Values(DType::f16, DType::bf16),
                                          testing::ValuesIn(sm90_cases())),
                         sm90_param_name);

class AttentionSm90Test : public testing::Test {
 protected:
  void SetUp() override {
    if (const auto reason = sm90_unavailable_reason()) GTEST_SKIP() << *reason;
  }
};

// User 1's keys and values are +Inf. Every block of users 0
// and 2 that reaches into user 1's rows (or past the tensor) must mask them
// out, so their outputs stay exact; only user 1's candidates are NaN.
TEST_F(AttentionSm90Test, NonFiniteRowsOfTheNextUserNeverReachOut) {
  for (const bool jagged : {false, true}) {
    SCOPED_TRACE(jagged ? "jagged K/V" : "dense K/V");
    SeededRng rng;
    const DType dtype = DType::f16;
    const Sm90AttentionCase test_case{"poisoned_user",
                                      6,
                                      3,
                                      37,
                                      2,
                                      128,
                                      100,
                                      jagged ? std::vector<std::int64_t>{100, 50, 70}
                                             : std::vector<std::int64_t>{},
                                      MapOrder::unsorted,
                                      std::nullopt};
    Inputs inputs = random_inputs(rng, dtype, test_case);
    const std::int64_t row_size = test_case.heads * test_case.head_dim;
    const auto first = static_cast<std::size_t>(inputs.kv_offsets[1] * row_size);
    const auto last = static_cast<std::size_t>(inputs.kv_offsets[2] * row_size);
    const double inf = std::numeric_limits<double>::infinity();
    std::fill(inputs.k.values.begin() + first, inputs.k.values.begin() + last, inf);
    std::fill(inputs.v.values.begin() + first, inputs.v.values.begin() + last, inf);
    const DeviceProblem problem(inputs, test_case.num_users, jagged);
    const std::vector<double> expected = inputs.expected();
    for (const Path path : {Path::portable, Path::ping_pong, Path::cooperative_lookahead}) {
      const std::vector<double> out = problem.run(path);
      for (std::int64_t b = 0; b < test_case.num_candidates; ++b) {
        if (inputs.cand_to_user[static_cast<std::size_t>(b)] == 1) continue;
        SCOPED_TRACE(testing::Message() << "candidate " << b);
        EXPECT_TRUE(matches_reference(candidate_part(out, inputs, b),
                                      candidate_part(expected, inputs, b), dtype));
      }
    }
  }
}

}  // namespace
}  // namespace ikbo::test
