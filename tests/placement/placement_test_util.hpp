// Helpers of the placement tests: a global tensor every rank can compute, the
// partial values a rank contributes to it, element-by-element comparison
// of a DistView's local block with the global tensor, and the text of the
// error a call throws.
#pragma once

#include <cstddef>
#include <exception>
#include <string>
#include <tuple>

#include "weft_test.hpp"

namespace weft::test {

// Distinct small integers: exact in every element type, sums of a few of them
// too, and a misplaced element always shows.
template <class T>
T global_value(std::size_t g) {
  return static_cast<T>(g + 1);
}

// What coordinate c of an axis holds of value f when the tensor is Partial<Op>.
template <class Op, class T>
T contribution(T f, int c) {
  if constexpr (std::is_same_v<Op, Sum> || std::is_same_v<Op, Avg>) return f * static_cast<T>(c + 1);
  else if constexpr (std::is_same_v<Op, Max>) return f + static_cast<T>(c);
  else return f - static_cast<T>(c);
}

// The reduction over the p ranks of an axis of what contribution() gives.
template <class Op, class T>
T reduced(T f, int p) {
  if constexpr (std::is_same_v<Op, Sum>) return f * static_cast<T>(p * (p + 1) / 2);
  else if constexpr (std::is_same_v<Op, Avg>) return f * static_cast<T>(p + 1) / static_cast<T>(2);
  else if constexpr (std::is_same_v<Op, Max>) return f + static_cast<T>(p - 1);
  else return f - static_cast<T>(p - 1);
}

// Writes value(global linear index) into every local element.
template <class DV, class F>
void fill(const DV& x, F value) {
  auto h = Kokkos::create_mirror_view(x.local());
  const auto m = x.index_map();
  for (std::size_t n = 0; n < h.size(); ++n) h.data()[n] = value(m.global_linear(n));
  Kokkos::deep_copy(x.local(), h);
}

// How many local elements differ from expected(global linear index).
template <class DV, class F>
std::size_t mismatches(const DV& y, F expected) {
  auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), y.local());
  const auto m = y.index_map();
  std::size_t bad = 0;
  for (std::size_t n = 0; n < h.size(); ++n)
    if (h.data()[n] != expected(m.global_linear(n))) ++bad;
  return bad;
}

// "what: N wrong elements", so that a failing CHECK says which case failed
// (the MPI harness reports the expression and its values only).
inline std::string wrong(const std::string& what, std::size_t n) {
  return what + ": " + std::to_string(n) + " wrong elements";
}

// The message of the exception f() throws, or "(no error)" when it throws none.
template <class F>
std::string error_text(F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(no error)";
}

// Whether part occurs in s.
inline bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// Calls f.template operator()<Exec>() for every execution space of the build.
template <class F>
void for_each_exec_space(F&& f) {
  [&]<class... E>(std::tuple<E...>*) { (f.template operator()<E>(), ...); }(static_cast<std::tuple<WEFT_TEST_EXEC_SPACES>*>(nullptr));
}

}  // namespace weft::test
