// Row softmax of attention scores, optionally causal, numerically stable (the
// row maximum is subtracted before exponentiating), keeping the log-sum-exp
// of each row so a backward pass can rebuild the probabilities from scores.
#pragma once

#include <weft/ops/common.hpp>

namespace weft::ops {

/// P(b, i, j) = exp(scale * S(b, i, j) - lse(b, i)) over the keys j query i
/// may see: all of them, or with `causal` those with j <= i + (Tk - Tq) (so a
/// block of the last Tq queries against Tk keys masks correctly). Masked
/// entries of P are 0. P may alias S. lse is [batch, Tq].
template <class SV, class PV, class LV>
void softmax_forward(const SV& S, typename PV::const_value_type scale, bool causal, const PV& P, const LV& lse) {
  const std::size_t nb = S.extent(0), tq = S.extent(1), tk = S.extent(2);
  WEFT_REQUIRE(!causal || tk >= tq, ShapeError, "weft::ops::softmax_forward: causal attention needs at least as many keys (",
               tk, ") as queries (", tq, ")");
  for (unsigned r = 0; r < 3; ++r) detail::require_extent("weft::ops::softmax_forward", "P", P, r, S.extent(r));
  detail::require_extent("weft::ops::softmax_forward", "lse", lse, 0, nb);
  detail::require_extent("weft::ops::softmax_forward", "lse", lse, 1, tq);
  using T = typename PV::non_const_value_type;
  const std::size_t shift = tk - tq;
  Kokkos::parallel_for(
      "weft::softmax_forward", detail::range(S, nb * tq), KOKKOS_LAMBDA(std::size_t r) {
        const std::size_t b = r / tq, i = r % tq;
        const std::size_t n = causal ? i + shift + 1 : tk;
        T mx = scale * S(b, i, 0);
        for (std::size_t j = 1; j < n; ++j) mx = scale * S(b, i, j) > mx ? scale * S(b, i, j) : mx;
        T sum = 0;
        for (std::size_t j = 0; j < n; ++j) {
          const T e = math::fast_exp(scale * S(b, i, j) - mx);
          P(b, i, j) = e;
          sum += e;
        }
        const T inv = T(1) / sum;
        for (std::size_t j = 0; j < n; ++j) P(b, i, j) *= inv;
        for (std::size_t j = n; j < tk; ++j) P(b, i, j) = 0;
        lse(b, i) = mx + math::log(sum);
      });
}

/// dS = scale * P * (dP - sum_j P dP) row by row: the gradient with respect to
/// the unscaled scores. Masked entries come out 0 because P is 0 there. dS may
/// alias dP.
template <class PV, class DPV, class DSV>
void softmax_backward(const PV& P, const DPV& dP, typename DSV::const_value_type scale, const DSV& dS) {
  const std::size_t nb = P.extent(0), tq = P.extent(1), tk = P.extent(2);
  for (unsigned r = 0; r < 3; ++r) {
    detail::require_extent("weft::ops::softmax_backward", "dP", dP, r, P.extent(r));
    detail::require_extent("weft::ops::softmax_backward", "dS", dS, r, P.extent(r));
  }
  using T = typename DSV::non_const_value_type;
  Kokkos::parallel_for(
      "weft::softmax_backward", detail::range(P, nb * tq), KOKKOS_LAMBDA(std::size_t r) {
        const std::size_t b = r / tq, i = r % tq;
        T dot = 0;
        for (std::size_t j = 0; j < tk; ++j) dot += P(b, i, j) * dP(b, i, j);
        for (std::size_t j = 0; j < tk; ++j) dS(b, i, j) = scale * P(b, i, j) * (dP(b, i, j) - dot);
      });
}

}  // namespace weft::ops
