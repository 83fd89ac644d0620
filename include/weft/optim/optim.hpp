// Optimizers over a model's parameter list: AdamW (decoupled weight decay,
// bias-corrected moments) and SGD with momentum and weight decay, plus
// clipping by the global gradient norm. State lives in the parameters'
// execution space and is attributed as optimizer state; AdamW keeps its
// moments in flat buffers and updates runs of adjacent parameters in one pass.
#pragma once

#include <algorithm>
#include <cmath>
#include <functional>
#include <utility>
#include <vector>

#include <weft/metrics/memory.hpp>
#include <weft/nn/parameter.hpp>
#include <weft/ops/common.hpp>
#include <weft/precision/loss_scale.hpp>

namespace weft::optim {

/// sqrt of the sum of squares of every gradient, accumulated in double. On a
/// data-parallel run this is the local part; reduce squares across ranks first.
/// With a tensor-parallel communicator `tp`, the squares of TP-sharded
/// parameters (Parameter::tp_sharded) are summed over the TP ranks and those of
/// replicated ones (norms, row-parallel biases; equal on every TP rank) are
/// counted once, so the norm is the single-process model's.
template <class T, class Space>
double grad_norm(const std::vector<nn::Parameter<T, Space>*>& params, Comm* tp = nullptr) {
  double sums[2] = {0, 0};  // TP-sharded, replicated
  for (auto* p : params) {
    // Chunks summed with ops::detail::lane_sum (independent partial sums the
    // compiler vectorises); one double add per element in a single chain
    // would run at one add per few cycles.
    const T* __restrict gp = p->grad.data();
    const std::size_t n = p->grad.extent(0), chunk = 4096;
    double s = 0;
    Kokkos::parallel_reduce(
        "weft::grad_norm", Kokkos::RangePolicy<typename Space::execution_space>(0, (n + chunk - 1) / chunk),
        KOKKOS_LAMBDA(std::size_t c, double& acc) {
          const std::size_t i0 = c * chunk, len = n - i0 < chunk ? n - i0 : chunk;
          acc += ops::detail::lane_sum<double>(len, [&](std::size_t j) {
            const double x = double(gp[i0 + j]);
            return x * x;
          });
        },
        s);
    sums[p->tp_sharded() ? 0 : 1] += s;
  }
  if (tp && tp->size() > 1) {
    Kokkos::View<double*, Kokkos::HostSpace, Kokkos::MemoryTraits<Kokkos::Unmanaged>> v(sums, 1);
    tp->all_reduce(v);
  }
  return std::sqrt(sums[0] + sums[1]);
}

/// Multiplies every gradient of `params` by f (rounded to T once).
template <class T, class Space>
void scale_grads(const std::vector<nn::Parameter<T, Space>*>& params, double factor) {
  const T f = T(factor);
  for (auto* p : params) {
    T* __restrict gp = p->grad.data();
    const std::size_t n = p->grad.extent(0), chunk = 4096;
    Kokkos::parallel_for(
        "weft::clip_grad", Kokkos::RangePolicy<typename Space::execution_space>(0, (n + chunk - 1) / chunk),
        KOKKOS_LAMBDA(std::size_t c) {
          const std::size_t end = (c + 1) * chunk < n ? (c + 1) * chunk : n;
          for (std::size_t i = c * chunk; i < end; ++i) gp[i] *= f;
        });
  }
}

/// Scales every gradient by max_norm / norm when the global norm exceeds
/// max_norm (max_norm <= 0: no clipping). Returns the norm before clipping.
/// `tp`: as in grad_norm.
template <class T, class Space>
double clip_grad_norm(const std::vector<nn::Parameter<T, Space>*>& params, double max_norm, Comm* tp = nullptr) {
  const double norm = grad_norm(params, tp);
  if (max_norm > 0 && norm > max_norm) scale_grads(params, max_norm / (norm + 1e-6));
  return norm;
}

/// The end of a loss-scaled step, once the gradients of (loss x
/// scaler.scale()) are complete on every rank: `scaled_norm` is their global
/// norm (identical on every rank, so every rank decides alike). An infinite
/// or NaN norm is an overflow: scaler.update(true) skips the step and backs
/// the scale off, and the gradients are left as they are (the caller does
/// not step the optimizer). Otherwise the gradients are multiplied once by
/// 1 / scale, times the clipping factor min(1, clip / (norm + 1e-6)) of the
/// unscaled norm when clip > 0, through `scale_by(f)`. Returns whether the
/// step is skipped; `norm` receives the unscaled norm (the scaled one, not
/// finite, on a skipped step).
template <class ScaleBy>
bool unscale_and_clip(DynamicLossScaler& scaler, double scaled_norm, double clip, double& norm, ScaleBy&& scale_by) {
  const double scale = scaler.scale();  // this step's: update() may grow it
  if (scaler.update(!std::isfinite(scaled_norm))) {
    norm = scaled_norm;
    return true;
  }
  norm = scaled_norm / scale;
  double f = 1.0 / scale;
  if (clip > 0 && norm > clip) f *= clip / (norm + 1e-6);
  scale_by(f);
  return false;
}

/// AdamW's hyper-parameters (GPT-2 style defaults).
struct AdamWOptions {
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.1;  ///< decoupled; only on parameters with decay() (matrices, embeddings)
};

/// AdamW (Loshchilov & Hutter): p -= lr * (m_hat / (sqrt(v_hat) + eps) + wd * p).
///
/// The two moments live in one flat buffer each, laid out in the memory order
/// of the parameters' values. Parameters whose values and gradients are
/// adjacent in memory (those of a data-parallel wrapper's flat buckets, or of
/// one ZeRO shard) and share decay() form one segment, and a step is one
/// kernel over every segment's elements: one pass over the flat value,
/// gradient and moment buffers, not one launch per parameter. The segments are
/// found again whenever a parameter's storage moves.
template <class T, class Space>
class AdamW {
 public:
  /// A run of parameters whose values, gradients and moments are each one
  /// contiguous range, with one decay flag (internal to step(); public
  /// because nvcc refuses a private type in an extended lambda's captures).
  struct Segment {
    T* w;
    const T* g;
    T* m;
    T* v;
    std::size_t n;
    std::size_t first_chunk;
    bool decay;
  };

  /// Allocates zero first and second moments for every parameter.
  AdamW(std::vector<nn::Parameter<T, Space>*> params, AdamWOptions o = {}) : params_(std::move(params)), o_(o) {
    WEFT_REQUIRE(o.beta1 >= 0 && o.beta1 < 1 && o.beta2 >= 0 && o.beta2 < 1 && o.eps > 0 && o.weight_decay >= 0,
                 ConfigError, "optim::AdamW: beta1 ", o.beta1, " and beta2 ", o.beta2, " must lie in [0, 1), eps ", o.eps,
                 " must be positive and weight decay ", o.weight_decay, " non-negative");
    // Moments in the memory order of the values, so that adjacent values have
    // adjacent moments and a run of parameters is one segment.
    std::vector<std::size_t> order(params_.size());
    for (std::size_t k = 0; k < order.size(); ++k) order[k] = k;
    std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
      return std::less<const T*>()(params_[a]->value.data(), params_[b]->value.data());
    });
    offset_.assign(params_.size(), 0);
    std::size_t total = 0;
    for (std::size_t k : order) {
      offset_[k] = total;
      total += params_[k]->size();
    }
    order_ = std::move(order);
    m_flat_ = allocate_view<Flat>("weft::adamw.first_moment", total);
    v_flat_ = allocate_view<Flat>("weft::adamw.second_moment", total);
    for (std::size_t k = 0; k < params_.size(); ++k) {
      const auto range = std::make_pair(offset_[k], offset_[k] + params_[k]->size());
      m_.emplace_back(Kokkos::subview(m_flat_, range));
      v_.emplace_back(Kokkos::subview(v_flat_, range));
    }
    build_segments();
  }

  /// One update with learning rate lr from the accumulated gradients.
  void step(double lr) {
    WEFT_REQUIRE(lr >= 0 && std::isfinite(lr), ConfigError, "optim::AdamW: learning rate ", lr,
                 " must be finite and non-negative (--lr)");
    if (storage_moved()) build_segments();
    ++t_;
    const T b1 = T(o_.beta1), b2 = T(o_.beta2), eps = T(o_.eps);
    const T c1 = T(1.0 / (1.0 - std::pow(o_.beta1, double(t_))));
    const T c2 = T(1.0 / (1.0 - std::pow(o_.beta2, double(t_))));
    const T step_lr = T(lr), keep_decay = T(1.0 - lr * o_.weight_decay);
    const auto segs = segments_;
    const std::size_t nseg = segs.extent(0);
    if (nseg == 0) return;
    Kokkos::parallel_for(
        "weft::adamw", Kokkos::RangePolicy<typename Space::execution_space>(0, chunks_),
        KOKKOS_LAMBDA(std::size_t c) {
          // The segment holding chunk c: the last whose first chunk is <= c.
          std::size_t lo = 0, hi = nseg;
          while (hi - lo > 1) {
            const std::size_t mid = (lo + hi) / 2;
            if (segs(mid).first_chunk <= c) lo = mid; else hi = mid;
          }
          const Segment s = segs(lo);
          const std::size_t i0 = (c - s.first_chunk) * kChunk;
          const std::size_t end = i0 + kChunk < s.n ? i0 + kChunk : s.n;
          const T keep = s.decay ? keep_decay : T(1);
          // A plain inner loop over restrict pointers, so that it vectorises.
          T* __restrict wp = s.w;
          const T* __restrict gp = s.g;
          T* __restrict mp = s.m;
          T* __restrict vp = s.v;
          for (std::size_t i = i0; i < end; ++i) {
            const T gi = gp[i];
            const T mi = b1 * mp[i] + (T(1) - b1) * gi;
            const T vi = b2 * vp[i] + (T(1) - b2) * gi * gi;
            mp[i] = mi;
            vp[i] = vi;
            wp[i] = keep * wp[i] - step_lr * (mi * c1) / (ops::math::fast_sqrt(vi * c2) + eps);
          }
        });
  }

  /// Steps taken.
  long steps() const { return t_; }
  /// Sets the steps taken (the bias correction's t) when the moments are
  /// restored from a checkpoint.
  void set_steps(long t) {
    WEFT_REQUIRE(t >= 0, ConfigError, "optim::AdamW: step count ", t, " must be non-negative");
    t_ = t;
  }
  /// The hyper-parameters.
  const AdamWOptions& options() const { return o_; }
  /// First moment of parameter k (in the order the optimizer was given): a
  /// slice of the flat first-moment buffer.
  const Kokkos::View<T*, Space>& first_moment(std::size_t k) const { return m_.at(k); }
  /// Second moment of parameter k.
  const Kokkos::View<T*, Space>& second_moment(std::size_t k) const { return v_.at(k); }
  /// Kernel segments of the last step (runs of parameters adjacent in memory
  /// with the same decay): 1 for a data-parallel wrapper's single flat
  /// buffer without undecayed parameters, at most the parameter count.
  std::size_t segments() const { return segments_.extent(0); }
  /// Moment buffers, as optimizer state (by parameter).
  metrics::MemoryLedger memory() const {
    metrics::MemoryLedger l;
    for (std::size_t k = 0; k < m_.size(); ++k)
      l.add(metrics::MemoryCategory::optimizer_state, params_[k]->name(),
            (m_[k].span() + v_[k].span()) * sizeof(T));
    return l;
  }

 private:
  using Flat = Kokkos::View<T*, Space>;
  static constexpr std::size_t kChunk = 2048;

  bool storage_moved() const {
    for (std::size_t k = 0; k < params_.size(); ++k)
      if (params_[k]->value.data() != seen_[k].first || params_[k]->grad.data() != seen_[k].second) return true;
    return false;
  }

  void build_segments() {
    std::vector<Segment> segs;
    seen_.clear();
    for (auto* p : params_) seen_.emplace_back(p->value.data(), p->grad.data());
    for (std::size_t k : order_) {
      auto* p = params_[k];
      const std::size_t n = p->size();
      if (n == 0) continue;
      WEFT_REQUIRE(p->value.extent(0) == n && p->grad.extent(0) == n, ConfigError, "optim::AdamW: parameter '",
                   p->name(), "' has ", p->value.extent(0), " values and ", p->grad.extent(0),
                   " gradients for its ", n, " elements");
      T* w = p->value.data();
      T* g = p->grad.data();
      T* m = m_flat_.data() + offset_[k];
      T* v = v_flat_.data() + offset_[k];
      if (!segs.empty()) {
        Segment& s = segs.back();
        if (s.decay == p->decay() && s.w + s.n == w && s.g + s.n == g && s.m + s.n == m) {
          s.n += n;
          continue;
        }
      }
      segs.push_back(Segment{w, g, m, v, n, 0, p->decay()});
    }
    chunks_ = 0;
    for (auto& s : segs) {
      s.first_chunk = chunks_;
      chunks_ += (s.n + kChunk - 1) / kChunk;
    }
    segments_ = Kokkos::View<Segment*, Space>("weft::adamw.segments", segs.size());
    auto host = Kokkos::create_mirror_view(segments_);
    for (std::size_t i = 0; i < segs.size(); ++i) host(i) = segs[i];
    Kokkos::deep_copy(segments_, host);
  }

  std::vector<nn::Parameter<T, Space>*> params_;
  AdamWOptions o_;
  std::vector<std::size_t> order_, offset_;
  Flat m_flat_, v_flat_;
  std::vector<Flat> m_, v_;
  std::vector<std::pair<const T*, const T*>> seen_;
  Kokkos::View<Segment*, Space> segments_;
  std::size_t chunks_ = 0;
  long t_ = 0;
};

/// SGD's hyper-parameters.
struct SGDOptions {
  double momentum = 0.0;      ///< heavy-ball momentum (0: plain SGD, no state)
  double weight_decay = 0.0;  ///< L2 term added to the gradient of parameters with decay()
};

/// SGD: b = momentum * b + (g + wd * p); p -= lr * b.
template <class T, class Space>
class SGD {
 public:
  /// Allocates momentum buffers only when momentum is used.
  SGD(std::vector<nn::Parameter<T, Space>*> params, SGDOptions o = {}) : params_(std::move(params)), o_(o) {
    WEFT_REQUIRE(o.momentum >= 0 && o.momentum < 1 && o.weight_decay >= 0, ConfigError, "optim::SGD: momentum ",
                 o.momentum, " must lie in [0, 1) and weight decay ", o.weight_decay, " be non-negative");
    if (o.momentum > 0)
      for (auto* p : params_) b_.emplace_back(p->name() + ".momentum", p->size());
  }

  /// One update with learning rate lr.
  void step(double lr) {
    WEFT_REQUIRE(lr >= 0 && std::isfinite(lr), ConfigError, "optim::SGD: learning rate ", lr,
                 " must be finite and non-negative (--lr)");
    const T mu = T(o_.momentum), step_lr = T(lr);
    const bool use_b = o_.momentum > 0;
    for (std::size_t k = 0; k < params_.size(); ++k) {
      auto* p = params_[k];
      auto w = p->value;
      auto g = p->grad;
      auto b = use_b ? b_[k] : Kokkos::View<T*, Space>();
      const T wd = p->decay() ? T(o_.weight_decay) : T(0);
      Kokkos::parallel_for(
          "weft::sgd", Kokkos::RangePolicy<typename Space::execution_space>(0, w.extent(0)),
          KOKKOS_LAMBDA(std::size_t i) {
            T d = g(i) + wd * w(i);
            if (use_b) {
              d = mu * b(i) + d;
              b(i) = d;
            }
            w(i) -= step_lr * d;
          });
    }
  }

  /// The momentum buffer of parameter k (none, and an error, without momentum).
  const Kokkos::View<T*, Space>& momentum_buffer(std::size_t k) const {
    WEFT_REQUIRE(k < b_.size(), ConfigError, "optim::SGD: no momentum buffer ", k, " (momentum ", o_.momentum,
                 ", ", b_.size(), " buffers)");
    return b_[k];
  }
  /// Whether there are momentum buffers (momentum > 0).
  bool has_momentum() const { return !b_.empty(); }
  /// The hyper-parameters.
  const SGDOptions& options() const { return o_; }

  /// Momentum buffers, as optimizer state.
  metrics::MemoryLedger memory() const {
    metrics::MemoryLedger l;
    for (std::size_t k = 0; k < b_.size(); ++k)
      l.add(metrics::MemoryCategory::optimizer_state, params_[k]->name(), b_[k].span() * sizeof(T));
    return l;
  }

 private:
  std::vector<nn::Parameter<T, Space>*> params_;
  SGDOptions o_;
  std::vector<Kokkos::View<T*, Space>> b_;
};

}  // namespace weft::optim
