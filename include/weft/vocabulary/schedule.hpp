// Pipeline-parallel schedules as types: GPipe, OneFOneB, Interleaved1F1B<V> and
// ZeroBubble (ZB-H1) each turn (stages, microbatches, rank) into the ordered list
// of actions that rank performs — a pure function, evaluable at compile time.
#pragma once

#include <array>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include <weft/core/error.hpp>
#include <weft/mesh/axis.hpp>

namespace weft {

/// What one pipeline rank does at one step of its plan.
enum class PipeOp : std::uint8_t {
  forward,          ///< forward of a microbatch on one model chunk
  backward,         ///< full backward (input and weight gradients together)
  backward_input,   ///< input-gradient half of the backward (zero-bubble schedules)
  backward_weight,  ///< weight-gradient half of the backward (zero-bubble schedules)
  send_activation,  ///< send a forward output to the next virtual stage
  recv_activation,  ///< receive a forward input from the previous virtual stage
  send_gradient,    ///< send an input gradient to the previous virtual stage
  recv_gradient,    ///< receive an output gradient from the next virtual stage
};

/// Short lower-case name of an operation, for messages and traces.
constexpr std::string_view to_string(PipeOp op) noexcept {
  switch (op) {
    case PipeOp::forward: return "forward";
    case PipeOp::backward: return "backward";
    case PipeOp::backward_input: return "backward_input";
    case PipeOp::backward_weight: return "backward_weight";
    case PipeOp::send_activation: return "send_activation";
    case PipeOp::recv_activation: return "recv_activation";
    case PipeOp::send_gradient: return "send_gradient";
    case PipeOp::recv_gradient: return "recv_gradient";
  }
  return "?";
}

/// True for the operations that compute (as opposed to communicate).
constexpr bool is_compute(PipeOp op) noexcept {
  return op == PipeOp::forward || op == PipeOp::backward || op == PipeOp::backward_input ||
         op == PipeOp::backward_weight;
}

/// One step of a rank's plan. `chunk` is the model chunk on this rank (always 0
/// unless the schedule places several virtual stages per rank); `peer` is the
/// rank on the other end of a send or receive and -1 for compute.
struct PipeAction {
  PipeOp op = PipeOp::forward;
  int microbatch = 0;
  int chunk = 0;
  int peer = -1;
  friend constexpr bool operator==(const PipeAction&, const PipeAction&) = default;
};

/// Relative costs of the compute operations on one chunk, and the latency of a
/// transfer, in arbitrary time units. A full backward costs
/// backward_input + backward_weight.
struct PipeCosts {
  double forward = 1.0;          ///< one forward
  double backward_input = 1.0;   ///< the input-gradient half of a backward
  double backward_weight = 1.0;  ///< the weight-gradient half of a backward
  double transfer = 0.0;         ///< from a send to the earliest matching receive
};

namespace detail {

// The placement of virtual stages shared by every schedule: chunk c of rank r is
// virtual stage c * p + r, so consecutive virtual stages sit on consecutive
// ranks and the last rank hands over to rank 0's next chunk (Megatron's layout).
// Forward and backward emit the receive just before the compute that needs it
// and the send just after the compute that produces it; sends are non-blocking.
template <class Emit>
constexpr void emit_forward(int p, int chunks, int rank, int mb, int chunk, Emit& emit) {
  const int vs = chunk * p + rank;
  const int last = chunks * p - 1;
  if (vs > 0) emit(PipeAction{PipeOp::recv_activation, mb, chunk, (vs - 1) % p});
  emit(PipeAction{PipeOp::forward, mb, chunk, -1});
  if (vs < last) emit(PipeAction{PipeOp::send_activation, mb, chunk, (vs + 1) % p});
}

template <class Emit>
constexpr void emit_backward(int p, int chunks, int rank, int mb, int chunk, PipeOp op, Emit& emit) {
  const int vs = chunk * p + rank;
  const int last = chunks * p - 1;
  if (vs < last) emit(PipeAction{PipeOp::recv_gradient, mb, chunk, (vs + 1) % p});
  emit(PipeAction{op, mb, chunk, -1});
  if (vs > 0) emit(PipeAction{PipeOp::send_gradient, mb, chunk, (vs - 1) % p});
}

template <class Emit>
constexpr void emit_weight(int mb, int chunk, Emit& emit) {
  emit(PipeAction{PipeOp::backward_weight, mb, chunk, -1});
}

constexpr int min_int(int a, int b) { return a < b ? a : b; }
constexpr int max_int(int a, int b) { return a > b ? a : b; }

[[noreturn]] inline void throw_too_few_microbatches(std::string_view schedule, int p, int m, std::string_view why) {
  throw_error<ConfigError>("Pipeline<", schedule, ">: ", m, " microbatches on ", p, " stages; ", schedule,
                           " needs microbatches >= stages (m >= p) ", why, ". Use at least ", p,
                           " microbatches, or fewer stages, or GPipe.");
}

inline void check_common(std::string_view schedule, int p, int m) {
  WEFT_REQUIRE(p >= 1, ConfigError, "Pipeline<", schedule, ">: ", p,
               " stages; a pipeline needs at least 1 stage. Give the size of the PP mesh axis.");
  WEFT_REQUIRE(m >= 1, ConfigError, "Pipeline<", schedule, ">: ", m,
               " microbatches; a pipeline needs at least 1 microbatch. Pass --microbatches >= 1.");
}

}  // namespace detail

/// GPipe: every rank runs all forwards, then all backwards. Bubble
/// (p-1)/(m+p-1); every rank holds the activations of all m microbatches.
struct GPipe {
  static constexpr std::string_view name = "GPipe";
  static constexpr int chunks = 1;                 ///< model chunks per rank
  static constexpr bool splits_backward = false;   ///< whether backward_weight is separate

  /// Calls emit(PipeAction) for each step of `rank`'s plan, in order.
  template <class Emit>
  static constexpr void generate(int p, int m, int rank, Emit&& emit) {
    for (int i = 0; i < m; ++i) detail::emit_forward(p, 1, rank, i, 0, emit);
    for (int i = 0; i < m; ++i) detail::emit_backward(p, 1, rank, i, 0, PipeOp::backward, emit);
  }
  /// Throws ConfigError when (p, m) is not a valid configuration.
  static void check(int p, int m) { detail::check_common(name, p, m); }
  /// Compile-time version of check; its static_asserts explain a failure.
  template <std::size_t P, std::size_t M>
  static constexpr bool static_check() {
    return true;
  }
  /// Most microbatch activations `rank` holds at once, in chunk-microbatches.
  static constexpr int peak_in_flight(int /*p*/, int m, int /*rank*/) { return m; }
  /// Fraction of rank-time spent idle, with zero transfer latency.
  static constexpr double bubble_fraction(int p, int m, const PipeCosts& = {}) {
    return double(p - 1) / double(m + p - 1);
  }
};

/// 1F1B (PipeDream-Flush): after p-r-1 warm-up forwards, rank r alternates one
/// forward and one backward, so it holds at most p-r microbatches' activations.
/// Same bubble as GPipe, (p-1)/(m+p-1). Needs m >= p.
struct OneFOneB {
  static constexpr std::string_view name = "OneFOneB";
  static constexpr int chunks = 1;                ///< model chunks per rank
  static constexpr bool splits_backward = false;  ///< whether backward_weight is separate

  /// Calls emit(PipeAction) for each step of `rank`'s plan, in order.
  template <class Emit>
  static constexpr void generate(int p, int m, int rank, Emit&& emit) {
    const int warmup = detail::min_int(p - rank - 1, m);
    for (int i = 0; i < warmup; ++i) detail::emit_forward(p, 1, rank, i, 0, emit);
    for (int i = 0; i < m - warmup; ++i) {
      detail::emit_forward(p, 1, rank, warmup + i, 0, emit);
      detail::emit_backward(p, 1, rank, i, 0, PipeOp::backward, emit);
    }
    for (int i = m - warmup; i < m; ++i) detail::emit_backward(p, 1, rank, i, 0, PipeOp::backward, emit);
  }
  /// Throws ConfigError when (p, m) is not a valid configuration.
  static void check(int p, int m) {
    detail::check_common(name, p, m);
    if (m < p) detail::throw_too_few_microbatches("OneFOneB", p, m, "so that every stage reaches its steady state");
  }
  /// Compile-time version of check; its static_asserts explain a failure.
  template <std::size_t P, std::size_t M>
  static constexpr bool static_check() {
    static_assert(M >= P,
                  "Pipeline<OneFOneB>: 1F1B needs at least as many microbatches as stages (M >= P); "
                  "raise the microbatch count or use GPipe");
    return true;
  }
  /// Most microbatch activations `rank` holds at once, in chunk-microbatches.
  static constexpr int peak_in_flight(int p, int m, int rank) { return detail::min_int(p - rank, m); }
  /// Fraction of rank-time spent idle, with zero transfer latency.
  static constexpr double bubble_fraction(int p, int m, const PipeCosts& = {}) {
    return double(p - 1) / double(m + p - 1);
  }
};

/// Interleaved 1F1B (Megatron-LM): each rank holds V model chunks (virtual
/// stage c*p + r), so the pipeline fills V times faster. Bubble
/// (p-1)/(V*m+p-1). Needs V >= 2, p >= 2 and m a multiple of p. Costs are per
/// chunk, so a chunk's forward costs 1/V of a whole stage's.
template <int V>
struct Interleaved1F1B {
  static_assert(V >= 2,
                "Interleaved1F1B<V>: interleaved 1F1B needs V >= 2 virtual stages per rank; with V = 1 use OneFOneB");
  static constexpr std::string_view name = "Interleaved1F1B";
  static constexpr int chunks = V;                ///< model chunks per rank
  static constexpr bool splits_backward = false;  ///< whether backward_weight is separate

  /// Number of chunk-microbatch forwards rank r runs before its first backward.
  static constexpr int warmup(int p, int m, int rank) {
    return detail::min_int((p - rank - 1) * 2 + (V - 1) * p, V * m);
  }
  /// Microbatch and chunk of the k-th forward (or backward) of a rank: groups
  /// of p microbatches go through chunk 0, then chunk 1, ...; backwards visit
  /// the chunks in reverse.
  static constexpr PipeAction step(int p, int k, bool forward) {
    const int within = k % (p * V);
    int chunk = within / p;
    if (!forward) chunk = V - 1 - chunk;
    return PipeAction{forward ? PipeOp::forward : PipeOp::backward, (k / (p * V)) * p + within % p, chunk, -1};
  }
  /// Calls emit(PipeAction) for each step of `rank`'s plan, in order.
  template <class Emit>
  static constexpr void generate(int p, int m, int rank, Emit&& emit) {
    const int total = V * m;
    const int w = warmup(p, m, rank);
    auto fwd = [&](int k) {
      const PipeAction a = step(p, k, true);
      detail::emit_forward(p, V, rank, a.microbatch, a.chunk, emit);
    };
    auto bwd = [&](int k) {
      const PipeAction a = step(p, k, false);
      detail::emit_backward(p, V, rank, a.microbatch, a.chunk, PipeOp::backward, emit);
    };
    for (int k = 0; k < w; ++k) fwd(k);
    for (int k = 0; k < total - w; ++k) {
      fwd(k + w);
      bwd(k);
    }
    for (int k = total - w; k < total; ++k) bwd(k);
  }
  /// Throws ConfigError when (p, m) is not a valid configuration.
  static void check(int p, int m) {
    detail::check_common(name, p, m);
    WEFT_REQUIRE(p >= 2, ConfigError, "Pipeline<Interleaved1F1B<", V, ">>: ", p,
                 " stage; interleaving needs at least 2 stages. Use OneFOneB on a single stage.");
    WEFT_REQUIRE(m % p == 0, ConfigError, "Pipeline<Interleaved1F1B<", V, ">>: ", m, " microbatches on ", p,
                 " stages; interleaved 1F1B needs the microbatch count to be a multiple of the stage count "
                 "(m % p == 0, here ",
                 m % p, "). Use ", m < p ? "" : std::to_string((m / p) * p) + " or ", (m / p + 1) * p, " microbatches.");
  }
  /// Compile-time version of check; its static_asserts explain a failure.
  template <std::size_t P, std::size_t M>
  static constexpr bool static_check() {
    static_assert(P >= 2, "Pipeline<Interleaved1F1B<V>>: interleaving needs at least 2 stages; use OneFOneB");
    static_assert(M % P == 0,
                  "Pipeline<Interleaved1F1B<V>>: interleaved 1F1B needs the microbatch count to be a multiple of "
                  "the stage count (M % P == 0); round the microbatch count to a multiple of P");
    return true;
  }
  /// Most chunk activations `rank` holds at once (each is 1/V of a stage's).
  static constexpr int peak_in_flight(int p, int m, int rank) {
    return detail::min_int(warmup(p, m, rank) + 1, V * m);
  }
  /// Fraction of rank-time spent idle, with zero transfer latency.
  static constexpr double bubble_fraction(int p, int m, const PipeCosts& = {}) {
    return double(p - 1) / double(V * m + p - 1);
  }
};

/// Zero-bubble ZB-H1 (Qi et al., 2023): the backward is split into its
/// input-gradient half B, on the critical path, and its weight-gradient half W,
/// which nobody waits for. Rank r runs 1F1B with B in place of the backward and
/// defers each W by r steps, so the W work fills what would be the 1F1B bubble
/// while every rank holds at most p microbatches (1F1B's peak, on rank 0).
/// Idle time (p-1)(F+B-W) per rank when W <= min(F, B) (derived in
/// docs/pipeline.md; a longer W does not fit its gap). Needs m >= p.
struct ZeroBubble {
  static constexpr std::string_view name = "ZeroBubble";
  static constexpr int chunks = 1;               ///< model chunks per rank
  static constexpr bool splits_backward = true;  ///< whether backward_weight is separate

  /// Calls emit(PipeAction) for each step of `rank`'s plan, in order.
  template <class Emit>
  static constexpr void generate(int p, int m, int rank, Emit&& emit) {
    const int warmup = detail::min_int(p - rank - 1, m);
    auto b_then_w = [&](int i) {
      detail::emit_backward(p, 1, rank, i, 0, PipeOp::backward_input, emit);
      if (i >= rank) detail::emit_weight(i - rank, 0, emit);
    };
    for (int i = 0; i < warmup; ++i) detail::emit_forward(p, 1, rank, i, 0, emit);
    for (int i = 0; i < m - warmup; ++i) {
      detail::emit_forward(p, 1, rank, warmup + i, 0, emit);
      b_then_w(i);
    }
    for (int i = m - warmup; i < m; ++i) b_then_w(i);
    for (int j = detail::max_int(m - rank, 0); j < m; ++j) detail::emit_weight(j, 0, emit);
  }
  /// Throws ConfigError when (p, m) is not a valid configuration.
  static void check(int p, int m) {
    detail::check_common(name, p, m);
    if (m < p)
      detail::throw_too_few_microbatches("ZeroBubble", p, m, "so that the deferred weight gradients fill the bubble");
  }
  /// Compile-time version of check; its static_asserts explain a failure.
  template <std::size_t P, std::size_t M>
  static constexpr bool static_check() {
    static_assert(M >= P,
                  "Pipeline<ZeroBubble>: ZB-H1 needs at least as many microbatches as stages (M >= P); "
                  "raise the microbatch count or use GPipe");
    return true;
  }
  /// Most microbatch activations `rank` holds at once (kept until W ran).
  static constexpr int peak_in_flight(int p, int m, int /*rank*/) { return detail::min_int(p, m); }
  /// Fraction of rank-time spent idle, with zero transfer latency; the
  /// schedule reaches it when W <= min(F, B).
  static constexpr double bubble_fraction(int p, int m, const PipeCosts& c = {}) {
    const double bubble = (p - 1) * (c.forward + c.backward_input - c.backward_weight);
    return bubble / (m * (c.forward + c.backward_input + c.backward_weight) + bubble);
  }
};

namespace detail {
/// Discards the actions a schedule generates: the action sink of the
/// PipelineSchedule concept. A named type, not a lambda: nvcc evaluates a
/// requires-expression that contains a lambda as false.
struct DiscardPipeActions {
  constexpr void operator()(const PipeAction&) const noexcept {}
};
}  // namespace detail

/// What Pipeline<Schedule> needs from a schedule type.
template <class S>
concept PipelineSchedule = requires(int p, int m, int r, const PipeCosts& c) {
  { S::name } -> std::convertible_to<std::string_view>;
  { S::chunks } -> std::convertible_to<int>;
  { S::splits_backward } -> std::convertible_to<bool>;
  S::check(p, m);
  { S::peak_in_flight(p, m, r) } -> std::convertible_to<int>;
  { S::bubble_fraction(p, m, c) } -> std::convertible_to<double>;
  S::generate(p, m, r, detail::DiscardPipeActions{});
};

namespace detail {
template <class Schedule, std::size_t P, std::size_t M>
constexpr bool pipeline_static_check() {
  static_assert(P == dynamic_extent || P >= 1, "Pipeline: a static stage count must be at least 1");
  static_assert(M == dynamic_extent || M >= 1, "Pipeline: a static microbatch count must be at least 1");
  if constexpr (P != dynamic_extent && M != dynamic_extent) return Schedule::template static_check<P, M>();
  return true;
}

/// Counts the steps of a plan (the size of its static array).
template <class Schedule>
constexpr std::size_t plan_length(int p, int m, int rank) {
  std::size_t n = 0;
  Schedule::generate(p, m, rank, [&](const PipeAction&) { ++n; });
  return n;
}
}  // namespace detail

/// A pipeline of `stages` ranks running `microbatches` microbatches per step
/// with a Schedule. Either size may be static (a template argument, checked by
/// static_assert) or dynamic (a constructor argument, checked at construction
/// with a ConfigError), as with Mesh extents. The plans are what each PP rank
/// executes; run them through simulate_pipeline() to check and time them.
template <class Schedule, std::size_t P = dynamic_extent, std::size_t M = dynamic_extent>
class Pipeline {
  static_assert(PipelineSchedule<Schedule>,
                "Pipeline<Schedule>: Schedule must be a pipeline schedule such as weft::GPipe, weft::OneFOneB, "
                "weft::Interleaved1F1B<V> or weft::ZeroBubble");
  static_assert(detail::pipeline_static_check<Schedule, P, M>());

 public:
  using schedule_type = Schedule;
  using policy_axis = PP;  ///< in a weft::Strategy, Pipeline<Schedule> is the policy of the PP axis
  static constexpr std::size_t static_stages = P;        ///< P, or dynamic_extent
  static constexpr std::size_t static_microbatches = M;  ///< M, or dynamic_extent
  static constexpr int chunks = Schedule::chunks;        ///< model chunks per rank (V)

  /// Both sizes static: nothing to check at run time.
  constexpr Pipeline()
    requires(P != dynamic_extent && M != dynamic_extent)
      : p_(int(P)), m_(int(M)) {}

  /// Sizes given at run time; a static size must be repeated unchanged.
  Pipeline(int stages, int microbatches) : p_(stages), m_(microbatches) {
    if constexpr (P != dynamic_extent)
      WEFT_REQUIRE(stages == int(P), ConfigError, "Pipeline<", Schedule::name, ">: ", stages,
                   " stages given but the type fixes ", P, ". Pass ", P, " or make the stage count dynamic.");
    if constexpr (M != dynamic_extent)
      WEFT_REQUIRE(microbatches == int(M), ConfigError, "Pipeline<", Schedule::name, ">: ", microbatches,
                   " microbatches given but the type fixes ", M, ". Pass ", M,
                   " or make the microbatch count dynamic.");
    Schedule::check(stages, microbatches);
  }

  /// Number of pipeline stages (ranks of the PP axis).
  constexpr int stages() const noexcept { return p_; }
  /// Number of microbatches per optimizer step.
  constexpr int microbatches() const noexcept { return m_; }

  /// The ordered actions of `rank` (0 <= rank < stages()).
  std::vector<PipeAction> plan(int rank) const {
    WEFT_REQUIRE(rank >= 0 && rank < p_, ConfigError, "Pipeline<", Schedule::name, ">::plan: rank ", rank,
                 " is outside the pipeline of ", p_, " stages; pass 0 <= rank < ", p_, ".");
    std::vector<PipeAction> out;
    Schedule::generate(p_, m_, rank, [&](const PipeAction& a) { out.push_back(a); });
    return out;
  }
  /// The plans of all ranks, indexed by rank.
  std::vector<std::vector<PipeAction>> plans() const {
    std::vector<std::vector<PipeAction>> out;
    for (int r = 0; r < p_; ++r) out.push_back(plan(r));
    return out;
  }
  /// The activation memory the schedule promises for `rank`, in chunk-microbatches.
  constexpr int peak_in_flight(int rank) const { return Schedule::peak_in_flight(p_, m_, rank); }
  /// The analytic idle fraction for these costs (zero transfer latency).
  constexpr double bubble_fraction(const PipeCosts& costs = {}) const {
    return Schedule::bubble_fraction(p_, m_, costs);
  }

  /// The plan of `Rank` as a std::array, computed at compile time.
  template <int Rank>
  static constexpr auto static_plan()
    requires(P != dynamic_extent && M != dynamic_extent)
  {
    static_assert(Rank >= 0 && std::size_t(Rank) < P, "Pipeline::static_plan<Rank>: Rank must be in [0, P)");
    constexpr std::size_t n = detail::plan_length<Schedule>(int(P), int(M), Rank);
    std::array<PipeAction, n> out{};
    std::size_t i = 0;
    Schedule::generate(int(P), int(M), Rank, [&](const PipeAction& a) { out[i++] = a; });
    return out;
  }

 private:
  int p_;
  int m_;
};

}  // namespace weft
