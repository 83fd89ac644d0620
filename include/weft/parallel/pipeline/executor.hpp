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
#include <map>
#include <memory>
#include <set>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include <weft/comm/comm.hpp>
#include <weft/data/stream.hpp>
#include <weft/optim/train_step.hpp>
#include <weft/parallel/data_parallel.hpp>
#include <weft/parallel/train_step.hpp>
#include <weft/parallel/pipeline/send_cap.hpp>
#include <weft/parallel/pipeline/stage.hpp>
#include <weft/precision/convert.hpp>
#include <weft/vocabulary/schedule.hpp>
#include <weft/vocabulary/strategy.hpp>

namespace weft::pipeline {

namespace detail {
template <class S>
struct schedule_cli_name {
  static std::string get() {
    if constexpr (std::is_same_v<S, GPipe>) return "gpipe";
    else if constexpr (std::is_same_v<S, OneFOneB>) return "1f1b";
    else if constexpr (std::is_same_v<S, ZeroBubble>) return "zb";
    else return std::string(S::name);
  }
};
template <int V>
struct schedule_cli_name<Interleaved1F1B<V>> {
  static std::string get() { return "interleaved:" + std::to_string(V); }
};
template <int V, class F>
decltype(auto) visit_interleaved(int v, F&& f) {
  if constexpr (V > 8) {
    weft::detail::throw_error<ConfigError>("--schedule interleaved:", v, ": V (chunks per rank) must be between 2 and 8");
    return f(std::type_identity<Interleaved1F1B<8>>{});  // not reached
  } else {
    if (v == V) return f(std::type_identity<Interleaved1F1B<V>>{});
    return visit_interleaved<V + 1>(v, std::forward<F>(f));
  }
}
template <class St>
struct wire_element {
  using type = typename St::Matrix::non_const_value_type;
};
template <class St>
  requires requires { St::precision::mixed; } && (St::precision::mixed)
struct wire_element<St> {
  using type = typename St::precision::param_type;
};
}  // namespace detail

/// The element type of the messages between pipeline ranks (activations
/// and their gradients) of a stage type St: under a mixed weft::Precision
/// (St::precision::mixed: bf16 or fp16 products) its 2-byte storage type,
/// weft::bf16 or weft::fp16, so each message carries half the bytes of an
/// fp32 one; otherwise St's own element type. The executor rounds what it
/// sends to it (nearest even, as weft::convert) and widens what it receives
/// back into the stage's float slot, so the stages compute as before. A
/// stage without a `precision` member (a user's LayerStage) sends its own type.
template <class St>
using wire_element_t = typename detail::wire_element<St>::type;

/// The command-line name of a schedule type: "gpipe", "1f1b", "interleaved:V" or "zb".
template <PipelineSchedule S>
std::string schedule_name() {
  return detail::schedule_cli_name<S>::get();
}

/// For command lines only (the library's runtime takes schedule types):
/// calls f(std::type_identity<S>{}) with the compiled schedule type S that
/// `--schedule gpipe|1f1b|interleaved:V|zb` (V from 2 to 8) names, and
/// returns what f returns. A ConfigError names a value that is not one of them.
template <class F>
decltype(auto) visit_schedule(std::string_view s, F&& f) {
  if (s == "gpipe") return f(std::type_identity<GPipe>{});
  if (s == "1f1b") return f(std::type_identity<OneFOneB>{});
  if (s == "zb") return f(std::type_identity<ZeroBubble>{});
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
    return detail::visit_interleaved<2>(x, std::forward<F>(f));
  }
  weft::detail::throw_error<ConfigError>("--schedule ", s, ": unknown schedule; expected gpipe, 1f1b, interleaved:V or zb");
}

/// Checks a `--schedule` value and returns its canonical name (ConfigError as visit_schedule).
inline std::string parse_schedule(std::string_view s) {
  return visit_schedule(s, []<class S>(std::type_identity<S>) { return schedule_name<S>(); });
}

/// What the executor needs of the model part a pipeline rank runs: weft's
/// GPT stage (pipeline::Stage) and the stage of a model built of a user's
/// layers (pipeline::LayerStage) both satisfy it. A slot holds one
/// microbatch's activations on one chunk, with xs.front() the received input,
/// xs.back() the output to send, dy the received output gradient and dx the
/// input gradient to send, and the Requests of those four messages.
template <class St>
concept PipelineStage = requires(St& s, const St& cs, int mb, int c, double scale, bool split, std::size_t n) {
  typename St::Matrix;
  { St::splits_backward } -> std::convertible_to<bool>;
  { cs.ranks() } -> std::convertible_to<int>;
  { cs.rank() } -> std::convertible_to<int>;
  { cs.num_chunks() } -> std::convertible_to<std::size_t>;
  { cs.virtual_stage(c) } -> std::convertible_to<std::size_t>;
  { cs.has_head(c) } -> std::convertible_to<bool>;
  s.reserve_microbatches(n);
  s.slot(mb, c).xs.back();
  s.slot(mb, c).recv_activation.test();
  { s.forward_microbatch(mb, c, scale) } -> std::convertible_to<double>;
  s.backward_microbatch(mb, c, split);
  s.backward_weight(mb, c);
  s.weights_done(c);
  s.release(mb, c);
  { cs.has_slot(mb, c) } -> std::convertible_to<bool>;
  { cs.live_slots() } -> std::convertible_to<std::size_t>;
  s.reserve_send_buffers(n);
  { s.take_send_buffer() } -> std::same_as<typename St::Matrix>;
  s.set_progress(std::function<void()>{});
  s.parameters();
  { cs.microbatch_samples() } -> std::convertible_to<std::size_t>;
  { cs.loss_terms_per_sample() } -> std::convertible_to<std::size_t>;
  { cs.tp_comm() } -> std::convertible_to<Comm*>;
};

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

namespace detail {
/// The communicator an Executor built without one owns (a duplicate of
/// MPI_COMM_SELF): a base, so that it exists before the reference to it.
struct OwnedPipelineComm {
  std::unique_ptr<Comm> own;
};
}  // namespace detail

/// Runs one rank's plan of a schedule on a stage, over the PP communicator.
/// The schedule is a type: Executor ex(stage, pp, Pipeline<OneFOneB>(pp.size(), m)).
/// At pp = 1 it needs no PP axis: Executor ex(stage, Pipeline<GPipe>(1, m))
/// runs the m microbatches of a stage that holds the whole model
/// (LayerStage(model), pipeline::Stage at one rank), accumulating their
/// gradients, on a communicator of this rank alone that it owns.
template <PipelineStage StageT, PipelineSchedule Schedule>
class Executor : private detail::OwnedPipelineComm {
  static_assert(!Schedule::splits_backward || StageT::splits_backward,
                "pipeline::Executor: the schedule splits every backward into its input-gradient and weight-gradient "
                "halves (Pipeline<ZeroBubble>), but the stage's blocks do not split theirs; give the block "
                "backward_input(x, dy, dx, saved, work) (nn::SplitBackwardLayer) or use Pipeline<OneFOneB>");

 public:
  using stage_type = StageT;        ///< the model part it runs
  using schedule_type = Schedule;   ///< the schedule it runs
  using Matrix = typename StageT::Matrix;
  /// The element type of the messages (wire_element_t<StageT>).
  using wire_type = wire_element_t<StageT>;
  /// Whether messages travel in a narrower type than the stage computes in
  /// (a mixed Precision): each is converted on send and on receive.
  static constexpr bool narrow_wire = !std::is_same_v<wire_type, typename Matrix::non_const_value_type>;
  /// A message buffer in the wire type.
  using WireMatrix = Kokkos::View<wire_type**, typename Matrix::array_layout, typename Matrix::memory_space>;

  /// `pp`: the PP-axis communicator (its rank is the pipeline rank and must
  /// equal stage.rank()); the plan is `pipeline`'s for this rank, and its
  /// stage count must be the size of `pp`.
  template <std::size_t P, std::size_t M>
  Executor(StageT& stage, Comm& pp, const Pipeline<Schedule, P, M>& pipeline, ExecutorOptions o = {})
      : Executor(stage, nullptr, &pp, pipeline, std::move(o)) {}

  /// One pipeline rank, no PP communicator: `pipeline` must have 1 stage and
  /// the stage must be built for rank 0 of 1 (ConfigError otherwise, before
  /// any communicator is made). Everything else is as above.
  template <std::size_t P, std::size_t M>
  Executor(StageT& stage, const Pipeline<Schedule, P, M>& pipeline, ExecutorOptions o = {})
      : Executor(stage, self_comm(pipeline), nullptr, pipeline, std::move(o)) {}

 private:
  template <std::size_t P, std::size_t M>
  static std::unique_ptr<Comm> self_comm(const Pipeline<Schedule, P, M>& pipeline) {
    WEFT_REQUIRE(pipeline.stages() == 1, ConfigError, "pipeline::Executor without a PP communicator runs one pipeline rank, but Pipeline<",
                 Schedule::name, "> has ", pipeline.stages(), " stages; give the PP axis' communicator (mesh.axis<weft::PP>())");
    return std::make_unique<Comm>(Comm::duplicate(MPI_COMM_SELF, "pp"));
  }

  template <std::size_t P, std::size_t M>
  Executor(StageT& stage, std::unique_ptr<Comm> owned, Comm* given, const Pipeline<Schedule, P, M>& pipeline, ExecutorOptions o)
      : detail::OwnedPipelineComm{std::move(owned)}, stage_(stage), pp_(given ? *given : *this->own),
        m_(pipeline.microbatches()), o_(std::move(o)) {
    Comm& pp = pp_;
    const std::string name = schedule_name<Schedule>();
    WEFT_REQUIRE(pipeline.stages() == pp.size(), ConfigError, "pipeline::Executor: Pipeline<", Schedule::name, "> has ",
                 pipeline.stages(), " stages, but the PP communicator has ", pp.size(), " ranks");
    WEFT_REQUIRE(pp.size() == stage.ranks() && pp.rank() == stage.rank(), ConfigError, "pipeline::Executor: the PP communicator has rank ",
                 pp.rank(), " of ", pp.size(), ", but the stage was built for rank ", stage.rank(), " of ", stage.ranks());
    WEFT_REQUIRE(int(stage.num_chunks()) == Schedule::chunks, ConfigError, "pipeline::Executor: schedule ", name,
                 " runs ", Schedule::chunks, " chunks per rank, but the stage has ", stage.num_chunks());
    if constexpr (Schedule::splits_backward && requires { stage.check_split_backward(); })
      stage.check_split_backward();  // a stage that cannot split its backward says why, before step 0
    stage.reserve_microbatches(std::size_t(m_));
    auto plans = pipeline.plans();
    plan_ = plans[std::size_t(pp.rank())];
    if (o_.send_buffers < 0) {
      cap_ = default_send_cap(plans);
    } else {
      cap_ = std::size_t(o_.send_buffers);
      if (!send_cap_is_deadlock_free(plans, cap_))
        weft::detail::throw_error<ConfigError>(
            "pipeline::Executor: ExecutorOptions::send_buffers = ", cap_, " can deadlock schedule ", name, " on ",
            pp.size(), " ranks with ", m_, " microbatches; the smallest safe value is ", smallest_send_cap(plans),
            " (or -1 for the default)");
    }
    // A narrow wire detaches its own 2-byte message buffers (the slot's dx is
    // free once converted), so the stage's fp32 spares are not needed.
    if constexpr (!narrow_wire) stage.reserve_send_buffers(cap_);
    for (std::size_t k = 0; k < plan_.size(); ++k) {
      const PipeOp op = plan_[k].op;
      if (op == PipeOp::recv_activation || op == PipeOp::recv_gradient) recvs_.push_back(k);
    }
    // The last action per chunk that adds weight gradients: after it the
    // chunk's weight gradients of the step are complete.
    last_weight_.assign(plan_.size(), false);
    std::vector<std::size_t> last(std::size_t(Schedule::chunks), plan_.size());
    for (std::size_t k = 0; k < plan_.size(); ++k)
      if (plan_[k].op == PipeOp::backward || plan_[k].op == PipeOp::backward_weight)
        last[std::size_t(plan_[k].chunk)] = k;
    for (std::size_t k : last)
      if (k < plan_.size()) last_weight_[k] = true;
    next_compute_.assign(plan_.size() + 1, plan_.size());
    for (std::size_t k = plan_.size(); k-- > 0;)
      next_compute_[k] = is_compute(plan_[k].op) ? k : next_compute_[k + 1];
  }

 public:
  /// This rank's plan.
  const std::vector<PipeAction>& plan() const { return plan_; }
  /// The schedule's command-line name ("1f1b", "interleaved:2", ...).
  static std::string schedule() { return schedule_name<Schedule>(); }
  /// Microbatches per step.
  int microbatches() const { return m_; }
  /// Detached input-gradient sends this rank may hold (ExecutorOptions::send_buffers).
  std::size_t send_buffers() const { return cap_; }
  /// The stage it runs.
  StageT& stage() { return stage_; }
  /// The PP communicator.
  Comm& comm() { return pp_; }
  /// What the last run() did and when (compute and blocked receives).
  const std::vector<StepEvent>& timeline() const { return timeline_; }
  /// Steady-clock seconds at the start and end of the last run().
  std::pair<double, double> last_run_span() const { return {t_begin_, t_end_}; }
  /// Bytes of the wire buffers allocated so far (narrow_wire only; 0
  /// otherwise): a 2-byte buffer per message posted or in flight, reused
  /// from step to step, so the count stops growing after the first step.
  std::size_t wire_buffer_bytes() const { return wire_bytes_; }
  /// The stage's memory() plus the wire buffers, as "pipeline.wire_buffers"
  /// (category buffers) when there are any.
  metrics::MemoryLedger memory() {
    metrics::MemoryLedger m = stage_.memory();
    if (wire_bytes_) m.add(metrics::MemoryCategory::buffers, "pipeline.wire_buffers", wire_bytes_);
    return m;
  }

  /// Runs the plan once: forwards and backwards of every microbatch, with
  /// gradients accumulating grad_scale * d(sum of token losses). Returns the
  /// sum over microbatches of their mean token loss on the rank that holds
  /// the head (0 elsewhere).
  double run(double grad_scale) {
    timeline_.clear();
    retiring_.clear();
    grad_sent_.clear();
    for (auto& [key, w] : wires_) release_wires(w);  // left by a step that ended in an error
    wires_.clear();
    next_post_ = 0;
    t_begin_ = now();
    stage_.set_progress([this] { progress(); });
    struct Unset {
      StageT& s;
      ~Unset() { s.set_progress({}); }
    } unset{stage_};
    double loss = 0;
    for (std::size_t k = 0; k < plan_.size(); ++k) {
      const PipeAction& a = plan_[k];
      if (o_.before_action) o_.before_action(a, k);
      retire();
      complete_sends(false);
      switch (a.op) {
        case PipeOp::recv_activation:
        case PipeOp::recv_gradient: {
          post_until(k + 1);
          auto& s = stage_.slot(a.microbatch, a.chunk);
          const bool grad = a.op == PipeOp::recv_gradient;
          const double t0 = now();
          wait(grad ? s.recv_gradient : s.recv_activation, a);
          if constexpr (narrow_wire) {
            auto& w = wires_[{a.microbatch, a.chunk}];
            land(grad ? s.dy : s.xs[0], grad ? w.grad_in : w.act_in);
          }
          timeline_.push_back({a.op, a.microbatch, a.chunk, t0, now()});
          break;
        }
        case PipeOp::send_activation: {
          auto& s = stage_.slot(a.microbatch, a.chunk);
          s.send_activation = post_send(s.xs.back(), a, &Wires::act_out, activation_tag);
          break;
        }
        case PipeOp::send_gradient: {
          auto& s = stage_.slot(a.microbatch, a.chunk);
          s.send_gradient = post_send(s.dx, a, &Wires::grad_out, gradient_tag);
          grad_sent_.insert({a.microbatch, a.chunk});
          break;
        }
        case PipeOp::forward: {
          post_until(next_compute_[k + 1]);
          const double t0 = now();
          const double mean = stage_.forward_microbatch(a.microbatch, a.chunk, grad_scale);
          if (stage_.has_head(a.chunk)) loss += mean;
          fence_and_record(a, t0);
          break;
        }
        case PipeOp::backward:
        case PipeOp::backward_input: {
          post_until(next_compute_[k + 1]);
          const double t0 = now();
          const bool split = a.op == PipeOp::backward_input;
          stage_.backward_microbatch(a.microbatch, a.chunk, split);
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
      release_wires(key);
      stage_.release(key.first, key.second);
    }
    retiring_.clear();
    complete_sends(true);
    WEFT_REQUIRE(stage_.live_slots() == 0, Error, "pipeline::Executor: ", stage_.live_slots(),
                 " microbatch activations are still held after the flush; the plan of schedule ", schedule(),
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
    // Shown in the watchdog's heartbeat table (its deadline is this loop's own).
    weft::detail::WaitScope scope(pipeline_wait, pp_.name(), pp_.staging_state().world_ranks, 0);
    for (long spin = 0; !r.test(); ++spin) {
      if (now() - t0 > o_.deadline_s) deadline_passed(what());
      // Spin briefly, then yield, then sleep: on a node with more ranks than
      // cores a waiting rank must leave its core to the ranks that compute.
      if (spin > 4096) std::this_thread::sleep_for(std::chrono::microseconds(50));
      else if (spin > 64) std::this_thread::yield();
    }
  }

  /// Ends the run with the CommError of a wait past its deadline.
  /// Every waiting rank raises it; one rank of the node, elected by the
  /// watchdog, is told to print it (CommError::reported_by_another_rank).
  [[noreturn]] void deadline_passed(const std::string& what) {
    weft::detail::comm_poisoned() = true;  // pending requests must not be waited for at destruction
    const auto& core = pp_.staging_state();
    weft::detail::PeerReport r;
    const bool here = weft::detail::Watchdog::instance().elect_reporter(pipeline_wait, core.name, core.world_ranks,
                                                                        o_.deadline_s, r);
    throw CommError("pipeline", pp_.name(),
                    "pipeline rank " + std::to_string(pp_.rank()) + " (schedule " + schedule() + "): waited " +
                        std::to_string(o_.deadline_s) + " s to " + what +
                        " without completing: a pipeline peer failed or hangs (deadline: "
                        "ExecutorOptions::deadline_s, WEFT_DEADLINE). The pipeline's other ranks:" + r.text,
                    here ? CommError::Deadline::report_here : CommError::Deadline::reported_by_another_rank);
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
  static constexpr const char* pipeline_wait = "a pipeline wait";

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
      if (a.op == PipeOp::recv_activation) s.recv_activation = post_recv(s.xs[0], a, &Wires::act_in, activation_tag);
      else s.recv_gradient = post_recv(s.dy, a, &Wires::grad_in, gradient_tag);
    }
  }

  // The wire buffers of one slot's four messages (narrow wire only).
  struct Wires {
    WireMatrix act_in, grad_in, act_out, grad_out;
  };

  // A wire buffer of rows x cols: a spare of that shape, else a new one.
  WireMatrix take_wire(std::size_t rows, std::size_t cols) {
    for (std::size_t i = 0; i < wire_spare_.size(); ++i)
      if (wire_spare_[i].extent(0) == rows && wire_spare_[i].extent(1) == cols) {
        WireMatrix w = wire_spare_[i];
        wire_spare_.erase(wire_spare_.begin() + long(i));
        return w;
      }
    wire_bytes_ += rows * cols * sizeof(wire_type);
    return WireMatrix(Kokkos::view_alloc(Kokkos::WithoutInitializing, "pipeline.wire_buffer"), rows, cols);
  }
  void give_wire(WireMatrix& w) {
    if (w.data()) wire_spare_.push_back(w);
    w = WireMatrix();
  }

  // Posts action a's receive into `target`: directly, or into the slot's
  // wire buffer `which`, which land() widens into it once the message is complete.
  Request post_recv(const Matrix& target, const PipeAction& a, WireMatrix Wires::*which, int tag) {
    if constexpr (narrow_wire) {
      WireMatrix& w = wires_[{a.microbatch, a.chunk}].*which;
      w = take_wire(target.extent(0), target.extent(1));
      return pp_.irecv(w, a.peer, tag);
    } else {
      return pp_.irecv(target, a.peer, tag);
    }
  }
  // Sends `src` for action a: directly, or rounded to the wire type in the
  // slot's wire buffer `which`, which stays with the slot (or its detached
  // send) until the send completes. (The Comm fences the buffer's execution
  // space, where the conversion ran, before MPI reads it.)
  Request post_send(const Matrix& src, const PipeAction& a, WireMatrix Wires::*which, int tag) {
    if constexpr (narrow_wire) {
      WireMatrix& w = wires_[{a.microbatch, a.chunk}].*which;
      w = take_wire(src.extent(0), src.extent(1));
      convert(w, src);
      return pp_.isend(w, a.peer, tag);
    } else {
      return pp_.isend(src, a.peer, tag);
    }
  }
  // Widens a received wire buffer into the slot's matrix and frees the buffer.
  void land(const Matrix& target, WireMatrix& w) {
    convert(target, w);
    Kokkos::fence();  // the buffer may take the next receive
    give_wire(w);
  }
  // Frees the wire buffers of a slot whose messages have all completed.
  void release_wires(const std::pair<int, int>& key) {
    if constexpr (narrow_wire) {
      auto it = wires_.find(key);
      if (it == wires_.end()) return;
      release_wires(it->second);
      wires_.erase(it);
    }
  }
  void release_wires(Wires& w) {
    for (WireMatrix* m : {&w.act_in, &w.grad_in, &w.act_out, &w.grad_out}) give_wire(*m);
  }

  // Moves a pending gradient send and its buffer out of a slot (which gets a
  // spare buffer). With all cap_ spares in flight it first waits until one of
  // them, or this send, completes: send_cap.hpp shows that cannot deadlock.
  // With a narrow wire the in-flight buffer is the slot's 2-byte grad_out
  // (the slot keeps its dx), and it returns to the wire spares.
  void detach(Request& r, Matrix& buf, const std::pair<int, int>& key) {
    if (!r.active() || r.test()) {
      if constexpr (narrow_wire) give_wire(wires_[key].grad_out);
      return;
    }
    complete_sends(false);
    if (sending_.size() >= cap_) {
      const double t0 = now();
      weft::detail::WaitScope scope(pipeline_wait, pp_.name(), pp_.staging_state().world_ranks, 0);
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
    if constexpr (narrow_wire) {
      sending_.push_back({std::move(r), Matrix(), wires_[key].grad_out});
      wires_[key].grad_out = WireMatrix();
    } else {
      sending_.push_back({std::move(r), buf, WireMatrix()});
      buf = stage_.take_send_buffer();
    }
  }
  // Returns the buffers of completed detached sends to the spares.
  void complete_sends(bool wait_all) {
    for (std::size_t i = 0; i < sending_.size();) {
      if (wait_all) wait_for(sending_[i].req, [] { return std::string("complete a send of this step"); });
      if (!sending_[i].req.test()) {
        ++i;
        continue;
      }
      if constexpr (narrow_wire) give_wire(sending_[i].wire);
      else stage_.return_send_buffer(sending_[i].buf);
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
      const std::size_t vs = stage_.virtual_stage(key.second);
      const bool grad_done = vs == 0 || grad_sent_.count(key) != 0;
      if (grad_done) {
        // The activation has been consumed (its output gradient came back),
        // so its send completes without any further step of the peer. A
        // gradient send still in flight keeps only its own buffer, not the
        // slot: the activations are free as soon as the backward is complete.
        wait(s.send_activation, PipeAction{PipeOp::send_activation, key.first, key.second, -1});
        detach(s.send_gradient, s.dx, key);
        release_wires(key);
        stage_.release(key.first, key.second);
        retiring_.erase(retiring_.begin() + long(i));
      } else {
        ++i;
      }
    }
  }

  StageT& stage_;
  Comm& pp_;
  int m_;
  ExecutorOptions o_;
  std::vector<PipeAction> plan_;
  std::vector<std::size_t> recvs_, next_compute_;
  std::vector<bool> last_weight_;  // plan index: the chunk's last weight-gradient action of the step
  std::size_t next_post_ = 0;
  std::vector<std::pair<int, int>> retiring_;
  std::set<std::pair<int, int>> grad_sent_;
  struct InFlightSend {
    Request req;
    Matrix buf;       // the stage's send buffer (fp32 wire)
    WireMatrix wire;  // or the 2-byte wire buffer
  };
  std::map<std::pair<int, int>, Wires> wires_;  // narrow wire: each live slot's message buffers
  std::vector<WireMatrix> wire_spare_;
  std::size_t wire_bytes_ = 0;  // bytes of every wire buffer allocated so far
  std::vector<InFlightSend> sending_;
  std::size_t cap_ = 1;  // most detached gradient sends (preallocated buffers)
  std::vector<StepEvent> timeline_;
  double t_begin_ = 0, t_end_ = 0;
};

/// Deduces Executor<StageT, Schedule> from a Pipeline<Schedule>.
template <class StageT, class Schedule, std::size_t P, std::size_t M>
Executor(StageT&, Comm&, const Pipeline<Schedule, P, M>&, ExecutorOptions = {}) -> Executor<StageT, Schedule>;

/// The executor a strategy S gives a stage on `mesh`: S's schedule (the
/// Pipeline<Schedule> of its PP entry) over mesh.axis<weft::PP>(), running
/// `microbatches` microbatches per step. A strategy without a PP entry runs
/// one pipeline rank (GPipe over the stage's m microbatches, the
/// executor's one-rank form that owns its communicator), so the same code
/// serves pp = 1 without a PP axis. Checks, before anything is built: at
/// compile time weft::check_strategy_mesh<S, MeshT> (every policy's axis in
/// the mesh; the static extents' rules), and at run time
/// weft::validate_strategy<S>(mesh) (an axis S gives no policy must have
/// extent 1, interleaving needs pp >= 2, experts divide by ep, ...), then the
/// Executor's own checks (the stage's rank and chunks against the schedule).
///
///   auto ex = weft::pipeline::executor_of<S>(stage, mesh, 4);
template <StrategyType S, PipelineStage StageT, class MeshT>
auto executor_of(StageT& stage, MeshT& mesh, int microbatches, ExecutorOptions o = {}) {
  static_assert(check_strategy_mesh<S, MeshT>());
  validate_strategy<S>(mesh);
  if constexpr (S::pipelined) {
    using PipelineT = typename S::template policy<PP>;
    using Ex = Executor<StageT, typename PipelineT::schedule_type>;
    return Ex(stage, mesh.template axis<PP>(), PipelineT(mesh.template extent<PP>(), microbatches), std::move(o));
  } else {
    using Ex = Executor<StageT, GPipe>;
    return Ex(stage, Pipeline<GPipe>(1, microbatches), std::move(o));
  }
}

namespace detail {
// train_step_with's body; scaler is null without loss scaling.
template <class Ex, class DP, class Optimizer, class Fill>
optim::StepResult train_step(Ex& ex, DP* dp, Optimizer& opt, std::size_t global_batch, double lr, double clip,
                             DynamicLossScaler* scaler, Fill&& fill) {
  auto& stage = ex.stage();
  const std::size_t m = std::size_t(ex.microbatches());
  // The CP ranks of a DP rank take the same sequences (parallel::detail::sample_groups).
  const auto groups = parallel::detail::sample_groups(stage, dp ? &dp->comm() : nullptr, "pipeline::train_step");
  const std::size_t ndp = groups.groups;
  const std::size_t mb = parallel::local_microbatch(global_batch, ndp, m);
  WEFT_REQUIRE(mb == stage.microbatch_samples(), ConfigError, "pipeline::train_step: the stage is built for microbatches of ",
               stage.microbatch_samples(), " samples, but batch ", global_batch, " / dp ", ndp, " / microbatches ", m, " = ", mb);
  // zb adds weight gradients after the group hooks' after_backward: zero2
  // and fsdp then reduce-scatter each group once, after its last weight half.
  if (dp) dp->set_weight_gradients_deferred(Ex::schedule_type::splits_backward);
  const std::size_t rank = groups.index;
  for (std::size_t i = 0; i < m; ++i) fill(i, parallel::microbatch_first_sample(i, rank, mb, ndp), mb);
  if (dp) {
    dp->zero_grad();
    dp->begin_microbatch(false);  // replicate/zero1 reduce after the flush; zero2/fsdp per group in the hooks
  } else {
    for (auto* p : stage.parameters())
      if (p->grad.extent(0)) Kokkos::deep_copy(p->grad, 0);
  }
  optim::StepResult r;
  if (scaler) r.loss_scale = scaler->scale();
  const double local = ex.run(r.loss_scale / double(global_batch * stage.loss_terms_per_sample()));
  if (dp) dp->finish_gradients();
  // The global gradient norm: stages hold disjoint parameters; sharded DP
  // modes hold disjoint pieces, replicate holds copies; TP-sharded
  // parameters are disjoint pieces over TP, TP-replicated ones copies.
  // (With data parallelism its engine sums them: ExpertDataParallel counts
  // the experts of every EP rank once.)
  auto params = dp ? dp->optimizer_parameters() : stage.parameters();
  Comm* tp = stage.tp_comm();
  double local_sq = 0;
  if (dp) {
    local_sq = dp->gradient_squares(tp);
  } else {
    double sums[2] = {0, 0};  // TP-sharded, the rest
    // The kernels are DataParallel's (weft::detail): nvcc refuses extended
    // lambdas in this function, which is templated on a lambda type (Fill).
    for (auto* p : params) sums[tp && p->tp_sharded() ? 0 : 1] += weft::detail::dp_sum_squares(p->grad);
    using HostSums = Kokkos::View<double*, Kokkos::HostSpace, Kokkos::MemoryTraits<Kokkos::Unmanaged>>;
    if (tp) tp->all_reduce(HostSums(sums, 1));
    local_sq = sums[0] + sums[1];
  }
  const double sq = ex.sum_over_pipeline(local_sq);
  auto scale_grads = [&](double f) {
    for (auto* p : params) {
      using V = typename std::remove_reference_t<decltype(p->grad)>::non_const_value_type;
      weft::detail::dp_scale(p->grad, V(f));
    }
  };
  if (!scaler) {
    r.grad_norm = std::sqrt(sq);
    if (clip > 0 && r.grad_norm > clip) scale_grads(clip / (r.grad_norm + 1e-6));
    opt.step(lr);
  } else {
    // The norm is summed over every stage, DP and TP rank, so an overflow on
    // one rank skips the step on all of them.
    r.skipped = optim::unscale_and_clip(*scaler, std::sqrt(sq), clip, r.grad_norm, scale_grads);
    if (!r.skipped) opt.step(lr);
  }
  if (dp) dp->sync_parameters();
  double loss = ex.sum_over_pipeline(local / double(m));
  if (dp && dp->comm().size() > 1) {
    Kokkos::View<double*, Kokkos::HostSpace, Kokkos::MemoryTraits<Kokkos::Unmanaged>> v(&loss, 1);
    dp->comm().all_reduce(v, ReduceOp::avg);
  }
  r.loss = loss;
  return r;
}

}  // namespace detail

/// One optimizer step of a pipeline over any stage (optionally composed with
/// data parallelism over `dp`, whose hooks the stage must call): every DP
/// rank takes its slice of each microbatch of the global batch of
/// `global_batch` samples (parallel::microbatch_first_sample),
/// `fill(i, first, n)` loads microbatch i -- samples [first, first + n) of
/// the global batch -- into the stage, the plan runs its microbatches,
/// gradients are reduced over DP after the flush, clipped by the global norm
/// (over every stage, shard and TP rank) and applied. Returns the global
/// mean loss (identical on every rank) and the gradient norm before clipping.
/// A stage whose precision scales its loss (fp16) does not compile here: it
/// takes the overload with a scaler.
template <class Ex, class DP, class Optimizer, class Fill>
optim::StepResult train_step_with(Ex& ex, DP* dp, Optimizer& opt, std::size_t global_batch, double lr, double clip,
                                  Fill&& fill) {
  static_assert(!optim::loss_scaled_model_v<typename Ex::stage_type>,
                "weft::pipeline::train_step: the stage's weft::Precision<FP16, F32, DynamicLossScale> scales its loss; "
                "pass the weft::DynamicLossScaler that holds the scale: train_step(..., lr, clip, scaler)");
  return detail::train_step(ex, dp, opt, global_batch, lr, clip, nullptr, std::forward<Fill>(fill));
}

/// The same step with dynamic loss scaling, for a stage whose precision
/// scales its loss (fp16): the loss gradient of every microbatch is
/// multiplied by scaler.scale(), and once the gradients are complete an
/// overflow (a non-finite norm, summed over every stage, DP and TP rank, so
/// that every rank decides alike) skips the update on every rank and backs
/// the scale off, while a clean step unscales the gradients (and clips the
/// unscaled norm) before the optimizer's step (optim::unscale_and_clip). The
/// result says whether the step was skipped and at which scale it ran.
template <class Ex, class DP, class Optimizer, class Fill>
optim::StepResult train_step_with(Ex& ex, DP* dp, Optimizer& opt, std::size_t global_batch, double lr, double clip,
                                  DynamicLossScaler& scaler, Fill&& fill) {
  static_assert(optim::loss_scaled_model_v<typename Ex::stage_type>,
                "weft::pipeline::train_step: a weft::DynamicLossScaler was given, but the stage's precision does not "
                "scale its loss (fp32 and bf16 need none); drop the scaler, or use weft::Precision<weft::FP16, "
                "weft::F32, weft::DynamicLossScale>");
  return detail::train_step(ex, dp, opt, global_batch, lr, clip, &scaler, std::forward<Fill>(fill));
}

/// One optimizer step of a GPT pipeline on step `step` of `data`: the global
/// batch of `global_batch` sequences, each DP rank its slice (the same
/// sequences as the single-process run). See train_step_with.
template <class Ex, class DP, class Optimizer>
optim::StepResult train_step(Ex& ex, DP* dp, Optimizer& opt, const data::TokenStream& data, std::uint64_t step,
                             std::size_t global_batch, double lr, double clip) {
  auto& stage = ex.stage();
  return train_step_with(ex, dp, opt, global_batch, lr, clip, [&](std::size_t i, std::size_t first, std::size_t n) {
    data.fill(step, global_batch, first, n, stage.ids(i), stage.targets(i));
  });
}

/// The same with dynamic loss scaling (an fp16 stage; see train_step_with).
template <class Ex, class DP, class Optimizer>
optim::StepResult train_step(Ex& ex, DP* dp, Optimizer& opt, const data::TokenStream& data, std::uint64_t step,
                             std::size_t global_batch, double lr, double clip, DynamicLossScaler& scaler) {
  auto& stage = ex.stage();
  return train_step_with(ex, dp, opt, global_batch, lr, clip, scaler, [&](std::size_t i, std::size_t first, std::size_t n) {
    data.fill(step, global_batch, first, n, stage.ids(i), stage.targets(i));
  });
}

}  // namespace weft::pipeline
