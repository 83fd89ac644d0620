// Propagation rules: the placement of an operation's result as a type function
// of its operands' placements, for matmul, element-wise operations and
// reductions over a dimension. An unsupported combination does not compile,
// and the message suggests the redistribute that fixes it.
#pragma once

#include <cstddef>
#include <type_traits>

#include <weft/placement/dist_view.hpp>
#include <weft/placement/placement.hpp>

namespace weft {

// ------------------------------------------------------------------- matmul

namespace detail {
// What a Shard<D> of a matmul operand splits; see matmul_placement.
enum class MatmulRole { none, batch, rows, contraction, cols };

template <class P, std::size_t Rank, bool IsB>
constexpr MatmulRole matmul_role() {
  if constexpr (!is_shard_v<P>) {
    return MatmulRole::none;
  } else {
    if (P::dim + 2 < Rank) return MatmulRole::batch;
    if (P::dim + 2 == Rank) return IsB ? MatmulRole::contraction : MatmulRole::rows;
    if (P::dim + 1 == Rank) return IsB ? MatmulRole::cols : MatmulRole::contraction;
    return MatmulRole::none;
  }
}

template <class P>
constexpr bool linear_partial() {
  if constexpr (is_partial_v<P>) return P::op::linear;
  else return false;
}
}  // namespace detail

/// The placement over one mesh axis of C = A x B, where A is (..., m, k) and
/// B is (..., k, n), both of rank Rank (leading dimensions are batch
/// dimensions, placed alike in both operands):
///   Replicate x Replicate  -> Replicate
///   Shard<m>  x Replicate  -> Shard<m>    (rows of A: Shard<0> for matrices)
///   Replicate x Shard<n>   -> Shard<n>    (columns of B: Shard<1>)
///   Shard<k>  x Shard<k>   -> Partial<Sum> (Shard<1> x Shard<0> for matrices)
///   Shard<b>  x Shard<b>   -> Shard<b>    (a batch dimension)
///   Partial<Sum|Avg> x Replicate, Replicate x Partial<Sum|Avg> -> the same Partial
/// Any other pair is a compile error that says which redistribute fixes it.
template <class PA, class PB, std::size_t Rank = 2>
struct matmul_placement {
  static_assert(Placement<PA> && Placement<PB>,
                "weft::matmul_placement<A, B>: both operands' placements must be Shard<D>, Replicate or Partial<Op>");
  static_assert(Rank >= 2, "weft::matmul_placement: matmul operands have rank 2 or more");

 private:
  using R = detail::MatmulRole;
  static constexpr R ra = detail::matmul_role<PA, Rank, false>();
  static constexpr R rb = detail::matmul_role<PB, Rank, true>();
  static constexpr std::size_t da = detail::shard_dim_or_npos<PA>();
  static constexpr std::size_t db = detail::shard_dim_or_npos<PB>();

  static constexpr int check() {
    static_assert(da == detail::npos || da < Rank, "weft::matmul: A is Shard<D> with D beyond its rank");
    static_assert(db == detail::npos || db < Rank, "weft::matmul: B is Shard<D> with D beyond its rank");
    if constexpr (is_partial_v<PA> || is_partial_v<PB>) {
      static_assert(!(is_partial_v<PA> && is_partial_v<PB>),
                    "weft::matmul: A and B are both Partial, and the product of two sums of partial values is not a "
                    "sum of partial products. Redistribute one operand to Replicate (all-reduce) first.");
      static_assert(!(is_partial_v<PA> && is_shard_v<PB>) && !(is_shard_v<PA> && is_partial_v<PB>),
                    "weft::matmul: one operand is Partial and the other is Shard: a partial block times another "
                    "block is no partial of the product. Redistribute the Partial operand to Replicate (all-reduce) "
                    "first.");
      static_assert(detail::linear_partial<PA>() || detail::linear_partial<PB>(),
                    "weft::matmul: an operand is Partial<Max> or Partial<Min>, which does not commute with the sums "
                    "of a product. Redistribute it to Replicate (all-reduce) first.");
    } else if constexpr (is_shard_v<PA> && is_replicate_v<PB>) {
      static_assert(ra != R::contraction,
                    "weft::matmul: A is Shard over its contraction dimension (Shard<1> for a matrix) but B is "
                    "Replicate. Redistribute B to Shard over its contraction dimension (Shard<0> for a matrix: a "
                    "local slice, no communication); the product is then Partial<Sum>.");
      static_assert(ra != R::batch,
                    "weft::matmul: A is Shard over a batch dimension but B is Replicate. Redistribute B to the same "
                    "Shard<D> (a local slice, no communication).");
    } else if constexpr (is_replicate_v<PA> && is_shard_v<PB>) {
      static_assert(rb != R::contraction,
                    "weft::matmul: A is Replicate but B is Shard over its contraction dimension (Shard<0> for a "
                    "matrix). Redistribute A to Shard over its contraction dimension (Shard<1> for a matrix: a local "
                    "slice, no communication); the product is then Partial<Sum>.");
      static_assert(rb != R::batch,
                    "weft::matmul: A is Replicate but B is Shard over a batch dimension. Redistribute A to the same "
                    "Shard<D> (a local slice, no communication).");
    } else if constexpr (is_shard_v<PA> && is_shard_v<PB>) {
      static_assert(ra != R::rows && rb != R::cols,
                    "weft::matmul: A and B are both Shard over this axis, and one of them shards a dimension of the "
                    "result (A's rows, Shard<0> for a matrix, or B's columns, Shard<1>): no rank holds a whole block "
                    "of the product. Redistribute the other operand to Replicate (all-gather).");
      static_assert(!(ra == R::contraction && rb != R::contraction),
                    "weft::matmul: A is Shard over its contraction dimension (Shard<1> for a matrix) but B is not "
                    "split the same way. Redistribute B to Shard over its contraction dimension (Shard<0> for a "
                    "matrix: all-to-all); the product is then Partial<Sum>.");
      static_assert(!(rb == R::contraction && ra != R::contraction),
                    "weft::matmul: B is Shard over its contraction dimension (Shard<0> for a matrix) but A is not "
                    "split the same way. Redistribute A to Shard over its contraction dimension (Shard<1> for a "
                    "matrix: all-to-all); the product is then Partial<Sum>.");
      static_assert(!(ra == R::batch || rb == R::batch) || da == db,
                    "weft::matmul: A and B must shard the same batch dimension. Redistribute one to the other's "
                    "Shard<D> (all-to-all).");
    }
    return 0;
  }
  static_assert(check() == 0);

  template <class X = void>
  static auto pick() {
    if constexpr (is_replicate_v<PA> && is_replicate_v<PB>) return Replicate{};
    else if constexpr (is_partial_v<PA> && is_replicate_v<PB>) return PA{};
    else if constexpr (is_replicate_v<PA> && is_partial_v<PB>) return PB{};
    else if constexpr (ra == R::rows && is_replicate_v<PB>) return Shard<Rank - 2>{};
    else if constexpr (is_replicate_v<PA> && rb == R::cols) return Shard<Rank - 1>{};
    else if constexpr (ra == R::contraction && rb == R::contraction) return Partial<Sum>{};
    else if constexpr (ra == R::batch && rb == R::batch && da == db) return Shard<da>{};
    else return Replicate{};  // unreachable past the checks; keeps later errors quiet
  }

 public:
  /// The result's placement.
  using type = decltype(pick());
};

/// The placement of A x B over one axis (see matmul_placement).
template <class PA, class PB, std::size_t Rank = 2>
using matmul_placement_t = typename matmul_placement<PA, PB, Rank>::type;

// ----------------------------------------------------------- element-wise

/// Element-wise operation kinds, as far as placements care.
/// Additive: a + b, a - b (sums of partial values stay partial).
struct Additive {};
/// Multiplicative: a * b, and scaling by a constant (linear in each operand).
struct Multiplicative {};
/// Anything else: exp, max, division by a tensor, activations.
struct Nonlinear {};

namespace detail {
template <class K>
inline constexpr bool elementwise_kind_v =
    std::is_same_v<K, Additive> || std::is_same_v<K, Multiplicative> || std::is_same_v<K, Nonlinear>;
}  // namespace detail

/// The placement over one axis of a binary element-wise operation of kind
/// Kind (Additive, Multiplicative, Nonlinear) on operands of equal shape:
///   equal Shard<D> or Replicate placements   -> the same
///   Partial<Op> + Partial<Op>, Op linear     -> Partial<Op>   (Additive)
///   Partial<Op> * Replicate (either order)   -> Partial<Op>   (Multiplicative, Op linear)
/// Anything else is a compile error that says which redistribute fixes it.
template <class Kind, class PA, class PB>
struct elementwise_placement {
  static_assert(detail::elementwise_kind_v<Kind>,
                "weft::elementwise_placement<Kind, A, B>: Kind must be weft::Additive, weft::Multiplicative or "
                "weft::Nonlinear");
  static_assert(Placement<PA> && Placement<PB>,
                "weft::elementwise_placement: both operands' placements must be Shard<D>, Replicate or Partial<Op>");

 private:
  static constexpr int check() {
    if constexpr (is_shard_v<PA> && is_shard_v<PB>) {
      static_assert(std::is_same_v<PA, PB>,
                    "weft::elementwise: A and B are Shard over different dimensions. Redistribute B to A's Shard<D> "
                    "(all-to-all), or both to Replicate (all-gather).");
    } else if constexpr ((is_shard_v<PA> && is_replicate_v<PB>) || (is_replicate_v<PA> && is_shard_v<PB>)) {
      static_assert(!std::is_same_v<PA, PA>,
                    "weft::elementwise: one operand is Shard<D> and the other Replicate; element-wise operands must "
                    "have the same placement. Redistribute the Replicate operand to the same Shard<D> (a local "
                    "slice, no communication), or the Shard operand to Replicate (all-gather).");
    } else if constexpr ((is_partial_v<PA> && is_shard_v<PB>) || (is_shard_v<PA> && is_partial_v<PB>)) {
      static_assert(!std::is_same_v<PA, PA>,
                    "weft::elementwise: one operand is Partial and the other Shard<D>. Redistribute the Partial "
                    "operand to the same Shard<D> (reduce-scatter) first.");
    } else if constexpr (is_partial_v<PA> || is_partial_v<PB>) {
      if constexpr (std::is_same_v<Kind, Nonlinear>) {
        static_assert(!std::is_same_v<PA, PA>,
                      "weft::elementwise: a non-linear operation on a Partial operand would apply to the partial "
                      "values, not to their reduction. Redistribute the Partial operand to Replicate (all-reduce) or "
                      "to Shard<D> (reduce-scatter) first.");
      } else if constexpr (is_partial_v<PA> && is_partial_v<PB>) {
        static_assert(std::is_same_v<PA, PB>,
                      "weft::elementwise: A and B are Partial with different reductions. Redistribute one to "
                      "Replicate (all-reduce) first.");
        static_assert(std::is_same_v<Kind, Additive>,
                      "weft::elementwise: the product of two Partial operands is not the partial of a product. "
                      "Redistribute one operand to Replicate (all-reduce) first.");
        static_assert(detail::linear_partial<PA>(),
                      "weft::elementwise: Partial<Max> or Partial<Min> operands cannot be added: the maximum of sums "
                      "is not the sum of maxima. Redistribute them to Replicate (all-reduce) first.");
      } else {
        static_assert(!std::is_same_v<Kind, Additive>,
                      "weft::elementwise: adding a Replicate operand to a Partial one adds it once per rank. "
                      "Redistribute the Partial operand to Replicate (all-reduce) first, or add the Replicate operand "
                      "on one rank only.");
        static_assert(detail::linear_partial<PA>() || detail::linear_partial<PB>(),
                      "weft::elementwise: scaling Partial<Max> or Partial<Min> values is not linear (negative "
                      "factors swap max and min). Redistribute the Partial operand to Replicate (all-reduce) first.");
      }
    }
    return 0;
  }
  static_assert(check() == 0);

  template <class X = void>
  static auto pick() {
    if constexpr (is_partial_v<PA>) return PA{};
    else if constexpr (is_partial_v<PB>) return PB{};
    else return PA{};
  }

 public:
  /// The result's placement.
  using type = decltype(pick());
};

/// The placement of a binary element-wise operation over one axis.
template <class Kind, class PA, class PB>
using elementwise_placement_t = typename elementwise_placement<Kind, PA, PB>::type;

/// The placement over one axis of a unary element-wise operation: Additive
/// and Multiplicative ones (negation, scaling by a constant) keep any
/// placement; a Nonlinear one needs the values complete (no Partial).
template <class Kind, class P>
struct unary_placement {
  static_assert(detail::elementwise_kind_v<Kind>,
                "weft::unary_placement<Kind, P>: Kind must be weft::Additive, weft::Multiplicative or weft::Nonlinear");
  static_assert(Placement<P>, "weft::unary_placement: the placement must be Shard<D>, Replicate or Partial<Op>");
  static_assert(!(std::is_same_v<Kind, Nonlinear> && is_partial_v<P>),
                "weft::elementwise: a non-linear operation on a Partial operand would apply to the partial values, "
                "not to their reduction. Redistribute it to Replicate (all-reduce) or to Shard<D> (reduce-scatter) "
                "first.");
  static_assert(!(!std::is_same_v<Kind, Nonlinear> && is_partial_v<P> && !detail::linear_partial<P>()),
                "weft::elementwise: scaling Partial<Max> or Partial<Min> values is not linear. Redistribute it to "
                "Replicate (all-reduce) first.");
  /// The result's placement.
  using type = P;
};

/// The placement of a unary element-wise operation over one axis.
template <class Kind, class P>
using unary_placement_t = typename unary_placement<Kind, P>::type;

namespace detail {
// The rules of elementwise_placement and unary_placement as predicates, with
// no static_assert, so that an operation can test them and say in its own
// words what is wrong (weft/placement/elementwise.hpp) before any result
// type is formed.
template <class Kind, class PA, class PB>
constexpr bool elementwise_valid() {
  if constexpr (is_partial_v<PA> || is_partial_v<PB>) {
    if constexpr (std::is_same_v<Kind, Nonlinear> || is_shard_v<PA> || is_shard_v<PB>) return false;
    else if constexpr (is_partial_v<PA> && is_partial_v<PB>)
      return std::is_same_v<PA, PB> && std::is_same_v<Kind, Additive> && linear_partial<PA>();
    else return !std::is_same_v<Kind, Additive> && (linear_partial<PA>() || linear_partial<PB>());
  } else {
    return std::is_same_v<PA, PB>;
  }
}
template <class Kind, class P>
constexpr bool unary_valid() {
  if constexpr (is_partial_v<P>) return !std::is_same_v<Kind, Nonlinear> && linear_partial<P>();
  else return true;
}

// The placement a bias along the last dimension of a rank-Rank tensor placed
// PX needs over the same axis (Replicate for Partial PX, which has no valid
// bias; see bias_placement).
template <class PX, std::size_t Rank>
constexpr auto bias_for() {
  if constexpr (is_shard_v<PX>) {
    if constexpr (PX::dim + 1 == Rank) return Shard<0>{};
    else return Replicate{};
  } else {
    return Replicate{};
  }
}
template <class PX, class PB, std::size_t Rank>
constexpr bool bias_valid() {
  return !is_partial_v<PX> && std::is_same_v<PB, decltype(bias_for<PX, Rank>())>;
}
}  // namespace detail

/// The placement over one axis that a bias b (a vector along the last
/// dimension) needs to be added to a rank-Rank tensor x placed PX, y(..., j)
/// = x(..., j) + b(j); y keeps PX:
///   Replicate, or Shard<D> over a leading dimension -> b Replicate (every rank holds every feature)
///   Shard<Rank-1> (the features split)             -> b Shard<0> (the same slice of the bias)
///   Partial<Op>                                    -> no bias: it would be added once per rank
/// A Partial PX is a compile error that says to reduce x first.
template <class PX, std::size_t Rank>
struct bias_placement {
  static_assert(Placement<PX>, "weft::bias_placement: the placement must be Shard<D>, Replicate or Partial<Op>");
  static_assert(!is_partial_v<PX>,
                "weft::bias_placement: a bias added to a Partial tensor is added once per rank of the axis, so the "
                "reduced sum holds it as many times as the axis has ranks. Redistribute the tensor to Replicate "
                "(all-reduce) or to Shard<D> (reduce-scatter) first.");
  /// The placement the bias needs.
  using type = decltype(detail::bias_for<PX, Rank>());
};

/// The placement over one axis that a bias of a rank-Rank tensor placed PX needs.
template <class PX, std::size_t Rank>
using bias_placement_t = typename bias_placement<PX, Rank>::type;

// --------------------------------------------------------------- reductions

/// The placement over one axis of a reduction with Op (Sum, Max, Min, Avg
/// for the mean) over dimension Dim:
///   Shard<Dim>        -> Partial<Op>   (each rank reduced its block)
///   Shard<D>, D < Dim -> Shard<D>;  D > Dim -> Shard<D - 1> (Shard<D> with KeepDim)
///   Replicate         -> Replicate
///   Partial<P>        -> Partial<P> when P and Op are both linear or P == Op
/// Anything else is a compile error that says which redistribute fixes it.
template <class P, std::size_t Dim, class Op, bool KeepDim = false>
struct reduction_placement {
  static_assert(Placement<P>, "weft::reduction_placement: the placement must be Shard<D>, Replicate or Partial<Op>");
  static_assert(ReduceTag<Op>, "weft::reduction_placement: Op must be weft::Sum, weft::Max, weft::Min or weft::Avg");

 private:
  static constexpr int check() {
    if constexpr (is_partial_v<P>) {
      static_assert((P::op::linear && Op::linear) || std::is_same_v<typename P::op, Op>,
                    "weft::reduction: reducing Partial values with another kind of reduction (e.g. a max over "
                    "partial sums) does not reduce the true values. Redistribute the operand to Replicate "
                    "(all-reduce) or to Shard<D> (reduce-scatter) first.");
    }
    return 0;
  }
  static_assert(check() == 0);

  template <class X = void>
  static auto pick() {
    if constexpr (is_shard_v<P>) {
      if constexpr (P::dim == Dim) return Partial<Op>{};
      else if constexpr (P::dim < Dim || KeepDim) return P{};
      else return Shard<P::dim - 1>{};
    } else {
      return P{};
    }
  }

 public:
  /// The result's placement.
  using type = decltype(pick());
};

/// The placement of a reduction over dimension Dim, over one axis.
template <class P, std::size_t Dim, class Op, bool KeepDim = false>
using reduction_placement_t = typename reduction_placement<P, Dim, Op, KeepDim>::type;

// ---------------------------------------------------- whole DistView types

namespace detail {
template <class... Lists>
struct concat;
template <>
struct concat<> {
  using type = type_list<>;
};
template <class... A>
struct concat<type_list<A...>> {
  using type = type_list<A...>;
};
template <class... A, class... B, class... Rest>
struct concat<type_list<A...>, type_list<B...>, Rest...> {
  using type = typename concat<type_list<A..., B...>, Rest...>::type;
};

// The On<>s of B whose axes A does not name.
template <class ListA, class ListB>
struct only_in_b;
template <class... A, class... B>
struct only_in_b<type_list<A...>, type_list<B...>> {
  using type = typename concat<
      std::conditional_t<axis_position<typename B::axis, A...>() == npos, type_list<B>, type_list<>>...>::type;
};

template <class DVA, class DVB>
struct binary_axes;
template <class T, class EA, class S, class... A, class U, class EB, class S2, class... B>
struct binary_axes<BasicDistView<T, EA, S, A...>, BasicDistView<U, EB, S2, B...>> {
  using a_list = type_list<A...>;
  using b_list = type_list<B...>;
  using b_only = typename only_in_b<a_list, b_list>::type;
};

template <class DVA, class DVB, class F, class AList, class BOnly>
struct combine;
template <class DVA, class DVB, class F, class... A, class... B>
struct combine<DVA, DVB, F, type_list<A...>, type_list<B...>> {
  using type = type_list<On<typename A::axis, typename F::template apply<typename A::placement,
                                                                         typename DVB::template placement_on<typename A::axis>>>...,
                         On<typename B::axis, typename F::template apply<Replicate, typename B::placement>>...>;
};

template <std::size_t Rank>
struct matmul_fn {
  template <class PA, class PB>
  using apply = matmul_placement_t<PA, PB, Rank>;
};
template <class Kind>
struct elementwise_fn {
  template <class PA, class PB>
  using apply = elementwise_placement_t<Kind, PA, PB>;
};

template <class DV, class Fn, class List>
struct map_unary;
template <class DV, class Fn, class... O>
struct map_unary<DV, Fn, type_list<O...>> {
  using type = type_list<On<typename O::axis, typename Fn::template apply<typename O::placement>>...>;
};
template <std::size_t Dim, class Op, bool KeepDim>
struct reduction_fn {
  template <class P>
  using apply = reduction_placement_t<P, Dim, Op, KeepDim>;
};
template <class Kind>
struct unary_fn {
  template <class P>
  using apply = unary_placement_t<Kind, P>;
};

template <class DVA, class DVB>
constexpr bool same_element_and_space() {
  return std::is_same_v<typename DVA::value_type, typename DVB::value_type> &&
         std::is_same_v<typename DVA::memory_space, typename DVB::memory_space>;
}
}  // namespace detail

/// The DistView type of A x B (see matmul_placement), over every axis either
/// operand names. Both must have the same rank, element type and memory space.
template <DistributedView DVA, DistributedView DVB>
struct matmul_result {
  static_assert(DVA::rank == DVB::rank && DVA::rank >= 2,
                "weft::matmul_result: A and B must have the same rank, 2 or more");
  static_assert(detail::same_element_and_space<DVA, DVB>(),
                "weft::matmul_result: A and B must have the same element type and memory space");
  /// The result DistView type.
  using type = with_placements_t<
      BasicDistView<typename DVA::value_type, dextents<DVA::rank>, typename DVA::memory_space>,
      typename detail::combine<DVA, DVB, detail::matmul_fn<DVA::rank>, typename DVA::placements,
                               typename detail::binary_axes<DVA, DVB>::b_only>::type>;
};
/// The DistView type of A x B.
template <DistributedView DVA, DistributedView DVB>
using matmul_result_t = typename matmul_result<DVA, DVB>::type;

/// The DistView type of a binary element-wise operation of kind Kind.
template <class Kind, DistributedView DVA, DistributedView DVB>
struct elementwise_result {
  static_assert(DVA::rank == DVB::rank, "weft::elementwise_result: A and B must have the same rank");
  static_assert(detail::same_element_and_space<DVA, DVB>(),
                "weft::elementwise_result: A and B must have the same element type and memory space");
  /// The result DistView type.
  using type = with_placements_t<
      DVA, typename detail::combine<DVA, DVB, detail::elementwise_fn<Kind>, typename DVA::placements,
                                    typename detail::binary_axes<DVA, DVB>::b_only>::type>;
};
/// The DistView type of a binary element-wise operation.
template <class Kind, DistributedView DVA, DistributedView DVB>
using elementwise_result_t = typename elementwise_result<Kind, DVA, DVB>::type;

/// The DistView type of a unary element-wise operation of kind Kind.
template <class Kind, DistributedView DV>
using unary_result_t =
    with_placements_t<DV, typename detail::map_unary<DV, detail::unary_fn<Kind>, typename DV::placements>::type>;

/// The DistView type of a reduction with Op over dimension Dim (rank - 1
/// dimensions, or the same rank with KeepDim).
template <DistributedView DV, std::size_t Dim, class Op, bool KeepDim = false>
struct reduction_result {
  static_assert(Dim < DV::rank, "weft::reduction_result: Dim must be a dimension of the tensor");
  static_assert(KeepDim || DV::rank >= 2,
                "weft::reduction_result: reducing the only dimension leaves rank 0; use KeepDim = true");
  /// The result DistView type.
  using type = with_placements_t<
      BasicDistView<typename DV::value_type, dextents<(KeepDim ? DV::rank : DV::rank - 1)>, typename DV::memory_space>,
      typename detail::map_unary<DV, detail::reduction_fn<Dim, Op, KeepDim>, typename DV::placements>::type>;
};
/// The DistView type of a reduction over dimension Dim.
template <DistributedView DV, std::size_t Dim, class Op, bool KeepDim = false>
using reduction_result_t = typename reduction_result<DV, Dim, Op, KeepDim>::type;

}  // namespace weft
