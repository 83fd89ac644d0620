// Strategies as types: weft::Strategy<On<Axis, Policy>...> names, for each
// mesh axis, what that axis does (data parallelism with the placements of
// parameters, gradients and optimizer state; tensor parallelism with or
// without sequence parallelism; a pipeline schedule), and optionally the
// precision (weft::Precision, precision/policy.hpp). Pure types and checks,
// no run time: the model (nn::GPT), DataParallel, the pipeline stage and
// executor and train_step are all instantiated from one of these.
#pragma once

#include <cstddef>
#include <initializer_list>
#include <string>
#include <string_view>
#include <type_traits>

#include <weft/core/error.hpp>
#include <weft/mesh/axis.hpp>
#include <weft/vocabulary/context_policy.hpp>
#include <weft/vocabulary/dp_mode.hpp>
#include <weft/vocabulary/schedule.hpp>
#include <weft/placement/placement.hpp>
#include <weft/precision/policy.hpp>

namespace weft {

// ---------------------------------------------------------------------------
// Data parallelism over DP: the placements of the three states.

/// Data parallelism as the placements over DP of the three per-parameter
/// states: parameters, gradients and optimizer state, each Replicate or
/// Shard<0> (of the flat buffers DataParallel keeps). Sharding is monotone --
/// what is sharded earlier in a step stays sharded later -- so only four
/// combinations mean something: Replicate/Replicate/Replicate (DDP),
/// Replicate/Replicate/Shard (ZeRO-1), Replicate/Shard/Shard (ZeRO-2) and
/// Shard/Shard/Shard (fully sharded). Any other does not compile.
template <class Params, class Grads, class OptState>
struct DPStates {
  static_assert(is_replicate_v<Params> || std::is_same_v<Params, Shard<0>>,
                "weft::DPStates<Params, Grads, OptState>: the parameters' placement over DP must be weft::Replicate or "
                "weft::Shard<0> (a shard of the flat parameter buffer); Partial and Shard<D> with D > 0 mean nothing "
                "for data parallelism");
  static_assert(is_replicate_v<Grads> || std::is_same_v<Grads, Shard<0>>,
                "weft::DPStates<Params, Grads, OptState>: the gradients' placement over DP must be weft::Replicate or "
                "weft::Shard<0>");
  static_assert(is_replicate_v<OptState> || std::is_same_v<OptState, Shard<0>>,
                "weft::DPStates<Params, Grads, OptState>: the optimizer state's placement over DP must be "
                "weft::Replicate or weft::Shard<0>");
  static_assert(!(is_shard_v<Params> && !is_shard_v<Grads>),
                "weft::DPStates<Shard<0>, Replicate, ...>: sharded parameters need sharded gradients (each rank "
                "computes the gradient only where it holds the parameters at the step's end); use weft::FullyShard = "
                "DPStates<Shard<0>, Shard<0>, Shard<0>>");
  static_assert(!(is_shard_v<Grads> && !is_shard_v<OptState>),
                "weft::DPStates<..., Shard<0>, Replicate>: sharded gradients need a sharded optimizer state (a rank "
                "can only update the shard whose gradient it holds); use weft::ZeRO<2> = DPStates<Replicate, "
                "Shard<0>, Shard<0>>");
  using policy_axis = DP;      ///< the axis this policy belongs on
  using params = Params;       ///< placement of the parameters over DP
  using grads = Grads;         ///< placement of the gradients over DP
  using opt_state = OptState;  ///< placement of the optimizer state over DP
  /// The mode's name in the planner's and the command line's vocabulary.
  static constexpr parallel::DPMode mode = is_shard_v<Params>     ? parallel::DPMode::fsdp
                                           : is_shard_v<Grads>    ? parallel::DPMode::zero2
                                           : is_shard_v<OptState> ? parallel::DPMode::zero1
                                                                  : parallel::DPMode::replicate;
  /// "Replicate", "ZeRO<1>", "ZeRO<2>" or "FullyShard".
  static std::string policy_name() {
    switch (mode) {
      case parallel::DPMode::replicate: return "Replicate";
      case parallel::DPMode::zero1: return "ZeRO<1>";
      case parallel::DPMode::zero2: return "ZeRO<2>";
      case parallel::DPMode::fsdp: return "FullyShard";
    }
    return "?";
  }
};

/// Everything replicated over DP; gradients all-reduced (DDP). `On<DP, Replicate>` in a Strategy means the same.
using Replicated = DPStates<Replicate, Replicate, Replicate>;
/// Everything sharded over DP (FSDP, ZeRO-3). `On<DP, Shard<0>>` in a Strategy means the same.
using FullyShard = DPStates<Shard<0>, Shard<0>, Shard<0>>;

namespace detail {
template <int Stage>
struct zero_stage {
  static_assert(Stage >= 1 && Stage <= 3,
                "weft::ZeRO<Stage>: the stage must be 1 (optimizer state sharded), 2 (gradients too) or 3 (parameters "
                "too, = weft::FullyShard)");
  using type = FullyShard;
};
template <>
struct zero_stage<1> {
  using type = DPStates<Replicate, Replicate, Shard<0>>;
};
template <>
struct zero_stage<2> {
  using type = DPStates<Replicate, Shard<0>, Shard<0>>;
};
}  // namespace detail

/// ZeRO stage 1 (optimizer state sharded over DP), 2 (gradients too) or 3 (= FullyShard).
template <int Stage>
using ZeRO = typename detail::zero_stage<Stage>::type;

/// True for the data-parallel policies, the DPStates<...> types (Replicated,
/// ZeRO<1>, ZeRO<2>, FullyShard): what DataParallel's Policy must be.
template <class X>
inline constexpr bool is_dp_policy_v = false;
template <class Params, class Grads, class OptState>
inline constexpr bool is_dp_policy_v<DPStates<Params, Grads, OptState>> = true;

/// The DP policy of a DP mode named by the planner's enum (a type for every value).
template <parallel::DPMode M>
using dp_policy_of = std::conditional_t<
    M == parallel::DPMode::replicate, Replicated,
    std::conditional_t<M == parallel::DPMode::zero1, ZeRO<1>,
                       std::conditional_t<M == parallel::DPMode::zero2, ZeRO<2>, FullyShard>>>;

// ---------------------------------------------------------------------------
// Tensor parallelism over TP.

/// Option of TensorParallel: the token dimension of the residual stream (and
/// of the norms and dropout around the matmuls) is sharded over TP too.
struct SequenceParallel {
  using policy_option_of = TP;  ///< an option of the TP axis' TensorParallel, not a policy of its own
  static constexpr std::string_view name = "SequenceParallel";
};

namespace detail {
template <class... Options>
constexpr bool tp_options_valid() {
  return ((std::is_same_v<Options, SequenceParallel>) && ...) && sizeof...(Options) <= 1;
}
}  // namespace detail

/// Tensor parallelism over TP: attention heads, MLP hidden units and the
/// vocabulary are split over the axis (Megatron's column/row pairs).
/// `TensorParallel<SequenceParallel>` shards the residual stream's tokens as well.
template <class... Options>
struct TensorParallel {
  static_assert(detail::tp_options_valid<Options...>(),
                "weft::TensorParallel<Options...>: the only option is weft::SequenceParallel, at most once: "
                "TensorParallel<> or TensorParallel<SequenceParallel>");
  using policy_axis = TP;  ///< the axis this policy belongs on
  /// Whether the residual stream's tokens are sharded over TP too.
  static constexpr bool sequence_parallel = (std::is_same_v<Options, SequenceParallel> || ...);
  /// "TensorParallel<>" or "TensorParallel<SequenceParallel>".
  static std::string policy_name() {
    return sequence_parallel ? "TensorParallel<SequenceParallel>" : "TensorParallel<>";
  }
};

// ---------------------------------------------------------------------------
// Expert parallelism over EP.

/// Expert parallelism over EP for mixture-of-experts blocks of N routed
/// experts: each EP rank holds N / ep of them, tokens travel to their experts'
/// ranks by all_to_allv and back. The EP ranks are data ranks as well (EP is
/// folded over DP): everything outside the experts is data-parallel over
/// DP x EP, the experts over DP alone. N must divide by ep -- checked at
/// compile time when the mesh's EP extent is static (weft::check_strategy_mesh)
/// and at construction otherwise (weft::validate_strategy, nn::expert_parallel_of).
template <std::size_t N>
struct Experts {
  static_assert(N >= 1, "weft::Experts<N>: a mixture-of-experts layer needs at least one routed expert (N >= 1)");
  using policy_axis = EP;  ///< the axis this policy belongs on
  /// The number of routed experts of every MoE block.
  static constexpr std::size_t experts = N;
  /// "Experts<N>".
  static std::string policy_name() { return "Experts<" + std::to_string(N) + ">"; }
};

/// True for Experts<N>.
template <class X>
inline constexpr bool is_experts_policy_v = false;
template <std::size_t N>
inline constexpr bool is_experts_policy_v<Experts<N>> = true;

namespace detail {
/// "1, 2, 4, 8": the EP sizes that divide n experts.
inline std::string divisors_text(std::size_t n) {
  std::string s;
  for (std::size_t d = 1; d <= n; ++d)
    if (n % d == 0) s += (s.empty() ? "" : ", ") + std::to_string(d);
  return s;
}
}  // namespace detail

// ---------------------------------------------------------------------------
// The strategy.

/// The policy of an axis a Strategy leaves out: the axis (if the mesh has it)
/// must have extent 1.
struct NoPolicy {
  static std::string policy_name() { return "none"; }
};

namespace detail {
template <class Policy>
struct schedule_name_of {
  static std::string get() { return std::string(Policy::name); }
};
template <int V>
struct schedule_name_of<Interleaved1F1B<V>> {
  static std::string get() { return "Interleaved1F1B<" + std::to_string(V) + ">"; }
};

// What an On<Axis, X> of a Strategy means: X normalised to a policy type.
template <class Axis, class X>
struct normalise_policy {
  using type = X;
};
// On<DP, Replicate> is DDP, On<DP, Shard<0>> fully sharded.
template <>
struct normalise_policy<DP, Replicate> {
  using type = Replicated;
};
template <>
struct normalise_policy<DP, Shard<0>> {
  using type = FullyShard;
};

template <class X>
struct is_pipeline_policy : std::false_type {};
template <class S, std::size_t P, std::size_t M>
struct is_pipeline_policy<Pipeline<S, P, M>> : std::true_type {};

template <class X>
struct is_dp_policy : std::false_type {};
template <class A, class B, class C>
struct is_dp_policy<DPStates<A, B, C>> : std::true_type {};

template <class X>
struct is_tp_policy : std::false_type {};
template <class... O>
struct is_tp_policy<TensorParallel<O...>> : std::true_type {};

// The axis a policy belongs on (void: not a policy).
template <class X>
struct policy_axis_of {
  using type = void;
};
template <class X>
  requires requires { typename X::policy_axis; }
struct policy_axis_of<X> {
  using type = typename X::policy_axis;
};

template <class X>
std::string policy_name_of() {
  if constexpr (is_pipeline_policy<X>::value) return "Pipeline<" + schedule_name_of<typename X::schedule_type>::get() + ">";
  else return X::policy_name();
}

// One entry of Strategy<...>::name(): "On<dp, FullyShard>", or a Precision
// entry's own spelling. Instantiated once per entry type and shared by every
// strategy that holds the entry, so that a table of many strategies (an
// executable's --dp x tp x pp x cp choices) does not compile a naming body
// per strategy.
template <class E>
std::string strategy_entry_name() {
  if constexpr (is_precision_v<E>) {
    return E::policy_name();
  } else {
    using X = typename normalise_policy<typename E::axis, typename E::placement>::type;
    return "On<" + std::string(E::axis::name) + ", " + policy_name_of<X>() + ">";
  }
}

// "Strategy<" + the entries' names joined by ", " + ">".
inline std::string strategy_spelling(std::initializer_list<std::string (*)()> entries) {
  std::string s = "Strategy<";
  bool first = true;
  for (auto entry : entries) {
    if (!first) s += ", ";
    first = false;
    s += entry();
  }
  return s + ">";
}

// Checks one On<Axis, X> of a Strategy; the messages name the fix.
template <class O>
constexpr bool check_strategy_entry() {
  static_assert(is_on<O>::value || is_precision_v<O>,
                "weft::Strategy<...>: every argument must be weft::On<Axis, Policy>, e.g. "
                "weft::On<weft::DP, weft::FullyShard> or weft::On<weft::TP, weft::TensorParallel<>>, or the "
                "precision, weft::Precision<Param, Reduce, LossScale>");
  // Naming Precision<...> as an argument does not instantiate it; completing
  // the type here runs its own checks (fp16 without a loss scaler, ...).
  if constexpr (is_precision_v<O>) static_assert(sizeof(O) > 0);
  if constexpr (is_on<O>::value) {
    using Axis = typename O::axis;
    using X = typename normalise_policy<Axis, typename O::placement>::type;
    static_assert(!is_precision_v<X>,
                  "weft::Strategy: weft::Precision<...> is not the policy of a mesh axis -- it holds for the whole "
                  "model; give it as an entry of its own: weft::Strategy<weft::On<weft::DP, weft::FullyShard>, "
                  "weft::Precision<weft::BF16, weft::F32>>");
    static_assert(!std::is_same_v<X, SequenceParallel>,
                  "weft::Strategy: SequenceParallel is not a policy of its own -- it is an option of tensor "
                  "parallelism and needs the TP axis. Write weft::On<weft::TP, "
                  "weft::TensorParallel<weft::SequenceParallel>>");
    static_assert(!(Placement<X> && std::is_same_v<Axis, DP>),
                  "weft::Strategy: over DP a placement policy must be weft::Replicate (DDP) or weft::Shard<0> (fully "
                  "sharded); for ZeRO-1 and ZeRO-2 use weft::ZeRO<1> or weft::ZeRO<2>");
    static_assert(!(Placement<X> && !std::is_same_v<Axis, DP>),
                  "weft::Strategy: a bare placement (Replicate, Shard<D>, Partial) is a policy only over DP; give "
                  "other axes their strategy: weft::TensorParallel<> on TP, weft::Pipeline<Schedule> on PP");
    if constexpr (!Placement<X> && !std::is_same_v<X, SequenceParallel> && !is_precision_v<X>) {
      using Home = typename policy_axis_of<X>::type;
      static_assert(!std::is_void_v<Home>,
                    "weft::Strategy: the policy of an On<Axis, Policy> is not a strategy policy; use weft::Replicated, "
                    "weft::ZeRO<1>, weft::ZeRO<2> or weft::FullyShard on DP, weft::TensorParallel<...> on TP, "
                    "weft::Pipeline<Schedule> on PP, weft::Context<Variant> on CP, weft::Experts<N> on EP");
      if constexpr (!std::is_void_v<Home>) {
        static_assert(!is_dp_policy<X>::value || std::is_same_v<Axis, DP>,
                      "weft::Strategy: a data-parallel policy (Replicated, ZeRO<N>, FullyShard, DPStates) belongs on "
                      "the DP axis: weft::On<weft::DP, Policy>");
        static_assert(!is_tp_policy<X>::value || std::is_same_v<Axis, TP>,
                      "weft::Strategy: weft::TensorParallel<...> belongs on the TP axis: weft::On<weft::TP, "
                      "weft::TensorParallel<...>>");
        static_assert(!is_pipeline_policy<X>::value || std::is_same_v<Axis, PP>,
                      "weft::Strategy: weft::Pipeline<Schedule> belongs on the PP axis: weft::On<weft::PP, "
                      "weft::Pipeline<Schedule>>");
        static_assert(!is_context_policy<X>::value || std::is_same_v<Axis, CP>,
                      "weft::Strategy: weft::Context<Variant> belongs on the CP axis: weft::On<weft::CP, "
                      "weft::Context<weft::Ring>> (or AllGather, AllToAll)");
        static_assert(!is_experts_policy_v<X> || std::is_same_v<Axis, EP>,
                      "weft::Strategy: weft::Experts<N> belongs on the EP axis: weft::On<weft::EP, weft::Experts<N>>");
      }
    }
  }
  return true;
}

// The mesh axis of a Strategy entry; void for the Precision entry, which names none.
template <class O>
struct entry_axis {
  using type = typename O::axis;
};
template <class P, class R, class L>
struct entry_axis<Precision<P, R, L>> {
  using type = void;
};
template <class O>
using entry_axis_t = typename entry_axis<O>::type;

template <class A, class... Os>
constexpr std::size_t count_axis() {
  return (std::size_t(0) + ... + std::size_t(std::is_same_v<entry_axis_t<Os>, A>));
}
// Whether entry O names an axis no other entry names (the Precision entry is counted apart).
template <class O, class... Os>
constexpr bool axis_named_once() {
  if constexpr (is_precision_v<O>) return true;
  else return count_axis<entry_axis_t<O>, Os...>() == 1;
}

template <class Axis, class... Os>
struct policy_on {
  using type = NoPolicy;
};
template <class Axis, class O, class... Os>
struct policy_on<Axis, O, Os...> {
  using type = std::conditional_t<std::is_same_v<typename O::axis, Axis>,
                                  typename normalise_policy<Axis, typename O::placement>::type,
                                  typename policy_on<Axis, Os...>::type>;
};
template <class Axis, class P, class R, class L, class... Os>
struct policy_on<Axis, Precision<P, R, L>, Os...> : policy_on<Axis, Os...> {};

// The Precision entry among a Strategy's entries; Precision<> (all fp32) when there is none.
template <class... Os>
struct precision_entry {
  using type = Precision<>;
};
template <class O, class... Os>
struct precision_entry<O, Os...> : precision_entry<Os...> {};
template <class P, class R, class L, class... Os>
struct precision_entry<Precision<P, R, L>, Os...> {
  using type = Precision<P, R, L>;
};
}  // namespace detail

/// A parallel strategy: one policy per mesh axis, outermost first as in the
/// mesh (the order of the On<...> entries does not change the meaning).
///
///   using S = weft::Strategy<weft::On<weft::DP, weft::FullyShard>,
///                            weft::On<weft::PP, weft::Pipeline<weft::OneFOneB>>,
///                            weft::On<weft::TP, weft::TensorParallel<weft::SequenceParallel>>>;
///
/// Axes the strategy leaves out must have extent 1 on the mesh (checked at
/// construction of the runtime pieces); a policy on an axis the mesh lacks
/// does not compile (weft::check_strategy_mesh).
///
/// One entry may instead be the precision, weft::Precision<Param, Reduce,
/// LossScale>; without one the strategy is all fp32 (Precision<>). The GPT,
/// the serving runner and the loss-scaled train_step overloads read it
/// (docs/architecture.md, "Mixed precision").
template <class... Entries>
struct Strategy {
  static_assert((detail::check_strategy_entry<Entries>() && ...));
  static_assert((detail::axis_named_once<Entries, Entries...>() && ...),
                "weft::Strategy<...>: two policies name the same mesh axis; give each axis one policy (for ZeRO with "
                "sequence-parallel TP write On<DP, ZeRO<1>>, On<TP, TensorParallel<SequenceParallel>>)");
  static_assert((std::size_t(0) + ... + std::size_t(is_precision_v<Entries>)) <= 1,
                "weft::Strategy<...>: two weft::Precision<...> entries; a strategy has one precision -- keep the one "
                "you mean, e.g. weft::Strategy<weft::On<weft::DP, weft::FullyShard>, weft::Precision<weft::BF16, "
                "weft::F32>>");

  /// The policy on Axis (NoPolicy when the strategy leaves Axis out).
  template <class Axis>
  using policy = typename detail::policy_on<Axis, Entries...>::type;
  /// Whether the strategy gives Axis a policy.
  template <class Axis>
  static constexpr bool has = !std::is_same_v<policy<Axis>, NoPolicy>;

  /// The DP policy (Replicated when the strategy leaves DP out: with one DP
  /// rank every mode computes the same, and replicate does no work).
  using data_parallel = std::conditional_t<has<DP>, policy<DP>, Replicated>;
  /// The TP policy, or NoPolicy.
  using tensor_parallel = policy<TP>;
  /// Whether the layers are split over TP.
  static constexpr bool tensor_parallel_v = has<TP>;
  /// Whether the residual stream's tokens are sharded over TP.
  static constexpr bool sequence_parallel = [] {
    if constexpr (has<TP>) return policy<TP>::sequence_parallel;
    else return false;
  }();
  /// Whether the model is split into pipeline stages over PP.
  static constexpr bool pipelined = has<PP>;
  /// The CP policy (weft::Context<Ring | AllGather | AllToAll>), or NoPolicy.
  using context_parallel = policy<CP>;
  /// The EP policy (weft::Experts<N>), or NoPolicy.
  using expert_parallel = policy<EP>;
  /// Whether MoE blocks' experts are split over EP.
  static constexpr bool expert_parallel_v = has<EP>;
  /// The precision policy: the Precision entry, or Precision<> (all fp32) without one.
  using precision = typename detail::precision_entry<Entries...>::type;

  /// The strategy's spelling: "Strategy<On<dp, FullyShard>, On<tp, TensorParallel<>>>"
  /// ("Strategy<>" for the single-process model; a Precision entry is spelled
  /// where it stands, "Precision<BF16, F32>"). Run records name it.
  static std::string name() { return detail::strategy_spelling({&detail::strategy_entry_name<Entries>...}); }
};

/// True for Strategy<...>.
template <class S>
inline constexpr bool is_strategy_v = false;
template <class... E>
inline constexpr bool is_strategy_v<Strategy<E...>> = true;

/// A weft::Strategy<...> type.
template <class S>
concept StrategyType = is_strategy_v<S>;

/// The single-process strategy: no axis does anything.
using SingleProcess = Strategy<>;

/// A strategy's precision policy: its Precision entry, or Precision<> (all
/// fp32) when it has none. precision_of_t<S>::param_type and ::reduce_type
/// are the storage types of parameters and activations and of the gradient
/// reduction.
template <StrategyType S>
using precision_of_t = typename S::precision;

/// The schedule type of a pipelined strategy (its Pipeline<Schedule>'s Schedule).
template <StrategyType S>
  requires(S::pipelined)
using strategy_schedule_t = typename S::template policy<PP>::schedule_type;

/// What of a strategy changes the code of a layer: its tensor-parallel policy
/// (NoPolicy, TensorParallel<> or TensorParallel<SequenceParallel>). Layers
/// and models are parameterised by this projection, not by the whole
/// strategy, so that strategies that differ only in what wraps the model (the
/// DP mode, the schedule) share one model type.
template <StrategyType S>
using layer_policy_t = typename S::tensor_parallel;

// ---------------------------------------------------------------------------
// Checks against a mesh and a model's sizes.

namespace detail {
template <class Axis, class MeshT>
constexpr std::size_t static_extent_of() {
  if constexpr (MeshT::template has_axis<Axis>) return MeshT::static_extents[MeshT::template index_of<Axis>()];
  else return 1;
}

template <class MeshT, class E>
constexpr bool check_entry_in_mesh() {
  if constexpr (!is_precision_v<E>)  // the Precision entry names no axis
    static_assert(MeshT::template has_axis<typename E::axis>,
                  "weft::Strategy: a policy is on a mesh axis that the mesh lacks (see the On<Axis, Policy> in the "
                  "instantiation below); add that axis to the weft::Mesh<...> or drop the policy from the Strategy");
  return true;
}

template <class S>
struct strategy_entries;
template <class... E>
struct strategy_entries<Strategy<E...>> {
  template <class MeshT>
  static constexpr bool in_mesh() {
    return (check_entry_in_mesh<MeshT, E>() && ...);
  }
};

inline constexpr const char* sp_needs_tp_text =
    "TensorParallel<SequenceParallel>: sequence parallelism shards the tokens over the TP ranks and needs a TP axis "
    "of more than one rank; use TensorParallel<> or a larger tp";
inline constexpr const char* interleaved_needs_stages_text =
    "Pipeline<Interleaved1F1B<V>>: interleaving needs at least 2 pipeline stages on the PP axis; use "
    "Pipeline<OneFOneB> or a larger pp";
}  // namespace detail

/// Checks at compile time what a strategy needs of a mesh type: every policy's
/// axis is in the mesh; with static extents, sequence parallelism has a TP
/// axis of more than one rank and an interleaved schedule at least 2 stages.
/// Returns true (use inside static_assert or as a constant).
template <StrategyType S, class MeshT>
constexpr bool check_strategy_mesh() {
  static_assert(detail::strategy_entries<S>::template in_mesh<MeshT>());
  if constexpr (S::sequence_parallel && MeshT::template has_axis<TP>)
    static_assert(detail::static_extent_of<TP, MeshT>() != 1,
                  "TensorParallel<SequenceParallel>: sequence parallelism shards the tokens over the TP ranks and "
                  "needs a TP axis of more than one rank; use TensorParallel<> or a larger tp");
  if constexpr (S::expert_parallel_v && MeshT::template has_axis<EP>)
    if constexpr (detail::static_extent_of<EP, MeshT>() != dynamic_extent)
      static_assert(S::expert_parallel::experts % detail::static_extent_of<EP, MeshT>() == 0,
                    "weft::Experts<N>: the routed experts do not divide by the EP axis' extent (each EP rank holds "
                    "N / ep whole experts); choose ep among the divisors of N");
  if constexpr (S::pipelined && MeshT::template has_axis<PP>)
    if constexpr (strategy_schedule_t<S>::chunks > 1)
      static_assert(detail::static_extent_of<PP, MeshT>() != 1,
                    "Pipeline<Interleaved1F1B<V>>: interleaving needs at least 2 pipeline stages on the PP axis; use "
                    "Pipeline<OneFOneB> or a larger pp");
  return true;
}

/// Sizes of a model that a strategy splits (dynamic_extent: known only at run time).
template <std::size_t Heads = dynamic_extent, std::size_t Blocks = dynamic_extent>
struct ModelSizes {
  static constexpr std::size_t heads = Heads;    ///< attention heads (split over TP); dynamic_extent if none or dynamic
  static constexpr std::size_t blocks = Blocks;  ///< blocks (split over PP stages x chunks)
};

/// Checks at compile time that a model's static sizes divide over a strategy
/// on a mesh with static extents: heads by tp, blocks by stages x chunks.
/// Sizes or extents that are dynamic are checked at run time instead, by
/// validate_strategy, with the same text.
template <StrategyType S, class MeshT, class Sizes>
constexpr bool check_strategy_sizes() {
  static_assert(check_strategy_mesh<S, MeshT>());
  if constexpr (S::tensor_parallel_v && Sizes::heads != dynamic_extent &&
                detail::static_extent_of<TP, MeshT>() != dynamic_extent)
    static_assert(Sizes::heads % detail::static_extent_of<TP, MeshT>() == 0,
                  "TensorParallel: the attention heads do not divide by tp (each TP rank holds heads / tp whole "
                  "heads); choose tp among the divisors of the head count");
  if constexpr (S::pipelined && Sizes::blocks != dynamic_extent &&
                detail::static_extent_of<PP, MeshT>() != dynamic_extent)
    static_assert(Sizes::blocks % (detail::static_extent_of<PP, MeshT>() * strategy_schedule_t<S>::chunks) == 0,
                  "Pipeline<Schedule>: the blocks do not divide by stages x chunks (pp x V for interleaved "
                  "schedules), so the stages would be unequal; choose pp (and V) among the divisors of the block "
                  "count, or give the stage boundaries explicitly");
  return true;
}

/// What a model can do with the strategy entries that act inside its layers:
/// sequence parallelism, context parallelism and expert parallelism. The DP
/// mode, the schedule and plain tensor parallelism act around or through the
/// layers a model is built from, so every model takes them.
///
/// A model declares what it takes with a static member,
///
///   static constexpr weft::ModelPolicies policies{.sequence_parallel = false, .context = false, .experts = true};
///
/// and a model that declares none takes none of the three. A strategy that
/// gives a model a policy it does not take does not compile
/// (weft::check_strategy_model), because it would otherwise be ignored.
struct ModelPolicies {
  bool sequence_parallel = false;  ///< its layers run TensorParallel<SequenceParallel> (tokens sharded over TP)
  bool context = false;            ///< it runs Context<...>: sequence-sharded activations and CP attention
  bool experts = false;            ///< its blocks hold MoE layers that split their experts under Experts<N>
};

/// The ModelPolicies that Model declares (`Model::policies`), or none.
template <class Model>
constexpr ModelPolicies model_policies() {
  if constexpr (requires { Model::policies; }) return ModelPolicies(Model::policies);
  else return ModelPolicies{};
}

/// Checks at compile time that Model takes every policy of S that acts inside
/// a model's layers (weft::ModelPolicies): sequence parallelism, a Context
/// entry, an Experts entry. Returns true (use inside static_assert).
template <StrategyType S, class Model>
constexpr bool check_strategy_model() {
  constexpr ModelPolicies p = model_policies<Model>();
  if constexpr (S::sequence_parallel)
    static_assert(p.sequence_parallel,
                  "weft::Strategy: TensorParallel<SequenceParallel> on a model whose layers do not take sequence "
                  "parallelism (its `policies` does not say .sequence_parallel = true), so the tokens would not be "
                  "sharded and the policy would be ignored; use On<TP, TensorParallel<>>, or give the model layers "
                  "that shard the residual stream over TP");
  if constexpr (S::template has<CP>)
    static_assert(p.context,
                  "weft::Strategy: a Context<...> policy on a model that does not take context parallelism (its "
                  "`policies` does not say .context = true), so each CP rank would train on its own sequences and "
                  "the run would silently leave the one-rank curve; drop On<CP, ...> and set cp=1, or train a model "
                  "that shards its sequences over CP (nn::GPT)");
  if constexpr (S::expert_parallel_v)
    static_assert(p.experts,
                  "weft::Strategy: an Experts<N> policy on a model without MoE layers (its `policies` does not say "
                  ".experts = true), so there are no experts to split over EP; drop On<EP, Experts<N>> and set ep=1, "
                  "or build the model's blocks with nn::MoE layers");
  return true;
}

/// The run-time form of check_strategy_mesh and check_strategy_sizes, for
/// dynamic extents and sizes: an axis the strategy leaves out must have
/// extent 1; sequence parallelism needs tp > 1, interleaving pp >= 2; heads
/// divide by tp, and when `equal_stages` blocks by pp x chunks. 0 for heads or
/// blocks skips that check. ConfigError with the compile-time text and the values seen.
template <StrategyType S, class MeshT>
void validate_strategy(const MeshT& mesh, std::size_t heads = 0, std::size_t blocks = 0, bool equal_stages = false) {
  static_assert(check_strategy_mesh<S, MeshT>());
  auto extent = [&](auto tag) -> std::size_t {
    using A = decltype(tag);
    if constexpr (MeshT::template has_axis<A>) return std::size_t(mesh.template extent<A>());
    else return 1;
  };
  auto unused = [&](auto tag, const char* what) {
    using A = decltype(tag);
    if constexpr (MeshT::template has_axis<A>)
      WEFT_REQUIRE(S::template has<A> || extent(tag) == 1, ConfigError, S::name(), ": the mesh's ", A::name,
                   " axis has extent ", extent(tag), " but the strategy gives it no policy; add On<",
                   what, "> to the strategy or set ", A::name, "=1");
  };
  unused(DP{}, "DP, Replicated|ZeRO<1>|ZeRO<2>|FullyShard");
  unused(TP{}, "TP, TensorParallel<...>");
  unused(PP{}, "PP, Pipeline<Schedule>");
  unused(CP{}, "CP, ...: context parallelism");
  unused(EP{}, "EP, Experts<N>");
  const std::size_t tp = extent(TP{}), pp = extent(PP{});
  if constexpr (S::expert_parallel_v) {
    constexpr std::size_t n = S::expert_parallel::experts;
    const std::size_t ep = extent(EP{});
    WEFT_REQUIRE(n % ep == 0, ConfigError,
                 "weft::Experts<N>: the routed experts do not divide by the EP axis' extent (each EP rank holds N / "
                 "ep whole experts); choose ep among the divisors of N (N ",
                 n, ", ep ", ep, "; ep sizes that work: ", detail::divisors_text(n), ")");
  }
  if constexpr (S::sequence_parallel)
    WEFT_REQUIRE(tp > 1, ConfigError, detail::sp_needs_tp_text, " (tp is ", tp, ")");
  if constexpr (S::pipelined) {
    constexpr int chunks = strategy_schedule_t<S>::chunks;
    if constexpr (chunks > 1) WEFT_REQUIRE(pp >= 2, ConfigError, detail::interleaved_needs_stages_text, " (pp is ", pp, ")");
    if (blocks && equal_stages)
      WEFT_REQUIRE(blocks % (pp * std::size_t(chunks)) == 0, ConfigError,
                   "Pipeline<Schedule>: the blocks do not divide by stages x chunks (pp x V for interleaved "
                   "schedules), so the stages would be unequal; choose pp (and V) among the divisors of the block "
                   "count, or give the stage boundaries explicitly (blocks ",
                   blocks, ", pp ", pp, ", chunks ", chunks, ")");
  }
  if constexpr (S::tensor_parallel_v)
    if (heads)
      WEFT_REQUIRE(heads % tp == 0, ConfigError,
                   "TensorParallel: the attention heads do not divide by tp (each TP rank holds heads / tp whole "
                   "heads); choose tp among the divisors of the head count (heads ",
                   heads, ", tp ", tp, ")");
}

}  // namespace weft
