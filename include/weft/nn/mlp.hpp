// nn::MLP: up-projection, GELU (tanh form) or SwiGLU, down-projection. It
// saves the up-projection's output (the activation's input) and the
// activation's output (the down-projection's input).
#pragma once

#include <cmath>

#include <weft/nn/config.hpp>
#include <weft/nn/linear.hpp>

namespace weft::nn {

/// The feed-forward part of a block.
template <class T, class Space = Kokkos::DefaultExecutionSpace>
class MLP {
 public:
  /// Activations the backward pass needs.
  struct Saved {
    ops::Matrix<T, Space> up;   ///< [tokens, F] (GELU) or [tokens, 2F] (SwiGLU: gate | value)
    ops::Matrix<T, Space> act;  ///< [tokens, F]
    Saved() = default;
    Saved(const std::string& n, const GPTConfig& c)
        : up(n + ".up", c.tokens(), c.hidden() * (c.mlp == MlpKind::swiglu ? 2 : 1)),
          act(n + ".act", c.tokens(), c.hidden()) {}
    /// Bytes held.
    std::size_t bytes() const { return detail::bytes_of(up) + detail::bytes_of(act); }
  };
  /// Scratch of the backward pass, shared by all blocks.
  struct Workspace {
    ops::Matrix<T, Space> dup, dact;
    Workspace() = default;
    explicit Workspace(const GPTConfig& c)
        : dup("mlp.dup", c.tokens(), c.hidden() * (c.mlp == MlpKind::swiglu ? 2 : 1)),
          dact("mlp.dact", c.tokens(), c.hidden()) {}
    /// Bytes held.
    std::size_t bytes() const { return detail::bytes_of(dup) + detail::bytes_of(dact); }
  };

  /// Parameters "<name>.up.{weight,bias}" and "<name>.down.{weight,bias}".
  MLP(ContextPtr ctx, const std::string& name, const GPTConfig& c)
      : ctx_(ctx),
        kind_(c.mlp),
        up_(ctx, name + ".up", c.d_model, c.hidden() * (c.mlp == MlpKind::swiglu ? 2 : 1), true, c.seed, c.init_std),
        down_(ctx, name + ".down", c.hidden(), c.d_model, true, c.seed, c.init_std / std::sqrt(2.0 * double(c.layers))) {}

  /// out = down(act(up(h))), filling s.
  template <class HV, class OV>
  void forward(const HV& h, const Saved& s, const OV& out) const {
    up_.forward(h, s.up);
    {
      metrics::Profiler::Scope sc(ctx_->profiler, kind_ == MlpKind::gelu ? "gelu" : "swiglu");
      if (kind_ == MlpKind::gelu)
        ops::gelu_forward(s.up, s.act);
      else
        ops::swiglu_forward(s.up, s.act);
    }
    down_.forward(s.act, out);
  }

  /// dh = d/dh (overwritten); parameter gradients accumulate.
  template <class HV, class DOV, class DHV>
  void backward(const HV& h, const Saved& s, const DOV& dout, const DHV& dh, const Workspace& w) {
    down_.backward(s.act, dout, w.dact, false);
    {
      metrics::Profiler::Scope sc(ctx_->profiler, kind_ == MlpKind::gelu ? "gelu" : "swiglu");
      if (kind_ == MlpKind::gelu)
        ops::gelu_backward(w.dact, s.up, w.dup);
      else
        ops::swiglu_backward(w.dact, s.up, w.dup);
    }
    up_.backward(h, w.dup, dh, false);
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
