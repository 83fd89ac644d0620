// weft::bf16 and weft::fp16: every bit pattern through float and back, float
// (and double) to 2 bytes against an independent reference -- the two
// representable neighbours of the value, enumerated from the formats' fields
// in double, and the nearer (ties: the even one) chosen -- on hand-picked
// edge cases, on every midpoint between neighbours and on a large random
// sample; the same conversions inside Kokkos kernels; and 2-byte views
// through MPI. Single-rank.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "weft_test.hpp"

namespace {

using weft::bf16;
using weft::fp16;

// ---------------------------------------------------------------------------
// The reference: a format described by its field widths, values computed
// with ldexp from the fields, rounding by enumerating neighbours.

struct Format {
  const char* name;
  int exponent_bits;
  int mantissa_bits;
  int bias() const { return (1 << (exponent_bits - 1)) - 1; }
  std::uint16_t infinity_bits() const { return static_cast<std::uint16_t>(((1 << exponent_bits) - 1) << mantissa_bits); }
  std::uint16_t sign_bit() const { return 0x8000; }
  bool is_nan(std::uint16_t b) const {
    return (b & infinity_bits()) == infinity_bits() && (b & ((1u << mantissa_bits) - 1)) != 0;
  }
  bool is_quiet_nan(std::uint16_t b) const { return is_nan(b) && (b & (1u << (mantissa_bits - 1))) != 0; }
  // The value of a non-negative pattern below NaNs; infinity_bits() itself is
  // given the value the formula continues to (2^(emax + 1)), which is where
  // IEEE 754 puts the rounding boundary of overflow.
  double magnitude(std::uint16_t p) const {
    const int e = p >> mantissa_bits;
    const int f = p & ((1 << mantissa_bits) - 1);
    if (e == 0) return std::ldexp(double(f), 1 - bias() - mantissa_bits);
    return std::ldexp(double((1 << mantissa_bits) + f), e - bias() - mantissa_bits);
  }
};

constexpr Format kBF16{"bf16", 8, 7};
constexpr Format kFP16{"fp16", 5, 10};

// All non-negative finite magnitudes in order, with the overflow boundary last.
std::vector<double> magnitudes(const Format& fmt) {
  std::vector<double> v;
  for (std::uint32_t p = 0; p <= fmt.infinity_bits(); ++p) v.push_back(fmt.magnitude(static_cast<std::uint16_t>(p)));
  return v;
}

// x (not NaN) rounded to the format: the pattern of the nearer neighbour,
// the even one on a tie, the infinity at or beyond the overflow boundary.
std::uint16_t reference_round(double x, const Format& fmt, const std::vector<double>& table) {
  const std::uint16_t sign = std::signbit(x) ? fmt.sign_bit() : 0;
  const double a = std::fabs(x);
  const auto inf = fmt.infinity_bits();
  if (a >= table[inf]) return static_cast<std::uint16_t>(sign | inf);
  const auto lo = static_cast<std::uint16_t>(std::upper_bound(table.begin(), table.end(), a) - table.begin() - 1);
  const std::uint16_t hi = lo + 1;
  // lo and hi have at most 11 significant bits: their midpoint is exact in double.
  const double mid = (table[lo] + table[hi]) / 2;
  std::uint16_t r;
  if (a < mid) r = lo;
  else if (a > mid) r = hi;
  else r = (lo % 2 == 0) ? lo : hi;
  return static_cast<std::uint16_t>(sign | r);
}

template <class H>
constexpr const Format& format_of() {
  if constexpr (std::is_same_v<H, bf16>) return kBF16;
  else return kFP16;
}

std::string hex(std::uint64_t v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "0x%llx", static_cast<unsigned long long>(v));
  return buf;
}

float float_of(std::uint32_t u) { return std::bit_cast<float>(u); }
std::uint32_t bits_of(float f) { return std::bit_cast<std::uint32_t>(f); }

// Checks H(x) against the reference; returns the number of mismatches (the
// first few are printed with the value's bits).
template <class H, class X>
std::size_t check_conversion(const std::vector<X>& xs, const std::vector<double>& table, const char* what) {
  const Format& fmt = format_of<H>();
  std::size_t bad = 0;
  for (const X x : xs) {
    const std::uint16_t got = H(x).bits();
    bool ok;
    std::uint16_t want = 0;
    if (std::isnan(x)) {
      ok = fmt.is_quiet_nan(got) && ((got & fmt.sign_bit()) != 0) == std::signbit(x);
    } else {
      want = reference_round(double(x), fmt, table);
      ok = got == want;
    }
    if (!ok && ++bad <= 5) {
      std::uint64_t xb = 0;
      std::memcpy(&xb, &x, sizeof x);
      MESSAGE(fmt.name << "(" << what << " " << hex(xb) << " = " << double(x) << ") gave " << hex(got) << ", want "
                       << (std::isnan(x) ? std::string("a quiet NaN of the same sign") : hex(want)));
    }
  }
  return bad;
}

// Every float within one float-ulp of a midpoint between neighbouring
// representable values (and the midpoints and the values themselves), both
// signs: the cases where rounding decides.
std::vector<float> midpoint_cases(const std::vector<double>& table) {
  std::vector<float> v;
  for (std::size_t p = 0; p + 1 < table.size(); ++p) {
    const float lo = static_cast<float>(table[p]);
    const float mid = static_cast<float>((table[p] + table[p + 1]) / 2);
    REQUIRE(double(mid) == (table[p] + table[p + 1]) / 2);  // midpoints are floats
    for (float x : {lo, mid, std::nextafter(mid, 0.0f), std::nextafter(mid, std::numeric_limits<float>::infinity())}) {
      v.push_back(x);
      v.push_back(-x);
    }
  }
  return v;
}

// ---------------------------------------------------------------------------
// The types' properties.

static_assert(sizeof(bf16) == 2 && sizeof(fp16) == 2);
static_assert(std::is_trivially_copyable_v<bf16> && std::is_trivially_copyable_v<fp16>);
static_assert(std::is_standard_layout_v<bf16> && std::is_standard_layout_v<fp16>);
static_assert(weft::is_reduced_precision_v<bf16> && weft::is_reduced_precision_v<const fp16> &&
              !weft::is_reduced_precision_v<float> && !weft::is_reduced_precision_v<std::uint16_t>);
static_assert(std::is_same_v<weft::accumulation_t<bf16>, float> && std::is_same_v<weft::accumulation_t<fp16>, float> &&
              std::is_same_v<weft::accumulation_t<double>, double> && std::is_same_v<weft::accumulation_t<float>, float>);
static_assert(weft::Communicable<bf16> && weft::Communicable<fp16>);
static_assert(!weft::mpi_reducible_v<bf16> && !weft::mpi_reducible_v<fp16> && weft::mpi_reducible_v<float>);
// Narrowing is explicit, widening implicit.
static_assert(!std::is_convertible_v<float, bf16> && !std::is_convertible_v<double, fp16>);
static_assert(std::is_convertible_v<bf16, float> && std::is_convertible_v<fp16, float>);
// The conversions are constexpr.
static_assert(bf16(1.0f).bits() == 0x3f80 && fp16(1.0f).bits() == 0x3c00 && fp16(-2).bits() == 0xc000);
static_assert(float(fp16::from_bits(0x0001)) == 0x1p-24f && float(bf16::from_bits(0x0001)) == 0x1p-133f);
static_assert(bf16{}.bits() == 0 && fp16{}.bits() == 0);
// numeric_limits agree with the patterns' values.
static_assert(float(std::numeric_limits<fp16>::max()) == 65504.0f && float(std::numeric_limits<fp16>::min()) == 0x1p-14f &&
              float(std::numeric_limits<fp16>::epsilon()) == 0x1p-10f &&
              float(std::numeric_limits<fp16>::denorm_min()) == 0x1p-24f);
static_assert(float(std::numeric_limits<bf16>::max()) == 0x1.fep127f && float(std::numeric_limits<bf16>::min()) == 0x1p-126f &&
              float(std::numeric_limits<bf16>::epsilon()) == 0x1p-7f &&
              float(std::numeric_limits<bf16>::lowest()) == -0x1.fep127f);

TEST_CASE_TEMPLATE("every 2-byte pattern converts to float exactly and back to itself (NaNs stay NaN)", H, bf16, fp16) {
  const Format& fmt = format_of<H>();
  std::size_t bad = 0, nans = 0;
  for (std::uint32_t p = 0; p < 65536; ++p) {
    const auto b = static_cast<std::uint16_t>(p);
    const float f = H::from_bits(b);
    const std::uint16_t back = H(f).bits();
    bool ok;
    if (fmt.is_nan(b)) {
      ++nans;
      // The float is a NaN of the same sign; a quiet NaN comes back bit for
      // bit, a signalling one comes back quiet with the same sign.
      ok = std::isnan(f) && std::signbit(f) == ((b & 0x8000) != 0) && fmt.is_quiet_nan(back) &&
           (back & 0x8000) == (b & 0x8000) && (!fmt.is_quiet_nan(b) || back == b);
    } else {
      // The float's value is the pattern's value (exactly, against the
      // fields' formula), and rounding it gives the pattern again.
      const std::uint16_t mag = b & 0x7fff;
      const double want = (b & 0x8000 ? -1.0 : 1.0) * (mag == fmt.infinity_bits() ? HUGE_VAL : fmt.magnitude(mag));
      ok = double(f) == want && std::signbit(f) == ((b & 0x8000) != 0) && back == b;
    }
    if (!ok && ++bad <= 5) MESSAGE(fmt.name << " pattern " << hex(b) << " -> " << f << " -> " << hex(back));
  }
  CHECK(bad == 0);
  // 2 signs x (2^m - 1) NaN mantissas.
  CHECK(nans == 2 * ((std::size_t(1) << fmt.mantissa_bits) - 1));
}

TEST_CASE("float to bf16: edge cases round to nearest even, overflow to infinity, NaN stays NaN") {
  struct Case {
    std::uint32_t f;
    std::uint16_t want;
    const char* why;
  };
  const Case cases[] = {
      {0x00000000, 0x0000, "+0"},
      {0x80000000, 0x8000, "-0 keeps its sign"},
      {0x3f800000, 0x3f80, "1"},
      {0x3f808000, 0x3f80, "1 + 2^-8: a tie between 1 (even) and 1 + 2^-7"},
      {0x3f818000, 0x3f82, "1 + 3 2^-8: a tie between 1 + 2^-7 (odd) and 1 + 2^-6"},
      {0x3f808001, 0x3f81, "just above the tie rounds up"},
      {0x3f807fff, 0x3f80, "just below the tie rounds down"},
      {0xbf808000, 0xbf80, "ties to even for negative values too"},
      {0x7f7f0000, 0x7f7f, "the largest bf16"},
      {0x7f7f7fff, 0x7f7f, "just below half an ulp above the largest bf16"},
      {0x7f7f8000, 0x7f80, "half an ulp above the largest bf16 (odd) overflows to infinity"},
      {0x7f7fffff, 0x7f80, "the largest float overflows to infinity"},
      {0xff7fffff, 0xff80, "the lowest float overflows to -infinity"},
      {0x7f800000, 0x7f80, "+infinity"},
      {0xff800000, 0xff80, "-infinity"},
      {0x00800000, 0x0080, "the smallest normal float"},
      {0x00000001, 0x0000, "the smallest subnormal float rounds to zero"},
      {0x00008000, 0x0000, "a tie between 0 (even) and the smallest bf16 subnormal"},
      {0x00008001, 0x0001, "just above it"},
      {0x00018000, 0x0002, "a tie between subnormals 1 (odd) and 2"},
      {0x007fffff, 0x0080, "the largest subnormal float rounds up to the smallest normal"},
  };
  for (const Case& c : cases) {
    INFO(c.why << ": " << hex(c.f));
    CHECK(bf16(float_of(c.f)).bits() == c.want);
  }
  // NaNs: quiet, sign kept, and never an infinity even when the payload sits
  // only in the 16 bits that bf16 drops.
  for (std::uint32_t nan : {0x7fc00000u, 0xffc00000u, 0x7f800001u, 0xff800001u, 0x7fffffffu, 0x7fa00000u}) {
    INFO("NaN " << hex(nan));
    const std::uint16_t b = bf16(float_of(nan)).bits();
    CHECK(kBF16.is_quiet_nan(b));
    CHECK((b & 0x8000) == ((nan >> 16) & 0x8000));
  }
}

TEST_CASE("float to fp16: edge cases round to nearest even, subnormals, overflow to infinity, NaN stays NaN") {
  struct Case {
    float f;
    std::uint16_t want;
    const char* why;
  };
  const Case cases[] = {
      {0.0f, 0x0000, "+0"},
      {-0.0f, 0x8000, "-0 keeps its sign"},
      {1.0f, 0x3c00, "1"},
      {1.0f + 0x1p-11f, 0x3c00, "1 + 2^-11: a tie between 1 (even) and 1 + 2^-10"},
      {1.0f + 3 * 0x1p-11f, 0x3c02, "1 + 3 2^-11: a tie between 1 + 2^-10 (odd) and 1 + 2^-9"},
      {2049.0f, 0x6800, "2049: a tie between 2048 (even) and 2050"},
      {2051.0f, 0x6802, "2051: a tie between 2050 (odd) and 2052"},
      {65504.0f, 0x7bff, "the largest fp16"},
      {65519.0f, 0x7bff, "below half an ulp above it"},
      {std::nextafter(65520.0f, 0.0f), 0x7bff, "just below half an ulp above it"},
      {65520.0f, 0x7c00, "half an ulp above the largest fp16 (odd) overflows to infinity"},
      {-65520.0f, 0xfc00, "and to -infinity"},
      {1e9f, 0x7c00, "far beyond the range"},
      {std::numeric_limits<float>::max(), 0x7c00, "the largest float"},
      {std::numeric_limits<float>::infinity(), 0x7c00, "+infinity"},
      {-std::numeric_limits<float>::infinity(), 0xfc00, "-infinity"},
      {0x1p-14f, 0x0400, "the smallest normal fp16"},
      {0x1p-14f - 0x1p-25f, 0x0400, "a tie between the largest subnormal (odd) and the smallest normal"},
      {0x1p-14f - 0x1p-24f, 0x03ff, "the largest subnormal"},
      {0x1p-24f, 0x0001, "the smallest subnormal"},
      {-0x1p-24f, 0x8001, "the smallest negative subnormal"},
      {0x1p-25f, 0x0000, "a tie between 0 (even) and the smallest subnormal"},
      {-0x1p-25f, 0x8000, "the same tie below zero gives -0"},
      {std::nextafter(0x1p-25f, 1.0f), 0x0001, "just above that tie"},
      {3 * 0x1p-25f, 0x0002, "a tie between subnormals 1 (odd) and 2"},
      {5 * 0x1p-25f, 0x0002, "a tie between subnormals 2 (even) and 3"},
      {0x1p-26f, 0x0000, "below half the smallest subnormal"},
      {std::numeric_limits<float>::denorm_min(), 0x0000, "the smallest float"},
      {0.1f, 0x2e66, "0.1"},
  };
  for (const Case& c : cases) {
    INFO(c.why << ": " << c.f);
    CHECK(fp16(c.f).bits() == c.want);
  }
  for (std::uint32_t nan : {0x7fc00000u, 0xffc00000u, 0x7f800001u, 0xff800001u, 0x7fffffffu, 0x7fa00000u}) {
    INFO("NaN " << hex(nan));
    const std::uint16_t h = fp16(float_of(nan)).bits();
    CHECK(kFP16.is_quiet_nan(h));
    CHECK((h & 0x8000) == ((nan >> 16) & 0x8000));
  }
  // fp16 subnormals to float.
  CHECK(float(fp16::from_bits(0x0001)) == 0x1p-24f);
  CHECK(float(fp16::from_bits(0x03ff)) == 1023 * 0x1p-24f);
  CHECK(float(fp16::from_bits(0x8200)) == -0x1p-15f);
  CHECK(std::signbit(float(fp16::from_bits(0x8000))));
}

TEST_CASE_TEMPLATE("float to 2 bytes matches the reference at every midpoint and on 2 x 10^6 random floats", H, bf16, fp16) {
  const Format& fmt = format_of<H>();
  const auto table = magnitudes(fmt);
  // The reference itself on a few values it must get right.
  REQUIRE(reference_round(1.0, fmt, table) == H(1.0f).bits());
  REQUIRE(table.back() == (std::is_same_v<H, bf16> ? 0x1p128 : 0x1p16));

  CHECK(check_conversion<H>(midpoint_cases(table), table, "float") == 0);

  const std::uint64_t seed = 20261205;
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  std::vector<float> xs;
  // 10^6 uniformly random bit patterns: every exponent, NaNs and infinities included.
  for (int i = 0; i < 1000000; ++i) xs.push_back(float_of(static_cast<std::uint32_t>(rng())));
  // 10^6 whose exponent lies near the format's range and its subnormals, where
  // most patterns above would saturate or vanish for fp16.
  const int lo_e = std::is_same_v<H, bf16> ? 1 : 127 - 30, hi_e = std::is_same_v<H, bf16> ? 254 : 127 + 18;
  std::uniform_int_distribution<int> exponent(lo_e, hi_e);
  for (int i = 0; i < 1000000; ++i) {
    const auto r = static_cast<std::uint32_t>(rng());
    xs.push_back(float_of((r & 0x807fffffu) | (static_cast<std::uint32_t>(exponent(rng)) << 23)));
  }
  CHECK(check_conversion<H>(xs, table, "float") == 0);
}

TEST_CASE_TEMPLATE("double to 2 bytes rounds once (no double rounding through float)", H, bf16, fp16) {
  const Format& fmt = format_of<H>();
  const auto table = magnitudes(fmt);
  // A double just above a tie whose float rounding lands on the tie: rounding
  // through float would pick the even neighbour, rounding once picks the upper.
  const double tie = (table[0x3c00] + table[0x3c01]) / 2;  // bf16: 2^-7 and its neighbour; fp16: 1 and its neighbour
  const double above = tie + std::ldexp(tie, -40);
  REQUIRE(static_cast<float>(above) == static_cast<float>(tie));
  CHECK(H(above).bits() == reference_round(above, fmt, table));
  CHECK(H(-above).bits() == reference_round(-above, fmt, table));
  CHECK(H(above).bits() == 0x3c01);

  std::mt19937_64 rng(7);
  std::vector<double> xs;
  // Random doubles with exponents over the format's whole range and beyond,
  // and doubles a tiny step from every midpoint.
  const int range = std::is_same_v<H, bf16> ? 140 : 30;
  std::uniform_int_distribution<int> exponent(1023 - range, 1023 + range);
  for (int i = 0; i < 500000; ++i) {
    const std::uint64_t r = rng();
    xs.push_back(std::bit_cast<double>((r & 0x800fffffffffffffull) | (static_cast<std::uint64_t>(exponent(rng)) << 52)));
  }
  for (std::size_t p = 0; p + 1 < table.size(); ++p) {
    const double mid = (table[p] + table[p + 1]) / 2;
    for (double x : {mid, std::nextafter(mid, 0.0), std::nextafter(mid, HUGE_VAL)}) {
      xs.push_back(x);
      xs.push_back(-x);
    }
  }
  xs.push_back(std::numeric_limits<double>::max());
  xs.push_back(std::numeric_limits<double>::denorm_min());
  xs.push_back(std::numeric_limits<double>::quiet_NaN());
  xs.push_back(-std::numeric_limits<double>::infinity());
  CHECK(check_conversion<H>(xs, table, "double") == 0);
  // Integers go through double.
  CHECK(H(3).bits() == H(3.0f).bits());
  CHECK(H(-2049).bits() == H(-2049.0f).bits());
}

// The conversions inside a kernel on each execution space of the build give
// the host's bits.
TEST_CASE_TEMPLATE("conversions inside Kokkos kernels give the host's bits", Exec, WEFT_TEST_EXEC_SPACES) {
  using Mem = typename Exec::memory_space;
  const std::size_t n = 65536 + 4096;
  Kokkos::View<float*, Mem> f("f", n);
  auto fh = Kokkos::create_mirror_view(f);
  std::mt19937 rng(3);
  for (std::size_t i = 0; i < n; ++i)
    fh(i) = i < 65536 ? float(fp16::from_bits(static_cast<std::uint16_t>(i))) + float(bf16::from_bits(static_cast<std::uint16_t>(i)))
                      : float_of(rng());
  Kokkos::deep_copy(f, fh);
  Kokkos::View<bf16*, Mem> b("b", n);
  Kokkos::View<fp16*, Mem> h("h", n);
  Kokkos::View<float*, Mem> back("back", n);
  Kokkos::parallel_for(
      "weft.test.half_kernel", Kokkos::RangePolicy<Exec>(0, n), KOKKOS_LAMBDA(const std::size_t i) {
        b(i) = bf16(f(i));
        h(i) = fp16(f(i));
        back(i) = weft::to_float(b(i)) + weft::to_float(h(i));
      });
  Kokkos::fence();
  auto bh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), b);
  auto hh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), h);
  auto backh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), back);
  std::size_t bad = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const float want = float(bf16(fh(i))) + float(fp16(fh(i)));
    const bool ok = bh(i).bits() == bf16(fh(i)).bits() && hh(i).bits() == fp16(fh(i)).bits() &&
                    (bits_of(backh(i)) == bits_of(want) || (std::isnan(backh(i)) && std::isnan(want)));
    bad += !ok;
  }
  CHECK(bad == 0);
}

TEST_CASE("2-byte views travel through MPI bit for bit; their MPI type is a 2-byte integer") {
  auto& world = weft::test::world();
  CHECK(weft::mpi_datatype<bf16>::get() == MPI_UINT16_T);
  CHECK(weft::mpi_datatype<fp16>::get() == MPI_UINT16_T);
  CHECK(std::string(weft::detail::datatype_name_of_id(weft::mpi_datatype<bf16>::id)) == "weft::bf16");
  CHECK(std::string(weft::detail::datatype_name_of_id(weft::mpi_datatype<fp16>::id)) == "weft::fp16");
  CHECK(weft::mpi_datatype<bf16>::id != weft::mpi_datatype<std::uint16_t>::id);

  const std::size_t n = 65536;
  Kokkos::View<bf16*, Kokkos::HostSpace> b("b", n), bo("bo", n * std::size_t(world.size()));
  Kokkos::View<fp16*, Kokkos::HostSpace> h("h", n), ho("ho", n * std::size_t(world.size()));
  for (std::size_t i = 0; i < n; ++i) {
    b(i) = bf16::from_bits(static_cast<std::uint16_t>(i));
    h(i) = fp16::from_bits(static_cast<std::uint16_t>(i));
  }
  world.all_gather(b, bo);
  world.all_gather(h, ho);
  world.broadcast(b, 0);
  std::size_t bad = 0;
  for (std::size_t i = 0; i < bo.size(); ++i) {
    bad += bo(i).bits() != static_cast<std::uint16_t>(i % n);
    bad += ho(i).bits() != static_cast<std::uint16_t>(i % n);
  }
  for (std::size_t i = 0; i < n; ++i) bad += b(i).bits() != static_cast<std::uint16_t>(i);
  CHECK(bad == 0);
}

}  // namespace
