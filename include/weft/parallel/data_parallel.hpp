// Data parallelism over the DP axis of a mesh, typed by its policy (a
// weft::DPStates, see vocabulary/strategy.hpp): Replicated (DDP: bucketed
// gradient all-reduce started during backward) and the sharded ZeRO<1>,
// ZeRO<2> and FullyShard. Works on parameter groups of any model whose layers
// hold weft::nn::Parameter objects and call nn::GroupHooks.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <deque>
#include <exception>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <weft/comm/comm.hpp>
#include <weft/core/error.hpp>
#include <weft/core/half.hpp>
#include <weft/metrics/memory.hpp>
#include <weft/nn/parameter.hpp>
#include <weft/precision/convert.hpp>
#include <weft/vocabulary/dp_mode.hpp>
#include <weft/vocabulary/strategy.hpp>

namespace weft::detail {
// DataParallel's kernels. They depend on the element type and the space, not
// on the policy, so every policy shares one instantiation of each.
template <class T, class Space>
double dp_sum_squares(const Kokkos::View<T*, Space>& g) {
  double s = 0;
  Kokkos::parallel_reduce(
      "weft::dp_sumsq", Kokkos::RangePolicy<typename Space::execution_space>(0, g.extent(0)),
      KOKKOS_LAMBDA(std::size_t i, double& acc) { acc += double(g(i)) * double(g(i)); }, s);
  return s;
}
template <class T, class Space>
void dp_scale(const Kokkos::View<T*, Space>& g, T f) {
  Kokkos::parallel_for("weft::dp_clip", Kokkos::RangePolicy<typename Space::execution_space>(0, g.extent(0)),
                       KOKKOS_LAMBDA(std::size_t i) { g(i) *= f; });
}
template <class Space, class D, class S>
void dp_accumulate(const D& dst, const S& src, std::size_t n) {
  Kokkos::parallel_for("weft::dp_accumulate", Kokkos::RangePolicy<typename Space::execution_space>(0, n),
                       KOKKOS_LAMBDA(std::size_t i) { dst(i) += src(i); });
}
// The 2-byte reduction's sum: out(i) (+)= sum over q = 0 .. p-1, in that
// order, of blocks(q * chunk + i) widened, accumulated in float and stored
// once (rounded when out is 2-byte).
template <class Space, class O, class B>
void dp_sum_blocks(const O& out, const B& blocks, std::size_t chunk, std::size_t p, bool accumulate) {
  using V = typename O::non_const_value_type;
  Kokkos::parallel_for("weft::dp_sum_blocks", Kokkos::RangePolicy<typename Space::execution_space>(0, chunk),
                       KOKKOS_LAMBDA(std::size_t i) {
                         float acc = 0.0f;
                         for (std::size_t q = 0; q < p; ++q) acc += float(blocks(q * chunk + i));
                         if (accumulate) out(i) = V(float(out(i)) + acc);
                         else out(i) = V(acc);
                       });
}
}  // namespace weft::detail

namespace weft::parallel {

/// Run-time options of DataParallel (the mode is its Policy type).
struct DPOptions {
  /// Bucket size of replicate and zero1 (zero2 and fsdp communicate one
  /// parameter group at a time).
  double bucket_mb = 25.0;
  /// Start each bucket's reduction as soon as backward completes it (off: all
  /// reductions after backward, for measuring what overlap buys).
  bool overlap = true;
  /// fsdp: free a block's gathered parameters after its forward and gather
  /// them again for backward (off: keep them from forward to backward).
  bool reshard_after_forward = true;
  /// fsdp: start gathering the next group while the current one computes.
  bool prefetch = true;
};

/// Data parallelism over one communicator (the mesh's DP axis).
///
/// Lifecycle of a step: zero_grad(); for each microbatch: begin_microbatch(last)
/// then the model's forward and backward (which call the hooks);
/// finish_gradients(); clip_grad_norm(); the optimizer's step() over
/// optimizer_parameters(); sync_parameters().
///
/// Gradients are summed over the DP axis, not averaged: each rank scales its
/// loss by 1 / (global batch tokens), so the sum is the gradient of the global
/// mean loss, exactly as the single-process model computes it.
///
/// Parameters and gradients live in flat buffers laid out bucket by bucket in
/// the order backward completes them (blocks last to first, then the root
/// group); each bucket is padded to a multiple of the DP size so rank r owns
/// chunk r of every bucket. The padding is internal storage only: it is zero,
/// never part of any tensor, and excluded from the optimizer.
///
/// FullyShard gathers a parameter that every reader rounds to a 2-byte type
/// first (nn::Parameter::read_as(): an nn::Linear weight under bf16 or fp16
/// products) in that type: each group's bucket is split in two, the
/// parameters read as 2 bytes (the narrow bucket) and the others; the owned
/// chunk of the narrow one is rounded to 2 bytes, all-gathered, and widened
/// (exactly) into the gathered float copy. The layer rounds it again before
/// each product, which changes nothing, so the results are bit for bit those
/// of a float gather at half its bytes. Gradients are reduce-scattered in T,
/// bucket by bucket.
///
/// Policy is the placement of parameters, gradients and optimizer state over
/// DP: weft::Replicated (DDP), weft::ZeRO<1>, weft::ZeRO<2> or
/// weft::FullyShard. Each instantiation compiles only its own mode's paths.
///
/// Prec is the strategy's weft::Precision; DataParallel reads its Reduce.
/// With Reduce = F32 (the default) gradients are reduced in T by MPI's
/// reductions. With BF16 or FP16 each bucket's gradient (padded, as above)
/// is rounded to that type (to nearest even) and exchanged with an
/// all-to-all, so that rank r receives every rank's chunk r in 2 bytes; it
/// adds them in float in rank order (0, 1, .., p-1), so the result does not
/// depend on MPI's reduction order: the 2-byte reduction's result is
/// sum_q float(round(g_q)). zero1 keeps that sum as its shard gradient,
/// zero2 and fsdp add it to theirs (microbatches accumulate in float); 
/// replicate rounds it to 2 bytes once more and all-gathers the chunks, so
/// every rank holds the same gradient, sum_q float(round(g_q)) rounded. The
/// bytes on the wire are half the fp32 reduction's (an all-to-all of the
/// padded bucket in 2 bytes, where a reduce-scatter moves it in 4; replicate
/// adds the all-gather of the chunks). Replicate's all-gathers run when the
/// step's gradients are finished (finish_gradients), in bucket order on
/// every rank.
template <class T, class Policy = Replicated, class Space = Kokkos::DefaultExecutionSpace, class Prec = Precision<>>
class DataParallel : public nn::GroupHooks {
  static_assert(is_precision_v<Prec>,
                "weft::parallel::DataParallel<T, Policy, Space, Prec>: Prec must be a weft::Precision<...> (the "
                "strategy's: typename S::precision)");
  // The 2-byte reduce type, or T.
  using R = std::conditional_t<is_reduced_precision_v<typename Prec::reduce_type>, typename Prec::reduce_type, T>;
  static constexpr bool kNarrowReduce = is_reduced_precision_v<R>;
  static_assert(is_dp_policy_v<Policy>,
                "weft::parallel::DataParallel<T, Policy, Space>: Policy must be a data-parallel policy: "
                "weft::Replicated, weft::ZeRO<1>, weft::ZeRO<2> or weft::FullyShard (a weft::DPStates<...>). The "
                "execution space is the third argument: write DataParallel<T, weft::Replicated, Space>, or "
                "DataParallelOf<T, Strategy, Space> to take the policy from a weft::Strategy");
  // The mode (replicate for a Policy the assertion above rejects, so that
  // only that assertion reports it).
  static constexpr DPMode M = [] {
    if constexpr (is_dp_policy_v<Policy>) return Policy::mode;
    else return DPMode::replicate;
  }();
  static constexpr bool kReplicate = M == DPMode::replicate;
  static constexpr bool kFsdp = M == DPMode::fsdp;
  // zero2 and fsdp: gradients reduce-scattered group by group every microbatch.
  static constexpr bool kGroupGrads = M == DPMode::zero2 || M == DPMode::fsdp;
  // zero1 and zero2: full parameters on every rank, updated shards all-gathered after the step.
  static constexpr bool kGatherAfterStep = M == DPMode::zero1 || M == DPMode::zero2;

 public:
  /// The DP policy (a weft::DPStates).
  using policy = Policy;
  /// The precision policy whose Reduce type the gradient reduction uses.
  using precision = Prec;
  /// The element type gradients travel in: T, or bf16 / fp16 (see above).
  using reduce_type = R;
  using Param = nn::Parameter<T, Space>;
  using Flat = Kokkos::View<T*, Space>;

  /// Takes over the parameters of `groups` (forward order; the last group is
  /// the root, used before the first and after the last block): their value
  /// and gradient views are re-pointed into weft's buffers. Collective over dp.
  DataParallel(Comm& dp, std::vector<std::vector<Param*>> groups, DPOptions o = {})
      : dp_(dp), o_(o), groups_(std::move(groups)), p_(static_cast<std::size_t>(dp.size())),
        r_(static_cast<std::size_t>(dp.rank())) {
    WEFT_REQUIRE(!groups_.empty(), ConfigError, "parallel::DataParallel: no parameter groups");
    WEFT_REQUIRE(o.bucket_mb > 0, ConfigError, "--bucket-mb ", o.bucket_mb, ": expected a positive size in MiB");
    root_ = groups_.size() - 1;
    build_buckets();
    allocate_and_adopt();
    group_state_.resize(groups_.size());
  }
  DataParallel(const DataParallel&) = delete;
  DataParallel& operator=(const DataParallel&) = delete;
  ~DataParallel() override {
    // Unwinding from an error: a peer may never join, so do not wait
    // (pending Requests then keep their buffers alive instead).
    if (std::uncaught_exceptions() == 0) drain();
  }

  /// The mode, in the planner's and the command line's vocabulary (fixed by Policy).
  static constexpr DPMode mode() { return M; }
  /// The DP communicator.
  Comm& comm() { return dp_; }

  /// The parameters the optimizer updates: all of them (replicate) or this
  /// rank's shard pieces, one per (parameter, owned chunk) intersection.
  std::vector<Param*> optimizer_parameters() {
    std::vector<Param*> out;
    if constexpr (kReplicate) {
      for (auto& g : groups_)
        for (auto* p : g) out.push_back(p);
    } else {
      for (auto& piece : pieces_) out.push_back(piece.get());
    }
    return out;
  }

  /// Where optimizer_parameters()[i] comes from: the parameter's name and the
  /// offset of the piece inside it (0 and whole parameters for replicate).
  struct PieceOrigin {
    std::string parameter;
    std::size_t offset = 0;
  };
  /// The origin of every optimizer parameter, in the same order.
  const std::vector<PieceOrigin>& piece_origins() const { return origins_; }

  /// Sets every gradient this rank accumulates to zero (start of a step).
  void zero_grad() {
    if (flat_grad_.extent(0)) Kokkos::deep_copy(flat_grad_, T(0));
    if (shard_grad_.extent(0)) Kokkos::deep_copy(shard_grad_, T(0));
  }

  /// Announces the next microbatch; gradients of replicate and zero1 are
  /// communicated only during the last one.
  void begin_microbatch(bool last) {
    last_microbatch_ = last;
    for (auto& b : buckets_) b.done_groups = 0;
    next_post_ = 0;
  }

  /// Completes every gradient reduction of the step.
  void finish_gradients() {
    if (sums_once_per_step())
      for (; next_post_ < buckets_.size(); ++next_post_) post_bucket(next_post_);
    drain();
  }

  /// Clips by the global gradient norm (over all shards) and returns the norm
  /// before clipping; max_norm <= 0 only measures. With a tensor-parallel
  /// communicator `tp` (the parameters are each rank's TP shards), the squares
  /// of TP-sharded parameters are summed over TP as well and those of
  /// TP-replicated ones counted once.
  double clip_grad_norm(double max_norm, Comm* tp = nullptr) {
    const double norm = std::sqrt(gradient_squares(tp));
    if (max_norm > 0 && norm > max_norm) scale_gradients(max_norm / (norm + 1e-6));
    return norm;
  }

  /// The squared global gradient norm of the parameters this engine holds
  /// (clip_grad_norm's sum before the square root): summed over the shards
  /// and, with `tp`, over TP for TP-sharded parameters. Collective over the
  /// DP communicator (sharded modes) and tp.
  double gradient_squares(Comm* tp = nullptr) {
    auto params = optimizer_parameters();
    using HostSums = Kokkos::View<double*, Kokkos::HostSpace, Kokkos::MemoryTraits<Kokkos::Unmanaged>>;
    double total = 0;
    if (tp == nullptr || tp->size() == 1) {
      for (auto* p : params) total += sum_squares(p->grad);
      if (!kReplicate && p_ > 1) dp_.all_reduce(HostSums(&total, 1));
    } else {
      double sums[2] = {0, 0};  // TP-sharded, TP-replicated
      for (auto* p : params) sums[p->tp_sharded() ? 0 : 1] += sum_squares(p->grad);
      if (!kReplicate && p_ > 1) dp_.all_reduce(HostSums(sums, 2));
      tp->all_reduce(HostSums(sums, 1));
      total = sums[0] + sums[1];
    }
    return total;
  }

  /// Multiplies every gradient this rank holds by f (clipping).
  void scale_gradients(double f) {
    for (auto* p : optimizer_parameters()) weft::detail::dp_scale(p->grad, T(f));
  }

  /// After the optimizer step: zero1/zero2 all-gather the updated shards into
  /// every rank's full parameters; fsdp has nothing to do (the shards are the
  /// parameters); replicate neither.
  void sync_parameters() {
    if constexpr (kFsdp) release_all();  // gathered copies are stale now
    if constexpr (kGatherAfterStep) {
      std::vector<Request> reqs;
      reqs.reserve(buckets_.size());
      for (auto& b : buckets_) {
        auto full = Kokkos::subview(flat_value_, std::make_pair(b.flat_off, b.flat_off + b.padded));
        auto mine = Kokkos::subview(full, std::make_pair(r_ * b.chunk, (r_ + 1) * b.chunk));
        Kokkos::deep_copy(b.send_tmp, mine);
        reqs.push_back(dp_.iall_gather(b.send_tmp, full));
      }
      for (auto& q : reqs) q.wait();
    }
  }

  /// Frees every gathered group (fsdp), e.g. after evaluation.
  void release_all() {
    if constexpr (kFsdp) {
      drain();
      for (std::size_t g = 0; g < groups_.size(); ++g) release(g);
    }
  }

  /// Persistent bytes per category on this rank (parameters, gradients) plus
  /// the peak of transient gathered buffers (fsdp parameters, zero2/fsdp
  /// group gradients) as "buffers".
  metrics::MemoryLedger memory() const {
    metrics::MemoryLedger m;
    using C = metrics::MemoryCategory;
    m.add(C::parameters, "dp.flat_parameters", bytes(flat_value_) + bytes(shard_value_));
    m.add(C::gradients, "dp.flat_gradients", bytes(flat_grad_) + bytes(shard_grad_));
    m.add(C::buffers, "dp.gathered_groups_peak", peak_transient_);
    // What the pool keeps beyond that peak (buffers of different sizes whose
    // peaks did not coincide); zero for the GPT's equal-sized blocks.
    m.add(C::buffers, "dp.group_buffer_pool_excess", retained_ > peak_transient_ ? retained_ - peak_transient_ : 0);
    std::size_t tmp = 0;
    for (const auto& b : buckets_)
      tmp += bytes(b.send_tmp) + bytes(b.rs_tmp) + b.send_bf16.span() * sizeof(bf16) + b.send_fp16.span() * sizeof(fp16);
    m.add(C::buffers, "dp.communication_buffers", tmp);
    return m;
  }

  /// Peak bytes of gathered parameters and group gradients held at once.
  std::size_t peak_transient_bytes() const { return peak_transient_; }

  // ------------------------------------------------------------- the hooks
  void before_forward(std::size_t g) override {
    if constexpr (kFsdp) {
      gather(g);
      if (o_.prefetch && g < root_ && g + 1 < root_) start_gather(g + 1);
      if (o_.prefetch && g == root_ && root_ > 0) start_gather(0);
      progress();
    }
  }
  void after_forward(std::size_t g) override {
    if constexpr (kFsdp)
      if (o_.reshard_after_forward && g != root_) release(g);
  }
  /// Split backwards (zero-bubble pipeline schedules) add weight gradients
  /// after after_backward, and run the input half of a group's next
  /// microbatch before the weight half of the previous one. With `on`, zero2
  /// and fsdp keep each group's full gradient buffer from the group's first
  /// backward of the step to after_weight_gradients, and reduce-scatter it
  /// there, once per step, instead of once per microbatch in after_backward
  /// (more gradient memory: every group's full gradient may be held at once).
  /// No effect in the other modes.
  void set_weight_gradients_deferred(bool on) { defer_weight_grads_ = on; }
  /// Whether zero2/fsdp wait for after_weight_gradients (see set_weight_gradients_deferred).
  bool weight_gradients_deferred() const { return defer_weight_grads_; }

  void before_backward(std::size_t g) override {
    if constexpr (kFsdp) {
      gather(g);
      if (o_.prefetch) {
        if (g == root_ && root_ > 0) start_gather(root_ - 1);
        else if (g != root_ && g > 0) start_gather(g - 1);
      }
    }
    if constexpr (kGroupGrads)
      if (!(defer_weight_grads_ && group_state_[g].full_grad.extent(0))) allocate_group_grad(g);
    progress();
  }
  void after_backward(std::size_t g) override {
    if constexpr (kGroupGrads) {
      if (!defer_weight_grads_) post_group_reduce_scatter(g);
      if constexpr (kFsdp) release(g);  // the deferred weight gemms read inputs and dy, not the weights
    } else if (o_.overlap && last_microbatch_) {
      for (auto bi : group_buckets_[g]) buckets_[bi].done_groups += 1;
      while (next_post_ < buckets_.size() && buckets_[next_post_].done_groups == buckets_[next_post_].groups.size())
        post_bucket(next_post_++);
    }
    progress();
  }
  void after_weight_gradients(std::size_t g) override {
    if constexpr (kGroupGrads)
      if (defer_weight_grads_) post_group_reduce_scatter(g);
    progress();
  }

 private:
  template <class H>
  using HalfFlat = Kokkos::View<H*, Space>;
  struct Bucket {
    std::vector<Param*> params;
    std::vector<std::size_t> param_off;  // offset of each parameter inside the bucket
    std::vector<std::size_t> groups;     // groups whose parameters it holds
    std::size_t size = 0, padded = 0, chunk = 0, flat_off = 0, shard_off = 0;
    // zero2/fsdp: offset of the bucket inside its group's gathered value and gradient buffers.
    std::size_t group_off = 0;
    std::size_t done_groups = 0;
    // fsdp: the 2-byte type its parameters are gathered in (f32: gathered in T).
    nn::ProductPrecision narrow = nn::ProductPrecision::f32;
    Flat send_tmp, rs_tmp;  // zero1/zero2 all-gather source; zero2/fsdp reduce-scatter target
    HalfFlat<bf16> send_bf16;  // fsdp narrow buckets: the owned chunk rounded to 2 bytes
    HalfFlat<fp16> send_fp16;
  };
  struct GroupState {
    bool gathered = false;
    std::vector<Request> gather_reqs;  // one per bucket of the group
    Flat full_value, full_grad;
    HalfFlat<bf16> recv_bf16;  // the narrow bucket as gathered, until widened into full_value
    HalfFlat<fp16> recv_fp16;
  };
  struct Pending {
    Request req;
    std::size_t bucket;
    bool accumulate;  // add rs_tmp into the shard gradients
    std::size_t group;
    bool last = true;  // the group's last bucket: free the group gradient after it
    Kokkos::View<R*, Space> nsend{}, nrecv{};  // 2-byte reduction: the all-to-all's buffers (pooled)
  };

  static constexpr bool sums_once_per_step() { return !kGroupGrads; }

  static std::size_t bytes(const Flat& v) { return v.span() * sizeof(T); }

  static double sum_squares(const Kokkos::View<T*, Space>& g) { return weft::detail::dp_sum_squares(g); }

  // Buckets in backward order: blocks last to first, then the root. zero2 and
  // fsdp: one bucket per group; replicate and zero1: parameters packed up to
  // bucket_mb (a parameter larger than that is a bucket of its own).
  void build_buckets() {
    std::vector<std::size_t> order;
    for (std::size_t g = root_; g-- > 0;) order.push_back(g);
    order.push_back(root_);
    group_buckets_.assign(groups_.size(), {});
    const std::size_t limit = std::max<std::size_t>(1, std::size_t(o_.bucket_mb * 1024.0 * 1024.0) / sizeof(T));
    const bool per_group = !sums_once_per_step();
    Bucket cur;
    auto close = [&] {
      if (cur.params.empty()) return;
      buckets_.push_back(std::move(cur));
      cur = Bucket{};
    };
    auto add = [&](Param* p, std::size_t g) {
      if (!per_group && cur.size > 0 && cur.size + p->size() > limit) close();
      cur.param_off.push_back(cur.size);
      cur.params.push_back(p);
      cur.size += p->size();
      if (cur.groups.empty() || cur.groups.back() != g) cur.groups.push_back(g);
    };
    for (std::size_t g : order) {
      if constexpr (kFsdp) {
        // The narrow bucket first (the parameters read as the group's first
        // 2-byte type), then the others, each in backward order.
        nn::ProductPrecision narrow = nn::ProductPrecision::f32;
        for (auto* p : groups_[g])
          if (narrow == nn::ProductPrecision::f32) narrow = p->read_as();
        if (narrow != nn::ProductPrecision::f32) {
          for (auto it = groups_[g].rbegin(); it != groups_[g].rend(); ++it)
            if ((*it)->read_as() == narrow) add(*it, g);
          cur.narrow = narrow;
          close();
        }
        for (auto it = groups_[g].rbegin(); it != groups_[g].rend(); ++it)
          if ((*it)->read_as() != narrow || narrow == nn::ProductPrecision::f32) add(*it, g);
      } else {
        for (auto it = groups_[g].rbegin(); it != groups_[g].rend(); ++it) add(*it, g);
      }
      if (per_group) close();
    }
    close();
    std::size_t flat = 0, shard = 0;
    group_padded_.assign(groups_.size(), 0);
    for (std::size_t b = 0; b < buckets_.size(); ++b) {
      auto& k = buckets_[b];
      k.chunk = (k.size + p_ - 1) / p_;
      k.padded = k.chunk * p_;
      k.flat_off = flat;
      k.shard_off = shard;
      flat += k.padded;
      shard += k.chunk;
      for (auto g : k.groups) group_buckets_[g].push_back(b);
      if (per_group) {
        k.group_off = group_padded_[k.groups.front()];
        group_padded_[k.groups.front()] += k.padded;
      }
    }
    flat_size_ = flat;
    shard_size_ = shard;
  }

  template <class V>
  static auto slice(const V& v, std::size_t off, std::size_t n) {
    return Kokkos::subview(v, std::make_pair(off, off + n));
  }

  // Copies the initial values into weft's buffers and re-points the
  // parameters: every rank built the same values (initialisation depends only
  // on seed and name), so each keeps what it needs.
  void allocate_and_adopt() {
    constexpr bool full_values = !kFsdp;
    if constexpr (full_values) flat_value_ = Flat("weft::dp.parameters", flat_size_);
    else shard_value_ = Flat("weft::dp.parameter_shard", shard_size_);
    if constexpr (sums_once_per_step()) flat_grad_ = Flat("weft::dp.gradients", flat_size_);
    if constexpr (!kReplicate) shard_grad_ = Flat("weft::dp.gradient_shard", shard_size_);
    for (auto& b : buckets_) {
      if constexpr (kGatherAfterStep) b.send_tmp = Flat("weft::dp.gather_send", b.chunk);
      if constexpr (kGroupGrads) b.rs_tmp = Flat("weft::dp.reduce_scatter_out", b.chunk);
      if (b.narrow == nn::ProductPrecision::bf16) b.send_bf16 = HalfFlat<bf16>("weft::dp.gather_send_bf16", b.chunk);
      if (b.narrow == nn::ProductPrecision::fp16) b.send_fp16 = HalfFlat<fp16>("weft::dp.gather_send_fp16", b.chunk);
      for (std::size_t i = 0; i < b.params.size(); ++i) {
        Param* p = b.params[i];
        const std::size_t off = b.param_off[i];
        if constexpr (full_values) {
          Kokkos::deep_copy(slice(flat_value_, b.flat_off + off, p->size()), p->value);
        } else {
          // Copy the part of this parameter that falls in the owned chunk.
          const std::size_t lo = std::max(off, r_ * b.chunk), hi = std::min(off + p->size(), (r_ + 1) * b.chunk);
          if (lo < hi)
            Kokkos::deep_copy(slice(shard_value_, b.shard_off + lo - r_ * b.chunk, hi - lo), slice(p->value, lo - off, hi - lo));
        }
      }
    }
    // Re-point (after all copies: a parameter's old storage is freed here).
    for (auto& b : buckets_) {
      for (std::size_t i = 0; i < b.params.size(); ++i) {
        Param* p = b.params[i];
        const std::size_t off = b.param_off[i];
        p->value = full_values ? Flat(slice(flat_value_, b.flat_off + off, p->size())) : Flat();
        p->grad = flat_grad_.extent(0) ? Flat(slice(flat_grad_, b.flat_off + off, p->size())) : Flat();
      }
    }
    if constexpr (kReplicate) {
      for (auto& g : groups_)
        for (auto* p : g) origins_.push_back(PieceOrigin{p->name(), 0});
    } else {
      // Optimizer pieces: the owned chunk of each bucket cut at parameter borders.
      for (auto& b : buckets_) {
        for (std::size_t i = 0; i < b.params.size(); ++i) {
          Param* p = b.params[i];
          const std::size_t off = b.param_off[i];
          const std::size_t lo = std::max(off, r_ * b.chunk), hi = std::min(off + p->size(), (r_ + 1) * b.chunk);
          // fsdp: the shard is the parameter's only storage between steps;
          // the parameter learns which part of it this rank keeps (possibly
          // none), so that a change made outside the optimizer (the MoE
          // selection bias) reaches it.
          if constexpr (kFsdp) {
            std::vector<typename Param::StoredPiece> mine;
            if (lo < hi) mine.push_back({lo - off, Flat(slice(shard_value_, b.shard_off + lo - r_ * b.chunk, hi - lo))});
            p->set_stored_pieces(std::move(mine));
          }
          if (lo >= hi) continue;
          const std::size_t in_shard = b.shard_off + lo - r_ * b.chunk;
          Flat v = full_values ? Flat(slice(flat_value_, b.flat_off + lo, hi - lo)) : Flat(slice(shard_value_, in_shard, hi - lo));
          Flat g = slice(shard_grad_, in_shard, hi - lo);
          origins_.push_back(PieceOrigin{p->name(), lo - off});
          pieces_.push_back(std::make_unique<Param>(p->name() + "[" + std::to_string(lo - off) + ":" + std::to_string(hi - off) + "]",
                                                    v, g, p->decay()));
          pieces_.back()->set_tp_sharded(p->tp_sharded());
        }
      }
    }
  }

  // Gathered parameters and group gradients come and go every microbatch.
  // Freed buffers wait in a pool for the next group of the same size: fresh
  // allocations of tens of MiB each time cost page faults and unmapping on
  // every use. The pool never holds more than the peak of live buffers.
  Flat take(std::size_t n, bool zero) {
    for (auto it = pool_.begin(); it != pool_.end(); ++it) {
      if (it->extent(0) != n) continue;
      Flat v = *it;
      pool_.erase(it);
      if (zero) Kokkos::deep_copy(v, T(0));
      return v;
    }
    retained_ += n * sizeof(T);
    return zero ? Flat("weft::dp.group_buffer", n)
                : Flat(Kokkos::view_alloc(Kokkos::WithoutInitializing, "weft::dp.group_buffer"), n);
  }
  void give_back(const Flat& v) {
    if (v.extent(0)) pool_.push_back(v);
  }
  // The same for the 2-byte receive buffers of narrow gathers.
  template <class H>
  std::vector<HalfFlat<H>>& half_pool() {
    static_assert(is_reduced_precision_v<H>);
    if constexpr (std::is_same_v<H, bf16>) return pool_bf16_;
    else return pool_fp16_;
  }
  template <class H>
  HalfFlat<H> take_half(std::size_t n) {
    auto& pool = half_pool<H>();
    for (auto it = pool.begin(); it != pool.end(); ++it) {
      if (it->extent(0) != n) continue;
      HalfFlat<H> v = *it;
      pool.erase(it);
      return v;
    }
    retained_ += n * sizeof(H);
    return HalfFlat<H>(Kokkos::view_alloc(Kokkos::WithoutInitializing, "weft::dp.group_buffer_2byte"), n);
  }
  template <class H>
  void give_back_half(HalfFlat<H>& v) {
    if (!v.extent(0)) return;
    track(-std::ptrdiff_t(v.span() * sizeof(H)));
    half_pool<H>().push_back(v);
    v = HalfFlat<H>();
  }
  template <class H>
  static HalfFlat<H>& recv_of(GroupState& s) {
    if constexpr (std::is_same_v<H, bf16>) return s.recv_bf16;
    else return s.recv_fp16;
  }
  template <class H>
  static HalfFlat<H>& send_of(Bucket& b) {
    if constexpr (std::is_same_v<H, bf16>) return b.send_bf16;
    else return b.send_fp16;
  }

  void track(std::ptrdiff_t delta) {
    transient_ = std::size_t(std::ptrdiff_t(transient_) + delta);
    peak_transient_ = std::max(peak_transient_, transient_);
  }

  // fsdp: start the all-gather of group g's parameters (its buckets; one per group).
  // A group without parameters (e.g. the dense blocks in ExpertDataParallel's
  // experts engine) has no bucket: nothing to gather, reduce or free.
  bool no_bucket(std::size_t g) const { return group_buckets_[g].empty(); }
  void start_gather(std::size_t g) {
    auto& s = group_state_[g];
    if (no_bucket(g) || s.gathered || !s.gather_reqs.empty()) return;
    s.full_value = take(group_padded_[g], false);
    track(std::ptrdiff_t(bytes(s.full_value)));
    for (auto bi : group_buckets_[g]) {
      auto& b = buckets_[bi];
      auto mine = slice(shard_value_, b.shard_off, b.chunk);
      if (b.narrow == nn::ProductPrecision::bf16) start_narrow_gather<bf16>(s, b, mine);
      else if (b.narrow == nn::ProductPrecision::fp16) start_narrow_gather<fp16>(s, b, mine);
      else s.gather_reqs.push_back(dp_.iall_gather(mine, slice(s.full_value, b.group_off, b.padded)));
    }
  }
  template <class H, class V>
  void start_narrow_gather(GroupState& s, Bucket& b, const V& mine) {
    auto& send = send_of<H>(b);
    weft::convert(send, mine);  // the layer's own rounding, applied once to the owned chunk
    typename Space::execution_space().fence();
    auto& recv = recv_of<H>(s);
    recv = take_half<H>(b.padded);
    track(std::ptrdiff_t(recv.span() * sizeof(H)));
    s.gather_reqs.push_back(dp_.iall_gather(send, recv));
  }
  template <class H>
  void widen(GroupState& s, const Bucket& b) {
    auto& recv = recv_of<H>(s);
    weft::convert(slice(s.full_value, b.group_off, b.padded), recv);  // exact
    typename Space::execution_space().fence();
    give_back_half<H>(recv);
  }
  void gather(std::size_t g) {
    auto& s = group_state_[g];
    if (no_bucket(g) || s.gathered) return;
    start_gather(g);
    for (auto& q : s.gather_reqs) q.wait();
    s.gather_reqs.clear();
    s.gathered = true;
    for (auto bi : group_buckets_[g]) {
      const auto& b = buckets_[bi];
      if (b.narrow == nn::ProductPrecision::bf16) widen<bf16>(s, b);
      if (b.narrow == nn::ProductPrecision::fp16) widen<fp16>(s, b);
      for (std::size_t i = 0; i < b.params.size(); ++i)
        b.params[i]->value = Flat(slice(s.full_value, b.group_off + b.param_off[i], b.params[i]->size()));
    }
  }
  void release(std::size_t g) {
    auto& s = group_state_[g];
    for (auto& q : s.gather_reqs) q.wait();
    s.gather_reqs.clear();
    give_back_half<bf16>(s.recv_bf16);  // a prefetched gather that was never used
    give_back_half<fp16>(s.recv_fp16);
    if (!s.full_value.extent(0)) return;
    track(-std::ptrdiff_t(bytes(s.full_value)));
    give_back(s.full_value);
    s.full_value = Flat();  // a moved-from Kokkos 3.4 view may still point at its data
    s.gathered = false;
    for (auto* p : groups_[g]) p->value = Flat();
  }

  // zero2/fsdp: a zeroed full gradient for group g while its backward runs.
  void allocate_group_grad(std::size_t g) {
    if (no_bucket(g)) return;
    auto& s = group_state_[g];
    // The previous microbatch's reduction of this group may still be in
    // flight on the old buffer: finish it (and what was posted before it).
    while (s.full_grad.extent(0) && !pending_.empty()) {
      complete(pending_.front());
      pending_.pop_front();
    }
    s.full_grad = take(group_padded_[g], true);
    track(std::ptrdiff_t(bytes(s.full_grad)));
    for (auto bi : group_buckets_[g]) {
      const auto& b = buckets_[bi];
      for (std::size_t i = 0; i < b.params.size(); ++i)
        b.params[i]->grad = Flat(slice(s.full_grad, b.group_off + b.param_off[i], b.params[i]->size()));
    }
  }
  void post_group_reduce_scatter(std::size_t g) {
    if (no_bucket(g)) return;
    for (auto bi : group_buckets_[g]) {
      auto& b = buckets_[bi];
      const bool last = bi == group_buckets_[g].back();
      auto full = slice(group_state_[g].full_grad, b.group_off, b.padded);
      if constexpr (kNarrowReduce) post_narrow(bi, full, true, g, last);
      else pending_.push_back(Pending{dp_.ireduce_scatter(full, b.rs_tmp), bi, true, g, last});
    }
  }
  // The 2-byte reduction of one bucket's padded gradient `full`: rounded,
  // then exchanged (complete() sums what arrives).
  template <class V>
  void post_narrow(std::size_t bi, const V& full, bool accumulate, std::size_t g, bool last) {
    auto& b = buckets_[bi];
    auto send = take_half<R>(b.padded), recv = take_half<R>(b.padded);
    track(std::ptrdiff_t(2 * b.padded * sizeof(R)));
    weft::convert(send, full);
    typename Space::execution_space().fence();
    Pending q{dp_.iall_to_all(send, recv), bi, accumulate, g, last};
    q.nsend = send;
    q.nrecv = recv;
    pending_.push_back(std::move(q));
  }

  // replicate: all-reduce the bucket in place; zero1: reduce-scatter it into the shard.
  void post_bucket(std::size_t bi) {
    auto& b = buckets_[bi];
    if constexpr (kNarrowReduce) {
      post_narrow(bi, slice(flat_grad_, b.flat_off, b.padded), false, 0, true);
    } else if constexpr (kReplicate) {
      pending_.push_back(Pending{dp_.iall_reduce(slice(flat_grad_, b.flat_off, b.size)), bi, false, 0});
    } else {
      auto full = slice(flat_grad_, b.flat_off, b.padded);
      pending_.push_back(Pending{dp_.ireduce_scatter(full, slice(shard_grad_, b.shard_off, b.chunk)), bi, false, 0});
    }
  }

  void complete(Pending& q) {
    q.req.wait();
    auto& b = buckets_[q.bucket];
    if constexpr (kNarrowReduce) {
      if constexpr (kReplicate) {
        // Sum into the first chunk of the (no longer needed) send buffer,
        // rounded, and all-gather the chunks into the receive buffer.
        auto sum = slice(q.nsend, 0, b.chunk);
        weft::detail::dp_sum_blocks<Space>(sum, q.nrecv, b.chunk, p_, false);
        typename Space::execution_space().fence();
        dp_.all_gather(sum, q.nrecv);
        weft::convert(slice(flat_grad_, b.flat_off, b.padded), q.nrecv);
      } else {
        weft::detail::dp_sum_blocks<Space>(slice(shard_grad_, b.shard_off, b.chunk), q.nrecv, b.chunk, p_, q.accumulate);
      }
      typename Space::execution_space().fence();
      give_back_half<R>(q.nsend);
      give_back_half<R>(q.nrecv);
    }
    if (!q.accumulate) return;
    if constexpr (!kNarrowReduce)
      weft::detail::dp_accumulate<Space>(slice(shard_grad_, b.shard_off, b.chunk), b.rs_tmp, b.chunk);
    if (!q.last) return;
    auto& s = group_state_[q.group];
    track(-std::ptrdiff_t(bytes(s.full_grad)));
    give_back(s.full_grad);
    s.full_grad = Flat();
    for (auto* p : groups_[q.group]) p->grad = Flat();
  }
  // Lets MPI advance posted operations; completes those at the front that are done.
  // (Replicate's 2-byte reduction completes only in drain(): its completion
  // starts an all-gather, which every rank must start in the same order.)
  void progress() {
    if constexpr (kNarrowReduce && kReplicate) {
      for (auto& q : pending_) (void)q.req.test();
      return;
    }
    while (!pending_.empty() && pending_.front().req.test()) {
      complete(pending_.front());
      pending_.pop_front();
    }
  }
  void drain() {
    while (!pending_.empty()) {
      complete(pending_.front());
      pending_.pop_front();
    }
  }

  Comm& dp_;
  DPOptions o_;
  std::vector<std::vector<Param*>> groups_;
  std::size_t p_, r_, root_ = 0;
  std::vector<Bucket> buckets_;
  std::vector<std::vector<std::size_t>> group_buckets_;
  std::vector<std::size_t> group_padded_;  // zero2/fsdp: padded elements of each group's buckets together
  std::size_t flat_size_ = 0, shard_size_ = 0;
  Flat flat_value_, flat_grad_, shard_value_, shard_grad_;
  std::vector<std::unique_ptr<Param>> pieces_;
  std::vector<PieceOrigin> origins_;
  std::vector<GroupState> group_state_;
  std::vector<Flat> pool_;
  std::vector<HalfFlat<bf16>> pool_bf16_;
  std::vector<HalfFlat<fp16>> pool_fp16_;
  std::size_t retained_ = 0;  // bytes of group buffers allocated (live or pooled)
  std::deque<Pending> pending_;
  std::size_t next_post_ = 0;
  bool last_microbatch_ = true;
  bool defer_weight_grads_ = false;  // zero2/fsdp reduce-scatter in after_weight_gradients
  std::size_t transient_ = 0, peak_transient_ = 0;
};

/// True for the DataParallel instantiations.
template <class X>
inline constexpr bool is_data_parallel_v = false;
template <class T, class Policy, class Space, class Prec>
inline constexpr bool is_data_parallel_v<DataParallel<T, Policy, Space, Prec>> = true;
/// A DataParallel<T, Policy, Space> (what train_step takes).
template <class X>
concept DataParallelType = is_data_parallel_v<X>;

/// The DataParallel a strategy selects: a DataParallel<T, P, Space> whose
/// policy P is S's DP policy (Replicated when S leaves DP out), checked
/// against the mesh and the model it serves.
///
///   using S = weft::Strategy<weft::On<weft::DP, weft::ZeRO<1>>, weft::On<weft::TP, weft::TensorParallel<>>>;
///   weft::parallel::DataParallelOf<float, S> dp(mesh, stage);  // stage: a pipeline::LayerStage, or the model
///
/// The (mesh, model) constructor is the checked entry:
/// - at compile time, weft::check_strategy_mesh<S, Mesh> (every policy's axis
///   is in the mesh; the static extents S needs) and
///   weft::check_strategy_model<S, M> (the model takes S's sequence, context
///   and expert parallelism, as its `policies` declares; a LayerStage
///   declares its model's);
/// - at run time, weft::validate_strategy<S>(mesh): every axis S leaves out has
///   extent 1, and the extents S needs.
/// It reduces gradients over the DP axis, or over DP x CP (mesh.axes<DP, CP>())
/// when S has a Context entry, and takes model.parameter_groups(). An Experts
/// entry does not compile here: expert parameters reduce over a different
/// group (parallel::ExpertDataParallel).
///
/// The (comm, groups) constructor is DataParallel's own, for a strategy with
/// none of sequence, context or expert parallelism; with one of them it does
/// not compile (the model could not be checked).
template <class T, StrategyType S, class Space = Kokkos::DefaultExecutionSpace>
class DataParallelOf : public DataParallel<T, typename S::data_parallel, Space, precision_of_t<S>> {
  using Base = DataParallel<T, typename S::data_parallel, Space, precision_of_t<S>>;

 public:
  /// The strategy it was built for.
  using strategy = S;

  /// Serves `model` (anything with parameter_groups(): a model, a
  /// pipeline::LayerStage, a pipeline::Stage) on `mesh`, after the checks
  /// above. Collective over the mesh (the DP x CP communicator may be created).
  template <class MeshT, class Model>
    requires requires(Model& m) { m.parameter_groups(); }
  DataParallelOf(MeshT& mesh, Model& model, DPOptions o = {})
      : Base(checked_comm<Model>(mesh), model.parameter_groups(), o) {
    // Only once the model has passed check_strategy_model (it declares
    // .context = true): otherwise that check's sentence is the one to read.
    if constexpr (S::template has<CP> && model_policies<Model>().context) {
      static_assert(requires { model.context_parallel().size(); },
                    "weft::parallel::DataParallelOf<T, S>(mesh, model): S has a Context<...> entry and the model "
                    "declares .context = true, but it does not say how its sequences are split: give the model "
                    "context_parallel(), returning its nn::ContextSplit over mesh.axis<CP>() (nn::ContextLayeredModel)");
      if constexpr (requires { model.context_parallel().size(); })
        WEFT_REQUIRE(std::size_t(model.context_parallel().size()) == std::size_t(mesh.template extent<CP>()), ConfigError,
                     "weft::parallel::DataParallelOf<T, S>(mesh, model): S has ", S::name(), " on a CP axis of extent ",
                     mesh.template extent<CP>(), ", but the model splits its sequences over ",
                     model.context_parallel().size(),
                     " ranks; build the model with the CP axis' context (weft::context::attention_of<Policy, "
                     "T>(mesh.axis<CP>()), or an nn::ContextSplit over mesh.axis<CP>())");
    }
  }

  /// DataParallel's own constructor, for a strategy without sequence, context
  /// or expert parallelism (see above).
  DataParallelOf(Comm& dp, std::vector<std::vector<typename Base::Param*>> groups, DPOptions o = {})
      : Base(dp, std::move(groups), o) {
    static_assert(!S::sequence_parallel && !S::template has<CP> && !S::expert_parallel_v,
                  "weft::parallel::DataParallelOf<T, S>(comm, groups): the strategy has sequence, context or expert "
                  "parallelism, which only a model can honour, and a communicator with parameter groups cannot show "
                  "that the model does; construct it from the mesh and the model, DataParallelOf<T, S>(mesh, model), "
                  "which checks both");
  }

 private:
  template <class Model, class MeshT>
  static Comm& checked_comm(MeshT& mesh) {
    static_assert(check_strategy_mesh<S, MeshT>());  // the mesh first: a missing axis is the first thing to fix
    static_assert(check_strategy_model<S, Model>());
    static_assert(!S::expert_parallel_v,
                  "weft::parallel::DataParallelOf<T, S>(mesh, model): S has an Experts<N> entry, whose expert "
                  "parameters reduce over DP only and the others over DP x EP; use parallel::ExpertDataParallel");
    static_assert(MeshT::template has_axis<DP>,
                  "weft::parallel::DataParallelOf<T, S>(mesh, model): the mesh has no DP axis to reduce the "
                  "gradients over; add one (weft::Mesh<weft::DP, ...>, extent 1 for a single replica)");
    validate_strategy<S>(mesh);
    if constexpr (S::template has<CP>) return mesh.template axes<DP, CP>();
    else return mesh.template axis<DP>();
  }
};

template <class T, class S, class Space>
inline constexpr bool is_data_parallel_v<DataParallelOf<T, S, Space>> = true;

}  // namespace weft::parallel
