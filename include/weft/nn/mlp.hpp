// nn::MLP: up-projection, GELU (tanh form) or SwiGLU, down-projection. It
// saves the up-projection's output (the activation's input) and the
// activation's output (the down-projection's input). Over a tensor-parallel
// axis the up-projection is column-parallel (SwiGLU: each rank holds the same
// columns of the gate and of the value, side by side) and the down-projection
// row-parallel, joined as in Attention.
#pragma once

#include <cmath>

#include <weft/nn/config.hpp>
#include <weft/nn/linear.hpp>
#include <weft/nn/tp_comm.hpp>

namespace weft::nn {

/// The feed-forward part of a block.
template <class T, class Space = Kokkos::DefaultExecutionSpace>
class MLP {
 public:
  /// Activations the backward pass needs.
  struct Saved {
    ops::Matrix<T, Space> up;     ///< [tokens, F / tp] (GELU) or [tokens, 2F / tp] (SwiGLU: gate | value)
    ops::Matrix<T, Space> act;    ///< [tokens, F / tp]
    ops::Matrix<T, Space> input;  ///< sequence parallelism: [tokens, D], the all-gathered input; else empty
    Saved() = default;
    /// For the global config c split over tp.
    Saved(const std::string& n, const GPTConfig& c, const TensorSplit& tp = {})
        : up(n + ".up", c.tokens(), c.hidden() / tp.size() * (c.mlp == MlpKind::swiglu ? 2 : 1)),
          act(n + ".act", c.tokens(), c.hidden() / tp.size()),
          input(tp.sp() ? ops::Matrix<T, Space>(n + ".input", c.tokens(), c.d_model) : ops::Matrix<T, Space>()) {}
    /// Bytes held.
    std::size_t bytes() const { return detail::bytes_of(up) + detail::bytes_of(act) + detail::bytes_of(input); }
  };
  /// Scratch of the backward pass, shared by all blocks.
  struct Workspace {
    ops::Matrix<T, Space> dup, dact;
    ops::Matrix<T, Space> full;  ///< sequence parallelism: [tokens, D] gathered gradients and partial sums
    Workspace() = default;
    /// For the global config c split over tp.
    explicit Workspace(const GPTConfig& c, const TensorSplit& tp = {})
        : dup("mlp.dup", c.tokens(), c.hidden() / tp.size() * (c.mlp == MlpKind::swiglu ? 2 : 1)),
          dact("mlp.dact", c.tokens(), c.hidden() / tp.size()),
          full(tp.sp() ? ops::Matrix<T, Space>("mlp.full", c.tokens(), c.d_model) : ops::Matrix<T, Space>()) {}
    /// Bytes held.
    std::size_t bytes() const { return detail::bytes_of(dup) + detail::bytes_of(dact) + detail::bytes_of(full); }
  };

  /// Parameters "<name>.up.{weight,bias}" and "<name>.down.{weight,bias}"
  /// (this rank's part of them over the context's TP axis).
  MLP(ContextPtr ctx, const std::string& name, const GPTConfig& c)
      : ctx_(ctx),
        kind_(c.mlp),
        up_(ctx, name + ".up", c.d_model, c.hidden() * (c.mlp == MlpKind::swiglu ? 2 : 1), true, c.seed, c.init_std,
            LinearSplit::column(ctx->tp.size(), ctx->tp.rank(),
                                c.mlp == MlpKind::swiglu ? std::vector<std::size_t>{c.hidden(), c.hidden()}
                                                         : std::vector<std::size_t>{c.hidden()})),
        down_(ctx, name + ".down", c.hidden(), c.d_model, true, c.seed, c.init_std / std::sqrt(2.0 * double(c.layers)),
              LinearSplit::row(ctx->tp.size(), ctx->tp.rank())) {}

  /// out = down(act(up(h))), filling s. h, out: [rows, D] as in Attention.
  template <class HV, class OV>
  void forward(const HV& h, const Saved& s, const OV& out, const Workspace* w = nullptr) const {
    const TensorSplit& tp = ctx_->tp;
    const bool gelu = kind_ == MlpKind::gelu;
    // With GELU the up-projection's bias is added by the activation kernel (one pass fewer).
    auto up_forward = [&](const auto& x) {
      if (gelu)
        up_.forward_product(x, s.up);
      else
        up_.forward(x, s.up);
    };
    if (tp.sp()) {
      detail::tp_all_gather_operand<Space>(*ctx_, h, s.input);  // read by the up (and gate) products only
      up_forward(s.input);
    } else {
      up_forward(h);
    }
    {
      metrics::Profiler::Scope sc(ctx_->profiler, gelu ? "gelu" : "swiglu");
      if (gelu)
        up_.read_bias([&](const auto& b) { ops::bias_gelu_forward(s.up, b, s.act); });
      else
        ops::swiglu_forward(s.up, s.act);
    }
    detail::row_parallel_forward(*ctx_, down_, s.act, out, w ? &w->full : nullptr, "nn::MLP");
  }

  /// dh = d/dh (overwritten); parameter gradients accumulate.
  template <class HV, class DOV, class DHV>
  void backward(const HV& h, const Saved& s, const DOV& dout, const DHV& dh, const Workspace& w) {
    const TensorSplit& tp = ctx_->tp;
    detail::row_parallel_backward(*ctx_, down_, s.act, dout, w.dact, w.full);
    const bool gelu = kind_ == MlpKind::gelu;
    {
      metrics::Profiler::Scope sc(ctx_->profiler, gelu ? "gelu" : "swiglu");
      if (gelu)
        ops::bias_gelu_backward(w.dact, s.up, w.dup, up_.bias().grad);  // the up-projection's bias gradient too
      else
        ops::swiglu_backward(w.dact, s.up, w.dup);
    }
    auto up_backward = [&](const auto& x, const auto& dx) {
      if (gelu)
        up_.backward_product(x, w.dup, dx, false);
      else
        up_.backward(x, w.dup, dx, false);
    };
    if (!tp.active()) {
      up_backward(h, dh);
    } else if (!tp.sp()) {
      up_backward(h, dh);
      detail::tp_all_reduce(*ctx_, dh);
    } else {
      up_backward(s.input, w.full);
      detail::tp_reduce_scatter(*ctx_, w.full, dh);
    }
  }

  /// Appends pointers to this layer's parameters.
  void collect(std::vector<Parameter<T, Space>*>& out) {
    up_.collect(out);
    down_.collect(out);
  }

 private:
  ContextPtr ctx_;
  MlpKind kind_;
  Linear<T, Space> up_, down_;
};

}  // namespace weft::nn
