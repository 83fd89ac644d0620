// Softmax cross-entropy of logits against target ids, fused with its backward:
// the gradient overwrites the logits in place, so the [tokens, vocab]
// probabilities -- the largest activation of a small-model step -- are never
// stored beside the logits.
#pragma once

#include <weft/ops/common.hpp>

namespace weft::ops {

namespace detail {
template <class LV, class IV>
void check_targets(const char* op, const LV& logits, const IV& targets) {
  require_extent(op, "targets", targets, 0, logits.extent(0));
  const int vocab = static_cast<int>(logits.extent(1));
  long bad = -1;
  Kokkos::parallel_reduce(
      "weft::cross_entropy_check", range(targets, targets.extent(0)),
      KOKKOS_LAMBDA(std::size_t i, long& first) {
        if ((targets(i) < 0 || targets(i) >= vocab) && (first < 0 || long(i) < first)) first = long(i);
      },
      Kokkos::Max<long>(bad));
  WEFT_REQUIRE(bad < 0, ConfigError, op, ": target id at row ", bad, " is outside the vocabulary [0, ", vocab,
               "); raise --vocab or check the data's tokenizer");
}
}  // namespace detail

/// Sum over rows of -log softmax(logits(i, :))(targets(i)); logits untouched.
/// Accumulated in double so the loss of a large batch keeps float precision.
template <class LV, class IV>
double cross_entropy_forward(const LV& logits, const IV& targets) {
  detail::check_targets("weft::ops::cross_entropy_forward", logits, targets);
  const std::size_t v = logits.extent(1);
  double total = 0;
  Kokkos::parallel_reduce(
      "weft::cross_entropy_forward", detail::range(logits, logits.extent(0)),
      KOKKOS_LAMBDA(std::size_t i, double& acc) {
        using T = typename LV::non_const_value_type;
        T mx = logits(i, 0);
        for (std::size_t j = 1; j < v; ++j) mx = logits(i, j) > mx ? logits(i, j) : mx;
        T s = 0;
        for (std::size_t j = 0; j < v; ++j) s += math::fast_exp(logits(i, j) - mx);
        acc += double(mx + math::log(s) - logits(i, targets(i)));
      },
      total);
  return total;
}

/// Returns the summed loss like cross_entropy_forward and replaces the logits
/// by grad_scale * (softmax(logits) - onehot(targets)): the gradient of
/// grad_scale * loss. Pass 1/tokens as grad_scale for a mean loss.
template <class LV, class IV>
double cross_entropy_forward_backward(const LV& logits, const IV& targets,
                                      typename LV::const_value_type grad_scale) {
  detail::check_targets("weft::ops::cross_entropy_forward_backward", logits, targets);
  const std::size_t v = logits.extent(1);
  double total = 0;
  Kokkos::parallel_reduce(
      "weft::cross_entropy_forward_backward", detail::range(logits, logits.extent(0)),
      KOKKOS_LAMBDA(std::size_t i, double& acc) {
        using T = typename LV::non_const_value_type;
        T mx = logits(i, 0);
        for (std::size_t j = 1; j < v; ++j) mx = logits(i, j) > mx ? logits(i, j) : mx;
        const int t = targets(i);
        const T zt = logits(i, t);
        T s = 0;
        for (std::size_t j = 0; j < v; ++j) {
          const T e = math::fast_exp(logits(i, j) - mx);
          logits(i, j) = e;  // keep exp for the gradient: one pass fewer
          s += e;
        }
        acc += double(mx + math::log(s) - zt);
        const T f = grad_scale / s;
        for (std::size_t j = 0; j < v; ++j) logits(i, j) *= f;
        logits(i, t) -= grad_scale;
      },
      total);
  return total;
}

}  // namespace weft::ops
