// Counter-based random numbers (Philox-4x32-10) and parameter initialisation
// from (seed, parameter name, global element index) alone. Any shard of a
// parameter, on any rank layout, draws exactly the values the single-process
// model has at those global indices.
#pragma once

#include <cstdint>
#include <string_view>

#include <weft/ops/common.hpp>

namespace weft::ops {

/// 64-bit FNV-1a of a name: turns a parameter name into a random stream id.
constexpr std::uint64_t name_hash(std::string_view s) {
  std::uint64_t h = 1469598103934665603ull;
  for (char c : s) {
    h ^= static_cast<unsigned char>(c);
    h *= 1099511628211ull;
  }
  return h;
}

/// Four 32-bit words of Philox-4x32 with 10 rounds (Salmon et al., SC'11) for
/// counter (index, stream) under key seed: a pure function, so any element can
/// be drawn independently of all others.
struct Philox {
  std::uint32_t x[4];
  KOKKOS_INLINE_FUNCTION Philox(std::uint64_t seed, std::uint64_t stream, std::uint64_t index) {
    std::uint32_t c0 = std::uint32_t(index), c1 = std::uint32_t(index >> 32), c2 = std::uint32_t(stream),
                  c3 = std::uint32_t(stream >> 32);
    std::uint32_t k0 = std::uint32_t(seed), k1 = std::uint32_t(seed >> 32);
    for (int r = 0; r < 10; ++r) {
      const std::uint64_t p0 = std::uint64_t(0xD2511F53u) * c0;
      const std::uint64_t p1 = std::uint64_t(0xCD9E8D57u) * c2;
      const std::uint32_t n0 = std::uint32_t(p1 >> 32) ^ c1 ^ k0;
      const std::uint32_t n2 = std::uint32_t(p0 >> 32) ^ c3 ^ k1;
      c1 = std::uint32_t(p1);
      c3 = std::uint32_t(p0);
      c0 = n0;
      c2 = n2;
      k0 += 0x9E3779B9u;
      k1 += 0xBB67AE85u;
    }
    x[0] = c0;
    x[1] = c1;
    x[2] = c2;
    x[3] = c3;
  }
  /// Uniform in (0, 1], from 53 random bits.
  KOKKOS_INLINE_FUNCTION double uniform() const {
    const std::uint64_t bits = (std::uint64_t(x[0]) << 21) ^ std::uint64_t(x[1] >> 11);
    return (double(bits & ((1ull << 53) - 1)) + 1.0) * (1.0 / 9007199254740992.0);
  }
  /// Standard normal by Box-Muller from all four words.
  KOKKOS_INLINE_FUNCTION double normal() const {
    const double u1 = uniform();
    const std::uint64_t b2 = (std::uint64_t(x[2]) << 21) ^ std::uint64_t(x[3] >> 11);
    const double u2 = double(b2 & ((1ull << 53) - 1)) * (1.0 / 9007199254740992.0);
    return math::sqrt(-2.0 * math::log(u1)) * math::cos(6.283185307179586 * u2);
  }
};

/// Where a local block of a parameter sits in the global tensor: element
/// (i, j) of the block is global element (row0 + i) * global_cols + col0 + j.
/// The default is the whole tensor (a single-process layer).
struct GlobalBlock {
  std::size_t row0 = 0, col0 = 0;
  std::size_t global_cols = 0;  ///< 0: the block's own column count
};

/// Fills a rank-2 block with N(0, stddev^2) values drawn from (seed, name, global index).
template <class V>
void init_normal(const V& w, std::uint64_t seed, std::string_view name, double stddev, GlobalBlock at = {}) {
  static_assert(V::rank == 2, "init_normal takes a rank-2 block; view vectors as [1, n]");
  const std::uint64_t stream = name_hash(name);
  const std::size_t cols = w.extent(1), gcols = at.global_cols ? at.global_cols : cols, r0 = at.row0, c0 = at.col0;
  WEFT_REQUIRE(c0 + cols <= gcols, ShapeError, "weft::ops::init_normal: columns [", c0, ", ", c0 + cols,
               ") of parameter '", name, "' exceed its global width ", gcols);
  using T = typename V::non_const_value_type;
  Kokkos::parallel_for(
      "weft::init_normal", detail::range(w, w.extent(0)), KOKKOS_LAMBDA(std::size_t i) {
        for (std::size_t j = 0; j < cols; ++j) {
          const std::uint64_t g = std::uint64_t(r0 + i) * gcols + c0 + j;
          w(i, j) = T(stddev * Philox(seed, stream, g).normal());
        }
      });
}

/// Fills a rank-1 view with a constant (norm scales 1, biases 0).
template <class V>
void init_constant(const V& w, typename V::const_value_type value) {
  Kokkos::deep_copy(w, value);
}

}  // namespace weft::ops
