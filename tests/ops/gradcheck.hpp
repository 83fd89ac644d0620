// Helpers of the finite-difference gradient tests: random fills from the
// counter-based generator, central differences over every element of an
// input, and the norm-wise relative error between two gradients.
#pragma once

#include <cmath>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <weft/ops/ops.hpp>

#include "weft_test.hpp"

namespace weft::test {

/// Copies any contiguous view to a host std::vector<double>.
template <class V>
std::vector<double> to_vector(const V& v) {
  auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), v);
  std::vector<double> out(h.span());
  for (std::size_t i = 0; i < h.span(); ++i) out[i] = double(h.data()[i]);
  return out;
}

/// Fills a contiguous view with values uniform in [lo, hi) drawn from (seed, label, index).
template <class V>
void fill_uniform(const V& v, std::uint64_t seed, double lo = -1.0, double hi = 1.0) {
  auto h = Kokkos::create_mirror_view(v);
  const auto stream = ops::name_hash(v.label());
  for (std::size_t i = 0; i < h.span(); ++i)
    h.data()[i] = typename V::non_const_value_type(lo + (hi - lo) * (ops::Philox(seed, stream, i).uniform()));
  Kokkos::deep_copy(v, h);
}

/// Central-difference gradient of loss() with respect to every element of x
/// (step h); x is restored afterwards.
template <class V>
std::vector<double> numeric_gradient(const V& x, const std::function<double()>& loss, double h = 1e-6) {
  auto hx = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), x);
  std::vector<double> g(hx.span());
  for (std::size_t i = 0; i < hx.span(); ++i) {
    const auto orig = hx.data()[i];
    hx.data()[i] = orig + h;
    Kokkos::deep_copy(x, hx);
    const double fp = loss();
    hx.data()[i] = orig - h;
    Kokkos::deep_copy(x, hx);
    const double fm = loss();
    hx.data()[i] = orig;
    Kokkos::deep_copy(x, hx);
    g[i] = (fp - fm) / (2 * h);
  }
  return g;
}

/// ||a - b|| / max(||a||, ||b||, tiny): one number per gradient, so single
/// near-zero entries do not dominate.
inline double relative_error(const std::vector<double>& a, const std::vector<double>& b) {
  REQUIRE(a.size() == b.size());
  double d = 0, na = 0, nb = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    d += (a[i] - b[i]) * (a[i] - b[i]);
    na += a[i] * a[i];
    nb += b[i] * b[i];
  }
  const double den = std::max({std::sqrt(na), std::sqrt(nb), 1e-30});
  return std::sqrt(d) / den;
}

/// sum(w * y) over a contiguous view pair: the scalar whose gradient a test checks.
template <class YV, class WV>
double weighted_sum(const YV& y, const WV& w) {
  const auto a = to_vector(y), b = to_vector(w);
  double s = 0;
  for (std::size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

}  // namespace weft::test
