// Row softmax of attention scores, optionally causal, numerically stable (the
// row maximum is subtracted before exponentiating), keeping the log-sum-exp
// of each row so a backward pass can rebuild the probabilities from scores.
//
// Mixed precision: scores, probabilities and their gradients may be bf16 or
// fp16; the maximum, the exponentials, their sum, the log-sum-exp and the
// backward's dot product are computed in float (detail::compute_t), and the
// log-sum-exp view is a float view. A 2-byte probability is rounded once,
// from the float exponential times the float reciprocal of the sum.
#pragma once

#include <weft/ops/common.hpp>

namespace weft::ops {

namespace detail {
// One row of softmax_forward: mask, scale, maximum, exponentials, sum and
// normalisation through row pointers and lane-wise reductions, so that every
// loop vectorises; returns the row's log-sum-exp. Free functions, not
// lambdas captured by the kernel: nvcc refuses a closure type in the
// captures of an extended lambda.
//
// T is the compute type. When P holds T, the exponentials are kept in p and
// scaled in place (one exponential per element); a P narrower than T would
// round them twice, so then the exponentials are recomputed in the last pass
// and each p[j] is rounded once.
template <class T, class ST, class PT>
KOKKOS_INLINE_FUNCTION T softmax_row(const ST* s, PT* p, std::size_t n, std::size_t tkk, T scale) {
  const T mx = lane_max<T>(n, [&](std::size_t j) { return T(scale * load<T>(s[j])); });
  if constexpr (stores_exactly_v<PT, T>) {
    const T sum = lane_sum<T>(n, [&](std::size_t j) {
      const T e = math::fast_exp(scale * load<T>(s[j]) - mx);
      p[j] = e;
      return e;
    });
    const T inv = T(1) / sum;
    for (std::size_t j = 0; j < n; ++j) p[j] *= inv;
    for (std::size_t j = n; j < tkk; ++j) p[j] = 0;
    return mx + math::log(sum);
  } else {
    const T sum = lane_sum<T>(n, [&](std::size_t j) { return math::fast_exp(scale * load<T>(s[j]) - mx); });
    const T inv = T(1) / sum;
    // p may be s (in place): element j is read before it is written.
    for (std::size_t j = 0; j < n; ++j) p[j] = store<PT>(math::fast_exp(scale * load<T>(s[j]) - mx) * inv);
    for (std::size_t j = n; j < tkk; ++j) p[j] = store<PT>(T(0));
    return mx + math::log(sum);
  }
}
// One row of softmax_backward: ds = scale * p * (dp - sum_j p dp), zero past n,
// in the compute type T.
template <class T, class PT, class DPT, class DST>
KOKKOS_INLINE_FUNCTION void softmax_backward_row(const PT* __restrict p, const DPT* dp, DST* ds, std::size_t n,
                                                 std::size_t tk, T scale) {
  const T dot = lane_sum<T>(n, [&](std::size_t j) { return T(load<T>(p[j]) * load<T>(dp[j])); });
  for (std::size_t j = 0; j < n; ++j) ds[j] = store<DST>(scale * load<T>(p[j]) * (load<T>(dp[j]) - dot));
  for (std::size_t j = n; j < tk; ++j) ds[j] = store<DST>(T(0));
}
}  // namespace detail

/// P(b, i, j) = exp(scale * S(b, i, j) - lse(b, i)) over the keys j query i
/// may see: all of them, or with `causal` those with j <= i + (Tk - Tq) (so a
/// block of the last Tq queries against Tk keys masks correctly). Masked
/// entries of P are 0. P may alias S. lse is [batch, Tq]. Computed in
/// compute_t<SV, PV> (float for bf16/fp16 scores); lse is stored as its own
/// element type (keep it float).
template <class SV, class PV, class LV>
void softmax_forward(const SV& S, detail::compute_t<SV, PV> scale, bool causal, const PV& P, const LV& lse) {
  const std::size_t nb = S.extent(0), tq = S.extent(1), tk = S.extent(2);
  WEFT_REQUIRE(!causal || tk >= tq, ShapeError, "weft::ops::softmax_forward: causal attention needs at least as many keys (",
               tk, ") as queries (", tq, ")");
  for (unsigned r = 0; r < 3; ++r) detail::require_extent("weft::ops::softmax_forward", "P", P, r, S.extent(r));
  detail::require_extent("weft::ops::softmax_forward", "lse", lse, 0, nb);
  detail::require_extent("weft::ops::softmax_forward", "lse", lse, 1, tq);
  detail::require_contiguous_rows("weft::ops::softmax_forward", "S", S, 2);
  detail::require_contiguous_rows("weft::ops::softmax_forward", "P", P, 2);
  using T = detail::compute_t<SV, PV>;
  using L = detail::value_t<LV>;
  using PT = detail::value_t<PV>;
  const std::size_t shift = tk - tq;
  // Mask, scale, maximum, exponentials, sum and normalisation of a row in one
  // kernel, through row pointers and lane-wise reductions so that every loop
  // vectorises. In place (P = S) the same pointer is used for both, so the
  // compiler needs no run-time overlap check (which would fail and fall back
  // to scalar code).
  const bool in_place = static_cast<const void*>(P.data()) == static_cast<const void*>(S.data()) &&
                        P.stride(0) == S.stride(0) && P.stride(1) == S.stride(1);
  Kokkos::parallel_for(
      "weft::softmax_forward", detail::range(S, nb * tq), KOKKOS_LAMBDA(std::size_t r) {
        const std::size_t b = r / tq, i = r % tq;
        const std::size_t n = causal ? i + shift + 1 : tk;
        PT* p = &P(b, i, 0);
        lse(b, i) = detail::store<L>(in_place ? detail::softmax_row<T>(p, p, n, tk, T(scale))
                                              : detail::softmax_row<T>(&S(b, i, 0), p, n, tk, T(scale)));
      });
}

/// dS = scale * P * (dP - sum_j P dP) row by row: the gradient with respect to
/// the unscaled scores. Masked entries come out 0 because P is 0 there. dS may
/// alias dP. With `causal` (the mask of softmax_forward) only the keys each
/// query sees are read; the others are written 0. Computed in
/// compute_t<PV, DPV, DSV>; dS rounded once.
template <class PV, class DPV, class DSV>
void softmax_backward(const PV& P, const DPV& dP, detail::compute_t<PV, DPV, DSV> scale, const DSV& dS,
                      bool causal = false) {
  const std::size_t nb = P.extent(0), tq = P.extent(1), tk = P.extent(2);
  for (unsigned r = 0; r < 3; ++r) {
    detail::require_extent("weft::ops::softmax_backward", "dP", dP, r, P.extent(r));
    detail::require_extent("weft::ops::softmax_backward", "dS", dS, r, P.extent(r));
  }
  detail::require_contiguous_rows("weft::ops::softmax_backward", "P", P, 2);
  detail::require_contiguous_rows("weft::ops::softmax_backward", "dP", dP, 2);
  detail::require_contiguous_rows("weft::ops::softmax_backward", "dS", dS, 2);
  using T = detail::compute_t<PV, DPV, DSV>;
  using DST = detail::value_t<DSV>;
  const bool in_place = static_cast<const void*>(dS.data()) == static_cast<const void*>(dP.data()) &&
                        dS.stride(0) == dP.stride(0) && dS.stride(1) == dP.stride(1);
  WEFT_REQUIRE(!causal || tk >= tq, ShapeError, "weft::ops::softmax_backward: causal attention needs at least as many keys (",
               tk, ") as queries (", tq, ")");
  const std::size_t shift = tk - tq;
  Kokkos::parallel_for(
      "weft::softmax_backward", detail::range(P, nb * tq), KOKKOS_LAMBDA(std::size_t r) {
        const std::size_t b = r / tq, i = r % tq;
        const std::size_t n = causal ? i + shift + 1 : tk;
        DST* ds = &dS(b, i, 0);
        if (in_place)
          detail::softmax_backward_row<T>(&P(b, i, 0), ds, ds, n, tk, T(scale));
        else
          detail::softmax_backward_row<T>(&P(b, i, 0), &dP(b, i, 0), ds, n, tk, T(scale));
      });
}

}  // namespace weft::ops
