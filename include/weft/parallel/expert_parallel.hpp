// Data parallelism for a model whose mixture-of-experts blocks are split over
// an EP axis (weft::Experts<N>, EP folded over DP): the EP ranks are data
// ranks too, so everything outside the routed experts -- attention, norms,
// embeddings, routers, shared experts -- is replicated over DP x EP and its
// gradients are summed there, while each routed expert lives on one EP rank
// of every DP replica and its gradients are summed over DP alone.
// ExpertDataParallel holds one DataParallel engine for each of the two sets,
// both with the strategy's DP policy, and offers DataParallel's interface, so
// parallel::train_step and the optimizers take it as they take DataParallel.
#pragma once

#include <cmath>
#include <utility>
#include <vector>

#include <weft/parallel/data_parallel.hpp>

namespace weft::parallel {

/// Data parallelism of a model with experts split over EP. `data` is the
/// DP x EP group (mesh.axes<DP, EP>(), the model's ExpertSplit::data),
/// `replicas` the ranks that hold the same experts (mesh.axis<DP>()), `ep`
/// the EP axis. Parameters marked ep_sharded (nn::MoE's routed experts under
/// expert parallelism) go to the replicas' engine, all others to the data
/// group's. Gradient clipping takes the norm over both sets (the experts'
/// squares summed over EP).
template <class T, class Policy = Replicated, class Space = Kokkos::DefaultExecutionSpace>
class ExpertDataParallel final : public nn::GroupHooks {
 public:
  /// The DP policy of both engines (a weft::DPStates).
  using policy = Policy;
  using Param = nn::Parameter<T, Space>;
  using Engine = DataParallel<T, Policy, Space>;
  /// Gradients are reduced in T (a 2-byte Reduce is not implemented here:
  /// parallel::train_step refuses a model that asks for one).
  using reduce_type = T;

  /// Takes over the parameters of `groups` (forward order, root last, as
  /// DataParallel). Collective over data, replicas and ep.
  ExpertDataParallel(Comm& data, Comm& replicas, Comm& ep, std::vector<std::vector<Param*>> groups, DPOptions o = {})
      : data_(data),
        ep_(ep),
        dense_(data, part(groups, false), o),
        experts_(replicas, part(groups, true), o) {
    WEFT_REQUIRE(data.size() == replicas.size() * ep.size(), ConfigError, "parallel::ExpertDataParallel: the data group has ",
                 data.size(), " ranks, but DP x EP = ", replicas.size(), " x ", ep.size());
  }

  /// The mode (fixed by Policy).
  static constexpr DPMode mode() { return Engine::mode(); }
  /// The DP x EP communicator: the ranks that split the global batch.
  Comm& comm() { return data_; }
  /// The engine of everything but the routed experts (over DP x EP).
  Engine& dense() { return dense_; }
  /// The engine of this rank's routed experts (over DP).
  Engine& experts() { return experts_; }

  /// The parameters the optimizer updates: the dense engine's, then the experts'.
  std::vector<Param*> optimizer_parameters() {
    auto a = dense_.optimizer_parameters();
    auto b = experts_.optimizer_parameters();
    a.insert(a.end(), b.begin(), b.end());
    return a;
  }
  /// Where each optimizer parameter comes from, in the same order.
  std::vector<typename Engine::PieceOrigin> piece_origins() const {
    auto a = dense_.piece_origins();
    const auto& b = experts_.piece_origins();
    a.insert(a.end(), b.begin(), b.end());
    return a;
  }

  /// Zeroes every gradient (start of a step).
  void zero_grad() {
    dense_.zero_grad();
    experts_.zero_grad();
  }
  /// Announces the next microbatch.
  void begin_microbatch(bool last) {
    dense_.begin_microbatch(last);
    experts_.begin_microbatch(last);
  }
  /// Completes every gradient reduction of the step.
  void finish_gradients() {
    dense_.finish_gradients();
    experts_.finish_gradients();
  }
  /// Clips by the norm of all gradients of the model (every expert of every
  /// EP rank counted once) and returns it before clipping.
  double clip_grad_norm(double max_norm, Comm* tp = nullptr) {
    const double norm = std::sqrt(gradient_squares(tp));
    if (max_norm > 0 && norm > max_norm) scale_gradients(max_norm / (norm + 1e-6));
    return norm;
  }
  /// The squared norm of all gradients this rank's model holds (clip_grad_norm's
  /// sum before the square root): the dense engine's, plus the experts'
  /// summed over EP. Collective over the data group, DP, EP and tp.
  double gradient_squares(Comm* tp = nullptr) {
    double ex = experts_.gradient_squares(tp);
    Kokkos::View<double*, Kokkos::HostSpace, Kokkos::MemoryTraits<Kokkos::Unmanaged>> v(&ex, 1);
    ep_.all_reduce(v);
    return dense_.gradient_squares(tp) + ex;
  }
  /// Multiplies every gradient this rank holds by f (clipping).
  void scale_gradients(double f) {
    dense_.scale_gradients(f);
    experts_.scale_gradients(f);
  }
  /// DataParallel::set_weight_gradients_deferred for both engines (schedules
  /// that split backward, pipeline::ZeroBubble).
  void set_weight_gradients_deferred(bool on) {
    dense_.set_weight_gradients_deferred(on);
    experts_.set_weight_gradients_deferred(on);
  }
  /// After the optimizer step (DataParallel::sync_parameters for both sets).
  void sync_parameters() {
    dense_.sync_parameters();
    experts_.sync_parameters();
  }
  /// Frees every gathered group (fully sharded).
  void release_all() {
    dense_.release_all();
    experts_.release_all();
  }
  /// Both engines' bytes, the experts' labelled "experts.".
  metrics::MemoryLedger memory() const {
    metrics::MemoryLedger m = dense_.memory();
    const metrics::MemoryLedger e = experts_.memory();
    for (const auto& it : e.items()) m.add(it.category, "experts." + it.label, it.bytes);
    return m;
  }

  void before_forward(std::size_t g) override {
    dense_.before_forward(g);
    experts_.before_forward(g);
  }
  void after_forward(std::size_t g) override {
    dense_.after_forward(g);
    experts_.after_forward(g);
  }
  void before_backward(std::size_t g) override {
    dense_.before_backward(g);
    experts_.before_backward(g);
  }
  void after_backward(std::size_t g) override {
    dense_.after_backward(g);
    experts_.after_backward(g);
  }
  void after_weight_gradients(std::size_t g) override {
    dense_.after_weight_gradients(g);
    experts_.after_weight_gradients(g);
  }

 private:
  static std::vector<std::vector<Param*>> part(const std::vector<std::vector<Param*>>& groups, bool experts) {
    std::vector<std::vector<Param*>> out(groups.size());
    for (std::size_t g = 0; g < groups.size(); ++g)
      for (auto* p : groups[g])
        if (p->ep_sharded() == experts) out[g].push_back(p);
    return out;
  }

  Comm& data_;
  Comm& ep_;
  Engine dense_, experts_;
};

template <class T, class Policy, class Space>
inline constexpr bool is_data_parallel_v<ExpertDataParallel<T, Policy, Space>> = true;

}  // namespace weft::parallel
