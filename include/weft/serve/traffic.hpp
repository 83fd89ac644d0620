// Request lengths of the serving traffic models (examples/serve_gpt and
// benchmarks/bench_serve): a prompt's or an output's token count drawn from
// a distribution over [lo, hi], as a pure function of one uniform 64-bit
// draw, so that every rank and every run builds the same traffic.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>

#include <weft/core/error.hpp>

namespace weft::serve {

/// The shape of a length distribution.
enum class LengthShape {
  uniform,     ///< every length in [lo, hi] equally likely
  exponential  ///< lo plus an exponential excess, truncated at hi: most requests short, a few long
};

/// Token counts in [lo, hi]. Uniform, or lo plus an exponentially
/// distributed excess of mean `scale` (before truncation) cut off at hi:
/// the long tail of chat traffic, where most answers are short and a few
/// run long. For batching the difference matters: a static batch runs as
/// long as its longest member, and under a long tail its longest member is
/// several times its mean.
struct LengthDist {
  std::size_t lo = 1;                     ///< shortest length
  std::size_t hi = 1;                     ///< longest length
  LengthShape shape = LengthShape::uniform;  ///< the distribution's shape
  double scale = 0;                       ///< exponential: mean excess over lo before truncation; 0: (hi - lo) / 4

  /// Throws ConfigError (naming `what`) unless lo <= hi and scale >= 0.
  void validate(const std::string& what) const {
    WEFT_REQUIRE(lo <= hi, ConfigError, what, ": the shortest length ", lo, " exceeds the longest ", hi);
    WEFT_REQUIRE(scale >= 0 && std::isfinite(scale), ConfigError, what, ": the exponential scale ", scale,
                 " must be a finite number >= 0");
  }

  /// The exponential's scale in use: `scale`, or (hi - lo) / 4 when it is 0.
  double effective_scale() const { return scale > 0 ? scale : std::max(double(hi - lo) / 4.0, 1e-9); }

  /// The length for a uniform 64-bit draw. Uniform: lo + bits mod (hi - lo
  /// + 1). Exponential: the inverse of the truncated distribution function
  /// at u = the draw's top 53 bits, in (0, 1), floored to a whole token.
  std::size_t draw(std::uint64_t bits) const {
    if (hi <= lo) return lo;
    if (shape == LengthShape::uniform) return lo + std::size_t(bits % std::uint64_t(hi - lo + 1));
    const double s = effective_scale(), span = double(hi - lo + 1);
    const double u = (double(bits >> 11) + 0.5) * 0x1p-53;
    const double x = -s * std::log1p(u * std::expm1(-span / s));  // P(X <= x) = u under truncation at span
    return lo + std::min(std::size_t(x), hi - lo);
  }

  /// The mean length, exactly (a sum over [lo, hi]).
  double mean() const {
    if (hi <= lo) return double(lo);
    if (shape == LengthShape::uniform) return (double(lo) + double(hi)) / 2.0;
    const double s = effective_scale(), span = double(hi - lo + 1), total = -std::expm1(-span / s);
    double m = 0;
    for (std::size_t j = 0; j <= hi - lo; ++j)  // P(excess = j) = P(j <= X < j + 1) under truncation
      m += double(j) * (std::exp(-double(j) / s) - std::exp(-double(j + 1) / s)) / total;
    return double(lo) + m;
  }

  /// "uniform" or "exponential".
  const char* shape_name() const { return shape == LengthShape::uniform ? "uniform" : "exponential"; }
};

/// The shape named `name` ("uniform" or "exponential"); ConfigError naming `flag` otherwise.
inline LengthShape parse_length_shape(const std::string& flag, const std::string& name) {
  if (name == "uniform") return LengthShape::uniform;
  if (name == "exponential") return LengthShape::exponential;
  detail::throw_error<ConfigError>(flag, " ", name, ": expected uniform or exponential");
}

}  // namespace weft::serve
