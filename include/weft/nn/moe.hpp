// nn::MoE: a mixture-of-experts MLP. A linear router scores each token
// against N experts (softmax or sigmoid), sends it to its top k, and the
// block's output is the gate-weighted sum of those experts' outputs (each an
// nn::MLP run as one gemm chain on its contiguous group of tokens), plus
// optional shared experts every token passes through. Capacity, drops, the
// balancing losses and the selection bias are defined in docs/moe.md.
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <optional>
#include <string>
#include <vector>

#include <weft/nn/linear.hpp>
#include <weft/nn/mlp.hpp>

namespace weft::nn {

/// Routing statistics of MoE layers, summed over the forward passes (and,
/// when merged, the layers) since the last reset.
struct MoEStats {
  std::vector<double> selected;  ///< per expert (per layer when merged): slots the router chose, before capacity
  double tokens = 0;             ///< tokens routed (each counted once per layer)
  double slots = 0;              ///< token-expert slots chosen: tokens x k
  double dropped = 0;            ///< slots over capacity, not computed
  double entropy_sum = 0;        ///< sum over tokens of the entropy (nats) of the normalised scores
  double aux_loss = 0;           ///< sum over passes of the load-balancing loss (with its coefficient)
  double z_loss = 0;             ///< sum over passes of the router z-loss (with its coefficient)
  std::size_t passes = 0;        ///< forward passes summed (layers x microbatches when merged)
  std::size_t layers = 0;        ///< layers merged (1 for one layer's own statistics)

  /// Whether anything was recorded.
  bool empty() const { return passes == 0; }
  /// Smallest count in `selected`.
  double min_tokens() const { return selected.empty() ? 0 : *std::min_element(selected.begin(), selected.end()); }
  /// Largest count in `selected`.
  double max_tokens() const { return selected.empty() ? 0 : *std::max_element(selected.begin(), selected.end()); }
  /// Mean count in `selected`.
  double mean_tokens() const {
    return selected.empty() ? 0 : std::accumulate(selected.begin(), selected.end(), 0.0) / double(selected.size());
  }
  /// max / mean of the per-expert counts (1: perfectly balanced).
  double imbalance() const { return mean_tokens() > 0 ? max_tokens() / mean_tokens() : 0; }
  /// Mean routing entropy per token and layer (nats; log N is uniform routing).
  double entropy() const { return tokens > 0 ? entropy_sum / tokens : 0; }
  /// Mean load-balancing loss per layer and pass.
  double mean_aux_loss() const { return passes ? aux_loss / double(passes) : 0; }
  /// Mean z-loss per layer and pass.
  double mean_z_loss() const { return passes ? z_loss / double(passes) : 0; }
  /// The load-balancing term of the objective: summed over the layers,
  /// mean over the forward passes of each layer (the microbatches).
  double aux_loss_term() const { return passes ? aux_loss * double(std::max<std::size_t>(layers, 1)) / double(passes) : 0; }
  /// The z-loss term of the objective, as aux_loss_term.
  double z_loss_term() const { return passes ? z_loss * double(std::max<std::size_t>(layers, 1)) / double(passes) : 0; }
  /// Appends another layer's statistics (its experts are appended to `selected`).
  void merge(const MoEStats& o) {
    selected.insert(selected.end(), o.selected.begin(), o.selected.end());
    tokens += o.tokens;
    slots += o.slots;
    dropped += o.dropped;
    entropy_sum += o.entropy_sum;
    aux_loss += o.aux_loss;
    z_loss += o.z_loss;
    passes += o.passes;
    layers += std::max<std::size_t>(o.layers, 1);
  }
};

/// The mixture-of-experts feed-forward part of a block, for one process: it
/// refuses tensor and context parallelism, and on a data-parallel rank its
/// capacity and bias counts would cover that rank's tokens only (docs/moe.md).
template <class T, class Space = Kokkos::DefaultExecutionSpace>
class MoE {
  using Mat = ops::Matrix<T, Space>;
  using Expert = MLP<T, Space>;

 public:
  /// Activations and routing of one forward pass, kept for backward. Rows of
  /// the grouped buffers are the kept token-expert slots ordered by expert,
  /// and by token index within an expert.
  struct Saved {
    Mat logits;  ///< [tokens, N] router logits u
    Mat xin;     ///< [tokens * k, D] inputs gathered by expert
    Mat eout;    ///< [tokens * k, D] expert outputs
    Mat up;      ///< [tokens * k, F or 2F] the experts' up-projections
    Mat act;     ///< [tokens * k, F] the experts' activations
    Kokkos::View<int*, Space> row_token;  ///< [tokens * k] token of each grouped row
    Kokkos::View<T*, Space> row_gate;     ///< [tokens * k] gate of each grouped row
    Kokkos::View<int*, Space> slot_row;   ///< [tokens * k] grouped row of slot t k + j (-1: dropped)
    std::vector<typename Expert::Saved> shared;  ///< the shared experts' activations
    Mat shared_out;                              ///< [tokens, D] one shared expert's output
    // Host copies of the routing decisions (small: tokens x N).
    std::vector<double> scores;          ///< [tokens * N] scores p (softmax or sigmoid of u)
    std::vector<double> u;               ///< [tokens * N] the logits u
    std::vector<double> lse;             ///< [tokens] logsumexp of u
    std::vector<int> slot_expert;        ///< [tokens * k] expert of slot t k + j (j-th choice of token t)
    std::vector<double> slot_gate;       ///< [tokens * k] gate of the slot
    std::vector<std::size_t> offsets;    ///< [N + 1] first grouped row of each expert
    std::vector<std::size_t> dropped;    ///< slots t k + j dropped by capacity, ascending
    std::vector<double> selected;        ///< [N] slots each expert was chosen for
    double aux = 0, z = 0;               ///< the losses of the pass (with their coefficients)

    Saved() = default;
    /// For config c (its tokens per forward pass).
    Saved(const std::string& n, const GPTConfig& c)
        : logits(n + ".logits", c.tokens(), c.experts),
          xin(n + ".xin", c.tokens() * c.top_k, c.d_model),
          eout(n + ".eout", c.tokens() * c.top_k, c.d_model),
          up(n + ".up", c.tokens() * c.top_k, c.expert_width() * (c.mlp == MlpKind::swiglu ? 2 : 1)),
          act(n + ".act", c.tokens() * c.top_k, c.expert_width()),
          row_token(n + ".row_token", c.tokens() * c.top_k),
          row_gate(n + ".row_gate", c.tokens() * c.top_k),
          slot_row(n + ".slot_row", c.tokens() * c.top_k),
          shared_out(c.shared_experts ? Mat(n + ".shared_out", c.tokens(), c.d_model) : Mat()) {
      const GPTConfig ec = expert_config(c);
      for (std::size_t i = 0; i < c.shared_experts; ++i) shared.emplace_back(n + ".shared." + std::to_string(i), ec);
    }
    /// Bytes held on the device.
    std::size_t bytes() const {
      std::size_t b = detail::bytes_of(logits) + detail::bytes_of(xin) + detail::bytes_of(eout) +
                      detail::bytes_of(up) + detail::bytes_of(act) + detail::bytes_of(row_token) +
                      detail::bytes_of(row_gate) + detail::bytes_of(slot_row) + detail::bytes_of(shared_out);
      for (const auto& s : shared) b += s.bytes();
      return b;
    }
  };

  /// Backward scratch.
  struct Workspace {
    Mat dslot;  ///< [tokens * k, D] gate-weighted output gradient per grouped row
    Mat dxin;   ///< [tokens * k, D] input gradient per grouped row
    Mat dup, dact;  ///< [tokens * k, ...] the experts' MLP scratch
    Mat du;     ///< [tokens, N] gradient of the router logits
    Kokkos::View<T*, Space> dgate;  ///< [tokens * k] d/d(gate) per slot
    Mat dtmp;   ///< [tokens, D] a shared expert's input gradient
    typename Expert::Workspace shared;  ///< the shared experts' scratch
    Workspace() = default;
    /// For config c.
    explicit Workspace(const GPTConfig& c)
        : dslot("moe.dslot", c.tokens() * c.top_k, c.d_model),
          dxin("moe.dxin", c.tokens() * c.top_k, c.d_model),
          dup("moe.dup", c.tokens() * c.top_k, c.expert_width() * (c.mlp == MlpKind::swiglu ? 2 : 1)),
          dact("moe.dact", c.tokens() * c.top_k, c.expert_width()),
          du("moe.du", c.tokens(), c.experts),
          dgate("moe.dgate", c.tokens() * c.top_k),
          dtmp(c.shared_experts ? Mat("moe.dtmp", c.tokens(), c.d_model) : Mat()),
          shared(c.shared_experts ? typename Expert::Workspace(expert_config(c)) : typename Expert::Workspace()) {}
    /// Bytes held.
    std::size_t bytes() const {
      return detail::bytes_of(dslot) + detail::bytes_of(dxin) + detail::bytes_of(dup) + detail::bytes_of(dact) +
             detail::bytes_of(du) + detail::bytes_of(dgate) + detail::bytes_of(dtmp) + shared.bytes();
    }
  };

  /// The config each expert MLP is built from: c with the expert's hidden width.
  static GPTConfig expert_config(const GPTConfig& c) {
    GPTConfig e = c;
    e.ffn_hidden = c.expert_width();
    return e;
  }

  /// Parameters "<name>.router.weight" [D, N] (no bias),
  /// "<name>.experts.<e>.{up,down}.{weight,bias}", "<name>.shared.<i>...."
  /// and the selection bias "<name>.router.expert_bias" [1, N] (zero at
  /// start). The selection bias is model state, not a trained weight: its
  /// gradient is always zero (so optimizers leave it alone) and
  /// update_bias() moves it; it is a Parameter so that it is saved and
  /// loaded wherever the weights are.
  MoE(ContextPtr ctx, const std::string& name, const GPTConfig& c)
      : ctx_(checked(std::move(ctx), name, c)),
        cfg_(c),
        router_(ctx_, name + ".router", c.d_model, c.experts, false, c.seed, c.init_std),
        bias_(name + ".router.expert_bias", 1, c.experts, false),
        step_counts_(c.experts, 0.0) {
    Kokkos::deep_copy(bias_.value, T(0));
    Kokkos::deep_copy(bias_.grad, T(0));
    const GPTConfig ec = expert_config(c);
    experts_.reserve(c.experts);
    for (std::size_t e = 0; e < c.experts; ++e) experts_.emplace_back(ctx_, name + ".experts." + std::to_string(e), ec);
    shared_.reserve(c.shared_experts);
    for (std::size_t i = 0; i < c.shared_experts; ++i) shared_.emplace_back(ctx_, name + ".shared." + std::to_string(i), ec);
    stats_.selected.assign(c.experts, 0.0);
    stats_.layers = 1;
  }

  /// Slots per expert for a microbatch of `tokens` tokens (all tokens of the
  /// microbatch, over every rank that shares it): ceil(capacity_factor *
  /// tokens * k / N); with dropless routing, tokens * k (nothing can overflow).
  std::size_t capacity(std::size_t tokens) const {
    if (cfg_.dropless()) return tokens * cfg_.top_k;
    const double c = std::ceil(cfg_.capacity_factor * double(tokens) * double(cfg_.top_k) / double(cfg_.experts) - 1e-9);
    return std::min<std::size_t>(tokens * cfg_.top_k, std::size_t(std::max(c, 0.0)));
  }

  /// out = sum over the token's kept experts of gate * expert(h) (+ the
  /// shared experts), filling s. h, out: [tokens, D].
  template <class HV, class OV>
  void forward(const HV& h, Saved& s, const OV& out) {
    const std::size_t n = h.extent(0), N = cfg_.experts, K = cfg_.top_k, D = cfg_.d_model;
    WEFT_REQUIRE(s.logits.extent(0) == n && out.extent(0) == n, ShapeError, "nn::MoE: input has ", n,
                 " tokens but the saved activations hold ", s.logits.extent(0), " and the output ", out.extent(0));
    router_.forward(h, s.logits);
    route(s, n);
    // Gather each kept slot's input into its expert's group.
    const std::size_t rows = s.offsets[N];
    {
      metrics::Profiler::Scope sc(ctx_->profiler, "moe_dispatch");
      auto xin = s.xin;
      auto row_token = s.row_token;
      Kokkos::parallel_for(
          "weft::moe_gather", Kokkos::RangePolicy<exec>(0, rows), KOKKOS_LAMBDA(std::size_t r) {
            const std::size_t t = std::size_t(row_token(r));
            for (std::size_t j = 0; j < D; ++j) xin(r, j) = h(t, j);
          });
    }
    for (std::size_t e = 0; e < N; ++e) {
      const auto g = group(s, e);
      experts_[e].forward(rows_of(s.xin, g), expert_saved(s, g), rows_of(s.eout, g));
    }
    {
      metrics::Profiler::Scope sc(ctx_->profiler, "moe_combine");
      auto eout = s.eout;
      auto slot_row = s.slot_row;
      auto row_gate = s.row_gate;
      Kokkos::parallel_for(
          "weft::moe_combine", Kokkos::RangePolicy<exec>(0, n), KOKKOS_LAMBDA(std::size_t t) {
            for (std::size_t j = 0; j < D; ++j) out(t, j) = T(0);
            for (std::size_t q = 0; q < K; ++q) {  // in choice order: the same sum on every run
              const int r = slot_row(t * K + q);
              if (r < 0) continue;
              const T g = row_gate(r);
              for (std::size_t j = 0; j < D; ++j) out(t, j) += g * eout(r, j);
            }
          });
    }
    for (std::size_t i = 0; i < shared_.size(); ++i) {
      shared_[i].forward(h, s.shared[i], s.shared_out);
      ops::add(out, out, s.shared_out);
    }
  }

  /// dh = d/dh (overwritten) of sum(dout * out) + loss_weight() * (aux + z);
  /// parameter gradients accumulate.
  template <class HV, class DOV, class DHV>
  void backward(const HV& h, const Saved& s, const DOV& dout, const DHV& dh, Workspace& w) {
    const std::size_t n = h.extent(0), N = cfg_.experts, K = cfg_.top_k, D = cfg_.d_model;
    const std::size_t rows = s.offsets[N];
    {
      metrics::Profiler::Scope sc(ctx_->profiler, "moe_combine");
      auto dslot = w.dslot;
      auto dgate = w.dgate;
      auto eout = s.eout;
      auto row_token = s.row_token;
      auto row_gate = s.row_gate;
      auto slot_row = s.slot_row;
      Kokkos::parallel_for(
          "weft::moe_combine_backward", Kokkos::RangePolicy<exec>(0, rows), KOKKOS_LAMBDA(std::size_t r) {
            const std::size_t t = std::size_t(row_token(r));
            const T g = row_gate(r);
            for (std::size_t j = 0; j < D; ++j) dslot(r, j) = g * dout(t, j);
          });
      Kokkos::parallel_for(
          "weft::moe_gate_backward", Kokkos::RangePolicy<exec>(0, n * K), KOKKOS_LAMBDA(std::size_t q) {
            const int r = slot_row(q);
            T acc = 0;
            if (r >= 0)
              for (std::size_t j = 0; j < D; ++j) acc += dout(q / K, j) * eout(r, j);
            dgate(q) = acc;
          });
    }
    for (std::size_t e = 0; e < N; ++e) {
      const auto g = group(s, e);
      typename Expert::Workspace ew;
      ew.dup = rows_of(w.dup, g);
      ew.dact = rows_of(w.dact, g);
      experts_[e].backward(rows_of(s.xin, g), expert_saved(s, g), rows_of(w.dslot, g), rows_of(w.dxin, g), ew);
    }
    {
      metrics::Profiler::Scope sc(ctx_->profiler, "moe_dispatch");
      auto dxin = w.dxin;
      auto slot_row = s.slot_row;
      Kokkos::parallel_for(
          "weft::moe_scatter", Kokkos::RangePolicy<exec>(0, n), KOKKOS_LAMBDA(std::size_t t) {
            for (std::size_t j = 0; j < D; ++j) dh(t, j) = T(0);
            for (std::size_t q = 0; q < K; ++q) {
              const int r = slot_row(t * K + q);
              if (r < 0) continue;
              for (std::size_t j = 0; j < D; ++j) dh(t, j) += dxin(r, j);
            }
          });
    }
    for (std::size_t i = 0; i < shared_.size(); ++i) {
      shared_[i].backward(h, s.shared[i], dout, w.dtmp, w.shared);
      ops::add(dh, dh, w.dtmp);
    }
    router_logits_backward(s, n, w);
    router_.backward(h, w.du, dh, true);
  }

  /// The weight of the auxiliary losses' gradients in backward: the model
  /// sets it to grad_scale x tokens, so that the losses enter the gradient
  /// of the microbatch as its mean token loss does (1 by default).
  void set_loss_weight(double w) { loss_weight_ = w; }
  /// See set_loss_weight.
  double loss_weight() const { return loss_weight_; }
  /// Whether forward passes count in the statistics and the bias-update
  /// counts (off while a block recomputes its forward for backward).
  void set_recording(bool on) { recording_ = on; }

  /// Moves the selection bias from the slots counted since the last update:
  /// b_e += gamma * sign(mean_e' c_e' - c_e), so overloaded experts are
  /// chosen less and idle ones more, without a loss term. Call it after the
  /// optimizer step. Does nothing when gamma is 0 or nothing was counted.
  void update_bias(double gamma) {
    const double total = std::accumulate(step_counts_.begin(), step_counts_.end(), 0.0);
    if (gamma != 0 && total > 0) {
      const double mean = total / double(step_counts_.size());
      auto hv = Kokkos::create_mirror_view(bias_.value);
      Kokkos::deep_copy(hv, bias_.value);
      for (std::size_t e = 0; e < step_counts_.size(); ++e) {
        const double d = mean - step_counts_[e];
        hv(e) += T(gamma * double((d > 0) - (d < 0)));
      }
      Kokkos::deep_copy(bias_.value, hv);
    }
    std::fill(step_counts_.begin(), step_counts_.end(), 0.0);
  }

  /// The load-balancing loss of the last forward pass (with its coefficient).
  double last_aux_loss() const { return last_aux_; }
  /// The router z-loss of the last forward pass (with its coefficient).
  double last_z_loss() const { return last_z_; }

  /// Statistics since the last reset_statistics().
  const MoEStats& statistics() const { return stats_; }
  /// Clears the statistics.
  void reset_statistics() {
    stats_ = MoEStats{};
    stats_.selected.assign(cfg_.experts, 0.0);
    stats_.layers = 1;
  }

  /// The selection bias (value [1, N]; its gradient stays zero).
  Parameter<T, Space>& expert_bias() { return bias_; }
  /// The router's linear gate.
  Linear<T, Space>& router() { return router_; }
  /// Expert e.
  Expert& expert(std::size_t e) { return experts_.at(e); }
  /// Number of routed experts.
  std::size_t experts() const { return cfg_.experts; }

  /// Appends pointers to this layer's parameters: router, selection bias,
  /// experts in order, shared experts.
  void collect(std::vector<Parameter<T, Space>*>& out) {
    router_.collect(out);
    out.push_back(&bias_);
    for (auto& e : experts_) e.collect(out);
    for (auto& e : shared_) e.collect(out);
  }

 private:
  using exec = typename Kokkos::View<T*, Space>::execution_space;

  static ContextPtr checked(ContextPtr ctx, const std::string& name, const GPTConfig& c) {
    WEFT_REQUIRE(c.experts > 0 && c.top_k >= 1 && c.top_k <= c.experts, ConfigError, "nn::MoE '", name, "': ",
                 c.experts, " experts and top-k ", c.top_k, "; expected experts >= 1 and 1 <= top-k <= experts");
    WEFT_REQUIRE(!ctx->tp.active() && !ctx->cp.active(), ConfigError, "nn::MoE '", name,
                 "': tensor and context parallelism are not implemented for mixture-of-experts blocks (tp ",
                 ctx->tp.size(), ", cp ", ctx->cp.size(), "); run MoE models with tp=1 and cp=1");
    return ctx;
  }

  static auto rows_of(const Mat& m, std::pair<std::size_t, std::size_t> g) {
    return Mat(Kokkos::subview(m, g, Kokkos::ALL));
  }
  static std::pair<std::size_t, std::size_t> group(const Saved& s, std::size_t e) {
    return {s.offsets[e], s.offsets[e + 1]};
  }
  static typename Expert::Saved expert_saved(const Saved& s, std::pair<std::size_t, std::size_t> g) {
    typename Expert::Saved es;
    es.up = rows_of(s.up, g);
    es.act = rows_of(s.act, g);
    return es;
  }

  // Scores, top-k, gates, capacity and drops, the losses and the statistics;
  // the grouped-row maps go to the device.
  void route(Saved& s, std::size_t n) {
    metrics::Profiler::Scope sc(ctx_->profiler, "moe_route");
    const std::size_t N = cfg_.experts, K = cfg_.top_k;
    auto lh = Kokkos::create_mirror_view(s.logits);
    Kokkos::deep_copy(lh, s.logits);
    auto bh = Kokkos::create_mirror_view(bias_.value);
    Kokkos::deep_copy(bh, bias_.value);
    const bool softmax = cfg_.router == RouterKind::softmax;
    s.scores.assign(n * N, 0.0);
    s.u.assign(n * N, 0.0);
    s.lse.assign(n, 0.0);
    s.slot_expert.assign(n * K, 0);
    s.slot_gate.assign(n * K, 0.0);
    s.selected.assign(N, 0.0);
    double entropy = 0;
    std::vector<double> mean_p(N, 0.0);
    std::vector<int> order(N);
    std::vector<double> key(N);
    for (std::size_t t = 0; t < n; ++t) {
      double mx = -std::numeric_limits<double>::infinity();
      for (std::size_t e = 0; e < N; ++e) mx = std::max(mx, double(lh(t, e)));
      double se = 0;
      for (std::size_t e = 0; e < N; ++e) se += std::exp(double(lh(t, e)) - mx);
      s.lse[t] = mx + std::log(se);
      double* p = &s.scores[t * N];
      double psum = 0;
      for (std::size_t e = 0; e < N; ++e) {
        const double u = double(lh(t, e));
        s.u[t * N + e] = u;
        p[e] = softmax ? std::exp(u - s.lse[t]) : 1.0 / (1.0 + std::exp(-u));
        psum += p[e];
        mean_p[e] += p[e] / double(n);
      }
      for (std::size_t e = 0; e < N; ++e) {
        const double q = p[e] / psum;
        if (q > 0) entropy -= q * std::log(q);
      }
      // Top k by score + selection bias; ties go to the lower expert index.
      for (std::size_t e = 0; e < N; ++e) key[e] = p[e] + double(bh(e));
      std::iota(order.begin(), order.end(), 0);
      std::partial_sort(order.begin(), order.begin() + long(K), order.end(), [&](int a, int b) {
        return key[a] > key[b] || (key[a] == key[b] && a < b);
      });
      double gsum = 0;
      for (std::size_t q = 0; q < K; ++q) gsum += p[order[q]];
      for (std::size_t q = 0; q < K; ++q) {
        const int e = order[q];
        s.slot_expert[t * K + q] = e;
        s.slot_gate[t * K + q] = cfg_.normalize_gates ? p[e] / gsum : p[e];
        s.selected[e] += 1;
      }
    }
    // Capacity: an expert keeps its C slots of highest score, ties by token
    // index -- a rule on global token indices alone, so the same slots are
    // dropped whatever the layout.
    const std::size_t cap = capacity(n);
    std::vector<std::vector<std::size_t>> cand(N);
    for (std::size_t q = 0; q < n * K; ++q) cand[std::size_t(s.slot_expert[q])].push_back(q);
    // The grouped-row maps are built in host mirrors of the device views.
    auto row_token = Kokkos::create_mirror_view(s.row_token);
    auto row_gate = Kokkos::create_mirror_view(s.row_gate);
    auto slot_row = Kokkos::create_mirror_view(s.slot_row);
    Kokkos::deep_copy(row_token, 0);
    Kokkos::deep_copy(row_gate, T(0));
    Kokkos::deep_copy(slot_row, -1);
    s.offsets.assign(N + 1, 0);
    s.dropped.clear();
    std::size_t r = 0;
    for (std::size_t e = 0; e < N; ++e) {
      auto& c = cand[e];  // ascending slot index = ascending token index
      if (c.size() > cap) {
        std::stable_sort(c.begin(), c.end(), [&](std::size_t a, std::size_t b) {
          return s.scores[(a / K) * N + e] > s.scores[(b / K) * N + e];
        });
        for (std::size_t i = cap; i < c.size(); ++i) s.dropped.push_back(c[i]);
        c.resize(cap);
        std::sort(c.begin(), c.end());
      }
      s.offsets[e] = r;
      for (std::size_t q : c) {
        slot_row(q) = int(r);
        row_token(r) = int(q / K);
        row_gate(r) = T(s.slot_gate[q]);
        ++r;
      }
    }
    s.offsets[N] = r;
    std::sort(s.dropped.begin(), s.dropped.end());
    // The losses: alpha N sum_e f_e P_e and beta mean_t lse_t^2.
    double aux = 0, z = 0;
    for (std::size_t e = 0; e < N; ++e) aux += s.selected[e] / double(n * K) * mean_p[e];
    aux *= cfg_.aux_loss * double(N);
    for (std::size_t t = 0; t < n; ++t) z += s.lse[t] * s.lse[t];
    z *= cfg_.z_loss / double(n);
    s.aux = last_aux_ = aux;
    s.z = last_z_ = z;
    if (recording_) {
      for (std::size_t e = 0; e < N; ++e) {
        stats_.selected[e] += s.selected[e];
        step_counts_[e] += s.selected[e];
      }
      stats_.tokens += double(n);
      stats_.slots += double(n * K);
      stats_.dropped += double(s.dropped.size());
      stats_.entropy_sum += entropy;
      stats_.aux_loss += aux;
      stats_.z_loss += z;
      stats_.passes += 1;
    }
    Kokkos::deep_copy(s.row_token, row_token);
    Kokkos::deep_copy(s.row_gate, row_gate);
    Kokkos::deep_copy(s.slot_row, slot_row);
  }

  // w.du = d/du of sum(dout * out) (through the gates) + loss_weight * (aux + z).
  void router_logits_backward(const Saved& s, std::size_t n, Workspace& w) {
    metrics::Profiler::Scope sc(ctx_->profiler, "moe_route");
    const std::size_t N = cfg_.experts, K = cfg_.top_k;
    auto dg = Kokkos::create_mirror_view(w.dgate);
    Kokkos::deep_copy(dg, w.dgate);
    auto du = Kokkos::create_mirror_view(w.du);
    const bool softmax = cfg_.router == RouterKind::softmax;
    const double lw = loss_weight_;
    std::vector<double> ds(N);
    for (std::size_t t = 0; t < n; ++t) {
      const double* p = &s.scores[t * N];
      // Aux loss: alpha N f_e / n per score (f_e is a count: no gradient).
      for (std::size_t e = 0; e < N; ++e)
        ds[e] = lw * cfg_.aux_loss * double(N) * (s.selected[e] / double(n * K)) / double(n);
      // Gates: g_j = p_j / S over the chosen set (or g_j = p_j).
      if (cfg_.normalize_gates) {
        double S = 0, gdg = 0;
        for (std::size_t q = 0; q < K; ++q) {
          S += p[s.slot_expert[t * K + q]];
          gdg += s.slot_gate[t * K + q] * double(dg(t * K + q));
        }
        for (std::size_t q = 0; q < K; ++q) ds[std::size_t(s.slot_expert[t * K + q])] += (double(dg(t * K + q)) - gdg) / S;
      } else {
        for (std::size_t q = 0; q < K; ++q) ds[std::size_t(s.slot_expert[t * K + q])] += double(dg(t * K + q));
      }
      if (softmax) {
        double dot = 0;
        for (std::size_t e = 0; e < N; ++e) dot += p[e] * ds[e];
        for (std::size_t e = 0; e < N; ++e) du(t, e) = T(p[e] * (ds[e] - dot));
      } else {
        for (std::size_t e = 0; e < N; ++e) du(t, e) = T(ds[e] * p[e] * (1 - p[e]));
      }
      // z-loss: 2 beta lse_t softmax(u_t) / n.
      if (cfg_.z_loss != 0) {
        const double c = lw * 2 * cfg_.z_loss * s.lse[t] / double(n);
        for (std::size_t e = 0; e < N; ++e) du(t, e) += T(c * std::exp(s.u[t * N + e] - s.lse[t]));
      }
    }
    Kokkos::deep_copy(w.du, du);
  }

  ContextPtr ctx_;
  GPTConfig cfg_;
  Linear<T, Space> router_;
  Parameter<T, Space> bias_;
  std::vector<Expert> experts_, shared_;
  std::vector<double> step_counts_;
  MoEStats stats_;
  double loss_weight_ = 1;
  double last_aux_ = 0, last_z_ = 0;
  bool recording_ = true;
};

}  // namespace weft::nn
