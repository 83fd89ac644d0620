// Embedding lookup (token and learned position tables) and its backward, a
// scatter-add into the table. The scatter runs one thread per chunk of feature
// columns over the tokens in order, so repeated tokens add up in a fixed order without
// atomics: the gradient is bit-identical whatever the thread count.
//
// Mixed precision: tables, activations and gradients may each be float,
// bf16 or fp16. A lookup converts the table's element to the activation's
// type (rounded once; an add in float first with `accumulate`); a scatter
// adds into the gradient view in its accumulation type, so a float
// gradient table under bf16 activations accumulates exactly as in fp32 (a
// 2-byte gradient table would round at every add: keep gradients float).
#pragma once

#include <weft/ops/common.hpp>

namespace weft::ops {

/// y(n, :) = W(ids(n), :), or += with `accumulate`. Ids are checked on the
/// device; an id outside [0, vocab) is a ConfigError naming the first one.
template <class WV, class IV, class YV>
void embedding_forward(const WV& W, const IV& ids, const YV& y, bool accumulate = false) {
  const std::size_t n = ids.extent(0), d = W.extent(1);
  const int vocab = static_cast<int>(W.extent(0));
  detail::require_extent("weft::ops::embedding_forward", "y", y, 0, n);
  detail::require_extent("weft::ops::embedding_forward", "y", y, 1, d);
  long bad = -1;
  Kokkos::parallel_reduce(
      "weft::embedding_check", detail::range(ids, n),
      KOKKOS_LAMBDA(std::size_t i, long& first) {
        if ((ids(i) < 0 || ids(i) >= vocab) && (first < 0 || long(i) < first)) first = long(i);
      },
      Kokkos::Max<long>(bad));
  if (bad >= 0) {
    auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), Kokkos::subview(ids, std::make_pair(bad, bad + 1)));
    ::weft::detail::throw_error<ConfigError>("weft::ops::embedding_forward: token id ", h(0), " at position ", bad,
                                     " is outside the vocabulary [0, ", vocab,
                                     "); raise --vocab or check the data's tokenizer");
  }
  using T = detail::compute_t<WV, YV>;
  using Y = detail::value_t<YV>;
  Kokkos::parallel_for(
      "weft::embedding_forward", detail::range(y, n), KOKKOS_LAMBDA(std::size_t i) {
        const int t = ids(i);
        for (std::size_t j = 0; j < d; ++j)
          y(i, j) = detail::store<Y>(accumulate ? detail::load<T>(y(i, j)) + detail::load<T>(W(t, j))
                                                : detail::load<T>(W(t, j)));
      });
}

/// dW(ids(n), :) += dy(n, :) for every n (accumulates into dW).
template <class DYV, class IV, class DWV>
void embedding_backward(const DYV& dy, const IV& ids, const DWV& dW) {
  const std::size_t n = ids.extent(0);
  detail::require_extent("weft::ops::embedding_backward", "dy", dy, 0, n);
  detail::require_extent("weft::ops::embedding_backward", "dy", dy, 1, dW.extent(1));
  const std::size_t d = dW.extent(1), C = detail::column_chunk;
  using T = detail::compute_t<DYV, DWV>;
  using G = detail::value_t<DWV>;
  Kokkos::parallel_for(
      "weft::embedding_backward", detail::range(dW, (d + C - 1) / C), KOKKOS_LAMBDA(std::size_t c) {
        const std::size_t j0 = c * C, w = d - j0 < C ? d - j0 : C;
        for (std::size_t i = 0; i < n; ++i)
          for (std::size_t jj = 0; jj < w; ++jj)
            dW(ids(i), j0 + jj) = detail::store<G>(detail::load<T>(dW(ids(i), j0 + jj)) + detail::load<T>(dy(i, j0 + jj)));
      });
}

/// y(b*T + t, :) (+)= P(offset + t, :) for rows grouped in sequences of length
/// T: learned absolute positions. `offset` is the global position of the first
/// row of each sequence, so a sequence shard reads its own positions.
template <class PV, class YV>
void position_forward(const PV& P, std::size_t seq, std::size_t offset, const YV& y, bool accumulate = true) {
  const std::size_t rows = y.extent(0), d = y.extent(1);
  WEFT_REQUIRE(seq > 0 && rows % seq == 0, ShapeError, "weft::ops::position_forward: ", rows,
               " rows are not whole sequences of length ", seq);
  WEFT_REQUIRE(offset + seq <= P.extent(0), ConfigError, "weft::ops::position_forward: positions up to ", offset + seq,
               " need a table of at least that many rows, the table has ", P.extent(0), "; raise --seq");
  detail::require_extent("weft::ops::position_forward", "position table", P, 1, d);
  using T = detail::compute_t<PV, YV>;
  using Y = detail::value_t<YV>;
  Kokkos::parallel_for(
      "weft::position_forward", detail::range(y, rows), KOKKOS_LAMBDA(std::size_t i) {
        const std::size_t t = offset + i % seq;
        for (std::size_t j = 0; j < d; ++j)
          y(i, j) = detail::store<Y>(accumulate ? detail::load<T>(y(i, j)) + detail::load<T>(P(t, j))
                                                : detail::load<T>(P(t, j)));
      });
}

/// dP(offset + t, :) += sum over sequences b of dy(b*T + t, :).
template <class DYV, class DPV>
void position_backward(const DYV& dy, std::size_t seq, std::size_t offset, const DPV& dP) {
  const std::size_t rows = dy.extent(0), d = dy.extent(1);
  WEFT_REQUIRE(seq > 0 && rows % seq == 0 && offset + seq <= dP.extent(0), ShapeError,
               "weft::ops::position_backward: ", rows, " rows of sequences of length ", seq, " at offset ", offset,
               " do not fit a table of ", dP.extent(0), " rows");
  const std::size_t nseq = rows / seq;
  using T = detail::compute_t<DYV, DPV>;
  using G = detail::value_t<DPV>;
  Kokkos::parallel_for(
      "weft::position_backward", detail::range(dy, seq), KOKKOS_LAMBDA(std::size_t t) {
        for (std::size_t b = 0; b < nseq; ++b)
          for (std::size_t j = 0; j < d; ++j)
            dP(offset + t, j) = detail::store<G>(detail::load<T>(dP(offset + t, j)) + detail::load<T>(dy(b * seq + t, j)));
      });
}

// ------------------------------------------------ vocabulary-parallel forms

/// Vocabulary-parallel lookup: W holds rows [first, first + W.extent(0)) of a
/// table of `vocab` rows. y(n, :) = W(ids(n) - first, :) for ids in that
/// range and 0 for the others, so the sum over the ranks holding all rows is
/// the whole lookup. An id outside [0, vocab) is a ConfigError.
template <class WV, class IV, class YV>
void vocab_embedding_forward(const WV& W, const IV& ids, std::size_t first, std::size_t vocab, const YV& y) {
  const std::size_t n = ids.extent(0), d = W.extent(1), rows = W.extent(0);
  detail::require_extent("weft::ops::vocab_embedding_forward", "y", y, 0, n);
  detail::require_extent("weft::ops::vocab_embedding_forward", "y", y, 1, d);
  const int v = static_cast<int>(vocab);
  long bad = -1;
  Kokkos::parallel_reduce(
      "weft::vocab_embedding_check", detail::range(ids, n),
      KOKKOS_LAMBDA(std::size_t i, long& first_bad) {
        if ((ids(i) < 0 || ids(i) >= v) && (first_bad < 0 || long(i) < first_bad)) first_bad = long(i);
      },
      Kokkos::Max<long>(bad));
  WEFT_REQUIRE(bad < 0, ConfigError, "weft::ops::vocab_embedding_forward: the token id at position ", bad,
               " is outside the vocabulary [0, ", vocab, "); raise --vocab or check the data's tokenizer");
  using Y = detail::value_t<YV>;
  Kokkos::parallel_for(
      "weft::vocab_embedding_forward", detail::range(y, n), KOKKOS_LAMBDA(std::size_t i) {
        const long t = long(ids(i)) - long(first);
        const bool mine = t >= 0 && t < long(rows);
        for (std::size_t j = 0; j < d; ++j) y(i, j) = mine ? detail::store<Y>(W(std::size_t(t), j)) : detail::store<Y>(0.0f);
      });
}

/// dW(ids(n) - first, :) += dy(n, :) for the ids this rank's rows hold.
template <class DYV, class IV, class DWV>
void vocab_embedding_backward(const DYV& dy, const IV& ids, std::size_t first, const DWV& dW) {
  const std::size_t n = ids.extent(0), rows = dW.extent(0);
  detail::require_extent("weft::ops::vocab_embedding_backward", "dy", dy, 0, n);
  detail::require_extent("weft::ops::vocab_embedding_backward", "dy", dy, 1, dW.extent(1));
  const std::size_t d = dW.extent(1), C = detail::column_chunk;
  using T = detail::compute_t<DYV, DWV>;
  using G = detail::value_t<DWV>;
  Kokkos::parallel_for(
      "weft::vocab_embedding_backward", detail::range(dW, (d + C - 1) / C), KOKKOS_LAMBDA(std::size_t c) {
        const std::size_t j0 = c * C, w = d - j0 < C ? d - j0 : C;
        for (std::size_t i = 0; i < n; ++i) {
          const long t = long(ids(i)) - long(first);
          if (t < 0 || t >= long(rows)) continue;
          for (std::size_t jj = 0; jj < w; ++jj)
            dW(std::size_t(t), j0 + jj) =
                detail::store<G>(detail::load<T>(dW(std::size_t(t), j0 + jj)) + detail::load<T>(dy(i, j0 + jj)));
        }
      });
}

/// y(i, :) += P((row0 + i) % seq, :): learned positions for a block of token
/// rows that starts at global row row0 of sequences of length seq (a
/// sequence-parallel shard need not start or end at a sequence boundary).
template <class PV, class YV>
void position_forward_rows(const PV& P, std::size_t seq, std::size_t row0, const YV& y) {
  const std::size_t rows = y.extent(0), d = y.extent(1);
  WEFT_REQUIRE(seq > 0 && seq <= P.extent(0), ConfigError, "weft::ops::position_forward_rows: sequences of ", seq,
               " tokens need a table of at least that many rows, the table has ", P.extent(0));
  detail::require_extent("weft::ops::position_forward_rows", "position table", P, 1, d);
  using T = detail::compute_t<PV, YV>;
  using Y = detail::value_t<YV>;
  Kokkos::parallel_for(
      "weft::position_forward_rows", detail::range(y, rows), KOKKOS_LAMBDA(std::size_t i) {
        const std::size_t t = (row0 + i) % seq;
        for (std::size_t j = 0; j < d; ++j) y(i, j) = detail::store<Y>(detail::load<T>(y(i, j)) + detail::load<T>(P(t, j)));
      });
}

/// dP((row0 + i) % seq, :) += dy(i, :) over the rows of the block, in row
/// order per column chunk (deterministic, no atomics).
template <class DYV, class DPV>
void position_backward_rows(const DYV& dy, std::size_t seq, std::size_t row0, const DPV& dP) {
  const std::size_t rows = dy.extent(0), d = dy.extent(1), C = detail::column_chunk;
  WEFT_REQUIRE(seq > 0 && seq <= dP.extent(0) && dP.extent(1) == d, ShapeError,
               "weft::ops::position_backward_rows: rows of sequences of length ", seq, " do not fit a table of ",
               dP.extent(0), " x ", dP.extent(1));
  using T = detail::compute_t<DYV, DPV>;
  using G = detail::value_t<DPV>;
  Kokkos::parallel_for(
      "weft::position_backward_rows", detail::range(dy, (d + C - 1) / C), KOKKOS_LAMBDA(std::size_t c) {
        const std::size_t j0 = c * C, w = d - j0 < C ? d - j0 : C;
        for (std::size_t i = 0; i < rows; ++i) {
          const std::size_t t = (row0 + i) % seq;
          for (std::size_t jj = 0; jj < w; ++jj)
            dP(t, j0 + jj) = detail::store<G>(detail::load<T>(dP(t, j0 + jj)) + detail::load<T>(dy(i, j0 + jj)));
        }
      });
}

/// The global position of row i of a block of token rows of a
/// context-parallel rank: the block starts at local row row0 of sequences of
/// local_seq = seq / cp tokens, laid out as weft::context::global_index says
/// (rank r holds chunks r and 2·cp−1−r of 2·cp; the formula is repeated here
/// so that it runs inside a kernel on any backend).
struct BalancedPositions {
  std::size_t row0 = 0, local_seq = 1, seq = 1, cp = 1, rank = 0;
  KOKKOS_INLINE_FUNCTION std::size_t operator()(std::size_t i) const {
    const std::size_t t = (row0 + i) % local_seq, c = seq / (2 * cp);
    return t < c ? rank * c + t : (2 * cp - 1 - rank) * c + (t - c);
  }
};

/// out(i) = full((i / local_seq) * seq + at(i)): a context-parallel rank's
/// tokens of every sequence of a [batch * seq] token array (the balanced
/// layout of `at`; out holds batch * at.local_seq tokens).
template <class FV, class OV>
void select_balanced(const FV& full, const BalancedPositions& at, const OV& out) {
  const std::size_t tl = at.local_seq, seq = at.seq;
  Kokkos::parallel_for(
      "weft::select_balanced", Kokkos::RangePolicy<typename OV::execution_space>(0, out.extent(0)),
      KOKKOS_LAMBDA(std::size_t i) { out(i) = full((i / tl) * seq + at(i)); });
}

/// y(i, :) += P(at(i), :): learned positions of a context-parallel rank's rows.
template <class PV, class YV>
void position_forward_balanced(const PV& P, const BalancedPositions& at, const YV& y) {
  const std::size_t rows = y.extent(0), d = y.extent(1);
  WEFT_REQUIRE(at.seq <= P.extent(0) && at.cp > 0 && at.seq % (2 * at.cp) == 0 && at.local_seq * at.cp == at.seq,
               ConfigError, "weft::ops::position_forward_balanced: sequences of ", at.seq, " tokens over cp = ", at.cp,
               " need a table of at least ", at.seq, " rows (it has ", P.extent(0), ") and a multiple of 2·cp tokens");
  detail::require_extent("weft::ops::position_forward_balanced", "position table", P, 1, d);
  using T = detail::compute_t<PV, YV>;
  using Y = detail::value_t<YV>;
  Kokkos::parallel_for(
      "weft::position_forward_balanced", detail::range(y, rows), KOKKOS_LAMBDA(std::size_t i) {
        const std::size_t t = at(i);
        for (std::size_t j = 0; j < d; ++j) y(i, j) = detail::store<Y>(detail::load<T>(y(i, j)) + detail::load<T>(P(t, j)));
      });
}

/// dP(at(i), :) += dy(i, :) over the rows of the block, in row order per
/// column chunk (deterministic, no atomics).
template <class DYV, class DPV>
void position_backward_balanced(const DYV& dy, const BalancedPositions& at, const DPV& dP) {
  const std::size_t rows = dy.extent(0), d = dy.extent(1), C = detail::column_chunk;
  WEFT_REQUIRE(at.seq <= dP.extent(0) && dP.extent(1) == d, ShapeError,
               "weft::ops::position_backward_balanced: rows of sequences of length ", at.seq,
               " do not fit a table of ", dP.extent(0), " x ", dP.extent(1));
  using T = detail::compute_t<DYV, DPV>;
  using G = detail::value_t<DPV>;
  Kokkos::parallel_for(
      "weft::position_backward_balanced", detail::range(dy, (d + C - 1) / C), KOKKOS_LAMBDA(std::size_t c) {
        const std::size_t j0 = c * C, w = d - j0 < C ? d - j0 : C;
        for (std::size_t i = 0; i < rows; ++i) {
          const std::size_t t = at(i);
          for (std::size_t jj = 0; jj < w; ++jj)
            dP(t, j0 + jj) = detail::store<G>(detail::load<T>(dP(t, j0 + jj)) + detail::load<T>(dy(i, j0 + jj)));
        }
      });
}

}  // namespace weft::ops
