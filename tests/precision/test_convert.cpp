// weft::convert and weft::converted: every element of a view converted as
// the scalar conversion of core/half.hpp converts it (bit for bit), on each
// execution space, for contiguous views (the flat loop), mixed layouts and
// strided subviews (the MDRange loops), ranks 1 to 4; mismatched extents and
// ranks that need contiguity are refused with the views' shapes.
// Single-rank.
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>

#include "weft_test.hpp"

namespace {

using weft::bf16;
using weft::fp16;

template <class T>
std::uint64_t bits_of(const T& x) {
  std::uint64_t b = 0;
  std::memcpy(&b, &x, sizeof x);
  return b;
}

// The same value and bits, with any NaN equal to any NaN of the same sign
// (the scalar and kernel paths are the same code, so the bits agree anyway;
// this only keeps the comparison meaningful for NaN payloads of doubles).
template <class T>
bool same(const T& a, const T& b) {
  if (std::isnan(double(a)) || std::isnan(double(b)))
    return std::isnan(double(a)) && std::isnan(double(b)) && std::signbit(double(a)) == std::signbit(double(b));
  return bits_of(a) == bits_of(b);
}

// Values that exercise rounding: random bit patterns (all exponents, NaN and
// infinities) and values spread over fp16's range.
template <class S>
S sample(std::mt19937_64& rng, std::size_t i) {
  if (i % 2 == 0) {
    if constexpr (std::is_same_v<S, double>) return std::bit_cast<double>(rng());
    else if constexpr (std::is_same_v<S, float>) return std::bit_cast<float>(static_cast<std::uint32_t>(rng()));
    else return S::from_bits(static_cast<std::uint16_t>(rng()));
  }
  std::uniform_real_distribution<double> u(-70000.0, 70000.0);
  const double x = u(rng) * std::ldexp(1.0, -int(rng() % 40));
  return S(x);
}

template <class V>
auto host(const V& v) {
  return Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), v);
}

// convert on rank-1 views of n elements from S to D, checked element by element against D(S).
template <class Exec, class D, class S>
void check_rank1(std::size_t n) {
  using Mem = typename Exec::memory_space;
  Kokkos::View<S*, Mem> src("src", n);
  Kokkos::View<D*, Mem> dst("dst", n);
  auto sh = Kokkos::create_mirror_view(src);
  std::mt19937_64 rng(n);
  for (std::size_t i = 0; i < n; ++i) sh(i) = sample<S>(rng, i);
  Kokkos::deep_copy(src, sh);
  weft::convert(dst, src);
  Kokkos::fence();
  auto dh = host(dst);
  std::size_t bad = 0;
  for (std::size_t i = 0; i < n; ++i) bad += !same(dh(i), static_cast<D>(sh(i)));
  CHECK(bad == 0);
}

TEST_CASE_TEMPLATE("convert: every pair of element types, rank 1, bit for bit with the scalar conversion", Exec,
                   WEFT_TEST_EXEC_SPACES) {
  const std::size_t n = 100003;
  check_rank1<Exec, bf16, float>(n);
  check_rank1<Exec, fp16, float>(n);
  check_rank1<Exec, float, bf16>(n);
  check_rank1<Exec, float, fp16>(n);
  check_rank1<Exec, bf16, double>(n);
  check_rank1<Exec, fp16, double>(n);
  check_rank1<Exec, double, bf16>(n);
  check_rank1<Exec, bf16, fp16>(n);
  check_rank1<Exec, fp16, bf16>(n);
  check_rank1<Exec, float, float>(n);
  check_rank1<Exec, bf16, float>(1);
  check_rank1<Exec, bf16, float>(0);
}

TEST_CASE_TEMPLATE("convert: mixed layouts, strided subviews and ranks 2 to 4", Exec, WEFT_TEST_EXEC_SPACES) {
  using Mem = typename Exec::memory_space;
  std::mt19937_64 rng(5);
  // Rank 2: LayoutRight float into LayoutLeft bf16 (the MDRange loop).
  Kokkos::View<float**, Kokkos::LayoutRight, Mem> a("a", 37, 53);
  auto ah = Kokkos::create_mirror_view(a);
  for (std::size_t i = 0; i < a.extent(0); ++i)
    for (std::size_t j = 0; j < a.extent(1); ++j) ah(i, j) = sample<float>(rng, i * 53 + j);
  Kokkos::deep_copy(a, ah);
  Kokkos::View<bf16**, Kokkos::LayoutLeft, Mem> b("b", 37, 53);
  weft::convert(b, a);
  Kokkos::fence();
  auto bh = host(b);
  std::size_t bad = 0;
  for (std::size_t i = 0; i < a.extent(0); ++i)
    for (std::size_t j = 0; j < a.extent(1); ++j) bad += !same(bh(i, j), bf16(ah(i, j)));
  CHECK(bad == 0);

  // A strided column block of a into a contiguous fp16 view, and back into a's other columns.
  auto cols = Kokkos::subview(a, Kokkos::ALL, std::make_pair(10, 30));
  Kokkos::View<fp16**, Kokkos::LayoutRight, Mem> h("h", 37, 20);
  weft::convert(h, cols);
  auto back = Kokkos::subview(a, Kokkos::ALL, std::make_pair(30, 50));
  weft::convert(back, h);
  Kokkos::fence();
  auto hh = host(h);
  auto a2 = host(a);
  bad = 0;
  for (std::size_t i = 0; i < 37; ++i)
    for (std::size_t j = 0; j < 20; ++j) {
      bad += !same(hh(i, j), fp16(ah(i, 10 + j)));
      bad += !same(a2(i, 30 + j), float(fp16(ah(i, 10 + j))));
    }
  CHECK(bad == 0);

  // Rank 3 with a strided source.
  Kokkos::View<double***, Kokkos::LayoutRight, Mem> c("c", 4, 6, 8);
  auto ch = Kokkos::create_mirror_view(c);
  for (std::size_t k = 0; k < c.size(); ++k) ch.data()[k] = sample<double>(rng, k);
  Kokkos::deep_copy(c, ch);
  auto cs = Kokkos::subview(c, Kokkos::ALL, std::make_pair(1, 5), Kokkos::ALL);
  Kokkos::View<bf16***, Mem> d("d", 4, 4, 8);
  weft::convert(d, cs);
  Kokkos::fence();
  auto dh = host(d);
  bad = 0;
  for (std::size_t i = 0; i < 4; ++i)
    for (std::size_t j = 0; j < 4; ++j)
      for (std::size_t k = 0; k < 8; ++k) bad += !same(dh(i, j, k), bf16(ch(i, j + 1, k)));
  CHECK(bad == 0);

  // Rank 4, contiguous: the flat loop.
  Kokkos::View<float****, Mem> e("e", 2, 3, 4, 5);
  auto eh = Kokkos::create_mirror_view(e);
  for (std::size_t k = 0; k < e.size(); ++k) eh.data()[k] = sample<float>(rng, k);
  Kokkos::deep_copy(e, eh);
  Kokkos::View<fp16****, Mem> f("f", 2, 3, 4, 5);
  weft::convert(f, e);
  Kokkos::fence();
  auto fh = host(f);
  bad = 0;
  for (std::size_t k = 0; k < e.size(); ++k) bad += !same(fh.data()[k], fp16(eh.data()[k]));
  CHECK(bad == 0);
}

TEST_CASE_TEMPLATE("converted allocates a view of the new type with the source's extents and layout", Exec,
                   WEFT_TEST_EXEC_SPACES) {
  using Mem = typename Exec::memory_space;
  Kokkos::View<float**, Kokkos::LayoutLeft, Mem> w("w", 5, 7);
  auto wh = Kokkos::create_mirror_view(w);
  for (std::size_t i = 0; i < 5; ++i)
    for (std::size_t j = 0; j < 7; ++j) wh(i, j) = 0.1f * float(i) - 0.37f * float(j);
  Kokkos::deep_copy(w, wh);
  auto c = weft::converted<bf16>(w, "compute_copy");
  static_assert(std::is_same_v<decltype(c), Kokkos::View<bf16**, Kokkos::LayoutLeft, Mem>>);
  Kokkos::fence();
  CHECK(c.label() == "compute_copy");
  CHECK(c.extent(0) == 5);
  CHECK(c.extent(1) == 7);
  auto ch = host(c);
  std::size_t bad = 0;
  for (std::size_t i = 0; i < 5; ++i)
    for (std::size_t j = 0; j < 7; ++j) bad += ch(i, j).bits() != bf16(wh(i, j)).bits();
  CHECK(bad == 0);
  // A strided source gives a LayoutRight result.
  auto sub = Kokkos::subview(w, std::make_pair(1, 4), Kokkos::ALL);
  auto cs = weft::converted<float>(weft::converted<fp16>(sub, "h"), "f");
  if constexpr (std::is_same_v<typename decltype(sub)::array_layout, Kokkos::LayoutStride>)
    static_assert(std::is_same_v<typename decltype(weft::converted<fp16>(sub, "h"))::array_layout, Kokkos::LayoutRight>);
  Kokkos::fence();
  auto csh = host(cs);
  bad = 0;
  for (std::size_t i = 0; i < 3; ++i)
    for (std::size_t j = 0; j < 7; ++j) bad += !same(csh(i, j), float(fp16(wh(i + 1, j))));
  CHECK(bad == 0);
}

TEST_CASE("convert refuses mismatched extents and non-contiguous views of rank above 3, naming the shapes") {
  Kokkos::View<float**, Kokkos::HostSpace> a("weights", 4, 6);
  Kokkos::View<bf16**, Kokkos::HostSpace> b("copy", 4, 5);
  const std::string e = weft::test::error_text<weft::ShapeError>([&] { weft::convert(b, a); });
  CHECK(weft::test::contains(e, "the views' extents differ (dst 'copy' is 4 x 5, src 'weights' is 4 x 6)"));

  Kokkos::View<float****, Kokkos::HostSpace> big("big", 2, 3, 4, 5);
  auto part = Kokkos::subview(big, Kokkos::ALL, Kokkos::ALL, Kokkos::ALL, std::make_pair(0, 2));
  Kokkos::View<fp16****, Kokkos::HostSpace> out("out", 2, 3, 4, 2);
  const std::string e4 = weft::test::error_text<weft::ShapeError>([&] { weft::convert(out, part); });
  CHECK(weft::test::contains(e4, "views of rank 4 are converted only when both are contiguous"));
}

}  // namespace
