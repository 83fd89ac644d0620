// Rotary position embedding applied in place to query or key heads inside a
// fused projection matrix. The angle comes from the global position of each
// row, so a sequence shard rotates its rows exactly as the whole sequence does.
//
// Mixed precision: X may be a bf16 or fp16 view. The angles are computed in
// double and their cosines and sines rounded to the compute type (float for
// 2-byte views, detail::compute_t); each pair is rotated in that type and
// rounded once when stored.
#pragma once

#include <weft/ops/common.hpp>

namespace weft::ops {

/// Where the heads to rotate sit in a [rows, cols] matrix, and how rows map to positions.
struct RotarySpec {
  std::size_t col_begin = 0;  ///< first column of the first head
  std::size_t heads = 1;      ///< number of consecutive heads to rotate
  std::size_t head_dim = 2;   ///< features per head (even)
  std::size_t seq = 1;        ///< rows per sequence: row r has position offset + r % seq
  std::size_t offset = 0;     ///< global position of the first row of each sequence
  double base = 10000.0;      ///< angle of pair i at position p is p * base^(-2i / head_dim)
};

/// Rotates pairs (x_i, x_{i + head_dim/2}) of every head by +angle
/// (forward) or -angle (`inverse`: the backward pass, since a rotation's
/// transpose is its inverse).
template <class XV>
void rotary_apply(const XV& X, const RotarySpec& s, bool inverse = false) {
  WEFT_REQUIRE(s.head_dim % 2 == 0 && s.head_dim > 0, ConfigError, "weft::ops::rotary_apply: head dimension ",
               s.head_dim, " must be even for rotary positions; choose d-model / heads even");
  WEFT_REQUIRE(s.col_begin + s.heads * s.head_dim <= X.extent(1) && s.seq > 0, ShapeError,
               "weft::ops::rotary_apply: heads [", s.col_begin, ", ", s.col_begin + s.heads * s.head_dim,
               ") do not fit in ", X.extent(1), " columns");
  using T = detail::compute_t<XV>;
  using XT = detail::value_t<XV>;
  const std::size_t half = s.head_dim / 2, heads = s.heads, c0 = s.col_begin, hd = s.head_dim, seq = s.seq,
                    off = s.offset;
  const double base = s.base;
  const T sign = inverse ? T(-1) : T(1);
  Kokkos::parallel_for(
      "weft::rotary_apply", detail::range(X, X.extent(0)), KOKKOS_LAMBDA(std::size_t r) {
        const double pos = double(off + r % seq);
        for (std::size_t i = 0; i < half; ++i) {
          const double ang = pos * math::pow(base, -2.0 * double(i) / double(hd));
          const T c = T(math::cos(ang)), sn = sign * T(math::sin(ang));
          for (std::size_t h = 0; h < heads; ++h) {
            const std::size_t a = c0 + h * hd + i, b = a + half;
            const T xa = detail::load<T>(X(r, a)), xb = detail::load<T>(X(r, b));
            X(r, a) = detail::store<XT>(xa * c - xb * sn);
            X(r, b) = detail::store<XT>(xa * sn + xb * c);
          }
        }
      });
}

}  // namespace weft::ops
