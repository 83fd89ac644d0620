// nn::Attention: causal multi-head self-attention with a fused QKV projection,
// optional grouped-query heads and rotary positions. Heads are column ranges
// of the fused matrix and each (sequence, head) product is one BLAS call, so
// no head is ever copied or transposed. Over a tensor-parallel axis each rank
// holds heads / tp query heads and kv_heads / tp key/value heads: QKV is
// column-parallel (each rank's Q, K and V columns are its heads'), the output
// projection row-parallel, and one all-reduce (or, with sequence parallelism,
// an all-gather before QKV and a reduce-scatter after the projection) joins
// the ranks in each direction.
#pragma once

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <vector>

#include <weft/nn/config.hpp>
#include <weft/nn/linear.hpp>
#include <weft/nn/sequence_attention.hpp>
#include <weft/nn/tp_comm.hpp>
#include <weft/ops/flash_attention.hpp>
#include <weft/ops/rotary.hpp>
#include <weft/ops/softmax.hpp>

namespace weft::nn {

namespace detail {
/// Whether nn::Attention uses the blockwise kernel (ops/flash_attention.hpp)
/// rather than per-head BLAS products around a softmax over stored [T, T]
/// probabilities, for the local config `local` (one TP rank's heads, one
/// microbatch) and elements of T. Measured on one CPU thread at T = 128 to
/// 4096 (bench_train_step --attention-seqs, docs/model.md), the BLAS path is
/// 3 to 6 times faster, so AttentionKernel::automatic keeps it unless one
/// block's probabilities exceed local.attention_budget bytes; blas and
/// blockwise choose. The blockwise kernel needs head_dim <= 256 (a larger
/// head falls back to BLAS). Compiling with WEFT_ATTENTION_KERNEL=1 forces
/// the blockwise kernel, =0 the BLAS path.
template <class T>
inline bool use_blockwise_attention(const GPTConfig& local) {
  const bool fits = local.head_dim() <= ops::detail::flash_max_head_dim;
#if defined(WEFT_ATTENTION_KERNEL)
  return WEFT_ATTENTION_KERNEL && fits;
#else
  switch (local.attention) {
    case AttentionKernel::blas: return false;
    case AttentionKernel::blockwise: return fits;
    case AttentionKernel::automatic: break;
  }
  const double probs = double(local.batch) * double(local.heads) * double(local.seq) * double(local.seq) * sizeof(T);
  return fits && probs > local.attention_budget;
#endif
}
/// Whether the attention keeps [T, T] probabilities (the BLAS path of whole
/// sequences); the blockwise kernel and context parallelism keep none.
template <class T>
inline bool keeps_probabilities(const GPTConfig& local) {
  return !use_blockwise_attention<T>(local) && local.seq_shards == 1;
}
}  // namespace detail

/// Causal self-attention of one block.
template <class T, class Space = Kokkos::DefaultExecutionSpace>
class Attention {
 public:
  /// Activations the backward pass needs: the projected (and rotated) Q, K, V;
  /// the attention probabilities with each row's log-sum-exp; and the heads'
  /// outputs before the output projection (this rank's heads only); with
  /// sequence parallelism also the gathered input.
  struct Saved {
    ops::Matrix<T, Space> qkv;    ///< [tokens, (D + 2 kv hd) / tp]
    ops::Tensor3<T, Space> probs; ///< [batch * heads / tp, T, T]; empty with the blockwise kernel
    ops::Matrix<T, Space> lse;    ///< [batch * heads / tp, T]
    ops::Matrix<T, Space> heads;  ///< [tokens, D / tp]
    ops::Matrix<T, Space> input;  ///< sequence parallelism: [tokens, D], the all-gathered input; else empty
    Saved() = default;
    /// For the global config c split over tp.
    Saved(const std::string& n, const GPTConfig& c, const TensorSplit& tp = {})
        : Saved(n, c.local(tp.size()), c.d_model, tp.sp()) {}
    /// Bytes held.
    std::size_t bytes() const {
      return detail::bytes_of(qkv) + detail::bytes_of(probs) + detail::bytes_of(lse) + detail::bytes_of(heads) +
             detail::bytes_of(input);
    }

   private:
    Saved(const std::string& n, const GPTConfig& l, std::size_t d, bool sp)
        : qkv(n + ".qkv", l.tokens(), l.qkv_cols()),
          probs(!detail::keeps_probabilities<T>(l) ? ops::Tensor3<T, Space>()
                                                : ops::Tensor3<T, Space>(n + ".probs", l.batch * l.heads, l.seq, l.seq)),
          lse(n + ".lse", l.batch * l.heads, l.seq),
          heads(n + ".heads", l.tokens(), l.d_model),
          input(sp ? ops::Matrix<T, Space>(n + ".input", l.tokens(), d) : ops::Matrix<T, Space>()) {}
  };

  /// Scratch of the backward pass, shared by all blocks.
  struct Workspace {
    ops::Matrix<T, Space> dqkv, dheads;
    ops::Tensor3<T, Space> dprobs;
    ops::Matrix<T, Space> full;  ///< sequence parallelism: [tokens, D] gathered gradients and partial sums
    Workspace() = default;
    /// For the global config c split over tp.
    explicit Workspace(const GPTConfig& c, const TensorSplit& tp = {}) : Workspace(c.local(tp.size()), c.d_model, tp.sp()) {}
    /// Bytes held.
    std::size_t bytes() const {
      return detail::bytes_of(dqkv) + detail::bytes_of(dheads) + detail::bytes_of(dprobs) + detail::bytes_of(full);
    }

   private:
    Workspace(const GPTConfig& l, std::size_t d, bool sp)
        : dqkv("attn.dqkv", l.tokens(), l.qkv_cols()),
          dheads("attn.dheads", l.tokens(), l.d_model),
          dprobs(!detail::keeps_probabilities<T>(l) ? ops::Tensor3<T, Space>()
                                                 : ops::Tensor3<T, Space>("attn.dprobs", l.batch * l.heads, l.seq, l.seq)),
          full(sp ? ops::Matrix<T, Space>("attn.full", l.tokens(), d) : ops::Matrix<T, Space>()) {}
  };

  /// Parameters "<name>.qkv.{weight,bias}" and "<name>.proj.{weight,bias}"
  /// (this rank's part of them over the context's TP axis). With `cp` (and
  /// c a rank's share of every sequence, GPTConfig::local_sequence), each
  /// sequence's attention runs over the CP axis.
  Attention(ContextPtr ctx, const std::string& name, const GPTConfig& c, const ContextParallel<T, Space>* cp = nullptr)
      : ctx_(ctx),
        cfg_(c.local(ctx->tp.size())),
        qkv_(ctx, name + ".qkv", c.d_model, c.qkv_cols(), true, c.seed, c.init_std,
             LinearSplit::column(ctx->tp.size(), ctx->tp.rank(),
                                 {c.d_model, c.kv() * c.head_dim(), c.kv() * c.head_dim()})),
        proj_(ctx, name + ".proj", c.d_model, c.d_model, true, c.seed, c.init_std / std::sqrt(2.0 * double(c.layers)),
              LinearSplit::row(ctx->tp.size(), ctx->tp.rank())) {
    if (cfg_.seq_shards > 1) {
      WEFT_REQUIRE(cp && cp->make && cp->size() == cfg_.seq_shards, ConfigError, "nn::Attention ", name,
                   ": the config is a share of 1/", cfg_.seq_shards,
                   " of every sequence but no context-parallel attention over that many ranks was given");
      cp_ = cp;
      cp_->make(cfg_.heads, cfg_.kv(), cfg_.global_seq(), cfg_.head_dim());  // its size checks, now
    }
  }

  /// Bytes the context-parallel attention keeps of its own from forward to backward (0 without CP).
  std::size_t context_bytes() const {
    std::size_t n = 0;
    for (const auto& [key, v] : seq_attn_)
      for (const auto& a : v) n += a->owned_bytes();
    return n;
  }

  /// The most bytes of exchange buffers the context-parallel attention has
  /// held at once (one sequence at a time, so a peak over its sequences;
  /// 0 without CP).
  std::size_t context_buffer_bytes() const {
    std::size_t n = 0;
    for (const auto& [key, v] : seq_attn_)
      for (const auto& a : v) n = std::max(n, a->peak_buffer_bytes());
    return n;
  }

  /// out = proj(attention(qkv(h))), filling s. h, out: [rows, D], where rows
  /// are the tokens, or this rank's token shard under sequence parallelism
  /// (w is then needed for the partial sums).
  template <class HV, class OV>
  void forward(const HV& h, const Saved& s, const OV& out, const Workspace* w = nullptr) const {
    const TensorSplit& tp = ctx_->tp;
    if (tp.sp()) {
      detail::tp_all_gather_operand<Space>(*ctx_, h, s.input);  // read by the QKV products only
      qkv_.forward(s.input, s.qkv);
    } else {
      qkv_.forward(h, s.qkv);
    }
    if (cfg_.position == PositionKind::rotary) rotate(s.qkv, false);
    const std::size_t H = cfg_.heads, hd = cfg_.head_dim();
    if (cp_) {
      metrics::Profiler::Scope sc(ctx_->profiler, "attention.context");
      const std::size_t kv = cfg_.kv(), D = cfg_.d_model;
      auto& sa = sequence_attention(s);
      for (std::size_t b = 0; b < cfg_.batch; ++b)
        sa[b]->forward(heads_view(s.qkv, b, 0, H), heads_view(s.qkv, b, D, kv),
                              heads_view(s.qkv, b, D + kv * hd, kv), T(1) / std::sqrt(T(hd)),
                              heads_view(s.heads, b, 0, H), lse_of(s.lse, b));
      detail::row_parallel_forward(*ctx_, proj_, s.heads, out, w ? &w->full : nullptr, "nn::Attention");
      return;
    }
    if (detail::use_blockwise_attention<T>(cfg_)) {
      metrics::Profiler::Scope sc(ctx_->profiler, "attention");
      for (std::size_t b = 0; b < cfg_.batch; ++b)
        ops::flash_attention_forward(heads_view(s.qkv, b, 0, H), heads_view(s.qkv, b, cfg_.d_model, cfg_.kv()),
                                     heads_view(s.qkv, b, cfg_.d_model + cfg_.kv() * hd, cfg_.kv()),
                                     T(1) / std::sqrt(T(hd)), true, heads_view(s.heads, b, 0, H),
                                     Kokkos::subview(s.lse, std::make_pair(b * H, (b + 1) * H), Kokkos::ALL));
      detail::row_parallel_forward(*ctx_, proj_, s.heads, out, w ? &w->full : nullptr, "nn::Attention");
      return;
    }
    with_operand_type([&]<class O>() { forward_blas<O>(s); });
    detail::row_parallel_forward(*ctx_, proj_, s.heads, out, w ? &w->full : nullptr, "nn::Attention");
  }

  /// dh = d/dh (overwritten) from dout; parameter gradients accumulate. h,
  /// dout and dh have the rows of forward.
  template <class HV, class DOV, class DHV>
  void backward(const HV& h, const Saved& s, const DOV& dout, const DHV& dh, const Workspace& w) {
    const TensorSplit& tp = ctx_->tp;
    detail::row_parallel_backward(*ctx_, proj_, s.heads, dout, w.dheads, w.full);
    const std::size_t H = cfg_.heads, hd = cfg_.head_dim();
    Kokkos::deep_copy(w.dqkv, T(0));  // K and V gradients sum over the query heads of a group
    if (cp_) {
      metrics::Profiler::Scope sc(ctx_->profiler, "attention.context");
      const std::size_t kv = cfg_.kv(), D = cfg_.d_model;
      auto& sa = sequence_attention(s);
      for (std::size_t b = 0; b < cfg_.batch; ++b)
        sa[b]->backward(heads_view(w.dheads, b, 0, H), heads_view(w.dqkv, b, 0, H),
                               heads_view(w.dqkv, b, D, kv), heads_view(w.dqkv, b, D + kv * hd, kv));
    } else if (detail::use_blockwise_attention<T>(cfg_)) {
      metrics::Profiler::Scope sc(ctx_->profiler, "attention");
      const std::size_t kv = cfg_.kv(), D = cfg_.d_model;
      for (std::size_t b = 0; b < cfg_.batch; ++b)
        ops::flash_attention_backward(
            heads_view(s.qkv, b, 0, H), heads_view(s.qkv, b, D, kv), heads_view(s.qkv, b, D + kv * hd, kv),
            heads_view(s.heads, b, 0, H), heads_view(w.dheads, b, 0, H),
            Kokkos::subview(s.lse, std::make_pair(b * H, (b + 1) * H), Kokkos::ALL), T(1) / std::sqrt(T(hd)), true,
            heads_view(w.dqkv, b, 0, H), heads_view(w.dqkv, b, D, kv), heads_view(w.dqkv, b, D + kv * hd, kv));
    } else {
      with_operand_type([&]<class O>() { backward_blas<O>(s, w); });
    }
    if (cfg_.position == PositionKind::rotary) rotate(w.dqkv, true);
    if (!tp.active()) {
      qkv_.backward(h, w.dqkv, dh, false);
    } else if (!tp.sp()) {
      qkv_.backward(h, w.dqkv, dh, false);  // this rank's heads' part of dh
      detail::tp_all_reduce(*ctx_, dh);
    } else {
      qkv_.backward(s.input, w.dqkv, w.full, false);
      detail::tp_reduce_scatter(*ctx_, w.full, dh);
    }
  }

  /// Appends pointers to this layer's parameters.
  void collect(std::vector<Parameter<T, Space>*>& out) {
    qkv_.collect(out);
    proj_.collect(out);
  }

 private:
  // The BLAS path's products take operands of type O: T itself (fp32
  // products, and any T but float), or under 2-byte products (a mixed
  // Precision, LayerContext::products) the 2-byte type, as nn::Linear's
  // products do: each operand is rounded once to O into the model's product
  // staging (slot 3: Q, K and V of every head; 4: the heads' output
  // gradient; 5: one head's probabilities, or their gradient), and the
  // product accumulates in float into T. The softmax, its log-sum-exp and
  // every gradient stay T.
  template <class F>
  void with_operand_type(F&& f) const {
    if constexpr (std::is_same_v<T, float>) {
      if (ctx_->products == ProductPrecision::bf16) return f.template operator()<bf16>();
      if (ctx_->products == ProductPrecision::fp16) return f.template operator()<fp16>();
    }
    f.template operator()<T>();
  }
  // src itself when O is its type, else src rounded to O in staging slot `slot`.
  template <class O, class V>
  auto operand(int slot, const V& src) const {
    if constexpr (std::is_same_v<O, typename V::non_const_value_type>) {
      return src;
    } else {
      return product_staging<Space>(*ctx_).template rounded<O>(slot, src);
    }
  }
  // Head hh of sequence b of a [batch * heads, T, T] tensor.
  auto block(const ops::Tensor3<T, Space>& t, std::size_t b, std::size_t hh) const {
    return Kokkos::subview(t, b * cfg_.heads + hh, Kokkos::ALL, Kokkos::ALL);
  }

  /// The BLAS path's forward: per head S = Q K^T, the softmax of S into
  /// s.probs (with s.lse), O = P V into s.heads.
  template <class O>
  void forward_blas(const Saved& s) const {
    const std::size_t H = cfg_.heads, hd = cfg_.head_dim();
    const auto qkv = operand<O>(3, s.qkv);
    {
      metrics::Profiler::Scope sc(ctx_->profiler, "gemm.attention");
      for (std::size_t b = 0; b < cfg_.batch; ++b)
        for (std::size_t hh = 0; hh < H; ++hh)
          ops::gemm(ops::Trans::N, ops::Trans::T, T(1), q(qkv, b, hh), k(qkv, b, hh), T(0), block(s.probs, b, hh));
    }
    {
      metrics::Profiler::Scope sc(ctx_->profiler, "softmax");
      ops::softmax_forward(s.probs, T(1) / std::sqrt(T(hd)), true, s.probs, s.lse);
    }
    {
      metrics::Profiler::Scope sc(ctx_->profiler, "gemm.attention");
      for (std::size_t b = 0; b < cfg_.batch; ++b)
        for (std::size_t hh = 0; hh < H; ++hh)
          ops::gemm(ops::Trans::N, ops::Trans::N, T(1), operand<O>(5, block(s.probs, b, hh)), v(qkv, b, hh), T(0),
                    head(s.heads, b, hh));
    }
  }

  /// The BLAS path's backward from the output gradient in w.dheads to w.dqkv.
  template <class O>
  void backward_blas(const Saved& s, const Workspace& w) const {
    const std::size_t H = cfg_.heads, hd = cfg_.head_dim();
    const auto qkv = operand<O>(3, s.qkv);
    const auto dheads = operand<O>(4, w.dheads);
    {
      metrics::Profiler::Scope sc(ctx_->profiler, "gemm.attention");
      for (std::size_t b = 0; b < cfg_.batch; ++b)
        for (std::size_t hh = 0; hh < H; ++hh) {
          const auto dO = head(dheads, b, hh);
          ops::gemm(ops::Trans::T, ops::Trans::N, T(1), operand<O>(5, block(s.probs, b, hh)), dO, T(1),
                    v(w.dqkv, b, hh));
          ops::gemm(ops::Trans::N, ops::Trans::T, T(1), dO, v(qkv, b, hh), T(0), block(w.dprobs, b, hh));
        }
    }
    {
      metrics::Profiler::Scope sc(ctx_->profiler, "softmax");
      ops::softmax_backward(s.probs, w.dprobs, T(1) / std::sqrt(T(hd)), w.dprobs, true);
    }
    {
      metrics::Profiler::Scope sc(ctx_->profiler, "gemm.attention");
      for (std::size_t b = 0; b < cfg_.batch; ++b)
        for (std::size_t hh = 0; hh < H; ++hh) {
          const auto dS = operand<O>(5, block(w.dprobs, b, hh));
          ops::gemm(ops::Trans::N, ops::Trans::N, T(1), dS, k(qkv, b, hh), T(0), q(w.dqkv, b, hh));
          ops::gemm(ops::Trans::T, ops::Trans::N, T(1), dS, q(qkv, b, hh), T(1), k(w.dqkv, b, hh));
        }
    }
  }

  /// Heads [first_col / hd, +count) of sequence b of a [tokens, cols] matrix
  /// as a [count, T, hd] view over it (no copy): the blockwise kernel's operands.
  template <class M>
  auto heads_view(const M& m, std::size_t b, std::size_t first_col, std::size_t count) const {
    using V = Kokkos::View<typename M::value_type***, Kokkos::LayoutStride, typename M::device_type,
                           Kokkos::MemoryTraits<Kokkos::Unmanaged>>;
    const std::size_t hd = cfg_.head_dim();
    // Pointer arithmetic, not &m(i, j): the host must not evaluate an element
    // of a view that may live in device memory.
    return V(m.data() + b * cfg_.seq * m.stride(0) + first_col * m.stride(1),
             Kokkos::LayoutStride(count, hd, cfg_.seq, m.stride(0), hd, 1));
  }
  /// The context-parallel attention of every sequence whose activations are
  /// `s`: one set per Saved (a pipeline keeps one per in-flight microbatch,
  /// and each set keeps its forward's state until its backward).
  std::vector<std::unique_ptr<SequenceAttention<T, Space>>>& sequence_attention(const Saved& s) const {
    auto& v = seq_attn_[s.qkv.data()];
    if (v.empty())
      for (std::size_t b = 0; b < cfg_.batch; ++b)
        v.push_back(cp_->make(cfg_.heads, cfg_.kv(), cfg_.global_seq(), cfg_.head_dim()));
    return v;
  }
  /// Rows [b H, (b + 1) H) of the [batch * heads, T] log-sum-exp.
  template <class M>
  typename SequenceAttention<T, Space>::View2 lse_of(const M& m, std::size_t b) const {
    const std::size_t H = cfg_.heads;
    return typename SequenceAttention<T, Space>::View2(
        m.data() + b * H * m.stride(0), Kokkos::LayoutStride(H, m.stride(0), cfg_.seq, m.stride(1)));
  }
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
    if (cfg_.seq_shards > 1) {
      // Each of this rank's two chunks of every sequence has its own global offset.
      const std::size_t P = cfg_.seq_shards, r = ctx_->cp.rank(), C = cfg_.seq / 2;
      for (std::size_t b = 0; b < cfg_.batch; ++b)
        for (std::size_t part = 0; part < 2; ++part) {
          auto rows = Kokkos::subview(m, std::make_pair(b * cfg_.seq + part * C, b * cfg_.seq + (part + 1) * C), Kokkos::ALL);
          const std::size_t off = (part == 0 ? r : 2 * P - 1 - r) * C;
          ops::rotary_apply(rows, {.col_begin = 0, .heads = cfg_.heads, .head_dim = hd, .seq = C, .offset = off,
                                   .base = cfg_.rope_base}, inverse);
          ops::rotary_apply(rows, {.col_begin = cfg_.d_model, .heads = cfg_.kv(), .head_dim = hd, .seq = C,
                                   .offset = off, .base = cfg_.rope_base}, inverse);
        }
      return;
    }
    ops::rotary_apply(m, {.col_begin = 0, .heads = cfg_.heads, .head_dim = hd, .seq = cfg_.seq, .offset = 0,
                          .base = cfg_.rope_base}, inverse);
    ops::rotary_apply(m, {.col_begin = cfg_.d_model, .heads = cfg_.kv(), .head_dim = hd, .seq = cfg_.seq, .offset = 0,
                          .base = cfg_.rope_base}, inverse);
  }

  ContextPtr ctx_;
  GPTConfig cfg_;
  Linear<T, Space> qkv_, proj_;
  const ContextParallel<T, Space>* cp_ = nullptr;  // context parallelism (the model's; null: none)
  mutable std::map<const T*, std::vector<std::unique_ptr<SequenceAttention<T, Space>>>> seq_attn_;  // per Saved, per sequence
};

}  // namespace weft::nn
