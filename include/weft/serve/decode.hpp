// The kernels of an inference pass over a block KV cache that are not
// training kernels: rotary positions at each token's own position, the
// store of a pass's keys and values into their cache slots, and causal
// attention of each token over its sequence's cached keys and values.
// serve::ModelRunner calls them; they are free functions over views so that
// every element type goes through them the same way.
//
// Mixed precision: the fused qkv rows, the cache pools and the heads' output
// may each be float, bf16 or fp16 views. The kernels compute in
// ops::detail::compute_t of their views (float for 2-byte types, float and
// double unchanged): cache and query elements are widened when read, every
// dot product, running maximum and sum and the output accumulation stay in
// that type, and each stored element (a rotated feature, a cached key or
// value, an output feature) is rounded once.
#pragma once

#include <cmath>
#include <cstddef>

#include <weft/core/error.hpp>
#include <weft/ops/common.hpp>
#include <weft/ops/flash_attention.hpp>

namespace weft::serve {

/// Where the tokens of one pass sit: token r is at position positions(r)
/// of sequence seqs(r), whose blocks (in position order) are the row
/// tables(seqs(r), :). Device views, as the kernels read them.
template <class Space>
struct DecodeTokens {
  ops::Tokens<Space> positions;                            ///< each token's position in its sequence
  ops::Tokens<Space> seqs;                                 ///< each token's row of `tables`
  Kokkos::View<int**, Kokkos::LayoutRight, Space> tables;  ///< per sequence: its KV blocks
  std::size_t count = 0;                                   ///< tokens of the pass (rows of qkv used)
};

/// The heads of a fused qkv row: q_heads query heads in columns
/// [0, q_heads head_dim), then kv_heads key heads from column key_col and
/// kv_heads value heads after them. Query head h reads key/value head
/// h / (q_heads / kv_heads).
struct DecodeHeads {
  std::size_t head_dim = 0, q_heads = 0, kv_heads = 0, key_col = 0;
};

/// Query heads one work item of decode_attention takes on a host execution
/// space: all of a token's heads, up to this many, so that each cached
/// position's keys (and values) of those heads are read as one contiguous
/// run of the block, position after position. On a device one head per
/// work item, where parallelism is worth more than that locality.
inline constexpr std::size_t decode_host_heads = 16;
/// Positions scored together before one softmax rescale.
inline constexpr std::size_t decode_tile = 16;

/// Rotary positions of the query and key heads of each token at its own
/// position: pair (i, i + hd/2) of a head turned by position x
/// base^(-2i / hd) -- the formula of ops::rotary_apply, evaluated
/// identically (the angle in double, its cosine and sine in the compute type).
template <class QV, class Space>
void decode_rotary(const QV& qkv, const DecodeTokens<Space>& tok, const DecodeHeads& hs, double base) {
  using T = ops::detail::compute_t<QV>;
  using Q = ops::detail::value_t<QV>;
  const std::size_t hd = hs.head_dim, half = hd / 2, Hq = hs.q_heads, Hk = hs.kv_heads, kc = hs.key_col;
  const auto pv = tok.positions;
  Kokkos::parallel_for(
      "weft::serve::rotary", Kokkos::RangePolicy<typename Space::execution_space>(0, tok.count),
      KOKKOS_LAMBDA(std::size_t r) {
        const double pos = double(pv(r));
        for (std::size_t i = 0; i < half; ++i) {
          const double ang = pos * ops::math::pow(base, -2.0 * double(i) / double(hd));
          const T c = T(ops::math::cos(ang)), sn = T(ops::math::sin(ang));
          for (std::size_t h = 0; h < Hq + Hk; ++h) {
            const std::size_t a = (h < Hq ? h * hd : kc + (h - Hq) * hd) + i, bb = a + half;
            const T xa = ops::detail::load<T>(qkv(r, a)), xb = ops::detail::load<T>(qkv(r, bb));
            qkv(r, a) = ops::detail::store<Q>(xa * c - xb * sn);
            qkv(r, bb) = ops::detail::store<Q>(xa * sn + xb * c);
          }
        }
      });
}

/// Writes each token's keys and values into its slot of `layer` in the
/// pools K and V ([layers, blocks, block_size, kv_heads x head_dim]),
/// converted to the pools' element type.
template <class QV, class Space, class PV>
void decode_store_kv(const QV& qkv, const DecodeTokens<Space>& tok, const DecodeHeads& hs, const PV& K, const PV& V,
                     std::size_t layer) {
  using C = ops::detail::value_t<PV>;
  const std::size_t W = hs.kv_heads * hs.head_dim, kc = hs.key_col, bs = K.extent(2);
  const auto pv = tok.positions, sv = tok.seqs;
  const auto bt = tok.tables;
  Kokkos::parallel_for(
      "weft::serve::store_kv", Kokkos::RangePolicy<typename Space::execution_space>(0, tok.count * W),
      KOKKOS_LAMBDA(std::size_t i) {
        const std::size_t r = i / W, c = i % W, p = std::size_t(pv(r));
        const std::size_t blk = std::size_t(bt(std::size_t(sv(r)), p / bs));
        K(layer, blk, p % bs, c) = ops::detail::store<C>(qkv(r, kc + c));
        V(layer, blk, p % bs, c) = ops::detail::store<C>(qkv(r, kc + W + c));
      });
}

/// Causal attention of each token's query heads over its sequence's cached
/// keys and values of `layer`, positions 0..its own (written by
/// decode_store_kv first), into out(r, h hd + d), in one pass with a running
/// maximum per head (no [tokens, context] scores are stored): positions in
/// tiles of decode_tile, each tile's scores first, then one rescale per
/// head, then the tile's values. Grouped-query heads share a key/value head.
/// When out holds the compute type, the running output is kept in out;
/// otherwise in a local row of the compute type (head_dim <= 256), and out
/// gets each element rounded once.
template <class QV, class Space, class PV, class OV>
void decode_attention(const QV& qkv, const DecodeTokens<Space>& tok, const DecodeHeads& hs, const PV& K, const PV& V,
                      std::size_t layer, const OV& out) {
  using Exec = typename Space::execution_space;
  using T = ops::detail::compute_t<QV, PV, OV>;
  using O = ops::detail::value_t<OV>;
  using QE = const ops::detail::value_t<QV>;
  using CE = const ops::detail::value_t<PV>;
  constexpr bool in_out = ops::detail::stores_exactly_v<O, T>;
  constexpr std::size_t HG = Kokkos::SpaceAccessibility<Exec, Kokkos::HostSpace>::accessible ? decode_host_heads : 1;
  constexpr std::size_t TL = decode_tile;
  constexpr std::size_t MAXD = ops::detail::flash_max_head_dim;
  const std::size_t hd = hs.head_dim, Hq = hs.q_heads, group = hs.q_heads / hs.kv_heads, bs = K.extent(2);
  WEFT_REQUIRE(in_out || hd <= MAXD, ShapeError, "weft::serve::decode_attention: head_dim ", hd,
               " exceeds ", MAXD, " for an output narrower than the compute type");
  const std::size_t G = (Hq + HG - 1) / HG;  // work items per token
  const T scale = T(1) / std::sqrt(T(hd));
  const auto pv = tok.positions, sv = tok.seqs;
  const auto bt = tok.tables;
  Kokkos::parallel_for(
      "weft::serve::attention", Kokkos::RangePolicy<Exec>(0, tok.count * G), KOKKOS_LAMBDA(std::size_t i) {
        const std::size_t r = i / G, h0 = (i % G) * HG, nh = Hq - h0 < HG ? Hq - h0 : HG;
        const std::size_t p = std::size_t(pv(r)), s = std::size_t(sv(r));
        // Rows are contiguous (LayoutRight): a head's query and output, and
        // a cached position's keys or values of every key/value head, are
        // consecutive elements. o points at head h0's output features.
        QE* q = &qkv(r, 0);
        [[maybe_unused]] T obuf[ops::detail::stores_exactly_v<O, T> ? 1 : HG * MAXD];
        // out and hd are captured outside the constexpr-ifs, whose conditions
        // name the trait rather than the local in_out (nvcc's extended lambdas
        // may not capture a variable for the first time inside one).
        [[maybe_unused]] const auto& outv = out;
        const std::size_t hdim = hd;
        T* o;
        if constexpr (ops::detail::stores_exactly_v<O, T>)
          o = &outv(r, h0 * hdim);
        else
          o = obuf;
        T mx[HG], sum[HG], e[TL][HG];
        for (std::size_t hh = 0; hh < nh; ++hh) {
          sum[hh] = 0;
          mx[hh] = 0;
          for (std::size_t d = 0; d < hd; ++d) o[hh * hd + d] = 0;
        }
        for (std::size_t j0 = 0; j0 <= p; j0 += TL) {
          const std::size_t n = p + 1 - j0 < TL ? p + 1 - j0 : TL;
          for (std::size_t t = 0; t < n; ++t) {  // the tile's scores
            const std::size_t j = j0 + t;
            CE* kr = &K(layer, std::size_t(bt(s, j / bs)), j % bs, 0);
            for (std::size_t hh = 0; hh < nh; ++hh) {
              QE* qh = q + (h0 + hh) * hd;
              CE* k = kr + ((h0 + hh) / group) * hd;
              // Interleaved partial sums: the dot product vectorises.
              e[t][hh] = ops::detail::lane_sum<T>(
                             hd, [=](std::size_t d) { return ops::detail::load<T>(qh[d]) * ops::detail::load<T>(k[d]); }) *
                         scale;
            }
          }
          for (std::size_t hh = 0; hh < nh; ++hh) {  // each head's new maximum, one rescale, the weights
            T m = e[0][hh];
            for (std::size_t t = 1; t < n; ++t) m = e[t][hh] > m ? e[t][hh] : m;
            if (j0 == 0) {
              mx[hh] = m;
            } else if (m > mx[hh]) {  // what is summed so far shrinks by exp(old - new maximum)
              const T c = ops::math::fast_exp(mx[hh] - m);
              sum[hh] *= c;
              ops::detail::row_scale(o + hh * hd, c, hd);
              mx[hh] = m;
            }
            for (std::size_t t = 0; t < n; ++t) {
              e[t][hh] = ops::math::fast_exp(e[t][hh] - mx[hh]);
              sum[hh] += e[t][hh];
            }
          }
          for (std::size_t t = 0; t < n; ++t) {  // the tile's values
            const std::size_t j = j0 + t;
            CE* vr = &V(layer, std::size_t(bt(s, j / bs)), j % bs, 0);
            for (std::size_t hh = 0; hh < nh; ++hh)  // o (the heads' output) and v (the cache) do not overlap
              ops::detail::row_axpy(o + hh * hd, vr + ((h0 + hh) / group) * hd, e[t][hh], hd);
          }
        }
        for (std::size_t hh = 0; hh < nh; ++hh) {
          if constexpr (ops::detail::stores_exactly_v<O, T>) {
            ops::detail::row_scale(o + hh * hd, T(1) / sum[hh], hd);
          } else {
            const T inv = T(1) / sum[hh];
            for (std::size_t d = 0; d < hd; ++d) out(r, (h0 + hh) * hd + d) = ops::detail::store<O>(o[hh * hd + d] * inv);
          }
        }
      });
}

}  // namespace weft::serve
