// nn::Embedding: token table plus (for learned positions) a position table,
// summed into the first residual stream. It saves only the token ids.
#pragma once

#include <weft/nn/config.hpp>
#include <weft/ops/embedding.hpp>
#include <weft/ops/random.hpp>

namespace weft::nn {

/// Token (and learned position) embeddings.
template <class T, class Space = Kokkos::DefaultExecutionSpace>
class Embedding {
 public:
  /// "tok_emb.weight" [V, D] and, for learned positions, "pos_emb.weight" [T, D], both ~ N(0, init_std^2).
  Embedding(ContextPtr ctx, const GPTConfig& c) : ctx_(std::move(ctx)), seq_(c.seq), tok_("tok_emb.weight", c.vocab, c.d_model, true) {
    ops::init_normal(tok_.matrix(), c.seed, tok_.name(), c.init_std);
    if (c.position == PositionKind::learned) {
      pos_.emplace_back("pos_emb.weight", c.seq, c.d_model, true);
      ops::init_normal(pos_[0].matrix(), c.seed, pos_[0].name(), c.init_std);
    }
  }

  /// x = tok[ids] (+ pos[t]); ids: [tokens] of whole sequences.
  template <class IV, class XV>
  void forward(const IV& ids, const XV& x) const {
    metrics::Profiler::Scope sc(ctx_->profiler, "embedding");
    ops::embedding_forward(tok_.matrix(), ids, x);
    if (!pos_.empty()) ops::position_forward(pos_[0].matrix(), seq_, 0, x, true);
  }

  /// Table gradients accumulate from dx.
  template <class IV, class DXV>
  void backward(const IV& ids, const DXV& dx) {
    metrics::Profiler::Scope sc(ctx_->profiler, "embedding");
    ops::embedding_backward(dx, ids, tok_.grad_matrix());
    if (!pos_.empty()) ops::position_backward(dx, seq_, 0, pos_[0].grad_matrix());
  }

  /// Appends pointers to this layer's parameters.
  void collect(std::vector<Parameter<T, Space>*>& out) {
    out.push_back(&tok_);
    for (auto& p : pos_) out.push_back(&p);
  }

 private:
  ContextPtr ctx_;
  std::size_t seq_;
  Parameter<T, Space> tok_;
  std::vector<Parameter<T, Space>> pos_;
};

}  // namespace weft::nn
