// nn::GPT: token (+ position) embedding, L pre-norm blocks, final norm, untied
// LM head without bias, fused softmax cross-entropy. The single-process
// reference every parallel strategy must reproduce, with explicit
// forward/backward and memory attributed by category.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include <weft/metrics/memory.hpp>
#include <weft/nn/block.hpp>
#include <weft/nn/embedding.hpp>
#include <weft/ops/cross_entropy.hpp>

namespace weft::nn {

/// The reference GPT.
template <class T, class Space = Kokkos::DefaultExecutionSpace>
class GPT {
 public:
  /// Builds and initialises the model for config.batch sequences of config.seq
  /// tokens per forward pass. Throws ConfigError for an invalid config.
  explicit GPT(const GPTConfig& c) : cfg_((c.validate(), c)), ctx_(std::make_shared<Context>()), emb_(ctx_, cfg_),
        ln_f_(ctx_, "ln_f", cfg_.norm, cfg_.d_model, cfg_.norm_eps),
        head_(ctx_, "lm_head", cfg_.d_model, cfg_.vocab, false, cfg_.seed, cfg_.init_std),
        hf_("ln_f.out", cfg_.tokens(), cfg_.d_model),
        sf_("ln_f", cfg_.tokens()),
        logits_("lm_head.logits", cfg_.tokens(), cfg_.vocab),
        dhf_("ln_f.dout", cfg_.tokens(), cfg_.d_model),
        ws_(std::make_shared<typename Block<T, Space>::Workspace>(cfg_)) {
    for (std::size_t l = 0; l <= cfg_.layers; ++l)
      xs_.emplace_back("residual." + std::to_string(l), cfg_.tokens(), cfg_.d_model);
    for (int i = 0; i < 2; ++i) dxs_.emplace_back("residual.grad." + std::to_string(i), cfg_.tokens(), cfg_.d_model);
    std::shared_ptr<typename Block<T, Space>::Saved> shared;
    if (cfg_.recompute) shared = std::make_shared<typename Block<T, Space>::Saved>("blocks.shared", cfg_);
    blocks_.reserve(cfg_.layers);
    for (std::size_t l = 0; l < cfg_.layers; ++l)
      blocks_.emplace_back(ctx_, l, cfg_,
                           shared ? shared
                                  : std::make_shared<typename Block<T, Space>::Saved>("blocks." + std::to_string(l), cfg_),
                           ws_);
  }
  GPT(const GPT&) = delete;
  GPT& operator=(const GPT&) = delete;

  /// Forward, loss and backward for one microbatch: ids and targets are
  /// [batch * seq] token ids. Returns the mean loss over its tokens; parameter
  /// gradients accumulate grad_scale * d(sum of token losses) (default
  /// 1/tokens: the gradient of the mean).
  template <class IV, class TV>
  double forward_backward(const IV& ids, const TV& targets, double grad_scale = 0) {
    if (grad_scale == 0) grad_scale = 1.0 / double(cfg_.tokens());
    forward_hidden(ids);
    double sum = 0;
    {
      metrics::Profiler::Scope sc(ctx_->profiler, "cross_entropy");
      sum = ops::cross_entropy_forward_backward(logits_, targets, T(grad_scale));
    }
    const std::size_t L = cfg_.layers;
    if (hooks_) hooks_->before_backward(L);
    head_.backward(hf_, logits_, dhf_, false);
    ln_f_.backward(dhf_, xs_[L], sf_, dxs_[L % 2], false);
    for (std::size_t l = L; l-- > 0;) {
      if (hooks_) hooks_->before_backward(l);
      blocks_[l].backward(xs_[l], dxs_[(l + 1) % 2], dxs_[l % 2]);
      if (hooks_) hooks_->after_backward(l);
    }
    emb_.backward(ids, dxs_[0]);
    if (hooks_) hooks_->after_backward(L);
    return sum / double(cfg_.tokens());
  }

  /// Mean loss of a microbatch without touching gradients (evaluation).
  template <class IV, class TV>
  double loss(const IV& ids, const TV& targets) {
    forward_hidden(ids);
    metrics::Profiler::Scope sc(ctx_->profiler, "cross_entropy");
    return ops::cross_entropy_forward(logits_, targets) / double(cfg_.tokens());
  }

  /// Sets every gradient to zero (before a step's first microbatch).
  void zero_grad() {
    for (auto* p : parameters()) Kokkos::deep_copy(p->grad, T(0));
  }

  /// All parameters, in a fixed order (embedding, blocks, final norm, head).
  std::vector<Parameter<T, Space>*> parameters() {
    std::vector<Parameter<T, Space>*> out;
    emb_.collect(out);
    for (auto& b : blocks_) b.collect(out);
    ln_f_.collect(out);
    head_.collect(out);
    return out;
  }

  /// Parameters by group, for strategies that work group by group: group l <
  /// layers is block l, group `layers` the root (embeddings, final norm, head).
  std::vector<std::vector<Parameter<T, Space>*>> parameter_groups() {
    std::vector<std::vector<Parameter<T, Space>*>> g(cfg_.layers + 1);
    for (std::size_t l = 0; l < cfg_.layers; ++l) blocks_[l].collect(g[l]);
    emb_.collect(g[cfg_.layers]);
    ln_f_.collect(g[cfg_.layers]);
    head_.collect(g[cfg_.layers]);
    return g;
  }

  /// Installs hooks called around each group's forward and backward (null removes them).
  void set_hooks(GroupHooks* h) { hooks_ = h; }

  /// Total number of parameter elements.
  std::size_t num_parameters() {
    std::size_t n = 0;
    for (auto* p : parameters()) n += p->size();
    return n;
  }

  /// Bytes of parameters, gradients, activations (residual stream, each
  /// block's saved tensors -- once when shared --, final norm, logits) and
  /// buffers (backward scratch shared by all blocks).
  metrics::MemoryLedger memory() {
    metrics::MemoryLedger m;
    for (auto* p : parameters()) detail::account(m, *p);
    using C = metrics::MemoryCategory;
    for (const auto& x : xs_) m.add(C::activations, x.label(), detail::bytes_of(x));
    const void* last = nullptr;
    for (std::size_t l = 0; l < blocks_.size(); ++l) {
      const auto* s = blocks_[l].saved().get();
      if (s == last) continue;  // shared under recompute
      m.add(C::activations, cfg_.recompute ? "blocks.shared" : "blocks." + std::to_string(l), s->bytes());
      last = s;
    }
    m.add(C::activations, "ln_f", detail::bytes_of(hf_) + sf_.bytes());
    m.add(C::activations, "lm_head.logits", detail::bytes_of(logits_));
    m.add(C::buffers, "block backward workspace", ws_->bytes());
    m.add(C::buffers, "residual gradients", detail::bytes_of(dxs_[0]) * 2 + detail::bytes_of(dhf_));
    return m;
  }

  /// Attaches a profiler (null detaches): kernel scopes then fence and time.
  void set_profiler(metrics::Profiler* p) { ctx_->profiler = p; }
  /// The configuration.
  const GPTConfig& config() const { return cfg_; }
  /// Logits of the last forward pass ([tokens, V]); after forward_backward
  /// they hold the loss gradient instead.
  const ops::Matrix<T, Space>& logits() const { return logits_; }

 private:
  template <class IV>
  void forward_hidden(const IV& ids) {
    detail_check_ids(ids);
    const std::size_t L = cfg_.layers;
    if (hooks_) hooks_->before_forward(L);
    emb_.forward(ids, xs_[0]);
    for (std::size_t l = 0; l < L; ++l) {
      if (hooks_) hooks_->before_forward(l);
      blocks_[l].forward(xs_[l], xs_[l + 1]);
      if (hooks_) hooks_->after_forward(l);
    }
    ln_f_.forward(xs_[L], hf_, sf_);
    head_.forward(hf_, logits_);
    if (hooks_) hooks_->after_forward(L);
  }
  template <class IV>
  void detail_check_ids(const IV& ids) const {
    WEFT_REQUIRE(ids.extent(0) == cfg_.tokens(), ShapeError, "nn::GPT: got ", ids.extent(0),
                 " token ids, but the model is built for batch ", cfg_.batch, " x seq ", cfg_.seq, " = ",
                 cfg_.tokens());
  }

  GPTConfig cfg_;
  ContextPtr ctx_;
  Embedding<T, Space> emb_;
  std::vector<Block<T, Space>> blocks_;
  Norm<T, Space> ln_f_;
  Linear<T, Space> head_;
  std::vector<ops::Matrix<T, Space>> xs_, dxs_;
  ops::Matrix<T, Space> hf_;
  typename Norm<T, Space>::Saved sf_;
  ops::Matrix<T, Space> logits_, dhf_;
  std::shared_ptr<typename Block<T, Space>::Workspace> ws_;
  GroupHooks* hooks_ = nullptr;
};

}  // namespace weft::nn
