// nn::Embedding: token table plus (for learned positions) a position table,
// summed into the first residual stream. It saves only the token ids. Over a
// tensor-parallel axis the token table is split by vocabulary rows: each rank
// looks up the ids it holds (zeros for the others) and the ranks' partial
// rows are summed -- all-reduced, or reduce-scattered onto the token shards
// under sequence parallelism.
#pragma once

#include <weft/nn/config.hpp>
#include <weft/nn/tp_comm.hpp>
#include <weft/ops/embedding.hpp>
#include <weft/ops/random.hpp>

namespace weft::nn {

/// Token (and learned position) embeddings.
template <class T, class Space = Kokkos::DefaultExecutionSpace>
class Embedding {
 public:
  /// "tok_emb.weight" [V, D] and, for learned positions, "pos_emb.weight" [T, D], both ~ N(0, init_std^2).
  /// Over the context's TP axis this rank holds rows [r V / tp, (r + 1) V / tp) of the token table.
  Embedding(ContextPtr ctx, const GPTConfig& c)
      : ctx_(std::move(ctx)),
        seq_(c.seq),
        global_seq_(c.global_seq()),
        vocab_(c.vocab),
        first_(ctx_->tp.rank() * (c.vocab / ctx_->tp.size())),
        tok_("tok_emb.weight", c.vocab / ctx_->tp.size(), c.d_model, true) {
    ops::init_normal(tok_.matrix(), c.seed, tok_.name(), c.init_std, {.row0 = first_, .col0 = 0, .global_cols = 0});
    tok_.set_tp_sharded(ctx_->tp.active());
    // Both tables are read as their compute copies: the looked-up token rows
    // are rounded (round_tokens: each row is one table row, also after the
    // TP reduction, whose other terms are zero), the position table is
    // rounded before it is added (ComputeCopies).
    tok_.set_read_as(ctx_->products);
    tok_.set_global(c.vocab, c.d_model, {GlobalBand{first_, 0, tok_.rows(), c.d_model, 0}});
    if (c.position == PositionKind::learned) {
      pos_.emplace_back("pos_emb.weight", c.global_seq(), c.d_model, true);
      ops::init_normal(pos_[0].matrix(), c.seed, pos_[0].name(), c.init_std);
      pos_[0].set_read_as(ctx_->products);
    }
    if (ctx_->tp.sp()) full_ = ops::Matrix<T, Space>("tok_emb.full", c.tokens(), c.d_model);
  }

  /// x = tok[ids] (+ pos[t]); ids: [tokens] of whole sequences; x: [rows, D]
  /// (this rank's token shard under sequence parallelism).
  template <class IV, class XV>
  void forward(const IV& ids, const XV& x) const {
    metrics::Profiler::Scope sc(ctx_->profiler, "embedding");
    const TensorSplit& tp = ctx_->tp;
    if (ctx_->cp.active()) {  // ids are this rank's tokens; positions from the balanced layout
      if (!tp.active()) {
        ops::embedding_forward(tok_.matrix(), ids, x);
      } else if (!tp.sp()) {
        ops::vocab_embedding_forward(tok_.matrix(), ids, first_, vocab_, x);
        detail::tp_all_reduce(*ctx_, x);
      } else {
        ops::vocab_embedding_forward(tok_.matrix(), ids, first_, vocab_, full_);
        detail::tp_reduce_scatter(*ctx_, full_, x);
      }
      round_tokens(x);
      if (!pos_.empty())
        read_positions([&](const auto& P) { ops::position_forward_balanced(P, positions(x.extent(0)), x); });
    } else if (!tp.active()) {
      ops::embedding_forward(tok_.matrix(), ids, x);
      round_tokens(x);
      if (!pos_.empty()) read_positions([&](const auto& P) { ops::position_forward(P, seq_, 0, x, true); });
    } else if (!tp.sp()) {
      ops::vocab_embedding_forward(tok_.matrix(), ids, first_, vocab_, x);
      detail::tp_all_reduce(*ctx_, x);
      round_tokens(x);
      if (!pos_.empty()) read_positions([&](const auto& P) { ops::position_forward(P, seq_, 0, x, true); });
    } else {
      ops::vocab_embedding_forward(tok_.matrix(), ids, first_, vocab_, full_);
      detail::tp_reduce_scatter(*ctx_, full_, x);
      round_tokens(x);
      if (!pos_.empty())
        read_positions([&](const auto& P) { ops::position_forward_rows(P, seq_, tp.rank() * x.extent(0), x); });
    }
  }

  /// Table gradients accumulate from dx ([rows, D] as in forward). Under
  /// sequence parallelism the position gradient is this shard's part (the
  /// model sums it over TP).
  template <class IV, class DXV>
  void backward(const IV& ids, const DXV& dx) {
    metrics::Profiler::Scope sc(ctx_->profiler, "embedding");
    const TensorSplit& tp = ctx_->tp;
    if (ctx_->cp.active()) {
      if (!pos_.empty()) ops::position_backward_balanced(dx, positions(dx.extent(0)), pos_[0].grad_matrix());
      if (!tp.active()) {
        ops::embedding_backward(dx, ids, tok_.grad_matrix());
      } else if (!tp.sp()) {
        ops::vocab_embedding_backward(dx, ids, first_, tok_.grad_matrix());
      } else {
        detail::tp_all_gather(*ctx_, dx, full_);
        ops::vocab_embedding_backward(full_, ids, first_, tok_.grad_matrix());
      }
    } else if (!tp.active()) {
      ops::embedding_backward(dx, ids, tok_.grad_matrix());
      if (!pos_.empty()) ops::position_backward(dx, seq_, 0, pos_[0].grad_matrix());
    } else if (!tp.sp()) {
      ops::vocab_embedding_backward(dx, ids, first_, tok_.grad_matrix());
      if (!pos_.empty()) ops::position_backward(dx, seq_, 0, pos_[0].grad_matrix());
    } else {
      if (!pos_.empty()) ops::position_backward_rows(dx, seq_, tp.rank() * dx.extent(0), pos_[0].grad_matrix());
      detail::tp_all_gather(*ctx_, dx, full_);
      ops::vocab_embedding_backward(full_, ids, first_, tok_.grad_matrix());
    }
  }

  /// Parameters whose gradients are partial over the TP ranks under sequence
  /// parallelism (the position table).
  void collect_sequence_partial(std::vector<Parameter<T, Space>*>& out) {
    for (auto& p : pos_) out.push_back(&p);
  }
  /// Bytes of the sequence-parallel gather buffer.
  std::size_t buffer_bytes() const { return detail::bytes_of(full_); }

  /// Appends pointers to this layer's parameters.
  void collect(std::vector<Parameter<T, Space>*>& out) {
    out.push_back(&tok_);
    for (auto& p : pos_) out.push_back(&p);
  }

 private:
  // Global positions of this rank's `rows` residual rows (its token shard under sequence parallelism).
  ops::BalancedPositions positions(std::size_t rows) const {
    const std::size_t row0 = ctx_->tp.sp() ? ctx_->tp.rank() * rows : 0;
    return {row0, seq_, global_seq_, ctx_->cp.size(), ctx_->cp.rank()};
  }

  // Under a 2-byte product precision, the looked-up token rows rounded to it.
  template <class XV>
  void round_tokens(const XV& x) const {
    if (ctx_->products == ProductPrecision::bf16) weft::round_through<bf16>(x);
    else if (ctx_->products == ProductPrecision::fp16) weft::round_through<fp16>(x);
  }
  template <class F>
  void read_positions(F&& f) const {
    copies_.read_matrix(pos_[0], *ctx_, std::forward<F>(f));
  }

  ContextPtr ctx_;
  ComputeCopies<Space> copies_;  // reads the position table as computed with
  std::size_t seq_, global_seq_, vocab_, first_;
  Parameter<T, Space> tok_;
  std::vector<Parameter<T, Space>> pos_;
  ops::Matrix<T, Space> full_;  // sequence parallelism: [tokens, D] partial lookups and gathered gradients
};

}  // namespace weft::nn
