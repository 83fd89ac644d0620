// nn::Linear: y = x W + b with W stored [in, out] (so the forward product is
// a plain NN gemm) and explicit backward. It saves nothing itself: its
// backward needs the input x, which the caller already keeps.
#pragma once

#include <weft/nn/parameter.hpp>
#include <weft/ops/elementwise.hpp>
#include <weft/ops/gemm.hpp>
#include <weft/ops/random.hpp>

namespace weft::nn {

/// A dense layer with optional bias.
template <class T, class Space = Kokkos::DefaultExecutionSpace>
class Linear {
 public:
  /// Parameters "<name>.weight" [in, out] ~ N(0, init_std^2) and, with `bias`,
  /// "<name>.bias" [out] = 0, drawn from (seed, name, global index).
  Linear(ContextPtr ctx, const std::string& name, std::size_t in, std::size_t out, bool bias, std::uint64_t seed,
         double init_std)
      : ctx_(std::move(ctx)), weight_(name + ".weight", in, out, true) {
    WEFT_REQUIRE(in > 0 && out > 0, ConfigError, "nn::Linear '", name, "': sizes ", in, " x ", out,
                 " must be positive");
    ops::init_normal(weight_.matrix(), seed, weight_.name(), init_std);
    if (bias) {
      bias_.emplace_back(name + ".bias", 1, out, false);
      Kokkos::deep_copy(bias_[0].value, T(0));
    }
  }

  /// y = x W + b (y overwritten). x: [n, in], y: [n, out].
  template <class XV, class YV>
  void forward(const XV& x, const YV& y) const {
    {
      metrics::Profiler::Scope s(ctx_->profiler, "gemm");
      ops::gemm(ops::Trans::N, ops::Trans::N, T(1), x, weight_.matrix(), T(0), y);
    }
    if (!bias_.empty()) {
      metrics::Profiler::Scope s(ctx_->profiler, "bias");
      ops::bias_add(y, bias_[0].value);
    }
  }

  /// dW += x^T dy, db += colsum(dy), and dx = dy W^T (+= with accumulate_dx).
  /// Pass an empty dx (extent 0) when the input needs no gradient. While the
  /// context defers weight gradients, dW's gemm is queued there instead (with
  /// a copy of dy; x must stay unchanged until the queue runs).
  template <class XV, class DYV, class DXV>
  void backward(const XV& x, const DYV& dy, const DXV& dx, bool accumulate_dx = false) {
    {
      metrics::Profiler::Scope s(ctx_->profiler, "gemm");
      if (ctx_->deferred_weight_grads) {
        auto kept = ctx_->deferred_weight_grads->template take<ops::Matrix<T, Space>>(
            weight_.name() + ".deferred_dy", dy.extent(0), dy.extent(1));
        Kokkos::deep_copy(kept, dy);
        ctx_->deferred_weight_grads->push([this, x, kept] { backward_weight(x, kept); });
      } else {
        weight_gemm(x, dy);
      }
      if (dx.extent(0) != 0)
        ops::gemm(ops::Trans::N, ops::Trans::T, T(1), dy, weight_.matrix(), T(accumulate_dx ? 1 : 0), dx);
    }
    if (!bias_.empty()) {
      metrics::Profiler::Scope s(ctx_->profiler, "bias");
      ops::bias_backward(dy, bias_[0].grad);
    }
  }

  /// dW += x^T dy only: the weight-gradient half of backward.
  template <class XV, class DYV>
  void backward_weight(const XV& x, const DYV& dy) {
    metrics::Profiler::Scope s(ctx_->profiler, "gemm");
    weight_gemm(x, dy);
  }

  /// Input features.
  std::size_t in() const { return weight_.rows(); }
  /// Output features.
  std::size_t out() const { return weight_.cols(); }
  /// The weight.
  Parameter<T, Space>& weight() { return weight_; }
  /// Whether the layer has a bias.
  bool has_bias() const { return !bias_.empty(); }
  /// The bias (has_bias() must be true).
  Parameter<T, Space>& bias() { return bias_.at(0); }
  /// Appends pointers to this layer's parameters.
  void collect(std::vector<Parameter<T, Space>*>& out) {
    out.push_back(&weight_);
    for (auto& b : bias_) out.push_back(&b);
  }

 private:
  template <class XV, class DYV>
  void weight_gemm(const XV& x, const DYV& dy) {
    ops::gemm(ops::Trans::T, ops::Trans::N, T(1), x, dy, T(1), weight_.grad_matrix());
  }

  ContextPtr ctx_;
  Parameter<T, Space> weight_;
  std::vector<Parameter<T, Space>> bias_;  // zero or one: Parameter has no empty state
};

}  // namespace weft::nn
