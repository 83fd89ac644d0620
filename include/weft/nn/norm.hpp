// nn::Norm: LayerNorm (scale and shift, GPT-2's) or RMSNorm (scale only) over
// the feature dimension. It saves one mean and one reciprocal standard
// deviation per row (Saved); its backward also needs the input x.
#pragma once

#include <weft/nn/parameter.hpp>
#include <weft/ops/norm.hpp>

namespace weft::nn {

/// Which normalisation a model uses.
enum class NormKind { layernorm, rmsnorm };

/// A normalisation layer with affine scale (and shift for LayerNorm).
template <class T, class Space = Kokkos::DefaultExecutionSpace>
class Norm {
 public:
  /// What the backward pass needs besides the input: per-row statistics.
  struct Saved {
    ops::Vector<T, Space> mean, rstd;  ///< [rows]; mean unused by RMSNorm
    Saved() = default;
    Saved(const std::string& name, std::size_t rows) : mean(name + ".mean", rows), rstd(name + ".rstd", rows) {}
    /// Bytes held.
    std::size_t bytes() const { return detail::bytes_of(mean) + detail::bytes_of(rstd); }
  };

  /// "<name>.weight" = 1 and, for LayerNorm, "<name>.bias" = 0, over d features.
  Norm(ContextPtr ctx, const std::string& name, NormKind kind, std::size_t d, double eps)
      : ctx_(std::move(ctx)), kind_(kind), eps_(eps), weight_(name + ".weight", 1, d, false) {
    Kokkos::deep_copy(weight_.value, T(1));
    weight_.set_read_as(ctx_->products);  // read as its compute copy (ComputeCopies)
    if (kind == NormKind::layernorm) {
      bias_.emplace_back(name + ".bias", 1, d, false);
      Kokkos::deep_copy(bias_[0].value, T(0));
      bias_[0].set_read_as(ctx_->products);
    }
  }

  /// y = norm(x), filling s.
  template <class XV, class YV>
  void forward(const XV& x, const YV& y, const Saved& s) const {
    metrics::Profiler::Scope sc(ctx_->profiler, "norm");
    if (kind_ == NormKind::layernorm)
      copies_.read(weight_, bias_[0], *ctx_, [&](const auto& g, const auto& b) {
        ops::layernorm_forward(x, g, b, T(eps_), y, s.mean, s.rstd);
      });
    else
      copies_.read(weight_, *ctx_, [&](const auto& g) { ops::rmsnorm_forward(x, g, T(eps_), y, s.rstd); });
  }

  /// dx = (accumulate ? dx : 0) + d/dx; parameter gradients accumulate.
  template <class DYV, class XV, class DXV>
  void backward(const DYV& dy, const XV& x, const Saved& s, const DXV& dx, bool accumulate) {
    metrics::Profiler::Scope sc(ctx_->profiler, "norm");
    copies_.read(weight_, *ctx_, [&](const auto& g) {
      if (kind_ == NormKind::layernorm)
        ops::layernorm_backward(dy, x, g, s.mean, s.rstd, dx, accumulate, weight_.grad, bias_[0].grad);
      else
        ops::rmsnorm_backward(dy, x, g, s.rstd, dx, accumulate, weight_.grad);
    });
  }

  /// Which normalisation this is.
  NormKind kind() const { return kind_; }
  /// Appends pointers to this layer's parameters.
  void collect(std::vector<Parameter<T, Space>*>& out) {
    out.push_back(&weight_);
    for (auto& b : bias_) out.push_back(&b);
  }

 private:
  ContextPtr ctx_;
  NormKind kind_;
  double eps_;
  Parameter<T, Space> weight_;
  std::vector<Parameter<T, Space>> bias_;
  ComputeCopies<Space> copies_;  // reads the scale and shift as computed with
};

}  // namespace weft::nn
