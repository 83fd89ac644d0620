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
  uniform,      ///< every length in [lo, hi] equally likely
  exponential,  ///< lo plus an exponential excess, truncated at hi: most requests short, a few long
  lognormal     ///< lo plus a log-normal excess, truncated at hi: a heavier tail than the exponential's
};

/// Token counts in [lo, hi]. Uniform, or lo plus a random excess cut off at
/// hi (the distribution conditioned on the excess being at most hi - lo):
/// - exponential, of mean `scale` before truncation;
/// - log-normal, of median `scale` and log-space deviation `sigma` before
///   truncation, a common model of the answer lengths of chat traffic:
///   most answers short, a few far longer than the median.
/// For batching the difference matters: a static batch runs as long as its
/// longest member, and under a long tail its longest member is several
/// times its mean.
struct LengthDist {
  std::size_t lo = 1;                     ///< shortest length
  std::size_t hi = 1;                     ///< longest length
  LengthShape shape = LengthShape::uniform;  ///< the distribution's shape
  double scale = 0;    ///< exponential: mean excess over lo; log-normal: median excess (both before truncation); 0: default_scale()
  double sigma = 1.0;  ///< log-normal: standard deviation of the excess' logarithm

  /// Throws ConfigError (naming `what`) unless lo <= hi, scale >= 0 and sigma > 0.
  void validate(const std::string& what) const {
    WEFT_REQUIRE(lo <= hi, ConfigError, what, ": the shortest length ", lo, " exceeds the longest ", hi);
    WEFT_REQUIRE(scale >= 0 && std::isfinite(scale), ConfigError, what, ": the scale ", scale,
                 " must be a finite number >= 0");
    WEFT_REQUIRE(sigma > 0 && std::isfinite(sigma), ConfigError, what, ": the log-normal sigma ", sigma,
                 " must be a finite number > 0");
  }

  /// The scale used when `scale` is 0: a quarter of hi - lo for the
  /// exponential's mean, an eighth for the log-normal's median.
  double default_scale() const { return double(hi - lo) / (shape == LengthShape::lognormal ? 8.0 : 4.0); }

  /// The scale in use: `scale`, or default_scale() when it is 0.
  double effective_scale() const { return scale > 0 ? scale : std::max(default_scale(), 1e-9); }

  /// The length for a uniform 64-bit draw. Uniform: lo + bits mod (hi - lo
  /// + 1). Exponential and log-normal: the excess X is the inverse of the
  /// truncated distribution function at u = the draw's top 53 bits, in
  /// (0, 1), floored to a whole token.
  std::size_t draw(std::uint64_t bits) const {
    if (hi <= lo) return lo;
    if (shape == LengthShape::uniform) return lo + std::size_t(bits % std::uint64_t(hi - lo + 1));
    const double s = effective_scale(), span = double(hi - lo + 1);
    const double u = (double(bits >> 11) + 0.5) * 0x1p-53;
    if (shape == LengthShape::exponential) {
      const double x = -s * std::log1p(u * std::expm1(-span / s));  // P(X <= x) = u under truncation at span
      return lo + std::min(std::size_t(x), hi - lo);
    }
    // Log-normal: floor(X) = j where F(j) <= u F(span) < F(j + 1); F is
    // increasing, so j is found by bisection over the whole tokens.
    const double target = u * cdf(span);
    std::size_t a = 0, b = hi - lo;  // the answer lies in [a, b]
    while (a < b) {
      const std::size_t mid = a + (b - a) / 2;
      if (cdf(double(mid + 1)) > target) b = mid;
      else a = mid + 1;
    }
    return lo + a;
  }

  /// The mean length, exactly (a sum over [lo, hi]).
  double mean() const {
    if (hi <= lo) return double(lo);
    if (shape == LengthShape::uniform) return (double(lo) + double(hi)) / 2.0;
    const double total = cdf(double(hi - lo + 1));
    double m = 0, below = 0;  // below = F(j)
    for (std::size_t j = 0; j <= hi - lo; ++j) {  // P(excess = j) = P(j <= X < j + 1) under truncation
      const double upto = cdf(double(j + 1));
      m += double(j) * (upto - below) / total;
      below = upto;
    }
    return double(lo) + m;
  }

  /// The excess' distribution function before truncation, P(X <= x), for
  /// the exponential and log-normal shapes.
  double cdf(double x) const {
    if (x <= 0) return 0.0;
    const double s = effective_scale();
    if (shape == LengthShape::lognormal) return 0.5 * std::erfc(-std::log(x / s) / (sigma * std::sqrt(2.0)));
    return -std::expm1(-x / s);
  }

  /// "uniform", "exponential" or "lognormal".
  const char* shape_name() const {
    switch (shape) {
      case LengthShape::exponential: return "exponential";
      case LengthShape::lognormal: return "lognormal";
      default: return "uniform";
    }
  }
};

/// The shape named `name` ("uniform", "exponential" or "lognormal");
/// ConfigError naming `flag` otherwise.
inline LengthShape parse_length_shape(const std::string& flag, const std::string& name) {
  if (name == "uniform") return LengthShape::uniform;
  if (name == "exponential") return LengthShape::exponential;
  if (name == "lognormal") return LengthShape::lognormal;
  detail::throw_error<ConfigError>(flag, " ", name, ": expected uniform, exponential or lognormal");
}

}  // namespace weft::serve
