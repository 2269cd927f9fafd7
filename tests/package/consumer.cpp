// An ikbo consumer built against the installed package: LCE on the CPU
// backend over a small request, checked against the broadcast form computed
// here in double. Exits 0 when every element agrees.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <vector>

#include <ikbo/ikbo.hpp>

int main() {
  constexpr std::int64_t m = 3, kc = 5, ku = 4, n = 2, num_candidates = 5, num_users = 2;
  std::vector<float> w_c(m * kc), w_u(m * ku), e_c(num_candidates * kc * n),
      e_u(num_users * ku * n), out(num_candidates * m * n, -1.0f);
  const auto fill = [](std::vector<float>& values, float step) {
    for (std::size_t i = 0; i < values.size(); ++i) {
      values[i] = std::sin(step * static_cast<float>(i + 1));
    }
  };
  fill(w_c, 0.7f);
  fill(w_u, 1.3f);
  fill(e_c, 0.3f);
  fill(e_u, 1.9f);
  const std::vector<std::int32_t> cand_to_user = {1, 0, 1, 1, 0};

  const auto plan = ikbo::LcePlan::create(ikbo::Tensor(w_c.data(), ikbo::DType::f32, {m, kc}),
                                          ikbo::Tensor(w_u.data(), ikbo::DType::f32, {m, ku}));
  const auto map = ikbo::CandidateMap::build(cand_to_user.data(), num_candidates, num_users);
  ikbo::lce(plan, ikbo::Tensor(e_c.data(), ikbo::DType::f32, {num_candidates, kc, n}),
            ikbo::Tensor(e_u.data(), ikbo::DType::f32, {num_users, ku, n}), map,
            ikbo::Tensor(out.data(), ikbo::DType::f32, {num_candidates, m, n}));

  int wrong = 0;
  for (std::int64_t b = 0; b < num_candidates; ++b) {
    const std::int64_t user = cand_to_user[static_cast<std::size_t>(b)];
    for (std::int64_t row = 0; row < m; ++row) {
      for (std::int64_t col = 0; col < n; ++col) {
        double expected = 0.0;
        for (std::int64_t k = 0; k < kc; ++k) {
          expected += double{w_c[row * kc + k]} * e_c[(b * kc + k) * n + col];
        }
        for (std::int64_t k = 0; k < ku; ++k) {
          expected += double{w_u[row * ku + k]} * e_u[(user * ku + k) * n + col];
        }
        const float actual = out[(b * m + row) * n + col];
        if (!(std::abs(actual - expected) <= 1e-5 * (1.0 + std::abs(expected)))) {
          std::printf("out[%lld, %lld, %lld] = %g, expected %g\n", static_cast<long long>(b),
                      static_cast<long long>(row), static_cast<long long>(col), actual, expected);
          ++wrong;
        }
      }
    }
  }
  std::printf("ikbo package consumer: %d of %lld elements wrong\n", wrong,
              static_cast<long long>(out.size()));
  return wrong == 0 ? 0 : 1;
}
