// Runs a pipeline schedule's plan for this rank over the PP-axis communicator:
// receives are posted ahead (the input of the next compute is in flight while
// the current one runs), sends are non-blocking, every wait has a deadline so
// that a failed peer ends the run with a CommError instead of a hang, and the
// optimizer step follows the flush. Also names the schedules on the command
// line (gpipe|1f1b|interleaved:V|zb).
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <set>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include <weft/comm/comm.hpp>
#include <weft/data/stream.hpp>
#include <weft/optim/train_step.hpp>
#include <weft/parallel/data_parallel.hpp>
#include <weft/parallel/train_step.hpp>
#include <weft/parallel/pipeline/send_cap.hpp>
#include <weft/parallel/pipeline/stage.hpp>
#include <weft/parallel/schedule.hpp>

namespace weft::pipeline {

/// A schedule chosen at run time: its name, chunks per rank, whether it splits
/// the backward, and its plans, checks and analytic bubble (from the schedule
/// types of weft/parallel/schedule.hpp).
struct ScheduleChoice {
  std::string name;     ///< "gpipe", "1f1b", "interleaved:V" or "zb"
  int chunks = 1;       ///< model chunks (virtual stages) per rank
  bool split = false;   ///< backward split into input and weight halves
  std::function<void(int, int)> check;                              ///< throws ConfigError for a bad (p, m)
  std::function<std::vector<PipeAction>(int, int, int)> plan;       ///< (p, m, rank) -> actions
  std::function<double(int, int, const PipeCosts&)> bubble;         ///< analytic idle fraction
  std::function<int(int, int, int)> peak_in_flight;                 ///< (p, m, rank) -> chunk-microbatches
};

namespace detail {
template <class S>
ScheduleChoice make_choice(std::string name) {
  ScheduleChoice c;
  c.name = std::move(name);
  c.chunks = S::chunks;
  c.split = S::splits_backward;
  c.check = [](int p, int m) { S::check(p, m); };
  c.plan = [](int p, int m, int r) { return Pipeline<S>(p, m).plan(r); };
  c.bubble = [](int p, int m, const PipeCosts& k) { return S::bubble_fraction(p, m, k); };
  c.peak_in_flight = [](int p, int m, int r) { return S::peak_in_flight(p, m, r); };
  return c;
}
template <int V>
ScheduleChoice interleaved_choice(int v) {
  if constexpr (V > 8) {
    weft::detail::throw_error<ConfigError>("--schedule interleaved:", v,
                                           ": V (chunks per rank) must be between 2 and 8");
  } else {
    if (v == V) return make_choice<Interleaved1F1B<V>>("interleaved:" + std::to_string(V));
    return interleaved_choice<V + 1>(v);
  }
}
}  // namespace detail

/// Parses `--schedule gpipe|1f1b|interleaved:V|zb` (V from 2 to 8).
inline ScheduleChoice parse_schedule(std::string_view s) {
  if (s == "gpipe") return detail::make_choice<GPipe>("gpipe");
  if (s == "1f1b") return detail::make_choice<OneFOneB>("1f1b");
  if (s == "zb") return detail::make_choice<ZeroBubble>("zb");
  if (s.rfind("interleaved:", 0) == 0) {
    const std::string v(s.substr(12));
    std::size_t pos = 0;
    int x = 0;
    try {
      x = std::stoi(v, &pos);
    } catch (...) {
      pos = 0;
    }
    WEFT_REQUIRE(!v.empty() && pos == v.size() && x >= 2 && x <= 8, ConfigError, "--schedule ", s,
                 ": V (chunks per rank) must be an integer between 2 and 8, e.g. interleaved:2");
    return detail::interleaved_choice<2>(x);
  }
  weft::detail::throw_error<ConfigError>("--schedule ", s, ": unknown schedule; expected gpipe, 1f1b, interleaved:V or zb");
}

/// One operation of a rank's step as it ran: compute (forward, backward, its
/// halves) or the time blocked waiting for a receive (recv_activation,
/// recv_gradient). Times are steady-clock seconds (comparable across the
/// processes of one node).
struct StepEvent {
  PipeOp op = PipeOp::forward;
  int microbatch = 0;
  int chunk = 0;
  double start = 0, end = 0;
};

/// Options of the executor.
struct ExecutorOptions {
  /// Longest wait for one message, in seconds, before the step ends with a
  /// CommError (a peer failed or hangs). Default: WEFT_DEADLINE, else 60.
  double deadline_s = weft::detail::checked_defaults().deadline_s;
  /// Called before each action of the plan, with its index (tracing, fault injection in tests).
  std::function<void(const PipeAction&, std::size_t)> before_action;
  /// Input-gradient sends a rank may hold in flight after their microbatch's
  /// activations are freed, each in a buffer of one message allocated up
  /// front; when all are in flight the rank waits for one to complete. -1:
  /// pipeline::default_send_cap(), the smallest cap of at least one that
  /// provably cannot deadlock the schedule (weft/parallel/pipeline/send_cap.hpp).
  /// A cap that can deadlock is a ConfigError.
  int send_buffers = -1;
};

/// Runs one rank's plan of a schedule on a Stage, over the PP communicator.
template <class T, class Space = Kokkos::DefaultExecutionSpace>
class Executor {
 public:
  /// `pp`: the PP-axis communicator (its rank is the pipeline rank and must
  /// equal stage.rank()); `microbatches` per step; the plan comes from `schedule`.
  Executor(Stage<T, Space>& stage, Comm& pp, const ScheduleChoice& schedule, int microbatches, ExecutorOptions o = {})
      : stage_(stage), pp_(pp), schedule_(schedule), m_(microbatches), o_(std::move(o)),
        ids_("pipeline.ids", std::size_t(microbatches) * stage.config().tokens()),
        targets_("pipeline.targets", std::size_t(microbatches) * stage.config().tokens()) {
    WEFT_REQUIRE(pp.size() == stage.ranks() && pp.rank() == stage.rank(), ConfigError, "pipeline::Executor: the PP communicator has rank ",
                 pp.rank(), " of ", pp.size(), ", but the stage was built for rank ", stage.rank(), " of ", stage.ranks());
    WEFT_REQUIRE(int(stage.chunks().size()) == schedule.chunks, ConfigError, "pipeline::Executor: schedule ", schedule.name,
                 " runs ", schedule.chunks, " chunks per rank, but the stage has ", stage.chunks().size());
    schedule.check(pp.size(), microbatches);
    plan_ = schedule.plan(pp.size(), microbatches, pp.rank());
    std::vector<std::vector<PipeAction>> plans;
    for (int r = 0; r < pp.size(); ++r) plans.push_back(r == pp.rank() ? plan_ : schedule.plan(pp.size(), microbatches, r));
    if (o_.send_buffers < 0) {
      cap_ = default_send_cap(plans);
    } else {
      cap_ = std::size_t(o_.send_buffers);
      if (!send_cap_is_deadlock_free(plans, cap_))
        weft::detail::throw_error<ConfigError>(
            "pipeline::Executor: ExecutorOptions::send_buffers = ", cap_, " can deadlock schedule ", schedule.name, " on ",
            pp.size(), " ranks with ", microbatches, " microbatches; the smallest safe value is ", smallest_send_cap(plans),
            " (or -1 for the default)");
    }
    stage.reserve_send_buffers(cap_);
    for (std::size_t k = 0; k < plan_.size(); ++k) {
      const PipeOp op = plan_[k].op;
      if (op == PipeOp::recv_activation || op == PipeOp::recv_gradient) recvs_.push_back(k);
    }
    // The last action per chunk that adds weight gradients: after it the
    // chunk's weight gradients of the step are complete.
    last_weight_.assign(plan_.size(), false);
    std::vector<std::size_t> last(std::size_t(schedule.chunks), plan_.size());
    for (std::size_t k = 0; k < plan_.size(); ++k)
      if (plan_[k].op == PipeOp::backward || plan_[k].op == PipeOp::backward_weight)
        last[std::size_t(plan_[k].chunk)] = k;
    for (std::size_t k : last)
      if (k < plan_.size()) last_weight_[k] = true;
    next_compute_.assign(plan_.size() + 1, plan_.size());
    for (std::size_t k = plan_.size(); k-- > 0;)
      next_compute_[k] = is_compute(plan_[k].op) ? k : next_compute_[k + 1];
  }

  /// This rank's plan.
  const std::vector<PipeAction>& plan() const { return plan_; }
  /// The schedule.
  const ScheduleChoice& schedule() const { return schedule_; }
  /// Microbatches per step.
  int microbatches() const { return m_; }
  /// Detached input-gradient sends this rank may hold (ExecutorOptions::send_buffers).
  std::size_t send_buffers() const { return cap_; }
  /// The stage it runs.
  Stage<T, Space>& stage() { return stage_; }
  /// The PP communicator.
  Comm& comm() { return pp_; }
  /// Token ids of every microbatch of the step, [microbatches * tokens]; fill before run().
  const ops::Tokens<Space>& ids() const { return ids_; }
  /// Targets of every microbatch of the step, [microbatches * tokens].
  const ops::Tokens<Space>& targets() const { return targets_; }
  /// What the last run() did and when (compute and blocked receives).
  const std::vector<StepEvent>& timeline() const { return timeline_; }
  /// Steady-clock seconds at the start and end of the last run().
  std::pair<double, double> last_run_span() const { return {t_begin_, t_end_}; }

  /// Runs the plan once: forwards and backwards of every microbatch, with
  /// gradients accumulating grad_scale * d(sum of token losses). Returns the
  /// sum over microbatches of their mean token loss on the rank that holds
  /// the head (0 elsewhere).
  double run(double grad_scale) {
    timeline_.clear();
    retiring_.clear();
    grad_sent_.clear();
    next_post_ = 0;
    t_begin_ = now();
    stage_.set_progress([this] { progress(); });
    struct Unset {
      Stage<T, Space>& s;
      ~Unset() { s.set_progress({}); }
    } unset{stage_};
    const std::size_t tok = stage_.config().tokens();
    double loss = 0;
    for (std::size_t k = 0; k < plan_.size(); ++k) {
      const PipeAction& a = plan_[k];
      if (o_.before_action) o_.before_action(a, k);
      retire();
      complete_sends(false);
      auto ids = Kokkos::subview(ids_, std::make_pair(std::size_t(a.microbatch) * tok, std::size_t(a.microbatch + 1) * tok));
      auto tg = Kokkos::subview(targets_, std::make_pair(std::size_t(a.microbatch) * tok, std::size_t(a.microbatch + 1) * tok));
      switch (a.op) {
        case PipeOp::recv_activation:
        case PipeOp::recv_gradient: {
          post_until(k + 1);
          auto& s = stage_.slot(a.microbatch, a.chunk);
          const bool grad = a.op == PipeOp::recv_gradient;
          const double t0 = now();
          wait(grad ? s.recv_gradient : s.recv_activation, a);
          timeline_.push_back({a.op, a.microbatch, a.chunk, t0, now()});
          break;
        }
        case PipeOp::send_activation: {
          auto& s = stage_.slot(a.microbatch, a.chunk);
          s.send_activation = pp_.isend(s.xs.back(), a.peer, activation_tag);
          break;
        }
        case PipeOp::send_gradient: {
          auto& s = stage_.slot(a.microbatch, a.chunk);
          s.send_gradient = pp_.isend(s.dx, a.peer, gradient_tag);
          grad_sent_.insert({a.microbatch, a.chunk});
          break;
        }
        case PipeOp::forward: {
          post_until(next_compute_[k + 1]);
          const double t0 = now();
          const double sum = stage_.forward(a.microbatch, a.chunk, ids, tg, grad_scale);
          if (stage_.has_head(a.chunk)) loss += sum / double(tok);
          fence_and_record(a, t0);
          break;
        }
        case PipeOp::backward:
        case PipeOp::backward_input: {
          post_until(next_compute_[k + 1]);
          const double t0 = now();
          const bool split = a.op == PipeOp::backward_input;
          stage_.backward(a.microbatch, a.chunk, ids, split);
          fence_and_record(a, t0);
          if (!split) retiring_.push_back({a.microbatch, a.chunk});
          if (last_weight_[k]) stage_.weights_done(a.chunk);
          break;
        }
        case PipeOp::backward_weight: {
          post_until(next_compute_[k + 1]);
          const double t0 = now();
          stage_.backward_weight(a.microbatch, a.chunk);
          fence_and_record(a, t0);
          retiring_.push_back({a.microbatch, a.chunk});
          if (last_weight_[k]) stage_.weights_done(a.chunk);
          break;
        }
      }
    }
    // The flush: every message of the step completes before the optimizer runs.
    for (auto& key : retiring_) {
      auto& s = stage_.slot(key.first, key.second);
      wait(s.send_activation, PipeAction{PipeOp::send_activation, key.first, key.second, -1});
      wait(s.send_gradient, PipeAction{PipeOp::send_gradient, key.first, key.second, -1});
      stage_.release(key.first, key.second);
    }
    retiring_.clear();
    complete_sends(true);
    WEFT_REQUIRE(stage_.live_slots() == 0, Error, "pipeline::Executor: ", stage_.live_slots(),
                 " microbatch activations are still held after the flush; the plan of schedule ", schedule_.name,
                 " does not complete every backward on rank ", pp_.rank());
    t_end_ = now();
    return loss;
  }

  /// Waits for a message of the plan with the deadline; a CommError names
  /// the message, the peer and this rank.
  void wait(Request& r, const PipeAction& a) {
    wait_for(r, [&] {
      const bool send = a.op == PipeOp::send_activation || a.op == PipeOp::send_gradient;
      const bool grad = a.op == PipeOp::recv_gradient || a.op == PipeOp::send_gradient;
      return std::string(send ? "send" : "receive") + " the " + (grad ? "gradient" : "activation") + " of microbatch " +
             std::to_string(a.microbatch) + " chunk " + std::to_string(a.chunk) +
             (a.peer >= 0 ? std::string(send ? " to rank " : " from rank ").append(std::to_string(a.peer)) : std::string());
    });
  }

  /// Waits for any request on the pipeline with the deadline; `what()` says
  /// what was awaited, for the CommError.
  template <class Describe>
  void wait_for(Request& r, Describe&& what) {
    if (!r.active()) return;
    const double t0 = now();
    for (long spin = 0; !r.test(); ++spin) {
      if (now() - t0 > o_.deadline_s) deadline_passed(what());
      // Spin briefly, then yield, then sleep: on a node with more ranks than
      // cores a waiting rank must leave its core to the ranks that compute.
      if (spin > 4096) std::this_thread::sleep_for(std::chrono::microseconds(50));
      else if (spin > 64) std::this_thread::yield();
    }
  }

  /// Ends the run with the CommError of a wait past its deadline.
  [[noreturn]] void deadline_passed(const std::string& what) {
    weft::detail::comm_poisoned() = true;  // pending requests must not be waited for at destruction
    throw CommError("pipeline", pp_.name(),
                    "pipeline rank " + std::to_string(pp_.rank()) + " (schedule " + schedule_.name + "): waited " +
                        std::to_string(o_.deadline_s) + " s to " + what +
                        " without completing: a pipeline peer failed or hangs (deadline: "
                        "ExecutorOptions::deadline_s, WEFT_DEADLINE)");
  }

  /// Sum over this pipeline of `x` (a step-level reduction), with the deadline.
  double sum_over_pipeline(double x) {
    Kokkos::View<double*, Kokkos::HostSpace> v("pipeline.sum", 1);
    v(0) = x;
    Request r = pp_.iall_reduce(v);
    wait_for(r, [] { return std::string("sum a step total over the pipeline"); });
    return v(0);
  }

 private:
  static constexpr int activation_tag = 11, gradient_tag = 12;

  static double now() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
  }

  void fence_and_record(const PipeAction& a, double t0) {
    Kokkos::fence();
    timeline_.push_back({a.op, a.microbatch, a.chunk, t0, now()});
  }

  // Posts the receives of the plan that come before plan index `limit`, in
  // plan order (so that each channel's receives match its sends in order).
  void post_until(std::size_t limit) {
    for (; next_post_ < recvs_.size() && recvs_[next_post_] < limit; ++next_post_) {
      const PipeAction& a = plan_[recvs_[next_post_]];
      auto& s = stage_.slot(a.microbatch, a.chunk);
      if (a.op == PipeOp::recv_activation) s.recv_activation = pp_.irecv(s.xs[0], a.peer, activation_tag);
      else s.recv_gradient = pp_.irecv(s.dy, a.peer, gradient_tag);
    }
  }

  // Moves a pending gradient send and its buffer out of a slot (which gets a
  // spare buffer). With all cap_ spares in flight it first waits until one of
  // them, or this send, completes: send_cap.hpp shows that cannot deadlock.
  void detach(Request& r, ops::Matrix<T, Space>& buf, const std::pair<int, int>& key) {
    if (!r.active() || r.test()) return;
    complete_sends(false);
    if (sending_.size() >= cap_) {
      const double t0 = now();
      for (long spin = 0;; ++spin) {
        if (r.test()) return;
        complete_sends(false);
        if (sending_.size() < cap_) break;
        if (now() - t0 > o_.deadline_s)
          deadline_passed("complete the gradient send of microbatch " + std::to_string(key.first) + " chunk " +
                          std::to_string(key.second) + " or an earlier one (all " + std::to_string(cap_) +
                          " send buffers are in flight)");
        if (spin > 4096) std::this_thread::sleep_for(std::chrono::microseconds(50));
        else if (spin > 64) std::this_thread::yield();
      }
    }
    sending_.push_back({std::move(r), buf});
    buf = stage_.take_send_buffer();
  }
  // Returns the buffers of completed detached sends to the spares.
  void complete_sends(bool wait_all) {
    for (std::size_t i = 0; i < sending_.size();) {
      if (wait_all) wait_for(sending_[i].req, [] { return std::string("complete a send of this step"); });
      if (!sending_[i].req.test()) {
        ++i;
        continue;
      }
      stage_.return_send_buffer(sending_[i].buf);
      sending_.erase(sending_.begin() + long(i));
    }
  }

  // Lets MPI move posted messages while this rank computes.
  void progress() {
    complete_sends(false);
    for (std::size_t i = 0; i < next_post_; ++i) {
      const PipeAction& a = plan_[recvs_[i]];
      if (!stage_.has_slot(a.microbatch, a.chunk)) continue;
      auto& s = stage_.slot(a.microbatch, a.chunk);
      (a.op == PipeOp::recv_activation ? s.recv_activation : s.recv_gradient).test();
    }
    for (auto& key : retiring_) {
      auto& s = stage_.slot(key.first, key.second);
      s.send_activation.test();
      s.send_gradient.test();
    }
  }

  // Frees the activations of microbatches whose backward is complete and
  // whose messages have gone.
  void retire() {
    for (std::size_t i = 0; i < retiring_.size();) {
      const auto key = retiring_[i];
      auto& s = stage_.slot(key.first, key.second);
      const std::size_t vs = stage_.chunks()[std::size_t(key.second)].virtual_stage;
      const bool grad_done = vs == 0 || grad_sent_.count(key) != 0;
      if (grad_done) {
        // The activation has been consumed (its output gradient came back),
        // so its send completes without any further step of the peer. A
        // gradient send still in flight keeps only its own buffer, not the
        // slot: the activations are free as soon as the backward is complete.
        wait(s.send_activation, PipeAction{PipeOp::send_activation, key.first, key.second, -1});
        detach(s.send_gradient, s.dx, key);
        stage_.release(key.first, key.second);
        retiring_.erase(retiring_.begin() + long(i));
      } else {
        ++i;
      }
    }
  }

  Stage<T, Space>& stage_;
  Comm& pp_;
  ScheduleChoice schedule_;
  int m_;
  ExecutorOptions o_;
  ops::Tokens<Space> ids_, targets_;
  std::vector<PipeAction> plan_;
  std::vector<std::size_t> recvs_, next_compute_;
  std::vector<bool> last_weight_;  // plan index: the chunk's last weight-gradient action of the step
  std::size_t next_post_ = 0;
  std::vector<std::pair<int, int>> retiring_;
  std::set<std::pair<int, int>> grad_sent_;
  struct InFlightSend {
    Request req;
    ops::Matrix<T, Space> buf;
  };
  std::vector<InFlightSend> sending_;
  std::size_t cap_ = 1;  // most detached gradient sends (preallocated buffers)
  std::vector<StepEvent> timeline_;
  double t_begin_ = 0, t_end_ = 0;
};

/// One optimizer step of a pipeline (optionally composed with data
/// parallelism over `dp`, whose hooks the stage must call): every DP rank
/// takes its slice of the global batch (the same sequences as the
/// single-process run), the plan runs its microbatches, gradients are reduced
/// over DP after the flush, clipped by the global norm (over every stage and
/// shard) and applied. Returns the global mean loss (identical on every rank)
/// and the gradient norm before clipping.
template <class T, class Space, class DP, class Optimizer>
optim::StepResult train_step(Executor<T, Space>& ex, DP* dp, Optimizer& opt,
                             const data::TokenStream& data, std::uint64_t step, std::size_t global_batch, double lr,
                             double clip) {
  auto& stage = ex.stage();
  const std::size_t m = std::size_t(ex.microbatches());
  const std::size_t ndp = dp ? std::size_t(dp->comm().size()) : 1;
  const std::size_t mb = parallel::local_microbatch(global_batch, ndp, m);
  WEFT_REQUIRE(mb == stage.config().batch, ConfigError, "pipeline::train_step: the stage is built for microbatches of ",
               stage.config().batch, " sequences, but batch ", global_batch, " / dp ", ndp, " / microbatches ", m, " = ", mb);
  // zb adds weight gradients after the group hooks' after_backward: zero2
  // and fsdp then reduce-scatter each group once, after its last weight half.
  if (dp) dp->set_weight_gradients_deferred(ex.schedule().split);
  const std::size_t seq = stage.config().seq, tok = stage.config().tokens();
  const std::size_t first = (dp ? std::size_t(dp->comm().rank()) : 0) * mb * m;
  for (std::size_t i = 0; i < m; ++i)
    data.fill(step, global_batch, first + i * mb, mb, Kokkos::subview(ex.ids(), std::make_pair(i * tok, (i + 1) * tok)),
              Kokkos::subview(ex.targets(), std::make_pair(i * tok, (i + 1) * tok)));
  if (dp) {
    dp->zero_grad();
    dp->begin_microbatch(false);  // replicate/zero1 reduce after the flush; zero2/fsdp per group in the hooks
  } else {
    stage.zero_grad();
  }
  const double local = ex.run(1.0 / double(global_batch * seq));
  if (dp) dp->finish_gradients();
  // The global gradient norm: stages hold disjoint parameters; sharded DP
  // modes hold disjoint pieces, replicate holds copies; TP-sharded
  // parameters are disjoint pieces over TP, TP-replicated ones copies.
  auto params = dp ? dp->optimizer_parameters() : stage.parameters();
  const nn::TensorParallel& tp = stage.tensor_parallel();
  double sums[2] = {0, 0};  // TP-sharded, the rest
  for (auto* p : params) {
    auto g = p->grad;
    double s = 0;
    Kokkos::parallel_reduce(
        "weft::pipeline_sumsq", Kokkos::RangePolicy<typename Space::execution_space>(0, g.extent(0)),
        KOKKOS_LAMBDA(std::size_t i, double& acc) { acc += double(g(i)) * double(g(i)); }, s);
    sums[tp.active() && p->tp_sharded() ? 0 : 1] += s;
  }
  using HostSums = Kokkos::View<double*, Kokkos::HostSpace, Kokkos::MemoryTraits<Kokkos::Unmanaged>>;
  if (dp && dp->mode() != parallel::DPMode::replicate && dp->comm().size() > 1) dp->comm().all_reduce(HostSums(sums, 2));
  if (tp.active()) tp.comm->all_reduce(HostSums(sums, 1));
  const double sq = ex.sum_over_pipeline(sums[0] + sums[1]);
  optim::StepResult r;
  r.grad_norm = std::sqrt(sq);
  if (clip > 0 && r.grad_norm > clip) {
    const T f = T(clip / (r.grad_norm + 1e-6));
    for (auto* p : params) {
      auto g = p->grad;
      Kokkos::parallel_for("weft::pipeline_clip", Kokkos::RangePolicy<typename Space::execution_space>(0, g.extent(0)),
                           KOKKOS_LAMBDA(std::size_t i) { g(i) *= f; });
    }
  }
  opt.step(lr);
  if (dp) dp->sync_parameters();
  double loss = ex.sum_over_pipeline(local / double(m));
  if (dp && dp->comm().size() > 1) {
    Kokkos::View<double*, Kokkos::HostSpace, Kokkos::MemoryTraits<Kokkos::Unmanaged>> v(&loss, 1);
    dp->comm().all_reduce(v, ReduceOp::avg);
  }
  r.loss = loss;
  return r;
}

}  // namespace weft::pipeline
