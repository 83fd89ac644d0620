// nn::Linear: y = x W + b with W stored [in, out] (so the forward product is
// a plain NN gemm) and explicit backward. It saves nothing itself: its
// backward needs the input x, which the caller already keeps.
#pragma once

#include <utility>
#include <vector>

#include <weft/nn/parameter.hpp>
#include <weft/ops/elementwise.hpp>
#include <weft/ops/gemm.hpp>
#include <weft/ops/random.hpp>
#include <weft/precision/convert.hpp>

namespace weft::nn {

/// How a Linear's weight W [in, out] is split over the tensor-parallel axis.
///  - none: the whole layer (single process, or a TP size of 1).
///  - column: the output features are split (column-parallel; Megatron's
///    "column"): each rank holds W[:, its columns] and the bias' columns. The
///    output columns may form several segments split separately (the fused
///    Q | K | V projection, SwiGLU's gate | value) so that each rank holds
///    matching pieces of every segment, laid side by side.
///  - row: the input features are split (row-parallel): each rank holds
///    W[its rows, :]; its product is a partial sum, and the bias (whole on
///    every rank) is added by add_bias() after the reduction.
struct LinearSplit {
  /// The kind of split.
  enum class Kind { none, column, row };
  Kind kind = Kind::none;       ///< which dimension of W is split
  std::size_t parts = 1;        ///< TP ranks
  std::size_t index = 0;        ///< this rank
  std::vector<std::size_t> segments;  ///< column: global widths of the output segments (empty: one)

  /// A column split of segments (empty: the whole output is one segment).
  static LinearSplit column(std::size_t parts, std::size_t index, std::vector<std::size_t> segments = {}) {
    return LinearSplit{parts > 1 ? Kind::column : Kind::none, parts, index, std::move(segments)};
  }
  /// A row split.
  static LinearSplit row(std::size_t parts, std::size_t index) {
    return LinearSplit{parts > 1 ? Kind::row : Kind::none, parts, index, {}};
  }
};

/// A dense layer with optional bias. Its three products (forward, input
/// gradient, weight gradient) run in the context's ProductPrecision
/// (LayerContext::products): fp32, or bf16 / fp16 operands accumulated in fp32.
template <class T, class Space = Kokkos::DefaultExecutionSpace>
class Linear {
 public:
  /// The Space the layer was instantiated with (its views' and its product staging's).
  using space_type = Space;
  /// Parameters "<name>.weight" [in, out] ~ N(0, init_std^2) and, with `bias`,
  /// "<name>.bias" [out] = 0, drawn from (seed, name, global index). `in` and
  /// `out` are the global sizes; with a split this rank holds its part, with
  /// exactly the values the whole layer has at those global indices.
  Linear(ContextPtr ctx, const std::string& name, std::size_t in, std::size_t out, bool bias, std::uint64_t seed,
         double init_std, LinearSplit split = {})
      : ctx_(std::move(ctx)),
        split_(checked(name, in, out, std::move(split))),
        weight_(name + ".weight", split_.kind == LinearSplit::Kind::row ? in / split_.parts : in,
                split_.kind == LinearSplit::Kind::column ? out / split_.parts : out, true) {
    using K = LinearSplit::Kind;
    if (split_.kind == K::none) {
      ops::init_normal(weight_.matrix(), seed, weight_.name(), init_std);
    } else if (split_.kind == K::row) {
      ops::init_normal(weight_.matrix(), seed, weight_.name(), init_std,
                       {.row0 = split_.index * weight_.rows(), .col0 = 0, .global_cols = out});
    } else {
      std::size_t global0 = 0, local0 = 0;
      for (std::size_t w : split_.segments) {
        const std::size_t piece = w / split_.parts;
        ops::init_normal(Kokkos::subview(weight_.matrix(), Kokkos::ALL, std::make_pair(local0, local0 + piece)), seed,
                         weight_.name(), init_std,
                         {.row0 = 0, .col0 = global0 + split_.index * piece, .global_cols = out});
        global0 += w;
        local0 += piece;
      }
    }
    weight_.set_tp_sharded(split_.kind != K::none);
    // The weight is read only by the three products, which round it to the
    // context's product type first.
    weight_.set_read_as(ctx_->products);
    // Where this rank's part lies in the whole layer (checkpoints address tensors by global indices).
    std::vector<GlobalBand> bands;
    if (split_.kind == K::row) {
      bands.push_back({split_.index * weight_.rows(), 0, weight_.rows(), out, 0});
    } else if (split_.kind == K::column) {
      std::size_t global0 = 0, local0 = 0;
      for (std::size_t w : split_.segments) {
        const std::size_t piece = w / split_.parts;
        bands.push_back({0, global0 + split_.index * piece, in, piece, local0});
        global0 += w;
        local0 += piece;
      }
    }
    if (!bands.empty()) weight_.set_global(in, out, bands);
    if (bias) {
      bias_.emplace_back(name + ".bias", 1, split_.kind == K::column ? out / split_.parts : out, false);
      Kokkos::deep_copy(bias_[0].value, T(0));
      bias_[0].set_read_as(ctx_->products);  // read as its compute copy (add_bias, read_bias)
      bias_[0].set_tp_sharded(split_.kind == K::column);
      if (split_.kind == K::column) {
        for (auto& b : bands) b.rows = 1;
        bias_[0].set_global(1, out, bands);
      }
    }
  }

  /// y = x W + b (y overwritten). x: [n, in], y: [n, out], both this rank's
  /// part (row-parallel: x holds this rank's input features and y is a
  /// partial sum without the bias; see add_bias).
  template <class XV, class YV>
  void forward(const XV& x, const YV& y) const {
    {
      metrics::Profiler::Scope s(ctx_->profiler, "gemm");
      product_xw(x, y);
    }
    if (!bias_.empty() && split_.kind != LinearSplit::Kind::row) add_bias(y);
  }

  /// y = x W without the bias (y overwritten), for a caller that fuses the
  /// bias into the kernel that follows (ops::bias_gelu_forward); bias() holds it.
  template <class XV, class YV>
  void forward_product(const XV& x, const YV& y) const {
    metrics::Profiler::Scope s(ctx_->profiler, "gemm");
    product_xw(x, y);
  }

  /// y += b: the bias of a row-parallel layer, added once to the reduced sum.
  template <class YV>
  void add_bias(const YV& y) const {
    if (bias_.empty()) return;
    metrics::Profiler::Scope s(ctx_->profiler, "bias");
    read_bias([&](const auto& b) { ops::bias_add(y, b); });
  }

  /// Calls f(b) with the bias as the layer computes with it: bias().value,
  /// or its 2-byte compute copy under a 2-byte product precision
  /// (ComputeCopies). For a caller that fuses the bias into its own kernel.
  template <class F>
  void read_bias(F&& f) const {
    copies_.read(bias_.at(0), *ctx_, std::forward<F>(f));
  }

  /// dW += x^T dy, db += colsum(dy), and dx = dy W^T (+= with accumulate_dx).
  /// Pass an empty dx (extent 0) when the input needs no gradient. With a
  /// split, x, dy and dx are this rank's parts: column-parallel dx is a partial
  /// sum over the TP ranks (the caller reduces it); row-parallel dy is the
  /// whole output gradient, so its bias gradient is complete on every rank.
  /// While the context defers weight gradients, dW's gemm is queued there
  /// instead (with a copy of dy; x must stay unchanged until the queue runs,
  /// or is copied too when the queue copies_inputs()).
  template <class XV, class DYV, class DXV>
  void backward(const XV& x, const DYV& dy, const DXV& dx, bool accumulate_dx = false) {
    backward_product(x, dy, dx, accumulate_dx);
    if (!bias_.empty()) {
      metrics::Profiler::Scope s(ctx_->profiler, "bias");
      ops::bias_backward(dy, bias_[0].grad);
    }
  }

  /// backward without the bias gradient, for a caller that has already added
  /// colsum(dy) to bias().grad in a fused kernel (ops::bias_gelu_backward).
  template <class XV, class DYV, class DXV>
  void backward_product(const XV& x, const DYV& dy, const DXV& dx, bool accumulate_dx = false) {
    {
      metrics::Profiler::Scope s(ctx_->profiler, "gemm");
      if (auto* work = ctx_->deferred_weight_grads) {
        auto kept = work->template take<ops::Matrix<T, Space>>(weight_.name() + ".deferred_dy", dy.extent(0),
                                                              dy.extent(1));
        Kokkos::deep_copy(kept, dy);
        if (work->copies_inputs()) {  // x is overwritten before the queue runs (a recomputing stage)
          auto kept_x = work->template take<ops::Matrix<T, Space>>(weight_.name() + ".deferred_x", x.extent(0),
                                                                  x.extent(1));
          Kokkos::deep_copy(kept_x, x);
          work->push([this, kept_x, kept] { backward_weight(kept_x, kept); });
        } else {
          work->push([this, x, kept] { backward_weight(x, kept); });
        }
      } else {
        if constexpr (std::is_same_v<T, float>) {
          // 2-byte products: dy rounded once for both
          if (ctx_->products == ProductPrecision::bf16) return staged_backward<bf16>(x, dy, dx, accumulate_dx);
          if (ctx_->products == ProductPrecision::fp16) return staged_backward<fp16>(x, dy, dx, accumulate_dx);
        }
        weight_gemm(x, dy);
      }
      if (dx.extent(0) != 0) product_dx(dy, dx, accumulate_dx);
    }
  }

  /// dW += x^T dy only: the weight-gradient half of backward.
  template <class XV, class DYV>
  void backward_weight(const XV& x, const DYV& dy) {
    metrics::Profiler::Scope s(ctx_->profiler, "gemm");
    weight_gemm(x, dy);
  }

  /// Input features held by this rank.
  std::size_t in() const { return weight_.rows(); }
  /// Output features held by this rank.
  std::size_t out() const { return weight_.cols(); }
  /// How the layer is split over the TP axis.
  const LinearSplit& split() const { return split_; }
  /// The weight.
  Parameter<T, Space>& weight() { return weight_; }
  /// Whether the layer has a bias.
  bool has_bias() const { return !bias_.empty(); }
  /// The bias (has_bias() must be true).
  Parameter<T, Space>& bias() { return bias_.at(0); }
  /// The bias, read-only (has_bias() must be true).
  const Parameter<T, Space>& bias() const { return bias_.at(0); }
  /// Appends pointers to this layer's parameters.
  void collect(std::vector<Parameter<T, Space>*>& out) {
    out.push_back(&weight_);
    for (auto& b : bias_) out.push_back(&b);
  }

 private:
  static LinearSplit checked(const std::string& name, std::size_t in, std::size_t out, LinearSplit s) {
    WEFT_REQUIRE(in > 0 && out > 0, ConfigError, "nn::Linear '", name, "': sizes ", in, " x ", out,
                 " must be positive");
    WEFT_REQUIRE(s.parts > 0 && s.index < s.parts, ConfigError, "nn::Linear '", name, "': shard ", s.index, " of ",
                 s.parts, " does not exist");
    if (s.kind == LinearSplit::Kind::column) {
      if (s.segments.empty()) s.segments.push_back(out);
      std::size_t total = 0;
      for (std::size_t w : s.segments) {
        WEFT_REQUIRE(w % s.parts == 0, ConfigError, "nn::Linear '", name, "' (column-parallel): output segment of ", w,
                     " features is not divisible by tp ", s.parts, "; weft does not pad");
        total += w;
      }
      WEFT_REQUIRE(total == out, ConfigError, "nn::Linear '", name, "': output segments sum to ", total,
                   " features, expected ", out);
    }
    if (s.kind == LinearSplit::Kind::row)
      WEFT_REQUIRE(in % s.parts == 0, ConfigError, "nn::Linear '", name, "' (row-parallel): ", in,
                   " input features are not divisible by tp ", s.parts, "; weft does not pad");
    return s;
  }

  // The three products, in the context's product precision. In fp32 (and for
  // a T other than float) they are the plain gemms. With 2-byte products each
  // operand is rounded once to H (weft::bf16 or weft::fp16) into the model's
  // staging slots and the product accumulates in float into the float output
  // (ops::gemm's provider rule: oneDNN's bf16 x bf16 -> f32 where it has one,
  // an exact widening otherwise). The weight's compute copy is made again for
  // every product that reads it, so it is never stale, whatever changed the
  // weight (an optimizer step, an FSDP gather, a checkpoint load).
  template <class XV, class YV>
  void product_xw(const XV& x, const YV& y) const {
    if constexpr (std::is_same_v<T, float>) {
      if (ctx_->products == ProductPrecision::bf16) return staged_xw<bf16>(x, y);
      if (ctx_->products == ProductPrecision::fp16) return staged_xw<fp16>(x, y);
    }
    ops::gemm(ops::Trans::N, ops::Trans::N, T(1), x, weight_.matrix(), T(0), y);
  }
  template <class DYV, class DXV>
  void product_dx(const DYV& dy, const DXV& dx, bool accumulate) const {
    if constexpr (std::is_same_v<T, float>) {
      if (ctx_->products == ProductPrecision::bf16) return staged_dx<bf16>(dy, dx, accumulate);
      if (ctx_->products == ProductPrecision::fp16) return staged_dx<fp16>(dy, dx, accumulate);
    }
    ops::gemm(ops::Trans::N, ops::Trans::T, T(1), dy, weight_.matrix(), T(accumulate ? 1 : 0), dx);
  }
  template <class XV, class DYV>
  void weight_gemm(const XV& x, const DYV& dy) {
    if constexpr (std::is_same_v<T, float>) {
      if (ctx_->products == ProductPrecision::bf16) return staged_dw<bf16>(x, dy);
      if (ctx_->products == ProductPrecision::fp16) return staged_dw<fp16>(x, dy);
    }
    ops::gemm(ops::Trans::T, ops::Trans::N, T(1), x, dy, T(1), weight_.grad_matrix());
  }

  ProductStaging<Space>& staging() const { return product_staging<Space>(*ctx_); }
  // Slot `slot` of the staging holding src rounded to H.
  template <class H, class V>
  MatrixRef<H, Space> staged(int slot, const V& src) const {
    return staging().template rounded<H>(slot, src);
  }
  template <class H, class XV, class YV>
  void staged_xw(const XV& x, const YV& y) const {
    const auto w = staged<H>(0, weight_.matrix());
    ops::gemm(ops::Trans::N, ops::Trans::N, 1.0f, staged<H>(1, x), w, 0.0f, y);
  }
  template <class H, class DYV, class DXV>
  void staged_dx(const DYV& dy, const DXV& dx, bool accumulate) const {
    const auto w = staged<H>(0, weight_.matrix());
    ops::gemm(ops::Trans::N, ops::Trans::T, 1.0f, staged<H>(2, dy), w, accumulate ? 1.0f : 0.0f, dx);
  }
  template <class H, class XV, class DYV, class DXV>
  void staged_backward(const XV& x, const DYV& dy, const DXV& dx, bool accumulate) {
    const auto dyh = staged<H>(2, dy);
    ops::gemm(ops::Trans::T, ops::Trans::N, 1.0f, staged<H>(1, x), dyh, 1.0f, weight_.grad_matrix());
    if (dx.extent(0) != 0)
      ops::gemm(ops::Trans::N, ops::Trans::T, 1.0f, dyh, staged<H>(0, weight_.matrix()), accumulate ? 1.0f : 0.0f, dx);
  }
  template <class H, class XV, class DYV>
  void staged_dw(const XV& x, const DYV& dy) {
    ops::gemm(ops::Trans::T, ops::Trans::N, 1.0f, staged<H>(1, x), staged<H>(2, dy), 1.0f, weight_.grad_matrix());
  }

  ContextPtr ctx_;
  LinearSplit split_;
  Parameter<T, Space> weight_;
  ComputeCopies<Space> copies_;  // reads the bias as computed with
  std::vector<Parameter<T, Space>> bias_;  // zero or one: Parameter has no empty state
};

}  // namespace weft::nn
