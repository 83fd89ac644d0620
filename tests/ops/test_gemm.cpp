// The GEMM providers: every provider compiled into this build, called directly
// and through ops::gemm, on every transpose case, odd and zero sizes, column
// ranges of wider matrices (leading dimensions that are not the row length)
// and both layouts, against a plain loop in double; and the compile-time
// choice of provider, checked by the counters of the one that ran.
#include <doctest/doctest.h>

#include <cmath>
#include <random>
#include <type_traits>
#include <vector>

#include <weft/weft.hpp>

using namespace weft;
using Space = Kokkos::DefaultExecutionSpace;
using Host = Kokkos::DefaultHostExecutionSpace;

namespace {

template <class V>
void fill(const V& v, unsigned seed) {
  auto h = Kokkos::create_mirror_view(v);
  std::mt19937 gen(seed);
  std::uniform_real_distribution<double> u(-1, 1);
  for (std::size_t i = 0; i < v.extent(0); ++i)
    for (std::size_t j = 0; j < v.extent(1); ++j) h(i, j) = typename V::non_const_value_type(u(gen));
  Kokkos::deep_copy(v, h);
}

template <class V>
double at(const V& h, bool trans, std::size_t i, std::size_t j) {
  return trans ? double(h(j, i)) : double(h(i, j));
}

// C_ref = alpha op(A) op(B) + beta C0 in double, and the bound of an fp32
// evaluation of it: each element's sum of |terms| times k eps (a sum of k
// products in any order, with fused or separate multiply-adds, stays within
// k eps of that sum; Higham, Accuracy and Stability, 3.1).
template <class AV, class BV, class CV>
void reference(ops::Trans ta, ops::Trans tb, double alpha, const AV& A, const BV& B, double beta, const CV& C0,
               std::vector<double>& ref, std::vector<double>& bound, double eps, double out_eps = 0) {
  auto a = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), A);
  auto b = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), B);
  auto c = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), C0);
  const bool at_ = ta == ops::Trans::T, bt = tb == ops::Trans::T;
  const std::size_t m = C0.extent(0), n = C0.extent(1), k = at_ ? A.extent(0) : A.extent(1);
  ref.assign(m * n, 0);
  bound.assign(m * n, 0);
  for (std::size_t i = 0; i < m; ++i)
    for (std::size_t j = 0; j < n; ++j) {
      double s = 0, sa = 0;
      for (std::size_t q = 0; q < k; ++q) {
        const double t = at(a, at_, i, q) * at(b, bt, q, j);
        s += t;
        sa += std::fabs(t);
      }
      const double c0 = beta == 0 ? 0.0 : double(c(i, j));
      ref[i * n + j] = alpha * s + beta * c0;
      // out_eps: one more rounding of the result into a 2-byte C.
      bound[i * n + j] = (double(k) + 2) * eps * (std::fabs(alpha) * sa + std::fabs(beta * c0)) +
                         out_eps * std::fabs(ref[i * n + j]) + 1e-300;
    }
}

template <class CV>
void check_within(const CV& C, const std::vector<double>& ref, const std::vector<double>& bound) {
  auto c = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), C);
  const std::size_t n = C.extent(1);
  std::size_t bad = 0;
  double worst = 0;
  for (std::size_t i = 0; i < C.extent(0); ++i)
    for (std::size_t j = 0; j < n; ++j) {
      const double err = std::fabs(double(c(i, j)) - ref[i * n + j]);
      worst = std::max(worst, err / bound[i * n + j]);
      if (!(err <= bound[i * n + j])) ++bad;
    }
  CAPTURE(worst);
  CHECK(bad == 0);
}

// Calls Provider's runner, or ops::gemm when Provider is void, on every
// transpose case of one shape, in layout L, with A, B and C as column ranges
// of wider matrices (pad > 0) or whole ones.
// T: A's and B's type; TC: C's. bf16 inputs are exact in float, so their
// products accumulate with fp32 rounding (eps 2^-24); a bf16 C adds one
// rounding to 8 significant bits (2^-8 relative) at the end.
template <class Provider, class T, class L, class TC = T>
void check_shape(std::size_t m, std::size_t n, std::size_t k, std::size_t pad, double alpha, double beta) {
  using M = Kokkos::View<T**, L, Space>;
  using MC = Kokkos::View<TC**, L, Space>;
  const double eps = std::is_same_v<T, double> ? 0x1p-53 : 0x1p-24;
  const double out_eps = std::is_same_v<TC, bf16> ? 0x1p-8 : 0.0;
  for (auto ta : {ops::Trans::N, ops::Trans::T})
    for (auto tb : {ops::Trans::N, ops::Trans::T}) {
      const std::size_t ar = ta == ops::Trans::T ? k : m, ac = ta == ops::Trans::T ? m : k;
      const std::size_t br = tb == ops::Trans::T ? n : k, bc = tb == ops::Trans::T ? k : n;
      // With LayoutRight a column range keeps row-major order with a longer
      // row (ld > cols); with LayoutLeft a row range does the same for columns.
      constexpr bool right = std::is_same_v<L, Kokkos::LayoutRight>;
      M Aw("Aw", right ? ar : ar + pad, right ? ac + pad : ac), Bw("Bw", right ? br : br + pad, right ? bc + pad : bc);
      MC Cw("Cw", right ? m : m + pad, right ? n + pad : n);
      fill(Aw, unsigned(1 + m + 3 * k));
      fill(Bw, unsigned(2 + n + 5 * k));
      fill(Cw, unsigned(3 + m * n));
      auto sub = [&](const auto& w, std::size_t r, std::size_t c) {
        return right ? Kokkos::subview(w, std::make_pair(std::size_t(0), r), std::make_pair(pad / 2, pad / 2 + c))
                     : Kokkos::subview(w, std::make_pair(pad / 2, pad / 2 + r), std::make_pair(std::size_t(0), c));
      };
      auto A = sub(Aw, ar, ac);
      auto B = sub(Bw, br, bc);
      auto C = sub(Cw, m, n);
      static_assert(std::is_same_v<typename decltype(A)::array_layout, L>, "a range of a matrix keeps its layout");
      std::vector<double> ref, bound;
      reference(ta, tb, alpha, A, B, beta, C, ref, bound, eps, out_eps);
      if constexpr (std::is_void_v<Provider>) {
        ops::gemm(ta, tb, TC(alpha), A, B, TC(beta), C);
      } else {
        ops::gemm_provider_runner<Provider>::run(ta, tb, TC(alpha), A, B, TC(beta), C);
      }
      CAPTURE(m);
      CAPTURE(n);
      CAPTURE(k);
      CAPTURE(pad);
      CAPTURE(char(ta));
      CAPTURE(char(tb));
      CAPTURE(alpha);
      CAPTURE(beta);
      check_within(C, ref, bound);
      // The columns (rows) around the range are untouched.
      if (pad > 0) {
        auto cw = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), Cw);
        MC Cw0("Cw0", Cw.extent(0), Cw.extent(1));
        fill(Cw0, unsigned(3 + m * n));
        auto c0 = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), Cw0);
        std::size_t changed = 0;
        for (std::size_t i = 0; i < Cw.extent(0); ++i)
          for (std::size_t j = 0; j < Cw.extent(1); ++j) {
            const bool inside = right ? (j >= pad / 2 && j < pad / 2 + n) : (i >= pad / 2 && i < pad / 2 + m);
            if (!inside && float(cw(i, j)) != float(c0(i, j))) ++changed;
          }
        CHECK(changed == 0);
      }
    }
}

template <class Provider, class T, class TC = T>
void check_provider() {
  // Odd sizes around the vector widths (16 floats) and register blocks.
  const std::size_t sizes[][3] = {{1, 1, 1}, {1, 17, 33}, {7, 5, 3}, {17, 31, 15}, {33, 64, 65}, {64, 48, 129}};
  for (const auto& s : sizes)
    for (std::size_t pad : {0, 5}) {
      check_shape<Provider, T, Kokkos::LayoutRight, TC>(s[0], s[1], s[2], pad, 1.0, 0.0);
      check_shape<Provider, T, Kokkos::LayoutLeft, TC>(s[0], s[1], s[2], pad, 1.0, 0.0);
    }
  // Coefficients: accumulate (beta 1, the weight gradient), scale both.
  check_shape<Provider, T, Kokkos::LayoutRight, TC>(9, 10, 11, 3, 1.0, 1.0);
  check_shape<Provider, T, Kokkos::LayoutRight, TC>(9, 10, 11, 3, 0.5, 2.0);
  check_shape<Provider, T, Kokkos::LayoutRight, TC>(9, 10, 11, 0, -1.25, 0.0);
  check_shape<Provider, T, Kokkos::LayoutLeft, TC>(9, 10, 11, 3, 0.5, -1.0);
}

}  // namespace

TEST_CASE_TEMPLATE("ops::gemm equals a double loop within fp32 (or fp64) rounding", T, float, double) {
  check_provider<void, T>();
}

TEST_CASE("bf16 inputs through ops::gemm, float or bf16 C: fp32 accumulation of the exact inputs") {
  check_provider<void, bf16, float>();
  check_provider<void, bf16, bf16>();
}

TEST_CASE("the widening provider, called directly, for bf16 and fp16 inputs") {
  check_provider<ops::WidenGemm, bf16, float>();
  check_provider<ops::WidenGemm, bf16, bf16>();
  check_provider<ops::WidenGemm, fp16, float>();
}

TEST_CASE("Kokkos Kernels' provider, called directly, equals a double loop") {
  check_provider<ops::KokkosKernelsGemm, float>();
  check_provider<ops::KokkosKernelsGemm, double>();
}

#if WEFT_ONEDNN_PROVIDER
TEST_CASE("oneDNN's provider, called directly, equals a double loop, and caches its primitives") {
  if constexpr (Kokkos::SpaceAccessibility<Space, Kokkos::HostSpace>::accessible) {
    check_provider<ops::OneDnnGemm, float>();
    check_provider<ops::OneDnnGemm, bf16, float>();
    check_provider<ops::OneDnnGemm, bf16, bf16>();
    // A product of a shape seen before builds nothing new.
    ops::Matrix<float, Space> A("A", 13, 7), B("B", 7, 11), C("C", 13, 11);
    ops::gemm_provider_runner<ops::OneDnnGemm>::run(ops::Trans::N, ops::Trans::N, 1.0f, A, B, 0.0f, C);
    const auto builds = ops::onednn_primitive_builds();
    for (int i = 0; i < 3; ++i)
      ops::gemm_provider_runner<ops::OneDnnGemm>::run(ops::Trans::N, ops::Trans::N, 1.0f, A, B, 0.0f, C);
    CHECK(ops::onednn_primitive_builds() == builds);
    ops::gemm_provider_runner<ops::OneDnnGemm>::run(ops::Trans::N, ops::Trans::N, 1.0f, A, B, 1.0f, C);
    CHECK(ops::onednn_primitive_builds() == builds + 1);  // beta is part of the primitive
  }
}
#endif

TEST_CASE("zero sizes through ops::gemm: nothing for m or n = 0, beta C for k = 0") {
  auto run = [](std::size_t m, std::size_t n, std::size_t k, float beta) {
    ops::Matrix<float, Space> A("A", m, k), B("B", k, n), C("C", m, n);
    Kokkos::deep_copy(C, 3.0f);
    ops::gemm(ops::Trans::N, ops::Trans::N, 1.0f, A, B, beta, C);
    auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), C);
    std::vector<float> out;
    for (std::size_t i = 0; i < m; ++i)
      for (std::size_t j = 0; j < n; ++j) out.push_back(h(i, j));
    return out;
  };
  CHECK(run(0, 4, 3, 0.0f).empty());
  CHECK(run(4, 0, 3, 0.0f).empty());
  for (float v : run(3, 4, 0, 0.5f)) CHECK(v == 1.5f);
  for (float v : run(3, 4, 0, 0.0f)) CHECK(v == 0.0f);  // beta 0 overwrites, as BLAS does for k > 0
}

TEST_CASE("the provider is chosen by type, and the one chosen is the one that runs") {
  using F = ops::gemm_provider_t<ops::Matrix<float, Space>, ops::Matrix<float, Space>, ops::Matrix<float, Space>>;
  using D = ops::gemm_provider_t<ops::Matrix<double, Space>, ops::Matrix<double, Space>, ops::Matrix<double, Space>>;
  static_assert(std::is_same_v<D, ops::KokkosKernelsGemm>, "double products always go to Kokkos Kernels");
  using H = ops::gemm_provider_t<ops::Matrix<bf16, Space>, ops::Matrix<bf16, Space>, ops::Matrix<float, Space>>;
  using H16 = ops::gemm_provider_t<ops::Matrix<fp16, Space>, ops::Matrix<fp16, Space>, ops::Matrix<float, Space>>;
  static_assert(std::is_same_v<H16, ops::WidenGemm>, "fp16 inputs are widened (no provider takes them on the host)");
  constexpr bool host = Kokkos::SpaceAccessibility<Space, Kokkos::HostSpace>::accessible;
#if WEFT_ONEDNN_PROVIDER
  static_assert(std::is_same_v<F, std::conditional_t<host, ops::OneDnnGemm, ops::KokkosKernelsGemm>>,
                "with oneDNN, host float products go to oneDNN");
  static_assert(std::is_same_v<H, std::conditional_t<host, ops::OneDnnGemm, ops::WidenGemm>>,
                "with oneDNN, host bf16 products go to oneDNN");
  CHECK(std::string(ops::float_gemm_provider_name<Host>()) == "onednn");
#else
  static_assert(std::is_same_v<F, ops::KokkosKernelsGemm>, "without oneDNN float products go to Kokkos Kernels");
  static_assert(std::is_same_v<H, ops::WidenGemm>, "without oneDNN bf16 products are widened to float");
  CHECK(std::string(ops::float_gemm_provider_name<Host>()) == "kokkos-kernels");
#endif
  (void)host;
  auto& cnt = ops::gemm_counters();
  ops::Matrix<float, Space> A("A", 40, 30), B("B", 30, 20), C("C", 40, 20);
  ops::Matrix<double, Space> Ad("Ad", 40, 30), Bd("Bd", 30, 20), Cd("Cd", 40, 20);
  const auto f0 = cnt.calls_of(F::id), d0 = cnt.calls_of(D::id);
  const double flops0 = cnt.flops_of(F::id);
  ops::gemm(ops::Trans::N, ops::Trans::N, 1.0f, A, B, 0.0f, C);
  if constexpr (!std::is_same_v<F, D>) {
    CHECK(cnt.calls_of(F::id) == f0 + 1);
    CHECK(cnt.calls_of(D::id) == d0);
    CHECK(cnt.flops_of(F::id) == flops0 + 2.0 * 40 * 20 * 30);
  }
  ops::gemm(ops::Trans::N, ops::Trans::N, 1.0, Ad, Bd, 0.0, Cd);
  CHECK(cnt.calls_of(D::id) == d0 + 1 + (std::is_same_v<F, D> ? 1 : 0));
}

TEST_CASE("gemm_few_rows: the streaming kernel below few_rows_max rows on the host, the provider above") {
  auto& cnt = ops::gemm_counters();
  using F = ops::gemm_provider_t<ops::Matrix<float, Space>, ops::Matrix<float, Space>, ops::Matrix<float, Space>>;
  for (std::size_t m : {std::size_t(1), std::size_t(16), ops::few_rows_max, ops::few_rows_max + 1}) {
    ops::Matrix<float, Space> A("A", m, 70), B("B", 70, 130), C("C", m, 130);
    fill(A, 5);
    fill(B, 6);
    const auto few0 = cnt.calls_of(ops::GemmProviderId::few_rows), p0 = cnt.calls_of(F::id);
    ops::gemm_few_rows(A, B, C);
    const bool streams = m <= ops::few_rows_max && Kokkos::SpaceAccessibility<Space, Kokkos::HostSpace>::accessible;
    CAPTURE(m);
    CHECK(cnt.calls_of(ops::GemmProviderId::few_rows) == few0 + (streams ? 1 : 0));
    CHECK(cnt.calls_of(F::id) == p0 + (streams ? 0 : 1));
    std::vector<double> ref, bound;
    reference(ops::Trans::N, ops::Trans::N, 1.0, A, B, 0.0, C, ref, bound, 0x1p-24);
    check_within(C, ref, bound);
  }
}
