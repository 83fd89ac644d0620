// nn::Block: the pre-norm transformer block x + attn(norm(x)), then
// + mlp(norm(.)). Its Saved activations can be private (kept from forward to
// backward) or shared by all blocks with recomputation from the block input
// (activation checkpointing): memory of one block instead of L. Under
// sequence parallelism the norms and residual adds work on this rank's token
// shard (rows = tokens / tp), and the norms' parameter gradients, partial over
// the shards, are summed over the TP axis before the block's hooks see them.
// With GPTConfig::experts > 0, the MLP of every moe_every-th block is a
// mixture of experts (nn::MoE).
#pragma once

#include <memory>
#include <optional>

#include <weft/nn/attention.hpp>
#include <weft/nn/mlp.hpp>
#include <weft/nn/moe.hpp>
#include <weft/nn/norm.hpp>
#include <weft/nn/tp_comm.hpp>
#include <weft/ops/elementwise.hpp>

namespace weft::nn {

/// One transformer block.
template <class T, class Space = Kokkos::DefaultExecutionSpace>
class Block {
 public:
  /// Everything backward needs besides the block input: both norms' outputs
  /// and statistics, attention's and the MLP's saved tensors, and the
  /// residual stream between attention and MLP.
  struct Saved {
    typename Norm<T, Space>::Saved n1, n2;
    ops::Matrix<T, Space> h1, mid, h2;
    typename Attention<T, Space>::Saved attn;
    typename MLP<T, Space>::Saved mlp;           ///< a dense block's MLP (empty in a MoE block)
    std::optional<typename MoE<T, Space>::Saved> moe;  ///< a MoE block's routing and experts
    long holder = -1;  ///< index of the block whose activations these are now (-1: none)
    /// No block index: tensors for any block of the model.
    static constexpr std::size_t npos = std::size_t(-1);
    /// Whether the Saved of block `index` (npos: any block, e.g. the set all
    /// blocks share under recompute) needs the dense MLP's tensors.
    static bool needs_dense(const GPTConfig& c, std::size_t index) {
      if (index != npos) return !c.moe_block(index);
      return c.moe_blocks() < c.layers;
    }
    /// Whether it needs a mixture of experts' tensors.
    static bool needs_moe(const GPTConfig& c, std::size_t index) {
      return index != npos ? c.moe_block(index) : c.moe_blocks() > 0;
    }
    /// For the global config c split over tp; `index`: the block that keeps
    /// them (npos: any block).
    Saved(const std::string& n, const GPTConfig& c, const TensorSplit& tp = {}, std::size_t index = npos)
        : n1(n + ".ln1", rows(c, tp)),
          n2(n + ".ln2", rows(c, tp)),
          h1(n + ".ln1.out", rows(c, tp), c.d_model),
          mid(n + ".mid", rows(c, tp), c.d_model),
          h2(n + ".ln2.out", rows(c, tp), c.d_model),
          attn(n + ".attn", c, tp),
          mlp(needs_dense(c, index) ? typename MLP<T, Space>::Saved(n + ".mlp", c, tp) : typename MLP<T, Space>::Saved()) {
      if (needs_moe(c, index)) moe.emplace(n + ".mlp", moe_rows(c, tp));
    }
    /// Block `index`'s own activations over a float set all dense blocks
    /// share (GPTModel under a 2-byte Precision without recompute): its
    /// tensors alias `shared`'s, and a stash keeps this block's copies of
    /// them between its forward and its backward -- 2-byte (`prec`'s type)
    /// for the activations, float for the norms' statistics and the
    /// attention's log-sum-exps. A dense block only.
    Saved(const std::string& n, const Saved& shared, ProductPrecision prec)
        : n1(shared.n1), n2(shared.n2), h1(shared.h1), mid(shared.mid), h2(shared.h2), attn(shared.attn),
          mlp(shared.mlp), stash(std::in_place, prec) {
      WEFT_REQUIRE(!shared.moe && !shared.stash, Error, "nn::Block::Saved '", n,
                   "': a stash covers a dense block over a plain shared set");
      stash->keep(n1.mean, false, n + ".ln1.mean");
      stash->keep(n1.rstd, false, n + ".ln1.rstd");
      stash->keep(n2.mean, false, n + ".ln2.mean");
      stash->keep(n2.rstd, false, n + ".ln2.rstd");
      stash->keep(h1, true, n + ".ln1.out");
      stash->keep(mid, true, n + ".mid");
      stash->keep(h2, true, n + ".ln2.out");
      stash->keep(attn.qkv, true, n + ".attn.qkv");
      stash->keep(attn.probs, true, n + ".attn.probs");
      stash->keep(attn.lse, false, n + ".attn.lse");
      stash->keep(attn.heads, true, n + ".attn.heads");
      stash->keep(attn.input, true, n + ".attn.input");
      stash->keep(mlp.up, true, n + ".mlp.up");
      stash->keep(mlp.act, true, n + ".mlp.act");
      stash->keep(mlp.input, true, n + ".mlp.input");
    }
    /// This block's copies when its tensors alias a shared set (the
    /// constructor above); empty otherwise.
    std::optional<ActivationStash<T, Space>> stash;
    /// Bytes held: the stash's copies when there is one (the float tensors
    /// are then the shared set's, counted once by its owner), else the tensors.
    std::size_t bytes() const {
      if (stash) return stash->bytes();
      return n1.bytes() + n2.bytes() + detail::bytes_of(h1) + detail::bytes_of(mid) + detail::bytes_of(h2) +
             attn.bytes() + mlp.bytes() + (moe ? moe->bytes() : 0);
    }
  };

  /// Backward scratch shared by every block of a model.
  struct Workspace {
    typename Attention<T, Space>::Workspace attn;
    typename MLP<T, Space>::Workspace mlp;
    std::optional<typename MoE<T, Space>::Workspace> moe;  ///< when the model has MoE blocks
    ops::Matrix<T, Space> dh, dmid, scratch;
    /// For the global config c split over tp.
    explicit Workspace(const GPTConfig& c, const TensorSplit& tp = {})
        : attn(c, tp),
          mlp(c, tp),
          dh("block.dh", rows(c, tp), c.d_model),
          dmid("block.dmid", rows(c, tp), c.d_model),
          scratch(c.recompute ? ops::Matrix<T, Space>("block.recompute_out", rows(c, tp), c.d_model)
                              : ops::Matrix<T, Space>()) {
      if (c.moe_blocks() > 0) moe.emplace(moe_rows(c, tp));
    }
    /// Bytes held.
    std::size_t bytes() const {
      return attn.bytes() + mlp.bytes() + (moe ? moe->bytes() : 0) + detail::bytes_of(dh) + detail::bytes_of(dmid) + detail::bytes_of(scratch);
    }
  };

  /// Block `index` with parameters under "blocks.<index>."; `saved` is this
  /// block's own or (with recompute) the one all blocks share.
  Block(ContextPtr ctx, std::size_t index, const GPTConfig& c, std::shared_ptr<Saved> saved,
        std::shared_ptr<Workspace> ws, const ContextParallel<T, Space>* cp = nullptr)
      : ctx_(ctx),
        index_(long(index)),
        recompute_(c.recompute),
        ln1_(ctx, prefix(index) + "ln1", c.norm, c.d_model, c.norm_eps),
        ln2_(ctx, prefix(index) + "ln2", c.norm, c.d_model, c.norm_eps),
        attn_(ctx, prefix(index) + "attn", c, cp),
        s_(std::move(saved)),
        w_(std::move(ws)) {
    if (c.moe_block(index)) {
      moe_.emplace(ctx, prefix(index) + "mlp", c);
      WEFT_REQUIRE(s_->moe.has_value() && w_->moe.has_value(), Error, "nn::Block ", index,
                   " is a mixture-of-experts block, but its Saved or Workspace was built without MoE tensors");
    } else {
      mlp_.emplace(ctx, prefix(index) + "mlp", c);
    }
  }

  /// Token rows a rank's residual stream holds: all tokens, or tokens / tp
  /// under sequence parallelism.
  static std::size_t rows(const GPTConfig& c, const TensorSplit& tp) {
    return tp.sp() ? c.tokens() / tp.size() : c.tokens();
  }
  /// The config a MoE's Saved and Workspace are sized from: c, or under
  /// sequence parallelism c with tokens() = this rank's rows (the MoE routes
  /// its own token shard).
  static GPTConfig moe_rows(const GPTConfig& c, const TensorSplit& tp) {
    if (!tp.sp()) return c;
    GPTConfig local = c;
    local.batch = rows(c, tp);
    local.seq = 1;
    return local;
  }

  /// y = block(x); x must stay unchanged until backward (it is the checkpoint).
  template <class XV, class YV>
  void forward(const XV& x, const YV& y) {
    ln1_.forward(x, s_->h1, s_->n1);
    attn_.forward(s_->h1, s_->attn, s_->mid, &w_->attn);
    {
      metrics::Profiler::Scope sc(ctx_->profiler, "residual");
      ops::add(s_->mid, s_->mid, x);
    }
    ln2_.forward(s_->mid, s_->h2, s_->n2);
    if (moe_)
      moe_->forward(s_->h2, *s_->moe, y);
    else
      mlp_->forward(s_->h2, s_->mlp, y, &w_->mlp);
    {
      metrics::Profiler::Scope sc(ctx_->profiler, "residual");
      ops::add(y, y, s_->mid);
    }
    s_->holder = index_;
    if (s_->stash) {
      metrics::Profiler::Scope sc(ctx_->profiler, "stash");
      s_->stash->store();
    }
  }

  /// dx = d/dx from dy (dx overwritten, must not alias dy); parameter
  /// gradients accumulate. With recompute, re-runs forward from x first
  /// unless the shared activations are still this block's.
  template <class XV, class DYV, class DXV>
  void backward(const XV& x, const DYV& dy, const DXV& dx) {
    if (s_->stash) {
      // The shared float set holds the last forward's tensors (whichever
      // block ran it): load this block's copies, also for the block that ran
      // last, so every block's backward reads the same 2-byte activations.
      WEFT_REQUIRE(s_->holder == index_, Error, "nn::Block ", index_, ": backward without a preceding forward");
      WEFT_REQUIRE(!ctx_->deferred_weight_grads || ctx_->deferred_weight_grads->copies_inputs(), ConfigError,
                   "nn::Block ", index_,
                   ": a block that keeps 2-byte copies over a shared float set cannot defer its weight gradients "
                   "unless the deferred work copies its inputs (DeferredWork::set_copy_inputs): the set is refilled "
                   "by the next block's backward before the deferred products run");
      metrics::Profiler::Scope sc(ctx_->profiler, "stash");
      s_->stash->load();
    } else if (s_->holder != index_) {
      WEFT_REQUIRE(recompute_, Error, "nn::Block ", index_, ": backward without a preceding forward");
      metrics::Profiler::Scope sc(ctx_->profiler, "recompute");
      if (moe_) moe_->set_recording(false);  // the routing was counted by the first forward
      forward(x, w_->scratch);
      if (moe_) moe_->set_recording(true);
    }
    const bool sp = ctx_->tp.sp();
    if (sp) {
      WEFT_REQUIRE(!moe_ || !ctx_->deferred_weight_grads, ConfigError, "nn::Block ", index_, ": ",
                   moe_sp_split_text);
      if (!partial_) {
        // The norms', and a MoE's (its router and experts see this rank's
        // tokens only), summed over TP after the block's backward.
        std::vector<Parameter<T, Space>*> partial;
        ln1_.collect(partial);
        ln2_.collect(partial);
        if (moe_) moe_->collect(partial);
        partial_ = std::make_unique<detail::PartialGrads<T, Space>>(partial);
      }
      partial_->begin();
    }
    if (moe_)
      moe_->backward(s_->h2, *s_->moe, dy, w_->dh, *w_->moe);
    else
      mlp_->backward(s_->h2, s_->mlp, dy, w_->dh, w_->mlp);
    ln2_.backward(w_->dh, s_->mid, s_->n2, w_->dmid, false);
    {
      metrics::Profiler::Scope sc(ctx_->profiler, "residual");
      ops::add(w_->dmid, w_->dmid, dy);
    }
    attn_.backward(s_->h1, s_->attn, w_->dmid, w_->dh, w_->attn);
    ln1_.backward(w_->dh, x, s_->n1, dx, false);
    {
      metrics::Profiler::Scope sc(ctx_->profiler, "residual");
      ops::add(dx, dx, w_->dmid);
    }
    if (sp) partial_->finish(*ctx_);
  }

  /// Why a split backward (zero-bubble schedules) is refused for a MoE block
  /// under sequence parallelism.
  static constexpr const char* moe_sp_split_text =
      "a mixture-of-experts block under SequenceParallel sums its router's and experts' gradients over TP when its "
      "backward ends, so it cannot defer them to a zero-bubble schedule's weight half; use gpipe, 1f1b or "
      "interleaved, or drop SequenceParallel";

  /// Appends pointers to this block's parameters.
  void collect(std::vector<Parameter<T, Space>*>& out) {
    ln1_.collect(out);
    attn_.collect(out);
    ln2_.collect(out);
    if (moe_)
      moe_->collect(out);
    else
      mlp_->collect(out);
  }
  /// The mixture of experts of a MoE block (null in a dense block).
  MoE<T, Space>* moe() { return moe_ ? &*moe_ : nullptr; }
  /// Bytes the block's context-parallel attention keeps of its own (0 without CP).
  std::size_t context_bytes() const { return attn_.context_bytes(); }
  /// The context-parallel attention's peak of exchange buffers (Attention::context_buffer_bytes).
  std::size_t context_buffer_bytes() const { return attn_.context_buffer_bytes(); }
  /// The activations this block writes (shared with other blocks under recompute).
  const std::shared_ptr<Saved>& saved() const { return s_; }

 private:
  static std::string prefix(std::size_t i) { return "blocks." + std::to_string(i) + "."; }
  ContextPtr ctx_;
  long index_;
  bool recompute_;
  Norm<T, Space> ln1_, ln2_;
  Attention<T, Space> attn_;
  std::optional<MLP<T, Space>> mlp_;  // a dense block
  std::optional<MoE<T, Space>> moe_;  // a MoE block
  std::shared_ptr<Saved> s_;
  std::shared_ptr<Workspace> w_;
  std::unique_ptr<detail::PartialGrads<T, Space>> partial_;  // sequence parallelism: the norms' gradients
};

}  // namespace weft::nn
