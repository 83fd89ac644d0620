// Softmax cross-entropy of logits against target ids, fused with its backward:
// the gradient overwrites the logits in place, so the [tokens, vocab]
// probabilities -- the largest activation of a small-model step -- are never
// stored beside the logits.
//
// Mixed precision: the logits may be float (what the model hands over) or
// bf16/fp16; each row's maximum, exponentials, sum and log-sum-exp are
// computed in float for those (detail::compute_t), the loss is summed in
// double, and a 2-byte gradient is rounded once from its float value.
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
/// Accumulated in double so the loss of a large batch keeps float precision;
/// each row's terms in compute_t<LV> (float for 2-byte logits).
template <class LV, class IV>
double cross_entropy_forward(const LV& logits, const IV& targets) {
  detail::check_targets("weft::ops::cross_entropy_forward", logits, targets);
  const std::size_t v = logits.extent(1);
  double total = 0;
  Kokkos::parallel_reduce(
      "weft::cross_entropy_forward", detail::range(logits, logits.extent(0)),
      KOKKOS_LAMBDA(std::size_t i, double& acc) {
        using T = detail::compute_t<LV>;
        using detail::load;
        const T mx = detail::lane_max<T>(v, [&](std::size_t j) { return load<T>(logits(i, j)); });
        const T s = detail::lane_sum<T>(v, [&](std::size_t j) { return math::fast_exp(load<T>(logits(i, j)) - mx); });
        acc += double(mx + math::log(s) - load<T>(logits(i, targets(i))));
      },
      total);
  return total;
}

/// Returns the summed loss like cross_entropy_forward and replaces the logits
/// by grad_scale * (softmax(logits) - onehot(targets)): the gradient of
/// grad_scale * loss. Pass 1/tokens as grad_scale for a mean loss. 2-byte
/// logits: computed in float, each gradient element rounded once.
/// With `row_loss` ([rows] doubles, or empty for none), also stores each
/// row's loss there.
template <class LV, class IV, class RV>
double cross_entropy_forward_backward(const LV& logits, const IV& targets, detail::compute_t<LV> grad_scale,
                                      const RV& row_loss) {
  detail::check_targets("weft::ops::cross_entropy_forward_backward", logits, targets);
  detail::require_contiguous_rows("weft::ops::cross_entropy_forward_backward", "logits", logits, 1);
  WEFT_REQUIRE(row_loss.extent(0) == 0 || row_loss.extent(0) == logits.extent(0), ShapeError,
               "weft::ops::cross_entropy_forward_backward: row_loss has ", row_loss.extent(0), " entries for ",
               logits.extent(0), " rows");
  const std::size_t v = logits.extent(1);
  const bool rows = row_loss.extent(0) > 0;
  double total = 0;
  Kokkos::parallel_reduce(
      "weft::cross_entropy_forward_backward", detail::range(logits, logits.extent(0)),
      KOKKOS_LAMBDA(std::size_t i, double& acc) {
        // Three passes over a row that stays in cache: the maximum (read
        // only), the exponentials kept in place with their sum, and the
        // scaling; each is a vectorised loop over the row pointer.
        using T = detail::compute_t<LV>;
        using Z = detail::value_t<LV>;
        using detail::load;
        Z* z = &logits(i, 0);
        const T mx = detail::lane_max<T>(v, [&](std::size_t j) { return load<T>(z[j]); });
        const int t = targets(i);
        const T zt = load<T>(z[t]);
        // Read outside the constexpr-if: nvcc's extended lambdas may not
        // capture a variable for the first time inside one.
        const T gs = grad_scale;
        double li = 0;  // the row's loss
        if constexpr (detail::stores_exactly_v<Z, T>) {
          const T s = detail::lane_sum<T>(v, [&](std::size_t j) {
            const T e = math::fast_exp(z[j] - mx);
            z[j] = e;  // keep exp for the gradient: no exponential recomputed
            return e;
          });
          li = double(mx + math::log(s) - zt);
          const T f = gs / s;
          for (std::size_t j = 0; j < v; ++j) z[j] *= f;
          z[t] -= gs;
        } else {
          // A 2-byte row would round a kept exponential twice: recompute it
          // and round each gradient element once.
          const T s = detail::lane_sum<T>(v, [&](std::size_t j) { return math::fast_exp(load<T>(z[j]) - mx); });
          li = double(mx + math::log(s) - zt);
          const T f = gs / s;
          for (std::size_t j = 0; j < v; ++j) {
            const T g = math::fast_exp(load<T>(z[j]) - mx) * f;
            z[j] = detail::store<Z>(int(j) == t ? g - gs : g);
          }
        }
        acc += li;
        if (rows) row_loss(i) = li;
      },
      total);
  return total;
}

/// Without per-row losses.
template <class LV, class IV>
double cross_entropy_forward_backward(const LV& logits, const IV& targets, detail::compute_t<LV> grad_scale) {
  return cross_entropy_forward_backward(logits, targets, grad_scale,
                                        Kokkos::View<double*, typename LV::memory_space>());
}

// ------------------------------------------- vocabulary-parallel cross-entropy
//
// The logits' columns [first, first + logits.extent(1)) of a vocabulary of V
// lie on this rank. The loss needs, per row, the maximum over all columns, the
// sum of exp(z - max) over all columns and the target's logit: each rank
// computes its part (vocab_parallel_max, vocab_parallel_sums), the caller
// reduces them over the ranks (max; sum), and vocab_parallel_finish turns them
// into the loss and this rank's columns of the gradient. The full logits are
// never gathered.

/// m(i) = max over this rank's columns of logits(i, :).
template <class LV, class MV>
void vocab_parallel_max(const LV& logits, const MV& m) {
  detail::require_extent("weft::ops::vocab_parallel_max", "m", m, 0, logits.extent(0));
  const std::size_t v = logits.extent(1);
  using T = detail::compute_t<LV>;
  using M = detail::value_t<MV>;
  Kokkos::parallel_for(
      "weft::vocab_parallel_max", detail::range(logits, logits.extent(0)), KOKKOS_LAMBDA(std::size_t i) {
        T mx = detail::load<T>(logits(i, 0));
        for (std::size_t j = 1; j < v; ++j) {
          const T z = detail::load<T>(logits(i, j));
          mx = z > mx ? z : mx;
        }
        m(i) = detail::store<M>(mx);
      });
}

/// st(i, 0) = sum over this rank's columns of exp(logits(i, j) - m(i));
/// st(i, 1) = the target's logit if this rank holds it, else 0. Targets
/// outside [0, vocab) are a ConfigError.
template <class LV, class IV, class MV, class SV>
void vocab_parallel_sums(const LV& logits, const IV& targets, std::size_t first, std::size_t vocab, const MV& m,
                         const SV& st) {
  detail::require_extent("weft::ops::vocab_parallel_sums", "targets", targets, 0, logits.extent(0));
  detail::require_extent("weft::ops::vocab_parallel_sums", "st", st, 1, 2);
  const int vv = static_cast<int>(vocab);
  long bad = -1;
  Kokkos::parallel_reduce(
      "weft::vocab_parallel_check", detail::range(targets, targets.extent(0)),
      KOKKOS_LAMBDA(std::size_t i, long& f) {
        if ((targets(i) < 0 || targets(i) >= vv) && (f < 0 || long(i) < f)) f = long(i);
      },
      Kokkos::Max<long>(bad));
  WEFT_REQUIRE(bad < 0, ConfigError, "weft::ops::vocab_parallel_sums: target id at row ", bad,
               " is outside the vocabulary [0, ", vocab, "); raise --vocab or check the data's tokenizer");
  const std::size_t v = logits.extent(1);
  Kokkos::parallel_for(
      "weft::vocab_parallel_sums", detail::range(logits, logits.extent(0)), KOKKOS_LAMBDA(std::size_t i) {
        using T = detail::compute_t<LV>;
        using S = detail::value_t<SV>;
        using detail::load;
        const T mx = load<T>(m(i));
        T s = 0;
        for (std::size_t j = 0; j < v; ++j) s += math::fast_exp(load<T>(logits(i, j)) - mx);
        const long t = long(targets(i)) - long(first);
        st(i, 0) = detail::store<S>(s);
        st(i, 1) = detail::store<S>(t >= 0 && t < long(v) ? load<T>(logits(i, std::size_t(t))) : T(0));
      });
}

/// From the reduced m (row maxima) and st (sums of exp, target logits):
/// returns the summed loss over the rows, and with `backward` replaces this
/// rank's logits by grad_scale * (softmax - onehot(targets)) on its columns.
template <class LV, class IV, class MV, class SV>
double vocab_parallel_finish(const LV& logits, const IV& targets, std::size_t first, const MV& m, const SV& st,
                             detail::compute_t<LV> grad_scale, bool backward) {
  const std::size_t v = logits.extent(1);
  double total = 0;
  Kokkos::parallel_reduce(
      "weft::vocab_parallel_finish", detail::range(logits, logits.extent(0)),
      KOKKOS_LAMBDA(std::size_t i, double& acc) {
        using T = detail::compute_t<LV>;
        using Z = detail::value_t<LV>;
        using detail::load;
        const T mx = load<T>(m(i)), s = load<T>(st(i, 0));
        acc += double(mx + math::log(s) - load<T>(st(i, 1)));
        if (!backward) return;
        const T f = grad_scale / s;
        const long t = long(targets(i)) - long(first);
        // Captured outside the constexpr-if (nvcc's extended-lambda rule).
        const std::size_t nv = v;
        const auto& lg = logits;
        if constexpr (detail::stores_exactly_v<Z, T>) {
          for (std::size_t j = 0; j < nv; ++j) lg(i, j) = math::fast_exp(lg(i, j) - mx) * f;
          if (t >= 0 && t < long(nv)) lg(i, std::size_t(t)) -= grad_scale;
        } else {  // 2-byte logits: each gradient element rounded once
          for (std::size_t j = 0; j < nv; ++j) {
            const T g = math::fast_exp(load<T>(lg(i, j)) - mx) * f;
            lg(i, j) = detail::store<Z>(long(j) == t ? g - grad_scale : g);
          }
        }
      },
      total);
  return total;
}

}  // namespace weft::ops
