// Placement types: how one tensor is laid out over one mesh axis. Shard<D>
// splits dimension D, Replicate keeps a full copy per rank, Partial<Op> holds
// values still to be reduced with Op; On<Axis, P> ties a placement to an axis.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <type_traits>

#include <weft/comm/comm.hpp>
#include <weft/mesh/axis.hpp>

namespace weft {

// ------------------------------------------------------------ reduction tags

/// Reduction tag of Partial<Sum>: the true value is the sum over the axis.
struct Sum {
  static constexpr ReduceOp op = ReduceOp::sum;   ///< the Comm reduction that completes it
  static constexpr std::string_view name = "Sum"; ///< spelling in messages
  static constexpr bool linear = true;            ///< commutes with linear maps (sums, products with a constant)
};
/// Reduction tag of Partial<Max>: the true value is the maximum over the axis.
struct Max {
  static constexpr ReduceOp op = ReduceOp::max;   ///< the Comm reduction that completes it
  static constexpr std::string_view name = "Max"; ///< spelling in messages
  static constexpr bool linear = false;           ///< max does not commute with sums
};
/// Reduction tag of Partial<Min>: the true value is the minimum over the axis.
struct Min {
  static constexpr ReduceOp op = ReduceOp::min;   ///< the Comm reduction that completes it
  static constexpr std::string_view name = "Min"; ///< spelling in messages
  static constexpr bool linear = false;           ///< min does not commute with sums
};
/// Reduction tag of Partial<Avg>: the true value is the mean over the axis
/// (floating-point elements only).
struct Avg {
  static constexpr ReduceOp op = ReduceOp::avg;   ///< the Comm reduction that completes it
  static constexpr std::string_view name = "Avg"; ///< spelling in messages
  static constexpr bool linear = true;            ///< the mean is linear
};

/// A reduction tag usable in Partial<Op>: Sum, Max, Min, Avg or a user type
/// with the same three members.
template <class Op>
concept ReduceTag = requires {
  { Op::op } -> std::convertible_to<ReduceOp>;
  { Op::name } -> std::convertible_to<std::string_view>;
  { Op::linear } -> std::convertible_to<bool>;
};

// ---------------------------------------------------------------- placements

/// Dimension D of the tensor is split into equal contiguous blocks, one per
/// rank of the axis, in rank order.
template <std::size_t D>
struct Shard {
  static constexpr std::size_t dim = D;  ///< the split dimension
};

/// Every rank of the axis holds the whole tensor (the same values).
struct Replicate {};

/// Every rank of the axis holds the whole shape, but its values are partial:
/// the tensor is the reduction with Op of all ranks' values.
template <class Op>
struct Partial {
  static_assert(ReduceTag<Op>,
                "weft::Partial<Op>: Op must be a reduction tag: weft::Sum, weft::Max, weft::Min or weft::Avg");
  using op = Op;  ///< the reduction still to be applied
};

namespace detail {
template <class P>
struct placement_kind {
  static constexpr bool shard = false, replicate = false, partial = false;
};
template <std::size_t D>
struct placement_kind<Shard<D>> {
  static constexpr bool shard = true, replicate = false, partial = false;
};
template <>
struct placement_kind<Replicate> {
  static constexpr bool shard = false, replicate = true, partial = false;
};
template <class Op>
struct placement_kind<Partial<Op>> {
  static constexpr bool shard = false, replicate = false, partial = true;
};
}  // namespace detail

/// True for Shard<D>.
template <class P>
inline constexpr bool is_shard_v = detail::placement_kind<P>::shard;
/// True for Replicate.
template <class P>
inline constexpr bool is_replicate_v = detail::placement_kind<P>::replicate;
/// True for Partial<Op>.
template <class P>
inline constexpr bool is_partial_v = detail::placement_kind<P>::partial;

/// Shard<D>, Replicate or Partial<Op>.
template <class P>
concept Placement = is_shard_v<P> || is_replicate_v<P> || is_partial_v<P>;

/// A strategy policy or option (weft/vocabulary/strategy.hpp): a type that
/// names the axis it belongs on (`policy_axis`) or the policy it is an
/// option of (`policy_option_of`). On<Axis, P> takes one inside a weft::Strategy.
template <class P>
concept StrategyPolicyLike = requires { typename P::policy_axis; } || requires { typename P::policy_option_of; };

/// Placement P over mesh axis Axis: On<TP, Shard<1>>. Inside a
/// weft::Strategy, P may also be a strategy policy: On<DP, FullyShard>.
template <class Axis, class P>
struct On {
  static_assert(AxisTag<Axis>,
                "weft::On<Axis, P>: Axis must be a mesh axis tag such as weft::TP or weft::DP");
  static_assert(Placement<P> || StrategyPolicyLike<P>,
                "weft::On<Axis, P>: P must be a placement (weft::Shard<D>, weft::Replicate or weft::Partial<Op>) or, "
                "inside a weft::Strategy, a strategy policy (weft::FullyShard, weft::ZeRO<N>, "
                "weft::TensorParallel<...>, weft::Pipeline<Schedule>)");
  using axis = Axis;      ///< the mesh axis
  using placement = P;    ///< how the tensor lies over it
};

namespace detail {
template <class T>
struct is_on : std::false_type {};
template <class A, class P>
struct is_on<On<A, P>> : std::true_type {};
}  // namespace detail

/// True for On<Axis, P> with P a placement (not a strategy policy).
template <class T>
concept OnPlacement = detail::is_on<T>::value && Placement<typename T::placement>;

/// The spelling of a placement in messages: "Shard<1>", "Replicate", "Partial<Sum>".
template <Placement P>
std::string placement_name() {
  if constexpr (is_shard_v<P>) return "Shard<" + std::to_string(P::dim) + ">";
  else if constexpr (is_replicate_v<P>) return "Replicate";
  else return "Partial<" + std::string(P::op::name) + ">";
}

/// "On<tp, Shard<1>>"
template <OnPlacement O>
std::string placement_name() {
  return "On<" + std::string(O::axis::name) + ", " + placement_name<typename O::placement>() + ">";
}

// ------------------------------------------------------ lists of placements

/// A compile-time list of types.
template <class... Ts>
struct type_list {
  static constexpr std::size_t size = sizeof...(Ts);  ///< number of types
};

namespace detail {

inline constexpr std::size_t npos = static_cast<std::size_t>(-1);

// Position of Axis among the On<>s, or npos.
template <class Axis, class... Ons>
constexpr std::size_t axis_position() {
  constexpr bool same[] = {false, std::is_same_v<typename Ons::axis, Axis>...};
  for (std::size_t i = 1; i < sizeof...(Ons) + 1; ++i)
    if (same[i]) return i - 1;
  return npos;
}

template <class Axis, class... Ons>
struct placement_on {
  using type = Replicate;
};
template <class Axis, class First, class... Rest>
struct placement_on<Axis, First, Rest...> {
  using type = std::conditional_t<std::is_same_v<typename First::axis, Axis>, typename First::placement,
                                  typename placement_on<Axis, Rest...>::type>;
};

// Whether axis tags repeat among the On<>s.
template <class... Ons>
constexpr bool axes_unique() {
  constexpr std::size_t n = sizeof...(Ons);
  if constexpr (n < 2) {
    return true;
  } else {
    constexpr std::string_view names[] = {Ons::axis::name...};
    for (std::size_t i = 0; i < n; ++i)
      for (std::size_t j = i + 1; j < n; ++j)
        if (names[i] == names[j]) return false;
    return true;
  }
}

template <class P>
constexpr std::size_t shard_dim_or_npos() {
  if constexpr (is_shard_v<P>) return P::dim;
  else return npos;
}

// Whether no On<> after position pos shards dimension d (so the axis at pos is
// the innermost split of d: its blocks are contiguous inside the others').
template <std::size_t Pos, std::size_t D, class... Ons>
constexpr bool innermost_sharder() {
  constexpr std::size_t dims[] = {npos, shard_dim_or_npos<typename Ons::placement>()...};
  for (std::size_t i = Pos + 2; i < sizeof...(Ons) + 1; ++i)
    if (dims[i] == D) return false;
  return true;
}

// On<Axis, To> replacing Axis' entry, or appended when the list has none
// (and not appended at all when To is Replicate: unnamed axes are replicated).
template <class Axis, class To, class List>
struct replace_on;
template <class Axis, class To, class... Ons>
struct replace_on<Axis, To, type_list<Ons...>> {
  static constexpr bool named = axis_position<Axis, Ons...>() != npos;
  using replaced = type_list<std::conditional_t<std::is_same_v<typename Ons::axis, Axis>, On<Axis, To>, Ons>...>;
  using appended = std::conditional_t<is_replicate_v<To>, type_list<Ons...>, type_list<Ons..., On<Axis, To>>>;
  using type = std::conditional_t<named, replaced, appended>;
};

}  // namespace detail

/// The placement a list of On<>s gives Axis (Replicate when it is not named).
template <class Axis, class... Ons>
using placement_on_t = typename detail::placement_on<Axis, Ons...>::type;

}  // namespace weft
