// nn::Attention: causal multi-head self-attention with a fused QKV projection,
// optional grouped-query heads and rotary positions. Heads are column ranges
// of the fused matrix and each (sequence, head) product is one BLAS call, so
// no head is ever copied or transposed.
#pragma once

#include <cmath>

#include <weft/nn/config.hpp>
#include <weft/nn/linear.hpp>
#include <weft/ops/rotary.hpp>
#include <weft/ops/softmax.hpp>

namespace weft::nn {

/// Causal self-attention of one block.
template <class T, class Space = Kokkos::DefaultExecutionSpace>
class Attention {
 public:
  /// Activations the backward pass needs: the projected (and rotated) Q, K, V;
  /// the attention probabilities with each row's log-sum-exp; and the heads'
  /// outputs before the output projection.
  struct Saved {
    ops::Matrix<T, Space> qkv;    ///< [tokens, D + 2 kv hd]
    ops::Tensor3<T, Space> probs; ///< [batch * heads, T, T]
    ops::Matrix<T, Space> lse;    ///< [batch * heads, T]
    ops::Matrix<T, Space> heads;  ///< [tokens, D]
    Saved() = default;
    Saved(const std::string& n, const GPTConfig& c)
        : qkv(n + ".qkv", c.tokens(), c.qkv_cols()),
          probs(n + ".probs", c.batch * c.heads, c.seq, c.seq),
          lse(n + ".lse", c.batch * c.heads, c.seq),
          heads(n + ".heads", c.tokens(), c.d_model) {}
    /// Bytes held.
    std::size_t bytes() const {
      return detail::bytes_of(qkv) + detail::bytes_of(probs) + detail::bytes_of(lse) + detail::bytes_of(heads);
    }
  };

  /// Scratch of the backward pass, shared by all blocks.
  struct Workspace {
    ops::Matrix<T, Space> dqkv, dheads;
    ops::Tensor3<T, Space> dprobs;
    Workspace() = default;
    explicit Workspace(const GPTConfig& c)
        : dqkv("attn.dqkv", c.tokens(), c.qkv_cols()),
          dheads("attn.dheads", c.tokens(), c.d_model),
          dprobs("attn.dprobs", c.batch * c.heads, c.seq, c.seq) {}
    /// Bytes held.
    std::size_t bytes() const { return detail::bytes_of(dqkv) + detail::bytes_of(dheads) + detail::bytes_of(dprobs); }
  };

  /// Parameters "<name>.qkv.{weight,bias}" and "<name>.proj.{weight,bias}".
  Attention(ContextPtr ctx, const std::string& name, const GPTConfig& c)
      : ctx_(ctx),
        cfg_(c),
        qkv_(ctx, name + ".qkv", c.d_model, c.qkv_cols(), true, c.seed, c.init_std),
        proj_(ctx, name + ".proj", c.d_model, c.d_model, true, c.seed, c.init_std / std::sqrt(2.0 * double(c.layers))) {}

  /// out = proj(attention(qkv(h))), filling s. h, out: [tokens, D].
  template <class HV, class OV>
  void forward(const HV& h, const Saved& s, const OV& out) const {
    qkv_.forward(h, s.qkv);
    if (cfg_.position == PositionKind::rotary) rotate(s.qkv, false);
    const std::size_t H = cfg_.heads, hd = cfg_.head_dim();
    {
      metrics::Profiler::Scope sc(ctx_->profiler, "gemm.attention");
      for (std::size_t b = 0; b < cfg_.batch; ++b)
        for (std::size_t hh = 0; hh < H; ++hh)
          ops::gemm(ops::Trans::N, ops::Trans::T, T(1), q(s.qkv, b, hh), k(s.qkv, b, hh), T(0),
                    Kokkos::subview(s.probs, b * H + hh, Kokkos::ALL, Kokkos::ALL));
    }
    {
      metrics::Profiler::Scope sc(ctx_->profiler, "softmax");
      ops::softmax_forward(s.probs, T(1) / std::sqrt(T(hd)), true, s.probs, s.lse);
    }
    {
      metrics::Profiler::Scope sc(ctx_->profiler, "gemm.attention");
      for (std::size_t b = 0; b < cfg_.batch; ++b)
        for (std::size_t hh = 0; hh < H; ++hh)
          ops::gemm(ops::Trans::N, ops::Trans::N, T(1), Kokkos::subview(s.probs, b * H + hh, Kokkos::ALL, Kokkos::ALL),
                    v(s.qkv, b, hh), T(0), head(s.heads, b, hh));
    }
    proj_.forward(s.heads, out);
  }

  /// dh = d/dh (overwritten) from dout; parameter gradients accumulate.
  template <class HV, class DOV, class DHV>
  void backward(const HV& h, const Saved& s, const DOV& dout, const DHV& dh, const Workspace& w) {
    proj_.backward(s.heads, dout, w.dheads, false);
    const std::size_t H = cfg_.heads, hd = cfg_.head_dim();
    Kokkos::deep_copy(w.dqkv, T(0));  // K and V gradients sum over the query heads of a group
    {
      metrics::Profiler::Scope sc(ctx_->profiler, "gemm.attention");
      for (std::size_t b = 0; b < cfg_.batch; ++b)
        for (std::size_t hh = 0; hh < H; ++hh) {
          auto P = Kokkos::subview(s.probs, b * H + hh, Kokkos::ALL, Kokkos::ALL);
          auto dP = Kokkos::subview(w.dprobs, b * H + hh, Kokkos::ALL, Kokkos::ALL);
          auto dO = head(w.dheads, b, hh);
          ops::gemm(ops::Trans::T, ops::Trans::N, T(1), P, dO, T(1), v(w.dqkv, b, hh));
          ops::gemm(ops::Trans::N, ops::Trans::T, T(1), dO, v(s.qkv, b, hh), T(0), dP);
        }
    }
    {
      metrics::Profiler::Scope sc(ctx_->profiler, "softmax");
      ops::softmax_backward(s.probs, w.dprobs, T(1) / std::sqrt(T(hd)), w.dprobs);
    }
    {
      metrics::Profiler::Scope sc(ctx_->profiler, "gemm.attention");
      for (std::size_t b = 0; b < cfg_.batch; ++b)
        for (std::size_t hh = 0; hh < H; ++hh) {
          auto dS = Kokkos::subview(w.dprobs, b * H + hh, Kokkos::ALL, Kokkos::ALL);
          ops::gemm(ops::Trans::N, ops::Trans::N, T(1), dS, k(s.qkv, b, hh), T(0), q(w.dqkv, b, hh));
          ops::gemm(ops::Trans::T, ops::Trans::N, T(1), dS, q(s.qkv, b, hh), T(1), k(w.dqkv, b, hh));
        }
    }
    if (cfg_.position == PositionKind::rotary) rotate(w.dqkv, true);
    qkv_.backward(h, w.dqkv, dh, false);
  }

  /// Appends pointers to this layer's parameters.
  void collect(std::vector<Parameter<T, Space>*>& out) {
    qkv_.collect(out);
    proj_.collect(out);
  }

 private:
  using Pair = std::pair<std::size_t, std::size_t>;
  Pair rows(std::size_t b) const { return {b * cfg_.seq, (b + 1) * cfg_.seq}; }
  Pair cols(std::size_t c0) const { return {c0, c0 + cfg_.head_dim()}; }
  std::size_t group(std::size_t hh) const { return hh / (cfg_.heads / cfg_.kv()); }
  template <class M>
  auto q(const M& m, std::size_t b, std::size_t hh) const {
    return Kokkos::subview(m, rows(b), cols(hh * cfg_.head_dim()));
  }
  template <class M>
  auto k(const M& m, std::size_t b, std::size_t hh) const {
    return Kokkos::subview(m, rows(b), cols(cfg_.d_model + group(hh) * cfg_.head_dim()));
  }
  template <class M>
  auto v(const M& m, std::size_t b, std::size_t hh) const {
    return Kokkos::subview(m, rows(b), cols(cfg_.d_model + (cfg_.kv() + group(hh)) * cfg_.head_dim()));
  }
  template <class M>
  auto head(const M& m, std::size_t b, std::size_t hh) const {
    return Kokkos::subview(m, rows(b), cols(hh * cfg_.head_dim()));
  }
  template <class M>
  void rotate(const M& m, bool inverse) const {
    metrics::Profiler::Scope sc(ctx_->profiler, "rotary");
    const std::size_t hd = cfg_.head_dim();
    ops::rotary_apply(m, {.col_begin = 0, .heads = cfg_.heads, .head_dim = hd, .seq = cfg_.seq, .offset = 0,
                          .base = cfg_.rope_base}, inverse);
    ops::rotary_apply(m, {.col_begin = cfg_.d_model, .heads = cfg_.kv(), .head_dim = hd, .seq = cfg_.seq, .offset = 0,
                          .base = cfg_.rope_base}, inverse);
  }

  ContextPtr ctx_;
  GPTConfig cfg_;
  Linear<T, Space> qkv_, proj_;
};

}  // namespace weft::nn
