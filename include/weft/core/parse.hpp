// Strict parsing of the numbers (and named choices) weft's programs read
// from command lines and the environment. The whole text must be the number, and a value outside
// the destination's range is refused with the value and the range: a plain
// std::stoll and a cast would turn --mesh dp=4294967298 into dp=2 in an int.
#pragma once

#include <charconv>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <system_error>
#include <type_traits>

#include <weft/core/error.hpp>

namespace weft {

namespace detail {

// The magnitude and sign of a decimal integer (an optional '+' or '-', then
// digits only); nullopt for anything else. `overflow` is set when the
// magnitude does not fit in 64 bits.
struct ParsedInteger {
  bool negative = false;
  unsigned long long magnitude = 0;
  bool overflow = false;
};
inline std::optional<ParsedInteger> parse_decimal(const std::string& text) {
  ParsedInteger p;
  std::size_t i = 0;
  if (i < text.size() && (text[i] == '+' || text[i] == '-')) p.negative = text[i++] == '-';
  if (i == text.size()) return std::nullopt;
  for (std::size_t j = i; j < text.size(); ++j)
    if (text[j] < '0' || text[j] > '9') return std::nullopt;
  const auto [end, ec] = std::from_chars(text.data() + i, text.data() + text.size(), p.magnitude);
  if (ec == std::errc::result_out_of_range) p.overflow = true;
  else if (ec != std::errc() || end != text.data() + text.size()) return std::nullopt;
  return p;
}

}  // namespace detail

/// Parses `text` as a decimal integer of type T within [lo, hi] (the whole
/// text: digits with an optional sign; no spaces, no suffix). Throws
/// weft::ConfigError "<what> <text>: ..." naming the range when the text is
/// not an integer or the value lies outside [lo, hi] (values beyond 64 bits
/// included), so no value wraps on its way into T.
template <class T>
T parse_integer(const std::string& what, const std::string& text, T lo = std::numeric_limits<T>::min(),
                T hi = std::numeric_limits<T>::max()) {
  static_assert(std::is_integral_v<T> && !std::is_same_v<T, bool>, "parse_integer parses into an integer type");
  auto fail = [&](const char* why) {
    detail::throw_error<ConfigError>(what, " ", text, ": ", why, "; expected an integer from ", lo, " to ", hi);
  };
  const auto p = detail::parse_decimal(text);
  if (!p) fail("not an integer");
  const bool in_range = [&] {
    if (p->overflow) return false;
    if (p->negative) {
      if (p->magnitude == 0) return lo <= 0 && hi >= 0;
      if constexpr (std::is_unsigned_v<T>) {
        return false;
      } else {
        // -magnitude >= lo  <=>  magnitude <= -(lo) computed without overflow
        const unsigned long long lo_mag = lo < 0 ? 0ull - static_cast<unsigned long long>(lo) : 0ull;
        if (lo >= 0 || p->magnitude > lo_mag) return false;
        const long long v = p->magnitude == lo_mag ? static_cast<long long>(lo) : -static_cast<long long>(p->magnitude);
        return v <= static_cast<long long>(hi);
      }
    }
    if (hi < 0) return false;
    if (p->magnitude > static_cast<unsigned long long>(hi)) return false;
    if constexpr (std::is_signed_v<T>)
      return lo <= 0 || p->magnitude >= static_cast<unsigned long long>(lo);
    else
      return p->magnitude >= static_cast<unsigned long long>(lo);
  }();
  if (!in_range) fail("out of range");
  if (p->negative && p->magnitude > 0)  // -(m - 1) - 1: no overflow at the type's lowest value
    return static_cast<T>(-static_cast<long long>(p->magnitude - 1) - 1);
  return static_cast<T>(p->magnitude);
}

/// A duration in seconds as an environment variable or a flag gives it:
/// a non-negative number ("5", "2.5") with an optional unit "s", "ms" or
/// "min" (a space before it allowed: "5 s"). Returns nullopt for anything
/// else (a negative or non-finite number, another unit, trailing text).
inline std::optional<double> parse_seconds(const std::string& text) {
  const char* b = text.c_str();
  char* end = nullptr;
  const double x = std::strtod(b, &end);
  if (end == b || !std::isfinite(x) || x < 0) return std::nullopt;
  std::string unit(end);
  if (!unit.empty() && unit.front() == ' ') unit.erase(0, 1);
  if (unit.empty() || unit == "s") return x;
  if (unit == "ms") return x / 1000.0;
  if (unit == "min") return x * 60.0;
  return std::nullopt;
}

/// The value `choices` maps `text` to (the whole text, case-sensitive).
/// Throws weft::ConfigError "<what> <text>: expected one of a, b, c" (the
/// names in the map's order) for any other text.
template <class E>
E parse_choice(const std::string& what, const std::string& text, const std::map<std::string, E>& choices) {
  const auto it = choices.find(text);
  if (it == choices.end()) {
    std::string names;
    for (const auto& entry : choices) names += (names.empty() ? "" : ", ") + entry.first;
    detail::throw_error<ConfigError>(what, " ", text, ": expected one of ", names);
  }
  return it->second;
}

}  // namespace weft
